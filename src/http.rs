//! The HTTP endpoint: `/metrics` (Prometheus text), `/healthz` (the process lives) and
//! `/readyz` (it can deliver: Postgres and Valkey reachable, the stream up in stream mode, not
//! stalled). Binds where it is told; the default configuration keeps it on loopback.

use crate::metrics::Metrics;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
struct AppState {
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
}

/// Serves until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(AppState { registry, metrics });
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            "metrics encoding failed\n".to_owned(),
        ),
    }
}

async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let m = &state.metrics;
    // A standby replica delivers through its poller while another replica streams.
    let streaming = m.stream_up.get() == 1 || m.stream_standby.get() == 1;
    match m.health.ready(streaming, m.stream_stalled.get() == 1) {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", why.join(", ")),
        ),
    }
}
