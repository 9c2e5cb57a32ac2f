//! The asynq writer: tasks into Valkey/Redis exactly as asynq's Go client enqueues them.
//!
//! One Lua script call enqueues many tasks of one queue (all keys share the `{queue}` hash tag,
//! so this also holds on a cluster): for each task, if its hash exists the result is 0 (already
//! delivered, asynq's ErrTaskIDConflict), otherwise HSET msg/state/pending_since and LPUSH the id
//! onto the pending list, result 1. Many script calls ride in one pipeline: one round trip per
//! batch, never one per row.
//!
//! On a cluster a pipeline must stay within one slot, so a batch becomes one pipeline per queue
//! (sent together, each to the shard of its queue's slot), and `SADD asynq:queues`, whose key
//! has a slot of its own, is sent beside them once per queue (as asynq's Go client does).

use super::order_chain::{Link, OrderChain};
use super::queue_turns::{QueueTurns, Ticket};
use super::{Batch, Rejected, Sink, SinkError, WriteOutcome};
use crate::task::Task;
use crate::valkey::{ValkeyConnection, ValkeyTarget};
use redis::{ServerErrorKind, Value};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// The batched form of asynq's enqueue script. KEYS = task hashes..., the queue's order key,
/// pending list (last); ARGV = now in ns, the stream's field in the order key, this call's order
/// token, its predecessor's token, then (msg, id) per task. Returns one 0/1 per task. The new ids go onto the pending list in one
/// LPUSH, which leaves them in the order one LPUSH per task would (each value is pushed onto the
/// head in turn); the script runs atomically, so no reader sees the hashes without their ids.
///
/// All or nothing: the order key is written first and the pending list's type is checked before
/// any task is written, so the LPUSH cannot fail after the HSETs (a task hash without its pending
/// entry would count as delivered on a replay, and never run). Under `maxmemory` the first write
/// (the order key's HSET) is refused (Valkey checks memory at a script's first write), so nothing
/// is written either.
///
/// The order fence (see [`OrderChain`]): a call with a token lands only if its stream's field of
/// the queue's order key holds its predecessor's token (or it has no predecessor: it starts a
/// chain), and leaves its own token there; otherwise it is refused with `FENCED`, which the
/// writer retries. A call refused for memory therefore cannot be overtaken by the calls
/// pipelined after it. Each stream (Postgres system, database, slot) has a field of its own, so
/// relays of other outboxes writing to the same queue do not break its chains. A call without a
/// token (the pollers, `replay`) neither checks nor moves the fence, and declares the pending
/// list in the order key's place.
pub const ENQUEUE_SCRIPT: &str = r#"
local n = #KEYS - 2
local order = KEYS[#KEYS - 1]
local pending = KEYS[#KEYS]
local now, stream, token, prev = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if token ~= "" then
  if prev ~= "" then
    local last = redis.call("HMGET", order, stream)[1]
    if last ~= prev then
      return redis.error_reply("FENCED the call before this one (" .. order .. " " .. stream .. ") has not landed")
    end
  end
  redis.call("HSET", order, stream, token)
end
local kind = redis.call("TYPE", pending)["ok"]
if kind ~= "list" and kind ~= "none" then
  return redis.error_reply("WRONGTYPE " .. pending .. " holds a " .. kind .. ", not asynq's pending list")
end
local out = {}
local ids = {}
for i = 1, n do
  if redis.call("EXISTS", KEYS[i]) == 1 then
    out[i] = 0
  else
    redis.call("HSET", KEYS[i], "msg", ARGV[2 * i + 3], "state", "pending", "pending_since", now)
    ids[#ids + 1] = ARGV[2 * i + 4]
    out[i] = 1
  end
end
if #ids > 0 then
  redis.call("LPUSH", pending, unpack(ids))
end
return out
"#;

/// Tasks per script call: bounds the time one script holds the server, and the values of the
/// script's one LPUSH (Lua's `unpack` takes a few thousand at most).
const TASKS_PER_SCRIPT: usize = 200;

/// `asynq:{<q>}:t:<id>`
pub fn task_key(queue: &str, id: &str) -> String {
    format!("asynq:{{{queue}}}:t:{id}")
}

/// `asynq:{<q>}:pending`
pub fn pending_key(queue: &str) -> String {
    format!("asynq:{{{queue}}}:pending")
}

/// `asynq:{<q>}:outbox_relay_order`: a hash with a field per stream (see
/// [`OrderChain::stream`]) holding the order token of that stream's last call that landed on
/// the queue. asynq does not read it.
pub fn order_key(queue: &str) -> String {
    format!("asynq:{{{queue}}}:outbox_relay_order")
}

/// The set of queue names asynqmon and the Inspector read.
pub const QUEUES_KEY: &str = "asynq:queues";

/// Writes tasks to Valkey/Redis (one server, a cluster or a Sentinel-managed primary) through
/// one multiplexed connection (per node in a cluster). The stream has a sink of its own; the
/// pollers and the health monitor share another (see `crate::relay::run`).
#[derive(Clone)]
pub struct ValkeySink {
    conn: ValkeyConnection,
    script: Arc<redis::Script>,
    /// Cluster only: queues this process has added to `asynq:queues`. That key lives in its own
    /// slot, so it is written apart from the tasks: once per queue, and again after any failed
    /// write (a failover may have lost it).
    registered: Arc<Mutex<HashSet<Arc<str>>>>,
    /// Cluster only: each queue's writes reach its shard one at a time, in the writer's order
    /// (see [`QueueTurns`]).
    turns: QueueTurns,
    /// A write met NOSCRIPT (a restarted server, a promoted replica): the next write loads the
    /// script before it sends.
    script_missing: Arc<AtomicBool>,
    /// The stream's sink only: each queue's calls are fenced in the order they were issued
    /// (see [`OrderChain`]). The pollers' sink has none: its calls carry no token.
    order: Option<OrderChain>,
    /// Replicas each write must reach before it counts (`OUTBOX_VALKEY_WAIT_REPLICAS`).
    wait: Option<ReplicaWait>,
}

/// Valkey's `WAIT replicas timeout` after each write: a write counts only once that many
/// replicas acknowledged it. Valkey replicates asynchronously, so a primary that fails right
/// after answering may take the write with it, while the relay has acknowledged the WAL past it
/// and marked its rows published (docs/design.md, "What a failover can lose"). With a wait, a
/// write fewer replicas acknowledged fails and is sent again (the TaskIDs dedupe), so a
/// promoted replica that acknowledged holds every task the relay counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaWait {
    pub replicas: u32,
    pub timeout: std::time::Duration,
}

/// The replicas a primary's `ROLE` answer lists (`master`, its offset, one entry per replica);
/// `None` for another answer.
pub fn replicas_in_role(role: &[Value]) -> Option<usize> {
    match role {
        [Value::BulkString(kind), _, Value::Array(replicas)] if kind == b"master" => {
            Some(replicas.len())
        }
        [Value::SimpleString(kind), _, Value::Array(replicas)] if kind == "master" => {
            Some(replicas.len())
        }
        _ => None,
    }
}

/// The key [`ReplicaWait`] writes before each WAIT (the time of the write, in ns): a write of
/// the connection's own that replicates after every task the pipeline found or wrote.
pub const WAIT_MARK_KEY: &str = "asynq:outbox_relay_wait";

impl ReplicaWait {
    /// Appends the mark's SET and the WAIT to `pipe`: their two replies come last.
    pub fn add_to(&self, pipe: &mut redis::Pipeline, now_ns: &str) {
        let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
        pipe.cmd("SET").arg(WAIT_MARK_KEY).arg(now_ns);
        pipe.cmd("WAIT").arg(self.replicas).arg(ms.max(1));
    }

    /// The failure of a write that `acked` replicas acknowledged, if fewer than wanted.
    pub fn check(&self, acked: i64) -> Result<(), redis::RedisError> {
        if acked >= i64::from(self.replicas) {
            return Ok(());
        }
        Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "too few replicas acknowledged the write (WAIT; OUTBOX_VALKEY_WAIT_REPLICAS)",
            format!("{acked} of {} within {:?}", self.replicas, self.timeout),
        )))
    }
}

