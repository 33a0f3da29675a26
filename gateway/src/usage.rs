//! The REST face of the observability service: usage (`/v1/usage`, with
//! its records and budgets), the usage summary (`/v1/metrics`) and the
//! tenant's recent logs (`/v1/logs`). Amounts are decimal dollar strings
//! (`"costUsd": "0.0315"`), exact to the pico-dollar.

use std::sync::Arc;

use avm_common::money::{format_usd, parse_usd};
use avm_common::{ApiError, RequestContext};
use avm_proto::observability::v1 as pb;
use avm_proto::runtime::v1 as rt;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::GatewayState;
use crate::rest::{Ctx, json_body, query_fields, reply};
use crate::ws::opt_str;

type AppState = State<Arc<GatewayState>>;

/// Returns the observability routes.
pub fn routes() -> Router<Arc<GatewayState>> {
    Router::new()
        .route("/v1/usage", get(usage))
        .route("/v1/usage/records", get(records))
        .route("/v1/usage/budgets", get(budgets).put(set_budget))
        .route("/v1/metrics", get(summary))
        .route("/v1/logs", get(logs))
}

/// Query of the usage routes.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct UsageQuery {
    /// Another tenant (operators).
    tenant_id: Option<String>,
    /// Every tenant (operators).
    all: Option<bool>,
    /// Start and end of the call times, Unix ms.
    from: Option<i64>,
    to: Option<i64>,
    /// A calendar month `YYYY-MM` (UTC), instead of `from`/`to`.
    month: Option<String>,
    /// Comma-separated dimensions: tenant, key, model, day, month, status, user.
    group_by: Option<String>,
    key_id: Option<String>,
    model: Option<String>,
    user_id: Option<String>,
    page_size: Option<u32>,
    page_token: Option<String>,
}

impl UsageQuery {
    /// Returns the time range: `month`, or `from`/`to`.
    fn range(&self) -> Result<(i64, i64), ApiError> {
        let Some(month) = &self.month else {
            return Ok((self.from.unwrap_or(0), self.to.unwrap_or(0)));
        };
        month_range(month).ok_or_else(|| ApiError::invalid("INVALID_MONTH", "month must be YYYY-MM"))
    }
}

/// Returns the Unix ms range of a UTC calendar month `YYYY-MM`.
fn month_range(month: &str) -> Option<(i64, i64)> {
    let (year, month) = month.split_once('-')?;
    let (year, month): (i64, i64) = (year.parse().ok()?, month.parse().ok()?);
    if !(1970..=9999).contains(&year) || !(1..=12).contains(&month) || month.to_string().len() > 2 {
        return None;
    }
    let next = if month == 12 { (year + 1, 1) } else { (year, month + 1) };
    Some((
        days_from_civil(year, month) * 86_400_000,
        days_from_civil(next.0, next.1) * 86_400_000,
    ))
}

/// Returns the days from 1970-01-01 to the first of `month` (after Howard Hinnant).
fn days_from_civil(year: i64, month: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const DIMENSIONS: [(&str, pb::Dimension); 7] = [
    ("tenant", pb::Dimension::Tenant),
    ("key", pb::Dimension::Key),
    ("model", pb::Dimension::Model),
    ("day", pb::Dimension::Day),
    ("month", pb::Dimension::Month),
    ("status", pb::Dimension::Status),
    ("user", pb::Dimension::User),
];

fn dimensions(group_by: Option<&str>) -> Result<Vec<(&'static str, pb::Dimension)>, ApiError> {
    group_by
        .unwrap_or("model")
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(|name| {
            DIMENSIONS
                .iter()
                .find(|(known, _)| *known == name)
                .copied()
                .ok_or_else(|| {
                    ApiError::invalid(
                        "INVALID_GROUP_BY",
                        "groupBy takes tenant, key, model, day, month, status and user",
                    )
                })
        })
        .collect()
}

fn totals_json(totals: &pb::UsageTotals) -> Value {
    json!({
        "calls": totals.calls,
        "inputTokens": totals.input_tokens,
        "outputTokens": totals.output_tokens,
        "cacheReadTokens": totals.cache_read_tokens,
        "cacheWriteTokens": totals.cache_write_tokens,
        "costUsd": format_usd(totals.cost_pico_usd),
        "billedUsd": format_usd(totals.billed_pico_usd),
        "estimatedCalls": totals.estimated_calls,
    })
}

fn status_name(status: i32) -> &'static str {
    match pb::CallStatus::try_from(status) {
        Ok(pb::CallStatus::Completed) => "completed",
        Ok(pb::CallStatus::Interrupted) => "interrupted",
        Ok(pb::CallStatus::Failed) => "failed",
        _ => "unknown",
    }
}

