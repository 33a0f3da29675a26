//! REST adapters of export and import.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::api::transfer::{self, ExportBody, ImportResult, MAX_IMPORT_BYTES};
use crate::http::{Ctx, Path, error_response, reply};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

/// A streamed export as a download named `file`.
fn download(body: ExportBody, content_type: &'static str, file: String) -> Response {
    let disposition = format!("attachment; filename=\"{file}\"");
    (
        [
            (header::CONTENT_TYPE, content_type.to_owned()),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

#[utoipa::path(get, path = "/v1/images/{id}/export", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "The conversation as a versioned JSON document (`\"format\": \
        \"agentvm.conversation\"`): its configuration, every message, the resources its turns ran with and \
        its usage totals; streamed as it is read", content_type = "application/json", body = Object)))]
pub async fn export_image(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    match transfer::export_image(&state.peers, &ctx, id.clone()).await {
        // A server-made id: nothing in it needs quoting.
        Ok(body) => download(body, "application/json", format!("{id}.json")),
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

#[utoipa::path(get, path = "/v1/containers/{id}/export", tag = "containers", params(("id" = String, Path)),
    responses((status = 200, description = "The container as JSON Lines: a header (`\"format\": \
        \"agentvm.container\"`), then each conversation's document on a line, oldest first; streamed",
        content_type = "application/x-ndjson", body = String)))]
pub async fn export_container(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    match transfer::export_container(&state.peers, &ctx, id.clone()).await {
        // Container ids hold only letters, digits and `._:@-`.
        Ok(body) => download(body, "application/x-ndjson", format!("{id}.jsonl")),
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

#[utoipa::path(post, path = "/v1/containers/{id}/import", tag = "containers", params(("id" = String, Path)),
    request_body(content = String, description = "A conversation document, or a container export (JSON Lines); \
        at most 15 MiB", content_type = "application/json"),
    responses((status = 201, description = "Imported, with new ids", body = ImportResult),
              (status = 200, description = "Every document was imported into this container before", body = ImportResult)))]
pub async fn import(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>, body: axum::body::Body) -> Response {
    // Read here rather than by the shared extractor: imports may be larger
    // than any other body (the router lets this route's through).
    let document = match axum::body::to_bytes(body, MAX_IMPORT_BYTES).await {
        Ok(document) => document,
        Err(_) => return crate::http::too_large(MAX_IMPORT_BYTES, &ctx.request_id),
    };
    let result = transfer::import(&state.peers, &ctx, id, document).await;
    let status = match &result {
        Ok(result) if !result.created() => StatusCode::OK,
        _ => StatusCode::CREATED,
    };
    reply(&ctx, status, result)
}
