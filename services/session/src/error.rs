//! The session service's one error type and its mapping onto the shared vocabulary.

use avm_common::{ApiError, Code};
use avm_store::StoreError;

/// Everything that can go wrong in the session service.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The caller sent something the service refuses; `reason` is stable.
    #[error("{message}")]
    Invalid { reason: &'static str, message: String },
    /// The container does not exist for the caller's tenant.
    #[error("container {0} not found")]
    ContainerNotFound(String),
    /// The container id is held by a container of the tenant the caller may not see.
    #[error("container id {0} is already used in this tenant")]
    ContainerIdTaken(String),
    /// Only the container's owner (or an admin) may do this.
    #[error("only the owner of container {0} or an admin may do this")]
    NotContainerOwner(String),
    /// The container is shared with the caller with a role too weak for this.
    #[error("container {container_id} is shared with you as {role}; this needs {need} or ownership")]
    ShareRoleTooLow {
        container_id: String,
        role: &'static str,
        need: &'static str,
    },
    /// The image does not exist for the caller's tenant.
    #[error("image {0} not found")]
    ImageNotFound(String),
    /// The image's agent is terminated: it cannot change state or have children.
    #[error("the agent of image {0} is terminated")]
    AgentTerminated(String),
    /// The session does not exist for the caller's tenant.
    #[error("session {0} not found")]
    SessionNotFound(String),
    /// The message is not one of the session's.
    #[error("message {0} not found in this conversation")]
    MessageNotFound(String),
    /// The group does not exist for the caller's tenant.
    #[error("group {0} not found")]
    GroupNotFound(String),
    /// The group exists but has no such member.
    #[error("{member_id} is not a member of group {group_id}")]
    GroupMemberNotFound { group_id: String, member_id: String },
    /// The group already has a member with this id.
    #[error("{member_id} is already a member of group {group_id}")]
    GroupMemberExists { group_id: String, member_id: String },
    /// The request is well formed but the state refuses it (for instance a
    /// sender that is not a member); `reason` is stable.
    #[error("{message}")]
    Precondition { reason: &'static str, message: String },
    /// The caller is not allowed this operation (scope or role).
    #[error("{0}")]
    Denied(ApiError),
    /// What another service answered (a reference that does not resolve), passed on.
    #[error(transparent)]
    Peer(ApiError),
    /// A watcher fell too far behind the deletions, or they may have been lost.
    #[error("the session change feed is unavailable; reconnect")]
    EventsUnavailable,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl SessionError {
    /// Returns an `Invalid` error with a stable reason.
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            reason,
            message: message.into(),
        }
    }

    /// Returns a `Precondition` error with a stable reason.
    pub fn precondition(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Precondition {
            reason,
            message: message.into(),
        }
    }
}

impl From<SessionError> for ApiError {
    fn from(err: SessionError) -> Self {
        match err {
            SessionError::Invalid { reason, message } => ApiError::invalid(reason, message),
            SessionError::Denied(err) | SessionError::Peer(err) => err,
            SessionError::EventsUnavailable => ApiError::unavailable("SESSION_EVENTS_UNAVAILABLE", err.to_string()),
            SessionError::ContainerNotFound(_) => ApiError::not_found("CONTAINER_NOT_FOUND", err.to_string()),
            SessionError::ContainerIdTaken(_) => {
                ApiError::new(Code::AlreadyExists, "CONTAINER_ID_TAKEN", err.to_string())
            }
            SessionError::NotContainerOwner(_) => {
                ApiError::new(Code::PermissionDenied, "NOT_CONTAINER_OWNER", err.to_string())
            }
            SessionError::ShareRoleTooLow { .. } => {
                ApiError::new(Code::PermissionDenied, "SHARE_ROLE_TOO_LOW", err.to_string())
            }
            SessionError::ImageNotFound(_) => ApiError::not_found("IMAGE_NOT_FOUND", err.to_string()),
            SessionError::AgentTerminated(_) => ApiError::precondition("AGENT_TERMINATED", err.to_string()),
            SessionError::SessionNotFound(_) => ApiError::not_found("SESSION_NOT_FOUND", err.to_string()),
            SessionError::MessageNotFound(_) => ApiError::not_found("MESSAGE_NOT_FOUND", err.to_string()),
            SessionError::GroupNotFound(_) => ApiError::not_found("GROUP_NOT_FOUND", err.to_string()),
            SessionError::GroupMemberNotFound { .. } => ApiError::not_found("GROUP_MEMBER_NOT_FOUND", err.to_string()),
            SessionError::GroupMemberExists { .. } => {
                ApiError::new(Code::AlreadyExists, "GROUP_MEMBER_EXISTS", err.to_string())
            }
            SessionError::Precondition { reason, message } => ApiError::precondition(reason, message),
            SessionError::Store(err) => err.into_api("session"),
        }
    }
}

impl From<SessionError> for tonic::Status {
    fn from(err: SessionError) -> Self {
        ApiError::from(err).to_status()
    }
}

impl From<sqlx::Error> for SessionError {
    fn from(err: sqlx::Error) -> Self {
        Self::Store(StoreError::Database(err))
    }
}

impl From<sqlx::migrate::MigrateError> for SessionError {
    fn from(err: sqlx::migrate::MigrateError) -> Self {
        Self::Store(StoreError::Migration(err))
    }
}

impl SessionError {
    /// Returns the error of a stored row this code cannot read back.
    pub(crate) fn corrupt(detail: impl Into<String>) -> Self {
        Self::Store(StoreError::Corrupt(detail.into()))
    }
}
