//! Serialized writes: on a route with `serialize`, a write to one resource is forwarded
//! only while this instance holds the resource's lock, fleet-wide, with at least a third of
//! the lease left, and the lease is renewed while the write is at the origin. The origin
//! gets the grant's fencing token (`fence_header`) and the resource (`Fencing-Key`), so it
//! can refuse a write older than one it already accepted: the lock keeps writes apart while
//! all is well, the token keeps the order when a holder outlives its lease.
//!
//! Waiting happens twice, within one `wait_timeout`:
//!
//! 1. in this instance, in arrival order: one FIFO semaphore (a single permit) per resource,
//!    so only the first write of a resource here contends for the fleet lock; beyond
//!    `max_waiters` waiting, a write is refused at once;
//! 2. for the fleet lock (`coord/locks.rs`), woken by the holder's release event or its
//!    lease end.
//!
//! A write that was answered while others of its resource wait here **passes the lock on**
//! to the next of them instead of releasing it: one round trip to the lock service gives a
//! fresh fencing token and a full lease (`LockService::pass_on`), where a release, its event
//! and the next acquire take three and a wake-up. So that the other instances are served
//! too, a lock is passed on only while this instance's *run* of writes has held it for less
//! than a third of the lease or a quarter of `wait_timeout`, the shorter. A run that ends
//! with writes still waiting here releases the lock, and the next write here asks for it
//! again only a moment later ([`Serializer::COURTESY`]), so that writes waiting in other
//! instances, woken by the release's event, take it first. Lock services that mint a token
//! only with a new grant (etcd, ZooKeeper, MySQL, Redlock) release and take again after
//! each write, as a run of one.
//!
//! Either wait that runs out is answered 503 with `Retry-After`. A client that hangs up
//! while waiting leaves the queue (its future, and with it its place, is dropped). A write
//! that got the lock is forwarded from a task of its own (`proxy/write.rs`): the lock is
//! held until the origin answers, whatever the client does. A write is never retried.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::config::SerializeConfig;
use crate::coord::keyspace::serialized_resource;
use crate::coord::locks::{AcquireError, Grant, LockService};
use crate::metrics::{SerializeMetrics, SerializeOutcome};

/// The serialized writes of this instance: the lock services and the local queues.
#[derive(Debug)]
pub(crate) struct Serializer {
    /// The shared Redis's locks (the process's own in embedded mode).
    default: Arc<LockService>,
    /// The `[locks.<name>]` services, by name.
    named: HashMap<String, Arc<LockService>>,
    queues: Mutex<HashMap<u128, Arc<Queue>>>,
}

/// The writes of one resource waiting in this instance.
#[derive(Debug)]
struct Queue {
    /// One permit: held by the write that contends for (then holds) the fleet lock.
    turn: Arc<Semaphore>,
    /// Writes waiting for `turn` or holding it.
    waiting: AtomicUsize,
    /// A lock passed on by the last holder, for whoever takes `turn` next; released by the
    /// queue's last write if nobody took it.
    handed: Mutex<Option<Handed>>,
    /// Whether `turn` is held by a write that was answered and is giving the lock back: a
    /// waiter whose wait runs out then was kept by the lock service not answering the
    /// release, not by another write, so it is refused as `Unavailable` (the route's
    /// `on_redis_error` applies) rather than as a timeout.
    releasing: AtomicBool,
}

impl Queue {
    /// Puts `handed` in the queue's slot (`None`: empties it); gives what was there.
    fn hand(&self, handed: Option<Handed>) -> Option<Handed> {
        std::mem::replace(
            &mut *self.handed.lock().unwrap_or_else(PoisonError::into_inner),
            handed,
        )
    }
}

/// A lock passed on, waiting in its queue for the next write.
#[derive(Debug)]
struct Handed {
    service: Arc<LockService>,
    grant: Grant,
    /// When this instance took the lock from the lock service, before passing it on.
    since: Instant,
}

