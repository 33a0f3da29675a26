//! The REST API under `/v1`, plus `/health` and `/ready`. Errors are always
//! `{"error":{"code","message","requestId"}}` with the vocabulary's HTTP status.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use avm_common::auth::parse_bearer;
use avm_common::trace::TraceParent;
use avm_common::{ApiError, RequestContext};
use avm_proto::runtime::v1 as rt;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, Query, State};
use axum::http::header::{AUTHORIZATION, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::GatewayState;
use crate::backends::agent_json;
use crate::wire::{event_frame, system_error_frame};
use crate::ws::{content_field, image_config, opt_str, req_str};

type AppState = State<Arc<GatewayState>>;

/// Returns the gateway's HTTP routes.
pub fn router(state: Arc<GatewayState>) -> Router {
    let body_limit = state.config.max_frame_bytes;
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(avm_common::telemetry::metrics_endpoint))
        .route("/ws", get(crate::ws::upgrade))
        .route("/v1/containers", post(create_container).get(list_containers))
        .route("/v1/containers/{id}", get(get_container).delete(delete_container))
        .route("/v1/containers/{id}/images", post(create_image).get(list_images))
        .route("/v1/containers/{id}/shares", post(share_container).get(list_shares))
        .route(
            "/v1/containers/{id}/shares/{user}",
            axum::routing::delete(unshare_container),
        )
        .route(
            "/v1/images/{id}",
            get(get_image).patch(update_image).delete(delete_image),
        )
        .route("/v1/images/{id}/run", post(run_image))
        .route("/v1/images/{id}/stop", post(stop_image))
        .route("/v1/images/{id}/messages", get(list_messages).post(send_message))
        .route("/v1/images/{id}/events", get(image_events))
        .route("/v1/images/{id}/interrupt", post(interrupt))
        .route("/v1/agents", get(list_agents))
        .route("/v1/agents/{id}", get(get_agent).delete(destroy_agent))
        .merge(crate::admin::routes())
        .merge(crate::resources::routes())
        .merge(crate::settings::routes())
        .merge(crate::usage::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies beyond the frame limit are refused before they are buffered.
        .layer(DefaultBodyLimit::max(body_limit))
        // Outermost: every request, refused ones too, is counted and runs in
        // a span of its trace (the caller's `traceparent`, or a new one).
        .layer(axum::middleware::from_fn(observe_request))
        .with_state(state)
}

/// Serves one HTTP request inside a span of its trace, and records
/// `avm_gateway_http_requests_total{route, method, status}` and
/// `avm_gateway_http_request_duration_seconds{route}` (to the response head).
async fn observe_request(mut request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    use tracing::Instrument;
    let trace = request
        .headers()
        .get(avm_common::trace::TRACEPARENT)
        .and_then(|value| value.to_str().ok())
        .and_then(TraceParent::parse)
        .unwrap_or_else(TraceParent::root);
    request.extensions_mut().insert(trace);
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

/// The request id of an HTTP call: the caller's `x-request-id` or a new one.
pub struct RequestId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for RequestId {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(RequestId(request_id(&parts.headers)))
    }
}

fn request_id(headers: &HeaderMap) -> String {
    headers
        .get(avm_common::context::REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| avm_common::ids::new_id("req"), str::to_owned)
}

/// Returns the credential of `Authorization: Bearer <credential>`; a header
/// of any other form is an invalid credential, not a missing one.
pub fn bearer_credential(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    match headers.get(AUTHORIZATION) {
        None => Ok(None),
        Some(value) => value
            .to_str()
            .ok()
            .and_then(parse_bearer)
            .map(Some)
            .ok_or_else(avm_common::auth::invalid_token),
    }
}

/// The context of an authenticated HTTP call that is within its rate limit.
pub struct Ctx(pub RequestContext);

impl FromRequestParts<Arc<GatewayState>> for Ctx {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<GatewayState>) -> Result<Self, Self::Rejection> {
        let request_id = request_id(&parts.headers);
        let credential = bearer_credential(&parts.headers).map_err(|err| error_response(&err, &request_id))?;
        let caller = state
            .auth
            .authenticate(credential)
            .await
            .map_err(|err| error_response(&err, &request_id))?;
        if let Err(wait) = state.limiter.check(&caller.principal).await {
            return Err(rate_limited(wait, &request_id));
        }
        let trace = parts
            .extensions
            .get::<TraceParent>()
            .copied()
            .unwrap_or_else(TraceParent::root);
        let ctx = caller.context(request_id).with_trace(trace);
        avm_common::telemetry::record_caller(&ctx);
        Ok(Ctx(ctx))
    }
}

