//! Bounded fuzzing of what cacheguard reads from outside: request bytes on the proxy listener
//! and config text.
//!
//! - [`malformed_requests_are_refused_before_the_origin`]: an embedded instance (the item
//!   route and a write route) in front of a [`TestOrigin`]; raw loopback connections send
//!   random bytes, mutated valid requests and hand-made malformed ones (see [`generate`]),
//!   with valid requests interleaved. Every case has a unique path marker, so the origin's
//!   counters tell whether it reached the origin.
//! - [`config_loader_survives_arbitrary_text`]: `Config::from_toml` in process, then the
//!   binary's `--check-config` on a file, with random and mutated TOML.
//!
//! Environment (bench/fuzz.sh runs the same tests for minutes):
//! - `CG_FUZZ_SECS`: time budget of each test (default 5).
//! - `CG_FUZZ_SEED`: the seed (decimal or `0x` hex; default from the clock). Every case is
//!   generated from (seed, case number) alone, so a printed seed replays the same cases.
//! - `CG_FUZZ_CASES`: at most this many cases per test (default 2000 per second of budget).
//! - `CG_FUZZ_CASE`: run only this case number of the seed (both tests), printed in full.
//!
//! Failing inputs are printed (shortened) and written whole under
//! `target/tmp/fuzz-failures/`.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::common::{CgConfig, ITEM_ROUTE, TestOrigin, route};

// === settings and the generator ===

/// The run's settings, from the environment.
#[derive(Clone, Copy, Debug)]
struct Settings {
    seed: u64,
    budget: Duration,
    max_cases: u64,
    only_case: Option<u64>,
}

fn parse_u64(text: &str) -> Option<u64> {
    let text = text.trim();
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

fn settings(what: &str) -> Settings {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let secs: f64 = var("CG_FUZZ_SECS").map_or(5.0, |v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("CG_FUZZ_SECS={v:?}: expected seconds"))
    });
    let seed = match var("CG_FUZZ_SEED") {
        Some(v) => parse_u64(&v).unwrap_or_else(|| panic!("CG_FUZZ_SEED={v:?}: expected a u64")),
        None => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            Rng::new(nanos ^ u64::from(std::process::id()) << 32).next()
        }
    };
    let max_cases = var("CG_FUZZ_CASES").map_or(((secs * 2000.0) as u64).max(100), |v| {
        parse_u64(&v).unwrap_or_else(|| panic!("CG_FUZZ_CASES={v:?}: expected a count"))
    });
    let only_case = var("CG_FUZZ_CASE")
        .map(|v| parse_u64(&v).unwrap_or_else(|| panic!("CG_FUZZ_CASE={v:?}: expected a number")));
    let settings = Settings {
        seed,
        budget: Duration::from_secs_f64(secs.max(0.1)),
        max_cases,
        only_case,
    };
    println!(
        "fuzz {what}: seed {seed:#x}, budget {secs}s, at most {max_cases} cases \
         (replay: CG_FUZZ_SEED={seed:#x}{})",
        only_case.map_or(String::new(), |n| format!(" CG_FUZZ_CASE={n}"))
    );
    settings
}

/// splitmix64: small, fast, good enough to pick mutations.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// Case `n`'s generator: depends on (seed, n) only, not on the cases run before.
    fn for_case(seed: u64, stream: u64, n: u64) -> Rng {
        let mut rng = Rng(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        rng.0 ^= rng.next() ^ n.wrapping_add(1).wrapping_mul(0xA24B_AED4_963E_E407);
        rng.next();
        rng
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn percent(&mut self, p: u64) -> bool {
        self.next() % 100 < p
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn pick_copy<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }

    fn token(&mut self) -> String {
        format!("{:016x}", self.next())
    }
}

/// `bytes` escaped, at most about `max` characters (the middle elided).
fn show(bytes: &[u8], max: usize) -> String {
    let escaped = bytes.escape_ascii().to_string();
    if escaped.len() <= max {
        return escaped;
    }
    let cut = |s: &str, at: usize| {
        let mut at = at.min(s.len());
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        at
    };
    let head = cut(&escaped, max * 3 / 4);
    let tail = cut(&escaped, escaped.len() - max / 4);
    format!(
        "{}…({} bytes)…{}",
        &escaped[..head],
        bytes.len(),
        &escaped[tail..]
    )
}

/// Where failing inputs are written whole.
fn failures_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
    std::fs::create_dir_all(&dir).expect("create the fuzz-failures dir");
    dir
}

// === requests: the cases ===

/// What a case must get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// A well-formed request: answered 200.
    Valid,
    /// Certainly malformed, or refused by policy (the text says which rule): a 4xx or a
    /// closed connection, and the origin never sees its marker.
    Refused(&'static str),
    /// Anything but a timeout or an answer that is not HTTP.
    Any,
}

/// One request case.
#[derive(Clone, Debug)]
struct Case {
    n: u64,
    family: &'static str,
    expect: Expect,
    bytes: Vec<u8>,
    /// The origin path only this case can produce; `None` when it has none (CONNECT to an
    /// authority, random bytes).
    marker: Option<String>,
    /// The case changed its target after the marker: any origin path starting with the
    /// marker is this case's (a scan of every path, so only for the few that need it).
    marker_is_prefix: bool,
}

impl Case {
    /// Requests the origin received for this case's marker.
    fn at_origin(&self, origin: &TestOrigin) -> u64 {
        match &self.marker {
            Some(m) if self.marker_is_prefix => origin.count_prefix(m),
            Some(m) => origin.count(m),
            None => 0,
        }
    }
}

/// A request in pieces, so a case can break exactly one of them.
#[derive(Clone, Debug)]
struct Req {
    method: Vec<u8>,
    target: Vec<u8>,
    version: Vec<u8>,
    /// Whole field lines without their line end.
    lines: Vec<Vec<u8>>,
    body: Vec<u8>,
    eol: &'static [u8],
}

impl Req {
    fn new(method: &str, target: &str) -> Req {
        Req {
            method: method.as_bytes().to_vec(),
            target: target.as_bytes().to_vec(),
            version: b"HTTP/1.1".to_vec(),
            lines: Vec::new(),
            body: Vec::new(),
            eol: b"\r\n",
        }
    }

    fn header(&mut self, name: &str, value: &str) -> &mut Req {
        self.line(format!("{name}: {value}").into_bytes())
    }

    fn line(&mut self, line: Vec<u8>) -> &mut Req {
        self.lines.push(line);
        self
    }

    fn is(line: &[u8], name: &str) -> bool {
        line.len() > name.len()
            && line[..name.len()].eq_ignore_ascii_case(name.as_bytes())
            && line[name.len()] == b':'
    }

    /// Removes every `name` line.
    fn remove(&mut self, name: &str) -> &mut Req {
        self.lines.retain(|l| !Req::is(l, name));
        self
    }

    fn insert_anywhere(&mut self, rng: &mut Rng, line: Vec<u8>) {
        let at = rng.below(self.lines.len() + 1);
        self.lines.insert(at, line);
    }

    /// Replaces the value of the first `name` line.
    fn set_value(&mut self, name: &str, value: &[u8]) {
        if let Some(line) = self.lines.iter_mut().find(|l| Req::is(l, name)) {
            let mut new = line[..=name.len()].to_vec();
            new.push(b' ');
            new.extend_from_slice(value);
            *line = new;
        }
    }

    /// `body` with a `Content-Length`, or chunked into random pieces.
    fn body(&mut self, rng: &mut Rng, body: &[u8], chunked: bool) -> &mut Req {
        self.remove("content-length").remove("transfer-encoding");
        if chunked {
            self.header("Transfer-Encoding", "chunked");
            self.body = chunked_body(rng, body);
        } else {
            self.header("Content-Length", &body.len().to_string());
            self.body = body.to_vec();
        }
        self
    }

    fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128 + self.body.len());
        out.extend_from_slice(&self.method);
        out.push(b' ');
        out.extend_from_slice(&self.target);
        out.push(b' ');
        out.extend_from_slice(&self.version);
        out.extend_from_slice(self.eol);
        for line in &self.lines {
            out.extend_from_slice(line);
            out.extend_from_slice(self.eol);
        }
        out.extend_from_slice(self.eol);
        out.extend_from_slice(&self.body);
        out
    }
}

