//! The Redis side of the Bloom filters (shared mode): a snapshot of each filter and a log
//! of the ids created since.
//!
//! - `<prefix>bloom:<name>`: the snapshot's header, written by whichever instance finished a
//!   source load: format version, the sizing it was built with, when its load began, its
//!   item count, and which parts hold the filter: a random 16-byte snapshot id, the part
//!   count, the filter's length and its CRC-32. A new instance starts from it in
//!   milliseconds.
//! - `<prefix>bloom:<name>:part:<i>`: part `i` of the filter as the `bloomfilter` crate
//!   serializes it (bitmap, hash count and seed), at most [`PART_MAX`] (512 KiB) a key, each
//!   led by the snapshot id and its index. The filter grows with `expected_items` (1.2 MB at
//!   1M items and p = 0.01); one string would be a big key on one cluster slot, parts spread
//!   over the slots and none of them grows past 512 KiB.
//! - `<prefix>bloom:<name>:adds`: a sorted set of created ids scored by the time (unix ms)
//!   they were added, trimmed to [`Shared::retention`]. Every add also goes out as a
//!   `bloom_add` event; the set is what an instance replays after it missed events (a gap
//!   in its subscription, or the time between a snapshot or a source export and now).
//!
//! A snapshot is written parts first and header last, each `SET … PX` with the retention,
//! so a header never names parts not yet written. Two instances writing at once may leave
//! a header beside another snapshot's parts, and a reader may read parts while a writer
//! replaces them: a reader therefore takes a snapshot only when every part is there, carries
//! the header's id and index and has the expected length, and the whole has the header's
//! CRC. Anything else is no snapshot: the filter loads from its source, as when there is
//! none, and a debug line says why. Parts beyond a new, shorter snapshot's count are left
//! to their TTL.
//!
//! A version-1 snapshot (one string, header and filter, written by an older instance) is
//! not decoded: it counts as no snapshot, and the next source load replaces it.
//!
//! Why a log of ids rather than a Redis bitmap set bit by bit: the crate does not expose the
//! bit positions of an id, and a filter rebuilt from the source (which forgets deleted ids)
//! must not be OR-ed with an older one that remembers them.

use std::fmt;
use std::time::Duration;

use bloomfilter::Bloom;
use redis::{FromRedisValue, Script};
use tokio::time::Instant;
use tracing::debug;

use crate::clock::now_ms;
use crate::config::BloomConfig;
use crate::coord::Keyspace;
use crate::coord::events::BloomAddEvent;
use crate::coord::redis::{RedisConn, Unavailable};
use crate::metrics::RedisOp;

/// Ids created up to this long before a load began are replayed after it: covers a source
/// that exports from a replica lagging behind the primary the create was written to.
pub(crate) const REPLAY_MARGIN_MS: u64 = 60_000;
/// Bound on one snapshot (all its keys) or replay transfer.
const BULK_TIMEOUT: Duration = Duration::from_secs(10);
const SNAPSHOT_MAGIC: &[u8; 4] = b"CGBF";
/// 2: the filter is in parts; 1 (one string, header then filter) is no longer read.
const SNAPSHOT_VERSION: u8 = 2;
/// magic, version, expected_items, fp_rate, load_started_ms, items, id, parts, len, crc.
const HEADER_LEN: usize = 4 + 1 + 8 + 8 + 8 + 8 + ID_LEN + 8 + 8 + 4;
const PART_MAGIC: &[u8; 4] = b"CGBP";
/// magic, snapshot id, part index.
const PART_HEADER_LEN: usize = 4 + ID_LEN + 8;
/// The largest value of one part key, its own header included.
const PART_MAX: usize = 512 * 1024;
/// Filter bytes in each part but the last.
const PART_BYTES: usize = PART_MAX - PART_HEADER_LEN;
const ID_LEN: usize = 16;

