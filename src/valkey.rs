//! Connections to Valkey/Redis in its three topologies: one server, a cluster, or a primary
//! found through Sentinel. [`ValkeyTarget`] is the validated configuration (nothing connects
//! yet); [`ValkeyConnection`] is one cloneable, multiplexed connection that the sink, the
//! monitor, `status` and `peek` use alike through redis' `ConnectionLike`.
//!
//! - **Single**: redis' `ConnectionManager`, which reconnects by itself.
//! - **Cluster**: redis' async cluster connection. It routes each command by its first key (an
//!   `EVALSHA` by its first key, a pipeline by the slot of its commands, which must all share it)
//!   and keeps a connection per node. It does not retry a failed command itself (retries 0):
//!   a MOVED, ASK, TRYAGAIN, CLUSTERDOWN or connection error is returned to the caller, and the
//!   client refreshes its slot map on MOVED and connection errors. The relay's writer then
//!   re-sends its unconfirmed batches, in order, after a backoff.
//! - **Sentinel**: the primary named by the sentinels, over a multiplexed connection. A failed
//!   command, or a READONLY/MASTERDOWN reply (a primary demoted by a failover), drops that
//!   connection; the next command asks the sentinels again for the current primary and checks
//!   with `ROLE` that it is one.
//!
//! TLS: `rediss://` URLs, with the CA and client certificate files (`OUTBOX_VALKEY_CA_FILE`, ...)
//! applied to every connection of the topology: the server, every cluster node, the sentinels and
//! the primary they name.

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, FromRedisValue, IntoConnectionInfo, RedisError,
    RedisFuture, RedisResult, ServerErrorKind, TlsCertificates, TlsMode, Value,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the configured URLs are to be used.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Topology {
    /// One server (the URL list has one entry).
    #[default]
    Single,
    /// The URLs are seed nodes of a cluster.
    Cluster,
    /// The URLs are sentinels that monitor the primary named `master`.
    Sentinel {
        master: String,
        /// Password of the sentinels themselves (the URLs' credentials are the primary's).
        password: Option<String>,
    },
}

/// A validated Valkey configuration; [`connect`](Self::connect) opens the connection.
pub enum ValkeyTarget {
    Single {
        client: redis::Client,
        timeout: Duration,
    },
    Cluster(redis::cluster::ClusterClient),
    Sentinel {
        client: SentinelClient,
        db: i64,
        timeout: Duration,
    },
}

impl std::fmt::Debug for ValkeyTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single { .. } => "ValkeyTarget::Single",
            Self::Cluster(_) => "ValkeyTarget::Cluster",
            Self::Sentinel { .. } => "ValkeyTarget::Sentinel",
        })
    }
}

/// The URLs of a comma-separated list, trimmed, empty items dropped.
pub fn split_urls(urls: &str) -> Vec<&str> {
    urls.split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect()
}

/// The TLS mode of a `rediss://` address (`None` for plain TCP and sockets).
fn tls_mode(addr: &ConnectionAddr) -> Option<TlsMode> {
    match addr {
        ConnectionAddr::TcpTls { insecure: true, .. } => Some(TlsMode::Insecure),
        ConnectionAddr::TcpTls { .. } => Some(TlsMode::Secure),
        _ => None,
    }
}

