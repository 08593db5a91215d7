//! Redlock over N independent Redis masters (see `locks.rs`), with a fencing token.
//!
//! ```text
//! acquire (owner: random per try)
//!  ├─ 1. on every master, LOCK: SET <lock> owner NX PX lease; when set, answer the
//!  │     master's last token and its TIME (µs), else the holder's PTTL
//!  ├─ 2. set on a majority: token = max over them of max(last + 1, TIME µs);
//!  │     on each of them, FENCE: while <lock> is still ours, <fence> = max(<fence>, token)
//!  ├─ 3. written on a majority, and validity left (start + lease − drift × lease − 2 ms
//!  │     is still ahead) ─▶ granted, `expires` = that instant
//!  └─ else UNLOCK on every master (compare-and-delete), then: fewer than a majority
//!       answered ─▶ Unavailable; else sleep (jittered, never past the holder's PTTL)
//!       and try again until the deadline ─▶ Timeout
//! renew: RENEW (compare-and-pexpire) on every master; a majority ─▶ held
//! release: UNLOCK on every master
//! ```
//!
//! **Why tokens only grow.** A grant wrote its token on a majority while it held the lock
//! there; the next grant locked a majority, which meets the first in at least one master,
//! where its `SET NX` came after the first's lock ended, so after its write: that master's
//! counter, read in the same script, is at least the first token. The master's clock is
//! the floor, so a master restarted empty does not lower it either (unless its clock was
//! stepped back).
//!
//! **Where Redlock is weaker** than a consensus store (etcd, ZooKeeper) or a database row:
//! its safety rests on timing. A lease is measured on each master's clock and on this
//! process's: a master whose clock jumps ahead ends a lease early, and a holder paused
//! (GC, SIGSTOP) past its validity still believes it holds (Kleppmann's critique; antirez
//! answers that the validity check after acquiring covers delays before the grant, not
//! after). A majority of masters restarted empty at once (no persistence) can grant the
//! lock to a second holder while the first still writes: only the origin's token check
//! refuses the older write then, and the token still grows by the clock floor.
//!
//! Each master has a connection of its own (never the shared Redis's), made on first use
//! and again after an error; every call to a master is bounded by a tenth of the lease
//! (10 ms to 250 ms) and by the caller's deadline, so a master that hangs costs that much
//! per call and a master that is down costs nothing.

use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use futures_util::future::join_all;
use redis::aio::MultiplexedConnection;
use redis::{FromRedisValue, Script};
use tokio::time::Instant;

use super::{AcquireError, Backoff, Grant, next_token};
use crate::coord::{Keyspace, scripts};

/// How long a resource's token key outlives its last grant on a master.
const FENCE_IDLE: Duration = Duration::from_secs(24 * 3600);
/// Redlock's constant added to the drift, for the resolution of the masters' clocks.
const DRIFT_FLOOR: Duration = Duration::from_millis(2);
/// How long a release may take (it runs after the origin answered, before the client hears).
const RELEASE_TIMEOUT: Duration = Duration::from_millis(250);
/// How long connecting to every master may take at start.
const START_TIMEOUT: Duration = Duration::from_secs(2);

/// Sets the lock when free, and reads the master's last token and clock.
///
/// - `KEYS[1]` lock, `KEYS[2]` fence; `ARGV[1]` owner id, `ARGV[2]` lease ms
/// - returns `{1, last token, TIME µs}` (decimal strings) when set, `{0, pttl}` when held
///   (a lock without expiry, never set by cacheguard, is given one)
static LOCK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = redis.call('GET', KEYS[2]) or '0'
  return {1, last, string.format('%.0f', now)}
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  pttl = tonumber(ARGV[2])
end
return {0, tostring(pttl)}
",
    )
});

/// Writes the token back, only while the lock is still the caller's (compare-and-set).
///
/// - `KEYS[1]` lock, `KEYS[2]` fence; `ARGV[1]` owner id, `ARGV[2]` token, `ARGV[3]` the
///   fence key's idle expiry ms
/// - returns 1 when written (or already as high), 0 when the lock is not the caller's
static FENCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[2]) > last then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
else
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return 1
",
    )
});

