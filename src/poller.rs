//! The FOR UPDATE SKIP LOCKED poller: the recovery and backfill path beside the stream, and the
//! whole relay in poll mode (databases without logical replication).
//!
//! The Go kit's semantics: a full batch re-polls at once and the poll interval is only the idle
//! delay; a failing round backs off with doubling delays up to 30 s and the first good round
//! returns to the normal pace; rows enqueued before a mid-batch failure are marked published,
//! the rest stay. Several pollers (threads or replicas) never claim the same row. A row that
//! cannot become a task (no event name, metadata not a string map, over the size limit...)
//! becomes a dead letter at once: only a fix can change it. A task Valkey refuses for good
//! (its queue's key, the ACL) records a failed attempt and becomes a dead letter at the limit,
//! since a fix of Valkey's side makes the retry succeed.

use crate::backoff::Backoff;
use crate::error_chain::error_chain;
use crate::metrics::Metrics;
use crate::postgres::{PgError, PgTarget};
use crate::replication::invariant::InvariantViolation;
use crate::shared_event_ids::SharedIdsHandle;
use crate::sink::{Batch, Sink, SinkError};
use crate::store::{OutboxTable, OutboxTx, StoreError};
use crate::task::{Task, TaskSettings};
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
    /// Task bytes per Valkey write at most (a task larger than this goes alone): the stream's
    /// batch bound, so that large rows make more writes, each as long as a stream's, instead of
    /// one write that cannot finish within the write timeout on a slow link.
    pub chunk_bytes: usize,
    /// Payload and metadata text a round keeps at most (and the row that crosses it; the first
    /// row whatever its size), beside the tasks built from those rows. Rows claimed past it are
    /// left for the next round, which starts at once.
    pub claim_bytes: usize,
    /// The idle delay between rounds.
    pub poll_interval: Duration,
    /// Beside the stream: only rows at least this old. `None` in poll mode (every row).
    pub recovery_grace: Option<Duration>,
    pub max_attempts: i32,
    /// First retry delay of a failed row; doubles per attempt (at most an hour).
    pub attempt_backoff: Duration,
    /// A write unanswered this long has failed (the stream's writer uses the same): the
    /// round ends, its row locks go, and the connection is reset.
    pub write_timeout: Duration,
}

impl PollerSettings {
    /// The longest a round's transaction may legitimately stay idle between two statements: its
    /// chunks' Valkey writes, one after another with no statement between them, each bounded by
    /// the write timeout and the time of its bytes, at most `chunk_bytes`, on the slowest link
    /// allowed for ([`crate::valkey::write_deadline`]); plus `link_timeout` for the rest
    /// (building tasks, a slow answer). The
    /// server ends a poll transaction idle longer than this (see [`crate::store::pg::TxLimits`]):
    /// its client was cut off, and its row locks must go so that another poller can deliver.
    pub fn idle_in_transaction_bound(&self, link_timeout: Duration) -> Duration {
        let chunks = u32::try_from(self.writes_between_statements()).unwrap_or(u32::MAX);
        crate::valkey::write_deadline(self.write_timeout, self.chunk_bytes as u64)
            .saturating_mul(chunks)
            + link_timeout
    }

    /// Valkey writes a round makes with no statement between them, at most: a full batch cut
    /// by count alone. Rows cut by bytes into more writes get a statement (the marks so far)
    /// after this many, so that the idle bound holds whatever the rows' sizes.
    pub fn writes_between_statements(&self) -> usize {
        self.batch_size.div_ceil(self.chunk_size.max(1)).max(1)
    }

