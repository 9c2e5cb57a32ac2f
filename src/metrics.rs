//! Metric names and the registry, created once and shared by reference. Counters are atomics, so
//! the hot path only increments.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

/// Distinct `event_type` label values of `outbox_events_failed_total` at most; later names are
/// counted under [`OTHER_EVENT_TYPE`], so bad rows cannot grow `/metrics` without bound.
pub const MAX_EVENT_TYPE_LABELS: usize = 50;
/// Longest event name used as a label value; longer names count under [`OTHER_EVENT_TYPE`].
pub const MAX_EVENT_TYPE_LABEL_BYTES: usize = 64;
/// The label value of names beyond the limit, too long, empty or with unusual characters.
pub const OTHER_EVENT_TYPE: &str = "other";

/// `outbox_events_failed_total{event_type}` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventTypeLabel {
    pub event_type: String,
}

/// `outbox_reconnects_total{target}` labels: `postgres` or `valkey`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TargetLabel {
    pub target: &'static str,
}

/// `outbox_link_failures_total{link}` labels: `replication`, `postgres` (SQL) or `valkey`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LinkLabel {
    pub link: &'static str,
}

/// `outbox_bad_rows_total{reason}` labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// `outbox_slot_changes_total{kind}` labels: `timeline`, `other_cluster`, `behind`, `ahead`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

