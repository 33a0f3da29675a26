//! The explicit request context every cross-component call carries.

use tonic::metadata::{MetadataMap, MetadataValue};

/// Metadata key carrying the caller's request id across hops.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The tenant that owns everything until the auth service assigns real tenants.
pub const LOCAL_TENANT: &str = "local";

/// Who is asking and under which request id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestContext {
    /// The tenant whose data the request may touch.
    pub tenant_id: String,
    /// Correlates log lines of one request across components.
    pub request_id: String,
}

impl RequestContext {
    /// Returns a context for the local tenant with a fresh request id.
    pub fn local() -> Self {
        Self {
            tenant_id: LOCAL_TENANT.to_owned(),
            request_id: crate::ids::new_id("req"),
        }
    }

    /// Reads the context of an incoming gRPC request.
    ///
    /// The tenant is the local one: it is never taken from a header, because a
    /// header is caller-controlled. The auth service's verified token will
    /// supply it.
    pub fn from_metadata(metadata: &MetadataMap) -> Self {
        let request_id = metadata
            .get(REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty() && v.len() <= 128)
            .map(str::to_owned)
            .unwrap_or_else(|| crate::ids::new_id("req"));
        Self {
            tenant_id: LOCAL_TENANT.to_owned(),
            request_id,
        }
    }

    /// Returns a gRPC request carrying this context in its metadata.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Ok(value) = MetadataValue::try_from(self.request_id.as_str()) {
            request.metadata_mut().insert(REQUEST_ID_HEADER, value);
        }
        request
    }
}
