//! The Anthropic Messages API driver: `POST /v1/messages` with `stream: true`,
//! decoding the `message_start` … `message_stop` event sequence.

use std::collections::VecDeque;

use eventsource_stream::Event;
use reqwest::header::{HeaderMap, HeaderValue};
use serde::{Deserialize, Serialize};

use super::sse::{self, HttpTransport, Progress, SseDecoder};
use super::{LlmContent, LlmError, LlmEvent, LlmProvider, LlmRequest, LlmRole, LlmStream, PendingCall, StopReason};
use crate::config::LlmConfig;

/// The API root used when `base_url` is not set.
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";

/// The API version this driver speaks.
const API_VERSION: &str = "2023-06-01";

/// Streams replies from the Anthropic Messages API.
pub struct AnthropicProvider {
    transport: HttpTransport,
    model: String,
    max_tokens: u32,
}

impl AnthropicProvider {
    /// Returns a provider for `config`; fails when the base URL or the key cannot be used.
    pub fn new(config: &LlmConfig) -> Result<Self, LlmError> {
        let mut headers = HeaderMap::new();
        headers.insert("anthropic-version", HeaderValue::from_static(API_VERSION));
        if let Some(key) = sse::api_key(config) {
            headers.insert("x-api-key", sse::secret_header(key)?);
        }
        let transport = HttpTransport::new("anthropic", config, DEFAULT_BASE_URL, "v1/messages", headers)?;
        Ok(Self {
            transport,
            model: config.model.clone(),
            max_tokens: config.max_tokens,
        })
    }
}

#[async_trait::async_trait]
impl LlmProvider for AnthropicProvider {
    fn name(&self) -> &'static str {
        "anthropic"
    }

    async fn stream(&self, request: LlmRequest) -> Result<LlmStream, LlmError> {
        let body = MessagesRequest::new(&request, &self.model, self.max_tokens);
        let decoder = MessagesDecoder::new(body.model);
        self.transport.open(&body, decoder).await
    }
}

/// The request body, borrowing the conversation so that large attachments are
/// serialised straight from the request rather than copied.
#[derive(Serialize)]
struct MessagesRequest<'a> {
    model: &'a str,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<&'a str>,
    messages: Vec<Message<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
    stream: bool,
}

#[derive(Serialize)]
struct Tool<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: &'a serde_json::Value,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: Vec<ContentBlock<'a>>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ContentBlock<'a> {
    Text {
        text: &'a str,
    },
    Image {
        source: Base64Source<'a>,
    },
    Document {
        source: Base64Source<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        title: Option<&'a str>,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: &'a serde_json::Value,
    },
    ToolResult {
        tool_use_id: &'a str,
        content: &'a str,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        is_error: bool,
    },
}

#[derive(Serialize)]
struct Base64Source<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    media_type: &'a str,
    data: &'a str,
}

impl<'a> MessagesRequest<'a> {
    fn new(request: &'a LlmRequest, default_model: &'a str, default_max_tokens: u32) -> Self {
        let messages = request
            .messages
            .iter()
            .map(|message| Message {
                role: match message.role {
                    LlmRole::User => "user",
                    LlmRole::Assistant => "assistant",
                },
                content: message.content.iter().map(ContentBlock::from).collect(),
            })
            .collect();
        Self {
            model: if request.model.is_empty() {
                default_model
            } else {
                &request.model
            },
            max_tokens: if request.max_tokens == 0 {
                default_max_tokens
            } else {
                request.max_tokens
            },
            system: request.system.as_deref().filter(|system| !system.is_empty()),
            messages,
            tools: request
                .tools
                .iter()
                .map(|tool| Tool {
                    name: &tool.name,
                    description: &tool.description,
                    input_schema: &tool.input_schema,
                })
                .collect(),
            stream: true,
        }
    }
}

