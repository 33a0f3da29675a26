//! Identity shared by every component: who a caller is ([`Principal`]), the
//! access-token claims that carry it, the `[auth]` settings, the verifier every
//! gRPC service runs locally, and the service identity components use when
//! they act on their own.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ApiError;
use crate::config::Secret;

mod identity;
mod layer;
mod signing;
mod verifier;

pub use identity::ServiceIdentity;
pub use layer::{Authenticated, caller};
pub use signing::{SigningKey, StaticKeySource};
pub use verifier::{AuthKeySource, KeySource, TokenVerifier, Unready, parse_bearer, unready};

/// The audience of every access token AgentVM issues.
pub const AUDIENCE: &str = "agentvm";

/// The only signature algorithm of AgentVM's own tokens (RFC 8725: a fixed list).
pub const ALGORITHM: jsonwebtoken::Algorithm = jsonwebtoken::Algorithm::EdDSA;

/// Longest bearer token accepted; anything longer is refused unparsed.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// Prefix of every API key (`avm_<id>_<secret>`), which tells keys from JWTs.
pub const API_KEY_PREFIX: &str = "avm_";

/// Metadata naming the tenant a service principal acts for.
pub const ON_BEHALF_OF_HEADER: &str = "x-avm-tenant-id";

/// The user id of service principals.
pub const SERVICE_USER: &str = "service";

/// What a principal may do within its tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Manages the tenant's users and keys; sees all of its containers.
    Admin,
    /// Sees the containers it owns or that are shared with it.
    Member,
    /// An AgentVM component acting for any tenant.
    Service,
}

impl Role {
    /// Returns the role's name as it appears in tokens and the REST API.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Member => "member",
            Role::Service => "service",
        }
    }

    /// Parses a role name.
    pub fn parse(name: &str) -> Option<Role> {
        match name {
            "admin" => Some(Role::Admin),
            "member" => Some(Role::Member),
            "service" => Some(Role::Service),
            _ => None,
        }
    }

    /// Returns every scope this role may hold.
    pub fn allowed_scopes(self) -> Scopes {
        match self {
            Role::Admin | Role::Service => Scopes::ALL,
            Role::Member => Scopes::READ.union(Scopes::WRITE),
        }
    }
}

/// A set of scopes: `read` (look), `write` (create, change, talk), `admin`
/// (manage users, keys and tenants).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Scopes(u8);

impl Scopes {
    pub const NONE: Scopes = Scopes(0);
    pub const READ: Scopes = Scopes(1);
    pub const WRITE: Scopes = Scopes(2);
    pub const ADMIN: Scopes = Scopes(4);
    pub const ALL: Scopes = Scopes(7);
    const NAMES: [(&'static str, Scopes); 3] = [
        ("read", Scopes::READ),
        ("write", Scopes::WRITE),
        ("admin", Scopes::ADMIN),
    ];

    /// Returns the union of two sets.
    pub const fn union(self, other: Scopes) -> Scopes {
        Scopes(self.0 | other.0)
    }

    /// Returns whether every scope of `other` is in this set.
    pub const fn contains(self, other: Scopes) -> bool {
        self.0 & other.0 == other.0
    }

    /// Parses scope names; unknown names are an error naming them.
    pub fn parse<S: AsRef<str>>(names: &[S]) -> Result<Scopes, ApiError> {
        let mut scopes = Scopes::NONE;
        for name in names {
            let name = name.as_ref();
            let scope = Self::NAMES
                .iter()
                .find(|(known, _)| *known == name)
                .map(|(_, scope)| *scope)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "INVALID_SCOPE",
                        format!("unknown scope {name:?}; scopes are read, write and admin"),
                    )
                })?;
            scopes = scopes.union(scope);
        }
        Ok(scopes)
    }

    /// Returns the scope names, in a fixed order.
    pub fn names(self) -> Vec<String> {
        Self::NAMES
            .iter()
            .filter(|(_, scope)| self.contains(*scope))
            .map(|(name, _)| (*name).to_owned())
            .collect()
    }
}

/// Caps on use; zero means unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Requests per minute through the gateway.
    #[serde(default, rename = "rpm", skip_serializing_if = "is_zero_u32")]
    pub requests_per_minute: u32,
    /// LLM tokens (input + output) per calendar month (UTC).
    #[serde(default, rename = "tpm", skip_serializing_if = "is_zero_u64")]
    pub tokens_per_month: u64,
}

fn is_zero_u32(value: &u32) -> bool {
    *value == 0
}

fn is_zero_u64(value: &u64) -> bool {
    *value == 0
}

/// Who is calling: verified from an access token, never from a plain header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The tenant whose data the caller may touch.
    pub tenant_id: String,
    /// The user (or `service`).
    pub user_id: String,
    pub role: Role,
    /// Whether the caller is an admin of the operator tenant (manages every tenant).
    pub operator: bool,
    /// The API key the caller's token was made from.
    pub key_id: Option<String>,
    pub scopes: Scopes,
    pub tenant_limits: Limits,
    pub key_limits: Limits,
}