/// Names one written snapshot: its header and each of its parts carry it.
type SnapshotId = [u8; ID_LEN];

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

    /// Writes a snapshot of `bytes` (the serialized filter): every part, then the header
    /// (see the module docs), all within [`BULK_TIMEOUT`].
    pub(crate) async fn write_snapshot(
        &self,
        config: &BloomConfig,
        bytes: &[u8],
        load_started_ms: u64,
        items: u64,
    ) -> Result<(), Unavailable> {
        let deadline = Instant::now() + BULK_TIMEOUT;
        let id = rand::random::<u128>().to_le_bytes();
        let header = Header::new(config, bytes, load_started_ms, items, id);
        let ttl = u64::try_from(Self::retention(config).as_millis()).unwrap_or(u64::MAX);
        for (index, part) in (0u64..).zip(split(&id, bytes)) {
            let mut cmd = redis::cmd("SET");
            cmd.arg(self.keys.bloom_snapshot_part(&config.name, index))
                .arg(part)
                .arg("PX")
                .arg(ttl);
            self.bulk_until::<()>(&cmd, deadline).await?;
        }
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.snapshot_key(&config.name))
            .arg(header.encode())
            .arg("PX")
            .arg(ttl);
        self.bulk_until::<()>(&cmd, deadline).await
    }

    /// The snapshot, if one exists, is whole (see the module docs), was built with this
    /// filter's sizing and is recent enough that every id created since its load is still
    /// in the log.
    pub(crate) async fn read_snapshot(
        &self,
        config: &BloomConfig,
    ) -> Result<Option<Snapshot>, Unavailable> {
        let deadline = Instant::now() + BULK_TIMEOUT;
        let mut cmd = redis::cmd("GET");
        cmd.arg(self.snapshot_key(&config.name));
        let value: Option<Vec<u8>> = self.bulk_until(&cmd, deadline).await?;
        let Some(value) = value else {
            return Ok(None);
        };
        let oldest_covered = now_ms()
            .saturating_sub(u64::try_from(Self::retention(config).as_millis()).unwrap_or(u64::MAX));
        let read = match Header::decode(config, &value, oldest_covered) {
            Ok(header) => self.read_parts(config, &header, deadline).await?,
            Err(refused) => Err(refused),
        };
        match read {
            Ok(snapshot) => Ok(Some(snapshot)),
            Err(refused) => {
                debug!(
                    message = "Bloom filter snapshot in Redis not used; the filter loads from its source.",
                    filter = %config.name,
                    reason = %refused,
                );
                Ok(None)
            }
        }
    }

    /// The parts `header` names, one GET each (on a cluster they live on different slots),
    /// checked as they arrive: the first bad one ends the read.
    async fn read_parts(
        &self,
        config: &BloomConfig,
        header: &Header,
        deadline: Instant,
    ) -> Result<Result<Snapshot, Refused>, Unavailable> {
        let mut bytes = Vec::new();
        for index in 0..header.parts {
            let mut cmd = redis::cmd("GET");
            cmd.arg(self.keys.bloom_snapshot_part(&config.name, index));
            let part: Option<Vec<u8>> = self.bulk_until(&cmd, deadline).await?;
            if let Err(refused) = header.take_part(index, part, &mut bytes) {
                return Ok(Err(refused));
            }
        }
        Ok(header.finish(bytes))
    }

    /// One bulk command, bounded by what is left of the transfer's time.
    async fn bulk_until<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        deadline: Instant,
    ) -> Result<T, Unavailable> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Unavailable::Down);
        }
        self.redis.bulk(cmd, left).await
    }
}

/// Why a snapshot found in Redis is not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// Not a version-2 header: a version-1 snapshot, or garbage.
    NotAHeader,
    /// Built with another `expected_items` or `fp_rate`.
    OtherSizing,
    /// Older than the log of created ids reaches back.
    TooOld,
    /// The part count does not match the length.
    BadLayout,
    MissingPart(u64),
    /// Not a part, or part of another snapshot, or another index.
    OtherPart(u64),
    WrongLength(u64),
    BadChecksum,
    /// The bytes do not deserialize into a filter.
    NotAFilter,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refused::NotAHeader => f.write_str("not a version-2 snapshot header"),
            Refused::OtherSizing => f.write_str("built with another expected_items or fp_rate"),
            Refused::TooOld => f.write_str("older than the log of created ids"),
            Refused::BadLayout => f.write_str("the part count does not match the length"),
            Refused::MissingPart(i) => write!(f, "part {i} is missing"),
            Refused::OtherPart(i) => write!(f, "part {i} belongs to another snapshot"),
            Refused::WrongLength(i) => write!(f, "part {i} has the wrong length"),
            Refused::BadChecksum => f.write_str("the parts do not match the header's checksum"),
            Refused::NotAFilter => f.write_str("the bytes are not a Bloom filter"),
        }
    }
}

/// The value of `<prefix>bloom:<name>`.
#[derive(Debug, Clone, PartialEq)]
struct Header {
    expected_items: u64,
    fp_rate: f64,
    load_started_ms: u64,
    items: u64,
    id: SnapshotId,
    /// How many parts: `len` in slices of [`PART_BYTES`].
    parts: u64,
    /// The serialized filter's length.
    len: u64,
    /// CRC-32 of the serialized filter.
    crc: u32,
}

