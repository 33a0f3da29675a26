//! The message objects of the public protocol (PROTOCOL.md, "Message objects"),
//! rendered from stored messages. The runtime's message events and the
//! gateway's history responses both use this, so the two never drift apart.

use avm_proto::session::v1 as pb;
use serde_json::{Value, json};

/// Renders a stored message as the protocol's message object.
pub fn message_object(message: &pb::Message) -> Value {
    let id = &message.message_id;
    let timestamp = message.created_at_ms;
    match &message.body {
        Some(pb::message::Body::User(user)) => {
            let content = serde_json::from_str::<Value>(&user.content_json)
                .unwrap_or_else(|_| Value::String(user.content_json.clone()));
            json!({"id": id, "role": "user", "subtype": "user", "content": content, "timestamp": timestamp})
        }
        Some(pb::message::Body::Assistant(assistant)) => {
            let mut object = json!({
                "id": id,
                "role": "assistant",
                "subtype": "assistant",
                "content": [{"type": "text", "text": assistant.text}],
                "timestamp": timestamp,
            });
            if let Some(usage) = &assistant.usage {
                object["usage"] = usage_object(usage);
            }
            if assistant.interrupted {
                object["interrupted"] = Value::Bool(true);
            }
            // AVM: the exact resource versions the turn ran with.
            if !assistant.resources.is_empty() {
                object["resources"] = json!(assistant.resources);
            }
            object
        }
        Some(pb::message::Body::ToolCall(call)) => {
            let input = serde_json::from_str::<Value>(&call.input_json).unwrap_or(Value::Null);
            json!({
                "id": id,
                "role": "assistant",
                "subtype": "tool-call",
                "toolCall": {"type": "tool-call", "id": call.tool_call_id, "name": call.tool_name, "input": input},
                "timestamp": timestamp,
                "parentId": call.parent_id,
            })
        }
        Some(pb::message::Body::ToolResult(result)) => {
            let kind = if result.is_error { "error-text" } else { "text" };
            json!({
                "id": id,
                "role": "tool",
                "subtype": "tool-result",
                "toolCallId": result.tool_call_id,
                "toolResult": {
                    "type": "tool-result",
                    "id": result.tool_call_id,
                    "name": result.tool_name,
                    "output": {"type": kind, "value": result.output},
                },
                "timestamp": timestamp,
            })
        }
        Some(pb::message::Body::Error(error)) => {
            let mut object =
                json!({"id": id, "role": "error", "subtype": "error", "content": error.text, "timestamp": timestamp});
            if !error.error_code.is_empty() {
                object["errorCode"] = Value::String(error.error_code.clone());
            }
            object
        }
        None => json!({"id": id, "role": "unknown", "timestamp": timestamp}),
    }
}

/// Renders token usage as `{inputTokens, outputTokens}`.
pub fn usage_object(usage: &pb::Usage) -> Value {
    json!({"inputTokens": usage.input_tokens, "outputTokens": usage.output_tokens})
}
