//! Command line and `OUTBOX_*` environment configuration, validated before anything connects.
//!
//! Every setting is a flag with an environment variable (the Go kit's `OUTBOX_` prefix). Values
//! that parse but make no sense (zero sizes, zero timeouts) are refused here with a message that
//! names the setting.

use crate::pgoutput::TableName;
use crate::task::{PayloadFormat, QueueRoute, TaskSettings};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::sync::Arc;
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
    Peek(PeekArgs),
    /// List or retry rows that failed too often (dead letters).
    #[command(subcommand)]
    DeadLetters(DeadLettersCommand),
    /// Delete published rows older than a threshold, in bounded batches.
    Cleanup(CleanupArgs),
    /// Slot, publication, backlog, dead letters and Valkey queues at a glance.
    Status(StatusArgs),
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
    /// Make dead letters deliverable again (after fixing them).
    Retry {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Every dead letter.
        #[arg(
            long,
            conflicts_with = "event_id",
            required_unless_present = "event_id"
        )]
        all: bool,
        /// Only these events (repeatable).
        #[arg(long = "event-id", num_args = 1..)]
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

/// Where the outbox lives.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL (postgres://user:password@host:port/dbname; sslmode, sslrootcert,
    /// sslcert and sslkey as in libpq).
    #[arg(
        long,
        env = "OUTBOX_DATABASE_URL",
        hide_env_values = true,
        required_unless_present = "database_url_file",
        conflicts_with = "database_url_file"
    )]
    pub database_url: Option<String>,
    /// A file holding the PostgreSQL URL instead (a mounted secret; a trailing newline is
    /// ignored).
    #[arg(long, env = "OUTBOX_DATABASE_URL_FILE", value_name = "PATH", value_parser = read_secret_file)]
    pub database_url_file: Option<SecretFile>,
    /// The outbox table, `table` or `schema.table`.
    #[arg(long, env = "OUTBOX_TABLE", default_value = "outbox_events", value_parser = parse_table)]
    pub table: TableName,
    /// The publication the slot streams (created when missing; inserts only).
    #[arg(long, env = "OUTBOX_PUBLICATION", default_value = "outbox_relay", value_parser = parse_identifier)]
    pub publication: String,
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

