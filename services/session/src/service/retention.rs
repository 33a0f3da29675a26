//! Retention: each tenant's policy, set by its admins, and the sweeps that
//! apply it, on demand (an admin, for the own tenant) or in the background
//! (every tenant with a policy, every `session.retention_interval`).
//!
//! A sweep is bounded ([`MESSAGES_PER_SWEEP`], [`CONVERSATIONS_PER_SWEEP`]
//! per tenant) and made of small transactions, so a large backlog is worked
//! off over several sweeps without long locks. Conversations are deleted
//! through [`SessionService::remove_image`], as a user's deletion is, so
//! devices, runtimes, the search index and read markers follow. Only this
//! service's rows are touched; usage records, in other services'
//! databases, are never.

use std::time::{Duration, Instant};

use avm_common::auth::{Principal, Scopes};
use avm_common::ids::new_id;
use avm_common::{RequestContext, now_ms};
use tokio_util::sync::CancellationToken;
use tracing::instrument;

use super::allow;
use crate::error::SessionError;
use crate::retention::{
    CONVERSATIONS_PER_SWEEP, MESSAGES_PER_SWEEP, MESSAGES_PER_TRANSACTION, RetentionPolicy, RetentionSweeps,
    StoredPolicy, SweepReport,
};
use crate::service::SessionService;

/// Policies read per page by the background sweep.
const POLICIES_PER_PAGE: u32 = 100;

impl SessionService {
    /// Returns the retention policy of the caller's tenant; an empty one
    /// (nothing is deleted) when it never set one.
    #[instrument(
        name = "session.get_retention_policy",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn get_retention_policy(&self, ctx: &RequestContext) -> Result<StoredPolicy, SessionError> {
        allow(ctx, Scopes::READ)?;
        Ok(self
            .store
            .get_retention_policy(&ctx.tenant_id)
            .await?
            .unwrap_or_default())
    }

    /// Sets the retention policy of the caller's tenant, all of it (an
    /// admin's); a field out of its bounds refuses the whole policy and
    /// nothing is written.
    #[instrument(
        name = "session.set_retention_policy",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn set_retention_policy(
        &self,
        ctx: &RequestContext,
        policy: RetentionPolicy,
    ) -> Result<StoredPolicy, SessionError> {
        ctx.principal.require_admin().map_err(SessionError::Denied)?;
        policy.validate()?;
        let now = now_ms();
        self.store
            .set_retention_policy(&ctx.tenant_id, &policy, &ctx.principal.user_id, now)
            .await?;
        tracing::info!(
            message_days = policy.message_days,
            idle_conversation_days = policy.idle_conversation_days,
            max_conversations_per_container = policy.max_conversations_per_container,
            "retention policy set"
        );
        Ok(StoredPolicy {
            policy,
            updated_at_ms: now,
        })
    }

    /// Applies the policy of the caller's tenant now (an admin's), within
    /// the bounds of one sweep; a dry run deletes nothing and reports what a
    /// sweep would delete.
    #[instrument(
        name = "session.sweep_retention",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn sweep_retention(&self, ctx: &RequestContext, dry_run: bool) -> Result<SweepReport, SessionError> {
        ctx.principal.require_admin().map_err(SessionError::Denied)?;
        let policy = self
            .store
            .get_retention_policy(&ctx.tenant_id)
            .await?
            .unwrap_or_default()
            .policy;
        self.sweep_tenant(ctx, &policy, dry_run, now_ms()).await
    }

    /// Sweeps every tenant with a policy once, one after another, each
    /// within the bounds of one sweep; a tenant's failure is logged and the
    /// others go on. `None` when another replica is sweeping (Postgres).
    pub async fn sweep_all_tenants(&self) -> Result<Option<RetentionSweeps>, SessionError> {
        let Some(_lock) = self.store.lock_sweep().await? else {
            tracing::debug!("another replica is sweeping");
            return Ok(None);
        };
        let now = now_ms();
        let mut sweeps = RetentionSweeps::default();
        let mut after = String::new();
        loop {
            let page = self.store.list_retention_policies(&after, POLICIES_PER_PAGE).await?;
            for (tenant_id, policy) in &page {
                match self.sweep_tenant(&sweeper(tenant_id), policy, false, now).await {
                    Ok(report) => sweeps.add(&report),
                    Err(err) => {
                        sweeps.failed += 1;
                        tracing::warn!(tenant_id = %tenant_id, error = %err, "retention sweep failed");
                    }
                }
            }
            match page.last() {
                Some((last, _)) if page.len() == POLICIES_PER_PAGE as usize => after.clone_from(last),
                _ => return Ok(Some(sweeps)),
            }
        }
    }

