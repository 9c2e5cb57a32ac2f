//! The one way tests launch the relay: in-process ([`Relay`], with settings from [`run_args`])
//! or as the real binary ([`RelayProcess`] for `run`, [`run_command`] for the commands that end
//! by themselves). Every launch starts from a clean environment: no `OUTBOX_*` or `VALKEY_*`
//! variable of the developer's shell reaches the relay, only the settings the test gives.

use super::databases::TestDb;
use super::http::http_get;
use super::logs::init_logs;
use super::servers::{tmp_dir, Redis};
use super::waits::PATIENCE;
use clap::{CommandFactory, FromArgMatches};
use outbox_relay::config::{Cli, Command, RunArgs};
use outbox_relay::metrics::Metrics;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The relay's command line with every environment lookup removed.
fn without_env(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| a.env(None::<&'static str>))
        .mut_subcommands(without_env)
}

/// `outbox-relay run` settings for a test database and Redis, plus extra flags; the process
/// environment plays no part.
pub fn run_args(db: &TestDb, redis_url: &str, extra: &[&str]) -> RunArgs {
    let mut argv = vec![
        "outbox-relay",
        "run",
        "--database-url",
        &db.url,
        "--valkey-url",
        redis_url,
        "--slot",
        &db.slot,
    ];
    argv.extend_from_slice(extra);
    let matches = without_env(Cli::command())
        .try_get_matches_from(argv)
        .unwrap_or_else(|e| panic!("{e}"));
    match Cli::from_arg_matches(&matches).unwrap().command {
        Command::Run(args) => *args,
        _ => unreachable!(),
    }
}

/// A test's own migrated database (named after `prefix`) and Redis.
pub async fn database_and_redis(prefix: &str) -> (TestDb, Redis) {
    (TestDb::new(prefix).await, Redis::start())
}

/// A test's own migrated database and Redis, and the relay (in-process, with the `extra` flags)
/// streaming from the one to the other.
pub async fn streaming_relay(prefix: &str, extra: &[&str]) -> (TestDb, Redis, Relay) {
    let (db, redis) = database_and_redis(prefix).await;
    let relay = Relay::start_streaming(run_args(&db, &redis.url, extra)).await;
    (db, redis, relay)
}

/// The relay running in-process, with its HTTP endpoint on a free loopback port.
pub struct Relay {
    pub metrics: Arc<Metrics>,
    /// Where /metrics, /healthz and /readyz answer.
    pub http: std::net::SocketAddr,
    /// Cancelled to stop the relay (what SIGTERM does to the binary).
    token: CancellationToken,
    /// The relay's own task: its result once it ends.
    handle: tokio::task::JoinHandle<Result<(), outbox_relay::relay::RelayError>>,
}

impl Relay {
    pub fn start(args: RunArgs) -> Self {
        init_logs();
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Arc::new(Metrics::new(&mut registry));
        let token = CancellationToken::new();
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let http = std_listener.local_addr().unwrap();
        let listener = tokio::net::TcpListener::from_std(std_listener).unwrap();
        tokio::spawn(outbox_relay::http::serve(
            listener,
            Arc::new(registry),
            metrics.clone(),
            token.clone(),
        ));
        let (m, t) = (metrics.clone(), token.clone());
        let handle = tokio::spawn(async move { outbox_relay::relay::run(&args, m, t).await });
        Self {
            metrics,
            http,
            token,
            handle,
        }
    }

    /// How often the stream reconnected to Postgres.
    pub fn postgres_reconnects(&self) -> u64 {
        self.metrics
            .reconnects
            .get_or_create(&outbox_relay::metrics::TargetLabel { target: "postgres" })
            .get()
    }

    /// GET `path` from the relay's HTTP endpoint: (status, body).
    pub async fn get(&self, path: &str) -> (u16, String) {
        http_get(self.http, path).await
    }

    /// Starts the relay and waits until its stream is up (rows committed before the slot
    /// exists are the poller's backfill, not the stream's).
    pub async fn start_streaming(args: RunArgs) -> Self {
        let relay = Self::start(args);
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while relay.metrics.stream_up.get() != 1 {
            if relay.handle.is_finished() {
                let result = relay.handle.await;
                panic!("the relay stopped before streaming: {result:?}");
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "gave up waiting for the stream"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        relay
    }

    /// SIGTERM-equivalent: cancels and waits for a clean exit.
    pub async fn stop(self) {
        self.token.cancel();
        self.handle.await.unwrap().unwrap();
    }

    /// The relay's result if it ended on its own.
    pub async fn join(self) -> Result<(), outbox_relay::relay::RelayError> {
        self.handle.await.unwrap()
    }

    /// Runs a relay that must fail (at start-up, or when `args` make it stop); returns its
    /// error with every cause.
    pub async fn failure(args: RunArgs) -> String {
        // A relay that does not stop fails the test instead of hanging it (a hang guard, far
        // above any refusal's time, not a measurement).
        let err = tokio::time::timeout(Duration::from_secs(300), Self::start(args).join())
            .await
            .expect("the relay should have failed, and was still running after 300 s")
            .expect_err("the relay should have failed");
        outbox_relay::error_chain(&err)
    }
}

/// The relay binary, with none of the caller's `OUTBOX_*`/`VALKEY_*` variables, nor `RUST_LOG`.
pub fn relay_command() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    for (k, _) in std::env::vars_os() {
        let name = k.to_string_lossy();
        if name.starts_with("OUTBOX_") || name.starts_with("VALKEY_") || name == "RUST_LOG" {
            c.env_remove(&k);
        }
    }
    c.stdin(Stdio::null());
    c
}

/// Runs a command of the binary to its end with the settings in `env`: (exit code, stdout,
/// stderr).
pub fn run_command(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = relay_command()
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// [`run_command`] that must succeed: its stdout.
pub fn run_command_ok(args: &[&str], env: &[(&str, &str)]) -> String {
    let (code, out, err) = run_command(args, env);
    assert_eq!(code, 0, "outbox-relay {args:?}: {err}");
    out
}

/// The settings that point the binary at a test database and Redis.
pub fn relay_env<'a>(db: &'a TestDb, redis_url: &'a str) -> [(&'static str, &'a str); 3] {
    [
        ("OUTBOX_DATABASE_URL", &db.url),
        ("OUTBOX_VALKEY_URL", redis_url),
        ("OUTBOX_SLOT", &db.slot),
    ]
}

/// `outbox-relay run` as a process, its stdout and stderr in a log file.
pub struct RelayProcess {
    pub child: tokio::process::Child,
    pub log: PathBuf,
}

/// A test that fails while the relay process runs shows the end of the relay's own log: the
/// process writes to a file the test would otherwise never print (a stress run once left a
/// relay silent after its migrations, with nothing to say where it waited).
impl Drop for RelayProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            eprintln!(
                "---- the relay's log ({}), last {} lines ----\n{}",
                self.log.display(),
                tail.len(),
                tail.join("\n")
            );
        }
    }
}

