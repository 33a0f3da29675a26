//! REST adapters of resources: register, discover, read, publish, delete and
//! resolve `resource://` resources.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;

use crate::api::resources::{
    self, PublishVersion, RegisterResource, ResolveQuery, ResolveRequest, Resolved, ResourceDeleted, ResourceFilter,
    ResourcePage, ResourceWithVersion, VersionQuery,
};
use crate::http::{Body, Ctx, Path, Query, ok, reply};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(post, path = "/v1/resources", tag = "resources", request_body = RegisterResource,
    responses((status = 201, description = "The resource with its first version", body = ResourceWithVersion)))]
pub async fn register_resource(State(state): St, Ctx(ctx): Ctx, Body(request): Body<RegisterResource>) -> Response {
    reply(
        &ctx,
        StatusCode::CREATED,
        resources::register(&state.peers, &ctx, request).await,
    )
}

#[utoipa::path(get, path = "/v1/resources", tag = "resources", params(ResourceFilter),
    responses((status = 200, description = "A page of the resources the caller may read", body = ResourcePage)))]
pub async fn list_resources(State(state): St, Ctx(ctx): Ctx, Query(filter): Query<ResourceFilter>) -> Response {
    ok(&ctx, resources::list(&state.peers, &ctx, filter).await)
}

#[utoipa::path(get, path = "/v1/resources/{id}", tag = "resources", params(("id" = String, Path), VersionQuery),
    responses((status = 200, description = "The resource with one version (the latest unless `version`)", body = ResourceWithVersion)))]
pub async fn get_resource(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Query(query): Query<VersionQuery>,
) -> Response {
    ok(&ctx, resources::get(&state.peers, &ctx, id, query).await)
}

#[utoipa::path(put, path = "/v1/resources/{id}", tag = "resources", params(("id" = String, Path)),
    request_body = PublishVersion,
    responses((status = 201, description = "The new version (an existing one never changes)", body = ResourceWithVersion)))]
pub async fn publish_version(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Body(request): Body<PublishVersion>,
) -> Response {
    reply(
        &ctx,
        StatusCode::CREATED,
        resources::publish(&state.peers, &ctx, id, request).await,
    )
}

#[utoipa::path(delete, path = "/v1/resources/{id}", tag = "resources", params(("id" = String, Path), VersionQuery),
    responses((status = 200, description = "What was deleted (refused while others depend on it, unless `force`)", body = ResourceDeleted)))]
pub async fn delete_resource(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Query(query): Query<VersionQuery>,
) -> Response {
    ok(&ctx, resources::delete(&state.peers, &ctx, id, query).await)
}

#[utoipa::path(get, path = "/v1/resources/resolve", tag = "resources", params(ResolveQuery),
    responses((status = 200, description = "The URI at exact versions, with its dependencies", body = Resolved)))]
pub async fn resolve_resource(State(state): St, Ctx(ctx): Ctx, Query(query): Query<ResolveQuery>) -> Response {
    ok(&ctx, resources::resolve_query(&state.peers, &ctx, query).await)
}

/// Resolves a URI with variables that do not fit a query string.
#[utoipa::path(post, path = "/v1/resources/resolve", tag = "resources", request_body = ResolveRequest,
    responses((status = 200, description = "The URI at exact versions, with its dependencies", body = Resolved)))]
pub async fn resolve_resource_with_body(
    State(state): St,
    Ctx(ctx): Ctx,
    Body(request): Body<ResolveRequest>,
) -> Response {
    ok(&ctx, resources::resolve_body(&state.peers, &ctx, request).await)
}
