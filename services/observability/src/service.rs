//! The observability service: the usage ledger, budgets and tenants' logs,
//! with their permissions and validation.
//!
//! Who may do what:
//! - `RecordUsage`, `RecordLogs`, `CheckBudget`, `WatchBudgets`: AgentVM's
//!   components only (service principals), for any tenant.
//! - Usage queries (`QueryUsage`, `ListUsage`, `GetUsageSummary`) and
//!   `ListBudgets`: anyone of the tenant; members see only their own calls.
//! - `SetBudget`: the tenant's admins; `QueryLogs`: admins (not members).
//! - Another tenant, or every tenant: operators (and components) only. Naming
//!   another tenant otherwise is refused with `OPERATOR_REQUIRED`, the same
//!   answer whether that tenant exists or not.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use avm_common::auth::{Role, Scopes};
use avm_common::calendar::month_of;
use avm_common::{ApiError, Code, RequestContext};
use avm_store::events::EventBus;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use futures::{StreamExt, future};
use tokio_util::sync::CancellationToken;
use tracing::instrument;

use crate::config::LedgerSettings;
use crate::error::ObservabilityError;
use crate::events::{BudgetChanged, ObservabilityEvent};
use crate::ledger::{Ledger, SpendKey};
use crate::quotas::AuthQuotas;
use crate::record::{
    Budget, BudgetCheck, BudgetUpdate, BudgetWatch, CallEstimate, CallTiming, Dimension, Latency, Level, LogEvent,
    LogFilter, LogQuery, PageKey, StoredBudget, UsageFilter, UsagePage, UsageQuery, UsageRecord, UsageReport,
    UsageSummary, UsageTotals,
};
use crate::store::ObservabilityStore;

/// Most usage records one `RecordUsage` may carry.
pub const MAX_RECORDS_PER_REQUEST: usize = 1000;

/// Most log events one `RecordLogs` may carry.
pub const MAX_LOG_EVENTS_PER_REQUEST: usize = 1000;

/// Longest call id.
pub const MAX_CALL_ID_BYTES: usize = 128;

/// Longest tenant or API key id.
const MAX_ID_BYTES: usize = 128;

/// Longest other text field of a usage record (user, container, model, …).
const MAX_FIELD_BYTES: usize = 256;

/// A log message longer than this is truncated.
pub const MAX_LOG_MESSAGE_BYTES: usize = 8 * 1024;

/// Log fields longer than this (as JSON) are truncated.
pub const MAX_LOG_FIELDS_BYTES: usize = 16 * 1024;

/// Other text fields of a log event longer than this are truncated.
const MAX_LOG_LABEL_BYTES: usize = 256;

/// Records per `ListUsage` page unless asked otherwise, and at most.
const DEFAULT_PAGE_SIZE: u32 = 50;
const MAX_PAGE_SIZE: u32 = 500;

/// The summary's window unless asked otherwise.
const DEFAULT_SUMMARY_WINDOW_MS: i64 = 3_600_000;

/// Newest records of a summary's window its percentiles are computed over.
const SUMMARY_SAMPLE: u32 = 10_000;

/// Log events per `QueryLogs` unless asked otherwise, and at most.
const DEFAULT_LOG_LIMIT: u32 = 100;
const MAX_LOG_LIMIT: u32 = 1000;

/// How often old and excess log events are pruned.
const PRUNE_INTERVAL: Duration = Duration::from_secs(60);

/// How long a budget watcher waits for the cross-replica feed to go live.
const FEED_READY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a call's budget reservation holds without its usage record: a
/// runtime that died mid-call must not hold a budget forever; the runtime
/// reports every call it made, so a live call's record comes well before.
const RESERVATION_TTL: Duration = Duration::from_secs(600);

/// A call's estimated price, held against its tenant's and key's budgets
/// from its budget check until its usage record arrives.
struct Reservation {
    tenant_id: String,
    key_id: String,
    pico_usd: i64,
    /// Whether the auth service holds the call's estimated tokens too, which
    /// its usage record must settle there.
    tokens_held: bool,
    expires_at: std::time::Instant,
}

struct Inner {
    store: Arc<dyn ObservabilityStore>,
    settings: LedgerSettings,
    ledger: Arc<Ledger>,
    events: Arc<EventBus<ObservabilityEvent>>,
    /// Calls allowed by a budget check and not yet in the ledger, by call id.
    reservations: std::sync::Mutex<HashMap<String, Reservation>>,
    /// Budget checks that reserve run one at a time, so two calls cannot
    /// both take the room only one of them has.
    reserve_gate: tokio::sync::Mutex<()>,
    /// The auth service's token quotas, once connected.
    quotas: std::sync::OnceLock<Arc<AuthQuotas>>,
}

/// The observability service: the usage ledger, monthly spend budgets and
/// the tenants' recent log events.
#[derive(Clone)]
pub struct ObservabilityService {
    inner: Arc<Inner>,
}

