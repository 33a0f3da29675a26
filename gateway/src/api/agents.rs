//! Agents: the running, in-memory instances of images.

use avm_common::{ApiError, Code, RequestContext};
use avm_proto::runtime::v1 as rt;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::missing;
use crate::peers::Peers;

/// A running agent.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Agent {
    pub agent_id: String,
    pub container_id: String,
    pub image_id: String,
    pub session_id: String,
    /// `running` while it answers a message, else `idle`.
    pub state: AgentState,
    /// Unix milliseconds.
    pub started_at: i64,
}

/// Whether an agent is answering a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum AgentState {
    Idle,
    Running,
}

impl From<rt::Agent> for Agent {
    fn from(agent: rt::Agent) -> Self {
        Self {
            state: if agent.state == rt::AgentState::Running as i32 {
                AgentState::Running
            } else {
                AgentState::Idle
            },
            agent_id: agent.agent_id,
            container_id: agent.container_id,
            image_id: agent.image_id,
            session_id: agent.session_id,
            started_at: agent.started_at_ms,
        }
    }
}

/// Running agents.
#[derive(Debug, Serialize, ToSchema)]
pub struct AgentList {
    pub agents: Vec<Agent>,
}

/// Which agents to list.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase")]
#[into_params(parameter_in = Query)]
pub struct AgentFilter {
    /// Only the agents of this container.
    pub container_id: Option<String>,
}

/// What destroying an agent answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentDestroyed {
    pub agent_id: String,
    pub destroyed: bool,
}

/// Lists the caller's running agents, oldest first.
pub async fn list(peers: &Peers, ctx: &RequestContext, filter: AgentFilter) -> Result<AgentList, ApiError> {
    let request = ctx.request(rt::ListAgentsRequest {
        container_id: filter.container_id,
    });
    let agents = peers.runtime.list_agents(request).await?.into_inner().agents;
    Ok(AgentList {
        agents: agents.into_iter().map(Agent::from).collect(),
    })
}

/// Returns one running agent.
pub async fn get(peers: &Peers, ctx: &RequestContext, agent_id: String) -> Result<Agent, ApiError> {
    let request = ctx.request(rt::GetAgentRequest { agent_id });
    let agent = peers.runtime.get_agent(request).await?.into_inner().agent;
    Ok(agent.ok_or_else(|| missing("agent"))?.into())
}

/// Returns one running agent, or `None` when there is none (other failures are errors).
pub async fn find(peers: &Peers, ctx: &RequestContext, agent_id: String) -> Result<Option<Agent>, ApiError> {
    match get(peers, ctx, agent_id).await {
        Ok(agent) => Ok(Some(agent)),
        Err(err) if err.code == Code::NotFound => Ok(None),
        Err(err) => Err(err),
    }
}

/// Stops and forgets an agent.
pub async fn destroy(peers: &Peers, ctx: &RequestContext, agent_id: String) -> Result<AgentDestroyed, ApiError> {
    let request = ctx.request(rt::DestroyAgentRequest {
        agent_id: agent_id.clone(),
    });
    peers.runtime.destroy_agent(request).await?;
    Ok(AgentDestroyed {
        agent_id,
        destroyed: true,
    })
}

/// Stops every agent of a container; returns how many.
pub async fn destroy_all(peers: &Peers, ctx: &RequestContext, container_id: String) -> Result<u32, ApiError> {
    super::containers::get(peers, ctx, container_id.clone()).await?;
    let request = ctx.request(rt::DestroyAllAgentsRequest { container_id });
    Ok(peers.runtime.destroy_all_agents(request).await?.into_inner().destroyed)
}

/// What an agent's lifecycle call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LifecycleAction {
    Pause,
    Resume,
    Terminate,
}

/// Where an agent is in its life: `idle` (asleep, woken by what reaches
/// it), `running` (a turn), `paused` (not woken; what reaches it waits
/// unread), `error` (stopped by a failure retrying would not fix; like
/// `paused` until resumed) or `terminated` (never runs again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Lifecycle {
    Idle,
    Running,
    Paused,
    Terminated,
    Error,
}

/// An agent after a lifecycle call.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentLifecycle {
    /// The image the agent runs (a group member's id).
    pub image_id: String,
    pub state: Lifecycle,
    /// What stopped it, in the `error` state.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// After `terminate`: the image and every agent it started, at any
    /// depth (empty when it was terminated already).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub terminated_image_ids: Option<Vec<String>>,
}

impl AgentLifecycle {
    fn new(view: Option<rt::ImageView>, terminated_image_ids: Option<Vec<String>>) -> Result<Self, ApiError> {
        let view = view.ok_or_else(|| missing("image"))?;
        let image = view.image.ok_or_else(|| missing("image"))?;
        let running = view
            .agent
            .is_some_and(|agent| agent.state == rt::AgentState::Running as i32);
        let state = match avm_proto::session::v1::AgentState::try_from(image.agent_state) {
            Ok(avm_proto::session::v1::AgentState::Paused) => Lifecycle::Paused,
            Ok(avm_proto::session::v1::AgentState::Terminated) => Lifecycle::Terminated,
            Ok(avm_proto::session::v1::AgentState::Error) => Lifecycle::Error,
            _ if running => Lifecycle::Running,
            _ => Lifecycle::Idle,
        };
        Ok(Self {
            image_id: image.image_id,
            state,
            error: image.agent_error,
            terminated_image_ids,
        })
    }
}

/// Pauses, resumes or terminates the agent of an image, named by the image
/// id or by the id of its running agent.
pub async fn change(
    peers: &Peers,
    ctx: &RequestContext,
    id: String,
    action: LifecycleAction,
) -> Result<AgentLifecycle, ApiError> {
    let image_id = if id.starts_with("img_") {
        id
    } else {
        get(peers, ctx, id).await?.image_id
    };
    match action {
        LifecycleAction::Pause => {
            let request = ctx.request(rt::PauseAgentRequest { image_id });
            AgentLifecycle::new(peers.runtime.pause_agent(request).await?.into_inner().image, None)
        }
        LifecycleAction::Resume => {
            let request = ctx.request(rt::ResumeAgentRequest { image_id });
            AgentLifecycle::new(peers.runtime.resume_agent(request).await?.into_inner().image, None)
        }
        LifecycleAction::Terminate => {
            let request = ctx.request(rt::TerminateAgentRequest { image_id });
            let terminated = peers.runtime.terminate_agent(request).await?.into_inner();
            AgentLifecycle::new(terminated.image, Some(terminated.terminated_image_ids))
        }
    }
}