/// Returns the error of a request over its rate limit.
pub fn rate_limit_error(wait: Duration) -> ApiError {
    ApiError::new(
        avm_common::Code::ResourceExhausted,
        "RATE_LIMITED",
        format!(
            "too many requests; retry in {} s",
            crate::limits::retry_after_secs(wait)
        ),
    )
}

/// Renders a 429 with `Retry-After`.
fn rate_limited(wait: Duration, request_id: &str) -> Response {
    let mut response = error_response(&rate_limit_error(wait), request_id);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(crate::limits::retry_after_secs(wait)));
    response
}

/// Renders an error as the REST error document.
pub fn error_response(err: &ApiError, request_id: &str) -> Response {
    let body = json!({"error": {"code": err.reason, "message": err.message, "requestId": request_id}});
    let mut response = with_request_id((err.code.http_status(), axum::Json(body)).into_response(), request_id);
    if err.code == avm_common::Code::Unauthenticated {
        response
            .headers_mut()
            .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    response
}

pub(crate) fn with_request_id(mut response: Response, request_id: &str) -> Response {
    if let Ok(value) = HeaderValue::from_str(request_id) {
        response
            .headers_mut()
            .insert(avm_common::context::REQUEST_ID_HEADER, value);
    }
    response
}

pub(crate) fn reply(ctx: &RequestContext, status: StatusCode, result: Result<Value, ApiError>) -> Response {
    match result {
        Ok(body) => with_request_id((status, axum::Json(body)).into_response(), &ctx.request_id),
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

/// Returns a query string's fields, or INVALID_QUERY saying what is wrong.
pub(crate) fn query_fields<T>(
    query: Result<Query<T>, axum::extract::rejection::QueryRejection>,
) -> Result<T, ApiError> {
    query
        .map(|Query(query)| query)
        .map_err(|err| ApiError::invalid("INVALID_QUERY", format!("invalid query: {err}")))
}

/// Parses a JSON object body; an empty body is an empty object.
pub(crate) fn json_body(body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let bytes = body.map_err(|rejection| match rejection.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::invalid("REQUEST_TOO_LARGE", "request body is too large"),
        _ => ApiError::invalid("INVALID_BODY", "cannot read request body"),
    })?;
    if bytes.is_empty() {
        return Ok(json!({}));
    }
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(value @ Value::Object(_)) => Ok(value),
        _ => Err(ApiError::invalid("INVALID_JSON", "request body must be a JSON object")),
    }
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok", "version": env!("CARGO_PKG_VERSION")})).into_response()
}

async fn ready(State(state): AppState) -> Response {
    let failing = state.backends.unhealthy().await;
    if failing.is_empty() {
        axum::Json(json!({"status": "ready"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "not_ready", "failing": failing})),
        )
            .into_response()
    }
}

async fn not_found(RequestId(request_id): RequestId) -> Response {
    error_response(&ApiError::not_found("ROUTE_NOT_FOUND", "no such route"), &request_id)
}

async fn method_not_allowed(RequestId(request_id): RequestId) -> Response {
    let err = ApiError::new(
        avm_common::Code::InvalidArgument,
        "METHOD_NOT_ALLOWED",
        "method not allowed on this route",
    );
    let mut response = error_response(&err, &request_id);
    *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    response
}

