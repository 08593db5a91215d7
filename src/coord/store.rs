//! Every Redis call of the fill lock, the fill itself, invalidation and the tag index: one
//! method per script or command, each bounded and breaker-checked by [`RedisConn`]. The
//! protocol built on them (who fetches, who waits, for how long) is the fleet flight in
//! `protect/flight/fleet.rs`; the key names come from [`Keyspace`].
//!
//! The lock is a Redis key holding a token that is random per acquisition, set with
//! `SET NX PX lease`; every later operation compares the token first, so a holder whose
//! lease ran out can never release, renew or fill over a newer holder. The Lua sources
//! are in `scripts.rs`.

use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use crate::config::RedisMode;
use crate::coord::events::{Event, EventBus, EventKind, Waiters};
use crate::coord::keyspace::{ROUTE_SHARDS, TagKeys, route_shard};
use crate::coord::redis::Unavailable;
use crate::coord::{KeyNames, Keyspace, RedisConn, scripts};
use crate::metrics::{LockEvent, RedisOp};

/// Whether a fill reads and keeps its key's version floor (its route has `version`): the
/// floor is then read in the lock's round trip and checked again by the fill script. Off,
/// the scripts name no floor key and read nothing more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FloorCheck {
    Off,
    On,
}

/// A held lease on one key.
#[derive(Clone, Debug)]
pub(crate) struct Lease {
    token: String,
    /// The key's generation when the lease was taken; the fill is refused if it changed.
    /// Empty for a base key's lock, which fences its fill by itself (see `scripts.rs`).
    generation: String,
    /// Just before the lease was asked for: a fill is refused if a tag the answer carries
    /// was invalidated since (see [`RedisStore::tag_add`]). A real interval between two
    /// Redis events, so `std`'s clock, not tokio's (which a paused test stops).
    pub(crate) began: std::time::Instant,
    /// The key's version floor when the lease was taken (with [`FloorCheck::On`]).
    pub(crate) floor: Option<u128>,
    hash: u128,
    names: KeyNames,
    /// The floor's key name, with [`FloorCheck::On`].
    floor_key: Option<String>,
}

/// The keys of the invalidation script: the key's entry, lock, generation, variant index
/// and quarantine, then its version floor when `floor` names it; with how many of them are
/// named.
fn script_keys<'a>(names: &'a KeyNames, floor: Option<&'a str>) -> ([&'a str; 6], usize) {
    let all = [
        names.entry.as_str(),
        &names.lock,
        &names.generation,
        &names.vars,
        &names.quarantine,
        floor.unwrap_or_default(),
    ];
    (all, if floor.is_some() { 6 } else { 5 })
}

/// The keys of the fill script: the key's entry, lock, generation, variant index,
/// quarantine and the lock's waiters' mark, then its version floor when `floor` names it;
/// with how many of them are named.
fn fill_keys<'a>(names: &'a KeyNames, floor: Option<&'a str>) -> ([&'a str; 7], usize) {
    let all = [
        names.entry.as_str(),
        &names.lock,
        &names.generation,
        &names.vars,
        &names.quarantine,
        &names.waited,
        floor.unwrap_or_default(),
    ];
    (all, if floor.is_some() { 7 } else { 6 })
}

/// A floor as a script returns it: `''` for none.
fn parse_floor(floor: &str) -> Option<u128> {
    floor.parse().ok()
}

/// The answer to a lock attempt.
#[derive(Debug)]
pub(crate) enum Acquired {
    Won(Box<Lease>),
    /// The entry is there already (asked for with `or_entry`); nothing was taken.
    Present,
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
    /// A write quarantines the key: the answer may come from a lagging replica.
    Quarantined,
    /// The answer's version is below the key's floor (or it has none while there is a
    /// floor): a newer answer was stored since the fetch began.
    OlderVersion,
}

/// How long a failed fetch's answer is kept for the waiters woken by its `failed` event:
/// they read it at once; this only has to outlast the event's delivery.
const FAILURE_KEPT: Duration = Duration::from_secs(2);

