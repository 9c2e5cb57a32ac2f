//! The command line as a new user meets it, driven as the real binary: errors printed once and
//! without repeats, settings refused with a message that helps (exit code 2), secrets on the
//! command line warned about, and the operator commands saying what they did (`migrate`,
//! `cleanup --dry-run`, `peek`), plus the periodic summary of `run`.

mod common;

use common::*;
use serde_json::Value;

/// A Postgres URL nothing listens on (port 1 is never a test server's).
const NO_POSTGRES: &str = "postgres://postgres@127.0.0.1:1/postgres";
/// A Valkey URL nothing listens on.
const NO_VALKEY: &str = "redis://127.0.0.1:1/0";

/// The lines of `stderr` that report the failure.
fn error_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("error:") || l.contains("ERROR"))
        .collect()
}

/// Panics when a `: `-separated part of `line` comes twice.
fn assert_no_repeat(line: &str) {
    let parts: Vec<&str> = line.split(": ").collect();
    for (i, p) in parts.iter().enumerate() {
        assert!(
            !parts[i + 1..].contains(p),
            "{p:?} repeats in the error line: {line}"
        );
    }
}

#[test]
fn a_failing_command_prints_its_error_once_without_repeats() {
    for (args, env) in [
        (
            vec!["status"],
            vec![
                ("OUTBOX_DATABASE_URL", NO_POSTGRES),
                ("OUTBOX_VALKEY_URL", NO_VALKEY),
            ],
        ),
        (
            vec!["dead-letters", "list"],
            vec![("OUTBOX_DATABASE_URL", NO_POSTGRES)],
        ),
        (vec!["peek"], vec![("OUTBOX_VALKEY_URL", NO_VALKEY)]),
        (
            vec!["run"],
            vec![
                ("OUTBOX_DATABASE_URL", NO_POSTGRES),
                ("OUTBOX_VALKEY_URL", NO_VALKEY),
                ("OUTBOX_METRICS_ADDR", "127.0.0.1:0"),
            ],
        ),
    ] {
        let (code, _, err) = run_command(&args, &env);
        assert_eq!(code, 1, "{args:?}: {err}");
        let lines = error_lines(&err);
        assert_eq!(lines.len(), 1, "{args:?} should report once:\n{err}");
        assert_no_repeat(lines[0]);
    }
}

#[test]
fn an_invalid_log_filter_is_refused_not_silent() {
    for var in ["OUTBOX_LOG", "RUST_LOG"] {
        let (code, _, err) = run_command(
            &["dead-letters", "list"],
            &[("OUTBOX_DATABASE_URL", NO_POSTGRES), (var, "verbose")],
        );
        assert_eq!(code, 2, "{var}: {err}");
        assert!(err.contains(&format!("invalid {var}")), "{err}");
        assert!(err.contains("\"verbose\" is not a level"), "{err}");
    }
    // OUTBOX_LOG wins: a valid one hides a bad RUST_LOG.
    let (code, _, err) = run_command(
        &["dead-letters", "list"],
        &[
            ("OUTBOX_DATABASE_URL", NO_POSTGRES),
            ("OUTBOX_LOG", "warn"),
            ("RUST_LOG", "verbose"),
        ],
    );
    assert_eq!(code, 1, "{err}");
}

#[test]
fn command_line_mistakes_get_messages_that_help() {
    let db = [("OUTBOX_DATABASE_URL", NO_POSTGRES)];
    let (code, _, err) = run_command(&["dead-letters", "retry"], &db);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--all") && err.contains("--event-id"), "{err}");

    let (code, out, err) = run_command(&["dead-letters", "retry", "--event-id", "42"], &db);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("\"42\" is not an event id"), "{err}");

    let (code, _, err) = run_command(&["peek"], &[("OUTBOX_LOG_FORMAT", "yaml")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("possible values: text, json"), "{err}");

    // A decimal duration is accepted: the command goes on to connect (and fails there).
    let (code, _, err) = run_command(&["cleanup", "--older-than", "1.5s"], &db);
    assert_eq!(code, 1, "{err}");
    let (code, _, err) = run_command(&["cleanup", "--older-than", "1.s"], &db);
    assert_eq!(code, 2, "{err}");

    // A libpq parameter tokio-postgres does not know is refused at start, before any
    // connection (docs/configuration.md), not ignored.
    for param in ["sslcrl=/etc/crl.pem", "sslpassword=x"] {
        let url = format!("{NO_POSTGRES}?{param}");
        let (code, _, err) = run_command(&["status"], &[("OUTBOX_DATABASE_URL", &url)]);
        assert_eq!(code, 2, "{param}: {err}");
    }
}

