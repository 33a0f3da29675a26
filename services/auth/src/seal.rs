//! The token signing keys at rest: each private key is stored sealed
//! (ChaCha20-Poly1305) under a key derived from the deployment's secret key
//! (`AVM_CONFIG_SECRET_KEY`; `avm serve` keeps one in `<data dir>/config.key`)
//! and bound to its `kid`, so the database alone — a copy, a backup, a read
//! through SQL — holds nothing that signs a token, and a sealed key cannot be
//! moved to another row.

use avm_common::auth::SigningKey;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use sha2::{Digest, Sha256};

use crate::error::AuthError;
use crate::record::SigningKeyRecord;

/// Shortest key material accepted (as for the config service's secrets).
pub const MIN_SEAL_KEY_CHARS: usize = 32;

/// Starts every sealed key; plain PKCS#8 (rows written before sealing)
/// starts with a DER SEQUENCE (`0x30`) instead.
const SEALED_MAGIC: &[u8] = b"avmsk1";

/// Keeps the derived key apart from the config service's own (same material).
const DERIVATION_CONTEXT: &[u8] = b"agentvm signing-key seal v1\0";

const NONCE_BYTES: usize = 12;

/// Seals and opens the private halves of signing keys.
pub struct KeySeal {
    cipher: ChaCha20Poly1305,
}

impl std::fmt::Debug for KeySeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySeal(<redacted>)")
    }
}

impl KeySeal {
    /// Returns a seal under `material` (32+ characters, e.g. `openssl rand
    /// -hex 32`). A hash suffices to derive the key: the material is random,
    /// with nothing to stretch.
    pub fn new(material: &str) -> Result<Self, AuthError> {
        if material.trim().chars().count() < MIN_SEAL_KEY_CHARS {
            return Err(AuthError::invalid(
                "WEAK_SEAL_KEY",
                "the key sealing the token signing keys (AVM_CONFIG_SECRET_KEY) must be at least 32 characters \
                 (e.g. `openssl rand -hex 32`)",
            ));
        }
        let mut digest = Sha256::new();
        digest.update(DERIVATION_CONTEXT);
        digest.update(material.trim().as_bytes());
        Ok(Self {
            cipher: ChaCha20Poly1305::new(Key::from_slice(&digest.finalize())),
        })
    }

    /// Returns the private key `der` of `kid` sealed for storage.
    pub(crate) fn seal(&self, kid: &str, der: &[u8]) -> Result<Vec<u8>, AuthError> {
        let nonce: [u8; NONCE_BYTES] = rand::random();
        let payload = Payload {
            msg: der,
            aad: kid.as_bytes(),
        };
        let sealed = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), payload)
            .map_err(|_| AuthError::corrupt("cannot seal a signing key"))?;
        let mut stored = Vec::with_capacity(SEALED_MAGIC.len() + NONCE_BYTES + sealed.len());
        stored.extend_from_slice(SEALED_MAGIC);
        stored.extend_from_slice(&nonce);
        stored.extend_from_slice(&sealed);
        Ok(stored)
    }

    /// Returns the signing key a stored record holds, opening its seal.
    pub fn open(&self, record: &SigningKeyRecord) -> Result<SigningKey, AuthError> {
        let unreadable = || {
            AuthError::precondition(
                "SIGNING_KEY_UNREADABLE",
                format!(
                    "signing key {} cannot be opened: it was sealed under another AVM_CONFIG_SECRET_KEY \
                     (every auth replica needs the one it was sealed with; `avm serve` keeps its own in \
                     <data dir>/config.key)",
                    record.kid
                ),
            )
        };
        let sealed = record
            .private_key
            .strip_prefix(SEALED_MAGIC)
            .filter(|rest| rest.len() > NONCE_BYTES)
            .ok_or_else(unreadable)?;
        let (nonce, ciphertext) = sealed.split_at(NONCE_BYTES);
        let payload = Payload {
            msg: ciphertext,
            aad: record.kid.as_bytes(),
        };
        let der = self
            .cipher
            .decrypt(Nonce::from_slice(nonce), payload)
            .map_err(|_| unreadable())?;
        Ok(SigningKey::from_pkcs8(record.kid.clone(), der)?)
    }
}

/// Returns whether a stored private key is sealed (rather than plain PKCS#8
/// from before sealing).
pub(crate) fn is_sealed(stored: &[u8]) -> bool {
    stored.starts_with(SEALED_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MATERIAL: &str = "0123456789abcdef0123456789abcdef";

    fn record(kid: &str, private_key: Vec<u8>) -> SigningKeyRecord {
        SigningKeyRecord {
            kid: kid.to_owned(),
            private_key,
            public_jwk: String::new(),
            created_at_ms: 0,
            retired_at_ms: None,
        }
    }

    #[test]
    fn a_sealed_key_opens_only_under_its_material_and_kid() {
        let seal = KeySeal::new(MATERIAL).unwrap();
        let key = SigningKey::generate().unwrap();
        let sealed = seal.seal(key.kid(), key.pkcs8_der()).unwrap();
        assert!(is_sealed(&sealed));
        assert!(!is_sealed(key.pkcs8_der()), "plain PKCS#8 is told apart");
        assert!(
            !sealed.windows(32).any(|window| key.pkcs8_der().ends_with(window)),
            "the seed never shows"
        );
        let opened = seal.open(&record(key.kid(), sealed.clone())).unwrap();
        assert_eq!(opened.public_jwk(), key.public_jwk());

        let moved = seal.open(&record("sk_0000000000000000", sealed.clone())).unwrap_err();
        assert_eq!(avm_common::ApiError::from(moved).reason, "SIGNING_KEY_UNREADABLE");
        let other = KeySeal::new(&MATERIAL.replace('0', "1")).unwrap();
        assert!(other.open(&record(key.kid(), sealed)).is_err());
        assert!(seal.open(&record(key.kid(), key.pkcs8_der().to_vec())).is_err());
    }

    #[test]
    fn short_material_is_refused() {
        assert!(KeySeal::new("short").is_err());
        assert!(KeySeal::new(&" ".repeat(40)).is_err());
    }
}
