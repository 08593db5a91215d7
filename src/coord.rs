//! Coordination through Redis: the connection with bounded command times and health, the
//! Lua scripts, and the pub/sub event bus.
//!
//! Redis is an accelerator, not a dependency: every command is bounded by
//! `redis.command_timeout`, and while Redis is down no request waits on it at all.

pub(crate) mod events;
pub(crate) mod redis;
pub(crate) mod scripts;

pub(crate) use self::redis::RedisConn;

/// The Redis key of one cache key's `suffix` (`v` entry, `lock`, `gen`). The hash sits in a
/// Redis Cluster hash tag, so all keys of one cache key live in one slot and the Lua
/// scripts stay single-slot.
pub(crate) fn tagged_key(prefix: &str, hash: u128, suffix: &str) -> String {
    format!("{prefix}{{{hash:032x}}}:{suffix}")
}
