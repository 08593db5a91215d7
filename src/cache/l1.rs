//! L1: the in-process tier (moka), bounded by bytes, each entry expiring at the end of its
//! own grace period.
//!
//! moka's capacity is a weight, not a memory bound: the weigher approximates the bytes an
//! entry holds (body, headers, key, bookkeeping). The RSS bound is measured in a benchmark.
//!
//! Invalidation works on base keys and tags, but L1 is keyed by the full hash, so L1 keeps a
//! small index of what it holds beyond plain base keys: base → variants present, tag →
//! entries carrying it. moka has no lookup by anything but the key, and an eviction listener
//! cannot tell a removal from a removal-then-reinsert of the same key, so the index is a
//! superset: invalidating a hash that is gone is a no-op, and a sweep drops hashes that
//! left the cache.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::future::Cache;

use super::marks::{LocalMarks, Standing};
use super::{CacheKey, Entry, key};
use crate::clock::now_ms;

/// An L1 copy: the entry, and the local marks' sequence number from which it is known
/// valid. An invalidation marked later (here or by another instance's event, which marks
/// at once) makes it a miss at once, before its removal from moka has run.
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

/// Per-entry expiry: an L1 copy lives as long as its entry is fresh or within grace.
struct EntryLife;

impl Expiry<u128, Held> for EntryLife {
    fn expire_after_create(&self, _: &u128, held: &Held, _: Instant) -> Option<Duration> {
        Some(Duration::from_millis(
            held.entry.remaining_life_ms(now_ms()),
        ))
    }

    fn expire_after_update(
        &self,
        _: &u128,
        held: &Held,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(Duration::from_millis(
            held.entry.remaining_life_ms(now_ms()),
        ))
    }
}

/// Base → variant hashes, tag → entry hashes, for the entries L1 holds (a superset).
#[derive(Debug, Default)]
struct Index {
    variants: HashMap<u128, HashSet<u128>>,
    tags: HashMap<String, HashSet<u128>>,
}

/// The in-process cache. Cloning shares the same cache.
#[derive(Clone)]
pub(crate) struct L1 {
    cache: Cache<u128, Held>,
    index: Arc<Mutex<Index>>,
    marks: Arc<LocalMarks>,
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
    pub(crate) fn new(max_bytes: u64, marks: Arc<LocalMarks>) -> Self {
        let cache = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &u128, h: &Held| u32::try_from(h.entry.weight()).unwrap_or(u32::MAX))
            .expire_after(EntryLife)
            .build();
        L1 {
            cache,
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
    pub(crate) async fn get(&self, key: &CacheKey) -> Option<L1Copy> {
        let held = self.cache.get(&key.hash).await?;
        if !held.entry.matches(key) {
            return None;
        }
        let verified = match self.marks.standing(key.base, &held.entry.tags, held.since) {
            Standing::Valid => true,
            Standing::Unverified => false,
            Standing::Invalidated => {
                self.cache.invalidate(&key.hash).await;
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
    pub(crate) async fn insert(&self, key: &CacheKey, entry: Arc<Entry>, since: u64) {
        if key.is_variant() || !entry.tags.is_empty() {
            let mut index = self.index();
            if key.is_variant() {
                index.variants.entry(key.base).or_default().insert(key.hash);
            }
            for tag in &entry.tags {
                index.tags.entry(tag.clone()).or_default().insert(key.hash);
            }
        }
        self.cache.insert(key.hash, Held { entry, since }).await;
    }

    /// Drops the copy of `hash`, if any.
    pub(crate) async fn invalidate(&self, hash: u128) {
        self.cache.invalidate(&hash).await;
    }

    /// Drops the base key `base` and every variant of it; returns the hashes dropped (or
    /// possibly held: the index is a superset).
    pub(crate) async fn invalidate_base(&self, base: u128) -> Vec<u128> {
        let mut hashes = vec![base];
        if let Some(variants) = self.index().variants.remove(&base) {
            hashes.extend(variants);
        }
        for hash in &hashes {
            self.cache.invalidate(hash).await;
        }
        hashes
    }

    /// Drops every entry tagged `tag`; returns the hashes dropped (a superset).
    pub(crate) async fn invalidate_tag(&self, tag: &str) -> Vec<u128> {
        let hashes: Vec<u128> = self
            .index()
            .tags
            .remove(tag)
            .map(|set| set.into_iter().collect())
            .unwrap_or_default();
        for hash in &hashes {
            self.cache.invalidate(hash).await;
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

    /// Drops index members that are no longer in the cache.
    pub(crate) fn sweep_index(&self) {
        let mut guard = self.index();
        let Index { variants, tags } = &mut *guard;
        let cache = &self.cache;
        for set in variants.values_mut().chain(tags.values_mut()) {
            set.retain(|hash| cache.contains_key(hash));
        }
        variants.retain(|_, set| !set.is_empty());
        tags.retain(|_, set| !set.is_empty());
    }

    /// (entries, weighted bytes), after applying pending evictions.
    pub(crate) async fn usage(&self) -> (u64, u64) {
        self.cache.run_pending_tasks().await;
        (self.cache.entry_count(), self.cache.weighted_size())
    }
}
