//! The two I/O edges of the stream, as small traits: one replication connection
//! ([`ReplicationSource`]) and the slot it reads ([`SlotPort`]: its state, recreating it,
//! opening a connection, and the session holding it). [`super::pg_slot`] implements them with
//! pgwire-replication and tokio-postgres; the simulation (`crate::sim`) in memory.

use super::publication::PublicationGone;
use super::stream::StreamError;
use pgwire_replication::{Lsn, PgWireError, ReplicationEvent};
use std::future::Future;
use tokio_util::sync::CancellationToken;

/// One started replication connection.
pub trait ReplicationSource: Send {
    /// The next event; `Ok(None)` when the server closed the stream. Cancel-safe.
    fn recv(
        &mut self,
    ) -> impl Future<Output = Result<Option<ReplicationEvent>, PgWireError>> + Send;

    /// Everything up to `lsn` is delivered: report it as the flush position (the connection
    /// sends it with its next status update).
    fn update_applied_lsn(&self, lsn: Lsn);

    /// A position given to [`update_applied_lsn`](Self::update_applied_lsn) has not yet been
    /// sent to the server.
    fn feedback_pending(&self) -> bool;

    /// Closes the connection (bounded by the caller).
    fn shutdown(&mut self) -> impl Future<Output = ()> + Send;

    /// Asked when the connection has been silent for the whole receive deadline: whether the
    /// walsender behind it is busy decoding (and so reads no status update), as the server
    /// says over another connection (see [`super::liveness`]). `None`: unknown, or no answer
    /// in time (the default: a source that is silent only when its link is dead).
    fn walsender_busy(&self) -> impl Future<Output = Option<bool>> + Send {
        async { None }
    }
}

/// The slot as the database has it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Usable, confirmed up to this position.
    Ready(Lsn),
    /// `wal_status = lost`: the WAL it needed was removed.
    Invalidated,
    /// No such slot (dropped, or never created on this server, e.g. after a failover).
    Missing,
}

/// The session that holds the slot, as another relay sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotHolder {
    /// The walsender's pid.
    pub pid: i32,
    /// Its client's last status update time, as text (`pg_stat_replication.reply_time`);
    /// `None` before the first reply, or when this role may not see it.
    pub reply_time: Option<String>,
    /// Whether this role can see `reply_time` (superuser or `pg_read_all_stats`).
    pub can_see_replies: bool,
    /// Whether the walsender is busy decoding (see [`super::liveness::walsender_busy`]): it
    /// then reads no status update, and an unchanged `reply_time` proves nothing.
    pub busy: bool,
    /// Its `pg_stat_replication.sent_lsn`, as text: a busy walsender whose sent position moves
    /// decodes record after record, reading status updates between them.
    pub sent_lsn: Option<String>,
    /// Whether it is an outbox-relay's (its `application_name`): another replica, which
    /// delivers what it acknowledges, or this relay's own leftover; not a foreign consumer.
    pub relay: bool,
}

/// The replication slot and the connections to it.
pub trait SlotPort: Send + Sync {
    type Source: ReplicationSource;

    /// The publication the slot streams (named in the walsender's errors).
    fn publication(&self) -> &str;

    fn state(&self) -> impl Future<Output = Result<SlotState, StreamError>> + Send;

    /// Checks that the publication exists and publishes the outbox table's inserts, and creates
    /// it when it is missing (on the primary: a standby is read-only). `Ok(true)` when this call
    /// created it. The default: a publication that cannot go missing (the simulation's).
    fn restore_publication(&self) -> impl Future<Output = Result<bool, StreamError>> + Send {
        async { Ok(false) }
    }

    /// Whether the publication no longer streams the outbox table's inserts now (checked on the
    /// primary), without repairing it: dropped, or altered so that it leaves the table, its
    /// inserts or some of its rows or columns out. For a relay configured to stop rather than
    /// skip events (`OUTBOX_ON_SLOT_LOST=stop`). The default: a publication that cannot change
    /// (the simulation's).
    fn publication_gone(
        &self,
    ) -> impl Future<Output = Result<Option<PublicationGone>, StreamError>> + Send {
        async { Ok(None) }
    }

    /// Drops the slot if it exists and creates it again; returns its new position.
    fn recreate(&self) -> impl Future<Output = Result<Lsn, StreamError>> + Send;

    /// Starts streaming from `start`. `Ok(None)` when `shutdown` fired first.
    fn open(
        &self,
        start: Lsn,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Result<Option<Self::Source>, StreamError>> + Send;

    /// The session holding the slot, if any.
    fn holder(&self) -> impl Future<Output = Result<Option<SlotHolder>, StreamError>> + Send;

    /// Terminates the walsender `pid` (a zombie holding the slot).
    fn terminate(&self, pid: i32) -> impl Future<Output = Result<(), StreamError>> + Send;

    /// The slot's server and position before a session, for [`super::slot_watch`]; None when
    /// unknown (the default: an implementation without a server identity).
    fn observe(&self) -> impl Future<Output = Option<super::slot_watch::Observation>> + Send {
        async { None }
    }
}
