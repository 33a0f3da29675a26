//! What every request handler of the gateway shares.

use std::sync::atomic::AtomicUsize;

use axum::body::Bytes;
use tokio_util::sync::CancellationToken;

use crate::auth::Authenticator;
use crate::config::GatewayConfig;
use crate::limits::RateLimiter;
use crate::peers::Peers;
use crate::users::UserFeeds;

/// What every request handler of the gateway shares.
pub struct GatewayState {
    pub config: GatewayConfig,
    pub peers: Peers,
    /// Who is calling.
    pub auth: Authenticator,
    /// Requests per minute per tenant and key.
    pub limiter: RateLimiter,
    /// Open WebSocket connections.
    pub connections: AtomicUsize,
    /// Cancelled when the process begins to stop: `/ready` answers 503
    /// while running turns finish.
    pub stopping: CancellationToken,
    /// Cancelled at shutdown; open WebSockets close with 1001.
    pub shutdown: CancellationToken,
    /// The OpenAPI document, rendered once.
    pub openapi: Bytes,
    /// Each connected user's feed of what changes in their containers.
    pub users: UserFeeds,
}
