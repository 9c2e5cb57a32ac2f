//! The deterministic simulation of the delivery core (in the spirit of FoundationDB's simulation
//! testing and TigerBeetle's VOPR).
//!
//! The relay's own session loop, writer, acknowledgement tracker, supervisor (reconnects, slot
//! loss, standby takeover), marker and poller run unchanged against a simulated Postgres
//! ([`db`]) and Valkey ([`valkey`]) on one thread, on tokio's paused clock: time moves only when
//! every task waits, and one seed drives every choice — the workload (transactions of random
//! sizes over several queues, bad rows, rollbacks, other tables' WAL), every fault (Valkey down,
//! hanging, black-holed, replies lost, partial success, queues refusing, OOM, memory flapping
//! at maxmemory; SQL down; SIGTERM, crashes, links cut into zombie walsenders, slots dropped or invalidated)
//! and the relays' settings. The checker ([`check`]) runs at every acknowledgement and every
//! mark, and at the end.
//!
//! A failure names its seed; `cargo run --example simulate -- --seed N` replays it.

pub mod check;
pub mod db;
pub mod valkey;
mod wire;

use check::Checker;
use db::{SimDb, SimOutbox, SimPort};
use outbox_relay::config::OnSlotLost;
use outbox_relay::marker::Marker;
use outbox_relay::metrics::Metrics;
use outbox_relay::pgoutput::TableName;
use outbox_relay::poller::{Poller, PollerSettings};
use outbox_relay::replication::stream::{Stream, StreamSettings};
use outbox_relay::task::{QueueRoute, TaskSettings};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use valkey::{SimValkey, Writer};

/// What one run does.
#[derive(Debug, Clone)]
pub struct Options {
    /// Scenario steps (each a random action after a random pause).
    pub steps: usize,
    /// Print the scenario's actions as they happen.
    pub verbose: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            steps: 300,
            verbose: false,
        }
    }
}

/// What a run did.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub rows: usize,
    pub tasks: usize,
    pub faults: usize,
    pub sim_secs: u64,
    pub peak_write_bytes: usize,
}

/// A failed run: the seed, the violations, and the scenario's last actions.
#[derive(Debug)]
pub struct Failure {
    pub seed: u64,
    pub violations: Vec<String>,
    pub trace: Vec<String>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "simulation seed {} failed:", self.seed)?;
        for v in self.violations.iter().take(10) {
            writeln!(f, "  violation: {v}")?;
        }
        writeln!(f, "  last actions:")?;
        for t in self.trace.iter().rev().take(40).rev() {
            writeln!(f, "    {t}")?;
        }
        write!(
            f,
            "replay: cargo run --example simulate -- --seed {} --verbose",
            self.seed
        )
    }
}

/// Runs seed `seed` to the end and checks it.
pub fn run(seed: u64, opts: &Options) -> Result<Outcome, Failure> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    outbox_relay::backoff::seed_jitter(Some(seed));
    let result = rt.block_on(World::new(seed, opts.clone()).run());
    outbox_relay::backoff::seed_jitter(None);
    result
}

/// The relay settings a seed picks.
#[derive(Debug, Clone)]
struct Knobs {
    batch_rows: usize,
    batch_bytes: usize,
    max_inflight: usize,
    delete_delivered: bool,
    nodes: usize,
    /// The stream's receive deadline (`OUTBOX_LINK_TIMEOUT`), or none.
    link_timeout: Option<Duration>,
}

/// One relay process: its stream, marker and poller.
struct Node {
    shutdown: CancellationToken,
    background: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    stream: Option<JoinHandle<()>>,
    session: Arc<Mutex<Option<u64>>>,
    /// Stopped; restarts at this time.
    restart_at: Option<Instant>,
}

