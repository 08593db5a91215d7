//! Filling a miss: one origin fetch per key in this process, and one for the whole fleet.
//!
//! ```text
//! fill ─▶ hit-for-miss key? ─▶ fetch alone, lock-free
//!      ─▶ join the key's in-process flight
//!           follower ─▶ wait for the leader's result, until lock.wait_timeout after it
//!                       began waiting (then lock.on_timeout, as a wait on another
//!                       instance's fill); a failed or vanished leader: one follower
//!                       leads next (at most 3 rounds)
//!           leader   ─▶ lead, in a task of its own (a client hanging up cancels nothing)
//! lead ─▶ re-check L1/L2 (a fill that just finished has stored already)
//!      ─▶ Redis usable?
//!           no  ─▶ fetch_and_store: fetch, store (generation-checked), L1
//!           yes ─▶ claim the key's fleet lock (protect/flight/fleet.rs)
//!                   leader   ─▶ list the key in its route's index (a pattern purge finds
//!                               it from now on), fetch while the lease is renewed, then
//!                               FILL (store if no invalidation overtook it + release +
//!                               publish when a waiter marked the lock)
//!                   follower ─▶ look in L2; wait for the key's event or the holder's lease
//!                               end; then read L2, or claim again, or fetch alone; give up
//!                               after lock.wait_timeout (lock.on_timeout)
//!
//! lock.on_timeout = "origin" ─▶ fetch alone, store nothing (BYPASS); the waiters of one key
//!      that give up in this process while such a fetch runs share it (a flight of their
//!      own, `lone`): one at a time per key per instance, not one per waiter.
//! ```
//!
//! What the requests report: the one whose fetch it was answers `MISS`; every request a
//! fill answered without a fetch of its own — a follower of the in-process flight, a
//! waiter on another instance's lock that read what it stored, and that waiter's own
//! followers — answers `HIT-COALESCED` (`Outcome::Coalesced`); a waiter that gave up and
//! fetched (`lock.on_timeout`) answers `BYPASS`.
//!
//! Stale-while-revalidate and early refreshes use the same path in the background.
//! Waiting is event-driven: the only timers are the holder's lease end and the wait
//! timeout. Nothing polls.
//!
//! On a route with `version`, every fetch that serves an origin answer knows the key's
//! version floor before it starts (the higher of this process's, [`LocalMarks`]-kept, and
//! Redis's: read in the lock's or the lock-free fill's round trip, or with one `GET` for a
//! fetch that takes neither), and its answer reaches it (see `fetch.rs`); the fill script
//! checks it again as it stores. An answer an invalidation overtook during its fetch (the
//! store refused it: the generation changed, a tag was invalidated, or a newer version was
//! stored since) answers the request that fetched it, which began before, but not the
//! followers of its flight, which may have arrived after the write was answered: they
//! take the flight as abandoned and fill again, under the new floor.
//!
//! [`LocalMarks`]: crate::cache::marks::LocalMarks

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::Response;
use tokio::time::Instant;
use tracing::{debug, warn};

use super::access_log::{origin_waited, timing_origin};
use super::body::Body;
use super::fetch::{self, Classified, Failure, FillJob, SharedFailure};
use super::origin::Origin;
use super::respond;
use super::route::Route;
use crate::cache::tiers::{Cached, Tiers};
use crate::cache::version::Version;
use crate::cache::{CacheKey, Entry};
use crate::clock::now_ms;
use crate::config::{L1Policy, LockConfig, OnTimeout};
use crate::coord::events::EventKind;
use crate::coord::keyspace::route_shard;
use crate::coord::redis::{Unavailable, add_commands, count_commands};
use crate::coord::store::{FillOutcome, FloorCheck};
use crate::error::ProxyError;
use crate::metrics::{FillRefusal, LockEvent, Metrics, Outcome};
use crate::protect::flight::FlightKind;
use crate::protect::flight::fleet::{Claim, FillPermit, FleetLock, Wake};

/// The in-process flights of the read path: their failures carry a shareable copy of the
/// failed answer.
pub(crate) type Flights = crate::protect::flight::Flights<SharedFailure>;
type FlightResult = crate::protect::flight::FlightResult<SharedFailure>;
type Leader = crate::protect::flight::Leader<SharedFailure>;
type Role = crate::protect::flight::Role<SharedFailure>;
type Waited = crate::protect::flight::Waited<SharedFailure>;

/// How many times a follower joins a new flight after the leader failed or went away,
/// before it fetches for itself (still through the origin guard).
const MAX_FLIGHT_ATTEMPTS: usize = 3;

