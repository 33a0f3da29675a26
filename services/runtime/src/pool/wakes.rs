//! Waking agents to read their groups: a wake starts the agent here, or
//! goes to the replica holding it, and the woken agent reads what it has
//! not read (`groups.rs`).
//!
//! With replicas, group messages wake agents through the wake bus (a Redis
//! stream, `replicas/wakes.rs`): each replica takes wakes from it, has the
//! agent's owner (here or the replica holding its lease) read what woke it,
//! and acknowledges the wake only then. A replica that dies with wakes
//! unacknowledged leaves them to a survivor, which has them read again.

use std::sync::Arc;
use std::time::Duration;

use avm_common::RequestContext;
use avm_common::auth::Scopes;
use futures::future::BoxFuture;

use tokio_util::sync::CancellationToken;

use super::AgentPool;
use crate::agent::Agent;
use crate::error::RuntimeError;
use crate::peers::Role;
use crate::replicas::{Replicas, WakeEntry};

/// Heartbeats between two looks for wakes left idle: a wake is taken over
/// 5 to 8 s after it was left, and an idle runtime asks Redis seldom.
const RECLAIM_EVERY: u64 = 3;
/// Heartbeats between two prunings of gone replicas' consumers.
const PRUNE_EVERY: u64 = 60;

impl AgentPool {
    /// Takes wakes from the bus until `shutdown` or until it drains.
    pub(super) async fn take_wakes(self, replicas: Replicas, shutdown: CancellationToken) {
        let mut conn = None;
        loop {
            // Draining, it takes no new agents: the others take its wakes.
            if shutdown.is_cancelled() || replicas.draining() {
                return;
            }
            let reader = match conn.as_mut() {
                Some(reader) => reader,
                None => match replicas.wake_reader().await {
                    Ok(reader) => conn.insert(reader),
                    Err(_) => {
                        // Logged by the connection; tried again shortly.
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        }
                    }
                },
            };
            let entries = tokio::select! {
                () = shutdown.cancelled() => return,
                entries = replicas.read_wakes(reader) => entries,
            };
            match entries {
                Ok(entries) => {
                    for entry in entries {
                        self.deliver_wake(&replicas, entry);
                    }
                }
                Err(_) => conn = None,
            }
        }
    }

    /// Keeps this replica's wakes its own (every heartbeat; `beat` counts
    /// them), and takes over the wakes left idle by a replica that died or a
    /// delivery that failed (every [`RECLAIM_EVERY`]).
    pub(super) async fn reclaim_wakes(&self, replicas: &Replicas, beat: u64) {
        replicas.keep_wakes().await;
        if !beat.is_multiple_of(RECLAIM_EVERY) {
            return;
        }
        if let Ok(entries) = replicas.reclaim_wakes().await {
            for entry in entries {
                tracing::info!(image_id = %entry.image_id, group_id = %entry.group_id, seq = entry.seq, "a group message's wake taken over");
                metrics::counter!("avm_runtime_wakes_reclaimed_total").increment(1);
                self.deliver_wake(replicas, entry);
            }
        }
        metrics::gauge!("avm_runtime_wakes_in_flight").set(replicas.wakes_in_flight() as f64);
        if beat.is_multiple_of(PRUNE_EVERY) {
            replicas.prune_wake_consumers().await;
        }
    }

    /// Has the agent of a wake read what woke it, then acknowledges the wake;
    /// a wake that could not be read stays pending, to be taken over.
    fn deliver_wake(&self, replicas: &Replicas, entry: WakeEntry) {
        if !replicas.begin_wake(&entry.id) {
            return;
        }
        let (pool, replicas) = (self.clone(), replicas.clone());
        tokio::spawn(async move {
            let read = match pool.inner.ports.identity.tenant_context(&entry.tenant_id).await {
                Ok(ctx) => pool.wake_member(&ctx, &entry.image_id, true).await,
                Err(err) => Err(err.into()),
            };
            let done = match read {
                Ok(_) => true,
                Err(err) if err.transient() => {
                    tracing::warn!(image_id = %entry.image_id, group_id = %entry.group_id, seq = entry.seq, error = %err, "a group message's wake was not read; it is taken over in a few seconds");
                    false
                }
                Err(err) => {
                    // The image is gone or may not run: nothing to read again.
                    tracing::warn!(image_id = %entry.image_id, group_id = %entry.group_id, error = %err, "a group message's wake cannot be read; dropped");
                    true
                }
            };
            replicas.end_wake(&entry.id, done).await;
        });
    }
}

impl AgentPool {
    /// Wakes an agent here or on the replica holding it; with `wait`, answers
    /// once the agent read what woke it.
    pub(super) async fn wake_member(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        wait: bool,
    ) -> Result<bool, RuntimeError> {
        let woken = if wait {
            self.wake_and_read(ctx, image_id).await
        } else {
            self.wake(ctx, image_id).await
        };
        match woken {
            Err(RuntimeError::Elsewhere(addr)) => self.inner.placement.wake_elsewhere(&addr, ctx, image_id, wait).await,
            result => result,
        }
    }

    /// Wakes an agent whose group turn was lost with its runtime. Boxed: the
    /// wake may start the agent here, which ends lost turns.
    pub(super) fn wake_again(self, tenant_id: String, image_id: String, group_id: String) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let woken = match self.inner.ports.identity.tenant_context(&tenant_id).await {
                Ok(ctx) => self.wake_member(&ctx, &image_id, false).await,
                Err(err) => Err(err.into()),
            };
            match woken {
                Ok(_) => tracing::info!(image_id, group_id, "agent woken again after its runtime was lost"),
                Err(err) => {
                    tracing::warn!(image_id, group_id, error = %err, "cannot wake again an agent whose runtime was lost");
                }
            }
        })
    }

    /// Wakes an image's agent to read its unread group messages: starts it
    /// reading, or makes it read again once it is done.
    #[tracing::instrument(name = "runtime.wake_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn wake(&self, ctx: &RequestContext, image_id: &str) -> Result<bool, RuntimeError> {
        Ok(self.start_reading(ctx, image_id).await?.is_some())
    }

    /// Wakes an image's agent and answers once it read what woke it: `false`
    /// when it is paused, in error or terminated (what reached it stays
    /// unread), and unavailable when it left this replica before it was done.
    #[tracing::instrument(name = "runtime.wake_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn wake_and_read(&self, ctx: &RequestContext, image_id: &str) -> Result<bool, RuntimeError> {
        let Some((agent, wake)) = self.start_reading(ctx, image_id).await? else {
            return Ok(false);
        };
        agent.read(&wake).await;
        if agent.is_retired() {
            return Err(RuntimeError::AgentRestarting);
        }
        Ok(true)
    }

    pub(super) async fn start_reading(
        &self,
        ctx: &RequestContext,
        image_id: &str,
    ) -> Result<Option<(Arc<Agent>, crate::agent::Wake)>, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        if ctx.owner_filter().is_some() {
            // A member wakes an agent (which then calls the model) only where they may use it.
            self.image_with_role(ctx, image_id, Some(Role::Use)).await?;
        }
        let agent = match self.ensure_agent(ctx, image_id).await {
            // Paused, in error or terminated: what reached it stays unread.
            Err(err) if super::lifecycle::not_runnable(&err) => return Ok(None),
            agent => agent?.0,
        };
        let wake = agent.wake();
        if wake.start {
            tracing::debug!(image_id, "agent woken");
            tokio::spawn(self.clone().read_groups(Arc::clone(&agent)));
        }
        Ok(Some((agent, wake)))
    }
}
