//! Messages as the public protocol shows them (PROTOCOL.md, "Message
//! objects"), and user content decoded once, here at the edge, into the
//! typed parts every service passes on.

use avm_proto::session::v1 as ss;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::reasoned;

/// One part of a message: text, an image or a file (base64).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum ContentPart {
    Text {
        text: String,
    },
    Image {
        data: String,
        #[serde(rename = "mediaType")]
        media_type: String,
    },
    File {
        data: String,
        #[serde(rename = "mediaType")]
        media_type: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        filename: Option<String>,
    },
}

/// A message's content: text, or a list of parts.
///
/// Decoding checks the shape only (a part has a known type and its fields
/// are strings); what makes content acceptable — not empty, within size,
/// images and files complete — is the runtime's rule, the same for every caller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Value::deserialize(deserializer)? {
            Value::String(text) => Ok(MessageContent::Text(text)),
            Value::Array(parts) => parts
                .iter()
                .map(part)
                .collect::<Result<Vec<_>, _>>()
                .map(MessageContent::Parts)
                .map_err(|(reason, message)| reasoned(reason, message)),
            _ => Err(reasoned(
                "INVALID_CONTENT",
                "content must be a string or a list of parts",
            )),
        }
    }
}

/// Decodes one part; a field of an image or a file that is absent (or not a
/// string) stays empty, for the runtime to refuse by name. A field its type
/// does not have is `UNKNOWN_FIELD`, as in every body: a typo is not dropped.
fn part(value: &Value) -> Result<ContentPart, (&'static str, String)> {
    let invalid = |message: String| ("INVALID_CONTENT", message);
    let kind = value.get("type").and_then(Value::as_str);
    let known: &[&str] = match kind {
        Some("text") => &["type", "text"],
        Some("image") => &["type", "data", "mediaType"],
        Some("file") => &["type", "data", "mediaType", "filename"],
        Some(other) => {
            let other: String = other.chars().take(64).collect();
            return Err(invalid(format!("content part has unknown type {other:?}")));
        }
        None => return Err(invalid("content part needs a `type`".to_owned())),
    };
    if let Some(field) = value
        .as_object()
        .and_then(|fields| fields.keys().find(|field| !known.contains(&field.as_str())))
    {
        let field: String = field.chars().take(64).collect();
        let known = known.join(", ");
        return Err((
            "UNKNOWN_FIELD",
            format!("content part field `{field}` is not a field here (known: {known})"),
        ));
    }
    let text = |name: &str| value.get(name).and_then(Value::as_str).map(str::to_owned);
    match kind {
        Some("text") => text("text")
            .map(|text| ContentPart::Text { text })
            .ok_or_else(|| invalid("content part of type text needs a string `text`".to_owned())),
        Some("image") => Ok(ContentPart::Image {
            data: text("data").unwrap_or_default(),
            media_type: text("mediaType").unwrap_or_default(),
        }),
        // Only `file` is left: every other type was refused above.
        _ => Ok(ContentPart::File {
            data: text("data").unwrap_or_default(),
            media_type: text("mediaType").unwrap_or_default(),
            filename: text("filename"),
        }),
    }
}

impl MessageContent {
    /// Returns the content as the services carry it: parts, and whether it was plain text.
    pub fn into_parts(self) -> (Vec<ss::ContentPart>, bool) {
        use ss::content_part::Part;
        let part = |part: Part| ss::ContentPart { part: Some(part) };
        match self {
            MessageContent::Text(text) => (vec![part(Part::Text(ss::TextPart { text }))], true),
            MessageContent::Parts(parts) => (
                parts
                    .into_iter()
                    .map(|content| {
                        part(match content {
                            ContentPart::Text { text } => Part::Text(ss::TextPart { text }),
                            ContentPart::Image { data, media_type } => Part::Image(ss::ImagePart { data, media_type }),
                            ContentPart::File {
                                data,
                                media_type,
                                filename,
                            } => Part::File(ss::FilePart {
                                data,
                                media_type,
                                filename,
                            }),
                        })
                    })
                    .collect(),
                false,
            ),
        }
    }

    fn from_parts(parts: Vec<ss::ContentPart>, plain_text: bool) -> Self {
        use ss::content_part::Part;
        let parts: Vec<ContentPart> = parts
            .into_iter()
            .filter_map(|part| {
                Some(match part.part? {
                    Part::Text(text) => ContentPart::Text { text: text.text },
                    Part::Image(image) => ContentPart::Image {
                        data: image.data,
                        media_type: image.media_type,
                    },
                    Part::File(file) => ContentPart::File {
                        data: file.data,
                        media_type: file.media_type,
                        filename: file.filename,
                    },
                })
            })
            .collect();
        match (plain_text, parts.as_slice()) {
            (true, [ContentPart::Text { text }]) => MessageContent::Text(text.clone()),
            _ => MessageContent::Parts(parts),
        }
    }
}

