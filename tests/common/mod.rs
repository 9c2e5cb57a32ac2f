//! Test harness: real Postgres and Redis started by the project's own scripts, a database per
//! test, the relay in-process or as the real binary, and the asynq view of Valkey.
//!
//! One module per concern, re-exported here; each test file takes what it needs through
//! `use common::*`. Each test binary uses part of the harness, hence the allows.
#![allow(dead_code, unused_imports)]

pub mod asynq;
pub mod asynq_states;
pub mod asynq_worker;
pub mod certs;
pub mod checker;
pub mod databases;
pub mod filtered_replay;
pub mod http;
pub mod launcher;
pub mod logs;
pub mod mem_outbox;
pub mod observed;
pub mod pg_standby;
pub mod pg_upgrade;
pub mod proxy;
pub mod runbook_blocks;
pub mod servers;
pub mod topologies;
pub mod waits;

pub use asynq::*;
pub use databases::*;
pub use http::*;
pub use launcher::*;
pub use logs::*;
pub use servers::*;
pub use waits::*;
