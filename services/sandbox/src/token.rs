//! The tokens a runtime reaches a sandbox with: one image, a few minutes.
//!
//! The runtime signs each token with an Ed25519 key of its own (made when it
//! starts, never stored); a sandbox holds only the public half, which is no
//! secret: it can check a token and make none. A token names one image and
//! when it expires; a sandbox serves a call only for the image its token
//! names.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ed25519_dalek::{Signature, Signer as _, SigningKey, Verifier as _, VerifyingKey};

/// How long a token is good for.
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(300);

/// What is signed: the purpose, the image and the expiry.
fn message(image_id: &str, expires_ms: u64) -> Vec<u8> {
    format!("avm-sandbox-v1\n{image_id}\n{expires_ms}").into_bytes()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

/// Makes tokens (the runtime's half).
pub struct TokenSigner {
    key: SigningKey,
}

impl std::fmt::Debug for TokenSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenSigner")
    }
}

impl TokenSigner {
    /// Returns a signer with a new random key.
    pub fn random() -> Self {
        Self {
            key: SigningKey::from_bytes(&rand::random::<[u8; 32]>()),
        }
    }

    /// Returns the public key sandboxes check tokens with (URL-safe base64).
    pub fn public_key(&self) -> String {
        URL_SAFE_NO_PAD.encode(self.key.verifying_key().as_bytes())
    }

    /// Returns a token for `image_id`, good for [`TOKEN_LIFETIME`].
    pub fn issue(&self, image_id: &str) -> String {
        let lifetime = u64::try_from(TOKEN_LIFETIME.as_millis()).unwrap_or(u64::MAX);
        self.issue_until(image_id, now_ms().saturating_add(lifetime))
    }

    fn issue_until(&self, image_id: &str, expires_ms: u64) -> String {
        let signature = self.key.sign(&message(image_id, expires_ms));
        format!(
            "{}.{expires_ms}.{}",
            URL_SAFE_NO_PAD.encode(image_id),
            URL_SAFE_NO_PAD.encode(signature.to_bytes())
        )
    }
}

/// Checks tokens (the sandbox's half).
#[derive(Clone, Debug)]
pub struct TokenVerifier {
    key: VerifyingKey,
}

impl TokenVerifier {
    /// Reads a public key as [`TokenSigner::public_key`] writes it.
    pub fn from_public_key(text: &str) -> Result<Self, String> {
        let bytes = URL_SAFE_NO_PAD
            .decode(text.trim())
            .map_err(|_| "the sandbox token key is not URL-safe base64".to_owned())?;
        let bytes: [u8; 32] = bytes
            .try_into()
            .map_err(|_| "the sandbox token key is not 32 bytes".to_owned())?;
        let key =
            VerifyingKey::from_bytes(&bytes).map_err(|_| "the sandbox token key is not an Ed25519 key".to_owned())?;
        Ok(Self { key })
    }

    /// Returns `Ok` when `token` is good now for `image_id`; the error says
    /// why not (never echoing the token).
    pub fn check(&self, token: &str, image_id: &str) -> Result<(), &'static str> {
        let mut parts = token.splitn(3, '.');
        let (Some(image), Some(expires), Some(signature)) = (parts.next(), parts.next(), parts.next()) else {
            return Err("the sandbox token is malformed");
        };
        let image = URL_SAFE_NO_PAD
            .decode(image)
            .ok()
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .ok_or("the sandbox token is malformed")?;
        let expires_ms: u64 = expires.parse().map_err(|_| "the sandbox token is malformed")?;
        let signature = URL_SAFE_NO_PAD
            .decode(signature)
            .ok()
            .and_then(|bytes| Signature::from_slice(&bytes).ok())
            .ok_or("the sandbox token is malformed")?;
        self.key
            .verify(&message(&image, expires_ms), &signature)
            .map_err(|_| "the sandbox token is not signed by this sandbox's runtime")?;
        if expires_ms <= now_ms() {
            return Err("the sandbox token has expired");
        }
        if image != image_id {
            return Err("the sandbox token is for another image");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_opens_its_own_image_only_and_only_while_it_lasts() {
        let signer = TokenSigner::random();
        let verifier = TokenVerifier::from_public_key(&signer.public_key()).unwrap();
        let token = signer.issue("img_a");
        assert_eq!(verifier.check(&token, "img_a"), Ok(()));
        assert_eq!(
            verifier.check(&token, "img_b"),
            Err("the sandbox token is for another image")
        );
        let expired = signer.issue_until("img_a", now_ms() - 1);
        assert_eq!(verifier.check(&expired, "img_a"), Err("the sandbox token has expired"));
        // Another runtime's key, a forged image and garbage are refused.
        let other = TokenSigner::random().issue("img_a");
        assert!(verifier.check(&other, "img_a").is_err());
        let (_, rest) = token.split_once('.').unwrap();
        let forged = format!("{}.{rest}", URL_SAFE_NO_PAD.encode("img_b"));
        assert!(verifier.check(&forged, "img_b").is_err());
        for bad in ["", "x", "a.b.c", "\0.\0.\0", &"x".repeat(20_000)] {
            assert!(verifier.check(bad, "img_a").is_err(), "{bad:?}");
        }
        assert!(TokenVerifier::from_public_key("not a key").is_err());
    }
}
