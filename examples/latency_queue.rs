//! The benchmark's other link: a delay of D each way added in the kernel's own path, without a
//! second TCP connection, for comparison with examples/latency_proxy on the same machine.
//!
//! The proxy terminates each connection and opens another, so every byte crosses loopback twice
//! and through a process that must read and write it: on two cores that CPU comes out of what is
//! being measured. Here the client connects to a port of 127.0.0.1 that iptables redirects to
//! `--upstream` (`nat`, `REDIRECT`), the connection is marked (`mangle`, `CONNMARK`), and every
//! packet of a marked connection, both directions, goes to a netfilter queue (`NFQUEUE`) as it
//! arrives (`INPUT`). This program holds each packet there for `--delay-ms` from the moment it read
//! it, then lets it go on its way (one batch verdict for every packet that came due, in the order
//! they came): one TCP connection end to end, the payload not copied to user space beyond the
//! first 128 bytes of each packet (it reads the headers, for the ports and length). Without `netem` (this kernel has none, nor `fq` or
//! `etf`), it is the nearest thing to a wire with latency that this machine has.
//!
//! A netlink socket of its own, not the `nfq` crate: that crate hides its socket, so a program
//! cannot wait on it with a timer (`ppoll`) or enlarge its receive buffer, and it has no batch
//! verdict.
//!
//! Needs root (iptables, netfilter queues). Prints `listening 127.0.0.1:PORT` once its rules are
//! in place; removes them when its standard input closes (with `--exit-with-stdin`) and lets the
//! packets it holds go. The rules carry the comment `outbox-bench-queue-PID`, so that a benchmark
//! can remove what a killed one left; their queue is `--queue-bypass`, so a rule left behind
//! passes packets undelayed rather than dropping them. `--stats FILE` is the proxy's format (a
//! chunk is a packet), plus the packets dropped because the queue or its socket was full.
//!
//! ```sh
//! cargo run --release --example latency_queue -- --upstream 127.0.0.1:6379 --delay-ms 1 --exit-with-stdin
//! ```

use anyhow::{bail, ensure, Context};
use clap::Parser;
use std::collections::VecDeque;
use std::io::Write;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "link/stats.rs"]
mod stats;
use stats::{precise_waits, write_stats, Stats};

/// A delay of each direction of the connections to one upstream, in the kernel's path.
#[derive(Debug, Parser)]
struct Args {
    /// Where the connections go: a port on 127.0.0.1.
    #[arg(long)]
    upstream: SocketAddr,
    /// Delay of each direction, in milliseconds (0 still passes every packet through the queue).
    #[arg(long, default_value_t = 0.0)]
    delay_ms: f64,
    /// The netfilter queue (and connection mark) to use; by default one made from the process id.
    #[arg(long)]
    queue_num: Option<u16>,
    /// Where the counters are written (JSON, rewritten every 200 ms).
    #[arg(long)]
    stats: Option<PathBuf>,
    /// Exit (removing the rules) when standard input reaches its end.
    #[arg(long)]
    exit_with_stdin: bool,
}

/// The netfilter queue's netlink protocol (linux/netfilter/nfnetlink_queue.h).
mod nfq {
    pub const SUBSYS_QUEUE: u16 = 3;
    pub const MSG_PACKET: u16 = 0;
    pub const MSG_CONFIG: u16 = 2;
    pub const MSG_VERDICT_BATCH: u16 = 3;
    pub const A_PACKET_HDR: u16 = 1;
    pub const A_VERDICT_HDR: u16 = 2;
    pub const A_PAYLOAD: u16 = 10;
    pub const A_CAP_LEN: u16 = 13;
    pub const A_CFG_CMD: u16 = 1;
    pub const A_CFG_PARAMS: u16 = 2;
    pub const A_CFG_QUEUE_MAXLEN: u16 = 3;
    pub const A_CFG_MASK: u16 = 4;
    pub const A_CFG_FLAGS: u16 = 5;
    pub const CMD_BIND: u8 = 1;
    pub const COPY_PACKET: u8 = 2;
    pub const F_FAIL_OPEN: u32 = 1;
    pub const F_GSO: u32 = 4;
    pub const NF_ACCEPT: u32 = 1;
}

/// Bytes of each packet copied to this program: its IPv4 and TCP headers (with their options).
const COPY_RANGE: u32 = 128;
/// Packets the kernel may hold for the queue; past it, new ones are dropped (and counted).
const QUEUE_MAX_LEN: u32 = 1 << 16;
/// The netlink socket's receive buffer.
const SOCKET_BUFFER_BYTES: libc::c_int = 32 << 20;

