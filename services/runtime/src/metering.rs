//! Usage metering: every LLM call becomes one ledger record — its tokens as
//! the provider counted them (or an estimate, flagged, when the stream was
//! cut first), its provider cost from the configured price table, and the
//! billed amount with the markup — sent to the observability service off the
//! token path; and the budget check before each call. Each call is noted
//! open as it is made (`open_calls`), so a crash cannot lose its bill.
//!
//! Records go through a bounded queue that a background task sends in
//! batches, retrying (the ledger is idempotent on the call id) until it gets
//! through; a clean shutdown flushes it. Tenants with a budget are the
//! exception: their records are sent before the turn ends, so the check
//! before their next call already counts them.

use avm_common::backoff::Backoff;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use avm_common::auth::{Principal, ServiceIdentity};
use avm_common::{ApiError, Code, RequestContext};
use futures::StreamExt;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use crate::config::{BillingConfig, ProviderKind};
use crate::error::RuntimeError;
use crate::peers::{BudgetAnswer, Estimate, UsageRecord, Usages};

mod open_calls;

/// Records waiting to be sent; beyond it a turn waits for room before it
/// ends (the observability service has been unreachable for a long while).
const QUEUE_CAPACITY: usize = 10_000;

/// Most records in one report.
const BATCH: usize = 200;

/// How long records wait for company before they are sent.
const BATCH_DELAY: Duration = Duration::from_millis(100);

/// How long a budget check waits for its tenant's queued records.
const BUDGET_FLUSH: Duration = Duration::from_secs(2);

/// What one call cost and what the tenant pays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Charge {
    pub cost_pico_usd: i64,
    pub billed_pico_usd: i64,
    /// Whether the model had a price.
    pub priced: bool,
}

/// The tokens of one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
    pub cache_read: u64,
    pub cache_write: u64,
}

/// Returns what a call of `model` with `tokens` cost at the configured
/// prices, and what the tenant pays: the cost times the markup, or nothing
/// when the call used the tenant's own provider key.
///
/// OpenAI counts cached prompt tokens inside its input count, Anthropic
/// apart from it; both are priced once, at the cache-read price.
pub fn charge(billing: &BillingConfig, provider: ProviderKind, model: &str, tokens: Tokens, own_key: bool) -> Charge {
    if provider == ProviderKind::Offline {
        return Charge {
            priced: true,
            ..Charge::default()
        };
    }
    let Some(price) = billing.price_of(model) else {
        return Charge::default();
    };
    // USD per million tokens is pico-dollars per token times a million.
    let per_token = |usd_per_mtok: f64| (usd_per_mtok * avm_common::money::PICO_PER_USD as f64 / 1e6).round() as i128;
    let uncached_input = match provider {
        ProviderKind::Openai => tokens.input.saturating_sub(tokens.cache_read),
        _ => tokens.input,
    };
    let cost = i128::from(uncached_input) * per_token(price.input)
        + i128::from(tokens.output) * per_token(price.output)
        + i128::from(tokens.cache_read) * per_token(price.cache_read)
        + i128::from(tokens.cache_write) * per_token(price.cache_write);
    let markup_ppm = (billing.markup * 1e6).round() as i128;
    let billed = if own_key {
        0
    } else {
        (cost * markup_ppm + 500_000) / 1_000_000
    };
    Charge {
        cost_pico_usd: i64::try_from(cost).unwrap_or(i64::MAX),
        billed_pico_usd: i64::try_from(billed).unwrap_or(i64::MAX),
        priced: true,
    }
}

/// Returns whether the caller's tenant or API key has a monthly token
/// quota, as its token says (limits ride in every access token).
fn has_token_quota(principal: &Principal) -> bool {
    principal.tenant_limits.tokens_per_month > 0 || principal.key_limits.tokens_per_month > 0
}

/// Returns a rough token count of text `text_bytes` long in UTF-8 (a
/// quarter of its bytes, rounded up), for calls the provider never counted.
pub fn estimate_tokens(text_bytes: usize) -> u64 {
    u64::try_from(text_bytes.div_ceil(4)).unwrap_or(u64::MAX)
}

