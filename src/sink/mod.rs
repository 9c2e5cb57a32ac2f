//! Where tasks go. The [`Sink`] trait is the contract the stream and the poller write through;
//! [`valkey::ValkeySink`] is the real one (asynq's storage format). The deterministic simulation
//! (`crate::sim`) implements it in memory, with faults.

pub mod order_chain;
pub mod queue_turns;
pub mod valkey;

use crate::task::Task;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Tasks written together: one Valkey round trip.
#[derive(Debug, Default, Clone)]
pub struct Batch {
    pub tasks: Vec<Task>,
    /// Payload bytes in `tasks`, to bound a batch by size as well as by count.
    pub bytes: usize,
    /// Commit times of the tasks (unix microseconds), run-length encoded: (time, tasks).
    pub commit_times: Vec<(i64, u32)>,
}

impl Batch {
    pub fn push(&mut self, task: Task) {
        self.bytes += task.msg.len();
        self.tasks.push(task);
    }

    /// Adds a task committed at `commit_unix_micros`.
    pub fn push_committed(&mut self, task: Task, commit_unix_micros: i64) {
        self.push(task);
        match self.commit_times.last_mut() {
            Some((t, n)) if *t == commit_unix_micros => *n += 1,
            _ => self.commit_times.push((commit_unix_micros, 1)),
        }
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }
}

/// A task the sink refused for a reason that retrying the same write cannot fix (the queue's key
/// has the wrong type, the queue name spans cluster slots, the ACL forbids the queue...). Its row
/// stays unpublished: the recovery poller retries it, counts the attempts and dead-letters it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// Index of the task in [`Batch::tasks`].
    pub index: usize,
    /// The sink's answer, for logs and the row's `last_error`.
    pub reason: String,
}

/// What a successful write did: every task of the batch was created, already existed, or was
/// rejected.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct WriteOutcome {
    /// Tasks newly created.
    pub enqueued: usize,
    /// Tasks whose TaskID already existed: already delivered, so counted as delivered.
    pub duplicates: usize,
    /// Tasks refused for good (see [`Rejected`]), in any order: a sink lists them as its
    /// replies come (queue by queue). Read them through [`refused`](Self::refused).
    pub rejected: Vec<Rejected>,
}

impl WriteOutcome {
    /// Tasks that now exist in the destination.
    pub fn delivered(&self) -> usize {
        self.enqueued + self.duplicates
    }

    /// Whether this answers for a batch of `len` tasks: every task delivered or refused, each
    /// refused task named once and within the batch. Both the stream's writer and the poller
    /// refuse an answer that does not (they mark every task not named refused as delivered).
    pub fn accounts_for(&self, len: usize) -> Result<(), String> {
        let answered = self.delivered() + self.rejected.len();
        if answered != len {
            return Err(format!("the sink answered for {answered} of {len} tasks"));
        }
        if self.refused(len).iter().filter(|r| **r).count() != self.rejected.len() {
            return Err(format!(
                "the sink's refusals name tasks twice or outside the {len} tasks: {:?}",
                self.rejected.iter().map(|r| r.index).collect::<Vec<_>>()
            ));
        }
        Ok(())
    }

    /// For a batch of `len` tasks, which were refused: `refused[i]` for task `i`. An index out
    /// of range is ignored here; [`accounts_for`](Self::accounts_for) refuses such an answer.
    pub fn refused(&self, len: usize) -> Vec<bool> {
        let mut refused = vec![false; len];
        for r in &self.rejected {
            if let Some(slot) = refused.get_mut(r.index) {
                *slot = true;
            }
        }
        refused
    }
}

/// A failed write: nothing about the batch may be assumed (some tasks may exist, the reply may
/// have been lost). The caller keeps the batch and writes it again: asynq's TaskID dedupe makes
/// that harmless.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("valkey write failed")]
    Valkey(#[source] redis::RedisError),
    #[error("no answer from valkey within {0:?}")]
    Timeout(Duration),
    /// A fault the simulation injected.
    #[error("simulated failure: {0}")]
    Simulated(&'static str),
}

impl SinkError {
    /// The connection may hold queued writes that will never be answered: reset it rather than
    /// queue more behind them.
    pub fn poisons_connection(&self) -> bool {
        match self {
            SinkError::Timeout(_) => true,
            SinkError::Valkey(e) => e.is_io_error() || e.is_timeout() || e.is_connection_dropped(),
            // The simulation's faults are of the link: a reset is what the real sink would need.
            SinkError::Simulated(_) => true,
        }
    }
}

/// A destination for tasks.
///
/// Contract:
/// - Delivery is at-least-once, so a write must tolerate tasks that already exist (same
///   TaskID): they count as delivered, never as errors, and are never written twice.
/// - `Ok` means every task of the batch now exists in the destination, or is listed in
///   [`WriteOutcome::rejected`] (and does not exist).
/// - `Err` means anything may have happened; the caller writes the batch again.
/// - Within one sink, writes issued in order are applied in order (the pending list keeps
///   commit order); for the stream's sink this holds across writes refused for a while and
///   re-sent ([`Sink::restart_order`]).
/// - Each queue's part of a write is all or nothing: a task hash never exists without its
///   entry in the pending list.
pub trait Sink: Clone + Send + Sync + 'static {
    fn write(
        &self,
        batch: Arc<Batch>,
    ) -> impl Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static;

    /// Drops the connection and everything queued on it; the next write connects afresh.
    /// Called after a write timed out or the connection failed, so that abandoned writes do
    /// not pile up behind a link that does not answer.
    fn reset(&self) {}

    /// The writes issued from now on start their queues' order chains afresh: called by the
    /// stream's writer when it starts, and before it re-sends everything unconfirmed after a
    /// failure, so only where every task written before has landed (or never will, the
    /// rejected ones). A sink that keeps the order of writes issued in order across refusals
    /// (see [`valkey::ValkeySink::connect_ordered`]) needs it; others ignore it.
    fn restart_order(&self) {}
}