/// `body` as valid chunked framing, in random pieces.
fn chunked_body(rng: &mut Rng, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let take = rng.range(1, rest.len());
        out.extend_from_slice(format!("{take:x}\r\n").as_bytes());
        out.extend_from_slice(&rest[..take]);
        out.extend_from_slice(b"\r\n");
        rest = &rest[take..];
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

fn alnum(rng: &mut Rng, len: usize) -> Vec<u8> {
    const SET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    (0..len).map(|_| *rng.pick(SET)).collect()
}

/// A well-formed request to one of the instance's paths (item route, pass-through, write
/// route), with a marker path of its own; returns it and the marker.
fn valid_req(rng: &mut Rng, n: u64, host: &str) -> (Req, String) {
    let tok = rng.token();
    let item = format!("/api/items/fz{n}-{tok}");
    let pass = format!("/fuzz/{n}-{tok}");
    let (method, path, body) = match rng.below(5) {
        0 => ("GET", item, false),
        1 => ("HEAD", item, false),
        2 => ("GET", pass, false),
        3 => (
            *rng.pick(&["POST", "PATCH", "DELETE", "OPTIONS"]),
            pass,
            true,
        ),
        _ => ("PUT", item, true),
    };
    let mut req = Req::new(method, &path);
    req.header("Host", host).header("User-Agent", "cg-fuzz/1");
    if rng.percent(50) {
        req.header("Accept", "*/*");
    }
    if rng.percent(30) {
        req.header("X-Fuzz-Case", &n.to_string());
    }
    if body && method != "DELETE" && method != "OPTIONS" {
        let len = rng.range(0, 64);
        let content = alnum(rng, len);
        let chunked = rng.percent(50);
        req.body(rng, &content, chunked);
    }
    (req, path)
}

/// The [`Expect::Refused`] families.
const REFUSED_FAMILIES: usize = 14;

/// `items[v % len]`: a variant's choice.
fn nth<T: Copy>(items: &[T], v: usize) -> T {
    items[v % items.len()]
}

/// A case of refused family `family` (`0..REFUSED_FAMILIES`), its choices made by `variant`
/// (so a sweep of variants covers every value of the family's lists; the first cases of a
/// run do that), positions and bodies by `rng`.
fn refused_case(
    rng: &mut Rng,
    n: u64,
    (host, origin): (&str, SocketAddr),
    family: usize,
    v: usize,
) -> Case {
    let (mut req, marker) = valid_req(rng, n, host);
    let mut marker = Some(marker);
    let (family, rule): (&'static str, &'static str) = match family % REFUSED_FAMILIES {
        0 => {
            req.remove("host");
            (
                "no-host",
                "RFC 9112 §3.2: an HTTP/1.1 request without Host MUST get 400",
            )
        }
        1 => {
            let name = nth(&["Host", "host", "HOST"], v);
            let value = nth(
                &[
                    host,
                    "127.0.0.1",
                    "example.com",
                    "localhost:1",
                    "evil.example:80",
                ],
                v / 3,
            );
            req.insert_anywhere(rng, format!("{name}: {value}").into_bytes());
            (
                "two-host",
                "RFC 9112 §3.2: more than one Host field line MUST get 400",
            )
        }
        2 => {
            let bad: &[&[u8]] = &[
                b"a b",
                b"127.0.0.1:80 x",
                b"user@127.0.0.1",
                b"user:pw@127.0.0.1:80",
                b"@127.0.0.1",
                b"127.0.0.1/evil",
                b"127.0.0.1?x=1",
                b"127.0.0.1#frag",
                b"127.0.0.1\\x",
                b"ho\"st",
                b"<host>",
                b"ho{st}",
                b"ho^st",
                b"ho|st",
                b"ho`st",
                b"127.0.0.1:80:80",
                b"127.0.0.1:8o",
                b"[::1",
                b"::1",
                b"[127.0.0.1]",
                b"ho%zzst",
                b"ho%",
                b"h\tb",
                b"h\xc3\xa9st",
                b"h\xffst",
            ];
            req.set_value("host", nth(bad, v));
            (
                "bad-host",
                "RFC 9112 §3.2 + RFC 9110 §7.2: a Host that is not uri-host[:port] MUST get 400",
            )
        }
        3 => {
            let bad: &[&[u8]] = &[
                b"zz", b"g", b"-1", b"+5", b"0x5", b"5g", b"\xff", b"", b"5.0", b"1_0",
            ];
            let size = nth(bad, v);
            // A write route, whose body is read whole before anything is forwarded (a
            // streamed pass-through body is checked as it goes, after its head left).
            let item = format!("/api/items/fz{n}-chunk");
            req = Req::new("PUT", &item);
            req.header("Host", host);
            marker = Some(item);
            req.header("Transfer-Encoding", "chunked");
            let mut body = Vec::new();
            if (v / bad.len()) % 2 == 1 {
                body.extend_from_slice(b"3\r\nabc\r\n");
            }
            body.extend_from_slice(size);
            body.extend_from_slice(b"\r\nabcde\r\n0\r\n\r\n");
            req.body = body;
            (
                "bad-chunk-size",
                "RFC 9112 §7.1: chunk-size = 1*HEXDIG: the framing is invalid; on a write \
                 route (body read whole first) nothing is forwarded",
            )
        }
        4 => {
            let content = alnum(rng, 5);
            req.body(rng, &content, true);
            let cl = if v.is_multiple_of(2) {
                req.body.len().to_string()
            } else {
                rng.range(0, 100).to_string()
            };
            req.insert_anywhere(rng, format!("Content-Length: {cl}").into_bytes());
            (
                "cl-and-te",
                "RFC 9112 §6.3 (3): Content-Length with Transfer-Encoding ought to be handled \
                 as an error (policy here: refused; the RFC also lets an intermediary drop \
                 Content-Length and forward)",
            )
        }
        5 => {
            req.remove("content-length").remove("transfer-encoding");
            req.body = b"abcd".to_vec();
            let (a, b) = (v % 10, (v % 10 + 1 + v / 10 % 9) % 10);
            match v % 3 {
                0 => {
                    req.insert_anywhere(rng, format!("Content-Length: {a}").into_bytes());
                    req.insert_anywhere(rng, format!("Content-Length: {b}").into_bytes());
                }
                1 => {
                    req.header("Content-Length", &format!("{a}, {b}"));
                }
                _ => {
                    let bad: &[&[u8]] = &[
                        b"abc",
                        b"-1",
                        b"+4",
                        b"0x4",
                        b"4 4",
                        b"",
                        b"4.0",
                        b"\xd9\xa4",
                        b"4;",
                    ];
                    let mut line = b"Content-Length: ".to_vec();
                    line.extend_from_slice(nth(bad, v / 3));
                    req.insert_anywhere(rng, line);
                }
            }
            (
                "bad-content-length",
                "RFC 9112 §6.3 (5): an invalid Content-Length (differing values, not digits) \
                 MUST get 400",
            )
        }
        6 => {
            req.remove("content-length").remove("transfer-encoding");
            let te = nth(
                &[
                    "gzip",
                    "chunked, gzip",
                    "identity",
                    "x-fuzz",
                    "deflate",
                    "chunked, identity",
                ],
                v,
            );
            req.header("Transfer-Encoding", te);
            req.body = b"abcd".to_vec();
            (
                "te-not-chunked",
                "RFC 9112 §6.3 (4): a request whose final transfer coding is not chunked \
                 MUST get 400",
            )
        }
        7 => {
            let ws = nth(&[" ", "\t", "  "], v);
            if (v / 3).is_multiple_of(2) {
                req.remove("host");
                req.insert_anywhere(rng, format!("Host{ws}: {host}").into_bytes());
            } else {
                req.insert_anywhere(rng, format!("X-Fuzz{ws}: v").into_bytes());
            }
            (
                "space-before-colon",
                "RFC 9112 §5.1: whitespace between a field name and the colon MUST get 400",
            )
        }
        8 => {
            let tail = nth(&["b c", "junk line", "x\ty", "no-colon-here"], v);
            req.insert_anywhere(rng, format!("X-Fuzz: a\n{tail}").into_bytes());
            (
                "bare-lf-in-value",
                "RFC 9112 §2.2/§5 + RFC 9110 §5.5: a bare LF inside a field value, the line \
                 after it no field line (policy here: refused; §5.5 also allows replacing \
                 the LF with SP)",
            )
        }
        9 => {
            match v % 4 {
                0 => {
                    let bad: &[&[u8]] =
                        &[b"G(T", b"GE\"T", b"[GET]", b"G:T", b"GET\x00", b"G\x7fT"];
                    req.method = nth(bad, v / 4).to_vec();
                }
                1 => {
                    let bad: &[&[u8]] = &[
                        b"HTTP/1.1x",
                        b"HTTX/1.1",
                        b"http/1.1",
                        b"HTTP/1",
                        b"HTTP/1.",
                        b"HTTP/11",
                        b"HTTP/1.1.1",
                        b"HTTP/ 1.1",
                        b"HTTP/1.1 x",
                    ];
                    req.version = nth(bad, v / 4).to_vec();
                }
                2 => {
                    let insert: &[&[u8]] =
                        &[b"\x01", b"\x7f", b"\x00", b" q", b"\xc3\xa9", b"\"<>"];
                    let mut target = req.target.clone();
                    target.extend_from_slice(nth(insert, v / 4));
                    req.target = target;
                }
                _ => {
                    // A relative target: neither origin-form nor absolute-form.
                    req.target = req.target[1..].to_vec();
                }
            }
            (
                "bad-request-line",
                "RFC 9112 §3: a request line that does not parse gets 400",
            )
        }
        10 => {
            req.method = b"CONNECT".to_vec();
            (
                "connect-path",
                "RFC 9112 §3.2.3 + RFC 9110 §9.3.6: CONNECT takes an authority-form target; \
                 one with a path is malformed",
            )
        }
        11 => {
            req.method = b"CONNECT".to_vec();
            req.target = if v.is_multiple_of(2) {
                origin.to_string().into_bytes()
            } else {
                b"example.com:443".to_vec()
            };
            marker = None;
            (
                "connect",
                "policy (in progress): a reverse proxy is no tunnel; CONNECT is refused \
                 (no marker: only the answer is checked)",
            )
        }
        12 => {
            req.method = b"TRACE".to_vec();
            req.remove("content-length").remove("transfer-encoding");
            req.body.clear();
            if v.is_multiple_of(2) {
                req.header("Max-Forwards", &(v / 2 % 3).to_string());
            }
            (
                "trace",
                "policy (in progress): TRACE is refused, never forwarded",
            )
        }
        _ => {
            let len = rng.range(17_000, 70_000);
            if v.is_multiple_of(2) {
                let mut target = req.target.clone();
                target.extend_from_slice(b"?pad=");
                target.extend(std::iter::repeat_n(b'a', len));
                req.target = target;
            } else {
                let mut line = b"X-Pad: ".to_vec();
                line.extend(std::iter::repeat_n(b'a', len.min(40_000)));
                req.insert_anywhere(rng, line);
            }
            (
                "head-too-large",
                "config contract: a head over server.max_header_bytes (16384) gets 431/414 and \
                 is never forwarded",
            )
        }
    };
    // hyper frames such a request by Transfer-Encoding alone and closes the connection
    // after it, as RFC 9112 §6.3 allows an intermediary: only classified.
    let expect = if family == "cl-and-te" {
        Expect::Any
    } else {
        Expect::Refused(rule)
    };
    Case {
        n,
        family,
        expect,
        bytes: req.render(),
        marker_is_prefix: family == "bad-request-line",
        marker,
    }
}

/// Odd but not certainly malformed requests ([`Expect::Any`]): only classified.
fn edge_case(rng: &mut Rng, n: u64, host: &str) -> Case {
    let (mut req, marker) = valid_req(rng, n, host);
    let family = match rng.below(19) {
        0 => {
            req.insert_anywhere(rng, b"X-Fuzz: a\r\n  folded".to_vec());
            "obs-fold"
        }
        1 => {
            let ctl: &[&[u8]] = &[b"\x00", b"\r", b"\x7f", b"\x01", b"\x0b"];
            let mut line = b"X-Fuzz: a".to_vec();
            line.extend_from_slice(rng.pick_copy(ctl));
            line.extend_from_slice(b"b");
            req.insert_anywhere(rng, line);
            "ctl-in-value"
        }
        2 => {
            req.eol = b"\n";
            "lf-only-lines"
        }
        3 => {
            req.remove("content-length").remove("transfer-encoding");
            req.header("Transfer-Encoding", "chunked");
            req.body = b"3\nabc\n0\n\n".to_vec();
            "chunk-lf-only"
        }
        4 => {
            req.remove("content-length").remove("transfer-encoding");
            req.header("Transfer-Encoding", "chunked");
            req.body = b"a\r\nabc\r\n0\r\n\r\n".to_vec();
            "chunk-short"
        }
        5 => {
            req.remove("content-length").remove("transfer-encoding");
            req.header("Transfer-Encoding", "chunked");
            let size = *rng.pick(&[
                "FFFFFFFFFFFFFFED",
                "FFFFFFFFFFFFFFFFF",
                "7FFFFFFFFFFFFFFF",
                "100000000",
                "0000000000000000000005",
            ]);
            req.body = format!("{size}\r\nabcde\r\n0\r\n\r\n").into_bytes();
            "chunk-huge-size"
        }
        6 => {
            req.remove("content-length").remove("transfer-encoding");
            req.header("Transfer-Encoding", "chunked");
            let ext = match rng.below(4) {
                0 => "5;a=b".to_string(),
                1 => "5 ; x".to_string(),
                2 => "5;name=\"quo;ted\"".to_string(),
                _ => format!("5;{}", "e".repeat(rng.range(1_000, 20_000))),
            };
            req.body = format!("{ext}\r\nabcde\r\n0\r\n\r\n").into_bytes();
            "chunk-ext"
        }
        7 => {
            req.remove("content-length").remove("transfer-encoding");
            req.header("Transfer-Encoding", "chunked");
            let trailer = *rng.pick(&[
                "X-T: 1",
                "Host: evil.example",
                "Content-Length: 5",
                "Transfer-Encoding: chunked",
                "bad trailer",
            ]);
            req.body = format!("3\r\nabc\r\n0\r\n{trailer}\r\n\r\n").into_bytes();
            "chunk-trailers"
        }
        8 => {
            req.remove("content-length").remove("transfer-encoding");
            req.header("Content-Length", "3")
                .header("Content-Length", "3");
            req.body = b"abc".to_vec();
            "dup-cl-same"
        }
        9 => {
            req.remove("content-length").remove("transfer-encoding");
            req.header("Content-Length", &rng.range(10, 100_000).to_string());
            req.body = b"abc".to_vec();
            "cl-short-body"
        }
        10 => {
            req.remove("host").remove("transfer-encoding");
            req.version = b"HTTP/1.0".to_vec();
            if req.body.is_empty() {
                req.remove("content-length");
            } else {
                let body = req.body.clone();
                req.body(rng, &body, false);
            }
            "http10-no-host"
        }
        11 => {
            let mut target = match rng.below(3) {
                0 => format!("http://{host}").into_bytes(),
                1 => b"http://other.example".to_vec(),
                _ => format!("http://user:pw@{host}").into_bytes(),
            };
            target.extend_from_slice(&req.target);
            req.target = target;
            "absolute-form"
        }
        12 => {
            let mut target = req.target.clone();
            target.extend_from_slice(b"?pad=");
            target.extend(std::iter::repeat_n(b'a', rng.range(1_000, 15_000)));
            req.target = target;
            "long-uri"
        }
        13 => {
            req.method = if rng.percent(50) {
                {
                    let len = rng.range(1, 40);
                    alnum(rng, len)
                }
            } else {
                rng.pick(&[&b"get"[..], b"PROPFIND", b"M-SEARCH", b"BREW", b"PRI"])
                    .to_vec()
            };
            "random-method"
        }
        14 => {
            req.header("Expect", "100-continue");
            "expect-continue"
        }
        15 => {
            req.version = rng
                .pick(&[&b"HTTP/1.2"[..], b"HTTP/2.0", b"HTTP/0.9", b"HTTP/9.9"])
                .to_vec();
            "other-version"
        }
        16 => {
            let extra = match rng.below(3) {
                0 => valid_req(rng, n, host).0.render(),
                1 => {
                    let len = rng.range(1, 200);
                    rng.bytes(len)
                }
                _ => b"\r\n\r\n".to_vec(),
            };
            req.body.extend_from_slice(&extra);
            "pipelined"
        }
        17 => {
            let count = rng.range(50, 300);
            for i in 0..count {
                req.header(&format!("X-Many-{i}"), "v");
            }
            "many-headers"
        }
        _ => {
            match rng.below(3) {
                0 => {
                    req.set_value("host", b"");
                }
                1 => {
                    req.remove("content-length").remove("transfer-encoding");
                    req.header("Transfer-Encoding", "chunked, chunked");
                    req.body = b"3\r\nabc\r\n0\r\n\r\n".to_vec();
                }
                _ => {
                    let mut rendered = b"\r\n\r\n".to_vec();
                    rendered.extend_from_slice(&req.render());
                    return Case {
                        n,
                        family: "misc",
                        expect: Expect::Any,
                        bytes: rendered,
                        marker: Some(marker),
                        marker_is_prefix: false,
                    };
                }
            }
            "misc"
        }
    };
    Case {
        n,
        family,
        expect: Expect::Any,
        bytes: req.render(),
        marker: Some(marker),
        marker_is_prefix: false,
    }
}

/// The lines of `bytes` split on CRLF (the last one may be partial).
fn split_lines(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + 1 < bytes.len() {
        if bytes[i] == b'\r' && bytes[i + 1] == b'\n' {
            lines.push(bytes[start..i].to_vec());
            i += 2;
            start = i;
        } else {
            i += 1;
        }
    }
    lines.push(bytes[start..].to_vec());
    lines
}

fn join_lines(lines: &[Vec<u8>]) -> Vec<u8> {
    lines.join(&b"\r\n"[..])
}

/// A valid request with 1–4 random mutations.
fn mutated_case(rng: &mut Rng, n: u64, host: &str) -> Case {
    let (req, marker) = valid_req(rng, n, host);
    let mut bytes = req.render();
    for _ in 0..rng.range(1, 4) {
        let len = bytes.len().max(1);
        match rng.below(14) {
            0 => {
                let at = rng.below(len).min(bytes.len().saturating_sub(1));
                if !bytes.is_empty() {
                    bytes[at] ^= 1 << rng.below(8);
                }
            }
            1 => {
                if !bytes.is_empty() {
                    let at = rng.below(bytes.len());
                    bytes[at] = rng.byte();
                }
            }
            2 => {
                let at = rng.below(bytes.len() + 1);
                let count = rng.range(1, 8);
                let insert = rng.bytes(count);
                bytes.splice(at..at, insert);
            }
            3 => {
                let at = rng.below(bytes.len() + 1);
                let end = (at + rng.range(1, 16)).min(bytes.len());
                bytes.drain(at..end);
            }
            4 => {
                let mut lines = split_lines(&bytes);
                let i = rng.below(lines.len());
                let copy = lines[i].clone();
                lines.insert(rng.below(lines.len() + 1), copy);
                bytes = join_lines(&lines);
            }
            5 => {
                let mut lines = split_lines(&bytes);
                if lines.len() > 1 {
                    lines.remove(rng.below(lines.len()));
                }
                bytes = join_lines(&lines);
            }
            6 => {
                let mut lines = split_lines(&bytes);
                let (a, b) = (rng.below(lines.len()), rng.below(lines.len()));
                lines.swap(a, b);
                bytes = join_lines(&lines);
            }
            7 => {
                let end = bytes.iter().position(|b| *b == b' ').unwrap_or(0);
                let method = if rng.percent(50) {
                    let len = rng.range(0, 12);
                    alnum(rng, len)
                } else {
                    let len = rng.range(0, 12);
                    rng.bytes(len)
                };
                bytes.splice(0..end, method);
            }
            8 => {
                let cut = rng.below(bytes.len() + 1);
                bytes.truncate(cut);
            }
            9 => {
                let at = rng.below(bytes.len() + 1);
                let insert: &[u8] = rng.pick_copy(&[
                    &b"\r"[..],
                    b"\n",
                    b"\x00",
                    b"\r\n",
                    b" ",
                    b"\t",
                    b":",
                    b"\r\n ",
                    b"\r\n\r\n",
                ]);
                bytes.splice(at..at, insert.iter().copied());
            }
            10 => {
                let mut lines = split_lines(&bytes);
                if !lines.is_empty() {
                    let version: &[&[u8]] = &[b"HTTP/1.0", b"HTTP/2", b"", b"HTTP/1.1\x00"];
                    let first = &mut lines[0];
                    if let Some(sp) = first.iter().rposition(|b| *b == b' ') {
                        first.truncate(sp + 1);
                        first.extend_from_slice(rng.pick_copy(version));
                    }
                }
                bytes = join_lines(&lines);
            }
            11 => {
                let count = rng.range(1, 64);
                let garbage = rng.bytes(count);
                bytes.extend_from_slice(&garbage);
            }
            12 => {
                let mut lines = split_lines(&bytes);
                if lines.len() > 2 {
                    let i = rng.range(1, lines.len() - 1);
                    let copy = lines[i].clone();
                    for _ in 0..rng.range(2, 120) {
                        lines.insert(i, copy.clone());
                    }
                }
                bytes = join_lines(&lines);
            }
            _ => {
                let junk: &[&[u8]] = &[
                    b"\r\nTransfer-Encoding: chunked",
                    b"\r\nContent-Length: 7",
                    b"\r\nTransfer-Encoding: chunked\r\nContent-Length: 3",
                    b"\r\nHost: evil.example",
                    b"\r\nHost:",
                    b"\r\nExpect: 100-continue",
                    b"\r\nConnection: close",
                    b"\r\nUpgrade: h2c",
                ];
                // After the request line.
                let at = bytes
                    .windows(2)
                    .position(|w| w == b"\r\n")
                    .unwrap_or(bytes.len());
                bytes.splice(at..at, rng.pick(junk).iter().copied());
            }
        }
    }
    Case {
        n,
        family: "mutated",
        expect: Expect::Any,
        bytes,
        marker: Some(marker),
        marker_is_prefix: false,
    }
}

/// Random bytes, random printable text, or random HTTP words.
fn random_case(rng: &mut Rng, n: u64) -> Case {
    let len = rng.range(1, 2048);
    let (family, bytes) = match rng.below(3) {
        0 => ("random-bytes", rng.bytes(len)),
        1 => (
            "random-ascii",
            (0..len).map(|_| 0x20 + (rng.byte() % 0x5f)).collect(),
        ),
        _ => {
            const WORDS: &[&[u8]] = &[
                b"GET",
                b"POST",
                b" ",
                b"/",
                b"/fuzz",
                b"HTTP/1.1",
                b"HTTP/1.0",
                b"\r\n",
                b"\n",
                b"\r",
                b":",
                b": ",
                b"Host",
                b"Content-Length",
                b"Transfer-Encoding",
                b"chunked",
                b"0",
                b"5",
                b"ffff",
                b"\r\n\r\n",
                b";",
                b",",
                b"\t",
                b"\x00",
                b"Connection",
                b"close",
                b"Expect",
                b"100-continue",
                b"?",
                b"#",
                b"%00",
                b"*",
            ];
            let mut out = Vec::new();
            while out.len() < len {
                out.extend_from_slice(rng.pick_copy(WORDS));
            }
            ("random-words", out)
        }
    };
    Case {
        n,
        family,
        expect: Expect::Any,
        bytes,
        marker: None,
        marker_is_prefix: false,
    }
}

/// Variants of each refused family the first cases of a run go through (enough to cover
/// the longest list of a family).
const SWEEP_VARIANTS: usize = 40;

/// Case `n` of the seed: every 8th a valid request; else first a sweep of every refused
/// family's variants, then random bytes (15%), a refused family (40%), an edge family (20%)
/// or a mutated valid request (25%).
fn generate(seed: u64, n: u64, host: &str, origin: SocketAddr) -> Case {
    let mut rng = Rng::for_case(seed, 1, n);
    if n.is_multiple_of(8) {
        let (req, marker) = valid_req(&mut rng, n, host);
        return Case {
            n,
            family: "valid",
            expect: Expect::Valid,
            bytes: req.render(),
            marker: Some(marker),
            marker_is_prefix: false,
        };
    }
    // The first cases sweep every variant of every refused family once.
    let index = (n - n / 8 - 1) as usize;
    if index < REFUSED_FAMILIES * SWEEP_VARIANTS {
        let (family, variant) = (index % REFUSED_FAMILIES, index / REFUSED_FAMILIES);
        return refused_case(&mut rng, n, (host, origin), family, variant);
    }
    match rng.below(100) {
        0..15 => random_case(&mut rng, n),
        15..55 => {
            let (family, variant) = (rng.below(REFUSED_FAMILIES), rng.below(1000));
            refused_case(&mut rng, n, (host, origin), family, variant)
        }
        55..75 => edge_case(&mut rng, n, host),
        _ => mutated_case(&mut rng, n, host),
    }
}

// === requests: one exchange ===

/// How a connection ended.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Answer {
    /// The final status line's code (a 101 counts as final).
    Status(u16),
    /// EOF or reset before any answer byte.
    Closed,
    /// Nothing decisive within the per-connection limit (even after a half-close).
    Timeout,
    /// Answer bytes that are no HTTP/1.x status line (or a cut one).
    NotHttp(Vec<u8>),
    ConnectFailed(String),
}

