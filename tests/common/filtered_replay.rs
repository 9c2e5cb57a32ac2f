//! A long transaction that the publication filters almost entirely: a bulk change of a business
//! table with one outbox row at its end (the outbox pattern itself). While the walsender
//! replays it, it sends nothing and reads its client's status updates only every
//! `wal_sender_timeout / 2` (and on PostgreSQL 14 and 15, for a table rewrite, not at all until
//! the rewrite is replayed), so the slot holder's `reply_time` stops changing for that long:
//! [`ReplayWatch`] measures that silence, so a test can show the scenario really happened, and
//! [`replay_until_silent`] commits larger changes until it did (machines differ in speed: on a
//! quiet, fast one 2.5 M rows kept the walsender silent only 2.9 s, 2026-12-03 CI).

use super::{pending_ids, Redis, TestDb, PATIENCE};
use std::time::{Duration, Instant};

/// Rows of the first bulk change (`OUTBOX_TEST_REPLAY_ROWS`, default 2,500,000: about ten
/// seconds of replay on the project's 2-core machine when busy, under six when quiet).
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

/// Rewrites the whole business table (`ALTER TABLE ... TYPE`, to `numeric` on even tries and
/// back to `bigint` on odd ones, so that each try rewrites) and commits one outbox row in the
/// same transaction; its event id.
pub async fn commit_rewrite(db: &TestDb, try_index: u32) -> String {
    let to = if try_index.is_multiple_of(2) {
        "numeric"
    } else {
        "bigint"
    };
    commit_with_outbox_row(
        db,
        &format!("ALTER TABLE business ALTER COLUMN id TYPE {to}"),
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

/// How many changes [`replay_until_silent`] commits at most, each twice the size of the one
/// before.
pub const TRIES: u32 = 3;

/// The replays of one test: each try's rows and what its watch saw.
#[derive(Debug)]
pub struct Replays {
    pub tries: Vec<(i64, ReplayWatch)>,
}

impl Replays {
    /// The longest silence any try saw.
    pub fn longest_reply_silence(&self) -> Duration {
        self.tries
            .iter()
            .map(|(_, w)| w.longest_reply_silence)
            .max()
            .unwrap_or_default()
    }

    /// The walsenders that held the slot, in turn, over all tries.
    pub fn holders(&self) -> Vec<i32> {
        let mut all: Vec<i32> = Vec::new();
        for pid in self.tries.iter().flat_map(|(_, w)| &w.holders) {
            if all.last() != Some(pid) {
                all.push(*pid);
            }
        }
        all
    }

    /// The events committed (one per try).
    pub fn events(&self) -> u64 {
        self.tries.len() as u64
    }
}

/// Runs `commit(try_index)` (it commits a change and returns its rows and its event id) and
/// watches the replay, until a try keeps the slot holder's `reply_time` still for longer than
/// `needed`, at most [`TRIES`] times. The caller asserts that the last try did
/// ([`Replays::longest_reply_silence`]), so that the test fails, and does not pass, on a machine
/// where even the largest change replays too fast.
pub async fn replay_until_silent(
    db: &TestDb,
    redis: &Redis,
    needed: Duration,
    mut commit: impl AsyncFnMut(u32) -> (i64, String),
) -> Replays {
    let mut tries = Vec::new();
    for n in 0..TRIES {
        let (rows, id) = commit(n).await;
        let watch = watch_replay(db, redis, &id).await;
        let enough = watch.longest_reply_silence > needed;
        tries.push((rows, watch));
        if enough {
            break;
        }
    }
    Replays { tries }
}
