//! The statements and the `ObservabilityStore` implementation shared by
//! SQLite and Postgres.
//!
//! Both dialects accept `$N` placeholders (a number used twice is one
//! parameter), multi-row `VALUES`, `ON CONFLICT … DO NOTHING RETURNING`, row
//! values and window functions, so one text serves both. Queries whose
//! conditions depend on the request are assembled here from fixed fragments,
//! never from caller text, which only ever travels as bound parameters.
//!
//! The implementation is a macro expanded per store, as in the config and
//! resource services: code generic over `sqlx::Database` needs higher-ranked
//! `Executor` bounds that the `Send` futures of `async_trait` do not meet.
//! Every transaction starts with its write, so SQLite takes the write lock up
//! front, where `busy_timeout` applies.

use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::error::ObservabilityError;
use crate::record::{CallStatus, Dimension, Level, LogEvent, LogFilter, PageKey, UsageFilter, UsageRecord};

/// The columns of a ledger record as read back.
macro_rules! usage_columns {
    () => {
        "call_id, tenant_id, user_id, key_id, container_id, image_id, agent_id, provider, model, \
         input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, estimated, status, error_code, \
         started_at_ms, ended_at_ms, first_token_ms, cost_pico_usd, billed_pico_usd, priced, own_key"
    };
}

/// The columns of an inserted ledger record, in the order `insert_usage` binds them.
const USAGE_INSERT_COLUMNS: &str = concat!(usage_columns!(), ", day, month, recorded_at_ms");
const USAGE_INSERT_ARITY: usize = 26;

/// The columns of an inserted log event, in the order `insert_logs` binds them.
const LOG_COLUMNS: &str = "tenant_id, at_ms, level, component, target, message, fields_json, request_id, trace_id";
const LOG_ARITY: usize = 9;

/// Rows per multi-row `INSERT`, largest first. Few distinct sizes keep the
/// statements few, so each is prepared once per connection; 500 rows of 26
/// parameters stay under SQLite's 32,766 and Postgres's 65,535 parameters.
const INSERT_SIZES: [usize; 4] = [500, 100, 10, 1];

pub(super) const MONTH_SPEND: &str = "\
    SELECT CAST(COALESCE(SUM(billed_pico_usd), 0) AS BIGINT) FROM usage_records \
    WHERE tenant_id = $1 AND month = $2";
pub(super) const MONTH_SPEND_OF_KEY: &str = "\
    SELECT CAST(COALESCE(SUM(billed_pico_usd), 0) AS BIGINT) FROM usage_records \
    WHERE tenant_id = $1 AND month = $2 AND key_id = $3";

pub(super) const SELECT_BUDGETS: &str =
    "SELECT tenant_id, key_id, monthly_limit_pico_usd, updated_at_ms FROM usage_budgets";
pub(super) const SELECT_TENANT_BUDGETS: &str =
    "SELECT tenant_id, key_id, monthly_limit_pico_usd, updated_at_ms FROM usage_budgets WHERE tenant_id = $1";
pub(super) const SELECT_CALL_BUDGETS: &str = "\
    SELECT tenant_id, key_id, monthly_limit_pico_usd, updated_at_ms FROM usage_budgets \
    WHERE tenant_id = $1 AND (key_id = '' OR key_id = $2)";
pub(super) const UPSERT_BUDGET: &str = "\
    INSERT INTO usage_budgets (tenant_id, key_id, monthly_limit_pico_usd, updated_at_ms) VALUES ($1, $2, $3, $4) \
    ON CONFLICT (tenant_id, key_id) DO UPDATE SET monthly_limit_pico_usd = excluded.monthly_limit_pico_usd, \
    updated_at_ms = excluded.updated_at_ms";
pub(super) const DELETE_BUDGET: &str = "DELETE FROM usage_budgets WHERE tenant_id = $1 AND key_id = $2";

