//! The core relay against a real Postgres (wal_level=logical) and a real Redis.

mod common;

use common::*;
use std::collections::HashSet;

/// 10,000 events in transactions of 1, 10 and 1,000 rows become exactly 10,000 asynq tasks in
/// the Go kit's format, in commit order. The relay runs as the least-privilege role of
/// docs/least-privilege.sql.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_events_become_exactly_their_tasks() {
    let db = TestDb::new("ten_k").await;
    let relay_role = db.least_privilege_role().await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &relay_role,
        &redis.url,
        &[
            "--task-max-retry",
            "7",
            "--task-timeout",
            "90s",
            "--task-retention",
            "2h",
        ],
    ))
    .await;
    let mut c = db.client().await;
    let mut ids = Vec::new();
    // Interleaved: 1,000 transactions of 1 row, 200 of 10 rows and 7 of 1,000 rows.
    for round in 0..7 {
        let (singles, in_tens) = if round < 6 { (143, 290) } else { (142, 260) };
        ids.extend(insert_events(&mut c, "order.placed", singles, 1).await);
        ids.extend(insert_events(&mut c, "order.placed", in_tens, 10).await);
        ids.extend(insert_events(&mut c, "order.placed", 1000, 1000).await);
    }
    assert_eq!(ids.len(), 10_000);

    let pending = wait_pending(&redis, "default", ids.len()).await;
    assert_eq!(
        pending, ids,
        "the pending list holds the ids in commit order"
    );

    let rows = c
        .query(
            "SELECT event_id::text, event_name, payload::text, created_at FROM outbox_events",
            &[],
        )
        .await
        .unwrap();
    let mut conn = redis.conn().await;
    let now_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    for row in rows.iter().step_by(7) {
        let id: String = row.get(0);
        let (msg, state, since) = task(&mut conn, "default", &id).await.expect("task hash");
        assert_eq!(state, "pending");
        let since: u128 = since.parse().unwrap();
        assert!(
            since > now_ns - 600_000_000_000 && since <= now_ns + 600_000_000_000,
            "pending_since is in ns"
        );
        assert_eq!(msg.r#type, "event:order.placed");
        assert_eq!(msg.id, id);
        assert_eq!(msg.queue, "default");
        assert_eq!((msg.retry, msg.timeout, msg.retention), (7, 90, 7200));
        let env: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
        assert_eq!(env["id"], id);
        assert_eq!(env["name"], row.get::<_, String>(1));
        let payload: serde_json::Value = serde_json::from_str(&row.get::<_, String>(2)).unwrap();
        assert_eq!(env["payload"], payload);
        assert!(env.get("metadata").is_none(), "empty metadata is omitted");
        let created: std::time::SystemTime = row.get(3);
        let created = created.duration_since(std::time::UNIX_EPOCH).unwrap();
        let occurred = env["occurred_at"].as_str().unwrap();
        assert!(occurred.ends_with('Z'));
        assert_eq!(occurred_micros(occurred), created.as_micros());
    }
    let count: i64 = redis::cmd("LLEN")
        .arg("asynq:{default}:pending")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(count, 10_000);
    let queues: Vec<String> = redis::cmd("SMEMBERS")
        .arg("asynq:queues")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(queues, vec!["default"]);
    relay.stop().await;
}

