//! The read path: a cacheable request walks these steps in order and leaves at the first
//! one that can answer.
//!
//! ```text
//! per-user request? ─▶ pass through (BYPASS)
//! derive key (one parse: key + forwarded URL)
//! L1/L2 fresh ─▶ HIT-L1 / HIT-L2 / NEGATIVE   (maybe an early refresh in the background)
//! L1/L2 stale ─▶ STALE at once, one refresh in the background (stale-while-revalidate)
//! miss ─▶ single-flight (fill.rs): one leader per key in this process; across instances one
//!         lock holder per key; everyone else waits for its answer
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::{self, HeaderMap};
use http::request::Parts;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;

use super::Proxy;
use super::body::Body;
use super::fetch::{Failure, FillJob, SharedFailure};
use super::respond;
use super::route::Route;
use super::upstream::UpstreamBody;
use crate::cache::key;
use crate::cache::l2::Lookup;
use crate::cache::{CacheKey, Entry, Freshness, now_ms};
use crate::config::L1Policy;
use crate::metrics::{FillRefusal, Outcome};
use crate::protect::flight::{FlightKind, FlightResult, Role};
use crate::protect::hotkeys::Hot;

/// How many times a follower joins a new flight after the leader failed or went away,
/// before it fetches for itself (still through the origin guard).
const MAX_FLIGHT_ATTEMPTS: usize = 3;

/// How a hot-key request goes on when its L1 copy does not answer it outright.
enum GoOn {
    /// The usual path, L1 included.
    ThroughL1,
    /// Past L1: its copy is due a check against Redis.
    PastL1,
    /// The usual path, which answers from L1 and refreshes the entry early (XFetch chose it).
    RefreshEarly,
    /// Straight to the key's one in-process fill (joined, or led when none runs), without a
    /// lookup of its own: a hot key with no copy yet.
    Coalesce,
}

/// What a lookup found.
pub(crate) struct Found {
    pub(crate) entry: Arc<Entry>,
    pub(crate) tier: Outcome,
    pub(crate) freshness: Freshness,
}

/// How a fill ended, for the requests that wait on it.
pub(crate) enum Fetched {
    /// Answer from this entry (stored, or found stored by another fill), with this outcome.
    Ready(Arc<Entry>, Outcome),
    /// For this client only: not shareable.
    Uncacheable(Response<Body>),
    /// The origin failed (or cacheguard answered an error itself).
    Failed(Failure),
    /// A background refresh found another instance already refreshing; nothing to answer.
    Skipped,
}

impl Proxy {
    /// Serves a GET/HEAD on a cached route and records its outcome.
    pub(crate) async fn serve_read(
        self: &Arc<Self>,
        route: &Arc<Route>,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        let started = Instant::now();
        let (parts, body) = request.into_parts();
        // GET/HEAD bodies are never forwarded on cached routes: they are not in the key.
        drop(body);
        let (response, outcome) = self.read(route, parts, client).await;
        route
            .metrics
            .answered(outcome, started.elapsed().as_secs_f64());
        response
    }

    async fn read(
        self: &Arc<Self>,
        route: &Arc<Route>,
        parts: Parts,
        client: SocketAddr,
    ) -> (Response<Body>, Outcome) {
        // Per-user requests are never answered from, or stored into, a shared cache.
        if parts.headers.contains_key(header::AUTHORIZATION)
            || parts.headers.contains_key(header::COOKIE)
        {
            let empty: UpstreamBody = Empty::new().map_err(|never| match never {}).boxed();
            return self.forward(parts, empty, client).await;
        }

        let head = parts.method == Method::HEAD;
        let derived = key::derive(
            &route.config,
            parts.uri.path(),
            parts.uri.query(),
            &parts.headers,
        );
        let mut skip_l1 = false;
        let mut refresh_early = false;
        let mut coalesce = false;
        // A route without L1 has nothing to promote a hot key into: no detection either.
        if route.config.l1 != L1Policy::Off {
            self.hot.record(derived.key.hash);
        }
        if route.config.l1 != L1Policy::Off
            && let Some(hot) = self.hot.get(derived.key.hash)
        {
            match self.serve_hot(route, &derived.key, &hot, head).await {
                Ok(answer) => return answer,
                Err(GoOn::PastL1) => skip_l1 = true,
                Err(GoOn::RefreshEarly) => refresh_early = true,
                Err(GoOn::Coalesce) => coalesce = true,
                Err(GoOn::ThroughL1) => {}
            }
        }
        // A miss for this key is being filled right now: join it rather than look again.
        let found = if coalesce || self.flights.foreground_in_progress(derived.key.hash) {
            None
        } else {
            self.lookup_from(route, &derived.key, skip_l1).await
        };
        let job = || {
            let mut vary = HeaderMap::new();
            for name in &route.config.vary {
                for value in parts.headers.get_all(name) {
                    vary.append(name.clone(), value.clone());
                }
            }
            FillJob {
                route: Arc::clone(route),
                key: derived.key.clone(),
                forward: derived.forward_path_and_query.clone(),
                vary,
                client,
                background: false,
            }
        };

        match found {
            Some(found) if found.freshness == Freshness::Fresh => {
                let beta = route.config.early_refresh_beta;
                if beta > 0.0
                    && (refresh_early
                        || found
                            .entry
                            .should_refresh_early(now_ms(), beta, rand::random::<f64>()))
                    && self.refresh_in_background(job(), true)
                {
                    route.metrics.early_refreshes.inc();
                }
                hit(&found.entry, found.tier, head)
            }
            Some(found) => {
                // Stale-while-revalidate: answer at once; one request refreshes.
                self.refresh_in_background(job(), false);
                route.metrics.stale_served.inc();
                hit(&found.entry, Outcome::Stale, head)
            }
            None => self.fill(job(), head).await,
        }
    }

