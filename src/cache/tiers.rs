//! The two cache tiers behind one gate: L1 (this process, moka) over L2 (Redis).
//!
//! Every read of the read path goes through [`Tiers::lookup`] or [`Tiers::fresh_in_l2`],
//! and every copy into L1 through [`Tiers::keep`], so the rules live here once:
//!
//! ```text
//! lookup ─▶ L1 (unless the route says off, or a hot key's copy is due a check)
//!             fresh ─▶ Fresh(HIT-L1)
//!        ─▶ L2 (unless an invalidation of the key is owed to Redis)
//!             fresh ─▶ copy into L1 when the route keeps it there ─▶ Fresh(HIT-L2)
//!        ─▶ the newest stale copy within grace ─▶ Stale, else Miss (with the newest copy
//!           still kept: to revalidate, and to answer if the origin fails while it is
//!           within its error grace)
//! keep   ─▶ into L1 only if no invalidation of the key or its tags was marked since the
//!           copy was read or its fetch began (checked again after the insert)
//! ```
//!
//! What the tiers cannot know themselves comes through two small traits implemented by
//! the layers above: whether a key is hot ([`HotSet`]: hot keys are kept in L1 whatever
//! the route's policy) and whether an invalidation is owed to Redis ([`OwedSet`]).

use std::sync::Arc;

use http::HeaderMap;

use super::l1::L1;
use super::l2::{self, L2};
use super::marks::LocalMarks;
use super::{CacheKey, Entry, Freshness};
use crate::clock::now_ms;
use crate::config::L1Policy;
use crate::metrics::{FillRefusal, Metrics, Outcome};

/// The hot-key set, as the tiers see it.
pub(crate) trait HotSet: Send + Sync + std::fmt::Debug {
    /// Whether `hash` is hot here (promoted locally or by a peer).
    fn is_hot(&self, hash: u128) -> bool;
    /// A fresh copy of `key` entered L1: a hot key's L1 grace starts again.
    fn kept(&self, key: &CacheKey);
}

/// Invalidations this instance owes to Redis (journaled while Redis was unreachable).
pub(crate) trait OwedSet: Send + Sync + std::fmt::Debug {
    /// Whether Redis may still hold a copy of `base` that an owed invalidation concerns:
    /// then L2 must not be read for it.
    fn owes(&self, base: u128) -> bool;
}

/// What a lookup found.
#[derive(Debug)]
pub(crate) enum Cached {
    /// A fresh copy, from the tier the outcome names (`HitL1` or `HitL2`).
    Fresh(Arc<Entry>, Outcome),
    /// Only a stale copy (within grace): answered at once, refreshed in the background.
    Stale(Arc<Entry>),
    /// Nothing to answer with; maybe a copy past its grace that is still kept: its
    /// validators make the fetch a revalidation, and within its error grace it answers if
    /// the origin fails (stale-if-error).
    Miss(Option<Arc<Entry>>),
}

/// The gate over L1 and L2.
#[derive(Debug)]
pub(crate) struct Tiers {
    l1: L1,
    /// `None` in embedded mode.
    l2: Option<L2>,
    marks: Arc<LocalMarks>,
    hot: Arc<dyn HotSet>,
    owed: Arc<dyn OwedSet>,
    metrics: Metrics,
}

impl Tiers {
    pub(crate) fn new(
        l1: L1,
        l2: Option<L2>,
        marks: Arc<LocalMarks>,
        hot: Arc<dyn HotSet>,
        owed: Arc<dyn OwedSet>,
        metrics: Metrics,
    ) -> Self {
        Tiers {
            l1,
            l2,
            marks,
            hot,
            owed,
            metrics,
        }
    }

    /// Whether Redis is configured and answering (its breaker is closed).
    pub(crate) fn redis_up(&self) -> bool {
        self.l2.as_ref().is_some_and(|l2| l2.redis().is_up())
    }

    /// Whether Redis is configured at all (shared mode).
    pub(crate) fn shared(&self) -> bool {
        self.l2.is_some()
    }

    /// The local marks' position now: take it before reading or fetching an entry, and
    /// hand it to [`Tiers::keep`].
    pub(crate) fn since(&self) -> u64 {
        self.marks.snapshot()
    }

    /// Whether a route with policy `l1` keeps everything in L1. In embedded mode, and
    /// while Redis is down in shared mode, L1 is the only tier and holds everything unless
    /// the route says `off` (degraded = embedded behaviour). With Redis up, `hot` keeps L1
    /// for hot keys only.
    pub(crate) fn uses_l1(&self, l1: L1Policy) -> bool {
        match l1 {
            L1Policy::Off => false,
            L1Policy::All => true,
            L1Policy::Hot => !self.redis_up(),
        }
    }

