//! The agents of this runtime: at most one per image, started on demand
//! (hydrated from the image and its history), found by image or agent id,
//! and retired when stopped, deleted, replaced or idle.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use avm_common::RequestContext;
use avm_common::auth::Scopes;
use avm_common::event::data;
use avm_common::ids::new_id;
use tokio::sync::OnceCell;
use tracing::instrument;

use super::lifecycle;
use super::recovery::cut_turn;
use super::{AgentKey, AgentPool, validate_id};
use crate::agent::{Agent, AgentInfo};
use crate::context::context_to_llm;
use crate::error::{AgentTarget, RuntimeError};
use crate::peers::Role;
use crate::tools::Toolbox;

/// The agents of this runtime, by (tenant, image id) and by agent id, and
/// those retired while a turn of theirs still ran.
#[derive(Default)]
pub(super) struct Registry {
    /// Agents by (tenant, image id); the cell makes concurrent starts share one hydration.
    agents: Mutex<HashMap<AgentKey, Arc<OnceCell<Arc<Agent>>>>>,
    /// Agent id to its key, for calls that name the agent.
    agent_ids: Mutex<HashMap<String, AgentKey>>,
    /// Agents that left the pool while a turn of theirs still ran, until it
    /// ends: the next agent of the image reads its history once that turn
    /// stored what it had, and never takes it for a turn cut by a crash.
    retiring: Mutex<HashMap<AgentKey, Arc<Agent>>>,
}

impl Registry {
    fn agents(&self) -> MutexGuard<'_, HashMap<AgentKey, Arc<OnceCell<Arc<Agent>>>>> {
        self.agents.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    fn agent_ids(&self) -> MutexGuard<'_, HashMap<String, AgentKey>> {
        self.agent_ids.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    fn retiring_agents(&self) -> MutexGuard<'_, HashMap<AgentKey, Arc<Agent>>> {
        self.retiring.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Returns the cell of an image's agent, made empty when there is none.
    fn cell(&self, key: &AgentKey) -> Arc<OnceCell<Arc<Agent>>> {
        Arc::clone(self.agents().entry(key.clone()).or_default())
    }

    /// Forgets `cell` when it is still the image's and its agent never
    /// started; returns whether it did.
    fn forget_unstarted(&self, key: &AgentKey, cell: &Arc<OnceCell<Arc<Agent>>>) -> bool {
        let mut agents = self.agents();
        let unused = agents
            .get(key)
            .is_some_and(|c| Arc::ptr_eq(c, cell) && !c.initialized());
        unused && agents.remove(key).is_some()
    }

    /// Names a started agent by its id.
    fn name(&self, agent_id: String, key: AgentKey) {
        self.agent_ids().insert(agent_id, key);
    }

    /// Returns the tenant's agent named by `target`.
    fn get(&self, tenant_id: &str, target: &AgentTarget) -> Option<Arc<Agent>> {
        let key = match target {
            AgentTarget::Image(image_id) => (tenant_id.to_owned(), image_id.clone()),
            AgentTarget::Agent(agent_id) => self.agent_ids().get(agent_id).cloned()?,
        };
        if key.0 != tenant_id {
            return None;
        }
        self.agents().get(&key).and_then(|cell| cell.get().cloned())
    }

    /// Returns every started agent.
    fn live(&self) -> Vec<Arc<Agent>> {
        self.agents().values().filter_map(|cell| cell.get().cloned()).collect()
    }

    /// Removes `agent` when it is still its image's; returns whether it was.
    fn remove(&self, agent: &Arc<Agent>) -> bool {
        let key = (agent.tenant_id.clone(), agent.image.image_id.clone());
        {
            let mut agents = self.agents();
            let same = agents
                .get(&key)
                .and_then(|cell| cell.get())
                .is_some_and(|a| Arc::ptr_eq(a, agent));
            if !same {
                return false;
            }
            agents.remove(&key);
        }
        self.agent_ids().remove(&agent.agent_id);
        true
    }

    /// Returns the retired agent of an image whose turn still runs.
    fn retiring(&self, key: &AgentKey) -> Option<Arc<Agent>> {
        self.retiring_agents().get(key).cloned()
    }

