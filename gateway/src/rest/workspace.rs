//! REST adapters of an image's workspace: list a directory, read and write
//! files as raw bytes.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use crate::api::workspace::{self, WorkspaceEntry, WorkspaceListing, WorkspacePath, WorkspaceRemoved};
use crate::http::{Ctx, Path, Query, RawBody, error_response, ok, with_request_id};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(get, path = "/v1/images/{id}/workspace", tag = "images",
    params(("id" = String, Path), WorkspacePath),
    responses((status = 200, description = "A directory of the image's workspace", body = WorkspaceListing)))]
pub async fn list_workspace(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Query(path): Query<WorkspacePath>,
) -> Response {
    ok(&ctx, workspace::list(&state.peers, &ctx, id, path).await)
}

/// Serves `GET /v1/images/{id}/workspace/files/{*path}`: the file's bytes.
#[utoipa::path(get, path = "/v1/images/{id}/workspace/files/{path}", tag = "images",
    params(("id" = String, Path), ("path" = String, Path, description = "The file, relative to the workspace; may hold `/`")),
    responses((status = 200, description = "The file's content", content_type = "application/octet-stream", body = Vec<u8>)))]
pub async fn read_workspace_file(
    State(state): St,
    Ctx(ctx): Ctx,
    Path((id, path)): Path<(String, String)>,
) -> Response {
    match workspace::read(&state.peers, &ctx, id, path).await {
        Ok((_, content)) => {
            let mut response = content.into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            with_request_id(response, &ctx.request_id)
        }
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

/// Serves `PUT /v1/images/{id}/workspace/files/{*path}`: the body is the file.
#[utoipa::path(put, path = "/v1/images/{id}/workspace/files/{path}", tag = "images",
    params(("id" = String, Path), ("path" = String, Path, description = "The file, relative to the workspace; may hold `/`")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, description = "The file as written", body = WorkspaceEntry)))]
pub async fn write_workspace_file(
    State(state): St,
    Ctx(ctx): Ctx,
    Path((id, path)): Path<(String, String)>,
    RawBody(content, _): RawBody,
) -> Response {
    ok(
        &ctx,
        workspace::write(&state.peers, &ctx, id, path, content.to_vec()).await,
    )
}

/// Serves `DELETE /v1/images/{id}/workspace/files/{*path}`: a file, a link,
/// or a directory with what it holds.
#[utoipa::path(delete, path = "/v1/images/{id}/workspace/files/{path}", tag = "images",
    params(("id" = String, Path), ("path" = String, Path, description = "The file or directory, relative to the workspace; may hold `/`")),
    responses((status = 200, description = "Removed", body = WorkspaceRemoved)))]
pub async fn remove_workspace_file(
    State(state): St,
    Ctx(ctx): Ctx,
    Path((id, path)): Path<(String, String)>,
) -> Response {
    ok(&ctx, workspace::remove(&state.peers, &ctx, id, path).await)
}
