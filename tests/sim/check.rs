//! The invariants, checked as the simulation runs:
//! - at every acknowledgement (when the relay hands a position to its connection, and when the
//!   slot's confirmed position moves): it never passes a commit one of whose rows has no task, unless the row cannot become one (a bad row) or Valkey refused a stream's write of it for good
//!   (both stay unpublished for the poller);
//! - at every mark: no row is marked or deleted before its task exists, and no bad row is;
//! - at the end, once faults stopped: every committed row ends with exactly one task and is
//!   marked (or, bad or refused rows, is a dead letter / waits unpublished), and per queue the
//!   first enqueues the stream made follow commit order.
//!
//! Violations are collected (the first one ends the run).

use super::db::{Row, State};
use super::valkey::{SimValkey, Writer};
use pgwire_replication::Lsn;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

/// A task the stream created: (its place among all creations, its row's id, its event id).
type FirstEnqueue<'a> = (usize, i64, &'a str);

#[derive(Default)]
struct Inner {
    violations: Vec<String>,
    /// WAL transactions before this index were checked by an acknowledgement.
    checked: usize,
    /// The slot was (re)created here: commits before it are the poller's.
    slot_base: Lsn,
    /// Every (re)creation of the slot, in order: each starts a new stretch of commit order.
    recreated: Vec<Lsn>,
}

#[derive(Clone)]
pub struct Checker {
    inner: Arc<Mutex<Inner>>,
    valkey: SimValkey,
    start: Instant,
}

/// Unix microseconds at the simulation's start (any fixed value works).
const SIM_EPOCH_MICROS: i64 = 1_764_000_000_000_000;

impl Checker {
    pub fn new(valkey: SimValkey) -> Self {
        Self {
            inner: Arc::default(),
            valkey,
            start: Instant::now(),
        }
    }

    pub fn start(&self) -> Instant {
        self.start
    }

    /// The simulation's wall clock, unix microseconds.
    pub fn sim_micros(&self) -> i64 {
        SIM_EPOCH_MICROS + Instant::now().duration_since(self.start).as_micros() as i64
    }

    pub fn violate(&self, msg: String) {
        self.inner.lock().unwrap().violations.push(msg);
    }

    /// Violations so far (the checker's and the simulated Valkey's).
    pub fn violations(&self) -> Vec<String> {
        let mut v = self.inner.lock().unwrap().violations.clone();
        v.extend(self.valkey.st.lock().unwrap().violations.iter().cloned());
        v
    }

    pub fn slot_recreated(&self, at: Lsn, wal: &State) {
        let mut inner = self.inner.lock().unwrap();
        inner.slot_base = at;
        inner.recreated.push(at);
        inner.checked = inner
            .checked
            .max(wal.wal.partition_point(|t| t.end_lsn <= at));
    }

    fn has_task(&self, r: &Row) -> bool {
        self.valkey.exists(&r.queue, &r.event_id)
    }

    /// A stream's write was refused this row's task: the stream may acknowledge past it.
    fn refused_to_stream(&self, r: &Row) -> bool {
        self.valkey
            .st
            .lock()
            .unwrap()
            .rejected_to_stream
            .contains(&r.event_id)
    }

    /// The slot's confirmed position moved to `lsn`.
    pub fn on_ack(&self, st: &State, lsn: Lsn) {
        let mut inner = self.inner.lock().unwrap();
        while let Some(txn) = st.wal.get(inner.checked) {
            if txn.end_lsn > lsn {
                break;
            }
            inner.checked += 1;
            if txn.end_lsn <= inner.slot_base {
                continue;
            }
            for id in &txn.rows {
                let r = &st.rows[id];
                if r.good && !self.has_task(r) && !self.refused_to_stream(r) {
                    inner.violations.push(format!(
                        "acknowledged {lsn} past commit {} whose row {} ({}, queue {}) has no task",
                        txn.end_lsn, r.id, r.event_id, r.queue
                    ));
                }
            }
        }
    }

    /// Row `r` is being marked published (or deleted) by `by`.
    pub fn on_mark(&self, r: &Row, by: &str) {
        if !r.good {
            self.violate(format!("{by} marked bad row {} published", r.id));
        } else if !self.has_task(r) {
            self.violate(format!(
                "{by} marked row {} ({}, queue {}) published before its task exists",
                r.id, r.event_id, r.queue
            ));
        }
    }

