use outbox_relay::producer::{Event, Outbox};
use serde::Serialize;

#[derive(Serialize)]
struct OrderPlaced {
    order_id: i64,
    total: String,
}

async fn place_order(
    client: &mut tokio_postgres::Client,
    customer: &str,
    total: &str,
    traceparent: Option<&str>, // from the request, or from your tracing propagator
) -> Result<i64, Box<dyn std::error::Error + Send + Sync>> {
    let tx = client.transaction().await?;
    let order_id: i64 = tx
        .query_one(
            "INSERT INTO orders (customer, total) VALUES ($1, $2::text::numeric) RETURNING id",
            &[&customer, &total],
        )
        .await?
        .get(0);
    let mut event = Event::new("order.placed", &OrderPlaced { order_id, total: total.into() })?;
    if let Some(tp) = traceparent {
        event = event.with_trace_context(tp, None)?;
    }
    Outbox::default()
        .with_max_payload_bytes(1 << 20) // the relay's OUTBOX_MAX_PAYLOAD_BYTES
        .insert(&tx, &event)
        .await?;
    tx.commit().await?; // a dropped `tx` (an early `?`) rolls back both inserts
    Ok(order_id)
}