impl Principal {
    /// A service acting in `tenant_id`: every scope, no limits, not an
    /// operator, from no API key.
    pub fn service(tenant_id: impl Into<String>) -> Self {
        Self {
            tenant_id: tenant_id.into(),
            user_id: SERVICE_USER.to_owned(),
            role: Role::Service,
            operator: false,
            key_id: None,
            scopes: Scopes::ALL,
            tenant_limits: Limits::default(),
            key_limits: Limits::default(),
        }
    }

    /// Returns the user whose containers bound the caller's view: `None` when
    /// the caller sees the whole tenant (admins and services).
    pub fn container_owner_filter(&self) -> Option<&str> {
        match self.role {
            Role::Admin | Role::Service => None,
            Role::Member => Some(&self.user_id),
        }
    }

    /// Fails with PERMISSION_DENIED unless the caller holds `scope`.
    pub fn require(&self, scope: Scopes) -> Result<(), ApiError> {
        if self.scopes.contains(scope) {
            return Ok(());
        }
        let name = scope.names().join(", ");
        Err(ApiError::new(
            crate::Code::PermissionDenied,
            "MISSING_SCOPE",
            format!("this credential lacks the {name} scope"),
        ))
    }

    /// Fails with PERMISSION_DENIED unless the caller is an admin (or a service).
    pub fn require_admin(&self) -> Result<(), ApiError> {
        self.require(Scopes::ADMIN)?;
        match self.role {
            Role::Admin | Role::Service => Ok(()),
            Role::Member => Err(ApiError::new(
                crate::Code::PermissionDenied,
                "ADMIN_REQUIRED",
                "only an admin of the tenant may do this",
            )),
        }
    }

    /// Fails with PERMISSION_DENIED unless the caller is an operator (or a service).
    pub fn require_operator(&self) -> Result<(), ApiError> {
        self.require(Scopes::ADMIN)?;
        if self.operator || self.role == Role::Service {
            return Ok(());
        }
        Err(ApiError::new(
            crate::Code::PermissionDenied,
            "OPERATOR_REQUIRED",
            "only an operator may do this",
        ))
    }

    /// Fails with PERMISSION_DENIED unless the caller is a service principal.
    pub fn require_service(&self) -> Result<(), ApiError> {
        if self.role == Role::Service {
            return Ok(());
        }
        Err(ApiError::new(
            crate::Code::PermissionDenied,
            "SERVICE_REQUIRED",
            "only AgentVM components may call this",
        ))
    }
}

/// The claims of an AgentVM access token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub iss: String,
    pub aud: String,
    /// The user id.
    pub sub: String,
    /// The tenant id.
    pub tid: String,
    pub role: Role,
    /// Operator admin.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub op: bool,
    /// The API key the token was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub akid: Option<String>,
    /// Scope names.
    pub scp: Vec<String>,
    /// The tenant's limits, so the gateway enforces them with no lookup.
    #[serde(default)]
    pub tlim: Limits,
    /// The API key's limits.
    #[serde(default)]
    pub klim: Limits,
    pub iat: u64,
    pub nbf: u64,
    pub exp: u64,
    pub jti: String,
}

impl Claims {
    /// Returns the claims of a token for `principal`, valid from `now_s` for `ttl`.
    pub fn new(principal: &Principal, issuer: &str, now_s: u64, ttl: Duration) -> Claims {
        Claims {
            iss: issuer.to_owned(),
            aud: AUDIENCE.to_owned(),
            sub: principal.user_id.clone(),
            tid: principal.tenant_id.clone(),
            role: principal.role,
            op: principal.operator,
            akid: principal.key_id.clone(),
            scp: principal.scopes.names(),
            tlim: principal.tenant_limits,
            klim: principal.key_limits,
            iat: now_s,
            nbf: now_s,
            exp: now_s + ttl.as_secs().max(1),
            jti: crate::ids::new_id("tok"),
        }
    }

    /// Returns the principal the claims describe.
    pub fn principal(&self) -> Result<Principal, ApiError> {
        let scopes = Scopes::parse(&self.scp).map_err(|_| invalid_token())?;
        if self.tid.is_empty() || self.sub.is_empty() {
            return Err(invalid_token());
        }
        // The auth service makes operators only of admins: any other role
        // claiming it is a token it never made.
        if self.op && self.role != Role::Admin {
            return Err(invalid_token());
        }
        Ok(Principal {
            tenant_id: self.tid.clone(),
            user_id: self.sub.clone(),
            role: self.role,
            operator: self.op,
            key_id: self.akid.clone(),
            // A token never grants more than its role allows, whatever it claims.
            scopes: Scopes(scopes.0 & self.role.allowed_scopes().0),
            tenant_limits: self.tlim,
            key_limits: self.klim,
        })
    }
}

/// The error of a token that cannot be trusted, for whatever reason: the
/// reason is logged, never told to the caller.
pub fn invalid_token() -> ApiError {
    ApiError::new(
        crate::Code::Unauthenticated,
        "INVALID_TOKEN",
        "the access token is invalid",
    )
}

/// The error of a request without credentials.
pub fn missing_credentials() -> ApiError {
    ApiError::new(
        crate::Code::Unauthenticated,
        "UNAUTHENTICATED",
        "authentication required: send `authorization: Bearer <API key or access token>`",
    )
}