fn record_json(record: &pb::UsageRecord) -> Value {
    json!({
        "callId": record.call_id,
        "tenantId": record.tenant_id,
        "userId": record.user_id,
        "keyId": record.key_id,
        "containerId": record.container_id,
        "imageId": record.image_id,
        "agentId": record.agent_id,
        "provider": record.provider,
        "model": record.model,
        "inputTokens": record.input_tokens,
        "outputTokens": record.output_tokens,
        "cacheReadTokens": record.cache_read_tokens,
        "cacheWriteTokens": record.cache_write_tokens,
        "estimated": record.estimated,
        "status": status_name(record.status),
        "errorCode": record.error_code,
        "startedAt": record.started_at_ms,
        "endedAt": record.ended_at_ms,
        "firstTokenMs": record.first_token_ms,
        "costUsd": format_usd(record.cost_pico_usd),
        "billedUsd": format_usd(record.billed_pico_usd),
        "priced": record.priced,
        "ownKey": record.own_key,
    })
}

async fn usage(State(state): AppState, Ctx(ctx): Ctx, query: Result<Query<UsageQuery>, QueryRejection>) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let (from_ms, to_ms) = query.range()?;
        let dimensions = dimensions(query.group_by.as_deref())?;
        let request = pb::QueryUsageRequest {
            tenant_id: query.tenant_id.unwrap_or_default(),
            all_tenants: query.all.unwrap_or(false),
            from_ms,
            to_ms,
            group_by: dimensions.iter().map(|(_, dimension)| *dimension as i32).collect(),
            key_id: query.key_id.unwrap_or_default(),
            model: query.model.unwrap_or_default(),
            user_id: query.user_id.unwrap_or_default(),
        };
        let usage = state
            .backends
            .observability
            .clone()
            .query_usage(ctx.request(request))
            .await?
            .into_inner();
        let groups: Vec<Value> = usage
            .groups
            .iter()
            .map(|group| {
                let mut value = totals_json(&group.totals.unwrap_or_default());
                for ((name, _), key) in dimensions.iter().zip(&group.keys) {
                    value[*name] = json!(key);
                }
                value
            })
            .collect();
        Ok(json!({
            // Unbounded ends (nothing asked) are null.
            "from": (from_ms > 0).then_some(from_ms),
            "to": (to_ms > 0).then_some(to_ms),
            "groupBy": dimensions.iter().map(|(name, _)| *name).collect::<Vec<_>>(),
            "groups": groups,
            "totals": totals_json(&usage.totals.unwrap_or_default()),
        }))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn records(State(state): AppState, Ctx(ctx): Ctx, query: Result<Query<UsageQuery>, QueryRejection>) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let (from_ms, to_ms) = query.range()?;
        let request = pb::ListUsageRequest {
            tenant_id: query.tenant_id.unwrap_or_default(),
            all_tenants: query.all.unwrap_or(false),
            from_ms,
            to_ms,
            key_id: query.key_id.unwrap_or_default(),
            model: query.model.unwrap_or_default(),
            user_id: query.user_id.unwrap_or_default(),
            page_size: query.page_size.unwrap_or_default(),
            page_token: query.page_token.unwrap_or_default(),
        };
        let page = state
            .backends
            .observability
            .clone()
            .list_usage(ctx.request(request))
            .await?
            .into_inner();
        let mut body = json!({"records": page.records.iter().map(record_json).collect::<Vec<_>>()});
        if !page.next_page_token.is_empty() {
            body["nextPageToken"] = json!(page.next_page_token);
        }
        Ok(body)
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