impl std::fmt::Debug for ValkeySink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ValkeySink")
    }
}

/// The tasks of a batch grouped by queue, as indices into the batch: queues in order of first
/// appearance, each queue's tasks in batch order (the pending list is FIFO).
pub fn by_queue(tasks: &[Task]) -> Vec<(&str, Vec<usize>)> {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, t) in tasks.iter().enumerate() {
        match groups.iter_mut().find(|(q, _)| *q == &*t.queue) {
            Some((_, of_queue)) => of_queue.push(i),
            None => groups.push((&t.queue, vec![i])),
        }
    }
    groups
}

/// A reply refusing a command or a key to the user's ACL, before a script runs (`NOPERM`) or
/// inside it (Redis wraps that in `ERR`).
fn permission_refused(e: &redis::RedisError) -> bool {
    let detail = e.detail().unwrap_or_default().to_lowercase();
    e.code() == Some("NOPERM")
        || (e.code() == Some("ERR")
            && ["can't run", "can't access", "no permissions"]
                .iter()
                .any(|t| detail.contains(t)))
}

/// What a refused script call means for its tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The server or the link is in trouble (OOM, LOADING, BUSY, READONLY, TRYAGAIN,
    /// CLUSTERDOWN, MOVED, a lost connection...): hold the acknowledgement and write again.
    Retry,
    /// This queue cannot take these tasks until someone changes something (WRONGTYPE on its
    /// keys, CROSSSLOT from a queue name with braces, NOPERM from an ACL, a script error): the
    /// rows stay unpublished for the poller, which counts attempts and dead-letters them, and
    /// every other queue goes on.
    Reject,
}

