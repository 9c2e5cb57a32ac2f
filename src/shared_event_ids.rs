//! Rows that share an event_id.
//!
//! The Go kit's migration declares `event_id UNIQUE`. A table without that constraint can hold
//! two rows with one event_id, and asynq keeps one task per TaskID: the later row's write is
//! answered "already exists", exactly as a replay is, and the row is marked published although
//! its own payload never became a task. Valkey cannot tell the two apart; the table can.
//!
//! At start the relay looks for a unique index on event_id
//! ([`crate::replication::setup::has_unique_event_id`]). Without one it warns, and runs this
//! watch: the stream and the poller hand it the event_ids of every write that met an existing
//! TaskID ([`SharedIdsHandle::check`], which never blocks); it asks the table which of them more
//! than one row carries, logs each such event_id once with its row ids, and counts the rows
//! beyond the first in `outbox_events_shared_event_id_total`. It diagnoses, off the delivery
//! path: neither delivery nor marking waits for it. Event ids it had no room to check are
//! counted in `outbox_events_shared_event_id_unchecked_total`, never dropped silently.
//!
//! A row deleted after delivery (`OUTBOX_DELETE_DELIVERED`) leaves nothing to compare with: an
//! event_id reused after that is a replay to the relay (docs/reliability.md).

use crate::error_chain::error_chain;
use crate::metrics::Metrics;
use crate::store::Store;
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
/// Event ids already reported, with the rows counted, remembered so a replay does not count
/// them again; forgotten all at once past this many.
const MAX_REPORTED: usize = 100_000;

struct Shared {
    /// (row id, event_id) of rows whose write met an existing TaskID.
    pending: Mutex<Vec<(i64, Uuid)>>,
    notify: Notify,
}

/// The stream's and the pollers' side: cheap to clone, never blocks.
#[derive(Clone)]
pub struct SharedIdsHandle {
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
}

impl SharedIdsHandle {
    /// Queues the (row id, event_id) of the rows of a write that met an existing TaskID.
    pub fn check(&self, rows: Vec<(i64, Uuid)>) {
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
    metrics: Arc<Metrics>,
    /// Event ids reported, with the rows counted for each.
    reported: HashMap<Uuid, BTreeSet<i64>>,
    /// The wait before the next query.
    pause: Duration,
}

impl SharedIdsWatch {
    pub fn new(
        pool: deadpool_postgres::Pool,
        store: Store,
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
            metrics,
            reported: HashMap::new(),
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
                    self.metrics
                        .shared_event_id_unchecked
                        .inc_by(rows.len() as u64);
                    tracing::warn!(
                        error = %error_chain(&e),
                        event_ids = rows.len(),
                        "could not check whether rows share their event_id"
                    );
                }
            }
        }
    }

    /// The handed rows of up to [`MAX_PER_QUERY`] event ids, grouped by event_id.
    fn take(&mut self) -> HashMap<Uuid, BTreeSet<i64>> {
        let taken = {
            let mut pending = self.shared.pending.lock().expect("shared-id lock");
            let keep = pending.len().saturating_sub(MAX_PER_QUERY);
            pending.split_off(keep)
        };
        let mut rows: HashMap<Uuid, BTreeSet<i64>> = HashMap::new();
        for (row_id, event_id) in taken {
            rows.entry(event_id).or_default().insert(row_id);
        }
        rows
    }

    async fn check(
        &mut self,
        handed: &HashMap<Uuid, BTreeSet<i64>>,
    ) -> Result<(), crate::store::StoreError> {
        let ids: Vec<Uuid> = handed.keys().copied().collect();
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
        let mut all: HashMap<Uuid, BTreeSet<i64>> = handed.clone();
        for (event_id, rows) in in_table {
            all.entry(event_id).or_default().extend(rows);
        }
        for (event_id, rows) in all {
            self.note(event_id, rows);
        }
        Ok(())
    }

    /// Counts and logs the rows of `event_id` not counted before, if more than one row has it.
    fn note(&mut self, event_id: Uuid, rows: BTreeSet<i64>) {
        if rows.len() < 2 {
            return;
        }
        let new = match self.reported.get(&event_id) {
            None => rows.len() - 1,
            Some(counted) => rows.difference(counted).count(),
        };
        if new == 0 {
            return;
        }
        if self.reported.len() >= MAX_REPORTED && !self.reported.contains_key(&event_id) {
            self.reported.clear();
        }
        self.reported.entry(event_id).or_default().extend(&rows);
        self.metrics.shared_event_id.inc_by(new as u64);
        tracing::warn!(
            %event_id,
            rows = ?rows,
            "rows share an event_id: Valkey holds one task for all of them (asynq keeps one \
             task per TaskID), so only the first row delivered became a task and the others \
             were marked published without one; give each event its own event_id, and \
             restore the table's UNIQUE (event_id)"
        );
    }
}
