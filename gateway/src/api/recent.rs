//! The recent list and read markers: the conversations a caller may read,
//! most recently active first, each with its last message, its agent's
//! state and how many messages came after the caller's read marker.

use std::collections::HashMap;

use avm_common::{ApiError, RequestContext};
use avm_proto::runtime::v1 as rt;
use avm_proto::session::v1 as ss;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::images::agent_state_name;
use crate::peers::Peers;

/// Which page of the list.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct RecentQuery {
    /// Conversations per page (default 20, at most 100).
    pub page_size: Option<u32>,
    /// The previous page's `nextPageToken`.
    pub page_token: Option<String>,
}

/// The last message of a conversation, as a list shows it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LastMessage {
    pub id: String,
    pub seq: u64,
    /// `user`, `assistant`, `tool_call`, `tool_result` or `error`.
    pub role: &'static str,
    /// The start of its text, at most 200 characters.
    pub preview: String,
    /// Unix milliseconds.
    pub timestamp: i64,
}

/// One conversation of the list.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecentConversation {
    pub image_id: String,
    pub container_id: String,
    pub session_id: String,
    pub name: String,
    /// `active`, `paused`, `error` or `terminated`.
    pub agent_state: &'static str,
    /// Whether its agent is running now.
    pub online: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    /// Unix milliseconds.
    pub created_at: i64,
    /// When its last message was written, or it was made (Unix ms).
    pub last_active_at: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_message: Option<LastMessage>,
    /// The messages after the caller's read marker.
    pub unread_count: u64,
    /// The caller's read marker: every message up to this seq is read.
    pub read_seq: u64,
}

/// A page of the list, most recently active first.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecentList {
    pub conversations: Vec<RecentConversation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

/// How far a conversation is read.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default, expecting = "an object", deny_unknown_fields)]
pub struct ReadMark {
    /// Read up to this seq; absent: up to its last message. The marker never
    /// moves past the last message, nor back.
    pub seq: Option<u64>,
}

/// A read marker as it now is.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageRead {
    pub image_id: String,
    pub read_seq: u64,
}

fn role(message: &ss::Message) -> &'static str {
    use ss::message::Body;
    match &message.body {
        Some(Body::User(_)) => "user",
        Some(Body::Assistant(_)) => "assistant",
        Some(Body::ToolCall(_)) => "tool_call",
        Some(Body::ToolResult(_)) => "tool_result",
        Some(Body::Error(_)) => "error",
        None => "unknown",
    }
}

/// Returns a page of the caller's recent conversations.
pub async fn recent(peers: &Peers, ctx: &RequestContext, query: RecentQuery) -> Result<RecentList, ApiError> {
    let call = ctx.request(ss::ListRecentConversationsRequest {
        page_size: query.page_size.unwrap_or_default(),
        page_token: query.page_token.unwrap_or_default(),
    });
    let page = peers.session.list_recent_conversations(call).await?.into_inner();
    // Which of them run: the tenant's running agents, one call.
    let agents = peers
        .runtime
        .list_agents(ctx.request(rt::ListAgentsRequest { container_id: None }))
        .await?
        .into_inner()
        .agents;
    let running: HashMap<String, String> = agents
        .into_iter()
        .map(|agent| (agent.image_id, agent.agent_id))
        .collect();
    Ok(RecentList {
        conversations: page
            .conversations
            .into_iter()
            .map(|row| {
                let agent_id = running.get(&row.image_id).cloned();
                let last_message = row.last_message.map(|message| LastMessage {
                    role: role(&message),
                    id: message.message_id,
                    seq: message.seq,
                    preview: row.preview,
                    timestamp: message.created_at_ms,
                });
                RecentConversation {
                    online: agent_id.is_some(),
                    agent_id,
                    agent_state: agent_state_name(row.agent_state),
                    image_id: row.image_id,
                    container_id: row.container_id,
                    session_id: row.session_id,
                    name: row.name,
                    created_at: row.created_at_ms,
                    last_active_at: row.last_active_at_ms,
                    last_message,
                    unread_count: row.unread_count,
                    read_seq: row.read_seq,
                }
            })
            .collect(),
        next_page_token: Some(page.next_page_token).filter(|token| !token.is_empty()),
    })
}

/// Marks a conversation read by the caller.
pub async fn mark_read(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    mark: ReadMark,
) -> Result<ImageRead, ApiError> {
    let call = ctx.request(ss::MarkImageReadRequest {
        image_id: image_id.clone(),
        seq: mark.seq,
    });
    let read = peers.session.mark_image_read(call).await?.into_inner();
    Ok(ImageRead {
        image_id,
        read_seq: read.read_seq,
    })
}
