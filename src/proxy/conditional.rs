//! A read's own preconditions and range, answered by cacheguard from the `200` it would
//! otherwise send (RFC 9110 §13, §14), so a client revalidating its copy or asking for part
//! of it costs the origin nothing:
//!
//! ```text
//! If-None-Match matches the answer's ETag (weak comparison) ─▶ 304
//! else (no If-None-Match) If-Modified-Since ≥ its Last-Modified ─▶ 304
//! one `Range: bytes=` range, If-Range (if any) matching ─▶ 206 + Content-Range
//!                                  nothing of it within the body ─▶ 416 + Content-Range
//! anything else (several ranges, another unit, a malformed header) ─▶ the whole 200
//! ```
//!
//! Conditionals and ranges are not forwarded with a client's end-to-end headers (see
//! `origin::end_to_end`): one stored answer serves every client's conditional and range
//! requests. The one exception is a miss with nothing stored on a `freshness = "origin"`
//! route, whose fetch carries the client's `If-None-Match` / `If-Modified-Since`
//! (`FillJob::forwarding_validators`); the origin's `304` then goes to that client as it is.

use http::header::{self, HeaderMap, HeaderValue};
use http::{Response, StatusCode};

use super::body::Body;

/// A request's preconditions and range: what [`apply`] needs from it. `None` from
/// [`Asked::of`] when there is nothing to apply (the common case, looked up once).
#[derive(Debug)]
pub(crate) struct Asked {
    if_none_match: Option<HeaderValue>,
    if_modified_since: Option<HeaderValue>,
    range: Option<HeaderValue>,
    if_range: Option<HeaderValue>,
}

impl Asked {
    pub(crate) fn of(headers: &HeaderMap) -> Option<Asked> {
        let asked = Asked {
            if_none_match: headers.get(header::IF_NONE_MATCH).cloned(),
            if_modified_since: headers.get(header::IF_MODIFIED_SINCE).cloned(),
            range: headers.get(header::RANGE).cloned(),
            if_range: headers.get(header::IF_RANGE).cloned(),
        };
        let any = asked.if_none_match.is_some()
            || asked.if_modified_since.is_some()
            || asked.range.is_some();
        any.then_some(asked)
    }
}

/// Answers `asked` from `response` when it is a `200` (any other status goes out as it
/// is). `head`: the request was a HEAD (no range is served for it).
pub(crate) fn apply(asked: &Asked, response: Response<Body>, head: bool) -> Response<Body> {
    if response.status() != StatusCode::OK {
        return response;
    }
    if not_modified(asked, response.headers()) {
        return into_not_modified(response);
    }
    match &asked.range {
        Some(range) if !head && if_range_holds(asked, response.headers()) => {
            into_range(range, response)
        }
        _ => response,
    }
}

/// RFC 9110 §13.2.2, steps 3 and 4: `If-None-Match` when present, else
/// `If-Modified-Since`.
fn not_modified(asked: &Asked, headers: &HeaderMap) -> bool {
    if let Some(if_none_match) = &asked.if_none_match {
        let Some(etag) = headers.get(header::ETAG).and_then(|v| v.to_str().ok()) else {
            // `*` matches any current representation.
            return if_none_match.as_bytes().trim_ascii() == b"*";
        };
        return if_none_match.to_str().is_ok_and(|list| {
            list.split(',')
                .map(str::trim)
                .any(|tag| tag == "*" || weak_eq(tag, etag))
        });
    }
    let (Some(since), Some(modified)) = (
        asked.if_modified_since.as_ref().and_then(date_secs),
        headers.get(header::LAST_MODIFIED).and_then(date_secs),
    ) else {
        return false;
    };
    modified <= since
}

/// Weak comparison of two entity-tags (RFC 9110 §8.8.3.2): equal opaque tags, `W/` or not.
fn weak_eq(a: &str, b: &str) -> bool {
    let opaque = |tag: &str| tag.trim().trim_start_matches("W/").to_owned();
    opaque(a) == opaque(b)
}

