//! What cacheguard refuses instead of forwarding or storing: requests whose `Host`, method,
//! target or framing a hardened proxy rejects (RFC 9112 §3.2, §6; RFC 9110 §7.6.1), client
//! headers that would rewrite who or what the origin sees, and origin answers whose framing
//! cannot be trusted. Requests are raw bytes over a `TcpStream` where a client library would
//! not send them; origin answers come from a raw TCP origin where hyper would not write
//! them.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common;
use crate::common::{
    CgConfig, HttpClient, RawOrigin, RedisServer, TestOrigin, item_route, item_write_routes,
    raw_until_closed, route, status_of, url,
};

/// Sends `bytes` on a new connection and returns what came back within `wait` (the status
/// line first), or what there was when the connection closed.
async fn raw(addr: SocketAddr, bytes: &[u8], wait: Duration) -> String {
    raw_then(addr, bytes, wait, false).await
}

/// [`raw`], then, with `close`, the end of what this client sends (a half-close).
async fn raw_then(addr: SocketAddr, bytes: &[u8], wait: Duration, close: bool) -> String {
    common::raw_bytes(addr, bytes, wait, close).await
}

const WAIT: Duration = Duration::from_secs(5);

/// `Host` (RFC 9112 §3.2): no `Host` on HTTP/1.1, two `Host` lines, `Host: a b`,
/// `Host: good@evil` and an empty one each get 400 and reach the origin neither on a cached
/// route nor on pass-through; a valid one, and HTTP/1.0 without one, still work. Before,
/// each was answered 200, and on pass-through both `Host` lines reached the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_a_missing_repeated_or_invalid_host_are_refused() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let bad = [
        ("none", ""),
        ("two", "Host: a.example\r\nHost: b.example\r\n"),
        ("space", "Host: a b\r\n"),
        ("userinfo", "Host: good@evil\r\n"),
        ("empty", "Host: \r\n"),
    ];
    for prefix in ["/api/items/host", "/other/host"] {
        for (name, host) in bad {
            let path = format!("{prefix}-{name}");
            let request = format!("GET {path} HTTP/1.1\r\n{host}Connection: close\r\n\r\n");
            let answer = raw(cg.addr(), request.as_bytes(), WAIT).await;
            assert_eq!(status_of(&answer), 400, "{path}: {answer:?}");
            assert_eq!(origin.count(&path), 0, "{path} reached the origin");
        }
        let good = format!(
            "GET {prefix}-good HTTP/1.1\r\nHost: a.example:8080\r\nConnection: close\r\n\r\n"
        );
        assert_eq!(status_of(&raw(cg.addr(), good.as_bytes(), WAIT).await), 200);
        let old = format!("GET {prefix}-http10 HTTP/1.0\r\n\r\n");
        assert_eq!(status_of(&raw(cg.addr(), old.as_bytes(), WAIT).await), 200);
    }
    cg.shutdown().await;
}

/// `TRACE` and `CONNECT` get 405 with `Allow` on any path, cached route or not; `PURGE`
/// and `BAN` get 405 unless a route takes them. None reaches the origin. Before, all four
/// were proxied (`TRACE` reflecting what it was sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_connect_and_cache_methods_are_not_forwarded() {
    let origin = TestOrigin::start().await;
    let routes = format!(
        "{}{}",
        item_route(""),
        route("purge-taker", "/purgeable/{id}", "PURGE", "")
    );
    let cg = CgConfig::new(&origin).routes(&routes).start().await;
    for (method, target) in [
        ("TRACE", "/api/items/t1"),
        ("TRACE", "/other/t2"),
        ("CONNECT", "evil.example:443"),
        ("PURGE", "/api/items/p1"),
        ("BAN", "/other/b1"),
    ] {
        let request = format!(
            "{method} {target} HTTP/1.1\r\nHost: a.example\r\nX-Reflect: secret\r\nConnection: close\r\n\r\n"
        );
        let answer = raw(cg.addr(), request.as_bytes(), WAIT).await;
        assert_eq!(status_of(&answer), 405, "{method} {target}: {answer:?}");
        assert!(
            answer.to_ascii_lowercase().contains("\r\nallow: get, head"),
            "{method} {target}: no Allow: {answer:?}"
        );
    }
    assert_eq!(origin.total(), 0, "a refused method reached the origin");
    // A route that takes PURGE gets it.
    let request = "PURGE /purgeable/1 HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n";
    let answer = raw(cg.addr(), request.as_bytes(), WAIT).await;
    assert_eq!(status_of(&answer), 200, "{answer:?}");
    assert_eq!(origin.count("/purgeable/1"), 1);
    cg.shutdown().await;
}

