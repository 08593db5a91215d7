//! The stored entry: one origin answer plus what is needed to serve and age it.
//!
//! An entry's key and header lines live in one buffer beside its body ([`Packed`]): an L1
//! copy is those two, the few numbers that age it and a small struct, nothing per header;
//! an L2 value read from Redis becomes an entry without a copy (both are slices of the
//! reply). A hit builds its response headers from the buffer's lines, each value a slice
//! of it, each name a standard one or a clone of one made with the entry.
//!
//! Wire format (L2), version 8:
//!
//! ```text
//! 0..2    b"CG"
//! 2       8, the format version
//! 3..11   checksum: xxh3-64 of every byte from 11 to the end (u64, little-endian)
//! 11..19  the value's length in bytes, these 19 included (u64, little-endian)
//! 19..    the postcard encoding of [`Meta`] (the numbers that age the entry, its tags and
//!         selecting headers, the lengths of its key, head and body), the head, the body
//! ```
//!
//! A value read back proves it is whole before any of it is used ([`Entry::decode`]): the
//! length it records is the number of bytes read, its meta, head and body lengths add up
//! to it, and the checksum over everything after the checksum matches. A value cut
//! anywhere (inside the head, inside the body, at a read window), padded, or with any byte
//! changed is an error. Magic and version are compared exactly; the length field is
//! covered by the checksum. xxh3 catches damage, not a forger: whoever can write to Redis
//! can store any answer anyway. A large value's first bytes tell its length
//! ([`stored_len`]) and, with its checksum and meta, which stored value it is: `l2.rs`
//! reads it in pieces into one buffer of that size ([`Checked`]) and lets later reads of
//! the same value share that buffer.
//!
//! Versions 1–7 carried no checksum, and version 7 no body length (its body was "the rest",
//! so a value cut inside its body read as a shorter answer). They are not served: decoding
//! one is an error ([`DecodeEntryError::Unchecked`]), which the caller counts and treats as
//! a miss, and the fill that follows rewrites the value in version 8. That costs one origin
//! fetch per key still stored in an old version after an upgrade (and, while instances of
//! both versions share a Redis, each rewrites what the other wrote), and it is the only
//! way to never serve a value that cannot prove it is whole. Decoding anything else
//! (garbage, another program's value, a future version) is an error too, never a crash.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use super::CacheKey;

const MAGIC: &[u8; 2] = b"CG";
/// The format version written and the only one served (see the module docs).
const VERSION: u8 = 8;
/// Where the checksum is, and what it covers: every byte from `CHECKED` to the end.
const CHECKSUM: std::ops::Range<usize> = 3..11;
const CHECKED: usize = 11;
/// Where the value's length is.
const LENGTH: std::ops::Range<usize> = 11..19;
/// Magic, version, checksum and length: what precedes the meta.
const FIXED: usize = 19;
/// No Redis string is longer (`proto-max-bulk-len`'s default, 512 MB): a value recording a
/// greater length is damaged, and nothing is allocated for it.
const MAX_VALUE: u64 = 512 * 1024 * 1024;

/// A cached answer, ready to serve.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub(crate) status: StatusCode,
    /// Wall-clock store time, ms since the Unix epoch.
    pub(crate) stored_at_ms: u64,
    /// The answer's age when it arrived (its upstream `Age`, corrected: RFC 9111 §4.2.3).
    pub(crate) initial_age_secs: u64,
    /// Freshness lifetime (already jittered).
    pub(crate) ttl_ms: u64,
    /// How long past `ttl` a stale copy is served at once while one request refreshes it
    /// (stale-while-revalidate).
    pub(crate) grace_ms: u64,
    /// How long past `ttl` a stale copy may still answer when the origin fails
    /// (stale-if-error).
    pub(crate) error_grace_ms: u64,
    /// How long past `ttl` the copy is kept at all (at least both graces): past them, only
    /// to be revalidated with the origin (its `ETag` / `Last-Modified` sent along), never
    /// served as it is.
    pub(crate) keep_ms: u64,
    /// How long the origin fetch took: the `delta` of probabilistic early expiration.
    pub(crate) fetch_ms: u32,
    /// The surrogate keys (`Surrogate-Key` / `Cache-Tag`) the origin tagged the answer with:
    /// invalidating one of them drops this entry.
    pub(crate) tags: Vec<String>,
    /// The request headers the answer's `Vary` names that its key does not hold, with the
    /// values (normalized; `None`: absent) of the request it was made for. It is only
    /// served to requests with the same values (RFC 9111 §4.1): see [`Entry::selects`].
    pub(crate) selecting: Vec<(HeaderName, Option<HeaderValue>)>,
    /// The full cache key (compared on read so a hash collision is a miss), the end-to-end
    /// header lines worth keeping (hop-by-hop, `Set-Cookie`, `Age` removed: the age is
    /// `initial_age_secs` and grows while the entry is stored) and the body.
    packed: Packed,
}

