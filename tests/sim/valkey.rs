//! A simulated Valkey: asynq's enqueue semantics (a TaskID is created once; each queue's part of
//! a write is all or nothing), with faults the scenario switches on: connection failures (every
//! write issued on the failed connection fails), writes that hang past the writer's timeout,
//! replies lost after the write applied, partial success across queues, queues that refuse for
//! good (WRONGTYPE-like) for a while, maxmemory (OOM) windows, memory flapping at `maxmemory`
//! (some writes refused, the ones pipelined behind them not), and hashes without a pending
//! entry (tasks a consumer took). The stream's writes are fenced per queue as the real enqueue
//! script fences them (src/sink/order_chain.rs): a write whose queue's predecessor has not
//! landed is refused with FENCED. It records what the checker needs: first enqueues in order,
//! by whom, and the bytes held by writes not yet answered.

use outbox_relay::sink::order_chain::{Link, OrderChain};
use outbox_relay::sink::valkey::by_queue;
use outbox_relay::sink::{Batch, Rejected, Sink, SinkError, WriteOutcome};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Who wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    Stream(usize),
    Poller(usize),
}

impl Writer {
    /// The relay process (simulated node) that writes.
    pub fn node(self) -> usize {
        match self {
            Writer::Stream(n) | Writer::Poller(n) => n,
        }
    }
}

/// A first enqueue: the task came to exist.
#[derive(Debug, Clone)]
pub struct Created {
    pub queue: String,
    pub id: String,
    pub by: Writer,
    /// When the write that created it was applied (simulated time). Read by
    /// tests/group_commit.rs only; the example that includes this module does not.
    #[allow(dead_code)]
    pub at: Instant,
}

#[derive(Debug, Default)]
pub struct State {
    /// Task hashes: (queue, id) -> state.
    pub tasks: BTreeMap<(String, String), &'static str>,
    /// Pending lists (front = newest, as LPUSH leaves them).
    pub pending: BTreeMap<String, VecDeque<String>>,
    /// Every creation, in order.
    pub created: Vec<Created>,
    /// Ids a write answered as rejected.
    pub rejected: BTreeSet<String>,
    /// Ids a stream's write answered as rejected: the only refusals that let a stream
    /// acknowledge past a row without its task.
    pub rejected_to_stream: BTreeSet<String>,
    // Faults.
    /// Writes fail (connection refused) until then.
    pub down_until: Option<Instant>,
    /// Writes hang until then (the writer's timeout fires first).
    pub hang_until: Option<Instant>,
    /// The link drops every packet until then: a write sent meanwhile reaches the server only
    /// when it ends (TCP sends it again), and never if its connection was reset before.
    pub black_hole_until: Option<Instant>,
    /// Connections the server dropped (a fault met while applying a write): commands of theirs
    /// that already arrived die with them. A connection the relay reset is not among them: what
    /// it had sent and the server had received still applies.
    pub dropped_by_server: BTreeSet<u64>,
    /// OOM: every script is refused until then.
    pub oom_until: Option<Instant>,
    /// Memory flapping at `maxmemory` until then: each write is refused (OOM, a server reply:
    /// the connection stays) or not, at random, so the writes pipelined behind a refused one
    /// may apply.
    pub oom_flap_until: Option<Instant>,
    /// Each queue's order key: the token of the stream's last write that landed on it.
    pub fence: BTreeMap<String, String>,
    /// Sinks made so far (their order chains' nonces).
    pub sinks: u64,
    /// The next n writes apply, then lose their reply (the connection drops).
    pub reply_lost: u32,
    /// The next n writes apply their first queue only, then the connection drops.
    pub partial: u32,
    /// Queues refusing for good until then (their rows go to the poller).
    pub rejecting: BTreeMap<String, Instant>,
    /// The connection generation: a write issued on an older one fails (its connection died).
    pub epoch: u64,
    /// Writes issued and not answered, by write number: (node, bytes).
    pub outstanding: BTreeMap<u64, (usize, usize)>,
    /// Per node, bytes of abandoned writes still queued on a connection it did not reset.
    /// Writes dropped before their answer and not yet answered by the server: write number ->
    /// (node, bytes). A reset or the process's exit frees them, and so does the server's answer.
    pub stuck: BTreeMap<u64, (usize, usize)>,
    /// Per node, its process's incarnation: a process that exited holds nothing any more.
    pub lives: BTreeMap<usize, u64>,
    pub next_write: u64,
    /// The most bytes one process's writes ever held (outstanding + stuck).
    pub peak_bytes: usize,
    /// The most writes one writer ever had outstanding at once, per writer.
    pub peak_writes: BTreeMap<String, usize>,
    /// Write latency bounds.
    pub latency: (Duration, Duration),
    /// When each connection's last write reaches the server (by writer and connection
    /// generation): one connection's commands are applied in the order they were sent.
    pub lane: BTreeMap<String, Instant>,
    /// When each connection's last held write is released (a hang holds the commands behind
    /// it). Two connections of one writer are released independently, in no set order.
    pub released: BTreeMap<String, Instant>,
    /// Each client's writes issued and not yet answered (or dropped).
    pub lane_writes: BTreeMap<String, usize>,
    /// What one process's writes may hold at most (outstanding + stuck), and the violations
    /// seen.
    pub bound: usize,
    pub violations: Vec<String>,
}