/// `Connection` naming `Content-Length`, `Host` or `Transfer-Encoding` gets 400 (forwarded,
/// the proxy would drop the very header that frames or addresses the request); a target
/// longer than `max_header_bytes` gets 414 (it was 431). (Targets beyond the connection's
/// read buffer: `a_target_too_long_for_the_read_buffer_gets_414_not_431`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framing_headers_named_by_connection_and_huge_targets_are_refused() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set("server", "max_header_bytes", "200000")
        .start()
        .await;
    for named in ["Content-Length", "Host", "Transfer-Encoding"] {
        let path = format!("/other/conn-{named}");
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: a.example\r\nConnection: {named}\r\nContent-Length: 2\r\n\r\nhi"
        );
        let answer = raw(cg.addr(), request.as_bytes(), WAIT).await;
        assert_eq!(status_of(&answer), 400, "Connection: {named}: {answer:?}");
        assert_eq!(
            origin.count(&path),
            0,
            "Connection: {named} reached the origin"
        );
    }
    let cg_small = CgConfig::new(&origin).start().await;
    let long = format!(
        "GET /other/{} HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n",
        "a".repeat(20 * 1024)
    );
    let answer = raw(cg_small.addr(), long.as_bytes(), WAIT).await;
    assert_eq!(
        status_of(&answer),
        414,
        "{}",
        &answer[..answer.len().min(200)]
    );
    assert_eq!(origin.total(), 0);
    cg.shutdown().await;
    cg_small.shutdown().await;
}

/// On a write route the body is read whole before anything is forwarded or invalidated: a
/// malformed chunked body (a non-hex size, LF-only lines, a chunk cut short by the end of
/// the connection) gets 400, one over `max_body_bytes` 413 (at once when a chunk size says
/// so, as `FFFFFFFFFFFFFFED` does); the origin sees none of them and the cached entry is not
/// invalidated. On pass-through (streamed) a malformed body gets 400 and is counted.
/// Before, the head (and for the large one 10 MiB of body, and the write's first
/// invalidation) reached the origin, and the answer was 502 or came only at
/// `upstream.timeout`; later, the absurd chunk size waited for `upload_timeout` (408).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_whose_body_is_malformed_reaches_nothing() {
    let origin = TestOrigin::start().await;
    let redis = RedisServer::start().await;
    let routes = item_write_routes();
    for (mode, cfg) in [
        ("embedded", CgConfig::new(&origin)),
        ("shared", CgConfig::new(&origin).redis(&redis)),
    ] {
        let cg = cfg
            .routes(&routes)
            .set("server", "max_body_bytes", "65536")
            .set("upstream", "upload_timeout", "\"1s\"")
            .start()
            .await;
        let client = HttpClient::new();
        let cases: [(&str, String, bool, u16); 5] = [
            ("nonhex", "zz\r\nhello\r\n0\r\n\r\n".to_owned(), false, 400),
            ("short", "10\r\nhi\r\n".to_owned(), true, 400),
            ("lf-only", "5\nhello\n0\n\n".to_owned(), false, 400),
            (
                "huge-size",
                "FFFFFFFFFFFFFFED\r\nabc".to_owned(),
                false,
                413,
            ),
            (
                "too-large",
                format!("{:x}\r\n{}\r\n0\r\n\r\n", 70_000, "b".repeat(70_000)),
                false,
                413,
            ),
        ];
        for (name, body, close, expected) in cases {
            let path = format!("/api/items/{mode}-{name}");
            let cached = client.get(&url(cg.addr(), &path)).await;
            assert_eq!(cached.status, 200);
            let request = format!(
                "PUT {path} HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\n{body}"
            );
            let started = tokio::time::Instant::now();
            let answer = raw_then(cg.addr(), request.as_bytes(), WAIT, close).await;
            assert_eq!(status_of(&answer), expected, "{mode} {name}: {answer:?}");
            assert!(started.elapsed() < Duration::from_secs(4), "{mode} {name}");
            assert_eq!(
                origin.count(&path),
                1,
                "{mode} {name}: the PUT reached the origin"
            );
            let again = client.get(&url(cg.addr(), &path)).await;
            assert!(
                again.is_hit(),
                "{mode} {name}: the entry was invalidated: {again}"
            );
        }
        // Streamed pass-through: refused as it is read, counted.
        let request = "POST /other/bad-chunk HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n";
        let answer = raw(cg.addr(), request.as_bytes(), WAIT).await;
        assert_eq!(status_of(&answer), 400, "{mode} pass-through: {answer:?}");
        let counted = common::metric(
            &client,
            cg.admin_addr(),
            "cacheguard_rejected_requests_total",
            &[("reason", "bad_request_body")],
        )
        .await;
        assert!(counted >= 1.0, "{mode}: {counted} counted");
        cg.shutdown().await;
    }
}

