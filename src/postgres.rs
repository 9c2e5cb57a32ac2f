//! Connections to PostgreSQL: one URL gives both the SQL connections (setup, poller, status)
//! and the replication connection's parameters. Session settings are pinned so timestamps come
//! out the same on both paths (`DateStyle=ISO`, `TimeZone=UTC`).

use pgwire_replication::ReplicationConfig;
use std::str::FromStr;
use std::time::Duration;
use tokio_postgres::config::Host;
use tokio_postgres::NoTls;

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
}

impl std::fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PgTarget({})", self.display())
    }
}

impl PgTarget {
    pub fn parse(url: &str) -> Result<Self, PgError> {
        let mut config = tokio_postgres::Config::from_str(url)
            .map_err(|e| PgError::InvalidUrl(e.to_string()))?;
        if config.get_hosts().is_empty() {
            return Err(PgError::InvalidUrl("no host given".into()));
        }
        if config.get_user().is_none() {
            return Err(PgError::InvalidUrl("no user given".into()));
        }
        config
            .options(SESSION_OPTIONS)
            .application_name(APPLICATION_NAME)
            .connect_timeout(Duration::from_secs(10))
            .keepalives_idle(Duration::from_secs(30));
        Ok(Self { config })
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
        let (client, conn) =
            self.config
                .connect(NoTls)
                .await
                .map_err(|source| PgError::Connect {
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
    pub async fn connect_raw(
        &self,
    ) -> Result<
        (
            tokio_postgres::Client,
            tokio_postgres::Connection<tokio_postgres::Socket, tokio_postgres::tls::NoTlsStream>,
        ),
        PgError,
    > {
        self.config
            .connect(NoTls)
            .await
            .map_err(|source| PgError::Connect {
                target: self.display(),
                source,
            })
    }

    /// A pool of SQL connections for the poller and periodic queries.
    pub fn pool(&self, size: usize) -> deadpool_postgres::Pool {
        let mgr = deadpool_postgres::Manager::from_config(
            self.config.clone(),
            NoTls,
            deadpool_postgres::ManagerConfig {
                recycling_method: deadpool_postgres::RecyclingMethod::Fast,
            },
        );
        deadpool_postgres::Pool::builder(mgr)
            .max_size(size)
            .build()
            .expect("a pool without a runtime-specific timeout always builds")
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
            .with_port(self.port()),
            None => unreachable!("parse() refuses URLs without a host"),
        };
        base.with_options(SESSION_OPTIONS)
            .with_application_name(APPLICATION_NAME)
    }
}
