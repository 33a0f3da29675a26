//! The agent pool: at most one agent per image, started on demand, dropped
//! when idle, each running one turn at a time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use avm_common::auth::{Scopes, ServiceIdentity};
use avm_common::ids::new_id;
use avm_common::{ApiError, Code, RequestContext};
use avm_proto::session::v1 as pb;
use serde_json::{Value, json};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, instrument};

use crate::config::RuntimeConfig;
use crate::context::{history_to_llm, parse_content, push_message};
use crate::hub::{EventContext, Hubs, SessionHub, Subscription};
use crate::llm::{LlmMessage, LlmRole};
use crate::metering::Metering;
use crate::resources::{AgentPlan, ResourceClient};
use crate::session_client::{ImageInfo, SessionClient};
use crate::settings::LlmSettings;
use crate::turn;

/// What callers learn about an agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentInfo {
    pub agent_id: String,
    pub container_id: String,
    pub image_id: String,
    pub session_id: String,
    pub running: bool,
    pub started_at_ms: i64,
}

/// The answer to an accepted message: who runs it and the turn's events.
pub struct SendAccepted {
    pub agent: AgentInfo,
    pub user_message_id: String,
    /// Cursor of the last event before the turn's stream events.
    pub cursor: u64,
    /// The turn's events; the subscription was opened before the turn started.
    pub events: Subscription,
}

/// Names an agent either by its image or by its own id.
#[derive(Clone, Debug)]
pub enum AgentTarget {
    Image(String),
    Agent(String),
}

/// A running, in-memory instance of an image.
pub(crate) struct Agent {
    pub(crate) agent_id: String,
    pub(crate) tenant_id: String,
    pub(crate) image: ImageInfo,
    /// What its image's resource references resolved to when it started.
    pub(crate) plan: AgentPlan,
    pub(crate) started_at_ms: i64,
    pub(crate) context: Arc<EventContext>,
    pub(crate) hub: Arc<SessionHub>,
    state: Mutex<AgentState>,
}

struct AgentState {
    history: Vec<LlmMessage>,
    turn: Option<CancellationToken>,
    last_active: Instant,
    /// Set once the agent left the pool; a send that raced with it starts over.
    retired: bool,
}

impl Agent {
    fn lock(&self) -> MutexGuard<'_, AgentState> {
        self.state.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    fn info(&self) -> AgentInfo {
        AgentInfo {
            agent_id: self.agent_id.clone(),
            container_id: self.image.container_id.clone(),
            image_id: self.image.image_id.clone(),
            session_id: self.image.session_id.clone(),
            running: self.lock().turn.is_some(),
            started_at_ms: self.started_at_ms,
        }
    }

    /// Publishes an event of this agent's session.
    pub(crate) fn emit(&self, kind: &'static str, data: &Value) -> u64 {
        self.hub.publish(kind, &self.context, data).cursor
    }

    /// Records the end of a turn and what it added to the conversation.
    pub(crate) fn finish_turn(&self, reply: Option<String>) {
        let mut state = self.lock();
        if let Some(text) = reply.filter(|text| !text.is_empty()) {
            push_message(
                &mut state.history,
                LlmRole::Assistant,
                vec![crate::llm::LlmContent::Text(text)],
            );
        }
        state.turn = None;
        state.last_active = Instant::now();
    }
}

type AgentKey = (String, String);

pub(crate) struct PoolInner {
    pub(crate) config: RuntimeConfig,
    /// The LLM settings of each tenant, from the config service.
    pub(crate) llm: LlmSettings,
    /// Usage records and budget checks, with the observability service.
    pub(crate) metering: Metering,
    pub(crate) sessions: SessionClient,
    pub(crate) resources: ResourceClient,
    /// The runtime's own credential, for work that outlives the caller's request.
    pub(crate) identity: ServiceIdentity,
    hubs: Hubs,
    /// Agents by (tenant, image id); the cell makes concurrent starts share one hydration.
    agents: Mutex<HashMap<AgentKey, Arc<OnceCell<Arc<Agent>>>>>,
    /// Agent id to its key, for calls that name the agent.
    agent_ids: Mutex<HashMap<String, AgentKey>>,
}

/// The agent pool of one runtime process.
#[derive(Clone)]
pub struct AgentPool {
    inner: Arc<PoolInner>,
}