    /// Runs [`Self::sweep_all_tenants`] every `interval` (the first after
    /// one interval) until `shutdown`; a zero interval runs nothing. A sweep
    /// cut short by shutdown loses nothing: each deletion is a transaction
    /// of its own.
    pub fn spawn_retention(&self, interval: Duration, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let service = self.clone();
        tokio::spawn(async move {
            if interval.is_zero() {
                return;
            }
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    result = service.sweep_all_tenants() => {
                        if let Err(err) = result {
                            tracing::warn!(error = %err, "retention sweep failed");
                        }
                    }
                }
            }
        })
    }

    /// Applies `policy` to the tenant of `ctx` as of `now`: first the old
    /// messages, a transaction of at most [`MESSAGES_PER_TRANSACTION`] at a
    /// time, then the idle and excess conversations, each deleted as a user
    /// deletes one. Deleting messages changes no conversation's last
    /// activity, so a dry run's counts are what a sweep then deletes.
    async fn sweep_tenant(
        &self,
        ctx: &RequestContext,
        policy: &RetentionPolicy,
        dry_run: bool,
        now: i64,
    ) -> Result<SweepReport, SessionError> {
        let started = Instant::now();
        let tenant_id = ctx.tenant_id.as_str();
        let mut report = SweepReport {
            dry_run,
            ..SweepReport::default()
        };
        if let Some(before) = policy.messages_before(now) {
            if dry_run {
                report.messages = self
                    .store
                    .count_old_messages(tenant_id, before, MESSAGES_PER_SWEEP)
                    .await?;
            } else {
                let bound = u64::from(MESSAGES_PER_SWEEP);
                while report.messages < bound {
                    let batch = u64::from(MESSAGES_PER_TRANSACTION).min(bound - report.messages);
                    let batch = u32::try_from(batch).unwrap_or(MESSAGES_PER_TRANSACTION);
                    let deleted = self.store.delete_old_messages(tenant_id, before, batch).await?;
                    metrics::counter!("avm_session_retention_deleted_total", "what" => "messages").increment(deleted);
                    report.messages += deleted;
                    if deleted < u64::from(batch) {
                        break;
                    }
                }
            }
            report.limit_reached |= report.messages >= u64::from(MESSAGES_PER_SWEEP);
        }
        let idle_before = policy.idle_before(now);
        if idle_before.is_some() || policy.max_conversations_per_container.is_some() {
            let candidates = self
                .store
                .list_retention_candidates(
                    tenant_id,
                    idle_before,
                    policy.max_conversations_per_container,
                    CONVERSATIONS_PER_SWEEP,
                )
                .await?;
            report.limit_reached |= candidates.len() >= CONVERSATIONS_PER_SWEEP as usize;
            for candidate in candidates {
                if dry_run {
                    report.conversation(candidate.image_id);
                    continue;
                }
                let deleted = match self
                    .remove_image(ctx, &candidate.image_id, Some(candidate.last_active_at_ms))
                    .await
                {
                    Ok(deleted) => deleted,
                    // Deleted since, active again, or a parent now: not this sweep's.
                    Err(SessionError::ImageNotFound(_)) => continue,
                    Err(err) => return Err(err),
                };
                metrics::counter!("avm_session_retention_deleted_total", "what" => "conversations")
                    .increment(deleted.len() as u64);
                for image_id in deleted {
                    report.conversation(image_id);
                }
            }
        }
        if !dry_run {
            metrics::counter!("avm_session_retention_sweeps_total").increment(1);
            metrics::histogram!("avm_session_retention_sweep_seconds").record(started.elapsed().as_secs_f64());
            if report.messages > 0 || report.conversations > 0 {
                tracing::info!(
                    tenant_id,
                    messages = report.messages,
                    conversations = report.conversations,
                    limit_reached = report.limit_reached,
                    "retention sweep deleted"
                );
            }
        }
        Ok(report)
    }
}

/// Returns the context the background sweep acts in for a tenant: a
/// service principal's, under a request id of its own (the origin its
/// deletions are told with).
fn sweeper(tenant_id: &str) -> RequestContext {
    RequestContext::new(Principal::service(tenant_id), None, new_id("req"))
}
