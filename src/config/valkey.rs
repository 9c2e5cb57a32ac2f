//! The Valkey settings: `OUTBOX_VALKEY_URL` (or a file holding it), or the Go kit's `VALKEY_*`
//! settings; the topology (one server, cluster, sentinels) and the TLS files.

use super::parse::parse_positive_duration;
use super::secret::{redact_url, Secret};
use super::ConfigError;
use crate::sink::valkey::ReplicaWait;
use crate::valkey::{split_urls, Topology, ValkeyTarget};
use clap::Args;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Valkey connection: `OUTBOX_VALKEY_URL`, or the Go kit's `VALKEY_*` settings.
#[derive(Debug, Clone, Args)]
pub struct ValkeyArgs {
    /// Valkey/Redis URL (redis://[user:password@]host:port/db). When unset, VALKEY_ADDR,
    /// VALKEY_PASSWORD and VALKEY_DB are used, as the Go kit does.
    #[arg(
        long,
        env = "OUTBOX_VALKEY_URL",
        hide_env_values = true,
        conflicts_with = "valkey_url_file",
        value_parser = Secret::value_parser()
    )]
    pub valkey_url: Option<Secret>,
    /// A file holding the Valkey URL(s) instead (a mounted secret; a trailing newline is
    /// ignored).
    #[arg(long, env = "OUTBOX_VALKEY_URL_FILE", value_name = "PATH", value_parser = Secret::file_parser())]
    pub valkey_url_file: Option<Secret>,
    /// host:port, used when OUTBOX_VALKEY_URL is unset.
    #[arg(long, env = "VALKEY_ADDR", default_value = "localhost:6379")]
    pub valkey_addr: String,
    /// Password, used when OUTBOX_VALKEY_URL is unset.
    #[arg(
        long,
        env = "VALKEY_PASSWORD",
        hide_env_values = true,
        conflicts_with = "valkey_password_file",
        value_parser = Secret::value_parser()
    )]
    pub valkey_password: Option<Secret>,
    /// A file holding the password instead (a trailing newline is ignored).
    #[arg(long, env = "VALKEY_PASSWORD_FILE", value_name = "PATH", value_parser = Secret::file_parser())]
    pub valkey_password_file: Option<Secret>,
    /// Database number, used when OUTBOX_VALKEY_URL is unset.
    #[arg(long, env = "VALKEY_DB", default_value_t = 0)]
    pub valkey_db: u32,
    /// How long one Valkey command may take before it counts as failed.
    #[arg(long, env = "OUTBOX_VALKEY_TIMEOUT", default_value = "5s", value_parser = parse_positive_duration)]
    pub valkey_timeout: Duration,
    /// Replicas that must acknowledge each write (Valkey's WAIT) before the relay counts its
    /// tasks delivered; 0 trusts the primary's answer. One server or sentinels, not a cluster.
    #[arg(long, env = "OUTBOX_VALKEY_WAIT_REPLICAS", default_value_t = 0)]
    pub valkey_wait_replicas: u32,
    /// How long a write waits for those replicas; fewer in time fails the write, which is sent
    /// again. Less than OUTBOX_VALKEY_TIMEOUT.
    #[arg(long, env = "OUTBOX_VALKEY_WAIT_TIMEOUT", default_value = "500ms", value_parser = parse_positive_duration)]
    pub valkey_wait_timeout: Duration,
    /// Valkey/Redis Cluster: the URLs (comma-separated) are seed nodes; one reachable node is
    /// enough to find the others.
    #[arg(long, env = "OUTBOX_VALKEY_CLUSTER", default_value_t = false, action = clap::ArgAction::Set)]
    pub valkey_cluster: bool,
    /// Sentinel: connect to the primary the sentinels know by this name; the URLs
    /// (comma-separated) are then the sentinels', their user, password and database the primary's.
    #[arg(long, env = "OUTBOX_VALKEY_SENTINEL_MASTER")]
    pub valkey_sentinel_master: Option<String>,
    /// Password of the sentinels themselves, when they require one.
    #[arg(
        long,
        env = "OUTBOX_VALKEY_SENTINEL_PASSWORD",
        hide_env_values = true,
        conflicts_with = "valkey_sentinel_password_file",
        value_parser = Secret::value_parser()
    )]
    pub valkey_sentinel_password: Option<Secret>,
    /// A file holding the sentinels' password instead (a trailing newline is ignored).
    #[arg(long, env = "OUTBOX_VALKEY_SENTINEL_PASSWORD_FILE", value_name = "PATH", value_parser = Secret::file_parser())]
    pub valkey_sentinel_password_file: Option<Secret>,
    /// PEM file of the CA certificates that sign Valkey's TLS certificate (rediss:// URLs;
    /// without it, Mozilla's root certificates are trusted).
    #[arg(long, env = "OUTBOX_VALKEY_CA_FILE", value_name = "PATH")]
    pub valkey_ca_file: Option<PathBuf>,
    /// PEM client certificate (chain), for a Valkey with `tls-auth-clients`; with the key file.
    #[arg(
        long,
        env = "OUTBOX_VALKEY_CLIENT_CERT_FILE",
        value_name = "PATH",
        requires = "valkey_client_key_file"
    )]
    pub valkey_client_cert_file: Option<PathBuf>,
    /// PEM private key of the client certificate.
    #[arg(
        long,
        env = "OUTBOX_VALKEY_CLIENT_KEY_FILE",
        value_name = "PATH",
        requires = "valkey_client_cert_file"
    )]
    pub valkey_client_key_file: Option<PathBuf>,
}

