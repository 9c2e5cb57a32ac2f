//! Dead links: each link of the relay (the replication connection, the SQL pool, Valkey)
//! black-holed under load, through the fault proxy (tests/common/proxy.rs) and in the kernel
//! (iptables `DROP`, which only the socket options or the relay's own deadlines can find); a
//! stalled walsender; and added latency, which must not be taken for a dead link. Each test
//! waits for the relay to notice (its counters and `/readyz`), lets the link pass again, waits
//! for the relay to recover, and then checks with the fault suite's checker that every committed
//! event was delivered. Detection and recovery times are printed (`LINK-TIMES ...`), never
//! asserted.

mod common;

use common::checker::{verify, Load, LoadSpec};
use common::filtered_replay;
use common::proxy::{Fault, Proxy};
use common::*;
use outbox_relay::metrics::LinkLabel;
use std::time::{Duration, Instant};

/// Flags for quick detection and recovery in tests.
const FLAGS: [&str; 14] = [
    "--recovery-grace",
    "2s",
    "--poll-interval",
    "200ms",
    "--link-timeout",
    "3s",
    "--health-interval",
    "500ms",
    "--valkey-timeout",
    "1s",
    "--takeover-after",
    "2s",
    "--stall-after",
    "60s",
];

/// `db` reached through `proxy`.
fn through(db: &TestDb, proxy: &Proxy) -> TestDb {
    TestDb {
        url: proxy.url_through(&db.url),
        name: db.name.clone(),
        slot: db.slot.clone(),
    }
}

fn link_failures(relay: &Relay, link: &'static str) -> u64 {
    relay
        .metrics
        .link_failures
        .get_or_create(&LinkLabel { link })
        .get()
}

/// Waits (up to [`PATIENCE`]) until `f` holds; how long that took.
async fn until(what: &str, mut f: impl AsyncFnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < PATIENCE, "gave up waiting: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    start.elapsed()
}

async fn ready(relay: &Relay) -> bool {
    relay.get("/readyz").await.0 == 200
}

