//! The REST surface: thin axum handlers over `api/`, each annotated with its
//! OpenAPI operation; `router.rs` puts them on their routes.

use std::sync::Arc;

use avm_common::ApiError;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::http::{RequestId, error_response};
use crate::state::GatewayState;

pub mod auth;
pub mod conversations;
pub mod credentials;
pub mod groups;
pub mod recent;
pub mod resources;
pub mod retention;
pub mod search;
pub mod secrets;
pub mod settings;
pub mod transfer;
pub mod usage;
pub mod workspace;

/// What `/health` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// Always `ok`.
    pub status: String,
    /// The server's version.
    pub version: String,
}

/// What `/ready` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// `ready` or `not_ready`.
    pub status: String,
    /// What fails: the services that do not answer their health check,
    /// `auth.credentials` (the auth service refuses this gateway's service
    /// key), `auth.events` (the stream of key revocations is not live),
    /// `stopping`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failing: Vec<String>,
    /// Why, for what is not a peer's health check.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<ReadinessProblem>,
}

/// One reason `/ready` says not ready.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReadinessProblem {
    /// What fails, as in `failing`.
    pub dependency: String,
    /// A stable reason, e.g. `SERVICE_KEY_REFUSED`, `AUTH_EVENTS_DOWN`.
    pub code: String,
    pub message: String,
}

#[utoipa::path(get, path = "/health", tag = "system", security(()),
    responses((status = 200, description = "The process is up", body = Health)))]
pub async fn health() -> Response {
    axum::Json(Health {
        status: "ok".to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
    })
    .into_response()
}

#[utoipa::path(get, path = "/ready", tag = "system", security(()),
    responses((status = 200, description = "Every service the gateway needs answers, accepts its credentials, \
        and the auth event stream is live", body = Readiness),
              (status = 503, description = "Something fails: `failing` names it", body = Readiness)))]
pub async fn ready(State(state): State<Arc<GatewayState>>) -> Response {
    let mut failing = state.peers.unhealthy().await;
    let unready = state.auth.unready();
    failing.extend(unready.iter().map(|problem| problem.dependency));
    if state.stopping.is_cancelled() {
        failing.push("stopping");
    }
    let status = if failing.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = Readiness {
        status: if failing.is_empty() { "ready" } else { "not_ready" }.to_owned(),
        failing: failing.into_iter().map(str::to_owned).collect(),
        problems: unready
            .into_iter()
            .map(|problem| ReadinessProblem {
                dependency: problem.dependency.to_owned(),
                code: problem.reason.to_owned(),
                message: problem.message.to_owned(),
            })
            .collect(),
    };
    (status, axum::Json(body)).into_response()
}

#[utoipa::path(get, path = "/metrics", tag = "system", security(()),
    responses((status = 200, description = "This process's metrics, Prometheus text", content_type = "text/plain", body = String)))]
pub async fn metrics() -> Response {
    avm_common::telemetry::metrics_endpoint().await.into_response()
}

#[utoipa::path(get, path = "/v1/openapi.json", tag = "system", security(()),
    responses((status = 200, description = "This document (OpenAPI 3.1)", body = Object)))]
pub async fn openapi(State(state): State<Arc<GatewayState>>) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        state.openapi.clone(),
    )
        .into_response()
}

/// Answers a path no route serves.
pub async fn not_found(RequestId(request_id): RequestId) -> Response {
    error_response(&ApiError::not_found("ROUTE_NOT_FOUND", "no such route"), &request_id)
}

/// Answers a method the route does not serve.
pub async fn method_not_allowed(RequestId(request_id): RequestId) -> Response {
    let err = ApiError::new(
        avm_common::Code::InvalidArgument,
        "METHOD_NOT_ALLOWED",
        "method not allowed on this route",
    );
    let mut response = error_response(&err, &request_id);
    *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    response
}
