//! Marks rows the stream delivered as published, in coalesced batches off the stream's hot path,
//! so the recovery poller does not redo them.
//!
//! The stream hands over row ids without waiting ([`MarkerHandle::mark`] appends to a shared
//! buffer and never blocks). This task takes them in UPDATEs of up to 10,000 ids. If it falls
//! too far behind (Postgres slow or down), ids beyond the bound are dropped and counted: those
//! rows stay unpublished and the recovery poller re-sends them, which asynq's TaskID dedupe
//! absorbs. Correctness never depends on marking; it only saves work.
//!
//! A commit reaches the stream as soon as its WAL is flushed, a moment before the transaction is
//! visible to new snapshots, so an UPDATE right after can miss a row. Ids an UPDATE did not find
//! are tried again shortly after, a few times.

use crate::backoff::Backoff;
use crate::error_chain::error_chain;
use crate::metrics::Metrics;
use crate::store::{OutboxTable, StoreError};
use crate::timer::sleep_until_opt;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Ids per UPDATE at most.
const MAX_IDS_PER_UPDATE: usize = 10_000;
/// Ids waiting to be marked at most (24 bytes each, with their event ids: 24 MB).
const MAX_PENDING_IDS: usize = 1_000_000;
/// Ids an UPDATE did not find, kept to be tried again, at most (32 bytes each with their tries
/// left: 3.2 MB); beyond that they are dropped and counted as the ids past `MAX_PENDING_IDS`
/// are.
const MAX_MISSED_IDS: usize = 100_000;
/// After this long, a trickle of ids (fewer than `BURST_IDS`) is marked at once: steady load
/// gets small, frequent UPDATEs, whose WAL the walsender decodes without a noticeable pause
/// (at 5,000 events/s, 100 ms made the p99 latency 3 to 5 times that of 20 ms).
const SHORT: Duration = Duration::from_millis(20);
const BURST_IDS: usize = 5_000;
/// In a burst, marking waits until the stream has been quiet this long, so the burst is
/// delivered before its UPDATEs compete with the walsender for the CPU (on the benchmark
/// machine an UPDATE costs the backend about as much CPU per row as decoding the insert costs
/// the walsender; docs/benchmarks.md)...
const QUIET: Duration = Duration::from_millis(100);
/// ...but never longer than this (and a quarter of OUTBOX_RECOVERY_GRACE: rows not yet marked
/// when the grace ends would be sent again by the recovery poller)...
pub const MAX_WAIT: Duration = Duration::from_secs(5);
/// ...or than this many ids (6 MB).
const FLUSH_IDS: usize = 250_000;
/// Ids an UPDATE did not find are retried after this, this many times.
const MISS_DELAY: Duration = Duration::from_millis(200);
const MISS_TRIES: u8 = 3;

/// A delivered row: its id and its event_id (the pair identifies it even across a failover,
/// where a new primary may reuse an id).
pub type Delivered = (i64, uuid::Uuid);

struct Shared {
    ids: Mutex<Vec<Delivered>>,
    notify: Notify,
}

/// The stream's side: cheap to clone, never blocks.
#[derive(Clone)]
pub struct MarkerHandle {
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
}

impl MarkerHandle {
    /// Queues `ids` for marking; drops (and counts) them when too many are waiting.
    pub fn mark(&self, ids: Vec<Delivered>) {
        if ids.is_empty() {
            return;
        }
        {
            let mut pending = self.shared.ids.lock().expect("marker lock");
            if pending.len() + ids.len() > MAX_PENDING_IDS {
                self.metrics.mark_dropped.inc_by(ids.len() as u64);
                return;
            }
            pending.extend(ids);
        }
        self.shared.notify.notify_one();
    }
}

/// The marking task.
pub struct Marker<T: OutboxTable> {
    shared: Arc<Shared>,
    /// Where rows are marked.
    table: T,
    metrics: Arc<Metrics>,
    /// How long a burst may wait to be marked.
    max_wait: Duration,
    /// Ids an UPDATE missed: (id, tries left), retried at `retry_at`.
    missed: Vec<(Delivered, u8)>,
    retry_at: Option<Instant>,
}

impl<T: OutboxTable> Marker<T> {
    /// `recovery_grace`: the recovery poller's, when it runs; a burst waits at most a quarter
    /// of it (and at most [`MAX_WAIT`]) to be marked.
    pub fn new(
        table: T,
        metrics: Arc<Metrics>,
        recovery_grace: Option<Duration>,
    ) -> (Self, MarkerHandle) {
        let shared = Arc::new(Shared {
            ids: Mutex::new(Vec::new()),
            notify: Notify::new(),
        });
        let handle = MarkerHandle {
            shared: shared.clone(),
            metrics: metrics.clone(),
        };
        let marker = Self {
            shared,
            table,
            metrics,
            max_wait: recovery_grace.map_or(MAX_WAIT, |g| (g / 4).min(MAX_WAIT)),
            missed: Vec::new(),
            retry_at: None,
        };
        (marker, handle)
    }

