//! The domain types of the ledger, budgets and logs: what the service and the
//! store exchange, free of proto and of database rows.

use futures::stream::BoxStream;

use avm_common::calendar::day_of;

use crate::error::ObservabilityError;

/// How an LLM call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallStatus {
    Completed,
    Interrupted,
    Failed,
    /// Its runtime died during the call: billed at the estimate noted when
    /// the call was opened.
    Cut,
}

impl CallStatus {
    /// Returns the status as stored and as a group key.
    pub fn as_str(self) -> &'static str {
        match self {
            CallStatus::Completed => "completed",
            CallStatus::Interrupted => "interrupted",
            CallStatus::Failed => "failed",
            CallStatus::Cut => "cut",
        }
    }

    /// Parses a stored status.
    pub fn parse(text: &str) -> Option<CallStatus> {
        match text {
            "completed" => Some(CallStatus::Completed),
            "interrupted" => Some(CallStatus::Interrupted),
            "failed" => Some(CallStatus::Failed),
            "cut" => Some(CallStatus::Cut),
            _ => None,
        }
    }
}

/// One LLM call in the ledger; amounts are pico-dollars (1e-12 USD).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageRecord {
    /// Unique per call: a second report of the same id changes nothing.
    pub call_id: String,
    pub tenant_id: String,
    pub user_id: String,
    /// The API key of the call; empty for other credentials.
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
    /// Some counts are the runtime's estimate, not the provider's.
    pub estimated: bool,
    pub status: CallStatus,
    /// The stable reason of a failed call.
    pub error_code: String,
    pub started_at_ms: i64,
    pub ended_at_ms: i64,
    /// Milliseconds from the start to the first token; 0 when none came.
    pub first_token_ms: i64,
    pub cost_pico_usd: i64,
    pub billed_pico_usd: i64,
    pub priced: bool,
    pub own_key: bool,
}

impl UsageRecord {
    /// Returns the UTC calendar month of the call's start, `YYYY-MM`: the
    /// month whose budget it counts against.
    pub fn month(&self) -> String {
        avm_common::calendar::month_of(self.started_at_ms)
    }

    /// Returns the UTC day of the call's start, `YYYY-MM-DD`.
    pub fn day(&self) -> String {
        day_of(self.started_at_ms)
    }

    /// Returns how long the call took, in milliseconds.
    pub fn duration_ms(&self) -> i64 {
        self.ended_at_ms.saturating_sub(self.started_at_ms)
    }
}

/// Something usage can be grouped by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dimension {
    Tenant,
    Key,
    Model,
    /// The UTC day of the call's start, `YYYY-MM-DD`.
    Day,
    /// The UTC month of the call's start, `YYYY-MM`.
    Month,
    /// `completed`, `interrupted`, `failed` or `cut`.
    Status,
    User,
    /// The provider that answered: `anthropic`, `openai` or `offline`.
    Provider,
}

/// Sums over ledger records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsageTotals {
    pub calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_tokens: u64,
    pub cache_write_tokens: u64,
    pub cost_pico_usd: i64,
    pub billed_pico_usd: i64,
    /// Calls whose counts were estimated.
    pub estimated_calls: u64,
}

impl UsageTotals {
    /// Adds `other` to these totals.
    pub fn add(&mut self, other: &UsageTotals) {
        self.calls += other.calls;
        self.input_tokens += other.input_tokens;
        self.output_tokens += other.output_tokens;
        self.cache_read_tokens += other.cache_read_tokens;
        self.cache_write_tokens += other.cache_write_tokens;
        self.cost_pico_usd += other.cost_pico_usd;
        self.billed_pico_usd += other.billed_pico_usd;
        self.estimated_calls += other.estimated_calls;
    }

    /// Returns the totals of one record.
    pub fn of(record: &UsageRecord) -> UsageTotals {
        UsageTotals {
            calls: 1,
            input_tokens: record.input_tokens,
            output_tokens: record.output_tokens,
            cache_read_tokens: record.cache_read_tokens,
            cache_write_tokens: record.cache_write_tokens,
            cost_pico_usd: record.cost_pico_usd,
            billed_pico_usd: record.billed_pico_usd,
            estimated_calls: u64::from(record.estimated),
        }
    }
}

/// The totals of one combination of dimension values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageGroup {
    /// The value of each requested dimension, in the request's order.
    pub keys: Vec<String>,
    pub totals: UsageTotals,
}

/// The answer of a usage query: the groups, ordered by their keys, and their sum.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageReport {
    pub groups: Vec<UsageGroup>,
    pub totals: UsageTotals,
}

/// Which ledger records a caller asks about. Empty strings and zero times
/// mean "any".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageQuery {
    /// The tenant; empty means the caller's. Another one is for operators.
    pub tenant_id: String,
    /// Every tenant (operators).
    pub all_tenants: bool,
    /// Start (inclusive) and end (exclusive) of the calls' start times, Unix ms.
    pub from_ms: i64,
    pub to_ms: i64,
    pub key_id: String,
    pub model: String,
    pub user_id: String,
}

