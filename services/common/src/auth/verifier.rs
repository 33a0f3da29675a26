//! Local verification of access tokens: signature against the auth service's
//! published keys (cached, refetched on an unknown `kid` at most once a
//! second, or at once after a rotation the auth service announced), claims
//! per RFC 8725 with a bounded lifetime (`exp - iat` at most the configured
//! token lifetime, `iat` not in the future), and the revocations and
//! exhausted quotas the auth service pushes over `WatchAuthEvents`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use avm_proto::auth::v1 as pb;
use avm_proto::auth::v1::AuthServiceHandle;
use http::HeaderMap;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{DecodingKey, Validation};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::{ALGORITHM, AUDIENCE, AuthConfig, Claims, MAX_TOKEN_BYTES, ON_BEHALF_OF_HEADER, Principal, Role};
use super::{ServiceIdentity, invalid_token, missing_credentials};
use crate::context::{RequestContext, request_id_from_headers};
use crate::{ApiError, Code};

/// Shortest time between two fetches of the verification keys, so tokens
/// with made-up `kid`s cannot turn into a flood of fetches.
const MIN_REFRESH_INTERVAL: Duration = Duration::from_secs(1);

/// Most tokens kept verified; past it, the expired ones go, and if that is
/// not enough, all of them.
const MAX_VERIFIED: usize = 4096;

/// Where verification keys come from.
#[async_trait]
pub trait KeySource: Send + Sync + 'static {
    /// Returns the current JWKS.
    async fn jwks(&self) -> Result<JwkSet, ApiError>;
}

/// Reads the keys from the auth service's `GetJwks`.
pub struct AuthKeySource {
    auth: AuthServiceHandle,
}

impl AuthKeySource {
    /// Returns a source reading from `auth`.
    pub fn new(auth: AuthServiceHandle) -> Self {
        Self { auth }
    }
}

#[async_trait]
impl KeySource for AuthKeySource {
    async fn jwks(&self) -> Result<JwkSet, ApiError> {
        let response = self.auth.get_jwks(tonic::Request::new(pb::GetJwksRequest {})).await?;
        serde_json::from_str(&response.into_inner().jwks_json)
            .map_err(|err| ApiError::internal(format!("auth service sent an unreadable jwks: {err}")))
    }
}

/// A token whose signature and claims were checked.
struct Verified {
    principal: Principal,
    /// Unix seconds: its `exp` and the leeway.
    valid_until: u64,
}

#[derive(Default)]
struct KeyCache {
    keys: HashMap<String, DecodingKey>,
    fetched: Option<Instant>,
}

/// What the auth service said must be refused or refreshed, with when.
#[derive(Default)]
struct AuthState {
    revoked_keys: HashMap<String, i64>,
    deleted_users: HashMap<String, i64>,
    deleted_tenants: HashMap<String, i64>,
    updated_tenants: HashMap<String, i64>,
    /// (tenant, key) → month of exhaustion ("YYYY-MM").
    exhausted: HashMap<(String, Option<String>), String>,
}

struct Inner {
    issuer: String,
    validation: Validation,
    /// How long a revocation matters: after this, every token it could refuse has expired.
    retention_ms: i64,
    /// The longest `exp - iat` accepted: the auth service's token lifetime
    /// (the same `[auth] token_ttl` on every component) and the leeway.
    max_lifetime_secs: u64,
    /// The clock skew tolerated on `iat`.
    leeway_secs: u64,
    source: Arc<dyn KeySource>,
    keys: RwLock<KeyCache>,
    refresh: tokio::sync::Mutex<()>,
    /// Counts key-set fetches, so callers that waited for one do not start another.
    fetches: std::sync::atomic::AtomicU64,
    state: RwLock<AuthState>,
    /// Tokens whose signature and claims were checked, by their SHA-256:
    /// the same token at each hop of a request, and at each request of a
    /// client, costs a lookup instead of a signature check. Revocations are
    /// still checked at every use; a new key set empties it.
    verified: RwLock<HashMap<[u8; 32], Verified>>,
    /// Whether the event stream is live (its snapshot received).
    watching: AtomicBool,
    /// Counts the revocations and deletions applied, so long-lived streams
    /// re-check their caller when one arrives rather than at their next event.
    revocations: tokio::sync::watch::Sender<u64>,
}