/// Deletes the lock, only while it is the caller's (compare-and-delete).
///
/// - `KEYS[1]` lock; `ARGV[1]` owner id
/// - returns 1 when deleted
static UNLOCK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
",
    )
});

/// One independent Redis master and its connection.
#[derive(Debug)]
struct Master {
    client: redis::Client,
    /// `redis://host:port` without a password, for logs.
    shown: String,
    /// Made on first use; dropped after an error or a timeout, and made again.
    conn: Mutex<Option<MultiplexedConnection>>,
    /// One connection attempt at a time; the others wait for it (bounded).
    connecting: tokio::sync::Mutex<()>,
}

impl Master {
    /// Runs `script` within `bound`; `None` when the master did not answer in time or failed.
    async fn call<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        bound: Instant,
    ) -> Option<T> {
        self.invoke(script, keys, args, bound).await.ok()
    }

    /// [`Master::call`], with what went wrong.
    async fn invoke<T: FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&str],
        bound: Instant,
    ) -> Result<T, Fault> {
        let mut conn = self.connection(bound).await?;
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let answer = tokio::time::timeout_at(bound, invocation.invoke_async(&mut conn)).await;
        if !matches!(answer, Ok(Ok(_))) {
            self.forget();
        }
        match answer {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(Fault::Redis(e)),
            Err(_) => Err(Fault::TimedOut),
        }
    }

    async fn connection(&self, bound: Instant) -> Result<MultiplexedConnection, Fault> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _turn = tokio::time::timeout_at(bound, self.connecting.lock())
            .await
            .map_err(|_| Fault::TimedOut)?;
        // Someone else may have connected while this one waited.
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        // The connection outlives this call: each call bounds its own answer (`call`).
        let limit = bound.saturating_duration_since(Instant::now());
        let settings = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(limit))
            .set_response_timeout(None);
        let conn = tokio::time::timeout_at(
            bound,
            self.client
                .get_multiplexed_async_connection_with_config(&settings),
        )
        .await
        .map_err(|_| Fault::TimedOut)?
        .map_err(Fault::Redis)?;
        *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = Some(conn.clone());
        Ok(conn)
    }

    fn current(&self) -> Option<MultiplexedConnection> {
        self.conn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn forget(&self) {
        *self.conn.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

/// Why a master could not be used.
#[derive(Debug)]
enum Fault {
    /// Its bound passed first.
    TimedOut,
    Redis(redis::RedisError),
}

impl Fault {
    /// What is wrong, in a user's words.
    fn explain(&self) -> String {
        let Fault::Redis(error) = self else {
            return "it did not answer in time".to_owned();
        };
        let refused_login = error.kind() == redis::ErrorKind::AuthenticationFailed
            || matches!(error.code(), Some("NOAUTH" | "WRONGPASS"));
        if refused_login {
            format!("the login was refused (check the user and password in its url): {error}")
        } else if error.code() == Some("NOPERM") {
            format!(
                "this user may not run the lock's scripts (it needs EVAL, EVALSHA, SET, GET, \
                 PTTL, PEXPIRE and DEL on the keys `cg:*`): {error}"
            )
        } else if error.is_io_error() {
            format!("it cannot be reached: {error}")
        } else {
            error.to_string()
        }
    }
}

/// What one master said to LOCK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Vote {
    /// Set: the master's last token and its clock in µs.
    Set { last: u64, now_us: u64 },
    /// Held by another for this much longer.
    Held(Duration),
    /// No answer in time.
    Silent,
}

impl Vote {
    fn of(answer: Option<Vec<String>>) -> Vote {
        let number = |s: Option<&String>| s.and_then(|s| s.parse::<u64>().ok());
        match answer.as_deref() {
            Some([flag, last, now]) if flag == "1" => match (number(Some(last)), number(Some(now)))
            {
                (Some(last), Some(now_us)) => Vote::Set { last, now_us },
                _ => Vote::Silent,
            },
            Some([_, pttl]) => Vote::Held(Duration::from_millis(number(Some(pttl)).unwrap_or(0))),
            _ => Vote::Silent,
        }
    }
}

/// The locks over a set of independent Redis masters.
#[derive(Debug)]
pub(crate) struct RedlockLocks {
    masters: Arc<[Master]>,
    keys: Keyspace,
    /// The clock drift allowed, as a fraction of the lease.
    drift: f64,
}

impl RedlockLocks {
    /// # Errors
    /// When a URL is not one the Redis client understands.
    pub(crate) fn new(urls: &[String], drift: f64) -> Result<Self, String> {
        let masters = urls
            .iter()
            .map(|url| {
                Ok(Master {
                    client: redis::Client::open(url.as_str())
                        .map_err(|e| format!("{}: {e}", crate::config::redact_url(url)))?,
                    shown: crate::config::redact_url(url),
                    conn: Mutex::new(None),
                    connecting: tokio::sync::Mutex::new(()),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(RedlockLocks {
            masters: masters.into(),
            keys: Keyspace::redlock(),
            drift,
        })
    }

    /// Runs a harmless script on every master (bounded: a login refused or a script
    /// refused shows then, not only an unreachable master) and logs what is wrong with each
    /// one that cannot be used.
    pub(crate) async fn check_at_start(&self, name: &str) {
        let bound = Instant::now() + START_TIMEOUT;
        // A compare-and-delete by an owner that never holds: it changes nothing.
        let probe = self.keys.serialized(0).lock;
        let (keys, args) = ([probe.as_str()], ["start-up check"]);
        let answers = join_all(
            self.masters
                .iter()
                .map(|m| m.invoke::<i64>(&UNLOCK, &keys, &args, bound)),
        )
        .await;
        let problems: Vec<String> = self
            .masters
            .iter()
            .zip(&answers)
            .filter_map(|(m, answer)| {
                let fault = answer.as_ref().err()?;
                Some(format!("{}: {}", m.shown, fault.explain()))
            })
            .collect();
        let up = self.masters.len() - problems.len();
        if problems.is_empty() {
            tracing::info!(
                message = "Lock service ready.",
                lock = %name,
                backend = "redlock",
                masters = self.masters.len(),
            );
        } else if up >= self.majority() {
            tracing::warn!(
                message = "Some Redlock masters cannot be used at start; locks are granted by \
                           the others while they are a majority.",
                lock = %name,
                problems = ?problems,
            );
        } else {
            tracing::error!(
                message = "Lock service not usable at start: fewer than a majority of its \
                           Redis masters can be used; routes using it follow their \
                           on_redis_error until they can.",
                lock = %name,
                backend = "redlock",
                up,
                needed = self.majority(),
                problems = ?problems,
            );
        }
    }

    fn majority(&self) -> usize {
        self.masters.len() / 2 + 1
    }

    /// The part of a lease taken off for clock drift.
    fn drift(&self, lease: Duration) -> Duration {
        lease.mul_f64(self.drift) + DRIFT_FLOOR
    }

    pub(super) async fn acquire(
        &self,
        resource: u128,
        lease: Duration,
        deadline: Instant,
    ) -> Result<Grant, AcquireError> {
        let names = self.keys.serialized(resource);
        let keys = [names.lock.as_str(), names.fence.as_str()];
        let lease_ms = millis(lease).to_string();
        let idle_ms = millis(FENCE_IDLE.max(lease * 4)).to_string();
        let mut backoff = Backoff::new();
        loop {
            let owner = format!("{:032x}", rand::random::<u128>());
            let started = Instant::now();
            let validity = started + lease.saturating_sub(self.drift(lease));
            let bound = (started + per_call(lease)).min(deadline);
            let args = [owner.as_str(), lease_ms.as_str()];
            let votes: Vec<Vote> = join_all(
                self.masters
                    .iter()
                    .map(|m| m.call::<Vec<String>>(&LOCK, &keys, &args, bound)),
            )
            .await
            .into_iter()
            .map(Vote::of)
            .collect();
            let tally = Tally::of(&votes);
            if tally.set.len() >= self.majority()
                && let Some(token) = tally.token()
            {
                let bound = (Instant::now() + per_call(lease)).min(deadline);
                let token_text = token.to_string();
                let args = [owner.as_str(), token_text.as_str(), idle_ms.as_str()];
                let written = join_all(
                    tally
                        .set
                        .iter()
                        .map(|&i| self.masters[i].call::<i64>(&FENCE, &keys, &args, bound)),
                )
                .await
                .into_iter()
                .filter(|answer| *answer == Some(1))
                .count();
                if written >= self.majority() && Instant::now() < validity {
                    return Ok(Grant {
                        token,
                        expires: validity,
                        resource,
                        owner,
                        key: String::new(),
                        handle: super::Handle::None,
                    });
                }
            }
            // Given back at once (not bounded by the deadline: keys left behind would keep
            // the next try, this one's or another's, from a majority for a lease).
            self.unlock_all(&names.lock, &owner, Instant::now() + per_call(lease))
                .await;
            if tally.answered() < self.majority() {
                return Err(AcquireError::Unavailable);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(AcquireError::Timeout);
            }
            tokio::time::sleep_until((now + backoff.next(tally.held_for())).min(deadline)).await;
            if Instant::now() >= deadline {
                return Err(AcquireError::Timeout);
            }
        }
    }

    pub(super) async fn renew(
        &self,
        grant: &mut Grant,
        lease: Duration,
    ) -> Result<bool, AcquireError> {
        let names = self.keys.serialized(grant.resource);
        let sent = Instant::now();
        // Past its validity a grant is lost, whatever the masters say now.
        if sent >= grant.expires {
            return Ok(false);
        }
        let bound = (sent + per_call(lease)).min(grant.expires);
        let lease_ms = millis(lease).to_string();
        let (keys, args) = (
            [names.lock.as_str()],
            [grant.owner.as_str(), lease_ms.as_str()],
        );
        let answers: Vec<Option<i64>> = join_all(
            self.masters
                .iter()
                .map(|m| m.call::<i64>(&scripts::RENEW, &keys, &args, bound)),
        )
        .await;
        let renewed = answers.iter().filter(|a| **a == Some(1)).count();
        let refused = answers.iter().filter(|a| **a == Some(0)).count();
        if renewed >= self.majority() {
            grant.expires = sent + lease.saturating_sub(self.drift(lease));
            Ok(true)
        } else if refused > self.masters.len() - self.majority() {
            Ok(false)
        } else {
            Err(AcquireError::Unavailable)
        }
    }

    /// `false` when fewer than a majority answered (the lock may still hold there).
    pub(super) async fn release(&self, grant: &Grant) -> bool {
        let names = self.keys.serialized(grant.resource);
        self.unlock_all(&names.lock, &grant.owner, Instant::now() + RELEASE_TIMEOUT)
            .await
            >= self.majority()
    }

    /// UNLOCK on every master, within `bound`: how many answered.
    async fn unlock_all(&self, lock: &str, owner: &str, bound: Instant) -> usize {
        let (keys, args) = ([lock], [owner]);
        join_all(
            self.masters
                .iter()
                .map(|m| m.call::<i64>(&UNLOCK, &keys, &args, bound)),
        )
        .await
        .iter()
        .filter(|answer| answer.is_some())
        .count()
    }
}

/// The votes of one try, by kind.
#[derive(Debug, Default)]
struct Tally {
    /// Indexes of the masters that set the lock, with their last token and clock.
    set: Vec<usize>,
    proposals: Vec<u64>,
    held: Vec<Duration>,
}

impl Tally {
    fn of(votes: &[Vote]) -> Tally {
        let mut tally = Tally::default();
        for (i, vote) in votes.iter().enumerate() {
            match *vote {
                Vote::Set { last, now_us } => {
                    tally.set.push(i);
                    tally.proposals.push(next_token(last, now_us));
                }
                Vote::Held(left) => tally.held.push(left),
                Vote::Silent => {}
            }
        }
        tally
    }

    /// Above every token the setting masters have seen, and at least their clocks.
    fn token(&self) -> Option<u64> {
        self.proposals.iter().copied().max()
    }

    fn answered(&self) -> usize {
        self.set.len() + self.held.len()
    }

    /// How long until the holder's lock ends on the masters that refused (the shortest).
    fn held_for(&self) -> Duration {
        self.held.iter().copied().min().unwrap_or(Duration::ZERO)
    }
}

/// The bound of one call to one master: a tenth of the lease, 10 ms to 250 ms.
fn per_call(lease: Duration) -> Duration {
    (lease / 10).clamp(Duration::from_millis(10), Duration::from_millis(250))
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_redis::TestRedis;

    const LEASE: Duration = Duration::from_secs(10);

    async fn masters(n: usize) -> Vec<TestRedis> {
        let mut servers = Vec::new();
        for _ in 0..n {
            servers.push(TestRedis::start().await);
        }
        servers
    }

    fn service(servers: &[TestRedis]) -> RedlockLocks {
        let urls: Vec<String> = servers.iter().map(TestRedis::url).collect();
        RedlockLocks::new(&urls, 0.01).expect("Redis URLs")
    }

    fn within(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    async fn grant(locks: &RedlockLocks) -> Grant {
        locks
            .acquire(7, LEASE, within(2_000))
            .await
            .expect("granted")
    }

    /// A connection made with little of a call's bound left is kept for later calls: it
    /// must not keep that bound as its response timeout (it did: every later answer slower
    /// than it failed, and the connection was made again).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_made_late_in_a_call_keeps_no_short_timeout() {
        let servers = masters(1).await;
        let locks = service(&servers);
        let master = &locks.masters[0];
        assert!(master.connection(within(50)).await.is_ok());
        // About 100 ms of Lua on this machine: slower than the first call's bound.
        let slow = Script::new("local n = 0 for i = 1, 20000000 do n = n + 1 end return 1");
        let started = Instant::now();
        let answer = master.call::<i64>(&slow, &[], &[], within(5_000)).await;
        assert!(
            started.elapsed() > Duration::from_millis(50),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(answer, Some(1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn grants_exclude_renew_release_and_tokens_grow() {
        let servers = masters(3).await;
        let (a, b) = (service(&servers), service(&servers));
        let mut first = grant(&a).await;
        assert!(first.expires <= Instant::now() + LEASE - LEASE / 100);
        assert_eq!(
            b.acquire(7, LEASE, within(150)).await.map(|g| g.token),
            Err(AcquireError::Timeout)
        );
        assert_eq!(a.renew(&mut first, LEASE).await, Ok(true));
        let token = first.token;
        a.release(&first).await;
        drop(first);
        let second = grant(&b).await;
        assert!(second.token > token, "{} after {token}", second.token);
        // The token was written back to the masters of the grant.
        let mut written = 0;
        for server in &servers {
            let fence: Option<u64> = redis::cmd("GET")
                .arg(Keyspace::redlock().serialized(7).fence)
                .query_async(&mut server.conn().await)
                .await
                .expect("GET");
            written += usize::from(fence == Some(second.token));
        }
        assert!(written >= 2, "on a majority: {written}");
        b.release(&second).await;
        drop(second);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_grant_past_its_validity_is_taken_over_and_its_renewal_says_lost() {
        let servers = masters(3).await;
        let (a, b) = (service(&servers), service(&servers));
        let lease = Duration::from_millis(300);
        let mut old = a.acquire(7, lease, within(1_000)).await.expect("granted");
        let new = b
            .acquire(7, LEASE, within(2_000))
            .await
            .expect("taken over");
        assert!(new.token > old.token);
        assert_eq!(a.renew(&mut old, lease).await, Ok(false));
        a.release(&old).await;
        drop(old);
        assert!(
            a.acquire(7, LEASE, within(150)).await.is_err(),
            "still the new holder's"
        );
    }

    /// A minority down: grants go on. A majority down: `Unavailable` at once (within a
    /// call's bound), not at the deadline. One master restarted empty: tokens still grow.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_minority_down_grants_a_majority_down_does_not_and_tokens_grow() {
        let mut servers = masters(5).await;
        let locks = service(&servers);
        let first = grant(&locks).await;
        let last = first.token;
        locks.release(&first).await;
        drop(first);
        servers[0].kill();
        servers[1].kill();
        let next = grant(&locks).await;
        assert!(next.token > last);
        locks.release(&next).await;
        drop(next);
        servers[2].kill();
        let started = Instant::now();
        let down = locks.acquire(7, LEASE, within(5_000)).await;
        assert_eq!(down.map(|g| g.token), Err(AcquireError::Unavailable));
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        let mut before = 0;
        for server in &mut servers[..3] {
            server.restart().await;
        }
        // Three of five restarted empty at once: only the clock floor keeps the order.
        for _ in 0..3 {
            let grant = grant(&locks).await;
            assert!(grant.token > before);
            before = grant.token;
            locks.release(&grant).await;
            drop(grant);
        }
    }

    /// Takers of several instances at once: one grant at a time, tokens distinct.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_takers_get_one_grant_at_a_time() {
        let servers = masters(3).await;
        let services: Vec<std::sync::Arc<RedlockLocks>> = (0..4)
            .map(|_| std::sync::Arc::new(service(&servers)))
            .collect();
        let held = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let (locks, held) = (
                    std::sync::Arc::clone(&services[i % 4]),
                    std::sync::Arc::clone(&held),
                );
                tokio::spawn(async move {
                    let grant = locks
                        .acquire(7, LEASE, within(20_000))
                        .await
                        .expect("every taker gets its turn");
                    assert_eq!(
                        held.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                        0,
                        "two holders"
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    held.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    let token = grant.token;
                    locks.release(&grant).await;
                    drop(grant);
                    token
                })
            })
            .collect();
        let mut tokens = Vec::new();
        for task in tasks {
            tokens.push(task.await.expect("taker"));
        }
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens.len(), 16);
    }

    fn set(last: u64, now_us: u64) -> Vote {
        Vote::Set { last, now_us }
    }

    #[test]
    fn the_token_is_above_every_counter_of_the_majority_and_their_clocks() {
        let tally = Tally::of(&[set(500, 10), set(900, 20), Vote::Silent]);
        assert_eq!(tally.set, vec![0, 1]);
        assert_eq!(tally.token(), Some(901));
        // A master restarted empty: its clock is the floor.
        let tally = Tally::of(&[set(0, 1_000_000), set(900, 20), Vote::Held(Duration::ZERO)]);
        assert_eq!(tally.token(), Some(1_000_000));
        assert_eq!(tally.answered(), 3);
    }

    #[test]
    fn votes_are_read_from_the_script_answers() {
        let s = |v: &[&str]| Some(v.iter().map(|s| (*s).to_owned()).collect());
        assert_eq!(Vote::of(s(&["1", "41", "1700"])), set(41, 1700));
        assert_eq!(
            Vote::of(s(&["0", "250"])),
            Vote::Held(Duration::from_millis(250))
        );
        assert_eq!(Vote::of(None), Vote::Silent);
        assert_eq!(Vote::of(s(&["1", "x", "1"])), Vote::Silent);
    }

    #[test]
    fn a_waiter_sleeps_no_longer_than_the_shortest_hold() {
        let tally = Tally::of(&[
            Vote::Held(Duration::from_millis(300)),
            Vote::Held(Duration::from_millis(40)),
            Vote::Silent,
        ]);
        assert_eq!(tally.held_for(), Duration::from_millis(40));
        assert_eq!(tally.answered(), 2);
    }

    #[test]
    fn calls_are_bounded_by_a_tenth_of_the_lease() {
        assert_eq!(per_call(Duration::from_secs(1)), Duration::from_millis(100));
        assert_eq!(
            per_call(Duration::from_millis(50)),
            Duration::from_millis(10)
        );
        assert_eq!(
            per_call(Duration::from_secs(30)),
            Duration::from_millis(250)
        );
    }
}