/// Valkey connection: `OUTBOX_VALKEY_URL`, or the Go kit's `VALKEY_*` settings.
#[derive(Debug, Clone, Args)]
pub struct ValkeyArgs {
    /// Valkey/Redis URL (redis://[user:password@]host:port/db). When unset, VALKEY_ADDR,
    /// VALKEY_PASSWORD and VALKEY_DB are used, as the Go kit does.
    #[arg(
        long,
        env = "OUTBOX_VALKEY_URL",
        hide_env_values = true,
        conflicts_with = "valkey_url_file"
    )]
    pub valkey_url: Option<String>,
    /// A file holding the Valkey URL(s) instead (a mounted secret; a trailing newline is
    /// ignored).
    #[arg(long, env = "OUTBOX_VALKEY_URL_FILE", value_name = "PATH", value_parser = read_secret_file)]
    pub valkey_url_file: Option<SecretFile>,
    /// host:port, used when OUTBOX_VALKEY_URL is unset.
    #[arg(long, env = "VALKEY_ADDR", default_value = "localhost:6379")]
    pub valkey_addr: String,
    /// Password, used when OUTBOX_VALKEY_URL is unset.
    #[arg(
        long,
        env = "VALKEY_PASSWORD",
        hide_env_values = true,
        conflicts_with = "valkey_password_file"
    )]
    pub valkey_password: Option<String>,
    /// A file holding the password instead (a trailing newline is ignored).
    #[arg(long, env = "VALKEY_PASSWORD_FILE", value_name = "PATH", value_parser = read_secret_file)]
    pub valkey_password_file: Option<SecretFile>,
    /// Database number, used when OUTBOX_VALKEY_URL is unset.
    #[arg(long, env = "VALKEY_DB", default_value_t = 0)]
    pub valkey_db: u32,
    /// How long one Valkey command may take before it counts as failed.
    #[arg(long, env = "OUTBOX_VALKEY_TIMEOUT", default_value = "5s", value_parser = parse_positive_duration)]
    pub valkey_timeout: Duration,
    /// Valkey/Redis Cluster: the URLs (comma-separated) are seed nodes; one reachable node is
    /// enough to find the others.
    #[arg(long, env = "OUTBOX_VALKEY_CLUSTER", default_value_t = false, action = clap::ArgAction::Set)]
    pub valkey_cluster: bool,
    /// Sentinel: connect to the primary the sentinels know by this name; the URLs
    /// (comma-separated) are then the sentinels', their user, password and database the primary's.
    #[arg(long, env = "OUTBOX_VALKEY_SENTINEL_MASTER")]
    pub valkey_sentinel_master: Option<String>,
    /// Password of the sentinels themselves, when they require one.
    #[arg(
        long,
        env = "OUTBOX_VALKEY_SENTINEL_PASSWORD",
        hide_env_values = true,
        conflicts_with = "valkey_sentinel_password_file"
    )]
    pub valkey_sentinel_password: Option<String>,
    /// A file holding the sentinels' password instead (a trailing newline is ignored).
    #[arg(long, env = "OUTBOX_VALKEY_SENTINEL_PASSWORD_FILE", value_name = "PATH", value_parser = read_secret_file)]
    pub valkey_sentinel_password_file: Option<SecretFile>,
    /// PEM file of the CA certificates that sign Valkey's TLS certificate (rediss:// URLs;
    /// without it, Mozilla's root certificates are trusted).
    #[arg(long, env = "OUTBOX_VALKEY_CA_FILE", value_name = "PATH")]
    pub valkey_ca_file: Option<PathBuf>,
    /// PEM client certificate (chain), for a Valkey with `tls-auth-clients`; with the key file.
    #[arg(
        long,
        env = "OUTBOX_VALKEY_CLIENT_CERT_FILE",
        value_name = "PATH",
        requires = "valkey_client_key_file"
    )]
    pub valkey_client_cert_file: Option<PathBuf>,
    /// PEM private key of the client certificate.
    #[arg(
        long,
        env = "OUTBOX_VALKEY_CLIENT_KEY_FILE",
        value_name = "PATH",
        requires = "valkey_client_cert_file"
    )]
    pub valkey_client_key_file: Option<PathBuf>,
}

impl ValkeyArgs {
    /// The URL to connect to, or the comma-separated URLs of cluster nodes or sentinels (may
    /// contain a password: never log it).
    pub fn url(&self) -> String {
        if let Some(url) = self.given_url() {
            return url.to_owned();
        }
        let password = self
            .valkey_password
            .as_deref()
            .or(self.valkey_password_file.as_ref().map(SecretFile::value));
        let auth = match password {
            Some(p) if !p.is_empty() => format!(":{}@", percent_encode(p)),
            _ => String::new(),
        };
        crate::valkey::split_urls(&self.valkey_addr)
            .iter()
            .map(|addr| format!("redis://{auth}{addr}/{}", self.valkey_db))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How the URLs are used: one server, cluster seed nodes, or sentinels.
    pub fn topology(&self) -> crate::valkey::Topology {
        use crate::valkey::Topology;
        match &self.valkey_sentinel_master {
            Some(master) => Topology::Sentinel {
                master: master.clone(),
                password: self.valkey_sentinel_password.clone().or_else(|| {
                    self.valkey_sentinel_password_file
                        .as_ref()
                        .map(|f| f.value().to_owned())
                }),
            },
            None if self.valkey_cluster => Topology::Cluster,
            None => Topology::Single,
        }
    }

    /// The validated target in its topology (no connection yet).
    pub fn target(&self) -> Result<crate::valkey::ValkeyTarget, ConfigError> {
        if self.valkey_cluster && self.valkey_sentinel_master.is_some() {
            return Err(ConfigError::Invalid {
                setting: "OUTBOX_VALKEY_CLUSTER",
                reason: "a cluster is not reached through sentinels: unset OUTBOX_VALKEY_CLUSTER \
                         or OUTBOX_VALKEY_SENTINEL_MASTER"
                    .into(),
            });
        }
        let setting = self.url_setting();
        crate::tls::install_default_provider();
        let certs = self.tls_certificates()?;
        crate::valkey::ValkeyTarget::new(&self.url(), &self.topology(), self.valkey_timeout, certs)
            .map_err(|reason| ConfigError::Invalid { setting, reason })
    }

    /// OUTBOX_VALKEY_URL, or the contents of OUTBOX_VALKEY_URL_FILE.
    fn given_url(&self) -> Option<&str> {
        self.valkey_url
            .as_deref()
            .or(self.valkey_url_file.as_ref().map(SecretFile::value))
    }

    /// The setting the URL comes from, for messages.
    fn url_setting(&self) -> &'static str {
        match (&self.valkey_url, &self.valkey_url_file) {
            (Some(_), _) => "OUTBOX_VALKEY_URL",
            (None, Some(_)) => "OUTBOX_VALKEY_URL_FILE",
            (None, None) => "VALKEY_ADDR/VALKEY_PASSWORD/VALKEY_DB",
        }
    }