/// Conditions that pass, which a generic `ERR` reply can carry: Redis 6 wraps an error raised
/// inside a script as `ERR Error running script ... -OOM command not allowed ...` (or `-MISCONF`
/// while its snapshots or AOF cannot be written), and a full server answers `ERR max number of
/// clients reached`.
const TRANSIENT_INSIDE_ERR: [&str; 10] = [
    "OOM",
    "MISCONF",
    "BUSY",
    "LOADING",
    "READONLY",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "NOREPLICAS",
    "max number of clients",
];

/// Classifies a server's error reply to one queue's script call. When in doubt it retries: a
/// retry holds the acknowledgement and loses nothing, while a wrong refusal sends the rows to
/// the poller, which counts attempts against them.
pub fn refusal(e: &redis::RedisError) -> Refusal {
    match e.code() {
        Some("ERR") => {
            let detail = e.detail().unwrap_or_default();
            if TRANSIENT_INSIDE_ERR.iter().any(|t| detail.contains(t)) {
                Refusal::Retry
            } else {
                Refusal::Reject
            }
        }
        Some("WRONGTYPE" | "CROSSSLOT" | "NOPERM" | "EXECABORT") => Refusal::Reject,
        _ => Refusal::Retry,
    }
}

/// The scripts of one queue in a pipeline: the batch indices of each call's tasks.
struct QueueCalls<'b> {
    queue: &'b str,
    chunks: Vec<&'b [usize]>,
}