    /// Once faults stopped and the relays had time: every row delivered exactly once and
    /// settled, or (bad or refused) left to the poller; per queue, the stream's first enqueues
    /// in commit order.
    /// The end state; with `can_catch_up` (the stream can notice a dead link), also liveness.
    /// `confirmed`: the slot's position at the quiet end, before the nodes stopped; `None` when
    /// there is no slot or the stream could not catch up (see the caller).
    pub fn at_end(&self, st: &State, confirmed: Option<Lsn>) {
        // Liveness: after the quiet end the stream has caught up, its slot acknowledged past the
        // last commit with outbox rows (a stream stuck retrying, its rows delivered by the
        // recovery poller instead, would pin WAL for ever).
        let last = st.wal.iter().rev().find(|t| !t.rows.is_empty());
        if let (Some(confirmed), Some(last)) = (confirmed, last) {
            if confirmed < last.end_lsn {
                self.violate(format!(
                    "the stream never caught up: the slot is acknowledged to {confirmed} after \
                     the quiet end, behind the last commit {}",
                    last.end_lsn
                ));
            }
        }
        let vk = self.valkey.st.lock().unwrap();
        let mut created: BTreeMap<(&str, &str), (usize, Writer)> = BTreeMap::new();
        for (i, c) in vk.created.iter().enumerate() {
            if created.insert((&c.queue, &c.id), (i, c.by)).is_some() {
                self.violate(format!("task {} of queue {} created twice", c.id, c.queue));
            }
        }
        // Order holds among the rows committed under one slot: rows a lost slot skipped are
        // enqueued when the poller (or a session still finishing) gets to them, after later
        // rows of their queue (docs/task-format.md, "Order").
        let recreated = self.inner.lock().unwrap().recreated.clone();
        let mut by_queue: BTreeMap<(&str, usize), Vec<FirstEnqueue<'_>>> = BTreeMap::new();
        for r in st.rows.values() {
            let task = created.get(&(r.queue.as_str(), r.event_id.as_str()));
            let refused = vk.rejected.contains(&r.event_id);
            match (r.good, task) {
                (false, Some(_)) => self.violate(format!("bad row {} became a task", r.id)),
                (false, None) if r.settled() => {
                    self.violate(format!("bad row {} was marked published", r.id))
                }
                (false, None) if r.attempts == 0 => self.violate(format!(
                    "bad row {} was never attempted by the poller",
                    r.id
                )),
                (true, None) if !(refused && r.dead) => self.violate(format!(
                    "row {} ({}, queue {}, commit {}) was never delivered (published {}, dead {}, \
                     refused {refused})",
                    r.id, r.event_id, r.queue, r.end_lsn, r.published, r.dead
                )),
                // Delivered, then its marking was lost (a crash, or SQL down at SIGTERM), and
                // the poller's attempts met the queue refusing (the script checks the pending
                // list's type before it looks for the task): a dead letter whose task exists.
                // Nothing is lost; `retry-dead-letters` settles it (the TaskID dedupes) and
                // `trace` shows both.
                (true, Some(_)) if !r.settled() && r.dead && refused => {}
                (true, Some((_, by))) if !r.settled() => self.violate(format!(
                    "row {} ({}, queue {}) was delivered by {by:?} but never marked published \
                     (dead {}, attempts {}, refused {refused})",
                    r.id, r.event_id, r.queue, r.dead, r.attempts
                )),
                (true, Some((i, Writer::Stream(_)))) if !refused => {
                    let slot = recreated.partition_point(|at| *at < r.end_lsn);
                    by_queue
                        .entry((&r.queue, slot))
                        .or_default()
                        .push((*i, r.id, &r.event_id));
                }
                _ => {}
            }
        }
        for ((queue, _), mut firsts) in by_queue {
            firsts.sort();
            for w in firsts.windows(2) {
                if w[1].1 < w[0].1 {
                    self.violate(format!(
                        "queue {queue}: row {} ({}, committed later) was enqueued before row {} \
                         ({})",
                        w[0].1, w[0].2, w[1].1, w[1].2
                    ));
                    break;
                }
            }
        }
    }
}
