//! The in-flight side of the stream: batches handed to the sink in order, confirmed in order,
//! and on any failure re-sent (all of them, in order) after a backoff. asynq's TaskID dedupe
//! makes re-sending a batch that partly landed harmless.
//!
//! Rules, each checked in release builds (a broken one ends the session, see [`super::invariant`]):
//! - the writes under way are always for the oldest unconfirmed batches, in order: a batch handed
//!   over while the writer backs off waits for the retry, which re-sends everything unconfirmed;
//! - a confirmation must be for the oldest unconfirmed batch, and must account for every task;
//! - at most `max_inflight` batches are held, so memory is bounded by `max_inflight` batches
//!   (each bounded by rows and bytes by the session);
//! - a write that does not answer within `write_timeout` counts as failed, and a failure on the
//!   link resets the sink's connection, so abandoned writes never pile up behind a dead link.

use super::invariant::{ensure, InvariantViolation};
use crate::backoff::Backoff;
use crate::metrics::{Metrics, TargetLabel};
use crate::sink::{Batch, Sink, SinkError, WriteOutcome};
use futures::future::BoxFuture;
use futures::stream::{FuturesOrdered, StreamExt};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// What happened to the writes.
#[derive(Debug)]
pub enum WriterEvent {
    /// Batch `seq` is in the sink (less the tasks `outcome` lists as rejected); every earlier
    /// batch already was.
    Confirmed {
        seq: u64,
        batch: Arc<Batch>,
        outcome: WriteOutcome,
    },
    /// A write failed; everything unconfirmed is re-sent after `retry_in`.
    Failed {
        error: SinkError,
        retry_in: Duration,
    },
}

type WriteResult = (u64, Instant, Result<WriteOutcome, SinkError>);

/// First delay after a failed write, and the cap of the doubling delays.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

pub struct Writer<S: Sink> {
    sink: S,
    /// Batches handed over and not yet confirmed, oldest first.
    unconfirmed: VecDeque<(u64, Arc<Batch>)>,
    /// Task bytes held in `unconfirmed`.
    bytes: usize,
    /// The writes under way: one for each of the first `inflight.len()` batches of
    /// `unconfirmed`, resolving in that order.
    inflight: FuturesOrdered<BoxFuture<'static, WriteResult>>,
    /// Set after a failure: when to re-send.
    retry_at: Option<Instant>,
    /// Unconfirmed batches at most.
    max_inflight: usize,
    /// A write unanswered this long has failed.
    write_timeout: Duration,
    backoff: Backoff,
    metrics: Arc<Metrics>,
    /// A write failed and none has succeeded since.
    failing: bool,
    /// When the newest write was issued (a retry re-sends at once), whether or not it is still
    /// under way.
    newest_write_at: Option<Instant>,
}

impl<S: Sink> Writer<S> {
    pub fn new(
        sink: S,
        max_inflight: usize,
        write_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        // Nothing is unconfirmed yet: the session starts where everything before has landed.
        sink.restart_order();
        Self {
            sink,
            unconfirmed: VecDeque::new(),
            bytes: 0,
            inflight: FuturesOrdered::new(),
            retry_at: None,
            max_inflight: max_inflight.max(1),
            write_timeout,
            backoff: Backoff::new(RETRY_FIRST, RETRY_MAX),
            metrics,
            failing: false,
            newest_write_at: None,
        }
    }

    /// Room for another batch.
    pub fn can_send(&self) -> bool {
        self.unconfirmed.len() < self.max_inflight
    }

    /// Something is unconfirmed: [`next`](Self::next) will resolve.
    pub fn busy(&self) -> bool {
        !self.unconfirmed.is_empty()
    }

    /// Backing off after a failure.
    pub fn backing_off(&self) -> bool {
        self.retry_at.is_some()
    }

    /// When the retry after a failure re-sends every unconfirmed batch; `None` when not backing
    /// off.
    pub fn retry_at(&self) -> Option<Instant> {
        self.retry_at
    }

    /// When the newest write was issued, whether or not it is still under way; `None` before
    /// the first.
    pub fn last_write_started(&self) -> Option<Instant> {
        self.newest_write_at
    }

    /// Batches held, and their task bytes.
    pub fn held(&self) -> (usize, usize) {
        (self.unconfirmed.len(), self.bytes)
    }

