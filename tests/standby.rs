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
    wait_all_published(&client).await;
    println!(
        "STANDBY-DECODING pg={} events={} via_stream={}",
        pair.major,
        ids.len(),
        pending.len()
    );
    relay.stop().await;
}

/// A publication dropped on the primary while the stream decodes on a standby, under load. The
/// relay creates it again on the PRIMARY (the standby is read-only; once, the relay tried it on
/// the standby and retried for ever). Before PostgreSQL 18 the slot on the standby cannot decode
/// past the drop, so the relay also recreates it there once the standby has replayed the new
/// publication; from 18 the slot skips the missing publication without an error (nothing but the
/// relay's periodic check notices) and picks up the new one, so the slot is kept. Either way the
/// recovery poller delivers the rows committed while the publication was missing, nothing is
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
    let db = TestDb::on(&pair.primary.url, "standby_pub", true).await;
    let standby_db_url = with_db(&pair.standby.url, &db.name);
    let redis = Redis::start();
    let slot_kept = pair.major >= 18;
    // From 18 only the relay's periodic check notices the drop. Before 18 it is kept out (once
    // an hour), so that the slot's repair is what this tests: a check creating the publication
    // before the walsender decoded a change after the drop would leave it nothing to repair.
    let check_every = if slot_kept { "500ms" } else { "1h" };
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
            "--health-interval",
            check_every,
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
    // The primary's position: the standby replays the same WAL, at the same positions.
    let dropped_at = db.current_lsn().await;
    stream_delivers_after(&relay, dropped_at).await;
    eventually("the relay counts its repair", || async {
        (relay.metrics.publication_restored.get() >= 1
            && (slot_kept || relay.metrics.publication_recreated.get() >= 1))
            .then_some(())
    })
    .await;
    assert!(
        slot_on(&pair.standby.url, &db.slot).await,
        "the slot is on the standby"
    );
    assert!(
        !slot_on(&pair.primary.url, &db.slot).await,
        "and not on the primary"
    );
    let result = load.stop().await;
    let v = verify("standby_publication_recreated", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    assert_eq!(
        relay.metrics.publication_restored.get(),
        1,
        "created again once, not in a loop"
    );
    assert_eq!(
        relay.metrics.publication_recreated.get(),
        u64::from(!slot_kept),
        "the slot recreated once before 18, kept from 18"
    );
    assert_eq!(relay.metrics.slot_lost.get(), 0);
    println!(
        "STANDBY-PUBLICATION pg={} restored=1 slot_recreated={} committed={}",
        pair.major,
        relay.metrics.publication_recreated.get(),
        result.committed.len()
    );
    relay.stop().await;
}

/// A relay that must not skip events (`OUTBOX_ON_SLOT_LOST=stop`, no recovery poller) refuses to
/// start while its publication is missing and its slot exists on the standby, as it does with a
/// slot on the primary: creating the publication behind the slot would make it skip (from 18)
/// or fail to decode (before) the inserts committed without it. Found by review: with a
/// standby's slot the start-up guard was skipped and the start created the publication.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_refuses_a_missing_publication_behind_a_standby_slot_when_it_must_not_skip() {
    let pair = PgPair::start().await;
    if pair.major < 16 {
        println!(
            "STANDBY-GUARD pg={} skipped (decoding on a standby needs 16+)",
            pair.major
        );
        return;
    }
    let db = TestDb::on(&pair.primary.url, "standby_guard", true).await;
    let standby_db_url = with_db(&pair.standby.url, &db.name);
    let redis = Redis::start();
    let args = || {
        run_args(
            &db,
            &redis.url,
            &[
                "--replication-url",
                &standby_db_url,
                "--recovery",
                "false",
                "--on-slot-lost",
                "stop",
            ],
        )
    };
    Relay::start_streaming(args()).await.stop().await;
    assert!(slot_on(&pair.standby.url, &db.slot).await);
    let admin = db.client().await;
    admin
        .batch_execute("DROP PUBLICATION outbox_relay")
        .await
        .unwrap();
    let err = tokio::time::timeout(PATIENCE, Relay::failure(args()))
        .await
        .expect("the relay started behind the standby's slot");
    assert!(err.contains("is missing while slot"), "{err}");
    let missing = admin
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = 'outbox_relay'",
            &[],
        )
        .await
        .unwrap()
        .is_none();
    assert!(missing, "the start created the publication again");
    println!("STANDBY-GUARD pg={} refused", pair.major);
}