    /// Keeps a retired agent whose turn still runs, until [`Self::release_retiring`].
    fn hold_retiring(&self, agent: &Arc<Agent>) {
        let key = (agent.tenant_id.clone(), agent.image.image_id.clone());
        self.retiring_agents().insert(key, Arc::clone(agent));
    }

    /// Lets go of a retired agent whose turn ended.
    fn release_retiring(&self, agent: &Arc<Agent>) {
        let key = (agent.tenant_id.clone(), agent.image.image_id.clone());
        let mut retiring = self.retiring_agents();
        if retiring.get(&key).is_some_and(|a| Arc::ptr_eq(a, agent)) {
            retiring.remove(&key);
        }
    }
}

impl AgentPool {
    /// Starts the agent of an image, or returns the running one (`reused`).
    #[instrument(name = "runtime.run_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn run_image(&self, ctx: &RequestContext, image_id: &str) -> Result<(AgentInfo, bool), RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        if ctx.owner_filter().is_some() {
            self.image_with_role(ctx, image_id, Some(Role::Use)).await?;
        }
        let (agent, reused) = self.ensure_agent(ctx, image_id).await?;
        Ok((agent.info(), reused))
    }

    pub(super) async fn ensure_agent(
        &self,
        ctx: &RequestContext,
        image_id: &str,
    ) -> Result<(Arc<Agent>, bool), RuntimeError> {
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        let key = (ctx.tenant_id.clone(), image_id.to_owned());
        let cell = self.inner.registry.cell(&key);
        let hydrated_here = AtomicBool::new(false);
        let result = cell
            .get_or_try_init(|| {
                hydrated_here.store(true, Ordering::Relaxed);
                self.hydrate(ctx, image_id, key.clone())
            })
            .await;
        match result {
            Ok(agent) => {
                let reused = !hydrated_here.load(Ordering::Relaxed);
                if reused && ctx.owner_filter().is_some() {
                    // A member may use a running agent only if they may see its
                    // image; the session service answers exactly as for a missing one.
                    self.sessions().get_image(ctx, image_id).await?;
                }
                Ok((Arc::clone(agent), reused))
            }
            Err(err) => {
                let removed = self.inner.registry.forget_unstarted(&key, &cell);
                if removed {
                    self.inner.placement.release(&key.0, &key.1).await;
                }
                Err(err)
            }
        }
    }

    /// Loads an image and its history and makes it a live agent. With
    /// replicas, this one claims the image first: an image another live
    /// replica holds is `Elsewhere`, and a turn a dead holder left is ended
    /// (`RUNTIME_LOST`). A history that ends in a turn nobody ended (the
    /// process running it crashed) gets its record: `TURN_LOST`.
    pub(super) async fn hydrate(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        key: AgentKey,
    ) -> Result<Arc<Agent>, RuntimeError> {
        if let Some(dead) = self.inner.placement.claim(&ctx.tenant_id, image_id).await? {
            self.end_turn_of_dead_holder(&dead, &ctx.tenant_id, image_id).await?;
        }
        self.recovered().await;
        let image = self.sessions().get_image(ctx, image_id).await?;
        lifecycle::check_runnable(&image)?;
        let plan = crate::plan::plan(&self.inner.resources, ctx, &image).await?;
        // A turn of the image's previous agent, interrupted when it left the
        // pool, stores what it had before the history is read.
        let previous = self.inner.registry.retiring(&key);
        let settled = match previous {
            Some(previous) => tokio::time::timeout(RETIRED_TURN_WAIT, previous.stopped())
                .await
                .is_ok(),
            None => true,
        };
        // What waits in the outbox for the session is stored first, so the
        // history read holds it, in its order.
        self.inner
            .ports
            .outbox
            .settle_before_loading(&ctx.tenant_id, &image.session_id)
            .await?;
        // What the model reads: from the latest compaction on, so a long
        // conversation loads what fits its window, not its whole history.
        let (compaction, mut history) = self.sessions().list_context(ctx, &image.session_id).await?;
        let lost = match cut_turn(&history) {
            Some(user_message_id) if settled => {
                let user_message_id = user_message_id.to_owned();
                self.record_cut_turn(&ctx.tenant_id, &image.session_id, &user_message_id)
                    .await
            }
            _ => None,
        };
        if let Some(message) = &lost {
            history.push(message.clone());
        }
        let workspace = self.workspace(&ctx.tenant_id, image_id);
        let tools = Toolbox::new(
            (&ctx.tenant_id, image_id),
            &plan.tools,
            &plan.mcp_servers,
            plan.sandbox.as_ref(),
            workspace,
            &self.inner.tools,
        )?
        .map(Arc::new);
        let agent_id = new_id("agent");
        let hub = self.inner.hubs.open(&image.session_id).await;
        let messages = history.len();
        let agent = Arc::new(Agent::new(
            agent_id.clone(),
            ctx.tenant_id.clone(),
            image,
            plan,
            tools,
            hub,
            context_to_llm(
                compaction.as_ref().map(|compaction| compaction.summary.as_str()),
                &history,
            ),
        ));
        self.inner.registry.name(agent_id.clone(), key);
        metrics::gauge!("avm_runtime_active_agents").increment(1.0);
        if let Some(message) = &lost {
            agent.emit_message(message);
        }
        agent.emit(data::AgentRegistered {
            container_id: agent.image.container_id.clone(),
            agent_id: agent_id.clone(),
            definition_name: agent.image.name.clone(),
            registered_at: agent.started_at_ms,
        });
        tracing::info!(
            image_id = %agent.image.image_id,
            agent_id = %agent_id,
            messages,
            resources = ?agent.plan.resources,
            "agent started"
        );
        Ok(agent)
    }

    pub(super) fn lookup(&self, tenant_id: &str, target: &AgentTarget) -> Option<Arc<Agent>> {
        self.inner.registry.get(tenant_id, target)
    }

    pub(super) fn live_agents(&self) -> Vec<Arc<Agent>> {
        self.inner.registry.live()
    }

    pub(super) fn retire_container(&self, tenant_id: &str, container_id: &str) -> u32 {
        let doomed: Vec<Arc<Agent>> = self
            .live_agents()
            .into_iter()
            .filter(|agent| agent.tenant_id == tenant_id && agent.image.container_id == container_id)
            .collect();
        for agent in &doomed {
            self.retire(agent, "destroyed");
        }
        u32::try_from(doomed.len()).unwrap_or(u32::MAX)
    }

    /// Removes an agent from the pool, interrupting its turn.
    pub(super) fn retire(&self, agent: &Arc<Agent>, why: &'static str) {
        agent.retire();
        if !self.inner.registry.remove(agent) {
            return;
        }
        if agent.is_running() {
            self.inner.registry.hold_retiring(agent);
            let (pool, agent) = (self.clone(), Arc::clone(agent));
            tokio::spawn(async move {
                agent.stopped().await;
                pool.inner.registry.release_retiring(&agent);
            });
        }
        metrics::gauge!("avm_runtime_active_agents").decrement(1.0);
        agent.emit(data::AgentUnregistered {
            container_id: agent.image.container_id.clone(),
            agent_id: agent.agent_id.clone(),
        });
        self.inner.placement.release_when_stopped(agent);
        tracing::info!(agent_id = %agent.agent_id, image_id = %agent.image.image_id, why, "agent removed");
    }

    /// Drops agents idle longer than the configured timeout, retained events
    /// past their period, and hubs nobody uses.
    pub fn reap_idle(&self) -> usize {
        let timeout = self.inner.config.agent_idle_timeout;
        let idle: Vec<Arc<Agent>> = self
            .live_agents()
            .into_iter()
            .filter(|agent| agent.idle_for(timeout))
            .collect();
        let retired = idle.len();
        for agent in idle {
            self.retire(&agent, "idle");
        }
        let period = i64::try_from(self.inner.config.event_retention_period.as_millis()).unwrap_or(i64::MAX);
        self.inner.hubs.trim(avm_common::now_ms().saturating_sub(period));
        // The retired agents let go of their hubs above (unless a turn of
        // theirs is still ending).
        self.inner.hubs.prune();
        let hubs = &self.inner.hubs;
        self.inner
            .group_feeds
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .retain(|group_id, _| hubs.get(group_id).is_some());
        retired
    }
}

/// How long a new agent waits for its predecessor's interrupted turn to
/// store what it had; past it, the history is read without it.
const RETIRED_TURN_WAIT: Duration = Duration::from_secs(10);