/// Authentication settings (`[auth]`, `AVM_AUTH_*`), read by every component.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// The credential AgentVM's components use among themselves: the same
    /// random value (32+ characters) on every component of a deployment.
    /// `avm serve` makes its own.
    pub service_key: Secret,
    /// The `iss` of access tokens.
    pub issuer: String,
    /// Lifetime of access tokens.
    #[serde(with = "humantime_serde")]
    pub token_ttl: Duration,
    /// Clock skew tolerated on `exp` and `nbf` (at most 5 minutes).
    #[serde(with = "humantime_serde")]
    pub leeway: Duration,
    /// A signing key older than this is replaced by a new one (the old one
    /// stays published until its tokens expire).
    #[serde(with = "humantime_serde")]
    pub key_rotation: Duration,
    /// `avm serve` only, on loopback only: requests without credentials act
    /// as the admin of a local `dev` tenant.
    pub dev: bool,
    /// Limits of tenants created without their own.
    pub default_requests_per_minute: u32,
    /// Monthly token quota of tenants created without their own (0: unlimited).
    pub default_tokens_per_month: u64,
    /// An external OIDC issuer whose tokens are accepted too.
    pub oidc: Option<OidcConfig>,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            service_key: Secret::default(),
            issuer: "agentvm".to_owned(),
            token_ttl: Duration::from_secs(600),
            leeway: Duration::from_secs(30),
            key_rotation: Duration::from_secs(30 * 24 * 3600),
            dev: false,
            default_requests_per_minute: 600,
            default_tokens_per_month: 0,
            oidc: None,
        }
    }
}

impl AuthConfig {
    /// Returns the leeway in whole seconds, bounded to 5 minutes.
    pub fn leeway_secs(&self) -> u64 {
        self.leeway.as_secs().min(300)
    }

    /// Returns the service key, or an error saying how to set one.
    pub fn require_service_key(&self) -> Result<&str, ApiError> {
        match self.service_key.expose() {
            Some(key) if key.len() >= 32 => Ok(key),
            Some(_) => Err(ApiError::invalid(
                "WEAK_SERVICE_KEY",
                "AVM_AUTH_SERVICE_KEY must be at least 32 characters (e.g. `openssl rand -hex 32`)",
            )),
            None => Err(ApiError::invalid(
                "MISSING_SERVICE_KEY",
                "AVM_AUTH_SERVICE_KEY is required: set the same random value (e.g. `openssl rand -hex 32`) on every component",
            )),
        }
    }
}

/// An external OpenID Connect issuer (`[auth.oidc]`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OidcConfig {
    /// The issuer URL, compared exactly with the tokens' `iss`.
    pub issuer: String,
    /// Where the issuer publishes its keys (JWKS).
    pub jwks_url: String,
    /// The `aud` the tokens must carry.
    pub audience: String,
    /// Accepted algorithms (RFC 8725: a fixed list); default `["RS256"]`.
    #[serde(default = "default_oidc_algorithms")]
    pub algorithms: Vec<String>,
    /// The claim naming the AgentVM tenant id.
    #[serde(default = "default_tenant_claim")]
    pub tenant_claim: String,
    /// The claim holding the role (`admin` or `member`); absent means member.
    #[serde(default = "default_role_claim")]
    pub role_claim: String,
}

fn default_oidc_algorithms() -> Vec<String> {
    vec!["RS256".to_owned()]
}

fn default_tenant_claim() -> String {
    "tenant_id".to_owned()
}

fn default_role_claim() -> String {
    "role".to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member() -> Principal {
        Principal {
            tenant_id: "ten_1".into(),
            user_id: "usr_1".into(),
            role: Role::Member,
            operator: false,
            key_id: Some("key_1".into()),
            scopes: Scopes::READ.union(Scopes::WRITE),
            tenant_limits: Limits {
                requests_per_minute: 60,
                tokens_per_month: 1000,
            },
            key_limits: Limits::default(),
        }
    }

    #[test]
    fn claims_round_trip_to_the_principal() {
        let principal = member();
        let claims = Claims::new(&principal, "agentvm", 1000, Duration::from_secs(60));
        assert_eq!(claims.exp, 1060);
        assert_eq!(claims.principal().ok(), Some(principal));
    }

    #[test]
    fn a_token_never_grants_more_than_its_role() {
        let mut claims = Claims::new(&member(), "agentvm", 0, Duration::from_secs(60));
        claims.scp = vec!["read".into(), "write".into(), "admin".into()];
        let principal = claims.principal().ok();
        assert_eq!(principal.map(|p| p.scopes), Some(Scopes::READ.union(Scopes::WRITE)));
    }

    #[test]
    fn scopes_parse_and_name() {
        let scopes = Scopes::parse(&["write", "read"]).ok();
        assert_eq!(
            scopes.map(Scopes::names),
            Some(vec!["read".to_owned(), "write".to_owned()])
        );
        assert!(Scopes::parse(&["root"]).is_err());
        assert!(member().require(Scopes::ADMIN).is_err());
        assert!(member().require_admin().is_err());
    }
}
