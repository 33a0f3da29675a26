//! Envelopes of the public protocol: events (for WebSocket frames and SSE
//! data alike), `<x>_response` frames and system errors.

use avm_common::ApiError;
use avm_proto::runtime::v1 as rt;
use serde_json::{Value, json};

/// The runtime's mark of where in a session's stream it accepted a message
/// (with the request's id); turned into the sender's `message_send_response`
/// and never relayed as an event.
pub const MESSAGE_ACCEPTED: &str = "message_accepted";

/// Returns the envelope's `source` and `category` for an event type.
fn classify(kind: &str) -> (&'static str, &'static str) {
    match kind {
        "message_start" | "text_delta" | "tool_use_start" | "input_json_delta" | "tool_use_stop" | "message_delta"
        | "message_stop" | "tool_result" | "error_received" => ("agent", "stream"),
        "conversation_start"
        | "conversation_responding"
        | "conversation_end"
        | "tool_planned"
        | "tool_executing"
        | "error_occurred" => ("agent", "state"),
        "assistant_message" | "tool_call_message" | "tool_result_message" | "error_message" => ("agent", "message"),
        "interrupted" => ("agent", "lifecycle"),
        "message_persisted" => ("session", "persist"),
        "session_destroyed" => ("session", "lifecycle"),
        "system_error" => ("container", "error"),
        _ => ("container", "lifecycle"),
    }
}

/// Renders a runtime event as a protocol event frame.
///
/// The `data` object arrives serialized from the runtime and is spliced in
/// as-is, so relaying an event does not parse it.
pub fn event_frame(event: &rt::Event) -> String {
    let (source, category) = classify(&event.r#type);
    let context = event.context.as_ref().map_or(Value::Null, |c| {
        json!({"containerId": c.container_id, "imageId": c.image_id, "agentId": c.agent_id, "sessionId": c.session_id})
    });
    let data = if event.data_json.is_empty() {
        "{}"
    } else {
        event.data_json.as_str()
    };
    format!(
        r#"{{"type":{},"timestamp":{},"data":{},"source":"{}","category":"{}","intent":"notification","context":{},"cursor":{}}}"#,
        Value::String(event.r#type.clone()),
        event.timestamp_ms,
        data,
        source,
        category,
        context,
        Value::String(event.cursor.clone()),
    )
}

/// Renders a successful `<x>_response`.
pub fn response_frame(kind: &str, request_id: &Value, mut data: Value) -> String {
    if let Value::Object(map) = &mut data {
        map.insert("requestId".to_owned(), request_id.clone());
    }
    json!({
        "type": format!("{kind}_response"),
        "timestamp": avm_common::now_ms(),
        "data": data,
        "source": "command",
        "category": "response",
        "intent": "result",
    })
    .to_string()
}

/// Renders a failed `<x>_response` with the error message and stable code.
pub fn error_response_frame(kind: &str, request_id: &Value, error: &ApiError) -> String {
    response_frame(kind, request_id, json!({"error": error.message, "code": error.reason}))
}

/// Renders a `system_error` event.
pub fn system_error_frame(error: &ApiError, request_id: Option<&Value>) -> String {
    let mut data = json!({"message": error.message, "code": error.reason, "severity": "error"});
    if let Some(id) = request_id {
        data["requestId"] = id.clone();
    }
    json!({
        "type": "system_error",
        "timestamp": avm_common::now_ms(),
        "data": data,
        "source": "container",
        "category": "error",
        "intent": "notification",
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_frames_are_valid_json_with_the_envelope_fields() {
        let event = rt::Event {
            r#type: "text_delta".into(),
            cursor: "42".into(),
            timestamp_ms: 7,
            context: Some(rt::EventContext {
                container_id: "c".into(),
                image_id: "img_1".into(),
                agent_id: "agent_1".into(),
                session_id: "sess_1".into(),
            }),
            data_json: r#"{"text":"hé \"q\""}"#.into(),
        };
        let frame: Value = serde_json::from_str(&event_frame(&event)).expect("valid json");
        assert_eq!(frame["type"], "text_delta");
        assert_eq!(frame["category"], "stream");
        assert_eq!(frame["source"], "agent");
        assert_eq!(frame["data"]["text"], "hé \"q\"");
        assert_eq!(frame["context"]["imageId"], "img_1");
        assert_eq!(frame["cursor"], "42");
    }
}
