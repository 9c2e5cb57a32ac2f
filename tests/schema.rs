//! Columns by name, schema changes while streaming, bad rows that never stall the stream,
//! trace headers, queue routing, ignored operations, and an idle outbox that does not pin WAL.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_map_by_name_and_survive_alter_table() {
    let db = TestDb::on(&shared_pg_url(), "colmap", false).await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE SCHEMA app;
         CREATE TABLE app.events (
             tenant text DEFAULT 'acme',
             payload jsonb NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now(),
             event_name text NOT NULL,
             note text,
             metadata jsonb NOT NULL DEFAULT '{}',
             event_id uuid NOT NULL UNIQUE,
             published_at timestamptz,
             id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY);",
    )
    .await
    .unwrap();
    let redis = Redis::start();
    let relay = Relay::start_streaming(run_args(
        &db,
        &redis.url,
        &[
            "--table",
            "app.events",
            "--recovery",
            "false",
            "--on-slot-lost",
            "stop",
        ],
    ))
    .await;
    c.batch_execute(
        "INSERT INTO app.events (payload, event_name, event_id) VALUES
            ('{\"a\": 1}', 'first', '00000000-0000-4000-8000-0000000000a1');",
    )
    .await
    .unwrap();
    wait_pending(&redis, "default", 1).await;
    c.batch_execute(
        "ALTER TABLE app.events ADD COLUMN region text DEFAULT 'eu';
         ALTER TABLE app.events DROP COLUMN note;
         INSERT INTO app.events (payload, event_name, event_id, region) VALUES
            ('{\"b\": 2}', 'second', '00000000-0000-4000-8000-0000000000a2', 'us');",
    )
    .await
    .unwrap();
    let ids = wait_pending(&redis, "default", 2).await;
    assert_eq!(
        ids,
        [
            "00000000-0000-4000-8000-0000000000a1",
            "00000000-0000-4000-8000-0000000000a2"
        ]
    );
    let mut conn = redis.conn().await;
    let (msg, _, _) = task(&mut conn, "default", &ids[1]).await.unwrap();
    assert_eq!(msg.r#type, "event:second");
    let env: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
    assert_eq!(env["payload"], serde_json::json!({"b": 2}));
    relay.stop().await;
}

