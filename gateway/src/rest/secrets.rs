//! REST adapters of a tenant's secrets.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;

use crate::api::secrets::{self, Secret, SecretDeleted, SecretInput, Secrets};
use crate::http::{Body, Ctx, Path, ok};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(put, path = "/v1/secrets/{name}", tag = "secrets", params(("name" = String, Path)),
    request_body = SecretInput,
    responses((status = 200, description = "The stored secret, by name (its value is never shown)", body = Secret)))]
pub async fn put_secret(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(name): Path<String>,
    Body(input): Body<SecretInput>,
) -> Response {
    ok(&ctx, secrets::set(&state.peers, &ctx, name, input).await)
}

#[utoipa::path(get, path = "/v1/secrets", tag = "secrets",
    responses((status = 200, description = "The tenant's secrets, by name", body = Secrets)))]
pub async fn list_secrets(State(state): St, Ctx(ctx): Ctx) -> Response {
    ok(&ctx, secrets::list(&state.peers, &ctx).await)
}

#[utoipa::path(delete, path = "/v1/secrets/{name}", tag = "secrets", params(("name" = String, Path)),
    responses((status = 200, description = "The secret was removed", body = SecretDeleted)))]
pub async fn delete_secret(State(state): St, Ctx(ctx): Ctx, Path(name): Path<String>) -> Response {
    ok(&ctx, secrets::delete(&state.peers, &ctx, name).await)
}