/// Client headers that name another host, port, scheme, target or method for the origin
/// are dropped on pass-through and per-user (bypassed) requests, as on cached fetches.
/// Before, only `Forwarded`, `X-Forwarded-Host` and `X-Real-IP` were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_claims_about_target_and_method_never_reach_the_origin() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let claims = [
        ("X-Forwarded-Port", "1"),
        ("X-Forwarded-Server", "evil"),
        ("X-Forwarded-Scheme", "https"),
        ("X-Host", "evil.example"),
        ("X-Original-URL", "/admin"),
        ("X-Rewrite-URL", "/admin"),
        ("X-HTTP-Method-Override", "DELETE"),
        ("X-HTTP-Method", "DELETE"),
        ("X-Method-Override", "DELETE"),
    ];
    let client = HttpClient::new();
    for (path, extra) in [
        ("/other/claims", None),
        ("/api/items/claims", Some(("Cookie", "session=1"))),
    ] {
        let mut headers: Vec<(&str, &str)> = claims.to_vec();
        headers.extend(extra);
        let answer = client
            .request(
                http::Method::GET,
                &url(cg.addr(), path),
                &headers,
                common::client::empty_body(),
            )
            .await
            .expect("answer");
        assert_eq!(answer.status, 200, "{path}");
        let seen = origin.last_request(path).expect("forwarded");
        for (name, _) in claims {
            assert_eq!(seen.header(name), None, "{path}: {name} reached the origin");
        }
    }
    cg.shutdown().await;
}

/// An origin answer with both `Content-Length` and `Transfer-Encoding` (RFC 9112 §6.3), or
/// with more than 16 informational answers before its final one, gets 502 and is never
/// stored (each request asks the origin again), on a cached route (embedded and shared)
/// and on pass-through; a few `103 Early Hints` are fine. Before, both were accepted and
/// the first was stored with both headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_answers_with_untrustworthy_framing_are_refused() {
    let both = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\nCache-Control: max-age=60\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec();
    let hints = |n: usize| {
        let mut answer =
            b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n".repeat(n);
        answer.extend_from_slice(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nCache-Control: max-age=60\r\n\r\nok",
        );
        answer
    };
    let redis = RedisServer::start().await;
    let client = HttpClient::new();
    for (name, answer, refused) in [
        ("cl+te", both, true),
        ("1000 hints", hints(1000), true),
        ("3 hints", hints(3), false),
    ] {
        let origin = RawOrigin::start(answer).await;
        let upstream = origin.url();
        for (mode, cfg) in [
            ("embedded", CgConfig::with_upstream(&upstream)),
            ("shared", CgConfig::with_upstream(&upstream).redis(&redis)),
        ] {
            let cg = cfg.start().await;
            let before = origin.requests();
            let path = format!("/api/items/{}-{mode}", name.replace(' ', "-"));
            let mut statuses = Vec::new();
            for _ in 0..2 {
                statuses.push(client.get(&url(cg.addr(), &path)).await.status.as_u16());
            }
            statuses.push(
                client
                    .get(&url(cg.addr(), "/other/x"))
                    .await
                    .status
                    .as_u16(),
            );
            let asked = origin.requests() - before;
            if refused {
                assert_eq!(statuses, [502, 502, 502], "{name}, {mode}");
                assert_eq!(asked, 3, "{name}, {mode}: a refused answer was stored");
            } else {
                assert_eq!(statuses, [200, 200, 200], "{name}, {mode}");
                assert_eq!(asked, 2, "{name}, {mode}: the good answer was not stored");
            }
            cg.shutdown().await;
        }
    }
}

/// `GET {path}` with `Host` and `fields - 1` more header fields: `fields` in all.
fn request_with_fields(path: &str, fields: usize) -> String {
    let mut request = format!("GET {path} HTTP/1.1\r\nHost: a.example\r\n");
    for i in 1..fields {
        request.push_str(&format!("X-Field-{i}: {i}\r\n"));
    }
    request.push_str("\r\n");
    request
}

/// `server.max_headers` counts header fields: with 20, a head of 30 fields gets 431 (with a
/// short body) and reaches the origin neither on a cached route nor on pass-through; one of
/// 15 is served. Before, hyper's default of 100 applied whatever the file said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_header_fields_than_max_headers_get_431() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set("server", "max_headers", "20")
        .start()
        .await;
    for prefix in ["/api/items/fields", "/other/fields"] {
        let many = format!("{prefix}-30");
        let answer = raw(cg.addr(), request_with_fields(&many, 30).as_bytes(), WAIT).await;
        assert_eq!(status_of(&answer), 431, "{many}: {answer:?}");
        assert_eq!(origin.count(&many), 0, "{many} reached the origin");
        let few = format!("{prefix}-15");
        let answer = raw(cg.addr(), request_with_fields(&few, 15).as_bytes(), WAIT).await;
        assert_eq!(status_of(&answer), 200, "{few}: {answer:?}");
        assert_eq!(origin.count(&few), 1, "{few}");
    }
    cg.shutdown().await;
}