#[test]
fn a_secret_flag_is_warned_about_once_without_its_value() {
    let (code, _, err) = run_command(
        &[
            "dead-letters",
            "list",
            "--database-url",
            "postgres://postgres:hunter2-secret@127.0.0.1:1/postgres",
        ],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert!(!err.contains("hunter2-secret"), "{err}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(warnings[0].contains("--database-url"), "{err}");
    assert!(warnings[0].contains("OUTBOX_DATABASE_URL_FILE"), "{err}");

    // The same secret from its variable: no warning.
    let (_, _, err) = run_command(
        &["dead-letters", "list"],
        &[("OUTBOX_DATABASE_URL", NO_POSTGRES)],
    );
    assert!(!err.contains("WARN"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_says_what_it_skipped() {
    // TestDb::new has migrated already: every file is found applied.
    let db = TestDb::new("cli_migrate").await;
    let env = [("OUTBOX_DATABASE_URL", db.url.as_str())];
    let (code, _, err) = run_command(&["migrate"], &env);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("migration applied"), "{err}");
    assert_eq!(err.matches("migration already applied").count(), 3, "{err}");
    assert!(err.contains("already_applied=3"), "{err}");

    // The optional trigger is new: that file alone is applied.
    let (code, _, err) = run_command(&["migrate", "--with-notify-trigger"], &env);
    assert_eq!(code, 0, "{err}");
    assert_eq!(err.matches("migration applied").count(), 1, "{err}");
    assert!(err.contains("outbox_relay_notify.sql"), "{err}");
    assert!(err.contains("applied=1"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_dry_run_counts_and_deletes_nothing() {
    let db = TestDb::new("cli_cleanup").await;
    let mut c = db.client().await;
    insert_events(&mut c, "order.placed", 5, 5).await;
    c.execute(
        "UPDATE outbox_events SET published_at = now() - interval '2 days' WHERE id IN \
         (SELECT id FROM outbox_events ORDER BY id LIMIT 3)",
        &[],
    )
    .await
    .unwrap();
    let env = [("OUTBOX_DATABASE_URL", db.url.as_str())];
    let out = run_command_ok(&["cleanup", "--older-than", "1.5d", "--dry-run"], &env);
    assert_eq!(out.trim(), "dry run: 3 published row(s) would be deleted");
    let left: i64 = c
        .query_one("SELECT count(*) FROM outbox_events", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 5);
    let out = run_command_ok(&["cleanup", "--older-than", "1.5d"], &env);
    assert_eq!(out.trim(), "deleted 3 published row(s)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_is_readable_and_run_logs_summaries() {
    let (db, redis) = database_and_redis("cli_peek").await;
    let mut relay =
        RelayProcess::spawn_streaming(&db, &redis.url, &["--log-summary-interval", "200ms"]).await;
    let mut c = db.client().await;
    let evil = "evil\u{202e}name\nnext";
    insert_named_events(&mut c, &[evil], 2, 2).await;
    wait_pending(&redis, "default", 2).await;
    let env = relay_env(&db, &redis.url);

    let text = run_command_ok(&["peek"], &env);
    assert_eq!(text.lines().count(), 3, "one line per task:\n{text}");
    assert!(text.contains("event:evil\\u{202e}name\\nnext"), "{text}");

    let json: Value = serde_json::from_str(&run_command_ok(&["peek", "--json"], &env)).unwrap();
    let tasks = json.as_array().unwrap();
    assert_eq!(tasks.len(), 2);
    assert!(tasks[0]["payload"].is_object(), "{json}");

    let (code, out, err) = run_command(&["peek", "--queue", "nosuch"], &env);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 1, "the header only: {out}");
    assert!(err.contains("not in asynq:queues"), "{err}");
    assert!(err.contains("known queues: default"), "{err}");

    // Summaries come while streaming; the first one after the events counts them.
    eventually("a summary counting the events", || {
        let log = relay.log_text();
        async move {
            log.lines()
                .any(|l| l.contains("summary of the last 0.2s") && l.contains("total=2"))
                .then_some(())
        }
    })
    .await;
    let log = relay.log_text();
    assert!(log.contains("wal_status=reserved"), "{log}");
    assert!(
        !log.contains("Some("),
        "debug formatting in the log:\n{log}"
    );
    relay.signal("TERM");
    assert_eq!(relay.exit_code().await, 0);
}