/// Verifies access tokens locally; cheap to clone.
#[derive(Clone)]
pub struct TokenVerifier {
    inner: Arc<Inner>,
}

impl TokenVerifier {
    /// Returns a verifier for tokens of `config.issuer`, with keys from `source`.
    pub fn new(config: &AuthConfig, source: Arc<dyn KeySource>) -> Self {
        let mut validation = Validation::new(ALGORITHM);
        validation.algorithms = vec![ALGORITHM];
        validation.leeway = config.leeway_secs();
        validation.validate_exp = true;
        validation.validate_nbf = true;
        validation.validate_aud = true;
        validation.set_audience(&[AUDIENCE]);
        validation.set_issuer(&[config.issuer.as_str()]);
        // Required, so a claim of the wrong type is an error rather than absent.
        validation.set_required_spec_claims(&["exp", "nbf", "iss", "aud", "sub"]);
        let retention = config.token_ttl + config.leeway + Duration::from_secs(60);
        Self {
            inner: Arc::new(Inner {
                issuer: config.issuer.clone(),
                validation,
                retention_ms: i64::try_from(retention.as_millis()).unwrap_or(i64::MAX),
                max_lifetime_secs: config.token_ttl.as_secs().saturating_add(config.leeway_secs()),
                leeway_secs: config.leeway_secs(),
                source,
                keys: RwLock::new(KeyCache::default()),
                refresh: tokio::sync::Mutex::new(()),
                fetches: std::sync::atomic::AtomicU64::new(0),
                state: RwLock::new(AuthState::default()),
                verified: RwLock::new(HashMap::new()),
                watching: AtomicBool::new(false),
                revocations: tokio::sync::watch::Sender::new(0),
            }),
        }
    }

    /// Returns the issuer whose tokens this verifier accepts.
    pub fn issuer(&self) -> &str {
        &self.inner.issuer
    }

    /// Verifies a token and returns the principal it speaks for.
    pub async fn verify(&self, token: &str) -> Result<Principal, ApiError> {
        if token.len() > MAX_TOKEN_BYTES {
            tracing::debug!(bytes = token.len(), "token refused: too long");
            return Err(invalid_token());
        }
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(principal) = self.recall(&digest) {
            self.check_revoked(&principal)?;
            return Ok(principal);
        }
        let header = jsonwebtoken::decode_header(token).map_err(|err| rejected("unreadable header", &err))?;
        if header.alg != ALGORITHM {
            tracing::debug!(alg = ?header.alg, "token refused: algorithm not allowed");
            return Err(invalid_token());
        }
        let Some(kid) = header.kid.filter(|kid| !kid.is_empty() && kid.len() <= 128) else {
            tracing::debug!("token refused: no kid");
            return Err(invalid_token());
        };
        let key = self.key(&kid).await?;
        let data = jsonwebtoken::decode::<Claims>(token, &key, &self.inner.validation).map_err(|err| {
            if matches!(err.kind(), ErrorKind::ExpiredSignature) {
                ApiError::new(Code::Unauthenticated, "TOKEN_EXPIRED", "the access token has expired")
            } else {
                rejected("invalid", &err)
            }
        })?;
        self.check_lifetime(&data.claims)?;
        let principal = data.claims.principal()?;
        self.check_revoked(&principal)?;
        self.remember(digest, &principal, data.claims.exp);
        Ok(principal)
    }

    /// Returns the principal of a token verified before, while the token
    /// has not expired (with the leeway the full check allows).
    fn recall(&self, digest: &[u8; 32]) -> Option<Principal> {
        let verified = self.inner.verified.read().unwrap_or_else(|poison| poison.into_inner());
        let entry = verified.get(digest)?;
        let now = u64::try_from(crate::now_ms() / 1000).unwrap_or(u64::MAX);
        (now <= entry.valid_until).then(|| entry.principal.clone())
    }

    fn remember(&self, digest: [u8; 32], principal: &Principal, exp: u64) {
        let mut verified = self.verified_mut();
        if verified.len() >= MAX_VERIFIED {
            let now = u64::try_from(crate::now_ms() / 1000).unwrap_or(u64::MAX);
            verified.retain(|_, entry| now <= entry.valid_until);
            if verified.len() >= MAX_VERIFIED {
                verified.clear();
            }
        }
        let entry = Verified {
            principal: principal.clone(),
            valid_until: exp.saturating_add(self.inner.leeway_secs),
        };
        verified.insert(digest, entry);
    }

