//! Database pools: SQLite (WAL) for one-process mode, Postgres in production.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};

use avm_common::ApiError;

/// A connected pool of either supported database.
#[derive(Clone, Debug)]
pub enum DbPool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// Opens the database named by `url` (`sqlite://…` or `postgres://…`).
///
/// The pool's use shows in `/metrics` as `avm_db_pool_connections{pool, state}`,
/// `pool` naming the SQLite file or Postgres schema.
pub async fn connect(url: &str, max_connections: Option<u32>) -> Result<DbPool, ApiError> {
    let pool = if url.starts_with("sqlite:") {
        open_sqlite(url, max_connections).await.map(DbPool::Sqlite)?
    } else if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        open_postgres(url, max_connections).await.map(DbPool::Postgres)?
    } else {
        return Err(ApiError::invalid(
            "UNSUPPORTED_DATABASE_URL",
            "database url must start with sqlite:// or postgres://",
        ));
    };
    let name = pool_name(url);
    let observed = pool.clone();
    avm_common::telemetry::on_scrape(move || {
        let (size, idle) = match &observed {
            DbPool::Sqlite(pool) => (pool.size(), pool.num_idle()),
            DbPool::Postgres(pool) => (pool.size(), pool.num_idle()),
        };
        let idle = u32::try_from(idle).unwrap_or(u32::MAX);
        metrics::gauge!("avm_db_pool_connections", "pool" => name.clone(), "state" => "idle").set(f64::from(idle));
        metrics::gauge!("avm_db_pool_connections", "pool" => name.clone(), "state" => "used")
            .set(f64::from(size.saturating_sub(idle)));
    });
    Ok(pool)
}

/// Returns what names a pool in metrics: the SQLite file's stem or the
/// Postgres schema (never credentials).
fn pool_name(url: &str) -> String {
    if url.starts_with("sqlite:") {
        let path = url.split('?').next().unwrap_or_default();
        let file = path.rsplit('/').next().unwrap_or_default();
        return file.split('.').next().unwrap_or_default().to_owned();
    }
    search_path(url).unwrap_or_else(|| "public".to_owned())
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
        // A file connection cannot go stale, and each check is a round trip
        // to the connection's thread: a second wakeup for every query.
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .map_err(|err| unavailable("sqlite", &err))
}

/// Opens a Postgres pool; the schema the url's `search_path` names is created
/// when missing, safely when several replicas start at once.
pub async fn open_postgres(url: &str, max_connections: Option<u32>) -> Result<PgPool, ApiError> {
    let options = PgConnectOptions::from_str(url)
        .map_err(|_| ApiError::invalid("INVALID_DATABASE_URL", "invalid postgres url"))?;
    if let Some(schema) = search_path(url) {
        let mut connection: sqlx::PgConnection = sqlx::Connection::connect_with(&options)
            .await
            .map_err(|err| unavailable("postgres", &err))?;
        create_schema(&mut connection, &schema)
            .await
            .map_err(|err| unavailable("postgres", &err))?;
        sqlx::Connection::close(connection)
            .await
            .map_err(|err| unavailable("postgres", &err))?;
    }
    PgPoolOptions::new()
        .max_connections(max_connections.unwrap_or(10))
        // Also how long sqlx keeps trying a refused connection: while the
        // database is down, a call needing a new connection fails
        // (UNAVAILABLE) after it. Shorter would turn a busy pool into errors.
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|err| unavailable("postgres", &err))
}

/// How long a call waits for a pooled Postgres connection.
pub const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Creates `schema` unless it exists.
///
/// `CREATE SCHEMA IF NOT EXISTS` does not guard against itself: two replicas
/// starting together may both find the schema missing, and the second then
/// fails on `pg_namespace_nspname_index`. The check and the creation run
/// under a transaction-scoped advisory lock named after the schema, so the
/// second waits for the first to commit and finds the schema there. (The
/// migrations that follow are serialised by sqlx's own advisory lock.)
async fn create_schema(connection: &mut sqlx::PgConnection, schema: &str) -> Result<(), sqlx::Error> {
    let mut tx = sqlx::Connection::begin(connection).await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(format!("avm create schema {schema}"))
        .execute(&mut *tx)
        .await?;
    sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""))
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// Returns the error a caller sees when `service`'s database failed: a
/// saturated pool or a lost connection is worth retrying (UNAVAILABLE), any
/// other failure is internal; the detail is logged, never returned.
pub fn database_error(service: &str, err: &sqlx::Error) -> ApiError {
    match err {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) => {
            tracing::error!(service, error = %err, "database unavailable");
            ApiError::unavailable("DATABASE_UNAVAILABLE", format!("the {service} database is unavailable"))
        }
        // A server shutting down or restarting ends its sessions with class
        // 57 (operator intervention) or 08 (connection exception).
        sqlx::Error::Database(db)
            if db
                .code()
                .is_some_and(|code| code.starts_with("57") || code.starts_with("08")) =>
        {
            tracing::error!(service, error = %err, "database unavailable");
            ApiError::unavailable("DATABASE_UNAVAILABLE", format!("the {service} database is unavailable"))
        }
        _ => ApiError::internal(format_args!("{service} database: {err}")),
    }
}

