//! What can go wrong in a store, the same for every service that has one.

use avm_common::ApiError;

/// A failure of a service's database.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The schema could not be brought up to date.
    #[error("migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// A stored row could not be read back; the data is not what this code wrote.
    #[error("corrupt stored data: {0}")]
    Corrupt(String),
}

impl StoreError {
    /// Returns the error a caller sees when `service`'s store failed: a
    /// saturated pool or a lost connection is worth retrying (UNAVAILABLE),
    /// anything else is internal; the detail is logged, never returned.
    pub fn into_api(self, service: &str) -> ApiError {
        match self {
            StoreError::Database(err) => crate::db::database_error(service, &err),
            err @ (StoreError::Migration(_) | StoreError::Corrupt(_)) => {
                ApiError::internal(format_args!("{service}: {err}"))
            }
        }
    }
}
