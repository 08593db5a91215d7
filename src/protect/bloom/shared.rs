//! The Redis side of the Bloom filters (shared mode): a snapshot of each filter and a log
//! of the ids created since.
//!
//! - `<prefix>bloom:<name>`: the snapshot, written by whichever instance finished a source
//!   load: a small header (format version, the sizing it was built with, when its load
//!   began, its item count) followed by the filter as the `bloomfilter` crate serializes it
//!   (bitmap, hash count and seed). A new instance starts from it in milliseconds.
//! - `<prefix>bloom:<name>:adds`: a sorted set of created ids scored by the time (unix ms)
//!   they were added, trimmed to [`Shared::retention`]. Every add also goes out as a
//!   `bloom_add` event; the set is what an instance replays after it missed events (a gap
//!   in its subscription, or the time between a snapshot or a source export and now).
//!
//! Why a log of ids rather than a Redis bitmap set bit by bit: the crate does not expose the
//! bit positions of an id, and a filter rebuilt from the source (which forgets deleted ids)
//! must not be OR-ed with an older one that remembers them.

use std::time::Duration;

use bloomfilter::Bloom;
use redis::Script;

use crate::clock::now_ms;
use crate::config::BloomConfig;
use crate::coord::Keyspace;
use crate::coord::events::BloomAddEvent;
use crate::coord::redis::{RedisConn, Unavailable};
use crate::metrics::RedisOp;

/// Ids created up to this long before a load began are replayed after it: covers a source
/// that exports from a replica lagging behind the primary the create was written to.
pub(crate) const REPLAY_MARGIN_MS: u64 = 60_000;
/// Bound on one snapshot or replay transfer.
const BULK_TIMEOUT: Duration = Duration::from_secs(10);
const SNAPSHOT_MAGIC: &[u8; 4] = b"CGBF";
const SNAPSHOT_VERSION: u8 = 1;
const HEADER_LEN: usize = 4 + 1 + 8 + 8 + 8 + 8;

/// ZADD the id, trim what is older than the retention, keep the set's TTL, and publish the
/// `bloom_add` event — one round trip, and the event never goes out without the log entry.
const ADD: &str = r"
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (tonumber(ARGV[2]) - tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
";

/// A decoded snapshot.
pub(crate) struct Snapshot {
    pub(crate) bloom: Bloom<[u8]>,
    pub(crate) load_started_ms: u64,
    pub(crate) items: u64,
}

/// Redis access for every filter of one instance.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) redis: RedisConn,
    keys: Keyspace,
    channel: String,
    add_script: Script,
}

impl Shared {
    pub(crate) fn new(redis: RedisConn, keys: Keyspace) -> Self {
        Shared {
            redis,
            channel: keys.events_channel(),
            keys,
            add_script: Script::new(ADD),
        }
    }

    fn snapshot_key(&self, filter: &str) -> String {
        self.keys.bloom_snapshot(filter)
    }

    fn adds_key(&self, filter: &str) -> String {
        self.keys.bloom_adds(filter)
    }

    /// How long created ids are kept in the log (and a snapshot trusted): long enough for
    /// every instance's next source load to include them.
    pub(crate) fn retention(config: &BloomConfig) -> Duration {
        if config.refresh.is_zero() {
            Duration::from_secs(24 * 3600)
        } else {
            (config.refresh * 3).max(Duration::from_secs(3600))
        }
    }

    /// Logs and broadcasts one created id (bounded by `command_timeout`).
    pub(crate) async fn add(
        &self,
        config: &BloomConfig,
        event: &BloomAddEvent,
        at_ms: u64,
    ) -> Result<(), Unavailable> {
        let key = self.adds_key(&config.name);
        let retention = Self::retention(config).as_millis().to_string();
        let message = event.encode();
        let at = at_ms.to_string();
        self.redis
            .run_script::<i64>(
                RedisOp::Bloom,
                &self.add_script,
                &[&key],
                &[
                    &event.id,
                    at.as_bytes(),
                    retention.as_bytes(),
                    self.channel.as_bytes(),
                    message.as_bytes(),
                ],
            )
            .await
            .map(|_| ())
    }

    /// Every id logged at or after `since_ms`.
    pub(crate) async fn adds_since(
        &self,
        filter: &str,
        since_ms: u64,
    ) -> Result<Vec<Vec<u8>>, Unavailable> {
        let mut cmd = redis::cmd("ZRANGEBYSCORE");
        cmd.arg(self.adds_key(filter)).arg(since_ms).arg("+inf");
        self.redis.bulk(&cmd, BULK_TIMEOUT).await
    }

