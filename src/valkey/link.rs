//! One multiplexed connection to a Valkey server (a single server, or the primary the sentinels
//! name) that is replaced after a failure instead of being kept.
//!
//! Why not redis' `ConnectionManager`: it reconnects only after errors it considers fatal (a
//! reset, an end of file), not after a response timeout. A black-holed link produces only
//! timeouts, so the stalled TCP connection was kept. Every retry then queued behind the
//! unacknowledged bytes in that socket (memory grew with each retry), and once the link came
//! back the connection resumed only at the kernel's next retransmission, whose interval had
//! grown during the outage: 25-35 s of further silence after a one-minute black hole. Here a
//! command that fails for any reason other than a server's error reply (a timeout, a reset, a
//! refused connection), or a READONLY/MASTERDOWN reply (a demoted primary), drops the connection;
//! the next command makes a fresh one, whose SYN goes out at once. [`Link::reset`] does the same
//! on request.

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::SentinelClient;
use redis::{Cmd, ErrorKind, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where a connection comes from.
pub(super) enum Source {
    /// One server.
    Direct(redis::Client),
    /// The primary the sentinels name now (checked with `ROLE`).
    Sentinel(SentinelClient),
}

/// A cloneable handle; clones share the connection.
#[derive(Clone)]
pub struct Link {
    inner: Arc<Inner>,
}

struct Inner {
    /// Makes connections; one at a time, so writes waiting for a connection keep their order.
    source: tokio::sync::Mutex<Source>,
    /// The connection in use, with its generation number.
    current: Mutex<Option<(u64, MultiplexedConnection)>>,
    generation: AtomicU64,
    /// Connections made after the first one.
    reconnects: AtomicU64,
    config: redis::AsyncConnectionConfig,
    timeout: Duration,
    db: i64,
    /// Bytes of the commands and pipelines under way on this link: a command's reply waits for
    /// theirs, so its deadline counts them ([`super::write_deadline`]).
    pipelined: Arc<AtomicU64>,
}

impl Link {
    pub(super) fn new(source: Source, timeout: Duration, db: i64) -> Self {
        Self {
            inner: Arc::new(Inner {
                source: tokio::sync::Mutex::new(source),
                current: Mutex::new(None),
                generation: AtomicU64::new(0),
                reconnects: AtomicU64::new(0),
                config: redis::AsyncConnectionConfig::new()
                    .set_response_timeout(Some(timeout))
                    .set_connection_timeout(Some(timeout)),
                timeout,
                db,
                pipelined: Arc::default(),
            }),
        }
    }

    /// The connection in use, making one when there is none.
    pub(super) async fn current(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(c) = self.inner.current.lock().unwrap().clone() {
            return Ok(c);
        }
        // Writes waiting here get the lock in arrival order, so they keep their order.
        let mut source = self.inner.source.lock().await;
        if let Some(c) = self.inner.current.lock().unwrap().clone() {
            return Ok(c);
        }
        let config = &self.inner.config;
        let connect = async {
            match &mut *source {
                Source::Direct(client) => {
                    let conn = client
                        .get_multiplexed_async_connection_with_config(config)
                        .await?;
                    Ok::<_, RedisError>((None, conn))
                }
                Source::Sentinel(sentinels) => {
                    // Asks the sentinels for the primary's address and checks it with ROLE.
                    let primary = sentinels.async_get_client().await?;
                    let addr = primary.get_connection_info().addr().to_string();
                    let conn = primary
                        .get_multiplexed_async_connection_with_config(config)
                        .await?;
                    Ok((Some(addr), conn))
                }
            }
        };
        // Each step is bounded by the timeout; this bounds the sum (sentinels, then primary).
        let (primary, conn) = tokio::time::timeout(self.inner.timeout * 3, connect)
            .await
            .map_err(|_| RedisError::from((ErrorKind::Io, "timed out connecting to valkey")))??;
        let generation = self.inner.generation.fetch_add(1, Ordering::Relaxed) + 1;
        if generation > 1 {
            self.inner.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        match primary {
            Some(addr) => {
                tracing::info!(primary = %addr, "connected to the primary named by the sentinels")
            }
            None if generation > 1 => tracing::info!("valkey connection made again"),
            None => {}
        }
        *self.inner.current.lock().unwrap() = Some((generation, conn.clone()));
        Ok((generation, conn))
    }

    /// Stops using connection `generation`: the next command makes a new one. Commands still
    /// waiting on the old connection fail with it; the old socket closes once they are gone.
    fn forget(&self, generation: u64, why: &RedisError) {
        let mut current = self.inner.current.lock().unwrap();
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            tracing::warn!(error = %why, "valkey connection failed; making a new one for the next command");
            *current = None;
        }
    }

    /// Drops the connection in use (if any): the next command makes a new one. For callers
    /// that gave up on a command themselves (their own timeout).
    pub fn reset(&self) {
        if self.inner.current.lock().unwrap().take().is_some() {
            tracing::info!("valkey connection reset on request");
        }
    }

    /// How many connections were made after the first one.
    pub fn reconnects(&self) -> u64 {
        self.inner.reconnects.load(Ordering::Relaxed)
    }

    pub(super) fn db(&self) -> i64 {
        self.inner.db
    }

    /// Counts `bytes` as under way on this link until the guard is dropped, and gives `conn`
    /// (this command's handle) the deadline of those bytes and of everything under way before
    /// them: the client's response timeout runs from the moment a command is queued, so it
    /// covers sending it and what is ahead of it.
    fn under_way(&self, conn: &mut MultiplexedConnection, bytes: u64) -> UnderWay {
        let under_way = UnderWay::add(&self.inner.pipelined, bytes);
        conn.set_response_timeout(super::write_deadline(self.inner.timeout, under_way.total()));
        under_way
    }

    /// Forgets the connection if `result` says it is no longer worth using.
    fn check<T>(&self, generation: u64, result: &RedisResult<T>, replies: impl Fn(&T) -> bool) {
        match result {
            Err(e) if connection_failed(e) => self.forget(generation, e),
            Ok(v) if replies(v) => {
                let e = RedisError::from((ErrorKind::Io, "the server is no longer a primary"));
                self.forget(generation, &e);
            }
            _ => {}
        }
    }
}

/// Whether an error means the connection (not the command) failed: an I/O error (a timeout, a
/// reset, a refused connection), a reply that cannot be parsed (the stream is out of step), or
/// a reply that says this server is not (or no longer) the primary. An error reply to the
/// command itself (WRONGTYPE, OOM, NOSCRIPT, ...) leaves the connection in use.
pub(super) fn connection_failed(e: &RedisError) -> bool {
    match e.kind() {
        ErrorKind::Io | ErrorKind::Parse => true,
        ErrorKind::Server(kind) => demoted_kind(&kind),
        _ => false,
    }
}

fn demoted_kind(kind: &ServerErrorKind) -> bool {
    matches!(
        kind,
        ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown
    )
}

/// A reply that says this server is not (or no longer) a usable primary.
pub(super) fn demoted(value: &Value) -> bool {
    matches!(value, Value::ServerError(e) if e.kind().is_some_and(|k| demoted_kind(&k)))
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.current().await?;
            // Behind the pipelines under way, as a pipeline is (found by review: the health
            // check's PING, queued behind a poller's large write on a slow link, timed out and
            // dropped a connection that was delivering).
            let under_way = self.under_way(&mut conn, args_bytes(cmd));
            let result = conn.req_packed_command(cmd).await;
            drop(under_way);
            self.check(generation, &result, demoted);
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
            let under_way = self.under_way(&mut conn, pipeline_bytes(pipeline));
            let result = conn.req_packed_commands(pipeline, offset, count).await;
            drop(under_way);
            self.check(generation, &result, |values: &Vec<Value>| {
                values.iter().any(demoted)
            });
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.db
    }
}

