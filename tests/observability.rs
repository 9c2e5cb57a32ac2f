//! Metrics, health endpoints, the status command and the heartbeat.

mod common;

use common::observed::ObservedRelay;
use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_read_the_number_of_delivered_events() {
    let (db, redis, relay) = streaming_relay("counters", &["--health-interval", "200ms"]).await;
    let mut c = db.client().await;
    let ids = insert_events(&mut c, "order.placed", 1_234, 100).await;
    wait_pending(&redis, "default", ids.len()).await;
    let text = eventually("the counters and the pending gauge settle", || async {
        let (status, text) = relay.get("/metrics").await;
        assert_eq!(status, 200);
        let settled = metric_value(&text, "outbox_events_published_total") == Some(1234.0)
            && metric_value(&text, "outbox_events_pending") == Some(0.0);
        settled.then_some(text)
    })
    .await;
    assert_eq!(
        metric_value(&text, "outbox_events_duplicate_total"),
        Some(0.0)
    );
    assert_eq!(metric_value(&text, "outbox_stream_up"), Some(1.0));
    assert_eq!(
        metric_value(&text, "outbox_delivery_latency_seconds_count"),
        Some(1234.0)
    );
    assert!(metric_value(&text, "outbox_batch_duration_seconds_count").unwrap() >= 1.0);
    assert_eq!(metric_value(&text, "outbox_dead_letters"), Some(0.0));
    assert!(text.contains("outbox_replication_lag_bytes"));
    assert_eq!(relay.get("/healthz").await.0, 200);
    relay.stop().await;
}

/// `outbox_oldest_pending_age_seconds`: the age of the oldest row waiting for delivery, 0 once
/// everything is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oldest_pending_row_has_its_age_in_a_gauge() {
    let (db, redis, relay) = streaming_relay("oldest", &["--health-interval", "200ms"]).await;
    let age = || async {
        let (_, text) = relay.get("/metrics").await;
        metric_value(&text, "outbox_oldest_pending_age_seconds")
    };
    assert_eq!(age().await, Some(0.0), "registered at 0");
    redis.stop();
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox_events (event_id, event_name, payload, created_at) \
         VALUES (gen_random_uuid(), 'old.one', '{}', now() - interval '1 hour')",
    )
    .await
    .unwrap();
    eventually("the gauge shows the hour-old row", || async {
        age().await.filter(|a| *a >= 3600.0)
    })
    .await;
    redis.restart();
    eventually("delivered: back to 0", || async {
        (age().await == Some(0.0)).then_some(())
    })
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_valkey() {
    let (_db, redis, relay) = streaming_relay("readyz", &["--health-interval", "200ms"]).await;
    eventually("ready", || async {
        (relay.get("/readyz").await.0 == 200).then_some(())
    })
    .await;
    redis.stop();
    let body = eventually("not ready without valkey", || async {
        let (status, body) = relay.get("/readyz").await;
        (status == 503).then_some(body)
    })
    .await;
    assert!(body.contains("valkey unreachable"), "{body}");
    assert_eq!(relay.get("/healthz").await.0, 200, "alive all the same");
    redis.restart();
    eventually("ready again", || async {
        (relay.get("/readyz").await.0 == 200).then_some(())
    })
    .await;
    relay.stop().await;
}

/// Heartbeats go through the slot; when the stream cannot move (Valkey down, in-flight full)
/// they stop coming back and the stream is reported stalled, until it moves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stream_is_noticed_through_heartbeats() {
    let (db, redis, relay) = streaming_relay(
        "stall",
        &[
            "--health-interval",
            "200ms",
            "--heartbeat-interval",
            "200ms",
            "--stall-after",
            "1s",
            "--batch-size",
            "1",
            "--max-inflight-batches",
            "1",
        ],
    )
    .await;
    // A heartbeat-prefixed message written now has come back through the slot (the stream
    // acknowledged past it), and the relay does not call the stream stalled.
    let written: i64 = db
        .client()
        .await
        .query_one(
            "SELECT (pg_logical_emit_message(false, $1, 'test') - '0/0'::pg_lsn)::bigint",
            &[&outbox_relay::monitor::HEARTBEAT_PREFIX],
        )
        .await
        .unwrap()
        .get(0);
    eventually(
        "a heartbeat comes back and the stream is not stalled",
        || async {
            let back = relay.metrics.acked_lsn.get() >= written as u64;
            (back && relay.metrics.stream_stalled.get() == 0).then_some(())
        },
    )
    .await;
    redis.stop();
    let mut c = db.client().await;
    insert_events(&mut c, "order.placed", 20, 1).await;
    eventually("stalled", || async {
        (relay.metrics.stream_stalled.get() == 1).then_some(())
    })
    .await;
    let (status, body) = relay.get("/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains("stalled"), "{body}");
    redis.restart();
    wait_pending(&redis, "default", 20).await;
    eventually("recovered", || async {
        (relay.metrics.stream_stalled.get() == 0).then_some(())
    })
    .await;
    relay.stop().await;
}

