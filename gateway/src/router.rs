//! Every route of the gateway, and the layers every request passes through.
//!
//! Each REST route is registered with its OpenAPI operation (`routes!`), so
//! the document served at `/v1/openapi.json` lists exactly what is served.

use std::sync::Arc;

use avm_common::trace::TraceParent;
use axum::Router;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::http::Method;
use axum::response::Response;
use axum::routing::get;
use tracing::Instrument;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::http::{RequestId, request_id_from_headers};
use crate::rest::{
    self, auth, conversations as conv, credentials, groups, recent, resources, retention, search, secrets, settings,
    transfer, usage, workspace,
};
use crate::state::GatewayState;

/// Returns every route (with the OpenAPI document they make) before state is given.
pub fn routes() -> (Router<Arc<GatewayState>>, utoipa::openapi::OpenApi) {
    let (router, api) = OpenApiRouter::with_openapi(crate::openapi::ApiDoc::openapi())
        // System: probes, metrics, this document and the WebSocket.
        .routes(routes!(rest::health))
        .routes(routes!(rest::ready))
        .routes(routes!(rest::metrics))
        .routes(routes!(rest::openapi))
        .routes(routes!(crate::ws::upgrade))
        // Containers.
        .routes(routes!(conv::create_container, conv::list_containers))
        .routes(routes!(conv::get_container, conv::delete_container))
        .routes(routes!(conv::share_container, conv::list_shares))
        .routes(routes!(conv::unshare_container))
        // Images, their agents, messages and events.
        .routes(routes!(conv::create_image, conv::list_images))
        .routes(routes!(conv::get_image, conv::update_image, conv::delete_image))
        .routes(routes!(conv::list_children))
        .routes(routes!(conv::run_image))
        .routes(routes!(conv::stop_image))
        .routes(routes!(conv::interrupt))
        .routes(routes!(conv::list_messages, conv::send_message))
        .routes(routes!(conv::image_events))
        .routes(routes!(workspace::list_workspace))
        // A file's path may hold `/`: a wildcard, documented in `ApiDoc` as `{path}`.
        .route(
            "/v1/images/{id}/workspace/files/{*path}",
            get(workspace::read_workspace_file)
                .put(workspace::write_workspace_file)
                .delete(workspace::remove_workspace_file),
        )
        // Groups, their members, messages and read cursors.
        .routes(routes!(groups::create_group, groups::list_groups))
        .routes(routes!(groups::list_unread_groups))
        .routes(routes!(groups::get_group, groups::update_group, groups::delete_group))
        .routes(routes!(groups::add_group_member, groups::list_group_members))
        .routes(routes!(groups::remove_group_member))
        .routes(routes!(groups::list_group_messages, groups::post_group_message))
        .routes(routes!(groups::mark_group_read))
        .routes(routes!(groups::group_events))
        // Search, export and import.
        .routes(routes!(search::search))
        .routes(routes!(transfer::export_image))
        .routes(routes!(transfer::export_container))
        .routes(routes!(transfer::import))
        .routes(routes!(recent::list_recent))
        .routes(routes!(recent::mark_read))
        .routes(routes!(conv::rewind_image))
        .routes(routes!(conv::clear_image))
        // Retention: the tenant's policy and sweeps on demand.
        .routes(routes!(retention::get_retention, retention::put_retention))
        .routes(routes!(retention::sweep_retention))
        // Agents.
        .routes(routes!(conv::list_agents))
        .routes(routes!(conv::get_agent, conv::destroy_agent))
        .routes(routes!(conv::pause_agent))
        .routes(routes!(conv::resume_agent))
        .routes(routes!(conv::terminate_agent))
        // Tenants and users.
        .routes(routes!(auth::create_tenant, auth::list_tenants))
        .routes(routes!(auth::get_tenant, auth::update_tenant, auth::delete_tenant))
        .routes(routes!(auth::create_user, auth::list_users))
        .routes(routes!(auth::get_user, auth::delete_user))
        // Keys, tokens and identity.
        .routes(routes!(auth::create_api_key, auth::list_api_keys))
        .routes(routes!(auth::get_api_key, auth::revoke_api_key))
        .routes(routes!(auth::exchange_token))
        .routes(routes!(auth::jwks))
        .routes(routes!(auth::whoami))
        .routes(routes!(auth::get_quota))
        .routes(routes!(auth::rotate_signing_key))
        // Resources.
        .routes(routes!(resources::register_resource, resources::list_resources))
        .routes(routes!(
            resources::resolve_resource,
            resources::resolve_resource_with_body
        ))
        .routes(routes!(
            resources::get_resource,
            resources::publish_version,
            resources::delete_resource
        ))
        // Configuration.
        .routes(routes!(settings::get_config, settings::put_config))
        .routes(routes!(settings::get_config_key))
        // MCP servers' credentials.
        .routes(routes!(credentials::list_credentials))
        .routes(routes!(credentials::put_credential, credentials::delete_credential))
        // The tenant's secrets for its agents' sandboxes.
        .routes(routes!(secrets::list_secrets))
        .routes(routes!(secrets::put_secret, secrets::delete_secret))
        // Usage, budgets, the summary and logs.
        .routes(routes!(usage::query_usage))
        .routes(routes!(usage::list_usage_records))
        .routes(routes!(usage::list_budgets, usage::set_budget))
        .routes(routes!(usage::get_usage_summary))
        .routes(routes!(usage::query_logs))
        .split_for_parts();
    (router, crate::openapi::complete(api))
}

