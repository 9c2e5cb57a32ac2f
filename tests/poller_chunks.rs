//! A poll round's Valkey writes are bounded by bytes as well as by count, and however many
//! writes large rows make, no more of them run between two statements of the round's
//! transaction than the idle-in-transaction bound allows for.
//!
//! Before, a round cut its rows by count alone (100 tasks a write): 100 rows of 1 MiB made one
//! write of 100 MiB that a slow link could not carry within the write timeout, every round,
//! and the rows were neither delivered nor counted as failed.

mod common;

use common::mem_outbox::{MemTable, Step, Steps};
use outbox_relay::metrics::Metrics;
use outbox_relay::poller::{Poller, PollerSettings};
use outbox_relay::sink::{Batch, Sink, SinkError, WriteOutcome};
use outbox_relay::store::ClaimedRow;
use outbox_relay::task::TaskSettings;
use std::sync::Arc;
use std::time::Duration;

/// A sink that logs each write in the table's steps and creates every task, except that write
/// number `fails` (from 1), if any, fails as a lost link would.
#[derive(Clone)]
struct LoggingSink {
    steps: Steps,
    fails: Option<usize>,
}

impl Sink for LoggingSink {
    fn write(
        &self,
        batch: Arc<Batch>,
    ) -> impl std::future::Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static {
        let mut steps = self.steps.lock().unwrap();
        steps.push(Step::Write {
            tasks: batch.len(),
            bytes: batch.tasks.iter().map(|t| t.msg.len()).sum(),
        });
        let nth = steps
            .iter()
            .filter(|s| matches!(s, Step::Write { .. }))
            .count();
        let answer = match self.fails == Some(nth) {
            true => Err(SinkError::Simulated("the link is gone")),
            false => Ok(WriteOutcome {
                enqueued: batch.len(),
                ..Default::default()
            }),
        };
        async move { answer }
    }
}

/// `n` rows whose payloads carry `payload_bytes` bytes each.
fn rows(n: usize, payload_bytes: usize) -> Vec<ClaimedRow> {
    (1..=n)
        .map(|i| ClaimedRow {
            id: i as i64,
            event_id: Some(format!("00000000-0000-4000-8000-{i:012}")),
            event_name: Some("order.placed".into()),
            payload: Some(format!("{{\"blob\":\"{}\"}}", "x".repeat(payload_bytes))),
            metadata: Some("{}".into()),
            created_at: Some("2026-01-01 00:00:00+00".into()),
            attempts: 0,
        })
        .collect()
}

fn settings() -> PollerSettings {
    PollerSettings {
        batch_size: 12,
        chunk_size: 4,
        chunk_bytes: 8 << 10,
        claim_bytes: 32 << 20,
        poll_interval: Duration::from_millis(200),
        recovery_grace: None,
        max_attempts: 3,
        attempt_backoff: Duration::from_millis(200),
        write_timeout: Duration::from_secs(1),
    }
}

/// One round over `rows` whose write number `fails` fails: the round's outcome (rows delivered,
/// rows failed), its steps, and the rows it marked published.
async fn round_failing(
    rows: Vec<ClaimedRow>,
    fails: Option<usize>,
) -> (Result<(usize, usize), String>, Vec<Step>, Vec<i64>) {
    let table = MemTable::new(rows);
    let poller = Poller {
        table: table.clone(),
        settings: settings(),
        tasks: Arc::new(TaskSettings::default()),
        sink: LoggingSink {
            steps: table.steps.clone(),
            fails,
        },
        metrics: Arc::new(Metrics::new(
            &mut prometheus_client::registry::Registry::default(),
        )),
        wake: Arc::default(),
        shared_ids: None,
    };
    let out = poller
        .round()
        .await
        .map(|out| (out.delivered, out.failed_rows))
        .map_err(|e| e.to_string());
    let steps = table.steps.lock().unwrap().clone();
    let published = table.published.lock().unwrap().clone();
    (out, steps, published)
}

