//! The Postgres store, for production.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::SessionError;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// A `SessionStore` in a Postgres database, in the schema first on the pool's `search_path`.
#[derive(Clone, Debug)]
pub struct PostgresSessionStore {
    pool: PgPool,
}

impl PostgresSessionStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    pub async fn new(pool: PgPool) -> Result<Self, SessionError> {
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }
}

super::sql::impl_session_store!(PostgresSessionStore, sqlx::Postgres);
