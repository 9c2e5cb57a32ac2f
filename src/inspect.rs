//! `outbox-relay peek`: the pending tasks of a queue as asynq workers will see them, decoded.
//! An operator tool: it prints task payloads to stdout on request (logs never carry them).

use crate::command::{self, printable, CommandError};
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
    /// The payload itself when it is JSON (as the Go kit's envelope is), else its text.
    pub payload: serde_json::Value,
}

/// A payload as JSON output shows it: the JSON value it holds, else a string (invalid UTF-8
/// replaced).
fn payload_value(bytes: &[u8]) -> serde_json::Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(bytes).into_owned()))
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
            payload: payload_value(&msg.payload),
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
        let payload = match &t.payload {
            serde_json::Value::String(text) => text.clone(),
            json => json.to_string(),
        };
        let _ = writeln!(
            s,
            "{:<36}  {:<24}  {:<8}  {:<7}  {}",
            printable(&t.id),
            printable(&t.task_type),
            printable(&t.queue),
            printable(&t.state),
            printable(&payload)
        );
    }
    s
}

/// Why a peek found nothing, for stderr: the queue is empty, or asynq has never seen it.
pub fn empty_queue_note(queue: &str, known: &[String]) -> String {
    let queue_text = printable(queue);
    if known.iter().any(|q| q == queue) {
        return format!("queue {queue_text:?} has no pending tasks");
    }
    let list = if known.is_empty() {
        "none".to_owned()
    } else {
        known
            .iter()
            .map(|q| printable(q).into_owned())
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "queue {queue_text:?} is not in asynq:queues: no task was ever enqueued to it \
         (known queues: {list})"
    )
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
    if tasks.is_empty() {
        let known = crate::asynq_state::known_queues(&mut conn).await?;
        eprintln!("{}", empty_queue_note(&args.queue, &known));
    }
    command::print(args.json, tasks.as_slice(), render)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_payloads_stay_json_and_others_become_text() {
        assert_eq!(payload_value(br#"{"a":1}"#), serde_json::json!({"a": 1}));
        assert_eq!(payload_value(b"plain"), serde_json::json!("plain"));
        assert_eq!(payload_value(b"\xff"), serde_json::json!("\u{fffd}"));
    }

    #[test]
    fn text_output_escapes_control_characters() {
        let task = PendingTask {
            id: "id".into(),
            task_type: "event:evil\u{202e}name\nnext".into(),
            queue: "default".into(),
            max_retry: 1,
            timeout_secs: 1,
            retention_secs: 1,
            state: "pending".into(),
            payload: payload_value(b"line1\nline2"),
        };
        let out = render(&[task]);
        assert_eq!(out.lines().count(), 2, "{out}");
        assert!(out.contains("event:evil\\u{202e}name\\nnext"), "{out}");
        assert!(out.contains("line1\\nline2"), "{out}");
    }

    #[test]
    fn an_empty_peek_says_why() {
        let known = vec!["critical".to_owned(), "default".to_owned()];
        assert_eq!(
            empty_queue_note("default", &known),
            "queue \"default\" has no pending tasks"
        );
        let note = empty_queue_note("defualt", &known);
        assert!(note.contains("not in asynq:queues"), "{note}");
        assert!(note.contains("known queues: critical, default"), "{note}");
    }
}
