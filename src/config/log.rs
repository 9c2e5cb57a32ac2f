//! The log filter: `OUTBOX_LOG`, else `RUST_LOG`, else `info`, checked like every other
//! setting. `tracing`'s `EnvFilter` takes any bare word as a target name, so a typo such as
//! `verbose` would switch every log off without a word; here it is refused instead.

use super::ConfigError;

/// The levels a bare directive may name.
const LEVELS: &[&str] = &["off", "error", "warn", "info", "debug", "trace"];

/// The filter directives to use and the variable they came from: `OUTBOX_LOG` wins over
/// `RUST_LOG`; neither set (or both blank) is `info`.
pub fn log_filter(outbox_log: Option<&str>, rust_log: Option<&str>) -> Result<String, ConfigError> {
    let given = [("OUTBOX_LOG", outbox_log), ("RUST_LOG", rust_log)]
        .into_iter()
        .find_map(|(var, v)| v.filter(|v| !v.trim().is_empty()).map(|v| (var, v)));
    let Some((var, value)) = given else {
        return Ok("info".into());
    };
    check(value).map_err(|reason| ConfigError::Invalid {
        setting: var.to_owned(),
        reason,
    })?;
    Ok(value.to_owned())
}

/// Refuses what `EnvFilter` refuses, and bare words that are not a level.
fn check(value: &str) -> Result<(), String> {
    for directive in value.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        // A bare word is a level, or a target at every level: only the relay's own module
        // paths are taken as targets (`outbox_relay`, `outbox_relay::replication`).
        let bare = !directive.contains(['=', '[', ':']) && directive != "outbox_relay";
        if bare && !LEVELS.contains(&directive.to_ascii_lowercase().as_str()) {
            return Err(format!(
                "{directive:?} is not a level ({}) nor `target=level` \
                 (e.g. `info,outbox_relay=debug`)",
                LEVELS.join(", ")
            ));
        }
    }
    tracing_subscriber::EnvFilter::builder()
        .parse(value)
        .map(drop)
        .map_err(|e| format!("{value:?}: {e} (e.g. `info,outbox_relay=debug`)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outbox_log_wins_over_rust_log_and_info_is_the_default() {
        assert_eq!(log_filter(None, None).unwrap(), "info");
        assert_eq!(log_filter(Some(" "), None).unwrap(), "info");
        assert_eq!(log_filter(None, Some("debug")).unwrap(), "debug");
        assert_eq!(log_filter(Some("warn"), Some("debug")).unwrap(), "warn");
        assert_eq!(
            log_filter(Some("info,outbox_relay::replication=debug"), None).unwrap(),
            "info,outbox_relay::replication=debug"
        );
        assert_eq!(log_filter(Some("WARN"), None).unwrap(), "WARN");
        assert_eq!(
            log_filter(Some("outbox_relay"), None).unwrap(),
            "outbox_relay"
        );
    }

    #[test]
    fn a_word_that_is_no_level_is_refused_naming_the_variable() {
        let e = log_filter(Some("verbose"), None).unwrap_err().to_string();
        assert!(e.starts_with("invalid OUTBOX_LOG: \"verbose\""), "{e}");
        assert!(e.contains("debug"), "{e}");
        let e = log_filter(None, Some("info,loud")).unwrap_err().to_string();
        assert!(e.starts_with("invalid RUST_LOG: \"loud\""), "{e}");
        let e = log_filter(Some("outbox_relay=loud"), None).unwrap_err();
        assert!(e.to_string().starts_with("invalid OUTBOX_LOG"), "{e}");
    }
}
