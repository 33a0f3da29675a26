//! Calls from one runtime replica to another: the clients of the others, by
//! address, and the mark a call sent on carries (a call is sent on once).

use std::collections::HashMap;
use std::sync::Mutex;

use avm_common::ApiError;
use avm_common::config::GrpcConfig;
use avm_proto::runtime::v1::RuntimeServiceRemote;
use tonic::Request;
use tonic::metadata::MetadataMap;

/// Marks a call one replica sent on to another.
const FORWARDED: &str = "avm-forwarded";

/// Clients of the other runtime replicas, made on first use.
pub(crate) struct Remotes {
    config: GrpcConfig,
    clients: Mutex<HashMap<String, RuntimeServiceRemote>>,
}

impl Remotes {
    pub(crate) fn new(config: GrpcConfig) -> Self {
        Self {
            config,
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// Returns the client of the replica at `addr`.
    pub(crate) fn client(&self, addr: &str) -> Result<RuntimeServiceRemote, ApiError> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(client) = clients.get(addr) {
            return Ok(client.clone());
        }
        let channel = avm_common::grpc::channel(addr, &self.config)?;
        let client = RuntimeServiceRemote::new(channel, self.config.max_message_bytes);
        clients.insert(addr.to_owned(), client.clone());
        Ok(client)
    }
}

/// Returns whether another replica sent this call on.
pub fn forwarded<T>(request: &Request<T>) -> bool {
    request.metadata().contains_key(FORWARDED)
}

/// Returns `message` as a call sent on: the caller's metadata (its token,
/// its trace), marked so that the replica it reaches sends it nowhere else.
pub fn relay_message<U>(metadata: &MetadataMap, message: U) -> Request<U> {
    let mut relayed = Request::new(message);
    *relayed.metadata_mut() = metadata.clone();
    relayed
        .metadata_mut()
        .insert(FORWARDED, tonic::metadata::MetadataValue::from_static("1"));
    relayed
}
