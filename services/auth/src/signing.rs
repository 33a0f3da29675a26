//! The keys that sign access tokens: Ed25519, kept in the store (sealed, see
//! `seal.rs`) so every replica signs with the same current key and publishes
//! the same JWKS.
//!
//! Each replica keeps the current key in memory. A rotation (by an operator,
//! or because the key is due) is announced on the auth feed, which reaches
//! every replica: each drops its copy and reads the new key at its next
//! signature. While the feed is not live, the copy is trusted for a second
//! only.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use avm_common::auth::{AuthConfig, Claims, KeySource, SigningKey};
use avm_common::{ApiError, now_ms};
use avm_store::events::EventBus;
use futures::StreamExt;
use jsonwebtoken::jwk::{Jwk, JwkSet};
use tokio_util::sync::CancellationToken;

use crate::error::AuthError;
use crate::events::{AuthEvent, AuthEventKind};
use crate::record::SigningKeyRecord;
use crate::seal::{KeySeal, is_sealed};
use crate::store::AuthStore;

/// How long the current key is trusted from memory while rotations reach
/// this replica through the feed: a bound for a rotation whose announcement
/// was lost (its replica stopped between storing the key and announcing it).
pub(crate) const CURRENT_KEY_REFRESH: Duration = Duration::from_secs(60);

/// How long the current key is trusted from memory while the feed is not
/// live, so another replica's rotation is seen within it.
const UNFOLLOWED_KEY_REFRESH: Duration = Duration::from_secs(1);

/// How long the follower waits for the feed before trying again.
const FEED_READY_TIMEOUT: Duration = Duration::from_secs(5);

/// The key signing now, as read from the store.
struct ActiveKey {
    key: SigningKey,
    created_at_ms: i64,
    read_at: Instant,
}

/// Signs tokens with the current key, rotating it when it is old, and
/// publishes the keys that still verify live tokens.
pub(crate) struct SigningKeys {
    store: Arc<dyn AuthStore>,
    /// Seals the private halves the store keeps.
    seal: KeySeal,
    /// Where rotations are announced to every replica (this one included).
    events: Arc<EventBus<AuthEvent>>,
    rotation_ms: i64,
    /// How long a retired key stays published: its last tokens' life, the
    /// verifiers' leeway, and the time another replica may still sign with it
    /// from its cache.
    retired_window_ms: i64,
    current: RwLock<Option<Arc<ActiveKey>>>,
    refresh: tokio::sync::Mutex<()>,
    /// Bumped whenever the cached key is dropped, so a store read that raced
    /// with a rotation elsewhere is used once but not cached.
    epoch: AtomicU64,
    /// Whether rotations of other replicas reach this one now.
    following: AtomicBool,
}

impl SigningKeys {
    /// Returns the signing keys of `store`.
    pub(crate) fn new(
        store: Arc<dyn AuthStore>,
        seal: KeySeal,
        events: Arc<EventBus<AuthEvent>>,
        config: &AuthConfig,
    ) -> Self {
        let window = config.token_ttl + Duration::from_secs(config.leeway_secs()) + CURRENT_KEY_REFRESH;
        // In process (SQLite) this replica is the only one: it always follows.
        let following = !store.event_transport().shares_events();
        Self {
            store,
            seal,
            events,
            rotation_ms: millis(config.key_rotation),
            retired_window_ms: millis(window),
            current: RwLock::new(None),
            refresh: tokio::sync::Mutex::new(()),
            epoch: AtomicU64::new(0),
            following: AtomicBool::new(following),
        }
    }

    /// Signs `claims` with the current key.
    pub(crate) async fn sign(&self, claims: &Claims) -> Result<String, AuthError> {
        Ok(self.current().await?.key.sign(claims)?)
    }

    /// Returns the id of the current key, making or rotating it as needed.
    pub(crate) async fn current_kid(&self) -> Result<String, AuthError> {
        Ok(self.current().await?.key.kid().to_owned())
    }

    /// Starts signing with a new key and retires the others; returns its kid.
    pub(crate) async fn rotate(&self) -> Result<String, AuthError> {
        let _guard = self.refresh.lock().await;
        let key = self.insert_new().await?;
        let kid = key.key.kid().to_owned();
        *self.current.write().unwrap_or_else(|poison| poison.into_inner()) = Some(key);
        Ok(kid)
    }

