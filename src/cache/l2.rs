//! L2: entries in the shared Redis, one key per cache key, named by
//! [`Keyspace::entry`] (`<prefix>{<base>}:v` for a base key, `<prefix>{<base>}:v:<hash>`
//! for a variant): the same name the fill writes, so lookup and fill cannot disagree.
//!
//! A value is served only once it has proved whole (`entry.rs`: its recorded length is the
//! number of bytes read, and its checksum matches) and to be the entry of the key asked
//! for. One that does not — cut, padded, a byte changed, an older format, not an entry at
//! all, a whole entry of another cache key copied under this one's name — is counted
//! (`cacheguard_entry_decode_errors_total`) and is a miss; the fill that follows stores a
//! new value over it (the fill script's `SET` replaces whatever is there).
//!
//! An entry is read with `GETRANGE` up to 256 KiB + 1 byte: all of a small value in one
//! command (a value cut to exactly 256 KiB reads as one of that size, and its recorded
//! length refuses it). A larger one is then read on the bulk connection (its own timeout,
//! not counted toward the breaker), so a large value never holds up the shared connection
//! nor times out at `command_timeout` (as the fill writes it, `coord/store.rs`). Its first
//! bytes record its length: the rest is read in 1 MiB `GETRANGE` pieces into one buffer of
//! that size plus one byte (so a padded value reads longer than it says), and the
//! connection never holds more than a piece. Read in pieces, a value replaced between two
//! of them would read as a mix of both; its checksum tells, and then it is read once more in
//! one `GET`: only a value that fails read in one piece is counted as damaged.
//!
//! Readers of one large value share one buffer, however many there are. A large value that
//! proved whole is kept in a table of live values (a `Weak` per key hash, so it lives only
//! as long as an answer being written or an L1 copy holds it). A later read of the key
//! still sends its first `GETRANGE` (after the request arrived: read-after-write is decided
//! on that read, as for any read) and, when those first 256 KiB + 1 bytes and the recorded
//! length are the live value's, takes the live buffer instead of reading and holding the
//! value again. Those bytes hold the value's meta and checksum, so they name one stored
//! value: a refill or an invalidation in between changes them (a new store time, or no
//! value at all). Only damage past those bytes can make Redis's value differ from the live
//! one; while the live copy is held, readers get that copy (the answer as it was stored),
//! and the first read after it is let go finds the damage, counts it and refills.
//!
//! Concurrent reads of one key in this process share `GET`s: a burst of requests for one
//! key costs Redis about two reads per instance, not one per request (nor, for a large
//! entry, one transfer of it per request). The first reader reads; the others wait for its
//! answer on a `watch` channel, made when the first of them arrives (a read nobody waits
//! for, the common case, makes none). A miss is as true when it arrives as when the read was sent
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
use std::sync::{Arc, Mutex, PoisonError, Weak};

use bytes::Bytes;
use tokio::sync::watch;
use tracing::debug;

use super::entry::{Checked, DecodeEntryError, stored_len};
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

/// A read in progress: when it was sent (on the arrival counter), and the channel its answer
/// goes out on, once a request waits for it.
#[derive(Debug)]
struct Read {
    sent: u64,
    answer: Option<watch::Sender<Option<Lookup>>>,
}

/// A wait for another request's read: when that read was sent, and its answer, once there.
struct Awaited {
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
    /// Large values read here and still held.
    live: Arc<Live>,
}

/// The read of one key in progress: removed from the table when its reader is done
/// ([`Reading::answered`]) or dropped (cancelled: its waiters' channel closes and they read
/// for themselves), so no later reader waits on a read nobody drives.
struct Reading<'a> {
    reads: &'a Reads,
    hash: u128,
}

impl Reading<'_> {
    /// The read's answer: out of the table, and to whoever waits for it.
    fn answered(self, answer: &Lookup) {
        let read = self.take();
        std::mem::forget(self);
        if let Some(Read {
            answer: Some(waiters),
            ..
        }) = read
        {
            waiters.send_replace(Some(answer.clone()));
        }
    }

    /// This read's entry, out of the table (the entry at its hash is its own: one is made
    /// only where there is none, and only its reader removes it).
    fn take(&self) -> Option<Read> {
        self.reads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.hash)
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        drop(self.take());
    }
}