/// Clones share one server.
#[derive(Clone)]
pub struct SimValkey {
    pub st: Arc<Mutex<State>>,
    rng: Arc<Mutex<rand::rngs::SmallRng>>,
}

/// A client of the server, tagged with who writes through it.
#[derive(Clone)]
pub struct SimSink {
    pub server: SimValkey,
    pub by: Writer,
    /// The incarnation of the process it belongs to.
    life: u64,
    /// The stream's sink only: its writes' places in their queues' order chains.
    order: Option<OrderChain>,
}

impl SimValkey {
    pub fn new(seed: u64) -> Self {
        use rand::SeedableRng;
        Self {
            st: Arc::new(Mutex::new(State {
                latency: (Duration::from_micros(200), Duration::from_millis(3)),
                ..State::default()
            })),
            rng: Arc::new(Mutex::new(rand::rngs::SmallRng::seed_from_u64(
                seed ^ 0x5eed,
            ))),
        }
    }

    pub fn sink(&self, by: Writer) -> SimSink {
        let mut st = self.st.lock().unwrap();
        let life = st.life(by.node());
        st.sinks += 1;
        // Every node streams the same slot: one stream, one field of the order keys. The
        // nonce is unique per sink and the same in every replay of a seed.
        let order = matches!(by, Writer::Stream(_))
            .then(|| OrderChain::with_nonce("sim".into(), format!("sink{}", st.sinks)));
        SimSink {
            server: self.clone(),
            by,
            life,
            order,
        }
    }

    /// Node `node`'s process exited (SIGTERM or crash): the memory its writes held is gone.
    pub fn process_exited(&self, node: usize) {
        let mut st = self.st.lock().unwrap();
        *st.lives.entry(node).or_default() += 1;
        st.stuck.retain(|_, (n, _)| *n != node);
        st.outstanding.retain(|_, (n, _)| *n != node);
    }

    pub fn exists(&self, queue: &str, id: &str) -> bool {
        let st = self.st.lock().unwrap();
        st.tasks.contains_key(&(queue.to_owned(), id.to_owned()))
    }

    /// A consumer takes the oldest pending task of `queue` and completes it (the hash stays,
    /// for the retention: a replay still dedupes).
    pub fn consume_one(&self, queue: &str) {
        let mut st = self.st.lock().unwrap();
        let Some(id) = st.pending.get_mut(queue).and_then(|l| l.pop_back()) else {
            return;
        };
        st.tasks.insert((queue.to_owned(), id), "completed");
    }

