//! Usage: the ledger's totals and records, monthly budgets, the usage
//! summary and the tenant's recent logs. Amounts are decimal dollar strings
//! (`"costUsd": "0.0315"`), exact to the pico-dollar.

use std::collections::HashSet;
use std::time::Duration;

use avm_common::money::{format_usd, parse_usd};
use avm_common::{ApiError, RequestContext};
use avm_proto::observability::v1 as pb;
use avm_proto::runtime::v1 as rt;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Value, json};
use utoipa::{IntoParams, ToSchema};

use super::reasoned;
use crate::peers::Peers;

/// What usage to count, and how to group it.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UsageQuery {
    /// Another tenant (operators).
    pub tenant_id: Option<String>,
    /// Every tenant (operators).
    pub all: Option<bool>,
    /// Start of the call times, Unix ms.
    pub from: Option<i64>,
    /// End of the call times, Unix ms.
    pub to: Option<i64>,
    /// A calendar month `YYYY-MM` (UTC), instead of `from`/`to`.
    pub month: Option<String>,
    /// Comma-separated dimensions: tenant, key, provider, model, day, month, status, user (default model).
    pub group_by: Option<String>,
    pub key_id: Option<String>,
    pub model: Option<String>,
    pub user_id: Option<String>,
    pub page_size: Option<u32>,
    pub page_token: Option<String>,
}

impl UsageQuery {
    /// Returns the time range: `month`, or `from`/`to`.
    fn range(&self) -> Result<(i64, i64), ApiError> {
        let Some(month) = &self.month else {
            return Ok((self.from.unwrap_or(0), self.to.unwrap_or(0)));
        };
        avm_common::calendar::month_range(month)
            .ok_or_else(|| ApiError::invalid("INVALID_MONTH", "month must be YYYY-MM"))
    }
}

const DIMENSIONS: [(&str, pb::Dimension); 8] = [
    ("tenant", pb::Dimension::Tenant),
    ("key", pb::Dimension::Key),
    ("provider", pb::Dimension::Provider),
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
                        "groupBy takes tenant, key, provider, model, day, month, status and user",
                    )
                })
        })
        .collect()
}

/// Counts and amounts of a set of calls.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Totals {
    pub calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
    /// The providers' cost, dollars.
    pub cost_usd: String,
    /// What the tenant pays, dollars.
    pub billed_usd: String,
    /// Calls whose tokens were estimated (the stream was cut first).
    pub estimated_calls: u64,
}

impl From<pb::UsageTotals> for Totals {
    fn from(totals: pb::UsageTotals) -> Self {
        Self {
            calls: totals.calls,
            input_tokens: totals.input_tokens,
            output_tokens: totals.output_tokens,
            cache_read_tokens: totals.cache_read_tokens,
            cache_write_tokens: totals.cache_write_tokens,
            cost_usd: format_usd(totals.cost_pico_usd),
            billed_usd: format_usd(totals.billed_pico_usd),
            estimated_calls: totals.estimated_calls,
        }
    }
}

/// Usage over a range, grouped.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// Start of the range (Unix ms), null when unbounded.
    pub from: Option<i64>,
    /// End of the range (Unix ms), null when unbounded.
    pub to: Option<i64>,
    pub group_by: Vec<String>,
    /// Totals of each group, with its key under each dimension's name.
    #[schema(value_type = Vec<Object>)]
    pub groups: Vec<Value>,
    pub totals: Totals,
}

/// One LLM call of the ledger.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageRecord {
    pub call_id: String,
    pub tenant_id: String,
    pub user_id: String,
    pub key_id: String,
    pub container_id: String,
    pub image_id: String,
    pub agent_id: String,
    pub provider: String,
    pub model: String,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
    pub estimated: bool,
    /// `completed`, `interrupted`, `failed` or `cut` (its runtime ended
    /// during the call: billed at the estimate noted when it was made).
    pub status: String,
    pub error_code: String,
    pub started_at: i64,
    pub ended_at: i64,
    pub first_token_ms: i64,
    pub cost_usd: String,
    pub billed_usd: String,
    /// Whether the model had a price.
    pub priced: bool,
    /// Whether the call used the tenant's own provider key (not billed).
    pub own_key: bool,
}

fn status_name(status: i32) -> &'static str {
    match pb::CallStatus::try_from(status) {
        Ok(pb::CallStatus::Completed) => "completed",
        Ok(pb::CallStatus::Interrupted) => "interrupted",
        Ok(pb::CallStatus::Failed) => "failed",
        Ok(pb::CallStatus::Cut) => "cut",
        _ => "unknown",
    }
}

