//! Per-queue turns for a Valkey Cluster: the writes of one queue reach its shard one at a time,
//! in the order the writer issued them.
//!
//! On a single server every write goes down one connection, which the server reads in order, so
//! batches can be pipelined. A cluster client gives no such promise across requests: redis
//! 1.8's cluster connection runs them as a set of futures (`FuturesUnordered`), each getting its
//! node's connection before it sends, so a later request to the same node can go first. Two batches of the same queue in
//! flight could then land in the wrong order. So each write takes a ticket per queue when it is
//! issued (synchronously, in the writer's order), sends a queue's pipeline only when that
//! queue's earlier tickets are done, and gives its tickets back when it ends or is dropped (a
//! write abandoned after a failure or a timeout never blocks the ones after it). Queues do not
//! wait for each other: a ticket waits only for tickets of its own queue.

use std::collections::{BTreeSet, HashMap};
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

/// One queue's place in line; the turn is given back when it is dropped.
pub struct Ticket {
    shared: Arc<Shared>,
    queue: Arc<str>,
    number: u64,
}

impl QueueTurns {
    /// Takes the next ticket of `queue`.
    pub fn ticket(&self, queue: &str) -> Ticket {
        let mut lines = self.shared.lines.lock().expect("queue turns lock");
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
        }
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

    fn serving(&self) -> bool {
        let lines = self.shared.lines.lock().expect("queue turns lock");
        lines
            .get(&self.queue)
            .is_some_and(|line| line.serving == self.number)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
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
}

#[cfg(test)]
mod tests {
    use super::QueueTurns;
    use futures::FutureExt;

    #[tokio::test]
    async fn a_queue_turns_in_ticket_order_and_queues_do_not_wait_for_each_other() {
        let turns = QueueTurns::default();
        let a1 = turns.ticket("a");
        let a2 = turns.ticket("a");
        let b1 = turns.ticket("b");
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
        let first = turns.ticket("q");
        let abandoned = turns.ticket("q");
        let third = turns.ticket("q");
        drop(abandoned);
        assert!(third.turn().now_or_never().is_none());
        drop(first);
        assert!(
            third.turn().now_or_never().is_some(),
            "the third goes once the first is done, the second being gone"
        );
    }
}
