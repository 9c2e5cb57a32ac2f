//! Runs every SQL and shell block of docs/operations.md, in the order written, against a
//! throwaway primary and streaming standby of the version under test (the matrix runs it on each).
//!
//! Each block carries a comment `<!-- runbook: SERVER[, N+][, wait] -->` just above it:
//! SERVER is `primary`, `standby`, `new primary` (the standby once promoted), `old primary`, or
//! `shell` (run with bash, `$PRIMARY_URL` and `$STANDBY_URL` set); `N+` skips it before version N;
//! `wait` repeats it until it returns a row. A block without the comment fails the test, so the
//! runbook cannot hold a command that was never run.

mod common;

use common::pg_standby::{server_major, PgPair};
use common::*;
use std::time::Duration;

#[derive(Debug)]
struct Block {
    line: usize,
    lang: String,
    server: String,
    min_major: i32,
    wait: bool,
    text: String,
}

fn blocks(doc: &str) -> Vec<Block> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim();
        let Some(lang) = line
            .strip_prefix("```")
            .filter(|l| matches!(*l, "sql" | "sh"))
        else {
            i += 1;
            continue;
        };
        let note = (i > 0)
            .then(|| lines[i - 1].trim())
            .and_then(|l| l.strip_prefix("<!-- runbook:"))
            .and_then(|l| l.strip_suffix("-->"))
            .unwrap_or_else(|| {
                panic!(
                    "docs/operations.md line {}: a {lang} block without a `<!-- runbook: ... -->` comment",
                    i + 1
                )
            });
        let mut block = Block {
            line: i + 1,
            lang: lang.to_owned(),
            server: String::new(),
            min_major: 0,
            wait: false,
            text: String::new(),
        };
        for word in note.split(',').map(str::trim) {
            if word == "wait" {
                block.wait = true;
            } else if let Some(v) = word.strip_suffix('+') {
                block.min_major = v.parse().expect("a version like 17+");
            } else if block.server.is_empty() {
                block.server = word.to_owned();
            }
        }
        assert!(
            matches!(
                block.server.as_str(),
                "primary" | "standby" | "new primary" | "old primary" | "shell"
            ),
            "docs/operations.md line {}: unknown server {:?}",
            block.line,
            block.server
        );
        i += 1;
        while i < lines.len() && lines[i].trim() != "```" {
            block.text.push_str(lines[i]);
            block.text.push('\n');
            i += 1;
        }
        out.push(block);
        i += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_runbook_command_runs() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let blocks = blocks(&doc);
    assert!(blocks.len() >= 8, "the runbook has its blocks");
    let pair = PgPair::start().await;
    let primary = connect(&pair.primary.url).await;
    assert_eq!(server_major(&primary).await, pair.major);
    // The relay's slot, as the relay creates it.
    outbox_relay::replication::setup::ensure_slot(&primary, "outbox_relay")
        .await
        .unwrap();
    let mut promoted = false;
    let mut ran = 0;
    for b in &blocks {
        if pair.major < b.min_major {
            continue;
        }
        let where_ = format!("docs/operations.md line {}", b.line);
        if b.lang == "sh" {
            let out = tokio::process::Command::new("bash")
                .args(["-euo", "pipefail", "-c", &b.text])
                .env("PRIMARY_URL", &pair.primary.url)
                .env("STANDBY_URL", &pair.standby.url)
                .output()
                .await
                .unwrap();
            assert!(
                out.status.success(),
                "{where_}: the shell block failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            println!("{where_}: {}", String::from_utf8_lossy(&out.stdout).trim());
            ran += 1;
            continue;
        }
        let url = match b.server.as_str() {
            "primary" | "old primary" => &pair.primary.url,
            _ => &pair.standby.url,
        };
        assert_eq!(
            b.server == "new primary" || b.server == "old primary",
            promoted,
            "{where_}: a {} block {} the promotion",
            b.server,
            if promoted { "after" } else { "before" }
        );
        let client = connect(url).await;
        if b.wait {
            eventually(&format!("{where_} returns a row"), || async {
                // What a consumer does: the primary's slot moves on, so the standby can sync it.
                let _ = primary
                    .batch_execute(
                        "CHECKPOINT; SELECT pg_replication_slot_advance('outbox_relay', pg_current_wal_lsn())",
                    )
                    .await;
                tokio::time::sleep(Duration::from_millis(400)).await;
                let rows = client.simple_query(&b.text).await.unwrap_or_else(|e| {
                    panic!("{where_}: {e:?}");
                });
                rows.iter()
                    .any(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(_)))
                    .then_some(())
            })
            .await;
        } else {
            // One statement at a time, as psql sends them (ALTER SYSTEM refuses a transaction).
            for statement in b.text.split(";\n").map(str::trim).filter(|s| !s.is_empty()) {
                client
                    .simple_query(statement)
                    .await
                    .unwrap_or_else(|e| panic!("{where_}: {statement}: {e:?}"));
            }
        }
        if b.text.contains("pg_promote") {
            promoted = true;
        }
        ran += 1;
    }
    assert!(promoted, "the runbook promotes the standby");
    println!(
        "RUNBOOK pg={} blocks_run={ran} of {}",
        pair.major,
        blocks.len()
    );
}
