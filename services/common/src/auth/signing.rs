//! Ed25519 signing keys for access tokens: generated from the OS RNG, kept
//! as PKCS#8, published as JWKs.

use async_trait::async_trait;
use jsonwebtoken::jwk::{Jwk, JwkSet, PublicKeyUse};
use jsonwebtoken::{EncodingKey, Header};

use super::{ALGORITHM, Claims, KeySource};
use crate::ApiError;

/// The PKCS#8 v1 prefix of an Ed25519 private key (RFC 8410); the 32-byte seed follows.
const ED25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];

/// A key that signs access tokens.
pub struct SigningKey {
    kid: String,
    pkcs8: Vec<u8>,
    encoding: EncodingKey,
    jwk: Jwk,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

impl SigningKey {
    /// Returns a new random key with a fresh `kid`.
    pub fn generate() -> Result<Self, ApiError> {
        let seed: [u8; 32] = rand::random();
        let mut pkcs8 = ED25519_PKCS8_PREFIX.to_vec();
        pkcs8.extend_from_slice(&seed);
        let bits: u64 = rand::random();
        Self::from_pkcs8(format!("sk_{bits:016x}"), pkcs8)
    }

    /// Returns the key `kid` from its PKCS#8 DER form.
    pub fn from_pkcs8(kid: String, pkcs8: Vec<u8>) -> Result<Self, ApiError> {
        let encoding = EncodingKey::from_ed_der(&pkcs8);
        let mut jwk = Jwk::from_encoding_key(&encoding, ALGORITHM)
            .map_err(|err| ApiError::internal(format!("unusable signing key {kid}: {err}")))?;
        jwk.common.key_id = Some(kid.clone());
        jwk.common.public_key_use = Some(PublicKeyUse::Signature);
        Ok(Self {
            kid,
            pkcs8,
            encoding,
            jwk,
        })
    }

    /// Returns the key id.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// Returns the private key as PKCS#8 DER, for storage.
    pub fn pkcs8_der(&self) -> &[u8] {
        &self.pkcs8
    }

    /// Returns the public key as a JWK carrying the `kid`.
    pub fn public_jwk(&self) -> &Jwk {
        &self.jwk
    }

    /// Signs `claims` as a compact JWT with this key's `kid`.
    pub fn sign(&self, claims: &Claims) -> Result<String, ApiError> {
        let mut header = Header::new(ALGORITHM);
        header.kid = Some(self.kid.clone());
        header.typ = Some("JWT".to_owned());
        jsonwebtoken::encode(&header, claims, &self.encoding)
            .map_err(|err| ApiError::internal(format!("cannot sign a token: {err}")))
    }
}

/// A fixed key set, for a verifier whose keys are known up front.
pub struct StaticKeySource(pub JwkSet);

#[async_trait]
impl KeySource for StaticKeySource {
    async fn jwks(&self) -> Result<JwkSet, ApiError> {
        Ok(self.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::auth::{AuthConfig, Limits, Principal, Role, Scopes, TokenVerifier};

    fn principal() -> Principal {
        Principal {
            tenant_id: "ten_1".into(),
            user_id: "usr_1".into(),
            role: Role::Admin,
            operator: false,
            key_id: None,
            scopes: Scopes::ALL,
            tenant_limits: Limits::default(),
            key_limits: Limits::default(),
        }
    }

    #[tokio::test]
    async fn a_signed_token_verifies_and_a_foreign_key_does_not() {
        let key = SigningKey::generate().ok();
        let other = SigningKey::generate().ok();
        let (Some(key), Some(other)) = (key, other) else {
            panic!("keys must generate");
        };
        let config = AuthConfig::default();
        let jwks = JwkSet {
            keys: vec![key.public_jwk().clone()],
        };
        let verifier = TokenVerifier::new(&config, Arc::new(StaticKeySource(jwks)));
        let now = u64::try_from(crate::now_ms() / 1000).unwrap_or_default();
        let claims = Claims::new(&principal(), &config.issuer, now, Duration::from_secs(60));
        let token = key.sign(&claims).ok().unwrap_or_default();
        assert_eq!(verifier.verify(&token).await.ok(), Some(principal()));
        // The same claims under a key the verifier does not know are refused.
        let forged = other.sign(&claims).ok().unwrap_or_default();
        let err = verifier.verify(&forged).await.err();
        assert_eq!(err.map(|e| e.reason.into_owned()).as_deref(), Some("INVALID_TOKEN"));
        // A key reloaded from its stored form signs tokens the same verifier accepts.
        let reloaded = SigningKey::from_pkcs8(key.kid().to_owned(), key.pkcs8_der().to_vec()).ok();
        let token = reloaded.and_then(|k| k.sign(&claims).ok()).unwrap_or_default();
        assert!(verifier.verify(&token).await.is_ok());
    }
}
