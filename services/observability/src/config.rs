//! The service's settings.

use std::time::Duration;

/// How the usage ledger batches its writes and how long log events live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerSettings {
    /// How often the background writer flushes pending usage records (200 ms).
    pub flush_interval: Duration,
    /// Pending records that wake the writer before its interval (500).
    pub flush_batch: usize,
    /// Log events older than this are pruned (24 h).
    pub log_retention: Duration,
    /// Log events kept per tenant, newest first; older ones are pruned (10,000).
    pub max_log_events_per_tenant: usize,
    /// Usage records that may wait to be written (pending and being written);
    /// beyond it `RecordUsage` answers RESOURCE_EXHAUSTED `USAGE_BACKLOG`
    /// rather than grow memory or drop a record it accepted (100,000).
    pub max_pending_records: usize,
}

impl Default for LedgerSettings {
    fn default() -> Self {
        Self {
            flush_interval: Duration::from_millis(200),
            flush_batch: 500,
            log_retention: Duration::from_secs(24 * 3600),
            max_log_events_per_tenant: 10_000,
            max_pending_records: 100_000,
        }
    }
}
