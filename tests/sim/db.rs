//! A simulated PostgreSQL: the WAL of committed transactions, the outbox table (with
//! `published_at`, attempts, dead letters, row locks and the moment a commit becomes visible to
//! SQL), one logical slot and the walsender sessions reading it. It implements the relay's I/O
//! traits: `SlotPort` and `ReplicationSource` for the stream, `OutboxTable` and `OutboxTx` for the
//! marker and the poller. Every acknowledgement and every mark is checked as it happens
//! (`Checker`).

use super::check::Checker;
use super::wire;
use outbox_relay::replication::source::{ReplicationSource, SlotHolder, SlotPort, SlotState};
use outbox_relay::replication::stream::StreamError;
use outbox_relay::store::{Claimed, ClaimedRow, OutboxTable, OutboxTx, StoreError};
use pgwire_replication::{Lsn, PgWireError, ReplicationEvent};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Every simulated row's payload and metadata, as the claim reads them.
const SIM_PAYLOAD: &str = "{\"n\":1}";
const SIM_METADATA: &str = "{}";

/// The outbox's relation id in the simulated catalog.
const RELATION: u32 = 16390;
/// A walsender whose client sent nothing for this long is ended by the server.
const WAL_SENDER_TIMEOUT: Duration = Duration::from_secs(60);
/// How often an idle walsender sends a keepalive.
const KEEPALIVE_EVERY: Duration = Duration::from_secs(10);
/// The relay's status interval (pgwire-replication's, as configured by the relay).
const STATUS_EVERY: Duration = Duration::from_secs(1);

/// One outbox row.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: i64,
    pub event_id: String,
    pub event_name: String,
    pub queue: String,
    /// Whether it can become a task (a bad row cannot).
    pub good: bool,
    pub created: Instant,
    /// Its transaction's commit end LSN.
    pub end_lsn: Lsn,
    /// When a new snapshot sees it (a moment after the commit reached the WAL).
    pub visible_at: Instant,
    pub published: bool,
    pub deleted: bool,
    pub attempts: i32,
    pub next_attempt: Option<Instant>,
    pub dead: bool,
    /// The poll transaction holding its lock.
    pub locked: Option<u64>,
}

impl Row {
    pub fn settled(&self) -> bool {
        self.published || self.deleted
    }
}

/// A committed transaction in the WAL.
#[derive(Debug, Clone)]
pub struct Txn {
    pub end_lsn: Lsn,
    pub commit_micros: i64,
    /// Outbox rows, in insert order (empty: a transaction on another table).
    pub rows: Vec<i64>,
}

#[derive(Debug)]
struct Slot {
    confirmed: Lsn,
    invalidated: bool,
    holder: Option<u64>,
}

#[derive(Debug)]
struct Walsender {
    pid: i32,
    /// Ended (terminated, or its client went away).
    ended: bool,
    /// The client's link is cut: nothing arrives from it, nothing reaches it.
    cut: bool,
    last_reply: Instant,
    pending_ack: Option<Lsn>,
}

impl State {
    /// Whether the link of walsender `session` is cut.
    pub fn is_cut(&self, session: u64) -> bool {
        self.walsenders.get(&session).is_some_and(|w| w.cut)
    }

    /// The slot's confirmed position, if the slot exists and is valid.
    pub fn slot_confirmed(&self) -> Option<Lsn> {
        self.slot
            .as_ref()
            .filter(|s| !s.invalidated)
            .map(|s| s.confirmed)
    }
}

#[derive(Debug)]
pub struct State {
    pub rows: BTreeMap<i64, Row>,
    pub wal: Vec<Txn>,
    /// The WAL's end.
    pub lsn: u64,
    slot: Option<Slot>,
    walsenders: BTreeMap<u64, Walsender>,
    next_walsender: u64,
    next_tx: u64,
    /// SQL statements fail until then.
    pub sql_down_until: Option<Instant>,
    /// Whether the relays' role may see `reply_time` (superuser or pg_read_all_stats).
    pub can_see_replies: bool,
    /// Rows are deleted instead of marked published.
    pub delete_delivered: bool,
    /// How often an idle walsender sends a keepalive (wal_sender_timeout / 2 on a real
    /// server).
    pub keepalive_every: Duration,
}