impl ObservabilityService {
    /// Returns the service over `store`; nothing is written in the
    /// background until [`ObservabilityService::spawn_background`].
    pub fn new(store: Arc<dyn ObservabilityStore>, settings: LedgerSettings) -> Self {
        let events = Arc::new(EventBus::new("observability", store.event_transport()));
        let ledger = Arc::new(Ledger::new(Arc::clone(&store), Arc::clone(&events), &settings));
        Self {
            inner: Arc::new(Inner {
                store,
                settings,
                ledger,
                events,
                reservations: std::sync::Mutex::new(HashMap::new()),
                reserve_gate: tokio::sync::Mutex::new(()),
                quotas: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Connects the auth service's token quotas (once): every call new to
    /// the ledger counts against them, each budget check that names its
    /// estimated tokens reserves them there, and a budget's API key is
    /// looked up there. Without it, quotas are the auth service's business
    /// alone and budgets' keys are taken as given.
    pub fn count_quotas_with(&self, quotas: Arc<AuthQuotas>) {
        if self.inner.quotas.set(Arc::clone(&quotas)).is_err() {
            tracing::warn!("token quotas were connected twice; keeping the first");
            return;
        }
        self.inner.ledger.count_quotas_with(quotas);
    }

    /// Runs the ledger writer, the log pruner and the cross-replica feed
    /// (budget changes for watchers, other replicas' spends for the ledger)
    /// until `shutdown`. The task ends once everything buffered is written
    /// (retrying for a while if the database fails); from then on each
    /// `RecordUsage` is written before it is answered, so a report that
    /// arrives during the drain is not lost either.
    pub fn spawn_background(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let listener = Arc::clone(&self.inner.events).spawn_listener(shutdown.clone());
        let pruner = tokio::spawn(self.clone().prune_periodically(shutdown.clone()));
        let ledger = Arc::clone(&self.inner.ledger);
        let spends = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { ledger.follow_spends(shutdown).await }
        });
        let service = self.clone();
        tokio::spawn(async move {
            service.inner.ledger.run_writer(shutdown).await;
            for task in [pruner, spends, listener] {
                if let Err(err) = task.await {
                    tracing::error!(error = %err, "observability background task failed");
                }
            }
        })
    }

    /// Writes every usage record accepted before the call to the database.
    pub async fn flush(&self) -> Result<(), ObservabilityError> {
        self.inner.ledger.flush().await.map(|_| ())
    }

    /// Deletes log events older than the retention and each tenant's beyond
    /// its cap, as the background pruner does every minute; returns how many.
    pub async fn prune_logs(&self) -> Result<u64, ObservabilityError> {
        let settings = &self.inner.settings;
        let retention = i64::try_from(settings.log_retention.as_millis()).unwrap_or(i64::MAX);
        let before_ms = avm_common::now_ms().saturating_sub(retention);
        let keep = u64::try_from(settings.max_log_events_per_tenant).unwrap_or(u64::MAX);
        self.inner.store.prune_logs(before_ms, keep).await
    }

    async fn prune_periodically(self, shutdown: CancellationToken) {
        let mut ticks = tokio::time::interval(PRUNE_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticks.tick() => {}
            }
            self.settle_abandoned().await;
            match self.prune_logs().await {
                Ok(0) => {}
                Ok(deleted) => tracing::debug!(deleted, "log events pruned"),
                Err(err) => tracing::warn!(error = %err, "log events not pruned"),
            }
        }
    }

    /// Records LLM calls (components only) and returns how many were new.
    ///
    /// Every record is checked first; one invalid record refuses the whole
    /// request (`INVALID_USAGE_RECORD`, naming it and its field). The records
    /// are buffered and written by the background writer, idempotently on
    /// `call_id`: a retried report is never counted twice, whether it comes
    /// in the same request, before its first report was written or after.
    /// "New" means new to this replica's buffer: a retry of a call already
    /// written counts here but changes nothing stored. A full buffer refuses
    /// the request with RESOURCE_EXHAUSTED `USAGE_BACKLOG`.
    #[instrument(name = "observability.record_usage", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn record_usage(
        &self,
        ctx: &RequestContext,
        records: Vec<UsageRecord>,
    ) -> Result<u32, ObservabilityError> {
        ctx.principal.require_service()?;
        if records.len() > MAX_RECORDS_PER_REQUEST {
            return Err(ObservabilityError::invalid(
                "TOO_MANY_USAGE_RECORDS",
                format!("at most {MAX_RECORDS_PER_REQUEST} usage records may be reported at once"),
            ));
        }
        for (index, record) in records.iter().enumerate() {
            validate_record(index, record)?;
        }
        let accepted = self.accept_records(records).await?;
        if self.inner.ledger.writes_through() {
            self.inner.ledger.flush().await?;
        }
        Ok(u32::try_from(accepted).unwrap_or(u32::MAX))
    }

    /// Buffers records for the ledger and ends their calls' reservations.
    pub(crate) async fn accept_records(&self, records: Vec<UsageRecord>) -> Result<usize, ObservabilityError> {
        let calls: Vec<String> = records.iter().map(|record| record.call_id.clone()).collect();
        let held_tokens = self.holding_tokens(&records);
        let accepted = self.inner.ledger.accept(records)?;
        // The ledger's spend counts these calls now: their reservations end.
        self.settle(&calls);
        // Their token reservations end at the auth service, now rather than
        // after the ledger's next write, so the tenant's next check counts
        // their real tokens (the ledger's own report later changes nothing).
        if !held_tokens.is_empty()
            && let Some(quotas) = self.inner.quotas.get()
        {
            quotas.settle(&held_tokens).await;
        }
        Ok(accepted)
    }

    pub(crate) fn store(&self) -> &Arc<dyn ObservabilityStore> {
        &self.inner.store
    }

