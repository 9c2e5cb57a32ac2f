//! Which LSN may be acknowledged to Postgres. Pure bookkeeping, no I/O.
//!
//! The rule: the flush LSN is the commit end LSN of the newest transaction such that it and
//! every earlier one are fully confirmed by the sink. Rows travel in numbered batches, written
//! and confirmed in order; a commit is safe once every batch that holds (or precedes) its rows
//! is confirmed. Keepalive positions are taken only when nothing at all is open or unconfirmed.
//! The acknowledged LSN never moves backwards.

use super::invariant::{ensure, InvariantViolation};
use pgwire_replication::Lsn;
use std::collections::VecDeque;

#[derive(Debug)]
pub struct AckTracker {
    /// Sequence number the batch now being filled will get.
    open_seq: u64,
    /// Rows in the open batch.
    open_rows: usize,
    /// Every batch with a lower sequence number is confirmed.
    confirmed_below: u64,
    /// Commits waiting for their batches: (batches below this seq must be confirmed, end LSN).
    commits: VecDeque<(u64, Lsn)>,
    /// Between Begin and Commit.
    in_txn: bool,
    acked: Lsn,
}

impl AckTracker {
    /// Starts at the slot's confirmed position.
    pub fn new(start: Lsn) -> Self {
        Self {
            open_seq: 0,
            open_rows: 0,
            confirmed_below: 0,
            commits: VecDeque::new(),
            in_txn: false,
            acked: start,
        }
    }

    pub fn acked(&self) -> Lsn {
        self.acked
    }

    /// A transaction begins. Transactions do not nest.
    pub fn begin(&mut self) -> Result<(), InvariantViolation> {
        ensure(!self.in_txn, || "a transaction began inside another".into())?;
        self.in_txn = true;
        Ok(())
    }

    /// A row of the current transaction was added to the open batch.
    pub fn row(&mut self) -> Result<(), InvariantViolation> {
        ensure(self.in_txn, || "a row arrived outside a transaction".into())?;
        self.open_rows += 1;
        Ok(())
    }

    /// The transaction ended at `end_lsn`; its rows are in the open batch or earlier ones.
    /// Commits arrive in LSN order, never at or before the position already acknowledged.
    pub fn commit(&mut self, end_lsn: Lsn) -> Result<(), InvariantViolation> {
        ensure(self.in_txn, || format!("commit {end_lsn} without a begin"))?;
        let newest = self.commits.back().map_or(self.acked, |c| c.1);
        ensure(end_lsn > newest, || {
            format!("commit {end_lsn} is not after {newest}, acknowledged or waiting")
        })?;
        self.in_txn = false;
        let needs_below = if self.open_rows > 0 {
            self.open_seq + 1
        } else {
            self.open_seq
        };
        // Commits that wait for the same batches become safe together: keep only the newest,
        // so transactions without rows (empty ones on PostgreSQL 14, bad rows, other tables)
        // read during a Valkey outage are not each held (at most max_inflight + 2 entries).
        match self.commits.back_mut() {
            Some(back) if back.0 == needs_below => back.1 = end_lsn,
            _ => self.commits.push_back((needs_below, end_lsn)),
        }
        self.advance();
        Ok(())
    }

    /// The open batch is handed to the sink; returns its sequence number.
    pub fn seal(&mut self) -> u64 {
        let seq = self.open_seq;
        self.open_seq += 1;
        self.open_rows = 0;
        seq
    }

    /// The sink confirmed batch `seq`. Batches are confirmed in order, each once, and only
    /// after they were sealed.
    pub fn confirmed(&mut self, seq: u64) -> Result<(), InvariantViolation> {
        ensure(seq == self.confirmed_below && seq < self.open_seq, || {
            format!(
                "batch {seq} confirmed, but the oldest unconfirmed one is {} (sealed below {})",
                self.confirmed_below, self.open_seq
            )
        })?;
        self.confirmed_below = seq + 1;
        self.advance();
        Ok(())
    }

    /// A keepalive (or a non-transactional message) reported the server at `wal_end`. Taken only
    /// when no transaction is open and nothing is buffered or unconfirmed: otherwise a crash
    /// could lose what is in flight.
    pub fn idle_position(&mut self, wal_end: Lsn) {
        if self.is_idle() && wal_end > self.acked {
            self.acked = wal_end;
        }
    }

    /// Nothing open, buffered or waiting for the sink.
    pub fn is_idle(&self) -> bool {
        !self.in_txn
            && self.open_rows == 0
            && self.commits.is_empty()
            && self.confirmed_below == self.open_seq
    }

