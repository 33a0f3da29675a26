//! The recent list: the conversations a caller may read, most recently
//! active first, each with its last message and how many messages came
//! after the caller's read marker.

use crate::error::SessionError;
use crate::record::{AgentState, MessageRecord};

/// Conversations per page when the caller does not say.
pub const DEFAULT_RECENT_PAGE_SIZE: u32 = 20;
/// The most conversations of one page.
pub const MAX_RECENT_PAGE_SIZE: u32 = 100;
/// The longest preview of a last message, in characters.
pub const PREVIEW_CHARS: usize = 200;

/// One conversation as a store reads it for the list.
#[derive(Clone, Debug, PartialEq)]
pub struct RecentRow {
    pub image_id: String,
    pub container_id: String,
    pub session_id: String,
    pub name: String,
    pub agent_state: AgentState,
    pub created_at_ms: i64,
    /// The seq of its newest message (0: none).
    pub last_seq: u64,
    /// When its last message was written, or it was made.
    pub last_active_at_ms: i64,
    /// The reader's marker: every message up to it is read.
    pub read_seq: u64,
    pub last_message: Option<MessageRecord>,
}

impl RecentRow {
    /// The messages after the reader's marker.
    pub fn unread(&self) -> u64 {
        self.last_seq.saturating_sub(self.read_seq)
    }
}

/// A page of the list.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecentPage {
    pub conversations: Vec<RecentRow>,
    /// Empty on the last page.
    pub next_page_token: String,
}

/// Returns a page token's place in the list: its last conversation's
/// activity and session id.
pub fn read_token(token: &str) -> Result<Option<(i64, String)>, SessionError> {
    if token.is_empty() {
        return Ok(None);
    }
    token
        .split_once(':')
        .and_then(|(at, session)| Some((at.parse::<i64>().ok()?, session)))
        .filter(|(_, session)| !session.is_empty() && session.len() <= crate::checks::MAX_ID_BYTES)
        .map(|(at, session)| Some((at, session.to_owned())))
        .ok_or_else(|| SessionError::invalid("INVALID_PAGE_TOKEN", "pageToken is not one this list returned"))
}

/// Returns the token of the page after `row`.
pub fn token_after(row: &RecentRow) -> String {
    format!("{}:{}", row.last_active_at_ms, row.session_id)
}

/// Returns the start of a message's text, for a list.
pub fn preview(message: &MessageRecord) -> String {
    let text = message.body.search_text();
    let mut preview: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if let Some((cut, _)) = preview.char_indices().nth(PREVIEW_CHARS) {
        preview.truncate(cut);
        preview.push('…');
    }
    preview
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_bad_ones_are_refused() {
        assert_eq!(read_token("").unwrap(), None);
        assert_eq!(read_token("17:sess_a").unwrap(), Some((17, "sess_a".to_owned())));
        for bad in ["x", "1", "a:b", "1:", &format!("1:{}", "s".repeat(200))] {
            assert!(read_token(bad).is_err(), "{bad}");
        }
    }
}