impl Header {
    fn new(
        config: &BloomConfig,
        bytes: &[u8],
        load_started_ms: u64,
        items: u64,
        id: SnapshotId,
    ) -> Self {
        Header {
            expected_items: config.expected_items as u64,
            fp_rate: config.fp_rate,
            load_started_ms,
            items,
            id,
            parts: bytes.len().div_ceil(PART_BYTES) as u64,
            len: bytes.len() as u64,
            crc: crc32fast::hash(bytes),
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut value = Vec::with_capacity(HEADER_LEN);
        value.extend_from_slice(SNAPSHOT_MAGIC);
        value.push(SNAPSHOT_VERSION);
        value.extend_from_slice(&self.expected_items.to_le_bytes());
        value.extend_from_slice(&self.fp_rate.to_bits().to_le_bytes());
        value.extend_from_slice(&self.load_started_ms.to_le_bytes());
        value.extend_from_slice(&self.items.to_le_bytes());
        value.extend_from_slice(&self.id);
        value.extend_from_slice(&self.parts.to_le_bytes());
        value.extend_from_slice(&self.len.to_le_bytes());
        value.extend_from_slice(&self.crc.to_le_bytes());
        value
    }

    /// The header in `value`, if it is one for this filter's sizing whose load began no
    /// earlier than `oldest_covered` (unix ms) less [`REPLAY_MARGIN_MS`].
    fn decode(config: &BloomConfig, value: &[u8], oldest_covered: u64) -> Result<Self, Refused> {
        if value.len() != HEADER_LEN
            || value.get(..4) != Some(SNAPSHOT_MAGIC.as_slice())
            || value.get(4) != Some(&SNAPSHOT_VERSION)
        {
            return Err(Refused::NotAHeader);
        }
        let mut at = 5;
        let mut take = |n: usize| {
            let field = value.get(at..at + n);
            at += n;
            field.ok_or(Refused::NotAHeader)
        };
        let u64_of = |b: &[u8]| {
            b.try_into()
                .map(u64::from_le_bytes)
                .map_err(|_| Refused::NotAHeader)
        };
        let expected_items = u64_of(take(8)?)?;
        let fp_rate = f64::from_bits(u64_of(take(8)?)?);
        let load_started_ms = u64_of(take(8)?)?;
        let items = u64_of(take(8)?)?;
        let id: SnapshotId = take(ID_LEN)?.try_into().map_err(|_| Refused::NotAHeader)?;
        let parts = u64_of(take(8)?)?;
        let len = u64_of(take(8)?)?;
        let crc = take(4)?
            .try_into()
            .map(u32::from_le_bytes)
            .map_err(|_| Refused::NotAHeader)?;
        if expected_items != config.expected_items as u64 || fp_rate != config.fp_rate {
            return Err(Refused::OtherSizing);
        }
        if load_started_ms.saturating_sub(REPLAY_MARGIN_MS) < oldest_covered {
            return Err(Refused::TooOld);
        }
        if parts != len.div_ceil(PART_BYTES as u64) {
            return Err(Refused::BadLayout);
        }
        Ok(Header {
            expected_items,
            fp_rate,
            load_started_ms,
            items,
            id,
            parts,
            len,
            crc,
        })
    }

    /// How many filter bytes part `index` holds.
    fn part_len(&self, index: u64) -> u64 {
        let start = index.saturating_mul(PART_BYTES as u64);
        self.len.saturating_sub(start).min(PART_BYTES as u64)
    }

    /// Appends part `index` (the value of its key, `None` when there is none) to `bytes`, if
    /// it is that part of this snapshot.
    fn take_part(
        &self,
        index: u64,
        value: Option<Vec<u8>>,
        bytes: &mut Vec<u8>,
    ) -> Result<(), Refused> {
        let value = value.ok_or(Refused::MissingPart(index))?;
        let (head, slice) = value
            .split_at_checked(PART_HEADER_LEN)
            .ok_or(Refused::OtherPart(index))?;
        if part_header(&self.id, index) != head {
            return Err(Refused::OtherPart(index));
        }
        if slice.len() as u64 != self.part_len(index) {
            return Err(Refused::WrongLength(index));
        }
        bytes.extend_from_slice(slice);
        Ok(())
    }

    /// The filter from the bytes of every part, if they are the ones the header describes.
    fn finish(&self, bytes: Vec<u8>) -> Result<Snapshot, Refused> {
        if bytes.len() as u64 != self.len || crc32fast::hash(&bytes) != self.crc {
            return Err(Refused::BadChecksum);
        }
        let bloom = Bloom::from_bytes(bytes).map_err(|_| Refused::NotAFilter)?;
        Ok(Snapshot {
            bloom,
            load_started_ms: self.load_started_ms,
            items: self.items,
        })
    }
}

/// The header of part `index` of snapshot `id`.
fn part_header(id: &SnapshotId, index: u64) -> [u8; PART_HEADER_LEN] {
    let mut head = [0; PART_HEADER_LEN];
    head[..4].copy_from_slice(PART_MAGIC);
    head[4..4 + ID_LEN].copy_from_slice(id);
    head[4 + ID_LEN..].copy_from_slice(&index.to_le_bytes());
    head
}

/// The values of the part keys of snapshot `id` of `bytes`, in index order.
fn split<'a>(id: &'a SnapshotId, bytes: &'a [u8]) -> impl Iterator<Item = Vec<u8>> + 'a {
    (0u64..)
        .zip(bytes.chunks(PART_BYTES))
        .map(move |(index, slice)| {
            let mut value = Vec::with_capacity(PART_HEADER_LEN + slice.len());
            value.extend_from_slice(&part_header(id, index));
            value.extend_from_slice(slice);
            value
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BloomSource, SourceFormat};

    fn config(expected_items: usize, fp_rate: f64) -> BloomConfig {
        BloomConfig {
            name: "items".to_owned(),
            expected_items,
            fp_rate,
            refresh: Duration::from_secs(600),
            load_timeout: Duration::from_secs(60),
            source: BloomSource::File("/dev/null".into()),
            format: SourceFormat::Lines,
        }
    }

    /// A filter of `expected_items` holding `"42"`, and its bytes.
    fn filter(expected_items: usize) -> Vec<u8> {
        let mut bloom: Bloom<[u8]> = Bloom::new_for_fp_rate(expected_items, 0.01).unwrap();
        bloom.set(b"42".as_slice());
        bloom.to_bytes()
    }

    /// What [`Shared::write_snapshot`] writes: the header's value and the parts' values.
    fn write(cfg: &BloomConfig, bytes: &[u8], id: SnapshotId) -> (Vec<u8>, Vec<Vec<u8>>) {
        let header = Header::new(cfg, bytes, 77, 3, id);
        (header.encode(), split(&id, bytes).collect())
    }

    /// What [`Shared::read_snapshot`] reads, given the header's value and what GET returns
    /// for each part key.
    fn read(
        cfg: &BloomConfig,
        header: &[u8],
        parts: Vec<Option<Vec<u8>>>,
    ) -> Result<Snapshot, Refused> {
        let header = Header::decode(cfg, header, 0)?;
        let mut bytes = Vec::new();
        let mut parts = parts.into_iter();
        for index in 0..header.parts {
            header.take_part(index, parts.next().flatten(), &mut bytes)?;
        }
        header.finish(bytes)
    }

    fn all(parts: &[Vec<u8>]) -> Vec<Option<Vec<u8>>> {
        parts.iter().cloned().map(Some).collect()
    }

    #[test]
    fn a_large_filter_is_split_into_parts_of_at_most_512_kib_and_joined_back() {
        let cfg = config(1_000_000, 0.01);
        let bytes = filter(1_000_000);
        assert!(bytes.len() > 1_000_000, "{} bytes", bytes.len());
        let (header, parts) = write(&cfg, &bytes, [7; ID_LEN]);
        assert_eq!(parts.len(), bytes.len().div_ceil(PART_BYTES));
        assert!(parts.len() >= 3, "{} parts", parts.len());
        assert!(parts.iter().all(|p| p.len() <= PART_MAX));
        assert_eq!(parts[0].len(), PART_MAX);
        assert!(header.len() < 100);
        let snap = read(&cfg, &header, all(&parts)).unwrap();
        assert!(snap.bloom.check(b"42".as_slice()));
        assert_eq!(snap.bloom.to_bytes(), bytes);
        assert_eq!((snap.load_started_ms, snap.items), (77, 3));
    }

    #[test]
    fn a_small_filter_is_one_part() {
        let cfg = config(1000, 0.01);
        let bytes = filter(1000);
        let (header, parts) = write(&cfg, &bytes, [1; ID_LEN]);
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0].len(), PART_HEADER_LEN + bytes.len());
        let snap = read(&cfg, &header, all(&parts)).unwrap();
        assert!(snap.bloom.check(b"42".as_slice()));
    }

