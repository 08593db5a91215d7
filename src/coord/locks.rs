//! Locks for serialized writes: one holder per resource across the fleet, each grant with
//! a **fencing token** that only increases, for the origin to check in its own transaction
//! (`… WHERE fence <= :token`). The lock keeps writes apart while everything is well; the
//! token is what keeps an older write from winning when a holder outlives its lease (a
//! pause, a cut connection) and its write reaches the origin after the next holder's.
//!
//! One contract for every backend ([`LockService`]): [`LockService::acquire`] with a
//! bounded wait gives a [`Grant`] (token, lease end) or says it timed out or the backend
//! failed; [`LockService::renew`] extends a grant while it is still held and says when it
//! was lost; [`LockService::release`] ends it (and says when the backend did not answer, so
//! the caller can try again while the lease lasts). Backends:
//!
//! - **Redis** (`redis.rs`, the default): `SET <lock> <owner> NX PX <lease>` and the token
//!   minted in the same script as `max(stored + 1, Redis TIME in µs)`, so it keeps growing
//!   across a Redis restart without persistence or a failover to a lagging replica (the
//!   clock is the floor; a Redis clock stepped back is the residual risk). The token key
//!   expires when the resource is idle. Waiters are woken by the `released` event on the
//!   bus, or by the holder's lease end (its instance may be gone).
//! - **Memory** (`memory.rs`, embedded mode): the fleet is this process; tokens are minted
//!   the same way from the local clock.
//! - **etcd** (`etcd.rs`, `[locks.<name>] backend = "etcd"`): a key bound to a lease of the
//!   grant's own, created only if absent; the token is the key's create revision.
//! - **ZooKeeper** (`zookeeper.rs`, `backend = "zookeeper"`): Curator's `InterProcessMutex`
//!   recipe (ephemeral sequential nodes, the lowest holds), held by the process's session;
//!   the token is the lock node's `czxid`.
//! - **MySQL / MariaDB** (`mysql.rs`): a row per resource in a lock table, taken by one
//!   `INSERT … ON DUPLICATE KEY UPDATE` that bumps its durable fence column; waiters poll.
//! - **Redlock** (`redlock.rs`): a majority of independent Redis masters; the token is read
//!   from and written back to that majority; waiters poll.

mod etcd;
mod memory;
mod mysql;
mod redis;
mod redlock;
#[cfg(test)]
pub(crate) mod test_servers;
mod zookeeper;

use std::time::Duration;

use tokio::time::Instant;

use self::etcd::{EtcdGrant, EtcdLocks, EtcdSettings};
pub(crate) use self::memory::MemoryLocks;
pub(crate) use self::mysql::MysqlLocks;
pub(crate) use self::redis::RedisLocks;
pub(crate) use self::redlock::RedlockLocks;
use self::zookeeper::{ZooKeeperGrant, ZooKeeperLocks, ZooKeeperSettings};

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
    /// The backend's name for the resource where it is not derived from `resource` (a
    /// MySQL row's key); empty otherwise.
    key: String,
    /// What the backend holds for it, beyond the owner id.
    handle: Handle,
}

