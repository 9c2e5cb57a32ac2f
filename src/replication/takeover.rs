//! When a standby relay may take the slot from the session holding it. Pure: fed with what the
//! standby observes and when (its own monotonic clock), it answers whether the holder is a
//! zombie.
//!
//! A live relay sends a status update every second, and each carries a new `reply_time`. A
//! walsender whose `reply_time` has not changed for `takeover_after`, as this standby observed it,
//! has lost its client (a cut connection the server has not noticed yet): terminating it lets the
//! slot be taken. The decision never compares the database's clock with the time the other relay
//! wrote (the hosts' clocks may disagree). A role that cannot see `reply_time` (neither superuser
//! nor a member of `pg_read_all_stats`) never takes over: it waits for the server's
//! `wal_sender_timeout` to end the zombie instead, because a live holder would look silent.
//! Nor does a holder busy decoding count as silent: while it replays a transaction the
//! publication filters (or, on PostgreSQL 14 and 15, a table rewrite) it reads no status update
//! for up to `wal_sender_timeout / 2` (or for the whole rewrite), so its `reply_time` stands
//! still although its client lives ([`super::liveness`]).

use super::source::SlotHolder;
use std::time::Duration;
use tokio::time::Instant;

/// What the standby should do about the holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No holder, or one that answers: stand by.
    Live,
    /// The holder `pid` has not answered for the whole `takeover_after`: terminate it.
    Zombie { pid: i32, silent: Duration },
    /// This role cannot see replies; never terminate.
    CannotTell,
}

/// The standby's memory of the holder.
#[derive(Debug)]
pub struct TakeoverWatch {
    after: Duration,
    /// (pid, reply_time) last observed, and since when it has been unchanged.
    seen: Option<(i32, Option<String>, Instant)>,
    /// (pid, sent_lsn) last observed.
    sent: Option<(i32, Option<String>)>,
}

impl TakeoverWatch {
    pub fn new(after: Duration) -> Self {
        Self {
            after,
            seen: None,
            sent: None,
        }
    }

