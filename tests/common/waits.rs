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