/// Why a write was not serialized.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// `max_waiters` writes to the resource wait here already.
    TooMany,
    /// No turn within `wait_timeout`.
    Timeout,
    /// The lock service did not answer.
    Unavailable,
}

/// The lock on one resource, held for one write.
#[derive(Debug)]
pub(crate) struct Held {
    service: Arc<LockService>,
    grant: Grant,
    lease: Duration,
    /// When this instance took the lock from the lock service (it may have been passed on
    /// since), and how long it may keep passing it on from then.
    since: Instant,
    run_for: Duration,
    _turn: OwnedSemaphorePermit,
    _place: Place,
}

/// A write's place in its resource's queue: counted while it lives, and the queue is
/// dropped from the table with its last write.
#[derive(Debug)]
struct Place {
    serializer: Arc<Serializer>,
    resource: u128,
    queue: Arc<Queue>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut queues = self
            .serializer
            .queues
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if self.queue.waiting.fetch_sub(1, Ordering::AcqRel) == 1 {
            queues.remove(&self.resource);
            // A lock passed on to a write that then left (its client hung up, its wait ran
            // out) is released, not left to its lease's end.
            let handed = self.queue.hand(None);
            if let (Some(handed), Ok(runtime)) = (handed, tokio::runtime::Handle::try_current()) {
                runtime.spawn(async move { handed.service.release(&handed.grant).await });
            }
        }
    }
}

impl Serializer {
    /// How long, at most, the next write here waits after a release that ended a run
    /// before it asks for the lock again (see the module docs); a twentieth of the run's
    /// length when that is shorter.
    pub(crate) const COURTESY: Duration = Duration::from_millis(5);

    pub(crate) fn new(default: LockService, named: HashMap<String, LockService>) -> Arc<Self> {
        Arc::new(Serializer {
            default: Arc::new(default),
            named: named
                .into_iter()
                .map(|(name, service)| (name, Arc::new(service)))
                .collect(),
            queues: Mutex::new(HashMap::new()),
        })
    }

    /// The lock service a route's `serialize.lock` names (the shared Redis's without one).
    /// Names were checked against `[locks.<name>]` at config load; one added by a reload
    /// without a restart is not connected, and such a route's writes are refused as with a
    /// lock service that does not answer.
    fn service(&self, config: &SerializeConfig) -> Option<&Arc<LockService>> {
        match &config.lock {
            None => Some(&self.default),
            Some(name) => self.named.get(name),
        }
    }

