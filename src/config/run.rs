//! The settings of `outbox-relay run`: slot, queues and task options, batching and memory
//! bounds, the poller, marking, the HTTP endpoint and the health checks.

use super::database::DatabaseArgs;
use super::parse::{
    parse_duration, parse_identifier, parse_nonempty, parse_positive_duration,
    parse_positive_usize, parse_routes, parse_size, QueueRoutes,
};
use super::valkey::ValkeyArgs;
use super::ConfigError;
use crate::task::{PayloadFormat, TaskSettings};
use clap::{Args, ValueEnum};
use std::sync::Arc;
use std::time::Duration;

/// Settings of `outbox-relay run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub db: DatabaseArgs,
    #[command(flatten)]
    pub valkey: ValkeyArgs,
    /// The logical replication slot (pgoutput; created when missing).
    #[arg(long, env = "OUTBOX_SLOT", default_value = "outbox_relay", value_parser = parse_identifier)]
    pub slot: String,
    /// The asynq queue tasks go to unless a route matches.
    #[arg(long, env = "OUTBOX_QUEUE", default_value = "default", value_parser = parse_nonempty)]
    pub queue: String,
    /// Routes event names to queues: `order.placed=critical,user.*=low` (first match wins).
    #[arg(long, env = "OUTBOX_QUEUE_ROUTES", default_value = "", value_parser = parse_routes)]
    pub queue_routes: QueueRoutes,
    /// asynq MaxRetry of each task (n means n+1 attempts).
    #[arg(long, env = "OUTBOX_TASK_MAX_RETRY", default_value_t = 25, value_parser = clap::value_parser!(i32).range(0..))]
    pub task_max_retry: i32,
    /// asynq task timeout.
    #[arg(long, env = "OUTBOX_TASK_TIMEOUT", default_value = "30m", value_parser = parse_positive_duration)]
    pub task_timeout: Duration,
    /// How long asynq keeps a completed task, and so how long a replayed TaskID is deduplicated.
    /// Must exceed the longest window in which the relay can re-send an event.
    #[arg(long, env = "OUTBOX_TASK_RETENTION", default_value = "24h", value_parser = parse_duration)]
    pub task_retention: Duration,
    /// Task type prefix: the type is this plus the event name.
    #[arg(long, env = "OUTBOX_TASK_TYPE_PREFIX", default_value = "event:")]
    pub task_type_prefix: String,
    /// Task payload: the Go kit's Envelope JSON, or the row's payload alone.
    #[arg(long, env = "OUTBOX_PAYLOAD_FORMAT", value_enum, default_value_t = PayloadFormat::Envelope)]
    pub payload_format: PayloadFormat,
    /// Rows per Valkey round trip (and per poll).
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 500, value_parser = parse_positive_usize)]
    pub batch_size: usize,
    /// Batches written to Valkey but not yet confirmed, at most. Bounds memory with batch size.
    #[arg(long, env = "OUTBOX_MAX_INFLIGHT_BATCHES", default_value_t = 4, value_parser = parse_positive_usize)]
    pub max_inflight_batches: usize,
    /// Rows with a larger payload (bytes; KiB/MiB suffixes accepted) are not delivered.
    #[arg(long, env = "OUTBOX_MAX_PAYLOAD_BYTES", default_value = "1MiB", value_parser = parse_size)]
    pub max_payload_bytes: usize,
    /// On SIGINT/SIGTERM, how long in-flight writes may take before they are abandoned.
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    pub shutdown_timeout: Duration,
    /// `stream`: logical replication plus the recovery poller; `poll`: the poller alone, for
    /// PostgreSQL without wal_level=logical.
    #[arg(long, env = "OUTBOX_MODE", value_enum, default_value_t = Mode::Stream)]
    pub mode: Mode,
    /// The poller's idle delay (a full batch re-polls at once).
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "1s", value_parser = parse_positive_duration)]
    pub poll_interval: Duration,
    /// Poll loops in this process (each claims its own rows with SKIP LOCKED).
    #[arg(long, env = "OUTBOX_POLLERS", default_value_t = 1, value_parser = parse_positive_usize)]
    pub pollers: usize,
    /// In stream mode, the recovery poller takes only unpublished rows older than this.
    #[arg(long, env = "OUTBOX_RECOVERY_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub recovery_grace: Duration,
    /// In stream mode, run the recovery poller (backfill, lost slots, skipped rows).
    #[arg(long, env = "OUTBOX_RECOVERY", default_value_t = true, action = clap::ArgAction::Set)]
    pub recovery: bool,
    /// In stream mode, mark delivered rows published (so the recovery poller skips them).
    #[arg(long, env = "OUTBOX_MARK_PUBLISHED", default_value_t = true, action = clap::ArgAction::Set)]
    pub mark_published: bool,
    /// Delete delivered rows instead of marking them published (stream and poller). Far less
    /// WAL than the UPDATE (which the walsender must decode too), but no delivery history in
    /// the table, and the Go kit's poller, if still running, cannot tell delivered rows apart.
    #[arg(long, env = "OUTBOX_DELETE_DELIVERED", default_value_t = false, action = clap::ArgAction::Set)]
    pub delete_delivered: bool,
    /// Failed attempts after which a row becomes a dead letter.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 10, value_parser = clap::value_parser!(i32).range(1..))]
    pub max_attempts: i32,
    /// Delay before retrying a failed row; doubles per attempt, at most an hour.
    #[arg(long, env = "OUTBOX_ATTEMPT_BACKOFF", default_value = "10s", value_parser = parse_duration)]
    pub attempt_backoff: Duration,
    /// What to do when the slot is missing or invalidated (wal_status = lost): recreate it (the
    /// poller delivers what the stream missed) or stop with an error.
    #[arg(long, env = "OUTBOX_ON_SLOT_LOST", value_enum, default_value_t = OnSlotLost::Recreate)]
    pub on_slot_lost: OnSlotLost,
    /// Stream from this server instead, a hot standby of PostgreSQL 16+ (decoding on a standby):
    /// the slot lives there and the primary spends no CPU on decoding; SQL (setup, poller,
    /// marking) still goes to OUTBOX_DATABASE_URL. May contain a password.
    #[arg(long, env = "OUTBOX_REPLICATION_URL", value_name = "URL")]
    pub replication_url: Option<String>,
    /// A walsender holding the slot whose client has been silent this long is taken to be a
    /// zombie of a cut connection and terminated, so this relay can take the slot. A live
    /// relay answers every second, so a live replica is never touched.
    #[arg(long, env = "OUTBOX_TAKEOVER_AFTER", default_value = "15s", value_parser = parse_positive_duration)]
    pub takeover_after: Duration,
    /// In poll mode, LISTEN for the insert trigger's notifications to poll at once (install
    /// the trigger with `migrate --with-notify-trigger`).
    #[arg(long, env = "OUTBOX_POLL_NOTIFY", default_value_t = true, action = clap::ArgAction::Set)]
    pub poll_notify: bool,
    /// Delete published rows older than this, periodically (unset: never).
    #[arg(long, env = "OUTBOX_CLEANUP_OLDER_THAN", value_parser = parse_positive_duration)]
    pub cleanup_older_than: Option<Duration>,
    /// How often the periodic cleanup runs.
    #[arg(long, env = "OUTBOX_CLEANUP_INTERVAL", default_value = "1h", value_parser = parse_positive_duration)]
    pub cleanup_interval: Duration,
    /// Where /metrics, /healthz and /readyz are served (loopback unless set otherwise).
    #[arg(long, env = "OUTBOX_METRICS_ADDR", default_value = "127.0.0.1:9187")]
    pub metrics_addr: std::net::SocketAddr,
    /// How often pending rows, dead letters, slot lag and reachability are refreshed.
    #[arg(long, env = "OUTBOX_HEALTH_INTERVAL", default_value = "10s", value_parser = parse_positive_duration)]
    pub health_interval: Duration,
    /// How often to log a one-line summary at info: events delivered, their rate, slot lag,
    /// batches in flight, unpublished rows. `0`: never.
    #[arg(long, env = "OUTBOX_LOG_SUMMARY_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub log_summary_interval: Duration,
    /// Emit a heartbeat through the slot this often (stream mode; unset: off). Keeps an idle
    /// slot advancing and lets a stalled stream be noticed.
    #[arg(long, env = "OUTBOX_HEARTBEAT_INTERVAL", value_parser = parse_positive_duration)]
    pub heartbeat_interval: Option<Duration>,
    /// A heartbeat not back through the stream after this long marks the stream stalled.
    #[arg(long, env = "OUTBOX_STALL_AFTER", default_value = "60s", value_parser = parse_positive_duration)]
    pub stall_after: Duration,
    /// A link to Postgres silent this long counts as dead (a black hole sends no FIN or RST):
    /// the replication stream reconnects, SQL sockets give up (TCP_USER_TIMEOUT, keepalive),
    /// a health check that takes longer fails and /readyz turns not-ready. See
    /// docs/reliability.md, "Dead links".
    #[arg(long, env = "OUTBOX_LINK_TIMEOUT", default_value = "30s", value_parser = parse_positive_duration)]
    pub link_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    Stream,
    Poll,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnSlotLost {
    Recreate,
    Stop,
}

