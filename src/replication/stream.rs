//! The replication stream: pgoutput in, asynq tasks out, LSN acknowledged only after Valkey.
//!
//! One task runs one `select! { biased; ... }` loop per connection (a session), in priority
//! order: shutdown; write confirmations and failures; the next replication event (only while
//! the open batch has room); dispatch of the open batch (when it is full, or when nothing is
//! ready to read and no write is under way, so rows gather while a write travels).
//!
//! Rows are streamed into batches as they arrive, so a huge transaction
//! never sits in memory; its commit is acknowledged once its last batch is confirmed.
//! Status updates go out every second from the transport's own clock, also while this loop
//! waits on Valkey, so the walsender never times out.

use super::ack::AckTracker;
use super::setup::{self, SetupError};
use super::writer::{Writer, WriterEvent};
use crate::backoff::Backoff;
use crate::config::OnSlotLost;
use crate::marker::{sleep_until_opt, MarkerHandle};
use crate::metrics::{Metrics, TargetLabel};
use crate::monitor::HEARTBEAT_PREFIX;
use crate::pgoutput::{
    self, DecodeError, Decoded, OutboxColumn, OutboxInsert, RelationCache, TableName,
};
use crate::postgres::{PgError, PgTarget};
use crate::sink::{Batch, Sink};
use crate::task::{BadRow, RowText, TaskSettings};
use crate::tls::SslMode;
use pgwire_replication::{FeedbackObserver, Lsn, PgWireError, ReplicationClient, ReplicationEvent};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How the stream runs.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    pub slot: String,
    pub publication: String,
    pub table: TableName,
    /// Rows per batch (one Valkey round trip).
    pub batch_rows: usize,
    /// Task bytes per batch.
    pub batch_bytes: usize,
    /// Unconfirmed batches at most.
    pub max_inflight: usize,
    /// How long shutdown waits for in-flight writes.
    pub shutdown_timeout: Duration,
    /// Events buffered between the socket reader and this loop.
    pub buffer_events: usize,
    /// What to do when the slot is missing or invalidated.
    pub on_slot_lost: OnSlotLost,
    /// A walsender holding the slot whose client has been silent this long is a zombie (a cut
    /// connection the server has not noticed): it is terminated so the slot can be taken.
    pub takeover_after: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("replication connection failed")]
    Replication(#[source] PgWireError),
    #[error("could not decode a pgoutput message")]
    Decode(#[source] DecodeError),
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error(transparent)]
    Postgres(#[from] PgError),
    #[error(
        "replication slot {slot:?} is {why}; OUTBOX_ON_SLOT_LOST=stop: events committed while it \
         was gone are only in the table now (run with OUTBOX_ON_SLOT_LOST=recreate, or OUTBOX_MODE=poll)"
    )]
    SlotLost { slot: String, why: &'static str },
}

impl StreamError {
    /// Worth reconnecting for; the rest stops the relay with the error.
    pub fn is_retryable(&self) -> bool {
        match self {
            // A handshake the network cut short (the server restarting) is worth another try;
            // a certificate or protocol refusal is not.
            StreamError::Replication(PgWireError::Tls(msg)) => tls_io_failure(msg),
            StreamError::Replication(PgWireError::Auth(_)) => false,
            StreamError::Replication(_) | StreamError::Decode(_) | StreamError::Postgres(_) => true,
            StreamError::Setup(SetupError::Query(_)) => true,
            StreamError::Setup(_) | StreamError::SlotLost { .. } => false,
        }
    }

    /// Another session holds the slot (another relay replica, or a zombie walsender).
    pub fn slot_in_use(&self) -> bool {
        matches!(self, StreamError::Replication(PgWireError::Server(msg)) if msg.contains("SQLSTATE 55006"))
    }
}

/// pgwire-replication's text for a failed TLS handshake (after the server accepted TLS).
fn tls_handshake_failed(msg: &str) -> bool {
    msg.starts_with("TLS handshake failed:")
}

