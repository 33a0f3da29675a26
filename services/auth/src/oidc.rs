//! Tokens of an external OpenID Connect issuer: its keys fetched from its
//! JWKS url (cached, refetched on an unknown `kid` at most once a second),
//! claims checked per RFC 8725 with exactly the configured algorithms.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use avm_common::auth::{MAX_TOKEN_BYTES, OidcConfig, Role};
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};

use crate::error::AuthError;

/// Shortest time between two fetches of the issuer's keys, so tokens with
/// made-up `kid`s cannot turn into a flood of fetches.
const MIN_REFETCH_INTERVAL: Duration = Duration::from_secs(1);
/// Keys older than this are refetched, so a key the issuer withdrew stops working.
const MAX_KEY_AGE: Duration = Duration::from_secs(600);
/// Time allowed for one fetch of the issuer's keys.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest JWKS document accepted.
const MAX_JWKS_BYTES: usize = 1024 * 1024;
/// Longest user name kept from the issuer's claims, in characters.
const MAX_NAME_CHARS: usize = 128;

/// Who a valid external token speaks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ExternalIdentity {
    pub subject: String,
    pub tenant_id: String,
    pub role: Role,
    pub name: String,
}

#[derive(Default)]
struct KeyCache {
    /// Keys by `kid`.
    keys: HashMap<String, DecodingKey>,
    /// Keys published without a `kid`, tried for tokens without one.
    unnamed: Vec<DecodingKey>,
    fetched: Option<Instant>,
}

/// The configured external issuer.
pub(crate) struct ExternalIssuer {
    config: OidcConfig,
    algorithms: Vec<Algorithm>,
    validation: Validation,
    http: reqwest::Client,
    keys: RwLock<KeyCache>,
    refresh: tokio::sync::Mutex<()>,
}

impl ExternalIssuer {
    /// Returns the issuer of `config`, refusing `none`, HMAC (a shared secret
    /// is not a public key) and unknown algorithms.
    pub(crate) fn new(config: &OidcConfig, leeway_secs: u64) -> Result<Self, AuthError> {
        if config.issuer.is_empty() || config.audience.is_empty() || config.jwks_url.is_empty() {
            return Err(AuthError::invalid(
                "INVALID_OIDC_CONFIG",
                "[auth.oidc] needs issuer, jwks_url and audience",
            ));
        }
        let mut algorithms = Vec::new();
        for name in &config.algorithms {
            let algorithm = Algorithm::from_str(name)
                .ok()
                .filter(|alg| !matches!(alg, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512))
                .ok_or_else(|| {
                    AuthError::invalid(
                        "OIDC_ALGORITHM_NOT_ALLOWED",
                        format!("[auth.oidc] algorithm {name:?} is not allowed; use RS*, PS*, ES* or EdDSA"),
                    )
                })?;
            algorithms.push(algorithm);
        }
        let Some(first) = algorithms.first().copied() else {
            return Err(AuthError::invalid(
                "OIDC_ALGORITHM_NOT_ALLOWED",
                "[auth.oidc] algorithms must name at least one algorithm",
            ));
        };
        let mut validation = Validation::new(first);
        validation.leeway = leeway_secs;
        validation.validate_exp = true;
        validation.validate_nbf = true;
        validation.validate_aud = true;
        validation.set_issuer(&[config.issuer.as_str()]);
        validation.set_audience(&[config.audience.as_str()]);
        // Many issuers (Google, Auth0) send no `nbf`; it is checked when present.
        // jsonwebtoken ≥ 10.3 refuses a present but malformed one (CVE-2026-25537).
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        let http = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .build()
            .map_err(|err| AuthError::invalid("INVALID_OIDC_CONFIG", format!("cannot build http client: {err}")))?;
        Ok(Self {
            config: config.clone(),
            algorithms,
            validation,
            http,
            keys: RwLock::new(KeyCache::default()),
            refresh: tokio::sync::Mutex::new(()),
        })
    }

