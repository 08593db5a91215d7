//! L1: the in-process tier (quick_cache), bounded by bytes, each entry kept until the end of
//! its own grace period.
//!
//! The cache's capacity is a weight, not a memory bound: the weigher approximates the bytes
//! an entry holds (body, headers, key, bookkeeping). The RSS bound is measured in a
//! benchmark. quick_cache rather than moka: its bookkeeping is a slab slot and a hash-table
//! index per entry (about 60 bytes) where moka's order queues, timer wheel and frequency
//! sketch cost about 400, a fifth of a small entry; and a lookup is a shard's read lock, with
//! no maintenance work deferred onto later calls. Its eviction (Clock-PRO, close to S3-FIFO)
//! keeps what is asked for again and resists scans, as moka's TinyLFU does.
//!
//! quick_cache has no time to live: an entry past its end (`Entry::remaining_life_ms`) is
//! a miss when looked up, and removed then; one never looked up again is removed by the
//! periodic sweep ([`L1::sweep`]) or evicted by newer entries first, being cold.
//!
//! Invalidation works on base keys and tags, but L1 is keyed by the full hash, so L1 keeps a
//! small index of what it holds beyond plain base keys: base → variants present, tag →
//! entries carrying it. The cache has no lookup by anything but the key, and evictions are
//! not reported, so the index is a superset: invalidating a hash that is gone is a no-op, and
//! the sweep drops hashes that left the cache.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use quick_cache::Weighter;
use quick_cache::sync::Cache;

use super::marks::{LocalMarks, Standing};
use super::{CacheKey, Entry, key};
use crate::clock::now_ms;

/// An L1 copy: the entry, and the local marks' sequence number from which it is known
/// valid. An invalidation marked later (here or by another instance's event, which marks
/// at once) makes it a miss at once, before it is removed.
#[derive(Clone)]
struct Held {
    entry: Arc<Entry>,
    since: u64,
}

/// An L1 copy as a lookup gets it.
#[derive(Debug)]
pub(crate) struct L1Copy {
    pub(crate) entry: Arc<Entry>,
    /// False when an invalidation of it may have been missed: while Redis answers, it is
    /// checked there before it is served.
    pub(crate) verified: bool,
}

/// An entry's weight: [`Entry::weight`].
#[derive(Clone, Copy, Debug)]
struct ByBytes;

impl Weighter<u128, Held> for ByBytes {
    fn weight(&self, _: &u128, held: &Held) -> u64 {
        // Never zero (a zero-weight item would never be evicted).
        u64::try_from(held.entry.weight())
            .unwrap_or(u64::MAX)
            .max(1)
    }
}

/// How many shards (each its own lock and its own share of the capacity) the cache is cut
/// into: four per CPU, fewer when a shard would not hold [`SHARD_HOLDS`] of the largest
/// entry (an entry heavier than its shard's share is not kept at all).
fn shards(max_bytes: u64, max_entry_bytes: usize) -> usize {
    let per_cpu = std::thread::available_parallelism().map_or(4, std::num::NonZero::get);
    let largest = u64::try_from(max_entry_bytes)
        .unwrap_or(u64::MAX)
        .saturating_mul(SHARD_HOLDS)
        .max(1);
    let fit = (max_bytes / largest).max(1);
    let mut shards = (per_cpu * 4).next_power_of_two();
    while shards > 1 && u64::try_from(shards).unwrap_or(u64::MAX) > fit {
        shards /= 2;
    }
    shards
}

/// How many of the largest entry each shard has room for at least.
const SHARD_HOLDS: u64 = 4;

/// The entry size the cache's tables are first sized for (they grow as needed).
const TYPICAL_ENTRY: u64 = 2048;

/// Base → variant hashes, tag → entry hashes, for the entries L1 holds (a superset).
#[derive(Debug, Default)]
struct Index {
    variants: HashMap<u128, HashSet<u128>>,
    tags: HashMap<String, HashSet<u128>>,
}

/// The in-process cache. Cloning shares the same cache.
#[derive(Clone)]
pub(crate) struct L1 {
    cache: Arc<Cache<u128, Held, ByBytes>>,
    index: Arc<Mutex<Index>>,
    marks: Arc<LocalMarks>,
}

impl std::fmt::Debug for L1 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L1")
            .field("entries", &self.cache.len())
            .field("bytes", &self.cache.weight())
            .finish()
    }
}

