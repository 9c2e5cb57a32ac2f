//! TLS to PostgreSQL (every `sslmode`, on the SQL and the replication connections) and to
//! Valkey, with certificates made at test time (the `openssl` command).

mod common;

use common::certs::Certs;
use common::*;
use outbox_relay::error_chain;

/// A Postgres cluster of this test speaking TLS with the certificate `cert` and key `key` of
/// `certs` (and the extra server `settings`). The harness's `postgres` connects over plain TCP;
/// every other role as the `hba` lines say.
async fn tls_postgres(certs: &Certs, cert: &str, key: &str, settings: &[&str], hba: &str) -> OwnPg {
    let cert_file = format!("ssl_cert_file={}", certs.p(cert));
    let key_file = format!("ssl_key_file={}", certs.p(key));
    let mut args = vec!["-c", "ssl=on", "-c", &cert_file, "-c", &key_file];
    for setting in settings {
        args.extend(["-c", setting]);
    }
    let pg = OwnPg::start(&args);
    pg.set_hba(&format!(
        "local all all trust\nhost all postgres 127.0.0.1/32 trust\n{hba}"
    ))
    .await;
    pg
}

/// Streams a few events through a relay with these settings; returns whether the walsender's
/// connection was encrypted.
async fn delivers(owner: &TestDb, relay_db: &TestDb, extra: &[&str]) -> bool {
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(relay_db, &redis.url, extra)).await;
    let mut c = owner.client().await;
    let ids = insert_events(&mut c, "tls", 5, 5).await;
    assert_eq!(wait_pending(&redis, "default", 5).await, ids);
    let ssl: bool = c
        .query_one(
            "SELECT coalesce(bool_and(ssl), false) FROM pg_stat_ssl \
             WHERE pid = (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1)",
            &[&owner.slot],
        )
        .await
        .unwrap()
        .get(0);
    relay.stop().await;
    ssl
}

/// TLS to PostgreSQL on both paths: verify-full (by IP address and by name), verify-ca,
/// require, prefer (the default), a client certificate (`cert` authentication), and a clear
/// error against the wrong CA. Roles other than the harness's may connect over TLS only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_in_every_mode() {
    let certs = Certs::new();
    let ca = certs.p("ca.crt");
    let pg = tls_postgres(
        &certs,
        "server.crt",
        "pg-server.key",
        &[&format!("ssl_ca_file={ca}")],
        "hostssl all certuser 127.0.0.1/32 cert\n\
         hostssl all all 127.0.0.1/32 scram-sha-256\n",
    )
    .await;
    let cases: Vec<(&str, String)> = vec![
        (
            "verify-full by address",
            format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
        ("verify-ca", format!("sslmode=verify-ca&sslrootcert={ca}")),
        ("require", "sslmode=require".to_owned()),
        ("prefer (the default)", String::new()),
    ];
    for (what, params) in cases {
        let db = TestDb::on(&pg.url, "pgtls", true).await;
        let role = db.least_privilege_role_with_password("tls-pw").await;
        let as_role = if params.is_empty() {
            role
        } else {
            role.at(format!("{}?{params}", role.url))
        };
        assert!(delivers(&db, &as_role, &[]).await, "{what}: TLS");
    }

    // By host name, authenticated by a client certificate instead of a password.
    let db = TestDb::on(&pg.url, "pgcert", true).await;
    db.least_privilege_role().await;
    let lp_role = db.least_privilege_role_name();
    db.client()
        .await
        .batch_execute(&format!("ALTER ROLE {lp_role} RENAME TO certuser"))
        .await
        .unwrap();
    let port = port_of(&pg.url);
    let cert_db = db.at(format!(
        "postgres://certuser@localhost:{port}/{}?sslmode=verify-full&sslrootcert={ca}&sslcert={}&sslkey={}",
        db.name,
        certs.p("client.crt"),
        certs.p("client.key")
    ));
    assert!(delivers(&db, &cert_db, &[]).await, "client certificate");

    // The wrong CA: refused at the first connection, saying why.
    let db = TestDb::on(&pg.url, "pgbadca", true).await;
    let role = db.least_privilege_role_with_password("tls-pw").await;
    let bad = role.at(format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        role.url,
        certs.p("other-ca.crt")
    ));
    let redis = Redis::start();
    let msg = Relay::failure(run_args(&bad, &redis.url, &[])).await;
    assert!(
        msg.contains("cannot connect to PostgreSQL") && msg.contains("UnknownIssuer"),
        "{msg}"
    );
    // And plain TCP is refused for the relay's role (so the runs above did use TLS).
    let plain = bad.at(format!("{}?sslmode=disable", role.url));
    let msg = Relay::failure(run_args(&plain, &redis.url, &[])).await;
    assert!(msg.contains("no encryption"), "{msg}");
}

