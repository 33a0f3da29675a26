//! The domain types: what the store keeps and the service hands out.

use avm_common::auth::{Limits, Principal, Role, Scopes};

/// A tenant: an isolated customer of AgentVM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantRecord {
    pub tenant_id: String,
    pub name: String,
    /// Admins of the operator tenant manage every tenant.
    pub operator: bool,
    pub limits: Limits,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// A person or program within a tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserRecord {
    pub user_id: String,
    pub tenant_id: String,
    pub name: String,
    /// `Admin` or `Member`; a service is never a user.
    pub role: Role,
    /// The `sub` of the external issuer for users provisioned from its tokens.
    pub external_subject: Option<String>,
    pub created_at_ms: i64,
}

/// An API key's metadata; its secret is never part of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiKeyRecord {
    pub key_id: String,
    pub tenant_id: String,
    pub user_id: String,
    pub name: String,
    /// The first characters of the full key, enough to recognise it.
    pub prefix: String,
    pub scopes: Scopes,
    /// The key's own limits; zero fields inherit the tenant's.
    pub limits: Limits,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
}

/// An API key about to be stored: its metadata and the hash of its secret.
#[derive(Clone)]
pub struct NewApiKey {
    pub key: ApiKeyRecord,
    /// Hex SHA-256 of the key's secret part.
    pub secret_hash: String,
}

impl std::fmt::Debug for NewApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The hash is as good as the key to an offline guesser; never print it.
        f.debug_struct("NewApiKey")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// What verifying an API key needs: the key, its secret's hash, its user and tenant.
#[derive(Clone)]
pub struct KeyCredential {
    pub key: ApiKeyRecord,
    pub secret_hash: String,
    pub user: UserRecord,
    pub tenant: TenantRecord,
}

impl std::fmt::Debug for KeyCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyCredential")
            .field("key", &self.key)
            .field("user", &self.user)
            .field("tenant", &self.tenant)
            .finish_non_exhaustive()
    }
}

/// A key that signs access tokens.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningKeyRecord {
    /// `sk_<16 hex>`, the `kid` of the tokens it signs.
    pub kid: String,
    /// The Ed25519 private key as stored: sealed (see [`crate::KeySeal`]);
    /// plain PKCS#8 DER only in rows written before keys were sealed, which
    /// the service seals when it starts.
    pub private_key: Vec<u8>,
    /// The public key as a JWK (JSON).
    pub public_jwk: String,
    pub created_at_ms: i64,
    pub retired_at_ms: Option<i64>,
}

impl std::fmt::Debug for SigningKeyRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKeyRecord")
            .field("kid", &self.kid)
            .field("created_at_ms", &self.created_at_ms)
            .field("retired_at_ms", &self.retired_at_ms)
            .finish_non_exhaustive()
    }
}

/// What a deleted id was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TombstoneKind {
    User,
    Tenant,
}

impl TombstoneKind {
    /// Returns the kind as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            TombstoneKind::User => "user",
            TombstoneKind::Tenant => "tenant",
        }
    }

    /// Parses a stored kind.
    pub fn parse(kind: &str) -> Option<TombstoneKind> {
        match kind {
            "user" => Some(TombstoneKind::User),
            "tenant" => Some(TombstoneKind::Tenant),
            _ => None,
        }
    }
}

/// The record of a deleted user or tenant, kept so late watchers learn of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tombstone {
    pub kind: TombstoneKind,
    pub id: String,
    pub at_ms: i64,
}

/// How far a caller reaches: `None` fields do not narrow.
///
/// Every lookup by id carries one, so an object out of reach is refused by
/// the same statement, with the same error, as a missing one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reach {
    /// Only objects of this tenant.
    pub tenant_id: Option<String>,
    /// Only this user, or the keys of this user.
    pub user_id: Option<String>,
}

impl Reach {
    /// Returns the reach of operators and services: everything.
    pub fn all() -> Reach {
        Reach::default()
    }

