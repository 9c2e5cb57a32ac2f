//! `pg_upgrade` under the relay, by the runbook's commands (docs/operations.md, "Major-version
//! upgrade"): the relay binary streams a producer load from an old cluster, the old cluster is
//! stopped and upgraded to 18, the relay starts on the new cluster, the load goes on, and the
//! checker finds every committed event exactly once in Valkey.
//!
//! - From 16 the slot does not survive: the relay creates it again and the recovery poller
//!   delivers what the stream never saw (rows committed after the relay stopped, before the
//!   upgrade, and on the new cluster before the slot existed).
//! - From 17 the slot is carried over: it exists on the new cluster at or past the position the
//!   relay acknowledged last, and the stream resumes from it with the poller held back (a
//!   recovery grace of an hour), so only the stream can deliver.
//!
//! The installs come from scripts/fetch-postgres-full.sh (`scripts/test.sh --upgrade`); without
//! them each test says why on the terminal and skips. Clusters use the relay's default slot name,
//! so the runbook's SQL runs as written.

mod common;

use common::checker::{verify, Load, LoadResult, LoadSpec};
use common::observed::{wait_for_more_tasks, ObservedRelay};
use common::pg_upgrade::{full_installs_or_skip, Cluster, UpgradeRun};
use common::*;

const SLOT: &str = "outbox_relay";