/// Sends `bytes` on a new connection and returns everything that came back until the
/// server closed it (or `wait` passed).
async fn raw_all(addr: SocketAddr, bytes: &[u8], wait: Duration) -> String {
    raw_until_closed(addr, bytes, wait).await.0
}

/// The body of a whole answer (after its head).
fn body_of(answer: &str) -> &str {
    answer.split_once("\r\n\r\n").map_or("", |(_, body)| body)
}

/// A request target longer than the connection's read buffer (twice `max_header_bytes`),
/// 100 KiB or 1 MiB with the default 16 KiB, gets 414 with cacheguard's short body, as one
/// that fits does, and reaches the origin neither on a cached route nor on pass-through.
/// Heads too large for other reasons still get 431, now with a short body too: 8 KiB of
/// header fields over `max_header_bytes` (refused by cacheguard), 100 KiB of them or one
/// 100 KiB field (beyond the read buffer: refused by hyper), more fields than
/// `max_headers`. Before, the long target got hyper's bare 431.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_too_long_for_the_read_buffer_gets_414_not_431() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set("server", "max_headers", "50")
        .start()
        .await;
    for prefix in ["/api/items/", "/other/"] {
        for len in [100 * 1024, 1024 * 1024] {
            let request = format!(
                "GET {prefix}{} HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n",
                "a".repeat(len)
            );
            let answer = raw_all(cg.addr(), request.as_bytes(), WAIT).await;
            let shown = &answer[..answer.len().min(300)];
            assert_eq!(status_of(&answer), 414, "{prefix}: {len}: {shown:?}");
            assert_eq!(
                body_of(&answer),
                "cacheguard: request target too long (limit 16384 bytes)\n",
                "{prefix}: {len}: {shown}"
            );
        }
        // Also on a connection that served a request before.
        let first = format!("GET {prefix}first HTTP/1.1\r\nHost: a.example\r\n\r\n");
        let long = format!(
            "{first}GET {prefix}{} HTTP/1.1\r\nHost: a.example\r\n\r\n",
            "b".repeat(100 * 1024)
        );
        let answer = raw_all(cg.addr(), long.as_bytes(), WAIT).await;
        assert!(
            answer.starts_with("HTTP/1.1 200 ")
                && answer.contains("}HTTP/1.1 414 URI Too Long\r\n")
                && answer
                    .ends_with("\r\n\r\ncacheguard: request target too long (limit 16384 bytes)\n"),
            "{prefix}: {:?}",
            &answer[..answer.len().min(600)]
        );
    }
    assert_eq!(
        origin.total(),
        2,
        "only the two requests before a long target reached the origin"
    );

    let field = |i: usize, len: usize| format!("X-Pad-{i}: {}\r\n", "p".repeat(len));
    let over_by_8k: String = (0..24).map(|i| field(i, 1000)).collect();
    let beyond_buffer: String = (0..40).map(|i| field(i, 2500)).collect();
    let one_huge = field(0, 100 * 1024);
    let too_many: String = (0..60).map(|i| field(i, 1)).collect();
    for (name, fields, body) in [
        (
            "8 KiB over",
            over_by_8k,
            "cacheguard: request header fields too large (limit 16384 bytes)\n",
        ),
        (
            "100 KiB of fields",
            beyond_buffer,
            "cacheguard: request header fields too large (limits 16384 bytes, 50 fields)\n",
        ),
        (
            "one 100 KiB field",
            one_huge,
            "cacheguard: request header fields too large (limits 16384 bytes, 50 fields)\n",
        ),
        (
            "60 fields",
            too_many,
            "cacheguard: request header fields too large (limits 16384 bytes, 50 fields)\n",
        ),
    ] {
        let request = format!(
            "GET /api/items/big-head HTTP/1.1\r\nHost: a.example\r\n{fields}Connection: close\r\n\r\n"
        );
        let answer = raw_all(cg.addr(), request.as_bytes(), WAIT).await;
        let shown = &answer[..answer.len().min(300)];
        assert_eq!(status_of(&answer), 431, "{name}: {shown}");
        assert_eq!(body_of(&answer), body, "{name}: {shown}");
    }
    assert_eq!(origin.total(), 2, "a refused head reached the origin");
    cg.shutdown().await;
}