/// Clones share one server.
#[derive(Clone)]
pub struct SimDb {
    pub st: Arc<Mutex<State>>,
    /// Bumped on every commit and every change a walsender must notice.
    changed: Arc<watch::Sender<u64>>,
    pub checker: Checker,
}

impl SimDb {
    pub fn new(checker: Checker) -> Self {
        Self {
            st: Arc::new(Mutex::new(State {
                rows: BTreeMap::new(),
                wal: Vec::new(),
                lsn: 0x1000,
                slot: Some(Slot {
                    confirmed: Lsn(0x1000),
                    invalidated: false,
                    holder: None,
                }),
                walsenders: BTreeMap::new(),
                next_walsender: 1,
                next_tx: 1,
                sql_down_until: None,
                can_see_replies: true,
                delete_delivered: false,
                keepalive_every: KEEPALIVE_EVERY,
            })),
            changed: Arc::new(watch::channel(0).0),
            checker,
        }
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Commits a transaction of `rows` (event_id, event_name, queue, good); returns its end LSN.
    pub fn commit(&self, rows: &[(String, String, String, bool)], visible_after: Duration) -> Lsn {
        let now = Instant::now();
        let mut st = self.st.lock().unwrap();
        let mut ids = Vec::with_capacity(rows.len());
        st.lsn += 40 + 120 * rows.len() as u64;
        let end_lsn = Lsn(st.lsn);
        for (event_id, event_name, queue, good) in rows {
            let id = st.rows.len() as i64 + 1;
            st.rows.insert(
                id,
                Row {
                    id,
                    event_id: event_id.clone(),
                    event_name: event_name.clone(),
                    queue: queue.clone(),
                    good: *good,
                    created: now,
                    end_lsn,
                    visible_at: now + visible_after,
                    published: false,
                    deleted: false,
                    attempts: 0,
                    next_attempt: None,
                    dead: false,
                    locked: None,
                },
            );
            ids.push(id);
        }
        let commit_micros = self.checker.sim_micros();
        st.wal.push(Txn {
            end_lsn,
            commit_micros,
            rows: ids,
        });
        drop(st);
        self.bump();
        end_lsn
    }

    /// WAL written by other tables, or a rolled-back transaction: the end moves, nothing is
    /// decoded.
    pub fn other_wal(&self, bytes: u64) {
        self.st.lock().unwrap().lsn += bytes;
        self.bump();
    }

    /// The slot is dropped (`invalidate`: wal_status = lost instead), ending its walsender.
    pub fn lose_slot(&self, invalidate: bool) {
        let mut st = self.st.lock().unwrap();
        if let Some(holder) = st.slot.as_ref().and_then(|s| s.holder) {
            if let Some(w) = st.walsenders.get_mut(&holder) {
                w.ended = true;
            }
        }
        if invalidate {
            if let Some(s) = st.slot.as_mut() {
                s.invalidated = true;
                s.holder = None;
            }
        } else {
            st.slot = None;
        }
        drop(st);
        self.bump();
    }

    /// Cuts (or restores) the link of the walsender `session` holds: a zombie after a cut.
    pub fn cut(&self, session: u64, cut: bool) {
        if let Some(w) = self.st.lock().unwrap().walsenders.get_mut(&session) {
            w.cut = cut;
        }
        self.bump();
    }

    fn sql(&self) -> Result<(), String> {
        let st = self.st.lock().unwrap();
        if st.sql_down_until.is_some_and(|t| t > Instant::now()) {
            return Err("connection refused".into());
        }
        Ok(())
    }

    /// Ends walsenders whose client has been silent past the server's timeout.
    fn reap(st: &mut State) {
        let now = Instant::now();
        let mut ended = Vec::new();
        for (id, w) in st.walsenders.iter_mut() {
            if !w.ended && w.cut && now.duration_since(w.last_reply) >= WAL_SENDER_TIMEOUT {
                w.ended = true;
                ended.push(*id);
            }
        }
        if let Some(s) = st.slot.as_mut() {
            if s.holder.is_some_and(|h| ended.contains(&h)) {
                s.holder = None;
            }
        }
    }

    /// Applies a status update of walsender `id`: the slot's confirmed position moves.
    fn status_update(&self, id: u64) {
        let mut st = self.st.lock().unwrap();
        let now = Instant::now();
        let Some(w) = st.walsenders.get_mut(&id) else {
            return;
        };
        if w.ended || w.cut {
            return;
        }
        w.last_reply = now;
        let Some(lsn) = w.pending_ack.take() else {
            return;
        };
        let holds = st.slot.as_ref().is_some_and(|s| s.holder == Some(id));
        if !holds {
            return;
        }
        let slot = st.slot.as_mut().expect("held");
        if lsn > slot.confirmed {
            slot.confirmed = lsn;
            self.checker.on_ack(&st, lsn);
        }
    }
}

fn io(msg: &str) -> PgWireError {
    PgWireError::Io(Arc::new(std::io::Error::other(msg.to_owned())))
}

/// The relay's view of the slot, for one node.
pub struct SimPort {
    pub db: SimDb,
    /// The walsender this node's last session used (so the scenario can cut it).
    pub last_session: Arc<Mutex<Option<u64>>>,
}

impl SlotPort for SimPort {
    type Source = SimSource;