    /// The CA and client certificate files, read and checked, for `rediss://` URLs. `None`
    /// when neither is set (a `rediss://` URL then trusts Mozilla's root certificates).
    pub fn tls_certificates(&self) -> Result<Option<redis::TlsCertificates>, ConfigError> {
        if self.valkey_ca_file.is_none() && self.valkey_client_cert_file.is_none() {
            return Ok(None);
        }
        let setting = if self.valkey_ca_file.is_some() {
            "OUTBOX_VALKEY_CA_FILE"
        } else {
            "OUTBOX_VALKEY_CLIENT_CERT_FILE"
        };
        let tls_url = self.given_url().is_some_and(|urls| {
            urls.split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .all(|u| u.starts_with("rediss://") || u.starts_with("valkeys://"))
        });
        if !tls_url {
            return Err(ConfigError::Invalid {
                setting,
                reason: "TLS needs rediss:// (or valkeys://) URLs in OUTBOX_VALKEY_URL".into(),
            });
        }
        // Parsed here too, so a bad file is named; redis parses the same bytes again.
        let pem = |path: &PathBuf,
                   setting: &'static str,
                   check: &dyn Fn(&std::path::Path) -> Result<(), String>| {
            check(path).map_err(|reason| ConfigError::Invalid { setting, reason })?;
            std::fs::read(path).map_err(|e| ConfigError::Invalid {
                setting,
                reason: format!("cannot read {}: {e}", path.display()),
            })
        };
        let root_cert = match &self.valkey_ca_file {
            Some(path) => Some(pem(path, "OUTBOX_VALKEY_CA_FILE", &|p| {
                crate::tls::root_store_from_file(p, "file").map(drop)
            })?),
            None => None,
        };
        let client_tls = match (&self.valkey_client_cert_file, &self.valkey_client_key_file) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: pem(cert, "OUTBOX_VALKEY_CLIENT_CERT_FILE", &|p| {
                    crate::tls::load_certs(p, "file").map(drop)
                })?,
                client_key: pem(key, "OUTBOX_VALKEY_CLIENT_KEY_FILE", &|p| {
                    crate::tls::load_key(p, "file").map(drop)
                })?,
            }),
            _ => None,
        };
        Ok(Some(redis::TlsCertificates {
            client_tls,
            root_cert,
        }))
    }

    /// The validated client (no connection yet).
    pub fn client(&self) -> Result<redis::Client, ConfigError> {
        crate::tls::install_default_provider();
        let setting = self.url_setting();
        let client = match self.tls_certificates()? {
            Some(certs) => redis::Client::build_with_tls(self.url(), certs),
            None => redis::Client::open(self.url()),
        };
        client.map_err(|e| ConfigError::Invalid {
            setting,
            reason: e.to_string(),
        })
    }

    /// Where Valkey is, without credentials, for messages.
    pub fn display(&self) -> String {
        let at = match self.given_url() {
            Some(url) => crate::valkey::split_urls(url)
                .into_iter()
                .map(redact_url)
                .collect::<Vec<_>>()
                .join(","),
            None => self.valkey_addr.clone(),
        };
        match self.topology() {
            crate::valkey::Topology::Single => at,
            crate::valkey::Topology::Cluster => format!("{at} (cluster)"),
            crate::valkey::Topology::Sentinel { master, .. } => {
                format!("{at} (sentinels of {master})")
            }
        }
    }
}

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
    /// Emit a heartbeat through the slot this often (stream mode; unset: off). Keeps an idle
    /// slot advancing and lets a stalled stream be noticed.
    #[arg(long, env = "OUTBOX_HEARTBEAT_INTERVAL", value_parser = parse_positive_duration)]
    pub heartbeat_interval: Option<Duration>,
    /// A heartbeat not back through the stream after this long marks the stream stalled.
    #[arg(long, env = "OUTBOX_STALL_AFTER", default_value = "60s", value_parser = parse_positive_duration)]
    pub stall_after: Duration,
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

