//! A slot recreated behind the relay's back, under load: between two sessions someone drops the
//! relay's slot and creates one of the same name (a restore, a careless script, a tool that
//! "fixes" slots). The new slot starts at the WAL of its creation, past what the relay
//! acknowledged, so the rows committed in between never come from the stream.
//!
//! The relay must say so (a warning that names the slot, `outbox_slot_changes_total{kind="ahead"}`,
//! and `outbox-relay status`), stream on from the new slot, and lose nothing: the recovery poller
//! delivers the gap from the table.

mod common;

use common::checker::{verify, Load, LoadSpec};
use common::observed::ObservedRelay;
use common::*;
use outbox_relay::metrics::KindLabel;
use std::time::Duration;

/// Ends the walsender of `slot`, commits three rows while no walsender runs, and before the
/// relay reconnects drops the slot and creates one of the same name. Retried while the relay's
/// reconnect wins the race (the drop then finds the slot active again). Returns the new slot's
/// position and the ids of the rows committed between the two slots.
async fn recreate_behind_the_relays_back(db: &TestDb, slot: &str) -> (u64, Vec<String>) {
    let admin = db.client().await;
    let mut producer = db.client().await;
    for _ in 0..50 {
        admin
            .execute(
                "SELECT pg_terminate_backend(active_pid, 5000) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid IS NOT NULL",
                &[&slot],
            )
            .await
            .unwrap();
        let gap = insert_events(&mut producer, "between.slots", 3, 1).await;
        // One statement: no moment without the slot, so the relay cannot recreate it itself
        // (that would be a lost slot, another case).
        let recreated = admin
            .query_one(
                "SELECT (lsn - '0/0'::pg_lsn)::bigint FROM \
                 (SELECT pg_drop_replication_slot($1)) d, \
                 pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&slot],
            )
            .await;
        match recreated {
            Ok(row) => return (row.get::<_, i64>(0) as u64, gap),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("recreating the slot: {e}"),
        }
    }
    panic!("the relay's walsender kept the slot active through 50 attempts");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_recreated_behind_the_relays_back_is_reported_and_nothing_is_lost() {
    let db = TestDb::new("slot_recreated").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &["--recovery-grace", "2s", "--poll-interval", "200ms"],
    ))
    .await;
    let load = Load::start(&db.url, LoadSpec::default());
    stream_delivers_after(&relay, db.current_lsn().await).await;
    let acked_before = relay.metrics.acked_lsn.get();

    let (created_at, gap) = recreate_behind_the_relays_back(&db, &db.slot).await;
    assert!(
        created_at > acked_before,
        "the new slot starts past the relay's acknowledgement"
    );
    // The stream goes on from the new slot.
    stream_delivers_after(&relay, db.current_lsn().await).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let result = load.stop().await;
    let mut all = result;
    all.committed.extend(gap.iter().cloned());
    let v = verify("slot_recreated", &redis, &all, 1, 0).await;
    assert!(v.ok(), "{v}");

    // Reported: the metric, a warning naming the slot, and not as a slot the relay lost.
    let ahead = relay
        .metrics
        .slot_changes
        .get_or_create(&KindLabel { kind: "ahead" })
        .get();
    assert_eq!(ahead, 1, "the recreated slot is counted once");
    assert_eq!(
        relay.metrics.slot_lost.get(),
        0,
        "the relay never saw it gone"
    );
    let warned = logged(
        &db.slot,
        "replication slot is ahead of the relay's acknowledgement",
    );
    assert_eq!(warned.len(), 1, "one warning: {warned:?}");
    // The rows committed between the two slots never came from the stream: the poller
    // delivered them.
    assert!(
        relay.metrics.poller_delivered.get() >= gap.len() as u64,
        "the poller delivered the gap"
    );

    // `status` shows it from the running relay: the change, and (healed) no warning.
    let metrics_addr = relay.http.to_string();
    let mut env = relay_env(&db, &redis.url).to_vec();
    env.push(("OUTBOX_METRICS_ADDR", &metrics_addr));
    let text = run_command_ok(&["status"], &env);
    assert!(
        text.contains("slot_changes=ahead:1") && text.contains("stream_up=yes"),
        "{text}"
    );
    assert!(!text.contains("WARNING"), "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&run_command_ok(&["status", "--json"], &env)).unwrap();
    assert_eq!(json["relay"]["slot_changes"]["ahead"], 1, "{json}");
    assert_eq!(json["warnings"], serde_json::json!([]), "{json}");
    println!(
        "SLOT-RECREATED committed={} delivered_by_poller={} ahead={ahead}",
        all.committed.len(),
        relay.metrics.poller_delivered.get()
    );
    relay.stop().await;

    // A relay that does not answer is reported, and the rest of `status` still printed.
    let text = run_command_ok(&["status"], &env);
    assert!(
        text.contains(&format!("relay        {metrics_addr}"))
            && text.contains("unreachable")
            && text.contains("slot         "),
        "{text}"
    );
}

