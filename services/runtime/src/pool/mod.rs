//! The agent pool: at most one agent per image, started on demand, dropped
//! when idle or when its image is deleted, each running one turn at a time.
//!
//! One file per responsibility:
//! - `registry.rs`: the agents, started (hydrated), found and retired;
//! - `turns.rs`: a message accepted and its turn run; interrupts;
//! - `images.rs`: what a caller may see and do to images, containers and agents;
//! - `workspaces.rs`: images' workspaces as clients reach them;
//! - `lifecycle.rs`: pause, resume, terminate; `children.rs`: agents spawning agents;
//! - `groups.rs`: group messages posted and answered; `wakes.rs`: agents woken
//!   to read them, here or on another replica;
//! - `gate.rs`: how many agents' group turns run at once;
//! - `placement.rs`: where an image's agent runs (alone, or with replicas);
//! - `recovery.rs`: lost turns, a crash's and a dead replica's, ended;
//! - `session_changes.rs`: following the session service's changes (deleted
//!   images stop their agents, new group messages wake theirs);
//! - `drain.rs`: stopping at shutdown.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use avm_common::auth::ServiceIdentity;
use tokio_util::sync::CancellationToken;

use crate::agent::AgentInfo;
use crate::config::RuntimeConfig;
use crate::error::{AgentTarget, RuntimeError};
use crate::hub::{Hubs, Subscription};
use crate::metering::Metering;
use crate::outbox::Outbox;
use crate::peers::{Image, Resources, Sessions};
use crate::replicas::Replicas;
use crate::settings::LlmSettings;
use crate::tools::{Fetcher, ToolContext};
use crate::turn::{TurnLimits, TurnPorts};

mod children;
mod drain;
mod gate;
mod groups;
mod images;
mod lifecycle;
mod placement;
mod recovery;
mod registry;
mod rewind;
mod session_changes;
mod turns;
mod wakes;
mod workspaces;

use gate::RunGate;
use placement::Placement;
use registry::Registry;

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
    pub image: Image,
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
    /// Where an image's agent runs: here alone, or where its lease is.
    placement: Placement,
    /// What every agent's tools run with (`fetch_url`'s client among it).
    tools: ToolContext,
    /// The agents of this runtime.
    registry: Registry,
    /// The seq of the last `group_message` event published, per group with a hub.
    group_feeds: Mutex<HashMap<String, Arc<tokio::sync::Mutex<u64>>>>,
    /// Admits agents' group turns within the replica's and each tenant's limits.
    gate: RunGate,
    /// When this process's pool was made: older open turns were another's.
    started_at_ms: i64,
    /// Set once the turns the previous process left open are ended (at
    /// once with replicas, whose survivors end a dead one's turns).
    recovered: tokio::sync::watch::Sender<bool>,
    /// Set once the session service's changes reach this runtime: before,
    /// a group message posted would wake nobody.
    sessions_followed: tokio::sync::watch::Sender<bool>,
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
                        crate::tools::Launcher::new(
                            &config.sandbox,
                            &config.fetch.allow,
                            &workspaces::workspace_root(&config),
                        )
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
                placement: Placement::new(replicas),
                tools,
                registry: Registry::default(),
                group_feeds: Mutex::new(HashMap::new()),
                gate,
                started_at_ms: avm_common::now_ms(),
                recovered,
                sessions_followed: tokio::sync::watch::channel(false).0,
            }),
        };
        pool.serve_spawns();
        Ok(pool)
    }

    fn sessions(&self) -> &Sessions {
        &self.inner.ports.sessions
    }

    /// Follows the LLM settings, sends usage, stops the agents of deleted
    /// images and runs the idle reaper until `shutdown`; returns the reaper's task.
    pub fn spawn_background(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        self.inner.llm.spawn_watch(shutdown.clone());
        self.inner.ports.metering.spawn(shutdown.clone());
        self.inner.ports.outbox.spawn(shutdown.clone());
        // Alone, this runtime made every call and ran every turn left open
        // before it started.
        // With replicas, survivors end a dead one's turns instead.
        match self.inner.placement.replicas() {
            None => {
                self.inner.ports.metering.spawn_settle_previous(shutdown.clone());
                tokio::spawn(self.clone().end_turns_left_open(shutdown.clone()));
            }
            Some(replicas) => {
                replicas
                    .fanout()
                    .spawn(replicas.client(), self.inner.hubs.clone(), shutdown.clone());
                tokio::spawn(self.clone().keep_replica(replicas.clone(), shutdown.clone()));
                tokio::spawn(self.clone().take_wakes(replicas.clone(), shutdown.clone()));
            }
        }
        tokio::spawn(self.clone().follow_sessions(shutdown.clone()));
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

    /// Returns the address of the live replica that holds an image's agent,
    /// when another one does (and only with replicas).
    pub async fn held_elsewhere(&self, tenant_id: &str, image_id: &str) -> Result<Option<String>, RuntimeError> {
        if self
            .lookup(tenant_id, &AgentTarget::Image(image_id.to_owned()))
            .is_some()
        {
            return Ok(None);
        }
        self.inner.placement.holder(tenant_id, image_id).await
    }

    /// Returns the addresses of the other live runtime replicas.
    pub async fn other_replicas(&self) -> Result<Vec<String>, RuntimeError> {
        self.inner.placement.others().await
    }

    /// Returns whether this runtime shares its agents with other replicas.
    pub fn replicated(&self) -> bool {
        self.inner.placement.replicas().is_some()
    }

    /// Returns the client of the replica at `addr` (with replicas).
    pub fn remote(&self, addr: &str) -> Result<avm_proto::runtime::v1::RuntimeServiceRemote, RuntimeError> {
        self.inner.placement.remote(addr)
    }
}

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

/// Rejects ids no store could hold, answering like a missing object.
fn validate_id(reason: &'static str, what: &'static str, id: &str) -> Result<(), RuntimeError> {
    if id.is_empty() {
        return Err(RuntimeError::invalid("MISSING_ID", format!("{what} id is required")));
    }
    if id.len() > 128 {
        return Err(RuntimeError::TooLongId { reason, what });
    }
    Ok(())
}
