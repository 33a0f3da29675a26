//! The agent pool: at most one agent per image, started on demand, dropped
//! when idle or when its image is deleted, each running one turn at a time.

use avm_common::backoff::Backoff;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use avm_common::auth::{Scopes, ServiceIdentity};
use avm_common::ids::new_id;
use avm_common::{Code, RequestContext};
use futures::StreamExt;
use serde_json::json;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, instrument};

use crate::agent::{Agent, AgentInfo};
use crate::config::RuntimeConfig;
use crate::context::history_to_llm;
use crate::error::{AgentTarget, RuntimeError};
use crate::event::EventContext;
use crate::hub::{Hubs, SessionHub, Subscription};
use crate::message::{Content, Message, MessageBody};
use crate::metering::Metering;
use crate::outbox::Outbox;
use crate::peers::{Deletion, ImageChanges, ImageInfo, Resources, Role, Sessions};
use crate::replicas::{Placement, Replicas, TurnRecord};
use crate::settings::LlmSettings;
use crate::tools::{Fetcher, ToolContext, Toolbox, Workspace, access};
use crate::turn::{self, TurnLimits, TurnPorts};
use avm_sandbox::FileSystem;

mod children;
mod gate;
mod groups;
mod lifecycle;
mod lost;
mod wakes;

use gate::RunGate;
pub use groups::RemoteWake;

/// The answer to an accepted message: who runs it and the turn's events.
pub struct SendAccepted {
    pub agent: AgentInfo,
    pub user_message_id: String,
    /// Cursor of the `message_accepted` event, the last before the turn's own events.
    pub cursor: u64,
    /// The turn's events; the subscription was opened before the turn started.
    pub events: Subscription,
}

/// An image with its running agent, if any.
pub struct ImageView {
    pub image: ImageInfo,
    pub agent: Option<AgentInfo>,
}

type AgentKey = (String, String);

struct PoolInner {
    config: RuntimeConfig,
    /// The LLM settings of each tenant, from the config service.
    llm: LlmSettings,
    /// What a turn needs: sessions, metering, the runtime's own credential.
    ports: TurnPorts,
    resources: Resources,
    hubs: Arc<Hubs>,
    /// The other runtime replicas and the leases of this one, when replicated.
    replicas: Option<Replicas>,
    /// What every agent's tools run with (`fetch_url`'s client among it).
    tools: ToolContext,
    /// Agents by (tenant, image id); the cell makes concurrent starts share one hydration.
    agents: Mutex<HashMap<AgentKey, Arc<OnceCell<Arc<Agent>>>>>,
    /// Agent id to its key, for calls that name the agent.
    agent_ids: Mutex<HashMap<String, AgentKey>>,
    /// Agents that left the pool while a turn of theirs still ran, until it
    /// ends: the next agent of the image reads its history once that turn
    /// stored what it had, and never takes it for a turn cut by a crash.
    retiring: Mutex<HashMap<AgentKey, Arc<Agent>>>,
    /// Set when a runtime without replicas drains: no new turn starts.
    draining: AtomicBool,
    /// With replicas: how a wake reaches the replica holding the agent.
    remote_wake: std::sync::OnceLock<RemoteWake>,
    /// The seq of the last `group_message` event published, per group with a hub.
    group_feeds: Mutex<HashMap<String, Arc<tokio::sync::Mutex<u64>>>>,
    /// Admits agents' group turns within the replica's and each tenant's limits.
    gate: RunGate,
    /// When this process's pool was made: older open turns were another's.
    started_at_ms: i64,
    /// Set once the turns the previous process left open are ended (at
    /// once with replicas, whose survivors end a dead one's turns).
    recovered: tokio::sync::watch::Sender<bool>,
}

/// The agent pool of one runtime process; cheap to clone.
#[derive(Clone)]
pub struct AgentPool {
    inner: Arc<PoolInner>,
}

impl AgentPool {
    /// Returns an empty pool; settings it cannot use (an allow-list entry
    /// that names nothing) are refused.
    pub fn new(
        config: RuntimeConfig,
        llm: LlmSettings,
        metering: Metering,
        sessions: Sessions,
        resources: Resources,
        identity: ServiceIdentity,
        replicas: Option<Replicas>,
    ) -> Result<Self, RuntimeError> {
        avm_sandbox::isolation::check_config(&config.sandbox)
            .map_err(|why| RuntimeError::invalid("INVALID_CONFIG", why))?;
        let tools = ToolContext {
            limits: config.sandbox.clone(),
            fetcher: Fetcher::new(&config.fetch)?,
            mcp: config.mcp.clone(),
            credentials: Arc::new(crate::peers::StoredCredentials::new(llm.configs(), identity.clone())),
            store: crate::tools::disk::open(&config)?,
            sandboxes: match config.sandbox.provider {
                avm_sandbox::Provider::Local => None,
                avm_sandbox::Provider::Process | avm_sandbox::Provider::Pool | avm_sandbox::Provider::Kubernetes => {
                    Some(Arc::new(
                        crate::tools::Launcher::new(&config.sandbox, &config.fetch.allow, &workspace_root(&config))
                            .map_err(|why| RuntimeError::invalid("INVALID_CONFIG", why))?,
                    ))
                }
            },
        };
        let hubs = Arc::new(Hubs::new(
            config.event_retention,
            crate::hub::QueueLimits {
                capacity: config.subscriber_queue,
                stall_timeout: config.subscriber_stall_timeout,
            },
            replicas.as_ref().map(|replicas| replicas.fanout().clone()),
        ));
        let limits = TurnLimits {
            max_steps: config.max_tool_steps.max(1),
            tool_concurrency: config.tool_concurrency.max(1),
        };
        let gate = RunGate::new(config.max_running_agents, config.max_running_agents_per_tenant);
        let outbox = Outbox::new(
            sessions.clone(),
            identity.clone(),
            replicas.as_ref(),
            config.outbox_max_bytes,
        );
        let (recovered, _) = tokio::sync::watch::channel(replicas.is_some());
        let pool = Self {
            inner: Arc::new(PoolInner {
                config,
                llm,
                ports: TurnPorts {
                    sessions,
                    outbox,
                    metering,
                    identity,
                    limits,
                    spawner: Arc::default(),
                },
                resources,
                hubs,
                replicas,
                tools,
                agents: Mutex::new(HashMap::new()),
                agent_ids: Mutex::new(HashMap::new()),
                retiring: Mutex::new(HashMap::new()),
                draining: AtomicBool::new(false),
                remote_wake: std::sync::OnceLock::new(),
                group_feeds: Mutex::new(HashMap::new()),
                gate,
                started_at_ms: avm_common::now_ms(),
                recovered,
            }),
        };
        pool.serve_spawns();
        Ok(pool)
    }

