//! The SQLite store: one file in WAL mode, for one-process deployments.

use sqlx::SqlitePool;
use sqlx::migrate::Migrator;

use crate::error::AuthError;
use avm_store::events::EventTransport;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// An `AuthStore` in a SQLite database.
#[derive(Clone, Debug)]
pub struct SqliteAuthStore {
    pool: SqlitePool,
}

impl SqliteAuthStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    ///
    /// The pool must enforce foreign keys (as `avm_store::db::open_sqlite` does):
    /// deleting a user or tenant relies on `ON DELETE CASCADE`.
    pub async fn new(pool: SqlitePool) -> Result<Self, AuthError> {
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }

    /// One process owns a SQLite file, so events stay in process.
    fn event_transport_impl(&self) -> EventTransport {
        EventTransport::InProcess
    }
}

super::sql::impl_auth_store!(SqliteAuthStore, sqlx::Sqlite);
