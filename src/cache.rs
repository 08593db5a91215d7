//! The cache itself: keys, the stored entry format, TTL jitter, and the two tiers.
//!
//! - [`key`]: derives the cache key and the forwarded URL from one parse of the request.
//! - [`entry`]: the versioned binary entry format; a corrupt or foreign value is a miss.
//! - [`ttl`]: jitter as a pure function.
//! - [`l1`]: the in-process moka cache, bounded by bytes.
//! - [`l2`]: entries in Redis, through `coord`.

pub(crate) mod entry;
pub(crate) mod key;
pub(crate) mod l1;
pub(crate) mod l2;
pub(crate) mod ttl;

pub(crate) use entry::{Entry, Freshness};
pub(crate) use key::CacheKey;

/// Milliseconds since the Unix epoch: entries are shared between instances, so their
/// timestamps are wall-clock, not `Instant`s.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
