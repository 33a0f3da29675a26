//! The configuration center: effective values with their source, and the
//! system's or a tenant's overrides. Operators change the system layer by
//! default, everyone else their tenant's; secrets always show redacted.

use std::collections::HashMap;

use avm_common::{ApiError, RequestContext};
use avm_proto::config::v1 as pb;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::{IntoParams, ToSchema};

use super::{JsonObject, missing};
use crate::peers::Peers;

/// Which layers a config request is about.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ConfigScope {
    /// `system` (the layers below any tenant's) or `tenant`; unset means the
    /// system for operators and the caller's tenant for everyone else.
    pub scope: Option<String>,
    /// Another tenant (operators).
    pub tenant_id: Option<String>,
}

impl ConfigScope {
    /// Returns whether the request is about the system layers.
    fn system(&self, ctx: &RequestContext) -> Result<bool, ApiError> {
        match self.scope.as_deref() {
            None => Ok(ctx.principal.operator && self.tenant_id.is_none()),
            Some("system") => Ok(true),
            Some("tenant") => Ok(false),
            Some(other) => Err(ApiError::invalid(
                "INVALID_SCOPE",
                format!("unknown scope {other:?}; scopes are system and tenant"),
            )),
        }
    }
}

/// One key of the configuration.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    pub key: String,
    /// Secrets show as `<redacted>`.
    #[schema(value_type = Object)]
    pub value: Value,
    /// `default`, `deployment`, `system` or `tenant`.
    pub source: String,
    pub secret: bool,
    pub tenant_overridable: bool,
    pub writable: bool,
    pub description: String,
}

impl From<&pb::Entry> for Entry {
    fn from(entry: &pb::Entry) -> Self {
        let source = match pb::Source::try_from(entry.source) {
            Ok(pb::Source::Default) => "default",
            Ok(pb::Source::Deployment) => "deployment",
            Ok(pb::Source::System) => "system",
            Ok(pb::Source::Tenant) => "tenant",
            _ => "unknown",
        };
        Self {
            key: entry.key.clone(),
            value: serde_json::from_str(&entry.value_json).unwrap_or(Value::Null),
            source: source.to_owned(),
            secret: entry.secret,
            tenant_overridable: entry.tenant_overridable,
            writable: entry.writable,
            description: entry.description.clone(),
        }
    }
}

/// The configuration: its values as a tree and every entry.
#[derive(Debug, Serialize, ToSchema)]
pub struct Config {
    pub revision: u64,
    /// The values, nested by the keys' dots.
    #[schema(value_type = Object)]
    pub config: Map<String, Value>,
    pub entries: Vec<Entry>,
}

impl Config {
    fn new(revision: u64, entries: &[pb::Entry]) -> Self {
        let mut tree = Map::new();
        for entry in entries {
            let value = serde_json::from_str::<Value>(&entry.value_json).unwrap_or(Value::Null);
            let mut node = &mut tree;
            let mut parts = entry.key.split('.').peekable();
            while let Some(part) = parts.next() {
                if parts.peek().is_none() {
                    node.insert(part.to_owned(), value.clone());
                    break;
                }
                let child = node.entry(part.to_owned()).or_insert_with(|| Value::Object(Map::new()));
                let Value::Object(child) = child else { break };
                node = child;
            }
        }
        Self {
            revision,
            config: tree,
            entries: entries.iter().map(Entry::from).collect(),
        }
    }
}

/// One key with the configuration's revision.
#[derive(Debug, Serialize, ToSchema)]
pub struct KeyValue {
    #[serde(flatten)]
    pub entry: Entry,
    pub revision: u64,
}

async fn fetch(
    peers: &Peers,
    ctx: &RequestContext,
    scope: &ConfigScope,
    key: String,
) -> Result<pb::GetConfigResponse, ApiError> {
    let call = pb::GetConfigRequest {
        tenant_id: scope.tenant_id.clone().unwrap_or_default(),
        system_only: scope.system(ctx)?,
        key,
    };
    Ok(peers.config.get_config(ctx.request(call)).await?.into_inner())
}

