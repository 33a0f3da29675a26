//! Calls that reached a provider but whose record may never come: each LLM
//! call is noted as it is made (one write per call, never per token), as the
//! record it would be if its runtime died then — its estimated tokens and
//! price, status `cut`. Its record, written by the ledger, deletes the note.
//! Notes left behind become ledger records at their estimate: those of a
//! runtime's previous process when the runtime starts again (it says so), and
//! any older than [`ABANDONED_CALL_AGE`] (a replica that never came back).
//! They go through the ledger like any record, so they count against budgets
//! and token quotas, and a record that arrives after all is not counted twice.

use std::time::Duration;

use avm_common::RequestContext;
use tracing::instrument;

use crate::error::ObservabilityError;
use crate::record::{CallStatus, UsageRecord};
use crate::service::{ObservabilityService, validate_record};

/// Open calls settled per round trip to the database.
const SETTLE_PAGE: u32 = 500;

/// An open call this old has lost its runtime, whoever started it: no LLM
/// call streams for an hour, and a runtime that restarts settles its own
/// sooner.
pub(crate) const ABANDONED_CALL_AGE: Duration = Duration::from_secs(3600);

impl ObservabilityService {
    /// Notes an LLM call as it is made (components only): `record` is what
    /// the ledger bills if the call's own record never comes; it is stored
    /// as `cut` and `estimated` whatever it says.
    #[instrument(name = "observability.open_call", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn open_call(&self, ctx: &RequestContext, mut record: UsageRecord) -> Result<(), ObservabilityError> {
        ctx.principal.require_service()?;
        validate_record(0, &record)?;
        record.status = CallStatus::Cut;
        record.estimated = true;
        self.store().insert_open_call(&record).await
    }

    /// Bills every call opened before `opened_before_ms` whose record has
    /// not come at its noted estimate (components only); returns how many
    /// calls it billed.
    #[instrument(name = "observability.settle_open_calls", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn settle_open_calls(
        &self,
        ctx: &RequestContext,
        opened_before_ms: i64,
    ) -> Result<u32, ObservabilityError> {
        ctx.principal.require_service()?;
        self.settle_opened_before(opened_before_ms).await
    }

    /// Moves the calls opened before `opened_before_ms` into the ledger, a
    /// page at a time: each page is written (which deletes its notes) before
    /// the next is read.
    pub(crate) async fn settle_opened_before(&self, opened_before_ms: i64) -> Result<u32, ObservabilityError> {
        let mut settled = 0_u32;
        loop {
            let open = self.store().open_calls(opened_before_ms, SETTLE_PAGE).await?;
            let last_page = open.len() < SETTLE_PAGE as usize;
            if open.is_empty() {
                return Ok(settled);
            }
            for record in &open {
                tracing::warn!(
                    call_id = %record.call_id,
                    tenant_id = %record.tenant_id,
                    image_id = %record.image_id,
                    input_tokens = record.input_tokens,
                    output_tokens = record.output_tokens,
                    "an LLM call was cut by its runtime's end; billing its estimate"
                );
            }
            let count = u32::try_from(open.len()).unwrap_or(u32::MAX);
            metrics::counter!("avm_observability_cut_calls_total").increment(u64::from(count));
            self.accept_records(open).await?;
            self.flush().await?;
            settled = settled.saturating_add(count);
            if last_page {
                return Ok(settled);
            }
        }
    }

    /// Settles the calls open longer than [`ABANDONED_CALL_AGE`] (from the
    /// periodic pruner).
    pub(crate) async fn settle_abandoned(&self) {
        let age = i64::try_from(ABANDONED_CALL_AGE.as_millis()).unwrap_or(i64::MAX);
        let before = avm_common::now_ms().saturating_sub(age);
        if let Err(err) = self.settle_opened_before(before).await {
            tracing::warn!(error = %err, "abandoned LLM calls not settled");
        }
    }
}