    /// Sums the ledger over the records `query` selects, grouped by
    /// `group_by` (in that order). Groups are ordered by their keys (bytewise)
    /// and `totals` is their sum; without dimensions there is one group with
    /// no keys (none when nothing matched). Reads the database only:
    /// records still buffered are not in it yet.
    #[instrument(name = "observability.query_usage", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn query_usage(
        &self,
        ctx: &RequestContext,
        query: &UsageQuery,
        group_by: &[Dimension],
    ) -> Result<UsageReport, ObservabilityError> {
        let mut seen = HashSet::new();
        if let Some(repeated) = group_by.iter().find(|dimension| !seen.insert(**dimension)) {
            return Err(ObservabilityError::invalid(
                "INVALID_GROUP_BY",
                format!("group_by names {repeated:?} twice"),
            ));
        }
        let Some(filter) = usage_filter(ctx, query)? else {
            return Ok(UsageReport::default());
        };
        let mut groups = self.inner.store.usage_groups(&filter, group_by).await?;
        groups.sort_by(|a, b| a.keys.cmp(&b.keys));
        let mut totals = UsageTotals::default();
        for group in &groups {
            totals.add(&group.totals);
        }
        Ok(UsageReport { groups, totals })
    }

    /// Lists the records `query` selects, newest first by start time (then
    /// call id), `page_size` at a time (default 50, at most 500).
    #[instrument(name = "observability.list_usage", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_usage(
        &self,
        ctx: &RequestContext,
        query: &UsageQuery,
        page_size: u32,
        page_token: &str,
    ) -> Result<UsagePage, ObservabilityError> {
        let after = match page_token {
            "" => None,
            token => Some(decode_page_token(token)?),
        };
        let Some(filter) = usage_filter(ctx, query)? else {
            return Ok(UsagePage::default());
        };
        let page_size = match page_size {
            0 => DEFAULT_PAGE_SIZE,
            size => size.min(MAX_PAGE_SIZE),
        };
        // One more than a page says whether another page follows.
        let mut records = self
            .inner
            .store
            .list_usage(&filter, after.as_ref(), page_size + 1)
            .await?;
        let next_page_token = if records.len() > page_size as usize {
            records.truncate(page_size as usize);
            records.last().map(encode_page_token)
        } else {
            None
        };
        Ok(UsagePage {
            records,
            next_page_token,
        })
    }

    /// Summarises the calls started in the window ending now (`window_ms`,
    /// default one hour): totals, counts by status, and nearest-rank
    /// percentiles of the time to first token (of the calls that had one) and
    /// of the duration, over the window's newest 10,000 calls.
    #[instrument(name = "observability.get_usage_summary", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn usage_summary(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        all_tenants: bool,
        window_ms: i64,
    ) -> Result<UsageSummary, ObservabilityError> {
        let window_ms = match window_ms {
            0 => DEFAULT_SUMMARY_WINDOW_MS,
            window if window < 0 => {
                return Err(ObservabilityError::invalid(
                    "INVALID_WINDOW",
                    "window_ms must not be negative",
                ));
            }
            window => window,
        };
        let to_ms = avm_common::now_ms();
        let from_ms = to_ms.saturating_sub(window_ms);
        let query = UsageQuery {
            tenant_id: tenant_id.to_owned(),
            all_tenants,
            ..UsageQuery::default()
        };
        let mut summary = UsageSummary {
            from_ms,
            to_ms,
            ..UsageSummary::default()
        };
        let Some(mut filter) = usage_filter(ctx, &query)? else {
            return Ok(summary);
        };
        filter.from_ms = Some(from_ms);
        // The end is exclusive in filters; the window includes now.
        filter.to_ms = Some(to_ms.saturating_add(1));
        let store = &self.inner.store;
        for group in store.usage_groups(&filter, &[Dimension::Status]).await? {
            summary.totals.add(&group.totals);
            match group.keys.first().map(String::as_str) {
                Some("completed") => summary.completed += group.totals.calls,
                Some("interrupted") => summary.interrupted += group.totals.calls,
                // A cut call failed: its runtime ended during it.
                Some("failed" | "cut") => summary.failed += group.totals.calls,
                other => return Err(ObservabilityError::corrupt(format!("call status {other:?}"))),
            }
        }
        let timings = store.call_timings(&filter, SUMMARY_SAMPLE).await?;
        summary.first_token = latency(
            timings
                .iter()
                .map(|timing| timing.first_token_ms)
                .filter(|ms| *ms > 0)
                .collect(),
        );
        summary.duration = latency(timings.iter().map(|timing: &CallTiming| timing.duration_ms).collect());
        Ok(summary)
    }

    /// Sets the monthly spend cap of a tenant (the caller's when `tenant_id`
    /// is empty) or, with `key_id`, of one of its API keys; a zero limit
    /// removes it (`None`). The tenant's admins may cap it and its keys;
    /// other tenants need an operator. Watchers of every replica hear it.
    #[instrument(name = "observability.set_budget", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn set_budget(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        key_id: &str,
        monthly_limit_pico_usd: i64,
    ) -> Result<Option<Budget>, ObservabilityError> {
        let tenant_id = target_tenant(ctx, tenant_id)?;
        ctx.principal.require_admin()?;
        validate_key_id(key_id)?;
        if !key_id.is_empty() {
            self.ensure_key_of(ctx, &tenant_id, key_id).await?;
        }
        if monthly_limit_pico_usd < 0 {
            return Err(ObservabilityError::invalid(
                "INVALID_BUDGET_LIMIT",
                "monthly_limit_pico_usd must not be negative (zero removes the budget)",
            ));
        }
        let now_ms = avm_common::now_ms();
        let change = BudgetChanged {
            tenant_id: tenant_id.clone(),
            key_id: key_id.to_owned(),
            monthly_limit_pico_usd,
            updated_at_ms: now_ms,
        };
        if monthly_limit_pico_usd == 0 {
            if self.inner.store.delete_budget(&tenant_id, key_id).await? {
                tracing::info!(budget_tenant = %tenant_id, key_id, "budget removed");
                self.inner.events.emit(ObservabilityEvent::Budget(change)).await;
            }
            return Ok(None);
        }
        let stored = StoredBudget {
            tenant_id: tenant_id.clone(),
            key_id: key_id.to_owned(),
            monthly_limit_pico_usd,
            updated_at_ms: now_ms,
        };
        self.inner.store.put_budget(&stored).await?;
        tracing::info!(budget_tenant = %tenant_id, key_id, monthly_limit_pico_usd, "budget set");
        self.inner.events.emit(ObservabilityEvent::Budget(change)).await;
        Ok(Some(self.budget(stored).await?))
    }

    /// Fails exactly as the auth service fails for a missing key unless
    /// `key_id` is a key of `tenant_id` that the caller sees: a budget for
    /// another tenant's key, or a missing one, is never stored (issue 26
    /// item 14). An operator sees every tenant's keys, so the tenant is
    /// compared too.
    async fn ensure_key_of(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        key_id: &str,
    ) -> Result<(), ObservabilityError> {
        let Some(quotas) = self.inner.quotas.get() else {
            return Ok(());
        };
        if quotas.key_tenant(ctx, key_id).await? == tenant_id {
            return Ok(());
        }
        // The auth service's own words for a missing key, so a foreign one looks the same.
        Err(ApiError::not_found("API_KEY_NOT_FOUND", format!("api key {key_id} not found")).into())
    }

    /// Lists a tenant's budgets (the caller's when `tenant_id` is empty;
    /// others for operators) with what each spent this month.
    #[instrument(name = "observability.list_budgets", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_budgets(&self, ctx: &RequestContext, tenant_id: &str) -> Result<Vec<Budget>, ObservabilityError> {
        let tenant_id = target_tenant(ctx, tenant_id)?;
        ctx.require(Scopes::READ)?;
        // A member sees their own figures: the budget of the key they call
        // with, not the tenant's spend nor other users' (issue 26 item 13).
        let own_key = match ctx.principal.role {
            Role::Member => Some(ctx.principal.key_id.as_deref().unwrap_or_default()),
            Role::Admin | Role::Service => None,
        };
        let mut budgets = Vec::new();
        for stored in self.inner.store.budgets(Some(&tenant_id)).await? {
            if own_key.is_some_and(|own| own.is_empty() || stored.key_id != own) {
                continue;
            }
            budgets.push(self.budget(stored).await?);
        }
        Ok(budgets)
    }

    /// Says whether a call of `tenant_id` (the caller's when empty) with
    /// `key_id` may go ahead (components only): not when the tenant's budget
    /// or the key's has spent its limit this month, counting the records
    /// reported but not yet written.
    #[instrument(name = "observability.check_budget", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn check_budget(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        key_id: &str,
    ) -> Result<BudgetCheck, ObservabilityError> {
        self.reserve_budget(ctx, tenant_id, key_id, "", CallEstimate::default())
            .await
    }

    /// As [`ObservabilityService::check_budget`], for the LLM call `call_id`
    /// about to be made (components only): a budget whose spend plus the
    /// reservations of calls in flight reaches its limit refuses; else the
    /// call's estimated price is reserved against its budgets until its
    /// usage record arrives (or [`RESERVATION_TTL`] passes). Checks are
    /// serialised, so the month's billing exceeds a limit by at most the
    /// last call allowed under it (and what calls bill beyond their
    /// estimates), whatever the concurrency. Reservations live in this
    /// process: each replica of the service keeps its own.
    ///
    /// With estimated tokens, the call's tokens are then reserved against
    /// its tenant's and key's monthly token quotas at the auth service, in
    /// its database, so the same bound holds for quotas across every replica
    /// of both services; a refusal there releases the budget's reservation.
    #[instrument(name = "observability.reserve_budget", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn reserve_budget(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        key_id: &str,
        call_id: &str,
        estimate: CallEstimate,
    ) -> Result<BudgetCheck, ObservabilityError> {
        ctx.principal.require_service()?;
        let estimated_pico_usd = estimate.pico_usd;
        if call_id.len() > MAX_CALL_ID_BYTES {
            return Err(ObservabilityError::invalid(
                "INVALID_BUDGET_CHECK",
                format!("call_id must be at most {MAX_CALL_ID_BYTES} bytes"),
            ));
        }
        if estimated_pico_usd < 0 {
            return Err(ObservabilityError::invalid(
                "INVALID_BUDGET_CHECK",
                "estimated_pico_usd must not be negative",
            ));
        }
        let tenant_id = match tenant_id {
            "" => ctx.tenant_id.as_str(),
            tenant_id => {
                validate_tenant_id(tenant_id)?;
                tenant_id
            }
        };
        validate_key_id(key_id)?;
        let gate = self.inner.reserve_gate.lock().await;
        let mut budgeted = false;
        // The tenant's own budget comes first (key '' sorts first).
        for stored in self.inner.store.budgets_for_call(tenant_id, key_id).await? {
            budgeted = true;
            let budget = self.budget(stored).await?;
            let reserved = self.reserved(&budget.tenant_id, &budget.key_id);
            if budget.exhausted || budget.spent_pico_usd.saturating_add(reserved) >= budget.monthly_limit_pico_usd {
                return Ok(BudgetCheck {
                    allowed: false,
                    exhausted: Some(budget),
                    quota_exceeded: None,
                });
            }
        }
        if budgeted && !call_id.is_empty() && estimated_pico_usd > 0 {
            self.reserve(call_id, tenant_id, key_id, estimated_pico_usd, false);
        }
        // The auth service serialises token reservations itself.
        drop(gate);
        let quotas = self.inner.quotas.get();
        if let Some(quotas) = quotas.filter(|_| !call_id.is_empty() && estimate.tokens > 0) {
            let refused = quotas.reserve(tenant_id, key_id, call_id, estimate.tokens).await;
            if !matches!(refused, Ok(None)) {
                self.settle(&[call_id.to_owned()]);
            }
            if let Some(quota) = refused? {
                return Ok(BudgetCheck {
                    allowed: false,
                    exhausted: None,
                    quota_exceeded: Some(quota),
                });
            }
            self.reserve(call_id, tenant_id, key_id, 0, true);
        }
        Ok(BudgetCheck {
            allowed: true,
            exhausted: None,
            quota_exceeded: None,
        })
    }

    /// Holds `pico_usd` for the call `call_id` (adding to what it holds),
    /// and marks it holding tokens at the auth service when `tokens_held`.
    fn reserve(&self, call_id: &str, tenant_id: &str, key_id: &str, pico_usd: i64, tokens_held: bool) {
        let now = std::time::Instant::now();
        let mut reservations = self.lock_reservations();
        // Expired ones go first, so a crashed runtime's calls never pile up.
        reservations.retain(|_, reservation| reservation.expires_at > now);
        let reservation = reservations.entry(call_id.to_owned()).or_insert_with(|| Reservation {
            tenant_id: tenant_id.to_owned(),
            key_id: key_id.to_owned(),
            pico_usd: 0,
            tokens_held: false,
            expires_at: now + RESERVATION_TTL,
        });
        reservation.pico_usd = reservation.pico_usd.saturating_add(pico_usd);
        reservation.tokens_held |= tokens_held;
    }

    /// Returns the records whose calls hold tokens at the auth service.
    fn holding_tokens(&self, records: &[UsageRecord]) -> Vec<UsageRecord> {
        let reservations = self.lock_reservations();
        records
            .iter()
            .filter(|record| {
                reservations
                    .get(&record.call_id)
                    .is_some_and(|reservation| reservation.tokens_held)
            })
            .cloned()
            .collect()
    }

    /// Streams every budget (one `snapshot` message), then each change made
    /// on any replica (components only). Spent amounts are as of each message.
    #[instrument(name = "observability.watch_budgets", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn watch_budgets(&self, ctx: &RequestContext) -> Result<BudgetWatch, ObservabilityError> {
        ctx.principal.require_service()?;
        let events = &self.inner.events;
        events.wait_live(FEED_READY_TIMEOUT).await?;
        // Subscribe before reading the snapshot, so no change falls in
        // between; a change in both comes again after it, which is harmless:
        // every change carries the budget's whole state.
        let live = events.subscribe();
        let mut budgets = Vec::new();
        for stored in self.inner.store.budgets(None).await? {
            budgets.push(self.budget(stored).await?);
        }
        let first = BudgetUpdate {
            budgets,
            snapshot: true,
            removed: false,
        };
        let service = self.clone();
        // Other replicas' spends are the ledger's business, not watchers'.
        let budget_changes = live.filter_map(|event| {
            future::ready(match event {
                Ok(ObservabilityEvent::Budget(change)) => Some(Ok(change)),
                Ok(ObservabilityEvent::Spent(_)) => None,
                Err(err) => Some(Err(err)),
            })
        });
        let changes = budget_changes.then(move |event| {
            let service = service.clone();
            async move {
                let change = event?;
                if change.monthly_limit_pico_usd == 0 {
                    return Ok(BudgetUpdate {
                        budgets: vec![Budget {
                            tenant_id: change.tenant_id,
                            key_id: change.key_id,
                            monthly_limit_pico_usd: 0,
                            spent_pico_usd: 0,
                            exhausted: false,
                            updated_at_ms: change.updated_at_ms,
                        }],
                        snapshot: false,
                        removed: true,
                    });
                }
                let budget = service
                    .budget(StoredBudget {
                        tenant_id: change.tenant_id,
                        key_id: change.key_id,
                        monthly_limit_pico_usd: change.monthly_limit_pico_usd,
                        updated_at_ms: change.updated_at_ms,
                    })
                    .await?;
                Ok(BudgetUpdate {
                    budgets: vec![budget],
                    snapshot: false,
                    removed: false,
                })
            }
        });
        Ok(futures::stream::once(future::ready(Ok(first))).chain(changes).boxed())
    }

    /// Returns a stored budget with what it spent this calendar month (UTC).
    fn lock_reservations(&self) -> std::sync::MutexGuard<'_, HashMap<String, Reservation>> {
        self.inner
            .reservations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// What the calls in flight under a budget (`key_id` empty: the
    /// tenant's, any key) reserved; expired reservations go first.
    fn reserved(&self, tenant_id: &str, key_id: &str) -> i64 {
        let mut reservations = self.lock_reservations();
        let now = std::time::Instant::now();
        reservations.retain(|_, reservation| reservation.expires_at > now);
        reservations
            .values()
            .filter(|reservation| {
                reservation.tenant_id == tenant_id && (key_id.is_empty() || reservation.key_id == key_id)
            })
            .fold(0_i64, |sum, reservation| sum.saturating_add(reservation.pico_usd))
    }

    /// Ends the reservations of calls the ledger now counts.
    fn settle(&self, call_ids: &[String]) {
        let mut reservations = self.lock_reservations();
        if reservations.is_empty() {
            return;
        }
        for call_id in call_ids {
            reservations.remove(call_id);
        }
    }

    async fn budget(&self, stored: StoredBudget) -> Result<Budget, ObservabilityError> {
        let key = SpendKey {
            tenant_id: stored.tenant_id.clone(),
            key_id: (!stored.key_id.is_empty()).then(|| stored.key_id.clone()),
            month: month_of(avm_common::now_ms()),
        };
        let spent = self.inner.ledger.spent(&key).await?;
        Ok(Budget {
            exhausted: spent >= stored.monthly_limit_pico_usd,
            spent_pico_usd: spent,
            tenant_id: stored.tenant_id,
            key_id: stored.key_id,
            monthly_limit_pico_usd: stored.monthly_limit_pico_usd,
            updated_at_ms: stored.updated_at_ms,
        })
    }

    /// Stores log events that name a tenant (components only), in one
    /// transaction, before answering: logs arrive already batched by the
    /// components' forwarders. Over-long text is truncated, never refused;
    /// an event without a tenant or a level refuses the request
    /// (`INVALID_LOG_EVENT`). An event without a time is stamped now.
    #[instrument(name = "observability.record_logs", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn record_logs(&self, ctx: &RequestContext, mut events: Vec<LogEvent>) -> Result<(), ObservabilityError> {
        ctx.principal.require_service()?;
        if events.len() > MAX_LOG_EVENTS_PER_REQUEST {
            return Err(ObservabilityError::invalid(
                "TOO_MANY_LOG_EVENTS",
                format!("at most {MAX_LOG_EVENTS_PER_REQUEST} log events may be recorded at once"),
            ));
        }
        let now_ms = avm_common::now_ms();
        for (index, event) in events.iter_mut().enumerate() {
            if event.tenant_id.is_empty() || event.tenant_id.len() > MAX_ID_BYTES {
                return Err(ObservabilityError::invalid(
                    "INVALID_LOG_EVENT",
                    format!("events[{index}].tenant_id must be 1 to {MAX_ID_BYTES} bytes"),
                ));
            }
            if event.at_ms <= 0 {
                event.at_ms = now_ms;
            }
            truncate(&mut event.message, MAX_LOG_MESSAGE_BYTES);
            truncate_fields(&mut event.fields_json);
            for label in [
                &mut event.component,
                &mut event.target,
                &mut event.request_id,
                &mut event.trace_id,
            ] {
                truncate(label, MAX_LOG_LABEL_BYTES);
            }
        }
        self.inner.store.insert_logs(&events).await
    }

    /// Returns a tenant's log events (the caller's when `tenant_id` is empty;
    /// others for operators), newest first: admins, operators and components
    /// only.
    #[instrument(name = "observability.query_logs", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn query_logs(
        &self,
        ctx: &RequestContext,
        query: &LogQuery,
    ) -> Result<Vec<LogEvent>, ObservabilityError> {
        let tenant_id = target_tenant(ctx, &query.tenant_id)?;
        ctx.principal.require_admin()?;
        let (from_ms, to_ms) = time_range(query.from_ms, query.to_ms)?;
        let limit = match query.limit {
            0 => DEFAULT_LOG_LIMIT,
            limit => limit.min(MAX_LOG_LIMIT),
        };
        let filter = LogFilter {
            tenant_id,
            min_level: query.min_level.unwrap_or(Level::Info),
            from_ms,
            to_ms,
            limit,
        };
        self.inner.store.query_logs(&filter).await
    }
}

