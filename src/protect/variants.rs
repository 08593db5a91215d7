//! A budget of variants per path: how many distinct query (or `vary`) variants of one base
//! key are fetched and cached per window, and what happens to a variant beyond it.
//!
//! With every query parameter keyed (`query = "sorted"`, the default), `?x=<random>` makes
//! every request a new key: a miss, an origin fetch and an entry each, around single-flight,
//! hot-key limits and Bloom filters alike. A miss on a variant new in its path's window
//! (the route's `ttl`) meets these rules, in order:
//!
//! ```text
//! the base key, or a variant admitted in this window      ─▶ fetch and cache, as any miss
//! fewer than max_variants admitted for the path           ─▶ admit: fetch and cache   budget
//! beyond, asked for before (the doorkeeper knows it)      ─▶ admit: fetch and cache   repeat
//!         and a cell of the route's overflow rate
//! beyond, a first ask, and a cell of the overflow rate    ─▶ fetch for this request
//!         and of its half for first asks                     only, store nothing     uncached
//! otherwise                                               ─▶ 429, Retry-After: 1     refused
//! ```
//!
//! # Why this shape
//!
//! A budget alone is spendable by anyone: random parameters used up a path's variants and
//! every real client's new variant of that path was refused for the rest of the window.
//! What separates a real variant from a random one, in every deployment, is that it is
//! asked for again: by the next user, or by the same client retrying. (The client's address
//! does not: behind a load balancer or an ingress, which is where a sidecar usually sits,
//! every request comes from the same peer.) So beyond the budget:
//!
//! - A variant asked for before is *admitted*: fetched once and cached like one within the
//!   budget, so a popular variant costs the origin one fetch, not one per request.
//! - A first ask is answered *uncached*: fetched for its request under the origin guard,
//!   stored nowhere (a random variant is never asked again; caching it would only push
//!   real entries out). It is what lets a long tail of real one-off variants (a search
//!   box) through, where the budget used to refuse them.
//! - Both cost the origin one request each, so both draw on one rate per route,
//!   `variant_overflow_rate` per second (with a burst of as many): the origin load a flood
//!   can cause is `max_variants` per path per window plus that rate, per instance. First
//!   asks may take at most half of it (rounded down), so however many random parameters
//!   arrive, repeats always find the other half.
//! - Over that rate a miss is refused (429) with `Retry-After: 1`: by then the variant is
//!   known, so the client's retry is a repeat. With `variant_overflow_rate = 0` nothing is
//!   fetched beyond the budget and a refusal waits for the next window.
//!
//! What it does not do: an attacker who sends each random value twice makes its repeats
//! compete with real ones for the rate, so real variants beyond the budget may again be
//! refused; the origin stays bounded by the same rate. A query allowlist
//! (`query = ["page", ...]`) is the real fix and what the documentation recommends.
//!
//! # Memory, whatever is sent
//!
//! - Paths: at most [`TRACKED_PATHS`] per route, each with the variants admitted in its
//!   window: `max_variants`, plus the repeats the route's rate admitted (at most the burst
//!   plus `variant_overflow_rate` per second of window, over all its paths together).
//! - The doorkeeper: a fixed table of [`SEEN_SLOTS`] 64-bit fingerprints per route (128
//!   KiB), made when the first path of the route overflows.
//! - The rates: two governor cells per route.
//!
//! Everything is per instance: a fleet of N fetches at most N times as much.

use std::collections::HashSet;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use governor::{Quota, RateLimiter};
use moka::sync::Cache;

use crate::clock::{DirectLimiter, TokioClock};
use crate::metrics::NewVariant;

/// Paths tracked at once. A path pushed out starts a new budget: bounded memory, at the
/// cost of letting an attacker who cycles through more paths than this start over (each
/// of those paths is a miss of its own, which the other protections see).
const TRACKED_PATHS: u64 = 16_384;

/// Fingerprints the doorkeeper holds per route. A first ask is remembered until another
/// one lands on its slot: with this many slots, about 94% of them survive the next 1,000
/// first asks, so a repeat within a moment of a flood is recognised.
const SEEN_SLOTS: usize = 16_384;

