//! The statements and the `ConfigStore` implementation shared by SQLite and
//! Postgres: both accept `$N` placeholders, `RETURNING` and
//! `ON CONFLICT … DO UPDATE`. The implementation is a macro expanded per
//! store, as in the session service (generic `Executor` bounds do not meet
//! `async_trait`'s `Send` futures). A transaction starts with its write, so
//! SQLite takes the write lock up front, where `busy_timeout` applies.

pub(super) const BUMP_REVISION: &str =
    "UPDATE config_revision SET revision = revision + 1 WHERE id = 1 RETURNING revision";
pub(super) const SELECT_REVISION: &str = "SELECT revision FROM config_revision WHERE id = 1";
pub(super) const SELECT_OVERRIDES: &str =
    "SELECT key, value, encrypted FROM config_overrides WHERE scope = $1 ORDER BY key";
pub(super) const UPSERT_OVERRIDE: &str = "\
    INSERT INTO config_overrides (scope, key, value, encrypted, updated_at_ms, updated_by) \
    VALUES ($1, $2, $3, $4, $5, $6) \
    ON CONFLICT (scope, key) DO UPDATE SET value = excluded.value, encrypted = excluded.encrypted, \
    updated_at_ms = excluded.updated_at_ms, updated_by = excluded.updated_by";
pub(super) const DELETE_OVERRIDE: &str = "DELETE FROM config_overrides WHERE scope = $1 AND key = $2";

/// Returns a revision as stored (never negative) as the counter it is.
pub(super) fn revision(stored: i64) -> Result<u64, crate::error::ConfigError> {
    u64::try_from(stored).map_err(|_| crate::error::ConfigError::corrupt(format!("negative revision {stored}")))
}

/// Implements `ConfigStore` for a struct with a `pool` field and an
/// `event_transport_impl` method.
macro_rules! impl_config_store {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::ConfigStore for $store {
            async fn overrides(
                &self,
                scope: &str,
            ) -> Result<Vec<$crate::store::StoredValue>, $crate::error::ConfigError> {
                let rows: Vec<(String, String, bool)> = sqlx::query_as(super::sql::SELECT_OVERRIDES)
                    .bind(scope)
                    .fetch_all(&self.pool)
                    .await?;
                Ok(rows
                    .into_iter()
                    .map(|(key, value, encrypted)| $crate::store::StoredValue {
                        key,
                        value,
                        encrypted,
                    })
                    .collect())
            }

            async fn apply(
                &self,
                scope: &str,
                changes: &[$crate::store::Change],
                updated_by: &str,
                now_ms: i64,
            ) -> Result<u64, $crate::error::ConfigError> {
                let mut tx = self.pool.begin().await?;
                let revision: i64 = sqlx::query_scalar(super::sql::BUMP_REVISION)
                    .fetch_one(&mut *tx)
                    .await?;
                for change in changes {
                    match &change.value {
                        Some(value) => {
                            sqlx::query(super::sql::UPSERT_OVERRIDE)
                                .bind(scope)
                                .bind(&change.key)
                                .bind(&value.value)
                                .bind(value.encrypted)
                                .bind(now_ms)
                                .bind(updated_by)
                                .execute(&mut *tx)
                                .await?;
                        }
                        None => {
                            sqlx::query(super::sql::DELETE_OVERRIDE)
                                .bind(scope)
                                .bind(&change.key)
                                .execute(&mut *tx)
                                .await?;
                        }
                    }
                }
                tx.commit().await?;
                super::sql::revision(revision)
            }

            async fn revision(&self) -> Result<u64, $crate::error::ConfigError> {
                let revision: i64 = sqlx::query_scalar(super::sql::SELECT_REVISION)
                    .fetch_one(&self.pool)
                    .await?;
                super::sql::revision(revision)
            }

            fn event_transport(&self) -> avm_store::events::EventTransport {
                self.event_transport_impl()
            }
        }
    };
}

pub(super) use impl_config_store;