pub(super) const DELETE_OLD_LOGS: &str = "DELETE FROM log_events WHERE at_ms < $1";
/// Deletes every tenant's events beyond its newest `$1`, looking only at
/// the tenants over the cap.
pub(super) const DELETE_EXCESS_LOGS: &str = "\
    DELETE FROM log_events WHERE id IN ( \
      SELECT id FROM ( \
        SELECT id, ROW_NUMBER() OVER (PARTITION BY tenant_id ORDER BY at_ms DESC, id DESC) AS position \
        FROM log_events WHERE tenant_id IN ( \
          SELECT tenant_id FROM log_events GROUP BY tenant_id HAVING COUNT(*) > $1) \
      ) ranked WHERE position > $1)";

/// A value bound to a statement.
pub(super) enum Arg {
    Text(String),
    Int(i64),
    Int32(i32),
}

/// A statement assembled for one request, with its parameters in order.
pub(super) struct Statement {
    pub(super) sql: String,
    pub(super) args: Vec<Arg>,
}

impl Statement {
    fn new(sql: &str) -> Self {
        Self {
            sql: sql.to_owned(),
            args: Vec::new(),
        }
    }

    /// Adds a parameter and returns its placeholder.
    fn param(&mut self, arg: Arg) -> String {
        self.args.push(arg);
        format!("${}", self.args.len())
    }

    /// Appends ` WHERE` and the conditions of `filter` (all of them must hold).
    fn usage_conditions(&mut self, filter: &UsageFilter, extra: Option<String>) {
        let mut conditions = Vec::new();
        if let Some(tenant_id) = &filter.tenant_id {
            conditions.push(format!("tenant_id = {}", self.param(Arg::Text(tenant_id.clone()))));
        }
        if let Some(from_ms) = filter.from_ms {
            conditions.push(format!("started_at_ms >= {}", self.param(Arg::Int(from_ms))));
        }
        if let Some(to_ms) = filter.to_ms {
            conditions.push(format!("started_at_ms < {}", self.param(Arg::Int(to_ms))));
        }
        if let Some(key_id) = &filter.key_id {
            conditions.push(format!("key_id = {}", self.param(Arg::Text(key_id.clone()))));
        }
        if let Some(model) = &filter.model {
            conditions.push(format!("model = {}", self.param(Arg::Text(model.clone()))));
        }
        if let Some(user_id) = &filter.user_id {
            conditions.push(format!("user_id = {}", self.param(Arg::Text(user_id.clone()))));
        }
        conditions.extend(extra);
        self.sql.push_str(" WHERE ");
        if conditions.is_empty() {
            self.sql.push_str("1 = 1");
        } else {
            self.sql.push_str(&conditions.join(" AND "));
        }
    }
}

/// Returns the column a dimension groups by.
fn dimension_column(dimension: Dimension) -> &'static str {
    match dimension {
        Dimension::Tenant => "tenant_id",
        Dimension::Key => "key_id",
        Dimension::Model => "model",
        Dimension::Day => "day",
        Dimension::Month => "month",
        Dimension::Status => "status",
        Dimension::User => "user_id",
        Dimension::Provider => "provider",
    }
}

/// The sums of a usage group, read after its keys. `CAST` because Postgres
/// sums `BIGINT`s into `NUMERIC`.
const USAGE_SUMS: &str = "COUNT(*), \
    CAST(COALESCE(SUM(input_tokens), 0) AS BIGINT), \
    CAST(COALESCE(SUM(output_tokens), 0) AS BIGINT), \
    CAST(COALESCE(SUM(cache_read_tokens), 0) AS BIGINT), \
    CAST(COALESCE(SUM(cache_write_tokens), 0) AS BIGINT), \
    CAST(COALESCE(SUM(cost_pico_usd), 0) AS BIGINT), \
    CAST(COALESCE(SUM(billed_pico_usd), 0) AS BIGINT), \
    CAST(COALESCE(SUM(CASE WHEN estimated THEN 1 ELSE 0 END), 0) AS BIGINT)";

