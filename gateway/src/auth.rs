//! Who is calling: API keys are exchanged for access tokens at the auth
//! service and cached; AgentVM access tokens are verified locally; tokens of
//! the configured external OIDC issuer are exchanged and cached.
//!
//! A cached exchange is used until a third of the token's life is left, as
//! long as the auth event stream is live and says nothing against it; while
//! the stream is down it is used for at most a second, so a revoked key stops
//! working within that second either way.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use avm_common::auth::{
    API_KEY_PREFIX, Limits, MAX_TOKEN_BYTES, Principal, Role, Scopes, ServiceIdentity, TokenVerifier, Unready,
};
use avm_common::{ApiError, Code, RequestContext};
use avm_proto::auth::v1 as pb;
use avm_proto::auth::v1::AuthServiceHandle;
use sha2::{Digest, Sha256};

/// How long a cached exchange is trusted while the auth event stream is down.
const UNWATCHED_TTL: Duration = Duration::from_secs(1);

/// Most cached exchanges kept; beyond it the oldest half is dropped.
const MAX_CACHED: usize = 50_000;

/// A verified caller and the access token that speaks for it downstream.
#[derive(Clone, Debug)]
pub struct Caller {
    pub principal: Principal,
    pub token: Arc<str>,
}

impl Caller {
    /// Returns a request context for this caller.
    pub fn context(&self, request_id: String) -> RequestContext {
        RequestContext::new(self.principal.clone(), Some(Arc::clone(&self.token)), request_id)
    }
}

struct Cached {
    caller: Caller,
    fetched: Instant,
    fetched_ms: i64,
    renew_at: Instant,
}

/// Authenticates credentials presented at the edge; cheap to clone.
#[derive(Clone)]
pub struct Authenticator {
    verifier: TokenVerifier,
    auth: AuthServiceHandle,
    /// The gateway's own credential, which follows the auth events.
    identity: ServiceIdentity,
    /// Exchanges by SHA-256 of the credential, so the map never holds one.
    cache: Arc<Mutex<HashMap<[u8; 32], Cached>>>,
    /// Whether external (OIDC) tokens may be exchanged.
    external: bool,
    /// The credential used for requests that carry none (`--dev` on loopback only).
    anonymous: Option<Arc<str>>,
}

impl Authenticator {
    /// Returns the gateway's own service credential, for lookups a caller
    /// may not make itself (whether a user exists in the caller's tenant).
    pub fn identity(&self) -> &ServiceIdentity {
        &self.identity
    }

    /// Returns an authenticator verifying with `verifier` (which follows
    /// the auth events as `identity`) and exchanging at `identity`'s auth service.
    pub fn new(verifier: TokenVerifier, identity: ServiceIdentity, external: bool) -> Self {
        Self {
            verifier,
            auth: identity.auth().clone(),
            identity,
            cache: Arc::new(Mutex::new(HashMap::new())),
            external,
            anonymous: None,
        }
    }

    /// Lets requests without credentials act with `credential` (development only).
    pub fn with_anonymous(mut self, credential: String) -> Self {
        self.anonymous = Some(Arc::from(credential));
        self
    }

    /// Whether requests without credentials are let in (`--dev`).
    pub fn anonymous(&self) -> bool {
        self.anonymous.is_some()
    }

    /// Returns the verifier (revocations and quotas).
    pub fn verifier(&self) -> &TokenVerifier {
        &self.verifier
    }

    /// Authenticates an optional credential; none is UNAUTHENTICATED unless
    /// anonymous access is on.
    pub async fn authenticate(&self, credential: Option<&str>) -> Result<Caller, ApiError> {
        match credential.map(str::trim).filter(|c| !c.is_empty()) {
            Some(credential) => self.authenticate_credential(credential).await,
            None => match self.anonymous.clone() {
                Some(anonymous) => self.authenticate_credential(&anonymous).await,
                None => Err(avm_common::auth::missing_credentials()),
            },
        }
    }

    /// Re-checks a caller authenticated earlier (a long-lived WebSocket):
    /// fails once its credential is revoked or its token expired.
    pub fn still_valid(&self, caller: &Caller) -> Result<(), ApiError> {
        self.verifier.check_revoked(&caller.principal)
    }

