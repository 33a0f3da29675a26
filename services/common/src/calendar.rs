//! UTC calendar arithmetic on Unix milliseconds: the months quotas and
//! budgets reset on, and the days and months usage groups by. Written here
//! (after Howard Hinnant's date algorithms) because a date crate for three
//! conversions would weigh more than they do.

/// Milliseconds in a day.
const DAY_MS: i64 = 86_400_000;

/// Returns the calendar month (UTC) of a Unix time in milliseconds, as `YYYY-MM`.
pub fn month_of(ms: i64) -> String {
    let (year, month, _) = civil_date(ms);
    format!("{year:04}-{month:02}")
}

/// Returns the calendar day (UTC) of a Unix time in milliseconds, as
/// `YYYY-MM-DD`; it always falls in the month [`month_of`] gives.
pub fn day_of(ms: i64) -> String {
    let (year, month, day) = civil_date(ms);
    format!("{year:04}-{month:02}-{day:02}")
}

/// Returns the Unix ms range `[start, end)` of a UTC calendar month written
/// `YYYY-MM`, or `None` when it is not one.
pub fn month_range(month: &str) -> Option<(i64, i64)> {
    let (year, month) = month.split_once('-')?;
    if year.len() != 4 || month.is_empty() || month.len() > 2 {
        return None;
    }
    let (year, month): (i64, i64) = (year.parse().ok()?, month.parse().ok()?);
    if !(1970..=9999).contains(&year) || !(1..=12).contains(&month) {
        return None;
    }
    let next = if month == 12 { (year + 1, 1) } else { (year, month + 1) };
    Some((
        days_from_civil(year, month) * DAY_MS,
        days_from_civil(next.0, next.1) * DAY_MS,
    ))
}

/// Returns the days from 1970-01-01 to the first of `month` of `year`.
fn days_from_civil(year: i64, month: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Returns the UTC (year, month, day) of a Unix time in milliseconds.
fn civil_date(ms: i64) -> (i64, i64, i64) {
    let days = ms.div_euclid(DAY_MS);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn months_are_utc_calendar_months() {
        assert_eq!(month_range("1970-01"), Some((0, 31 * DAY_MS)));
        assert_eq!(month_range("2024-02").map(|(from, to)| (to - from) / DAY_MS), Some(29));
        assert_eq!(
            month_range("2026-12").map(|(_, to)| to),
            month_range("2027-01").map(|(from, _)| from)
        );
        for bad in ["2026-13", "26-1x", "2026-", "2026-001", "1969-12"] {
            assert_eq!(month_range(bad), None, "{bad}");
        }
    }

    #[test]
    fn months_of_instants_are_utc_calendar_months() {
        assert_eq!(month_of(0), "1970-01");
        assert_eq!(month_of(951_782_400_000), "2000-02"); // 2000-02-29
        assert_eq!(month_of(1_798_761_599_999), "2026-12"); // 2026-12-31T23:59:59.999
        assert_eq!(month_of(1_798_761_600_000), "2027-01");
    }

    #[test]
    fn days_fall_in_their_months() {
        assert_eq!(day_of(0), "1970-01-01");
        assert_eq!(day_of(951_782_400_000), "2000-02-29");
        assert_eq!(day_of(1_798_761_599_999), "2026-12-31");
        assert_eq!(day_of(1_798_761_600_000), "2027-01-01");
        assert_eq!(day_of(-1), "1969-12-31");
        let mut ms = -10 * 86_400_000;
        while ms < 4_000_000_000_000 {
            assert!(day_of(ms).starts_with(&month_of(ms)), "{ms}");
            ms += 86_400_000 * 7 + 3_600_000 * 5 + 17;
        }
    }

    #[test]
    fn days_and_months_round_trip() {
        let (start, end) = month_range("2024-02").unwrap_or_default();
        assert_eq!(month_of(start), "2024-02");
        assert_eq!(month_of(end - 1), "2024-02");
        assert_eq!(day_of(end - 1), "2024-02-29");
        assert_eq!(month_of(end), "2024-03");
        assert_eq!(day_of(-1), "1969-12-31");
    }
}
