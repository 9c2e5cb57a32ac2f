//! Where a task is in asynq's storage, read the way asynq's own Inspector reads it (v0.26.0,
//! `internal/rdb/inspect.go`: `GetTaskInfo`, `DeleteTask`), for `trace`, `replay` and
//! `reconcile`. Read-only except [`delete_task`], which is the Inspector's `DeleteTask`.
//!
//! A task is the hash `asynq:{q}:t:<id>`; its `state` field says which structure holds its id:
//! the `pending` list (servers pop from the right), the `active` list with a `lease` zset
//! score, or the `scheduled`, `retry`, `archived` and `completed` zsets (scores: next process
//! time, next process time, time archived, and for `completed` the time the janitor deletes it,
//! completed_at + retention). Every key of a queue shares the `{q}` hash tag, so each script
//! below runs on one cluster shard.

use crate::task::time::unix_seconds_to_rfc3339;
use crate::task::TaskMessage;
use prost::Message;
use redis::aio::ConnectionLike;

/// One atomic read of a task: `{msg, state, detail, pending_since}` or nil when the hash does
/// not exist. `detail`: tasks ahead in the pending list (by its position from the right), the
/// lease expiry of an active task, the zset score of a scheduled, retry, archived or completed
/// task, or the group of an aggregating one.
/// KEYS = [task hash]; ARGV = [task id, queue key prefix `asynq:{q}:`].
const READ_SCRIPT: &str = r#"
if redis.call("EXISTS", KEYS[1]) == 0 then
  return nil
end
local msg, state, since, group = unpack(redis.call("HMGET", KEYS[1], "msg", "state", "pending_since", "group"))
local detail = false
if state == "pending" then
  local pos = redis.call("LPOS", ARGV[2] .. "pending", ARGV[1], "RANK", -1)
  if pos then
    detail = redis.call("LLEN", ARGV[2] .. "pending") - 1 - pos
  end
elseif state == "active" then
  detail = redis.call("ZSCORE", ARGV[2] .. "lease", ARGV[1])
elseif state == "scheduled" or state == "retry" or state == "archived" or state == "completed" then
  detail = redis.call("ZSCORE", ARGV[2] .. state, ARGV[1])
elseif state == "aggregating" then
  detail = group
end
return {msg, state, detail, since}
"#;

/// asynq v0.26.0's `deleteTaskCmd` (Inspector.DeleteTask), verbatim in effect: 1 deleted,
/// 0 no such task, -1 the task is active (asynq refuses to delete it).
/// KEYS = [task hash, `asynq:{q}:groups`]; ARGV = [id, queue key prefix, group key prefix].
const DELETE_SCRIPT: &str = r#"
if redis.call("EXISTS", KEYS[1]) == 0 then
	return 0
end
local state, group = unpack(redis.call("HMGET", KEYS[1], "state", "group"))
if state == "active" then
	return -1
end
if state == "pending" then
	if redis.call("LREM", ARGV[2] .. state, 0, ARGV[1]) == 0 then
		return redis.error_reply("task is not found in list: " .. tostring(ARGV[2] .. state))
	end
elseif state == "aggregating" then
	if redis.call("ZREM", ARGV[3] .. group, ARGV[1]) == 0 then
		return redis.error_reply("task is not found in zset: " .. tostring(ARGV[3] .. group))
	end
	if redis.call("ZCARD", ARGV[3] .. group) == 0 then
		redis.call("SREM", KEYS[2], group)
	end
else
	if redis.call("ZREM", ARGV[2] .. state, ARGV[1]) == 0 then
		return redis.error_reply("task is not found in zset: " .. tostring(ARGV[2] .. state))
	end
end
local unique_key = redis.call("HGET", KEYS[1], "unique_key")
if unique_key and unique_key ~= "" and redis.call("GET", unique_key) == ARGV[1] then
	redis.call("DEL", unique_key)
end
return redis.call("DEL", KEYS[1])
"#;

/// `asynq:{q}:` — the prefix of every key of a queue.
pub fn queue_prefix(queue: &str) -> String {
    format!("asynq:{{{queue}}}:")
}

