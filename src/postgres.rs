//! Connections to PostgreSQL: one URL gives both the SQL connections (setup, poller, status)
//! and the replication connection's parameters. Session settings are pinned so timestamps come
//! out the same on both paths (`DateStyle=ISO`, `TimeZone=UTC`).
//!
//! TLS follows libpq's `sslmode`, `sslrootcert`, `sslcert` and `sslkey` parameters on both
//! paths (see [`crate::tls`]); tokio-postgres does not know the last three, so they are taken
//! out of the connection string before it parses the rest. Under `prefer`, as in libpq, a TLS
//! handshake that fails is retried once without TLS (tokio-postgres alone falls back only when
//! the server declines TLS); the replication stream does the same.
//!
//! A URL may name several hosts, as libpq's (`host=a,b port=5432,5433` or
//! `postgres://a:5432,b:5433/db?target_session_attrs=read-write`). SQL connections try them in
//! order and take the first that fits `target_session_attrs`; that host is remembered, and the
//! replication connection (which takes one host) goes to it. The stream opens an SQL connection
//! (the slot check) right before each replication session, so after a failover it follows the
//! new primary.

use crate::tls::{PgTls, SslMode};
use futures::TryFutureExt;
use pgwire_replication::ReplicationConfig;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::config::Host;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::Socket;
use tokio_postgres_rustls::MakeRustlsConnect;

/// The stream of an SQL connection (TLS or not, as negotiated).
pub type PgStream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// An SQL connection and the driver the caller polls.
type Connected = (
    tokio_postgres::Client,
    tokio_postgres::Connection<Socket, PgStream>,
);

/// Session settings for every connection, SQL and replication alike. READ COMMITTED whatever
/// the database's or the role's default (found by review): under REPEATABLE READ or SERIALIZABLE
/// a poll round's `FOR UPDATE SKIP LOCKED` fails (40001) on a row another poller or the marker
/// changed after the claim's snapshot, and so do the marker's UPDATEs, where READ COMMITTED
/// re-checks the row instead. (The backslash escapes the space, as in libpq's `options`.)
pub const SESSION_OPTIONS: &str = "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601 \
     -c default_transaction_isolation=read\\ committed";

/// The application_name the relay's sessions carry (seen in pg_stat_activity).
pub const APPLICATION_NAME: &str = "outbox-relay";

#[derive(Debug, thiserror::Error)]
pub enum PgError {
    #[error("not a valid PostgreSQL URL: {0}")]
    InvalidUrl(String),
    #[error("postgres connection failed")]
    Connection(#[from] tokio_postgres::Error),
    #[error("cannot connect to PostgreSQL at {target}")]
    Connect {
        target: String,
        #[source]
        source: tokio_postgres::Error,
    },
}

/// A parsed database URL.
#[derive(Clone)]
pub struct PgTarget {
    config: tokio_postgres::Config,
    tls: PgTls,
    connector: MarkedTls,
    /// Whether a `prefer` fallback to plain TCP was logged at warn level yet (once per target).
    fallback_logged: Arc<AtomicBool>,
    /// How long a link may stay silent before it counts as dead.
    link_timeout: Duration,
    /// Of several hosts, the index of the one the last SQL connection was made to.
    chosen_host: Arc<AtomicUsize>,
}

impl std::fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PgTarget({})", self.display())
    }
}