    #[test]
    fn parts_of_another_snapshot_or_a_missing_part_are_refused() {
        let cfg = config(1_000_000, 0.01);
        let bytes = filter(1_000_000);
        let (header, parts) = write(&cfg, &bytes, [1; ID_LEN]);
        // Another instance wrote its parts over ours (same length, other id and seed).
        let (_, theirs) = write(&cfg, &filter(1_000_000), [2; ID_LEN]);

        let mut mixed = all(&parts);
        mixed[1] = Some(theirs[1].clone());
        assert_eq!(
            read(&cfg, &header, mixed).err(),
            Some(Refused::OtherPart(1))
        );

        let mut missing = all(&parts);
        missing[2] = None;
        assert_eq!(
            read(&cfg, &header, missing).err(),
            Some(Refused::MissingPart(2))
        );

        let mut reordered = all(&parts);
        reordered.swap(0, 1);
        assert_eq!(
            read(&cfg, &header, reordered).err(),
            Some(Refused::OtherPart(0))
        );

        let mut short = all(&parts);
        if let Some(Some(last)) = short.last_mut() {
            last.pop();
        }
        let last = parts.len() as u64 - 1;
        assert_eq!(
            read(&cfg, &header, short).err(),
            Some(Refused::WrongLength(last))
        );

        let mut stub = all(&parts);
        stub[0] = Some(b"CGBP".to_vec());
        assert_eq!(read(&cfg, &header, stub).err(), Some(Refused::OtherPart(0)));
    }