/// A task as asynq stores it, flattened for output. Times are RFC 3339 UTC.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TaskInfo {
    /// The queue whose keys hold the task.
    pub queue: String,
    /// asynq's state: pending, active, scheduled, retry, archived, completed, aggregating.
    pub state: String,
    /// Pending: how many tasks a server takes before this one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ahead: Option<i64>,
    /// Pending: since when (asynq's `pending_since`, nanoseconds, shown as a time).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pending_since: Option<String>,
    /// Active: when the worker's lease runs out (it is extended while the worker lives).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_expires_at: Option<String>,
    /// Scheduled or retry: when it becomes pending again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_process_at: Option<String>,
    /// Archived: when.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub archived_at: Option<String>,
    /// Completed: when the handler returned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<String>,
    /// Completed: until when asynq keeps it (completed_at + retention); its TaskID
    /// deduplicates replays until then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kept_until: Option<String>,
    /// Aggregating: the group.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// The task type (`event:<name>`), when the message decodes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task_type: Option<String>,
    /// Failed attempts so far, and the MaxRetry of the task.
    pub retried: i32,
    pub max_retry: i32,
    /// The handler's last error (retry, archived).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_failed_at: Option<String>,
}

impl TaskInfo {
    /// A one-line description: `pending (3 ahead) in queue default`.
    pub fn describe(&self) -> String {
        let detail = match self.state.as_str() {
            "pending" => self
                .ahead
                .map(|n| format!(" ({n} ahead)"))
                .unwrap_or_default(),
            "active" => " (a worker is running it)".to_owned(),
            "scheduled" | "retry" => self
                .next_process_at
                .as_deref()
                .map(|t| format!(" (next attempt {t})"))
                .unwrap_or_default(),
            "completed" => self
                .kept_until
                .as_deref()
                .map(|t| format!(" (kept until {t})"))
                .unwrap_or_default(),
            "archived" => self
                .archived_at
                .as_deref()
                .map(|t| format!(" (since {t})"))
                .unwrap_or_default(),
            _ => String::new(),
        };
        let error = match (&self.last_error, self.state.as_str()) {
            (Some(e), "retry" | "archived") => format!(", error: {}", one_line(e)),
            _ => String::new(),
        };
        format!(
            "{}{detail} in queue {}{error}",
            one_line(&self.state),
            one_line(&self.queue)
        )
    }
}

/// Control characters and direction marks escaped ([`crate::command::printable`]), so a
/// handler's error or a producer's event name cannot break or reorder the output's lines.
pub fn one_line(s: &str) -> String {
    crate::command::printable(s).into_owned()
}

fn score_secs(v: &redis::Value) -> Option<i64> {
    match v {
        redis::Value::BulkString(b) => std::str::from_utf8(b)
            .ok()?
            .parse::<f64>()
            .ok()
            .map(|f| f as i64),
        redis::Value::Int(i) => Some(*i),
        _ => None,
    }
}