/// Returns the totals of the records `filter` selects, grouped by `group_by`.
pub(super) fn usage_groups(filter: &UsageFilter, group_by: &[Dimension]) -> Statement {
    let columns: Vec<&str> = group_by.iter().copied().map(dimension_column).collect();
    let mut select = String::from("SELECT ");
    for column in &columns {
        select.push_str(column);
        select.push_str(", ");
    }
    select.push_str(USAGE_SUMS);
    select.push_str(" FROM usage_records");
    let mut statement = Statement::new(&select);
    statement.usage_conditions(filter, None);
    if !columns.is_empty() {
        statement.sql.push_str(" GROUP BY ");
        statement.sql.push_str(&columns.join(", "));
    }
    statement
}

/// Returns a page of the records `filter` selects, newest first, after `after`.
pub(super) fn list_usage(filter: &UsageFilter, after: Option<&PageKey>, limit: u32) -> Statement {
    let mut statement = Statement::new(concat!("SELECT ", usage_columns!(), " FROM usage_records"));
    let keyset = after.map(|key| {
        let started = statement.param(Arg::Int(key.started_at_ms));
        let call_id = statement.param(Arg::Text(key.call_id.clone()));
        format!("(started_at_ms, call_id) < ({started}, {call_id})")
    });
    statement.usage_conditions(filter, keyset);
    let limit = statement.param(Arg::Int(i64::from(limit)));
    statement
        .sql
        .push_str(&format!(" ORDER BY started_at_ms DESC, call_id DESC LIMIT {limit}"));
    statement
}

/// Returns the timings of the newest `limit` records `filter` selects.
pub(super) fn call_timings(filter: &UsageFilter, limit: u32) -> Statement {
    let mut statement =
        Statement::new("SELECT first_token_ms, ended_at_ms - started_at_ms AS duration_ms FROM usage_records");
    statement.usage_conditions(filter, None);
    let limit = statement.param(Arg::Int(i64::from(limit)));
    statement
        .sql
        .push_str(&format!(" ORDER BY started_at_ms DESC, call_id DESC LIMIT {limit}"));
    statement
}

/// Returns the log events `filter` selects, newest first.
pub(super) fn query_logs(filter: &LogFilter) -> Statement {
    let mut statement = Statement::new(&format!("SELECT {LOG_COLUMNS} FROM log_events WHERE "));
    let tenant = statement.param(Arg::Text(filter.tenant_id.clone()));
    let level = statement.param(Arg::Int32(filter.min_level.as_i32()));
    let mut conditions = vec![format!("tenant_id = {tenant}"), format!("level >= {level}")];
    if let Some(from_ms) = filter.from_ms {
        conditions.push(format!("at_ms >= {}", statement.param(Arg::Int(from_ms))));
    }
    if let Some(to_ms) = filter.to_ms {
        conditions.push(format!("at_ms < {}", statement.param(Arg::Int(to_ms))));
    }
    let limit = statement.param(Arg::Int(i64::from(filter.limit)));
    statement.sql.push_str(&conditions.join(" AND "));
    statement
        .sql
        .push_str(&format!(" ORDER BY at_ms DESC, id DESC LIMIT {limit}"));
    statement
}

/// How a multi-row `INSERT` numbers its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placeholders {
    /// `$1, $2, …` (Postgres).
    Numbered,
    /// `?, ?, …`, bound in order (SQLite). SQLite looks numbered parameters
    /// up by name in a list, both when it parses the statement and when each
    /// one is bound, which is quadratic in their count: a 500-row insert of
    /// 26 columns spent more CPU naming its parameters than storing its rows.
    Anonymous,
}

impl Placeholders {
    /// The placeholders database `name` (`sqlx::Database::NAME`) is given.
    pub(super) fn of(name: &str) -> Self {
        if name == "SQLite" {
            Self::Anonymous
        } else {
            Self::Numbered
        }
    }
}