    fn publication(&self) -> &str {
        "outbox_relay"
    }

    async fn state(&self) -> Result<SlotState, StreamError> {
        self.db
            .sql()
            .map_err(|e| StreamError::Replication(io(&e)))?;
        let st = self.db.st.lock().unwrap();
        Ok(match &st.slot {
            None => SlotState::Missing,
            Some(s) if s.invalidated => SlotState::Invalidated,
            Some(s) => SlotState::Ready(s.confirmed),
        })
    }

    async fn recreate(&self) -> Result<Lsn, StreamError> {
        self.db
            .sql()
            .map_err(|e| StreamError::Replication(io(&e)))?;
        let mut st = self.db.st.lock().unwrap();
        let lsn = Lsn(st.lsn);
        st.slot = Some(Slot {
            confirmed: lsn,
            invalidated: false,
            holder: None,
        });
        self.db.checker.slot_recreated(lsn, &st);
        Ok(lsn)
    }

    async fn open(
        &self,
        start: Lsn,
        shutdown: &CancellationToken,
    ) -> Result<Option<SimSource>, StreamError> {
        if shutdown.is_cancelled() {
            return Ok(None);
        }
        self.db
            .sql()
            .map_err(|e| StreamError::Replication(io(&e)))?;
        let mut st = self.db.st.lock().unwrap();
        SimDb::reap(&mut st);
        let Some(slot) = st.slot.as_ref() else {
            return Err(StreamError::Replication(PgWireError::Server(
                "replication slot does not exist (SQLSTATE 42704)".into(),
            )));
        };
        if slot.invalidated {
            return Err(StreamError::Replication(PgWireError::Server(
                "cannot read from logical replication slot: it was invalidated (SQLSTATE 55000)"
                    .into(),
            )));
        }
        if let Some(h) = slot.holder {
            if st.walsenders.get(&h).is_some_and(|w| !w.ended) {
                return Err(StreamError::Replication(PgWireError::Server(
                    "replication slot is active for PID (SQLSTATE 55006)".into(),
                )));
            }
        }
        let from = start.max(slot.confirmed);
        let id = st.next_walsender;
        st.next_walsender += 1;
        st.walsenders.insert(
            id,
            Walsender {
                pid: 1000 + id as i32,
                ended: false,
                cut: false,
                last_reply: Instant::now(),
                pending_ack: None,
            },
        );
        st.slot.as_mut().expect("checked").holder = Some(id);
        let cursor = st.wal.partition_point(|t| t.end_lsn <= from);
        let keepalive_every = st.keepalive_every;
        drop(st);
        *self.last_session.lock().unwrap() = Some(id);
        let db = self.db.clone();
        let ticker = tokio::spawn(async move {
            let mut tick = tokio::time::interval(STATUS_EVERY);
            loop {
                tick.tick().await;
                db.status_update(id);
            }
        });
        Ok(Some(SimSource {
            db: self.db.clone(),
            id,
            cursor,
            queue: VecDeque::new(),
            relation_sent: false,
            changed: self.db.changed.subscribe(),
            keepalive_at: Instant::now() + keepalive_every,
            ticker,
        }))
    }

