//! The access log (`[access_log]`): one line per request, JSON or nginx `combined`, written
//! off the request path.
//!
//! - [`every_cache_outcome_is_logged_with_its_fields`]: MISS, HIT-L1, HIT-L2, NEGATIVE,
//!   STALE, REVALIDATED, REJECT and BYPASS (pass-through and per-user), in shared mode
//!   against a real redis-server, each line checked field by field.
//! - [`own_answers_are_logged_with_their_reason`]: 400, 405, 413, 414, 429, 431, 502, 503
//!   and 504, each with the reason cacheguard gave. (A 500 is only made when a fill task
//!   panics: not reachable from outside.)
//! - [`stock_gate_answers_are_logged_in_both_formats`]: a stock gate's sale, replay
//!   (`REPLAYED`), sold-out answers (`SOLDOUT`, from Redis or the ledger and from memory) and
//!   idempotency refusals, in JSON and combined, embedded and shared mode.
//! - [`a_serialized_write_is_logged_with_its_origin_time`].
//! - [`formats_parse_and_the_query_is_written_only_when_asked`].
//! - [`sampling_keeps_the_fraction_and_every_own_answer_and_5xx`].
//! - [`a_blocked_writer_never_slows_requests`]: the log is a FIFO nobody reads.
//! - [`a_reload_switches_the_format_and_reopens_the_file`]: off → json → combined,
//!   rotation by rename + reload, off again, a restart-only key, an unopenable file.
//! - [`a_client_cannot_break_a_line`]: quotes, backslashes, tabs and non-ASCII bytes from
//!   the client are escaped.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Method;
use serde_json::Value;
use tokio::io::AsyncReadExt;
use tokio::time::Instant;

use common::*;

/// Bound on waiting for lines to reach the file.
const LINES_TIMEOUT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(20);

/// `cfg` with the access log on, in `format`, to `path`.
fn logging(cfg: CgConfig, format: &str, path: &Path) -> CgConfig {
    cfg.set_str("access_log", "format", format).set_str(
        "access_log",
        "path",
        &path.display().to_string(),
    )
}

fn read_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The lines of `path` once `done` holds for them; panics with them after [`LINES_TIMEOUT`].
async fn wait_lines(path: &Path, what: &str, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    let found = poll_until(LINES_TIMEOUT, POLL, || async {
        let lines = read_lines(path);
        done(&lines).then_some(lines)
    })
    .await;
    found.unwrap_or_else(|| {
        panic!(
            "{}: {what} not there within {LINES_TIMEOUT:?}; lines:\n{}",
            path.display(),
            read_lines(path).join("\n")
        )
    })
}

fn json(line: &str) -> Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"))
}

/// The JSON lines of `lines` whose `path` is `path`.
fn json_for(lines: &[String], path: &str) -> Vec<Value> {
    lines
        .iter()
        .map(|l| json(l))
        .filter(|v| v["path"] == path)
        .collect()
}

/// Waits for `n` JSON lines for `path` in `file` and returns them.
async fn json_lines(file: &Path, path: &str, n: usize) -> Vec<Value> {
    let lines = wait_lines(file, &format!("{n} lines for {path}"), |lines| {
        json_for(lines, path).len() >= n
    })
    .await;
    json_for(&lines, path)
}

/// One line in nginx's combined format with cacheguard's fields after it.
#[derive(Debug)]
struct Combined {
    client: String,
    time: String,
    request: String,
    status: u16,
    bytes: u64,
    referer: String,
    user_agent: String,
    extra: HashMap<String, String>,
}

/// Parses a combined line: with every quote of a field escaped, splitting on `"` gives
/// exactly seven parts.
fn combined(line: &str) -> Combined {
    let parts: Vec<&str> = line.split('"').collect();
    assert_eq!(parts.len(), 7, "not a combined line: {line}");
    let head: Vec<&str> = parts[0].split_whitespace().collect();
    assert_eq!(head.len(), 5, "client, -, -, [date, zone]: {line}");
    assert_eq!((head[1], head[2]), ("-", "-"), "{line}");
    let status_bytes: Vec<&str> = parts[2].split_whitespace().collect();
    assert_eq!(status_bytes.len(), 2, "{line}");
    assert_eq!(parts[4], " ", "{line}");
    let extra = parts[6]
        .split_whitespace()
        .map(|pair| {
            let (k, v) = pair
                .split_once('=')
                .unwrap_or_else(|| panic!("{pair:?} is not key=value: {line}"));
            (k.to_owned(), v.to_owned())
        })
        .collect();
    Combined {
        client: head[0].to_owned(),
        time: format!("{} {}", head[3], head[4]),
        request: parts[1].to_owned(),
        status: status_bytes[0]
            .parse()
            .unwrap_or_else(|_| panic!("status: {line}")),
        bytes: status_bytes[1]
            .parse()
            .unwrap_or_else(|_| panic!("bytes: {line}")),
        referer: parts[3].to_owned(),
        user_agent: parts[5].to_owned(),
        extra,
    }
}

