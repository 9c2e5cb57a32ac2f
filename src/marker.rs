//! Marks rows the stream delivered as published, in coalesced batches off the stream's hot path,
//! so the recovery poller does not redo them.
//!
//! The stream hands over row ids without waiting ([`MarkerHandle::mark`] never blocks). If this
//! task falls too far behind (Postgres slow or down), ids beyond the bound are dropped and
//! counted: those rows stay unpublished and the recovery poller re-sends them, which asynq's
//! TaskID dedupe absorbs. Correctness never depends on marking; it only saves work.

use crate::backoff::Backoff;
use crate::metrics::Metrics;
use crate::store::Store;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Ids per UPDATE at most.
const MAX_IDS_PER_UPDATE: usize = 10_000;
/// Batches of ids waiting in the channel at most.
const QUEUE_BATCHES: usize = 256;

/// The stream's side: cheap to clone, never blocks.
#[derive(Clone)]
pub struct MarkerHandle {
    tx: mpsc::Sender<Vec<i64>>,
    metrics: Arc<Metrics>,
}

impl MarkerHandle {
    /// Queues `ids` for marking; drops (and counts) them when the queue is full.
    pub fn mark(&self, ids: Vec<i64>) {
        if ids.is_empty() {
            return;
        }
        let n = ids.len() as u64;
        if self.tx.try_send(ids).is_err() {
            self.metrics.mark_dropped.inc_by(n);
        }
    }
}

/// The marking task.
pub struct Marker {
    rx: mpsc::Receiver<Vec<i64>>,
    pool: deadpool_postgres::Pool,
    store: Store,
    metrics: Arc<Metrics>,
}

impl Marker {
    pub fn new(
        pool: deadpool_postgres::Pool,
        store: Store,
        metrics: Arc<Metrics>,
    ) -> (Self, MarkerHandle) {
        let (tx, rx) = mpsc::channel(QUEUE_BATCHES);
        let handle = MarkerHandle {
            tx,
            metrics: metrics.clone(),
        };
        (
            Self {
                rx,
                pool,
                store,
                metrics,
            },
            handle,
        )
    }

    /// Marks until every handle is dropped, or `shutdown` (after one last flush of what is
    /// queued).
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        let mut pending: Vec<i64> = Vec::new();
        loop {
            if pending.is_empty() {
                tokio::select! {
                    ids = self.rx.recv() => match ids {
                        Some(ids) => pending = ids,
                        None => return,
                    },
                    _ = shutdown.cancelled() => {
                        self.drain(&mut pending);
                        let _ = self.flush(&pending).await;
                        return;
                    }
                }
            }
            self.drain(&mut pending);
            match self.flush(&pending).await {
                Ok(()) => {
                    pending.clear();
                    backoff.reset();
                }
                Err(e) => {
                    tracing::warn!(error = %crate::replication::stream::error_chain(&e), rows = pending.len(), "marking rows published failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff.next_delay()) => {}
                        _ = shutdown.cancelled() => return,
                    }
                }
            }
        }
    }

    /// Coalesces what is queued into `pending`, up to the per-UPDATE bound.
    fn drain(&mut self, pending: &mut Vec<i64>) {
        while pending.len() < MAX_IDS_PER_UPDATE {
            match self.rx.try_recv() {
                Ok(ids) => pending.extend(ids),
                Err(_) => break,
            }
        }
    }

    async fn flush(&self, ids: &[i64]) -> Result<(), MarkError> {
        if ids.is_empty() {
            return Ok(());
        }
        let client = self.pool.get().await?;
        let n = self.store.mark_published(&**client, ids).await?;
        self.metrics.marked.inc_by(n);
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
enum MarkError {
    #[error("cannot get a postgres connection")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("update failed")]
    Query(#[from] tokio_postgres::Error),
}