    fn advance(&mut self) {
        while let Some(&(needs_below, lsn)) = self.commits.front() {
            if needs_below > self.confirmed_below {
                break;
            }
            self.commits.pop_front();
            if lsn > self.acked {
                self.acked = lsn;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn acks_a_commit_only_after_its_batch_is_confirmed() {
        let mut t = AckTracker::new(Lsn(10));
        t.begin().unwrap();
        t.row().unwrap();
        t.row().unwrap();
        t.commit(Lsn(100)).unwrap();
        assert_eq!(t.acked(), Lsn(10));
        let s = t.seal();
        assert_eq!(t.acked(), Lsn(10));
        t.confirmed(s).unwrap();
        assert_eq!(t.acked(), Lsn(100));
    }

    #[test]
    fn a_transaction_spanning_batches_waits_for_the_last() {
        let mut t = AckTracker::new(Lsn(0));
        t.begin().unwrap();
        t.row().unwrap();
        let a = t.seal();
        t.row().unwrap();
        let b = t.seal();
        t.row().unwrap();
        t.commit(Lsn(50)).unwrap();
        t.confirmed(a).unwrap();
        t.confirmed(b).unwrap();
        assert_eq!(t.acked(), Lsn(0), "the third row is not written yet");
        let c = t.seal();
        t.confirmed(c).unwrap();
        assert_eq!(t.acked(), Lsn(50));
    }

    #[test]
    fn a_commit_without_rows_waits_for_earlier_batches() {
        let mut t = AckTracker::new(Lsn(0));
        t.begin().unwrap();
        t.row().unwrap();
        t.commit(Lsn(10)).unwrap();
        let a = t.seal();
        t.begin().unwrap();
        t.commit(Lsn(20)).unwrap(); // every row of it was a bad row
        assert_eq!(t.acked(), Lsn(0));
        t.confirmed(a).unwrap();
        assert_eq!(t.acked(), Lsn(20));
    }

    #[test]
    fn keepalives_move_the_ack_only_when_idle() {
        let mut t = AckTracker::new(Lsn(5));
        t.idle_position(Lsn(7));
        assert_eq!(t.acked(), Lsn(7));
        t.begin().unwrap();
        t.idle_position(Lsn(9));
        assert_eq!(t.acked(), Lsn(7), "inside a transaction");
        t.row().unwrap();
        t.commit(Lsn(12)).unwrap();
        t.idle_position(Lsn(15));
        assert_eq!(t.acked(), Lsn(7), "a row is buffered");
        let s = t.seal();
        t.idle_position(Lsn(15));
        assert_eq!(t.acked(), Lsn(7), "a batch is unconfirmed");
        t.confirmed(s).unwrap();
        assert_eq!(t.acked(), Lsn(12));
        t.idle_position(Lsn(15));
        assert_eq!(t.acked(), Lsn(15));
        t.idle_position(Lsn(3));
        assert_eq!(t.acked(), Lsn(15), "never backwards");
    }

    #[test]
    fn a_confirmation_out_of_order_is_a_violation_and_acks_nothing() {
        let mut t = AckTracker::new(Lsn(0));
        t.begin().unwrap();
        t.row().unwrap();
        let a = t.seal();
        t.commit(Lsn(10)).unwrap();
        t.begin().unwrap();
        t.row().unwrap();
        let b = t.seal();
        t.commit(Lsn(20)).unwrap();
        assert!(t.confirmed(b).is_err(), "b confirmed before a");
        assert_eq!(t.acked(), Lsn(0));
        assert!(t.confirmed(a + 7).is_err(), "never sealed");
        t.confirmed(a).unwrap();
        assert!(t.confirmed(a).is_err(), "confirmed twice");
        assert_eq!(t.acked(), Lsn(10));
    }

    /// While a batch is unconfirmed (Valkey down), transactions without rows (PostgreSQL 14
    /// sends every transaction of the database, empty; all-bad-row transactions; other tables
    /// of the publication) must not each be held: the stream keeps reading them, so the queue
    /// of waiting commits would grow with the outage.
    #[test]
    fn waiting_commits_stay_bounded_while_a_batch_is_unconfirmed() {
        let mut t = AckTracker::new(Lsn(0));
        t.begin().unwrap();
        t.row().unwrap();
        t.commit(Lsn(10)).unwrap();
        let a = t.seal();
        for i in 0..100_000u64 {
            t.begin().unwrap();
            t.commit(Lsn(20 + i)).unwrap();
        }
        assert!(
            t.commits.len() <= 2,
            "{} commits held for one unconfirmed batch",
            t.commits.len()
        );
        t.confirmed(a).unwrap();
        assert_eq!(t.acked(), Lsn(20 + 99_999));
    }

    #[test]
    fn protocol_violations_are_refused() {
        let mut t = AckTracker::new(Lsn(100));
        assert!(t.row().is_err(), "row outside a transaction");
        assert!(t.commit(Lsn(200)).is_err(), "commit without begin");
        t.begin().unwrap();
        assert!(t.begin().is_err(), "nested begin");
        assert!(
            t.commit(Lsn(100)).is_err(),
            "commit at the acknowledged position"
        );
    }

    proptest! {
        /// Random interleavings: the ack is always a commit LSN (or a keepalive when idle) whose
        /// rows and all earlier rows are confirmed.
        #[test]
        fn never_acks_past_an_unconfirmed_row(ops in proptest::collection::vec(0u8..5, 1..200)) {
            let mut t = AckTracker::new(Lsn(0));
            let mut lsn = 0u64;
            // For every row: (batch seq it went into or None if still open, commit lsn once known)
            let mut rows: Vec<(Option<u64>, Option<u64>)> = Vec::new();
            let mut sealed: Vec<u64> = Vec::new();
            let mut confirmed = 0u64;
            let mut in_txn = false;
            for op in ops {
                match op {
                    0 if !in_txn => { t.begin().unwrap(); in_txn = true; }
                    1 if in_txn => { t.row().unwrap(); rows.push((None, None)); }
                    2 if in_txn => {
                        lsn += 10;
                        t.commit(Lsn(lsn)).unwrap();
                        for r in rows.iter_mut().filter(|r| r.1.is_none()) { r.1 = Some(lsn); }
                        in_txn = false;
                    }
                    3 => {
                        let s = t.seal();
                        for r in rows.iter_mut().filter(|r| r.0.is_none()) { r.0 = Some(s); }
                        sealed.push(s);
                    }
                    4 if (confirmed as usize) < sealed.len() => { t.confirmed(confirmed).unwrap(); confirmed += 1; }
                    _ => {}
                }
                let acked = t.acked().0;
                for r in &rows {
                    if let Some(commit) = r.1 {
                        if commit <= acked {
                            let seq = r.0.expect("an acked row was sealed");
                            prop_assert!(seq < confirmed, "acked {acked} but row's batch {seq} unconfirmed");
                        }
                    }
                }
            }
        }
    }
}