impl Answer {
    fn class(&self) -> &'static str {
        match self {
            Answer::Status(s) if *s < 200 => "1xx",
            Answer::Status(s) if *s < 400 => "2xx/3xx",
            Answer::Status(s) if *s < 500 => "4xx",
            Answer::Status(_) => "5xx",
            Answer::Closed => "closed",
            Answer::Timeout => "timeout",
            Answer::NotHttp(_) => "not-http",
            Answer::ConnectFailed(_) => "conn-fail",
        }
    }

    fn describe(&self) -> String {
        match self {
            Answer::Status(s) => format!("answered {s}"),
            Answer::Closed => "closed without an answer".into(),
            Answer::Timeout => "timed out".into(),
            Answer::NotHttp(b) => format!("answered non-HTTP bytes {:?}", show(b, 80)),
            Answer::ConnectFailed(e) => format!("connect failed: {e}"),
        }
    }
}

const CLASSES: [&str; 8] = [
    "2xx/3xx",
    "4xx",
    "5xx",
    "1xx",
    "closed",
    "timeout",
    "not-http",
    "conn-fail",
];

/// The final status in `buf`, once there is one (interim 1xx heads other than 101 are
/// skipped); `Some(NotHttp)` as soon as the bytes cannot be an HTTP/1.x answer.
fn read_status(buf: &mut Vec<u8>) -> Option<Answer> {
    loop {
        const PREFIX: &[u8] = b"HTTP/1.";
        let n = buf.len().min(PREFIX.len());
        if buf[..n] != PREFIX[..n] {
            return Some(Answer::NotHttp(buf.clone()));
        }
        let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
            return (buf.len() > 8192).then(|| Answer::NotHttp(buf.clone()));
        };
        let line = &buf[..eol];
        let status = (line.len() >= 12 && line[8] == b' ')
            .then(|| std::str::from_utf8(&line[9..12]).ok()?.parse::<u16>().ok())
            .flatten();
        let Some(status) = status else {
            return Some(Answer::NotHttp(buf.clone()));
        };
        if !(100..200).contains(&status) || status == 101 {
            return Some(Answer::Status(status));
        }
        let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
        buf.drain(..end + 4);
        if buf.is_empty() {
            return None;
        }
    }
}