impl ValkeyArgs {
    /// The URL to connect to, or the comma-separated URLs of cluster nodes or sentinels (may
    /// contain a password: never log it).
    pub fn url(&self) -> String {
        if let Some(url) = self.given_url() {
            return url.value().to_owned();
        }
        let password = Secret::either(&self.valkey_password, &self.valkey_password_file);
        let auth = match password.map(Secret::value) {
            Some(p) if !p.is_empty() => format!(":{}@", percent_encode(p)),
            _ => String::new(),
        };
        split_urls(&self.valkey_addr)
            .iter()
            .map(|addr| format!("redis://{auth}{addr}/{}", self.valkey_db))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How the URLs are used: one server, cluster seed nodes, or sentinels.
    pub fn topology(&self) -> Topology {
        match &self.valkey_sentinel_master {
            Some(master) => Topology::Sentinel {
                master: master.clone(),
                password: Secret::either(
                    &self.valkey_sentinel_password,
                    &self.valkey_sentinel_password_file,
                )
                .map(|p| p.value().to_owned()),
            },
            None if self.valkey_cluster => Topology::Cluster,
            None => Topology::Single,
        }
    }

    /// The validated target in its topology (no connection yet).
    pub fn target(&self) -> Result<ValkeyTarget, ConfigError> {
        if self.valkey_cluster && self.valkey_sentinel_master.is_some() {
            return Err(ConfigError::Invalid {
                setting: "OUTBOX_VALKEY_CLUSTER".into(),
                reason: "a cluster is not reached through sentinels: unset OUTBOX_VALKEY_CLUSTER \
                         or OUTBOX_VALKEY_SENTINEL_MASTER"
                    .into(),
            });
        }
        let setting = self.url_setting().to_owned();
        crate::tls::install_default_provider();
        let certs = self.tls_certificates()?;
        ValkeyTarget::new(&self.url(), &self.topology(), self.valkey_timeout, certs)
            .map_err(|reason| ConfigError::Invalid { setting, reason })
    }

    /// The replicas each write must reach (`None` with OUTBOX_VALKEY_WAIT_REPLICAS=0).
    pub fn replica_wait(&self) -> Result<Option<ReplicaWait>, ConfigError> {
        if self.valkey_wait_replicas == 0 {
            return Ok(None);
        }
        if self.valkey_cluster {
            // A cluster's pipelines go to each queue's shard, and WAIT (no key) would reach
            // some node, not the shards written.
            return Err(ConfigError::Invalid {
                setting: "OUTBOX_VALKEY_WAIT_REPLICAS".into(),
                reason: "not supported with OUTBOX_VALKEY_CLUSTER: use min-replicas-to-write on \
                         the shards"
                    .into(),
            });
        }
        if self.valkey_wait_timeout >= self.valkey_timeout {
            return Err(ConfigError::Invalid {
                setting: "OUTBOX_VALKEY_WAIT_TIMEOUT".into(),
                reason: format!(
                    "{:?} is not less than OUTBOX_VALKEY_TIMEOUT ({:?}): the write would time \
                     out before WAIT answers",
                    self.valkey_wait_timeout, self.valkey_timeout
                ),
            });
        }
        Ok(Some(ReplicaWait {
            replicas: self.valkey_wait_replicas,
            timeout: self.valkey_wait_timeout,
        }))
    }

    /// OUTBOX_VALKEY_URL, or the contents of OUTBOX_VALKEY_URL_FILE.
    fn given_url(&self) -> Option<&Secret> {
        Secret::either(&self.valkey_url, &self.valkey_url_file)
    }

    /// The setting the URL comes from, for messages.
    fn url_setting(&self) -> &str {
        self.given_url()
            .map_or("VALKEY_ADDR/VALKEY_PASSWORD/VALKEY_DB", Secret::setting)
    }

    /// The CA and client certificate files, read and checked, for `rediss://` URLs. `None`
    /// when neither is set (a `rediss://` URL then trusts Mozilla's root certificates).
    pub fn tls_certificates(&self) -> Result<Option<redis::TlsCertificates>, ConfigError> {
        if self.valkey_ca_file.is_none() && self.valkey_client_cert_file.is_none() {
            return Ok(None);
        }
        let setting = if self.valkey_ca_file.is_some() {
            "OUTBOX_VALKEY_CA_FILE"
        } else {
            "OUTBOX_VALKEY_CLIENT_CERT_FILE"
        };
        let tls_url = self.given_url().is_some_and(|urls| {
            urls.value()
                .split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .all(|u| u.starts_with("rediss://") || u.starts_with("valkeys://"))
        });
        if !tls_url {
            return Err(ConfigError::Invalid {
                setting: setting.into(),
                reason: "TLS needs rediss:// (or valkeys://) URLs in OUTBOX_VALKEY_URL".into(),
            });
        }
        let root_cert = match &self.valkey_ca_file {
            Some(path) => Some(read_pem(path, "OUTBOX_VALKEY_CA_FILE", &|p| {
                crate::tls::root_store_from_file(p, "file").map(drop)
            })?),
            None => None,
        };
        let client_tls = match (&self.valkey_client_cert_file, &self.valkey_client_key_file) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: read_pem(cert, "OUTBOX_VALKEY_CLIENT_CERT_FILE", &|p| {
                    crate::tls::load_certs(p, "file").map(drop)
                })?,
                client_key: read_pem(key, "OUTBOX_VALKEY_CLIENT_KEY_FILE", &|p| {
                    crate::tls::load_key(p, "file").map(drop)
                })?,
            }),
            _ => None,
        };
        Ok(Some(redis::TlsCertificates {
            client_tls,
            root_cert,
        }))
    }

    /// Where Valkey is, without credentials, for messages.
    pub fn display(&self) -> String {
        let at = match self.given_url() {
            Some(url) => split_urls(url.value())
                .into_iter()
                .map(redact_url)
                .collect::<Vec<_>>()
                .join(","),
            None => self.valkey_addr.clone(),
        };
        match self.topology() {
            Topology::Single => at,
            Topology::Cluster => format!("{at} (cluster)"),
            Topology::Sentinel { master, .. } => format!("{at} (sentinels of {master})"),
        }
    }
}

