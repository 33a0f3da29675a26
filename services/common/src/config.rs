//! Layered configuration: built-in defaults < TOML file < environment < flags.
//!
//! Each component owns its section type; the binary composes them into one
//! document and loads it here once. Environment variables are `AVM_<SECTION>_<KEY>`
//! (for example `AVM_SERVER_PORT`, `AVM_DATABASE_URL`); peer addresses are
//! `AVM_<COMPONENT>_ADDR`; the LLM settings also read `LLM_<KEY>`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Serialized};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize, Serializer};

/// Components whose address may be given as `AVM_<COMPONENT>_ADDR`.
pub const PEER_COMPONENTS: [&str; 6] = ["auth", "resource", "session", "config", "observability", "runtime"];

/// What went wrong while loading configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid configuration: {0}")]
    Invalid(String),
    #[error("cannot read config file {path}: {source}")]
    File { path: PathBuf, source: std::io::Error },
}

/// Where configuration comes from, besides the built-in defaults.
#[derive(Debug, Default)]
pub struct Sources {
    /// A TOML file; `None` reads the path from `AVM_CONFIG`, if set.
    pub file: Option<PathBuf>,
    /// Command-line values, as a nested document (highest precedence).
    pub flags: serde_json::Map<String, serde_json::Value>,
}

/// Loads `T` from its defaults, the file, the environment and the flags.
pub fn load<T>(sources: &Sources) -> Result<T, ConfigError>
where
    T: Default + Serialize + DeserializeOwned,
{
    let mut figment = Figment::from(Serialized::defaults(T::default()));
    let file = sources
        .file
        .clone()
        .or_else(|| std::env::var_os("AVM_CONFIG").map(PathBuf::from));
    if let Some(path) = file {
        let table = read_file(&path)?;
        figment = figment.merge(Layer {
            name: "config file",
            source: Some(path),
            values: table,
        });
    }
    // Only variables that name a section of `T` are configuration; others that
    // share the prefix (AVM_TEST_*, for instance) belong to someone else.
    let sections: Vec<String> = match serde_json::to_value(T::default()) {
        Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    };
    figment = figment
        .merge(EnvLayer(
            Env::prefixed("LLM_").map(|key| format!("llm.{}", key.as_str().to_ascii_lowercase()).into()),
        ))
        .merge(EnvLayer(
            Env::prefixed("AVM_")
                .ignore(&["config"])
                .map(|key| env_key_to_path(key.as_str()).into())
                .filter(move |key| {
                    let section = key.as_str().split('.').next().unwrap_or_default();
                    sections.iter().any(|known| known == section)
                }),
        ))
        .merge(Layer {
            name: "command-line flags",
            source: None,
            values: serde_json::Value::Object(sources.flags.clone()),
        });
    // Lossy: a variable's text becomes the number or boolean its key wants.
    figment.extract_lossy().map_err(describe)
}

/// Environment variables as configuration: a value is the variable's text
/// (a number or boolean only where its key wants one), or the array or table
/// it spells (`[a, b]`, `{k = v}`). figment's own `Env` guesses a type from
/// the text alone, so `AVM_REDIS_KEY_PREFIX=123` was a number, refused by a
/// key that wants a string.
struct EnvLayer(Env);

impl figment::Provider for EnvLayer {
    fn metadata(&self) -> figment::Metadata {
        self.0.metadata()
    }

    fn data(&self) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        use figment::value::Value;
        let mut values = figment::value::Dict::new();
        for (key, text) in self.0.iter() {
            let value = match spells_collection(&text).then(|| text.parse::<Value>()) {
                Some(Ok(value @ (Value::Dict(..) | Value::Array(..)))) => value,
                _ => Value::from(text),
            };
            insert_at(&mut values, key.as_str(), value);
        }
        Ok(figment::Profile::Default.collect(values))
    }
}

/// Whether `text` is given to figment's parser as an array or table.
/// figment 0.10 panics unescaping a quoted string in which a backslash follows
/// a non-ASCII character (it slices bytes at a character index), so such text
/// stays text: a key that wants an array then refuses it by name.
fn spells_collection(text: &str) -> bool {
    text.trim_start().starts_with(['[', '{']) && (text.is_ascii() || !text.contains('\\'))
}

