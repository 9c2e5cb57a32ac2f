//! How long a write to Valkey may take: the Valkey timeout, plus the time its bytes (and the
//! bytes sent before it on the same connection, which go first) take on the slowest link the
//! relay allows for.
//!
//! Found by review: every write had the Valkey timeout alone (5 s by default), counted by the
//! client from the moment the write was queued. On a link slower than about 1.7 MB/s a batch of
//! 8 MiB (large rows) could never be sent in time, the same batches were re-sent and timed out
//! again for ever, nothing was acknowledged and the slot pinned WAL. A write's deadline now
//! grows with its bytes; on links slower than [`SLOWEST_LINK_BYTES_PER_SEC`] large writes still
//! time out.

use std::time::Duration;

/// The slowest link whose large writes still finish within their deadline: 1 MiB/s (about 8.4
/// Mbit/s).
pub const SLOWEST_LINK_BYTES_PER_SEC: u64 = 1 << 20;

/// The deadline of a write of `bytes` (with those queued before it on its connection): `base`
/// plus their time at [`SLOWEST_LINK_BYTES_PER_SEC`].
pub fn write_deadline(base: Duration, bytes: u64) -> Duration {
    base.saturating_add(Duration::from_secs_f64(
        bytes as f64 / SLOWEST_LINK_BYTES_PER_SEC as f64,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_grows_by_a_second_per_mebibyte() {
        let base = Duration::from_secs(5);
        assert_eq!(write_deadline(base, 0), base);
        assert_eq!(write_deadline(base, 8 << 20), Duration::from_secs(13));
        assert_eq!(write_deadline(base, 512 << 10), Duration::from_millis(5500));
    }
}
