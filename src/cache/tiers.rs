//! The two cache tiers behind one gate: L1 (this process, quick_cache) over L2 (Redis).
//!
//! Every read of the read path goes through [`Tiers::lookup`] or [`Tiers::fresh_in_l2`],
//! and every copy into L1 through [`Tiers::keep`], so the rules live here once:
//!
//! ```text
//! lookup ─▶ L1 (unless the route says off, a hot key's copy is due a check, or the copy
//!             may have missed an invalidation and Redis answers — on a route that
//!             needs the bus, every copy while the event bus is not confirmed)
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
//! The tiers also remember which request headers an origin varies a URL's answers on, and
//! which variant the URL's own key holds ([`Tiers::vary_spec`]): every copy they see of a
//! URL's own key whose `Vary` selected it teaches both (see [`Tiers::learn_vary`]), so the
//! read path looks up the request's own Vary variant (`key::selected`), or the URL's key
//! when it holds that variant: one L2 read.
//!
//! What the tiers cannot know themselves comes through two small traits implemented by
//! the layers above: whether a key is hot ([`HotSet`]: hot keys are kept in L1 whatever
//! the route's policy) and whether an invalidation is owed to Redis ([`OwedSet`]).

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName};

use super::key;
use super::l1::{L1, L1Copy};
use super::l2::{self, L2};
use super::marks::{LocalMarks, Standing};
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
    /// URL key hash → what its copies taught of the origin's `Vary` (see
    /// [`Tiers::vary_spec`]).
    vary: moka::sync::Cache<u128, VarySpec>,
}

/// What a copy of a URL's own key taught of its origin's `Vary`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct VarySpec {
    /// The request headers its answers vary on (and the route does not key).
    pub(crate) names: Arc<[HeaderName]>,
    /// The hash of the Vary variant whose answer the URL's own key holds: the first fetched
    /// before the names were known there (`key::selected_by` of its selection).
    pub(crate) held: u128,
}

/// URLs whose `Vary` names are remembered at once. One forgotten costs its next request
/// one more L2 read (the URL's own key, which teaches them again).
const VARY_URLS: u64 = 65_536;

