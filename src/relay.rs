//! `outbox-relay run`: start-up checks, then the stream (with the recovery poller and the
//! published-row marker beside it) or the poller alone, until shutdown.
//!
//! Takes its configuration and its shutdown token as arguments, so tests drive it in-process.

use crate::config::{Mode, OnSlotLost, RunArgs};
use crate::error_chain::error_chain;
use crate::marker::Marker;
use crate::metrics::Metrics;
use crate::monitor::{Monitor, MonitorSettings};
use crate::pgoutput::TableName;
use crate::poller::{self, Poller, PollerSettings};
use crate::postgres::{PgError, PgTarget};
use crate::replication::pg_slot::PgSlot;
use crate::replication::setup::{self, SetupError};
use crate::replication::standby;
use crate::replication::stream::{Stream, StreamError, StreamSettings};
use crate::shared_event_ids::{SharedIdsHandle, SharedIdsWatch};
use crate::sink::valkey::ValkeySink;
use crate::sink::SinkError;
use crate::store::pg::{PgOutbox, TxLimits};
use crate::store::Store;
use crate::supervise::{supervise, Supervised};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Postgres(#[from] PgError),
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error(
        "Valkey at {target} refused the replica wait's probe (SET {key} and WAIT, which \
         OUTBOX_VALKEY_WAIT_REPLICAS needs): allow them to the relay's user (`+set +wait`, and \
         the key {key} if its key patterns are narrower than ~asynq:*), or set \
         OUTBOX_VALKEY_WAIT_REPLICAS=0",
        key = crate::sink::valkey::WAIT_MARK_KEY
    )]
    WaitRefused {
        target: String,
        #[source]
        source: SinkError,
    },
    #[error("cannot reach Valkey at {target}: check OUTBOX_VALKEY_URL (or VALKEY_ADDR) and that Valkey is running")]
    Valkey {
        target: String,
        #[source]
        source: SinkError,
    },
    #[error(
        "Valkey at {target} is a read-only replica (ROLE answers {role:?}{node}): tasks written \
         there would be refused; point OUTBOX_VALKEY_URL (or VALKEY_ADDR) at the primary, or use \
         redis+sentinel:// to follow the primary"
    )]
    ValkeyReplica {
        target: String,
        role: String,
        node: String,
    },
    #[error(
        "the Valkey user at {target} may not read the stream's order fence ({detail}): the \
         enqueue script runs HMGET on asynq:{{<queue>}}:outbox_relay_order; add +hmget to the \
         user's ACL, and that key to its key patterns if they are narrower than ~asynq:* \
         (docs/configuration.md, The Valkey user)"
    )]
    ValkeyAclWithoutFence { target: String, detail: String },
    #[error(transparent)]
    Stream(#[from] StreamError),
    #[error(transparent)]
    Standby(#[from] crate::replication::standby::StandbyError),
    #[error(
        "a background task (poller, marker, monitor or another) panicked: {0}; the relay stopped \
         rather than run without it (rows it delivers or marks would wait for ever)"
    )]
    BackgroundPanicked(String),
}

/// Task bytes at which the stream closes a batch (with `OUTBOX_BATCH_SIZE` rows at most), so a
/// batch holds this plus at most one task: with `OUTBOX_MAX_INFLIGHT_BATCHES`, this bounds what
/// the stream holds while Valkey is slow or down. A poller's write stays within it (a task
/// larger than it goes alone).
const BATCH_BYTES: usize = 8 << 20;
/// Payload and metadata text one poll round keeps (and the row that crosses it): four writes of
/// [`BATCH_BYTES`], as many as the stream's default batches in flight, whatever
/// `OUTBOX_BATCH_SIZE` rows of the largest size would make.
const POLL_ROUND_BYTES: usize = 4 * BATCH_BYTES;
/// Replication events buffered between the socket reader and the session: enough to keep the
/// session busy while it writes, few enough that memory stays small with large rows.
const REPLICATION_BUFFER_EVENTS: usize = 2048;
/// The poller's tasks per Valkey write (at most `OUTBOX_BATCH_SIZE`): the unit of partial
/// success, whose marks a later failure in the same round does not lose.
const POLLER_CHUNK: usize = 100;
/// Connections the pool allows beside the pollers: the marker's, the monitor's, and the check
/// for rows sharing an event_id (crate::shared_event_ids; made only when it runs, as the pool
/// connects on demand).
const POOL_EXTRA: usize = 3;
/// A stream write unanswered for this many Valkey timeouts has failed, whatever the client
/// library does (a backstop for a write stuck behind a dead link).
const WRITE_TIMEOUT_FACTOR: u32 = 3;