/// A route's `forward_client_headers` lets the client forwarding headers it names through
/// to the origin as sent, for the requests that route takes: a cached fetch (where the
/// header is keyed, so each value gets its own entry), a per-user bypass and a write. Other
/// forwarding headers on the same requests, the same header on another route and on
/// unrouted paths are still dropped. Before, every one of them was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_forwards_the_client_headers_it_names_and_no_other() {
    let origin = TestOrigin::start().await;
    let routes = format!(
        "{}{}{}",
        item_route(
            "vary = [\"x-forwarded-prefix\"]\nforward_client_headers = [\"X-Forwarded-Prefix\"]"
        ),
        route(
            "item-write",
            "/api/items/{id}",
            "PUT",
            "forward_client_headers = [\"x-forwarded-prefix\"]"
        ),
        route(
            "plain",
            "/plain/{id}",
            "GET",
            "vary = [\"x-forwarded-prefix\"]"
        )
    );
    let cg = CgConfig::new(&origin).routes(&routes).start().await;
    let client = HttpClient::new();
    let send = |method: http::Method, path: &'static str, prefix: &'static str, extra| {
        let client = client.clone();
        let addr = cg.addr();
        async move {
            let mut headers = vec![
                ("x-forwarded-prefix", prefix),
                ("x-forwarded-host", "evil.example"),
            ];
            headers.extend(extra);
            let body = if method == http::Method::PUT {
                common::client::full_body("x")
            } else {
                common::client::empty_body()
            };
            let answer = client
                .request(method, &url(addr, path), &headers, body)
                .await
                .expect("answer");
            assert_eq!(answer.status, 200, "{path}: {answer}");
            answer
        }
    };
    let seen = |path: &str| {
        let request = origin.last_request(path).expect("forwarded");
        (
            request.header("x-forwarded-prefix"),
            request.header("x-forwarded-host"),
        )
    };
    let shop = (Some("/shop".to_owned()), None);

    // Cached: forwarded and keyed.
    let first = send(http::Method::GET, "/api/items/1", "/shop", None).await;
    assert_eq!(first.x_cache(), "MISS");
    assert_eq!(seen("/api/items/1"), shop);
    let again = send(http::Method::GET, "/api/items/1", "/shop", None).await;
    assert!(again.is_hit(), "{again}");
    let other = send(http::Method::GET, "/api/items/1", "/admin", None).await;
    assert_eq!(other.x_cache(), "MISS", "another value, another entry");
    assert_eq!(seen("/api/items/1"), (Some("/admin".to_owned()), None));
    assert_eq!(origin.count("/api/items/1"), 2);
    // Bypassed (per user) and written: forwarded.
    send(
        http::Method::GET,
        "/api/items/2",
        "/shop",
        Some(("cookie", "session=1")),
    )
    .await;
    assert_eq!(seen("/api/items/2"), shop);
    send(http::Method::PUT, "/api/items/3", "/shop", None).await;
    assert_eq!(seen("/api/items/3"), shop);
    // Another route (which keys it but does not name it), and no route: dropped.
    send(http::Method::GET, "/plain/1", "/shop", None).await;
    assert_eq!(seen("/plain/1"), (None, None));
    send(http::Method::GET, "/other/1", "/shop", None).await;
    assert_eq!(seen("/other/1"), (None, None));
    cg.shutdown().await;
}

/// After a 400 that leaves the request's framing or target in doubt — `Connection` naming
/// `Host`, `Content-Length` or `Transfer-Encoding`, two `Host` lines, a broken chunked body
/// on a write — the answer says `Connection: close` and the connection is closed: a request
/// pipelined behind it on the same connection is never served. Before, the pipelined
/// request reached the origin and was answered on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_for_its_framing_closes_its_connection() {
    let origin = TestOrigin::start().await;
    let routes = format!(
        "{}{}",
        item_route(""),
        route("item-write", "/api/items/{id}", "PUT", "")
    );
    let cg = CgConfig::new(&origin).routes(&routes).start().await;
    let cases = [
        (
            "conn-host",
            "POST /other/f HTTP/1.1\r\nHost: a.example\r\nConnection: Host\r\nContent-Length: 2\r\n\r\nhi",
        ),
        (
            "conn-length",
            "POST /other/f HTTP/1.1\r\nHost: a.example\r\nConnection: Content-Length\r\nContent-Length: 2\r\n\r\nhi",
        ),
        (
            "conn-te",
            "POST /other/f HTTP/1.1\r\nHost: a.example\r\nConnection: Transfer-Encoding\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
        ),
        (
            "conn-get",
            "GET /api/items/f HTTP/1.1\r\nHost: a.example\r\nConnection: keep-alive, Host\r\n\r\n",
        ),
        (
            "two-hosts",
            "GET /other/f HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\n\r\n",
        ),
        (
            "bad-chunk",
            "PUT /api/items/f HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        ),
    ];
    for (name, first) in cases {
        let behind = format!("/other/pipelined-{name}");
        let bytes = format!("{first}GET {behind} HTTP/1.1\r\nHost: a.example\r\n\r\n");
        let (answer, closed) = raw_until_closed(cg.addr(), bytes.as_bytes(), WAIT).await;
        assert_eq!(status_of(&answer), 400, "{name}: {answer:?}");
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("\r\nconnection: close\r\n"),
            "{name}: no Connection: close: {answer:?}"
        );
        assert_eq!(
            answer.matches("HTTP/1.1 ").count(),
            1,
            "{name}: the pipelined request was answered: {answer:?}"
        );
        assert!(closed, "{name}: the connection stayed open");
        assert_eq!(
            origin.count(&behind),
            0,
            "{name}: the pipelined request was served"
        );
    }
    // An answer that leaves the framing sound keeps the connection: both are served.
    let bytes = "GET /other/k1 HTTP/1.1\r\nHost: a.example\r\n\r\nGET /other/k2 HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n";
    let (answer, _) = raw_until_closed(cg.addr(), bytes.as_bytes(), WAIT).await;
    assert_eq!(answer.matches("HTTP/1.1 200").count(), 2, "{answer:?}");
    cg.shutdown().await;
}

