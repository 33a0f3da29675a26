//! The REST face of the config service: `GET`/`PUT /v1/config` and
//! `GET /v1/config/{key}`. Operators change the system layer by default,
//! everyone else their tenant's overrides; secrets always show redacted.

use std::sync::Arc;

use avm_common::{ApiError, RequestContext};
use avm_proto::config::v1 as pb;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::GatewayState;
use crate::rest::{Ctx, json_body, query_fields, reply};

type AppState = State<Arc<GatewayState>>;

/// Returns the config routes.
pub fn routes() -> Router<Arc<GatewayState>> {
    Router::new()
        .route("/v1/config", get(get_config).put(put_config))
        .route("/v1/config/{key}", get(get_key))
}

/// Query of the config routes.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ConfigQuery {
    /// `system` (the layers below any tenant's) or `tenant`.
    scope: Option<String>,
    /// Another tenant (operators).
    tenant_id: Option<String>,
}

/// Whether a request is about the system layers, from `?scope=`; unset means
/// the system for operators and the caller's tenant for everyone else.
fn system_scope(ctx: &RequestContext, query: &ConfigQuery) -> Result<bool, ApiError> {
    match query.scope.as_deref() {
        None => Ok(ctx.principal.operator && query.tenant_id.is_none()),
        Some("system") => Ok(true),
        Some("tenant") => Ok(false),
        Some(other) => Err(ApiError::invalid(
            "INVALID_SCOPE",
            format!("unknown scope {other:?}; scopes are system and tenant"),
        )),
    }
}

fn source_name(source: i32) -> &'static str {
    match pb::Source::try_from(source) {
        Ok(pb::Source::Default) => "default",
        Ok(pb::Source::Deployment) => "deployment",
        Ok(pb::Source::System) => "system",
        Ok(pb::Source::Tenant) => "tenant",
        _ => "unknown",
    }
}

fn entry_json(entry: &pb::Entry) -> Value {
    json!({
        "key": entry.key,
        "value": serde_json::from_str::<Value>(&entry.value_json).unwrap_or(Value::Null),
        "source": source_name(entry.source),
        "secret": entry.secret,
        "tenantOverridable": entry.tenant_overridable,
        "writable": entry.writable,
        "description": entry.description,
    })
}

/// Renders entries as `{"revision", "config": {nested values}, "entries": […]}`.
fn config_json(revision: u64, entries: &[pb::Entry]) -> Value {
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
    json!({
        "revision": revision,
        "config": tree,
        "entries": entries.iter().map(entry_json).collect::<Vec<_>>(),
    })
}

async fn fetch(
    state: &GatewayState,
    ctx: &RequestContext,
    query: &ConfigQuery,
    key: &str,
) -> Result<pb::GetConfigResponse, ApiError> {
    let request = pb::GetConfigRequest {
        tenant_id: query.tenant_id.clone().unwrap_or_default(),
        system_only: system_scope(ctx, query)?,
        key: key.to_owned(),
    };
    Ok(state
        .backends
        .config
        .clone()
        .get_config(ctx.request(request))
        .await?
        .into_inner())
}

async fn get_config(
    State(state): AppState,
    Ctx(ctx): Ctx,
    query: Result<Query<ConfigQuery>, QueryRejection>,
) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let config = fetch(&state, &ctx, &query, "").await?;
        Ok(config_json(config.revision, &config.entries))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn get_key(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(key): Path<String>,
    query: Result<Query<ConfigQuery>, QueryRejection>,
) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let config = fetch(&state, &ctx, &query, &key).await?;
        let entry = config
            .entries
            .first()
            .ok_or_else(|| ApiError::internal("the config service returned no entry"))?;
        let mut body = entry_json(entry);
        body["revision"] = json!(config.revision);
        Ok(body)
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// Sets keys from a flat (`{"llm.model": …}`) or nested (`{"llm": {"model": …}}`)
/// body; `null` removes an override, and a secret's redacted form keeps it.
async fn put_config(
    State(state): AppState,
    Ctx(ctx): Ctx,
    query: Result<Query<ConfigQuery>, QueryRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let body = json_body(body)?;
        let mut values = std::collections::HashMap::new();
        flatten("", &body, &mut values);
        let scope = if system_scope(&ctx, &query)? {
            pb::Scope::System
        } else {
            pb::Scope::Tenant
        };
        let request = pb::UpdateConfigRequest {
            scope: scope as i32,
            tenant_id: query.tenant_id.unwrap_or_default(),
            values,
        };
        let updated = state
            .backends
            .config
            .clone()
            .update_config(ctx.request(request))
            .await?
            .into_inner();
        Ok(config_json(updated.revision, &updated.entries))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// Flattens nested objects into dotted keys with JSON text values.
fn flatten(prefix: &str, value: &Value, out: &mut std::collections::HashMap<String, String>) {
    match value {
        Value::Object(map) => {
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
    use super::*;

    #[test]
    fn nested_and_flat_bodies_name_the_same_keys() {
        let mut nested = std::collections::HashMap::new();
        flatten(
            "",
            &json!({"llm": {"model": "m", "apiKey": null}, "defaults.maxTokens": 5}),
            &mut nested,
        );
        assert_eq!(nested.get("llm.model").map(String::as_str), Some("\"m\""));
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
        let body = config_json(3, &[entry("llm.model", "\"m\""), entry("llm.apiKey", "\"<redacted>\"")]);
        assert_eq!(body["config"]["llm"]["model"], "m");
        assert_eq!(body["config"]["llm"]["apiKey"], "<redacted>");
        assert_eq!(body["revision"], 3);
    }
}
