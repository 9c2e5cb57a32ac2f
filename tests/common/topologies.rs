//! Valkey as a cluster and behind Sentinel, started by the project's scripts
//! (`valkey-cluster-start.sh`, `valkey-sentinel-start.sh`); failovers; a producer that commits
//! events continuously and records what it committed.

use super::certs::Certs;
use super::{script, scripts, tmp_dir, PATIENCE};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// `redis-cli -h 127.0.0.1 -p PORT ARGS...`: its stdout, or None if it failed.
pub fn cli(port: u16, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.success() && !text.starts_with("ERR") && !text.contains("Could not connect"))
        .then_some(text)
}

/// `KEY:value` of an INFO section.
pub fn info_field(info: &str, key: &str) -> Option<String> {
    info.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{key}:")).map(str::to_owned))
}

/// Polls `f` every 100 ms until it is true; panics after [`PATIENCE`].
pub async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The server directories (with `port` and `redis.pid`) under `dir`.
fn server_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("port").exists())
        .collect();
    out.sort();
    out
}

fn port_of(server: &Path) -> u16 {
    std::fs::read_to_string(server.join("port"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// SIGKILLs the server listening on `port` among those under `dir`.
fn kill_server(dir: &Path, port: u16) {
    let server = server_dirs(dir)
        .into_iter()
        .find(|s| port_of(s) == port)
        .unwrap_or_else(|| panic!("no server on port {port} under {}", dir.display()));
    let pid = std::fs::read_to_string(server.join("redis.pid")).unwrap();
    let status = std::process::Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -KILL {}", pid.trim());
}

/// Stops writes on `primary` (`CLIENT PAUSE ... WRITE`: writes wait, unanswered), waits until
/// `replica` has everything the primary has, then SIGKILLs the primary. Every write the primary
/// ever answered is then on the replica: what a later failover loses is only what was never
/// acknowledged. (Without the pause, asynchronous replication may lose acknowledged writes
/// when a primary dies: Valkey's durability, not the relay's.)
pub async fn kill_primary_in_sync(dir: &Path, primary: u16, replica: u16) {
    cli(primary, &["CLIENT", "PAUSE", "60000", "WRITE"]).expect("CLIENT PAUSE");
    until("the replica caught up with the paused primary", || {
        let Some(p) = cli(primary, &["INFO", "replication"]) else {
            return false;
        };
        let Some(r) = cli(replica, &["INFO", "replication"]) else {
            return false;
        };
        let p: u64 = info_field(&p, "master_repl_offset")
            .and_then(|v| v.parse().ok())
            .unwrap_or(u64::MAX);
        let r: u64 = info_field(&r, "slave_repl_offset")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        r >= p
    })
    .await;
    kill_server(dir, primary);
}

/// A node of `CLUSTER NODES`.
#[derive(Debug, Clone)]
pub struct ClusterNode {
    pub id: String,
    pub port: u16,
    pub primary: bool,
    pub failed: bool,
    /// Of a replica: its primary's id.
    pub primary_id: Option<String>,
    pub slots: Vec<(u16, u16)>,
}

/// A three-primary, three-replica cluster of this test alone.
pub struct ValkeyCluster {
    dir: PathBuf,
    /// The six nodes' URLs, comma-separated (the relay's seed list).
    pub urls: String,
    /// The certificates of a TLS-only cluster ([`start_tls`](Self::start_tls)).
    tls: Option<redis::TlsCertificates>,
}

impl ValkeyCluster {
    pub fn start() -> Self {
        let dir = tmp_dir("vcluster");
        let urls = script("valkey-cluster-start.sh", &[dir.to_str().unwrap()]);
        Self {
            dir,
            urls,
            tls: None,
        }
    }

    /// A cluster that speaks TLS only, with `certs`, and requires client certificates
    /// (`valkey-cluster-start.sh --tls`); `urls` are rediss://. The `cli` helpers and the
    /// failover methods do not work on it.
    pub fn start_tls(certs: &Certs) -> Self {
        let dir = tmp_dir("vcluster-tls");
        let urls = script(
            "valkey-cluster-start.sh",
            &[dir.to_str().unwrap(), "--tls", certs.dir.to_str().unwrap()],
        );
        Self {
            dir,
            urls,
            tls: Some(certs.valkey_tls()),
        }
    }

    /// A cluster connection of the test's own (routes by key; long timeouts).
    pub async fn conn(&self) -> redis::cluster_async::ClusterConnection {
        let seeds: Vec<&str> = self.urls.split(',').collect();
        let mut builder = redis::cluster::ClusterClientBuilder::new(seeds)
            .response_timeout(Duration::from_secs(60))
            .connection_timeout(Duration::from_secs(10));
        if let Some(certs) = &self.tls {
            builder = builder.certs(certs.clone());
        }
        builder
            .build()
            .unwrap()
            .get_async_connection()
            .await
            .unwrap()
    }

    fn ports(&self) -> Vec<u16> {
        server_dirs(&self.dir).iter().map(|s| port_of(s)).collect()
    }

    /// `CLUSTER NODES` as seen by the first node that answers.
    pub fn nodes(&self) -> Vec<ClusterNode> {
        let text = self
            .ports()
            .into_iter()
            .find_map(|p| cli(p, &["CLUSTER", "NODES"]))
            .expect("no cluster node answers");
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let addr = f[1].split('@').next().unwrap();
                let flags = f[2];
                ClusterNode {
                    id: f[0].to_owned(),
                    port: addr.rsplit(':').next().unwrap().parse().unwrap(),
                    primary: flags.contains("master"),
                    failed: flags.contains("fail"),
                    primary_id: (f[3] != "-").then(|| f[3].to_owned()),
                    slots: f[8..]
                        .iter()
                        .filter(|s| !s.starts_with('['))
                        .map(|s| match s.split_once('-') {
                            Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
                            None => (s.parse().unwrap(), s.parse().unwrap()),
                        })
                        .collect(),
                }
            })
            .collect()
    }

    /// The slot of `key`.
    pub fn slot(&self, key: &str) -> u16 {
        let port = self.ports()[0];
        cli(port, &["CLUSTER", "KEYSLOT", key])
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// The live primary serving `slot`.
    pub fn primary_of(&self, slot: u16) -> ClusterNode {
        self.nodes()
            .into_iter()
            .find(|n| {
                n.primary && !n.failed && n.slots.iter().any(|(a, b)| *a <= slot && slot <= *b)
            })
            .unwrap_or_else(|| panic!("no primary serves slot {slot}"))
    }

    /// A live replica of `primary`.
    pub fn replica_of(&self, primary: &ClusterNode) -> ClusterNode {
        self.nodes()
            .into_iter()
            .find(|n| !n.failed && n.primary_id.as_deref() == Some(&primary.id))
            .unwrap_or_else(|| panic!("{} has no live replica", primary.port))
    }

    /// Every live node reports `cluster_state:ok`, and `port` is a primary.
    fn healthy_with_primary(&self, port: u16, dead: &[u16]) -> bool {
        let role_ok = cli(port, &["ROLE"]).is_some_and(|r| r.starts_with("master"));
        role_ok
            && self
                .ports()
                .into_iter()
                .filter(|p| !dead.contains(p))
                .all(|p| {
                    cli(p, &["CLUSTER", "INFO"])
                        .is_some_and(|i| info_field(&i, "cluster_state").as_deref() == Some("ok"))
                })
            && self
                .nodes()
                .iter()
                .any(|n| n.port == port && n.primary && !n.slots.is_empty())
    }

    /// `CLUSTER FAILOVER` on `replica`: its primary stops taking writes, the replica catches
    /// up, and only then takes over; the old primary becomes its replica and answers MOVED.
    /// No acknowledged write is lost. Waits until the cluster is healthy again.
    pub async fn coordinated_failover(&self, replica: &ClusterNode) {
        let reply = cli(replica.port, &["CLUSTER", "FAILOVER"]).expect("CLUSTER FAILOVER");
        assert_eq!(reply.trim(), "OK");
        until("the coordinated failover completed", || {
            self.healthy_with_primary(replica.port, &[])
        })
        .await;
    }

    /// SIGKILLs `primary` once `replica` has all its writes (see [`kill_primary_in_sync`]),
    /// then waits until the cluster has promoted the replica on its own (node timeout 2 s).
    pub async fn kill_primary(&self, primary: &ClusterNode, replica: &ClusterNode) {
        kill_primary_in_sync(&self.dir, primary.port, replica.port).await;
        until("the cluster promoted the replica", || {
            self.healthy_with_primary(replica.port, &[primary.port])
        })
        .await;
    }
}

impl Drop for ValkeyCluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new(scripts().join("valkey-cluster-stop.sh"))
            .arg(&self.dir)
            .stderr(Stdio::null())
            .status();
    }
}

