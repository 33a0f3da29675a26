//! The whole configuration document: every component's section in one place.

use avm_common::auth::AuthConfig;
use avm_common::config::{DatabaseConfig, GrpcConfig, LogConfig, PeersConfig, RedisConfig, ServerConfig};
use avm_gateway::GatewayConfig;
use avm_runtime::{LlmConfig, RuntimeConfig};
use serde::{Deserialize, Serialize};

/// AgentVM's configuration, loaded by `avm_common::config::load`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AvmConfig {
    pub server: ServerConfig,
    pub grpc: GrpcConfig,
    pub log: LogConfig,
    pub database: DatabaseConfig,
    pub redis: RedisConfig,
    pub peers: PeersConfig,
    pub auth: AuthConfig,
    pub gateway: GatewayConfig,
    pub runtime: RuntimeConfig,
    pub llm: LlmConfig,
}
