//! L2: entries in the shared Redis, one key per cache key, named by
//! [`Keyspace::entry`] (`<prefix>{<base>}:v` for a base key, `<prefix>{<base>}:v:<hash>`
//! for a variant): the same name the fill writes, so lookup and fill cannot disagree. A value that fails to decode is counted and treated
//! as a miss; the next fill overwrites it.

use std::sync::Arc;

use tracing::debug;

use super::{CacheKey, Entry};
use crate::coord::{Keyspace, RedisConn};
use crate::metrics::Metrics;

/// What an L2 read found.
#[derive(Debug)]
pub(crate) enum Lookup {
    Hit(Arc<Entry>),
    Miss,
    /// Redis is down or did not answer in time: carry on without it.
    Unavailable,
}

#[derive(Clone, Debug)]
pub(crate) struct L2 {
    redis: RedisConn,
    keys: Keyspace,
    metrics: Metrics,
}

impl L2 {
    pub(crate) fn new(redis: RedisConn, keys: Keyspace, metrics: Metrics) -> Self {
        L2 {
            redis,
            keys,
            metrics,
        }
    }

    pub(crate) fn redis(&self) -> &RedisConn {
        &self.redis
    }

    pub(crate) async fn get(&self, key: &CacheKey) -> Lookup {
        let bytes = match self.redis.get(&self.keys.entry(key.base, key.hash)).await {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Lookup::Miss,
            Err(_) => return Lookup::Unavailable,
        };
        match Entry::decode(&bytes) {
            Ok(entry) if entry.matches(key) => Lookup::Hit(Arc::new(entry)),
            // Another key with the same 128-bit hash: a miss, never a wrong answer.
            Ok(_) => Lookup::Miss,
            Err(error) => {
                self.metrics.entry_decode_errors.inc();
                debug!(message = "Undecodable L2 value treated as a miss.", %error);
                Lookup::Miss
            }
        }
    }
}