/// A primary, a replica and three sentinels of this test alone.
pub struct ValkeySentinel {
    dir: PathBuf,
    /// The sentinels' URLs, comma-separated.
    pub urls: String,
    /// The name the sentinels know the primary by.
    pub name: String,
    /// The certificates of a TLS-only setup (`--tls`).
    tls: Option<redis::TlsCertificates>,
}

impl ValkeySentinel {
    pub fn start() -> Self {
        Self::start_with(&[], None)
    }

    /// With more `valkey-sentinel-start.sh` options (`--sentinel-password-file FILE`), and
    /// TLS only with `certs` (`--tls`; `urls` are then rediss://). The `cli`-based methods
    /// (`primary_port`, `kill_primary`) work only on a plain setup without a password.
    pub fn start_with(options: &[&str], certs: Option<&Certs>) -> Self {
        let dir = tmp_dir("vsentinel");
        let mut args = vec![dir.to_str().unwrap()];
        args.extend_from_slice(options);
        if let Some(certs) = certs {
            args.extend(["--tls", certs.dir.to_str().unwrap()]);
        }
        let urls = script("valkey-sentinel-start.sh", &args);
        let name = std::fs::read_to_string(dir.join("name"))
            .unwrap()
            .trim()
            .to_owned();
        Self {
            dir,
            urls,
            name,
            tls: certs.map(Certs::valkey_tls),
        }
    }