    async fn holder(&self) -> Result<Option<SlotHolder>, StreamError> {
        self.db
            .sql()
            .map_err(|e| StreamError::Replication(io(&e)))?;
        let mut st = self.db.st.lock().unwrap();
        SimDb::reap(&mut st);
        let Some(h) = st.slot.as_ref().and_then(|s| s.holder) else {
            return Ok(None);
        };
        let visible = st.can_see_replies;
        let start = self.db.checker.start();
        Ok(st
            .walsenders
            .get(&h)
            .filter(|w| !w.ended)
            .map(|w| SlotHolder {
                pid: w.pid,
                reply_time: visible.then(|| format!("{:?}", w.last_reply.duration_since(start))),
                can_see_replies: visible,
                // The simulated walsender never decodes for long without answering.
                busy: false,
                sent_lsn: None,
                // Every simulated walsender is a relay's.
                relay: true,
            }))
    }

    async fn terminate(&self, pid: i32) -> Result<(), StreamError> {
        self.db
            .sql()
            .map_err(|e| StreamError::Replication(io(&e)))?;
        let mut st = self.db.st.lock().unwrap();
        let mut ended = None;
        for (id, w) in st.walsenders.iter_mut() {
            if w.pid == pid {
                w.ended = true;
                ended = Some(*id);
            }
        }
        if let Some(s) = st.slot.as_mut() {
            if s.holder.is_some() && s.holder == ended {
                s.holder = None;
            }
        }
        drop(st);
        self.db.bump();
        Ok(())
    }
}

/// One walsender connection, as the relay's session reads it.
pub struct SimSource {
    db: SimDb,
    id: u64,
    /// The next transaction of the WAL to send.
    cursor: usize,
    /// Events of the transaction being sent.
    queue: VecDeque<ReplicationEvent>,
    relation_sent: bool,
    changed: watch::Receiver<u64>,
    keepalive_at: Instant,
    ticker: tokio::task::JoinHandle<()>,
}

impl Drop for SimSource {
    fn drop(&mut self) {
        self.ticker.abort();
        let mut st = self.db.st.lock().unwrap();
        // A closed connection ends its walsender, unless the link is cut: then the server does
        // not know yet (a zombie until terminated or timed out).
        let cut = st.walsenders.get(&self.id).is_some_and(|w| w.cut);
        if !cut {
            if let Some(w) = st.walsenders.get_mut(&self.id) {
                w.ended = true;
            }
            if let Some(s) = st.slot.as_mut() {
                if s.holder == Some(self.id) {
                    s.holder = None;
                }
            }
        }
    }
}

impl SimSource {
    fn fill(&mut self, st: &State) -> bool {
        let Some(txn) = st.wal.get(self.cursor) else {
            return false;
        };
        self.cursor += 1;
        // The walsender sends the transaction now (this read), decoding it half a millisecond
        // after its commit at the earliest: a backlog read after an outage is behind, as on a
        // real server, so the session's linger path runs in the simulation too.
        let sent_micros = self.db.checker.sim_micros().max(txn.commit_micros + 500);
        let server_time = sent_micros - PG_EPOCH_UNIX_MICROS;
        let commit_time = txn.commit_micros - PG_EPOCH_UNIX_MICROS;
        self.queue.push_back(ReplicationEvent::Begin {
            final_lsn: txn.end_lsn,
            xid: self.cursor as u32,
            commit_time_micros: commit_time,
        });
        let data = |d: Vec<u8>| ReplicationEvent::XLogData {
            wal_start: txn.end_lsn,
            wal_end: txn.end_lsn,
            server_time_micros: server_time,
            data: d.into(),
        };
        if !txn.rows.is_empty() && !self.relation_sent {
            self.relation_sent = true;
            self.queue
                .push_back(data(wire::relation(RELATION, "public", "outbox_events")));
        }
        for id in &txn.rows {
            let r = &st.rows[id];
            let id_text = r.id.to_string();
            let name = if r.good { r.event_name.as_str() } else { "" };
            self.queue.push_back(data(wire::insert(
                RELATION,
                &[
                    Some(&id_text),
                    Some(&r.event_id),
                    Some(name),
                    Some("{\"n\":1}"),
                    Some("{}"),
                    Some("2026-11-29 10:15:30.123456+00"),
                    None,
                ],
            )));
        }
        self.queue.push_back(ReplicationEvent::Commit {
            lsn: Lsn(txn.end_lsn.0 - 1),
            end_lsn: txn.end_lsn,
            commit_time_micros: commit_time,
        });
        true
    }
}

/// Postgres timestamps count microseconds from 2000-01-01.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

impl ReplicationSource for SimSource {
    async fn recv(&mut self) -> Result<Option<ReplicationEvent>, PgWireError> {
        let db = self.db.clone();
        loop {
            {
                let st = db.st.lock().unwrap();
                let w = &st.walsenders[&self.id];
                if w.ended {
                    return Err(io("connection closed by the server"));
                }
                if !w.cut {
                    if let Some(ev) = self.queue.pop_front() {
                        return Ok(Some(ev));
                    }
                    if self.fill(&st) {
                        continue;
                    }
                    if Instant::now() >= self.keepalive_at {
                        self.keepalive_at = Instant::now() + st.keepalive_every;
                        return Ok(Some(ReplicationEvent::KeepAlive {
                            wal_end: Lsn(st.lsn),
                            reply_requested: false,
                            server_time_micros: 0,
                        }));
                    }
                }
            }
            tokio::select! {
                biased;
                r = self.changed.changed() => {
                    if r.is_err() {
                        return Ok(None);
                    }
                }
                // A cut link sends no keepalives: without this, a `keepalive_at` already past
                // makes this loop spin on the paused clock and the whole world stops.
                _ = tokio::time::sleep_until(self.keepalive_at.max(Instant::now() + Duration::from_millis(1))) => {}
            }
        }
    }