impl RelayProcess {
    /// `outbox-relay run` with the settings in `env` and the `extra` flags.
    pub fn spawn_env(env: &[(&str, &str)], extra: &[&str]) -> Self {
        let log = tmp_dir("relay-log").join("relay.log");
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd: tokio::process::Command = relay_command().into();
        let child = cmd
            .arg("run")
            .args(extra)
            .envs(env.iter().copied())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self { child, log }
    }

    /// `outbox-relay run` for a test database and Redis, its HTTP endpoint on a free port.
    pub fn spawn(db: &TestDb, redis_url: &str, extra: &[&str]) -> Self {
        let mut env = relay_env(db, redis_url).to_vec();
        env.push(("OUTBOX_METRICS_ADDR", "127.0.0.1:0"));
        Self::spawn_env(&env, extra)
    }

    /// Spawns the binary and waits until it holds the slot.
    pub async fn spawn_streaming(db: &TestDb, redis_url: &str, extra: &[&str]) -> Self {
        let mut p = Self::spawn(db, redis_url, extra);
        p.wait_streaming(db).await;
        p
    }

    /// Waits until the relay's walsender streams from the slot, failing at once if it exits
    /// instead. (The slot's `active` flag alone is also set while the relay CREATES the slot,
    /// by an SQL backend, before its consistent point: rows committed then are not in the
    /// stream, and a test that wrote them at that moment waited for ever with the poller off.)
    pub async fn wait_streaming(&mut self, db: &TestDb) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        let c = db.client().await;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the relay exited ({status}): {}", self.log_text());
            }
            let streaming = c
                .query_opt(super::databases::SLOT_STREAMED, &[&db.slot])
                .await
                .unwrap()
                .is_some();
            if streaming {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "gave up waiting for the stream"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits for the process to end by itself: its exit code.
    pub async fn exit_code(&mut self) -> i32 {
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the relay exits")
            .unwrap()
            .code()
            .unwrap_or(-1)
    }

    /// SIGTERM, then waits for a clean exit: the log.
    pub async fn terminate(mut self) -> String {
        self.signal("TERM");
        let status = tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the relay stops on SIGTERM")
            .unwrap();
        assert!(status.success(), "clean exit: {}", self.log_text());
        self.log_text()
    }

    pub fn signal(&self, sig: &str) {
        let pid = self.child.id().expect("running").to_string();
        let ok = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &pid])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Peak resident memory (VmHWM) in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        let pid = self.child.id().expect("running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}
