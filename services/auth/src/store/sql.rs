//! The statements and the `AuthStore` implementation shared by SQLite and Postgres.
//!
//! Both dialects accept `$N` placeholders, `RETURNING`, `ON CONFLICT … DO
//! NOTHING / DO UPDATE` and partial indexes, so one text serves both. The
//! implementation is a macro expanded once per concrete pool type, as in the
//! session service: code generic over `sqlx::Database` needs higher-ranked
//! `Executor` bounds that the `Send` futures of `async_trait` do not satisfy.
//!
//! Every transaction starts with a write, so SQLite takes its write lock up
//! front (where `busy_timeout` applies) instead of failing to upgrade a read.
//!
//! A reach is two nullable parameters: `($t IS NULL OR tenant_id = $t)` and
//! `($u IS NULL OR user_id = $u)`.

use avm_common::auth::{Limits, Role, Scopes};
use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::error::AuthError;
use crate::record::{ApiKeyRecord, SigningKeyRecord, TenantRecord, Tombstone, TombstoneKind, UserRecord};

macro_rules! tenant_columns {
    () => {
        "tenant_id, name, operator, requests_per_minute, tokens_per_month, created_at_ms, updated_at_ms"
    };
}
macro_rules! user_columns {
    () => {
        "user_id, tenant_id, name, role, external_subject, created_at_ms"
    };
}
macro_rules! key_columns {
    () => {
        "key_id, tenant_id, user_id, name, prefix, scopes, requests_per_minute, tokens_per_month, \
         created_at_ms, expires_at_ms, revoked_at_ms"
    };
}

pub(super) const INSERT_TENANT: &str = concat!(
    "INSERT INTO tenants (",
    tenant_columns!(),
    ") VALUES ($1, $2, $3, $4, $5, $6, $7)"
);
/// Inserts nothing once any tenant exists; the one-operator index stops a
/// concurrent second bootstrap that got past the `NOT EXISTS`.
pub(super) const BOOTSTRAP_TENANT: &str = concat!(
    "INSERT INTO tenants (",
    tenant_columns!(),
    ") SELECT $1, $2, $3, $4, $5, $6, $7 WHERE NOT EXISTS (SELECT 1 FROM tenants) ON CONFLICT DO NOTHING"
);
pub(super) const SELECT_TENANT: &str = concat!(
    "SELECT ",
    tenant_columns!(),
    " FROM tenants WHERE tenant_id = $1 AND ($2 IS NULL OR tenant_id = $2)"
);
pub(super) const FIND_TENANT_BY_NAME: &str = concat!(
    "SELECT ",
    tenant_columns!(),
    " FROM tenants WHERE name = $1 AND operator = $2 ORDER BY created_at_ms, tenant_id LIMIT 1"
);
pub(super) const LIST_TENANTS: &str = concat!(
    "SELECT ",
    tenant_columns!(),
    " FROM tenants WHERE ($1 IS NULL OR tenant_id = $1) ORDER BY created_at_ms, tenant_id"
);
/// The first write of an update: takes the lock and tells whether the tenant is in reach.
pub(super) const TOUCH_TENANT: &str = "\
    UPDATE tenants SET updated_at_ms = $3 WHERE tenant_id = $1 AND ($2 IS NULL OR tenant_id = $2)";
pub(super) const UPDATE_TENANT: &str = "\
    UPDATE tenants SET name = COALESCE($2, name), \
                       requests_per_minute = COALESCE($3, requests_per_minute), \
                       tokens_per_month = COALESCE($4, tokens_per_month) \
    WHERE tenant_id = $1";
/// Never the operator tenant; the cascade takes users, keys and usage.
pub(super) const DELETE_TENANT: &str = "DELETE FROM tenants WHERE tenant_id = $1 AND operator = $2";
pub(super) const INSERT_TOMBSTONE: &str = "\
    INSERT INTO tombstones (kind, id, at_ms) VALUES ($1, $2, $3) \
    ON CONFLICT (kind, id) DO UPDATE SET at_ms = excluded.at_ms";

/// Inserts nothing when the tenant is missing or out of reach (`$7`).
pub(super) const INSERT_USER: &str = concat!(
    "INSERT INTO users (",
    user_columns!(),
    ") SELECT $1, $2, $3, $4, $5, $6 FROM tenants t WHERE t.tenant_id = $2 AND ($7 IS NULL OR t.tenant_id = $7)"
);
pub(super) const SELECT_USER: &str = concat!(
    "SELECT ",
    user_columns!(),
    " FROM users WHERE user_id = $1 AND ($2 IS NULL OR tenant_id = $2) AND ($3 IS NULL OR user_id = $3)"
);
pub(super) const LIST_USERS: &str = concat!(
    "SELECT ",
    user_columns!(),
    " FROM users WHERE tenant_id = $1 ORDER BY created_at_ms, user_id"
);
pub(super) const TENANT_IN_REACH: &str = "\
    SELECT 1 FROM tenants WHERE tenant_id = $1 AND ($2 IS NULL OR tenant_id = $2)";
/// The cascade takes the user's keys.
pub(super) const DELETE_USER: &str = concat!(
    "DELETE FROM users WHERE user_id = $1 AND ($2 IS NULL OR tenant_id = $2) AND ($3 IS NULL OR user_id = $3) \
     RETURNING ",
    user_columns!()
);
/// The issuer is the authority on the role, so a known subject takes the role it states now.
pub(super) const UPSERT_EXTERNAL_USER: &str = concat!(
    "INSERT INTO users (",
    user_columns!(),
    ") VALUES ($1, $2, $3, $4, $5, $6) \
     ON CONFLICT (tenant_id, external_subject) DO UPDATE SET role = excluded.role RETURNING ",
    user_columns!()
);

