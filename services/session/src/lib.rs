//! The session service: a tenant's containers, the images (persisted
//! conversation definitions) inside them, the one session of each image and
//! its messages, stored in SQLite or Postgres and served as `avm.session.v1`.
//!
//! ```text
//! grpc.rs     proto ⇄ domain, metadata → RequestContext, error → Status
//! service.rs  validation, ids, timestamps, logs
//! store.rs    the SessionStore trait; store/{sqlite,postgres}.rs behind it
//! record.rs   the domain types
//! references.rs  resource:// references checked with the resource service
//! ```

mod error;
mod grpc;
mod record;
mod references;
mod service;
mod store;

pub use error::SessionError;
pub use grpc::{SessionGrpc, grpc_server};
pub use record::{
    ContainerRecord, ImageRecord, ImageUpdate, MessageBody, MessageRecord, NewImage, NewMessage, SessionChange,
    ShareRecord, Usage, WatchItem,
};
pub use references::References;
pub use service::{
    DEFAULT_IMAGE_NAME, MAX_DESCRIPTION_CHARS, MAX_ID_BYTES, MAX_MCP_SERVERS_BYTES, MAX_MESSAGE_BYTES, MAX_NAME_CHARS,
    MAX_SYSTEM_PROMPT_BYTES, SessionService,
};
pub use store::{PostgresSessionStore, Scope, SessionStore, SqliteSessionStore, open_store};
