//! Several relays on one database: exactly one streams, the others stand by (and poll); when
//! the active one dies, another takes the slot, and no event is lost across the switch.

mod common;

use common::checker::{verify, Load, LoadSpec};
use common::filtered_replay;
use common::observed::{wait_for_more_tasks, ObservedRelay};
use common::*;
use std::time::{Duration, Instant};

/// A relay binary with a known metrics port.
struct Replica {
    relay: ObservedRelay,
}

/// Flags of every replica here: the standby checks every second and takes a silent slot over
/// after 3 s (so a load of several times that would show a live replica being touched).
const REPLICA: [&str; 6] = [
    "--poll-interval",
    "200ms",
    "--health-interval",
    "200ms",
    "--takeover-after",
    "3s",
];

/// A failing test shows what each replica logged.
impl Drop for Replica {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- replica log ({:?}):\n{}",
                self.relay.http,
                self.relay.process.log_text()
            );
        }
    }
}

impl Replica {
    fn spawn(db: &TestDb, redis_url: &str) -> Self {
        Self::spawn_with(db, redis_url, &["--recovery-grace", "2s"])
    }

    fn spawn_with(db: &TestDb, redis_url: &str, extra: &[&str]) -> Self {
        let relay = ObservedRelay::spawn(db, redis_url, &[&REPLICA[..], extra].concat());
        Self { relay }
    }

    /// `outbox_stream_up`, `outbox_stream_standby`, or None while the endpoint is not up.
    async fn state(&self) -> Option<(f64, f64)> {
        let text = self.relay.metrics().await?;
        Some((
            metric_value(&text, "outbox_stream_up")?,
            metric_value(&text, "outbox_stream_standby")?,
        ))
    }
}