impl From<pb::UsageRecord> for UsageRecord {
    fn from(record: pb::UsageRecord) -> Self {
        Self {
            status: status_name(record.status).to_owned(),
            cost_usd: format_usd(record.cost_pico_usd),
            billed_usd: format_usd(record.billed_pico_usd),
            call_id: record.call_id,
            tenant_id: record.tenant_id,
            user_id: record.user_id,
            key_id: record.key_id,
            container_id: record.container_id,
            image_id: record.image_id,
            agent_id: record.agent_id,
            provider: record.provider,
            model: record.model,
            input_tokens: record.input_tokens,
            output_tokens: record.output_tokens,
            cache_read_tokens: record.cache_read_tokens,
            cache_write_tokens: record.cache_write_tokens,
            estimated: record.estimated,
            error_code: record.error_code,
            started_at: record.started_at_ms,
            ended_at: record.ended_at_ms,
            first_token_ms: record.first_token_ms,
            priced: record.priced,
            own_key: record.own_key,
        }
    }
}

/// A page of ledger records.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecordPage {
    pub records: Vec<UsageRecord>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

/// A monthly budget.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Budget {
    pub tenant_id: String,
    /// The key it caps; null for the whole tenant.
    pub key_id: Option<String>,
    pub monthly_limit_usd: String,
    pub spent_usd: String,
    pub exhausted: bool,
    pub updated_at: i64,
}

impl From<pb::Budget> for Budget {
    fn from(budget: pb::Budget) -> Self {
        Self {
            key_id: Some(budget.key_id).filter(|key| !key.is_empty()),
            monthly_limit_usd: format_usd(budget.monthly_limit_pico_usd),
            spent_usd: format_usd(budget.spent_pico_usd),
            tenant_id: budget.tenant_id,
            exhausted: budget.exhausted,
            updated_at: budget.updated_at_ms,
        }
    }
}

/// Budgets.
#[derive(Debug, Serialize, ToSchema)]
pub struct BudgetList {
    pub budgets: Vec<Budget>,
}

/// A budget to set; a limit of 0 removes it.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewBudget {
    /// Dollars, as a string (`"25.00"`) or a number.
    #[serde(deserialize_with = "dollars")]
    #[schema(value_type = String)]
    pub monthly_limit_usd: i64,
    /// A key of the tenant, to cap it alone.
    #[serde(default)]
    pub key_id: Option<String>,
    /// Another tenant (operators).
    #[serde(default)]
    pub tenant_id: Option<String>,
}

fn dollars<'de, D: Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
    let limit = match Value::deserialize(deserializer)? {
        Value::String(text) => parse_usd(&text),
        Value::Number(number) => number.as_f64().and_then(|usd| parse_usd(&format!("{usd}"))),
        _ => None,
    };
    limit.ok_or_else(|| {
        reasoned(
            "INVALID_BUDGET",
            "monthlyLimitUsd must be a non-negative amount of dollars, such as 25.00",
        )
    })
}

/// What setting a budget answers: the budget, or that it was removed.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum BudgetSet {
    Set(Budget),
    Removed { removed: bool },
}

/// Whose usage summary, over which window.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SummaryQuery {
    pub tenant_id: Option<String>,
    pub all: Option<bool>,
    /// The window ending now, e.g. `15m`, `24h` (default `1h`).
    pub window: Option<String>,
}

/// Percentiles of a latency, ms.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Latency {
    pub p50_ms: i64,
    pub p90_ms: i64,
    pub p99_ms: i64,
    pub max_ms: i64,
}

impl From<Option<pb::Latency>> for Latency {
    fn from(latency: Option<pb::Latency>) -> Self {
        let latency = latency.unwrap_or_default();
        Self {
            p50_ms: latency.p50_ms,
            p90_ms: latency.p90_ms,
            p99_ms: latency.p99_ms,
            max_ms: latency.max_ms,
        }
    }
}

/// The LLM calls of a window, their outcome, tokens and latency, with the
/// tenant's live agents and containers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    pub from: i64,
    pub to: i64,
    pub requests: u64,
    pub completed: u64,
    pub interrupted: u64,
    pub failed: u64,
    pub success_rate: f64,
    pub error_rate: f64,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub cost_usd: String,
    pub billed_usd: String,
    pub first_token_latency: Latency,
    pub latency: Latency,
    /// The caller's own tenant's running agents (not shown for another tenant or all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_agents: Option<usize>,
    /// The containers those agents run in.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_containers: Option<usize>,
}

