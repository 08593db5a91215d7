//! Every Redis key and channel name cacheguard uses, built here and nowhere else.
//!
//! ```text
//! <p>{<base>}:v            entry of a base key (route and path, no query, no `vary` values)
//! <p>{<base>}:v:<hash>     entry of one of its variants (query or `vary` values)
//! <p>{<base>}:lock[:<hash>] fill lock of the base key [of a variant]
//! <p>{<base>}:wait[:<hash>] set by a waiter that found that lock held: its fill publishes
//! <p>{<base>}:gen          generation, shared by the base and all its variants
//! <p>{<base>}:vars         sorted set of the variants' hashes (score: entry expiry)
//! <p>{<base>}:q            a write's quarantine (fills store nothing while it lives)
//! <p>{<base>}:floor        the version floor of a route with `version` (a fill older than
//!                          it stores nothing), set by a write's answer and by fills
//! <p>{<base>}:fail[:<hash>] a failed fetch's answer, for the lock's waiters (seconds)
//! <p>tag:{<t>}:keys        sorted set of the base keys a surrogate key (tag) covers
//! <p>tag:{<t>}:at          Redis time (ms) of the tag's last invalidation
//! <p>tag:{<t>.<s>}:keys    shard `<s>` of a route's index (see [`ROUTE_SHARDS`]), no expiry
//!                          (expired members are dropped as members are listed)
//! <p>tag:{<t>.<s>}:at      Redis time (ms) of the last pattern purge, per shard
//! <p>bloom:<filter>        a Bloom filter's snapshot header; `:adds` its recent creates
//! <p>bloom:<filter>:part:<i> part `i` of the snapshot (≤ 512 KiB each, one slot each)
//! <p>stock:{<r>.<s>}       a stock gate's segment `<s>` of resource `<r>` (hash: units
//!                          available, units reserved); `:res` its live reservations,
//!                          `:done` those recently consumed, `:idem:<k>` an idempotency
//!                          key's record (in the key's home segment), `:rc` the
//!                          resource's reconcile turn (segment 0)
//! <p>ser:{<r>}:lock        a serialized write's lock on resource `<r>` (owner id)
//! <p>ser:{<r>}:fence       the last fencing token minted for `<r>`
//! <p>events                the pub/sub channel of the event bus
//! ```
//!
//! `<p>` is `redis.key_prefix` (`cg:` by default). The base hash sits in a Redis Cluster
//! hash tag, so every key of a path and of all its variants lives in one slot and each Lua
//! script stays single-slot. Lookup and fill both name an entry through
//! [`Keyspace::entry`], so they cannot disagree on where it lives.

use std::sync::Arc;

/// How many shards a route's index is split into. Every fill lists its base key in its
/// route's index (what a pattern purge searches), so one index per route would grow with
/// the route's keys — past 10k members and 1 MB at 100k keys, on one cluster slot: the big
/// key this product protects its users from. 64 shards keep each under 10k members up to
/// about 600k live keys per route; a pattern purge walks them all.
pub(crate) const ROUTE_SHARDS: u16 = 64;

/// The shard of a route's index that lists `base`.
pub(crate) fn route_shard(base: u128) -> u16 {
    u16::try_from(base % u128::from(ROUTE_SHARDS)).unwrap_or(0)
}

/// Builds the names under one key prefix.
#[derive(Clone, Debug)]
pub(crate) struct Keyspace {
    prefix: Arc<str>,
}

/// The Redis keys of one cache key (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct KeyNames {
    pub(crate) entry: String,
    pub(crate) lock: String,
    /// Marked by the waiters that found the lock held: the fill wakes them.
    pub(crate) waited: String,
    pub(crate) generation: String,
    pub(crate) vars: String,
    /// Set by a write for its `double_delete_delay`: fills store nothing meanwhile.
    pub(crate) quarantine: String,
    /// A failed fetch's answer, for a moment: the waiters answer with it.
    pub(crate) failure: String,
    /// The variant's hash in hex, `None` for a base key.
    pub(crate) variant: Option<String>,
}

/// The two keys of one surrogate key (tag).
#[derive(Clone, Debug)]
pub(crate) struct TagKeys {
    /// Sorted set of `<base hex> <path>` members, scored by the entry's expiry.
    pub(crate) index: String,
    /// The Redis time (ms) of the tag's last invalidation.
    pub(crate) at: String,
}

impl Keyspace {
    pub(crate) fn new(prefix: &str) -> Self {
        Keyspace {
            prefix: prefix.into(),
        }
    }