impl ValkeyTarget {
    /// Checks the URL list against the topology and builds the client (no I/O). `certs` (the CA
    /// and client certificate files' contents) apply to every connection: the server, each
    /// cluster node, the sentinels and the primary they name; they need `rediss://` URLs. The
    /// error says what is wrong, without repeating the URLs (they may hold a password).
    pub fn new(
        urls: &str,
        topology: &Topology,
        timeout: Duration,
        certs: Option<TlsCertificates>,
    ) -> Result<Self, String> {
        let list = split_urls(urls);
        if list.is_empty() {
            return Err("no URL given".into());
        }
        let infos = list
            .iter()
            .map(|u| u.into_connection_info())
            .collect::<RedisResult<Vec<ConnectionInfo>>>()
            .map_err(|e| e.to_string())?;
        if certs.is_some() && !infos.iter().all(|i| tls_mode(i.addr()).is_some()) {
            return Err(
                "CA and client certificate files need rediss:// (or valkeys://) URLs, every one"
                    .into(),
            );
        }
        match topology {
            Topology::Single => {
                if infos.len() > 1 {
                    return Err(format!(
                        "{} URLs given: a list is for cluster seed nodes (OUTBOX_VALKEY_CLUSTER=true) \
                         or sentinels (OUTBOX_VALKEY_SENTINEL_MASTER)",
                        infos.len()
                    ));
                }
                let client = match certs {
                    Some(certs) => redis::Client::build_with_tls(infos[0].clone(), certs),
                    None => redis::Client::open(infos[0].clone()),
                }
                .map_err(|e| e.to_string())?;
                Ok(Self::Single { client, timeout })
            }
            Topology::Cluster => {
                let first_mode = tls_mode(infos[0].addr());
                let mut builder = redis::cluster::ClusterClientBuilder::new(infos)
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .retries(0);
                if let Some(certs) = certs {
                    // Every node the cluster names is reached with these certificates, in the
                    // seed URLs' mode (`certs` alone would make it Secure).
                    builder = builder.certs(certs);
                    if let Some(mode) = first_mode {
                        builder = builder.tls(mode);
                    }
                }
                let client = builder.build().map_err(|e| e.to_string())?;
                Ok(Self::Cluster(client))
            }
            Topology::Sentinel { master, password } => {
                if master.trim().is_empty() {
                    return Err("the sentinel master name is empty".into());
                }
                let primary = infos[0].redis_settings().clone();
                let same = |i: &ConnectionInfo| {
                    let r = i.redis_settings();
                    r.username() == primary.username()
                        && r.password() == primary.password()
                        && r.db() == primary.db()
                };
                if !infos.iter().all(same) {
                    return Err(
                        "with sentinels, every URL must carry the same user, password and database \
                         (those of the primary)"
                            .into(),
                    );
                }
                // The primary is reached as the sentinels are: with TLS (and the same
                // certificates) when their URLs are rediss://.
                let primary_mode = tls_mode(infos[0].addr());
                // The sentinels get the address only, plus their own password if any.
                let mut builder = SentinelClientBuilder::new(
                    infos.iter().map(|i| i.addr().clone()),
                    master,
                    SentinelServerType::Master,
                )
                .map_err(|e| e.to_string())?
                .set_client_to_redis_db(primary.db())
                .set_client_to_redis_protocol(primary.protocol());
                if let Some(user) = primary.username() {
                    builder = builder.set_client_to_redis_username(user);
                }
                if let Some(p) = primary.password() {
                    builder = builder.set_client_to_redis_password(p);
                }
                if let Some(p) = password.as_deref().filter(|p| !p.is_empty()) {
                    builder = builder.set_client_to_sentinel_password(p);
                }
                if let Some(mode) = primary_mode {
                    builder = builder.set_client_to_redis_tls_mode(mode);
                }
                if let Some(certs) = certs {
                    builder = builder
                        .set_client_to_sentinel_certificates(certs.clone())
                        .set_client_to_redis_certificates(certs);
                }
                let client = builder.build().map_err(|e| e.to_string())?;
                Ok(Self::Sentinel {
                    client,
                    db: primary.db(),
                    timeout,
                })
            }
        }
    }

    /// Connects (failing if Valkey cannot be reached now).
    pub async fn connect(self) -> RedisResult<ValkeyConnection> {
        match self {
            Self::Single { client, timeout } => {
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_response_timeout(Some(timeout))
                    .set_connection_timeout(Some(timeout))
                    .set_max_delay(Duration::from_secs(2))
                    .set_number_of_retries(2);
                let conn = client.get_connection_manager_with_config(config).await?;
                Ok(ValkeyConnection::Single(conn))
            }
            Self::Cluster(client) => Ok(ValkeyConnection::Cluster(
                client.get_async_connection().await?,
            )),
            Self::Sentinel {
                client,
                db,
                timeout,
            } => {
                let conn = SentinelConnection {
                    inner: Arc::new(SentinelInner {
                        client: tokio::sync::Mutex::new(client),
                        current: Mutex::new(None),
                        generation: AtomicU64::new(0),
                        config: redis::AsyncConnectionConfig::new()
                            .set_response_timeout(Some(timeout))
                            .set_connection_timeout(Some(timeout)),
                        timeout,
                        db,
                    }),
                };
                conn.current().await?;
                Ok(ValkeyConnection::Sentinel(conn))
            }
        }
    }
}

/// One connection to Valkey, whatever its topology. Cheap to clone; clones share the
/// underlying connections.
#[derive(Clone)]
pub enum ValkeyConnection {
    Single(ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
    Sentinel(SentinelConnection),
}

impl std::fmt::Debug for ValkeyConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "ValkeyConnection::Single",
            Self::Cluster(_) => "ValkeyConnection::Cluster",
            Self::Sentinel(_) => "ValkeyConnection::Sentinel",
        })
    }
}

impl ValkeyConnection {
    /// A cluster: keys of different slots cannot share a pipeline.
    pub fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// Stops using the current connection after a write timed out or failed on the link, so
    /// writes queued behind it are dropped rather than piling up. Sentinel: the next command
    /// asks the sentinels again. Single server and cluster: their clients reconnect by
    /// themselves on connection errors (a timed-out write is bounded by the response timeout).
    pub fn reset(&self) {
        if let Self::Sentinel(c) = self {
            c.forget_current();
        }
    }

