//! Filling a miss: the in-process leader of a key fetches once for the whole fleet.
//!
//! ```text
//! lead ─▶ re-check L1/L2 (a fill that just finished has stored already)
//!      ─▶ Redis and the event bus usable?
//!           no  ─▶ fetch_and_store: fetch, store (generation-checked), L1
//!           yes ─▶ acquire the key's lock
//!                   won  ─▶ fetch_as_owner: fetch while renewing the lease every lease/3,
//!                           then FILL (store if generation unchanged + release + publish)
//!                   held ─▶ wait for the key's event (fill / released / uncacheable) or the
//!                           end of the holder's lease, whichever comes first; then read L2,
//!                           or take the lock over, or fetch alone; give up after
//!                           lock.wait_timeout (lock.on_timeout)
//! ```
//!
//! Waiting is event-driven: the only timers are the holder's lease end (its owner may
//! have died; one waiter takes over) and the wait timeout. Nothing polls.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, warn};

use super::Proxy;
use super::fetch::{Classified, Failure, FillJob};
use super::read::Fetched;
use crate::cache::l2::Lookup;
use crate::cache::{Entry, Freshness, now_ms};
use crate::config::{L1Policy, OnTimeout};
use crate::coord::events::EventKind;
use crate::coord::redis::Unavailable;
use crate::coord::store::FillOutcome;
use crate::error::ProxyError;
use crate::metrics::{FillRefusal, LockEvent, Outcome};
use crate::protect::flight::fleet::{Claim, FillPermit, FleetLock, Wake};
use crate::protect::flight::{FlightResult, Leader};

impl Proxy {
    /// Runs the fill for a key this process leads, and publishes the result to the local
    /// followers. `recheck` looks for a fresh entry first (off for early refreshes, whose
    /// entry is fresh by design).
    pub(crate) async fn lead(&self, job: FillJob, leader: Leader, recheck: bool) -> Fetched {
        if recheck
            && let Some(found) = self.lookup(&job.route, &job.key).await
            && found.freshness == Freshness::Fresh
        {
            leader.finish(FlightResult::Filled(Arc::clone(&found.entry), found.tier));
            return Fetched::Ready(found.entry, found.tier);
        }
        let fetched = self.fill_unflighted(&job).await;
        leader.finish(match &fetched {
            Fetched::Ready(entry, _) => FlightResult::Filled(Arc::clone(entry), Outcome::Miss),
            Fetched::Uncacheable(_) => FlightResult::Uncacheable,
            Fetched::Failed(failure) => FlightResult::Failed(failure.shared.clone()),
            Fetched::Skipped => FlightResult::Abandoned,
        });
        fetched
    }

    /// Fills without the in-process flight: under the fleet lock while Redis answers,
    /// otherwise on this process alone.
    pub(crate) async fn fill_unflighted(&self, job: &FillJob) -> Fetched {
        match &self.fleet {
            Some(fleet) if fleet.is_available() => self.fill_shared(job, fleet).await,
            _ => self.fetch_and_store(job).await,
        }
    }

