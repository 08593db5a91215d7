//! Coordination through Redis: the connection, bounded command times, and health.
//!
//! Redis is an accelerator, not a dependency: every command is bounded by
//! `redis.command_timeout`, and while Redis is down no request waits on it at all.

pub(crate) mod redis;

pub(crate) use self::redis::RedisConn;
