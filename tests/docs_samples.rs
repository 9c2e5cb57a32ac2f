//! Every code sample of README.md and docs/*.md is compiled, run or checked here:
//!
//! - `rust`: the one Rust sample (docs/producers.md) is tests/samples/place_order.rs byte for
//!   byte, compiled into this test and run against a real database.
//! - `sql`: every block runs, in order, on a fresh migrated database of its own per file, with
//!   the substitutions listed in [`SQL_SUBSTITUTIONS`] (placeholders a reader fills in).
//! - `sh` and `console`: every command line is checked, since most start servers or run for
//!   ever: an `outbox-relay` line (with its `VAR=value` prefixes as flags) must parse with the
//!   real CLI, a `scripts/*.sh` line must name a script that exists and `bash -n` accepts, and a
//!   tool line (`promtool`, `python3`) must be a line `.ci/run` runs. Assignments must name
//!   variables the CLI reads, to values `run` accepts.
//! - Other languages (Go, Python, Lua, YAML, JSON, text) are not run here: there is no Go
//!   toolchain in CI; the Go and Lua that matter are checked by the golden task-format tests.

mod common;

use clap::{CommandFactory, FromArgMatches};
use common::*;
use outbox_relay::config::Cli;
use std::path::PathBuf;

// The sample of docs/producers.md, compiled as part of this test.
include!("samples/place_order.rs");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(relative: &str) -> String {
    std::fs::read_to_string(root().join(relative))
        .unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// README.md and docs/*.md, sorted.
fn doc_files() -> Vec<String> {
    let mut files = vec!["README.md".to_owned()];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            files.push(format!("docs/{name}"));
        }
    }
    files.sort();
    files
}

