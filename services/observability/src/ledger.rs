//! The ledger's write path and what budgets read of it.
//!
//! `RecordUsage` never waits for the database: accepted records go to a
//! bounded pending buffer (deduplicated by call id) that a background writer
//! inserts in batches, every `flush_interval` or as soon as `flush_batch`
//! records wait. A failed write keeps its records for the next attempt, so
//! an accepted record is never dropped; when the buffer is full the caller is
//! told to retry (`USAGE_BACKLOG`).
//!
//! What a budget has spent this month is what the database holds, cached
//! per tenant (and key) and month after its first load and kept current by
//! the writer with the records it actually inserted, plus the records still
//! buffered. A retried report of a call already written is counted while it
//! waits (conservative) and dropped when its write finds the call stored.
//!
//! Flushes and cache loads take the same async gate, so a load never reads
//! the database between a flush's commit and the moment the flush moves its
//! records from "buffered" to "cached": each record is counted at least once
//! at every instant, and exactly once outside that conservative window.
//!
//! With replicas on one database, each flush also announces on the feed whose
//! spends it changed, and every other replica drops those from its cache, so
//! a budget checked on any replica counts a call within the writer's flush
//! interval. The cache is still trusted for a second at most, which bounds
//! what a lost announcement (a writer stopping between its commit and its
//! announcement, a broken feed) can leave stale.

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use avm_store::events::EventBus;
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::LedgerSettings;
use crate::error::ObservabilityError;
use crate::events::{ObservabilityEvent, SpendChanged};
use crate::quotas::QuotaSink;
use crate::record::UsageRecord;
use crate::store::ObservabilityStore;

/// Most records written in one transaction (in statements of at most 500 rows).
const MAX_TRANSACTION_RECORDS: usize = 5_000;

/// How long a cached month spend is trusted when other replicas write to the
/// same database: their announcements drop it sooner, this bounds what a lost
/// one leaves stale.
const SHARED_SPEND_TTL: Duration = Duration::from_secs(1);

/// How long the spend follower waits for the feed before trying again.
const FEED_READY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a shutdown keeps retrying to write what is buffered.
const SHUTDOWN_FLUSH_LIMIT: Duration = Duration::from_secs(10);

/// The longest wait between attempts of a failing flush.
const MAX_RETRY_BACKOFF: Duration = Duration::from_secs(5);

/// Whose month spend: a tenant's (`key_id` `None`) or one of its keys'.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SpendKey {
    pub(crate) tenant_id: String,
    pub(crate) key_id: Option<String>,
    /// `YYYY-MM` (UTC).
    pub(crate) month: String,
}

impl SpendKey {
    /// Returns the spends a record counts in: its tenant's and, when it was
    /// made with an API key, the key's.
    fn of(record: &UsageRecord) -> impl Iterator<Item = SpendKey> {
        let month = record.month();
        let tenant = SpendKey {
            tenant_id: record.tenant_id.clone(),
            key_id: None,
            month: month.clone(),
        };
        let key = (!record.key_id.is_empty()).then(|| SpendKey {
            tenant_id: record.tenant_id.clone(),
            key_id: Some(record.key_id.clone()),
            month,
        });
        std::iter::once(tenant).chain(key)
    }
}

/// The billed amount of records not yet written.
#[derive(Debug, Default)]
struct Unflushed {
    billed: i64,
    records: usize,
}

/// A month spend as the database holds it.
#[derive(Debug)]
struct Flushed {
    billed: i64,
    loaded_at: Instant,
}

#[derive(Debug, Default)]
struct State {
    /// Accepted records waiting for the writer.
    pending: Vec<UsageRecord>,
    /// Call ids of the pending records and of those being written.
    waiting: HashSet<String>,
    /// Billed amounts of the pending records and of those being written.
    unflushed: HashMap<SpendKey, Unflushed>,
    /// Month spends loaded from the database, kept current by the writer.
    flushed: HashMap<SpendKey, Flushed>,
    /// After shutdown began, every report is written before it is answered.
    write_through: bool,
}

impl State {
    fn unflushed_billed(&self, key: &SpendKey) -> i64 {
        self.unflushed.get(key).map_or(0, |unflushed| unflushed.billed)
    }
}

