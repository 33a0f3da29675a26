//! The Postgres store, for production.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::ResourceError;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// A `ResourceStore` in a Postgres database, in the schema first on the pool's `search_path`.
#[derive(Clone, Debug)]
pub struct PostgresResourceStore {
    pool: PgPool,
}

impl PostgresResourceStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    pub async fn new(pool: PgPool) -> Result<Self, ResourceError> {
        MIGRATOR.run(&pool).await?;
        Ok(Self { pool })
    }
}

super::sql::impl_resource_store!(PostgresResourceStore, sqlx::Postgres);
