//! Calls noted open as they are made, so a crash does not lose their bill.
//!
//! Each LLM call is noted with the observability service as it goes out,
//! with the estimate its budget check reserves (input at a token per 4 bytes
//! plus its `max_tokens` of output), off the turn's path: the note is sent by
//! a task of its own while the request is made, one write per call. The
//! call's usage record settles the note. When a runtime that runs alone
//! starts, it asks for every call its previous process left open to be
//! billed at that estimate (status `cut`); with replicas the observability
//! service bills the calls left open for an hour, as no other replica can
//! tell a dead one's calls from a live one's here.

use avm_common::backoff::Backoff;

use tokio_util::sync::CancellationToken;

use super::Metering;
use crate::peers::UsageRecord;

impl Metering {
    /// Notes the call `record` describes (its estimate) as it is made,
    /// without waiting for the answer; a note that cannot be sent is logged
    /// (the call's record still bills it unless the runtime dies too).
    pub fn open_call(&self, record: UsageRecord) {
        let metering = self.clone();
        tokio::spawn(async move {
            let noted = async {
                let ctx = metering.inner.identity.own_context().await?;
                metering.inner.usages.open_call(&ctx, &record).await
            }
            .await;
            if let Err(err) = noted {
                tracing::warn!(call_id = %record.call_id, error = %err, "cannot note an LLM call as open");
            }
        });
    }

    /// Bills the calls this runtime's previous process left open (they
    /// were opened before this one started), retrying until it gets through
    /// or `shutdown`. Only for a runtime that runs alone: a replica's
    /// siblings have calls open too.
    pub fn spawn_settle_previous(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let metering = self.clone();
        tokio::spawn(async move {
            let mut backoff = Backoff::default();
            loop {
                let settled = async {
                    let ctx = metering.inner.identity.own_context().await?;
                    metering
                        .inner
                        .usages
                        .settle_open_calls(&ctx, metering.inner.started_at_ms)
                        .await
                }
                .await;
                match settled {
                    Ok(0) => return,
                    Ok(calls) => {
                        tracing::warn!(calls, "LLM calls cut by the previous process billed at their estimate");
                        return;
                    }
                    Err(err) => tracing::warn!(error = %err, "cannot settle the calls left open; retrying"),
                }
                if !backoff.wait(&shutdown).await {
                    return;
                }
            }
        })
    }
}
