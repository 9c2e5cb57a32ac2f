//! Two queues refused in one write, their tasks interleaved (a batch [qa, qb, qa] with both
//! queues' pending lists holding strings, so every script call answers WRONGTYPE).
//!
//! Found by review: the sink listed refusals queue by queue ([0, 2, 1]) while the stream and the
//! poller merged them with the batch as if in batch order, so the refused qb task counted as
//! delivered and its row was marked published with no task: the stream had acknowledged past it
//! and the poller never claims a published row, so the event was lost. Now the sink lists them
//! in batch order, and the stream, the poller and the writer's invariant read them by index,
//! in any order (the simulation's Valkey lists them queue by queue, as a sink meets them).

mod common;

use common::mem_outbox::MemTable;
use common::*;
use outbox_relay::metrics::Metrics;
use outbox_relay::poller::{Poller, PollerSettings};
use outbox_relay::sink::valkey::ValkeySink;
use outbox_relay::sink::{Batch, Sink, SinkError};
use outbox_relay::store::{Claimed, ClaimedRow, OutboxTable, OutboxTx, StoreError};
use outbox_relay::task::{QueueRoute, TaskSettings};
use std::sync::Arc;
use std::time::Duration;

fn task_settings() -> TaskSettings {
    TaskSettings {
        routes: ["a.*=qa", "b.*=qb"]
            .iter()
            .map(|r| QueueRoute::parse(r).unwrap())
            .collect(),
        ..TaskSettings::default()
    }
}

fn fresh_metrics() -> Arc<Metrics> {
    Arc::new(Metrics::new(
        &mut prometheus_client::registry::Registry::default(),
    ))
}

/// A poller over `table` and `sink`, settings small and fixed (a 1 s write timeout).
fn poller<T: OutboxTable, S: Sink>(
    table: T,
    sink: S,
    recovery_grace: Option<Duration>,
    metrics: Arc<Metrics>,
) -> Poller<T, S> {
    Poller {
        table,
        settings: PollerSettings {
            batch_size: 10,
            chunk_size: 10,
            chunk_bytes: 8 << 20,
            claim_bytes: 32 << 20,
            poll_interval: Duration::from_millis(200),
            recovery_grace,
            max_attempts: 3,
            attempt_backoff: Duration::from_millis(200),
            write_timeout: Duration::from_secs(1),
        },
        tasks: Arc::new(task_settings()),
        sink,
        metrics,
        wake: Arc::default(),
        shared_ids: None,
    }
}

/// Rows 1..=3: a.x (qa), b.x (qb), a.x (qa).
fn rows() -> Vec<ClaimedRow> {
    ["a.x", "b.x", "a.x"]
        .iter()
        .enumerate()
        .map(|(i, name)| ClaimedRow {
            id: i as i64 + 1,
            event_id: Some(format!("00000000-0000-4000-8000-00000000000{}", i + 1)),
            event_name: Some((*name).to_owned()),
            payload: Some("{\"n\":1}".into()),
            metadata: Some("{}".into()),
            created_at: Some("2026-01-01 00:00:00+00".into()),
            attempts: 0,
        })
        .collect()
}

/// Both queues' pending lists hold strings: every script call of either queue answers
/// WRONGTYPE, which the sink classifies as a refusal for good (`Refusal::Reject`).
async fn redis_with_two_broken_queues() -> (Redis, ValkeySink) {
    let redis = Redis::start();
    let mut admin = redis.conn().await;
    for q in ["qa", "qb"] {
        let _: () = redis::cmd("SET")
            .arg(format!("asynq:{{{q}}}:pending"))
            .arg("not a list")
            .query_async(&mut admin)
            .await
            .unwrap();
    }
    let target = outbox_relay::valkey::ValkeyTarget::new(
        &redis.url,
        &outbox_relay::valkey::Topology::Single,
        Duration::from_secs(5),
        None,
    )
    .unwrap();
    let sink = ValkeySink::connect(target).await.unwrap();
    (redis, sink)
}

/// The real sink answers for every task, refusals in batch order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_lists_the_refusals_of_two_queues_in_batch_order() {
    let (_redis, sink) = redis_with_two_broken_queues().await;
    let tasks = task_settings();
    let mut batch = Batch::default();
    let mut scratch = Vec::new();
    for r in rows() {
        batch.push(tasks.build(&r.text().unwrap(), &mut scratch).unwrap());
    }
    let out = sink.write(Arc::new(batch)).await.unwrap();
    let idx: Vec<usize> = out.rejected.iter().map(|r| r.index).collect();
    assert_eq!(out.delivered(), 0, "nothing was written");
    assert_eq!(
        idx,
        vec![0, 1, 2],
        "every task refused, listed in batch order"
    );
}

