//! Per-queue turns for a Valkey Cluster: the writes of one queue reach its shard one at a time,
//! in the order the writer issued them.
//!
//! On a single server every write goes down one connection, which the server reads in order, so
//! batches can be pipelined. A cluster client gives no such promise across requests: redis
//! 1.8's cluster connection runs them as a set of futures (`FuturesUnordered`), each getting its
//! node's connection before it sends, so a later request to the same node can go first. Two batches of the same queue in
//! flight could then land in the wrong order. So each write takes a ticket per queue when it is
//! issued (synchronously, in the writer's order, all of its queues at once), sends a queue's
//! pipeline only when that queue's earlier tickets are done, and gives a queue's ticket back as
//! soon as that queue's pipeline has landed (or when the write ends or is dropped: a write
//! abandoned after a failure or a timeout never blocks the ones after it).
//!
//! Taking a write's tickets at once matters: two writes issued together on two threads (the
//! stream and a poller) that took theirs one queue at a time could each hold an earlier ticket
//! on one queue and a later one on another, and wait on each other for ever (found by review,
//! on a real cluster). Taken under one lock, any two writes are in the same order on every
//! queue they share.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

#[derive(Default)]
struct Line {
    /// The next ticket to hand out.
    next: u64,
    /// Every ticket below this is done: this one may go.
    serving: u64,
    /// Tickets done out of turn (dropped while waiting).
    done: BTreeSet<u64>,
}

#[derive(Default)]
struct Shared {
    lines: Mutex<HashMap<Arc<str>, Line>>,
    changed: Notify,
}

/// The turns of every queue. Clones share them.
#[derive(Clone, Default)]
pub struct QueueTurns {
    shared: Arc<Shared>,
}

/// One queue's place in line; the turn is given back by [`Ticket::done`] or when it is
/// dropped.
pub struct Ticket {
    shared: Arc<Shared>,
    queue: Arc<str>,
    number: u64,
    given_back: AtomicBool,
}

impl QueueTurns {
    /// Takes the next ticket of each of `queues` (distinct names), all under one lock.
    pub fn tickets<'q>(&self, queues: impl IntoIterator<Item = &'q str>) -> Vec<Ticket> {
        let mut lines = self.shared.lines.lock().expect("queue turns lock");
        queues
            .into_iter()
            .map(|queue| {
                let queue: Arc<str> = match lines.get_key_value(queue) {
                    Some((name, _)) => name.clone(),
                    None => Arc::from(queue),
                };
                let line = lines.entry(queue.clone()).or_default();
                let number = line.next;
                line.next += 1;
                Ticket {
                    shared: self.shared.clone(),
                    queue,
                    number,
                    given_back: AtomicBool::new(false),
                }
            })
            .collect()
    }
}

impl Ticket {
    /// The queue this ticket is for.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Waits until every earlier ticket of this queue is done.
    pub async fn turn(&self) {
        loop {
            let changed = self.shared.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.serving() {
                return;
            }
            changed.await;
        }
    }

    /// Gives the turn back now (the queue's pipeline landed); later calls and the drop do
    /// nothing more.
    pub fn done(&self) {
        if self.given_back.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut lines = self.shared.lines.lock().expect("queue turns lock");
        if let Some(line) = lines.get_mut(&self.queue) {
            if line.serving == self.number {
                line.serving += 1;
                while line.done.remove(&line.serving) {
                    line.serving += 1;
                }
            } else {
                line.done.insert(self.number);
            }
        }
        drop(lines);
        self.shared.changed.notify_waiters();
    }

    fn serving(&self) -> bool {
        let lines = self.shared.lines.lock().expect("queue turns lock");
        lines
            .get(&self.queue)
            .is_some_and(|line| line.serving == self.number)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.done();
    }
}

#[cfg(test)]
mod tests {
    use super::QueueTurns;
    use futures::FutureExt;

    #[tokio::test]
    async fn a_queue_turns_in_ticket_order_and_queues_do_not_wait_for_each_other() {
        let turns = QueueTurns::default();
        let a1 = turns.tickets(["a"]).pop().unwrap();
        let a2 = turns.tickets(["a"]).pop().unwrap();
        let b1 = turns.tickets(["b"]).pop().unwrap();
        assert!(
            a1.turn().now_or_never().is_some(),
            "the first ticket goes at once"
        );
        assert!(
            a2.turn().now_or_never().is_none(),
            "the second waits for the first"
        );
        assert!(
            b1.turn().now_or_never().is_some(),
            "another queue does not wait"
        );
        let waiting = tokio::spawn(async move { a2.turn().await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(a1);
        waiting.await.expect("the second ticket's turn comes");
    }

    #[tokio::test]
    async fn a_ticket_dropped_while_waiting_does_not_block_the_ones_after_it() {
        let turns = QueueTurns::default();
        let first = turns.tickets(["q"]).pop().unwrap();
        let abandoned = turns.tickets(["q"]).pop().unwrap();
        let third = turns.tickets(["q"]).pop().unwrap();
        drop(abandoned);
        assert!(third.turn().now_or_never().is_none());
        drop(first);
        assert!(
            third.turn().now_or_never().is_some(),
            "the third goes once the first is done, the second being gone"
        );
    }

    /// Two writes over the same two queues, issued together: whichever took its tickets first
    /// is first on both queues, so neither waits for the other on one queue while holding the
    /// other (the deadlock review found with one-at-a-time tickets).
    #[tokio::test]
    async fn two_writes_on_the_same_queues_are_in_one_order_on_both() {
        let turns = QueueTurns::default();
        let w = turns.tickets(["a", "b"]);
        let p = turns.tickets(["b", "a"]);
        for t in &w {
            assert!(
                t.turn().now_or_never().is_some(),
                "the first write goes on {}",
                t.queue()
            );
        }
        for t in &p {
            assert!(
                t.turn().now_or_never().is_none(),
                "the second waits on {}",
                t.queue()
            );
        }
        // The first write's queue b lands: the second may send b while a is still out.
        w.iter().find(|t| t.queue() == "b").unwrap().done();
        let pb = p.iter().find(|t| t.queue() == "b").unwrap();
        let pa = p.iter().find(|t| t.queue() == "a").unwrap();
        assert!(pb.turn().now_or_never().is_some());
        assert!(pa.turn().now_or_never().is_none());
        drop(w);
        assert!(pa.turn().now_or_never().is_some());
    }
}