impl<'a> From<&'a LlmContent> for ContentBlock<'a> {
    fn from(content: &'a LlmContent) -> Self {
        match content {
            LlmContent::Text(text) => ContentBlock::Text { text },
            LlmContent::Image { media_type, data } => ContentBlock::Image {
                source: Base64Source {
                    kind: "base64",
                    media_type,
                    data,
                },
            },
            LlmContent::File {
                media_type,
                data,
                filename,
            } => ContentBlock::Document {
                source: Base64Source {
                    kind: "base64",
                    media_type,
                    data,
                },
                title: filename.as_deref(),
            },
            LlmContent::ToolUse(call) => ContentBlock::ToolUse {
                id: &call.id,
                name: &call.name,
                input: &call.input,
            },
            LlmContent::ToolResult(output) => ContentBlock::ToolResult {
                tool_use_id: &output.tool_call_id,
                content: &output.text,
                is_error: output.is_error,
            },
        }
    }
}

/// Decodes the Messages streaming events: text and tool-use blocks; `ping`,
/// thinking blocks and event types added later are skipped.
struct MessagesDecoder {
    model: String,
    started: bool,
    stop_reason: StopReason,
    /// The tool-use blocks open now, by block index.
    calls: Vec<(u64, PendingCall)>,
}

#[derive(Deserialize)]
struct ContentBlockStart {
    index: u64,
    content_block: StartedBlock,
}

#[derive(Deserialize)]
struct StartedBlock {
    #[serde(rename = "type")]
    kind: String,
    id: Option<String>,
    name: Option<String>,
}

#[derive(Deserialize)]
struct ContentBlockStop {
    index: u64,
}

#[derive(Deserialize)]
struct EventType<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
}

#[derive(Deserialize)]
struct MessageStart {
    message: MessageStartBody,
}

#[derive(Deserialize)]
struct MessageStartBody {
    model: Option<String>,
    #[serde(default)]
    usage: Usage,
}

#[derive(Default, Deserialize)]
struct Usage {
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
}

impl Usage {
    /// Returns the cache counts as an event, when any is above zero.
    fn cache_event(&self) -> Option<LlmEvent> {
        let (read, write) = (self.cache_read_input_tokens, self.cache_creation_input_tokens);
        (read.unwrap_or(0) > 0 || write.unwrap_or(0) > 0).then_some(LlmEvent::CacheUsage {
            read_tokens: read,
            write_tokens: write,
        })
    }
}

#[derive(Deserialize)]
struct ContentBlockDelta<'a> {
    #[serde(default)]
    index: u64,
    #[serde(borrow)]
    delta: Delta<'a>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
    text: Option<String>,
    partial_json: Option<String>,
}

#[derive(Deserialize)]
struct MessageDelta {
    #[serde(default)]
    delta: MessageDeltaBody,
    usage: Option<Usage>,
}

#[derive(Default, Deserialize)]
struct MessageDeltaBody {
    stop_reason: Option<String>,
}

#[derive(Deserialize)]
struct ErrorEvent {
    error: ErrorBody,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(rename = "type")]
    kind: Option<String>,
    message: Option<String>,
}

impl MessagesDecoder {
    fn new(model: &str) -> Self {
        Self {
            model: model.to_owned(),
            started: false,
            stop_reason: StopReason::EndTurn,
            calls: Vec::new(),
        }
    }

    /// Emits `Start` first even if a non-conforming server skipped `message_start`.
    fn ensure_started(&mut self, out: &mut VecDeque<LlmEvent>) {
        if !self.started {
            self.started = true;
            out.push_back(LlmEvent::Start {
                model: self.model.clone(),
                input_tokens: None,
            });
        }
    }
}

fn parse<'a, T: Deserialize<'a>>(event: &'a Event, what: &str) -> Result<T, LlmError> {
    serde_json::from_str(&event.data).map_err(|err| sse::bad_event(what, &err))
}

fn stop_reason(reason: &str) -> StopReason {
    match reason {
        "max_tokens" | "model_context_window_exceeded" => StopReason::MaxTokens,
        "stop_sequence" => StopReason::StopSequence,
        "tool_use" => StopReason::ToolUse,
        // end_turn, and pause_turn or refusal, which also end this reply.
        _ => StopReason::EndTurn,
    }
}

