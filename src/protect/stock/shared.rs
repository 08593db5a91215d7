//! The Redis side of the stock gates (shared mode): one Lua script per decision, on the
//! node of the resource segment's keys (`coord/keyspace.rs`, `stock`).
//!
//! A segment is a hash (`n` units available, `rsv` units reserved by buys in flight), a
//! sorted set of live reservations (member `<units>.<id>`, score the deadline in Redis
//! ms), a sorted set of recently consumed reservations (score: when), and, in the
//! segment that is an idempotency key's home, that key's record (`record.rs`). Every key
//! expires at most [`super::IDLE`] after its last buy (BUY pushes the expiry back once per
//! half of it, see [`BUY`]), so no resource is kept for ever; a resource whose keys
//! expired is loaded again from the origin on its next buy.
//!
//! Expired reservations (their instance died, or was paused past the deadline) are removed
//! by the next buy or reconcile, **without** giving their units back: the buy may have
//! reached the origin. The buy that notices asks for a reconcile, which takes the number
//! from the origin.

use std::sync::LazyLock;

use redis::{Script, Value};

use super::ops::{Applied, Buy, BuyRequest, Sale, SalesSettled, Settle, Settled};
use crate::coord::Keyspace;
use crate::coord::keyspace::StockKeys;
use crate::coord::redis::{RedisConn, Unavailable};
use crate::metrics::RedisOp;

/// Lua: Redis's clock in ms since the Unix epoch, in `now`.
const NOW: &str = "local t = redis.call('TIME')\n\
                   local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n";

/// Lua: the units of a reservation member `<units>.<id>` (0 for a malformed one).
const UNITS_OF: &str = "local function units_of(member)\n\
                        return tonumber(string.match(member, '^(%d+)%.') or '0') or 0\n\
                        end\n";

/// Takes `units` from a segment for one buy, or says why not.
///
/// - `KEYS[1]` state, `KEYS[2]` reservations, `KEYS[3]` the idempotency record (or
///   `KEYS[1]` again when `ARGV[5]` is not `1`)
/// - `ARGV[1]` units, `ARGV[2]` the reservation member, `ARGV[3]` the reservation's ttl in
///   ms, `ARGV[4]` the idle expiry in ms, `ARGV[5]` `1`: check and claim the record,
///   `ARGV[6]` the in-flight record, `ARGV[7]` `1`: claim it even when this segment has too
///   few units (another segment is tried next), `ARGV[8]` the body's fingerprint (16 hex),
///   `ARGV[9]` `1`: a record in doubt with this fingerprint is taken up again (`{4, …}`);
///   otherwise it is answered `{2, record}` like any other
/// - returns `{0, left, expired}` taken; `{1, left, expired}` too few; `{2, record}` the key
///   has a record (and `{1, left, expired, reserved}` for too few: `reserved` the units of
///   buys in flight); `{4, record}` its buy was in doubt and this request goes on with it (the
///   record is in flight again); `{3}` the segment is not loaded. `expired` is the units of
///   the expired reservations this call removed (a reconcile should run).
///
/// The state is read once (`HMGET`) and written once (`HSET`). Its keys' idle expiry is
/// pushed back only every half of it (the state's `fresh` field says until when it need
/// not be), and on the reservations when they were empty (the set may be new): every
/// key still expires after at most `ARGV[4]` without a buy, at a cost of two commands
/// per half-life instead of per buy.
static BUY: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}{UNITS_OF}{}",
        r"
if ARGV[5] == '1' then
  local record = redis.call('GET', KEYS[3])
  if record then
    if ARGV[9] == '1' and string.sub(record, 1, 1) == 'U' and string.sub(record, 3, 18) == ARGV[8] then
      redis.call('SET', KEYS[3], 'P' .. string.sub(record, 2), 'PX', ARGV[3])
      return {4, record}
    end
    return {2, record}
  end
end
local state = redis.call('HMGET', KEYS[1], 'n', 'rsv', 'fresh')
if not state[1] then
  return {3}
end
local n = tonumber(state[1])
local rsv = tonumber(state[2] or '0')
local expired = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 64)) do
  expired = expired + units_of(member)
  redis.call('ZREM', KEYS[2], member)