/// Waits until the relay delivered something (the load runs).
async fn delivering(relay: &Relay) {
    let before = relay.metrics.published.get() + relay.metrics.poller_delivered.get();
    until("events are delivered", async || {
        relay.metrics.published.get() + relay.metrics.poller_delivered.get() > before
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_passes_delays_black_holes_and_resets() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = echo.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = echo.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let proxy = Proxy::start(target).await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let mut buf = [0u8; 5];
    conn.write_all(b"hello").await.unwrap();
    conn.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hello");

    proxy.set(Fault::Delay(Duration::from_millis(200)));
    let sent = Instant::now();
    conn.write_all(b"slow!").await.unwrap();
    conn.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"slow!");
    // Both directions are delayed: the echo needs at least twice the delay.
    assert!(sent.elapsed() >= Duration::from_millis(400));
    // A delay is latency, not a queue of delays: chunks sent one after another are in flight
    // together, and each is held about the delay (a message read in several chunks is late
    // once, not once per chunk). Held one after another, the second chunk would wait about
    // twice the delay less the 50 ms between them.
    assert_eq!(proxy.most_chunks_held(), 1, "one chunk at a time so far");
    let delay = Duration::from_millis(1000);
    proxy.set(Fault::Delay(delay));
    for part in [b"one..", b"two..", b"three", b"four."] {
        conn.write_all(part).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut four = [0u8; 20];
    conn.read_exact(&mut four).await.unwrap();
    assert_eq!(&four, b"one..two..threefour.");
    assert!(
        proxy.most_chunks_held() >= 2,
        "chunks sent 50 ms apart under a 1 s delay were never in flight together"
    );
    assert!(
        proxy.longest_hold() < delay * 3 / 2,
        "a chunk was held {:?} under a {delay:?} delay: chunks waited for each other",
        proxy.longest_hold()
    );

    proxy.set(Fault::BlackHole);
    conn.write_all(b"held!").await.unwrap();
    let silent = tokio::time::timeout(Duration::from_millis(500), conn.read(&mut buf)).await;
    assert!(
        silent.is_err(),
        "a black hole forwards nothing and closes nothing"
    );
    proxy.set(Fault::Pass);
    conn.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"held!", "what was held goes on when the link passes");

    proxy.reset();
    let mut rest = Vec::new();
    let end = conn.read_to_end(&mut rest).await;
    assert!(
        matches!(&end, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "a reset closes with an RST: {end:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_replication_link_is_not_taken_for_a_dead_one() {
    let db = TestDb::new("l_idle").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&db.url).await;
    let mut flags = FLAGS.to_vec();
    flags[5] = "2s"; // --link-timeout
    let relay = Relay::start_streaming(run_args(&through(&db, &proxy), &redis.url, &flags)).await;
    // The server has nothing to send for several link timeouts: the idle status updates ask for
    // a reply, and the replies keep the link alive.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(link_failures(&relay, "replication"), 0);
    assert_eq!(relay.postgres_reconnects(), 0);
    assert_eq!(relay.metrics.stream_up.get(), 1);
    // And the stream still delivers.
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "idle.check", 3, 3).await;
    let pending = wait_pending(&redis, "default", 3).await;
    assert!(ids.iter().all(|id| pending.contains(id)));
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_replication_link_is_detected_and_healed_under_load() {
    let db = TestDb::new("l_repl").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&db.url).await;
    let relay = Relay::start_streaming(run_args(&through(&db, &proxy), &redis.url, &FLAGS)).await;
    let load = Load::start(&db.url, LoadSpec::default());
    delivering(&relay).await;

    proxy.set_replication(Fault::BlackHole);
    let detected = until("the dead replication link is detected", async || {
        link_failures(&relay, "replication") >= 1
    })
    .await;
    let not_ready = until("/readyz is not ready", async || !ready(&relay).await).await;
    assert_eq!(relay.metrics.stream_up.get(), 0);
    // Meanwhile the recovery poller delivers.
    delivering(&relay).await;

    proxy.set_replication(Fault::Pass);
    let recovered = until("the stream is back", async || {
        relay.metrics.stream_up.get() == 1 && ready(&relay).await
    })
    .await;
    delivering(&relay).await;
    let result = load.stop().await;
    println!(
        "LINK-TIMES link=replication detected_after_ms={} not_ready_after_ms={} recovered_after_ms={}",
        detected.as_millis(),
        (detected + not_ready).as_millis(),
        recovered.as_millis()
    );
    let v = verify("black_holed_replication_link", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_sql_link_turns_readyz_not_ready_and_heals() {
    let db = TestDb::new("l_sql").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&db.url).await;
    let relay = Relay::start_streaming(run_args(&through(&db, &proxy), &redis.url, &FLAGS)).await;
    let load = Load::start(&db.url, LoadSpec::default());
    delivering(&relay).await;

    proxy.set_sql(Fault::BlackHole);
    let detected = until("the dead SQL link is detected", async || {
        link_failures(&relay, "postgres") >= 1
    })
    .await;
    let (status, body) = relay.get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("postgres unreachable"), "{body}");
    // The replication link is not cut: the stream still delivers.
    delivering(&relay).await;

    proxy.set_sql(Fault::Pass);
    // The monitor did not hang: it sees Postgres again.
    let recovered = until("/readyz is ready again", async || ready(&relay).await).await;
    let result = load.stop().await;
    println!(
        "LINK-TIMES link=sql detected_after_ms={} recovered_after_ms={}",
        detected.as_millis(),
        recovered.as_millis()
    );
    let v = verify("black_holed_sql_link", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_postgres_server_is_detected_and_healed_under_load() {
    let db = TestDb::new("l_pg").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&db.url).await;
    let relay = Relay::start_streaming(run_args(&through(&db, &proxy), &redis.url, &FLAGS)).await;
    let load = Load::start(&db.url, LoadSpec::default());
    delivering(&relay).await;

    proxy.set(Fault::BlackHole);
    let detected = until("both Postgres links are found dead", async || {
        link_failures(&relay, "replication") >= 1 && link_failures(&relay, "postgres") >= 1
    })
    .await;
    let (status, body) = relay.get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("postgres unreachable"), "{body}");

    proxy.set(Fault::Pass);
    let recovered = until("the stream and /readyz are back", async || {
        relay.metrics.stream_up.get() == 1 && ready(&relay).await
    })
    .await;
    delivering(&relay).await;
    let result = load.stop().await;
    println!(
        "LINK-TIMES link=postgres_server detected_after_ms={} recovered_after_ms={}",
        detected.as_millis(),
        recovered.as_millis()
    );
    let v = verify("black_holed_postgres_server", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_valkey_holds_the_acknowledgement_and_heals_under_load() {
    let db = TestDb::new("l_valkey").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&redis.url).await;
    let relay = Relay::start_streaming(run_args(&db, &proxy.url_through(&redis.url), &FLAGS)).await;
    let load = Load::start(&db.url, LoadSpec::default());
    delivering(&relay).await;

    proxy.set(Fault::BlackHole);
    let errors = relay.metrics.write_errors.get();
    let detected = until("valkey writes time out", async || {
        relay.metrics.write_errors.get() > errors
    })
    .await;
    let not_ready = until("/readyz says valkey is unreachable", async || {
        let (status, body) = relay.get("/readyz").await;
        status == 503 && body.contains("valkey unreachable")
    })
    .await;
    assert!(link_failures(&relay, "valkey") >= 1);

    // A commit made now cannot reach Valkey: no acknowledgement may pass it.
    let mut c = db.client().await;
    let tx = c.transaction().await.unwrap();
    let row = tx
        .query_one(
            "WITH e AS (INSERT INTO outbox_events (event_id, event_name, payload, metadata) \
             VALUES (gen_random_uuid(), 'probe', '{}', '{}') RETURNING event_id::text) \
             SELECT event_id, (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint FROM e",
            &[],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (probe, inside): (String, i64) = (row.get(0), row.get(1));
    let inside = inside as u64;
    // Watch the acknowledgement through several more failed retries.
    let errors = relay.metrics.write_errors.get();
    while relay.metrics.write_errors.get() < errors + 3 {
        assert!(
            relay.metrics.acked_lsn.get() < inside,
            "acknowledged past a commit Valkey never confirmed"
        );
        assert!(db.confirmed_flush().await.unwrap() < inside);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    proxy.set(Fault::Pass);
    let recovered = until("the probe reaches valkey", async || {
        let mut conn = redis.conn().await;
        pending_ids(&mut conn, "default").await.contains(&probe)
    })
    .await;
    let result = load.stop().await;
    println!(
        "LINK-TIMES link=valkey detected_after_ms={} not_ready_after_ms={} recovered_after_ms={}",
        detected.as_millis(),
        (detected + not_ready).as_millis(),
        recovered.as_millis()
    );
    let v = verify("black_holed_valkey", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    until("the slot is acknowledged past the probe", async || {
        db.confirmed_flush().await.unwrap() >= inside
    })
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valkey_connection_whose_writes_time_out_is_replaced() {
    let db = TestDb::new("l_vreset").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&redis.url).await;
    // The stream alone delivers here: with the recovery poller's 2 s grace, the poller's write
    // on the other (shared) connection could deliver the rows first, before the stream's write
    // had timed out (seen under `stress --cpu 2` once the stream had a connection of its own).
    let mut flags = FLAGS.to_vec();
    flags[1] = "1h"; // --recovery-grace
    let relay = Relay::start_streaming(run_args(&db, &proxy.url_through(&redis.url), &flags)).await;
    let mut c = db.client().await;
    let first = insert_events(&mut c, "before.stall", 5, 5).await;
    wait_pending(&redis, "default", first.len()).await;

    // The flow in use dies (as one whose retransmissions back off after a black hole); a new
    // connection would get through. Only a relay that drops the stalled connection after a
    // timeout and makes a new one delivers while the old flow stays dead.
    let accepted = proxy.accepted();
    proxy.stall_open_connections();
    let ids = insert_events(&mut c, "during.stall", 5, 5).await;
    let replaced = until("the events arrive over a new connection", async || {
        let mut conn = redis.conn().await;
        let pending = pending_ids(&mut conn, "default").await;
        ids.iter().all(|id| pending.contains(id))
    })
    .await;
    assert!(proxy.accepted() > accepted, "a new connection was made");
    assert!(
        relay.metrics.write_errors.get() >= 1,
        "the old one timed out first"
    );
    println!(
        "LINK-TIMES link=valkey_stalled_connection replaced_and_delivered_after_ms={}",
        replaced.as_millis()
    );
    proxy.set(Fault::Pass);
    relay.stop().await;
}

/// The silence a filtered replay's test needs: longer than the `--link-timeout 3s`, with room.
const REPLAY_SILENCE: Duration = Duration::from_millis(3500);

/// Checks what a filtered replay's test saw: the silence happened (the holder's `reply_time`
/// stood still for [`REPLAY_SILENCE`]), the link was kept, once found silent while its
/// walsender was busy, and the events came through the stream.
async fn assert_kept_through_silence(relay: &Relay, replays: &filtered_replay::Replays) {
    assert!(
        replays.longest_reply_silence() > REPLAY_SILENCE,
        "the scenario did not happen: the walsender read replies at least every {:?}, even \
         after {} tries (raise OUTBOX_TEST_REPLAY_ROWS)",
        replays.longest_reply_silence(),
        filtered_replay::TRIES
    );
    assert_eq!(
        link_failures(relay, "replication"),
        0,
        "the live replication link was taken for dead"
    );
    assert_eq!(relay.postgres_reconnects(), 0);
    let holders = replays.holders();
    assert_eq!(holders.len(), 1, "the slot changed hands: {holders:?}");
    assert!(
        relay.metrics.walsender_busy_silences.get() >= 1,
        "the deadline never passed during the silence"
    );
    // The stream counts a task once Valkey's reply is back, which can be after the task is
    // visible in Valkey (where the replay's watch saw it): wait for the count, then check it.
    eventually("the stream counts the events it delivered", || async {
        (relay.metrics.published.get() >= replays.events()).then_some(())
    })
    .await;
    assert_eq!(
        relay.metrics.published.get(),
        replays.events(),
        "the events came through the stream"
    );
}

/// A long transaction that the publication filters almost entirely (a bulk change of a business
/// table with its outbox row at the end): while the walsender replays it, it reads status
/// updates, and so answers their reply requests, only every `wal_sender_timeout / 2` (here 6 s).
/// With `--link-timeout 3s` below that silence, the relay must still not take the live link for
/// dead: when the deadline passes it asks the server, which shows the walsender busy decoding.
/// Before, it reconnected, the new walsender decoded the same transaction again, and the stream
/// never got past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_filtered_replay_is_not_taken_for_a_dead_link() {
    let db = TestDb::new("l_replay").await;
    filtered_replay::set_wal_sender_timeout(&db, "12s").await;
    filtered_replay::create_business_table(&db).await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &["--recovery-grace", "1h", "--link-timeout", "3s"],
    ))
    .await;
    let replays = filtered_replay::replay_until_silent(&db, &redis, REPLAY_SILENCE, async |n| {
        let rows = filtered_replay::replay_rows() << n;
        (rows, filtered_replay::commit_bulk_change(&db, rows).await)
    })
    .await;
    println!(
        "LINK-TIMES filtered_replay {replays:?} busy_silences={}",
        relay.metrics.walsender_busy_silences.get()
    );
    assert_kept_through_silence(&relay, &replays).await;
    relay.stop().await;
}

/// A table rewrite (`ALTER TABLE ... TYPE`) with its outbox row at the end: on PostgreSQL 14 and
/// 15 the walsender reads no status update for as long as it replays the rewrite, not bounded by
/// `wal_sender_timeout` (found by review: 11.5 s of silence with an 8 s timeout). The relay
/// must keep the link as above. (From 16 the silence is bounded by `wal_sender_timeout / 2`,
/// and the test shows the same.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_table_rewrite_is_not_taken_for_a_dead_link() {
    let db = TestDb::new("l_rewrite").await;
    filtered_replay::set_wal_sender_timeout(&db, "12s").await;
    filtered_replay::create_business_table(&db).await;
    // A rewrite replays faster per row than a filtered transaction: on a quiet machine 2.5 M
    // rows kept the walsender silent only 3.3 s, under the scenario's 3.5 s (2026-12-02).
    let rows = filtered_replay::replay_rows() * 8 / 5;
    filtered_replay::load_business_rows(&db, rows).await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &["--recovery-grace", "1h", "--link-timeout", "3s"],
    ))
    .await;
    // A later try doubles the table (the rows it adds are decoded and filtered) and rewrites
    // it again.
    let replays = filtered_replay::replay_until_silent(&db, &redis, REPLAY_SILENCE, async |n| {
        if n > 0 {
            filtered_replay::load_business_rows(&db, rows << (n - 1)).await;
        }
        (rows << n, filtered_replay::commit_rewrite(&db, n).await)
    })
    .await;
    println!(
        "LINK-TIMES rewrite_replay {replays:?} busy_silences={}",
        relay.metrics.walsender_busy_silences.get()
    );
    assert_kept_through_silence(&relay, &replays).await;
    relay.stop().await;
}

