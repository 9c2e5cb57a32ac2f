//! Waiting on observable state, never on sleeps: a liveness bound, not a speed check.

use std::time::Duration;

/// How long a test waits for something that should happen; a liveness bound, not a speed check.
pub const PATIENCE: Duration = Duration::from_secs(120);

/// Waits until `f` returns Some, or panics after [`PATIENCE`] with `what`.
pub async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Tasks the relay's stream (not its poller) has delivered: the count of
/// `outbox_delivery_latency_seconds`, which only the stream observes (`outbox_events_published_total`
/// counts the poller's too).
pub async fn stream_delivered(relay: &super::Relay) -> f64 {
    let (_, text) = super::http_get(relay.http, "/metrics").await;
    super::metric_value(&text, "outbox_delivery_latency_seconds_count").unwrap_or(0.0)
}

/// Waits until the relay's stream delivers a row committed after WAL position `lsn`: first its
/// acknowledgement reaches `lsn` (so every row committed before it was confirmed and counted),
/// then the stream's count grows. A stream that decodes on but sends nothing (PostgreSQL 18
/// without its publication) acknowledges past `lsn` and never passes the second wait.
pub async fn stream_delivers_after(relay: &super::Relay, lsn: u64) {
    eventually("the stream acknowledges past the position", || async {
        (relay.metrics.acked_lsn.get() >= lsn).then_some(())
    })
    .await;
    let delivered = stream_delivered(relay).await;
    eventually("the stream delivers a row committed after it", || async {
        (relay.metrics.stream_up.get() == 1 && stream_delivered(relay).await > delivered)
            .then_some(())
    })
    .await;
}

/// Rows of `outbox_events` not marked published yet (dead letters included).
pub async fn unpublished_rows(c: &tokio_postgres::Client) -> i64 {
    c.query_one(
        "SELECT count(*) FROM outbox_events WHERE published_at IS NULL",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// Rows of `outbox_events` named `event_name` not marked published yet.
pub async fn unpublished_named(c: &tokio_postgres::Client, event_name: &str) -> i64 {
    c.query_one(
        "SELECT count(*) FROM outbox_events WHERE event_name = $1 AND published_at IS NULL",
        &[&event_name],
    )
    .await
    .unwrap()
    .get(0)
}

/// Waits until every row of `outbox_events` is marked published.
pub async fn wait_all_published(c: &tokio_postgres::Client) {
    eventually("every row is marked published", || async {
        (unpublished_rows(c).await == 0).then_some(())
    })
    .await;
}