end
rsv = rsv - expired
local units = tonumber(ARGV[1])
if n < units then
  if expired > 0 then
    redis.call('HSET', KEYS[1], 'rsv', rsv)
  end
  if ARGV[7] == '1' then
    redis.call('SET', KEYS[3], ARGV[6], 'PX', ARGV[3])
  end
  return {1, n, expired, rsv}
end
local empty = rsv <= 0
n = n - units
rsv = rsv + units
local idle = tonumber(ARGV[4])
local refresh = now >= tonumber(state[3] or '0')
if refresh then
  redis.call('HSET', KEYS[1], 'n', n, 'rsv', rsv, 'fresh', now + math.floor(idle / 2))
  redis.call('PEXPIRE', KEYS[1], idle)
else
  redis.call('HSET', KEYS[1], 'n', n, 'rsv', rsv)
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[2])
if refresh or empty then
  redis.call('PEXPIRE', KEYS[2], idle)
end
if ARGV[5] == '1' then
  redis.call('SET', KEYS[3], ARGV[6], 'PX', ARGV[3])
end
return {0, n, expired}
"
    ))
});

/// What the origin's answer meant for a reservation.
///
/// - `KEYS[1]` state, `KEYS[2]` reservations, `KEYS[3]` consumed, `KEYS[4]` the record (or
///   `KEYS[1]` again when `ARGV[6]` is not `1`)
/// - `ARGV[1]` the member, `ARGV[2]` `sold` | `back` | `none` (the origin has none left) |
///   `doubt`, `ARGV[3]` units, `ARGV[4]` idle expiry ms, `ARGV[5]` how long consumed members
///   are kept (ms), `ARGV[6]` `1`: write the record `ARGV[7]` for `ARGV[8]` ms; `2`:
///   delete the record if it names this reservation (a buy whose answer was lost);
///   `ARGV[9]` how long ago (ms) the origin answered: a sale is consumed as of then
/// - returns `{removed, left, reserved}`: whether the reservation was still live, the units
///   left (-1: the segment is not loaded; its units are not touched then) and the units
///   still reserved by buys in flight.
static SETTLE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}{}",
        r"
local removed = 0
if ARGV[2] ~= 'doubt' and ARGV[1] ~= '' then
  removed = redis.call('ZREM', KEYS[2], ARGV[1])
end
local units = tonumber(ARGV[3])
if removed == 1 then
  redis.call('HINCRBY', KEYS[1], 'rsv', -units)
end
local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '-1')
if ARGV[2] == 'sold' and ARGV[1] ~= '' then
  redis.call('ZADD', KEYS[3], now - tonumber(ARGV[9]), ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[5]))
  redis.call('PEXPIRE', KEYS[3], ARGV[4])
elseif ARGV[2] == 'back' then
  if removed == 1 and n >= 0 then
    n = redis.call('HINCRBY', KEYS[1], 'n', units)
  end
elseif ARGV[2] == 'none' then
  if n > 0 then
    redis.call('HSET', KEYS[1], 'n', 0)
    n = 0
  end
end
if ARGV[6] == '1' then
  redis.call('SET', KEYS[4], ARGV[7], 'PX', ARGV[8])
elseif ARGV[6] == '2' then
  local record = redis.call('GET', KEYS[4])
  if record and string.find(record, ARGV[1], 1, true) then
    redis.call('DEL', KEYS[4])
  end
end
return {removed, n, tonumber(redis.call('HGET', KEYS[1], 'rsv') or '0')}
"
    ))
});

/// Settles a batch of sales of one segment: what [`SETTLE`] does for `sold`, for every
/// member at once, so its cost per sale falls with the batch.
///
/// - `KEYS[1]` state, `KEYS[2]` reservations, `KEYS[3]` consumed
/// - `ARGV[1]` idle expiry ms, `ARGV[2]` how long consumed members are kept (ms), then per
///   sale two: its member and how long ago (ms) the origin answered
/// - returns `{left, reserved}` afterwards (`left` -1: the segment is not loaded)
static SETTLE_SALES: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}{UNITS_OF}{}",
        r"
