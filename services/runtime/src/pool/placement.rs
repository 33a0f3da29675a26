//! Where an image's agent runs: here, when this runtime runs alone; on the
//! replica holding the image's lease, when runtimes share their agents
//! through Redis (`replicas/`). Decided once, when the pool is made: the
//! pool asks the placement what to do and never which one it is.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use avm_common::RequestContext;
use avm_proto::runtime::v1 as pb;
use avm_proto::runtime::v1::runtime_service_server::RuntimeService as _;
use tracing::Instrument;

use crate::agent::Agent;
use crate::error::RuntimeError;
use crate::replicas::{Claim, Replicas, TurnRecord, relay_message};

pub(super) enum Placement {
    /// Every image's agent runs here.
    Alone {
        /// Set when this runtime drains: no new turn starts.
        draining: AtomicBool,
        /// The group messages this runtime acted on lately.
        posts: std::sync::Mutex<PostClaims>,
    },
    /// An image's agent runs on the replica holding its lease.
    Replicated(Replicas),
}

impl Placement {
    pub(super) fn new(replicas: Option<Replicas>) -> Self {
        match replicas {
            None => Self::Alone {
                draining: AtomicBool::new(false),
                posts: std::sync::Mutex::default(),
            },
            Some(replicas) => Self::Replicated(replicas),
        }
    }

    /// Returns the replicas, when this runtime is one of several.
    pub(super) fn replicas(&self) -> Option<&Replicas> {
        match self {
            Self::Alone { .. } => None,
            Self::Replicated(replicas) => Some(replicas),
        }
    }

    /// Claims an image's agent for this runtime before it starts here.
    /// Returns the dead replica that held it (whose turn for it, if any, is
    /// lost); another live holder is `Elsewhere`, and a draining replica
    /// sends new agents to another one.
    pub(super) async fn claim(&self, tenant_id: &str, image_id: &str) -> Result<Option<String>, RuntimeError> {
        let Self::Replicated(replicas) = self else {
            return Ok(None);
        };
        if replicas.draining() && !replicas.holds(tenant_id, image_id) {
            let others = replicas.others().await?;
            return Err(others
                .into_iter()
                .next()
                .map_or(RuntimeError::Draining, RuntimeError::Elsewhere));
        }
        match replicas.claim(tenant_id, image_id).await? {
            Claim::Elsewhere(addr) => Err(RuntimeError::Elsewhere(addr)),
            Claim::Here { lost_from } => Ok(lost_from),
        }
    }

    /// Gives up the claim on an image whose agent did not start.
    pub(super) async fn release(&self, tenant_id: &str, image_id: &str) {
        if let Self::Replicated(replicas) = self {
            replicas.release(tenant_id, image_id).await;
        }
    }

    /// Gives up a retired agent's image once its turn (interrupted) has
    /// stored what it had, so another replica may take it. A draining
    /// replica releases its leases itself, once its workspaces are saved.
    pub(super) fn release_when_stopped(&self, agent: &Arc<Agent>) {
        if let Self::Replicated(replicas) = self
            && !replicas.draining()
        {
            let (replicas, agent) = (replicas.clone(), Arc::clone(agent));
            tokio::spawn(async move {
                agent.stopped().await;
                replicas.release(&agent.tenant_id, &agent.image.image_id).await;
            });
        }
    }

    /// Runs a turn in the current span. With replicas it is recorded while
    /// it runs (`record` is only made then), so a survivor ends it if this
    /// replica dies.
    pub(super) fn run_turn<F>(
        &self,
        record: impl FnOnce() -> TurnRecord,
        turn: F,
    ) -> tokio::task::JoinHandle<Option<String>>
    where
        F: Future<Output = Option<String>> + Send + 'static,
    {
        let span = tracing::Span::current();
        match self {
            Self::Alone { .. } => tokio::spawn(turn.instrument(span)),
            Self::Replicated(replicas) => {
                let record = record();
                replicas.turn_started(&record);
                let replicas = replicas.clone();
                tokio::spawn(
                    async move {
                        let reply = turn.await;
                        replicas.turn_ended(&record.tenant_id, &record.image_id);
                        reply
                    }
                    .instrument(span),
                )
            }
        }
    }

    /// Returns whether new turns are refused: a runtime alone that drains
    /// has nobody to send them to (replicas send them to another one).
    pub(super) fn refuses_turns(&self) -> bool {
        match self {
            Self::Alone { draining, .. } => draining.load(Ordering::Relaxed),
            Self::Replicated(_) => false,
        }
    }