/// Whether the relay's slot exists, on the standby with `OUTBOX_REPLICATION_URL`, else on the
/// primary (`client`).
async fn slot_exists(client: &tokio_postgres::Client, args: &RunArgs) -> Result<bool, RelayError> {
    let found = match &args.replication_url {
        None => setup::slot_info(client, &args.slot).await?,
        Some(url) => {
            let standby = standby::target(url)?
                .with_link_timeout(args.link_timeout)
                .connect()
                .await?;
            setup::slot_info(&standby, &args.slot).await?
        }
    };
    Ok(found.is_some())
}

/// Checks everything the configured mode needs; in stream mode creates the publication and the
/// slot when missing.
pub async fn prepare(args: &RunArgs) -> Result<(PgTarget, ValkeySink, TableName), RelayError> {
    let pg = args.db.target()?.with_link_timeout(args.link_timeout);
    let valkey_target = args.valkey.target()?;
    let client = pg.connect().await?;
    let payload_is_json = args.payload_format == crate::task::PayloadFormat::Envelope;
    setup::check_table(&client, &args.db.table, payload_is_json).await?;
    let table = setup::resolve_table(&client, &args.db.table).await?;
    if args.mode == Mode::Poll || args.recovery {
        setup::check_poller_columns(&client, &table).await?;
    }
    // Valkey before the slot: a first run that cannot write tasks must not leave behind a new
    // slot that pins WAL until someone drops it.
    let sink = connect_sink(args, valkey_target, None).await?;
    refuse_replica(&sink, &args.valkey.display()).await?;
    warn_on_eviction(&sink).await;
    check_replica_wait(&sink, args).await?;
    crate::valkey_durability::warn_if_volatile(
        &sink.connection(),
        args.valkey.valkey_wait_replicas > 0,
    )
    .await;
    if args.mode == Mode::Stream {
        setup::check_wal_level(&client).await?;
        setup::check_replication_privilege(&client).await?;
        // A relay that must never skip events itself does not create a dropped publication
        // again behind its slot (found by review; the watch applies the same rule while it runs),
        // whether the slot is on the primary or on a standby (OUTBOX_REPLICATION_URL; found by
        // review: that case was left to the running watch, and a restart after the watch's stop
        // created the publication behind the slot).
        if args.on_slot_lost == OnSlotLost::Stop
            && crate::replication::publication::current(&client, &args.db.publication)
                .await?
                .oid
                .is_none()
            && slot_exists(&client, args).await?
        {
            return Err(SetupError::PublicationDroppedBehindSlot {
                publication: args.db.publication.clone(),
                slot: args.slot.clone(),
            }
            .into());
        }
        // The publication first: a slot created before it may miss the table's first changes.
        setup::ensure_publication(&client, &args.db.publication, &table).await?;
        let slot = match &args.replication_url {
            None => setup::ensure_slot(&client, &args.slot).await?,
            Some(url) => standby::ensure_slot(&client, &standby::target(url)?, &args.slot).await?,
        };
        tracing::info!(
            slot = %args.slot,
            confirmed_flush = %slot.confirmed_flush,
            wal_status = %slot.wal_status.as_deref().unwrap_or("unknown"),
            "slot ready"
        );
    }
    Ok((pg, sink, table))
}