local members, consumed = {}, {}
for i = 3, #ARGV, 2 do
  members[#members + 1] = ARGV[i]
  consumed[#consumed + 1] = now - tonumber(ARGV[i + 1])
  consumed[#consumed + 1] = ARGV[i]
end
local live = redis.call('ZMSCORE', KEYS[2], unpack(members))
local removed, units = {}, 0
for i, score in ipairs(live) do
  if score then
    removed[#removed + 1] = members[i]
    units = units + units_of(members[i])
  end
end
local rsv
if #removed > 0 then
  redis.call('ZREM', KEYS[2], unpack(removed))
  rsv = redis.call('HINCRBY', KEYS[1], 'rsv', -units)
end
redis.call('ZADD', KEYS[3], unpack(consumed))
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[3], ARGV[1])
local state = redis.call('HMGET', KEYS[1], 'n', 'rsv')
return {tonumber(state[1] or '-1'), tonumber(state[2] or '0')}
"
    ))
});

/// A reconcile's step on one segment: `n = budget − reserved − consumed since`, where
/// `budget` is the segment's share of what the origin said is left, `reserved` the units of
/// its live reservations (counted again here: the `rsv` field is only a cache of it) and
/// `consumed since` the units of sales settled after the reconcile began, which the
/// origin's number may not show yet.
///
/// - `KEYS[1]` state, `KEYS[2]` reservations, `KEYS[3]` consumed
/// - `ARGV[1]` budget, `ARGV[2]` since (Redis ms), `ARGV[3]` idle expiry ms, `ARGV[4]` how
///   long consumed members are kept (ms)
/// - returns `{old, new}` (`old` = -1 when the segment was not loaded)
static APPLY: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}{UNITS_OF}{}",
        r"
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local rsv = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  rsv = rsv + units_of(member)
end
local recent = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], ARGV[2], '+inf')) do
  recent = recent + units_of(member)
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[4]))
local n = tonumber(ARGV[1]) - rsv - recent
if n < 0 then
  n = 0
end
local old = tonumber(redis.call('HGET', KEYS[1], 'n') or '-1')
redis.call('HSET', KEYS[1], 'n', n, 'rsv', rsv)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return {old, n}
"
    ))
});

/// Redis's clock on the node of `KEYS[1]`, in ms (a script, so a cluster routes it there).
static CLOCK: LazyLock<Script> = LazyLock::new(|| Script::new(&format!("{NOW}return now\n")));

/// A reconcile turn: `SET … NX PX`, so one instance at a time asks the origin.
static TURN: LazyLock<Script> = LazyLock::new(|| {
    Script::new("return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0")
});

/// The stock ledger in Redis.
#[derive(Clone, Debug)]
pub(crate) struct RedisLedger {
    redis: RedisConn,
    keys: Keyspace,
}

impl RedisLedger {
    pub(crate) fn new(redis: RedisConn, keys: Keyspace) -> Self {
        RedisLedger { redis, keys }
    }

    /// False while the breaker is open: a command would fail unsent.
    pub(crate) fn up(&self) -> bool {
        self.redis.is_up()
    }

    fn segment(&self, resource: u128, segment: u16) -> StockKeys {
        self.keys.stock(resource, segment)
    }

    pub(crate) async fn buy(
        &self,
        resource: u128,
        segment: u16,
        request: &BuyRequest<'_>,
    ) -> Result<Buy, Unavailable> {
        let keys = self.segment(resource, segment);
        let record = request
            .record
            .as_ref()
            .map(|r| self.segment(resource, r.home).idempotency(r.key));
        let units = request.units.to_string();
        let ttl = request.ttl_ms.to_string();
        let idle = request.idle_ms.to_string();
        let flag = |on: bool| if on { "1" } else { "0" };
        let (check, pending, claim, fingerprint, reclaim) = match &request.record {
            Some(r) => (
                "1",
                r.pending.as_slice(),
                flag(r.claim_when_short),
                format!("{:016x}", r.fingerprint),
                flag(r.reclaim),
            ),
            None => ("0", &[][..], "0", String::new(), "0"),
        };
        let record_key = record.as_deref().unwrap_or(&keys.state);
        let reply: Vec<Value> = self
            .redis
            .run_script(
                RedisOp::Stock,
                &BUY,
                &[&keys.state, &keys.reservations, record_key],
                &[
                    units.as_bytes(),
                    request.member.as_bytes(),
                    ttl.as_bytes(),
                    idle.as_bytes(),
                    check.as_bytes(),
                    pending,
                    claim.as_bytes(),
                    fingerprint.as_bytes(),
                    reclaim.as_bytes(),
                ],
            )
            .await?;
        Ok(parse_buy(&reply))
    }