impl DatabaseArgs {
    /// The database URL, from OUTBOX_DATABASE_URL or the file of OUTBOX_DATABASE_URL_FILE (may
    /// contain a password: never log it).
    pub fn url(&self) -> &str {
        match (&self.database_url, &self.database_url_file) {
            (Some(url), _) => url,
            (None, Some(file)) => file.value(),
            (None, None) => "",
        }
    }

    /// The parsed database URL.
    pub fn target(&self) -> Result<crate::postgres::PgTarget, ConfigError> {
        let setting = if self.database_url.is_none() && self.database_url_file.is_some() {
            "OUTBOX_DATABASE_URL_FILE"
        } else {
            "OUTBOX_DATABASE_URL"
        };
        crate::postgres::PgTarget::parse(self.url()).map_err(|e| ConfigError::Invalid {
            setting,
            reason: e.to_string(),
        })
    }
}

/// A secret read from a file (`*_FILE` settings): the contents with trailing line breaks
/// removed. Its `Debug` shows the path only.
#[derive(Clone)]
pub struct SecretFile {
    path: PathBuf,
    value: String,
}

impl SecretFile {
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    pub fn value(&self) -> &str {
        &self.value
    }
}

impl std::fmt::Debug for SecretFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretFile({})", self.path.display())
    }
}

/// Reads a `*_FILE` setting's file when the command line is parsed, so an unreadable file is a
/// configuration error (exit code 2) naming the setting. The message never quotes the contents.
pub fn read_secret_file(path: &str) -> Result<SecretFile, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let text = String::from_utf8(bytes).map_err(|_| format!("{path} is not UTF-8 text"))?;
    let value = text.trim_end_matches(['\n', '\r']).to_owned();
    if value.is_empty() {
        return Err(format!("{path} is empty"));
    }
    Ok(SecretFile {
        path: PathBuf::from(path),
        value,
    })
}

impl RunArgs {
    /// Checks what clap cannot: URLs parse. Runs before anything connects.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.db.target()?;
        self.valkey.target()?;
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

/// A setting that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid {setting}: {reason}")]
    Invalid {
        setting: &'static str,
        reason: String,
    },
}

/// Parses `500ms`, `30s`, `5m`, `24h`, `7d` (and combinations such as `1h30m`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty duration (use e.g. 500ms, 30s, 5m, 24h, 7d)".into());
    }
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!(
                "{s:?} is not a duration (use e.g. 500ms, 30s, 5m, 24h, 7d)"
            ));
        }
        let n: u64 = rest[..digits]
            .parse()
            .map_err(|_| format!("{s:?}: number too large"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            "h" => Duration::from_secs(n.saturating_mul(3600)),
            "d" => Duration::from_secs(n.saturating_mul(86_400)),
            "" => return Err(format!("{s:?} needs a unit (ms, s, m, h, d)")),
            u => return Err(format!("{s:?} has unknown unit {u:?} (use ms, s, m, h, d)")),
        };
        total = total.saturating_add(unit);
        rest = &rest[unit_len..];
    }
    Ok(total)
}

pub fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

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

fn parse_table(s: &str) -> Result<TableName, String> {
    TableName::parse(s).ok_or_else(|| {
        format!("{s:?} is not a plain lowercase table name (`table` or `schema.table`)")
    })
}

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