/// The key and header lines of an entry in one buffer, and its body:
///
/// ```text
/// head: key (UTF-8) | per line: name length (u16 BE), name, value length (u32 BE), value
///       0           key_len                                                          end
/// body: as it was read (from the origin: no copy; from Redis: a slice of the same reply)
/// ```
///
/// Every name and value was checked when the head was made ([`Packed::new`],
/// [`Packed::checked`]), so reading it back cannot fail. Hand-rolled rather than a
/// serialized `HeaderMap`: the point is that a hit reads its header values as slices of
/// one allocation, with no decoding step and nothing allocated per line. The body is kept
/// apart so that a fill never copies it (a large body buffered for slow clients would
/// briefly be held twice).
#[derive(Clone, Debug)]
struct Packed {
    head: Bytes,
    key_len: u32,
    body: Bytes,
    /// The names of the lines that are not among http's standard headers, in line order
    /// ([`is_custom`]). Making a `HeaderName` of such a name copies it: a hit clones these
    /// instead (a reference count), so it allocates nothing per line. A standard name costs
    /// nothing to make and is not kept.
    custom: Box<[HeaderName]>,
}

/// Whether `name` is not one of http's standard headers, whose `HeaderName`s are made
/// without an allocation. http has no test for it; a standard name's text is static, so a
/// second parse of it points at the same bytes, while a custom name is copied anew by each
/// parse. Only what a hit costs depends on the answer: the lines are matched by their
/// bytes ([`Packed::lines`]).
fn is_custom(name: &HeaderName) -> bool {
    HeaderName::from_bytes(name.as_str().as_bytes())
        .is_ok_and(|again| again.as_str().as_ptr() != name.as_str().as_ptr())
}

/// Why a packed head was refused.
#[derive(Debug)]
struct BadPacking;

impl Packed {
    fn new(key: &str, headers: &HeaderMap, body: Bytes) -> Packed {
        let lines: usize = headers
            .iter()
            .map(|(n, v)| 6 + n.as_str().len() + v.len())
            .sum();
        let mut head = Vec::with_capacity(key.len() + lines);
        head.extend_from_slice(key.as_bytes());
        let mut custom = Vec::new();
        for (name, value) in headers {
            // A HeaderName is at most 64 KiB; a value longer than 4 GiB cannot have come
            // through the origin's head limits. Such a line is left out, never truncated.
            let (Ok(name_len), Ok(value_len)) = (
                u16::try_from(name.as_str().len()),
                u32::try_from(value.len()),
            ) else {
                continue;
            };
            head.extend_from_slice(&name_len.to_be_bytes());
            head.extend_from_slice(name.as_str().as_bytes());
            head.extend_from_slice(&value_len.to_be_bytes());
            head.extend_from_slice(value.as_bytes());
            if is_custom(name) {
                custom.push(name.clone());
            }
        }
        Packed {
            head: Bytes::from(head),
            key_len: u32::try_from(key.len()).unwrap_or(u32::MAX),
            body,
            custom: custom.into_boxed_slice(),
        }
    }

    /// A head and body read back (from Redis): the key and every line checked.
    fn checked(head: Bytes, key_len: u32, body: Bytes) -> Result<Packed, BadPacking> {
        let key_end = key_len as usize;
        if key_end > head.len() {
            return Err(BadPacking);
        }
        std::str::from_utf8(&head[..key_end]).map_err(|_| BadPacking)?;
        let mut packed = Packed {
            head,
            key_len,
            body,
            custom: Box::default(),
        };
        let mut custom = Vec::new();
        let mut lines = packed.line_ranges();
        for (name, value) in lines.by_ref() {
            let name = HeaderName::from_bytes(&packed.head[name]).map_err(|_| BadPacking)?;
            if is_custom(&name) {
                custom.push(name);
            }
            // A slice of the buffer, not `from_bytes`, which would copy the value only to
            // check it (an L2 hit reads every entry anew).
            HeaderValue::from_maybe_shared(packed.head.slice(value)).map_err(|_| BadPacking)?;
        }
        if lines.broken {
            return Err(BadPacking);
        }
        packed.custom = custom.into_boxed_slice();
        Ok(packed)
    }

    fn key(&self) -> &str {
        std::str::from_utf8(&self.head[..self.key_len as usize]).unwrap_or_default()
    }

    fn line_ranges(&self) -> LineRanges<'_> {
        LineRanges {
            block: &self.head,
            at: self.key_len as usize,
            broken: false,
        }
    }

    fn lines(&self) -> impl Iterator<Item = (HeaderName, HeaderValue)> + '_ {
        let mut custom = self.custom.iter().peekable();
        self.line_ranges().filter_map(move |(name, value)| {
            let bytes = &self.head[name];
            let name = match custom.next_if(|custom| custom.as_str().as_bytes() == bytes) {
                Some(custom) => custom.clone(),
                None => HeaderName::from_bytes(bytes).ok()?,
            };
            let value = HeaderValue::from_maybe_shared(self.head.slice(value)).ok()?;
            Some((name, value))
        })
    }
}

/// The byte ranges of the name and value of each header line of a packed buffer.
struct LineRanges<'a> {
    block: &'a [u8],
    at: usize,
    /// A line ran past the end of the block.
    broken: bool,
}

impl Iterator for LineRanges<'_> {
    type Item = (std::ops::Range<usize>, std::ops::Range<usize>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.block.len() || self.broken {
            return None;
        }
        let field = |at: usize, width: usize| -> Option<(usize, usize)> {
            let bytes = self.block.get(at..at.checked_add(width)?)?;
            let len = bytes.iter().fold(0usize, |n, b| (n << 8) | usize::from(*b));
            let start = at + width;
            let end = start.checked_add(len)?;
            (end <= self.block.len()).then_some((start, end))
        };
        let Some((name_start, name_end)) = field(self.at, 2) else {
            self.broken = true;
            return None;
        };
        let Some((value_start, value_end)) = field(name_end, 4) else {
            self.broken = true;
            return None;
        };
        self.at = value_end;
        Some((name_start..name_end, value_start..value_end))
    }
}

