//! `outbox-relay run` as a process: the HTTP endpoint (`/metrics`, `/healthz`, `/readyz`),
//! SIGINT/SIGTERM as the shutdown token, and [`relay::run`](crate::relay::run) until shutdown.

use crate::command::CommandError;
use crate::config::RunArgs;
use crate::metrics::Metrics;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Serves the HTTP endpoint and runs the relay until a signal (or a fatal error) ends it.
pub async fn execute(args: &RunArgs) -> Result<(), CommandError> {
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .map_err(|source| CommandError::Listen {
            addr: args.metrics_addr,
            source,
        })?;
    let http_stop = CancellationToken::new();
    let http = tokio::spawn(crate::http::serve(
        listener,
        Arc::new(registry),
        metrics.clone(),
        http_stop.clone(),
    ));
    let result = crate::relay::run(args, metrics, shutdown).await;
    http_stop.cancel();
    let _ = http.await;
    Ok(result?)
}

/// Cancels `token` on SIGINT or SIGTERM.
async fn cancel_on_signal(token: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
    }
    token.cancel();
}