/// A sink on a connection of its own; with `stream` (its field in the order keys), the
/// stream's (see [`ValkeySink::connect_ordered`]).
async fn connect_sink(
    args: &RunArgs,
    target: crate::valkey::ValkeyTarget,
    stream: Option<String>,
) -> Result<ValkeySink, RelayError> {
    let wait = args.valkey.replica_wait()?;
    match stream {
        Some(stream) => ValkeySink::connect_ordered(target, stream).await,
        None => ValkeySink::connect(target).await,
    }
    .map(|sink| sink.waiting_for_replicas(wait))
    .map_err(|source| RelayError::Valkey {
        target: args.valkey.display(),
        source,
    })
}

/// With `OUTBOX_VALKEY_WAIT_REPLICAS`: refuses a user that may not run the wait (found by
/// review: every write failed on NOPERM and was sent again, for ever), and warns while fewer
/// replicas than asked for are connected (every write then fails until enough are).
async fn check_replica_wait(sink: &ValkeySink, args: &RunArgs) -> Result<(), RelayError> {
    let connected = sink
        .check_wait()
        .await
        .map_err(|source| RelayError::WaitRefused {
            target: args.valkey.display(),
            source,
        })?;
    let wanted = usize::try_from(args.valkey.valkey_wait_replicas).unwrap_or(usize::MAX);
    if let Some(connected) = connected.filter(|c| *c < wanted) {
        tracing::warn!(
            slot = %args.slot,
            connected,
            wanted,
            "fewer Valkey replicas are connected than OUTBOX_VALKEY_WAIT_REPLICAS asks for: \
             every write fails and is sent again until enough are (rows stay unpublished, the \
             WAL unacknowledged)"
        );
    }
    Ok(())
}

/// The stream's name in the queues' order keys (`src/sink/order_chain.rs`): the Postgres
/// system (`pg_control_system()`, the same on a primary and its standbys), the database and the
/// slot, so that relays of other outboxes writing to the same queues keep chains apart. Without
/// the system's identifier (a server that refuses `pg_control_system()`) it is `-`: relays of
/// same-named databases and slots on two systems, writing to one queue, then fence each
/// other's writes now and then (retried; order holds), nothing worse.
async fn stream_identity(pg: &PgTarget, slot: &str) -> Result<String, RelayError> {
    let client = pg.connect().await?;
    let database: String = client
        .query_one("SELECT current_database()", &[])
        .await
        .map_err(PgError::from)?
        .get(0);
    let system = match client
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await
    {
        Ok(row) => row.get::<_, String>(0),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the Postgres system identifier for the \
                stream's order fence; using database and slot only");
            "-".to_owned()
        }
    };
    Ok(format!("{system}/{database}/{slot}"))
}

/// Refuses to stream as a Valkey user whose ACL keeps the enqueue script from reading the
/// order fence (no `HMGET`, or key patterns without `asynq:{<queue>}:outbox_relay_order`, both
/// fine before the fence): every script call after a chain's first would be refused, and its
/// rows would wait for the recovery poller (found by review).
async fn refuse_fence_without_access(
    sink: &ValkeySink,
    queue: &str,
    args: &RunArgs,
) -> Result<(), RelayError> {
    sink.check_fence(queue)
        .await
        .map_err(|detail| RelayError::ValkeyAclWithoutFence {
            target: args.valkey.display(),
            detail,
        })
}

/// Refuses a Valkey that answers `ROLE` as a replica: it accepts connections, PING and script
/// loads, and refuses every write with READONLY, which the relay would retry forever while
/// looking healthy. On a cluster every primary is asked (they are primaries by definition; the
/// check costs nothing there). A `ROLE` the ACL forbids is not a refusal: the check is skipped.
async fn refuse_replica(sink: &ValkeySink, target: &str) -> Result<(), RelayError> {
    let mut conn = sink.connection();
    let replies = match conn
        .on_each_primary::<Vec<redis::Value>>(&redis::cmd("ROLE"))
        .await
    {
        Ok(replies) => replies,
        Err(e) => {
            tracing::debug!(error = %e, "could not ask valkey for its ROLE");
            return Ok(());
        }
    };
    for (node, reply) in replies {
        let role = match reply {
            Ok(values) => values
                .first()
                .and_then(|v| redis::from_redis_value_ref::<String>(v).ok()),
            Err(e) => {
                tracing::debug!(error = %e, "could not ask valkey for its ROLE");
                None
            }
        };
        if let Some(role) = role.filter(|r| r == "slave" || r == "replica") {
            return Err(RelayError::ValkeyReplica {
                target: target.to_owned(),
                role,
                node: node.map(|n| format!(" on {n}")).unwrap_or_default(),
            });
        }
    }
    Ok(())
}