    fn latency(&self) -> Duration {
        use rand::Rng;
        let (lo, hi) = self.st.lock().unwrap().latency;
        let mut rng = self.rng.lock().unwrap();
        Duration::from_micros(rng.random_range(lo.as_micros() as u64..=hi.as_micros() as u64))
    }
}

/// Removes a write's bytes from `outstanding` when its future ends or is dropped; a dropped
/// write whose connection was not reset stays queued ("stuck") until it is, or until the server
/// answers it.
struct InFlight {
    server: SimValkey,
    write: u64,
    node: usize,
    life: u64,
    lane: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut st = self.server.st.lock().unwrap();
        if let Some(n) = st.lane_writes.get_mut(&self.lane) {
            *n -= 1;
        }
        if let Some((_, bytes)) = st.outstanding.remove(&self.write) {
            // Dropped before its answer: the bytes stay on the connection until a reset, the
            // server's answer, or the process's exit.
            if st.life(self.node) == self.life {
                st.stuck.insert(self.write, (self.node, bytes));
            }
        }
    }
}

impl State {
    /// The server drops the current connection: its commands still queued die with it.
    fn drop_connection(&mut self) {
        self.dropped_by_server.insert(self.epoch);
        self.epoch += 1;
    }

    fn life(&self, node: usize) -> u64 {
        self.lives.get(&node).copied().unwrap_or(0)
    }

    /// What node `node`'s writes hold: (outstanding, stuck).
    fn held(&self, node: usize) -> (usize, usize) {
        let outstanding = self
            .outstanding
            .values()
            .filter(|(n, _)| *n == node)
            .map(|(_, b)| b)
            .sum();
        let stuck = self
            .stuck
            .values()
            .filter(|(n, _)| *n == node)
            .map(|(_, b)| b)
            .sum();
        (outstanding, stuck)
    }
}