/// With OUTBOX_ON_SLOT_LOST=stop (here with the recovery poller off, which that setting allows)
/// the relay must never skip events itself: a slot recreated behind its back stops it, as a lost
/// slot does, and the rows committed between the two slots wait unpublished in the table. (It
/// streamed on from the new slot before this test, and with no poller those rows were never
/// delivered.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_recreated_behind_its_back_stops_a_relay_that_must_not_skip_events() {
    let db = TestDb::new("slot_recreated_stop").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &["--recovery", "false", "--on-slot-lost", "stop"],
    ))
    .await;
    let mut c = db.client().await;
    let before = insert_events(&mut c, "before", 5, 5).await;
    wait_pending(&redis, "default", before.len()).await;
    let lsn = db.current_lsn().await;
    eventually("the stream acknowledges them", || async {
        (relay.metrics.acked_lsn.get() >= lsn).then_some(())
    })
    .await;

    let (_, gap) = recreate_behind_the_relays_back(&db, &db.slot).await;
    let err = tokio::time::timeout(PATIENCE, relay.join())
        .await
        .expect("the relay stops")
        .expect_err("with an error");
    let err = outbox_relay::error_chain(&err);
    assert!(
        err.contains("ahead of the relay's acknowledgement") && err.contains(&db.slot),
        "{err}"
    );
    let unpublished: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE event_id::text = ANY($1) AND published_at IS NULL",
            &[&gap],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(unpublished, gap.len() as i64, "the gap waits in the table");
    let pending = pending_ids(&mut redis.conn().await, "default").await;
    assert!(
        gap.iter().all(|id| !pending.contains(id)),
        "no task for the gap"
    );
}

/// Another replica streaming from the slot moves it past this relay's acknowledgement too, and
/// that skips nothing: the other replica delivered what it acknowledged. Replica A (set to stop
/// rather than skip events) freezes, B takes the slot over and streams, A comes back and stands
/// by, B ends, A takes the slot back: A must not take the slot for one recreated behind its back
/// (found by review: A stopped with "ahead of the relay's acknowledgement", and in recreate
/// mode counted it again at every standby check, with `status` warning).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_by_another_replica_is_not_taken_for_one_recreated() {
    let db = TestDb::new("slot_replicas").await;
    let redis = Redis::start();
    let a = ObservedRelay::spawn_streaming(
        &db,
        &redis.url,
        &["--on-slot-lost", "stop", "--recovery", "false"],
    )
    .await;
    let mut c = db.client().await;
    let mut ids = insert_events(&mut c, "first", 5, 5).await;
    wait_pending(&redis, "default", ids.len()).await;
    let a_acked = a.wait_metric("outbox_acked_lsn", |v| v > 0.0).await as u64;
    a.signal("STOP");
    let b = ObservedRelay::spawn(&db, &redis.url, &["--takeover-after", "3s"]);
    b.wait_metric("outbox_stream_up", |v| v == 1.0).await;
    ids.extend(insert_events(&mut c, "second", 5, 5).await);
    wait_pending(&redis, "default", ids.len()).await;
    eventually("the slot is past A's acknowledgement", || async {
        db.confirmed_flush().await.filter(|c| *c > a_acked)
    })
    .await;
    a.signal("CONT");
    a.wait_metric("outbox_stream_standby", |v| v == 1.0).await;
    // A looks at the holder after each failed open (every STANDBY_CHECK, 1 s): a few looks
    // before B ends, so that A has seen it (found by review: ended at once, B could be gone
    // before A's first look, and A would never learn another replica held the slot; that
    // case is a documented gap, not what this test is about).
    tokio::time::sleep(Duration::from_secs(3)).await;
    b.signal("TERM");
    a.wait_metric("outbox_stream_up", |v| v == 1.0).await;
    ids.extend(insert_events(&mut c, "third", 5, 5).await);
    let pending = wait_pending(&redis, "default", ids.len()).await;
    assert_eq!(pending, ids, "every event once, in commit order");
    let ahead = a
        .metric("outbox_slot_changes_total{kind=\"ahead\"}")
        .await
        .unwrap_or(0.0);
    assert_eq!(
        ahead, 0.0,
        "the other replica's progress taken for a recreated slot"
    );
    let metrics_addr = a.http.to_string();
    let mut env = relay_env(&db, &redis.url).to_vec();
    env.push(("OUTBOX_METRICS_ADDR", &metrics_addr));
    let text = run_command_ok(&["status"], &env);
    assert!(
        !text.contains("WARNING") && text.contains("stream_up=yes"),
        "{text}"
    );
}
