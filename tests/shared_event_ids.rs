//! Two rows with one event_id, in a table whose UNIQUE (event_id) was dropped (issue 14): asynq
//! keeps one task per TaskID, so the second row is answered "already exists", exactly as a
//! replay is, and marked published without a task of its own. The relay cannot deliver it as
//! its own task, but it must say so: each such event_id is logged once and counted in
//! `outbox_events_shared_event_id_total`, and a plain replay (one row, sent twice) is not.

mod common;

use common::*;
use outbox_relay::pgoutput::TableName;
use outbox_relay::replication::setup;

const SHARED: &str = "6f1c1d1e-0000-4000-8000-000000000001";

async fn drop_unique_event_id(db: &TestDb) {
    db.client()
        .await
        .batch_execute("ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_event_id_key")
        .await
        .unwrap();
}

async fn insert_with_id(c: &impl tokio_postgres::GenericClient, event_id: &str, note: &str) {
    c.execute(
        "INSERT INTO outbox_events (event_id, event_name, payload, metadata) \
         VALUES ($1::text::uuid, 'order.created', jsonb_build_object('note', $2::text), '{}')",
        &[&event_id, &note],
    )
    .await
    .unwrap();
}

async fn task_note(redis: &Redis, id: &str) -> String {
    let (msg, _, _) = task(&mut redis.conn().await, "default", id)
        .await
        .expect("the shared event_id has a task");
    let payload = String::from_utf8(msg.payload).unwrap();
    ["first", "second"]
        .into_iter()
        .find(|n| payload.contains(n))
        .unwrap_or_else(|| panic!("payload {payload} holds neither row's note"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_reports_a_second_row_with_the_same_event_id() {
    let (db, redis) = database_and_redis("sharedstream").await;
    drop_unique_event_id(&db).await;
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &[])).await;
    let c = db.client().await;
    insert_with_id(&c, SHARED, "first").await;
    insert_with_id(&c, SHARED, "second").await;
    eventually("the second row counted as sharing its event_id", || async {
        (relay.metrics.shared_event_id.get() == 1).then_some(())
    })
    .await;
    assert_eq!(
        pending_ids(&mut redis.conn().await, "default").await,
        [SHARED],
        "one task for both rows"
    );
    assert_eq!(task_note(&redis, SHARED).await, "first");
    assert_eq!(relay.metrics.shared_event_id_unchecked.get(), 0);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_poller_reports_shared_event_ids_but_not_a_replay() {
    let (db, redis) = database_and_redis("sharedpoll").await;
    drop_unique_event_id(&db).await;
    let poll = ["--mode", "poll", "--poll-interval", "100ms"];
    let mut c = db.client().await;
    // A row delivered once, then made unpublished again: the poller replays it, and its
    // TaskID already exists, as the shared event_id's does. Both in one round and one write
    // (batch size 10), so the check sees them in one query.
    let replayed = insert_events(&mut c, "order.created", 1, 1).await.remove(0);
    let relay = Relay::start(run_args(&db, &redis.url, &poll));
    eventually("the first row delivered", || async {
        (relay.metrics.published.get() == 1).then_some(())
    })
    .await;
    relay.stop().await;
    let tx = c.transaction().await.unwrap();
    tx.execute(
        "UPDATE outbox_events SET published_at = NULL WHERE event_id = $1::text::uuid",
        &[&replayed],
    )
    .await
    .unwrap();
    insert_with_id(&tx, SHARED, "first").await;
    insert_with_id(&tx, SHARED, "second").await;
    tx.commit().await.unwrap();

    let relay = Relay::start(run_args(&db, &redis.url, &poll));
    eventually("the three rows delivered", || async {
        (relay.metrics.published.get() == 3).then_some(())
    })
    .await;
    assert_eq!(
        relay.metrics.duplicates.get(),
        2,
        "the replay and the second row"
    );
    eventually("the second row counted as sharing its event_id", || async {
        (relay.metrics.shared_event_id.get() >= 1).then_some(())
    })
    .await;
    // The replayed row was in the same query: had it been counted, this would be 2.
    assert_eq!(relay.metrics.shared_event_id.get(), 1);
    assert_eq!(relay.metrics.shared_event_id_unchecked.get(), 0);
    assert_eq!(task_note(&redis, SHARED).await, "first");
    let unpublished: Vec<i64> = column(
        &c,
        "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
        &[],
    )
    .await;
    assert_eq!(
        unpublished,
        [0],
        "the second row is marked published, as logged"
    );
    relay.stop().await;
}

/// The start-up check that decides whether the watch runs: only a unique index on event_id
/// alone, with no predicate, makes sharing impossible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_full_unique_index_on_event_id_counts_as_unique() {
    let db = TestDb::new("sharedindex").await;
    let c = db.client().await;
    let table = setup::resolve_table(&c, &TableName::parse("outbox_events").unwrap())
        .await
        .unwrap();
    let unique = || async { setup::has_unique_event_id(&c, &table).await.unwrap() };
    assert!(
        unique().await,
        "the Go kit's migration: event_id uuid NOT NULL UNIQUE"
    );
    c.batch_execute("ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_event_id_key")
        .await
        .unwrap();
    assert!(!unique().await);
    c.batch_execute("CREATE INDEX plain ON outbox_events (event_id)")
        .await
        .unwrap();
    assert!(!unique().await, "a plain index");
    c.batch_execute(
        "CREATE UNIQUE INDEX partial ON outbox_events (event_id) WHERE published_at IS NULL",
    )
    .await
    .unwrap();
    assert!(!unique().await, "a partial unique index");
    c.batch_execute("CREATE UNIQUE INDEX pair ON outbox_events (event_id, id)")
        .await
        .unwrap();
    assert!(!unique().await, "unique only with another column");
    c.batch_execute("CREATE UNIQUE INDEX whole ON outbox_events (event_id)")
        .await
        .unwrap();
    assert!(unique().await);
}

/// A third row reusing an event_id already reported is one more row without a task of its own:
/// counted and logged too (found by review: the watch skipped reported event ids).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_row_after_the_report_is_counted_too() {
    let (db, redis) = database_and_redis("sharedthird").await;
    drop_unique_event_id(&db).await;
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &[])).await;
    let c = db.client().await;
    insert_with_id(&c, SHARED, "first").await;
    insert_with_id(&c, SHARED, "second").await;
    eventually("the second row counted", || async {
        (relay.metrics.shared_event_id.get() == 1).then_some(())
    })
    .await;
    insert_with_id(&c, SHARED, "third").await;
    eventually("the third row counted", || async {
        (relay.metrics.shared_event_id.get() == 2).then_some(())
    })
    .await;
    assert_eq!(relay.metrics.duplicates.get(), 2);
    assert_eq!(task_note(&redis, SHARED).await, "first");
    relay.stop().await;
}

