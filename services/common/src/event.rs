//! The events of a session (PROTOCOL.md, "Events"): one enum of what they
//! are, [`EventKind`], and one of what they say, [`Event`], each kind with
//! its typed payload. The runtime builds an [`Event`] and serialises its
//! `data` object once ([`Event::data_json`]); the gateway relays that JSON
//! and reads only the event's kind (and the typed fields the runtime's gRPC
//! `Event` carries for it), never the JSON.
//!
//! The names here are the only place an event's name is written: the
//! runtime, the gateway and the tests take them from [`EventKind::name`].

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A message object (PROTOCOL.md, "Message objects") as `image_messages`
/// returns it, rendered by the runtime that owns the message.
pub type MessageObject = Map<String, Value>;

/// The token counts of one reply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// Who posted a group message.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupSender {
    /// `user` or `agent`.
    pub kind: String,
    /// The user's id or the agent's image id.
    pub member_id: String,
}

/// Declares the events: for each, its variant, protocol name, envelope
/// `source` and `category`, and its payload's fields (camelCase on the wire).
macro_rules! events {
    ($(
        $(#[doc = $doc:literal])*
        $variant:ident = $name:literal, $source:literal, $category:literal {
            $( $(#[$attr:meta])* $field:ident : $ty:ty ),* $(,)?
        }
    )*) => {
        /// What an event is; its name is the protocol's event `type`.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum EventKind {
            $($(#[doc = $doc])* $variant,)*
        }

        impl EventKind {
            /// Every kind, in the protocol document's order.
            pub const ALL: &[EventKind] = &[$(EventKind::$variant),*];

            /// The protocol's name of the kind, e.g. `text_delta`.
            pub const fn name(self) -> &'static str {
                match self {
                    $(EventKind::$variant => $name,)*
                }
            }

            /// The kind of a protocol name; `None` for a name this build does not know.
            pub fn parse(name: &str) -> Option<Self> {
                match name {
                    $($name => Some(EventKind::$variant),)*
                    _ => None,
                }
            }

            /// The envelope's `source`: `agent`, `session` or `container`.
            pub const fn source(self) -> &'static str {
                match self {
                    $(EventKind::$variant => $source,)*
                }
            }

            /// The envelope's `category`, e.g. `stream` or `state`.
            pub const fn category(self) -> &'static str {
                match self {
                    $(EventKind::$variant => $category,)*
                }
            }
        }

        /// The payloads of the events, one type per kind, named after it.
        pub mod data {
            #[allow(unused_imports)]
            use super::*;

            $(
                $(#[doc = $doc])*
                #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
                #[serde(rename_all = "camelCase")]
                pub struct $variant {
                    $($(#[$attr])* pub $field: $ty,)*
                }
            )*
        }

        /// An event: its kind and its typed payload.
        #[derive(Clone, Debug, PartialEq)]
        pub enum Event {
            $($(#[doc = $doc])* $variant(data::$variant),)*
        }

        impl Event {
            /// What the event is.
            pub const fn kind(&self) -> EventKind {
                match self {
                    $(Event::$variant(_) => EventKind::$variant,)*
                }
            }

            /// The event's protocol `data` object, serialised.
            pub fn data_json(&self) -> String {
                let json = match self {
                    $(Event::$variant(data) => serde_json::to_string(data),)*
                };
                // Only a map with non-string keys fails, and no payload has one.
                json.unwrap_or_else(|_| "{}".to_owned())
            }

            /// Reads an event of `kind` from its `data` object.
            pub fn decode(kind: EventKind, data_json: &str) -> Result<Self, serde_json::Error> {
                Ok(match kind {
                    $(EventKind::$variant => Event::$variant(serde_json::from_str(data_json)?),)*
                })
            }
        }

        $(
            impl From<data::$variant> for Event {
                fn from(data: data::$variant) -> Self {
                    Event::$variant(data)
                }
            }
        )*
    };
}

events! {
    // Stream.
    /// A reply began.
    MessageStart = "message_start", "agent", "stream" { message_id: String, model: String }
    /// Text of the reply.
    TextDelta = "text_delta", "agent", "stream" { text: String }
    /// The model began a tool call.
    ToolUseStart = "tool_use_start", "agent", "stream" { tool_call_id: String, tool_name: String }
    /// A piece of the tool call's input, as the model writes it.
    InputJsonDelta = "input_json_delta", "agent", "stream" { partial_json: String }
    /// The tool call, complete.
    ToolUseStop = "tool_use_stop", "agent", "stream" { tool_call_id: String, tool_name: String, input: Value }
    /// The reply's token counts (AVM), before `message_stop`.
    MessageDelta = "message_delta", "agent", "stream" { usage: TokenUsage }
    /// The reply ended: `end_turn`, `tool_use`, `max_tokens` or `stop_sequence`.
    MessageStop = "message_stop", "agent", "stream" { stop_reason: String }
    /// What a tool answered.
    ToolResult = "tool_result", "agent", "stream" { tool_call_id: String, result: String, is_error: bool }
    /// The turn met an error.
    ErrorReceived = "error_received", "agent", "stream" { message: String, error_code: String }

    // State.
    /// The agent began answering.
    ConversationStart = "conversation_start", "agent", "state" { message_id: String }
    /// The agent is writing (after each text delta).
    ConversationResponding = "conversation_responding", "agent", "state" {}
    /// The turn ended: `completed` or `interrupted`.
    ConversationEnd = "conversation_end", "agent", "state" { reason: String }
    /// A tool call is planned.
    ToolPlanned = "tool_planned", "agent", "state" { tool_id: String, tool_name: String }
    /// A tool call runs.
    ToolExecuting = "tool_executing", "agent", "state" { tool_id: String, tool_name: String, input: Value }
    /// The turn failed; it ends here.
    ErrorOccurred = "error_occurred", "agent", "state" { code: String, message: String, recoverable: bool }

    // Messages: the full objects `image_messages` returns.
    /// The user's message, stored (AVM: other devices render it from this).
    UserMessage = "user_message", "session", "message" { #[serde(flatten)] message: MessageObject }
    /// The reply, stored.
    AssistantMessage = "assistant_message", "agent", "message" { #[serde(flatten)] message: MessageObject }
    /// A tool call, stored.
    ToolCallMessage = "tool_call_message", "agent", "message" { #[serde(flatten)] message: MessageObject }
    /// A tool's result, stored.
    ToolResultMessage = "tool_result_message", "agent", "message" { #[serde(flatten)] message: MessageObject }
    /// The turn's error, stored.
    ErrorMessage = "error_message", "agent", "message" { #[serde(flatten)] message: MessageObject }

    // Lifecycle and persistence.
    /// The turn was interrupted.
    Interrupted = "interrupted", "agent", "lifecycle" { agent_id: String, container_id: String }
    /// The user's message is stored.
    MessagePersisted = "message_persisted", "session", "persist" { session_id: String, message_id: String, saved_at: i64 }
    /// A container was made.
    ContainerCreated = "container_created", "container", "lifecycle" { container_id: String, created_at: i64 }
    /// AVM: a conversation was made (`record`: `imageId`, `containerId`,
    /// `sessionId`, `name`, `createdAt`, `updatedAt`).
    ImageCreated = "image_created", "container", "lifecycle" { record: Value }
    /// AVM: a conversation was renamed or changed (its `record`, as above).
    ImageUpdated = "image_updated", "container", "lifecycle" { record: Value }
    /// AVM: a conversation was deleted, with its session.
    ImageDeleted = "image_deleted", "container", "lifecycle" { image_id: String, container_id: String, session_id: String }
    /// An agent started.
    AgentRegistered = "agent_registered", "container", "lifecycle" {
        container_id: String,
        agent_id: String,
        definition_name: String,
        registered_at: i64,
    }
    /// An agent stopped.
    AgentUnregistered = "agent_unregistered", "container", "lifecycle" { container_id: String, agent_id: String }
    /// AVM: a session's stored messages (message objects, oldest first),
    /// sent once to a `subscribe` with `withHistory`, before its live events.
    ConversationHistory = "conversation_history", "session", "persist" {
        session_id: String,
        messages: Vec<MessageObject>,
    }
    /// AVM: the conversation was rewound to after `afterMessageId`, or
    /// cleared (no `afterMessageId`): `removedMessages` later messages are
    /// deleted and the agent's context is rebuilt from what is kept.
    ConversationRewound = "conversation_rewound", "session", "lifecycle" {
        image_id: String,
        session_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after_message_id: Option<String>,
        removed_messages: u64,
    }
    /// AVM: the agent's context neared the model's window: the older
    /// messages up to `throughMessageId` (`compactedMessages` of them) are
    /// replaced in what the model reads by a summary (`method` `summarized`)
    /// or left out (`dropped`). The stored history stays whole.
    ContextCompacted = "context_compacted", "session", "lifecycle" {
        image_id: String,
        session_id: String,
        through_message_id: String,
        compacted_messages: u64,
        method: String,
        tokens_before: u64,
        tokens_after: u64,
    }
    /// The session is gone.
    SessionDestroyed = "session_destroyed", "session", "lifecycle" {}
    /// Something failed outside any turn.
    SystemError = "system_error", "container", "error" {
        message: String,
        /// AVM: the error's reason, e.g. `INVALID_JSON`.
        code: String,
        /// The id of the request that failed, as the client wrote it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request_id: Option<Value>,
        severity: String,
    }

    // AVM.
    /// A `message_send` was accepted: never relayed, it answers the request.
    MessageAccepted = "message_accepted", "container", "lifecycle" {
        request_id: String,
        image_id: String,
        agent_id: String,
        user_message_id: String,
    }
    /// An MCP server of the agent changed state.
    McpServerState = "mcp_server_state", "container", "lifecycle" {
        agent_id: String,
        server: String,
        state: String,
        message: String,
    }
    /// The agent started a child agent.
    AgentSpawned = "agent_spawned", "container", "lifecycle" {
        parent_image_id: String,
        child_image_id: String,
        session_id: String,
        depth: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        group_id: Option<String>,
    }
    /// A message posted to a group.
    GroupMessage = "group_message", "container", "lifecycle" {
        group_id: String,
        message_id: String,
        seq: u64,
        sender: GroupSender,
        content: String,
        mentions: Vec<String>,
        created_at: i64,
    }
    /// A member read a group up to `readSeq`.
    GroupRead = "group_read", "container", "lifecycle" { group_id: String, member_id: String, read_seq: u64 }
    /// An agent of a group stopped on an error retrying would not fix.
    AgentError = "agent_error", "container", "lifecycle" {
        group_id: String,
        image_id: String,
        agent_state: String,
        error: String,
    }
    /// A group's agents posted too many messages in a row; they were stopped.
    GroupRunawayStopped = "group_runaway_stopped", "container", "lifecycle" {
        group_id: String,
        consecutive_agent_messages: u64,
        limit: u64,
    }
}

impl EventKind {
    /// Whether the event ends a turn for its watchers.
    pub const fn ends_turn(self) -> bool {
        matches!(self, EventKind::ConversationEnd | EventKind::ErrorOccurred)
    }
}

/// A group member's kind as events, prompts and the public API name it:
/// `agent` or `user`.
pub fn member_kind_name(kind: avm_proto::session::v1::GroupMemberKind) -> &'static str {
    match kind {
        avm_proto::session::v1::GroupMemberKind::Agent => "agent",
        _ => "user",
    }
}

impl From<&avm_proto::session::v1::GroupMessage> for data::GroupMessage {
    /// A stored group message as the `group_message` event shows it: the
    /// one mapping, for the runtime that publishes it and the gateway that
    /// replays history.
    fn from(message: &avm_proto::session::v1::GroupMessage) -> Self {
        let sender = message.sender.clone().unwrap_or_default();
        Self {
            group_id: message.group_id.clone(),
            message_id: message.message_id.clone(),
            seq: message.seq,
            sender: GroupSender {
                kind: member_kind_name(sender.kind()).to_owned(),
                member_id: sender.member_id,
            },
            content: message.content.clone(),
            mentions: message.mentions.clone(),
            created_at: message.created_at_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Every event PROTOCOL.md lists ("Events", and the AVM additions), with
    /// an example of its `data` as the document writes its fields.
    fn documented() -> Vec<(&'static str, Value)> {
        let message = json!({"id": "msg_1", "role": "assistant", "subtype": "assistant",
            "content": [{"type": "text", "text": "hi"}], "timestamp": 5});
        vec![
            ("message_start", json!({"messageId": "msg_1", "model": "m"})),
            ("text_delta", json!({"text": "hé \"q\""})),
            ("tool_use_start", json!({"toolCallId": "t1", "toolName": "bash"})),
            ("input_json_delta", json!({"partialJson": "{\"a\""})),
            (
                "tool_use_stop",
                json!({"toolCallId": "t1", "toolName": "bash", "input": {"a": 1}}),
            ),
            ("message_delta", json!({"usage": {"inputTokens": 3, "outputTokens": 4}})),
            ("message_stop", json!({"stopReason": "end_turn"})),
            (
                "tool_result",
                json!({"toolCallId": "t1", "result": "ok", "isError": false}),
            ),
            ("error_received", json!({"message": "m", "errorCode": "E"})),
            ("conversation_start", json!({"messageId": "msg_1"})),
            ("conversation_responding", json!({})),
            ("conversation_end", json!({"reason": "completed"})),
            ("tool_planned", json!({"toolId": "t1", "toolName": "bash"})),
            (
                "tool_executing",
                json!({"toolId": "t1", "toolName": "bash", "input": {}}),
            ),
            (
                "error_occurred",
                json!({"code": "E", "message": "m", "recoverable": true}),
            ),
            ("assistant_message", message.clone()),
            (
                "tool_call_message",
                json!({"id": "msg_2", "role": "assistant", "subtype": "tool-call",
                "toolCall": {"type": "tool-call", "id": "t1", "name": "bash", "input": {}},
                "timestamp": 5, "parentId": "msg_1"}),
            ),
            (
                "tool_result_message",
                json!({"id": "msg_3", "role": "tool", "subtype": "tool-result",
                "toolCallId": "t1", "toolResult": {"type": "tool-result", "id": "t1", "name": "bash",
                "output": {"type": "text", "value": "ok"}}, "timestamp": 5}),
            ),
            (
                "user_message",
                json!({"id": "msg_0", "role": "user", "subtype": "user", "content": "hi", "timestamp": 5}),
            ),
            (
                "error_message",
                json!({"id": "msg_4", "role": "error", "subtype": "error", "content": "m",
                "errorCode": "E", "timestamp": 5}),
            ),
            ("interrupted", json!({"agentId": "a", "containerId": "c"})),
            (
                "message_persisted",
                json!({"sessionId": "s", "messageId": "msg_0", "savedAt": 5}),
            ),
            ("container_created", json!({"containerId": "c", "createdAt": 5})),
            (
                "image_created",
                json!({"record": {"imageId": "i", "containerId": "c", "sessionId": "s", "name": "n",
                "createdAt": 5, "updatedAt": 5}}),
            ),
            (
                "image_updated",
                json!({"record": {"imageId": "i", "containerId": "c", "sessionId": "s", "name": "m",
                "createdAt": 5, "updatedAt": 6}}),
            ),
            (
                "image_deleted",
                json!({"imageId": "i", "containerId": "c", "sessionId": "s"}),
            ),
            (
                "agent_registered",
                json!({"containerId": "c", "agentId": "a", "definitionName": "d",
                "registeredAt": 5}),
            ),
            ("agent_unregistered", json!({"containerId": "c", "agentId": "a"})),
            ("session_destroyed", json!({})),
            (
                "conversation_history",
                json!({"sessionId": "s", "messages": [{"id": "msg_0", "role": "user", "subtype": "user",
                "content": "hi", "timestamp": 5}]}),
            ),
            (
                "conversation_rewound",
                json!({"imageId": "i", "sessionId": "s", "afterMessageId": "msg_2", "removedMessages": 4}),
            ),
            (
                "conversation_rewound",
                json!({"imageId": "i", "sessionId": "s", "removedMessages": 6}),
            ),
            (
                "context_compacted",
                json!({"imageId": "i", "sessionId": "s", "throughMessageId": "msg_9", "compactedMessages": 9,
                "method": "summarized", "tokensBefore": 9000, "tokensAfter": 900}),
            ),
            (
                "system_error",
                json!({"message": "m", "code": "E", "requestId": "r", "severity": "error"}),
            ),
            (
                "system_error",
                json!({"message": "m", "code": "E", "requestId": 7, "severity": "error"}),
            ),
            (
                "system_error",
                json!({"message": "m", "code": "E", "severity": "error"}),
            ),
            (
                "message_accepted",
                json!({"requestId": "r", "imageId": "i", "agentId": "a",
                "userMessageId": "msg_0"}),
            ),
            (
                "mcp_server_state",
                json!({"agentId": "a", "server": "gh", "state": "ready", "message": ""}),
            ),
            (
                "agent_spawned",
                json!({"parentImageId": "i", "childImageId": "j", "sessionId": "s", "depth": 1,
                "groupId": "g"}),
            ),
            (
                "agent_spawned",
                json!({"parentImageId": "i", "childImageId": "j", "sessionId": "s", "depth": 1}),
            ),
            (
                "group_message",
                json!({"groupId": "g", "messageId": "m", "seq": 2,
                "sender": {"kind": "user", "memberId": "u"}, "content": "hi", "mentions": ["i"], "createdAt": 5}),
            ),
            ("group_read", json!({"groupId": "g", "memberId": "u", "readSeq": 2})),
            (
                "agent_error",
                json!({"groupId": "g", "imageId": "i", "agentState": "error", "error": "E: m"}),
            ),
            (
                "group_runaway_stopped",
                json!({"groupId": "g", "consecutiveAgentMessages": 9, "limit": 8}),
            ),
        ]
    }

    #[test]
    fn every_documented_event_round_trips_through_the_enum() {
        let documented = documented();
        for (name, data) in &documented {
            let kind = EventKind::parse(name).unwrap_or_else(|| panic!("{name} has no kind"));
            assert_eq!(kind.name(), *name);
            let event = Event::decode(kind, &data.to_string()).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(event.kind(), kind);
            let again: Value = serde_json::from_str(&event.data_json()).expect("valid json");
            assert_eq!(&again, data, "{name} changed in the round trip");
        }
        // And the enum has no kind the document does not list.
        for kind in EventKind::ALL {
            assert!(
                documented.iter().any(|(name, _)| *name == kind.name()),
                "{} is not documented",
                kind.name()
            );
        }
    }

    #[test]
    fn a_payload_without_its_fields_or_an_unknown_name_is_refused() {
        assert!(Event::decode(EventKind::TextDelta, r#"{"text":1}"#).is_err());
        assert!(Event::decode(EventKind::ConversationEnd, r#"{}"#).is_err());
        assert!(EventKind::parse("text_delta\0").is_none());
        assert!(EventKind::parse("").is_none());
    }

    #[test]
    fn the_envelope_of_each_kind_is_the_documents() {
        assert_eq!(EventKind::TextDelta.source(), "agent");
        assert_eq!(EventKind::TextDelta.category(), "stream");
        assert_eq!(EventKind::ErrorOccurred.category(), "state");
        assert_eq!(EventKind::ToolResultMessage.category(), "message");
        assert_eq!(EventKind::MessagePersisted.source(), "session");
        assert_eq!(EventKind::MessagePersisted.category(), "persist");
        assert_eq!(EventKind::SystemError.category(), "error");
        assert!(EventKind::ConversationEnd.ends_turn() && !EventKind::MessageStop.ends_turn());
    }
}
