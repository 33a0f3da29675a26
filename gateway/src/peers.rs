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
    /// The channels of the peers in other processes, for readiness.
    remote: Vec<(&'static str, Channel)>,
}

/// Channels to the gateway's peers in other processes.
#[derive(Clone, Debug)]
pub struct PeerChannels {
    pub auth: Channel,
    pub session: Channel,
    pub runtime: Channel,
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
    pub fn remote(channels: PeerChannels, config: &GrpcConfig) -> Self {
        let limit = config.max_message_bytes;
        Self {
            auth: AuthServiceRemote::new(channels.auth.clone(), limit).handle(),
            session: SessionServiceRemote::new(channels.session.clone(), limit).handle(),
            runtime: RuntimeServiceRemote::new(channels.runtime.clone(), limit).handle(),
            resource: ResourceServiceRemote::new(channels.resource.clone(), limit).handle(),
            config: ConfigServiceRemote::new(channels.config.clone(), limit).handle(),
            observability: ObservabilityServiceRemote::new(channels.observability.clone(), limit).handle(),
            remote: vec![
                ("avm.auth.v1.AuthService", channels.auth),
                ("avm.session.v1.SessionService", channels.session),
                ("avm.runtime.v1.RuntimeService", channels.runtime),
                ("avm.resource.v1.ResourceService", channels.resource),
                ("avm.config.v1.ConfigService", channels.config),
                ("avm.observability.v1.ObservabilityService", channels.observability),
            ],
        }
    }

    /// Returns the remote services that do not answer their health check as SERVING.
    pub async fn unhealthy(&self) -> Vec<&'static str> {
        let mut failing = Vec::new();
        for (name, channel) in &self.remote {
            let mut client = tonic_health::pb::health_client::HealthClient::new(channel.clone());
            let request = tonic_health::pb::HealthCheckRequest {
                service: (*name).to_owned(),
            };
            let serving = matches!(
                tokio::time::timeout(Duration::from_secs(2), client.check(request)).await,
                Ok(Ok(response)) if response.get_ref().status == ServingStatus::Serving as i32
            );
            if !serving {
                failing.push(*name);
            }
        }
        failing
    }
}
