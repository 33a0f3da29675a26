//! The SQLite store: one file in WAL mode, for one-process deployments.

use avm_store::events::EventTransport;
use sqlx::SqlitePool;
use sqlx::migrate::Migrator;

use super::sql::{search_filters, visible};
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

    /// How every transaction begins: with the write lock, where
    /// `busy_timeout` waits for it. A deferred transaction whose first write
    /// reaches an FTS5 index (the search triggers) fails at once with
    /// `SQLITE_BUSY` when another writer holds the lock.
    const BEGIN: &str = "BEGIN IMMEDIATE";

    /// Finds hits through the FTS5 indexes of messages and names, ranked by
    /// BM25 (`bm25()` is lower for better hits, so its negation scores), a
    /// page of them first, then the messages of that page alone.
    const SEARCH: &str = concat!(
        "SELECT h.container_id, h.image_id, h.session_id, h.image_name, h.score, h.at_ms, \
                m.message_id, m.seq, m.created_at_ms, m.body \
         FROM (SELECT i.container_id AS container_id, i.image_id AS image_id, s.session_id AS session_id, \
                      i.name AS image_name, -bm25(message_search) AS score, m.created_at_ms AS at_ms, \
                      m.id AS message_key \
               FROM message_search JOIN messages m ON m.id = message_search.rowid \
               JOIN sessions s ON s.session_id = m.session_id JOIN images i ON i.image_id = s.image_id \
               JOIN containers c ON c.tenant_id = i.tenant_id AND c.container_id = i.container_id \
               WHERE message_search MATCH $1 AND ($6 IS NULL OR m.kind = $6)",
        search_filters!("m.created_at_ms"),
        " UNION ALL \
          SELECT i.container_id, i.image_id, s.session_id, i.name, -bm25(image_search), i.created_at_ms, NULL \
          FROM image_search JOIN image_search_keys k ON k.id = image_search.rowid \
          JOIN images i ON i.image_id = k.image_id JOIN sessions s ON s.image_id = i.image_id \
          JOIN containers c ON c.tenant_id = i.tenant_id AND c.container_id = i.container_id \
          WHERE image_search MATCH $1 AND $6 IS NULL",
        search_filters!("i.created_at_ms"),
        " ORDER BY score DESC, at_ms DESC, image_id, message_key LIMIT $9 OFFSET $10) h \
         LEFT JOIN messages m ON m.id = h.message_key \
         ORDER BY h.score DESC, h.at_ms DESC, h.image_id, h.message_key"
    );

    /// One process owns a SQLite file: nobody else sweeps it.
    async fn lock_sweep_impl(&self) -> Result<Option<super::SweepLock>, SessionError> {
        Ok(Some(super::SweepLock(Box::new(()))))
    }

    /// One process owns a SQLite file, so events stay in process.
    fn event_transport_impl(&self) -> EventTransport {
        EventTransport::InProcess
    }
}

super::sql::impl_session_store!(SqliteSessionStore, sqlx::Sqlite);
super::groups::impl_group_store!(SqliteSessionStore, sqlx::Sqlite);