    /// L1, then L2. A fresh copy wins; otherwise the newest stale copy (within grace).
    pub(crate) async fn lookup(&self, route: &Route, key: &CacheKey) -> Option<Found> {
        self.lookup_from(route, key, false).await
    }

    /// [`Self::lookup`], optionally past L1 (a hot key whose L1 copy is due a check).
    async fn lookup_from(&self, route: &Route, key: &CacheKey, skip_l1: bool) -> Option<Found> {
        let now = now_ms();
        let mut stale = None;
        if route.config.l1 != L1Policy::Off
            && !skip_l1
            && let Some(entry) = self.l1.get(key).await
        {
            match entry.freshness(now) {
                Freshness::Fresh => {
                    return Some(Found {
                        entry,
                        tier: Outcome::HitL1,
                        freshness: Freshness::Fresh,
                    });
                }
                Freshness::Stale => stale = Some(entry),
                Freshness::Expired => {}
            }
        }
        let since = self.invalidator.marks.snapshot();
        if let Some(l2) = &self.l2
            && !self.invalidator.owes(key.base)
            && let Lookup::Hit(entry) = l2.get(key).await
        {
            match entry.freshness(now) {
                Freshness::Fresh => {
                    if self.keeps_in_l1(route, key.hash) {
                        self.put_l1(key, Arc::clone(&entry), since).await;
                    }
                    return Some(Found {
                        entry,
                        tier: Outcome::HitL2,
                        freshness: Freshness::Fresh,
                    });
                }
                Freshness::Stale
                    if stale
                        .as_ref()
                        .is_none_or(|s: &Arc<Entry>| s.stored_at_ms < entry.stored_at_ms) =>
                {
                    stale = Some(entry);
                }
                Freshness::Stale | Freshness::Expired => {}
            }
        }
        stale.map(|entry| Found {
            entry,
            tier: Outcome::Stale,
            freshness: Freshness::Stale,
        })
    }

    /// Whether this route's entries are kept in L1. In embedded mode, and while Redis is
    /// down in shared mode, L1 is the only tier and holds everything unless the route says
    /// `off` (degraded = embedded behaviour). With Redis up, `hot` keeps L1 for hot keys
    /// only (see [`Self::keeps_in_l1`]).
    pub(crate) fn uses_l1(&self, route: &Route) -> bool {
        match route.config.l1 {
            L1Policy::Off => false,
            L1Policy::All => true,
            L1Policy::Hot => self.l2.as_ref().is_none_or(|l2| !l2.redis().is_up()),
        }
    }

    /// Whether an entry for `hash` on `route` goes into L1: per the route's policy, and for
    /// every hot key unless the route says `off`.
    pub(crate) fn keeps_in_l1(&self, route: &Route, hash: u128) -> bool {
        self.uses_l1(route) || (route.config.l1 != L1Policy::Off && self.hot.get(hash).is_some())
    }

