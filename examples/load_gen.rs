//! The steady-load generator of `scripts/bench.sh`: single-row outbox transactions at a fixed
//! rate, from several connections, for a fixed time.
//!
//! Event `i` is due at `start + i / rate`; each connection takes the next index, waits until it
//! is due and commits one `INSERT` (autocommit). A connection that falls behind does not sleep
//! until it has caught up, and nothing is inserted after `--seconds`: the achieved rate is what
//! the machine sustained, never more than the target. Each row's `event_id` and inserting
//! transaction id (`xmin`) go to `--out` as `event_id<TAB>xid` lines, so the benchmark can read
//! the commit time (`pg_xact_commit_timestamp`) even after the relay marked the row published.
//! Prints one JSON line with the target and achieved rates, and when the load started and ended
//! on the monotonic clock (`CLOCK_MONOTONIC`, Python's `time.monotonic()` on Linux), so that a
//! probe sampling beside it (bench/send_lag.py) can take the load's own window.
//!
//! ```sh
//! cargo run --release --example load_gen -- --database-url URL --rate 5000 --seconds 10 --out rows.tsv
//! ```

use anyhow::Context;
use clap::Parser;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// One outbox row per transaction; the payload (~220 bytes of jsonb) and the trace context come
/// from the client, as an application sends them.
const INSERT: &str = "INSERT INTO outbox_events (event_id, event_name, payload, metadata) \
                      VALUES (gen_random_uuid(), $1, $2::text::jsonb, $3::text::jsonb) \
                      RETURNING event_id::text, xmin::text";

/// Single-row outbox transactions at a fixed rate.
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL URL of the database holding outbox_events.
    #[arg(long)]
    database_url: String,
    /// Target inserts (transactions) per second.
    #[arg(long)]
    rate: f64,
    /// How long to insert.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Connections inserting concurrently.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Where to write `event_id<TAB>xid` per inserted row.
    #[arg(long)]
    out: std::path::PathBuf,
    /// The rows' event name.
    #[arg(long, default_value = "order.placed")]
    event_name: String,
}

/// A realistic order event (about 220 bytes as jsonb text).
fn payload(i: u64) -> String {
    format!(
        r#"{{"order_id":"ord_{i:010}","customer_id":"cus_{:012x}","currency":"EUR","total_cents":{},"items":[{{"sku":"SKU-{}","qty":{},"price_cents":1999}},{{"sku":"SKU-{}","qty":1,"price_cents":4550}}]}}"#,
        i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 16,
        1000 + i * 7919 % 90_000,
        i % 977,
        1 + i % 3,
        i % 541,
    )
}

/// W3C trace context, as the Go kit stores it.
fn metadata() -> String {
    let trace: u128 = rand::random();
    let span: u64 = rand::random();
    format!(r#"{{"traceparent":"00-{trace:032x}-{span:016x}-01","producer":"checkout"}}"#)
}

/// `CLOCK_MONOTONIC` in seconds: the clock `std::time::Instant` reads on Linux, and Python's
/// `time.monotonic()`.
fn monotonic_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// What one connection inserted: (event_id, xid).
type Inserted = Vec<(String, String)>;

async fn connection(
    args: Arc<Args>,
    next: Arc<AtomicU64>,
    planned: u64,
    start: Instant,
    deadline: Instant,
) -> anyhow::Result<Inserted> {
    let (client, conn) = tokio_postgres::connect(&args.database_url, tokio_postgres::NoTls)
        .await
        .context("connect to postgres")?;
    tokio::spawn(conn);
    let insert = client.prepare(INSERT).await?;
    let mut out = Vec::new();
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= planned {
            break;
        }
        let due = start + Duration::from_secs_f64(i as f64 / args.rate);
        tokio::time::sleep_until(due).await;
        if Instant::now() >= deadline {
            break;
        }
        let row = client
            .query_one(&insert, &[&args.event_name, &payload(i), &metadata()])
            .await?;
        out.push((row.get(0), row.get(1)));
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    anyhow::ensure!(
        args.rate > 0.0 && args.seconds > 0.0,
        "rate and seconds must be positive"
    );
    let planned = (args.rate * args.seconds).round() as u64;
    let next = Arc::new(AtomicU64::new(0));
    // Connections are set up before the clock starts.
    let lead = Duration::from_millis(300);
    let start = Instant::now() + lead;
    let start_monotonic_s = monotonic_s() + lead.as_secs_f64();
    let deadline = start + Duration::from_secs_f64(args.seconds);
    let mut tasks = Vec::new();
    for _ in 0..args.connections.max(1) {
        tasks.push(tokio::spawn(connection(
            args.clone(),
            next.clone(),
            planned,
            start,
            deadline,
        )));
    }
    let mut rows: Inserted = Vec::with_capacity(planned as usize);
    for t in tasks {
        rows.extend(t.await??);
    }
    // No insert was sent after the deadline; every connection may have finished before it.
    let end_monotonic_s = monotonic_s().min(start_monotonic_s + args.seconds);
    let elapsed = start.elapsed().as_secs_f64().max(args.seconds);
    let mut file = std::io::BufWriter::new(std::fs::File::create(&args.out)?);
    for (event_id, xid) in &rows {
        writeln!(file, "{event_id}\t{xid}")?;
    }
    file.flush()?;
    println!(
        "{}",
        serde_json::json!({
            "target_rate": args.rate,
            "planned": planned,
            "inserted": rows.len(),
            "seconds": elapsed,
            "achieved_rate": rows.len() as f64 / elapsed,
            "connections": args.connections,
            // The first insert was due at the start.
            "load_start_monotonic_s": start_monotonic_s,
            "load_end_monotonic_s": end_monotonic_s,
        })
    );
    Ok(())
}
