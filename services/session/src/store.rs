//! The database: one trait, with a SQLite and a Postgres implementation that
//! share their statements (`store/sql.rs`).
//!
//! Every method takes the tenant and scopes its statements by it, so another
//! tenant's object is indistinguishable from a missing one. Not-found errors
//! are decided here, inside the statement or transaction that looked.

use std::sync::Arc;

use async_trait::async_trait;
use avm_common::ApiError;
use avm_common::db::{self, DbPool};

use crate::error::SessionError;
use crate::record::{ContainerRecord, ImageRecord, ImageUpdate, MessageRecord, NewMessage};

mod postgres;
mod sql;
mod sqlite;

pub use postgres::PostgresSessionStore;
pub use sqlite::SqliteSessionStore;

/// Persists containers, images, sessions and messages.
#[async_trait]
pub trait SessionStore: Send + Sync + 'static {
    /// Inserts the container unless it exists; returns it and whether it is new.
    async fn create_container(
        &self,
        tenant_id: &str,
        container_id: &str,
        now_ms: i64,
    ) -> Result<(ContainerRecord, bool), SessionError>;

    /// Returns a container, or `ContainerNotFound`.
    async fn get_container(&self, tenant_id: &str, container_id: &str) -> Result<ContainerRecord, SessionError>;

    /// Returns the tenant's containers, oldest first.
    async fn list_containers(&self, tenant_id: &str) -> Result<Vec<ContainerRecord>, SessionError>;

    /// Deletes a container with its images, sessions and messages; returns the deleted image ids.
    async fn delete_container(&self, tenant_id: &str, container_id: &str) -> Result<Vec<String>, SessionError>;

    /// Inserts an image and its session in one transaction; `ContainerNotFound` when
    /// the image's container does not exist.
    async fn create_image(&self, tenant_id: &str, image: &ImageRecord) -> Result<(), SessionError>;

    /// Returns an image, or `ImageNotFound`.
    async fn get_image(&self, tenant_id: &str, image_id: &str) -> Result<ImageRecord, SessionError>;

    /// Returns the image that owns a session, or `SessionNotFound`.
    async fn get_session_image(&self, tenant_id: &str, session_id: &str) -> Result<ImageRecord, SessionError>;

    /// Returns images newest first (`created_at_ms`, then `image_id`, descending), of
    /// one container or of all the tenant's containers.
    async fn list_images(&self, tenant_id: &str, container_id: Option<&str>) -> Result<Vec<ImageRecord>, SessionError>;

    /// Applies `update` and sets `updated_at_ms`; returns the changed image.
    async fn update_image(
        &self,
        tenant_id: &str,
        image_id: &str,
        update: &ImageUpdate,
        now_ms: i64,
    ) -> Result<ImageRecord, SessionError>;

    /// Deletes an image with its session and messages.
    async fn delete_image(&self, tenant_id: &str, image_id: &str) -> Result<(), SessionError>;

    /// Appends a message with the next `seq` of its session, keeping `created_at_ms`
    /// as given. A message id already in the session returns the stored message unchanged.
    async fn append_message(
        &self,
        tenant_id: &str,
        session_id: &str,
        message: &NewMessage,
    ) -> Result<MessageRecord, SessionError>;

    /// Returns a session's messages in `seq` order, or `SessionNotFound`.
    async fn list_messages(&self, tenant_id: &str, session_id: &str) -> Result<Vec<MessageRecord>, SessionError>;
}

/// Opens the store named by `url` (`sqlite://…` or `postgres://…`) and brings its
/// schema up to date.
///
/// A Postgres url may choose the schema: `…?options=-c%20search_path%3D<schema>`.
pub async fn open_store(url: &str, max_connections: Option<u32>) -> Result<Arc<dyn SessionStore>, ApiError> {
    let store: Arc<dyn SessionStore> = match db::connect(url, max_connections).await? {
        DbPool::Sqlite(pool) => Arc::new(SqliteSessionStore::new(pool).await?),
        DbPool::Postgres(pool) => Arc::new(PostgresSessionStore::new(pool).await?),
    };
    Ok(store)
}