/// How long `Vary` names are remembered: an origin that stops varying (or varies on other
/// headers) is seen again within this time. Until then its answers are stored per variant
/// still: more copies, never a wrong one (each copy's own selection is checked on read).
const VARY_TTL: Duration = Duration::from_secs(300);

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
            vary: moka::sync::Cache::builder()
                .max_capacity(VARY_URLS)
                .time_to_live(VARY_TTL)
                .build(),
        }
    }

    /// What a copy of the URL key `url` taught here of its origin's `Vary`: the request
    /// headers its answers vary on (and the route does not key), and which variant `url`
    /// itself holds. The read path then looks up the request's Vary variant
    /// (`key::selected`), or `url` when it holds that one. A stale spec only costs a miss:
    /// every copy's own selection is checked on read.
    pub(crate) fn vary_spec(&self, url: &CacheKey) -> Option<VarySpec> {
        if url.is_selected() {
            return None;
        }
        self.vary.get(&url.hash)
    }

    /// Learns from `entry`, a copy of `key` read or stored, the headers its origin varies
    /// on and which variant `key` holds: only a URL's own key teaches (a Vary variant's key
    /// was made from them).
    pub(crate) fn learn_vary(&self, key: &CacheKey, entry: &Entry) {
        if key.is_selected() || entry.selecting.is_empty() || !entry.matches(key) {
            return;
        }
        let selection = entry
            .selecting
            .iter()
            .map(|(name, value)| (name, value.clone()));
        let spec = VarySpec {
            names: entry
                .selecting
                .iter()
                .map(|(name, _)| name.clone())
                .collect(),
            held: key::selected_by(key, selection).hash,
        };
        if self.vary.get(&key.hash).as_ref() != Some(&spec) {
            self.vary.insert(key.hash, spec);
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

    /// The version floor of base key `base` this process knows of (its own writes', and
    /// those other instances' `invalidate` events carried).
    pub(crate) fn floor(&self, base: u128) -> Option<u128> {
        self.marks.floor(base)
    }

    /// Whether `key` (or one of `tags`) was invalidated here since the marks' position
    /// `since` (or invalidations may have been missed since).
    pub(crate) fn invalidated_since(&self, key: &CacheKey, tags: &[String], since: u64) -> bool {
        self.marks.standing(key.base, tags, since) != Standing::Valid
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

    /// The L1 copy of `key`, whatever its freshness (the hot-key gate decides on it), if it
    /// may be served without asking Redis. `needs_bus`: the route's
    /// [`RouteConfig::l1_needs_bus`](crate::config::RouteConfig::l1_needs_bus).
    pub(crate) async fn l1_copy(&self, key: &CacheKey, needs_bus: bool) -> Option<Arc<Entry>> {
        self.trusted_l1(key, needs_bus).await
    }

    /// The L1 copy of `key` unless it is unverified while Redis answers (then it is
    /// checked there: L2 has the current copy or none).
    async fn trusted_l1(&self, key: &CacheKey, needs_bus: bool) -> Option<Arc<Entry>> {
        let copy = self.l1.get(key)?;
        self.trusts(&copy, needs_bus).then_some(copy.entry)
    }

    /// Whether an L1 copy answers without asking Redis: it is verified (no invalidation
    /// of it may have been missed) and, on a route that needs the bus, the event bus is
    /// confirmed — or Redis cannot be asked (the outage fallback). The first test is one
    /// atomic load.
    fn trusts(&self, copy: &L1Copy, needs_bus: bool) -> bool {
        (copy.verified && (!needs_bus || self.marks.bus_confirmed())) || !self.redis_up()
    }

    /// L1, then L2: a fresh copy wins; otherwise the newest stale copy within grace;
    /// otherwise a miss, with the newest copy still kept. A copy whose `Vary` selection
    /// does not match `request` (the headers of the request it would answer) counts as
    /// absent. `skip_l1` goes past L1 (a hot key whose L1 copy is due a check against
    /// Redis). An unverified L1 copy (an invalidation may have been missed) is checked in
    /// L2: it answers only if Redis cannot (the outage fallback). So is every copy of a
    /// route that `needs_bus` while the event bus is not confirmed.
    pub(crate) async fn lookup(
        &self,
        key: &CacheKey,
        l1: L1Policy,
        needs_bus: bool,
        skip_l1: bool,
        request: &HeaderMap,
    ) -> Cached {
        let now = now_ms();
        let mut found = Found::default();
        let mut unverified = None;
        if l1 != L1Policy::Off
            && !skip_l1
            && let Some(copy) = self.l1.get(key)
            && self.selects(key, &copy.entry, request)
        {
            if self.trusts(&copy, needs_bus) {
                if let Some(fresh) = found.add(copy.entry, now, Outcome::HitL1) {
                    return fresh;
                }
            } else {
                unverified = Some(copy.entry);
            }
        }
        let since = self.since();
        // On the heap, and only past L1: the L2 read's future (a Redis command, a large
        // value's pieces) is kilobytes, which every request's future would otherwise
        // carry, an L1 hit's included.
        match Box::pin(self.l2_read(key)).await {
            L2Read::Hit(entry) if self.selects(key, &entry, request) => {
                if entry.freshness(now) == Freshness::Fresh && self.keeps_in_l1(l1, key.hash) {
                    Box::pin(self.keep(key, Arc::clone(&entry), since)).await;
                }
                if let Some(fresh) = found.add(entry, now, Outcome::HitL2) {
                    return fresh;
                }
            }
            // Redis cannot say: the unverified copy is what the outage fallback has.
            L2Read::Unavailable => {
                if let Some(entry) = unverified
                    && let Some(fresh) = found.add(entry, now, Outcome::HitL1)
                {
                    return fresh;
                }
            }
            L2Read::Hit(_) | L2Read::Miss => {}
        }
        found.into_cached()
    }

    /// A fresh L1 copy of `key` for a request with `request` headers that may answer
    /// without asking Redis (a verified one, or any while Redis is down).
    pub(crate) async fn fresh_in_l1(
        &self,
        key: &CacheKey,
        l1: L1Policy,
        needs_bus: bool,
        request: &HeaderMap,
    ) -> Option<Arc<Entry>> {
        if l1 == L1Policy::Off {
            return None;
        }
        let entry = self.trusted_l1(key, needs_bus).await?;
        (entry.freshness(now_ms()) == Freshness::Fresh && entry.selects(request)).then_some(entry)
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
        if entry.freshness(now_ms()) != Freshness::Fresh || !self.selects(key, &entry, request) {
            return None;
        }
        if self.keeps_in_l1(l1, key.hash) {
            self.keep(key, Arc::clone(&entry), since).await;
        }
        Some(entry)
    }

    /// Whether `entry`, a copy of `key`, selects `request`; it teaches its `Vary` names
    /// either way.
    fn selects(&self, key: &CacheKey, entry: &Entry, request: &HeaderMap) -> bool {
        self.learn_vary(key, entry);
        entry.selects(request)
    }

    /// L2's copy of `key`, unless an invalidation of it is owed to Redis.
    async fn l2_copy(&self, key: &CacheKey) -> Option<Arc<Entry>> {
        match self.l2_read(key).await {
            L2Read::Hit(entry) => Some(entry),
            L2Read::Miss | L2Read::Unavailable => None,
        }
    }

    /// What L2 says of `key`. An owed invalidation makes it a miss: Redis may still hold a
    /// copy it concerns. Embedded mode: unavailable.
    async fn l2_read(&self, key: &CacheKey) -> L2Read {
        let Some(l2) = self.l2.as_ref() else {
            return L2Read::Unavailable;
        };
        if self.owed.owes(key.base) {
            return L2Read::Miss;
        }
        match l2.get(key).await {
            l2::Lookup::Hit(entry) => L2Read::Hit(entry),
            l2::Lookup::Miss => L2Read::Miss,
            l2::Lookup::Unavailable => L2Read::Unavailable,
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
        self.l1.insert(key, Arc::clone(&entry), since);
        if !self.marks.allows(key.base, &entry.tags, since) {
            self.l1.invalidate(key.hash);
            self.metrics.fill_refused(FillRefusal::Generation);
            return false;
        }
        self.hot.kept(key);
        true
    }
}

/// What L2 said of a key.
enum L2Read {
    Hit(Arc<Entry>),
    Miss,
    /// Redis did not answer (or there is none).
    Unavailable,
}

/// The copies a lookup has seen that are not fresh: the newest stale one within grace, and
/// the newest one past it that is still kept.
#[derive(Default)]
struct Found {
    stale: Option<Arc<Entry>>,
    kept: Option<Arc<Entry>>,
}

impl Found {
    /// Takes a copy in: a fresh one is the answer (`Some`, with `outcome`); any other is
    /// remembered when it is newer than the one of its kind seen before.
    fn add(&mut self, entry: Arc<Entry>, now: u64, outcome: Outcome) -> Option<Cached> {
        let slot = match entry.freshness(now) {
            Freshness::Fresh => return Some(Cached::Fresh(entry, outcome)),
            Freshness::Stale => &mut self.stale,
            Freshness::IfError | Freshness::Kept => &mut self.kept,
            Freshness::Expired => return None,
        };
        if slot
            .as_ref()
            .is_none_or(|held| held.stored_at_ms < entry.stored_at_ms)
        {
            *slot = Some(entry);
        }
        None
    }

    fn into_cached(self) -> Cached {
        match self.stale {
            Some(entry) => Cached::Stale(entry),
            None => Cached::Miss(self.kept),
        }
    }
}