/// Sends `bytes` on a new connection to `addr` and reads the answer's status line: waits
/// `grace` for it, then half-closes (so a server waiting for more bytes sees the end) and
/// waits until `limit` after connecting in all.
async fn exchange(addr: SocketAddr, bytes: &[u8], grace: Duration, limit: Duration) -> Answer {
    let deadline = Instant::now() + limit;
    let mut stream = match tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return Answer::ConnectFailed(e.to_string()),
        Err(_) => return Answer::Timeout,
    };
    let _ = stream.set_nodelay(true);
    // A reset instead of FIN on drop: long runs do not fill the port range with TIME_WAIT.
    let _ = stream.set_zero_linger();
    // The server may answer and close before it read everything: a failed write is not the
    // answer, the read below is.
    if tokio::time::timeout_at(deadline, stream.write_all(bytes))
        .await
        .is_err()
    {
        return Answer::Timeout;
    }
    let grace_until = Instant::now() + grace;
    let mut half_closed = false;
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let until = if half_closed {
            deadline
        } else {
            grace_until.min(deadline)
        };
        match tokio::time::timeout_at(until, stream.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                return if buf.is_empty() {
                    Answer::Closed
                } else {
                    Answer::NotHttp(buf)
                };
            }
            Ok(Ok(k)) => {
                buf.extend_from_slice(&chunk[..k]);
                if let Some(answer) = read_status(&mut buf) {
                    return answer;
                }
            }
            Err(_) if !half_closed && Instant::now() < deadline => {
                let _ = stream.shutdown().await;
                half_closed = true;
            }
            Err(_) => return Answer::Timeout,
        }
    }
}