/// pgwire-replication reports every TLS failure as text; those of the connection itself carry
/// the I/O error's text ("Connection reset by peer (os error 104)", "unexpected end of file").
fn tls_io_failure(msg: &str) -> bool {
    msg.starts_with("TLS handshake failed:")
        && (msg.contains("(os error") || msg.contains("end of file") || msg.contains("eof"))
}

/// The replication stream of one relay.
pub struct Stream<S: Sink> {
    pub pg: PgTarget,
    pub settings: StreamSettings,
    pub tasks: Arc<TaskSettings>,
    pub sink: S,
    pub metrics: Arc<Metrics>,
    /// Marks delivered rows published, when enabled.
    pub marker: Option<MarkerHandle>,
}

/// How a session ended without an error.
enum SessionEnd {
    Shutdown,
    ServerClosed,
}

impl<S: Sink> Stream<S> {
    /// Streams until `shutdown` fires (Ok) or a non-retryable error. Reconnects with capped
    /// exponential backoff, each time resuming from the slot's confirmed position.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), StreamError> {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        let mut standby_logged = false;
        loop {
            let mut streamed = false;
            let result = self.session(&shutdown, &mut streamed).await;
            self.metrics.stream_up.set(0);
            if matches!(result, Ok(SessionEnd::Shutdown)) {
                self.metrics.stream_standby.set(0);
            }
            let standing_by = matches!(&result, Err(e) if e.slot_in_use());
            self.metrics.stream_standby.set(i64::from(standing_by));
            if !standing_by {
                standby_logged = false;
            }
            let delay = match result {
                Ok(SessionEnd::Shutdown) => return Ok(()),
                Err(_) if standing_by => {
                    // Standby: another replica streams. Check often, so takeover is quick.
                    if !standby_logged {
                        tracing::info!(slot = %self.settings.slot, "slot held by another session; standing by");
                        standby_logged = true;
                    }
                    self.reclaim_zombie_slot().await;
                    Duration::from_secs(1)
                }
                Ok(SessionEnd::ServerClosed) => {
                    tracing::warn!("replication stream closed by the server");
                    self.next_delay(&mut backoff, streamed)
                }
                Err(e) if e.is_retryable() => {
                    tracing::warn!(error = %error_chain(&e), "replication stream lost");
                    // A stream that failed on its own data would fail again at once: only
                    // a session that streamed and then lost its connection starts afresh.
                    let fresh = streamed && !matches!(e, StreamError::Decode(_));
                    self.next_delay(&mut backoff, fresh)
                }
                Err(e) => return Err(e),
            };
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// The delay before reconnecting: from the first step again after a session that
    /// streamed (a lost connection), growing while connecting keeps failing.
    fn next_delay(&self, backoff: &mut Backoff, streamed: bool) -> Duration {
        if streamed {
            backoff.reset();
        }
        self.metrics
            .reconnects
            .get_or_create(&TargetLabel { target: "postgres" })
            .inc();
        let delay = backoff.next_delay();
        tracing::info!(
            delay_ms = delay.as_millis() as u64,
            "reconnecting the replication stream"
        );
        delay
    }

    /// Terminates the walsender holding the slot if its client has been silent for longer than
    /// `takeover_after`: a live relay answers every second, so that one is a zombie left by a
    /// cut connection. A live replica is never touched.
    async fn reclaim_zombie_slot(&self) {
        let result = async {
            let client = self.pg.connect().await?;
            let row = client
                .query_opt(
                    "SELECT r.pid, extract(epoch FROM now() - coalesce(r.reply_time, r.backend_start))::float8 \
                     FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid \
                     WHERE s.slot_name = $1",
                    &[&self.settings.slot],
                )
                .await
                .map_err(PgError::from)?;
            let Some(row) = row else { return Ok::<(), StreamError>(()) };
            let (pid, silent): (i32, f64) = (row.get(0), row.get(1));
            if silent >= self.settings.takeover_after.as_secs_f64() {
                tracing::warn!(
                    pid,
                    silent_secs = silent as u64,
                    "terminating a walsender that holds the slot but has not heard from its client \
                     (a zombie after a cut connection)"
                );
                client
                    .execute("SELECT pg_terminate_backend($1)", &[&pid])
                    .await
                    .map_err(PgError::from)?;
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            tracing::debug!(error = %error_chain(&e), "could not check the slot's holder");
        }
    }

    /// The slot's confirmed position. A slot that vanished or was invalidated since start-up
    /// lost events from the stream's view: say so loudly, count it, and recreate it (the
    /// recovery poller delivers those events from the table) or stop, as configured.
    async fn slot_position(&self) -> Result<Lsn, StreamError> {
        let client = self.pg.connect().await?;
        let slot = &self.settings.slot;
        let why = match setup::slot_info(&client, slot).await? {
            Some(info) if info.wal_status.as_deref() != Some("lost") => {
                return Ok(info.confirmed_flush)
            }
            Some(_) => "invalidated (wal_status = lost: the WAL it needed was removed)",
            None => "missing (dropped)",
        };
        self.metrics.slot_lost.inc();
        tracing::error!(
            slot = %slot,
            why,
            "REPLICATION SLOT LOST: events committed while it was gone cannot come from the stream; \
             the recovery poller delivers them from the table"
        );
        if self.settings.on_slot_lost == OnSlotLost::Stop {
            return Err(StreamError::SlotLost {
                slot: slot.clone(),
                why,
            });
        }
        setup::drop_slot(&client, slot).await?;
        let info = setup::ensure_slot(&client, slot).await?;
        tracing::warn!(slot = %slot, lsn = %info.confirmed_flush, "replication slot recreated");
        Ok(info.confirmed_flush)
    }

    async fn session(
        &self,
        shutdown: &CancellationToken,
        streamed: &mut bool,
    ) -> Result<SessionEnd, StreamError> {
        let start = self.slot_position().await?;
        let cfg = self
            .pg
            .replication(&self.settings.slot, &self.settings.publication)
            .with_start_lsn(start)
            .with_ack_lsn(start)
            .with_status_interval(Duration::from_secs(1))
            .with_wakeup_interval(Duration::from_secs(1))
            .with_buffer_size(self.settings.buffer_events)
            // Needed for feedback_pending_since(): the final ack is confirmed sent.
            .with_feedback_observer(FeedbackObserver::new(|_| {}));
        let mut client = match self.start_replication(cfg.clone(), shutdown).await {
            Err(PgWireError::Tls(msg))
                if self.pg.tls().mode == SslMode::Prefer && tls_handshake_failed(&msg) =>
            {
                // As libpq under `prefer`: once more, without TLS.
                self.pg.log_fallback(&msg);
                let plain = cfg.with_tls(pgwire_replication::TlsConfig::disabled());
                self.start_replication(plain, shutdown).await
            }
            other => other,
        }
        .map_err(StreamError::Replication)?;
        if shutdown.is_cancelled() {
            return Ok(SessionEnd::Shutdown);
        }
        tracing::info!(slot = %self.settings.slot, lsn = %start, "replication stream started");
        *streamed = true;
        self.metrics.stream_up.set(1);
        let mut session = Session::new(self, start);
        let end = session.run(&mut client, shutdown).await;
        if matches!(end, Ok(SessionEnd::Shutdown)) {
            session.finish(&mut client).await;
        }
        end
    }
}

impl<S: Sink> Stream<S> {
    /// Opens the replication connection and waits until the stream has started (or shutdown
    /// fires: the client is then returned unstarted, and the caller checks `shutdown`).
    async fn start_replication(
        &self,
        cfg: pgwire_replication::ReplicationConfig,
        shutdown: &CancellationToken,
    ) -> Result<ReplicationClient, PgWireError> {
        let mut client = ReplicationClient::connect(cfg).await?;
        tokio::select! {
            _ = shutdown.cancelled() => {}
            r = client.wait_started() => r?,
        }
        Ok(client)
    }
}

/// State of one replication connection.
struct Session<'a, S: Sink> {
    stream: &'a Stream<S>,
    relations: RelationCache,
    ack: AckTracker,
    /// The LSN last handed to the transport.
    reported: Lsn,
    open: Batch,
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
}

/// A stream that is this far behind its commits (server send time minus commit time) is
/// draining a backlog...
const BEHIND_MICROS: i64 = 50_000;
/// ...so its batches wait until their first row is this old, or full, rather than leaving as
/// soon as nothing more is readable. Behind, the stream often reads faster than the walsender
/// decodes, and sending each short read as its own write costs the relay and Valkey more CPU per
/// event (CPU that, on a shared host, the walsender then lacks). Caught up, nothing waits: a
/// batch leaves as soon as nothing more is readable.
const LINGER: Duration = Duration::from_millis(2);

impl<'a, S: Sink> Session<'a, S> {
    fn new(stream: &'a Stream<S>, start: Lsn) -> Self {
        Self {
            stream,
            relations: RelationCache::new(stream.settings.table.clone()),
            ack: AckTracker::new(start),
            reported: start,
            open: Batch::default(),
            writer: Writer::new(
                stream.sink.clone(),
                stream.settings.max_inflight,
                stream.metrics.clone(),
            ),
            scratch: Vec::with_capacity(4096),
            txn_lsn: Lsn::ZERO,
            txn_commit_micros: 0,
            sent_micros: 0,
            open_since: None,
            linger_at: None,
        }
    }

