//! Runtime settings: the agent pool and the LLM it talks to.

use std::time::Duration;

use avm_common::config::Secret;
use avm_common::settings;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// The agent pool's settings (`[runtime]`, `AVM_RUNTIME_*`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// An agent with no turn for this long is dropped from memory; the next
    /// message rehydrates it from the session service.
    #[serde(with = "humantime_serde")]
    pub agent_idle_timeout: Duration,
    /// How many recent events of each active session are kept for resuming subscribers.
    pub event_retention: usize,
    /// How long recent events are kept; afterwards an idle session holds none
    /// (a client resuming later reloads the history instead).
    #[serde(with = "humantime_serde")]
    pub event_retention_period: Duration,
    /// Capacity of each subscriber's queue; a subscriber that falls this far
    /// behind is cut off with a typed error.
    pub subscriber_queue: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            agent_idle_timeout: Duration::from_secs(600),
            event_retention: 1024,
            event_retention_period: Duration::from_secs(120),
            subscriber_queue: 1024,
        }
    }
}

/// Which LLM API to speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    Anthropic,
    Openai,
    Offline,
}

/// LLM settings (`[llm]`, `LLM_*` or `AVM_LLM_*`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LlmConfig {
    /// `anthropic`, `openai` (any OpenAI-compatible server) or `offline`;
    /// unset means `anthropic` when an API key is set and `offline` otherwise.
    pub provider: Option<ProviderKind>,
    /// The provider's API key.
    pub api_key: Secret,
    /// The API root: for `anthropic` without `/v1` (default
    /// `https://api.anthropic.com`), for `openai` with it (default `https://api.openai.com/v1`).
    pub base_url: Option<String>,
    /// The model name sent to the provider.
    pub model: String,
    /// The largest reply, in tokens.
    pub max_tokens: u32,
    /// Time allowed to connect and receive the response headers.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Time allowed between two chunks of a streaming reply.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
}

impl Default for LlmConfig {
    fn default() -> Self {
        Self {
            provider: None,
            api_key: Secret::default(),
            base_url: None,
            model: "claude-sonnet-4-20250514".to_owned(),
            max_tokens: 4096,
            request_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

impl LlmConfig {
    /// Returns the provider in effect, resolving an unset one from the key.
    pub fn provider_kind(&self) -> ProviderKind {
        match self.provider {
            Some(kind) => kind,
            None if self.api_key.is_set() => ProviderKind::Anthropic,
            None => ProviderKind::Offline,
        }
    }
}

impl ProviderKind {
    /// Returns the provider's name in the configuration tree.
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::Openai => "openai",
            ProviderKind::Offline => "offline",
        }
    }

    /// Parses a provider name of the configuration tree.
    pub fn parse(name: &str) -> Option<ProviderKind> {
        match name {
            "anthropic" => Some(ProviderKind::Anthropic),
            "openai" => Some(ProviderKind::Openai),
            "offline" => Some(ProviderKind::Offline),
            _ => None,
        }
    }
}

impl LlmConfig {
    /// Returns these settings as keys of the configuration tree (the
    /// deployment layer the config service starts from).
    pub fn settings_tree(&self) -> Map<String, Value> {
        let mut tree = Map::new();
        tree.insert(
            settings::LLM_PROVIDER.into(),
            self.provider.map_or(Value::Null, |kind| Value::from(kind.as_str())),
        );
        tree.insert(settings::LLM_MODEL.into(), Value::from(self.model.clone()));
        tree.insert(
            settings::LLM_API_KEY.into(),
            self.api_key.expose().map_or(Value::Null, Value::from),
        );
        tree.insert(
            settings::LLM_BASE_URL.into(),
            self.base_url.clone().map_or(Value::Null, Value::from),
        );
        tree.insert(
            settings::LLM_IDLE_TIMEOUT.into(),
            settings::duration_value(self.idle_timeout),
        );
        tree.insert(settings::DEFAULTS_MAX_TOKENS.into(), Value::from(self.max_tokens));
        tree.insert(
            settings::DEFAULTS_TIMEOUT.into(),
            settings::duration_value(self.request_timeout),
        );
        tree
    }

    /// Returns the settings an effective configuration tree holds; keys it
    /// lacks keep their built-in defaults.
    pub fn from_settings(tree: &Map<String, Value>) -> LlmConfig {
        let defaults = LlmConfig::default();
        LlmConfig {
            provider: settings::text(tree, settings::LLM_PROVIDER).and_then(ProviderKind::parse),
            api_key: settings::text(tree, settings::LLM_API_KEY)
                .map(Secret::new)
                .unwrap_or_default(),
            base_url: settings::text(tree, settings::LLM_BASE_URL).map(str::to_owned),
            model: settings::text(tree, settings::LLM_MODEL).map_or(defaults.model, str::to_owned),
            max_tokens: settings::count(tree, settings::DEFAULTS_MAX_TOKENS)
                .and_then(|count| u32::try_from(count).ok())
                .unwrap_or(defaults.max_tokens),
            request_timeout: settings::duration(tree, settings::DEFAULTS_TIMEOUT).unwrap_or(defaults.request_timeout),
            idle_timeout: settings::duration(tree, settings::LLM_IDLE_TIMEOUT).unwrap_or(defaults.idle_timeout),
        }
    }
}

impl RuntimeConfig {
    /// Returns these settings as keys of the configuration tree (shown by
    /// the config service; they apply at start).
    pub fn settings_tree(&self) -> Map<String, Value> {
        let mut tree = Map::new();
        tree.insert(
            settings::RUNTIME_AGENT_IDLE_TIMEOUT.into(),
            settings::duration_value(self.agent_idle_timeout),
        );
        tree.insert(
            settings::RUNTIME_EVENT_RETENTION.into(),
            Value::from(self.event_retention),
        );
        tree.insert(
            settings::RUNTIME_EVENT_RETENTION_PERIOD.into(),
            settings::duration_value(self.event_retention_period),
        );
        tree.insert(
            settings::RUNTIME_SUBSCRIBER_QUEUE.into(),
            Value::from(self.subscriber_queue),
        );
        tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llm_settings_survive_the_configuration_tree() {
        let config = LlmConfig {
            provider: Some(ProviderKind::Openai),
            api_key: Secret::new("sk-test"),
            base_url: Some("http://127.0.0.1:9/v1".into()),
            model: "gpt-test".into(),
            max_tokens: 77,
            request_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(7),
        };
        let back = LlmConfig::from_settings(&config.settings_tree());
        assert_eq!(back.provider, config.provider);
        assert_eq!(back.api_key.expose(), Some("sk-test"));
        assert_eq!(
            (
                back.base_url,
                back.model,
                back.max_tokens,
                back.request_timeout,
                back.idle_timeout
            ),
            (
                config.base_url,
                config.model,
                77,
                config.request_timeout,
                config.idle_timeout
            )
        );
        let defaults = LlmConfig::from_settings(&Map::new());
        assert_eq!(defaults.provider_kind(), ProviderKind::Offline);
        assert_eq!(defaults.model, LlmConfig::default().model);
    }

    #[test]
    fn every_tree_key_is_a_known_setting() {
        let mut tree = LlmConfig::default().settings_tree();
        tree.extend(RuntimeConfig::default().settings_tree());
        for (key, value) in &tree {
            let spec = settings::spec(key).unwrap_or_else(|| panic!("{key} is not in the settings table"));
            if !value.is_null() {
                assert_eq!(spec.check(value).as_ref(), Ok(value), "{key}");
            }
        }
    }
}
