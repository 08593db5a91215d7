//! One access-log record and its two line formats, made on the writer thread.
//!
//! Fields from the request are escaped as nginx's `escape=default` does — `"`, `\` and every
//! byte outside printable ASCII become `\xHH` — and capped ([`MAX_TARGET`], [`MAX_HEADER`]);
//! a capped field ends in `...`. So no client can put a newline, a quote or a control
//! character into a line, nor make one longer than a few kilobytes.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderValue, StatusCode, Uri, Version};
use serde::Serialize;

use crate::metrics::Outcome;
use crate::proxy::route::Route;

/// The longest request target (path, and query when logged) written, in bytes of the
/// escaped text.
pub(super) const MAX_TARGET: usize = 2048;
/// The longest `User-Agent` or `Referer` written.
pub(super) const MAX_HEADER: usize = 512;
/// The longest method or `X-Cache` value written (both are short unless forged).
const MAX_WORD: usize = 32;

/// A line's format (`access_log.format`, but for `off`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Json,
    Combined,
}

/// The route a request took, for its line.
#[derive(Debug)]
pub(crate) enum RouteName {
    /// No route (`-`: refused before routing) or pass-through (`_passthrough`).
    Static(&'static str),
    Route(Arc<Route>),
}

impl RouteName {
    fn as_str(&self) -> &str {
        match self {
            RouteName::Static(name) => name,
            RouteName::Route(route) => &route.config.name,
        }
    }
}

/// What a line takes from the request head: method, target, `User-Agent` and `Referer`,
/// copied into one allocation (each cut a byte past its cap, so a cut still shows). A copy,
/// not the request's own `Uri` and `HeaderValue`s: those are slices of hyper's read buffer,
/// which a queued line would keep alive (and hyper could not reuse) until it is written.
#[derive(Debug)]
pub(crate) struct Head {
    text: Box<[u8]>,
    method: usize,
    target: usize,
    user_agent: Option<usize>,
    referer: Option<usize>,
}

impl Head {
    pub(crate) fn new(
        method: &str,
        target: &str,
        user_agent: Option<&HeaderValue>,
        referer: Option<&HeaderValue>,
    ) -> Self {
        let cut = |bytes: &[u8], max: usize| -> usize { bytes.len().min(max + 1) };
        let method = &method.as_bytes()[..cut(method.as_bytes(), MAX_WORD)];
        let target = &target.as_bytes()[..cut(target.as_bytes(), MAX_TARGET)];
        let user_agent = user_agent.map(|v| &v.as_bytes()[..cut(v.as_bytes(), MAX_HEADER)]);
        let referer = referer.map(|v| &v.as_bytes()[..cut(v.as_bytes(), MAX_HEADER)]);
        let len = |part: Option<&[u8]>| part.map_or(0, <[u8]>::len);
        let mut text =
            Vec::with_capacity(method.len() + target.len() + len(user_agent) + len(referer));
        for part in [Some(method), Some(target), user_agent, referer]
            .into_iter()
            .flatten()
        {
            text.extend_from_slice(part);
        }
        Head {
            text: text.into_boxed_slice(),
            method: method.len(),
            target: target.len(),
            user_agent: user_agent.map(<[u8]>::len),
            referer: referer.map(<[u8]>::len),
        }
    }

    fn method(&self) -> &[u8] {
        self.text.get(..self.method).unwrap_or_default()
    }

    fn target(&self) -> &[u8] {
        let start = self.method;
        self.text
            .get(start..start + self.target)
            .unwrap_or_default()
    }

    fn user_agent(&self) -> Option<&[u8]> {
        let start = self.method + self.target;
        self.user_agent
            .map(|len| self.text.get(start..start + len).unwrap_or_default())
    }

