//! An asynq server's effects on Valkey, step by step, for tests (no Go toolchain here).
//!
//! Each step runs asynq v0.26.0's own Lua script (github.com/hibiken/asynq, MIT licence,
//! `internal/rdb/rdb.go`, copied verbatim) with the KEYS and ARGV its Go caller passes, and
//! makes the same changes to the TaskMessage the Go code makes before calling it:
//! - [`AsynqWorker::dequeue`]: `dequeueCmd` (pending -> active, a lease of 30 s);
//! - [`AsynqWorker::succeed`]: the processor's success path: `markAsCompleteCmd` with
//!   CompletedAt = now when the task's Retention > 0 (kept in the completed zset until
//!   now + retention), `doneCmd` otherwise (the hash deleted);
//! - [`AsynqWorker::fail`]: the processor's failure path: `retryCmd` (Retried + 1, ErrorMsg,
//!   LastFailedAt, into the retry zset at the next process time) while Retried < Retry, else
//!   `archiveCmd` (ErrorMsg, LastFailedAt, into the archived zset);
//! - [`AsynqWorker::forward`]: the forwarder's `forwardCmd` (due retry tasks back to pending);
//! - [`AsynqWorker::janitor`]: `deleteExpiredCompletedTasksCmd` (completed tasks past their
//!   retention deleted), with `now` given so a test can move the clock.

use outbox_relay::task::TaskMessage;
use prost::Message;
use redis::aio::MultiplexedConnection;
use std::time::{SystemTime, UNIX_EPOCH};

const STATS_TTL_SECS: i64 = 90 * 24 * 3600;
const LEASE_SECS: i64 = 30;
const MAX_ARCHIVE_SIZE: i64 = 10_000;
const ARCHIVED_EXPIRATION_DAYS: i64 = 90;

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
return redis.status_reply("OK")
"#;

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
return redis.status_reply("OK")
"#;