/// iptables rules dropping loopback TCP packets (both directions), removed when dropped. Each
/// rule carries the name of this run's scratch directory as a comment ([`KernelBlackHole::tag`]),
/// and scripts/test.sh deletes the rules of its run left behind (a test process killed before
/// its drop), not those of another run.
struct KernelBlackHole {
    /// Each rule's match: `--sport`/`--dport` pairs.
    rules: Vec<Vec<String>>,
}

impl KernelBlackHole {
    /// The run's scratch directory name (OUTBOX_TEST_TMP, set by scripts/test.sh).
    fn tag() -> String {
        std::env::var("OUTBOX_TEST_TMP")
            .ok()
            .and_then(|d| {
                std::path::Path::new(&d)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "outbox-relay-test".into())
    }

    fn iptables(op: &str, rule: &[String]) -> bool {
        std::process::Command::new("iptables")
            .args([op, "INPUT", "-i", "lo", "-p", "tcp"])
            .args(rule)
            .args(["-m", "comment", "--comment", &Self::tag(), "-j", "DROP"])
            .status()
            .expect("iptables (run as root with iptables installed; .ci/run installs it)")
            .success()
    }

    fn insert(rules: Vec<Vec<String>>) -> Self {
        let mut hole = Self { rules: Vec::new() };
        for rule in rules {
            assert!(Self::iptables("-I", &rule), "iptables -I {rule:?} failed");
            // Kept for the drop as soon as it exists, so a failed next insert removes it.
            hole.rules.push(rule);
        }
        hole
    }

    /// Drops every packet to and from `port`: the flow whose client end it is, or a whole
    /// server (its listening port).
    fn cut(port: u16) -> Self {
        let p = port.to_string();
        Self::insert(vec![
            vec!["--sport".into(), p.clone()],
            vec!["--dport".into(), p],
        ])
    }

    /// Drops the one flow between client port `client` and server port `server` (a client port
    /// alone may be shared by flows to other servers).
    fn cut_flow(client: u16, server: u16) -> Self {
        let (c, s) = (client.to_string(), server.to_string());
        Self::insert(vec![
            vec!["--sport".into(), c.clone(), "--dport".into(), s.clone()],
            vec!["--sport".into(), s, "--dport".into(), c],
        ])
    }
}

impl Drop for KernelBlackHole {
    fn drop(&mut self) {
        // Never a panic here (it may run while a failed test unwinds): a rule that could not be
        // deleted is said, and scripts/test.sh deletes it at the end.
        for rule in &self.rules {
            if !Self::iptables("-D", rule) {
                eprintln!("could not delete the iptables rule {rule:?}");
            }
        }
    }
}

/// A replication link black-holed in the KERNEL (iptables DROP of its flow: no FIN, no RST, no
/// acknowledgement) while the walsender is busy replaying a long filtered transaction. The
/// receive deadline keeps a link whose walsender is busy, so `TCP_USER_TIMEOUT` on the
/// replication socket (the relay's status updates stay unacknowledged) must find it: the kernel
/// closes the socket ("Connection timed out"), the relay reconnects, takes the slot back once the
/// old walsender stops, and delivers the event. Without the socket option the kernel would wait
/// for its retransmission limit, and the link is found by the deadline alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_black_hole_under_a_busy_walsender_is_found_by_tcp_user_timeout() {
    let db = TestDb::new("l_kernel").await;
    filtered_replay::set_wal_sender_timeout(&db, "12s").await;
    filtered_replay::create_business_table(&db).await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &[
            "--recovery-grace",
            "1h",
            "--link-timeout",
            "3s",
            "--takeover-after",
            "2s",
        ],
    ))
    .await;
    let admin = db.client().await;
    let port: i32 = admin
        .query_one(
            "SELECT r.client_port FROM pg_replication_slots s \
             JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1",
            &[&db.slot],
        )
        .await
        .unwrap()
        .get(0);
    // Twice the first try of the other replay tests: the replay must outlast TCP_USER_TIMEOUT
    // (3 s, with a status update every second), and on a quiet machine 2.5 M rows kept the
    // walsender silent only 2.4 s after the commit (2026-12-03).
    let rows = filtered_replay::replay_rows() * 2;
    let id = filtered_replay::commit_bulk_change(&db, rows).await;
    let reconnects = relay.postgres_reconnects();
    let hole = KernelBlackHole::cut_flow(port as u16, url_port(&db.url));
    until(
        "the relay gives the black-holed connection up",
        async || relay.postgres_reconnects() > reconnects,
    )
    .await;
    drop(hole);
    let watch = filtered_replay::watch_replay(&db, &redis, &id).await;
    let dead = link_failures(&relay, "replication");
    println!(
        "LINK-TIMES kernel_black_hole rows={rows} {watch:?} replication_links_found_dead={dead} \
         reconnects={}",
        relay.postgres_reconnects() - reconnects
    );
    // The kernel gave the socket up (TCP_USER_TIMEOUT: "Connection timed out"; without the
    // option it waits for its retransmission limit, about 15 minutes). The receive deadline may
    // call the link dead in the same moment, when the walsender, blocked writing to the dead
    // socket, no longer looks busy: seen once in CI (dead link counted 0.2 s after the
    // timeout), so the count is printed, not asserted. No other test of this binary cuts the
    // replication flow in the kernel.
    let timed_out =
        logged_by_any("replication worker terminated with error: io error: Connection timed out");
    assert!(
        !timed_out.is_empty(),
        "TCP_USER_TIMEOUT never closed the black-holed replication socket (dead links: {dead})"
    );
    relay.stop().await;
}

