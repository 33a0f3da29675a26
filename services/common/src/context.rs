//! The explicit request context every cross-component call carries: who is
//! calling (verified), under which request id, and the credential to forward.

use std::sync::Arc;

use tonic::metadata::MetadataValue;

use crate::ApiError;
use crate::auth::{ON_BEHALF_OF_HEADER, Principal, Role, Scopes};
use crate::trace::{TRACEPARENT, TraceParent};

/// Metadata key carrying the caller's request id across hops.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Response metadata key of the runtime's `SubscribeEvents`: the cursor of
/// the session's latest event when the stream began.
pub const START_CURSOR_HEADER: &str = "avm-start-cursor";

/// Who is asking, under which request id, with which credential.
#[derive(Clone, Debug)]
pub struct RequestContext {
    /// The tenant whose data the request may touch (the principal's).
    pub tenant_id: String,
    /// Correlates log lines of one request across components.
    pub request_id: String,
    /// The verified caller.
    pub principal: Arc<Principal>,
    /// The trace the request belongs to (W3C trace context).
    pub trace: TraceParent,
    /// The access token forwarded on calls made for this request.
    credential: Option<Arc<str>>,
}

impl RequestContext {
    /// Records this caller on the current request span (see
    /// `telemetry::request_span`), so the events that follow carry its
    /// tenant and request id.
    pub fn record_in_span(&self) {
        let span = tracing::Span::current();
        span.record("tenant_id", self.tenant_id.as_str());
        span.record("request_id", self.request_id.as_str());
    }

    /// Returns the context of a verified principal, starting a new trace.
    pub fn new(principal: Principal, credential: Option<Arc<str>>, request_id: String) -> Self {
        Self {
            tenant_id: principal.tenant_id.clone(),
            request_id,
            principal: Arc::new(principal),
            trace: TraceParent::root(),
            credential,
        }
    }

    /// Returns the same context within the trace `trace`.
    pub fn with_trace(self, trace: TraceParent) -> Self {
        Self { trace, ..self }
    }

    /// Returns the same caller under another request id.
    pub fn with_request_id(&self, request_id: String) -> Self {
        Self {
            request_id,
            ..self.clone()
        }
    }

    /// Returns the access token this context forwards.
    pub fn credential(&self) -> Option<&str> {
        self.credential.as_deref()
    }

    /// Returns the user whose containers bound the caller's view, `None` for
    /// the whole tenant (admins and services).
    pub fn owner_filter(&self) -> Option<&str> {
        self.principal.container_owner_filter()
    }

    /// Fails with PERMISSION_DENIED unless the caller holds `scope`.
    pub fn require(&self, scope: Scopes) -> Result<(), ApiError> {
        self.principal.require(scope)
    }

    /// Returns a gRPC request carrying this context: in its metadata for a
    /// call to another process, and as itself in its extensions for a call
    /// in this process (which then needs no verification).
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.extensions_mut().insert(self.clone());
        let metadata = request.metadata_mut();
        if let Ok(value) = MetadataValue::try_from(self.request_id.as_str()) {
            metadata.insert(REQUEST_ID_HEADER, value);
        }
        if let Ok(value) = MetadataValue::try_from(crate::telemetry::outgoing_trace(&self.trace).header()) {
            metadata.insert(TRACEPARENT, value);
        }
        if let Some(token) = &self.credential
            && let Ok(value) = MetadataValue::try_from(format!("Bearer {token}"))
        {
            metadata.insert("authorization", value);
        }
        if self.principal.role == Role::Service
            && let Ok(value) = MetadataValue::try_from(self.tenant_id.as_str())
        {
            metadata.insert(ON_BEHALF_OF_HEADER, value);
        }
        request
    }
}

/// Returns the caller's request id (`x-request-id`) when it is usable, or a new one.
pub fn request_id_from_headers(headers: &http::HeaderMap) -> String {
    headers
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| crate::ids::new_id("req"))
}