/// With eviction enabled, Valkey may silently drop tasks under memory pressure. On a cluster
/// every primary is asked.
async fn warn_on_eviction(sink: &ValkeySink) {
    let mut conn = sink.connection();
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET").arg("maxmemory-policy");
    let replies = match conn.on_each_primary::<Vec<String>>(&cmd).await {
        Ok(replies) => replies,
        Err(e) => {
            tracing::debug!(error = %e, "could not read maxmemory-policy");
            return;
        }
    };
    for (node, policy) in replies {
        let node = node.unwrap_or_default();
        match policy {
            Ok(kv) if kv.get(1).is_some_and(|p| p != "noeviction") => tracing::warn!(
                policy = %kv[1],
                node = %node,
                "valkey maxmemory-policy is not noeviction: under memory pressure tasks can be \
                 evicted silently; set `maxmemory-policy noeviction`"
            ),
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(error = %e, node = %node, "could not read maxmemory-policy")
            }
        }
    }
}

/// Without a unique index on event_id, warns and starts the check for rows that share one
/// (crate::shared_event_ids). A failed look-up is logged and the check started anyway: with a
/// unique index it finds nothing, and its look-ups use that index.
async fn watch_shared_event_ids(
    pool: &deadpool_postgres::Pool,
    store: &Store,
    table: &TableName,
    tasks: &Arc<crate::task::TaskSettings>,
    metrics: &Arc<Metrics>,
    background: &CancellationToken,
    set: &mut JoinSet<()>,
) -> Option<SharedIdsHandle> {
    let indexes = match pool.get().await {
        Ok(client) => async {
            Ok((
                setup::has_unique_event_id(&client, table).await?,
                setup::has_event_id_index(&client, table).await?,
            ))
        }
        .await
        .map_err(|e: setup::SetupError| error_chain(&e)),
        Err(e) => Err(error_chain(&e)),
    };
    let indexed = match indexes {
        Ok((true, _)) => return None,
        Ok((false, indexed)) => {
            tracing::warn!(
                table = %table.sql(),
                "the outbox table has no unique index on event_id: two rows with one event_id \
                 in one queue become one task (asynq keeps one task per TaskID in a queue); \
                 such rows are logged and counted in outbox_events_shared_event_id_total"
            );
            indexed
        }
        Err(e) => {
            tracing::warn!(
                error = %e,
                "could not check event_id for a unique index; checking writes that meet existing \
                 TaskIDs for rows sharing an event_id, in case"
            );
            true
        }
    };
    if !indexed {
        tracing::warn!(
            table = %table.sql(),
            "no index on event_id either: each check for rows sharing an event_id scans \
             the table (the checks are spaced out by how long they take); \
             CREATE INDEX CONCURRENTLY ON <table> (event_id) makes them cheap"
        );
    }
    let (watch, handle) =
        SharedIdsWatch::new(pool.clone(), store.clone(), tasks.clone(), metrics.clone());
    set.spawn(watch.run(background.clone()));
    Some(handle)
}

