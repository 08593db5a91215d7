//! Protections in front of the origin: Bloom filters of existing ids ([`bloom`]),
//! single-flight in this process and across the fleet ([`flight`], [`flight::fleet`]) and
//! hot-key detection with per-key limits ([`hotkeys`]), and a budget of query variants per
//! path ([`variants`]), and stock gates that answer a flash sale's crowd "sold out" at
//! the edge ([`stock`]), and the fleet-wide queue of serialized writes ([`serialize`]).
//! The origin guard lives with the upstream client in `proxy/origin_guard.rs`.

pub(crate) mod bloom;
pub(crate) mod flight;
pub(crate) mod hotkeys;
pub(crate) mod serialize;
pub(crate) mod stock;
pub(crate) mod variants;