/// Returns what a usage query may read, `None` when the answer is empty
/// whatever is stored (a member naming another user).
fn usage_filter(ctx: &RequestContext, query: &UsageQuery) -> Result<Option<UsageFilter>, ObservabilityError> {
    let tenant_id = if query.all_tenants {
        require_operator(ctx)?;
        None
    } else {
        Some(target_tenant(ctx, &query.tenant_id)?)
    };
    ctx.require(Scopes::READ)?;
    let (from_ms, to_ms) = time_range(query.from_ms, query.to_ms)?;
    let mut user_id = non_empty(&query.user_id);
    if ctx.principal.role == Role::Member {
        let own = &ctx.principal.user_id;
        if user_id.as_ref().is_some_and(|asked| asked != own) {
            return Ok(None);
        }
        user_id = Some(own.clone());
    }
    Ok(Some(UsageFilter {
        tenant_id,
        from_ms,
        to_ms,
        key_id: non_empty(&query.key_id),
        model: non_empty(&query.model),
        user_id,
    }))
}

/// Returns a time range's bounds; zero means unbounded.
fn time_range(from_ms: i64, to_ms: i64) -> Result<(Option<i64>, Option<i64>), ObservabilityError> {
    if from_ms < 0 || to_ms < 0 {
        return Err(ObservabilityError::invalid(
            "INVALID_TIME_RANGE",
            "from_ms and to_ms must not be negative",
        ));
    }
    if to_ms > 0 && from_ms > to_ms {
        return Err(ObservabilityError::invalid(
            "INVALID_TIME_RANGE",
            "from_ms must not be after to_ms",
        ));
    }
    Ok(((from_ms > 0).then_some(from_ms), (to_ms > 0).then_some(to_ms)))
}