/// Returns `INSERT INTO table (columns) VALUES (…), … ` for `rows` rows of `arity` parameters.
fn insert_values(table: &str, columns: &str, arity: usize, rows: usize, placeholders: Placeholders) -> String {
    use std::fmt::Write as _;
    let mut sql = format!("INSERT INTO {table} ({columns}) VALUES ");
    for row in 0..rows {
        if row > 0 {
            sql.push_str(", ");
        }
        sql.push('(');
        for column in 0..arity {
            if column > 0 {
                sql.push_str(", ");
            }
            match placeholders {
                Placeholders::Numbered => {
                    let _ = write!(sql, "${}", row * arity + column + 1);
                }
                Placeholders::Anonymous => sql.push('?'),
            }
        }
        sql.push(')');
    }
    sql
}

/// Returns the statement inserting `rows` ledger records, skipping stored
/// call ids and returning the inserted ones.
pub(super) fn insert_usage(rows: usize, placeholders: Placeholders) -> String {
    let mut sql = insert_values(
        "usage_records",
        USAGE_INSERT_COLUMNS,
        USAGE_INSERT_ARITY,
        rows,
        placeholders,
    );
    sql.push_str(" ON CONFLICT (call_id) DO NOTHING RETURNING call_id");
    sql
}

/// Returns the statement noting one open call (`usage_columns!`), unless
/// it is noted already.
pub(super) fn insert_open_call(placeholders: Placeholders) -> String {
    let mut sql = insert_values("open_calls", usage_columns!(), OPEN_CALL_ARITY, 1, placeholders);
    sql.push_str(" ON CONFLICT (call_id) DO NOTHING RETURNING call_id");
    sql
}

/// The columns of an open call: a ledger record's, as read back.
const OPEN_CALL_ARITY: usize = 23;

/// Returns the statement deleting the open calls of `rows` recorded calls.
pub(super) fn delete_open_calls(rows: usize, placeholders: Placeholders) -> String {
    let mut sql = String::from("DELETE FROM open_calls WHERE call_id IN (");
    for row in 0..rows {
        if row > 0 {
            sql.push_str(", ");
        }
        match placeholders {
            Placeholders::Numbered => sql.push_str(&format!("${}", row + 1)),
            Placeholders::Anonymous => sql.push('?'),
        }
    }
    sql.push(')');
    sql
}

/// The oldest open calls opened before `$1`, at most `$2`.
pub(super) const SELECT_OPEN_CALLS: &str = concat!(
    "SELECT ",
    usage_columns!(),
    " FROM open_calls WHERE started_at_ms < $1 ORDER BY started_at_ms, call_id LIMIT $2"
);

/// Returns the statement inserting `rows` log events.
pub(super) fn insert_logs(rows: usize, placeholders: Placeholders) -> String {
    insert_values("log_events", LOG_COLUMNS, LOG_ARITY, rows, placeholders)
}

/// Splits `len` items into chunks of the sizes of [`INSERT_SIZES`].
pub(super) fn insert_chunks(len: usize) -> Vec<std::ops::Range<usize>> {
    let mut chunks = Vec::new();
    let mut start = 0;
    for size in INSERT_SIZES {
        while len - start >= size {
            chunks.push(start..start + size);
            start += size;
        }
    }
    chunks
}

/// Returns a count as stored; counts past `i64::MAX` were refused on the way in.
pub(super) fn stored_count(count: u64) -> Result<i64, ObservabilityError> {
    i64::try_from(count)
        .map_err(|_| ObservabilityError::invalid("INVALID_USAGE_RECORD", "token counts must fit in 63 bits"))
}

fn read_count(call_id: &str, what: &str, stored: i64) -> Result<u64, ObservabilityError> {
    u64::try_from(stored)
        .map_err(|_| ObservabilityError::corrupt(format!("usage record {call_id} has {what} {stored}")))
}