    /// Records an observation made at `now` and judges the holder.
    pub fn observe(&mut self, holder: Option<&SlotHolder>, now: Instant) -> Verdict {
        let Some(h) = holder else {
            self.seen = None;
            return Verdict::Live;
        };
        if !h.can_see_replies {
            self.seen = None;
            return Verdict::CannotTell;
        }
        // Busy inside one record (busy, its sent position unmoved since the last look), it
        // reads no status update: not silent, whatever reply_time says. Busy from record to
        // record it reads them, and an unchanged reply_time means its client is gone.
        let sent = Some((h.pid, h.sent_lsn.clone()));
        let inside_one_record = h.busy && h.sent_lsn.is_some() && self.sent == sent;
        self.sent = sent;
        let since = match &self.seen {
            _ if inside_one_record => now,
            Some((pid, reply, since)) if *pid == h.pid && *reply == h.reply_time => *since,
            _ => now,
        };
        self.seen = Some((h.pid, h.reply_time.clone(), since));
        let silent = now.saturating_duration_since(since);
        if silent >= self.after {
            Verdict::Zombie { pid: h.pid, silent }
        } else {
            Verdict::Live
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pid: i32, reply: Option<&str>, visible: bool) -> SlotHolder {
        SlotHolder {
            busy: false,
            sent_lsn: Some("0/100".into()),
            pid,
            reply_time: reply.map(str::to_owned),
            can_see_replies: visible,
            relay: true,
        }
    }

    #[test]
    fn a_holder_whose_replies_change_is_live_however_skewed_its_clock() {
        let t0 = Instant::now();
        let mut w = TakeoverWatch::new(Duration::from_secs(5));
        // The other host's clock is an hour behind: its reply times are old, but they change.
        for i in 0..30u64 {
            let reply = format!("2026-01-01 00:00:{:02}+00", i % 60);
            let h = holder(7, Some(&reply), true);
            let v = w.observe(Some(&h), t0 + Duration::from_secs(i));
            assert_eq!(v, Verdict::Live, "second {i}");
        }
    }

    #[test]
    fn a_holder_busy_decoding_is_never_a_zombie_and_its_silence_counts_from_the_last_busy_look() {
        let t0 = Instant::now();
        let mut w = TakeoverWatch::new(Duration::from_secs(5));
        let busy = SlotHolder {
            busy: true,
            ..holder(7, Some("2026-01-01 00:00:00+00"), true)
        };
        for s in 0..60u64 {
            assert_eq!(
                w.observe(Some(&busy), t0 + Duration::from_secs(s)),
                Verdict::Live,
                "second {s}"
            );
        }
        // Done replaying, it waits with the same reply_time: the silence counts from the last
        // look that saw it busy (second 59).
        let waiting = holder(7, Some("2026-01-01 00:00:00+00"), true);
        let t1 = t0 + Duration::from_secs(60);
        assert_eq!(w.observe(Some(&waiting), t1), Verdict::Live);
        assert_eq!(
            w.observe(Some(&waiting), t1 + Duration::from_secs(3)),
            Verdict::Live
        );
        assert_eq!(
            w.observe(Some(&waiting), t1 + Duration::from_secs(4)),
            Verdict::Zombie {
                pid: 7,
                silent: Duration::from_secs(5)
            }
        );
    }

    #[test]
    fn a_busy_holder_whose_sent_position_moves_is_judged_by_its_replies() {
        let t0 = Instant::now();
        let mut w = TakeoverWatch::new(Duration::from_secs(5));
        for s in 0..=5u64 {
            let h = SlotHolder {
                busy: true,
                sent_lsn: Some(format!("0/{}", 100 + s)),
                ..holder(7, Some("2026-01-01 00:00:00+00"), true)
            };
            let v = w.observe(Some(&h), t0 + Duration::from_secs(s));
            if s < 5 {
                assert_eq!(v, Verdict::Live, "second {s}");
            } else {
                assert_eq!(
                    v,
                    Verdict::Zombie {
                        pid: 7,
                        silent: Duration::from_secs(5)
                    }
                );
            }
        }
    }

    #[test]
    fn a_holder_silent_for_the_whole_window_is_a_zombie() {
        let t0 = Instant::now();
        let mut w = TakeoverWatch::new(Duration::from_secs(5));
        let h = holder(7, Some("2026-01-01 00:00:00+00"), true);
        assert_eq!(w.observe(Some(&h), t0), Verdict::Live);
        assert_eq!(
            w.observe(Some(&h), t0 + Duration::from_secs(4)),
            Verdict::Live
        );
        assert_eq!(
            w.observe(Some(&h), t0 + Duration::from_secs(5)),
            Verdict::Zombie {
                pid: 7,
                silent: Duration::from_secs(5)
            }
        );
        // A new walsender (another pid) starts a new window.
        let h2 = holder(8, Some("2026-01-01 00:00:00+00"), true);
        assert_eq!(
            w.observe(Some(&h2), t0 + Duration::from_secs(6)),
            Verdict::Live
        );
    }

    #[test]
    fn a_holder_that_never_replied_becomes_a_zombie_only_after_the_window() {
        let t0 = Instant::now();
        let mut w = TakeoverWatch::new(Duration::from_secs(5));
        let h = holder(7, None, true);
        assert_eq!(w.observe(Some(&h), t0), Verdict::Live);
        assert!(matches!(
            w.observe(Some(&h), t0 + Duration::from_secs(5)),
            Verdict::Zombie { .. }
        ));
    }

    #[test]
    fn without_the_right_to_see_replies_nothing_is_ever_terminated() {
        let t0 = Instant::now();
        let mut w = TakeoverWatch::new(Duration::from_secs(1));
        let h = holder(7, None, false);
        for i in 0..100 {
            assert_eq!(
                w.observe(Some(&h), t0 + Duration::from_secs(i)),
                Verdict::CannotTell
            );
        }
    }
}