    /// `tasks` cut into writes of at most `chunk_size` tasks and `chunk_bytes` task bytes (or
    /// one task larger than that), in order.
    pub fn chunks<'a, T>(&self, tasks: &'a [(T, Task)]) -> Vec<&'a [(T, Task)]> {
        let mut chunks = Vec::new();
        let mut start = 0;
        let mut bytes = 0;
        for (i, (_, task)) in tasks.iter().enumerate() {
            let full = i - start >= self.chunk_size.max(1)
                || (i > start && bytes + task.msg.len() > self.chunk_bytes);
            if full {
                chunks.push(&tasks[start..i]);
                start = i;
                bytes = 0;
            }
            bytes += task.msg.len();
        }
        if start < tasks.len() {
            chunks.push(&tasks[start..]);
        }
        chunks
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PollerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("valkey write failed")]
    Sink(#[source] SinkError),
    /// The sink's answer did not account for every task: nothing of the round is marked.
    #[error(transparent)]
    Invariant(#[from] InvariantViolation),
}

/// First delay after a failed round, and the cap of the doubling delays (the Go kit's).
const ROUND_RETRY_FIRST: Duration = Duration::from_secs(1);
const ROUND_RETRY_MAX: Duration = Duration::from_secs(30);
/// `max_attempts` that makes [`OutboxTx::mark_failed`] dead-letter the row on this attempt.
const DEAD_AT_ONCE: i32 = 0;

/// One poll loop.
pub struct Poller<T: OutboxTable, S: Sink> {
    /// The outbox table.
    pub table: T,
    pub settings: PollerSettings,
    pub tasks: Arc<TaskSettings>,
    /// Where tasks go.
    pub sink: S,
    pub metrics: Arc<Metrics>,
    /// Woken by LISTEN/NOTIFY (or anyone) to poll before the interval is up.
    pub wake: Arc<Notify>,
    /// Told of writes that met existing TaskIDs, when event_id is not unique in the table.
    pub shared_ids: Option<SharedIdsHandle>,
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RoundOutcome {
    pub claimed: usize,
    /// Rows were locked past `claim_bytes` and left for the next round.
    pub left: bool,
    pub delivered: usize,
    pub failed_rows: usize,
}

impl<T: OutboxTable, S: Sink> Poller<T, S> {
    /// Polls until `shutdown`. Errors are logged and retried; nothing here is fatal.
    pub async fn run(&self, shutdown: CancellationToken) {
        let mut backoff = Backoff::new(ROUND_RETRY_FIRST, ROUND_RETRY_MAX);
        // This poller's last round failed on Valkey (readiness counts it as failing writes).
        let mut failing = false;
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            let delay = match self.round().await {
                Ok(out) => {
                    backoff.reset();
                    // A round that ended well clears this poller's failure, also when it had
                    // nothing to write (the rows it failed on were delivered by the stream
                    // meanwhile): otherwise one old failure would keep /readyz not ready. A
                    // round of another poller with nothing to write clears nothing.
                    if std::mem::take(&mut failing) {
                        self.metrics
                            .valkey_write_succeeded(crate::health::Writer::Poller);
                    }
                    self.metrics.poller_rounds.inc();
                    if out.claimed >= self.settings.batch_size || out.left {
                        continue;
                    }
                    self.settings.poll_interval
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    match &e {
                        PollerError::Sink(_) => {
                            failing = true;
                            self.metrics
                                .valkey_write_failed(crate::health::Writer::Poller);
                        }
                        PollerError::Invariant(_) => {
                            failing = true;
                            self.metrics.invariant_violations.inc();
                            self.metrics
                                .valkey_write_failed(crate::health::Writer::Poller);
                        }
                        PollerError::Store(_) => {}
                    }
                    self.metrics.poller_errors.inc();
                    tracing::warn!(
                        error = %error_chain(&e),
                        retry_in_ms = delay.as_millis() as u64,
                        "poll round failed"
                    );
                    delay
                }
            };
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Claims a batch, enqueues it in chunks, marks what was enqueued, commits. A task the sink
    /// rejects for good records a failed attempt (a dead letter at the limit); a Valkey failure
    /// after some chunks still commits the marks of the chunks before it, then reports the error.
    pub async fn round(&self) -> Result<RoundOutcome, PollerError> {
        let started = tokio::time::Instant::now();
        let s = &self.settings;
        let mut tx = self.table.begin().await?;
        let claimed = tx
            .claim(s.batch_size, s.claim_bytes, s.recovery_grace)
            .await?;
        let rows = claimed.rows;
        let mut out = RoundOutcome {
            claimed: rows.len(),
            left: claimed.left,
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
                Ok(task) => good.push((row, task)),
                Err(bad) => {
                    out.failed_rows += 1;
                    // A bad row is bad for good: nothing but a fix of the row (or of the
                    // settings) changes it, so retrying with backoff only delays the operator.
                    // It becomes a dead letter now; retrying is for what can change by itself
                    // (Valkey refusing a queue, below).
                    let dead = tx
                        .mark_failed(row.id, &bad.to_string(), s.attempt_backoff, DEAD_AT_ONCE)
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
        // Rows of `delivered` from this index on are not marked yet.
        let mut unmarked = 0;
        let mut writes_since_statement = 0;
        let mut failure = None;
        for chunk in s.chunks(&good) {
            if writes_since_statement == s.writes_between_statements() {
                // Only chunks whose every task was delivered leave no statement behind them
                // (a refusal is marked at once), so there are rows to mark.
                tx.mark_published(&delivered[unmarked..]).await?;
                unmarked = delivered.len();
                writes_since_statement = 0;
            }
            writes_since_statement += 1;
            let mut batch = Batch::default();
            for (_, task) in chunk {
                batch.push(task.clone());
            }
            let limit = crate::valkey::write_deadline(s.write_timeout, batch.bytes as u64);
            let written = match tokio::time::timeout(limit, self.sink.write(Arc::new(batch))).await
            {
                Ok(r) => r,
                Err(_) => Err(SinkError::Timeout(limit)),
            };
            if let Err(e) = &written {
                if e.poisons_connection() {
                    self.sink.reset();
                }
            }
            let outcome = match written {
                Ok(o) => o,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            // As the stream's writer does: an answer that does not account for every task
            // ends the round unmarked (the rows are claimed again; TaskIDs dedupe).
            if let Err(why) = outcome.accounts_for(chunk.len()) {
                return Err(InvariantViolation(format!("poll round: {why}")).into());
            }
            self.metrics
                .valkey_write_succeeded(crate::health::Writer::Poller);
            self.metrics.published.inc_by(outcome.delivered() as u64);
            self.metrics.duplicates.inc_by(outcome.duplicates as u64);
            self.metrics
                .poller_delivered
                .inc_by(outcome.delivered() as u64);
            let mut reasons: Vec<Option<&str>> = vec![None; chunk.len()];
            for r in &outcome.rejected {
                if let Some(slot) = reasons.get_mut(r.index) {
                    *slot = Some(&r.reason);
                }
            }
            if let Some(shared_ids) = self.shared_ids.as_ref().filter(|_| outcome.duplicates > 0) {
                shared_ids.check(
                    chunk
                        .iter()
                        .zip(&reasons)
                        .filter(|(_, reason)| reason.is_none())
                        .filter_map(|((row, task), _)| {
                            uuid::Uuid::parse_str(row.event_id())
                                .ok()
                                .map(|id| (row.id, id, task.queue.clone()))
                        })
                        .collect(),
                );
            }
            for ((row, _), reason) in chunk.iter().zip(reasons) {
                match reason {
                    None => delivered.push(row.id),
                    Some(reason) => {
                        out.failed_rows += 1;
                        let dead = tx
                            .mark_failed(row.id, reason, s.attempt_backoff, s.max_attempts)
                            .await?;
                        writes_since_statement = 0;
                        self.metrics.rows_rejected.inc();
                        tracing::warn!(
                            event_id = %row.event_id(),
                            attempt = row.attempts + 1,
                            dead_letter = dead,
                            reason = %reason,
                            "valkey refused the task"
                        );
                    }
                }
            }
        }
        tx.mark_published(&delivered[unmarked..]).await?;
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
                Err(e) => tracing::warn!(error = %error_chain(&e), "notification connection lost"),
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
    let notify = wake.clone();
    let driver = tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(m) = futures::StreamExt::next(&mut messages).await {
            if let tokio_postgres::AsyncMessage::Notification(_) = m? {
                notify.notify_waiters();
                notify.notify_one();
            }
        }
        Ok::<(), tokio_postgres::Error>(())
    });
    client.batch_execute(&format!("LISTEN {channel}")).await?;
    // Rows committed while nobody listened notified nobody: poll once now.
    wake.notify_one();
    tracing::debug!(channel, "listening for outbox notifications");
    let result = driver.await;
    drop(client);
    match result {
        Ok(r) => Ok(r?),
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_may_stay_idle_for_all_its_chunks_writes_and_a_link_timeout() {
        let settings = PollerSettings {
            batch_size: 500,
            chunk_size: 100,
            chunk_bytes: 8 << 20,
            claim_bytes: 32 << 20,
            poll_interval: Duration::from_secs(1),
            recovery_grace: None,
            max_attempts: 25,
            attempt_backoff: Duration::from_secs(1),
            write_timeout: Duration::from_secs(15),
        };
        // The defaults: five chunks of 3 x 5 s and 8 s for 8 MiB on the slowest link allowed
        // for, and 30 s.
        assert_eq!(
            settings.idle_in_transaction_bound(Duration::from_secs(30)),
            Duration::from_secs(145)
        );
        let partial = PollerSettings {
            batch_size: 101,
            ..settings
        };
        assert_eq!(
            partial.idle_in_transaction_bound(Duration::from_secs(3)),
            Duration::from_secs(49)
        );
    }

    fn sized(lens: &[usize]) -> Vec<((), Task)> {
        lens.iter()
            .map(|&n| {
                let task = Task {
                    queue: "q".into(),
                    id: String::new(),
                    msg: vec![0; n],
                    row_id: None,
                };
                ((), task)
            })
            .collect()
    }

    fn cut(settings: &PollerSettings, lens: &[usize]) -> Vec<Vec<usize>> {
        let tasks = sized(lens);
        settings
            .chunks(&tasks)
            .iter()
            .map(|c| c.iter().map(|(_, t)| t.msg.len()).collect())
            .collect()
    }

    #[test]
    fn a_round_cuts_its_writes_by_count_and_by_bytes_in_order() {
        let settings = PollerSettings {
            batch_size: 6,
            chunk_size: 3,
            chunk_bytes: 10,
            claim_bytes: 32 << 20,
            poll_interval: Duration::from_secs(1),
            recovery_grace: None,
            max_attempts: 25,
            attempt_backoff: Duration::from_secs(1),
            write_timeout: Duration::from_secs(15),
        };
        assert_eq!(settings.writes_between_statements(), 2);
        assert_eq!(
            cut(&settings, &[1, 1, 1, 1, 1, 1, 1]),
            [vec![1, 1, 1], vec![1, 1, 1], vec![1]]
        );
        // 10 bytes fill a write; a task larger than the bound goes alone.
        assert_eq!(
            cut(&settings, &[4, 6, 1, 25, 9, 2]),
            [vec![4, 6], vec![1], vec![25], vec![9], vec![2]]
        );
        assert_eq!(cut(&settings, &[30]), [vec![30]]);
        assert!(cut(&settings, &[]).is_empty());
    }
}