/// A message of the history, or of a `*_message` event.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum MessageObject {
    User(UserMessage),
    Assistant(AssistantMessage),
    ToolCall(ToolCallMessage),
    ToolResult(ToolResultMessage),
    Error(ErrorMessage),
}

/// What a user sent.
#[derive(Debug, Serialize, ToSchema)]
pub struct UserMessage {
    pub id: String,
    /// `user`.
    pub role: &'static str,
    /// `user`.
    pub subtype: &'static str,
    pub content: MessageContent,
    /// Unix milliseconds.
    pub timestamp: i64,
}

/// Text of an assistant reply.
#[derive(Debug, Serialize, ToSchema)]
pub struct TextBlock {
    /// `text`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub text: String,
}

/// Token counts of a reply.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// A complete (or interrupted) assistant reply.
#[derive(Debug, Serialize, ToSchema)]
pub struct AssistantMessage {
    pub id: String,
    /// `assistant`.
    pub role: &'static str,
    /// `assistant`.
    pub subtype: &'static str,
    pub content: Vec<TextBlock>,
    pub timestamp: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<TokenUsage>,
    /// Set when the reply was interrupted.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub interrupted: bool,
    /// The exact resources (`resource://…@<version>`) the turn ran with.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<String>,
}

/// A tool call the assistant made.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ToolCallMessage {
    pub id: String,
    /// `assistant`.
    pub role: &'static str,
    /// `tool-call`.
    pub subtype: &'static str,
    pub tool_call: ToolCall,
    pub timestamp: i64,
    pub parent_id: String,
}

/// The call itself.
#[derive(Debug, Serialize, ToSchema)]
pub struct ToolCall {
    /// `tool-call`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub id: String,
    pub name: String,
    #[schema(value_type = Object)]
    pub input: Value,
}

/// The outcome of a tool call.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ToolResultMessage {
    pub id: String,
    /// `tool`.
    pub role: &'static str,
    /// `tool-result`.
    pub subtype: &'static str,
    pub tool_call_id: String,
    pub tool_result: ToolResult,
    pub timestamp: i64,
}

/// The result itself.
#[derive(Debug, Serialize, ToSchema)]
pub struct ToolResult {
    /// `tool-result`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub id: String,
    pub name: String,
    pub output: ToolOutput,
}

/// What a tool answered.
#[derive(Debug, Serialize, ToSchema)]
pub struct ToolOutput {
    /// `text`, or `error-text` for a failure.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub value: String,
}

/// A turn that failed.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ErrorMessage {
    pub id: String,
    /// `error`.
    pub role: &'static str,
    /// `error`.
    pub subtype: &'static str,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    pub timestamp: i64,
}

