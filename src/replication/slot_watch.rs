//! Notices when the slot the stream resumes from is not the one it left: the server's timeline
//! changed (a standby was promoted), the server is another cluster, or the slot's confirmed
//! position is not where the relay acknowledged it.
//!
//! Checked at the start of each replication session, once the session holds the slot (so that
//! nobody can move it between the check and the stream; found by review: checked before
//! opening, a slot recreated in between was streamed from unnoticed, the server silently
//! forwarding the start to the new slot's position). The comparison is pure ([`compare`]); the
//! SQL that feeds it is [`observe`]. A move of the slot by another walsender (a replica) or by
//! the relay itself is not a finding ([`SlotWatch::forget`]).
//! - Position behind the previous check's: the slot was restored or synced from an older state
//!   (a failover slot whose copy lagged). The stream replays from there; asynq's
//!   TaskID dedupe absorbs the repeats.
//! - Position ahead of it, with nothing else having moved it: the slot was recreated or advanced
//!   behind the relay's back. Events in between never come from the stream; the recovery poller
//!   delivers them from the table.
//!
//! Each finding is logged at warn level and counted in `outbox_slot_changes_total{kind}`;
//! `outbox_postgres_timeline` is the timeline of the last check. `outbox-relay status` shows the
//! server's timeline and the slot's failover/synced flags beside these two metrics (read from
//! the running relay), and says when the slot is past the relay's acknowledgement.

use crate::metrics::{KindLabel, Metrics};
use pgwire_replication::Lsn;
use std::sync::Mutex;
use tokio_postgres::Client;

/// The stream's memory of the previous check.
#[derive(Debug, Default)]
pub struct SlotWatch {
    /// The previous observation and the `outbox_slot_lost` count at that time.
    last: Mutex<Option<(Observation, u64)>>,
    /// Set by [`SlotWatch::forget`]: the next check does not compare positions.
    position_forgotten: std::sync::atomic::AtomicBool,
}

impl SlotWatch {
    /// The slot's next position is not compared with the previous check's (the server's
    /// identity and timeline still are). Called when a move of the slot is known not to skip
    /// events: the relay recreated it itself, or another walsender held it (another replica,
    /// which delivers what it acknowledges; found by review: a replica that lost the slot to
    /// another and took it back found it "ahead", and with OUTBOX_ON_SLOT_LOST=stop it stopped).
    pub fn forget(&self) {
        self.position_forgotten
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Compares `now` (the slot's server before a session, from [`SlotPort::observe`]; None
    /// when it could not be read) with the previous check, reports what changed and returns it.
    ///
    /// [`SlotPort::observe`]: super::source::SlotPort::observe
    pub fn check(&self, now: Option<Observation>, slot: &str, metrics: &Metrics) -> Vec<Finding> {
        let Some(now) = now else {
            return Vec::new();
        };
        let lost = metrics.slot_lost.get();
        let acked = Lsn::from(metrics.acked_lsn.get());
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let previous = last.as_ref().map(|(o, lost_then)| (*o, *lost_then));
        let forgotten = self
            .position_forgotten
            .swap(false, std::sync::atomic::Ordering::Relaxed);
        let found = compare(
            previous.as_ref().map(|(o, _)| o),
            &now,
            acked,
            forgotten || previous.is_some_and(|(_, lost_then)| lost_then != lost),
        );
        *last = Some((now, lost));
        drop(last);
        metrics.timeline.set(i64::from(now.timeline));
        for f in &found {
            log(slot, f);
            metrics
                .slot_changes
                .get_or_create(&KindLabel { kind: f.kind() })
                .inc();
        }
        found
    }
}

/// What the server and its slot looked like at one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    /// `pg_control_system().system_identifier`: the same on a primary and its standbys.
    pub system_id: i64,
    /// The timeline the server writes (a primary) or receives (a standby) WAL on.
    pub timeline: u32,
    /// The slot's `confirmed_flush_lsn`.
    pub confirmed_flush: Lsn,
}

/// A difference [`compare`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finding {
    /// The timeline changed: a failover (or a point-in-time recovery) happened.
    Timeline { from: u32, to: u32 },
    /// A different cluster answers at this address (restored from a dump, upgraded, replaced).
    OtherCluster { from: i64, to: i64 },
    /// The slot's position moved backwards since the previous check: events are replayed.
    Behind { acked: Lsn, confirmed: Lsn },
    /// The slot's position is ahead of what the relay acknowledged: it was recreated or advanced
    /// by someone else, and the stream skips what lies between.
    Ahead { acked: Lsn, confirmed: Lsn },
}

