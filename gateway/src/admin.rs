//! The REST face of the auth service: tenants and their users, API keys,
//! token exchange, the verification keys and the caller's identity.

use std::sync::Arc;

use avm_common::ApiError;
use avm_common::auth::Scopes;
use avm_proto::auth::v1 as pb;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::GatewayState;
use crate::rest::{Ctx, RequestId, bearer_credential, error_response, json_body, reply, with_request_id};
use crate::ws::{opt_str, req_str};

type AppState = State<Arc<GatewayState>>;

/// Returns the auth routes.
pub fn routes() -> Router<Arc<GatewayState>> {
    Router::new()
        .route("/v1/tenants", post(create_tenant).get(list_tenants))
        .route(
            "/v1/tenants/{id}",
            get(get_tenant).patch(update_tenant).delete(delete_tenant),
        )
        .route("/v1/tenants/{id}/users", post(create_user).get(list_users))
        .route("/v1/tenants/{id}/users/{user}", get(get_user).delete(delete_user))
        .route("/v1/auth/keys", post(create_key).get(list_keys))
        .route("/v1/auth/keys/{id}", get(get_key).delete(revoke_key))
        .route("/v1/auth/token", post(exchange_token))
        .route("/v1/auth/jwks.json", get(jwks))
        .route("/v1/auth/whoami", get(whoami))
        .route("/v1/auth/signing-keys/rotate", post(rotate_signing_key))
}

fn limits_json(limits: Option<&pb::Limits>) -> Value {
    let limits = limits.cloned().unwrap_or_default();
    json!({"requestsPerMinute": limits.requests_per_minute, "tokensPerMonth": limits.tokens_per_month})
}

fn tenant_json(tenant: &pb::Tenant) -> Value {
    json!({
        "tenantId": tenant.tenant_id,
        "name": tenant.name,
        "operator": tenant.operator,
        "limits": limits_json(tenant.limits.as_ref()),
        "createdAt": tenant.created_at_ms,
        "updatedAt": tenant.updated_at_ms,
    })
}

fn role_name(role: i32) -> &'static str {
    match pb::Role::try_from(role) {
        Ok(pb::Role::Admin) => "admin",
        Ok(pb::Role::Member) => "member",
        Ok(pb::Role::Service) => "service",
        _ => "unknown",
    }
}

fn user_json(user: &pb::User) -> Value {
    json!({
        "userId": user.user_id,
        "tenantId": user.tenant_id,
        "name": user.name,
        "role": role_name(user.role),
        "createdAt": user.created_at_ms,
    })
}

fn key_json(key: &pb::ApiKey) -> Value {
    let mut value = json!({
        "keyId": key.key_id,
        "tenantId": key.tenant_id,
        "userId": key.user_id,
        "name": key.name,
        "prefix": key.prefix,
        "scopes": key.scopes,
        "limits": limits_json(key.limits.as_ref()),
        "createdAt": key.created_at_ms,
    });
    if let Some(at) = key.expires_at_ms {
        value["expiresAt"] = json!(at);
    }
    if let Some(at) = key.revoked_at_ms {
        value["revokedAt"] = json!(at);
    }
    value
}

fn caller_json(caller: &avm_common::auth::Principal) -> Value {
    json!({
        "tenantId": caller.tenant_id,
        "userId": caller.user_id,
        "role": caller.role.as_str(),
        "operator": caller.operator,
        "keyId": caller.key_id,
        "scopes": caller.scopes.names(),
        "limits": {
            "tenant": {"requestsPerMinute": caller.tenant_limits.requests_per_minute, "tokensPerMonth": caller.tenant_limits.tokens_per_month},
            "key": {"requestsPerMinute": caller.key_limits.requests_per_minute, "tokensPerMonth": caller.key_limits.tokens_per_month},
        },
    })
}