const RETRY: &str = r#"
if redis.call("LREM", KEYS[2], 0, ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
if redis.call("ZREM", KEYS[3], ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
redis.call("ZADD", KEYS[4], ARGV[3], ARGV[1])
redis.call("HSET", KEYS[1], "msg", ARGV[2], "state", "retry")
if tonumber(ARGV[5]) == 1 then
	local n = redis.call("INCR", KEYS[5])
	if tonumber(n) == 1 then
		redis.call("EXPIREAT", KEYS[5], ARGV[4])
	end
	local m = redis.call("INCR", KEYS[6])
	if tonumber(m) == 1 then
		redis.call("EXPIREAT", KEYS[6], ARGV[4])
	end
    local total = redis.call("GET", KEYS[7])
    if tonumber(total) == tonumber(ARGV[6]) then
    	redis.call("SET", KEYS[7], 1)
    	redis.call("SET", KEYS[8], 1)
    else
    	redis.call("INCR", KEYS[7])
    	redis.call("INCR", KEYS[8])
    end
end
return redis.status_reply("OK")"#;

const ARCHIVE: &str = r#"
if redis.call("LREM", KEYS[2], 0, ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
if redis.call("ZREM", KEYS[3], ARGV[1]) == 0 then
  return redis.error_reply("NOT FOUND")
end
redis.call("ZADD", KEYS[4], ARGV[3], ARGV[1])
local old = redis.call("ZRANGE", KEYS[4], "-inf", ARGV[4], "BYSCORE")
if #old > 0 then
	for _, id in ipairs(old) do
		redis.call("DEL", KEYS[9] .. id)
	end
	redis.call("ZREM", KEYS[4], unpack(old))
end

local extra = redis.call("ZRANGE", KEYS[4], 0, -ARGV[5])
if #extra > 0 then
	for _, id in ipairs(extra) do
		redis.call("DEL", KEYS[9] .. id)
	end
	redis.call("ZREM", KEYS[4], unpack(extra))
end

redis.call("HSET", KEYS[1], "msg", ARGV[2], "state", "archived")
local n = redis.call("INCR", KEYS[5])
if tonumber(n) == 1 then
	redis.call("EXPIREAT", KEYS[5], ARGV[6])
end
local m = redis.call("INCR", KEYS[6])
if tonumber(m) == 1 then
	redis.call("EXPIREAT", KEYS[6], ARGV[6])
end
local total = redis.call("GET", KEYS[7])
if tonumber(total) == tonumber(ARGV[7]) then
   	redis.call("SET", KEYS[7], 1)
   	redis.call("SET", KEYS[8], 1)
else
  	redis.call("INCR", KEYS[7])
   	redis.call("INCR", KEYS[8])
end
return redis.status_reply("OK")"#;

const FORWARD: &str = r#"
local ids = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", ARGV[1], "LIMIT", 0, 100)
for _, id in ipairs(ids) do
	local taskKey = ARGV[2] .. id
	local group = redis.call("HGET", taskKey, "group")
	if group and group ~= '' then
	    redis.call("ZADD", ARGV[4] .. group, ARGV[1], id)
		redis.call("ZREM", KEYS[1], id)
		redis.call("HSET", taskKey,
				   "state", "aggregating")
	else
		redis.call("LPUSH", KEYS[2], id)
		redis.call("ZREM", KEYS[1], id)
		redis.call("HSET", taskKey,
				   "state", "pending",
				   "pending_since", ARGV[3])
	end
end
return table.getn(ids)"#;

const DELETE_EXPIRED_COMPLETED: &str = r#"
local ids = redis.call("ZRANGEBYSCORE", KEYS[1], "-inf", ARGV[1], "LIMIT", 0, tonumber(ARGV[3]))
for _, id in ipairs(ids) do
	redis.call("DEL", ARGV[2] .. id)
	redis.call("ZREM", KEYS[1], id)
end
return table.getn(ids)"#;

pub fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn today() -> String {
    outbox_relay::task::time::unix_seconds_to_rfc3339(now_secs())[..10].to_owned()
}

/// One asynq server's processing of one queue, a step at a time.
pub struct AsynqWorker {
    conn: MultiplexedConnection,
    queue: String,
}

impl AsynqWorker {
    pub fn new(conn: MultiplexedConnection, queue: &str) -> Self {
        Self {
            conn,
            queue: queue.to_owned(),
        }
    }

    fn key(&self, suffix: &str) -> String {
        format!("asynq:{{{}}}:{suffix}", self.queue)
    }

    /// Takes the next pending task (the rightmost), as a server's dequeue does.
    pub async fn dequeue(&mut self) -> Option<TaskMessage> {
        let msg: Option<Vec<u8>> = redis::Script::new(DEQUEUE)
            .key(self.key("pending"))
            .key(self.key("paused"))
            .key(self.key("active"))
            .key(self.key("lease"))
            .arg(now_secs() + LEASE_SECS)
            .arg(self.key("t:"))
            .invoke_async(&mut self.conn)
            .await
            .unwrap();
        msg.map(|m| TaskMessage::decode(m.as_slice()).unwrap())
    }

    /// The handler returned nil: completed and kept for its retention, or deleted at once.
    pub async fn succeed(&mut self, msg: &TaskMessage) {
        let now = now_secs();
        let stats = format!("processed:{}", today());
        if msg.retention > 0 {
            let mut done = msg.clone();
            done.completed_at = now;
            let () = redis::Script::new(MARK_AS_COMPLETE)
                .key(self.key("active"))
                .key(self.key("lease"))
                .key(self.key("completed"))
                .key(self.key(&format!("t:{}", msg.id)))
                .key(self.key(&stats))
                .key(self.key("processed"))
                .arg(&msg.id)
                .arg(now + STATS_TTL_SECS)
                .arg(now + msg.retention)
                .arg(done.encode_to_vec())
                .arg(i64::MAX)
                .invoke_async(&mut self.conn)
                .await
                .unwrap();
        } else {
            let () = redis::Script::new(DONE)
                .key(self.key("active"))
                .key(self.key("lease"))
                .key(self.key(&format!("t:{}", msg.id)))
                .key(self.key(&stats))
                .key(self.key("processed"))
                .arg(&msg.id)
                .arg(now + STATS_TTL_SECS)
                .arg(i64::MAX)
                .invoke_async(&mut self.conn)
                .await
                .unwrap();
        }
    }

    /// The handler returned `error`: retried at now + `retry_in_secs` while retries are left
    /// (Retried < Retry), archived otherwise.
    pub async fn fail(&mut self, msg: &TaskMessage, error: &str, retry_in_secs: i64) {
        let now = now_secs();
        let date = today();
        let mut modified = msg.clone();
        modified.error_msg = error.to_owned();
        modified.last_failed_at = now;
        let task_key = self.key(&format!("t:{}", msg.id));
        if msg.retried >= msg.retry {
            let () = redis::Script::new(ARCHIVE)
                .key(&task_key)
                .key(self.key("active"))
                .key(self.key("lease"))
                .key(self.key("archived"))
                .key(self.key(&format!("processed:{date}")))
                .key(self.key(&format!("failed:{date}")))
                .key(self.key("processed"))
                .key(self.key("failed"))
                .key(self.key("t:"))
                .arg(&msg.id)
                .arg(modified.encode_to_vec())
                .arg(now)
                .arg(now - ARCHIVED_EXPIRATION_DAYS * 86_400)
                .arg(MAX_ARCHIVE_SIZE)
                .arg(now + STATS_TTL_SECS)
                .arg(i64::MAX)
                .invoke_async(&mut self.conn)
                .await
                .unwrap();
            return;
        }
        modified.retried += 1;
        let () = redis::Script::new(RETRY)
            .key(&task_key)
            .key(self.key("active"))
            .key(self.key("lease"))
            .key(self.key("retry"))
            .key(self.key(&format!("processed:{date}")))
            .key(self.key(&format!("failed:{date}")))
            .key(self.key("processed"))
            .key(self.key("failed"))
            .arg(&msg.id)
            .arg(modified.encode_to_vec())
            .arg(now + retry_in_secs)
            .arg(now + STATS_TTL_SECS)
            .arg(1)
            .arg(i64::MAX)
            .invoke_async(&mut self.conn)
            .await
            .unwrap();
    }

    /// The forwarder at time `now`: due retry tasks go back to pending; returns how many.
    pub async fn forward(&mut self, now: i64) -> i64 {
        redis::Script::new(FORWARD)
            .key(self.key("retry"))
            .key(self.key("pending"))
            .arg(now)
            .arg(self.key("t:"))
            .arg(now.saturating_mul(1_000_000_000))
            .arg(self.key("g:"))
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    /// The janitor at time `now`: completed tasks whose retention ran out are deleted.
    pub async fn janitor(&mut self, now: i64) -> i64 {
        redis::Script::new(DELETE_EXPIRED_COMPLETED)
            .key(self.key("completed"))
            .arg(now)
            .arg(self.key("t:"))
            .arg(100)
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }
}
