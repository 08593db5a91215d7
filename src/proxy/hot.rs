//! The hot-key gate of the read path.
//!
//! A hot key's L1 copy answers while its L1 grace lasts; after that, at most
//! `max_backend_rps_per_key` requests per second go on to Redis and the origin, and the
//! rest get the L1 copy (fresh or stale), join the key's fill when there is no copy, or
//! (for a key whose answers cannot be shared) 429.

use std::sync::Arc;

use http::{HeaderMap, Response};

use super::body::Body;
use super::fill::Flights;
use super::respond;
use super::route::Route;
use crate::cache::tiers::Tiers;
use crate::cache::{CacheKey, Freshness};
use crate::clock::now_ms;
use crate::config::L1Policy;
use crate::error::ProxyError;
use crate::metrics::Outcome;
use crate::protect::hotkeys::HotKeys;

/// What the gate decided.
pub(crate) enum Gate {
    /// Answered from the hot key's L1 copy, or refused.
    Answered((Response<Body>, Outcome)),
    /// Look the key up. `past_l1`: its L1 copy is due a check against Redis.
    /// `refresh_early`: answer from L1 and refresh the entry early (XFetch chose it).
    Lookup { past_l1: bool, refresh_early: bool },
    /// Straight to the key's one in-process fill (joined, or led when none runs), without
    /// a lookup: a hot key with no copy yet.
    Join,
}

/// Not hot, or nothing to decide: the usual lookup.
const USUAL: Gate = Gate::Lookup {
    past_l1: false,
    refresh_early: false,
};

/// The gate: the hot-key set and what it needs to decide.
#[derive(Debug)]
pub(crate) struct HotGate {
    pub(crate) hot: Arc<HotKeys>,
    pub(crate) tiers: Arc<Tiers>,
    /// The read path's in-process flights: a hot key with no copy joins its running fill.
    pub(crate) flights: Arc<Flights>,
    /// The read path's hit-for-miss keys: only their excess is refused.
    pub(crate) uncacheable: moka::sync::Cache<u128, ()>,
}

impl HotGate {
    /// Counts the request towards hot-key detection and, for a hot key, decides how it
    /// goes on.
    /// `request`: the request's headers, for the copy's `Vary` selection.
    pub(crate) async fn check(
        &self,
        route: &Route,
        key: &CacheKey,
        head: bool,
        request: &HeaderMap,
    ) -> Gate {
        // A route without L1 has nothing to promote a hot key into: no detection either.
        if route.config.l1 == L1Policy::Off {
            return USUAL;
        }
        self.hot.record(key.hash);
        let Some(hot) = self.hot.get(key.hash) else {
            return USUAL;
        };
        // Without a usable Redis the L1 copy is the only copy: nothing to check it against.
        if !self.tiers.redis_up() {
            return USUAL;
        }
        let now = now_ms();
        // A copy selected by other request headers is no copy for this request.
        let copy = self
            .tiers
            .l1_copy(key, route.config.l1_needs_bus())
            .await
            .filter(|e| e.selects(request));
        let freshness = copy.as_ref().map(|e| e.freshness(now));
        if let Some(entry) = &copy
            && freshness == Some(Freshness::Fresh)
            && hot.l1_fresh()
        {
            let beta = route.config.early_refresh_beta;
            if beta > 0.0 && entry.should_refresh_early(now, beta, rand::random::<f64>()) {
                // The usual path answers from L1 and starts the early refresh.
                return Gate::Lookup {
                    past_l1: false,
                    refresh_early: true,
                };
            }
            self.hot.served(key.hash, &key.full, true);
            return Gate::Answered(respond::hit(entry, Outcome::HitL1, head));
        }
        // No copy yet and this process is filling the key: joining that fill costs the
        // backend nothing, so it is not limited (a cold key that turns hot mid-fill must
        // not answer 429 to the requests the single-flight was built for).
        if copy.is_none() && self.flights.foreground_in_progress(key.hash) {
            return Gate::Join;
        }
        if self.hot.allow_backend(key.hash) {
            self.hot.served(key.hash, &key.full, false);
            // Past L1 when there is a copy: it is due a check against Redis.
            return Gate::Lookup {
                past_l1: copy.is_some(),
                refresh_early: false,
            };
        }
        route.metrics.hot_limited.inc();
        match (copy, freshness) {
            (Some(entry), Some(Freshness::Fresh)) => {
                self.hot.served(key.hash, &key.full, true);
                Gate::Answered(respond::hit(&entry, Outcome::HitL1, head))
            }
            (Some(entry), Some(Freshness::Stale)) => {
                self.hot.served(key.hash, &key.full, true);
                Gate::Answered(respond::hit(&entry, Outcome::Stale, head))
            }
            // No copy at all (a key that turned hot before its first fill here, between
            // the lookups of the first requests and their fill): the excess joins, or
            // leads, the one in-process fill, which costs the backend at most one fetch per
            // instance at a time. Only a key whose answers cannot be shared, where each
            // request would fetch for itself, is refused.
            _ if !self.uncacheable.contains_key(&key.hash) => Gate::Join,
            _ => Gate::Answered((respond::error(&ProxyError::HotKeyLimited), Outcome::Error)),
        }
    }
}
