//! Serving the gateway: its state, router and listener, until shutdown.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::auth::Authenticator;
use crate::config::GatewayConfig;
use crate::limits::RateLimiter;
use crate::peers::Peers;
use crate::router;
use crate::state::GatewayState;

/// Serves the gateway on `listener` until `shutdown`, then lets in-flight
/// HTTP requests finish; from `stopping` on, `/ready` answers not ready.
pub async fn serve(
    listener: TcpListener,
    config: GatewayConfig,
    peers: Peers,
    auth: Authenticator,
    limiter: RateLimiter,
    stopping: CancellationToken,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    // Metrics recorded before the recorder exists are lost: install it now.
    avm_common::telemetry::metrics();
    let state = Arc::new(GatewayState {
        config,
        peers,
        auth,
        limiter,
        connections: AtomicUsize::new(0),
        stopping,
        shutdown: shutdown.clone(),
        openapi: router::openapi_json(),
    });
    let app = router::router(state);
    // Nagle's algorithm would hold a small frame (a token's delta) until the
    // peer's delayed ACK, about 40 ms: every accepted socket sends at once.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
    });
    // Each request knows its peer's address: failed token exchanges are
    // limited per client.
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(async move { shutdown.cancelled().await })
    .await
}
