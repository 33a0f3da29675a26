//! The OpenAI Chat Completions driver, for OpenAI and any compatible server:
//! `POST {base}/chat/completions` with `stream: true`, decoding
//! `chat.completion.chunk` events up to `[DONE]`.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::fmt;

use eventsource_stream::Event;
use reqwest::header::{AUTHORIZATION, HeaderMap};
use serde::{Deserialize, Serialize, Serializer};

use super::sse::{self, HttpTransport, Progress, SseDecoder};
use super::{
    LlmContent, LlmError, LlmEvent, LlmMessage, LlmProvider, LlmRequest, LlmRole, LlmStream, PendingCall, StopReason,
};
use crate::config::LlmConfig;

/// The API root used when `base_url` is not set; by OpenAI's convention it includes `/v1`.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// Streams replies from an OpenAI-compatible Chat Completions API.
pub struct OpenAiProvider {
    transport: HttpTransport,
    model: String,
    max_tokens: u32,
}

impl OpenAiProvider {
    /// Returns a provider for `config`; fails when the base URL or the key cannot be used.
    pub fn new(config: &LlmConfig) -> Result<Self, LlmError> {
        let mut headers = HeaderMap::new();
        if let Some(key) = sse::api_key(config) {
            headers.insert(AUTHORIZATION, sse::secret_header(&format!("Bearer {key}"))?);
        }
        let transport = HttpTransport::new("openai", config, DEFAULT_BASE_URL, "chat/completions", headers)?;
        Ok(Self {
            transport,
            model: config.model.clone(),
            max_tokens: config.max_tokens,
        })
    }
}

#[async_trait::async_trait]
impl LlmProvider for OpenAiProvider {
    fn name(&self) -> &'static str {
        "openai"
    }

    async fn stream(&self, request: LlmRequest) -> Result<LlmStream, LlmError> {
        let body = ChatRequest::new(&request, &self.model, self.max_tokens);
        let decoder = ChatDecoder::new(body.model);
        self.transport.open(&body, decoder).await
    }
}

/// The request body, borrowing the conversation so that large attachments are
/// serialised straight from the request rather than copied.
#[derive(Serialize)]
struct ChatRequest<'a> {
    model: &'a str,
    max_tokens: u32,
    messages: Vec<ChatMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
    stream: bool,
    /// Asks for the final chunk with the token counts, which the usage ledger needs.
    stream_options: StreamOptions,
}

#[derive(Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: Function<'a>,
}

#[derive(Serialize)]
struct Function<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a serde_json::Value,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    /// `null` only for an assistant message that holds nothing but tool calls.
    content: Option<ChatContent<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCallOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
}

impl<'a> ChatMessage<'a> {
    fn new(role: &'static str, content: ChatContent<'a>) -> Self {
        Self {
            role,
            content: Some(content),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A tool call of an assistant message; its arguments are a JSON string.
#[derive(Serialize)]
struct ToolCallOut<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: CallOut<'a>,
}

#[derive(Serialize)]
struct CallOut<'a> {
    name: &'a str,
    arguments: String,
}

/// A message's content: a plain string when it is one text, parts otherwise.
#[derive(Serialize)]
#[serde(untagged)]
enum ChatContent<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<ContentPart<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ContentPart<'a> {
    Text { text: &'a str },
    ImageUrl { image_url: ImageUrl<'a> },
    File { file: FileData<'a> },
}

#[derive(Serialize)]
struct ImageUrl<'a> {
    url: DataUrl<'a>,
}

#[derive(Serialize)]
struct FileData<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    filename: Option<&'a str>,
    file_data: DataUrl<'a>,
}

/// A `data:<media type>;base64,<data>` URL, written straight into the body
/// instead of being built as a copy of a possibly large attachment.
struct DataUrl<'a> {
    media_type: &'a str,
    data: &'a str,
}

impl fmt::Display for DataUrl<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "data:{};base64,{}", self.media_type, self.data)
    }
}