    /// The port of the server started as the primary (the primary until a failover).
    pub fn first_primary_port(&self) -> u16 {
        port_of(&self.dir.join("primary"))
    }

    fn sentinel_ports(&self) -> Vec<u16> {
        server_dirs(&self.dir)
            .iter()
            .filter(|s| {
                s.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("sentinel")
            })
            .map(|s| port_of(s))
            .collect()
    }

    /// The primary's port as the first answering sentinel names it.
    pub fn primary_port(&self) -> u16 {
        let text = self
            .sentinel_ports()
            .into_iter()
            .find_map(|p| cli(p, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.name]))
            .expect("no sentinel answers");
        text.lines().nth(1).unwrap().trim().parse().unwrap()
    }

    /// The port of the other data server (the replica before a failover).
    pub fn replica_port(&self) -> u16 {
        let primary = self.primary_port();
        ["primary", "replica"]
            .iter()
            .map(|d| port_of(&self.dir.join(d)))
            .find(|p| *p != primary)
            .unwrap()
    }

    /// A connection to the server on `port` (with TLS on a TLS setup).
    pub async fn conn(&self, port: u16) -> redis::aio::MultiplexedConnection {
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_secs(60)))
            .set_connection_timeout(Some(Duration::from_secs(10)));
        let client = match &self.tls {
            Some(certs) => {
                redis::Client::build_with_tls(format!("rediss://127.0.0.1:{port}"), certs.clone())
            }
            None => redis::Client::open(format!("redis://127.0.0.1:{port}")),
        };
        client
            .unwrap()
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap()
    }

    /// SIGKILLs the primary once the replica has all its writes (see
    /// [`kill_primary_in_sync`]); waits until every sentinel names the replica as the primary
    /// and it says it is one. Returns the new primary's port.
    pub async fn kill_primary(&self) -> u16 {
        let (primary, replica) = (self.primary_port(), self.replica_port());
        kill_primary_in_sync(&self.dir, primary, replica).await;
        until("the sentinels promoted the replica", || {
            self.sentinel_ports().into_iter().all(|s| {
                cli(s, &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", &self.name])
                    .and_then(|t| t.lines().nth(1).map(|p| p.trim() == replica.to_string()))
                    .unwrap_or(false)
            }) && cli(replica, &["ROLE"]).is_some_and(|r| r.starts_with("master"))
        })
        .await;
        replica
    }
}