struct Inner {
    usages: Usages,
    identity: ServiceIdentity,
    queue: mpsc::Sender<UsageRecord>,
    receiver: Mutex<Option<mpsc::Receiver<UsageRecord>>>,
    /// Records accepted and not yet confirmed by the observability service.
    pending: AtomicUsize,
    /// The same, by tenant: a budget check waits for its tenant's.
    pending_by_tenant: Mutex<std::collections::HashMap<String, usize>>,
    sent: Notify,
    /// (tenant, key or "") pairs with a budget, from `WatchBudgets`.
    capped: RwLock<HashSet<(String, String)>>,
    /// Whether `capped` holds a snapshot; until then every call is checked.
    budgets_known: AtomicBool,
    /// When this process began metering: calls opened before were another's.
    started_at_ms: i64,
}

/// The runtime's usage reporter and budget guard; cheap to clone.
#[derive(Clone)]
pub struct Metering {
    inner: Arc<Inner>,
}

impl Metering {
    /// Returns a reporter to the observability service.
    pub fn new(usages: Usages, identity: ServiceIdentity) -> Self {
        let (queue, receiver) = mpsc::channel(QUEUE_CAPACITY);
        Self {
            inner: Arc::new(Inner {
                usages,
                identity,
                queue,
                receiver: Mutex::new(Some(receiver)),
                pending: AtomicUsize::new(0),
                pending_by_tenant: Mutex::new(std::collections::HashMap::new()),
                sent: Notify::new(),
                capped: RwLock::new(HashSet::new()),
                budgets_known: AtomicBool::new(false),
                started_at_ms: avm_common::now_ms(),
            }),
        }
    }

    fn capped(&self, tenant_id: &str, key_id: &str) -> bool {
        let capped = self.inner.capped.read().unwrap_or_else(|poison| poison.into_inner());
        capped.contains(&(tenant_id.to_owned(), String::new()))
            || (!key_id.is_empty() && capped.contains(&(tenant_id.to_owned(), key_id.to_owned())))
    }

    /// Fails with BUDGET_EXCEEDED when the caller's tenant or key spent its
    /// monthly budget, and with QUOTA_EXCEEDED when it used its monthly
    /// token quota, counting the calls in flight; else the call `call_id`
    /// reserves its estimate against them until its record arrives. Tenants
    /// with neither are not asked about.
    pub async fn check_budget(
        &self,
        ctx: &RequestContext,
        call_id: &str,
        estimate: Estimate,
    ) -> Result<(), RuntimeError> {
        let key_id = ctx.principal.key_id.as_deref().unwrap_or_default();
        let known = self.inner.budgets_known.load(Ordering::Acquire);
        let quota = has_token_quota(&ctx.principal);
        if known && !quota && !self.capped(&ctx.tenant_id, key_id) {
            return Ok(());
        }
        let estimate = Estimate {
            tokens: if quota { estimate.tokens } else { 0 },
            ..estimate
        };
        // What this tenant spent must be counted first: its queued records go out.
        self.wait_sent(&ctx.tenant_id, BUDGET_FLUSH).await;
        let answer = async {
            let own = self.inner.identity.context_for(ctx).await?;
            self.inner
                .usages
                .check_budget(&own, &ctx.tenant_id, key_id, call_id, estimate)
                .await
        }
        .await;
        match answer {
            Ok(BudgetAnswer::Allowed) => Ok(()),
            Ok(BudgetAnswer::Exhausted {
                key_id,
                monthly_limit_pico_usd,
                spent,
            }) => {
                let whose = if key_id.is_empty() {
                    "the tenant's"
                } else {
                    "this API key's"
                };
                let limit = avm_common::money::format_usd(monthly_limit_pico_usd);
                let message = if spent {
                    format!("{whose} monthly budget of {limit} USD is spent; no further LLM call is made this month")
                } else {
                    format!(
                        "{whose} monthly budget of {limit} USD is taken by the LLM calls in flight; try again when they end"
                    )
                };
                Err(ApiError::new(Code::ResourceExhausted, "BUDGET_EXCEEDED", message).into())
            }
            Ok(BudgetAnswer::QuotaExceeded { key_id, used_up }) => {
                let whose = if key_id.is_empty() {
                    "the tenant's"
                } else {
                    "this API key's"
                };
                let message = if used_up {
                    format!("{whose} monthly token quota is used up; ask an operator to raise it")
                } else {
                    format!("{whose} monthly token quota is taken by the LLM calls in flight; try again when they end")
                };
                // The gateway's reason for a used-up quota, so clients handle both alike.
                Err(ApiError::new(Code::ResourceExhausted, "QUOTA_EXCEEDED", message).into())
            }
            // Unknown budgets while the service is away: let the call go,
            // rather than stop every tenant for the sake of a few.
            Err(err) if !known => {
                tracing::warn!(error = %err, "cannot check budgets; allowing the call");
                Ok(())
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot check a budget; refusing the call");
                Err(ApiError::unavailable(
                    "BUDGET_UNAVAILABLE",
                    "the budget or token quota of this tenant cannot be checked right now; try again shortly",
                )
                .into())
            }
        }
    }

