//! `outbox-relay reconcile`: finds published rows whose tasks Valkey no longer has, and with
//! `--yes` enqueues them again.
//!
//! A published row's task counts as present in any asynq state (pending, active, scheduled,
//! retry, archived, or completed and kept for the retention), in its routed queue or any other
//! queue asynq knows. Only rows created less than the task retention ago can be judged: a
//! completed task is kept until completed_at + retention, and completed_at is after the row's
//! creation, so such a row's task, if it ever completed, is still there. Older rows are counted
//! and left alone. With retention 0 nothing can be judged, and reconcile says so.
//!
//! With `OUTBOX_DELETE_DELIVERED=true` delivered rows are gone from the table, and reconcile
//! has nothing to compare: it cannot find their lost tasks.

use crate::asynq_state;
use crate::config::{parse_positive_usize, ConfigError, DatabaseArgs, ValkeyArgs};
use crate::event_filter::{self, Delivery, EventFilter};
use crate::operator::{self, OperatorError, RefusedTask};
use crate::replay::{classify_page, Class};
use crate::sink::valkey::ValkeySink;
use crate::sink::{Batch, Sink};
use crate::task_args::TaskArgs;
use clap::Args;
use std::fmt::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Settings of `outbox-relay reconcile`.
#[derive(Debug, Clone, Args)]
pub struct ReconcileArgs {
    /// `--since` is required: rows created at or after it are compared.
    #[command(flatten)]
    pub filter: EventFilter,
    /// Enqueue the missing tasks again (without it: only report them).
    #[arg(long)]
    pub yes: bool,
    /// Rows per page: one query and one Valkey round trip per queue.
    #[arg(long, default_value_t = 500, value_parser = parse_positive_usize)]
    pub batch: usize,
    #[command(flatten)]
    pub db: DatabaseArgs,
    #[command(flatten)]
    pub valkey: ValkeyArgs,
    #[command(flatten)]
    pub task: TaskArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

impl ReconcileArgs {
    /// `--since` bounds the work; retention 0 leaves nothing to judge.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.filter.since.is_none() {
            return Err(ConfigError::Invalid {
                setting: "--since".into(),
                reason: "reconcile needs --since (e.g. --since 2h, or the time before a Valkey \
                         restart)"
                    .into(),
            });
        }
        if self.task.task_retention.is_zero() {
            return Err(ConfigError::Invalid {
                setting: "OUTBOX_TASK_RETENTION".into(),
                reason: "with a task retention of 0 asynq deletes completed tasks at once, so a \
                         lost task and a completed one look the same: reconcile cannot judge"
                    .into(),
            });
        }
        self.db.target()?;
        self.valkey.target().map(|_| ())
    }
}

/// A published row whose task is missing.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MissingTask {
    pub event_id: String,
    pub event_name: String,
    pub created_at: String,
    pub published_at: Option<String>,
    pub queue: String,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReconcileSummary {
    /// Whether the missing tasks were enqueued (`--yes`).
    pub performed: bool,
    /// Published rows compared.
    pub checked: u64,
    /// Of those, rows whose task exists (any state).
    pub present: u64,
    /// Rows whose task is missing.
    pub missing: Vec<MissingTask>,
    /// Tasks enqueued again (`--yes`).
    pub enqueued: u64,
    /// Missing tasks Valkey refused for good (`--yes`): still missing. The command exits with
    /// 1 after the report.
    pub refused: Vec<RefusedTask>,
    /// Published rows in the range but created longer ago than the retention: not judged.
    pub too_old: i64,
    /// Rows that cannot become tasks under these settings (logged).
    pub bad_rows: u64,
    pub retention_secs: i64,
}