/// Runs the relay until `shutdown` fires.
pub async fn run(
    args: &RunArgs,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> Result<(), RelayError> {
    let (pg, sink, table) = prepare(args).await?;
    metrics.health.set_postgres(true);
    metrics.health.set_valkey(true);
    metrics.health.set_running(true, args.mode == Mode::Stream);
    let tasks = Arc::new(args.task_settings());
    let store = Store::new(table.clone()).deleting_delivered(args.delete_delivered);
    let pool = pg.pool(args.pollers + POOL_EXTRA);
    let poller_settings = PollerSettings {
        batch_size: args.batch_size,
        chunk_size: args.batch_size.min(POLLER_CHUNK),
        chunk_bytes: BATCH_BYTES,
        claim_bytes: POLL_ROUND_BYTES,
        poll_interval: args.poll_interval,
        recovery_grace: (args.mode == Mode::Stream).then_some(args.recovery_grace),
        max_attempts: args.max_attempts,
        attempt_backoff: args.attempt_backoff,
        write_timeout: args.valkey.valkey_timeout * WRITE_TIMEOUT_FACTOR,
    };
    let outbox = PgOutbox {
        pool: pool.clone(),
        store: store.clone(),
        // A poll transaction cut off from its client is ended by the server, which releases its
        // row locks: once idle longer than any wait of a round, or once what it sends stays
        // unacknowledged for the link timeout (as the relay's own sockets do).
        tx_limits: Some(TxLimits {
            idle: poller_settings.idle_in_transaction_bound(args.link_timeout),
            unacknowledged: args.link_timeout,
        }),
    };
    // Background work stops on its own token, after the stream has finished its shutdown.
    let background = CancellationToken::new();
    let mut set = JoinSet::new();

    let shared_ids = watch_shared_event_ids(
        &pool,
        &store,
        &table,
        &tasks,
        &metrics,
        &background,
        &mut set,
    )
    .await;
    let run_pollers = args.mode == Mode::Poll || args.recovery;
    if run_pollers {
        let wake = Arc::new(Notify::new());
        if args.mode == Mode::Poll && args.poll_notify {
            set.spawn(poller::listen(
                pg.clone(),
                args.db.publication.clone(),
                wake.clone(),
                background.clone(),
            ));
        }
        for _ in 0..args.pollers {
            let poller = Poller {
                table: outbox.clone(),
                settings: poller_settings.clone(),
                tasks: tasks.clone(),
                sink: sink.clone(),
                metrics: metrics.clone(),
                wake: wake.clone(),
                shared_ids: shared_ids.clone(),
            };
            let token = background.clone();
            set.spawn(async move { poller.run(token).await });
        }
    }
    set.spawn(
        Monitor {
            pool: pool.clone(),
            store: store.clone(),
            valkey: sink.connection(),
            settings: MonitorSettings {
                interval: args.health_interval,
                heartbeat: args
                    .heartbeat_interval
                    .filter(|_| args.mode == Mode::Stream),
                stall_after: args.stall_after,
                check_timeout: args.link_timeout,
                // The PING waits behind every poller's chunk (at most BATCH_BYTES each) on the
                // connection they share.
                valkey_check_timeout: args.link_timeout.max(crate::valkey::write_deadline(
                    args.valkey.valkey_timeout * WRITE_TIMEOUT_FACTOR,
                    (args.pollers * BATCH_BYTES) as u64,
                )),
                slot: (args.mode == Mode::Stream).then(|| args.slot.clone()),
            },
            metrics: metrics.clone(),
        }
        .run(background.clone()),
    );
    if !args.log_summary_interval.is_zero() {
        set.spawn(log_summaries(
            metrics.clone(),
            args.log_summary_interval,
            background.clone(),
        ));
    }
    if let Some(older_than) = args.cleanup_older_than {
        set.spawn(crate::admin::periodic_cleanup(
            pool.clone(),
            store.clone(),
            older_than,
            args.cleanup_interval,
            background.clone(),
        ));
    }

    let marker = (args.mode == Mode::Stream && args.mark_published).then(|| {
        let (marker, handle) = Marker::new(
            outbox.clone(),
            metrics.clone(),
            args.recovery.then_some(args.recovery_grace),
        );
        set.spawn(marker.run(background.clone()));
        handle
    });
    // A background task ends only on the background token, which is cancelled below; one that
    // panics before (a poller, the marker) must not leave the relay running without it.
    let stop = shutdown.child_token();
    let work = async {
        match args.mode {
            Mode::Poll => {
                tracing::info!(pollers = args.pollers, "running in poll mode");
                stop.cancelled().await;
                Ok(())
            }
            Mode::Stream => {
                // The stream writes on a Valkey connection of its own. On a shared one,
                // another user that gives it up (the monitor's PING timing out, a poller
                // resetting it after its own write timed out) sent the stream's next write out
                // on a new connection while its earlier write still travelled on the old one,
                // and the later batch could land first: out of commit order, with nothing
                // failing on the stream's side (found by review; tests/links.rs
                // `a_link_given_up_by_the_monitor_keeps_the_streams_order`). On its own
                // connection only the stream's own failures replace it, and it then writes
                // again, in order, whatever was in flight.
                let stream_id = stream_identity(&pg, &args.slot).await?;
                let stream_sink =
                    connect_sink(args, args.valkey.target()?, Some(stream_id)).await?;
                refuse_fence_without_access(&stream_sink, &args.queue, args).await?;
                // The slot's server: a standby with OUTBOX_REPLICATION_URL, else the primary.
                let (pg, primary) = match &args.replication_url {
                    Some(url) => (standby::target(url)?, Some(pg)),
                    None => (pg, None),
                };
                let stream = Stream {
                    port: PgSlot {
                        pg,
                        slot: args.slot.clone(),
                        publication: args.db.publication.clone(),
                        // As resolved at start: a search path changed since must not make the
                        // checks and the repair name another table, or none (found by review).
                        table: table.clone(),
                        primary,
                        buffer_events: REPLICATION_BUFFER_EVENTS,
                        first_publication: Default::default(),
                    },
                    settings: StreamSettings {
                        slot: args.slot.clone(),
                        table,
                        batch_rows: args.batch_size,
                        batch_bytes: BATCH_BYTES,
                        max_inflight: args.max_inflight_batches,
                        write_timeout: args.valkey.valkey_timeout * WRITE_TIMEOUT_FACTOR,
                        shutdown_timeout: args.shutdown_timeout,
                        on_slot_lost: args.on_slot_lost,
                        takeover_after: args.takeover_after,
                        link_timeout: Some(args.link_timeout),
                        publication_check: Some(args.health_interval),
                    },
                    tasks,
                    sink: stream_sink,
                    metrics: metrics.clone(),
                    marker,
                    shared_ids,
                    slot_watch: Default::default(),
                };
                stream.run(stop.clone()).await.map_err(RelayError::from)
            }
        }
    };
    let result = match supervise(work, &mut set, &stop).await {
        Supervised::Ended(result) => result,
        Supervised::Panicked { panic, work } => {
            if let Err(e) = &work {
                tracing::warn!(error = %crate::error_chain::error_chain(e), "the stream also ended with an error");
            }
            Err(RelayError::BackgroundPanicked(panic))
        }
    };
    metrics.health.set_running(false, false);
    background.cancel();
    let drained = tokio::time::timeout(args.shutdown_timeout.max(Duration::from_secs(1)), async {
        while set.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            running = set.len(),
            "background tasks did not stop in time; aborting them"
        );
        set.abort_all();
    }
    tracing::info!("relay stopped");
    result
}

/// Every `interval` until `shutdown`, one line at info on how delivery went since the last one
/// (as Debezium's "records sent during previous ..."). It reads the metrics' atomics only, so
/// the stream and the pollers never wait for it.
async fn log_summaries(metrics: Arc<Metrics>, interval: Duration, shutdown: CancellationToken) {
    let delivered = |m: &Metrics| m.published.get().saturating_add(m.poller_delivered.get());
    let mut last = delivered(&metrics);
    let mut since = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        let now = tokio::time::Instant::now();
        let total = delivered(&metrics);
        let events = total.saturating_sub(last);
        let secs = now.duration_since(since).as_secs_f64().max(0.001);
        let per_sec = (events as f64 / secs * 10.0).round() / 10.0;
        tracing::info!(
            events,
            events_per_sec = per_sec,
            total,
            lag_bytes = metrics.lag_bytes.get(),
            inflight_batches = metrics.inflight_batches.get(),
            unpublished = metrics.pending.get(),
            dead_letters = metrics.dead_letters.get(),
            "summary of the last {}s",
            interval.as_secs_f64()
        );
        last = total;
        since = now;
    }
}
