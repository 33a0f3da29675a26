//! The schema of the configuration tree this service serves: each key, what
//! it holds, who may change it, and how a value is checked. The keys' names
//! are `avm_common::settings`'s, shared with the components that read them.

use std::time::Duration;

use avm_common::settings::*;
use serde_json::Value;

/// What a key holds, and its bounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ValueKind {
    /// `anthropic`, `openai` or `offline`; `null` picks from the API key.
    Provider,
    /// A non-empty string of at most this many bytes.
    Text(usize),
    /// An `http://` or `https://` URL, or `null`.
    Url,
    /// A whole number within the bounds.
    Count(u64, u64),
    /// A duration such as `"60s"` or `"10m"`, within the bounds (seconds).
    Duration(u64, u64),
    /// A number within the bounds.
    Number(f64, f64),
    /// Model name (or prefix) to its price in USD per million tokens:
    /// `{"input", "output", "cacheRead"?, "cacheWrite"?}`.
    PriceTable,
    /// Model name (or prefix) to its context window, in tokens.
    WindowTable,
    /// One of these words.
    Choice(&'static [&'static str]),
}

/// One key of the tree.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KeySpec {
    /// Dotted camelCase name, e.g. `llm.model`.
    pub key: &'static str,
    pub kind: ValueKind,
    /// Written but never read back, except by AgentVM's own components.
    pub secret: bool,
    /// Whether a tenant may override it for itself.
    pub tenant_overridable: bool,
    /// Whether the API may change it; the others come from the deployment
    /// (file, environment, flags) and apply at start.
    pub writable: bool,
    pub description: &'static str,
}

const fn key(
    key: &'static str,
    kind: ValueKind,
    tenant_overridable: bool,
    writable: bool,
    description: &'static str,
) -> KeySpec {
    KeySpec {
        key,
        kind,
        secret: false,
        tenant_overridable,
        writable,
        description,
    }
}

const HOUR: u64 = 3600;

/// Every key, in the order they are shown.
pub const KEYS: &[KeySpec] = &[
    key(
        LLM_PROVIDER,
        ValueKind::Provider,
        true,
        true,
        "the LLM API: anthropic, openai (any OpenAI-compatible server) or offline; null picks anthropic when an API key is set",
    ),
    key(
        LLM_MODEL,
        ValueKind::Text(200),
        true,
        true,
        "the model name sent to the provider",
    ),
    KeySpec {
        key: LLM_API_KEY,
        kind: ValueKind::Text(4096),
        secret: true,
        tenant_overridable: true,
        writable: true,
        description: "the provider's API key (write-only)",
    },
    // Not for tenants: the runtime would send requests wherever a tenant
    // pointed it, inside the deployment's network too.
    key(
        LLM_BASE_URL,
        ValueKind::Url,
        false,
        true,
        "the provider's API root (anthropic without /v1, openai with it); null is the provider's own",
    ),
    key(
        LLM_IDLE_TIMEOUT,
        ValueKind::Duration(1, HOUR),
        false,
        true,
        "time allowed between two chunks of a streaming reply",
    ),
    key(
        LLM_CONTEXT_WINDOWS,
        ValueKind::WindowTable,
        true,
        true,
        "context windows by model (or model prefix), in tokens; they add to and override the built-in ones",
    ),
    key(
        LLM_COMPACTION,
        ValueKind::Choice(&COMPACTION_POLICIES),
        true,
        true,
        "what happens to older turns when a conversation nears the model's window: summarize, drop or off",
    ),
    key(
        DEFAULTS_MAX_TOKENS,
        ValueKind::Count(1, 1_000_000),
        true,
        true,
        "the largest reply, in tokens",
    ),
    key(
        DEFAULTS_TIMEOUT,
        ValueKind::Duration(1, HOUR),
        true,
        true,
        "time allowed for an LLM call to connect and answer",
    ),
    key(
        BILLING_MARKUP,
        ValueKind::Number(1.0, 10.0),
        false,
        true,
        "what tenants pay per unit of provider cost (1.05: cost plus 5 %)",
    ),
    key(
        BILLING_PRICES,
        ValueKind::PriceTable,
        false,
        true,
        "provider prices by model (or model prefix), USD per million tokens: {input, output, cacheRead?, cacheWrite?}",
    ),
    key(
        SYSTEM_DATA_DIR,
        ValueKind::Text(4096),
        false,
        false,
        "where avm serve keeps its files (--data-dir)",
    ),
    key(
        SYSTEM_LOG_LEVEL,
        ValueKind::Text(1024),
        false,
        false,
        "the log filter (AVM_LOG_LEVEL)",
    ),
    key(
        RUNTIME_AGENT_IDLE_TIMEOUT,
        ValueKind::Duration(1, 24 * HOUR),
        false,
        false,
        "an agent idle this long is dropped from memory",
    ),
    key(
        RUNTIME_EVENT_RETENTION,
        ValueKind::Count(0, 1_000_000),
        false,
        false,
        "recent events kept per active session for resuming clients",
    ),
    key(
        RUNTIME_EVENT_RETENTION_PERIOD,
        ValueKind::Duration(1, 24 * HOUR),
        false,
        false,
        "how long recent events are kept",
    ),
    key(
        RUNTIME_SUBSCRIBER_QUEUE,
        ValueKind::Count(1, 1_000_000),
        false,
        false,
        "events a subscriber may fall behind before its text deltas merge",
    ),
    key(
        RUNTIME_SUBSCRIBER_STALL_TIMEOUT,
        ValueKind::Duration(1, 24 * HOUR),
        false,
        false,
        "how long a subscriber that fell behind may read nothing before it is cut off",
    ),
];