struct World {
    seed: u64,
    opts: Options,
    rng: SmallRng,
    db: SimDb,
    valkey: SimValkey,
    checker: Checker,
    tasks: Arc<TaskSettings>,
    knobs: Knobs,
    nodes: Vec<Node>,
    trace: Vec<String>,
    faults: usize,
    next_event: u64,
}

const QUEUES: [(&str, &str); 4] = [
    ("a.created", "qa"),
    ("b.created", "qb"),
    ("c.created", "qc"),
    ("d.created", "default"),
];
/// Rows the recovery poller leaves to the stream for this long.
const GRACE: Duration = Duration::from_secs(2);
/// How long the world runs without faults at the end.
const QUIET_END: Duration = Duration::from_secs(120);

impl World {
    fn new(seed: u64, opts: Options) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let valkey = SimValkey::new(seed);
        let checker = Checker::new(valkey.clone());
        let db = SimDb::new(checker.clone());
        let knobs = Knobs {
            batch_rows: *[1, 3, 10, 50, 500].get(rng.random_range(0..5)).unwrap(),
            batch_bytes: *[300, 4096, 8 << 20].get(rng.random_range(0..3)).unwrap(),
            max_inflight: rng.random_range(1..=4),
            delete_delivered: rng.random_bool(0.3),
            nodes: if rng.random_bool(0.4) { 2 } else { 1 },
            // From a generator of its own, so that every other choice of a seed stays as it
            // was before this knob existed. Short enough to end a cut link within the
            // scenario's few seconds (nodes restart often); the simulated walsender then sends
            // keepalives three times as often, as a real one sends them every
            // wal_sender_timeout / 2 below the deadline an operator sets: an idle link is never
            // silent for the whole deadline, a cut one is.
            link_timeout: {
                let mut r = SmallRng::seed_from_u64(seed ^ 0x11_4b);
                r.random_bool(0.5)
                    .then(|| Duration::from_millis(*[200, 1000].get(r.random_range(0..2)).unwrap()))
            },
        };
        {
            let mut st = db.st.lock().unwrap();
            st.delete_delivered = knobs.delete_delivered;
            st.can_see_replies = rng.random_bool(0.8);
            if let Some(t) = knobs.link_timeout {
                st.keepalive_every = t / 3;
            }
        }
        // Each node's stream holds at most max_inflight batches (each within the byte bound
        // plus one task), and its poller one chunk: what one process's writes may hold.
        let per_task = 700;
        let per_batch = knobs.batch_bytes.min(knobs.batch_rows * per_task) + per_task;
        valkey.st.lock().unwrap().bound = (knobs.max_inflight * per_batch + 10 * per_task) * 2;
        let routes = ["a.*=qa", "b.*=qb", "c.*=qc"]
            .iter()
            .map(|r| QueueRoute::parse(r).expect("route"))
            .collect();
        let tasks = Arc::new(TaskSettings {
            routes,
            ..TaskSettings::default()
        });
        Self {
            seed,
            opts,
            rng,
            db,
            valkey,
            checker,
            tasks,
            knobs,
            nodes: Vec::new(),
            trace: Vec::new(),
            faults: 0,
            next_event: 1,
        }
    }

    fn log(&mut self, what: String) {
        let at = Instant::now().duration_since(self.checker.start());
        let line = format!("[{:>9.3}s] {what}", at.as_secs_f64());
        if self.opts.verbose {
            eprintln!("{line}");
        }
        self.trace.push(line);
    }

    fn start_node(&mut self, idx: usize) -> Node {
        let metrics = Arc::new(Metrics::new(
            &mut prometheus_client::registry::Registry::default(),
        ));
        let outbox = SimOutbox {
            db: self.db.clone(),
        };
        let shutdown = CancellationToken::new();
        let background = CancellationToken::new();
        let (marker, handle) = Marker::new(outbox.clone(), metrics.clone(), Some(GRACE));
        let mut tasks = vec![tokio::spawn(marker.run(background.clone()))];
        // A background task that ends before shutdown (a panic) is found when the node stops.
        let poller = Poller {
            table: outbox,
            settings: PollerSettings {
                batch_size: 50,
                chunk_size: 10,
                // The stream's bound: with 300 or 4096 bytes a round cuts more writes than its
                // count allows for between two statements, and marks part of its rows early.
                chunk_bytes: self.knobs.batch_bytes,
                // Rows of 9 bytes: with 300 bytes a round reads 34 of its 50 and leaves the rest
                // locked, for the round after it.
                claim_bytes: self.knobs.batch_bytes,
                poll_interval: Duration::from_millis(200),
                recovery_grace: Some(GRACE),
                max_attempts: 3,
                attempt_backoff: Duration::from_millis(200),
                write_timeout: Duration::from_secs(1),
            },
            tasks: self.tasks.clone(),
            sink: self.valkey.sink(Writer::Poller(idx)),
            metrics: metrics.clone(),
            wake: Arc::default(),
            shared_ids: None,
        };
        let token = background.clone();
        tasks.push(tokio::spawn(async move { poller.run(token).await }));
        let session = Arc::new(Mutex::new(None));
        let stream = Stream {
            port: SimPort {
                db: self.db.clone(),
                last_session: session.clone(),
            },
            settings: StreamSettings {
                slot: "outbox_relay".into(),
                table: TableName::parse("public.outbox_events").expect("name"),
                batch_rows: self.knobs.batch_rows,
                batch_bytes: self.knobs.batch_bytes,
                max_inflight: self.knobs.max_inflight,
                write_timeout: Duration::from_secs(1),
                shutdown_timeout: Duration::from_secs(2),
                on_slot_lost: OnSlotLost::Recreate,
                takeover_after: Duration::from_secs(5),
                // A cut link (a zombie walsender) is silent: with a deadline the session finds
                // it dead itself, asks the server (the busy probe), and reconnects.
                link_timeout: self.knobs.link_timeout,
                // Its publication cannot go missing.
                publication_check: None,
            },
            tasks: self.tasks.clone(),
            sink: self.valkey.sink(Writer::Stream(idx)),
            metrics,
            marker: Some(handle),
            shared_ids: None,
            slot_watch: Default::default(),
        };
        let token = shutdown.clone();
        let bg = background.clone();
        let checker = self.checker.clone();
        let stream = tokio::spawn(async move {
            let result = std::panic::AssertUnwindSafe(stream.run(token));
            match futures::FutureExt::catch_unwind(result).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    checker.violate(format!("node {idx}: the stream stopped with an error: {e}"))
                }
                Err(_) => checker.violate(format!("node {idx}: the stream panicked")),
            }
            bg.cancel();
        });
        Node {
            shutdown,
            background,
            tasks,
            stream: Some(stream),
            session,
            restart_at: None,
        }
    }

    /// SIGTERM: the stream finishes (final acknowledgement), then the background tasks.
    async fn stop_node(&mut self, idx: usize) {
        let node = &mut self.nodes[idx];
        node.shutdown.cancel();
        if let Some(s) = node.stream.take() {
            let _ = s.await;
        }
        node.background.cancel();
        let deadline = Instant::now() + Duration::from_secs(3);
        for t in node.tasks.drain(..) {
            match tokio::time::timeout_at(deadline, t).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => self
                    .checker
                    .violate(format!("node {idx}: a background task failed: {e}")),
                Err(_) => self
                    .checker
                    .violate(format!("node {idx}: a background task did not stop")),
            }
        }
        self.valkey.process_exited(idx);
    }

    /// A crash: every task dropped where it stands.
    fn crash_node(&mut self, idx: usize) {
        let node = &mut self.nodes[idx];
        if let Some(s) = node.stream.take() {
            s.abort();
        }
        for t in node.tasks.drain(..) {
            t.abort();
        }
        self.valkey.process_exited(idx);
    }

    fn running(&self, idx: usize) -> bool {
        self.nodes[idx].stream.is_some()
    }

    fn commit(&mut self) {
        let n = match self.rng.random_range(0..20) {
            0 => self.rng.random_range(100..400),
            1..=4 => 0,
            _ => self.rng.random_range(1..12),
        };
        let mut rows = Vec::with_capacity(n);
        for _ in 0..n {
            let (name, queue) = QUEUES[self.rng.random_range(0..QUEUES.len())];
            let good = !self.rng.random_bool(0.03);
            let id = format!("00000000-0000-4000-8000-{:012x}", self.next_event);
            self.next_event += 1;
            rows.push((id, name.to_owned(), queue.to_owned(), good));
        }
        if self.rng.random_bool(0.05) {
            self.db.other_wal(200);
            self.log(format!("rolled back a transaction of {n} rows"));
            return;
        }
        let visible = Duration::from_micros(self.rng.random_range(0..5000));
        let lsn = self.db.commit(&rows, visible);
        self.log(format!("committed {n} rows at {lsn}"));
    }

    fn until(&mut self, lo_ms: u64, hi_ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(self.rng.random_range(lo_ms..=hi_ms))
    }

    async fn step(&mut self) {
        let pause = self.rng.random_range(0..30);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let idx = self.rng.random_range(0..self.nodes.len());
        let roll = self.rng.random_range(0..100);
        let fault = match roll {
            0..=54 => {
                self.commit();
                None
            }
            55..=61 => {
                self.db.other_wal(500);
                None
            }
            62..=65 => {
                let t = self.until(50, 3000);
                self.valkey.st.lock().unwrap().down_until = Some(t);
                Some("valkey down".to_string())
            }
            66..=67 => {
                let t = self.until(500, 3000);
                self.valkey.st.lock().unwrap().hang_until = Some(t);
                Some("valkey hangs (writes time out)".into())
            }
            68..=69 => {
                self.valkey.st.lock().unwrap().reply_lost += 1;
                Some("next valkey reply lost after the write applied".into())
            }
            70..=71 => {
                self.valkey.st.lock().unwrap().partial += 1;
                Some("next valkey write applies its first queue only".into())
            }
            72..=74 => {
                let (_, q) = QUEUES[self.rng.random_range(0..QUEUES.len())];
                let t = self.until(200, 5000);
                self.valkey
                    .st
                    .lock()
                    .unwrap()
                    .rejecting
                    .insert(q.to_owned(), t);
                Some(format!("queue {q} refuses for good for a while"))
            }
            75..=76 => {
                let t = self.until(100, 2000);
                self.valkey.st.lock().unwrap().oom_until = Some(t);
                Some("valkey at maxmemory (OOM)".into())
            }
            77..=78 => {
                let t = self.until(100, 2000);
                self.db.st.lock().unwrap().sql_down_until = Some(t);
                Some("sql connections refused".into())
            }
            79..=80 if self.running(idx) => {
                self.stop_node(idx).await;
                self.nodes[idx].restart_at = Some(self.until(0, 500));
                Some(format!("SIGTERM node {idx}"))
            }
            81..=82 if self.running(idx) => {
                self.crash_node(idx);
                self.nodes[idx].restart_at = Some(self.until(0, 500));
                Some(format!("crash node {idx}"))
            }
            83 => {
                let invalidate = self.rng.random_bool(0.5);
                self.db.lose_slot(invalidate);
                Some(format!("slot lost (invalidated: {invalidate})"))
            }
            84 if self.running(idx) => {
                let session = *self.nodes[idx].session.lock().unwrap();
                session.map(|s| {
                    self.db.cut(s, true);
                    format!("node {idx}'s replication link cut (walsender {s} becomes a zombie)")
                })
            }
            95..=96 => {
                let t = self.until(100, 2000);
                self.valkey.st.lock().unwrap().oom_flap_until = Some(t);
                Some("valkey memory flapping at maxmemory (some writes refused)".into())
            }
            97 => {
                let t = self.until(2000, 8000);
                self.valkey.st.lock().unwrap().black_hole_until = Some(t);
                Some("valkey link black-holed (writes unanswered until it ends or a reset)".into())
            }
            85..=94 => {
                let (_, q) = QUEUES[self.rng.random_range(0..QUEUES.len())];
                for _ in 0..self.rng.random_range(1..20) {
                    self.valkey.consume_one(q);
                }
                None
            }
            _ => None,
        };
        if let Some(f) = fault {
            self.faults += 1;
            self.log(f);
        }
        for i in 0..self.nodes.len() {
            if self.nodes[i]
                .restart_at
                .is_some_and(|t| t <= Instant::now())
            {
                self.nodes[i] = self.start_node(i);
                self.log(format!("node {i} started"));
            }
        }
    }

    async fn run(mut self) -> Result<Outcome, Failure> {
        self.log(format!("seed {} knobs {:?}", self.seed, self.knobs));
        for i in 0..self.knobs.nodes {
            let node = self.start_node(i);
            self.nodes.push(node);
        }
        for _ in 0..self.opts.steps {
            self.step().await;
            if !self.checker.violations().is_empty() {
                return Err(self.failure());
            }
        }
        // Faults stop; every node runs; time passes; everything must be delivered and marked.
        {
            let mut vk = self.valkey.st.lock().unwrap();
            vk.down_until = None;
            vk.hang_until = None;
            vk.oom_until = None;
            vk.oom_flap_until = None;
            vk.black_hole_until = None;
            vk.reply_lost = 0;
            vk.partial = 0;
            vk.rejecting.clear();
        }
        self.db.st.lock().unwrap().sql_down_until = None;
        for i in 0..self.nodes.len() {
            if !self.running(i) {
                self.nodes[i] = self.start_node(i);
            }
        }
        self.log("faults stop".into());
        tokio::time::sleep(QUIET_END).await;
        // A session whose replication link is still cut cannot catch up without a receive
        // deadline (`link_timeout` None): a real relay would notice at the kernel's TCP limits,
        // which are not modelled. Only then is liveness not checked (found by review: skipping
        // it for every seed with a cut link left 29% of seeds unchecked).
        let still_cut = {
            let st = self.db.st.lock().unwrap();
            self.nodes
                .iter()
                .any(|n| n.session.lock().unwrap().is_some_and(|s| st.is_cut(s)))
        };
        // The slot's position is taken before the nodes stop: a stop sends what the session
        // still holds and acknowledges it, which would hide rows a running session never sent
        // (found by review: a session loop that left an idle writer's open batch unsent passed
        // 300 schedules when the position was read after the stop).
        let confirmed = self.db.st.lock().unwrap().slot_confirmed();
        for i in 0..self.nodes.len() {
            self.stop_node(i).await;
        }
        {
            let st = self.db.st.lock().unwrap();
            let can_catch_up = self.knobs.link_timeout.is_some() || !still_cut;
            self.checker.at_end(&st, confirmed.filter(|_| can_catch_up));
        }
        if !self.checker.violations().is_empty() {
            return Err(self.failure());
        }
        let st = self.db.st.lock().unwrap();
        let vk = self.valkey.st.lock().unwrap();
        Ok(Outcome {
            rows: st.rows.len(),
            tasks: vk.created.len(),
            faults: self.faults,
            sim_secs: Instant::now()
                .duration_since(self.checker.start())
                .as_secs(),
            peak_write_bytes: vk.peak_bytes,
        })
    }

    fn failure(&mut self) -> Failure {
        for i in 0..self.nodes.len() {
            self.crash_node(i);
        }
        Failure {
            seed: self.seed,
            violations: self.checker.violations(),
            trace: std::mem::take(&mut self.trace),
        }
    }
}