impl SseDecoder for MessagesDecoder {
    fn decode(&mut self, event: &Event, out: &mut VecDeque<LlmEvent>) -> Result<Progress, LlmError> {
        // The SSE event name says what the data is; a proxy that drops `event:`
        // lines leaves the same name in the data's `type`.
        let tagged;
        let name = if event.event == "message" {
            tagged = parse::<EventType<'_>>(event, "untyped")?;
            tagged.kind.as_ref()
        } else {
            event.event.as_str()
        };
        match name {
            "message_start" => {
                let start: MessageStart = parse(event, name)?;
                if !self.started {
                    self.started = true;
                    let model = start
                        .message
                        .model
                        .filter(|model| !model.is_empty())
                        .unwrap_or_else(|| self.model.clone());
                    out.push_back(LlmEvent::Start {
                        model,
                        input_tokens: start.message.usage.input_tokens,
                    });
                    out.extend(start.message.usage.cache_event());
                }
            }
            "content_block_start" => {
                let start: ContentBlockStart = parse(event, name)?;
                if start.content_block.kind == "tool_use" {
                    self.ensure_started(out);
                    let (Some(id), Some(name)) = (start.content_block.id, start.content_block.name) else {
                        return Err(LlmError::new(
                            super::LlmErrorKind::BadResponse,
                            "the LLM provider started a tool_use block without its id or name",
                        ));
                    };
                    let call = PendingCall::new(id, name);
                    out.push_back(call.start_event());
                    self.calls.push((start.index, call));
                }
            }
            "content_block_stop" => {
                let stop: ContentBlockStop = parse(event, name)?;
                if let Some(at) = self.calls.iter().position(|(index, _)| *index == stop.index) {
                    let (_, call) = self.calls.remove(at);
                    out.push_back(call.finish()?);
                }
            }
            "content_block_delta" => {
                let block: ContentBlockDelta<'_> = parse(event, name)?;
                // Text and tool input are relayed; thinking deltas are skipped.
                if block.delta.kind == "input_json_delta" {
                    let call = self.calls.iter_mut().find(|(index, _)| *index == block.index);
                    let (Some((_, call)), Some(piece)) = (call, block.delta.partial_json) else {
                        return Err(LlmError::new(
                            super::LlmErrorKind::BadResponse,
                            "the LLM provider sent tool input outside a tool_use block",
                        ));
                    };
                    out.extend(call.push(piece));
                } else if block.delta.kind == "text_delta" {
                    self.ensure_started(out);
                    match block.delta.text {
                        Some(text) if !text.is_empty() => out.push_back(LlmEvent::TextDelta(text)),
                        Some(_) => {}
                        None => {
                            return Err(LlmError::new(
                                super::LlmErrorKind::BadResponse,
                                "the LLM provider sent a text_delta without text",
                            ));
                        }
                    }
                }
            }
            "message_delta" => {
                let delta: MessageDelta = parse(event, name)?;
                self.ensure_started(out);
                if let Some(reason) = delta.delta.stop_reason.as_deref() {
                    self.stop_reason = stop_reason(reason);
                }
                if let Some(usage) = delta.usage {
                    out.push_back(LlmEvent::Usage {
                        input_tokens: usage.input_tokens,
                        output_tokens: usage.output_tokens,
                    });
                    out.extend(usage.cache_event());
                }
            }
            "message_stop" => {
                self.ensure_started(out);
                out.push_back(LlmEvent::Stop {
                    reason: self.stop_reason,
                });
                return Ok(Progress::Complete);
            }
            "error" => {
                let error: ErrorEvent = parse(event, name)?;
                return Err(sse::provider_error(
                    error.error.kind.as_deref(),
                    error.error.message.as_deref(),
                ));
            }
            _ => {}
        }
        Ok(Progress::More)
    }

