//! Runtime settings: the agent pool and the LLM it talks to.

use std::collections::BTreeMap;
use std::time::Duration;

use avm_common::config::Secret;
use avm_common::settings;
use serde::{Deserialize, Serialize};

pub use avm_sandbox::{
    COMMAND_PATH, EnvValue, HIDE_REMOVED, Removed, SandboxEnvironment, SandboxLimits, SandboxRequest,
};
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
    /// Events a subscriber may fall behind before its text deltas merge
    /// (consecutive deltas of a message become one, every other event kept
    /// in order), so a client reading at its own pace is never cut off.
    /// Twice as many events that cannot merge cut it off.
    pub subscriber_queue: usize,
    /// How long a subscriber whose queue is full may take no event before
    /// it is cut off with `SUBSCRIBER_TOO_SLOW` (its turn goes on and is stored).
    #[serde(with = "humantime_serde")]
    pub subscriber_stall_timeout: Duration,
    /// Where images' workspaces live (`<root>/<tenant>/<image>`); the
    /// server's data directory's `workspaces` when unset.
    pub workspace_root: Option<std::path::PathBuf>,
    /// Where workspaces persist between agents, so that an image's follows
    /// its agent to whichever replica runs it next: an object store URL
    /// (`s3://bucket/prefix`, `gs://…`, `az://…`, `file:///path`), its
    /// credentials and settings from the standard `AWS_*`, `GOOGLE_*` or
    /// `AZURE_*` variables. Unset: on this server's disk only.
    pub workspace_store: Option<String>,
    /// LLM calls one turn may make before it ends with `TOOL_LOOP_LIMIT`.
    pub max_tool_steps: u32,
    /// Tool calls of one reply run at once, at most.
    pub tool_concurrency: usize,
    /// Consecutive agent messages a group takes without a user's: past it,
    /// agent messages wake nobody until a user posts (runaway protection).
    pub group_runaway_limit: u64,
    /// Levels of child agents below an agent nobody started (`spawn_agent`).
    pub max_agent_depth: u32,
    /// Children one agent may have started (terminated ones included).
    pub max_children_per_agent: usize,
    /// Group turns running at once on this replica; the wakes beyond wait,
    /// each tenant in turn. 0: no limit.
    pub max_running_agents: usize,
    /// Group turns of one tenant running at once; 0: no limit.
    pub max_running_agents_per_tenant: usize,
    /// Bytes of messages the outbox keeps while the session service does
    /// not take them (in Redis when configured, for all replicas together,
    /// else in this process's memory); a reply beyond it ends its turn
    /// with `REPLY_NOT_STORED`.
    pub outbox_max_bytes: usize,
    /// The limits `run_command` runs under (`[runtime.sandbox]`).
    pub sandbox: SandboxLimits,
    /// What `fetch_url` may reach and how much it reads (`[runtime.fetch]`).
    pub fetch: FetchConfig,
    /// MCP servers: which commands may run, and their timeouts (`[runtime.mcp]`).
    pub mcp: McpConfig,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            agent_idle_timeout: Duration::from_secs(600),
            event_retention: 1024,
            event_retention_period: Duration::from_secs(120),
            subscriber_queue: 1024,
            subscriber_stall_timeout: Duration::from_secs(30),
            workspace_root: None,
            workspace_store: None,
            max_tool_steps: 25,
            tool_concurrency: 4,
            group_runaway_limit: 20,
            max_agent_depth: 3,
            max_children_per_agent: 8,
            max_running_agents: 64,
            max_running_agents_per_tenant: 8,
            outbox_max_bytes: 64 * 1024 * 1024,
            sandbox: SandboxLimits::default(),
            fetch: FetchConfig::default(),
            mcp: McpConfig::default(),
        }
    }
}

/// MCP servers' settings (`[runtime.mcp]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct McpConfig {
    /// Commands a tenant's own (private) tool resource may start as a stdio
    /// MCP server, as its `mcpServer.command` names them. Public tool
    /// resources, which only operators publish, need no entry.
    pub allowed_commands: Vec<String>,
    /// Time to start a server (or reach it) and list its tools.
    pub connect_timeout_seconds: u64,
    /// Time one tool call may take.
    pub call_timeout_seconds: u64,
}

