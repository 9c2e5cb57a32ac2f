//! `outbox-relay trace`: where is event X? One answer per event, from the three places it can
//! be: the outbox row, the replication slot, and the asynq task in Valkey, with a one-line
//! verdict.
//!
//! What can and cannot be known:
//! - PostgreSQL keeps no commit LSN per row. The row's last writer (`xmin`) is known, and its
//!   commit time when `track_commit_timestamp` is on; once the row was marked published or a
//!   failed attempt was recorded, that writer is the relay's UPDATE, not the producer's INSERT.
//! - "Is the slot past the row's commit?" has a proven yes in two cases: the slot confirmed the
//!   WAL position read together with the row (the insert committed at or before it), or the
//!   row's last writer is older than the slot's `catalog_xmin` (it finished before the slot's
//!   restart point). Otherwise the answer is "not known", never a guessed no.
//! - A published row whose task is gone: within the task retention after the row's creation a
//!   completed task would still be kept, so its task was lost by the sink (a Valkey restart
//!   without persistence, a failover to a replica that missed writes, a manual delete). After
//!   the retention, a completed task is deleted by asynq's janitor: nothing tells the two apart.

mod verdict;

use crate::asynq_state::{self, TaskInfo};
use crate::config::{parse_identifier, parse_positive_usize, DatabaseArgs, ValkeyArgs};
use crate::event_filter::{parse_event_id, Delivery, EventFilter, EventRow, COLUMNS};
use crate::operator::OperatorError;
use crate::task_args::TaskArgs;
use clap::Args;
use std::fmt::Write;
pub use verdict::{Verdict, VerdictKind};

/// Settings of `outbox-relay trace`.
#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    /// Event ids to trace (or search with --event-name/--since).
    #[arg(value_parser = parse_event_id, required_unless_present_any = ["since", "until", "event_name"])]
    pub event_ids: Vec<String>,
    #[command(flatten)]
    pub filter: EventFilter,
    /// Search: how many rows at most (the newest matching ones).
    #[arg(long, default_value_t = 20, value_parser = parse_positive_usize)]
    pub limit: usize,
    #[command(flatten)]
    pub db: DatabaseArgs,
    #[command(flatten)]
    pub valkey: ValkeyArgs,
    #[command(flatten)]
    pub task: TaskArgs,
    /// The replication slot.
    #[arg(long, env = "OUTBOX_SLOT", default_value = "outbox_relay", value_parser = parse_identifier)]
    pub slot: String,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The outbox row, as far as the table tells.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RowInfo {
    pub id: i64,
    pub event_name: String,
    pub created_at: String,
    pub published_at: Option<String>,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub next_attempt_at: Option<String>,
    pub dead_at: Option<String>,
    /// The transaction that wrote the row's current version (`xmin`): the producer's INSERT
    /// until the relay updates the row (published, or a failed attempt).
    pub last_write_xid: String,
    /// That transaction's commit time; `None` when `track_commit_timestamp` is off.
    pub last_write_committed_at: Option<String>,
    /// The WAL position when the row was read: its insert committed at or before it.
    pub wal_lsn_when_read: String,
}

/// The slot against the row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SlotInfo {
    pub name: String,
    pub exists: bool,
    pub confirmed_flush_lsn: Option<String>,
    /// `Some(true)`: confirmed at or past the row's commit. `None`: not known (no slot, no
    /// row, or the slot is behind the WAL position read with the row).
    pub past_row_commit: Option<bool>,
}

/// One event's answer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Trace {
    pub event_id: String,
    pub row: Option<RowInfo>,
    pub slot: SlotInfo,
    /// The queue the routes give the event (`None` without a row: the name is unknown).
    pub routed_queue: Option<String>,
    /// The task, in whichever queue holds it; `None`: no task hash in any known queue.
    pub task: Option<TaskInfo>,
    pub verdict: Verdict,
}

fn lsn_text(v: i64) -> String {
    let v = v as u64;
    format!("{:X}/{:X}", v >> 32, v & 0xffff_ffff)
}

