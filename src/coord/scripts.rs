//! The Lua scripts cacheguard runs in Redis. Each is one round trip and atomic; all keys of
//! one script share a cache key's hash tag, so they stay single-slot on a Redis Cluster.
//!
//! Key names (prefix `cg:` by default; see [`super::keyspace`]): `cg:{<base>}:v` entry,
//! `cg:{<base>}:lock` lock token, `cg:{<base>}:gen` generation, and for a
//! variant `cg:{<base>}:v:<hash>`, `cg:{<base>}:lock:<hash>`, indexed in `cg:{<base>}:vars`.
//! Tags: `cg:tag:{<t>}:keys` and `cg:tag:{<t>}:at` (see [`super::keyspace`]).
//!
//! Times come from Redis (`TIME`), one clock for every instance: a tag's invalidation time
//! is its node's clock, and a fill that carries the tag compares it with the same node's
//! clock read as it lists itself under the tag, less the time (measured by the filler) since
//! before its lock was asked for. No script of a cold miss reads the clock otherwise.
//!
//! A generation is a random integer, created by the first fill that finds none and moved
//! on (`INCR`) by every invalidation. A fill reads it before its fetch and is refused when
//! it differs afterwards — and when it is gone: a generation key evicted by a Redis under
//! an `allkeys-*` policy (or expired) may have carried a write that happened since, so its
//! absence never reads as "unchanged". There is no "absent = 0": after an eviction the
//! next fill creates a fresh random value, which no earlier fill read.
//!
//! The lock of a base key needs no generation: [`INVALIDATE`] deletes it in the same step
//! as it moves the generation on, so a base key's lock that is still the holder's when it
//! fills proves that no invalidation ran since it was taken (a lock gone for any other
//! reason — its lease lapsed, evicted, a failover — refuses the fill too). A variant's lock
//! is deleted by an invalidation only once the variant is listed in its base's index,
//! which its first fill does: variants, and fills without the lock, read the generation.
//!
//! Waiters on another instance's fetch mark the lock's `wait` key as they find it held;
//! [`FILL`] publishes `fill` only when that mark is there (or the lock is not the filler's):
//! a fill nobody waits on wakes nobody.
//!
//! A route with `version` also has a version floor per base key (`cg:{<base>}:floor`,
//! named only by the scripts of such routes): a write raises it to its answer's version
//! ([`INVALIDATE`]), a fill stores nothing older than it and raises it to its own version
//! ([`FILL`]), and a fill reads it before its fetch in the same round trip as the lock or
//! the generation ([`ACQUIRE`], [`BEGIN`]). Versions are canonical decimal strings (no
//! leading zeros; `-` is an answer without one), compared by length, then digit by digit:
//! exact at any size (no doubles) and whatever the server's collation.

/// Lua: Redis's clock in ms since the Unix epoch.
macro_rules! now_ms {
    () => {
        "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
    };
}

/// Lua: the key's generation (`KEYS[2]`) into `gen` (declared by the caller), created as
/// `ARGV[3]` when absent, and kept for at least `ARGV[4]` ms: it must outlive the fetch that
/// reads it now. `SET NX GET` reads and creates in one command (Redis 7).
macro_rules! generation {
    () => {
        r"
gen = redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4], 'GET')
if not gen then
  gen = ARGV[3]
elseif redis.call('PTTL', KEYS[2]) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
"
    };
}

/// Lua: `older(a, b)`, whether version `a` is below version `b` (canonical decimal
/// strings), and `raise_floor(key, version, life)`, which keeps the higher version in the
/// floor `key` for the longer of its remaining life and `life` ms.
macro_rules! floors {
    () => {
        r"
local function older(a, b)
  if #a ~= #b then
    return #a < #b
  end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x < y
    end
  end
  return false
end
local function raise_floor(key, version, life)
  local floor = redis.call('GET', key)
  local pttl = redis.call('PTTL', key)
  if not floor or older(floor, version) then
    if pttl > life then
      life = pttl
    end
    redis.call('SET', key, version, 'PX', life)
  elseif pttl >= 0 and pttl < life then
    redis.call('PEXPIRE', key, life)
  end
end
"
    };
}

use std::sync::LazyLock;

use redis::Script;