    /// Waits for the lock on `path` (see the module docs).
    ///
    /// # Cancel safety
    /// Dropped while waiting: the place in the queue is given up. Dropped once the fleet
    /// lock was granted: it stays taken until its lease ends.
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        config: &SerializeConfig,
        path: &str,
        metrics: &SerializeMetrics,
    ) -> Result<Held, Refusal> {
        let started = Instant::now();
        let deadline = started + config.wait_timeout;
        let resource = serialized_resource(path);
        let Some(service) = self.service(config).cloned() else {
            metrics.outcome(SerializeOutcome::Unavailable);
            return Err(Refusal::Unavailable);
        };
        let place = {
            let mut queues = self.queues.lock().unwrap_or_else(PoisonError::into_inner);
            let queue = queues.entry(resource).or_insert_with(|| {
                Arc::new(Queue {
                    turn: Arc::new(Semaphore::new(1)),
                    waiting: AtomicUsize::new(0),
                    handed: Mutex::new(None),
                    releasing: AtomicBool::new(false),
                })
            });
            // The holder counts too: `max_waiters` waiting behind it.
            if queue.waiting.load(Ordering::Acquire) > config.max_waiters {
                metrics.outcome(SerializeOutcome::TooMany);
                return Err(Refusal::TooMany);
            }
            queue.waiting.fetch_add(1, Ordering::AcqRel);
            Place {
                serializer: Arc::clone(self),
                resource,
                queue: Arc::clone(queue),
            }
        };
        let turn =
            match tokio::time::timeout_at(deadline, Arc::clone(&place.queue.turn).acquire_owned())
                .await
            {
                Ok(Ok(turn)) => turn,
                // The semaphore is never closed.
                Ok(Err(_)) | Err(_) if place.queue.releasing.load(Ordering::Acquire) => {
                    metrics.outcome(SerializeOutcome::Unavailable);
                    return Err(Refusal::Unavailable);
                }
                Ok(Err(_)) | Err(_) => {
                    metrics.outcome(SerializeOutcome::Timeout);
                    return Err(Refusal::Timeout);
                }
            };
        // A grant with less than a third of its lease left (a slow backend) is given back
        // and tried again: the write must reach the origin with time for a renewal.
        let margin = config.lease / 3;
        let run_for = margin.min(config.wait_timeout / 4);
        if let Some(handed) = place.queue.hand(None) {
            // Passed on by the write before: the lock's lease was renewed then, and a
            // route of another lock service on the same resource gives it back.
            if Arc::ptr_eq(&handed.service, &service)
                && handed
                    .grant
                    .expires
                    .saturating_duration_since(Instant::now())
                    >= margin
            {
                metrics.waited(started.elapsed());
                metrics.outcome(SerializeOutcome::Granted);
                return Ok(Held {
                    service,
                    grant: handed.grant,
                    lease: config.lease,
                    since: handed.since,
                    run_for,
                    _turn: turn,
                    _place: place,
                });
            }
            handed.service.release(&handed.grant).await;
        }
        loop {
            let grant = match service
                .acquire(resource, path, config.lease, deadline)
                .await
            {
                Ok(grant) => grant,
                Err(AcquireError::Timeout) => {
                    metrics.outcome(SerializeOutcome::Timeout);
                    return Err(Refusal::Timeout);
                }
                Err(AcquireError::Unavailable) => {
                    metrics.outcome(SerializeOutcome::Unavailable);
                    return Err(Refusal::Unavailable);
                }
            };
            if grant.expires.saturating_duration_since(Instant::now()) >= margin {
                metrics.waited(started.elapsed());
                metrics.outcome(SerializeOutcome::Granted);
                return Ok(Held {
                    service,
                    grant,
                    lease: config.lease,
                    since: Instant::now(),
                    run_for,
                    _turn: turn,
                    _place: place,
                });
            }
            metrics.late_grants.inc();
            service.release(&grant).await;
            if Instant::now() >= deadline {
                metrics.outcome(SerializeOutcome::Timeout);
                return Err(Refusal::Timeout);
            }
        }
    }

    /// Runs `write` while holding `held`, renewing the lease a third of it after the grant
    /// or the last renewal was sent, then passes the lock on to the next write waiting here
    /// or releases it (see the module docs): in a task of its own, so the write's answer
    /// does not wait for that round trip (and a release Redis did not take is tried again
    /// while the lease lasts). The turn here is given up once the lock was passed on or
    /// its release tried, so after a release the next write of this instance asks the lock
    /// service again, as every other instance's waiter does (woken by the release's event).
    ///
    /// A renewal that fails (Redis did not answer within `command_timeout`) is tried again
    /// a twelfth of the lease later, and so on while the write is at the origin: the lease
    /// is at least 3 × `command_timeout`, so after one renewal that timed out there is time
    /// for the next before the lease ends, and a Redis that was out of reach for less than
    /// the lease leaves the lock held. Only a renewal that finds the lock gone (another
    /// owner, or none) ends the renewals; it is counted, and the write goes on (it may
    /// already be at the origin): only the origin's token check can refuse it then.
    pub(crate) async fn hold<F: Future>(
        self: &Arc<Self>,
        mut held: Held,
        write: F,
        metrics: &SerializeMetrics,
    ) -> F::Output {
        let every = held.lease / 3;
        let retry = held.lease / 12;
        let mut write = std::pin::pin!(write);
        // `expires` is the lease's end as of the last grant or renewal sent.
        let mut next = held.grant.expires - (held.lease - every);
        let mut lost = false;
        let output = loop {
            tokio::select! {
                output = &mut write => break output,
                () = tokio::time::sleep_until(next), if !lost => {
                    match held.service.renew(&mut held.grant, held.lease).await {
                        Ok(true) => next = held.grant.expires - (held.lease - every),
                        Ok(false) => {
                            lost = true;
                            metrics.lost.inc();
                        }
                        Err(_) => next = Instant::now() + retry,
                    }
                }
            }
        };
        let passed_on = metrics.passed_on.clone();
        tokio::spawn(async move {
            let Held {
                service,
                mut grant,
                lease,
                since,
                run_for,
                _turn: turn,
                _place: place,
            } = held;
            let queue = Arc::clone(&place.queue);
            queue.releasing.store(true, Ordering::Release);
            // The holder counts itself: more than one is a write waiting here.
            let waited_for = queue.waiting.load(Ordering::Acquire) > 1;
            if waited_for
                && !lost
                && since.elapsed() < run_for
                && service.pass_on(&mut grant, lease).await
            {
                passed_on.inc();
                queue.hand(Some(Handed {
                    service,
                    grant,
                    since,
                }));
                queue.releasing.store(false, Ordering::Release);
                drop((turn, place));
                return;
            }
            let mut released = service.release(&grant).await;
            queue.releasing.store(false, Ordering::Release);
            if waited_for && released && since.elapsed() >= run_for {
                // The run is over: writes waiting in other instances, woken by the
                // release's event, get a moment to take the lock before the next one here.
                tokio::time::sleep(Self::COURTESY.min(run_for / 20)).await;
            }
            drop((turn, place));
            // A release the backend did not take leaves the resource locked for everyone
            // until the lease ends: it is tried again (compare-and-delete, so a late one is
            // harmless) a twelfth of the lease later, while the lease lasts. The next write
            // here need not wait for that: it finds the lock held in the backend, and waits
            // there. The grant is dropped last (a ZooKeeper node is deleted then).
            while !released && Instant::now() < grant.expires {
                tokio::time::sleep(lease / 12).await;
                released = service.release(&grant).await;
            }
        });
        output
    }
}