impl L1 {
    /// An L1 of `max_bytes` (in [`Entry::weight`]s), whose entries are at most
    /// `max_entry_bytes` long.
    pub(crate) fn new(max_bytes: u64, max_entry_bytes: usize, marks: Arc<LocalMarks>) -> Self {
        let options = quick_cache::OptionsBuilder::new()
            .estimated_items_capacity(
                usize::try_from(max_bytes / TYPICAL_ENTRY)
                    .unwrap_or(usize::MAX)
                    .max(1),
            )
            .weight_capacity(max_bytes)
            .shards(shards(max_bytes, max_entry_bytes))
            .build();
        let cache = match options {
            Ok(options) => Cache::with_options(
                options,
                ByBytes,
                quick_cache::DefaultHashBuilder::default(),
                quick_cache::sync::DefaultLifecycle::default(),
            ),
            // Only a zero shard count is refused, and `shards` never gives one.
            Err(_) => Cache::with_weighter(1, max_bytes, ByBytes),
        };
        L1 {
            cache: Arc::new(cache),
            index: Arc::default(),
            marks,
        }
    }

    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The copy of `key`, if present and really for this key (the full key is compared).
    /// Not returned: a copy an invalidation marked since it was stored. A copy from before
    /// a possible missed invalidation (see `marks.rs`) comes back unverified.
    pub(crate) fn get(&self, key: &CacheKey) -> Option<L1Copy> {
        let held = self.cache.get(&key.hash)?;
        if !held.entry.matches(key) {
            return None;
        }
        if held.entry.remaining_life_ms(now_ms()) == 0 {
            // Past its end: gone (unless a newer copy took its place meanwhile).
            self.cache
                .remove_if(&key.hash, |now| Arc::ptr_eq(&now.entry, &held.entry));
            return None;
        }
        let verified = match self.marks.standing(key.base, &held.entry.tags, held.since) {
            Standing::Valid => true,
            Standing::Unverified => false,
            Standing::Invalidated => {
                self.cache.remove(&key.hash);
                return None;
            }
        };
        Some(L1Copy {
            entry: held.entry,
            verified,
        })
    }

    /// Stores `entry`, known valid from the local marks' `since` (taken before it was
    /// fetched or read).
    pub(crate) fn insert(&self, key: &CacheKey, entry: Arc<Entry>, since: u64) {
        if key.is_variant() || !entry.tags.is_empty() {
            let mut index = self.index();
            if key.is_variant() {
                index.variants.entry(key.base).or_default().insert(key.hash);
            }
            for tag in &entry.tags {
                index.tags.entry(tag.clone()).or_default().insert(key.hash);
            }
        }
        self.cache.insert(key.hash, Held { entry, since });
    }

    /// Drops the copy of `hash`, if any.
    pub(crate) fn invalidate(&self, hash: u128) {
        self.cache.remove(&hash);
    }

    /// Drops the base key `base` and every variant of it; returns the hashes dropped (or
    /// possibly held: the index is a superset).
    pub(crate) fn invalidate_base(&self, base: u128) -> Vec<u128> {
        let mut hashes = vec![base];
        if let Some(variants) = self.index().variants.remove(&base) {
            hashes.extend(variants);
        }
        for hash in &hashes {
            self.cache.remove(hash);
        }
        hashes
    }

    /// Drops every entry tagged `tag`; returns the hashes dropped (a superset).
    pub(crate) fn invalidate_tag(&self, tag: &str) -> Vec<u128> {
        let hashes: Vec<u128> = self
            .index()
            .tags
            .remove(tag)
            .map(|set| set.into_iter().collect())
            .unwrap_or_default();
        for hash in &hashes {
            self.cache.remove(hash);
        }
        hashes
    }

    /// The full keys of entries whose path matches `matches` (pattern purges: L1 is the
    /// whole cache in embedded mode). Walks the cache.
    pub(crate) fn matching_keys(&self, matches: impl Fn(&str) -> bool) -> Vec<String> {
        self.cache
            .iter()
            .filter(|(_, held)| {
                key::route_and_path(held.entry.key()).is_some_and(|(_, path)| matches(path))
            })
            .map(|(_, held)| held.entry.key().to_owned())
            .collect()
    }

