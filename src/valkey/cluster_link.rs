//! The connection to a Valkey cluster, made again from the seed nodes after a connection
//! failure instead of being kept.
//!
//! Why: redis' async cluster connection (1.8) answers an I/O error by reconnecting to the same
//! node in the background; it refreshes its slot map only on a MOVED reply or when it has no
//! connection for a slot at all. A primary that was killed never answers MOVED, and its
//! replaced socket fails with "broken pipe" (the background reconnect is refused), so the slot
//! map kept pointing at the dead node after the cluster had promoted its replica: every write
//! to that shard failed for as long as CI waited (tests/cluster.rs
//! `failovers_under_load_lose_no_event`, 120 s; upstream redis-rs/redis-rs#2277 describes the
//! same stale-connection path). Here an I/O or parse error of any command, or
//! [`ClusterLink::reset`], drops the connection; the next command builds a new one, which asks
//! the seed nodes for the slot map afresh.
//!
//! Order is not this file's concern: a write to a queue waits for the previous write to that
//! queue to have its final replies (`sink::queue_turns`), whatever connection either used.

use redis::aio::ConnectionLike;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::RoutingInfo;
use redis::{Cmd, ErrorKind, RedisError, RedisFuture, RedisResult, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A cloneable handle; clones share the connection.
#[derive(Clone)]
pub struct ClusterLink {
    inner: Arc<Inner>,
}

struct Inner {
    /// Makes connections; one at a time, so commands waiting for a connection keep their order.
    client: tokio::sync::Mutex<ClusterClient>,
    /// The connection in use, with its generation number.
    current: Mutex<Option<(u64, ClusterConnection)>>,
    generation: AtomicU64,
    /// Connections made after the first one.
    reconnects: AtomicU64,
    /// Bounds the making of one connection (which asks the seed nodes, then connects to every
    /// primary).
    timeout: Duration,
}

impl ClusterLink {
    pub(super) fn new(client: ClusterClient, timeout: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                client: tokio::sync::Mutex::new(client),
                current: Mutex::new(None),
                generation: AtomicU64::new(0),
                reconnects: AtomicU64::new(0),
                timeout,
            }),
        }
    }

    /// The connection in use, making one when there is none.
    pub(super) async fn current(&self) -> RedisResult<(u64, ClusterConnection)> {
        if let Some(c) = self.inner.current.lock().unwrap().clone() {
            return Ok(c);
        }
        let client = self.inner.client.lock().await;
        if let Some(c) = self.inner.current.lock().unwrap().clone() {
            return Ok(c);
        }
        let conn = tokio::time::timeout(self.inner.timeout * 3, client.get_async_connection())
            .await
            .map_err(|_| {
                RedisError::from((ErrorKind::Io, "timed out connecting to the valkey cluster"))
            })??;
        let generation = self.inner.generation.fetch_add(1, Ordering::Relaxed) + 1;
        if generation > 1 {
            self.inner.reconnects.fetch_add(1, Ordering::Relaxed);
            tracing::info!("valkey cluster connection made again (slot map read afresh)");
        }
        *self.inner.current.lock().unwrap() = Some((generation, conn.clone()));
        Ok((generation, conn))
    }

    /// Stops using connection `generation` after `why`: the next command makes a new one.
    /// Commands still under way on the old one finish or fail with it.
    fn forget(&self, generation: u64, why: &RedisError) {
        let mut current = self.inner.current.lock().unwrap();
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            tracing::warn!(error = %why, "valkey cluster connection failed; making a new one for the next command");
            *current = None;
        }
    }

    /// Drops the connection in use (if any): the next command makes a new one. For callers
    /// that gave up on a command themselves (their own timeout).
    pub fn reset(&self) {
        if self.inner.current.lock().unwrap().take().is_some() {
            tracing::info!("valkey cluster connection reset on request");
        }
    }

    /// How many connections were made after the first one.
    pub fn reconnects(&self) -> u64 {
        self.inner.reconnects.load(Ordering::Relaxed)
    }

    fn check<T>(&self, generation: u64, result: &RedisResult<T>) {
        if let Err(e) = result {
            if connection_failed(e) {
                self.forget(generation, e);
            }
        }
    }

    /// Sends `cmd` where `routing` says (for commands to every primary).
    pub(super) async fn route_command(&self, cmd: Cmd, routing: RoutingInfo) -> RedisResult<Value> {
        let (generation, mut conn) = self.current().await?;
        let result = conn.route_command(cmd, routing).await;
        self.check(generation, &result);
        result
    }
}

/// Whether an error means a node's connection failed (an I/O error: a timeout, a reset, a
/// refused connection, a broken pipe; or a reply that cannot be parsed). Server replies,
/// MOVED and ASK included, leave the connection in use: the cluster client handles those.
fn connection_failed(e: &RedisError) -> bool {
    matches!(e.kind(), ErrorKind::Io | ErrorKind::Parse)
}

impl ConnectionLike for ClusterLink {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.current().await?;
            let result = conn.req_packed_command(cmd).await;
            self.check(generation, &result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, mut conn) = self.current().await?;
            let result = conn.req_packed_commands(pipeline, offset, count).await;
            self.check(generation, &result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_drop_the_connection_and_replies_do_not() {
        let broken = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "broken pipe",
        ));
        assert!(connection_failed(&broken));
        let refused = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "refused",
        ));
        assert!(connection_failed(&refused));
        assert!(!connection_failed(&RedisError::from((
            ErrorKind::Server(redis::ServerErrorKind::Moved),
            "MOVED",
            "105 127.0.0.1:7000".to_string(),
        ))));
        assert!(!connection_failed(&RedisError::from((
            ErrorKind::Server(redis::ServerErrorKind::NoScript),
            "NOSCRIPT",
        ))));
    }
}