/// Whether this request reads the key itself or waits for another's read.
enum Role<'a> {
    Reader(Reading<'a>),
    Waiter(Awaited),
}

impl L2 {
    pub(crate) fn new(redis: RedisConn, keys: Keyspace, metrics: Metrics) -> Self {
        L2 {
            redis,
            keys,
            metrics,
            reads: Arc::default(),
            order: Arc::default(),
            live: Arc::default(),
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
                    reading.answered(&answer);
                    return answer;
                }
                Role::Waiter(Awaited { sent, mut answer }) => {
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
        if let Some(read) = reads.get_mut(&hash) {
            let answer = read
                .answer
                .get_or_insert_with(|| watch::channel(None).0)
                .subscribe();
            return Role::Waiter(Awaited {
                sent: read.sent,
                answer,
            });
        }
        let sent = self.order.fetch_add(1, Ordering::AcqRel);
        reads.insert(hash, Read { sent, answer: None });
        Role::Reader(Reading {
            reads: &self.reads,
            hash,
        })
    }

    async fn read(&self, key: &CacheKey) -> Lookup {
        let name = self.keys.entry(key.base, key.hash);
        // The first LARGE_VALUE + 1 bytes: all of a small value, in one command.
        let first = match self.redis.get_up_to(&name, LARGE_VALUE + 1).await {
            Ok(first) => first,
            Err(_) => return Lookup::Unavailable,
        };
        let decoded = if first.is_empty() {
            // No value (an entry is never empty).
            return Lookup::Miss;
        } else if first.len() > LARGE_VALUE {
            match self.read_large(key.hash, &name, first).await {
                Large::Read(decoded) => decoded,
                Large::Gone => return Lookup::Miss,
                Large::Unavailable => return Lookup::Unavailable,
            }
        } else {
            Entry::decode(Bytes::from(first)).map(Arc::new)
        };
        match decoded {
            Ok(entry) if entry.matches(key) => Lookup::Hit(entry),
            // A whole entry of another cache key: copied or renamed under this one's name
            // (or, once in 2^128, another key with the same hash). Refused like a damaged
            // value: a miss, never a wrong answer, and counted.
            Ok(_) => {
                self.metrics.entry_decode_errors.inc();
                debug!(
                    message = "L2 value of another cache key treated as a miss.",
                    key = %name,
                );
                Lookup::Miss
            }
            Err(error) => {
                self.metrics.entry_decode_errors.inc();
                debug!(message = "Undecodable L2 value treated as a miss.", %error);
                Lookup::Miss
            }
        }
    }

    /// A value longer than `LARGE_VALUE`, whose first `LARGE_VALUE + 1` bytes are `first`:
    /// the same stored value as a live one, shared; or the rest of it read in pieces into
    /// one buffer of the size it records, and checked whole.
    async fn read_large(&self, hash: u128, name: &str, first: Vec<u8>) -> Large {
        let len = match stored_len(&first) {
            Ok(len) => len,
            Err(error) => return Large::Read(Err(error)),
        };
        if let Some(value) = self.live.find(hash, len, &first) {
            return Large::Read(Entry::from_checked(&value).map(Arc::new));
        }
        // One byte more than it records, so that a padded value reads longer than it says.
        // The length is not checked yet (at most 512 MiB): a damaged one may ask for more
        // than this process can have, which is not a reason to abort it.
        let end = len.saturating_add(1).max(first.len());
        let mut value = Vec::new();
        if value.try_reserve_exact(end).is_err() {
            return Large::Unavailable;
        }
        value.extend_from_slice(&first);
        drop(first);
        if self
            .redis
            .bulk_get_rest(name, &mut value, end, LARGE_VALUE_TIMEOUT)
            .await
            .is_err()
        {
            return Large::Unavailable;
        }
        let value = match Checked::new(value) {
            Ok(value) => value,
            // Read in pieces, the value may have been replaced (or removed) between two of
            // them: only a value read in one piece that fails is a damaged one.
            Err(_) => match self.redis.bulk_get(name, LARGE_VALUE_TIMEOUT).await {
                Ok(Some(whole)) => match Checked::new(whole) {
                    Ok(value) => value,
                    Err(error) => return Large::Read(Err(error)),
                },
                Ok(None) => return Large::Gone,
                Err(_) => return Large::Unavailable,
            },
        };
        let value = Arc::new(value);
        let entry = Entry::from_checked(&value).map(Arc::new);
        if entry.is_ok() {
            self.live.keep(hash, &value);
        }
        Large::Read(entry)
    }
}

/// What reading a large value found.
enum Large {
    Read(Result<Arc<Entry>, DecodeEntryError>),
    /// Removed while it was being read.
    Gone,
    Unavailable,
}

/// Large values read here that something still holds (an answer being written, an L1 copy),
/// by key hash, so that a new read of the same stored value takes the buffer that is there
/// instead of reading and holding the value once more (see the module docs).
#[derive(Debug, Default)]
struct Live {
    table: Mutex<LiveTable>,
}

#[derive(Debug, Default)]
struct LiveTable {
    values: HashMap<u128, Weak<Checked>>,
    /// The table's size at which the values nothing holds any more are dropped.
    sweep_at: usize,
}

/// The smallest size at which the live table is swept.
const LIVE_SWEEP_MIN: usize = 64;

impl Live {
    /// The live value of `hash` if it is the one whose first bytes are `first` and whose
    /// length is `len`.
    fn find(&self, hash: u128, len: usize, first: &[u8]) -> Option<Arc<Checked>> {
        let value = self
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values
            .get(&hash)?
            .upgrade()?;
        let bytes = value.as_bytes();
        (bytes.len() == len && bytes.starts_with(first)).then_some(value)
    }

