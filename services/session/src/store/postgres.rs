//! The Postgres store, for production.

use avm_store::events::EventTransport;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

use super::sql::{search_filters, visible};
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

    /// How every transaction begins.
    const BEGIN: &str = "BEGIN";

    /// Finds hits through the GIN indexes of `messages.search` and of the
    /// names' vectors, ranked by `ts_rank`, a page of them first, then the
    /// messages of that page alone.
    const SEARCH: &str = concat!(
        "SELECT h.container_id, h.image_id, h.session_id, h.image_name, h.score, h.at_ms, \
                m.message_id, m.seq, m.created_at_ms, m.body \
         FROM (SELECT i.container_id, i.image_id, s.session_id, i.name AS image_name, \
                      ts_rank(m.search, websearch_to_tsquery('simple', $1))::float8 AS score, \
                      m.created_at_ms AS at_ms, m.seq AS message_key \
               FROM messages m JOIN sessions s ON s.session_id = m.session_id \
               JOIN images i ON i.image_id = s.image_id \
               JOIN containers c ON c.tenant_id = i.tenant_id AND c.container_id = i.container_id \
               WHERE m.search @@ websearch_to_tsquery('simple', $1) AND ($6::text IS NULL OR m.kind = $6)",
        search_filters!("m.created_at_ms"),
        " UNION ALL \
          SELECT i.container_id, i.image_id, s.session_id, i.name, \
                 ts_rank(to_tsvector('simple', i.name), websearch_to_tsquery('simple', $1))::float8, \
                 i.created_at_ms, NULL::bigint \
          FROM images i JOIN sessions s ON s.image_id = i.image_id \
          JOIN containers c ON c.tenant_id = i.tenant_id AND c.container_id = i.container_id \
          WHERE to_tsvector('simple', i.name) @@ websearch_to_tsquery('simple', $1) AND $6::text IS NULL",
        search_filters!("i.created_at_ms"),
        " ORDER BY score DESC, at_ms DESC, image_id, message_key LIMIT $9 OFFSET $10) h \
         LEFT JOIN messages m ON m.session_id = h.session_id AND m.seq = h.message_key \
         ORDER BY h.score DESC, h.at_ms DESC, h.image_id, h.message_key"
    );

    /// Takes the advisory lock of this schema's sweep on a connection of its
    /// own, beside the pool (whose connections the sweep's deletions need),
    /// held until it is dropped: closing the connection releases the lock,
    /// whatever happened. Another replica's try fails at once.
    async fn lock_sweep_impl(&self) -> Result<Option<super::SweepLock>, SessionError> {
        use sqlx::Connection;
        let mut connection = sqlx::PgConnection::connect_with(&self.pool.connect_options()).await?;
        let locked = sqlx::query_scalar::<_, bool>(
            "SELECT pg_try_advisory_lock(hashtext(COALESCE(current_schema(), '') || '.avm_session_retention'))",
        )
        .fetch_one(&mut connection)
        .await?;
        if !locked {
            connection.close().await?;
            return Ok(None);
        }
        Ok(Some(super::SweepLock(Box::new(connection))))
    }

    /// Every replica on the same database hears every deletion.
    fn event_transport_impl(&self) -> EventTransport {
        self.events.clone()
    }
}

super::sql::impl_session_store!(PostgresSessionStore, sqlx::Postgres);
super::groups::impl_group_store!(PostgresSessionStore, sqlx::Postgres);