/// A chunked body whose chunk sizes declare more than `server.max_body_bytes` — one
/// absurd size (`FFFFFFFFFFFFFFED`), one over 64 bits, one just over the limit, or a second
/// chunk that takes the total over it — gets 413 as soon as the size line arrives, on a
/// write route (nothing forwarded, nothing invalidated) and on pass-through, and the
/// connection is closed. A body exactly at the limit, and a `Content-Length` body whose
/// bytes look like a chunk size, still go through. Before, the absurd sizes waited for
/// `upload_timeout` (408; 400 for the overflow) and the others were 413 only once the
/// bytes had come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_size_over_the_body_limit_gets_413_at_once() {
    let origin = TestOrigin::start().await;
    let redis = RedisServer::start().await;
    let routes = item_write_routes();
    let at_limit = format!("{:x}\r\n{}\r\n0\r\n\r\n", 65_536, "a".repeat(65_536));
    let cases: [(&str, String, u16); 6] = [
        ("absurd", "FFFFFFFFFFFFFFED\r\nabc".to_owned(), 413),
        ("overflow", "1FFFFFFFFFFFFFFFF\r\nabc".to_owned(), 413),
        ("over-limit", format!("{:x}\r\nabc", 65_537), 413),
        ("second", "5\r\nhello\r\nFFFF\r\nabc".to_owned(), 413),
        ("extension", "FFFFFFFFFF;name=value\r\nabc".to_owned(), 413),
        ("at-limit", at_limit, 200),
    ];
    for (mode, cfg) in [
        ("embedded", CgConfig::new(&origin)),
        ("shared", CgConfig::new(&origin).redis(&redis)),
    ] {
        let cg = cfg
            .routes(&routes)
            .set("server", "max_body_bytes", "65536")
            .set("upstream", "upload_timeout", "\"5s\"")
            .start()
            .await;
        let client = HttpClient::new();
        for (name, body, expected) in &cases {
            for path in [
                format!("/api/items/{mode}-{name}"),
                format!("/other/{mode}-{name}"),
            ] {
                let written = path.starts_with("/api/");
                if written {
                    assert_eq!(client.get(&url(cg.addr(), &path)).await.status, 200);
                }
                let method = if written { "PUT" } else { "POST" };
                let request = format!(
                    "{method} {path} HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\n\r\n{body}"
                );
                let started = tokio::time::Instant::now();
                let (answer, closed) = if *expected == 200 {
                    let answer = raw(cg.addr(), request.as_bytes(), WAIT).await;
                    (answer, true)
                } else {
                    raw_until_closed(cg.addr(), request.as_bytes(), WAIT).await
                };
                assert_eq!(status_of(&answer), *expected, "{path}: {answer:?}");
                if *expected != 413 {
                    continue;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(2),
                    "{path}: answered after {:?}",
                    started.elapsed()
                );
                assert!(closed, "{path}: the connection stayed open");
                if written {
                    assert_eq!(origin.count(&path), 1, "{path}: the PUT reached the origin");
                    let again = client.get(&url(cg.addr(), &path)).await;
                    assert!(again.is_hit(), "{path}: invalidated: {again}");
                }
            }
        }
        // Bytes of a Content-Length body that read like a chunk size, then a request
        // pipelined behind it: both served.
        let bytes = "PUT /api/items/look-alike HTTP/1.1\r\nHost: a.example\r\nContent-Length: 10\r\n\r\nFFFFFFFF\r\n\
                     POST /other/after HTTP/1.1\r\nHost: a.example\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n2\r\nhi\r\n0\r\n\r\n";
        let (answer, _) = raw_until_closed(cg.addr(), bytes.as_bytes(), WAIT).await;
        assert_eq!(
            answer.matches("HTTP/1.1 200").count(),
            2,
            "{mode}: {answer:?}"
        );
        cg.shutdown().await;
    }
}