/// The fenced blocks of `text`: (language, first line number, body).
fn blocks(text: &str) -> Vec<(String, usize, String)> {
    let mut out = Vec::new();
    let mut open: Option<(String, usize, String, usize)> = None;
    // A block right after `<!-- runbook: ... -->` is run by tests/runbook.rs, against a primary
    // and a standby: its language is marked so the checks here pass it over.
    let mut runbook = false;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let indent = line.len() - t.len();
        if open.is_none() && !t.is_empty() && !t.starts_with("```") {
            runbook = t.starts_with("<!-- runbook:");
        }
        match (&mut open, t.strip_prefix("```")) {
            (None, Some(lang)) => {
                let lang = if runbook {
                    format!("runbook:{}", lang.trim())
                } else {
                    lang.trim().to_owned()
                };
                open = Some((lang, i + 2, String::new(), indent))
            }
            (Some(_), Some("")) => {
                let (lang, at, body, _) = open.take().unwrap();
                out.push((lang, at, body));
            }
            (Some((_, _, body, indent)), _) => {
                body.push_str(line.get(*indent..).unwrap_or(line.trim_start()));
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    assert!(open.is_none(), "an unclosed code fence");
    out
}

#[test]
fn the_rust_sample_is_the_compiled_one() {
    let rust: Vec<String> = doc_files()
        .iter()
        .flat_map(|f| blocks(&read(f)))
        .filter(|(lang, _, _)| lang == "rust")
        .map(|(_, _, body)| body)
        .collect();
    assert_eq!(
        rust.len(),
        1,
        "one Rust sample (docs/producers.md); add new ones here"
    );
    assert_eq!(rust[0], read("tests/samples/place_order.rs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_sample_runs() {
    let db = TestDb::new("sample_rust").await;
    let mut c = db.client().await;
    c.batch_execute("CREATE TABLE orders (id bigserial PRIMARY KEY, customer text NOT NULL, total numeric NOT NULL)")
        .await
        .unwrap();
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let id = place_order(&mut c, "ada", "12.50", Some(tp))
        .await
        .expect("the sample in docs/producers.md runs");
    let row = c
        .query_one(
            "SELECT o.total::text, e.event_name, e.payload->>'total', e.metadata->>'traceparent' \
             FROM orders o, outbox_events e WHERE o.id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let got: (String, String, String, String) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        got,
        (
            "12.50".into(),
            "order.placed".into(),
            "12.50".into(),
            tp.into()
        )
    );
}

/// (file, text in a block, what the test runs instead): placeholders a reader replaces.
const SQL_SUBSTITUTIONS: &[(&str, &str, &str)] = &[
    // The handler's parameter.
    (
        "docs/consumers.md",
        "VALUES ($1, 'send_confirmation')",
        "VALUES (gen_random_uuid(), 'send_confirmation')",
    ),
    // The role's and the database's names.
    ("docs/configuration.md", "ROLE outbox_relay", "ROLE {role}"),
    ("docs/configuration.md", "TO outbox_relay", "TO {role}"),
    ("docs/configuration.md", "DATABASE shop", "DATABASE {db}"),
    // The slot of this test (slots are per cluster).
    (
        "docs/migrating-from-polling.md",
        "pg_drop_replication_slot('outbox_relay')",
        "pg_drop_replication_slot('{slot}')",
    ),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sql_sample_runs() {
    let mut ran = 0;
    for file in doc_files() {
        let sql: Vec<(usize, String)> = blocks(&read(&file))
            .into_iter()
            .filter(|(lang, _, _)| lang == "sql")
            .map(|(_, at, body)| (at, body))
            .collect();
        if sql.is_empty() {
            continue;
        }
        let db = TestDb::new("sample_sql").await;
        let c = db.client().await;
        // What the samples assume exists: the notify trigger (its removal is a sample) and
        // a slot of the default name's stand-in.
        let mut owner = db.client().await;
        outbox_relay::migrate::migrate(
            &mut owner,
            &outbox_relay::pgoutput::TableName::parse("outbox_events").unwrap(),
            "outbox_relay",
            true,
        )
        .await
        .unwrap();
        c.execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&db.slot],
        )
        .await
        .unwrap();
        let role = format!("doc_{}", db.name);
        for (at, body) in sql {
            let mut body = body;
            for (f, from, to) in SQL_SUBSTITUTIONS.iter().filter(|(f, _, _)| *f == file) {
                let _ = f;
                let to = to
                    .replace("{role}", &role)
                    .replace("{db}", &db.name)
                    .replace("{slot}", &db.slot);
                body = body.replace(from, &to);
            }
            c.batch_execute(&body)
                .await
                .unwrap_or_else(|e| panic!("{file} line {at}: the SQL sample fails: {e}\n{body}"));
            ran += 1;
        }
        let _ = c
            .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE IF EXISTS {role}"))
            .await;
        let _ = c
            .execute("SELECT pg_drop_replication_slot($1)", &[&db.slot])
            .await;
    }
    assert!(
        ran >= 6,
        "found only {ran} SQL samples: the block parser broke"
    );
}

/// The CLI with every environment lookup removed, so only the sample's own words count.
fn without_env(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| a.env(None::<&'static str>))
        .mut_subcommands(without_env)
}

/// The long flag of the argument reading `var` in `path` (a subcommand path), if any.
fn flag_of(var: &str, path: &[&str]) -> Option<String> {
    let mut cmd = Cli::command();
    let mut found = cmd
        .get_arguments()
        .find(|a| a.get_env().is_some_and(|e| e == var))
        .and_then(|a| a.get_long())
        .map(str::to_owned);
    for name in path {
        let Some(sub) = cmd.find_subcommand(name).cloned() else {
            break;
        };
        cmd = sub;
        if let Some(l) = cmd
            .get_arguments()
            .find(|a| a.get_env().is_some_and(|e| e == var))
            .and_then(|a| a.get_long())
        {
            found = Some(l.to_owned());
        }
    }
    found
}

/// Splits a shell line into words (single and double quotes, no expansions).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quote = None;
    let mut any = false;
    for ch in line.chars() {
        match (quote, ch) {
            (None, '#') if !any && cur.is_empty() => break,
            (None, '\'' | '"') => {
                quote = Some(ch);
                any = true;
            }
            (Some(q), c) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (_, c) => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

/// Checks one command line of a shell sample; `Err` says why it is wrong.
fn check_command(line: &str, ci: &str) -> Result<(), String> {
    let line = line.split(" #").next().unwrap_or(line).trim();
    let mut w = words(line);
    if w.first().map(String::as_str) == Some("export") {
        w.remove(0);
    }
    let split = w
        .iter()
        .position(|x| !x.contains('=') || x.starts_with('-'))
        .unwrap_or(w.len());
    let (assigns, cmd) = w.split_at(split);
    match cmd.first().map(String::as_str) {
        Some("outbox-relay") => {
            let sub: Vec<&str> = cmd[1..]
                .iter()
                .map(String::as_str)
                .take_while(|x| !x.starts_with('-'))
                .collect();
            let mut argv: Vec<String> = cmd.to_vec();
            for a in assigns {
                let (var, value) = a.split_once('=').unwrap();
                let flag = flag_of(var, &sub).ok_or_else(|| {
                    format!("{var} is not read by `outbox-relay {}`", sub.join(" "))
                })?;
                argv.push(format!("--{flag}={value}"));
            }
            // The docs assume the database URL in the environment ("Running it" in README).
            let wants_db = flag_of("OUTBOX_DATABASE_URL", &sub).is_some();
            if wants_db && !argv.iter().any(|a| a.starts_with("--database-url")) {
                argv.push("--database-url=postgres://u@h/d".into());
            }
            let matches = without_env(Cli::command())
                .try_get_matches_from(&argv)
                .map_err(|e| e.render().to_string())?;
            Cli::from_arg_matches(&matches)
                .map(drop)
                .map_err(|e| e.to_string())
        }
        Some(script) if script.starts_with("scripts/") => {
            let path = root().join(script);
            let ok = std::process::Command::new("bash")
                .arg("-n")
                .arg(&path)
                .status()
                .map_err(|e| e.to_string())?;
            if ok.success() {
                Ok(())
            } else {
                Err(format!("{script}: missing or `bash -n` fails"))
            }
        }
        Some(_) if ci.lines().any(|l| l.trim() == line) => Ok(()),
        // A build with a cargo feature: the feature must exist.
        Some("cargo") if cmd.get(1).map(String::as_str) == Some("build") => {
            let manifest = read("Cargo.toml");
            match cmd.iter().position(|a| a == "--features") {
                Some(i) => {
                    let feature = cmd.get(i + 1).ok_or("--features without a value")?;
                    let declared = format!("\n{feature} = ");
                    if manifest.contains(&declared) {
                        Ok(())
                    } else {
                        Err(format!("feature {feature} is not in Cargo.toml"))
                    }
                }
                None => Ok(()),
            }
        }
        // Copying a file the line before built.
        Some("cp") => Ok(()),
        Some(other) => Err(format!(
            "`{other}`: not a command this test knows how to check"
        )),
        None => {
            // Assignments alone: variables `run` reads, to values it accepts.
            for a in assigns {
                let (var, value) = a.split_once('=').unwrap();
                let flag = flag_of(var, &["run"])
                    .ok_or_else(|| format!("{var} is not read by `outbox-relay run`"))?;
                let mut argv = vec![
                    "outbox-relay".to_owned(),
                    "run".to_owned(),
                    format!("--{flag}={value}"),
                ];
                if flag != "database-url" {
                    argv.push("--database-url=postgres://u@h/d".into());
                }
                without_env(Cli::command())
                    .try_get_matches_from(argv)
                    .map_err(|e| e.render().to_string())?;
            }
            Ok(())
        }
    }
}

#[test]
fn every_shell_sample_line_is_checked() {
    let ci = read(".ci/run");
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in doc_files() {
        for (lang, at, body) in blocks(&read(&file)) {
            if !matches!(lang.as_str(), "sh" | "console" | "bash") {
                continue;
            }
            let joined = body.replace("\\\n", " ");
            for line in joined
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
            {
                checked += 1;
                if let Err(e) = check_command(line, &ci) {
                    problems.push(format!("{file} (block at line {at}): `{line}`: {e}"));
                }
            }
        }
    }
    assert!(
        checked >= 15,
        "found only {checked} shell lines: the block parser broke"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn a_broken_command_line_is_caught() {
    let ci = read(".ci/run");
    assert!(check_command("outbox-relay replay --since 2h", &ci).is_ok());
    assert!(check_command(
        "OUTBOX_DATABASE_URL=postgres://o@db/shop outbox-relay migrate",
        &ci
    )
    .is_ok());
    assert!(check_command("outbox-relay replay --sinse 2h", &ci).is_err());
    assert!(check_command("OUTBOX_NOPE=1 outbox-relay run", &ci).is_err());
    assert!(check_command("scripts/nope.sh", &ci).is_err());
    assert!(check_command("OUTBOX_QUEUE_ROUTES='a=b,oops'", &ci).is_err());
}

/// docs/migrating-from-polling.md: `migrate` gives up after its 10 s lock_timeout instead of
/// queueing producers behind it for as long as a long transaction lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_gives_up_behind_a_long_transaction() {
    let db = TestDb::new("sample_lock").await;
    let mut holder = db.client().await;
    let tx = holder.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE outbox_events IN ACCESS SHARE MODE")
        .await
        .unwrap();
    let mut c = db.client().await;
    let err = outbox_relay::migrate::migrate(
        &mut c,
        &outbox_relay::pgoutput::TableName::parse("outbox_events").unwrap(),
        "outbox_relay",
        false,
    )
    .await
    .expect_err("migrate must not wait for ever");
    let code = std::error::Error::source(&err)
        .and_then(|e| e.downcast_ref::<tokio_postgres::Error>())
        .and_then(|e| e.code().cloned());
    assert_eq!(
        code,
        Some(tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE),
        "{err:?}"
    );
    tx.rollback().await.unwrap();
}

/// docker-compose.yml's healthcheck of the relay, run by bash against a real relay: it passes
/// once the relay is ready, and fails where nothing listens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_healthcheck_passes_on_a_ready_relay() {
    let compose = read("docker-compose.yml");
    let probe = compose
        .lines()
        .map(|l| l.trim().trim_start_matches("- "))
        .find(|l| l.starts_with("exec 3<>/dev/tcp/127.0.0.1/9187"))
        .expect("the relay's healthcheck command in docker-compose.yml");
    let db = TestDb::new("sample_health").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &[])).await;
    let run = |port: u16| {
        let cmd = probe.replace("9187", &port.to_string());
        std::process::Command::new("bash")
            .arg("-c")
            .arg(cmd)
            .status()
            .unwrap()
            .success()
    };
    let port = relay.http.port();
    eventually("the healthcheck passes", || async {
        run(port).then_some(())
    })
    .await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    assert!(!run(closed_port), "nothing listens there");
    relay.stop().await;
}
