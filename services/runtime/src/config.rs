//! Runtime settings: the agent pool and the LLM it talks to.

use std::time::Duration;

use avm_common::config::Secret;
use serde::{Deserialize, Serialize};

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