fn non_empty(text: &str) -> Option<String> {
    (!text.is_empty()).then(|| text.to_owned())
}

/// Returns the tenant a call is about: the caller's when `tenant_id` is
/// empty or its own; another only for operators and components.
fn target_tenant(ctx: &RequestContext, tenant_id: &str) -> Result<String, ObservabilityError> {
    if tenant_id.is_empty() || tenant_id == ctx.tenant_id {
        return Ok(ctx.tenant_id.clone());
    }
    require_operator(ctx)?;
    validate_tenant_id(tenant_id)?;
    Ok(tenant_id.to_owned())
}

/// Fails with PERMISSION_DENIED `OPERATOR_REQUIRED` unless the caller is an
/// operator or a component (then with `MISSING_SCOPE` unless its credential
/// holds the admin scope). Checked before the scope so members, who hold no
/// admin scope, get the same answer as admins of another tenant.
fn require_operator(ctx: &RequestContext) -> Result<(), ObservabilityError> {
    let principal = &ctx.principal;
    if !principal.operator && principal.role != Role::Service {
        return Err(ApiError::new(
            Code::PermissionDenied,
            "OPERATOR_REQUIRED",
            "only an operator may see other tenants",
        )
        .into());
    }
    principal.require_operator()?;
    Ok(())
}