    /// Whether an entry for `hash` goes into L1: per the route's policy, and for every hot
    /// key unless the route says `off`.
    pub(crate) fn keeps_in_l1(&self, l1: L1Policy, hash: u128) -> bool {
        self.uses_l1(l1) || (l1 != L1Policy::Off && self.hot.is_hot(hash))
    }

    /// The L1 copy of `key`, whatever its freshness (the hot-key gate decides on it).
    pub(crate) async fn l1_copy(&self, key: &CacheKey) -> Option<Arc<Entry>> {
        self.l1.get(key).await
    }

    /// L1, then L2: a fresh copy wins; otherwise the newest stale copy within grace;
    /// otherwise a miss, with the newest copy still kept. A copy whose `Vary` selection
    /// does not match `request` (the headers of the request it would answer) counts as
    /// absent. `skip_l1` goes past L1 (a hot key whose L1 copy is due a check against
    /// Redis).
    pub(crate) async fn lookup(
        &self,
        key: &CacheKey,
        l1: L1Policy,
        skip_l1: bool,
        request: &HeaderMap,
    ) -> Cached {
        let now = now_ms();
        let mut stale = None;
        let mut kept = None;
        // The newer of two copies.
        let newer = |held: &mut Option<Arc<Entry>>, entry: Arc<Entry>| {
            if held
                .as_ref()
                .is_none_or(|h| h.stored_at_ms < entry.stored_at_ms)
            {
                *held = Some(entry);
            }
        };
        if l1 != L1Policy::Off
            && !skip_l1
            && let Some(entry) = self.l1.get(key).await
            && entry.selects(request)
        {
            match entry.freshness(now) {
                Freshness::Fresh => return Cached::Fresh(entry, Outcome::HitL1),
                Freshness::Stale => stale = Some(entry),
                Freshness::IfError | Freshness::Kept => kept = Some(entry),
                Freshness::Expired => {}
            }
        }
        let since = self.since();
        if let Some(entry) = self.l2_copy(key).await
            && entry.selects(request)
        {
            match entry.freshness(now) {
                Freshness::Fresh => {
                    if self.keeps_in_l1(l1, key.hash) {
                        self.keep(key, Arc::clone(&entry), since).await;
                    }
                    return Cached::Fresh(entry, Outcome::HitL2);
                }
                Freshness::Stale => newer(&mut stale, entry),
                Freshness::IfError | Freshness::Kept => newer(&mut kept, entry),
                Freshness::Expired => {}
            }
        }
        match stale {
            Some(entry) => Cached::Stale(entry),
            None => Cached::Miss(kept),
        }
    }

    /// A fresh L2 copy of `key` for a request with `request` headers (a waiter on another
    /// instance's fill looks for its answer), copied into L1 when the route keeps it there.
    pub(crate) async fn fresh_in_l2(
        &self,
        key: &CacheKey,
        l1: L1Policy,
        request: &HeaderMap,
    ) -> Option<Arc<Entry>> {
        let since = self.since();
        let entry = self.l2_copy(key).await?;
        if entry.freshness(now_ms()) != Freshness::Fresh || !entry.selects(request) {
            return None;
        }
        if self.keeps_in_l1(l1, key.hash) {
            self.keep(key, Arc::clone(&entry), since).await;
        }
        Some(entry)
    }

    /// L2's copy of `key`, unless an invalidation of it is owed to Redis.
    async fn l2_copy(&self, key: &CacheKey) -> Option<Arc<Entry>> {
        let l2 = self.l2.as_ref()?;
        if self.owed.owes(key.base) {
            return None;
        }
        match l2.get(key).await {
            l2::Lookup::Hit(entry) => Some(entry),
            l2::Lookup::Miss | l2::Lookup::Unavailable => None,
        }
    }

    /// Puts an entry read or fetched since the marks' position `since` into L1, unless an
    /// invalidation of its key or tags was marked here since (it may predate it). The check
    /// runs again after the insert: an invalidation landing in between removes it. Returns
    /// whether the copy was kept.
    pub(crate) async fn keep(&self, key: &CacheKey, entry: Arc<Entry>, since: u64) -> bool {
        if !self.marks.allows(key.base, &entry.tags, since) {
            self.metrics.fill_refused(FillRefusal::Generation);
            return false;
        }
        self.l1.insert(key, Arc::clone(&entry), since).await;
        if !self.marks.allows(key.base, &entry.tags, since) {
            self.l1.invalidate(key.hash).await;
            self.metrics.fill_refused(FillRefusal::Generation);
            return false;
        }
        self.hot.kept(key);
        true
    }
}
