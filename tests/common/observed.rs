//! The relay binary with a known metrics port, so a test can read its metrics (and its memory)
//! while it runs: what the fault suite asserts on instead of log wording or sleeps.

use super::{eventually, http_get, metric_value, RelayProcess, TestDb};

/// A free loopback port (free when asked; the relay binds it right after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The relay binary, its `/metrics` on a known address.
pub struct ObservedRelay {
    pub process: RelayProcess,
    pub http: std::net::SocketAddr,
}

impl ObservedRelay {
    pub fn spawn(db: &TestDb, redis_url: &str, extra: &[&str]) -> Self {
        let http: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let addr = http.to_string();
        let args = [&["--metrics-addr", addr.as_str()], extra].concat();
        let process = RelayProcess::spawn(db, redis_url, &args);
        Self { process, http }
    }

    /// Spawns it and waits until its stream is up (`outbox_stream_up` 1).
    pub async fn spawn_streaming(db: &TestDb, redis_url: &str, extra: &[&str]) -> Self {
        let relay = Self::spawn(db, redis_url, extra);
        relay.wait_metric("outbox_stream_up", |v| v == 1.0).await;
        relay
    }

    /// The metrics text, None while the endpoint does not answer.
    pub async fn metrics(&self) -> Option<String> {
        tokio::net::TcpStream::connect(self.http).await.ok()?;
        let (status, text) = http_get(self.http, "/metrics").await;
        (status == 200).then_some(text)
    }

    /// One unlabelled metric, None while the endpoint does not answer.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        metric_value(&self.metrics().await?, name)
    }

    /// Waits until metric `name` satisfies `ok`; returns its value.
    pub async fn wait_metric(&self, name: &str, ok: impl Fn(f64) -> bool) -> f64 {
        eventually(&format!("{name} as expected"), || async {
            self.metric(name).await.filter(|v| ok(*v))
        })
        .await
    }

    /// Resident memory now (VmRSS) in KiB.
    pub fn rss_kib(&self) -> u64 {
        proc_status_kib(&self.process, "VmRSS:")
    }

    /// Peak resident memory (VmHWM) in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        proc_status_kib(&self.process, "VmHWM:")
    }

    /// Open file descriptors (sockets included).
    pub fn open_fds(&self) -> usize {
        let pid = self.process.child.id().expect("running");
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    pub fn signal(&self, sig: &str) {
        self.process.signal(sig)
    }
}

fn proc_status_kib(p: &RelayProcess, field: &str) -> u64 {
    let pid = p.child.id().expect("running");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// The pid of the redis-server of `redis` (for SIGSTOP: a peer that accepts nothing and never
/// answers, a stand-in for a black-holed link).
pub fn redis_pid(redis: &super::Redis) -> u32 {
    let path = redis.dir().join("redis.pid");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    text.trim().parse().unwrap()
}

/// Resumes a SIGSTOPped process when dropped (a failed assertion included), so that it can be
/// stopped.
pub struct Resume(pub u32);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// Sends `sig` to process `pid`.
pub fn kill(sig: &str, pid: u32) {
    let ok = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(ok.success(), "kill -{sig} {pid}");
}

/// Waits until the pending list of `queue` holds at least `more` ids beyond `from`; returns its
/// length then. Progress to wait for between faults, so each one lands while tasks flow.
pub async fn wait_for_more_tasks(
    redis: &super::Redis,
    queue: &str,
    from: usize,
    more: usize,
) -> usize {
    let conn = redis.conn().await;
    let key = format!("asynq:{{{queue}}}:pending");
    eventually(&format!("{more} more tasks in {queue}"), || {
        let mut conn = conn.clone();
        let key = key.clone();
        async move {
            let n: usize = redis::cmd("LLEN")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .ok()?;
            (n >= from + more).then_some(n)
        }
    })
    .await
}