/// Compares, and with `--yes` heals.
pub async fn reconcile(args: &ReconcileArgs) -> Result<ReconcileSummary, OperatorError> {
    let (client, mut conn) = crate::operator::connect(&args.db, &args.valkey).await?;
    let settings = args.task.settings();
    let retention = args.task.task_retention.as_secs_f64();
    let mut cond = args.filter.condition(&[], Delivery::Published);
    let too_old_sql = format!(
        "SELECT count(*) FROM {} {} AND created_at <= now() - make_interval(secs => ${})",
        args.db.table.sql(),
        cond.sql,
        cond.params.len() + 1
    );
    let mut params = cond.refs();
    params.push(&retention);
    let too_old: i64 = client.query_one(&too_old_sql, &params).await?.get(0);
    drop(params);
    cond.push(
        "created_at > now() - make_interval(secs => $?)",
        Box::new(retention),
    );
    let sink = match args.yes {
        true => Some(
            ValkeySink::connect(args.valkey.target()?)
                .await?
                .waiting_for_replicas(args.valkey.replica_wait()?),
        ),
        false => None,
    };
    let known = asynq_state::known_queues(&mut conn).await?;
    let mut s = ReconcileSummary {
        performed: args.yes,
        too_old,
        retention_secs: settings.retention_secs,
        ..ReconcileSummary::default()
    };
    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut pager = event_filter::Pager::new(&client, &args.db.table, &cond, args.batch);
    while let Some(rows) = pager.next_page().await? {
        s.checked += rows.len() as u64;
        let page = classify_page(&mut conn, &settings, rows).await?;
        s.bad_rows += page.bad_rows;
        let mut batch = Batch::default();
        for (row, task, class, _) in page.tasks {
            if class != Class::Absent || elsewhere(&mut conn, &known, &task.queue, &task.id).await?
            {
                s.present += 1;
                continue;
            }
            s.missing.push(MissingTask {
                event_id: row.event_id,
                event_name: row.event_name,
                created_at: row.created_at,
                published_at: row.published_at,
                queue: task.queue.to_string(),
            });
            batch.push(task);
        }
        if let Some(sink) = &sink {
            let batch = Arc::new(batch);
            let out = sink.write(batch.clone()).await?;
            s.refused.extend(operator::refused_tasks(&batch, &out)?);
            s.enqueued += out.enqueued as u64;
        }
        if last_report.elapsed() >= PROGRESS_EVERY {
            last_report = Instant::now();
            tracing::info!(
                rows = s.checked,
                missing = s.missing.len(),
                rows_per_sec = (s.checked as f64 / started.elapsed().as_secs_f64()) as u64,
                "reconcile in progress"
            );
        }
    }
    if !s.missing.is_empty() {
        tracing::warn!(
            missing = s.missing.len(),
            enqueued = s.enqueued,
            refused = s.refused.len(),
            "published events whose tasks valkey lost"
        );
    }
    Ok(s)
}

/// Whether the task exists in another queue asynq knows (the routes changed since).
async fn elsewhere(
    conn: &mut crate::valkey::ValkeyConnection,
    known: &[String],
    routed: &str,
    id: &str,
) -> Result<bool, OperatorError> {
    for q in known.iter().filter(|q| q.as_str() != routed) {
        if asynq_state::states(conn, q, &[id]).await?[0].is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The summary as text; every missing event on a line of its own.
pub fn render(s: &ReconcileSummary) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "reconcile: {} published row(s) compared with Valkey: {} present, {} missing",
        s.checked,
        s.present,
        s.missing.len()
    );
    if s.too_old > 0 {
        let _ = writeln!(
            out,
            "  {} older published row(s) not judged: created more than the task retention ({}s) \
             ago, their completed tasks may have expired",
            s.too_old, s.retention_secs
        );
    }
    if s.bad_rows > 0 {
        let _ = writeln!(out, "  {} row(s) cannot become tasks (logged)", s.bad_rows);
    }
    for m in &s.missing {
        let _ = writeln!(
            out,
            "missing  {}  {}  created {}  queue {}",
            m.event_id,
            asynq_state::one_line(&m.event_name),
            m.created_at,
            m.queue
        );
    }
    if s.performed {
        let _ = writeln!(out, "enqueued {} missing task(s) again", s.enqueued);
        operator::render_refused(&mut out, &s.refused);
    } else if !s.missing.is_empty() {
        let _ = writeln!(out, "run again with --yes to enqueue them");
    }
    out
}