/// One netlink message of the queue's subsystem, built attribute by attribute.
struct Message(Vec<u8>);

impl Message {
    fn new(kind: u16, queue: u16, ack: bool) -> Self {
        let flags = libc::NLM_F_REQUEST as u16 | if ack { libc::NLM_F_ACK as u16 } else { 0 };
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(&0u32.to_ne_bytes()); // length, set by `bytes`
        b.extend_from_slice(&((nfq::SUBSYS_QUEUE << 8) | kind).to_ne_bytes());
        b.extend_from_slice(&flags.to_ne_bytes());
        b.extend_from_slice(&[0; 8]); // sequence, port id
        b.extend_from_slice(&[libc::AF_UNSPEC as u8, 0]); // nfgenmsg: family, version
        b.extend_from_slice(&queue.to_be_bytes());
        Self(b)
    }

    fn attr(mut self, kind: u16, data: &[u8]) -> Self {
        self.0
            .extend_from_slice(&((4 + data.len()) as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(data);
        while !self.0.len().is_multiple_of(4) {
            self.0.push(0);
        }
        self
    }

    fn bytes(mut self) -> Vec<u8> {
        let len = self.0.len() as u32;
        self.0[..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
}

/// A packet held in the queue: its id, when it may go, its direction and its TCP payload.
struct Held {
    id: u32,
    due: Instant,
    /// Client to upstream, upstream to client, or a packet this program could not read.
    up: Option<bool>,
    bytes: usize,
}

/// What the program took from a queued packet's first bytes.
#[derive(Debug, PartialEq)]
struct Packet {
    id: u32,
    source_port: u16,
    destination_port: u16,
    payload_bytes: usize,
    opens: bool,
}

/// The id of a queued packet, from its message's attributes.
fn packet_id(attrs: &[u8]) -> Option<u32> {
    let mut rest = attrs;
    while rest.len() >= 8 {
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
        if len < 4 || len > rest.len() {
            return None;
        }
        if kind == nfq::A_PACKET_HDR && len >= 8 {
            return Some(u32::from_be_bytes(rest[4..8].try_into().ok()?));
        }
        rest = &rest[((len + 3) & !3).min(rest.len())..];
    }
    None
}

/// What the kernel counts for one queue in /proc/net/netfilter/nfnetlink_queue: packets it
/// dropped because the queue was full (`queue_dropped`) or could not be sent to this program
/// (`user_dropped`: its socket's buffer was full).
fn queue_drops(queue: u16) -> u64 {
    let Ok(text) = std::fs::read_to_string("/proc/net/netfilter/nfnetlink_queue") else {
        return 0;
    };
    text.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.first() == Some(&queue.to_string().as_str()))
        .map_or(0, |f| {
            let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            n(5) + n(6)
        })
}

/// Reads a packet message's attributes (after the netlink header and nfgenmsg).
fn parse_packet(attrs: &[u8]) -> Option<Packet> {
    let (mut id, mut ip, mut length) = (None, None, None);
    let mut rest = attrs;
    while rest.len() >= 4 {
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
        if len < 4 || len > rest.len() {
            break;
        }
        let data = &rest[4..len];
        match kind {
            nfq::A_PACKET_HDR if data.len() >= 4 => {
                id = Some(u32::from_be_bytes(data[..4].try_into().ok()?));
            }
            nfq::A_PAYLOAD => ip = Some(data),
            // The packet's whole length, when the copy cut it (a GSO packet's IP header does not
            // hold it).
            nfq::A_CAP_LEN if data.len() >= 4 => {
                length = Some(u32::from_be_bytes(data[..4].try_into().ok()?) as usize);
            }
            _ => {}
        }
        rest = &rest[((len + 3) & !3).min(rest.len())..];
    }
    let (id, ip) = (id?, ip?);
    if ip.len() < 20 || ip[0] >> 4 != 4 || ip[9] != libc::IPPROTO_TCP as u8 {
        return None;
    }
    let header = ((ip[0] & 0x0f) as usize) * 4;
    let total = length.unwrap_or(ip.len());
    let tcp = ip.get(header..header + 14)?;
    let tcp_header = ((tcp[12] >> 4) as usize) * 4;
    Some(Packet {
        id,
        source_port: u16::from_be_bytes([tcp[0], tcp[1]]),
        destination_port: u16::from_be_bytes([tcp[2], tcp[3]]),
        payload_bytes: total.saturating_sub(header + tcp_header),
        opens: tcp[13] & 0x12 == 0x02,
    })
}

/// The netlink socket bound to one queue.
struct Queue {
    fd: OwnedFd,
    num: u16,
    buf: Vec<u8>,
}

impl Queue {
    fn bind(num: u16) -> anyhow::Result<Self> {
        // SAFETY: plain syscalls on a socket this function owns from here on.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_NETFILTER,
            )
        };
        ensure!(
            fd >= 0,
            "netlink socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `addr` is a zeroed sockaddr_nl with its family set, valid for the call.
        let bound = unsafe {
            let mut addr: libc::sockaddr_nl = std::mem::zeroed();
            addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            libc::bind(
                fd.as_raw_fd(),
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        ensure!(
            bound == 0,
            "netlink bind: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: SO_RCVBUFFORCE takes an int, which outlives the call.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                &SOCKET_BUFFER_BYTES as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        let mut q = Self {
            fd,
            num,
            buf: vec![0; 1 << 18],
        };
        q.configure(
            Message::new(nfq::MSG_CONFIG, num, true)
                .attr(nfq::A_CFG_CMD, &[nfq::CMD_BIND, 0, 0, 0]),
        )
        .with_context(|| format!("bind netfilter queue {num}"))?;
        let mut params = COPY_RANGE.to_be_bytes().to_vec();
        params.push(nfq::COPY_PACKET);
        q.configure(
            Message::new(nfq::MSG_CONFIG, num, true)
                .attr(nfq::A_CFG_PARAMS, &params)
                .attr(nfq::A_CFG_QUEUE_MAXLEN, &QUEUE_MAX_LEN.to_be_bytes())
                .attr(nfq::A_CFG_FLAGS, &nfq::F_GSO.to_be_bytes())
                .attr(nfq::A_CFG_MASK, &nfq::F_GSO.to_be_bytes()),
        )
        .context("configure the netfilter queue")?;
        Ok(q)
    }

    fn send(&self, msg: Message) -> std::io::Result<()> {
        let bytes = msg.bytes();
        // SAFETY: `addr` (the kernel: port id 0) and `bytes` outlive the call.
        let sent = unsafe {
            let mut addr: libc::sockaddr_nl = std::mem::zeroed();
            addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
            libc::sendto(
                self.fd.as_raw_fd(),
                bytes.as_ptr() as *const libc::c_void,
                bytes.len(),
                0,
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if sent < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sends a configuration message and waits for the kernel's acknowledgement.
    fn configure(&mut self, msg: Message) -> anyhow::Result<()> {
        self.send(msg)?;
        loop {
            let n = self.recv(0)?;
            let mut at = 0;
            while at + 16 <= n {
                let len = u32::from_ne_bytes(self.buf[at..at + 4].try_into()?) as usize;
                let kind = u16::from_ne_bytes([self.buf[at + 4], self.buf[at + 5]]);
                if kind == libc::NLMSG_ERROR as u16 && at + 20 <= n {
                    let errno = i32::from_ne_bytes(self.buf[at + 16..at + 20].try_into()?);
                    if errno == 0 {
                        return Ok(());
                    }
                    bail!("{}", std::io::Error::from_raw_os_error(-errno));
                }
                if len < 16 {
                    break;
                }
                at += (len + 3) & !3;
            }
        }
    }

    fn recv(&mut self, flags: libc::c_int) -> std::io::Result<usize> {
        // SAFETY: `buf` is valid for writes of its length for the call.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr() as *mut libc::c_void,
                self.buf.len(),
                flags,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// Every packet message waiting on the socket, without blocking, each with the time its
    /// `recv` returned. A packet this program cannot read (not TCP over IPv4, or headers past
    /// the copy) is passed as `Err(id)`: it is delayed like the others, and not counted. A full socket buffer
    /// (ENOBUFS) is not an error: the kernel counts the packets it dropped (`queue_drops`).
    fn drain(&mut self, mut each: impl FnMut(Result<Packet, u32>, Instant)) -> anyhow::Result<()> {
        loop {
            let n = match self.recv(libc::MSG_DONTWAIT) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => continue,
                Err(e) => return Err(e).context("recv from the netfilter queue"),
            };
            let read_at = Instant::now();
            let mut at = 0;
            while at + 16 <= n {
                let len = u32::from_ne_bytes(self.buf[at..at + 4].try_into()?) as usize;
                let kind = u16::from_ne_bytes([self.buf[at + 4], self.buf[at + 5]]);
                if len < 16 || at + len > n {
                    break;
                }
                if kind == libc::NLMSG_ERROR as u16 && len >= 20 {
                    // A failed request (a verdict the kernel refused): its packets would stay
                    // queued for ever.
                    let errno = i32::from_ne_bytes(self.buf[at + 16..at + 20].try_into()?);
                    if errno != 0 {
                        bail!(
                            "the netfilter queue refused a request: {}",
                            std::io::Error::from_raw_os_error(-errno)
                        );
                    }
                } else if kind == (nfq::SUBSYS_QUEUE << 8) | nfq::MSG_PACKET && len >= 20 {
                    let attrs = &self.buf[at + 20..at + len];
                    match parse_packet(attrs) {
                        Some(p) => each(Ok(p), read_at),
                        None => match packet_id(attrs) {
                            Some(id) => each(Err(id), read_at),
                            None => bail!("a queued packet without its id"),
                        },
                    }
                }
                at += (len + 3) & !3;
            }
        }
    }

    /// From now on the kernel lets each new packet of the queue go at once instead of queueing
    /// it (fail-open, with room for none), so that the queue is empty when its rule goes. No
    /// acknowledgement is asked: a refusal comes back as an error to `drain`.
    fn pass_new_packets(&self) -> std::io::Result<()> {
        self.send(
            Message::new(nfq::MSG_CONFIG, self.num, false)
                .attr(nfq::A_CFG_QUEUE_MAXLEN, &0u32.to_be_bytes())
                .attr(nfq::A_CFG_FLAGS, &nfq::F_FAIL_OPEN.to_be_bytes())
                .attr(nfq::A_CFG_MASK, &nfq::F_FAIL_OPEN.to_be_bytes()),
        )
    }

    /// Lets every packet up to `id` go on.
    fn accept_through(&self, id: u32) -> std::io::Result<()> {
        let mut hdr = nfq::NF_ACCEPT.to_be_bytes().to_vec();
        hdr.extend_from_slice(&id.to_be_bytes());
        self.send(
            Message::new(nfq::MSG_VERDICT_BATCH, self.num, false).attr(nfq::A_VERDICT_HDR, &hdr),
        )
    }
}

/// The iptables rules that send one port's connections to the upstream through the queue,
/// removed when dropped.
struct Rules {
    rules: Vec<(&'static str, &'static str, Vec<String>)>,
}

impl Rules {
    fn install(port: u16, upstream: SocketAddr, queue: u16) -> anyhow::Result<Self> {
        let tag = format!("outbox-bench-queue-{}", std::process::id());
        let mark = format!("{:#x}", 0x4f52_0000u32 | queue as u32);
        let (port, up, q) = (
            port.to_string(),
            upstream.port().to_string(),
            queue.to_string(),
        );
        let with_tag = |v: Vec<&str>| {
            v.into_iter()
                .chain(["-m", "comment", "--comment"])
                .map(String::from)
                .chain([tag.clone()])
                .collect::<Vec<_>>()
        };
        let to_port = ["-o", "lo", "-p", "tcp", "-d", "127.0.0.1", "--dport", &port];
        let mut rules = Rules { rules: Vec::new() };
        // The queue takes packets as they arrive (INPUT), not as they leave (OUTPUT): loopback
        // has already detached them from the sending socket, so a held packet does not count
        // against the sender's write memory. Held at OUTPUT, TCP's small-queue limit (about a
        // millisecond of the socket's pacing rate) capped each flow at that limit per delay.
        for (table, chain, spec) in [
            (
                "mangle",
                "OUTPUT",
                [&to_port[..], &["-j", "CONNMARK", "--set-mark", &mark]].concat(),
            ),
            (
                "nat",
                "OUTPUT",
                [&to_port[..], &["-j", "REDIRECT", "--to-ports", &up]].concat(),
            ),
            (
                "filter",
                "INPUT",
                vec![
                    "-i", "lo", "-m", "connmark", "--mark", &mark, "-j", "NFQUEUE",
                ]
                .into_iter()
                .chain(["--queue-num", &q, "--queue-bypass"])
                .collect(),
            ),
        ] {
            let spec = with_tag(spec);
            iptables(table, chain, "-I", &spec)?;
            rules.rules.push((table, chain, spec));
        }
        Ok(rules)
    }
}

impl Rules {
    /// Removes the rules that take new connections into the link (the mark and the redirect),
    /// and leaves the one that queues the packets of marked connections.
    fn close_entry(&mut self) {
        let (keep, gone): (Vec<_>, Vec<_>) = self
            .rules
            .drain(..)
            .partition(|(table, ..)| *table == "filter");
        self.rules = keep;
        for (table, chain, spec) in gone.iter().rev() {
            if let Err(e) = iptables(table, chain, "-D", spec) {
                eprintln!("latency_queue: {e:#}");
            }
        }
    }
}

impl Drop for Rules {
    fn drop(&mut self) {
        for (table, chain, spec) in self.rules.iter().rev() {
            if let Err(e) = iptables(table, chain, "-D", spec) {
                eprintln!("latency_queue: {e:#}");
            }
        }
    }
}

fn iptables(table: &str, chain: &str, op: &str, spec: &[String]) -> anyhow::Result<()> {
    let out = Command::new("iptables")
        .args(["-w", "-t", table, op, chain])
        .args(spec)
        .output()
        .context("run iptables (this link needs root and iptables)")?;
    ensure!(
        out.status.success(),
        "iptables -t {table} {op} {chain} {}: {}",
        spec.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// What ends a link: the end of a file (standard input, or a pipe in the tests) and a signal.
#[derive(Clone, Copy, Default)]
struct Stop {
    /// Read until its end.
    eof: Option<RawFd>,
    /// A signalfd: readable once SIGINT, SIGTERM or SIGHUP came.
    signal: Option<RawFd>,
}

impl Stop {
    /// Waits until the queue's socket or a stop is readable, or `timeout` passes; returns
    /// whether the link must stop.
    fn wait(&self, queue: RawFd, timeout: Option<Duration>) -> bool {
        let fd = |f: Option<RawFd>| libc::pollfd {
            fd: f.unwrap_or(-1),
            events: libc::POLLIN,
            revents: 0,
        };
        let mut fds = [fd(Some(queue)), fd(self.eof), fd(self.signal)];
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const _);
        // SAFETY: `fds` and `ts` outlive the call; a null signal mask leaves the mask alone.
        let ready = unsafe { libc::ppoll(fds.as_mut_ptr(), 3, ts_ptr, std::ptr::null()) };
        if ready <= 0 {
            return false;
        }
        if fds[2].revents != 0 {
            return true;
        }
        fds[1].revents != 0 && at_end(self.eof)
    }
}

/// Reads what `fd` holds; true at its end (or on an error).
fn at_end(fd: Option<RawFd>) -> bool {
    let Some(fd) = fd else { return false };
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is valid for writes of its length for the call.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
    n <= 0
}

/// Blocks SIGINT, SIGTERM and SIGHUP in this thread (and the threads it starts from now on) and
/// returns a signalfd that reads them: a signal then ends the link through its exit path, which
/// removes the rules, instead of killing the process with them in place.
fn stop_signals() -> anyhow::Result<OwnedFd> {
    // SAFETY: `set` is initialised by sigemptyset before use; the calls only read it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        ensure!(
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) == 0,
            "pthread_sigmask"
        );
        let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC);
        ensure!(fd >= 0, "signalfd: {}", std::io::Error::last_os_error());
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

/// A TCP socket bound to a free port of 127.0.0.1, not listening, and its port.
fn reserve_port() -> std::io::Result<(OwnedFd, u16)> {
    // SAFETY: plain socket calls on a descriptor this function owns; `addr` and `len` outlive
    // the calls that take them.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let p = &mut addr as *mut libc::sockaddr_in as *mut libc::sockaddr;
        if libc::bind(fd.as_raw_fd(), p, len) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut got = len;
        if libc::getsockname(fd.as_raw_fd(), p, &mut got) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((fd, u16::from_be(addr.sin_port)))
    }
}

/// A link: its rules, its queue, and the port that clients connect to.
struct Link {
    port: u16,
    upstream_port: u16,
    delay: Duration,
    queue: Queue,
    /// Removed first when the link stops, while the queue still lets go what it holds.
    rules: Option<Rules>,
    /// A bound socket that does not listen: it keeps the port, and a connection to it once the
    /// redirect is gone is refused instead of left hanging.
    _reserved: OwnedFd,
}

/// How long a stopping link waits for more packets once it holds none.
const STOP_GRACE: Duration = Duration::from_millis(20);
/// How long a stopping link goes on delaying the connections it carries at most.
const STOP_LIMIT: Duration = Duration::from_secs(2);

impl Link {
    fn open(upstream: SocketAddr, delay: Duration, queue_num: u16) -> anyhow::Result<Self> {
        ensure!(
            upstream.ip().is_loopback() && upstream.is_ipv4(),
            "--upstream must be a port on 127.0.0.1 (iptables REDIRECT), not {upstream}"
        );
        // The port clients connect to: held, so nothing else takes it; the redirect moves each
        // connection to the upstream before it could reach this listener.
        let (reserved, port) = reserve_port().context("reserve a port")?;
        let queue = Queue::bind(queue_num)?;
        let rules = Rules::install(port, upstream, queue_num)?;
        Ok(Self {
            port,
            upstream_port: upstream.port(),
            delay,
            queue,
            rules: Some(rules),
            _reserved: reserved,
        })
    }

    /// Holds and releases packets until `stop`, then stops in three steps:
    ///
    /// 1. It takes no new connections (the mark and redirect rules go) and goes on delaying the
    ///    packets of those it carries until none came or left for `STOP_GRACE` (at most
    ///    `STOP_LIMIT`).
    /// 2. The kernel then lets new packets go at once (`pass_new_packets`); those already
    ///    queued are read and, with those held, let go at their due times.
    /// 3. Only with the queue empty does the queueing rule go: removing it while packets were
    ///    queued dropped them (seen here: their verdicts failed with ENOENT; the last rule that
    ///    uses conntrack takes its hooks away, and the kernel then flushes every queue).
    ///
    /// On an error the rules are removed and every packet held is let go at once.
    fn run(&mut self, stats: &Stats, stop: Stop) -> anyhow::Result<()> {
        precise_waits();
        let mut held: VecDeque<Held> = VecDeque::new();
        let result = self.hold_and_release(stats, stop, &mut held);
        if let Some(h) = held.back() {
            let _ = self.queue.accept_through(h.id);
        }
        self.rules = None;
        result
    }

    fn hold_and_release(
        &mut self,
        stats: &Stats,
        stop: Stop,
        held: &mut VecDeque<Held>,
    ) -> anyhow::Result<()> {
        enum Phase {
            Running,
            Stopping { since: Instant },
            Closing,
        }
        let (upstream, delay) = (self.upstream_port, self.delay);
        let mut phase = Phase::Running;
        let mut last_activity = Instant::now();
        let mut unreadable = 0u64;
        loop {
            let now = Instant::now();
            let timeout = match (held.front(), &phase) {
                (Some(h), _) => Some(h.due.saturating_duration_since(now)),
                (None, Phase::Running) => None,
                (None, Phase::Stopping { .. }) => {
                    Some((last_activity + STOP_GRACE).saturating_duration_since(now))
                }
                (None, Phase::Closing) => Some(Duration::ZERO),
            };
            let fd = self.queue.fd.as_raw_fd();
            match phase {
                Phase::Running => {
                    if stop.wait(fd, timeout) {
                        phase = Phase::Stopping {
                            since: Instant::now(),
                        };
                        last_activity = Instant::now();
                        if let Some(rules) = self.rules.as_mut() {
                            rules.close_entry();
                        }
                    }
                }
                _ => {
                    Stop::default().wait(fd, timeout);
                }
            }
            self.queue.drain(|p, read_at| {
                let (id, up, bytes) = match p {
                    Ok(p) => {
                        let up = p.destination_port == upstream;
                        if up && p.opens {
                            stats.connections.fetch_add(1, Ordering::Relaxed);
                        }
                        (p.id, Some(up), p.payload_bytes)
                    }
                    Err(id) => {
                        unreadable += 1;
                        (id, None, 0)
                    }
                };
                last_activity = read_at;
                held.push_back(Held {
                    id,
                    due: read_at + delay,
                    up,
                    bytes,
                });
            })?;
            let now = Instant::now();
            let mut last = None;
            while held.front().is_some_and(|h| h.due <= now) {
                let h = held.pop_front().expect("checked");
                match h.up {
                    Some(true) => stats.up.record(h.bytes, now - h.due),
                    Some(false) => stats.down.record(h.bytes, now - h.due),
                    None => {}
                }
                last = Some(h.id);
            }
            if let Some(id) = last {
                self.queue.accept_through(id).context("verdict")?;
                // What it let go may be answered: the answer is delayed too.
                last_activity = Instant::now();
            }
            match phase {
                Phase::Stopping { since } => {
                    let quiet = held.is_empty() && last_activity.elapsed() >= STOP_GRACE;
                    if quiet || since.elapsed() > STOP_LIMIT {
                        self.queue.pass_new_packets().context("fail-open")?;
                        phase = Phase::Closing;
                    }
                }
                // New packets pass at once now: once the last queued one has been read and let
                // go, the queue is empty.
                Phase::Closing if held.is_empty() => break,
                _ => {}
            }
        }
        if unreadable > 0 {
            eprintln!(
                "latency_queue: {unreadable} packets were not TCP over IPv4 with headers \
                 within {COPY_RANGE} bytes: delayed, not counted"
            );
        }
        Ok(())
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ensure!(
        args.delay_ms >= 0.0 && args.delay_ms.is_finite(),
        "--delay-ms must be 0 or more"
    );
    let delay = Duration::from_secs_f64(args.delay_ms / 1e3);
    // Before any other thread starts, so that every thread has them blocked.
    let signals = stop_signals()?;
    // A queue number another process holds is refused (EPERM or EBUSY): the next one is tried.
    let first = args
        .queue_num
        .unwrap_or(1000 + (std::process::id() % 60_000) as u16);
    let tries = if args.queue_num.is_some() { 1 } else { 16 };
    let mut opened = Err(anyhow::anyhow!("no queue number tried"));
    for queue_num in (0..tries).map(|i| first.wrapping_add(i)) {
        opened = Link::open(args.upstream, delay, queue_num).map(|l| (l, queue_num));
        if opened.is_ok() {
            break;
        }
    }
    let (mut link, queue_num) = opened?;
    let stats = Arc::new(Stats::default());
    if let Some(path) = args.stats.clone() {
        let (s, path) = (stats.clone(), path.clone());
        write_stats(&path, &s, delay).context("write --stats")?;
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            s.dropped.store(queue_drops(queue_num), Ordering::Relaxed);
            let _ = write_stats(&path, &s, delay);
        });
    }
    println!("listening 127.0.0.1:{}", link.port);
    std::io::stdout().flush()?;
    let stdin = std::io::stdin();
    let stop = Stop {
        eof: args.exit_with_stdin.then(|| stdin.as_raw_fd()),
        signal: Some(signals.as_raw_fd()),
    };
    let result = link.run(&stats, stop);
    stats
        .dropped
        .store(queue_drops(queue_num), Ordering::Relaxed);
    if let Some(path) = &args.stats {
        write_stats(path, &stats, delay).context("write --stats")?;
    }
    result
}

#[cfg(test)]
#[path = "link/echo.rs"]
mod echo;

#[cfg(test)]
mod tests {
    use super::echo::{echo_server, echoed};
    use super::*;
    use std::io::Read;
    use std::net::TcpStream;

    /// A running link, stopped (its rules removed) by closing the pipe's write end.
    struct Running {
        port: u16,
        stats: Arc<Stats>,
        stop: Option<OwnedFd>,
        thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
        tag: String,
    }

    impl Running {
        fn start(upstream: SocketAddr, delay_ms: u64, queue_num: u16) -> Self {
            let mut fds = [0; 2];
            // SAFETY: `fds` has room for the two descriptors.
            assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
            // SAFETY: both were just opened and are owned by nothing else.
            let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            let mut link =
                Link::open(upstream, Duration::from_millis(delay_ms), queue_num).unwrap();
            let port = link.port;
            let stats = Arc::new(Stats::default());
            let s = stats.clone();
            let thread = std::thread::spawn(move || {
                let r = r;
                link.run(
                    &s,
                    Stop {
                        eof: Some(r.as_raw_fd()),
                        signal: None,
                    },
                )
            });
            Self {
                port,
                stats,
                stop: Some(w),
                thread: Some(thread),
                tag: format!("outbox-bench-queue-{}", std::process::id()),
            }
        }

        fn stop(&mut self) {
            drop(self.stop.take());
            if let Some(t) = self.thread.take() {
                t.join().unwrap().unwrap();
            }
        }
    }

    impl Drop for Running {
        fn drop(&mut self) {
            // A failed test still removes its rules.
            drop(self.stop.take());
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    fn rules_left(tag: &str) -> usize {
        let out = Command::new("iptables-save").output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains(tag))
            .count()
    }

    fn round_trip(c: &mut TcpStream, byte: u8) -> Duration {
        let t = Instant::now();
        c.write_all(&[byte; 100]).unwrap();
        let mut got = [0u8; 100];
        c.read_exact(&mut got).unwrap();
        assert_eq!(got, [byte; 100]);
        t.elapsed()
    }

    // One test, not three: the links share the process id in their rules' comment.
    #[test]
    fn the_kernel_link_delays_each_way_keeps_the_bytes_and_removes_its_rules() {
        let upstream = echo_server();

        // 25 ms each way: every round trip takes both.
        let mut link = Running::start(upstream, 25, 64_001);
        assert_eq!(rules_left(&link.tag), 3);
        let mut c = TcpStream::connect(("127.0.0.1", link.port)).unwrap();
        for i in 1..=5u8 {
            let rtt = round_trip(&mut c, i);
            assert!(rtt >= Duration::from_millis(50), "round trip {i}: {rtt:?}");
        }
        // A large stream arrives whole and in order.
        let sent: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(echoed(&c, &sent), sent);
        assert_eq!(link.stats.connections.load(Ordering::Relaxed), 1);
        let up = link.stats.up.bytes.load(Ordering::Relaxed);
        let down = link.stats.down.bytes.load(Ordering::Relaxed);
        assert_eq!((up, down), (500 + 3_000_000, 500 + 3_000_000));
        // The kernel dropped none of the queue's packets (a drop would be retransmitted, so
        // the bytes above would not show it).
        assert_eq!(queue_drops(64_001), 0);
        link.stop();
        assert_eq!(rules_left(&link.tag), 0);

        // Its rules gone, the port no longer reaches the upstream.
        assert!(TcpStream::connect(("127.0.0.1", link.port)).is_err());

        // A link stopped while it holds a packet lets it go at its due time (and counts it)
        // before it closes its queue, which would drop it.
        // Its reply, which comes while it stops, is delayed as well: the write's round trip
        // takes both delays.
        let mut link = Running::start(upstream, 300, 64_002);
        let mut c = TcpStream::connect(("127.0.0.1", link.port)).unwrap();
        round_trip(&mut c, 1);
        let sent_at = Instant::now();
        c.write_all(&[2; 100]).unwrap();
        std::thread::sleep(Duration::from_millis(100)); // read and held by now, not yet due
        link.stop();
        let mut got = [0u8; 100];
        c.read_exact(&mut got).unwrap();
        assert_eq!(got, [2; 100]);
        assert!(
            sent_at.elapsed() >= Duration::from_millis(600),
            "{:?}",
            sent_at.elapsed()
        );
        assert_eq!(link.stats.up.bytes.load(Ordering::Relaxed), 200);
        assert_eq!(link.stats.down.bytes.load(Ordering::Relaxed), 200);
        assert_eq!(rules_left(&link.tag), 0);
    }

    #[test]
    fn a_queued_packets_ports_length_and_syn_are_read_from_its_headers() {
        let mut attrs = Message::new(0, 0, false);
        attrs.0.clear();
        let mut ip = vec![
            0x45, 0, 0, 0, 0, 0, 0, 0, 64, 6, 0, 0, 127, 0, 0, 1, 127, 0, 0, 1,
        ];
        ip[2..4].copy_from_slice(&(20u16 + 32 + 7).to_be_bytes());
        let mut tcp = vec![0u8; 32];
        tcp[0..2].copy_from_slice(&5432u16.to_be_bytes());
        tcp[2..4].copy_from_slice(&40000u16.to_be_bytes());
        tcp[12] = 8 << 4; // 32-byte header (with options)
        tcp[13] = 0x02; // SYN
        ip.extend_from_slice(&tcp);
        let attrs = attrs
            .attr(nfq::A_PACKET_HDR, &[0, 0, 1, 2, 8, 0, 3])
            .attr(nfq::A_PAYLOAD, &ip)
            .attr(nfq::A_CAP_LEN, &59u32.to_be_bytes());
        assert_eq!(
            parse_packet(&attrs.0),
            Some(Packet {
                id: 258,
                source_port: 5432,
                destination_port: 40000,
                payload_bytes: 7,
                opens: true,
            })
        );
        // SYN+ACK answers; it does not open a connection.
        let mut synack = attrs.0.clone();
        let flags = synack.len() - 8 - tcp.len() + 13;
        synack[flags] = 0x12;
        assert!(!parse_packet(&synack).unwrap().opens);
        // Not IPv4: refused, not misread.
        let mut v6 = attrs.0.clone();
        let ip_at = v6.len() - 8 - ip.len();
        v6[ip_at] = 0x60;
        assert_eq!(parse_packet(&v6), None);
        // ICMP about the connection (it carries the connection's mark): not read as TCP.
        let mut icmp = attrs.0.clone();
        icmp[ip_at + 9] = libc::IPPROTO_ICMP as u8;
        assert_eq!(parse_packet(&icmp), None);
        assert_eq!(packet_id(&icmp), Some(258));
    }
}