/// TLS to Valkey: rediss:// with the CA file and a client certificate (the server requires
/// one); without the client certificate, or trusting another CA, the relay cannot connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_tls_with_a_ca_and_a_client_certificate() {
    let certs = Certs::new();
    let tls_port = free_port().to_string();
    let redis = Redis::start_with(
        &[
            "--tls-port",
            &tls_port,
            "--tls-cert-file",
            &certs.p("server.crt"),
            "--tls-key-file",
            &certs.p("server.key"),
            "--tls-ca-cert-file",
            &certs.p("ca.crt"),
            "--tls-auth-clients",
            "yes",
        ],
        None,
    );
    let tls_url = format!("rediss://127.0.0.1:{tls_port}");
    let db = TestDb::new("vktls").await;
    let tls = certs.relay_valkey_tls(Some("ca.crt"), true);
    let relay = Relay::start_streaming(run_args(&db, &tls_url, &tls.flags())).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "valkey.tls", 20, 5).await;
    assert_eq!(wait_pending(&redis, "default", 20).await, ids);
    relay.stop().await;
    let env = [&relay_env(&db, &tls_url)[..], &tls.env()].concat();
    let out = run_command_ok(&["status", "--json"], &env);
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["queues"][0]["pending"], 20, "{out}");

    for (what, tls) in [
        (
            "no client certificate",
            certs.relay_valkey_tls(Some("ca.crt"), false),
        ),
        (
            "another CA",
            certs.relay_valkey_tls(Some("other-ca.crt"), true),
        ),
    ] {
        let msg = Relay::failure(run_args(&db, &tls_url, &tls.flags())).await;
        assert!(
            msg.contains("cannot reach Valkey at rediss://"),
            "{what}: {msg}"
        );
    }
}

/// The replication connection alone, as the relay configures it for `url` (pgwire-replication):
/// `IDENTIFY_SYSTEM` on it, or the error on one line.
async fn replication_probe(url: &str) -> Result<(), String> {
    let target = outbox_relay::postgres::PgTarget::parse(url).map_err(|e| error_chain(&e))?;
    let cfg = target.replication("probe", "outbox_relay");
    let mut client = pgwire_replication::ReplicationClient::connect_gated(cfg)
        .await
        .map_err(|e| error_chain(&e))?;
    client
        .identify_system()
        .await
        .map(drop)
        .map_err(|e| error_chain(&e))
}

/// An SQL connection alone, as the relay makes it for `url`, or the error on one line.
async fn sql_probe(url: &str) -> Result<(), String> {
    let target = outbox_relay::postgres::PgTarget::parse(url).map_err(|e| error_chain(&e))?;
    let client = target.connect().await.map_err(|e| error_chain(&e))?;
    client
        .simple_query("SELECT 1")
        .await
        .map(drop)
        .map_err(|e| error_chain(&e))
}

