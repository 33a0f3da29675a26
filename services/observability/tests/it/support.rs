//! An observability service on a fresh database, and helpers.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use avm_common::ApiError;
use avm_common::testing::operator_ctx;
use avm_observability::{
    BudgetUpdate, BudgetWatch, CallStatus, CallTiming, Dimension, LedgerSettings, LogEvent, LogFilter,
    ObservabilityError, ObservabilityService, ObservabilityStore, PageKey, StoredBudget, UsageFilter, UsageGroup,
    UsageQuery, UsageRecord, UsageTotals, open_store,
};
use avm_store::events::EventTransport;
use avm_store::testing::TestDatabase;
use futures::StreamExt;

/// The operator tenant.
pub const OPS: &str = "ten_ops";
pub const A: &str = "ten_a";
pub const B: &str = "ten_b";

/// A service on a database made for the test.
pub struct Harness {
    pub service: ObservabilityService,
    pub store: Arc<dyn ObservabilityStore>,
    pub db: TestDatabase,
}

impl Harness {
    /// Returns a service with the default settings on `db`.
    pub async fn on(db: TestDatabase) -> Harness {
        let store = open_store(&db.url, Some(4)).await.expect("open observability store");
        let service = ObservabilityService::new(Arc::clone(&store), LedgerSettings::default());
        Harness { service, store, db }
    }

    /// Returns another service on the same store, with `settings`.
    pub fn with_settings(&self, settings: LedgerSettings) -> ObservabilityService {
        ObservabilityService::new(Arc::clone(&self.store), settings)
    }

    /// Returns another service (a second replica) with its own pool on the same database.
    pub async fn replica(&self) -> ObservabilityService {
        let store = open_store(&self.db.url, Some(4))
            .await
            .expect("open observability store");
        ObservabilityService::new(store, LedgerSettings::default())
    }

    /// Returns whether replicas on this database share events (Postgres).
    pub fn shares_events(&self) -> bool {
        self.store.event_transport().shares_events()
    }

    /// Returns every record of every tenant, as an operator lists them.
    pub async fn all_records(&self) -> Vec<UsageRecord> {
        list_all(
            &self.service,
            &UsageQuery {
                all_tenants: true,
                ..UsageQuery::default()
            },
        )
        .await
    }
}

/// Lists every page of `query` as an operator and returns the records.
pub async fn list_all(service: &ObservabilityService, query: &UsageQuery) -> Vec<UsageRecord> {
    let ops = operator_ctx(OPS);
    let mut records = Vec::new();
    let mut token = String::new();
    loop {
        let page = service.list_usage(&ops, query, 500, &token).await.unwrap();
        records.extend(page.records);
        match page.next_page_token {
            Some(next) => token = next,
            None => return records,
        }
    }
}

/// Returns a completed call of `tenant_id` started two seconds ago.
pub fn usage(call_id: &str, tenant_id: &str) -> UsageRecord {
    let now = avm_common::now_ms();
    UsageRecord {
        call_id: call_id.to_owned(),
        tenant_id: tenant_id.to_owned(),
        user_id: "usr_1".to_owned(),
        key_id: String::new(),
        container_id: "ctr_1".to_owned(),
        image_id: "img_1".to_owned(),
        agent_id: "agt_1".to_owned(),
        provider: "anthropic".to_owned(),
        model: "model-1".to_owned(),
        input_tokens: 100,
        output_tokens: 50,
        cache_read_tokens: 10,
        cache_write_tokens: 5,
        estimated: false,
        status: CallStatus::Completed,
        error_code: String::new(),
        started_at_ms: now - 2_000,
        ended_at_ms: now - 1_000,
        first_token_ms: 300,
        cost_pico_usd: 1_000,
        billed_pico_usd: 1_050,
        priced: true,
        own_key: false,
    }
}

/// Returns the sum of `records`.
pub fn totals_of<'a>(records: impl IntoIterator<Item = &'a UsageRecord>) -> UsageTotals {
    let mut totals = UsageTotals::default();
    for record in records {
        totals.add(&UsageTotals::of(record));
    }
    totals
}