/// Reads a row of `usage_columns!`.
pub(super) fn usage_from_row<'r, R>(row: &'r R) -> Result<UsageRecord, ObservabilityError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
{
    let call_id: String = row.try_get("call_id")?;
    let status: String = row.try_get("status")?;
    let status = CallStatus::parse(&status)
        .ok_or_else(|| ObservabilityError::corrupt(format!("usage record {call_id} has status {status:?}")))?;
    let count = |column: &'r str| -> Result<u64, ObservabilityError> {
        let stored: i64 = row.try_get(column)?;
        read_count(&call_id, column, stored)
    };
    Ok(UsageRecord {
        tenant_id: row.try_get("tenant_id")?,
        user_id: row.try_get("user_id")?,
        key_id: row.try_get("key_id")?,
        container_id: row.try_get("container_id")?,
        image_id: row.try_get("image_id")?,
        agent_id: row.try_get("agent_id")?,
        provider: row.try_get("provider")?,
        model: row.try_get("model")?,
        input_tokens: count("input_tokens")?,
        output_tokens: count("output_tokens")?,
        cache_read_tokens: count("cache_read_tokens")?,
        cache_write_tokens: count("cache_write_tokens")?,
        estimated: row.try_get("estimated")?,
        status,
        error_code: row.try_get("error_code")?,
        started_at_ms: row.try_get("started_at_ms")?,
        ended_at_ms: row.try_get("ended_at_ms")?,
        first_token_ms: row.try_get("first_token_ms")?,
        cost_pico_usd: row.try_get("cost_pico_usd")?,
        billed_pico_usd: row.try_get("billed_pico_usd")?,
        priced: row.try_get("priced")?,
        own_key: row.try_get("own_key")?,
        call_id,
    })
}

/// Reads the sums of a `usage_groups` row whose keys are its first `keys` columns.
pub(super) fn group_from_row<'r, R>(row: &'r R, keys: usize) -> Result<crate::record::UsageGroup, ObservabilityError>
where
    R: Row,
    usize: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let key_values = (0..keys)
        .map(|index| row.try_get::<String, usize>(index))
        .collect::<Result<Vec<_>, _>>()?;
    let sum = |offset: usize| row.try_get::<i64, usize>(keys + offset);
    let count = |offset: usize| -> Result<u64, ObservabilityError> {
        let stored = sum(offset)?;
        u64::try_from(stored).map_err(|_| ObservabilityError::corrupt(format!("negative usage sum {stored}")))
    };
    Ok(crate::record::UsageGroup {
        totals: crate::record::UsageTotals {
            calls: count(0)?,
            input_tokens: count(1)?,
            output_tokens: count(2)?,
            cache_read_tokens: count(3)?,
            cache_write_tokens: count(4)?,
            cost_pico_usd: sum(5)?,
            billed_pico_usd: sum(6)?,
            estimated_calls: count(7)?,
        },
        keys: key_values,
    })
}

/// Reads a row of the log columns.
pub(super) fn log_from_row<'r, R>(row: &'r R) -> Result<LogEvent, ObservabilityError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    i32: Decode<'r, R::Database> + Type<R::Database>,
{
    let level: i32 = row.try_get("level")?;
    let level = Level::from_i32(level).ok_or_else(|| ObservabilityError::corrupt(format!("log level {level}")))?;
    Ok(LogEvent {
        tenant_id: row.try_get("tenant_id")?,
        at_ms: row.try_get("at_ms")?,
        level,
        component: row.try_get("component")?,
        target: row.try_get("target")?,
        message: row.try_get("message")?,
        fields_json: row.try_get("fields_json")?,
        request_id: row.try_get("request_id")?,
        trace_id: row.try_get("trace_id")?,
    })
}