/// Returns the database url `service` uses when the deployment names one
/// database for all: each service keeps its tables (and its migration history)
/// apart. SQLite gets a file per service (`avm.db` → `avm-session.db`);
/// Postgres a schema per service (`avm_session`, or `<search_path>_session`
/// when the url names a search path).
pub fn service_url(url: &str, service: &str) -> Result<String, ApiError> {
    let invalid = || ApiError::invalid("INVALID_DATABASE_URL", "the database url cannot be parsed");
    if url.starts_with("sqlite:") {
        if url.contains(":memory:") {
            return Ok(url.to_owned());
        }
        let (path, query) = url.split_once('?').map_or((url, None), |(p, q)| (p, Some(q)));
        let file_start = path.rfind('/').map_or(0, |i| i + 1);
        let stem_end = path[file_start..].rfind('.').map_or(path.len(), |i| file_start + i);
        let mut derived = format!("{}-{service}{}", &path[..stem_end], &path[stem_end..]);
        if let Some(query) = query {
            derived.push('?');
            derived.push_str(query);
        }
        return Ok(derived);
    }
    let mut parsed = url::Url::parse(url).map_err(|_| invalid())?;
    let base = search_path(url).unwrap_or_else(|| "avm".to_owned());
    let kept: Vec<(String, String)> = parsed
        .query_pairs()
        .filter(|(key, value)| !(key == "options" && value.contains("search_path")))
        .map(|(key, value)| (key.into_owned(), value.into_owned()))
        .collect();
    {
        let mut query = parsed.query_pairs_mut();
        query.clear();
        for (key, value) in &kept {
            query.append_pair(key, value);
        }
        query.append_pair("options", &format!("-c search_path={base}_{service}"));
    }
    Ok(parsed.to_string())
}

/// Returns the schema a Postgres url's `options=-c search_path=…` names.
fn search_path(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok()?;
    let options = parsed
        .query_pairs()
        .find(|(key, _)| key == "options")
        .map(|(_, value)| value.into_owned())?;
    let value = options.split("search_path=").nth(1)?;
    let schema: String = value
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!schema.is_empty()).then_some(schema)
}

fn unavailable(kind: &str, err: &sqlx::Error) -> ApiError {
    // The url may hold a password, so it is never part of the message.
    tracing::error!(database = kind, error = %err, "cannot open database");
    ApiError::unavailable(
        "DATABASE_UNAVAILABLE",
        format!("cannot open the {kind} database: {err}"),
    )
}

#[cfg(test)]
mod tests {
    use super::{pool_name, service_url};

    #[test]
    fn pools_are_named_without_credentials() {
        assert_eq!(pool_name("sqlite:///tmp/x/auth.db?mode=rwc"), "auth");
        assert_eq!(
            pool_name("postgres://user:secret@db/avm?options=-c%20search_path%3Davm_session"),
            "avm_session"
        );
        assert_eq!(pool_name("postgres://user:secret@db/avm"), "public");
    }

    #[test]
    fn each_service_gets_its_own_file_or_schema() {
        assert_eq!(
            service_url("sqlite:///data/avm.db", "auth").ok().as_deref(),
            Some("sqlite:///data/avm-auth.db")
        );
        assert_eq!(
            service_url("sqlite://avm?mode=rwc", "session").ok().as_deref(),
            Some("sqlite://avm-session?mode=rwc")
        );
        assert_eq!(
            service_url("postgres://u@db:5432/app", "auth").ok().as_deref(),
            Some("postgres://u@db:5432/app?options=-c+search_path%3Davm_auth")
        );
        assert_eq!(
            service_url(
                "postgres://u@db/app?sslmode=disable&options=-c%20search_path%3Dtest_1",
                "session"
            )
            .ok()
            .as_deref(),
            Some("postgres://u@db/app?sslmode=disable&options=-c+search_path%3Dtest_1_session")
        );
    }
}
