//! The Postgres store, for production; budget changes between replicas
//! travel by `NOTIFY` / `LISTEN`.

use avm_store::events::EventTransport;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::ObservabilityError;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// The notification channel of budget changes in the `public` schema.
pub const EVENT_CHANNEL: &str = "avm_observability_events";

/// An `ObservabilityStore` in a Postgres database, in the schema first on the pool's `search_path`.
#[derive(Clone, Debug)]
pub struct PostgresObservabilityStore {
    pool: PgPool,
    events: EventTransport,
}

impl PostgresObservabilityStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    pub async fn new(pool: PgPool) -> Result<Self, ObservabilityError> {
        MIGRATOR.run(&pool).await?;
        let events = EventTransport::postgres(&pool, EVENT_CHANNEL).await?;
        Ok(Self { pool, events })
    }

    /// Every replica on the same database hears every change.
    fn event_transport_impl(&self) -> EventTransport {
        self.events.clone()
    }
}

super::sql::impl_observability_store!(PostgresObservabilityStore, sqlx::Postgres);
