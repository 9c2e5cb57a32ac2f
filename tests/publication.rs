//! A publication dropped and recreated while the relay streams under load: the slot cannot
//! decode past the drop (see src/replication/publication.rs), so the relay recreates it, and
//! the recovery poller delivers what the old slot would have. Nothing is lost.

mod common;

use common::checker::{verify, Load, LoadSpec};
use common::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_dropped_and_recreated_under_load_heals() {
    let db = TestDb::new("p_recreate").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &["--recovery-grace", "2s", "--poll-interval", "200ms"],
    ))
    .await;
    let load = Load::start(&db.url, LoadSpec::default());
    let published = relay.metrics.published.get();
    eventually("the stream delivers", || async {
        (relay.metrics.published.get() > published).then_some(())
    })
    .await;

    let admin = db.client().await;
    // Two transactions, with the load committing in between: WAL positions exist where the
    // publication does not. (Dropped and created in one transaction, it never goes missing
    // in the catalog's history, and the stream goes on unharmed.)
    admin
        .batch_execute("DROP PUBLICATION outbox_relay")
        .await
        .unwrap();
    let mut c = db.client().await;
    insert_events(&mut c, "between", 3, 1).await;
    // The relay may have been quicker: finding the publication missing, it creates it again
    // (as at start-up) before it makes the new slot. Either way one of the two creates it.
    let created = admin
        .batch_execute(
            "CREATE PUBLICATION outbox_relay FOR TABLE outbox_events WITH (publish = 'insert')",
        )
        .await;
    if let Err(e) = created {
        assert_eq!(
            e.code(),
            Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT),
            "{e}"
        );
    }
    eventually("the relay notices", || async {
        (relay.metrics.publication_recreated.get() >= 1).then_some(())
    })
    .await;
    // The new slot streams again: rows committed from now on come through it.
    let published = relay.metrics.published.get();
    eventually("the stream delivers again", || async {
        (relay.metrics.stream_up.get() == 1 && relay.metrics.published.get() > published)
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let result = load.stop().await;
    let v = verify("publication_recreated", &redis, &result, 1, 0).await;
    assert!(v.ok(), "{v}");
    // Healed once, not retried in a loop.
    assert_eq!(relay.metrics.publication_recreated.get(), 1);
    relay.stop().await;

    // A publication dropped (not recreated) while the relay is down: the next start creates it
    // and the stream resumes; the rows committed meanwhile arrive too.
    admin
        .batch_execute("DROP PUBLICATION outbox_relay")
        .await
        .unwrap();
    let ids = insert_events(&mut c, "after.drop", 5, 5).await;
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &["--recovery-grace", "2s", "--poll-interval", "200ms"],
    ))
    .await;
    let more = insert_events(&mut c, "after.restart", 5, 5).await;
    let pending = wait_pending(&redis, "default", result.committed.len() + 10).await;
    assert!(ids.iter().chain(&more).all(|id| pending.contains(id)));
    relay.stop().await;
}
