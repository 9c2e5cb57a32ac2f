//! Command line and `OUTBOX_*` environment configuration, validated before anything connects.
//!
//! Every setting is a flag with an environment variable (the Go kit's `OUTBOX_` prefix). Values
//! that parse but make no sense (zero sizes, zero timeouts) are refused here with a message that
//! names the setting.
//!
//! - [`cli`]: the command line, its subcommands and what each checks before connecting;
//!   [`cli_error`]: clap's errors naming the environment variable too.
//! - [`run`]: the settings of `outbox-relay run`.
//! - [`database`]: where the outbox lives; [`valkey`]: how Valkey is reached.
//! - [`secret`]: the one value-or-file secret type, and URLs with their password redacted.
//! - [`parse`]: the value parsers (durations, sizes, identifiers, routes).
//! - [`log`]: the log filter (`OUTBOX_LOG`, `RUST_LOG`), checked like the other settings.

pub mod cli;
pub mod cli_error;
pub mod database;
pub mod log;
pub mod parse;
pub mod run;
pub mod secret;
pub mod valkey;

pub use cli::{
    CleanupArgs, Cli, Command, DeadLettersCommand, LogFormat, MigrateArgs, PeekArgs, StatusArgs,
};
pub use database::DatabaseArgs;
pub use parse::{
    parse_duration, parse_identifier, parse_nonempty, parse_positive_duration,
    parse_positive_usize, parse_routes, parse_size, QueueRoutes,
};
pub use run::{Mode, OnSlotLost, RunArgs};
pub use secret::{redact_url, Secret};
pub use valkey::ValkeyArgs;

/// A setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid {setting}: {reason}")]
    Invalid { setting: String, reason: String },
}
