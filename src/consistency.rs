//! The write path's consistency machinery: after a write, no instance serves the old value
//! for longer than a configured bound, and every invalidation a write owes is eventually
//! done — even across a Redis outage and a restart of cacheguard.
//!
//! - [`invalidate`]: the one invalidation routine (L1, Redis, journal on failure).
//! - [`tags`]: surrogate keys (`Surrogate-Key`, `Cache-Tag`).
//! - [`journal`]: the durable retry journal of owed invalidations.
//! - [`stream`]: external invalidations from a Redis Stream (CDC, batch jobs).
//!
//! The write route itself (delayed double delete) is `proxy/write.rs`; the purge API is in
//! `admin.rs`.

pub(crate) mod invalidate;
pub(crate) mod journal;
pub(crate) mod stream;
pub(crate) mod tags;
