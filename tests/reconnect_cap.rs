//! The stream's reconnect backoff, end to end through `Stream::run` (issue 17: the documented
//! 30 s cap was tested only as a unit of `src/backoff.rs`). Postgres stays unreachable for ten
//! minutes on tokio's paused clock, so the test takes no wall-clock time and no timing luck: it
//! records when the stream asks for the slot, and checks the delays between attempts double
//! from 200 ms (less up to 25% jitter) and then stay at the cap, 30 s (22.5 s to 30 s).
//! Raising the cap in src/replication/stream.rs, or dropping it, fails this test.
//!
//! A session that streamed (it opened the slot) and then lost its connection starts the delay
//! afresh: with a connection lost right after each opening, every attempt follows the one
//! before after the first step, 200 ms (less jitter), however long it goes on.

use outbox_relay::config::OnSlotLost;
use outbox_relay::metrics::Metrics;
use outbox_relay::pgoutput::TableName;
use outbox_relay::replication::source::{ReplicationSource, SlotHolder, SlotPort, SlotState};
use outbox_relay::replication::stream::{Stream, StreamError, StreamSettings};
use outbox_relay::sink::{Batch, Sink, SinkError, WriteOutcome};
use outbox_relay::task::TaskSettings;
use pgwire_replication::{Lsn, PgWireError, ReplicationEvent};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

fn unreachable_error() -> StreamError {
    StreamError::Replication(PgWireError::Io(Arc::new(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "connection refused",
    ))))
}

/// A replication connection that is never opened.
struct NoSource;

impl ReplicationSource for NoSource {
    async fn recv(&mut self) -> Result<Option<ReplicationEvent>, PgWireError> {
        unreachable!("never opened")
    }
    fn update_applied_lsn(&self, _: Lsn) {}
    fn feedback_pending(&self) -> bool {
        false
    }
    async fn shutdown(&mut self) {}
}

/// A Postgres that refuses every connection, recording when it was asked.
#[derive(Clone, Default)]
struct DownPort {
    attempts: Arc<Mutex<Vec<Instant>>>,
}

impl SlotPort for DownPort {
    type Source = NoSource;

    fn publication(&self) -> &str {
        "outbox_relay"
    }
    async fn state(&self) -> Result<SlotState, StreamError> {
        self.attempts.lock().unwrap().push(Instant::now());
        Err(unreachable_error())
    }
    async fn recreate(&self) -> Result<Lsn, StreamError> {
        Err(unreachable_error())
    }
    async fn open(&self, _: Lsn, _: &CancellationToken) -> Result<Option<NoSource>, StreamError> {
        self.attempts.lock().unwrap().push(Instant::now());
        Err(unreachable_error())
    }
    async fn holder(&self) -> Result<Option<SlotHolder>, StreamError> {
        Err(unreachable_error())
    }
    async fn terminate(&self, _: i32) -> Result<(), StreamError> {
        Err(unreachable_error())
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
        async { unreachable!("nothing is streamed") }
    }
}

fn stream_on<P: SlotPort>(port: P, metrics: Arc<Metrics>) -> Stream<P, NoSink> {
    Stream {
        port,
        settings: StreamSettings {
            slot: "outbox_relay".into(),
            table: TableName::parse("public.outbox_events").unwrap(),
            batch_rows: 100,
            batch_bytes: 1 << 20,
            max_inflight: 2,
            write_timeout: Duration::from_secs(1),
            shutdown_timeout: Duration::from_secs(1),
            on_slot_lost: OnSlotLost::Recreate,
            takeover_after: Duration::from_secs(5),
            link_timeout: None,
            publication_check: None,
        },
        tasks: Arc::new(TaskSettings::default()),
        sink: NoSink,
        metrics,
        marker: None,
        shared_ids: None,
        slot_watch: Default::default(),
    }
}

/// Runs `stream` for ten minutes of the paused clock, then stops it.
async fn run_ten_minutes<P: SlotPort>(stream: Stream<P, NoSink>) {
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(600)).await;
        stop.cancel();
    });
    stream.run(shutdown).await.expect("a clean stop");
}