    fn update_applied_lsn(&self, lsn: Lsn) {
        let mut st = self.db.st.lock().unwrap();
        // The relay acknowledges here: everything up to `lsn` must already be in Valkey,
        // whether or not this status update ever reaches the server.
        self.db.checker.on_ack(&st, lsn);
        if let Some(w) = st.walsenders.get_mut(&self.id) {
            w.pending_ack = Some(w.pending_ack.map_or(lsn, |p| p.max(lsn)));
        }
    }

    fn feedback_pending(&self) -> bool {
        let st = self.db.st.lock().unwrap();
        st.walsenders
            .get(&self.id)
            .is_some_and(|w| w.pending_ack.is_some() && !w.ended && !w.cut)
    }

    async fn shutdown(&mut self) {
        self.db.status_update(self.id);
    }

    /// What the server says over SQL: the simulated walsender sends each transaction whole, so
    /// it is never busy inside one record; it is waiting (a cut link's included). Unknown while
    /// SQL is down, which the session takes for a dead link.
    async fn walsender_busy(&self) -> Option<bool> {
        self.db.sql().ok().map(|()| false)
    }
}

/// The outbox table through the simulated server.
#[derive(Clone)]
pub struct SimOutbox {
    pub db: SimDb,
}

/// One poll transaction: locks its rows; its updates apply at commit.
pub struct SimTx {
    db: SimDb,
    id: u64,
    failed: Vec<(i64, i32, Duration, i32)>,
    published: Vec<i64>,
}

impl Drop for SimTx {
    fn drop(&mut self) {
        let mut st = self.db.st.lock().unwrap();
        for r in st.rows.values_mut() {
            if r.locked == Some(self.id) {
                r.locked = None;
            }
        }
    }
}

fn store_err(e: String) -> StoreError {
    let _ = e;
    StoreError::Simulated("connection refused")
}

impl OutboxTable for SimOutbox {
    type Tx = SimTx;