    /// Marks until `shutdown` (then one last flush of what is queued).
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        loop {
            let retry = self.retry_at;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    let ids = self.take(usize::MAX);
                    let _ = self.flush(&ids, false).await;
                    return;
                }
                // Before new ids: under a steady stream a notification is always waiting, and
                // the retries must not starve behind it (found by review: the misses piled up
                // until the stream went quiet).
                _ = sleep_until_opt(retry) => {
                    self.retry_at = None;
                    self.requeue_misses();
                }
                _ = self.shared.notify.notified() => self.gather().await,
            }
            // What is due now, not what arrives meanwhile: ids the stream queues during these
            // UPDATEs wait for the next quiet moment (a backlog keeps the stream busy).
            let mut due = self.shared.ids.lock().expect("marker lock").len();
            while due > 0 {
                let ids = self.take(due.min(MAX_IDS_PER_UPDATE));
                if ids.is_empty() {
                    break;
                }
                due = due.saturating_sub(ids.len());
                match self.flush(&ids, true).await {
                    Ok(()) => backoff.reset(),
                    Err(e) => {
                        tracing::warn!(error = %error_chain(&e), rows = ids.len(), "marking rows published failed; retrying");
                        due += ids.len();
                        self.shared.ids.lock().expect("marker lock").extend(ids);
                        tokio::select! {
                            biased;
                            _ = shutdown.cancelled() => return,
                            _ = tokio::time::sleep(backoff.next_delay()) => {}
                        }
                    }
                }
            }
        }
    }

    /// Gathers ids into few, large UPDATEs: a steady trickle is marked after `SHORT`; during a
    /// burst, marking waits until the stream is quiet (up to the bounds), so it does not compete
    /// with the stream for the database while the burst is delivered.
    async fn gather(&self) {
        let started = Instant::now();
        loop {
            let pending = self.shared.ids.lock().expect("marker lock").len();
            let waited = started.elapsed();
            if pending >= FLUSH_IDS
                || waited >= self.max_wait
                || (waited >= SHORT && pending < BURST_IDS)
            {
                return;
            }
            if tokio::time::timeout(QUIET, self.shared.notify.notified())
                .await
                .is_err()
            {
                return;
            }
        }
    }

    fn take(&self, max: usize) -> Vec<Delivered> {
        let mut pending = self.shared.ids.lock().expect("marker lock");
        let n = pending.len().min(max);
        pending.drain(..n).collect()
    }

    /// One UPDATE; ids it did not find go to the miss list (when `retry_misses`).
    async fn flush(&mut self, ids: &[Delivered], retry_misses: bool) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let marked = self.table.mark_published(ids).await?;
        self.metrics.marked.inc_by(marked.len() as u64);
        if !retry_misses || marked.len() == ids.len() {
            self.forget_misses(&marked);
            return Ok(());
        }
        let marked: HashSet<i64> = marked.into_iter().collect();
        // The tries left of this UPDATE's rows that were missed before. Misses of earlier
        // UPDATEs not in this one stay as they are, due at `retry_at` (found by review: taking
        // them all here dropped them, and under steady load each partial miss dropped the
        // misses before it, leaving those rows to the recovery poller).
        let this: HashSet<Delivered> = ids.iter().copied().collect();
        let mut tries = std::collections::HashMap::new();
        self.missed.retain(|&(row, left)| {
            let ours = this.contains(&row);
            if ours {
                tries.insert(row, left);
            }
            !ours
        });
        for &row in ids {
            if marked.contains(&row.0) {
                continue;
            }
            let left = tries.get(&row).copied().unwrap_or(MISS_TRIES);
            if left == 0 {
                continue;
            }
            if self.missed.len() >= MAX_MISSED_IDS {
                // Bounded as the ids waiting are: the recovery poller re-sends the row.
                self.metrics.mark_dropped.inc();
                continue;
            }
            self.missed.push((row, left - 1));
        }
        if !self.missed.is_empty() && self.retry_at.is_none() {
            self.retry_at = Some(Instant::now() + MISS_DELAY);
        }
        Ok(())
    }

    /// Queues the missed ids again (their tries stay in the miss list), within the bound of
    /// ids waiting: those that do not fit are dropped and counted.
    fn requeue_misses(&mut self) {
        let mut pending = self.shared.ids.lock().expect("marker lock");
        let room = MAX_PENDING_IDS.saturating_sub(pending.len());
        if self.missed.len() > room {
            let dropped = self.missed.len() - room;
            self.metrics.mark_dropped.inc_by(dropped as u64);
            self.missed.truncate(room);
        }
        pending.extend(self.missed.iter().map(|(row, _)| *row));
    }

    fn forget_misses(&mut self, marked: &[i64]) {
        if !self.missed.is_empty() {
            let marked: HashSet<&i64> = marked.iter().collect();
            self.missed.retain(|((id, _), _)| !marked.contains(id));
        }
    }
}