/// The bytes of a pipeline's arguments (what it sends, less the protocol's framing).
fn pipeline_bytes(pipeline: &redis::Pipeline) -> u64 {
    pipeline.cmd_iter().map(args_bytes).sum()
}

/// The bytes of a command's arguments.
fn args_bytes(cmd: &Cmd) -> u64 {
    cmd.args_iter()
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => bytes.len() as u64,
            _ => 0,
        })
        .sum()
}

/// A pipeline's bytes counted as under way on a link until dropped (answered, failed, or its
/// future dropped).
struct UnderWay {
    counter: Arc<AtomicU64>,
    bytes: u64,
}

impl UnderWay {
    fn add(counter: &Arc<AtomicU64>, bytes: u64) -> Self {
        counter.fetch_add(bytes, Ordering::Relaxed);
        Self {
            counter: counter.clone(),
            bytes,
        }
    }

    /// This pipeline's bytes and those of every other under way now.
    fn total(&self) -> u64 {
        self.counter.load(Ordering::Relaxed)
    }
}

impl Drop for UnderWay {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_and_resets_drop_the_connection_and_error_replies_do_not() {
        let timeout = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "timed out",
        ));
        assert!(connection_failed(&timeout));
        let reset = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert!(connection_failed(&reset));
        assert!(!connection_failed(&RedisError::from((
            ErrorKind::Server(ServerErrorKind::NoScript),
            "NOSCRIPT",
        ))));
        assert!(connection_failed(&RedisError::from((
            ErrorKind::Server(ServerErrorKind::ReadOnly),
            "READONLY",
        ))));
        assert!(!connection_failed(&RedisError::from((
            ErrorKind::Extension,
            "WRONGTYPE",
        ))));
    }
}
