//! Operator commands on the outbox table: dead letters and cleanup (also run periodically inside
//! `run` when configured). Long work logs its progress at a steady interval.

use crate::command::{self, printable, CommandError};
use crate::config::{CleanupArgs, DatabaseArgs, DeadLettersCommand};
use crate::relay::RelayError;
use crate::replication::setup;
use crate::store::{DeadLetter, Store};
use std::fmt::Write;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How often long work reports progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Deletes published rows older than `older_than` in batches of `batch`; returns the total.
pub async fn cleanup(
    client: &tokio_postgres::Client,
    store: &Store,
    older_than: Duration,
    batch: usize,
) -> Result<u64, tokio_postgres::Error> {
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut total = 0u64;
    loop {
        let n = store.delete_published(client, older_than, limit).await?;
        total += n;
        if n < batch as u64 {
            break;
        }
        if last_report.elapsed() >= PROGRESS_EVERY {
            last_report = Instant::now();
            let rate = total as f64 / started.elapsed().as_secs_f64().max(0.001);
            tracing::info!(
                deleted = total,
                rows_per_sec = rate as u64,
                "cleanup in progress"
            );
        }
    }
    tracing::info!(
        deleted = total,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "cleanup done"
    );
    Ok(total)
}

/// Runs [`cleanup`] every `interval` until `shutdown`.
pub async fn periodic_cleanup(
    pool: deadpool_postgres::Pool,
    store: Store,
    older_than: Duration,
    interval: Duration,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let result = match pool.get().await {
            Ok(client) => cleanup(&client, &store, older_than, 10_000)
                .await
                .map(|_| ()),
            Err(e) => {
                tracing::warn!(error = %e, "periodic cleanup: no postgres connection");
                continue;
            }
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "periodic cleanup failed");
        }
    }
}

/// Dead letters as a compact table.
pub fn render_dead_letters(rows: &[DeadLetter]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<36}  {:<24}  {:>8}  {:<32}  LAST ERROR",
        "EVENT ID", "EVENT NAME", "ATTEMPTS", "DEAD SINCE"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<36}  {:<24}  {:>8}  {:<32}  {}",
            printable(&r.event_id),
            printable(&r.event_name),
            r.attempts,
            r.dead_at,
            printable(r.last_error.as_deref().unwrap_or(""))
        );
    }
    let _ = writeln!(s, "{} dead letter(s)", rows.len());
    s
}

/// The database, its outbox table checked as the relay checks it at start (a table whose `id`
/// is not a bigint would make these commands fail on their first row).
async fn checked_connect(db: &DatabaseArgs) -> Result<tokio_postgres::Client, CommandError> {
    let client = db.target()?.connect().await?;
    setup::check_table(&client, &db.table, false)
        .await
        .map_err(RelayError::from)?;
    Ok(client)
}

/// `outbox-relay cleanup`: deletes old published rows, then says how many; with `--dry-run`,
/// counts them.
pub async fn execute_cleanup(args: &CleanupArgs) -> Result<(), CommandError> {
    let client = checked_connect(&args.db).await?;
    let store = Store::new(args.db.table.clone());
    if args.dry_run {
        let n = store.count_published(&client, args.older_than).await?;
        println!("dry run: {n} published row(s) would be deleted");
        return Ok(());
    }
    let n = cleanup(&client, &store, args.older_than, args.batch).await?;
    println!("deleted {n} published row(s)");
    Ok(())
}

/// `outbox-relay dead-letters list|retry`.
pub async fn execute_dead_letters(cmd: &DeadLettersCommand) -> Result<(), CommandError> {
    match cmd {
        DeadLettersCommand::List { db, json } => {
            let client = checked_connect(db).await?;
            let rows = Store::new(db.table.clone()).dead_letters(&client).await?;
            command::print(*json, rows.as_slice(), render_dead_letters)
        }
        DeadLettersCommand::Retry { db, all, event_id } => {
            let client = checked_connect(db).await?;
            let store = Store::new(db.table.clone());
            let ids = (!all).then_some(event_id.as_slice());
            let n = store.retry_dead_letters(&client, ids).await?;
            println!("{n} dead letter(s) will be delivered again");
            let given = event_id
                .iter()
                .collect::<std::collections::BTreeSet<_>>()
                .len();
            let missed = (given as u64).saturating_sub(n);
            if !all && missed > 0 {
                eprintln!("{missed} of the {given} event id(s) given are not dead letters");
            }
            Ok(())
        }
    }
}