impl PgTarget {
    pub fn parse(url: &str) -> Result<Self, PgError> {
        let (rest, ssl) = take_ssl_params(url).map_err(PgError::InvalidUrl)?;
        let mut config = tokio_postgres::Config::from_str(&rest)
            .map_err(|e| PgError::InvalidUrl(e.to_string()))?;
        if config.get_hosts().is_empty() {
            return Err(PgError::InvalidUrl("no host given".into()));
        }
        if config.get_user().is_none() {
            return Err(PgError::InvalidUrl("no user given".into()));
        }
        let param = |k: &str| {
            ssl.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        let mut tls = PgTls::from_params(
            param("sslmode"),
            param("sslrootcert"),
            param("sslcert"),
            param("sslkey"),
        )
        .map_err(PgError::InvalidUrl)?;
        // PostgreSQL has no TLS on Unix sockets; libpq ignores sslmode there.
        if config
            .get_hosts()
            .iter()
            .all(|h| !matches!(h, Host::Tcp(_)))
        {
            tls.mode = SslMode::Disable;
        }
        // The URL's own `options` (an operator's `-c statement_timeout=...`) are kept; the
        // relay's come after them, so the formats it parses win (found by review: they were
        // replaced). The replication connection carries the relay's only: a walsender is no
        // place for an operator's statement or lock timeouts.
        let options = match config.get_options() {
            Some(theirs) if !theirs.trim().is_empty() => format!("{theirs} {SESSION_OPTIONS}"),
            _ => SESSION_OPTIONS.to_owned(),
        };
        config
            .ssl_mode(match tls.mode {
                SslMode::Disable => tokio_postgres::config::SslMode::Disable,
                SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
                _ => tokio_postgres::config::SslMode::Require,
            })
            .options(&options)
            .application_name(APPLICATION_NAME)
            .connect_timeout(Duration::from_secs(10));
        set_link_timeout(&mut config, DEFAULT_LINK_TIMEOUT);
        let connector = MarkedTls(MakeRustlsConnect::new(
            tls.client_config().map_err(PgError::InvalidUrl)?,
        ));
        Ok(Self {
            config,
            tls,
            connector,
            fallback_logged: Arc::new(AtomicBool::new(false)),
            link_timeout: DEFAULT_LINK_TIMEOUT,
            chosen_host: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Gives up on an SQL socket that stays silent for `timeout` (see [`set_link_timeout`]).
    pub fn with_link_timeout(mut self, timeout: Duration) -> Self {
        set_link_timeout(&mut self.config, timeout);
        self.link_timeout = timeout;
        self
    }

    /// How long a link may stay silent before it counts as dead.
    pub fn link_timeout(&self) -> Duration {
        self.link_timeout
    }

    /// How many hosts the URL names.
    pub fn host_count(&self) -> usize {
        self.config.get_hosts().len()
    }

    /// The configuration for host `i` alone (its port, or the only port given), with every
    /// other setting of the URL, `target_session_attrs` included.
    fn single_host(&self, i: usize) -> tokio_postgres::Config {
        let from = &self.config;
        let mut c = tokio_postgres::Config::new();
        match &from.get_hosts()[i] {
            Host::Tcp(h) => c.host(h),
            Host::Unix(p) => c.host_path(p),
        };
        if let Some(addr) = from.get_hostaddrs().get(i) {
            c.hostaddr(*addr);
        }
        let ports = from.get_ports();
        if let Some(port) = ports.get(i).or(ports.first().filter(|_| ports.len() == 1)) {
            c.port(*port);
        }
        if let Some(user) = from.get_user() {
            c.user(user);
        }
        if let Some(password) = from.get_password() {
            c.password(password);
        }
        if let Some(db) = from.get_dbname() {
            c.dbname(db);
        }
        if let Some(options) = from.get_options() {
            c.options(options);
        }
        if let Some(name) = from.get_application_name() {
            c.application_name(name);
        }
        if let Some(t) = from.get_connect_timeout() {
            c.connect_timeout(*t);
        }
        if let Some(t) = from.get_tcp_user_timeout() {
            c.tcp_user_timeout(*t);
        }
        c.keepalives(from.get_keepalives())
            .keepalives_idle(from.get_keepalives_idle());
        if let Some(t) = from.get_keepalives_interval() {
            c.keepalives_interval(t);
        }
        if let Some(n) = from.get_keepalives_retries() {
            c.keepalives_retries(n);
        }
        c.ssl_mode(from.get_ssl_mode())
            .ssl_negotiation(from.get_ssl_negotiation())
            .channel_binding(from.get_channel_binding())
            .target_session_attrs(from.get_target_session_attrs());
        c
    }

    /// Connects as `sslmode` says. Under `prefer`, a TLS handshake that fails (a server whose
    /// TLS the relay cannot speak, a certificate it cannot use) is followed by one attempt
    /// without TLS, as libpq does; stricter modes fail.
    async fn open(&self) -> Result<Connected, tokio_postgres::Error> {
        if self.host_count() < 2 {
            return self.open_with(&self.config).await;
        }
        // Host by host, as libpq does, so that the one chosen is known.
        let mut last = None;
        for i in 0..self.host_count() {
            match self.open_with(&self.single_host(i)).await {
                Ok(connected) => {
                    if self.chosen_host.swap(i, Ordering::Relaxed) != i {
                        tracing::info!(target_db = %self.display_host(i), "postgres host chosen");
                    }
                    return Ok(connected);
                }
                Err(e) => {
                    tracing::debug!(target_db = %self.display_host(i), error = %e,
                        "postgres host not usable; trying the next");
                    last = Some(e);
                }
            }
        }
        Err(last.expect("at least two hosts were tried"))
    }

    async fn open_with(
        &self,
        config: &tokio_postgres::Config,
    ) -> Result<Connected, tokio_postgres::Error> {
        match config.connect(self.connector.clone()).await {
            Err(e) if self.tls.mode == SslMode::Prefer && failed_in_tls_handshake(&e) => {
                self.log_fallback(&e);
                let mut plain = config.clone();
                plain.ssl_mode(tokio_postgres::config::SslMode::Disable);
                plain.connect(self.connector.clone()).await
            }
            other => other,
        }
    }

    /// Logs a `prefer` fallback: at warn level the first time, then at debug level.
    pub fn log_fallback(&self, error: &dyn std::fmt::Display) {
        if self.fallback_logged.swap(true, Ordering::Relaxed) {
            tracing::debug!(target_db = %self.display(), error = %error,
                "TLS handshake failed; sslmode=prefer: connecting without TLS");
        } else {
            tracing::warn!(target_db = %self.display(), error = %error,
                "TLS handshake failed; sslmode=prefer: connecting without TLS (use sslmode=require \
                 or stricter to refuse unencrypted connections)");
        }
    }

    /// The TLS settings in effect.
    pub fn tls(&self) -> &PgTls {
        &self.tls
    }

    /// `user@host:port/db` (the hosts comma-separated), no password: safe for logs.
    pub fn display(&self) -> String {
        let hosts: Vec<String> = (0..self.host_count())
            .map(|i| format!("{}:{}", self.host_name(i), self.port_of(i)))
            .collect();
        format!(
            "{}@{}/{}",
            self.config.get_user().unwrap_or("?"),
            if hosts.is_empty() {
                "?".to_owned()
            } else {
                hosts.join(",")
            },
            self.dbname()
        )
    }

    /// [`Self::display`] for host `i` alone.
    fn display_host(&self, i: usize) -> String {
        format!(
            "{}@{}:{}/{}",
            self.config.get_user().unwrap_or("?"),
            self.host_name(i),
            self.port_of(i),
            self.dbname()
        )
    }

    fn host_name(&self, i: usize) -> String {
        match self.config.get_hosts().get(i) {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => p.display().to_string(),
            None => "?".into(),
        }
    }

    /// Host `i`'s port: its own, or the only one given, or 5432.
    fn port_of(&self, i: usize) -> u16 {
        let ports = self.config.get_ports();
        match ports.len() {
            0 => 5432,
            1 => ports[0],
            _ => ports.get(i).copied().unwrap_or(5432),
        }
    }

    fn dbname(&self) -> &str {
        self.config
            .get_dbname()
            .or(self.config.get_user())
            .unwrap_or("postgres")
    }

    pub fn user(&self) -> &str {
        self.config.get_user().unwrap_or("postgres")
    }

    /// A plain SQL connection; its driver task runs in the background until the client drops.
    pub async fn connect(&self) -> Result<tokio_postgres::Client, PgError> {
        let (client, conn) = self.open().await.map_err(|source| PgError::Connect {
            target: self.display(),
            source,
        })?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "postgres connection closed");
            }
        });
        Ok(client)
    }

