//! `freshness = "origin"`: a route whose lifetimes come from the origin's own headers
//! (RFC 9111), with the client's end-to-end request headers forwarded, and RFC 9111
//! invalidation by unsafe methods. In embedded mode and in shared mode with `l1` off, hot
//! and all.
//!
//! - Lifetimes: `max-age` is honoured and capped by the route's `ttl`; answers without
//!   freshness, or stale on arrival, are not served from the cache; a `Surrogate-Control`
//!   aimed at the cache wins over `Cache-Control` and is not passed on.
//! - Stale-if-error: past its lifetime a copy answers when the origin fails, unless the
//!   answer forbids it.
//! - Revalidation: a stale copy with a validator is fetched conditionally, and a `304`
//!   refreshes it.
//! - `Vary` on a forwarded, unkeyed header selects which requests a copy answers.
//! - Forwarding: end-to-end headers reach the origin, and on a miss with nothing stored the
//!   client's validators; what cacheguard owns (forwarding, method and path overrides,
//!   ranges, `If-Match`, unkeyed `Accept-Encoding`) does not.
//! - Invalidation: an unsafe method no write route takes still invalidates the cached path,
//!   and a non-error answer's same-origin `Location` / `Content-Location` too.

mod common;

use std::time::Duration;

use common::*;
use http::Method;

/// A catch-all origin-mode read route under `/api/` with a 1 s cap.
fn routes() -> String {
    item_route("freshness = \"origin\"\nttl = \"1s\"\njitter = 0.0\ngrace = \"30s\"\n")
}

