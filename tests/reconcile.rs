//! `reconcile`: a Valkey restarted without persistence loses tasks the relay wrote and
//! acknowledged; reconcile finds exactly those and enqueues them again. And the start-up
//! warning about a Valkey without AOF and without replicas.

mod common;

use common::asynq_states::AsynqWorker;
use common::*;
use serde_json::Value;
use std::collections::BTreeSet;

fn cli_json(db: &TestDb, redis: &Redis, args: &[&str]) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(args)
        .env("OUTBOX_DATABASE_URL", &db.url)
        .env("OUTBOX_VALKEY_URL", &redis.url)
        .env("OUTBOX_SLOT", &db.slot)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?} failed:\n{err}");
    serde_json::from_slice(&out.stdout).unwrap()
}

async fn published(db: &TestDb) -> i64 {
    db.client()
        .await
        .query_one(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

fn missing_ids(v: &Value) -> BTreeSet<String> {
    v["missing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["event_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_heals_exactly_what_a_restart_without_persistence_lost() {
    let db = TestDb::new("reconcile").await;
    let redis = Redis::start();
    let relay = RelayProcess::spawn_streaming(&db, &redis.url, &[]).await;
    let mut c = db.client().await;
    let lost = insert_events(&mut c, "order.placed", 30, 10).await;
    wait_pending(&redis, "default", 30).await;
    eventually("30 rows published", || async {
        (published(&db).await == 30).then_some(())
    })
    .await;
    // A worker completes ten of them: kept for the retention, present until the restart.
    let mut worker = AsynqWorker::new(redis.conn().await, "default");
    for _ in 0..10 {
        let t = worker.dequeue().await.unwrap();
        worker.succeed(&t).await;
    }
    let before = cli_json(&db, &redis, &["reconcile", "--json", "--since", "1h"]);
    assert_eq!(
        (before["checked"].clone(), before["present"].clone()),
        (30.into(), 30.into())
    );
    assert!(missing_ids(&before).is_empty());

    // Valkey restarts without persistence: every task is gone, the rows stay published.
    redis.stop();
    redis.restart();
    let kept = insert_events(&mut c, "order.placed", 20, 5).await;
    let pending = wait_pending(&redis, "default", 20).await;
    assert_eq!(pending, kept, "the relay carries on after the restart");
    eventually("50 rows published", || async {
        (published(&db).await == 50).then_some(())
    })
    .await;
    assert!(
        relay.log_text().contains("valkey runs without AOF"),
        "run warns at start about a Valkey without AOF and replicas:\n{}",
        relay.log_text()
    );

    let t = cli_json(&db, &redis, &["trace", "--json", &lost[0]]);
    assert_eq!(t[0]["verdict"]["kind"], "lost_by_sink");

    let found = cli_json(&db, &redis, &["reconcile", "--json", "--since", "1h"]);
    assert_eq!(found["checked"], 50);
    assert_eq!(found["present"], 20);
    assert_eq!(
        missing_ids(&found),
        lost.iter().cloned().collect::<BTreeSet<_>>()
    );
    assert_eq!(found["performed"], false);
    assert_eq!(
        pending_ids(&mut redis.conn().await, "default").await.len(),
        20,
        "a report writes nothing"
    );

    let healed = cli_json(
        &db,
        &redis,
        &["reconcile", "--json", "--since", "1h", "--yes"],
    );
    assert_eq!(healed["enqueued"], 30);
    let pending = pending_ids(&mut redis.conn().await, "default").await;
    assert_eq!(
        pending,
        [kept.clone(), lost.clone()].concat(),
        "re-enqueued in row order, after the rest"
    );
    let t = cli_json(&db, &redis, &["trace", "--json", &lost[0]]);
    assert_eq!(t[0]["task"]["state"], "pending");
    let after = cli_json(&db, &redis, &["reconcile", "--json", "--since", "1h"]);
    assert!(missing_ids(&after).is_empty());
    assert_eq!(after["present"], 50);

    // Rows created longer ago than the retention are not judged.
    c.batch_execute("UPDATE outbox_events SET created_at = now() - interval '2 days'")
        .await
        .unwrap();
    let old = cli_json(&db, &redis, &["reconcile", "--json", "--since", "7d"]);
    assert_eq!(
        (old["checked"].clone(), old["too_old"].clone()),
        (0.into(), 50.into())
    );
    drop(relay);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durability_is_read_from_info() {
    let volatile = Redis::start();
    let aof = Redis::start_with(&["--appendonly", "yes"], None);
    for (redis, expect) in [(&volatile, true), (&aof, false)] {
        let target = outbox_relay::valkey::ValkeyTarget::new(
            &redis.url,
            &outbox_relay::valkey::Topology::Single,
            std::time::Duration::from_secs(5),
            None,
        )
        .unwrap();
        let conn = target.connect().await.unwrap();
        let found = outbox_relay::valkey_durability::check(&conn).await.unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].volatile(), expect, "{found:?}");
    }
}
