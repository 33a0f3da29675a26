//! Envelopes of the public protocol: events (for WebSocket frames and SSE
//! data alike), `<x>_response` frames and system errors.

use avm_common::ApiError;
use avm_common::event::{Event, EventKind, data};
use avm_proto::runtime::v1 as rt;
use serde_json::{Value, json};

/// Parses a client's text frame: a JSON object, or `INVALID_JSON`.
///
/// The frame's own fields (`sessionId`, `groupId`, `afterCursor`, …) are
/// bounded here; a request's `data` is bounded where it is decoded, so the
/// refusal still answers that request.
pub fn parse_frame(text: &str) -> Result<Value, ApiError> {
    match serde_json::from_str(text) {
        Ok(Value::Object(fields)) => {
            crate::bounds::check_fields(fields.iter().filter(|(name, _)| *name != "data"))?;
            Ok(Value::Object(fields))
        }
        _ => Err(ApiError::invalid("INVALID_JSON", "frame is not a JSON object")),
    }
}

/// Returns a frame's `type`, or `MISSING_TYPE`.
pub fn frame_type(frame: &Value) -> Result<&str, ApiError> {
    frame
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid("MISSING_TYPE", "frame has no string `type`"))
}

/// Returns a `<x>_request` frame's `data.requestId` (null when absent, so
/// even a refused request is answered with what the client sent) and its
/// `data` without the `requestId`, or why the request cannot run.
pub fn request_data(frame: &Value) -> (Value, Result<Value, ApiError>) {
    let data = frame.get("data").cloned().unwrap_or(Value::Null);
    let request_id = data.get("requestId").cloned().unwrap_or(Value::Null);
    if !request_id.is_string() {
        let err = ApiError::invalid("MISSING_REQUEST_ID", "data.requestId must be a string");
        return (request_id, Err(err));
    }
    if !data.is_object() {
        let err = ApiError::invalid("INVALID_DATA", "`data` must be an object");
        return (request_id, Err(err));
    }
    // The request id is the envelope's, not the operation's: it leaves
    // `data` so each request type can refuse every field it does not know.
    let mut data = data;
    if let Some(fields) = data.as_object_mut() {
        fields.remove("requestId");
    }
    (request_id, Ok(data))
}

/// Returns what a runtime event is; `None` for a kind this build does not know.
pub fn kind(event: &rt::Event) -> Option<EventKind> {
    EventKind::parse(&event.r#type)
}

/// Renders a runtime event as a protocol event frame.
///
/// The `data` object arrives serialized from the runtime and is spliced in
/// as-is, so relaying an event does not parse it.
pub fn event_frame(event: &rt::Event) -> String {
    // A kind of a newer runtime is relayed as it came, as a container event.
    let (source, category) = kind(event).map_or(("container", "lifecycle"), |kind| (kind.source(), kind.category()));
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

/// Renders an event the gateway makes (a user feed's, a subscription's
/// history): the protocol's envelope, without a cursor (it belongs to no
/// session's stream).
pub fn notification_frame(event: &avm_common::event::Event, context: serde_json::Value) -> String {
    let kind = event.kind();
    format!(
        r#"{{"type":"{}","timestamp":{},"data":{},"source":"{}","category":"{}","intent":"notification","context":{}}}"#,
        kind.name(),
        avm_common::now_ms(),
        event.data_json(),
        kind.source(),
        kind.category(),
        context,
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
    let error = Event::from(data::SystemError {
        message: error.message.clone(),
        code: error.reason.to_string(),
        request_id: request_id.cloned(),
        severity: "error".to_owned(),
    });
    let kind = error.kind();
    format!(
        r#"{{"type":"{}","timestamp":{},"data":{},"source":"{}","category":"{}","intent":"notification"}}"#,
        kind.name(),
        avm_common::now_ms(),
        error.data_json(),
        kind.source(),
        kind.category(),
    )
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::testing::{json, text};

    /// Request ids as clients send them: usually strings, sometimes not
    /// (floats left out: serde_json rounds some when parsing).
    fn request_id() -> impl Strategy<Value = Value> {
        prop_oneof![
            4 => text().prop_map(Value::String),
            1 => any::<i64>().prop_map(Value::from),
            1 => any::<bool>().prop_map(Value::Bool),
            1 => Just(Value::Null),
            1 => prop::collection::vec(text().prop_map(Value::String), 0..3).prop_map(Value::Array),
        ]
    }

    proptest! {
        #[test]
        fn event_frames_carry_any_strings_and_data_intact(
            kind in text(),
            cursor in text(),
            ids in (text(), text(), text(), text()),
            data in json(),
            timestamp_ms in any::<i64>(),
        ) {
            let event = rt::Event {
                r#type: kind.clone(),
                cursor: cursor.clone(),
                timestamp_ms,
                context: Some(rt::EventContext {
                    container_id: ids.0.clone(),
                    image_id: ids.1.clone(),
                    agent_id: ids.2,
                    session_id: ids.3,
                }),
                data_json: data.to_string(),
                ..rt::Event::default()
            };
            let frame: Value = serde_json::from_str(&event_frame(&event)).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&frame["type"], &Value::String(kind));
            prop_assert_eq!(&frame["cursor"], &Value::String(cursor));
            prop_assert_eq!(&frame["timestamp"], &Value::from(timestamp_ms));
            prop_assert_eq!(&frame["context"]["containerId"], &Value::String(ids.0));
            prop_assert_eq!(&frame["context"]["imageId"], &Value::String(ids.1));
            // Spliced unparsed: the frame holds the runtime's text exactly (read
            // back the same way, as serde_json rounds some floats when parsing).
            let sent: Value = serde_json::from_str(&event.data_json).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&frame["data"], &sent);
        }

        #[test]
        fn response_and_error_frames_answer_any_request_id(kind in text(), request_id in request_id(), reason in "[A-Z_]{1,20}", message in text()) {
            let frame: Value = serde_json::from_str(&response_frame(&kind, &request_id, serde_json::json!({"ok": true})))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&frame["type"], &Value::String(format!("{kind}_response")));
            prop_assert_eq!(&frame["data"]["requestId"], &request_id);
            let err = ApiError::invalid("X", message.clone());
            let err = ApiError::new(err.code, reason.clone(), err.message);
            let frame: Value = serde_json::from_str(&error_response_frame(&kind, &request_id, &err))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&frame["data"]["code"], &Value::String(reason.clone()));
            prop_assert_eq!(&frame["data"]["error"], &Value::String(message));
            prop_assert_eq!(&frame["data"]["requestId"], &request_id);
            let frame: Value = serde_json::from_str(&system_error_frame(&err, Some(&request_id)))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&frame["data"]["code"], &Value::String(reason));
            prop_assert_eq!(&frame["data"]["requestId"], &request_id);
        }
    }

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
            ..rt::Event::default()
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