/// Takes the fill lock for a key, and for a variant reads its generation in the same step
/// (creating it when there is none: see the module docs).
///
/// - `KEYS[1]` lock, `KEYS[2]` generation, `KEYS[3]` entry, `KEYS[4]` the lock's waiters'
///   mark, `KEYS[5]` the version floor (named only when `ARGV[6]` is `1`)
/// - `ARGV[1]` token (random per acquisition), `ARGV[2]` lease in ms, `ARGV[3]` a fresh
///   random generation, `ARGV[4]` how long a generation (and a waiters' mark) must last at
///   least, in ms (longer than any fetch), `ARGV[5]` `1` when an entry already there
///   answers instead (a cold miss: a fill may have landed since the caller looked),
///   `ARGV[6]` `1` to read the version floor (a route with `version`), `ARGV[7]` `1` to
///   read the generation (a variant; a base key's lock fences its fill by itself)
/// - returns `{2, '', 0, 0, ''}` when `ARGV[5]` is `1` and the entry exists (nothing
///   taken), `{1, generation, 0, 0, floor}` when acquired (`generation` `''` when not
///   asked), `{0, '', pttl, repaired, floor}` when another holder has it (`pttl` is its
///   remaining lease in ms; the waiters' mark is set, so its fill wakes this waiter);
///   `floor` is the version floor (`''`: none, or not asked). A lock with no expiry (never
///   set by cacheguard: another client, or a bug) would stall the key for ever: it is
///   given a lease here, and `repaired` is 1.
///
/// The entry check spares a cold miss's leader a read of its own before it locks: one
/// command instead of two.
///
/// Reading the generation here (or, for a base key, holding the lock that every
/// invalidation deletes), before the fetch starts, is what lets [`FILL`] refuse an answer
/// that an invalidation overtook while it was being fetched.
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_SOURCE));

/// The source of [`ACQUIRE`], for `EVAL` in a pipeline (see
/// `RedisConn::run_script_replicated`).
pub(crate) const ACQUIRE_SOURCE: &str = concat!(
    r"
if ARGV[5] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then
  return {2, '', 0, 0, ''}
end
local floor = ''
if ARGV[6] == '1' then
  floor = redis.call('GET', KEYS[5]) or ''
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local gen = ''
  if ARGV[7] == '1' then
",
    generation!(),
    r"
  end
  return {1, gen, 0, 0, floor}
end
redis.call('SET', KEYS[4], '1', 'PX', ARGV[4])
local pttl = redis.call('PTTL', KEYS[1])
if pttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {0, '', tonumber(ARGV[2]), 1, floor}
end
return {0, '', pttl, 0, floor}
",
);

/// Begins a fill without the lock: reads the generation (creating it when there is none),
/// and the version floor when asked.
///
/// - `KEYS[1]` unused, `KEYS[2]` generation, `KEYS[3]` the version floor (named only when
///   `ARGV[5]` is `1`); `ARGV[3]`, `ARGV[4]` as for [`ACQUIRE`], `ARGV[5]` `1` to read the
///   floor
/// - returns `{generation, floor}` (`floor`: `''` when none, or not asked).
pub(crate) static BEGIN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        "local gen\n",
        generation!(),
        r"
local floor = ''
if ARGV[5] == '1' then
  floor = redis.call('GET', KEYS[3]) or ''
end
return {gen, floor}
",
    ))
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
/// tells the waiters why; a failed fetch may leave a copy of its answer for them.
///
/// - `KEYS[1]` lock, `KEYS[2]` the failure's key, named only when a failure is left: a
///   script of one key runs on a Redis Cluster slot being migrated (redis-rs follows its
///   `ASK`), one of two keys only once they are on one node (`TRYAGAIN` meanwhile)
/// - `ARGV[1]` token, `ARGV[2]` channel, `ARGV[3]` event message, `ARGV[4]` the encoded
///   failure (empty: none, and no `KEYS[2]`), `ARGV[5]` how long it is kept, in ms
/// - returns 1 when released (and published), 0 when the lock was no longer ours: a late
///   release never deletes a newer holder's lock, and never wakes its waiters.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[4] ~= '' then
    redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
  end
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  return 1
end
return 0
",
    )
});