/// Implements `ObservabilityStore` for a struct with a `pool` field of
/// database `$db` and an `event_transport_impl` method.
macro_rules! impl_observability_store {
    ($store:ty, $db:ty) => {
        impl $store {
            /// Binds the parameters of an assembled statement.
            fn bind_query<'q>(
                mut query: sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments<'q>>,
                args: &'q [super::sql::Arg],
            ) -> sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments<'q>> {
                for arg in args {
                    query = match arg {
                        super::sql::Arg::Text(text) => query.bind(text.as_str()),
                        super::sql::Arg::Int(value) => query.bind(*value),
                        super::sql::Arg::Int32(value) => query.bind(*value),
                    };
                }
                query
            }

            /// Binds the columns of `usage_columns!` of a record, in order.
            fn bind_usage<'q, O>(
                query: sqlx::query::QueryScalar<'q, $db, O, <$db as sqlx::Database>::Arguments<'q>>,
                record: &'q $crate::record::UsageRecord,
            ) -> Result<
                sqlx::query::QueryScalar<'q, $db, O, <$db as sqlx::Database>::Arguments<'q>>,
                $crate::error::ObservabilityError,
            > {
                use super::sql;
                Ok(query
                    .bind(record.call_id.as_str())
                    .bind(record.tenant_id.as_str())
                    .bind(record.user_id.as_str())
                    .bind(record.key_id.as_str())
                    .bind(record.container_id.as_str())
                    .bind(record.image_id.as_str())
                    .bind(record.agent_id.as_str())
                    .bind(record.provider.as_str())
                    .bind(record.model.as_str())
                    .bind(sql::stored_count(record.input_tokens)?)
                    .bind(sql::stored_count(record.output_tokens)?)
                    .bind(sql::stored_count(record.cache_read_tokens)?)
                    .bind(sql::stored_count(record.cache_write_tokens)?)
                    .bind(record.estimated)
                    .bind(record.status.as_str())
                    .bind(record.error_code.as_str())
                    .bind(record.started_at_ms)
                    .bind(record.ended_at_ms)
                    .bind(record.first_token_ms)
                    .bind(record.cost_pico_usd)
                    .bind(record.billed_pico_usd)
                    .bind(record.priced)
                    .bind(record.own_key))
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::ObservabilityStore for $store {
            async fn insert_usage(
                &self,
                records: &[$crate::record::UsageRecord],
                now_ms: i64,
            ) -> Result<std::collections::HashSet<String>, $crate::error::ObservabilityError> {
                use super::sql;
                let mut inserted = std::collections::HashSet::new();
                if records.is_empty() {
                    return Ok(inserted);
                }
                let mut tx = self.pool.begin().await?;
                for chunk in sql::insert_chunks(records.len()) {
                    let statement =
                        sql::insert_usage(chunk.len(), sql::Placeholders::of(<$db as sqlx::Database>::NAME));
                    let mut query = sqlx::query_scalar::<$db, String>(&statement);
                    for record in &records[chunk.clone()] {
                        query = Self::bind_usage(query, record)?
                            .bind(record.day())
                            .bind(record.month())
                            .bind(now_ms);
                    }
                    inserted.extend(query.fetch_all(&mut *tx).await?);
                    // Recorded calls are no longer open.
                    let statement =
                        sql::delete_open_calls(chunk.len(), sql::Placeholders::of(<$db as sqlx::Database>::NAME));
                    let mut query = sqlx::query::<$db>(&statement);
                    for record in &records[chunk] {
                        query = query.bind(record.call_id.as_str());
                    }
                    query.execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(inserted)
            }

            async fn insert_open_call(
                &self,
                record: &$crate::record::UsageRecord,
            ) -> Result<(), $crate::error::ObservabilityError> {
                let statement =
                    super::sql::insert_open_call(super::sql::Placeholders::of(<$db as sqlx::Database>::NAME));
                let query = sqlx::query_scalar::<$db, String>(&statement);
                Self::bind_usage(query, record)?
                    .fetch_optional(&self.pool)
                    .await?;
                Ok(())
            }

            async fn open_calls(
                &self,
                opened_before_ms: i64,
                limit: u32,
            ) -> Result<Vec<$crate::record::UsageRecord>, $crate::error::ObservabilityError> {
                let rows = sqlx::query::<$db>(super::sql::SELECT_OPEN_CALLS)
                    .bind(opened_before_ms)
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| super::sql::usage_from_row(row)).collect()
            }

            async fn usage_groups(
                &self,
                filter: &$crate::record::UsageFilter,
                group_by: &[$crate::record::Dimension],
            ) -> Result<Vec<$crate::record::UsageGroup>, $crate::error::ObservabilityError> {
                let statement = super::sql::usage_groups(filter, group_by);
                let rows = Self::bind_query(sqlx::query(&statement.sql), &statement.args)
                    .fetch_all(&self.pool)
                    .await?;
                let mut groups = Vec::with_capacity(rows.len());
                for row in &rows {
                    let group = super::sql::group_from_row(row, group_by.len())?;
                    // Without dimensions the one row of sums exists even when nothing matched.
                    if group.totals.calls > 0 {
                        groups.push(group);
                    }
                }
                Ok(groups)
            }

            async fn list_usage(
                &self,
                filter: &$crate::record::UsageFilter,
                after: Option<&$crate::record::PageKey>,
                limit: u32,
            ) -> Result<Vec<$crate::record::UsageRecord>, $crate::error::ObservabilityError> {
                let statement = super::sql::list_usage(filter, after, limit);
                let rows = Self::bind_query(sqlx::query(&statement.sql), &statement.args)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| super::sql::usage_from_row(row)).collect()
            }

            async fn call_timings(
                &self,
                filter: &$crate::record::UsageFilter,
                limit: u32,
            ) -> Result<Vec<$crate::record::CallTiming>, $crate::error::ObservabilityError> {
                let statement = super::sql::call_timings(filter, limit);
                let rows = Self::bind_query(sqlx::query(&statement.sql), &statement.args)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter()
                    .map(|row| {
                        Ok($crate::record::CallTiming {
                            first_token_ms: sqlx::Row::try_get(row, "first_token_ms")?,
                            duration_ms: sqlx::Row::try_get(row, "duration_ms")?,
                        })
                    })
                    .collect()
            }

            async fn month_spend(
                &self,
                tenant_id: &str,
                key_id: Option<&str>,
                month: &str,
            ) -> Result<i64, $crate::error::ObservabilityError> {
                let spent: i64 = match key_id {
                    None => {
                        sqlx::query_scalar(super::sql::MONTH_SPEND)
                            .bind(tenant_id)
                            .bind(month)
                            .fetch_one(&self.pool)
                            .await?
                    }
                    Some(key_id) => {
                        sqlx::query_scalar(super::sql::MONTH_SPEND_OF_KEY)
                            .bind(tenant_id)
                            .bind(month)
                            .bind(key_id)
                            .fetch_one(&self.pool)
                            .await?
                    }
                };
                Ok(spent)
            }

            async fn budgets(
                &self,
                tenant_id: Option<&str>,
            ) -> Result<Vec<$crate::record::StoredBudget>, $crate::error::ObservabilityError> {
                let rows: Vec<(String, String, i64, i64)> = match tenant_id {
                    None => {
                        sqlx::query_as(super::sql::SELECT_BUDGETS)
                            .fetch_all(&self.pool)
                            .await?
                    }
                    Some(tenant_id) => {
                        sqlx::query_as(super::sql::SELECT_TENANT_BUDGETS)
                            .bind(tenant_id)
                            .fetch_all(&self.pool)
                            .await?
                    }
                };
                Ok(super::budgets_from_rows(rows))
            }

            async fn budgets_for_call(
                &self,
                tenant_id: &str,
                key_id: &str,
            ) -> Result<Vec<$crate::record::StoredBudget>, $crate::error::ObservabilityError> {
                let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(super::sql::SELECT_CALL_BUDGETS)
                    .bind(tenant_id)
                    .bind(key_id)
                    .fetch_all(&self.pool)
                    .await?;
                Ok(super::budgets_from_rows(rows))
            }

            async fn put_budget(
                &self,
                budget: &$crate::record::StoredBudget,
            ) -> Result<(), $crate::error::ObservabilityError> {
                sqlx::query(super::sql::UPSERT_BUDGET)
                    .bind(&budget.tenant_id)
                    .bind(&budget.key_id)
                    .bind(budget.monthly_limit_pico_usd)
                    .bind(budget.updated_at_ms)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn delete_budget(
                &self,
                tenant_id: &str,
                key_id: &str,
            ) -> Result<bool, $crate::error::ObservabilityError> {
                let deleted = sqlx::query(super::sql::DELETE_BUDGET)
                    .bind(tenant_id)
                    .bind(key_id)
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                Ok(deleted > 0)
            }

            async fn insert_logs(
                &self,
                events: &[$crate::record::LogEvent],
            ) -> Result<(), $crate::error::ObservabilityError> {
                use super::sql;
                if events.is_empty() {
                    return Ok(());
                }
                let mut tx = self.pool.begin().await?;
                for chunk in sql::insert_chunks(events.len()) {
                    let statement = sql::insert_logs(chunk.len(), sql::Placeholders::of(<$db as sqlx::Database>::NAME));
                    let mut query = sqlx::query(&statement);
                    for event in &events[chunk] {
                        query = query
                            .bind(event.tenant_id.as_str())
                            .bind(event.at_ms)
                            .bind(event.level.as_i32())
                            .bind(event.component.as_str())
                            .bind(event.target.as_str())
                            .bind(event.message.as_str())
                            .bind(event.fields_json.as_str())
                            .bind(event.request_id.as_str())
                            .bind(event.trace_id.as_str());
                    }
                    query.execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(())
            }

            async fn query_logs(
                &self,
                filter: &$crate::record::LogFilter,
            ) -> Result<Vec<$crate::record::LogEvent>, $crate::error::ObservabilityError> {
                let statement = super::sql::query_logs(filter);
                let rows = Self::bind_query(sqlx::query(&statement.sql), &statement.args)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| super::sql::log_from_row(row)).collect()
            }

            async fn prune_logs(
                &self,
                before_ms: i64,
                keep_per_tenant: u64,
            ) -> Result<u64, $crate::error::ObservabilityError> {
                let keep = i64::try_from(keep_per_tenant).unwrap_or(i64::MAX);
                let old = sqlx::query(super::sql::DELETE_OLD_LOGS)
                    .bind(before_ms)
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                let excess = sqlx::query(super::sql::DELETE_EXCESS_LOGS)
                    .bind(keep)
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                Ok(old + excess)
            }

            fn event_transport(&self) -> avm_store::events::EventTransport {
                self.event_transport_impl()
            }
        }
    };
}

