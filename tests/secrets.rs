//! Secrets never leave the process (logs, command output, metrics), and secrets from files:
//! read before anything connects, named when they cannot be used.

mod common;

use common::topologies::{assert_each_delivered_once, ValkeySentinel};
use common::*;

/// Distinctive secrets: the test fails if any of them shows up where it must not.
const PG_SECRET: &str = "pgSecretQx7Zr4Lw";
const VK_SECRET: &str = "vkSecretWm4Np9Td";
const PG_WRONG: &str = "pgWrongPw3Hs8Kb";
const VK_WRONG: &str = "vkWrongPw6Jc2Fy";
const SN_SECRET: &str = "snSecretKv5Rb8Yz";
const SN_WRONG: &str = "snWrongPw4Lp7Mc";

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
    let pg = OwnPg::start_scram().await;
    let db = TestDb::on(&pg.url, "secrets", true).await;
    let role = db.least_privilege_role_with_password(PG_SECRET).await;
    let redis = Redis::start_with(&[], Some(VK_SECRET));
    let valkey_addr = format!("127.0.0.1:{}", port_of(&redis.url));
    let files = tmp_dir("secret-files");
    let url_file = files.join("database-url");
    std::fs::write(&url_file, format!("{}\n", role.url)).unwrap();
    let pw_file = files.join("valkey-password");
    std::fs::write(&pw_file, format!("{VK_SECRET}\n")).unwrap();
    let metrics_port = free_port().to_string();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");

    let mut relay = RelayProcess::spawn_env(
        &[
            ("OUTBOX_DATABASE_URL_FILE", url_file.to_str().unwrap()),
            ("VALKEY_ADDR", &valkey_addr),
            ("VALKEY_PASSWORD_FILE", pw_file.to_str().unwrap()),
            ("OUTBOX_SLOT", &db.slot),
            ("OUTBOX_METRICS_ADDR", &metrics_addr),
            ("OUTBOX_HEALTH_INTERVAL", "1s"),
            ("OUTBOX_HEARTBEAT_INTERVAL", "1s"),
            ("OUTBOX_LOG", "debug"),
        ],
        &[],
    );
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
        let (code, out, err) = run_command(args, env);
        assert_eq!(code, 0, "{args:?}: {err}");
        outputs.push((format!("{args:?}"), format!("{out}\n{err}")));
    }
    assert!(outputs[0].1.contains("default"), "{}", outputs[0].1);
    // `status` with a wrong Valkey password reports Valkey unreachable.
    let wrong_vk = vk_url.replace(VK_SECRET, VK_WRONG);
    let (code, out, err) = run_command(
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
    let mut bad_pg = RelayProcess::spawn_env(
        &[
            ("OUTBOX_DATABASE_URL", &wrong_pg),
            ("OUTBOX_VALKEY_URL", &vk_url),
            ("OUTBOX_SLOT", &db.slot),
            ("OUTBOX_METRICS_ADDR", "127.0.0.1:0"),
            ("OUTBOX_LOG", "debug"),
        ],
        &[],
    );
    assert_eq!(bad_pg.exit_code().await, 1);
    let bad_pg_log = bad_pg.log_text();
    assert!(
        bad_pg_log.contains("password authentication failed"),
        "{bad_pg_log}"
    );
    let mut bad_vk = RelayProcess::spawn_env(
        &[
            ("OUTBOX_DATABASE_URL", &role.url),
            ("OUTBOX_VALKEY_URL", &wrong_vk),
            ("OUTBOX_SLOT", &db.slot),
            ("OUTBOX_METRICS_ADDR", "127.0.0.1:0"),
            ("OUTBOX_LOG", "debug"),
        ],
        &[],
    );
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
    let (code, _, err) = run_command(&["migrate"], &[("OUTBOX_DATABASE_URL_FILE", url_file)]);
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
        let (code, _, err) = run_command(&["run"], env);
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

    let mut relay = RelayProcess::spawn_env(&as_refs(&good), &[]);
    relay.wait_streaming(&db).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "sentinel.secret", 10, 5).await;
    let mut conn = sentinel.conn(sentinel.first_primary_port()).await;
    let expected = std::collections::HashMap::from([("default".to_owned(), ids)]);
    assert_each_delivered_once(&mut conn, &expected).await;
    let (code, out, err) = run_command(&["status", "--json"], &as_refs(&good));
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
        let mut bad = RelayProcess::spawn_env(&as_refs(&env(&extra)), &[]);
        assert_eq!(bad.exit_code().await, 1, "{what}: {}", bad.log_text());
        let text = bad.log_text();
        assert!(
            text.contains("cannot reach Valkey at redis://"),
            "{what}: {text}"
        );
        assert_no_secret(what, &text);
    }
}
