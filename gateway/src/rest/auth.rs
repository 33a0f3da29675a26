//! REST adapters of tenants, users, API keys, token exchange, the
//! verification keys and the caller's identity.

use std::sync::Arc;

use avm_common::Code;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::api::auth::{
    self, AccessToken, ApiKey, Caller, KeyCreated, KeyFilter, KeyList, NewKey, NewTenant, NewUser, Quota, QuotaQuery,
    Rotated, Tenant, TenantCreated, TenantDeleted, TenantList, TenantUpdate, TokenRequest, User, UserDeleted, UserList,
};
use crate::http::{
    Body, ClientAddr, Ctx, Path, Query, RequestId, bearer_credential, error_response, ok, rate_limited, reply,
    with_request_id,
};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(post, path = "/v1/tenants", tag = "tenants", request_body = NewTenant,
    responses((status = 201, description = "The tenant, its first admin and the admin's key (shown once)", body = TenantCreated)))]
pub async fn create_tenant(State(state): St, Ctx(ctx): Ctx, Body(request): Body<NewTenant>) -> Response {
    reply(
        &ctx,
        StatusCode::CREATED,
        auth::create_tenant(&state.peers, &ctx, request).await,
    )
}

#[utoipa::path(get, path = "/v1/tenants", tag = "tenants",
    responses((status = 200, description = "Every tenant (operators)", body = TenantList)))]
pub async fn list_tenants(State(state): St, Ctx(ctx): Ctx) -> Response {
    ok(&ctx, auth::list_tenants(&state.peers, &ctx).await)
}

#[utoipa::path(get, path = "/v1/tenants/{id}", tag = "tenants", params(("id" = String, Path)),
    responses((status = 200, description = "The tenant", body = Tenant)))]
pub async fn get_tenant(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, auth::get_tenant(&state.peers, &ctx, id).await)
}

#[utoipa::path(patch, path = "/v1/tenants/{id}", tag = "tenants", params(("id" = String, Path)),
    request_body = TenantUpdate, responses((status = 200, description = "The changed tenant", body = Tenant)))]
pub async fn update_tenant(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Body(update): Body<TenantUpdate>,
) -> Response {
    ok(&ctx, auth::update_tenant(&state.peers, &ctx, id, update).await)
}

#[utoipa::path(delete, path = "/v1/tenants/{id}", tag = "tenants", params(("id" = String, Path)),
    responses((status = 200, description = "Deleted with its users and keys", body = TenantDeleted)))]
pub async fn delete_tenant(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, auth::delete_tenant(&state.peers, &ctx, id).await)
}

#[utoipa::path(post, path = "/v1/tenants/{id}/users", tag = "tenants", params(("id" = String, Path)),
    request_body = NewUser, responses((status = 201, description = "The new user", body = User)))]
pub async fn create_user(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(tenant_id): Path<String>,
    Body(request): Body<NewUser>,
) -> Response {
    reply(
        &ctx,
        StatusCode::CREATED,
        auth::create_user(&state.peers, &ctx, tenant_id, request).await,
    )
}

#[utoipa::path(get, path = "/v1/tenants/{id}/users", tag = "tenants", params(("id" = String, Path)),
    responses((status = 200, description = "The tenant's users", body = UserList)))]
pub async fn list_users(State(state): St, Ctx(ctx): Ctx, Path(tenant_id): Path<String>) -> Response {
    ok(&ctx, auth::list_users(&state.peers, &ctx, tenant_id).await)
}

#[utoipa::path(get, path = "/v1/tenants/{id}/users/{user}", tag = "tenants",
    params(("id" = String, Path), ("user" = String, Path)),
    responses((status = 200, description = "The user", body = User)))]
pub async fn get_user(State(state): St, Ctx(ctx): Ctx, Path((tenant_id, user_id)): Path<(String, String)>) -> Response {
    ok(&ctx, auth::get_user(&state.peers, &ctx, tenant_id, user_id).await)
}

#[utoipa::path(delete, path = "/v1/tenants/{id}/users/{user}", tag = "tenants",
    params(("id" = String, Path), ("user" = String, Path)),
    responses((status = 200, description = "Deleted; its keys stop working", body = UserDeleted)))]
pub async fn delete_user(
    State(state): St,
    Ctx(ctx): Ctx,
    Path((tenant_id, user_id)): Path<(String, String)>,
) -> Response {
    ok(&ctx, auth::delete_user(&state.peers, &ctx, tenant_id, user_id).await)
}

#[utoipa::path(post, path = "/v1/auth/keys", tag = "keys", request_body = NewKey,
    responses((status = 201, description = "The key and its secret (shown once)", body = KeyCreated)))]
