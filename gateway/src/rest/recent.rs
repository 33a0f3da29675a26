//! REST adapters of the recent list and read markers.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;

use crate::api::recent::{self, ImageRead, ReadMark, RecentList, RecentQuery};
use crate::http::{Body, Ctx, Path, Query, ok};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(get, path = "/v1/conversations/recent", tag = "images", params(RecentQuery),
    responses((status = 200, description = "The conversations the caller may read, most recently active first, \
        each with its last message, its agent's state and its unread count", body = RecentList)))]
pub async fn list_recent(State(state): St, Ctx(ctx): Ctx, Query(query): Query<RecentQuery>) -> Response {
    ok(&ctx, recent::recent(&state.peers, &ctx, query).await)
}

#[utoipa::path(post, path = "/v1/images/{id}/read", tag = "images", params(("id" = String, Path)),
    request_body = ReadMark,
    responses((status = 200, description = "The caller's read marker, moved forward", body = ImageRead)))]
pub async fn mark_read(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Body(mark): Body<ReadMark>,
) -> Response {
    ok(&ctx, recent::mark_read(&state.peers, &ctx, id, mark).await)
}
