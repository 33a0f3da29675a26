//! The SQLite store: one file in WAL mode, for one-process deployments.

use avm_store::events::EventTransport;
use sqlx::SqlitePool;
use sqlx::migrate::Migrator;

use crate::error::ConfigError;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// A `ConfigStore` in a SQLite database.
#[derive(Clone, Debug)]
pub struct SqliteConfigStore {
    pool: SqlitePool,
}

impl SqliteConfigStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    pub async fn new(pool: SqlitePool) -> Result<Self, ConfigError> {
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }

    /// One process owns a SQLite file, so events stay in process.
    fn event_transport_impl(&self) -> EventTransport {
        EventTransport::InProcess
    }
}

super::sql::impl_config_store!(SqliteConfigStore);
