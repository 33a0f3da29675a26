//! Encryption of stored secrets: ChaCha20-Poly1305 under a key derived from
//! `AVM_CONFIG_SECRET_KEY`, each value bound to its scope and key so a sealed
//! value cannot be moved to another key or tenant.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use sha2::{Digest, Sha256};

use crate::error::ConfigError;

/// Shortest key material accepted.
pub const MIN_SECRET_KEY_CHARS: usize = 32;

/// Marks the format of a sealed value, so it can change later.
const SEALED_PREFIX: &str = "v1.";

const NONCE_BYTES: usize = 12;

/// Seals and opens stored secrets.
pub struct SecretCipher {
    cipher: ChaCha20Poly1305,
}

impl std::fmt::Debug for SecretCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretCipher(<redacted>)")
    }
}

impl SecretCipher {
    /// Returns a cipher under `material` (at least 32 characters, e.g.
    /// `openssl rand -hex 32`), hashed to a 256-bit key.
    pub fn new(material: &str) -> Result<Self, ConfigError> {
        if material.chars().count() < MIN_SECRET_KEY_CHARS {
            return Err(ConfigError::SecretKey(
                "AVM_CONFIG_SECRET_KEY must be at least 32 characters (e.g. `openssl rand -hex 32`); it encrypts stored secrets",
            ));
        }
        let digest = Sha256::digest(material.as_bytes());
        Ok(Self {
            cipher: ChaCha20Poly1305::new(Key::from_slice(&digest)),
        })
    }

    /// Returns `plaintext` sealed for `context` (scope and key).
    pub fn seal(&self, context: &str, plaintext: &str) -> Result<String, ConfigError> {
        let nonce_bytes: [u8; NONCE_BYTES] = rand::random();
        let payload = Payload {
            msg: plaintext.as_bytes(),
            aad: context.as_bytes(),
        };
        let sealed = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce_bytes), payload)
            .map_err(|_| ConfigError::corrupt("cannot encrypt a secret".to_owned()))?;
        let mut bytes = nonce_bytes.to_vec();
        bytes.extend_from_slice(&sealed);
        Ok(format!("{SEALED_PREFIX}{}", URL_SAFE_NO_PAD.encode(bytes)))
    }

    /// Returns the plaintext of a value sealed for `context`; `key` names it
    /// in the error when it cannot be opened (another key, or tampered).
    pub fn open(&self, context: &str, key: &str, sealed: &str) -> Result<String, ConfigError> {
        let unreadable = || ConfigError::SecretUnreadable(key.to_owned());
        let bytes = sealed
            .strip_prefix(SEALED_PREFIX)
            .and_then(|encoded| URL_SAFE_NO_PAD.decode(encoded).ok())
            .filter(|bytes| bytes.len() > NONCE_BYTES)
            .ok_or_else(unreadable)?;
        let (nonce, ciphertext) = bytes.split_at(NONCE_BYTES);
        let payload = Payload {
            msg: ciphertext,
            aad: context.as_bytes(),
        };
        let plaintext = self
            .cipher
            .decrypt(Nonce::from_slice(nonce), payload)
            .map_err(|_| unreadable())?;
        String::from_utf8(plaintext).map_err(|_| unreadable())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn sealed_values_open_only_where_they_were_sealed() {
        let cipher = SecretCipher::new(KEY).unwrap();
        let sealed = cipher.seal("system/llm.apiKey", "\"sk-canary\"").unwrap();
        assert!(!sealed.contains("canary"));
        assert_ne!(
            sealed,
            cipher.seal("system/llm.apiKey", "\"sk-canary\"").unwrap(),
            "fresh nonces"
        );
        assert_eq!(
            cipher.open("system/llm.apiKey", "llm.apiKey", &sealed).unwrap(),
            "\"sk-canary\""
        );
        assert!(
            cipher.open("ten_b/llm.apiKey", "llm.apiKey", &sealed).is_err(),
            "bound to its scope"
        );
        let other = SecretCipher::new(&KEY.replace('0', "1")).unwrap();
        let err = other.open("system/llm.apiKey", "llm.apiKey", &sealed).unwrap_err();
        assert!(err.to_string().contains("llm.apiKey"));
        assert!(!err.to_string().contains("canary"));
    }

    #[test]
    fn short_keys_are_refused() {
        assert!(SecretCipher::new("short").is_err());
    }
}
