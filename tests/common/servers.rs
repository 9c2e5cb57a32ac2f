//! Servers of the test run: the shared Postgres that scripts/test.sh starts, and Redis and
//! Postgres servers of one test alone (started, stopped and restarted by the project's own
//! scripts, on free loopback ports, under the run's temp directory).

use super::databases::connect;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

pub fn scripts() -> PathBuf {
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

pub fn script(name: &str, args: &[&str]) -> String {
    script_env(name, args, &[])
}

/// [`script`] with extra environment variables (e.g. `REDISCLI_AUTH`).
pub fn script_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> String {
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

impl OwnPg {
    /// A cluster where every role but the harness's `postgres` authenticates with SCRAM-SHA-256.
    pub async fn start_scram() -> Self {
        let pg = Self::start(&["-c", "password_encryption=scram-sha-256"]);
        pg.set_hba(
            "local all all trust\n\
             host all postgres 127.0.0.1/32 trust\n\
             host all all 127.0.0.1/32 scram-sha-256\n",
        )
        .await;
        pg
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

/// A free TCP port on loopback (free when asked; a server should take it soon).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The port of `scheme://[auth@]host:port[/db]`.
pub fn port_of(url: &str) -> &str {
    let after_host = url.rsplit('@').next().unwrap();
    let host_port = after_host.split('/').find(|p| p.contains(':')).unwrap();
    host_port.rsplit(':').next().unwrap()
}

/// `CONFIG SET name value` on a Redis server.
pub async fn config_set(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    name: &str,
    value: impl redis::ToRedisArgs,
) {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("CONFIG SET {name}: {e}"));
}