/// Added to the longest fetch for the life of a generation read at a fetch's start.
const GENERATION_SLACK: Duration = Duration::from_secs(60);

/// A stored value above this size is written and read on the bulk connection (see
/// [`RedisConn::bulk`]).
pub(crate) const LARGE_VALUE: usize = 256 * 1024;

/// How long the transfer of a large value may take, waiting for its turn included.
pub(crate) const LARGE_VALUE_TIMEOUT: Duration = Duration::from_secs(5);

/// A fresh generation: a random integer (so `INCR` works on it) far above the small
/// numbers an `INCR` of an absent key starts from, and exact in Lua's doubles.
fn fresh_generation() -> String {
    (rand::random::<u64>() >> 12 | 1 << 40).to_string()
}

#[derive(Clone, Debug)]
pub(crate) struct RedisStore {
    redis: RedisConn,
    keys: Keyspace,
    pub(crate) lease: Duration,
    bus: Arc<EventBus>,
    /// `lock.wait_replicas`: replicas that must have a new lock before its fetch starts.
    wait_replicas: u32,
    /// `lock.wait_replicas_timeout`: the bound of that `WAIT`.
    wait_replicas_timeout: Duration,
    /// How long a generation read at the start of a fetch must last at least: longer than
    /// any fetch (see the module docs of `scripts.rs`).
    generation_life: Duration,
    /// Large values are written one at a time per process (see
    /// [`RedisStore::large_value_turn`]).
    large_turn: Arc<tokio::sync::Semaphore>,
}

impl RedisStore {
    pub(crate) fn new(
        redis: RedisConn,
        keys: Keyspace,
        lease: Duration,
        bus: Arc<EventBus>,
    ) -> Self {
        RedisStore {
            redis,
            keys,
            lease,
            bus,
            wait_replicas: 0,
            wait_replicas_timeout: Duration::ZERO,
            generation_life: lease + GENERATION_SLACK,
            large_turn: Arc::new(tokio::sync::Semaphore::new(1)),
        }
    }

    /// The turn to encode and write a value of `size` bytes, when it is large: one at a
    /// time per process, so the copies of a large value (encoded, then in the command) exist
    /// for one fill at a time instead of one per fill waiting on the bulk connection.
    /// `None` for a small value (no turn needed).
    ///
    /// # Errors
    /// `Unavailable` when the turn did not come within the large-value timeout.
    pub(crate) async fn large_value_turn(
        &self,
        size: usize,
    ) -> Result<Option<tokio::sync::OwnedSemaphorePermit>, Unavailable> {
        if size <= LARGE_VALUE {
            return Ok(None);
        }
        let turn = Arc::clone(&self.large_turn).acquire_owned();
        match tokio::time::timeout(LARGE_VALUE_TIMEOUT, turn).await {
            Ok(Ok(turn)) => Ok(Some(turn)),
            _ => Err(Unavailable::Down),
        }
    }

    /// A fetch may run for up to `longest_fetch`: the generation it reads at its start is
    /// kept at least that long (plus slack), so its fill can tell "unchanged" from "gone".
    pub(crate) fn with_longest_fetch(mut self, longest_fetch: Duration) -> Self {
        self.generation_life = longest_fetch.max(self.lease) + GENERATION_SLACK;
        self
    }

