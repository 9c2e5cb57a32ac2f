//! A fault proxy for link tests: accepts on a loopback port and forwards each connection to a
//! target, with a switch that cuts one link at a time.
//!
//! - [`Fault::Pass`]: forward as it comes.
//! - [`Fault::Delay`]: forward each chunk this long after it was read: latency, with chunks in
//!   flight overlapping as on a real link (order kept).
//! - [`Fault::BlackHole`]: stop forwarding in both directions without closing anything, as a
//!   dropped route or a firewall that forgot the flow does: no FIN, no RST, not even for a side
//!   that closes meanwhile. What was read is held and goes on once the link passes again. New
//!   connections are accepted but reach nothing.
//!
//! In front of Postgres, the replication connection and the SQL connections can be cut apart
//! ([`Proxy::set_replication`], [`Proxy::set_sql`]): a connection counts as a replication one
//! once its startup message asks for `replication` (the tests' servers run without TLS, so the
//! startup message is readable).
//!
//! [`Proxy::reset`] closes every current connection with an RST (a peer that crashed); the
//! sockets linger 0, so any close of theirs is an RST after the FIN.
//!
//! The proxy's own kernel still acknowledges what it reads, so a black hole here is seen by the
//! relay's application-level deadlines (the replication receive deadline, command and health
//! check timeouts), not by TCP_USER_TIMEOUT or keepalive, which need a real kernel black hole.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to the traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Pass,
    Delay(Duration),
    BlackHole,
}

/// The faults in effect, per kind of connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Faults {
    /// Postgres replication connections.
    replication: Fault,
    /// Every other connection (SQL, Valkey).
    other: Fault,
    /// Connections accepted before this many are black-holed, whatever their kind (a flow
    /// that died while new ones get through).
    stalled_below: u64,
    /// Bytes per second at most from each client to the target (a slow link), if set.
    rate: Option<u64>,
}

/// A running proxy; dropping it stops accepting and resets its connections.
pub struct Proxy {
    pub addr: SocketAddr,
    fault: watch::Sender<Faults>,
    /// Bumped by [`reset`](Self::reset): connections older than it close with an RST.
    resets: watch::Sender<u64>,
    accepted: Arc<AtomicU64>,
    /// Bytes read from clients so far (whatever the fault does with them next).
    from_clients: Arc<AtomicU64>,
    held: Held,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (fault, _) = watch::channel(Faults {
            replication: Fault::Pass,
            other: Fault::Pass,
            stalled_below: 0,
            rate: None,
        });
        let (resets, _) = watch::channel(0u64);
        let accepted = Arc::new(AtomicU64::new(0));
        let from_clients = Arc::new(AtomicU64::new(0));
        let held = Held::default();
        let (f, r, n, b, h) = (
            fault.clone(),
            resets.clone(),
            accepted.clone(),
            from_clients.clone(),
            held.clone(),
        );
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let id = n.fetch_add(1, Ordering::Relaxed);
                let (f, r) = (f.subscribe(), r.subscribe());
                tokio::spawn(connection(client, id, target, f, r, b.clone(), h.clone()));
            }
        });
        Self {
            addr,
            fault,
            resets,
            accepted,
            from_clients,
            held,
            accept,
        }
    }

    /// A proxy in front of the host:port of a `postgres://` or `redis://` URL.
    pub async fn in_front_of(url: &str) -> Self {
        let u = url::Url::parse(url).unwrap();
        let host = u.host_str().unwrap();
        let port = u.port().unwrap();
        let target = tokio::net::lookup_host((host, port))
            .await
            .unwrap()
            .next()
            .unwrap();
        Self::start(target).await
    }

    /// `url` with its host and port replaced by the proxy's.
    pub fn url_through(&self, url: &str) -> String {
        let mut u = url::Url::parse(url).unwrap();
        u.set_host(Some(&self.addr.ip().to_string())).unwrap();
        u.set_port(Some(self.addr.port())).unwrap();
        u.to_string()
    }

    /// The same fault on every connection (and no more stalled ones; a rate stays).
    pub fn set(&self, fault: Fault) {
        self.fault.send_modify(|f| {
            f.replication = fault;
            f.other = fault;
            f.stalled_below = 0;
        });
    }

    /// Forwards at most `bytes_per_sec` from each client to the target (`None`: as fast as it
    /// comes): a slow link, whose sender's socket fills as TCP's window would.
    pub fn set_rate(&self, bytes_per_sec: Option<u64>) {
        self.fault.send_modify(|f| f.rate = bytes_per_sec);
    }

    /// Black-holes the connections open now; new ones pass (until [`set`](Self::set)).
    pub fn stall_open_connections(&self) {
        let open = self.accepted();
        self.fault.send_modify(|f| f.stalled_below = open);
    }

    /// A fault on Postgres replication connections only.
    pub fn set_replication(&self, fault: Fault) {
        self.fault.send_modify(|f| f.replication = fault);
    }

    /// A fault on every connection but Postgres replication ones.
    pub fn set_sql(&self, fault: Fault) {
        self.fault.send_modify(|f| f.other = fault);
    }

    /// Closes every open connection with an RST, on both sides.
    pub fn reset(&self) {
        self.resets.send_modify(|n| *n += 1);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Bytes the proxy has read from its clients so far: a command is on its way once this
    /// grew, even while a delay or a black hole holds it.
    pub fn bytes_from_clients(&self) -> u64 {
        self.from_clients.load(Ordering::Relaxed)
    }

    /// The most chunks the proxy has held at once, read and not yet forwarded (over all its
    /// connections and both directions): above one only if a delay lets chunks overlap.
    pub fn most_chunks_held(&self) -> u64 {
        self.held.most.load(Ordering::Relaxed)
    }

    /// The longest the proxy has held a chunk, from reading it to forwarding it.
    pub fn longest_hold(&self) -> Duration {
        Duration::from_micros(self.held.longest_micros.load(Ordering::Relaxed))
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset();
    }
}

