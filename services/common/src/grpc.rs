//! gRPC server and channel builders with the settings every component shares:
//! health, reflection, message-size limits, keepalive, request timeout and a
//! bounded graceful drain.

use std::convert::Infallible;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::ApiError;
use crate::config::GrpcConfig;

/// Errors of serving gRPC.
#[derive(Debug, thiserror::Error)]
pub enum GrpcError {
    #[error("grpc server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("cannot build reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
}

/// Collects services and serves them with health and reflection.
///
/// Services apply `config.max_message_bytes` to their generated server type
/// themselves, since the limit is a method of each generated type.
pub struct GrpcServer {
    config: GrpcConfig,
    routes: RoutesBuilder,
    names: Vec<&'static str>,
}

impl GrpcServer {
    /// Returns an empty server using the shared gRPC settings.
    pub fn new(config: &GrpcConfig) -> Self {
        Self {
            config: config.clone(),
            routes: RoutesBuilder::default(),
            names: Vec::new(),
        }
    }

    /// Adds a service; health reports it SERVING until shutdown.
    pub fn add_service<S>(mut self, service: S) -> Self
    where
        S: tower::Service<http::Request<Body>, Error = Infallible> + NamedService + Clone + Send + Sync + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.names.push(S::NAME);
        self.routes.add_service(service);
        self
    }

    /// Serves until `shutdown` is cancelled, then flips health to NOT_SERVING,
    /// stops accepting, and gives in-flight calls `drain_timeout` to finish.
    pub async fn serve(self, listener: TcpListener, shutdown: CancellationToken) -> Result<(), GrpcError> {
        let (reporter, health) = tonic_health::server::health_reporter();
        for name in &self.names {
            reporter.set_service_status(*name, ServingStatus::Serving).await;
        }
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(avm_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        let mut routes = self.routes;
        routes.add_service(health).add_service(reflection);

        let config = self.config;
        let incoming = TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(config.keepalive_interval));
        let stop_accepting = CancellationToken::new();
        let stop = stop_accepting.clone();
        let server = Server::builder()
            .timeout(config.request_timeout)
            .http2_keepalive_interval(Some(config.keepalive_interval))
            .http2_keepalive_timeout(Some(config.keepalive_timeout))
            .add_routes(routes.routes())
            .serve_with_incoming_shutdown(incoming, async move { stop.cancelled().await });
        tokio::pin!(server);
        tokio::select! {
            result = &mut server => return result.map_err(GrpcError::from),
            () = shutdown.cancelled() => {}
        }
        set_all(&reporter, &self.names, ServingStatus::NotServing).await;
        stop_accepting.cancel();
        match tokio::time::timeout(config.drain_timeout, server).await {
            Ok(result) => result.map_err(GrpcError::from),
            Err(_) => {
                tracing::warn!(timeout = ?config.drain_timeout, "grpc drain timed out; closing remaining calls");
                Ok(())
            }
        }
    }
}

async fn set_all(reporter: &HealthReporter, names: &[&'static str], status: ServingStatus) {
    reporter.set_service_status("", status).await;
    for name in names {
        reporter.set_service_status(*name, status).await;
    }
}

/// Returns a lazily connecting channel to a peer with the shared timeouts and keepalive.
pub fn channel(addr: &str, config: &GrpcConfig) -> Result<Channel, ApiError> {
    let endpoint = Endpoint::from_shared(addr.to_owned())
        .map_err(|_| ApiError::invalid("INVALID_PEER_ADDRESS", format!("invalid peer address {addr:?}")))?;
    Ok(endpoint
        .connect_timeout(config.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(config.keepalive_interval)
        .keep_alive_timeout(config.keepalive_timeout)
        .keep_alive_while_idle(true)
        .connect_lazy())
}
