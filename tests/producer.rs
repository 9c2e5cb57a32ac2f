//! The producer API against a real Postgres and, through the running relay, a real Redis: an
//! event written in the caller's transaction becomes its task on commit and nothing on rollback.

mod common;

use common::*;
use outbox_relay::pgoutput::TableName;
use outbox_relay::producer::{Event, Outbox, ProducerError};
use serde_json::json;
use uuid::Uuid;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACESTATE: &str = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";

async fn create_orders(c: &tokio_postgres::Client) {
    c.batch_execute("CREATE TABLE orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL)")
        .await
        .unwrap();
}

async fn count(
    c: &tokio_postgres::Client,
    sql: &str,
    id: &(dyn tokio_postgres::types::ToSql + Sync),
) -> i64 {
    c.query_one(sql, &[id]).await.unwrap().get(0)
}

/// PlaceOrder: the order and its event commit together, and the task carries the event's id,
/// name, payload and metadata, with the trace context also in the TaskMessage headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_committed_with_the_order_becomes_its_task() {
    let (db, redis) = database_and_redis("producer_commit").await;
    let mut c = db.client().await;
    create_orders(&c).await;
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &[])).await;

    let id = Uuid::new_v4();
    let payload = json!({ "order_id": 42, "total_cents": 4250, "note": "<gift> & \"wrap\"" });
    let event = Event::new("order.placed", &payload)
        .unwrap()
        .with_id(id)
        .with_metadata("tenant", "acme")
        .with_trace_context(TRACEPARENT, Some(TRACESTATE))
        .unwrap();
    let tx = c.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO orders (id, total_cents) VALUES (42, 4250)",
        &[],
    )
    .await
    .unwrap();
    let outbox = Outbox::new(TableName::parse("public.outbox_events").unwrap())
        .with_max_payload_bytes(1 << 20);
    outbox.insert(&tx, &event).await.unwrap();
    tx.commit().await.unwrap();

    let pending = wait_pending(&redis, "default", 1).await;
    assert_eq!(pending, [id.to_string()]);
    let mut conn = redis.conn().await;
    let (msg, state, _) = task(&mut conn, "default", &id.to_string()).await.unwrap();
    assert_eq!(state, "pending");
    assert_eq!(msg.r#type, "event:order.placed");
    assert_eq!(msg.id, id.to_string());
    let envelope: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
    assert_eq!(envelope["id"], id.to_string());
    assert_eq!(envelope["name"], "order.placed");
    assert_eq!(envelope["payload"], payload);
    assert_eq!(
        envelope["metadata"],
        json!({ "tenant": "acme", "traceparent": TRACEPARENT, "tracestate": TRACESTATE })
    );
    let headers: Vec<(&str, &str)> = msg
        .headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        headers,
        [("traceparent", TRACEPARENT), ("tracestate", TRACESTATE)],
        "only the trace keys become headers"
    );
    assert_eq!(
        count(&c, "SELECT count(*) FROM orders WHERE id = $1", &42_i64).await,
        1
    );
    relay.stop().await;
}

/// Rolled back, explicitly or by an error after the event insert: neither the order nor a task
/// exists once a later committed marker event has arrived (so the check is not too early).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_rolled_back_with_the_order_never_becomes_a_task() {
    let (db, redis) = database_and_redis("producer_rollback").await;
    let mut c = db.client().await;
    create_orders(&c).await;
    c.execute("INSERT INTO orders (id, total_cents) VALUES (7, 100)", &[])
        .await
        .unwrap();
    let relay = Relay::start_streaming(run_args(&db, &redis.url, &[])).await;

    let rolled_back = Event::new("order.placed", &json!({ "order_id": 43 })).unwrap();
    let tx = c.transaction().await.unwrap();
    tx.execute("INSERT INTO orders (id, total_cents) VALUES (43, 1)", &[])
        .await
        .unwrap();
    Outbox::default().insert(&tx, &rolled_back).await.unwrap();
    tx.rollback().await.unwrap();

    // PlaceOrder fails after writing its event (order 7 exists): the `?` drops the transaction.
    let failed = Event::new("order.placed", &json!({ "order_id": 7 })).unwrap();
    let result: Result<(), tokio_postgres::Error> = async {
        let tx = c.transaction().await?;
        Outbox::default().insert(&tx, &failed).await.unwrap();
        tx.execute("INSERT INTO orders (id, total_cents) VALUES (7, 2)", &[])
            .await?;
        tx.commit().await
    }
    .await;
    assert!(result.is_err(), "the duplicate order fails the transaction");

    let marker = Event::new("marker", &json!({})).unwrap();
    Outbox::default().insert(&c, &marker).await.unwrap();
    let pending = wait_pending(&redis, "default", 1).await;
    assert_eq!(
        pending,
        [marker.id().to_string()],
        "only the marker is a task"
    );
    let mut conn = redis.conn().await;
    for event in [&rolled_back, &failed] {
        assert!(task(&mut conn, "default", &event.id().to_string())
            .await
            .is_none());
        let rows = count(
            &c,
            "SELECT count(*) FROM outbox_events WHERE event_id = $1",
            &event.id(),
        )
        .await;
        assert_eq!(rows, 0);
    }
    assert_eq!(
        count(&c, "SELECT count(*) FROM orders WHERE id = $1", &43_i64).await,
        0
    );
    relay.stop().await;
}

/// Invalid events are refused before any SQL, and a payload over the limit inserts nothing:
/// the caller's transaction stays usable after either. A reused event_id is a typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_events_are_refused_and_the_transaction_survives() {
    let db = TestDb::new("producer_invalid").await;
    let mut c = db.client().await;
    assert!(matches!(
        Event::new("", &json!({})),
        Err(ProducerError::EmptyName)
    ));
    for bad in [
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "not a traceparent",
    ] {
        let e = Event::new("order.placed", &json!({}))
            .unwrap()
            .with_trace_context(bad, None);
        assert!(
            matches!(e, Err(ProducerError::InvalidTraceparent(_))),
            "{bad}"
        );
    }

    let tx = c.transaction().await.unwrap();
    let nul = Event::new("a", &json!({}))
        .unwrap()
        .with_metadata("k", "v\0");
    assert!(matches!(
        Outbox::default().insert(&tx, &nul).await,
        Err(ProducerError::Nul("metadata"))
    ));
    // PostgreSQL prints {"a": 1, "b": [1, 2]} (21 bytes), serde_json {"a":1,"b":[1,2]} (17):
    // the limit applies to the former, as the relay measures it.
    let big = Event::new("a", &json!({ "a": 1, "b": [1, 2] })).unwrap();
    let limited = Outbox::default().with_max_payload_bytes(20);
    match limited.insert(&tx, &big).await {
        Err(ProducerError::PayloadTooLarge {
            size: 21,
            limit: 20,
        }) => {}
        other => panic!("expected PayloadTooLarge(21 > 20), got {other:?}"),
    }
    Outbox::default()
        .with_max_payload_bytes(21)
        .insert(&tx, &big)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let stored: String = c
        .query_one(
            "SELECT payload::text FROM outbox_events WHERE event_id = $1",
            &[&big.id()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, r#"{"a": 1, "b": [1, 2]}"#);

    let again = Outbox::default().insert(&c, &big).await;
    assert!(matches!(again, Err(ProducerError::DuplicateEventId { id, .. }) if id == big.id()));
    let rows: i64 = c
        .query_one("SELECT count(*) FROM outbox_events", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "only the event within the limit was written");
}
