//! Coordination through Redis: the connection with bounded command times and health, the
//! Lua scripts, and the pub/sub event bus.
//!
//! Redis is an accelerator, not a dependency: every command is bounded by
//! `redis.command_timeout`, and while Redis is down no request waits on it at all.

pub(crate) mod backend;
pub(crate) mod events;
pub(crate) mod redis;
pub(crate) mod scripts;
pub(crate) mod sentinel;

pub(crate) use self::redis::RedisConn;

use crate::cache::CacheKey;

/// The Redis key of one base key's `suffix` (`v` entry, `lock`, `gen`, `vars`). The base
/// hash sits in a Redis Cluster hash tag, so every key of a path and of all its variants
/// lives in one slot and the Lua scripts stay single-slot.
pub(crate) fn tagged_key(prefix: &str, base: u128, suffix: &str) -> String {
    format!("{prefix}{{{base:032x}}}:{suffix}")
}

/// The Redis keys of one cache key (see DESIGN.md, Redis layout):
///
/// - `cg:{<base>}:gen`: the generation, shared by the base and all its variants;
/// - `cg:{<base>}:v` / `cg:{<base>}:lock`: entry and fill lock of the base key itself;
/// - `cg:{<base>}:v:<hash>` / `cg:{<base>}:lock:<hash>`: those of a variant (query or
///   `vary` values), listed in the sorted set `cg:{<base>}:vars` (member `<hash>`, score
///   its entry's expiry), so an invalidation of the base finds every variant without a scan;
/// - `cg:{<base>}:q`: a write's quarantine (see `proxy/write.rs`).
#[derive(Clone, Debug)]
pub(crate) struct KeyNames {
    pub(crate) entry: String,
    pub(crate) lock: String,
    pub(crate) generation: String,
    pub(crate) vars: String,
    /// Set by a write for its `double_delete_delay`: fills store nothing meanwhile.
    pub(crate) quarantine: String,
    /// The variant's hash in hex, `None` for a base key.
    pub(crate) variant: Option<String>,
}

impl KeyNames {
    pub(crate) fn new(prefix: &str, key: &CacheKey) -> Self {
        let mut names = KeyNames::of_base(prefix, key.base);
        if key.is_variant() {
            let hash = format!("{:032x}", key.hash);
            names.entry = tagged_key(prefix, key.base, &format!("v:{hash}"));
            names.lock = tagged_key(prefix, key.base, &format!("lock:{hash}"));
            names.variant = Some(hash);
        }
        names
    }

    /// The keys of base key `base` itself.
    pub(crate) fn of_base(prefix: &str, base: u128) -> Self {
        KeyNames {
            entry: tagged_key(prefix, base, "v"),
            lock: tagged_key(prefix, base, "lock"),
            generation: tagged_key(prefix, base, "gen"),
            vars: tagged_key(prefix, base, "vars"),
            quarantine: tagged_key(prefix, base, "q"),
            variant: None,
        }
    }
}

/// The Redis keys of one surrogate key (tag): `cg:tag:{<hash of tag>}:keys`, a sorted set
/// of the base keys whose entries carried it (member `<base hex> <path>`, score the entry's
/// expiry), and `cg:tag:{<hash>}:at`, the Redis time (ms) of its last invalidation.
pub(crate) fn tag_keys(prefix: &str, tag: &str) -> (String, String) {
    let hash = xxhash_rust::xxh3::xxh3_128(tag.as_bytes());
    (
        format!("{prefix}tag:{{{hash:032x}}}:keys"),
        format!("{prefix}tag:{{{hash:032x}}}:at"),
    )
}