/// How a fill ended, for the requests that wait on it.
pub(crate) enum Fetched {
    /// Answer from this entry (stored, or found stored by another fill), with this outcome.
    Ready(Arc<Entry>, Outcome),
    /// On a route with `version`: a fetched answer that an invalidation overtook (see the
    /// module docs). It answers the request that fetched it (a miss), not the followers
    /// of its flight.
    Overtaken(Arc<Entry>),
    /// For this client only: not shareable.
    Uncacheable(Response<Body>),
    /// The origin's `304` to the leading client's own validators: its answer alone; for
    /// the requests waiting on the fill, it ended without an answer.
    NotModified(Response<Body>),
    /// The origin failed (or cacheguard answered an error itself).
    Failed(Failure),
    /// A background refresh found another instance already refreshing; nothing to answer.
    Skipped,
}

impl Fetched {
    /// The answer for the request that waited on this fill.
    fn respond(self, head: bool) -> (Response<Body>, Outcome) {
        match self {
            Fetched::Ready(entry, outcome) => respond::hit(&entry, outcome, head),
            Fetched::Overtaken(entry) => respond::hit(&entry, Outcome::Miss, head),
            Fetched::Uncacheable(response) | Fetched::NotModified(response) => {
                (response, Outcome::Bypass)
            }
            Fetched::Failed(failure) => (failure.response, failure.outcome),
            // Only background fills skip, and nobody awaits their answer.
            Fetched::Skipped => (
                respond::text(http::StatusCode::SERVICE_UNAVAILABLE, "cacheguard: retry\n"),
                Outcome::Error,
            ),
        }
    }
}

/// Fills misses: the in-process flights, the fleet lock and the origin, and the store.
#[derive(Debug)]
pub(crate) struct Filler {
    pub(crate) tiers: Arc<Tiers>,
    /// In-process single-flight (shared with the hot-key gate, which joins running fills).
    pub(crate) flights: Arc<Flights>,
    /// The fetches that store nothing, of waiters that gave up (`lock.on_timeout =
    /// "origin"`): the ones of one key share one (see [`Filler::fetch_alone_together`]).
    pub(crate) lone: Arc<Flights>,
    /// The fleet-wide fill lock; `None` in embedded mode.
    pub(crate) fleet: Option<FleetLock>,
    /// Reloadable (see `reload.rs`).
    pub(crate) lock: ArcSwap<LockConfig>,
    /// Keys whose last answer was not shareable (hit-for-miss), for a short time.
    pub(crate) uncacheable: moka::sync::Cache<u128, ()>,
    /// Keys whose background refresh just failed: not retried for a moment, so a failing
    /// origin is not hit once per stale-served request.
    pub(crate) refresh_backoff: moka::sync::Cache<u128, ()>,
    pub(crate) origin: Arc<Origin>,
    pub(crate) metrics: Metrics,
}

impl Filler {
    /// Whether a fill of `hash` that requests wait on runs in this process: its leader
    /// found nothing usable, so a request arriving now can join it without looking.
    pub(crate) fn in_progress(&self, hash: u128) -> bool {
        self.flights.foreground_in_progress(hash)
    }

