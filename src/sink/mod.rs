//! Where tasks go. The [`Sink`] trait is the contract the stream and the poller write through;
//! [`valkey::ValkeySink`] is the real one (asynq's storage format), [`memory::MemorySink`] an
//! in-memory one with injectable failures for tests.

pub mod memory;
pub mod valkey;

use crate::task::Task;
use std::future::Future;
use std::sync::Arc;

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

/// What a successful write did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WriteOutcome {
    /// Tasks newly created.
    pub enqueued: usize,
    /// Tasks whose TaskID already existed: already delivered, so counted as delivered.
    pub duplicates: usize,
}

/// A failed write: nothing about the batch may be assumed (some tasks may exist). Every sink
/// error is retryable from the caller's side; the caller decides how long to keep trying.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("valkey write failed")]
    Valkey(#[source] redis::RedisError),
    #[error("injected failure")]
    Injected,
}

/// A destination for tasks.
///
/// Contract: delivery is at-least-once, so a write must tolerate tasks that already exist
/// (same TaskID): they count as delivered, never as errors, and are never written twice.
/// `Ok` means every task of the batch now exists in the destination. Within one sink, writes
/// issued in order are applied in order (the pending list keeps commit order).
pub trait Sink: Clone + Send + Sync + 'static {
    fn write(
        &self,
        batch: Arc<Batch>,
    ) -> impl Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static;
}