/// Where an entry is in its life at a given moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Freshness {
    Fresh,
    /// Past ttl, within grace: served at once while one request refreshes it.
    Stale,
    /// Past grace, within the error grace: answers only if the origin fails.
    IfError,
    /// Past both graces, still kept: only a source of validators for a revalidation.
    Kept,
    Expired,
}

/// Why a stored value could not be decoded.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeEntryError {
    #[error("not a cacheguard entry (bad magic)")]
    Magic,
    #[error("unknown entry format version {0}")]
    Version(u8),
    #[error("entry format version {0} carries no checksum: it cannot prove it is whole")]
    Unchecked(u8),
    #[error("corrupt entry: it records {recorded} bytes, {read} were read (cut or padded)")]
    Length { recorded: u64, read: usize },
    #[error("corrupt entry: its checksum does not match")]
    Checksum,
    #[error("corrupt entry: {0}")]
    Corrupt(#[from] postcard::Error),
    #[error("corrupt entry: bad status, header or length")]
    Invalid,
}

/// What follows the fixed start of a value (see the module docs).
#[derive(Serialize, Deserialize)]
struct Meta {
    status: u16,
    stored_at_ms: u64,
    initial_age_secs: u64,
    ttl_ms: u64,
    grace_ms: u64,
    error_grace_ms: u64,
    keep_ms: u64,
    fetch_ms: u32,
    tags: Vec<String>,
    selecting: Vec<(String, Option<Bytes>)>,
    key_len: u32,
    head_len: u32,
    body_len: u64,
}

/// A stored value that proved whole ([`Checked::new`]), in one buffer: every entry decoded
/// from it ([`Entry::from_checked`]) holds slices of that buffer, so however many there are,
/// the value is in memory once. `l2.rs` keeps large values this way.
pub(crate) struct Checked(Vec<u8>);

impl std::fmt::Debug for Checked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checked")
            .field("len", &self.0.len())
            .finish()
    }
}

