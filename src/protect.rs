//! Protections in front of the origin: Bloom filters of existing ids ([`bloom`]),
//! in-process single-flight ([`flight`]) and the fleet-wide fill lock ([`lock`]).
//! The origin guard lives with the upstream client in `proxy/origin_guard.rs`.

pub(crate) mod bloom;
pub(crate) mod flight;
pub(crate) mod lock;