impl Held {
    /// The grant's fencing token.
    pub(crate) fn token(&self) -> u64 {
        self.grant.token
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coord::locks::MemoryLocks;
    use crate::metrics::Metrics;

    fn config(max_waiters: usize, wait: u64) -> SerializeConfig {
        SerializeConfig {
            key: "/r/{id}".into(),
            lease: Duration::from_secs(3),
            wait_timeout: Duration::from_millis(wait),
            max_waiters,
            fence_header: None,
            on_redis_error: crate::config::OnRedisError::Reject,
            retry_after: Duration::from_secs(1),
            lock: None,
        }
    }

    /// One write of `/r/1`: waits for the lock, runs `body` holding it, and gives its token.
    async fn write(
        serializer: &Arc<Serializer>,
        config: &SerializeConfig,
        metrics: &SerializeMetrics,
        body: impl Future<Output = ()>,
    ) -> u64 {
        let held = serializer
            .acquire(config, "/r/1", metrics)
            .await
            .expect("granted");
        let token = held.token();
        serializer.hold(held, body, metrics).await;
        token
    }

    #[tokio::test(start_paused = true)]
    async fn writes_to_one_resource_go_one_at_a_time_in_order_with_growing_tokens() {
        let serializer = Serializer::new(LockService::Memory(MemoryLocks::new()), HashMap::new());
        let metrics = Metrics::unregistered().serialize.for_route("r");
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (serializer, metrics, order) =
                (Arc::clone(&serializer), metrics.clone(), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                write(&serializer, &config(16, 10_000), &metrics, async {
                    order.lock().unwrap().push((i, "start"));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    order.lock().unwrap().push((i, "end"));
                })
                .await
            }));
            // Arrivals 1 ms apart: the queue keeps their order.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let mut tokens = Vec::new();
        for task in tasks {
            tokens.push(task.await.unwrap());
        }
        // The last release (and with it the queue's last place) runs in a task of its own.
        tokio::time::sleep(Duration::from_millis(1)).await;
        let order = order.lock().unwrap().clone();
        let expected: Vec<(i32, &str)> = (0..5).flat_map(|i| [(i, "start"), (i, "end")]).collect();
        assert_eq!(order, expected, "one at a time, in arrival order");
        assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
        assert_eq!(
            metrics.passed_on.get(),
            4,
            "each write passed the lock on to the next"
        );
        assert!(
            serializer.queues.lock().unwrap().is_empty(),
            "queues go with their last write"
        );
    }

    /// A run of writes passing the lock on ends once it held the lock for a quarter of
    /// `wait_timeout` (a third of the lease being longer): the lock is released, and the
    /// next write here takes it again only after the courtesy pause, with a fresh grant
    /// whose run starts anew.
    #[tokio::test(start_paused = true)]
    async fn a_run_of_writes_ends_after_its_length_and_the_next_waits_a_moment() {
        let serializer = Serializer::new(LockService::Memory(MemoryLocks::new()), HashMap::new());
        let metrics = Metrics::unregistered().serialize.for_route("r");
        // wait_timeout 400 ms: runs of 100 ms, a courtesy of 5 ms.
        let config = config(16, 400);
        let times = Arc::new(Mutex::new(Vec::new()));
        let origin = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..5 {
            let (serializer, metrics, times, config) = (
                Arc::clone(&serializer),
                metrics.clone(),
                Arc::clone(&times),
                config.clone(),
            );
            tasks.push(tokio::spawn(async move {
                write(&serializer, &config, &metrics, async {
                    let start = origin.elapsed().as_millis();
                    tokio::time::sleep(Duration::from_millis(40)).await;
                    times.lock().unwrap().push((i, start));
                })
                .await
            }));
            tokio::task::yield_now().await;
        }
        let mut tokens = Vec::new();
        for task in tasks {
            tokens.push(task.await.unwrap());
        }
        assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
        // 0 → 1 → 2 passed on (the run is 80 ms old when 1 ends); 2 ends it at 120 ms;
        // 3 starts a run 5 ms later and passes on to 4.
        let times = times.lock().unwrap().clone();
        assert_eq!(
            times,
            [(0, 0), (1, 40), (2, 80), (3, 125), (4, 165)],
            "start times in ms"
        );
        assert_eq!(metrics.passed_on.get(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn waits_are_bounded_in_time_and_count() {
        let serializer = Serializer::new(LockService::Memory(MemoryLocks::new()), HashMap::new());
        let metrics = Metrics::unregistered().serialize.for_route("r");
        let first = serializer
            .acquire(&config(1, 200), "/r/1", &metrics)
            .await
            .expect("granted");
        // One may wait behind the holder; it times out after wait_timeout.
        let waiter = {
            let (serializer, metrics) = (Arc::clone(&serializer), metrics.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                let result = serializer.acquire(&config(1, 200), "/r/1", &metrics).await;
                (result.map(|_| ()), started.elapsed())
            })
        };
        tokio::task::yield_now().await;
        assert_eq!(
            serializer
                .acquire(&config(1, 200), "/r/1", &metrics)
                .await
                .map(|_| ()),
            Err(Refusal::TooMany)
        );
        let (result, waited) = waiter.await.unwrap();
        assert_eq!(result, Err(Refusal::Timeout));
        assert_eq!(waited, Duration::from_millis(200));
        // Another resource is not held up.
        assert!(
            serializer
                .acquire(&config(1, 200), "/r/2", &metrics)
                .await
                .is_ok()
        );
        drop(first);
    }
}