/// Returns the effective configuration.
pub async fn get(peers: &Peers, ctx: &RequestContext, scope: ConfigScope) -> Result<Config, ApiError> {
    let config = fetch(peers, ctx, &scope, String::new()).await?;
    Ok(Config::new(config.revision, &config.entries))
}

/// Returns one key.
pub async fn get_key(
    peers: &Peers,
    ctx: &RequestContext,
    key: String,
    scope: ConfigScope,
) -> Result<KeyValue, ApiError> {
    let config = fetch(peers, ctx, &scope, key).await?;
    let entry = config.entries.first().ok_or_else(|| missing("config entry"))?;
    Ok(KeyValue {
        entry: entry.into(),
        revision: config.revision,
    })
}

/// Sets keys from a flat (`{"llm.model": …}`) or nested (`{"llm": {"model": …}}`)
/// object; `null` removes an override, and a secret's redacted form keeps it.
pub async fn update(
    peers: &Peers,
    ctx: &RequestContext,
    scope: ConfigScope,
    values: JsonObject,
) -> Result<Config, ApiError> {
    let mut flat = HashMap::new();
    flatten("", &Value::Object(values.0), &mut flat);
    let layer = if scope.system(ctx)? {
        pb::Scope::System
    } else {
        pb::Scope::Tenant
    };
    let call = pb::UpdateConfigRequest {
        scope: layer as i32,
        tenant_id: scope.tenant_id.unwrap_or_default(),
        values: flat,
    };
    let updated = peers.config.update_config(ctx.request(call)).await?.into_inner();
    Ok(Config::new(updated.revision, &updated.entries))
}

/// Flattens nested objects into dotted keys with JSON text values; a table
/// key's object is its value.
fn flatten(prefix: &str, value: &Value, out: &mut HashMap<String, String>) {
    match value {
        Value::Object(map) if !avm_common::settings::TABLE_KEYS.contains(&prefix) => {
            for (key, child) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                flatten(&path, child, out);
            }
        }
        other => {
            out.insert(prefix.to_owned(), other.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn nested_and_flat_bodies_name_the_same_keys() {
        let mut nested = HashMap::new();
        flatten(
            "",
            &json!({"llm": {"model": "m", "apiKey": null}, "defaults.maxTokens": 5}),
            &mut nested,
        );
        assert_eq!(nested.get("llm.model").map(String::as_str), Some("\"m\""));
        let mut tables = HashMap::new();
        flatten(
            "",
            &json!({"llm": {"contextWindows": {"claude-": 8000}}, "billing.prices": {"m": {"input": 1}}}),
            &mut tables,
        );
        assert_eq!(
            tables.get("llm.contextWindows").map(String::as_str),
            Some(r#"{"claude-":8000}"#)
        );
        assert_eq!(
            tables.get("billing.prices").map(String::as_str),
            Some(r#"{"m":{"input":1}}"#)
        );
        assert_eq!(nested.get("llm.apiKey").map(String::as_str), Some("null"));
        assert_eq!(nested.get("defaults.maxTokens").map(String::as_str), Some("5"));
        assert_eq!(nested.len(), 3);
    }

    #[test]
    fn entries_render_as_a_tree() {
        let entry = |key: &str, value: &str| pb::Entry {
            key: key.into(),
            value_json: value.into(),
            ..pb::Entry::default()
        };
        let body = Config::new(3, &[entry("llm.model", "\"m\""), entry("llm.apiKey", "\"<redacted>\"")]);
        let body = serde_json::to_value(&body).unwrap_or_default();
        assert_eq!(body["config"]["llm"]["model"], "m");
        assert_eq!(body["config"]["llm"]["apiKey"], "<redacted>");
        assert_eq!(body["revision"], 3);
    }
}
