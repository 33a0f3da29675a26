//! The database: one trait, with a SQLite and a Postgres implementation that
//! share their statements (`store/sql.rs`).

use std::sync::Arc;

use async_trait::async_trait;
use avm_common::ApiError;
use avm_store::db::{self, DbPool};
use avm_store::events::EventTransport;

use crate::error::ConfigError;

mod postgres;
mod sql;
mod sqlite;

pub use postgres::PostgresConfigStore;
pub use sqlite::SqliteConfigStore;

/// The scope of the system's own overrides; a tenant's scope is its id.
pub const SYSTEM_SCOPE: &str = "";

/// An override as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredValue {
    pub key: String,
    /// The JSON value, or for secrets the sealed JSON.
    pub value: String,
    pub encrypted: bool,
}

/// One change of an `apply`: a new stored value, or `None` to remove the override.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub key: String,
    pub value: Option<StoredValue>,
}

/// Persists the overrides of every scope and the revision counter.
#[async_trait]
pub trait ConfigStore: Send + Sync + 'static {
    /// Returns the overrides of `scope` (the system's or a tenant's), by key.
    async fn overrides(&self, scope: &str) -> Result<Vec<StoredValue>, ConfigError>;

    /// Applies `changes` to `scope` in one transaction and returns the new revision.
    async fn apply(&self, scope: &str, changes: &[Change], updated_by: &str, now_ms: i64) -> Result<u64, ConfigError>;

    /// Returns the current revision.
    async fn revision(&self) -> Result<u64, ConfigError>;

    /// Returns how change events travel between the replicas on this store.
    fn event_transport(&self) -> EventTransport;
}

/// Opens the store named by `url` (`sqlite://…` or `postgres://…`) and brings
/// its schema up to date.
pub async fn open_store(url: &str, max_connections: Option<u32>) -> Result<Arc<dyn ConfigStore>, ApiError> {
    let store: Arc<dyn ConfigStore> = match db::connect(url, max_connections).await? {
        DbPool::Sqlite(pool) => Arc::new(SqliteConfigStore::new(pool).await?),
        DbPool::Postgres(pool) => Arc::new(PostgresConfigStore::new(pool).await?),
    };
    Ok(store)
}