/// The relay's slot on `db`'s cluster: (plugin, failover (None before 17, which has no such
/// flag), confirmed_flush_lsn as a number).
async fn slot(db: &TestDb) -> Option<(String, Option<bool>, u64)> {
    let row = db
        .client()
        .await
        .query_opt(
            "SELECT plugin::text, (to_jsonb(s) ->> 'failover')::bool,
                    (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint
             FROM pg_replication_slots s WHERE slot_name = $1",
            &[&SLOT],
        )
        .await
        .unwrap()?;
    Some((row.get(0), row.get(1), row.get::<_, i64>(2) as u64))
}

/// A migrated database on `old` whose slot is the relay's default, and the old cluster's
/// configuration file with `wal_level = logical`: the scripts set it on the command line, which
/// pg_upgrade does not pass on when it starts the server (as a production configuration has it).
async fn outbox_on(old: &Cluster) -> TestDb {
    connect(&old.url)
        .await
        .batch_execute("ALTER SYSTEM SET wal_level = logical")
        .await
        .unwrap();
    let db = TestDb::on(&old.url, "upgrade", true).await;
    TestDb {
        slot: SLOT.to_owned(),
        ..db
    }
}

/// A metric of the relay, which must be answering.
async fn metric(relay: &ObservedRelay, name: &str) -> f64 {
    relay
        .metric(name)
        .await
        .unwrap_or_else(|| panic!("{name} is not reported"))
}

/// Lets the load commit on the upgraded cluster and the relay deliver it (the pending list
/// grows by `more` tasks), then stops the load: what it committed, before and after.
async fn load_after_upgrade(redis: &Redis, load: Load, more: usize) -> LoadResult {
    let mut conn = redis.conn().await;
    let now = pending_ids(&mut conn, "default").await.len();
    wait_for_more_tasks(redis, "default", now, more).await;
    load.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_16_the_slot_is_recreated_and_the_poller_delivers_the_gap() {
    let Some(bins) = full_installs_or_skip("upgrade from 16", &[16, 18]) else {
        return;
    };
    let old = Cluster::start(&bins[0]);
    let db = outbox_on(&old).await;
    let redis = Redis::start();
    let recovery = ["--recovery-grace", "1s", "--poll-interval", "200ms"];
    let relay = ObservedRelay::spawn_streaming(&db, &redis.url, &recovery).await;
    let load = Load::start(&db.url, LoadSpec::default());
    wait_pending(&redis, "default", 200).await;
    assert!(slot(&db).await.is_some(), "the relay made its slot");

    // The relay first, the load still on: from here on, commits are past its last
    // acknowledgement, and these rows certainly are.
    relay.process.terminate().await;
    let gap = insert_events(&mut db.client().await, "upgrade.gap", 50, 10).await;
    let mut upgrade = UpgradeRun::new(&old, &bins[1]).await;
    upgrade.stop_old();
    let new = upgrade.upgrade();
    assert_eq!(new.port, old.port);
    assert_eq!(upgrade.check_upgraded(&db.url).await, 0, "no 17+ check");
    assert!(
        slot(&db).await.is_none(),
        "pg_upgrade from 16 does not carry logical slots over"
    );

    let relay = ObservedRelay::spawn_streaming(&db, &redis.url, &recovery).await;
    let (_, failover, _) = slot(&db).await.expect("the relay made its slot again");
    assert_eq!(failover, Some(true), "a slot made on 18 is a failover slot");
    let mut all = load_after_upgrade(&redis, load, 200).await;
    all.committed.extend(gap.iter().cloned());
    let v = verify("upgrade_16_to_18", &redis, &all, 1, 0).await;
    assert!(v.ok(), "{v}");
    let by_poller = metric(&relay, "outbox_poller_delivered_total").await;
    println!(
        "UPGRADE-SUMMARY from=16 to=18 committed={} gap={} delivered_by_poller={by_poller}",
        v.committed,
        gap.len()
    );
    assert!(
        by_poller >= gap.len() as f64,
        "the gap can only come from the poller: {by_poller} delivered by it"
    );
    let log = relay.process.terminate().await;
    assert!(log.contains("created logical replication slot"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_17_the_slot_is_carried_over_and_the_stream_resumes_from_it() {
    let Some(bins) = full_installs_or_skip("upgrade from 17", &[17, 18]) else {
        return;
    };
    let old = Cluster::start(&bins[0]);
    let db = outbox_on(&old).await;
    let redis = Redis::start();
    // The poller takes nothing younger than an hour: only the stream delivers.
    let recovery = ["--recovery-grace", "1h", "--poll-interval", "200ms"];
    let relay = ObservedRelay::spawn_streaming(&db, &redis.url, &recovery).await;
    let load = Load::start(&db.url, LoadSpec::default());
    wait_pending(&redis, "default", 200).await;
    let (_, failover, _) = slot(&db).await.expect("the relay made its slot");
    assert_eq!(
        failover,
        Some(true),
        "the relay makes a failover slot on 17"
    );

    // The old cluster goes down under the relay and the load: its walsender hands the relay
    // the rest and waits for the acknowledgement.
    let mut upgrade = UpgradeRun::new(&old, &bins[1]).await;
    upgrade.stop_old();
    let acked = metric(&relay, "outbox_acked_lsn").await as u64;
    assert_eq!(metric(&relay, "outbox_poller_delivered_total").await, 0.0);
    relay.process.terminate().await;
    let _new = upgrade.upgrade();
    assert_eq!(
        upgrade.check_upgraded(&db.url).await,
        1,
        "the 17+ check ran"
    );
    let (plugin, failover, confirmed) = slot(&db).await.expect("the slot came over");
    assert_eq!(plugin, "pgoutput");
    assert_eq!(failover, Some(true), "the slot kept its failover flag");
    assert!(
        confirmed >= acked,
        "the slot is at {confirmed:#x}, before the relay's last acknowledgement {acked:#x}"
    );

    let relay = ObservedRelay::spawn_streaming(&db, &redis.url, &recovery).await;
    let all = load_after_upgrade(&redis, load, 200).await;
    let v = verify("upgrade_17_to_18", &redis, &all, 1, 0).await;
    // The stream alone delivered, so in commit order, across the upgrade too.
    assert!(v.ok_in_order(), "{v}");
    let by_poller = metric(&relay, "outbox_poller_delivered_total").await;
    println!(
        "UPGRADE-SUMMARY from=17 to=18 committed={} acked={acked:#x} slot_after={confirmed:#x} delivered_by_poller={by_poller}",
        v.committed
    );
    assert_eq!(by_poller, 0.0, "the stream delivered everything");
    assert_eq!(metric(&relay, "outbox_slot_lost_total").await, 0.0);
    let log = relay.process.terminate().await;
    assert!(
        !log.contains("created logical replication slot"),
        "the relay used the slot pg_upgrade carried over: {log}"
    );
}
