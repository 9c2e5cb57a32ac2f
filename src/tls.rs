//! TLS settings shared by both servers: PostgreSQL's libpq-style `sslmode` (for the SQL
//! connections through tokio-postgres-rustls, and mapped onto pgwire-replication's `TlsConfig`
//! for the replication connection), PEM loading, and the rustls crypto provider.
//!
//! Everything runs on rustls with the `ring` provider, as pgwire-replication does. The redis
//! client builds its rustls configuration from the process-wide default provider, so
//! [`install_default_provider`] runs before any Valkey client is built.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The crypto provider of every TLS connection the relay makes.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes `ring` the process-wide default rustls provider (the redis client needs one; with
/// more than one provider compiled in, rustls does not pick one itself). Idempotent.
pub fn install_default_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// PostgreSQL's `sslmode`, as libpq spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// TLS when the server offers it, without verifying the certificate; plain otherwise.
    /// libpq's default.
    #[default]
    Prefer,
    /// TLS, without verifying the certificate (unless `sslrootcert` is given: then as
    /// `verify-ca`, as libpq does).
    Require,
    /// TLS; the certificate must chain to a trusted root. The host name is not checked.
    VerifyCa,
    /// TLS; the certificate must chain to a trusted root and name the host.
    VerifyFull,
}

impl SslMode {
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "disable" => Self::Disable,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            // libpq's `allow` tries plain first; with no reason to prefer plain, refuse it.
            other => {
                return Err(format!(
                    "sslmode {other:?} is not supported (use disable, prefer, require, verify-ca \
                     or verify-full)"
                ))
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }

    /// Whether the certificate chain is verified.
    pub fn verifies(self) -> bool {
        matches!(self, Self::VerifyCa | Self::VerifyFull)
    }
}

/// Where trusted root certificates come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// Mozilla's root program, compiled in (`webpki-roots`): no `sslrootcert`, or
    /// `sslrootcert=system`.
    Mozilla,
    /// A PEM file of CA certificates (`sslrootcert=/path`).
    File(PathBuf),
}

/// The TLS part of a PostgreSQL connection string (`sslmode`, `sslrootcert`, `sslcert`,
/// `sslkey`), validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgTls {
    /// The mode in effect: `require` with an `sslrootcert` file is `verify-ca`, as in libpq.
    pub mode: SslMode,
    pub roots: RootCerts,
    /// Client certificate chain and key, for `cert` authentication or `clientcert=verify-*`.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

impl Default for PgTls {
    fn default() -> Self {
        Self {
            mode: SslMode::Prefer,
            roots: RootCerts::Mozilla,
            client_cert: None,
        }
    }
}

impl PgTls {
    /// From the libpq parameters (values as given; `None` when absent).
    pub fn from_params(
        sslmode: Option<&str>,
        sslrootcert: Option<&str>,
        sslcert: Option<&str>,
        sslkey: Option<&str>,
    ) -> Result<Self, String> {
        let mut mode = match sslmode {
            Some(m) => SslMode::parse(m)?,
            None => SslMode::Prefer,
        };
        let roots = match sslrootcert {
            None | Some("system") => RootCerts::Mozilla,
            Some("") => return Err("sslrootcert is empty".into()),
            Some(path) => RootCerts::File(PathBuf::from(path)),
        };
        if mode == SslMode::Require && matches!(roots, RootCerts::File(_)) {
            mode = SslMode::VerifyCa;
        }
        let client_cert = match (sslcert, sslkey) {
            (None, None) => None,
            (Some(c), Some(k)) if !c.is_empty() && !k.is_empty() => {
                Some((PathBuf::from(c), PathBuf::from(k)))
            }
            _ => return Err("sslcert and sslkey must be given together".into()),
        };
        let tls = Self {
            mode,
            roots,
            client_cert,
        };
        // Read every file now, so a missing or broken one is a configuration error.
        tls.client_config()?;
        Ok(tls)
    }

