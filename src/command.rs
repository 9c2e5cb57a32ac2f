//! What the subcommands fail with, and how the operator commands print their results. The
//! binary prints a [`CommandError`] with every cause on one line and exits with code 1.

use crate::config::ConfigError;
use crate::migrate::MigrateError;
use crate::postgres::PgError;
use crate::relay::RelayError;
use serde::Serialize;

/// A subcommand that failed after its settings were accepted.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Postgres(#[from] PgError),
    #[error(transparent)]
    Sql(#[from] tokio_postgres::Error),
    #[error("cannot reach Valkey at {at}")]
    ValkeyUnreachable {
        at: String,
        #[source]
        source: redis::RedisError,
    },
    #[error(transparent)]
    Valkey(#[from] redis::RedisError),
    #[error("outbox-relay migrate")]
    Migrate(#[source] MigrateError),
    #[error("cannot listen on OUTBOX_METRICS_ADDR {addr}")]
    Listen {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Relay(#[from] RelayError),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Operator(#[from] crate::operator::OperatorError),
}

/// Prints `value` to stdout: pretty JSON with `--json`, else as `render` lays it out.
pub fn print<T: Serialize + ?Sized>(
    json: bool,
    value: &T,
    render: impl FnOnce(&T) -> String,
) -> Result<(), CommandError> {
    if json {
        println!("{}", serde_json::to_string_pretty(value)?);
    } else {
        print!("{}", render(value));
    }
    Ok(())
}

/// `s` with the characters that would garble a terminal line shown as escapes: control
/// characters (`\n`, `\t`, `\r`, `\u{1b}`...) and the invisible marks that reorder text
/// (right-to-left marks and overrides). Text output only; JSON escapes on its own.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| {
        c.is_control()
            || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !s.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if unsafe_char(c) => out.push_str(&format!("\\u{{{:04x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn control_characters_and_direction_marks_are_escaped() {
        assert_eq!(printable("order.placed"), "order.placed");
        assert_eq!(printable("a\nb\tc\r"), "a\\nb\\tc\\r");
        assert_eq!(printable("x\u{1b}[31m"), "x\\u{001b}[31m");
        assert_eq!(printable("abc\u{202e}fed"), "abc\\u{202e}fed");
        assert_eq!(printable("\u{200f}evil"), "\\u{200f}evil");
        assert_eq!(printable("café ünïcode"), "café ünïcode");
    }
}
