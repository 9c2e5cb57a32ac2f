//! `trace` and `replay`, driven as the real binary (`--json`), against tasks moved through
//! asynq's states by asynq's own scripts (tests/common/asynq_states.rs, asynq v0.26.0); and what
//! `replay` and `reconcile` do with tasks Valkey refuses for good.

mod common;

use common::asynq_states::{now_secs, AsynqWorker};
use common::*;
use serde_json::Value;

/// Runs the binary with the test's database and Valkey: (exit code, stdout, stderr).
fn cli(db: &TestDb, redis: &Redis, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(args)
        .env("OUTBOX_DATABASE_URL", &db.url)
        .env("OUTBOX_VALKEY_URL", &redis.url)
        .env("OUTBOX_SLOT", &db.slot)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// `cli` that must succeed, its stdout parsed as JSON.
fn cli_json(db: &TestDb, redis: &Redis, args: &[&str]) -> Value {
    let (code, out, err) = cli(db, redis, args);
    assert_eq!(code, 0, "{args:?} failed:\n{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}\n{out}"))
}

/// One event's trace.
fn trace(db: &TestDb, redis: &Redis, id: &str, extra: &[&str]) -> Value {
    let mut args = vec!["trace", "--json", id];
    args.extend_from_slice(extra);
    let v = cli_json(db, redis, &args);
    assert_eq!(v.as_array().unwrap().len(), 1);
    v[0].clone()
}