/// A grant's hold in a backend that keeps one per grant.
#[derive(Debug)]
enum Handle {
    /// Redis and memory: the owner id says it all.
    None,
    /// The grant's lease.
    Etcd(EtcdGrant),
    /// The grant's lock node (deleted when dropped).
    ZooKeeper(ZooKeeperGrant),
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
    Etcd(EtcdLocks),
    ZooKeeper(ZooKeeperLocks),
    /// Boxed: its pool's handle and statements are large beside the others.
    Mysql(Box<MysqlLocks>),
    Redlock(RedlockLocks),
    /// A `[locks.<name>]` that could not be set up (logged at start): never grants.
    Unusable,
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
        path: &str,
        lease: Duration,
        deadline: Instant,
    ) -> Result<Grant, AcquireError> {
        match self {
            LockService::Redis(redis) => redis.acquire(resource, lease, deadline).await,
            LockService::Memory(memory) => Ok(memory.acquire(resource, lease)),
            LockService::Etcd(etcd) => etcd.acquire(resource, path, lease, deadline).await,
            LockService::ZooKeeper(zk) => zk.acquire(resource, path, lease, deadline).await,
            LockService::Mysql(mysql) => mysql.acquire(resource, path, lease, deadline).await,
            LockService::Redlock(redlock) => redlock.acquire(resource, lease, deadline).await,
            LockService::Unusable => Err(AcquireError::Unavailable),
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
            LockService::Etcd(etcd) => etcd.renew(grant, lease).await,
            LockService::ZooKeeper(zk) => zk.renew(grant, lease).await,
            LockService::Mysql(mysql) => mysql.renew(grant, lease).await,
            LockService::Redlock(redlock) => redlock.renew(grant, lease).await,
            LockService::Unusable => Err(AcquireError::Unavailable),
        }
    }

    /// Passes `grant` on to the next holder in this process without letting go of the lock:
    /// a fresh fencing token (above every earlier one, as a new grant's) and a lease of
    /// `lease` from now. `false`: not passed on (the lock was lost, the backend did not
    /// answer, or it has no way to: etcd, ZooKeeper, MySQL and Redlock mint a token only
    /// with a new grant), and the caller releases it as usual.
    pub(crate) async fn pass_on(&self, grant: &mut Grant, lease: Duration) -> bool {
        match self {
            LockService::Redis(redis) => redis.pass_on(grant, lease).await,
            LockService::Memory(memory) => {
                memory.pass_on(grant, lease);
                true
            }
            LockService::Etcd(_)
            | LockService::ZooKeeper(_)
            | LockService::Mysql(_)
            | LockService::Redlock(_)
            | LockService::Unusable => false,
        }
    }

    /// Ends `grant` (if still held) and wakes the next waiter. `false`: the backend did not
    /// answer, and the lock may still be held until its lease ends.
    pub(crate) async fn release(&self, grant: &Grant) -> bool {
        match self {
            LockService::Redis(redis) => redis.release(grant).await,
            LockService::Etcd(etcd) => etcd.release(grant).await,
            // The grant's node is deleted when the grant is dropped (`Contender`'s `Drop`,
            // in the background, retried while the session lasts).
            LockService::ZooKeeper(_) => true,
            LockService::Mysql(mysql) => mysql.release(grant).await,
            LockService::Redlock(redlock) => redlock.release(grant).await,
            LockService::Memory(_) | LockService::Unusable => true,
        }
    }
}

/// How long start waits for a `[locks.<name>]` service to connect before it goes on
/// without it (its task keeps trying in the background, and its routes follow their
/// `on_redis_error` meanwhile).
const START_WAIT: Duration = Duration::from_secs(2);

/// Spawns a lock service's connection task (`connecting`, which sends `true` once
/// connected), and waits until it is, [`START_WAIT`] at most. The task ends with the
/// returned handle.
async fn connect_in_background<F>(
    connecting: impl FnOnce(tokio::sync::watch::Sender<bool>) -> F,
) -> tokio_util::task::AbortOnDropHandle<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let (connected, mut ready) = tokio::sync::watch::channel(false);
    let task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(connecting(connected)));
    let _ = tokio::time::timeout(START_WAIT, ready.wait_for(|ready| *ready)).await;
    task
}

/// `max(last + 1, now in µs)`: a token above every earlier one, also when `last` was lost
/// (then the clock is the floor).
pub(crate) fn next_token(last: u64, now_us: u64) -> u64 {
    last.saturating_add(1).max(now_us)
}

/// How a waiter that cannot be woken (a backend without events) sleeps between tries:
/// from 5 ms doubling to 100 ms, each sleep jittered between half and all of it (waiters of
/// several instances spread out), and never much past the holder's lease end.
#[derive(Debug)]
pub(super) struct Backoff {
    next: Duration,
}

impl Backoff {
    const MIN: Duration = Duration::from_millis(5);
    const MAX: Duration = Duration::from_millis(100);

    pub(super) fn new() -> Self {
        Backoff { next: Self::MIN }
    }