/// The event ids of the newest rows matching the search.
async fn search(
    client: &tokio_postgres::Client,
    args: &TraceArgs,
) -> Result<Vec<String>, OperatorError> {
    let cond = args.filter.condition(&[], Delivery::Any);
    let n = cond.params.len();
    let sql = format!(
        "SELECT event_id::text FROM {} {} ORDER BY id DESC LIMIT ${}",
        args.db.table.sql(),
        cond.sql,
        n + 1
    );
    let limit = i64::try_from(args.limit).unwrap_or(i64::MAX);
    let mut params = cond.refs();
    params.push(&limit);
    let rows = client.query(&sql, &params).await?;
    Ok(rows.iter().rev().map(|r| r.get(0)).collect())
}

async fn read_row(
    client: &tokio_postgres::Client,
    args: &TraceArgs,
    commit_ts: bool,
    event_id: &str,
) -> Result<Option<(EventRow, RowInfo, Position)>, OperatorError> {
    let ts = if commit_ts {
        "pg_xact_commit_timestamp(xmin)::text"
    } else {
        "NULL::text"
    };
    let sql = format!(
        "SELECT {COLUMNS}, xmin::text, {ts}, (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint, \
                age(xmin) \
         FROM {} WHERE event_id::text = $1 ORDER BY id LIMIT 1",
        args.db.table.sql()
    );
    let Some(r) = client.query_opt(&sql, &[&event_id]).await? else {
        return Ok(None);
    };
    let row = EventRow::from_row(&r);
    let wal: i64 = r.get(13);
    let position = Position {
        wal,
        xmin_age: r.get(14),
    };
    let info = RowInfo {
        id: row.id,
        event_name: row.event_name.clone(),
        created_at: row.created_at.clone(),
        published_at: row.published_at.clone(),
        attempts: row.attempts,
        last_error: row.last_error.clone(),
        next_attempt_at: row.next_attempt_at.clone(),
        dead_at: row.dead_at.clone(),
        last_write_xid: r.get(11),
        last_write_committed_at: r.get(12),
        wal_lsn_when_read: lsn_text(wal),
    };
    Ok(Some((row, info, position)))
}

/// Where a row's commit is bounded: the WAL position read with it (the commit is at or
/// before it), and the age of its last writer's transaction.
#[derive(Debug, Clone, Copy)]
struct Position {
    wal: i64,
    xmin_age: i32,
}

/// A slot's confirmed position and the age of its `catalog_xmin`.
struct SlotPosition {
    confirmed: i64,
    confirmed_text: String,
    catalog_xmin_age: Option<i32>,
}

impl SlotPosition {
    /// Whether the slot is provably past the row's commit. Either the slot confirmed the WAL
    /// position read with the row, or the row's last writer is older than the slot's
    /// `catalog_xmin`: every transaction older than that had finished before the slot's restart
    /// point, which is at or before its confirmed position, and the insert committed no later
    /// than any transaction that updated the row since.
    fn past(&self, row: &Position) -> bool {
        self.confirmed >= row.wal || self.catalog_xmin_age.is_some_and(|a| row.xmin_age > a)
    }
}

/// The slot's confirmed position, `None` without the slot.
async fn read_slot(
    client: &tokio_postgres::Client,
    slot: &str,
) -> Result<Option<SlotPosition>, OperatorError> {
    let row = client
        .query_opt(
            "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint, confirmed_flush_lsn::text, \
                    age(catalog_xmin) \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.and_then(|r| {
        let n: Option<i64> = r.get(0);
        let t: Option<String> = r.get(1);
        n.zip(t).map(|(confirmed, confirmed_text)| SlotPosition {
            confirmed,
            confirmed_text,
            catalog_xmin_age: r.get(2),
        })
    }))
}

