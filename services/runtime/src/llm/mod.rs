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
}

/// What a provider's stream yields, normalised across providers.
#[derive(Clone, Debug, PartialEq)]
pub enum LlmEvent {
    /// The provider accepted the request; usage may already hold the input count.
    Start { model: String, input_tokens: Option<u64> },
    /// A piece of the assistant's text.
    TextDelta(String),
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