/// The pending buffer, the month-spend cache and the writer.
pub(crate) struct Ledger {
    store: Arc<dyn ObservabilityStore>,
    state: Mutex<State>,
    /// Held by each flush from taking its batch to publishing it, and by each
    /// spend load from reading the database to caching what it read.
    gate: tokio::sync::Mutex<()>,
    /// Wakes the writer when a batch is ready.
    wake: Notify,
    /// Told when a record arrives while none were buffered.
    arrived: Notify,
    flush_interval: Duration,
    flush_batch: usize,
    max_pending: usize,
    /// `None` when this replica is the only writer (its cache never goes stale).
    spend_ttl: Option<Duration>,
    /// Where calls new to the ledger go to count against token quotas.
    quotas: std::sync::OnceLock<Arc<dyn QuotaSink>>,
    /// The feed of every replica, where flushes announce whose spends changed.
    events: Arc<EventBus<ObservabilityEvent>>,
    /// Names this replica in its announcements, so it skips its own.
    replica: String,
    /// Bumped whenever cached spends are dropped, so a load that raced with
    /// another replica's write is answered but not cached.
    epoch: AtomicU64,
}

impl Ledger {
    /// Returns an empty ledger over `store`.
    pub(crate) fn new(
        store: Arc<dyn ObservabilityStore>,
        events: Arc<EventBus<ObservabilityEvent>>,
        settings: &LedgerSettings,
    ) -> Self {
        let spend_ttl = store.event_transport().shares_events().then_some(SHARED_SPEND_TTL);
        Self {
            events,
            replica: avm_common::ids::new_id("obs"),
            epoch: AtomicU64::new(0),
            store,
            state: Mutex::new(State::default()),
            gate: tokio::sync::Mutex::new(()),
            wake: Notify::new(),
            arrived: Notify::new(),
            flush_interval: settings.flush_interval,
            flush_batch: settings.flush_batch.max(1),
            max_pending: settings.max_pending_records,
            spend_ttl,
            quotas: std::sync::OnceLock::new(),
        }
    }