    /// Whether the stream is draining a backlog.
    fn behind(&self) -> bool {
        self.sent_micros - self.txn_commit_micros > BEHIND_MICROS
    }

    fn open_full(&self) -> bool {
        self.open.len() >= self.stream.settings.batch_rows
            || self.open.bytes >= self.stream.settings.batch_bytes
    }

    async fn run(
        &mut self,
        client: &mut ReplicationClient,
        shutdown: &CancellationToken,
    ) -> Result<SessionEnd, StreamError> {
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(SessionEnd::Shutdown),
                ev = self.writer.next(), if self.writer.busy() => self.on_write(ev, client),
                ev = client.recv(), if !self.open_full() => match ev {
                    Ok(Some(ev)) => self.on_event(ev, client)?,
                    Ok(None) => return Ok(SessionEnd::ServerClosed),
                    Err(e) => return Err(StreamError::Replication(e)),
                },
                // Nothing to read right now: send what is open, unless a write is already under
                // way. Rows then gather while it travels (group commit), so a steady stream
                // makes few, full writes instead of many tiny ones; a full batch goes at once.
                _ = std::future::ready(()), if !self.open.is_empty() && !self.writer.busy() && self.linger_at.is_none() => {
                    match self.open_since {
                        Some(since) if self.behind() => self.linger_at = Some(since + LINGER),
                        _ => self.dispatch(),
                    }
                }
                _ = sleep_until_opt(self.linger_at), if self.linger_at.is_some() && !self.writer.busy() => {
                    self.dispatch();
                }
            }
        }
    }

    fn dispatch(&mut self) {
        self.open_since = None;
        self.linger_at = None;
        let seq = self.ack.seal();
        let batch = std::mem::take(&mut self.open);
        self.writer.send(seq, batch);
    }

    fn report(&mut self, client: &ReplicationClient) {
        let acked = self.ack.acked();
        if acked > self.reported {
            client.update_applied_lsn(acked);
            self.reported = acked;
            self.stream.metrics.acked_lsn.set(acked.0);
        }
    }

    fn on_write(&mut self, ev: WriterEvent, client: &ReplicationClient) {
        match ev {
            WriterEvent::Confirmed {
                seq,
                batch,
                outcome,
            } => {
                let m = &self.stream.metrics;
                m.published
                    .inc_by((outcome.enqueued + outcome.duplicates) as u64);
                m.duplicates.inc_by(outcome.duplicates as u64);
                tracing::debug!(
                    seq,
                    tasks = batch.len(),
                    duplicates = outcome.duplicates,
                    "batch confirmed"
                );
                self.ack.confirmed(seq);
                self.report(client);
                observe_latency(&m.delivery_latency, &batch.commit_times);
                if let Some(marker) = &self.stream.marker {
                    marker.mark(batch.tasks.iter().filter_map(|t| t.row_id).collect());
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
    }

    fn on_event(
        &mut self,
        ev: ReplicationEvent,
        client: &ReplicationClient,
    ) -> Result<(), StreamError> {
        match ev {
            ReplicationEvent::Begin {
                final_lsn,
                commit_time_micros,
                ..
            } => {
                self.txn_lsn = final_lsn;
                self.txn_commit_micros = commit_time_micros + PG_EPOCH_UNIX_MICROS;
                self.ack.begin();
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
                self.ack.commit(end_lsn);
                self.report(client);
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                self.ack.idle_position(wal_end);
                self.report(client);
            }
            ReplicationEvent::Message {
                transactional: false,
                lsn,
                prefix,
                ..
            } => {
                if prefix == HEARTBEAT_PREFIX {
                    self.stream.metrics.health.heartbeat_seen(lsn.0);
                }
                self.ack.idle_position(lsn);
                self.report(client);
            }
            ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
        }
        if self.open_full() && self.writer.can_send() {
            self.dispatch();
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
                            table = %self.stream.settings.table,
                            missing = ?missing.iter().map(|c| c.name()).collect::<Vec<_>>(),
                            "the outbox table lost required columns: its rows cannot become tasks \
                             and stay unpublished until the table is fixed"
                        );
                    }
                }
            }
            Decoded::Insert(row) => self.on_insert(&row),
            Decoded::OtherInsert { .. } | Decoded::Ignored(_) => {}
        }
        Ok(())
    }

    fn on_insert(&mut self, row: &OutboxInsert<'_>) {
        let event_id = row.text(OutboxColumn::EventId).ok().flatten().unwrap_or("");
        let event_name = row
            .text(OutboxColumn::EventName)
            .ok()
            .flatten()
            .unwrap_or("");
        let built =
            row_text(row).and_then(|text| self.stream.tasks.build(&text, &mut self.scratch));
        match built {
            Ok(task) => {
                if self.open.is_empty() {
                    self.open_since = Some(Instant::now());
                }
                self.open.push_committed(task, self.txn_commit_micros);
                self.ack.row();
            }
            Err(bad) => {
                tracing::warn!(
                    event_id,
                    event_name,
                    lsn = %self.txn_lsn,
                    reason = %bad,
                    "row cannot become a task; left unpublished for the recovery path"
                );
                self.stream.metrics.bad_row(event_name, bad.reason());
            }
        }
    }

    /// Graceful end: send what is open, wait (bounded) for in-flight writes, send the final
    /// acknowledgement and make sure it reached the server.
    async fn finish(&mut self, client: &mut ReplicationClient) {
        if !self.open.is_empty() {
            self.dispatch();
        }
        let deadline = Instant::now() + self.stream.settings.shutdown_timeout;
        while self.writer.busy() {
            tokio::select! {
                ev = self.writer.next() => {
                    if let WriterEvent::Failed { error, .. } = ev {
                        tracing::warn!(error = %error_chain(&error), "write failed during shutdown; abandoning in-flight batches (they will be replayed)");
                        break;
                    }
                    self.on_write(ev, client);
                }
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!("shutdown deadline reached; abandoning in-flight batches (they will be replayed)");
                    break;
                }
            }
        }
        self.report(client);
        let sent_by = Instant::now() + Duration::from_secs(3);
        while client.feedback_pending_since().is_some() && Instant::now() < sent_by {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tracing::info!(lsn = %self.ack.acked(), "final acknowledgement sent");
        let _ = tokio::time::timeout(Duration::from_secs(3), client.shutdown()).await;
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

/// An error and its causes on one line, for logs.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_failures_of_the_network_are_retried_and_refusals_are_not() {
        let tls = |m: &str| StreamError::Replication(PgWireError::Tls(m.into()));
        assert!(
            tls("TLS handshake failed: Connection reset by peer (os error 104)").is_retryable()
        );
        assert!(tls("TLS handshake failed: unexpected end of file").is_retryable());
        assert!(
            !tls("TLS handshake failed: invalid peer certificate: UnknownIssuer").is_retryable()
        );
        assert!(!tls("server does not support TLS (SSLRequest rejected)").is_retryable());
        assert!(!tls("TLS config error: failed to open CA PEM '/x': No such file").is_retryable());
    }
}
