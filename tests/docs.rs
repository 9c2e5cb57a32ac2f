//! Keeps the documentation and docker-compose.yml in step with the CLI.
//!
//! - docs/configuration.md has a table row for every flag of every subcommand, pairing it with
//!   its environment variable (or `—`) and naming its default; it names no flag or variable the
//!   CLI lacks.
//! - README.md and docs/*.md name no `OUTBOX_*`/`VALKEY_*` variable the binary does not read.
//! - docker-compose.yml sets only variables `outbox-relay run` reads, to values it accepts.
//!
//! No servers: the CLI is inspected through clap and parsed in-process.

use clap::{Command, CommandFactory, FromArgMatches};
use outbox_relay::config::{Cli, Command as Subcommand};
use std::collections::BTreeSet;
use std::path::PathBuf;

/// Variables read outside clap (by the binary, or the simulation's triage switch), with the
/// source file that reads each (checked, so this list cannot outlive the code).
const NOT_CLI_ENV: &[(&str, &str)] = &[
    ("OUTBOX_LOG", "src/main.rs"),
    // The simulation's triage switch (docs/reliability.md), not the binary's.
    ("OUTBOX_SIM_WATCH", "tests/sim/valkey.rs"),
];

fn read(relative: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// One argument with a long flag, in one (sub)command.
#[derive(Debug)]
struct CliArg {
    /// `outbox-relay dead-letters retry`, for messages.
    command: String,
    long: String,
    env: Option<String>,
    defaults: Vec<String>,
    takes_value: bool,
}

/// The arguments of `cmd` itself; clap's own `--help`/`--version` are left out.
fn args_of(cmd: &Command, path: &str) -> Vec<CliArg> {
    cmd.get_arguments()
        .filter_map(|arg| {
            let long = arg.get_long()?;
            if matches!(long, "help" | "version") {
                return None;
            }
            Some(CliArg {
                command: path.to_owned(),
                long: long.to_owned(),
                env: arg.get_env().map(|e| e.to_string_lossy().into_owned()),
                defaults: arg
                    .get_default_values()
                    .iter()
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect(),
                takes_value: arg.get_action().takes_values(),
            })
        })
        .collect()
}

/// The arguments of `cmd` and of its subcommands, recursively.
fn collect(cmd: &Command, path: &str, out: &mut Vec<CliArg>) {
    out.extend(args_of(cmd, path));
    for sub in cmd.get_subcommands() {
        collect(sub, &format!("{path} {}", sub.get_name()), out);
    }
}

fn cli_args() -> Vec<CliArg> {
    let mut out = Vec::new();
    collect(&Cli::command(), "outbox-relay", &mut out);
    assert!(
        out.iter()
            .any(|a| a.env.as_deref() == Some("OUTBOX_DATABASE_URL")),
        "walking the CLI found no OUTBOX_DATABASE_URL: the walk is broken"
    );
    out
}

fn cli_env_names(args: &[CliArg]) -> BTreeSet<String> {
    args.iter().filter_map(|a| a.env.clone()).collect()
}

/// The CLI with every environment lookup removed, so the test's own environment cannot change
/// what parses.
fn without_env(cmd: Command) -> Command {
    cmd.mut_args(|a| a.env(None::<&'static str>))
        .mut_subcommands(without_env)
}

/// Every `OUTBOX_*` / `VALKEY_*` name in `text` (a name ending in `_` is a prefix, not a name).
fn env_like_names(text: &str) -> BTreeSet<String> {
    let is_word = |c: char| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_';
    text.split(|c: char| !is_word(c))
        .filter(|t| {
            ["OUTBOX_", "VALKEY_"]
                .iter()
                .any(|p| t.len() > p.len() && t.starts_with(p))
                && !t.ends_with('_')
        })
        .map(str::to_owned)
        .collect()
}

/// A row of a `| variable | flag | default | meaning |` table.
#[derive(Debug)]
struct Row {
    line: usize,
    variable: String,
    flag: String,
    default: String,
}

/// The spans between backticks in a table cell.
fn code_spans(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

fn doc_rows(doc: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut in_table = false;
    for (i, line) in doc.lines().enumerate() {
        let t = line.trim();
        if !t.starts_with('|') {
            in_table = false;
            continue;
        }
        let cells: Vec<&str> = t
            .trim_start_matches('|')
            .trim_end_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        if cells.first() == Some(&"variable") {
            assert_eq!(
                cells,
                ["variable", "flag", "default", "meaning"],
                "docs/configuration.md line {}: settings tables have the columns \
                 | variable | flag | default | meaning |",
                i + 1
            );
            in_table = true;
            continue;
        }
        if !in_table
            || cells
                .iter()
                .all(|c| c.chars().all(|ch| ch == '-' || ch == ':'))
        {
            continue;
        }
        assert_eq!(
            cells.len(),
            4,
            "docs/configuration.md line {}: a settings row has 4 cells (is there a `|` inside a cell?)",
            i + 1
        );
        rows.push(Row {
            line: i + 1,
            variable: cells[0].to_owned(),
            flag: cells[1].to_owned(),
            default: cells[2].to_owned(),
        });
    }
    rows
}

#[test]
fn configuration_md_documents_every_flag_and_variable() {
    let args = cli_args();
    let envs = cli_env_names(&args);
    let longs: BTreeSet<String> = args.iter().map(|a| format!("--{}", a.long)).collect();
    let doc = read("docs/configuration.md");
    let rows = doc_rows(&doc);
    assert!(
        !rows.is_empty(),
        "docs/configuration.md has no settings table"
    );

    let mut problems = Vec::new();
    for a in &args {
        let flag = format!("`--{}`", a.long);
        let variable = a
            .env
            .as_ref()
            .map_or_else(|| "—".to_owned(), |e| format!("`{e}`"));
        let matching: Vec<&Row> = rows
            .iter()
            .filter(|r| r.flag.contains(&flag) && r.variable == variable)
            .collect();
        if matching.is_empty() {
            problems.push(format!(
                "no row pairs {variable} with {flag} ({}); documented rows for that flag: {:?}",
                a.command,
                rows.iter()
                    .filter(|r| r.flag.contains(&flag))
                    .map(|r| (&r.variable, r.line))
                    .collect::<Vec<_>>()
            ));
            continue;
        }
        for d in a.defaults.iter().filter(|d| !d.is_empty()) {
            let want = format!("`{d}`");
            if !matching.iter().any(|r| r.default.contains(&want)) {
                problems.push(format!(
                    "{variable} / {flag} ({}): the default column does not say {want} \
                     (line {})",
                    a.command, matching[0].line
                ));
            }
        }
    }
    for r in &rows {
        if r.variable != "—" {
            let name = r.variable.trim_matches('`');
            if !envs.contains(name) {
                problems.push(format!(
                    "line {}: {} is not an environment variable of the CLI",
                    r.line, r.variable
                ));
            }
        }
        for span in code_spans(&r.flag) {
            if span.starts_with("--") && !longs.contains(span) {
                problems.push(format!(
                    "line {}: `{span}` is not a flag of the CLI",
                    r.line
                ));
            }
        }
    }
    for name in env_like_names(&doc) {
        if !envs.contains(&name) && !NOT_CLI_ENV.iter().any(|(n, _)| *n == name) {
            problems.push(format!(
                "docs/configuration.md names {name}, which the CLI does not read"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "docs/configuration.md drifted from the CLI:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn the_docs_name_only_variables_the_binary_reads() {
    let envs = cli_env_names(&cli_args());
    for (name, file) in NOT_CLI_ENV {
        assert!(
            read(file).contains(&format!("\"{name}\"")),
            "{name} is listed as read by {file}, which no longer reads it"
        );
    }
    let mut files = vec!["README.md".to_owned()];
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs");
    for entry in std::fs::read_dir(dir).expect("docs/ exists") {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            files.push(format!("docs/{name}"));
        }
    }
    files.sort();
    let mut problems = Vec::new();
    for file in &files {
        for name in env_like_names(&read(file)) {
            if !envs.contains(&name) && !NOT_CLI_ENV.iter().any(|(n, _)| *n == name) {
                problems.push(format!(
                    "{file} names {name}, which the binary does not read"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A `KEY: value` of the compose file, or of a commented-out example.
#[derive(Debug, Clone)]
struct ComposeVar {
    line: usize,
    key: String,
    value: String,
    commented: bool,
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The lines under line `at` (indented deeper than it), as (line number, text).
fn block(lines: &[&str], at: usize) -> Vec<(usize, String)> {
    let base = indent(lines[at]);
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate().skip(at + 1) {
        let t = line.trim();
        if t.is_empty() {
            continue;
        }
        if indent(line) <= base && !t.starts_with('#') {
            break;
        }
        if indent(line) > base {
            out.push((i + 1, (*line).to_owned()));
        }
    }
    out
}

/// `OUTBOX_X: "v"` or `- OUTBOX_X=v`, possibly behind `#`.
fn parse_var(line_no: usize, line: &str) -> Option<ComposeVar> {
    let mut t = line.trim();
    let commented = t.starts_with('#');
    if commented {
        t = t.trim_start_matches('#').trim();
    }
    let (key, value) = match t.strip_prefix("- ") {
        Some(item) => item.split_once('=')?,
        None => t.split_once(':')?,
    };
    let key = key.trim();
    if !(key.starts_with("OUTBOX_") || key.starts_with("VALKEY_"))
        || !key
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    {
        return None;
    }
    let mut value = value.trim();
    let quoted = value.len() >= 2
        && ((value.starts_with('"') && value[1..].contains('"'))
            || (value.starts_with('\'') && value[1..].contains('\'')));
    if quoted {
        let q = &value[..1];
        let end = value[1..].find(q).expect("closing quote") + 1;
        value = &value[1..end];
    } else if let Some(hash) = value.find(" #") {
        value = value[..hash].trim();
    }
    Some(ComposeVar {
        line: line_no,
        key: key.to_owned(),
        value: value.to_owned(),
        commented,
    })
}

/// The relay service's environment, with `<<: *anchor` merges resolved.
fn compose_relay_env(yaml: &str) -> Vec<ComposeVar> {
    let lines: Vec<&str> = yaml.lines().collect();
    let find = |pred: &dyn Fn(usize, &str) -> bool| {
        lines
            .iter()
            .enumerate()
            .find(|(i, l)| pred(*i, l))
            .map(|(i, _)| i)
    };
    let services =
        find(&|_, l| l.trim_end() == "services:").expect("docker-compose.yml: services:");
    let relay = block(&lines, services)
        .into_iter()
        .find(|(_, l)| l.trim() == "relay:")
        .map(|(n, _)| n - 1)
        .expect("docker-compose.yml: a `relay` service");
    let env = block(&lines, relay)
        .into_iter()
        .find(|(_, l)| l.trim() == "environment:")
        .map(|(n, _)| n - 1)
        .expect("docker-compose.yml: the relay service has an environment");
    let mut vars = Vec::new();
    for (n, line) in block(&lines, env) {
        if let Some(anchor) = line.trim().strip_prefix("<<:") {
            let anchor = anchor.trim().trim_start_matches('*');
            let def =
                find(&|_, l| l.trim_end().ends_with(&format!("&{anchor}"))).unwrap_or_else(|| {
                    panic!("docker-compose.yml line {n}: anchor &{anchor} not found")
                });
            vars.extend(
                block(&lines, def)
                    .into_iter()
                    .filter_map(|(n, l)| parse_var(n, &l)),
            );
        } else if let Some(v) = parse_var(n, &line) {
            vars.push(v);
        }
    }
    vars
}

#[test]
fn docker_compose_sets_only_real_variables_to_accepted_values() {
    check_compose(&read("docker-compose.yml"));
}

/// `outbox-relay run` with `flags` (and a placeholder database URL unless `flags` has one):
/// parsed without any environment lookup, then validated as `main` does before connecting.
fn run_accepts(flags: &[String]) -> Result<(), String> {
    let has_db = flags.iter().any(|f| f.starts_with("--database-url="));
    let argv: Vec<&str> = ["outbox-relay", "run"]
        .into_iter()
        .chain(flags.iter().map(String::as_str))
        .chain((!has_db).then_some("--database-url=postgres://u@h/d"))
        .collect();
    let matches = without_env(Cli::command())
        .try_get_matches_from(argv)
        .map_err(|e| e.render().to_string())?;
    let cli = Cli::from_arg_matches(&matches).map_err(|e| e.render().to_string())?;
    match cli.command {
        Subcommand::Run(args) => args.validate().map_err(|e| e.to_string()),
        other => Err(format!("parsed as {other:?}, not `run`")),
    }
}

/// Panics, naming each variable, when the relay's environment in `yaml` sets a variable
/// `outbox-relay run` does not read, or a value it refuses. Commented-out examples
/// (`# OUTBOX_X: "..."`) are checked too, one at a time on top of the rest.
fn check_compose(yaml: &str) {
    let vars = compose_relay_env(yaml);
    assert!(
        vars.iter().any(|v| !v.commented),
        "docker-compose.yml: found no OUTBOX_*/VALKEY_* in the relay's environment"
    );
    // The relay service runs `outbox-relay run`: its variables are those of `run` (and global).
    let root = Cli::command();
    let run = root.find_subcommand("run").expect("the CLI has `run`");
    let mut run_args = args_of(&root, "outbox-relay");
    collect(run, "outbox-relay run", &mut run_args);

    let mut problems = Vec::new();
    // (variable, its long flag, the flag with its value)
    let mut flags: Vec<(&ComposeVar, &str, String)> = Vec::new();
    for v in &vars {
        let what = format!(
            "docker-compose.yml line {}: {}{}",
            v.line,
            v.key,
            if v.commented {
                " (commented-out example)"
            } else {
                ""
            }
        );
        let Some(arg) = run_args.iter().find(|a| a.env.as_deref() == Some(&v.key)) else {
            problems.push(format!(
                "{what} is not an environment variable of `outbox-relay run`"
            ));
            continue;
        };
        if v.value.contains('$') {
            problems.push(format!(
                "{what} uses interpolation, which this test does not resolve"
            ));
        } else if arg.takes_value {
            flags.push((v, arg.long.as_str(), format!("--{}={}", arg.long, v.value)));
        } else if v.value == "true" {
            flags.push((v, arg.long.as_str(), format!("--{}", arg.long)));
        } else {
            problems.push(format!(
                "{what} is a switch without a value; only \"true\" maps to a flag, got {:?}",
                v.value
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    let set: Vec<String> = flags
        .iter()
        .filter(|(v, _, _)| !v.commented)
        .map(|(_, _, f)| f.clone())
        .collect();
    for (v, _, flag) in &flags {
        // Each value alone, so a refusal names its variable.
        if let Err(e) = run_accepts(std::slice::from_ref(flag)) {
            problems.push(format!(
                "docker-compose.yml line {}: {}={:?} is refused by `outbox-relay run` (as {flag}):\n{e}",
                v.line, v.key, v.value
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // Then all of them together, and each example on top of them.
    if let Err(e) = run_accepts(&set) {
        panic!(
            "docker-compose.yml: the relay's environment together is refused by `outbox-relay run` \
             (as flags: {set:?}):\n{e}"
        );
    }
    for (v, long, flag) in flags.iter().filter(|(v, _, _)| v.commented) {
        let same = format!("--{long}=");
        let mut with: Vec<String> = set
            .iter()
            .filter(|f| !f.starts_with(&same))
            .cloned()
            .collect();
        with.push(flag.clone());
        if let Err(e) = run_accepts(&with) {
            panic!(
                "docker-compose.yml line {}: the commented-out example {} is refused together with \
                 the rest (as {flag}):\n{e}",
                v.line, v.key
            );
        }
    }
}

/// Every source file under `dir` (recursively), as text.
fn sources(dir: &std::path::Path, out: &mut String) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

/// docs/reliability.md's "What each test proves" names tests that exist: each test name there
/// is a `fn` under tests/ or src/.
#[test]
fn reliability_md_names_only_existing_tests() {
    let doc = read("docs/reliability.md");
    let start = doc
        .find("## What each test proves")
        .expect("docs/reliability.md has a \"What each test proves\" section");
    let section = &doc[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut code = String::new();
    sources(&root.join("tests"), &mut code);
    sources(&root.join("src"), &mut code);
    let mut named = 0;
    let mut missing = Vec::new();
    for line in section.lines().filter(|l| l.starts_with('|')) {
        let Some(tests) = line.split('|').nth(2) else {
            continue;
        };
        for span in code_spans(tests) {
            let is_test_name = span.matches('_').count() >= 3
                && !span.starts_with("outbox_")
                && span
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !is_test_name {
                continue;
            }
            named += 1;
            if !code.contains(&format!("fn {span}(")) {
                missing.push(span.to_owned());
            }
        }
    }
    assert!(named >= 20, "only {named} test names found in the section");
    assert!(missing.is_empty(), "no such test: {missing:?}");
}

/// docs/task-format.md shows the enqueue script the relay runs, not an older one: the ```lua
/// block under "### The enqueue script" is `ENQUEUE_SCRIPT`, line for line.
#[test]
fn task_format_md_shows_the_enqueue_script_the_relay_runs() {
    let doc = read("docs/task-format.md");
    let section = doc
        .split_once("### The enqueue script")
        .expect("task-format.md has an enqueue script section")
        .1;
    let block = section
        .split_once("```lua\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .expect("the section holds a ```lua block")
        .0;
    assert_eq!(
        block.trim(),
        outbox_relay::sink::valkey::ENQUEUE_SCRIPT.trim(),
        "docs/task-format.md's enqueue script differs from src/sink/valkey.rs's ENQUEUE_SCRIPT"
    );
}