    /// The rustls configuration of the SQL connections. With `disable` it is never used.
    pub fn client_config(&self) -> Result<ClientConfig, String> {
        let provider = provider();
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS setup: {e}"))?;
        let builder = match self.mode {
            SslMode::Disable | SslMode::Prefer | SslMode::Require => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AcceptAnyServerCert(provider))),
            SslMode::VerifyCa => {
                let inner = WebPkiServerVerifier::builder_with_provider(
                    Arc::new(self.root_store()?),
                    provider,
                )
                .build()
                .map_err(|e| format!("sslrootcert: {e}"))?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(VerifyChainOnly(inner)))
            }
            SslMode::VerifyFull => builder.with_root_certificates(self.root_store()?),
        };
        match &self.client_cert {
            None => Ok(builder.with_no_client_auth()),
            Some((cert, key)) => builder
                .with_client_auth_cert(load_certs(cert, "sslcert")?, load_key(key, "sslkey")?)
                .map_err(|e| format!("sslcert/sslkey: {e}")),
        }
    }

    fn root_store(&self) -> Result<RootCertStore, String> {
        match &self.roots {
            RootCerts::Mozilla => Ok(RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            }),
            RootCerts::File(path) => root_store_from_file(path, "sslrootcert"),
        }
    }

    /// The replication connection's TLS settings (pgwire-replication), for a TCP `host`.
    pub fn replication(&self, host: &str) -> pgwire_replication::TlsConfig {
        use pgwire_replication::{SslMode as Mode, TlsConfig};
        let ca = match &self.roots {
            RootCerts::Mozilla => None,
            RootCerts::File(path) => Some(path.clone()),
        };
        let mut tls = match self.mode {
            SslMode::Disable => TlsConfig::disabled(),
            SslMode::Prefer => TlsConfig {
                mode: Mode::Prefer,
                ..TlsConfig::default()
            },
            SslMode::Require => TlsConfig::require(),
            SslMode::VerifyCa => TlsConfig::verify_ca(ca),
            SslMode::VerifyFull => {
                let tls = TlsConfig::verify_full(ca);
                // pgwire-replication refuses verify-full to an IP address unless the name to
                // check is given: the address itself, checked against the certificate's IP
                // entries, as libpq does.
                if host.parse::<std::net::IpAddr>().is_ok() {
                    tls.with_sni_hostname(host)
                } else {
                    tls
                }
            }
        };
        if let Some((cert, key)) = &self.client_cert {
            tls = tls.with_client_cert(cert.clone(), key.clone());
        }
        tls
    }
}

/// Every certificate of a PEM file, for messages naming `setting`.
pub fn load_certs(path: &Path, setting: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{setting} {}: {}", path.display(), pem_error(e)))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{setting} {}: {}", path.display(), pem_error(e)))?;
    if certs.is_empty() {
        return Err(format!(
            "{setting} {}: no PEM certificate in the file",
            path.display()
        ));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path, setting: &str) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| format!("{setting} {}: {}", path.display(), pem_error(e)))
}

/// A root store of the certificates in a PEM file.
pub fn root_store_from_file(path: &Path, setting: &str) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(load_certs(path, setting)?);
    if added == 0 {
        return Err(format!(
            "{setting} {}: no usable CA certificate in the file",
            path.display()
        ));
    }
    Ok(roots)
}

/// Never includes file contents.
fn pem_error(e: rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error;
    match e {
        Error::Io(e) => format!("cannot read it: {e}"),
        Error::NoItemsFound => "no PEM item of the expected kind in the file".into(),
        _ => "not a valid PEM file".into(),
    }
}

/// `sslmode=prefer` and `require`: encryption without authentication of the server. Like
/// libpq, the certificate is not checked at all, so an active attacker in the network path can
/// impersonate the server; use `verify-full` (or `verify-ca`) against that. The handshake
/// signatures are still verified, so the session is bound to the certificate presented.
#[derive(Debug)]
struct AcceptAnyServerCert(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode=verify-ca`: the chain must lead to a trusted root; the names in the certificate
/// are not compared with the host (webpki checks the chain first, so a name mismatch is the
/// only error accepted).
#[derive(Debug)]
struct VerifyChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for VerifyChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        let t = PgTls::from_params(None, None, None, None).unwrap();
        assert_eq!(t.mode, SslMode::Prefer);
        for m in ["disable", "prefer", "require", "verify-ca", "verify-full"] {
            let t = PgTls::from_params(Some(m), None, None, None).unwrap();
            assert_eq!(t.mode.as_str(), m);
        }
        assert!(PgTls::from_params(Some("allow"), None, None, None).is_err());
        assert!(PgTls::from_params(Some("verify_full"), None, None, None).is_err());
        let err = PgTls::from_params(Some("verify-full"), Some("/nonexistent/ca.pem"), None, None)
            .unwrap_err();
        assert!(err.contains("sslrootcert /nonexistent/ca.pem"), "{err}");
        assert!(PgTls::from_params(None, None, Some("/c.pem"), None).is_err());
    }

    #[test]
    fn replication_mapping() {
        use pgwire_replication::SslMode as Mode;
        let t = PgTls::from_params(Some("verify-full"), None, None, None).unwrap();
        let r = t.replication("127.0.0.1");
        assert_eq!(r.mode, Mode::VerifyFull);
        assert_eq!(r.sni_hostname.as_deref(), Some("127.0.0.1"));
        assert_eq!(t.replication("db.example").sni_hostname, None);
        let t = PgTls::from_params(Some("disable"), None, None, None).unwrap();
        assert_eq!(t.replication("h").mode, Mode::Disable);
        let t = PgTls::default();
        assert_eq!(t.replication("h").mode, Mode::Prefer);
    }
}
