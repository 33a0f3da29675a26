//! The token quotas, derived from the ledger. The runtime reports each LLM
//! call once, to the ledger; each call new to the ledger is then counted,
//! once, against its tenant's and API key's monthly token quota at the auth
//! service (which owns quotas and tells every gateway when one runs out).
//! `RecordUsage` there is idempotent on the call id, so a retry never counts
//! a call twice.

use std::sync::Arc;
use std::time::Duration;

use avm_common::auth::ServiceIdentity;
use avm_proto::auth::v1 as pb;
use avm_proto::auth::v1::AuthServiceHandle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::record::UsageRecord;

/// Calls waiting to be counted; beyond it a call is not counted (logged and
/// counted in `avm_observability_quota_reports_dropped_total`): the ledger,
/// which bills, keeps every call regardless.
const QUEUE_CAPACITY: usize = 10_000;

/// Where the ledger sends the calls it wrote for the first time.
pub trait QuotaSink: Send + Sync + 'static {
    /// Takes calls new to the ledger; never waits.
    fn counted(&self, records: &[UsageRecord]);
}

/// Counts ledger calls against the auth service's token quotas.
pub struct AuthQuotas {
    queue: mpsc::Sender<pb::RecordUsageRequest>,
}

impl AuthQuotas {
    /// Returns the sink, and the task that reports to `auth` as `identity`
    /// until `stop` (then what it still holds, bounded by its caller).
    pub fn spawn(
        auth: AuthServiceHandle,
        identity: ServiceIdentity,
        stop: CancellationToken,
    ) -> (Arc<Self>, tokio::task::JoinHandle<()>) {
        let (queue, receiver) = mpsc::channel(QUEUE_CAPACITY);
        let task = tokio::spawn(report(auth, identity, receiver, stop));
        (Arc::new(Self { queue }), task)
    }
}

impl QuotaSink for AuthQuotas {
    fn counted(&self, records: &[UsageRecord]) {
        for record in records {
            if record.input_tokens == 0 && record.output_tokens == 0 {
                continue;
            }
            let report = pb::RecordUsageRequest {
                tenant_id: record.tenant_id.clone(),
                key_id: Some(record.key_id.clone()).filter(|key| !key.is_empty()),
                input_tokens: record.input_tokens,
                output_tokens: record.output_tokens,
                report_id: record.call_id.clone(),
            };
            if self.queue.try_send(report).is_err() {
                tracing::warn!(call_id = %record.call_id, "quota queue full; this call does not count against its quota");
                metrics::counter!("avm_observability_quota_reports_dropped_total").increment(1);
            }
        }
    }
}

/// Sends each report until it is taken, backing off while the auth service is away.
async fn report(
    auth: AuthServiceHandle,
    identity: ServiceIdentity,
    mut receiver: mpsc::Receiver<pb::RecordUsageRequest>,
    stop: CancellationToken,
) {
    loop {
        let report = tokio::select! {
            report = receiver.recv() => report,
            () = stop.cancelled() => {
                // What is still queued goes out now.
                receiver.close();
                receiver.recv().await
            }
        };
        let Some(report) = report else { return };
        let mut backoff = Duration::from_millis(100);
        for attempt in 1..=8 {
            let sent = match identity.own_context().await {
                Ok(ctx) => auth
                    .record_usage(ctx.request(report.clone()))
                    .await
                    .map(|_| ())
                    .map_err(|status| avm_common::ApiError::from_status(&status)),
                Err(err) => Err(err),
            };
            match sent {
                Ok(()) => break,
                Err(err) if attempt < 8 && !stop.is_cancelled() => {
                    tracing::warn!(report_id = %report.report_id, attempt, error = %err, "quota report failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(err) => {
                    tracing::error!(report_id = %report.report_id, reason = %err.reason, "quota report not sent");
                    break;
                }
            }
        }
    }
}