/// Every metric the relay exports.
pub struct Metrics {
    /// Events confirmed in Valkey (new tasks plus TaskIDs that already existed).
    pub published: Counter,
    /// Of those, TaskIDs that already existed (replays absorbed by asynq's dedupe).
    pub duplicates: Counter,
    /// Rows that could not be delivered, by event name.
    pub failed: Family<EventTypeLabel, Counter>,
    /// Rows that could not become tasks, by reason.
    pub bad_rows: Family<ReasonLabel, Counter>,
    /// One Valkey write (a pipeline of tasks), from send to confirmation.
    pub batch_duration: Histogram,
    /// Failed Valkey writes (each one is retried).
    pub write_errors: Counter,
    /// 1 while the replication stream is connected.
    pub stream_up: Gauge,
    /// 1 while another session (a replica) holds the slot and this relay stands by.
    pub stream_standby: Gauge,
    /// Connections re-established after a loss.
    pub reconnects: Family<TargetLabel, Counter>,
    /// The LSN last acknowledged to Postgres (as a number).
    pub acked_lsn: Gauge<u64, AtomicU64>,
    /// Poll rounds completed (with or without rows).
    pub poller_rounds: Counter,
    /// Poll rounds that failed (retried with backoff).
    pub poller_errors: Counter,
    /// Events the poller delivered.
    pub poller_delivered: Counter,
    /// The replication slot was found missing or invalidated.
    pub slot_lost: Counter,
    /// The slot or server was not the one the stream left (replication/slot_watch.rs), by kind.
    pub slot_changes: Family<KindLabel, Counter>,
    /// The Postgres timeline at the stream's last check (it changes when a standby is promoted).
    pub timeline: Gauge,
    /// Rows the stream marked published, or deleted with `OUTBOX_DELETE_DELIVERED`.
    pub marked: Counter,
    /// Row ids not marked because the marking queue was full (the poller re-sends them).
    pub mark_dropped: Counter,
    /// Unpublished rows (refreshed by the monitor).
    pub pending: Gauge,
    /// Age of the oldest unpublished row that is not a dead letter, 0 when none (refreshed by
    /// the monitor).
    pub oldest_pending_age: Gauge<f64, AtomicU64>,
    /// Dead letters (refreshed by the monitor).
    pub dead_letters: Gauge,
    /// Current WAL position minus the slot's confirmed position (refreshed by the monitor).
    pub lag_bytes: Gauge<u64, AtomicU64>,
    /// Commit time to Valkey confirmation, per event (stream).
    pub delivery_latency: Histogram,
    /// 1 while the heartbeat says the stream is stalled.
    pub stream_stalled: Gauge,
    /// Batches handed to Valkey and not yet confirmed (the stream's writer).
    pub inflight_batches: Gauge,
    /// Task bytes in those batches.
    pub inflight_bytes: Gauge,
    /// Rows whose task the sink refused for good (their queue's keys, ACL...): left
    /// unpublished for the recovery poller, which counts attempts and dead-letters them.
    pub rows_rejected: Counter,
    /// Broken delivery invariants: each ended a session without acknowledging (a bug).
    pub invariant_violations: Counter,
    /// Links found dead: the replication connection silent past its deadline, or a health
    /// check of Postgres or Valkey failing (after passing).
    pub link_failures: Family<LinkLabel, Counter>,
    /// Times the replication connection stayed silent past its deadline while its walsender was
    /// busy decoding (the link was kept).
    pub walsender_busy_silences: Counter,
    /// Times the publication was found recreated behind the slot (the slot was recreated).
    pub publication_recreated: Counter,
    /// Times the relay found its publication missing while running and created it again (the
    /// slot kept, from PostgreSQL 18; before, the slot is recreated too and counted above).
    pub publication_restored: Counter,
    /// Rows found sharing their event_id with an earlier row (one task for all of them).
    pub shared_event_id: Counter,
    /// Rows the shared-event_id check had no room or no answer to check.
    pub shared_event_id_unchecked: Counter,
    /// Liveness of the dependencies, for /readyz.
    pub health: crate::health::Health,
    /// The `event_type` values `failed` has used (at most [`MAX_EVENT_TYPE_LABELS`]).
    event_types: Mutex<HashSet<String>>,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            published: Counter::default(),
            duplicates: Counter::default(),
            failed: Family::default(),
            bad_rows: Family::default(),
            batch_duration: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            write_errors: Counter::default(),
            stream_up: Gauge::default(),
            stream_standby: Gauge::default(),
            reconnects: Family::default(),
            acked_lsn: Gauge::default(),
            poller_rounds: Counter::default(),
            poller_errors: Counter::default(),
            poller_delivered: Counter::default(),
            slot_lost: Counter::default(),
            slot_changes: Family::default(),
            timeline: Gauge::default(),
            marked: Counter::default(),
            mark_dropped: Counter::default(),
            pending: Gauge::default(),
            oldest_pending_age: Gauge::default(),
            dead_letters: Gauge::default(),
            lag_bytes: Gauge::default(),
            delivery_latency: Histogram::new(exponential_buckets(0.0005, 2.0, 18)),
            stream_stalled: Gauge::default(),
            inflight_batches: Gauge::default(),
            inflight_bytes: Gauge::default(),
            rows_rejected: Counter::default(),
            invariant_violations: Counter::default(),
            link_failures: Family::default(),
            walsender_busy_silences: Counter::default(),
            publication_recreated: Counter::default(),
            publication_restored: Counter::default(),
            shared_event_id: Counter::default(),
            shared_event_id_unchecked: Counter::default(),
            health: crate::health::Health::default(),
            event_types: Mutex::default(),
        };
        registry.register(
            "outbox_link_failures",
            "Links found dead (replication connection silent past OUTBOX_LINK_TIMEOUT, or a \
             Postgres or Valkey health check failing), by link",
            m.link_failures.clone(),
        );
        registry.register(
            "outbox_walsender_busy_silences",
            "Times the replication connection stayed silent past OUTBOX_LINK_TIMEOUT while the \
             server showed its walsender busy decoding (a long filtered transaction or a table \
             rewrite): the link was kept, not taken for dead",
            m.walsender_busy_silences.clone(),
        );
        registry.register(
            "outbox_publication_recreated",
            "Times the publication was found dropped and recreated behind the slot (the slot \
             was recreated; the recovery poller delivers the gap)",
            m.publication_recreated.clone(),
        );
        registry.register(
            "outbox_publication_restored",
            "Times the relay found its publication missing while running and created it again \
             (rows committed while it was missing are delivered by the recovery poller)",
            m.publication_restored.clone(),
        );
        registry.register(
            "outbox_events_shared_event_id",
            "Rows that share their event_id with another row routed to the same queue: asynq \
             keeps one task for all of them, so these rows were marked published without a task \
             of their own (checked only when the table has no UNIQUE event_id)",
            m.shared_event_id.clone(),
        );
        registry.register(
            "outbox_events_shared_event_id_unchecked",
            "Rows of writes that met existing TaskIDs that the shared-event_id check could not \
             look up (too many waiting, or the query failed)",
            m.shared_event_id_unchecked.clone(),
        );
        registry.register(
            "outbox_events_published",
            "Events confirmed in Valkey (new tasks plus already-present TaskIDs)",
            m.published.clone(),
        );
        registry.register(
            "outbox_events_duplicate",
            "Events whose TaskID already existed in Valkey (replays deduplicated)",
            m.duplicates.clone(),
        );
        registry.register(
            "outbox_events_failed",
            "Events that could not be delivered, by event type",
            m.failed.clone(),
        );
        registry.register(
            "outbox_bad_rows",
            "Rows that could not become tasks, by reason",
            m.bad_rows.clone(),
        );
        registry.register(
            "outbox_batch_duration_seconds",
            "Duration of one Valkey write of a batch",
            m.batch_duration.clone(),
        );
        registry.register(
            "outbox_valkey_write_errors",
            "Failed Valkey writes (retried)",
            m.write_errors.clone(),
        );
        registry.register(
            "outbox_stream_up",
            "1 while the replication stream is connected",
            m.stream_up.clone(),
        );
        registry.register(
            "outbox_stream_standby",
            "1 while another replica holds the slot and this relay stands by (its poller runs)",
            m.stream_standby.clone(),
        );
        registry.register(
            "outbox_reconnects",
            "Connections re-established after a loss, by target",
            m.reconnects.clone(),
        );
        registry.register(
            "outbox_acked_lsn",
            "The LSN last acknowledged to Postgres",
            m.acked_lsn.clone(),
        );
        let more: [(&str, &str, &Counter); 6] = [
            (
                "outbox_poller_rounds",
                "Poll rounds completed",
                &m.poller_rounds,
            ),
            (
                "outbox_poller_errors",
                "Poll rounds that failed (retried)",
                &m.poller_errors,
            ),
            (
                "outbox_poller_delivered",
                "Events the poller delivered",
                &m.poller_delivered,
            ),
            (
                "outbox_slot_lost",
                "Times the replication slot was found missing or invalidated",
                &m.slot_lost,
            ),
            (
                "outbox_rows_marked",
                "Rows the stream marked published, or deleted with OUTBOX_DELETE_DELIVERED",
                &m.marked,
            ),
            (
                "outbox_rows_mark_dropped",
                "Rows not marked published because the marking queue was full",
                &m.mark_dropped,
            ),
        ];
        for (name, help, c) in more {
            registry.register(name, help, c.clone());
        }
        registry.register(
            "outbox_events_pending",
            "Unpublished outbox rows",
            m.pending.clone(),
        );
        registry.register(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest unpublished row that is not a dead letter (0 when none)",
            m.oldest_pending_age.clone(),
        );
        registry.register(
            "outbox_dead_letters",
            "Rows that failed too often and wait for an operator",
            m.dead_letters.clone(),
        );
        registry.register(
            "outbox_replication_lag_bytes",
            "Current WAL position minus the slot's confirmed position",
            m.lag_bytes.clone(),
        );
        registry.register(
            "outbox_delivery_latency_seconds",
            "Commit in Postgres to confirmation in Valkey, per event (stream)",
            m.delivery_latency.clone(),
        );
        registry.register(
            "outbox_stream_stalled",
            "1 while heartbeats are not coming back through the stream",
            m.stream_stalled.clone(),
        );
        registry.register(
            "outbox_inflight_batches",
            "Batches handed to Valkey and not yet confirmed",
            m.inflight_batches.clone(),
        );
        registry.register(
            "outbox_inflight_bytes",
            "Task bytes in the batches not yet confirmed by Valkey",
            m.inflight_bytes.clone(),
        );
        registry.register(
            "outbox_rows_rejected",
            "Rows whose task Valkey refused for good; left unpublished for the recovery poller",
            m.rows_rejected.clone(),
        );
        registry.register(
            "outbox_invariant_violations",
            "Broken delivery invariants; each ended a session without acknowledging",
            m.invariant_violations.clone(),
        );
        registry.register(
            "outbox_slot_changes",
            "Times the slot or server was not the one the stream left (timeline change, another \
             cluster, slot moved behind or ahead of the relay), by kind",
            m.slot_changes.clone(),
        );
        registry.register(
            "outbox_postgres_timeline",
            "The Postgres timeline at the stream's last check (changes when a standby is promoted)",
            m.timeline.clone(),
        );
        m
    }

    /// A Valkey write failed (it is retried): counted, and `/readyz` turns not ready when
    /// writes keep failing (see [`crate::health::WRITES_FAILING_NOT_READY`]).
    pub fn valkey_write_failed(&self, by: crate::health::Writer) {
        self.write_errors.inc();
        self.health.write_failed(by);
    }

    /// A Valkey write succeeded.
    pub fn valkey_write_succeeded(&self, by: crate::health::Writer) {
        self.health.write_succeeded(by);
    }

    /// Counts a row that could not become a task.
    pub fn bad_row(&self, event_name: &str, reason: &'static str) {
        self.bad_rows.get_or_create(&ReasonLabel { reason }).inc();
        let event_type = self.event_type_label(event_name);
        self.failed
            .get_or_create(&EventTypeLabel { event_type })
            .inc();
    }

    /// The `event_type` label for `event_name`: the name itself when it is short, made of
    /// the characters event names use, and among the first [`MAX_EVENT_TYPE_LABELS`] distinct
    /// names seen; otherwise [`OTHER_EVENT_TYPE`]. A bad row's name is whatever a producer
    /// wrote (4,000 rows with 10 KB names once made `/metrics` 41 MB): it must not become a
    /// label as it is.
    fn event_type_label(&self, event_name: &str) -> String {
        let plain = !event_name.is_empty()
            && event_name.len() <= MAX_EVENT_TYPE_LABEL_BYTES
            && event_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._:-/".contains(&b));
        if !plain || event_name == OTHER_EVENT_TYPE {
            return OTHER_EVENT_TYPE.to_owned();
        }
        let mut known = self.event_types.lock().expect("event types lock");
        if known.contains(event_name) || known.len() < MAX_EVENT_TYPE_LABELS {
            known.insert(event_name.to_owned());
            event_name.to_owned()
        } else {
            OTHER_EVENT_TYPE.to_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed_labels(m: &Metrics) -> Vec<String> {
        let mut registry = Registry::default();
        registry.register("f", "f", m.failed.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text.lines()
            .filter_map(|l| l.split("event_type=\"").nth(1))
            .map(|l| l.split('"').next().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn failed_event_types_are_bounded_and_never_raw_bad_names() {
        let m = Metrics::new(&mut Registry::default());
        m.bad_row("order.created", "empty_event_name");
        m.bad_row(&"x".repeat(10_000), "payload_too_large");
        m.bad_row("", "empty_event_name");
        m.bad_row("bad name\n{}\"", "missing_column");
        for i in 0..4_000 {
            m.bad_row(&format!("name.{i}"), "metadata_not_object");
        }
        m.bad_row("order.created", "empty_event_name");
        let labels = failed_labels(&m);
        assert!(
            labels.len() <= MAX_EVENT_TYPE_LABELS + 1,
            "{}",
            labels.len()
        );
        assert!(labels.contains(&"order.created".to_owned()));
        assert!(labels.contains(&OTHER_EVENT_TYPE.to_owned()));
        assert!(labels.iter().all(|l| l.len() <= MAX_EVENT_TYPE_LABEL_BYTES));
        let other = m
            .failed
            .get_or_create(&EventTypeLabel {
                event_type: OTHER_EVENT_TYPE.into(),
            })
            .get();
        assert_eq!(other, 3 + 4_000 - (MAX_EVENT_TYPE_LABELS as u64 - 1));
    }
}
