//! Rows that share an event_id.
//!
//! The Go kit's migration declares `event_id UNIQUE`. A table without that constraint can hold
//! two rows with one event_id, and asynq keeps one task per TaskID in a queue: when both rows
//! route to the same queue, the later row's write is answered "already exists", exactly as a
//! replay is, and the row is marked published although its own payload never became a task.
//! (Rows routed to different queues are two tasks, and not reported.) Valkey cannot tell the
//! two apart; the table can.
//!
//! At start the relay looks for a valid unique index on event_id
//! ([`crate::replication::setup::has_unique_event_id`]). Without one it warns, and runs this
//! watch: the stream and the pollers hand it the (row id, event_id, queue) of every row of a
//! write that met an existing TaskID ([`SharedIdsHandle::check`], which never blocks). Rows are
//! told apart by their row id, so a replay (one row sent twice) is never taken for two rows.
//! The watch joins the rows it was handed with those the table holds for the same event_ids
//! (one query per [`COALESCE`] or more, routing the table's rows by their event_name), logs
//! each (queue, event_id) that more than one row carries with its first row ids, and counts the
//! rows beyond the first in `outbox_events_shared_event_id_total`; a row that joins a group
//! already reported is logged and counted too. It diagnoses, off the delivery path: neither
//! delivery nor marking waits for it. Rows it had no room or no answer to check are counted in
//! `outbox_events_shared_event_id_unchecked_total`, never dropped silently.
//!
//! What it remembers is per process and bounded ([`MAX_REPORTED`] row ids, then forgotten all
//! at once): after a restart or that, the replay of a reported pair reports it again. A row
//! deleted after delivery (`OUTBOX_DELETE_DELIVERED`, `cleanup`) is still seen while it is
//! among the rows handed over in the same check (rows of one write); an event_id reused after
//! that looks like a replay to the relay (docs/task-format.md).

use crate::error_chain::error_chain;
use crate::metrics::Metrics;
use crate::store::Store;
use crate::task::TaskSettings;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Rows waiting to be checked at most (24 bytes each).
const MAX_PENDING: usize = 100_000;
/// Event ids per query at most.
const MAX_PER_QUERY: usize = 10_000;
/// Checks wait at least this long after a write met an existing TaskID, so that a replay's many
/// batches make one query.
pub const COALESCE: Duration = Duration::from_millis(500);
/// Without an index on event_id each query scans the table: the wait before the next one is
/// at least this many times the last query's duration (at most [`MAX_PAUSE`]).
const PAUSE_FACTOR: u32 = 10;
const MAX_PAUSE: Duration = Duration::from_secs(60);
/// A query running longer than this is cancelled (its event ids counted unchecked).
const STATEMENT_TIMEOUT: &str = "10s";
/// Row ids of reported groups, remembered so a replay does not count them again; forgotten all
/// at once past this many.
const MAX_REPORTED: usize = 100_000;
/// Row ids named in one log line at most.
const LOGGED_ROWS: usize = 20;

/// A row of a write that met an existing TaskID: its id, event_id and queue.
pub type HandedRow = (i64, Uuid, Arc<str>);
/// TaskIDs are unique per queue.
type Key = (Arc<str>, Uuid);

struct Shared {
    /// Rows whose write met an existing TaskID.
    pending: Mutex<Vec<HandedRow>>,
    notify: Notify,
}

/// The stream's and the pollers' side: cheap to clone, never blocks.
#[derive(Clone)]
pub struct SharedIdsHandle {
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
}

impl SharedIdsHandle {
    /// Queues the rows of a write that met an existing TaskID.
    pub fn check(&self, rows: Vec<HandedRow>) {
        if rows.is_empty() {
            return;
        }
        {
            let mut pending = self.shared.pending.lock().expect("shared-id lock");
            if pending.len() + rows.len() > MAX_PENDING {
                self.metrics
                    .shared_event_id_unchecked
                    .inc_by(rows.len() as u64);
                return;
            }
            pending.extend(rows);
        }
        self.shared.notify.notify_one();
    }
}

/// The checking task.
pub struct SharedIdsWatch {
    shared: Arc<Shared>,
    pool: deadpool_postgres::Pool,
    store: Store,
    tasks: Arc<TaskSettings>,
    metrics: Arc<Metrics>,
    /// Groups reported, with the rows counted for each.
    reported: HashMap<Key, BTreeSet<i64>>,
    /// Row ids in `reported`.
    reported_rows: usize,
    /// The wait before the next query.
    pause: Duration,
}

