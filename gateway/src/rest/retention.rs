//! REST adapters of retention.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;

use crate::api::retention::{self, RetentionPolicy, RetentionPolicyUpdate, SweepQuery, SweepResult};
use crate::http::{Body, Ctx, Query, ok};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(get, path = "/v1/retention", tag = "retention",
    responses((status = 200, description = "The tenant's retention policy; null fields set no limit",
        body = RetentionPolicy)))]
pub async fn get_retention(State(state): St, Ctx(ctx): Ctx) -> Response {
    ok(&ctx, retention::get(&state.peers, &ctx).await)
}

/// Replaces the whole policy (the tenant's admins); a field out of its
/// bounds is `INVALID_RETENTION_POLICY` and nothing is written.
#[utoipa::path(put, path = "/v1/retention", tag = "retention", request_body = RetentionPolicyUpdate,
    responses((status = 200, description = "The policy as stored", body = RetentionPolicy)))]
pub async fn put_retention(State(state): St, Ctx(ctx): Ctx, Body(update): Body<RetentionPolicyUpdate>) -> Response {
    ok(&ctx, retention::set(&state.peers, &ctx, update).await)
}

/// Applies the policy now, within the bounds of one sweep (the tenant's
/// admins); usage records are never deleted.
#[utoipa::path(post, path = "/v1/retention/sweep", tag = "retention", params(SweepQuery),
    responses((status = 200, description = "What the sweep deleted, or with dryRun would delete",
        body = SweepResult)))]
pub async fn sweep_retention(State(state): St, Ctx(ctx): Ctx, Query(query): Query<SweepQuery>) -> Response {
    ok(&ctx, retention::sweep(&state.peers, &ctx, query).await)
}
