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
use crate::error::ProxyError;
use crate::metrics::{FillRefusal, LockEvent, Outcome};
use crate::protect::flight::{FlightResult, Leader};
use crate::protect::lock::{Acquired, DistLock, FillOutcome, Lease};

/// Slack after a holder's lease end before a waiter tries to take over, so the expiry has
/// really happened in Redis by then.
const LEASE_SLACK: Duration = Duration::from_millis(20);

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
        match &self.dist {
            Some(dist) if dist.is_available() => self.fill_shared(job, dist).await,
            _ => self.fetch_and_store(job).await,
        }
    }

    /// The fleet-wide fill: take the key's lock and fetch, or wait for whoever holds it.
    async fn fill_shared(&self, job: &FillJob, dist: &DistLock) -> Fetched {
        let started = Instant::now();
        let deadline = started + self.lock.load().wait_timeout;
        let mut contended = false;
        let metrics = &self.metrics;
        loop {
            let remaining = match dist.acquire(&job.key).await {
                // Redis went away under us: degrade to this process's single-flight.
                Err(_) => return self.fetch_and_store(job).await,
                Ok(Acquired::Won(lease)) => {
                    if contended {
                        metrics.lock_event(LockEvent::Takeover);
                        metrics.lock_wait.observe(started.elapsed().as_secs_f64());
                        debug!(message = "Lock taken over after waiting.", route = %job.route.config.name);
                    } else {
                        metrics.lock_event(LockEvent::Acquired);
                    }
                    return self.fetch_as_owner(job, dist, *lease).await;
                }
                Ok(Acquired::Held { remaining }) => remaining,
            };
            if job.background {
                // Another instance is refreshing this key already.
                return Fetched::Skipped;
            }
            if !contended {
                contended = true;
                metrics.lock_event(LockEvent::Contended);
            }
            // Register before looking at L2: a fill that lands between the look and the
            // wait still wakes us.
            let mut waiter = dist.waiters().register(job.key.hash);
            if let Some(entry) = self.fresh_in_l2(job).await {
                metrics.lock_wait.observe(started.elapsed().as_secs_f64());
                return Fetched::Ready(entry, Outcome::Miss);
            }
            let now = Instant::now();
            if now >= deadline {
                return self.lock_wait_timed_out(job, started).await;
            }
            let lease_end = now + remaining + LEASE_SLACK;
            tokio::select! {
                signal = waiter.changed() => match signal.kind {
                    Some(EventKind::Uncacheable) => {
                        metrics.lock_wait.observe(started.elapsed().as_secs_f64());
                        self.remember_uncacheable(&job.key);
                        return self.fetch_alone(job).await;
                    }
                    // A fill, or a reconnect after which events may have been missed.
                    Some(EventKind::Fill) | None => {
                        if let Some(entry) = self.fresh_in_l2(job).await {
                            metrics.lock_wait.observe(started.elapsed().as_secs_f64());
                            return Fetched::Ready(entry, Outcome::Miss);
                        }
                    }
                    // Released without a fill (or an invalidation, which voids the lease):
                    // contend for the lock again.
                    Some(EventKind::Released | EventKind::Invalidate | EventKind::Hot) => {}
                },
                // The holder's lease ended without news (its instance may have died):
                // try to take over; exactly one waiter wins the SET NX.
                () = tokio::time::sleep_until(lease_end.min(deadline)) => {}
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

    /// The lock holder's fetch: the lease is renewed every lease/3 while the origin works,
    /// then one script stores (if the generation is unchanged), releases and publishes.
    async fn fetch_as_owner(&self, job: &FillJob, dist: &DistLock, lease: Lease) -> Fetched {
        let since = self.invalidator.marks.snapshot();
        let fetch = self.fetch_origin(job);
        tokio::pin!(fetch);
        let period = (dist.lease / 3).max(Duration::from_millis(10));
        let mut renew = tokio::time::interval_at(Instant::now() + period, period);
        let classified = loop {
            tokio::select! {
                classified = &mut fetch => break classified,
                _ = renew.tick() => match dist.renew(&lease).await {
                    Ok(true) => self.metrics.lock_event(LockEvent::Renewed),
                    Ok(false) => {
                        self.metrics.lock_event(LockEvent::Lost);
                        warn!(message = "Lock lease lost during a fetch.", route = %job.route.config.name);
                    }
                    // Redis is down: the fill below will not reach it either; keep fetching.
                    Err(_) => {}
                },
            }
        };
        match classified {
            Classified::Storable(entry) => {
                let entry = Arc::new(entry);
                self.store(job, &entry, Some((dist, &lease)), since).await;
                Fetched::Ready(entry, Outcome::Miss)
            }
            Classified::Uncacheable(response) => {
                let _ = dist.release(&lease, EventKind::Uncacheable).await;
                self.remember_uncacheable(&job.key);
                Fetched::Uncacheable(response)
            }
            Classified::Failed(failure) => {
                // One waiter takes over; the others keep waiting on it.
                let _ = dist.release(&lease, EventKind::Released).await;
                Fetched::Failed(failure)
            }
        }
    }

    /// A fill without the fleet lock (embedded mode, Redis or the bus down, hit-for-miss
    /// keys): fetch, then store generation-checked when Redis is there.
    pub(crate) async fn fetch_and_store(&self, job: &FillJob) -> Fetched {
        // The generation is read before the fetch, like a lock holder's.
        let unlocked = match &self.dist {
            Some(dist) => dist.unlocked_lease(&job.key).await.ok().map(|l| (dist, l)),
            None => None,
        };
        let since = self.invalidator.marks.snapshot();
        match self.fetch_origin(job).await {
            Classified::Storable(entry) => {
                let entry = Arc::new(entry);
                self.store(job, &entry, unlocked.as_ref().map(|(d, l)| (*d, l)), since)
                    .await;
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
        l2: Option<(&DistLock, &Lease)>,
        since: u64,
    ) {
        let mut keep = true;
        // Filled without Redis (no lease: the breaker was open): L1 is the only copy,
        // whatever the breaker says by now.
        let in_l1 = l2.is_none() && self.l2.is_some() && job.route.config.l1 != L1Policy::Off;
        if let Some((dist, lease)) = l2 {
            let life = Duration::from_millis(entry.remaining_life_ms(now_ms()));
            let outcome = match self.index_tags(job, entry, dist, lease, life).await {
                Ok(true) => Ok(FillOutcome::GenerationChanged),
                Err(e) => Err(e),
                Ok(false) => match entry.encode() {
                    Ok(bytes) => dist.fill(lease, &bytes, life).await,
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

    /// Lists the entry's base key under the route's tag (for pattern purges) and under each
    /// surrogate key, before the fill stores it. `Ok(true)`: one of its tags was invalidated
    /// after the fetch began, so the answer may predate it — the lock is released (waiters
    /// take over) and nothing is stored.
    async fn index_tags(
        &self,
        job: &FillJob,
        entry: &Entry,
        dist: &DistLock,
        lease: &Lease,
        life: Duration,
    ) -> Result<bool, crate::coord::redis::Unavailable> {
        let member = format!("{:032x} {}", job.key.base, job.key.path());
        let route_tag = route_tag(&job.route.config.name);
        let tags = std::iter::once(route_tag.as_str()).chain(entry.tags.iter().map(String::as_str));
        let checks = tags.map(|tag| dist.tag_add(tag, &member, life, lease.started_ms));
        let mut overtaken = false;
        for check in futures_util::future::join_all(checks).await {
            overtaken |= check?;
        }
        if overtaken {
            let _ = dist.release(lease, EventKind::Released).await;
        }
        Ok(overtaken)
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

/// The implicit tag every entry of a route carries: its index is what a pattern purge
/// searches. A space cannot occur in a tag read from a header, so it never collides.
pub(crate) fn route_tag(route: &str) -> String {
    format!("route {route}")
}
