//! The record an idempotency key leaves: whether its buy is in flight, done (with the
//! answer to replay) or in doubt (with the reservation a retry goes on with).
//!
//! ```text
//! <kind> ' ' <fingerprint: 16 hex> ' ' <segment> ' ' <reservation member> [ ' ' <ends> ]
//!     [ '\n' <answer> ]
//! ```
//!
//! `kind` is `P` (in flight), `D` (done: the answer follows, postcard) or `U` (in doubt:
//! `ends` is when its reservation ends, in ms since the Unix epoch).
//! The first 18 bytes are read by the buy script too (`shared.rs`): the kind, and the
//! fingerprint of the body the key was first sent with.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

/// Largest answer body kept for a replay; a larger one is replayed as its status and
/// headers (the record says it was cut).
pub(crate) const MAX_REPLAY_BODY: usize = 64 * 1024;

/// What state a key's buy is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    InFlight,
    Done,
    InDoubt,
}

impl Kind {
    fn byte(self) -> u8 {
        match self {
            Kind::InFlight => b'P',
            Kind::Done => b'D',
            Kind::InDoubt => b'U',
        }
    }
}

/// An idempotency key's record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) kind: Kind,
    /// xxh3-64 of the request body the key was first sent with.
    pub(crate) fingerprint: u64,
    /// The segment its reservation is in.
    pub(crate) segment: u16,
    /// Its reservation (`<units>.<id>`), empty when it had none (forwarded ungated).
    pub(crate) member: String,
    /// `InDoubt`: when its reservation ends (ms since the Unix epoch, on the clock of the
    /// instance that wrote it); until then its units are held.
    pub(crate) ends_ms: Option<u64>,
    /// `Done`: the answer to replay.
    pub(crate) answer: Option<StoredAnswer>,
}

/// An origin answer kept for replays.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StoredAnswer {
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, Bytes)>,
    pub(crate) body: Bytes,
    /// The body was longer than [`MAX_REPLAY_BODY`] and is not kept.
    pub(crate) cut: bool,
}

impl StoredAnswer {
    /// The answer `status`, `headers`, `body` as a replay will give it: end-to-end headers
    /// only, no `Set-Cookie`, `Date` or `X-Cache` (made anew), the body up to
    /// [`MAX_REPLAY_BODY`].
    pub(crate) fn of(status: StatusCode, headers: &HeaderMap, body: Option<Bytes>) -> Self {
        let kept = headers
            .iter()
            .filter(|(name, _)| {
                !matches!(
                    name.as_str(),
                    "set-cookie"
                        | "date"
                        | "x-cache"
                        | "age"
                        | "connection"
                        | "keep-alive"
                        | "transfer-encoding"
                        | "content-length"
                        | "trailer"
                        | "upgrade"
                )
            })
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    Bytes::copy_from_slice(value.as_bytes()),
                )
            })
            .collect();
        let (body, cut) = match body {
            Some(body) if body.len() <= MAX_REPLAY_BODY => (body, false),
            _ => (Bytes::new(), true),
        };
        StoredAnswer {
            status: status.as_u16(),
            headers: kept,
            body,
            cut,
        }
    }

    /// The headers, as a map (names and values were valid when stored).
    pub(crate) fn header_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.headers.len());
        for (name, value) in &self.headers {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_maybe_shared(value.clone()),
            ) {
                map.append(name, value);
            }
        }
        map
    }
}

impl Record {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.member.len());
        out.push(self.kind.byte());
        out.extend_from_slice(
            format!(
                " {:016x} {} {}",
                self.fingerprint, self.segment, self.member
            )
            .as_bytes(),
        );
        if let Some(ends) = self.ends_ms {
            out.extend_from_slice(format!(" {ends}").as_bytes());
        }
        if let Some(answer) = &self.answer {
            out.push(b'\n');
            // A `Vec` writer cannot fail, and every field serializes.
            if let Ok(encoded) = postcard::to_extend(answer, out.clone()) {
                out = encoded;
            }
        }
        out
    }

    /// `None` for anything that is not a record (garbage, another program's value).
    pub(crate) fn decode(bytes: &[u8]) -> Option<Record> {
        let (line, answer) = match bytes.iter().position(|b| *b == b'\n') {
            Some(at) => (&bytes[..at], Some(&bytes[at + 1..])),
            None => (bytes, None),
        };
        let line = std::str::from_utf8(line).ok()?;
        let mut parts = line.splitn(5, ' ');
        let kind = match parts.next()? {
            "P" => Kind::InFlight,
            "D" => Kind::Done,
            "U" => Kind::InDoubt,
            _ => return None,
        };
        let fingerprint = u64::from_str_radix(parts.next()?, 16).ok()?;
        let segment = parts.next()?.parse().ok()?;
        let member = parts.next().unwrap_or_default().to_owned();
        let ends_ms = match parts.next() {
            Some(ends) => Some(ends.parse().ok()?),
            None => None,
        };
        let answer = match answer {
            Some(bytes) => Some(postcard::from_bytes(bytes).ok()?),
            None => None,
        };
        if (kind == Kind::Done) != answer.is_some() {
            return None;
        }
        Some(Record {
            kind,
            fingerprint,
            segment,
            member,
            ends_ms,
            answer,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_start_as_the_script_reads_them() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("set-cookie", HeaderValue::from_static("a=b"));
        let answer = StoredAnswer::of(StatusCode::CREATED, &headers, Some(Bytes::from("{}")));
        assert_eq!(answer.headers.len(), 1, "set-cookie is never replayed");
        for record in [
            Record {
                kind: Kind::InFlight,
                fingerprint: 0xdead_beef,
                segment: 3,
                member: "1.abc".into(),
                ends_ms: None,
                answer: None,
            },
            Record {
                kind: Kind::Done,
                fingerprint: u64::MAX,
                segment: 0,
                member: "2.x".into(),
                ends_ms: None,
                answer: Some(answer.clone()),
            },
            Record {
                kind: Kind::InDoubt,
                fingerprint: 1,
                segment: 0,
                member: String::new(),
                ends_ms: None,
                answer: None,
            },
            Record {
                kind: Kind::InDoubt,
                fingerprint: 2,
                segment: 1,
                member: "1.def".into(),
                ends_ms: Some(1_700_000_000_000),
                answer: None,
            },
        ] {
            let bytes = record.encode();
            assert_eq!(Record::decode(&bytes), Some(record.clone()));
            assert_eq!(bytes[1], b' ');
            assert_eq!(
                &bytes[2..18],
                format!("{:016x}", record.fingerprint).as_bytes()
            );
        }
        assert_eq!(Record::decode(b"X 00 0 a"), None);
        assert_eq!(
            Record::decode(b"D 0000000000000001 0 a"),
            None,
            "done needs an answer"
        );
        assert_eq!(Record::decode(b"P zz 0 a"), None);
        assert_eq!(Record::decode(b"U 0000000000000001 0 a soon"), None);
        let big = StoredAnswer::of(
            StatusCode::OK,
            &HeaderMap::new(),
            Some(Bytes::from(vec![0u8; MAX_REPLAY_BODY + 1])),
        );
        assert!(big.cut && big.body.is_empty());
    }
}
