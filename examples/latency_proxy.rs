//! The link of `scripts/bench.sh`: a TCP proxy that delays every byte by a fixed time each way,
//! as a network link between hosts would (this kernel has no `netem`).
//!
//! Each accepted connection gets a connection to `--upstream` and one thread per direction. The
//! thread reads what has arrived, stamps each chunk (what one read returned) with the time it was
//! read, and writes it once `--delay-ms` has passed since then. Nothing leaves before its due time
//! and nothing is reordered (one writer per direction, due times in read order). What is due when
//! the thread writes goes out in that one write: chunks that came due while the thread was off
//! the CPU leave together, as bytes that reached a receiver's socket together are read together.
//! A direction holds at most `--window-bytes` in its delay line; when that is full the thread
//! stops reading, so the sender sees backpressure as it would from a full link, instead of the
//! proxy buffering without bound.
//!
//! One thread per direction, waiting in `ppoll(2)` for the socket or for the next due time: no
//! hand-off between a reader and a writer thread, whose wake-ups and context switches would
//! take CPU from the processes being measured on the same cores. Not an async runtime: tokio's
//! timer has a resolution of 1 ms, too coarse for a 0.5 ms delay; `ppoll` takes nanoseconds, and
//! each thread sets its timer slack to 1 ns with `prctl` (the kernel's default lets a wait end up
//! to 50 µs late).
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
use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "link/stats.rs"]
mod stats;
use stats::{precise_waits, write_stats, DirectionStats, Stats};

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

/// Size of one read at most; a chunk is what one read returned.
const READ_BYTES: usize = 64 << 10;
/// A chunk in the delay line: when it is due, its length, and whether its lateness is counted
/// (when the first write that carries it starts).
struct Chunk {
    due: Instant,
    len: usize,
    counted: bool,
}

/// One direction's delay line: the bytes not yet written, and the chunks they came in.
struct DelayLine {
    bytes: VecDeque<u8>,
    chunks: VecDeque<Chunk>,
    /// Bytes of the front chunk already written (a write took part of it).
    front_written: usize,
}

impl DelayLine {
    fn new() -> Self {
        Self {
            bytes: VecDeque::new(),
            chunks: VecDeque::new(),
            front_written: 0,
        }
    }

    fn push(&mut self, data: &[u8], due: Instant) {
        self.bytes.extend(data);
        self.chunks.push_back(Chunk {
            due,
            len: data.len(),
            counted: false,
        });
    }

    /// Bytes due at `now` and not yet written.
    fn due_bytes(&self, now: Instant) -> usize {
        let mut n = 0;
        for (i, c) in self.chunks.iter().enumerate() {
            if c.due > now {
                break;
            }
            n += if i == 0 {
                c.len - self.front_written
            } else {
                c.len
            };
        }
        n
    }

    /// Drops the first `n` bytes, which a write that started at `started` took; counts the
    /// lateness of each chunk whose first byte left in it.
    fn consume(&mut self, n: usize, started: Instant, dir: &DirectionStats) {
        self.bytes.drain(..n);
        // Where each chunk's unwritten bytes start, counted from the first unwritten byte.
        let mut offset = 0;
        for (i, c) in self.chunks.iter_mut().enumerate() {
            if offset >= n {
                break;
            }
            if !c.counted {
                c.counted = true;
                dir.record(c.len, started.saturating_duration_since(c.due));
            }
            offset += if i == 0 {
                c.len - self.front_written
            } else {
                c.len
            };
        }
        let mut n = n;
        while n > 0 {
            let front = self
                .chunks
                .front()
                .expect("written bytes belong to a chunk");
            let left = front.len - self.front_written;
            if n >= left {
                n -= left;
                self.front_written = 0;
                self.chunks.pop_front();
            } else {
                self.front_written += n;
                n = 0;
            }
        }
    }

    fn next_due(&self) -> Option<Instant> {
        self.chunks.front().map(|c| c.due)
    }
}

