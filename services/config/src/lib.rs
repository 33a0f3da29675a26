//! The config service: the configuration tree AgentVM runs with, layered
//! from built-in defaults, the deployment (file, environment, flags), stored
//! system overrides and per-tenant overrides; secrets are write-only and
//! sealed at rest; changes stream to watchers. Served as `avm.config.v1`.
//!
//! ```text
//! grpc.rs     proto ⇄ domain, metadata → RequestContext, error → Status
//! service.rs  layering, validation, permissions, watch
//! schema.rs   every key of the tree: what it holds, who may change it, checks
//! cipher.rs   sealing of stored secrets
//! credentials.rs  MCP servers' credentials per user or tenant, sealed
//! secrets.rs  a tenant's secrets for its agents' sandboxes, sealed
//! store.rs    the ConfigStore trait; store/{sqlite,postgres}.rs behind it
//! ```

mod cipher;
mod config;
mod credentials;
mod error;
mod grpc;
pub mod schema;
mod secrets;
mod service;
mod store;

pub use cipher::{MIN_SECRET_KEY_CHARS, SecretCipher};
pub use config::ConfigServiceConfig;
pub use credentials::{CredentialInfo, CredentialScope, MAX_CREDENTIAL_HEADERS};
pub use error::ConfigError;
pub use grpc::{ConfigGrpc, grpc_server};
pub use secrets::{MAX_SECRET_BYTES, MAX_SECRETS};
pub use service::{
    ConfigChanged, ConfigService, Deployment, EntryView, MAX_VALUES_PER_UPDATE, Snapshot, Source, UpdateScope,
    WatchStream, WatchUpdate,
};
pub use store::{Change, ConfigStore, PostgresConfigStore, SYSTEM_SCOPE, SqliteConfigStore, StoredValue, open_store};