/// `If-Range` (RFC 9110 §13.1.5): absent, or a strong ETag equal to the answer's, or a date
/// equal to its `Last-Modified`. Otherwise the whole answer is sent.
fn if_range_holds(asked: &Asked, headers: &HeaderMap) -> bool {
    let Some(if_range) = asked.if_range.as_ref().and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let if_range = if_range.trim();
    if if_range.starts_with('"') {
        return headers
            .get(header::ETAG)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|etag| etag.trim() == if_range);
    }
    let modified = headers.get(header::LAST_MODIFIED).and_then(date_secs);
    modified.is_some() && modified == httpdate::parse_http_date(if_range).ok().and_then(secs)
}

fn date_secs(value: &HeaderValue) -> Option<u64> {
    secs(httpdate::parse_http_date(value.to_str().ok()?).ok()?)
}

fn secs(time: std::time::SystemTime) -> Option<u64> {
    Some(time.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs())
}

/// A `304` from a `200`: no body, and none of the headers that describe it.
fn into_not_modified(response: Response<Body>) -> Response<Body> {
    let (mut parts, _) = response.into_parts();
    parts.status = StatusCode::NOT_MODIFIED;
    for name in [
        header::CONTENT_LENGTH,
        header::CONTENT_TYPE,
        header::CONTENT_RANGE,
        header::TRANSFER_ENCODING,
    ] {
        parts.headers.remove(name);
    }
    Response::from_parts(parts, Body::empty())
}

/// A `206` with the one range asked for, or a `416` when none of it is in the body. A
/// streamed body (an answer too large to store), several ranges or a range that does not
/// parse: the whole `200`.
fn into_range(range: &HeaderValue, response: Response<Body>) -> Response<Body> {
    let (mut parts, body) = response.into_parts();
    let bytes = match body {
        Body::Full(bytes) => bytes.unwrap_or_default(),
        other => return Response::from_parts(parts, other),
    };
    let whole = |parts, bytes| Response::from_parts(parts, Body::full(bytes));
    let Some(parsed) = range
        .to_str()
        .ok()
        .and_then(|r| http_range_header::parse_range_header(r).ok())
    else {
        return whole(parts, bytes);
    };
    let len = bytes.len() as u64;
    match parsed.validate(len) {
        Ok(ranges) if ranges.len() == 1 => {
            let (start, end) = (*ranges[0].start(), *ranges[0].end());
            parts.status = StatusCode::PARTIAL_CONTENT;
            set(&mut parts.headers, format!("bytes {start}-{end}/{len}"));
            parts.headers.remove(header::CONTENT_LENGTH);
            // Within the body: `validate` keeps every range inside 0..len.
            let (start, end) = (start as usize, end as usize);
            Response::from_parts(parts, Body::full(bytes.slice(start..=end)))
        }
        Ok(_) => whole(parts, bytes),
        Err(_) => {
            parts.status = StatusCode::RANGE_NOT_SATISFIABLE;
            set(&mut parts.headers, format!("bytes */{len}"));
            parts.headers.remove(header::CONTENT_LENGTH);
            Response::from_parts(parts, Body::empty())
        }
    }
}

