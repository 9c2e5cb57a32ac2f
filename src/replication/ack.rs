//! Which LSN may be acknowledged to Postgres. Pure bookkeeping, no I/O.
//!
//! The rule: the flush LSN is the commit end LSN of the newest transaction such that it and
//! every earlier one are fully confirmed by the sink. Rows travel in numbered batches, written
//! and confirmed in order; a commit is safe once every batch that holds (or precedes) its rows
//! is confirmed. Keepalive positions are taken only when nothing at all is open or unconfirmed.
//! The acknowledged LSN never moves backwards.

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

    pub fn begin(&mut self) {
        self.in_txn = true;
    }

    /// A row was added to the open batch.
    pub fn row(&mut self) {
        self.open_rows += 1;
    }

    /// The transaction ended at `end_lsn`; its rows are in the open batch or earlier ones.
    pub fn commit(&mut self, end_lsn: Lsn) {
        self.in_txn = false;
        let needs_below = if self.open_rows > 0 {
            self.open_seq + 1
        } else {
            self.open_seq
        };
        self.commits.push_back((needs_below, end_lsn));
        self.advance();
    }

    /// The open batch is handed to the sink; returns its sequence number.
    pub fn seal(&mut self) -> u64 {
        let seq = self.open_seq;
        self.open_seq += 1;
        self.open_rows = 0;
        seq
    }

    /// The sink confirmed batch `seq`. Batches are confirmed in order.
    pub fn confirmed(&mut self, seq: u64) {
        debug_assert_eq!(seq, self.confirmed_below, "batches confirm in order");
        self.confirmed_below = self.confirmed_below.max(seq + 1);
        self.advance();
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
        t.begin();
        t.row();
        t.row();
        t.commit(Lsn(100));
        assert_eq!(t.acked(), Lsn(10));
        let s = t.seal();
        assert_eq!(t.acked(), Lsn(10));
        t.confirmed(s);
        assert_eq!(t.acked(), Lsn(100));
    }

    #[test]
    fn a_transaction_spanning_batches_waits_for_the_last() {
        let mut t = AckTracker::new(Lsn(0));
        t.begin();
        t.row();
        let a = t.seal();
        t.row();
        let b = t.seal();
        t.row();
        t.commit(Lsn(50));
        t.confirmed(a);
        t.confirmed(b);
        assert_eq!(t.acked(), Lsn(0), "the third row is not written yet");
        let c = t.seal();
        t.confirmed(c);
        assert_eq!(t.acked(), Lsn(50));
    }

    #[test]
    fn a_commit_without_rows_waits_for_earlier_batches() {
        let mut t = AckTracker::new(Lsn(0));
        t.begin();
        t.row();
        t.commit(Lsn(10));
        let a = t.seal();
        t.begin();
        t.commit(Lsn(20)); // every row of it was a bad row
        assert_eq!(t.acked(), Lsn(0));
        t.confirmed(a);
        assert_eq!(t.acked(), Lsn(20));
    }

    #[test]
    fn keepalives_move_the_ack_only_when_idle() {
        let mut t = AckTracker::new(Lsn(5));
        t.idle_position(Lsn(7));
        assert_eq!(t.acked(), Lsn(7));
        t.begin();
        t.idle_position(Lsn(9));
        assert_eq!(t.acked(), Lsn(7), "inside a transaction");
        t.row();
        t.commit(Lsn(12));
        t.idle_position(Lsn(15));
        assert_eq!(t.acked(), Lsn(7), "a row is buffered");
        let s = t.seal();
        t.idle_position(Lsn(15));
        assert_eq!(t.acked(), Lsn(7), "a batch is unconfirmed");
        t.confirmed(s);
        assert_eq!(t.acked(), Lsn(12));
        t.idle_position(Lsn(15));
        assert_eq!(t.acked(), Lsn(15));
        t.idle_position(Lsn(3));
        assert_eq!(t.acked(), Lsn(15), "never backwards");
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
                    0 if !in_txn => { t.begin(); in_txn = true; }
                    1 if in_txn => { t.row(); rows.push((None, None)); }
                    2 if in_txn => {
                        lsn += 10;
                        t.commit(Lsn(lsn));
                        for r in rows.iter_mut().filter(|r| r.1.is_none()) { r.1 = Some(lsn); }
                        in_txn = false;
                    }
                    3 => {
                        let s = t.seal();
                        for r in rows.iter_mut().filter(|r| r.0.is_none()) { r.0 = Some(s); }
                        sealed.push(s);
                    }
                    4 if (confirmed as usize) < sealed.len() => { t.confirmed(confirmed); confirmed += 1; }
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
