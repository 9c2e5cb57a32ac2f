//! Dead links: each link of the relay (the replication connection, the SQL pool, Valkey)
//! black-holed through the fault proxy (tests/common/proxy.rs) under load. Each test waits for
//! the relay to notice (its counters and `/readyz`), lets the link pass again, waits for the
//! relay to recover, and then checks with the fault suite's checker that every committed event
//! was delivered. Detection and recovery times are printed (`LINK-TIMES ...`), never asserted.

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

/// A database whose walsenders run with `wal_sender_timeout` 4 s, so that the relay's
/// replication deadline stays at `--link-timeout 3s` (the relay raises it to 3/4 of the
/// server's timeout, src/replication/liveness.rs; the cluster's 60 s would make it 45 s).
async fn link_db(prefix: &str) -> TestDb {
    let db = TestDb::new(prefix).await;
    filtered_replay::set_wal_sender_timeout(&db, "4s").await;
    db
}

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
    let db = link_db("l_idle").await;
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
    let db = link_db("l_repl").await;
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
    let db = link_db("l_sql").await;
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
    let db = link_db("l_pg").await;
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
    let db = link_db("l_valkey").await;
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
    let db = link_db("l_vreset").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&redis.url).await;
    let relay = Relay::start_streaming(run_args(&db, &proxy.url_through(&redis.url), &FLAGS)).await;
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

/// A long transaction that the publication filters almost entirely (a bulk change of a business
/// table with its outbox row at the end): while the walsender replays it, it reads status
/// updates, and so answers their reply requests, only every `wal_sender_timeout / 2` (here 4 s).
/// With `--link-timeout 1s` below that silence, the relay must still not take the live link for
/// dead (it raises its deadline to 3/4 of the server's timeout): before, it reconnected, the new
/// walsender decoded the same transaction again, and the stream never got past it. The test
/// checks that the silence happened (the holder's `reply_time` stood still for longer than the
/// configured second), that the event came through the stream, and that nothing reconnected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_filtered_replay_is_not_taken_for_a_dead_link() {
    let db = TestDb::new("l_replay").await;
    filtered_replay::set_wal_sender_timeout(&db, "8s").await;
    filtered_replay::create_business_table(&db).await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &["--recovery-grace", "1h", "--link-timeout", "1s"],
    ))
    .await;
    let rows = filtered_replay::replay_rows();
    let id = filtered_replay::commit_bulk_change(&db, rows).await;
    let watch = filtered_replay::watch_replay(&db, &redis, &id).await;
    let dead = link_failures(&relay, "replication");
    println!(
        "LINK-TIMES filtered_replay rows={rows} {watch:?} replication_links_found_dead={dead}"
    );
    assert!(
        watch.longest_reply_silence > Duration::from_millis(1500),
        "the scenario did not happen: the walsender read replies at least every \
         {:?} (raise OUTBOX_TEST_REPLAY_ROWS)",
        watch.longest_reply_silence
    );
    assert_eq!(dead, 0, "the live replication link was taken for dead");
    assert_eq!(relay.postgres_reconnects(), 0);
    assert_eq!(
        watch.holders.len(),
        1,
        "the slot changed hands: {:?}",
        watch.holders
    );
    assert_eq!(
        relay.metrics.published.get(),
        1,
        "the event came through the stream"
    );
    relay.stop().await;
}