    /// The fleet-wide fill: claim the key's lock and fetch, or wait for whoever holds it.
    async fn fill_shared(&self, job: &FillJob, fleet: &FleetLock) -> Fetched {
        let started = Instant::now();
        let deadline = started + self.lock.load().wait_timeout;
        let mut contended = false;
        loop {
            let mut follower = match fleet.claim(job.key.base, job.key.hash).await {
                // Redis went away under us: degrade to this process's single-flight.
                Err(_) => return self.fetch_and_store(job).await,
                Ok(Claim::Leader(permit)) => {
                    if contended {
                        fleet.count(LockEvent::Takeover);
                        self.metrics
                            .lock_wait
                            .observe(started.elapsed().as_secs_f64());
                        debug!(message = "Lock taken over after waiting.", route = %job.route.config.name);
                    } else {
                        fleet.count(LockEvent::Acquired);
                    }
                    return self.fetch_as_owner(job, *permit).await;
                }
                Ok(Claim::Follower(follower)) => follower,
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
            // the wait still wakes it.
            if let Some(entry) = self.fresh_in_l2(job).await {
                self.metrics
                    .lock_wait
                    .observe(started.elapsed().as_secs_f64());
                return Fetched::Ready(entry, Outcome::Miss);
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
                        return Fetched::Ready(entry, Outcome::Miss);
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
        match lock.on_timeout {
            OnTimeout::Origin => self.fetch_alone(job).await,
            OnTimeout::Error => {
                Fetched::Failed(Failure::own(&ProxyError::LockWait(lock.wait_timeout)))
            }
        }
    }

    /// The lock holder's fetch: the lease is renewed while the origin works, then one
    /// script stores (if the generation is unchanged), releases and publishes.
    async fn fetch_as_owner(&self, job: &FillJob, permit: FillPermit) -> Fetched {
        let since = self.invalidator.marks.snapshot();
        let classified = permit
            .hold_while(self.fetch_origin(job), &self.metrics)
            .await;
        match classified {
            Classified::Storable(entry) => {
                let entry = Arc::new(entry);
                self.store(job, &entry, Some(permit), since).await;
                Fetched::Ready(entry, Outcome::Miss)
            }
            Classified::Uncacheable(response) => {
                permit.release(EventKind::Uncacheable).await;
                self.remember_uncacheable(&job.key);
                Fetched::Uncacheable(response)
            }
            Classified::Failed(failure) => {
                // One waiter takes over; the others keep waiting on it.
                permit.release(EventKind::Released).await;
                Fetched::Failed(failure)
            }
        }
    }

    /// A fill without the fleet lock (embedded mode, Redis or the bus down, hit-for-miss
    /// keys): fetch, then store generation-checked when Redis is there.
    pub(crate) async fn fetch_and_store(&self, job: &FillJob) -> Fetched {
        // The generation is read before the fetch, like a lock holder's.
        let unlocked = match &self.fleet {
            Some(fleet) => fleet.unlocked(job.key.base, job.key.hash).await.ok(),
            None => None,
        };
        let since = self.invalidator.marks.snapshot();
        match self.fetch_origin(job).await {
            Classified::Storable(entry) => {
                let entry = Arc::new(entry);
                self.store(job, &entry, unlocked, since).await;
                Fetched::Ready(entry, Outcome::Miss)
            }
            Classified::Uncacheable(response) => {
                self.remember_uncacheable(&job.key);
                Fetched::Uncacheable(response)
            }
            Classified::Failed(failure) => Fetched::Failed(failure),
        }
    }

    /// A fetch for one client that stores nothing: the lock holder is still at work (wait
    /// timeout), or the key's answer is not shareable.
    async fn fetch_alone(&self, job: &FillJob) -> Fetched {
        match self.fetch_origin(job).await {
            Classified::Storable(entry) => Fetched::Ready(Arc::new(entry), Outcome::Bypass),
            Classified::Uncacheable(response) => Fetched::Uncacheable(response),
            Classified::Failed(failure) => Fetched::Failed(failure),
        }
    }

    /// Stores a fetched entry: its tags (the route's own and the origin's surrogate keys)
    /// into their indexes, then L2 through the fill script (when Redis is there), then L1
    /// when the route keeps it there. An answer an invalidation overtook — the key's
    /// generation changed, a tag of it was invalidated after the fetch began, or a local
    /// mark says so — goes to the requests that asked for it, but is kept nowhere.
    async fn store(
        &self,
        job: &FillJob,
        entry: &Arc<Entry>,
        permit: Option<FillPermit>,
        since: u64,
    ) {
        let mut keep = true;
        // Filled without Redis (no lease: the breaker was open): L1 is the only copy,
        // whatever the breaker says by now.
        let in_l1 = permit.is_none() && self.l2.is_some() && job.route.config.l1 != L1Policy::Off;
        if let Some(permit) = permit {
            let life = Duration::from_millis(entry.remaining_life_ms(now_ms()));
            let outcome = match index_tags(job, entry, &permit, life).await {
                Ok(true) => {
                    // A tag was invalidated after the fetch began: waiters take over.
                    permit.release(EventKind::Released).await;
                    Ok(FillOutcome::GenerationChanged)
                }
                Err(e) => Err(e),
                Ok(false) => match entry.encode() {
                    Ok(bytes) => permit.fill(&bytes, life).await,
                    Err(_) => Ok(FillOutcome::Stored),
                },
            };
            match outcome {
                Ok(FillOutcome::Stored) | Err(_) => {}
                Ok(FillOutcome::GenerationChanged) => {
                    self.metrics.fill_refused(FillRefusal::Generation);
                    keep = false;
                }
                Ok(FillOutcome::LockTaken) => {
                    self.metrics.fill_refused(FillRefusal::LockTaken);
                }
                Ok(FillOutcome::Quarantined) => {
                    self.metrics.fill_refused(FillRefusal::Quarantine);
                    keep = false;
                }
            }
        }
        if keep && (in_l1 || self.keeps_in_l1(&job.route, job.key.hash)) {
            self.put_l1(&job.key, Arc::clone(entry), since).await;
        }
    }

    async fn fresh_in_l2(&self, job: &FillJob) -> Option<Arc<Entry>> {
        let l2 = self.l2.as_ref()?;
        if self.invalidator.owes(job.key.base) {
            return None;
        }
        let since = self.invalidator.marks.snapshot();
        match l2.get(&job.key).await {
            Lookup::Hit(entry) if entry.freshness(now_ms()) == Freshness::Fresh => {
                if self.keeps_in_l1(&job.route, job.key.hash) {
                    self.put_l1(&job.key, Arc::clone(&entry), since).await;
                }
                Some(entry)
            }
            _ => None,
        }
    }

    /// Hit-for-miss: remember for a while that this key's answer is not shareable, so
    /// later requests neither wait on each other nor on a lock.
    fn remember_uncacheable(&self, key: &crate::cache::CacheKey) {
        self.uncacheable.insert(key.hash, ());
    }
}

/// Lists the entry's base key under the route's tag (for pattern purges) and under each
/// surrogate key, before the fill stores it. `Ok(true)`: one of its tags was invalidated
/// after the fetch began, so the answer may predate it and must not be stored.
async fn index_tags(
    job: &FillJob,
    entry: &Entry,
    permit: &FillPermit,
    life: Duration,
) -> Result<bool, Unavailable> {
    let member = format!("{:032x} {}", job.key.base, job.key.path());
    let route_tag = route_tag(&job.route.config.name);
    let tags = std::iter::once(route_tag.as_str()).chain(entry.tags.iter().map(String::as_str));
    let checks = tags.map(|tag| permit.tag_add(tag, &member, life));
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