impl RunArgs {
    /// Checks what clap cannot: URLs parse. Runs before anything connects.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.db.target()?;
        self.valkey.target()?;
        // WAIT holds the connection: the writes queued on one (the stream's batches in flight,
        // or the pollers' chunks, each with its WAIT) are answered one after another, and the
        // last must be before OUTBOX_VALKEY_TIMEOUT, or it times out and everything in flight
        // is sent again, round after round (found by review).
        if let Some(wait) = self.valkey.replica_wait()? {
            let queued = self
                .max_inflight_batches
                .max(self.pollers)
                .saturating_add(1);
            let queued = u32::try_from(queued).unwrap_or(u32::MAX);
            if wait.timeout.saturating_mul(queued) >= self.valkey.valkey_timeout {
                return Err(ConfigError::Invalid {
                    setting: "OUTBOX_VALKEY_WAIT_TIMEOUT".into(),
                    reason: format!(
                        "{queued} writes may wait one after another on a connection \
                         (OUTBOX_MAX_INFLIGHT_BATCHES or OUTBOX_POLLERS, plus one): {queued} x \
                         {:?} must be less than OUTBOX_VALKEY_TIMEOUT ({:?})",
                        wait.timeout, self.valkey.valkey_timeout
                    ),
                });
            }
        }
        // A recreated slot starts after the events committed while it was gone: only the
        // recovery poller can deliver those, so recreating without it would lose them.
        if self.mode == Mode::Stream && !self.recovery && self.on_slot_lost == OnSlotLost::Recreate
        {
            return Err(ConfigError::Invalid {
                setting: "OUTBOX_RECOVERY".into(),
                reason: "false needs OUTBOX_ON_SLOT_LOST=stop: a recreated slot skips the events \
                         committed while it was gone, and only the recovery poller delivers them"
                    .into(),
            });
        }
        Ok(())
    }

    /// The task settings this configuration describes.
    pub fn task_settings(&self) -> TaskSettings {
        TaskSettings {
            type_prefix: self.task_type_prefix.clone(),
            payload_format: self.payload_format,
            default_queue: Arc::from(self.queue.as_str()),
            routes: self.queue_routes.0.clone(),
            max_retry: self.task_max_retry,
            timeout_secs: i64::try_from(self.task_timeout.as_secs())
                .unwrap_or(i64::MAX)
                .max(1),
            retention_secs: i64::try_from(self.task_retention.as_secs()).unwrap_or(i64::MAX),
            max_payload_bytes: self.max_payload_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Cli, Command};
    use crate::task::TaskSettings;
    use clap::Parser;

    fn parse(args: &[&str]) -> Command {
        let mut argv = vec!["outbox-relay"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().command
    }

    /// `run` given no task setting, and the operator commands that build the relay's tasks
    /// (`trace`, `replay`, `reconcile`, with their own copy of the flags), give
    /// `TaskSettings::default()`: what the benchmarks, the fuzzer and the tests take as the
    /// relay's defaults is what the relay runs with. (A run of the tests with `OUTBOX_QUEUE`
    /// or another task variable in its environment fails here, as it should.)
    #[test]
    fn the_task_flags_default_to_task_settings_default() {
        let db = "--database-url=postgres://h/d";
        let defaults = TaskSettings::default();
        let Command::Run(run) = parse(&["run", db]) else {
            panic!("not run")
        };
        assert_eq!(run.task_settings(), defaults);
        let Command::Trace(trace) = parse(&["trace", db, "--event-name", "x"]) else {
            panic!("not trace")
        };
        assert_eq!(trace.task.settings(), defaults);
        let Command::Replay(replay) = parse(&["replay", db, "--event-name", "x"]) else {
            panic!("not replay")
        };
        assert_eq!(replay.task.settings(), defaults);
        let Command::Reconcile(reconcile) = parse(&["reconcile", db, "--since", "1h"]) else {
            panic!("not reconcile")
        };
        assert_eq!(reconcile.task.settings(), defaults);
    }

    /// The replica wait's default fits the default timeouts; a wait that the writes queued on
    /// one connection would push past OUTBOX_VALKEY_TIMEOUT is refused before anything
    /// connects.
    #[test]
    fn a_replica_wait_that_queued_writes_push_past_the_valkey_timeout_is_refused() {
        let run = |extra: &[&str]| {
            let mut argv = vec!["run", "--database-url=postgres://u@h/d"];
            argv.extend_from_slice(extra);
            let Command::Run(run) = parse(&argv) else {
                panic!("not run")
            };
            run.validate()
        };
        run(&["--valkey-wait-replicas", "1"]).unwrap();
        let err = run(&["--valkey-wait-replicas", "1", "--valkey-wait-timeout", "1s"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("5 x 1s"), "{err}");
        let err = run(&[
            "--valkey-wait-replicas",
            "1",
            "--pollers",
            "9",
            "--valkey-timeout",
            "4s",
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("10 x 500ms"), "{err}");
        run(&["--valkey-wait-timeout", "1s"]).unwrap();
    }
}