    /// With `n > 0`, a won lock waits (`WAIT n`, up to `lock.wait_replicas_timeout`) until `n`
    /// replicas have it, as Redisson does: a failover right after the acquire then keeps
    /// the lock, and a second instance does not fetch the same key. Fewer replicas in time
    /// is counted (`lock_events{event="unreplicated"}`) and the fetch goes on: correctness
    /// never rests on the lock (fills are generation-checked).
    pub(crate) fn with_wait_replicas(mut self, n: u32, timeout: Duration) -> Self {
        self.wait_replicas = n;
        self.wait_replicas_timeout = timeout;
        self
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

    /// How long a generation read at a fetch's start is kept: longer than any fetch.
    pub(crate) fn generation_life(&self) -> Duration {
        self.generation_life
    }

    /// `ARGV[3]` and `ARGV[4]` of the scripts that read a generation at a fetch's start.
    fn generation_args(&self) -> (String, String) {
        (
            fresh_generation(),
            self.generation_life.as_millis().to_string(),
        )
    }

    fn lease_ms(&self) -> Vec<u8> {
        self.lease.as_millis().to_string().into_bytes()
    }

    fn message(&self, kind: EventKind, hash: u128) -> Vec<u8> {
        Event {
            kind,
            instance: self.bus.instance,
            hash,
            floor: None,
        }
        .encode()
        .into_bytes()
    }

    /// `SET lock token NX PX lease`, reading the generation (and with [`FloorCheck::On`] the
    /// version floor) in the same round trip; with `or_entry`, nothing is taken when the
    /// entry exists already ([`Acquired::Present`]).
    pub(crate) async fn acquire(
        &self,
        base: u128,
        hash: u128,
        or_entry: bool,
        check: FloorCheck,
    ) -> Result<Acquired, Unavailable> {
        let began = std::time::Instant::now();
        let names = self.keys.key(base, hash);
        let token = format!("{:032x}", rand::random::<u128>());
        let floor_key = (check == FloorCheck::On).then(|| self.keys.floor(base));
        let all = [
            names.lock.as_str(),
            &names.generation,
            &names.entry,
            &names.waited,
            floor_key.as_deref().unwrap_or_default(),
        ];
        let keys = &all[..if floor_key.is_some() { 5 } else { 4 }];
        let (fresh, life) = self.generation_args();
        let args: [&[u8]; 7] = [
            token.as_bytes(),
            &self.lease_ms(),
            fresh.as_bytes(),
            life.as_bytes(),
            if or_entry { b"1" } else { b"0" },
            if floor_key.is_some() { b"1" } else { b"0" },
            // A variant's lock is not deleted by an invalidation before the variant is
            // listed: its fill checks the generation (see `scripts.rs`).
            if hash == base { b"0" } else { b"1" },
        ];
        type Answer = (i64, String, i64, i64, String);
        let (won, generation, pttl, repaired, floor): Answer = if self.wait_replicas > 0 {
            let (answer, acked): (Answer, i64) = self
                .redis
                .run_script_replicated(
                    RedisOp::Lock,
                    scripts::ACQUIRE_SOURCE,
                    keys,
                    &args,
                    self.wait_replicas,
                    self.wait_replicas_timeout,
                )
                .await?;
            let (won, ..) = answer;
            if won == 1 && acked < i64::from(self.wait_replicas) {
                self.redis.metrics().lock_event(LockEvent::Unreplicated);
            }
            answer
        } else {
            self.redis
                .run_script(RedisOp::Lock, &scripts::ACQUIRE, keys, &args)
                .await?
        };
        if won == 2 {
            Ok(Acquired::Present)
        } else if won == 1 {
            Ok(Acquired::Won(Box::new(Lease {
                token,
                generation,
                began,
                floor: parse_floor(&floor),
                hash,
                names,
                floor_key,
            })))
        } else {
            if repaired == 1 {
                self.redis.metrics().lock_event(LockEvent::Repaired);
                warn!(
                    message = "A fill lock without an expiry was given one; another client may write cacheguard's keys.",
                    key = %names.lock,
                    lease_ms = self.lease.as_millis(),
                );
            }
            let remaining = u64::try_from(pttl).unwrap_or(0);
            Ok(Acquired::Held {
                remaining: Duration::from_millis(remaining),
            })
        }
    }

    /// A lease for storing without the lock (no fleet coordination available): it holds no
    /// lock — its token matches none — so its fill stores only while nobody holds the lock
    /// and the generation read here is unchanged (and, with [`FloorCheck::On`], its answer
    /// reaches the key's version floor, also read here).
    pub(crate) async fn unlocked_lease(
        &self,
        base: u128,
        hash: u128,
        check: FloorCheck,
    ) -> Result<Lease, Unavailable> {
        let began = std::time::Instant::now();
        let names = self.keys.key(base, hash);
        let floor_key = (check == FloorCheck::On).then(|| self.keys.floor(base));
        let all = [
            names.lock.as_str(),
            &names.generation,
            floor_key.as_deref().unwrap_or_default(),
        ];
        let keys = &all[..if floor_key.is_some() { 3 } else { 2 }];
        let (fresh, life) = self.generation_args();
        let (generation, floor): (String, String) = self
            .redis
            .run_script(
                RedisOp::Lock,
                &scripts::BEGIN,
                keys,
                &[
                    b"".as_slice(),
                    b"",
                    fresh.as_bytes(),
                    life.as_bytes(),
                    if floor_key.is_some() { b"1" } else { b"0" },
                ],
            )
            .await?;
        Ok(Lease {
            token: "-".to_owned(),
            generation,
            began,
            floor: parse_floor(&floor),
            hash,
            names,
            floor_key,
        })
    }

    /// The version floor of base key `base` in Redis (a fetch that takes no lease reads it
    /// on its own: one `GET`, only on routes with `version`).
    pub(crate) async fn floor(&self, base: u128) -> Result<Option<u128>, Unavailable> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.keys.floor(base));
        let floor: Option<String> = self.redis.query(RedisOp::Lock, &cmd).await?;
        Ok(floor.as_deref().and_then(parse_floor))
    }

    /// Extends the lease; `Ok(false)` means it was lost (expired, or someone else holds it).
    pub(crate) async fn renew(&self, lease: &Lease) -> Result<bool, Unavailable> {
        let renewed: i64 = self
            .redis
            .run_script(
                RedisOp::Renew,
                &scripts::RENEW,
                &[&lease.names.lock],
                &[lease.token.as_bytes(), &self.lease_ms()],
            )
            .await?;
        Ok(renewed == 1)
    }

    /// Invalidates the base key `base` and all its variants fleet-wide (see
    /// [`scripts::INVALIDATE`]). `generation_ttl` must outlast any fill that could still be
    /// running with the old generation.
    /// A non-zero `quarantine` keeps fills of the key from storing anything for that long.
    /// A `floor` (a write's version and how long it holds) raises the key's version floor:
    /// fills older than it store nothing. It travels in the `invalidate` event too, so
    /// every instance knows it.
    pub(crate) async fn invalidate(
        &self,
        base: u128,
        generation_ttl: Duration,
        quarantine: Duration,
        floor: Option<(u128, Duration)>,
    ) -> Result<(), Unavailable> {
        // Variant keys are built in the script from this prefix (same hash tag).
        let prefix = self.keys.variant_prefix(base);
        let names = self.keys.base(base);
        let ttl_ms = generation_ttl.as_millis().max(1).to_string();
        let quarantine_ms = quarantine.as_millis().to_string();
        let floor_ms =
            floor.map(|(_, ttl)| u64::try_from(ttl.as_millis().max(1)).unwrap_or(u64::MAX));
        let message = Event {
            kind: EventKind::Invalidate,
            instance: self.bus.instance,
            hash: base,
            floor: floor.zip(floor_ms).map(|((version, _), ms)| (version, ms)),
        }
        .encode()
        .into_bytes();
        let floor_key = floor.map(|_| self.keys.floor(base));
        let floor_version = floor.map(|(version, _)| version.to_string());
        let floor_ms = floor_ms.map(|ms| ms.to_string());
        // On a cluster a PUBLISH inside the script reaches the other nodes' subscribers
        // over the cluster bus, after the script has answered: a write could return before
        // another instance heard of it. There the event is published on its own, routed
        // to the node every instance subscribes on first (the primary of the channel's
        // slot, see `EventBus::run`), which delivers it before it answers.
        let separate = self.redis.mode() == RedisMode::Cluster;
        let channel: &[u8] = if separate {
            b""
        } else {
            self.bus.channel.as_bytes()
        };
        let (all, named) = script_keys(&names, floor_key.as_deref());
        let keys = &all[..named];
        self.redis
            .run_script::<i64>(
                RedisOp::Invalidate,
                &scripts::INVALIDATE,
                keys,
                &[
                    ttl_ms.as_bytes(),
                    channel,
                    &message,
                    prefix.as_bytes(),
                    quarantine_ms.as_bytes(),
                    floor_version.as_deref().unwrap_or("").as_bytes(),
                    floor_ms.as_deref().unwrap_or("").as_bytes(),
                ],
            )
            .await?;
        if separate {
            let mut cmd = redis::cmd("PUBLISH");
            cmd.arg(&self.bus.channel).arg(&message);
            self.redis.query::<i64>(RedisOp::Invalidate, &cmd).await?;
        }
        Ok(())
    }

    /// Lists `member` (`<base hex> <path>`) under surrogate key `tag` for `life`, and tells
    /// whether the tag was invalidated since `began` (then the entry must not be stored).
    ///
    /// The tag's invalidation time and the clock it is compared with are both its node's
    /// (`TIME`, read by the script). The fetch began after `began`, and the script ran
    /// before its answer came back, so the node's clock when the fetch began was at least
    /// its clock now less the time elapsed since `began`: an invalidation at or after that
    /// refuses the fill — a few milliseconds early at worst, never late.
    pub(crate) async fn tag_add(
        &self,
        tag: &str,
        member: &str,
        life: Duration,
        began: std::time::Instant,
    ) -> Result<bool, Unavailable> {
        let TagKeys { index, at } = self.keys.tag(tag);
        let life_ms = life.as_millis().max(1).to_string();
        let (invalidated, now): (u64, u64) = self
            .redis
            .run_script(
                RedisOp::Tag,
                &scripts::TAG_ADD,
                &[&index, &at],
                &[member.as_bytes(), life_ms.as_bytes()],
            )
            .await?;
        // Whole milliseconds, rounded up: `now` and `invalidated` are both rounded down.
        let elapsed = began.elapsed();
        let elapsed_ms = u64::try_from(elapsed.as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(u64::from(!elapsed.subsec_nanos().is_multiple_of(1_000_000)));
        Ok(invalidated >= now.saturating_sub(elapsed_ms))
    }

    /// Lists `member` (`<base hex> <path>`, of base key `base`) in its shard `shard` of the
    /// index of the route whose implicit tag is `tag`, with `expiry` (Unix ms, this
    /// process's clock) as its score: the latest its entry can expire, so the shard keeps it
    /// at least that long. `ZADD GT`: a later expiry another fill listed is kept. One
    /// listing in [`scripts::ROUTE_KEEP_EVERY`] (chosen by the base, so it is spread over
    /// the shards) also drops the shard's expired members ([`scripts::ROUTE_ADD`]); the
    /// others are one `ZADD`.
    ///
    /// Listed before the fetch starts: a pattern purge that scans the shard afterwards finds
    /// the key and invalidates it, which refuses the fill; one that scanned it before ran
    /// before the fetch, whose answer is then newer than the purge.
    pub(crate) async fn route_add(
        &self,
        tag: &str,
        shard: u16,
        base: u128,
        member: &str,
        expiry: u64,
    ) -> Result<(), Unavailable> {
        let index = self.keys.route_index(tag, shard).index;
        let score = expiry.to_string();
        let cmd = if (base >> 6).is_multiple_of(scripts::ROUTE_KEEP_EVERY) {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(scripts::ROUTE_ADD)
                .arg(1)
                .arg(&index)
                .arg(member)
                .arg(&score);
            cmd
        } else {
            let mut cmd = redis::cmd("ZADD");
            cmd.arg(&index).arg("GT").arg(&score).arg(member);
            cmd
        };
        self.redis.query::<i64>(RedisOp::Tag, &cmd).await?;
        Ok(())
    }

    /// Records that `tag` is invalidated now and returns its index's live members.
    pub(crate) async fn tag_mark(
        &self,
        tag: &str,
        keep: Duration,
    ) -> Result<Vec<String>, Unavailable> {
        let TagKeys { index, at } = self.keys.tag(tag);
        let keep_ms = keep.as_millis().max(1).to_string();
        self.redis
            .run_script(
                RedisOp::Tag,
                &scripts::TAG_MARK,
                &[&index, &at],
                &[keep_ms.as_bytes()],
            )
            .await
    }

    /// Records that the route of `tag` (its implicit tag) is purged now — fills that began
    /// earlier are refused — then lists the members of its index whose path matches `glob`
    /// (`*` any run of characters), scanning each shard in chunks.
    pub(crate) async fn route_scan(
        &self,
        tag: &str,
        keep: Duration,
        glob: &str,
    ) -> Result<Vec<String>, Unavailable> {
        let keep_ms = keep.as_millis().max(1).to_string();
        for shard in 0..ROUTE_SHARDS {
            let at = self.keys.route_index(tag, shard).at;
            self.redis
                .run_script::<i64>(
                    RedisOp::Tag,
                    &scripts::TAG_TOUCH,
                    &[&at],
                    &[keep_ms.as_bytes()],
                )
                .await?;
        }
        // Members are `<base hex> <path>`; a path has no raw space. Redis's MATCH knows
        // `*`, `?`, `[...]` and `\`: everything but `*` is escaped.
        let mut pattern = String::from("* ");
        for c in glob.chars() {
            if matches!(c, '?' | '[' | ']' | '\\') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        let mut found = Vec::new();
        for shard in 0..ROUTE_SHARDS {
            let index = self.keys.route_index(tag, shard).index;
            let mut cursor = 0u64;
            // Bounded: a cursor walk of even a huge index ends long before this.
            for _ in 0..1_000_000 {
                let mut cmd = redis::cmd("ZSCAN");
                cmd.arg(&index)
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000);
                let (next, chunk): (u64, Vec<String>) =
                    self.redis.query(RedisOp::Tag, &cmd).await?;
                // ZSCAN answers member, score, member, score, …
                found.extend(chunk.into_iter().step_by(2));
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        found.sort_unstable();
        found.dedup();
        Ok(found)
    }

    /// Removes members from `tag`'s index once their keys were invalidated.
    pub(crate) async fn tag_forget(
        &self,
        tag: &str,
        members: &[String],
    ) -> Result<(), Unavailable> {
        if members.is_empty() {
            return Ok(());
        }
        let index = self.keys.tag(tag).index;
        let mut cmd = redis::cmd("ZREM");
        cmd.arg(&index).arg(members);
        self.redis
            .query::<i64>(RedisOp::Tag, &cmd)
            .await
            .map(|_| ())
    }

    /// Removes members (`<base hex> <path>`) from the shards of a route's index once their
    /// keys were invalidated.
    pub(crate) async fn route_forget(
        &self,
        tag: &str,
        members: &[String],
    ) -> Result<(), Unavailable> {
        let mut by_shard: std::collections::BTreeMap<u16, Vec<&String>> = Default::default();
        for member in members {
            if let Some(base) = member
                .get(..32)
                .and_then(|hex| u128::from_str_radix(hex, 16).ok())
            {
                by_shard.entry(route_shard(base)).or_default().push(member);
            }
        }
        for (shard, members) in by_shard {
            let mut cmd = redis::cmd("ZREM");
            cmd.arg(self.keys.route_index(tag, shard).index)
                .arg(members);
            self.redis.query::<i64>(RedisOp::Tag, &cmd).await?;
        }
        Ok(())
    }

    /// Stores `encoded` for `ttl` if the generation is unchanged and the lock is not
    /// someone else's (and, with the lease's [`FloorCheck::On`], `version` reaches the
    /// key's floor, which it raises); releases the lock; wakes the waiters. `version` is
    /// the answer's as the script takes it (`-`: none; see `cache/version.rs`).
    pub(crate) async fn fill(
        &self,
        lease: &Lease,
        encoded: &[u8],
        ttl: Duration,
        version: Option<&str>,
    ) -> Result<FillOutcome, Unavailable> {
        let names = &lease.names;
        let ttl_ms = ttl.as_millis().max(1).to_string();
        // The floor is named (and the version passed) only on a route with `version`.
        let (floor, version) = match (&lease.floor_key, version) {
            (Some(floor), Some(version)) => (Some(floor.as_str()), version),
            _ => (None, ""),
        };
        let (all, named) = fill_keys(names, floor);
        let keys = &all[..named];
        let fill = self.message(EventKind::Fill, lease.hash);
        let released = self.message(EventKind::Released, lease.hash);
        let args = [
            lease.token.as_bytes(),
            lease.generation.as_bytes(),
            encoded,
            ttl_ms.as_bytes(),
            self.bus.channel.as_bytes(),
            &fill,
            &released,
            names.variant.as_deref().unwrap_or("").as_bytes(),
            version.as_bytes(),
        ];
        // A large entry goes on the bulk connection: its transfer must not time out at
        // command_timeout (nor count toward the breaker when slow), nor hold up the small
        // commands behind it; and large fills take turns there, so the copies a command
        // makes of its value are there for one of them at a time.
        let stored: i64 = if encoded.len() > LARGE_VALUE {
            self.redis
                .bulk_script(
                    RedisOp::Fill,
                    &scripts::FILL,
                    keys,
                    &args,
                    LARGE_VALUE_TIMEOUT,
                )
                .await?
        } else {
            self.redis
                .run_script(RedisOp::Fill, &scripts::FILL, keys, &args)
                .await?
        };
        Ok(match stored {
            1 => FillOutcome::Stored,
            0 => FillOutcome::GenerationChanged,
            -2 => FillOutcome::Quarantined,
            -3 => FillOutcome::OlderVersion,
            _ => FillOutcome::LockTaken,
        })
    }

    /// Releases the lock without a fill, telling waiters `why` (`Released`: one of them
    /// takes over; `Uncacheable`: each fetches for itself; `Failed`: they answer with
    /// `failure`, left in Redis for a moment).
    ///
    /// On a Redis Cluster slot being migrated, a release that leaves a failure (two keys)
    /// cannot run until the migration ends (`TRYAGAIN`): the lock is then released alone
    /// (one key, which runs wherever the key is) and the waiters told `released`, so they
    /// take over at once rather than at the lease's end.
    pub(crate) async fn release(
        &self,
        lease: &Lease,
        why: EventKind,
        failure: Option<&[u8]>,
    ) -> Result<bool, Unavailable> {
        match self.release_once(lease, why, failure).await {
            Err(Unavailable::Migrating) if failure.is_some() => {
                self.release_once(lease, EventKind::Released, None).await
            }
            released => released,
        }
    }

    async fn release_once(
        &self,
        lease: &Lease,
        why: EventKind,
        failure: Option<&[u8]>,
    ) -> Result<bool, Unavailable> {
        let keep_ms = FAILURE_KEPT.as_millis().to_string();
        let mut keys = vec![lease.names.lock.as_str()];
        if failure.is_some() {
            keys.push(&lease.names.failure);
        }
        let released: i64 = self
            .redis
            .run_script(
                RedisOp::Release,
                &scripts::RELEASE,
                &keys,
                &[
                    lease.token.as_bytes(),
                    self.bus.channel.as_bytes(),
                    &self.message(why, lease.hash),
                    failure.unwrap_or_default(),
                    keep_ms.as_bytes(),
                ],
            )
            .await?;
        Ok(released == 1)
    }

    /// The copy of a failed fetch's answer left for the waiters of `hash`, if still there.
    pub(crate) async fn failure(
        &self,
        base: u128,
        hash: u128,
    ) -> Result<Option<Vec<u8>>, Unavailable> {
        let names = self.keys.key(base, hash);
        let mut cmd = redis::cmd("GET");
        cmd.arg(&names.failure);
        self.redis.query(RedisOp::Lock, &cmd).await
    }
}
