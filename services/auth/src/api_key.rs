//! The API key format: `avm_<24 lowercase hex>_<43 base64url characters>`.
//!
//! The hex part names the key (`key_<hex>`); the rest is 256 random bits of
//! which only a SHA-256 is stored. A hash, not a password KDF, because the
//! secret is random and long: nothing is left to guess, and verifying stays
//! fast enough for every exchange.

use avm_common::auth::API_KEY_PREFIX;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Length of the id part, in hex characters (96 bits).
const ID_HEX_LEN: usize = 24;
/// Length of the secret part: 32 bytes in unpadded base64url.
const SECRET_LEN: usize = 43;
/// Length of a full key.
const KEY_LEN: usize = API_KEY_PREFIX.len() + ID_HEX_LEN + 1 + SECRET_LEN;
/// How many characters of a key are kept to recognise it.
const DISPLAY_PREFIX_LEN: usize = 12;

/// A freshly made key.
pub(crate) struct GeneratedKey {
    pub key_id: String,
    /// The full key, shown to its owner once.
    pub full: String,
    pub prefix: String,
    pub secret_hash: String,
}

/// Returns a new random key.
pub(crate) fn generate() -> GeneratedKey {
    let mut rng = rand::rng();
    let mut id = [0u8; ID_HEX_LEN / 2];
    rng.fill_bytes(&mut id);
    let mut secret = [0u8; 32];
    rng.fill_bytes(&mut secret);
    let id = hex(&id);
    let secret = URL_SAFE_NO_PAD.encode(secret);
    let full = format!("{API_KEY_PREFIX}{id}_{secret}");
    GeneratedKey {
        key_id: format!("key_{id}"),
        prefix: full[..DISPLAY_PREFIX_LEN].to_owned(),
        secret_hash: hash_secret(&secret),
        full,
    }
}

/// A presented key split into its parts.
pub(crate) struct ParsedKey<'a> {
    pub key_id: String,
    pub secret: &'a str,
}

/// Splits a presented key, or `None` when it is not of the format.
///
/// By position rather than by `_`, since base64url uses `_` too.
pub(crate) fn parse(full: &str) -> Option<ParsedKey<'_>> {
    if full.len() != KEY_LEN || !full.is_ascii() {
        return None;
    }
    let rest = full.strip_prefix(API_KEY_PREFIX)?;
    let (id, rest) = rest.split_at(ID_HEX_LEN);
    let secret = rest.strip_prefix('_')?;
    let id_ok = id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let secret_ok = secret
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    (id_ok && secret_ok).then(|| ParsedKey {
        key_id: format!("key_{id}"),
        secret,
    })
}

/// Returns the hex SHA-256 of a secret, as stored.
pub(crate) fn hash_secret(secret: &str) -> String {
    hex(&Sha256::digest(secret.as_bytes()))
}

/// Compares a secret with a stored hash in constant time.
pub(crate) fn secret_matches(secret: &str, stored_hash: &str) -> bool {
    hash_secret(secret).as_bytes().ct_eq(stored_hash.as_bytes()).into()
}

/// Returns lowercase hex; written here because it is one line and the
/// workspace has no hex crate.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_keys_parse_back_to_their_id_and_hash() {
        let key = generate();
        assert_eq!(key.full.len(), KEY_LEN);
        assert!(key.full.starts_with(&key.prefix));
        let parsed = parse(&key.full).unwrap();
        assert_eq!(parsed.key_id, key.key_id);
        assert!(secret_matches(parsed.secret, &key.secret_hash));
        assert!(!secret_matches("nope", &key.secret_hash));
    }

    #[test]
    fn malformed_keys_do_not_parse() {
        let key = generate().full;
        assert!(parse(&key[1..]).is_none());
        assert!(parse(&key.replacen("avm_", "xyz_", 1)).is_none());
        assert!(parse(&key.to_uppercase()).is_none());
        let mut bad_separator = key.clone().into_bytes();
        bad_separator[API_KEY_PREFIX.len() + ID_HEX_LEN] = b'-';
        assert!(parse(&String::from_utf8(bad_separator).unwrap()).is_none());
        assert!(parse(&format!("{}é", &key[..KEY_LEN - 2])).is_none());
    }
}
