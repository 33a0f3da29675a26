//! REST adapters of the configuration center.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;

use crate::api::JsonObject;
use crate::api::settings::{self, Config, ConfigScope, KeyValue};
use crate::http::{Body, Ctx, Path, Query, ok};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(get, path = "/v1/config", tag = "config", params(ConfigScope),
    responses((status = 200, description = "The effective configuration, each value with its source", body = Config)))]
pub async fn get_config(State(state): St, Ctx(ctx): Ctx, Query(scope): Query<ConfigScope>) -> Response {
    ok(&ctx, settings::get(&state.peers, &ctx, scope).await)
}

#[utoipa::path(get, path = "/v1/config/{key}", tag = "config", params(("key" = String, Path), ConfigScope),
    responses((status = 200, description = "One key", body = KeyValue)))]
pub async fn get_config_key(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(key): Path<String>,
    Query(scope): Query<ConfigScope>,
) -> Response {
    ok(&ctx, settings::get_key(&state.peers, &ctx, key, scope).await)
}

/// Sets keys from a flat (`{"llm.model": …}`) or nested (`{"llm": {"model": …}}`)
/// object; `null` removes an override, and a secret's redacted form keeps it.
#[utoipa::path(put, path = "/v1/config", tag = "config", params(ConfigScope), request_body = Object,
    responses((status = 200, description = "The configuration after the change", body = Config)))]
pub async fn put_config(
    State(state): St,
    Ctx(ctx): Ctx,
    Query(scope): Query<ConfigScope>,
    Body(values): Body<JsonObject>,
) -> Response {
    ok(&ctx, settings::update(&state.peers, &ctx, scope, values).await)
}