/// A replication link black-holed above the kernel (the fault proxy) while the server decodes a
/// steady load that the publication filters (business inserts, no outbox rows), with
/// `wal_sender_timeout` off, so that only the relay can find the link dead. The walsender is
/// busy, but from record to record, reading status updates between them: the probe must not
/// take that for a replay (found by review: the link was kept 9 times, until the walsender's own
/// timeout ended it). The relay finds the link dead, and its standby check then takes the slot
/// back from the zombie walsender (busy the same way) and streams again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_hole_under_filtered_load_is_not_excused_by_a_busy_walsender() {
    let db = TestDb::new("l_fload").await;
    filtered_replay::set_wal_sender_timeout(&db, "0").await;
    filtered_replay::create_business_table(&db).await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&db.url).await;
    let relay = Relay::start_streaming(run_args(&through(&db, &proxy), &redis.url, &FLAGS)).await;
    let first = db.wait_walsender_other_than(None).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (stop, c) = (stop.clone(), db.client().await);
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                c.execute(
                    "INSERT INTO business SELECT g, 'x' FROM generate_series(1, 20000) g",
                    &[],
                )
                .await
                .unwrap();
            }
        })
    };
    proxy.set_replication(Fault::BlackHole);
    until("the relay finds the replication link dead", async || {
        link_failures(&relay, "replication") >= 1
    })
    .await;
    proxy.set_replication(Fault::Pass);
    // The zombie (the first walsender) is taken over, and the stream is up again.
    let second = db.wait_walsender_other_than(Some(first)).await;
    until("the stream is up again", async || {
        relay.metrics.stream_up.get() == 1
    })
    .await;
    println!(
        "LINK-TIMES filtered_load_black_hole busy_silences={} walsenders={first}->{second}",
        relay.metrics.walsender_busy_silences.get()
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.unwrap();
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "after.hole", 3, 3).await;
    let pending = wait_pending(&redis, "default", 3).await;
    assert!(ids.iter().all(|id| pending.contains(id)));
    relay.stop().await;
}

