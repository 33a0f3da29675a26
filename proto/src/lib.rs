//! AgentVM's gRPC contracts: generated message types, clients and servers,
//! and for each service its two peers behind the service's own trait —
//! `<Service>Remote`, a gRPC client, and `<Service>Local`, the service's
//! adapter in this process — so a caller holds a `<Service>Handle` and never
//! knows which (Quickwit's local-or-remote client).

#![allow(missing_docs, clippy::all)]

use std::future::Future;
use std::pin::Pin;

/// A stream of a server-streaming RPC, as every peer returns it.
pub type BoxStream<T> = Pin<Box<dyn tonic::codegen::tokio_stream::Stream<Item = Result<T, tonic::Status>> + Send>>;

/// What a `<Service>Remote` sends its calls through: a channel to one peer,
/// or anything else that carries gRPC requests (several peers behind one).
pub type Transport = tower::util::BoxCloneSyncService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    TransportError,
>;

/// Why a [`Transport`] could not carry a call.
#[derive(Debug)]
pub struct TransportError(pub Box<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for TransportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for TransportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// Returns `channel` as a [`Transport`].
pub fn transport(channel: tonic::transport::Channel) -> Transport {
    use tower::ServiceExt;
    Transport::new(channel.map_err(|err| TransportError(Box::new(err))))
}

/// Watches the calls a `<Service>Local` makes in process, as the gRPC server
/// watches the calls it serves (a span in the caller's trace, metrics).
pub trait Observe: Send + Sync + 'static {
    /// What a call carries from its start to its end.
    type Call: Send;

    /// Starts observing a call of `component`'s `method` with the request's metadata.
    fn begin(
        &self,
        component: &'static str,
        method: &'static str,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Self::Call;

    /// Runs the call, observed.
    fn run<T: Send>(
        &self,
        call: Self::Call,
        future: impl Future<Output = Result<tonic::Response<T>, tonic::Status>> + Send,
    ) -> impl Future<Output = Result<tonic::Response<T>, tonic::Status>> + Send;
}

/// Auth service contracts (`avm.auth.v1`).
pub mod auth {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.auth.v1");
        include!(concat!(env!("OUT_DIR"), "/avm.auth.v1.peers.rs"));
    }
}

/// Session service contracts (`avm.session.v1`).
pub mod session {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.session.v1");
        include!(concat!(env!("OUT_DIR"), "/avm.session.v1.peers.rs"));
    }
}

/// Runtime service contracts (`avm.runtime.v1`).
pub mod runtime {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.runtime.v1");
        include!(concat!(env!("OUT_DIR"), "/avm.runtime.v1.peers.rs"));
    }
}

/// Resource service contracts (`avm.resource.v1`).
pub mod resource {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.resource.v1");
        include!(concat!(env!("OUT_DIR"), "/avm.resource.v1.peers.rs"));
    }
}

/// Config service contracts (`avm.config.v1`).
pub mod config {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.config.v1");
        include!(concat!(env!("OUT_DIR"), "/avm.config.v1.peers.rs"));
    }
}

/// Observability service contracts (`avm.observability.v1`).
pub mod observability {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.observability.v1");
        include!(concat!(env!("OUT_DIR"), "/avm.observability.v1.peers.rs"));
    }
}

/// Sandbox service contracts (`avm.sandbox.v1`).
pub mod sandbox {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.sandbox.v1");
        include!(concat!(env!("OUT_DIR"), "/avm.sandbox.v1.peers.rs"));
    }
}

/// Returns the encoded descriptor set of every AgentVM service, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/avm_descriptor.bin"));
