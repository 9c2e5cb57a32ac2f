//! Postgres `timestamptz` text to Go's `time.Time` JSON form (RFC 3339 with the fraction's
//! trailing zeros trimmed, `Z` for UTC), without a date-time library on the hot path.

/// Why a timestamp could not be converted.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("created_at {0:?} is not a finite timestamp in ISO form")]
pub struct TimestampError(pub String);

/// Converts Postgres' ISO output (`2026-11-29 10:15:30.123456+00`, any offset such as `+05:30`
/// or `-08`, `T` or space separator) to UTC RFC 3339: `2026-11-29T10:15:30.123456Z`.
pub fn pg_timestamptz_to_rfc3339(s: &str, out: &mut String) -> Result<(), TimestampError> {
    let err = || TimestampError(s.to_owned());
    let b = s.as_bytes();
    if b.len() < 19
        || b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b' ' | b'T')
        || b[13] != b':'
        || b[16] != b':'
    {
        return Err(err());
    }
    let num = |r: std::ops::Range<usize>| -> Result<i64, TimestampError> {
        let part = &b[r];
        if part.iter().all(u8::is_ascii_digit) {
            Ok(part.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0')))
        } else {
            Err(err())
        }
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return Err(err());
    }
    let mut pos = 19;
    let mut frac = "";
    if b.get(pos) == Some(&b'.') {
        let start = pos + 1;
        let mut end = start;
        while end < b.len() && b[end].is_ascii_digit() {
            end += 1;
        }
        if end == start || end - start > 9 {
            return Err(err());
        }
        frac = s[start..end].trim_end_matches('0');
        pos = end;
    }
    let offset_secs = parse_offset(&b[pos..]).ok_or_else(err)?;
    let local = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second;
    let utc = local - offset_secs;
    let (days, secs) = (utc.div_euclid(86_400), utc.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    if !(0..=9999).contains(&y) {
        return Err(err());
    }
    use std::fmt::Write;
    let _ = write!(
        out,
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    );
    if !frac.is_empty() {
        out.push('.');
        out.push_str(frac);
    }
    out.push('Z');
    Ok(())
}

/// `Z`, `+HH`, `+HH:MM` or `+HH:MM:SS` (and `-`), in seconds east of UTC.
fn parse_offset(b: &[u8]) -> Option<i64> {
    if b == b"Z" {
        return Some(0);
    }
    let sign = match b.first()? {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    let two = |i: usize| -> Option<i64> {
        let (x, y) = (*b.get(i)?, *b.get(i + 1)?);
        (x.is_ascii_digit() && y.is_ascii_digit())
            .then(|| i64::from(x - b'0') * 10 + i64::from(y - b'0'))
    };
    let (secs, len) = match b.len() {
        3 => (two(1)? * 3600, 3),
        6 if b[3] == b':' => (two(1)? * 3600 + two(4)? * 60, 6),
        9 if b[3] == b':' && b[6] == b':' => (two(1)? * 3600 + two(4)? * 60 + two(7)?, 9),
        _ => return None,
    };
    (len == b.len()).then_some(sign * secs)
}

/// Unix seconds as RFC 3339 UTC (`2026-12-01T03:04:05Z`), for operator output of asynq's
/// second-resolution times.
pub fn unix_seconds_to_rfc3339(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(s: &str) -> Result<String, TimestampError> {
        let mut out = String::new();
        pg_timestamptz_to_rfc3339(s, &mut out).map(|()| out)
    }

    #[test]
    fn unix_seconds_format() {
        assert_eq!(unix_seconds_to_rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            unix_seconds_to_rfc3339(1_796_094_245),
            "2026-12-01T03:04:05Z"
        );
        assert_eq!(unix_seconds_to_rfc3339(-1), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn utc_with_fraction() {
        assert_eq!(
            conv("2026-11-29 10:15:30.123456+00").unwrap(),
            "2026-11-29T10:15:30.123456Z"
        );
        assert_eq!(
            conv("2026-11-29 10:15:30.120000+00").unwrap(),
            "2026-11-29T10:15:30.12Z"
        );
        assert_eq!(
            conv("2026-11-29 10:15:31+00").unwrap(),
            "2026-11-29T10:15:31Z"
        );
        assert_eq!(
            conv("2026-11-29T10:15:31.000+00:00").unwrap(),
            "2026-11-29T10:15:31Z"
        );
    }

    #[test]
    fn offsets_are_converted_to_utc() {
        assert_eq!(
            conv("2026-01-01 01:30:00+05:30").unwrap(),
            "2025-12-31T20:00:00Z"
        );
        assert_eq!(
            conv("2024-02-28 20:00:00.5-08").unwrap(),
            "2024-02-29T04:00:00.5Z"
        );
        assert_eq!(
            conv("1970-01-01 00:00:10+00:00:10").unwrap(),
            "1970-01-01T00:00:00Z"
        );
    }

    #[test]
    fn rejects_what_go_cannot_represent_or_we_cannot_read() {
        for bad in [
            "infinity",
            "-infinity",
            "2026-13-01 00:00:00+00",
            "2026-02-30 00:00:00+00",
            "2026-11-29 10:15:30",
            "2026-11-29 10:15:30.+00",
            "2026-11-29 10:15:30+0",
            "0000-01-01 00:00:00+01",
            "2026-11-29 10:15:30+00 BC",
            "20261-11-29 10:15:30+00",
        ] {
            assert!(conv(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn civil_round_trip() {
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