impl Drop for ValkeySentinel {
    fn drop(&mut self) {
        let _ = std::process::Command::new(scripts().join("valkey-sentinel-stop.sh"))
            .arg(&self.dir)
            .stderr(Stdio::null())
            .status();
    }
}

/// Commits outbox events continuously, cycling through event names and transaction sizes,
/// and records every committed `(event_name, event_id)` in commit order.
pub struct Producer {
    stop: CancellationToken,
    committed: Arc<AtomicUsize>,
    handle: tokio::task::JoinHandle<Vec<(String, String)>>,
}

impl Producer {
    pub fn start(url: &str, names: &[&str]) -> Self {
        let stop = CancellationToken::new();
        let committed = Arc::new(AtomicUsize::new(0));
        let (url, names) = (
            url.to_owned(),
            names.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
        );
        let (s, n) = (stop.clone(), committed.clone());
        let handle = tokio::spawn(async move {
            let mut client = super::connect(&url).await;
            let mut out = Vec::new();
            let sizes = [1usize, 5, 20, 3];
            let mut i = 0usize;
            while !s.is_cancelled() {
                let name = &names[i % names.len()];
                let size = sizes[i % sizes.len()];
                let ids = super::insert_events(&mut client, name, size, size).await;
                out.extend(ids.into_iter().map(|id| (name.clone(), id)));
                n.store(out.len(), Ordering::Relaxed);
                i += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            out
        });
        Self {
            stop,
            committed,
            handle,
        }
    }

    /// Events committed so far.
    pub fn committed(&self) -> usize {
        self.committed.load(Ordering::Relaxed)
    }

    /// Waits until `more` further events are committed.
    pub async fn wait_for_more(&self, more: usize) {
        let target = self.committed() + more;
        until(&format!("{target} events committed"), || {
            self.committed() >= target
        })
        .await;
    }

    /// Stops; the committed events in commit order.
    pub async fn stop(self) -> Vec<(String, String)> {
        self.stop.cancel();
        self.handle.await.unwrap()
    }
}

/// Waits until every expected id is in its queue's pending list (read through `conn`), then
/// asserts each list holds exactly its expected ids, each once. `expected`: queue -> ids.
pub async fn assert_each_delivered_once(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    expected: &HashMap<String, Vec<String>>,
) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    for (queue, ids) in expected {
        let pending = loop {
            let pending = super::pending_ids(conn, queue).await;
            let have: std::collections::HashSet<&String> = pending.iter().collect();
            let missing = ids.iter().filter(|id| !have.contains(id)).count();
            if missing == 0 {
                break pending;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "queue {queue}: {missing} of {} committed events never arrived",
                ids.len()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let mut sorted = pending.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            sorted.len(),
            pending.len(),
            "queue {queue}: an id was pushed twice"
        );
        assert_eq!(
            pending.len(),
            ids.len(),
            "queue {queue}: tasks that no committed event explains"
        );
    }
}
