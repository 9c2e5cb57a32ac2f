//! Several relays on one database: exactly one streams, the others stand by (and poll); when
//! the active one dies, another takes the slot, and no event is lost across the switch.

mod common;

use common::checker::{verify, Load, LoadSpec};
use common::*;
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A relay binary with a known metrics port.
struct Replica {
    process: RelayProcess,
    http: std::net::SocketAddr,
}

impl Replica {
    fn spawn(db: &TestDb, redis_url: &str) -> Self {
        let http: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let process = RelayProcess::spawn(
            db,
            redis_url,
            &[
                "--metrics-addr",
                &http.to_string(),
                "--recovery-grace",
                "2s",
                "--poll-interval",
                "200ms",
                "--health-interval",
                "200ms",
            ],
        );
        Self { process, http }
    }

    /// `outbox_stream_up`, `outbox_stream_standby`, or None while the endpoint is not up.
    async fn state(&self) -> Option<(f64, f64)> {
        let conn = tokio::net::TcpStream::connect(self.http).await.ok()?;
        drop(conn);
        let (status, text) = http_get(self.http, "/metrics").await;
        if status != 200 {
            return None;
        }
        Some((
            metric_value(&text, "outbox_stream_up")?,
            metric_value(&text, "outbox_stream_standby")?,
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_streams_and_another_takes_over_when_it_dies() {
    let db = TestDb::new("replicas").await;
    let redis = Redis::start();
    let mut replicas: Vec<Replica> = (0..3).map(|_| Replica::spawn(&db, &redis.url)).collect();
    let states = eventually("one streams, two stand by", || async {
        let mut states = Vec::new();
        for r in &replicas {
            states.push(r.state().await?);
        }
        let streaming = states.iter().filter(|s| s.0 == 1.0).count();
        let standby = states.iter().filter(|s| s.1 == 1.0).count();
        (streaming == 1 && standby == 2).then_some(states)
    })
    .await;
    let active = states.iter().position(|s| s.0 == 1.0).unwrap();
    // Every replica is ready: standbys deliver through their pollers.
    for r in &replicas {
        let (status, body) = http_get(r.http, "/readyz").await;
        assert_eq!(status, 200, "{body} {:?}", r.state().await);
    }

    let load = Load::start(&db.url, LoadSpec::default());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut dead = replicas.remove(active);
    dead.process.signal("KILL");
    let killed_at = Instant::now();
    let _ = dead.process.child.wait().await;
    eventually("another replica streams", || async {
        for r in &replicas {
            if r.state().await.is_some_and(|s| s.0 == 1.0) {
                return Some(());
            }
        }
        None
    })
    .await;
    let takeover = killed_at.elapsed();
    println!("REPLICA-TAKEOVER seconds={:.2}", takeover.as_secs_f64());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let result = load.stop().await;
    let v = verify("replica_takeover", &redis, &result, 1).await;
    assert!(v.ok(), "{v}");
}
