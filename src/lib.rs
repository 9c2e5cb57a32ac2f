//! outbox-relay: delivers rows of a PostgreSQL transactional outbox to Valkey as asynq tasks,
//! through logical replication, acknowledging an LSN only after Valkey confirmed every task up
//! to that commit.
//!
//! # Layout
//! - [`config`]: the CLI and `OUTBOX_*` settings, validated before anything connects.
//! - [`pgoutput`]: PURE decoding of pgoutput messages into outbox rows; no I/O, never panics.
//! - [`task`]: PURE row -> asynq task (the Go kit's Envelope, asynq's TaskMessage bytes).
//! - [`sink`]: the [`sink::Sink`] contract; the Valkey writer (asynq's enqueue script,
//!   pipelined) and an in-memory sink for tests.
//! - [`valkey`]: connections to Valkey as one server, a cluster, or a primary found through
//!   Sentinel.
//! - [`replication`]: slot/publication setup and checks, the stream loop, the in-flight writes
//!   and the acknowledgement bookkeeping.
//! - [`poller`]: the FOR UPDATE SKIP LOCKED recovery/backfill loop, and poll mode.
//! - [`marker`]: marks rows the stream delivered as published, coalesced, off the hot path.
//! - [`producer`]: the application side: an outbox row inserted in the caller's transaction.
//! - [`store`]: the SQL on the outbox table (claim, mark, dead letters, cleanup).
//! - [`admin`]: operator commands (dead letters, cleanup).
//! - [`command`]: what a subcommand fails with; how operator commands print.
//! - [`daemon`]: `run` as a process: signals, the HTTP endpoint, the relay until shutdown.
//! - [`postgres`]: connections (SQL and replication parameters) from one URL.
//! - [`migrate`]: the embedded goose migrations.
//! - [`relay`]: `run` wiring: checks, then the stream until shutdown.
//! - [`supervise`]: the stream beside the background tasks; one that panics stops the relay.
//! - [`inspect`]: `peek`, the pending tasks of a queue decoded (an operator tool).
//! - [`metrics`]: metric names, registered once; [`health`]: what `/readyz` answers from;
//!   [`http`]: `/metrics`, `/healthz`, `/readyz`; [`monitor`]: periodic gauges, reachability,
//!   heartbeat and stall detection; [`status`]: the `status` command.
//! - [`backoff`]: the one capped-exponential retry delay.
//! - [`trace`], [`replay`], [`reconcile`]: operator commands joining the row, the slot and the
//!   asynq task ("where is event X", replay from the table, heal what Valkey lost); they share
//!   [`operator`] (connections, errors), [`event_filter`] (which rows), [`task_args`] (the task
//!   settings of `run`) and [`asynq_state`] (asynq's task states, read as its Inspector reads
//!   them); [`valkey_durability`]: what a Valkey restart would lose.
//! - [`tls`]: PostgreSQL `sslmode` (SQL and replication connections), PEM files, the rustls
//!   crypto provider.

// Only with `--features mimalloc`, to compare allocators (docs/benchmarks.md, "Allocator").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod admin;
pub mod asynq_state;
pub mod backoff;
pub mod command;
pub mod config;
pub mod daemon;
pub mod error_chain;
pub mod event_filter;
pub mod health;
pub mod http;
pub mod inspect;
pub mod marker;
pub mod metrics;
pub mod migrate;
pub mod monitor;
pub mod operator;
pub mod pgoutput;
pub mod poller;
pub mod postgres;
pub mod producer;
pub mod reconcile;
pub mod relay;
pub mod replay;
pub mod replication;
pub mod shared_event_ids;
pub mod sink;
pub mod status;
pub mod store;
pub mod supervise;
pub mod task;
pub mod task_args;
pub mod timer;
pub mod tls;
pub mod trace;
pub mod valkey;
pub mod valkey_durability;
pub use error_chain::error_chain;
