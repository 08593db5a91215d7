//! Building responses: cache hits, cacheguard's own errors, and the header hygiene shared
//! by every path (`X-Cache`, `Age`, hop-by-hop removal).

use std::fmt::Write as _;
use std::sync::LazyLock;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};

use super::body::Body;
use super::own_answer::OwnAnswer;
use crate::cache::Entry;
use crate::clock::now_ms;
use crate::error::ProxyError;
use crate::metrics::Outcome;

pub(crate) static X_CACHE: HeaderName = HeaderName::from_static("x-cache");

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1), plus the
/// proxy-only ones. Never forwarded in either direction.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Whether `name` is a hop-by-hop header by itself (those a `Connection` line names aside).
pub(crate) fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name) || name == "proxy-connection"
}

/// Removes hop-by-hop headers, including those named by `Connection`.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove("proxy-connection");
}

/// `Age` values below this many seconds are slices of one text made once ([`age_value`]).
const AGES: u64 = 10_000;
/// Bytes per age in that text: the longest, 9999, is 4 digits.
const AGE_SLOT: usize = 4;

/// The `Age` value for `secs`. A hit answers with one, and `HeaderValue::from(u64)`
/// allocates a buffer for each: below [`AGES`] the value is a slice of a text of every age
/// made once (40 KB, `AGE_SLOT` bytes per age), which costs no allocation.
fn age_value(secs: u64) -> HeaderValue {
    static TEXT: LazyLock<String> = LazyLock::new(|| {
        (0..AGES).fold(String::new(), |mut text, age| {
            let _ = write!(text, "{age:<width$}", width = AGE_SLOT);
            text
        })
    });
    if secs >= AGES {
        return HeaderValue::from(secs);
    }
    let text: &'static String = LazyLock::force(&TEXT);
    // In range: secs < AGES, and every slot holds the age's digits first.
    let start = usize::try_from(secs).unwrap_or(0) * AGE_SLOT;
    let digits = secs.checked_ilog10().map_or(1, |log| log as usize + 1);
    let slice = Bytes::from_static(&text.as_bytes()[start..start + digits]);
    HeaderValue::from_maybe_shared(slice).unwrap_or_else(|_| HeaderValue::from(secs))
}

fn x_cache_value(outcome: Outcome) -> HeaderValue {
    HeaderValue::from_static(outcome.header_value())
}

/// Marks a response with its `X-Cache` value.
pub(crate) fn mark(response: &mut Response<Body>, outcome: Outcome) {
    response
        .headers_mut()
        .insert(X_CACHE.clone(), x_cache_value(outcome));
}

/// A response from a cached entry. `head` answers a HEAD request (headers only).
/// The answer from a cached entry, from the tier `tier` names; a hit on a 404/410 is
/// `NEGATIVE`.
pub(crate) fn hit(entry: &Entry, tier: Outcome, head: bool) -> (Response<Body>, Outcome) {
    let outcome = match tier {
        Outcome::HitL1 | Outcome::HitL2 if entry.is_negative() => Outcome::Negative,
        other => other,
    };
    (from_entry(entry, outcome, head, now_ms()), outcome)
}

pub(crate) fn from_entry(
    entry: &Entry,
    outcome: Outcome,
    head: bool,
    now_ms: u64,
) -> Response<Body> {
    let body = if head {
        Body::empty()
    } else {
        Body::Full(Some(entry.body()).filter(|b| !b.is_empty()))
    };
    let mut response = Response::new(body);
    *response.status_mut() = entry.status;
    let headers = response.headers_mut();
    headers.reserve(entry.header_count() + 3);
    for (name, value) in entry.header_lines() {
        headers.append(name, value);
    }
    if head {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(entry.body_len()));
    }
    headers.insert(header::AGE, age_value(entry.age_secs(now_ms)));
    headers.insert(X_CACHE.clone(), x_cache_value(outcome));
    response
}

/// cacheguard's own answer for `error`: the right status, a short text body, and
/// `Retry-After` where the client should come back later. Tagged as an [`OwnAnswer`], so
/// the router logs it.
/// The methods cacheguard forwards or answers, for a 405's `Allow`.
const ALLOWED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

pub(crate) fn error(error: &ProxyError) -> Response<Body> {
    let mut response = Response::new(Body::full(format!("cacheguard: {error}\n")));
    *response.status_mut() = error.status();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if let Some(seconds) = error.retry_after() {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    if matches!(error, ProxyError::MethodNotAllowed) {
        // RFC 9110 §15.5.6: a 405 says which methods the target takes.
        headers.insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
    }
    headers.insert(X_CACHE.clone(), x_cache_value(Outcome::Error));
    response.extensions_mut().insert(OwnAnswer::of(error));
    response
}

/// A plain text response (admin endpoints, simple answers).
pub(crate) fn text(status: StatusCode, body: impl Into<String>) -> Response<Body> {
    let mut response = Response::new(Body::full(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn age_values_are_the_decimal_seconds() {
        for secs in [
            0,
            1,
            9,
            10,
            99,
            100,
            999,
            1000,
            9999,
            10_000,
            123_456,
            u64::MAX,
        ] {
            assert_eq!(age_value(secs), secs.to_string().as_str(), "{secs}");
        }
    }
}
