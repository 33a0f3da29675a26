//! HTTP plumbing of the REST surface and the WebSocket upgrade: the request
//! id, the caller's context, typed bodies and queries, and every error as
//! the API's error document `{"error":{"code","message","requestId"}}`.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use avm_common::auth::parse_bearer;
use avm_common::trace::TraceParent;
use avm_common::{ApiError, Code, RequestContext};
use axum::body::Bytes;
use axum::extract::{ConnectInfo, FromRequest, FromRequestParts, Request};
use axum::http::header::{AUTHORIZATION, RETRY_AFTER, WWW_AUTHENTICATE};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use utoipa::ToSchema;

use crate::state::GatewayState;

/// The error document every failed REST call answers with.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDocument {
    pub error: ErrorBody,
}

/// What went wrong, in the shared vocabulary.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ErrorBody {
    /// A stable reason, e.g. `IMAGE_NOT_FOUND`.
    pub code: String,
    /// For people; may change.
    pub message: String,
    /// The request's id (the caller's `x-request-id`, or one made for it).
    pub request_id: String,
}

/// The request id of an HTTP call: the caller's `x-request-id` or one made
/// once per request (by the router's first layer) and kept in its extensions.
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for RequestId {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(request_id_of(parts))
    }
}

fn request_id_of(parts: &Parts) -> RequestId {
    parts
        .extensions
        .get::<RequestId>()
        .cloned()
        .unwrap_or_else(|| RequestId(request_id_from_headers(&parts.headers)))
}

/// Returns the caller's `x-request-id` when it is usable, else a new id.
pub fn request_id_from_headers(headers: &HeaderMap) -> String {
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

/// The client of an HTTP call: the connection's peer, or, behind a proxy
/// the gateway was told to trust (`[gateway] client_ip_header`), the address
/// that proxy names. `None` when neither is known.
pub struct ClientAddr(pub Option<IpAddr>);

impl FromRequestParts<Arc<GatewayState>> for ClientAddr {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<GatewayState>) -> Result<Self, Self::Rejection> {
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.ip());
        let Some(header) = state.config.client_ip_header.as_deref() else {
            return Ok(ClientAddr(peer));
        };
        // The last address is the one the trusted proxy added; any before it
        // came from the client and prove nothing.
        let named = parts
            .headers
            .get_all(header)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .next_back()
            .and_then(|last| last.trim().parse::<IpAddr>().ok());
        Ok(ClientAddr(named.or(peer)))
    }
}

/// The context of an authenticated HTTP call that is within its rate limit.
pub struct Ctx(pub RequestContext);

impl FromRequestParts<Arc<GatewayState>> for Ctx {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &Arc<GatewayState>) -> Result<Self, Self::Rejection> {
        let RequestId(request_id) = request_id_of(parts);
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
        ctx.record_in_span();
        Ok(Ctx(ctx))
    }
}

/// A request body as bytes; one over the body limit, or one that cannot be
/// read, is refused with the error document.
pub struct RawBody(pub Bytes, pub RequestId);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let request_id = request
            .extensions()
            .get::<RequestId>()
            .map_or_else(|| request_id_from_headers(request.headers()), |id| id.0.clone());
        match Bytes::from_request(request, state).await {
            Ok(bytes) => Ok(RawBody(bytes, RequestId(request_id))),
            Err(rejection) => match rejection.status() {
                StatusCode::PAYLOAD_TOO_LARGE => Err(too_large_response(&request_id)),
                _ => {
                    let err = ApiError::invalid("INVALID_BODY", "cannot read request body");
                    Err(error_response(&err, &request_id))
                }
            },
        }
    }
}

/// A JSON object body decoded into its typed form; an empty body is `{}`.
pub struct Body<T>(pub T);

impl<T, S> FromRequest<S> for Body<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let RawBody(bytes, RequestId(request_id)) = RawBody::from_request(request, state).await?;
        json_object(&bytes)
            .and_then(crate::api::decode)
            .map(Body)
            .map_err(|err| error_response(&err, &request_id))
    }
}