/// Every method-override header — `X-HTTP-Method-Override`, `X-HTTP-Method`,
/// `X-Method-Override` and `X-Original-Method` — is dropped on every path: a fill (in both
/// freshness modes), a per-user bypass, a write, an unrouted request and an unsafe method
/// on a cached path that no write route takes. Before, `X-Original-Method` reached the
/// origin on all but the default-mode fill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_overrides_never_reach_the_origin_on_any_path() {
    let origin = TestOrigin::start().await;
    let routes = format!(
        "{}{}{}",
        item_route(""),
        route("fresh", "/fresh/{id}", "GET", "freshness = \"origin\""),
        route("item-write", "/api/items/{id}", "PUT", "")
    );
    let cg = CgConfig::new(&origin).routes(&routes).start().await;
    let overrides = [
        ("X-HTTP-Method-Override", "DELETE"),
        ("X-HTTP-Method", "DELETE"),
        ("X-Method-Override", "DELETE"),
        ("X-Original-Method", "DELETE"),
    ];
    let client = HttpClient::new();
    let cases = [
        ("fill", http::Method::GET, "/api/items/ov-fill", None),
        ("origin-mode fill", http::Method::GET, "/fresh/ov", None),
        (
            "bypass",
            http::Method::GET,
            "/api/items/ov-bypass",
            Some(("Cookie", "session=1")),
        ),
        ("write", http::Method::PUT, "/api/items/ov-write", None),
        ("unrouted", http::Method::GET, "/other/ov", None),
        (
            "unrouted upload",
            http::Method::POST,
            "/other/ov-post",
            None,
        ),
        (
            "unsafe on a cached path",
            http::Method::DELETE,
            "/api/items/ov-del",
            None,
        ),
    ];
    for (name, method, path, extra) in cases {
        let mut headers: Vec<(&str, &str)> = overrides.to_vec();
        headers.extend(extra);
        let body = if method == http::Method::GET {
            common::client::empty_body()
        } else {
            common::client::full_body("x")
        };
        let answer = client
            .request(method, &url(cg.addr(), path), &headers, body)
            .await
            .expect("answer");
        assert_eq!(answer.status, 200, "{name}: {answer}");
        let seen = origin.last_request(path).expect("forwarded");
        for (header, _) in overrides {
            assert_eq!(
                seen.header(header),
                None,
                "{name}: {header} reached the origin"
            );
        }
    }
    cg.shutdown().await;
}

/// A method longer than 32 bytes (300 bytes here) gets 400 with a short body and
/// `Connection: close`, on a cached path and on pass-through; the connection is closed (a
/// request pipelined behind it is never read), the origin sees nothing, and the refusal is
/// counted with the other 400s. An extension method of exactly 32 bytes is still forwarded.
/// Before, the 300-byte method reached the origin and the connection stayed open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlong_method_gets_400_and_closes_the_connection() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    let refused = || {
        common::metric(
            &client,
            cg.admin_addr(),
            "cacheguard_rejected_requests_total",
            &[("reason", "bad_request")],
        )
    };
    let long = "M".repeat(300);
    for prefix in ["/api/items/", "/other/"] {
        let path = format!("{prefix}long-method");
        let behind = format!("{prefix}behind-long-method");
        let before = refused().await;
        let bytes = format!(
            "{long} {path} HTTP/1.1\r\nHost: a.example\r\n\r\nGET {behind} HTTP/1.1\r\nHost: a.example\r\n\r\n"
        );
        let (answer, closed) = raw_until_closed(cg.addr(), bytes.as_bytes(), WAIT).await;
        assert_eq!(status_of(&answer), 400, "{path}: {answer:?}");
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("\r\nconnection: close\r\n"),
            "{path}: no Connection: close: {answer:?}"
        );
        assert!(
            body_of(&answer).starts_with("cacheguard: ") && body_of(&answer).len() < 200,
            "{path}: {answer:?}"
        );
        assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{path}: {answer:?}");
        assert!(closed, "{path}: the connection stayed open");
        assert_eq!(
            origin.count(&path),
            0,
            "{path}: the method reached the origin"
        );
        assert_eq!(
            origin.count(&behind),
            0,
            "{path}: the pipelined request was served"
        );
        assert_eq!(refused().await, before + 1.0, "{path}: not counted");
    }
    // At the bound: forwarded (pass-through), as any extension method.
    let method = "X-EXTENSION-METHOD-OF-32-BYTES-Z";
    assert_eq!(method.len(), 32);
    let path = "/other/bound-method";
    let bytes = format!("{method} {path} HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n");
    let (answer, _) = raw_until_closed(cg.addr(), bytes.as_bytes(), WAIT).await;
    assert_ne!(status_of(&answer), 400, "{answer:?}");
    assert_eq!(origin.count(path), 1, "{answer:?}");
    let seen = origin.last_request(path).expect("forwarded");
    assert_eq!(seen.method.as_str(), method);
    cg.shutdown().await;
}