fn budget_json(budget: &pb::Budget) -> Value {
    json!({
        "tenantId": budget.tenant_id,
        "keyId": if budget.key_id.is_empty() { Value::Null } else { json!(budget.key_id) },
        "monthlyLimitUsd": format_usd(budget.monthly_limit_pico_usd),
        "spentUsd": format_usd(budget.spent_pico_usd),
        "exhausted": budget.exhausted,
        "updatedAt": budget.updated_at_ms,
    })
}

async fn budgets(State(state): AppState, Ctx(ctx): Ctx, query: Result<Query<UsageQuery>, QueryRejection>) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let request = pb::ListBudgetsRequest {
            tenant_id: query.tenant_id.unwrap_or_default(),
        };
        let budgets = state
            .backends
            .observability
            .clone()
            .list_budgets(ctx.request(request))
            .await?
            .into_inner()
            .budgets;
        Ok(json!({"budgets": budgets.iter().map(budget_json).collect::<Vec<_>>()}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// `PUT /v1/usage/budgets` with `{"monthlyLimitUsd", "keyId"?, "tenantId"?}`;
/// a limit of 0 removes the budget.
async fn set_budget(State(state): AppState, Ctx(ctx): Ctx, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = json_body(body)?;
        let limit = match body.get("monthlyLimitUsd") {
            Some(Value::String(text)) => parse_usd(text),
            Some(Value::Number(number)) => number.as_f64().and_then(|usd| parse_usd(&format!("{usd}"))),
            _ => None,
        }
        .ok_or_else(|| {
            ApiError::invalid(
                "INVALID_BUDGET",
                "monthlyLimitUsd must be a non-negative amount of dollars, such as 25.00",
            )
        })?;
        let request = pb::SetBudgetRequest {
            tenant_id: opt_str(&body, "tenantId")?.unwrap_or_default(),
            key_id: opt_str(&body, "keyId")?.unwrap_or_default(),
            monthly_limit_pico_usd: limit,
        };
        let set = state
            .backends
            .observability
            .clone()
            .set_budget(ctx.request(request))
            .await?
            .into_inner();
        Ok(match set.budget {
            Some(budget) => budget_json(&budget),
            None => json!({"removed": true}),
        })
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// Query of `/v1/metrics`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SummaryQuery {
    tenant_id: Option<String>,
    all: Option<bool>,
    /// The window ending now, e.g. `15m`, `24h` (default `1h`).
    window: Option<String>,
}

fn latency_json(latency: Option<&pb::Latency>) -> Value {
    let latency = latency.cloned().unwrap_or_default();
    json!({"p50Ms": latency.p50_ms, "p90Ms": latency.p90_ms, "p99Ms": latency.p99_ms, "maxMs": latency.max_ms})
}

/// Returns a rate with three decimals, 0 when nothing happened.
fn rate(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        return 0.0;
    }
    (part as f64 / whole as f64 * 1000.0).round() / 1000.0
}

/// The usage summary: LLM calls of the window, their outcome, tokens and
/// latency, with the tenant's live agents and containers.
async fn summary(
    State(state): AppState,
    Ctx(ctx): Ctx,
    query: Result<Query<SummaryQuery>, QueryRejection>,
) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let window = match &query.window {
            None => std::time::Duration::from_secs(3600),
            Some(text) => humantime::parse_duration(text)
                .map_err(|_| ApiError::invalid("INVALID_WINDOW", "window must be a duration such as 15m or 24h"))?,
        };
        let tenant_id = query.tenant_id.clone().unwrap_or_default();
        let request = pb::GetUsageSummaryRequest {
            tenant_id: tenant_id.clone(),
            all_tenants: query.all.unwrap_or(false),
            window_ms: i64::try_from(window.as_millis()).unwrap_or(i64::MAX),
        };
        let summary = state
            .backends
            .observability
            .clone()
            .get_usage_summary(ctx.request(request))
            .await?
            .into_inner();
        let totals = summary.totals.unwrap_or_default();
        let mut body = json!({
            "from": summary.from_ms,
            "to": summary.to_ms,
            "requests": totals.calls,
            "completed": summary.completed,
            "interrupted": summary.interrupted,
            "failed": summary.failed,
            "successRate": rate(summary.completed, totals.calls),
            "errorRate": rate(summary.failed, totals.calls),
            "tokensIn": totals.input_tokens,
            "tokensOut": totals.output_tokens,
            "costUsd": format_usd(totals.cost_pico_usd),
            "billedUsd": format_usd(totals.billed_pico_usd),
            "firstTokenLatency": latency_json(summary.first_token.as_ref()),
            "latency": latency_json(summary.duration.as_ref()),
        });
        // Live counts are the caller's own tenant's (not another's, nor all).
        if tenant_id.is_empty() && !query.all.unwrap_or(false) {
            let (agents, containers) = live_counts(&state, &ctx).await?;
            body["activeAgents"] = json!(agents);
            body["activeContainers"] = json!(containers);
        }
        Ok(body)
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// Returns the caller's running agents, and the containers they run in.
async fn live_counts(state: &GatewayState, ctx: &RequestContext) -> Result<(usize, usize), ApiError> {
    let agents = state
        .backends
        .runtime
        .clone()
        .list_agents(ctx.request(rt::ListAgentsRequest { container_id: None }))
        .await?
        .into_inner()
        .agents;
    // Containers are rows; those with a running agent are the active ones.
    let containers: std::collections::HashSet<&str> = agents.iter().map(|agent| agent.container_id.as_str()).collect();
    Ok((agents.len(), containers.len()))
}

/// Query of `/v1/logs`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct LogsQuery {
    tenant_id: Option<String>,
    /// The lowest level shown: trace, debug, info (default), warn, error.
    level: Option<String>,
    from: Option<i64>,
    to: Option<i64>,
    limit: Option<u32>,
}