/// Rows that cannot become tasks are counted and left for the recovery path; the rest flow and
/// the slot moves past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_never_stall_the_stream() {
    let (db, redis, relay) = streaming_relay("badrows", &["--max-payload-bytes", "1KiB"]).await;
    let c = db.client().await;
    c.batch_execute(&format!(
        "INSERT INTO outbox_events (event_id, event_name, payload, metadata) VALUES
            ('00000000-0000-4000-8000-000000000001', 'good', '{{}}', '{{}}'),
            ('00000000-0000-4000-8000-000000000002', '', '{{}}', '{{}}'),
            ('00000000-0000-4000-8000-000000000003', 'too.big', '{{\"x\": \"{}\"}}', '{{}}'),
            ('00000000-0000-4000-8000-000000000004', 'meta.array', '{{}}', '[1]'),
            ('00000000-0000-4000-8000-000000000005', 'meta.number', '{{}}', '{{\"n\": 1}}'),
            ('00000000-0000-4000-8000-000000000008', 'meta.big', '{{}}', '{{\"k\": \"{}\"}}'),
            ('00000000-0000-4000-8000-000000000009', '{}', '{{}}', '{{}}'),
            ('00000000-0000-4000-8000-000000000006', 'good', '{{}}', '{{}}');",
        "y".repeat(2000),
        "<".repeat(2000),
        "n".repeat(2000)
    ))
    .await
    .unwrap();
    let after_commit = db.current_lsn().await;
    c.batch_execute("INSERT INTO outbox_events (event_id, event_name, payload) VALUES ('00000000-0000-4000-8000-000000000007', 'good', '{}')")
        .await
        .unwrap();
    let ids = wait_pending(&redis, "default", 3).await;
    assert_eq!(
        ids,
        [
            "00000000-0000-4000-8000-000000000001",
            "00000000-0000-4000-8000-000000000006",
            "00000000-0000-4000-8000-000000000007"
        ]
    );
    eventually("the slot moves past the bad rows", || async {
        (db.confirmed_flush().await.unwrap() >= after_commit).then_some(())
    })
    .await;
    let bad: u64 = [
        "empty_event_name",
        "payload_too_large",
        "column_too_large",
        "metadata_not_object",
        "metadata_not_string",
    ]
    .into_iter()
    .map(|reason| {
        relay
            .metrics
            .bad_rows
            .get_or_create(&outbox_relay::metrics::ReasonLabel { reason })
            .get()
    })
    .sum();
    assert_eq!(bad, 6);
    // Delivered rows are marked published (asynchronously); the bad ones stay for the recovery
    // path.
    let unpublished = eventually("delivered rows are marked published", || async {
        let rows = c
            .query(
                "SELECT event_name FROM outbox_events WHERE published_at IS NULL ORDER BY id",
                &[],
            )
            .await
            .unwrap();
        let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        (names.len() == 6).then_some(names)
    })
    .await;
    let long_name = "n".repeat(2000);
    assert_eq!(
        unpublished,
        [
            "",
            "too.big",
            "meta.array",
            "meta.number",
            "meta.big",
            &long_name
        ]
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_context_headers_and_queue_routes() {
    let (db, redis, relay) = streaming_relay(
        "routes",
        &["--queue-routes", "user.*=critical,order.paid=payments"],
    )
    .await;
    db.client()
        .await
        .batch_execute(
            "INSERT INTO outbox_events (event_id, event_name, payload, metadata) VALUES
              ('00000000-0000-4000-8000-000000000001', 'user.signed_up', '{}',
               '{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\", \"tracestate\": \"k=v\", \"tenant\": \"acme\"}'),
              ('00000000-0000-4000-8000-000000000002', 'order.paid', '{}', '{}'),
              ('00000000-0000-4000-8000-000000000003', 'order.placed', '{}', '{}');",
        )
        .await
        .unwrap();
    for (queue, id) in [
        ("critical", "00000000-0000-4000-8000-000000000001"),
        ("payments", "00000000-0000-4000-8000-000000000002"),
        ("default", "00000000-0000-4000-8000-000000000003"),
    ] {
        assert_eq!(wait_pending(&redis, queue, 1).await, [id]);
    }
    let mut conn = redis.conn().await;
    let (msg, _, _) = task(
        &mut conn,
        "critical",
        "00000000-0000-4000-8000-000000000001",
    )
    .await
    .unwrap();
    assert_eq!(msg.queue, "critical");
    assert_eq!(
        msg.headers.len(),
        2,
        "trace context only: {:?}",
        msg.headers
    );
    assert_eq!(msg.headers["tracestate"], "k=v");
    let env: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
    assert_eq!(
        env["metadata"]["tenant"], "acme",
        "the envelope keeps all metadata"
    );
    assert_eq!(queues(&mut conn).await, ["critical", "default", "payments"]);
    relay.stop().await;
}

/// A publication that publishes everything: UPDATE, DELETE and TRUNCATE produce no task and no
/// error, and inserts keep flowing. The UPDATE gives the row a new event_id, so that a relay
/// taking an update's new tuple for an insert would enqueue a third task (an update that kept
/// the event_id would hide it: the TaskID dedupes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_delete_truncate_are_ignored() {
    let db = TestDb::new("ops").await;
    let c = db.client().await;
    c.batch_execute("CREATE PUBLICATION all_ops FOR TABLE outbox_events")
        .await
        .unwrap();
    let redis = Redis::start();
    let relay =
        Relay::start_streaming(run_args(&db, &redis.url, &["--publication", "all_ops"])).await;
    c.batch_execute(
        "INSERT INTO outbox_events (event_id, event_name, payload) VALUES ('00000000-0000-4000-8000-000000000001', 'a', '{}');
         UPDATE outbox_events SET event_id = '00000000-0000-4000-8000-000000000003', published_at = now();
         DELETE FROM outbox_events;
         TRUNCATE outbox_events;
         INSERT INTO outbox_events (event_id, event_name, payload) VALUES ('00000000-0000-4000-8000-000000000002', 'b', '{}');",
    )
    .await
    .unwrap();
    let ids = wait_pending(&redis, "default", 2).await;
    assert_eq!(
        ids,
        [
            "00000000-0000-4000-8000-000000000001",
            "00000000-0000-4000-8000-000000000002"
        ]
    );
    assert_eq!(relay.postgres_reconnects(), 0);
    relay.stop().await;
}

/// Heavy writes to other tables and none to the outbox: the slot keeps up, pinning no WAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_does_not_pin_wal() {
    let (db, _redis, relay) = streaming_relay("idle", &[]).await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE TABLE busy (id serial, body text);
         INSERT INTO busy (body) SELECT repeat('x', 500) FROM generate_series(1, 20000);",
    )
    .await
    .unwrap();
    let after = db.current_lsn().await;
    eventually("the slot follows the other tables' WAL", || async {
        (db.confirmed_flush().await.unwrap() >= after).then_some(())
    })
    .await;
    relay.stop().await;
}
