//! `outbox-relay peek`: the pending tasks of a queue as asynq workers will see them, decoded.
//! An operator tool: it prints task payloads to stdout on request (logs never carry them).

use crate::command::{self, CommandError};
use crate::config::PeekArgs;
use crate::sink::valkey::{pending_key, task_key};
use crate::task::TaskMessage;
use prost::Message;
use std::fmt::Write;

/// One pending task, decoded.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PendingTask {
    pub id: String,
    pub task_type: String,
    pub queue: String,
    pub max_retry: i32,
    pub timeout_secs: i64,
    pub retention_secs: i64,
    pub state: String,
    pub payload: String,
}

/// The `limit` oldest pending tasks of `queue` (the next ones a server will take).
pub async fn peek(
    conn: &mut crate::valkey::ValkeyConnection,
    queue: &str,
    limit: usize,
) -> redis::RedisResult<Vec<PendingTask>> {
    let limit = isize::try_from(limit).unwrap_or(isize::MAX);
    let mut ids: Vec<String> = redis::cmd("LRANGE")
        .arg(pending_key(queue))
        .arg(-limit)
        .arg(-1)
        .query_async(conn)
        .await?;
    ids.reverse();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        let (msg, state): (Option<Vec<u8>>, Option<String>) = redis::cmd("HMGET")
            .arg(task_key(queue, &id))
            .arg("msg")
            .arg("state")
            .query_async(conn)
            .await?;
        let Some(msg) = msg.and_then(|m| TaskMessage::decode(m.as_slice()).ok()) else {
            continue;
        };
        out.push(PendingTask {
            id,
            task_type: msg.r#type,
            queue: msg.queue,
            max_retry: msg.retry,
            timeout_secs: msg.timeout,
            retention_secs: msg.retention,
            state: state.unwrap_or_default(),
            payload: String::from_utf8_lossy(&msg.payload).into_owned(),
        });
    }
    Ok(out)
}

/// A compact human table.
pub fn render(tasks: &[PendingTask]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<36}  {:<24}  {:<8}  {:<7}  PAYLOAD",
        "TASK ID", "TYPE", "QUEUE", "STATE"
    );
    for t in tasks {
        let _ = writeln!(
            s,
            "{:<36}  {:<24}  {:<8}  {:<7}  {}",
            t.id, t.task_type, t.queue, t.state, t.payload
        );
    }
    s
}

/// `outbox-relay peek`: prints the oldest pending tasks of the queue.
pub async fn execute(args: &PeekArgs) -> Result<(), CommandError> {
    let mut conn = args.valkey.target()?.connect().await.map_err(|source| {
        CommandError::ValkeyUnreachable {
            at: args.valkey.display(),
            source,
        }
    })?;
    let tasks = peek(&mut conn, &args.queue, args.limit).await?;
    command::print(args.json, tasks.as_slice(), render)
}