    /// Runs `cmd` on every primary: on the one server, on the current primary, or on each
    /// primary of the cluster. Returns (node, reply) pairs; the node is `None` outside a
    /// cluster. An error of the whole call means no node could be asked.
    pub async fn on_each_primary<T: FromRedisValue>(
        &mut self,
        cmd: &Cmd,
    ) -> RedisResult<Vec<(Option<String>, RedisResult<T>)>> {
        let Self::Cluster(conn) = self else {
            return Ok(vec![(None, cmd.query_async(self).await)]);
        };
        // No response policy: the reply is a map of node address to that node's reply.
        let reply = conn
            .route_command(
                cmd.clone(),
                RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
            )
            .await?;
        let Value::Map(pairs) = reply else {
            return Err(RedisError::from((
                ErrorKind::UnexpectedReturnType,
                "a command sent to every primary did not answer with one reply per node",
            )));
        };
        Ok(pairs
            .into_iter()
            .map(|(node, value)| {
                let node = String::from_utf8_lossy(
                    &redis::from_redis_value::<Vec<u8>>(node).unwrap_or_default(),
                )
                .into_owned();
                let reply = value
                    .extract_error()
                    .and_then(|v| redis::from_redis_value(v).map_err(RedisError::from));
                (Some(node), reply)
            })
            .collect())
    }
}

impl ConnectionLike for ValkeyConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            Self::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Sentinel(c) => c.inner.db,
        }
    }
}

/// The current primary of a Sentinel-managed group, re-resolved after a failure.
#[derive(Clone)]
pub struct SentinelConnection {
    inner: Arc<SentinelInner>,
}

struct SentinelInner {
    /// Asks the sentinels; one resolution at a time.
    client: tokio::sync::Mutex<SentinelClient>,
    /// The connection to the primary in use, with its generation number.
    current: Mutex<Option<(u64, MultiplexedConnection)>>,
    generation: AtomicU64,
    config: redis::AsyncConnectionConfig,
    timeout: Duration,
    db: i64,
}

impl SentinelConnection {
    /// The connection to the current primary, asking the sentinels when there is none.
    async fn current(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(c) = self.inner.current.lock().unwrap().clone() {
            return Ok(c);
        }
        // Writes waiting here get the lock in arrival order, so they keep their order.
        let mut client = self.inner.client.lock().await;
        if let Some(c) = self.inner.current.lock().unwrap().clone() {
            return Ok(c);
        }
        let resolve = async {
            // Asks the sentinels for the primary's address and checks it with ROLE.
            let primary = client.async_get_client().await?;
            let addr = primary.get_connection_info().addr().to_string();
            let conn = primary
                .get_multiplexed_async_connection_with_config(&self.inner.config)
                .await?;
            Ok::<_, RedisError>((addr, conn))
        };
        // The sentinels and the primary are each bounded by the timeout; this bounds the sum.
        let (addr, conn) = tokio::time::timeout(self.inner.timeout * 3, resolve)
            .await
            .map_err(|_| {
                RedisError::from((
                    ErrorKind::Io,
                    "timed out asking the sentinels for the primary",
                ))
            })??;
        let generation = self.inner.generation.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(primary = %addr, "connected to the primary named by the sentinels");
        *self.inner.current.lock().unwrap() = Some((generation, conn.clone()));
        Ok((generation, conn))
    }

    /// Stops using whatever connection is current.
    fn forget_current(&self) {
        *self.inner.current.lock().unwrap() = None;
    }

    /// Stops using connection `generation`: the next command asks the sentinels again.
    fn forget(&self, generation: u64, why: &RedisError) {
        let mut current = self.inner.current.lock().unwrap();
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            tracing::warn!(error = %why, "primary connection failed; asking the sentinels again");
            *current = None;
        }
    }
}

/// A reply that says this server is not (or no longer) a usable primary.
fn demoted(value: &Value) -> Option<RedisError> {
    let Value::ServerError(e) = value else {
        return None;
    };
    matches!(
        e.kind(),
        Some(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    )
    .then(|| value.clone().extract_error().unwrap_err())
}

impl ConnectionLike for SentinelConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, mut conn) = self.current().await?;
            let result = conn.req_packed_command(cmd).await;
            match &result {
                Err(e) => self.forget(generation, e),
                Ok(v) => {
                    if let Some(e) = demoted(v) {
                        self.forget(generation, &e);
                    }
                }
            }
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
            match &result {
                Err(e) => self.forget(generation, e),
                Ok(values) => {
                    if let Some(e) = values.iter().find_map(demoted) {
                        self.forget(generation, &e);
                    }
                }
            }
            result
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.db
    }
}
