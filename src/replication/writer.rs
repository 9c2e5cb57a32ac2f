//! The in-flight side of the stream: batches handed to the sink in order, confirmed in order,
//! and on any failure re-sent (all of them, in order) after a backoff. asynq's TaskID dedupe
//! makes re-sending a batch that partly landed harmless. Memory is bounded by `max_inflight`.

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
    /// Batch `seq` is in the sink; every earlier batch already was.
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

pub struct Writer<S: Sink> {
    sink: S,
    /// Batches handed over and not yet confirmed, oldest first.
    unconfirmed: VecDeque<(u64, Arc<Batch>)>,
    /// The writes under way for (a suffix of) `unconfirmed`, resolving in order.
    inflight: FuturesOrdered<BoxFuture<'static, WriteResult>>,
    /// Set after a failure: when to re-send.
    retry_at: Option<Instant>,
    max_inflight: usize,
    backoff: Backoff,
    metrics: Arc<Metrics>,
    /// A write failed and none has succeeded since.
    failing: bool,
}

impl<S: Sink> Writer<S> {
    pub fn new(sink: S, max_inflight: usize, metrics: Arc<Metrics>) -> Self {
        Self {
            sink,
            unconfirmed: VecDeque::new(),
            inflight: FuturesOrdered::new(),
            retry_at: None,
            max_inflight,
            backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            metrics,
            failing: false,
        }
    }

    /// Room for another batch, and not backing off.
    pub fn can_send(&self) -> bool {
        self.retry_at.is_none() && self.unconfirmed.len() < self.max_inflight
    }

    /// Something is unconfirmed: [`next`](Self::next) will resolve.
    pub fn busy(&self) -> bool {
        !self.unconfirmed.is_empty()
    }

    /// Hands batch `seq` to the sink.
    pub fn send(&mut self, seq: u64, batch: Batch) {
        let batch = Arc::new(batch);
        self.unconfirmed.push_back((seq, batch.clone()));
        let fut = self.write(seq, batch);
        self.inflight.push_back(fut);
    }

    fn write(&self, seq: u64, batch: Arc<Batch>) -> BoxFuture<'static, WriteResult> {
        let write = self.sink.write(batch);
        Box::pin(async move {
            let started = Instant::now();
            (seq, started, write.await)
        })
    }

    /// The next confirmation or failure. Cancel-safe: use it in `select!`. Only call while
    /// [`busy`](Self::busy).
    pub async fn next(&mut self) -> WriterEvent {
        loop {
            if let Some(at) = self.retry_at {
                tokio::time::sleep_until(at).await;
                self.retry_at = None;
                for (seq, batch) in &self.unconfirmed {
                    let fut = self.write(*seq, batch.clone());
                    self.inflight.push_back(fut);
                }
            }
            match self.inflight.next().await {
                Some((seq, started, Ok(outcome))) => {
                    let (front, batch) = self
                        .unconfirmed
                        .pop_front()
                        .expect("a confirmed write has an unconfirmed batch");
                    debug_assert_eq!(front, seq);
                    self.backoff.reset();
                    if std::mem::take(&mut self.failing) {
                        self.metrics
                            .reconnects
                            .get_or_create(&TargetLabel { target: "valkey" })
                            .inc();
                    }
                    self.metrics
                        .batch_duration
                        .observe(started.elapsed().as_secs_f64());
                    return WriterEvent::Confirmed {
                        seq,
                        batch,
                        outcome,
                    };
                }
                Some((_, _, Err(error))) => {
                    // Later writes may or may not land; all of them are re-sent in order.
                    self.inflight = FuturesOrdered::new();
                    let retry_in = self.backoff.next_delay();
                    self.retry_at = Some(Instant::now() + retry_in);
                    self.metrics.write_errors.inc();
                    self.failing = true;
                    return WriterEvent::Failed { error, retry_in };
                }
                None => std::future::pending::<()>().await,
            }
        }
    }
}
