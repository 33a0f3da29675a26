//! Server-made identifiers: a type prefix and 128 random bits; and the
//! rule for names users give (servers' credentials, secrets).

/// Returns a new id such as `img_3f9c…` with 128 bits from the OS-seeded RNG.
pub fn new_id(prefix: &str) -> String {
    let bits: u128 = rand::random();
    format!("{prefix}_{bits:032x}")
}

/// Returns whether `name` is 1 to 128 letters, digits, `-`, `_` or `.`: how
/// an MCP server's credential and a tenant's secret are named.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    #[test]
    fn plain_names_are_bounded_words() {
        assert!(super::is_plain_name("search-v2.internal_x"));
        for bad in ["", "a/b", "x y", "a\0b", "é", &"n".repeat(129)] {
            assert!(!super::is_plain_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn ids_have_their_prefix_and_differ() {
        let a = super::new_id("img");
        let b = super::new_id("img");
        assert!(a.starts_with("img_"));
        assert_eq!(a.len(), 4 + 32);
        assert_ne!(a, b);
    }
}
