//! L1: the in-process tier (moka), bounded by bytes, each entry expiring at the end of its
//! own grace period.
//!
//! moka's capacity is a weight, not a memory bound: the weigher approximates the bytes an
//! entry holds (body, headers, key, bookkeeping). The RSS bound is measured in a benchmark.

use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::future::Cache;

use super::{CacheKey, Entry, now_ms};

/// Per-entry expiry: an L1 copy lives as long as its entry is fresh or within grace.
struct EntryLife;

impl Expiry<u128, Arc<Entry>> for EntryLife {
    fn expire_after_create(&self, _: &u128, entry: &Arc<Entry>, _: Instant) -> Option<Duration> {
        Some(Duration::from_millis(entry.remaining_life_ms(now_ms())))
    }

    fn expire_after_update(
        &self,
        _: &u128,
        entry: &Arc<Entry>,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(Duration::from_millis(entry.remaining_life_ms(now_ms())))
    }
}

/// The in-process cache. Cloning shares the same cache.
#[derive(Clone)]
pub(crate) struct L1 {
    cache: Cache<u128, Arc<Entry>>,
}

impl std::fmt::Debug for L1 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L1")
            .field("entries", &self.cache.entry_count())
            .field("bytes", &self.cache.weighted_size())
            .finish()
    }
}

impl L1 {
    pub(crate) fn new(max_bytes: u64) -> Self {
        let cache = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &u128, e: &Arc<Entry>| u32::try_from(e.weight()).unwrap_or(u32::MAX))
            .expire_after(EntryLife)
            .build();
        L1 { cache }
    }

    /// The entry for `key`, if present and really for this key (the full key is compared).
    pub(crate) async fn get(&self, key: &CacheKey) -> Option<Arc<Entry>> {
        let entry = self.cache.get(&key.hash).await?;
        entry.matches(key).then_some(entry)
    }

    pub(crate) async fn insert(&self, key: &CacheKey, entry: Arc<Entry>) {
        self.cache.insert(key.hash, entry).await;
    }

    /// Drops the copy of `hash`, if any.
    pub(crate) async fn invalidate(&self, hash: u128) {
        self.cache.invalidate(&hash).await;
    }

    /// (entries, weighted bytes), after applying pending evictions.
    pub(crate) async fn usage(&self) -> (u64, u64) {
        self.cache.run_pending_tasks().await;
        (self.cache.entry_count(), self.cache.weighted_size())
    }
}