    /// A miss: one fill per key in this process, shared with every concurrent miss.
    pub(crate) async fn fill(
        self: &Arc<Self>,
        mut job: FillJob,
        head: bool,
    ) -> (Response<Body>, Outcome) {
        if self.uncacheable.contains_key(&job.key.hash) {
            // Hit-for-miss: the last answer for this key was not shareable, so nobody waits
            // on anybody; each request fetches for itself.
            return self.fetch_and_store(&job).await.respond(head);
        }
        let mut counted = false;
        // A follower waits lock.wait_timeout at most, whatever its leader waits on (the
        // origin, another instance's fill), over all its rounds.
        let deadline = Instant::now() + self.lock.load().wait_timeout;
        for _ in 0..MAX_FLIGHT_ATTEMPTS {
            match self
                .flights
                .join(job.key.hash, job.key.base, FlightKind::Foreground)
            {
                Role::Leader(leader) => {
                    // The fill runs in its own task: if this client hangs up, the fetch its
                    // followers (here and on other instances) wait on still completes.
                    let this = Arc::clone(self);
                    let task_job = job.clone();
                    let task = tokio::spawn(count_commands(timing_origin(async move {
                        this.lead(task_job, leader, true).await
                    })));
                    return match task.await {
                        Ok(((fetched, origin), commands)) => {
                            // The fill's commands and origin time are this request's.
                            add_commands(commands);
                            if let Some(waited) = origin {
                                origin_waited(waited);
                            }
                            if let Fetched::NotModified(_) = fetched {
                                // The origin confirmed this client's copy, and the key is
                                // still not stored: one whole fetch in the background
                                // fills it for the requests after it.
                                self.refresh_in_background(job.without_validators(), false);
                            }
                            fetched.respond(head)
                        }
                        Err(_) => (respond::error(&ProxyError::Internal), Outcome::Error),
                    };
                }
                Role::Follower(follower) => {
                    // Only the request that leads at its first join sends its validators:
                    // a follower may lead the next round, whose answer is shared.
                    job.validators.clear();
                    if !counted {
                        job.route.metrics.coalesced.inc();
                        counted = true;
                    }
                    let result = match follower.wait(deadline).await {
                        Waited::Done(result) => result,
                        Waited::TimedOut { first } => {
                            return self.follower_timed_out(&job, first).await.respond(head);
                        }
                    };
                    match result {
                        // The leader's answer, unless its `Vary` selected it for other
                        // request headers than this one's: then this request goes round
                        // again (and fills in turn).
                        FlightResult::Filled(entry, tier)
                            if entry.matches(&job.key) && entry.selects(&job.headers) =>
                        {
                            return respond::hit(&entry, tier, head);
                        }
                        FlightResult::Uncacheable => {
                            // Not shareable: each request fetches for itself, lock-free.
                            return self.fetch_and_store(&job).await.respond(head);
                        }
                        // The leader's failure is every follower's answer: a failing origin
                        // is asked once per failure, not once more per waiter.
                        FlightResult::Failed(Some(failure)) => {
                            return (failure.response(), failure.outcome);
                        }
                        // A failure with no copy to share (a streamed body): one of the
                        // followers becomes the new leader and tries once more.
                        FlightResult::Failed(None) => {}
                        FlightResult::Filled(..) | FlightResult::Abandoned => {}
                    }
                }
            }
        }
        // Out of attempts: fill without the in-process flight, but still under the fleet
        // lock.
        self.fill_unflighted(&job, false).await.respond(head)
    }

    /// XFetch: a fresh entry is refreshed early, in the background, by one request when
    /// its remaining life is short (or whenever the hot-key gate `chose` it).
    pub(crate) fn refresh_early(
        self: &Arc<Self>,
        route: &Route,
        entry: &Entry,
        chose: bool,
        job: impl FnOnce() -> FillJob,
    ) {
        let beta = route.config.early_refresh_beta;
        if beta > 0.0
            && (chose || entry.should_refresh_early(now_ms(), beta, rand::random::<f64>()))
            && self.refresh_in_background(job(), true)
        {
            route.metrics.early_refreshes.inc();
        }
    }

