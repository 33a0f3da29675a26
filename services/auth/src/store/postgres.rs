//! The Postgres store, for production; events between replicas travel by
//! `NOTIFY` / `LISTEN`.

use avm_store::events::EventTransport;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::AuthError;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// The notification channel of auth events in the `public` schema.
pub const EVENT_CHANNEL: &str = "avm_auth_events";

/// An `AuthStore` in a Postgres database, in the schema first on the pool's `search_path`.
#[derive(Clone, Debug)]
pub struct PostgresAuthStore {
    pool: PgPool,
    events: EventTransport,
}

impl PostgresAuthStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    pub async fn new(pool: PgPool) -> Result<Self, AuthError> {
        MIGRATOR.run(&pool).await?;
        let events = EventTransport::postgres(&pool, EVENT_CHANNEL).await?;
        Ok(Self { pool, events })
    }

    /// Every replica on the same database hears every event.
    fn event_transport_impl(&self) -> EventTransport {
        self.events.clone()
    }
}

super::sql::impl_auth_store!(PostgresAuthStore, sqlx::Postgres);
