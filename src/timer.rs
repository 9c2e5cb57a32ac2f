//! Timers for `select!` loops.

use tokio::time::Instant;

/// Sleeps until `at`, or forever without one (a `select!` branch that is off).
pub async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