impl MessageObject {
    /// Renders a stored message; `None` for one without a body.
    pub fn new(message: ss::Message) -> Option<Self> {
        use ss::message::Body;
        let (id, timestamp) = (message.message_id, message.created_at_ms);
        Some(match message.body? {
            Body::User(user) => MessageObject::User(UserMessage {
                id,
                role: "user",
                subtype: "user",
                content: MessageContent::from_parts(user.content, user.plain_text),
                timestamp,
            }),
            Body::Assistant(reply) => MessageObject::Assistant(AssistantMessage {
                id,
                role: "assistant",
                subtype: "assistant",
                content: vec![TextBlock {
                    kind: "text",
                    text: reply.text,
                }],
                timestamp,
                usage: reply.usage.map(|usage| TokenUsage {
                    input_tokens: usage.input_tokens,
                    output_tokens: usage.output_tokens,
                }),
                interrupted: reply.interrupted,
                resources: reply.resources,
            }),
            Body::ToolCall(call) => MessageObject::ToolCall(ToolCallMessage {
                role: "assistant",
                subtype: "tool-call",
                tool_call: ToolCall {
                    kind: "tool-call",
                    id: call.tool_call_id,
                    name: call.tool_name,
                    input: serde_json::from_str(&call.input_json).unwrap_or(Value::Null),
                },
                id,
                timestamp,
                parent_id: call.parent_id,
            }),
            Body::ToolResult(result) => MessageObject::ToolResult(ToolResultMessage {
                id,
                role: "tool",
                subtype: "tool-result",
                tool_result: ToolResult {
                    kind: "tool-result",
                    id: result.tool_call_id.clone(),
                    name: result.tool_name,
                    output: ToolOutput {
                        kind: if result.is_error { "error-text" } else { "text" },
                        value: result.output,
                    },
                },
                tool_call_id: result.tool_call_id,
                timestamp,
            }),
            Body::Error(error) => MessageObject::Error(ErrorMessage {
                id,
                role: "error",
                subtype: "error",
                content: error.text,
                error_code: Some(error.error_code).filter(|code| !code.is_empty()),
                timestamp,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn decode(value: Value) -> Result<MessageContent, (String, String)> {
        #[derive(Deserialize)]
        struct Body {
            content: MessageContent,
        }
        crate::api::decode::<Body>(json!({"content": value}))
            .map(|body| body.content)
            .map_err(|err| (err.reason.into_owned(), err.message))
    }

    #[test]
    fn content_is_text_or_parts_of_known_types() {
        assert_eq!(decode(json!("hi")), Ok(MessageContent::Text("hi".into())));
        let parts = decode(
            json!([{"type": "text", "text": "look"}, {"type": "image", "data": "AAA=", "mediaType": "image/png"}]),
        );
        assert!(
            matches!(parts, Ok(MessageContent::Parts(ref p)) if p.len() == 2),
            "{parts:?}"
        );
        for bad in [
            json!(42),
            json!({"text": "x"}),
            json!([{"type": "video"}]),
            json!([{"text": "x"}]),
            json!([{"type": "text"}]),
        ] {
            assert_eq!(
                decode(bad.clone()).err().map(|e| e.0),
                Some("INVALID_CONTENT".to_owned()),
                "{bad}"
            );
        }
        // Issue 26 item 22: a misspelt field of a part is refused, not dropped.
        for typo in [
            json!([{"type": "text", "txt": "x", "text": "y"}]),
            json!([{"type": "image", "data": "AAA=", "mimeType": "image/png"}]),
            json!([{"type": "file", "data": "AAA=", "mediaType": "text/plain", "fileName": "a.txt"}]),
        ] {
            let refused = decode(typo.clone()).err();
            assert_eq!(refused.as_ref().map(|e| e.0.as_str()), Some("UNKNOWN_FIELD"), "{typo}");
            assert!(refused.is_some_and(|e| e.1.contains("not a field here")), "{typo}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_content_decodes_or_is_refused_with_a_reason(value in crate::testing::json()) {
            if let Err((reason, message)) = decode(value.clone()) {
                proptest::prop_assert!(
                    // NUL is refused in any text before decoding (issue 26 item 16).
                    ["INVALID_CONTENT", "UNKNOWN_FIELD", "MISSING_FIELD", "NUL_CHARACTER"].contains(&reason.as_str()),
                    "{value} refused as {reason}: {message}"
                );
                proptest::prop_assert!(!message.is_empty());
            }
        }

        #[test]
        fn any_list_of_parts_decodes_or_names_the_part(parts in proptest::collection::vec(crate::testing::object(), 0..4)) {
            let value = Value::Array(parts);
            if let Err((reason, _)) = decode(value.clone()) {
                proptest::prop_assert!(["INVALID_CONTENT", "UNKNOWN_FIELD", "NUL_CHARACTER"].contains(&reason.as_str()), "{} {}", reason, value);
            }
        }

        #[test]
        fn content_round_trips_through_json_and_storage(content in crate::testing::content()) {
            let sent = serde_json::to_value(&content).unwrap_or_default();
            // Text holding NUL is refused at the edge (issue 26 item 16).
            proptest::prop_assume!(!sent.to_string().contains("\\u0000"));
            proptest::prop_assert_eq!(decode(sent), Ok(content.clone()));
            let (parts, plain) = content.clone().into_parts();
            proptest::prop_assert_eq!(MessageContent::from_parts(parts, plain), content);
        }
    }

    #[test]
    fn stored_content_shows_as_it_was_sent() {
        let sent =
            decode(json!([{"type": "file", "data": "JVBE", "mediaType": "application/pdf", "filename": "a.pdf"}]));
        let Ok(sent) = sent else { panic!("{sent:?}") };
        let (parts, plain) = sent.clone().into_parts();
        assert_eq!(MessageContent::from_parts(parts, plain), sent);
        let (parts, plain) = MessageContent::Text("hello".into()).into_parts();
        assert_eq!(
            serde_json::to_value(MessageContent::from_parts(parts, plain)).unwrap_or_default(),
            json!("hello")
        );
    }
}
