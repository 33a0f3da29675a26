//! The Postgres store, for production; events between replicas travel by
//! `NOTIFY` / `LISTEN`.

use async_trait::async_trait;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgListener;

use crate::error::AuthError;
use crate::store::EventFeed;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

/// The notification channel of auth events in the `public` schema.
pub const EVENT_CHANNEL: &str = "avm_auth_events";

/// An `AuthStore` in a Postgres database, in the schema first on the pool's `search_path`.
#[derive(Clone, Debug)]
pub struct PostgresAuthStore {
    pool: PgPool,
    channel: String,
}

impl PostgresAuthStore {
    /// Returns a store on `pool` after bringing its schema up to date.
    pub async fn new(pool: PgPool) -> Result<Self, AuthError> {
        MIGRATOR.run(&pool).await?;
        let schema: Option<String> = sqlx::query_scalar("SELECT current_schema()").fetch_one(&pool).await?;
        let channel = event_channel(schema.as_deref().unwrap_or("public"));
        Ok(Self { pool, channel })
    }

    /// Every replica on the same database hears every event.
    fn shares_events_impl(&self) -> bool {
        true
    }

    async fn publish_event_impl(&self, payload: &str) -> Result<(), AuthError> {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(&self.channel)
            .bind(payload)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn listen_events_impl(&self) -> Result<Option<Box<dyn EventFeed>>, AuthError> {
        let mut listener = PgListener::connect_with(&self.pool).await?;
        listener.listen(&self.channel).await?;
        Ok(Some(Box::new(PgEventFeed { listener })))
    }
}

/// Returns the channel of a schema's events.
///
/// Notification channels are per database, not per schema, so deployments
/// (and tests) sharing a database in separate schemas would hear each other;
/// any schema but `public` gets its own channel, hashed to stay within
/// Postgres's 63-byte identifiers.
fn event_channel(schema: &str) -> String {
    if schema == "public" {
        return EVENT_CHANNEL.to_owned();
    }
    let digest = Sha256::digest(schema.as_bytes());
    let suffix: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{EVENT_CHANNEL}_{suffix}")
}

struct PgEventFeed {
    listener: PgListener,
}

#[async_trait]
impl EventFeed for PgEventFeed {
    async fn next(&mut self) -> Result<Option<String>, AuthError> {
        // `try_recv` says `None` when the connection dropped (and reconnects),
        // which is exactly when notifications may have been lost.
        let notification = self.listener.try_recv().await?;
        Ok(notification.map(|n| n.payload().to_owned()))
    }
}

super::sql::impl_auth_store!(PostgresAuthStore, sqlx::Postgres);
