//! Fleet-wide single-flight: across every instance that shares Redis, one lock holder per
//! key fetches from the origin; the others wait for its answer.
//!
//! Only an instance's in-process leader for a key takes part (see the parent module), so
//! each instance makes one claim per key, not one per request. Shaped like the in-process
//! flight, a claim gives a typed permit:
//!
//! ```text
//! claim ─▶ Leader(FillPermit)  holds the key's lock; `hold_while` renews its lease every
//!                              lease/3 while the fetch runs; `fill` (store + release +
//!                              publish, one script) or `release` consumes it; dropping it
//!                              unused releases the lock, so waiters take over at once
//!                              instead of at the lease's end
//!       ─▶ Follower            registered for the key's events before `claim` returns, so
//!                              a fill that lands after the claim still wakes it; `wait`
//!                              ends on an event or at the holder's lease end (its instance
//!                              may have died: contend again, exactly one waiter wins)
//! ```
//!
//! Nothing polls: the only timers are the holder's lease end and the caller's deadline.
//! Correctness never rests on the lock: every fill is generation-checked in Redis, so a
//! holder that lost its lease can waste a fetch but never store over a newer answer.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tracing::warn;

use crate::coord::events::{EventKind, WaitHandle};
use crate::coord::redis::Unavailable;
use crate::coord::store::{Acquired, FillOutcome, FloorCheck, Lease, RedisStore};
use crate::metrics::{LockEvent, Metrics};

/// Slack after a holder's lease end before a waiter contends again, so the expiry has
/// really happened in Redis by then.
const LEASE_SLACK: Duration = Duration::from_millis(20);

/// The shortest renewal period, whatever the lease.
const MIN_RENEW_PERIOD: Duration = Duration::from_millis(10);

/// The fleet lock of every key: claims, and unlocked fill permits.
#[derive(Clone, Debug)]
pub(crate) struct FleetLock {
    store: RedisStore,
    metrics: Metrics,
}

/// What a claim got.
pub(crate) enum Claim {
    /// This instance holds the key's lock: fetch, then fill or release.
    Leader(Box<FillPermit>),
    /// Another instance holds it: wait for its answer.
    Follower(Follower),
    /// Another instance holds it, and this instance already waits on `max_waiters` keys:
    /// no wait (the caller answers per `lock.on_timeout`).
    Full,
    /// The entry is in Redis already (asked for with `or_entry`): read it, and claim again
    /// without `or_entry` if it does not answer the request.
    Present,
}

/// The right to store one fetched answer in Redis: a lock holder's, or an unlocked one
/// (no fleet coordination: the event bus or the lock path is not usable), which stores
/// only while nobody holds the lock. Either way the store is refused when the key's
/// generation changed since the permit was taken.
#[derive(Debug)]
pub(crate) struct FillPermit {
    store: RedisStore,
    lease: Lease,
    /// Holds the key's lock, which is released if the permit is dropped unused.
    locked: bool,
    /// `fill` or `release` ran: the lock is no longer ours to release.
    done: bool,
    /// Until when (Unix ms) the key is listed in its route's index, once listed.
    listed_until: Option<u64>,
}

/// A waiter on another instance's fetch of one key.
#[derive(Debug)]
pub(crate) struct Follower {
    waiter: WaitHandle,
    /// When the holder's lease runs out, plus [`LEASE_SLACK`].
    lease_end: Instant,
}

/// Why a follower's wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wake {
    /// The holder stored an answer, or the bus reconnected (events may have been missed):
    /// look in Redis.
    Filled,
    /// The holder's answer cannot be shared: fetch alone.
    Uncacheable,
    /// The holder's fetch failed: answer with the copy it left in Redis (or contend when
    /// it is gone).
    Failed,
    /// The holder released the lock without an answer, or its lease ended, or the key
    /// was invalidated: contend for the lock again.
    Contend,
}

