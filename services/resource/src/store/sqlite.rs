//! The SQLite store: one file in WAL mode, for one-process deployments.

use sqlx::SqlitePool;
use sqlx::migrate::Migrator;

use crate::error::ResourceError;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// A `ResourceStore` in a SQLite database.
#[derive(Clone, Debug)]
pub struct SqliteResourceStore {
    pool: SqlitePool,
}

impl SqliteResourceStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    ///
    /// The pool must enforce foreign keys (as `avm_store::db::open_sqlite` does):
    /// deleting a resource or a version relies on `ON DELETE CASCADE`.
    pub async fn new(pool: SqlitePool) -> Result<Self, ResourceError> {
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }
}

super::sql::impl_resource_store!(SqliteResourceStore, sqlx::Sqlite);
