//! The slot and its connections on a real server: [`PgSlot`] implements [`SlotPort`] with
//! tokio-postgres (the slot's SQL) and pgwire-replication (the stream), and
//! `ReplicationClient` is the [`ReplicationSource`].

use super::publication::PublicationGone;
use super::setup;
use super::source::{ReplicationSource, SlotHolder, SlotPort, SlotState};
use super::stream::StreamError;
use crate::postgres::{PgError, PgTarget};
use crate::tls::SslMode;
use pgwire_replication::{
    FeedbackObserver, Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent,
};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the connection sends a status update on its own (also while the session waits on
/// Valkey), and wakes to do so. Well under the server's `wal_sender_timeout`.
const STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// How long the busy probe may take (it runs while the session waits on it).
const BUSY_PROBE_LIMIT: Duration = Duration::from_secs(5);
/// The probe looks this many times, this far apart: busy in every look with its sent position
/// unmoved means inside one record (see `liveness::busy_inside_one_record`).
const BUSY_PROBE_LOOKS: usize = 3;
const BUSY_PROBE_SPACING: Duration = Duration::from_millis(100);

/// A started replication connection on a real server, with what it needs to ask the server
/// about its walsender.
pub struct PgSource {
    client: ReplicationClient,
    /// The slot's server, over SQL.
    pg: PgTarget,
    slot: String,
}

impl PgSource {
    /// The walsender holding the slot, as the server shows it: its wait event and sent
    /// position; `Ok(None)` when no walsender holds the slot or this role cannot see it.
    async fn look(
        &self,
        client: &tokio_postgres::Client,
    ) -> Result<Option<(Option<String>, String)>, PgError> {
        let row = client
            .query_opt(
                "SELECT a.wait_event, r.sent_lsn::text FROM pg_replication_slots s \
                 JOIN pg_stat_replication r ON r.pid = s.active_pid \
                 JOIN pg_stat_activity a ON a.pid = r.pid \
                 WHERE s.slot_name = $1 AND a.state IS NOT NULL AND r.sent_lsn IS NOT NULL",
                &[&self.slot],
            )
            .await?;
        Ok(row.map(|r| (r.get(0), r.get(1))))
    }
}

impl ReplicationSource for PgSource {
    async fn recv(&mut self) -> Result<Option<ReplicationEvent>, PgWireError> {
        self.client.recv().await
    }

    fn update_applied_lsn(&self, lsn: Lsn) {
        self.client.update_applied_lsn(lsn)
    }

    fn feedback_pending(&self) -> bool {
        self.client.feedback_pending_since().is_some()
    }

    async fn shutdown(&mut self) {
        let _ = self.client.shutdown().await;
    }

    async fn walsender_busy(&self) -> Option<bool> {
        let probe = async {
            let client = self.pg.connect().await?;
            let mut looks = Vec::with_capacity(BUSY_PROBE_LOOKS);
            for look in 0..BUSY_PROBE_LOOKS {
                if look > 0 {
                    tokio::time::sleep(BUSY_PROBE_SPACING).await;
                }
                match self.look(&client).await? {
                    Some(seen) => looks.push(seen),
                    // Nobody holds the slot (or not visibly): this connection's walsender is gone.
                    None => return Ok(false),
                }
            }
            Ok::<bool, PgError>(super::liveness::busy_inside_one_record(
                looks.iter().map(|(w, lsn)| (w.as_deref(), lsn.as_str())),
            ))
        };
        match tokio::time::timeout(BUSY_PROBE_LIMIT.min(self.pg.link_timeout()), probe).await {
            Ok(Ok(busy)) => Some(busy),
            Ok(Err(e)) => {
                tracing::warn!(error = %crate::error_chain::error_chain(&e), "could not ask the server about the silent replication connection's walsender");
                None
            }
            Err(_) => {
                tracing::warn!("the server did not say in time what the silent replication connection's walsender is doing");
                None
            }
        }
    }
}

/// One slot on one server.
pub struct PgSlot {
    pub pg: PgTarget,
    pub slot: String,
    pub publication: String,
    /// The outbox table (a missing publication is created for it again).
    pub table: crate::pgoutput::TableName,
    /// The primary, when `pg` is a standby that decodes (OUTBOX_REPLICATION_URL): a missing
    /// publication is created there, as a standby is read-only.
    pub primary: Option<PgTarget>,
    /// Events buffered between the socket reader and the session.
    pub buffer_events: usize,
    /// The publication's identity as [`SlotPort::publication_gone`] first found it (see
    /// [`super::publication::changed`]).
    pub first_publication: std::sync::Mutex<Option<super::publication::PublicationIdentity>>,
}

impl PgSlot {
    async fn start(
        &self,
        cfg: ReplicationConfig,
        shutdown: &CancellationToken,
    ) -> Result<Option<ReplicationClient>, PgWireError> {
        let mut client = ReplicationClient::connect(cfg).await?;
        // Bounded: a black-holed link would leave the start waiting for ever.
        let limit = self.pg.link_timeout();
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(None),
            r = tokio::time::timeout(limit, client.wait_started()) => match r {
                Ok(started) => started?,
                Err(_) => {
                    client.abort();
                    return Err(PgWireError::Io(std::sync::Arc::new(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("replication connection not started within {limit:?} (OUTBOX_LINK_TIMEOUT)"),
                    ))));
                }
            },
        }
        Ok(Some(client))
    }
}

/// pgwire-replication's text for a TLS handshake that failed after the server accepted TLS:
/// under `sslmode=prefer`, libpq then tries again without TLS.
fn tls_refused_after_accept(msg: &str) -> bool {
    msg.starts_with("TLS handshake failed:")
}