/// Whose logs, how severe, when.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LogsQuery {
    pub tenant_id: Option<String>,
    /// The lowest level shown: trace, debug, info (default), warn, error.
    pub level: Option<String>,
    pub from: Option<i64>,
    pub to: Option<i64>,
    pub limit: Option<u32>,
}

/// One log event of the tenant.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LogEvent {
    pub at: i64,
    pub level: String,
    pub component: String,
    pub target: String,
    pub message: String,
    #[schema(value_type = Object)]
    pub fields: Value,
    pub request_id: String,
    pub trace_id: String,
}

/// The tenant's recent log events.
#[derive(Debug, Serialize, ToSchema)]
pub struct LogList {
    pub events: Vec<LogEvent>,
}

const LEVELS: [(&str, pb::Level); 5] = [
    ("trace", pb::Level::Trace),
    ("debug", pb::Level::Debug),
    ("info", pb::Level::Info),
    ("warn", pb::Level::Warn),
    ("error", pb::Level::Error),
];

/// Returns the caller's usage totals, grouped.
pub async fn usage(peers: &Peers, ctx: &RequestContext, query: UsageQuery) -> Result<Usage, ApiError> {
    let (from_ms, to_ms) = query.range()?;
    let dimensions = dimensions(query.group_by.as_deref())?;
    let call = pb::QueryUsageRequest {
        tenant_id: query.tenant_id.unwrap_or_default(),
        all_tenants: query.all.unwrap_or(false),
        from_ms,
        to_ms,
        group_by: dimensions.iter().map(|(_, dimension)| *dimension as i32).collect(),
        key_id: query.key_id.unwrap_or_default(),
        model: query.model.unwrap_or_default(),
        user_id: query.user_id.unwrap_or_default(),
    };
    let usage = peers.observability.query_usage(ctx.request(call)).await?.into_inner();
    let groups = usage
        .groups
        .into_iter()
        .map(|group| {
            let mut value = serde_json::to_value(Totals::from(group.totals.unwrap_or_default())).unwrap_or_default();
            for ((name, _), key) in dimensions.iter().zip(&group.keys) {
                value[*name] = json!(key);
            }
            value
        })
        .collect();
    Ok(Usage {
        // Unbounded ends (nothing asked) are null.
        from: (from_ms > 0).then_some(from_ms),
        to: (to_ms > 0).then_some(to_ms),
        group_by: dimensions.iter().map(|(name, _)| (*name).to_owned()).collect(),
        groups,
        totals: usage.totals.unwrap_or_default().into(),
    })
}

/// Returns a page of the caller's ledger records.
pub async fn records(peers: &Peers, ctx: &RequestContext, query: UsageQuery) -> Result<RecordPage, ApiError> {
    let (from_ms, to_ms) = query.range()?;
    let call = pb::ListUsageRequest {
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
    let page = peers.observability.list_usage(ctx.request(call)).await?.into_inner();
    Ok(RecordPage {
        records: page.records.into_iter().map(UsageRecord::from).collect(),
        next_page_token: Some(page.next_page_token).filter(|token| !token.is_empty()),
    })
}

/// Lists the budgets of the caller's tenant (or another's, operators).
pub async fn budgets(peers: &Peers, ctx: &RequestContext, query: UsageQuery) -> Result<BudgetList, ApiError> {
    let call = pb::ListBudgetsRequest {
        tenant_id: query.tenant_id.unwrap_or_default(),
    };
    let budgets = peers
        .observability
        .list_budgets(ctx.request(call))
        .await?
        .into_inner()
        .budgets;
    Ok(BudgetList {
        budgets: budgets.into_iter().map(Budget::from).collect(),
    })
}

/// Sets (or, with 0, removes) a monthly budget. A key's budget names a key
/// of the budget's tenant: the observability service answers another
/// tenant's key, or a missing one, exactly as a missing key (issue 26 item 14).
pub async fn set_budget(peers: &Peers, ctx: &RequestContext, request: NewBudget) -> Result<BudgetSet, ApiError> {
    let call = pb::SetBudgetRequest {
        tenant_id: request.tenant_id.unwrap_or_default(),
        key_id: request.key_id.unwrap_or_default(),
        monthly_limit_pico_usd: request.monthly_limit_usd,
    };
    let set = peers.observability.set_budget(ctx.request(call)).await?.into_inner();
    Ok(match set.budget {
        Some(budget) => BudgetSet::Set(budget.into()),
        None => BudgetSet::Removed { removed: true },
    })
}

/// Returns a rate with three decimals, 0 when nothing happened.
fn rate(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        return 0.0;
    }
    (part as f64 / whole as f64 * 1000.0).round() / 1000.0
}