/// Stores a fetched entry, releases the lock and wakes the waiters, in one round trip.
///
/// - `KEYS[1]` entry, `KEYS[2]` lock, `KEYS[3]` generation, `KEYS[4]` variant index,
///   `KEYS[5]` the base's write quarantine, `KEYS[6]` the lock's waiters' mark, `KEYS[7]`
///   the base's version floor (named only when `ARGV[9]` is not empty)
/// - `ARGV[1]` token, `ARGV[2]` generation read at acquisition (empty: a base key's lock,
///   which fences the fill by itself), `ARGV[3]` encoded entry, `ARGV[4]` entry TTL in ms,
///   `ARGV[5]` channel, `ARGV[6]` `fill` message, `ARGV[7]` `released` message, `ARGV[8]`
///   the variant's hash (empty for a base key), `ARGV[9]` the answer's version on a route
///   with `version` (`-`: it carries none; empty: the route has no `version`)
/// - returns 1 stored; 0 refused because the generation changed or is gone (an
///   invalidation overtook the fetch, or its trace was evicted) — for a fill fenced by its
///   lock, because the lock is gone; -1 refused because another holder took the lock (ours
///   expired and someone else is fetching a newer answer); -2 refused because a write
///   quarantines the key (its answer may come from a replica that has not caught up with
///   the write yet); -3 refused because the answer's version is below the key's floor, or
///   it has none while there is a floor (a fill stored a newer version since the fetch
///   began).
///
/// Everything it checks is read with one `MGET` (all keys share the base's hash tag). The
/// entry is stored only if the generation is unchanged (the lock still ours, for a fill
/// fenced by it), the key is not quarantined, its version reaches the floor and no other
/// holder has the lock; a stored version raises the floor to itself, for the entry's life
/// (so no later fill stores an older one). The lock (and its waiters' mark) is deleted
/// only if it is still ours. Waiters get `fill` when there is something to read — from a
/// holder only when one marked the lock as it waited (nobody else waits on it) —,
/// `released` (so one of them takes over) when nothing was stored because of an
/// invalidation — also when the invalidation already deleted our lock, or the waiters of a
/// variant (whose events carry the variant's hash, not the base's) would sleep until the
/// lease ran out. A variant is listed in the base's index, scored by its expiry (the only
/// step that reads Redis's clock); expired members are dropped on the way.
pub(crate) static FILL: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        floors!(),
        r"
local read
if ARGV[9] ~= '' then
  read = redis.call('MGET', KEYS[3], KEYS[2], KEYS[5], KEYS[6], KEYS[7])
else
  read = redis.call('MGET', KEYS[3], KEYS[2], KEYS[5], KEYS[6])
end
local gen, holder = read[1], read[2]
local quarantined, waited = read[3] ~= false, read[4] ~= false
local ours = holder == ARGV[1]
local changed
if ARGV[2] == '' then
  changed = not holder
else
  changed = gen ~= ARGV[2]
end
local behind = false
if ARGV[9] ~= '' and read[5] then
  behind = ARGV[9] == '-' or older(ARGV[9], read[5])
end
if changed or quarantined or behind then
  if ours then
    redis.call('DEL', KEYS[2], KEYS[6])
  end
  if ours or not holder then
    redis.call('PUBLISH', ARGV[5], ARGV[7])
  end
  if changed then
    return 0
  end
  if quarantined then
    return -2
  end
  return -3
end
if holder and not ours then
  return -1
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
if ARGV[8] ~= '' then
",
        now_ms!(),
        r"
  local ttl = tonumber(ARGV[4])
  redis.call('ZADD', KEYS[4], now + ttl, ARGV[8])
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if redis.call('PTTL', KEYS[4]) < ttl then
    redis.call('PEXPIRE', KEYS[4], ttl)
  end
end
if ARGV[9] ~= '' and ARGV[9] ~= '-' then
  raise_floor(KEYS[7], ARGV[9], tonumber(ARGV[4]))
end
if ours then
  redis.call('DEL', KEYS[2], KEYS[6])
end
if waited or not ours then
  redis.call('PUBLISH', ARGV[5], ARGV[6])
end
return 1
",
    ))
});

