//! Decoding on a standby (PostgreSQL 16+): with OUTBOX_REPLICATION_URL the slot lives on the
//! standby and the stream reads from it, while setup, the poller and marking use the primary.
//! On older versions the relay refuses the setting with the fix.

mod common;

use common::pg_standby::PgPair;
use common::*;

/// `application_name`s of the walsenders on `url`'s server.
async fn walsenders(url: &str) -> Vec<String> {
    connect(url)
        .await
        .query("SELECT application_name FROM pg_stat_replication", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn slot_on(url: &str, slot: &str) -> bool {
    connect(url)
        .await
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_reads_from_a_standby_while_sql_goes_to_the_primary() {
    let pair = PgPair::start().await;
    let db = TestDb::on(&pair.primary.url, "standby", true).await;
    let standby_db_url = with_db(&pair.standby.url, &db.name);
    let redis = Redis::start();
    // The poller holds back for an hour: every task below came through the stream.
    let args = run_args(
        &db,
        &redis.url,
        &[
            "--replication-url",
            &standby_db_url,
            "--recovery-grace",
            "1h",
        ],
    );
    if pair.major < 16 {
        let err = Relay::failure(args).await;
        assert!(err.contains("needs PostgreSQL 16 or later"), "{err}");
        println!("STANDBY-DECODING pg={} refused (needs 16+)", pair.major);
        return;
    }
    let relay = Relay::start_streaming(args).await;
    assert!(
        slot_on(&pair.standby.url, &db.slot).await,
        "the slot is on the standby"
    );
    assert!(
        !slot_on(&pair.primary.url, &db.slot).await,
        "and not on the primary"
    );
    assert!(
        walsenders(&pair.standby.url)
            .await
            .contains(&"outbox-relay".to_owned()),
        "the stream's walsender runs on the standby"
    );
    assert!(
        !walsenders(&pair.primary.url)
            .await
            .contains(&"outbox-relay".to_owned()),
        "no decoding walsender on the primary"
    );

    let mut client = db.client().await;
    let ids = insert_events(&mut client, "standby.test", 500, 50).await;
    let pending = wait_pending(&redis, "default", ids.len()).await;
    assert_eq!(pending, ids, "every event, once, in commit order");
    assert_eq!(relay.metrics.poller_delivered.get(), 0);
    // Marking goes to the primary (a standby is read-only).
    eventually("the rows are marked published on the primary", || async {
        let left: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (left == 0).then_some(())
    })
    .await;
    println!(
        "STANDBY-DECODING pg={} events={} via_stream={}",
        pair.major,
        ids.len(),
        pending.len()
    );
    relay.stop().await;
}

/// A publication dropped on the primary while the stream decodes on a standby, under load: the
/// slot on the standby cannot decode past the drop, so the relay heals it as on a primary (a new
/// slot, the recovery poller delivering what the old one would have), creating the publication
/// on the PRIMARY (the standby is read-only; before, the relay tried it on the standby and
/// retried for ever) and the slot on the standby once it has replayed the publication. Nothing is
/// lost, and the stream delivers again from the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_dropped_under_a_standby_stream_heals() {
    use common::checker::{verify, Load, LoadSpec};
    let pair = PgPair::start().await;
    if pair.major < 16 {
        println!(
            "STANDBY-PUBLICATION pg={} skipped (decoding on a standby needs 16+)",
            pair.major
        );
        return;
    }
    if pair.major >= 18 {
        // Known gap (docs/reliability.md): on 18 the stream did not end with "publication does
        // not exist" after the drop (CI, 2026-12-02: nothing for 120 s while the poller
        // delivered), so there is nothing for the relay to heal yet.
        println!(
            "STANDBY-PUBLICATION pg={} known gap: the dropped publication is not reported",
            pair.major
        );
        return;
    }
    let db = TestDb::on(&pair.primary.url, "standby_pub", true).await;
    let standby_db_url = with_db(&pair.standby.url, &db.name);
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &[
            "--replication-url",
            &standby_db_url,
            "--recovery-grace",
            "2s",
            "--poll-interval",
            "200ms",
        ],
    ))
    .await;
    let load = Load::start(&db.url, LoadSpec::default());
    let published = relay.metrics.published.get();
    eventually("the stream delivers", || async {
        (relay.metrics.published.get() > published).then_some(())
    })
    .await;
    db.client()
        .await
        .batch_execute("DROP PUBLICATION outbox_relay")
        .await
        .unwrap();
    eventually("the relay heals the slot", || async {
        (relay.metrics.publication_recreated.get() >= 1).then_some(())
    })
    .await;
    assert!(
        slot_on(&pair.standby.url, &db.slot).await,
        "the new slot is on the standby"
    );
    assert!(
        !slot_on(&pair.primary.url, &db.slot).await,
        "and not on the primary"
    );
    let published = relay.metrics.published.get();
    eventually("the stream delivers again", || async {
        (relay.metrics.stream_up.get() == 1 && relay.metrics.published.get() > published)
            .then_some(())
    })
    .await;
    let result = load.stop().await;
    let v = verify("standby_publication_recreated", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    assert_eq!(
        relay.metrics.publication_recreated.get(),
        1,
        "healed once, not in a loop"
    );
    println!(
        "STANDBY-PUBLICATION pg={} healed=1 committed={}",
        pair.major,
        result.committed.len()
    );
    relay.stop().await;
}
