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
//! One silence of a live link is longer than a second, and the server sets its length: while
//! the walsender replays a committed transaction whose changes the publication filters out (a
//! bulk change of a business table with the outbox row at its end: the outbox pattern itself),
//! it sends nothing and reads the client's status updates, answering their reply requests,
//! only every `wal_sender_timeout / 2` (PostgreSQL's `WalSndUpdateProgress`, which calls
//! `ProcessPendingWrites` no sooner than that after the last reply it processed). A deadline
//! shorter than that takes the replay for a dead link, and the next session decodes the same
//! transaction again, for ever. [`silence_bound`] is therefore never shorter than three
//! quarters of the server's `wal_sender_timeout`: the longest silence of a live link plus a
//! quarter of it as a margin. The same bound holds for a standby judging the slot's holder by
//! its `reply_time` ([`super::takeover`]), which stops changing for as long.

use std::time::{Duration, Instant};

/// The silence a live replication link can show on a server whose walsenders run with
/// `wal_sender_timeout` (`None`: unknown; zero: off, and then the walsender reads replies
/// between any two changes): the `configured` bound, raised to three quarters of the timeout.
pub fn silence_bound(configured: Duration, wal_sender_timeout: Option<Duration>) -> Duration {
    match wal_sender_timeout {
        Some(w) if !w.is_zero() => configured.max(w * 3 / 4),
        _ => configured,
    }
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
    fn the_bound_covers_the_walsenders_longest_silence() {
        let w = |s: u64| Some(secs(s));
        // PostgreSQL's default 60 s: a filtered replay is silent for up to 30 s.
        assert_eq!(silence_bound(secs(30), w(60)), secs(45));
        assert_eq!(silence_bound(secs(1), w(4)), secs(3));
        // A configured bound already above it stays.
        assert_eq!(silence_bound(secs(60), w(60)), secs(60));
        // Off (0) or unknown: the walsender's silence is not bounded by it; configured only.
        assert_eq!(silence_bound(secs(30), w(0)), secs(30));
        assert_eq!(silence_bound(secs(30), None), secs(30));
        // Always strictly above half the timeout, the silence the replay can show.
        for t in [1u64, 4, 7, 60, 600] {
            assert!(silence_bound(secs(1), w(t)) > secs(t) / 2);
        }
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
