//! The events of a session as the runtime keeps and relays them.

use std::sync::Arc;

use avm_common::event::{Event, EventKind};
use serde::{Deserialize, Serialize};

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
    pub kind: EventKind,
    pub cursor: u64,
    pub timestamp_ms: i64,
    pub context: Arc<EventContext>,
    /// The protocol `data` object, serialized once.
    pub data_json: String,
    /// Boxed, as most events have none: the replay window keeps many.
    pub detail: Option<Box<Detail>>,
}

impl SessionEvent {
    /// Returns whether this event ends a turn.
    pub fn ends_turn(&self) -> bool {
        self.kind.ends_turn()
    }
}

/// What readers of an event in this mesh need of it besides its kind,
/// typed, so none of them reads its JSON back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Detail {
    /// A `message_accepted`'s request id: the request it answers.
    Request(Box<str>),
    /// A `group_message`'s position in its group.
    Seq(u64),
    /// An `error_occurred` that retrying would not fix: `code: message`.
    Unrecoverable(Box<str>),
}

impl Detail {
    /// Takes what readers need of `event`, if anything.
    pub fn of(event: &Event) -> Option<Box<Self>> {
        let detail = match event {
            Event::MessageAccepted(accepted) => Detail::Request(accepted.request_id.as_str().into()),
            Event::GroupMessage(message) => Detail::Seq(message.seq),
            Event::ErrorOccurred(error) if !error.recoverable => {
                Detail::Unrecoverable(format!("{}: {}", error.code, error.message).into())
            }
            _ => return None,
        };
        Some(Box::new(detail))
    }
}
