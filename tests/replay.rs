//! Replays against a consumer that ran the tasks: an asynq server's own steps (dequeue, then
//! complete with retention or delete without) move the tasks on, then the slot is rewound so the
//! relay re-sends every one of them. While the task hashes exist the replay adds nothing; with a
//! retention of 0 the completed tasks are enqueued again, as docs/reliability.md says.

mod common;

use common::asynq_worker::AsynqWorker;
use common::observed::ObservedRelay;
use common::*;
use std::collections::HashSet;

/// The recovery poller only takes rows an hour old: the stream alone delivers and replays.
const STREAM_ONLY: [&str; 2] = ["--recovery-grace", "1h"];

/// What a replay did to a queue whose consumer had run some tasks.
struct Replayed {
    ids: Vec<String>,
    /// Ids the consumer completed, started (active) and left pending.
    completed: Vec<String>,
    active: Vec<String>,
    /// The pending list before and after the replay, oldest first.
    pending_before: Vec<String>,
    pending_after: Vec<String>,
    /// `outbox_events_duplicate_total` of the relay that replayed.
    duplicates: f64,
    published: f64,
    worker: AsynqWorker,
    /// The server the worker talks to, kept running.
    _redis: Redis,
}

/// 50 events delivered; the consumer completes 30 and starts 10; then the slot is rewound to
/// before the events (a copy of the slot made before them replaces it) and a new relay replays
/// all 50.
async fn replay_after_consumer(prefix: &str, extra: &[&str]) -> Replayed {
    let db = TestDb::new(prefix).await;
    let redis = Redis::start();
    let args = [&STREAM_ONLY[..], extra].concat();
    let first = ObservedRelay::spawn_streaming(&db, &redis.url, &args).await;
    let admin = db.client().await;
    let rewind = format!("{}_rewind", db.slot);
    let mut c = db.client().await;
    // A copy of the slot at its position now, before the events: the rewind point.
    admin
        .execute(
            "SELECT pg_copy_logical_replication_slot($1, $2)",
            &[&db.slot, &rewind],
        )
        .await
        .unwrap();
    let ids = insert_events(&mut c, "order.placed", 50, 5).await;
    assert_eq!(wait_pending(&redis, "default", 50).await, ids);
    let mut worker = AsynqWorker::new(redis.conn().await, "default");
    let mut completed = Vec::new();
    for _ in 0..30 {
        let msg = worker.dequeue().await.expect("a pending task");
        worker.succeed(&msg).await;
        completed.push(msg.id);
    }
    let mut active = Vec::new();
    for _ in 0..10 {
        active.push(worker.dequeue().await.expect("a pending task").id);
    }
    assert_eq!(completed, ids[..30], "the consumer runs them oldest first");
    // Acknowledged and gone: the relay is stopped, its slot replaced by the copy from before.
    first.signal("TERM");
    let mut first = first;
    assert!(first.process.child.wait().await.unwrap().success());
    db.wait_slot_released().await;
    admin
        .execute("SELECT pg_drop_replication_slot($1)", &[&db.slot])
        .await
        .unwrap();
    admin
        .execute(
            "SELECT pg_copy_logical_replication_slot($1, $2)",
            &[&rewind, &db.slot],
        )
        .await
        .unwrap();
    admin
        .execute("SELECT pg_drop_replication_slot($1)", &[&rewind])
        .await
        .unwrap();
    let mut conn = redis.conn().await;
    let pending_before = pending_ids(&mut conn, "default").await;
    let again = ObservedRelay::spawn_streaming(&db, &redis.url, &args).await;
    // Every replayed event is counted, as a new task or as one Valkey already had.
    let published = again
        .wait_metric("outbox_events_published_total", |n| n >= 50.0)
        .await;
    let duplicates = again.metric("outbox_events_duplicate_total").await.unwrap();
    let pending_after = pending_ids(&mut conn, "default").await;
    again.signal("TERM");
    Replayed {
        ids,
        completed,
        active,
        pending_before,
        pending_after,
        duplicates,
        published,
        worker,
        _redis: redis,
    }
}

/// With a retention (the default 24 h), completed, active and pending tasks all keep their hash:
/// the replay re-sends all 50 and Valkey takes none of them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_after_the_consumer_ran_the_tasks_adds_nothing() {
    let mut r = replay_after_consumer("replay_kept", &[]).await;
    assert_eq!(r.published, 50.0, "the replay re-sent every event");
    assert_eq!(r.duplicates, 50.0, "and Valkey had every one of them");
    assert_eq!(r.pending_after, r.pending_before, "nothing pushed again");
    assert_eq!(r.pending_after, r.ids[40..], "the 10 never dequeued");
    for id in &r.completed {
        assert_eq!(r.worker.state(id).await.as_deref(), Some("completed"));
    }
    for id in &r.active {
        assert_eq!(r.worker.state(id).await.as_deref(), Some("active"));
    }
    assert_eq!(r.worker.processed().await, 30);
}

/// With `OUTBOX_TASK_RETENTION=0` a completed task's hash is deleted at once (asynq's `Done`),
/// so the replay enqueues those 30 again and the handler would run twice: the documented
/// re-enqueue. The active and pending ones are still deduplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_retention_zero_a_replay_enqueues_completed_tasks_again() {
    let mut r = replay_after_consumer("replay_gone", &["--task-retention", "0s"]).await;
    assert_eq!(r.published, 50.0, "the replay re-sent every event");
    assert_eq!(
        r.duplicates, 20.0,
        "only the active and pending ones were still there"
    );
    let again: Vec<String> = r.pending_after[r.pending_before.len()..].to_vec();
    assert_eq!(r.pending_after[..r.pending_before.len()], r.pending_before);
    assert_eq!(
        again, r.completed,
        "the completed ones, in commit order, once each"
    );
    let unique: HashSet<&String> = r.pending_after.iter().collect();
    assert_eq!(
        unique.len(),
        r.pending_after.len(),
        "no id twice in the list"
    );
    // They run again.
    let reran = r.worker.drain().await;
    assert_eq!(reran, [&r.ids[40..], &r.completed[..]].concat());
}