impl SlotPort for PgSlot {
    type Source = PgSource;

    fn publication(&self) -> &str {
        &self.publication
    }

    async fn state(&self) -> Result<SlotState, StreamError> {
        let client = self.pg.connect().await?;
        Ok(match setup::slot_info(&client, &self.slot).await? {
            Some(info) if info.wal_status.as_deref() == Some("lost") => SlotState::Invalidated,
            Some(info) => SlotState::Ready(info.confirmed_flush),
            None => SlotState::Missing,
        })
    }

    async fn restore_publication(&self) -> Result<bool, StreamError> {
        let client = self.primary.as_ref().unwrap_or(&self.pg).connect().await?;
        Ok(setup::restore_publication(&client, &self.publication, &self.table).await?)
    }

    async fn publication_gone(&self) -> Result<Option<PublicationGone>, StreamError> {
        let client = self.primary.as_ref().unwrap_or(&self.pg).connect().await?;
        let checked = setup::check_publication(&client, &self.publication, &self.table).await;
        if let Some(gone) = super::publication::gone(checked)? {
            return Ok(Some(gone));
        }
        let Some(now) =
            setup::publication_identity(&client, &self.publication, &self.table).await?
        else {
            // Dropped between the two queries.
            return Ok(Some(PublicationGone::Dropped));
        };
        let mut first = self
            .first_publication
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Ok(super::publication::changed(&mut first, now))
    }

    async fn recreate(&self) -> Result<Lsn, StreamError> {
        if let Some(primary) = &self.primary {
            let info = super::standby::recreate_slot(
                primary,
                &self.pg,
                &self.slot,
                &self.publication,
                &self.table,
            )
            .await?;
            return Ok(info.confirmed_flush);
        }
        let client = self.pg.connect().await?;
        let (info, _) =
            super::publication::recreate_slot(&client, &self.slot, &self.publication, &self.table)
                .await?;
        Ok(info.confirmed_flush)
    }

    async fn open(
        &self,
        start: Lsn,
        shutdown: &CancellationToken,
    ) -> Result<Option<PgSource>, StreamError> {
        let cfg = self
            .pg
            .replication(&self.slot, &self.publication)
            .with_start_lsn(start)
            // Nothing confirmed until the session acknowledges: a first status update carrying
            // `start` would set the slot back to it if the server forwarded the start to a
            // slot recreated since (servers without the guard against moving confirmed_flush
            // backwards), and the check at the session's start would then see nothing (found
            // by review). The server ignores an invalid flush position.
            .with_ack_lsn(Lsn::ZERO)
            .with_status_interval(STATUS_INTERVAL)
            .with_wakeup_interval(STATUS_INTERVAL)
            // Each idle wakeup asks the walsender for a keepalive: proof the link lives.
            .with_reply_requested_when_idle(true)
            // A status update goes out every second, so on a black-holed link the kernel has
            // unacknowledged data within a second and gives up after this long, whatever the
            // receive deadline (which a busy walsender extends, see `walsender_busy`).
            .with_tcp_user_timeout(self.pg.link_timeout())
            .with_buffer_size(self.buffer_events)
            // Needed for feedback_pending_since(): the final ack is confirmed sent.
            .with_feedback_observer(FeedbackObserver::new(|_| {}));
        match self.start(cfg.clone(), shutdown).await {
            Err(PgWireError::Tls(msg))
                if self.pg.tls().mode == SslMode::Prefer && tls_refused_after_accept(&msg) =>
            {
                // As libpq under `prefer`: once more, without TLS.
                self.pg.log_fallback(&msg);
                let plain = cfg.with_tls(pgwire_replication::TlsConfig::disabled());
                self.start(plain, shutdown).await
            }
            other => other,
        }
        .map(|client| {
            client.map(|client| PgSource {
                client,
                pg: self.pg.clone(),
                slot: self.slot.clone(),
            })
        })
        .map_err(StreamError::Replication)
    }

    async fn holder(&self) -> Result<Option<SlotHolder>, StreamError> {
        let client = self.pg.connect().await?;
        // reply_time is visible to superusers and members of pg_read_all_stats only; for other
        // roles it reads NULL even for a live walsender, which must not look silent.
        let row = client
            .query_opt(
                "SELECT r.pid, r.reply_time::text, pg_has_role('pg_read_all_stats', 'USAGE'), \
                 a.wait_event, r.sent_lsn::text, r.application_name = $2 \
                 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid \
                 LEFT JOIN pg_stat_activity a ON a.pid = r.pid \
                 WHERE s.slot_name = $1",
                &[&self.slot, &crate::postgres::APPLICATION_NAME],
            )
            .await
            .map_err(PgError::from)?;
        Ok(row.map(|r| SlotHolder {
            pid: r.get(0),
            reply_time: r.get(1),
            can_see_replies: r.get(2),
            busy: super::liveness::walsender_busy(r.get::<_, Option<&str>>(3)),
            sent_lsn: r.get(4),
            relay: r.get::<_, Option<bool>>(5).unwrap_or(false),
        }))
    }

    async fn terminate(&self, pid: i32) -> Result<(), StreamError> {
        let client = self.pg.connect().await?;
        client
            .execute("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .map_err(PgError::from)?;
        Ok(())
    }

    async fn observe(&self) -> Option<super::slot_watch::Observation> {
        let client = self.pg.connect().await.ok()?;
        match super::slot_watch::observe(&client, &self.slot).await {
            Ok(o) => o,
            Err(e) => {
                tracing::debug!(error = %e, "could not check the slot's identity");
                None
            }
        }
    }
}