async fn wait_published(db: &TestDb, n: i64) {
    let c = db.client().await;
    eventually(&format!("{n} rows published"), || async {
        let got: i64 = c
            .query_one(
                "SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (got >= n).then_some(())
    })
    .await;
}

const ROUTES: [&str; 2] = ["--queue-routes", "pay.*=payments"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_names_every_state_a_worker_leaves() {
    let db = TestDb::new("trace").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &[
            &ROUTES[..],
            &["--task-max-retry", "1", "--recovery-grace", "1h"],
        ]
        .concat(),
    ))
    .await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "order.placed", 8, 1).await;
    let paid = insert_events(&mut c, "pay.captured", 1, 1).await.remove(0);
    wait_pending(&redis, "default", 8).await;
    wait_published(&db, 9).await;

    // A worker on `default`: ids[0] completed, ids[1] active, ids[2] retrying; the rest
    // pending. On `payments`: failed twice with MaxRetry 1, so archived.
    let mut worker = AsynqWorker::new(redis.conn().await, "default");
    let t0 = worker.dequeue().await.unwrap();
    assert_eq!(t0.id, ids[0], "servers take the oldest first");
    worker.succeed(&t0).await;
    let _t1 = worker.dequeue().await.unwrap();
    let t2 = worker.dequeue().await.unwrap();
    worker.fail(&t2, "card declined\nby bank", 3600).await;
    let mut payments = AsynqWorker::new(redis.conn().await, "payments");
    let p = payments.dequeue().await.unwrap();
    payments.fail(&p, "gateway down", 0).await;
    assert_eq!(payments.forward(now_secs() + 1).await, 1);
    let p = payments.dequeue().await.unwrap();
    assert_eq!(p.retried, 1);
    payments.fail(&p, "gateway still down", 0).await;

    let routes = &ROUTES[..];
    // The slot acknowledges past the rows' commits (on its own clock, once idle).
    let t = eventually("the slot is known past the row", || async {
        let t = trace(&db, &redis, &ids[0], routes);
        (t["slot"]["past_row_commit"] == true).then_some(t)
    })
    .await;
    assert_eq!(t["task"]["state"], "completed");
    assert!(t["task"]["kept_until"].is_string());
    assert_eq!(t["verdict"]["kind"], "delivered");
    assert!(t["row"]["published_at"].is_string());

    let t = trace(&db, &redis, &ids[1], routes);
    assert_eq!(t["task"]["state"], "active");
    assert!(t["task"]["lease_expires_at"].is_string());

    let t = trace(&db, &redis, &ids[2], routes);
    assert_eq!(t["task"]["state"], "retry");
    assert_eq!(t["task"]["last_error"], "card declined\nby bank");
    assert_eq!(t["task"]["retried"], 1);
    assert!(t["task"]["next_process_at"].is_string());
    let (_, text, _) = cli(&db, &redis, &["trace", &ids[2]]);
    assert!(
        text.contains("card declined\\nby bank") && !text.contains("declined\nby"),
        "the text form escapes control characters:\n{text}"
    );

    // Pending: ids[3] is next (0 ahead), ids[7] has four before it.
    let t = trace(&db, &redis, &ids[3], routes);
    assert_eq!(
        (t["task"]["state"].clone(), t["task"]["ahead"].clone()),
        ("pending".into(), 0.into())
    );
    let t = trace(&db, &redis, &ids[7], routes);
    assert_eq!(t["task"]["ahead"], 4);
    assert_eq!(t["routed_queue"], "default");

    let t = trace(&db, &redis, &paid, routes);
    assert_eq!(t["routed_queue"], "payments");
    assert_eq!(t["task"]["queue"], "payments");
    assert_eq!(t["task"]["state"], "archived");
    assert_eq!(t["task"]["last_error"], "gateway still down");
    assert!(t["task"]["archived_at"].is_string());
    // Without the routes trace still finds it, in the other queue asynq knows.
    let t = trace(&db, &redis, &paid, &[]);
    assert_eq!(t["task"]["queue"], "payments");

    // Lost by the sink: the task deleted (as asynq's Inspector would), the row published and
    // created within the retention.
    let mut conn = redis.conn().await;
    let deleted = outbox_relay::asynq_state::delete_task(&mut conn, "default", &ids[4])
        .await
        .unwrap();
    assert_eq!(deleted, outbox_relay::asynq_state::Deleted::Yes);
    let t = trace(&db, &redis, &ids[4], routes);
    assert!(t["task"].is_null());
    assert_eq!(t["verdict"]["kind"], "lost_by_sink");
    // The same, created longer ago than the retention: a completed task would have expired.
    c.execute(
        "UPDATE outbox_events SET created_at = now() - interval '2 days' WHERE event_id = $1::text::uuid",
        &[&ids[4]],
    )
    .await
    .unwrap();
    assert_eq!(
        trace(&db, &redis, &ids[4], routes)["verdict"]["kind"],
        "unknowable"
    );
    // The janitor at a time past the retention deletes the completed task: the same answer.
    assert_eq!(worker.janitor(now_secs() + 86_400 + 60).await, 1);
    c.execute(
        "UPDATE outbox_events SET created_at = now() - interval '2 days' WHERE event_id = $1::text::uuid",
        &[&ids[0]],
    )
    .await
    .unwrap();
    assert_eq!(
        trace(&db, &redis, &ids[0], routes)["verdict"]["kind"],
        "unknowable"
    );

    // In flight: the task exists, the row not marked yet.
    c.execute(
        "UPDATE outbox_events SET published_at = NULL WHERE event_id = $1::text::uuid",
        &[&ids[5]],
    )
    .await
    .unwrap();
    assert_eq!(
        trace(&db, &redis, &ids[5], routes)["verdict"]["kind"],
        "in_flight"
    );
    // Delivered with the row deleted (OUTBOX_DELETE_DELIVERED, cleanup).
    c.execute(
        "DELETE FROM outbox_events WHERE event_id = $1::text::uuid",
        &[&ids[6]],
    )
    .await
    .unwrap();
    let t = trace(&db, &redis, &ids[6], routes);
    assert!(t["row"].is_null());
    assert_eq!(t["verdict"]["kind"], "delivered");

    // A row the stream cannot deliver: the slot moves past it, the poller (grace 1h here) has
    // not taken it yet.
    let bad: String = c
        .query_one(
            "INSERT INTO outbox_events (event_id, event_name, payload, metadata) \
             VALUES (gen_random_uuid(), 'order.placed', '{}', '{\"n\": 1}') RETURNING event_id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let t = eventually("the slot passes the bad row", || async {
        let t = trace(&db, &redis, &bad, routes);
        (t["slot"]["past_row_commit"] == true).then_some(t)
    })
    .await;
    assert_eq!(t["verdict"]["kind"], "waiting_for_poller");
    assert!(t["verdict"]["text"].as_str().unwrap().contains("since"));
    // After failed attempts (the poller's own bookkeeping), a dead letter.
    let store = outbox_relay::store::Store::new(
        outbox_relay::pgoutput::TableName::parse("outbox_events").unwrap(),
    );
    let row_id: i64 = c
        .query_one(
            "SELECT id FROM outbox_events WHERE event_id = $1::text::uuid",
            &[&bad],
        )
        .await
        .unwrap()
        .get(0);
    assert!(store
        .mark_failed(
            &c,
            row_id,
            "metadata value for key \"n\" is not a string",
            std::time::Duration::ZERO,
            1
        )
        .await
        .unwrap());
    let t = trace(&db, &redis, &bad, routes);
    assert_eq!(t["verdict"]["kind"], "dead_letter");
    assert_eq!(t["row"]["attempts"], 1);

    let unknown = uuid::Uuid::new_v4().to_string();
    assert_eq!(
        trace(&db, &redis, &unknown, routes)["verdict"]["kind"],
        "not_found"
    );

    // The quick search: by name and time, newest rows, oldest first in the answer.
    let found = cli_json(
        &db,
        &redis,
        &["trace", "--json", "--event-name", "pay.*", "--since", "1h"],
    );
    let found: Vec<&str> = found
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(found, [paid.as_str()]);
    // Bad input: a clear refusal before anything connects.
    let (code, _, err) = cli(&db, &redis, &["trace", "42"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not an event id"), "{err}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_a_dry_run_until_yes_and_dedupes_by_task_id() {
    let db = TestDb::new("replay").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &[])).await;
    let mut c = db.client().await;
    let orders = insert_events(&mut c, "order.placed", 5, 1).await;
    let users = insert_events(&mut c, "user.signed_up", 2, 2).await;
    wait_pending(&redis, "default", 7).await;
    wait_published(&db, 7).await;
    relay.stop().await;
    let mut conn = redis.conn().await;
    let original = task(&mut conn, "default", &orders[0]).await.unwrap().0;
    // Every task processed and kept as completed for the retention.
    let mut worker = AsynqWorker::new(redis.conn().await, "default");
    while let Some(t) = worker.dequeue().await {
        worker.succeed(&t).await;
    }
    // One unpublished row in the range: the relay's to deliver, not replay's.
    insert_events(&mut c, "order.placed", 1, 1).await;

    let dry = cli_json(&db, &redis, &["replay", "--json", "--since", "1h"]);
    assert_eq!(dry["performed"], false);
    assert_eq!(
        (
            dry["matched"].clone(),
            dry["kept"].clone(),
            dry["absent"].clone()
        ),
        (7.into(), 7.into(), 0.into())
    );
    assert_eq!(dry["unpublished"], 1);
    assert_eq!(dry["sample"].as_array().unwrap().len(), 7);
    assert_eq!(dry["sample"][0]["task_state"], "completed");
    assert!(
        pending_ids(&mut conn, "default").await.is_empty(),
        "a dry run writes nothing"
    );

    // --yes without --force: asynq would refuse the kept TaskIDs, so nothing is enqueued.
    let kept = cli_json(
        &db,
        &redis,
        &[
            "replay",
            "--json",
            "--since",
            "1h",
            "--event-name",
            "order.*",
            "--yes",
        ],
    );
    assert_eq!(
        (
            kept["performed"].clone(),
            kept["kept"].clone(),
            kept["enqueued"].clone()
        ),
        (true.into(), 5.into(), 0.into())
    );
    assert!(pending_ids(&mut conn, "default").await.is_empty());

    // --force: the completed tasks deleted as the Inspector does, then enqueued again: the
    // same task, pending, in the rows' order.
    let forced = cli_json(
        &db,
        &redis,
        &[
            "replay",
            "--json",
            "--since",
            "1h",
            "--event-name",
            "order.*",
            "--yes",
            "--force",
        ],
    );
    assert_eq!(
        (forced["deleted"].clone(), forced["enqueued"].clone()),
        (5.into(), 5.into())
    );
    assert_eq!(pending_ids(&mut conn, "default").await, orders);
    let (again, state, _) = task(&mut conn, "default", &orders[0]).await.unwrap();
    assert_eq!((again, state.as_str()), (original, "pending"));
    let t = trace(&db, &redis, &users[0], &[]);
    assert_eq!(t["task"]["state"], "completed", "other names untouched");

    // A task already pending is never enqueued twice, --force or not.
    let queued = cli_json(
        &db,
        &redis,
        &[
            "replay",
            "--json",
            "--event-id",
            &orders[0],
            "--yes",
            "--force",
        ],
    );
    assert_eq!(
        (queued["queued"].clone(), queued["enqueued"].clone()),
        (1.into(), 0.into())
    );
    assert_eq!(pending_ids(&mut conn, "default").await.len(), 5);

    // A completed task expired (the janitor past the retention): replayed without --force.
    assert_eq!(worker.janitor(now_secs() + 86_400 + 60).await, 2);
    let expired = cli_json(
        &db,
        &redis,
        &["replay", "--json", "--event-id", &users[1], "--yes"],
    );
    assert_eq!(
        (expired["absent"].clone(), expired["enqueued"].clone()),
        (1.into(), 1.into())
    );
    assert_eq!(
        pending_ids(&mut conn, "default").await.last(),
        Some(&users[1])
    );

    // Clear answers: an empty range, an unknown queue, a bad id.
    let (code, _, err) = cli(
        &db,
        &redis,
        &[
            "replay",
            "--since",
            "2020-01-01T00:00:00Z",
            "--until",
            "2020-01-02T00:00:00Z",
        ],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("nothing to replay"), "{err}");
    let before = pending_ids(&mut conn, "default").await;
    let (code, _, err) = cli(
        &db,
        &redis,
        &[
            "replay", "--since", "1h", "--queue", "nowhere", "--yes", "--force",
        ],
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("nowhere") && err.contains("unknown to Valkey"),
        "{err}"
    );
    assert_eq!(pending_ids(&mut conn, "default").await, before);
    assert!(pending_ids(&mut conn, "nowhere").await.is_empty());
    let (code, _, err) = cli(&db, &redis, &["replay", "--event-id", "42"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = cli(&db, &redis, &["replay"]);
    assert_eq!(code, 2, "a replay of everything must be asked for: {err}");
}

/// Turns queue `q`'s pending list into a string: every enqueue there answers WRONGTYPE, which
/// the sink reports as a refusal for good.
async fn break_queue(redis: &Redis, q: &str) {
    mend_queue(redis, q).await;
    let _: () = redis::cmd("SET")
        .arg(pending_key(q))
        .arg("not a list")
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
}

/// Deletes queue `q`'s pending list (whatever its type): enqueues work there again.
async fn mend_queue(redis: &Redis, q: &str) {
    let _: () = redis::cmd("DEL")
        .arg(pending_key(q))
        .query_async(&mut redis.conn().await)
        .await
        .unwrap();
}

fn pending_key(q: &str) -> String {
    format!("asynq:{{{q}}}:pending")
}

/// The event ids of a report's `refused` list, each with WRONGTYPE as its reason.
fn refused_ids(report: &Value) -> Vec<String> {
    let refused = report["refused"].as_array().unwrap();
    for r in refused {
        assert!(r["reason"].as_str().unwrap().contains("WRONGTYPE"), "{r}");
        assert_eq!(r["queue"], "payments", "{r}");
    }
    refused
        .iter()
        .map(|r| r["event_id"].as_str().unwrap().to_owned())
        .collect()
}

/// A task Valkey refuses for good is neither counted as enqueued nor passed over in silence:
/// `replay --yes` and `reconcile --yes` list it, write the rest, and exit with 1; once the queue
/// is mended the same command (without `--force`: the deleted task is absent now) writes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_and_reconcile_list_what_valkey_refuses_and_exit_1() {
    let db = TestDb::new("refused").await;
    let redis = Redis::start();
    let routes = &ROUTES[..];
    let relay = Relay::start_streaming(run_args(&db, &redis.url, routes)).await;
    let mut c = db.client().await;
    let orders = insert_events(&mut c, "order.placed", 3, 1).await;
    let pays = insert_events(&mut c, "pay.captured", 2, 1).await;
    wait_pending(&redis, "default", 3).await;
    wait_pending(&redis, "payments", 2).await;
    wait_published(&db, 5).await;
    relay.stop().await;
    for q in ["default", "payments"] {
        let mut worker = AsynqWorker::new(redis.conn().await, q);
        while let Some(t) = worker.dequeue().await {
            worker.succeed(&t).await;
        }
    }
    break_queue(&redis, "payments").await;
    let replay = [&["replay", "--json", "--since", "1h", "--yes"][..], routes].concat();

    let forced = [&replay[..], &["--force"]].concat();
    let (code, out, err) = cli(&db, &redis, &forced);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("refused 2 task(s)"), "{err}");
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (report["deleted"].clone(), report["enqueued"].clone()),
        (5.into(), 3.into())
    );
    assert_eq!(refused_ids(&report), pays);
    let mut conn = redis.conn().await;
    assert_eq!(pending_ids(&mut conn, "default").await, orders);
    // As text: the refused tasks are absent now, so a replay without --force tries them.
    let text_args = [&["replay", "--since", "1h", "--yes"][..], routes].concat();
    let (code, text, _) = cli(&db, &redis, &text_args);
    assert_eq!(code, 1);
    assert!(
        text.contains(&format!(
            "refused  {}  queue \"payments\" refused the task: \"WRONGTYPE\": ",
            pays[0]
        )),
        "{text}"
    );

    mend_queue(&redis, "payments").await;
    let again = cli_json(&db, &redis, &replay);
    assert_eq!(
        (again["absent"].clone(), again["enqueued"].clone()),
        (2.into(), 2.into())
    );
    assert!(refused_ids(&again).is_empty());
    assert_eq!(pending_ids(&mut conn, "payments").await, pays);

    // Valkey loses every task; reconcile enqueues what it can and lists the rest.
    let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
    let _: () = redis::cmd("SADD")
        .arg("asynq:queues")
        .arg("default")
        .arg("payments")
        .query_async(&mut conn)
        .await
        .unwrap();
    break_queue(&redis, "payments").await;
    let reconcile = [
        &["reconcile", "--json", "--since", "1h", "--yes"][..],
        routes,
    ]
    .concat();
    let (code, out, err) = cli(&db, &redis, &reconcile);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("refused 2 task(s)"), "{err}");
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["enqueued"], 3);
    assert_eq!(refused_ids(&report), pays);
    assert_eq!(pending_ids(&mut conn, "default").await, orders);
    mend_queue(&redis, "payments").await;
    let healed = cli_json(&db, &redis, &reconcile);
    assert_eq!(healed["enqueued"], 2);
    assert!(refused_ids(&healed).is_empty());
    assert_eq!(pending_ids(&mut conn, "payments").await, pays);
}

