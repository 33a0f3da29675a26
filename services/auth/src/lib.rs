//! The auth service: tenants, their users and API keys, the keys that sign
//! access tokens, monthly token usage, and the events verifiers act on,
//! stored in SQLite or Postgres and served as `avm.auth.v1`.
//!
//! ```text
//! grpc.rs     proto ⇄ domain, bearer token → RequestContext, error → Status
//! service.rs  who may do what, key and token minting, usage, logs
//! api_key.rs  the API key format, its hash and constant-time check
//! signing.rs  Ed25519 signing keys: current key, rotation, JWKS
//! seal.rs     the signing keys' private halves sealed at rest
//! events.rs   auth events and their feed (broadcast; NOTIFY/LISTEN on Postgres)
//! oidc.rs     tokens of an external OpenID Connect issuer
//! store.rs    the AuthStore trait; store/{sqlite,postgres}.rs behind it
//! record.rs   the domain types
//! ```

mod api_key;
mod error;
mod events;
mod grpc;
mod oidc;
mod record;
mod seal;
mod service;
mod signing;
mod store;

pub use error::AuthError;
pub use events::{AuthEvent, AuthEventKind, WatchItem};
pub use grpc::{AuthGrpc, grpc_server};
pub use record::{
    AccessToken, ApiKeyRecord, ApiKeySpec, CounterChange, CreatedApiKey, CreatedTenant, KeyCredential, NewApiKey,
    QuotaState, Reach, ReserveOutcome, SigningKeyRecord, TenantRecord, TenantUpdate, TokenReservation, Tombstone,
    TombstoneKind, UsageOutcome, UsageRecord, UsageReport, UserRecord,
};
pub use seal::{KeySeal, MIN_SEAL_KEY_CHARS};
pub use service::{AuthEventStream, AuthService, Bootstrap, MAX_ID_BYTES, MAX_NAME_CHARS, SERVICE_TENANT};
pub use store::{AuthStore, PostgresAuthStore, SqliteAuthStore, open_store};
