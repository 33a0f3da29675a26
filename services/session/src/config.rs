//! Settings of the session service (`[session]`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::retention::DEFAULT_RETENTION_INTERVAL;

/// Settings of the session service.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    /// How often the retention sweeper applies every tenant's policy
    /// (`AVM_SESSION_RETENTION_INTERVAL`, e.g. `1h`); `0s` turns it off.
    #[serde(with = "humantime_serde")]
    pub retention_interval: Duration,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            retention_interval: DEFAULT_RETENTION_INTERVAL,
        }
    }
}
