//! The resource service's one error type and its mapping onto the shared vocabulary.

use avm_common::{ApiError, Code};
use avm_store::StoreError;

/// Everything that can go wrong in the resource service.
#[derive(Debug, thiserror::Error)]
pub enum ResourceError {
    /// The caller sent something the service refuses; `reason` is stable.
    #[error("{message}")]
    Invalid { reason: &'static str, message: String },
    /// The resource (an id or a URI) does not exist, or the caller may not see it:
    /// one answer for both, so another tenant's private resource stays unknown.
    #[error("resource {0} not found")]
    ResourceNotFound(String),
    /// No published version of a visible resource matches the requested one;
    /// holds the URI that was asked for.
    #[error("{0} matches no published version")]
    VersionNotFound(String),
    /// The version was published before; versions are immutable. Holds the exact URI.
    #[error("{0} already exists; published versions never change")]
    VersionExists(String),
    /// Another tenant already publishes a public resource of this kind and name.
    #[error("a public resource {0} already exists")]
    PublicNameTaken(String),
    /// `public` asked on a later registration of a private resource; holds its URI.
    #[error("{0} is private; visibility is chosen when a resource is first registered")]
    VisibilityMismatch(String),
    /// A dependency requirement resolves to nothing; holds the chain that led to it.
    #[error("missing dependency: {0}")]
    MissingDependency(String),
    /// A public resource would depend on a resource other tenants cannot read.
    #[error("public resources may only depend on public ones: {0} is private")]
    PrivateDependency(String),
    /// A version names its own resource among its dependencies.
    #[error("{0} cannot depend on itself")]
    SelfDependency(String),
    /// Resolving went round in a circle; holds the path, first node repeated last.
    #[error("dependency cycle: {0}")]
    DependencyCycle(String),
    /// Other resources depend on what a delete would remove.
    #[error("{target} is used by {dependents}")]
    InUse { target: String, dependents: String },
    /// The resource is public and the caller's tenant does not own it; holds its id.
    #[error("only the tenant that owns resource {0} may change it")]
    NotOwner(String),
    /// A member publishes a version of a resource another user owns; holds its id.
    #[error("only the user who registered resource {0} or an admin of its tenant may publish its versions")]
    NotPublisher(String),
    /// The caller is not allowed this operation (scope or role).
    #[error("{0}")]
    Denied(ApiError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ResourceError {
    /// Returns an `Invalid` error with a stable reason.
    pub fn invalid(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            reason,
            message: message.into(),
        }
    }
}

impl From<ResourceError> for ApiError {
    fn from(err: ResourceError) -> Self {
        match err {
            ResourceError::Invalid { reason, message } => ApiError::invalid(reason, message),
            ResourceError::Denied(err) => err,
            ResourceError::ResourceNotFound(_) => ApiError::not_found("RESOURCE_NOT_FOUND", err.to_string()),
            ResourceError::VersionNotFound(_) => ApiError::not_found("VERSION_NOT_FOUND", err.to_string()),
            ResourceError::VersionExists(_) => ApiError::new(Code::AlreadyExists, "VERSION_EXISTS", err.to_string()),
            ResourceError::PublicNameTaken(_) => {
                ApiError::new(Code::AlreadyExists, "PUBLIC_NAME_TAKEN", err.to_string())
            }
            ResourceError::VisibilityMismatch(_) => ApiError::precondition("VISIBILITY_MISMATCH", err.to_string()),
            ResourceError::MissingDependency(_) => ApiError::precondition("MISSING_DEPENDENCY", err.to_string()),
            ResourceError::PrivateDependency(_) => ApiError::precondition("PRIVATE_DEPENDENCY", err.to_string()),
            ResourceError::SelfDependency(_) => ApiError::invalid("SELF_DEPENDENCY", err.to_string()),
            ResourceError::DependencyCycle(_) => ApiError::precondition("DEPENDENCY_CYCLE", err.to_string()),
            ResourceError::InUse { .. } => ApiError::precondition("RESOURCE_IN_USE", err.to_string()),
            ResourceError::NotOwner(_) => ApiError::new(Code::PermissionDenied, "NOT_RESOURCE_OWNER", err.to_string()),
            ResourceError::NotPublisher(_) => {
                ApiError::new(Code::PermissionDenied, "NOT_RESOURCE_OWNER", err.to_string())
            }
            ResourceError::Store(err) => err.into_api("resource"),
        }
    }
}

impl From<ResourceError> for tonic::Status {
    fn from(err: ResourceError) -> Self {
        ApiError::from(err).to_status()
    }
}

impl From<sqlx::Error> for ResourceError {
    fn from(err: sqlx::Error) -> Self {
        Self::Store(StoreError::Database(err))
    }
}

impl From<sqlx::migrate::MigrateError> for ResourceError {
    fn from(err: sqlx::migrate::MigrateError) -> Self {
        Self::Store(StoreError::Migration(err))
    }
}

impl ResourceError {
    /// Returns the error of a stored row this code cannot read back.
    pub(crate) fn corrupt(detail: impl Into<String>) -> Self {
        Self::Store(StoreError::Corrupt(detail.into()))
    }
}
