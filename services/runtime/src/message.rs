//! The conversation's messages as the runtime knows them: what a user sent
//! (checked here, by the same rules whoever calls), what the agent answered,
//! and how a message shows in the session's events (PROTOCOL.md, "Message
//! objects").

use avm_common::event::{Event, TokenUsage, data};
use serde_json::{Value, json};

use crate::error::RuntimeError;
use crate::llm::{LlmContent, ToolCall, ToolOutput};

/// Largest accepted user content, in bytes of its text and data.
pub const MAX_CONTENT_BYTES: usize = 8 * 1024 * 1024;

/// One part of what a user sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Text(String),
    /// An image, base64-encoded.
    Image {
        media_type: String,
        data: String,
    },
    /// A document such as a PDF, base64-encoded.
    File {
        media_type: String,
        data: String,
        filename: Option<String>,
    },
}

/// What a user sent: its parts, and whether it was plain text (one text
/// part, shown as a string) rather than a list of parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Content {
    pub parts: Vec<Part>,
    pub plain_text: bool,
}

impl Content {
    /// Checks the content against the rules every caller meets: within
    /// size, each part complete, not empty.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        let bytes: usize = self
            .parts
            .iter()
            .map(|part| match part {
                Part::Text(text) => text.len(),
                Part::Image { media_type, data } => media_type.len() + data.len(),
                Part::File {
                    media_type,
                    data,
                    filename,
                } => media_type.len() + data.len() + filename.as_ref().map_or(0, String::len),
            })
            .sum();
        if bytes > MAX_CONTENT_BYTES {
            return Err(RuntimeError::invalid(
                "CONTENT_TOO_LARGE",
                "message content exceeds 8 MiB",
            ));
        }
        for part in &self.parts {
            let (kind, media_type, data) = match part {
                Part::Text(_) => continue,
                Part::Image { media_type, data } => ("image", media_type, data),
                Part::File { media_type, data, .. } => ("file", media_type, data),
            };
            if media_type.is_empty() {
                return Err(RuntimeError::invalid(
                    "INVALID_CONTENT",
                    format!("content part of type {kind} needs `mediaType`"),
                ));
            }
            if data.is_empty() {
                return Err(RuntimeError::invalid(
                    "INVALID_CONTENT",
                    format!("content part of type {kind} needs base64 `data`"),
                ));
            }
        }
        let empty = self
            .parts
            .iter()
            .all(|part| matches!(part, Part::Text(text) if text.trim().is_empty()));
        if empty {
            return Err(RuntimeError::invalid("EMPTY_CONTENT", "message content is empty"));
        }
        Ok(())
    }

    /// Returns the parts as an LLM request carries them.
    /// Returns the content as the protocol writes it: a string for plain
    /// text, else the list of parts.
    pub fn object(&self) -> Value {
        if self.plain_text
            && let [Part::Text(text)] = self.parts.as_slice()
        {
            return Value::String(text.clone());
        }
        let parts = self.parts.iter().map(|part| match part {
            Part::Text(text) => json!({"type": "text", "text": text}),
            Part::Image { media_type, data } => json!({"type": "image", "data": data, "mediaType": media_type}),
            Part::File {
                media_type,
                data,
                filename,
            } => {
                let mut part = json!({"type": "file", "data": data, "mediaType": media_type});
                if let Some(filename) = filename {
                    part["filename"] = Value::String(filename.clone());
                }
                part
            }
        });
        Value::Array(parts.collect())
    }

    pub fn to_llm(&self) -> Vec<LlmContent> {
        self.parts
            .iter()
            .map(|part| match part {
                Part::Text(text) => LlmContent::Text(text.clone()),
                Part::Image { media_type, data } => LlmContent::Image {
                    media_type: media_type.clone(),
                    data: data.clone(),
                },
                Part::File {
                    media_type,
                    data,
                    filename,
                } => LlmContent::File {
                    media_type: media_type.clone(),
                    data: data.clone(),
                    filename: filename.clone(),
                },
            })
            .collect()
    }
}

/// The token count an LLM reported for one reply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl Usage {
    /// Returns the protocol's `{inputTokens, outputTokens}`.
    pub fn object(&self) -> TokenUsage {
        TokenUsage {
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
        }
    }
}

/// A complete (or interrupted) assistant reply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    pub text: String,
    pub usage: Option<Usage>,
    pub interrupted: bool,
    pub model: String,
    pub stop_reason: String,
    /// The exact resources the turn ran with (`resource://…@<version>`).
    pub resources: Vec<String>,
}