    /// The keys on Redlock's masters (`[locks.<name>] backend = "redlock"`): servers of
    /// their own, so the default prefix; only the serialized-write keys are used there.
    pub(crate) fn redlock() -> Self {
        Keyspace::new("cg:")
    }

    /// `<p>{<base>}:<suffix>`.
    fn tagged(&self, base: u128, suffix: &str) -> String {
        let mut name = self.with_room(base, suffix.len());
        name.push_str(suffix);
        name
    }

    /// `<p>{<base>}:`, in a string with room for `more` bytes after it: built in one
    /// allocation (a `format!` grows its string as it goes; a name is built per request).
    fn with_room(&self, base: u128, more: usize) -> String {
        use std::fmt::Write as _;
        let mut name = String::with_capacity(self.prefix.len() + 35 + more);
        // Writing to a String cannot fail.
        let _ = write!(name, "{}{{{base:032x}}}:", self.prefix);
        name
    }

    /// The entry key of the cache key `hash` whose base is `base` (equal for a base key).
    /// The only place an entry's name is built: the lookup and the fill both use it.
    pub(crate) fn entry(&self, base: u128, hash: u128) -> String {
        if hash == base {
            self.tagged(base, "v")
        } else {
            use std::fmt::Write as _;
            let mut name = self.with_room(base, 34);
            // Writing to a String cannot fail.
            let _ = write!(name, "v:{hash:032x}");
            name
        }
    }

    /// Every key of the cache key `hash` whose base is `base`.
    pub(crate) fn key(&self, base: u128, hash: u128) -> KeyNames {
        let mut names = self.base(base);
        if hash != base {
            names.entry = self.entry(base, hash);
            names.lock = self.tagged(base, &format!("lock:{hash:032x}"));
            names.waited = self.tagged(base, &format!("wait:{hash:032x}"));
            names.failure = self.tagged(base, &format!("fail:{hash:032x}"));
            names.variant = Some(format!("{hash:032x}"));
        }
        names
    }

    /// The keys of base key `base` itself.
    pub(crate) fn base(&self, base: u128) -> KeyNames {
        KeyNames {
            entry: self.entry(base, base),
            lock: self.tagged(base, "lock"),
            waited: self.tagged(base, "wait"),
            generation: self.tagged(base, "gen"),
            vars: self.tagged(base, "vars"),
            quarantine: self.tagged(base, "q"),
            failure: self.tagged(base, "fail"),
            variant: None,
        }
    }

    /// The version floor of base key `base` (shared by its variants). Not one of
    /// [`KeyNames`]: only the fills and writes of a route with `version` name it, so the
    /// others build no name for it.
    pub(crate) fn floor(&self, base: u128) -> String {
        self.tagged(base, "floor")
    }

    /// `<p>{<base>}:`, from which the invalidation script names the variants' keys
    /// (`v:<hash>`, `lock:<hash>`) inside Redis.
    pub(crate) fn variant_prefix(&self, base: u128) -> String {
        self.tagged(base, "")
    }

    /// The keys of one shard of a route's index (`tag` is the route's implicit tag): the
    /// shard of a base key is [`route_shard`]. Each shard has its own hash tag, so on a
    /// Redis Cluster the index spreads over the nodes, and its own invalidation time, so
    /// the script that lists a key stays single-slot.
    pub(crate) fn route_index(&self, tag: &str, shard: u16) -> TagKeys {
        let hash = xxhash_rust::xxh3::xxh3_128(tag.as_bytes());
        TagKeys {
            index: format!("{}tag:{{{hash:032x}.{shard:02x}}}:keys", self.prefix),
            at: format!("{}tag:{{{hash:032x}.{shard:02x}}}:at", self.prefix),
        }
    }

    /// The keys of surrogate key `tag`, hashed so any text is a valid, bounded name.
    pub(crate) fn tag(&self, tag: &str) -> TagKeys {
        let hash = xxhash_rust::xxh3::xxh3_128(tag.as_bytes());
        TagKeys {
            index: format!("{}tag:{{{hash:032x}}}:keys", self.prefix),
            at: format!("{}tag:{{{hash:032x}}}:at", self.prefix),
        }
    }

    /// A Bloom filter's snapshot: the header that names its parts.
    pub(crate) fn bloom_snapshot(&self, filter: &str) -> String {
        format!("{}bloom:{filter}", self.prefix)
    }

    /// Part `index` of a Bloom filter's snapshot. No hash tag: on a Redis Cluster the
    /// parts spread over the slots instead of making one big slot. (A filter name has no
    /// `:`, so this cannot be another filter's key.)
    pub(crate) fn bloom_snapshot_part(&self, filter: &str, index: u64) -> String {
        format!("{}bloom:{filter}:part:{index}", self.prefix)
    }