/// The pid of the walsender holding the slot (0 when none does).
async fn active_pid(admin: &tokio_postgres::Client, slot: &str) -> i32 {
    admin
        .query_one(
            "SELECT coalesce(active_pid, 0) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
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
        let (status, body) = http_get(r.relay.http, "/readyz").await;
        assert_eq!(status, 200, "{body} {:?}", r.state().await);
    }

    let load = Load::start(&db.url, LoadSpec::default());
    let delivered = wait_for_more_tasks(&redis, "default", 0, 100).await;
    let mut dead = replicas.remove(active);
    dead.relay.signal("KILL");
    let killed_at = Instant::now();
    let _ = dead.relay.process.child.wait().await;
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
    wait_for_more_tasks(&redis, "default", delivered, 100).await;
    let result = load.stop().await;
    let v = verify("replica_takeover", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    // The replica that took over streams and no longer stands by.
    eventually("the new streamer's standby gauge is 0", || async {
        for r in &replicas {
            if r.state().await == Some((1.0, 0.0)) {
                return Some(());
            }
        }
        None
    })
    .await;
    // Standing by is a state, logged once at info, not an error every second.
    for r in &replicas {
        let log = r.relay.process.log_text();
        assert!(
            !log.contains("replication worker terminated with error"),
            "a standby logs its retries as errors:\n{log}"
        );
        if r.state().await == Some((0.0, 1.0)) {
            assert_eq!(log.matches("standing by").count(), 1, "{log}");
        }
    }
}

/// One replica streams while two stand by, under a load that lasts several times
/// `OUTBOX_TAKEOVER_AFTER` and includes a transaction that takes longer than that to deliver:
/// the streaming replica's walsender is never terminated (its pid never changes) and it never
/// reconnects. The standbys' recovery pollers deliver rows the stream left unpublished.
async fn a_live_replica_is_never_touched(least_privilege: bool) {
    let db = TestDb::new("live_replica").await;
    let lp;
    let relay_db = if least_privilege {
        lp = db.least_privilege_role().await;
        &lp
    } else {
        &db
    };
    let redis = Redis::start();
    // The active one alone has no poller: whatever a poller delivers, a standby delivered.
    let active = Replica::spawn_with(
        relay_db,
        &redis.url,
        &["--recovery", "false", "--on-slot-lost", "stop"],
    );
    active
        .relay
        .wait_metric("outbox_stream_up", |v| v == 1.0)
        .await;
    // The standbys' pollers take rows ten minutes old only: none of the load's.
    let standbys = [
        Replica::spawn_with(relay_db, &redis.url, &["--recovery-grace", "10m"]),
        Replica::spawn_with(relay_db, &redis.url, &["--recovery-grace", "10m"]),
    ];
    for s in &standbys {
        s.relay
            .wait_metric("outbox_stream_standby", |v| v == 1.0)
            .await;
    }
    let admin = db.client().await;
    let pid = active_pid(&admin, &db.slot).await;
    assert_ne!(pid, 0);

    let load = Load::start(&db.url, LoadSpec::default());
    let big = {
        let url = db.url.clone();
        tokio::spawn(async move {
            let mut c = connect(&url).await;
            insert_events(&mut c, "bulk.imported", 50_000, 50_000).await
        })
    };
    // Three times the takeover delay: the scenario's length, during which each standby checks
    // the slot's holder every second.
    let until = Instant::now() + Duration::from_secs(9);
    let mut samples = 0;
    while Instant::now() < until || !big.is_finished() {
        assert_eq!(
            active_pid(&admin, &db.slot).await,
            pid,
            "the live walsender was replaced"
        );
        samples += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let bulk = big.await.unwrap();
    let result = load.stop().await;
    let v = verify("live_replica", &redis, &result, 0, 0).await;
    assert!(v.ok_in_order(), "{v}");
    wait_pending(&redis, "default", result.committed.len() + bulk.len()).await;
    assert_eq!(
        active_pid(&admin, &db.slot).await,
        pid,
        "the live walsender was replaced"
    );
    let reconnects = active
        .relay
        .metric("outbox_reconnects_total{target=\"postgres\"}")
        .await
        .unwrap_or(0.0);
    assert_eq!(reconnects, 0.0, "the streaming replica reconnected");
    assert_eq!(active.state().await, Some((1.0, 0.0)));
    println!("LIVE-REPLICA samples={samples} pid={pid} least_privilege={least_privilege}");

    // Rows the stream delivered, made unpublished and old again: only the standbys' pollers
    // can send them (again: Valkey has them, so nothing is pushed twice).
    let polled = || async {
        let mut sum = 0.0;
        for s in &standbys {
            sum += s.relay.metric("outbox_poller_delivered_total").await?;
        }
        Some(sum)
    };
    let before = polled().await.unwrap();
    let unmarked = admin
        .execute(
            "UPDATE outbox_events SET published_at = NULL, created_at = created_at - interval '1 hour'
             WHERE id IN (SELECT id FROM outbox_events ORDER BY id LIMIT 200)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(unmarked, 200);
    eventually("the standbys' pollers deliver them", || async {
        polled().await.filter(|n| *n >= before + 200.0)
    })
    .await;
    let v = verify("live_replica_pollers", &redis, &result, 0, 0).await;
    assert!(v.ok_in_order(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_replica_is_never_touched_as_superuser() {
    a_live_replica_is_never_touched(false).await;
}

/// As the role of docs/least-privilege.sql.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_replica_is_never_touched_as_the_least_privilege_role() {
    a_live_replica_is_never_touched(true).await;
}

/// A long transaction that the publication filters almost entirely, with two replicas: while
/// the walsender replays it, it reads the active relay's status updates only every
/// `wal_sender_timeout / 2` (here 6 s), so `pg_stat_replication.reply_time` stands still. With
/// `--takeover-after 2s` below that silence, the standby must still not take the live holder for
/// a zombie (the server shows the holder busy decoding): before, it terminated the
/// holder, decoded the same transaction again, was terminated in turn by the other replica, and
/// the stream never got past the transaction. The test checks that the silence happened, that
/// the slot never changed hands, and that the event came through the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_filtered_replay_is_not_taken_for_a_zombie() {
    let db = TestDb::new("replay_replicas").await;
    filtered_replay::set_wal_sender_timeout(&db, "12s").await;
    filtered_replay::create_business_table(&db).await;
    let redis = Redis::start();
    let flags = ["--recovery-grace", "1h", "--takeover-after", "2s"];
    let a = Relay::start_streaming(run_args(&db, &redis.url, &flags)).await;
    let b = Relay::start(run_args(&db, &redis.url, &flags));
    eventually("the second relay stands by", || async {
        (b.metrics.stream_standby.get() == 1).then_some(())
    })
    .await;
    // Silence past the takeover delay plus the standby's one-second check: a standby looked
    // at a holder whose reply was older than its takeover delay.
    let needed = Duration::from_millis(3000);
    let replays = filtered_replay::replay_until_silent(&db, &redis, needed, async |n| {
        let rows = filtered_replay::replay_rows() << n;
        (rows, filtered_replay::commit_bulk_change(&db, rows).await)
    })
    .await;
    println!(
        "REPLICA-REPLAY {replays:?} reconnects a={} b={}",
        a.postgres_reconnects(),
        b.postgres_reconnects()
    );
    assert!(
        replays.longest_reply_silence() > needed,
        "the scenario did not happen: the walsender read replies at least every {:?}, even \
         after {} tries (raise OUTBOX_TEST_REPLAY_ROWS)",
        replays.longest_reply_silence(),
        filtered_replay::TRIES
    );
    let holders = replays.holders();
    assert_eq!(holders.len(), 1, "the slot changed hands: {holders:?}");
    assert_eq!(a.postgres_reconnects(), 0, "the live holder was cut");
    // Counted once Valkey's reply is back, which can be after the replay's watch saw the task.
    eventually(
        "the holder's stream counts the events it delivered",
        || async { (a.metrics.published.get() >= replays.events()).then_some(()) },
    )
    .await;
    assert_eq!(
        a.metrics.published.get(),
        replays.events(),
        "the events came through the holder's stream"
    );
    a.stop().await;
    b.stop().await;
}
