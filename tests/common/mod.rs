//! Test harness: real Postgres and Redis started by the project's own scripts, a database per
//! test, the relay in-process or as the real binary, and the asynq view of Valkey.
#![allow(dead_code)]

pub mod asynq_worker;
pub mod certs;
pub mod checker;
pub mod topologies;

use clap::Parser;
use outbox_relay::config::{Cli, Command, RunArgs};
use outbox_relay::metrics::Metrics;
use outbox_relay::pgoutput::TableName;
use outbox_relay::task::TaskMessage;
use prost::Message;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long a test waits for something that should happen; a liveness bound, not a speed check.
pub const PATIENCE: Duration = Duration::from_secs(120);

fn scripts() -> PathBuf {
    std::env::var_os("OUTBOX_TEST_SCRIPTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts"))
}

fn tmp_root() -> PathBuf {
    let root = std::env::var_os("OUTBOX_TEST_TMP")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/outbox-relay-test-local"));
    std::fs::create_dir_all(&root).unwrap();
    root
}

/// A fresh directory under the test temp root.
pub fn tmp_dir(prefix: &str) -> PathBuf {
    let dir = tmp_root().join(format!("{prefix}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn script(name: &str, args: &[&str]) -> String {
    script_env(name, args, &[])
}

/// [`script`] with extra environment variables (e.g. `REDISCLI_AUTH`).
fn script_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = std::process::Command::new(scripts().join(name))
        .args(args)
        .envs(env.iter().copied())
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {name}: {e}"));
    assert!(out.status.success(), "{name} {args:?} failed");
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// The shared Postgres of this test run (scripts/test.sh starts it).
pub fn shared_pg_url() -> String {
    std::env::var("OUTBOX_TEST_PG_URL")
        .expect("OUTBOX_TEST_PG_URL is unset: run the tests with scripts/test.sh")
}

/// A Redis server of this test alone, which it may stop and restart.
pub struct Redis {
    dir: PathBuf,
    pub url: String,
    /// The default user's password (`--requirepass`), if any; `url` carries it.
    password: Option<String>,
    /// More redis-server options, given again on a restart.
    extra: Vec<String>,
}

impl Redis {
    pub fn start() -> Self {
        Self::start_with(&[], None)
    }

    /// A server with more redis-server options (`--tls-port ...`), and with `password` as the
    /// default user's password (`--requirepass`); `url` then carries the password.
    pub fn start_with(extra: &[&str], password: Option<&str>) -> Self {
        let dir = tmp_dir("redis");
        let mut extra: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
        if let Some(p) = password {
            extra.extend(["--requirepass".to_owned(), p.to_owned()]);
        }
        let mut redis = Self {
            dir,
            url: String::new(),
            password: password.map(str::to_owned),
            extra,
        };
        let plain = redis.run_script("redis-start.sh", false);
        redis.url = match password {
            Some(p) => plain.replace("redis://", &format!("redis://:{p}@")),
            None => plain,
        };
        redis
    }

    /// The server's directory (its log is redis.log there).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    fn run_script(&self, name: &str, keep: bool) -> String {
        let dir = self.dir.to_str().unwrap();
        let mut args = vec![dir];
        if keep {
            args.push("--keep");
        }
        if name == "redis-start.sh" && !self.extra.is_empty() {
            args.push("--");
            args.extend(self.extra.iter().map(String::as_str));
        }
        let auth: Vec<(&str, &str)> = self
            .password
            .as_deref()
            .map(|p| ("REDISCLI_AUTH", p))
            .into_iter()
            .collect();
        script_env(name, &args, &auth)
    }

    /// Stops the server (its data is gone: Redis runs without persistence here).
    pub fn stop(&self) {
        self.run_script("redis-stop.sh", true);
    }

    /// Stops the server after writing its data to disk, so a restart keeps the tasks (a
    /// restart of a persistent Valkey, not a loss of its data).
    pub fn stop_saving(&self) {
        let port = std::fs::read_to_string(self.dir.join("port")).unwrap();
        let status = std::process::Command::new("redis-cli")
            .args(["-p", port.trim(), "shutdown", "save"])
            .envs(self.password.as_deref().map(|p| ("REDISCLI_AUTH", p)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success() || status.code() == Some(1));
        // Wait until it is gone, then let the stop script clean up its pid file.
        self.stop();
    }

    /// Starts it again on the same port (with the same options).
    pub fn restart(&self) {
        self.run_script("redis-start.sh", false);
    }

    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_secs(60)))
            .set_connection_timeout(Some(Duration::from_secs(10)));
        redis::Client::open(self.url.as_str())
            .unwrap()
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = std::process::Command::new(scripts().join("redis-stop.sh"))
            .arg(&self.dir)
            .envs(self.password.as_deref().map(|p| ("REDISCLI_AUTH", p)))
            .stderr(Stdio::null())
            .status();
    }
}

