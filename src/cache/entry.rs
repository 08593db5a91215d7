//! The stored entry: one origin answer plus what is needed to serve and age it.
//!
//! Wire format (L2): `b"CG"`, a format version byte, then the postcard encoding of
//! [`StoredV6`] (version 2 added the surrogate keys, version 3 the age the answer arrived
//! with, version 4 the stale-if-error window, version 5 how long the copy is kept to be
//! revalidated, version 6 the request headers its `Vary` selected it by; older values still
//! decode, with none). Decoding anything else (garbage, another program's value, a future version) is
//! an error the caller treats as a miss, never a crash.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use super::CacheKey;

const MAGIC: &[u8; 2] = b"CG";
const VERSION_1: u8 = 1;
const VERSION_2: u8 = 2;
const VERSION_3: u8 = 3;
const VERSION_4: u8 = 4;
const VERSION_5: u8 = 5;
const VERSION_6: u8 = 6;

/// A cached answer, ready to serve (headers already parsed).
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    /// The full cache key; compared on read so a hash collision is a miss.
    pub(crate) key: String,
    pub(crate) status: StatusCode,
    /// End-to-end headers worth keeping (hop-by-hop, `Set-Cookie`, `Age` removed: the age
    /// is `initial_age_secs` and grows while the entry is stored).
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
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
    #[error("corrupt entry: {0}")]
    Corrupt(#[from] postcard::Error),
    #[error("corrupt entry: bad status or header")]
    Invalid,
}

#[derive(Serialize, Deserialize)]
struct StoredV1 {
    key: String,
    status: u16,
    headers: Vec<(String, Bytes)>,
    body: Bytes,
    stored_at_ms: u64,
    ttl_ms: u64,
    grace_ms: u64,
    fetch_ms: u32,
}