/// A PEM file's bytes for redis, after `check` parsed them too, so that a bad file is named
/// (redis parses the same bytes again).
fn read_pem(
    path: &Path,
    setting: &'static str,
    check: &dyn Fn(&Path) -> Result<(), String>,
) -> Result<Vec<u8>, ConfigError> {
    let invalid = |reason| ConfigError::Invalid {
        setting: setting.into(),
        reason,
    };
    check(path).map_err(invalid)?;
    std::fs::read(path).map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One server from the kit's settings, with nothing else set.
    fn kit(addr: &str, password: Option<&str>, db: u32) -> ValkeyArgs {
        ValkeyArgs {
            valkey_url: None,
            valkey_url_file: None,
            valkey_addr: addr.into(),
            valkey_password: password.map(|p| Secret::given("VALKEY_PASSWORD", p)),
            valkey_password_file: None,
            valkey_db: db,
            valkey_timeout: Duration::from_secs(1),
            valkey_wait_replicas: 0,
            valkey_wait_timeout: Duration::from_millis(500),
            valkey_cluster: false,
            valkey_sentinel_master: None,
            valkey_sentinel_password: None,
            valkey_sentinel_password_file: None,
            valkey_ca_file: None,
            valkey_client_cert_file: None,
            valkey_client_key_file: None,
        }
    }

    #[test]
    fn a_replica_wait_is_refused_on_a_cluster_and_past_the_valkey_timeout() {
        let mut args = kit("localhost:6379", None, 0);
        assert_eq!(args.replica_wait().unwrap(), None);
        args.valkey_wait_replicas = 1;
        assert_eq!(
            args.replica_wait().unwrap(),
            Some(ReplicaWait {
                replicas: 1,
                timeout: Duration::from_millis(500)
            })
        );
        args.valkey_wait_timeout = Duration::from_secs(1);
        let err = args.replica_wait().unwrap_err().to_string();
        assert!(err.contains("OUTBOX_VALKEY_WAIT_TIMEOUT"), "{err}");
        args.valkey_wait_timeout = Duration::from_millis(500);
        args.valkey_cluster = true;
        let err = args.replica_wait().unwrap_err().to_string();
        assert!(err.contains("OUTBOX_VALKEY_WAIT_REPLICAS"), "{err}");
    }

    fn url(urls: &str) -> Option<Secret> {
        Some(Secret::given("OUTBOX_VALKEY_URL", urls))
    }

    #[test]
    fn valkey_url_from_the_kit_settings() {
        let v = kit("cache:6380", Some("p@ss word"), 3);
        assert_eq!(v.url(), "redis://:p%40ss%20word@cache:6380/3");
        assert!(v.target().is_ok());
        assert!(!v.display().contains("ss"));
        let v = ValkeyArgs {
            valkey_url: url("redis://u:secret@h:1/0"),
            ..v
        };
        assert_eq!(v.display(), "redis://u:***@h:1/0");
    }

    #[test]
    fn valkey_cluster_and_sentinel_url_lists() {
        let single = ValkeyArgs {
            valkey_url: url("redis://:pw@a:1, redis://:pw@b:2"),
            ..kit("localhost:6379", None, 0)
        };
        // A list needs a topology that uses one.
        assert!(single.target().is_err());
        let cluster = ValkeyArgs {
            valkey_cluster: true,
            ..single.clone()
        };
        assert!(cluster.target().is_ok());
        assert_eq!(
            cluster.display(),
            "redis://:***@a:1,redis://:***@b:2 (cluster)"
        );
        let sentinel = ValkeyArgs {
            valkey_sentinel_master: Some("mymaster".into()),
            valkey_sentinel_password: Some(Secret::given(
                "OUTBOX_VALKEY_SENTINEL_PASSWORD",
                "sentinel-secret",
            )),
            ..single.clone()
        };
        assert!(sentinel.target().is_ok());
        assert!(!sentinel.display().contains("pw") && !sentinel.display().contains("secret"));
        assert!(sentinel.display().ends_with("(sentinels of mymaster)"));
        let both = ValkeyArgs {
            valkey_cluster: true,
            ..sentinel.clone()
        };
        assert!(both.target().is_err());
        // The kit's VALKEY_ADDR may list several nodes too.
        let kit = ValkeyArgs {
            valkey_cluster: true,
            ..kit("a:1,b:2", Some("p"), 0)
        };
        assert_eq!(kit.url(), "redis://:p@a:1/0,redis://:p@b:2/0");
        assert!(kit.target().is_ok());
    }

    #[test]
    fn errors_name_the_setting_the_url_came_from() {
        let bad = |secret: Secret| ValkeyArgs {
            valkey_url_file: Some(secret),
            ..kit("localhost:6379", None, 0)
        };
        let err = bad(Secret::given("OUTBOX_VALKEY_URL_FILE", "http://nope"))
            .target()
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("invalid OUTBOX_VALKEY_URL_FILE: "),
            "{err}"
        );
    }
}
