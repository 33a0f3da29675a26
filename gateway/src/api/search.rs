//! Search: the messages and conversation names the caller may read that hold
//! every word of a query, best first, with highlighted snippets.

use avm_common::{ApiError, RequestContext};
use avm_proto::session::v1 as pb;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::peers::Peers;

/// What to look for, and where. Other fields are refused; the WebSocket
/// request's `requestId` is taken off before.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct SearchQuery {
    /// Words that must all appear, case aside; words in double quotes must
    /// appear together as written. At most 512 bytes and 16 words or phrases.
    pub q: String,
    /// Only this container's conversations.
    pub container_id: Option<String>,
    /// Only this conversation.
    pub image_id: Option<String>,
    /// Only messages of this kind: `user`, `assistant`, `tool_call`,
    /// `tool_result` or `error`. Conversation names are searched only without it.
    pub role: Option<String>,
    /// Only what was written at or after this instant (Unix ms).
    pub from: Option<i64>,
    /// Only what was written before this instant (Unix ms).
    pub to: Option<i64>,
    /// Hits per page (default 20, at most 100).
    pub page_size: Option<u32>,
    /// The previous page's `nextPageToken`.
    pub page_token: Option<String>,
}

/// A message, or a conversation's name, that matched.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SearchHit {
    pub container_id: String,
    pub image_id: String,
    pub session_id: String,
    /// The conversation's name.
    pub image_name: String,
    /// Higher is better; comparable within one search.
    pub score: f64,
    /// When the message was written, or the conversation created (Unix ms).
    pub timestamp: i64,
    /// The message; absent when the conversation's name matched.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// The message's kind: `user`, `assistant`, `tool_call`, `tool_result` or `error`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Words around the first match, HTML-escaped, each matching word inside
    /// `<mark>`…`</mark>` (the only markup).
    pub snippet: String,
}

/// A page of hits, best first.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SearchResults {
    pub hits: Vec<SearchHit>,
    /// Absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

/// Searches what the caller may read.
pub async fn search(peers: &Peers, ctx: &RequestContext, query: SearchQuery) -> Result<SearchResults, ApiError> {
    let call = ctx.request(pb::SearchMessagesRequest {
        query: query.q,
        container_id: query.container_id,
        image_id: query.image_id,
        role: query.role,
        from_ms: query.from,
        to_ms: query.to,
        page_size: query.page_size.unwrap_or_default(),
        page_token: query.page_token.unwrap_or_default(),
    });
    let page = peers.session.search_messages(call).await?.into_inner();
    Ok(SearchResults {
        hits: page
            .hits
            .into_iter()
            .map(|hit| SearchHit {
                container_id: hit.container_id,
                image_id: hit.image_id,
                session_id: hit.session_id,
                image_name: hit.image_name,
                score: hit.score,
                timestamp: hit.at_ms,
                message_id: hit.message_id,
                seq: hit.seq,
                role: hit.role,
                snippet: hit.snippet,
            })
            .collect(),
        next_page_token: Some(page.next_page_token).filter(|token| !token.is_empty()),
    })
}
