//! Logical replication: setup and checks ([`setup`]); the stream's supervisor ([`stream`]) and
//! its sessions ([`session`]); the writes a session has in flight ([`writer`]); which LSN may be
//! acknowledged ([`ack`]); the invariants checked in release builds ([`invariant`]); the I/O
//! edges as traits ([`source`]) and their Postgres implementation ([`pg_slot`]); when a standby
//! takes the slot over ([`takeover`]); when the link counts as dead ([`liveness`]); a
//! publication dropped behind the slot ([`publication`]); a slot on a standby ([`standby`]) and
//! what changed under the slot between sessions ([`slot_watch`]).

pub mod ack;
pub mod invariant;
pub mod liveness;
pub mod pg_slot;
pub mod publication;
pub mod session;
pub mod setup;
pub mod slot_watch;
pub mod source;
pub mod standby;
pub mod stream;
pub mod takeover;
pub mod writer;

/// The prefix of the monitor's heartbeat messages (`pg_logical_emit_message`), which the
/// session recognises when they come back through the stream.
pub const HEARTBEAT_PREFIX: &str = "outbox-relay";
