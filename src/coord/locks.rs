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
//! - **etcd** (`etcd.rs`, `[locks.<name>] backend = "etcd"`): a key bound to a lease of the
//!   grant's own, created only if absent; the token is the key's create revision.
//! - **ZooKeeper** (`zookeeper.rs`, `backend = "zookeeper"`): Curator's `InterProcessMutex`
//!   recipe (ephemeral sequential nodes, the lowest holds), held by the process's session;
//!   the token is the lock node's `czxid`.

mod etcd;
mod memory;
mod redis;
#[cfg(test)]
pub(crate) mod test_servers;
mod zookeeper;

use std::time::Duration;

use tokio::time::Instant;

use self::etcd::{EtcdGrant, EtcdLocks, EtcdSettings};
pub(crate) use self::memory::MemoryLocks;
pub(crate) use self::redis::RedisLocks;
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
        }
    }

    /// Ends `grant` (if still held) and wakes the next waiter.
    pub(crate) async fn release(&self, grant: Grant) {
        match self {
            LockService::Redis(redis) => redis.release(grant).await,
            LockService::Memory(_) => {}
            LockService::Etcd(etcd) => etcd.release(grant).await,
            LockService::ZooKeeper(zk) => zk.release(grant),
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

/// The lock service a `[locks.<name>]` section describes, connected (or trying to: one that
/// cannot be reached is logged, naming the lock, and tried again in the background).
pub(crate) async fn connect(config: &crate::config::LockBackendConfig) -> LockService {
    match &config.backend {
        crate::config::LockBackend::Etcd {
            endpoints,
            prefix,
            username,
            password,
            connect_timeout,
        } => LockService::Etcd(
            EtcdLocks::connect(EtcdSettings {
                name: config.name.clone(),
                endpoints: endpoints.clone(),
                prefix: prefix.clone(),
                user: username
                    .clone()
                    .map(|user| (user, password.clone().unwrap_or_default())),
                connect_timeout: *connect_timeout,
            })
            .await,
        ),
        crate::config::LockBackend::ZooKeeper {
            connect,
            path,
            session_timeout,
        } => LockService::ZooKeeper(
            ZooKeeperLocks::connect(ZooKeeperSettings {
                name: config.name.clone(),
                connect: connect.clone(),
                path: path.clone(),
                session_timeout: *session_timeout,
            })
            .await,
        ),
        crate::config::LockBackend::Mysql { .. } | crate::config::LockBackend::Redlock { .. } => {
            unimplemented!("lock backend {} is being built", config.backend.kind())
        }
    }
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
