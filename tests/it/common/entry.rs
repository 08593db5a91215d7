//! The L2 entry format (`src/cache/entry.rs`, version 8), read back by the tests that look
//! at what cacheguard stored in Redis: a value is taken only whole (its recorded length
//! and checksum agree with it), as cacheguard takes it.
//!
//! ```text
//! b"CG", 8, xxh3-64 of bytes 11.. (u64 LE), the value's length (u64 LE),
//! postcard of `Meta`, the head (key, then header lines), the body
//! ```

use serde::Deserialize;

/// What precedes the head, as `src/cache/entry.rs` writes it. postcard is positional: only
/// the field order and types must match.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
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
    selecting: Vec<(String, Option<bytes::Bytes>)>,
    key_len: u32,
    head_len: u32,
    body_len: u64,
}

/// Magic, version, checksum and length.
const FIXED: usize = 19;

/// What the tests read of a stored entry, and where its parts are in the value.
#[derive(Debug)]
pub struct StoredEntry {
    pub key: String,
    pub status: u16,
    pub stored_at_ms: u64,
    pub ttl_ms: u64,
    pub grace_ms: u64,
    pub body: Vec<u8>,
    /// Where the meta, the head and the body start in the value.
    pub meta_at: usize,
    pub head_at: usize,
    pub body_at: usize,
}

/// The entry `raw` holds, if it is a whole version-8 value; why not otherwise.
pub fn decode(raw: &[u8]) -> Result<StoredEntry, String> {
    let fixed = raw
        .get(..FIXED)
        .ok_or_else(|| format!("{} bytes: shorter than the fixed start", raw.len()))?;
    if &fixed[..3] != b"CG\x08" {
        return Err(format!("not a version-8 entry: {:?}", &fixed[..3]));
    }
    let recorded = u64::from_le_bytes(fixed[11..19].try_into().expect("8 bytes"));
    if recorded != raw.len() as u64 {
        return Err(format!("records {recorded} bytes, {} there", raw.len()));
    }
    let sum = u64::from_le_bytes(fixed[3..11].try_into().expect("8 bytes"));
    if xxhash_rust::xxh3::xxh3_64(&raw[11..]) != sum {
        return Err("checksum does not match".into());
    }
    let (meta, rest): (Meta, &[u8]) =
        postcard::take_from_bytes(&raw[FIXED..]).map_err(|e| format!("meta: {e}"))?;
    let head_at = raw.len() - rest.len();
    let body_at = head_at + meta.head_len as usize;
    if body_at as u64 + meta.body_len != raw.len() as u64 {
        return Err("head and body lengths do not add up".into());
    }
    let key = std::str::from_utf8(&raw[head_at..head_at + meta.key_len as usize])
        .map_err(|e| format!("key: {e}"))?;
    Ok(StoredEntry {
        key: key.to_owned(),
        status: meta.status,
        stored_at_ms: meta.stored_at_ms,
        ttl_ms: meta.ttl_ms,
        grace_ms: meta.grace_ms,
        body: raw[body_at..].to_vec(),
        meta_at: FIXED,
        head_at,
        body_at,
    })
}
