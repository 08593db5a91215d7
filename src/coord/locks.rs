//! Locks for serialized writes: one holder per resource across the fleet, each grant with
//! a **fencing token** that only increases, for the origin to check in its own transaction
//! (`… WHERE fence <= :token`). The lock keeps writes apart while everything is well; the
//! token is what keeps an older write from winning when a holder outlives its lease (a
//! pause, a cut connection) and its write reaches the origin after the next holder's.
//!
//! One contract for every backend ([`LockService`]): [`LockService::acquire`] with a
//! bounded wait gives a [`Grant`] (token, lease end) or says it timed out or the backend
//! failed; [`LockService::renew`] extends a grant while it is still held and says when it
//! was lost; [`LockService::release`] ends it. Backends:
//!
//! - **Redis** (`redis.rs`, the default): `SET <lock> <owner> NX PX <lease>` and the token
//!   minted in the same script as `max(stored + 1, Redis TIME in µs)`, so it keeps growing
//!   across a Redis restart without persistence or a failover to a lagging replica (the
//!   clock is the floor; a Redis clock stepped back is the residual risk). The token key
//!   expires when the resource is idle. Waiters are woken by the `released` event on the
//!   bus, or by the holder's lease end (its instance may be gone).
//! - **Memory** (`memory.rs`, embedded mode): the fleet is this process; tokens are minted
//!   the same way from the local clock.

mod memory;
mod redis;

use std::time::Duration;

use tokio::time::Instant;

pub(crate) use self::memory::MemoryLocks;
pub(crate) use self::redis::RedisLocks;

/// A lock held on one resource.
#[derive(Debug)]
pub(crate) struct Grant {
    /// The fencing token: larger than every earlier grant's on this resource.
    pub(crate) token: u64,
    /// When the lease ends unless renewed (a local estimate, taken from before the
    /// request that granted it was sent, so never later than the backend's).
    pub(crate) expires: Instant,
    resource: u128,
    /// This grant's owner id: a renewal or release of an older grant never touches it.
    owner: String,
}

/// Why a lock was not granted.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AcquireError {
    /// Held by others until the deadline.
    Timeout,
    /// The backend did not answer.
    Unavailable,
}

/// The lock service serialized writes use.
#[derive(Debug)]
pub(crate) enum LockService {
    Redis(RedisLocks),
    Memory(MemoryLocks),
}

impl LockService {
    /// Waits until `deadline` at most for the lock on `resource` (an id: the hash of its
    /// `path`, which backends that name locks by path use), then holds it for `lease`.
    ///
    /// # Cancel safety
    /// A lock granted to a future that is then dropped stays taken until its lease ends
    /// (waiters take over then); callers run grants to completion.
    pub(crate) async fn acquire(
        &self,
        resource: u128,
        _path: &str,
        lease: Duration,
        deadline: Instant,
    ) -> Result<Grant, AcquireError> {
        match self {
            LockService::Redis(redis) => redis.acquire(resource, lease, deadline).await,
            LockService::Memory(memory) => Ok(memory.acquire(resource, lease)),
        }
    }

    /// Extends `grant` by `lease` while it is still held. `Ok(false)`: it was lost (another
    /// holder may have it now).
    pub(crate) async fn renew(
        &self,
        grant: &mut Grant,
        lease: Duration,
    ) -> Result<bool, AcquireError> {
        match self {
            LockService::Redis(redis) => redis.renew(grant, lease).await,
            LockService::Memory(_) => {
                grant.expires = Instant::now() + lease;
                Ok(true)
            }
        }
    }

    /// Ends `grant` (if still held) and wakes the next waiter.
    pub(crate) async fn release(&self, grant: Grant) {
        match self {
            LockService::Redis(redis) => redis.release(grant).await,
            LockService::Memory(_) => {}
        }
    }
}

/// `max(last + 1, now in µs)`: a token above every earlier one, also when `last` was lost
/// (then the clock is the floor).
pub(crate) fn next_token(last: u64, now_us: u64) -> u64 {
    last.saturating_add(1).max(now_us)
}

/// The lock service a `[locks.<name>]` section describes, connected (or trying to).
pub(crate) async fn connect(config: &crate::config::LockBackendConfig) -> LockService {
    match &config.backend {
        crate::config::LockBackend::Etcd { .. }
        | crate::config::LockBackend::ZooKeeper { .. }
        | crate::config::LockBackend::Mysql { .. }
        | crate::config::LockBackend::Redlock { .. } => {
            unimplemented!("lock backend {} is being built", config.backend.kind())
        }
    }
}