/// Reads an optional `limits` object of the REST form.
fn limits_field(body: &Value) -> Result<Option<pb::Limits>, ApiError> {
    let limits = match body.get("limits") {
        None | Some(Value::Null) => return Ok(None),
        Some(limits @ Value::Object(_)) => limits,
        Some(_) => return Err(ApiError::invalid("INVALID_FIELD", "limits must be an object")),
    };
    let number = |field: &str| -> Result<u64, ApiError> {
        match limits.get(field) {
            None | Some(Value::Null) => Ok(0),
            Some(value) => value.as_u64().ok_or_else(|| {
                ApiError::invalid(
                    "INVALID_FIELD",
                    format!("limits.{field} must be a non-negative integer"),
                )
            }),
        }
    };
    let per_minute = u32::try_from(number("requestsPerMinute")?)
        .map_err(|_| ApiError::invalid("INVALID_FIELD", "limits.requestsPerMinute is too large"))?;
    Ok(Some(pb::Limits {
        requests_per_minute: per_minute,
        tokens_per_month: number("tokensPerMonth")?,
    }))
}

fn role_field(body: &Value) -> Result<pb::Role, ApiError> {
    match opt_str(body, "role")?.as_deref() {
        None | Some("member") => Ok(pb::Role::Member),
        Some("admin") => Ok(pb::Role::Admin),
        Some(other) => Err(ApiError::invalid(
            "INVALID_ROLE",
            format!("unknown role {other:?}; roles are admin and member"),
        )),
    }
}

async fn create_tenant(State(state): AppState, Ctx(ctx): Ctx, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = json_body(body)?;
        let request = pb::CreateTenantRequest {
            name: req_str(&body, "name")?,
            limits: limits_field(&body)?,
            admin_name: opt_str(&body, "adminName")?.unwrap_or_default(),
        };
        let created = state
            .auth
            .client()
            .create_tenant(ctx.request(request))
            .await?
            .into_inner();
        Ok(json!({
            "tenant": created.tenant.as_ref().map(tenant_json),
            "admin": created.admin.as_ref().map(user_json),
            "key": created.api_key.as_ref().map(key_json),
            "secret": created.secret,
        }))
    }
    .await;
    reply(&ctx, StatusCode::CREATED, result)
}

