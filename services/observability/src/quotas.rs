//! The token quotas, owned by the auth service. Before an LLM call its
//! budget check reserves the call's estimated tokens there, against its
//! tenant's and API key's monthly quotas (so concurrent calls count each
//! other while in flight); after it, the call's usage record settles the
//! reservation with the real tokens. Every call new to the ledger is counted
//! there too, once: `RecordUsage` at the auth service is idempotent on the
//! call id, so a call settled early, or a retry, never counts twice.

use std::sync::Arc;

use avm_common::RequestContext;
use avm_common::auth::ServiceIdentity;
use avm_proto::auth::v1 as pb;
use avm_proto::auth::v1::AuthServiceHandle;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::error::ObservabilityError;
use crate::record::{TokenQuota, UsageRecord};

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
    auth: AuthServiceHandle,
    identity: ServiceIdentity,
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
        let task = tokio::spawn(report(auth.clone(), identity.clone(), receiver, stop));
        (Arc::new(Self { auth, identity, queue }), task)
    }
}

impl AuthQuotas {
    /// Reserves `tokens` for the call `call_id` of `tenant_id` (with
    /// `key_id`, when not empty) against their monthly quotas; returns the
    /// quota that refuses it, if one does.
    pub(crate) async fn reserve(
        &self,
        tenant_id: &str,
        key_id: &str,
        call_id: &str,
        tokens: u64,
    ) -> Result<Option<TokenQuota>, ObservabilityError> {
        let ctx = self.identity.own_context().await?;
        let request = ctx.request(pb::ReserveTokensRequest {
            tenant_id: tenant_id.to_owned(),
            key_id: Some(key_id.to_owned()).filter(|key| !key.is_empty()),
            reservation_id: call_id.to_owned(),
            tokens,
        });
        let answer = self
            .auth
            .reserve_tokens(request)
            .await
            .map_err(|status| avm_common::ApiError::from_status(&status))?
            .into_inner();
        if answer.reserved {
            return Ok(None);
        }
        let quota = answer.exceeded.unwrap_or_default();
        Ok(Some(TokenQuota {
            key_id: quota.key_id.unwrap_or_default(),
            used_up: answer.used_up,
        }))
    }

    /// Returns the tenant of the API key `key_id` as `ctx`'s caller sees it:
    /// NOT_FOUND `API_KEY_NOT_FOUND` when the caller may not see it or it
    /// does not exist (the auth service's one answer for both).
    pub(crate) async fn key_tenant(&self, ctx: &RequestContext, key_id: &str) -> Result<String, ObservabilityError> {
        let request = ctx.request(pb::GetApiKeyRequest {
            key_id: key_id.to_owned(),
        });
        let key = self
            .auth
            .get_api_key(request)
            .await
            .map_err(|status| avm_common::ApiError::from_status(&status))?
            .into_inner()
            .api_key;
        Ok(key.map(|key| key.tenant_id).unwrap_or_default())
    }

    /// Settles the reservations of calls whose records just arrived: counts
    /// their real tokens at once (zero too, which only ends the
    /// reservation), so the next check of the tenant sees them; what cannot
    /// be sent now goes to the retrying queue.
    pub(crate) async fn settle(&self, records: &[UsageRecord]) {
        let Ok(ctx) = self.identity.own_context().await else {
            self.enqueue(records.iter());
            return;
        };
        for record in records {
            if let Err(status) = self.auth.record_usage(ctx.request(report_of(record))).await {
                tracing::warn!(call_id = %record.call_id, reason = %avm_common::ApiError::from_status(&status).reason, "token reservation not settled; retrying in the background");
                self.enqueue(std::iter::once(record));
            }
        }
    }

    /// Hands reports to the background sender; never waits.
    fn enqueue<'a>(&self, records: impl Iterator<Item = &'a UsageRecord>) {
        for record in records {
            if self.queue.try_send(report_of(record)).is_err() {
                tracing::warn!(call_id = %record.call_id, "quota queue full; this call does not count against its quota");
                metrics::counter!("avm_observability_quota_reports_dropped_total").increment(1);
            }
        }
    }
}

impl QuotaSink for AuthQuotas {
    fn counted(&self, records: &[UsageRecord]) {
        self.enqueue(
            records
                .iter()
                .filter(|record| record.input_tokens > 0 || record.output_tokens > 0),
        );
    }
}

/// Returns the auth service's report of one call, identified by its call id.
fn report_of(record: &UsageRecord) -> pb::RecordUsageRequest {
    pb::RecordUsageRequest {
        tenant_id: record.tenant_id.clone(),
        key_id: Some(record.key_id.clone()).filter(|key| !key.is_empty()),
        input_tokens: record.input_tokens,
        output_tokens: record.output_tokens,
        report_id: record.call_id.clone(),
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
        let mut backoff = avm_common::backoff::Backoff::default();
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
                    tokio::time::sleep(backoff.next_pause()).await;
                }
                Err(err) => {
                    tracing::error!(report_id = %report.report_id, reason = %err.reason, "quota report not sent");
                    break;
                }
            }
        }
    }
}