fn validate_tenant_id(tenant_id: &str) -> Result<(), ObservabilityError> {
    if tenant_id.is_empty() || tenant_id.len() > MAX_ID_BYTES || !tenant_id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ObservabilityError::invalid("INVALID_TENANT_ID", "invalid tenant id"));
    }
    Ok(())
}

fn validate_key_id(key_id: &str) -> Result<(), ObservabilityError> {
    if key_id.len() > MAX_ID_BYTES || !key_id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ObservabilityError::invalid("INVALID_KEY_ID", "invalid API key id"));
    }
    Ok(())
}

/// Checks one reported record; the error names it and its field.
pub(crate) fn validate_record(index: usize, record: &UsageRecord) -> Result<(), ObservabilityError> {
    let invalid = |field: &str, why: &str| {
        Err(ObservabilityError::invalid(
            "INVALID_USAGE_RECORD",
            format!("records[{index}].{field} {why}"),
        ))
    };
    let required = [
        ("call_id", &record.call_id, MAX_CALL_ID_BYTES),
        ("tenant_id", &record.tenant_id, MAX_ID_BYTES),
        ("model", &record.model, MAX_FIELD_BYTES),
    ];
    for (field, value, max) in required {
        if value.is_empty() {
            return invalid(field, "must not be empty");
        }
        if value.len() > max {
            return invalid(field, &format!("must be at most {max} bytes"));
        }
    }
    let optional = [
        ("user_id", &record.user_id, MAX_FIELD_BYTES),
        ("key_id", &record.key_id, MAX_ID_BYTES),
        ("container_id", &record.container_id, MAX_FIELD_BYTES),
        ("image_id", &record.image_id, MAX_FIELD_BYTES),
        ("agent_id", &record.agent_id, MAX_FIELD_BYTES),
        ("provider", &record.provider, MAX_FIELD_BYTES),
        ("error_code", &record.error_code, MAX_FIELD_BYTES),
    ];
    for (field, value, max) in optional {
        if value.len() > max {
            return invalid(field, &format!("must be at most {max} bytes"));
        }
    }
    let counts = [
        ("input_tokens", record.input_tokens),
        ("output_tokens", record.output_tokens),
        ("cache_read_tokens", record.cache_read_tokens),
        ("cache_write_tokens", record.cache_write_tokens),
    ];
    for (field, count) in counts {
        if i64::try_from(count).is_err() {
            return invalid(field, "is out of range");
        }
    }
    let amounts = [
        ("cost_pico_usd", record.cost_pico_usd),
        ("billed_pico_usd", record.billed_pico_usd),
        ("first_token_ms", record.first_token_ms),
    ];
    for (field, amount) in amounts {
        if amount < 0 {
            return invalid(field, "must not be negative");
        }
    }
    if record.ended_at_ms < record.started_at_ms {
        return invalid("ended_at_ms", "must not be before started_at_ms");
    }
    Ok(())
}

