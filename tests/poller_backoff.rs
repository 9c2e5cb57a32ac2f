//! A poll loop whose rounds fail waits 1 s, doubling up to 30 s (less up to 25% jitter), and
//! stays at that cap: docs/configuration.md (`OUTBOX_POLL_INTERVAL`), observability.md and
//! design.md say so, and nothing tested it. Postgres stays unreachable for ten minutes on
//! tokio's paused clock, so the test takes no wall-clock time: it records when each round asks
//! for a transaction and checks the delays between them. Raising or dropping the cap
//! (`ROUND_RETRY_MAX` in src/poller.rs), or the first delay, fails it.

mod common;

use common::mem_outbox::MemTx;
use outbox_relay::metrics::Metrics;
use outbox_relay::poller::{Poller, PollerSettings};
use outbox_relay::sink::{Batch, Sink, SinkError, WriteOutcome};
use outbox_relay::store::{OutboxTable, StoreError};
use outbox_relay::task::TaskSettings;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// An outbox table whose database is down, recording when each round asked for it.
#[derive(Clone, Default)]
struct DownTable {
    begins: Arc<Mutex<Vec<Instant>>>,
}

impl OutboxTable for DownTable {
    type Tx = MemTx;

    async fn mark_published(&self, _: &[(i64, uuid::Uuid)]) -> Result<Vec<i64>, StoreError> {
        Err(StoreError::Simulated("postgres is down"))
    }
    async fn begin(&self) -> Result<MemTx, StoreError> {
        self.begins.lock().unwrap().push(Instant::now());
        Err(StoreError::Simulated("postgres is down"))
    }
}

/// A sink nothing reaches.
#[derive(Clone)]
struct NoSink;

impl Sink for NoSink {
    // The trait asks for a 'static future; an `async fn` here would borrow `self`.
    #[allow(clippy::manual_async_fn)]
    fn write(
        &self,
        _: Arc<Batch>,
    ) -> impl std::future::Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static {
        async { unreachable!("no round gets as far as a write") }
    }
}

#[tokio::test(start_paused = true)]
async fn failed_rounds_wait_one_second_doubling_up_to_the_30_second_cap() {
    let table = DownTable::default();
    let metrics = Arc::new(Metrics::new(
        &mut prometheus_client::registry::Registry::default(),
    ));
    let poller = Poller {
        table: table.clone(),
        settings: PollerSettings {
            batch_size: 100,
            chunk_size: 100,
            chunk_bytes: 8 << 20,
            claim_bytes: 32 << 20,
            // Far from every delay checked below: a failed round must not wait this instead.
            poll_interval: Duration::from_secs(7),
            recovery_grace: None,
            max_attempts: 3,
            attempt_backoff: Duration::from_secs(1),
            write_timeout: Duration::from_secs(5),
        },
        tasks: Arc::new(TaskSettings::default()),
        sink: NoSink,
        metrics: metrics.clone(),
        wake: Default::default(),
        shared_ids: None,
    };
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(600)).await;
        stop.cancel();
    });
    poller.run(shutdown).await;

    let begins = table.begins.lock().unwrap().clone();
    let gaps: Vec<f64> = begins
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    // 1 s doubling: 1, 2, 4, 8, 16, then 30 s: 31 s to reach the cap, then one round every
    // 22.5-30 s for the rest of the ten minutes.
    assert!(
        gaps.len() >= 20,
        "only {} rounds in ten minutes: {gaps:?}",
        begins.len()
    );
    let mut step: f64 = 1.0;
    for (i, &gap) in gaps.iter().enumerate() {
        let cap = step.min(30.0);
        assert!(
            gap >= cap * 0.75 - 1e-3 && gap <= cap + 1e-3,
            "round {i}: waited {gap:.3} s, expected {:.3}..{cap:.3} s; all gaps {gaps:?}",
            cap * 0.75
        );
        step *= 2.0;
    }
    assert_eq!(
        metrics.poller_errors.get(),
        begins.len() as u64,
        "every round counted as failed"
    );
}
