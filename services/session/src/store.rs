//! The database: one trait, with a SQLite and a Postgres implementation that
//! share their statements (`store/sql.rs`).
//!
//! Every method takes a [`Scope`] (the tenant, and for members the user) and
//! bounds its statements by it, so another tenant's object, or a container of
//! the same tenant the user may not see, is indistinguishable from a missing one. Not-found errors
//! are decided here, inside the statement or transaction that looked.

use std::sync::Arc;

use async_trait::async_trait;
use avm_common::ApiError;
use avm_store::db::{self, DbPool};
use avm_store::events::EventTransport;

use crate::error::SessionError;
use crate::record::{ContainerRecord, ImageRecord, ImageUpdate, MessageRecord, NewMessage, ShareRecord};

mod postgres;
mod sql;
mod sqlite;

pub use postgres::PostgresSessionStore;
pub use sqlite::SqliteSessionStore;

/// Whose data a statement may touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scope<'a> {
    pub tenant_id: &'a str,
    /// When set, only containers this user owns or that are shared with them
    /// (and what is inside them) exist; `None` is the whole tenant.
    pub user_id: Option<&'a str>,
}

/// Persists containers, images, sessions and messages.
#[async_trait]
pub trait SessionStore: Send + Sync + 'static {
    /// Inserts the container, owned by `owner_id`, unless it exists; returns
    /// it and whether it is new. `ContainerIdTaken` when it exists but is not
    /// visible in `scope`.
    async fn create_container(
        &self,
        scope: &Scope<'_>,
        container_id: &str,
        owner_id: &str,
        now_ms: i64,
    ) -> Result<(ContainerRecord, bool), SessionError>;

    /// Returns a container, or `ContainerNotFound`.
    async fn get_container(&self, scope: &Scope<'_>, container_id: &str) -> Result<ContainerRecord, SessionError>;

    /// Returns the containers of the scope, oldest first.
    async fn list_containers(&self, scope: &Scope<'_>) -> Result<Vec<ContainerRecord>, SessionError>;

    /// Deletes a container with its images, sessions and messages; returns the
    /// deleted image ids. `NotContainerOwner` when the scope's user sees it but
    /// does not own it.
    async fn delete_container(&self, scope: &Scope<'_>, container_id: &str) -> Result<Vec<String>, SessionError>;

    /// Shares a container with a user of the tenant (idempotent); only its
    /// owner or the whole-tenant scope may.
    async fn share_container(
        &self,
        scope: &Scope<'_>,
        container_id: &str,
        user_id: &str,
        now_ms: i64,
    ) -> Result<(), SessionError>;

    /// Stops sharing a container with a user (idempotent); only its owner or
    /// the whole-tenant scope may.
    async fn unshare_container(&self, scope: &Scope<'_>, container_id: &str, user_id: &str)
    -> Result<(), SessionError>;

    /// Returns the users a visible container is shared with.
    async fn list_shares(&self, scope: &Scope<'_>, container_id: &str) -> Result<Vec<ShareRecord>, SessionError>;

    /// Inserts an image and its session in one transaction; `ContainerNotFound` when
    /// the image's container does not exist in the scope.
    async fn create_image(&self, scope: &Scope<'_>, image: &ImageRecord) -> Result<(), SessionError>;

    /// Returns an image, or `ImageNotFound`.
    async fn get_image(&self, scope: &Scope<'_>, image_id: &str) -> Result<ImageRecord, SessionError>;

    /// Returns the image that owns a session, or `SessionNotFound`.
    async fn get_session_image(&self, scope: &Scope<'_>, session_id: &str) -> Result<ImageRecord, SessionError>;

    /// Returns images newest first (`created_at_ms`, then `image_id`, descending), of
    /// one container or of all the scope's containers.
    async fn list_images(
        &self,
        scope: &Scope<'_>,
        container_id: Option<&str>,
    ) -> Result<Vec<ImageRecord>, SessionError>;

    /// Applies `update` and sets `updated_at_ms`; returns the changed image.
    async fn update_image(
        &self,
        scope: &Scope<'_>,
        image_id: &str,
        update: &ImageUpdate,
        now_ms: i64,
    ) -> Result<ImageRecord, SessionError>;

    /// Deletes an image with its session and messages.
    async fn delete_image(&self, scope: &Scope<'_>, image_id: &str) -> Result<(), SessionError>;

    /// Appends a message with the next `seq` of its session, keeping `created_at_ms`
    /// as given. A message id already in the session returns the stored message unchanged.
    async fn append_message(
        &self,
        scope: &Scope<'_>,
        session_id: &str,
        message: &NewMessage,
    ) -> Result<MessageRecord, SessionError>;

    /// Returns a session's messages in `seq` order, or `SessionNotFound`.
    async fn list_messages(&self, scope: &Scope<'_>, session_id: &str) -> Result<Vec<MessageRecord>, SessionError>;

    /// Returns how change events travel between the replicas on this store.
    fn event_transport(&self) -> EventTransport;
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
