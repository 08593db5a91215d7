//! Coordination through Redis: the connection with bounded command times and health, the
//! Lua scripts, the pub/sub event bus, and the names of every key cacheguard writes
//! ([`keyspace`]).
//!
//! Redis is an accelerator, not a dependency: every command is bounded by
//! `redis.command_timeout`, and while Redis is down no request waits on it at all.

pub(crate) mod addr;
pub(crate) mod backend;
pub(crate) mod events;
pub(crate) mod io;
pub(crate) mod keyspace;
pub(crate) mod locks;
pub(crate) mod redis;
pub(crate) mod scripts;
pub(crate) mod sentinel;
pub(crate) mod store;
pub(crate) mod worker_conn;

pub(crate) use self::keyspace::{KeyNames, Keyspace};
pub(crate) use self::redis::RedisConn;
