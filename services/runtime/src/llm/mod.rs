//! LLM drivers: one streaming interface over the Anthropic Messages API, any
//! OpenAI-compatible Chat Completions API, and the network-free `offline` provider.

use std::sync::Arc;

use futures::stream::BoxStream;

use crate::config::{LlmConfig, ProviderKind};

pub mod anthropic;
pub mod offline;
pub mod openai;
mod sse;

/// One call to an LLM: a system prompt and the conversation so far.
#[derive(Clone, Debug, PartialEq)]
pub struct LlmRequest {
    pub model: String,
    pub system: Option<String>,
    /// Alternating user and assistant messages, oldest first, ending with a
    /// user message; shared with the agent that holds the conversation.
    pub messages: Arc<Vec<LlmMessage>>,
    pub max_tokens: u32,
    /// The tools the model may call; empty offers none.
    pub tools: Arc<Vec<ToolSpec>>,
}

/// A tool as the model sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// The JSON schema of the tool's input (an object schema).
    pub input_schema: serde_json::Value,
}

/// A message of the conversation as sent to the provider.
#[derive(Clone, Debug, PartialEq)]
pub struct LlmMessage {
    pub role: LlmRole,
    pub content: Vec<LlmContent>,
}

/// Who said a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlmRole {
    User,
    Assistant,
}

/// One part of a message.
#[derive(Clone, Debug, PartialEq)]
pub enum LlmContent {
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
    /// A tool call the assistant made (assistant messages only).
    ToolUse(ToolCall),
    /// What a tool call gave back (user messages only, after the call).
    ToolResult(ToolOutput),
}

/// A tool call: the provider's id for it, the tool and its input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The input, a JSON object.
    pub input: serde_json::Value,
}

/// The result of a tool call, as text, and whether the call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolOutput {
    pub tool_call_id: String,
    pub text: String,
    pub is_error: bool,
}

/// What a provider's stream yields, normalised across providers.
#[derive(Clone, Debug, PartialEq)]
pub enum LlmEvent {
    /// The provider accepted the request; usage may already hold the input count.
    Start { model: String, input_tokens: Option<u64> },
    /// A piece of the assistant's text.
    TextDelta(String),
    /// The model starts a tool call; its input follows in pieces.
    ToolUseStart { id: String, name: String },
    /// A piece of the input JSON of the tool call started last with this id.
    ToolInputDelta { id: String, partial_json: String },
    /// The tool call is complete, with its whole input.
    ToolUseStop(ToolCall),
    /// Token counts reported so far; later reports supersede earlier ones field by field.
    Usage {
        input_tokens: Option<u64>,
        output_tokens: Option<u64>,
    },
    /// Prompt-cache token counts, when the provider reports any: tokens read
    /// from the cache and written to it. Later reports supersede earlier ones.
    CacheUsage {
        read_tokens: Option<u64>,
        write_tokens: Option<u64>,
    },
    /// The reply is complete.
    Stop { reason: StopReason },
}

/// Why the provider stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    EndTurn,
    ToolUse,
    MaxTokens,
    StopSequence,
}

impl StopReason {
    /// Returns the protocol's name (`end_turn`, `tool_use`, `max_tokens`, `stop_sequence`).
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::EndTurn => "end_turn",
            StopReason::ToolUse => "tool_use",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopSequence => "stop_sequence",
        }
    }
}

/// Classes of provider failure, each with a stable reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlmErrorKind {
    /// 401/403: the key was refused.
    Unauthenticated,
    /// 429: the provider's rate limit.
    RateLimited,
    /// 400/404/422: the provider rejected the request itself.
    InvalidRequest,
    /// 5xx or 529: the provider failed.
    Unavailable,
    /// No answer (or no next chunk) in time.
    Timeout,
    /// The connection could not be made or broke.
    Unreachable,
    /// The stream could not be understood.
    BadResponse,
}

