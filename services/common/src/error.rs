//! The shared error vocabulary: one small set of codes, each mapped once to a
//! gRPC code, an HTTP status and the reason carried in WebSocket error events.

use std::borrow::Cow;

use tonic_types::{ErrorDetails, StatusExt};

/// The domain placed in gRPC `ErrorInfo` details.
const ERROR_DOMAIN: &str = "agentvm";

/// Longest status message, in bytes. The message travels twice, in
/// `grpc-message` and inside `grpc-status-details-bin` (base64), and an
/// HTTP/2 peer refusing so large a header block may end the whole
/// connection, every other caller's streams with it (issue 26 item 5).
pub const MAX_STATUS_MESSAGE_BYTES: usize = 1024;

/// Longest reason carried in a status's details, in bytes.
const MAX_REASON_BYTES: usize = 128;

/// Returns `message` cut to [`MAX_STATUS_MESSAGE_BYTES`] on a character
/// boundary, marked with `…` when cut.
pub fn bounded_message(message: &str) -> Cow<'_, str> {
    if message.len() <= MAX_STATUS_MESSAGE_BYTES {
        return Cow::Borrowed(message);
    }
    let mut end = MAX_STATUS_MESSAGE_BYTES - '…'.len_utf8();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}…", &message[..end]))
}

/// Returns a status whose message and details are bounded: the one place an
/// error becomes a status, so no input echoed into a message (an id, a path)
/// can grow a status past what every peer accepts.
pub fn bounded_status(code: tonic::Code, message: &str, reason: Option<&str>) -> tonic::Status {
    let message = bounded_message(message).into_owned();
    match reason.filter(|reason| reason.len() <= MAX_REASON_BYTES) {
        Some(reason) => {
            let details =
                ErrorDetails::with_error_info(reason.to_owned(), ERROR_DOMAIN, std::collections::HashMap::new());
            tonic::Status::with_error_details(code, message, details)
        }
        None => tonic::Status::new(code, message),
    }
}

/// Classifies every error AgentVM returns to a caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    Unauthenticated,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    DeadlineExceeded,
    Internal,
}

impl Code {
    /// Returns the gRPC status code for this error class.
    pub fn grpc(self) -> tonic::Code {
        match self {
            Code::InvalidArgument => tonic::Code::InvalidArgument,
            Code::NotFound => tonic::Code::NotFound,
            Code::AlreadyExists => tonic::Code::AlreadyExists,
            Code::FailedPrecondition => tonic::Code::FailedPrecondition,
            Code::Unauthenticated => tonic::Code::Unauthenticated,
            Code::PermissionDenied => tonic::Code::PermissionDenied,
            Code::ResourceExhausted => tonic::Code::ResourceExhausted,
            Code::Unavailable => tonic::Code::Unavailable,
            Code::DeadlineExceeded => tonic::Code::DeadlineExceeded,
            Code::Internal => tonic::Code::Internal,
        }
    }

    /// Returns the HTTP status for this error class.
    pub fn http_status(self) -> http::StatusCode {
        match self {
            Code::InvalidArgument => http::StatusCode::BAD_REQUEST,
            Code::NotFound => http::StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::FailedPrecondition => http::StatusCode::CONFLICT,
            Code::Unauthenticated => http::StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => http::StatusCode::FORBIDDEN,
            Code::ResourceExhausted => http::StatusCode::TOO_MANY_REQUESTS,
            Code::Unavailable => http::StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => http::StatusCode::GATEWAY_TIMEOUT,
            Code::Internal => http::StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Maps a gRPC status code back to the vocabulary.
    pub fn from_grpc(code: tonic::Code) -> Code {
        match code {
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange => Code::InvalidArgument,
            tonic::Code::NotFound => Code::NotFound,
            tonic::Code::AlreadyExists => Code::AlreadyExists,
            tonic::Code::FailedPrecondition | tonic::Code::Aborted => Code::FailedPrecondition,
            tonic::Code::Unauthenticated => Code::Unauthenticated,
            tonic::Code::PermissionDenied => Code::PermissionDenied,
            tonic::Code::ResourceExhausted => Code::ResourceExhausted,
            tonic::Code::Unavailable | tonic::Code::Cancelled => Code::Unavailable,
            tonic::Code::DeadlineExceeded => Code::DeadlineExceeded,
            _ => Code::Internal,
        }
    }

    /// Returns the default stable reason for errors that carry none.
    pub fn default_reason(self) -> &'static str {
        match self {
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::Unauthenticated => "UNAUTHENTICATED",
            Code::PermissionDenied => "PERMISSION_DENIED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Code::Unavailable => "UNAVAILABLE",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::Internal => "INTERNAL",
        }
    }
}

/// An error as a caller sees it: a class, a stable `SCREAMING_SNAKE_CASE`
/// reason and a lowercase human-readable message free of internal details.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub code: Code,
    pub reason: Cow<'static, str>,
    pub message: String,
}

