//! Security: secrets never leave the process (logs, command output, metrics), secrets from
//! files, SCRAM authentication to PostgreSQL, password and ACL-user authentication to Valkey,
//! and TLS to both with certificates made at test time (the `openssl` command).

mod common;

use common::certs::Certs;
use common::topologies::{assert_each_delivered_once, ValkeySentinel};
use common::*;
use outbox_relay::error_chain;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

/// Distinctive secrets: the test fails if any of them shows up where it must not.
const PG_SECRET: &str = "pgSecretQx7Zr4Lw";
const VK_SECRET: &str = "vkSecretWm4Np9Td";
const PG_WRONG: &str = "pgWrongPw3Hs8Kb";
const VK_WRONG: &str = "vkWrongPw6Jc2Fy";
const SN_SECRET: &str = "snSecretKv5Rb8Yz";
const SN_WRONG: &str = "snWrongPw4Lp7Mc";

/// The binary with none of the caller's OUTBOX_*/VALKEY_* settings.
fn relay_bin() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTBOX_") || k.starts_with("VALKEY_") {
            c.env_remove(k);
        }
    }
    c
}

/// Runs a command of the binary to its end: (exit code, stdout, stderr).
fn run_cmd(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = relay_bin()
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `outbox-relay run` as a process, logging to a file.
struct RunProcess {
    child: tokio::process::Child,
    log: PathBuf,
}

impl RunProcess {
    fn spawn(env: &[(&str, &str)]) -> Self {
        let log = tmp_dir("relay-log").join("relay.log");
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd: tokio::process::Command = relay_bin().into();
        let child = cmd
            .arg("run")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self { child, log }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the relay holds the slot, failing at once if it exits instead.
    async fn wait_streaming(&mut self, db: &TestDb) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        let c = db.client().await;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the relay exited ({status}): {}", self.log_text());
            }
            let active = c
                .query_opt(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[&db.slot],
                )
                .await
                .unwrap()
                .is_some_and(|r| r.get::<_, bool>(0));
            if active {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "gave up waiting for the stream"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits for the process to end by itself: its exit code.
    async fn exit_code(&mut self) -> i32 {
        tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the relay exits")
            .unwrap()
            .code()
            .unwrap_or(-1)
    }

    async fn terminate(mut self) -> String {
        let pid = self.child.id().expect("running").to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        let status = tokio::time::timeout(PATIENCE, self.child.wait())
            .await
            .expect("the relay stops on SIGTERM")
            .unwrap();
        assert!(status.success(), "clean exit: {}", self.log_text());
        self.log_text()
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A cluster where every role but the harness's `postgres` authenticates with SCRAM-SHA-256.
async fn scram_cluster() -> OwnPg {
    let pg = OwnPg::start(&["-c", "password_encryption=scram-sha-256"]);
    pg.set_hba(
        "local all all trust\n\
         host all postgres 127.0.0.1/32 trust\n\
         host all all 127.0.0.1/32 scram-sha-256\n",
    )
    .await;
    pg
}

/// `db` as its least-privilege role, with `password`.
async fn role_with_password(db: &TestDb, password: &str) -> TestDb {
    let role = db.least_privilege_role().await;
    let name = db.least_privilege_role_name();
    db.client()
        .await
        .batch_execute(&format!("ALTER ROLE {name} PASSWORD '{password}'"))
        .await
        .unwrap();
    TestDb {
        url: role.url.replace(LEAST_PRIVILEGE_PASSWORD, password),
        ..role
    }
}

/// The port of `scheme://[auth@]host:port[/db]`.
fn port_of(url: &str) -> &str {
    let after_host = url.rsplit('@').next().unwrap();
    let host_port = after_host.split('/').find(|p| p.contains(':')).unwrap();
    host_port.rsplit(':').next().unwrap()
}

fn assert_no_secret(what: &str, text: &str) {
    for secret in [
        PG_SECRET, VK_SECRET, PG_WRONG, VK_WRONG, SN_SECRET, SN_WRONG,
    ] {
        assert!(
            !text.contains(secret),
            "{what} contains the secret {secret}:\n{text}"
        );
    }
}

/// A full run of the binary with passwords on both sides (from files), Valkey restarted under
/// it, a walsender killed, then `status`, `status --json`, `peek` and /metrics; then runs with a
/// wrong password for each server. None of the secrets appears anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_appear_in_logs_output_or_metrics() {
    let pg = scram_cluster().await;
    let db = TestDb::on(&pg.url, "secrets", true).await;
    let role = role_with_password(&db, PG_SECRET).await;
    let redis = Redis::start_with(&[], Some(VK_SECRET));
    let valkey_addr = format!("127.0.0.1:{}", port_of(&redis.url));
    let files = tmp_dir("secret-files");
    let url_file = files.join("database-url");
    std::fs::write(&url_file, format!("{}\n", role.url)).unwrap();
    let pw_file = files.join("valkey-password");
    std::fs::write(&pw_file, format!("{VK_SECRET}\n")).unwrap();
    let metrics_port = free_port().to_string();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");

    let mut relay = RunProcess::spawn(&[
        ("OUTBOX_DATABASE_URL_FILE", url_file.to_str().unwrap()),
        ("VALKEY_ADDR", &valkey_addr),
        ("VALKEY_PASSWORD_FILE", pw_file.to_str().unwrap()),
        ("OUTBOX_SLOT", &db.slot),
        ("OUTBOX_METRICS_ADDR", &metrics_addr),
        ("OUTBOX_HEALTH_INTERVAL", "1s"),
        ("OUTBOX_HEARTBEAT_INTERVAL", "1s"),
        ("OUTBOX_LOG", "debug"),
    ]);
    relay.wait_streaming(&db).await;
    let mut c = db.client().await;
    let mut ids = insert_events(&mut c, "secret.first", 20, 5).await;
    wait_pending(&redis, "default", 20).await;

    // Valkey goes away (keeping its data) while events arrive, and comes back.
    redis.stop_saving();
    ids.extend(insert_events(&mut c, "secret.during", 10, 5).await);
    eventually("the relay notices Valkey is gone", || async {
        relay
            .log_text()
            .contains("valkey write failed")
            .then_some(())
    })
    .await;
    redis.restart();
    // The walsender is cut: the stream reconnects and authenticates again.
    c.execute(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1",
        &[&db.slot],
    )
    .await
    .unwrap();
    ids.extend(insert_events(&mut c, "secret.after", 10, 5).await);
    let pending = wait_pending(&redis, "default", ids.len()).await;
    assert!(ids.iter().all(|id| pending.contains(id)));

    let metrics_at: std::net::SocketAddr = metrics_addr.parse().unwrap();
    let (code, metrics) = http_get(metrics_at, "/metrics").await;
    assert_eq!(code, 200);
    assert!(metrics.contains("outbox_events_published"), "{metrics}");
    let (_, ready) = http_get(metrics_at, "/readyz").await;
    let (_, health) = http_get(metrics_at, "/healthz").await;

    // The operator commands, with the secrets in plain variables this time.
    let vk_url = redis.url.clone();
    let env: &[(&str, &str)] = &[
        ("OUTBOX_DATABASE_URL", &role.url),
        ("OUTBOX_VALKEY_URL", &vk_url),
        ("OUTBOX_SLOT", &db.slot),
        ("OUTBOX_LOG", "debug"),
    ];
    let mut outputs = Vec::new();
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["peek", "--limit", "3"],
        &["dead-letters", "list"],
    ] {
        let (code, out, err) = run_cmd(args, env);
        assert_eq!(code, 0, "{args:?}: {err}");
        outputs.push((format!("{args:?}"), format!("{out}\n{err}")));
    }
    assert!(outputs[0].1.contains("default"), "{}", outputs[0].1);
    // `status` with a wrong Valkey password reports Valkey unreachable.
    let wrong_vk = vk_url.replace(VK_SECRET, VK_WRONG);
    let (code, out, err) = run_cmd(
        &["status"],
        &[
            ("OUTBOX_DATABASE_URL", &role.url),
            ("OUTBOX_VALKEY_URL", &wrong_vk),
            ("OUTBOX_SLOT", &db.slot),
        ],
    );
    assert_eq!(code, 0, "{err}");
    outputs.push((
        "status with a wrong Valkey password".into(),
        format!("{out}\n{err}"),
    ));

    let log = relay.terminate().await;
    assert!(log.contains("replication stream started"), "{log}");
    assert!(log.contains("valkey write failed"), "{log}");

    // A wrong PostgreSQL password, then a wrong Valkey password: each stops the relay.
    let wrong_pg = role.url.replace(PG_SECRET, PG_WRONG);
    let mut bad_pg = RunProcess::spawn(&[
        ("OUTBOX_DATABASE_URL", &wrong_pg),
        ("OUTBOX_VALKEY_URL", &vk_url),
        ("OUTBOX_SLOT", &db.slot),
        ("OUTBOX_METRICS_ADDR", "127.0.0.1:0"),
        ("OUTBOX_LOG", "debug"),
    ]);
    assert_eq!(bad_pg.exit_code().await, 1);
    let bad_pg_log = bad_pg.log_text();
    assert!(
        bad_pg_log.contains("password authentication failed"),
        "{bad_pg_log}"
    );
    let mut bad_vk = RunProcess::spawn(&[
        ("OUTBOX_DATABASE_URL", &role.url),
        ("OUTBOX_VALKEY_URL", &wrong_vk),
        ("OUTBOX_SLOT", &db.slot),
        ("OUTBOX_METRICS_ADDR", "127.0.0.1:0"),
        ("OUTBOX_LOG", "debug"),
    ]);
    assert_eq!(bad_vk.exit_code().await, 1);
    let bad_vk_log = bad_vk.log_text();
    assert!(
        bad_vk_log.contains("cannot reach Valkey at redis://:***@"),
        "{bad_vk_log}"
    );

    assert_no_secret("the relay's log", &log);
    assert_no_secret("/metrics", &metrics);
    assert_no_secret("/readyz", &ready);
    assert_no_secret("/healthz", &health);
    for (what, text) in &outputs {
        assert_no_secret(what, text);
    }
    assert_no_secret(
        "the log of the run with a wrong PostgreSQL password",
        &bad_pg_log,
    );
    assert_no_secret(
        "the log of the run with a wrong Valkey password",
        &bad_vk_log,
    );
}

/// `*_FILE` settings: read before anything connects, a trailing newline ignored; an unreadable
/// file, or a setting given both ways, is a one-line error naming it (exit code 2).
#[test]
fn secrets_from_files_are_checked_before_connecting() {
    let dir = tmp_dir("secret-file-checks");
    let url_file = dir.join("url");
    std::fs::write(&url_file, "postgres://u:pgSecretQx7Zr4Lw@127.0.0.1:1/d\n").unwrap();
    let url_file = url_file.to_str().unwrap();
    let missing = dir.join("missing");
    let missing = missing.to_str().unwrap();

    // Read and used: the connection it describes is attempted (and refused: nothing listens).
    let (code, _, err) = run_cmd(&["migrate"], &[("OUTBOX_DATABASE_URL_FILE", url_file)]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("cannot connect to PostgreSQL at u@127.0.0.1:1/d"),
        "{err}"
    );
    assert_no_secret("stderr", &err);

    // (the environment, what the one-line message must name)
    type Case<'a> = (&'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: &[Case] = &[
        (
            &[("OUTBOX_DATABASE_URL_FILE", missing)],
            &["OUTBOX_DATABASE_URL_FILE", "cannot read"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("OUTBOX_DATABASE_URL", "postgres://u@h/d"),
            ],
            &["OUTBOX_DATABASE_URL", "OUTBOX_DATABASE_URL_FILE"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("OUTBOX_VALKEY_URL_FILE", missing),
            ],
            &["OUTBOX_VALKEY_URL_FILE"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("OUTBOX_VALKEY_URL_FILE", url_file),
                ("OUTBOX_VALKEY_URL", "redis://h"),
            ],
            &["OUTBOX_VALKEY_URL", "OUTBOX_VALKEY_URL_FILE"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("VALKEY_PASSWORD_FILE", missing),
            ],
            &["VALKEY_PASSWORD_FILE"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("VALKEY_PASSWORD_FILE", url_file),
                ("VALKEY_PASSWORD", "x"),
            ],
            &["VALKEY_PASSWORD", "VALKEY_PASSWORD_FILE"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("OUTBOX_VALKEY_SENTINEL_PASSWORD_FILE", missing),
            ],
            &["OUTBOX_VALKEY_SENTINEL_PASSWORD_FILE", "cannot read"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("OUTBOX_VALKEY_SENTINEL_PASSWORD_FILE", url_file),
                ("OUTBOX_VALKEY_SENTINEL_PASSWORD", "x"),
            ],
            &[
                "OUTBOX_VALKEY_SENTINEL_PASSWORD",
                "OUTBOX_VALKEY_SENTINEL_PASSWORD_FILE",
            ],
        ),
        (
            &[(
                "OUTBOX_DATABASE_URL",
                "postgres://u:pgSecretQx7Zr4Lw@h/d?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
            )],
            &["OUTBOX_DATABASE_URL", "sslrootcert /nonexistent/ca.pem"],
        ),
        (
            &[(
                "OUTBOX_DATABASE_URL",
                "postgres://u:pgSecretQx7Zr4Lw@h/d?sslmode=verify_full",
            )],
            &["OUTBOX_DATABASE_URL", "sslmode"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("OUTBOX_VALKEY_URL", "redis://:vkSecretWm4Np9Td@h:1"),
                ("OUTBOX_VALKEY_CA_FILE", url_file),
            ],
            &["OUTBOX_VALKEY_CA_FILE", "rediss://"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("OUTBOX_VALKEY_URL", "rediss://:vkSecretWm4Np9Td@h:1"),
                ("OUTBOX_VALKEY_CA_FILE", url_file),
            ],
            &["OUTBOX_VALKEY_CA_FILE", "no PEM certificate"],
        ),
        (
            &[
                ("OUTBOX_DATABASE_URL_FILE", url_file),
                ("OUTBOX_VALKEY_URL", "rediss://h:1"),
                ("OUTBOX_VALKEY_CLIENT_CERT_FILE", url_file),
            ],
            &["OUTBOX_VALKEY_CLIENT_KEY_FILE"],
        ),
    ];
    for (env, names) in cases {
        let (code, _, err) = run_cmd(&["run"], env);
        assert_eq!(code, 2, "{env:?}: {err}");
        for name in *names {
            assert!(err.contains(name), "{env:?} should name {name}: {err}");
        }
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert_no_secret("stderr", &err);
    }
}

/// `(key, value)` pairs borrowed from owned ones.
fn as_refs(v: &[(String, String)]) -> Vec<(&str, &str)> {
    v.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// The sentinels' own password from a file (`OUTBOX_VALKEY_SENTINEL_PASSWORD_FILE`): sentinels
/// that require one (`requirepass`), the relay as a process, `status` through them; without the
/// password, or with a wrong one, the relay cannot ask them and stops (exit code 1). Neither
/// password appears in any of the logs or outputs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_password_from_a_file_never_appears_in_output() {
    let files = tmp_dir("sentinel-secret");
    let pw_file = files.join("sentinel-password");
    std::fs::write(&pw_file, format!("{SN_SECRET}\n")).unwrap();
    let pw_file = pw_file.to_str().unwrap();
    let wrong_file = files.join("wrong-password");
    std::fs::write(&wrong_file, SN_WRONG).unwrap();
    let wrong_file = wrong_file.to_str().unwrap();
    let sentinel = ValkeySentinel::start_with(&["--sentinel-password-file", pw_file], None);
    let db = TestDb::new("sentinel_pw").await;
    let env = |extra: &[(&'static str, &str)]| -> Vec<(String, String)> {
        [
            ("OUTBOX_DATABASE_URL", db.url.as_str()),
            ("OUTBOX_VALKEY_URL", sentinel.urls.as_str()),
            ("OUTBOX_VALKEY_SENTINEL_MASTER", sentinel.name.as_str()),
            ("OUTBOX_SLOT", db.slot.as_str()),
            ("OUTBOX_METRICS_ADDR", "127.0.0.1:0"),
            ("OUTBOX_LOG", "debug"),
        ]
        .iter()
        .chain(extra)
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
    };
    let good = env(&[("OUTBOX_VALKEY_SENTINEL_PASSWORD_FILE", pw_file)]);

    let mut relay = RunProcess::spawn(&as_refs(&good));
    relay.wait_streaming(&db).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "sentinel.secret", 10, 5).await;
    let mut conn = sentinel.conn(sentinel.first_primary_port()).await;
    let expected = std::collections::HashMap::from([("default".to_owned(), ids)]);
    assert_each_delivered_once(&mut conn, &expected).await;
    let (code, out, err) = run_cmd(&["status", "--json"], &as_refs(&good));
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["queues"][0]["pending"], 10, "{out}");
    let log = relay.terminate().await;
    assert_no_secret("the relay's log", &log);
    assert_no_secret("status", &format!("{out}\n{err}"));

    for (what, extra) in [
        ("no sentinel password", vec![]),
        (
            "a wrong sentinel password",
            vec![("OUTBOX_VALKEY_SENTINEL_PASSWORD_FILE", wrong_file)],
        ),
    ] {
        let mut bad = RunProcess::spawn(&as_refs(&env(&extra)));
        assert_eq!(bad.exit_code().await, 1, "{what}: {}", bad.log_text());
        let text = bad.log_text();
        assert!(
            text.contains("cannot reach Valkey at redis://"),
            "{what}: {text}"
        );
        assert_no_secret(what, &text);
    }
}

/// The relay's role authenticates with SCRAM-SHA-256 (SQL connections and the replication
/// connection); Valkey with an ACL user allowed only the commands the relay uses (CONFIG GET,
/// for the eviction warning, is denied and tolerated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_role_and_a_valkey_acl_user_limited_to_the_relays_commands() {
    let pg = scram_cluster().await;
    let db = TestDb::on(&pg.url, "scram", true).await;
    let role = role_with_password(&db, "scram-pw").await;
    let redis = Redis::start();
    let mut admin = redis.conn().await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("relay")
        .arg("on")
        .arg(">acl-pw")
        .arg("resetkeys")
        .arg("~asynq:*")
        .arg("resetchannels")
        .arg("-@all")
        // The sink (and the commands its enqueue script runs), the monitor, status, peek.
        .arg("+evalsha")
        .arg("+script|load")
        .arg("+exists")
        .arg("+hset")
        .arg("+lpush")
        .arg("+sadd")
        .arg("+ping")
        .arg("+smembers")
        .arg("+llen")
        .arg("+lrange")
        .arg("+hmget")
        .query_async(&mut admin)
        .await
        .unwrap();
    let acl_url = redis.url.replace("redis://", "redis://relay:acl-pw@");
    let relay =
        Relay::start_streaming(run_args(&role, &acl_url, &["--recovery-grace", "1s"])).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "scram.acl", 50, 10).await;
    assert_eq!(wait_pending(&redis, "default", 50).await, ids);
    // The marker's UPDATEs went through the SQL path as the SCRAM role.
    eventually("rows are marked published", || async {
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (n == 0).then_some(())
    })
    .await;
    let env: &[(&str, &str)] = &[
        ("OUTBOX_DATABASE_URL", &role.url),
        ("OUTBOX_VALKEY_URL", &acl_url),
        ("OUTBOX_SLOT", &db.slot),
    ];
    let (code, out, err) = run_cmd(&["status", "--json"], env);
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["queues"][0]["pending"], 50, "{out}");
    let (code, out, err) = run_cmd(&["peek", "--limit", "2", "--json"], env);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&ids[0]), "{out}");
    relay.stop().await;

    // A wrong password is refused with the server's message.
    let wrong = TestDb {
        url: role.url.replace("scram-pw", "not-it"),
        name: role.name.clone(),
        slot: role.slot.clone(),
    };
    let msg = Relay::failure(run_args(&wrong, &acl_url, &[])).await;
    assert!(msg.contains("password authentication failed"), "{msg}");
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
    let pg = OwnPg::start(&[
        "-c",
        "ssl=on",
        "-c",
        &format!("ssl_cert_file={}", certs.p("server.crt")),
        "-c",
        &format!("ssl_key_file={}", certs.p("pg-server.key")),
        "-c",
        &format!("ssl_ca_file={}", certs.p("ca.crt")),
    ]);
    pg.set_hba(
        "local all all trust\n\
         host all postgres 127.0.0.1/32 trust\n\
         hostssl all certuser 127.0.0.1/32 cert\n\
         hostssl all all 127.0.0.1/32 scram-sha-256\n",
    )
    .await;
    let ca = certs.p("ca.crt");
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
        let role = role_with_password(&db, "tls-pw").await;
        let as_role = TestDb {
            url: if params.is_empty() {
                role.url.clone()
            } else {
                format!("{}?{params}", role.url)
            },
            ..role
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
    let cert_db = TestDb {
        url: format!(
            "postgres://certuser@localhost:{port}/{}?sslmode=verify-full&sslrootcert={ca}&sslcert={}&sslkey={}",
            db.name,
            certs.p("client.crt"),
            certs.p("client.key")
        ),
        name: db.name.clone(),
        slot: db.slot.clone(),
    };
    assert!(delivers(&db, &cert_db, &[]).await, "client certificate");

    // The wrong CA: refused at the first connection, saying why.
    let db = TestDb::on(&pg.url, "pgbadca", true).await;
    let role = role_with_password(&db, "tls-pw").await;
    let bad = TestDb {
        url: format!(
            "{}?sslmode=verify-full&sslrootcert={}",
            role.url,
            certs.p("other-ca.crt")
        ),
        ..role
    };
    let redis = Redis::start();
    let msg = Relay::failure(run_args(&bad, &redis.url, &[])).await;
    assert!(
        msg.contains("cannot connect to PostgreSQL") && msg.contains("UnknownIssuer"),
        "{msg}"
    );
    // And plain TCP is refused for the relay's role (so the runs above did use TLS).
    let plain = TestDb {
        url: format!("{}?sslmode=disable", bad.url.split('?').next().unwrap()),
        name: bad.name.clone(),
        slot: bad.slot.clone(),
    };
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
    let (ca, cert, key) = (
        certs.p("ca.crt"),
        certs.p("client.crt"),
        certs.p("client.key"),
    );
    let tls_flags = [
        "--valkey-ca-file",
        &ca,
        "--valkey-client-cert-file",
        &cert,
        "--valkey-client-key-file",
        &key,
    ];
    let relay = Relay::start_streaming(run_args(&db, &tls_url, &tls_flags)).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "valkey.tls", 20, 5).await;
    assert_eq!(wait_pending(&redis, "default", 20).await, ids);
    relay.stop().await;
    let (code, out, err) = run_cmd(
        &["status", "--json"],
        &[
            ("OUTBOX_DATABASE_URL", &db.url),
            ("OUTBOX_VALKEY_URL", &tls_url),
            ("OUTBOX_VALKEY_CA_FILE", &ca),
            ("OUTBOX_VALKEY_CLIENT_CERT_FILE", &cert),
            ("OUTBOX_VALKEY_CLIENT_KEY_FILE", &key),
            ("OUTBOX_SLOT", &db.slot),
        ],
    );
    assert_eq!(code, 0, "{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(status["queues"][0]["pending"], 20, "{out}");

    let other_ca = certs.p("other-ca.crt");
    for (what, flags) in [
        ("no client certificate", &["--valkey-ca-file", &ca][..]),
        (
            "another CA",
            &[
                "--valkey-ca-file",
                &other_ca,
                "--valkey-client-cert-file",
                &cert,
                "--valkey-client-key-file",
                &key,
            ],
        ),
    ] {
        let msg = Relay::failure(run_args(&db, &tls_url, flags)).await;
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
    let pg = OwnPg::start(&[
        "-c",
        "ssl=on",
        "-c",
        &format!("ssl_cert_file={}", certs.p("elsewhere.crt")),
        "-c",
        &format!("ssl_key_file={}", certs.p("pg-elsewhere.key")),
    ]);
    pg.set_hba(
        "local all all trust\n\
         host all postgres 127.0.0.1/32 trust\n\
         hostssl all all 127.0.0.1/32 scram-sha-256\n",
    )
    .await;
    let db = TestDb::on(&pg.url, "verifyca", true).await;
    let role = role_with_password(&db, "tls-pw").await;
    let with = |params: String| TestDb {
        url: format!("{}?{params}", role.url),
        name: role.name.clone(),
        slot: role.slot.clone(),
    };
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
    let pg = OwnPg::start(&[
        "-c",
        "ssl=on",
        "-c",
        &format!("ssl_cert_file={}", certs.p("server.crt")),
        "-c",
        &format!("ssl_key_file={}", certs.p("pg-server.key")),
        "-c",
        "ssl_min_protocol_version=TLSv1",
        "-c",
        "ssl_max_protocol_version=TLSv1.1",
    ]);
    pg.set_hba(
        "local all all trust\n\
         host all postgres 127.0.0.1/32 trust\n\
         host all all 127.0.0.1/32 scram-sha-256\n",
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
    let role = role_with_password(&db, "tls-pw").await;
    let with = |params: &str| TestDb {
        url: format!("{}?{params}", role.url),
        name: role.name.clone(),
        slot: role.slot.clone(),
    };

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
    let default = TestDb {
        url: role.url.clone(),
        name: role.name.clone(),
        slot: role.slot.clone(),
    };
    assert!(!delivers(&db, &default, &[]).await);
}
