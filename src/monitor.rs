//! Periodic, cheap observation: unpublished rows and their age, dead letters, the slot's lag,
//! Postgres and Valkey reachability (for `/readyz`), the optional heartbeat through the slot,
//! and progress logs while the poller works through a backlog.
//!
//! The monitor never hangs on a dead link: Postgres, Valkey and the heartbeat are observed side
//! by side, each bounded by [`MonitorSettings::check_timeout`]; a check that runs out of time
//! counts as a failure (the dependency is unreachable, `/readyz` says so) and is logged.

use crate::metrics::{LinkLabel, Metrics};
use crate::store::Store;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The prefix of the relay's heartbeat messages (`pg_logical_emit_message`).
pub use crate::replication::HEARTBEAT_PREFIX;

/// How the monitor runs.
#[derive(Debug, Clone)]
pub struct MonitorSettings {
    /// How long the monitor sleeps between two rounds of observation.
    pub interval: Duration,
    /// Emit a heartbeat through the slot this often (stream mode), if set.
    pub heartbeat: Option<Duration>,
    /// A heartbeat not seen on the stream for this long means the stream is stalled.
    pub stall_after: Duration,
    /// How long one check (Postgres, Valkey, a heartbeat) may take before it counts as failed.
    pub check_timeout: Duration,
    /// How long the Valkey check may take: `check_timeout`, or longer, as its PING shares a
    /// connection with the pollers' writes and waits behind them, up to their deadline (found by review: at the
    /// check timeout alone, four pollers' 8 MiB writes on a 1 MiB/s link outlasted it, and the
    /// check reset the connection that was delivering).
    pub valkey_check_timeout: Duration,
    /// The slot, in stream mode.
    pub slot: Option<String>,
}

/// The periodic observer of one relay; [`Monitor::run`] until shutdown.
pub struct Monitor {
    /// Connections for the counts, the slot's lag and the heartbeat: shared with the relay's
    /// other SQL work, so an unreachable Postgres shows here as a failed checkout.
    pub pool: deadpool_postgres::Pool,
    /// The outbox table's queries (unpublished rows, dead letters).
    pub store: Store,
    /// The connection PINGed for Valkey's reachability.
    pub valkey: crate::valkey::ValkeyConnection,
    /// How often to observe, and whether to emit heartbeats and watch for a stall.
    pub settings: MonitorSettings,
    /// Where the observations go: the gauges, and the health `/readyz` answers from.
    pub metrics: Arc<Metrics>,
}

