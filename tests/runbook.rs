//! Runs the SQL and shell blocks of docs/operations.md, in the order written, against a
//! throwaway primary and streaming standby of the version under test (the matrix runs it on each).
//!
//! How blocks are marked is in tests/common/runbook_blocks.rs. The major-version upgrade's
//! blocks (`upgrade`, `upgraded`) need two installs and are tests/upgrade.rs's; this test runs
//! every other block.

mod common;

use common::pg_standby::{server_major, PgPair};
use common::runbook_blocks::{blocks, operations_doc, UPGRADE_SERVERS};
use common::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_runbook_command_runs() {
    let blocks: Vec<_> = blocks(&operations_doc())
        .into_iter()
        .filter(|b| !UPGRADE_SERVERS.contains(&b.server.as_str()))
        .collect();
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
        let where_ = b.place();
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
            for statement in b.statements() {
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
