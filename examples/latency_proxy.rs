//! The link of `scripts/bench.sh`: a TCP proxy that delays every byte by a fixed time each way,
//! as a network link between hosts would (this kernel has no `netem`).
//!
//! Each accepted connection gets a connection to `--upstream` and, per direction, a reader and a
//! writer thread. The reader timestamps every chunk it reads; the writer sends that chunk, as it
//! was read, once `--delay-ms` has passed since then. Nothing is batched (one write per chunk
//! read) and nothing is reordered (one writer per direction, due times in read order). A
//! direction holds at most `--window-bytes` in its delay line; beyond that its reader stops
//! reading, so the sender sees backpressure as it would from a full link, instead of the proxy
//! buffering without bound.
//!
//! Blocking threads, not an async runtime: tokio's timer has a resolution of 1 ms, too coarse for
//! a 0.5 ms delay, and each writer sets its own timer slack to 1 ns (the kernel's default lets a
//! sleep end up to 50 µs late). Threads cost nothing here: the relay opens a handful of
//! connections.
//!
//! `--stats FILE` is rewritten every 200 ms with cumulative counters: connections, chunks and
//! bytes per direction, and a histogram of how late each chunk left (its write started this long
//! after its due time), which the benchmark turns into the proxy's own overhead.
//!
//! Prints `listening 127.0.0.1:PORT` on stdout once it accepts connections; runs until killed
//! (or, with `--exit-with-stdin`, until its standard input closes).
//!
//! ```sh
//! cargo run --release --example latency_proxy -- --listen 127.0.0.1:0 --upstream 127.0.0.1:6379 --delay-ms 1
//! ```

use anyhow::Context;
use clap::Parser;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A TCP proxy that delays each direction by a fixed time.
#[derive(Debug, Parser)]
struct Args {
    /// Address to accept connections on (port 0: any free port, printed on stdout).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where each accepted connection is forwarded.
    #[arg(long)]
    upstream: SocketAddr,
    /// Delay of each direction, in milliseconds (0 forwards at once, through the same path).
    #[arg(long, default_value_t = 0.0)]
    delay_ms: f64,
    /// Bytes a direction holds in its delay line at most.
    #[arg(long, default_value_t = 4 << 20)]
    window_bytes: usize,
    /// Where the counters are written (JSON, rewritten every 200 ms).
    #[arg(long)]
    stats: Option<PathBuf>,
    /// Exit when standard input reaches its end: the benchmark holds it open, so a proxy never
    /// outlives a benchmark that was killed.
    #[arg(long)]
    exit_with_stdin: bool,
}

/// Size of one read; a chunk is what one read returned.
const READ_BYTES: usize = 64 << 10;
/// Chunks a direction's queue holds at most.
const QUEUE_CHUNKS: usize = 4096;
/// Lateness histogram: bucket `i` holds chunks that left less than `bound(i)` µs late.
const BUCKETS: usize = 64;

/// Upper bound (µs) of lateness bucket `i`: four buckets per power of two.
fn bucket_bound_us(i: usize) -> f64 {
    2f64.powf(i as f64 / 4.0)
}

fn bucket_of(late: Duration) -> usize {
    let us = late.as_secs_f64() * 1e6;
    (0..BUCKETS)
        .find(|&i| us < bucket_bound_us(i))
        .unwrap_or(BUCKETS - 1)
}

/// Counters of one direction, shared by every connection.
struct DirectionStats {
    chunks: AtomicU64,
    bytes: AtomicU64,
    max_late_ns: AtomicU64,
    late: [AtomicU64; BUCKETS],
}