/// Returns the spec of `key`, if it is one.
pub fn spec(key: &str) -> Option<&'static KeySpec> {
    KEYS.iter().find(|spec| spec.key == key)
}

/// What `llm.compaction` may be.
pub const COMPACTION_POLICIES: [&str; 3] = ["summarize", "drop", "off"];

/// The LLM providers a value may name.
pub const PROVIDERS: [&str; 3] = ["anthropic", "openai", "offline"];

impl KeySpec {
    /// Checks a value for this key and returns it in its canonical form;
    /// the error says what is wrong, without repeating the value (it may be
    /// a secret).
    pub fn check(&self, value: &Value) -> Result<Value, String> {
        match (self.kind, value) {
            (ValueKind::Provider | ValueKind::Url, Value::Null) => Ok(Value::Null),
            (ValueKind::Provider, Value::String(name)) if PROVIDERS.contains(&name.as_str()) => Ok(value.clone()),
            (ValueKind::Provider, _) => Err(format!("must be one of {} or null", PROVIDERS.join(", "))),
            (ValueKind::Text(max), Value::String(text)) if !text.trim().is_empty() && text.len() <= max => {
                Ok(value.clone())
            }
            (ValueKind::Text(max), _) => Err(format!("must be a non-empty string of at most {max} bytes")),
            (ValueKind::Url, Value::String(url)) => match url::Url::parse(url) {
                Ok(parsed) if matches!(parsed.scheme(), "http" | "https") && parsed.has_host() => {
                    Ok(Value::String(url.trim_end_matches('/').to_owned()))
                }
                _ => Err("must be an http:// or https:// URL, or null".to_owned()),
            },
            (ValueKind::Url, _) => Err("must be an http:// or https:// URL, or null".to_owned()),
            (ValueKind::Count(min, max), Value::Number(number)) => match number.as_u64() {
                Some(count) if (min..=max).contains(&count) => Ok(value.clone()),
                _ => Err(format!("must be a whole number from {min} to {max}")),
            },
            (ValueKind::Count(min, max), _) => Err(format!("must be a whole number from {min} to {max}")),
            (ValueKind::Duration(min, max), Value::String(text)) => match humantime::parse_duration(text) {
                Ok(duration) if (min..=max).contains(&duration.as_secs()) => {
                    Ok(Value::String(humantime::format_duration(duration).to_string()))
                }
                _ => Err(duration_bounds(min, max)),
            },
            (ValueKind::Duration(min, max), _) => Err(duration_bounds(min, max)),
            (ValueKind::Number(min, max), Value::Number(number)) => match number.as_f64() {
                Some(n) if (min..=max).contains(&n) => Ok(value.clone()),
                _ => Err(format!("must be a number from {min} to {max}")),
            },
            (ValueKind::Number(min, max), _) => Err(format!("must be a number from {min} to {max}")),
            (ValueKind::PriceTable, Value::Object(models)) => check_prices(models).map(|()| value.clone()),
            (ValueKind::PriceTable, _) => Err("must be an object of model name to price".to_owned()),
            (ValueKind::WindowTable, Value::Object(models)) => check_windows(models).map(|()| value.clone()),
            (ValueKind::WindowTable, _) => Err("must be an object of model name to tokens".to_owned()),
            (ValueKind::Choice(words), Value::String(word)) if words.contains(&word.as_str()) => Ok(value.clone()),
            (ValueKind::Choice(words), _) => Err(format!("must be one of {}", words.join(", "))),
        }
    }
}

/// The fields of one model's price, USD per million tokens.
pub const PRICE_FIELDS: [&str; 4] = ["input", "output", "cacheRead", "cacheWrite"];

/// Most models a price table holds.
const MAX_PRICED_MODELS: usize = 1000;

fn check_prices(models: &serde_json::Map<String, Value>) -> Result<(), String> {
    if models.len() > MAX_PRICED_MODELS {
        return Err(format!("may price at most {MAX_PRICED_MODELS} models"));
    }
    for (model, price) in models {
        if model.is_empty() || model.len() > 200 {
            return Err("model names must be 1 to 200 bytes".to_owned());
        }
        let Value::Object(fields) = price else {
            return Err(format!("{model}: must be an object with input and output prices"));
        };
        for (field, amount) in fields {
            if !PRICE_FIELDS.contains(&field.as_str()) {
                return Err(format!(
                    "{model}: unknown price {field:?}; prices are {}",
                    PRICE_FIELDS.join(", ")
                ));
            }
            if !amount.as_f64().is_some_and(|n| (0.0..=1_000_000.0).contains(&n)) {
                return Err(format!(
                    "{model}.{field}: must be a number of USD per million tokens, from 0"
                ));
            }
        }
        for required in ["input", "output"] {
            if !fields.contains_key(required) {
                return Err(format!("{model}: {required} is required"));
            }
        }
    }
    Ok(())
}