impl Checked {
    /// `value`, once it has proved whole: its recorded length is its length and its checksum
    /// matches.
    ///
    /// # Errors
    /// Why it is not a whole value of the current format.
    pub(crate) fn new(value: Vec<u8>) -> Result<Checked, DecodeEntryError> {
        check(&value)?;
        Ok(Checked(value))
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The owner of the buffer of entries decoded from a [`Checked`] value.
struct SharedValue(Arc<Checked>);

impl AsRef<[u8]> for SharedValue {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

/// The length a value records for itself, read from its first bytes (at least 19 of them):
/// how much there is to read of a value read in pieces.
///
/// # Errors
/// Not a value of the current format, or a length no Redis string can have.
pub(crate) fn stored_len(prefix: &[u8]) -> Result<usize, DecodeEntryError> {
    let rest = prefix.strip_prefix(MAGIC).ok_or(DecodeEntryError::Magic)?;
    match rest.first() {
        Some(&VERSION) => {}
        Some(&old @ 1..VERSION) => return Err(DecodeEntryError::Unchecked(old)),
        Some(&other) => return Err(DecodeEntryError::Version(other)),
        None => return Err(DecodeEntryError::Magic),
    }
    let field = prefix
        .get(LENGTH)
        .and_then(|field| <[u8; 8]>::try_from(field).ok())
        .ok_or(DecodeEntryError::Length {
            recorded: 0,
            read: prefix.len(),
        })?;
    let recorded = u64::from_le_bytes(field);
    match usize::try_from(recorded) {
        Ok(len) if recorded <= MAX_VALUE => Ok(len),
        _ => Err(DecodeEntryError::Length {
            recorded,
            read: prefix.len(),
        }),
    }
}

/// Whether `value` is a whole value of the current format: the length it records is its
/// length, and the checksum over everything after the checksum matches.
fn check(value: &[u8]) -> Result<(), DecodeEntryError> {
    let recorded = stored_len(value)?;
    if recorded != value.len() {
        return Err(DecodeEntryError::Length {
            recorded: recorded as u64,
            read: value.len(),
        });
    }
    let sum = value
        .get(CHECKSUM)
        .and_then(|field| <[u8; 8]>::try_from(field).ok())
        .map(u64::from_le_bytes);
    match value.get(CHECKED..) {
        Some(covered) if sum == Some(xxh3_64(covered)) => Ok(()),
        _ => Err(DecodeEntryError::Checksum),
    }
}

impl Entry {
    /// An entry for `key` holding `status`, `headers` (copied into one buffer) and `body`,
    /// stored at time 0 with no lifetime, tags or selecting headers: the caller sets them.
    pub(crate) fn new(key: &str, status: StatusCode, headers: &HeaderMap, body: Bytes) -> Entry {
        Entry {
            status,
            stored_at_ms: 0,
            initial_age_secs: 0,
            ttl_ms: 0,
            grace_ms: 0,
            error_grace_ms: 0,
            keep_ms: 0,
            fetch_ms: 0,
            tags: Vec::new(),
            selecting: Vec::new(),
            packed: Packed::new(key, headers, body),
        }
    }

    /// The full cache key.
    pub(crate) fn key(&self) -> &str {
        self.packed.key()
    }

    /// The body (shared, not copied).
    pub(crate) fn body(&self) -> Bytes {
        self.packed.body.clone()
    }

    pub(crate) fn body_len(&self) -> usize {
        self.packed.body.len()
    }

    /// The stored header lines, in order; each value is a slice of the entry's buffer.
    pub(crate) fn header_lines(&self) -> impl Iterator<Item = (HeaderName, HeaderValue)> + '_ {
        self.packed.lines()
    }

    /// How many header lines are stored.
    pub(crate) fn header_count(&self) -> usize {
        self.packed.line_ranges().count()
    }

    /// The stored header lines as a map (for the rare paths that edit them).
    pub(crate) fn headers(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.header_count());
        for (name, value) in self.header_lines() {
            map.append(name, value);
        }
        map
    }

    /// Whether a header line named `name` is stored.
    pub(crate) fn has_header(&self, name: &HeaderName) -> bool {
        self.header(name).is_some()
    }

    /// The value of the first header line named `name`.
    pub(crate) fn header(&self, name: &HeaderName) -> Option<HeaderValue> {
        let (_, value) = self
            .packed
            .line_ranges()
            .find(|(n, _)| self.packed.head[n.clone()] == *name.as_str().as_bytes())?;
        HeaderValue::from_maybe_shared(self.packed.head.slice(value)).ok()
    }

    /// The entry with its body replaced by `hold(body)`, which must hold the same bytes
    /// (e.g. the same buffer tied to something that lives as long as it).
    pub(crate) fn map_body(mut self, hold: impl FnOnce(Bytes) -> Bytes) -> Entry {
        let len = self.packed.body.len();
        let held = hold(std::mem::take(&mut self.packed.body));
        debug_assert_eq!(held.len(), len);
        self.packed.body = held;
        self
    }

    /// Is this a negative entry (a cached "does not exist")?
    pub(crate) fn is_negative(&self) -> bool {
        matches!(self.status.as_u16(), 404 | 410)
    }

    pub(crate) fn matches(&self, key: &CacheKey) -> bool {
        self.key() == key.full
    }

    /// Whether this answer may be served to a request with `headers`: every header its
    /// `Vary` selected it by has the same (normalized) value, or is absent from both.
    pub(crate) fn selects(&self, headers: &HeaderMap) -> bool {
        self.selecting
            .iter()
            .all(|(name, value)| selecting_value(headers, name) == *value)
    }

    pub(crate) fn freshness(&self, now_ms: u64) -> Freshness {
        let fresh_until = self.stored_at_ms.saturating_add(self.ttl_ms);
        if now_ms < fresh_until {
            Freshness::Fresh
        } else if now_ms < fresh_until.saturating_add(self.grace_ms) {
            Freshness::Stale
        } else if now_ms < fresh_until.saturating_add(self.error_grace_ms) {
            Freshness::IfError
        } else if now_ms < fresh_until.saturating_add(self.keep_ms) {
            Freshness::Kept
        } else {
            Freshness::Expired
        }
    }

    /// The `Age` header (RFC 9111 §4.2.3): the age the answer arrived with plus the whole
    /// seconds it has been stored.
    pub(crate) fn age_secs(&self, now_ms: u64) -> u64 {
        let resident = now_ms.saturating_sub(self.stored_at_ms) / 1000;
        self.initial_age_secs.saturating_add(resident)
    }

    /// Milliseconds until the entry leaves its grace period (its physical lifetime).
    /// Probabilistic early expiration (XFetch; Vattani, Chierichetti, Lowenstein, VLDB 2015):
    /// refresh now if `now - delta * beta * ln(u) >= expiry`, with `u` uniform in (0, 1].
    /// The closer the expiry and the slower the fetch, the likelier one request refreshes
    /// before the entry expires, so a hot key never goes through a miss.
    pub(crate) fn should_refresh_early(&self, now_ms: u64, beta: f64, u: f64) -> bool {
        if beta <= 0.0 || u <= 0.0 {
            return false;
        }
        let expiry = self.stored_at_ms.saturating_add(self.ttl_ms) as f64;
        let gap = f64::from(self.fetch_ms.max(1)) * beta * -u.ln();
        now_ms as f64 + gap >= expiry
    }

    pub(crate) fn remaining_life_ms(&self, now_ms: u64) -> u64 {
        let kept = self.keep_ms.max(self.grace_ms).max(self.error_grace_ms);
        (self.stored_at_ms + self.ttl_ms + kept).saturating_sub(now_ms)
    }

    /// Approximate memory held by this entry while it sits in L1, for L1's byte bound.
    ///
    /// Counts the buffer (key, header lines, body), the names of its custom header lines, the
    /// tags and selecting headers, and a
    /// fixed per-entry overhead: the `Entry` and its `Arc` (224 bytes with the allocator's
    /// header), allocator rounding, the body's shared-buffer record, and the cache's own
    /// bookkeeping (a slab slot and a hash-table index). The fixed part was sized from RSS
    /// measured under a million distinct keys (see BENCHMARKS.md, memory: 1,576 bytes per
    /// entry of a 1 KiB body and about 140 bytes of key and header lines, so about 410 of
    /// overhead), with a margin; an under-count lets RSS outgrow `l1_max_bytes`, which is a
    /// weight, not a memory bound.
    pub(crate) fn weight(&self) -> usize {
        const PER_ENTRY: usize = 448;
        let tags: usize = self.tags.iter().map(|t| t.len() + 24).sum();
        let selecting: usize = self
            .selecting
            .iter()
            .map(|(n, v)| n.as_str().len() + v.as_ref().map_or(0, HeaderValue::len) + 96)
            .sum();
        let custom: usize = self
            .packed
            .custom
            .iter()
            .map(|n| n.as_str().len() + 64)
            .sum();
        self.packed.head.len() + self.packed.body.len() + tags + selecting + custom + PER_ENTRY
    }

    /// The value stored in Redis (see the module docs).
    ///
    /// # Errors
    /// When postcard cannot encode the meta; it always can (plain numbers, strings and
    /// bytes into a `Vec`).
    pub(crate) fn encode(&self) -> Result<Vec<u8>, postcard::Error> {
        let meta = Meta {
            status: self.status.as_u16(),
            stored_at_ms: self.stored_at_ms,
            initial_age_secs: self.initial_age_secs,
            ttl_ms: self.ttl_ms,
            grace_ms: self.grace_ms,
            error_grace_ms: self.error_grace_ms,
            keep_ms: self.keep_ms,
            fetch_ms: self.fetch_ms,
            tags: self.tags.clone(),
            selecting: self
                .selecting
                .iter()
                .map(|(n, v)| {
                    let value = v.as_ref().map(|v| Bytes::copy_from_slice(v.as_bytes()));
                    (n.as_str().to_owned(), value)
                })
                .collect(),
            key_len: self.packed.key_len,
            head_len: u32::try_from(self.packed.head.len()).unwrap_or(u32::MAX),
            body_len: self.packed.body.len() as u64,
        };
        let mut out =
            Vec::with_capacity(FIXED + 64 + self.packed.head.len() + self.packed.body.len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.resize(FIXED, 0);
        let mut out = postcard::to_extend(&meta, out)?;
        out.extend_from_slice(&self.packed.head);
        out.extend_from_slice(&self.packed.body);
        let len = out.len() as u64;
        out[LENGTH].copy_from_slice(&len.to_le_bytes());
        let sum = xxh3_64(&out[CHECKED..]);
        out[CHECKSUM].copy_from_slice(&sum.to_le_bytes());
        Ok(out)
    }

    /// The entry a stored value holds, once the value has proved whole (see the module
    /// docs). The entry's buffers are slices of `bytes`: no copy.
    ///
    /// # Errors
    /// Why the value is not a whole entry of the current format.
    pub(crate) fn decode(bytes: Bytes) -> Result<Entry, DecodeEntryError> {
        check(&bytes)?;
        Self::parse(bytes)
    }

    /// The entry a checked value holds, its buffers slices of the value's (no copy, and no
    /// second pass over it: it proved whole when it was checked).
    ///
    /// # Errors
    /// A checksum guards against damage, not against a writer of wrong values: the meta and
    /// every header line are still checked.
    pub(crate) fn from_checked(value: &Arc<Checked>) -> Result<Entry, DecodeEntryError> {
        Self::parse(Bytes::from_owner(SharedValue(Arc::clone(value))))
    }

    /// The entry in a value whose length and checksum were checked: its meta, and its head and
    /// body lengths adding up to the rest.
    fn parse(bytes: Bytes) -> Result<Entry, DecodeEntryError> {
        let payload = bytes.get(FIXED..).ok_or(DecodeEntryError::Invalid)?;
        let (meta, packed) = postcard::take_from_bytes::<Meta>(payload)?;
        let head_len = meta.head_len as usize;
        let body_len = usize::try_from(meta.body_len).map_err(|_| DecodeEntryError::Invalid)?;
        if head_len.checked_add(body_len) != Some(packed.len()) {
            return Err(DecodeEntryError::Invalid);
        }
        let (head, body) = packed.split_at(head_len);
        let packed = Packed::checked(bytes.slice_ref(head), meta.key_len, bytes.slice_ref(body))
            .map_err(|_| DecodeEntryError::Invalid)?;
        Ok(Entry {
            status: StatusCode::from_u16(meta.status).map_err(|_| DecodeEntryError::Invalid)?,
            stored_at_ms: meta.stored_at_ms,
            initial_age_secs: meta.initial_age_secs,
            ttl_ms: meta.ttl_ms,
            grace_ms: meta.grace_ms,
            error_grace_ms: meta.error_grace_ms,
            keep_ms: meta.keep_ms,
            fetch_ms: meta.fetch_ms,
            tags: meta.tags,
            selecting: selecting_from(meta.selecting)?,
            packed,
        })
    }
}

/// The selecting headers of a stored value, checked.
fn selecting_from(
    raw: Vec<(String, Option<Bytes>)>,
) -> Result<Vec<(HeaderName, Option<HeaderValue>)>, DecodeEntryError> {
    let mut selecting = Vec::with_capacity(raw.len());
    for (name, value) in raw {
        let name =
            HeaderName::from_bytes(name.as_bytes()).map_err(|_| DecodeEntryError::Invalid)?;
        let value = value
            .map(HeaderValue::from_maybe_shared)
            .transpose()
            .map_err(|_| DecodeEntryError::Invalid)?;
        selecting.push((name, value));
    }
    Ok(selecting)
}

/// The value of `name` in `headers` as a `Vary` selection compares it: every field line,
/// each comma-separated member trimmed, joined with `,` (so `a, b`, `a,b` and two lines `a`
/// and `b` are one value). `None` when absent.
pub(crate) fn selecting_value(headers: &HeaderMap, name: &HeaderName) -> Option<HeaderValue> {
    let mut lines = headers.get_all(name).iter().peekable();
    lines.peek()?;
    let mut joined = Vec::new();
    for line in lines {
        for member in line.as_bytes().split(|b| *b == b',') {
            let member = member.trim_ascii();
            if member.is_empty() {
                continue;
            }
            if !joined.is_empty() {
                joined.push(b',');
            }
            joined.extend_from_slice(member);
        }
    }
    HeaderValue::from_bytes(&joined).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Entry {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        let mut e = Entry::new(
            "item\n/api/items/1\n",
            StatusCode::OK,
            &headers,
            Bytes::from_static(b"{\"id\":1}"),
        );
        e.stored_at_ms = 1_000;
        e.initial_age_secs = 7;
        e.ttl_ms = 60_000;
        e.grace_ms = 30_000;
        e.error_grace_ms = 50_000;
        e.keep_ms = 70_000;
        e.fetch_ms = 20;
        e.tags = vec!["item-1".into(), "items".into()];
        e.selecting = vec![
            (
                HeaderName::from_static("accept-language"),
                Some(HeaderValue::from_static("fr,en")),
            ),
            (HeaderName::from_static("x-absent"), None),
        ];
        e
    }

    #[test]
    fn served_only_to_the_values_it_was_selected_by() {
        let e = sample();
        let request = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (n, v) in pairs {
                h.append(*n, HeaderValue::from_static(v));
            }
            h
        };
        assert!(e.selects(&request(&[("accept-language", "fr, en")])));
        assert!(e.selects(&request(&[
            ("accept-language", "fr"),
            ("accept-language", "en")
        ])));
        assert!(!e.selects(&request(&[("accept-language", "en, fr")])));
        assert!(!e.selects(&request(&[])));
        assert!(!e.selects(&request(&[("accept-language", "fr,en"), ("x-absent", "1")])));
    }

    /// Lines of standard and custom names, interleaved and repeated, come back in order
    /// with their values, from a fresh entry and from a decoded one alike.
    #[test]
    fn custom_and_standard_names_come_back_in_line_order() {
        let mut headers = HeaderMap::new();
        headers.append("x-a", HeaderValue::from_static("1"));
        headers.append(http::header::CONTENT_TYPE, HeaderValue::from_static("t"));
        headers.append("x-b", HeaderValue::from_static("2"));
        headers.append("x-a", HeaderValue::from_static("3"));
        headers.append(http::header::ETAG, HeaderValue::from_static("\"e\""));
        let e = Entry::new("k", StatusCode::OK, &headers, Bytes::new());
        let lines = |e: &Entry| -> Vec<(String, String)> {
            e.header_lines()
                .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
                .collect()
        };
        let want: Vec<(String, String)> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
            .collect();
        assert_eq!(lines(&e), want);
        assert_eq!(
            e.packed.custom.len(),
            3,
            "x-a, x-b, x-a: the standard names are not kept"
        );
        let d = Entry::decode(Bytes::from(e.encode().unwrap())).unwrap();
        assert_eq!(lines(&d), want);
        assert!(is_custom(&HeaderName::from_static("x-request-id")));
        assert!(!is_custom(&http::header::CONTENT_TYPE));
    }

    #[test]
    fn round_trip() {
        let e = sample();
        let d = Entry::decode(Bytes::from(e.encode().unwrap())).unwrap();
        assert_eq!(d.key(), e.key());
        assert_eq!(d.status, e.status);
        assert_eq!(d.headers(), e.headers());
        assert_eq!(d.body(), e.body());
        assert_eq!(d.header_count(), 3);
        assert!(d.has_header(&HeaderName::from_static("x-multi")));
        assert!(!d.has_header(&HeaderName::from_static("x-other")));
        assert_eq!(d.tags, e.tags);
        assert_eq!(d.initial_age_secs, 7);
        assert_eq!(d.error_grace_ms, 50_000);
        assert_eq!(d.keep_ms, 70_000);
        assert_eq!(d.selecting, e.selecting);
        assert_eq!(
            (d.stored_at_ms, d.ttl_ms, d.grace_ms),
            (1_000, 60_000, 30_000)
        );
    }

    /// Where the meta, the head and the body of an encoded value start.
    fn regions(value: &[u8]) -> [(&'static str, std::ops::Range<usize>); 6] {
        let payload = &value[FIXED..];
        let (meta, rest) = postcard::take_from_bytes::<Meta>(payload).unwrap();
        let head_at = value.len() - rest.len();
        let body_at = head_at + meta.head_len as usize;
        [
            ("magic and version", 0..3),
            ("checksum", CHECKSUM),
            ("length", LENGTH),
            ("meta", FIXED..head_at),
            ("head", head_at..body_at),
            ("body", body_at..value.len()),
        ]
    }

    fn region_of(value: &[u8], at: usize) -> &'static str {
        regions(value)
            .into_iter()
            .find(|(_, range)| range.contains(&at))
            .map_or("past the end", |(name, _)| name)
    }

    #[test]
    fn a_value_cut_anywhere_is_refused() {
        let value = sample().encode().unwrap();
        for (name, range) in regions(&value) {
            assert!(!range.is_empty(), "the sample has no {name}");
        }
        for cut in 0..value.len() {
            let decoded = Entry::decode(Bytes::copy_from_slice(&value[..cut]));
            let region = region_of(&value, cut);
            match decoded {
                Err(DecodeEntryError::Magic) if cut < 3 => {}
                Err(DecodeEntryError::Length { recorded: 0, read }) if cut < FIXED => {
                    assert_eq!(read, cut, "cut in the {region}");
                }
                Err(DecodeEntryError::Length { recorded, read }) => {
                    assert_eq!(
                        (recorded, read),
                        (value.len() as u64, cut),
                        "cut in the {region}"
                    );
                }
                other => panic!("cut at {cut} (in the {region}): {other:?}"),
            }
        }
    }

    #[test]
    fn a_padded_value_is_refused() {
        let value = sample().encode().unwrap();
        let padded = [&[0u8][..], b"\r\n", &[0xff; 8], &value];
        for pad in padded {
            let mut long = value.clone();
            long.extend_from_slice(pad);
            assert!(
                matches!(
                    Entry::decode(Bytes::from(long)),
                    Err(DecodeEntryError::Length { .. })
                ),
                "padded with {} bytes",
                pad.len()
            );
        }
    }

    #[test]
    fn a_byte_changed_anywhere_is_refused() {
        let value = sample().encode().unwrap();
        for at in 0..value.len() {
            for flip in [0x01, 0x80, 0xff] {
                let mut changed = value.clone();
                changed[at] ^= flip;
                let region = region_of(&value, at);
                match Entry::decode(Bytes::from(changed)) {
                    Err(DecodeEntryError::Length { .. }) if LENGTH.contains(&at) => {}
                    Err(DecodeEntryError::Checksum) if at >= 3 && !LENGTH.contains(&at) => {}
                    Err(
                        DecodeEntryError::Magic
                        | DecodeEntryError::Version(_)
                        | DecodeEntryError::Unchecked(_),
                    ) if at < 3 => {}
                    other => panic!("byte {at} (in the {region}) ^ {flip:#x}: {other:?}"),
                }
            }
        }
    }

    /// Each check stands on its own: a value cut and given back a matching length still
    /// fails the checksum; one whose checksum is made to match again still fails when its
    /// meta's lengths do not add up to what is there.
    #[test]
    fn lengths_and_checksum_are_each_checked() {
        let value = sample().encode().unwrap();
        let reseal = |mut v: Vec<u8>, checksum: bool| {
            let len = v.len() as u64;
            v[LENGTH].copy_from_slice(&len.to_le_bytes());
            if checksum {
                let sum = xxh3_64(&v[CHECKED..]);
                v[CHECKSUM].copy_from_slice(&sum.to_le_bytes());
            }
            Bytes::from(v)
        };
        let cut = value[..value.len() - 3].to_vec();
        assert!(matches!(
            Entry::decode(reseal(cut.clone(), false)),
            Err(DecodeEntryError::Checksum)
        ));
        assert!(matches!(
            Entry::decode(reseal(cut, true)),
            Err(DecodeEntryError::Invalid)
        ));
        let mut padded = value.clone();
        padded.push(b'x');
        assert!(matches!(
            Entry::decode(reseal(padded, true)),
            Err(DecodeEntryError::Invalid)
        ));
        assert!(Entry::decode(reseal(value, true)).is_ok());
    }

    /// A large value cut to exactly the first read's window (256 KiB) reads as a whole value
    /// of that size to the reader: only its recorded length tells it is not.
    #[test]
    fn a_large_value_cut_at_the_read_window_is_refused() {
        let mut e = sample();
        e.packed.body = Bytes::from(vec![b'x'; 300 * 1024]);
        let value = e.encode().unwrap();
        let window = 256 * 1024;
        assert_eq!(stored_len(&value[..window + 1]).unwrap(), value.len());
        assert!(matches!(
            Entry::decode(Bytes::copy_from_slice(&value[..window])),
            Err(DecodeEntryError::Length { .. })
        ));
        assert!(matches!(
            Checked::new(value[..window].to_vec()),
            Err(DecodeEntryError::Length { .. })
        ));
        assert_eq!(
            Entry::decode(Bytes::from(value)).unwrap().body_len(),
            300 * 1024
        );
    }

    #[test]
    fn values_of_earlier_versions_are_refused_as_unchecked() {
        let value = sample().encode().unwrap();
        for version in 1..VERSION {
            let mut old = value.clone();
            old[2] = version;
            assert!(
                matches!(
                    Entry::decode(Bytes::from(old)),
                    Err(DecodeEntryError::Unchecked(v)) if v == version
                ),
                "version {version}"
            );
        }
    }

    #[test]
    fn a_recorded_length_no_redis_string_can_have_is_refused_before_any_allocation() {
        let mut value = sample().encode().unwrap();
        value[LENGTH].copy_from_slice(&(MAX_VALUE + 1).to_le_bytes());
        assert!(matches!(
            stored_len(&value),
            Err(DecodeEntryError::Length { .. })
        ));
        assert!(matches!(
            stored_len(&value[..FIXED - 1]),
            Err(DecodeEntryError::Length { .. })
        ));
    }

    #[test]
    fn entries_from_a_checked_value_share_its_buffer_and_let_it_go() {
        let value = Arc::new(Checked::new(sample().encode().unwrap()).unwrap());
        let within = value.as_bytes().as_ptr_range();
        let a = Entry::from_checked(&value).unwrap();
        let b = Entry::from_checked(&value).unwrap();
        for e in [&a, &b] {
            assert!(
                within.contains(&e.body().as_ptr()),
                "the body is the buffer's"
            );
            assert_eq!(e.key(), sample().key());
        }
        let live = Arc::downgrade(&value);
        drop(value);
        let body = a.body();
        drop((a, b));
        assert!(
            live.upgrade().is_some(),
            "a body still held keeps the buffer"
        );
        drop(body);
        assert!(live.upgrade().is_none(), "nothing holds it any more");
    }

    #[test]
    fn a_decoded_entry_shares_the_value_it_was_read_from() {
        let value = Bytes::from(sample().encode().unwrap());
        let d = Entry::decode(value.clone()).unwrap();
        let body = d.body();
        let within = value.as_ptr_range();
        assert!(
            within.contains(&body.as_ptr()),
            "the body is a slice of the value"
        );
        for (_, v) in d.header_lines() {
            assert!(
                within.contains(&v.as_bytes().as_ptr()),
                "so is each header value"
            );
        }
    }

    #[test]
    fn a_packed_head_that_lies_is_refused() {
        let body = Bytes::from_static(b"body");
        // the key longer than the head; a header block of one byte
        assert!(Packed::checked(Bytes::from_static(b"k"), 2, body.clone()).is_err());
        assert!(Packed::checked(Bytes::from_static(b"k"), 0, body.clone()).is_err());
        let mut bad_name = b"k".to_vec();
        bad_name.extend_from_slice(&[0, 2, b'a', b' ', 0, 0, 0, 0]);
        assert!(Packed::checked(Bytes::from(bad_name), 1, body.clone()).is_err());
        let mut bad_value = b"k".to_vec();
        bad_value.extend_from_slice(&[0, 1, b'a', 0, 0, 0, 1, b'\n']);
        assert!(Packed::checked(Bytes::from(bad_value), 1, body.clone()).is_err());
        let mut cut = b"k".to_vec();
        cut.extend_from_slice(&[0, 1, b'a', 0, 0, 0, 9, b'x']);
        assert!(Packed::checked(Bytes::from(cut), 1, body.clone()).is_err());
        let good = Packed::new("k", &HeaderMap::new(), body.clone());
        assert!(Packed::checked(good.head, 1, body).is_ok());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let decode = |b: &[u8]| Entry::decode(Bytes::copy_from_slice(b));
        assert!(matches!(decode(b""), Err(DecodeEntryError::Magic)));
        assert!(matches!(decode(b"hello"), Err(DecodeEntryError::Magic)));
        assert!(matches!(
            decode(b"CG\x09xx"),
            Err(DecodeEntryError::Version(9))
        ));
        // What the checksum cannot stop, a writer of wrong values with a right checksum:
        // every prefix and a sweep of byte changes, each sealed again with its length and
        // checksum, must decode to Ok or Err, never panic; what decodes can be served (its
        // lines read back) without a panic either.
        let seal = |mut v: Vec<u8>| {
            if v.len() >= FIXED {
                let len = v.len() as u64;
                v[LENGTH].copy_from_slice(&len.to_le_bytes());
                let sum = xxh3_64(&v[CHECKED..]);
                v[CHECKSUM].copy_from_slice(&sum.to_le_bytes());
            }
            v
        };
        let full = sample().encode().unwrap();
        for i in 0..full.len() {
            let _ = decode(&seal(full[..i].to_vec()));
            let mut changed = full.clone();
            changed[i] ^= 0xff;
            if let Ok(e) = decode(&seal(changed)) {
                let _ = (e.headers(), e.body(), e.key());
            }
        }
    }

    #[test]
    fn early_refresh_gets_likelier_towards_expiry() {
        let e = sample(); // fresh until 61_000, fetch 20 ms
        let share = |now: u64| {
            (1..=1000)
                .filter(|i| e.should_refresh_early(now, 1.0, f64::from(*i) / 1000.0))
                .count()
        };
        assert_eq!(share(1_000), 0);
        assert!(share(60_990) > share(60_950));
        assert_eq!(share(61_000), 1000);
        assert!(!e.should_refresh_early(60_999, 0.0, 0.5));
    }

    #[test]
    fn freshness_windows() {
        let e = sample();
        assert_eq!(e.freshness(1_000), Freshness::Fresh);
        assert_eq!(e.freshness(60_999), Freshness::Fresh);
        assert_eq!(e.freshness(61_000), Freshness::Stale);
        assert_eq!(e.freshness(91_000), Freshness::IfError);
        assert_eq!(e.freshness(111_000), Freshness::Kept);
        assert_eq!(e.freshness(131_000), Freshness::Expired);
        assert_eq!(
            e.remaining_life_ms(61_000),
            70_000,
            "kept for the longest window"
        );
        assert_eq!(e.age_secs(11_500), 17, "arrived 7 s old, stored 10 s");
    }
}
