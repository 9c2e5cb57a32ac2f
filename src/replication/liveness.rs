//! When the replication connection counts as dead. PURE: fed with instants, no I/O, no clock.
//!
//! A link that is black-holed (a dropped route, a firewall forgetting the flow) sends no FIN or
//! RST: the socket stays open and reads simply wait. The kernel gives up only at its
//! retransmission limit (about 15 minutes), and only while the relay has unacknowledged data
//! in flight. So the session keeps its own deadline.
//!
//! Silence alone proves nothing on an idle server: the walsender sends nothing when it has
//! nothing to send and the client has confirmed everything. That is why the replication
//! client asks for a reply with every status update it sends after a second without a message
//! (`ReplicationConfig::with_reply_requested_when_idle`, a change to the vendored client, see
//! vendor/pgwire-replication/VENDORED.md): the walsender answers each with a keepalive at once.
//! A live link therefore carries a message at least every second or two, and a link that
//! carries nothing for [`Liveness::timeout`] is dead.
//!
//! The deadline only runs while the session reads. When the session stops reading (its open
//! batch is full and waits for Valkey), the client stops reading the socket too, and the
//! silence that follows is the relay's own backpressure, not the link's: the clock is paused,
//! and on resuming the silence counts afresh.
//!
//! A live link can still be silent for longer: while the walsender replays a committed
//! transaction whose changes the publication filters out (a bulk change of a business table
//! with the outbox row at its end: the outbox pattern itself), it sends nothing and reads the
//! client's status updates only every `wal_sender_timeout / 2` (PostgreSQL's
//! `WalSndUpdateProgress`); on PostgreSQL 14 and 15 it reads none at all while it replays a
//! table rewrite (`ALTER TABLE ... TYPE`), however long that takes. Silence cannot tell that
//! from a dead link, so when the deadline passes the session asks the server, over an SQL
//! connection, what the walsender holding the slot is doing
//! ([`super::source::ReplicationSource::walsender_busy`], [`busy_inside_one_record`]): busy
//! inside one WAL record (as while it replays one commit), the link lives and the count starts
//! again; reading status updates (waiting, or decoding record after record), it would have
//! answered a live client, so the link gets one more deadline (an answer may have crossed the
//! probe) and is then dead, as it is when the server does not answer. A link black-holed in
//! the kernel is found by `TCP_USER_TIMEOUT` in any case: a status update goes out every second.

use std::time::{Duration, Instant};

/// Whether a walsender whose `pg_stat_activity.wait_event` is `wait_event` is busy decoding:
/// no wait event (on the CPU) or one that is not a walsender's wait for its client or for WAL
/// (`WalSenderMain`, `WalSenderWaitForWAL`, `WalSenderWriteData`; spelled differently across
/// versions, hence the prefix).
pub fn walsender_busy(wait_event: Option<&str>) -> bool {
    match wait_event {
        None => true,
        Some(e) => {
            !(e.to_ascii_lowercase().starts_with("walsender") || WAITING_EVENTS.contains(&e))
        }
    }
}

/// Other wait events of a walsender that waits rather than decodes: for the standbys of
/// `synchronized_standby_slots` (a failover slot, PostgreSQL 17+), or on its client's socket.
const WAITING_EVENTS: [&str; 3] = ["WaitForStandbyConfirmation", "ClientWrite", "ClientRead"];

/// Whether looks at a walsender, each its wait event and its `sent_lsn`, show it busy INSIDE one
/// WAL record: busy in every look, and its sent position unmoved. Only then does it read no
/// status update: between records (decoding WAL as it comes, even WAL the publication filters)
/// it reads them, and a client it does not answer is gone.
pub fn busy_inside_one_record<'a>(
    looks: impl IntoIterator<Item = (Option<&'a str>, &'a str)>,
) -> bool {
    let mut first: Option<&str> = None;
    for (wait_event, sent_lsn) in looks {
        if !walsender_busy(wait_event) || first.is_some_and(|f| f != sent_lsn) {
            return false;
        }
        first.get_or_insert(sent_lsn);
    }
    first.is_some()
}

/// The receive deadline of one replication session.
#[derive(Debug, Clone)]
pub struct Liveness {
    timeout: Duration,
    /// When the last message arrived, or when reading (re)started.
    heard: Instant,
    /// Set while the session does not read: the silence does not count.
    paused: bool,
}

