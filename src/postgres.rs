//! Connections to PostgreSQL: one URL gives both the SQL connections (setup, poller, status)
//! and the replication connection's parameters. Session settings are pinned so timestamps come
//! out the same on both paths (`DateStyle=ISO`, `TimeZone=UTC`).
//!
//! TLS follows libpq's `sslmode`, `sslrootcert`, `sslcert` and `sslkey` parameters on both
//! paths (see [`crate::tls`]); tokio-postgres does not know the last three, so they are taken
//! out of the connection string before it parses the rest. Under `prefer`, as in libpq, a TLS
//! handshake that fails is retried once without TLS (tokio-postgres alone falls back only when
//! the server declines TLS); the replication stream does the same.

use crate::tls::{PgTls, SslMode};
use futures::TryFutureExt;
use pgwire_replication::ReplicationConfig;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Session settings for every connection, SQL and replication alike.
pub const SESSION_OPTIONS: &str = "-c DateStyle=ISO -c TimeZone=UTC -c IntervalStyle=iso_8601";

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
        config
            .ssl_mode(match tls.mode {
                SslMode::Disable => tokio_postgres::config::SslMode::Disable,
                SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
                _ => tokio_postgres::config::SslMode::Require,
            })
            .options(SESSION_OPTIONS)
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

    /// Connects as `sslmode` says. Under `prefer`, a TLS handshake that fails (a server whose
    /// TLS the relay cannot speak, a certificate it cannot use) is followed by one attempt
    /// without TLS, as libpq does; stricter modes fail.
    async fn open(&self) -> Result<Connected, tokio_postgres::Error> {
        match self.config.connect(self.connector.clone()).await {
            Err(e) if self.tls.mode == SslMode::Prefer && failed_in_tls_handshake(&e) => {
                self.log_fallback(&e);
                let mut plain = self.config.clone();
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

    /// `user@host:port/db`, no password: safe for logs.
    pub fn display(&self) -> String {
        let host = match self.config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            Some(Host::Unix(p)) => p.display().to_string(),
            None => "?".into(),
        };
        format!(
            "{}@{}:{}/{}",
            self.config.get_user().unwrap_or("?"),
            host,
            self.port(),
            self.dbname()
        )
    }

    fn port(&self) -> u16 {
        self.config.get_ports().first().copied().unwrap_or(5432)
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

    /// Replication connection parameters for `slot` and `publication`.
    pub fn replication(&self, slot: &str, publication: &str) -> ReplicationConfig {
        let password = self
            .config
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        let base = match self.config.get_hosts().first() {
            Some(Host::Unix(dir)) => ReplicationConfig::unix(
                dir.display().to_string(),
                self.port(),
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
            .with_port(self.port())
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
}