/// A combined-format `[27/Nov/2026:02:04:44 +0000]`.
fn is_clf_time(time: &str) -> bool {
    let b = time.as_bytes();
    time.len() == 28
        && b[0] == b'['
        && b[3] == b'/'
        && b[7] == b'/'
        && b[12] == b':'
        && time.ends_with(" +0000]")
}

/// Sends `bytes` on a new connection; returns the status of the answer (0 for none).
async fn raw(addr: SocketAddr, bytes: &[u8]) -> u16 {
    common::raw_bytes(addr, bytes, Duration::from_secs(5), false)
        .await
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

async fn lines_metric(client: &HttpClient, admin: SocketAddr, result: &str) -> f64 {
    metric(
        client,
        admin,
        "cacheguard_access_log_lines_total",
        &[("result", result)],
    )
    .await
}

// === outcomes ===

/// The routes of the outcome test: `item` keeps everything in L1, `l2` nothing; `stale`
/// expires after 1 s with 30 s of grace; `reval` follows the origin's headers (a copy past
/// them is fetched conditionally); `b` checks the Bloom filter `ids`.
fn outcome_routes() -> String {
    [
        item_route("l1 = \"all\""),
        route("l2", "/l2/{id}", "GET", "l1 = \"off\""),
        route(
            "stale",
            "/stale/{id}",
            "GET",
            "ttl = \"1s\"\njitter = 0.0\ngrace = \"30s\"",
        ),
        route(
            "reval",
            "/reval/{id}",
            "GET",
            "freshness = \"origin\"\nttl = \"1s\"\njitter = 0.0\ngrace = \"30s\"",
        ),
        route(
            "b",
            "/b/{id}",
            "GET",
            "bloom = { filter = \"ids\", param = \"id\" }",
        ),
        bloom_table("ids", 1000, 0.01, "10m", "{ url = \"/internal/ids\" }"),
    ]
    .concat()
}

/// One request's expected line.
struct Expect<'a> {
    status: u16,
    cache: &'a str,
    route: &'a str,
    /// Whether this request waited on the origin itself.
    origin: bool,
}

