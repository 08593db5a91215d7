//! The Lua scripts cacheguard runs in Redis. Each is one round trip and atomic; all keys of
//! one script share a cache key's hash tag, so they stay single-slot on a Redis Cluster.
//!
//! Key names (prefix `cg:` by default): `cg:{<hash>}:v` entry, `cg:{<hash>}:lock` lock token,
//! `cg:{<hash>}:gen` generation (absent = "0").

use std::sync::LazyLock;

use redis::Script;

/// Takes the fill lock for a key, and reads the key's generation in the same step.
///
/// - `KEYS[1]` lock, `KEYS[2]` generation
/// - `ARGV[1]` token (random per acquisition), `ARGV[2]` lease in ms
/// - returns `{1, generation, 0}` when acquired, `{0, generation, pttl}` when another
///   holder has it (`pttl` is its remaining lease in ms).
///
/// Reading the generation here, before the fetch starts, is what lets [`FILL`] refuse an
/// answer that an invalidation overtook while it was being fetched.
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local gen = redis.call('GET', KEYS[2]) or '0'
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, gen, 0}
end
return {0, gen, redis.call('PTTL', KEYS[1])}
",
    )
});

/// Extends the lease, only while the caller still holds the lock (compare-and-pexpire).
///
/// - `KEYS[1]` lock; `ARGV[1]` token, `ARGV[2]` lease in ms
/// - returns 1 when renewed, 0 when the lock is gone or held by someone else (lost).
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
",
    )
});

/// Releases the lock without a fill (the fetch failed or the answer is not shareable), and
/// tells the waiters why.
///
/// - `KEYS[1]` lock; `ARGV[1]` token, `ARGV[2]` channel, `ARGV[3]` event message
/// - returns 1 when released (and published), 0 when the lock was no longer ours: a late
///   release never deletes a newer holder's lock, and never wakes its waiters.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 1
end
return 0
",
    )
});

/// Stores a fetched entry, releases the lock and wakes the waiters, in one round trip.
///
/// - `KEYS[1]` entry, `KEYS[2]` lock, `KEYS[3]` generation
/// - `ARGV[1]` token, `ARGV[2]` generation read at acquisition, `ARGV[3]` encoded entry,
///   `ARGV[4]` entry TTL in ms, `ARGV[5]` channel, `ARGV[6]` `fill` message, `ARGV[7]`
///   `released` message
/// - returns 1 stored; 0 refused because the generation changed (an invalidation overtook
///   the fetch); -1 refused because another holder took the lock (ours expired and someone
///   else is fetching a newer answer).
///
/// The entry is stored only if the generation is unchanged and no other holder has the
/// lock. The lock is deleted only if it is still ours. Waiters get `fill` when there is
/// something to read, `released` (so one of them takes over) when we held the lock but
/// stored nothing.
pub(crate) static FILL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local gen = redis.call('GET', KEYS[3]) or '0'
local holder = redis.call('GET', KEYS[2])
local ours = holder == ARGV[1]
if gen ~= ARGV[2] then
  if ours then
    redis.call('DEL', KEYS[2])
    redis.call('PUBLISH', ARGV[5], ARGV[7])
  end
  return 0
end
if holder and not ours then
  return -1
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
if ours then
  redis.call('DEL', KEYS[2])
end
redis.call('PUBLISH', ARGV[5], ARGV[6])
return 1
",
    )
});

/// Invalidates a key for a write ("a delete voids the lease"): bumps its generation first,
/// so a fill whose fetch began before is refused, then deletes the entry and the lock, and
/// publishes `invalidate` so every instance drops its L1 copy.
/// - `KEYS[1]` entry, `KEYS[2]` lock, `KEYS[3]` generation
/// - `ARGV[1]` generation ttl in ms, `ARGV[2]` channel, `ARGV[3]` invalidate message
pub(crate) static INVALIDATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
",
    )
});
