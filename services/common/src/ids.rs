//! Server-made identifiers: a type prefix and 128 random bits.

/// Returns a new id such as `img_3f9c…` with 128 bits from the OS-seeded RNG.
pub fn new_id(prefix: &str) -> String {
    let bits: u128 = rand::random();
    format!("{prefix}_{bits:032x}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_have_their_prefix_and_differ() {
        let a = super::new_id("img");
        let b = super::new_id("img");
        assert!(a.starts_with("img_"));
        assert_eq!(a.len(), 4 + 32);
        assert_ne!(a, b);
    }
}