    fn referer(&self) -> Option<&[u8]> {
        let start = self.method + self.target + self.user_agent.unwrap_or(0);
        self.referer
            .map(|len| self.text.get(start..start + len).unwrap_or_default())
    }
}

/// Everything one line says. Built from the request head when it arrives, completed from
/// the answer and, when the body ends, with the bytes sent and the total time.
#[derive(Debug)]
pub(crate) struct Record {
    /// The format at the time of the request (a reload may change it before it is written).
    pub(crate) format: Format,
    /// The file the settings of that time write to (see `SinkSlot`).
    pub(crate) sink: u64,
    /// When the request reached the router.
    pub(crate) at: SystemTime,
    pub(crate) client: IpAddr,
    pub(crate) version: Version,
    pub(crate) head: Head,
    pub(crate) status: StatusCode,
    /// The `X-Cache` value.
    pub(crate) cache: Option<&'static str>,
    pub(crate) route: RouteName,
    /// Why cacheguard answered itself (`OwnAnswer::reason`).
    pub(crate) reason: Option<&'static str>,
    /// The time this request's origin requests waited for an answer.
    pub(crate) origin: Option<Duration>,
    /// Body bytes handed to the connection.
    pub(crate) bytes: u64,
    /// From the request's arrival until its body ended or was dropped.
    pub(crate) total: Duration,
}

/// The `X-Cache` value cacheguard set, as one of its own words; `?` for a value that is
/// none of them (never seen: every answer is marked by `respond.rs`).
pub(crate) fn cache_word(value: &HeaderValue) -> &'static str {
    Outcome::ALL
        .iter()
        .map(|outcome| outcome.header_value())
        .find(|word| word.as_bytes() == value.as_bytes())
        .unwrap_or("?")
}

/// Buffers reused from line to line, so a line allocates nothing once they have grown.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    time: String,
    method: String,
    target: String,
    user_agent: String,
    referer: String,
}

/// The JSON line: field names are part of the interface (README, "Access log").
#[derive(Serialize)]
struct JsonLine<'a> {
    time: &'a str,
    client: IpAddr,
    method: &'a str,
    path: &'a str,
    protocol: &'static str,
    status: u16,
    bytes: u64,
    cache: Option<&'a str>,
    route: Option<&'a str>,
    total_us: u64,
    origin_us: Option<u64>,
    reason: Option<&'static str>,
    user_agent: Option<&'a str>,
    referer: Option<&'a str>,
}

/// Appends `record`'s line, newline included, to `out`.
pub(super) fn write(record: &Record, scratch: &mut Scratch, out: &mut Vec<u8>) {
    scratch.fill(record);
    match record.format {
        Format::Json => json(record, scratch, out),
        Format::Combined => combined(record, scratch, out),
    }
    out.push(b'\n');
}

impl Scratch {
    fn fill(&mut self, record: &Record) {
        self.time.clear();
        let _ = write!(self.time, "{}", humantime::format_rfc3339_millis(record.at));
        let head = &record.head;
        escape(head.method(), MAX_WORD, &mut self.method);
        escape(head.target(), MAX_TARGET, &mut self.target);
        escape(
            head.user_agent().unwrap_or_default(),
            MAX_HEADER,
            &mut self.user_agent,
        );
        escape(
            head.referer().unwrap_or_default(),
            MAX_HEADER,
            &mut self.referer,
        );
    }
}

fn json(record: &Record, scratch: &Scratch, out: &mut Vec<u8>) {
    let head = &record.head;
    let present = |value: Option<&[u8]>, text| value.map(|_| text);
    let route = record.route.as_str();
    let line = JsonLine {
        time: &scratch.time,
        client: record.client,
        method: &scratch.method,
        path: &scratch.target,
        protocol: protocol(record.version),
        status: record.status.as_u16(),
        bytes: record.bytes,
        cache: record.cache,
        route: (route != "-").then_some(route),
        total_us: micros(record.total),
        origin_us: record.origin.map(micros),
        reason: record.reason,
        user_agent: present(head.user_agent(), scratch.user_agent.as_str()),
        referer: present(head.referer(), scratch.referer.as_str()),
    };
    // Serializing borrowed strings and numbers into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, &line);
}

/// `127.0.0.1 - - [27/Nov/2026:02:04:44 +0000] "GET /a HTTP/1.1" 200 1024 "-" "curl/8"`
/// followed by ` cache=HIT-L1 route=items rt=0.000123 ot=- reason=-`.
fn combined(record: &Record, scratch: &Scratch, out: &mut Vec<u8>) {
    let head = &record.head;
    // Writing into a Vec cannot fail.
    let _ = write!(
        out,
        "{} - - [{}] \"{} {} {}\" {} {} \"{}\" \"{}\" cache={} route={} rt={:.6} ot=",
        record.client,
        clf_time(&scratch.time),
        scratch.method,
        scratch.target,
        protocol(record.version),
        record.status.as_u16(),
        record.bytes,
        or_dash(head.referer(), &scratch.referer),
        or_dash(head.user_agent(), &scratch.user_agent),
        record.cache.unwrap_or("-"),
        record.route.as_str(),
        record.total.as_secs_f64(),
    );
    let _ = match record.origin {
        Some(origin) => write!(out, "{:.6}", origin.as_secs_f64()),
        None => write!(out, "-"),
    };
    let _ = write!(out, " reason={}", record.reason.unwrap_or("-"));
}