    /// Hands batch `seq` to the sink. Sequence numbers increase by one; there must be room.
    pub fn send(&mut self, seq: u64, batch: Batch) -> Result<(), InvariantViolation> {
        ensure(self.can_send(), || {
            format!(
                "batch {seq} handed over with {} held",
                self.unconfirmed.len()
            )
        })?;
        if let Some((last, _)) = self.unconfirmed.back() {
            ensure(seq == last + 1, || {
                format!("batch {seq} handed over after batch {last}")
            })?;
        }
        let batch = Arc::new(batch);
        self.bytes += batch.bytes;
        self.unconfirmed.push_back((seq, batch.clone()));
        // While backing off nothing is written: the retry re-sends every unconfirmed batch, in
        // order, this one included.
        if self.retry_at.is_none() {
            // Every unconfirmed batch is under way before it on the connection.
            let fut = self.write(seq, batch, self.bytes);
            self.inflight.push_back(fut);
            self.newest_write_at = Some(Instant::now());
        }
        self.gauges();
        Ok(())
    }

    /// Writes batch `seq`; `through`: its bytes and those of the batches under way before it,
    /// which its deadline allows for ([`crate::valkey::write_deadline`]).
    fn write(
        &self,
        seq: u64,
        batch: Arc<Batch>,
        through: usize,
    ) -> BoxFuture<'static, WriteResult> {
        let write = self.sink.write(batch);
        let limit = crate::valkey::write_deadline(self.write_timeout, through as u64);
        Box::pin(async move {
            let started = Instant::now();
            let result = match tokio::time::timeout(limit, write).await {
                Ok(r) => r,
                Err(_) => Err(SinkError::Timeout(limit)),
            };
            (seq, started, result)
        })
    }

    fn gauges(&self) {
        self.metrics
            .inflight_batches
            .set(self.unconfirmed.len() as i64);
        self.metrics.inflight_bytes.set(self.bytes as i64);
    }

    /// The next confirmation or failure. Cancel-safe: use it in `select!`. Only call while
    /// [`busy`](Self::busy).
    pub async fn next(&mut self) -> Result<WriterEvent, InvariantViolation> {
        loop {
            if let Some(at) = self.retry_at {
                tokio::time::sleep_until(at).await;
                self.retry_at = None;
                ensure(self.inflight.is_empty(), || {
                    "writes under way while backing off".into()
                })?;
                // Everything before the oldest unconfirmed batch has landed: the re-sent
                // writes start new order chains, so that a call refused before (and every later
                // one, refused after it) can land now.
                self.sink.restart_order();
                let mut through = 0;
                for (seq, batch) in &self.unconfirmed {
                    through += batch.bytes;
                    let fut = self.write(*seq, batch.clone(), through);
                    self.inflight.push_back(fut);
                }
                self.newest_write_at = Some(Instant::now());
            }
            match self.inflight.next().await {
                Some((seq, started, Ok(outcome))) => return self.confirmed(seq, started, outcome),
                Some((_, _, Err(error))) => {
                    // Later writes may or may not land; all of them are re-sent in order.
                    self.inflight = FuturesOrdered::new();
                    if error.poisons_connection() {
                        self.sink.reset();
                    }
                    let retry_in = self.backoff.next_delay();
                    self.retry_at = Some(Instant::now() + retry_in);
                    self.metrics
                        .valkey_write_failed(crate::health::Writer::Stream);
                    self.failing = true;
                    return Ok(WriterEvent::Failed { error, retry_in });
                }
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn confirmed(
        &mut self,
        seq: u64,
        started: Instant,
        outcome: WriteOutcome,
    ) -> Result<WriterEvent, InvariantViolation> {
        let front = self.unconfirmed.front().map(|(s, _)| *s);
        ensure(front == Some(seq), || match front {
            Some(front) => {
                format!("the sink confirmed batch {seq}, but the oldest unconfirmed is {front}")
            }
            None => format!("the sink confirmed batch {seq}, but none is unconfirmed"),
        })?;
        let (_, batch) = self.unconfirmed.pop_front().expect("checked above");
        // Every task delivered or refused, each refused task named once, within the batch:
        // the marker marks every task not named refused.
        outcome
            .accounts_for(batch.len())
            .map_err(|why| InvariantViolation(format!("batch {seq}: {why}")))?;
        self.bytes -= batch.bytes;
        self.gauges();
        self.backoff.reset();
        self.metrics
            .valkey_write_succeeded(crate::health::Writer::Stream);
        if std::mem::take(&mut self.failing) {
            self.metrics
                .reconnects
                .get_or_create(&TargetLabel { target: "valkey" })
                .inc();
        }
        self.metrics
            .batch_duration
            .observe(started.elapsed().as_secs_f64());
        Ok(WriterEvent::Confirmed {
            seq,
            batch,
            outcome,
        })
    }
}

/// A session's writer going away (the session ended: a standby now, a reconnect, a stop) takes
/// its failing writes with it: readiness must not stay "writes failing" on a relay that no
/// longer writes on the stream (found by review). The next session's writes set it again if
/// Valkey still refuses them.
impl<S: Sink> Drop for Writer<S> {
    fn drop(&mut self) {
        if self.failing {
            self.metrics
                .valkey_write_succeeded(crate::health::Writer::Stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::WriteOutcome;
    use crate::task::Task;
    use std::sync::Mutex;

    /// A sink that fails its first `fail` writes and records which batch each write carried
    /// (by its first task's id), in the order the writes reached it.
    #[derive(Clone, Default)]
    struct Scripted {
        fail: Arc<Mutex<usize>>,
        seen: Arc<Mutex<Vec<String>>>,
    }

    impl Sink for Scripted {
        fn write(
            &self,
            batch: Arc<Batch>,
        ) -> impl std::future::Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static
        {
            let this = self.clone();
            async move {
                this.seen.lock().unwrap().push(batch.tasks[0].id.clone());
                let mut fail = this.fail.lock().unwrap();
                if *fail > 0 {
                    *fail -= 1;
                    return Err(SinkError::Simulated("refused"));
                }
                Ok(WriteOutcome {
                    enqueued: batch.len(),
                    ..WriteOutcome::default()
                })
            }
        }
    }

    fn batch(id: &str) -> Batch {
        let mut b = Batch::default();
        b.push(Task {
            queue: Arc::from("q"),
            id: id.into(),
            msg: vec![0; 10],
            row_id: None,
        });
        b
    }

    fn metrics() -> Arc<Metrics> {
        Arc::new(Metrics::new(
            &mut prometheus_client::registry::Registry::default(),
        ))
    }

    /// Issue 12: a batch handed over while the writer backs off (SIGTERM's final dispatch did
    /// this) must wait for the retry, which re-sends everything in order. Writing it at once
    /// let its confirmation be taken for the older batch's, and the acknowledgement passed a
    /// batch that was never written.
    #[tokio::test(start_paused = true)]
    async fn a_batch_handed_over_during_backoff_waits_for_the_retry() {
        let sink = Scripted {
            fail: Arc::new(Mutex::new(1)),
            ..Scripted::default()
        };
        let mut w = Writer::new(sink.clone(), 4, Duration::from_secs(5), metrics());
        w.send(0, batch("a")).unwrap();
        assert!(matches!(
            w.next().await.unwrap(),
            WriterEvent::Failed { .. }
        ));
        w.send(1, batch("b")).unwrap();
        let mut confirmed = Vec::new();
        while w.busy() {
            if let WriterEvent::Confirmed { seq, batch, .. } = w.next().await.unwrap() {
                confirmed.push((seq, batch.tasks[0].id.clone()));
            }
        }
        assert_eq!(
            *sink.seen.lock().unwrap(),
            ["a", "a", "b"],
            "nothing is written during the backoff; the retry writes in order"
        );
        assert_eq!(confirmed, [(0, "a".to_string()), (1, "b".to_string())]);
    }

    #[tokio::test(start_paused = true)]
    async fn more_batches_than_the_bound_are_refused() {
        let mut w = Writer::new(Scripted::default(), 2, Duration::from_secs(5), metrics());
        w.send(0, batch("a")).unwrap();
        w.send(1, batch("b")).unwrap();
        assert!(w.send(2, batch("c")).is_err(), "only 2 batches may be held");
        assert!(w.send(5, batch("d")).is_err());
        assert_eq!(w.held().0, 2);
    }

    /// A sink that answers for fewer tasks than the batch has is a broken invariant.
    #[tokio::test(start_paused = true)]
    async fn an_answer_for_too_few_tasks_stops_the_session() {
        #[derive(Clone)]
        struct Short;
        impl Sink for Short {
            #[allow(clippy::manual_async_fn)]
            fn write(
                &self,
                _: Arc<Batch>,
            ) -> impl std::future::Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static
            {
                async { Ok(WriteOutcome::default()) }
            }
        }
        let mut w = Writer::new(Short, 2, Duration::from_secs(5), metrics());
        w.send(0, batch("a")).unwrap();
        assert!(w.next().await.is_err());
    }

    /// A writer that goes away while its writes fail (its session ended: this relay stands by
    /// now) leaves no "writes failing" behind for readiness.
    #[tokio::test(start_paused = true)]
    async fn a_writer_that_goes_away_takes_its_failing_writes_with_it() {
        let sink = Scripted::default();
        *sink.fail.lock().unwrap() = 1;
        let m = metrics();
        let mut w = Writer::new(sink, 2, Duration::from_secs(1), m.clone());
        w.send(1, batch("a")).unwrap();
        assert!(matches!(w.next().await, Ok(WriterEvent::Failed { .. })));
        assert!(m.health.writes_failing());
        drop(w);
        assert!(!m.health.writes_failing());
    }
}
