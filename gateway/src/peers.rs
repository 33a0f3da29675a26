//! The services the gateway fronts, each behind its own trait: in `avm
//! serve` the services themselves, in a mesh gRPC clients. The gateway opens
//! no database and keeps nothing of its own.

use std::time::Duration;

use avm_common::config::GrpcConfig;
use avm_proto::auth::v1::{AuthServiceHandle, AuthServiceRemote};
use avm_proto::config::v1::{ConfigServiceHandle, ConfigServiceRemote};
use avm_proto::observability::v1::{ObservabilityServiceHandle, ObservabilityServiceRemote};
use avm_proto::resource::v1::{ResourceServiceHandle, ResourceServiceRemote};
use avm_proto::runtime::v1::{RuntimeServiceHandle, RuntimeServiceRemote};
use avm_proto::session::v1::{SessionServiceHandle, SessionServiceRemote};
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

/// The services the gateway fronts; cheap to clone.
#[derive(Clone)]
pub struct Peers {
    pub auth: AuthServiceHandle,
    pub session: SessionServiceHandle,
    pub runtime: RuntimeServiceHandle,
    pub resource: ResourceServiceHandle,
    pub config: ConfigServiceHandle,
    pub observability: ObservabilityServiceHandle,
    /// The channels of the peers in other processes, for readiness: a peer
    /// is ready when any of its replicas is.
    remote: Vec<(&'static str, Vec<Channel>)>,
}

/// Channels to the gateway's peers in other processes.
#[derive(Clone, Debug)]
pub struct PeerChannels {
    pub auth: Channel,
    pub session: Channel,
    /// Every runtime replica the gateway may call (`AVM_RUNTIME_ADDR`, a
    /// comma-separated list), by address.
    pub runtime: Vec<(String, Channel)>,
    pub resource: Channel,
    pub config: Channel,
    pub observability: Channel,
}

impl Peers {
    /// Returns peers in this process (`avm serve`); they are ready when it is.
    pub fn local(
        auth: AuthServiceHandle,
        session: SessionServiceHandle,
        runtime: RuntimeServiceHandle,
        resource: ResourceServiceHandle,
        config: ConfigServiceHandle,
        observability: ObservabilityServiceHandle,
    ) -> Self {
        Self {
            auth,
            session,
            runtime,
            resource,
            config,
            observability,
            remote: Vec::new(),
        }
    }

    /// Returns gRPC clients of peers in other processes, with the shared size limits.
    pub fn remote(channels: PeerChannels, config: &GrpcConfig) -> Result<Self, avm_common::ApiError> {
        let limit = config.max_message_bytes;
        let runtime = avm_common::grpc::failover(&channels.runtime)?;
        Ok(Self {
            auth: AuthServiceRemote::new(channels.auth.clone(), limit).handle(),
            session: SessionServiceRemote::new(channels.session.clone(), limit).handle(),
            runtime: RuntimeServiceRemote::over(runtime, limit).handle(),
            resource: ResourceServiceRemote::new(channels.resource.clone(), limit).handle(),
            config: ConfigServiceRemote::new(channels.config.clone(), limit).handle(),
            observability: ObservabilityServiceRemote::new(channels.observability.clone(), limit).handle(),
            remote: vec![
                ("avm.auth.v1.AuthService", vec![channels.auth]),
                ("avm.session.v1.SessionService", vec![channels.session]),
                (
                    "avm.runtime.v1.RuntimeService",
                    channels.runtime.into_iter().map(|(_, channel)| channel).collect(),
                ),
                ("avm.resource.v1.ResourceService", vec![channels.resource]),
                ("avm.config.v1.ConfigService", vec![channels.config]),
                (
                    "avm.observability.v1.ObservabilityService",
                    vec![channels.observability],
                ),
            ],
        })
    }

    /// Returns the remote services that do not answer their health check as SERVING.
    pub async fn unhealthy(&self) -> Vec<&'static str> {
        let mut failing = Vec::new();
        for (name, channels) in &self.remote {
            let mut serving = false;
            for channel in channels {
                if serves(channel, name).await {
                    serving = true;
                    break;
                }
            }
            if !serving {
                failing.push(*name);
            }
        }
        failing
    }
}

/// Returns whether the peer at `channel` answers its health check for `name` as SERVING.
async fn serves(channel: &Channel, name: &str) -> bool {
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let request = tonic_health::pb::HealthCheckRequest {
        service: name.to_owned(),
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), client.check(request)).await,
        Ok(Ok(response)) if response.get_ref().status == ServingStatus::Serving as i32
    )
}