    /// A connection whose driver the caller polls (for LISTEN/NOTIFY).
    pub async fn connect_raw(&self) -> Result<Connected, PgError> {
        self.open().await.map_err(|source| PgError::Connect {
            target: self.display(),
            source,
        })
    }

    /// A pool of SQL connections for the poller and periodic queries.
    pub fn pool(&self, size: usize) -> deadpool_postgres::Pool {
        let mgr = deadpool_postgres::Manager::from_connect(
            self.config.clone(),
            PoolConnect(self.clone()),
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        // Waiting for a connection, making one and checking one back out are each bounded, so
        // no caller waits on a dead link for longer than the link timeout.
        deadpool_postgres::Pool::builder(mgr)
            .max_size(size)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(self.link_timeout))
            .create_timeout(Some(self.link_timeout))
            .recycle_timeout(Some(self.link_timeout))
            .build()
            .expect("a pool with the tokio runtime set always builds")
    }

    /// Replication connection parameters for `slot` and `publication`, to the host the last SQL
    /// connection chose (the first host until one was made).
    pub fn replication(&self, slot: &str, publication: &str) -> ReplicationConfig {
        let password = self
            .config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        let i = self
            .chosen_host
            .load(Ordering::Relaxed)
            .min(self.host_count().saturating_sub(1));
        let base = match self.config.get_hosts().get(i) {
            Some(Host::Unix(dir)) => ReplicationConfig::unix(
                dir.display().to_string(),
                self.port_of(i),
                self.user(),
                password,
                self.dbname(),
                slot,
                publication,
            ),
            Some(Host::Tcp(host)) => ReplicationConfig::new(
                host.clone(),
                self.user(),
                password,
                self.dbname(),
                slot,
                publication,
            )
            .with_port(self.port_of(i))
            .with_tls(self.tls.replication(host)),
            None => unreachable!("parse() refuses URLs without a host"),
        };
        base.with_options(SESSION_OPTIONS)
            .with_application_name(APPLICATION_NAME)
    }
}