    /// Reports one call made for `ctx`: at once when its tenant or key has
    /// a budget or a token quota (so the next check counts it), else through
    /// the batching queue.
    pub async fn record(&self, ctx: &RequestContext, record: UsageRecord) {
        let checked = has_token_quota(&ctx.principal) || self.capped(&record.tenant_id, &record.key_id);
        if checked && self.send(std::slice::from_ref(&record)).await.is_ok() {
            return;
        }
        let depth = self.inner.pending.fetch_add(1, Ordering::SeqCst) + 1;
        metrics::gauge!("avm_runtime_usage_queue_depth").set(depth as f64);
        self.count_pending(&record.tenant_id, 1, true);
        let unsent = match self.inner.queue.try_send(record) {
            Ok(()) => return,
            // A billing record is never dropped for want of room: the turn
            // waits until the reporter catches up.
            Err(mpsc::error::TrySendError::Full(record)) => {
                tracing::warn!(
                    capacity = QUEUE_CAPACITY,
                    "usage queue full (is the observability service reachable?); the turn waits for room"
                );
                match self.inner.queue.send(record).await {
                    Ok(()) => return,
                    Err(closed) => closed.0,
                }
            }
            Err(mpsc::error::TrySendError::Closed(record)) => record,
        };
        self.inner.pending.fetch_sub(1, Ordering::SeqCst);
        self.count_pending(&unsent.tenant_id, 1, false);
        tracing::error!(
            call_id = %unsent.call_id,
            tenant_id = %unsent.tenant_id,
            input_tokens = unsent.input_tokens,
            output_tokens = unsent.output_tokens,
            "usage reporter stopped; record not sent"
        );
    }

    /// Adds to (or takes from) a tenant's count of queued records.
    fn count_pending(&self, tenant_id: &str, count: usize, add: bool) {
        let mut by_tenant = self
            .inner
            .pending_by_tenant
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let entry = by_tenant.entry(tenant_id.to_owned()).or_default();
        *entry = if add {
            *entry + count
        } else {
            entry.saturating_sub(count)
        };
        if *entry == 0 {
            by_tenant.remove(tenant_id);
        }
    }

