//! Protections in front of the origin. For now: in-process single-flight ([`flight`]).
//! The origin guard lives with the upstream client in `proxy/origin_guard.rs`.

pub(crate) mod flight;