impl Sink for SimSink {
    fn write(
        &self,
        batch: Arc<Batch>,
    ) -> impl std::future::Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static {
        let server = self.server.clone();
        let by = self.by;
        let life = self.life;
        // Taken when the write is issued, as the real sink does: one script call per queue.
        let links: Vec<(String, Link)> = match &self.order {
            Some(order) => by_queue(&batch.tasks)
                .into_iter()
                .map(|(q, _)| (q.to_owned(), order.issue(q, 1).remove(0)))
                .collect(),
            None => Vec::new(),
        };
        async move {
            let latency = server.latency();
            let (write, epoch, arrives) = {
                let mut st = server.st.lock().unwrap();
                let lane = format!("{by:?}");
                let connection = format!("{by:?}@{}", st.epoch);
                let earliest = st
                    .lane
                    .get(&connection)
                    .map_or(Instant::now(), |t| *t + Duration::from_millis(1));
                let arrives = (Instant::now() + latency).max(earliest);
                st.lane.insert(connection, arrives);
                let write = st.next_write;
                st.next_write += 1;
                let bytes = batch.bytes + 64 * batch.len();
                st.outstanding.insert(write, (by.node(), bytes));
                let lane_writes = st.lane_writes.entry(lane.clone()).or_default();
                *lane_writes += 1;
                let now_out = *lane_writes;
                let peak = st.peak_writes.entry(lane.clone()).or_default();
                *peak = (*peak).max(now_out);
                let (outstanding, stuck) = st.held(by.node());
                let held = outstanding + stuck;
                st.peak_bytes = st.peak_bytes.max(held);
                if held > st.bound {
                    let msg = format!(
                        "memory: node {}'s writes hold {held} bytes (outstanding {outstanding}, \
                         stuck on a connection that was never reset {stuck}), over the bound {}",
                        by.node(),
                        st.bound
                    );
                    st.violations.push(msg);
                }
                (write, st.epoch, arrives)
            };
            watch(&batch, by, &|| {
                format!("issued (write {write}, epoch {epoch}, links {links:?})")
            });
            let guard = InFlight {
                server: server.clone(),
                write,
                node: by.node(),
                life,
                lane: format!("{by:?}"),
            };
            // The server's side runs on its own: a write the relay gave up on (its future
            // dropped) still reaches the server and applies there, unless its connection was
            // reset first, as pipelined commands do on a real connection.
            let (answer, answered) = tokio::sync::oneshot::channel();
            let on_server = server.clone();
            tokio::spawn(async move {
                let server = on_server;
                tokio::time::sleep_until(arrives).await;
                let hole = server
                    .st
                    .lock()
                    .unwrap()
                    .black_hole_until
                    .filter(|t| *t > Instant::now());
                if let Some(end) = hole {
                    tokio::time::sleep_until(end).await;
                }
                // Received, unless the relay reset its connection before: then it never
                // arrives. Once received it applies even if the relay resets the connection
                // while a hang holds it (the server reads what was sent before the close).
                let arrived = server.st.lock().unwrap().epoch == epoch;
                // A hanging server holds the write; the connection's later commands wait behind
                // it (each released after the one before, a millisecond apart: tokio's timer fires
                // deadlines within one millisecond in no set order), even when the server recovers
                // meanwhile.
                let release = {
                    let mut st = server.st.lock().unwrap();
                    let now = Instant::now();
                    let lane = format!("{by:?}@{epoch}");
                    let behind = st
                        .released
                        .get(&lane)
                        .filter(|t| **t >= now)
                        .map(|t| *t + Duration::from_millis(1));
                    let hang = st.hang_until.filter(|t| *t > now);
                    let release = match (hang, behind) {
                        (Some(h), Some(b)) => Some(h.max(b)),
                        (h, b) => h.or(b),
                    };
                    if let Some(r) = release {
                        st.released.insert(lane, r);
                    }
                    release
                };
                if let Some(until) = release {
                    tokio::time::sleep_until(until).await;
                }
                let result = apply(&server, &batch, by, epoch, arrived, &links);
                // Answered: a write the relay gave up on holds nothing any more.
                server.st.lock().unwrap().stuck.remove(&write);
                let _ = answer.send(result);
            });
            let result = answered.await.unwrap_or(Err(SinkError::Simulated(
                "the server's side of the write ended without an answer",
            )));
            server.st.lock().unwrap().outstanding.remove(&write);
            drop(guard);
            result
        }
    }

    fn reset(&self) {
        let mut st = self.server.st.lock().unwrap();
        let node = self.by.node();
        st.stuck.retain(|_, (n, _)| *n != node);
        st.epoch += 1;
    }

    fn restart_order(&self) {
        if let Some(order) = &self.order {
            order.restart();
        }
    }
}

/// A server's error reply, as the real sink returns it (it does not poison the connection).
fn server_error(resp: &str) -> SinkError {
    SinkError::Valkey(
        redis::parse_redis_value(format!("-{resp}\r\n").as_bytes())
            .expect("a RESP error")
            .extract_error()
            .expect_err("an error reply"),
    )
}

/// Triage: `OUTBOX_SIM_WATCH=<event id suffix>[,...]` prints every write that carries one of
/// those tasks, and what became of it.
fn watch(batch: &Batch, by: Writer, what: &dyn Fn() -> String) {
    static WATCH: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let watched = WATCH.get_or_init(|| {
        std::env::var("OUTBOX_SIM_WATCH")
            .map(|v| v.split(',').map(str::to_owned).collect())
            .unwrap_or_default()
    });
    if watched.is_empty() {
        return;
    }
    for t in batch.tasks.iter() {
        if watched.iter().any(|w| t.id.ends_with(w.as_str())) {
            eprintln!(
                "watch {:?}: {} written by {by:?}: {}",
                Instant::now(),
                t.id,
                what()
            );
        }
    }
}

fn apply(
    server: &SimValkey,
    batch: &Batch,
    by: Writer,
    epoch: u64,
    arrived: bool,
    links: &[(String, Link)],
) -> Result<WriteOutcome, SinkError> {
    let result = apply_inner(server, batch, by, epoch, arrived, links);
    watch(batch, by, &|| {
        format!("applied (epoch {epoch}): {result:?}")
    });
    result
}

