//! One replication connection's session: pgoutput in, batches to the writer, the LSN
//! acknowledged only once the sink confirmed every task up to that commit.
//!
//! One `select! { biased; ... }` loop, in priority order:
//! 1. shutdown;
//! 2. write confirmations and failures (they free room and move the acknowledgement);
//! 3. a full open batch goes out as soon as the writer has room;
//! 4. the next replication event, while the open batch has room;
//! 5. nothing to read right now: the open batch goes out unless a write is under way (rows
//!    then gather while it travels: group commit) or, while rows arrive faster than one per
//!    [`GROUP_COMMIT_WAIT`], the newest write left less than that ago (write spacing), or it
//!    lingers while draining a backlog;
//! 6. the linger timer;
//! 7. caught up, when the timer due [`GROUP_COMMIT_WAIT`] after the newest write left fires (0.5
//!    to 1.5 ms after it; while the writer backs off, at its retry): the open batch goes out,
//!    beside that write if it is still under way, so over a slow link a row waits about a
//!    millisecond, not a round trip;
//! 8. the receive deadline.
//!
//! Rows are streamed into batches as they arrive, so a huge transaction never sits in memory;
//! its commit is acknowledged once its last batch is confirmed. Status updates go out every
//! second from the connection's own clock, also while this loop waits on Valkey, so the
//! walsender never times out. A broken invariant ends the session at once: nothing more is
//! acknowledged or marked, and the supervisor reconnects (Postgres replays from the last safe
//! position).

use super::ack::AckTracker;
use super::invariant::InvariantViolation;
use super::liveness::Liveness;
use super::source::ReplicationSource;
use super::stream::{StreamError, StreamSettings};
use super::writer::{Writer, WriterEvent};
use super::HEARTBEAT_PREFIX;
use crate::error_chain::error_chain;
use crate::marker::MarkerHandle;
use crate::metrics::{LinkLabel, Metrics};
use crate::pgoutput::{self, Decoded, OutboxColumn, OutboxInsert, RelationCache};
use crate::shared_event_ids::SharedIdsHandle;
use crate::sink::{Batch, Sink};
use crate::task::{BadRow, RowText, TaskSettings};
use crate::timer::sleep_until_opt;
use pgwire_replication::{Lsn, ReplicationEvent};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How a session ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    Shutdown,
    ServerClosed,
}

/// A stream that is this far behind its commits (server send time minus commit time) is
/// draining a backlog...
const BEHIND_MICROS: i64 = 50_000;
/// ...so its batches wait until their first row is this old, or full, rather than leaving as
/// soon as nothing more is readable. Behind, the stream often reads faster than the walsender
/// decodes, and sending each short read as its own write costs the relay and Valkey more CPU per
/// event (CPU that, on a shared host, the walsender then lacks). Caught up, a batch does not
/// linger (see [`GROUP_COMMIT_WAIT`] for what it waits for then).
const LINGER: Duration = Duration::from_millis(2);
/// Caught up, with room in the writer, how long a row may be held after the newest write left (a
/// retry counts as a write, and rows read while the writer backs off leave with it). A held row
/// leaves when a timer due this long after that write fires, which tokio does at the end of the
/// millisecond tick the due time falls in: 0.5 to 1.5 ms after the write, 1 ms on average. A row
/// is held:
/// - while a write is under way (group commit: one write carries them all), until the timer
///   fires; then the held rows leave beside it, while the writer has room. Across a link of round
///   trip R a row waited up to R for the write ahead of it before its own write could leave;
/// - while rows arrive more than one per wait on average ([`Session::spacing`]), also after a
///   write that already came back (on loopback, where a write returns in a fraction of the wait),
///   if it is read less than this after that write: write spacing. A row read later leaves at
///   once, so writes leave at least this far apart: rows arriving steadily 200 µs apart leave
///   about 0.6 ms apart, three to a write, and rows arriving in bursts leave with their burst.
///   Slower rows gain nothing by waiting (the next would come after the write anyway) and leave
///   at once.
///
/// Half a millisecond. With 1 ms the timer fired 1 to 2 ms after the write, and on loopback at
/// 5,000 events/s writes left 1.7 ms apart, the p50 latency 1.3 to 1.4 ms above the build without
/// spacing. Sending held rows by the timer alone (so writes leave about a millisecond apart
/// however rows arrive) was measured too, and doubled the loopback p50 again: docs/benchmarks.md,
/// "The wait halved".
///
/// Measured in docs/benchmarks.md ("The group-commit wait", "Write spacing", "The wait halved").
pub const GROUP_COMMIT_WAIT: Duration = Duration::from_micros(500);
/// The mean gap between rows read, as [`Session::spacing`] keeps it, starts at and never
/// exceeds this (an idle minute weighs no more than a few slow rows).
const ROW_GAP_CAP: Duration = Duration::from_millis(4);

