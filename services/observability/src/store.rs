//! The database: one trait, with a SQLite and a Postgres implementation that
//! share their statements (`store/sql.rs`).

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use avm_common::ApiError;
use avm_store::db::{self, DbPool};
use avm_store::events::EventTransport;

use crate::error::ObservabilityError;
use crate::record::{
    CallTiming, Dimension, LogEvent, LogFilter, PageKey, StoredBudget, UsageFilter, UsageGroup, UsageRecord,
};

mod postgres;
mod sql;
mod sqlite;

pub use postgres::PostgresObservabilityStore;
pub use sqlite::SqliteObservabilityStore;

/// Persists the usage ledger, the budgets and the tenants' log events.
#[async_trait]
pub trait ObservabilityStore: Send + Sync + 'static {
    /// Inserts `records` (distinct call ids) in one transaction, skipping
    /// those whose call id is already stored, and returns the call ids it
    /// inserted; the calls are no longer open. `now_ms` is stored as the
    /// time they were recorded.
    async fn insert_usage(&self, records: &[UsageRecord], now_ms: i64) -> Result<HashSet<String>, ObservabilityError>;

    /// Notes a call being made, as the record it would be if cut now, unless
    /// it is noted already; [`ObservabilityStore::insert_usage`] of its record
    /// deletes the note.
    async fn insert_open_call(&self, record: &UsageRecord) -> Result<(), ObservabilityError>;

    /// Returns at most `limit` of the oldest calls noted open before
    /// `opened_before_ms` (by their start), as noted.
    async fn open_calls(&self, opened_before_ms: i64, limit: u32) -> Result<Vec<UsageRecord>, ObservabilityError>;

    /// Returns the totals of the records `filter` selects, one group per
    /// combination of the values of `group_by` (one group with no keys when
    /// `group_by` is empty and a record matches), in no particular order.
    async fn usage_groups(
        &self,
        filter: &UsageFilter,
        group_by: &[Dimension],
    ) -> Result<Vec<UsageGroup>, ObservabilityError>;

    /// Returns at most `limit` records `filter` selects, newest first by
    /// (`started_at_ms`, `call_id`), starting after `after`.
    async fn list_usage(
        &self,
        filter: &UsageFilter,
        after: Option<&PageKey>,
        limit: u32,
    ) -> Result<Vec<UsageRecord>, ObservabilityError>;

    /// Returns the timings of at most `limit` of the newest records `filter` selects.
    async fn call_timings(&self, filter: &UsageFilter, limit: u32) -> Result<Vec<CallTiming>, ObservabilityError>;

    /// Returns what a tenant (or, with `key_id`, one of its keys) was billed
    /// for the calls started in `month` (`YYYY-MM`), as stored.
    async fn month_spend(&self, tenant_id: &str, key_id: Option<&str>, month: &str) -> Result<i64, ObservabilityError>;

    /// Returns the budgets of a tenant, or of every tenant when `None`.
    async fn budgets(&self, tenant_id: Option<&str>) -> Result<Vec<StoredBudget>, ObservabilityError>;

    /// Returns the budgets a call of `tenant_id` with `key_id` answers to:
    /// the tenant's own and, when `key_id` is not empty, the key's.
    async fn budgets_for_call(&self, tenant_id: &str, key_id: &str) -> Result<Vec<StoredBudget>, ObservabilityError>;

    /// Creates or replaces a budget.
    async fn put_budget(&self, budget: &StoredBudget) -> Result<(), ObservabilityError>;

    /// Removes a budget; returns whether there was one.
    async fn delete_budget(&self, tenant_id: &str, key_id: &str) -> Result<bool, ObservabilityError>;

    /// Inserts log events in one transaction.
    async fn insert_logs(&self, events: &[LogEvent]) -> Result<(), ObservabilityError>;

    /// Returns the log events `filter` selects, newest first.
    async fn query_logs(&self, filter: &LogFilter) -> Result<Vec<LogEvent>, ObservabilityError>;

    /// Deletes the log events older than `before_ms`, and every tenant's
    /// beyond its newest `keep_per_tenant`; returns how many it deleted.
    async fn prune_logs(&self, before_ms: i64, keep_per_tenant: u64) -> Result<u64, ObservabilityError>;

    /// Returns how change events travel between the replicas on this store.
    fn event_transport(&self) -> EventTransport;
}

/// Opens the store named by `url` (`sqlite://…` or `postgres://…`) and brings
/// its schema up to date.
pub async fn open_store(url: &str, max_connections: Option<u32>) -> Result<Arc<dyn ObservabilityStore>, ApiError> {
    let store: Arc<dyn ObservabilityStore> = match db::connect(url, max_connections).await? {
        DbPool::Sqlite(pool) => Arc::new(SqliteObservabilityStore::new(pool).await?),
        DbPool::Postgres(pool) => Arc::new(PostgresObservabilityStore::new(pool).await?),
    };
    Ok(store)
}

/// Returns budget rows as budgets, ordered by tenant and key (bytewise, the
/// same on both databases).
fn budgets_from_rows(rows: Vec<(String, String, i64, i64)>) -> Vec<StoredBudget> {
    let mut budgets: Vec<StoredBudget> = rows
        .into_iter()
        .map(
            |(tenant_id, key_id, monthly_limit_pico_usd, updated_at_ms)| StoredBudget {
                tenant_id,
                key_id,
                monthly_limit_pico_usd,
                updated_at_ms,
            },
        )
        .collect();
    budgets.sort_by(|a, b| (&a.tenant_id, &a.key_id).cmp(&(&b.tenant_id, &b.key_id)));
    budgets
}
