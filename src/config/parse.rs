//! The value parsers of the settings: durations, sizes, counts, identifiers, table names and
//! queue routes. Each error says what a valid value looks like; clap adds the setting's name.

use crate::pgoutput::TableName;
use crate::task::QueueRoute;
use std::time::Duration;

/// Parses `500ms`, `30s`, `1.5s`, `5m`, `24h`, `7d` (and combinations such as `1h30m`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty duration (use e.g. 500ms, 1.5s, 30s, 5m, 24h, 7d)".into());
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut nanos: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let (whole, fraction, after) = split_number(rest).ok_or_else(|| {
            format!("{s:?} is not a duration (use e.g. 500ms, 1.5s, 30s, 5m, 24h, 7d)")
        })?;
        let unit_len = after
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(after.len());
        let unit: u128 = match &after[..unit_len] {
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            "" => return Err(format!("{s:?} needs a unit (ms, s, m, h, d)")),
            u => return Err(format!("{s:?} has unknown unit {u:?} (use ms, s, m, h, d)")),
        };
        let n: u128 = whole
            .parse()
            .map_err(|_| format!("{s:?}: number too large"))?;
        // Digits past the nanosecond cannot matter: at most 18 are read, so nothing overflows.
        let digits = &fraction[..fraction.len().min(18)];
        let scale = 10u128.pow(u32::try_from(digits.len()).unwrap_or(18));
        let part: u128 = if digits.is_empty() {
            0
        } else {
            digits.parse().map_err(|_| format!("{s:?}: bad fraction"))?
        };
        nanos = nanos
            .saturating_add(n.saturating_mul(unit))
            .saturating_add(part * unit / scale);
        rest = &after[unit_len..];
    }
    let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
    let sub = u32::try_from(nanos % 1_000_000_000).unwrap_or(0);
    Ok(Duration::new(secs, sub))
}

/// `12.5ms` -> (`12`, `5`, `ms`): digits, then optionally a point and more digits. None when
/// `s` does not start with a digit, or the point has no digit after it.
fn split_number(s: &str) -> Option<(&str, &str, &str)> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if end == 0 {
        return None;
    }
    let (whole, rest) = s.split_at(end);
    let Some(after_point) = rest.strip_prefix('.') else {
        return Some((whole, "", rest));
    };
    let end = after_point
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(after_point.len());
    if end == 0 {
        return None;
    }
    let (fraction, rest) = after_point.split_at(end);
    Some((whole, fraction, rest))
}

/// A duration greater than zero.
pub fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

/// A whole number greater than zero.
pub fn parse_positive_usize(s: &str) -> Result<usize, String> {
    match s.trim().parse::<i64>() {
        Ok(n) if n > 0 => usize::try_from(n).map_err(|_| "too large".to_string()),
        Ok(_) => Err("must be greater than zero".into()),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

/// Bytes, with optional `KiB`/`MiB`/`GiB` (or `KB`/`MB`/`GB`, same meaning) suffix.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let n: usize = t[..split]
        .parse()
        .map_err(|_| format!("{s:?} is not a size (use e.g. 65536, 512KiB, 1MiB)"))?;
    let mult = match t[split..].trim() {
        "" | "B" => 1,
        "KiB" | "KB" | "k" | "K" => 1 << 10,
        "MiB" | "MB" | "M" => 1 << 20,
        "GiB" | "GB" | "G" => 1 << 30,
        u => return Err(format!("{s:?} has unknown unit {u:?} (use KiB, MiB, GiB)")),
    };
    let v = n
        .checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))?;
    if v == 0 {
        return Err("must be greater than zero".into());
    }
    Ok(v)
}

/// Queue routes, `name=queue` items separated by commas (empty: none).
#[derive(Debug, Clone, Default)]
pub struct QueueRoutes(pub Vec<QueueRoute>);

pub fn parse_routes(s: &str) -> Result<QueueRoutes, String> {
    s.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(QueueRoute::parse)
        .collect::<Result<Vec<_>, _>>()
        .map(QueueRoutes)
}

/// `table` or `schema.table`, plain lowercase names.
pub fn parse_table(s: &str) -> Result<TableName, String> {
    TableName::parse(s).ok_or_else(|| {
        format!("{s:?} is not a plain lowercase table name (`table` or `schema.table`)")
    })
}

/// A lowercase SQL identifier (slot and publication names are formatted into SQL).
pub fn parse_identifier(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} must be a lowercase identifier ([a-z_][a-z0-9_]*, at most 63 characters)"
        ))
    }
}

/// Any text but an empty or blank one.
pub fn parse_nonempty(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("must not be empty".into())
    } else {
        Ok(s.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("24h").unwrap(), Duration::from_secs(86_400));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        for bad in [
            "", "5", "s", "5x", "-5s", "5 s", "1.s", ".5s", "1.5", "1..5s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert!(parse_duration("5x")
            .unwrap_err()
            .contains("unknown unit \"x\""));
        assert!(parse_positive_duration("0s").is_err());
    }

    #[test]
    fn durations_take_decimals() {
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(
            parse_duration("1500ms").unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(parse_duration("0.25m").unwrap(), Duration::from_secs(15));
        assert_eq!(
            parse_duration("1.5h30m").unwrap(),
            Duration::from_secs(7200)
        );
        assert_eq!(parse_duration("0.5ms").unwrap(), Duration::from_micros(500));
        assert_eq!(
            parse_duration("1.0000000000000000000001s").unwrap(),
            Duration::from_secs(1)
        );
        assert!(parse_positive_duration("0.0s").is_err());
    }

    #[test]
    fn sizes_and_counts() {
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("512KiB").unwrap(), 512 << 10);
        assert_eq!(parse_size("100").unwrap(), 100);
        for bad in ["0", "-1", "1XB", "", "MiB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert!(parse_positive_usize("0").is_err());
        assert!(parse_positive_usize("-3").is_err());
        assert_eq!(parse_positive_usize("7").unwrap(), 7);
    }

    #[test]
    fn routes() {
        assert!(parse_routes("").unwrap().0.is_empty());
        assert!(parse_routes(" , ").unwrap().0.is_empty());
        assert_eq!(parse_routes("a=b, c.*=d").unwrap().0.len(), 2);
        assert!(parse_routes("a=b,oops").is_err());
    }

    #[test]
    fn identifiers() {
        assert!(parse_identifier("outbox_relay").is_ok());
        assert!(parse_identifier("Bad").is_err());
        assert!(parse_identifier("a;b").is_err());
    }
}
