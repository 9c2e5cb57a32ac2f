//! The asynq view of Valkey: a queue's pending ids and a task's hash, decoded, as a Go worker
//! would read them.

use super::servers::Redis;
use super::waits::{eventually, PATIENCE};
use outbox_relay::task::TaskMessage;
use prost::Message;

/// The ids of a queue's pending list, oldest first (asynq LPUSHes and pops from the right).
pub async fn pending_ids(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    queue: &str,
) -> Vec<String> {
    const PAGE: isize = 50_000;
    let key = format!("asynq:{{{queue}}}:pending");
    let mut ids: Vec<String> = Vec::new();
    let mut start = 0isize;
    loop {
        let page: Vec<String> = redis::cmd("LRANGE")
            .arg(&key)
            .arg(start)
            .arg(start + PAGE - 1)
            .query_async(conn)
            .await
            .unwrap();
        let n = page.len();
        ids.extend(page);
        if (n as isize) < PAGE {
            break;
        }
        start += PAGE;
    }
    ids.reverse();
    ids
}

/// The task hash of `id`, decoded: (message, state, pending_since).
pub async fn task(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    queue: &str,
    id: &str,
) -> Option<(TaskMessage, String, String)> {
    let fields: std::collections::HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(format!("asynq:{{{queue}}}:t:{id}"))
        .query_async(conn)
        .await
        .unwrap();
    if fields.is_empty() {
        return None;
    }
    assert_eq!(
        fields.len(),
        3,
        "enqueue writes exactly msg, state, pending_since"
    );
    let msg = TaskMessage::decode(fields["msg"].as_slice()).unwrap();
    let state = String::from_utf8(fields["state"].clone()).unwrap();
    let since = String::from_utf8(fields["pending_since"].clone()).unwrap();
    Some((msg, state, since))
}

/// Waits until the pending list of `queue` holds at least `n` ids; returns them oldest first.
pub async fn wait_pending(redis: &Redis, queue: &str, n: usize) -> Vec<String> {
    let conn = redis.conn().await;
    eventually(&format!("{n} tasks in {queue}"), || {
        let mut conn = conn.clone();
        async move {
            let ids = pending_ids(&mut conn, queue).await;
            (ids.len() >= n).then_some(ids)
        }
    })
    .await
}

/// Waits until every one of `ids` is pending in `queue` (whatever else is there), and returns
/// the queue's pending ids; after [`PATIENCE`] fails naming the ids still missing. A count alone
/// cannot say that: other rows (a test's own inserts, a load's) may fill it first.
pub async fn wait_pending_ids(redis: &Redis, queue: &str, ids: &[String]) -> Vec<String> {
    let mut conn = redis.conn().await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let pending = pending_ids(&mut conn, queue).await;
        let have: std::collections::HashSet<&String> = pending.iter().collect();
        let missing: Vec<&String> = ids.iter().filter(|id| !have.contains(id)).collect();
        if missing.is_empty() {
            return pending;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting: {} of {} ids not pending in {queue}: {missing:?}",
            missing.len(),
            ids.len()
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The queues asynq knows (`asynq:queues`), sorted.
pub async fn queues(conn: &mut (impl redis::aio::ConnectionLike + Send)) -> Vec<String> {
    let mut queues: Vec<String> = redis::cmd("SMEMBERS")
        .arg("asynq:queues")
        .query_async(conn)
        .await
        .unwrap();
    queues.sort();
    queues
}

/// Valkey's count of error replies by their first word (`INFO errorstats`).
pub async fn refusals_by_reply(redis: &Redis) -> Vec<(String, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("errorstats")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
    info.lines()
        .filter_map(|l| l.strip_prefix("errorstat_"))
        .filter_map(|l| {
            let (reply, rest) = l.split_once(":count=")?;
            Some((reply.to_owned(), rest.parse().ok()?))
        })
        .collect()
}