// === requests: the test ===

/// One case's result, kept for the report.
#[derive(Debug)]
struct Outcome {
    case: Case,
    answer: Answer,
    took: Duration,
}

/// Per-connection limit: no answer may take longer.
const LIMIT: Duration = Duration::from_secs(2);
/// How long a case waits for an answer before it half-closes.
const GRACE: Duration = Duration::from_millis(400);
/// Connections in flight at once.
const WIDTH: usize = 16;

/// One thing wrong, for the report.
#[derive(Debug)]
struct Finding {
    family: &'static str,
    rule: String,
    what: String,
    n: u64,
    bytes: Vec<u8>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_refused_before_the_origin() {
    let settings = settings("requests");
    let origin = TestOrigin::start().await;
    let routes = format!(
        "{ITEM_ROUTE}{}",
        route("item-write", "/api/items/{id}", "PUT", "")
    );
    let cg = CgConfig::new(&origin).routes(&routes).start().await;
    let (addr, admin) = (cg.addr(), cg.admin_addr());
    let host = addr.to_string();
    let started = Instant::now();

    // The admin listener answers /healthz throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let health = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let (mut checks, mut bad) = (0u64, Vec::new());
            let request =
                format!("GET /healthz HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n");
            while !stop.load(Ordering::Relaxed) {
                let answer = exchange(admin, request.as_bytes(), LIMIT, LIMIT).await;
                checks += 1;
                if answer != Answer::Status(200) {
                    bad.push(answer.describe());
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            (checks, bad)
        })
    };

    let outcomes = Arc::new(Mutex::new(Vec::<Outcome>::new()));
    let next = Arc::new(AtomicU64::new(0));
    let width = if settings.only_case.is_some() {
        1
    } else {
        WIDTH
    };
    let mut workers = Vec::new();
    for _ in 0..width {
        let (outcomes, next, host) = (Arc::clone(&outcomes), Arc::clone(&next), host.clone());
        let origin_addr = origin.addr();
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let n = match settings.only_case {
                    Some(only) if i == 0 => only,
                    Some(_) => break,
                    None => i,
                };
                if i >= settings.max_cases || started.elapsed() >= settings.budget {
                    break;
                }
                let case = generate(settings.seed, n, &host, origin_addr);
                // Valid requests wait the whole limit: they must be answered.
                let grace = if case.expect == Expect::Valid {
                    LIMIT
                } else {
                    GRACE
                };
                let at = Instant::now();
                let answer = exchange(addr, &case.bytes, grace, LIMIT).await;
                let took = at.elapsed();
                outcomes
                    .lock()
                    .expect("outcomes")
                    .push(Outcome { case, answer, took });
            }
        }));
    }
    for worker in workers {
        worker.await.expect("a fuzz worker panicked");
    }
    let fuzz_time = started.elapsed();
    // Let forwarded requests land at the origin before its counters are read.
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Still serving: a valid GET through the cache, and /healthz.
    let final_path = format!(
        "/api/items/fz-final-{}",
        Rng::for_case(settings.seed, 9, 0).token()
    );
    let final_get = exchange(
        addr,
        format!("GET {final_path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
        LIMIT,
        LIMIT,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let (health_checks, health_bad) = health.await.expect("health task");
    let final_health = exchange(
        admin,
        format!("GET /healthz HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n").as_bytes(),
        LIMIT,
        LIMIT,
    )
    .await;

    let outcomes = std::mem::take(&mut *outcomes.lock().expect("outcomes"));
    let mut findings = Vec::new();
    // family → class → count; and per family the cases that reached the origin.
    let mut table: BTreeMap<&'static str, (BTreeMap<&'static str, u64>, u64, u64)> =
        BTreeMap::new();
    let mut slowest = Duration::ZERO;
    for o in &outcomes {
        slowest = slowest.max(o.took);
        let reached = o.case.at_origin(&origin);
        let row = table.entry(o.case.family).or_default();
        *row.0.entry(o.answer.class()).or_default() += 1;
        row.1 += 1;
        if matches!(o.case.expect, Expect::Refused(_)) && reached > 0 {
            row.2 += 1;
        }
        let mut finding = |rule: &str, what: String| {
            findings.push(Finding {
                family: o.case.family,
                rule: rule.to_string(),
                what,
                n: o.case.n,
                bytes: o.case.bytes.clone(),
            });
        };
        match &o.answer {
            Answer::Timeout => finding(
                "every connection is answered or closed within the limit",
                format!("no answer or close within {LIMIT:?}"),
            ),
            Answer::NotHttp(_) | Answer::ConnectFailed(_) => finding(
                "an answer is an HTTP/1.x status line or a close",
                o.answer.describe(),
            ),
            _ => {}
        }
        match o.case.expect {
            Expect::Valid if o.answer != Answer::Status(200) => finding(
                "a valid request is served (200) during the fuzzing",
                o.answer.describe(),
            ),
            Expect::Refused(rule) => {
                let refused = matches!(o.answer, Answer::Closed)
                    || matches!(o.answer, Answer::Status(s) if (400..500).contains(&s));
                let mut wrong = Vec::new();
                if !refused && o.answer != Answer::Timeout {
                    wrong.push(o.answer.describe());
                }
                if reached > 0 {
                    wrong.push(format!("reached the origin ({reached} request)"));
                }
                if !wrong.is_empty() {
                    finding(rule, wrong.join(", "));
                }
            }
            _ => {}
        }
    }
    if final_get != Answer::Status(200) || origin.count(&final_path) != 1 {
        findings.push(Finding {
            family: "final",
            rule: "a valid GET is served after the fuzzing".into(),
            what: format!(
                "{} (origin saw {})",
                final_get.describe(),
                origin.count(&final_path)
            ),
            n: 0,
            bytes: Vec::new(),
        });
    }
    if final_health != Answer::Status(200) || !health_bad.is_empty() {
        findings.push(Finding {
            family: "health",
            rule: "GET /healthz on the admin listener answers 200 throughout".into(),
            what: format!(
                "final: {}; {} of {health_checks} checks during: {:?}",
                final_health.describe(),
                health_bad.len(),
                health_bad.iter().take(3).collect::<Vec<_>>()
            ),
            n: 0,
            bytes: Vec::new(),
        });
    }

    // The summary.
    let mut out = String::new();
    let _ = writeln!(
        out,
        "fuzz requests summary: {} cases in {:.1}s, seed {:#x}, slowest answer {:?}, \
         {health_checks} health checks",
        outcomes.len(),
        fuzz_time.as_secs_f64(),
        settings.seed,
        slowest
    );
    let _ = write!(out, "  {:<20} {:>6}", "family", "cases");
    for class in CLASSES {
        let _ = write!(out, " {class:>9}");
    }
    let _ = writeln!(out, " {:>10}", "at-origin");
    let mut totals: BTreeMap<&str, u64> = BTreeMap::new();
    for (family, (classes, cases, reached)) in &table {
        let refused = outcomes
            .iter()
            .any(|o| o.case.family == *family && matches!(o.case.expect, Expect::Refused(_)));
        let _ = write!(out, "  {family:<20} {cases:>6}");
        for class in CLASSES {
            let count = classes.get(class).copied().unwrap_or(0);
            *totals.entry(class).or_default() += count;
            let _ = write!(out, " {count:>9}");
        }
        let reached = if refused {
            reached.to_string()
        } else {
            "-".into()
        };
        let _ = writeln!(out, " {reached:>10}");
    }
    let _ = write!(out, "  {:<20} {:>6}", "total", outcomes.len());
    for class in CLASSES {
        let _ = write!(out, " {:>9}", totals.get(class).copied().unwrap_or(0));
    }
    let _ = writeln!(out);
    println!("{out}");
    if let Some(only) = settings.only_case {
        for o in &outcomes {
            println!(
                "case {only} [{}]: {} in {:?}; origin saw marker {:?}: {}\n  bytes: {}",
                o.case.family,
                o.answer.describe(),
                o.took,
                o.case.marker,
                o.case.at_origin(&origin),
                show(&o.case.bytes, 100_000)
            );
        }
    }
    cg.shutdown().await;
    report_findings("requests", settings.seed, &findings);
}