    /// A Bloom filter's recent creates (sorted set scored by unix ms).
    pub(crate) fn bloom_adds(&self, filter: &str) -> String {
        format!("{}bloom:{filter}:adds", self.prefix)
    }

    /// The event bus channel.
    pub(crate) fn events_channel(&self) -> String {
        format!("{}events", self.prefix)
    }

    /// The keys of segment `segment` of stock resource `resource` (see
    /// [`stock_resource`]). One hash tag per segment: a segment's scripts are single-slot,
    /// and on a Redis Cluster the segments of one resource spread over the slots.
    pub(crate) fn stock(&self, resource: u128, segment: u16) -> StockKeys {
        let tag = format!("{}stock:{{{resource:032x}.{segment:02x}}}", self.prefix);
        StockKeys {
            reservations: format!("{tag}:res"),
            consumed: format!("{tag}:done"),
            reconcile: format!("{tag}:rc"),
            idempotency_prefix: format!("{tag}:idem:"),
            state: tag,
        }
    }
}

/// The keys of a serialized resource's lock.
#[derive(Clone, Debug)]
pub(crate) struct SerializedKeys {
    pub(crate) lock: String,
    pub(crate) fence: String,
}

impl Keyspace {
    /// The lock and token keys of resource `resource` (see [`serialized_resource`]).
    pub(crate) fn serialized(&self, resource: u128) -> SerializedKeys {
        let tag = format!("{}ser:{{{resource:032x}}}", self.prefix);
        SerializedKeys {
            lock: format!("{tag}:lock"),
            fence: format!("{tag}:fence"),
        }
    }
}

/// A serialized resource's id: the hash of its path, whatever route names it (a `PUT` and
/// a `DELETE` of one seat take one lock).
pub(crate) fn serialized_resource(path: &str) -> u128 {
    xxhash_rust::xxh3::xxh3_128(path.as_bytes())
}

/// A stock resource's id: the gate and the resource's path, hashed so that any path gives
/// a valid, bounded key name.
pub(crate) fn stock_resource(gate: &str, path: &str) -> u128 {
    let mut text = Vec::with_capacity(gate.len() + 1 + path.len());
    text.extend_from_slice(gate.as_bytes());
    text.push(0);
    text.extend_from_slice(path.as_bytes());
    xxhash_rust::xxh3::xxh3_128(&text)
}

/// The Redis keys of one segment of a stock resource (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct StockKeys {
    /// Hash: `n` units available, `rsv` units reserved by buys in flight.
    pub(crate) state: String,
    /// Sorted set of live reservations, member `<units>.<id>`, score its deadline (ms).
    pub(crate) reservations: String,
    /// Sorted set of reservations consumed by a sale, scored by when (ms), kept a while so
    /// a reconcile can count sales the origin's number may not show yet.
    pub(crate) consumed: String,
    /// The resource's reconcile turn (segment 0's is used): one instance at a time.
    pub(crate) reconcile: String,
    /// `<state>:idem:`, followed by an idempotency key's hash (32 hex digits).
    pub(crate) idempotency_prefix: String,
}

impl StockKeys {
    /// The record of an idempotency key whose hash is `key` (this segment is its home).
    pub(crate) fn idempotency(&self, key: u128) -> String {
        format!("{}{key:032x}", self.idempotency_prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_key_and_its_variants_share_one_hash_tag() {
        let space = Keyspace::new("cg:");
        let base = space.key(1, 1);
        assert_eq!(base.entry, format!("cg:{{{:032x}}}:v", 1));
        assert_eq!(base.variant, None);
        let variant = space.key(1, 2);
        assert_eq!(variant.entry, format!("cg:{{{:032x}}}:v:{:032x}", 1, 2));
        assert_eq!(variant.lock, format!("cg:{{{:032x}}}:lock:{:032x}", 1, 2));
        assert_eq!(variant.generation, base.generation);
        assert_eq!(variant.vars, base.vars);
        assert_eq!(variant.quarantine, base.quarantine);
        assert!(variant.entry.starts_with(&space.variant_prefix(1)));
        assert_eq!(space.floor(1), format!("cg:{{{:032x}}}:floor", 1));
        assert!(space.floor(1).starts_with(&space.variant_prefix(1)));
    }

    #[test]
    fn the_entry_name_is_the_one_every_key_set_uses() {
        let space = Keyspace::new("p:");
        for (base, hash) in [(7, 7), (7, 9)] {
            assert_eq!(space.entry(base, hash), space.key(base, hash).entry);
        }
    }
}