    /// Waits until none of `tenant_id`'s records is queued, for at most `limit`.
    async fn wait_sent(&self, tenant_id: &str, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let sent = self.inner.sent.notified();
            let queued = self
                .inner
                .pending_by_tenant
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .contains_key(tenant_id);
            if !queued || tokio::time::timeout_at(deadline, sent).await.is_err() {
                return;
            }
        }
    }

    async fn send(&self, records: &[UsageRecord]) -> Result<(), RuntimeError> {
        let ctx = self.inner.identity.own_context().await?;
        self.inner.usages.record(&ctx, records).await
    }

    /// Waits until every queued record was sent, for at most `limit`.
    pub async fn flush(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let sent = self.inner.sent.notified();
            if self.inner.pending.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, sent).await.is_err() {
                let left = self.inner.pending.load(Ordering::SeqCst);
                tracing::error!(records = left, "usage records not sent before shutdown");
                return false;
            }
        }
    }

    /// Sends queued records and follows the budgets until `shutdown`.
    pub fn spawn(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let receiver = self
            .inner
            .receiver
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .take();
        let budgets = tokio::spawn(self.clone().follow_budgets(shutdown.clone()));
        let metering = self.clone();
        tokio::spawn(async move {
            if let Some(receiver) = receiver {
                metering.send_queued(receiver, shutdown).await;
            }
            budgets.abort();
        })
    }

    async fn send_queued(&self, mut receiver: mpsc::Receiver<UsageRecord>, shutdown: CancellationToken) {
        let mut batch: Vec<UsageRecord> = Vec::new();
        let mut backoff = Backoff::default();
        loop {
            if batch.is_empty() {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    record = receiver.recv() => match record {
                        Some(record) => batch.push(record),
                        None => return,
                    },
                }
                // Let a few more arrive, then send them together.
                let deadline = tokio::time::Instant::now() + BATCH_DELAY;
                while batch.len() < BATCH {
                    match tokio::time::timeout_at(deadline, receiver.recv()).await {
                        Ok(Some(record)) => batch.push(record),
                        _ => break,
                    }
                }
            }
            match self.send(&batch).await {
                Ok(()) => {
                    let left = self.inner.pending.fetch_sub(batch.len(), Ordering::SeqCst) - batch.len();
                    metrics::gauge!("avm_runtime_usage_queue_depth").set(left as f64);
                    for record in &batch {
                        self.count_pending(&record.tenant_id, 1, false);
                    }
                    self.inner.sent.notify_waiters();
                    batch.clear();
                    backoff.reset();
                }
                Err(err) => {
                    tracing::warn!(records = batch.len(), error = %err, "usage report failed; retrying");
                    if !backoff.wait(&shutdown).await {
                        return;
                    }
                }
            }
        }
    }

    /// Keeps the set of capped tenants and keys, reconnecting with backoff.
    async fn follow_budgets(self, shutdown: CancellationToken) {
        let mut backoff = Backoff::default();
        loop {
            let result = tokio::select! {
                () = shutdown.cancelled() => return,
                result = self.watch_budgets() => result,
            };
            self.inner.budgets_known.store(false, Ordering::Release);
            if let Err(err) = result {
                tracing::warn!(error = %err, "budget watch ended; reconnecting");
            }
            if !backoff.wait(&shutdown).await {
                return;
            }
        }
    }

    async fn watch_budgets(&self) -> Result<(), RuntimeError> {
        let ctx = self.inner.identity.own_context().await?;
        let mut stream = self.inner.usages.watch_budgets(&ctx).await?;
        while let Some(update) = stream.next().await.transpose()? {
            let mut capped = self.inner.capped.write().unwrap_or_else(|poison| poison.into_inner());
            if update.snapshot {
                capped.clear();
            }
            for pair in update.budgets {
                if update.removed {
                    capped.remove(&pair);
                } else {
                    capped.insert(pair);
                }
            }
            drop(capped);
            self.inner.budgets_known.store(true, Ordering::Release);
        }
        Err(ApiError::unavailable("BUDGET_WATCH_ENDED", "the observability service ended the watch").into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn billing() -> BillingConfig {
        BillingConfig {
            markup: 1.05,
            ..BillingConfig::default()
        }
    }

    #[test]
    fn calls_cost_their_tokens_at_list_price_plus_markup() {
        let tokens = Tokens {
            input: 1000,
            output: 500,
            cache_read: 0,
            cache_write: 0,
        };
        // claude-sonnet-4: $3 in, $15 out per million tokens.
        let charge = charge(
            &billing(),
            ProviderKind::Anthropic,
            "claude-sonnet-4-20250514",
            tokens,
            false,
        );
        let cost = 1000 * 3_000_000 + 500 * 15_000_000;
        assert_eq!(charge.cost_pico_usd, cost);
        assert_eq!(charge.billed_pico_usd, cost * 105 / 100);
        assert!(charge.priced);
        let own = super::charge(&billing(), ProviderKind::Anthropic, "claude-sonnet-4", tokens, true);
        assert_eq!(
            (own.cost_pico_usd, own.billed_pico_usd),
            (cost, 0),
            "own keys are not billed"
        );
        let unknown = super::charge(&billing(), ProviderKind::Anthropic, "mystery", tokens, false);
        assert_eq!(unknown, Charge::default());
        let offline = super::charge(&billing(), ProviderKind::Offline, "claude-sonnet-4", tokens, false);
        assert_eq!((offline.cost_pico_usd, offline.priced), (0, true));
    }

    #[test]
    fn cached_tokens_are_priced_once() {
        let tokens = Tokens {
            input: 1000,
            output: 0,
            cache_read: 400,
            cache_write: 0,
        };
        // gpt-4o-mini: $0.15 in, $0.075 cached; OpenAI counts the cached in the input.
        let openai = charge(&billing(), ProviderKind::Openai, "gpt-4o-mini", tokens, false);
        assert_eq!(openai.cost_pico_usd, 600 * 150_000 + 400 * 75_000);
        // Anthropic counts them apart.
        let anthropic = charge(&billing(), ProviderKind::Anthropic, "claude-3-5-haiku", tokens, false);
        assert_eq!(anthropic.cost_pico_usd, 1000 * 800_000 + 400 * 80_000);
    }

    #[test]
    fn estimates_round_up() {
        assert_eq!(estimate_tokens(9), 3);
        assert_eq!(estimate_tokens(0), 0);
    }
}
