//! The outbox table: its SQL ([`Store`], in [`statements`]), and the two narrow traits the
//! delivery core uses it through — [`OutboxTable`] for the marker and the poller, [`OutboxTx`]
//! for one poll round's transaction. [`pg::PgOutbox`] implements them on a connection pool; the
//! simulation (`crate::sim`) implements them in memory.

pub mod pg;
mod statements;

pub use statements::{mark_delivered_sql, Claimed, ClaimedRow, DeadLetter, Store};

use std::future::Future;
use std::time::Duration;

/// A failed statement or connection; the caller retries with backoff.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot get a postgres connection")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("postgres query failed")]
    Query(#[from] tokio_postgres::Error),
    /// A fault the simulation injected.
    #[error("simulated failure: {0}")]
    Simulated(&'static str),
}

/// The outbox table as the delivery core sees it.
pub trait OutboxTable: Clone + Send + Sync + 'static {
    type Tx: OutboxTx;

    /// Marks delivered rows published (or deletes them), each matched by (id, event_id);
    /// returns the ids it found. Rows not yet visible, or already marked, are not among them.
    fn mark_published(
        &self,
        rows: &[(i64, uuid::Uuid)],
    ) -> impl Future<Output = Result<Vec<i64>, StoreError>> + Send;

    /// Begins a poll round's transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;
}

/// One poll round's transaction. Dropped without [`commit`](Self::commit), it rolls back: the
/// claimed rows are unlocked and unchanged.
pub trait OutboxTx: Send {
    /// Locks up to `limit` deliverable rows no other transaction holds, oldest id first, and
    /// returns them until `bytes` of payload and metadata (the first row whatever its size;
    /// [`Claimed::left`] when rows were locked past that: they are unlocked unchanged at the
    /// end of the round). With `older_than`, only rows created at least that long ago.
    fn claim(
        &mut self,
        limit: usize,
        bytes: usize,
        older_than: Option<Duration>,
    ) -> impl Future<Output = Result<Claimed, StoreError>> + Send;

    /// Records a failed attempt: the next waits `backoff * 2^(attempts-1)` (at most an hour),
    /// and the row becomes a dead letter at `max_attempts`. Returns whether it is now one.
    fn mark_failed(
        &mut self,
        id: i64,
        error: &str,
        backoff: Duration,
        max_attempts: i32,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Marks delivered rows published (or deletes them).
    fn mark_published(
        &mut self,
        ids: &[i64],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn commit(self) -> impl Future<Output = Result<(), StoreError>> + Send;
}