/// With OUTBOX_DELETE_DELIVERED the rows are gone before any query could find them; rows
/// handed over in one check are still compared by their row ids (found by review: the pair was
/// never reported). The poller writes both rows in one write, so they are handed over
/// together; the stream does so only when they share a write (docs/task-format.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_deleted_on_delivery_are_still_reported_when_written_together() {
    let (db, redis) = database_and_redis("shareddelete").await;
    drop_unique_event_id(&db).await;
    let mut c = db.client().await;
    let tx = c.transaction().await.unwrap();
    insert_with_id(&tx, SHARED, "first").await;
    insert_with_id(&tx, SHARED, "second").await;
    tx.commit().await.unwrap();
    let relay = Relay::start(run_args(
        &db,
        &redis.url,
        &[
            "--mode",
            "poll",
            "--poll-interval",
            "100ms",
            "--delete-delivered",
            "true",
        ],
    ));
    eventually("the pair reported", || async {
        (relay.metrics.shared_event_id.get() == 1).then_some(())
    })
    .await;
    let left: Vec<i64> = column(&c, "SELECT count(*) FROM outbox_events", &[]).await;
    assert_eq!(
        left,
        [0],
        "both rows deleted: the table could not have told"
    );
    assert_eq!(task_note(&redis, SHARED).await, "first");
    relay.stop().await;
}

