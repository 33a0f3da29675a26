//! REST adapters of MCP servers' credentials.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;

use crate::api::credentials::{
    self, Credential, CredentialDeleted, CredentialInput, CredentialScopeQuery, Credentials,
};
use crate::http::{Body, Ctx, Path, Query, ok};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(put, path = "/v1/credentials/{server}", tag = "credentials", params(("server" = String, Path)),
    request_body = CredentialInput,
    responses((status = 200, description = "The stored credential, by header name (values are never shown)", body = Credential)))]
pub async fn put_credential(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(server): Path<String>,
    Body(input): Body<CredentialInput>,
) -> Response {
    ok(&ctx, credentials::set(&state.peers, &ctx, server, input).await)
}

#[utoipa::path(get, path = "/v1/credentials", tag = "credentials",
    responses((status = 200, description = "The caller's credentials, then its tenant's", body = Credentials)))]
pub async fn list_credentials(State(state): St, Ctx(ctx): Ctx) -> Response {
    ok(&ctx, credentials::list(&state.peers, &ctx).await)
}

#[utoipa::path(delete, path = "/v1/credentials/{server}", tag = "credentials",
    params(("server" = String, Path), CredentialScopeQuery),
    responses((status = 200, description = "The credential was removed", body = CredentialDeleted)))]
pub async fn delete_credential(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(server): Path<String>,
    Query(query): Query<CredentialScopeQuery>,
) -> Response {
    ok(&ctx, credentials::delete(&state.peers, &ctx, server, query).await)
}