#[tokio::test(start_paused = true)]
async fn reconnect_delays_double_up_to_the_30_second_cap_and_stay_there() {
    let port = DownPort::default();
    let metrics = Arc::new(Metrics::new(
        &mut prometheus_client::registry::Registry::default(),
    ));
    run_ten_minutes(stream_on(port.clone(), metrics.clone())).await;

    let attempts = port.attempts.lock().unwrap().clone();
    let gaps: Vec<f64> = attempts
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    // 200 ms doubling: 0.2, 0.4, ... 25.6, then 30 s: ~51 s to reach the cap, then one attempt
    // every 22.5-30 s for the rest of the ten minutes.
    let mut step: f64 = 0.2;
    for (i, &gap) in gaps.iter().enumerate() {
        let cap = step.min(30.0);
        assert!(
            gap >= cap * 0.75 - 1e-3 && gap <= cap + 1e-3,
            "attempt {i}: waited {gap:.3} s, expected {:.3}..{cap:.3} s; all gaps {gaps:?}",
            cap * 0.75
        );
        step *= 2.0;
    }
    // The first 8 gaps are the doubling steps (0.2 s to 25.6 s); every later one was checked
    // against the cap above.
    assert!(
        gaps.len() >= 8 + 15,
        "the delay reached the cap and stayed there: {gaps:?}"
    );
    assert_eq!(
        metrics
            .reconnects
            .get_or_create(&outbox_relay::metrics::TargetLabel { target: "postgres" })
            .get(),
        gaps.len() as u64 + 1,
        "each failed attempt counted once as a reconnect"
    );
}

/// A replication connection lost as soon as it is read.
struct LostSource;

impl ReplicationSource for LostSource {
    async fn recv(&mut self) -> Result<Option<ReplicationEvent>, PgWireError> {
        Err(PgWireError::Io(Arc::new(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset by peer",
        ))))
    }
    fn update_applied_lsn(&self, _: Lsn) {}
    fn feedback_pending(&self) -> bool {
        false
    }
    async fn shutdown(&mut self) {}
}

/// A Postgres whose slot opens every time, on a connection that is then lost; records when the
/// slot was opened.
#[derive(Clone, Default)]
struct LosingPort {
    opened: Arc<Mutex<Vec<Instant>>>,
}

impl SlotPort for LosingPort {
    type Source = LostSource;

    fn publication(&self) -> &str {
        "outbox_relay"
    }
    async fn state(&self) -> Result<SlotState, StreamError> {
        Ok(SlotState::Ready(Lsn(0x1000)))
    }
    async fn recreate(&self) -> Result<Lsn, StreamError> {
        unreachable!("the slot is there")
    }
    async fn open(&self, _: Lsn, _: &CancellationToken) -> Result<Option<LostSource>, StreamError> {
        self.opened.lock().unwrap().push(Instant::now());
        Ok(Some(LostSource))
    }
    async fn holder(&self) -> Result<Option<SlotHolder>, StreamError> {
        Ok(None)
    }
    async fn terminate(&self, _: i32) -> Result<(), StreamError> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_session_that_streamed_starts_the_delay_afresh() {
    let port = LosingPort::default();
    let metrics = Arc::new(Metrics::new(
        &mut prometheus_client::registry::Registry::default(),
    ));
    run_ten_minutes(stream_on(port.clone(), metrics)).await;

    let opened = port.opened.lock().unwrap().clone();
    let gaps: Vec<f64> = opened
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    // Ten minutes at one attempt every 150 to 200 ms: some 3,000; a delay that grew would give
    // a few dozen.
    assert!(
        gaps.len() > 2_000,
        "{} sessions in ten minutes",
        opened.len()
    );
    for (i, &gap) in gaps.iter().enumerate() {
        assert!(
            (0.15 - 1e-3..=0.2 + 1e-3).contains(&gap),
            "session {i}: waited {gap:.3} s after a session that streamed, expected 0.150..0.200 s"
        );
    }
}