/// Found by review: the stream, the pollers and the monitor shared ONE Valkey link
/// (`src/valkey/link.rs`). When another user of it (here the monitor's PING timing out; the
/// poller's `reset()` after a write timeout did the same) gave the connection up, the stream's
/// NEXT write went out on a new connection while its earlier write was still travelling on the
/// old one. Nothing failed on the stream's side (both writes confirmed, in order, the
/// acknowledgement right), but the later batch landed first: the pending list out of commit
/// order (2 runs of 3). The stream now writes on a connection of its own: commit A lands
/// before the later commit B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_given_up_by_the_monitor_keeps_the_streams_order() {
    let db = TestDb::new("r_reorder").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&redis.url).await;
    let flags = [
        "--recovery-grace",
        "1h",
        "--health-interval",
        "200ms",
        "--valkey-timeout",
        "3s",
        "--batch-size",
        "3",
        "--max-inflight-batches",
        "4",
    ];
    let relay = Relay::start_streaming(run_args(&db, &proxy.url_through(&redis.url), &flags)).await;
    let mut c = db.client().await;
    let warm = insert_events(&mut c, "warm", 3, 3).await;
    wait_pending(&redis, "default", warm.len()).await;

    // The flow in use stalls (a retransmission backoff, a congested path); new flows pass.
    proxy.stall_open_connections();
    let failures = link_failures(&relay, "valkey");
    let write_errors = relay.metrics.write_errors.get();
    // The monitor's next PING (every 200 ms) goes out on the stalled connection; its reply
    // timeout (OUTBOX_VALKEY_TIMEOUT, 3 s) starts. Commit A comes after it: written at once
    // (nothing else in flight), on the same stalled connection, so its own 3 s run later.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let a = insert_events(&mut c, "first", 1, 1).await;
    // The PING times out and the link forgets the connection (A's write still waits on it).
    until("the monitor's PING timed out", async || {
        link_failures(&relay, "valkey") > failures
    })
    .await;
    // Commit B (later): a full batch, dispatched while A is in flight: on a NEW connection.
    let b = insert_events(&mut c, "second", 3, 3).await;
    let mut conn = redis.conn().await;
    let landed_first = tokio::time::timeout(Duration::from_millis(1500), async {
        loop {
            let pending = pending_ids(&mut conn, "default").await;
            if b.iter().all(|id| pending.contains(id)) {
                return !pending.contains(&a[0]);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // The old flow passes again before A's write times out: A lands, after B.
    proxy.set(Fault::Pass);
    wait_pending(&redis, "default", warm.len() + a.len() + b.len()).await;
    let pending = pending_ids(&mut conn, "default").await;
    // pending_ids lists the oldest first. In commit order A comes before every row of B.
    let pos = |id: &String| pending.iter().position(|p| p == id).unwrap();
    println!(
        "REORDER b_landed_before_a={landed_first:?} pending(oldest first)={pending:?} \
         a={a:?} b={b:?} stream_write_errors_during={}",
        relay.metrics.write_errors.get() - write_errors
    );
    relay.stop().await;
    assert!(
        b.iter().all(|id| pos(&a[0]) < pos(id)),
        "commit A ({}) was enqueued after the later commit B {b:?}: pending list (oldest first) \
         {pending:?}",
        a[0]
    );
}

/// The port of a `redis://host:port` or `postgres://host:port/db` URL.
fn url_port(url: &str) -> u16 {
    url::Url::parse(url)
        .unwrap()
        .port()
        .expect("a port in the URL")
}

/// The established TCP sockets (/proc/net/tcp, state 01: the whole network namespace) from one
/// of the local `ports` to the remote port `server`: the relay's ends of those flows.
fn established(ports: &[u16], server: u16) -> Vec<u16> {
    let port_of = |addr: &str| u16::from_str_radix(addr.rsplit(':').next()?, 16).ok();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            let local = port_of(cols.get(1)?)?;
            let remote = port_of(cols.get(2)?)?;
            (cols.get(3) == Some(&"01") && remote == server && ports.contains(&local))
                .then_some(local)
        })
        .collect()
}

/// Valkey black-holed in the KERNEL (iptables DROP of every packet to and from its port: no
/// FIN, no RST, new connections' SYNs unanswered) under load: the relay's writes time out, the
/// acknowledgement holds, `/readyz` says so, and once the route is back the relay reconnects by
/// itself and delivers everything. The proxy variant is
/// `a_black_holed_valkey_holds_the_acknowledgement_and_heals_under_load`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_black_hole_on_valkey_holds_the_acknowledgement_and_heals() {
    let db = TestDb::new("l_kvalkey").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &FLAGS)).await;
    let load = Load::start(&db.url, LoadSpec::default());
    delivering(&relay).await;

    let hole = KernelBlackHole::cut(url_port(&redis.url));
    let errors = relay.metrics.write_errors.get();
    let detected = until("valkey writes time out", async || {
        relay.metrics.write_errors.get() > errors
    })
    .await;
    let not_ready = until("/readyz says valkey is unreachable", async || {
        let (status, body) = relay.get("/readyz").await;
        status == 503 && body.contains("valkey unreachable")
    })
    .await;
    // Nothing committed now can be confirmed by Valkey: the slot stays behind it.
    let inside = db.current_lsn().await;
    let errors = relay.metrics.write_errors.get();
    while relay.metrics.write_errors.get() < errors + 2 {
        assert!(
            relay.metrics.acked_lsn.get() < inside,
            "acknowledged past a commit Valkey never confirmed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(hole);
    let recovered = until("/readyz is ready again", async || ready(&relay).await).await;
    delivering(&relay).await;
    let result = load.stop().await;
    println!(
        "LINK-TIMES link=valkey_kernel detected_after_ms={} not_ready_after_ms={} \
         recovered_after_ms={}",
        detected.as_millis(),
        (detected + not_ready).as_millis(),
        recovered.as_millis()
    );
    let v = verify("kernel_black_holed_valkey", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    relay.stop().await;
}

/// The relay's SQL connections black-holed in the KERNEL under load (iptables DROP of each of
/// their flows; connections opened afterwards get through, as after a route that changed):
/// `TCP_USER_TIMEOUT` and keepalive close every one of them (a marker or poller query waiting
/// on one would otherwise wait for the kernel's retransmission limit, about 15 minutes, and an
/// idle pooled one for ever), the pool opens new ones, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_black_hole_on_the_sql_connections_is_closed_by_the_socket_options() {
    let db = TestDb::new("l_ksql").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &FLAGS)).await;
    let load = Load::start(&db.url, LoadSpec::default());
    delivering(&relay).await;

    let ports: Vec<u16> = db
        .client()
        .await
        .query(
            "SELECT client_port FROM pg_stat_activity WHERE datname = $1 \
             AND application_name = $2 AND backend_type = 'client backend'",
            &[&db.name, &outbox_relay::postgres::APPLICATION_NAME],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, i32>(0) as u16)
        .collect();
    assert!(!ports.is_empty(), "the relay has SQL connections");
    let server = url_port(&db.url);
    // The relay's ends of those flows (one may have been recycled since the query).
    assert!(!established(&ports, server).is_empty(), "{ports:?}");
    let holes: Vec<KernelBlackHole> = ports
        .iter()
        .map(|p| KernelBlackHole::cut_flow(*p, server))
        .collect();
    let closed = until("every black-holed SQL socket is closed", async || {
        established(&ports, server).is_empty()
    })
    .await;
    delivering(&relay).await;
    drop(holes);
    let result = load.stop().await;
    println!(
        "LINK-TIMES link=sql_kernel connections={} closed_after_ms={} sql_links_found_dead={}",
        ports.len(),
        closed.as_millis(),
        link_failures(&relay, "postgres")
    );
    let v = verify("kernel_black_holed_sql", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    relay.stop().await;
}

