//! The FOR UPDATE SKIP LOCKED poller: the recovery and backfill path beside the stream, and the
//! whole relay in poll mode (databases without logical replication).
//!
//! The Go kit's semantics: a full batch re-polls at once and the poll interval is only the idle
//! delay; a failing round backs off with doubling delays up to 30 s and the first good round
//! returns to the normal pace; rows enqueued before a mid-batch failure are marked published,
//! the rest stay. Several pollers (threads or replicas) never claim the same row. A row that
//! cannot become a task records a failed attempt and becomes a dead letter at the limit.

use crate::backoff::Backoff;
use crate::metrics::Metrics;
use crate::postgres::{PgError, PgTarget};
use crate::sink::{Batch, Sink, SinkError};
use crate::store::Store;
use crate::task::TaskSettings;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How a poller runs.
#[derive(Debug, Clone)]
pub struct PollerSettings {
    /// Rows claimed per round (OUTBOX_BATCH_SIZE).
    pub batch_size: usize,
    /// Tasks per Valkey write: the unit of partial success.
    pub chunk_size: usize,
    /// The idle delay between rounds.
    pub poll_interval: Duration,
    /// Beside the stream: only rows at least this old. `None` in poll mode (every row).
    pub recovery_grace: Option<Duration>,
    pub max_attempts: i32,
    /// First retry delay of a failed row; doubles per attempt (at most an hour).
    pub attempt_backoff: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum PollerError {
    #[error("cannot get a postgres connection")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("postgres query failed")]
    Query(#[from] tokio_postgres::Error),
    #[error("valkey write failed")]
    Sink(#[source] SinkError),
}

/// One poll loop.
pub struct Poller<S: Sink> {
    pub pool: deadpool_postgres::Pool,
    pub store: Store,
    pub settings: PollerSettings,
    pub tasks: Arc<TaskSettings>,
    pub sink: S,
    pub metrics: Arc<Metrics>,
    /// Woken by LISTEN/NOTIFY (or anyone) to poll before the interval is up.
    pub wake: Arc<Notify>,
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RoundOutcome {
    pub claimed: usize,
    pub delivered: usize,
    pub failed_rows: usize,
}

impl<S: Sink> Poller<S> {
    /// Polls until `shutdown`. Errors are logged and retried; nothing here is fatal.
    pub async fn run(&self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            let delay = match self.round().await {
                Ok(out) => {
                    backoff.reset();
                    self.metrics.poller_rounds.inc();
                    if out.claimed >= self.settings.batch_size {
                        continue;
                    }
                    self.settings.poll_interval
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    self.metrics.poller_errors.inc();
                    tracing::warn!(
                        error = %crate::replication::stream::error_chain(&e),
                        retry_in_ms = delay.as_millis() as u64,
                        "poll round failed"
                    );
                    delay
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
                _ = self.wake.notified() => {}
            }
        }
    }

    /// Claims a batch, enqueues it in chunks, marks what was enqueued, commits. A Valkey failure
    /// after some chunks still commits the marks of the chunks before it, then reports the error.
    pub async fn round(&self) -> Result<RoundOutcome, PollerError> {
        let started = std::time::Instant::now();
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let rows = self
            .store
            .claim(&*tx, self.settings.batch_size, self.settings.recovery_grace)
            .await?;
        let mut out = RoundOutcome {
            claimed: rows.len(),
            ..Default::default()
        };
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(out);
        }
        let mut scratch = Vec::new();
        let mut good = Vec::with_capacity(rows.len());
        for row in &rows {
            match row
                .text()
                .and_then(|text| self.tasks.build(&text, &mut scratch))
            {
                Ok(task) => good.push((row.id, task)),
                Err(bad) => {
                    out.failed_rows += 1;
                    let dead = self
                        .store
                        .mark_failed(
                            &*tx,
                            row.id,
                            &bad.to_string(),
                            self.settings.attempt_backoff,
                            self.settings.max_attempts,
                        )
                        .await?;
                    self.metrics.bad_row(row.event_name(), bad.reason());
                    tracing::warn!(
                        event_id = %row.event_id(),
                        event_name = %row.event_name(),
                        attempt = row.attempts + 1,
                        dead_letter = dead,
                        reason = %bad,
                        "row cannot become a task"
                    );
                }
            }
        }
        let mut delivered: Vec<i64> = Vec::with_capacity(good.len());
        let mut failure = None;
        for chunk in good.chunks(self.settings.chunk_size.max(1)) {
            let mut batch = Batch::default();
            for (_, task) in chunk {
                batch.push(task.clone());
            }
            match self.sink.write(Arc::new(batch)).await {
                Ok(o) => {
                    delivered.extend(chunk.iter().map(|(id, _)| *id));
                    self.metrics
                        .published
                        .inc_by((o.enqueued + o.duplicates) as u64);
                    self.metrics.duplicates.inc_by(o.duplicates as u64);
                    self.metrics.poller_delivered.inc_by(chunk.len() as u64);
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        self.store.mark_published(&*tx, &delivered).await?;
        tx.commit().await?;
        out.delivered = delivered.len();
        self.metrics
            .batch_duration
            .observe(started.elapsed().as_secs_f64());
        match failure {
            Some(e) => Err(PollerError::Sink(e)),
            None => Ok(out),
        }
    }
}

/// LISTENs on `channel` and wakes `wake` on every notification, reconnecting on loss, until
/// `shutdown`.
pub async fn listen(pg: PgTarget, channel: String, wake: Arc<Notify>, shutdown: CancellationToken) {
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listen_session(&pg, &channel, &wake) => match r {
                Ok(()) => tracing::debug!("notification connection closed"),
                Err(e) => tracing::warn!(error = %crate::replication::stream::error_chain(&e), "notification connection lost"),
            },
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
    }
}

async fn listen_session(pg: &PgTarget, channel: &str, wake: &Arc<Notify>) -> Result<(), PgError> {
    let (client, mut conn) = pg.connect_raw().await?;
    let wake = wake.clone();
    let driver = tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(m) = futures::StreamExt::next(&mut messages).await {
            if let tokio_postgres::AsyncMessage::Notification(_) = m? {
                wake.notify_waiters();
                wake.notify_one();
            }
        }
        Ok::<(), tokio_postgres::Error>(())
    });
    client.batch_execute(&format!("LISTEN {channel}")).await?;
    tracing::debug!(channel, "listening for outbox notifications");
    let result = driver.await;
    drop(client);
    match result {
        Ok(r) => Ok(r?),
        Err(_) => Ok(()),
    }
}
