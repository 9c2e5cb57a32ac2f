//! The assumptions the acknowledgement rule rests on, checked in release builds.
//!
//! A broken one is a bug in the relay (or a server that broke the protocol): the session stops
//! at once, without acknowledging or marking anything more, and the supervisor reconnects, so
//! Postgres replays from the last position that was safe. Never continue on a mismatch.

/// A delivery invariant that did not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("delivery invariant broken: {0}")]
pub struct InvariantViolation(pub String);

/// Returns a violation with `msg` unless `cond` holds.
pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), InvariantViolation> {
    if cond {
        Ok(())
    } else {
        Err(InvariantViolation(msg()))
    }
}