/// Added latency on every link (100 ms each way on both Postgres links through the proxy, and
/// on Valkey through another) under load is slowness, not a dead link: no link is found dead,
/// the stream never reconnects, `/readyz` stays ready, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn added_latency_on_every_link_is_not_taken_for_a_dead_one() {
    let db = TestDb::new("l_latency").await;
    let redis = Redis::start();
    let pg_proxy = Proxy::in_front_of(&db.url).await;
    let valkey_proxy = Proxy::in_front_of(&redis.url).await;
    let relay = Relay::start_streaming(run_args(
        &through(&db, &pg_proxy),
        &valkey_proxy.url_through(&redis.url),
        &FLAGS,
    ))
    .await;
    let load = Load::start(&db.url, LoadSpec::default());
    delivering(&relay).await;
    let reconnects = relay.postgres_reconnects();

    let delay = Duration::from_millis(100);
    pg_proxy.set(Fault::Delay(delay));
    valkey_proxy.set(Fault::Delay(delay));
    // Several link timeouts (3 s) and health checks (500 ms) of slow links, delivering.
    let slow_since = Instant::now();
    while slow_since.elapsed() < Duration::from_secs(10) {
        delivering(&relay).await;
        assert!(ready(&relay).await, "{:?}", relay.get("/readyz").await);
    }
    pg_proxy.set(Fault::Pass);
    valkey_proxy.set(Fault::Pass);
    delivering(&relay).await;
    let result = load.stop().await;
    for link in ["replication", "postgres", "valkey"] {
        assert_eq!(link_failures(&relay, link), 0, "{link} taken for dead");
    }
    assert_eq!(
        relay.postgres_reconnects(),
        reconnects,
        "the stream reconnected"
    );
    let v = verify("added_latency", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    relay.stop().await;
}