/// Prints `findings` grouped by family and rule (three examples each, the rest written to
/// files) and fails the test when there are any.
fn report_findings(what: &str, seed: u64, findings: &[Finding]) {
    if findings.is_empty() {
        println!("fuzz {what}: no findings");
        return;
    }
    let dir = failures_dir();
    let mut groups: BTreeMap<(&str, &str), Vec<&Finding>> = BTreeMap::new();
    for f in findings {
        groups
            .entry((f.family, f.rule.as_str()))
            .or_default()
            .push(f);
    }
    let mut out = format!(
        "fuzz {what}: {} findings in {} groups (seed {seed:#x}; one case again: \
         CG_FUZZ_SEED={seed:#x} CG_FUZZ_CASE=<n>; inputs under {})\n",
        findings.len(),
        groups.len(),
        dir.display()
    );
    for ((family, rule), group) in &groups {
        let mut whats: BTreeMap<&str, u64> = BTreeMap::new();
        for f in group {
            *whats.entry(f.what.as_str()).or_default() += 1;
        }
        let _ = writeln!(out, "[{family}] {} cases: {rule}", group.len());
        for (w, count) in whats.iter().take(6) {
            let _ = writeln!(out, "    {count} × {w}");
        }
        // An example of each kind of answer, then more of the group up to three.
        let mut shown: Vec<u64> = Vec::new();
        for w in whats.keys().take(6) {
            if let Some(f) = group.iter().find(|f| f.what == *w) {
                shown.push(f.n);
            }
        }
        for f in group.iter() {
            if shown.len() >= 3 {
                break;
            }
            if !shown.contains(&f.n) {
                shown.push(f.n);
            }
        }
        let mut printed = Vec::new();
        for f in group.iter().filter(|f| shown.contains(&f.n)) {
            if !f.bytes.is_empty() && !printed.contains(&f.n) {
                printed.push(f.n);
                let _ = writeln!(
                    out,
                    "    case {} ({}): {}",
                    f.n,
                    show(f.what.as_bytes(), 80),
                    show(&f.bytes, 220)
                );
            }
        }
        for f in group.iter().take(20) {
            if !f.bytes.is_empty() {
                let _ = std::fs::write(dir.join(format!("{what}-{seed:x}-{}.bin", f.n)), &f.bytes);
            }
        }
    }
    println!("{out}");
    panic!("fuzz {what}: {} findings (listed above)", findings.len());
}

// === config ===

/// The documented configs, as mutation seeds.
fn config_samples() -> Vec<(String, String)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut samples: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("read config/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("read a sample config");
            (p.display().to_string(), text)
        })
        .collect();
    samples.sort();
    assert!(!samples.is_empty(), "no config/*.toml samples");
    samples
}