async fn connection(
    client: TcpStream,
    id: u64,
    target: SocketAddr,
    fault: watch::Receiver<Faults>,
    mut resets: watch::Receiver<u64>,
    from_clients: Arc<AtomicU64>,
    held: Held,
) {
    resets.mark_unchanged();
    let replication = Arc::new(AtomicBool::new(false));
    // A black hole swallows the connection attempt too: wait before reaching the target.
    let mut link = Link {
        id,
        fault,
        replication: replication.clone(),
        from_clients,
        held,
    };
    if link.passable().await.is_none() {
        return;
    }
    // Linger 0: a socket closed by a reset (its pumps aborted) sends an RST, not a FIN.
    let _ = client.set_zero_linger();
    let Ok(server) = TcpStream::connect(target).await else {
        return;
    };
    let _ = server.set_zero_linger();
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // Borrowed halves: unlike owned ones they send no FIN when dropped, so a reset is an RST.
    let (mut client, mut server) = (client, server);
    let (cr, cw) = client.split();
    let (sr, sw) = server.split();
    let both = async {
        tokio::join!(pump(cr, sw, link.clone(), true), pump(sr, cw, link, false));
    };
    tokio::select! {
        _ = both => {}
        _ = resets.changed() => {}
    }
}

/// One connection's view of the faults.
#[derive(Clone)]
struct Link {
    /// The connection's number, in accept order.
    id: u64,
    fault: watch::Receiver<Faults>,
    /// Set once the client's startup message asked for replication.
    replication: Arc<AtomicBool>,
    /// The proxy's count of bytes read from clients.
    from_clients: Arc<AtomicU64>,
    /// The proxy's count of chunks read and not yet forwarded.
    held: Held,
}

/// Chunks read and not yet forwarded, over all connections: the most there were at once, and
/// the longest one was held.
#[derive(Clone, Default)]
struct Held {
    now: Arc<AtomicU64>,
    most: Arc<AtomicU64>,
    longest_micros: Arc<AtomicU64>,
}

impl Held {
    /// Counts a chunk read at `arrived` as held until the guard is dropped (forwarded, or
    /// dropped with its connection).
    fn hold(&self, arrived: tokio::time::Instant) -> HeldChunk {
        let now = self.now.fetch_add(1, Ordering::Relaxed) + 1;
        self.most.fetch_max(now, Ordering::Relaxed);
        HeldChunk {
            held: self.clone(),
            arrived,
        }
    }
}

