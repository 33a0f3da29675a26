//! The runtime's one error type and its mapping onto the shared vocabulary.

use avm_common::{ApiError, Code};

/// Names an agent either by its image or by its own id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentTarget {
    Image(String),
    Agent(String),
}

/// Everything that can go wrong in the runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The caller sent something the runtime refuses; `reason` is stable.
    #[error("{message}")]
    Invalid { reason: &'static str, message: String },
    /// An id no store could hold; answers like the missing object it names.
    #[error("{what} not found")]
    TooLongId { reason: &'static str, what: &'static str },
    /// No agent runs for the target (or the caller may not see it).
    #[error("{}", agent_not_found(.0))]
    AgentNotFound(AgentTarget),
    /// The agent is answering another message.
    #[error("the agent is still answering the previous message; wait for conversation_end or interrupt it")]
    AgentBusy,
    /// The agent left the pool twice while a message was being accepted.
    #[error("the agent is restarting; send the message again")]
    AgentRestarting,
    /// The configuration of the LLM cannot be used.
    #[error("the LLM settings cannot be used: {0}")]
    LlmMisconfigured(String),
    /// The runtime has no configuration yet.
    #[error("the runtime has not loaded its configuration yet (is the config service reachable?)")]
    ConfigUnavailable,
    /// A subscriber fell behind the event stream.
    #[error("the subscriber fell too far behind the event stream; resubscribe with the last cursor")]
    SubscriberTooSlow,
    /// What another service (or a permission check) answered, passed on as it is.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// Another runtime replica holds the image's agent (at this address).
    #[error("another runtime replica holds the agent")]
    Elsewhere(String),
    /// This replica is shutting down and no other takes the agent.
    #[error("this runtime is shutting down; retry")]
    Draining,
    /// The conversation's last reply waits in the outbox for the session
    /// service: the next message would run on a history without it.
    #[error("the conversation's last reply is not stored yet (the session service is unavailable); retry shortly")]
    RepliesPending,
}

fn agent_not_found(target: &AgentTarget) -> String {
    match target {
        AgentTarget::Image(id) => format!("no running agent for image {id}"),
        AgentTarget::Agent(id) => format!("agent {id} not found"),
    }
}

impl RuntimeError {
    /// Returns an `Invalid` error with a stable reason.
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            reason,
            message: message.into(),
        }
    }

    /// Returns whether retrying the same turn later may succeed, as a failed
    /// turn's error events say.
    pub fn recoverable(&self) -> bool {
        !matches!(self.code(), Code::ResourceExhausted | Code::PermissionDenied)
    }

    /// Returns whether the same call may succeed later (a peer or this
    /// replica was unavailable), rather than never.
    pub fn transient(&self) -> bool {
        matches!(self.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Internal)
    }

    fn code(&self) -> Code {
        match self {
            RuntimeError::Invalid { .. } => Code::InvalidArgument,
            RuntimeError::TooLongId { .. } | RuntimeError::AgentNotFound(_) => Code::NotFound,
            RuntimeError::AgentBusy | RuntimeError::LlmMisconfigured(_) => Code::FailedPrecondition,
            RuntimeError::AgentRestarting
            | RuntimeError::ConfigUnavailable
            | RuntimeError::Elsewhere(_)
            | RuntimeError::Draining
            | RuntimeError::RepliesPending => Code::Unavailable,
            RuntimeError::SubscriberTooSlow => Code::ResourceExhausted,
            RuntimeError::Api(err) => err.code,
        }
    }
}

impl From<RuntimeError> for ApiError {
    fn from(err: RuntimeError) -> Self {
        let code = err.code();
        match err {
            RuntimeError::Invalid { reason, message } => ApiError::new(code, reason, message),
            RuntimeError::TooLongId { reason, .. } => ApiError::new(code, reason, err.to_string()),
            RuntimeError::AgentNotFound(_) => ApiError::new(code, "AGENT_NOT_FOUND", err.to_string()),
            RuntimeError::AgentBusy => ApiError::new(code, "AGENT_BUSY", err.to_string()),
            RuntimeError::AgentRestarting => ApiError::new(code, "AGENT_RESTARTING", err.to_string()),
            RuntimeError::LlmMisconfigured(_) => ApiError::new(code, "LLM_MISCONFIGURED", err.to_string()),
            RuntimeError::ConfigUnavailable => ApiError::new(code, "CONFIG_UNAVAILABLE", err.to_string()),
            RuntimeError::SubscriberTooSlow => ApiError::new(code, "SUBSCRIBER_TOO_SLOW", err.to_string()),
            RuntimeError::Elsewhere(_) => {
                ApiError::new(code, "AGENT_MOVING", "the agent is moving between runtimes; retry")
            }
            RuntimeError::Draining => ApiError::new(code, "RUNTIME_DRAINING", err.to_string()),
            RuntimeError::RepliesPending => ApiError::new(code, "REPLY_PENDING", err.to_string()),
            RuntimeError::Api(err) => err,
        }
    }
}

/// Names, on a status that says an agent is elsewhere, the replica holding
/// it: for the router in front of the adapter (`router.rs`), which sends the
/// call there and never lets the name out.
pub(crate) const HOLDER_HEADER: &str = "avm-holder";

impl From<RuntimeError> for tonic::Status {
    fn from(err: RuntimeError) -> Self {
        let holder = match &err {
            RuntimeError::Elsewhere(addr) => tonic::metadata::MetadataValue::try_from(addr.as_str()).ok(),
            _ => None,
        };
        let mut status = ApiError::from(err).to_status();
        if let Some(holder) = holder {
            status.metadata_mut().insert(HOLDER_HEADER, holder);
        }
        status
    }
}

impl From<tonic::Status> for RuntimeError {
    fn from(status: tonic::Status) -> Self {
        RuntimeError::Api(ApiError::from_status(&status))
    }
}
