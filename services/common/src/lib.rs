//! Shared foundation of every AgentVM component: layered configuration,
//! telemetry, the error vocabulary, gRPC server and channel builders, the
//! token check, request context, ids and the process lifecycle. Databases
//! are `avm-store`'s, for the services that store.

pub mod address;
pub mod auth;
pub mod backoff;
pub mod calendar;
pub mod config;
pub mod context;
pub mod error;
pub mod event;
pub mod grpc;
pub mod ids;
pub mod lifecycle;
pub mod mcp;
pub mod money;
pub mod settings;
pub mod shutdown;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tools;
pub mod trace;

pub use context::RequestContext;
pub use error::{ApiError, Code};

/// Returns the current Unix time in milliseconds.
pub fn now_ms() -> i64 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
}
