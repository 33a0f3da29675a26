//! Database pools: SQLite (WAL) for one-process mode, Postgres in production.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};

use crate::ApiError;

/// A connected pool of either supported database.
#[derive(Clone, Debug)]
pub enum DbPool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// Opens the database named by `url` (`sqlite://…` or `postgres://…`).
pub async fn connect(url: &str, max_connections: Option<u32>) -> Result<DbPool, ApiError> {
    if url.starts_with("sqlite:") {
        open_sqlite(url, max_connections).await.map(DbPool::Sqlite)
    } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        open_postgres(url, max_connections).await.map(DbPool::Postgres)
    } else {
        Err(ApiError::invalid(
            "UNSUPPORTED_DATABASE_URL",
            "database url must start with sqlite:// or postgres://",
        ))
    }
}

/// Opens (creating if needed) a SQLite database in WAL mode.
pub async fn open_sqlite(url: &str, max_connections: Option<u32>) -> Result<SqlitePool, ApiError> {
    let options = SqliteConnectOptions::from_str(url)
        .map_err(|err| ApiError::invalid("INVALID_DATABASE_URL", format!("invalid sqlite url: {err}")))?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // NORMAL is durable across process crashes in WAL mode and much cheaper than FULL.
        .synchronous(SqliteSynchronous::Normal)
        .foreign_keys(true)
        .busy_timeout(Duration::from_secs(5));
    SqlitePoolOptions::new()
        .max_connections(max_connections.unwrap_or(4))
        .connect_with(options)
        .await
        .map_err(|err| unavailable("sqlite", &err))
}

/// Opens a Postgres pool.
pub async fn open_postgres(url: &str, max_connections: Option<u32>) -> Result<PgPool, ApiError> {
    let options = PgConnectOptions::from_str(url)
        .map_err(|_| ApiError::invalid("INVALID_DATABASE_URL", "invalid postgres url"))?;
    PgPoolOptions::new()
        .max_connections(max_connections.unwrap_or(10))
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(|err| unavailable("postgres", &err))
}

fn unavailable(kind: &str, err: &sqlx::Error) -> ApiError {
    // The url may hold a password, so it is never part of the message.
    tracing::error!(database = kind, error = %err, "cannot open database");
    ApiError::unavailable(
        "DATABASE_UNAVAILABLE",
        format!("cannot open the {kind} database: {err}"),
    )
}