    /// Settles `sales` of one segment in one script (see [`SETTLE_SALES`]).
    pub(crate) async fn settle_sales(
        &self,
        resource: u128,
        segment: u16,
        sales: &[Sale],
        idle_ms: u64,
        consumed_kept_ms: u64,
    ) -> Result<SalesSettled, Unavailable> {
        let keys = self.segment(resource, segment);
        let mut args: Vec<Vec<u8>> = Vec::with_capacity(2 + 2 * sales.len());
        args.push(idle_ms.to_string().into_bytes());
        args.push(consumed_kept_ms.to_string().into_bytes());
        for sale in sales {
            args.push(sale.member.clone().into_bytes());
            args.push(sale.answered.elapsed().as_millis().to_string().into_bytes());
        }
        let args: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
        let reply: Vec<i64> = self
            .redis
            .run_script(
                RedisOp::Stock,
                &SETTLE_SALES,
                &[&keys.state, &keys.reservations, &keys.consumed],
                &args,
            )
            .await?;
        Ok(SalesSettled {
            left: reply.first().copied().unwrap_or(-1),
            reserved: u64::try_from(reply.get(1).copied().unwrap_or(0)).unwrap_or(0),
        })
    }

    pub(crate) async fn settle(
        &self,
        resource: u128,
        segment: u16,
        settle: &Settle,
    ) -> Result<Settled, Unavailable> {
        let keys = self.segment(resource, segment);
        let units = settle.units.to_string();
        let idle = settle.idle_ms.to_string();
        let kept = settle.consumed_kept_ms.to_string();
        let record_ttl = settle.record.as_ref().map_or(0, |r| r.ttl_ms).to_string();
        let age = settle.answered.elapsed().as_millis().to_string();
        // The record goes with the script when it lives in this segment (single-slot);
        // otherwise the caller writes it on its own.
        let record_key = settle
            .record
            .as_ref()
            .filter(|r| r.home == segment)
            .map(|r| keys.idempotency(r.key));
        let (record_op, record_value): (&[u8], &[u8]) = match (&settle.record, &record_key) {
            (Some(record), Some(_)) if record.forget => (b"2", &[]),
            (Some(record), Some(_)) => (b"1", record.value.as_slice()),
            _ => (b"0", &[]),
        };
        let reply: Vec<i64> = self
            .redis
            .run_script(
                RedisOp::Stock,
                &SETTLE,
                &[
                    &keys.state,
                    &keys.reservations,
                    &keys.consumed,
                    record_key.as_deref().unwrap_or(&keys.state),
                ],
                &[
                    settle.member.as_bytes(),
                    settle.outcome.as_str().as_bytes(),
                    units.as_bytes(),
                    idle.as_bytes(),
                    kept.as_bytes(),
                    record_op,
                    record_value,
                    record_ttl.as_bytes(),
                    age.as_bytes(),
                ],
            )
            .await?;
        if let Some(record) = settle
            .record
            .as_ref()
            .filter(|r| r.home != segment && !r.forget)
        {
            self.write_record(
                resource,
                record.home,
                record.key,
                Some((&record.value, record.ttl_ms)),
            )
            .await?;
        }
        Ok(Settled {
            removed: reply.first().copied() == Some(1),
            left: reply.get(1).copied().unwrap_or(-1),
            reserved: u64::try_from(reply.get(2).copied().unwrap_or(0)).unwrap_or(0),
        })
    }