/// Puts `value` at the dotted `path` of `dict`, making the tables on the way.
fn insert_at(dict: &mut figment::value::Dict, path: &str, value: figment::value::Value) {
    use figment::value::{Dict, Value};
    match path.split_once('.') {
        Some((head, rest)) => {
            let entry = dict.entry(head.to_owned()).or_insert_with(|| Value::from(Dict::new()));
            if !matches!(entry, Value::Dict(..)) {
                *entry = Value::from(Dict::new());
            }
            if let Value::Dict(_, inner) = entry {
                insert_at(inner, rest, value);
            }
        }
        None => {
            dict.insert(path.to_owned(), value);
        }
    }
}

/// A layer of values named as its errors should name it (figment names a
/// serialized layer by the Rust code that made it).
struct Layer<T> {
    name: &'static str,
    source: Option<PathBuf>,
    values: T,
}

impl<T: Serialize> figment::Provider for Layer<T> {
    fn metadata(&self) -> figment::Metadata {
        let metadata = figment::Metadata::named(self.name);
        match &self.source {
            Some(path) => metadata.source(path.as_path()),
            None => metadata,
        }
    }

    fn data(&self) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        Serialized::defaults(&self.values).data()
    }
}

/// Renders every error of a load as `section.key: what is wrong (where it
/// came from)`; figment's own text names a variable's key as `SECTION.KEY`,
/// which is not the variable to fix.
fn describe(errors: figment::Error) -> ConfigError {
    let lines: Vec<String> = errors
        .into_iter()
        .map(|err| {
            let key = err.path.join(".");
            let origin = err.metadata.as_ref().map(|metadata| {
                let name = metadata.name.as_ref();
                if name.contains("`AVM_`") {
                    format!("from {}", env_var_of(&err.path))
                } else if name.contains("`LLM_`") {
                    let key = err.path.get(1).map_or("", String::as_str);
                    format!("from LLM_{}", key.to_ascii_uppercase())
                } else {
                    match &metadata.source {
                        Some(source) => format!("in {name} {source}"),
                        None => format!("in {name}"),
                    }
                }
            });
            match (key.is_empty(), origin) {
                (true, Some(origin)) => format!("{} ({origin})", err.kind),
                (true, None) => err.kind.to_string(),
                (false, Some(origin)) => format!("{key}: {} ({origin})", err.kind),
                (false, None) => format!("{key}: {}", err.kind),
            }
        })
        .collect();
    ConfigError::Invalid(lines.join("; "))
}

/// Returns the `AVM_` variable that sets the key at `path` (a variable sets a
/// section's key; anything deeper is inside the table it spells).
fn env_var_of(path: &[String]) -> String {
    match path {
        [section, peer, ..] if section == "peers" => format!("AVM_{}_ADDR", peer.to_ascii_uppercase()),
        [section, key, ..] => format!("AVM_{section}_{key}").to_ascii_uppercase(),
        _ => format!("AVM_{}", path.join("_").to_ascii_uppercase()),
    }
}

/// Reads a TOML configuration file, replacing `${VAR}` (or `${VAR:-default}`)
/// in its strings with the environment's values; `$${` stands for a literal
/// `${`. A missing file named explicitly is an error, not silently ignored.
fn read_file(path: &Path) -> Result<toml::Table, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::File {
        path: path.to_owned(),
        source,
    })?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|err| ConfigError::Invalid(format!("config file {}: {err}", path.display())))?;
    let mut document = toml::Value::Table(table);
    interpolate("", &mut document, &|name| std::env::var(name).ok())
        .map_err(|err| ConfigError::Invalid(format!("config file {}: {err}", path.display())))?;
    match document {
        toml::Value::Table(table) => Ok(table),
        _ => Err(ConfigError::Invalid(format!(
            "config file {}: not a table",
            path.display()
        ))),
    }
}