/// What a message of the history says, as far as the runtime reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MessageBody {
    User(Content),
    Assistant(Reply),
    Error {
        text: String,
        error_code: String,
    },
    /// A tool call of an assistant reply (`parent_id`: the reply's message id).
    ToolCall {
        call: ToolCall,
        parent_id: String,
    },
    /// What a tool call gave back.
    ToolResult {
        output: ToolOutput,
        tool_name: String,
    },
    /// A message of a kind this runtime does not know (from a newer peer).
    Other,
}

/// One message of a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub message_id: String,
    pub session_id: String,
    /// Unix milliseconds; 0 lets the session service stamp it.
    pub created_at_ms: i64,
    pub body: MessageBody,
}

impl Message {
    /// Returns the event that shows the message: `user_message` (AVM),
    /// `assistant_message`, `tool_call_message`, `tool_result_message` or
    /// `error_message` (`None` for a kind this runtime does not know).
    pub fn event(&self) -> Option<Event> {
        let Value::Object(message) = self.object() else {
            return None;
        };
        Some(match &self.body {
            MessageBody::User(_) => data::UserMessage { message }.into(),
            MessageBody::Assistant(_) => data::AssistantMessage { message }.into(),
            MessageBody::ToolCall { .. } => data::ToolCallMessage { message }.into(),
            MessageBody::ToolResult { .. } => data::ToolResultMessage { message }.into(),
            MessageBody::Error { .. } => data::ErrorMessage { message }.into(),
            MessageBody::Other => return None,
        })
    }

    /// Returns the message as the protocol's message object (the `data` of
    /// the event that shows it).
    pub fn object(&self) -> Value {
        let (id, timestamp) = (&self.message_id, self.created_at_ms);
        match &self.body {
            MessageBody::Assistant(reply) => {
                let mut object = json!({
                    "id": id,
                    "role": "assistant",
                    "subtype": "assistant",
                    "content": [{"type": "text", "text": reply.text}],
                    "timestamp": timestamp,
                });
                if let Some(usage) = &reply.usage {
                    object["usage"] = json!(usage.object());
                }
                if reply.interrupted {
                    object["interrupted"] = Value::Bool(true);
                }
                // AVM: the exact resource versions the turn ran with.
                if !reply.resources.is_empty() {
                    object["resources"] = json!(reply.resources);
                }
                object
            }
            MessageBody::Error { text, error_code } => {
                let mut object =
                    json!({"id": id, "role": "error", "subtype": "error", "content": text, "timestamp": timestamp});
                if !error_code.is_empty() {
                    object["errorCode"] = Value::String(error_code.clone());
                }
                object
            }
            MessageBody::ToolCall { call, parent_id } => json!({
                "id": id,
                "role": "assistant",
                "subtype": "tool-call",
                "toolCall": {"type": "tool-call", "id": call.id, "name": call.name, "input": call.input},
                "timestamp": timestamp,
                "parentId": parent_id,
            }),
            MessageBody::ToolResult { output, tool_name } => json!({
                "id": id,
                "role": "tool",
                "subtype": "tool-result",
                "toolCallId": output.tool_call_id,
                "toolResult": {
                    "type": "tool-result",
                    "id": output.tool_call_id,
                    "name": tool_name,
                    "output": {"type": if output.is_error { "error-text" } else { "text" }, "value": output.text},
                },
                "timestamp": timestamp,
            }),
            MessageBody::User(content) => json!({
                "id": id,
                "role": "user",
                "subtype": "user",
                "content": content.object(),
                "timestamp": timestamp,
            }),
            MessageBody::Other => json!({"id": id, "timestamp": timestamp}),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(text: &str) -> Content {
        Content {
            parts: vec![Part::Text(text.into())],
            plain_text: true,
        }
    }

    #[test]
    fn content_is_checked_by_its_rules() {
        assert!(text("hi").validate().is_ok());
        let image = |media_type: &str, data: &str| Content {
            parts: vec![
                Part::Text("look".into()),
                Part::Image {
                    media_type: media_type.into(),
                    data: data.into(),
                },
            ],
            plain_text: false,
        };
        assert!(image("image/png", "AAA=").validate().is_ok());
        let reason = |content: Content| match content.validate() {
            Err(RuntimeError::Invalid { reason, .. }) => reason,
            other => panic!("{other:?}"),
        };
        assert_eq!(reason(image("", "AAA=")), "INVALID_CONTENT");
        assert_eq!(reason(image("image/png", "")), "INVALID_CONTENT");
        assert_eq!(reason(text("   ")), "EMPTY_CONTENT");
        assert_eq!(
            reason(Content {
                parts: Vec::new(),
                plain_text: false
            }),
            "EMPTY_CONTENT"
        );
        assert_eq!(reason(text(&"x".repeat(MAX_CONTENT_BYTES + 1))), "CONTENT_TOO_LARGE");
    }
}