    /// Drops the entries past their end, then the index members no longer in the cache.
    pub(crate) fn sweep(&self) {
        let now = now_ms();
        self.cache
            .retain(|_, held| held.entry.remaining_life_ms(now) > 0);
        let mut guard = self.index();
        let Index { variants, tags } = &mut *guard;
        let cache = &self.cache;
        for set in variants.values_mut().chain(tags.values_mut()) {
            set.retain(|hash| cache.contains_key(hash));
        }
        variants.retain(|_, set| !set.is_empty());
        tags.retain(|_, set| !set.is_empty());
    }

    /// (entries, weighted bytes), entries past their end that were not looked up or swept
    /// since included.
    pub(crate) fn usage(&self) -> (u64, u64) {
        (
            u64::try_from(self.cache.len()).unwrap_or(u64::MAX),
            self.cache.weight(),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};
    use prometheus::IntCounter;

    use super::*;

    fn l1(max_bytes: u64, max_entry_bytes: usize) -> L1 {
        let overflow = IntCounter::new("overflow", "overflow").expect("a counter");
        let marks = Arc::new(LocalMarks::new(Duration::from_secs(60), overflow));
        L1::new(max_bytes, max_entry_bytes, marks)
    }

    /// An entry of `key` stored now, fresh for `ttl` and kept no longer.
    fn entry(key: &CacheKey, body: usize, ttl: Duration) -> Arc<Entry> {
        let mut entry = Entry::new(
            &key.full,
            StatusCode::OK,
            &HeaderMap::new(),
            Bytes::from(vec![b'x'; body]),
        );
        entry.stored_at_ms = now_ms();
        entry.ttl_ms = u64::try_from(ttl.as_millis()).expect("a short ttl");
        Arc::new(entry)
    }

    #[tokio::test(start_paused = true)]
    async fn an_entry_is_a_hit_until_its_end_then_a_miss_and_gone() {
        let l1 = l1(1 << 20, 1 << 16);
        let key = CacheKey::new("item\n/items/1\n".to_owned());
        l1.insert(&key, entry(&key, 100, Duration::from_secs(10)), 0);
        tokio::time::advance(Duration::from_millis(9_990)).await;
        assert!(l1.get(&key).is_some(), "a hit before its end");
        assert_eq!(l1.usage().0, 1);
        tokio::time::advance(Duration::from_millis(20)).await;
        assert!(l1.get(&key).is_none(), "a miss past its end");
        assert_eq!(
            l1.usage(),
            (0, 0),
            "removed by the lookup that found it ended"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_sweep_removes_ended_entries_nobody_looks_up() {
        let l1 = l1(1 << 20, 1 << 16);
        let short = CacheKey::new("item\n/items/1\n".to_owned());
        let long = CacheKey::new("item\n/items/2\n".to_owned());
        l1.insert(&short, entry(&short, 100, Duration::from_secs(1)), 0);
        l1.insert(&long, entry(&long, 100, Duration::from_secs(60)), 0);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(l1.usage().0, 2, "not looked up: still held");
        l1.sweep();
        assert_eq!(l1.usage().0, 1, "the ended one swept");
        assert!(l1.get(&long).is_some(), "the live one kept");
    }

    #[tokio::test(start_paused = true)]
    async fn the_largest_entry_fits_a_small_cache() {
        // 4 MiB cut into shards of a quarter MiB each would refuse a 1 MiB entry.
        let l1 = l1(4 << 20, 1 << 20);
        let key = CacheKey::new("item\n/items/big\n".to_owned());
        l1.insert(&key, entry(&key, 1 << 20, Duration::from_secs(60)), 0);
        assert!(l1.get(&key).is_some(), "a 1 MiB entry kept in a 4 MiB L1");
    }

    #[tokio::test(start_paused = true)]
    async fn the_weight_stays_within_the_capacity() {
        let l1 = l1(1 << 20, 1 << 16);
        for i in 0..2_000 {
            let key = CacheKey::new(format!("item\n/items/{i}\n"));
            l1.insert(&key, entry(&key, 1024, Duration::from_secs(60)), 0);
        }
        let (entries, bytes) = l1.usage();
        assert!(bytes <= 1 << 20, "{bytes} bytes held in a 1 MiB L1");
        assert!(entries > 100, "only {entries} entries held");
    }
}