impl Default for DirectionStats {
    fn default() -> Self {
        Self {
            chunks: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            max_late_ns: AtomicU64::new(0),
            late: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl DirectionStats {
    fn record(&self, bytes: usize, late: Duration) {
        self.chunks.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.max_late_ns
            .fetch_max(late.as_nanos() as u64, Ordering::Relaxed);
        self.late[bucket_of(late)].fetch_add(1, Ordering::Relaxed);
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "chunks": self.chunks.load(Ordering::Relaxed),
            "bytes": self.bytes.load(Ordering::Relaxed),
            "max_late_us": self.max_late_ns.load(Ordering::Relaxed) as f64 / 1e3,
            "late_hist": self.late.iter().map(|c| c.load(Ordering::Relaxed)).collect::<Vec<_>>(),
        })
    }
}

#[derive(Default)]
struct Stats {
    connections: AtomicU64,
    /// Client to upstream, upstream to client.
    up: DirectionStats,
    down: DirectionStats,
}

impl Stats {
    fn json(&self, delay: Duration) -> serde_json::Value {
        serde_json::json!({
            "delay_ms": delay.as_secs_f64() * 1e3,
            "connections": self.connections.load(Ordering::Relaxed),
            "bucket_bounds_us": (0..BUCKETS).map(bucket_bound_us).collect::<Vec<_>>(),
            "up": self.up.json(),
            "down": self.down.json(),
        })
    }
}

/// Bytes in a direction's delay line, bounded: the reader waits for room.
struct Window {
    used: Mutex<usize>,
    room: Condvar,
    cap: usize,
}

impl Window {
    fn new(cap: usize) -> Self {
        Self {
            used: Mutex::new(0),
            room: Condvar::new(),
            cap,
        }
    }

    /// Waits until `n` more bytes fit (a chunk larger than the window goes alone).
    fn take(&self, n: usize) {
        let mut used = self.used.lock().expect("window lock");
        while *used > 0 && *used + n > self.cap {
            used = self.room.wait(used).expect("window lock");
        }
        *used += n;
    }

    fn give(&self, n: usize) {
        *self.used.lock().expect("window lock") -= n;
        self.room.notify_one();
    }
}

enum Chunk {
    Data { read_at: Instant, bytes: Vec<u8> },
    End,
}

/// Reads `from` and queues each chunk with the time it was read.
fn read_side(mut from: TcpStream, line: SyncSender<Chunk>, window: Arc<Window>) {
    let mut buf = vec![0u8; READ_BYTES];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let read_at = Instant::now();
                window.take(n);
                let bytes = buf[..n].to_vec();
                if line.send(Chunk::Data { read_at, bytes }).is_err() {
                    break;
                }
            }
        }
    }
    let _ = line.send(Chunk::End);
}