    /// Verifies a token of the issuer and returns who it speaks for.
    pub(crate) async fn verify(&self, token: &str) -> Result<ExternalIdentity, AuthError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(refused("too long"));
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| refused("unreadable header"))?;
        if !self.algorithms.contains(&header.alg) {
            tracing::debug!(alg = ?header.alg, "external token refused: algorithm not allowed");
            return Err(AuthError::InvalidExternalToken);
        }
        // One algorithm per check: the library refuses a list spanning key families.
        let mut validation = self.validation.clone();
        validation.algorithms = vec![header.alg];
        let keys = self.keys_for(header.kid.as_deref()).await?;
        let mut last_error = None;
        for key in &keys {
            match jsonwebtoken::decode::<Map<String, Value>>(token, key, &validation) {
                Ok(data) => return self.identity(&data.claims),
                Err(err) => last_error = Some(err),
            }
        }
        tracing::debug!(error = ?last_error.map(|err| err.into_kind()), "external token refused");
        Err(AuthError::InvalidExternalToken)
    }

    fn identity(&self, claims: &Map<String, Value>) -> Result<ExternalIdentity, AuthError> {
        let text = |name: &str| claims.get(name).and_then(Value::as_str).filter(|v| !v.is_empty());
        let subject = text("sub")
            .filter(|s| s.len() <= 256)
            .ok_or_else(|| refused("bad sub"))?;
        let tenant_id = text(&self.config.tenant_claim)
            .filter(|t| t.len() <= 128)
            .ok_or_else(|| refused("no tenant claim"))?;
        let role = match claims.get(&self.config.role_claim) {
            None | Some(Value::Null) => Role::Member,
            Some(Value::String(role)) if role == "admin" => Role::Admin,
            Some(Value::String(role)) if role == "member" => Role::Member,
            Some(_) => return Err(refused("unknown role")),
        };
        let name = ["name", "preferred_username", "email"]
            .into_iter()
            .find_map(text)
            .unwrap_or(subject)
            .trim()
            .chars()
            .take(MAX_NAME_CHARS)
            .collect::<String>();
        Ok(ExternalIdentity {
            subject: subject.to_owned(),
            tenant_id: tenant_id.to_owned(),
            role,
            name: if name.is_empty() { subject.to_owned() } else { name },
        })
    }

    /// Returns the keys that may have signed a token with this `kid`.
    async fn keys_for(&self, kid: Option<&str>) -> Result<Vec<DecodingKey>, AuthError> {
        if let Some(keys) = self.cached(kid) {
            return Ok(keys);
        }
        let _guard = self.refresh.lock().await;
        if let Some(keys) = self.cached(kid) {
            return Ok(keys);
        }
        let recently = self
            .read_keys()
            .fetched
            .is_some_and(|at| at.elapsed() < MIN_REFETCH_INTERVAL);
        if !recently {
            self.fetch().await?;
        }
        self.cached(kid).ok_or_else(|| refused("unknown kid"))
    }

    /// Returns the cached keys for `kid` while the cache is young enough.
    fn cached(&self, kid: Option<&str>) -> Option<Vec<DecodingKey>> {
        let cache = self.read_keys();
        if cache.fetched.is_none_or(|at| at.elapsed() >= MAX_KEY_AGE) {
            return None;
        }
        match kid {
            Some(kid) => cache.keys.get(kid).map(|key| vec![key.clone()]),
            None if !cache.unnamed.is_empty() => Some(cache.unnamed.clone()),
            None => None,
        }
    }

    async fn fetch(&self) -> Result<(), AuthError> {
        let jwks = self.download().await.map_err(|err| {
            tracing::warn!(error = %err, "cannot fetch the external issuer's keys");
            AuthError::OidcUnavailable
        })?;
        let mut cache = KeyCache {
            fetched: Some(Instant::now()),
            ..KeyCache::default()
        };
        for jwk in &jwks.keys {
            match DecodingKey::from_jwk(jwk) {
                Ok(key) => match jwk.common.key_id.clone() {
                    Some(kid) => {
                        cache.keys.insert(kid, key);
                    }
                    None => cache.unnamed.push(key),
                },
                Err(err) => tracing::warn!(kid = ?jwk.common.key_id, error = %err, "unusable external key skipped"),
            }
        }
        tracing::debug!(
            keys = cache.keys.len() + cache.unnamed.len(),
            "external issuer keys fetched"
        );
        *self.keys.write().unwrap_or_else(|poison| poison.into_inner()) = cache;
        Ok(())
    }

    async fn download(&self) -> Result<JwkSet, String> {
        let response = self
            .http
            .get(&self.config.jwks_url)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|err| err.to_string())?;
        let body = response.bytes().await.map_err(|err| err.to_string())?;
        if body.len() > MAX_JWKS_BYTES {
            return Err(format!("jwks of {} bytes is too large", body.len()));
        }
        serde_json::from_slice(&body).map_err(|err| format!("unreadable jwks: {err}"))
    }

    fn read_keys(&self) -> std::sync::RwLockReadGuard<'_, KeyCache> {
        self.keys.read().unwrap_or_else(|poison| poison.into_inner())
    }
}

fn refused(why: &'static str) -> AuthError {
    tracing::debug!(why, "external token refused");
    AuthError::InvalidExternalToken
}