async fn list_tenants(State(state): AppState, Ctx(ctx): Ctx) -> Response {
    let result = async {
        let request = ctx.request(pb::ListTenantsRequest {});
        let tenants = state.auth.client().list_tenants(request).await?.into_inner().tenants;
        Ok(json!({"tenants": tenants.iter().map(tenant_json).collect::<Vec<_>>()}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn get_tenant(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = async {
        let request = ctx.request(pb::GetTenantRequest { tenant_id: id });
        let tenant = state.auth.client().get_tenant(request).await?.into_inner().tenant;
        Ok(tenant.as_ref().map(tenant_json).unwrap_or(Value::Null))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn update_tenant(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = json_body(body)?;
        let request = pb::UpdateTenantRequest {
            tenant_id: id,
            name: opt_str(&body, "name")?,
            limits: limits_field(&body)?,
        };
        let tenant = state
            .auth
            .client()
            .update_tenant(ctx.request(request))
            .await?
            .into_inner()
            .tenant;
        Ok(tenant.as_ref().map(tenant_json).unwrap_or(Value::Null))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn delete_tenant(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = async {
        let request = ctx.request(pb::DeleteTenantRequest { tenant_id: id.clone() });
        state.auth.client().delete_tenant(request).await?;
        Ok(json!({"tenantId": id, "deleted": true}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn create_user(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(tenant_id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = json_body(body)?;
        let request = pb::CreateUserRequest {
            tenant_id,
            name: req_str(&body, "name")?,
            role: role_field(&body)? as i32,
        };
        let user = state
            .auth
            .client()
            .create_user(ctx.request(request))
            .await?
            .into_inner()
            .user;
        Ok(user.as_ref().map(user_json).unwrap_or(Value::Null))
    }
    .await;
    reply(&ctx, StatusCode::CREATED, result)
}

async fn list_users(State(state): AppState, Ctx(ctx): Ctx, Path(tenant_id): Path<String>) -> Response {
    let result = async {
        let request = ctx.request(pb::ListUsersRequest { tenant_id });
        let users = state.auth.client().list_users(request).await?.into_inner().users;
        Ok(json!({"users": users.iter().map(user_json).collect::<Vec<_>>()}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// Returns a user, answering NOT_FOUND when it is not of the tenant in the path.
async fn tenant_user(
    state: &GatewayState,
    ctx: &avm_common::RequestContext,
    tenant_id: &str,
    user_id: &str,
) -> Result<pb::User, ApiError> {
    let request = ctx.request(pb::GetUserRequest {
        user_id: user_id.to_owned(),
    });
    let user = state.auth.client().get_user(request).await?.into_inner().user;
    match user {
        Some(user) if user.tenant_id == tenant_id => Ok(user),
        _ => Err(ApiError::not_found(
            "USER_NOT_FOUND",
            format!("user {user_id} not found"),
        )),
    }
}

async fn get_user(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path((tenant_id, user_id)): Path<(String, String)>,
) -> Response {
    let result = tenant_user(&state, &ctx, &tenant_id, &user_id)
        .await
        .map(|user| user_json(&user));
    reply(&ctx, StatusCode::OK, result)
}

async fn delete_user(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path((tenant_id, user_id)): Path<(String, String)>,
) -> Response {
    let result = async {
        tenant_user(&state, &ctx, &tenant_id, &user_id).await?;
        let request = ctx.request(pb::DeleteUserRequest {
            user_id: user_id.clone(),
        });
        state.auth.client().delete_user(request).await?;
        Ok(json!({"userId": user_id, "deleted": true}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn create_key(State(state): AppState, Ctx(ctx): Ctx, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = json_body(body)?;
        let scopes = match body.get("scopes") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| {
                    item.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| ApiError::invalid("INVALID_FIELD", "scopes must be a list of strings"))
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => return Err(ApiError::invalid("INVALID_FIELD", "scopes must be a list of strings")),
        };
        // Refused here too, so the error names the field the caller wrote.
        Scopes::parse(&scopes)?;
        let expires_at_ms = match (body.get("expiresAt"), opt_str(&body, "expiresIn")?) {
            (Some(Value::Number(at)), None) => Some(
                at.as_i64()
                    .ok_or_else(|| ApiError::invalid("INVALID_FIELD", "expiresAt must be a time in ms"))?,
            ),
            (None | Some(Value::Null), Some(within)) => {
                let within = humantime::parse_duration(&within).map_err(|_| {
                    ApiError::invalid(
                        "INVALID_FIELD",
                        "expiresIn must be a duration such as \"30d\" or \"12h\"",
                    )
                })?;
                let within = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
                Some(avm_common::now_ms().saturating_add(within))
            }
            (None | Some(Value::Null), None) => None,
            _ => {
                return Err(ApiError::invalid(
                    "INVALID_FIELD",
                    "give either expiresAt (ms) or expiresIn (duration), not both",
                ));
            }
        };
        let request = pb::CreateApiKeyRequest {
            user_id: opt_str(&body, "userId")?.unwrap_or_default(),
            name: opt_str(&body, "name")?.unwrap_or_default(),
            scopes,
            expires_at_ms,
            limits: limits_field(&body)?,
        };
        let created = state
            .auth
            .client()
            .create_api_key(ctx.request(request))
            .await?
            .into_inner();
        Ok(json!({"key": created.api_key.as_ref().map(key_json), "secret": created.secret}))
    }
    .await;
    reply(&ctx, StatusCode::CREATED, result)
}

/// Query of `GET /v1/auth/keys`.
#[derive(Debug, Deserialize)]
struct KeysQuery {
    #[serde(rename = "userId")]
    user_id: Option<String>,
}

async fn list_keys(
    State(state): AppState,
    Ctx(ctx): Ctx,
    query: Result<Query<KeysQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let result = async {
        let query = crate::rest::query_fields(query)?;
        let request = ctx.request(pb::ListApiKeysRequest { user_id: query.user_id });
        let keys = state.auth.client().list_api_keys(request).await?.into_inner().api_keys;
        Ok(json!({"keys": keys.iter().map(key_json).collect::<Vec<_>>()}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn get_key(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = async {
        let request = ctx.request(pb::GetApiKeyRequest { key_id: id });
        let key = state.auth.client().get_api_key(request).await?.into_inner().api_key;
        Ok(key.as_ref().map(key_json).unwrap_or(Value::Null))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn revoke_key(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = async {
        let request = ctx.request(pb::RevokeApiKeyRequest { key_id: id });
        let key = state.auth.client().revoke_api_key(request).await?.into_inner().api_key;
        Ok(key.as_ref().map(key_json).unwrap_or(Value::Null))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// `POST /v1/auth/token`: exchanges an API key (body `apiKey` or the
/// `Authorization` header) or an external token (`subjectToken`) for an
/// access token.
async fn exchange_token(
    State(state): AppState,
    RequestId(request_id): RequestId,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = json_body(body)?;
        let (expires_at_ms, token) = match (opt_str(&body, "apiKey")?, opt_str(&body, "subjectToken")?) {
            (Some(api_key), None) => exchange_key(&state, api_key).await?,
            (None, Some(subject_token)) => {
                let request = pb::ExchangeExternalTokenRequest { subject_token };
                let response = state.auth.client().exchange_external_token(request).await?.into_inner();
                (response.expires_at_ms, response.access_token)
            }
            (None, None) => match bearer_credential(&headers)? {
                Some(api_key) => exchange_key(&state, api_key.to_owned()).await?,
                None => return Err(avm_common::auth::missing_credentials()),
            },
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "INVALID_FIELD",
                    "give either apiKey or subjectToken, not both",
                ));
            }
        };
        let expires_in = (expires_at_ms - avm_common::now_ms()).max(0) / 1000;
        Ok(json!({"accessToken": token, "tokenType": "Bearer", "expiresIn": expires_in, "expiresAt": expires_at_ms}))
    }
    .await;
    match result {
        Ok(body) => {
            let mut response = with_request_id((StatusCode::OK, axum::Json(body)).into_response(), &request_id);
            // A token is a credential: no cache may keep it.
            response.headers_mut().insert(
                axum::http::header::CACHE_CONTROL,
                axum::http::HeaderValue::from_static("no-store"),
            );
            response
        }
        Err(err) => error_response(&err, &request_id),
    }
}

async fn exchange_key(state: &GatewayState, api_key: String) -> Result<(i64, String), ApiError> {
    let request = pb::ExchangeApiKeyRequest { api_key };
    let response = state.auth.client().exchange_api_key(request).await?.into_inner();
    Ok((response.expires_at_ms, response.access_token))
}

async fn jwks(State(state): AppState, RequestId(request_id): RequestId) -> Response {
    let result = async {
        let response = state.auth.client().get_jwks(pb::GetJwksRequest {}).await?.into_inner();
        serde_json::from_str::<Value>(&response.jwks_json)
            .map_err(|err| ApiError::internal(format!("auth service sent an unreadable jwks: {err}")))
    }
    .await;
    match result {
        Ok(body) => with_request_id(axum::Json(body).into_response(), &request_id),
        Err(err) => error_response(&err, &request_id),
    }
}

async fn whoami(Ctx(ctx): Ctx) -> Response {
    reply(&ctx, StatusCode::OK, Ok(caller_json(&ctx.principal)))
}

async fn rotate_signing_key(State(state): AppState, Ctx(ctx): Ctx) -> Response {
    let result = async {
        let request = ctx.request(pb::RotateSigningKeyRequest {});
        let kid = state.auth.client().rotate_signing_key(request).await?.into_inner().kid;
        Ok(json!({"kid": kid}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}