/// Returns the error a caller would see, failing the test when there is none.
pub fn api_err<T: std::fmt::Debug>(result: Result<T, ObservabilityError>) -> ApiError {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(err) => ApiError::from(err),
    }
}

/// Returns the next update of a watch, failing after a generous deadline.
pub async fn next(watch: &mut BudgetWatch) -> BudgetUpdate {
    tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("an update in time")
        .expect("the watch goes on")
        .expect("no watch error")
}

/// A store that fails its usage writes while `failing` is set.
pub struct FlakyStore {
    pub inner: Arc<dyn ObservabilityStore>,
    pub failing: AtomicBool,
}

impl FlakyStore {
    pub fn new(inner: Arc<dyn ObservabilityStore>) -> Arc<FlakyStore> {
        Arc::new(FlakyStore {
            inner,
            failing: AtomicBool::new(false),
        })
    }

    pub fn fail(&self, failing: bool) {
        self.failing.store(failing, Ordering::SeqCst);
    }
}

#[async_trait]
impl ObservabilityStore for FlakyStore {
    async fn insert_usage(&self, records: &[UsageRecord], now_ms: i64) -> Result<HashSet<String>, ObservabilityError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(ObservabilityError::from(sqlx::Error::PoolTimedOut));
        }
        self.inner.insert_usage(records, now_ms).await
    }

    async fn insert_open_call(&self, record: &UsageRecord) -> Result<(), ObservabilityError> {
        self.inner.insert_open_call(record).await
    }

    async fn open_calls(&self, opened_before_ms: i64, limit: u32) -> Result<Vec<UsageRecord>, ObservabilityError> {
        self.inner.open_calls(opened_before_ms, limit).await
    }

    async fn usage_groups(
        &self,
        filter: &UsageFilter,
        group_by: &[Dimension],
    ) -> Result<Vec<UsageGroup>, ObservabilityError> {
        self.inner.usage_groups(filter, group_by).await
    }

    async fn list_usage(
        &self,
        filter: &UsageFilter,
        after: Option<&PageKey>,
        limit: u32,
    ) -> Result<Vec<UsageRecord>, ObservabilityError> {
        self.inner.list_usage(filter, after, limit).await
    }

    async fn call_timings(&self, filter: &UsageFilter, limit: u32) -> Result<Vec<CallTiming>, ObservabilityError> {
        self.inner.call_timings(filter, limit).await
    }

    async fn month_spend(&self, tenant_id: &str, key_id: Option<&str>, month: &str) -> Result<i64, ObservabilityError> {
        self.inner.month_spend(tenant_id, key_id, month).await
    }

    async fn budgets(&self, tenant_id: Option<&str>) -> Result<Vec<StoredBudget>, ObservabilityError> {
        self.inner.budgets(tenant_id).await
    }

    async fn budgets_for_call(&self, tenant_id: &str, key_id: &str) -> Result<Vec<StoredBudget>, ObservabilityError> {
        self.inner.budgets_for_call(tenant_id, key_id).await
    }

    async fn put_budget(&self, budget: &StoredBudget) -> Result<(), ObservabilityError> {
        self.inner.put_budget(budget).await
    }

    async fn delete_budget(&self, tenant_id: &str, key_id: &str) -> Result<bool, ObservabilityError> {
        self.inner.delete_budget(tenant_id, key_id).await
    }

    async fn insert_logs(&self, events: &[LogEvent]) -> Result<(), ObservabilityError> {
        self.inner.insert_logs(events).await
    }

    async fn query_logs(&self, filter: &LogFilter) -> Result<Vec<LogEvent>, ObservabilityError> {
        self.inner.query_logs(filter).await
    }

    async fn prune_logs(&self, before_ms: i64, keep_per_tenant: u64) -> Result<u64, ObservabilityError> {
        self.inner.prune_logs(before_ms, keep_per_tenant).await
    }

    fn event_transport(&self) -> EventTransport {
        self.inner.event_transport()
    }
}