/// Writes each queued chunk to `to` once it is due; at the end (or on a write error) closes the
/// direction, and on an error the whole connection.
fn write_side(
    mut to: TcpStream,
    line: Receiver<Chunk>,
    window: Arc<Window>,
    delay: Duration,
    stats: Arc<Stats>,
    upstream: bool,
) {
    // Precise sleeps for this thread; best effort (the stats show the lateness either way).
    let _ = std::fs::write("/proc/thread-self/timerslack_ns", "1");
    let dir = if upstream { &stats.up } else { &stats.down };
    while let Ok(Chunk::Data { read_at, bytes }) = line.recv() {
        let due = read_at + delay;
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        let late = Instant::now().saturating_duration_since(due);
        let n = bytes.len();
        let written = to.write_all(&bytes);
        window.give(n);
        dir.record(n, late);
        if written.is_err() {
            let _ = to.shutdown(Shutdown::Both);
            return;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// One direction: a reader, a bounded queue, a writer.
fn pipe(from: TcpStream, to: TcpStream, args: &Args, stats: &Arc<Stats>, upstream: bool) {
    // The window bounds the bytes; this, the chunks (far more than a 2 ms line ever holds).
    let (tx, rx) = sync_channel(QUEUE_CHUNKS);
    let window = Arc::new(Window::new(args.window_bytes));
    let delay = Duration::from_secs_f64(args.delay_ms / 1e3);
    let (w, s) = (window.clone(), stats.clone());
    std::thread::spawn(move || read_side(from, tx, window));
    std::thread::spawn(move || write_side(to, rx, w, delay, s, upstream));
}

fn serve(client: TcpStream, args: &Args, stats: &Arc<Stats>) -> std::io::Result<()> {
    let server = TcpStream::connect(args.upstream)?;
    for s in [&client, &server] {
        s.set_nodelay(true)?;
    }
    stats.connections.fetch_add(1, Ordering::Relaxed);
    pipe(client.try_clone()?, server.try_clone()?, args, stats, true);
    pipe(server, client, args, stats, false);
    Ok(())
}

fn write_stats(path: &PathBuf, stats: &Stats, delay: Duration) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, stats.json(delay).to_string())?;
    std::fs::rename(tmp, path)
}

fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    anyhow::ensure!(
        args.delay_ms >= 0.0 && args.delay_ms.is_finite(),
        "--delay-ms must be 0 or more"
    );
    anyhow::ensure!(args.window_bytes > 0, "--window-bytes must be positive");
    let listener = TcpListener::bind(args.listen).context("bind --listen")?;
    let stats = Arc::new(Stats::default());
    if let Some(path) = args.stats.clone() {
        let (s, delay) = (stats.clone(), Duration::from_secs_f64(args.delay_ms / 1e3));
        write_stats(&path, &s, delay).context("write --stats")?;
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            let _ = write_stats(&path, &s, delay);
        });
    }
    if args.exit_with_stdin {
        std::thread::spawn(|| {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            std::process::exit(0);
        });
    }
    println!("listening {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        if let Err(e) = serve(client, &args, &stats) {
            eprintln!(
                "latency_proxy: cannot reach the upstream {}: {e}",
                args.upstream
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream that echoes what it reads.
    fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let mut s = s.unwrap();
                let mut r = s.try_clone().unwrap();
                std::thread::spawn(move || std::io::copy(&mut r, &mut s));
            }
        });
        addr
    }

    fn proxy(upstream: SocketAddr, delay_ms: f64, window_bytes: usize) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let args = Arc::new(Args {
            listen: addr,
            upstream,
            delay_ms,
            window_bytes,
            stats: None,
            exit_with_stdin: false,
        });
        let stats = Arc::new(Stats::default());
        std::thread::spawn(move || {
            for c in l.incoming() {
                serve(c.unwrap(), &args, &stats).unwrap();
            }
        });
        addr
    }

    #[test]
    fn bytes_arrive_whole_in_order_and_never_before_the_delay() {
        let addr = proxy(echo_server(), 30.0, 1 << 20);
        let mut c = TcpStream::connect(addr).unwrap();
        let mut r = c.try_clone().unwrap();
        let sent: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let t0 = Instant::now();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; 300_000];
            let mut first = None;
            let mut off = 0;
            while off < got.len() {
                let n = r.read(&mut got[off..]).unwrap();
                assert!(n > 0, "closed early");
                first.get_or_insert_with(Instant::now);
                off += n;
            }
            (got, first.unwrap())
        });
        for part in sent.chunks(1000) {
            c.write_all(part).unwrap();
        }
        let (got, first) = reader.join().unwrap();
        assert_eq!(got, sent);
        // Two directions of 30 ms each: the first echoed byte cannot come sooner.
        assert!(first - t0 >= Duration::from_millis(60), "{:?}", first - t0);
    }

    #[test]
    fn a_small_window_still_carries_everything_and_the_end_of_stream() {
        let addr = proxy(echo_server(), 0.0, 4096);
        let mut c = TcpStream::connect(addr).unwrap();
        let sent: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
        let mut r = c.try_clone().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            r.read_to_end(&mut got).unwrap();
            got
        });
        c.write_all(&sent).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        assert_eq!(reader.join().unwrap(), sent);
    }

    #[test]
    fn lateness_buckets_are_ordered_and_cover_the_range() {
        assert_eq!(bucket_of(Duration::ZERO), 0);
        assert!(bucket_of(Duration::from_micros(100)) < bucket_of(Duration::from_millis(1)));
        assert_eq!(bucket_of(Duration::from_secs(3600)), BUCKETS - 1);
    }
}