/// Inserts nothing when the user is gone (or not of the key's tenant).
pub(super) const INSERT_KEY: &str = concat!(
    "INSERT INTO api_keys (",
    key_columns!(),
    ", secret_hash) SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12 FROM users u \
     WHERE u.user_id = $3 AND u.tenant_id = $2"
);
pub(super) const SELECT_KEY: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM api_keys WHERE key_id = $1 AND ($2 IS NULL OR tenant_id = $2) AND ($3 IS NULL OR user_id = $3)"
);
pub(super) const SELECT_KEY_CREDENTIAL: &str = concat!(
    "SELECT ",
    key_columns!(),
    ", secret_hash FROM api_keys WHERE key_id = $1"
);
pub(super) const LIST_KEYS: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM api_keys WHERE ($1 IS NULL OR tenant_id = $1) AND ($2 IS NULL OR user_id = $2) \
     ORDER BY created_at_ms DESC, key_id DESC"
);
pub(super) const REVOKE_KEY: &str = "\
    UPDATE api_keys SET revoked_at_ms = $4 \
    WHERE key_id = $1 AND ($2 IS NULL OR tenant_id = $2) AND ($3 IS NULL OR user_id = $3) \
      AND revoked_at_ms IS NULL";
pub(super) const REVOKE_KEYS_NAMED: &str = "\
    UPDATE api_keys SET revoked_at_ms = $3 \
    WHERE user_id = $1 AND name = $2 AND revoked_at_ms IS NULL RETURNING key_id";
/// A credential claiming to be an operator's is alive only while its user
/// is an admin of the operator tenant.
pub(super) const CREDENTIAL_ALIVE: &str = "\
    SELECT 1 FROM users u JOIN tenants t ON t.tenant_id = u.tenant_id \
    WHERE u.user_id = $1 AND u.tenant_id = $2 \
      AND ($3 IS NULL OR EXISTS (SELECT 1 FROM api_keys k \
                                 WHERE k.key_id = $3 AND k.user_id = u.user_id AND k.revoked_at_ms IS NULL)) \
      AND ($4 = FALSE OR (t.operator AND u.role = 'admin'))";

/// Fails on the foreign key when the tenant is missing, which is how the caller learns it is.
pub(super) const INSERT_REPORT: &str = "\
    INSERT INTO usage_reports (tenant_id, report_id, recorded_at_ms) VALUES ($1, $2, $3) \
    ON CONFLICT (tenant_id, report_id) DO NOTHING";
/// `key_id` is `''` for the tenant's own counter.
pub(super) const ADD_USAGE: &str = "\
    INSERT INTO usage (tenant_id, key_id, month, tokens) VALUES ($1, $2, $3, $4) \
    ON CONFLICT (tenant_id, key_id, month) DO UPDATE SET tokens = usage.tokens + excluded.tokens \
    RETURNING tokens";
/// Adds a report's tokens to a counter (the tenant's, with key id `''`, or a
/// key's) and returns it with its quota (NULL for a key that is gone): one
/// statement where a read of the quota would be a second.
pub(super) const COUNT_USAGE: &str = "\
    INSERT INTO usage (tenant_id, key_id, month, tokens) VALUES ($1, $2, $3, $4) \
    ON CONFLICT (tenant_id, key_id, month) DO UPDATE SET tokens = usage.tokens + excluded.tokens \
    RETURNING tokens, CASE WHEN $2 = '' \
        THEN (SELECT tokens_per_month FROM tenants WHERE tenant_id = $1) \
        ELSE (SELECT tokens_per_month FROM api_keys WHERE key_id = $2 AND tenant_id = $1) END";
/// Ends a call's token reservation when its report arrives.
pub(super) const SETTLE_RESERVATION: &str = "\
    DELETE FROM token_reservations WHERE tenant_id = $1 AND reservation_id = $2";
pub(super) const DROP_EXPIRED_RESERVATIONS: &str = "\
    DELETE FROM token_reservations WHERE tenant_id = $1 AND expires_at_ms <= $2";
/// What the other calls in flight hold: the tenant's all (`$2` NULL) or one key's.
pub(super) const RESERVED_TOKENS: &str = "\
    SELECT CAST(COALESCE(SUM(tokens), 0) AS BIGINT) FROM token_reservations \
    WHERE tenant_id = $1 AND ($2 IS NULL OR key_id = $2) AND reservation_id <> $3";
pub(super) const INSERT_RESERVATION: &str = "\
    INSERT INTO token_reservations (tenant_id, reservation_id, key_id, tokens, expires_at_ms) \
    VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tenant_id, reservation_id) DO NOTHING";
pub(super) const SELECT_USAGE: &str = "SELECT tokens FROM usage WHERE tenant_id = $1 AND key_id = $2 AND month = $3";
pub(super) const TENANT_QUOTA: &str = "SELECT tokens_per_month FROM tenants WHERE tenant_id = $1";
pub(super) const KEY_QUOTA: &str = "SELECT tokens_per_month FROM api_keys WHERE key_id = $1 AND tenant_id = $2";
pub(super) const EXHAUSTED_TENANTS: &str = "\
    SELECT u.tenant_id FROM usage u JOIN tenants t ON t.tenant_id = u.tenant_id \
    WHERE u.month = $1 AND u.key_id = '' AND t.tokens_per_month > 0 AND u.tokens >= t.tokens_per_month";
