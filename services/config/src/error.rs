//! The config service's one error type and its mapping onto the shared vocabulary.

use avm_common::{ApiError, Code};
use avm_store::StoreError;

/// Everything that can go wrong in the config service.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The caller sent something the service refuses; `reason` is stable and
    /// the message names the key.
    #[error("{message}")]
    Invalid { reason: &'static str, message: String },
    /// A stored secret cannot be decrypted with the configured key.
    #[error("the stored secret {0} cannot be decrypted: AVM_CONFIG_SECRET_KEY is not the key it was written with")]
    SecretUnreadable(String),
    /// The secret key is missing or too short.
    #[error("{0}")]
    SecretKey(&'static str),
    /// A watcher fell too far behind the change feed.
    #[error("the config change stream fell behind; reconnect")]
    EventsLagged,
    /// The cross-replica change feed is not live (or was interrupted).
    #[error("the config change feed is unavailable; reconnect")]
    EventsUnavailable,
    /// An error already in the shared vocabulary (scope and role checks).
    #[error(transparent)]
    Api(#[from] ApiError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ConfigError {
    /// Returns an `Invalid` error with a stable reason.
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            reason,
            message: message.into(),
        }
    }
}

impl From<avm_store::events::FeedError> for ConfigError {
    fn from(err: avm_store::events::FeedError) -> Self {
        match err {
            avm_store::events::FeedError::Lagged => ConfigError::EventsLagged,
            avm_store::events::FeedError::Unavailable => ConfigError::EventsUnavailable,
        }
    }
}

impl From<ConfigError> for ApiError {
    fn from(err: ConfigError) -> Self {
        match err {
            ConfigError::Invalid { reason, message } => ApiError::invalid(reason, message),
            ConfigError::Api(api) => api,
            ConfigError::SecretUnreadable(_) => {
                ApiError::new(Code::Internal, "CONFIG_SECRET_UNREADABLE", err.to_string())
            }
            ConfigError::SecretKey(message) => ApiError::invalid("CONFIG_SECRET_KEY", message),
            ConfigError::EventsLagged => {
                ApiError::new(Code::ResourceExhausted, "CONFIG_EVENTS_LAGGED", err.to_string())
            }
            ConfigError::EventsUnavailable => ApiError::unavailable("CONFIG_EVENTS_UNAVAILABLE", err.to_string()),
            ConfigError::Store(err) => err.into_api("config"),
        }
    }
}

impl From<ConfigError> for tonic::Status {
    fn from(err: ConfigError) -> Self {
        ApiError::from(err).into()
    }
}

impl From<sqlx::Error> for ConfigError {
    fn from(err: sqlx::Error) -> Self {
        Self::Store(StoreError::Database(err))
    }
}

impl From<sqlx::migrate::MigrateError> for ConfigError {
    fn from(err: sqlx::migrate::MigrateError) -> Self {
        Self::Store(StoreError::Migration(err))
    }
}

impl ConfigError {
    /// Returns the error of a stored row this code cannot read back.
    pub(crate) fn corrupt(detail: impl Into<String>) -> Self {
        Self::Store(StoreError::Corrupt(detail.into()))
    }
}
