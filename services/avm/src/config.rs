//! The whole configuration document: every component's section in one place.

use avm_common::auth::AuthConfig;
use avm_common::config::{DatabaseConfig, GrpcConfig, LogConfig, PeersConfig, RedisConfig, ServerConfig};
use avm_common::settings;
use avm_config::{ConfigServiceConfig, Deployment};
use avm_gateway::GatewayConfig;
use avm_runtime::{BillingConfig, LlmConfig, RuntimeConfig};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

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
    pub billing: BillingConfig,
    pub config: ConfigServiceConfig,
}

impl AvmConfig {
    /// Returns the layers the config service starts from: the built-in
    /// defaults, and what this configuration (file, environment, flags) made
    /// of them.
    pub fn deployment(&self) -> Deployment {
        Deployment {
            defaults: AvmConfig::default().settings_tree(),
            values: self.settings_tree(),
        }
    }

    fn settings_tree(&self) -> Map<String, Value> {
        let mut tree = self.llm.settings_tree();
        tree.extend(self.runtime.settings_tree());
        tree.extend(self.billing.settings_tree());
        tree.insert(
            settings::SYSTEM_DATA_DIR.into(),
            Value::from(self.server.data_dir.clone()),
        );
        tree.insert(settings::SYSTEM_LOG_LEVEL.into(), Value::from(self.log.level.clone()));
        tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_the_deployment_layer_is_in_the_config_schema() {
        let deployment = AvmConfig::default().deployment();
        for (key, value) in &deployment.values {
            let spec = avm_config::schema::spec(key).unwrap_or_else(|| panic!("{key} is not in the config schema"));
            if !value.is_null() {
                assert_eq!(spec.check(value).as_ref(), Ok(value), "{key}");
            }
        }
    }
}
