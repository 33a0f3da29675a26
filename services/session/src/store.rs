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
use crate::recent::RecentRow;
use crate::record::{
    AgentState, AgentStateChange, Compaction, ContainerAccess, ContainerRecord, GroupCursor, GroupMemberRecord,
    GroupMessageRecord, GroupRecord, GroupUpdate, ImageRecord, ImageUpdate, MemberRef, MessageRecord, NewGroupMessage,
    NewMessage, OpenTurn, ShareRecord, ShareRole, Truncated, UnreadGroup,
};
use crate::retention::{RetentionCandidate, RetentionPolicy, StoredPolicy};
use crate::search::{SearchRequest, SearchRow, Terms};
use crate::transfer::{ImportWrite, Imported};

mod groups;
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

/// Persists containers, images, sessions and messages; and, through
/// [`GroupStore`], the groups inside the containers.
#[async_trait]
pub trait SessionStore: GroupStore + Send + Sync + 'static {
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

    /// Shares a container with a user of the tenant with `role` (again: the
    /// role changes); only its owner or the whole-tenant scope may.
    async fn share_container(
        &self,
        scope: &Scope<'_>,
        container_id: &str,
        user_id: &str,
        role: ShareRole,
        now_ms: i64,
    ) -> Result<(), SessionError>;

    /// Returns what the scope's user may do in a container it sees: `Full`
    /// for the whole-tenant scope and the owner, else the share's role.
    /// `ContainerNotFound` when the scope does not see it.
    async fn container_access(&self, scope: &Scope<'_>, container_id: &str) -> Result<ContainerAccess, SessionError>;

    /// Stops sharing a container with a user (idempotent); only its owner or
    /// the whole-tenant scope may.
    async fn unshare_container(&self, scope: &Scope<'_>, container_id: &str, user_id: &str)
    -> Result<(), SessionError>;

    /// Returns the users a visible container is shared with.
    async fn list_shares(&self, scope: &Scope<'_>, container_id: &str) -> Result<Vec<ShareRecord>, SessionError>;

    /// Inserts an image and its session in one transaction; `ContainerNotFound` when
    /// the image's container does not exist in the scope. An image with a parent
    /// holds the parent until commit: `ImageNotFound` when the parent is gone,
    /// `AgentTerminated` when it is terminated (the service checked the rest).
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

    /// Returns the direct children of an image, newest first; none when the
    /// image does not exist in the scope.
    async fn list_child_images(
        &self,
        scope: &Scope<'_>,
        parent_image_id: &str,
    ) -> Result<Vec<ImageRecord>, SessionError>;

    /// Sets an image's agent state in one transaction; terminating it
    /// terminates every descendant too. A terminated image stays so
    /// (`AgentTerminated` for any other state); setting the state it has
    /// changes nothing. `Error` takes `error` (a later one replaces it) and
    /// leaves a paused image paused; any other state clears it.
    /// `ImageNotFound` when it does not exist in the scope.
    async fn set_agent_state(
        &self,
        scope: &Scope<'_>,
        image_id: &str,
        state: AgentState,
        error: Option<&str>,
        now_ms: i64,
    ) -> Result<AgentStateChange, SessionError>;

    /// Applies `update` and sets `updated_at_ms`; returns the changed image.
    async fn update_image(
        &self,
        scope: &Scope<'_>,
        image_id: &str,
        update: &ImageUpdate,
        now_ms: i64,
    ) -> Result<ImageRecord, SessionError>;

    /// Deletes an image and its descendants with their sessions and messages;
    /// returns the deleted image ids, the image first.
    async fn delete_image(&self, scope: &Scope<'_>, image_id: &str) -> Result<Vec<String>, SessionError>;

    /// Deletes an image as [`Self::delete_image`] does, only while its
    /// session's last activity is `last_active_at_ms` and it has no
    /// children (what retention chose, unless it changed since);
    /// `ImageNotFound` otherwise, with nothing deleted.
    async fn delete_unchanged_image(
        &self,
        scope: &Scope<'_>,
        image_id: &str,
        last_active_at_ms: i64,
    ) -> Result<Vec<String>, SessionError>;

    /// Returns a tenant's retention policy, `None` when it never set one.
    async fn get_retention_policy(&self, tenant_id: &str) -> Result<Option<StoredPolicy>, SessionError>;

    /// Sets a tenant's retention policy, all of it (the caller checked it).
    async fn set_retention_policy(
        &self,
        tenant_id: &str,
        policy: &RetentionPolicy,
        updated_by: &str,
        now_ms: i64,
    ) -> Result<(), SessionError>;

    /// Returns up to `limit` policies that delete something, by tenant id
    /// after `after_tenant_id`.
    async fn list_retention_policies(
        &self,
        after_tenant_id: &str,
        limit: u32,
    ) -> Result<Vec<(String, RetentionPolicy)>, SessionError>;

    /// Returns how many of a tenant's messages were written before
    /// `before_ms`, counting at most `limit`.
    async fn count_old_messages(&self, tenant_id: &str, before_ms: i64, limit: u32) -> Result<u64, SessionError>;

    /// Deletes at most `limit` of a tenant's messages written before
    /// `before_ms`, in one transaction; returns how many.
    async fn delete_old_messages(&self, tenant_id: &str, before_ms: i64, limit: u32) -> Result<u64, SessionError>;

    /// Returns at most `limit` conversations of a tenant, least recently
    /// active first, that were last active before `idle_before_ms` or lie
    /// beyond the `keep_per_container` most recently active of their
    /// container; only images without children.
    async fn list_retention_candidates(
        &self,
        tenant_id: &str,
        idle_before_ms: Option<i64>,
        keep_per_container: Option<u32>,
        limit: u32,
    ) -> Result<Vec<RetentionCandidate>, SessionError>;

    /// Returns the right to sweep every tenant now, held until dropped, or
    /// `None` when another replica holds it (Postgres); one process owns a
    /// SQLite file, which always has it.
    async fn lock_sweep(&self) -> Result<Option<SweepLock>, SessionError>;

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

    /// Returns what the model reads of a session: its latest compaction, if
    /// any, and the messages from that compaction's first one on (all of
    /// them without one), in stored order.
    async fn list_context(
        &self,
        scope: &Scope<'_>,
        session_id: &str,
    ) -> Result<(Option<Compaction>, Vec<MessageRecord>), SessionError>;

    /// Records a compaction starting at its `from_message_id`, replacing one
    /// that starts there; returns that message's seq.
    async fn record_compaction(
        &self,
        scope: &Scope<'_>,
        session_id: &str,
        compaction: &Compaction,
    ) -> Result<u64, SessionError>;

    /// Deletes a session's messages after `after_message_id` (all of them
    /// when `None`), sets its seq back and moves read markers back with it.
    /// `MessageNotFound` when the message is not the session's; refused
    /// when it is a user message or a tool call (a turn would be left open).
    async fn truncate_messages(
        &self,
        scope: &Scope<'_>,
        session_id: &str,
        after_message_id: Option<&str>,
    ) -> Result<Truncated, SessionError>;

    /// Returns, across tenants, at most `limit` turns left open by sessions
    /// whose last message was stored before `before_ms`, by session id after
    /// `after_session_id`.
    async fn list_open_turns(
        &self,
        before_ms: i64,
        after_session_id: &str,
        limit: u32,
    ) -> Result<Vec<OpenTurn>, SessionError>;

    /// Returns up to `limit` conversations of the scope, most recently active
    /// first, after `after` (the last activity and session id of the
    /// previous page), each with its last message and `reader`'s read marker.
    async fn list_recent(
        &self,
        scope: &Scope<'_>,
        reader: &str,
        after: Option<(i64, &str)>,
        limit: u32,
    ) -> Result<Vec<RecentRow>, SessionError>;

    /// Moves `reader`'s read marker of an image forward to `seq` (`None`: its
    /// last message; never past it) and returns it; `ImageNotFound` when the
    /// image is not in the scope.
    async fn mark_read(
        &self,
        scope: &Scope<'_>,
        image_id: &str,
        reader: &str,
        seq: Option<u64>,
        now_ms: i64,
    ) -> Result<u64, SessionError>;

    /// Returns up to `limit` messages of a session with a seq above
    /// `after_seq`, in `seq` order. The caller has checked the session is in
    /// its scope (an export reads its image first).
    async fn list_messages_page(
        &self,
        session_id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<MessageRecord>, SessionError>;

    /// Writes imported conversations into a container in one transaction that
    /// holds the container: each image with its session and its messages at
    /// their seqs, unless an earlier import of the same document id made it
    /// (then that image, `created` false). `ContainerNotFound` when the
    /// container is not visible in the scope; nothing is written then.
    async fn import_conversations(
        &self,
        scope: &Scope<'_>,
        container_id: &str,
        items: &[ImportWrite],
        now_ms: i64,
    ) -> Result<Vec<Imported>, SessionError>;

    /// Returns up to `limit` hits after the first `offset`, best first:
    /// messages whose words match `terms` and, without a role filter,
    /// conversations whose name does, in the scope and the request's filters.
    async fn search(
        &self,
        scope: &Scope<'_>,
        terms: &Terms,
        filter: &SearchRequest,
        limit: u32,
        offset: u64,
    ) -> Result<Vec<SearchRow>, SessionError>;

    /// Returns how change events travel between the replicas on this store.
    fn event_transport(&self) -> EventTransport;
}

/// The right to run the retention sweep, until dropped: on Postgres a
/// connection holding an advisory lock, which closes with it (or when the
/// process dies).
pub struct SweepLock(#[allow(dead_code)] Box<dyn std::any::Any + Send>);

/// Persists groups, their members and read cursors, and their messages.
///
/// Groups live in containers and follow their visibility: a group of a
/// container the scope does not see is `GroupNotFound`, like a missing one.
#[async_trait]
pub trait GroupStore: Send + Sync + 'static {
    /// Inserts a group and its first members in one transaction;
    /// `ContainerNotFound` when its container does not exist in the scope,
    /// `ImageNotFound` when an agent member is not an image of that container.
    async fn create_group(
        &self,
        scope: &Scope<'_>,
        group: &GroupRecord,
        members: &[MemberRef],
    ) -> Result<(), SessionError>;

    /// Returns a group, or `GroupNotFound`.
    async fn get_group(&self, scope: &Scope<'_>, group_id: &str) -> Result<GroupRecord, SessionError>;

    /// Returns up to `limit` groups of a container, newest first
    /// (`created_at_ms`, then `group_id`, descending), after `after` when set;
    /// none when the container does not exist in the scope.
    async fn list_groups(
        &self,
        scope: &Scope<'_>,
        container_id: &str,
        after: Option<&GroupCursor>,
        limit: u32,
    ) -> Result<Vec<GroupRecord>, SessionError>;

    /// Applies `update` and sets `updated_at_ms`; returns the changed group.
    async fn update_group(
        &self,
        scope: &Scope<'_>,
        group_id: &str,
        update: &GroupUpdate,
        now_ms: i64,
    ) -> Result<GroupRecord, SessionError>;

    /// Deletes a group with its members and messages.
    async fn delete_group(&self, scope: &Scope<'_>, group_id: &str) -> Result<(), SessionError>;

    /// Adds a member with a read cursor of 0. `GroupMemberExists` when the
    /// group has a member with that id; `ImageNotFound` when an agent is not
    /// an image of the group's container.
    async fn add_group_member(
        &self,
        scope: &Scope<'_>,
        group_id: &str,
        member: &MemberRef,
        now_ms: i64,
    ) -> Result<GroupMemberRecord, SessionError>;

    /// Removes a member; its messages stay. `GroupMemberNotFound` when the
    /// group has no such member.
    async fn remove_group_member(
        &self,
        scope: &Scope<'_>,
        group_id: &str,
        member: &MemberRef,
    ) -> Result<(), SessionError>;

    /// Returns a group's members in the order they joined.
    async fn list_group_members(
        &self,
        scope: &Scope<'_>,
        group_id: &str,
    ) -> Result<Vec<GroupMemberRecord>, SessionError>;

    /// Appends a message with the next `seq` of its group and moves the
    /// group's agent streak, in one transaction; returns it and whether it is
    /// new. A message id already in the group returns the stored message
    /// unchanged. The sender and every mention must be members
    /// (`Precondition` otherwise).
    async fn post_group_message(
        &self,
        scope: &Scope<'_>,
        group_id: &str,
        message_id: &str,
        message: &NewGroupMessage,
    ) -> Result<(GroupMessageRecord, bool), SessionError>;

    /// Returns up to `limit` messages of a group with a seq above `after_seq`, in `seq` order.
    async fn list_group_messages(
        &self,
        scope: &Scope<'_>,
        group_id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<GroupMessageRecord>, SessionError>;

    /// Returns every group in which `member` has unread messages, by group
    /// id, each with its count and its first `message_limit` unread messages.
    async fn list_unread(
        &self,
        scope: &Scope<'_>,
        member: &MemberRef,
        message_limit: u32,
    ) -> Result<Vec<UnreadGroup>, SessionError>;

    /// Moves a member's read cursor forward to `seq` (at most the group's
    /// newest message; never backwards) and returns the member.
    async fn advance_read_cursor(
        &self,
        scope: &Scope<'_>,
        group_id: &str,
        member: &MemberRef,
        seq: u64,
    ) -> Result<GroupMemberRecord, SessionError>;
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