/// Replaces `${VAR}` references in every string under `value` (at `path`).
fn interpolate(path: &str, value: &mut toml::Value, env: &dyn Fn(&str) -> Option<String>) -> Result<(), String> {
    match value {
        toml::Value::String(text) => {
            *text = expand(text, env).map_err(|why| format!("{path}: {why}"))?;
        }
        toml::Value::Array(items) => {
            for (index, item) in items.iter_mut().enumerate() {
                interpolate(&format!("{path}[{index}]"), item, env)?;
            }
        }
        toml::Value::Table(table) => {
            for (key, item) in table.iter_mut() {
                let path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                interpolate(&path, item, env)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Expands `${VAR}`, `${VAR:-default}` and `$${` in one string.
fn expand(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        if let Some(after) = rest.strip_prefix("$${") {
            out.push_str("${");
            rest = after;
        } else if let Some(after) = rest.strip_prefix("${") {
            let end = after.find('}').ok_or_else(|| "an unclosed ${ reference".to_owned())?;
            let reference = &after[..end];
            let (name, default) = match reference.split_once(":-") {
                Some((name, default)) => (name, Some(default)),
                None => (reference, None),
            };
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(format!("${{{reference}}} is not a variable reference"));
            }
            match (env(name), default) {
                (Some(value), _) => out.push_str(&value),
                (None, Some(default)) => out.push_str(default),
                (None, None) => return Err(format!("environment variable {name} is not set")),
            }
            rest = &after[end + 1..];
        } else {
            out.push('$');
            rest = &rest[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// Maps an environment key (without `AVM_`) to a dotted config path.
fn env_key_to_path(key: &str) -> String {
    let key = key.to_ascii_lowercase();
    if let Some(peer) = key.strip_suffix("_addr")
        && PEER_COMPONENTS.contains(&peer)
    {
        return format!("peers.{peer}");
    }
    match key.split_once('_') {
        Some((section, rest)) => format!("{section}.{rest}"),
        None => key,
    }
}

/// Renders a configuration as TOML with every secret redacted.
pub fn render<T: Serialize>(config: &T) -> Result<String, ConfigError> {
    toml::to_string_pretty(config).map_err(|err| ConfigError::Invalid(err.to_string()))
}

/// A secret value: readable by code that asks for it, redacted everywhere else
/// (`Debug`, `Serialize`, `--print-config`).
#[derive(Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(Option<String>);

/// What a set secret looks like when shown.
pub const REDACTED: &str = "<redacted>";

impl Secret {
    /// Wraps a secret value.
    pub fn new(value: impl Into<String>) -> Self {
        Self(Some(value.into()).filter(|v| !v.is_empty()))
    }

    /// Returns the secret itself, for the one place that must use it.
    pub fn expose(&self) -> Option<&str> {
        self.0.as_deref().filter(|v| !v.is_empty())
    }

    /// Returns whether a non-empty secret is set.
    pub fn is_set(&self) -> bool {
        self.expose().is_some()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_set() {
            f.write_str(REDACTED)
        } else {
            f.write_str("None")
        }
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.is_set() {
            serializer.serialize_str(REDACTED)
        } else {
            serializer.serialize_none()
        }
    }
}

/// Where the one-process server listens and keeps its files.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address the gateway and gRPC listeners bind to.
    pub host: String,
    /// Gateway (HTTP + WebSocket) port.
    pub port: u16,
    /// gRPC port of all services in `avm serve`.
    pub grpc_port: u16,
    /// Directory of the SQLite files in `avm serve`; `~` expands to `$HOME`.
    pub data_dir: String,
    /// Listen address of a single component (`avm <component>`).
    pub listen: Option<String>,
    /// The address other processes reach this one at (`AVM_SERVER_ADVERTISE`,
    /// e.g. `http://10.0.0.5:7000`): runtime replicas give it to each other
    /// and to the gateways. Default: the listen address.
    pub advertise: Option<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_owned(),
            port: 8080,
            grpc_port: 7000,
            data_dir: "~/.agentvm".to_owned(),
            listen: None,
            advertise: None,
        }
    }
}

impl ServerConfig {
    /// Returns the data directory with `~` expanded.
    pub fn data_dir(&self) -> PathBuf {
        expand_home(&self.data_dir)
    }
}

/// Expands a leading `~` to the user's home directory.
pub fn expand_home(path: &str) -> PathBuf {
    match (path.strip_prefix('~'), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => Path::new(&home).join(rest.trim_start_matches('/')),
        _ => PathBuf::from(path),
    }
}

/// Settings of every gRPC server and client.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcConfig {
    /// Largest message a server or client decodes or encodes.
    pub max_message_bytes: usize,
    /// Time allowed for a unary call (and for a stream to start).
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Time allowed to establish a connection to a peer.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// HTTP/2 ping interval that keeps idle connections verified.
    #[serde(with = "humantime_serde")]
    pub keepalive_interval: Duration,
    /// How long a keepalive ping may go unanswered.
    #[serde(with = "humantime_serde")]
    pub keepalive_timeout: Duration,
    /// How long in-flight calls may finish after a shutdown signal.
    #[serde(with = "humantime_serde")]
    pub drain_timeout: Duration,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            max_message_bytes: 16 * 1024 * 1024,
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
        }
    }
}

