//! The conversation an agent holds: its history as the LLM reads it, shared
//! with each turn's request rather than copied into it.

use std::sync::Arc;

use crate::llm::{LlmContent, LlmMessage, LlmRole};
use crate::message::{Message, MessageBody};

/// The messages an LLM request carries; a turn holds the same allocation as
/// its agent, and the agent copies it only to append while a turn still
/// holds it (a copy-on-write of the vector, never of the messages' text).
pub type History = Arc<Vec<LlmMessage>>;

/// Turns stored history into alternating LLM messages.
///
/// Error messages are not part of the conversation; empty assistant messages
/// (an interrupt before any text) are skipped; consecutive messages of one
/// role (a user message whose turn failed, then another) are merged, because
/// providers expect roles to alternate.
pub fn history_to_llm(history: &[Message]) -> History {
    let mut messages: Vec<LlmMessage> = Vec::with_capacity(history.len());
    for message in history {
        let (role, content) = match &message.body {
            MessageBody::User(content) => (LlmRole::User, content.to_llm()),
            MessageBody::Assistant(reply) if !reply.text.is_empty() => {
                (LlmRole::Assistant, vec![LlmContent::Text(reply.text.clone())])
            }
            _ => continue,
        };
        push_message(&mut messages, role, content);
    }
    Arc::new(messages)
}

/// Appends to the conversation, merging into the last message when roles repeat.
pub fn push_message(messages: &mut Vec<LlmMessage>, role: LlmRole, content: Vec<LlmContent>) {
    match messages.last_mut() {
        Some(last) if last.role == role => last.content.extend(content),
        _ => messages.push(LlmMessage { role, content }),
    }
}

/// Appends to a shared history: in place when no turn holds it any more.
pub fn append(history: &mut History, role: LlmRole, content: Vec<LlmContent>) {
    push_message(Arc::make_mut(history), role, content);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Content, Part, Reply};

    fn message(body: MessageBody) -> Message {
        Message {
            message_id: String::new(),
            session_id: String::new(),
            created_at_ms: 0,
            body,
        }
    }

    fn user(text: &str) -> Message {
        message(MessageBody::User(Content {
            parts: vec![Part::Text(text.into())],
            plain_text: true,
        }))
    }

    fn assistant(text: &str) -> Message {
        message(MessageBody::Assistant(Reply {
            text: text.into(),
            ..Reply::default()
        }))
    }

    #[test]
    fn history_alternates_and_skips_errors_and_empty_replies() {
        let error = message(MessageBody::Error {
            text: "boom".into(),
            error_code: "X".into(),
        });
        let history = [user("a"), error, user("b"), assistant(""), assistant("c"), user("d")];
        let messages = history_to_llm(&history);
        let roles: Vec<_> = messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [LlmRole::User, LlmRole::Assistant, LlmRole::User]);
        assert_eq!(messages[0].content.len(), 2);
    }

    #[test]
    fn appending_copies_only_while_a_turn_holds_the_history() {
        let mut history = history_to_llm(&[user("a")]);
        let before = Arc::as_ptr(&history);
        append(&mut history, LlmRole::Assistant, vec![LlmContent::Text("b".into())]);
        assert_eq!(Arc::as_ptr(&history), before, "nobody else held it: appended in place");
        let turn = Arc::clone(&history);
        append(&mut history, LlmRole::User, vec![LlmContent::Text("c".into())]);
        assert_eq!((turn.len(), history.len()), (2, 3), "the turn keeps what it was given");
    }
}