impl Monitor {
    pub async fn run(self, shutdown: CancellationToken) {
        let mut last_heartbeat: Option<Instant> = None;
        let mut progress = Progress::default();
        loop {
            let beat = self
                .settings
                .heartbeat
                .filter(|every| last_heartbeat.is_none_or(|t| t.elapsed() >= *every));
            if beat.is_some() {
                last_heartbeat = Some(Instant::now());
            }
            let checks = async {
                tokio::join!(self.observe_postgres(), self.observe_valkey(), async {
                    if beat.is_some() {
                        self.heartbeat().await;
                    }
                })
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = checks => {}
            }
            if self.settings.heartbeat.is_some() {
                self.check_stall();
            }
            progress.log(&self.metrics);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.settings.interval) => {}
            }
        }
    }

    /// `check` bounded by the check timeout.
    async fn bounded<T>(
        &self,
        check: impl std::future::Future<Output = Result<T, MonitorError>>,
    ) -> Result<T, MonitorError> {
        self.bounded_by(self.settings.check_timeout, check).await
    }

    async fn bounded_by<T>(
        &self,
        limit: Duration,
        check: impl std::future::Future<Output = Result<T, MonitorError>>,
    ) -> Result<T, MonitorError> {
        tokio::time::timeout(limit, check)
            .await
            .unwrap_or(Err(MonitorError::TimedOut(limit)))
    }

    async fn observe_postgres(&self) {
        let ok = self.bounded(self.query_postgres()).await;
        match &ok {
            Err(e @ MonitorError::TimedOut(_)) => tracing::warn!(
                error = %crate::error_chain::error_chain(e),
                "postgres health check timed out: the link may be dead"
            ),
            Err(e) => {
                tracing::debug!(error = %crate::error_chain::error_chain(e), "postgres check failed")
            }
            Ok(()) => {}
        }
        self.set_link("postgres", ok.is_ok());
    }

    async fn query_postgres(&self) -> Result<(), MonitorError> {
        let client = self.pool.get().await?;
        let (pending, oldest) = self.store.unpublished(&**client).await?;
        self.metrics.pending.set(pending);
        self.metrics
            .oldest_pending_age
            .set(oldest.unwrap_or(0.0).max(0.0));
        let dead = self.store.dead_letters_count(&**client).await?;
        self.metrics.dead_letters.set(dead);
        if let Some(slot) = &self.settings.slot {
            let row = client
                .query_opt(
                    "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint, wal_status \
                     FROM pg_replication_slots WHERE slot_name = $1",
                    &[slot],
                )
                .await?;
            if let Some(row) = row {
                let lag: Option<i64> = row.get(0);
                self.metrics.lag_bytes.set(lag.unwrap_or(0).max(0) as u64);
                if row.get::<_, Option<String>>(1).as_deref() == Some("lost") {
                    tracing::error!(slot = %slot, "replication slot invalidated (wal_status = lost); the stream recreates it on reconnect and the poller delivers what it missed");
                }
            }
        }
        Ok(())
    }

    async fn observe_valkey(&self) {
        let mut conn = self.valkey.clone();
        let pong = self
            .bounded_by(self.settings.valkey_check_timeout, async {
                redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .map_err(MonitorError::from)
            })
            .await;
        if let Err(e @ MonitorError::TimedOut(_)) = &pong {
            // Its own timeout fired first: nothing may queue behind that socket.
            conn.reset();
            tracing::warn!(error = %crate::error_chain::error_chain(e), "valkey health check timed out");
        }
        self.set_link("valkey", pong.is_ok());
    }

    /// Records a dependency's reachability; a change is logged, and a loss counted.
    fn set_link(&self, link: &'static str, ok: bool) {
        let health = &self.metrics.health;
        let was = match link {
            "postgres" => health.set_postgres(ok),
            _ => health.set_valkey(ok),
        };
        if was && !ok {
            self.metrics
                .link_failures
                .get_or_create(&LinkLabel { link })
                .inc();
            tracing::warn!(link, "health check failed: /readyz reports not ready");
        } else if !was && ok {
            tracing::info!(link, "health check passes again");
        }
    }

    async fn heartbeat(&self) {
        let emitted = self.bounded(async {
            let client = self.pool.get().await?;
            let row = client
                .query_one(
                    "SELECT (pg_logical_emit_message(false, $1, now()::text) - '0/0'::pg_lsn)::bigint",
                    &[&HEARTBEAT_PREFIX],
                )
                .await?;
            Ok::<i64, MonitorError>(row.get(0))
        })
        .await;
        match emitted {
            Ok(lsn) => self.metrics.health.heartbeat_emitted(lsn.max(0) as u64),
            Err(e) => {
                tracing::warn!(error = %crate::error_chain::error_chain(&e), "heartbeat failed")
            }
        }
    }

    fn check_stall(&self) {
        let stalled = self
            .metrics
            .health
            .heartbeat_wait()
            .is_some_and(|w| w >= self.settings.stall_after);
        let was = self.metrics.stream_stalled.get() == 1;
        if stalled && !was {
            tracing::error!(
                after_secs = self.settings.stall_after.as_secs(),
                "stream stalled: a heartbeat written to the WAL has not come back through the slot"
            );
        } else if !stalled && was {
            tracing::info!("stream recovered: heartbeats come back again");
        }
        self.metrics.stream_stalled.set(i64::from(stalled));
    }
}

/// Logs the poller's progress through a backlog at a steady interval.
#[derive(Default)]
struct Progress {
    last: Option<(Instant, u64)>,
}

impl Progress {
    const EVERY: Duration = Duration::from_secs(10);

    fn log(&mut self, m: &Metrics) {
        let done = m.poller_delivered.get();
        let Some((at, before)) = self.last else {
            self.last = Some((Instant::now(), done));
            return;
        };
        if at.elapsed() < Self::EVERY {
            return;
        }
        let delta = done - before;
        if delta > 0 {
            let rate = delta as f64 / at.elapsed().as_secs_f64();
            tracing::info!(
                rows_done = done,
                rows_per_sec = rate as u64,
                remaining = m.pending.get(),
                "poller progress"
            );
        }
        self.last = Some((Instant::now(), done));
    }
}

#[derive(Debug, thiserror::Error)]
enum MonitorError {
    #[error("cannot get a postgres connection")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("query failed")]
    Query(#[from] tokio_postgres::Error),
    #[error("valkey command failed")]
    Valkey(#[from] redis::RedisError),
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
}