/// A write that fails (here: no replica acknowledges it, with `--valkey-wait-replicas 1` on a
/// server that has none) ends `replay --yes` and `reconcile --yes` with exit 1 and no report,
/// after the pages before it were written; the same command run again skips what is there and
/// writes the rest. What docs/operations.md promises for a write that fails midway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_and_reconcile_stop_at_a_failed_write_and_run_again_write_the_rest() {
    let db = TestDb::new("failed_write").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &[])).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "order.placed", 5, 1).await;
    wait_pending(&redis, "default", 5).await;
    wait_published(&db, 5).await;
    relay.stop().await;
    let mut conn = redis.conn().await;
    let lose_every_task = || async {
        let mut conn = redis.conn().await;
        let _: () = redis::cmd("FLUSHALL").query_async(&mut conn).await.unwrap();
        let _: () = redis::cmd("SADD")
            .arg("asynq:queues")
            .arg("default")
            .query_async(&mut conn)
            .await
            .unwrap();
    };
    // Pages of two rows: the first write is made, then its WAIT finds no replica.
    let wait = ["--batch", "2", "--valkey-wait-replicas", "1"];
    for command in ["replay", "reconcile"] {
        lose_every_task().await;
        let run = [command, "--json", "--since", "1h", "--yes"];
        let (code, out, err) = cli(&db, &redis, &[&run[..], &wait].concat());
        assert_eq!(code, 1, "{command}: {err}");
        assert!(
            err.contains("the same command run again writes the rest"),
            "{command}: {err}"
        );
        assert!(out.is_empty(), "{command} printed a report: {out}");
        assert_eq!(
            pending_ids(&mut conn, "default").await,
            ids[..2],
            "{command}: the first page's write stays"
        );
        let again = cli_json(&db, &redis, &[&run[..], &["--batch", "2"]].concat());
        assert_eq!(again["enqueued"], 3, "{command}: {again}");
        assert_eq!(pending_ids(&mut conn, "default").await, ids, "{command}");
    }
}
