//! The cache itself: keys, the stored entry format, TTL jitter, and the two tiers.
//!
//! - [`key`]: derives the cache key and the forwarded URL from one parse of the request.
//! - [`control`]: what an origin answer's `Cache-Control`, `Vary` and `Age` allow.
//! - [`entry`]: the versioned binary entry format; a corrupt or foreign value is a miss.
//! - [`ttl`]: jitter as a pure function.
//! - [`l1`]: the in-process cache (quick_cache), bounded by bytes.
//! - [`l2`]: entries in Redis, through `coord`.
//! - [`marks`]: local invalidation marks, the generation check of L1 copies.
//! - [`version`]: row versions the origin tells, and the floors writes set with them.
//! - [`tiers`]: L1 over L2 behind one gate: every lookup and every copy into L1 of the
//!   read path goes through it.

pub(crate) mod control;
pub(crate) mod entry;
pub(crate) mod key;
pub(crate) mod l1;
pub(crate) mod l2;
pub(crate) mod marks;
pub(crate) mod tiers;
pub(crate) mod ttl;
pub(crate) mod version;

pub(crate) use entry::{Entry, Freshness};
pub(crate) use key::CacheKey;
