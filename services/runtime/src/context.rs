//! Building the LLM's view of a conversation from stored messages and user content.

use avm_common::ApiError;
use avm_proto::session::v1 as pb;
use serde_json::Value;

use crate::llm::{LlmContent, LlmMessage, LlmRole};

/// Largest accepted user content, in bytes of JSON.
pub const MAX_CONTENT_BYTES: usize = 8 * 1024 * 1024;

/// Parses and validates user content: a non-empty string or a list of parts
/// (`text`, `image`, `file`) as PROTOCOL.md describes.
pub fn parse_content(content_json: &str) -> Result<Vec<LlmContent>, ApiError> {
    if content_json.len() > MAX_CONTENT_BYTES {
        return Err(ApiError::invalid("CONTENT_TOO_LARGE", "message content exceeds 8 MiB"));
    }
    let value: Value = serde_json::from_str(content_json)
        .map_err(|_| ApiError::invalid("INVALID_CONTENT", "content must be a string or a list of parts"))?;
    let parts = match value {
        Value::String(text) => vec![LlmContent::Text(text)],
        Value::Array(parts) => parts.iter().map(parse_part).collect::<Result<Vec<_>, _>>()?,
        _ => {
            return Err(ApiError::invalid(
                "INVALID_CONTENT",
                "content must be a string or a list of parts",
            ));
        }
    };
    let empty = parts
        .iter()
        .all(|part| matches!(part, LlmContent::Text(text) if text.trim().is_empty()));
    if empty {
        return Err(ApiError::invalid("EMPTY_CONTENT", "message content is empty"));
    }
    Ok(parts)
}

fn parse_part(part: &Value) -> Result<LlmContent, ApiError> {
    let field = |name: &str| part.get(name).and_then(Value::as_str).map(str::to_owned);
    let invalid = |what: &str| ApiError::invalid("INVALID_CONTENT", format!("content part {what}"));
    match part.get("type").and_then(Value::as_str) {
        Some("text") => field("text")
            .map(LlmContent::Text)
            .ok_or_else(|| invalid("of type text needs a string `text`")),
        Some("image") => Ok(LlmContent::Image {
            media_type: field("mediaType").ok_or_else(|| invalid("of type image needs `mediaType`"))?,
            data: field("data").ok_or_else(|| invalid("of type image needs base64 `data`"))?,
        }),
        Some("file") => Ok(LlmContent::File {
            media_type: field("mediaType").ok_or_else(|| invalid("of type file needs `mediaType`"))?,
            data: field("data").ok_or_else(|| invalid("of type file needs base64 `data`"))?,
            filename: field("filename"),
        }),
        Some(other) => Err(invalid(&format!("has unknown type {other:?}"))),
        None => Err(invalid("needs a `type`")),
    }
}

/// Turns stored history into alternating LLM messages.
///
/// Error messages are not part of the conversation; empty assistant messages
/// (an interrupt before any text) are skipped; consecutive messages of one
/// role (a user message whose turn failed, then another) are merged, because
/// providers expect roles to alternate.
pub fn history_to_llm(history: &[pb::Message]) -> Vec<LlmMessage> {
    let mut messages: Vec<LlmMessage> = Vec::with_capacity(history.len());
    for message in history {
        let (role, content) = match &message.body {
            Some(pb::message::Body::User(user)) => match parse_content(&user.content_json) {
                Ok(content) => (LlmRole::User, content),
                Err(_) => continue,
            },
            Some(pb::message::Body::Assistant(assistant)) if !assistant.text.is_empty() => {
                (LlmRole::Assistant, vec![LlmContent::Text(assistant.text.clone())])
            }
            _ => continue,
        };
        push_message(&mut messages, role, content);
    }
    messages
}

/// Appends to the conversation, merging into the last message when roles repeat.
pub fn push_message(messages: &mut Vec<LlmMessage>, role: LlmRole, content: Vec<LlmContent>) {
    match messages.last_mut() {
        Some(last) if last.role == role => last.content.extend(content),
        _ => messages.push(LlmMessage { role, content }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> pb::Message {
        pb::Message {
            body: Some(pb::message::Body::User(pb::UserMessage {
                content_json: Value::String(text.into()).to_string(),
            })),
            ..pb::Message::default()
        }
    }

    fn assistant(text: &str) -> pb::Message {
        pb::Message {
            body: Some(pb::message::Body::Assistant(pb::AssistantMessage {
                text: text.into(),
                ..Default::default()
            })),
            ..pb::Message::default()
        }
    }

    #[test]
    fn content_accepts_strings_and_parts_and_rejects_the_rest() {
        assert_eq!(parse_content(r#""hi""#).ok(), Some(vec![LlmContent::Text("hi".into())]));
        let parts = r#"[{"type":"text","text":"look"},{"type":"image","data":"AAA=","mediaType":"image/png"}]"#;
        assert_eq!(parse_content(parts).map(|p| p.len()).ok(), Some(2));
        for bad in [
            "42",
            "{}",
            r#"[{"type":"video"}]"#,
            r#""   ""#,
            "not json",
            r#"[{"text":"x"}]"#,
        ] {
            assert!(parse_content(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn history_alternates_and_skips_errors_and_empty_replies() {
        let error = pb::Message {
            body: Some(pb::message::Body::Error(pb::ErrorMessage {
                text: "boom".into(),
                error_code: "X".into(),
            })),
            ..pb::Message::default()
        };
        let history = [user("a"), error, user("b"), assistant(""), assistant("c"), user("d")];
        let messages = history_to_llm(&history);
        let roles: Vec<_> = messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [LlmRole::User, LlmRole::Assistant, LlmRole::User]);
        assert_eq!(messages[0].content.len(), 2);
    }
}