impl Finding {
    /// The `kind` label of `outbox_slot_changes_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            Finding::Timeline { .. } => "timeline",
            Finding::OtherCluster { .. } => "other_cluster",
            Finding::Behind { .. } => "behind",
            Finding::Ahead { .. } => "ahead",
        }
    }
}

/// Compares the check at a session's start with the previous one. `acked` is the position the
/// relay last acknowledged (zero: nothing yet in this process, so positions are not compared);
/// `recreated_by_relay` is true when the slot's new position is expected: the relay itself
/// recreated the slot since the previous check (reported as a lost slot already), or another
/// replica streamed from it ([`SlotWatch::forget`]).
pub fn compare(
    previous: Option<&Observation>,
    now: &Observation,
    acked: Lsn,
    recreated_by_relay: bool,
) -> Vec<Finding> {
    let mut found = Vec::new();
    let Some(prev) = previous else {
        return found;
    };
    if prev.system_id != now.system_id {
        found.push(Finding::OtherCluster {
            from: prev.system_id,
            to: now.system_id,
        });
    } else if prev.timeline != now.timeline {
        found.push(Finding::Timeline {
            from: prev.timeline,
            to: now.timeline,
        });
    }
    if acked == Lsn::ZERO || recreated_by_relay {
        return found;
    }
    // A slot's position only moves forward, and only as far as its one consumer confirmed.
    let confirmed = now.confirmed_flush;
    if confirmed < prev.confirmed_flush {
        found.push(Finding::Behind { acked, confirmed });
    } else if confirmed > acked && confirmed > prev.confirmed_flush {
        found.push(Finding::Ahead { acked, confirmed });
    }
    found
}

/// The server's timeline, as an SQL expression (an `int`). A primary's is the first 8 hex digits
/// of its current WAL file's name; a standby's is the one its WAL receiver receives (or replays,
/// without a receiver). `outbox-relay status` shows the same.
pub const TIMELINE_SQL: &str = "CASE WHEN pg_is_in_recovery() \
         THEN coalesce((SELECT received_tli FROM pg_stat_wal_receiver), \
                       (SELECT timeline_id FROM pg_control_checkpoint())) \
         ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int \
    END";

/// Reads the server's identity and timeline and the slot's position; `None` without the slot.
pub async fn observe(
    client: &Client,
    slot: &str,
) -> Result<Option<Observation>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            format!(
                "SELECT (SELECT system_identifier FROM pg_control_system()), {TIMELINE_SQL}, \
                        coalesce(s.confirmed_flush_lsn::text, '0/0') \
                 FROM pg_replication_slots s WHERE s.slot_name = $1"
            )
            .as_str(),
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| Observation {
        system_id: r.get(0),
        timeline: r.get::<_, i32>(1) as u32,
        confirmed_flush: Lsn::parse(r.get::<_, &str>(2)).unwrap_or(Lsn::ZERO),
    }))
}

