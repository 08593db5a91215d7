//! L2: entries in the shared Redis, one key per cache key, named by
//! [`Keyspace::entry`] (`<prefix>{<base>}:v` for a base key, `<prefix>{<base>}:v:<hash>`
//! for a variant): the same name the fill writes, so lookup and fill cannot disagree.
//!
//! A value is served only once it has proved whole (`entry.rs`: its recorded length is the
//! number of bytes read, and its checksum matches). One that does not — cut, padded, a byte
//! changed, an older format, not an entry at all — is counted
//! (`cacheguard_entry_decode_errors_total`) and is a miss; the fill that follows stores a
//! new value over it (the fill script's `SET` replaces whatever is there).
//!
//! An entry is read with `GETRANGE` up to 256 KiB + 1 byte: all of a small value in one
//! command (a value cut to exactly 256 KiB reads as one of that size, and its recorded
//! length refuses it); a larger one is then read whole on the bulk connection (its own timeout, not counted
//! toward the breaker), so a large value never holds up the shared connection nor times
//! out at `command_timeout` (as the fill writes it, `coord/store.rs`).
//!
//! Concurrent reads of one key in this process share `GET`s: a burst of requests for one
//! key costs Redis about two reads per instance, not one per request (nor, for a large
//! entry, one transfer of it per request). The first reader reads; the others wait for its
//! answer on a `watch` channel. A miss is as true when it arrives as when the read was sent
//! (the fill that follows re-checks), so every waiter takes it. A copy is taken only by the
//! requests that arrived before its read was sent: for a request that came later, a write
//! whose answer its client already saw may have invalidated the copy after the read was
//! sent. Those wait for the next read, which they all share (read-after-write holds on
//! every instance). Arrivals and reads are ordered by one counter.
//! Hand-written rather than `futures::Shared`: a reader that is cancelled must not leave
//! a half-done read behind for later readers (its answer could predate an invalidation by
//! any length of time), so the entry is removed by the reader's `Drop`, and waiters whose
//! reader went away read for themselves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;
use tracing::debug;

use super::{CacheKey, Entry};
use crate::coord::store::{LARGE_VALUE, LARGE_VALUE_TIMEOUT};
use crate::coord::{Keyspace, RedisConn};
use crate::metrics::Metrics;

/// What an L2 read found.
#[derive(Clone, Debug)]
pub(crate) enum Lookup {
    Hit(Arc<Entry>),
    Miss,
    /// Redis is down or did not answer in time: carry on without it.
    Unavailable,
}

/// Reads in progress, by key hash.
type Reads = Mutex<HashMap<u128, Read>>;

/// A read in progress: when it was sent (on the arrival counter) and its answer, once there.
#[derive(Clone, Debug)]
struct Read {
    sent: u64,
    answer: watch::Receiver<Option<Lookup>>,
}

/// How many reads a request waits for before it reads alone (each wait normally ends with
/// an answer it may take by the second).
const MAX_SHARED_ROUNDS: usize = 3;

#[derive(Clone, Debug)]
pub(crate) struct L2 {
    redis: RedisConn,
    keys: Keyspace,
    metrics: Metrics,
    reads: Arc<Reads>,
    /// Orders arrivals and reads (see the module docs).
    order: Arc<AtomicU64>,
}

/// The read of one key in progress: removed from the table when its reader is done or
/// dropped (cancelled), so no later reader waits on a read nobody drives.
struct Reading<'a> {
    reads: &'a Reads,
    hash: u128,
    answer: watch::Sender<Option<Lookup>>,
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        self.reads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.hash);
    }
}

/// Whether this request reads the key itself or waits for another's read.
enum Role<'a> {
    Reader(Reading<'a>),
    Waiter(Read),
}

impl L2 {
    pub(crate) fn new(redis: RedisConn, keys: Keyspace, metrics: Metrics) -> Self {
        L2 {
            redis,
            keys,
            metrics,
            reads: Arc::default(),
            order: Arc::default(),
        }
    }

    pub(crate) fn redis(&self) -> &RedisConn {
        &self.redis
    }

    /// The entry for `key`, sharing a read of the same key in progress here when its
    /// answer is as good as a read of this request's own.
    ///
    /// # Cancel safety
    /// Cancel-safe: a cancelled reader's waiters read again.
    pub(crate) async fn get(&self, key: &CacheKey) -> Lookup {
        let arrived = self.order.fetch_add(1, Ordering::AcqRel);
        for _ in 0..MAX_SHARED_ROUNDS {
            match self.role(key.hash) {
                Role::Reader(reading) => {
                    let answer = self.read(key).await;
                    reading.answer.send_replace(Some(answer.clone()));
                    return answer;
                }
                Role::Waiter(Read { sent, mut answer }) => {
                    let shared = match answer.wait_for(Option::is_some).await {
                        Ok(found) => found.clone(),
                        // The reader went away without an answer.
                        Err(_) => None,
                    };
                    match shared {
                        // Nothing there, or Redis down: as true now as when the read was sent.
                        Some(found @ (Lookup::Miss | Lookup::Unavailable)) => return found,
                        // Read after this request came: nothing it must see can be missing.
                        Some(Lookup::Hit(entry)) if sent > arrived => return Lookup::Hit(entry),
                        // Read before: a write this request's client already saw answered may
                        // have invalidated it since. Share the next read.
                        Some(Lookup::Hit(_)) | None => {}
                    }
                }
            }
        }
        self.read(key).await
    }

    fn role(&self, hash: u128) -> Role<'_> {
        let mut reads = self.reads.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(read) = reads.get(&hash) {
            return Role::Waiter(read.clone());
        }
        let (answer, waiters) = watch::channel(None);
        let sent = self.order.fetch_add(1, Ordering::AcqRel);
        reads.insert(
            hash,
            Read {
                sent,
                answer: waiters,
            },
        );
        Role::Reader(Reading {
            reads: &self.reads,
            hash,
            answer,
        })
    }

    async fn read(&self, key: &CacheKey) -> Lookup {
        let name = self.keys.entry(key.base, key.hash);
        // The first LARGE_VALUE + 1 bytes: all of a small value, in one command. A larger
        // one is then read whole on the bulk connection, with a timeout of its own.
        let bytes = match self.redis.get_up_to(&name, LARGE_VALUE + 1).await {
            // No value (an entry is never empty).
            Ok(bytes) if bytes.is_empty() => return Lookup::Miss,
            Ok(bytes) if bytes.len() > LARGE_VALUE => {
                match self.redis.bulk_get(&name, LARGE_VALUE_TIMEOUT).await {
                    Ok(Some(bytes)) => bytes,
                    Ok(None) => return Lookup::Miss,
                    Err(_) => return Lookup::Unavailable,
                }
            }
            Ok(bytes) => bytes,
            Err(_) => return Lookup::Unavailable,
        };
        match Entry::decode(bytes::Bytes::from(bytes)) {
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