    /// Starts a refresh of `job`'s key in the background unless one is already running in
    /// this process. `early` refreshes an entry that is still fresh. Returns whether a
    /// refresh was started.
    pub(crate) fn refresh_in_background(self: &Arc<Self>, mut job: FillJob, early: bool) -> bool {
        if self.refresh_backoff.contains_key(&job.key.hash) {
            return false;
        }
        let joined = self
            .flights
            .join(job.key.hash, job.key.base, FlightKind::Background);
        let Role::Leader(leader) = joined else {
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

    /// A follower of this process's fill of a key waited `lock.wait_timeout`: counted as a
    /// wait on another instance's fill is, logged once per flight, and answered per
    /// `lock.on_timeout`.
    async fn follower_timed_out(&self, job: &FillJob, first: bool) -> Fetched {
        self.metrics.lock_event(LockEvent::WaitTimeout);
        if first {
            let lock = self.lock.load();
            warn!(
                message = "Requests waited lock.wait_timeout for this instance's fill of a key; answering them per lock.on_timeout.",
                route = %job.route.config.name,
                wait_timeout = ?lock.wait_timeout,
                on_timeout = ?lock.on_timeout,
            );
        }
        self.unwaited(job).await
    }

    /// How long a waiter that gave up waits for a lone fetch it shares: as long as that
    /// fetch can take (the guard's queue and the origin timeout), plus a margin.
    fn lone_wait_limit(&self) -> Duration {
        self.origin.guard.load().queue_timeout()
            + self.origin.upstream.load().timeout
            + Duration::from_secs(1)
    }

    /// Runs the fill for a key this process leads, and publishes the result to the local
    /// followers. `recheck` looks for a fresh entry first (off for early refreshes, whose
    /// entry is fresh by design).
    ///
    /// A cold miss (nothing stored) with Redis in use looks only in L1 here: the lock
    /// script looks in Redis as it locks (`or_entry`), one command instead of two.
    pub(crate) async fn lead(&self, job: FillJob, leader: Leader, recheck: bool) -> Fetched {
        let locks_look = recheck
            && job.stored.is_none()
            && self.fleet.as_ref().is_some_and(|f| f.is_available());
        if recheck {
            let l1 = job.route.config.l1;
            let needs_bus = job.route.config.l1_needs_bus();
            let found = if locks_look {
                self.tiers
                    .fresh_in_l1(&job.key, l1, needs_bus, &job.headers)
                    .await
                    .map(|entry| (entry, Outcome::HitL1))
            } else if let Cached::Fresh(entry, tier) = self
                .tiers
                .lookup(&job.key, l1, needs_bus, false, &job.headers)
                .await
            {
                Some((entry, tier))
            } else {
                None
            };
            if let Some((entry, tier)) = found {
                leader.finish(FlightResult::Filled(Arc::clone(&entry), tier));
                return Fetched::Ready(entry, tier);
            }
        }
        let fetched = self.fill_unflighted(&job, locks_look).await;
        leader.finish(match &fetched {
            // A copy found in Redis as the lock was asked for is a hit for the followers
            // too, one fetched alone (stored nowhere) their bypass; anything else (this
            // leader's fetch, or another instance's fill it waited on) answers them without
            // a fetch of their own: coalesced.
            Fetched::Ready(entry, tier @ (Outcome::HitL1 | Outcome::HitL2 | Outcome::Bypass)) => {
                FlightResult::Filled(Arc::clone(entry), *tier)
            }
            Fetched::Ready(entry, _) => FlightResult::Filled(Arc::clone(entry), Outcome::Coalesced),
            Fetched::Uncacheable(_) => FlightResult::Uncacheable,
            Fetched::Failed(failure) => FlightResult::Failed(failure.shared.clone()),
            // The followers need a whole answer, or this one is not theirs (they fill again,
            // under the floor the invalidation set): one of them leads next.
            Fetched::Overtaken(_) | Fetched::Skipped | Fetched::NotModified(_) => {
                FlightResult::Abandoned
            }
        });
        fetched
    }

    /// Fills without the in-process flight: under the fleet lock while Redis answers,
    /// otherwise on this process alone. `or_entry`: a fill that landed in Redis since the
    /// caller looked answers instead (see [`Filler::lead`]).
    pub(crate) async fn fill_unflighted(&self, job: &FillJob, or_entry: bool) -> Fetched {
        match &self.fleet {
            Some(fleet) if fleet.is_available() => self.fill_shared(job, fleet, or_entry).await,
            _ => self.fetch_and_store(job).await,
        }
    }

    /// The fleet-wide fill: claim the key's lock and fetch, or wait for whoever holds it.
    async fn fill_shared(&self, job: &FillJob, fleet: &FleetLock, or_entry: bool) -> Fetched {
        let started = Instant::now();
        let deadline = started + self.lock.load().wait_timeout;
        let mut contended = false;
        let mut or_entry = or_entry;
        loop {
            let max_waiters = self.lock.load().max_waiters;
            let claimed = fleet
                .claim(
                    job.key.base,
                    job.key.hash,
                    max_waiters,
                    or_entry,
                    floor_check(job),
                )
                .await;
            or_entry = false;
            let mut follower = match claimed {
                Ok(Claim::Present) => {
                    // Filled since the caller looked; read it, or (a copy that does not
                    // answer this request) claim the lock after all.
                    if let Some(entry) = self.fresh_in_l2(job).await {
                        return Fetched::Ready(entry, Outcome::HitL2);
                    }
                    continue;
                }
                // Redis went away under us: degrade to this process's single-flight.
                Err(Unavailable::Down) => return self.fetch_and_store(job).await,
                // The key's cluster slot is being migrated: no script of its keys runs
                // until it ends (the unlocked fill's neither), so fill as without Redis.
                Err(Unavailable::Migrating) => return self.fetch_and_keep(job, None).await,
                Ok(Claim::Leader(permit)) => {
                    if contended {
                        fleet.count(LockEvent::Takeover);
                        self.metrics
                            .lock_wait
                            .observe(started.elapsed().as_secs_f64());
                        debug!(message = "Lock taken over after waiting.", route = %job.route.config.name);
                        // Waited on another holder (perhaps one whose validators the origin
                        // answered 304): the waiters of the fleet need a whole answer.
                        if !job.validators.is_empty() {
                            return self
                                .fetch_as_owner(&job.without_validators(), *permit)
                                .await;
                        }
                    } else {
                        fleet.count(LockEvent::Acquired);
                    }
                    return self.fetch_as_owner(job, *permit).await;
                }
                Ok(Claim::Follower(follower)) => follower,
                Ok(Claim::Full) if job.background => return Fetched::Skipped,
                Ok(Claim::Full) => {
                    self.metrics.lock_event(LockEvent::WaitersFull);
                    return self.unwaited(job).await;
                }
            };
            if job.background {
                // Another instance is refreshing this key already.
                return Fetched::Skipped;
            }
            if !contended {
                contended = true;
                fleet.count(LockEvent::Contended);
            }
            // The follower is registered already: a fill that lands between this look and
            // the wait still wakes it. What the holder stored answers this request without
            // a fetch of its own: coalesced, as a follower of this process's flight is.
            if let Some(entry) = self.fresh_in_l2(job).await {
                self.metrics
                    .lock_wait
                    .observe(started.elapsed().as_secs_f64());
                return Fetched::Ready(entry, Outcome::Coalesced);
            }
            if Instant::now() >= deadline {
                return self.lock_wait_timed_out(job, started).await;
            }
            match follower.wait(deadline).await {
                Wake::Uncacheable => {
                    self.metrics
                        .lock_wait
                        .observe(started.elapsed().as_secs_f64());
                    self.remember_uncacheable(&job.key);
                    return self.fetch_alone(job).await;
                }
                Wake::Filled => {
                    if let Some(entry) = self.fresh_in_l2(job).await {
                        self.metrics
                            .lock_wait
                            .observe(started.elapsed().as_secs_f64());
                        return Fetched::Ready(entry, Outcome::Coalesced);
                    }
                }
                Wake::Failed => {
                    if let Some(failure) = fleet
                        .failure(job.key.base, job.key.hash)
                        .await
                        .and_then(|bytes| SharedFailure::decode_from_fleet(&bytes))
                    {
                        self.metrics
                            .lock_wait
                            .observe(started.elapsed().as_secs_f64());
                        return Fetched::Failed(Failure {
                            response: failure.response(),
                            outcome: failure.outcome,
                            shared: Some(Arc::new(failure)),
                        });
                    }
                }
                Wake::Contend => {}
            }
        }
    }

    async fn lock_wait_timed_out(&self, job: &FillJob, started: Instant) -> Fetched {
        let lock = self.lock.load_full();
        self.metrics.lock_event(LockEvent::WaitTimeout);
        self.metrics
            .lock_wait
            .observe(started.elapsed().as_secs_f64());
        warn!(
            message = "Waited lock.wait_timeout for another instance's fill.",
            route = %job.route.config.name,
            on_timeout = ?lock.on_timeout,
        );
        self.unwaited(job).await
    }

    /// A miss this request does not wait on any longer (its wait timed out, or too many
    /// keys are waited on): `lock.on_timeout` says what to do.
    async fn unwaited(&self, job: &FillJob) -> Fetched {
        let lock = self.lock.load_full();
        match lock.on_timeout {
            OnTimeout::Origin => self.fetch_alone_together(job).await,
            OnTimeout::Error => {
                Fetched::Failed(Failure::own(&ProxyError::LockWait(lock.wait_timeout)))
            }
        }
    }

    /// The lock holder's fetch: the lease is renewed while the origin works, then one
    /// script stores (if the generation is unchanged), releases and publishes. On a route
    /// with `version`, the answer reaches the floor read with the lock.
    async fn fetch_as_owner(&self, job: &FillJob, mut permit: FillPermit) -> Fetched {
        if list_in_route(job, &mut permit).await.is_err() {
            // Not listed, so a pattern purge could miss what it would store: store nothing
            // in Redis, and let the waiters take over.
            permit.release(EventKind::Released).await;
            return self.fetch_and_keep(job, None).await;
        }
        let since = self.tiers.since();
        let floor = self.floor_with(job, permit.floor());
        let (classified, version) = permit
            .hold_while(fetch::from_origin(&self.origin, job, floor), &self.metrics)
            .await;
        match classified {
            Classified::Storable(entry, outcome, reservation) => {
                let entry = Arc::new(entry);
                let kept = self.store(job, &entry, Some(permit), since, version).await;
                ready(kept, fetch::served(entry, reservation), outcome)
            }
            Classified::Uncacheable(response) => {
                permit.release(EventKind::Uncacheable).await;
                self.remember_uncacheable(&job.key);
                Fetched::Uncacheable(response)
            }
            Classified::NotModified(response) => {
                // The waiters on other instances contend again; one of them fetches.
                permit.release(EventKind::Released).await;
                Fetched::NotModified(response)
            }
            Classified::Failed(failure) => {
                // The waiters answer with a copy of the failure; without one, one of them
                // takes over and the others keep waiting on it.
                match failure.shared.as_ref().and_then(|f| f.encode_for_fleet()) {
                    Some(encoded) => permit.release_failed(&encoded).await,
                    None => permit.release(EventKind::Released).await,
                }
                Fetched::Failed(failure)
            }
        }
    }

    /// A fill without the fleet lock (embedded mode, Redis or the bus down, hit-for-miss
    /// keys): fetch, then store generation-checked when Redis is there.
    pub(crate) async fn fetch_and_store(&self, job: &FillJob) -> Fetched {
        // The generation (and version floor) is read before the fetch, like a lock
        // holder's.
        let mut unlocked = match &self.fleet {
            Some(fleet) => fleet
                .unlocked(job.key.base, job.key.hash, floor_check(job))
                .await
                .ok(),
            None => None,
        };
        if let Some(permit) = unlocked.as_mut()
            && list_in_route(job, permit).await.is_err()
        {
            // Not listed: a pattern purge could miss it, so it is kept out of Redis.
            unlocked = None;
        }
        self.fetch_and_keep(job, unlocked).await
    }

    /// Fetches, then stores through `unlocked` (generation-checked) or, without it, keeps
    /// the answer in L1 only (see [`Filler::store`]). Without `unlocked`, the version
    /// floor is the one this process knows.
    async fn fetch_and_keep(&self, job: &FillJob, unlocked: Option<FillPermit>) -> Fetched {
        let since = self.tiers.since();
        let floor = self.floor_with(job, unlocked.as_ref().and_then(FillPermit::floor));
        let (classified, version) = fetch::from_origin(&self.origin, job, floor).await;
        match classified {
            Classified::Storable(entry, outcome, reservation) => {
                let entry = Arc::new(entry);
                let kept = self.store(job, &entry, unlocked, since, version).await;
                ready(kept, fetch::served(entry, reservation), outcome)
            }
            Classified::Uncacheable(response) => {
                self.remember_uncacheable(&job.key);
                Fetched::Uncacheable(response)
            }
            Classified::NotModified(response) => Fetched::NotModified(response),
            Classified::Failed(failure) => Fetched::Failed(failure),
        }
    }

    /// A variant beyond its path's budget, asked for the first time: fetched for this
    /// request alone (through the origin guard, as every fetch), stored nowhere, answered
    /// `BYPASS`. Nobody waits on it, so it runs in the request's task.
    pub(crate) async fn fetch_uncached(
        &self,
        job: &FillJob,
        head: bool,
    ) -> (Response<Body>, Outcome) {
        self.fetch_alone(job).await.respond(head)
    }

    /// A fetch that stores nothing, for waiters that gave up on the key's fill
    /// (`lock.on_timeout = "origin"`). The ones of one key in this process share it: a
    /// flight of its own beside the key's fill (which still runs), so a hundred waiters
    /// giving up at once make one more origin request, not a hundred, as one instance's
    /// waiters on another instance's lock make one. Its answer is theirs, BYPASS. An
    /// answer that cannot be shared, or a leader that went away, leaves each to fetch
    /// alone (through the origin guard).
    async fn fetch_alone_together(&self, job: &FillJob) -> Fetched {
        let deadline = Instant::now() + self.lone_wait_limit();
        for _ in 0..MAX_FLIGHT_ATTEMPTS {
            let joined = self
                .lone
                .join(job.key.hash, job.key.base, FlightKind::Foreground);
            let follower = match joined {
                Role::Leader(leader) => {
                    let fetched = self.fetch_alone(job).await;
                    leader.finish(match &fetched {
                        Fetched::Ready(entry, outcome) => {
                            FlightResult::Filled(Arc::clone(entry), *outcome)
                        }
                        Fetched::Uncacheable(_) => FlightResult::Uncacheable,
                        Fetched::Failed(failure) => FlightResult::Failed(failure.shared.clone()),
                        Fetched::Overtaken(_) | Fetched::Skipped | Fetched::NotModified(_) => {
                            FlightResult::Abandoned
                        }
                    });
                    return fetched;
                }
                Role::Follower(follower) => follower,
            };
            match follower.wait(deadline).await {
                Waited::Done(FlightResult::Filled(entry, outcome))
                    if entry.matches(&job.key) && entry.selects(&job.headers) =>
                {
                    return Fetched::Ready(entry, outcome);
                }
                Waited::Done(FlightResult::Failed(Some(failure))) => {
                    return Fetched::Failed(Failure {
                        response: failure.response(),
                        outcome: failure.outcome,
                        shared: Some(failure),
                    });
                }
                Waited::Done(FlightResult::Uncacheable) | Waited::TimedOut { .. } => break,
                // Gone without an answer for this request: one of them leads next.
                Waited::Done(
                    FlightResult::Filled(..) | FlightResult::Failed(None) | FlightResult::Abandoned,
                ) => {}
            }
        }
        self.fetch_alone(job).await
    }

    /// A fetch for one client that stores nothing: the lock holder is still at work (wait
    /// timeout), or the key's answer is not shareable. On a route with `version` it reads
    /// the floor first (one `GET` while Redis answers), as it takes no lease that would.
    async fn fetch_alone(&self, job: &FillJob) -> Fetched {
        let known = match &self.fleet {
            Some(fleet) if job.route.config.version.is_some() && fleet.is_available() => {
                fleet.floor(job.key.base).await.ok().flatten()
            }
            _ => None,
        };
        let floor = self.floor_with(job, known);
        match fetch::from_origin(&self.origin, job, floor).await.0 {
            Classified::Storable(entry, _, reservation) => {
                Fetched::Ready(fetch::served(Arc::new(entry), reservation), Outcome::Bypass)
            }
            Classified::Uncacheable(response) => Fetched::Uncacheable(response),
            Classified::NotModified(response) => Fetched::NotModified(response),
            Classified::Failed(failure) => Fetched::Failed(failure),
        }
    }

    /// Stores a fetched entry: its surrogate keys into their indexes (its route's index
    /// listed it before the fetch), then L2 through the fill script (when Redis is there), then L1
    /// when the route keeps it there. An answer an invalidation overtook — the key's
    /// generation changed, a tag of it was invalidated after the fetch began, a newer
    /// version was stored since, or a local mark says so — goes to the requests that asked
    /// for it, but is kept nowhere; on a route with `version`, only to the one that
    /// fetched it ([`Kept::Own`]). `version` is the answer's (a route with `version`).
    async fn store(
        &self,
        job: &FillJob,
        entry: &Arc<Entry>,
        permit: Option<FillPermit>,
        since: u64,
        version: Option<Version>,
    ) -> Kept {
        let mut keep = true;
        let mut overtaken = false;
        let mut stored = false;
        // Filled without Redis (no lease: the breaker was open): L1 is the only copy,
        // whatever the breaker says by now.
        let in_l1 = permit.is_none() && self.tiers.shared() && job.route.config.l1 != L1Policy::Off;
        if let Some(mut permit) = permit {
            let life = Duration::from_millis(entry.remaining_life_ms(now_ms()));
            let outcome = match index_tags(job, entry, &mut permit, life).await {
                Ok(true) => {
                    // A tag was invalidated after the fetch began: waiters take over.
                    permit.release(EventKind::Released).await;
                    Ok(FillOutcome::GenerationChanged)
                }
                Err(e) => Err(e),
                Ok(false) => match permit.large_value_turn(entry.body_len()).await {
                    Ok(_turn) => match entry.encode() {
                        Ok(bytes) => {
                            let version = version.map(Version::to_arg);
                            permit.fill(&bytes, life, version.as_deref()).await
                        }
                        Err(_) => Ok(FillOutcome::Stored),
                    },
                    Err(e) => Err(e),
                },
            };
            match outcome {
                Ok(FillOutcome::Stored) => stored = true,
                Err(_) => {}
                Ok(FillOutcome::GenerationChanged) => {
                    self.metrics.fill_refused(FillRefusal::Generation);
                    keep = false;
                    overtaken = true;
                }
                Ok(FillOutcome::LockTaken) => {
                    self.metrics.fill_refused(FillRefusal::LockTaken);
                }
                Ok(FillOutcome::Quarantined) => {
                    self.metrics.fill_refused(FillRefusal::Quarantine);
                    keep = false;
                }
                Ok(FillOutcome::OlderVersion) => {
                    job.route.metrics.refused_older.inc();
                    keep = false;
                    overtaken = true;
                }
            }
        } else if job.route.config.version.is_some() {
            // No script to say so: the local marks do (this process's writes and the
            // invalidations it heard of).
            overtaken = self.tiers.invalidated_since(&job.key, &entry.tags, since);
        }
        if keep && (in_l1 || self.tiers.keeps_in_l1(job.route.config.l1, job.key.hash)) {
            stored |= self.tiers.keep(&job.key, Arc::clone(entry), since).await;
        }
        if stored {
            // A URL's key stored with a `Vary` selection: the next request of another
            // variant goes to its own variant key.
            self.tiers.learn_vary(&job.key, entry);
            if job.key.is_selected() && job.stored.is_none() && !job.background {
                job.route.metrics.vary_variants_stored.inc();
            }
        }
        if overtaken && job.route.config.version.is_some() {
            Kept::Own
        } else {
            Kept::Shared
        }
    }

    /// The version floor a fetch of `job` must reach: on a route with `version`, the
    /// higher of the one this process knows and `known` (read in Redis before the fetch).
    fn floor_with(&self, job: &FillJob, known: Option<u128>) -> Option<u128> {
        job.route.config.version.as_ref()?;
        self.tiers.floor(job.key.base).max(known)
    }

    async fn fresh_in_l2(&self, job: &FillJob) -> Option<Arc<Entry>> {
        self.tiers
            .fresh_in_l2(&job.key, job.route.config.l1, &job.headers)
            .await
    }

    /// Hit-for-miss: remember for a while that this key's answer is not shareable, so
    /// later requests neither wait on each other nor on a lock.
    fn remember_uncacheable(&self, key: &CacheKey) {
        self.uncacheable.insert(key.hash, ());
    }
}

/// Whom a fetched answer may answer, once stored (see [`Filler::store`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kept {
    /// Every request that waited on its fill.
    Shared,
    /// Only the request that fetched it: an invalidation overtook it (a route with
    /// `version`).
    Own,
}

/// A fetched answer's [`Fetched`], by whom it may answer.
fn ready(kept: Kept, entry: Arc<Entry>, outcome: Outcome) -> Fetched {
    match kept {
        Kept::Shared => Fetched::Ready(entry, outcome),
        Kept::Own => Fetched::Overtaken(entry),
    }
}

/// Whether `job`'s fill reads and keeps the key's version floor: its route has `version`.
fn floor_check(job: &FillJob) -> FloorCheck {
    if job.route.config.version.is_some() {
        FloorCheck::On
    } else {
        FloorCheck::Off
    }
}

/// The member that lists `job`'s base key in an index: `<base hex> <path>`.
fn index_member(job: &FillJob) -> String {
    format!("{:032x} {}", job.key.base, job.key.path())
}

/// The longest an entry of `route` can live in Redis: its longest ttl (the larger of `ttl`
/// and `negative_ttl`, jittered up; an origin's own lifetime is capped by `ttl`) plus its
/// `grace` (which bounds the stale windows and the time a copy is kept for revalidation).
fn longest_life(route: &crate::config::RouteConfig) -> Duration {
    let ttl = route.ttl.max(route.negative_ttl).as_secs_f64() * (1.0 + route.jitter);
    Duration::try_from_secs_f64(ttl)
        .unwrap_or(Duration::MAX)
        .saturating_add(route.grace)
}

/// Lists `job`'s base key in its route's index (what a pattern purge searches) before the
/// fetch starts, until the latest its entry can expire: now, plus the longest a fill can
/// take, plus the longest an entry of the route lives (see `RedisStore::route_add`).
async fn list_in_route(job: &FillJob, permit: &mut FillPermit) -> Result<(), Unavailable> {
    let until = now_ms()
        .saturating_add(millis(permit.longest_fill()))
        .saturating_add(millis(longest_life(&job.route.config)));
    let tag = route_tag(&job.route.config.name);
    let base = job.key.base;
    permit
        .route_add(&tag, route_shard(base), base, &index_member(job), until)
        .await
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Lists the entry's base key under each surrogate key before the fill stores it, and in
/// its route's index again if it would outlive its listing there (never with the route's
/// own lifetimes). `Ok(true)`: one of its tags was invalidated after the fetch began, so
/// the answer may predate it and must not be stored.
async fn index_tags(
    job: &FillJob,
    entry: &Entry,
    permit: &mut FillPermit,
    life: Duration,
) -> Result<bool, Unavailable> {
    let member = index_member(job);
    let expiry = now_ms().saturating_add(millis(life));
    if permit.listed_until().is_none_or(|until| until < expiry) {
        let tag = route_tag(&job.route.config.name);
        let base = job.key.base;
        permit
            .route_add(&tag, route_shard(base), base, &member, expiry)
            .await?;
    }
    let checks = entry
        .tags
        .iter()
        .map(|tag| permit.tag_add(tag, &member, life));
    let mut overtaken = false;
    for check in futures_util::future::join_all(checks).await {
        overtaken |= check?;
    }
    Ok(overtaken)
}

/// The implicit tag every entry of a route carries: its index is what a pattern purge
/// searches. A space cannot occur in a tag read from a header, so it never collides.
pub(crate) fn route_tag(route: &str) -> String {
    format!("route {route}")
}