/// The budget of one route.
#[derive(Debug)]
pub(crate) struct VariantBudget {
    /// Base key → the variants admitted in its current window.
    admitted: Cache<u128, Arc<Mutex<HashSet<u128>>>>,
    max: usize,
    /// `None` with `variant_overflow_rate = 0`: nothing is fetched beyond the budget.
    overflow: Option<Overflow>,
}

/// What may pass a spent budget, route-wide.
#[derive(Debug)]
struct Overflow {
    /// Every fetch beyond a budget takes a cell.
    rate: DirectLimiter,
    /// First asks also take one here: half the rate (`None` below 2 per second, where
    /// first asks get none).
    first_asks: Option<DirectLimiter>,
    seen: Doorkeeper,
}

impl VariantBudget {
    /// `max` variants per path per `window`; beyond them, `overflow_rate` fetches per
    /// second for the whole route.
    pub(crate) fn new(max: usize, window: Duration, overflow_rate: u32) -> Self {
        let limiter = |per_second: u32| {
            NonZeroU32::new(per_second).map(|rate| {
                RateLimiter::direct_with_clock(
                    Quota::per_second(rate).allow_burst(rate),
                    TokioClock::new(),
                )
            })
        };
        VariantBudget {
            admitted: Cache::builder()
                .max_capacity(TRACKED_PATHS)
                .time_to_live(window.max(Duration::from_millis(1)))
                .build(),
            max,
            overflow: limiter(overflow_rate).map(|rate| Overflow {
                rate,
                first_asks: limiter(overflow_rate / 2),
                seen: Doorkeeper::default(),
            }),
        }
    }

    /// What a miss on variant `hash` of base `base` may do: `None` when it is the base
    /// itself or a variant admitted in this window (fetch and cache, as any miss);
    /// otherwise how the new variant is treated (see the module docs).
    pub(crate) fn admit(&self, base: u128, hash: u128) -> Option<NewVariant> {
        if base == hash {
            return None;
        }
        let set = self.admitted.get_with(base, Arc::default);
        let mut set = set.lock().unwrap_or_else(PoisonError::into_inner);
        if set.contains(&hash) {
            return None;
        }
        if set.len() < self.max {
            set.insert(hash);
            return Some(NewVariant::Budget);
        }
        let Some(overflow) = &self.overflow else {
            return Some(NewVariant::Refused);
        };
        // Under the path's lock: of concurrent repeats of one variant, only the first takes
        // a cell; the others find it admitted.
        let verdict = if overflow.seen.check_and_mark(hash) {
            if overflow.rate.check().is_ok() {
                set.insert(hash);
                NewVariant::Repeat
            } else {
                NewVariant::Refused
            }
        } else if overflow
            .first_asks
            .as_ref()
            .is_some_and(|first| first.check().is_ok())
            && overflow.rate.check().is_ok()
        {
            NewVariant::Uncached
        } else {
            NewVariant::Refused
        };
        Some(verdict)
    }

    /// The `Retry-After` of a refusal: a second with an overflow rate (the retry is then a
    /// repeat), the whole window without one.
    pub(crate) fn retry_after(&self, window: Duration) -> u64 {
        match self.overflow {
            Some(_) => 1,
            None => window.as_secs().max(1),
        }
    }
}

/// The variants asked for once beyond a spent budget, so that the next ask is known as a
/// repeat: a direct-mapped table of 64-bit fingerprints, one per slot, overwritten by the
/// next first ask that lands on the slot.
///
/// Hand-written rather than a Bloom or cuckoo filter from a crate: their false positives
/// are what a flood of random variants would farm (each false positive passes as a repeat
/// and takes a cell meant for real ones). Here a random variant passes as a repeat only
/// with the same slot *and* fingerprint, 1 in 2^64; a flood can only push real first asks
/// out (a real repeat then counts as a first ask: a refusal, never an extra fetch). The
/// table is allocated on first use, so routes whose paths never overflow pay nothing.
#[derive(Debug, Default)]
struct Doorkeeper {
    slots: OnceLock<Box<[AtomicU64]>>,
}

