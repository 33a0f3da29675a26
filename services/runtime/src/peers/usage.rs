//! The observability service, as the runtime reports to it: one ledger
//! record per LLM call (noted open as it is made), budget checks, and the
//! stream of budgets.

use avm_common::RequestContext;
use avm_proto::observability::v1 as pb;
use avm_proto::observability::v1::ObservabilityServiceHandle;
use futures::stream::{BoxStream, StreamExt};

use crate::error::RuntimeError;

/// The observability service's ledger record is the runtime's: it adds
/// nothing to it. `CallStatus` says how the call ended.
pub use pb::{CallStatus, UsageRecord};

/// Returns how a call ended as the runtime's metrics label it.
pub fn status_label(status: CallStatus) -> &'static str {
    match status {
        CallStatus::Completed => "completed",
        CallStatus::Interrupted => "interrupted",
        CallStatus::Failed => "failed",
        CallStatus::Cut => "cut",
        CallStatus::Unspecified => "unspecified",
    }
}

/// What an LLM call about to be made is expected to cost: its price (for
/// budgets) and its input and output tokens (for token quotas; zero skips them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Estimate {
    pub pico_usd: i64,
    pub tokens: u64,
}

/// What a budget check answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BudgetAnswer {
    Allowed,
    /// The tenant's (or, with a key id, the key's) monthly budget is spent,
    /// or (`spent` false) taken by the reservations of calls in flight.
    Exhausted {
        key_id: String,
        monthly_limit_pico_usd: i64,
        spent: bool,
    },
    /// The tenant's (or, with a key id, the key's) monthly token quota is
    /// used up, or (`used_up` false) taken by the calls in flight.
    QuotaExceeded {
        key_id: String,
        used_up: bool,
    },
}

/// A change of the set of (tenant, key) pairs with a budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetUpdate {
    /// The whole set (replace what is known), or a change.
    pub snapshot: bool,
    pub removed: bool,
    /// (tenant, key or "") pairs.
    pub budgets: Vec<(String, String)>,
}

/// The observability service as the runtime uses it; cheap to clone.
#[derive(Clone)]
pub struct Usages {
    service: ObservabilityServiceHandle,
}

impl Usages {
    /// Wraps the observability service (in process or remote).
    pub fn new(service: ObservabilityServiceHandle) -> Self {
        Self { service }
    }

    /// Records calls in the ledger (idempotent on their call ids).
    pub async fn record(&self, ctx: &RequestContext, records: &[UsageRecord]) -> Result<(), RuntimeError> {
        let request = ctx.request(pb::RecordUsageRequest {
            records: records.to_vec(),
        });
        self.service.record_usage(request).await?;
        Ok(())
    }

    /// Notes an LLM call as it is made: `record` is what the ledger bills
    /// (as `cut`) if the call's own record never comes.
    pub async fn open_call(&self, ctx: &RequestContext, record: &UsageRecord) -> Result<(), RuntimeError> {
        let mut record = record.clone();
        record.status = CallStatus::Cut.into();
        let request = ctx.request(pb::OpenCallRequest { record: Some(record) });
        self.service.open_call(request).await?;
        Ok(())
    }

    /// Bills the calls opened before `opened_before_ms` whose record never
    /// came at their noted estimate; returns how many.
    pub async fn settle_open_calls(&self, ctx: &RequestContext, opened_before_ms: i64) -> Result<u32, RuntimeError> {
        let request = ctx.request(pb::SettleOpenCallsRequest { opened_before_ms });
        Ok(self.service.settle_open_calls(request).await?.into_inner().settled)
    }

    /// Asks whether a tenant (and key) may make the call `call_id` this
    /// month; an allowed call's estimated price stays reserved against its
    /// budgets, and its estimated tokens (when not zero) against its token
    /// quotas, until its usage record arrives.
    pub async fn check_budget(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        key_id: &str,
        call_id: &str,
        estimate: Estimate,
    ) -> Result<BudgetAnswer, RuntimeError> {
        let request = ctx.request(pb::CheckBudgetRequest {
            tenant_id: tenant_id.to_owned(),
            key_id: key_id.to_owned(),
            call_id: call_id.to_owned(),
            estimated_pico_usd: estimate.pico_usd,
            estimated_tokens: estimate.tokens,
        });
        let answer = self.service.check_budget(request).await?.into_inner();
        if answer.allowed {
            return Ok(BudgetAnswer::Allowed);
        }
        if let Some(quota) = answer.quota_exceeded {
            return Ok(BudgetAnswer::QuotaExceeded {
                key_id: quota.key_id,
                used_up: quota.used_up,
            });
        }
        let budget = answer.exhausted.unwrap_or_default();
        Ok(BudgetAnswer::Exhausted {
            key_id: budget.key_id,
            monthly_limit_pico_usd: budget.monthly_limit_pico_usd,
            spent: budget.exhausted,
        })
    }

    /// Follows which tenants and keys have a budget.
    pub async fn watch_budgets(
        &self,
        ctx: &RequestContext,
    ) -> Result<BoxStream<'static, Result<BudgetUpdate, RuntimeError>>, RuntimeError> {
        let request = ctx.request(pb::WatchBudgetsRequest {});
        let stream = self.service.watch_budgets(request).await?.into_inner();
        Ok(stream
            .map(|item| {
                let update = item?;
                Ok(BudgetUpdate {
                    snapshot: update.snapshot,
                    removed: update.removed,
                    budgets: update
                        .budgets
                        .into_iter()
                        .map(|budget| (budget.tenant_id, budget.key_id))
                        .collect(),
                })
            })
            .boxed())
    }
}