/// A Postgres cluster of this test alone (for restarts and special settings).
pub struct OwnPg {
    dir: PathBuf,
    pub url: String,
}

impl OwnPg {
    pub fn start(extra: &[&str]) -> Self {
        let dir = tmp_dir("pg");
        let mut args = vec![dir.to_str().unwrap()];
        if !extra.is_empty() {
            args.push("--");
            args.extend_from_slice(extra);
        }
        let url = script("pg-start.sh", &args);
        Self { dir, url }
    }

    pub fn stop(&self, mode: &str) {
        script("pg-stop.sh", &[self.dir.to_str().unwrap(), mode, "--keep"]);
    }

    pub fn restart(&self) {
        script("pg-start.sh", &[self.dir.to_str().unwrap()]);
    }

    /// The cluster's data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Replaces pg_hba.conf with `lines` and reloads the configuration. The superuser
    /// `postgres` should keep a line that lets the harness in over TCP without a password.
    pub async fn set_hba(&self, lines: &str) {
        let path = self.data_dir().join("pg_hba.conf");
        std::fs::write(&path, lines).unwrap_or_else(|e| panic!("write {path:?}: {e}"));
        let ok: bool = connect(&self.url)
            .await
            .query_one("SELECT pg_reload_conf()", &[])
            .await
            .unwrap()
            .get(0);
        assert!(ok, "pg_reload_conf");
        // The postmaster re-reads the file when it handles the signal, not before the call returns.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

impl Drop for OwnPg {
    fn drop(&mut self) {
        let _ = std::process::Command::new(scripts().join("pg-stop.sh"))
            .arg(&self.dir)
            .arg("immediate")
            .stderr(Stdio::null())
            .status();
    }
}

/// The password of [`TestDb::least_privilege_role`]'s roles.
pub const LEAST_PRIVILEGE_PASSWORD: &str = "lp-relay-pw";

/// A database of its own on a cluster, migrated, with a slot name unique in the cluster.
pub struct TestDb {
    pub url: String,
    pub name: String,
    pub slot: String,
}

/// Replaces the database name of a `postgres://...` URL.
pub fn with_db(url: &str, db: &str) -> String {
    let (base, _) = url.rsplit_once('/').unwrap();
    format!("{base}/{db}")
}

impl TestDb {
    /// A new migrated database on the shared cluster.
    pub async fn new(prefix: &str) -> Self {
        Self::on(&shared_pg_url(), prefix, true).await
    }

    pub async fn on(cluster_url: &str, prefix: &str, migrate: bool) -> Self {
        let name = format!(
            "{prefix}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        );
        let admin = connect(cluster_url).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let url = with_db(cluster_url, &name);
        if migrate {
            let mut c = connect(&url).await;
            outbox_relay::migrate::migrate(
                &mut c,
                &TableName::parse("outbox_events").unwrap(),
                "outbox_relay",
                false,
            )
            .await
            .unwrap();
        }
        Self {
            url,
            slot: format!("s_{name}"),
            name,
        }
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }

    /// The slot's confirmed_flush_lsn as a number, None without a slot.
    pub async fn confirmed_flush(&self) -> Option<u64> {
        let c = self.client().await;
        let row = c
            .query_opt(
                "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .unwrap()?;
        row.get::<_, Option<i64>>(0).map(|v| v as u64)
    }

    /// Terminates the walsender holding the slot and drops the slot before the relay can take
    /// it again (retrying until the drop wins the race).
    pub async fn drop_slot_under_relay(&self) {
        let admin = self.client().await;
        eventually("the slot is dropped", || async {
            let _ = admin
                .execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active",
                    &[&self.slot],
                )
                .await;
            admin
                .execute("SELECT pg_drop_replication_slot($1)", &[&self.slot])
                .await
                .ok()
                .map(|_| ())
        })
        .await
    }

    /// Waits until a walsender holds the slot.
    pub async fn wait_slot_active(&self) {
        eventually("the slot is active", || async {
            let c = self.client().await;
            let row = c
                .query_opt(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot],
                )
                .await
                .unwrap()?;
            row.get::<_, bool>(0).then_some(())
        })
        .await
    }

    /// A role made with exactly docs/least-privilege.sql (role, password and database names
    /// replaced), and this database as that role: the relay runs as it, while the test keeps
    /// using `self` (the owner) to insert rows and look.
    /// The name of the role [`least_privilege_role`](Self::least_privilege_role) creates.
    pub fn least_privilege_role_name(&self) -> String {
        format!("lp_{}", self.name)
    }

    pub async fn least_privilege_role(&self) -> TestDb {
        let role = self.least_privilege_role_name();
        let sql = std::fs::read_to_string(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/least-privilege.sql"),
        )
        .unwrap();
        assert!(sql.contains("CREATE ROLE outbox_relay LOGIN REPLICATION PASSWORD 'change-me'"));
        let sql = sql
            .replace("outbox_relay", &role)
            .replace("'change-me'", &format!("'{LEAST_PRIVILEGE_PASSWORD}'"))
            .replace("DATABASE shop", &format!("DATABASE {}", self.name));
        self.client().await.batch_execute(&sql).await.unwrap();
        let (scheme, rest) = self.url.split_once("://").unwrap();
        let (_, host_and_db) = rest.split_once('@').unwrap();
        TestDb {
            url: format!("{scheme}://{role}:{LEAST_PRIVILEGE_PASSWORD}@{host_and_db}"),
            name: self.name.clone(),
            slot: self.slot.clone(),
        }
    }

    /// The current WAL position as a number.
    pub async fn current_lsn(&self) -> u64 {
        let c = self.client().await;
        let row = c
            .query_one("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint", &[])
            .await
            .unwrap();
        row.get::<_, i64>(0) as u64
    }
}

pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"));
    tokio::spawn(conn);
    client
}

/// `outbox-relay run` settings for a test database and Redis, plus extra flags.
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
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Run(args) => *args,
        _ => unreachable!(),
    }
}

