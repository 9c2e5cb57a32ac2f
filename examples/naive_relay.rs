//! The naive baseline of `scripts/bench.sh`: a polling relay that calls an asynq client once per
//! row, as users run today. One Valkey round trip per event, no pipelining.
//!
//! Each round claims up to `--batch` unpublished rows (`FOR UPDATE SKIP LOCKED`, oldest id
//! first), builds every task with the relay's own [`TaskSettings::build`] (so the bytes are the
//! relay's and only the round-trip pattern differs), enqueues them one `EVALSHA` of asynq's
//! single-task enqueue script at a time, marks the enqueued rows published and commits. It exits
//! when a round finds no row, and prints one JSON line: `{"events": N, "seconds": S}`.
//!
//! `SADD asynq:queues` runs once per queue per process, as the Go client does.
//!
//! ```sh
//! cargo run --release --example naive_relay -- --database-url URL --redis-url URL
//! ```

use anyhow::Context;
use clap::Parser;
use outbox_relay::config::{Cli, Command};
use outbox_relay::sink::valkey::{pending_key, task_key, QUEUES_KEY};
use outbox_relay::task::{RowText, TaskSettings};
use std::collections::HashSet;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// asynq's own enqueue script (rdb.go `enqueueCmd`): KEYS = task hash, pending list;
/// ARGV = msg, task id, now in ns.
const ENQUEUE_ONE: &str = r#"
if redis.call("EXISTS", KEYS[1]) == 1 then
    return 0
end
redis.call("HSET", KEYS[1],
           "msg", ARGV[1],
           "state", "pending",
           "pending_since", ARGV[3])
redis.call("LPUSH", KEYS[2], ARGV[2])
return 1
"#;

const CLAIM: &str = "SELECT id, event_id::text, event_name, payload::text, metadata::text, \
                     created_at::text FROM outbox_events WHERE published_at IS NULL \
                     ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";

const MARK: &str = "UPDATE outbox_events SET published_at = now() WHERE id = ANY($1)";

/// The naive one-round-trip-per-event relay.
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL URL of the database holding outbox_events.
    #[arg(long)]
    database_url: String,
    /// Valkey/Redis URL.
    #[arg(long)]
    redis_url: String,
    /// Rows claimed per transaction.
    #[arg(long, default_value_t = 100)]
    batch: i64,
}

/// The relay's default task settings, so the task bytes are exactly the relay's.
fn default_task_settings(database_url: &str) -> anyhow::Result<TaskSettings> {
    let argv = ["outbox-relay", "run", "--database-url", database_url];
    match Cli::try_parse_from(argv)?.command {
        Command::Run(args) => Ok(args.task_settings()),
        _ => unreachable!("parsed a run command"),
    }
}

fn now_ns() -> String {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
        .to_string()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings = default_task_settings(&args.database_url)?;
    let (mut pg, conn) = tokio_postgres::connect(&args.database_url, tokio_postgres::NoTls)
        .await
        .context("connect to postgres")?;
    tokio::spawn(conn);
    let mut valkey = redis::Client::open(args.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await
        .context("connect to valkey")?;
    let script = redis::Script::new(ENQUEUE_ONE);
    let mut registered: HashSet<String> = HashSet::new();

    let started = Instant::now();
    let mut events = 0u64;
    let mut scratch = Vec::new();
    loop {
        let tx = pg.transaction().await?;
        let rows = tx.query(CLAIM, &[&args.batch]).await?;
        if rows.is_empty() {
            tx.commit().await?;
            break;
        }
        let mut enqueued: Vec<i64> = Vec::with_capacity(rows.len());
        for row in &rows {
            let metadata: String = row.get(4);
            let text = RowText {
                id: None,
                event_id: row.get(1),
                event_name: row.get(2),
                payload: row.get(3),
                metadata: Some(&metadata),
                created_at: row.get(5),
            };
            let task = settings.build(&text, &mut scratch).map_err(|e| {
                anyhow::anyhow!("row {} cannot become a task: {e}", row.get::<_, i64>(0))
            })?;
            if registered.insert(task.queue.to_string()) {
                let _: i64 = redis::cmd("SADD")
                    .arg(QUEUES_KEY)
                    .arg(&*task.queue)
                    .query_async(&mut valkey)
                    .await?;
            }
            let _created: i64 = script
                .key(task_key(&task.queue, &task.id))
                .key(pending_key(&task.queue))
                .arg(&task.msg[..])
                .arg(&task.id)
                .arg(now_ns())
                .invoke_async(&mut valkey)
                .await?;
            enqueued.push(row.get(0));
        }
        tx.execute(MARK, &[&enqueued]).await?;
        tx.commit().await?;
        events += enqueued.len() as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({ "events": events, "seconds": seconds })
    );
    Ok(())
}