/// Parses a JSON object; empty input is an empty object.
pub fn json_object(bytes: &[u8]) -> Result<Value, ApiError> {
    if bytes.is_empty() {
        return Ok(Value::Object(serde_json::Map::new()));
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(value @ Value::Object(_)) => Ok(value),
        _ => Err(ApiError::invalid("INVALID_JSON", "request body must be a JSON object")),
    }
}

/// A query string decoded into its typed form (`INVALID_QUERY` otherwise),
/// each parameter first bounded as [`crate::bounds`] says.
pub struct Query<T>(pub T);

impl<T, S> FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        // Every parameter is bounded before it is read as anything (issue 26 item 5).
        if let Ok(axum::extract::Query(pairs)) =
            axum::extract::Query::<Vec<(String, String)>>::from_request_parts(parts, state).await
            && let Err(err) = pairs
                .iter()
                .try_for_each(|(name, value)| crate::bounds::check_query_param(name, value))
        {
            let RequestId(request_id) = request_id_of(parts);
            return Err(error_response(&err, &request_id));
        }
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(query)) => Ok(Query(query)),
            Err(err) => {
                let RequestId(request_id) = request_id_of(parts);
                let err = ApiError::invalid("INVALID_QUERY", format!("invalid query: {err}"));
                Err(error_response(&err, &request_id))
            }
        }
    }
}

/// Path parameters decoded into their typed form, each first bounded (an id
/// to 256 bytes, a workspace path to 4096, no NUL); a segment that is not
/// UTF-8 once percent-decoded (`%ff`) is `INVALID_PATH` in the error
/// document, not axum's plain-text rejection.
pub struct Path<T>(pub T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        // Every parameter is bounded before it is read as anything (issue 26
        // item 5); one that is not UTF-8 is refused below, by name.
        if let Ok(params) = axum::extract::RawPathParams::from_request_parts(parts, state).await
            && let Err(err) = params
                .iter()
                .try_for_each(|(name, value)| crate::bounds::check_path_param(name, value))
        {
            let RequestId(request_id) = request_id_of(parts);
            return Err(error_response(&err, &request_id));
        }
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(params)) => Ok(Path(params)),
            Err(rejection) => {
                let RequestId(request_id) = request_id_of(parts);
                let err = path_error(&rejection);
                Err(error_response(&err, &request_id))
            }
        }
    }
}

/// Maps axum's refusal of a path to the vocabulary: the client's mistake
/// (`INVALID_PATH`), or a route whose parameters do not fit its handler.
fn path_error(rejection: &axum::extract::rejection::PathRejection) -> ApiError {
    use axum::extract::path::ErrorKind;
    use axum::extract::rejection::PathRejection;
    match rejection {
        PathRejection::FailedToDeserializePathParams(failed) => match failed.kind() {
            ErrorKind::InvalidUtf8InPathParam { key } => {
                ApiError::invalid("INVALID_PATH", format!("path parameter {key} is not valid UTF-8"))
            }
            ErrorKind::ParseErrorAtKey { key, .. } | ErrorKind::DeserializeError { key, .. } => {
                ApiError::invalid("INVALID_PATH", format!("path parameter {key} is invalid"))
            }
            ErrorKind::ParseErrorAtIndex { index, .. } => {
                ApiError::invalid("INVALID_PATH", format!("path parameter {index} is invalid"))
            }
            ErrorKind::ParseError { .. } | ErrorKind::Message(_) => {
                ApiError::invalid("INVALID_PATH", "the path's parameters are invalid")
            }
            // A handler whose parameters do not match its route is a bug of ours.
            _ => ApiError::internal(format!("path parameters do not fit the route: {failed}")),
        },
        _ => ApiError::internal(format!("path parameters unavailable: {rejection}")),
    }
}

/// Renders a 413 (`REQUEST_TOO_LARGE`) for a body beyond `limit` bytes.
pub fn too_large(limit: usize, request_id: &str) -> Response {
    let err = ApiError::invalid(
        "REQUEST_TOO_LARGE",
        format!("request body is larger than {limit} bytes"),
    );
    let mut response = error_response(&err, request_id);
    *response.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
    response
}