/// How long a link may stay silent before it counts as dead, unless configured
/// (`OUTBOX_LINK_TIMEOUT`).
pub const DEFAULT_LINK_TIMEOUT: Duration = Duration::from_secs(30);

/// Makes an SQL socket give up on a dead peer within `timeout`: `TCP_USER_TIMEOUT` closes it when
/// data it sent stays unacknowledged that long (a query to a black-holed server), and TCP
/// keepalive probes an idle one from a third of it, every sixth, three times (an idle pooled
/// connection whose peer vanished). Without them a black-holed connection waits for the
/// kernel's retransmission limit (about 15 minutes), or forever when idle.
pub fn set_link_timeout(config: &mut tokio_postgres::Config, timeout: Duration) {
    let idle = (timeout / 3).max(Duration::from_secs(1));
    let interval = (timeout / 6).max(Duration::from_secs(1));
    config
        .tcp_user_timeout(timeout)
        .keepalives(true)
        .keepalives_idle(idle)
        .keepalives_interval(interval)
        .keepalives_retries(3);
}

/// The pool's connections, made by [`PgTarget::open`] (with the `prefer` fallback).
struct PoolConnect(PgTarget);

impl deadpool_postgres::Connect for PoolConnect {
    fn connect(
        &self,
        _config: &tokio_postgres::Config,
    ) -> futures::future::BoxFuture<
        '_,
        Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>,
    > {
        Box::pin(async move {
            let (client, conn) = self.0.open().await?;
            let driver = tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "postgres connection closed");
                }
            });
            Ok((client, driver))
        })
    }
}

/// tokio-postgres-rustls's connector, with the errors of its TLS handshake wrapped in
/// [`TlsHandshakeFailed`], so that they can be told from the other connection errors.
#[derive(Clone)]
struct MarkedTls(MakeRustlsConnect);

/// A TLS handshake with PostgreSQL failed; shown as its cause.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TlsHandshakeFailed(Box<dyn std::error::Error + Send + Sync>);

/// Whether `e` came out of the TLS handshake (the error [`MarkedConnect`] wraps), rather than
/// from the TCP connection before it or the authentication after it: under `prefer`, only such
/// a failure is worth a second attempt without TLS.
fn failed_in_tls_handshake(e: &tokio_postgres::Error) -> bool {
    std::error::Error::source(e).is_some_and(|s| s.downcast_ref::<TlsHandshakeFailed>().is_some())
}

impl MakeTlsConnect<Socket> for MarkedTls {
    type Stream = PgStream;
    type TlsConnect = MarkedConnect<<MakeRustlsConnect as MakeTlsConnect<Socket>>::TlsConnect>;
    type Error = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Self::TlsConnect, Self::Error> {
        MakeTlsConnect::<Socket>::make_tls_connect(&mut self.0, domain).map(MarkedConnect)
    }
}