/// verify-ca checks the chain and not the host name, on the SQL connections and on the
/// replication connection alike. The server's certificate chains to the CA but names another
/// host (`db.invalid`): verify-ca connects on both paths, over TLS, and the relay delivers;
/// verify-full is refused on both (so the certificate really does not name the host). A
/// certificate from another CA is refused on both under verify-ca, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_verify_ca_ignores_the_host_name_on_both_connections() {
    let certs = Certs::new();
    certs.signed(
        "elsewhere",
        "/CN=db.invalid",
        "subjectAltName=DNS:db.invalid\nextendedKeyUsage=serverAuth\n",
    );
    certs.pg_key("elsewhere");
    let pg = tls_postgres(
        &certs,
        "elsewhere.crt",
        "pg-elsewhere.key",
        &[],
        "hostssl all all 127.0.0.1/32 scram-sha-256
",
    )
    .await;
    let db = TestDb::on(&pg.url, "verifyca", true).await;
    let role = db.least_privilege_role_with_password("tls-pw").await;
    let with = |params: String| role.at(format!("{}?{params}", role.url));
    let ca = certs.p("ca.crt");

    let verify_ca = with(format!("sslmode=verify-ca&sslrootcert={ca}"));
    assert_eq!(sql_probe(&verify_ca.url).await, Ok(()), "verify-ca, SQL");
    assert_eq!(
        replication_probe(&verify_ca.url).await,
        Ok(()),
        "verify-ca, replication"
    );
    assert!(
        delivers(&db, &verify_ca, &[]).await,
        "verify-ca: the walsender's connection is encrypted"
    );

    let verify_full = with(format!("sslmode=verify-full&sslrootcert={ca}"));
    for (path, result) in [
        ("SQL", sql_probe(&verify_full.url).await),
        ("replication", replication_probe(&verify_full.url).await),
    ] {
        let err = result.expect_err(path);
        assert!(
            err.contains("certificate not valid for name"),
            "verify-full, {path}: {err}"
        );
    }

    let other_ca = with(format!(
        "sslmode=verify-ca&sslrootcert={}",
        certs.p("other-ca.crt")
    ));
    let err = sql_probe(&other_ca.url).await.unwrap_err();
    assert!(
        err.contains("cannot connect to PostgreSQL") && err.contains("UnknownIssuer"),
        "another CA, SQL: {err}"
    );
    let err = replication_probe(&other_ca.url).await.unwrap_err();
    assert!(
        err.contains("TLS handshake failed") && err.contains("UnknownIssuer"),
        "another CA, replication: {err}"
    );
}

/// `sslmode=prefer` falls back to plain TCP when the TLS handshake fails, as libpq does, on the
/// SQL connections and on the replication connection; `require` refuses, saying why. The server
/// offers TLS (ssl=on: it accepts the SSLRequest) but speaks only TLS 1.0 and 1.1, which rustls
/// does not, and pg_hba.conf allows plain `host` connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefer_falls_back_to_plain_when_the_tls_handshake_fails() {
    let certs = Certs::new();
    let pg = tls_postgres(
        &certs,
        "server.crt",
        "pg-server.key",
        &[
            "ssl_min_protocol_version=TLSv1",
            "ssl_max_protocol_version=TLSv1.1",
        ],
        "host all all 127.0.0.1/32 scram-sha-256
",
    )
    .await;
    let admin = connect(&pg.url).await;
    for (setting, value) in [("ssl", "on"), ("ssl_max_protocol_version", "TLSv1.1")] {
        let shown: String = admin
            .query_one(&format!("SHOW {setting}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(shown, value, "the server runs with {setting} = {value}");
    }
    let db = TestDb::on(&pg.url, "prefer", true).await;
    let role = db.least_privilege_role_with_password("tls-pw").await;
    let with = |params: &str| role.at(format!("{}?{params}", role.url));

    // require: the handshake fails on both paths, and the relay stops saying so.
    let require = with("sslmode=require");
    let err = sql_probe(&require.url).await.unwrap_err();
    assert!(err.contains("error performing TLS handshake"), "SQL: {err}");
    let err = replication_probe(&require.url).await.unwrap_err();
    assert!(err.contains("TLS handshake failed"), "replication: {err}");
    let redis = Redis::start();
    let msg = Relay::failure(run_args(&require, &redis.url, &[])).await;
    assert!(
        msg.contains("cannot connect to PostgreSQL") && msg.contains("TLS handshake"),
        "{msg}"
    );

    // prefer, named and as the default: connects without TLS, streams and delivers.
    assert_eq!(sql_probe(&with("sslmode=prefer").url).await, Ok(()));
    assert!(
        !delivers(&db, &with("sslmode=prefer"), &[]).await,
        "the walsender's connection is plain"
    );
    assert!(!delivers(&db, &role, &[]).await, "prefer is the default");
}
