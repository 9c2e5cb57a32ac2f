//! A long transaction that the publication filters almost entirely: a bulk change of a business
//! table with one outbox row at its end (the outbox pattern itself). While the walsender
//! replays it, it sends nothing and reads its client's status updates only every
//! `wal_sender_timeout / 2` (and on PostgreSQL 14 and 15, for a table rewrite, not at all until
//! the rewrite is replayed), so the slot holder's `reply_time` stops changing for that long:
//! [`ReplayWatch`] measures that silence, so a test can show the scenario really happened.

use super::{pending_ids, Redis, TestDb, PATIENCE};
use std::time::{Duration, Instant};

/// Rows of the bulk change (`OUTBOX_TEST_REPLAY_ROWS`, default 2,500,000: about ten seconds
/// of replay on the project's 2-core machine).
pub fn replay_rows() -> i64 {
    std::env::var("OUTBOX_TEST_REPLAY_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_500_000)
}

/// Sets `wal_sender_timeout` for the walsenders of `db` (new connections only).
pub async fn set_wal_sender_timeout(db: &TestDb, value: &str) {
    db.client()
        .await
        .batch_execute(&format!(
            "ALTER DATABASE {} SET wal_sender_timeout = '{value}'",
            db.name
        ))
        .await
        .unwrap();
}

/// Creates the business table the bulk change goes to.
pub async fn create_business_table(db: &TestDb) {
    db.client()
        .await
        .batch_execute("CREATE TABLE business (id bigint, note text)")
        .await
        .unwrap();
}

/// Commits `rows` business rows and one outbox row in ONE transaction; its event id.
pub async fn commit_bulk_change(db: &TestDb, rows: i64) -> String {
    commit_with_outbox_row(
        db,
        &format!("INSERT INTO business SELECT g, 'x' FROM generate_series(1, {rows}) g"),
        "bulk.done",
    )
    .await
}

/// Fills the business table with `rows` rows (before the relay's slot exists: never decoded).
pub async fn load_business_rows(db: &TestDb, rows: i64) {
    db.client()
        .await
        .execute(
            "INSERT INTO business SELECT g, 'x' FROM generate_series(1, $1::bigint) g",
            &[&rows],
        )
        .await
        .unwrap();
}

/// Rewrites the whole business table (`ALTER TABLE ... TYPE`) and commits one outbox row in
/// the same transaction; its event id.
pub async fn commit_rewrite(db: &TestDb) -> String {
    commit_with_outbox_row(
        db,
        "ALTER TABLE business ALTER COLUMN id TYPE numeric",
        "rewrite.done",
    )
    .await
}

/// Runs `change` and inserts one outbox row named `event_name` in ONE transaction; its event id.
async fn commit_with_outbox_row(db: &TestDb, change: &str, event_name: &str) -> String {
    let mut c = db.client().await;
    let tx = c.transaction().await.unwrap();
    tx.batch_execute(change).await.unwrap();
    let row = tx
        .query_one(
            "INSERT INTO outbox_events (event_id, event_name, payload) \
             VALUES (gen_random_uuid(), $1, '{}') RETURNING event_id::text",
            &[&event_name],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    row.get(0)
}

/// What happened between the commit and the event's arrival.
#[derive(Debug)]
pub struct ReplayWatch {
    /// From the commit until the task was pending.
    pub delivered_after: Duration,
    /// The longest time the slot holder's `reply_time` stayed unchanged (the walsender read
    /// no status update), as sampled every 50 ms.
    pub longest_reply_silence: Duration,
    /// The walsenders that held the slot, in turn.
    pub holders: Vec<i32>,
}

/// Samples the slot's holder until `id` is pending in the default queue (at most [`PATIENCE`]).
pub async fn watch_replay(db: &TestDb, redis: &Redis, id: &str) -> ReplayWatch {
    let committed = Instant::now();
    let admin = db.client().await;
    let mut conn = redis.conn().await;
    let mut holders: Vec<i32> = Vec::new();
    let mut last: Option<(i32, Option<String>, Instant)> = None;
    let mut longest = Duration::ZERO;
    loop {
        assert!(
            committed.elapsed() < PATIENCE,
            "the event of the bulk change never arrived; slot holders in turn: {holders:?}, \
             longest reply silence {longest:?}"
        );
        let row = admin
            .query_opt(
                "SELECT r.pid, r.reply_time::text FROM pg_replication_slots s \
                 JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1",
                &[&db.slot],
            )
            .await
            .unwrap();
        let now = Instant::now();
        if let Some(row) = row {
            let (pid, reply): (i32, Option<String>) = (row.get(0), row.get(1));
            if holders.last() != Some(&pid) {
                holders.push(pid);
            }
            match &last {
                Some((p, r, since)) if *p == pid && *r == reply => {
                    longest = longest.max(now - *since);
                }
                _ => last = Some((pid, reply, now)),
            }
        }
        if pending_ids(&mut conn, "default")
            .await
            .iter()
            .any(|p| p == id)
        {
            return ReplayWatch {
                delivered_after: committed.elapsed(),
                longest_reply_silence: longest,
                holders,
            };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
