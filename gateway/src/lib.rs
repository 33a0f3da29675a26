//! The AgentVM gateway: the public HTTP + WebSocket edge, translating to the
//! services' gRPC APIs. It owns nothing persistent and opens no database.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub mod admin;
pub mod auth;
pub mod backends;
pub mod config;
pub mod limits;
pub mod resources;
pub mod rest;
pub mod settings;
pub mod usage;
pub mod wire;
pub mod ws;

pub use auth::Authenticator;
pub use backends::{Backends, PeerChannels};
pub use config::GatewayConfig;
pub use limits::RateLimiter;

/// What every request handler of the gateway shares.
pub struct GatewayState {
    pub config: GatewayConfig,
    pub backends: Backends,
    /// Who is calling.
    pub auth: Authenticator,
    /// Requests per minute per tenant and key.
    pub limiter: RateLimiter,
    /// Open WebSocket connections.
    pub connections: AtomicUsize,
    /// Cancelled at shutdown; open WebSockets close with 1001.
    pub shutdown: CancellationToken,
}

/// Serves the gateway on `listener` until `shutdown`, then lets in-flight
/// HTTP requests finish.
pub async fn serve(
    listener: TcpListener,
    config: GatewayConfig,
    backends: Backends,
    auth: Authenticator,
    limiter: RateLimiter,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    // Metrics recorded before the recorder exists are lost: install it now.
    avm_common::telemetry::metrics();
    let state = Arc::new(GatewayState {
        config,
        backends,
        auth,
        limiter,
        connections: AtomicUsize::new(0),
        shutdown: shutdown.clone(),
    });
    let app = rest::router(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}