impl Default for McpConfig {
    fn default() -> Self {
        Self {
            allowed_commands: Vec::new(),
            connect_timeout_seconds: 20,
            call_timeout_seconds: 60,
        }
    }
}

/// `fetch_url`'s limits and the operator's allow-list (`[runtime.fetch]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FetchConfig {
    /// Addresses fetched although they are loopback, private, link-local or
    /// otherwise internal: host names (`wiki.internal`), addresses
    /// (`10.1.2.3`) or networks (`10.0.0.0/8`, `fd00::/8`). Empty by default.
    pub allow: Vec<String>,
    /// Time for the whole fetch, redirects and body included.
    pub timeout_seconds: u64,
    /// Bytes of a response body read; the rest is cut with a marker.
    pub max_bytes: usize,
    /// Redirects followed, each one checked like the first address.
    pub max_redirects: u32,
}

impl Default for FetchConfig {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            timeout_seconds: 30,
            max_bytes: 512 * 1024,
            max_redirects: 5,
        }
    }
}

/// The model every offline reply and its ledger record name: the offline
/// provider answers as itself, whatever model was configured, so usage by
/// model never mixes its replies with real calls.
pub const OFFLINE_MODEL: &str = "offline";

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
    /// Context windows by model name or prefix, in tokens, over the
    /// built-in ones ([`DEFAULT_CONTEXT_WINDOWS`]).
    pub context_windows: BTreeMap<String, u64>,
    /// What happens to older turns when a conversation nears the window.
    pub compaction: Compaction,
}

/// What happens to older turns when a conversation nears the model's window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compaction {
    /// The model summarises them (a metered call); the summary stands for them.
    #[default]
    Summarize,
    /// They are left out of what the model reads.
    Drop,
    /// Everything is sent; a conversation past the window fails its turns.
    Off,
}

impl Compaction {
    pub fn parse(word: &str) -> Option<Self> {
        match word {
            "summarize" => Some(Self::Summarize),
            "drop" => Some(Self::Drop),
            "off" => Some(Self::Off),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Summarize => "summarize",
            Self::Drop => "drop",
            Self::Off => "off",
        }
    }
}

/// The windows of the providers' models when this was written, by prefix;
/// a model none of them (nor the configured ones) names gets
/// [`FALLBACK_CONTEXT_WINDOW`].
pub const DEFAULT_CONTEXT_WINDOWS: &[(&str, u64)] = &[
    ("claude-", 200_000),
    ("gpt-4o", 128_000),
    ("gpt-4.1", 1_000_000),
    ("gpt-5", 400_000),
    ("o1", 200_000),
    ("o3", 200_000),
    ("o4", 200_000),
];

/// The window of a model nothing names.
pub const FALLBACK_CONTEXT_WINDOW: u64 = 128_000;

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
            context_windows: BTreeMap::new(),
            compaction: Compaction::default(),
        }
    }
}

impl LlmConfig {
    /// Returns the provider in effect, resolving an unset one from the key.
    /// Returns the model that answers a call for which the agent chose
    /// `chosen` (else the configured model): the offline provider answers as
    /// itself, so nothing names a model that did not answer.
    pub fn answering_model<'a>(&'a self, chosen: Option<&'a str>) -> &'a str {
        match self.provider_kind() {
            ProviderKind::Offline => OFFLINE_MODEL,
            _ => chosen.unwrap_or(&self.model),
        }
    }

    /// Returns the context window of `model` in tokens: the configured
    /// entry of the model or of its longest prefix, else the built-in one.
    pub fn context_window(&self, model: &str) -> u64 {
        let longest = |entries: &mut dyn Iterator<Item = (&str, u64)>| {
            entries
                .filter(|(prefix, _)| model.starts_with(prefix))
                .max_by_key(|(prefix, _)| prefix.len())
                .map(|(_, tokens)| tokens)
        };
        longest(
            &mut self
                .context_windows
                .iter()
                .map(|(prefix, tokens)| (prefix.as_str(), *tokens)),
        )
        .or_else(|| longest(&mut DEFAULT_CONTEXT_WINDOWS.iter().copied()))
        .unwrap_or(FALLBACK_CONTEXT_WINDOW)
    }