struct MarkedConnect<T>(T);

fn mark<E: Into<Box<dyn std::error::Error + Send + Sync>>>(e: E) -> TlsHandshakeFailed {
    TlsHandshakeFailed(e.into())
}

impl<T: TlsConnect<Socket>> TlsConnect<Socket> for MarkedConnect<T> {
    type Stream = T::Stream;
    type Error = TlsHandshakeFailed;
    type Future = futures::future::MapErr<T::Future, fn(T::Error) -> TlsHandshakeFailed>;

    fn connect(self, stream: Socket) -> Self::Future {
        self.0
            .connect(stream)
            .map_err(mark::<T::Error> as fn(T::Error) -> TlsHandshakeFailed)
    }
}

/// libpq's TLS parameters, which tokio-postgres does not parse (it knows `sslmode` but only up
/// to `require`).
const SSL_PARAMS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// Splits the TLS parameters off a connection string (URL or `key=value` form): the string
/// without them, and their (decoded) values.
fn take_ssl_params(s: &str) -> Result<(String, Vec<(String, String)>), String> {
    let mut taken = Vec::new();
    let trimmed = s.trim_start();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let Some((base, query)) = s.split_once('?') else {
            return Ok((s.to_owned(), taken));
        };
        let mut kept = Vec::new();
        for pair in query.split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let key = percent_decode(k)?;
            if SSL_PARAMS.contains(&key.as_str()) {
                taken.push((key, percent_decode(v)?));
            } else {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, taken));
    }
    let mut kept = Vec::new();
    for (k, v) in key_value_pairs(s)? {
        if SSL_PARAMS.contains(&k.as_str()) {
            taken.push((k, v));
        } else {
            kept.push(format!(
                "{k}='{}'",
                v.replace('\\', "\\\\").replace('\'', "\\'")
            ));
        }
    }
    Ok((kept.join(" "), taken))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or("invalid percent-encoding in the query string")?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "the query string is not UTF-8".to_owned())
}