/// The records a store reads: every condition that is `Some` holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageFilter {
    /// `None` reads every tenant.
    pub tenant_id: Option<String>,
    /// Calls started at or after.
    pub from_ms: Option<i64>,
    /// Calls started before.
    pub to_ms: Option<i64>,
    pub key_id: Option<String>,
    pub model: Option<String>,
    pub user_id: Option<String>,
}

/// Where a page of records starts: after the record with this order key
/// (pages run newest first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageKey {
    pub started_at_ms: i64,
    pub call_id: String,
}

/// A page of ledger records, newest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsagePage {
    pub records: Vec<UsageRecord>,
    /// Present when another page follows.
    pub next_page_token: Option<String>,
}

/// When a call's first token came and how long it took, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallTiming {
    /// 0 when no token came.
    pub first_token_ms: i64,
    pub duration_ms: i64,
}

/// A distribution's percentiles, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Latency {
    pub p50_ms: i64,
    pub p90_ms: i64,
    pub p99_ms: i64,
    pub max_ms: i64,
}

/// Calls over a recent window.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageSummary {
    /// The window: calls started at or after `from_ms` and at or before `to_ms`.
    pub from_ms: i64,
    pub to_ms: i64,
    pub totals: UsageTotals,
    pub completed: u64,
    pub interrupted: u64,
    pub failed: u64,
    /// Time to first token, of the calls that had one.
    pub first_token: Latency,
    /// Whole call duration.
    pub duration: Latency,
}

/// A monthly spend cap as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredBudget {
    pub tenant_id: String,
    /// Empty for the whole tenant.
    pub key_id: String,
    pub monthly_limit_pico_usd: i64,
    pub updated_at_ms: i64,
}

/// A monthly spend cap with what is spent of it this calendar month (UTC).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budget {
    pub tenant_id: String,
    /// Empty for the whole tenant.
    pub key_id: String,
    pub monthly_limit_pico_usd: i64,
    /// Billed this month, counting records not yet written.
    pub spent_pico_usd: i64,
    /// Whether `spent` reached the limit.
    pub exhausted: bool,
    pub updated_at_ms: i64,
}

/// Whether a tenant and key may make another LLM call this month.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetCheck {
    pub allowed: bool,
    /// The budget that refuses, when one does.
    pub exhausted: Option<Budget>,
    /// The token quota that refuses, when one does.
    pub quota_exceeded: Option<TokenQuota>,
}

/// What an LLM call about to be made is expected to cost: its price (for
/// budgets) and its input and output tokens (for token quotas; zero when
/// none applies).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallEstimate {
    pub pico_usd: i64,
    pub tokens: u64,
}

/// The monthly token quota that refused an LLM call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenQuota {
    /// Empty for the tenant's own quota.
    pub key_id: String,
    /// Whether counted tokens used it up (else calls in flight hold the rest).
    pub used_up: bool,
}

/// One message of a budget watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetUpdate {
    /// Every budget (snapshot) or the one that changed.
    pub budgets: Vec<Budget>,
    pub snapshot: bool,
    /// The budget was removed.
    pub removed: bool,
}

/// The stream of a budget watch.
pub type BudgetWatch = BoxStream<'static, Result<BudgetUpdate, ObservabilityError>>;

/// A log event's severity; higher is more severe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    Trace = 1,
    Debug = 2,
    Info = 3,
    Warn = 4,
    Error = 5,
}

impl Level {
    /// Returns the level as stored.
    pub fn as_i32(self) -> i32 {
        self as i32
    }

    /// Parses a stored level.
    pub fn from_i32(value: i32) -> Option<Level> {
        match value {
            1 => Some(Level::Trace),
            2 => Some(Level::Debug),
            3 => Some(Level::Info),
            4 => Some(Level::Warn),
            5 => Some(Level::Error),
            _ => None,
        }
    }
}

/// One structured log line that names a tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEvent {
    pub tenant_id: String,
    pub at_ms: i64,
    pub level: Level,
    /// The component that logged it (`gateway`, `runtime`, …).
    pub component: String,
    /// The module path of the code that logged it.
    pub target: String,
    pub message: String,
    /// The event's and its spans' fields, as a JSON object of strings.
    pub fields_json: String,
    pub request_id: String,
    pub trace_id: String,
}

/// Which log events a caller asks about.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogQuery {
    /// Empty means the caller's tenant; others for operators.
    pub tenant_id: String,
    /// This level and above; `None` means info.
    pub min_level: Option<Level>,
    /// Start (inclusive) and end (exclusive), Unix ms; zero means unbounded.
    pub from_ms: i64,
    pub to_ms: i64,
    /// At most this many (default 100, at most 1000).
    pub limit: u32,
}

/// The log events a store reads, newest first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogFilter {
    pub tenant_id: String,
    pub min_level: Level,
    pub from_ms: Option<i64>,
    pub to_ms: Option<i64>,
    pub limit: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_order_by_severity() {
        assert!(Level::Error > Level::Warn && Level::Info > Level::Debug);
        for level in [Level::Trace, Level::Debug, Level::Info, Level::Warn, Level::Error] {
            assert_eq!(Level::from_i32(level.as_i32()), Some(level));
        }
        assert_eq!(Level::from_i32(0), None);
    }
}