/// Every `key =` that appears in the samples, comments included.
fn config_keys(samples: &[(String, String)]) -> Vec<String> {
    let mut keys: Vec<String> = samples
        .iter()
        .flat_map(|(_, text)| text.lines())
        .filter_map(|line| {
            let line = line.trim_start_matches(['#', ' ']);
            let (key, _) = line.split_once(" = ")?;
            key.bytes()
                .all(|b| b.is_ascii_lowercase() || b == b'_')
                .then(|| key.to_string())
        })
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

fn random_string(rng: &mut Rng) -> String {
    const PIECES: &[&str] = &[
        "a",
        "Z",
        "0",
        "9",
        " ",
        "/",
        "{",
        "}",
        "{id}",
        "{*rest}",
        ":",
        "@",
        "\\\\",
        "\\\"",
        "\\n",
        "\\t",
        "\\u0000",
        "\\uD800",
        "é",
        "☃",
        "\u{200b}",
        "%",
        "..",
        "http://",
        "redis://",
        "127.0.0.1",
        "[::1]",
        ":8080",
        "s",
        "ms",
        "h",
        "-",
        ".",
        "*",
        "#",
    ];
    let mut s = String::from("\"");
    for _ in 0..rng.range(0, 12) {
        s.push_str(rng.pick_copy(PIECES));
    }
    s.push('"');
    s
}

/// A random TOML value (or something that is not one).
fn random_value(rng: &mut Rng) -> String {
    const FIXED: &[&str] = &[
        "0",
        "-1",
        "1",
        "9223372036854775807",
        "-9223372036854775808",
        "18446744073709551615",
        "99999999999999999999999",
        "0x7fffffff",
        "0o777",
        "1_000",
        "+5",
        "nan",
        "-inf",
        "inf",
        "1e308",
        "-0.0",
        "0.999999",
        "1.0",
        "2.5",
        "1e-320",
        "true",
        "false",
        "\"\"",
        "\"0s\"",
        "\"1ns\"",
        "\"-5s\"",
        "\"18446744073709551615s\"",
        "\"99999999999999h\"",
        "\"1h 30m\"",
        "\"5 parsecs\"",
        "\"0.0.0.0:0\"",
        "\"[::1]:99999\"",
        "\"127.0.0.1:8080\"",
        "\"http://127.0.0.1:9000\"",
        "\"http://[::1\"",
        "\"https://x:1\"",
        "\"redis://:pw@\"",
        "\"rediss://h:1/#insecure\"",
        "\"unix:///nope\"",
        "\"/api/{id}\"",
        "\"/{*rest}\"",
        "\"{\"",
        "\"/a/{id}/{id}\"",
        "\"json:/id\"",
        "\"location\"",
        "\"sorted\"",
        "\"ignore\"",
        "\"all\"",
        "\"off\"",
        "\"hot\"",
        "\"origin\"",
        "\"route\"",
        "\"always\"",
        "\"never\"",
        "\"cluster\"",
        "\"sentinel\"",
        "[]",
        "[\"GET\"]",
        "[\"G ET\", \"\"]",
        "[\"GET\", \"POST\"]",
        "[1, \"a\"]",
        "[[]]",
        "{}",
        "{ url = \"x\" }",
        "{ filter = \"items\", param = \"id\" }",
        "{ file = \"\" }",
        "{ paths = [\"/\"], rate = 0 }",
        "1979-05-27T07:32:00Z",
        "07:32:00",
        "\"\"\"\nmulti\n\"\"\"",
        "'literal'",
        "",
        "=",
        "\"unterminated",
    ];
    match rng.below(4) {
        0 => random_string(rng),
        1 => (rng.next() as i64).to_string(),
        _ => rng.pick(FIXED).to_string(),
    }
}

/// Random bytes, random TOML-ish text, or a sample with 1–6 mutations.
fn config_case(rng: &mut Rng, samples: &[(String, String)], keys: &[String]) -> Vec<u8> {
    match rng.below(100) {
        0..8 => {
            let len = rng.range(0, 2000);
            rng.bytes(len)
        }
        8..18 => {
            const PIECES: &[&str] = &[
                "[", "]", "[[", "]]", "{", "}", "=", " = ", "\"", "'", ",", ".", "\n", "#", "a",
                "server", "routes", "ttl", "1", "-", "+", "_", ":", " ", "\t", "\r\n", "\"\"\"",
                "true", "1e5", "\\",
            ];
            let mut s = String::new();
            for _ in 0..rng.range(1, 300) {
                s.push_str(rng.pick_copy(PIECES));
            }
            s.into_bytes()
        }
        _ => {
            let (_, text) = rng.pick(samples);
            let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
            for _ in 0..rng.range(1, 6) {
                let len = lines.len().max(1);
                match rng.below(11) {
                    0 if !lines.is_empty() => {
                        lines.remove(rng.below(lines.len()));
                    }
                    1 if !lines.is_empty() => {
                        let copy = lines[rng.below(lines.len())].clone();
                        lines.insert(rng.below(len), copy);
                    }
                    2 if !lines.is_empty() => {
                        let (a, b) = (rng.below(lines.len()), rng.below(lines.len()));
                        lines.swap(a, b);
                    }
                    3..6 => {
                        let candidates: Vec<usize> = (0..lines.len())
                            .filter(|i| {
                                !lines[*i].trim_start().starts_with('#')
                                    && lines[*i].contains(" = ")
                            })
                            .collect();
                        if !candidates.is_empty() {
                            let i = *rng.pick(&candidates);
                            let key = lines[i].split(" = ").next().unwrap_or("").to_string();
                            lines[i] = format!("{key} = {}", random_value(rng));
                        }
                    }
                    6 => {
                        let candidates: Vec<usize> = (0..lines.len())
                            .filter(|i| lines[*i].starts_with("# ") && lines[*i].contains(" = "))
                            .collect();
                        if !candidates.is_empty() {
                            let i = *rng.pick(&candidates);
                            lines[i] = lines[i][2..].to_string();
                        }
                    }
                    7 => {
                        let line = format!("{} = {}", rng.pick(keys), random_value(rng));
                        lines.insert(rng.below(len), line);
                    }
                    8 => {
                        let header = *rng.pick(&[
                            "[server]",
                            "[upstream]",
                            "[redis]",
                            "[admin]",
                            "[cache]",
                            "[lock]",
                            "[hot_keys]",
                            "[journal]",
                            "[invalidation_stream]",
                            "[[routes]]",
                            "[[bloom]]",
                            "[routes]",
                            "[[server]]",
                            "[cache.x]",
                            "[]",
                            "[[]]",
                            "[a b]",
                            "[ server ]",
                        ]);
                        lines.insert(rng.below(len), header.to_string());
                    }
                    9 => {
                        lines.push("[[routes]]".into());
                        for _ in 0..rng.range(0, 6) {
                            lines.push(format!("{} = {}", rng.pick(keys), random_value(rng)));
                        }
                    }
                    _ => {
                        let mut text = lines.join("\n").into_bytes();
                        match rng.below(3) {
                            0 => {
                                let at = rng.below(text.len() + 1);
                                let len = rng.range(1, 4);
                                let insert = rng.bytes(len);
                                text.splice(at..at, insert);
                            }
                            1 => {
                                let at = rng.below(text.len() + 1);
                                let end = (at + rng.range(1, 40)).min(text.len());
                                text.drain(at..end);
                            }
                            _ => {
                                let cut = rng.below(text.len() + 1);
                                text.truncate(cut);
                            }
                        }
                        lines = String::from_utf8_lossy(&text)
                            .lines()
                            .map(str::to_string)
                            .collect();
                    }
                }
            }
            let mut text = lines.join("\n");
            text.push('\n');
            text.into_bytes()
        }
    }
}

/// Inputs only the binary gets: some could take a process down (deep nesting), some are
/// not UTF-8.
fn config_specials(samples: &[(String, String)]) -> Vec<(&'static str, Vec<u8>)> {
    let documented = samples
        .iter()
        .find(|(path, _)| path.ends_with("cacheguard.toml"))
        .map_or_else(|| samples[0].1.clone(), |(_, t)| t.clone());
    vec![
        (
            "deep-arrays",
            format!("a = {}{}", "[".repeat(50_000), "]".repeat(50_000)).into_bytes(),
        ),
        (
            "deep-inline-tables",
            format!("a = {}1{}", "{b = ".repeat(20_000), "}".repeat(20_000)).into_bytes(),
        ),
        (
            "long-dotted-key",
            format!("a{} = 1", ".a".repeat(20_000)).into_bytes(),
        ),
        (
            "deep-table-header",
            format!("[{}a]\n", "a.".repeat(20_000)).into_bytes(),
        ),
        (
            "huge-string",
            format!("[server]\nlisten = \"{}\"\n", "x".repeat(4 << 20)).into_bytes(),
        ),
        ("many-comments", "#\n".repeat(200_000).into_bytes()),
        ("many-routes", "[[routes]]\n".repeat(5_000).into_bytes()),
        (
            "bom",
            [&b"\xef\xbb\xbf"[..], documented.as_bytes()].concat(),
        ),
        ("crlf", documented.replace('\n', "\r\n").into_bytes()),
        ("cr-only", documented.replace('\n', "\r").into_bytes()),
        (
            "not-utf8",
            [documented.as_bytes(), b"\n# \xff\xfe\n"].concat(),
        ),
        ("nul", [documented.as_bytes(), b"\n\x00\n"].concat()),
        ("empty", Vec::new()),
    ]
}

/// What is wrong with one reported problem, if anything: it must name `file`, a line of
/// the text and a key, on one line.
fn bad_problem(p: &cacheguard::config::ConfigProblem, file: &str, lines: usize) -> Option<String> {
    let shown = p.to_string();
    if p.file != file {
        return Some(format!("names file {:?}, not {file:?}: {shown}", p.file));
    }
    let Some(line) = p.line else {
        return Some(format!("has no line: {shown}"));
    };
    if line == 0 || line > lines + 1 {
        return Some(format!(
            "line {line} is outside the text's {lines} lines: {shown}"
        ));
    }
    if p.key.trim().is_empty() || p.key.contains(['\n', '\r']) {
        return Some(format!("key {:?} is empty or spans lines: {shown}", p.key));
    }
    if p.message.trim().is_empty() || p.message.contains(['\n', '\r']) {
        return Some(format!("message is empty or spans lines: {shown:?}"));
    }
    None
}

/// Lines of `text` the way a problem counts them (1 + newlines).
fn line_count(text: &[u8]) -> usize {
    text.iter().filter(|b| **b == b'\n').count() + 1
}

thread_local! {
    /// Set while this thread runs a loader call whose panic is caught and reported.
    static QUIET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, turning a panic into `Err(message)` without the default hook's output (only on
/// this thread: panics of other tests still print).
fn catch_quiet<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(std::cell::Cell::get) {
                previous(info);
            }
        }));
    });
    QUIET.with(|q| q.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    QUIET.with(|q| q.set(false));
    result.map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "<non-string panic>".into())
    })
}

/// `cacheguard --check-config path` with the overrides removed from its environment; the
/// exit code (`None`: killed by a signal or by us after 30 s), stdout and stderr.
fn check_config(path: &Path, dir: &Path) -> (Option<i32>, String, String) {
    let (out_path, err_path) = (dir.join("stdout"), dir.join("stderr"));
    let mut command = std::process::Command::new(crate::common::process::binary());
    command
        .arg("--check-config")
        .arg(path)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"));
    for name in [
        "CACHEGUARD_LISTEN",
        "CACHEGUARD_UPSTREAM",
        "CACHEGUARD_REDIS_URL",
        "CACHEGUARD_REDIS_PASSWORD",
        "CACHEGUARD_ADMIN_TOKEN",
    ] {
        command.env_remove(name);
    }
    let mut child = command.spawn().expect("run cacheguard --check-config");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for cacheguard") {
            break status.code();
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let read =
        |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    (status, read(&out_path), read(&err_path))
}