/// The relay running in-process, with its HTTP endpoint on a free loopback port.
pub struct Relay {
    pub metrics: Arc<Metrics>,
    /// Where /metrics, /healthz and /readyz answer.
    pub http: std::net::SocketAddr,
    token: CancellationToken,
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
        let err = Self::start(args)
            .join()
            .await
            .expect_err("the relay should have failed");
        outbox_relay::replication::stream::error_chain(&err)
    }
}

/// The real binary, for signals.
pub struct RelayProcess {
    pub child: tokio::process::Child,
    pub log: PathBuf,
}

impl RelayProcess {
    pub fn spawn(db: &TestDb, redis_url: &str, extra: &[&str]) -> Self {
        let log = tmp_dir("relay-log").join("relay.log");
        let file = std::fs::File::create(&log).unwrap();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .arg("run")
            .args(extra)
            .env("OUTBOX_DATABASE_URL", &db.url)
            .env("OUTBOX_VALKEY_URL", redis_url)
            .env("OUTBOX_SLOT", &db.slot)
            .env("OUTBOX_METRICS_ADDR", "127.0.0.1:0")
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self { child, log }
    }

    /// Spawns the binary and waits until it holds the slot.
    pub async fn spawn_streaming(db: &TestDb, redis_url: &str, extra: &[&str]) -> Self {
        let p = Self::spawn(db, redis_url, extra);
        db.wait_slot_active().await;
        p
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

/// Inserts `n` events in transactions of `per_txn` rows; returns their event ids in commit order.
pub async fn insert_events(
    client: &mut tokio_postgres::Client,
    name: &str,
    n: usize,
    per_txn: usize,
) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    let mut left = n;
    while left > 0 {
        let k = left.min(per_txn);
        let tx = client.transaction().await.unwrap();
        let rows = tx
            .query(
                "INSERT INTO outbox_events (event_id, event_name, payload, metadata)
                 SELECT gen_random_uuid(), $1, jsonb_build_object('n', g, 'note', 'x'), '{}'
                 FROM generate_series(1, $2::int) g ORDER BY g
                 RETURNING event_id::text",
                &[&name, &(k as i32)],
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        ids.extend(rows.iter().map(|r| r.get::<_, String>(0)));
        left -= k;
    }
    ids
}

/// The ids of a queue's pending list, oldest first (asynq LPUSHes and pops from the right).
pub async fn pending_ids(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    queue: &str,
) -> Vec<String> {
    const PAGE: isize = 50_000;
    let key = format!("asynq:{{{queue}}}:pending");
    let mut ids: Vec<String> = Vec::new();
    let mut start = 0isize;
    loop {
        let page: Vec<String> = redis::cmd("LRANGE")
            .arg(&key)
            .arg(start)
            .arg(start + PAGE - 1)
            .query_async(conn)
            .await
            .unwrap();
        let n = page.len();
        ids.extend(page);
        if (n as isize) < PAGE {
            break;
        }
        start += PAGE;
    }
    ids.reverse();
    ids
}

/// The task hash of `id`, decoded: (message, state, pending_since).
pub async fn task(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    queue: &str,
    id: &str,
) -> Option<(TaskMessage, String, String)> {
    let fields: std::collections::HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(format!("asynq:{{{queue}}}:t:{id}"))
        .query_async(conn)
        .await
        .unwrap();
    if fields.is_empty() {
        return None;
    }
    assert_eq!(
        fields.len(),
        3,
        "enqueue writes exactly msg, state, pending_since"
    );
    let msg = TaskMessage::decode(fields["msg"].as_slice()).unwrap();
    let state = String::from_utf8(fields["state"].clone()).unwrap();
    let since = String::from_utf8(fields["pending_since"].clone()).unwrap();
    Some((msg, state, since))
}

/// Waits until `f` returns Some, or panics after [`PATIENCE`] with `what`.
pub async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the pending list of `queue` holds at least `n` ids; returns them oldest first.
pub async fn wait_pending(redis: &Redis, queue: &str, n: usize) -> Vec<String> {
    let conn = redis.conn().await;
    eventually(&format!("{n} tasks in {queue}"), || {
        let mut conn = conn.clone();
        async move {
            let ids = pending_ids(&mut conn, queue).await;
            (ids.len() >= n).then_some(ids)
        }
    })
    .await
}

/// Relay logs to the test output (shown for failing tests).
pub fn init_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("OUTBOX_LOG")
                    .unwrap_or_else(|_| "info".into()),
            )
            .with_test_writer()
            .try_init();
    });
}

/// A minimal HTTP/1.1 GET: (status, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The value of an unlabelled metric in Prometheus text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}