    /// Sends the calls new to the ledger to `quotas` from now on (once).
    pub(crate) fn count_quotas_with(&self, quotas: Arc<dyn QuotaSink>) {
        if self.quotas.set(quotas).is_err() {
            tracing::warn!("quota counting was set up twice; keeping the first");
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data: every
        // critical section only moves whole records between collections.
        self.state.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Buffers the records whose call ids are not already waiting (nor
    /// repeated within `records`) and returns how many it took; refuses all
    /// of them when they would overfill the buffer.
    pub(crate) fn accept(&self, records: Vec<UsageRecord>) -> Result<usize, ObservabilityError> {
        let mut state = self.state();
        let mut seen = HashSet::new();
        let fresh: Vec<UsageRecord> = records
            .into_iter()
            .filter(|record| !state.waiting.contains(&record.call_id) && seen.insert(record.call_id.clone()))
            .collect();
        if state.waiting.len() + fresh.len() > self.max_pending {
            return Err(ObservabilityError::Backlog(state.waiting.len()));
        }
        let accepted = fresh.len();
        let first = state.pending.is_empty() && accepted > 0;
        for record in fresh {
            for key in SpendKey::of(&record) {
                let unflushed = state.unflushed.entry(key).or_default();
                unflushed.billed += record.billed_pico_usd;
                unflushed.records += 1;
            }
            state.waiting.insert(record.call_id.clone());
            state.pending.push(record);
        }
        let ready = state.pending.len() >= self.flush_batch;
        record_depth(&state);
        drop(state);
        // The first record wakes an idle writer, which then waits
        // `flush_interval` for more; a full batch is written at once.
        if first {
            self.arrived.notify_one();
        }
        if ready {
            self.wake.notify_one();
        }
        Ok(accepted)
    }

    /// Returns whether reports must be written before they are answered
    /// (shutdown began, so no writer will come back for them).
    pub(crate) fn writes_through(&self) -> bool {
        self.state().write_through
    }

    /// Writes every record accepted before the call; returns how many were
    /// new to the database. On failure the unwritten records stay buffered.
    pub(crate) async fn flush(&self) -> Result<usize, ObservabilityError> {
        // Waiting for the gate also waits for a flush in progress, so what
        // that flush took is written (or back in the buffer) when this starts.
        let gate = self.gate.lock().await;
        let mut batch = std::mem::take(&mut self.state().pending);
        let mut written = 0;
        let mut start = 0;
        let mut spent = BTreeSet::new();
        let outcome = loop {
            if start >= batch.len() {
                break Ok(written);
            }
            let end = (start + MAX_TRANSACTION_RECORDS).min(batch.len());
            match self.store.insert_usage(&batch[start..end], avm_common::now_ms()).await {
                Ok(inserted) => {
                    written += inserted.len();
                    spent.extend(
                        batch[start..end]
                            .iter()
                            .filter(|record| inserted.contains(&record.call_id))
                            .map(|record| record.tenant_id.clone()),
                    );
                    self.publish(&batch[start..end], &inserted);
                    if let Some(quotas) = self.quotas.get() {
                        let new: Vec<UsageRecord> = batch[start..end]
                            .iter()
                            .filter(|record| inserted.contains(&record.call_id))
                            .cloned()
                            .collect();
                        quotas.counted(&new);
                    }
                    start = end;
                }
                Err(err) => {
                    let unwritten = batch.split_off(start);
                    let mut state = self.state();
                    // Ahead of what arrived meanwhile, so the oldest go first.
                    state.pending.splice(0..0, unwritten);
                    metrics::counter!("avm_observability_usage_flush_failures_total").increment(1);
                    break Err(err);
                }
            }
        };
        // What was written is published: loads need not wait for the news.
        drop(gate);
        self.announce(spent).await;
        outcome
    }

    /// Tells the other replicas whose month spends this replica's writes changed.
    async fn announce(&self, tenants: BTreeSet<String>) {
        if tenants.is_empty() || !self.events.shares_events() {
            return;
        }
        for event in SpendChanged::announcing(&self.replica, tenants.into_iter().collect()) {
            self.events.emit(ObservabilityEvent::Spent(event)).await;
        }
    }

    /// Drops the cached spends of `tenants` (and their keys), or all of them.
    fn forget(&self, tenants: Option<&[String]>) {
        let mut state = self.state();
        self.epoch.fetch_add(1, Ordering::SeqCst);
        match tenants {
            Some(tenants) => {
                let tenants: HashSet<&str> = tenants.iter().map(String::as_str).collect();
                state.flushed.retain(|key, _| !tenants.contains(key.tenant_id.as_str()));
            }
            None => state.flushed.clear(),
        }
    }

    /// Drops the spends other replicas' writes changed, as they announce
    /// them, until `shutdown`; when announcements may have been lost, drops
    /// every cached spend.
    pub(crate) async fn follow_spends(&self, shutdown: CancellationToken) {
        if !self.events.shares_events() {
            return;
        }
        loop {
            let live = tokio::select! {
                () = shutdown.cancelled() => return,
                live = self.events.wait_live(FEED_READY_TIMEOUT) => live,
            };
            if live.is_ok() {
                let mut feed = std::pin::pin!(self.events.subscribe());
                self.forget(None);
                loop {
                    let item = tokio::select! {
                        () = shutdown.cancelled() => return,
                        item = feed.next() => item,
                    };
                    match item {
                        Some(Ok(ObservabilityEvent::Spent(spent))) if spent.writer != self.replica => {
                            self.forget(Some(&spent.spent_tenants));
                        }
                        Some(Ok(_)) => {}
                        Some(Err(_)) | None => break,
                    }
                }
                self.forget(None);
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    /// Moves written records out of the buffer, and the billed amount of
    /// those the database did not hold yet into the loaded month spends.
    fn publish(&self, written: &[UsageRecord], inserted: &HashSet<String>) {
        let mut state = self.state();
        for record in written {
            state.waiting.remove(&record.call_id);
            let new = inserted.contains(&record.call_id);
            for key in SpendKey::of(record) {
                if new && let Some(flushed) = state.flushed.get_mut(&key) {
                    flushed.billed += record.billed_pico_usd;
                }
                if let Entry::Occupied(mut entry) = state.unflushed.entry(key) {
                    let unflushed = entry.get_mut();
                    unflushed.billed -= record.billed_pico_usd;
                    unflushed.records = unflushed.records.saturating_sub(1);
                    if unflushed.records == 0 {
                        entry.remove();
                    }
                }
            }
        }
        record_depth(&state);
    }

    /// Returns what `key` spent: the database's sum (cached) plus the
    /// records still buffered.
    pub(crate) async fn spent(&self, key: &SpendKey) -> Result<i64, ObservabilityError> {
        if let Some(spent) = self.cached_spend(key) {
            return Ok(spent);
        }
        let _gate = self.gate.lock().await;
        // Another caller may have loaded it while this one waited.
        if let Some(spent) = self.cached_spend(key) {
            return Ok(spent);
        }
        let epoch = self.epoch.load(Ordering::SeqCst);
        let billed = self
            .store
            .month_spend(&key.tenant_id, key.key_id.as_deref(), &key.month)
            .await?;
        let mut state = self.state();
        if self.epoch.load(Ordering::SeqCst) == epoch {
            // Spends of past months are never asked about again.
            state.flushed.retain(|cached, _| cached.month == key.month);
            state.flushed.insert(
                key.clone(),
                Flushed {
                    billed,
                    loaded_at: Instant::now(),
                },
            );
        }
        Ok(billed + state.unflushed_billed(key))
    }

    fn cached_spend(&self, key: &SpendKey) -> Option<i64> {
        let state = self.state();
        let flushed = state.flushed.get(key)?;
        let fresh = self.spend_ttl.is_none_or(|ttl| flushed.loaded_at.elapsed() < ttl);
        fresh.then(|| flushed.billed + state.unflushed_billed(key))
    }

    /// Writes buffered records every `flush_interval` (sooner when a batch
    /// is ready, later while writes fail) until `shutdown`, then writes what
    /// is left, retrying for a while.
    pub(crate) async fn run_writer(&self, shutdown: CancellationToken) {
        let mut backoff: Option<Duration> = None;
        loop {
            if backoff.is_none() && self.state().pending.is_empty() {
                // Nothing to write: no timer until the first record comes
                // (an idle process is not woken up five times a second).
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => break,
                    () = self.arrived.notified() => {}
                }
            }
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                () = self.wake.notified(), if backoff.is_none() => {}
                () = tokio::time::sleep(backoff.unwrap_or(self.flush_interval)) => {}
            }
            match self.flush().await {
                Ok(_) => backoff = None,
                Err(err) => {
                    let waiting = self.state().waiting.len();
                    let next = backoff
                        .map_or(self.flush_interval, |wait| wait * 2)
                        .min(MAX_RETRY_BACKOFF);
                    let retry_in_ms = u64::try_from(next.as_millis()).unwrap_or(u64::MAX);
                    tracing::warn!(error = %err, records = waiting, retry_in_ms, "usage records not written; retrying");
                    backoff = Some(next);
                }
            }
        }
        self.finish().await;
    }

    /// Writes what is buffered at shutdown; from now on each report is
    /// written before it is answered, so none is accepted and then lost.
    async fn finish(&self) {
        self.state().write_through = true;
        let deadline = Instant::now() + SHUTDOWN_FLUSH_LIMIT;
        let mut backoff = avm_common::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let mut pause = backoff.next_pause();
        loop {
            match self.flush().await {
                Ok(_) => return,
                Err(err) if Instant::now() + pause < deadline => {
                    tracing::warn!(error = %err, "usage records not written at shutdown; retrying");
                    tokio::time::sleep(pause).await;
                    pause = backoff.next_pause();
                }
                Err(err) => {
                    let waiting = self.state().waiting.len();
                    tracing::error!(error = %err, records = waiting, "usage records lost at shutdown");
                    return;
                }
            }
        }
    }
}

fn record_depth(state: &State) {
    metrics::gauge!("avm_observability_usage_pending_records").set(state.waiting.len() as f64);
}