fn text(v: &redis::Value) -> Option<String> {
    match v {
        redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn time(secs: i64) -> Option<String> {
    (secs > 0).then(|| unix_seconds_to_rfc3339(secs))
}

/// The task `id` in `queue`, or `None` when its hash does not exist there.
pub async fn read<C: ConnectionLike + Send>(
    conn: &mut C,
    queue: &str,
    id: &str,
) -> redis::RedisResult<Option<TaskInfo>> {
    let prefix = queue_prefix(queue);
    let reply: redis::Value = redis::Script::new(READ_SCRIPT)
        .key(format!("{prefix}t:{id}"))
        .arg(id)
        .arg(&prefix)
        .invoke_async(conn)
        .await?;
    let redis::Value::Array(parts) = reply else {
        return Ok(None);
    };
    let [msg, state, detail, since] = parts.as_slice() else {
        return Ok(None);
    };
    let state = text(state).unwrap_or_default();
    let message = match msg {
        redis::Value::BulkString(b) => TaskMessage::decode(b.as_slice()).ok(),
        _ => None,
    };
    let detail_secs = score_secs(detail);
    let mut info = TaskInfo {
        queue: queue.to_owned(),
        state: state.clone(),
        ahead: None,
        pending_since: text(since)
            .and_then(|ns| ns.parse::<i64>().ok())
            .and_then(|ns| time(ns / 1_000_000_000)),
        lease_expires_at: None,
        next_process_at: None,
        archived_at: None,
        completed_at: None,
        kept_until: None,
        group: None,
        task_type: message.as_ref().map(|m| m.r#type.clone()),
        retried: message.as_ref().map_or(0, |m| m.retried),
        max_retry: message.as_ref().map_or(0, |m| m.retry),
        last_error: message
            .as_ref()
            .map(|m| m.error_msg.clone())
            .filter(|e| !e.is_empty()),
        last_failed_at: message.as_ref().and_then(|m| time(m.last_failed_at)),
    };
    match state.as_str() {
        "pending" => info.ahead = detail_secs,
        "active" => info.lease_expires_at = detail_secs.and_then(time),
        "scheduled" | "retry" => info.next_process_at = detail_secs.and_then(time),
        "archived" => info.archived_at = detail_secs.and_then(time),
        "completed" => {
            info.kept_until = detail_secs.and_then(time);
            info.completed_at = message.as_ref().and_then(|m| time(m.completed_at));
        }
        "aggregating" => info.group = text(detail),
        _ => {}
    }
    Ok(Some(info))
}

/// The task `id` in the first of `queues` that holds it.
pub async fn find<C: ConnectionLike + Send>(
    conn: &mut C,
    queues: &[String],
    id: &str,
) -> redis::RedisResult<Option<TaskInfo>> {
    for q in queues {
        if let Some(info) = read(conn, q, id).await? {
            return Ok(Some(info));
        }
    }
    Ok(None)
}

/// The queues asynq knows (`asynq:queues`), sorted.
pub async fn known_queues<C: ConnectionLike + Send>(
    conn: &mut C,
) -> redis::RedisResult<Vec<String>> {
    let mut queues: Vec<String> = redis::cmd("SMEMBERS")
        .arg(crate::sink::valkey::QUEUES_KEY)
        .query_async(conn)
        .await?;
    queues.sort();
    Ok(queues)
}

/// `queue` first, then every other queue asynq knows: where to look for a task whose routed
/// queue may have changed since it was enqueued.
pub fn search_order(queue: &str, known: &[String]) -> Vec<String> {
    std::iter::once(queue.to_owned())
        .chain(known.iter().filter(|q| *q != queue).cloned())
        .collect()
}

/// The `state` of each task `ids` names in `queue` (`None`: no task hash), in one pipeline
/// (one cluster slot: every key shares the queue's hash tag).
pub async fn states<C: ConnectionLike + Send>(
    conn: &mut C,
    queue: &str,
    ids: &[&str],
) -> redis::RedisResult<Vec<Option<String>>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let prefix = queue_prefix(queue);
    let mut pipe = redis::pipe();
    for id in ids {
        pipe.cmd("HGET").arg(format!("{prefix}t:{id}")).arg("state");
    }
    pipe.query_async(conn).await
}

/// What [`delete_task`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    Yes,
    NotFound,
    /// asynq does not delete an active task (a worker holds it).
    Active,
}

/// asynq's Inspector.DeleteTask: removes the id from its state's structure and deletes the
/// hash (and a uniqueness lock it holds).
pub async fn delete_task<C: ConnectionLike + Send>(
    conn: &mut C,
    queue: &str,
    id: &str,
) -> redis::RedisResult<Deleted> {
    let prefix = queue_prefix(queue);
    let n: i64 = redis::Script::new(DELETE_SCRIPT)
        .key(format!("{prefix}t:{id}"))
        .key(format!("{prefix}groups"))
        .arg(id)
        .arg(&prefix)
        .arg(format!("{prefix}g:"))
        .invoke_async(conn)
        .await?;
    Ok(match n {
        1 => Deleted::Yes,
        -1 => Deleted::Active,
        _ => Deleted::NotFound,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_starts_with_the_routed_queue() {
        let known = vec!["critical".to_owned(), "default".to_owned()];
        assert_eq!(search_order("default", &known), ["default", "critical"]);
        assert_eq!(search_order("new", &known), ["new", "critical", "default"]);
    }

    #[test]
    fn errors_stay_on_one_line() {
        assert_eq!(one_line("a\nb\u{202e}"), "a\\nb\\u{202e}");
    }
}
