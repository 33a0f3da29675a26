//! The config service's own settings (`[config]`, `AVM_CONFIG_*`).

use avm_common::config::Secret;
use serde::{Deserialize, Serialize};

/// Settings of the config service.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConfigServiceConfig {
    /// Key material (32+ characters) that seals stored secrets; the same on
    /// every replica, kept like a password. `avm serve` makes one in its data
    /// dir (`config.key`) when unset.
    pub secret_key: Secret,
}
