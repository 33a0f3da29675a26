//! Amounts of money: integers of pico-dollars (1e-12 USD) everywhere, so
//! sums are exact; decimal dollars only at the edges.

/// Pico-dollars in a dollar.
pub const PICO_PER_USD: i64 = 1_000_000_000_000;

/// Renders pico-dollars as a decimal number of dollars (`"1.05"`).
pub fn format_usd(pico: i64) -> String {
    let sign = if pico < 0 { "-" } else { "" };
    let pico = pico.unsigned_abs();
    let whole = pico / PICO_PER_USD.unsigned_abs();
    let fraction = format!("{:012}", pico % PICO_PER_USD.unsigned_abs());
    let fraction = fraction.trim_end_matches('0');
    if fraction.is_empty() {
        format!("{sign}{whole}")
    } else {
        format!("{sign}{whole}.{fraction}")
    }
}

/// Parses a non-negative decimal number of dollars (`"5"`, `"0.25"`) into
/// pico-dollars; more than 12 decimals, signs, exponents or overflow are `None`.
pub fn parse_usd(text: &str) -> Option<i64> {
    let text = text.trim();
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty() || fraction.len() > 12 || !(whole.bytes().chain(fraction.bytes())).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let whole: i64 = whole.parse().ok()?;
    let fraction: i64 = if fraction.is_empty() {
        0
    } else {
        format!("{fraction:0<12}").parse().ok()?
    };
    whole.checked_mul(PICO_PER_USD)?.checked_add(fraction)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dollars_round_trip_exactly() {
        assert_eq!(format_usd(0), "0");
        assert_eq!(format_usd(1_050_000_000_000), "1.05");
        assert_eq!(format_usd(157_500), "0.0000001575");
        assert_eq!(format_usd(-2 * PICO_PER_USD), "-2");
        for text in ["5", "0.25", "1.05", "0.000000000001", "123456.789"] {
            assert_eq!(parse_usd(text).map(format_usd).as_deref(), Some(text));
        }
        for bad in ["", "-1", "1e3", "0.1234567890123", "abc", ".5", "99999999999999999"] {
            assert_eq!(parse_usd(bad), None, "{bad}");
        }
    }
}