    fn keep(&self, hash: u128, value: &Arc<Checked>) {
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        table.values.insert(hash, Arc::downgrade(value));
        // Swept when it has doubled since the last sweep: amortized O(1) per insert, and
        // never more than twice the live values (or the minimum) in size.
        if table.values.len() >= table.sweep_at {
            table.values.retain(|_, value| value.strong_count() > 0);
            table.sweep_at = (table.values.len() * 2).max(LIVE_SWEEP_MIN);
        }
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, StatusCode};

    use super::*;

    fn value(body: &[u8]) -> Arc<Checked> {
        let entry = Entry::new(
            "item\n/api/items/1\n",
            StatusCode::OK,
            &HeaderMap::new(),
            Bytes::copy_from_slice(body),
        );
        Arc::new(Checked::new(entry.encode().unwrap()).unwrap())
    }

    #[test]
    fn a_live_value_is_found_only_by_its_key_first_bytes_and_length() {
        let live = Live::default();
        let held = value(b"the body");
        live.keep(1, &held);
        let bytes = held.as_bytes().to_vec();
        let first = &bytes[..30];
        assert!(live.find(1, bytes.len(), first).is_some());
        assert!(live.find(2, bytes.len(), first).is_none(), "another key");
        assert!(
            live.find(1, bytes.len() + 1, first).is_none(),
            "another length"
        );
        let mut other = first.to_vec();
        other[5] ^= 1;
        assert!(
            live.find(1, bytes.len(), &other).is_none(),
            "another checksum"
        );
        drop(held);
        assert!(
            live.find(1, bytes.len(), first).is_none(),
            "nothing holds it"
        );
    }

    #[test]
    fn the_live_table_drops_what_nothing_holds() {
        let live = Live::default();
        for hash in 0..1000 {
            live.keep(hash, &value(b"let go at once"));
        }
        let held = value(b"held");
        live.keep(1000, &held);
        let table = live.table.lock().unwrap();
        assert!(
            table.values.len() <= LIVE_SWEEP_MIN,
            "{}",
            table.values.len()
        );
        assert!(
            table
                .values
                .get(&1000)
                .is_some_and(|v| v.upgrade().is_some())
        );
    }
}