    fn agents(&self) -> MutexGuard<'_, HashMap<AgentKey, Arc<OnceCell<Arc<Agent>>>>> {
        self.inner.agents.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    fn agent_ids(&self) -> MutexGuard<'_, HashMap<String, AgentKey>> {
        self.inner.agent_ids.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    fn retiring(&self) -> MutexGuard<'_, HashMap<AgentKey, Arc<Agent>>> {
        self.inner.retiring.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    fn sessions(&self) -> &Sessions {
        &self.inner.ports.sessions
    }

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

    async fn ensure_agent(&self, ctx: &RequestContext, image_id: &str) -> Result<(Arc<Agent>, bool), RuntimeError> {
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
                    self.sessions().get_image(ctx, image_id).await?;
                }
                Ok((Arc::clone(agent), reused))
            }
            Err(err) => {
                let removed = {
                    let mut agents = self.agents();
                    let unused = agents
                        .get(&key)
                        .is_some_and(|c| Arc::ptr_eq(c, &cell) && !c.initialized());
                    unused && agents.remove(&key).is_some()
                };
                if removed && let Some(replicas) = &self.inner.replicas {
                    replicas.release(&key.0, &key.1).await;
                }
                Err(err)
            }
        }
    }

    /// Returns an image's workspace (not created until a tool needs it).
    fn workspace(&self, tenant_id: &str, image_id: &str) -> Workspace {
        let dir = workspace_root(&self.inner.config).join(tenant_id).join(image_id);
        match &self.inner.tools.store {
            Some(store) => store.workspace(tenant_id, image_id, dir),
            None => Workspace::new(dir),
        }
    }

    /// Loads an image and its history and makes it a live agent. With
    /// replicas, this one claims the image first: an image another live
    /// replica holds is `Elsewhere`, and a turn a dead holder left is ended
    /// (`RUNTIME_LOST`). A history that ends in a turn nobody ended (the
    /// process running it crashed) gets its record: `TURN_LOST`.
    async fn hydrate(&self, ctx: &RequestContext, image_id: &str, key: AgentKey) -> Result<Arc<Agent>, RuntimeError> {
        if let Some(replicas) = &self.inner.replicas {
            if replicas.draining() && !replicas.holds(&ctx.tenant_id, image_id) {
                let others = replicas.others().await?;
                return Err(others
                    .into_iter()
                    .next()
                    .map_or(RuntimeError::Draining, RuntimeError::Elsewhere));
            }
            match replicas.claim(&ctx.tenant_id, image_id).await? {
                Placement::Elsewhere(addr) => return Err(RuntimeError::Elsewhere(addr)),
                Placement::Here { lost_from: None } => {}
                Placement::Here { lost_from: Some(dead) } => {
                    let field = format!("{}/{image_id}", ctx.tenant_id);
                    if let Some((_, record)) = replicas
                        .lost_turns(&dead)
                        .await?
                        .into_iter()
                        .find(|(name, _)| *name == field)
                    {
                        // Undecided (a peer is down): the record stays for
                        // the heartbeat to end, and this start is refused.
                        let open = self.lost_turn_open(&record).await?;
                        if replicas.take_lost_turn(&dead, &field).await && open {
                            self.end_lost_turn(&dead, record).await;
                        }
                    }
                }
            }
        }
        self.recovered().await;
        let image = self.sessions().get_image(ctx, image_id).await?;
        lifecycle::check_runnable(&image)?;
        let plan = crate::plan::plan(&self.inner.resources, ctx, &image).await?;
        // A turn of the image's previous agent, interrupted when it left the
        // pool, stores what it had before the history is read.
        let previous = self.retiring().get(&key).cloned();
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
        let mut history = self.sessions().list_messages(ctx, &image.session_id).await?;
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
            history_to_llm(&history),
        ));
        self.agent_ids().insert(agent_id.clone(), key);
        metrics::gauge!("avm_runtime_active_agents").increment(1.0);
        if let Some(message) = &lost {
            agent.emit("error_message", &message.object());
        }
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
            messages,
            resources = ?agent.plan.resources,
            "agent started"
        );
        Ok(agent)
    }

    /// Persists a user message and starts a turn; one turn at a time per agent.
    ///
    /// The acceptance is published into the session's events (`message_accepted`,
    /// with the request's id) after `message_persisted` and before the turn's
    /// own events, so a subscriber learns of it in the order of the stream.
    #[instrument(name = "runtime.send_message", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn send_message(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        content: Content,
    ) -> Result<SendAccepted, RuntimeError> {
        Ok(self.start_turn(ctx, image_id, content, None).await?.0)
    }

    /// Does what [`Self::send_message`] says, for a message of `group` when
    /// one is named; the handle ends with the turn, with the text of its
    /// last reply when it completed.
    async fn start_turn(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        content: Content,
        group: Option<&str>,
    ) -> Result<(SendAccepted, tokio::task::JoinHandle<Option<String>>), RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        content.validate()?;
        let llm = self.inner.llm.for_tenant(ctx).await?;
        let agent = self.reserve_turn(ctx, image_id).await?;
        let cancel = agent.1;
        let agent = agent.0;
        // The previous turn's reply, kept while the session service was
        // away, is stored before the next message: never a turn on a history without it.
        let settled = self
            .inner
            .ports
            .outbox
            .settle(&ctx.tenant_id, &agent.image.session_id)
            .await;
        if let Err(err) = settled {
            agent.finish_turn(None, None);
            return Err(err);
        }
        let user_message_id = new_id("msg");
        let llm_content = content.to_llm();
        let message = Message {
            message_id: user_message_id.clone(),
            session_id: agent.image.session_id.clone(),
            // Stored with the caller's credential: the session service stamps
            // a user's message itself and refuses a time chosen for it.
            created_at_ms: 0,
            body: MessageBody::User(content),
        };
        let stored = match self.sessions().append(ctx, &message).await {
            Ok(stored) => stored,
            Err(err) => {
                agent.finish_turn(None, None);
                return Err(err);
            }
        };
        agent.emit(
            "message_persisted",
            &json!({"sessionId": stored.session_id, "messageId": stored.message_id, "savedAt": stored.created_at_ms}),
        );
        let cursor = agent.emit(
            "message_accepted",
            &json!({
                "requestId": ctx.request_id,
                "imageId": agent.image.image_id,
                "agentId": agent.agent_id,
                "userMessageId": user_message_id,
            }),
        );
        let history = agent.add_user(llm_content);
        let request = turn::request(&llm.config, &agent, history);
        let events = agent.hub.subscribe(Some(cursor));
        tracing::info!(image_id = %agent.image.image_id, message_id = %user_message_id, "turn started");
        let turn = turn::run(
            self.inner.ports.clone(),
            Arc::clone(&agent),
            ctx.clone(),
            llm,
            request,
            cancel,
        );
        let handle = match &self.inner.replicas {
            // The turn outlives this call; it stays in the request's trace.
            None => tokio::spawn(turn.instrument(tracing::Span::current())),
            Some(replicas) => {
                // Recorded, so a survivor ends it if this replica dies.
                replicas.turn_started(&TurnRecord {
                    tenant_id: agent.tenant_id.clone(),
                    container_id: agent.image.container_id.clone(),
                    image_id: agent.image.image_id.clone(),
                    agent_id: agent.agent_id.clone(),
                    session_id: agent.image.session_id.clone(),
                    user_message_id: user_message_id.clone(),
                    group_id: group.unwrap_or_default().to_owned(),
                });
                let replicas = replicas.clone();
                let (tenant_id, image_id) = (agent.tenant_id.clone(), agent.image.image_id.clone());
                let recorded = async move {
                    let reply = turn.await;
                    replicas.turn_ended(&tenant_id, &image_id);
                    reply
                };
                tokio::spawn(recorded.instrument(tracing::Span::current()))
            }
        };
        let accepted = SendAccepted {
            agent: agent.info(),
            user_message_id,
            cursor,
            events,
        };
        Ok((accepted, handle))
    }

    /// Finds or starts the agent and claims its turn slot.
    async fn reserve_turn(
        &self,
        ctx: &RequestContext,
        image_id: &str,
    ) -> Result<(Arc<Agent>, CancellationToken), RuntimeError> {
        // A runtime alone has nobody to send the turn to while it drains.
        if self.inner.draining.load(Ordering::Relaxed) {
            return Err(RuntimeError::Draining);
        }
        // An agent retired by the idle reaper between lookup and reservation is
        // replaced by a fresh one; twice in a row would be a bug, not a race.
        for _ in 0..2 {
            let (agent, _) = self.ensure_agent(ctx, image_id).await?;
            match agent.begin_turn() {
                None => continue,
                Some(claimed) => return claimed.map(|cancel| (agent, cancel)),
            }
        }
        Err(RuntimeError::AgentRestarting)
    }

    fn lookup(&self, tenant_id: &str, target: &AgentTarget) -> Option<Arc<Agent>> {
        let key = match target {
            AgentTarget::Image(image_id) => (tenant_id.to_owned(), image_id.clone()),
            AgentTarget::Agent(agent_id) => self.agent_ids().get(agent_id).cloned()?,
        };
        if key.0 != tenant_id {
            return None;
        }
        self.agents().get(&key).and_then(|cell| cell.get().cloned())
    }

    /// Returns the caller's agent named by `target`, or AGENT_NOT_FOUND when
    /// there is none or the caller may not see its container.
    async fn find(
        &self,
        ctx: &RequestContext,
        target: &AgentTarget,
        need: Option<Role>,
    ) -> Result<Arc<Agent>, RuntimeError> {
        let not_found = || RuntimeError::AgentNotFound(target.clone());
        let agent = self.lookup(&ctx.tenant_id, target).ok_or_else(not_found)?;
        match self.authorize(ctx, &agent.image.container_id, need).await {
            Ok(()) => Ok(agent),
            Err(RuntimeError::Api(err)) if err.code == Code::NotFound => Err(not_found()),
            Err(err) => Err(err),
        }
    }

    /// Fails unless the caller may see the container and, with `need`, do
    /// what that role allows in it: admins and services may do everything in
    /// the tenant; members ask the session service (a share's role).
    async fn authorize(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        need: Option<Role>,
    ) -> Result<(), RuntimeError> {
        if ctx.owner_filter().is_none() {
            return Ok(());
        }
        match need {
            None => self.sessions().check_container(ctx, container_id).await,
            Some(need) => self.sessions().require_role(ctx, container_id, need).await,
        }
    }

    /// Returns an image the caller may see and, with `need`, do what that
    /// role allows in its container; a foreign or missing image is not found.
    async fn image_with_role(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        need: Option<Role>,
    ) -> Result<ImageInfo, RuntimeError> {
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        let image = self.sessions().get_image(ctx, image_id).await?;
        if need.is_some() {
            self.authorize(ctx, &image.container_id, need).await?;
        }
        Ok(image)
    }

    /// Interrupts the running turn; `false` when the agent was idle.
    #[instrument(name = "runtime.interrupt_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn interrupt(
        &self,
        ctx: &RequestContext,
        target: &AgentTarget,
    ) -> Result<(AgentInfo, bool), RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        let agent = self.find(ctx, target, Some(Role::Use)).await?;
        let interrupted = agent.interrupt();
        tracing::info!(agent_id = %agent.agent_id, interrupted, "interrupt requested");
        Ok((agent.info(), interrupted))
    }

    /// Returns one agent of the caller.
    #[instrument(name = "runtime.get_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn get_agent(&self, ctx: &RequestContext, agent_id: &str) -> Result<AgentInfo, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let target = AgentTarget::Agent(agent_id.to_owned());
        Ok(self.find(ctx, &target, None).await?.info())
    }

    /// Lists the caller's agents, optionally of one container, oldest first.
    #[instrument(name = "runtime.list_agents", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_agents(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
    ) -> Result<Vec<AgentInfo>, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let visible: Option<HashSet<String>> = match ctx.owner_filter() {
            None => None,
            Some(_) => Some(self.sessions().visible_containers(ctx).await?.into_iter().collect()),
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

    /// Returns an image with its running agent, if any.
    #[instrument(name = "runtime.get_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn get_image(&self, ctx: &RequestContext, image_id: &str) -> Result<ImageView, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let image = self.sessions().get_image(ctx, image_id).await?;
        let agent = self
            .lookup(&ctx.tenant_id, &AgentTarget::Image(image.image_id.clone()))
            .map(|agent| agent.info());
        Ok(ImageView { image, agent })
    }

    /// Lists a directory of an image's workspace (for whoever may see the image).
    #[instrument(name = "runtime.list_workspace", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_workspace(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        path: &str,
    ) -> Result<Vec<access::Entry>, RuntimeError> {
        let workspace = self.workspace_of(ctx, image_id, Scopes::READ, None).await?;
        accessed(workspace.entries(path).await)
    }

    /// Returns a file of an image's workspace (for whoever may see the image).
    #[instrument(name = "runtime.read_workspace_file", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn read_workspace_file(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        path: &str,
    ) -> Result<(access::Entry, Vec<u8>), RuntimeError> {
        let workspace = self.workspace_of(ctx, image_id, Scopes::READ, None).await?;
        accessed(workspace.fetch(path).await)
    }

    /// Writes a file of an image's workspace (for whoever may use the image).
    #[instrument(name = "runtime.write_workspace_file", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn write_workspace_file(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        path: &str,
        content: Vec<u8>,
    ) -> Result<access::Entry, RuntimeError> {
        let workspace = self.workspace_of(ctx, image_id, Scopes::WRITE, Some(Role::Use)).await?;
        let entry = accessed(workspace.store(path, content).await)?;
        workspace.save().await.map_err(|_| crate::tools::disk::unavailable())?;
        Ok(entry)
    }

    /// Removes a file or directory of an image's workspace (for whoever may use the image).
    #[instrument(name = "runtime.remove_workspace_file", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn remove_workspace_file(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        path: &str,
    ) -> Result<(), RuntimeError> {
        let workspace = self.workspace_of(ctx, image_id, Scopes::WRITE, Some(Role::Use)).await?;
        accessed(workspace.remove(path).await)?;
        workspace.save().await.map_err(|_| crate::tools::disk::unavailable())?;
        Ok(())
    }

    /// Returns the workspace of an image the caller may reach with `scope`;
    /// a foreign or missing image is not found, as everywhere.
    async fn workspace_of(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        scope: Scopes,
        need: Option<Role>,
    ) -> Result<Workspace, RuntimeError> {
        ctx.require(scope)?;
        let image = self.image_with_role(ctx, image_id, need).await?;
        let workspace = self.workspace(&ctx.tenant_id, &image.image_id);
        // Kept in a store: restored first, as for a tool (unless its agent runs here).
        workspace.load().await.map_err(|_| crate::tools::disk::unavailable())?;
        Ok(workspace)
    }

    /// Lists images, newest first, of one container or of all the caller's
    /// (or the children of one image), each with its running agent.
    #[instrument(name = "runtime.list_images", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_images(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
        parent_image_id: Option<&str>,
    ) -> Result<Vec<ImageView>, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let images = match parent_image_id {
            Some(parent_image_id) => {
                validate_id("IMAGE_NOT_FOUND", "image", parent_image_id)?;
                // The session service decides whether the caller may see it.
                let parent = self.sessions().get_image(ctx, parent_image_id).await?;
                // Children live in their parent's container: naming another leaves none.
                if container_id.is_some_and(|id| id != parent.container_id) {
                    Vec::new()
                } else {
                    self.sessions().children(ctx, parent_image_id).await?
                }
            }
            None => self.sessions().list_images(ctx, container_id).await?,
        };
        Ok(images
            .into_iter()
            .map(|image| {
                let agent = self
                    .lookup(&ctx.tenant_id, &AgentTarget::Image(image.image_id.clone()))
                    .map(|agent| agent.info());
                ImageView { image, agent }
            })
            .collect())
    }

    /// Stops the agent of an image; `false` when none was running. An image
    /// that does not exist is NOT_FOUND.
    #[instrument(name = "runtime.stop_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn stop_image(&self, ctx: &RequestContext, image_id: &str) -> Result<bool, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        // The session service decides whether the caller may see the image,
        // and a member needs to manage it: stopping cuts whoever is talking.
        self.image_with_role(ctx, image_id, Some(Role::Manage)).await?;
        Ok(self.leave(&ctx.tenant_id, image_id, "stopped"))
    }

    /// Changes an image; new tools stop its agent (interrupting a running
    /// turn), so the next message starts it with them. Returns whether an
    /// agent was stopped.
    #[instrument(name = "runtime.update_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn update_image(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        changes: ImageChanges,
    ) -> Result<bool, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        let retools = changes.tools.is_some();
        self.sessions().update_image(ctx, image_id, changes).await?;
        if !retools {
            return Ok(false);
        }
        match self.lookup(&ctx.tenant_id, &AgentTarget::Image(image_id.to_owned())) {
            Some(agent) => {
                self.retire(&agent, "tools changed");
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Stops an image's agent, then deletes the image with its session and
    /// messages; returns whether an agent was stopped.
    #[instrument(name = "runtime.delete_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn delete_image(&self, ctx: &RequestContext, image_id: &str) -> Result<bool, RuntimeError> {
        let stopped = self.stop_image(ctx, image_id).await?;
        self.sessions().delete_image(ctx, image_id).await?;
        self.remove_workspace(&ctx.tenant_id, image_id).await;
        Ok(stopped)
    }

    /// Stops the agents of a container, then deletes it with everything in
    /// it; returns the ids of its images.
    #[instrument(name = "runtime.delete_container", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn delete_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
    ) -> Result<Vec<String>, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        // Existence (and a member's right to stop its agents) first, so a
        // missing container is NOT_FOUND before anything is touched.
        self.authorize(ctx, container_id, Some(Role::Manage)).await?;
        if ctx.owner_filter().is_none() {
            self.sessions().check_container(ctx, container_id).await?;
        }
        self.retire_container(&ctx.tenant_id, container_id);
        let image_ids = self.sessions().delete_container(ctx, container_id).await?;
        for image_id in &image_ids {
            self.remove_workspace(&ctx.tenant_id, image_id).await;
        }
        Ok(image_ids)
    }

    /// Deletes an image's workspace, if it has one; a failure is logged.
    async fn remove_workspace(&self, tenant_id: &str, image_id: &str) {
        if let Some(store) = &self.inner.tools.store
            && let Err(err) = store.delete(tenant_id, image_id).await
        {
            tracing::warn!(image_id, error = %err, "cannot delete the image's workspace from the store");
        }
        let dir = self.workspace(tenant_id, image_id).dir().to_owned();
        let removed = tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&dir) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        })
        .await;
        if let Ok(Err(err)) | Err(err) = removed.map_err(std::io::Error::other) {
            tracing::warn!(image_id, error = %err, "cannot remove the image's workspace");
        }
    }

    /// Stops and forgets one agent.
    #[instrument(name = "runtime.destroy_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn destroy_agent(&self, ctx: &RequestContext, agent_id: &str) -> Result<(), RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        let target = AgentTarget::Agent(agent_id.to_owned());
        let agent = self.find(ctx, &target, Some(Role::Manage)).await?;
        self.retire(&agent, "destroyed");
        Ok(())
    }

    /// Stops every agent of a container; returns how many.
    #[instrument(name = "runtime.destroy_all_agents", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn destroy_all(&self, ctx: &RequestContext, container_id: &str) -> Result<u32, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        self.authorize(ctx, container_id, Some(Role::Manage)).await?;
        Ok(self.retire_container(&ctx.tenant_id, container_id))
    }

    fn retire_container(&self, tenant_id: &str, container_id: &str) -> u32 {
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
    fn retire(&self, agent: &Arc<Agent>, why: &'static str) {
        agent.retire();
        let key = (agent.tenant_id.clone(), agent.image.image_id.clone());
        {
            let mut agents = self.agents();
            let same = agents
                .get(&key)
                .and_then(|cell| cell.get())
                .is_some_and(|a| Arc::ptr_eq(a, agent));
            if !same {
                return;
            }
            agents.remove(&key);
        }
        if agent.is_running() {
            self.retiring().insert(key.clone(), Arc::clone(agent));
            let (pool, agent) = (self.clone(), Arc::clone(agent));
            tokio::spawn(async move {
                agent.stopped().await;
                let mut retiring = pool.retiring();
                if retiring.get(&key).is_some_and(|a| Arc::ptr_eq(a, &agent)) {
                    retiring.remove(&key);
                }
            });
        }
        self.agent_ids().remove(&agent.agent_id);
        metrics::gauge!("avm_runtime_active_agents").decrement(1.0);
        agent.emit(
            "agent_unregistered",
            &json!({"containerId": agent.image.container_id, "agentId": agent.agent_id}),
        );
        // A draining replica releases its leases itself, once its workspaces are saved.
        if let Some(replicas) = self.inner.replicas.as_ref().filter(|replicas| !replicas.draining()) {
            let (replicas, agent) = (replicas.clone(), Arc::clone(agent));
            // Once its turn (interrupted) has stored what it had.
            tokio::spawn(async move {
                agent.stopped().await;
                replicas.release(&agent.tenant_id, &agent.image.image_id).await;
            });
        }
        tracing::info!(agent_id = %agent.agent_id, image_id = %agent.image.image_id, why, "agent removed");
    }

    /// Subscribes to a session's events, replaying retained ones after `after_cursor`.
    #[instrument(name = "runtime.subscribe_events", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn subscribe(
        &self,
        ctx: &RequestContext,
        session_id: &str,
        after_cursor: Option<&str>,
    ) -> Result<Subscription, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let after = parse_cursor(after_cursor)?;
        validate_id("SESSION_NOT_FOUND", "session", session_id)?;
        // Ownership: the session must be one the caller may see.
        self.sessions().get_session(ctx, session_id).await?;
        Ok(self.inner.hubs.open(session_id).await.subscribe(after))
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

    /// Follows the LLM settings, sends usage, stops the agents of deleted
    /// images and runs the idle reaper until `shutdown`; returns the reaper's task.
    pub fn spawn_background(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        self.inner.llm.spawn_watch(shutdown.clone());
        self.inner.ports.metering.spawn(shutdown.clone());
        self.inner.ports.outbox.spawn(shutdown.clone());
        // Alone, this runtime made every call and ran every turn left open
        // before it started.
        if self.inner.replicas.is_none() {
            self.inner.ports.metering.spawn_settle_previous(shutdown.clone());
            tokio::spawn(self.clone().end_turns_left_open(shutdown.clone()));
        }
        tokio::spawn(self.clone().follow_deletions(shutdown.clone()));
        if let Some(replicas) = &self.inner.replicas {
            replicas
                .fanout()
                .spawn(replicas.client(), self.inner.hubs.clone(), shutdown.clone());
            tokio::spawn(self.clone().keep_replica(replicas.clone(), shutdown.clone()));
            tokio::spawn(self.clone().take_wakes(replicas.clone(), shutdown.clone()));
        }
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

    /// Stops the agents of images the session service deleted (whoever asked
    /// it to), reconnecting with backoff until `shutdown`.
    async fn follow_deletions(self, shutdown: CancellationToken) {
        let mut backoff = Backoff::default();
        loop {
            let result = tokio::select! {
                () = shutdown.cancelled() => return,
                result = self.watch_deletions(&mut backoff) => result,
            };
            if let Err(err) = result {
                tracing::warn!(error = %err, "session deletions watch ended; reconnecting");
            }
            if !backoff.wait(&shutdown).await {
                return;
            }
        }
    }

    async fn watch_deletions(&self, backoff: &mut Backoff) -> Result<(), RuntimeError> {
        let ctx = self.inner.ports.identity.own_context().await?;
        let mut stream = self.sessions().watch_deletions(&ctx).await?;
        while let Some(deletion) = stream.next().await.transpose()? {
            match deletion {
                Deletion::Live => {
                    backoff.reset();
                    // What was deleted while nobody watched: every live agent's image is checked.
                    self.reconcile().await;
                }
                Deletion::Images { tenant_id, image_ids } => {
                    for image_id in image_ids {
                        if let Some(agent) = self.lookup(&tenant_id, &AgentTarget::Image(image_id.clone())) {
                            self.retire(&agent, "image deleted");
                        }
                        // Deleted on the session service directly: the workspace goes too.
                        self.remove_workspace(&tenant_id, &image_id).await;
                    }
                }
            }
        }
        Ok(())
    }

    /// Retires the agents whose image no longer exists.
    async fn reconcile(&self) {
        for agent in self.live_agents() {
            let found = match self.inner.ports.identity.tenant_context(&agent.tenant_id).await {
                Ok(ctx) => self.sessions().get_image(&ctx, &agent.image.image_id).await,
                Err(err) => Err(err.into()),
            };
            if let Err(RuntimeError::Api(err)) = found
                && err.code == Code::NotFound
            {
                self.retire(&agent, "image deleted");
            }
        }
    }

    /// Returns the address of the live replica that holds an image's agent,
    /// when another one does (and only with replicas).
    pub async fn held_elsewhere(&self, tenant_id: &str, image_id: &str) -> Result<Option<String>, RuntimeError> {
        let Some(replicas) = &self.inner.replicas else {
            return Ok(None);
        };
        if self
            .lookup(tenant_id, &AgentTarget::Image(image_id.to_owned()))
            .is_some()
        {
            return Ok(None);
        }
        Ok(replicas.owner(tenant_id, image_id).await?)
    }

    /// Returns the addresses of the other live runtime replicas.
    pub async fn other_replicas(&self) -> Result<Vec<String>, RuntimeError> {
        match &self.inner.replicas {
            Some(replicas) => Ok(replicas.others().await?),
            None => Ok(Vec::new()),
        }
    }

    /// Returns whether this runtime shares its agents with other replicas.
    pub fn replicated(&self) -> bool {
        self.inner.replicas.is_some()
    }

    /// Keeps this replica registered, takes over wakes left unread, and ends
    /// the turns of replicas that died, until `shutdown`.
    async fn keep_replica(self, replicas: Replicas, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(crate::replicas::HEARTBEAT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut beat = 0_u64;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            beat += 1;
            match replicas.heartbeat().await {
                Ok(true) => {}
                Ok(false) => {
                    // Survivors may hold this replica's images now.
                    tracing::error!("this runtime replica's heartbeat lapsed; dropping its agents");
                    for agent in self.live_agents() {
                        self.retire(&agent, "lease lapsed");
                    }
                }
                Err(_) => continue,
            }
            self.reclaim_wakes(&replicas, beat).await;
            let Ok(dead) = replicas.dead_replicas().await else {
                continue;
            };
            for replica in dead {
                let Ok(turns) = replicas.lost_turns(&replica).await else {
                    continue;
                };
                let mut undecided = false;
                for (field, record) in turns {
                    let open = match self.lost_turn_open(&record).await {
                        Ok(open) => open,
                        Err(err) => {
                            // Decided on a later beat, once history answers.
                            tracing::debug!(replica, image_id = %record.image_id, error = %err, "cannot tell yet whether a dead replica's turn ended");
                            undecided = true;
                            continue;
                        }
                    };
                    if replicas.take_lost_turn(&replica, &field).await && open {
                        self.end_lost_turn(&replica, record).await;
                    }
                }
                if !undecided {
                    replicas.forget(&replica).await;
                }
            }
        }
    }

    /// Returns whether a dead replica's turn is still open: nothing answers
    /// its user message in history once the outbox has stored what it kept.
    /// A replica dies between a turn's end and the removal of its record, so
    /// the record alone does not say the turn was cut. An error while a peer
    /// is down is transient; a conversation or tenant since deleted has no
    /// open turn.
    async fn lost_turn_open(&self, record: &TurnRecord) -> Result<bool, RuntimeError> {
        let read = async {
            let ctx = self.inner.ports.identity.tenant_context(&record.tenant_id).await?;
            self.inner
                .ports
                .outbox
                .settle_before_loading(&record.tenant_id, &record.session_id)
                .await?;
            self.sessions().list_messages(&ctx, &record.session_id).await
        };
        let history = match read.await {
            Ok(history) => history,
            Err(err) if err.transient() => return Err(err),
            Err(_) => return Ok(false),
        };
        Ok(match cut_turn(&history) {
            // Records of older replicas do not name the message.
            Some(_) if record.user_message_id.is_empty() => true,
            Some(open) => open == record.user_message_id,
            None => false,
        })
    }

    /// Ends a turn a dead replica was running: an error message in history
    /// (the user's message stays) and `RUNTIME_LOST` on the session's events.
    async fn end_lost_turn(&self, replica: &str, record: TurnRecord) {
        tracing::warn!(
            replica,
            image_id = %record.image_id,
            session_id = %record.session_id,
            "a turn was lost with its runtime replica"
        );
        metrics::counter!("avm_runtime_turns_lost_total").increment(1);
        let text = "the runtime running this turn stopped; the reply was lost. Send the message again.";
        let stored = self
            .store_lost_turn(
                &record.tenant_id,
                &record.session_id,
                &record.user_message_id,
                "RUNTIME_LOST",
                text,
            )
            .await
            // Told to the session's subscribers anyway, as it happened.
            .unwrap_or_else(Some);
        let hub = self.inner.hubs.open(&record.session_id).await;
        let (tenant_id, group_id) = (record.tenant_id.clone(), record.group_id.clone());
        let context = Arc::new(EventContext {
            container_id: record.container_id,
            image_id: record.image_id,
            agent_id: record.agent_id,
            session_id: record.session_id,
        });
        // A hydration that found the turn cut may have recorded it first
        // (`TURN_LOST`, the same message id): the turn's watchers still learn
        // that it ended, but history keeps the one message.
        publish_lost_turn(&hub, &context, "RUNTIME_LOST", text, stored);
        // A group turn's messages are still unread (the cursor moves after
        // the reply): the agent, woken again, answers them. Its reply is
        // named after them, so one posted before the crash is not posted twice.
        if !group_id.is_empty() {
            tokio::spawn(self.clone().wake_again(tenant_id, context.image_id.clone(), group_id));
        }
    }

    /// Stores `TURN_LOST` after the user message of a turn that a crash cut
    /// (found when its image's agent starts again); returns the stored
    /// message, `None` when it could not be stored or was already.
    async fn record_cut_turn(&self, tenant_id: &str, session_id: &str, user_message_id: &str) -> Option<Message> {
        tracing::warn!(session_id, user_message_id, "a turn was cut by a crash; recording it");
        metrics::counter!("avm_runtime_turns_lost_total").increment(1);
        self.store_lost_turn(tenant_id, session_id, user_message_id, "TURN_LOST", lost::CUT_TURN_TEXT)
            .await
            .unwrap_or(None)
    }

    /// Stores the error message of a lost turn under an id made of the
    /// turn's user message id, so of a survivor ending a dead replica's turn
    /// (`RUNTIME_LOST`) and the hydration that finds it cut (`TURN_LOST`),
    /// only the first stores one (appends are idempotent on the id).
    /// Returns the message when this call stored it, `None` when it was
    /// there already, and the unstored message when it could not be stored
    /// (logged).
    async fn store_lost_turn(
        &self,
        tenant_id: &str,
        session_id: &str,
        user_message_id: &str,
        code: &str,
        text: &str,
    ) -> Result<Option<Message>, Message> {
        let message_id = if user_message_id.is_empty() {
            new_id("msg")
        } else {
            format!("{user_message_id}.lost")
        };
        let message = Message {
            message_id,
            session_id: session_id.to_owned(),
            created_at_ms: avm_common::now_ms(),
            body: MessageBody::Error {
                text: text.to_owned(),
                error_code: code.to_owned(),
            },
        };
        let stored = match self.inner.ports.identity.tenant_context(tenant_id).await {
            Ok(ctx) => self.sessions().append(&ctx, &message).await,
            Err(err) => Err(err.into()),
        };
        match stored {
            Ok(stored) if stored.body == message.body => Ok(Some(stored)),
            Ok(_) => Ok(None),
            Err(err) => {
                tracing::error!(session_id, code, error = %err, "cannot store the lost turn's error");
                Err(message)
            }
        }
    }

    /// Drains at shutdown (SIGTERM): lets running turns finish for at most
    /// `grace` (then interrupts them, so they store what they have). With
    /// replicas it takes no new agent (another replica does), drops its
    /// agents, releases their leases and leaves; alone, it starts no new
    /// turn (`RUNTIME_DRAINING`).
    pub async fn drain(&self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        let Some(replicas) = &self.inner.replicas else {
            self.inner.draining.store(true, Ordering::Relaxed);
            self.finish_turns(deadline).await;
            return;
        };
        replicas.drain();
        self.finish_turns(deadline).await;
        for agent in self.live_agents() {
            agent.stopped().await;
            self.retire(&agent, "draining");
        }
        // Their workspaces are saved before another replica may claim them.
        self.save_workspaces(grace).await;
        for (tenant_id, image_id) in replicas.held() {
            replicas.release(&tenant_id, &image_id).await;
        }
        replicas.deregister().await;
    }

    /// Waits until `deadline` for running turns to end, then interrupts
    /// those left (they store their partial replies).
    async fn finish_turns(&self, deadline: tokio::time::Instant) {
        tracing::info!(
            running = self.live_agents().iter().filter(|a| a.is_running()).count(),
            "draining"
        );
        for agent in self.live_agents() {
            if tokio::time::timeout_at(deadline, agent.stopped()).await.is_err() {
                agent.interrupt();
            }
        }
    }

    /// Waits, at most `limit`, until the usage of every finished call was
    /// reported (at shutdown, before the services it reports to stop).
    pub async fn flush_usage(&self, limit: Duration) -> bool {
        self.inner.ports.metering.flush(limit).await
    }

    /// Saves, within `limit`, the workspaces that changed since their last
    /// save (at shutdown, once turns ended); `true` without a store.
    pub async fn save_workspaces(&self, limit: Duration) -> bool {
        match &self.inner.tools.store {
            Some(store) => store.flush(limit).await,
            None => true,
        }
    }

    /// Returns whether any turn is still running.
    pub fn any_running(&self) -> bool {
        self.live_agents().iter().any(|agent| agent.is_running())
    }
}

