//! The Redis lock of serialized writes (see `locks.rs`).
//!
//! `<p>ser:{<r>}:lock` holds the owner id of the grant in force (`PX` lease);
//! `<p>ser:{<r>}:fence` the last token minted (`PX` idle expiry: no key is left behind for
//! an idle resource, and the clock floor makes its loss harmless). Both carry the
//! resource's hash tag, so ACQUIRE stays single-slot on a cluster.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;

use super::{AcquireError, Grant, Handle};
use crate::coord::events::{Event, EventKind, Waiters};
use crate::coord::{Keyspace, RedisConn, scripts};
use crate::metrics::RedisOp;

/// How long a resource's token key outlives its last grant.
const FENCE_IDLE: Duration = Duration::from_secs(24 * 3600);

/// After the holder's lease should have ended, a waiter tries again this much later (the
/// lease end is the holder's instance having died: one `SET NX` wins).
const TAKEOVER_SLACK: Duration = Duration::from_millis(20);

/// Mints the token of a grant just taken or passed on: `max(stored + 1, Redis TIME in µs)`,
/// stored back with the fence key's idle expiry (`KEYS[2]`, `ARGV[3]`); returns `{1, token}`.
const MINT: &str = r"
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local token = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
  if now > token then
    token = now
  end
  token = string.format('%.0f', token)
  redis.call('SET', KEYS[2], token, 'PX', ARGV[3])
  return {1, token}
";

/// Takes the lock and mints its token.
///
/// - `KEYS[1]` lock, `KEYS[2]` fence; `ARGV[1]` owner id, `ARGV[2]` lease ms, `ARGV[3]` the
///   fence key's idle expiry ms
/// - returns `{1, token}` granted (token as a decimal string), `{0, pttl}` held by another
///   for `pttl` more ms (a lock without expiry, never set by cacheguard, is given one)
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
{MINT}
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  pttl = tonumber(ARGV[2])
end
return {{0, pttl}}
"
    ))
});

/// Passes a held lock on to the next write of this instance: a full lease from now and a
/// fresh token, in one round trip instead of a release, its event and an acquire.
///
/// - the keys and arguments of [`ACQUIRE`]
/// - returns `{1, token}` passed on, `{0, ''}` the lock is no longer this owner's (its lease
///   ended: another may hold it, and nothing is changed)
static PASS_ON: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
{MINT}
end
return {{0, ''}}
"
    ))
});

/// The write locks in the shared Redis.
#[derive(Debug)]
pub(crate) struct RedisLocks {
    redis: RedisConn,
    keys: Keyspace,
    waiters: Arc<Waiters>,
    instance: u64,
}

impl RedisLocks {
    pub(crate) fn new(
        redis: RedisConn,
        keys: Keyspace,
        waiters: Arc<Waiters>,
        instance: u64,
    ) -> Self {
        RedisLocks {
            redis,
            keys,
            waiters,
            instance,
        }
    }

