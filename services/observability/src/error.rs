//! The observability service's one error type and its mapping onto the shared vocabulary.

use avm_common::{ApiError, Code};
use avm_store::StoreError;

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
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
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

impl From<avm_store::events::FeedError> for ObservabilityError {
    fn from(err: avm_store::events::FeedError) -> Self {
        match err {
            avm_store::events::FeedError::Lagged => ObservabilityError::EventsLagged,
            avm_store::events::FeedError::Unavailable => ObservabilityError::EventsUnavailable,
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
            ObservabilityError::Store(err) => err.into_api("observability"),
        }
    }
}

impl From<ObservabilityError> for tonic::Status {
    fn from(err: ObservabilityError) -> Self {
        ApiError::from(err).into()
    }
}

impl From<sqlx::Error> for ObservabilityError {
    fn from(err: sqlx::Error) -> Self {
        Self::Store(StoreError::Database(err))
    }
}

impl From<sqlx::migrate::MigrateError> for ObservabilityError {
    fn from(err: sqlx::migrate::MigrateError) -> Self {
        Self::Store(StoreError::Migration(err))
    }
}

impl ObservabilityError {
    /// Returns the error of a stored row this code cannot read back.
    pub(crate) fn corrupt(detail: impl Into<String>) -> Self {
        Self::Store(StoreError::Corrupt(detail.into()))
    }
}