/// Publishes the end of a lost turn on its session's events: its error
/// message (`error_received → error_message`) when `stored` holds it, and
/// `error_occurred` with `code`, which ends the turn for its watchers.
fn publish_lost_turn(hub: &SessionHub, context: &Arc<EventContext>, code: &str, text: &str, stored: Option<Message>) {
    if let Some(message) = stored {
        hub.publish("error_received", context, &json!({"message": text, "errorCode": code}));
        hub.publish("error_message", context, &message.object());
    }
    hub.publish(
        "error_occurred",
        context,
        &json!({"code": code, "message": text, "recoverable": true}),
    );
}

/// How long a new agent waits for its predecessor's interrupted turn to
/// store what it had; past it, the history is read without it.
const RETIRED_TURN_WAIT: Duration = Duration::from_secs(10);

/// Returns the user message id of the turn the history ends in when that
/// turn never ended: its last message is the user's (or a tool call without
/// its result), where every turn that ended stored a reply or an error.
fn cut_turn(history: &[Message]) -> Option<&str> {
    let last = history.last()?;
    if !matches!(last.body, MessageBody::User(_) | MessageBody::ToolCall { .. }) {
        return None;
    }
    history
        .iter()
        .rev()
        .find(|message| matches!(message.body, MessageBody::User(_)))
        .map(|message| message.message_id.as_str())
}