pub(super) use impl_observability_store;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inserts_split_into_few_statement_sizes() {
        let chunks = insert_chunks(1234);
        let sizes: Vec<usize> = chunks.iter().map(|chunk| chunk.len()).collect();
        assert_eq!(sizes, [500, 500, 100, 100, 10, 10, 10, 1, 1, 1, 1]);
        assert_eq!(chunks.last().map(|chunk| chunk.end), Some(1234));
        assert!(insert_chunks(0).is_empty());
        let sql = insert_usage(2, Placeholders::Numbered);
        assert!(
            sql.contains("($1, $2,") && sql.contains("$52)") && !sql.contains("$53"),
            "{sql}"
        );
        let sql = insert_usage(2, Placeholders::Anonymous);
        assert_eq!(sql.matches('?').count(), 52, "{sql}");
        assert!(!sql.contains('$'), "{sql}");
        assert_eq!(Placeholders::of("SQLite"), Placeholders::Anonymous);
        assert_eq!(Placeholders::of("PostgreSQL"), Placeholders::Numbered);
    }

    #[test]
    fn caller_text_only_travels_as_parameters() {
        let filter = UsageFilter {
            tenant_id: Some("t'; DROP TABLE usage_records; --".into()),
            model: Some("m".into()),
            ..UsageFilter::default()
        };
        let statement = usage_groups(&filter, &[Dimension::Model, Dimension::Day]);
        assert!(!statement.sql.contains("DROP"));
        assert!(statement.sql.contains("GROUP BY model, day"));
        assert_eq!(statement.args.len(), 2);
    }
}
