//! cacheguard: a cache-protection sidecar. An HTTP reverse proxy in front of a
//! database-backed API that keeps the API and its database alive and correct under the
//! classic cache failure modes (penetration, stampede, avalanche, hot keys, inconsistency).
//! The architecture is described in `docs/architecture.md`.
//!
//! # Layout
//!
//! - [`config`]: the TOML model, validated once; errors name file, line and key.
//! - [`app`]: builds every component from a [`Config`] and runs the listeners.
//! - `proxy/`: the HTTP server, routing, the read pipeline, the upstream client, the
//!   origin guard and the access log.
//! - `cache/`: cache keys, the entry format, TTL jitter, L1 (quick_cache) and L2 (Redis).
//! - `protect/`: Bloom filters, single-flight (local and the distributed lock), hot keys.
//! - `consistency/`: invalidation (L1, Redis, the retry journal), local generation marks,
//!   surrogate keys, and the invalidation stream consumer; the write route itself is
//!   `proxy/write.rs`, purges `proxy/purge.rs`.
//! - `coord/`: the Redis connection with bounded command times and health tracking, the Lua
//!   scripts and the event bus.
//! - `admin.rs`: the admin listener (`/metrics`, `/healthz`, `/readyz`, `/admin/*`: Bloom,
//!   hot keys, purge, the effective config), and `admin/status.rs`, the status page (`/`)
//!   with its sampled history.
//! - [`reload`]: config hot reload (file change or `SIGHUP`).
//! - [`metrics`]: every metric, defined and registered in one place.
//!
//! The read path, in order (see `proxy/read.rs`): route match → cache key → L1 → L2 →
//! single-flight → origin guard → origin → store (L2 with jittered TTL, L1).

pub mod app;
pub mod config;
pub mod metrics;

mod admin;
mod cache;
mod clock;
mod consistency;
mod coord;
mod error;
mod protect;
mod proxy;
pub mod reload;
pub mod shutdown;
mod tally;
mod worker;

#[cfg(test)]
mod test_redis;
// The integration tests' MariaDB fixture, shared with the unit tests of the MySQL lock.
#[cfg(test)]
#[path = "../tests/it/common/mariadb.rs"]
#[allow(dead_code, unreachable_pub)]
mod test_mariadb;

pub use app::{App, Running};
pub use config::Config;
