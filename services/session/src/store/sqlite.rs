//! The SQLite store: one file in WAL mode, for one-process deployments.

use avm_store::events::EventTransport;
use sqlx::SqlitePool;
use sqlx::migrate::Migrator;

use crate::error::SessionError;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// A `SessionStore` in a SQLite database.
#[derive(Clone, Debug)]
pub struct SqliteSessionStore {
    pool: SqlitePool,
}

impl SqliteSessionStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    ///
    /// The pool must enforce foreign keys (as `avm_store::db::open_sqlite` does):
    /// deleting an image or container relies on `ON DELETE CASCADE`.
    pub async fn new(pool: SqlitePool) -> Result<Self, SessionError> {
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }

    /// One process owns a SQLite file, so events stay in process.
    fn event_transport_impl(&self) -> EventTransport {
        EventTransport::InProcess
    }
}

super::sql::impl_session_store!(SqliteSessionStore, sqlx::Sqlite);
super::groups::impl_group_store!(SqliteSessionStore, sqlx::Sqlite);
