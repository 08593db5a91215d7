//! A budget of variants per path: how many distinct query (or `vary`) variants of one base
//! key may be fetched from the origin per window.
//!
//! With every query parameter keyed (`query = "sorted"`, the default), `?x=<random>` makes
//! every request a new key: a miss, an origin fetch and an entry each, around single-flight,
//! hot-key limits and Bloom filters alike. The budget bounds that: within one window (the
//! route's `ttl`) at most `max_variants` distinct variants of a path are fetched here; a
//! miss on one more is refused (429) until the window ends. Hits are never refused, and a
//! variant already admitted in the window is always fetched again when it expires. The
//! budget is per instance, so a fleet of N fetches at most N × `max_variants` variants of a
//! path per window; an allowlist of the parameters that matter (`query = [...]`) is the
//! real fix and what the documentation recommends.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use moka::sync::Cache;

/// Paths tracked at once. A path pushed out starts a new budget: bounded memory, at the
/// cost of letting an attacker who cycles through more paths than this start over (each
/// of those paths is a miss of its own, which the other protections see).
const TRACKED_PATHS: u64 = 16_384;

/// The budget of one route.
#[derive(Debug)]
pub(crate) struct VariantBudget {
    /// Base key → the variants admitted in its current window.
    admitted: Cache<u128, Arc<Mutex<HashSet<u128>>>>,
    max: usize,
}

impl VariantBudget {
    /// `max` variants per path per `window`.
    pub(crate) fn new(max: usize, window: Duration) -> Self {
        VariantBudget {
            admitted: Cache::builder()
                .max_capacity(TRACKED_PATHS)
                .time_to_live(window.max(Duration::from_millis(1)))
                .build(),
            max,
        }
    }

    /// Whether variant `hash` of base `base` may be fetched: already admitted in this
    /// window, or within the budget (then admitted).
    pub(crate) fn admit(&self, base: u128, hash: u128) -> bool {
        if base == hash {
            return true;
        }
        let set = self.admitted.get_with(base, Arc::default);
        let mut set = set.lock().unwrap_or_else(PoisonError::into_inner);
        if set.contains(&hash) {
            return true;
        }
        if set.len() >= self.max {
            return false;
        }
        set.insert(hash);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_admits_max_variants_and_keeps_admitting_them() {
        let budget = VariantBudget::new(3, Duration::from_secs(60));
        assert!(budget.admit(1, 1), "the base itself is never counted");
        for v in 10..13 {
            assert!(budget.admit(1, v));
        }
        assert!(!budget.admit(1, 13), "one more variant");
        assert!(budget.admit(1, 11), "an admitted variant again");
        assert!(budget.admit(2, 13), "another path has its own budget");
    }

    #[test]
    fn a_new_window_starts_a_new_budget() {
        let budget = VariantBudget::new(1, Duration::from_millis(20));
        assert!(budget.admit(1, 10));
        assert!(!budget.admit(1, 11));
        std::thread::sleep(Duration::from_millis(40));
        assert!(budget.admit(1, 11));
    }
}