/// Logging settings.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// A `tracing` filter such as `info` or `avm_runtime=debug,info`; `RUST_LOG` wins when set.
    pub level: String,
    /// `auto` (JSON unless stderr is a terminal), `json` or `text`.
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            level: "info".to_owned(),
            format: LogFormat::Auto,
        }
    }
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Auto,
    Json,
    Text,
}

/// Storage of a component that owns tables.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `sqlite://path` or `postgres://…`; in `avm serve` defaults to files under the data dir.
    pub url: Option<Secret>,
    /// Largest number of pooled connections.
    pub max_connections: Option<u32>,
}

/// Redis, shared by replicas of the gateway (`[redis]`, `AVM_REDIS_URL`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://host:6379`; unset means each process keeps its own counters.
    pub url: Option<Secret>,
    /// Prefix of every key AgentVM writes, so deployments can share a Redis.
    pub key_prefix: String,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: None,
            key_prefix: "avm:".to_owned(),
        }
    }
}

/// Addresses of peer components (`http://host:port`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeersConfig {
    pub auth: Option<String>,
    pub resource: Option<String>,
    pub session: Option<String>,
    pub config: Option<String>,
    pub observability: Option<String>,
    pub runtime: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_variable_that_set_the_key() {
        let path = |keys: &[&str]| keys.iter().map(|k| (*k).to_owned()).collect::<Vec<_>>();
        assert_eq!(env_var_of(&path(&["server", "grpc_port"])), "AVM_SERVER_GRPC_PORT");
        assert_eq!(env_var_of(&path(&["peers", "runtime"])), "AVM_RUNTIME_ADDR");
        assert_eq!(env_var_of(&path(&["auth", "oidc", "issuer"])), "AVM_AUTH_OIDC");
        assert_eq!(env_var_of(&path(&["redis"])), "AVM_REDIS");
    }

    #[test]
    fn env_keys_map_to_sections() {
        assert_eq!(env_key_to_path("SERVER_GRPC_PORT"), "server.grpc_port");
        assert_eq!(env_key_to_path("DATABASE_URL"), "database.url");
        assert_eq!(env_key_to_path("SESSION_ADDR"), "peers.session");
        assert_eq!(env_key_to_path("GATEWAY_MAX_FRAME_BYTES"), "gateway.max_frame_bytes");
    }

    #[test]
    fn file_strings_take_values_from_the_environment() {
        let env = |name: &str| (name == "LLM_KEY").then(|| "sk-from-env".to_owned());
        assert_eq!(expand("${LLM_KEY}", &env).as_deref(), Ok("sk-from-env"));
        assert_eq!(expand("a-${LLM_KEY}-b", &env).as_deref(), Ok("a-sk-from-env-b"));
        assert_eq!(expand("${MISSING:-fallback}", &env).as_deref(), Ok("fallback"));
        assert_eq!(
            expand("$${LLM_KEY} costs $5", &env).as_deref(),
            Ok("${LLM_KEY} costs $5")
        );
        assert!(expand("${MISSING}", &env).unwrap_err().contains("MISSING"));
        assert!(expand("${UNCLOSED", &env).is_err());
        assert!(expand("${not a name}", &env).is_err());
        let mut value: toml::Value =
            toml::from_str("[llm]\napi_key = \"${MISSING}\"").unwrap_or(toml::Value::Integer(0));
        let err = interpolate("", &mut value, &env).unwrap_err();
        assert!(err.contains("llm.api_key") && err.contains("MISSING"), "{err}");
    }

    proptest::proptest! {
        #[test]
        fn any_file_string_expands_or_says_why(text in "[a-z$]{0,4}(\\$\\{[A-Z_:a-z-]{0,8}\\}?)?.{0,20}", plain in "[^$]{0,40}") {
            let env = |name: &str| (name == "SET").then(|| "value".to_owned());
            if let Err(why) = expand(&text, &env) {
                proptest::prop_assert!(!why.is_empty());
            }
            proptest::prop_assert_eq!(expand(&plain, &env), Ok(plain.clone()));
        }
    }

    #[test]
    fn secrets_are_redacted_when_shown() {
        let secret = Secret::new("sk-live-123");
        assert_eq!(format!("{secret:?}"), REDACTED);
        assert_eq!(serde_json::to_string(&secret).ok().as_deref(), Some("\"<redacted>\""));
        assert_eq!(secret.expose(), Some("sk-live-123"));
        assert!(!Secret::new("").is_set());
    }
}