/// Returns nearest-rank percentiles of `values` (zeros when empty).
fn latency(mut values: Vec<i64>) -> Latency {
    values.sort_unstable();
    let Some(&max_ms) = values.last() else {
        return Latency::default();
    };
    let rank = |percent: usize| {
        // The smallest value with at least `percent`% of the values at or below it.
        let rank = (percent * values.len()).div_ceil(100).max(1);
        values[rank - 1]
    };
    Latency {
        p50_ms: rank(50),
        p90_ms: rank(90),
        p99_ms: rank(99),
        max_ms,
    }
}

/// Returns the token of the page after `last`: its order key, base64url.
fn encode_page_token(last: &UsageRecord) -> String {
    URL_SAFE_NO_PAD.encode(format!("{}/{}", last.started_at_ms, last.call_id))
}

/// Reads a page token; the start time holds no `/`, so it splits cleanly.
fn decode_page_token(token: &str) -> Result<PageKey, ObservabilityError> {
    let invalid = || ObservabilityError::invalid("INVALID_PAGE_TOKEN", "the page token is not one this service made");
    let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let (started, call_id) = text.split_once('/').ok_or_else(invalid)?;
    let started_at_ms: i64 = started.parse().map_err(|_| invalid())?;
    if call_id.is_empty() || call_id.len() > MAX_CALL_ID_BYTES {
        return Err(invalid());
    }
    Ok(PageKey {
        started_at_ms,
        call_id: call_id.to_owned(),
    })
}

