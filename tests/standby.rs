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