pub async fn create_api_key(State(state): St, Ctx(ctx): Ctx, Body(request): Body<NewKey>) -> Response {
    reply(
        &ctx,
        StatusCode::CREATED,
        auth::create_key(&state.peers, &ctx, request).await,
    )
}

#[utoipa::path(get, path = "/v1/auth/keys", tag = "keys", params(KeyFilter),
    responses((status = 200, description = "API keys", body = KeyList)))]
pub async fn list_api_keys(State(state): St, Ctx(ctx): Ctx, Query(filter): Query<KeyFilter>) -> Response {
    ok(&ctx, auth::list_keys(&state.peers, &ctx, filter).await)
}

#[utoipa::path(get, path = "/v1/auth/keys/{id}", tag = "keys", params(("id" = String, Path)),
    responses((status = 200, description = "The key", body = ApiKey)))]
pub async fn get_api_key(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, auth::get_key(&state.peers, &ctx, id).await)
}

#[utoipa::path(delete, path = "/v1/auth/keys/{id}", tag = "keys", params(("id" = String, Path)),
    responses((status = 200, description = "Revoked; refused everywhere within a second", body = ApiKey)))]
pub async fn revoke_api_key(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, auth::revoke_key(&state.peers, &ctx, id).await)
}

/// Exchanges an API key (body `apiKey`, or the `Authorization` header) or a
/// token of the configured OIDC issuer (`subjectToken`) for an access token.
/// A client whose exchanges failed `[gateway] failed_token_exchanges_per_minute`
/// times in a burst gets 429 `RATE_LIMITED` with `Retry-After` until it slows down.
#[utoipa::path(post, path = "/v1/auth/token", tag = "keys", request_body = TokenRequest, security(()),
    responses((status = 200, description = "A short-lived access token", body = AccessToken)))]
pub async fn exchange_token(
    State(state): St,
    RequestId(request_id): RequestId,
    ClientAddr(client): ClientAddr,
    headers: HeaderMap,
    Body(request): Body<TokenRequest>,
) -> Response {
    // A client past its burst of failures is refused before its credential
    // is looked at: a right guess would answer the same 429 as a wrong one.
    let per_minute = state.config.failed_token_exchanges_per_minute;
    if let Some(client) = client
        && let Err(wait) = state.limiter.check_failures(client, per_minute).await
    {
        return rate_limited(wait, &request_id);
    }
    let header_key = match bearer_credential(&headers) {
        Ok(key) => key,
        Err(err) if request.api_key.is_none() && request.subject_token.is_none() => {
            if let Some(client) = client {
                state.limiter.record_failure(client, per_minute).await;
            }
            return error_response(&err, &request_id);
        }
        Err(_) => None,
    };
    let exchanged = auth::exchange_token(&state.peers, request, header_key).await;
    if let (Err(err), Some(client)) = (&exchanged, client)
        && err.code == Code::Unauthenticated
    {
        state.limiter.record_failure(client, per_minute).await;
    }
    match exchanged {
        Ok(token) => {
            let mut response = with_request_id((StatusCode::OK, axum::Json(token)).into_response(), &request_id);
            // A token is a credential: no cache may keep it.
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            response
        }
        Err(err) => error_response(&err, &request_id),
    }
}

#[utoipa::path(get, path = "/v1/auth/jwks.json", tag = "keys", security(()),
    responses((status = 200, description = "The keys access tokens are verified with (JWKS)", body = Object)))]
pub async fn jwks(State(state): St, RequestId(request_id): RequestId) -> Response {
    match auth::jwks(&state.peers).await {
        Ok(body) => with_request_id(axum::Json(body).into_response(), &request_id),
        Err(err) => error_response(&err, &request_id),
    }
}

#[utoipa::path(get, path = "/v1/auth/whoami", tag = "keys",
    responses((status = 200, description = "Who the credential in use is", body = Caller)))]
pub async fn whoami(Ctx(ctx): Ctx) -> Response {
    ok(&ctx, Ok(auth::whoami(&ctx)))
}

#[utoipa::path(get, path = "/v1/auth/quota", tag = "keys", params(QuotaQuery),
    responses((status = 200, description = "The tenant's token use this month and its quota", body = Quota)))]
pub async fn get_quota(State(state): St, Ctx(ctx): Ctx, Query(query): Query<QuotaQuery>) -> Response {
    ok(&ctx, auth::quota(&state.peers, &ctx, query).await)
}

#[utoipa::path(post, path = "/v1/auth/signing-keys/rotate", tag = "keys",
    responses((status = 200, description = "The new signing key (operators)", body = Rotated)))]
pub async fn rotate_signing_key(State(state): St, Ctx(ctx): Ctx) -> Response {
    ok(&ctx, auth::rotate_signing_key(&state.peers, &ctx).await)
}
