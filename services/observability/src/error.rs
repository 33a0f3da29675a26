//! The observability service's one error type and its mapping onto the shared vocabulary.

use avm_common::{ApiError, Code};

/// Everything that can go wrong in the observability service.
#[derive(Debug, thiserror::Error)]
pub enum ObservabilityError {
    /// The caller sent something the service refuses; `reason` is stable and
    /// the message names the field.
    #[error("{message}")]
    Invalid { reason: &'static str, message: String },
    /// Usage records wait to be written beyond the pending buffer's bound
    /// (the database is slow or away); the caller retries later.
    #[error("{0} usage records are waiting to be written; retry shortly")]
    Backlog(usize),
    /// A budget watcher fell too far behind the change feed.
    #[error("the budget change stream fell behind; reconnect")]
    EventsLagged,
    /// The cross-replica change feed is not live (or was interrupted).
    #[error("the budget change feed is unavailable; reconnect")]
    EventsUnavailable,
    /// An error already in the shared vocabulary (scope and role checks).
    #[error(transparent)]
    Api(#[from] ApiError),
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The schema could not be brought up to date.
    #[error("migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// A stored row could not be read back.
    #[error("corrupt stored data: {0}")]
    Corrupt(String),
}

impl ObservabilityError {
    /// Returns an `Invalid` error with a stable reason.
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            reason,
            message: message.into(),
        }
    }
}

impl From<avm_common::events::FeedError> for ObservabilityError {
    fn from(err: avm_common::events::FeedError) -> Self {
        match err {
            avm_common::events::FeedError::Lagged => ObservabilityError::EventsLagged,
            avm_common::events::FeedError::Unavailable => ObservabilityError::EventsUnavailable,
        }
    }
}

impl From<ObservabilityError> for ApiError {
    fn from(err: ObservabilityError) -> Self {
        match err {
            ObservabilityError::Invalid { reason, message } => ApiError::invalid(reason, message),
            ObservabilityError::Api(api) => api,
            ObservabilityError::Backlog(_) => ApiError::new(Code::ResourceExhausted, "USAGE_BACKLOG", err.to_string()),
            ObservabilityError::EventsLagged => {
                ApiError::new(Code::ResourceExhausted, "BUDGET_EVENTS_LAGGED", err.to_string())
            }
            ObservabilityError::EventsUnavailable => {
                ApiError::unavailable("BUDGET_EVENTS_UNAVAILABLE", err.to_string())
            }
            ObservabilityError::Database(db) => avm_common::db::database_error("observability", &db),
            ObservabilityError::Migration(_) | ObservabilityError::Corrupt(_) => ApiError::internal(err),
        }
    }
}

impl From<ObservabilityError> for tonic::Status {
    fn from(err: ObservabilityError) -> Self {
        ApiError::from(err).into()
    }
}
