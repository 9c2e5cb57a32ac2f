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

use super::{Batch, Sink, SinkError, WriteOutcome};
use crate::task::Task;
use crate::valkey::{ValkeyConnection, ValkeyTarget};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// The batched form of asynq's enqueue script. KEYS = task hashes..., pending list (last);
/// ARGV = now in ns, then (msg, id) per task. Returns one 0/1 per task. The new ids go onto the
/// pending list in one LPUSH, which leaves them in the order one LPUSH per task would (each value
/// is pushed onto the head in turn); the script runs atomically, so no reader sees the hashes
/// without their ids.
pub const ENQUEUE_SCRIPT: &str = r#"
local n = #KEYS - 1
local pending = KEYS[#KEYS]
local now = ARGV[1]
local out = {}
local ids = {}
for i = 1, n do
  if redis.call("EXISTS", KEYS[i]) == 1 then
    out[i] = 0
  else
    redis.call("HSET", KEYS[i], "msg", ARGV[2 * i], "state", "pending", "pending_since", now)
    ids[#ids + 1] = ARGV[2 * i + 1]
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

/// The set of queue names asynqmon and the Inspector read.
pub const QUEUES_KEY: &str = "asynq:queues";

/// Writes tasks to Valkey/Redis (one server, a cluster or a Sentinel-managed primary) through
/// one multiplexed connection.
#[derive(Clone)]
pub struct ValkeySink {
    conn: ValkeyConnection,
    script: Arc<redis::Script>,
    /// Cluster only: queues this process has added to `asynq:queues`. That key lives in its own
    /// slot, so it is written apart from the tasks: once per queue, and again after any failed
    /// write (a failover may have lost it).
    registered: Arc<Mutex<HashSet<Arc<str>>>>,
}

impl std::fmt::Debug for ValkeySink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ValkeySink")
    }
}

/// The tasks of a batch grouped by queue, queues in order of first appearance, each queue's
/// tasks in batch order (the pending list is FIFO).
fn by_queue(tasks: &[Task]) -> Vec<(&str, Vec<&Task>)> {
    let mut groups: Vec<(&str, Vec<&Task>)> = Vec::new();
    for t in tasks {
        match groups.iter_mut().find(|(q, _)| *q == &*t.queue) {
            Some((_, of_queue)) => of_queue.push(t),
            None => groups.push((&t.queue, vec![t])),
        }
    }
    groups
}

/// Counts the script results (1 = created, 0 = already there).
fn count(results: &[Vec<i64>], out: &mut WriteOutcome) {
    for r in results.iter().flatten() {
        if *r == 1 {
            out.enqueued += 1;
        } else {
            out.duplicates += 1;
        }
    }
}

impl ValkeySink {
    /// Connects (failing if Valkey is unreachable now) and loads the enqueue script.
    pub async fn connect(target: ValkeyTarget) -> Result<Self, SinkError> {
        let conn = target.connect().await.map_err(SinkError::Valkey)?;
        let sink = Self {
            conn,
            script: Arc::new(redis::Script::new(ENQUEUE_SCRIPT)),
            registered: Arc::default(),
        };
        sink.load_script().await?;
        Ok(sink)
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

    /// Appends the script calls for one queue's tasks.
    fn add_scripts(&self, pipe: &mut redis::Pipeline, q: &str, tasks: &[&Task], now_ns: &str) {
        for chunk in tasks.chunks(TASKS_PER_SCRIPT) {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(self.script.get_hash()).arg(chunk.len() + 1);
            for t in chunk {
                cmd.arg(task_key(q, &t.id));
            }
            cmd.arg(pending_key(q)).arg(now_ns);
            for t in chunk {
                cmd.arg(&t.msg[..]).arg(&t.id);
            }
            pipe.add_command(cmd);
        }
    }

    async fn write_once(&self, batch: &Batch) -> Result<WriteOutcome, redis::RedisError> {
        let now_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
            .to_string();
        let groups = by_queue(&batch.tasks);
        let mut out = WriteOutcome::default();
        if !self.conn.is_cluster() {
            // One pipeline, one round trip: SADD and the script calls of every queue.
            let mut pipe = redis::pipe();
            for (q, tasks) in &groups {
                pipe.cmd("SADD").arg(QUEUES_KEY).arg(*q).ignore();
                self.add_scripts(&mut pipe, q, tasks, &now_ns);
            }
            let results: Vec<Vec<i64>> = pipe.query_async(&mut self.conn.clone()).await?;
            count(&results, &mut out);
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
        let writes = futures::future::join_all(groups.iter().map(|(q, tasks)| {
            let mut pipe = redis::pipe();
            self.add_scripts(&mut pipe, q, tasks, &now_ns);
            let mut conn = self.conn.clone();
            async move { pipe.query_async::<Vec<Vec<i64>>>(&mut conn).await }
        }));
        let (registered, written) = futures::future::join(register, writes).await;
        // Every queue's outcome is needed: a NOSCRIPT anywhere must be seen as such.
        let mut first_error = None;
        for w in written {
            match w {
                Ok(results) => count(&results, &mut out),
                Err(e) => {
                    if first_error.is_none()
                        || e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
                    {
                        first_error = Some(e);
                    }
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
        Ok(out)
    }
}

impl Sink for ValkeySink {
    fn write(
        &self,
        batch: Arc<Batch>,
    ) -> impl std::future::Future<Output = Result<WriteOutcome, SinkError>> + Send + 'static {
        let this = self.clone();
        async move {
            if batch.is_empty() {
                return Ok(WriteOutcome::default());
            }
            let result = match this.write_once(&batch).await {
                // A restarted server, or a replica promoted by a failover, may not have the
                // script: load it and try once more.
                Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    tracing::info!(
                        "valkey lacked the enqueue script (restarted, or a replica promoted); \
                         loading it again"
                    );
                    match this.load_script().await {
                        Ok(()) => this.write_once(&batch).await.map_err(SinkError::Valkey),
                        Err(e) => Err(e),
                    }
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
}
