//! The auth service's one error type and its mapping onto the shared vocabulary.

use avm_common::{ApiError, Code};
use avm_store::StoreError;

/// Everything that can go wrong in the auth service.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The caller sent something the service refuses; `reason` is stable.
    #[error("{message}")]
    Invalid { reason: &'static str, message: String },
    /// The request is well formed but the state forbids it; `reason` is stable.
    #[error("{message}")]
    Precondition { reason: &'static str, message: String },
    /// The tenant does not exist, or the caller may not see it.
    #[error("tenant {0} not found")]
    TenantNotFound(String),
    /// The user does not exist, or the caller may not see them.
    #[error("user {0} not found")]
    UserNotFound(String),
    /// The API key does not exist, or the caller may not see it.
    #[error("api key {0} not found")]
    ApiKeyNotFound(String),
    /// An API key that is malformed, unknown, revoked, expired or of a deleted
    /// user or tenant: one answer for all, so a guesser learns nothing.
    #[error("the API key is invalid, revoked or expired")]
    InvalidApiKey,
    /// A token of the external issuer that cannot be trusted; why is logged.
    #[error("the external token is invalid")]
    InvalidExternalToken,
    /// `ExchangeExternalToken` without `[auth.oidc]`.
    #[error("no external OIDC issuer is configured")]
    OidcNotConfigured,
    /// The external issuer's keys cannot be fetched.
    #[error("the external issuer's keys cannot be fetched")]
    OidcUnavailable,
    /// The caller's key was revoked, or their user or tenant deleted, after
    /// their token was issued.
    #[error("the credential was revoked")]
    CredentialRevoked,
    /// A watcher fell too far behind the event feed.
    #[error("the auth event stream fell behind; reconnect")]
    EventsLagged,
    /// The cross-replica event feed is not live (or was interrupted).
    #[error("the auth event feed is unavailable; reconnect")]
    EventsUnavailable,
    /// An error already in the shared vocabulary (token checks, scope checks).
    #[error(transparent)]
    Api(#[from] ApiError),
    /// Signing or key handling failed.
    #[error("signing failed: {0}")]
    Signing(#[from] jsonwebtoken::errors::Error),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl AuthError {
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

impl From<AuthError> for ApiError {
    fn from(err: AuthError) -> Self {
        match err {
            AuthError::Invalid { reason, message } => ApiError::invalid(reason, message),
            AuthError::Precondition { reason, message } => ApiError::precondition(reason, message),
            AuthError::TenantNotFound(_) => ApiError::not_found("TENANT_NOT_FOUND", err.to_string()),
            AuthError::UserNotFound(_) => ApiError::not_found("USER_NOT_FOUND", err.to_string()),
            AuthError::ApiKeyNotFound(_) => ApiError::not_found("API_KEY_NOT_FOUND", err.to_string()),
            AuthError::InvalidApiKey => ApiError::new(Code::Unauthenticated, "INVALID_API_KEY", err.to_string()),
            AuthError::InvalidExternalToken => {
                ApiError::new(Code::Unauthenticated, "INVALID_EXTERNAL_TOKEN", err.to_string())
            }
            AuthError::OidcNotConfigured => ApiError::precondition("OIDC_NOT_CONFIGURED", err.to_string()),
            AuthError::OidcUnavailable => ApiError::unavailable("OIDC_UNAVAILABLE", err.to_string()),
            AuthError::CredentialRevoked => ApiError::new(Code::Unauthenticated, "CREDENTIAL_REVOKED", err.to_string()),
            AuthError::EventsLagged => ApiError::new(Code::ResourceExhausted, "AUTH_EVENTS_LAGGED", err.to_string()),
            AuthError::EventsUnavailable => ApiError::unavailable("AUTH_EVENTS_UNAVAILABLE", err.to_string()),
            AuthError::Api(api) => api,
            // A saturated pool or a lost connection is worth retrying; say so without details.
            AuthError::Store(err) => err.into_api("auth"),
            AuthError::Signing(_) => ApiError::internal(err),
        }
    }
}

impl From<AuthError> for tonic::Status {
    fn from(err: AuthError) -> Self {
        ApiError::from(err).to_status()
    }
}

impl From<sqlx::Error> for AuthError {
    fn from(err: sqlx::Error) -> Self {
        Self::Store(StoreError::Database(err))
    }
}

impl From<sqlx::migrate::MigrateError> for AuthError {
    fn from(err: sqlx::migrate::MigrateError) -> Self {
        Self::Store(StoreError::Migration(err))
    }
}

impl AuthError {
    /// Returns the error of a stored row this code cannot read back.
    pub(crate) fn corrupt(detail: impl Into<String>) -> Self {
        Self::Store(StoreError::Corrupt(detail.into()))
    }
}
