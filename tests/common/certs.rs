//! TLS certificates made at test time with the `openssl` command: for PostgreSQL and Valkey
//! servers, and for the scripts' `--tls CERTDIR` (which want `ca.crt`, `server.crt`/`server.key`
//! and `client.crt`/`client.key` there).

use std::path::PathBuf;

/// The relay's Valkey TLS settings ([`Certs::relay_valkey_tls`]), as flags or as variables.
pub struct RelayValkeyTls {
    /// `--valkey-ca-file`.
    ca: Option<String>,
    /// `--valkey-client-cert-file` and `--valkey-client-key-file`.
    client: Option<(String, String)>,
}

impl RelayValkeyTls {
    /// `(flag, variable, value)` of each setting.
    fn settings(&self) -> Vec<(&'static str, &'static str, &str)> {
        let mut out = Vec::new();
        if let Some(ca) = &self.ca {
            out.push(("--valkey-ca-file", "OUTBOX_VALKEY_CA_FILE", ca.as_str()));
        }
        if let Some((cert, key)) = &self.client {
            out.push((
                "--valkey-client-cert-file",
                "OUTBOX_VALKEY_CLIENT_CERT_FILE",
                cert.as_str(),
            ));
            out.push((
                "--valkey-client-key-file",
                "OUTBOX_VALKEY_CLIENT_KEY_FILE",
                key.as_str(),
            ));
        }
        out
    }

    /// As flags of `outbox-relay run`.
    pub fn flags(&self) -> Vec<&str> {
        self.settings()
            .into_iter()
            .flat_map(|(flag, _, value)| [flag, value])
            .collect()
    }

    /// As environment variables.
    pub fn env(&self) -> Vec<(&'static str, &str)> {
        self.settings()
            .into_iter()
            .map(|(_, var, value)| (var, value))
            .collect()
    }
}

/// Certificates made for one test: a CA, a server certificate for localhost and 127.0.0.1, a
/// client certificate (CN `certuser`), and a second CA that signed none of them.
pub struct Certs {
    pub dir: PathBuf,
}

impl Certs {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        let dir = super::tmp_dir("certs");
        let certs = Self { dir };
        certs.key("ca");
        certs.openssl(&[
            "req",
            "-x509",
            "-new",
            "-key",
            "ca.key",
            "-days",
            "2",
            "-subj",
            "/CN=outbox-relay test CA",
            "-out",
            "ca.crt",
        ]);
        certs.key("other-ca");
        certs.openssl(&[
            "req",
            "-x509",
            "-new",
            "-key",
            "other-ca.key",
            "-days",
            "2",
            "-subj",
            "/CN=another CA",
            "-out",
            "other-ca.crt",
        ]);
        certs.signed(
            "server",
            "/CN=localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        );
        certs.signed("client", "/CN=certuser", "extendedKeyUsage=clientAuth\n");
        certs.pg_key("server");
        certs
    }

    /// `pg-NAME.key`: a copy of `NAME.key` as PostgreSQL wants its key, owned by the server's
    /// user and private.
    pub fn pg_key(&self, name: &str) {
        let pg_key = self.path(&format!("pg-{name}.key"));
        std::fs::copy(self.path(&format!("{name}.key")), &pg_key).unwrap();
        if nix_is_root() {
            let ok = std::process::Command::new("chown")
                .args(["postgres:postgres", pg_key.to_str().unwrap()])
                .status()
                .unwrap();
            assert!(ok.success());
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&pg_key, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    /// The CA and the client certificate, for a redis client of a TLS Valkey.
    pub fn valkey_tls(&self) -> redis::TlsCertificates {
        let read = |name: &str| std::fs::read(self.path(name)).unwrap();
        redis::TlsCertificates {
            client_tls: Some(redis::ClientTlsConfig {
                client_cert: read("client.crt"),
                client_key: read("client.key"),
            }),
            root_cert: Some(read("ca.crt")),
        }
    }

    /// The relay's settings for TLS to Valkey: trusting the CA certificate in the file `ca` of
    /// this directory (`None`: Mozilla's roots), with the client certificate or without.
    pub fn relay_valkey_tls(&self, ca: Option<&str>, client_certificate: bool) -> RelayValkeyTls {
        RelayValkeyTls {
            ca: ca.map(|name| self.p(name)),
            client: client_certificate.then(|| (self.p("client.crt"), self.p("client.key"))),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn p(&self, name: &str) -> String {
        self.path(name).to_str().unwrap().to_owned()
    }

    pub fn openssl(&self, args: &[&str]) {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(&self.dir)
            .output()
            .expect("the openssl command (apt-get install openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn key(&self, name: &str) {
        self.openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            &format!("{name}.key"),
        ]);
    }

    /// A key and a certificate signed by the CA, with `extensions` (openssl extfile lines).
    pub fn signed(&self, name: &str, subject: &str, extensions: &str) {
        self.key(name);
        self.openssl(&[
            "req",
            "-new",
            "-key",
            &format!("{name}.key"),
            "-subj",
            subject,
            "-out",
            &format!("{name}.csr"),
        ]);
        let ext = format!("{name}.ext");
        std::fs::write(
            self.path(&ext),
            format!("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n{extensions}"),
        )
        .unwrap();
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &format!("{name}.crt"),
        ]);
    }
}

pub fn nix_is_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
