//! The Postgres store, for production.

use avm_store::events::EventTransport;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::SessionError;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// A `SessionStore` in a Postgres database, in the schema first on the pool's `search_path`.
#[derive(Clone, Debug)]
pub struct PostgresSessionStore {
    pool: PgPool,
    events: EventTransport,
}

/// The notification channel of session deletions in the `public` schema.
pub const EVENT_CHANNEL: &str = "avm_session_events";

impl PostgresSessionStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    pub async fn new(pool: PgPool) -> Result<Self, SessionError> {
        MIGRATOR.run(&pool).await?;
        let events = EventTransport::postgres(&pool, EVENT_CHANNEL).await?;
        Ok(Self { pool, events })
    }

    /// Every replica on the same database hears every deletion.
    fn event_transport_impl(&self) -> EventTransport {
        self.events.clone()
    }
}

super::sql::impl_session_store!(PostgresSessionStore, sqlx::Postgres);
super::groups::impl_group_store!(PostgresSessionStore, sqlx::Postgres);