    /// Returns the published keys: unretired ones, and retired ones whose
    /// tokens may still be alive.
    pub(crate) async fn jwks(&self) -> Result<JwkSet, AuthError> {
        let since = now_ms().saturating_sub(self.retired_window_ms);
        let keys = self
            .store
            .public_keys(since)
            .await?
            .iter()
            .map(|json| serde_json::from_str::<Jwk>(json))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| AuthError::corrupt(format!("stored public key: {err}")))?;
        Ok(JwkSet { keys })
    }

    async fn current(&self) -> Result<Arc<ActiveKey>, AuthError> {
        if let Some(key) = self.cached() {
            return Ok(key);
        }
        // One store read at a time; whoever waited finds the fresh key.
        let _guard = self.refresh.lock().await;
        if let Some(key) = self.cached() {
            return Ok(key);
        }
        let epoch = self.epoch.load(Ordering::SeqCst);
        let key = match self.store.current_signing_key().await? {
            Some(stored) if !self.is_due(stored.created_at_ms) => Arc::new(self.active(&stored)?),
            stored => {
                let key = self.insert_new().await?;
                tracing::info!(
                    kid = %key.key.kid(),
                    previous_kid = stored.as_ref().map(|s| s.kid.as_str()).unwrap_or("none"),
                    "signing key rotated"
                );
                key
            }
        };
        let mut current = self.current.write().unwrap_or_else(|poison| poison.into_inner());
        if self.epoch.load(Ordering::SeqCst) == epoch {
            *current = Some(Arc::clone(&key));
        }
        Ok(key)
    }

    /// Returns the cached key while it is fresh and not due for rotation.
    fn cached(&self) -> Option<Arc<ActiveKey>> {
        let trusted_for = if self.following.load(Ordering::Acquire) {
            CURRENT_KEY_REFRESH
        } else {
            UNFOLLOWED_KEY_REFRESH
        };
        let current = self.current.read().unwrap_or_else(|poison| poison.into_inner());
        current
            .as_ref()
            .filter(|key| key.read_at.elapsed() < trusted_for && !self.is_due(key.created_at_ms))
            .cloned()
    }

    /// Drops the cached key unless it is `kid` (this replica's own rotation).
    fn rotated(&self, kid: &str) {
        let mut current = self.current.write().unwrap_or_else(|poison| poison.into_inner());
        if current.as_ref().is_some_and(|key| key.key.kid() == kid) {
            return;
        }
        self.epoch.fetch_add(1, Ordering::SeqCst);
        *current = None;
        tracing::debug!(kid, "signing key rotated by another replica");
    }

    /// Drops the cached key whatever it is: rotations may have been missed.
    fn forget(&self) {
        let mut current = self.current.write().unwrap_or_else(|poison| poison.into_inner());
        self.epoch.fetch_add(1, Ordering::SeqCst);
        *current = None;
    }

    /// Follows the rotations announced on the feed until `shutdown`; while
    /// the feed is not live the cached key is trusted for a second only.
    pub(crate) async fn follow(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            let live = tokio::select! {
                () = shutdown.cancelled() => return,
                live = self.events.wait_live(FEED_READY_TIMEOUT) => live,
            };
            if live.is_ok() {
                let mut feed = std::pin::pin!(self.events.subscribe());
                // What happened before the subscription is read from the store.
                self.forget();
                self.following.store(true, Ordering::Release);
                loop {
                    let item = tokio::select! {
                        () = shutdown.cancelled() => return,
                        item = feed.next() => item,
                    };
                    match item {
                        Some(Ok(AuthEvent {
                            kind: AuthEventKind::SigningKeyRotated(kid),
                            ..
                        })) => self.rotated(&kid),
                        Some(Ok(_)) => {}
                        Some(Err(_)) | None => break,
                    }
                }
                self.following.store(false, Ordering::Release);
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    /// Seals every key stored plain (before keys were sealed) and returns
    /// whether the current one was among them: a key that lay in the
    /// database in the clear may have been copied, so the caller replaces it.
    pub(crate) async fn seal_plain_keys(&self) -> Result<bool, AuthError> {
        let keys = self.store.signing_keys().await?;
        let mut current_was_plain = false;
        for record in keys.iter().filter(|record| !is_sealed(&record.private_key)) {
            let sealed = self.seal.seal(&record.kid, &record.private_key)?;
            if self
                .store
                .replace_private_key(&record.kid, &record.private_key, &sealed)
                .await?
            {
                tracing::info!(kid = %record.kid, "signing key sealed at rest");
            }
            current_was_plain |= record.retired_at_ms.is_none();
        }
        Ok(current_was_plain)
    }

    /// Returns the key a stored record holds, ready to sign.
    fn active(&self, record: &SigningKeyRecord) -> Result<ActiveKey, AuthError> {
        // A plain key is one an older replica wrote during a rolling upgrade;
        // the next start of this version seals it.
        let key = if is_sealed(&record.private_key) {
            self.seal.open(record)?
        } else {
            SigningKey::from_pkcs8(record.kid.clone(), record.private_key.clone())?
        };
        Ok(ActiveKey {
            key,
            created_at_ms: record.created_at_ms,
            read_at: Instant::now(),
        })
    }

    fn is_due(&self, created_at_ms: i64) -> bool {
        now_ms().saturating_sub(created_at_ms) >= self.rotation_ms
    }

    /// Stores a new key, retiring the others, and announces it to every replica.
    async fn insert_new(&self) -> Result<Arc<ActiveKey>, AuthError> {
        let now = now_ms();
        let (key, record) = generate(now, &self.seal)?;
        self.store.insert_signing_key(&record, now).await?;
        self.events
            .emit(AuthEvent {
                at_ms: now_ms(),
                kind: AuthEventKind::SigningKeyRotated(record.kid.clone()),
            })
            .await;
        Ok(Arc::new(ActiveKey {
            key,
            created_at_ms: record.created_at_ms,
            read_at: Instant::now(),
        }))
    }
}

/// Reads the verification keys straight from the store, for the auth
/// service's own verifier.
pub(crate) struct StoreKeySource {
    pub(crate) keys: Arc<SigningKeys>,
}

#[async_trait]
impl KeySource for StoreKeySource {
    async fn jwks(&self) -> Result<JwkSet, ApiError> {
        Ok(self.keys.jwks().await?)
    }
}

/// Returns a new Ed25519 key made at `now_ms`, and its record to store (sealed).
pub(crate) fn generate(now_ms: i64, seal: &KeySeal) -> Result<(SigningKey, SigningKeyRecord), AuthError> {
    let key = SigningKey::generate()?;
    let public_jwk =
        serde_json::to_string(key.public_jwk()).map_err(|err| AuthError::corrupt(format!("jwk: {err}")))?;
    let record = SigningKeyRecord {
        kid: key.kid().to_owned(),
        private_key: seal.seal(key.kid(), key.pkcs8_der())?,
        public_jwk,
        created_at_ms: now_ms,
        retired_at_ms: None,
    };
    Ok((key, record))
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_sign_and_publish_their_public_half() {
        let seal = KeySeal::new("0123456789abcdef0123456789abcdef").unwrap();
        let (key, record) = generate(1, &seal).unwrap();
        assert!(record.kid.starts_with("sk_") && record.kid.len() == 3 + 16);
        assert!(is_sealed(&record.private_key), "stored sealed");
        assert_eq!(key.pkcs8_der().len(), 48);
        let jwk: Jwk = serde_json::from_str(&record.public_jwk).unwrap();
        assert_eq!(jwk.common.key_id.as_deref(), Some(record.kid.as_str()));
        assert!(
            !record.public_jwk.contains("\"d\""),
            "the private part is never published"
        );
        let header = jsonwebtoken::Header::new(avm_common::auth::ALGORITHM);
        let token = jsonwebtoken::encode(
            &header,
            &serde_json::json!({"a": 1}),
            &jsonwebtoken::EncodingKey::from_ed_der(seal.open(&record).unwrap().pkcs8_der()),
        )
        .unwrap();
        let key = jsonwebtoken::DecodingKey::from_jwk(&jwk).unwrap();
        let mut validation = jsonwebtoken::Validation::new(avm_common::auth::ALGORITHM);
        validation.required_spec_claims.clear();
        validation.validate_exp = false;
        assert!(jsonwebtoken::decode::<serde_json::Value>(&token, &key, &validation).is_ok());
    }
}
