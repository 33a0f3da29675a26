//! The session service: a tenant's containers, the images (persisted
//! conversation definitions) inside them, the one session of each image and
//! its messages, and the groups in which agents and users talk together,
//! stored in SQLite or Postgres and served as `avm.session.v1`.
//!
//! ```text
//! grpc.rs     proto ⇄ domain, metadata → RequestContext, error → Status
//! service.rs  validation, ids, timestamps, logs (service/groups.rs: groups)
//! store.rs    the SessionStore and GroupStore traits; store/{sqlite,postgres}.rs
//!             behind them, sharing store/sql.rs and store/groups.rs
//! record.rs   the domain types
//! references.rs  resource:// references checked with the resource service
//! search.rs   full-text search: queries, hits, snippets
//! retention.rs  retention policies and sweep reports (service/retention.rs: the sweeps)
//! transfer.rs export and import documents
//! ```

mod checks;
mod config;
mod error;
mod grpc;
mod recent;
mod record;
mod references;
mod retention;
mod search;
mod service;
mod store;
mod transfer;

pub use config::SessionConfig;
pub use error::SessionError;
pub use grpc::{SessionGrpc, grpc_server};
pub use recent::{DEFAULT_RECENT_PAGE_SIZE, MAX_RECENT_PAGE_SIZE, PREVIEW_CHARS, RecentPage, RecentRow, preview};
pub use record::{
    AgentState, AgentStateChange, Compaction, ContainerRecord, GroupCursor, GroupMemberRecord, GroupMessageRecord,
    GroupPage, GroupRecord, GroupUpdate, ImageRecord, ImageUpdate, MemberKind, MemberRef, MessageBody, MessageRecord,
    NewGroup, NewGroupMessage, NewImage, NewMessage, OpenTurn, PostedGroupMessage, SessionChange, ShareRecord,
    ShareRole, Truncated, UnreadGroup, Usage, WakeMode, WatchItem,
};
pub use references::References;
pub use retention::{
    CONVERSATIONS_PER_SWEEP, DEFAULT_RETENTION_INTERVAL, MAX_CONVERSATIONS_PER_CONTAINER, MAX_REPORTED_IMAGE_IDS,
    MAX_RETENTION_DAYS, MESSAGES_PER_SWEEP, MESSAGES_PER_TRANSACTION, RetentionPolicy, RetentionSweeps, StoredPolicy,
    SweepReport,
};
pub use search::{
    DEFAULT_SEARCH_PAGE_SIZE, MAX_QUERY_BYTES, MAX_QUERY_TERMS, MAX_SEARCH_OFFSET, MAX_SEARCH_PAGE_SIZE, SEARCH_ROLES,
    SearchHit, SearchPage, SearchRequest, SearchRow, Terms,
};
pub use service::{
    DEFAULT_GROUP_MESSAGE_LIMIT, DEFAULT_GROUP_PAGE_SIZE, DEFAULT_IMAGE_NAME, ExportStream, MAX_DESCRIPTION_CHARS,
    MAX_GROUP_MESSAGE_LIMIT, MAX_GROUP_PAGE_SIZE, MAX_ID_BYTES, MAX_INITIAL_MEMBERS, MAX_MCP_SERVERS_BYTES,
    MAX_MENTIONS, MAX_MESSAGE_BYTES, MAX_NAME_CHARS, MAX_SYSTEM_PROMPT_BYTES, SessionService,
};
pub use store::{GroupStore, PostgresSessionStore, Scope, SessionStore, SqliteSessionStore, SweepLock, open_store};
pub use transfer::{
    CONTAINER_FORMAT, CONVERSATION_FORMAT, DOCUMENT_VERSION, EXPORT_CHUNK_BYTES, Imported, MAX_IMPORT_BYTES,
    MAX_IMPORT_CONVERSATIONS,
};