pub fn parse_nonempty(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("must not be empty".into())
    } else {
        Ok(s.to_owned())
    }
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A URL with its password replaced by `***`, for messages: the password of the authority,
/// and the `pass`/`password` query parameters (Unix-socket URLs carry it there).
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            let secret = |k: &str| matches!(k, "pass" | "password");
            if u.query_pairs().any(|(k, _)| secret(&k)) {
                let pairs: Vec<(String, String)> = u
                    .query_pairs()
                    .map(|(k, v)| {
                        let v = if secret(&k) {
                            "***".into()
                        } else {
                            v.into_owned()
                        };
                        (k.into_owned(), v)
                    })
                    .collect();
                u.query_pairs_mut().clear().extend_pairs(pairs);
            }
            u.to_string()
        }
        Err(_) => "<unparseable url>".into(),
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
        for bad in ["", "5", "s", "5x", "-5s", "1.5s", "5 s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert!(parse_positive_duration("0s").is_err());
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
    fn valkey_url_from_the_kit_settings() {
        let v = ValkeyArgs {
            valkey_url: None,
            valkey_addr: "cache:6380".into(),
            valkey_password: Some("p@ss word".into()),
            valkey_db: 3,
            valkey_timeout: Duration::from_secs(1),
            valkey_cluster: false,
            valkey_sentinel_master: None,
            valkey_sentinel_password: None,
            valkey_sentinel_password_file: None,
            valkey_url_file: None,
            valkey_password_file: None,
            valkey_ca_file: None,
            valkey_client_cert_file: None,
            valkey_client_key_file: None,
        };
        assert_eq!(v.url(), "redis://:p%40ss%20word@cache:6380/3");
        assert!(v.client().is_ok());
        assert!(!v.display().contains("ss"));
        let v = ValkeyArgs {
            valkey_url: Some("redis://u:secret@h:1/0".into()),
            ..v
        };
        assert_eq!(v.display(), "redis://u:***@h:1/0");
        assert_eq!(
            redact_url("redis+unix:///run/valkey.sock?db=2&pass=secret"),
            "redis+unix:///run/valkey.sock?db=2&pass=***"
        );
    }

    #[test]
    fn valkey_cluster_and_sentinel_url_lists() {
        let single = ValkeyArgs {
            valkey_url: Some("redis://:pw@a:1, redis://:pw@b:2".into()),
            valkey_addr: "localhost:6379".into(),
            valkey_password: None,
            valkey_db: 0,
            valkey_timeout: Duration::from_secs(1),
            valkey_cluster: false,
            valkey_sentinel_master: None,
            valkey_sentinel_password: None,
            valkey_sentinel_password_file: None,
            valkey_url_file: None,
            valkey_password_file: None,
            valkey_ca_file: None,
            valkey_client_cert_file: None,
            valkey_client_key_file: None,
        };
        // A list needs a topology that uses one.
        assert!(single.target().is_err());
        let cluster = ValkeyArgs {
            valkey_cluster: true,
            ..single.clone()
        };
        assert!(cluster.target().is_ok());
        assert_eq!(
            cluster.display(),
            "redis://:***@a:1,redis://:***@b:2 (cluster)"
        );
        let sentinel = ValkeyArgs {
            valkey_sentinel_master: Some("mymaster".into()),
            valkey_sentinel_password: Some("sentinel-secret".into()),
            ..single.clone()
        };
        assert!(sentinel.target().is_ok());
        assert!(!sentinel.display().contains("pw") && !sentinel.display().contains("secret"));
        assert!(sentinel.display().ends_with("(sentinels of mymaster)"));
        let both = ValkeyArgs {
            valkey_cluster: true,
            ..sentinel.clone()
        };
        assert!(both.target().is_err());
        // The kit's VALKEY_ADDR may list several nodes too.
        let kit = ValkeyArgs {
            valkey_url: None,
            valkey_addr: "a:1,b:2".into(),
            valkey_password: Some("p".into()),
            valkey_db: 0,
            ..cluster
        };
        assert_eq!(kit.url(), "redis://:p@a:1/0,redis://:p@b:2/0");
        assert!(kit.target().is_ok());
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