/// SIGSTOPs walsender `pid` at a moment it waits (for its client or for WAL): its
/// `pg_stat_activity.wait_event`, frozen with it, then says so. Stopped on the CPU instead (even
/// an idle walsender wakes to send keepalives), it would look busy inside one record to the
/// relay's probe, which keeps such a link (seen: one run in two, "gave up waiting").
async fn stop_while_waiting(db: &TestDb, pid: i32) {
    let c = db.client().await;
    for _ in 0..50 {
        common::observed::kill("STOP", pid as u32);
        // A stopped backend no longer changes its own wait_event; a moment for the last change
        // to be visible.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let wait_event: Option<String> = c
            .query_one(
                "SELECT wait_event FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .unwrap()
            .get(0);
        if wait_event.is_some_and(|e| e.to_ascii_lowercase().starts_with("walsender")) {
            return;
        }
        common::observed::kill("CONT", pid as u32);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("walsender {pid} was never stopped while waiting");
}

/// A stalled walsender (SIGSTOP: the kernel still acknowledges every packet, so
/// `TCP_USER_TIMEOUT` never fires and keepalives are answered): only the receive deadline tied
/// to the walsender's keepalives can find it. The relay calls the link dead and `/readyz` says
/// the stream is down; rows committed meanwhile wait; once the walsender runs again (and ends,
/// by the relay's takeover) the relay streams again and delivers them.
///
/// Stopped while waiting (an idle outbox, as here; the stop is retried until it lands in a wait),
/// the walsender shows a walsender wait event and the probe does not excuse it. Stopped in the middle of decoding one record it would look
/// busy inside that record, and the link would be kept while it stays stopped: see
/// docs/reliability.md, "Dead links".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_walsender_is_found_by_the_receive_deadline() {
    let db = TestDb::new("l_stalled").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &FLAGS)).await;
    let mut c = db.client().await;
    let warm = insert_events(&mut c, "warm", 5, 5).await;
    wait_pending(&redis, "default", warm.len()).await;

    let walsender = db.wait_walsender_other_than(None).await;
    let dead = link_failures(&relay, "replication");
    let stalled = common::observed::Resume(walsender as u32);
    stop_while_waiting(&db, walsender).await;
    let during = insert_events(&mut c, "during.stall", 5, 5).await;
    let detected = until("the stalled replication link is found dead", async || {
        link_failures(&relay, "replication") > dead
    })
    .await;
    let not_ready = until("/readyz says the stream is down", async || {
        let (status, body) = relay.get("/readyz").await;
        status == 503 && body.contains("replication stream down")
    })
    .await;
    drop(stalled);
    let recovered = until("the stream is back", async || {
        relay.metrics.stream_up.get() == 1 && ready(&relay).await
    })
    .await;
    let new = db.wait_walsender_other_than(Some(walsender)).await;
    assert_ne!(new, walsender);
    let after = insert_events(&mut c, "after.stall", 5, 5).await;
    let pending = wait_pending(&redis, "default", warm.len() + during.len() + after.len()).await;
    assert!(
        during.iter().chain(&after).all(|id| pending.contains(id)),
        "every row committed during and after the stall has its task"
    );
    assert_eq!(pending.len(), warm.len() + during.len() + after.len());
    println!(
        "LINK-TIMES link=stalled_walsender detected_after_ms={} not_ready_after_ms={} \
         recovered_after_ms={}",
        detected.as_millis(),
        (detected + not_ready).as_millis(),
        recovered.as_millis()
    );
    relay.stop().await;
}