/// Returns the usage summary of a window.
pub async fn summary(peers: &Peers, ctx: &RequestContext, query: SummaryQuery) -> Result<Summary, ApiError> {
    let window = match &query.window {
        None => Duration::from_secs(3600),
        Some(text) => humantime::parse_duration(text)
            .map_err(|_| ApiError::invalid("INVALID_WINDOW", "window must be a duration such as 15m or 24h"))?,
    };
    let tenant_id = query.tenant_id.clone().unwrap_or_default();
    let all = query.all.unwrap_or(false);
    let call = pb::GetUsageSummaryRequest {
        tenant_id: tenant_id.clone(),
        all_tenants: all,
        window_ms: i64::try_from(window.as_millis()).unwrap_or(i64::MAX),
    };
    let summary = peers
        .observability
        .get_usage_summary(ctx.request(call))
        .await?
        .into_inner();
    let totals = summary.totals.unwrap_or_default();
    // Live counts are the caller's own tenant's (not another's, nor all).
    let (active_agents, active_containers) = if tenant_id.is_empty() && !all {
        let (agents, containers) = live_counts(peers, ctx).await?;
        (Some(agents), Some(containers))
    } else {
        (None, None)
    };
    Ok(Summary {
        from: summary.from_ms,
        to: summary.to_ms,
        requests: totals.calls,
        completed: summary.completed,
        interrupted: summary.interrupted,
        failed: summary.failed,
        success_rate: rate(summary.completed, totals.calls),
        error_rate: rate(summary.failed, totals.calls),
        tokens_in: totals.input_tokens,
        tokens_out: totals.output_tokens,
        cost_usd: format_usd(totals.cost_pico_usd),
        billed_usd: format_usd(totals.billed_pico_usd),
        first_token_latency: summary.first_token.into(),
        latency: summary.duration.into(),
        active_agents,
        active_containers,
    })
}

/// Returns the caller's running agents, and the containers they run in.
async fn live_counts(peers: &Peers, ctx: &RequestContext) -> Result<(usize, usize), ApiError> {
    let call = ctx.request(rt::ListAgentsRequest { container_id: None });
    let agents = peers.runtime.list_agents(call).await?.into_inner().agents;
    // Containers are rows; those with a running agent are the active ones.
    let containers: HashSet<&str> = agents.iter().map(|agent| agent.container_id.as_str()).collect();
    Ok((agents.len(), containers.len()))
}

/// Returns the tenant's recent log events.
pub async fn logs(peers: &Peers, ctx: &RequestContext, query: LogsQuery) -> Result<LogList, ApiError> {
    let min_level = match query.level.as_deref() {
        None => pb::Level::Info,
        Some(name) => LEVELS
            .iter()
            .find(|(known, _)| known.eq_ignore_ascii_case(name))
            .map(|(_, level)| *level)
            .ok_or_else(|| ApiError::invalid("INVALID_LEVEL", "level is trace, debug, info, warn or error"))?,
    };
    let call = pb::QueryLogsRequest {
        tenant_id: query.tenant_id.unwrap_or_default(),
        min_level: min_level as i32,
        from_ms: query.from.unwrap_or(0),
        to_ms: query.to.unwrap_or(0),
        limit: query.limit.unwrap_or_default(),
    };
    let events = peers
        .observability
        .query_logs(ctx.request(call))
        .await?
        .into_inner()
        .events;
    Ok(LogList {
        events: events
            .into_iter()
            .map(|event| LogEvent {
                at: event.at_ms,
                level: LEVELS
                    .iter()
                    .find(|(_, known)| *known as i32 == event.level)
                    .map_or("unknown", |(name, _)| *name)
                    .to_owned(),
                component: event.component,
                target: event.target,
                message: event.message,
                fields: serde_json::from_str(&event.fields_json).unwrap_or(Value::Null),
                request_id: event.request_id,
                trace_id: event.trace_id,
            })
            .collect(),
    })
}
