//! Connections to Valkey/Redis in its three topologies: one server, a cluster, or a primary
//! found through Sentinel. [`ValkeyTarget`] is the validated configuration (nothing connects
//! yet); [`ValkeyConnection`] is one cloneable, multiplexed connection that the sink, the
//! monitor, `status` and `peek` use alike through redis' `ConnectionLike`.
//!
//! - **Single**: one multiplexed connection ([`link::Link`]), dropped after a timeout or an I/O
//!   error and made again by the next command (redis' `ConnectionManager` kept a connection whose
//!   replies timed out, see [`link`]).
//! - **Cluster**: redis' async cluster connection. It routes each command by its first key (an
//!   `EVALSHA` by its first key, a pipeline by the slot of its commands, which must all share it)
//!   and keeps a connection per node. It does not retry a failed command itself (retries 0):
//!   a MOVED, ASK, TRYAGAIN, CLUSTERDOWN or connection error is returned to the caller. The
//!   client refreshes its slot map on MOVED; after a connection error the whole cluster
//!   connection is made again from the seed nodes ([`ClusterLink`]: the client alone kept
//!   reconnecting to a killed primary). The relay's writer then re-sends its unconfirmed
//!   batches, in order, after a backoff.
//! - **Sentinel**: the primary named by the sentinels, over a multiplexed connection
//!   ([`link::Link`]). A timeout or an I/O error, or a READONLY/MASTERDOWN reply (a primary
//!   demoted by a failover), drops that connection; the next command asks the sentinels again for
//!   the current primary and checks with `ROLE` that it is one.
//!
//! Sockets to Valkey carry `TCP_USER_TIMEOUT` ([`tcp_settings`]): the kernel closes a connection
//! whose data stays unacknowledged that long. Every topology's connection is also replaced at
//! the first timeout or I/O error.
//!
//! TLS: `rediss://` URLs, with the CA and client certificate files (`OUTBOX_VALKEY_CA_FILE`, ...)
//! applied to every connection of the topology: the server, every cluster node, the sentinels and
//! the primary they name.

mod cluster_link;
mod link;
mod write_deadline;

pub use cluster_link::ClusterLink;
pub use link::Link;
pub use write_deadline::{write_deadline, SLOWEST_LINK_BYTES_PER_SEC};

use redis::aio::ConnectionLike;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::io::tcp::TcpSettings;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, FromRedisValue, IntoConnectionInfo, RedisError,
    RedisFuture, RedisResult, TlsCertificates, TlsMode, Value,
};
use std::time::Duration;

/// The TCP settings of every socket to Valkey: the URL's own, plus `TCP_USER_TIMEOUT` at twice
/// the command timeout (a command that waits longer has failed anyway; the margin keeps a slow
/// but live link from being cut under a command still within its time).
pub fn tcp_settings(base: &TcpSettings, timeout: Duration) -> TcpSettings {
    base.clone().set_user_timeout(timeout * 2)
}

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
    Cluster {
        client: redis::cluster::ClusterClient,
        timeout: Duration,
    },
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
            Self::Cluster { .. } => "ValkeyTarget::Cluster",
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
            .map(|u| {
                let info = u.into_connection_info()?;
                let tcp = tcp_settings(info.tcp_settings(), timeout);
                Ok(info.set_tcp_settings(tcp))
            })
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
                let tcp = tcp_settings(infos[0].tcp_settings(), timeout);
                let mut builder = redis::cluster::ClusterClientBuilder::new(infos)
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .tcp_settings(tcp)
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
                Ok(Self::Cluster { client, timeout })
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
                .set_client_to_redis_tcp_settings(tcp_settings(infos[0].tcp_settings(), timeout))
                .set_client_to_sentinel_tcp_settings(tcp_settings(infos[0].tcp_settings(), timeout))
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
                let db = client.get_connection_info().redis_settings().db();
                let link = Link::new(link::Source::Direct(client), timeout, db);
                link.current().await?;
                Ok(ValkeyConnection::Single(link))
            }
            Self::Cluster { client, timeout } => {
                let link = ClusterLink::new(client, timeout);
                link.current().await?;
                Ok(ValkeyConnection::Cluster(link))
            }
            Self::Sentinel {
                client,
                db,
                timeout,
            } => {
                let link = Link::new(link::Source::Sentinel(client), timeout, db);
                link.current().await?;
                Ok(ValkeyConnection::Sentinel(link))
            }
        }
    }
}

/// One connection to Valkey, whatever its topology. Cheap to clone; clones share the
/// underlying connections.
#[derive(Clone)]
pub enum ValkeyConnection {
    Single(Link),
    Cluster(ClusterLink),
    Sentinel(Link),
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

    /// Drops the underlying connection, for a caller that gave up on a command by its own
    /// timeout or saw it fail: the next command (of any clone) makes a new one, so nothing
    /// queues behind a stalled socket (a cluster's new connection reads the slot map afresh).
    pub fn reset(&self) {
        match self {
            Self::Single(link) | Self::Sentinel(link) => link.reset(),
            Self::Cluster(link) => link.reset(),
        }
    }

    /// Connections made again after a failure or a reset.
    pub fn reconnects(&self) -> u64 {
        match self {
            Self::Single(link) | Self::Sentinel(link) => link.reconnects(),
            Self::Cluster(link) => link.reconnects(),
        }
    }

    /// Runs `cmd` on every primary: on the one server, on the current primary, or on each
    /// primary of the cluster. Returns (node, reply) pairs; the node is `None` outside a
    /// cluster. An error of the whole call means no node could be asked.
    pub async fn on_each_primary<T: FromRedisValue>(
        &mut self,
        cmd: &Cmd,
    ) -> RedisResult<Vec<(Option<String>, RedisResult<T>)>> {
        let Self::Cluster(link) = self else {
            return Ok(vec![(None, cmd.query_async(self).await)]);
        };
        // No response policy: the reply is a map of node address to that node's reply.
        let reply = link
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
            Self::Sentinel(c) => c.db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valkey_sockets_give_up_at_twice_the_command_timeout() {
        let tcp = tcp_settings(&TcpSettings::default(), Duration::from_secs(5));
        assert_eq!(tcp.user_timeout(), Some(Duration::from_secs(10)));
        let target = ValkeyTarget::new(
            "redis://127.0.0.1:1",
            &Topology::Single,
            Duration::from_secs(2),
            None,
        )
        .unwrap();
        let ValkeyTarget::Single { client, .. } = target else {
            panic!("one URL is one server");
        };
        assert_eq!(
            client.get_connection_info().tcp_settings().user_timeout(),
            Some(Duration::from_secs(4))
        );
    }
}
