//! What `/readyz` answers from: the dependencies' last observed state (the monitor refreshes
//! it) and the heartbeats the stream has not yet seen come back.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Shared liveness state. All methods are cheap and never block on I/O.
#[derive(Debug, Default)]
pub struct Health {
    postgres_ok: AtomicBool,
    valkey_ok: AtomicBool,
    /// Set once the relay runs; `/readyz` is false before.
    running: AtomicBool,
    /// In stream mode the stream must be up to be ready.
    needs_stream: AtomicBool,
    /// Heartbeats emitted and not yet seen on the stream: (LSN, when).
    unseen: Mutex<VecDeque<(u64, Instant)>>,
    /// The newest heartbeat LSN the stream delivered.
    seen: AtomicU64,
    /// Per writer (the stream, the pollers), since when its every Valkey write has failed
    /// (`None`: its last one succeeded). A Valkey that answers PING but refuses writes
    /// (maxmemory with noeviction, a replica) would otherwise look healthy; and one writer's
    /// successes do not hide the other's failures (a stream stuck on one shard while the
    /// poller delivers to the others).
    writes_failing_since: [Mutex<Option<Instant>>; 2],
}

/// Who wrote to Valkey, for readiness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    Stream = 0,
    Poller = 1,
}

/// Valkey writes failing without a success for this long make `/readyz` report not ready
/// (docs/observability.md). Long enough that one outage retried with backoff does not flap it.
pub const WRITES_FAILING_NOT_READY: Duration = Duration::from_secs(30);

/// Why the relay is not ready.
pub type NotReady = Vec<&'static str>;

impl Health {
    /// Records whether Postgres answered; returns what was recorded before.
    pub fn set_postgres(&self, ok: bool) -> bool {
        self.postgres_ok.swap(ok, Ordering::Relaxed)
    }

    /// Records whether Valkey answered; returns what was recorded before.
    pub fn set_valkey(&self, ok: bool) -> bool {
        self.valkey_ok.swap(ok, Ordering::Relaxed)
    }

    pub fn set_running(&self, running: bool, needs_stream: bool) {
        self.needs_stream.store(needs_stream, Ordering::Relaxed);
        self.running.store(running, Ordering::Relaxed);
    }

    /// A Valkey write of `by` failed (it is retried).
    pub fn write_failed(&self, by: Writer) {
        self.write_failed_at(by, Instant::now());
    }

    fn write_failed_at(&self, by: Writer, now: Instant) {
        let mut since = self.writes_failing_since[by as usize]
            .lock()
            .expect("health lock");
        since.get_or_insert(now);
    }

    /// A Valkey write of `by` succeeded.
    pub fn write_succeeded(&self, by: Writer) {
        *self.writes_failing_since[by as usize]
            .lock()
            .expect("health lock") = None;
    }

    /// Whether some writer's last Valkey write failed (and nothing cleared it since).
    pub fn writes_failing(&self) -> bool {
        self.writes_failing_for(Instant::now()).is_some()
    }

    /// How long some writer's Valkey writes have failed without one succeeding, at `now`.
    fn writes_failing_for(&self, now: Instant) -> Option<Duration> {
        self.writes_failing_since
            .iter()
            .filter_map(|since| *since.lock().expect("health lock"))
            .map(|s| now.saturating_duration_since(s))
            .max()
    }

    /// A heartbeat message was written at `lsn`.
    pub fn heartbeat_emitted(&self, lsn: u64) {
        let mut q = self.unseen.lock().expect("health lock");
        if q.len() >= 1024 {
            q.pop_front();
        }
        q.push_back((lsn, Instant::now()));
    }

    /// The stream delivered a heartbeat message at `lsn`.
    pub fn heartbeat_seen(&self, lsn: u64) {
        self.seen.fetch_max(lsn, Ordering::Relaxed);
    }

    /// How long the oldest heartbeat the stream has not delivered has been waiting.
    pub fn heartbeat_wait(&self) -> Option<Duration> {
        let seen = self.seen.load(Ordering::Relaxed);
        let mut q = self.unseen.lock().expect("health lock");
        while q.front().is_some_and(|(lsn, _)| *lsn <= seen) {
            q.pop_front();
        }
        q.front().map(|(_, at)| at.elapsed())
    }

    /// `Ok` when the relay can deliver; otherwise the reasons.
    pub fn ready(&self, stream_up: bool, stalled: bool) -> Result<(), NotReady> {
        self.ready_at(Instant::now(), stream_up, stalled)
    }

    fn ready_at(&self, now: Instant, stream_up: bool, stalled: bool) -> Result<(), NotReady> {
        let mut why = Vec::new();
        if !self.running.load(Ordering::Relaxed) {
            why.push("not running");
        }
        if !self.postgres_ok.load(Ordering::Relaxed) {
            why.push("postgres unreachable");
        }
        if !self.valkey_ok.load(Ordering::Relaxed) {
            why.push("valkey unreachable");
        }
        if self.needs_stream.load(Ordering::Relaxed) && !stream_up {
            why.push("replication stream down");
        }
        if stalled {
            why.push("stream stalled (heartbeats not coming back)");
        }
        if self
            .writes_failing_for(now)
            .is_some_and(|d| d >= WRITES_FAILING_NOT_READY)
        {
            why.push("valkey writes failing (none succeeded for 30 s)");
        }
        if why.is_empty() {
            Ok(())
        } else {
            Err(why)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_needs_every_dependency() {
        let h = Health::default();
        assert!(h.ready(true, false).is_err());
        h.set_running(true, true);
        h.set_postgres(true);
        h.set_valkey(true);
        assert!(h.ready(true, false).is_ok());
        assert_eq!(
            h.ready(false, false).unwrap_err(),
            vec!["replication stream down"]
        );
        h.set_valkey(false);
        assert_eq!(h.ready(true, true).unwrap_err().len(), 2);
    }

    #[test]
    fn writes_failing_for_long_make_it_not_ready() {
        let h = Health::default();
        h.set_running(true, false);
        h.set_postgres(true);
        h.set_valkey(true);
        let t0 = Instant::now();
        h.write_failed_at(Writer::Stream, t0);
        assert!(
            h.ready_at(t0, false, false).is_ok(),
            "one failure is retried"
        );
        // Later failures do not move the start of the failing period.
        h.write_failed_at(Writer::Stream, t0 + WRITES_FAILING_NOT_READY / 2);
        let late = t0 + WRITES_FAILING_NOT_READY;
        assert_eq!(
            h.ready_at(late, false, false).unwrap_err(),
            vec!["valkey writes failing (none succeeded for 30 s)"]
        );
        // The poller delivering to healthy queues does not hide the stream's failures.
        h.write_succeeded(Writer::Poller);
        assert!(h.ready_at(late, false, false).is_err());
        h.write_succeeded(Writer::Stream);
        assert!(h.ready_at(late, false, false).is_ok());
    }

    #[test]
    fn heartbeats_are_waited_for_until_seen() {
        let h = Health::default();
        assert!(h.heartbeat_wait().is_none());
        h.heartbeat_emitted(10);
        h.heartbeat_emitted(20);
        assert!(h.heartbeat_wait().is_some());
        h.heartbeat_seen(10);
        assert!(h.heartbeat_wait().is_some(), "20 is still unseen");
        h.heartbeat_seen(25);
        assert!(h.heartbeat_wait().is_none());
    }
}