impl Liveness {
    /// A session that starts reading at `now`.
    pub fn new(timeout: Duration, now: Instant) -> Self {
        Self {
            timeout,
            heard: now,
            paused: false,
        }
    }

    /// How long the link may stay silent while read.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A message (data, keepalive, anything) arrived at `now`.
    pub fn heard(&mut self, now: Instant) {
        self.heard = self.heard.max(now);
    }

    /// Whether the session reads (`true`) or holds off because of its own backpressure.
    /// Resuming restarts the silence count at `now`.
    pub fn reading(&mut self, reading: bool, now: Instant) {
        if self.paused && reading {
            self.heard = self.heard.max(now);
        }
        self.paused = !reading;
    }

    /// When the link counts as dead if nothing arrives; `None` while paused.
    pub fn deadline(&self) -> Option<Instant> {
        (!self.paused).then(|| self.heard + self.timeout)
    }

    /// How long the link has been silent at `now`, if that is long enough to call it dead.
    pub fn dead(&self, now: Instant) -> Option<Duration> {
        let deadline = self.deadline()?;
        (now >= deadline).then(|| now.saturating_duration_since(self.heard))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(10);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_walsender_waiting_for_its_client_or_for_wal_is_not_busy() {
        for waiting in [
            "WalSenderMain",
            "WalSenderWaitForWAL",
            "WalSenderWaitForWal",
            "WalSenderWriteData",
            "WaitForStandbyConfirmation",
            "ClientWrite",
            "ClientRead",
        ] {
            assert!(!walsender_busy(Some(waiting)), "{waiting}");
        }
        // On the CPU (decoding, replaying), or reading spilled changes or WAL from disk.
        for busy in [
            None,
            Some("ReorderBufferRead"),
            Some("WALRead"),
            Some("DataFileRead"),
            Some("WALWrite"),
        ] {
            assert!(walsender_busy(busy), "{busy:?}");
        }
    }

    #[test]
    fn only_a_walsender_busy_inside_one_record_excuses_silence() {
        let replaying = [
            (None, "0/100"),
            (Some("ReorderBufferRead"), "0/100"),
            (None, "0/100"),
        ];
        assert!(busy_inside_one_record(replaying));
        // Decoding record after record (its sent position moves): it reads replies meanwhile.
        assert!(!busy_inside_one_record([
            (None, "0/100"),
            (None, "0/200"),
            (None, "0/300")
        ]));
        // Waiting in any one look.
        assert!(!busy_inside_one_record([
            (None, "0/100"),
            (Some("WalSenderMain"), "0/100")
        ]));
        assert!(!busy_inside_one_record(std::iter::empty()));
    }

    #[test]
    fn silence_longer_than_the_timeout_is_death() {
        let t0 = Instant::now();
        let l = Liveness::new(T, t0);
        assert_eq!(l.deadline(), Some(t0 + T));
        assert_eq!(l.dead(t0 + secs(9)), None);
        assert_eq!(l.dead(t0 + T), Some(T));
        assert_eq!(l.dead(t0 + secs(25)), Some(secs(25)));
    }

    #[test]
    fn each_message_moves_the_deadline() {
        let t0 = Instant::now();
        let mut l = Liveness::new(T, t0);
        for s in 1..=30 {
            l.heard(t0 + secs(s));
            assert_eq!(l.dead(t0 + secs(s) + secs(9)), None);
        }
        assert_eq!(l.deadline(), Some(t0 + secs(40)));
        // A late report of an older message never moves the deadline back.
        l.heard(t0 + secs(3));
        assert_eq!(l.deadline(), Some(t0 + secs(40)));
    }

    #[test]
    fn backpressure_pauses_the_clock_and_resuming_restarts_it() {
        let t0 = Instant::now();
        let mut l = Liveness::new(T, t0);
        l.reading(false, t0 + secs(5));
        assert_eq!(l.deadline(), None);
        assert_eq!(
            l.dead(t0 + secs(600)),
            None,
            "paused: not reading is not death"
        );
        l.reading(true, t0 + secs(600));
        assert_eq!(l.dead(t0 + secs(609)), None);
        assert_eq!(l.dead(t0 + secs(610)), Some(T));
        // Staying in the reading state does not restart the count.
        l.reading(true, t0 + secs(605));
        assert_eq!(l.deadline(), Some(t0 + secs(610)));
    }
}