    /// Starts draining: alone, no new turn starts; with replicas, no new
    /// agent starts here. Returns whether the agents go to other replicas
    /// (so they are retired here once their turns end).
    pub(super) fn begin_drain(&self) -> bool {
        match self {
            Self::Alone { draining, .. } => {
                draining.store(true, Ordering::Relaxed);
                false
            }
            Self::Replicated(replicas) => {
                replicas.drain();
                true
            }
        }
    }

    /// Lets go of every image held and leaves the replicas (at the end of a drain).
    pub(super) async fn leave(&self) {
        if let Self::Replicated(replicas) = self {
            for (tenant_id, image_id) in replicas.held() {
                replicas.release(&tenant_id, &image_id).await;
            }
            replicas.deregister().await;
        }
    }

    /// Returns the address of the replica holding an image, when another
    /// live one does.
    pub(super) async fn holder(&self, tenant_id: &str, image_id: &str) -> Result<Option<String>, RuntimeError> {
        match self {
            Self::Alone { .. } => Ok(None),
            Self::Replicated(replicas) => Ok(replicas.owner(tenant_id, image_id).await?),
        }
    }

    /// Returns the addresses of the other live replicas.
    pub(super) async fn others(&self) -> Result<Vec<String>, RuntimeError> {
        match self {
            Self::Alone { .. } => Ok(Vec::new()),
            Self::Replicated(replicas) => Ok(replicas.others().await?),
        }
    }

    /// Claims a group message for this runtime: `true` when it is to act
    /// on it (tell the group's watchers, wake whom it concerns). The runtime
    /// of an agent about to post claims its message `outright`; each runtime
    /// hearing the session announce a message claims it only if nobody did.
    pub(super) async fn claim_post(
        &self,
        tenant_id: &str,
        group_id: &str,
        message_id: &str,
        outright: bool,
    ) -> Result<bool, RuntimeError> {
        match self {
            Self::Alone { posts, .. } => Ok(posts
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .claim(group_id, message_id)
                || outright),
            Self::Replicated(replicas) => Ok(replicas.claim_post(tenant_id, group_id, message_id, outright).await?),
        }
    }

    /// Queues wakes of agent members through the replicas' bus (delivered
    /// to a replica, which has the agent's holder read the message, and
    /// taken over if that one dies); returns `false` alone, where the
    /// caller wakes them itself.
    pub(super) async fn queue_wakes(
        &self,
        tenant_id: &str,
        group_id: &str,
        seq: u64,
        image_ids: &[String],
    ) -> Result<bool, RuntimeError> {
        let Self::Replicated(replicas) = self else {
            return Ok(false);
        };
        replicas.queue_wakes(tenant_id, group_id, seq, image_ids).await?;
        metrics::counter!("avm_runtime_wakes_queued_total").increment(image_ids.len() as u64);
        Ok(true)
    }

    /// Wakes an agent the replica at `addr` holds; with `wait`, answers once
    /// it read what woke it.
    pub(super) async fn wake_elsewhere(
        &self,
        addr: &str,
        ctx: &RequestContext,
        image_id: &str,
        wait: bool,
    ) -> Result<bool, RuntimeError> {
        let Self::Replicated(replicas) = self else {
            return Err(RuntimeError::Elsewhere(addr.to_owned()));
        };
        let request = relay_message(
            ctx.request(()).metadata(),
            pb::WakeAgentRequest {
                image_id: image_id.to_owned(),
                wait,
            },
        );
        Ok(replicas.remote(addr)?.wake_agent(request).await?.into_inner().woken)
    }

    /// Returns the client of the replica at `addr`.
    pub(super) fn remote(&self, addr: &str) -> Result<avm_proto::runtime::v1::RuntimeServiceRemote, RuntimeError> {
        match self {
            Self::Alone { .. } => Err(RuntimeError::Api(avm_common::ApiError::internal(
                "a runtime alone has no other replica to call",
            ))),
            Self::Replicated(replicas) => Ok(replicas.remote(addr)?),
        }
    }
}

/// The group messages a runtime alone claimed lately, by group and message
/// id: a message is claimed by its poster and by its announcement within
/// moments, so the newest few thousand are enough.
#[derive(Default)]
pub(super) struct PostClaims {
    claimed: std::collections::HashSet<(String, String)>,
    order: std::collections::VecDeque<(String, String)>,
}

impl PostClaims {
    /// Claims kept; the oldest goes first.
    const KEPT: usize = 4096;

    /// Returns `true` the first time a message is claimed.
    fn claim(&mut self, group_id: &str, message_id: &str) -> bool {
        let key = (group_id.to_owned(), message_id.to_owned());
        if !self.claimed.insert(key.clone()) {
            return false;
        }
        self.order.push_back(key);
        if self.order.len() > Self::KEPT
            && let Some(oldest) = self.order.pop_front()
        {
            self.claimed.remove(&oldest);
        }
        true
    }
}
