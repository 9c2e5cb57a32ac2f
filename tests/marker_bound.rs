//! The ids waiting to be marked published are bounded (docs/design.md's memory table: 1,000,000
//! ids and their event ids): beyond that the stream's hand-over drops them and counts them in
//! `outbox_rows_mark_dropped_total`, and never blocks. Those rows stay unpublished for the
//! recovery poller. The marker task is not run here, so nothing drains the buffer.

mod common;

use common::mem_outbox::MemTable;
use outbox_relay::marker::Marker;
use outbox_relay::metrics::Metrics;
use std::sync::Arc;

fn delivered(from: i64, n: i64) -> Vec<(i64, uuid::Uuid)> {
    (from..from + n)
        .map(|id| (id, uuid::Uuid::from_u64_pair(0, id as u64)))
        .collect()
}

#[test]
fn ids_past_the_bound_are_dropped_and_counted() {
    let metrics = Arc::new(Metrics::new(
        &mut prometheus_client::registry::Registry::default(),
    ));
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
