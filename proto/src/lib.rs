//! AgentVM's gRPC contracts: generated message types, clients and servers.

#![allow(missing_docs, clippy::all)]

/// Auth service contracts (`avm.auth.v1`).
pub mod auth {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.auth.v1");
    }
}

/// Session service contracts (`avm.session.v1`).
pub mod session {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.session.v1");
    }
}

/// Runtime service contracts (`avm.runtime.v1`).
pub mod runtime {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.runtime.v1");
    }
}

/// Resource service contracts (`avm.resource.v1`).
pub mod resource {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.resource.v1");
    }
}

/// Config service contracts (`avm.config.v1`).
pub mod config {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.config.v1");
    }
}

/// Observability service contracts (`avm.observability.v1`).
pub mod observability {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("avm.observability.v1");
    }
}

/// Returns the encoded descriptor set of every AgentVM service, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/avm_descriptor.bin"));