impl Serialize for DataUrl<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'a> ChatRequest<'a> {
    fn new(request: &'a LlmRequest, default_model: &'a str, default_max_tokens: u32) -> Self {
        let system = request
            .system
            .as_deref()
            .filter(|system| !system.is_empty())
            .map(|system| ChatMessage::new("system", ChatContent::Text(Cow::Borrowed(system))));
        let mut messages: Vec<ChatMessage<'a>> = system.into_iter().collect();
        for message in request.messages.iter() {
            match message.role {
                LlmRole::User => user_messages(message, &mut messages),
                LlmRole::Assistant => messages.push(assistant_message(message)),
            }
        }
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
            messages,
            tools: request
                .tools
                .iter()
                .map(|tool| Tool {
                    kind: "function",
                    function: Function {
                        name: &tool.name,
                        description: &tool.description,
                        parameters: &tool.input_schema,
                    },
                })
                .collect(),
            stream: true,
            stream_options: StreamOptions { include_usage: true },
        }
    }
}

/// Adds a user message: its tool results first, each a `tool` message, then
/// whatever else it holds as one `user` message.
fn user_messages<'a>(message: &'a LlmMessage, out: &mut Vec<ChatMessage<'a>>) {
    let mut rest = Vec::new();
    for part in &message.content {
        match part {
            LlmContent::ToolResult(result) => out.push(ChatMessage {
                tool_call_id: Some(&result.tool_call_id),
                ..ChatMessage::new("tool", ChatContent::Text(Cow::Borrowed(&result.text)))
            }),
            other => rest.push(other),
        }
    }
    if !rest.is_empty() || message.content.is_empty() {
        out.push(ChatMessage::new("user", user_content(&rest)));
    }
}

fn user_content<'a>(content: &[&'a LlmContent]) -> ChatContent<'a> {
    if let [LlmContent::Text(text)] = content {
        return ChatContent::Text(Cow::Borrowed(text));
    }
    let parts = content
        .iter()
        .filter_map(|part| match part {
            LlmContent::Text(text) => Some(ContentPart::Text { text }),
            LlmContent::Image { media_type, data } => Some(ContentPart::ImageUrl {
                image_url: ImageUrl {
                    url: DataUrl { media_type, data },
                },
            }),
            LlmContent::File {
                media_type,
                data,
                filename,
            } => Some(ContentPart::File {
                file: FileData {
                    filename: filename.as_deref(),
                    file_data: DataUrl { media_type, data },
                },
            }),
            LlmContent::ToolUse(_) | LlmContent::ToolResult(_) => None,
        })
        .collect();
    ChatContent::Parts(parts)
}

/// Returns an assistant message: its text (the API takes no attachments from
/// the assistant) and its tool calls.
fn assistant_message(message: &LlmMessage) -> ChatMessage<'_> {
    let mut texts = message.content.iter().filter_map(|part| match part {
        LlmContent::Text(text) => Some(text.as_str()),
        _ => None,
    });
    let text = match (texts.next(), texts.next()) {
        (None, _) => Cow::Borrowed(""),
        (Some(only), None) => Cow::Borrowed(only),
        (Some(first), Some(second)) => {
            let mut joined = format!("{first}{second}");
            texts.for_each(|text| joined.push_str(text));
            Cow::Owned(joined)
        }
    };
    let tool_calls: Vec<ToolCallOut<'_>> = message
        .content
        .iter()
        .filter_map(|part| match part {
            LlmContent::ToolUse(call) => Some(ToolCallOut {
                id: &call.id,
                kind: "function",
                function: CallOut {
                    name: &call.name,
                    arguments: call.input.to_string(),
                },
            }),
            _ => None,
        })
        .collect();
    ChatMessage {
        content: (!text.is_empty() || tool_calls.is_empty()).then_some(ChatContent::Text(text)),
        tool_calls,
        ..ChatMessage::new("assistant", ChatContent::Text(Cow::Borrowed("")))
    }
}

/// Decodes `chat.completion.chunk` events; only the first choice is read,
/// since the request asks for one.
struct ChatDecoder {
    model: String,
    started: bool,
    finish_reason: Option<StopReason>,
    /// The tool calls streaming now, by their index in the reply.
    calls: Vec<(u64, PendingCall)>,
}