/// Every `X-Cache` outcome leaves a line with its status, outcome, route, the body bytes
/// sent, the origin time when (and only when) the request went to the origin, and no
/// reason (none is cacheguard's own answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cache_outcome_is_logged_with_its_fields() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::builder().ids(["1", "2"]).start().await;
    origin.set_status("/api/items/gone", 404);
    origin.set_headers(
        "/reval/1",
        [("Cache-Control", "max-age=1"), ("ETag", "\"v1\"")],
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("access.log");
    let cg = logging(
        CgConfig::new(&origin)
            .redis(&redis)
            .routes(&outcome_routes()),
        "json",
        &file,
    )
    .start()
    .await;
    let client = HttpClient::new();
    wait_metric(
        &client,
        cg.admin_addr(),
        "cacheguard_bloom_ready",
        &[("filter", "ids")],
        Duration::from_secs(20),
        POLL,
        |v| v == 1.0,
        no_poke,
    )
    .await;
    let get = |path: &str, headers: &[(&str, &str)]| {
        let (client, url) = (client.clone(), url(cg.addr(), path));
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        async move {
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            client.get_with_headers(&url, &headers).await
        }
    };
    let mut seen = Vec::new();
    let mut sent = |path: &'static str, r: Resp, expect: Expect<'static>| {
        assert_eq!(
            (r.status.as_u16(), r.x_cache().as_str()),
            (expect.status, expect.cache),
            "{path}: {r}"
        );
        seen.push((path, r.body.len() as u64, expect));
    };
    let miss = |route| Expect {
        status: 200,
        cache: "MISS",
        route,
        origin: true,
    };
    let cached = |cache, route| Expect {
        status: 200,
        cache,
        route,
        origin: false,
    };

    // The two whose second request must wait for their copies to age.
    sent("/stale/1", get("/stale/1", &[]).await, miss("stale"));
    sent("/reval/1", get("/reval/1", &[]).await, miss("reval"));
    let aged = Instant::now() + Duration::from_millis(1_300);
    sent("/api/items/1", get("/api/items/1", &[]).await, miss("item"));
    sent(
        "/api/items/1",
        get("/api/items/1", &[]).await,
        cached("HIT-L1", "item"),
    );
    sent("/l2/1", get("/l2/1", &[]).await, miss("l2"));
    sent("/l2/1", get("/l2/1", &[]).await, cached("HIT-L2", "l2"));
    let gone = |cache, origin| Expect {
        status: 404,
        cache,
        route: "item",
        origin,
    };
    sent(
        "/api/items/gone",
        get("/api/items/gone", &[]).await,
        gone("MISS", true),
    );
    sent(
        "/api/items/gone",
        get("/api/items/gone", &[]).await,
        gone("NEGATIVE", false),
    );
    sent(
        "/b/404404",
        get("/b/404404", &[]).await,
        Expect {
            status: 404,
            cache: "REJECT",
            route: "b",
            origin: false,
        },
    );
    let bypass = |route| Expect {
        status: 200,
        cache: "BYPASS",
        route,
        origin: true,
    };
    sent(
        "/other/x",
        get("/other/x", &[]).await,
        bypass("_passthrough"),
    );
    sent(
        "/api/items/mine",
        get("/api/items/mine", &[("authorization", "Bearer x")]).await,
        bypass("item"),
    );
    tokio::time::sleep_until(aged).await;
    sent(
        "/stale/1",
        get("/stale/1", &[]).await,
        cached("STALE", "stale"),
    );
    sent(
        "/reval/1",
        get("/reval/1", &[]).await,
        Expect {
            status: 200,
            cache: "REVALIDATED",
            route: "reval",
            origin: true,
        },
    );

    // Per path, the lines in the order the requests were made.
    let mut wrong = Vec::new();
    let mut by_path: HashMap<&str, Vec<(u64, Expect)>> = HashMap::new();
    for (path, bytes, expect) in seen {
        by_path.entry(path).or_default().push((bytes, expect));
    }
    for (path, expected) in &by_path {
        let lines = json_lines(&file, path, expected.len()).await;
        assert_eq!(lines.len(), expected.len(), "{path}: {lines:?}");
        for (line, (bytes, e)) in lines.iter().zip(expected) {
            let origin_us = line["origin_us"].as_u64();
            let total_us = line["total_us"].as_u64().unwrap_or(0);
            let ok = line["status"] == e.status
                && line["cache"] == e.cache
                && line["route"] == e.route
                && line["bytes"] == *bytes
                && line["reason"].is_null()
                && line["method"] == "GET"
                && line["protocol"] == "HTTP/1.1"
                && line["client"] == "127.0.0.1"
                && origin_us.is_some() == e.origin
                && origin_us.is_none_or(|o| o <= total_us)
                && total_us > 0;
            if !ok {
                wrong.push(format!(
                    "{path} ({} {}, origin {}): {line}",
                    e.status, e.cache, e.origin
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "lines not as expected:\n{}",
        wrong.join("\n")
    );
    let written = lines_metric(&client, cg.admin_addr(), "written").await;
    assert_eq!(written, read_lines(&file).len() as f64);
    assert_eq!(lines_metric(&client, cg.admin_addr(), "dropped").await, 0.0);
    cg.shutdown().await;
}

// === cacheguard's own answers ===

/// Every answer cacheguard makes itself is logged with its status, `BYPASS`, its route
/// (none for those refused before routing) and its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_answers_are_logged_with_their_reason() {
    let origin = TestOrigin::start().await;
    origin.set_delay("/slow-a", Duration::from_secs(3));
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("access.log");
    let routes = item_route("")
        + &route(
            "v",
            "/v/{id}",
            "GET",
            "max_variants = 1\nvariant_overflow_rate = 0",
        );
    let cg = logging(
        CgConfig::new(&origin)
            .set("server", "max_header_bytes", "8192")
            .set("server", "max_body_bytes", "1024")
            .set_str("upstream", "timeout", "500ms")
            .set("upstream", "max_concurrency", "1")
            .set_str("upstream", "queue_timeout", "100ms")
            .routes(&routes),
        "json",
        &file,
    )
    .start()
    .await;
    let addr = cg.addr();
    let client = HttpClient::new();

    // (path as logged, status, route, reason)
    let mut expected: Vec<(String, u16, Option<&str>, &str)> = Vec::new();
    assert_eq!(
        raw(
            addr,
            b"GET /api/items/nohost HTTP/1.1\r\nConnection: close\r\n\r\n"
        )
        .await,
        400
    );
    expected.push(("/api/items/nohost".into(), 400, None, "bad_request"));
    assert_eq!(
        raw(
            addr,
            b"TRACE /api/items/trace HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
        .await,
        405
    );
    expected.push(("/api/items/trace".into(), 405, None, "method_not_allowed"));
    assert_eq!(
        raw(
            addr,
            b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 2000\r\nConnection: close\r\n\r\n"
        )
        .await,
        413
    );
    expected.push(("/upload".into(), 413, None, "body_too_large"));
    let long = format!("/api/items/{}", "x".repeat(9000));
    let request = format!("GET {long} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n");
    assert_eq!(raw(addr, request.as_bytes()).await, 414);
    // Capped at 2048 bytes.
    expected.push((format!("{}...", &long[..2048]), 414, None, "uri_too_long"));
    let big = "h".repeat(12_000);
    let r = client
        .get_with_headers(&url(addr, "/api/items/big"), &[("x-big", big.as_str())])
        .await;
    assert_eq!(r.status, 431, "{r}");
    expected.push(("/api/items/big".into(), 431, None, "header_too_large"));
    assert_eq!(client.get(&url(addr, "/v/1?a=1")).await.status, 200);
    let r = client.get(&url(addr, "/v/1?a=2")).await;
    assert_eq!(r.status, 429, "{r}");
    expected.push(("/v/1".into(), 429, Some("v"), "too_many_variants"));
    // One origin slot: a slow request holds it past upstream.timeout (504); one arriving
    // meanwhile waits queue_timeout for it and is shed (503).
    let slow = client.spawn_get(&url(addr, "/slow-a"));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let r = client.get(&url(addr, "/slow-b")).await;
    assert_eq!(r.status, 503, "{r}");
    expected.push(("/slow-b".into(), 503, Some("_passthrough"), "shed"));
    let r = slow.await.expect("joined").expect("answered");
    assert_eq!(r.status, 504, "{r}");
    expected.push((
        "/slow-a".into(),
        504,
        Some("_passthrough"),
        "origin_timeout",
    ));

    // 502: an instance whose origin is not there.
    let dead_file = dir.path().join("dead.log");
    let dead = logging(
        CgConfig::with_upstream(&format!("http://127.0.0.1:{}", free_port())),
        "json",
        &dead_file,
    )
    .start()
    .await;
    let r = client.get(&url(dead.addr(), "/api/items/dead")).await;
    assert_eq!(r.status, 502, "{r}");
    let dead_line = json_lines(&dead_file, "/api/items/dead", 1).await;
    let l = &dead_line[0];
    assert_eq!(
        (&l["status"], &l["cache"], &l["route"], &l["reason"]),
        (
            &Value::from(502),
            &Value::from("BYPASS"),
            &Value::from("item"),
            &Value::from("origin_unreachable")
        ),
        "{l}"
    );
    assert!(
        l["origin_us"].is_u64(),
        "a failed connect is origin time: {l}"
    );
    dead.shutdown().await;

    let mut wrong = Vec::new();
    for (path, status, route, reason) in &expected {
        let lines: Vec<Value> = json_lines(&file, path, 1)
            .await
            .into_iter()
            .filter(|l| l["status"] == *status)
            .collect();
        let Some(l) = lines.first() else {
            wrong.push(format!("{status} {reason}: no line for {path}"));
            continue;
        };
        let route = route.map_or(Value::Null, Value::from);
        if lines.len() != 1
            || l["status"] != *status
            || l["reason"] != *reason
            || l["cache"] != "BYPASS"
            || l["route"] != route
            || l["bytes"].as_u64().is_none_or(|b| b == 0)
        {
            wrong.push(format!("{status} {reason}: {lines:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // The timeout waited on the origin; the shed request never reached it.
    let timed_out = &json_lines(&file, "/slow-a", 1).await[0];
    assert!(
        timed_out["origin_us"]
            .as_u64()
            .is_some_and(|us| us >= 400_000),
        "{timed_out}"
    );
    assert!(json_lines(&file, "/slow-b", 1).await[0]["origin_us"].is_null());
    cg.shutdown().await;
}

// === stock gates ===

/// One request of the sale and the line it must leave: status, `X-Cache` word, reason,
/// and whether the origin was asked.
struct SaleLine {
    status: u16,
    cache: &'static str,
    reason: Option<&'static str>,
    origin: bool,
}

/// The sale of one seat, as lines: the buy (the origin sells), its retry with the same key
/// (replayed), two buys without a key (sold out: by the ledger, then from this instance's
/// memory), the key with another body (422) and a key that is no key (400).
async fn sell_one_seat(client: &HttpClient, addr: SocketAddr) -> Vec<(SaleLine, u64)> {
    let target = url(addr, &orders("t1", "a"));
    let line = |status, cache, reason, origin| SaleLine {
        status,
        cache,
        reason,
        origin,
    };
    let requests = [
        (Some("k1"), "a", line(200, "BYPASS", None, true)),
        (Some("k1"), "a", line(200, "REPLAYED", None, false)),
        (None, "", line(409, "SOLDOUT", None, false)),
        (None, "", line(409, "SOLDOUT", None, false)),
        (
            Some("k1"),
            "b",
            line(422, "BYPASS", Some("idempotency_mismatch"), false),
        ),
        (
            Some("no key"),
            "",
            line(400, "BYPASS", Some("bad_idempotency_key"), false),
        ),
    ];
    let mut sent = Vec::new();
    for (key, body, expect) in requests {
        let headers: Vec<(&str, &str)> = key.map(|k| ("idempotency-key", k)).into_iter().collect();
        let r = post(client, &target, &headers, body).await;
        assert_eq!(
            (r.status.as_u16(), r.x_cache().as_str()),
            (expect.status, expect.cache),
            "{key:?} {body:?}: {r}"
        );
        sent.push((expect, r.body.len() as u64));
    }
    sent
}

/// A stock gate's answers are logged like every other: `SOLDOUT` with the gate's status
/// (409), `REPLAYED` with the first answer's (200), neither with origin time or a reason;
/// its idempotency refusals with theirs. In JSON and combined, in embedded mode (the
/// ledger in memory) and shared mode (in Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stock_gate_answers_are_logged_in_both_formats() {
    let redis = RedisServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let client = HttpClient::new();
    let path = orders("t1", "a");
    for shared in [false, true] {
        for format in ["json", "combined"] {
            let what = format!("{format}, shared {shared}");
            let origin = TestOrigin::start().await;
            set_seats(&origin, "t1", "a", 1);
            let file = dir.path().join(format!("{format}-{shared}.log"));
            let mut cfg =
                CgConfig::new(&origin).routes(&(buy_route("seats") + &stock_table("seats", "")));
            if shared {
                cfg = cfg
                    .redis(&redis)
                    .set_str("redis", "key_prefix", &format!("{format}:"));
            }
            let cg = logging(cfg, format, &file).start().await;
            let sent = sell_one_seat(&client, cg.addr()).await;
            assert_eq!(origin.seats("/trains/t1/seats/a"), Some(0), "{what}");
            let lines = wait_lines(&file, &format!("{} lines ({what})", sent.len()), |l| {
                l.len() >= sent.len()
            })
            .await;
            let mut wrong = Vec::new();
            for (line, (e, bytes)) in lines.iter().zip(&sent) {
                let ok = if format == "json" {
                    let l = json(line);
                    l["path"] == path.as_str()
                        && l["method"] == "POST"
                        && l["status"] == e.status
                        && l["cache"] == e.cache
                        && l["route"] == "buy"
                        && l["reason"] == e.reason.map_or(Value::Null, Value::from)
                        && l["bytes"] == *bytes
                        && l["origin_us"].is_u64() == e.origin
                } else {
                    let l = combined(line);
                    l.request == format!("POST {path} HTTP/1.1")
                        && l.status == e.status
                        && l.bytes == *bytes
                        && l.extra["cache"] == e.cache
                        && l.extra["route"] == "buy"
                        && l.extra["reason"] == e.reason.unwrap_or("-")
                        && (l.extra["ot"] != "-") == e.origin
                };
                if !ok {
                    wrong.push(format!("{} {}: {line}", e.status, e.cache));
                }
            }
            assert!(
                wrong.is_empty(),
                "{what}: lines not as expected:\n{}",
                wrong.join("\n")
            );
            cg.shutdown().await;
        }
    }
}

/// A serialized write is forwarded from a task of its own too (the resource's lock held
/// while it is at the origin): its line has the origin time, as every forwarded write's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialized_write_is_logged_with_its_origin_time() {
    let origin = TestOrigin::start().await;
    origin.set_delay("/things/1", Duration::from_millis(50));
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("access.log");
    let routes = route(
        "thing-write",
        "/things/{id}",
        "PUT",
        r#"serialize = { key = "/things/{id}", fence_header = "fencing-token" }"#,
    );
    let cg = logging(CgConfig::new(&origin).routes(&routes), "json", &file)
        .start()
        .await;
    let client = HttpClient::new();
    let r = put(&client, cg.addr(), "/things/1").await;
    assert_eq!(r.status, 200, "{r}");
    let line = &json_lines(&file, "/things/1", 1).await[0];
    assert_eq!(line["route"], "thing-write", "{line}");
    assert!(
        line["origin_us"].as_u64().is_some_and(|us| us >= 50_000),
        "a serialized write's line without its origin time: {line}"
    );
    cg.shutdown().await;
}

// === formats ===

/// JSON without the query, then (another instance) combined with it: every field is where
/// the format says, and the query appears only when `query = true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formats_parse_and_the_query_is_written_only_when_asked() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let client = HttpClient::new();
    let headers = [
        ("user-agent", "probe/1.0"),
        ("referer", "http://r.example/p"),
    ];

    let json_file = dir.path().join("json.log");
    let cg = logging(CgConfig::new(&origin), "json", &json_file)
        .start()
        .await;
    let r = client
        .get_with_headers(&url(cg.addr(), "/api/items/q?token=secret&b=2"), &headers)
        .await;
    assert_eq!(r.status, 200, "{r}");
    let lines = wait_lines(&json_file, "one line", |l| !l.is_empty()).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        !lines[0].contains("secret"),
        "the query was written: {}",
        lines[0]
    );
    let l = json(&lines[0]);
    let fields: Vec<&str> = l
        .as_object()
        .expect("an object")
        .keys()
        .map(String::as_str)
        .collect();
    let mut expected = vec![
        "bytes",
        "cache",
        "client",
        "method",
        "origin_us",
        "path",
        "protocol",
        "reason",
        "referer",
        "route",
        "status",
        "time",
        "total_us",
        "user_agent",
    ];
    expected.sort_unstable();
    let mut fields = fields;
    fields.sort_unstable();
    assert_eq!(fields, expected, "{l}");
    assert_eq!(l["path"], "/api/items/q");
    assert_eq!(l["user_agent"], "probe/1.0");
    assert_eq!(l["referer"], "http://r.example/p");
    assert_eq!(
        (&l["status"], &l["cache"]),
        (&Value::from(200), &Value::from("MISS"))
    );
    let time = l["time"].as_str().expect("time");
    // RFC 3339, UTC, milliseconds: 2026-11-27T02:04:44.123Z
    assert!(
        time.len() == 24 && time.as_bytes()[10] == b'T' && time.ends_with('Z'),
        "{time}"
    );
    cg.shutdown().await;

    let combined_file = dir.path().join("combined.log");
    let cg = logging(CgConfig::new(&origin), "combined", &combined_file)
        .set("access_log", "query", "true")
        .start()
        .await;
    let item = client
        .get_with_headers(&url(cg.addr(), "/api/items/q?token=secret&b=2"), &headers)
        .await;
    assert_eq!(item.x_cache(), "MISS", "{item}");
    let r = client.get(&url(cg.addr(), "/unrouted")).await;
    assert_eq!(r.status, 200, "{r}");
    let lines = wait_lines(&combined_file, "two lines", |l| l.len() >= 2).await;
    let first = combined(&lines[0]);
    assert_eq!(first.client, "127.0.0.1", "{}", lines[0]);
    assert!(is_clf_time(&first.time), "{}", lines[0]);
    assert_eq!(first.request, "GET /api/items/q?token=secret&b=2 HTTP/1.1");
    assert_eq!((first.status, first.bytes), (200, item.body.len() as u64));
    assert_eq!(first.extra["cache"], "MISS");
    assert_eq!(first.referer, "http://r.example/p");
    assert_eq!(first.user_agent, "probe/1.0");
    assert_eq!(first.extra["route"], "item");
    assert_eq!(first.extra["reason"], "-");
    assert!(
        first.extra["rt"].parse::<f64>().is_ok_and(|s| s > 0.0),
        "{}",
        lines[0]
    );
    let second = combined(&lines[1]);
    assert_eq!(second.request, "GET /unrouted HTTP/1.1");
    assert_eq!((second.status, second.bytes), (200, r.body.len() as u64));
    assert_eq!(
        (second.referer.as_str(), second.user_agent.as_str()),
        ("-", "-")
    );
    assert_eq!(
        (
            second.extra["cache"].as_str(),
            second.extra["route"].as_str()
        ),
        ("BYPASS", "_passthrough")
    );
    assert!(second.extra["ot"].parse::<f64>().is_ok(), "{}", lines[1]);
    let keys: Vec<&str> = {
        let mut k: Vec<&str> = second.extra.keys().map(String::as_str).collect();
        k.sort_unstable();
        k
    };
    assert_eq!(keys, ["cache", "ot", "reason", "route", "rt"]);
    cg.shutdown().await;
}

// === sampling ===

/// `sample = 0.1` over 1000 hits logs about 100 of them; cacheguard's own answers (405)
/// and the origin's 5xx are all logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_keeps_the_fraction_and_every_own_answer_and_5xx() {
    let origin = TestOrigin::start().await;
    origin.set_status("/fail", 500);
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("access.log");
    let cg = logging(CgConfig::new(&origin).l1("all"), "json", &file)
        .set("access_log", "sample", "0.1")
        .start()
        .await;
    let client = HttpClient::new();
    let (addr, hits) = (cg.addr(), 1000);
    assert_eq!(client.get(&url(addr, "/api/items/1")).await.status, 200);
    let answers = bounded_parallel(hits, 8, Duration::from_secs(60), |_| {
        let client = client.clone();
        async move { client.get(&url(addr, "/api/items/1")).await.status }
    })
    .await;
    assert!(answers.iter().all(|s| *s == 200), "a hit failed");
    // Always logged: made after every hit's line was queued, so once they are all in the
    // file, every sampled hit is too (one writer, in order).
    let purge = Method::from_bytes(b"PURGE").expect("method");
    for _ in 0..20 {
        let r = client
            .request(
                purge.clone(),
                &url(addr, "/nowhere"),
                &[],
                client::empty_body(),
            )
            .await
            .expect("PURGE");
        assert_eq!(r.status, 405, "{r}");
        assert_eq!(client.get(&url(addr, "/fail")).await.status, 500);
    }
    let lines = wait_lines(&file, "the 40 always-logged lines", |lines| {
        lines
            .iter()
            .filter(|l| l.contains("\"status\":405") || l.contains("\"status\":500"))
            .count()
            == 40
    })
    .await;
    let hits_logged = json_for(&lines, "/api/items/1")
        .iter()
        .filter(|l| l["cache"] == "HIT-L1")
        .count();
    // 100 expected; the bounds are 5 standard deviations (9.5) away.
    assert!(
        (52..=148).contains(&hits_logged),
        "sample 0.1 logged {hits_logged} of {hits} hits"
    );
    assert_eq!(
        json_for(&lines, "/nowhere")
            .iter()
            .filter(|l| l["reason"] == "method_not_allowed")
            .count(),
        20
    );
    assert_eq!(json_for(&lines, "/fail").len(), 20);
    cg.shutdown().await;
}

// === the bounded channel ===

/// The log is a FIFO that is opened for reading but not read: the writer blocks as soon
/// as the pipe is full. 2000 requests still finish at once, the lines that did not fit in
/// the channel are dropped and counted, and once the FIFO is read every line is accounted
/// for: written + dropped = requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_writer_never_slows_requests() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("access.fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("run mkfifo");
    assert!(made.success(), "mkfifo failed");
    // Opened for reading first (non-blocking), so cacheguard's open for writing succeeds.
    let mut reader = tokio::net::unix::pipe::OpenOptions::new()
        .open_receiver(&fifo)
        .expect("open the FIFO for reading");
    let cg = logging(CgConfig::new(&origin).l1("all"), "json", &fifo)
        .set("access_log", "buffer", "16")
        .start()
        .await;
    let (client, addr, n) = (HttpClient::new(), cg.addr(), 2000usize);
    assert_eq!(client.get(&url(addr, "/api/items/1")).await.status, 200);

    let started = Instant::now();
    let answers = bounded_parallel(n, 16, Duration::from_secs(60), |_| {
        let client = client.clone();
        async move { client.try_get(&url(addr, "/api/items/1")).await }
    })
    .await;
    let took = started.elapsed();
    let failed: Vec<String> = answers
        .iter()
        .filter_map(|r| match r {
            Ok(r) if r.status == 200 => None,
            Ok(r) => Some(r.to_string()),
            Err(e) => Some(e.clone()),
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} requests failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    // Blocked requests would never finish; 2000 L1 hits take a second or two here.
    assert!(
        took < Duration::from_secs(20),
        "{n} requests took {took:?} with a blocked log writer"
    );
    let dropped = lines_metric(&client, cg.admin_addr(), "dropped").await;
    assert!(
        dropped > 0.0,
        "nothing dropped: the writer was not blocked?"
    );

    // Now read the FIFO: the writer goes on, and every line is written or dropped.
    let mut read = Vec::new();
    let total = (n + 1) as f64;
    let deadline = Instant::now() + Duration::from_secs(20);
    let (written, dropped) = loop {
        let mut buf = [0u8; 64 * 1024];
        if let Ok(Ok(got)) =
            tokio::time::timeout(Duration::from_millis(100), reader.read(&mut buf)).await
        {
            read.extend_from_slice(&buf[..got]);
        }
        let written = lines_metric(&client, cg.admin_addr(), "written").await;
        let dropped = lines_metric(&client, cg.admin_addr(), "dropped").await;
        let lines = read.iter().filter(|b| **b == b'\n').count() as f64;
        if written + dropped == total && lines == written {
            break (written, dropped);
        }
        assert!(
            Instant::now() < deadline,
            "written {written} + dropped {dropped} != {total}, or {lines} lines read"
        );
    };
    assert!(
        written > 0.0 && dropped > 0.0,
        "written {written}, dropped {dropped}"
    );
    assert_eq!(lines_metric(&client, cg.admin_addr(), "failed").await, 0.0);
    for line in String::from_utf8(read).expect("ASCII").lines() {
        json(line);
    }
    cg.shutdown().await;
}

// === reload ===

/// Format off → json → combined; the file renamed away and a reload (logrotate's
/// `postrotate kill -HUP`) sends the next lines to a new file; off again writes nothing;
/// `buffer` needs a restart; an unopenable file keeps the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_switches_the_format_and_reopens_the_file() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("cacheguard.toml");
    let log = dir.path().join("access.log");
    let text = |format: &str, path: &Path, buffer: u32| {
        logging(CgConfig::new(&origin), format, path)
            .set("access_log", "buffer", &buffer.to_string())
            .toml()
    };
    std::fs::write(&config, text("off", &log, 64)).expect("write config");
    let cg = start_watching(&config).await;
    let client = HttpClient::new();
    let get = |n: u32| {
        let (client, url) = (client.clone(), url(cg.addr(), &format!("/api/items/r{n}")));
        async move { assert_eq!(client.get(&url).await.status, 200) }
    };
    let reload = |format: &'static str, path: PathBuf, buffer: u32| {
        let (config, text) = (config.clone(), text(format, &path, buffer));
        let cg = &cg;
        async move {
            replace_file(&config, &text);
            cg.reload().await
        }
    };
    let applied = Ok(cacheguard::reload::Reloaded::Applied);

    get(0).await;
    assert_eq!(reload("json", log.clone(), 64).await, applied);
    get(1).await;
    let lines = json_lines(&log, "/api/items/r1", 1).await;
    assert_eq!(lines[0]["status"], 200);
    assert_eq!(reload("combined", log.clone(), 64).await, applied);
    get(2).await;
    wait_lines(&log, "r2, combined", |l| {
        l.iter()
            .any(|l| l.contains("\"GET /api/items/r2 HTTP/1.1\" 200 "))
    })
    .await;

    // Rotation: rename, reload (what SIGHUP does), and the next line is in a new file.
    let rotated = dir.path().join("access.log.1");
    std::fs::rename(&log, &rotated).expect("rotate");
    assert_eq!(reload("combined", log.clone(), 64).await, applied);
    get(3).await;
    let fresh = wait_lines(&log, "r3 in the new file", |l| !l.is_empty()).await;
    assert_eq!(fresh.len(), 1, "{fresh:?}");
    assert!(fresh[0].contains("GET /api/items/r3 "), "{fresh:?}");
    let old = read_lines(&rotated);
    assert_eq!(old.len(), 2, "the file before rotation: {old:?}");
    assert!(
        old[0].starts_with('{') && old[0].contains("/api/items/r1"),
        "{old:?}"
    );
    assert!(old[1].contains("GET /api/items/r2 "), "{old:?}");

    // Off: r4 is not logged; on again, r5 is, right after r3.
    assert_eq!(reload("off", log.clone(), 64).await, applied);
    get(4).await;
    assert_eq!(reload("json", log.clone(), 64).await, applied);
    get(5).await;
    let lines = wait_lines(&log, "r5", |l| l.len() >= 2).await;
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(json(&lines[1])["path"], "/api/items/r5");
    assert!(
        !lines
            .iter()
            .chain(&old)
            .any(|l| l.contains("/api/items/r0") || l.contains("/api/items/r4")),
        "a request was logged while the log was off"
    );

    // `buffer` waits for a restart; the rest of the section applies.
    assert_eq!(
        reload("combined", log.clone(), 128).await,
        Ok(cacheguard::reload::Reloaded::Partial(vec![
            "access_log.buffer"
        ]))
    );
    get(6).await;
    wait_lines(&log, "r6, combined", |l| {
        l.iter()
            .any(|l| l.contains("\"GET /api/items/r6 HTTP/1.1\""))
    })
    .await;

    // A file that cannot be opened: the old file and format stay.
    let nowhere = dir.path().join("missing-dir").join("access.log");
    let result = reload("json", nowhere.clone(), 64).await;
    assert!(result.is_ok(), "the rest of the reload applies: {result:?}");
    get(7).await;
    wait_lines(&log, "r7, still combined in the old file", |l| {
        l.iter()
            .any(|l| l.contains("\"GET /api/items/r7 HTTP/1.1\""))
    })
    .await;
    assert!(!nowhere.exists());
    cg.shutdown().await;
}

/// A file that cannot be opened stops the start, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unopenable_file_stops_the_start() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("no-such-dir").join("access.log");
    let toml = logging(CgConfig::new(&origin), "json", &path).toml();
    let config =
        cacheguard::Config::from_toml(&toml, "test.toml", &HashMap::<String, String>::new())
            .expect("valid config");
    let error = match cacheguard::App::start(config).await {
        Ok(_) => panic!("started with an unopenable access log"),
        Err(error) => format!("{error:#}"),
    };
    assert!(
        error.contains(&format!("access_log.path {}", path.display())),
        "{error}"
    );
}