/// Rejects ids no store could hold, answering like a missing object.
/// Reads a subscriber's resume cursor.
fn parse_cursor(cursor: Option<&str>) -> Result<Option<u64>, RuntimeError> {
    cursor
        .map(|cursor| {
            cursor
                .parse::<u64>()
                .map_err(|_| RuntimeError::invalid("INVALID_CURSOR", format!("invalid cursor {cursor:?}")))
        })
        .transpose()
}

fn validate_id(reason: &'static str, what: &'static str, id: &str) -> Result<(), RuntimeError> {
    if id.is_empty() {
        return Err(RuntimeError::invalid("MISSING_ID", format!("{what} id is required")));
    }
    if id.len() > 128 {
        return Err(RuntimeError::TooLongId { reason, what });
    }
    Ok(())
}

/// Returns where images' workspaces live.
fn workspace_root(config: &RuntimeConfig) -> std::path::PathBuf {
    config
        .workspace_root
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("avm-workspaces"))
}

/// Returns a client's workspace access as the API answers it.
fn accessed<T>(result: Result<T, access::AccessError>) -> Result<T, RuntimeError> {
    use avm_common::ApiError;
    result.map_err(|err| {
        RuntimeError::Api(match err {
            access::AccessError::Refused(message) => ApiError::invalid("INVALID_WORKSPACE_PATH", message),
            access::AccessError::NotFound(message) => ApiError::not_found("WORKSPACE_PATH_NOT_FOUND", message),
            access::AccessError::TooLarge(message) => ApiError::invalid("WORKSPACE_FILE_TOO_LARGE", message),
            access::AccessError::Failed(message) => ApiError::internal(message),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::ToolCall;
    use crate::message::{Part, Reply};

    fn message(id: &str, body: MessageBody) -> Message {
        Message {
            message_id: id.into(),
            session_id: "sess_1".into(),
            created_at_ms: 0,
            body,
        }
    }

    fn user(id: &str) -> Message {
        message(
            id,
            MessageBody::User(Content {
                parts: vec![Part::Text("hi".into())],
                plain_text: true,
            }),
        )
    }

    #[test]
    fn only_a_turn_that_never_ended_is_cut() {
        let reply = message("a", MessageBody::Assistant(Reply::default()));
        let error = message(
            "e",
            MessageBody::Error {
                text: "boom".into(),
                error_code: "LLM_TIMEOUT".into(),
            },
        );
        let call = message(
            "c",
            MessageBody::ToolCall {
                call: ToolCall {
                    id: "t1".into(),
                    name: "read_file".into(),
                    input: json!({}),
                },
                parent_id: "a".into(),
            },
        );
        assert_eq!(cut_turn(&[]), None);
        assert_eq!(cut_turn(&[user("u1"), reply.clone()]), None, "answered");
        assert_eq!(cut_turn(&[user("u1"), error]), None, "failed, and recorded");
        assert_eq!(cut_turn(&[user("u1"), reply, user("u2")]), Some("u2"));
        assert_eq!(cut_turn(&[user("u1"), call]), Some("u1"), "cut while a tool ran");
    }
}
