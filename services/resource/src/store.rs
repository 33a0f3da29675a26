//! The database: one trait, with a SQLite and a Postgres implementation that
//! share their statements (`store/sql.rs`).
//!
//! Every read takes the caller's tenant and sees only what that tenant may:
//! its own resources and public ones. Writes take the owner's tenant and touch
//! only its rows. Which version a requirement picks is decided in Rust
//! (`version.rs`) over a resource's few version strings, since SQL cannot
//! order semantic versions.

use std::sync::Arc;

use async_trait::async_trait;
use avm_common::ApiError;
use avm_store::db::{self, DbPool};

use crate::error::ResourceError;
use crate::kind::Kind;
use crate::record::{Deleted, ResourceRecord, ResourceUpdate, VersionInfo, VersionRecord};

mod postgres;
mod sql;
mod sqlite;

pub use postgres::PostgresResourceStore;
pub use sqlite::SqliteResourceStore;

/// The filters of a listing, already validated; every set one must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListFilter<'a> {
    pub kind: Option<Kind>,
    /// Exact name.
    pub name: Option<&'a str>,
    /// A valid tag the resource must carry.
    pub tag: Option<&'a str>,
    /// Text the name, description or a tag must contain, ignoring ASCII case.
    pub query: Option<&'a str>,
    /// Only resources ordered after this one (keyset pagination).
    pub after: Option<PageKey>,
}

/// Where a page of a listing ends: the order key of its last resource.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageKey {
    pub kind: Kind,
    pub name: String,
    pub resource_id: String,
}

/// Persists resources and their immutable versions.
#[async_trait]
pub trait ResourceStore: Send + Sync + 'static {
    /// Returns the resource of `kind` and `name` that `tenant_id` sees: its
    /// own, else a public one.
    async fn find_resource(
        &self,
        tenant_id: &str,
        kind: Kind,
        name: &str,
    ) -> Result<Option<ResourceRecord>, ResourceError>;

    /// Returns a resource `tenant_id` may read (its own or a public one).
    async fn get_resource(&self, tenant_id: &str, resource_id: &str) -> Result<Option<ResourceRecord>, ResourceError>;

    /// Returns the version strings of a resource `tenant_id` may read, in no
    /// particular order; empty when it may not.
    async fn version_numbers(&self, tenant_id: &str, resource_id: &str) -> Result<Vec<String>, ResourceError>;

    /// Returns every version of a resource `tenant_id` may read, without
    /// content, in no particular order; empty when it may not.
    async fn list_versions(&self, tenant_id: &str, resource_id: &str) -> Result<Vec<VersionInfo>, ResourceError>;

    /// Returns one version with its content, when `tenant_id` may read it.
    async fn get_version(
        &self,
        tenant_id: &str,
        resource_id: &str,
        version: &str,
    ) -> Result<Option<VersionRecord>, ResourceError>;

    /// Inserts a resource with its first version in one transaction; returns
    /// `false`, writing nothing, when the tenant already has a resource of that
    /// kind and name. `PublicNameTaken` when another public one has them.
    async fn create_resource(&self, resource: &ResourceRecord, version: &VersionRecord) -> Result<bool, ResourceError>;

    /// Adds a version to a resource of `tenant_id`, applies `update` and
    /// recomputes the latest version, in one transaction; returns the resource
    /// after it. `VersionExists` when the version was published before,
    /// `ResourceNotFound` when the resource is gone.
    async fn add_version(
        &self,
        tenant_id: &str,
        version: &VersionRecord,
        update: &ResourceUpdate,
        now_ms: i64,
    ) -> Result<ResourceRecord, ResourceError>;

    /// Returns up to `limit` resources `tenant_id` sees (its own, and public
    /// ones it does not shadow with its own of the same kind and name),
    /// ordered by kind name, name and resource id.
    async fn list_resources(
        &self,
        tenant_id: &str,
        filter: &ListFilter<'_>,
        limit: u32,
    ) -> Result<Vec<ResourceRecord>, ResourceError>;

    /// Deletes one exact version of `resource`, or every version (and the
    /// resource) when `version` is `None`; deleting the last version deletes
    /// the resource. Unless `force`, refuses with `InUse` when a version of
    /// another resource declares a requirement that holds on to a deleted
    /// version (`VersionSpec::claims`): one of the owner's tenant, or of any
    /// tenant that does not shadow the resource when it is public. The refusal
    /// names the owner tenant's dependents and only counts other tenants'.
    async fn delete_versions(
        &self,
        resource: &ResourceRecord,
        version: Option<&str>,
        force: bool,
        now_ms: i64,
    ) -> Result<Deleted, ResourceError>;
}

/// Opens the store named by `url` (`sqlite://…` or `postgres://…`) and brings its
/// schema up to date.
///
/// A Postgres url may choose the schema: `…?options=-c%20search_path%3D<schema>`.
pub async fn open_store(url: &str, max_connections: Option<u32>) -> Result<Arc<dyn ResourceStore>, ApiError> {
    let store: Arc<dyn ResourceStore> = match db::connect(url, max_connections).await? {
        DbPool::Sqlite(pool) => Arc::new(SqliteResourceStore::new(pool).await?),
        DbPool::Postgres(pool) => Arc::new(PostgresResourceStore::new(pool).await?),
    };
    Ok(store)
}
