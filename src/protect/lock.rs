//! The distributed fill lock: one origin fetch per key across every instance sharing Redis.
//!
//! Only an instance's in-process leader for a key takes part (see `flight.rs`), so each
//! instance makes one lock attempt per key, not one per request. The lock is a Redis key
//! `<prefix>{<hash>}:lock` holding a token that is random per acquisition, set with
//! `SET NX PX lease`; every later operation compares the token first, so a holder whose
//! lease ran out can never release, renew or fill over a newer holder. Redis-side logic is
//! in `coord/scripts.rs`.

use std::sync::Arc;
use std::time::Duration;

use crate::cache::CacheKey;
use crate::coord::events::{Event, EventBus, EventKind, Waiters};
use crate::coord::redis::Unavailable;
use crate::coord::{RedisConn, scripts, tagged_key};
use crate::metrics::RedisOp;

/// A held lease on one key.
#[derive(Debug)]
pub(crate) struct Lease {
    token: String,
    /// The key's generation when the lease was taken; the fill is refused if it changed.
    generation: String,
    hash: u128,
    lock_key: String,
}

/// The answer to a lock attempt.
#[derive(Debug)]
pub(crate) enum Acquired {
    Won(Lease),
    /// Another holder fetches; its lease has about this long left.
    Held {
        remaining: Duration,
    },
}

/// What the fill script did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FillOutcome {
    Stored,
    /// An invalidation bumped the generation while we fetched: the answer may predate it.
    GenerationChanged,
    /// Our lease ran out and another holder took the lock: it will store a newer answer.
    LockTaken,
}

#[derive(Debug)]
pub(crate) struct DistLock {
    redis: RedisConn,
    prefix: Arc<str>,
    pub(crate) lease: Duration,
    bus: Arc<EventBus>,
}

impl DistLock {
    pub(crate) fn new(redis: RedisConn, prefix: &str, lease: Duration, bus: Arc<EventBus>) -> Self {
        DistLock {
            redis,
            prefix: prefix.into(),
            lease,
            bus,
        }
    }

    /// Whether the distributed path can be used right now: Redis answers. The event bus
    /// need not be connected at this instant: a waiter registered while it reconnects is
    /// woken by the re-subscription (which wakes every waiter to re-check), so a short bus
    /// gap never splits a stampede into one fetch per instance.
    pub(crate) fn is_available(&self) -> bool {
        self.redis.is_up()
    }

    pub(crate) fn waiters(&self) -> &Arc<Waiters> {
        &self.bus.waiters
    }

    fn lease_ms(&self) -> Vec<u8> {
        self.lease.as_millis().to_string().into_bytes()
    }

    fn message(&self, kind: EventKind, hash: u128) -> Vec<u8> {
        Event {
            kind,
            instance: self.bus.instance,
            hash,
        }
        .encode()
        .into_bytes()
    }

    /// `SET lock token NX PX lease`, reading the generation in the same round trip.
    pub(crate) async fn acquire(&self, key: &CacheKey) -> Result<Acquired, Unavailable> {
        let lock_key = tagged_key(&self.prefix, key.hash, "lock");
        let gen_key = tagged_key(&self.prefix, key.hash, "gen");
        let token = format!("{:032x}", rand::random::<u128>());
        let (won, generation, pttl): (i64, String, i64) = self
            .redis
            .run_script(
                RedisOp::Lock,
                &scripts::ACQUIRE,
                &[&lock_key, &gen_key],
                &[token.as_bytes(), &self.lease_ms()],
            )
            .await?;
        if won == 1 {
            Ok(Acquired::Won(Lease {
                token,
                generation,
                hash: key.hash,
                lock_key,
            }))
        } else {
            // PTTL is -1 (no expiry: never set by us) or -2 (gone since): retry soon.
            let remaining = u64::try_from(pttl).unwrap_or(0);
            Ok(Acquired::Held {
                remaining: Duration::from_millis(remaining),
            })
        }
    }