    fn verified_mut(&self) -> RwLockWriteGuard<'_, HashMap<[u8; 32], Verified>> {
        self.inner.verified.write().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Refuses a token issued in the future or living longer than the auth
    /// service ever makes them: only a key that leaked could have signed it.
    fn check_lifetime(&self, claims: &Claims) -> Result<(), ApiError> {
        let now = u64::try_from(crate::now_ms() / 1000).unwrap_or(0);
        if claims.iat > now.saturating_add(self.inner.leeway_secs) {
            tracing::debug!(iat = claims.iat, "token refused: issued in the future");
            return Err(invalid_token());
        }
        if claims.exp.saturating_sub(claims.iat) > self.inner.max_lifetime_secs {
            tracing::debug!(
                lifetime_secs = claims.exp.saturating_sub(claims.iat),
                max_secs = self.inner.max_lifetime_secs,
                "token refused: lives longer than any token the auth service makes"
            );
            return Err(invalid_token());
        }
        Ok(())
    }

    /// Reads the caller of a gRPC call from its `authorization` header
    /// (see [`super::Authenticated`], which asks this once per call).
    ///
    /// A service principal acts for the tenant named in `x-avm-tenant-id`; the
    /// header means nothing coming from anyone else.
    pub async fn context_of(&self, headers: &HeaderMap) -> Result<RequestContext, ApiError> {
        let token = bearer(headers)?;
        let mut principal = self.verify(token).await?;
        if principal.role == Role::Service
            && let Some(tenant) = headers
                .get(ON_BEHALF_OF_HEADER)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty() && v.len() <= 128)
        {
            tenant.clone_into(&mut principal.tenant_id);
        }
        let trace = crate::trace::TraceParent::from_headers(headers).unwrap_or_else(crate::trace::TraceParent::root);
        Ok(RequestContext::new(principal, Some(Arc::from(token)), request_id_from_headers(headers)).with_trace(trace))
    }

    /// Fails when the principal's key, user or tenant was revoked or deleted.
    pub fn check_revoked(&self, principal: &Principal) -> Result<(), ApiError> {
        let state = self.state();
        let revoked = principal
            .key_id
            .as_ref()
            .is_some_and(|key| state.revoked_keys.contains_key(key))
            || state.deleted_users.contains_key(&principal.user_id)
            || (principal.role != Role::Service && state.deleted_tenants.contains_key(&principal.tenant_id));
        if revoked {
            return Err(ApiError::new(
                Code::Unauthenticated,
                "CREDENTIAL_REVOKED",
                "the credential was revoked",
            ));
        }
        Ok(())
    }

    /// Returns whether the principal's tenant or key used up this month's tokens.
    pub fn quota_exhausted(&self, principal: &Principal) -> bool {
        let month = crate::calendar::month_of(crate::now_ms());
        let state = self.state();
        let tenant = (principal.tenant_id.clone(), None);
        let key = principal
            .key_id
            .clone()
            .map(|key| (principal.tenant_id.clone(), Some(key)));
        [Some(tenant), key]
            .into_iter()
            .flatten()
            .any(|entry| state.exhausted.get(&entry).is_some_and(|m| *m == month))
    }

    /// Returns whether the tenant's settings changed after `since_ms`.
    pub fn tenant_updated_since(&self, tenant_id: &str, since_ms: i64) -> bool {
        self.state()
            .updated_tenants
            .get(tenant_id)
            .is_some_and(|at| *at >= since_ms)
    }

    /// Returns a receiver that changes whenever a key is revoked or a user or
    /// tenant deleted: the moment to re-check long-lived callers with
    /// [`TokenVerifier::check_revoked`].
    pub fn revocations(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.revocations.subscribe()
    }

    /// Returns whether the auth event stream is live; while it is not,
    /// revocations may be missed and callers should re-check credentials often.
    pub fn is_watching(&self) -> bool {
        self.inner.watching.load(Ordering::Acquire)
    }

    /// Records one auth event.
    pub fn apply(&self, event: &pb::AuthEvent) {
        use pb::auth_event::Kind;
        self.record(event);
        if matches!(
            event.kind,
            Some(Kind::KeyRevoked(_) | Kind::UserDeleted(_) | Kind::TenantDeleted(_))
        ) {
            self.inner
                .revocations
                .send_modify(|count| *count = count.wrapping_add(1));
        }
    }

    fn record(&self, event: &pb::AuthEvent) {
        use pb::auth_event::Kind;
        let at = event.at_ms;
        let mut state = self.state_mut();
        match &event.kind {
            Some(Kind::KeyRevoked(id)) => {
                state.revoked_keys.insert(id.clone(), at);
            }
            Some(Kind::UserDeleted(id)) => {
                state.deleted_users.insert(id.clone(), at);
            }
            Some(Kind::TenantDeleted(id)) => {
                state.deleted_tenants.insert(id.clone(), at);
            }
            Some(Kind::TenantUpdated(id)) => {
                state.updated_tenants.insert(id.clone(), at);
            }
            Some(Kind::QuotaExhausted(quota)) => {
                state
                    .exhausted
                    .insert((quota.tenant_id.clone(), quota.key_id.clone()), quota.month.clone());
            }
            Some(Kind::QuotaRestored(quota)) => {
                state.exhausted.remove(&(quota.tenant_id.clone(), quota.key_id.clone()));
            }
            Some(Kind::SigningKeyRotated(kid)) => {
                // The first token signed with the new key fetches the keys
                // at once instead of waiting out the fetch interval.
                let mut keys = self.keys_mut();
                if !keys.keys.contains_key(kid) {
                    keys.fetched = None;
                }
            }
            None => {}
        }
        let horizon = crate::now_ms().saturating_sub(self.inner.retention_ms);
        let state = &mut *state;
        for map in [
            &mut state.revoked_keys,
            &mut state.deleted_users,
            &mut state.deleted_tenants,
            &mut state.updated_tenants,
        ] {
            map.retain(|_, at| *at >= horizon);
        }
    }

    /// Marks the event stream live or not.
    pub fn set_watching(&self, watching: bool) {
        self.inner.watching.store(watching, Ordering::Release);
    }

    /// Follows the auth service's event stream until `shutdown`, reconnecting
    /// with backoff; the stream needs a service principal.
    pub fn spawn_watch(&self, identity: ServiceIdentity, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let verifier = self.clone();
        tokio::spawn(async move {
            let mut backoff = crate::backoff::Backoff::default();
            loop {
                let result = tokio::select! {
                    () = shutdown.cancelled() => break,
                    result = verifier.watch_once(&identity) => result,
                };
                verifier.set_watching(false);
                match result {
                    Ok(()) => backoff.reset(),
                    Err(err) => {
                        tracing::warn!(reason = %err.reason, error = %err, "auth event stream broken; reconnecting");
                    }
                }
                if !backoff.wait(&shutdown).await {
                    break;
                }
            }
        })
    }

    async fn watch_once(&self, identity: &ServiceIdentity) -> Result<(), ApiError> {
        let ctx = identity.own_context().await?;
        let mut stream = identity
            .auth()
            .watch_auth_events(ctx.request(pb::WatchAuthEventsRequest {}))
            .await?
            .into_inner();
        while let Some(item) = futures::StreamExt::next(&mut stream).await.transpose()? {
            if let Some(event) = &item.event {
                self.apply(event);
            }
            if item.snapshot_complete {
                self.set_watching(true);
                tracing::debug!("auth event stream live");
            }
        }
        Ok(())
    }

    /// Returns the key `kid`, fetching the key set when it is unknown.
    async fn key(&self, kid: &str) -> Result<DecodingKey, ApiError> {
        if let Some(key) = self.keys().keys.get(kid) {
            return Ok(key.clone());
        }
        // One fetch at a time; whoever waited finds the fresh set, and a key
        // still unknown after a fetch that began while it waited is refused
        // without another (a burst of made-up kids costs one fetch).
        let fetches_before = self.inner.fetches.load(Ordering::Acquire);
        let _guard = self.inner.refresh.lock().await;
        let since_fetch = {
            let cache = self.keys();
            if let Some(key) = cache.keys.get(kid) {
                return Ok(key.clone());
            }
            if self.inner.fetches.load(Ordering::Acquire) != fetches_before {
                tracing::debug!(kid, "token refused: unknown kid");
                return Err(invalid_token());
            }
            cache.fetched.map(|at| at.elapsed())
        };
        // Fetches stay at most one a second; a kid made by a rotation just
        // after the last fetch waits for the next one instead of failing.
        if let Some(elapsed) = since_fetch.filter(|elapsed| *elapsed < MIN_REFRESH_INTERVAL) {
            tokio::time::sleep(MIN_REFRESH_INTERVAL - elapsed).await;
        }
        let jwks = self.inner.source.jwks().await.map_err(|err| {
            tracing::warn!(error = %err, "cannot fetch the verification keys");
            ApiError::unavailable("AUTH_UNAVAILABLE", "cannot verify credentials right now")
        })?;
        let mut keys = HashMap::new();
        for jwk in &jwks.keys {
            let Some(id) = jwk.common.key_id.clone() else { continue };
            match DecodingKey::from_jwk(jwk) {
                Ok(key) => {
                    keys.insert(id, key);
                }
                Err(err) => tracing::warn!(kid = %id, error = %err, "unusable verification key skipped"),
            }
        }
        let mut cache = self.keys_mut();
        cache.keys = keys;
        cache.fetched = Some(Instant::now());
        // A key no longer published signs nothing any more, even what it
        // signed before.
        self.verified_mut().clear();
        self.inner.fetches.fetch_add(1, Ordering::Release);
        cache.keys.get(kid).cloned().ok_or_else(|| {
            tracing::debug!(kid, "token refused: unknown kid");
            invalid_token()
        })
    }

    fn keys(&self) -> RwLockReadGuard<'_, KeyCache> {
        self.inner.keys.read().unwrap_or_else(|poison| poison.into_inner())
    }

    fn keys_mut(&self) -> RwLockWriteGuard<'_, KeyCache> {
        self.inner.keys.write().unwrap_or_else(|poison| poison.into_inner())
    }

    fn state(&self) -> RwLockReadGuard<'_, AuthState> {
        self.inner.state.read().unwrap_or_else(|poison| poison.into_inner())
    }

    fn state_mut(&self) -> RwLockWriteGuard<'_, AuthState> {
        self.inner.state.write().unwrap_or_else(|poison| poison.into_inner())
    }
}

