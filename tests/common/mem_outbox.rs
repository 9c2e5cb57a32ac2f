//! An in-memory outbox for poll rounds driven without Postgres: every claim returns the same
//! rows, and the table records what a round marks published, what it marks failed, and each
//! statement of its transaction in order (a sink under test can log its writes in the same
//! [`Steps`], to check what runs between two statements).

use outbox_relay::store::{Claimed, ClaimedRow, OutboxTable, OutboxTx, StoreError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a round did, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A statement of the round's transaction (`claim`, `mark_failed`, `mark_published`).
    Statement(&'static str),
    /// A Valkey write of this many tasks and task bytes.
    Write { tasks: usize, bytes: usize },
}

pub type Steps = Arc<Mutex<Vec<Step>>>;

#[derive(Clone, Default)]
pub struct MemTable {
    rows: Arc<Vec<ClaimedRow>>,
    /// Rows marked published by committed rounds (and by the marker).
    pub published: Arc<Mutex<Vec<i64>>>,
    /// Rows marked failed by committed rounds.
    pub failed: Arc<Mutex<Vec<i64>>>,
    pub steps: Steps,
}

impl MemTable {
    /// A table whose every claim returns `rows`.
    pub fn new(rows: Vec<ClaimedRow>) -> Self {
        MemTable {
            rows: Arc::new(rows),
            ..MemTable::default()
        }
    }

    fn step(&self, name: &'static str) {
        self.steps.lock().unwrap().push(Step::Statement(name));
    }
}

pub struct MemTx {
    table: MemTable,
    published: Vec<i64>,
    failed: Vec<i64>,
}

impl OutboxTable for MemTable {
    type Tx = MemTx;

    async fn mark_published(&self, rows: &[(i64, uuid::Uuid)]) -> Result<Vec<i64>, StoreError> {
        let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
        self.published.lock().unwrap().extend(&ids);
        Ok(ids)
    }

    async fn begin(&self) -> Result<MemTx, StoreError> {
        Ok(MemTx {
            table: self.clone(),
            published: Vec::new(),
            failed: Vec::new(),
        })
    }
}

impl OutboxTx for MemTx {
    async fn claim(
        &mut self,
        _limit: usize,
        _bytes: usize,
        _older_than: Option<Duration>,
    ) -> Result<Claimed, StoreError> {
        self.table.step("claim");
        Ok(Claimed {
            rows: self.table.rows.to_vec(),
            left: false,
        })
    }

    async fn mark_failed(
        &mut self,
        id: i64,
        _error: &str,
        _backoff: Duration,
        _max_attempts: i32,
    ) -> Result<bool, StoreError> {
        self.table.step("mark_failed");
        self.failed.push(id);
        Ok(false)
    }

    async fn mark_published(&mut self, ids: &[i64]) -> Result<(), StoreError> {
        // As the real store: no ids, no statement.
        if !ids.is_empty() {
            self.table.step("mark_published");
        }
        self.published.extend_from_slice(ids);
        Ok(())
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.table.step("commit");
        self.table.published.lock().unwrap().extend(self.published);
        self.table.failed.lock().unwrap().extend(self.failed);
        Ok(())
    }
}