/// Renders a 413 (`REQUEST_TOO_LARGE`) for a body found too large while read.
fn too_large_response(request_id: &str) -> Response {
    let err = ApiError::invalid("REQUEST_TOO_LARGE", "request body is too large");
    let mut response = error_response(&err, request_id);
    *response.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
    response
}

/// Renders an operation's result: `status` with the JSON body, or the error document.
pub fn reply<T: Serialize>(ctx: &RequestContext, status: StatusCode, result: Result<T, ApiError>) -> Response {
    match result {
        Ok(body) => with_request_id((status, axum::Json(body)).into_response(), &ctx.request_id),
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

/// Renders an operation's result as 200 with the JSON body, or the error document.
pub fn ok<T: Serialize>(ctx: &RequestContext, result: Result<T, ApiError>) -> Response {
    reply(ctx, StatusCode::OK, result)
}

/// Renders an error as the error document, with the vocabulary's status.
pub fn error_response(err: &ApiError, request_id: &str) -> Response {
    let body = ErrorDocument {
        error: ErrorBody {
            code: err.reason.clone().into_owned(),
            message: err.message.clone(),
            request_id: request_id.to_owned(),
        },
    };
    let mut response = with_request_id((err.code.http_status(), axum::Json(body)).into_response(), request_id);
    if err.code == Code::Unauthenticated {
        response
            .headers_mut()
            .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    response
}

/// Adds the `x-request-id` header.
pub fn with_request_id(mut response: Response, request_id: &str) -> Response {
    if let Ok(value) = HeaderValue::from_str(request_id) {
        response
            .headers_mut()
            .insert(avm_common::context::REQUEST_ID_HEADER, value);
    }
    response
}

/// Returns the error of a request over its rate limit.
pub fn rate_limit_error(wait: Duration) -> ApiError {
    ApiError::new(
        Code::ResourceExhausted,
        "RATE_LIMITED",
        format!(
            "too many requests; retry in {} s",
            crate::limits::retry_after_secs(wait)
        ),
    )
}

/// Renders a 429 with `Retry-After`.
pub fn rate_limited(wait: Duration, request_id: &str) -> Response {
    let mut response = error_response(&rate_limit_error(wait), request_id);
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(crate::limits::retry_after_secs(wait)));
    response
}

#[cfg(test)]
mod tests {
    use axum::http::header::HeaderValue;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    use super::*;

    proptest! {
        #[test]
        fn any_authorization_header_is_a_credential_none_or_an_invalid_token(value in prop::collection::vec(any::<u8>(), 0..64), scheme in prop::sample::select(vec!["", "Bearer ", "bearer  ", "Basic "])) {
            let mut bytes = scheme.as_bytes().to_vec();
            bytes.extend(value);
            let Ok(value) = HeaderValue::from_bytes(&bytes) else {
                return Ok(());
            };
            let mut headers = HeaderMap::new();
            headers.insert(AUTHORIZATION, value);
            match bearer_credential(&headers) {
                Ok(Some(token)) => prop_assert!(!token.is_empty() && token == token.trim()),
                Ok(None) => {
                    return Err(TestCaseError::fail("a header that is there is not a missing credential"));
                }
                Err(err) => {
                    prop_assert_eq!(err.code, Code::Unauthenticated);
                    prop_assert_eq!(err.reason.as_ref(), "INVALID_TOKEN");
                }
            }
        }

        #[test]
        fn any_request_id_header_is_kept_or_replaced_by_a_printable_one(value in prop::collection::vec(any::<u8>(), 0..200)) {
            let mut headers = HeaderMap::new();
            if let Ok(value) = HeaderValue::from_bytes(&value) {
                headers.insert(avm_common::context::REQUEST_ID_HEADER, value);
            }
            let id = request_id_from_headers(&headers);
            prop_assert!(!id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()), "{:?}", id);
            prop_assert!(HeaderValue::from_str(&id).is_ok());
        }

        #[test]
        fn any_body_is_an_object_or_invalid_json(body in prop::collection::vec(any::<u8>(), 0..64)) {
            if let Err(err) = json_object(&body) {
                prop_assert_eq!(err.reason.as_ref(), "INVALID_JSON");
            }
        }
    }
}