    /// Puts an entry in L1; a hot key's copy is then served from L1 for `hot_keys.l1_ttl`
    /// without asking Redis.
    /// Puts an entry read or fetched since the local marks' `since` into L1, unless an
    /// invalidation of its key or tags happened here since (then it may predate it). The
    /// check runs again after the insert: an invalidation landing in between removes it.
    pub(crate) async fn put_l1(&self, key: &CacheKey, entry: Arc<Entry>, since: u64) {
        let marks = &self.invalidator.marks;
        if !marks.allows(key.base, &entry.tags, since) {
            self.metrics.fill_refused(FillRefusal::Generation);
            return;
        }
        self.l1.insert(key, Arc::clone(&entry), since).await;
        if !marks.allows(key.base, &entry.tags, since) {
            self.l1.invalidate(key.hash).await;
            self.metrics.fill_refused(FillRefusal::Generation);
            return;
        }
        if let Some(hot) = self.hot.get(key.hash) {
            self.hot.renew_l1(&hot);
            self.hot.label(key.hash, &key.full);
        }
    }

    /// A hot key: its L1 copy answers while its L1 grace lasts; after that, at most
    /// `max_backend_rps_per_key` requests per second go on to Redis and the origin, and the
    /// rest get the L1 copy (fresh or stale), join the key's fill when there is no copy, or
    /// (for a key whose answers cannot be shared) 429. `Err` = go on, as [`GoOn`] says.
    async fn serve_hot(
        &self,
        route: &Route,
        key: &CacheKey,
        hot: &Hot,
        head: bool,
    ) -> Result<(Response<Body>, Outcome), GoOn> {
        // Without a usable Redis the L1 copy is the only copy: nothing to check it against.
        if !self.l2.as_ref().is_some_and(|l2| l2.redis().is_up()) {
            return Err(GoOn::ThroughL1);
        }
        let now = now_ms();
        let copy = self.l1.get(key).await;
        let freshness = copy.as_ref().map(|e| e.freshness(now));
        if let Some(entry) = &copy
            && freshness == Some(Freshness::Fresh)
            && hot.l1_fresh()
        {
            let beta = route.config.early_refresh_beta;
            if beta > 0.0 && entry.should_refresh_early(now, beta, rand::random::<f64>()) {
                // The usual path answers from L1 and starts the early refresh.
                return Err(GoOn::RefreshEarly);
            }
            self.hot.served(key.hash, &key.full, true);
            return Ok(hit(entry, Outcome::HitL1, head));
        }
        // No copy yet and this process is filling the key: joining that fill costs the
        // backend nothing, so it is not limited (a cold key that turns hot mid-fill must
        // not answer 429 to the requests the single-flight was built for).
        if copy.is_none() && self.flights.foreground_in_progress(key.hash) {
            return Err(GoOn::Coalesce);
        }
        if self.hot.allow_backend(key.hash) {
            self.hot.served(key.hash, &key.full, false);
            // Past L1: its copy is due a check against Redis.
            return Err(if copy.is_some() {
                GoOn::PastL1
            } else {
                GoOn::ThroughL1
            });
        }
        self.metrics.hot_limited(&route.config.name);
        match (copy, freshness) {
            (Some(entry), Some(Freshness::Fresh)) => {
                self.hot.served(key.hash, &key.full, true);
                Ok(hit(&entry, Outcome::HitL1, head))
            }
            (Some(entry), Some(Freshness::Stale)) => {
                self.hot.served(key.hash, &key.full, true);
                Ok(hit(&entry, Outcome::Stale, head))
            }
            // No copy at all (a key that turned hot before its first fill here, between
            // the lookups of the first requests and their fill): the excess joins, or
            // leads, the one in-process fill, which costs the backend at most one fetch per
            // instance at a time. Only a key whose answers cannot be shared, where each
            // request would fetch for itself, is refused.
            _ if !self.uncacheable.contains_key(&key.hash) => Err(GoOn::Coalesce),
            _ => {
                let mut response = respond::text(
                    http::StatusCode::TOO_MANY_REQUESTS,
                    "cacheguard: too many requests for this key\n",
                );
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, http::HeaderValue::from_static("1"));
                Ok((response, Outcome::Error))
            }
        }
    }

    /// A miss: one fill per key in this process, shared with every concurrent miss.
    pub(crate) async fn fill(
        self: &Arc<Self>,
        job: FillJob,
        head: bool,
    ) -> (Response<Body>, Outcome) {
        if self.uncacheable.contains_key(&job.key.hash) {
            // Hit-for-miss: the last answer for this key was not shareable, so nobody waits
            // on anybody; each request fetches for itself.
            return respond_fetched(self.fetch_and_store(&job).await, head);
        }
        let mut counted = false;
        let mut last_failure: Option<Arc<SharedFailure>> = None;
        for _ in 0..MAX_FLIGHT_ATTEMPTS {
            match self.flights.join(job.key.hash, FlightKind::Foreground) {
                Role::Leader(leader) => {
                    // The fill runs in its own task: if this client hangs up, the fetch its
                    // followers (here and on other instances) wait on still completes.
                    let this = Arc::clone(self);
                    let task_job = job.clone();
                    let task = tokio::spawn(async move { this.lead(task_job, leader, true).await });
                    return match task.await {
                        Ok(fetched) => respond_fetched(fetched, head),
                        Err(_) => (
                            respond::text(
                                http::StatusCode::INTERNAL_SERVER_ERROR,
                                "cacheguard: internal error\n",
                            ),
                            Outcome::Error,
                        ),
                    };
                }
                Role::Follower(follower) => {
                    if !counted {
                        job.route.metrics.coalesced.inc();
                        counted = true;
                    }
                    match follower.wait(self.follower_wait_limit()).await {
                        FlightResult::Filled(entry, tier) if entry.matches(&job.key) => {
                            return hit(&entry, tier, head);
                        }
                        FlightResult::Uncacheable => {
                            // Not shareable: each request fetches for itself, lock-free.
                            return respond_fetched(self.fetch_and_store(&job).await, head);
                        }
                        FlightResult::Failed(Some(failure)) if !failure.retry => {
                            return (failure.response(), failure.outcome);
                        }
                        // An origin failure: one of the followers becomes the new leader and
                        // tries once more (pingora's lock does the same).
                        FlightResult::Failed(failure) => last_failure = failure.or(last_failure),
                        FlightResult::Filled(..) | FlightResult::Abandoned => {}
                    }
                }
            }
        }
        // Out of attempts. After repeated origin failures, answer with the last one rather
        // than send every waiter to a failing origin; otherwise fill without the in-process
        // flight, but still under the fleet lock.
        if let Some(failure) = last_failure {
            return (failure.response(), failure.outcome);
        }
        respond_fetched(self.fill_unflighted(&job).await, head)
    }

    /// Starts a refresh of `job`'s key in the background unless one is already running in
    /// this process. `early` refreshes an entry that is still fresh. Returns whether a
    /// refresh was started.
    fn refresh_in_background(self: &Arc<Self>, mut job: FillJob, early: bool) -> bool {
        if self.refresh_backoff.contains_key(&job.key.hash) {
            return false;
        }
        let Role::Leader(leader) = self.flights.join(job.key.hash, FlightKind::Background) else {
            return false;
        };
        job.background = true;
        job.route.metrics.background_refreshes.inc();
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let hash = job.key.hash;
            // A failed refresh, or one another instance is already running, is not tried
            // again for a moment: the stale copy keeps being served meanwhile.
            if let Fetched::Failed(_) | Fetched::Skipped = this.lead(job, leader, !early).await {
                this.refresh_backoff.insert(hash, ());
            }
        });
        true
    }

    /// A follower never waits longer than a leader can take: the lock wait, the guard's
    /// queue and the origin timeout, plus a margin.
    fn follower_wait_limit(&self) -> Duration {
        self.lock.load().wait_timeout
            + self.guard.load().queue_timeout()
            + self.upstream.load().timeout
            + Duration::from_secs(1)
    }
}

/// The response for a finished fill.
fn respond_fetched(fetched: Fetched, head: bool) -> (Response<Body>, Outcome) {
    match fetched {
        Fetched::Ready(entry, outcome) => hit(&entry, outcome, head),
        Fetched::Uncacheable(response) => (response, Outcome::Bypass),
        Fetched::Failed(failure) => (failure.response, failure.outcome),
        // Only background fills skip, and nobody awaits their answer.
        Fetched::Skipped => (
            respond::text(http::StatusCode::SERVICE_UNAVAILABLE, "cacheguard: retry\n"),
            Outcome::Error,
        ),
    }
}

/// A response from a cached entry. Cache hits on a 404/410 are `NEGATIVE`.
pub(crate) fn hit(entry: &Entry, tier: Outcome, head: bool) -> (Response<Body>, Outcome) {
    let outcome = match tier {
        Outcome::HitL1 | Outcome::HitL2 if entry.is_negative() => Outcome::Negative,
        other => other,
    };
    (respond::from_entry(entry, outcome, head, now_ms()), outcome)
}