    /// The next sleep, the holder's lock ending in `held_for`.
    pub(super) fn next(&mut self, held_for: Duration) -> Duration {
        let step = self.next;
        self.next = (step * 2).min(Self::MAX);
        let jittered = step / 2 + step.mul_f64(rand::random::<f64>() / 2.0);
        jittered.min(held_for + Self::MIN)
    }
}

/// The lock service a `[locks.<name>]` section describes, connected (or trying to: one that
/// cannot be used now is logged, naming the lock and what is wrong, and kept; its calls
/// fail as `Unavailable` until it can; etcd and ZooKeeper go on trying in the background).
pub(crate) async fn connect(config: &crate::config::LockBackendConfig) -> LockService {
    use crate::config::LockBackend;
    let name = &config.name;
    let made = match &config.backend {
        LockBackend::Etcd {
            endpoints,
            prefix,
            username,
            password,
            connect_timeout,
        } => Ok(LockService::Etcd(
            EtcdLocks::connect(EtcdSettings {
                name: name.clone(),
                endpoints: endpoints.clone(),
                prefix: prefix.clone(),
                user: username
                    .clone()
                    .map(|user| (user, password.clone().unwrap_or_default())),
                connect_timeout: *connect_timeout,
            })
            .await,
        )),
        LockBackend::ZooKeeper {
            connect,
            path,
            session_timeout,
        } => Ok(LockService::ZooKeeper(
            ZooKeeperLocks::connect(ZooKeeperSettings {
                name: name.clone(),
                connect: connect.clone(),
                path: path.clone(),
                session_timeout: *session_timeout,
            })
            .await,
        )),
        LockBackend::Mysql { url, table } => match MysqlLocks::new(name, url, table) {
            Ok(mysql) => {
                mysql.check_at_start(url).await;
                Ok(LockService::Mysql(Box::new(mysql)))
            }
            Err(error) => Err(error),
        },
        LockBackend::Redlock { urls, drift } => match RedlockLocks::new(urls, *drift) {
            Ok(redlock) => {
                redlock.check_at_start(name).await;
                Ok(LockService::Redlock(redlock))
            }
            Err(error) => Err(error),
        },
    };
    made.unwrap_or_else(|error| {
        tracing::error!(
            message = "Lock service cannot be set up; routes using it follow their \
                       on_redis_error.",
            lock = %name,
            backend = config.backend.kind(),
            %error,
        );
        LockService::Unusable
    })
}

/// What the backends' tests against real servers share.
#[cfg(test)]
pub(crate) mod testing {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{AcquireError, Grant, LockService};

    /// `path`'s lock for `lease`, waiting `wait` at most.
    pub(crate) async fn acquire(
        service: &LockService,
        path: &str,
        lease: Duration,
        wait: Duration,
    ) -> Result<Grant, AcquireError> {
        let resource = crate::coord::keyspace::serialized_resource(path);
        service
            .acquire(resource, path, lease, Instant::now() + wait)
            .await
    }

    /// `path`'s lock once the service can give it again (after its server came back),
    /// trying for `within` at most.
    pub(crate) async fn acquire_again(
        service: &LockService,
        path: &str,
        lease: Duration,
        within: Duration,
    ) -> Grant {
        let deadline = Instant::now() + within;
        loop {
            match acquire(service, path, lease, lease).await {
                Ok(grant) => return grant,
                Err(e) => assert!(Instant::now() < deadline, "still {e:?} after {within:?}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_jittered_and_stops_at_the_lease_end() {
        let mut backoff = Backoff::new();
        let mut caps = Vec::new();
        for _ in 0..8 {
            let cap = backoff.next;
            let sleep = backoff.next(Duration::from_secs(10));
            assert!(sleep >= cap / 2 && sleep <= cap, "{sleep:?} for {cap:?}");
            caps.push(cap.as_millis());
        }
        assert_eq!(caps, [5, 10, 20, 40, 80, 100, 100, 100]);
        assert!(backoff.next(Duration::ZERO) <= Backoff::MIN);
    }
}