    #[test]
    fn a_flipped_byte_fails_the_checksum() {
        let cfg = config(1_000_000, 0.01);
        let bytes = filter(1_000_000);
        let (header, parts) = write(&cfg, &bytes, [1; ID_LEN]);
        let mut flipped = all(&parts);
        if let Some(Some(part)) = flipped.get_mut(1) {
            part[PART_HEADER_LEN + 1000] ^= 0x10;
        }
        assert_eq!(
            read(&cfg, &header, flipped).err(),
            Some(Refused::BadChecksum)
        );
    }

    #[test]
    fn other_sizings_old_snapshots_version_1_and_garbage_are_refused() {
        let cfg = config(1000, 0.01);
        let bytes = filter(1000);
        let (header, parts) = write(&cfg, &bytes, [1; ID_LEN]);
        let refused = |cfg: &BloomConfig, value: &[u8]| read(cfg, value, all(&parts)).err();
        assert_eq!(
            refused(&config(1000, 0.001), &header),
            Some(Refused::OtherSizing)
        );
        assert_eq!(
            refused(&config(2000, 0.01), &header),
            Some(Refused::OtherSizing)
        );
        assert_eq!(refused(&cfg, &header[..10]), Some(Refused::NotAHeader));
        assert_eq!(
            refused(&cfg, &[header.as_slice(), b"x"].concat()),
            Some(Refused::NotAHeader)
        );
        assert_eq!(
            refused(&cfg, b"garbage garbage garbage garbage garbage"),
            Some(Refused::NotAHeader)
        );
        // Version 1: the same first header fields, then the filter itself.
        let mut v1 = header[..5 + 32].to_vec();
        v1[4] = 1;
        v1.extend_from_slice(&bytes);
        assert_eq!(refused(&cfg, &v1), Some(Refused::NotAHeader));
        // Loaded at 77 ms: far older than a log that reaches back to now.
        let decoded = Header::decode(&cfg, &header, now_ms()).err();
        assert_eq!(decoded, Some(Refused::TooOld));
        // A part count that does not match the length.
        let mut layout = Header::decode(&cfg, &header, 0).unwrap();
        layout.parts += 1;
        let decoded = Header::decode(&cfg, &layout.encode(), 0).err();
        assert_eq!(decoded, Some(Refused::BadLayout));
    }

    #[test]
    fn bytes_that_are_not_a_filter_are_refused() {
        let cfg = config(1000, 0.01);
        let (header, parts) = write(&cfg, b"not a filter", [1; ID_LEN]);
        assert_eq!(
            read(&cfg, &header, all(&parts)).err(),
            Some(Refused::NotAFilter)
        );
    }

    #[test]
    fn part_keys_follow_the_snapshot_key() {
        let keys = Keyspace::new("cg:");
        assert_eq!(keys.bloom_snapshot("items"), "cg:bloom:items");
        assert_eq!(
            keys.bloom_snapshot_part("items", 2),
            "cg:bloom:items:part:2"
        );
    }
}
