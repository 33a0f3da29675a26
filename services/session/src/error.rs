//! The session service's one error type and its mapping onto the shared vocabulary.

use avm_common::{ApiError, Code};

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
    /// The image does not exist for the caller's tenant.
    #[error("image {0} not found")]
    ImageNotFound(String),
    /// The session does not exist for the caller's tenant.
    #[error("session {0} not found")]
    SessionNotFound(String),
    /// The caller is not allowed this operation (scope or role).
    #[error("{0}")]
    Denied(ApiError),
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The schema could not be brought up to date.
    #[error("migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// A stored row could not be read back; the data is not what this code wrote.
    #[error("corrupt stored data: {0}")]
    Corrupt(String),
}

impl SessionError {
    /// Returns an `Invalid` error with a stable reason.
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            reason,
            message: message.into(),
        }
    }
}

impl From<SessionError> for ApiError {
    fn from(err: SessionError) -> Self {
        match err {
            SessionError::Invalid { reason, message } => ApiError::invalid(reason, message),
            SessionError::Denied(err) => err,
            SessionError::ContainerNotFound(_) => ApiError::not_found("CONTAINER_NOT_FOUND", err.to_string()),
            SessionError::ContainerIdTaken(_) => {
                ApiError::new(Code::AlreadyExists, "CONTAINER_ID_TAKEN", err.to_string())
            }
            SessionError::NotContainerOwner(_) => {
                ApiError::new(Code::PermissionDenied, "NOT_CONTAINER_OWNER", err.to_string())
            }
            SessionError::ImageNotFound(_) => ApiError::not_found("IMAGE_NOT_FOUND", err.to_string()),
            SessionError::SessionNotFound(_) => ApiError::not_found("SESSION_NOT_FOUND", err.to_string()),
            // A saturated pool or a lost connection is worth retrying; say so without details.
            SessionError::Database(db) => avm_common::db::database_error("session", &db),
            SessionError::Migration(_) | SessionError::Corrupt(_) => ApiError::internal(err),
        }
    }
}

impl From<SessionError> for tonic::Status {
    fn from(err: SessionError) -> Self {
        ApiError::from(err).to_status()
    }
}