impl SharedIdsWatch {
    pub fn new(
        pool: deadpool_postgres::Pool,
        store: Store,
        tasks: Arc<TaskSettings>,
        metrics: Arc<Metrics>,
    ) -> (Self, SharedIdsHandle) {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Vec::new()),
            notify: Notify::new(),
        });
        let handle = SharedIdsHandle {
            shared: shared.clone(),
            metrics: metrics.clone(),
        };
        let watch = Self {
            shared,
            pool,
            store,
            tasks,
            metrics,
            reported: HashMap::new(),
            reported_rows: 0,
            pause: COALESCE,
        };
        (watch, handle)
    }

    /// Checks until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = self.shared.notify.notified() => {}
            }
            loop {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(self.pause) => {}
                }
                let rows = self.take();
                if rows.is_empty() {
                    break;
                }
                let started = Instant::now();
                let result = tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return,
                    r = self.check(&rows) => r,
                };
                self.pause = (started.elapsed() * PAUSE_FACTOR).clamp(COALESCE, MAX_PAUSE);
                if let Err(e) = result {
                    let unchecked: usize = rows.values().map(BTreeSet::len).sum();
                    self.metrics
                        .shared_event_id_unchecked
                        .inc_by(unchecked as u64);
                    tracing::warn!(
                        error = %error_chain(&e),
                        rows = unchecked,
                        "could not check whether rows share their event_id"
                    );
                }
            }
        }
    }

    /// The oldest handed rows, up to [`MAX_PER_QUERY`], grouped by queue and event_id.
    fn take(&mut self) -> HashMap<Key, BTreeSet<i64>> {
        let taken: Vec<HandedRow> = {
            let mut pending = self.shared.pending.lock().expect("shared-id lock");
            let n = pending.len().min(MAX_PER_QUERY);
            pending.drain(..n).collect()
        };
        let mut rows: HashMap<Key, BTreeSet<i64>> = HashMap::new();
        for (row_id, event_id, queue) in taken {
            rows.entry((queue, event_id)).or_default().insert(row_id);
        }
        rows
    }

    async fn check(
        &mut self,
        handed: &HashMap<Key, BTreeSet<i64>>,
    ) -> Result<(), crate::store::StoreError> {
        let ids: Vec<Uuid> = handed
            .keys()
            .map(|(_, id)| *id)
            .collect::<std::collections::HashSet<_>>()
            .into_iter()
            .collect();
        let in_table = {
            let mut client = self.pool.get().await?;
            let tx = client.transaction().await?;
            tx.batch_execute(&format!(
                "SET LOCAL statement_timeout = '{STATEMENT_TIMEOUT}'"
            ))
            .await?;
            let found = self.store.rows_sharing_event_ids(&*tx, &ids).await?;
            tx.commit().await?;
            found
        };
        let mut all: HashMap<Key, BTreeSet<i64>> = handed.clone();
        for (event_id, row_id, event_name) in in_table {
            let queue = self.tasks.queue_for(&event_name).clone();
            all.entry((queue, event_id)).or_default().insert(row_id);
        }
        for (key, rows) in all {
            self.note(key, rows);
        }
        Ok(())
    }

    /// Counts and logs the rows of a group not counted before, if it has more than one row.
    fn note(&mut self, key: Key, rows: BTreeSet<i64>) {
        if rows.len() < 2 {
            return;
        }
        let new = match self.reported.get(&key) {
            None => rows.len() - 1,
            Some(counted) => rows.difference(counted).count(),
        };
        if new == 0 {
            return;
        }
        if self.reported_rows + rows.len() > MAX_REPORTED {
            self.reported.clear();
            self.reported_rows = 0;
        }
        let counted = self.reported.entry(key.clone()).or_default();
        let before = counted.len();
        counted.extend(&rows);
        self.reported_rows += counted.len() - before;
        self.metrics.shared_event_id.inc_by(new as u64);
        let (queue, event_id) = key;
        let first: Vec<i64> = rows.iter().copied().take(LOGGED_ROWS).collect();
        tracing::warn!(
            %event_id,
            queue = %queue,
            rows = rows.len(),
            first_row_ids = ?first,
            "rows share an event_id in one queue: Valkey holds one task for all of them (asynq \
             keeps one task per TaskID in a queue), so only the first row delivered became a task and the others \
             were marked published without one; give each event its own event_id, and \
             restore the table's UNIQUE (event_id)"
        );
    }
}
