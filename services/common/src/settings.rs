//! The names of the configuration tree's keys, and reading values of a flat
//! tree: the vocabulary the config service (which owns the keys' schema and
//! checks every value), the runtime (which reads its settings) and the binary
//! (which makes the deployment layer) share, so a key means the same everywhere.

use std::time::Duration;

use serde_json::Value;

pub const LLM_PROVIDER: &str = "llm.provider";
pub const LLM_MODEL: &str = "llm.model";
pub const LLM_API_KEY: &str = "llm.apiKey";
pub const LLM_BASE_URL: &str = "llm.baseUrl";
pub const LLM_IDLE_TIMEOUT: &str = "llm.idleTimeout";
pub const LLM_CONTEXT_WINDOWS: &str = "llm.contextWindows";
pub const LLM_COMPACTION: &str = "llm.compaction";
pub const DEFAULTS_MAX_TOKENS: &str = "defaults.maxTokens";
pub const DEFAULTS_TIMEOUT: &str = "defaults.timeout";
pub const SYSTEM_DATA_DIR: &str = "system.dataDir";
pub const SYSTEM_LOG_LEVEL: &str = "system.logLevel";
pub const RUNTIME_AGENT_IDLE_TIMEOUT: &str = "runtime.agentIdleTimeout";
pub const RUNTIME_EVENT_RETENTION: &str = "runtime.eventRetention";
pub const RUNTIME_EVENT_RETENTION_PERIOD: &str = "runtime.eventRetentionPeriod";
pub const RUNTIME_SUBSCRIBER_QUEUE: &str = "runtime.subscriberQueue";
pub const RUNTIME_SUBSCRIBER_STALL_TIMEOUT: &str = "runtime.subscriberStallTimeout";
pub const BILLING_MARKUP: &str = "billing.markup";
pub const BILLING_PRICES: &str = "billing.prices";

/// The keys whose value is an object of its own (model name to a value):
/// a nested body names them whole, not key by key below them.
pub const TABLE_KEYS: [&str; 2] = [BILLING_PRICES, LLM_CONTEXT_WINDOWS];

/// Returns the string at `key` of a flat tree, if it holds one.
pub fn text<'a>(tree: &'a serde_json::Map<String, Value>, key: &str) -> Option<&'a str> {
    tree.get(key).and_then(Value::as_str)
}

/// Returns the whole number at `key` of a flat tree, if it holds one.
pub fn count(tree: &serde_json::Map<String, Value>, key: &str) -> Option<u64> {
    tree.get(key).and_then(Value::as_u64)
}

/// Returns the duration at `key` of a flat tree, if it holds one.
pub fn duration(tree: &serde_json::Map<String, Value>, key: &str) -> Option<Duration> {
    text(tree, key).and_then(|text| humantime::parse_duration(text).ok())
}

/// Returns a duration as the tree holds it (`"1m 30s"`).
pub fn duration_value(duration: Duration) -> Value {
    Value::String(humantime::format_duration(duration).to_string())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::Map;

    use super::*;

    proptest! {
        #[test]
        fn any_text_is_a_duration_or_none(text in any::<String>()) {
            let tree = Map::from_iter([(LLM_IDLE_TIMEOUT.to_owned(), Value::from(text))]);
            let _ = duration(&tree, LLM_IDLE_TIMEOUT);
        }

        #[test]
        fn durations_round_trip_through_the_tree(secs in any::<u64>(), nanos in 0u32..1_000_000_000) {
            let value = Duration::new(secs, nanos);
            let tree = Map::from_iter([(RUNTIME_AGENT_IDLE_TIMEOUT.to_owned(), duration_value(value))]);
            prop_assert_eq!(duration(&tree, RUNTIME_AGENT_IDLE_TIMEOUT), Some(value));
        }
    }
}