    fn finish(&mut self, _out: &mut VecDeque<LlmEvent>) -> Result<(), LlmError> {
        Err(sse::ended_early())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{LlmErrorKind, LlmMessage};

    fn event(name: &str, data: &str) -> Event {
        Event {
            event: name.to_owned(),
            data: data.to_owned(),
            ..Event::default()
        }
    }

    fn decode_all(events: &[Event]) -> (Vec<LlmEvent>, Option<LlmError>) {
        let mut decoder = MessagesDecoder::new("requested-model");
        let mut out = VecDeque::new();
        for event in events {
            match decoder.decode(event, &mut out) {
                Ok(Progress::More) => {}
                Ok(Progress::Complete) => return (out.into(), None),
                Err(err) => return (out.into(), Some(err)),
            }
        }
        let err = decoder.finish(&mut out).err();
        (out.into(), err)
    }

    #[test]
    fn decodes_the_documented_sequence() {
        let (events, err) = decode_all(&[
            event(
                "message_start",
                r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-x","stop_reason":null,"usage":{"input_tokens":25,"cache_read_input_tokens":0,"output_tokens":1}}}"#,
            ),
            event(
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            ),
            event("ping", r#"{"type": "ping"}"#),
            event(
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
            ),
            event(
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}"#,
            ),
            event(
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" there"}}"#,
            ),
            event("content_block_stop", r#"{"type":"content_block_stop","index":0}"#),
            event(
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"output_tokens":2}}"#,
            ),
            event("message_stop", r#"{"type":"message_stop"}"#),
        ]);
        assert_eq!(err, None);
        assert_eq!(
            events,
            vec![
                LlmEvent::Start {
                    model: "claude-x".to_owned(),
                    input_tokens: Some(25)
                },
                LlmEvent::TextDelta("Hello".to_owned()),
                LlmEvent::TextDelta(" there".to_owned()),
                LlmEvent::Usage {
                    input_tokens: None,
                    output_tokens: Some(2)
                },
                LlmEvent::Stop {
                    reason: StopReason::MaxTokens
                },
            ]
        );
    }

    #[test]
    fn reads_the_type_when_the_event_name_is_missing() {
        let (events, err) = decode_all(&[
            event(
                "message",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}"#,
            ),
            event("message", r#"{"type":"message_stop"}"#),
        ]);
        assert_eq!(err, None);
        assert_eq!(
            events,
            vec![
                LlmEvent::Start {
                    model: "requested-model".to_owned(),
                    input_tokens: None
                },
                LlmEvent::TextDelta("hi".to_owned()),
                LlmEvent::Stop {
                    reason: StopReason::EndTurn
                },
            ]
        );
    }

    #[test]
    fn maps_error_events() {
        let (_, err) = decode_all(&[event(
            "error",
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        )]);
        let err = err.unwrap();
        assert_eq!(err.kind, LlmErrorKind::Unavailable);
        assert!(err.message.contains("Overloaded"), "{}", err.message);
    }

    #[test]
    fn rejects_malformed_and_truncated_streams() {
        let (_, err) = decode_all(&[event("content_block_delta", "{not json")]);
        assert_eq!(err.unwrap().kind, LlmErrorKind::BadResponse);
        let (_, err) = decode_all(&[event("content_block_delta", r#"{"delta":{"type":"text_delta"}}"#)]);
        assert_eq!(err.unwrap().kind, LlmErrorKind::BadResponse);
        let (events, err) = decode_all(&[event(
            "content_block_delta",
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}"#,
        )]);
        assert_eq!(events.len(), 2);
        let err = err.unwrap();
        assert_eq!(err.kind, LlmErrorKind::BadResponse);
        assert!(err.message.contains("ended early"), "{}", err.message);
    }

    #[test]
    fn encodes_the_request_body() {
        let request = LlmRequest {
            model: String::new(),
            system: Some("be brief".to_owned()),
            messages: std::sync::Arc::new(vec![LlmMessage {
                role: LlmRole::User,
                content: vec![
                    LlmContent::Text("look".to_owned()),
                    LlmContent::Image {
                        media_type: "image/png".to_owned(),
                        data: "iVBO".to_owned(),
                    },
                    LlmContent::File {
                        media_type: "application/pdf".to_owned(),
                        data: "JVBE".to_owned(),
                        filename: Some("a.pdf".to_owned()),
                    },
                ],
            }]),
            max_tokens: 0,
            tools: std::sync::Arc::default(),
        };
        let body = serde_json::to_value(MessagesRequest::new(&request, "default-model", 99)).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "model": "default-model",
                "max_tokens": 99,
                "system": "be brief",
                "stream": true,
                "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
                    {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}, "title": "a.pdf"},
                ]}],
            })
        );
    }

    #[test]
    fn decodes_tool_use_blocks() {
        let (events, err) = decode_all(&[
            event(
                "message_start",
                r#"{"type":"message_start","message":{"model":"claude","usage":{"input_tokens":9}}}"#,
            ),
            event(
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            ),
            event(
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Let me look."}}"#,
            ),
            event("content_block_stop", r#"{"type":"content_block_stop","index":0}"#),
            event(
                "content_block_start",
                r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"read_file","input":{}}}"#,
            ),
            event(
                "content_block_delta",
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"path\": \"a"}}"#,
            ),
            event(
                "content_block_delta",
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":".txt\"}"}}"#,
            ),
            event("content_block_stop", r#"{"type":"content_block_stop","index":1}"#),
            event(
                "content_block_start",
                r#"{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_2","name":"list_files","input":{}}}"#,
            ),
            event("content_block_stop", r#"{"type":"content_block_stop","index":2}"#),
            event(
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":30}}"#,
            ),
            event("message_stop", r#"{"type":"message_stop"}"#),
        ]);
        assert!(err.is_none(), "{err:?}");
        let call = |id: &str, name: &str, input: serde_json::Value| {
            LlmEvent::ToolUseStop(crate::llm::ToolCall {
                id: id.into(),
                name: name.into(),
                input,
            })
        };
        assert_eq!(
            events[1..],
            [
                LlmEvent::TextDelta("Let me look.".into()),
                LlmEvent::ToolUseStart {
                    id: "toolu_1".into(),
                    name: "read_file".into()
                },
                LlmEvent::ToolInputDelta {
                    id: "toolu_1".into(),
                    partial_json: "{\"path\": \"a".into()
                },
                LlmEvent::ToolInputDelta {
                    id: "toolu_1".into(),
                    partial_json: ".txt\"}".into()
                },
                call("toolu_1", "read_file", serde_json::json!({"path": "a.txt"})),
                LlmEvent::ToolUseStart {
                    id: "toolu_2".into(),
                    name: "list_files".into()
                },
                call("toolu_2", "list_files", serde_json::json!({})),
                LlmEvent::Usage {
                    input_tokens: None,
                    output_tokens: Some(30)
                },
                LlmEvent::Stop {
                    reason: StopReason::ToolUse
                },
            ]
        );
        let (_, err) = decode_all(&[event(
            "content_block_delta",
            r#"{"type":"content_block_delta","index":4,"delta":{"type":"input_json_delta","partial_json":"{"}}"#,
        )]);
        assert_eq!(err.map(|err| err.kind), Some(LlmErrorKind::BadResponse));
    }

    #[test]
    fn encodes_tool_calls_results_and_tools() {
        use crate::llm::{ToolCall, ToolOutput, ToolSpec};
        let request = LlmRequest {
            model: "m".to_owned(),
            system: None,
            messages: std::sync::Arc::new(vec![
                LlmMessage {
                    role: LlmRole::Assistant,
                    content: vec![
                        LlmContent::Text("Looking.".into()),
                        LlmContent::ToolUse(ToolCall {
                            id: "t1".into(),
                            name: "read_file".into(),
                            input: serde_json::json!({"path": "a"}),
                        }),
                    ],
                },
                LlmMessage {
                    role: LlmRole::User,
                    content: vec![LlmContent::ToolResult(ToolOutput {
                        tool_call_id: "t1".into(),
                        text: "no such file".into(),
                        is_error: true,
                    })],
                },
            ]),
            max_tokens: 5,
            tools: std::sync::Arc::new(vec![ToolSpec {
                name: "read_file".into(),
                description: "Reads a file.".into(),
                input_schema: serde_json::json!({"type": "object"}),
            }]),
        };
        let body = serde_json::to_value(MessagesRequest::new(&request, "d", 9)).unwrap();
        assert_eq!(
            body["messages"],
            serde_json::json!([
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "no such file", "is_error": true},
                ]},
            ])
        );
        assert_eq!(
            body["tools"],
            serde_json::json!([{"name": "read_file", "description": "Reads a file.", "input_schema": {"type": "object"}}])
        );
    }
}