/// Returns the OpenAPI document of every REST route.
pub fn openapi() -> utoipa::openapi::OpenApi {
    routes().1
}

/// Returns the gateway's router over `state`.
pub fn router(state: Arc<GatewayState>) -> Router {
    let body_limit = state.config.max_frame_bytes;
    let dev = state.auth.anonymous();
    let (routes, _) = routes();
    let routes = routes
        .fallback(rest::not_found)
        .method_not_allowed_fallback(rest::method_not_allowed)
        // Bodies beyond the frame limit are refused before they are buffered,
        // and one announced beyond it before it is even asked for.
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn(move |request, next| {
            refuse_announced_excess(request, next, body_limit)
        }));
    // Anonymous access (`--dev`) is for this machine's own pages and tools:
    // refuse other sites and rebound names before anything runs.
    let routes = if dev {
        routes.layer(axum::middleware::from_fn(crate::dev::guard))
    } else {
        routes
    };
    routes
        // Outermost: every request, refused ones too, gets its request id
        // once, is counted, and runs in a span of its trace (the caller's
        // `traceparent`, or a new one).
        .layer(axum::middleware::from_fn(observe_request))
        .with_state(state)
}

/// The route whose bodies may be as large as an import.
const IMPORT_ROUTE: &str = "/v1/containers/{id}/import";

/// Answers 413 with the error document, before the body is read, a request
/// whose `Content-Length` is beyond `limit`: hyper sends `100 Continue` only
/// once the body is read, so a client that asked (`Expect: 100-continue`)
/// is told not to send it (issue 26 item 16).
async fn refuse_announced_excess(
    request: axum::extract::Request,
    next: axum::middleware::Next,
    limit: usize,
) -> Response {
    let announced = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    // Imports are the one body allowed more (their handler bounds it).
    let limit = match request.extensions().get::<axum::extract::MatchedPath>() {
        Some(path) if path.as_str() == IMPORT_ROUTE => limit.max(crate::api::transfer::MAX_IMPORT_BYTES),
        _ => limit,
    };
    if announced.is_some_and(|length| length > limit as u64) {
        let request_id = request
            .extensions()
            .get::<RequestId>()
            .map_or_else(|| request_id_from_headers(request.headers()), |id| id.0.clone());
        return crate::http::too_large(limit, &request_id);
    }
    next.run(request).await
}

/// Renders the OpenAPI document once, for serving.
pub fn openapi_json() -> Bytes {
    Bytes::from(openapi().to_json().unwrap_or_else(|_| "{}".to_owned()))
}

/// Serves one HTTP request inside a span of its trace with its request id
/// in its extensions, and records `avm_gateway_http_requests_total{route,
/// method, status}` and `avm_gateway_http_request_duration_seconds{route}`
/// (to the response head).
async fn observe_request(mut request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let trace = request
        .headers()
        .get(avm_common::trace::TRACEPARENT)
        .and_then(|value| value.to_str().ok())
        .and_then(TraceParent::parse)
        .unwrap_or_else(TraceParent::root);
    let request_id = RequestId(request_id_from_headers(request.headers()));
    request.extensions_mut().insert(trace);
    request.extensions_mut().insert(request_id);
    // The route's template, never the path itself: ids are not labels.
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |path| path.as_str().to_owned());
    // Only standard methods name themselves: a label a client can invent is unbounded.
    let method = match *request.method() {
        Method::GET | Method::POST | Method::PUT | Method::PATCH | Method::DELETE | Method::HEAD | Method::OPTIONS => {
            request.method().as_str().to_owned()
        }
        _ => "other".to_owned(),
    };
    let span = avm_common::telemetry::request_span("http", &format!("{method} {route}"), &trace);
    let started = std::time::Instant::now();
    let response = next.run(request).instrument(span).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("avm_gateway_http_requests_total", "route" => route.clone(), "method" => method, "status" => status)
        .increment(1);
    metrics::histogram!("avm_gateway_http_request_duration_seconds", "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}