impl LlmErrorKind {
    /// Returns the stable reason, e.g. `LLM_RATE_LIMITED`.
    pub fn reason(self) -> &'static str {
        match self {
            LlmErrorKind::Unauthenticated => "LLM_UNAUTHENTICATED",
            LlmErrorKind::RateLimited => "LLM_RATE_LIMITED",
            LlmErrorKind::InvalidRequest => "LLM_INVALID_REQUEST",
            LlmErrorKind::Unavailable => "LLM_UNAVAILABLE",
            LlmErrorKind::Timeout => "LLM_TIMEOUT",
            LlmErrorKind::Unreachable => "LLM_UNREACHABLE",
            LlmErrorKind::BadResponse => "LLM_BAD_RESPONSE",
        }
    }

    /// Returns whether retrying the same turn later may succeed.
    pub fn recoverable(self) -> bool {
        !matches!(self, LlmErrorKind::Unauthenticated | LlmErrorKind::InvalidRequest)
    }
}

/// A provider failure with a message fit for the user: it never contains the API key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct LlmError {
    pub kind: LlmErrorKind,
    pub message: String,
}

impl LlmError {
    /// Returns an error of `kind` with a user-facing message.
    pub fn new(kind: LlmErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// The stream of one LLM call. Dropping it aborts the HTTP request.
pub type LlmStream = BoxStream<'static, Result<LlmEvent, LlmError>>;

/// A streaming LLM driver.
#[async_trait::async_trait]
pub trait LlmProvider: Send + Sync {
    /// Returns the provider's name (`anthropic`, `openai`, `offline`).
    fn name(&self) -> &'static str;

    /// Sends the request and returns the event stream once the provider has
    /// accepted it (HTTP status checked).
    async fn stream(&self, request: LlmRequest) -> Result<LlmStream, LlmError>;
}

/// Returns the provider the configuration selects.
pub fn build_provider(config: &LlmConfig) -> Result<Arc<dyn LlmProvider>, LlmError> {
    match config.provider_kind() {
        ProviderKind::Anthropic => Ok(Arc::new(anthropic::AnthropicProvider::new(config)?)),
        ProviderKind::Openai => Ok(Arc::new(openai::OpenAiProvider::new(config)?)),
        ProviderKind::Offline => Ok(Arc::new(offline::OfflineProvider::new(config))),
    }
}

/// A tool call as its input streams in: both drivers collect the pieces and
/// parse them once the call is complete.
#[derive(Debug)]
struct PendingCall {
    id: String,
    name: String,
    input_json: String,
}

impl PendingCall {
    fn new(id: String, name: String) -> Self {
        Self {
            id,
            name,
            input_json: String::new(),
        }
    }

    /// Returns the event of the call's start.
    fn start_event(&self) -> LlmEvent {
        LlmEvent::ToolUseStart {
            id: self.id.clone(),
            name: self.name.clone(),
        }
    }

    /// Adds a piece of the input and returns its event (none for an empty piece).
    fn push(&mut self, piece: String) -> Option<LlmEvent> {
        if piece.is_empty() {
            return None;
        }
        self.input_json.push_str(&piece);
        Some(LlmEvent::ToolInputDelta {
            id: self.id.clone(),
            partial_json: piece,
        })
    }

    /// Returns the complete call; no input at all is an empty object.
    fn finish(self) -> Result<LlmEvent, LlmError> {
        let input = if self.input_json.trim().is_empty() {
            serde_json::Value::Object(serde_json::Map::new())
        } else {
            serde_json::from_str(&self.input_json).map_err(|err| {
                LlmError::new(
                    LlmErrorKind::BadResponse,
                    format!(
                        "the LLM provider sent tool input for {} that is not JSON: {err}",
                        self.name
                    ),
                )
            })?
        };
        Ok(LlmEvent::ToolUseStop(ToolCall {
            id: self.id,
            name: self.name,
            input,
        }))
    }
}
