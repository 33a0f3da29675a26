//! The resource service: versioned prompts, tools, sandboxes, agent
//! definitions and knowledge behind `resource://` URIs, with their
//! dependencies, stored in SQLite or Postgres and served as `avm.resource.v1`.
//!
//! ```text
//! grpc.rs     proto ⇄ domain, metadata → RequestContext, error → Status
//! service.rs  validation, ids, timestamps, permissions, logs
//! resolve.rs  requirement → exact version; a version's dependency closure
//! content.rs  the content schema of each kind
//! template.rs prompt rendering ({{variable}} placeholders)
//! uri.rs      resource:// URIs and resource names
//! version.rs  semantic versions and the requirements that pick them
//! store.rs    the ResourceStore trait; store/{sqlite,postgres}.rs behind it
//! record.rs   the domain types
//! ```

mod content;
mod error;
mod grpc;
mod kind;
mod record;
mod resolve;
mod service;
mod store;
mod template;
mod uri;
mod version;

pub use content::MAX_CONTENT_BYTES;
pub use error::ResourceError;
pub use grpc::{ResourceGrpc, grpc_server};
pub use kind::Kind;
pub use record::{
    Deleted, ListQuery, NewResource, NewVersion, Published, Resolution, ResourceDetail, ResourcePage, ResourceRecord,
    ResourceUpdate, VersionInfo, VersionRecord, Visibility,
};
pub use service::{
    DEFAULT_PAGE_SIZE, MAX_DEPENDENCIES, MAX_DESCRIPTION_CHARS, MAX_PAGE_SIZE, MAX_QUERY_CHARS, MAX_TAG_CHARS,
    MAX_TAGS, ResourceService,
};
pub use store::{ListFilter, PageKey, PostgresResourceStore, ResourceStore, SqliteResourceStore, open_store};
pub use template::MAX_VARIABLES_BYTES;
pub use uri::{MAX_NAME_CHARS, MAX_URI_BYTES, ResourceUri};
pub use version::VersionSpec;