impl FleetLock {
    pub(crate) fn new(store: RedisStore, metrics: Metrics) -> Self {
        FleetLock { store, metrics }
    }

    /// Whether the fleet path can be used right now: Redis answers. The event bus need
    /// not be connected at this instant: a waiter registered while it reconnects is woken
    /// by the re-subscription (which wakes every waiter to re-check), so a short bus gap
    /// never splits a stampede into one fetch per instance.
    pub(crate) fn is_available(&self) -> bool {
        self.store.is_available()
    }

    /// Tries to take the lock of the cache key `hash` (whose base is `base`).
    ///
    /// # Cancel safety
    /// Not cancel-safe in one respect: cancelled after Redis granted the lock, the lock
    /// stays taken until its lease ends, when a waiter takes over. Fills run in their own
    /// task, so this only happens at shutdown.
    /// At most `max_waiters` keys are waited on at once in this process. With
    /// [`FloorCheck::On`], a won claim knows the key's version floor ([`FillPermit::floor`]).
    pub(crate) async fn claim(
        &self,
        base: u128,
        hash: u128,
        max_waiters: usize,
        or_entry: bool,
        check: FloorCheck,
    ) -> Result<Claim, Unavailable> {
        match self.store.acquire(base, hash, or_entry, check).await? {
            Acquired::Present => Ok(Claim::Present),
            Acquired::Won(lease) => Ok(Claim::Leader(Box::new(FillPermit {
                store: self.store.clone(),
                lease: *lease,
                locked: true,
                done: false,
                listed_until: None,
            }))),
            Acquired::Held { remaining } => {
                Ok(match self.store.waiters().try_register(hash, max_waiters) {
                    Some(waiter) => Claim::Follower(Follower::new(waiter, remaining)),
                    None => Claim::Full,
                })
            }
        }
    }

    /// A permit to store without the lock (see [`FillPermit`]); it reads the generation
    /// (and with [`FloorCheck::On`] the version floor) now, so take it before the fetch
    /// starts.
    pub(crate) async fn unlocked(
        &self,
        base: u128,
        hash: u128,
        check: FloorCheck,
    ) -> Result<FillPermit, Unavailable> {
        Ok(FillPermit {
            store: self.store.clone(),
            lease: self.store.unlocked_lease(base, hash, check).await?,
            locked: false,
            done: false,
            listed_until: None,
        })
    }

    /// The version floor of base key `base` in Redis, for a fetch that takes no permit.
    pub(crate) async fn floor(&self, base: u128) -> Result<Option<u128>, Unavailable> {
        self.store.floor(base).await
    }

    /// The copy of a failed fetch's answer its holder left for the waiters of `hash` (see
    /// [`FillPermit::release_failed`]), if still there.
    pub(crate) async fn failure(&self, base: u128, hash: u128) -> Option<Vec<u8>> {
        self.store.failure(base, hash).await.ok().flatten()
    }

    /// Counts a lock event.
    pub(crate) fn count(&self, event: LockEvent) {
        self.metrics.lock_event(event);
    }
}

impl FillPermit {
    /// The key's version floor when the permit was taken (asked for with
    /// [`FloorCheck::On`]): the fetch's answer must reach it.
    pub(crate) fn floor(&self) -> Option<u128> {
        self.lease.floor
    }

    /// Runs `work` (the fetch) while renewing the lease every lease/3, so a slow origin
    /// does not let the lock expire under it. A renewal that finds the lock lost is counted
    /// and logged; the work goes on (its fill will be refused if another holder stored).
    ///
    /// # Cancel safety
    /// Cancel-safe: dropping the future drops `work`; the lock is then released by the
    /// permit's `Drop` (or expires).
    pub(crate) async fn hold_while<F: Future>(&self, work: F, metrics: &Metrics) -> F::Output {
        if !self.locked {
            return work.await;
        }
        let period = (self.store.lease / 3).max(MIN_RENEW_PERIOD);
        keep_alive(work, period, || async {
            match self.store.renew(&self.lease).await {
                Ok(true) => metrics.lock_event(LockEvent::Renewed),
                Ok(false) => {
                    metrics.lock_event(LockEvent::Lost);
                    warn!(message = "Lock lease lost during a fetch.");
                }
                // Redis is down: the fill will not reach it either; keep fetching.
                Err(_) => {}
            }
        })
        .await
    }

