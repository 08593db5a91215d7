//! Serialized writes in embedded mode: the fleet is this process, whose queue already lets
//! one write per resource through at a time; this only mints the tokens, from the local
//! clock the way Redis does, so they keep growing across restarts too.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use super::{Grant, Handle, next_token};

/// Resources whose last token is remembered; a forgotten one restarts from the clock.
const MAX_RESOURCES: u64 = 100_000;

#[derive(Debug)]
pub(crate) struct MemoryLocks {
    last: moka::sync::Cache<u128, u64>,
}

impl MemoryLocks {
    pub(crate) fn new() -> Self {
        MemoryLocks {
            last: moka::sync::Cache::builder()
                .max_capacity(MAX_RESOURCES)
                .time_to_idle(Duration::from_secs(3600))
                .build(),
        }
    }

    pub(super) fn acquire(&self, resource: u128, lease: Duration) -> Grant {
        Grant {
            token: self.mint(resource),
            expires: Instant::now() + lease,
            resource,
            owner: String::new(),
            handle: Handle::None,
            key: String::new(),
        }
    }

    /// A fresh token for `grant`, and a lease of `lease` from now.
    pub(super) fn pass_on(&self, grant: &mut Grant, lease: Duration) {
        grant.token = self.mint(grant.resource);
        grant.expires = Instant::now() + lease;
    }

    fn mint(&self, resource: u128) -> u64 {
        let now_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        // The entry's own lock makes the read-and-bump atomic per resource.
        self.last
            .entry(resource)
            .and_upsert_with(|last| next_token(last.map_or(0, |e| *e.value()), now_us))
            .into_value()
    }
}