    pub(crate) async fn write_snapshot(
        &self,
        config: &BloomConfig,
        bytes: &[u8],
        load_started_ms: u64,
        items: u64,
    ) -> Result<(), Unavailable> {
        let mut value = Vec::with_capacity(HEADER_LEN + bytes.len());
        value.extend_from_slice(SNAPSHOT_MAGIC);
        value.push(SNAPSHOT_VERSION);
        value.extend_from_slice(&(config.expected_items as u64).to_le_bytes());
        value.extend_from_slice(&config.fp_rate.to_bits().to_le_bytes());
        value.extend_from_slice(&load_started_ms.to_le_bytes());
        value.extend_from_slice(&items.to_le_bytes());
        value.extend_from_slice(bytes);
        let ttl = u64::try_from(Self::retention(config).as_millis()).unwrap_or(u64::MAX);
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.snapshot_key(&config.name))
            .arg(value)
            .arg("PX")
            .arg(ttl);
        self.redis.bulk::<()>(&cmd, BULK_TIMEOUT).await
    }

    /// The snapshot, if one exists, was built with this filter's sizing and is recent
    /// enough that every id created since its load is still in the log.
    pub(crate) async fn read_snapshot(
        &self,
        config: &BloomConfig,
    ) -> Result<Option<Snapshot>, Unavailable> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.snapshot_key(&config.name));
        let value: Option<Vec<u8>> = self.redis.bulk(&cmd, BULK_TIMEOUT).await?;
        let Some(value) = value else {
            return Ok(None);
        };
        let oldest_covered = now_ms()
            .saturating_sub(u64::try_from(Self::retention(config).as_millis()).unwrap_or(u64::MAX));
        Ok(decode_snapshot(config, value)
            .filter(|s| s.load_started_ms.saturating_sub(REPLAY_MARGIN_MS) >= oldest_covered))
    }
}

/// `None` for a value that is not a snapshot of this filter's sizing (another version, a
/// config change, garbage).
fn decode_snapshot(config: &BloomConfig, mut value: Vec<u8>) -> Option<Snapshot> {
    let header = value.get(..HEADER_LEN)?;
    if &header[..4] != SNAPSHOT_MAGIC || header[4] != SNAPSHOT_VERSION {
        return None;
    }
    let u64_at = |at: usize| {
        header
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let expected_items = u64_at(5)?;
    let fp_rate = f64::from_bits(u64_at(13)?);
    let load_started_ms = u64_at(21)?;
    let items = u64_at(29)?;
    if expected_items != config.expected_items as u64 || fp_rate != config.fp_rate {
        return None;
    }
    let bytes = value.split_off(HEADER_LEN);
    let bloom = Bloom::from_bytes(bytes).ok()?;
    Some(Snapshot {
        bloom,
        load_started_ms,
        items,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BloomSource, SourceFormat};

    fn config(fp_rate: f64) -> BloomConfig {
        BloomConfig {
            name: "items".to_owned(),
            expected_items: 1000,
            fp_rate,
            refresh: Duration::from_secs(600),
            load_timeout: Duration::from_secs(60),
            source: BloomSource::File("/dev/null".into()),
            format: SourceFormat::Lines,
        }
    }

    fn encode(config: &BloomConfig, bloom: &Bloom<[u8]>, started: u64) -> Vec<u8> {
        let bytes = bloom.to_bytes();
        let mut value = Vec::new();
        value.extend_from_slice(SNAPSHOT_MAGIC);
        value.push(SNAPSHOT_VERSION);
        value.extend_from_slice(&(config.expected_items as u64).to_le_bytes());
        value.extend_from_slice(&config.fp_rate.to_bits().to_le_bytes());
        value.extend_from_slice(&started.to_le_bytes());
        value.extend_from_slice(&3u64.to_le_bytes());
        value.extend_from_slice(&bytes);
        value
    }

    #[test]
    fn snapshots_round_trip_and_other_sizings_are_refused() {
        let cfg = config(0.01);
        let mut bloom: Bloom<[u8]> = Bloom::new_for_fp_rate(1000, 0.01).unwrap();
        bloom.set(b"42".as_slice());
        let value = encode(&cfg, &bloom, 77);
        let snap = decode_snapshot(&cfg, value.clone()).unwrap();
        assert!(snap.bloom.check(b"42".as_slice()));
        assert_eq!((snap.load_started_ms, snap.items), (77, 3));
        assert!(decode_snapshot(&config(0.001), value.clone()).is_none());
        assert!(decode_snapshot(&cfg, value[..10].to_vec()).is_none());
        assert!(
            decode_snapshot(&cfg, b"garbage garbage garbage garbage garbage".to_vec()).is_none()
        );
    }
}