/// After shutdown, how long the final acknowledgement may take to reach the server, and the
/// connection to close.
const FINAL_ACK_WAIT: Duration = Duration::from_secs(3);

/// What the session needs from the relay, borrowed.
pub struct SessionContext<'a, S: Sink> {
    pub settings: &'a StreamSettings,
    pub tasks: &'a TaskSettings,
    pub sink: &'a S,
    pub metrics: &'a Arc<Metrics>,
    pub marker: Option<&'a MarkerHandle>,
    /// Told of writes that met existing TaskIDs, when event_id is not unique in the table.
    pub shared_ids: Option<&'a SharedIdsHandle>,
}

/// State of one replication connection.
pub struct Session<'a, S: Sink> {
    cx: SessionContext<'a, S>,
    /// Table definitions seen on this connection.
    relations: RelationCache,
    /// Which LSN may be acknowledged.
    ack: AckTracker,
    /// The LSN last handed to the connection.
    reported: Lsn,
    /// The batch being filled.
    open: Batch,
    /// Batches handed to the sink and not yet confirmed.
    writer: Writer<S>,
    /// Reused buffer for task payloads.
    scratch: Vec<u8>,
    /// The current transaction's final LSN, for logs.
    txn_lsn: Lsn,
    /// The current transaction's commit time, unix microseconds.
    txn_commit_micros: i64,
    /// When the server sent the last change, unix microseconds (the server's clock, like the
    /// commit time, so their difference is the stream's lag without any clock skew).
    sent_micros: i64,
    /// When the first row of `open` arrived.
    open_since: Option<Instant>,
    /// `open` waits until then for more rows (see [`LINGER`]).
    linger_at: Option<Instant>,
    /// The receive deadline (see [`super::liveness`]); `None` without a link timeout.
    liveness: Option<Liveness>,
    /// Set when a silence was given one more deadline after the server showed the walsender
    /// reading (it may have answered while the probe ran); cleared by any message.
    silence_rechecked: bool,
    /// When the last row was read, and the mean gap between rows (an exponential moving
    /// average, each gap capped at [`ROW_GAP_CAP`]): whether write spacing pays.
    last_row_at: Option<Instant>,
    row_gap: Duration,
}

impl<'a, S: Sink> Session<'a, S> {
    /// A session resuming at `start`, the slot's confirmed position.
    pub fn new(cx: SessionContext<'a, S>, start: Lsn) -> Self {
        let writer = Writer::new(
            cx.sink.clone(),
            cx.settings.max_inflight,
            cx.settings.write_timeout,
            cx.metrics.clone(),
        );
        Self {
            relations: RelationCache::new(cx.settings.table.clone()),
            ack: AckTracker::new(start),
            reported: start,
            open: Batch::default(),
            writer,
            scratch: Vec::with_capacity(4096),
            txn_lsn: Lsn::ZERO,
            txn_commit_micros: 0,
            sent_micros: 0,
            open_since: None,
            linger_at: None,
            silence_rechecked: false,
            last_row_at: None,
            row_gap: ROW_GAP_CAP,
            liveness: cx
                .settings
                .link_timeout
                .map(|t| Liveness::new(t, Instant::now().into_std())),
            cx,
        }
    }

    /// The position acknowledged so far.
    pub fn acked(&self) -> Lsn {
        self.ack.acked()
    }

    /// Whether the stream is draining a backlog.
    fn behind(&self) -> bool {
        self.sent_micros - self.txn_commit_micros > BEHIND_MICROS
    }

    /// When the open batch may leave, caught up (see [`GROUP_COMMIT_WAIT`]): that long after the
    /// newest write left, whether or not it is still under way; while the writer backs off, with
    /// its retry (which re-sends only what it holds: rows read during the backoff would otherwise
    /// wait for the retry's reply, found by review). `None` when it has no timed departure:
    /// empty, lingering or draining a backlog (batches then fill or linger), no room in the
    /// writer, or no write yet.
    fn spaced_write_at(&self) -> Option<Instant> {
        if self.open.is_empty() || self.linger_at.is_some() || self.behind() {
            return None;
        }
        if !self.writer.can_send() {
            return None;
        }
        if let Some(retry_at) = self.writer.retry_at() {
            return Some(retry_at);
        }
        self.writer
            .last_write_started()
            .map(|at| at + GROUP_COMMIT_WAIT)
    }