impl Doorkeeper {
    /// Whether `hash` was marked (and still holds its slot); marks it either way.
    fn check_and_mark(&self, hash: u128) -> bool {
        let slots = self
            .slots
            .get_or_init(|| (0..SEEN_SLOTS).map(|_| AtomicU64::new(0)).collect());
        // The key hash is xxh3-128: its halves are independent, one picks the slot and the
        // other is the fingerprint (0 marks an empty slot, so it is never one).
        let slot = usize::try_from(hash as u64 % SEEN_SLOTS as u64).unwrap_or(0);
        let fingerprint = ((hash >> 64) as u64).max(1);
        // Relaxed: a slot is a hint, not a lock; a lost race only forgets one first ask.
        slots[slot].swap(fingerprint, Ordering::Relaxed) == fingerprint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Variant `n` of a path: distinct slots and fingerprints for small `n`.
    fn variant(n: u128) -> u128 {
        (n << 64) | n
    }

    #[test]
    fn a_path_admits_max_variants_and_keeps_admitting_them() {
        let budget = VariantBudget::new(3, Duration::from_secs(60), 0);
        assert_eq!(budget.admit(1, 1), None, "the base itself is never counted");
        for v in 10..13 {
            assert_eq!(budget.admit(1, variant(v)), Some(NewVariant::Budget));
        }
        assert_eq!(
            budget.admit(1, variant(13)),
            Some(NewVariant::Refused),
            "one more variant, without an overflow rate"
        );
        assert_eq!(
            budget.admit(1, variant(11)),
            None,
            "an admitted variant again"
        );
        assert_eq!(
            budget.admit(2, variant(13)),
            Some(NewVariant::Budget),
            "another path has its own budget"
        );
        assert_eq!(budget.retry_after(Duration::from_secs(60)), 60);
    }

    #[test]
    fn a_new_window_starts_a_new_budget() {
        let budget = VariantBudget::new(1, Duration::from_millis(20), 0);
        assert_eq!(budget.admit(1, variant(10)), Some(NewVariant::Budget));
        assert_eq!(budget.admit(1, variant(11)), Some(NewVariant::Refused));
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(budget.admit(1, variant(11)), Some(NewVariant::Budget));
    }

    /// Beyond the budget, first asks take at most half the rate; a repeat finds the other
    /// half however many first asks came, is admitted, and then needs no cell again.
    #[tokio::test(start_paused = true)]
    async fn first_asks_take_half_the_overflow_and_repeats_the_rest() {
        const RATE: u32 = 10;
        let budget = VariantBudget::new(1, Duration::from_secs(3600), RATE);
        assert_eq!(budget.admit(1, variant(1)), Some(NewVariant::Budget));
        let flood = |from: u128| {
            (from..from + 1000)
                .filter(|&n| budget.admit(1, variant(n)) == Some(NewVariant::Uncached))
                .count()
        };
        assert_eq!(flood(1_000), 5, "first asks: half the burst");
        assert_eq!(budget.admit(1, variant(500_000)), Some(NewVariant::Refused));
        assert_eq!(
            budget.admit(1, variant(500_000)),
            Some(NewVariant::Repeat),
            "asked again: the other half"
        );
        assert_eq!(budget.admit(1, variant(500_000)), None, "admitted now");
        // A second later: the first asks' half has refilled by 5, and no more.
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(flood(10_000), 5);
        // Repeats of variants the flood asked for once take the rest of the rate.
        let repeats = (10_000..10_020)
            .filter(|&n| budget.admit(1, variant(n)) == Some(NewVariant::Repeat))
            .count();
        assert_eq!(repeats, 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_rate_of_one_is_for_repeats_only() {
        let budget = VariantBudget::new(1, Duration::from_secs(3600), 1);
        assert_eq!(budget.admit(1, variant(1)), Some(NewVariant::Budget));
        assert_eq!(budget.admit(1, variant(2)), Some(NewVariant::Refused));
        assert_eq!(budget.admit(1, variant(2)), Some(NewVariant::Repeat));
        assert_eq!(budget.retry_after(Duration::from_secs(60)), 1);
    }

    #[test]
    fn the_doorkeeper_knows_a_repeat_until_its_slot_is_taken() {
        let seen = Doorkeeper::default();
        assert!(!seen.check_and_mark(variant(7)));
        assert!(seen.check_and_mark(variant(7)));
        let same_slot = (99 << 64) | 7 | (SEEN_SLOTS as u128);
        assert!(
            !seen.check_and_mark(same_slot),
            "same slot, other fingerprint"
        );
        assert!(
            !seen.check_and_mark(variant(7)),
            "pushed out: a first ask again"
        );
        assert!(seen.check_and_mark(variant(7)));
    }
}
