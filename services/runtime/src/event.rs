//! The events of a session as the runtime keeps and relays them.

use std::sync::{Arc, Mutex};

/// Which conversation an event belongs to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventContext {
    pub container_id: String,
    pub image_id: String,
    pub agent_id: String,
    pub session_id: String,
}

/// One event of a session, in the protocol's vocabulary.
#[derive(Debug)]
pub struct SessionEvent {
    /// The protocol event type, e.g. `text_delta`.
    pub kind: &'static str,
    pub cursor: u64,
    pub timestamp_ms: i64,
    pub context: Arc<EventContext>,
    /// The protocol `data` object, serialized once.
    pub data_json: String,
}

impl SessionEvent {
    /// Returns whether this event ends a turn.
    pub fn ends_turn(&self) -> bool {
        matches!(self.kind, "conversation_end" | "error_occurred")
    }
}

/// Returns the `&'static` name of an event type another replica sent: the
/// protocol's few names, each kept once.
pub(crate) fn intern(kind: &str) -> &'static str {
    static KINDS: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut kinds = KINDS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(known) = kinds.iter().find(|known| **known == kind) {
        return known;
    }
    if kinds.len() >= 256 {
        return "unknown";
    }
    let name: &'static str = Box::leak(kind.to_owned().into_boxed_str());
    kinds.push(name);
    name
}