    /// Step 5 may act: the open batch, with nothing to read and no write under way, lingers
    /// (behind) or leaves (caught up: at once, or with write spacing once the newest write is
    /// [`GROUP_COMMIT_WAIT`] old; before that, step 7's timer sends it). Without a timed
    /// departure (`spaced_at` is `None`) it leaves at once: nothing else would send it.
    fn leave_when_idle(&self, spaced_at: Option<Instant>, now: Instant) -> bool {
        if self.open.is_empty() || self.writer.busy() || self.linger_at.is_some() {
            return false;
        }
        self.behind() || !self.spacing() || spaced_at.is_none_or(|at| at <= now)
    }

    /// Write spacing pays: rows arrive more than one per [`GROUP_COMMIT_WAIT`] on average (2,000
    /// a second), so a write that waits for the timer (0.5 to 1.5 ms after the write before it)
    /// carries more than the row that started it.
    fn spacing(&self) -> bool {
        self.row_gap < GROUP_COMMIT_WAIT
    }

    /// Counts a row read now in the mean gap between rows (weight 1/8).
    fn row_read(&mut self, now: Instant) {
        if let Some(last) = self.last_row_at {
            let gap = now.saturating_duration_since(last).min(ROW_GAP_CAP);
            self.row_gap = (self.row_gap * 7 + gap) / 8;
        }
        self.last_row_at = Some(now);
    }

    fn open_full(&self) -> bool {
        self.open.len() >= self.cx.settings.batch_rows
            || self.open.bytes >= self.cx.settings.batch_bytes
    }

    /// Streams until shutdown, the server closing, or an error.
    pub async fn run(
        &mut self,
        source: &mut impl ReplicationSource,
        shutdown: &CancellationToken,
    ) -> Result<SessionEnd, StreamError> {
        loop {
            let reading = !self.open_full();
            let deadline = self.liveness.as_mut().and_then(|l| {
                l.reading(reading, Instant::now().into_std());
                l.deadline().map(Instant::from_std)
            });
            let spaced_at = self.spaced_write_at();
            let idle_leave = self.leave_when_idle(spaced_at, Instant::now());
            tokio::select! {
                biased;
                // 1
                _ = shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
                // 2
                ev = self.writer.next(), if self.writer.busy() => self.on_write(ev?, source)?,
                // 3
                _ = std::future::ready(()), if self.open_full() && self.writer.can_send() => {
                    self.dispatch()?;
                }
                // 4
                ev = source.recv(), if reading => match ev {
                    Ok(Some(ev)) => {
                        if let Some(l) = &mut self.liveness {
                            l.heard(Instant::now().into_std());
                        }
                        self.silence_rechecked = false;
                        self.on_event(ev, source)?
                    }
                    Ok(None) => return Ok(SessionEnd::ServerClosed),
                    Err(e) => return Err(StreamError::Replication(e)),
                },
                // 5
                _ = std::future::ready(()), if idle_leave => {
                    match self.open_since {
                        Some(since) if self.behind() => self.linger_at = Some(since + LINGER),
                        _ => self.dispatch()?,
                    }
                }
                // 6
                _ = sleep_until_opt(self.linger_at), if self.linger_at.is_some() && !self.writer.busy() => {
                    self.dispatch()?;
                }
                // 7
                _ = sleep_until_opt(spaced_at), if spaced_at.is_some() => {
                    self.dispatch()?;
                }
                // 8: the link is dead; nothing more is acknowledged on it.
                // A walsender busy decoding reads no status update (see `super::liveness`):
                // the server is asked before the link is called dead.
                _ = sleep_until_opt(deadline), if deadline.is_some() => {
                    let silent = self.liveness.as_ref().and_then(|l| l.dead(Instant::now().into_std()));
                    if let Some(silent) = silent {
                        // Busy inside one record, it reads no status update: the link lives.
                        // One that reads (between records, or waiting) may have answered
                        // while the probe ran: one more deadline before the link is dead.
                        let keep = match source.walsender_busy().await {
                            Some(true) => {
                                tracing::info!(
                                    silent_secs = silent.as_secs(),
                                    "replication connection silent, but its walsender is busy \
                                     decoding (a long transaction the publication filters, or a \
                                     table rewrite): the link lives"
                                );
                                self.cx.metrics.walsender_busy_silences.inc();
                                true
                            }
                            Some(false) if !self.silence_rechecked => {
                                self.silence_rechecked = true;
                                true
                            }
                            _ => false,
                        };
                        if keep {
                            if let Some(l) = &mut self.liveness {
                                l.heard(Instant::now().into_std());
                            }
                            continue;
                        }
                        self.cx.metrics.link_failures.get_or_create(&LinkLabel { link: "replication" }).inc();
                        return Err(StreamError::LinkDead { silent_secs: silent.as_secs() });
                    }
                }
            }
        }
    }

