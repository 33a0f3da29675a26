//! The REST adapter of search.

use std::sync::Arc;

use axum::extract::State;
use axum::response::Response;

use crate::api::search::{self, SearchQuery, SearchResults};
use crate::http::{Ctx, Query, ok};
use crate::state::GatewayState;

#[utoipa::path(get, path = "/v1/search", tag = "search", params(SearchQuery),
    responses((status = 200, description = "The messages and conversation names the caller may read that hold \
        every word of `q`, best first", body = SearchResults)))]
pub async fn search(
    State(state): State<Arc<GatewayState>>,
    Ctx(ctx): Ctx,
    Query(query): Query<SearchQuery>,
) -> Response {
    ok(&ctx, search::search(&state.peers, &ctx, query).await)
}