    pub fn provider_kind(&self) -> ProviderKind {
        match self.provider {
            Some(kind) => kind,
            None if self.api_key.is_set() => ProviderKind::Anthropic,
            None => ProviderKind::Offline,
        }
    }
}

/// What LLM calls cost and what tenants pay for them (`[billing]`,
/// `AVM_BILLING_*`): the deployment layer of `billing.*` in the
/// configuration center.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BillingConfig {
    /// What tenants pay per unit of provider cost.
    pub markup: f64,
    /// Provider prices by model name or prefix (the longest matching key wins).
    pub prices: BTreeMap<String, ModelPrice>,
}

/// A model's price in USD per million tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelPrice {
    pub input: f64,
    pub output: f64,
    /// Tokens read from the prompt cache.
    pub cache_read: f64,
    /// Tokens written to the prompt cache.
    pub cache_write: f64,
}

impl Default for BillingConfig {
    /// The providers' public list prices when this was written; operators
    /// keep them current with `PUT /v1/config {"billing.prices": …}`.
    fn default() -> Self {
        let price = |input: f64, output: f64, cache_read: f64, cache_write: f64| ModelPrice {
            input,
            output,
            cache_read,
            cache_write,
        };
        let prices = [
            ("claude-opus-4", price(15.0, 75.0, 1.5, 18.75)),
            ("claude-sonnet-4", price(3.0, 15.0, 0.3, 3.75)),
            ("claude-3-7-sonnet", price(3.0, 15.0, 0.3, 3.75)),
            ("claude-3-5-haiku", price(0.8, 4.0, 0.08, 1.0)),
            ("gpt-4o", price(2.5, 10.0, 1.25, 0.0)),
            ("gpt-4o-mini", price(0.15, 0.6, 0.075, 0.0)),
            ("gpt-4.1", price(2.0, 8.0, 0.5, 0.0)),
            ("gpt-4.1-mini", price(0.4, 1.6, 0.1, 0.0)),
        ];
        Self {
            markup: 1.05,
            prices: prices
                .into_iter()
                .map(|(model, price)| (model.to_owned(), price))
                .collect(),
        }
    }
}

impl BillingConfig {
    /// Returns these settings as keys of the configuration tree.
    pub fn settings_tree(&self) -> Map<String, Value> {
        let prices: Map<String, Value> = self
            .prices
            .iter()
            .map(|(model, price)| {
                let value = serde_json::json!({
                    "input": price.input,
                    "output": price.output,
                    "cacheRead": price.cache_read,
                    "cacheWrite": price.cache_write,
                });
                (model.clone(), value)
            })
            .collect();
        let mut tree = Map::new();
        tree.insert(settings::BILLING_MARKUP.into(), Value::from(self.markup));
        tree.insert(settings::BILLING_PRICES.into(), Value::Object(prices));
        tree
    }

    /// Returns the billing settings an effective configuration tree holds.
    pub fn from_settings(tree: &Map<String, Value>) -> BillingConfig {
        let defaults = BillingConfig::default();
        let number = |price: &Value, field: &str| price.get(field).and_then(Value::as_f64).unwrap_or(0.0);
        let prices = match tree.get(settings::BILLING_PRICES) {
            Some(Value::Object(models)) => models
                .iter()
                .map(|(model, price)| {
                    let price = ModelPrice {
                        input: number(price, "input"),
                        output: number(price, "output"),
                        cache_read: number(price, "cacheRead"),
                        cache_write: number(price, "cacheWrite"),
                    };
                    (model.clone(), price)
                })
                .collect(),
            _ => defaults.prices,
        };
        BillingConfig {
            markup: tree
                .get(settings::BILLING_MARKUP)
                .and_then(Value::as_f64)
                .unwrap_or(defaults.markup),
            prices,
        }
    }