/// Embedded, and shared with each `l1` policy, each on its own origin path prefix.
async fn every_mode(one: impl AsyncFn(&str, &TestOrigin, cacheguard::Running) -> Vec<String>) {
    let redis = RedisServer::start().await;
    let mut wrong = Vec::new();
    for (mode, shared, l1) in [
        ("embedded", false, "all"),
        ("shared-off", true, "off"),
        ("shared-hot", true, "hot"),
        ("shared-all", true, "all"),
    ] {
        let origin = TestOrigin::start().await;
        let mut cfg = CgConfig::new(&origin).routes(&routes()).l1(l1);
        if shared {
            cfg = cfg.redis(&redis);
        }
        let running = cfg.start().await;
        wrong.extend(one(mode, &origin, running).await);
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Response headers of one case.
type Headers = &'static [(&'static str, &'static str)];

async fn get(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> Resp {
    request(addr, Method::GET, path, headers).await
}

async fn request(
    addr: std::net::SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
) -> Resp {
    let mut all = vec![("host", "cacheguard.test")];
    all.extend_from_slice(headers);
    raw_request(addr, method.clone(), path, &all, empty_body())
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifetimes_come_from_the_origin_capped_by_the_route() {
    every_mode(async |mode, origin, cg| {
        let mut wrong = Vec::new();
        let cases: [(&str, Headers, bool); 5] = [
            ("long", &[("Cache-Control", "max-age=3600")], true),
            ("zero", &[("Cache-Control", "max-age=0")], false),
            ("none", &[], false),
            (
                "aged",
                &[("Cache-Control", "max-age=60"), ("Age", "60")],
                false,
            ),
            (
                "surrogate",
                &[
                    ("Cache-Control", "no-store"),
                    ("Surrogate-Control", "max-age=3600;cacheguard"),
                ],
                true,
            ),
        ];
        for (name, headers, stored) in cases {
            let path = format!("/api/items/{mode}-{name}");
            origin.set_headers(&path, headers.iter().copied());
            let first = get(cg.addr(), &path, &[]).await;
            let second = get(cg.addr(), &path, &[]).await;
            if second.is_hit() != stored || origin.count(&path) != if stored { 1 } else { 2 } {
                wrong.push(format!(
                    "{mode}: {name}: stored {stored} expected; answers {first} / {second}, \
                     origin fetches {}",
                    origin.count(&path)
                ));
            }
            if first.header("surrogate-control").is_some() {
                wrong.push(format!(
                    "{mode}: {name}: Surrogate-Control passed on: {first}"
                ));
            }
        }
        // Past the route's 1 s cap the long-lived answer is fetched again.
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        let path = format!("/api/items/{mode}-long");
        let third = get(cg.addr(), &path, &[]).await;
        if third.status != 200 || origin.count(&path) != 2 {
            wrong.push(format!(
                "{mode}: max-age=3600 under a 1 s ttl: not fetched again after 1.3 s: {third} \
                 ({} fetches)",
                origin.count(&path)
            ));
        }
        cg.shutdown().await;
        wrong
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_headers_reach_the_origin_and_owned_ones_do_not() {
    every_mode(async |mode, origin, cg| {
        let path = format!("/api/items/{mode}-headers");
        origin.set_headers(&path, [("Cache-Control", "max-age=60")]);
        let sent = [
            ("x-custom", "1"),
            ("accept-language", "fr"),
            ("x-original-url", "/admin"),
            ("x-rewrite-url", "/admin"),
            ("x-http-method-override", "DELETE"),
            ("x-forwarded-host", "evil.test"),
            ("forwarded", "host=evil.test"),
            ("range", "bytes=0-1"),
            ("if-match", "\"x\""),
            ("accept-encoding", "gzip"),
        ];
        // Nothing is stored yet: the client's validators go along (the origin may answer
        // 304, for this client only).
        let validators = [
            ("if-none-match", "\"x\""),
            ("if-modified-since", "Thu, 01 Jan 1970 00:00:00 GMT"),
        ];
        let sent: Vec<_> = sent.iter().chain(&validators).copied().collect();
        get(cg.addr(), &path, &sent).await;
        let seen = origin
            .last_request(&path)
            .unwrap_or_else(|| panic!("{mode}: the origin saw nothing"));
        let mut wrong = Vec::new();
        for name in [
            "x-custom",
            "accept-language",
            "surrogate-capability",
            "if-none-match",
            "if-modified-since",
        ] {
            if seen.header(name).is_none() {
                wrong.push(format!("{mode}: {name} did not reach the origin"));
            }
        }
        for (name, _) in &sent[2..sent.len() - validators.len()] {
            if seen.header(name).is_some() {
                wrong.push(format!(
                    "{mode}: {name} reached the origin: {:?}",
                    seen.header(name)
                ));
            }
        }
        if seen.header("x-forwarded-for").as_deref() != Some("127.0.0.1") {
            wrong.push(format!("{mode}: X-Forwarded-For not regenerated"));
        }
        cg.shutdown().await;
        wrong
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_methods_invalidate_the_path_and_what_the_answer_names() {
    every_mode(async |mode, origin, cg| {
        let path = |name: &str| format!("/api/items/{mode}-{name}");
        for name in ["target", "located", "content-located", "foreign", "kept"] {
            origin.set_headers(&path(name), [("Cache-Control", "max-age=60")]);
            get(cg.addr(), &path(name), &[]).await;
        }
        // An extension method, on a path no write route takes: the answer names two more
        // paths of this origin and one of another.
        origin.set_headers(
            &path("target"),
            [
                ("Cache-Control", "max-age=60"),
                ("Location", path("located").as_str()),
                (
                    "Content-Location",
                    &format!("http://cacheguard.test{}", path("content-located")),
                ),
            ],
        );
        let answer = request(
            cg.addr(),
            Method::from_bytes(b"M-SEARCH").expect("method"),
            &path("target"),
            &[],
        )
        .await;
        // An error answer invalidates nothing it names.
        origin.set_status(&path("kept"), 500);
        origin.set_headers(&path("kept"), [("Location", path("foreign").as_str())]);
        request(cg.addr(), Method::POST, &path("kept"), &[]).await;
        // Another origin's URL is never invalidated.
        let elsewhere = format!("http://other.test{}", path("foreign"));
        origin.set_headers(&path("cross"), [("Location", elsewhere.as_str())]);
        request(cg.addr(), Method::POST, &path("cross"), &[]).await;
        let mut wrong = Vec::new();
        if answer.status != 200 {
            wrong.push(format!("{mode}: M-SEARCH answered {answer}"));
        }
        for (name, dropped) in [
            ("target", true),
            ("located", true),
            ("content-located", true),
            ("foreign", false),
        ] {
            let again = get(cg.addr(), &path(name), &[]).await;
            if again.is_hit() == dropped {
                wrong.push(format!(
                    "{mode}: {name}: invalidated {dropped} expected, got {again}"
                ));
            }
        }
        cg.shutdown().await;
        wrong
    })
    .await;
}

/// Stale-if-error: past its lifetime, a copy answers (`STALE`) when the origin fails, for
/// the route's `grace` or the answer's own `stale-if-error`; never when the answer forbids
/// stale use. While the origin answers, it is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_copy_answers_when_the_origin_fails() {
    every_mode(async |mode, origin, cg| {
        let path = |name: &str| format!("/api/items/{mode}-sie-{name}");
        let cases = [
            ("default", "max-age=1", true),
            ("directive", "max-age=1, stale-if-error=60", true),
            ("none", "max-age=1, stale-if-error=0", false),
            ("must", "max-age=1, must-revalidate", false),
        ];
        for (name, cache_control, _) in cases {
            origin.set_headers(&path(name), [("Cache-Control", cache_control)]);
            get(cg.addr(), &path(name), &[]).await;
        }
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        let mut wrong = Vec::new();
        // The origin still answers: a stale copy is not used.
        let asked = get(cg.addr(), &path("default"), &[]).await;
        if asked.x_cache() != "MISS" || origin.count(&path("default")) != 2 {
            wrong.push(format!("{mode}: with the origin up, got {asked}"));
        }
        tokio::time::sleep(Duration::from_millis(1_300)).await;
        for (name, cache_control, stale_ok) in cases {
            origin.set_status(&path(name), 503);
            let resp = get(cg.addr(), &path(name), &[]).await;
            let stale = resp.status == 200 && resp.x_cache() == "STALE";
            if stale != stale_ok {
                wrong.push(format!(
                    "{mode}: {cache_control}, origin 503: stale copy expected {stale_ok}: {resp}"
                ));
            }
        }
        cg.shutdown().await;
        wrong
    })
    .await;
}

/// Revalidation: past its lifetime a copy with an `ETag` is fetched conditionally; the
/// origin's `304` refreshes it (`REVALIDATED`, the stored body, the 304's new headers, a
/// fresh lifetime) and the next request is a hit. Also for `must-revalidate`, whose copy is
/// never served stale but is kept to be revalidated, and for `no-cache`, which is stored
/// and revalidated on every use. Counted by result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_copy_is_revalidated_with_a_conditional_fetch() {
    every_mode(async |mode, origin, cg| {
        let mut wrong = Vec::new();
        // The third request: a hit, or for no-cache a revalidation again.
        for (name, cache_control, third) in [
            ("plain", "max-age=1", "hit"),
            ("must", "max-age=1, must-revalidate", "hit"),
            ("nocache", "no-cache", "REVALIDATED"),
        ] {
            let path = format!("/api/items/{mode}-reval-{name}");
            origin.set_headers(
                &path,
                [
                    ("Cache-Control", cache_control),
                    ("ETag", "\"v1\""),
                    ("X-Version", "a"),
                ],
            );
            let first = get(cg.addr(), &path, &[]).await;
            tokio::time::sleep(Duration::from_millis(1_300)).await;
            origin.set_headers(
                &path,
                [
                    ("Cache-Control", cache_control),
                    ("ETag", "\"v1\""),
                    ("X-Version", "b"),
                ],
            );
            let revalidated = get(cg.addr(), &path, &[]).await;
            let seen = origin
                .last_request(&path)
                .and_then(|r| r.header("if-none-match"));
            let again = get(cg.addr(), &path, &[]).await;
            let ok = revalidated.x_cache() == "REVALIDATED"
                && revalidated.status == 200
                && revalidated.body == first.body
                && revalidated.header("x-version").as_deref() == Some("b")
                && seen.as_deref() == Some("\"v1\"")
                && (again.x_cache() == third || (third == "hit" && again.is_hit()))
                && origin.count(&path) == if third == "hit" { 2 } else { 3 };
            if !ok {
                wrong.push(format!(
                    "{mode}: {cache_control}: first {first}; then {revalidated} (origin saw \
                     If-None-Match {seen:?}); then {again}; {} origin requests",
                    origin.count(&path)
                ));
            }
        }
        let client = HttpClient::new();
        let counted = metric(
            &client,
            cg.admin_addr(),
            "cacheguard_revalidations_total",
            &[("result", "not_modified")],
        )
        .await;
        if counted < 4.0 {
            wrong.push(format!(
                "{mode}: revalidations{{result=not_modified}} = {counted}"
            ));
        }
        cg.shutdown().await;
        wrong
    })
    .await;
}

/// `Vary` on a forwarded header the route does not key: the copy is served only to
/// requests with the same value of it (the latest variant is kept); `Vary` on a header
/// cacheguard sets itself is never stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vary_selects_which_requests_a_copy_answers() {
    every_mode(async |mode, origin, cg| {
        let path = format!("/api/items/{mode}-vary");
        origin.set_headers(
            &path,
            [("Cache-Control", "max-age=60"), ("Vary", "Accept-Language")],
        );
        let lang = |l: &'static str| [("accept-language", l)];
        let steps = [
            ("fr", "MISS", 1),
            ("fr", "HIT", 1),
            ("fr ", "HIT", 1),
            ("de", "MISS", 2),
            ("de", "HIT", 2),
        ];
        let mut wrong = Vec::new();
        let mut bodies = std::collections::HashMap::new();
        for (value, expected, fetches) in steps {
            let resp = get(cg.addr(), &path, &lang(value)).await;
            let first_body = bodies
                .entry(value.trim())
                .or_insert_with(|| resp.body.clone());
            let hit = resp.is_hit();
            if hit != (expected == "HIT")
                || origin.count(&path) != fetches
                || *first_body != resp.body
            {
                wrong.push(format!(
                    "{mode}: Accept-Language {value:?}: expected {expected} after {fetches} \
                     fetches: {resp} ({} fetches)",
                    origin.count(&path)
                ));
            }
        }
        let owned = format!("/api/items/{mode}-vary-xff");
        origin.set_headers(
            &owned,
            [("Cache-Control", "max-age=60"), ("Vary", "X-Forwarded-For")],
        );
        get(cg.addr(), &owned, &[]).await;
        let again = get(cg.addr(), &owned, &[]).await;
        if again.is_hit() {
            wrong.push(format!("{mode}: Vary: X-Forwarded-For was stored: {again}"));
        }
        cg.shutdown().await;
        wrong
    })
    .await;
}
