//! The services the gateway fronts, as clients; the gateway opens no
//! database and keeps nothing of its own.

use std::time::Duration;

use avm_common::config::GrpcConfig;
use avm_proto::auth::v1::auth_service_client::AuthServiceClient;
use avm_proto::config::v1::config_service_client::ConfigServiceClient;
use avm_proto::observability::v1::observability_service_client::ObservabilityServiceClient;
use avm_proto::resource::v1::resource_service_client::ResourceServiceClient;
use avm_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;

/// Clients of the services the gateway fronts; cheap to clone.
#[derive(Clone)]
pub struct Peers {
    pub auth: AuthServiceClient<Channel>,
    pub session: SessionServiceClient<Channel>,
    pub runtime: RuntimeServiceClient<Channel>,
    pub resource: ResourceServiceClient<Channel>,
    pub config: ConfigServiceClient<Channel>,
    pub observability: ObservabilityServiceClient<Channel>,
    /// Raw channels, for health checks.
    channels: Vec<(&'static str, Channel)>,
}

/// Channels to the gateway's peers.
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
    /// Returns clients over the given channels with the shared size limits.
    pub fn new(peers: PeerChannels, config: &GrpcConfig) -> Self {
        let limit = config.max_message_bytes;
        Self {
            auth: AuthServiceClient::new(peers.auth.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            session: SessionServiceClient::new(peers.session.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            runtime: RuntimeServiceClient::new(peers.runtime.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            resource: ResourceServiceClient::new(peers.resource.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            config: ConfigServiceClient::new(peers.config.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            observability: ObservabilityServiceClient::new(peers.observability.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            channels: vec![
                ("avm.auth.v1.AuthService", peers.auth),
                ("avm.session.v1.SessionService", peers.session),
                ("avm.runtime.v1.RuntimeService", peers.runtime),
                ("avm.resource.v1.ResourceService", peers.resource),
                ("avm.config.v1.ConfigService", peers.config),
                ("avm.observability.v1.ObservabilityService", peers.observability),
            ],
        }
    }

    /// Returns the services that do not answer their health check as SERVING.
    pub async fn unhealthy(&self) -> Vec<&'static str> {
        let mut failing = Vec::new();
        for (name, channel) in &self.channels {
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
