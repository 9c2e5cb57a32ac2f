//! The command line: the global options, the subcommands and their own small settings, and
//! what each subcommand checks before anything connects.

use super::database::DatabaseArgs;
use super::parse::{
    parse_identifier, parse_nonempty, parse_positive_duration, parse_positive_usize,
};
use super::run::RunArgs;
use super::valkey::ValkeyArgs;
use super::ConfigError;
use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};
use std::time::Duration;

/// outbox-relay: delivers transactional-outbox rows from PostgreSQL to Valkey as asynq tasks.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about, long_about = None)]
pub struct Cli {
    /// Log format.
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    /// Worker threads of the async runtime. 0: everything runs on the main thread, with no
    /// hand-offs between threads (docs/benchmarks.md measures why this is the default).
    #[arg(
        long,
        env = "OUTBOX_WORKER_THREADS",
        default_value_t = 0,
        global = true
    )]
    pub worker_threads: usize,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stream outbox inserts into Valkey as asynq tasks (the relay's main job).
    Run(Box<RunArgs>),
    /// Create the outbox table (the Go kit's schema) and the publication; safe to run again.
    Migrate(MigrateArgs),
    /// Show the oldest pending tasks of a queue in Valkey, decoded.
    Peek(Box<PeekArgs>),
    /// List or retry rows that failed too often (dead letters).
    #[command(subcommand)]
    DeadLetters(DeadLettersCommand),
    /// Delete published rows older than a threshold, in bounded batches.
    Cleanup(CleanupArgs),
    /// Slot, publication, backlog, dead letters and Valkey queues at a glance.
    Status(Box<StatusArgs>),
    /// Where is an event: its row, the slot, its asynq task, and a verdict.
    Trace(Box<crate::trace::TraceArgs>),
    /// Enqueue published rows again (dry run unless --yes).
    Replay(Box<crate::replay::ReplayArgs>),
    /// Find published rows whose tasks Valkey lost, and re-enqueue them with --yes.
    Reconcile(Box<crate::reconcile::ReconcileArgs>),
}

#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub db: DatabaseArgs,
    #[command(flatten)]
    pub valkey: ValkeyArgs,
    /// The replication slot.
    #[arg(long, env = "OUTBOX_SLOT", default_value = "outbox_relay", value_parser = parse_identifier)]
    pub slot: String,
    /// The running relay's HTTP endpoint (the `run` setting of the same name): its /metrics
    /// show what it saw (timeline, slot changes, acknowledged position). Unreachable is
    /// reported, not an error.
    #[arg(long, env = "OUTBOX_METRICS_ADDR", default_value = "127.0.0.1:9187")]
    pub metrics_addr: std::net::SocketAddr,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum DeadLettersCommand {
    /// List dead letters.
    List {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Make dead letters deliverable again (after fixing them): `--all`, or `--event-id`.
    #[command(group(ArgGroup::new("which").required(true).args(["all", "event_id"])))]
    Retry {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Every dead letter.
        #[arg(long, conflicts_with = "event_id")]
        all: bool,
        /// Only these events, by event id (a UUID; repeatable).
        #[arg(long = "event-id", num_args = 1.., value_parser = crate::event_filter::parse_event_id)]
        event_id: Vec<String>,
    },
}

#[derive(Debug, Clone, Args)]
pub struct CleanupArgs {
    #[command(flatten)]
    pub db: DatabaseArgs,
    /// Delete rows published longer ago than this (e.g. 7d).
    #[arg(long, value_parser = parse_positive_duration)]
    pub older_than: Duration,
    /// Rows per DELETE.
    #[arg(long, default_value_t = 10_000, value_parser = parse_positive_usize)]
    pub batch: usize,
    /// Count the rows that would be deleted, and delete nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, Clone, Args)]
pub struct PeekArgs {
    #[command(flatten)]
    pub valkey: ValkeyArgs,
    /// The asynq queue.
    #[arg(long, env = "OUTBOX_QUEUE", default_value = "default", value_parser = parse_nonempty)]
    pub queue: String,
    /// How many tasks to show.
    #[arg(long, default_value_t = 20, value_parser = parse_positive_usize)]
    pub limit: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub db: DatabaseArgs,
    /// Also install the insert trigger that wakes poll-mode relays at once (LISTEN/NOTIFY).
    /// Not needed in stream mode; it serialises producers' commits.
    #[arg(long)]
    pub with_notify_trigger: bool,
}

impl Command {
    /// Settings that parse but cannot be used, refused before anything connects.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self {
            Command::Run(args) => args.validate(),
            Command::Migrate(args) => args.db.target().map(drop),
            Command::Peek(args) => args.valkey.target().map(drop),
            Command::DeadLetters(DeadLettersCommand::List { db, .. })
            | Command::DeadLetters(DeadLettersCommand::Retry { db, .. }) => db.target().map(drop),
            Command::Cleanup(args) => args.db.target().map(drop),
            Command::Status(args) => {
                args.db.target()?;
                args.valkey.target().map(drop)
            }
            Command::Trace(args) => {
                args.db.target()?;
                args.valkey.target().map(drop)
            }
            Command::Replay(args) => {
                args.db.target()?;
                args.valkey.target().map(drop)
            }
            Command::Reconcile(args) => args.validate(),
        }
    }
}