    fn dispatch(&mut self) -> Result<(), InvariantViolation> {
        self.open_since = None;
        self.linger_at = None;
        let seq = self.ack.seal();
        let batch = std::mem::take(&mut self.open);
        self.writer.send(seq, batch)
    }

    fn report(&mut self, source: &impl ReplicationSource) {
        let acked = self.ack.acked();
        if acked > self.reported {
            source.update_applied_lsn(acked);
            self.reported = acked;
            self.cx.metrics.acked_lsn.set(acked.0);
        }
    }

    fn on_write(
        &mut self,
        ev: WriterEvent,
        source: &impl ReplicationSource,
    ) -> Result<(), InvariantViolation> {
        match ev {
            WriterEvent::Confirmed {
                seq,
                batch,
                outcome,
            } => {
                let m = self.cx.metrics;
                m.published.inc_by(outcome.delivered() as u64);
                m.duplicates.inc_by(outcome.duplicates as u64);
                tracing::debug!(
                    seq,
                    tasks = batch.len(),
                    duplicates = outcome.duplicates,
                    rejected = outcome.rejected.len(),
                    "batch confirmed"
                );
                self.ack.confirmed(seq)?;
                self.report(source);
                observe_latency(&m.delivery_latency, &batch.commit_times);
                let refused = outcome.refused(batch.len());
                let mut delivered = Vec::with_capacity(batch.len());
                for (task, refused) in batch.tasks.iter().zip(refused) {
                    if refused {
                        continue;
                    }
                    if let (Some(id), Ok(event_id)) = (task.row_id, uuid::Uuid::parse_str(&task.id))
                    {
                        delivered.push((id, event_id));
                    }
                }
                for r in &outcome.rejected {
                    let task = &batch.tasks[r.index];
                    tracing::warn!(
                        event_id = %task.id,
                        queue = %task.queue,
                        reason = %r.reason,
                        "valkey refused the task; its row stays unpublished for the recovery poller"
                    );
                }
                m.rows_rejected.inc_by(outcome.rejected.len() as u64);
                if let Some(shared_ids) = self.cx.shared_ids.filter(|_| outcome.duplicates > 0) {
                    shared_ids.check(
                        batch
                            .tasks
                            .iter()
                            .zip(outcome.refused(batch.len()))
                            .filter(|(_, refused)| !refused)
                            .filter_map(|(task, _)| {
                                let event_id = uuid::Uuid::parse_str(&task.id).ok()?;
                                Some((task.row_id?, event_id, task.queue.clone()))
                            })
                            .collect(),
                    );
                }
                if let Some(marker) = self.cx.marker {
                    marker.mark(delivered);
                }
            }
            WriterEvent::Failed { error, retry_in } => {
                tracing::warn!(
                    error = %error_chain(&error),
                    retry_in_ms = retry_in.as_millis() as u64,
                    "valkey write failed; holding the acknowledgement and retrying"
                );
            }
        }
        Ok(())
    }

    fn on_event(
        &mut self,
        ev: ReplicationEvent,
        source: &impl ReplicationSource,
    ) -> Result<(), StreamError> {
        match ev {
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                self.txn_lsn = final_lsn;
                self.txn_commit_micros = commit_time_micros + PG_EPOCH_UNIX_MICROS;
                self.ack.begin()?;
            }
            ReplicationEvent::XLogData {
                data,
                server_time_micros,
                ..
            } => {
                self.sent_micros = server_time_micros + PG_EPOCH_UNIX_MICROS;
                self.on_data(&data)?
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.ack.commit(end_lsn)?;
                self.report(source);
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                self.ack.idle_position(wal_end);
                self.report(source);
            }
            ReplicationEvent::Message {
                transactional: false,
                lsn,
                prefix,
                ..
            } => {
                if prefix == HEARTBEAT_PREFIX {
                    self.cx.metrics.health.heartbeat_seen(lsn.0);
                }
                self.ack.idle_position(lsn);
                self.report(source);
            }
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        Ok(())
    }