/// Invalidates a base key and all its variants ("a delete voids the lease"): bumps the
/// shared generation first, so a fill whose fetch began before is refused, then deletes the
/// entries and locks of the base and of every variant in its index, and publishes
/// `invalidate` so every instance drops its L1 copies.
///
/// - `KEYS[1]` entry, `KEYS[2]` lock, `KEYS[3]` generation, `KEYS[4]` variant index,
///   `KEYS[5]` write quarantine, `KEYS[6]` version floor (named only when `ARGV[6]` is not
///   empty), all of the base key
/// - `ARGV[1]` generation ttl in ms, `ARGV[2]` channel (empty: the caller publishes),
///   `ARGV[3]` invalidate message,
///   `ARGV[4]` the base's key prefix `cg:{<base>}:` (variant keys are built from it; they
///   share the hash tag, so the script stays single-slot), `ARGV[5]` quarantine in ms (0 =
///   none; a longer quarantine already set is kept): until it ends, [`FILL`] stores nothing
///   for the key, `ARGV[6]` a write's version (empty: none) and `ARGV[7]` how long its
///   floor lasts, in ms: the floor is raised to it (the higher version, the longer life
///   are kept), so [`FILL`] stores nothing older
/// - returns the number of variants deleted.
///
/// The floor is raised in the same step as the generation bump and the deletes: no fill
/// can store between them an answer older than the write.
pub(crate) static INVALIDATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        floors!(),
        r"
redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1], KEYS[2])
local vars = redis.call('ZRANGE', KEYS[4], 0, -1)
for _, h in ipairs(vars) do
  redis.call('DEL', ARGV[4] .. 'v:' .. h, ARGV[4] .. 'lock:' .. h)
end
redis.call('DEL', KEYS[4])
local q = tonumber(ARGV[5])
if q > 0 and redis.call('PTTL', KEYS[5]) < q then
  redis.call('SET', KEYS[5], '1', 'PX', q)
end
if ARGV[6] ~= '' then
  raise_floor(KEYS[6], ARGV[6], tonumber(ARGV[7]))
end
if ARGV[2] ~= '' then
  redis.call('PUBLISH', ARGV[2], ARGV[3])
end
return #vars
",
    ))
});

/// Lists a stored entry's base key under a tag, and reads when the tag was last
/// invalidated. Run before the entry's [`FILL`]: a tag invalidation either runs after this
/// (and finds the base in the index) or before it (and the filler sees its time).
///
/// - `KEYS[1]` the tag's index, `KEYS[2]` its invalidation time
/// - `ARGV[1]` member (`<base hex> <path>`), `ARGV[2]` the entry's life in ms
/// - returns `{at, now}`: the tag's last invalidation time in ms (0 if none), and this
///   node's clock, which `at` was read on too.
pub(crate) static TAG_ADD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        now_ms!(),
        r"
local life = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + life, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('PTTL', KEYS[1]) < life then
  redis.call('PEXPIRE', KEYS[1], life)
end
return {tonumber(redis.call('GET', KEYS[2]) or '0'), now}
",
    ))
});

/// Lists a base key in its shard of its route's index, and keeps the shard: drops the
/// members whose entries expired and takes off any expiry (a shard has none: members are
/// listed by a plain `ZADD` too, which could not extend one). One listing in
/// [`ROUTE_KEEP_EVERY`] runs this; the others are a plain `ZADD GT`. Sent with `EVAL` (its
/// source, not its digest): used this rarely, a process's first use would otherwise cost
/// a refused `EVALSHA` and a `SCRIPT LOAD` on each node.
///
/// - `KEYS[1]` the shard; `ARGV[1]` member (`<base hex> <path>`), `ARGV[2]` its score: the
///   latest its entry can expire, in Unix ms
pub(crate) const ROUTE_ADD: &str = concat!(
    now_ms!(),
    r"
redis.call('ZADD', KEYS[1], 'GT', ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PERSIST', KEYS[1])
return 1
",
);

/// One route listing in this many keeps its shard ([`ROUTE_ADD`]), chosen by the base key.
pub(crate) const ROUTE_KEEP_EVERY: u128 = 32;

/// Records that a tag is invalidated now, without listing its index (a pattern purge scans
/// the index itself, in chunks).
///
/// - `KEYS[1]` the tag's invalidation time; `ARGV[1]` how long to keep it, in ms
pub(crate) static TAG_TOUCH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        now_ms!(),
        r"
redis.call('SET', KEYS[1], now, 'PX', ARGV[1])
return now
",
    ))
});

/// Begins a tag invalidation: records its time (fills that began earlier and carry the tag
/// are refused from now on) and returns the live members of the tag's index.
///
/// - `KEYS[1]` the tag's index, `KEYS[2]` its invalidation time
/// - `ARGV[1]` how long the time must be kept, in ms (longer than any fill)
/// - returns the members whose entries have not expired.
pub(crate) static TAG_MARK: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        now_ms!(),
        r"
redis.call('SET', KEYS[2], now, 'PX', ARGV[1])
return redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
",
    ))
});