async fn create_container(State(state): AppState, Ctx(ctx): Ctx, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = json_body(body)?;
        let container_id = req_str(&body, "containerId")?;
        state.backends.create_container(&ctx, &container_id).await
    }
    .await;
    match result {
        Ok((container, created)) => {
            let status = if created { StatusCode::CREATED } else { StatusCode::OK };
            reply(&ctx, status, Ok(container))
        }
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

async fn list_containers(State(state): AppState, Ctx(ctx): Ctx) -> Response {
    let result = state
        .backends
        .list_containers(&ctx)
        .await
        .map(|containers| json!({"containers": containers}));
    reply(&ctx, StatusCode::OK, result)
}

async fn get_container(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    reply(&ctx, StatusCode::OK, state.backends.get_container(&ctx, &id).await)
}

async fn delete_container(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = state
        .backends
        .delete_container(&ctx, &id)
        .await
        .map(|()| json!({"containerId": id, "deleted": true}));
    reply(&ctx, StatusCode::OK, result)
}

/// Body of `POST /v1/containers/{id}/shares`.
async fn share_container(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = json_body(body)?;
        let user_id = req_str(&body, "userId")?;
        state.backends.share_container(&ctx, &id, &user_id).await?;
        Ok(json!({"containerId": id, "userId": user_id, "shared": true}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn list_shares(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = state
        .backends
        .container_shares(&ctx, &id)
        .await
        .map(|shares| json!({"containerId": id, "shares": shares}));
    reply(&ctx, StatusCode::OK, result)
}

async fn unshare_container(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path((id, user_id)): Path<(String, String)>,
) -> Response {
    let result = state
        .backends
        .unshare_container(&ctx, &id, &user_id)
        .await
        .map(|()| json!({"containerId": id, "userId": user_id, "shared": false}));
    reply(&ctx, StatusCode::OK, result)
}

async fn create_image(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(container_id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = json_body(body)?;
        let config = image_config(Some(&body))?;
        state
            .backends
            .create_image(&ctx, &container_id, config)
            .await
            .map(|(record, _)| record)
    }
    .await;
    reply(&ctx, StatusCode::CREATED, result)
}

async fn list_images(State(state): AppState, Ctx(ctx): Ctx, Path(container_id): Path<String>) -> Response {
    let result = state
        .backends
        .list_images(&ctx, Some(&container_id))
        .await
        .map(|images| {
            let records: Vec<Value> = images.into_iter().map(|(record, _)| record).collect();
            json!({"images": records})
        });
    reply(&ctx, StatusCode::OK, result)
}

async fn get_image(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    reply(
        &ctx,
        StatusCode::OK,
        state.backends.get_image(&ctx, &id).await.map(|(record, _)| record),
    )
}

async fn update_image(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = json_body(body)?;
        let name = opt_str(&body, "name")?;
        let description = opt_str(&body, "description")?;
        state.backends.update_image(&ctx, &id, name, description).await
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn delete_image(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = state
        .backends
        .delete_image(&ctx, &id)
        .await
        .map(|()| json!({"imageId": id, "deleted": true}));
    reply(&ctx, StatusCode::OK, result)
}

async fn run_image(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = state
        .backends
        .run_image(&ctx, &id)
        .await
        .map(|(agent, reused)| json!({"imageId": id, "agentId": agent.agent_id, "reused": reused}));
    reply(&ctx, StatusCode::OK, result)
}

async fn stop_image(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = state
        .backends
        .stop_image(&ctx, &id)
        .await
        .map(|stopped| json!({"imageId": id, "stopped": stopped}));
    reply(&ctx, StatusCode::OK, result)
}

async fn list_messages(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = state
        .backends
        .messages(&ctx, &id)
        .await
        .map(|messages| json!({"imageId": id, "messages": messages}));
    reply(&ctx, StatusCode::OK, result)
}

fn sse_event(event: &rt::Event) -> Event {
    Event::default()
        .id(event.cursor.clone())
        .event(event.r#type.clone())
        .data(event_frame(event))
}

fn sse_error(status: &tonic::Status) -> Event {
    let err = ApiError::from_status(status);
    Event::default()
        .event("system_error")
        .data(system_error_frame(&err, None))
}

/// Sends a message and streams the turn as server-sent events, each with `id: <cursor>`.
async fn send_message(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = json_body(body)?;
        let content = content_field(&body)?.clone();
        if state.auth.verifier().quota_exhausted(&ctx.principal) {
            return Err(crate::auth::quota_exceeded());
        }
        state.backends.send_message(&ctx, &id, &content).await
    }
    .await;
    let (accepted, stream) = match result {
        Ok(accepted) => accepted,
        Err(err) => return error_response(&err, &ctx.request_id),
    };
    let agent_id = accepted
        .agent
        .as_ref()
        .map(|agent| agent.agent_id.clone())
        .unwrap_or_default();
    let first = Event::default().event("message_send_response").data(
        json!({"imageId": id, "agentId": agent_id, "userMessageId": accepted.user_message_id, "cursor": accepted.cursor})
            .to_string(),
    );
    let events = stream.filter_map(|item| async move {
        match item {
            Ok(rt::SendMessageResponse {
                kind: Some(rt::send_message_response::Kind::Event(event)),
            }) => Some(sse_event(&event)),
            Ok(_) => None,
            Err(status) => Some(sse_error(&status)),
        }
    });
    sse(futures::stream::once(async { first }).chain(events), &ctx)
}

fn sse(events: impl Stream<Item = Event> + Send + 'static, ctx: &RequestContext) -> Response {
    let stream = events.map(Ok::<_, Infallible>);
    with_request_id(
        Sse::new(stream).keep_alive(KeepAlive::default()).into_response(),
        &ctx.request_id,
    )
}

/// Query of `GET /v1/images/{id}/events`.
#[derive(Debug, Deserialize)]
struct EventsQuery {
    after: Option<String>,
}

/// Streams a conversation's events after a cursor (`?after=` or `Last-Event-ID`), then live.
async fn image_events(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let after = query.after.or_else(|| {
            headers
                .get("last-event-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
        let (_, session_id) = state.backends.get_image(&ctx, &id).await?;
        state.backends.subscribe(&ctx, &session_id, after).await
    }
    .await;
    match result {
        Ok(stream) => {
            let events = stream.filter_map(|item| async move {
                match item {
                    Ok(rt::SubscribeEventsResponse { event: Some(event) }) => Some(sse_event(&event)),
                    Ok(_) => None,
                    Err(status) => Some(sse_error(&status)),
                }
            });
            sse(events, &ctx)
        }
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

async fn interrupt(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let target = rt::interrupt_agent_request::Target::ImageId(id.clone());
    let result = state
        .backends
        .interrupt(&ctx, target)
        .await
        .map(|(agent, interrupted)| json!({"imageId": id, "agentId": agent.agent_id, "interrupted": interrupted}));
    reply(&ctx, StatusCode::OK, result)
}

/// Query of `GET /v1/agents`.
#[derive(Debug, Deserialize)]
struct AgentsQuery {
    #[serde(rename = "containerId")]
    container_id: Option<String>,
}

async fn list_agents(
    State(state): AppState,
    Ctx(ctx): Ctx,
    query: Result<Query<AgentsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let agents = state.backends.list_agents(&ctx, query.container_id.as_deref()).await?;
        Ok(json!({"agents": agents.iter().map(agent_json).collect::<Vec<_>>()}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn get_agent(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    reply(
        &ctx,
        StatusCode::OK,
        state
            .backends
            .get_agent(&ctx, &id)
            .await
            .map(|agent| agent_json(&agent)),
    )
}

async fn destroy_agent(State(state): AppState, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    let result = state
        .backends
        .destroy_agent(&ctx, &id)
        .await
        .map(|()| json!({"agentId": id, "destroyed": true}));
    reply(&ctx, StatusCode::OK, result)
}