    pub(super) async fn acquire(
        &self,
        resource: u128,
        lease: Duration,
        deadline: Instant,
    ) -> Result<Grant, AcquireError> {
        let names = self.keys.serialized(resource);
        let owner = format!("{:032x}", rand::random::<u128>());
        let lease_ms = millis(lease).to_string();
        let idle_ms = millis(FENCE_IDLE.max(lease * 4)).to_string();
        // Registered before the first try: a release between the try and the wait wakes it.
        let Some(mut waiter) = self.waiters.try_register(resource, usize::MAX) else {
            return Err(AcquireError::Unavailable);
        };
        loop {
            let sent = Instant::now();
            let reply: (i64, String) = self
                .redis
                .run_script(
                    RedisOp::Serialize,
                    &ACQUIRE,
                    &[&names.lock, &names.fence],
                    &[owner.as_bytes(), lease_ms.as_bytes(), idle_ms.as_bytes()],
                )
                .await
                .map_err(|_| AcquireError::Unavailable)?;
            match reply {
                (1, token) => {
                    let token = token.parse().map_err(|_| AcquireError::Unavailable)?;
                    return Ok(Grant {
                        token,
                        expires: sent + lease,
                        resource,
                        owner,
                        handle: Handle::None,
                        key: String::new(),
                    });
                }
                (_, pttl) => {
                    let held = Duration::from_millis(pttl.parse().unwrap_or(0));
                    let retry = (Instant::now() + held + TAKEOVER_SLACK).min(deadline);
                    if Instant::now() >= deadline {
                        return Err(AcquireError::Timeout);
                    }
                    tokio::select! {
                        _ = waiter.changed() => {}
                        () = tokio::time::sleep_until(retry) => {}
                    }
                    if Instant::now() >= deadline {
                        return Err(AcquireError::Timeout);
                    }
                }
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
        let renewed: i64 = self
            .redis
            .run_script_past_breaker(
                RedisOp::Serialize,
                &scripts::RENEW,
                &[&names.lock],
                &[grant.owner.as_bytes(), millis(lease).to_string().as_bytes()],
            )
            .await
            .map_err(|_| AcquireError::Unavailable)?;
        if renewed == 1 {
            grant.expires = sent + lease;
        }
        Ok(renewed == 1)
    }

    /// `true`: `grant` holds a fresh token and a lease of `lease` from now; `false`: not
    /// passed on (the lock was lost, or Redis did not answer), and it is to be released.
    pub(super) async fn pass_on(&self, grant: &mut Grant, lease: Duration) -> bool {
        let names = self.keys.serialized(grant.resource);
        let lease_ms = millis(lease).to_string();
        let idle_ms = millis(FENCE_IDLE.max(lease * 4)).to_string();
        let sent = Instant::now();
        let reply: Result<(i64, String), _> = self
            .redis
            .run_script(
                RedisOp::Serialize,
                &PASS_ON,
                &[&names.lock, &names.fence],
                &[
                    grant.owner.as_bytes(),
                    lease_ms.as_bytes(),
                    idle_ms.as_bytes(),
                ],
            )
            .await;
        match reply {
            Ok((1, token)) => match token.parse() {
                Ok(token) => {
                    grant.token = token;
                    grant.expires = sent + lease;
                    true
                }
                Err(_) => false,
            },
            _ => false,
        }
    }

    /// `false` when Redis did not answer (the lock may still be held).
    pub(super) async fn release(&self, grant: &Grant) -> bool {
        let names = self.keys.serialized(grant.resource);
        let message = Event {
            kind: EventKind::Released,
            instance: self.instance,
            hash: grant.resource,
            floor: None,
        }
        .encode();
        // The fill lock's release: compare-and-delete, then wake the waiters.
        self.redis
            .run_script_past_breaker::<i64>(
                RedisOp::Serialize,
                &scripts::RELEASE,
                &[&names.lock, &names.lock],
                &[
                    grant.owner.as_bytes(),
                    self.keys.events_channel().as_bytes(),
                    message.as_bytes(),
                    b"",
                    b"0",
                ],
            )
            .await
            .is_ok()
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::test_redis::TestRedis;
    use prometheus::IntGauge;

    async fn locks_on(redis: &TestRedis) -> (RedisLocks, RedisConn) {
        let toml = format!(
            "[upstream]\nurl = \"http://127.0.0.1:9\"\n[redis]\nurl = \"{}\"\n\
             [[routes]]\nname = \"r\"\nmatch = \"/r/{{id}}\"\n",
            redis.url()
        );
        let vars = std::collections::HashMap::<String, String>::new();
        let config = crate::config::Config::from_toml(&toml, "test.toml", &vars).expect("config");
        let redis_config = config.redis.as_ref().expect("shared mode");
        let conn = RedisConn::start(
            redis_config,
            Metrics::unregistered(),
            tokio_util::sync::CancellationToken::new(),
        )
        .await
        .expect("redis");
        let keys = Keyspace::new(&redis_config.key_prefix);
        let waiters = Waiters::new(IntGauge::new("waiters", "test").expect("gauge"));
        (RedisLocks::new(conn.clone(), keys, waiters, 1), conn)
    }

    /// Against a real redis-server: with the breaker open (a short outage opened it, Redis
    /// answers again but no probe has closed it yet), a held lock is still renewed and
    /// released: the lock lapses only when Redis stays unreachable for the lease, as
    /// documented, not whenever the breaker opens.
    #[tokio::test]
    async fn a_held_lock_is_renewed_and_released_while_the_breaker_is_open() {
        let redis = TestRedis::start().await;
        let (locks, conn) = locks_on(&redis).await;
        let lease = Duration::from_secs(5);
        let mut grant = locks
            .acquire(7, lease, Instant::now() + Duration::from_secs(2))
            .await
            .expect("granted");
        conn.open_breaker();
        assert!(!conn.is_up(), "the breaker is open");
        assert!(
            matches!(locks.renew(&mut grant, lease).await, Ok(true)),
            "a renewal is refused while the breaker is open: the lock would lapse"
        );
        let lock = locks.keys.serialized(7).lock;
        let mut raw = redis.conn().await;
        let held: Option<String> = redis::cmd("GET")
            .arg(&lock)
            .query_async(&mut raw)
            .await
            .expect("GET");
        assert_eq!(held.as_deref(), Some(grant.owner.as_str()));
        assert!(locks.release(&grant).await, "the release was refused");
        let held: Option<String> = redis::cmd("GET")
            .arg(&lock)
            .query_async(&mut raw)
            .await
            .expect("GET");
        assert_eq!(held, None, "the release did not reach Redis");
    }
}