/// What is wrong with one `--check-config` run on `text` at `path`, if anything.
fn bad_check(
    path: &Path,
    text: &[u8],
    status: Option<i32>,
    stdout: &str,
    stderr: &str,
) -> Option<String> {
    let shown = path.display().to_string();
    if status.is_none() {
        return Some(format!(
            "crashed or hung (no exit code); stderr: {}",
            show(stderr.as_bytes(), 300)
        ));
    }
    if stderr.contains("panicked") {
        return Some(format!("panicked: {}", show(stderr.as_bytes(), 300)));
    }
    match status {
        Some(0) => (stdout.trim_end() != format!("config OK: {shown}"))
            .then(|| format!("exit 0 but stdout {:?}", show(stdout.as_bytes(), 200))),
        Some(1) => {
            if stderr.trim().is_empty() {
                return Some("exit 1 with nothing on stderr".into());
            }
            let lines = line_count(text);
            let utf8 = std::str::from_utf8(text).is_ok();
            for line in stderr.lines() {
                let Some(rest) = line.strip_prefix(&format!("{shown}:")) else {
                    return Some(format!(
                        "a stderr line does not start with the file: {line:?}"
                    ));
                };
                if !utf8 && rest.starts_with(" cannot read: ") {
                    continue;
                }
                let (number, rest) = rest.split_once(": ").unwrap_or(("", rest));
                let Ok(number) = number.parse::<usize>() else {
                    return Some(format!("a stderr line has no line number: {line:?}"));
                };
                if number == 0 || number > lines + 1 {
                    return Some(format!(
                        "line {number} is outside the text's {lines} lines: {line:?}"
                    ));
                }
                match rest.split_once(": ") {
                    Some((key, message))
                        if !key.trim().is_empty() && !message.trim().is_empty() => {}
                    _ => {
                        return Some(format!(
                            "a stderr line is not `file:line: key: message`: {line:?}"
                        ));
                    }
                }
            }
            None
        }
        Some(code) => Some(format!(
            "exit {code} (documented: 0 or 1); stderr: {}",
            show(stderr.as_bytes(), 300)
        )),
        None => None,
    }
}

/// Values every `key = value` line of the documented config gets in turn (the sweep).
const EXTREMES: &[&str] = &[
    "\"18446744073709551615s\"",
    "\"99999999999999h\"",
    "\"0s\"",
    "18446744073709551615",
    "9223372036854775807",
    "-1",
    "0",
    "1e308",
    "nan",
    "\"\"",
];

/// Config case numbers from here on are the binary's: its specials, then random texts.
const BINARY_BASE: u64 = 1_000_000_000;

/// The sweep: `config/cacheguard.toml` with one `key = value` line (commented-out ones
/// uncommented) set to one of [`EXTREMES`], for every such line and value.
fn config_sweep(samples: &[(String, String)]) -> Vec<Vec<u8>> {
    let Some((_, text)) = samples.iter().find(|(p, _)| p.ends_with("cacheguard.toml")) else {
        return Vec::new();
    };
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let uncommented = line.strip_prefix("# ").unwrap_or(line);
        let Some((key, _)) = uncommented.split_once(" = ") else {
            continue;
        };
        if !key.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
            continue;
        }
        for value in EXTREMES {
            let mut copy: Vec<String> = lines.iter().map(|l| (*l).to_string()).collect();
            copy[i] = format!("{key} = {value}");
            out.push((copy.join("\n") + "\n").into_bytes());
        }
    }
    out
}

/// The text of config case `n`: the sweep first, then random/mutated texts; from
/// [`BINARY_BASE`] on, the binary's specials then more random texts. The family names it.
/// What config cases are made from.
struct ConfigInputs<'a> {
    samples: &'a [(String, String)],
    keys: &'a [String],
    sweep: &'a [Vec<u8>],
    specials: &'a [(&'static str, Vec<u8>)],
}

fn config_input(seed: u64, n: u64, inputs: &ConfigInputs<'_>) -> (&'static str, Vec<u8>) {
    if let Some(text) = usize::try_from(n).ok().and_then(|i| inputs.sweep.get(i)) {
        return ("sweep", text.clone());
    }
    if let Some((name, bytes)) = n
        .checked_sub(BINARY_BASE)
        .and_then(|i| usize::try_from(i).ok())
        .and_then(|i| inputs.specials.get(i))
    {
        return (name, bytes.clone());
    }
    let mut rng = Rng::for_case(seed, 2, n);
    ("random", config_case(&mut rng, inputs.samples, inputs.keys))
}

#[test]
fn config_loader_survives_arbitrary_text() {
    let settings = settings("config");
    let samples = config_samples();
    let keys = config_keys(&samples);
    let sweep = config_sweep(&samples);
    let specials = config_specials(&samples);
    let inputs = ConfigInputs {
        samples: &samples,
        keys: &keys,
        sweep: &sweep,
        specials: &specials,
    };
    let vars = HashMap::<String, String>::new();
    let started = std::time::Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut findings = Vec::new();
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    let mut problem_keys: BTreeMap<&str, u64> = BTreeMap::new();

    // 1. In process: the whole sweep, then random texts up to half the budget. Replaying one case
    //    below BINARY_BASE runs it here and in the binary.
    let in_process_budget = settings.budget / 2;
    let cases: Vec<u64> = match settings.only_case {
        Some(n) if n >= BINARY_BASE => Vec::new(),
        Some(n) => vec![n],
        None => (0..settings.max_cases.max(sweep.len() as u64)).collect(),
    };
    for n in cases {
        // The sweep runs whole (bounded by its count), random texts for the time left.
        if settings.only_case.is_none()
            && n >= sweep.len() as u64
            && started.elapsed() >= in_process_budget
        {
            break;
        }
        let (family, bytes) = config_input(settings.seed, n, &inputs);
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let lines = line_count(text.as_bytes());
        let finding = |what: String| Finding {
            family,
            rule: "Config::from_toml never panics; every problem is `file:line: key: message` \
                   on one line"
                .into(),
            what,
            n,
            bytes: text.clone().into_bytes(),
        };
        match catch_quiet(|| cacheguard::Config::from_toml(&text, "fuzz.toml", &vars)) {
            Err(panic) => {
                *counts.entry("in-process panicked").or_default() += 1;
                findings.push(finding(format!("panicked: {panic}")));
            }
            Ok(Ok(_)) => *counts.entry("in-process accepted").or_default() += 1,
            Ok(Err(error)) => {
                *counts.entry("in-process rejected").or_default() += 1;
                if error.problems.is_empty() {
                    findings.push(finding("rejected with no problem".into()));
                }
                for p in &error.problems {
                    let key = if p.key == "syntax" { "syntax" } else { "other" };
                    *problem_keys.entry(key).or_default() += 1;
                    if let Some(what) = bad_problem(p, "fuzz.toml", lines) {
                        findings.push(finding(what));
                    }
                }
            }
        }
        if settings.only_case.is_some() {
            println!(
                "config case {n} [{family}] in process: {counts:?}\n  text: {}",
                show(text.as_bytes(), 100_000)
            );
        }
    }
    let in_process_cases: u64 = counts.values().sum();

    // 2. The binary, for the rest of the budget and a bounded count: the specials first.
    let max_runs =
        ((settings.budget.as_secs_f64() * 40.0) as u64).clamp(specials.len() as u64 + 20, 20_000);
    let path = dir.path().join("fuzz.toml");
    let mut runs = 0u64;
    let binary_cases: Vec<u64> = match settings.only_case {
        Some(n) => vec![n],
        None => (BINARY_BASE..BINARY_BASE + max_runs).collect(),
    };
    for n in binary_cases {
        if settings.only_case.is_none()
            && n >= BINARY_BASE + specials.len() as u64
            && started.elapsed() >= settings.budget
        {
            break;
        }
        let (family, bytes) = config_input(settings.seed, n, &inputs);
        std::fs::write(&path, &bytes).expect("write the fuzz config");
        let (status, stdout, stderr) = check_config(&path, dir.path());
        runs += 1;
        let outcome = match status {
            Some(0) => "binary exit 0",
            Some(1) => "binary exit 1",
            _ => "binary other",
        };
        *counts.entry(outcome).or_default() += 1;
        if settings.only_case.is_some() {
            println!(
                "config case {n} [{family}] --check-config: exit {status:?}\n  stdout: {}\n  \
                 stderr: {}",
                show(stdout.as_bytes(), 2_000),
                show(stderr.as_bytes(), 2_000)
            );
        }
        if let Some(what) = bad_check(&path, &bytes, status, &stdout, &stderr) {
            findings.push(Finding {
                family,
                rule: "--check-config exits 0 or 1 without a panic; every error line is \
                       `file:line: key: message`"
                    .into(),
                what,
                n,
                bytes,
            });
        }
    }

    let mut out = format!(
        "fuzz config summary: {:.1}s, seed {:#x}, {in_process_cases} in process (sweep {}), \
         {runs} binary runs; ",
        started.elapsed().as_secs_f64(),
        settings.seed,
        sweep.len()
    );
    for (k, v) in &counts {
        let _ = write!(out, "{k}: {v}, ");
    }
    let _ = write!(out, "problems by key: {problem_keys:?}");
    println!("{out}");
    report_findings("config", settings.seed, &findings);
}