#[derive(Deserialize)]
struct Chunk {
    model: Option<String>,
    choices: Option<Vec<Choice>>,
    usage: Option<ChunkUsage>,
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Choice {
    delta: Option<ChoiceDelta>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct ChoiceDelta {
    content: Option<String>,
    tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A piece of a tool call: the first names it, the rest add to its arguments.
#[derive(Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    index: u64,
    id: Option<String>,
    function: Option<FunctionDelta>,
}

#[derive(Deserialize)]
struct FunctionDelta {
    name: Option<String>,
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct ChunkUsage {
    /// Includes the cached tokens, unlike Anthropic's `input_tokens`.
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Deserialize)]
struct PromptTokensDetails {
    cached_tokens: Option<u64>,
}

impl ChatDecoder {
    fn new(model: &str) -> Self {
        Self {
            model: model.to_owned(),
            started: false,
            finish_reason: None,
            calls: Vec::new(),
        }
    }

    /// Relays a piece of a tool call; a call's first piece carries its id and name.
    fn tool_call(&mut self, delta: ToolCallDelta, out: &mut VecDeque<LlmEvent>) -> Result<(), LlmError> {
        let (name, arguments) = delta
            .function
            .map_or((None, None), |function| (function.name, function.arguments));
        let at = match self.calls.iter().position(|(index, _)| *index == delta.index) {
            Some(at) => at,
            None => {
                let (Some(id), Some(name)) = (delta.id, name) else {
                    return Err(LlmError::new(
                        super::LlmErrorKind::BadResponse,
                        "the LLM provider sent a tool call without its id or name",
                    ));
                };
                let call = PendingCall::new(id, name);
                out.push_back(call.start_event());
                self.calls.push((delta.index, call));
                self.calls.len() - 1
            }
        };
        out.extend(arguments.and_then(|piece| self.calls[at].1.push(piece)));
        Ok(())
    }

    /// Completes the reply's tool calls, in the order they started.
    fn finish_calls(&mut self, out: &mut VecDeque<LlmEvent>) -> Result<(), LlmError> {
        for (_, call) in self.calls.drain(..) {
            out.push_back(call.finish()?);
        }
        Ok(())
    }

    fn ensure_started(&mut self, model: Option<String>, out: &mut VecDeque<LlmEvent>) {
        if !self.started {
            self.started = true;
            let model = model
                .filter(|model| !model.is_empty())
                .unwrap_or_else(|| self.model.clone());
            out.push_back(LlmEvent::Start {
                model,
                input_tokens: None,
            });
        }
    }
}

fn stop_reason(reason: &str) -> StopReason {
    match reason {
        "length" => StopReason::MaxTokens,
        "tool_calls" | "function_call" => StopReason::ToolUse,
        // stop, content_filter and anything new end the reply normally.
        _ => StopReason::EndTurn,
    }
}

/// Returns the error a compatible server reported in a chunk, as
/// `{"error": {"type", "code", "message"}}` or `{"error": "text"}`.
fn chunk_error(error: &serde_json::Value) -> LlmError {
    if let Some(message) = error.as_str() {
        return sse::provider_error(None, Some(message));
    }
    let text = |field: &str| match error.get(field) {
        Some(serde_json::Value::String(value)) => Some(value.clone()),
        Some(serde_json::Value::Number(value)) => Some(value.to_string()),
        _ => None,
    };
    let kind = text("type").or_else(|| text("code"));
    sse::provider_error(kind.as_deref(), text("message").as_deref())
}

impl SseDecoder for ChatDecoder {
    fn decode(&mut self, event: &Event, out: &mut VecDeque<LlmEvent>) -> Result<Progress, LlmError> {
        let data = event.data.trim();
        if data == "[DONE]" {
            self.ensure_started(None, out);
            self.finish_calls(out)?;
            out.push_back(LlmEvent::Stop {
                reason: self.finish_reason.unwrap_or(StopReason::EndTurn),
            });
            return Ok(Progress::Complete);
        }
        let chunk: Chunk = serde_json::from_str(data).map_err(|err| sse::bad_event("chat.completion.chunk", &err))?;
        if let Some(error) = chunk.error.as_ref().filter(|error| !error.is_null()) {
            return Err(chunk_error(error));
        }
        self.ensure_started(chunk.model, out);
        if let Some(choice) = chunk.choices.and_then(|choices| choices.into_iter().next()) {
            if let Some(delta) = choice.delta {
                if let Some(text) = delta.content.filter(|text| !text.is_empty()) {
                    out.push_back(LlmEvent::TextDelta(text));
                }
                for call in delta.tool_calls.into_iter().flatten() {
                    self.tool_call(call, out)?;
                }
            }
            if let Some(reason) = choice.finish_reason.as_deref() {
                self.finish_reason = Some(stop_reason(reason));
                self.finish_calls(out)?;
            }
        }
        if let Some(usage) = chunk.usage {
            out.push_back(LlmEvent::Usage {
                input_tokens: usage.prompt_tokens,
                output_tokens: usage.completion_tokens,
            });
            let cached = usage.prompt_tokens_details.and_then(|details| details.cached_tokens);
            if cached.unwrap_or(0) > 0 {
                out.push_back(LlmEvent::CacheUsage {
                    read_tokens: cached,
                    write_tokens: None,
                });
            }
        }
        Ok(Progress::More)
    }

    fn finish(&mut self, out: &mut VecDeque<LlmEvent>) -> Result<(), LlmError> {
        // Some compatible servers end the body after the finish reason without
        // `[DONE]`; the reply is complete all the same.
        match self.finish_reason {
            Some(reason) => {
                self.ensure_started(None, out);
                out.push_back(LlmEvent::Stop { reason });
                Ok(())
            }
            None => Err(sse::ended_early()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{LlmErrorKind, LlmMessage};

    fn data(data: &str) -> Event {
        Event {
            event: "message".to_owned(),
            data: data.to_owned(),
            ..Event::default()
        }
    }

    fn decode_all(events: &[Event]) -> (Vec<LlmEvent>, Option<LlmError>) {
        let mut decoder = ChatDecoder::new("requested-model");
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
    fn decodes_chunks_usage_and_done() {
        let (events, err) = decode_all(&[
            data(
                r#"{"id":"c","object":"chat.completion.chunk","model":"gpt-x","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#,
            ),
            data(
                r#"{"id":"c","object":"chat.completion.chunk","model":"gpt-x","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}],"usage":null}"#,
            ),
            data(
                r#"{"id":"c","object":"chat.completion.chunk","model":"gpt-x","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}],"usage":null}"#,
            ),
            data(
                r#"{"id":"c","object":"chat.completion.chunk","model":"gpt-x","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}"#,
            ),
            data("[DONE]"),
        ]);
        assert_eq!(err, None);
        assert_eq!(
            events,
            vec![
                LlmEvent::Start {
                    model: "gpt-x".to_owned(),
                    input_tokens: None
                },
                LlmEvent::TextDelta("Hi".to_owned()),
                LlmEvent::Usage {
                    input_tokens: Some(9),
                    output_tokens: Some(1)
                },
                LlmEvent::Stop {
                    reason: StopReason::ToolUse
                },
            ]
        );
    }

    #[test]
    fn ends_without_done_only_after_a_finish_reason() {
        let (events, err) = decode_all(&[data(
            r#"{"choices":[{"delta":{"content":"a"},"finish_reason":"length"}]}"#,
        )]);
        assert_eq!(err, None);
        assert_eq!(
            events.last(),
            Some(&LlmEvent::Stop {
                reason: StopReason::MaxTokens
            })
        );
        let (_, err) = decode_all(&[data(r#"{"choices":[{"delta":{"content":"a"},"finish_reason":null}]}"#)]);
        assert_eq!(err.unwrap().kind, LlmErrorKind::BadResponse);
    }

    #[test]
    fn maps_errors_and_malformed_chunks() {
        let (_, err) = decode_all(&[data(r#"{"error":{"message":"boom","type":"server_error"}}"#)]);
        let err = err.unwrap();
        assert_eq!(err.kind, LlmErrorKind::Unavailable);
        assert!(err.message.contains("boom"), "{}", err.message);
        let (_, err) = decode_all(&[data(r#"{"error":{"message":"slow","code":"rate_limit_exceeded"}}"#)]);
        assert_eq!(err.unwrap().kind, LlmErrorKind::RateLimited);
        let (_, err) = decode_all(&[data("{oops")]);
        assert_eq!(err.unwrap().kind, LlmErrorKind::BadResponse);
        let (_, err) = decode_all(&[data(r#"{"choices":"nope"}"#)]);
        assert_eq!(err.unwrap().kind, LlmErrorKind::BadResponse);
    }

    #[test]
    fn encodes_the_request_body() {
        let text = |text: &str| LlmContent::Text(text.to_owned());
        let request = LlmRequest {
            model: "m".to_owned(),
            system: Some("sys".to_owned()),
            messages: std::sync::Arc::new(vec![
                LlmMessage {
                    role: LlmRole::User,
                    content: vec![text("one")],
                },
                LlmMessage {
                    role: LlmRole::Assistant,
                    content: vec![text("two "), text("parts")],
                },
                LlmMessage {
                    role: LlmRole::User,
                    content: vec![
                        text("see"),
                        LlmContent::Image {
                            media_type: "image/png".to_owned(),
                            data: "iVBO".to_owned(),
                        },
                        LlmContent::File {
                            media_type: "application/pdf".to_owned(),
                            data: "JVBE".to_owned(),
                            filename: None,
                        },
                    ],
                },
            ]),
            max_tokens: 10,
            tools: std::sync::Arc::default(),
        };
        let body = serde_json::to_value(ChatRequest::new(&request, "default", 99)).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "model": "m",
                "max_tokens": 10,
                "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [
                    {"role": "system", "content": "sys"},
                    {"role": "user", "content": "one"},
                    {"role": "assistant", "content": "two parts"},
                    {"role": "user", "content": [
                        {"type": "text", "text": "see"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                        {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBE"}},
                    ]},
                ],
            })
        );
    }

    #[test]
    fn decodes_streamed_tool_calls() {
        let (events, err) = decode_all(&[
            data(r#"{"model":"gpt","choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}"#),
            data(
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"read_file","arguments":""}}]}}]}"#,
            ),
            data(
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"path\":"}}]}}]}"#,
            ),
            data(
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"list_files","arguments":"{}"}}]}}]}"#,
            ),
            data(
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"a.txt\"}"}}]}}]}"#,
            ),
            data(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#),
            data("[DONE]"),
        ]);
        assert!(err.is_none(), "{err:?}");
        let call = |id: &str, name: &str, input: serde_json::Value| {
            LlmEvent::ToolUseStop(crate::llm::ToolCall {
                id: id.into(),
                name: name.into(),
                input,
            })
        };
        let delta = |id: &str, piece: &str| LlmEvent::ToolInputDelta {
            id: id.into(),
            partial_json: piece.into(),
        };
        assert_eq!(
            events[1..],
            [
                LlmEvent::ToolUseStart {
                    id: "call_a".into(),
                    name: "read_file".into()
                },
                delta("call_a", "{\"path\":"),
                LlmEvent::ToolUseStart {
                    id: "call_b".into(),
                    name: "list_files".into()
                },
                delta("call_b", "{}"),
                delta("call_a", "\"a.txt\"}"),
                call("call_a", "read_file", serde_json::json!({"path": "a.txt"})),
                call("call_b", "list_files", serde_json::json!({})),
                LlmEvent::Stop {
                    reason: StopReason::ToolUse
                },
            ]
        );
        let (_, err) = decode_all(&[data(
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}"#,
        )]);
        assert_eq!(err.map(|err| err.kind), Some(LlmErrorKind::BadResponse));
    }

    #[test]
    fn encodes_tool_calls_and_results() {
        use crate::llm::{ToolCall, ToolOutput, ToolSpec};
        let request = LlmRequest {
            model: "m".to_owned(),
            system: None,
            messages: std::sync::Arc::new(vec![
                LlmMessage {
                    role: LlmRole::User,
                    content: vec![LlmContent::Text("go".into())],
                },
                LlmMessage {
                    role: LlmRole::Assistant,
                    content: vec![LlmContent::ToolUse(ToolCall {
                        id: "c1".into(),
                        name: "list_files".into(),
                        input: serde_json::json!({"path": "."}),
                    })],
                },
                LlmMessage {
                    role: LlmRole::User,
                    content: vec![
                        LlmContent::ToolResult(ToolOutput {
                            tool_call_id: "c1".into(),
                            text: "a.txt".into(),
                            is_error: false,
                        }),
                        LlmContent::Text("and?".into()),
                    ],
                },
            ]),
            max_tokens: 10,
            tools: std::sync::Arc::new(vec![ToolSpec {
                name: "list_files".into(),
                description: "Lists files.".into(),
                input_schema: serde_json::json!({"type": "object"}),
            }]),
        };
        let body = serde_json::to_value(ChatRequest::new(&request, "default", 99)).unwrap();
        assert_eq!(
            body["messages"],
            serde_json::json!([
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "list_files", "arguments": "{\"path\":\".\"}"}},
                ]},
                {"role": "tool", "content": "a.txt", "tool_call_id": "c1"},
                {"role": "user", "content": "and?"},
            ])
        );
        assert_eq!(
            body["tools"],
            serde_json::json!([{"type": "function", "function": {
                "name": "list_files", "description": "Lists files.", "parameters": {"type": "object"}}}])
        );
    }
}
