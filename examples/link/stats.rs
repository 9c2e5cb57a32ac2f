//! What the benchmark's two links (examples/latency_proxy, examples/latency_queue) count and
//! write to their `--stats` file, in one format: connections, and per direction the chunks (a
//! proxy's reads, the queue's packets), their bytes and a histogram of how late each left.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Lateness histogram: bucket `i` holds chunks that left less than `bound(i)` µs late.
pub const BUCKETS: usize = 64;

/// Upper bound (µs) of lateness bucket `i`: four buckets per power of two.
pub fn bucket_bound_us(i: usize) -> f64 {
    2f64.powf(i as f64 / 4.0)
}

pub fn bucket_of(late: Duration) -> usize {
    let us = late.as_secs_f64() * 1e6;
    (0..BUCKETS)
        .find(|&i| us < bucket_bound_us(i))
        .unwrap_or(BUCKETS - 1)
}

/// Counters of one direction, shared by every connection.
pub struct DirectionStats {
    pub chunks: AtomicU64,
    pub bytes: AtomicU64,
    pub max_late_ns: AtomicU64,
    pub late: [AtomicU64; BUCKETS],
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
    pub fn record(&self, bytes: usize, late: Duration) {
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
pub struct Stats {
    pub connections: AtomicU64,
    /// Client to upstream, upstream to client.
    pub up: DirectionStats,
    pub down: DirectionStats,
    /// Packets the link dropped: the kernel queue's when it or its socket was full (the proxy
    /// drops none: it stops reading instead).
    pub dropped: AtomicU64,
}

impl Stats {
    pub fn json(&self, delay: Duration) -> serde_json::Value {
        serde_json::json!({
            "delay_ms": delay.as_secs_f64() * 1e3,
            "connections": self.connections.load(Ordering::Relaxed),
            "bucket_bounds_us": (0..BUCKETS).map(bucket_bound_us).collect::<Vec<_>>(),
            "up": self.up.json(),
            "down": self.down.json(),
            "dropped": self.dropped.load(Ordering::Relaxed),
        })
    }
}

/// Writes the counters to `path` whole (through a file of the calling thread's own, renamed over
/// it), so that a reader never sees half of them and two writers never share the temporary.
pub fn write_stats(path: &Path, stats: &Stats, delay: Duration) -> std::io::Result<()> {
    let thread = format!("{:?}", std::thread::current().id());
    let tmp = path.with_extension(format!(
        "tmp-{}",
        thread.trim_matches(|c: char| !c.is_ascii_digit())
    ));
    std::fs::write(&tmp, stats.json(delay).to_string())?;
    std::fs::rename(tmp, path)
}

/// Sets this thread's timer slack to 1 ns, so that its waits end on time (best effort: the stats
/// show the lateness either way). `prctl`, because `/proc/thread-self` has no `timerslack_ns`.
pub fn precise_waits() {
    // SAFETY: PR_SET_TIMERSLACK takes an unsigned long and changes only the calling thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
}