/// Logs a finding (warn: an operator should know a failover or a foreign hand happened).
pub fn log(slot: &str, finding: &Finding) {
    match *finding {
        Finding::Timeline { from, to } => tracing::warn!(
            slot,
            from,
            to,
            "postgres timeline changed (a standby was promoted): the stream resumes from the slot \
             on the new timeline; events it cannot replay come from the recovery poller"
        ),
        Finding::OtherCluster { from, to } => tracing::warn!(
            slot,
            from,
            to,
            "a different postgres cluster answers (system identifier changed): its slot is not \
             the one the relay left"
        ),
        Finding::Behind { acked, confirmed } => tracing::warn!(
            slot,
            acked = %acked,
            confirmed = %confirmed,
            "replication slot moved backwards (restored, or a failover slot synced before the \
             last acknowledgements): events are replayed and deduplicated by TaskID"
        ),
        Finding::Ahead { acked, confirmed } => tracing::warn!(
            slot,
            acked = %acked,
            confirmed = %confirmed,
            "replication slot is ahead of the relay's acknowledgement (recreated or advanced \
             behind its back): the stream skips what lies between; the recovery poller delivers \
             it from the table"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(system_id: i64, timeline: u32, confirmed: u64) -> Observation {
        Observation {
            system_id,
            timeline,
            confirmed_flush: Lsn::from(confirmed),
        }
    }

    #[test]
    fn the_first_check_and_an_unchanged_slot_find_nothing() {
        assert!(compare(None, &obs(1, 1, 100), Lsn::from(100), false).is_empty());
        // Acknowledged 200 since the last check at 100: the slot is at 200.
        assert!(compare(
            Some(&obs(1, 1, 100)),
            &obs(1, 1, 200),
            Lsn::from(200),
            false
        )
        .is_empty());
        // The last acknowledgement did not reach the server before the session ended.
        assert!(compare(
            Some(&obs(1, 1, 100)),
            &obs(1, 1, 150),
            Lsn::from(200),
            false
        )
        .is_empty());
    }

    #[test]
    fn a_forgotten_position_is_not_compared_once_but_the_timeline_is() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Metrics::new(&mut registry);
        let watch = SlotWatch::default();
        metrics.acked_lsn.set(300);
        assert!(watch.check(Some(obs(1, 1, 300)), "s", &metrics).is_empty());
        // Another replica streamed from the slot (or the relay recreated it), and a failover.
        watch.forget();
        assert_eq!(
            watch.check(Some(obs(1, 2, 900)), "s", &metrics),
            [Finding::Timeline { from: 1, to: 2 }]
        );
        // Forgotten for that one check only.
        assert_eq!(
            watch.check(Some(obs(1, 2, 1900)), "s", &metrics),
            [Finding::Ahead {
                acked: Lsn::from(300),
                confirmed: Lsn::from(1900)
            }]
        );
    }

    #[test]
    fn a_promotion_is_a_timeline_change() {
        let f = compare(
            Some(&obs(1, 1, 100)),
            &obs(1, 2, 200),
            Lsn::from(200),
            false,
        );
        assert_eq!(f, [Finding::Timeline { from: 1, to: 2 }]);
        let f = compare(
            Some(&obs(1, 1, 100)),
            &obs(9, 1, 200),
            Lsn::from(200),
            false,
        );
        assert_eq!(f, [Finding::OtherCluster { from: 1, to: 9 }]);
    }

    #[test]
    fn a_slot_behind_the_acknowledgement_was_restored() {
        let f = compare(
            Some(&obs(1, 1, 300)),
            &obs(1, 2, 250),
            Lsn::from(300),
            false,
        );
        assert_eq!(
            f,
            [
                Finding::Timeline { from: 1, to: 2 },
                Finding::Behind {
                    acked: Lsn::from(300),
                    confirmed: Lsn::from(250)
                }
            ]
        );
    }

    #[test]
    fn a_slot_ahead_of_the_acknowledgement_was_recreated_behind_the_relays_back() {
        let f = compare(
            Some(&obs(1, 1, 300)),
            &obs(1, 1, 900),
            Lsn::from(300),
            false,
        );
        assert_eq!(
            f,
            [Finding::Ahead {
                acked: Lsn::from(300),
                confirmed: Lsn::from(900)
            }]
        );
        // The relay recreated it itself (already reported as a lost slot).
        assert!(compare(Some(&obs(1, 1, 300)), &obs(1, 1, 900), Lsn::from(300), true).is_empty());
        // Nothing acknowledged yet in this process: no position to compare with.
        assert!(compare(Some(&obs(1, 1, 300)), &obs(1, 1, 900), Lsn::ZERO, false).is_empty());
    }
}