fn rejected(why: &'static str, err: &jsonwebtoken::errors::Error) -> ApiError {
    tracing::debug!(why, error = ?err.kind(), "token refused");
    invalid_token()
}

/// Returns the bearer token of a call's headers.
fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let value = headers
        .get(http::header::AUTHORIZATION)
        .ok_or_else(missing_credentials)?
        .to_str()
        .map_err(|_| invalid_token())?;
    parse_bearer(value).ok_or_else(invalid_token)
}

/// Returns the token of an `Authorization: Bearer <token>` value.
pub fn parse_bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// A dependency a component cannot work soundly without, and why it fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unready {
    /// What fails, as readiness names it.
    pub dependency: &'static str,
    /// A stable reason.
    pub reason: &'static str,
    pub message: &'static str,
}

/// Returns what keeps a component holding `identity` and following auth
/// events with `verifier` from being ready: the auth service refusing its
/// service key (nothing it does on its own account works), or the auth event
/// stream not being live (revoked keys would keep working here).
pub fn unready(identity: &ServiceIdentity, verifier: &TokenVerifier) -> Vec<Unready> {
    let mut unready = Vec::new();
    if identity.is_refused() {
        unready.push(Unready {
            dependency: "auth.credentials",
            reason: "SERVICE_KEY_REFUSED",
            message: "the auth service refuses this component's service key (AVM_AUTH_SERVICE_KEY)",
        });
    }
    if !verifier.is_watching() {
        unready.push(Unready {
            dependency: "auth.events",
            reason: "AUTH_EVENTS_DOWN",
            message: "the auth event stream is not live: revoked keys would not be refused",
        });
    }
    unready
}

