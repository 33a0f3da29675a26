//! The database: one trait, with a SQLite and a Postgres implementation that
//! share their statements (`store/sql.rs`).
//!
//! Lookups by id take a [`Reach`], so an object the caller may not see is
//! refused by the same statement, with the same error, as a missing one.

use std::sync::Arc;

use async_trait::async_trait;
use avm_common::ApiError;
use avm_store::db::{self, DbPool};
use avm_store::events::EventTransport;

use crate::error::AuthError;
use crate::record::{
    ApiKeyRecord, KeyCredential, NewApiKey, QuotaState, Reach, ReserveOutcome, SigningKeyRecord, TenantRecord,
    TenantUpdate, TokenReservation, Tombstone, UsageOutcome, UsageReport, UserRecord,
};

mod postgres;
mod sql;
mod sqlite;

pub use postgres::PostgresAuthStore;
pub use sqlite::SqliteAuthStore;

/// Persists tenants, users, API keys, signing keys, usage and tombstones.
#[async_trait]
pub trait AuthStore: Send + Sync + 'static {
    /// Inserts a tenant with its first admin and their key, in one transaction.
    async fn create_tenant(&self, tenant: &TenantRecord, admin: &UserRecord, key: &NewApiKey) -> Result<(), AuthError>;

    /// Inserts an operator tenant with its admin and key only when no tenant
    /// exists; returns whether it did.
    async fn bootstrap(&self, tenant: &TenantRecord, admin: &UserRecord, key: &NewApiKey) -> Result<bool, AuthError>;

    /// Returns a tenant within reach, or `TenantNotFound`.
    async fn get_tenant(&self, reach: &Reach, tenant_id: &str) -> Result<TenantRecord, AuthError>;

    /// Returns the oldest non-operator tenant called `name`.
    async fn find_tenant_by_name(&self, name: &str) -> Result<Option<TenantRecord>, AuthError>;

    /// Returns the tenants within reach, oldest first.
    async fn list_tenants(&self, reach: &Reach) -> Result<Vec<TenantRecord>, AuthError>;

    /// Applies `update` and sets `updated_at_ms`; returns the tenant before and after.
    async fn update_tenant(
        &self,
        reach: &Reach,
        tenant_id: &str,
        update: &TenantUpdate,
        now_ms: i64,
    ) -> Result<(TenantRecord, TenantRecord), AuthError>;

    /// Deletes a non-operator tenant with its users, keys and usage, leaving a tombstone.
    async fn delete_tenant(&self, tenant_id: &str, now_ms: i64) -> Result<(), AuthError>;

    /// Inserts a user; `TenantNotFound` when the tenant is missing or out of reach.
    async fn create_user(&self, reach: &Reach, user: &UserRecord) -> Result<(), AuthError>;

    /// Returns a user within reach, or `UserNotFound`.
    async fn get_user(&self, reach: &Reach, user_id: &str) -> Result<UserRecord, AuthError>;

    /// Returns the users of a tenant within reach, oldest first; `TenantNotFound`
    /// when the tenant is missing or out of reach.
    async fn list_users(&self, reach: &Reach, tenant_id: &str) -> Result<Vec<UserRecord>, AuthError>;

    /// Deletes a user within reach with their keys, leaving a tombstone; returns the user.
    async fn delete_user(&self, reach: &Reach, user_id: &str, now_ms: i64) -> Result<UserRecord, AuthError>;

    /// Returns the user of an external subject, inserting `user` on first sight
    /// and keeping the role the issuer states.
    async fn upsert_external_user(&self, user: &UserRecord) -> Result<UserRecord, AuthError>;

    /// Inserts a key; `UserNotFound` when its user is gone.
    async fn create_api_key(&self, key: &NewApiKey) -> Result<(), AuthError>;

    /// Returns a key within reach, or `ApiKeyNotFound`.
    async fn get_api_key(&self, reach: &Reach, key_id: &str) -> Result<ApiKeyRecord, AuthError>;

    /// Returns the keys within reach, newest first.
    async fn list_api_keys(&self, reach: &Reach) -> Result<Vec<ApiKeyRecord>, AuthError>;

    /// Revokes a key within reach; returns it and whether this call revoked it.
    async fn revoke_api_key(&self, reach: &Reach, key_id: &str, now_ms: i64)
    -> Result<(ApiKeyRecord, bool), AuthError>;

    /// Revokes the unrevoked keys of a user called `name`; returns their ids.
    async fn revoke_api_keys_named(&self, user_id: &str, name: &str, now_ms: i64) -> Result<Vec<String>, AuthError>;

    /// Returns a key with its secret's hash, its user and its tenant.
    async fn key_credential(&self, key_id: &str) -> Result<Option<KeyCredential>, AuthError>;

    /// Returns whether the user still exists in the tenant, when given the
    /// key is theirs and unrevoked, and, when `operator`, the user is an
    /// admin of the operator tenant.
    async fn credential_alive(
        &self,
        tenant_id: &str,
        user_id: &str,
        key_id: Option<&str>,
        operator: bool,
    ) -> Result<bool, AuthError>;

    /// Counts a report once per `report_id`, in `month`, and ends the token
    /// reservation of the same id; `TenantNotFound` when the tenant is missing.
    async fn record_usage(&self, report: &UsageReport, month: &str, now_ms: i64) -> Result<UsageOutcome, AuthError>;

    /// Holds `reservation` against its tenant's and key's quotas in `month`
    /// until `expires_at_ms` (or its call's report), unless their use plus
    /// the unexpired reservations already reached one; a retried
    /// reservation holds once. `TenantNotFound` when the tenant is missing.
    async fn reserve_tokens(
        &self,
        reservation: &TokenReservation,
        month: &str,
        now_ms: i64,
        expires_at_ms: i64,
    ) -> Result<ReserveOutcome, AuthError>;

    /// Returns the tokens counted for a tenant (or one of its keys) in `month`.
    async fn usage(&self, tenant_id: &str, key_id: Option<&str>, month: &str) -> Result<u64, AuthError>;

    /// Returns the tenants and keys whose use in `month` reached their quota.
    async fn exhausted_quotas(&self, month: &str) -> Result<Vec<QuotaState>, AuthError>;

    /// Returns the keys revoked at or after `since_ms`, with when.
    async fn revoked_keys_since(&self, since_ms: i64) -> Result<Vec<(String, i64)>, AuthError>;

    /// Returns the tombstones made at or after `since_ms`.
    async fn tombstones_since(&self, since_ms: i64) -> Result<Vec<Tombstone>, AuthError>;

    /// Returns the tenants updated at or after `since_ms`, with when.
    async fn tenants_updated_since(&self, since_ms: i64) -> Result<Vec<(String, i64)>, AuthError>;

    /// Returns the newest unretired signing key.
    async fn current_signing_key(&self) -> Result<Option<SigningKeyRecord>, AuthError>;

    /// Inserts a signing key and retires every other unretired one.
    async fn insert_signing_key(&self, key: &SigningKeyRecord, now_ms: i64) -> Result<(), AuthError>;

    /// Returns every signing key, retired ones too, oldest first.
    async fn signing_keys(&self) -> Result<Vec<SigningKeyRecord>, AuthError>;

    /// Replaces a signing key's stored private half, if it is still
    /// `expected`; returns whether it did.
    async fn replace_private_key(&self, kid: &str, expected: &[u8], private_key: &[u8]) -> Result<bool, AuthError>;

    /// Returns the public JWKs of unretired keys and of keys retired at or after `since_ms`.
    async fn public_keys(&self, retired_since_ms: i64) -> Result<Vec<String>, AuthError>;

    /// Returns how events travel between the replicas on this store.
    fn event_transport(&self) -> EventTransport;
}

/// Opens the store named by `url` (`sqlite://…` or `postgres://…`) and brings its
/// schema up to date.
///
/// A Postgres url may choose the schema: `…?options=-c%20search_path%3D<schema>`.
pub async fn open_store(url: &str, max_connections: Option<u32>) -> Result<Arc<dyn AuthStore>, ApiError> {
    let store: Arc<dyn AuthStore> = match db::connect(url, max_connections).await? {
        DbPool::Sqlite(pool) => Arc::new(SqliteAuthStore::new(pool).await?),
        DbPool::Postgres(pool) => Arc::new(PostgresAuthStore::new(pool).await?),
    };
    Ok(store)
}