/// One round over `rows`, which succeeds with no failed row: its steps, and the rows it marked
/// published.
async fn round(rows: Vec<ClaimedRow>) -> (Vec<Step>, Vec<i64>) {
    let n = rows.len();
    let (out, steps, published) = round_failing(rows, None).await;
    assert_eq!(out, Ok((n, 0)), "every row delivered, none failed");
    (steps, published)
}

/// The most writes found between two statements.
fn longest_run_of_writes(steps: &[Step]) -> usize {
    steps
        .split(|s| matches!(s, Step::Statement(_)))
        .map(|run| run.len())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn large_rows_make_more_writes_each_within_the_byte_bound() {
    let s = settings();
    // About 3 KiB a task: two fit in 8 KiB, so twelve rows make six writes where the count
    // alone would make three.
    let (steps, published) = round(rows(12, 3 << 10)).await;
    let writes: Vec<(usize, usize)> = steps
        .iter()
        .filter_map(|s| match s {
            Step::Write { tasks, bytes } => Some((*tasks, *bytes)),
            Step::Statement(_) => None,
        })
        .collect();
    assert_eq!(writes.iter().map(|w| w.0).sum::<usize>(), 12, "{steps:?}");
    for (tasks, bytes) in &writes {
        assert!(
            *bytes <= s.chunk_bytes && *tasks <= s.chunk_size,
            "a write of {tasks} tasks and {bytes} bytes: {steps:?}"
        );
    }
    assert_eq!(writes.len(), 6, "{steps:?}");
    assert!(
        longest_run_of_writes(&steps) <= s.writes_between_statements(),
        "more writes between two statements than the idle bound allows for: {steps:?}"
    );
    assert_eq!(
        published,
        (1..=12).collect::<Vec<i64>>(),
        "each row marked once"
    );
    assert_eq!(steps.last(), Some(&Step::Statement("commit")));
}

#[tokio::test]
async fn a_row_larger_than_the_bound_goes_alone_and_small_rows_keep_one_statement() {
    let s = settings();
    // Twelve tasks over 8 KiB each: one write each, a statement after every three.
    let (steps, published) = round(rows(12, 9 << 10)).await;
    let writes = steps
        .iter()
        .filter(|s| matches!(s, Step::Write { tasks: 1, .. }))
        .count();
    assert_eq!(writes, 12, "{steps:?}");
    assert!(longest_run_of_writes(&steps) <= s.writes_between_statements());
    assert_eq!(published, (1..=12).collect::<Vec<i64>>());
    // Small rows: three writes of four, and the marks in one statement at the end as before.
    let (steps, published) = round(rows(12, 10)).await;
    let marks = steps
        .iter()
        .filter(|s| **s == Step::Statement("mark_published"))
        .count();
    assert_eq!((longest_run_of_writes(&steps), marks), (3, 1), "{steps:?}");
    assert_eq!(published, (1..=12).collect::<Vec<i64>>());
}

/// A write that fails after rows were marked early: the round commits the rows of the writes
/// before it, each once, and leaves the rest unpublished for the next round.
#[tokio::test]
async fn a_write_failing_after_an_early_mark_leaves_the_rest_unpublished() {
    // Two tasks a write, three writes between two statements: rows 1 to 6 are marked before
    // the fourth write, which fails.
    let (out, steps, published) = round_failing(rows(12, 3 << 10), Some(4)).await;
    assert!(
        out.as_ref()
            .is_err_and(|e| e.contains("valkey write failed")),
        "{out:?}"
    );
    assert_eq!(published, (1..=6).collect::<Vec<i64>>(), "{steps:?}");
    let marks = steps
        .iter()
        .filter(|s| **s == Step::Statement("mark_published"))
        .count();
    assert_eq!(marks, 1, "no statement for an empty rest: {steps:?}");
    assert_eq!(steps.last(), Some(&Step::Statement("commit")));
    // Fails on the third write, before any early mark: rows 1 to 4 in one mark at the end.
    let (out, _, published) = round_failing(rows(12, 3 << 10), Some(3)).await;
    assert!(out.is_err());
    assert_eq!(published, (1..=4).collect::<Vec<i64>>());
}