// === escaping ===

/// What a client sends — quotes, backslashes, a tab and bytes outside ASCII in its
/// headers and target — is escaped: each request stays one line, the combined format still
/// splits into its fields, and the JSON line parses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_break_a_line() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let combined_file = dir.path().join("combined.log");
    let json_file = dir.path().join("json.log");
    let sent = |addr: SocketAddr, target: &[u8]| {
        let mut request = b"GET ".to_vec();
        request.extend_from_slice(target);
        request.extend_from_slice(
            b" HTTP/1.1\r\nHost: a\r\nUser-Agent: x\" \"y\\z\t\xff\r\n\
              Referer: \"\r\nConnection: close\r\n\r\n",
        );
        async move { raw(addr, &request).await }
    };
    for (file, format) in [(&combined_file, "combined"), (&json_file, "json")] {
        let cg = logging(CgConfig::new(&origin), format, file)
            .set("access_log", "query", "true")
            .start()
            .await;
        // A quote (in the path) and a backslash are allowed in a target; bytes outside
        // ASCII get cacheguard's 400.
        assert_eq!(sent(cg.addr(), b"/api/items/a\"b\\c?q=\\1").await, 200);
        assert_eq!(sent(cg.addr(), b"/api/items/\xc3\xa9").await, 400);
        wait_lines(file, "two lines", |l| l.len() >= 2).await;
        cg.shutdown().await;
    }

    let raw_bytes = std::fs::read(&combined_file).expect("read");
    assert!(
        raw_bytes
            .iter()
            .all(|b| (0x20..0x7f).contains(b) || *b == b'\n'),
        "a byte outside printable ASCII: {raw_bytes:?}"
    );
    let lines = read_lines(&combined_file);
    assert_eq!(lines.len(), 2, "{lines:?}");
    let quoted = combined(&lines[0]);
    assert_eq!(
        quoted.request,
        "GET /api/items/a\\x22b\\x5Cc?q=\\x5C1 HTTP/1.1"
    );
    assert_eq!(quoted.user_agent, "x\\x22 \\x22y\\x5Cz\\x09\\xFF");
    assert_eq!(quoted.referer, "\\x22");
    let refused = combined(&lines[1]);
    assert_eq!(refused.request, "GET /api/items/\\xC3\\xA9 HTTP/1.1");
    assert_eq!(
        (refused.status, refused.extra["reason"].as_str()),
        (400, "bad_request")
    );

    let lines = read_lines(&json_file);
    assert_eq!(lines.len(), 2, "{lines:?}");
    let quoted = json(&lines[0]);
    assert_eq!(quoted["path"], "/api/items/a\\x22b\\x5Cc?q=\\x5C1");
    assert_eq!(quoted["user_agent"], "x\\x22 \\x22y\\x5Cz\\x09\\xFF");
    assert_eq!(json(&lines[1])["path"], "/api/items/\\xC3\\xA9");
}