    /// Resolves, with the reason, once `principal`'s key is revoked or its
    /// user or tenant deleted; until then it waits, waking only when such
    /// an event arrives. A stream that outlives its request ends on it.
    pub async fn revoked(&self, principal: &Principal) -> ApiError {
        let mut revocations = self.verifier.revocations();
        loop {
            if let Err(err) = self.verifier.check_revoked(principal) {
                return err;
            }
            if revocations.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Returns what keeps this gateway from authenticating soundly: the auth
    /// service refusing its service key, or the auth event stream (key
    /// revocations) not being live, each with a reason and why.
    pub fn unready(&self) -> Vec<Unready> {
        avm_common::auth::unready(&self.identity, &self.verifier)
    }

    async fn authenticate_credential(&self, credential: &str) -> Result<Caller, ApiError> {
        if credential.len() > MAX_TOKEN_BYTES {
            return Err(avm_common::auth::invalid_token());
        }
        if credential.starts_with(API_KEY_PREFIX) {
            return self.exchanged(credential, Exchange::ApiKey).await;
        }
        match self.verifier.verify(credential).await {
            Ok(principal) => Ok(Caller {
                principal,
                token: Arc::from(credential),
            }),
            Err(err) if self.external && err.reason == "INVALID_TOKEN" => {
                self.exchanged(credential, Exchange::External).await
            }
            Err(err) => Err(err),
        }
    }

    async fn exchanged(&self, credential: &str, kind: Exchange) -> Result<Caller, ApiError> {
        let digest: [u8; 32] = Sha256::digest(credential.as_bytes()).into();
        if let Some(caller) = self.cached(&digest) {
            return Ok(caller);
        }
        let (token, expires_at_ms, caller) = match kind {
            Exchange::ApiKey => {
                let request = tonic::Request::new(pb::ExchangeApiKeyRequest {
                    api_key: credential.to_owned(),
                });
                let response = self.auth.exchange_api_key(request).await?.into_inner();
                (response.access_token, response.expires_at_ms, response.caller)
            }
            Exchange::External => {
                let request = tonic::Request::new(pb::ExchangeExternalTokenRequest {
                    subject_token: credential.to_owned(),
                });
                let response = self.auth.exchange_external_token(request).await?.into_inner();
                (response.access_token, response.expires_at_ms, response.caller)
            }
        };
        let principal = principal_of(caller.unwrap_or_default())?;
        let caller = Caller {
            principal,
            token: Arc::from(token),
        };
        let life = Duration::from_millis(u64::try_from(expires_at_ms - avm_common::now_ms()).unwrap_or(0));
        let now = Instant::now();
        let mut cache = self.cache();
        if cache.len() >= MAX_CACHED {
            evict_oldest_half(&mut cache);
        }
        cache.insert(
            digest,
            Cached {
                caller: caller.clone(),
                fetched: now,
                fetched_ms: avm_common::now_ms(),
                renew_at: now + life * 2 / 3,
            },
        );
        Ok(caller)
    }

    fn cached(&self, digest: &[u8; 32]) -> Option<Caller> {
        let mut cache = self.cache();
        let entry = cache.get(digest)?;
        let fresh = Instant::now() < entry.renew_at
            && (self.verifier.is_watching() || entry.fetched.elapsed() < UNWATCHED_TTL)
            && self.verifier.check_revoked(&entry.caller.principal).is_ok()
            && !self
                .verifier
                .tenant_updated_since(&entry.caller.principal.tenant_id, entry.fetched_ms);
        if fresh {
            return Some(entry.caller.clone());
        }
        cache.remove(digest);
        None
    }

    fn cache(&self) -> MutexGuard<'_, HashMap<[u8; 32], Cached>> {
        self.cache.lock().unwrap_or_else(|poison| poison.into_inner())
    }
}

#[derive(Clone, Copy)]
enum Exchange {
    ApiKey,
    External,
}

fn evict_oldest_half(cache: &mut HashMap<[u8; 32], Cached>) {
    let mut ages: Vec<Instant> = cache.values().map(|entry| entry.fetched).collect();
    ages.sort_unstable();
    if let Some(cutoff) = ages.get(ages.len() / 2).copied() {
        cache.retain(|_, entry| entry.fetched > cutoff);
    }
}

/// Returns the principal an exchange answered with.
pub fn principal_of(caller: pb::Caller) -> Result<Principal, ApiError> {
    let role = match pb::Role::try_from(caller.role) {
        Ok(pb::Role::Admin) => Role::Admin,
        Ok(pb::Role::Member) => Role::Member,
        Ok(pb::Role::Service) => Role::Service,
        _ => return Err(ApiError::internal("auth service answered with an unknown role")),
    };
    Ok(Principal {
        tenant_id: caller.tenant_id,
        user_id: caller.user_id,
        role,
        operator: caller.operator,
        key_id: caller.key_id,
        scopes: Scopes::parse(&caller.scopes)
            .map_err(|_| ApiError::internal("auth service answered with unknown scopes"))?,
        tenant_limits: limits_of(caller.tenant_limits),
        key_limits: limits_of(caller.key_limits),
    })
}

fn limits_of(limits: Option<pb::Limits>) -> Limits {
    limits.map_or_else(Limits::default, |limits| Limits {
        requests_per_minute: limits.requests_per_minute,
        tokens_per_month: limits.tokens_per_month,
    })
}

/// Returns the error of a tenant or key over its monthly token quota.
pub fn quota_exceeded() -> ApiError {
    ApiError::new(
        Code::ResourceExhausted,
        "QUOTA_EXCEEDED",
        "the monthly token quota is used up; ask an operator to raise it",
    )
}