    /// Lists `member` (`<base hex> <path>`) under surrogate key `tag` for `life`;
    /// `Ok(true)` when the tag was invalidated since the permit was taken (then the answer
    /// must not be stored).
    pub(crate) async fn tag_add(
        &self,
        tag: &str,
        member: &str,
        life: Duration,
    ) -> Result<bool, Unavailable> {
        self.store
            .tag_add(tag, member, life, self.lease.began)
            .await
    }

    /// Lists `member` (of base key `base`) in shard `shard` of the index of the route whose
    /// implicit tag is `tag`, until `expiry` (Unix ms) at least: before the fetch starts
    /// (see [`RedisStore::route_add`]).
    pub(crate) async fn route_add(
        &mut self,
        tag: &str,
        shard: u16,
        base: u128,
        member: &str,
        expiry: u64,
    ) -> Result<(), Unavailable> {
        self.store
            .route_add(tag, shard, base, member, expiry)
            .await?;
        self.listed_until = self.listed_until.max(Some(expiry));
        Ok(())
    }

    /// Until when (Unix ms) the key is listed in its route's index, once
    /// [`FillPermit::route_add`] listed it.
    pub(crate) fn listed_until(&self) -> Option<u64> {
        self.listed_until
    }

    /// How long after the permit's fetch begins the fetch may still be storing: the
    /// longest fetch, plus slack (what a generation read now is kept for).
    pub(crate) fn longest_fill(&self) -> Duration {
        self.store.generation_life()
    }

    /// The turn to encode and store a value of `size` bytes (see
    /// [`RedisStore::large_value_turn`]); hold it until [`FillPermit::fill`] returns.
    ///
    /// # Errors
    /// `Unavailable` when it did not come in time: store nothing.
    pub(crate) async fn large_value_turn(
        &self,
        size: usize,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Unavailable> {
        self.store.large_value_turn(size).await
    }

    /// Stores `encoded` for `ttl` if the generation is unchanged and nobody else holds the
    /// lock (and its `version` reaches the key's floor, on a route with `version`; see
    /// [`RedisStore::fill`]), releases the lock and wakes the waiters (one script). A fill
    /// that fails (Redis timed out, or a cluster slot being migrated refused the script)
    /// releases the lock on its own, so the waiters take over now rather than at the
    /// lease's end.
    pub(crate) async fn fill(
        mut self,
        encoded: &[u8],
        ttl: Duration,
        version: Option<&str>,
    ) -> Result<FillOutcome, Unavailable> {
        let filled = self.store.fill(&self.lease, encoded, ttl, version).await;
        if filled.is_err() {
            self.release_with(EventKind::Released, None).await;
        } else {
            self.done = true;
        }
        filled
    }

    /// Releases the lock without a fill, telling the waiters `why` (`Released`: one of
    /// them takes over; `Uncacheable`: each fetches for itself).
    pub(crate) async fn release(self, why: EventKind) {
        self.release_with(why, None).await;
    }

    /// Releases the lock after a failed fetch, leaving `encoded` (the failure's answer) in
    /// Redis for a moment: the waiters answer with it instead of asking the origin again.
    pub(crate) async fn release_failed(self, encoded: &[u8]) {
        self.release_with(EventKind::Failed, Some(encoded)).await;
    }

    async fn release_with(mut self, why: EventKind, failure: Option<&[u8]>) {
        self.done = true;
        if self.locked {
            // A failure leaves the lock to expire at its lease's end: waiters take over.
            let _ = self.store.release(&self.lease, why, failure).await;
        }
    }
}

impl Drop for FillPermit {
    fn drop(&mut self) {
        if !self.locked || self.done {
            return;
        }
        // Dropped unused (the fetch task was cancelled or panicked): release the lock in
        // the background, so waiters take over now rather than at the lease's end. Outside
        // a runtime (process exit) the lease simply expires.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.store.clone();
        let lease = self.lease.clone();
        runtime.spawn(async move {
            let _ = store.release(&lease, EventKind::Released, None).await;
        });
    }
}

impl Follower {
    /// A waiter registered on the key's events, whose holder has `remaining` of its lease.
    pub(crate) fn new(waiter: WaitHandle, remaining: Duration) -> Self {
        Follower {
            waiter,
            lease_end: Instant::now() + remaining + LEASE_SLACK,
        }
    }