    /// A lease for storing without the lock (no fleet coordination available): it holds no
    /// lock — its token matches none — so its fill stores only while nobody holds the lock
    /// and the generation read here is unchanged.
    pub(crate) async fn unlocked_lease(&self, key: &CacheKey) -> Result<Lease, Unavailable> {
        let gen_key = tagged_key(&self.prefix, key.hash, "gen");
        let generation = self.redis.get(&gen_key).await?.map_or_else(
            || "0".to_owned(),
            |g| String::from_utf8_lossy(&g).into_owned(),
        );
        Ok(Lease {
            token: "-".to_owned(),
            generation,
            hash: key.hash,
            lock_key: tagged_key(&self.prefix, key.hash, "lock"),
        })
    }

    /// Extends the lease; `Ok(false)` means it was lost (expired, or someone else holds it).
    pub(crate) async fn renew(&self, lease: &Lease) -> Result<bool, Unavailable> {
        let renewed: i64 = self
            .redis
            .run_script(
                RedisOp::Renew,
                &scripts::RENEW,
                &[&lease.lock_key],
                &[lease.token.as_bytes(), &self.lease_ms()],
            )
            .await?;
        Ok(renewed == 1)
    }

    /// Stores `encoded` for `ttl` if the generation is unchanged and the lock is not
    /// someone else's; releases the lock; wakes the waiters.
    /// Invalidates `hash` fleet-wide (see [`scripts::INVALIDATE`]). `generation_ttl` must
    /// outlast any fill that could still be running with the old generation.
    pub(crate) async fn invalidate(
        &self,
        hash: u128,
        generation_ttl: Duration,
    ) -> Result<(), Unavailable> {
        let entry_key = tagged_key(&self.prefix, hash, "v");
        let lock_key = tagged_key(&self.prefix, hash, "lock");
        let gen_key = tagged_key(&self.prefix, hash, "gen");
        let ttl_ms = generation_ttl.as_millis().max(1).to_string();
        self.redis
            .run_script::<i64>(
                RedisOp::Invalidate,
                &scripts::INVALIDATE,
                &[&entry_key, &lock_key, &gen_key],
                &[
                    ttl_ms.as_bytes(),
                    self.bus.channel.as_bytes(),
                    &self.message(EventKind::Invalidate, hash),
                ],
            )
            .await
            .map(|_| ())
    }

    pub(crate) async fn fill(
        &self,
        lease: &Lease,
        encoded: &[u8],
        ttl: Duration,
    ) -> Result<FillOutcome, Unavailable> {
        let entry_key = tagged_key(&self.prefix, lease.hash, "v");
        let gen_key = tagged_key(&self.prefix, lease.hash, "gen");
        let ttl_ms = ttl.as_millis().max(1).to_string();
        let stored: i64 = self
            .redis
            .run_script(
                RedisOp::Fill,
                &scripts::FILL,
                &[&entry_key, &lease.lock_key, &gen_key],
                &[
                    lease.token.as_bytes(),
                    lease.generation.as_bytes(),
                    encoded,
                    ttl_ms.as_bytes(),
                    self.bus.channel.as_bytes(),
                    &self.message(EventKind::Fill, lease.hash),
                    &self.message(EventKind::Released, lease.hash),
                ],
            )
            .await?;
        Ok(match stored {
            1 => FillOutcome::Stored,
            0 => FillOutcome::GenerationChanged,
            _ => FillOutcome::LockTaken,
        })
    }

    /// Releases the lock without a fill, telling waiters `why` (`Released`: one of them
    /// takes over; `Uncacheable`: each fetches for itself).
    pub(crate) async fn release(&self, lease: &Lease, why: EventKind) -> Result<bool, Unavailable> {
        let released: i64 = self
            .redis
            .run_script(
                RedisOp::Release,
                &scripts::RELEASE,
                &[&lease.lock_key],
                &[
                    lease.token.as_bytes(),
                    self.bus.channel.as_bytes(),
                    &self.message(why, lease.hash),
                ],
            )
            .await?;
        Ok(released == 1)
    }
}