/// The pairs of a libpq `key=value` connection string: values unquoted (up to whitespace) or
/// in single quotes, with backslash escapes in both.
fn key_value_pairs(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(format!("expected `=` after `{key}`"));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\'') => break,
                    Some('\\') => value.push(chars.next().ok_or("unterminated value")?),
                    Some(c) => value.push(c),
                    None => return Err(format!("unterminated quoted value of `{key}`")),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.push(chars.next().ok_or("unterminated value")?);
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key, value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssl_params_come_off_a_url() {
        let (rest, ssl) = take_ssl_params(
            "postgres://u:p%40ss@h:5/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p%40ss@h:5/db?application_name=x");
        assert_eq!(
            ssl,
            [
                ("sslmode".to_owned(), "verify-full".to_owned()),
                ("sslrootcert".to_owned(), "/etc/ca.pem".to_owned())
            ]
        );
        let (rest, ssl) = take_ssl_params("postgresql://u@h/db?sslmode=disable").unwrap();
        assert_eq!(rest, "postgresql://u@h/db");
        assert_eq!(ssl.len(), 1);
        let (rest, ssl) = take_ssl_params("postgres://u@h/db").unwrap();
        assert_eq!((rest.as_str(), ssl.len()), ("postgres://u@h/db", 0));
    }

    #[test]
    fn ssl_params_come_off_a_key_value_string() {
        let (rest, ssl) = take_ssl_params(
            "host=h user=u password='it\\'s a secret' sslmode = require sslcert='/a b/c.pem' sslkey=/k",
        )
        .unwrap();
        assert_eq!(rest, "host='h' user='u' password='it\\'s a secret'");
        assert_eq!(ssl[0], ("sslmode".to_owned(), "require".to_owned()));
        assert_eq!(ssl[1], ("sslcert".to_owned(), "/a b/c.pem".to_owned()));
        let config = tokio_postgres::Config::from_str(&rest).unwrap();
        assert_eq!(config.get_password(), Some(&b"it's a secret"[..]));
        assert!(take_ssl_params("host=h password='open").is_err());
    }

    #[test]
    fn sql_sockets_and_the_pool_give_up_within_the_link_timeout() {
        let t = PgTarget::parse("postgres://u@127.0.0.1/db").unwrap();
        assert_eq!(t.link_timeout(), DEFAULT_LINK_TIMEOUT);
        let t = t.with_link_timeout(Duration::from_secs(12));
        let c = &t.config;
        assert_eq!(c.get_tcp_user_timeout(), Some(&Duration::from_secs(12)));
        assert!(c.get_keepalives());
        assert_eq!(c.get_keepalives_idle(), Duration::from_secs(4));
        assert_eq!(c.get_keepalives_interval(), Some(Duration::from_secs(2)));
        assert_eq!(c.get_keepalives_retries(), Some(3));
        let timeouts = t.pool(2).timeouts();
        assert_eq!(timeouts.wait, Some(Duration::from_secs(12)));
        assert_eq!(timeouts.create, Some(Duration::from_secs(12)));
        assert_eq!(timeouts.recycle, Some(Duration::from_secs(12)));
    }

    #[test]
    fn targets() {
        let t = PgTarget::parse("postgres://u:secret@127.0.0.1:5/db?sslmode=require").unwrap();
        assert_eq!(t.tls().mode, SslMode::Require);
        assert_eq!(t.display(), "u@127.0.0.1:5/db");
        assert!(!format!("{t:?}").contains("secret"));
        assert_eq!(
            t.replication("s", "p").tls.mode,
            pgwire_replication::SslMode::Require
        );
        let t = PgTarget::parse("postgres://u@127.0.0.1/db").unwrap();
        assert_eq!(t.tls().mode, SslMode::Prefer);
        let t = PgTarget::parse("host=/run/postgresql user=u sslmode=verify-full").unwrap();
        assert_eq!(t.tls().mode, SslMode::Disable, "no TLS on a Unix socket");
        let err = PgTarget::parse("postgres://u@h/db?sslmode=verify-full&sslrootcert=/nope.pem")
            .unwrap_err()
            .to_string();
        assert!(err.contains("sslrootcert /nope.pem"), "{err}");
        assert!(PgTarget::parse("postgres://u@h/db?sslmode=allow").is_err());
    }

    #[test]
    fn the_urls_own_options_are_kept_before_the_relays() {
        let t = PgTarget::parse("postgres://u@h/db?options=-c%20statement_timeout%3D1000").unwrap();
        assert_eq!(
            t.single_host(0).get_options(),
            Some(format!("-c statement_timeout=1000 {SESSION_OPTIONS}").as_str())
        );
        let r = t.replication("s", "p");
        assert_eq!(r.options.as_deref(), Some(SESSION_OPTIONS));
    }

    #[test]
    fn several_hosts_are_tried_one_by_one_and_replication_follows_the_chosen_one() {
        let t = PgTarget::parse(
            "postgres://u:pw@10.0.0.1:5433,db-b:5434/app?target_session_attrs=read-write",
        )
        .unwrap();
        assert_eq!(t.host_count(), 2);
        assert_eq!(t.display(), "u@10.0.0.1:5433,db-b:5434/app");
        let b = t.single_host(1);
        assert_eq!(b.get_hosts(), [Host::Tcp("db-b".into())]);
        assert_eq!(b.get_ports(), [5434]);
        assert_eq!(b.get_password(), Some(&b"pw"[..]));
        assert_eq!(b.get_dbname(), Some("app"));
        assert_eq!(
            b.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
        assert_eq!(b.get_options(), Some(SESSION_OPTIONS));
        let r = t.replication("s", "p");
        assert_eq!((r.host.as_str(), r.port), ("10.0.0.1", 5433));
        t.chosen_host.store(1, Ordering::Relaxed);
        let r = t.replication("s", "p");
        assert_eq!(
            (r.host.as_str(), r.port, r.password.as_str()),
            ("db-b", 5434, "pw")
        );
        // libpq's key=value form; one port for every host.
        let t = PgTarget::parse("host=a,b port=6000 user=u dbname=d").unwrap();
        assert_eq!(t.display(), "u@a:6000,b:6000/d");
        assert_eq!(t.single_host(1).get_ports(), [6000]);
    }
}