impl ApiError {
    /// Returns an error of the given class and reason.
    pub fn new(code: Code, reason: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// Returns an `InvalidArgument` error.
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, reason, message)
    }

    /// Returns a `NotFound` error.
    pub fn not_found(reason: &'static str, message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, reason, message)
    }

    /// Returns a `FailedPrecondition` error.
    pub fn precondition(reason: &'static str, message: impl Into<String>) -> Self {
        Self::new(Code::FailedPrecondition, reason, message)
    }

    /// Returns an `Unavailable` error.
    pub fn unavailable(reason: &'static str, message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, reason, message)
    }

    /// Logs `detail` and returns an `Internal` error that does not reveal it.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        tracing::error!(error = %detail, "internal error");
        Self::new(Code::Internal, "INTERNAL", "internal error")
    }

    /// Returns the gRPC status carrying the reason as `ErrorInfo` details,
    /// its message cut to [`MAX_STATUS_MESSAGE_BYTES`].
    pub fn to_status(&self) -> tonic::Status {
        bounded_status(self.code.grpc(), &self.message, Some(&self.reason))
    }

    /// Rebuilds the error from a gRPC status, keeping its reason when present.
    pub fn from_status(status: &tonic::Status) -> Self {
        let code = Code::from_grpc(status.code());
        let reason = status
            .get_details_error_info()
            .map(|info| Cow::Owned(info.reason))
            .unwrap_or(Cow::Borrowed(code.default_reason()));
        let message = match status.code() {
            // Transport failures carry transport jargon; say what it means to a caller.
            tonic::Code::Unavailable if status.message().is_empty() || reason == "UNAVAILABLE" => {
                "a backing service is unavailable".to_owned()
            }
            _ => status.message().to_owned(),
        };
        Self { code, reason, message }
    }
}

impl From<ApiError> for tonic::Status {
    fn from(err: ApiError) -> Self {
        err.to_status()
    }
}

impl From<tonic::Status> for ApiError {
    fn from(status: tonic::Status) -> Self {
        ApiError::from_status(&status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_survives_a_grpc_round_trip() {
        let err = ApiError::not_found("IMAGE_NOT_FOUND", "image img_1 not found");
        let back = ApiError::from_status(&err.to_status());
        assert_eq!(back, err);
        assert_eq!(back.code.http_status(), http::StatusCode::NOT_FOUND);
    }

    /// Issue 26 item 5: an error echoing a 17 kB id makes a status that
    /// fits any peer's header limit, its reason kept.
    #[test]
    fn statuses_are_bounded_whatever_they_echo() {
        let id = "é".repeat(17 * 1024);
        let err = ApiError::not_found("IMAGE_NOT_FOUND", format!("image {id} not found"));
        let status = err.to_status();
        assert!(
            status.message().len() <= MAX_STATUS_MESSAGE_BYTES,
            "{}",
            status.message().len()
        );
        assert!(status.message().ends_with('…'));
        assert!(status.details().len() <= 2 * MAX_STATUS_MESSAGE_BYTES);
        let mut headers = http::HeaderMap::new();
        assert!(status.add_header(&mut headers).is_ok());
        let size: usize = headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len())
            .sum();
        assert!(size < 8 * 1024, "{size} bytes of headers");
        assert_eq!(ApiError::from_status(&status).reason, "IMAGE_NOT_FOUND");
    }

    #[test]
    fn internal_errors_hide_their_detail() {
        let err = ApiError::internal("db password=hunter2 refused");
        assert_eq!(err.message, "internal error");
        assert!(!err.to_status().message().contains("hunter2"));
    }
}