/// Cuts `text` to at most `max` bytes, at a character boundary.
fn truncate(text: &mut String, max: usize) {
    if text.len() <= max {
        return;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
}

/// Keeps over-long fields readable: they become `{"truncated": "<the
/// start of the JSON>"}`, still a JSON object of strings, within the limit.
fn truncate_fields(fields_json: &mut String) {
    if fields_json.len() <= MAX_LOG_FIELDS_BYTES {
        return;
    }
    let mut keep = MAX_LOG_FIELDS_BYTES;
    loop {
        let mut start = fields_json.clone();
        truncate(&mut start, keep);
        let wrapped = serde_json::json!({ "truncated": start }).to_string();
        if wrapped.len() <= MAX_LOG_FIELDS_BYTES || keep == 0 {
            *fields_json = wrapped;
            return;
        }
        // Escaping grew it: cut the excess (and a little more) and try again.
        keep = keep.saturating_sub(wrapped.len() - MAX_LOG_FIELDS_BYTES + 16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<i64> = (1..=100).rev().collect();
        assert_eq!(
            latency(values),
            Latency {
                p50_ms: 50,
                p90_ms: 90,
                p99_ms: 99,
                max_ms: 100
            }
        );
        let one = latency(vec![7]);
        assert_eq!((one.p50_ms, one.p99_ms, one.max_ms), (7, 7, 7));
        let ten = latency((1..=10).collect());
        assert_eq!((ten.p50_ms, ten.p90_ms, ten.p99_ms), (5, 9, 10));
        assert_eq!(latency(Vec::new()), Latency::default());
    }

    #[test]
    fn page_tokens_round_trip_and_reject_forgeries() {
        let record = UsageRecord {
            call_id: "call/with/slashes".into(),
            tenant_id: "t".into(),
            user_id: String::new(),
            key_id: String::new(),
            container_id: String::new(),
            image_id: String::new(),
            agent_id: String::new(),
            provider: String::new(),
            model: "m".into(),
            input_tokens: 0,
            output_tokens: 0,
            cache_read_tokens: 0,
            cache_write_tokens: 0,
            estimated: false,
            status: crate::record::CallStatus::Completed,
            error_code: String::new(),
            started_at_ms: 1_700_000_000_000,
            ended_at_ms: 1_700_000_000_000,
            first_token_ms: 0,
            cost_pico_usd: 0,
            billed_pico_usd: 0,
            priced: true,
            own_key: false,
        };
        let key = decode_page_token(&encode_page_token(&record)).unwrap();
        assert_eq!(
            (key.started_at_ms, key.call_id.as_str()),
            (1_700_000_000_000, "call/with/slashes")
        );
        for forged in [
            "!!",
            "bm90IGEga2V5",
            &URL_SAFE_NO_PAD.encode("x/call"),
            &URL_SAFE_NO_PAD.encode("5/"),
        ] {
            assert!(matches!(
                decode_page_token(forged),
                Err(ObservabilityError::Invalid {
                    reason: "INVALID_PAGE_TOKEN",
                    ..
                })
            ));
        }
    }

    #[test]
    fn long_log_text_is_truncated_not_refused() {
        let mut message = "é".repeat(MAX_LOG_MESSAGE_BYTES);
        truncate(&mut message, MAX_LOG_MESSAGE_BYTES);
        assert!(message.len() <= MAX_LOG_MESSAGE_BYTES && message.len() >= MAX_LOG_MESSAGE_BYTES - 1);
        let mut fields = serde_json::json!({ "quote": "\"\n".repeat(MAX_LOG_FIELDS_BYTES) }).to_string();
        truncate_fields(&mut fields);
        assert!(fields.len() <= MAX_LOG_FIELDS_BYTES, "{}", fields.len());
        let parsed: serde_json::Value = serde_json::from_str(&fields).unwrap();
        assert!(parsed["truncated"].as_str().unwrap().starts_with("{\"quote\""));
        let mut small = "{\"a\":\"b\"}".to_owned();
        truncate_fields(&mut small);
        assert_eq!(small, "{\"a\":\"b\"}");
    }
}