/// Waits until `read` is readable, `write` is writable (either may be absent) or `timeout` has
/// passed (`None`: no timeout). Returns whether `read` has something to read (data, its end or
/// an error); an interrupted wait returns `false`, as if the time had passed.
fn wait(read: Option<&TcpStream>, write: Option<&TcpStream>, timeout: Option<Duration>) -> bool {
    let fd = |s: Option<&TcpStream>| s.map_or(-1, |s| s.as_raw_fd());
    let mut fds = [
        libc::pollfd {
            fd: fd(read),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: fd(write),
            events: libc::POLLOUT,
            revents: 0,
        },
    ];
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs() as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const _);
    // SAFETY: `fds` and `ts` outlive the call; a null signal mask leaves the mask alone.
    let ready = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, ts_ptr, std::ptr::null()) };
    ready > 0 && fds[0].revents != 0
}

/// One direction: reads `from` into the delay line, writes to `to` what is due. At the end of
/// `from` (or a read error) writes the rest at its due times and closes the direction; on a write
/// error closes the whole connection.
fn direction(
    mut from: TcpStream,
    mut to: TcpStream,
    delay: Duration,
    window_bytes: usize,
    dir: &DirectionStats,
) {
    precise_waits();
    let mut buf = vec![0u8; READ_BYTES];
    let mut line = DelayLine::new();
    let mut ended = false;
    // Whether a read may find something: after the wait said so, after a read that filled the
    // buffer, and whenever the last wait did not watch `from` (its window was full).
    let mut try_read = true;
    loop {
        let mut more = false;
        if try_read && !ended && line.bytes.len() < window_bytes {
            let room = (window_bytes - line.bytes.len()).min(READ_BYTES);
            match from.read(&mut buf[..room]) {
                Ok(0) => ended = true,
                Ok(n) => {
                    line.push(&buf[..n], Instant::now() + delay);
                    more = n == room;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => more = true,
                Err(_) => ended = true,
            }
        }
        // Write what is due, in one write.
        let mut blocked = false;
        let started = Instant::now();
        let due = line.due_bytes(started);
        if due > 0 {
            let (a, b) = line.bytes.as_slices();
            let a = &a[..a.len().min(due)];
            let b = &b[..b.len().min(due - a.len())];
            match to.write_vectored(&[IoSlice::new(a), IoSlice::new(b)]) {
                Ok(n) => {
                    line.consume(n, started, dir);
                    blocked = n < due;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => blocked = true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    let _ = to.shutdown(Shutdown::Both);
                    let _ = from.shutdown(Shutdown::Both);
                    return;
                }
            }
        }
        if ended && line.chunks.is_empty() {
            let _ = to.shutdown(Shutdown::Write);
            return;
        }
        let reading = !ended && line.bytes.len() < window_bytes;
        if more && reading {
            try_read = true;
            continue;
        }
        let watch = reading.then_some(&from);
        let now = Instant::now();
        let readable = match line.next_due() {
            // Something is due but the socket is full: wait for room (or more to read).
            _ if blocked => wait(watch, Some(&to), None),
            // It came due since the write above: write it now.
            Some(d) if d <= now => false,
            Some(d) => wait(watch, None, Some(d - now)),
            None => wait(watch, None, None),
        };
        try_read = readable || watch.is_none();
    }
}

fn serve(client: TcpStream, args: &Args, stats: &Arc<Stats>) -> std::io::Result<()> {
    let server = TcpStream::connect(args.upstream)?;
    for s in [&client, &server] {
        s.set_nodelay(true)?;
        s.set_nonblocking(true)?;
    }
    stats.connections.fetch_add(1, Ordering::Relaxed);
    let delay = Duration::from_secs_f64(args.delay_ms / 1e3);
    let window = args.window_bytes;
    let (c, s) = (client.try_clone()?, server.try_clone()?);
    let st = stats.clone();
    std::thread::spawn(move || direction(c, s, delay, window, &st.up));
    let st = stats.clone();
    std::thread::spawn(move || direction(server, client, delay, window, &st.down));
    Ok(())
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
#[path = "link/echo.rs"]
mod echo;

#[cfg(test)]
mod tests {
    use super::echo::{echo_server, echoed};
    use super::stats::{bucket_of, BUCKETS};
    use super::*;

    fn proxy(upstream: SocketAddr, delay_ms: f64, window_bytes: usize) -> SocketAddr {
        proxy_with_stats(upstream, delay_ms, window_bytes).0
    }

    fn proxy_with_stats(
        upstream: SocketAddr,
        delay_ms: f64,
        window_bytes: usize,
    ) -> (SocketAddr, Arc<Stats>) {
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
        let st = stats.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                serve(c.unwrap(), &args, &st).unwrap();
            }
        });
        (addr, stats)
    }

    /// Reads exactly `n` bytes; returns them and when each arrived.
    fn read_timed(r: &mut TcpStream, n: usize) -> (Vec<u8>, Vec<Instant>) {
        let mut got = vec![0u8; n];
        let mut at = Vec::with_capacity(n);
        let mut off = 0;
        while off < n {
            let k = r.read(&mut got[off..]).unwrap();
            assert!(k > 0, "closed early");
            let now = Instant::now();
            at.extend(std::iter::repeat_n(now, k));
            off += k;
        }
        (got, at)
    }

    #[test]
    fn bytes_arrive_whole_in_order_and_never_before_the_delay() {
        let addr = proxy(echo_server(), 30.0, 1 << 20);
        let mut c = TcpStream::connect(addr).unwrap();
        let mut r = c.try_clone().unwrap();
        let sent: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let t0 = Instant::now();
        let reader = std::thread::spawn(move || read_timed(&mut r, 300_000));
        for part in sent.chunks(1000) {
            c.write_all(part).unwrap();
        }
        let (got, at) = reader.join().unwrap();
        assert_eq!(got, sent);
        // Two directions of 30 ms each: the first echoed byte cannot come sooner.
        assert!(at[0] - t0 >= Duration::from_millis(60), "{:?}", at[0] - t0);
    }

    #[test]
    fn a_later_write_is_not_carried_with_an_earlier_one() {
        // What is due goes out together; what is not due yet must wait for its own time.
        let addr = proxy(echo_server(), 30.0, 1 << 20);
        let mut c = TcpStream::connect(addr).unwrap();
        let mut r = c.try_clone().unwrap();
        let reader = std::thread::spawn(move || read_timed(&mut r, 20));
        let t_a = Instant::now();
        c.write_all(b"aaaaaaaaaa").unwrap();
        std::thread::sleep(Duration::from_millis(15));
        let t_b = Instant::now();
        c.write_all(b"bbbbbbbbbb").unwrap();
        let (got, at) = reader.join().unwrap();
        assert_eq!(&got, b"aaaaaaaaaabbbbbbbbbb");
        assert!(
            at[0] - t_a >= Duration::from_millis(60),
            "{:?}",
            at[0] - t_a
        );
        assert!(
            at[10] - t_b >= Duration::from_millis(60),
            "{:?}",
            at[10] - t_b
        );
    }

    #[test]
    fn every_round_trip_takes_both_delays() {
        let addr = proxy(echo_server(), 5.0, 1 << 20);
        let mut c = TcpStream::connect(addr).unwrap();
        for i in 0..20u8 {
            let t = Instant::now();
            c.write_all(&[i; 10]).unwrap();
            let (got, at) = read_timed(&mut c, 10);
            assert_eq!(got, [i; 10]);
            assert!(
                at[0] - t >= Duration::from_millis(10),
                "{i}: {:?}",
                at[0] - t
            );
        }
    }

    #[test]
    fn a_small_window_still_carries_everything_and_the_end_of_stream() {
        for delay_ms in [0.0, 2.0] {
            let addr = proxy(echo_server(), delay_ms, 4096);
            let c = TcpStream::connect(addr).unwrap();
            let sent: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
            assert_eq!(echoed(&c, &sent), sent, "delay {delay_ms} ms");
        }
    }

    #[test]
    fn the_delay_line_counts_each_chunk_once_when_it_leaves_and_keeps_partial_writes() {
        let stats = DirectionStats::default();
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut line = DelayLine::new();
        line.push(b"aaaaa", t0);
        line.push(b"bbbbb", t0 + ms(1));
        line.push(b"ccccc", t0 + ms(10));
        // At 2 ms the first two are due, the third is not; nothing is counted before a write.
        assert_eq!(line.due_bytes(t0 + ms(2)), 10);
        assert_eq!(stats.chunks.load(Ordering::Relaxed), 0);
        // A write that started at 3 ms took 7 bytes: both chunks left in it (the second in
        // part), 3 bytes of the second are left.
        line.consume(7, t0 + ms(3), &stats);
        assert_eq!(stats.chunks.load(Ordering::Relaxed), 2);
        assert_eq!(stats.max_late_ns.load(Ordering::Relaxed), 3_000_000);
        assert_eq!(line.due_bytes(t0 + ms(3)), 3);
        assert_eq!(line.bytes.iter().copied().collect::<Vec<_>>(), b"bbbccccc");
        assert_eq!(line.next_due(), Some(t0 + ms(1)));
        // The rest of the second chunk leaves much later: it is not counted again.
        line.consume(3, t0 + ms(9), &stats);
        assert_eq!(stats.chunks.load(Ordering::Relaxed), 2);
        assert_eq!(stats.max_late_ns.load(Ordering::Relaxed), 3_000_000);
        assert_eq!(line.next_due(), Some(t0 + ms(10)));
        assert_eq!(line.due_bytes(t0 + ms(9)), 0);
        assert_eq!(line.due_bytes(t0 + ms(10)), 5);
        line.consume(5, t0 + ms(10), &stats);
        assert_eq!(stats.chunks.load(Ordering::Relaxed), 3);
        assert_eq!(stats.bytes.load(Ordering::Relaxed), 15);
        assert!(line.chunks.is_empty() && line.bytes.is_empty());
    }

    #[test]
    fn a_chunk_held_by_a_slow_receiver_counts_as_late() {
        // The upstream reads nothing for 400 ms: bytes the proxy holds leave that much after
        // their due time, and the lateness says so (a write that could not take them does not
        // count them).
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let up = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            std::thread::sleep(Duration::from_millis(400));
            let mut v = Vec::new();
            s.read_to_end(&mut v).unwrap();
            v.len()
        });
        let (addr, stats) = proxy_with_stats(up, 0.0, 256 << 10);
        let mut c = TcpStream::connect(addr).unwrap();
        let total = 32 << 20;
        c.write_all(&vec![7u8; total]).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        assert_eq!(server.join().unwrap(), total);
        let max_late = Duration::from_nanos(stats.up.max_late_ns.load(Ordering::Relaxed));
        assert!(max_late >= Duration::from_millis(200), "{max_late:?}");
        assert_eq!(stats.up.bytes.load(Ordering::Relaxed), total as u64);
    }

    #[test]
    fn each_thread_waits_with_a_timer_slack_of_1_ns() {
        let slack = std::thread::spawn(|| {
            precise_waits();
            // SAFETY: PR_GET_TIMERSLACK takes no argument and returns this thread's slack.
            unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) }
        })
        .join()
        .unwrap();
        assert_eq!(slack, 1);
    }

    #[test]
    fn lateness_buckets_are_ordered_and_cover_the_range() {
        assert_eq!(bucket_of(Duration::ZERO), 0);
        assert!(bucket_of(Duration::from_micros(100)) < bucket_of(Duration::from_millis(1)));
        assert_eq!(bucket_of(Duration::from_secs(3600)), BUCKETS - 1);
    }
}