impl AgentPool {
    /// Returns an empty pool.
    pub fn new(
        config: RuntimeConfig,
        llm: LlmSettings,
        metering: Metering,
        sessions: SessionClient,
        resources: ResourceClient,
        identity: ServiceIdentity,
    ) -> Self {
        let hubs = Hubs::new(config.event_retention, config.subscriber_queue);
        Self {
            inner: Arc::new(PoolInner {
                config,
                llm,
                metering,
                sessions,
                resources,
                identity,
                hubs,
                agents: Mutex::new(HashMap::new()),
                agent_ids: Mutex::new(HashMap::new()),
            }),
        }
    }

    fn agents(&self) -> MutexGuard<'_, HashMap<AgentKey, Arc<OnceCell<Arc<Agent>>>>> {
        self.inner.agents.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    fn agent_ids(&self) -> MutexGuard<'_, HashMap<String, AgentKey>> {
        self.inner.agent_ids.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Starts the agent of an image, or returns the running one (`reused`).
    #[instrument(name = "runtime.run_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn run_image(&self, ctx: &RequestContext, image_id: &str) -> Result<(AgentInfo, bool), ApiError> {
        ctx.require(Scopes::WRITE)?;
        let (agent, reused) = self.ensure_agent(ctx, image_id).await?;
        Ok((agent.info(), reused))
    }

    async fn ensure_agent(&self, ctx: &RequestContext, image_id: &str) -> Result<(Arc<Agent>, bool), ApiError> {
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        let key = (ctx.tenant_id.clone(), image_id.to_owned());
        let cell = Arc::clone(self.agents().entry(key.clone()).or_default());
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
                    self.inner.sessions.get_image(ctx, image_id).await?;
                }
                Ok((Arc::clone(agent), reused))
            }
            Err(err) => {
                let mut agents = self.agents();
                if agents
                    .get(&key)
                    .is_some_and(|c| Arc::ptr_eq(c, &cell) && !c.initialized())
                {
                    agents.remove(&key);
                }
                Err(err)
            }
        }
    }

    /// Loads an image and its history and makes it a live agent.
    async fn hydrate(&self, ctx: &RequestContext, image_id: &str, key: AgentKey) -> Result<Arc<Agent>, ApiError> {
        let image = self.inner.sessions.get_image(ctx, image_id).await?;
        let plan = self.inner.resources.plan(ctx, &image).await?;
        let history = self.inner.sessions.list_messages(ctx, &image.session_id).await?;
        let agent_id = new_id("agent");
        let context = Arc::new(EventContext {
            container_id: image.container_id.clone(),
            image_id: image.image_id.clone(),
            agent_id: agent_id.clone(),
            session_id: image.session_id.clone(),
        });
        let hub = self.inner.hubs.get_or_create(&image.session_id);
        let agent = Arc::new(Agent {
            agent_id: agent_id.clone(),
            tenant_id: ctx.tenant_id.clone(),
            started_at_ms: avm_common::now_ms(),
            context,
            hub,
            plan,
            state: Mutex::new(AgentState {
                history: history_to_llm(&history),
                turn: None,
                last_active: Instant::now(),
                retired: false,
            }),
            image,
        });
        self.agent_ids().insert(agent_id.clone(), key);
        metrics::gauge!("avm_runtime_active_agents").increment(1.0);
        agent.emit(
            "agent_registered",
            &json!({
                "containerId": agent.image.container_id,
                "agentId": agent_id,
                "definitionName": agent.image.name,
                "registeredAt": agent.started_at_ms,
            }),
        );
        tracing::info!(
            image_id = %agent.image.image_id,
            agent_id = %agent_id,
            messages = history.len(),
            resources = ?agent.plan.resources,
            "agent started"
        );
        Ok(agent)
    }

    /// Persists a user message and starts a turn; one turn at a time per agent.
    #[instrument(name = "runtime.send_message", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn send_message(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        content_json: &str,
    ) -> Result<SendAccepted, ApiError> {
        ctx.require(Scopes::WRITE)?;
        let content = parse_content(content_json)?;
        let llm = self.inner.llm.for_tenant(ctx).await?;
        let (agent, cancel) = self.reserve_turn(ctx, image_id).await?;
        let user_message_id = new_id("msg");
        let message = pb::Message {
            message_id: user_message_id.clone(),
            session_id: agent.image.session_id.clone(),
            created_at_ms: avm_common::now_ms(),
            seq: 0,
            body: Some(pb::message::Body::User(pb::UserMessage {
                content_json: content_json.to_owned(),
            })),
        };
        let stored = match self.inner.sessions.append(ctx, message).await {
            Ok(stored) => stored,
            Err(err) => {
                agent.finish_turn(None);
                return Err(err);
            }
        };
        let cursor = agent.emit(
            "message_persisted",
            &json!({"sessionId": stored.session_id, "messageId": stored.message_id, "savedAt": stored.created_at_ms}),
        );
        let request = {
            let mut state = agent.lock();
            push_message(&mut state.history, LlmRole::User, content);
            turn::request(&llm.config, &agent.plan, state.history.clone())
        };
        let events = agent.hub.subscribe(Some(cursor));
        tracing::info!(image_id = %agent.image.image_id, message_id = %user_message_id, "turn started");
        // The turn outlives this call; it stays in the request's trace.
        tokio::spawn(
            turn::run(
                Arc::clone(&self.inner),
                Arc::clone(&agent),
                ctx.clone(),
                llm,
                request,
                cancel,
            )
            .instrument(tracing::Span::current()),
        );
        Ok(SendAccepted {
            agent: agent.info(),
            user_message_id,
            cursor,
            events,
        })
    }

    /// Finds or starts the agent and claims its turn slot.
    async fn reserve_turn(
        &self,
        ctx: &RequestContext,
        image_id: &str,
    ) -> Result<(Arc<Agent>, CancellationToken), ApiError> {
        // An agent retired by the idle reaper between lookup and reservation is
        // replaced by a fresh one; twice in a row would be a bug, not a race.
        for _ in 0..2 {
            let (agent, _) = self.ensure_agent(ctx, image_id).await?;
            let mut state = agent.lock();
            if state.retired {
                continue;
            }
            if state.turn.is_some() {
                return Err(ApiError::precondition(
                    "AGENT_BUSY",
                    "the agent is still answering the previous message; wait for conversation_end or interrupt it",
                ));
            }
            let cancel = CancellationToken::new();
            state.turn = Some(cancel.clone());
            state.last_active = Instant::now();
            drop(state);
            return Ok((agent, cancel));
        }
        Err(ApiError::unavailable(
            "AGENT_RESTARTING",
            "the agent is restarting; send the message again",
        ))
    }

    fn lookup(&self, ctx: &RequestContext, target: &AgentTarget) -> Option<Arc<Agent>> {
        let key = match target {
            AgentTarget::Image(image_id) => (ctx.tenant_id.clone(), image_id.clone()),
            AgentTarget::Agent(agent_id) => self.agent_ids().get(agent_id).cloned()?,
        };
        if key.0 != ctx.tenant_id {
            return None;
        }
        self.agents().get(&key).and_then(|cell| cell.get().cloned())
    }

    /// Returns the caller's agent named by `target`, or AGENT_NOT_FOUND when
    /// there is none or the caller may not see its container.
    async fn find(&self, ctx: &RequestContext, target: &AgentTarget) -> Result<Arc<Agent>, ApiError> {
        let agent = self.lookup(ctx, target).ok_or_else(|| agent_not_found(target))?;
        match self.authorize(ctx, &agent.image.container_id).await {
            Ok(()) => Ok(agent),
            Err(err) if err.code == Code::NotFound => Err(agent_not_found(target)),
            Err(err) => Err(err),
        }
    }

    /// Fails unless the caller may see the container: admins and services see
    /// the whole tenant; members ask the session service.
    async fn authorize(&self, ctx: &RequestContext, container_id: &str) -> Result<(), ApiError> {
        if ctx.owner_filter().is_none() {
            return Ok(());
        }
        self.inner.sessions.check_container(ctx, container_id).await
    }

    /// Interrupts the running turn; `false` when the agent was idle.
    #[instrument(name = "runtime.interrupt_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn interrupt(&self, ctx: &RequestContext, target: &AgentTarget) -> Result<(AgentInfo, bool), ApiError> {
        ctx.require(Scopes::WRITE)?;
        let agent = self.find(ctx, target).await?;
        let interrupted = match &agent.lock().turn {
            Some(cancel) => {
                cancel.cancel();
                true
            }
            None => false,
        };
        tracing::info!(agent_id = %agent.agent_id, interrupted, "interrupt requested");
        Ok((agent.info(), interrupted))
    }

    /// Returns one agent of the caller.
    #[instrument(name = "runtime.get_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn get_agent(&self, ctx: &RequestContext, agent_id: &str) -> Result<AgentInfo, ApiError> {
        ctx.require(Scopes::READ)?;
        let target = AgentTarget::Agent(agent_id.to_owned());
        Ok(self.find(ctx, &target).await?.info())
    }

    /// Lists the caller's agents, optionally of one container, oldest first.
    #[instrument(name = "runtime.list_agents", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_agents(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
    ) -> Result<Vec<AgentInfo>, ApiError> {
        ctx.require(Scopes::READ)?;
        let visible: Option<std::collections::HashSet<String>> = match ctx.owner_filter() {
            None => None,
            Some(_) => Some(self.inner.sessions.visible_containers(ctx).await?.into_iter().collect()),
        };
        let mut agents: Vec<AgentInfo> = self
            .live_agents()
            .into_iter()
            .filter(|agent| agent.tenant_id == ctx.tenant_id)
            .filter(|agent| container_id.is_none_or(|id| agent.image.container_id == id))
            .filter(|agent| {
                visible
                    .as_ref()
                    .is_none_or(|ids| ids.contains(&agent.image.container_id))
            })
            .map(|agent| agent.info())
            .collect();
        agents.sort_by(|a, b| {
            a.started_at_ms
                .cmp(&b.started_at_ms)
                .then_with(|| a.agent_id.cmp(&b.agent_id))
        });
        Ok(agents)
    }

    fn live_agents(&self) -> Vec<Arc<Agent>> {
        self.agents().values().filter_map(|cell| cell.get().cloned()).collect()
    }

    /// Stops the agent of an image; `false` when none was running. An image
    /// that does not exist is NOT_FOUND.
    #[instrument(name = "runtime.stop_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn stop_image(&self, ctx: &RequestContext, image_id: &str) -> Result<bool, ApiError> {
        ctx.require(Scopes::WRITE)?;
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        // The session service decides whether the caller may see the image.
        self.inner.sessions.get_image(ctx, image_id).await?;
        match self.lookup(ctx, &AgentTarget::Image(image_id.to_owned())) {
            Some(agent) => {
                self.retire(&agent, "stopped");
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Stops and forgets one agent.
    #[instrument(name = "runtime.destroy_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn destroy_agent(&self, ctx: &RequestContext, agent_id: &str) -> Result<(), ApiError> {
        ctx.require(Scopes::WRITE)?;
        let target = AgentTarget::Agent(agent_id.to_owned());
        let agent = self.find(ctx, &target).await?;
        self.retire(&agent, "destroyed");
        Ok(())
    }

    /// Stops every agent of a container; returns how many.
    #[instrument(name = "runtime.destroy_all_agents", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn destroy_all(&self, ctx: &RequestContext, container_id: &str) -> Result<u32, ApiError> {
        ctx.require(Scopes::WRITE)?;
        self.authorize(ctx, container_id).await?;
        let doomed: Vec<Arc<Agent>> = self
            .live_agents()
            .into_iter()
            .filter(|agent| agent.tenant_id == ctx.tenant_id && agent.image.container_id == container_id)
            .collect();
        for agent in &doomed {
            self.retire(agent, "destroyed");
        }
        Ok(u32::try_from(doomed.len()).unwrap_or(u32::MAX))
    }

    /// Removes an agent from the pool, interrupting its turn.
    fn retire(&self, agent: &Arc<Agent>, why: &'static str) {
        {
            let mut state = agent.lock();
            state.retired = true;
            if let Some(cancel) = &state.turn {
                cancel.cancel();
            }
        }
        let key = (agent.tenant_id.clone(), agent.image.image_id.clone());
        {
            let mut agents = self.agents();
            let same = agents
                .get(&key)
                .and_then(|cell| cell.get())
                .is_some_and(|a| Arc::ptr_eq(a, agent));
            if same {
                agents.remove(&key);
            }
        }
        self.agent_ids().remove(&agent.agent_id);
        metrics::gauge!("avm_runtime_active_agents").decrement(1.0);
        agent.emit(
            "agent_unregistered",
            &json!({"containerId": agent.image.container_id, "agentId": agent.agent_id}),
        );
        tracing::info!(agent_id = %agent.agent_id, image_id = %agent.image.image_id, why, "agent removed");
    }

    /// Subscribes to a session's events, replaying retained ones after `after_cursor`.
    #[instrument(name = "runtime.subscribe_events", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn subscribe(
        &self,
        ctx: &RequestContext,
        session_id: &str,
        after_cursor: Option<&str>,
    ) -> Result<Subscription, ApiError> {
        ctx.require(Scopes::READ)?;
        let after = after_cursor
            .map(|cursor| {
                cursor
                    .parse::<u64>()
                    .map_err(|_| ApiError::invalid("INVALID_CURSOR", format!("invalid cursor {cursor:?}")))
            })
            .transpose()?;
        validate_id("SESSION_NOT_FOUND", "session", session_id)?;
        // Ownership: the session must be one the caller may see.
        self.inner.sessions.get_session(ctx, session_id).await?;
        Ok(self.inner.hubs.get_or_create(session_id).subscribe(after))
    }

    /// Drops agents idle longer than the configured timeout, retained events
    /// past their period, and hubs nobody uses.
    pub fn reap_idle(&self) -> usize {
        let timeout = self.inner.config.agent_idle_timeout;
        let idle: Vec<Arc<Agent>> = self
            .live_agents()
            .into_iter()
            .filter(|agent| {
                let state = agent.lock();
                state.turn.is_none() && state.last_active.elapsed() >= timeout
            })
            .collect();
        for agent in &idle {
            self.retire(agent, "idle");
        }
        let period = i64::try_from(self.inner.config.event_retention_period.as_millis()).unwrap_or(i64::MAX);
        self.inner.hubs.trim(avm_common::now_ms().saturating_sub(period));
        let active: std::collections::HashSet<String> = self
            .live_agents()
            .iter()
            .map(|agent| agent.image.session_id.clone())
            .collect();
        self.inner.hubs.prune(&|session_id| active.contains(session_id));
        idle.len()
    }

    /// Follows the LLM settings and runs the idle reaper until `shutdown`;
    /// returns the reaper's task.
    pub fn spawn_background(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        self.inner.llm.spawn_watch(shutdown.clone());
        self.inner.metering.spawn(shutdown.clone());
        let pool = self.clone();
        let config = &pool.inner.config;
        let period = (config.agent_idle_timeout.min(config.event_retention_period) / 2)
            .clamp(Duration::from_millis(50), Duration::from_secs(30));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    _ = tick.tick() => {
                        pool.reap_idle();
                    }
                }
            }
        })
    }

    /// Interrupts every running turn (used at shutdown so partial replies are stored).
    pub fn interrupt_all(&self) {
        for agent in self.live_agents() {
            if let Some(cancel) = &agent.lock().turn {
                cancel.cancel();
            }
        }
    }

    /// Waits, at most `limit`, until the usage of every finished call was
    /// reported (at shutdown, before the services it reports to stop).
    pub async fn flush_usage(&self, limit: Duration) -> bool {
        self.inner.metering.flush(limit).await
    }

    /// Returns whether any turn is still running.
    pub fn any_running(&self) -> bool {
        self.live_agents().iter().any(|agent| agent.lock().turn.is_some())
    }
}

fn agent_not_found(target: &AgentTarget) -> ApiError {
    match target {
        AgentTarget::Image(id) => ApiError::not_found("AGENT_NOT_FOUND", format!("no running agent for image {id}")),
        AgentTarget::Agent(id) => ApiError::not_found("AGENT_NOT_FOUND", format!("agent {id} not found")),
    }
}

/// Rejects ids no store could hold, answering like a missing object.
fn validate_id(reason: &'static str, what: &str, id: &str) -> Result<(), ApiError> {
    if id.is_empty() {
        return Err(ApiError::invalid("MISSING_ID", format!("{what} id is required")));
    }
    if id.len() > 128 {
        return Err(ApiError::not_found(reason, format!("{what} not found")));
    }
    Ok(())
}