/// Inserts `n` rows whose payload text is 512 KiB.
async fn insert_large_rows(db: &TestDb, n: i32) {
    db.client()
        .await
        .execute(
            "INSERT INTO outbox_events (event_id, event_name, payload) \
             SELECT gen_random_uuid(), 'large.row', to_jsonb(repeat(md5(g::text), 16384)) \
             FROM generate_series(1, $1) g",
            &[&n],
        )
        .await
        .unwrap();
}

/// Large rows over a slow Valkey link are delivered (found by review): a write's deadline was
/// the Valkey timeout alone, counted from the moment the write was queued, so a backlog's
/// batches of 8 MiB could never cross a link too slow for 8 MiB in that time. They timed out,
/// were sent again and timed out again for ever: nothing acknowledged, WAL pinned. Now a
/// write's deadline adds the time its bytes, and those queued before it, take at 1 MiB/s.
/// Here 24 rows of 512 KiB are waiting when the relay starts, Valkey is behind a 2 MiB/s link
/// and `--valkey-timeout 1s`: the first batch, 16 rows (8 MiB), needs about 4 s. Then 48 more
/// in poll mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_batches_cross_a_slow_valkey_link() {
    let db = TestDb::new("l_vslow").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&redis.url).await;
    proxy.set_rate(Some(2 << 20));
    // The slot first, so that the rows inserted next wait in it.
    let relay = Relay::start_streaming(run_args(
        &db,
        &proxy.url_through(&redis.url),
        &["--recovery-grace", "1h", "--valkey-timeout", "1s"],
    ))
    .await;
    relay.stop().await;
    insert_large_rows(&db, 24).await;
    let relay = Relay::start_streaming(run_args(
        &db,
        &proxy.url_through(&redis.url),
        &["--recovery-grace", "1h", "--valkey-timeout", "1s"],
    ))
    .await;
    eventually("24 large rows delivered over the slow link", || async {
        let mut conn = redis.conn().await;
        (pending_ids(&mut conn, "default").await.len() == 24).then_some(())
    })
    .await;
    assert_eq!(relay.metrics.write_errors.get(), 0, "no write timed out");
    relay.stop().await;

    // Poll mode: the pollers' writes share a connection with the health check's PING, which
    // waits behind them as their replies do (found by review: the PING timed out, `/readyz`
    // said "valkey unreachable" and the connection that was delivering was dropped).
    insert_large_rows(&db, 48).await;
    let relay = Relay::start(run_args(
        &db,
        &proxy.url_through(&redis.url),
        &[
            "--mode",
            "poll",
            "--poll-interval",
            "200ms",
            "--valkey-timeout",
            "1s",
            "--health-interval",
            "200ms",
        ],
    ));
    eventually("48 more large rows delivered in poll mode", || async {
        let mut conn = redis.conn().await;
        (pending_ids(&mut conn, "default").await.len() == 72).then_some(())
    })
    .await;
    assert_eq!(
        relay.metrics.write_errors.get(),
        0,
        "no poller write timed out"
    );
    assert_eq!(
        link_failures(&relay, "valkey"),
        0,
        "no health check timed out behind the writes"
    );
    relay.stop().await;
}
