//! An asynq consumer step for tests: what an unmodified Go asynq server does to a task, as the
//! same Lua its `internal/rdb/rdb.go` runs (hibiken/asynq v0.22-v0.26):
//! - dequeue (`dequeueCmd`): unless the queue is paused, `RPOPLPUSH pending -> active`, the hash's
//!   `state` becomes `active`, `pending_since` is removed, the id gets a lease in
//!   `asynq:{q}:lease`; the script returns the `msg`;
//! - success with `Retention > 0` (`markAsCompleteCmd`): off `active` and `lease`, `ZADD
//!   asynq:{q}:completed <now + retention> id`, `HSET msg <msg with completed_at> state
//!   completed`, and the processed counters;
//! - success with `Retention == 0` (`doneCmd`): off `active` and `lease`, `DEL` the task hash,
//!   and the processed counters.
//!
//! Only the completed task's `msg` differs from the server's bytes (the server re-encodes it with
//! `completed_at`; here the stored `msg` is re-encoded the same way with prost).

use outbox_relay::task::TaskMessage;
use prost::Message;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// asynq's `LeaseDuration`.
const LEASE: Duration = Duration::from_secs(30);
/// asynq's `statsTTL` (90 days), for the processed-counter keys.
const STATS_TTL: Duration = Duration::from_secs(90 * 24 * 3600);

const DEQUEUE: &str = r#"
if redis.call("EXISTS", KEYS[2]) == 0 then
	local id = redis.call("RPOPLPUSH", KEYS[1], KEYS[3])
	if id then
		local key = ARGV[2] .. id
		redis.call("HSET", key, "state", "active")
		redis.call("HDEL", key, "pending_since")
		redis.call("ZADD", KEYS[4], ARGV[1], id)
		return redis.call("HGET", key, "msg")
	end
end
return nil"#;

const DONE: &str = r#"
if redis.call("LREM", KEYS[1], 0, ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
if redis.call("ZREM", KEYS[2], ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
if redis.call("DEL", KEYS[3]) == 0 then
  return redis.error_reply("NOT FOUND")
end
local n = redis.call("INCR", KEYS[4])
if tonumber(n) == 1 then
	redis.call("EXPIREAT", KEYS[4], ARGV[2])
end
local total = redis.call("GET", KEYS[5])
if tonumber(total) == tonumber(ARGV[3]) then
	redis.call("SET", KEYS[5], 1)
else
	redis.call("INCR", KEYS[5])
end
return redis.status_reply("OK")"#;

const MARK_AS_COMPLETE: &str = r#"
if redis.call("LREM", KEYS[1], 0, ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
if redis.call("ZREM", KEYS[2], ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
if redis.call("ZADD", KEYS[3], ARGV[3], ARGV[1]) ~= 1 then
  return redis.error_reply("INTERNAL")
end
redis.call("HSET", KEYS[4], "msg", ARGV[4], "state", "completed")
local n = redis.call("INCR", KEYS[5])
if tonumber(n) == 1 then
	redis.call("EXPIREAT", KEYS[5], ARGV[2])
end
local total = redis.call("GET", KEYS[6])
if tonumber(total) == tonumber(ARGV[5]) then
	redis.call("SET", KEYS[6], 1)
else
	redis.call("INCR", KEYS[6])
end
return redis.status_reply("OK")"#;

fn key(queue: &str, suffix: &str) -> String {
    format!("asynq:{{{queue}}}:{suffix}")
}

fn now() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap()
}

/// `asynq:{q}:processed:<yyyy-mm-dd>` for today (UTC).
fn processed_today(queue: &str) -> String {
    let days = now().as_secs() / 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    key(queue, &format!("processed:{y:04}-{m:02}-{d:02}"))
}

/// One asynq server's view of a queue.
pub struct AsynqWorker {
    conn: redis::aio::MultiplexedConnection,
    queue: String,
}

impl AsynqWorker {
    pub fn new(conn: redis::aio::MultiplexedConnection, queue: &str) -> Self {
        Self {
            conn,
            queue: queue.to_owned(),
        }
    }

    /// Dequeues the oldest pending task (pending -> active), as a server does before running it.
    pub async fn dequeue(&mut self) -> Option<TaskMessage> {
        let lease_until = (now() + LEASE).as_secs();
        let msg: Option<Vec<u8>> = redis::Script::new(DEQUEUE)
            .key(key(&self.queue, "pending"))
            .key(key(&self.queue, "paused"))
            .key(key(&self.queue, "active"))
            .key(key(&self.queue, "lease"))
            .arg(lease_until)
            .arg(key(&self.queue, "t:"))
            .invoke_async(&mut self.conn)
            .await
            .unwrap();
        msg.map(|m| TaskMessage::decode(m.as_slice()).unwrap())
    }

    /// The handler succeeded: what the server does next, by the task's retention.
    pub async fn succeed(&mut self, msg: &TaskMessage) {
        let stats_expire = (now() + STATS_TTL).as_secs();
        let id = msg.id.as_str();
        if msg.retention > 0 {
            let mut completed = msg.clone();
            completed.completed_at = now().as_secs() as i64;
            let _: () = redis::Script::new(MARK_AS_COMPLETE)
                .key(key(&self.queue, "active"))
                .key(key(&self.queue, "lease"))
                .key(key(&self.queue, "completed"))
                .key(key(&self.queue, &format!("t:{id}")))
                .key(processed_today(&self.queue))
                .key(key(&self.queue, "processed"))
                .arg(id)
                .arg(stats_expire)
                .arg(completed.completed_at + msg.retention)
                .arg(completed.encode_to_vec())
                .arg(i64::MAX)
                .invoke_async(&mut self.conn)
                .await
                .unwrap();
        } else {
            let _: () = redis::Script::new(DONE)
                .key(key(&self.queue, "active"))
                .key(key(&self.queue, "lease"))
                .key(key(&self.queue, &format!("t:{id}")))
                .key(processed_today(&self.queue))
                .key(key(&self.queue, "processed"))
                .arg(id)
                .arg(stats_expire)
                .arg(i64::MAX)
                .invoke_async(&mut self.conn)
                .await
                .unwrap();
        }
    }

    /// Dequeues and succeeds every pending task; returns their ids in the order run.
    pub async fn drain(&mut self) -> Vec<String> {
        let mut ran = Vec::new();
        while let Some(msg) = self.dequeue().await {
            self.succeed(&msg).await;
            ran.push(msg.id);
        }
        ran
    }

    /// The task hash's `state` field, None when the hash is gone.
    pub async fn state(&mut self, id: &str) -> Option<String> {
        redis::cmd("HGET")
            .arg(key(&self.queue, &format!("t:{id}")))
            .arg("state")
            .query_async(&mut self.conn)
            .await
            .unwrap()
    }

    /// How many tasks the server counted as processed (`asynq:{q}:processed`).
    pub async fn processed(&mut self) -> i64 {
        let n: Option<i64> = redis::cmd("GET")
            .arg(key(&self.queue, "processed"))
            .query_async(&mut self.conn)
            .await
            .unwrap();
        n.unwrap_or(0)
    }
}