    /// Returns the price of `model`: its own entry, else the longest entry
    /// that is a prefix of it (`gpt-4o-mini-2024-07-18` → `gpt-4o-mini`).
    pub fn price_of(&self, model: &str) -> Option<ModelPrice> {
        if let Some(price) = self.prices.get(model) {
            return Some(*price);
        }
        self.prices
            .iter()
            .filter(|(prefix, _)| model.starts_with(prefix.as_str()))
            .max_by_key(|(prefix, _)| prefix.len())
            .map(|(_, price)| *price)
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
        tree.insert(
            settings::LLM_CONTEXT_WINDOWS.into(),
            Value::Object(
                self.context_windows
                    .iter()
                    .map(|(model, tokens)| (model.clone(), Value::from(*tokens)))
                    .collect(),
            ),
        );
        tree.insert(settings::LLM_COMPACTION.into(), Value::from(self.compaction.as_str()));
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
            context_windows: match tree.get(settings::LLM_CONTEXT_WINDOWS) {
                Some(Value::Object(models)) => models
                    .iter()
                    .filter_map(|(model, tokens)| Some((model.clone(), tokens.as_u64()?)))
                    .collect(),
                _ => defaults.context_windows,
            },
            compaction: settings::text(tree, settings::LLM_COMPACTION)
                .and_then(Compaction::parse)
                .unwrap_or(defaults.compaction),
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
        tree.insert(
            settings::RUNTIME_SUBSCRIBER_STALL_TIMEOUT.into(),
            settings::duration_value(self.subscriber_stall_timeout),
        );
        tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_environment_is_read_from_its_resource_and_refused_without_its_interpreter() {
        use std::os::unix::fs::PermissionsExt;
        let request = SandboxRequest::from_content(&serde_json::json!({"limits": {}, "environment": "python"}));
        assert_eq!(request.environment, SandboxEnvironment::Python);
        assert_eq!(
            SandboxRequest::from_content(&serde_json::json!({"limits": {}})).environment,
            SandboxEnvironment::Shell
        );
        let bin = tempfile::tempdir().unwrap();
        let dir = bin.path().to_str().unwrap();
        let err = SandboxEnvironment::Node.check(&[dir]).unwrap_err();
        assert!(err.contains("no node in") && err.contains(dir), "{err}");
        assert!(SandboxEnvironment::Shell.check(&[dir]).is_ok());
        // Present but not executable is missing too.
        let node = bin.path().join("node");
        std::fs::write(&node, "#!/bin/sh\n").unwrap();
        assert!(SandboxEnvironment::Node.check(&[dir]).is_err());
        std::fs::set_permissions(&node, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(SandboxEnvironment::Node.check(&[dir]).is_ok());
    }

    #[test]
    fn a_hide_list_is_refused_with_what_replaced_it() {
        let read = |sandbox: Value| serde_json::from_value::<SandboxLimits>(sandbox);
        let err = read(serde_json::json!({"hide": ["/srv/secrets"]})).unwrap_err();
        assert!(err.to_string().contains("expose"), "{err}");
        let empty = read(serde_json::json!({"hide": [], "expose": ["/opt/tools"]})).unwrap();
        assert_eq!(empty.expose, [std::path::PathBuf::from("/opt/tools")]);
        assert!(!serde_json::to_string(&empty).unwrap().contains("hide"));
    }

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
            context_windows: BTreeMap::from([("gpt-test".to_owned(), 8_000), ("gpt-".to_owned(), 64_000)]),
            compaction: Compaction::Drop,
        };
        let back = LlmConfig::from_settings(&config.settings_tree());
        assert_eq!(
            (&back.context_windows, back.compaction),
            (&config.context_windows, Compaction::Drop)
        );
        // The configured entry of the model or its longest prefix, else the built-in one.
        assert_eq!(back.context_window("gpt-test-2"), 8_000);
        assert_eq!(back.context_window("gpt-other"), 64_000);
        assert_eq!(back.context_window("claude-sonnet-4"), 200_000);
        assert_eq!(back.context_window("mystery"), FALLBACK_CONTEXT_WINDOW);
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
    fn billing_survives_the_tree_and_prices_by_prefix() {
        let billing = BillingConfig::default();
        assert_eq!(BillingConfig::from_settings(&billing.settings_tree()), billing);
        let mini = billing.price_of("gpt-4o-mini-2024-07-18").unwrap_or_default();
        assert_eq!((mini.input, mini.output), (0.15, 0.6), "the longest prefix wins");
        assert_eq!(
            billing.price_of("claude-sonnet-4-20250514").map(|p| p.output),
            Some(15.0)
        );
        assert_eq!(billing.price_of("unknown-model"), None);
    }
}
