//! Serving the gateway: its state, router and listener, until shutdown.
//!
//! The gateway runs its own accept loop on hyper's HTTP/1.1 connection rather
//! than `axum::serve`, which offers no hold on hyper's builder: every request
//! head is checked first ([`crate::heads`]), per-connection buffers are bounded
//! and a connection waiting for its next request is closed after
//! [`GatewayConfig::keep_alive_timeout`].

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use futures::FutureExt;
use futures::future::{Either, Ready};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tower::Service;

use crate::auth::Authenticator;
use crate::config::GatewayConfig;
use crate::heads::{Checked, Verdicts};
use crate::limits::RateLimiter;
use crate::peers::Peers;
use crate::router;
use crate::state::GatewayState;

/// hyper's smallest allowed read buffer. hyper grows a connection's read
/// buffer up to this bound (raised to hold a head of `max_head_bytes`) and
/// keeps it while the connection idles; its growth with the reads that fill
/// it (a request body) is avoided by [`crate::heads`], which reads less at
/// once. With hyper's default (~400 KB) and growth, an idle keep-alive
/// connection that had sent a 60 kB body kept 42 KiB (issue 26 item 19).
const MAX_BUF_BYTES: usize = 8 * 1024;

/// How long the accept loop pauses when accepting fails for lack of
/// resources (file descriptors): retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

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
    let http1 = http1_builder(&config);
    let max_head_bytes = config.max_head_bytes;
    let state = Arc::new(GatewayState {
        config,
        peers,
        auth,
        limiter,
        connections: AtomicUsize::new(0),
        stopping,
        shutdown: shutdown.clone(),
        openapi: router::openapi_json(),
        users: crate::users::UserFeeds::default(),
    });
    let app = router::router(state);
    // Every connection holds a receiver; shutdown waits until all are dropped.
    let (open_tx, open_rx) = watch::channel(());
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    accept_failed(&err).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let connection = Connection {
            app: app.clone(),
            peer,
            verdicts: Arc::default(),
            max_head_bytes,
        };
        tokio::spawn(serve_connection(
            tcp,
            connection,
            http1.clone(),
            shutdown.clone(),
            open_rx.clone(),
        ));
    }
    drop(listener);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

/// hyper's HTTP/1.1 settings: buffers bounded, and an idle connection closed
/// once it has waited `keep_alive_timeout` for its next request's head.
fn http1_builder(config: &GatewayConfig) -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(config.keep_alive_timeout)
        .max_buf_size(MAX_BUF_BYTES.max(config.max_head_bytes))
        .max_headers(crate::heads::MAX_HEADERS);
    builder
}

/// Accepting failed: a connection reset before it was accepted is nothing;
/// running out of descriptors pauses the loop instead of spinning on it.
async fn accept_failed(err: &std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(err.kind(), ConnectionAborted | ConnectionRefused | ConnectionReset) {
        return;
    }
    tracing::error!(error = %err, "cannot accept a connection");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

/// Serves one connection until it closes; at shutdown, lets its request in
/// flight finish and then closes it.
async fn serve_connection(
    tcp: TcpStream,
    connection: Connection,
    http1: hyper::server::conn::http1::Builder,
    shutdown: CancellationToken,
    _open: watch::Receiver<()>,
) {
    // Nagle's algorithm would hold a small frame (a token's delta) until the
    // peer's delayed ACK, about 40 ms: every accepted socket sends at once.
    if let Err(err) = tcp.set_nodelay(true) {
        tracing::debug!(error = %err, "cannot set TCP_NODELAY");
    }
    let io = Checked::new(tcp, Arc::clone(&connection.verdicts), connection.max_head_bytes);
    let served = http1.serve_connection(TokioIo::new(io), connection).with_upgrades();
    tokio::pin!(served);
    let result = tokio::select! {
        result = served.as_mut() => result,
        () = shutdown.cancelled() => {
            served.as_mut().graceful_shutdown();
            served.await
        }
    };
    if let Err(err) = result {
        tracing::trace!(error = %err, "connection ended with an error");
    }
}

/// The service of one connection: the router, with the peer's address (the
/// per-client limit of failed token exchanges) and the refusal of a
/// malformed head in its turn.
#[derive(Clone)]
struct Connection {
    app: Router,
    peer: SocketAddr,
    verdicts: Arc<Verdicts>,
    max_head_bytes: usize,
}

type Routed = axum::routing::future::RouteFuture<Infallible>;

/// An answer to a request that asked to upgrade.
type UpgradeAnswer = futures::future::Map<Routed, fn(Result<Response, Infallible>) -> Result<Response, Infallible>>;

impl hyper::service::Service<hyper::Request<Incoming>> for Connection {
    type Response = Response;
    type Error = Infallible;
    type Future = Either<Ready<Result<Response, Infallible>>, Either<Routed, UpgradeAnswer>>;

    fn call(&self, request: hyper::Request<Incoming>) -> Self::Future {
        if let Some(refusal) = self.verdicts.on_request() {
            return Either::Left(futures::future::ready(Ok(refusal.response(self.max_head_bytes))));
        }
        let upgrade = request.method() == hyper::Method::CONNECT || request.headers().contains_key(header::UPGRADE);
        let mut request: Request = request.map(Body::new);
        request.extensions_mut().insert(ConnectInfo(self.peer));
        let routed = self.app.clone().call(request);
        if !upgrade {
            return Either::Right(Either::Left(routed));
        }
        // What follows a request asking to upgrade goes to hyper unchecked
        // (it may be the upgraded protocol's): when it was not upgraded,
        // the connection ends with the answer, so no later head is read
        // unchecked.
        let close_unless_upgraded: fn(Result<Response, Infallible>) -> Result<Response, Infallible> = |answer| {
            answer.map(|mut response| {
                if response.status() != StatusCode::SWITCHING_PROTOCOLS {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                response
            })
        };
        Either::Right(Either::Right(routed.map(close_unless_upgraded)))
    }
}