    /// Returns the reach of one tenant.
    pub fn tenant(tenant_id: &str) -> Reach {
        Reach {
            tenant_id: Some(tenant_id.to_owned()),
            user_id: None,
        }
    }

    /// Returns the reach of one user of one tenant.
    pub fn user(tenant_id: &str, user_id: &str) -> Reach {
        Reach {
            tenant_id: Some(tenant_id.to_owned()),
            user_id: Some(user_id.to_owned()),
        }
    }
}

/// The changes of `UpdateTenant`; `None` fields stay.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantUpdate {
    pub name: Option<String>,
    pub limits: Option<Limits>,
}

/// What a new API key should be.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApiKeySpec {
    /// The user the key acts as; the caller when `None`.
    pub user_id: Option<String>,
    /// `default` when empty.
    pub name: String,
    /// Scope names; everything allowed when empty.
    pub scopes: Vec<String>,
    pub expires_at_ms: Option<i64>,
    pub limits: Option<Limits>,
}

/// A newly created API key: its metadata and, this once, the full key.
#[derive(Clone)]
pub struct CreatedApiKey {
    pub api_key: ApiKeyRecord,
    /// The full key (`avm_<id>_<secret>`).
    pub secret: String,
}

impl std::fmt::Debug for CreatedApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CreatedApiKey")
            .field("api_key", &self.api_key)
            .finish_non_exhaustive()
    }
}

/// A newly created tenant with its first admin and that admin's key.
#[derive(Clone, Debug)]
pub struct CreatedTenant {
    pub tenant: TenantRecord,
    pub admin: UserRecord,
    pub api_key: CreatedApiKey,
}

/// A signed access token and who it speaks for.
#[derive(Clone)]
pub struct AccessToken {
    pub token: String,
    pub expires_at_ms: i64,
    pub principal: Principal,
}

impl std::fmt::Debug for AccessToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessToken")
            .field("expires_at_ms", &self.expires_at_ms)
            .field("principal", &self.principal)
            .finish_non_exhaustive()
    }
}

/// The tokens of one LLM call, as the runtime reports them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageReport {
    pub tenant_id: String,
    pub key_id: Option<String>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Makes a retried report count once.
    pub report_id: String,
}

/// One counter before and after a report, with its quota (0: unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterChange {
    pub before: u64,
    pub after: u64,
    pub quota: u64,
}

impl CounterChange {
    /// Returns whether this change used up the quota.
    pub fn exhausted_now(&self) -> bool {
        self.quota > 0 && self.before < self.quota && self.after >= self.quota
    }
}

/// What recording a report did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsageOutcome {
    /// False when the report id was seen before and nothing changed.
    pub counted: bool,
    pub tenant: CounterChange,
    /// The key's counter, when the report named a key.
    pub key: Option<CounterChange>,
}

/// An LLM call's estimated tokens, held against its tenant's and key's
/// monthly quotas while it is in flight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenReservation {
    pub tenant_id: String,
    pub key_id: Option<String>,
    /// The call's id; its usage report (`report_id`) settles the reservation.
    pub reservation_id: String,
    pub tokens: u64,
}

/// What a reservation found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReserveOutcome {
    /// The call may go ahead (its tokens are held when a quota applies).
    Reserved,
    /// The tenant's quota (`key_id` `None`) or the key's refuses: its use
    /// plus the calls in flight reached it, or (`used_up`) its use alone.
    Refused { quota: QuotaState, used_up: bool },
}

/// A tenant's token use in one month.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageRecord {
    /// `YYYY-MM` (UTC).
    pub month: String,
    pub tokens_used: u64,
    /// Zero means unlimited.
    pub tokens_per_month: u64,
}

/// Who ran out of (or got back) tokens, in which month.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QuotaState {
    pub tenant_id: String,
    pub key_id: Option<String>,
    /// `YYYY-MM` (UTC).
    pub month: String,
}