    /// Waits for news of the holder, at most until its lease ends or `deadline`.
    ///
    /// # Cancel safety
    /// Cancel-safe: an event that arrives while not waiting is seen by the next call.
    pub(crate) async fn wait(&mut self, deadline: Instant) -> Wake {
        tokio::select! {
            signal = self.waiter.changed() => match signal.kind {
                Some(EventKind::Uncacheable) => Wake::Uncacheable,
                Some(EventKind::Failed) => Wake::Failed,
                // A fill, or a reconnect after which events may have been missed.
                Some(EventKind::Fill) | None => Wake::Filled,
                // Released without a fill (or an invalidation, which voids the lease).
                Some(EventKind::Released | EventKind::Invalidate | EventKind::Hot) => {
                    Wake::Contend
                }
            },
            () = tokio::time::sleep_until(self.lease_end.min(deadline)) => Wake::Contend,
        }
    }
}

/// Runs `work`, calling `renew` every `period` until it completes.
///
/// Hand-written rather than a crate: it is a `select!` over the work and an interval, and
/// the renewal must run on the same task (no spawn) so it stops the moment the work ends.
async fn keep_alive<F, R, RF>(work: F, period: Duration, mut renew: R) -> F::Output
where
    F: Future,
    R: FnMut() -> RF,
    RF: Future<Output = ()>,
{
    tokio::pin!(work);
    let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
    loop {
        tokio::select! {
            output = &mut work => return output,
            _ = ticks.tick() => renew().await,
        }
    }
}

#[cfg(test)]
mod tests {
    //! On paused time: the follower's timers and the leader's renewal cadence are logic,
    //! not Redis. The permit's Redis side (drop, fill) runs against a real redis-server;
    //! the protocol across instances is exercised end to end in `tests/`.

    use std::cell::Cell;
    use std::sync::Arc;

    use prometheus::IntGauge;

    use super::*;
    use crate::coord::events::Waiters;
    use crate::test_redis::TestRedis;