/// `text` (the escaped `value`), or `-` when there is no value.
fn or_dash<'a>(value: Option<&[u8]>, text: &'a str) -> &'a str {
    if value.is_some() { text } else { "-" }
}

/// The target a line shows: the path, with `?query` when `query`; the authority of a
/// request that names no path (`CONNECT host:port`).
pub(super) fn target(uri: &Uri, query: bool) -> &str {
    match uri.path_and_query() {
        Some(pq) if query => pq.as_str(),
        Some(pq) => pq.path(),
        None => uri.authority().map_or("-", |a| a.as_str()),
    }
}

fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3.0",
        _ => "-",
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// Replaces `out` with `bytes` escaped (see the module docs), at most `max` bytes of it;
/// a longer field is cut and ends in `...`.
pub(super) fn escape(bytes: &[u8], max: usize, out: &mut String) {
    out.clear();
    let plain = |byte: u8| (0x20..0x7f).contains(&byte) && byte != b'"' && byte != b'\\';
    // The usual case: nothing to escape or cut, copied at once.
    if bytes.len() <= max
        && bytes.iter().all(|&byte| plain(byte))
        && let Ok(text) = std::str::from_utf8(bytes)
    {
        out.push_str(text);
        return;
    }
    for &byte in bytes {
        let plain = plain(byte);
        let width = if plain { 1 } else { 4 };
        if out.len() + width > max {
            out.push_str("...");
            return;
        }
        if plain {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "\\x{byte:02X}");
        }
    }
}

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// `2026-11-27T02:04:44.123Z` (humantime's RFC 3339) as the common log format's
/// `27/Nov/2026:02:04:44 +0000`. Rearranged by hand: the one date crate in the tree,
/// humantime, formats RFC 3339 only, and this is a fixed-width reordering of its output.
fn clf_time(rfc3339: &str) -> String {
    let part = |range: std::ops::Range<usize>| rfc3339.get(range).unwrap_or("");
    let month = part(5..7)
        .parse::<usize>()
        .ok()
        .and_then(|m| MONTHS.get(m.wrapping_sub(1)))
        .copied()
        .unwrap_or("???");
    format!(
        "{}/{month}/{}:{} +0000",
        part(8..10),
        part(0..4),
        part(11..19)
    )
}

