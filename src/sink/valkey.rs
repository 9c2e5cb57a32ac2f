//! The asynq writer: tasks into Valkey/Redis exactly as asynq's Go client enqueues them.
//!
//! One Lua script call enqueues many tasks of one queue (all keys share the `{queue}` hash tag,
//! so this also holds on a cluster): for each task, if its hash exists the result is 0 (already
//! delivered, asynq's ErrTaskIDConflict), otherwise HSET msg/state/pending_since and LPUSH the id
//! onto the pending list, result 1. Many script calls ride in one pipeline: one round trip per
//! batch, never one per row.

use super::{Batch, Sink, SinkError, WriteOutcome};
use crate::task::Task;
use redis::aio::ConnectionManager;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The batched form of asynq's enqueue script. KEYS = task hashes..., pending list (last);
/// ARGV = now in ns, then (msg, id) per task. Returns one 0/1 per task.
pub const ENQUEUE_SCRIPT: &str = r#"
local n = #KEYS - 1
local pending = KEYS[#KEYS]
local now = ARGV[1]
local out = {}
for i = 1, n do
  if redis.call("EXISTS", KEYS[i]) == 1 then
    out[i] = 0
  else
    redis.call("HSET", KEYS[i], "msg", ARGV[2 * i], "state", "pending", "pending_since", now)
    redis.call("LPUSH", pending, ARGV[2 * i + 1])
    out[i] = 1
  end
end
return out
"#;

/// Tasks per script call: bounds the time one script holds the server.
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

/// Writes tasks to one Valkey/Redis through an auto-reconnecting multiplexed connection.
#[derive(Clone)]
pub struct ValkeySink {
    conn: ConnectionManager,
    script: Arc<redis::Script>,
}

impl std::fmt::Debug for ValkeySink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ValkeySink")
    }
}

impl ValkeySink {
    /// Connects (failing if Valkey is unreachable now) and loads the enqueue script.
    pub async fn connect(
        client: redis::Client,
        response_timeout: Duration,
    ) -> Result<Self, SinkError> {
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(response_timeout))
            .set_connection_timeout(Some(response_timeout))
            .set_max_delay(Duration::from_secs(2))
            .set_number_of_retries(2);
        let conn = client
            .get_connection_manager_with_config(config)
            .await
            .map_err(SinkError::Valkey)?;
        let sink = Self {
            conn,
            script: Arc::new(redis::Script::new(ENQUEUE_SCRIPT)),
        };
        sink.load_script().await?;
        Ok(sink)
    }

    /// The connection, for checks and inspection.
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    async fn load_script(&self) -> Result<(), SinkError> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(ENQUEUE_SCRIPT)
            .query_async(&mut conn)
            .await
            .map_err(SinkError::Valkey)?;
        Ok(())
    }

    fn pipeline(&self, tasks: &[Task]) -> (redis::Pipeline, usize) {
        let now_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
            .to_string();
        let mut pipe = redis::pipe();
        let mut scripts = 0;
        // Group by queue, keeping each queue's tasks in order (the pending list is FIFO).
        let mut queues: Vec<&str> = Vec::new();
        for t in tasks {
            if !queues.contains(&&*t.queue) {
                queues.push(&t.queue);
            }
        }
        for q in queues {
            pipe.cmd("SADD").arg(QUEUES_KEY).arg(q).ignore();
            let of_queue: Vec<&Task> = tasks.iter().filter(|t| &*t.queue == q).collect();
            for chunk in of_queue.chunks(TASKS_PER_SCRIPT) {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(self.script.get_hash()).arg(chunk.len() + 1);
                for t in chunk {
                    cmd.arg(task_key(q, &t.id));
                }
                cmd.arg(pending_key(q)).arg(&now_ns);
                for t in chunk {
                    cmd.arg(&t.msg[..]).arg(&t.id);
                }
                pipe.add_command(cmd);
                scripts += 1;
            }
        }
        (pipe, scripts)
    }

    async fn write_once(&self, batch: &Batch) -> Result<WriteOutcome, redis::RedisError> {
        let (pipe, _) = self.pipeline(&batch.tasks);
        let mut conn = self.conn.clone();
        let results: Vec<Vec<i64>> = pipe.query_async(&mut conn).await?;
        let mut out = WriteOutcome::default();
        for r in results.iter().flatten() {
            if *r == 1 {
                out.enqueued += 1;
            } else {
                out.duplicates += 1;
            }
        }
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
            match this.write_once(&batch).await {
                Ok(out) => Ok(out),
                // A restarted server forgot the script: load it and try once more.
                Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    this.load_script().await?;
                    this.write_once(&batch).await.map_err(SinkError::Valkey)
                }
                Err(e) => Err(SinkError::Valkey(e)),
            }
        }
    }
}
