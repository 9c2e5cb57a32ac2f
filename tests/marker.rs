//! The marker: what it keeps waiting, and what it tries again.
//!
//! - The ids waiting to be marked published are bounded (docs/design.md's memory table:
//!   1,000,000 ids and their event ids): beyond that the stream's hand-over drops them and counts
//!   them in `outbox_rows_mark_dropped_total`, and never blocks. Those rows stay unpublished for
//!   the recovery poller.
//! - A row an UPDATE did not find (its commit reached the stream a moment before it was visible)
//!   is tried again after 200 ms, three times: also when another UPDATE misses rows of its own
//!   meanwhile (found by review: each partial miss dropped the misses of the UPDATEs before it,
//!   so under steady load such rows were left to the recovery poller, which sends them again).

mod common;

use common::mem_outbox::{MemTable, MemTx};
use outbox_relay::marker::Marker;
use outbox_relay::metrics::Metrics;
use outbox_relay::store::{OutboxTable, StoreError};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

fn delivered(from: i64, n: i64) -> Vec<(i64, uuid::Uuid)> {
    (from..from + n)
        .map(|id| (id, uuid::Uuid::from_u64_pair(0, id as u64)))
        .collect()
}

fn metrics() -> Arc<Metrics> {
    Arc::new(Metrics::new(
        &mut prometheus_client::registry::Registry::default(),
    ))
}

#[test]
fn ids_past_the_bound_are_dropped_and_counted() {
    let metrics = metrics();
    let (_marker, handle) = Marker::new(MemTable::new(Vec::new()), metrics.clone(), None);
    handle.mark(delivered(1, 999_998));
    handle.mark(delivered(999_999, 2));
    assert_eq!(metrics.mark_dropped.get(), 0, "1,000,000 ids fit");
    // One more hand-over of three: all three dropped (a hand-over is kept or dropped whole).
    handle.mark(delivered(1_000_001, 3));
    assert_eq!(metrics.mark_dropped.get(), 3);
    handle.mark(delivered(1_000_004, 1));
    assert_eq!(metrics.mark_dropped.get(), 4);
}

/// A table whose rows become visible to UPDATEs at set times, as commits do a moment after the
/// stream has them; records which rows were marked.
#[derive(Clone)]
struct LateRows {
    visible_at: Arc<HashMap<i64, Instant>>,
    marked: Arc<Mutex<HashSet<i64>>>,
}

impl OutboxTable for LateRows {
    type Tx = MemTx;

    async fn mark_published(&self, rows: &[(i64, uuid::Uuid)]) -> Result<Vec<i64>, StoreError> {
        let now = Instant::now();
        let mut marked = self.marked.lock().unwrap();
        Ok(rows
            .iter()
            .map(|&(id, _)| id)
            .filter(|id| self.visible_at.get(id).is_some_and(|&at| at <= now))
            .filter(|&id| marked.insert(id))
            .collect())
    }
    async fn begin(&self) -> Result<MemTx, StoreError> {
        unreachable!("the marker claims nothing")
    }
}

/// Two UPDATEs 150 ms apart (a trickle is marked once the stream has been quiet 100 ms) each
/// miss their newest row, visible 450 ms after the start; both rows are marked when tried
/// again. Before the fix the second UPDATE's misses replaced the
/// first's: row 2 was never marked.
#[tokio::test(start_paused = true)]
async fn rows_an_update_missed_are_tried_again_after_later_updates_miss_others() {
    let start = Instant::now();
    let late = start + Duration::from_millis(450);
    let table = LateRows {
        visible_at: Arc::new(HashMap::from([
            (1, start),
            (2, late),
            (3, start),
            (4, late),
        ])),
        marked: Default::default(),
    };
    let (marker, handle) = Marker::new(table.clone(), metrics(), None);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(marker.run(shutdown.clone()));
    handle.mark(delivered(1, 2));
    tokio::time::sleep(Duration::from_millis(150)).await;
    // By now the first UPDATE (at 100 ms) marked row 1 and missed row 2.
    assert_eq!(*table.marked.lock().unwrap(), HashSet::from([1]));
    handle.mark(delivered(3, 2));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        *table.marked.lock().unwrap(),
        HashSet::from([1, 2, 3, 4]),
        "every missed row marked when tried again"
    );
    shutdown.cancel();
    running.await.unwrap();
}

/// A table where no row is ever found (replays of rows already marked, say), counting the
/// UPDATEs that looked for each; each UPDATE takes 3 ms.
#[derive(Clone, Default)]
struct NeverFound {
    tries: Arc<Mutex<HashMap<i64, u32>>>,
}

impl OutboxTable for NeverFound {
    type Tx = MemTx;

    async fn mark_published(&self, rows: &[(i64, uuid::Uuid)]) -> Result<Vec<i64>, StoreError> {
        tokio::time::sleep(Duration::from_millis(3)).await;
        let mut tries = self.tries.lock().unwrap();
        for &(id, _) in rows {
            *tries.entry(id).or_default() += 1;
        }
        Ok(Vec::new())
    }
    async fn begin(&self) -> Result<MemTx, StoreError> {
        unreachable!("the marker claims nothing")
    }
}

/// Misses are tried again while the stream keeps handing ids over, not only once it is quiet
/// (found by review: under a steady stream a notification was always waiting and won over the
/// retry timer, so the misses piled up until the stream stopped). Five ids every 2 ms for three
/// seconds: the ids of the first second were each looked for four times (once, then three
/// retries) before the stream stops.
#[tokio::test(start_paused = true)]
async fn misses_are_tried_again_while_the_stream_is_busy() {
    let table = NeverFound::default();
    let (marker, handle) = Marker::new(table.clone(), metrics(), None);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(marker.run(shutdown.clone()));
    let mut next = 1;
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        handle.mark(delivered(next, 5));
        next += 5;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let tries = table.tries.lock().unwrap().clone();
    let first_second: Vec<u32> = (1..2_500)
        .map(|id| tries.get(&id).copied().unwrap_or(0))
        .collect();
    assert!(
        first_second.iter().all(|&n| n == 4),
        "tries of the first second's ids, while the stream was busy: {:?}",
        first_second
            .iter()
            .fold(HashMap::<u32, usize>::new(), |mut m, &n| {
                *m.entry(n).or_default() += 1;
                m
            })
    );
    shutdown.cancel();
    running.await.unwrap();
}