/// A `CREATE UNIQUE INDEX CONCURRENTLY` that failed on the very duplicates leaves an invalid
/// unique index, which enforces nothing: it must not switch the check off (found by review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_unique_index_is_not_unique() {
    let db = TestDb::new("sharedinvalid").await;
    let c = db.client().await;
    let table = setup::resolve_table(&c, &TableName::parse("outbox_events").unwrap())
        .await
        .unwrap();
    c.batch_execute("ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_event_id_key")
        .await
        .unwrap();
    insert_with_id(&c, SHARED, "first").await;
    insert_with_id(&c, SHARED, "second").await;
    let built = c
        .batch_execute("CREATE UNIQUE INDEX CONCURRENTLY whole ON outbox_events (event_id)")
        .await;
    assert!(built.is_err(), "the duplicates make the build fail");
    let valid: Vec<bool> = column(
        &c,
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'whole'::regclass",
        &[],
    )
    .await;
    assert_eq!(valid, [false], "an invalid index was left behind");
    assert!(!setup::has_unique_event_id(&c, &table).await.unwrap());
    assert!(
        !setup::has_event_id_index(&c, &table).await.unwrap(),
        "an invalid index does not serve look-ups either"
    );
    c.batch_execute("CREATE INDEX plain ON outbox_events (event_id)")
        .await
        .unwrap();
    assert!(setup::has_event_id_index(&c, &table).await.unwrap());
    assert!(!setup::has_unique_event_id(&c, &table).await.unwrap());
}

/// asynq's TaskID is unique per queue (`asynq:{<queue>}:t:<id>`): two rows with one event_id
/// routed to different queues are two tasks, each with its own payload, and are not counted
/// (found by review). A replay of both, in the same write as a third row that shares the
/// event_id in one of the queues, counts that third row alone: grouping by event_id only would
/// count two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_sharing_an_event_id_in_different_queues_are_two_tasks() {
    let (db, redis) = database_and_redis("sharedqueues").await;
    drop_unique_event_id(&db).await;
    let args = [
        "--mode",
        "poll",
        "--poll-interval",
        "100ms",
        "--queue-routes",
        "a.*=qa,b.*=qb",
    ];
    let insert = "INSERT INTO outbox_events (event_id, event_name, payload, metadata) \
                  VALUES ($1::text::uuid, $2, '{}', '{}')";
    let mut c = db.client().await;
    for name in ["a.created", "b.created"] {
        c.execute(insert, &[&SHARED, &name]).await.unwrap();
    }
    let relay = Relay::start(run_args(&db, &redis.url, &args));
    eventually("both rows delivered", || async {
        (relay.metrics.published.get() == 2).then_some(())
    })
    .await;
    assert_eq!(relay.metrics.duplicates.get(), 0, "two queues, two tasks");
    relay.stop().await;
    for q in ["qa", "qb"] {
        assert!(
            task(&mut redis.conn().await, q, SHARED).await.is_some(),
            "each row has its own task in {q}"
        );
    }
    let tx = c.transaction().await.unwrap();
    tx.execute("UPDATE outbox_events SET published_at = NULL", &[])
        .await
        .unwrap();
    tx.execute(insert, &[&SHARED, &"a.updated"]).await.unwrap();
    tx.commit().await.unwrap();
    let relay = Relay::start(run_args(&db, &redis.url, &args));
    eventually("the three rows delivered", || async {
        (relay.metrics.published.get() == 3).then_some(())
    })
    .await;
    assert_eq!(
        relay.metrics.duplicates.get(),
        3,
        "two replays and the third row"
    );
    eventually("the third row counted", || async {
        (relay.metrics.shared_event_id.get() >= 1).then_some(())
    })
    .await;
    assert_eq!(
        relay.metrics.shared_event_id.get(),
        1,
        "only the row sharing qa's task; the row in qb has its own"
    );
    relay.stop().await;
}
