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