/// One chunk the proxy holds: counted in [`Held`] until dropped.
struct HeldChunk {
    held: Held,
    arrived: tokio::time::Instant,
}

impl HeldChunk {
    /// The chunk went on: how long it was held counts.
    fn forwarded(self) {
        let held = self.arrived.elapsed().as_micros() as u64;
        self.held.longest_micros.fetch_max(held, Ordering::Relaxed);
    }
}

impl Drop for HeldChunk {
    fn drop(&mut self) {
        self.held.now.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Link {
    /// Waits until the fault lets traffic pass; the delay to apply, or `None` if the proxy
    /// is gone.
    async fn passable(&mut self) -> Option<Duration> {
        loop {
            let faults = *self.fault.borrow_and_update();
            let now = if self.id < faults.stalled_below {
                Fault::BlackHole
            } else if self.replication.load(Ordering::Relaxed) {
                faults.replication
            } else {
                faults.other
            };
            match now {
                Fault::Pass => return Some(Duration::ZERO),
                Fault::Delay(d) => return Some(d),
                Fault::BlackHole => self.fault.changed().await.ok()?,
            }
        }
    }
}

/// Whether a client's first bytes hold a startup message asking for replication.
fn asks_for_replication(bytes: &[u8]) -> bool {
    bytes.windows(12).any(|w| w == b"replication\0")
}

/// Forwards one direction (`up`: from the client) as a link with latency does: a reader takes
/// each chunk as it comes and stamps it, a forwarder sends it on at its stamp plus the delay,
/// so chunks in flight overlap and a delay adds to each chunk's latency once, whatever the
/// number of chunks a message was read in. (Holding each chunk in turn instead made a write
/// read in four chunks take four delays: the SIGTERM test's write outlived the command
/// timeout that way.) A black hole stops the reader too, so the sender's socket fills as it
/// would behind a dead route.
async fn pump(
    mut from: tokio::net::tcp::ReadHalf<'_>,
    mut to: tokio::net::tcp::WriteHalf<'_>,
    link: Link,
    up: bool,
) {
    // At most this many chunks in flight per direction: a window, as TCP's is.
    let (tx, mut rx) =
        tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>, Option<HeldChunk>)>(64);
    let mut reader_link = link.clone();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut chunks = 0;
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => 0,
                Ok(n) => n,
            };
            let arrived = tokio::time::Instant::now();
            // The SSL request, then the startup message: the first chunks say what this is.
            if up && chunks < 3 && asks_for_replication(&buf[..n]) {
                reader_link.replication.store(true, Ordering::Relaxed);
            }
            if up {
                reader_link
                    .from_clients
                    .fetch_add(n as u64, Ordering::Relaxed);
            }
            chunks += 1;
            if reader_link.passable().await.is_none() {
                return;
            }
            // The end of the stream (n == 0) is no chunk: not counted.
            let held = (n > 0).then(|| reader_link.held.hold(arrived));
            if tx.send((arrived, buf[..n].to_vec(), held)).await.is_err() || n == 0 {
                return;
            }
        }
    };
    let mut link = link;
    let forward = async move {
        while let Some((arrived, bytes, held)) = rx.recv().await {
            let Some(delay) = link.passable().await else {
                return;
            };
            if !delay.is_zero() {
                tokio::time::sleep_until(arrived + delay).await;
                // The fault may have turned into a black hole while this chunk waited.
                if link.passable().await.is_none() {
                    return;
                }
            }
            if bytes.is_empty() {
                let _ = to.shutdown().await;
                return;
            }
            if to.write_all(&bytes).await.is_err() {
                return;
            }
            if let Some(held) = held {
                held.forwarded();
            }
            let rate = link.fault.borrow().rate;
            if let (true, Some(rate)) = (up, rate) {
                let secs = bytes.len() as f64 / rate.max(1) as f64;
                tokio::time::sleep(Duration::from_secs_f64(secs)).await;
            }
        }
    };
    tokio::join!(read, forward);
}