    fn on_data(&mut self, data: &[u8]) -> Result<(), StreamError> {
        match pgoutput::decode(data, &mut self.relations).map_err(StreamError::Decode)? {
            Decoded::Relation { relation_id } => {
                let rel = self.relations.get(relation_id);
                if let Some(missing) = rel.and_then(|r| r.outbox_map()).map(|m| m.missing()) {
                    if !missing.is_empty() {
                        tracing::error!(
                            table = %self.cx.settings.table,
                            missing = %missing.iter().map(|c| c.name()).collect::<Vec<_>>().join(", "),
                            "the outbox table lost required columns: its rows cannot become tasks \
                             and stay unpublished until the table is fixed"
                        );
                    }
                }
            }
            Decoded::Insert(row) => self.on_insert(&row)?,
            Decoded::OtherInsert { .. } | Decoded::Ignored(_) => {}
        }
        Ok(())
    }

    fn on_insert(&mut self, row: &OutboxInsert<'_>) -> Result<(), InvariantViolation> {
        let event_id = row.text(OutboxColumn::EventId).ok().flatten().unwrap_or("");
        let event_name = row
            .text(OutboxColumn::EventName)
            .ok()
            .flatten()
            .unwrap_or("");
        let built = row_text(row).and_then(|text| self.cx.tasks.build(&text, &mut self.scratch));
        match built {
            Ok(task) => {
                let now = Instant::now();
                self.row_read(now);
                if self.open.is_empty() {
                    self.open_since = Some(now);
                }
                self.open.push_committed(task, self.txn_commit_micros);
                self.ack.row()?;
            }
            Err(bad) => {
                tracing::warn!(
                    event_id,
                    event_name,
                    lsn = %self.txn_lsn,
                    reason = %bad,
                    "row cannot become a task; left unpublished for the recovery path"
                );
                self.cx.metrics.bad_row(event_name, bad.reason());
            }
        }
        Ok(())
    }

    /// Graceful end: send what is open, wait (bounded by the shutdown timeout) for the writes,
    /// retrying failed ones, send the final acknowledgement and make sure it reached the server.
    /// Whatever is still unconfirmed at the deadline is not acknowledged: Postgres replays it.
    pub async fn finish(&mut self, source: &mut impl ReplicationSource) {
        if let Err(e) = self.finish_writes(source).await {
            self.cx.metrics.invariant_violations.inc();
            tracing::error!(error = %e, "stopping without the final acknowledgement");
        }
        let sent_by = Instant::now() + FINAL_ACK_WAIT;
        while source.feedback_pending() && Instant::now() < sent_by {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tracing::info!(lsn = %self.ack.acked(), "final acknowledgement sent");
        let _ = tokio::time::timeout(FINAL_ACK_WAIT, source.shutdown()).await;
    }

    async fn finish_writes(
        &mut self,
        source: &mut impl ReplicationSource,
    ) -> Result<(), InvariantViolation> {
        let deadline = Instant::now() + self.cx.settings.shutdown_timeout;
        while !self.open.is_empty() || self.writer.busy() {
            if !self.open.is_empty() && self.writer.can_send() {
                self.dispatch()?;
            }
            tokio::select! {
                biased;
                ev = self.writer.next() => {
                    let ev = ev?;
                    if let WriterEvent::Failed { error, .. } = &ev {
                        tracing::warn!(error = %error_chain(error), "write failed during shutdown; retrying until the shutdown deadline");
                    }
                    self.on_write(ev, source)?;
                }
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!("shutdown deadline reached; unconfirmed batches are not acknowledged and will be replayed");
                    break;
                }
            }
        }
        self.report(source);
        Ok(())
    }
}

/// Postgres timestamps count microseconds from 2000-01-01.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// Commit-to-confirmation latency of every task of a confirmed batch.
fn observe_latency(h: &prometheus_client::metrics::histogram::Histogram, commits: &[(i64, u32)]) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    for &(at, n) in commits {
        let secs = (now - at).max(0) as f64 / 1e6;
        for _ in 0..n {
            h.observe(secs);
        }
    }
}

/// The text columns of an outbox insert.
fn row_text<'r>(row: &OutboxInsert<'r>) -> Result<RowText<'r>, BadRow> {
    let get = |c: OutboxColumn| row.text(c).map_err(|e| BadRow::Column(e.to_string()));
    let req = |c: OutboxColumn| get(c)?.ok_or(BadRow::MissingColumn(c.name()));
    Ok(RowText {
        id: get(OutboxColumn::Id)?,
        event_id: req(OutboxColumn::EventId)?,
        event_name: req(OutboxColumn::EventName)?,
        payload: req(OutboxColumn::Payload)?,
        metadata: get(OutboxColumn::Metadata)?,
        created_at: req(OutboxColumn::CreatedAt)?,
    })
}