    async fn mark_published(&self, rows: &[(i64, uuid::Uuid)]) -> Result<Vec<i64>, StoreError> {
        self.db.sql().map_err(store_err)?;
        // Postgres's UPDATE waits for a row lock a poll round holds, then re-checks the row.
        loop {
            let held = {
                let st = self.db.st.lock().unwrap();
                rows.iter()
                    .any(|(id, _)| st.rows.get(id).is_some_and(|r| r.locked.is_some()))
            };
            if !held {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let now = Instant::now();
        let mut st = self.db.st.lock().unwrap();
        let delete = st.delete_delivered;
        let mut marked = Vec::new();
        for (id, event_id) in rows {
            let Some(r) = st.rows.get(id) else { continue };
            if r.event_id != event_id.to_string() || r.settled() || r.visible_at > now {
                continue;
            }
            self.db.checker.on_mark(r, "marker");
            let r = st.rows.get_mut(id).expect("present");
            if delete {
                r.deleted = true;
            } else {
                r.published = true;
            }
            marked.push(*id);
        }
        Ok(marked)
    }

    async fn begin(&self) -> Result<SimTx, StoreError> {
        self.db.sql().map_err(store_err)?;
        let mut st = self.db.st.lock().unwrap();
        let id = st.next_tx;
        st.next_tx += 1;
        Ok(SimTx {
            db: self.db.clone(),
            id,
            failed: Vec::new(),
            published: Vec::new(),
        })
    }
}

impl OutboxTx for SimTx {
    async fn claim(
        &mut self,
        limit: usize,
        bytes: usize,
        older_than: Option<Duration>,
    ) -> Result<Claimed, StoreError> {
        self.db.sql().map_err(store_err)?;
        let now = Instant::now();
        let mut st = self.db.st.lock().unwrap();
        let mut out = Vec::new();
        // As the real claim: up to `limit` rows locked, returned until `bytes` of payload and
        // metadata (the first whatever its size); the rest stay locked until the round ends.
        let (mut locked, mut read) = (0, 0);
        for r in st.rows.values_mut() {
            if locked >= limit {
                break;
            }
            let eligible = !r.settled()
                && !r.dead
                && r.locked.is_none()
                && r.visible_at <= now
                && r.next_attempt.is_none_or(|t| t <= now)
                && older_than.is_none_or(|d| r.created + d <= now);
            if !eligible {
                continue;
            }
            r.locked = Some(self.id);
            locked += 1;
            if read >= bytes.max(1) {
                continue;
            }
            read += SIM_PAYLOAD.len() + SIM_METADATA.len();
            out.push(ClaimedRow {
                id: r.id,
                event_id: Some(r.event_id.clone()),
                event_name: Some(if r.good {
                    r.event_name.clone()
                } else {
                    String::new()
                }),
                payload: Some(SIM_PAYLOAD.into()),
                metadata: Some(SIM_METADATA.into()),
                created_at: Some("2026-11-29 10:15:30.123456+00".into()),
                attempts: r.attempts,
            });
        }
        Ok(Claimed {
            left: locked > out.len(),
            rows: out,
        })
    }

    async fn mark_failed(
        &mut self,
        id: i64,
        _error: &str,
        backoff: Duration,
        max_attempts: i32,
    ) -> Result<bool, StoreError> {
        self.db.sql().map_err(store_err)?;
        let st = self.db.st.lock().unwrap();
        let attempts = st.rows.get(&id).map_or(0, |r| r.attempts);
        self.failed.push((id, attempts, backoff, max_attempts));
        Ok(attempts + 1 >= max_attempts)
    }

    async fn mark_published(&mut self, ids: &[i64]) -> Result<(), StoreError> {
        self.db.sql().map_err(store_err)?;
        self.published.extend_from_slice(ids);
        Ok(())
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        self.db.sql().map_err(store_err)?;
        let now = Instant::now();
        let mut st = self.db.st.lock().unwrap();
        let delete = st.delete_delivered;
        for (id, attempts, backoff, max) in std::mem::take(&mut self.failed) {
            if let Some(r) = st.rows.get_mut(&id) {
                r.attempts = attempts + 1;
                let delay = backoff
                    .mul_f64(2f64.powi(attempts))
                    .min(Duration::from_secs(3600));
                r.next_attempt = Some(now + delay);
                r.dead = r.attempts >= max;
            }
        }
        for id in std::mem::take(&mut self.published) {
            let Some(r) = st.rows.get(&id) else { continue };
            if r.settled() {
                continue;
            }
            self.db.checker.on_mark(r, "poller");
            let r = st.rows.get_mut(&id).expect("present");
            if delete {
                r.deleted = true;
            } else {
                r.published = true;
            }
        }
        Ok(())
    }
}