/// End to end through a poll round with the real sink: no refused row is marked published, and
/// each records a failed attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_round_never_marks_a_refused_row_published() {
    let (redis, sink) = redis_with_two_broken_queues().await;
    let table = MemTable::new(rows());
    let poller = poller(table.clone(), sink, None, fresh_metrics());
    let _ = poller.round().await;
    let mut admin = redis.conn().await;
    let qb_tasks: Vec<String> = redis::cmd("KEYS")
        .arg("asynq:{qb}:t:*")
        .query_async(&mut admin)
        .await
        .unwrap();
    let published = table.published.lock().unwrap().clone();
    let failed = table.failed.lock().unwrap().clone();
    assert!(qb_tasks.is_empty(), "qb refused everything: {qb_tasks:?}");
    assert!(
        published.is_empty(),
        "rows {published:?} marked published without a task (failed attempts recorded for \
         {failed:?}): their events would be lost"
    );
    let mut failed = failed;
    failed.sort();
    assert_eq!(
        failed,
        vec![1, 2, 3],
        "each refused row records a failed attempt"
    );
}

/// A sink whose answer does not account for every task of a write.
#[derive(Clone)]
struct MiscountingSink;

impl Sink for MiscountingSink {
    fn write(
        &self,
        batch: Arc<Batch>,
    ) -> impl std::future::Future<Output = Result<outbox_relay::sink::WriteOutcome, SinkError>>
           + Send
           + 'static {
        let n = batch.len();
        async move {
            Ok(outbox_relay::sink::WriteOutcome {
                enqueued: n - 1,
                ..Default::default()
            })
        }
    }
}

/// As the stream's writer does, a poll round refuses an answer that does not account for every
/// task: it ends without marking anything, since every task the answer does not name refused
/// would be marked delivered.
#[tokio::test]
async fn a_poll_round_marks_nothing_on_an_answer_that_misses_a_task() {
    let table = MemTable::new(rows());
    let poller = poller(table.clone(), MiscountingSink, None, fresh_metrics());
    let err = poller.round().await.expect_err("the round must fail");
    assert!(
        err.to_string().contains("answered for 2 of 3 tasks"),
        "{err}"
    );
    assert!(table.published.lock().unwrap().is_empty());
}

/// A sink whose first write fails (Valkey down), and every later one succeeds.
#[derive(Clone, Default)]
struct FailsOnce {
    writes: Arc<std::sync::atomic::AtomicUsize>,
}

impl Sink for FailsOnce {
    fn write(
        &self,
        batch: Arc<Batch>,
    ) -> impl std::future::Future<Output = Result<outbox_relay::sink::WriteOutcome, SinkError>>
           + Send
           + 'static {
        let first = self
            .writes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            == 0;
        async move {
            if first {
                return Err(SinkError::Simulated("connection refused"));
            }
            Ok(outbox_relay::sink::WriteOutcome {
                enqueued: batch.len(),
                ..Default::default()
            })
        }
    }
}

/// The rows of [`rows`] until someone else delivers them, then nothing to claim.
#[derive(Clone, Default)]
struct DeliveredElsewhere {
    rounds: Arc<std::sync::atomic::AtomicUsize>,
}

impl OutboxTable for DeliveredElsewhere {
    type Tx = DeliveredElsewhereTx;

    async fn mark_published(&self, rows: &[(i64, uuid::Uuid)]) -> Result<Vec<i64>, StoreError> {
        Ok(rows.iter().map(|r| r.0).collect())
    }

    async fn begin(&self) -> Result<DeliveredElsewhereTx, StoreError> {
        let round = self
            .rounds
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(DeliveredElsewhereTx { first: round == 0 })
    }
}

struct DeliveredElsewhereTx {
    first: bool,
}

impl OutboxTx for DeliveredElsewhereTx {
    async fn claim(
        &mut self,
        _limit: usize,
        _bytes: usize,
        _older_than: Option<Duration>,
    ) -> Result<Claimed, StoreError> {
        Ok(Claimed {
            rows: if self.first { rows() } else { Vec::new() },
            left: false,
        })
    }

    async fn mark_failed(
        &mut self,
        _id: i64,
        _error: &str,
        _backoff: Duration,
        _max_attempts: i32,
    ) -> Result<bool, StoreError> {
        Ok(false)
    }

    async fn mark_published(&mut self, _ids: &[i64]) -> Result<(), StoreError> {
        Ok(())
    }

    async fn commit(self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A recovery poller whose write failed, and whose rows the stream then delivered, has nothing
/// more to write: its one old failure must not keep `/readyz` not ready (the failing state is
/// per writer, and a round that ends well clears the pollers').
#[tokio::test(start_paused = true)]
async fn a_poller_with_nothing_left_to_write_does_not_stay_failing() {
    let table = DeliveredElsewhere::default();
    let metrics = fresh_metrics();
    let poller = poller(
        table.clone(),
        FailsOnce::default(),
        Some(Duration::from_secs(30)),
        metrics.clone(),
    );
    let shutdown = tokio_util::sync::CancellationToken::new();
    let token = shutdown.clone();
    let running = tokio::spawn(async move { poller.run(token).await });
    while table.rounds.load(std::sync::atomic::Ordering::SeqCst) < 3 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        metrics.write_errors.get(),
        1,
        "the first round's write failed"
    );
    assert!(
        !metrics.health.writes_failing(),
        "later rounds had nothing to write and ended well"
    );
    shutdown.cancel();
    running.await.unwrap();
}