fn status_json(db: &TestDb, redis_url: &str) -> serde_json::Value {
    let out = run_command_ok(&["status", "--json"], &relay_env(db, redis_url));
    serde_json::from_str(&out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_a_lag_that_grows_while_the_relay_is_stopped() {
    let (db, redis, relay) =
        streaming_relay("status", &["--recovery", "false", "--on-slot-lost", "stop"]).await;
    let mut c = db.client().await;
    insert_events(&mut c, "order.placed", 10, 10).await;
    wait_pending(&redis, "default", 10).await;
    relay.stop().await;
    // The walsender outlives the relay by a moment: `active` is read once it is gone.
    db.wait_slot_released().await;
    let s0 = status_json(&db, &redis.url);
    assert_eq!(s0["slot"]["exists"], true);
    assert_eq!(s0["slot"]["active"], false);
    assert_eq!(
        s0["publication"]["operations"],
        serde_json::json!(["insert"])
    );
    assert_eq!(
        s0["queues"],
        serde_json::json!([{"queue": "default", "pending": 10}])
    );
    let lag0 = s0["slot"]["lag_bytes"].as_i64().unwrap();
    insert_events(&mut c, "order.placed", 200, 20).await;
    let s1 = status_json(&db, &redis.url);
    let lag1 = s1["slot"]["lag_bytes"].as_i64().unwrap();
    insert_events(&mut c, "order.placed", 200, 20).await;
    let lag2 = status_json(&db, &redis.url)["slot"]["lag_bytes"]
        .as_i64()
        .unwrap();
    assert!(
        lag0 < lag1 && lag1 < lag2,
        "lag grows: {lag0} {lag1} {lag2}"
    );
    assert_eq!(s1["unpublished_rows"], 200, "the 10 delivered were marked");
    // The human form names the same things.
    let text = run_command_ok(&["status"], &relay_env(&db, &redis.url));
    assert!(
        text.contains("unpublished=400") && text.contains("pending=10"),
        "{text}"
    );
}

/// The relay's JSON log lines (`--log-format json`), parsed.
fn json_log(relay: &ObservedRelay) -> Vec<serde_json::Value> {
    relay
        .process
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// A WARN line of `relay`'s JSON log whose field `field` is `value`, once there is one.
async fn warned_with(relay: &ObservedRelay, field: &str, value: &str) -> serde_json::Value {
    eventually(&format!("a warning with {field}={value}"), || async {
        json_log(relay)
            .into_iter()
            .find(|l| l["level"] == "WARN" && l[field] == value)
    })
    .await
}

/// A Valkey whose eviction policy could drop tasks is named at start-up, with its policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_valkey_is_warned_about_at_start_up() {
    let db = TestDb::new("evict").await;
    let redis = Redis::start_with(&["--maxmemory-policy", "allkeys-lru"], None);
    let relay = ObservedRelay::spawn_streaming(&db, &redis.url, &["--log-format", "json"]).await;
    let line = warned_with(&relay, "policy", "allkeys-lru").await;
    assert!(line["node"].is_string(), "{line}");
}

/// A row that cannot become a task is logged by the stream with its event_id (a structured
/// field), so an operator can find it. (Without the recovery poller, which logs it too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_row_is_logged_with_its_event_id() {
    let db = TestDb::new("badlog").await;
    let redis = Redis::start();
    let relay = ObservedRelay::spawn_streaming(
        &db,
        &redis.url,
        &[
            "--log-format",
            "json",
            "--recovery",
            "false",
            "--on-slot-lost",
            "stop",
        ],
    )
    .await;
    let id = "00000000-0000-4000-8000-00000000bad1";
    db.client()
        .await
        .execute(
            "INSERT INTO outbox_events (event_id, event_name, payload) VALUES ($1::text::uuid, '', '{}')",
            &[&id],
        )
        .await
        .unwrap();
    let line = warned_with(&relay, "event_id", id).await;
    assert!(
        line["reason"].is_string(),
        "the reason is a field too: {line}"
    );
}

/// Valkey loses its script cache (SCRIPT FLUSH, as after a restart or a failover to a replica):
/// the write that meets NOSCRIPT fails, the next one loads the script, and the writer's re-send
/// delivers everything, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_script_cache_is_reloaded_in_place() {
    let db = TestDb::new("noscript").await;
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &[])).await;
    let mut c = db.client().await;
    let mut ids = insert_events(&mut c, "before.flush", 5, 5).await;
    wait_pending(&redis, "default", 5).await;
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    ids.extend(insert_events(&mut c, "after.flush", 5, 5).await);
    assert_eq!(wait_pending(&redis, "default", 10).await, ids);
    let sha = redis::Script::new(outbox_relay::sink::valkey::ENQUEUE_SCRIPT)
        .get_hash()
        .to_owned();
    let loaded: Vec<i64> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(&sha)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(loaded, [1], "the script is loaded again");
    assert!(
        relay.metrics.write_errors.get() >= 1,
        "the write that met NOSCRIPT failed and was sent again"
    );
    relay.stop().await;
}