    /// Writes (or, with `None`, deletes) an idempotency key's record.
    pub(crate) async fn write_record(
        &self,
        resource: u128,
        home: u16,
        key: u128,
        record: Option<(&[u8], u64)>,
    ) -> Result<(), Unavailable> {
        let name = self.segment(resource, home).idempotency(key);
        let cmd = match record {
            Some((value, ttl_ms)) => {
                let mut cmd = redis::cmd("SET");
                cmd.arg(&name).arg(value).arg("PX").arg(ttl_ms.max(1));
                cmd
            }
            None => {
                let mut cmd = redis::cmd("DEL");
                cmd.arg(&name);
                cmd
            }
        };
        self.redis
            .query::<Value>(RedisOp::Stock, &cmd)
            .await
            .map(|_| ())
    }

    pub(crate) async fn read_record(
        &self,
        resource: u128,
        home: u16,
        key: u128,
    ) -> Result<Option<Vec<u8>>, Unavailable> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.segment(resource, home).idempotency(key));
        self.redis.query(RedisOp::Stock, &cmd).await
    }

    /// Redis's clock on the node of a resource's segment.
    pub(crate) async fn clock(&self, resource: u128, segment: u16) -> Result<u64, Unavailable> {
        let keys = self.segment(resource, segment);
        let now: i64 = self
            .redis
            .run_script(RedisOp::Stock, &CLOCK, &[&keys.state], &[])
            .await?;
        Ok(u64::try_from(now).unwrap_or(0))
    }

    pub(crate) async fn apply(
        &self,
        resource: u128,
        segment: u16,
        budget: u64,
        since_ms: u64,
        idle_ms: u64,
        consumed_kept_ms: u64,
    ) -> Result<Applied, Unavailable> {
        let keys = self.segment(resource, segment);
        let reply: Vec<i64> = self
            .redis
            .run_script(
                RedisOp::Stock,
                &APPLY,
                &[&keys.state, &keys.reservations, &keys.consumed],
                &[
                    budget.to_string().as_bytes(),
                    since_ms.to_string().as_bytes(),
                    idle_ms.to_string().as_bytes(),
                    consumed_kept_ms.to_string().as_bytes(),
                ],
            )
            .await?;
        let old = reply.first().copied().unwrap_or(-1);
        Ok(Applied {
            old: u64::try_from(old).ok(),
            new: u64::try_from(reply.get(1).copied().unwrap_or(0)).unwrap_or(0),
        })
    }

    /// Whether this instance may reconcile `resource` now (for `ttl_ms`).
    pub(crate) async fn take_turn(
        &self,
        resource: u128,
        instance: u64,
        ttl_ms: u64,
    ) -> Result<bool, Unavailable> {
        let keys = self.segment(resource, 0);
        let won: i64 = self
            .redis
            .run_script(
                RedisOp::Stock,
                &TURN,
                &[&keys.reconcile],
                &[
                    format!("{instance:016x}").as_bytes(),
                    ttl_ms.max(1).to_string().as_bytes(),
                ],
            )
            .await?;
        Ok(won == 1)
    }

    /// Publishes a stock event on the bus.
    pub(crate) async fn publish(&self, message: &str) -> Result<(), Unavailable> {
        self.redis
            .publish(&self.keys.events_channel(), message)
            .await
    }
}

/// Reads the buy script's answer; anything unexpected is taken as "not loaded", which
/// loads the segment again (never as units taken).
fn parse_buy(reply: &[Value]) -> Buy {
    let int = |i: usize| match reply.get(i) {
        Some(Value::Int(n)) => Some(*n),
        _ => None,
    };
    let units = |i: usize| u64::try_from(int(i).unwrap_or(0)).unwrap_or(0);
    let bytes = |i: usize| match reply.get(i) {
        Some(Value::BulkString(b)) => b.clone(),
        _ => Vec::new(),
    };
    match int(0) {
        Some(0) => Buy::Taken {
            left: units(1),
            expired: units(2),
        },
        Some(1) => Buy::Short {
            left: units(1),
            expired: units(2),
            reserved: units(3),
        },
        Some(2) => Buy::Known(bytes(1)),
        Some(4) => Buy::Reclaimed(bytes(1)),
        _ => Buy::Unloaded,
    }
}