const LEVELS: [(&str, pb::Level); 5] = [
    ("trace", pb::Level::Trace),
    ("debug", pb::Level::Debug),
    ("info", pb::Level::Info),
    ("warn", pb::Level::Warn),
    ("error", pb::Level::Error),
];

fn level_name(level: i32) -> &'static str {
    LEVELS
        .iter()
        .find(|(_, known)| *known as i32 == level)
        .map_or("unknown", |(name, _)| *name)
}

async fn logs(State(state): AppState, Ctx(ctx): Ctx, query: Result<Query<LogsQuery>, QueryRejection>) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let min_level = match query.level.as_deref() {
            None => pb::Level::Info,
            Some(name) => LEVELS
                .iter()
                .find(|(known, _)| known.eq_ignore_ascii_case(name))
                .map(|(_, level)| *level)
                .ok_or_else(|| ApiError::invalid("INVALID_LEVEL", "level is trace, debug, info, warn or error"))?,
        };
        let request = pb::QueryLogsRequest {
            tenant_id: query.tenant_id.unwrap_or_default(),
            min_level: min_level as i32,
            from_ms: query.from.unwrap_or(0),
            to_ms: query.to.unwrap_or(0),
            limit: query.limit.unwrap_or_default(),
        };
        let events = state
            .backends
            .observability
            .clone()
            .query_logs(ctx.request(request))
            .await?
            .into_inner()
            .events;
        let events: Vec<Value> = events
            .iter()
            .map(|event| {
                json!({
                    "at": event.at_ms,
                    "level": level_name(event.level),
                    "component": event.component,
                    "target": event.target,
                    "message": event.message,
                    "fields": serde_json::from_str::<Value>(&event.fields_json).unwrap_or(Value::Null),
                    "requestId": event.request_id,
                    "traceId": event.trace_id,
                })
            })
            .collect();
        Ok(json!({"events": events}))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn months_are_utc_calendar_months() {
        assert_eq!(month_range("1970-01"), Some((0, 31 * 86_400_000)));
        assert_eq!(
            month_range("2024-02").map(|(from, to)| (to - from) / 86_400_000),
            Some(29)
        );
        assert_eq!(
            month_range("2026-12").map(|(_, to)| to),
            month_range("2027-01").map(|(from, _)| from)
        );
        assert_eq!(month_range("2026-13"), None);
        assert_eq!(month_range("26-1x"), None);
    }
}
