//! A config service on a fresh database, and helpers.

use std::sync::Arc;

use avm_common::ApiError;
use avm_common::settings;
use avm_config::{ConfigError, ConfigService, ConfigStore, Deployment, Snapshot, Source, open_store};
use avm_store::testing::TestDatabase;
use serde_json::{Map, Value, json};

/// The key that seals secrets in these tests.
pub const SECRET_KEY: &str = "test-secret-key-0123456789abcdef0123";

/// A secret no response or stored row may ever show.
pub const CANARY: &str = "sk-canary-7f3a9c2e-do-not-leak";

/// A service on a database made for the test.
pub struct Harness {
    pub service: ConfigService,
    pub store: Arc<dyn ConfigStore>,
    pub db: TestDatabase,
}

impl Harness {
    /// Returns a service on `db` with the test deployment.
    pub async fn on(db: TestDatabase) -> Harness {
        let store = open_store(&db.url, Some(4)).await.expect("open config store");
        let service = ConfigService::new(Arc::clone(&store), deployment(), SECRET_KEY).expect("config service");
        Harness { service, store, db }
    }

    /// Returns another service (a second replica) on the same database.
    pub async fn replica(&self) -> ConfigService {
        let store = open_store(&self.db.url, Some(4)).await.expect("open config store");
        ConfigService::new(store, deployment(), SECRET_KEY).expect("config service")
    }
}

/// The deployment layers of these tests: the built-in model, a deployment
/// that changed `defaults.maxTokens` and set an API key.
pub fn deployment() -> Deployment {
    let mut defaults = Map::new();
    defaults.insert(settings::LLM_MODEL.into(), json!("claude-sonnet-4-20250514"));
    defaults.insert(settings::DEFAULTS_MAX_TOKENS.into(), json!(4096));
    defaults.insert(settings::DEFAULTS_TIMEOUT.into(), json!("1m"));
    let mut values = defaults.clone();
    values.insert(settings::DEFAULTS_MAX_TOKENS.into(), json!(2048));
    values.insert(settings::LLM_API_KEY.into(), json!("sk-deployment-key-0001"));
    Deployment { defaults, values }
}

/// Returns the value and source of `key` in a snapshot.
pub fn entry(snapshot: &Snapshot, key: &str) -> (Value, Source) {
    let entry = snapshot
        .entries
        .iter()
        .find(|entry| entry.spec.key == key)
        .unwrap_or_else(|| panic!("no entry {key}"));
    (entry.value.clone(), entry.source)
}

/// Returns `(key, JSON)` pairs for an update.
pub fn values(pairs: &[(&str, Value)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(key, value)| ((*key).to_owned(), value.to_string()))
        .collect()
}

/// Returns the error a caller would see, failing the test when there is none.
pub fn api_err<T: std::fmt::Debug>(result: Result<T, ConfigError>) -> ApiError {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(err) => ApiError::from(err),
    }
}
