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
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Event ids waiting to be checked at most (16 bytes each).
const MAX_PENDING: usize = 100_000;
/// Event ids per query at most.
const MAX_PER_QUERY: usize = 10_000;
/// Checks wait this long after a write met an existing TaskID, so that a replay's many batches
/// make one query (without a unique index, each query may scan the table).
const COALESCE: Duration = Duration::from_millis(500);
/// Event ids already reported, remembered so a replay does not log them again; forgotten all at
/// once past this many.
const MAX_REPORTED: usize = 100_000;

struct Shared {
    pending: Mutex<Vec<Uuid>>,
    notify: Notify,
}

/// The stream's and the pollers' side: cheap to clone, never blocks.
#[derive(Clone)]
pub struct SharedIdsHandle {
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
}

impl SharedIdsHandle {
    /// Queues the event_ids of a write that met an existing TaskID.
    pub fn check(&self, event_ids: Vec<Uuid>) {
        if event_ids.is_empty() {
            return;
        }
        {
            let mut pending = self.shared.pending.lock().expect("shared-id lock");
            if pending.len() + event_ids.len() > MAX_PENDING {
                self.metrics
                    .shared_event_id_unchecked
                    .inc_by(event_ids.len() as u64);
                return;
            }
            pending.extend(event_ids);
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
    reported: HashSet<Uuid>,
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
            reported: HashSet::new(),
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
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(COALESCE) => {}
            }
            loop {
                let ids = self.take();
                if ids.is_empty() {
                    break;
                }
                if let Err(e) = self.check(&ids).await {
                    self.metrics
                        .shared_event_id_unchecked
                        .inc_by(ids.len() as u64);
                    tracing::warn!(
                        error = %error_chain(&e),
                        event_ids = ids.len(),
                        "could not check whether rows share their event_id"
                    );
                    break;
                }
            }
        }
    }

    /// Up to [`MAX_PER_QUERY`] distinct event ids not yet reported.
    fn take(&mut self) -> Vec<Uuid> {
        let mut pending = self.shared.pending.lock().expect("shared-id lock");
        let mut ids = HashSet::new();
        while ids.len() < MAX_PER_QUERY {
            let Some(id) = pending.pop() else { break };
            if !self.reported.contains(&id) {
                ids.insert(id);
            }
        }
        ids.into_iter().collect()
    }

    async fn check(&mut self, ids: &[Uuid]) -> Result<(), crate::store::StoreError> {
        let client = self.pool.get().await?;
        let groups = self.store.rows_sharing_event_ids(&**client, ids).await?;
        for (event_id, rows) in groups {
            if self.reported.len() >= MAX_REPORTED {
                self.reported.clear();
            }
            if !self.reported.insert(event_id) {
                continue;
            }
            self.metrics
                .shared_event_id
                .inc_by(rows.len().saturating_sub(1) as u64);
            tracing::warn!(
                %event_id,
                rows = ?rows,
                "rows share an event_id: Valkey holds one task for all of them (asynq keeps one \
                 task per TaskID), so only the first row delivered became a task and the others \
                 were marked published without one; give each event its own event_id, and \
                 restore the table's UNIQUE (event_id)"
            );
        }
        Ok(())
    }
}