/// Adds the replies of one queue's script calls to `out`. A reply that says "retry" fails the
/// whole write (returned as the error); a rejecting one lists that call's tasks as rejected.
fn settle(
    calls: &QueueCalls<'_>,
    replies: impl Iterator<Item = Value>,
    out: &mut WriteOutcome,
) -> Result<(), redis::RedisError> {
    for (chunk, reply) in calls.chunks.iter().zip(replies) {
        match reply.extract_error() {
            Ok(v) => {
                for r in redis::from_redis_value::<Vec<i64>>(v)? {
                    if r == 1 {
                        out.enqueued += 1;
                    } else {
                        out.duplicates += 1;
                    }
                }
            }
            Err(e) if e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
                return Err(e)
            }
            Err(e) if refusal(&e) == Refusal::Reject => {
                let reason = format!("queue {:?} refused the task: {e}", calls.queue);
                out.rejected.extend(chunk.iter().map(|&index| Rejected {
                    index,
                    reason: reason.clone(),
                }));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl ValkeySink {
    /// Connects (failing if Valkey is unreachable now) and loads the enqueue script. Its
    /// writes are not fenced: for the pollers, `replay` and `reconcile`.
    pub async fn connect(target: ValkeyTarget) -> Result<Self, SinkError> {
        Self::connect_with(target, None).await
    }

    /// As [`connect`](Self::connect), for the stream `stream` (its field in the queues' order
    /// keys): each queue's script calls land in the order they were issued, a refused one
    /// holding back the ones after it (see [`OrderChain`]).
    pub async fn connect_ordered(target: ValkeyTarget, stream: String) -> Result<Self, SinkError> {
        Self::connect_with(target, Some(OrderChain::new(stream))).await
    }

    async fn connect_with(
        target: ValkeyTarget,
        order: Option<OrderChain>,
    ) -> Result<Self, SinkError> {
        let conn = target.connect().await.map_err(SinkError::Valkey)?;
        let sink = Self {
            conn,
            script: Arc::new(redis::Script::new(ENQUEUE_SCRIPT)),
            registered: Arc::default(),
            turns: QueueTurns::default(),
            script_missing: Arc::default(),
            order,
            wait: None,
        };
        sink.load_script().await?;
        Ok(sink)
    }

    /// Each write then counts only once `wait` asks it reached enough replicas (see
    /// [`ReplicaWait`]); `None` trusts the primary's answer. One server or sentinels: a
    /// cluster's configuration refuses it.
    pub fn waiting_for_replicas(mut self, wait: Option<ReplicaWait>) -> Self {
        self.wait = wait;
        self
    }

    /// With a replica wait: writes the mark and waits for no replica, so that a user the ACL
    /// denies `SET` or `WAIT` (or the mark's key) is refused at start, not on every write.
    /// Returns the replicas connected now, as `ROLE` lists them (`WAIT 0` answers how many
    /// acknowledged its own write: 0 at once, whatever is connected; found by review), or
    /// `None` without a wait or when `ROLE` does not answer.
    pub async fn check_wait(&self) -> Result<Option<usize>, SinkError> {
        let Some(wait) = &self.wait else {
            return Ok(None);
        };
        let probe = ReplicaWait {
            replicas: 0,
            timeout: wait.timeout,
        };
        let mut pipe = redis::pipe();
        probe.add_to(&mut pipe, "0");
        let _: ((), i64) = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(SinkError::Valkey)?;
        let role: redis::RedisResult<Vec<Value>> =
            redis::cmd("ROLE").query_async(&mut self.conn.clone()).await;
        Ok(role.ok().and_then(|r| replicas_in_role(&r)))
    }

    /// The connection, for checks and inspection.
    pub fn connection(&self) -> ValkeyConnection {
        self.conn.clone()
    }

    /// Loads the script on the server, or on every primary of a cluster.
    async fn load_script(&self) -> Result<(), SinkError> {
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(ENQUEUE_SCRIPT);
        for (_, reply) in conn
            .on_each_primary::<String>(&cmd)
            .await
            .map_err(SinkError::Valkey)?
        {
            reply.map_err(SinkError::Valkey)?;
        }
        Ok(())
    }

    /// Appends the script calls for one queue's tasks, one per chunk of `links` (the calls'
    /// places in the queue's order chain); returns the calls' task indices.
    fn add_scripts<'b>(
        &self,
        pipe: &mut redis::Pipeline,
        batch: &Batch,
        q: &'b str,
        tasks: &'b [usize],
        links: &[Link],
        now_ns: &str,
    ) -> QueueCalls<'b> {
        let mut calls = QueueCalls {
            queue: q,
            chunks: Vec::new(),
        };
        for (chunk, link) in tasks.chunks(TASKS_PER_SCRIPT).zip(links) {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(self.script.get_hash()).arg(chunk.len() + 2);
            for &i in chunk {
                cmd.arg(task_key(q, &batch.tasks[i].id));
            }
            // An unfenced call declares the pending list in the order key's place: it never
            // reads it, and an ACL whose key patterns leave the order key out (the pollers'
            // only need) must not refuse it (found by review).
            match &self.order {
                Some(_) => cmd.arg(order_key(q)),
                None => cmd.arg(pending_key(q)),
            };
            cmd.arg(pending_key(q))
                .arg(now_ns)
                .arg(self.order.as_ref().map_or("", |o| o.stream()))
                .arg(&link.token)
                .arg(&link.prev);
            for &i in chunk {
                let t = &batch.tasks[i];
                cmd.arg(&t.msg[..]).arg(&t.id);
            }
            pipe.add_command(cmd);
            calls.chunks.push(chunk);
        }
        calls
    }

    /// Whether the ACL lets the stream's script calls read the order fence of `queue`: runs the
    /// enqueue script as a call of a chain whose predecessor never landed, which answers
    /// `FENCED` and writes nothing. `Err` with the server's reply when it is refused for
    /// permissions (`HMGET` not allowed, or key patterns that leave the order key out: seen on
    /// Redis 7 as `NOPERM ...` before the script runs and as `ERR The user executing the script
    /// can't run this command ...` inside it), while the same call without a token (which
    /// touches neither `HMGET` nor the order key, and writes nothing either) is not: an ACL that
    /// keeps the relay off the whole queue is a per-queue refusal the writes handle (its rows
    /// go to the poller; `tests/delivery.rs` `sigterm_while_one_queue_is_refused_loses_nothing`).
    /// Any other answer is left to the writes.
    pub async fn check_fence(&self, queue: &str) -> Result<(), String> {
        let Some(order) = &self.order else {
            return Ok(());
        };
        let nonce = format!("{:016x}", rand::random::<u64>());
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.get_hash())
            .arg(2)
            .arg(order_key(queue))
            .arg(pending_key(queue))
            .arg(0)
            .arg(order.stream())
            .arg(format!("check-{nonce}"))
            .arg(format!("never-landed-{nonce}"));
        match cmd.query_async::<Value>(&mut self.conn.clone()).await {
            Err(e) if e.code() == Some("FENCED") => Ok(()),
            Err(e) if permission_refused(&e) => {
                let mut unfenced = redis::cmd("EVALSHA");
                unfenced
                    .arg(self.script.get_hash())
                    .arg(2)
                    .arg(pending_key(queue))
                    .arg(pending_key(queue))
                    .arg(0)
                    .arg("")
                    .arg("")
                    .arg("");
                match unfenced.query_async::<Value>(&mut self.conn.clone()).await {
                    Ok(_) => Err(e.to_string()),
                    Err(queue_refused) => {
                        tracing::debug!(error = %queue_refused, "the queue itself is refused");
                        Ok(())
                    }
                }
            }
            other => {
                tracing::debug!(answer = ?other, "the order fence check did not answer FENCED");
                Ok(())
            }
        }
    }

    /// Each queue's calls' places in its order chain, taken when the write is issued (so in
    /// the writer's order), in the order of [`by_queue`].
    fn links(&self, tasks: &[Task]) -> Vec<Vec<Link>> {
        by_queue(tasks)
            .iter()
            .map(|(q, of_queue)| {
                let calls = of_queue.len().div_ceil(TASKS_PER_SCRIPT);
                match &self.order {
                    Some(order) => order.issue(q, calls),
                    None => vec![Link::none(); calls],
                }
            })
            .collect()
    }

    async fn write_once(
        &self,
        batch: &Batch,
        turns: &[Ticket],
        links: &[Vec<Link>],
    ) -> Result<WriteOutcome, redis::RedisError> {
        let now_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
            .to_string();
        let groups = by_queue(&batch.tasks);
        let mut out = WriteOutcome::default();
        if !self.conn.is_cluster() {
            // One pipeline, one round trip: SADD and the script calls of every queue. Errors
            // come back per command, so one queue's refusal does not hide the others' results.
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            let mut calls = Vec::with_capacity(groups.len());
            for ((q, tasks), links) in groups.iter().zip(links) {
                pipe.cmd("SADD").arg(QUEUES_KEY).arg(*q);
                calls.push(self.add_scripts(&mut pipe, batch, q, tasks, links, &now_ns));
            }
            // Last, on the same connection: a write that always replicates, then WAIT for it.
            // WAIT waits for the connection's own last write only: a pipeline whose tasks all
            // existed (a poller's re-send) writes nothing, and on a new connection WAIT then
            // answered at once, with a replica that lacked the tasks (found by review).
            if let Some(wait) = &self.wait {
                wait.add_to(&mut pipe, &now_ns);
            }
            let replies: Vec<Value> = pipe.query_async(&mut self.conn.clone()).await?;
            let mut replies = replies.into_iter();
            for c in &calls {
                if let Some(sadd) = replies.next() {
                    sadd.extract_error()?;
                }
                settle(c, replies.by_ref().take(c.chunks.len()), &mut out)?;
            }
            if let Some(wait) = &self.wait {
                let missing =
                    || redis::RedisError::from((redis::ErrorKind::Parse, "no reply to WAIT"));
                replies.next().ok_or_else(missing)?.extract_error()?;
                let acked = replies.next().ok_or_else(missing)?;
                wait.check(redis::from_redis_value::<i64>(acked.extract_error()?)?)?;
            }
            out.rejected.sort_by_key(|r| r.index);
            return Ok(out);
        }
        // A cluster: one pipeline per queue (all its keys share the `{queue}` slot), sent
        // together, and the SADD of queues not yet registered beside them.
        let new: Vec<&str> = {
            let registered = self.registered.lock().unwrap();
            groups
                .iter()
                .map(|(q, _)| *q)
                .filter(|q| !registered.contains(*q))
                .collect()
        };
        let register = async {
            if new.is_empty() {
                return Ok(());
            }
            redis::cmd("SADD")
                .arg(QUEUES_KEY)
                .arg(&new)
                .query_async::<()>(&mut self.conn.clone())
                .await
        };
        let mut calls = Vec::with_capacity(groups.len());
        let mut pipes = Vec::with_capacity(groups.len());
        for ((q, tasks), links) in groups.iter().zip(links) {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            calls.push(self.add_scripts(&mut pipe, batch, q, tasks, links, &now_ns));
            pipes.push(pipe);
        }
        let writes = futures::future::join_all(pipes.iter().zip(&groups).map(|(pipe, (q, _))| {
            let mut conn = self.conn.clone();
            let ticket = turns.iter().find(|t| t.queue() == *q);
            async move {
                if let Some(ticket) = ticket {
                    ticket.turn().await;
                }
                let replies = pipe.query_async::<Vec<Value>>(&mut conn).await;
                // Landed, every reply final (a task written, or refused for good): the queue's
                // next write may go. A reply to retry (NOSCRIPT, OOM...) or a failed pipeline
                // keeps the turn until this write ends, so its re-send still goes first.
                let landed = replies.as_ref().is_ok_and(|r| {
                    r.iter().all(|v| match v {
                        Value::ServerError(_) => v
                            .clone()
                            .extract_error()
                            .err()
                            .is_some_and(|e| refusal(&e) == Refusal::Reject),
                        _ => true,
                    })
                });
                if let (true, Some(ticket)) = (landed, ticket) {
                    ticket.done();
                }
                replies
            }
        }));
        let (registered, written) = futures::future::join(register, writes).await;
        // Every queue's outcome is needed: a NOSCRIPT anywhere must be seen as such.
        let mut first_error = None;
        for (c, w) in calls.iter().zip(written) {
            let settled = w.and_then(|replies| settle(c, replies.into_iter(), &mut out));
            if let Err(e) = settled {
                if first_error.is_none()
                    || e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript)
                {
                    first_error = Some(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        registered?;
        self.registered
            .lock()
            .unwrap()
            .extend(new.into_iter().map(Arc::from));
        // Settled queue by queue; listed in batch order for logs (readers do not rely on it).
        out.rejected.sort_by_key(|r| r.index);
        Ok(out)
    }
}

impl Sink for ValkeySink {
    fn write(
        &self,
        batch: Arc<Batch>,
    ) -> impl std::future::Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static {
        let this = self.clone();
        // Taken now, in the order the writer issues its writes, and held until this write ends
        // or is dropped (a queue's turn is given back early once its pipeline landed).
        let turns: Vec<Ticket> = if self.conn.is_cluster() {
            self.turns
                .tickets(by_queue(&batch.tasks).iter().map(|(q, _)| *q))
        } else {
            Vec::new()
        };
        // Likewise the calls' places in their queues' order chains.
        let links = self.links(&batch.tasks);
        async move {
            if batch.is_empty() {
                return Ok(WriteOutcome::default());
            }
            // A restarted server, or a replica promoted by a failover, may lack the script. The
            // write that meets NOSCRIPT fails, and the writer sends everything unconfirmed
            // again, in order, after its backoff; the first of those loads the script before
            // it sends. Retrying inside this write instead would let a later write, issued
            // while this one loaded the script, land first (seen: a Valkey restart under load
            // put 500 tasks out of order).
            if this.script_missing.load(Ordering::Acquire) {
                this.load_script().await?;
                this.script_missing.store(false, Ordering::Release);
            }
            let result = match this.write_once(&batch, &turns, &links).await {
                Err(e) if e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
                    this.script_missing.store(true, Ordering::Release);
                    tracing::info!(
                        "valkey lacked the enqueue script (restarted, or a replica promoted); \
                         it is loaded before the next write"
                    );
                    Err(SinkError::Valkey(e))
                }
                other => other.map_err(SinkError::Valkey),
            };
            if result.is_err() {
                // A failover may have lost the queue set's entry: add it again on the next write.
                this.registered.lock().unwrap().clear();
            }
            result
        }
    }

    fn reset(&self) {
        self.conn.reset();
    }

    fn restart_order(&self) {
        if let Some(order) = &self.order {
            order.restart();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{refusal, Refusal, ReplicaWait};

    #[test]
    fn the_replicas_of_a_primary_are_counted_from_its_role() {
        use redis::Value;
        let replica = |port: &str| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::BulkString(port.as_bytes().to_vec()),
                Value::BulkString(b"0".to_vec()),
            ])
        };
        let master = |replicas: Vec<Value>| {
            vec![
                Value::BulkString(b"master".to_vec()),
                Value::Int(10),
                Value::Array(replicas),
            ]
        };
        assert_eq!(super::replicas_in_role(&master(vec![])), Some(0));
        assert_eq!(
            super::replicas_in_role(&master(vec![replica("1"), replica("2")])),
            Some(2)
        );
        let slave = vec![
            Value::BulkString(b"slave".to_vec()),
            Value::BulkString(b"127.0.0.1".to_vec()),
            Value::Int(6379),
            Value::BulkString(b"connected".to_vec()),
            Value::Int(10),
        ];
        assert_eq!(super::replicas_in_role(&slave), None);
    }

    #[test]
    fn a_write_fewer_replicas_acknowledged_fails_and_is_retried() {
        let wait = ReplicaWait {
            replicas: 2,
            timeout: std::time::Duration::from_millis(500),
        };
        assert!(wait.check(2).is_ok());
        assert!(wait.check(3).is_ok());
        let short = wait.check(1).unwrap_err();
        assert!(short.to_string().contains("1 of 2"), "{short}");
        // Sent again on the same connection: nothing to reset, and not a refusal of the tasks.
        assert!(!short.is_io_error() && !short.is_timeout());
        assert_eq!(refusal(&short), Refusal::Retry);
    }

    /// The error a server's reply `resp` (one RESP error line) carries.
    fn reply(resp: &str) -> redis::RedisError {
        redis::parse_redis_value(format!("{resp}\r\n").as_bytes())
            .expect("a RESP error")
            .extract_error()
            .expect_err("an error reply")
    }

    #[test]
    fn refusals_that_need_someone_to_change_something_go_to_the_poller() {
        for r in [
            "-WRONGTYPE asynq:{q}:pending holds a string, not asynq's pending list",
            "-CROSSSLOT Keys in request don't hash to the same slot",
            "-NOPERM User relay has no permissions to access the 'asynq:{q}:pending' key",
            "-ERR Error running script (call to f_1): @user_script:3: Script attempted to access nonexistent global variable",
            "-EXECABORT Transaction discarded because of previous errors.",
        ] {
            assert_eq!(refusal(&reply(r)), Refusal::Reject, "{r}");
        }
    }

    #[test]
    fn conditions_that_pass_are_retried_even_wrapped_in_err() {
        for r in [
            "-OOM command not allowed when used memory > 'maxmemory'.",
            "-ERR Error running script (call to f_1): @user_script:9: @user_script: 9: -OOM command not allowed when used memory > 'maxmemory'.",
            "-ERR max number of clients reached",
            "-MISCONF Errors writing to the AOF file: No space left on device",
            "-ERR Error running script (call to f_1): @user_script:9: @user_script: 9: -MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
            "-BUSY Redis is busy running a script.",
            "-LOADING Redis is loading the dataset in memory",
            "-READONLY You can't write against a read only replica.",
            "-TRYAGAIN Multiple keys request during rehashing of slot",
            "-CLUSTERDOWN The cluster is down",
            "-MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "-NOSCRIPT No matching script. Please use EVAL.",
            "-FENCED the call before this one (asynq:{q}:outbox_relay_order 1/db/slot) has not landed",
        ] {
            assert_eq!(refusal(&reply(r)), Refusal::Retry, "{r}");
        }
    }
}
