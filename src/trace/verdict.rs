//! The one-line verdict of `trace`: PURE, from the row, the slot and the task.

use super::{RowInfo, SlotInfo};
use crate::asynq_state::{one_line, TaskInfo};

/// What happened to the event, in one word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VerdictKind {
    /// The task exists in Valkey (in any state) and the row is published or gone.
    Delivered,
    /// On its way: a task exists but the row is not marked yet, or the stream has not
    /// acknowledged past the row's commit.
    InFlight,
    /// Unpublished with no task, and the stream is past it (or there is no slot): the
    /// recovery poller delivers it.
    WaitingForPoller,
    /// Failed `OUTBOX_MAX_ATTEMPTS` times; only `dead-letters retry` sends it again.
    DeadLetter,
    /// Published, no task, and a completed task would still be kept: Valkey lost it.
    LostBySink,
    /// Published, no task, but a completed task would have expired by now (or retention is
    /// 0): completed and lost cannot be told apart.
    Unknowable,
    /// Neither a row nor a task.
    NotFound,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Verdict {
    pub kind: VerdictKind,
    pub text: String,
}

/// What the verdict is made from.
pub struct Facts<'a> {
    pub row: Option<&'a RowInfo>,
    pub slot: &'a SlotInfo,
    pub task: Option<&'a TaskInfo>,
    pub routed_queue: Option<&'a str>,
    pub retention_secs: i64,
    /// The row was created less than the retention ago.
    pub created_within_retention: bool,
}

fn v(kind: VerdictKind, text: String) -> Verdict {
    Verdict { kind, text }
}

pub fn judge(f: &Facts<'_>) -> Verdict {
    use VerdictKind::*;
    let task = f.task.map(TaskInfo::describe);
    let moved = match (f.task, f.routed_queue) {
        (Some(t), Some(q)) if t.queue != q => {
            format!(" (the routes now say queue {q}: they changed since)")
        }
        _ => String::new(),
    };
    let Some(row) = f.row else {
        return match task {
            Some(t) => v(
                Delivered,
                format!(
                    "delivered: the task is {t}; the row is gone (OUTBOX_DELETE_DELIVERED or \
                     cleanup deleted it)"
                ),
            ),
            None => v(
                NotFound,
                "not found: no row in the table and no task in any queue (never written, or \
                 its row deleted and its completed task expired)"
                    .into(),
            ),
        };
    };
    if let (Some(dead), None) = (&row.dead_at, &row.published_at) {
        return v(
            DeadLetter,
            format!(
                "dead letter since {dead} after {} attempts{}: fix the row, then \
                 `outbox-relay dead-letters retry --event-id <id>`",
                row.attempts,
                row.last_error
                    .as_deref()
                    .map(|e| format!(" (last error: {})", one_line(e)))
                    .unwrap_or_default()
            ),
        );
    }
    if let Some(published) = &row.published_at {
        return match task {
            Some(t) => v(
                Delivered,
                format!("delivered at {published}: the task is {t}{moved}"),
            ),
            None if f.retention_secs == 0 => v(
                Unknowable,
                format!(
                    "published at {published}, no task: with a task retention of 0 a completed \
                     task is deleted at once, so completed and lost look the same"
                ),
            ),
            None if f.created_within_retention => v(
                LostBySink,
                format!(
                    "lost by the sink: published at {published}, but Valkey has no task, and a \
                     completed one would be kept for the task retention ({}s); Valkey lost it \
                     (a restart without persistence, a failover, a manual delete). \
                     `outbox-relay reconcile` re-enqueues such events",
                    f.retention_secs
                ),
            ),
            None => v(
                Unknowable,
                format!(
                    "published at {published}, no task: it was created longer ago than the task \
                     retention ({}s), so a completed task has expired; completed and lost cannot \
                     be told apart",
                    f.retention_secs
                ),
            ),
        };
    }
    if let Some(t) = task {
        return v(
            InFlight,
            format!("in flight: the task is {t}{moved}; the row is not marked published yet"),
        );
    }
    let failed = if row.attempts > 0 {
        format!(
            "; {} failed attempt(s){}{}",
            row.attempts,
            row.last_error
                .as_deref()
                .map(|e| format!(", last error: {}", one_line(e)))
                .unwrap_or_default(),
            row.next_attempt_at
                .as_deref()
                .map(|n| format!(", next attempt at {n}"))
                .unwrap_or_default()
        )
    } else {
        String::new()
    };
    if f.slot.past_row_commit == Some(true) || !f.slot.exists {
        let why = if f.slot.exists {
            "the stream's slot is past its commit without delivering it"
        } else {
            "no slot"
        };
        return v(
            WaitingForPoller,
            format!(
                "waiting for the poller since {} ({why}){failed}",
                row.created_at
            ),
        );
    }
    v(
        InFlight,
        format!(
            "in flight: not delivered yet and the slot has not confirmed past the row's commit \
             (created {}){failed}",
            row.created_at
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(published: Option<&str>, dead: Option<&str>) -> RowInfo {
        RowInfo {
            id: 1,
            event_name: "order.placed".into(),
            created_at: "2026-12-01 03:00:00+00".into(),
            published_at: published.map(str::to_owned),
            attempts: 0,
            last_error: None,
            next_attempt_at: None,
            dead_at: dead.map(str::to_owned),
            last_write_xid: "7".into(),
            last_write_committed_at: None,
            wal_lsn_when_read: "0/10".into(),
        }
    }

    fn slot(past: Option<bool>) -> SlotInfo {
        SlotInfo {
            name: "s".into(),
            exists: true,
            confirmed_flush_lsn: Some("0/10".into()),
            past_row_commit: past,
        }
    }

    fn judge_with(r: Option<&RowInfo>, s: &SlotInfo, within: bool, retention: i64) -> VerdictKind {
        judge(&Facts {
            row: r,
            slot: s,
            task: None,
            routed_queue: Some("default"),
            retention_secs: retention,
            created_within_retention: within,
        })
        .kind
    }

    #[test]
    fn without_a_task() {
        let published = row(Some("2026-12-01 03:00:01+00"), None);
        assert_eq!(
            judge_with(Some(&published), &slot(Some(true)), true, 86_400),
            VerdictKind::LostBySink
        );
        assert_eq!(
            judge_with(Some(&published), &slot(Some(true)), false, 86_400),
            VerdictKind::Unknowable
        );
        assert_eq!(
            judge_with(Some(&published), &slot(Some(true)), true, 0),
            VerdictKind::Unknowable
        );
        let waiting = row(None, None);
        assert_eq!(
            judge_with(Some(&waiting), &slot(Some(true)), true, 86_400),
            VerdictKind::WaitingForPoller
        );
        assert_eq!(
            judge_with(Some(&waiting), &slot(None), true, 86_400),
            VerdictKind::InFlight
        );
        let dead = row(None, Some("2026-12-01 04:00:00+00"));
        assert_eq!(
            judge_with(Some(&dead), &slot(Some(true)), true, 86_400),
            VerdictKind::DeadLetter
        );
        assert_eq!(
            judge_with(None, &slot(None), true, 86_400),
            VerdictKind::NotFound
        );
    }
}
