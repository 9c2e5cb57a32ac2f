//! Primary failover: a primary with a streaming standby and events flowing; the standby is
//! promoted and the old primary killed. The relay, given both hosts in one URL
//! (`target_session_attrs=read-write`), follows to the new primary and nothing is lost.
//!
//! - Before PostgreSQL 17 the slot does not exist on the new primary: the relay recreates it and
//!   the recovery poller delivers the gap from the table.
//! - From 17 the slot is a failover slot the standby keeps in sync: the stream goes on from it,
//!   with the poller held back (a recovery grace of an hour) so that only the stream can deliver.
//!
//! Prints `FAILOVER-SUMMARY` with the time from the promotion until every event committed before
//! it had its task (measured, not asserted).

mod common;

use common::checker::{verify, Load, LoadSpec};
use common::pg_standby::PgPair;
use common::*;
use outbox_relay::metrics::KindLabel;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// The relay's slot on `url`'s server: (exists, synced and persistent) — `synced` from 17.
async fn slot_synced(url: &str, slot: &str) -> bool {
    connect(url)
        .await
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND synced AND NOT temporary",
            &[&slot],
        )
        .await
        .unwrap()
        .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_standby_takes_over_and_nothing_is_lost() {
    let pair = PgPair::start().await;
    let failover_slots = pair.major >= 17;
    let db = TestDb::on(&pair.primary.url, "failover", true).await;
    let multi = TestDb {
        url: pair.multi_host_url(&db.name),
        name: db.name.clone(),
        slot: db.slot.clone(),
    };
    let redis = Redis::start();
    // From 17 the poller waits an hour before it touches a row: what arrives after the
    // promotion came from the stream.
    let recovery: &[&str] = if failover_slots {
        &["--recovery-grace", "1h", "--poll-interval", "200ms"]
    } else {
        &["--recovery-grace", "2s", "--poll-interval", "200ms"]
    };
    let relay = Relay::start_streaming(run_args(&multi, &redis.url, recovery)).await;

    let before = Load::start(&multi.url, LoadSpec::default());
    wait_pending(&redis, "default", 300).await;
    if failover_slots {
        let failover: bool = connect(&pair.primary.url)
            .await
            .query_one(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
                &[&db.slot],
            )
            .await
            .unwrap()
            .get(0);
        assert!(
            failover,
            "the relay creates a failover slot on PostgreSQL 17+"
        );
        eventually("the standby has a synced copy of the slot", || async {
            slot_synced(&pair.standby.url, &db.slot).await.then_some(())
        })
        .await;
    }

    let promoted_at = Instant::now();
    pair.promote_standby().await;
    pair.kill_primary();
    let before = before.stop().await;

    // Every event committed before the promotion gets its task: the recovery time.
    let conn = redis.conn().await;
    let committed: HashSet<&String> = before.committed.iter().collect();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let have: HashSet<String> = pending_ids(&mut conn.clone(), "default")
            .await
            .into_iter()
            .collect();
        let missing: Vec<&String> = committed
            .iter()
            .filter(|id| !have.contains(**id))
            .copied()
            .collect();
        if missing.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            // Where are they? In the new primary's table, published or not?
            let rows = connect(&multi.url)
                .await
                .query(
                    "SELECT event_id::text, published_at IS NOT NULL, attempts FROM outbox_events WHERE event_id::text = ANY($1)",
                    &[&missing],
                )
                .await
                .unwrap();
            let found: Vec<(String, bool, i32)> = rows
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
                .collect();
            panic!(
                "{} events committed before the promotion never got a task; on the new primary: {found:?}",
                missing.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let recovered = promoted_at.elapsed();

    // And events keep flowing on the new primary.
    let after = Load::start(&multi.url, LoadSpec::default());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut all = after.stop().await;
    assert!(
        !all.committed.is_empty(),
        "the producer committed on the new primary"
    );
    all.committed.extend(before.committed.iter().cloned());
    all.rolled_back.extend(before.rolled_back.iter().cloned());
    all.transactions += before.transactions;
    let v = verify(&format!("failover_pg{}", pair.major), &redis, &all, 1, 0).await;

    let metrics = &relay.metrics;
    let timeline_changes = metrics
        .slot_changes
        .get_or_create(&KindLabel { kind: "timeline" })
        .get();
    println!(
        "FAILOVER-SUMMARY pg={} failover_slots={} recovered_ms={} slot_lost={} timeline_changes={} \
         timeline={} phantom_tasks={} delivered_by_poller={}",
        pair.major,
        failover_slots,
        recovered.as_millis(),
        metrics.slot_lost.get(),
        timeline_changes,
        metrics.timeline.get(),
        v.leaked,
        metrics.poller_delivered.get(),
    );
    assert!(v.missing.is_empty(), "{v}");
    assert_eq!(v.duplicates, 0, "{v}");
    assert!(
        timeline_changes >= 1,
        "the promotion is reported as a timeline change"
    );
    assert_eq!(metrics.timeline.get(), 2);
    let warned = logged(&db.slot, "postgres timeline changed");
    assert!(!warned.is_empty(), "the promotion is logged as a warning");

    // `status` on the new primary, with the running relay's view.
    let status = outbox_relay::status::collect(
        &connect(&multi.url).await,
        None,
        &outbox_relay::pgoutput::TableName::parse("outbox_events").unwrap(),
        "outbox_relay",
        &db.slot,
        relay.http,
    )
    .await
    .unwrap();
    println!("{}", outbox_relay::status::render(&status));
    assert_eq!((status.server.role, status.server.timeline), ("primary", 2));
    assert_eq!(status.relay.timeline, Some(2), "{:?}", status.relay);
    assert!(
        status
            .relay
            .slot_changes
            .get("timeline")
            .copied()
            .unwrap_or(0)
            >= 1,
        "{:?}",
        status.relay
    );
    assert!(status.warnings.is_empty(), "{:?}", status.warnings);
    // The flag exists from 17; the relay asks for it there.
    let expected_flag = failover_slots.then_some(true);
    assert_eq!(status.slot.failover, expected_flag, "{:?}", status.slot);
    if failover_slots {
        // The stream went on from the synced slot: never lost, nothing from the poller, and
        // synchronized_standby_slots kept the relay from seeing a commit the standby lacked.
        assert_eq!(metrics.slot_lost.get(), 0, "the synced slot was used");
        assert_eq!(metrics.poller_delivered.get(), 0);
        assert_eq!(v.leaked, 0, "{v}");
    } else {
        assert!(
            metrics.slot_lost.get() >= 1,
            "the slot was recreated on the new primary"
        );
    }
    relay.stop().await;
}
