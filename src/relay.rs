//! `outbox-relay run`: start-up checks, then the stream until shutdown.
//!
//! Takes its configuration and its shutdown token as arguments, so tests drive it in-process.

use crate::config::RunArgs;
use crate::metrics::Metrics;
use crate::postgres::{PgError, PgTarget};

use crate::replication::setup::{self, SetupError};
use crate::replication::stream::{Stream, StreamError, StreamSettings};
use crate::sink::valkey::ValkeySink;
use crate::sink::SinkError;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Postgres(#[from] PgError),
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("cannot reach Valkey at {target}: check OUTBOX_VALKEY_URL (or VALKEY_ADDR) and that Valkey is running")]
    Valkey {
        target: String,
        #[source]
        source: SinkError,
    },
    #[error(transparent)]
    Stream(#[from] StreamError),
}

/// Checks everything a stream needs and creates the publication and slot when missing.
pub async fn prepare(args: &RunArgs) -> Result<(PgTarget, ValkeySink), RelayError> {
    let pg = args.db.target()?;
    let valkey_client = args.valkey.client()?;
    let client = pg.connect().await?;
    setup::check_wal_level(&client).await?;
    setup::check_replication_privilege(&client).await?;
    setup::check_table(&client, &args.db.table).await?;
    // The publication first: a slot created before it may miss the table's first changes.
    setup::ensure_publication(&client, &args.db.publication, &args.db.table).await?;
    let slot = setup::ensure_slot(&client, &args.slot).await?;
    tracing::info!(slot = %args.slot, confirmed_flush = %slot.confirmed_flush, wal_status = ?slot.wal_status, "slot ready");
    let sink = ValkeySink::connect(valkey_client, args.valkey.valkey_timeout)
        .await
        .map_err(|source| RelayError::Valkey {
            target: args.valkey.display(),
            source,
        })?;
    warn_on_eviction(&sink).await;
    Ok((pg, sink))
}

/// With eviction enabled, Valkey may silently drop tasks under memory pressure.
async fn warn_on_eviction(sink: &ValkeySink) {
    let mut conn = sink.connection();
    let policy: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut conn)
        .await;
    match policy {
        Ok(kv) if kv.get(1).is_some_and(|p| p != "noeviction") => tracing::warn!(
            policy = %kv[1],
            "valkey maxmemory-policy is not noeviction: under memory pressure tasks can be evicted \
             silently; set `maxmemory-policy noeviction`"
        ),
        Ok(_) => {}
        Err(e) => tracing::debug!(error = %e, "could not read maxmemory-policy"),
    }
}

/// Runs the relay until `shutdown` fires.
pub async fn run(
    args: &RunArgs,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    let (pg, sink) = prepare(args).await?;
    let stream = Stream {
        pg,
        settings: StreamSettings {
            slot: args.slot.clone(),
            publication: args.db.publication.clone(),
            table: args.db.table.clone(),
            batch_rows: args.batch_size,
            batch_bytes: 8 << 20,
            max_inflight: args.max_inflight_batches,
            shutdown_timeout: args.shutdown_timeout,
            buffer_events: 2048,
        },
        tasks: Arc::new(args.task_settings()),
        sink,
        metrics,
    };
    stream.run(shutdown).await?;
    tracing::info!("relay stopped");
    Ok(())
}