/// Microseconds since the epoch of an RFC 3339 UTC timestamp.
fn occurred_micros(s: &str) -> u128 {
    let out = std::process::Command::new("date")
        .args(["-u", "-d", s, "+%s%N"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse::<u128>()
        .unwrap()
        / 1000
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_transactions_and_savepoints_produce_no_task() {
    let (db, redis, relay) = streaming_relay("rollback", &[]).await;
    let c = db.client().await;
    c.batch_execute(
        "BEGIN;
         INSERT INTO outbox_events (event_id, event_name, payload) VALUES ('00000000-0000-4000-8000-000000000001', 'rolled.back', '{}');
         ROLLBACK;
         BEGIN;
         INSERT INTO outbox_events (event_id, event_name, payload) VALUES ('00000000-0000-4000-8000-000000000002', 'kept', '{}');
         SAVEPOINT s;
         INSERT INTO outbox_events (event_id, event_name, payload) VALUES ('00000000-0000-4000-8000-000000000003', 'under.savepoint', '{}');
         ROLLBACK TO SAVEPOINT s;
         INSERT INTO outbox_events (event_id, event_name, payload) VALUES ('00000000-0000-4000-8000-000000000004', 'kept', '{}');
         COMMIT;
         INSERT INTO outbox_events (event_id, event_name, payload) VALUES ('00000000-0000-4000-8000-000000000005', 'marker', '{}');",
    )
    .await
    .unwrap();
    let pending = wait_pending(&redis, "default", 3).await;
    assert_eq!(
        pending,
        vec![
            "00000000-0000-4000-8000-000000000002",
            "00000000-0000-4000-8000-000000000004",
            "00000000-0000-4000-8000-000000000005"
        ]
    );
    let mut conn = redis.conn().await;
    for gone in [
        "00000000-0000-4000-8000-000000000001",
        "00000000-0000-4000-8000-000000000003",
    ] {
        assert!(task(&mut conn, "default", gone).await.is_none());
    }
    relay.stop().await;
}

/// With Valkey down the slot does not move past committed rows; once it is back they are all
/// delivered and the slot moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_down_holds_the_acknowledgement() {
    let (db, redis, relay) = streaming_relay("valkey_down", &[]).await;
    let mut c = db.client().await;
    let warmup = insert_events(&mut c, "warm.up", 5, 5).await;
    wait_pending(&redis, "default", warmup.len()).await;

    redis.stop();
    let errors_before = relay.metrics.write_errors.get();
    let ids = insert_events(&mut c, "while.down", 300, 30).await;
    let after_commit = db.current_lsn().await;
    // The relay has read the rows and its writes fail...
    eventually("writes of the new rows fail", || async {
        (relay.metrics.write_errors.get() > errors_before).then_some(())
    })
    .await;
    // ...and it has since sent the walsender two more status updates (reply_time moves once
    // per update): the acknowledgement is held while they go on.
    let reply_time = || async {
        let row = db
            .client()
            .await
            .query_one(
                "SELECT r.reply_time::text FROM pg_stat_replication r
                 JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $1",
                &[&db.slot],
            )
            .await
            .unwrap();
        row.get::<_, Option<String>>(0)
    };
    for _ in 0..2 {
        let seen = reply_time().await;
        eventually("a status update", || async {
            (reply_time().await != seen).then_some(())
        })
        .await;
    }
    let held = db.confirmed_flush().await.unwrap();
    assert!(
        held < after_commit,
        "acknowledged {held} past undelivered commits ending by {after_commit}"
    );

    redis.restart();
    let pending = wait_pending(&redis, "default", ids.len()).await;
    assert_eq!(
        pending, ids,
        "all delivered, in order (the restarted Redis lost the warm-up)"
    );
    eventually("the slot moves past the delivered commits", || async {
        (db.confirmed_flush().await.unwrap() >= after_commit).then_some(())
    })
    .await;
    assert!(relay.metrics.write_errors.get() > 0, "the outage was seen");
    relay.stop().await;
}

/// SIGKILL mid-stream, then a restart (on the other kind of runtime): no event missing, no id
/// pushed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_loses_and_duplicates_nothing() {
    let (db, redis) = database_and_redis("sigkill").await;
    let mut relay = RelayProcess::spawn_streaming(&db, &redis.url, &["--batch-size", "50"]).await;
    let url = db.url.clone();
    let producer = tokio::spawn(async move {
        let mut c = connect(&url).await;
        insert_events(&mut c, "order.placed", 20_000, 100).await
    });
    let mut conn = redis.conn().await;
    eventually("some tasks before the kill", || {
        let mut conn = conn.clone();
        async move { (pending_ids(&mut conn, "default").await.len() > 2_000).then_some(()) }
    })
    .await;
    relay.signal("KILL");
    let _ = relay.child.wait().await;
    // The first process runs on one thread (the default), the second on a multi-thread
    // runtime: both runtimes deliver.
    let relay = RelayProcess::spawn_streaming(
        &db,
        &redis.url,
        &["--batch-size", "50", "--worker-threads", "2"],
    )
    .await;
    let ids = producer.await.unwrap();
    let pending = wait_pending(&redis, "default", ids.len()).await;
    let unique: HashSet<&String> = pending.iter().collect();
    assert_eq!(unique.len(), pending.len(), "an id was pushed twice");
    assert_eq!(
        unique,
        ids.iter().collect::<HashSet<_>>(),
        "the same set of events"
    );
    let _ = pending_ids(&mut conn, "default").await;
    relay.signal("TERM");
    drop(relay);
}

/// SIGTERM: exits 0 after a final acknowledgement of everything delivered. Valkey is reached
/// through a proxy that holds each chunk 1.5 s, so when SIGTERM comes the commit's write is on
/// its way and unconfirmed: neither Valkey nor the slot has it yet (checked), and only the
/// shutdown's wait for in-flight writes and its final acknowledgement can deliver it and move
/// the slot past it. (A periodic status update cannot: nothing was confirmed before SIGTERM.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_acknowledges_and_exits_zero() {
    use common::proxy::{Fault, Proxy};
    use std::time::Duration;
    let db = TestDb::new("sigterm").await;
    let redis = Redis::start();
    let proxy = Proxy::in_front_of(&redis.url).await;
    // Nothing but the producer writes WAL here (no marking, no poller), so the WAL position
    // right after the last commit is that commit's end: what the final acknowledgement must
    // reach. The health check's PING stays off the delayed link.
    let mut relay = RelayProcess::spawn_streaming(
        &db,
        &proxy.url_through(&redis.url),
        &[
            "--mark-published",
            "false",
            "--recovery",
            "false",
            "--on-slot-lost",
            "stop",
            "--health-interval",
            "1h",
        ],
    )
    .await;
    let mut c = db.client().await;
    let warm = insert_events(&mut c, "order.warm", 10, 10).await;
    wait_pending(&redis, "default", warm.len()).await;
    proxy.set(Fault::Delay(Duration::from_millis(1500)));
    let sent_before = proxy.bytes_from_clients();
    // One transaction of 50 rows: one write, dispatched after its commit.
    let ids = insert_events(&mut c, "order.placed", 50, 50).await;
    let committed = db.current_lsn().await;
    eventually("the commit's write reaches the proxy", || async {
        (proxy.bytes_from_clients() > sent_before).then_some(())
    })
    .await;
    let mut conn = redis.conn().await;
    let pending_at_term = pending_ids(&mut conn, "default").await;
    let acked_at_term = db.confirmed_flush().await.unwrap();
    relay.signal("TERM");
    let status = relay.child.wait().await.unwrap();
    let log = relay.log_text();
    assert!(status.success(), "exit status {status:?}; log:\n{log}");
    // What SIGTERM met: the write in flight, nothing of it confirmed or acknowledged.
    assert!(
        ids.iter().all(|id| !pending_at_term.contains(id)),
        "the write was confirmed before SIGTERM: the test did not meet an in-flight write"
    );
    assert!(
        acked_at_term < committed,
        "the slot was past the commit before SIGTERM ({acked_at_term} >= {committed})"
    );
    let pending = pending_ids(&mut conn, "default").await;
    assert!(
        ids.iter().all(|id| pending.contains(id)),
        "the in-flight write was not finished before exit; log:\n{log}"
    );
    // The final acknowledgement passed the commit: the slot has nothing of it left to send.
    // (Not a comparison with the WAL position read after the commit: other tests write WAL into
    // the same server meanwhile, so that position can lie past the commit's end; seen under
    // `stress --cpu 2`.)
    let left: i64 = eventually("the relay's walsender releases the slot", || async {
        db.client()
            .await
            .query_one(
                "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
                 'proto_version', '1', 'publication_names', 'outbox_relay') \
                 WHERE position(convert_to($2, 'UTF8') in data) > 0",
                &[&db.slot, &ids[0]],
            )
            .await
            .ok()
            .map(|r| r.get(0))
    })
    .await;
    assert_eq!(
        left, 0,
        "the final acknowledgement did not pass the commit: the slot would send it again; \
         log:\n{log}"
    );
}