pub(super) const EXHAUSTED_KEYS: &str = "\
    SELECT u.tenant_id, u.key_id FROM usage u JOIN api_keys k ON k.key_id = u.key_id \
    WHERE u.month = $1 AND u.key_id <> '' AND k.tokens_per_month > 0 AND u.tokens >= k.tokens_per_month";

pub(super) const REVOKED_KEYS_SINCE: &str = "\
    SELECT key_id, revoked_at_ms FROM api_keys WHERE revoked_at_ms >= $1 ORDER BY revoked_at_ms";
pub(super) const TOMBSTONES_SINCE: &str = "SELECT kind, id, at_ms FROM tombstones WHERE at_ms >= $1 ORDER BY at_ms";
pub(super) const TENANTS_UPDATED_SINCE: &str = "\
    SELECT tenant_id, updated_at_ms FROM tenants \
    WHERE updated_at_ms >= $1 AND updated_at_ms > created_at_ms ORDER BY updated_at_ms";

pub(super) const CURRENT_SIGNING_KEY: &str = "\
    SELECT kid, private_key, public_jwk, created_at_ms, retired_at_ms FROM signing_keys \
    WHERE retired_at_ms IS NULL ORDER BY created_at_ms DESC, kid DESC LIMIT 1";
pub(super) const INSERT_SIGNING_KEY: &str = "\
    INSERT INTO signing_keys (kid, private_key, public_jwk, created_at_ms, retired_at_ms) \
    VALUES ($1, $2, $3, $4, $5)";
pub(super) const RETIRE_OTHER_SIGNING_KEYS: &str = "\
    UPDATE signing_keys SET retired_at_ms = $2 WHERE retired_at_ms IS NULL AND kid <> $1";
pub(super) const ALL_SIGNING_KEYS: &str = "\
    SELECT kid, private_key, public_jwk, created_at_ms, retired_at_ms FROM signing_keys \
    ORDER BY created_at_ms, kid";
/// Changes a key's stored private half only from what the caller read, so
/// replicas sealing the same plain key at once write it once.
pub(super) const REPLACE_PRIVATE_KEY: &str = "\
    UPDATE signing_keys SET private_key = $3 WHERE kid = $1 AND private_key = $2";
pub(super) const PUBLIC_KEYS: &str = "\
    SELECT public_jwk FROM signing_keys WHERE retired_at_ms IS NULL OR retired_at_ms >= $1 \
    ORDER BY created_at_ms DESC, kid DESC";

/// Returns a stored count as a number of tokens or requests.
fn unsigned<T: TryFrom<i64>>(value: i64, what: &str) -> Result<T, AuthError> {
    T::try_from(value).map_err(|_| AuthError::corrupt(format!("{what} is {value}")))
}

/// Returns a count as stored; counts past `i64::MAX` saturate.
pub(super) fn signed(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Reads a tenant row.
pub(super) fn tenant_from_row<'r, R>(row: &'r R) -> Result<TenantRecord, AuthError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let tenant_id: String = row.try_get("tenant_id")?;
    let limits = Limits {
        requests_per_minute: unsigned(row.try_get("requests_per_minute")?, "requests_per_minute")?,
        tokens_per_month: unsigned(row.try_get("tokens_per_month")?, "tokens_per_month")?,
    };
    Ok(TenantRecord {
        name: row.try_get("name")?,
        operator: row.try_get("operator")?,
        limits,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        tenant_id,
    })
}

/// Reads a user row.
pub(super) fn user_from_row<'r, R>(row: &'r R) -> Result<UserRecord, AuthError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let user_id: String = row.try_get("user_id")?;
    let role: String = row.try_get("role")?;
    let role = match Role::parse(&role) {
        Some(role @ (Role::Admin | Role::Member)) => role,
        _ => return Err(AuthError::corrupt(format!("user {user_id} has role {role:?}"))),
    };
    Ok(UserRecord {
        tenant_id: row.try_get("tenant_id")?,
        name: row.try_get("name")?,
        role,
        external_subject: row.try_get("external_subject")?,
        created_at_ms: row.try_get("created_at_ms")?,
        user_id,
    })
}

/// Reads an API key row.
pub(super) fn key_from_row<'r, R>(row: &'r R) -> Result<ApiKeyRecord, AuthError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
{
    let key_id: String = row.try_get("key_id")?;
    let scopes: String = row.try_get("scopes")?;
    let names: Vec<&str> = scopes.split_whitespace().collect();
    let scopes =
        Scopes::parse(&names).map_err(|_| AuthError::corrupt(format!("api key {key_id} has scopes {scopes:?}")))?;
    let limits = Limits {
        requests_per_minute: unsigned(row.try_get("requests_per_minute")?, "requests_per_minute")?,
        tokens_per_month: unsigned(row.try_get("tokens_per_month")?, "tokens_per_month")?,
    };
    Ok(ApiKeyRecord {
        tenant_id: row.try_get("tenant_id")?,
        user_id: row.try_get("user_id")?,
        name: row.try_get("name")?,
        prefix: row.try_get("prefix")?,
        scopes,
        limits,
        created_at_ms: row.try_get("created_at_ms")?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        revoked_at_ms: row.try_get("revoked_at_ms")?,
        key_id,
    })
}

/// Reads a signing key row.
pub(super) fn signing_key_from_row<'r, R>(row: &'r R) -> Result<SigningKeyRecord, AuthError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(SigningKeyRecord {
        kid: row.try_get("kid")?,
        private_key: row.try_get("private_key")?,
        public_jwk: row.try_get("public_jwk")?,
        created_at_ms: row.try_get("created_at_ms")?,
        retired_at_ms: row.try_get("retired_at_ms")?,
    })
}