fn apply_inner(
    server: &SimValkey,
    batch: &Batch,
    by: Writer,
    epoch: u64,
    arrived: bool,
    links: &[(String, Link)],
) -> Result<WriteOutcome, SinkError> {
    let now = Instant::now();
    let mut st = server.st.lock().unwrap();
    if epoch != st.epoch && (!arrived || st.dropped_by_server.contains(&epoch)) {
        return Err(SinkError::Simulated(
            "connection lost (write issued on a dead connection)",
        ));
    }
    if st.down_until.is_some_and(|t| t > now) {
        st.drop_connection();
        return Err(SinkError::Simulated("connection refused"));
    }
    if st.oom_until.is_some_and(|t| t > now) {
        // Every queue's script refused at its first write: nothing applied. The pipelined
        // writes behind it are refused too (the connection is replaced by the retry).
        st.drop_connection();
        return Err(SinkError::Simulated("OOM command not allowed"));
    }
    if st.oom_flap_until.is_some_and(|t| t > now) {
        use rand::Rng;
        if server.rng.lock().unwrap().random_bool(0.5) {
            // Every queue's script refused at its first write; the connection stays.
            return Err(server_error(
                "OOM command not allowed when used memory > 'maxmemory'. (simulated)",
            ));
        }
    }
    let lose_reply = st.reply_lost > 0;
    if lose_reply {
        st.reply_lost -= 1;
    }
    let partial = st.partial > 0;
    if partial {
        st.partial -= 1;
    }
    // Queues in order of first appearance, each all or nothing.
    let groups = by_queue(&batch.tasks);
    let mut out = WriteOutcome::default();
    let mut fenced = false;
    for (n, (queue, idx)) in groups.iter().enumerate() {
        if partial && n > 0 {
            st.drop_connection();
            return Err(SinkError::Simulated("connection dropped mid-pipeline"));
        }
        // The enqueue script's fence, before anything else of the queue (a queue refusing for
        // good moves it too: the script sets it before its type check).
        if let Some((_, link)) = links.iter().find(|(q, _)| q == queue) {
            if !link.prev.is_empty() && st.fence.get(*queue) != Some(&link.prev) {
                fenced = true;
                continue;
            }
            st.fence.insert(queue.to_string(), link.token.clone());
        }
        if st.rejecting.get(*queue).is_some_and(|t| *t > now) {
            for &i in idx {
                st.rejected.insert(batch.tasks[i].id.clone());
                if matches!(by, Writer::Stream(_)) {
                    st.rejected_to_stream.insert(batch.tasks[i].id.clone());
                }
                out.rejected.push(Rejected {
                    index: i,
                    reason: format!("WRONGTYPE (simulated) on queue {queue}"),
                });
            }
            continue;
        }
        for &i in idx {
            let t = &batch.tasks[i];
            let key = (queue.to_string(), t.id.clone());
            if let std::collections::btree_map::Entry::Vacant(e) = st.tasks.entry(key) {
                e.insert("pending");
                st.pending
                    .entry(queue.to_string())
                    .or_default()
                    .push_front(t.id.clone());
                st.created.push(Created {
                    queue: queue.to_string(),
                    id: t.id.clone(),
                    by,
                    at: Instant::now(),
                });
                out.enqueued += 1;
            } else {
                out.duplicates += 1;
            }
        }
    }
    // Refusals are listed queue by queue, as a sink meets them, not in batch order: the relay
    // must not rely on their order (sorting here hid a bug that marked refused rows published).
    if lose_reply {
        st.drop_connection();
        return Err(SinkError::Simulated("reply lost (the write applied)"));
    }
    if fenced {
        return Err(server_error(
            "FENCED the call before this one has not landed (simulated)",
        ));
    }
    Ok(out)
}