    fn waiters() -> Arc<Waiters> {
        Waiters::new(IntGauge::new("waiters", "test").expect("gauge"))
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_contends_again_when_the_holders_lease_ends() {
        let waiters = waiters();
        let started = Instant::now();
        let mut follower = Follower::new(waiters.register(1), Duration::from_millis(300));
        let wake = follower.wait(started + Duration::from_secs(10)).await;
        assert_eq!(wake, Wake::Contend);
        assert_eq!(started.elapsed(), Duration::from_millis(300) + LEASE_SLACK);
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_wakes_the_follower_before_the_lease_ends() {
        let waiters = waiters();
        let started = Instant::now();
        for (kind, expected) in [
            (EventKind::Fill, Wake::Filled),
            (EventKind::Uncacheable, Wake::Uncacheable),
            (EventKind::Failed, Wake::Failed),
            (EventKind::Released, Wake::Contend),
            (EventKind::Invalidate, Wake::Contend),
        ] {
            let mut follower = Follower::new(waiters.register(7), Duration::from_secs(5));
            let notifier = Arc::clone(&waiters);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(40)).await;
                notifier.notify(7, kind);
            });
            let before = Instant::now();
            assert_eq!(
                follower.wait(started + Duration::from_secs(60)).await,
                expected
            );
            assert_eq!(before.elapsed(), Duration::from_millis(40), "{kind:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_bus_reconnect_makes_every_follower_look_in_redis() {
        let waiters = waiters();
        let mut a = Follower::new(waiters.register(1), Duration::from_secs(5));
        let mut b = Follower::new(waiters.register(2), Duration::from_secs(5));
        waiters.wake_all();
        let deadline = Instant::now() + Duration::from_secs(60);
        assert_eq!(a.wait(deadline).await, Wake::Filled);
        assert_eq!(b.wait(deadline).await, Wake::Filled);
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_never_waits_past_its_deadline() {
        let waiters = waiters();
        let started = Instant::now();
        let mut follower = Follower::new(waiters.register(3), Duration::from_secs(30));
        let wake = follower.wait(started + Duration::from_millis(250)).await;
        assert_eq!(wake, Wake::Contend);
        assert_eq!(started.elapsed(), Duration::from_millis(250));
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_sent_between_waits_is_not_missed() {
        let waiters = waiters();
        let mut follower = Follower::new(waiters.register(9), Duration::from_secs(30));
        waiters.notify(9, EventKind::Fill);
        let before = Instant::now();
        let wake = follower.wait(before + Duration::from_secs(60)).await;
        assert_eq!((wake, before.elapsed()), (Wake::Filled, Duration::ZERO));
    }

    #[tokio::test(start_paused = true)]
    async fn the_lease_is_renewed_every_period_while_the_work_runs_and_not_after() {
        let renewals = Cell::new(0);
        let output = keep_alive(
            async {
                tokio::time::sleep(Duration::from_millis(1050)).await;
                "fetched"
            },
            Duration::from_millis(100),
            || async { renewals.set(renewals.get() + 1) },
        )
        .await;
        assert_eq!((output, renewals.get()), ("fetched", 10));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(renewals.get(), 10, "renewed after the work ended");
    }

    /// A fleet lock on `redis` with a long lease, so only an explicit release frees a key.
    async fn fleet_on(redis: &TestRedis) -> FleetLock {
        let toml = format!(
            "[upstream]\nurl = \"http://127.0.0.1:9\"\n[redis]\nurl = \"{}\"\n\
             [[routes]]\nname = \"r\"\nmatch = \"/r/{{id}}\"\n",
            redis.url()
        );
        let vars = std::collections::HashMap::<String, String>::new();
        let config = crate::config::Config::from_toml(&toml, "test.toml", &vars).expect("config");
        let metrics = Metrics::unregistered();
        let redis_config = config.redis.as_ref().expect("shared mode");
        let conn = crate::coord::RedisConn::start(
            redis_config,
            metrics.clone(),
            tokio_util::sync::CancellationToken::new(),
        )
        .await
        .expect("redis");
        let keys = crate::coord::Keyspace::new(&redis_config.key_prefix);
        let bus = crate::coord::events::EventBus::new(keys.events_channel(), 1, waiters(), vec![]);
        FleetLock::new(
            RedisStore::new(conn, keys, Duration::from_secs(30), bus),
            metrics,
        )
    }

    /// Claims `hash` until this instance leads (bounded), and returns its permit.
    async fn lead(fleet: &FleetLock, hash: u128, within: Duration) -> Box<FillPermit> {
        lead_checked(fleet, hash, within, FloorCheck::Off).await
    }

    /// [`lead`], reading the version floor with `check`.
    async fn lead_checked(
        fleet: &FleetLock,
        hash: u128,
        within: Duration,
        check: FloorCheck,
    ) -> Box<FillPermit> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Claim::Leader(permit)) =
                fleet.claim(hash, hash, usize::MAX, false, check).await
            {
                return permit;
            }
            assert!(
                Instant::now() < deadline,
                "key {hash} still locked after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Against a real redis-server: a leader whose permit is dropped unused (its fetch
    /// task was cancelled or panicked) frees the key at once, not after its 30 s lease.
    #[tokio::test]
    async fn a_permit_dropped_unused_releases_the_lock_at_once() {
        let redis = TestRedis::start().await;
        let fleet = fleet_on(&redis).await;
        let permit = lead(&fleet, 1, Duration::ZERO).await;
        assert!(
            matches!(
                fleet.claim(1, 1, usize::MAX, false, FloorCheck::Off).await,
                Ok(Claim::Follower(_))
            ),
            "a second claim follows while the permit lives"
        );
        drop(permit);
        lead(&fleet, 1, Duration::from_secs(2))
            .await
            .release(EventKind::Released)
            .await;
    }

    /// Against a real redis-server: a fill stores the entry and frees the key in one step,
    /// and a consumed permit's drop touches nothing (the next holder keeps its lock).
    #[tokio::test]
    async fn a_fill_stores_and_frees_the_key_and_the_next_holder_keeps_its_lock() {
        let redis = TestRedis::start().await;
        let fleet = fleet_on(&redis).await;
        let permit = lead(&fleet, 2, Duration::ZERO).await;
        let stored = permit.fill(b"entry", Duration::from_secs(60), None).await;
        assert_eq!(stored.expect("redis"), FillOutcome::Stored);
        let mut conn = redis.conn().await;
        let entry: Option<Vec<u8>> = redis::cmd("GET")
            .arg(crate::coord::Keyspace::new("cg:").entry(2, 2))
            .query_async(&mut conn)
            .await
            .expect("GET");
        assert_eq!(entry.as_deref(), Some(&b"entry"[..]));
        let next = lead(&fleet, 2, Duration::ZERO).await;
        assert!(
            matches!(
                fleet.claim(2, 2, usize::MAX, false, FloorCheck::Off).await,
                Ok(Claim::Follower(_))
            ),
            "the next holder's lock was released by the filled permit"
        );
        next.release(EventKind::Released).await;
    }

    /// Against a real redis-server: a fill that an invalidation overtook is refused — a base
    /// key's by its lock alone (the invalidation deletes it; no generation was read), a
    /// variant's, not yet listed in its base's index (so its lock survives), by its
    /// generation — and a base key's whose lock is gone (its lease lapsed) is refused too.
    #[tokio::test]
    async fn an_invalidation_during_the_fetch_refuses_a_base_key_and_a_variant() {
        let redis = TestRedis::start().await;
        let fleet = fleet_on(&redis).await;
        let life = Duration::from_secs(60);
        let invalidate = |base: u128| {
            let fleet = fleet.clone();
            async move {
                fleet
                    .store
                    .invalidate(base, life, Duration::ZERO, None)
                    .await
                    .expect("invalidate");
            }
        };
        let permit = lead(&fleet, 7, Duration::ZERO).await;
        invalidate(7).await;
        let outcome = permit.fill(b"entry", life, None).await.expect("redis");
        assert_eq!(outcome, FillOutcome::GenerationChanged, "a base key");

        let Ok(Claim::Leader(variant)) =
            fleet.claim(7, 8, usize::MAX, false, FloorCheck::Off).await
        else {
            panic!("the variant's lock is free");
        };
        invalidate(7).await;
        let outcome = variant.fill(b"entry", life, None).await.expect("redis");
        assert_eq!(outcome, FillOutcome::GenerationChanged, "a variant");

        let permit = lead(&fleet, 9, Duration::ZERO).await;
        let mut conn = redis.conn().await;
        let _: i64 = redis::cmd("DEL")
            .arg(crate::coord::Keyspace::new("cg:").key(9, 9).lock)
            .query_async(&mut conn)
            .await
            .expect("DEL");
        let outcome = permit.fill(b"entry", life, None).await.expect("redis");
        assert_eq!(outcome, FillOutcome::GenerationChanged, "a lapsed lock");
        let entries: i64 = redis::cmd("EXISTS")
            .arg(crate::coord::Keyspace::new("cg:").entry(7, 7))
            .arg(crate::coord::Keyspace::new("cg:").entry(7, 8))
            .arg(crate::coord::Keyspace::new("cg:").entry(9, 9))
            .query_async(&mut conn)
            .await
            .expect("EXISTS");
        assert_eq!(entries, 0, "nothing stored");
    }

    /// Against a real redis-server: the version floor is read with the lock, set by a
    /// write's invalidation (a lower one never lowers it), kept by the fill script (an
    /// answer below it, or without a version, is refused; one at or above is stored and
    /// raises it), compared as numbers however long; a route without `version` ignores it.
    #[tokio::test]
    async fn the_floor_is_read_with_the_lock_and_kept_by_the_fill_script() {
        let redis = TestRedis::start().await;
        let fleet = fleet_on(&redis).await;
        let (key, on, now) = (3, FloorCheck::On, Duration::ZERO);
        let life = Duration::from_secs(60);
        let floored = |version: u128| Some((version, Duration::from_secs(10)));
        let permit = lead_checked(&fleet, key, now, on).await;
        assert_eq!(permit.floor(), None, "no write yet");
        permit.release(EventKind::Released).await;
        // 99 is above 100 as text: compared as numbers.
        fleet
            .store
            .invalidate(key, life, Duration::ZERO, floored(99))
            .await
            .expect("invalidate");
        let fill = |version: &str| {
            let (fleet, version) = (fleet.clone(), version.to_owned());
            async move {
                let permit = lead_checked(&fleet, key, Duration::from_secs(2), on).await;
                let floor = permit.floor();
                let outcome = permit.fill(b"entry", life, Some(&version)).await;
                (floor, outcome.expect("redis"))
            }
        };
        assert_eq!(fill("98").await, (Some(99), FillOutcome::OlderVersion));
        assert_eq!(
            fill("-").await,
            (Some(99), FillOutcome::OlderVersion),
            "none"
        );
        assert_eq!(fill("100").await, (Some(99), FillOutcome::Stored));
        assert_eq!(
            fill("99").await,
            (Some(100), FillOutcome::OlderVersion),
            "older than the stored entry's"
        );
        fleet
            .store
            .invalidate(key, life, Duration::ZERO, floored(50))
            .await
            .expect("invalidate");
        let big = "1".repeat(38);
        fleet
            .store
            .invalidate(
                key,
                life,
                Duration::ZERO,
                floored(big.parse().expect("u128")),
            )
            .await
            .expect("invalidate");
        let (floor, outcome) = fill(&"9".repeat(37)).await;
        assert_eq!(
            floor.map(|f| f.to_string()),
            Some(big),
            "a lower write kept none"
        );
        assert_eq!(outcome, FillOutcome::OlderVersion);
        // A route without `version`: no floor read, none checked.
        let permit = lead_checked(&fleet, key, Duration::from_secs(2), FloorCheck::Off).await;
        assert_eq!(permit.floor(), None);
        let stored = permit.fill(b"entry", life, None).await.expect("redis");
        assert_eq!(stored, FillOutcome::Stored);
        // The lock-free fill reads it too.
        let unlocked = fleet.unlocked(key, key, on).await.expect("redis");
        assert!(unlocked.floor().is_some());
        assert_eq!(
            fleet.floor(key).await.expect("redis"),
            unlocked.floor(),
            "a fetch without a permit reads the same"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_ends_before_the_first_period_is_never_renewed() {
        let renewals = Cell::new(0);
        keep_alive(
            tokio::time::sleep(Duration::from_millis(99)),
            Duration::from_millis(100),
            || async { renewals.set(renewals.get() + 1) },
        )
        .await;
        assert_eq!(renewals.get(), 0);
    }
}