/// Traces every event the arguments name (ids, then the search's matches, oldest first).
pub async fn trace(args: &TraceArgs) -> Result<Vec<Trace>, OperatorError> {
    let (client, mut conn) = crate::operator::connect(&args.db, &args.valkey).await?;
    let mut ids = args.event_ids.clone();
    if !args.filter.is_empty() {
        let found = search(&client, args).await?;
        if found.is_empty() && ids.is_empty() {
            return Err(OperatorError::Refused(
                "no row matches the search (--since/--until/--event-name)".into(),
            ));
        }
        ids.extend(found.into_iter().filter(|id| !args.event_ids.contains(id)));
    }
    let commit_ts: bool = client
        .query_one(
            "SELECT current_setting('track_commit_timestamp')::bool",
            &[],
        )
        .await?
        .get(0);
    let settings = args.task.settings();
    let retention_secs = settings.retention_secs;
    let known = asynq_state::known_queues(&mut conn).await?;
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        let row = read_row(&client, args, commit_ts, &id).await?;
        // Read after the row: a position confirmed at or past the WAL position read with the
        // row is past the row's commit.
        let slot = read_slot(&client, &args.slot).await?;
        let routed = row
            .as_ref()
            .map(|(r, _, _)| settings.queue_for(&r.event_name).to_string());
        let first = routed.clone().unwrap_or_else(|| args.task.queue.clone());
        let task =
            asynq_state::find(&mut conn, &asynq_state::search_order(&first, &known), &id).await?;
        let slot_info = SlotInfo {
            name: args.slot.clone(),
            exists: slot.is_some(),
            confirmed_flush_lsn: slot.as_ref().map(|s| s.confirmed_text.clone()),
            past_row_commit: match (&slot, &row) {
                (Some(slot), Some((_, _, position))) if slot.past(position) => Some(true),
                _ => None,
            },
        };
        let within_retention = match &row {
            Some((r, _, _)) => created_within(&client, &r.created_at, retention_secs).await?,
            None => false,
        };
        let row_info = row.map(|(_, info, _)| info);
        let verdict = verdict::judge(&verdict::Facts {
            row: row_info.as_ref(),
            slot: &slot_info,
            task: task.as_ref(),
            routed_queue: routed.as_deref(),
            retention_secs,
            created_within_retention: within_retention,
        });
        out.push(Trace {
            event_id: id,
            row: row_info,
            slot: slot_info,
            routed_queue: routed,
            task,
            verdict,
        });
    }
    Ok(out)
}

/// Whether `created_at` is less than the task retention ago (by the database's clock, which
/// wrote it).
async fn created_within(
    client: &tokio_postgres::Client,
    created_at: &str,
    retention_secs: i64,
) -> Result<bool, OperatorError> {
    Ok(client
        .query_one(
            "SELECT $1::text::timestamptz > now() - make_interval(secs => $2)",
            &[&created_at, &(retention_secs as f64)],
        )
        .await?
        .get(0))
}

/// The traces as text, one block per event.
pub fn render(traces: &[Trace]) -> String {
    let mut s = String::new();
    for t in traces {
        let _ = writeln!(s, "event    {}", t.event_id);
        match &t.row {
            None => {
                let _ = writeln!(s, "  row      none in the table");
            }
            Some(r) => {
                let _ = writeln!(
                    s,
                    "  row      {} · created {} · published {} · attempts {}{}{}",
                    asynq_state::one_line(&r.event_name),
                    r.created_at,
                    r.published_at.as_deref().unwrap_or("no"),
                    r.attempts,
                    r.last_error
                        .as_deref()
                        .map(|e| format!(" · last error: {}", asynq_state::one_line(e)))
                        .unwrap_or_default(),
                    r.dead_at
                        .as_deref()
                        .map(|d| format!(" · dead letter since {d}"))
                        .unwrap_or_default(),
                );
                let _ = writeln!(
                    s,
                    "           last written by xid {} ({}); WAL at {} when read",
                    r.last_write_xid,
                    r.last_write_committed_at
                        .as_deref()
                        .map(|c| format!("committed {c}"))
                        .unwrap_or_else(
                            || "commit time not kept: track_commit_timestamp is off".into()
                        ),
                    r.wal_lsn_when_read,
                );
            }
        }
        let slot = match (&t.slot.confirmed_flush_lsn, t.slot.past_row_commit) {
            (None, _) => "does not exist".to_owned(),
            (Some(c), Some(true)) => format!("confirmed {c}: past the row's commit"),
            (Some(c), _) if t.row.is_some() => {
                format!("confirmed {c}: not known to be past the row's commit")
            }
            (Some(c), _) => format!("confirmed {c}"),
        };
        let _ = writeln!(s, "  slot     {} {slot}", t.slot.name);
        let task = match &t.task {
            Some(task) => task.describe(),
            None => match &t.routed_queue {
                Some(q) => format!("absent (routed to queue {q}; no task hash in any queue)"),
                None => "absent (no task hash in any queue)".into(),
            },
        };
        let _ = writeln!(s, "  task     {task}");
        let _ = writeln!(s, "  verdict  {}", t.verdict.text);
    }
    s
}