/// The bounds of a context window, in tokens.
pub const WINDOW_TOKENS: (u64, u64) = (1_000, 10_000_000);

fn check_windows(models: &serde_json::Map<String, Value>) -> Result<(), String> {
    if models.len() > MAX_PRICED_MODELS {
        return Err(format!("may name at most {MAX_PRICED_MODELS} models"));
    }
    let (min, max) = WINDOW_TOKENS;
    for (model, tokens) in models {
        if model.is_empty() || model.len() > 200 {
            return Err("model names must be 1 to 200 bytes".to_owned());
        }
        if !tokens.as_u64().is_some_and(|n| (min..=max).contains(&n)) {
            return Err(format!("{model}: must be a whole number of tokens from {min} to {max}"));
        }
    }
    Ok(())
}

fn duration_bounds(min: u64, max: u64) -> String {
    format!(
        "must be a duration such as \"30s\" or \"5m\", from {} to {}",
        humantime::format_duration(Duration::from_secs(min)),
        humantime::format_duration(Duration::from_secs(max))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(key: &str, value: Value) -> Result<Value, String> {
        spec(key).map_or_else(|| Err("unknown".to_owned()), |spec| spec.check(&value))
    }

    #[test]
    fn values_are_checked_and_made_canonical() {
        assert_eq!(check(LLM_PROVIDER, json!("openai")), Ok(json!("openai")));
        assert_eq!(check(LLM_PROVIDER, json!(null)), Ok(json!(null)));
        assert!(check(LLM_PROVIDER, json!("gemini")).is_err());
        let windows = json!({"claude-": 200_000, "my-model": 8_000});
        assert_eq!(check(LLM_CONTEXT_WINDOWS, windows.clone()), Ok(windows));
        for bad in [
            json!({"m": 999}),
            json!({"m": "8k"}),
            json!({"": 8_000}),
            json!([8_000]),
        ] {
            assert!(check(LLM_CONTEXT_WINDOWS, bad.clone()).is_err(), "{bad}");
        }
        assert_eq!(check(LLM_COMPACTION, json!("drop")), Ok(json!("drop")));
        assert!(check(LLM_COMPACTION, json!("shrink")).is_err());
        assert!(check(LLM_MODEL, json!(" ")).is_err());
        assert!(check(LLM_MODEL, json!(7)).is_err());
        assert_eq!(
            check(LLM_BASE_URL, json!("http://127.0.0.1:9/v1/")),
            Ok(json!("http://127.0.0.1:9/v1"))
        );
        assert!(check(LLM_BASE_URL, json!("file:///etc/passwd")).is_err());
        assert_eq!(check(DEFAULTS_MAX_TOKENS, json!(1024)), Ok(json!(1024)));
        assert!(check(DEFAULTS_MAX_TOKENS, json!(0)).is_err());
        assert!(check(DEFAULTS_MAX_TOKENS, json!(1.5)).is_err());
        assert_eq!(check(DEFAULTS_TIMEOUT, json!("90s")), Ok(json!("1m 30s")));
        assert!(check(DEFAULTS_TIMEOUT, json!("2days")).is_err());
        assert_eq!(check(BILLING_MARKUP, json!(1.05)), Ok(json!(1.05)));
        assert!(check(BILLING_MARKUP, json!(0.5)).is_err());
        let prices = json!({"m": {"input": 3, "output": 15.0, "cacheRead": 0.3}});
        assert_eq!(check(BILLING_PRICES, prices.clone()), Ok(prices));
        assert!(
            check(BILLING_PRICES, json!({"m": {"input": 3}}))
                .unwrap_err()
                .contains("output")
        );
        assert!(check(BILLING_PRICES, json!({"m": {"input": 3, "output": -1}})).is_err());
        assert!(check(BILLING_PRICES, json!({"m": {"input": 3, "output": 1, "bogus": 1}})).is_err());
    }

    #[test]
    fn a_refused_secret_is_not_repeated() {
        let err = check(LLM_API_KEY, json!("")).unwrap_err();
        assert!(!err.contains("sk-"), "{err}");
        assert_eq!(spec(LLM_API_KEY).map(|spec| spec.secret), Some(true));
    }

    #[test]
    fn every_key_is_unique_and_sectioned() {
        for (index, spec) in KEYS.iter().enumerate() {
            assert!(spec.key.contains('.'), "{}", spec.key);
            assert!(KEYS[..index].iter().all(|other| other.key != spec.key), "{}", spec.key);
            assert!(spec.writable || !spec.tenant_overridable, "{}", spec.key);
        }
    }
}