#[cfg(test)]
mod tests {
    //! Token parsing and verification under arbitrary input: nothing but the
    //! token as signed is accepted, and every refusal is `INVALID_TOKEN`.

    use std::sync::LazyLock;

    use base64::Engine as _;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use jsonwebtoken::jwk::JwkSet;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    use super::*;
    use crate::auth::{Claims, Limits, Scopes, SigningKey};

    /// A verifier, the key it trusts and a token that key signed.
    struct Fixture {
        verifier: TokenVerifier,
        kid: String,
        token: String,
    }

    static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| {
        let Ok(key) = SigningKey::generate() else {
            panic!("a signing key must generate")
        };
        // Long-lived, so a slow run does not see it expire.
        let config = AuthConfig {
            token_ttl: Duration::from_secs(24 * 3600),
            ..AuthConfig::default()
        };
        let jwks = JwkSet {
            keys: vec![key.public_jwk().clone()],
        };
        let verifier = TokenVerifier::new(&config, Arc::new(crate::auth::StaticKeySource(jwks)));
        let principal = Principal {
            tenant_id: "ten_1".into(),
            user_id: "usr_1".into(),
            role: Role::Admin,
            operator: true,
            key_id: Some("key_1".into()),
            scopes: Scopes::ALL,
            tenant_limits: Limits::default(),
            key_limits: Limits::default(),
        };
        let now = u64::try_from(crate::now_ms() / 1000).unwrap_or_default();
        let claims = Claims::new(&principal, &config.issuer, now, config.token_ttl);
        let Ok(token) = key.sign(&claims) else {
            panic!("a token must sign")
        };
        Fixture {
            verifier,
            kid: key.kid().to_owned(),
            token,
        }
    });

    /// Verifies `token` with the fixture's verifier.
    fn verify(token: &str) -> Result<Principal, ApiError> {
        let verifier = &FIXTURE.verifier;
        // An unknown `kid` makes the verifier fetch the keys, at most once a
        // second; a rotation notice lets the next fetch happen at once, so
        // made-up kids cost no waiting here.
        verifier.apply(&pb::AuthEvent {
            at_ms: crate::now_ms(),
            kind: Some(pb::auth_event::Kind::SigningKeyRotated("sk_rotated".into())),
        });
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build();
        let Ok(runtime) = runtime else {
            return Err(ApiError::internal("no runtime"));
        };
        runtime.block_on(verifier.verify(token))
    }

    /// Fails the case unless `token` is refused as an invalid token, without echoing it.
    fn assert_refused(token: &str) -> Result<(), TestCaseError> {
        match verify(token) {
            Ok(principal) => Err(TestCaseError::fail(format!("{token:?} was accepted as {principal:?}"))),
            Err(err) => {
                prop_assert_eq!(err.code, Code::Unauthenticated, "{:?}", err);
                prop_assert_eq!(err.reason.as_ref(), "INVALID_TOKEN");
                prop_assert!(token.len() < 8 || !err.message.contains(token));
                Ok(())
            }
        }
    }

    fn segment(value: &serde_json::Value) -> String {
        URL_SAFE_NO_PAD.encode(value.to_string())
    }

    /// Arbitrary JSON with the claim names tokens carry.
    fn claims_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            any::<String>().prop_map(serde_json::Value::from),
            Just(serde_json::Value::from("agentvm")),
        ];
        let key = prop::sample::select(vec![
            "iss", "aud", "sub", "tid", "role", "op", "akid", "scp", "tlim", "klim", "exp", "nbf", "iat", "alg", "kid",
            "typ", "jku", "x5u",
        ]);
        let value = leaf.prop_recursive(3, 16, 4, |inner| {
            prop::collection::vec(inner, 0..4).prop_map(serde_json::Value::Array)
        });
        prop::collection::btree_map(key.prop_map(str::to_owned), value, 0..10)
            .prop_map(|map| serde_json::Value::Object(map.into_iter().collect()))
    }

    #[test]
    fn the_signed_token_itself_is_accepted() {
        assert!(verify(&FIXTURE.token).is_ok());
    }

    /// A new signing key, and a verifier with the default settings that
    /// trusts only that key.
    fn own_key() -> (SigningKey, AuthConfig, TokenVerifier) {
        let Ok(key) = SigningKey::generate() else {
            panic!("a signing key must generate")
        };
        let config = AuthConfig::default();
        let jwks = JwkSet {
            keys: vec![key.public_jwk().clone()],
        };
        let verifier = TokenVerifier::new(&config, Arc::new(crate::auth::StaticKeySource(jwks)));
        (key, config, verifier)
    }

    /// An admin (not an operator) of `ten_1`, through the API key `key_1`.
    fn admin() -> Principal {
        Principal {
            tenant_id: "ten_1".into(),
            user_id: "usr_1".into(),
            role: Role::Admin,
            operator: false,
            key_id: Some("key_1".into()),
            scopes: Scopes::ALL,
            tenant_limits: Limits::default(),
            key_limits: Limits::default(),
        }
    }

    /// A token verified once is taken from memory afterwards, but its key's
    /// revocation refuses it at once, and an entry past its token's expiry
    /// is never used.
    #[tokio::test]
    async fn a_remembered_token_is_still_refused_once_revoked_or_expired() {
        let (key, config, verifier) = own_key();
        let principal = admin();
        let now = u64::try_from(crate::now_ms() / 1000).unwrap_or_default();
        let Ok(token) = key.sign(&Claims::new(&principal, &config.issuer, now, config.token_ttl)) else {
            panic!("a token must sign")
        };
        assert_eq!(verifier.verify(&token).await.ok(), Some(principal.clone()));
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        assert_eq!(verifier.recall(&digest), Some(principal.clone()), "remembered");
        assert_eq!(verifier.verify(&token).await.ok(), Some(principal.clone()));
        // An entry whose token expired is not used (the full check then
        // answers, here for a token that is in fact still valid).
        verifier.remember(digest, &principal, now.saturating_sub(config.leeway_secs() + 1));
        assert_eq!(verifier.recall(&digest), None);
        assert!(verifier.verify(&token).await.is_ok());
        verifier.apply(&pb::AuthEvent {
            at_ms: crate::now_ms(),
            kind: Some(pb::auth_event::Kind::KeyRevoked("key_1".into())),
        });
        let refused = verifier.verify(&token).await.err().map(|err| err.reason);
        assert_eq!(refused.as_deref(), Some("CREDENTIAL_REVOKED"));
    }

    /// The last character of a base64 segment carries spare bits; a token
    /// whose spare bits differ decodes to the same bytes, so it is the one
    /// change a signature alone would not catch.
    #[test]
    fn no_other_last_character_of_a_segment_is_accepted() {
        let token = &FIXTURE.token;
        let ends = token.match_indices('.').map(|(at, _)| at - 1).chain([token.len() - 1]);
        for at in ends {
            for with in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_".chars() {
                if token[at..=at].starts_with(with) {
                    continue;
                }
                let mut forged = token.clone();
                forged.replace_range(at..=at, with.encode_utf8(&mut [0; 4]));
                assert!(verify(&forged).is_err(), "{forged} was accepted");
            }
        }
    }

    /// Issue 26 item 15: a token signed with the real key is refused when it
    /// lives longer than the auth service makes tokens (a 10-year `exp`), was
    /// issued in the future, has no `iat`, or claims `op` for a role other
    /// than admin; the same claims within the rules are accepted.
    #[tokio::test]
    async fn a_correctly_signed_token_beyond_the_maximum_lifetime_is_refused() {
        let (key, config, verifier) = own_key();
        let principal = admin();
        let now = u64::try_from(crate::now_ms() / 1000).unwrap_or_default();
        let honest = Claims::new(&principal, &config.issuer, now, config.token_ttl);
        let sign = |claims: &serde_json::Value| {
            let mut header = jsonwebtoken::Header::new(ALGORITHM);
            header.kid = Some(key.kid().to_owned());
            let encoding = jsonwebtoken::EncodingKey::from_ed_der(key.pkcs8_der());
            jsonwebtoken::encode(&header, claims, &encoding).unwrap_or_default()
        };
        let with = |changes: serde_json::Value| {
            let mut claims = serde_json::to_value(&honest).unwrap_or_default();
            if let (Some(claims), Some(changes)) = (claims.as_object_mut(), changes.as_object()) {
                claims.extend(changes.clone());
            }
            claims
        };
        let ten_years = 10 * 365 * 24 * 3600;
        let at_the_limit = config.token_ttl.as_secs() + config.leeway_secs();
        assert_eq!(
            verifier.verify(&sign(&with(serde_json::json!({})))).await.ok(),
            Some(principal.clone())
        );
        assert!(
            verifier
                .verify(&sign(&with(serde_json::json!({"exp": now + at_the_limit}))))
                .await
                .is_ok(),
            "a lifetime up to the limit is accepted"
        );
        let mut without_iat = with(serde_json::json!({}));
        if let Some(claims) = without_iat.as_object_mut() {
            claims.remove("iat");
        }
        let mut operator_member = principal.clone();
        operator_member.role = Role::Member;
        let operator_member =
            serde_json::to_value(Claims::new(&operator_member, &config.issuer, now, config.token_ttl))
                .unwrap_or_default();
        let forged = [
            ("a 10-year exp", with(serde_json::json!({"exp": now + ten_years}))),
            (
                "a 10-year exp, op",
                with(serde_json::json!({"exp": now + ten_years, "op": true})),
            ),
            (
                "one second over the limit",
                with(serde_json::json!({"exp": now + at_the_limit + 1})),
            ),
            (
                "issued in the future",
                with(serde_json::json!({"iat": now + 3600, "nbf": now, "exp": now + 3900})),
            ),
            ("no iat", without_iat),
            (
                "op for a member",
                with(serde_json::json!({"op": true, "role": "member"})),
            ),
            ("op for a member, as minted", {
                let mut claims = operator_member;
                claims["op"] = serde_json::json!(true);
                claims
            }),
        ];
        for (what, claims) in forged {
            let refused = verifier.verify(&sign(&claims)).await;
            assert_eq!(
                refused.map_err(|err| err.reason.into_owned()),
                Err("INVALID_TOKEN".to_owned()),
                "{what}"
            );
        }
    }

    proptest! {
        #[test]
        fn bearer_values_parse_to_a_trimmed_token_or_nothing(value in any::<String>()) {
            if let Some(token) = parse_bearer(&value) {
                prop_assert!(!token.is_empty());
                prop_assert_eq!(token, token.trim());
                prop_assert!(value.trim()[..6].eq_ignore_ascii_case("bearer"));
                prop_assert!(value.contains(token));
            }
        }

        #[test]
        fn any_casing_of_bearer_carries_its_token(
            scheme in "[bB][eE][aA][rR][eE][rR]",
            token in "[!-~]{1,64}",
            pad in "[ \t]{0,3}",
        ) {
            let value = format!("{pad}{scheme} {pad}{token}{pad}");
            prop_assert_eq!(parse_bearer(&value), Some(token.as_str()));
            let basic = format!("Basic {token}");
            prop_assert_eq!(parse_bearer(&basic), None);
        }

        #[test]
        fn arbitrary_strings_are_refused(token in any::<String>()) {
            assert_refused(&token)?;
        }

        #[test]
        fn arbitrary_jwt_shapes_are_refused(
            header in claims_json(),
            known_kid in any::<bool>(),
            claims in claims_json(),
            signature in prop::collection::vec(any::<u8>(), 0..80),
        ) {
            let mut header = header;
            header["alg"] = serde_json::json!("EdDSA");
            if known_kid {
                header["kid"] = serde_json::json!(FIXTURE.kid);
            }
            let token = format!("{}.{}.{}", segment(&header), segment(&claims), URL_SAFE_NO_PAD.encode(signature));
            assert_refused(&token)?;
        }

        #[test]
        fn one_changed_character_anywhere_is_refused(at in any::<prop::sample::Index>(), with in any::<char>()) {
            let token = &FIXTURE.token;
            let at = at.index(token.len());
            let original = char::from(token.as_bytes()[at]);
            prop_assume!(original != with);
            let mut forged = token.clone();
            forged.replace_range(at..=at, with.encode_utf8(&mut [0; 4]));
            assert_refused(&forged)?;
        }

        #[test]
        fn one_changed_base64_character_anywhere_is_refused(at in any::<prop::sample::Index>(), with in "[A-Za-z0-9_-]") {
            let token = &FIXTURE.token;
            let at = at.index(token.len());
            prop_assume!(token.as_bytes()[at] != b'.' && token[at..=at] != *with);
            let mut forged = token.clone();
            forged.replace_range(at..=at, &with);
            assert_refused(&forged)?;
        }

        #[test]
        fn a_truncated_or_extended_token_is_refused(keep in any::<prop::sample::Index>(), tail in "[A-Za-z0-9_.-]{1,8}") {
            let token = &FIXTURE.token;
            assert_refused(&token[..keep.index(token.len())])?;
            assert_refused(&format!("{token}{tail}"))?;
        }

        #[test]
        fn reordered_or_repeated_segments_are_refused(order in prop::sample::select(vec![
            [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [0, 0, 2], [0, 1, 1], [1, 1, 2],
        ])) {
            let segments: Vec<&str> = FIXTURE.token.split('.').collect();
            prop_assert_eq!(segments.len(), 3);
            let forged = order.iter().map(|&i| segments[i]).collect::<Vec<_>>().join(".");
            assert_refused(&forged)?;
        }
    }
}