fn set(headers: &mut HeaderMap, content_range: String) {
    if let Ok(value) = HeaderValue::from_str(&content_range) {
        headers.insert(header::CONTENT_RANGE, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(pairs: &[(&'static str, &'static str)]) -> Asked {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_static(v));
        }
        Asked::of(&h).expect("something asked")
    }

    fn ok(pairs: &[(&'static str, &'static str)], body: &'static str) -> Response<Body> {
        let mut response = Response::new(Body::full(body));
        for (n, v) in pairs {
            response
                .headers_mut()
                .append(*n, HeaderValue::from_static(v));
        }
        response
    }

    fn body(response: Response<Body>) -> Vec<u8> {
        match response.into_body() {
            Body::Full(bytes) => bytes.unwrap_or_default().to_vec(),
            _ => panic!("a buffered body"),
        }
    }

    const TAGGED: &[(&str, &str)] = &[
        ("etag", "\"abc\""),
        ("last-modified", "Thu, 01 Jan 1970 00:16:40 GMT"),
        ("content-type", "text/plain"),
    ];

    #[test]
    fn nothing_asked_is_nothing_to_do() {
        assert!(Asked::of(&HeaderMap::new()).is_none());
    }

    #[test]
    fn etags_and_dates_make_304s() {
        for inm in ["\"abc\"", "W/\"abc\"", "\"x\", \"abc\"", "*"] {
            let got = apply(&asked(&[("if-none-match", inm)]), ok(TAGGED, "01"), false);
            assert_eq!(got.status(), 304, "If-None-Match: {inm}");
            assert_eq!(got.headers()["etag"], "\"abc\"");
            assert!(got.headers().get("content-type").is_none());
        }
        let miss = apply(
            &asked(&[("if-none-match", "\"x\"")]),
            ok(TAGGED, "01"),
            false,
        );
        assert_eq!(miss.status(), 200);
        let later = asked(&[("if-modified-since", "Thu, 01 Jan 1970 00:20:00 GMT")]);
        assert_eq!(apply(&later, ok(TAGGED, "01"), false).status(), 304);
        let earlier = asked(&[("if-modified-since", "Thu, 01 Jan 1970 00:10:00 GMT")]);
        assert_eq!(apply(&earlier, ok(TAGGED, "01"), false).status(), 200);
        // If-None-Match wins over If-Modified-Since.
        let both = asked(&[
            ("if-none-match", "\"x\""),
            ("if-modified-since", "Thu, 01 Jan 1970 00:20:00 GMT"),
        ]);
        assert_eq!(apply(&both, ok(TAGGED, "01"), false).status(), 200);
    }

    #[test]
    fn one_range_is_served_from_the_whole() {
        let got = apply(
            &asked(&[("range", "bytes=0-1")]),
            ok(TAGGED, "0123456789"),
            false,
        );
        assert_eq!(got.status(), 206);
        assert_eq!(got.headers()["content-range"], "bytes 0-1/10");
        assert_eq!(body(got), b"01");
        let suffix = apply(
            &asked(&[("range", "bytes=-3")]),
            ok(TAGGED, "0123456789"),
            false,
        );
        assert_eq!(body(suffix), b"789");
        let open = apply(
            &asked(&[("range", "bytes=8-")]),
            ok(TAGGED, "0123456789"),
            false,
        );
        assert_eq!(body(open), b"89");
        let past = apply(
            &asked(&[("range", "bytes=20-30")]),
            ok(TAGGED, "0123456789"),
            false,
        );
        assert_eq!(past.status(), 416);
        assert_eq!(past.headers()["content-range"], "bytes */10");
        for whole in ["bytes=0-1,4-5", "items=0-1", "bytes=5-1", "nonsense"] {
            let got = apply(&asked(&[("range", whole)]), ok(TAGGED, "0123456789"), false);
            assert_eq!(got.status(), 200, "Range: {whole}");
        }
        let head = apply(
            &asked(&[("range", "bytes=0-1")]),
            ok(TAGGED, "0123456789"),
            true,
        );
        assert_eq!(head.status(), 200, "no range for a HEAD");
    }

    #[test]
    fn if_range_must_match_for_a_part() {
        let matching = asked(&[("range", "bytes=0-1"), ("if-range", "\"abc\"")]);
        assert_eq!(apply(&matching, ok(TAGGED, "0123"), false).status(), 206);
        let other = asked(&[("range", "bytes=0-1"), ("if-range", "\"zzz\"")]);
        assert_eq!(apply(&other, ok(TAGGED, "0123"), false).status(), 200);
        let dated = asked(&[
            ("range", "bytes=0-1"),
            ("if-range", "Thu, 01 Jan 1970 00:16:40 GMT"),
        ]);
        assert_eq!(apply(&dated, ok(TAGGED, "0123"), false).status(), 206);
    }
}