#[derive(Serialize, Deserialize)]
struct StoredV2 {
    v1: StoredV1,
    tags: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct StoredV3 {
    v2: StoredV2,
    initial_age_secs: u64,
}

#[derive(Serialize, Deserialize)]
struct StoredV4 {
    v3: StoredV3,
    error_grace_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct StoredV5 {
    v4: StoredV4,
    keep_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct StoredV6 {
    v5: StoredV5,
    selecting: Vec<(String, Option<Bytes>)>,
}

impl Entry {
    /// Is this a negative entry (a cached "does not exist")?
    pub(crate) fn is_negative(&self) -> bool {
        matches!(self.status.as_u16(), 404 | 410)
    }

    pub(crate) fn matches(&self, key: &CacheKey) -> bool {
        self.key == key.full
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
    /// Counts the body and key, each header (name, value, and the `Bytes` and map slot
    /// around it), and a fixed per-entry overhead: the `Entry` and its `Arc`, the header
    /// map's index table, and moka's own bookkeeping (hash-table slot, access and expiry
    /// order nodes, timer-wheel node), plus allocator rounding. The fixed part was sized
    /// from RSS measured under a million distinct keys (see BENCHMARKS.md, memory); an
    /// under-count lets RSS outgrow `l1_max_bytes`, which is a weight, not a memory bound.
    pub(crate) fn weight(&self) -> usize {
        const PER_HEADER: usize = 96;
        const PER_ENTRY: usize = 1024;
        let headers: usize = self
            .headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len() + PER_HEADER)
            .sum();
        let tags: usize = self.tags.iter().map(|t| t.len() + 24).sum();
        self.key.len() + self.body.len() + headers + tags + PER_ENTRY
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>, postcard::Error> {
        let v1 = StoredV1 {
            key: self.key.clone(),
            status: self.status.as_u16(),
            headers: self
                .headers
                .iter()
                .map(|(n, v)| (n.as_str().to_owned(), Bytes::copy_from_slice(v.as_bytes())))
                .collect(),
            body: self.body.clone(),
            stored_at_ms: self.stored_at_ms,
            ttl_ms: self.ttl_ms,
            grace_ms: self.grace_ms,
            fetch_ms: self.fetch_ms,
        };
        let stored = StoredV6 {
            v5: StoredV5 {
                v4: StoredV4 {
                    v3: StoredV3 {
                        v2: StoredV2 {
                            v1,
                            tags: self.tags.clone(),
                        },
                        initial_age_secs: self.initial_age_secs,
                    },
                    error_grace_ms: self.error_grace_ms,
                },
                keep_ms: self.keep_ms,
            },
            selecting: self
                .selecting
                .iter()
                .map(|(n, v)| {
                    let value = v.as_ref().map(|v| Bytes::copy_from_slice(v.as_bytes()));
                    (n.as_str().to_owned(), value)
                })
                .collect(),
        };
        let mut out = Vec::with_capacity(self.body.len() + self.key.len() + 256);
        out.extend_from_slice(MAGIC);
        out.push(VERSION_6);
        postcard::to_extend(&stored, out)
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Entry, DecodeEntryError> {
        let Some(rest) = bytes.strip_prefix(MAGIC) else {
            return Err(DecodeEntryError::Magic);
        };
        let (&version, payload) = rest.split_first().ok_or(DecodeEntryError::Magic)?;
        // Before version 4 the one grace window served both purposes; before version 5 a
        // copy was kept for as long as a grace lasted.
        let mut selecting_raw = Vec::new();
        let (stored, tags, initial_age_secs, error_grace_ms, keep_ms) = match version {
            VERSION_1 => {
                let v1: StoredV1 = postcard::from_bytes(payload)?;
                let grace = v1.grace_ms;
                (v1, Vec::new(), 0, grace, grace)
            }
            VERSION_2 => {
                let v2: StoredV2 = postcard::from_bytes(payload)?;
                let grace = v2.v1.grace_ms;
                (v2.v1, v2.tags, 0, grace, grace)
            }
            VERSION_3 => {
                let v3: StoredV3 = postcard::from_bytes(payload)?;
                let grace = v3.v2.v1.grace_ms;
                (v3.v2.v1, v3.v2.tags, v3.initial_age_secs, grace, grace)
            }
            VERSION_4 => {
                let v4: StoredV4 = postcard::from_bytes(payload)?;
                let (v3, error) = (v4.v3, v4.error_grace_ms);
                let keep = error.max(v3.v2.v1.grace_ms);
                (v3.v2.v1, v3.v2.tags, v3.initial_age_secs, error, keep)
            }
            VERSION_5 => {
                let v5: StoredV5 = postcard::from_bytes(payload)?;
                let (v3, error) = (v5.v4.v3, v5.v4.error_grace_ms);
                (v3.v2.v1, v3.v2.tags, v3.initial_age_secs, error, v5.keep_ms)
            }
            VERSION_6 => {
                let v6: StoredV6 = postcard::from_bytes(payload)?;
                selecting_raw = v6.selecting;
                let v5 = v6.v5;
                let (v3, error) = (v5.v4.v3, v5.v4.error_grace_ms);
                (v3.v2.v1, v3.v2.tags, v3.initial_age_secs, error, v5.keep_ms)
            }
            other => return Err(DecodeEntryError::Version(other)),
        };
        let status = StatusCode::from_u16(stored.status).map_err(|_| DecodeEntryError::Invalid)?;
        let mut headers = HeaderMap::with_capacity(stored.headers.len());
        for (name, value) in stored.headers {
            let name =
                HeaderName::from_bytes(name.as_bytes()).map_err(|_| DecodeEntryError::Invalid)?;
            let value =
                HeaderValue::from_maybe_shared(value).map_err(|_| DecodeEntryError::Invalid)?;
            headers.append(name, value);
        }
        let mut selecting = Vec::with_capacity(selecting_raw.len());
        for (name, value) in selecting_raw {
            let name =
                HeaderName::from_bytes(name.as_bytes()).map_err(|_| DecodeEntryError::Invalid)?;
            let value = value
                .map(HeaderValue::from_maybe_shared)
                .transpose()
                .map_err(|_| DecodeEntryError::Invalid)?;
            selecting.push((name, value));
        }
        Ok(Entry {
            key: stored.key,
            status,
            headers,
            body: stored.body,
            stored_at_ms: stored.stored_at_ms,
            initial_age_secs,
            ttl_ms: stored.ttl_ms,
            grace_ms: stored.grace_ms,
            error_grace_ms,
            keep_ms,
            fetch_ms: stored.fetch_ms,
            tags,
            selecting,
        })
    }
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
        Entry {
            key: "item\n/api/items/1\n".into(),
            status: StatusCode::OK,
            headers,
            body: Bytes::from_static(b"{\"id\":1}"),
            stored_at_ms: 1_000,
            initial_age_secs: 7,
            ttl_ms: 60_000,
            grace_ms: 30_000,
            error_grace_ms: 50_000,
            keep_ms: 70_000,
            fetch_ms: 20,
            tags: vec!["item-1".into(), "items".into()],
            selecting: vec![
                (
                    HeaderName::from_static("accept-language"),
                    Some(HeaderValue::from_static("fr,en")),
                ),
                (HeaderName::from_static("x-absent"), None),
            ],
        }
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

    #[test]
    fn round_trip() {
        let e = sample();
        let d = Entry::decode(&e.encode().unwrap()).unwrap();
        assert_eq!(d.key, e.key);
        assert_eq!(d.status, e.status);
        assert_eq!(d.headers, e.headers);
        assert_eq!(d.body, e.body);
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

    #[test]
    fn version_1_values_still_decode() {
        let e = sample();
        let v1 = StoredV1 {
            key: e.key.clone(),
            status: 200,
            headers: vec![],
            body: e.body.clone(),
            stored_at_ms: 1,
            ttl_ms: 2,
            grace_ms: 3,
            fetch_ms: 4,
        };
        let mut bytes = MAGIC.to_vec();
        bytes.push(VERSION_1);
        let bytes = postcard::to_extend(&v1, bytes).unwrap();
        let d = Entry::decode(&bytes).unwrap();
        assert_eq!((d.key, d.ttl_ms, d.tags.len()), (e.key, 2, 0));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(matches!(Entry::decode(b""), Err(DecodeEntryError::Magic)));
        assert!(matches!(
            Entry::decode(b"hello"),
            Err(DecodeEntryError::Magic)
        ));
        assert!(matches!(
            Entry::decode(b"CG\x09xx"),
            Err(DecodeEntryError::Version(9))
        ));
        let mut bytes = sample().encode().unwrap();
        bytes.truncate(bytes.len() / 2);
        assert!(Entry::decode(&bytes).is_err());
        // Every prefix and a sweep of byte flips must decode to Ok or Err, never panic.
        let full = sample().encode().unwrap();
        for i in 0..full.len() {
            let _ = Entry::decode(&full[..i]);
            let mut flipped = full.clone();
            flipped[i] ^= 0xff;
            let _ = Entry::decode(&flipped);
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
