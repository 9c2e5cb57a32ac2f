//! A simulated Valkey: asynq's enqueue semantics (a TaskID is created once; each queue's part of
//! a write is all or nothing), with faults the scenario switches on: connection failures (every
//! write issued on the failed connection fails), writes that hang past the writer's timeout,
//! replies lost after the write applied, partial success across queues, queues that refuse for
//! good (WRONGTYPE-like) for a while, maxmemory (OOM) windows, and hashes without a pending
//! entry (tasks a consumer took). It records what the checker needs: first enqueues in order,
//! by whom, and the bytes held by writes not yet answered.

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
    /// OOM: every script is refused until then.
    pub oom_until: Option<Instant>,
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
    pub stuck: BTreeMap<usize, usize>,
    /// Per node, its process's incarnation: a process that exited holds nothing any more.
    pub lives: BTreeMap<usize, u64>,
    pub next_write: u64,
    /// The most bytes one process's writes ever held (outstanding + stuck).
    pub peak_bytes: usize,
    /// Write latency bounds.
    pub latency: (Duration, Duration),
    /// When each client's last write reaches the server: one connection's commands are
    /// applied in the order they were sent.
    pub lane: BTreeMap<String, Instant>,
    /// When each client's last held write is released (a hang holds the commands behind it).
    pub released: BTreeMap<String, Instant>,
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
        let life = self.st.lock().unwrap().life(by.node());
        SimSink {
            server: self.clone(),
            by,
            life,
        }
    }

    /// Node `node`'s process exited (SIGTERM or crash): the memory its writes held is gone.
    pub fn process_exited(&self, node: usize) {
        let mut st = self.st.lock().unwrap();
        *st.lives.entry(node).or_default() += 1;
        st.stuck.remove(&node);
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
/// write whose connection was not reset stays queued ("stuck") until it is.
struct InFlight {
    server: SimValkey,
    write: u64,
    node: usize,
    life: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut st = self.server.st.lock().unwrap();
        if let Some((_, bytes)) = st.outstanding.remove(&self.write) {
            // Dropped before its answer: the bytes stay on the connection until a reset (or
            // until the process exits).
            if st.life(self.node) == self.life {
                *st.stuck.entry(self.node).or_default() += bytes;
            }
        }
    }
}

impl State {
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
        (outstanding, self.stuck.get(&node).copied().unwrap_or(0))
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
        async move {
            let latency = server.latency();
            let (write, epoch, arrives) = {
                let mut st = server.st.lock().unwrap();
                let lane = format!("{by:?}");
                let earliest = st
                    .lane
                    .get(&lane)
                    .map_or(Instant::now(), |t| *t + Duration::from_millis(1));
                let arrives = (Instant::now() + latency).max(earliest);
                st.lane.insert(lane, arrives);
                let write = st.next_write;
                st.next_write += 1;
                let bytes = batch.bytes + 64 * batch.len();
                st.outstanding.insert(write, (by.node(), bytes));
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
                format!("issued (write {write}, epoch {epoch})")
            });
            let guard = InFlight {
                server: server.clone(),
                write,
                node: by.node(),
                life,
            };
            tokio::time::sleep_until(arrives).await;
            // A hanging server holds the write; the connection's later commands wait behind
            // it (each released after the one before, a millisecond apart: tokio's timer fires
            // deadlines within one millisecond in no set order), even when the server recovers
            // meanwhile.
            let release = {
                let mut st = server.st.lock().unwrap();
                let now = Instant::now();
                let lane = format!("{by:?}");
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
            let result = apply(&server, &batch, by, epoch);
            server.st.lock().unwrap().outstanding.remove(&write);
            drop(guard);
            result
        }
    }

    fn reset(&self) {
        let mut st = self.server.st.lock().unwrap();
        st.stuck.remove(&self.by.node());
        st.epoch += 1;
    }
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
) -> Result<WriteOutcome, SinkError> {
    let result = apply_inner(server, batch, by, epoch);
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
) -> Result<WriteOutcome, SinkError> {
    let now = Instant::now();
    let mut st = server.st.lock().unwrap();
    if epoch != st.epoch {
        return Err(SinkError::Simulated(
            "connection lost (write issued on a dead connection)",
        ));
    }
    if st.down_until.is_some_and(|t| t > now) {
        st.epoch += 1;
        return Err(SinkError::Simulated("connection refused"));
    }
    if st.oom_until.is_some_and(|t| t > now) {
        // Every queue's script refused at its first write: nothing applied. The pipelined
        // writes behind it are refused too (the connection is replaced by the retry).
        st.epoch += 1;
        return Err(SinkError::Simulated("OOM command not allowed"));
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
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, t) in batch.tasks.iter().enumerate() {
        match groups.iter_mut().find(|(q, _)| *q == &*t.queue) {
            Some((_, v)) => v.push(i),
            None => groups.push((&t.queue, vec![i])),
        }
    }
    let mut out = WriteOutcome::default();
    for (n, (queue, idx)) in groups.iter().enumerate() {
        if partial && n > 0 {
            st.epoch += 1;
            return Err(SinkError::Simulated("connection dropped mid-pipeline"));
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
        st.epoch += 1;
        return Err(SinkError::Simulated("reply lost (the write applied)"));
    }
    Ok(out)
}