#[cfg(test)]
pub(super) mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn head(target: &str, user_agent: Option<&[u8]>, referer: Option<&[u8]>) -> Head {
        let value = |bytes: &[u8]| HeaderValue::from_bytes(bytes).expect("a header value");
        Head::new(
            "GET",
            target,
            user_agent.map(value).as_ref(),
            referer.map(value).as_ref(),
        )
    }

    pub(in crate::proxy::access_log) fn record(format: Format) -> Record {
        Record {
            format,
            sink: 0,
            // 2026-11-27T02:04:44.123Z
            at: SystemTime::UNIX_EPOCH + Duration::from_millis(1_795_745_084_123),
            client: IpAddr::V4(Ipv4Addr::LOCALHOST),
            version: Version::HTTP_11,
            head: head("/api/items/1", Some(b"curl/8"), None),
            status: StatusCode::OK,
            cache: Some("HIT-L1"),
            route: RouteName::Static("items"),
            reason: None,
            origin: None,
            bytes: 1024,
            total: Duration::from_micros(123),
        }
    }

    fn line(record: &Record) -> String {
        let mut out = Vec::new();
        write(record, &mut Scratch::default(), &mut out);
        String::from_utf8(out).expect("ASCII")
    }

    #[test]
    fn combined_is_nginx_combined_then_our_fields() {
        assert_eq!(
            line(&record(Format::Combined)),
            "127.0.0.1 - - [27/Nov/2026:02:04:44 +0000] \"GET /api/items/1 HTTP/1.1\" 200 1024 \
             \"-\" \"curl/8\" cache=HIT-L1 route=items rt=0.000123 ot=- reason=-\n"
        );
        let mut own = record(Format::Combined);
        own.head = head("/api/items/1?token=secret", Some(b"curl/8"), Some(b""));
        own.status = StatusCode::BAD_GATEWAY;
        own.cache = Some("BYPASS");
        own.reason = Some("origin_unreachable");
        own.origin = Some(Duration::from_millis(2));
        own.route = RouteName::Static("_passthrough");
        own.version = Version::HTTP_2;
        assert_eq!(
            line(&own),
            "127.0.0.1 - - [27/Nov/2026:02:04:44 +0000] \"GET /api/items/1?token=secret \
             HTTP/2.0\" 502 1024 \"\" \"curl/8\" cache=BYPASS route=_passthrough \
             rt=0.000123 ot=0.002000 reason=origin_unreachable\n"
        );
    }

    #[test]
    fn json_has_stable_fields_and_nulls_for_what_is_absent() {
        let text = line(&record(Format::Json));
        assert!(text.ends_with('\n') && text.matches('\n').count() == 1);
        let value: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(
            value,
            serde_json::json!({
                "time": "2026-11-27T02:04:44.123Z",
                "client": "127.0.0.1",
                "method": "GET",
                "path": "/api/items/1",
                "protocol": "HTTP/1.1",
                "status": 200,
                "bytes": 1024,
                "cache": "HIT-L1",
                "route": "items",
                "total_us": 123,
                "origin_us": null,
                "reason": null,
                "user_agent": "curl/8",
                "referer": null,
            })
        );
        let mut refused = record(Format::Json);
        refused.route = RouteName::Static("-");
        refused.cache = None;
        let value: serde_json::Value = serde_json::from_str(&line(&refused)).expect("JSON");
        assert!(
            value["route"].is_null() && value["cache"].is_null(),
            "{value}"
        );
    }

    #[test]
    fn the_target_has_its_query_only_when_asked() {
        let uri = Uri::from_static("/a/b?token=secret");
        assert_eq!(target(&uri, false), "/a/b");
        assert_eq!(target(&uri, true), "/a/b?token=secret");
        assert_eq!(
            target(&Uri::from_static("example.com:443"), false),
            "example.com:443"
        );
    }

    #[test]
    fn client_bytes_are_escaped_and_capped() {
        let mut out = String::new();
        escape(b"a\"b\\c\nd\r\x00\x7f\xc3\xa9 e", 100, &mut out);
        assert_eq!(out, "a\\x22b\\x5Cc\\x0Ad\\x0D\\x00\\x7F\\xC3\\xA9 e");
        escape(&[b'x'; 10], 4, &mut out);
        assert_eq!(out, "xxxx...");
        // An escape is never cut in two.
        escape(b"xx\n", 4, &mut out);
        assert_eq!(out, "xx...");

        let mut evil = record(Format::Combined);
        evil.head = head("/", Some(b"x\" \"y\xff"), None);
        let text = line(&evil);
        assert_eq!(text.matches('\n').count(), 1, "{text}");
        assert!(text.contains("\"x\\x22 \\x22y\\xFF\""), "{text}");
        // Exactly the six quotes of the format: request, referer, user agent.
        assert_eq!(text.matches('"').count(), 6, "{text}");

        // Cut at the caps, a byte past them kept so the cut shows.
        let long = format!("/{}", "a".repeat(10 * MAX_TARGET));
        let mut capped = record(Format::Json);
        capped.head = head(&long, Some(&[b'u'; 4 * MAX_HEADER][..]), None);
        let value: serde_json::Value = serde_json::from_str(&line(&capped)).expect("JSON");
        let path = value["path"].as_str().expect("path");
        assert_eq!(path.len(), MAX_TARGET + 3);
        assert!(path.ends_with("..."));
        let agent = value["user_agent"].as_str().expect("user agent");
        assert_eq!(agent, format!("{}...", "u".repeat(MAX_HEADER)));
        let exact = "a".repeat(MAX_TARGET);
        capped.head = head(&exact, None, None);
        let value: serde_json::Value = serde_json::from_str(&line(&capped)).expect("JSON");
        assert_eq!(
            value["path"],
            exact.as_str(),
            "a target at the cap is whole"
        );
    }

    #[test]
    fn the_cache_word_is_one_of_ours() {
        for outcome in Outcome::ALL {
            let value = HeaderValue::from_static(outcome.header_value());
            assert_eq!(cache_word(&value), outcome.header_value());
        }
        assert_eq!(cache_word(&HeaderValue::from_static("HIT")), "?");
    }

    #[test]
    fn clf_time_rearranges_rfc3339() {
        assert_eq!(
            clf_time("2026-01-02T03:04:05.678Z"),
            "02/Jan/2026:03:04:05 +0000"
        );
        assert_eq!(
            clf_time("2026-12-31T23:59:59.999Z"),
            "31/Dec/2026:23:59:59 +0000"
        );
    }
}