/// Reads a tombstone row.
pub(super) fn tombstone_from_row<'r, R>(row: &'r R) -> Result<Tombstone, AuthError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let kind: String = row.try_get("kind")?;
    let kind = TombstoneKind::parse(&kind).ok_or_else(|| AuthError::corrupt(format!("tombstone kind {kind:?}")))?;
    Ok(Tombstone {
        kind,
        id: row.try_get("id")?,
        at_ms: row.try_get("at_ms")?,
    })
}

/// Returns the stored form of scopes: their names separated by spaces.
pub(super) fn scopes_text(scopes: Scopes) -> String {
    scopes.names().join(" ")
}

/// Returns a stored count as tokens.
pub(super) fn tokens(value: i64) -> Result<u64, AuthError> {
    unsigned(value, "tokens")
}

/// Maps a foreign-key failure to `missing`: the parent vanished between the
/// check and the insert, the same outcome as never finding it.
pub(super) fn missing_parent(err: sqlx::Error, missing: impl FnOnce() -> AuthError) -> AuthError {
    match &err {
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => missing(),
        _ => AuthError::from(err),
    }
}

/// Implements `AuthStore` for a struct with a `pool: sqlx::Pool<$db>` field.
///
/// The event methods differ by database: they forward to the struct's own
/// `event_transport_impl`.
macro_rules! impl_auth_store {
    ($store:ty, $db:ty) => {
        impl $store {
            async fn tenant_in_reach(
                &self,
                reach: &$crate::record::Reach,
                tenant_id: &str,
            ) -> Result<bool, $crate::error::AuthError> {
                use $crate::store::sql;
                let found = sqlx::query(sql::TENANT_IN_REACH)
                    .bind(tenant_id)
                    .bind(reach.tenant_id.as_deref())
                    .fetch_optional(&self.pool)
                    .await?;
                Ok(found.is_some())
            }

            async fn insert_tenant_with_admin(
                tx: &mut sqlx::Transaction<'_, $db>,
                statement: &'static str,
                tenant: &$crate::record::TenantRecord,
                admin: &$crate::record::UserRecord,
                key: &$crate::record::NewApiKey,
            ) -> Result<bool, $crate::error::AuthError> {
                use $crate::store::sql;
                let inserted = sqlx::query(statement)
                    .bind(&tenant.tenant_id)
                    .bind(&tenant.name)
                    .bind(tenant.operator)
                    .bind(i64::from(tenant.limits.requests_per_minute))
                    .bind(sql::signed(tenant.limits.tokens_per_month))
                    .bind(tenant.created_at_ms)
                    .bind(tenant.updated_at_ms)
                    .execute(&mut **tx)
                    .await?
                    .rows_affected();
                if inserted == 0 {
                    return Ok(false);
                }
                sqlx::query(sql::INSERT_USER)
                    .bind(&admin.user_id)
                    .bind(&admin.tenant_id)
                    .bind(&admin.name)
                    .bind(admin.role.as_str())
                    .bind(admin.external_subject.as_deref())
                    .bind(admin.created_at_ms)
                    .bind(None::<&str>)
                    .execute(&mut **tx)
                    .await?;
                Self::insert_key(tx, key).await?;
                Ok(true)
            }

            async fn insert_key(
                tx: &mut sqlx::Transaction<'_, $db>,
                new: &$crate::record::NewApiKey,
            ) -> Result<u64, $crate::error::AuthError> {
                use $crate::store::sql;
                let key = &new.key;
                Ok(sqlx::query(sql::INSERT_KEY)
                    .bind(&key.key_id)
                    .bind(&key.tenant_id)
                    .bind(&key.user_id)
                    .bind(&key.name)
                    .bind(&key.prefix)
                    .bind(sql::scopes_text(key.scopes))
                    .bind(i64::from(key.limits.requests_per_minute))
                    .bind(sql::signed(key.limits.tokens_per_month))
                    .bind(key.created_at_ms)
                    .bind(key.expires_at_ms)
                    .bind(key.revoked_at_ms)
                    .bind(&new.secret_hash)
                    .execute(&mut **tx)
                    .await?
                    .rows_affected())
            }

            async fn add_usage(
                tx: &mut sqlx::Transaction<'_, $db>,
                tenant_id: &str,
                key_id: &str,
                month: &str,
                tokens: u64,
            ) -> Result<$crate::record::CounterChange, $crate::error::AuthError> {
                use $crate::store::sql;
                let (after, quota): (i64, Option<i64>) = sqlx::query_as(sql::COUNT_USAGE)
                    .bind(tenant_id)
                    .bind(key_id)
                    .bind(month)
                    .bind(sql::signed(tokens))
                    .fetch_one(&mut **tx)
                    .await?;
                let after = sql::tokens(after)?;
                Ok($crate::record::CounterChange {
                    before: after.saturating_sub(tokens),
                    after,
                    quota: sql::tokens(quota.unwrap_or(0))?,
                })
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::AuthStore for $store {
            async fn create_tenant(
                &self,
                tenant: &$crate::record::TenantRecord,
                admin: &$crate::record::UserRecord,
                key: &$crate::record::NewApiKey,
            ) -> Result<(), $crate::error::AuthError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin().await?;
                Self::insert_tenant_with_admin(&mut tx, sql::INSERT_TENANT, tenant, admin, key).await?;
                tx.commit().await?;
                Ok(())
            }

            async fn bootstrap(
                &self,
                tenant: &$crate::record::TenantRecord,
                admin: &$crate::record::UserRecord,
                key: &$crate::record::NewApiKey,
            ) -> Result<bool, $crate::error::AuthError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin().await?;
                if !Self::insert_tenant_with_admin(&mut tx, sql::BOOTSTRAP_TENANT, tenant, admin, key).await? {
                    tx.rollback().await?;
                    return Ok(false);
                }
                tx.commit().await?;
                Ok(true)
            }

            async fn get_tenant(
                &self,
                reach: &$crate::record::Reach,
                tenant_id: &str,
            ) -> Result<$crate::record::TenantRecord, $crate::error::AuthError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::SELECT_TENANT)
                    .bind(tenant_id)
                    .bind(reach.tenant_id.as_deref())
                    .fetch_optional(&self.pool)
                    .await?
                    .ok_or_else(|| $crate::error::AuthError::TenantNotFound(tenant_id.to_owned()))?;
                sql::tenant_from_row(&row)
            }

            async fn find_tenant_by_name(
                &self,
                name: &str,
            ) -> Result<Option<$crate::record::TenantRecord>, $crate::error::AuthError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::FIND_TENANT_BY_NAME)
                    .bind(name)
                    .bind(false)
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(|row| sql::tenant_from_row(row)).transpose()
            }

            async fn list_tenants(
                &self,
                reach: &$crate::record::Reach,
            ) -> Result<Vec<$crate::record::TenantRecord>, $crate::error::AuthError> {
                use $crate::store::sql;
                let rows = sqlx::query(sql::LIST_TENANTS)
                    .bind(reach.tenant_id.as_deref())
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::tenant_from_row(row)).collect()
            }

            async fn update_tenant(
                &self,
                reach: &$crate::record::Reach,
                tenant_id: &str,
                update: &$crate::record::TenantUpdate,
                now_ms: i64,
            ) -> Result<($crate::record::TenantRecord, $crate::record::TenantRecord), $crate::error::AuthError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin().await?;
                let touched = sqlx::query(sql::TOUCH_TENANT)
                    .bind(tenant_id)
                    .bind(reach.tenant_id.as_deref())
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if touched == 0 {
                    tx.rollback().await?;
                    return Err($crate::error::AuthError::TenantNotFound(tenant_id.to_owned()));
                }
                let row = sqlx::query(sql::SELECT_TENANT)
                    .bind(tenant_id)
                    .bind(None::<&str>)
                    .fetch_one(&mut *tx)
                    .await?;
                let before = sql::tenant_from_row(&row)?;
                let limits = update.limits.as_ref();
                sqlx::query(sql::UPDATE_TENANT)
                    .bind(tenant_id)
                    .bind(update.name.as_deref())
                    .bind(limits.map(|l| i64::from(l.requests_per_minute)))
                    .bind(limits.map(|l| sql::signed(l.tokens_per_month)))
                    .execute(&mut *tx)
                    .await?;
                let row = sqlx::query(sql::SELECT_TENANT)
                    .bind(tenant_id)
                    .bind(None::<&str>)
                    .fetch_one(&mut *tx)
                    .await?;
                let after = sql::tenant_from_row(&row)?;
                tx.commit().await?;
                Ok((before, after))
            }

            async fn delete_tenant(&self, tenant_id: &str, now_ms: i64) -> Result<(), $crate::error::AuthError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin().await?;
                let deleted = sqlx::query(sql::DELETE_TENANT)
                    .bind(tenant_id)
                    .bind(false)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if deleted == 0 {
                    tx.rollback().await?;
                    return Err($crate::error::AuthError::TenantNotFound(tenant_id.to_owned()));
                }
                sqlx::query(sql::INSERT_TOMBSTONE)
                    .bind($crate::record::TombstoneKind::Tenant.as_str())
                    .bind(tenant_id)
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(())
            }

            async fn create_user(
                &self,
                reach: &$crate::record::Reach,
                user: &$crate::record::UserRecord,
            ) -> Result<(), $crate::error::AuthError> {
                use $crate::store::sql;
                let missing = || $crate::error::AuthError::TenantNotFound(user.tenant_id.clone());
                let inserted = sqlx::query(sql::INSERT_USER)
                    .bind(&user.user_id)
                    .bind(&user.tenant_id)
                    .bind(&user.name)
                    .bind(user.role.as_str())
                    .bind(user.external_subject.as_deref())
                    .bind(user.created_at_ms)
                    .bind(reach.tenant_id.as_deref())
                    .execute(&self.pool)
                    .await
                    .map_err(|err| sql::missing_parent(err, missing))?
                    .rows_affected();
                if inserted == 0 {
                    return Err(missing());
                }
                Ok(())
            }

            async fn get_user(
                &self,
                reach: &$crate::record::Reach,
                user_id: &str,
            ) -> Result<$crate::record::UserRecord, $crate::error::AuthError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::SELECT_USER)
                    .bind(user_id)
                    .bind(reach.tenant_id.as_deref())
                    .bind(reach.user_id.as_deref())
                    .fetch_optional(&self.pool)
                    .await?
                    .ok_or_else(|| $crate::error::AuthError::UserNotFound(user_id.to_owned()))?;
                sql::user_from_row(&row)
            }

            async fn list_users(
                &self,
                reach: &$crate::record::Reach,
                tenant_id: &str,
            ) -> Result<Vec<$crate::record::UserRecord>, $crate::error::AuthError> {
                use $crate::store::sql;
                if !self.tenant_in_reach(reach, tenant_id).await? {
                    return Err($crate::error::AuthError::TenantNotFound(tenant_id.to_owned()));
                }
                let rows = sqlx::query(sql::LIST_USERS)
                    .bind(tenant_id)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::user_from_row(row)).collect()
            }

            async fn delete_user(
                &self,
                reach: &$crate::record::Reach,
                user_id: &str,
                now_ms: i64,
            ) -> Result<$crate::record::UserRecord, $crate::error::AuthError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin().await?;
                let Some(row) = sqlx::query(sql::DELETE_USER)
                    .bind(user_id)
                    .bind(reach.tenant_id.as_deref())
                    .bind(reach.user_id.as_deref())
                    .fetch_optional(&mut *tx)
                    .await?
                else {
                    tx.rollback().await?;
                    return Err($crate::error::AuthError::UserNotFound(user_id.to_owned()));
                };
                let user = sql::user_from_row(&row)?;
                sqlx::query(sql::INSERT_TOMBSTONE)
                    .bind($crate::record::TombstoneKind::User.as_str())
                    .bind(user_id)
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(user)
            }

            async fn upsert_external_user(
                &self,
                user: &$crate::record::UserRecord,
            ) -> Result<$crate::record::UserRecord, $crate::error::AuthError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::UPSERT_EXTERNAL_USER)
                    .bind(&user.user_id)
                    .bind(&user.tenant_id)
                    .bind(&user.name)
                    .bind(user.role.as_str())
                    .bind(user.external_subject.as_deref())
                    .bind(user.created_at_ms)
                    .fetch_one(&self.pool)
                    .await
                    .map_err(|err| {
                        sql::missing_parent(err, || {
                            $crate::error::AuthError::TenantNotFound(user.tenant_id.clone())
                        })
                    })?;
                sql::user_from_row(&row)
            }

            async fn create_api_key(&self, key: &$crate::record::NewApiKey) -> Result<(), $crate::error::AuthError> {
                let missing = || $crate::error::AuthError::UserNotFound(key.key.user_id.clone());
                let mut tx = self.pool.begin().await?;
                let inserted = Self::insert_key(&mut tx, key).await.map_err(|err| match err {
                    $crate::error::AuthError::Store(avm_store::StoreError::Database(err)) => {
                        $crate::store::sql::missing_parent(err, missing)
                    }
                    other => other,
                })?;
                if inserted == 0 {
                    tx.rollback().await?;
                    return Err(missing());
                }
                tx.commit().await?;
                Ok(())
            }

            async fn get_api_key(
                &self,
                reach: &$crate::record::Reach,
                key_id: &str,
            ) -> Result<$crate::record::ApiKeyRecord, $crate::error::AuthError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::SELECT_KEY)
                    .bind(key_id)
                    .bind(reach.tenant_id.as_deref())
                    .bind(reach.user_id.as_deref())
                    .fetch_optional(&self.pool)
                    .await?
                    .ok_or_else(|| $crate::error::AuthError::ApiKeyNotFound(key_id.to_owned()))?;
                sql::key_from_row(&row)
            }

            async fn list_api_keys(
                &self,
                reach: &$crate::record::Reach,
            ) -> Result<Vec<$crate::record::ApiKeyRecord>, $crate::error::AuthError> {
                use $crate::store::sql;
                let rows = sqlx::query(sql::LIST_KEYS)
                    .bind(reach.tenant_id.as_deref())
                    .bind(reach.user_id.as_deref())
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::key_from_row(row)).collect()
            }

            async fn revoke_api_key(
                &self,
                reach: &$crate::record::Reach,
                key_id: &str,
                now_ms: i64,
            ) -> Result<($crate::record::ApiKeyRecord, bool), $crate::error::AuthError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin().await?;
                let revoked = sqlx::query(sql::REVOKE_KEY)
                    .bind(key_id)
                    .bind(reach.tenant_id.as_deref())
                    .bind(reach.user_id.as_deref())
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                let Some(row) = sqlx::query(sql::SELECT_KEY)
                    .bind(key_id)
                    .bind(reach.tenant_id.as_deref())
                    .bind(reach.user_id.as_deref())
                    .fetch_optional(&mut *tx)
                    .await?
                else {
                    tx.rollback().await?;
                    return Err($crate::error::AuthError::ApiKeyNotFound(key_id.to_owned()));
                };
                let key = sql::key_from_row(&row)?;
                tx.commit().await?;
                Ok((key, revoked == 1))
            }

            async fn revoke_api_keys_named(
                &self,
                user_id: &str,
                name: &str,
                now_ms: i64,
            ) -> Result<Vec<String>, $crate::error::AuthError> {
                use $crate::store::sql;
                Ok(sqlx::query_scalar(sql::REVOKE_KEYS_NAMED)
                    .bind(user_id)
                    .bind(name)
                    .bind(now_ms)
                    .fetch_all(&self.pool)
                    .await?)
            }

            async fn key_credential(
                &self,
                key_id: &str,
            ) -> Result<Option<$crate::record::KeyCredential>, $crate::error::AuthError> {
                use sqlx::Row;
                use $crate::store::sql;
                let Some(row) = sqlx::query(sql::SELECT_KEY_CREDENTIAL)
                    .bind(key_id)
                    .fetch_optional(&self.pool)
                    .await?
                else {
                    return Ok(None);
                };
                let key = sql::key_from_row(&row)?;
                let secret_hash: String = row.try_get("secret_hash")?;
                let all = $crate::record::Reach::all();
                // The cascades remove a deleted user's or tenant's keys, so a
                // vanished parent here is a deletion racing this read.
                let user = match self.get_user(&all, &key.user_id).await {
                    Ok(user) => user,
                    Err($crate::error::AuthError::UserNotFound(_)) => return Ok(None),
                    Err(err) => return Err(err),
                };
                let tenant = match self.get_tenant(&all, &key.tenant_id).await {
                    Ok(tenant) => tenant,
                    Err($crate::error::AuthError::TenantNotFound(_)) => return Ok(None),
                    Err(err) => return Err(err),
                };
                Ok(Some($crate::record::KeyCredential {
                    key,
                    secret_hash,
                    user,
                    tenant,
                }))
            }

            async fn credential_alive(
                &self,
                tenant_id: &str,
                user_id: &str,
                key_id: Option<&str>,
                operator: bool,
            ) -> Result<bool, $crate::error::AuthError> {
                use $crate::store::sql;
                let found = sqlx::query(sql::CREDENTIAL_ALIVE)
                    .bind(user_id)
                    .bind(tenant_id)
                    .bind(key_id)
                    .bind(operator)
                    .fetch_optional(&self.pool)
                    .await?;
                Ok(found.is_some())
            }

            async fn record_usage(
                &self,
                report: &$crate::record::UsageReport,
                month: &str,
                now_ms: i64,
            ) -> Result<$crate::record::UsageOutcome, $crate::error::AuthError> {
                use $crate::store::sql;
                let missing = || $crate::error::AuthError::TenantNotFound(report.tenant_id.clone());
                let mut tx = self.pool.begin().await?;
                let fresh = sqlx::query(sql::INSERT_REPORT)
                    .bind(&report.tenant_id)
                    .bind(&report.report_id)
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await
                    .map_err(|err| sql::missing_parent(err, missing))?
                    .rows_affected()
                    == 1;
                // The call is counted now (or was before): its estimate stops holding.
                sqlx::query(sql::SETTLE_RESERVATION)
                    .bind(&report.tenant_id)
                    .bind(&report.report_id)
                    .execute(&mut *tx)
                    .await?;
                let tokens = report.input_tokens.saturating_add(report.output_tokens);
                let mut outcome = $crate::record::UsageOutcome {
                    counted: fresh,
                    ..Default::default()
                };
                if fresh {
                    outcome.tenant = Self::add_usage(&mut tx, &report.tenant_id, "", month, tokens).await?;
                    if let Some(key_id) = report.key_id.as_deref() {
                        outcome.key = Some(Self::add_usage(&mut tx, &report.tenant_id, key_id, month, tokens).await?);
                    }
                } else {
                    let used: Option<i64> = sqlx::query_scalar(sql::SELECT_USAGE)
                        .bind(&report.tenant_id)
                        .bind("")
                        .bind(month)
                        .fetch_optional(&mut *tx)
                        .await?;
                    let used = sql::tokens(used.unwrap_or(0))?;
                    let quota: i64 = sqlx::query_scalar(sql::TENANT_QUOTA)
                        .bind(&report.tenant_id)
                        .fetch_one(&mut *tx)
                        .await?;
                    outcome.tenant = $crate::record::CounterChange {
                        before: used,
                        after: used,
                        quota: sql::tokens(quota)?,
                    };
                }
                tx.commit().await?;
                Ok(outcome)
            }

            async fn reserve_tokens(
                &self,
                reservation: &$crate::record::TokenReservation,
                month: &str,
                now_ms: i64,
                expires_at_ms: i64,
            ) -> Result<$crate::record::ReserveOutcome, $crate::error::AuthError> {
                use $crate::record::ReserveOutcome;
                use $crate::store::sql;
                let tenant_id = &reservation.tenant_id;
                let missing = || $crate::error::AuthError::TenantNotFound(tenant_id.clone());
                let mut tx = self.pool.begin().await?;
                // Adding nothing to the tenant's counter takes its row for this
                // transaction: reservations and reports of one tenant (which
                // add to the same row) run one at a time on every replica.
                let used: i64 = sqlx::query_scalar(sql::ADD_USAGE)
                    .bind(tenant_id)
                    .bind("")
                    .bind(month)
                    .bind(0_i64)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(|err| sql::missing_parent(err, missing))?;
                let used = sql::tokens(used)?;
                sqlx::query(sql::DROP_EXPIRED_RESERVATIONS)
                    .bind(tenant_id)
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?;
                let reserved = |key_id: Option<&str>| {
                    sqlx::query_scalar::<_, i64>(sql::RESERVED_TOKENS)
                        .bind(tenant_id)
                        .bind(key_id.map(str::to_owned))
                        .bind(&reservation.reservation_id)
                };
                let tenant_quota = sql::tokens(
                    sqlx::query_scalar(sql::TENANT_QUOTA)
                        .bind(tenant_id)
                        .fetch_one(&mut *tx)
                        .await?,
                )?;
                let mut quotas = Vec::new();
                if tenant_quota > 0 {
                    let held = sql::tokens(reserved(None).fetch_one(&mut *tx).await?)?;
                    quotas.push((None, used, held, tenant_quota));
                }
                if let Some(key_id) = reservation.key_id.as_deref() {
                    let quota: Option<i64> = sqlx::query_scalar(sql::KEY_QUOTA)
                        .bind(key_id)
                        .bind(tenant_id)
                        .fetch_optional(&mut *tx)
                        .await?;
                    let quota = sql::tokens(quota.unwrap_or(0))?;
                    if quota > 0 {
                        let used: Option<i64> = sqlx::query_scalar(sql::SELECT_USAGE)
                            .bind(tenant_id)
                            .bind(key_id)
                            .bind(month)
                            .fetch_optional(&mut *tx)
                            .await?;
                        let used = sql::tokens(used.unwrap_or(0))?;
                        let held = sql::tokens(reserved(Some(key_id)).fetch_one(&mut *tx).await?)?;
                        quotas.push((Some(key_id.to_owned()), used, held, quota));
                    }
                }
                let refusing = quotas
                    .iter()
                    .find(|(_, used, held, quota)| used.saturating_add(*held) >= *quota);
                let outcome = match refusing {
                    Some((key_id, used, _, quota)) => ReserveOutcome::Refused {
                        quota: $crate::record::QuotaState {
                            tenant_id: tenant_id.clone(),
                            key_id: key_id.clone(),
                            month: month.to_owned(),
                        },
                        used_up: used >= quota,
                    },
                    None => {
                        if !quotas.is_empty() {
                            sqlx::query(sql::INSERT_RESERVATION)
                                .bind(tenant_id)
                                .bind(&reservation.reservation_id)
                                .bind(reservation.key_id.as_deref().unwrap_or(""))
                                .bind(sql::signed(reservation.tokens))
                                .bind(expires_at_ms)
                                .execute(&mut *tx)
                                .await?;
                        }
                        ReserveOutcome::Reserved
                    }
                };
                tx.commit().await?;
                Ok(outcome)
            }

            async fn usage(
                &self,
                tenant_id: &str,
                key_id: Option<&str>,
                month: &str,
            ) -> Result<u64, $crate::error::AuthError> {
                use $crate::store::sql;
                let used: Option<i64> = sqlx::query_scalar(sql::SELECT_USAGE)
                    .bind(tenant_id)
                    .bind(key_id.unwrap_or(""))
                    .bind(month)
                    .fetch_optional(&self.pool)
                    .await?;
                sql::tokens(used.unwrap_or(0))
            }

            async fn exhausted_quotas(
                &self,
                month: &str,
            ) -> Result<Vec<$crate::record::QuotaState>, $crate::error::AuthError> {
                use $crate::store::sql;
                let tenants: Vec<String> = sqlx::query_scalar(sql::EXHAUSTED_TENANTS)
                    .bind(month)
                    .fetch_all(&self.pool)
                    .await?;
                let keys: Vec<(String, String)> = sqlx::query_as(sql::EXHAUSTED_KEYS)
                    .bind(month)
                    .fetch_all(&self.pool)
                    .await?;
                let tenants = tenants.into_iter().map(|tenant_id| (tenant_id, None));
                let keys = keys
                    .into_iter()
                    .map(|(tenant_id, key_id)| (tenant_id, Some(key_id)));
                Ok(tenants
                    .chain(keys)
                    .map(|(tenant_id, key_id)| $crate::record::QuotaState {
                        tenant_id,
                        key_id,
                        month: month.to_owned(),
                    })
                    .collect())
            }

            async fn revoked_keys_since(&self, since_ms: i64) -> Result<Vec<(String, i64)>, $crate::error::AuthError> {
                use $crate::store::sql;
                Ok(sqlx::query_as(sql::REVOKED_KEYS_SINCE)
                    .bind(since_ms)
                    .fetch_all(&self.pool)
                    .await?)
            }

            async fn tombstones_since(
                &self,
                since_ms: i64,
            ) -> Result<Vec<$crate::record::Tombstone>, $crate::error::AuthError> {
                use $crate::store::sql;
                let rows = sqlx::query(sql::TOMBSTONES_SINCE)
                    .bind(since_ms)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::tombstone_from_row(row)).collect()
            }

            async fn tenants_updated_since(
                &self,
                since_ms: i64,
            ) -> Result<Vec<(String, i64)>, $crate::error::AuthError> {
                use $crate::store::sql;
                Ok(sqlx::query_as(sql::TENANTS_UPDATED_SINCE)
                    .bind(since_ms)
                    .fetch_all(&self.pool)
                    .await?)
            }

            async fn current_signing_key(
                &self,
            ) -> Result<Option<$crate::record::SigningKeyRecord>, $crate::error::AuthError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::CURRENT_SIGNING_KEY)
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(|row| sql::signing_key_from_row(row)).transpose()
            }

            async fn insert_signing_key(
                &self,
                key: &$crate::record::SigningKeyRecord,
                now_ms: i64,
            ) -> Result<(), $crate::error::AuthError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin().await?;
                sqlx::query(sql::INSERT_SIGNING_KEY)
                    .bind(&key.kid)
                    .bind(&key.private_key)
                    .bind(&key.public_jwk)
                    .bind(key.created_at_ms)
                    .bind(key.retired_at_ms)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(sql::RETIRE_OTHER_SIGNING_KEYS)
                    .bind(&key.kid)
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(())
            }

            async fn signing_keys(&self) -> Result<Vec<$crate::record::SigningKeyRecord>, $crate::error::AuthError> {
                use $crate::store::sql;
                let rows = sqlx::query(sql::ALL_SIGNING_KEYS).fetch_all(&self.pool).await?;
                rows.iter().map(|row| sql::signing_key_from_row(row)).collect()
            }

            async fn replace_private_key(
                &self,
                kid: &str,
                expected: &[u8],
                private_key: &[u8],
            ) -> Result<bool, $crate::error::AuthError> {
                use $crate::store::sql;
                let done = sqlx::query(sql::REPLACE_PRIVATE_KEY)
                    .bind(kid)
                    .bind(expected)
                    .bind(private_key)
                    .execute(&self.pool)
                    .await?;
                Ok(done.rows_affected() == 1)
            }

            async fn public_keys(&self, retired_since_ms: i64) -> Result<Vec<String>, $crate::error::AuthError> {
                use $crate::store::sql;
                Ok(sqlx::query_scalar(sql::PUBLIC_KEYS)
                    .bind(retired_since_ms)
                    .fetch_all(&self.pool)
                    .await?)
            }

            fn event_transport(&self) -> avm_store::events::EventTransport {
                self.event_transport_impl()
            }
        }
    };
}

pub(super) use impl_auth_store;
