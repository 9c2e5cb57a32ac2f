//! `outbox-relay replay`: delivers published rows again, from the table, as the same tasks.
//!
//! The rows are chosen by `--since`/`--until` (on `created_at`), `--event-name` and
//! `--event-id`; only published rows are replayed (unpublished ones are still the relay's to
//! deliver, dead letters are `dead-letters retry`'s). Without `--yes` it is a dry run: counts
//! and a sample, nothing written.
//!
//! TaskID dedupe is explicit. The task of a row has TaskID = event_id, and asynq refuses an id
//! whose hash still exists. So a row whose task is still pending, scheduled, retrying or active
//! is skipped (its consumer gets it anyway); one whose task is kept as completed (within the
//! retention) or archived is skipped too unless `--force`, which first deletes that task the
//! way asynq's Inspector `DeleteTask` does and then enqueues the row's task anew. Tasks are
//! enqueued with the relay's own script (an id created meanwhile is not written twice).
//!
//! A task Valkey refuses for good (its queue's pending list has the wrong type) is listed in the
//! report and the command exits with 1. With `--force` such a task was deleted first: its row is
//! still published, so the same replay run again once the queue is mended finds it absent and
//! enqueues it.

use crate::asynq_state::{self, Deleted};
use crate::config::{parse_positive_usize, DatabaseArgs, ValkeyArgs};
use crate::event_filter::{self, parse_event_id, Delivery, EventFilter, EventRow};
use crate::operator::{self, OperatorError, RefusedTask};
use crate::sink::valkey::ValkeySink;
use crate::sink::{Batch, Sink};
use crate::task::TaskSettings;
use crate::task_args::TaskArgs;
use crate::valkey::ValkeyConnection;
use clap::Args;
use std::collections::BTreeSet;
use std::fmt::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a long replay logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Settings of `outbox-relay replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub filter: EventFilter,
    /// Only these events (repeatable).
    #[arg(
        long = "event-id",
        num_args = 1..,
        value_parser = parse_event_id,
        required_unless_present_any = ["since", "until", "event_name"]
    )]
    pub event_id: Vec<String>,
    /// Enqueue the tasks (without it: a dry run that counts and shows a sample).
    #[arg(long)]
    pub yes: bool,
    /// Also replay events whose task asynq still keeps as completed or archived: delete that
    /// task first, as asynq's Inspector does, then enqueue the row's task.
    #[arg(long)]
    pub force: bool,
    /// Enqueue into queues Valkey has never seen (not in `asynq:queues`).
    #[arg(long)]
    pub create_queue: bool,
    /// Rows shown in the dry run's sample.
    #[arg(long, default_value_t = 10)]
    pub sample: usize,
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

/// What a row's task is now, and so what replay does with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// No task hash: enqueued.
    Absent,
    /// Completed (within retention) or archived: skipped, or with `--force` deleted and
    /// enqueued.
    Kept,
    /// Pending, scheduled, retry, aggregating or active: skipped (consumers get it anyway).
    Queued,
}

fn classify(state: Option<&str>) -> Class {
    match state {
        None => Class::Absent,
        Some("completed" | "archived") => Class::Kept,
        Some(_) => Class::Queued,
    }
}

/// One row of the sample.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SampleRow {
    pub event_id: String,
    pub event_name: String,
    pub created_at: String,
    pub queue: String,
    /// asynq's state of the task now, `None` when absent.
    pub task_state: Option<String>,
    pub class: Class,
}

/// The outcome of a replay or of its dry run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReplaySummary {
    /// Whether tasks were written (`--yes`).
    pub performed: bool,
    pub force: bool,
    /// Published rows that match.
    pub matched: u64,
    /// Rows without a task: enqueued (or, in a dry run, to be enqueued).
    pub absent: u64,
    /// Rows whose task is kept as completed or archived.
    pub kept: u64,
    /// Rows whose task is still queued or running: skipped.
    pub queued: u64,
    /// Rows that cannot become tasks (logged with their event id).
    pub bad_rows: u64,
    /// Tasks written (`--yes`): the absent ones, plus the kept ones with `--force`.
    pub enqueued: u64,
    /// Kept tasks deleted first (`--force`).
    pub deleted: u64,
    /// Tasks that appeared between the check and the write (not written twice).
    pub duplicates: u64,
    /// Matching rows not replayed: unpublished (the relay delivers them) and dead letters.
    pub unpublished: i64,
    pub dead_letters: i64,
    /// Queues the rows go to that Valkey has never seen.
    pub unknown_queues: Vec<String>,
    /// Tasks Valkey refused for good (`--yes`): not written; with `--force` their kept task was
    /// deleted first. The command exits with 1 after the report.
    pub refused: Vec<RefusedTask>,
    pub sample: Vec<SampleRow>,
}

/// One page: the rows' tasks, classified by their current state.
pub struct Classified {
    pub tasks: Vec<(EventRow, crate::task::Task, Class, Option<String>)>,
    pub bad_rows: u64,
}

/// Builds each row's task and reads its state in its routed queue.
pub async fn classify_page(
    conn: &mut ValkeyConnection,
    settings: &TaskSettings,
    rows: Vec<EventRow>,
) -> Result<Classified, OperatorError> {
    let mut scratch = Vec::new();
    let mut built = Vec::with_capacity(rows.len());
    let mut bad_rows = 0;
    for row in rows {
        match settings.build(&row.text(), &mut scratch) {
            Ok(task) => built.push((row, task)),
            Err(e) => {
                tracing::warn!(event_id = %row.event_id, error = %e, "row cannot become a task; not replayed");
                bad_rows += 1;
            }
        }
    }
    let queues: BTreeSet<Arc<str>> = built.iter().map(|(_, t)| t.queue.clone()).collect();
    let mut tasks = Vec::with_capacity(built.len());
    let mut states = std::collections::HashMap::new();
    for q in &queues {
        let ids: Vec<&str> = built
            .iter()
            .filter(|(_, t)| &t.queue == q)
            .map(|(_, t)| t.id.as_str())
            .collect();
        let found = asynq_state::states(conn, q, &ids).await?;
        for (id, state) in ids.into_iter().zip(found) {
            states.insert(id.to_owned(), state);
        }
    }
    for (row, task) in built {
        let state = states.remove(&task.id).flatten();
        tasks.push((row, task, classify(state.as_deref()), state));
    }
    Ok(Classified { tasks, bad_rows })
}

/// Counts of the matching rows that are not published: (unpublished, dead letters).
async fn not_published(
    client: &tokio_postgres::Client,
    args: &ReplayArgs,
) -> Result<(i64, i64), OperatorError> {
    let cond = args.filter.condition(&args.event_id, Delivery::Any);
    let sql = format!(
        "SELECT count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NULL), \
                count(*) FILTER (WHERE published_at IS NULL AND dead_at IS NOT NULL) \
         FROM {} {}",
        args.db.table.sql(),
        cond.sql
    );
    let row = client.query_one(&sql, &cond.refs()).await?;
    Ok((row.get(0), row.get(1)))
}

/// One pass over the matching published rows: counts (and a sample) with `sink` unset, the
/// replay itself with it.
async fn pass(
    args: &ReplayArgs,
    client: &tokio_postgres::Client,
    conn: &mut ValkeyConnection,
    sink: Option<&ValkeySink>,
) -> Result<ReplaySummary, OperatorError> {
    let settings = args.task.settings();
    let known = asynq_state::known_queues(conn).await?;
    let cond = args.filter.condition(&args.event_id, Delivery::Published);
    let mut s = ReplaySummary {
        performed: sink.is_some(),
        force: args.force,
        ..ReplaySummary::default()
    };
    let mut unknown = BTreeSet::new();
    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut pager = event_filter::Pager::new(client, &args.db.table, &cond, args.batch);
    while let Some(rows) = pager.next_page().await? {
        s.matched += rows.len() as u64;
        let page = classify_page(conn, &settings, rows).await?;
        s.bad_rows += page.bad_rows;
        let mut batch = Batch::default();
        for (row, task, class, state) in page.tasks {
            if !known.iter().any(|k| **k == *task.queue) {
                unknown.insert(task.queue.to_string());
            }
            match class {
                Class::Absent => s.absent += 1,
                Class::Kept => s.kept += 1,
                Class::Queued => s.queued += 1,
            }
            if s.sample.len() < args.sample {
                s.sample.push(SampleRow {
                    event_id: row.event_id.clone(),
                    event_name: row.event_name.clone(),
                    created_at: row.created_at.clone(),
                    queue: task.queue.to_string(),
                    task_state: state,
                    class,
                });
            }
            if sink.is_none() {
                continue;
            }
            if class == Class::Kept && args.force {
                match asynq_state::delete_task(conn, &task.queue, &task.id).await? {
                    Deleted::Yes => s.deleted += 1,
                    Deleted::NotFound => {}
                    // Running again meanwhile: its consumer gets it anyway.
                    Deleted::Active => continue,
                }
                batch.push(task);
            } else if class == Class::Absent {
                batch.push(task);
            }
        }
        if let Some(sink) = sink {
            let batch = Arc::new(batch);
            let out = sink.write(batch.clone()).await?;
            s.refused.extend(operator::refused_tasks(&batch, &out)?);
            s.enqueued += out.enqueued as u64;
            s.duplicates += out.duplicates as u64;
        }
        if last_report.elapsed() >= PROGRESS_EVERY {
            last_report = Instant::now();
            tracing::info!(
                rows = s.matched,
                enqueued = s.enqueued,
                rows_per_sec = (s.matched as f64 / started.elapsed().as_secs_f64()) as u64,
                "replay in progress"
            );
        }
    }
    s.unknown_queues = unknown.into_iter().collect();
    Ok(s)
}

/// The dry run, and with `--yes` the replay.
pub async fn replay(args: &ReplayArgs) -> Result<ReplaySummary, OperatorError> {
    let (client, mut conn) = crate::operator::connect(&args.db, &args.valkey).await?;
    let (unpublished, dead_letters) = not_published(&client, args).await?;
    let mut summary = pass(args, &client, &mut conn, None).await?;
    summary.unpublished = unpublished;
    summary.dead_letters = dead_letters;
    if summary.matched == 0 {
        return Err(OperatorError::Refused(format!(
            "nothing to replay: no published row matches{}",
            if unpublished + dead_letters > 0 {
                format!(
                    " ({unpublished} unpublished row(s) and {dead_letters} dead letter(s) do; \
                     the relay delivers the first, `dead-letters retry` the second)"
                )
            } else {
                " (check --since/--until, --event-name and --event-id)".into()
            }
        )));
    }
    if !args.yes {
        return Ok(summary);
    }
    if !summary.unknown_queues.is_empty() && !args.create_queue {
        return Err(OperatorError::Refused(format!(
            "queue(s) {} unknown to Valkey (not in asynq:queues): no asynq client or relay has \
             used them, so no server may consume them. Check OUTBOX_QUEUE and \
             OUTBOX_QUEUE_ROUTES, or pass --create-queue",
            summary.unknown_queues.join(", ")
        )));
    }
    let sink = ValkeySink::connect(args.valkey.target()?)
        .await?
        .waiting_for_replicas(args.valkey.replica_wait()?);
    let mut done = pass(args, &client, &mut conn, Some(&sink)).await?;
    done.unpublished = unpublished;
    done.dead_letters = dead_letters;
    tracing::info!(
        rows = done.matched,
        enqueued = done.enqueued,
        deleted = done.deleted,
        refused = done.refused.len(),
        "replay done"
    );
    Ok(done)
}

/// The summary as text.
pub fn render(s: &ReplaySummary) -> String {
    let mut out = String::new();
    let head = if s.performed {
        "replay"
    } else {
        "replay (dry run)"
    };
    let _ = writeln!(out, "{head}: {} published row(s) match", s.matched);
    let kept_note = if s.force {
        "deleted as asynq's Inspector does, then enqueued (--force)"
    } else {
        "skipped: asynq refuses their TaskID while it keeps them; --force replaces them"
    };
    let _ = writeln!(
        out,
        "  no task in Valkey        {:>8}  {}",
        s.absent,
        if s.performed {
            "enqueued"
        } else {
            "will be enqueued"
        }
    );
    let _ = writeln!(out, "  completed or archived    {:>8}  {kept_note}", s.kept);
    let _ = writeln!(
        out,
        "  still queued or running  {:>8}  skipped: consumers get them anyway",
        s.queued
    );
    if s.bad_rows > 0 {
        let _ = writeln!(
            out,
            "  cannot become tasks      {:>8}  skipped (logged with their event ids)",
            s.bad_rows
        );
    }
    if s.unpublished + s.dead_letters > 0 {
        let _ = writeln!(
            out,
            "  not replayed: {} unpublished (the relay delivers them), {} dead letter(s) \
             (`dead-letters retry`)",
            s.unpublished, s.dead_letters
        );
    }
    if !s.unknown_queues.is_empty() {
        let _ = writeln!(
            out,
            "  queues unknown to Valkey: {} (--yes refuses them without --create-queue)",
            s.unknown_queues.join(", ")
        );
    }
    if s.performed {
        let _ = writeln!(
            out,
            "enqueued {} task(s){}{}",
            s.enqueued,
            if s.deleted > 0 {
                format!(", after deleting {} kept task(s)", s.deleted)
            } else {
                String::new()
            },
            if s.duplicates > 0 {
                format!("; {} appeared meanwhile and were left alone", s.duplicates)
            } else {
                String::new()
            }
        );
        operator::render_refused(&mut out, &s.refused);
        return out;
    }
    if !s.sample.is_empty() {
        let _ = writeln!(
            out,
            "sample:\n  {:<36}  {:<24}  {:<32}  {:<10}  TASK NOW",
            "EVENT ID", "EVENT NAME", "CREATED", "QUEUE"
        );
        for r in &s.sample {
            let _ = writeln!(
                out,
                "  {:<36}  {:<24}  {:<32}  {:<10}  {}",
                r.event_id,
                asynq_state::one_line(&r.event_name),
                r.created_at,
                r.queue,
                r.task_state.as_deref().unwrap_or("absent")
            );
        }
    }
    let n = s.absent + if s.force { s.kept } else { 0 };
    let _ = writeln!(
        out,
        "dry run: nothing written; run again with --yes to enqueue {n} task(s)"
    );
    out
}