/// An origin connection whose answer had untrustworthy framing never carries another
/// request: after each such answer — both `Content-Length` and `Transfer-Encoding`, two
/// different `Content-Length` values, a chunk size that is no number, a `Transfer-Encoding`
/// whose last coding is not `chunked`, more than 16 informational answers arriving with the
/// final one, bytes after the declared end, a body cut short with the connection left open
/// — the next request reaches the origin on a new connection, on a cached route and on
/// pass-through. A sound answer's connection is reused (which shows the test can tell).
/// Before, a refused answer whose bytes were all read left its connection in the pool: the
/// request after it went out on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_connection_is_never_reused_after_a_framing_fault() {
    let head = |fields: &str, body: &str| {
        format!("HTTP/1.1 200 OK\r\nCache-Control: max-age=60\r\n{fields}\r\n{body}").into_bytes()
    };
    let mut hints = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n".repeat(17);
    hints.extend_from_slice(&head("Content-Length: 2\r\n", "ok"));
    // (name, answer, whether pass-through is asked too — a body cut short on pass-through
    // streams to the client until the origin closes —, whether every answer is a 502)
    let faults = [
        (
            "cl+te",
            head(
                "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                "5\r\nhello\r\n0\r\n\r\n",
            ),
            true,
            true,
        ),
        (
            "two-lengths",
            head("Content-Length: 5\r\nContent-Length: 6\r\n", "hello"),
            true,
            true,
        ),
        (
            "bad-chunk",
            head("Transfer-Encoding: chunked\r\n", "zz\r\nhello\r\n0\r\n\r\n"),
            true,
            false,
        ),
        // No fault in an answer (RFC 9112 §6.3 (3)): its body runs to the connection's
        // close, so the connection ends with it; this origin never closes, so the answer
        // is cut off by the upstream timeout.
        (
            "te-not-chunked",
            head("Transfer-Encoding: gzip\r\n", "hello"),
            false,
            false,
        ),
        ("17-hints", hints, true, true),
        (
            "bytes-after-the-end",
            head(
                "Content-Length: 5\r\n",
                "helloHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nevil",
            ),
            true,
            false,
        ),
        (
            "cut-short",
            head("Content-Length: 10\r\n", "hello"),
            false,
            false,
        ),
    ];
    let client = HttpClient::new();
    let get = |addr: SocketAddr, path: String| {
        let client = client.clone();
        async move {
            // 0: no answer in time, or one cut off (a streamed body that broke).
            match tokio::time::timeout(WAIT, client.try_get(&url(addr, &path))).await {
                Ok(Ok(r)) => r.status.as_u16(),
                _ => 0,
            }
        }
    };

    // A sound answer: its connection carries the next request.
    let origin = RawOrigin::start(head("Content-Length: 2\r\n", "ok")).await;
    let cg = CgConfig::with_upstream(&origin.url()).start().await;
    for path in ["/api/items/sound-1", "/api/items/sound-2", "/other/sound-3"] {
        assert_eq!(get(cg.addr(), path.to_owned()).await, 200, "{path}");
    }
    let per_connection = origin.per_connection();
    assert!(
        per_connection.iter().any(|&n| n > 1),
        "sound answers' connections were not reused: {per_connection:?}"
    );
    cg.shutdown().await;

    let (mut reused, mut not_502) = (Vec::new(), Vec::new());
    for (name, answer, passthrough, refused) in faults {
        let origin = RawOrigin::start(answer).await;
        let cg = CgConfig::with_upstream(&origin.url())
            .set_str("upstream", "timeout", "1s")
            .start()
            .await;
        let mut paths = vec![
            format!("/api/items/{name}-1"),
            format!("/api/items/{name}-2"),
        ];
        if passthrough {
            paths.push(format!("/other/{name}-3"));
            paths.push(format!("/api/items/{name}-4"));
        }
        let mut statuses = Vec::new();
        for path in paths {
            statuses.push(get(cg.addr(), path).await);
        }
        let per_connection = origin.per_connection();
        eprintln!("{name}: answered {statuses:?}, requests per connection {per_connection:?}");
        if per_connection.iter().any(|&n| n > 1) {
            reused.push(format!("{name}: {per_connection:?} ({statuses:?})"));
        }
        if refused && statuses.iter().any(|&s| s != 502) {
            not_502.push(format!("{name}: {statuses:?}"));
        }
        cg.shutdown().await;
    }
    assert!(
        reused.is_empty(),
        "an origin connection carried a request after a framing fault: {reused:?}"
    );
    assert!(
        not_502.is_empty(),
        "refused answers not answered 502: {not_502:?}"
    );
}
