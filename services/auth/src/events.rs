//! Auth events (revocations, deletions, tenant updates, quota changes,
//! signing-key rotations); they travel on the shared feed of
//! `avm_store::events`, which reaches every replica.

use serde::{Deserialize, Serialize};

use crate::record::QuotaState;

/// One thing verifiers must act on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuthEvent {
    /// When it happened (Unix ms).
    pub at_ms: i64,
    /// What happened.
    pub kind: AuthEventKind,
}

/// What happened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuthEventKind {
    /// Tokens made from this key, and the key itself, are refused.
    KeyRevoked(String),
    /// Tokens of this user are refused.
    UserDeleted(String),
    /// Tokens of this tenant are refused.
    TenantDeleted(String),
    /// The tenant's name or limits changed.
    TenantUpdated(String),
    /// The tenant (or key) used up its monthly tokens.
    QuotaExhausted(QuotaState),
    /// The tenant (or key) may use tokens again.
    QuotaRestored(QuotaState),
    /// Every replica signs with this new key (its kid) from now on.
    SigningKeyRotated(String),
}

impl AuthEventKind {
    /// Returns the kind's name, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            AuthEventKind::KeyRevoked(_) => "key_revoked",
            AuthEventKind::UserDeleted(_) => "user_deleted",
            AuthEventKind::TenantDeleted(_) => "tenant_deleted",
            AuthEventKind::TenantUpdated(_) => "tenant_updated",
            AuthEventKind::QuotaExhausted(_) => "quota_exhausted",
            AuthEventKind::QuotaRestored(_) => "quota_restored",
            AuthEventKind::SigningKeyRotated(_) => "signing_key_rotated",
        }
    }
}

/// One message of `WatchAuthEvents`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchItem {
    /// An event, of the snapshot or live.
    Event(AuthEvent),
    /// Everything before was the snapshot; live events follow.
    SnapshotComplete,
}
