//! What an origin answer's own caching headers demand of a shared cache (RFC 9111), held in
//! the default (strict) mode, where a route's own rules set the lifetime:
//!
//! - `Vary`: a stored answer never reaches a request whose `Vary`-named headers could
//!   differ. An answer that varies on a header the route does not key — one cacheguard does
//!   not forward, or `X-Forwarded-For`, which it sets per client — is not stored
//!   (`fill_refused{reason="vary"}`); one that varies on a keyed header is, per key value.
//! - `must-revalidate`, `proxy-revalidate` and `s-maxage`: past its lifetime such an answer
//!   is never served stale, whatever the route's grace; the origin's failure is the answer.
//! - `Age`: the age an answer arrived with is kept and grows while it is stored; a
//!   list-valued `Age` counts by its first member and an invalid one is ignored (RFC 9111
//!   §5.1), so the origin's lifetime still holds (route `fresh`, `freshness = "origin"`).
//! - `CDN-Cache-Control` (RFC 9213): its `private` and `no-cache` stop reuse whatever
//!   `Cache-Control` allows; one that is not a valid Structured Field Dictionary is ignored
//!   as a whole. It is passed on to clients.
//! - Interim (1xx) answers are never stored, nor their headers, nor sent with a hit.
//! - A client's conditionals and range are answered from the stored copy (304, 206, 416).
//!   On a miss with nothing stored, an origin-mode route forwards the client's validator:
//!   the origin's `304` answers that client alone, the requests waiting on the same fill
//!   get the whole answer, and the key is filled.
//!
//! - `Vary` in origin mode: every variant of a URL (its answer for each value of the
//!   headers its `Vary` names) is kept as its own entry, within the path's variant budget,
//!   served only to its own requests, dropped with its path by a purge; two variants never
//!   share a fill, and one variant's concurrent misses do.
//!
//! Each holds in embedded mode and in shared mode with `l1` off, hot and all (the Vary
//! rules on a Redis Cluster too), read back through a second instance where there is one.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use common::*;
use http::Method;

/// Route `item`, keyed on `accept-language`; no jitter, so lifetimes are exact. And route
/// `fresh` under `/api/fresh/`, whose lifetimes come from the origin (`freshness =
/// "origin"`), capped by the same `ttl`.
fn route(ttl: &str) -> String {
    item_route(&format!(
        "ttl = \"{ttl}\"\njitter = 0.0\ngrace = \"30s\"\nvary = [\"accept-language\"]\n"
    )) + &common::route(
        "fresh",
        "/api/fresh/{id}",
        "GET",
        &format!("freshness = \"origin\"\nttl = \"{ttl}\"\njitter = 0.0\ngrace = \"30s\"\n"),
    )
}

/// The modes a user can pick: a name and the config for it.
async fn modes(origin: &TestOrigin, redis: &RedisServer, ttl: &str) -> Vec<(String, CgConfig)> {
    let base = || CgConfig::new(origin).routes(&route(ttl));
    let mut out = vec![
        ("embedded, l1 = all".to_owned(), base().l1("all")),
        ("embedded, l1 = hot".to_owned(), base().l1("hot")),
    ];
    for l1 in ["off", "hot", "all"] {
        out.push((format!("shared, l1 = {l1}"), base().redis(redis).l1(l1)));
    }
    out
}

/// Starts an origin and a Redis, runs `one` in every mode of [`modes`] (with route ttl
/// `ttl`) and in `more`, all at once, and fails with everything that went wrong in any of
/// them. `one` gets the origin, the mode's name and config, and whether it has Redis.
async fn in_every_mode(
    ttl: &str,
    more: &[(&str, &RedisCluster)],
    one: impl AsyncFn(&TestOrigin, &str, &CgConfig, bool) -> Vec<String>,
) {
    let origin = TestOrigin::start().await;
    let redis = RedisServer::start().await;
    let mut cells = modes(&origin, &redis, ttl).await;
    for (l1, cluster) in more {
        cells.push((
            format!("cluster, l1 = {l1}"),
            CgConfig::new(&origin)
                .routes(&route(ttl))
                .redis_cluster(cluster)
                .l1(l1),
        ));
    }
    let runs = cells
        .iter()
        .map(|(mode, cfg)| one(&origin, mode, cfg, !mode.starts_with("embedded")));
    let wrong: Vec<String> = futures_util::future::join_all(runs)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The instances of one mode: one in embedded mode, two sharing Redis in shared mode.
struct Instances {
    all: Vec<cacheguard::Running>,
}

impl Instances {
    async fn start(cfg: &CgConfig, shared: bool) -> Instances {
        let mut all = vec![cfg.start().await];
        if shared {
            all.push(cfg.start().await);
        }
        Instances { all }
    }

    async fn shutdown(self) {
        for running in self.all {
            running.shutdown().await;
        }
    }
}

async fn get(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> Resp {
    get_from(None, addr, path, headers).await
}

/// A GET on a connection of its own from local address `from`.
async fn get_from(
    from: Option<IpAddr>,
    addr: std::net::SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> Resp {
    let mut all = vec![("host", "cacheguard.test")];
    all.extend_from_slice(headers);
    raw_request_from(from, addr, Method::GET, path, &all, empty_body())
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

/// The origin's serial number of the answer (`"n":N` in its default body).
fn serial(resp: &Resp) -> String {
    let text = resp.text();
    text.split("\"n\":")
        .nth(1)
        .map(|rest| rest.trim_end_matches('}').to_owned())
        .unwrap_or(text)
}

/// In one mode: answers that vary on unkeyed headers are fetched for every client and
/// counted; one that varies on the route's keyed header is stored per value.
async fn vary_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    let client = HttpClient::new();
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(cfg, shared).await;
    let first = instances.all[0].addr();
    let mut wrong = Vec::new();

    // Unkeyed: a header cacheguard never forwards, one it sets per client, and `*` in a list.
    let unkeyed = [
        ("foo", "Foo"),
        ("xff", "X-Forwarded-For"),
        ("star", "Accept-Language, *"),
    ];
    for (name, vary) in unkeyed {
        let path = format!("/api/items/{tag}-{name}");
        origin.set_headers(&path, [("Vary", vary)]);
        let made = get(first, &path, &[("foo", "1"), ("accept-language", "fr")]).await;
        for (i, running) in instances.all.iter().enumerate() {
            // Another client: another address, another `Foo`, the same keyed header.
            let other = get_from(
                Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))),
                running.addr(),
                &path,
                &[("foo", "2"), ("accept-language", "fr")],
            )
            .await;
            if other.is_hit() || serial(&other) == serial(&made) {
                wrong.push(format!(
                    "{mode}: Vary: {vary}: the answer made for 127.0.0.1 with Foo: 1 reached \
                     127.0.0.2 with Foo: 2 through instance {i}: {other}"
                ));
            }
        }
        let fetches = origin.count(&path);
        if fetches != 1 + instances.all.len() as u64 {
            wrong.push(format!(
                "{mode}: Vary: {vary}: {fetches} origin fetches, expected one per request"
            ));
        }
    }
    let refused = metric(
        &client,
        instances.all[0].admin_addr(),
        "cacheguard_fill_refused_total",
        &[("reason", "vary")],
    )
    .await;
    if refused < unkeyed.len() as f64 {
        wrong.push(format!(
            "{mode}: fill_refused{{reason=\"vary\"}} is {refused}, expected at least {}",
            unkeyed.len()
        ));
    }

    // Keyed: stored once per value of the keyed header, and only served to that value.
    let path = format!("/api/items/{tag}-keyed");
    origin.set_headers(&path, [("Vary", "Accept-Language")]);
    let fr = get(first, &path, &[("accept-language", "fr")]).await;
    let last = instances.all[instances.all.len() - 1].addr();
    let fr_again = get(last, &path, &[("accept-language", "fr")]).await;
    let de = get(last, &path, &[("accept-language", "de")]).await;
    if !fr_again.is_hit() || serial(&fr_again) != serial(&fr) {
        wrong.push(format!(
            "{mode}: Vary: Accept-Language (keyed): the same value was not a hit: {fr_again}"
        ));
    }
    if de.is_hit() || serial(&de) == serial(&fr) {
        wrong.push(format!(
            "{mode}: Vary: Accept-Language (keyed): the fr answer reached de: {de}"
        ));
    }
    instances.shutdown().await;
    wrong
}

/// Regression: an answer with `Vary: Foo` stored for `Foo: 1` was served to `Foo: 2`, and
/// one with `Vary: X-Forwarded-For` made for 127.0.0.1 was served to 127.0.0.2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vary_never_serves_another_clients_answer() {
    let cluster = RedisCluster::start().await;
    in_every_mode("60s", &[("hot", &cluster)], vary_in_one_mode).await;
}

/// In one mode: after the route's 1 s lifetime, with the origin failing, an answer that
/// forbids stale use is not served (the failure is), while a plain one is (grace).
async fn stale_in_one_mode(mode: &str, cfg: &CgConfig, shared: bool) -> Vec<String> {
    let origin = TestOrigin::start().await;
    let cfg = cfg.clone().set_str("upstream", "url", &origin.url());
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(&cfg, shared).await;
    let mut wrong = Vec::new();
    let cases = [
        ("plain", "max-age=1", true),
        ("must", "max-age=1, must-revalidate", false),
        ("proxy", "max-age=1, proxy-revalidate", false),
        ("smaxage", "s-maxage=1", false),
    ];
    let path = |name: &str| format!("/api/items/{tag}-{name}");
    for (name, cache_control, _) in cases {
        origin.set_headers(&path(name), [("Cache-Control", cache_control)]);
        let first = get(instances.all[0].addr(), &path(name), &[]).await;
        assert_eq!(first.status, 200, "{mode}: {first}");
    }
    // Past the route's ttl (1 s), well within its grace (30 s).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for failure in ["503", "down"] {
        for (name, cache_control, stale_ok) in cases {
            if failure == "503" {
                origin.set_status(&path(name), 503);
            }
            for (i, running) in instances.all.iter().enumerate() {
                let resp = get(running.addr(), &path(name), &[]).await;
                let served_stale = resp.status == 200;
                if served_stale != stale_ok {
                    wrong.push(format!(
                        "{mode}: Cache-Control: {cache_control}, origin {failure}, instance {i}: \
                         {resp} (stale copy allowed: {stale_ok})"
                    ));
                }
            }
        }
        if failure == "503" {
            origin.stop();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    instances.shutdown().await;
    wrong
}

/// Regression: an answer with `Cache-Control: max-age=2, must-revalidate` was served
/// `200 STALE` past its lifetime while the origin failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revalidation_directives_forbid_stale_answers() {
    // Each mode stops an origin of its own.
    in_every_mode("1s", &[], async |_, mode, cfg, shared| {
        stale_in_one_mode(mode, cfg, shared).await
    })
    .await;
}

/// In one mode: the origin's `Age: 2000` is kept on the miss, on a hit from this instance
/// and on one from the other; an answer without `Age` starts at 0.
async fn age_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(cfg, shared).await;
    let aged = format!("/api/items/{tag}-aged");
    origin.set_headers(&aged, [("Age", "2000")]);
    let young = format!("/api/items/{tag}-young");
    let mut wrong = Vec::new();
    for (path, from) in [(&aged, 2000), (&young, 0)] {
        let mut seen = vec![get(instances.all[0].addr(), path, &[]).await];
        for running in &instances.all {
            seen.push(get(running.addr(), path, &[]).await);
        }
        // Allow a few seconds of residence on a loaded machine.
        let ok = |r: &Resp| r.age().is_some_and(|age| (from..from + 5).contains(&age));
        if !seen.iter().all(ok) || !seen[1..].iter().all(Resp::is_hit) {
            let ages: Vec<_> = seen.iter().map(|r| (r.x_cache(), r.age())).collect();
            wrong.push(format!(
                "{mode}: {path}: expected a hit after the miss and Age in {from}..{}: {ages:?}",
                from + 5
            ));
        }
    }
    instances.shutdown().await;
    wrong
}

/// Regression: the origin's `Age: 2000` left cacheguard as `Age: 0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn age_includes_the_upstream_age() {
    in_every_mode("60s", &[], age_in_one_mode).await;
}

/// In one mode: a client's `If-None-Match`, `If-Modified-Since` and `Range` are answered
/// from the stored copy (304, 206, 416), and the origin is asked once.
async fn conditionals_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(cfg, shared).await;
    let path = format!("/api/items/{tag}-conditional");
    origin.set_headers(
        &path,
        [
            ("ETag", "\"v1\""),
            ("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT"),
        ],
    );
    let full = get(instances.all[0].addr(), &path, &[]).await;
    let last = instances.all[instances.all.len() - 1].addr();
    // Request headers, the status expected, the body expected (None: any).
    type Case<'a> = (&'a [(&'a str, &'a str)], u16, Option<&'a [u8]>);
    let cases: [Case; 6] = [
        (&[("if-none-match", "\"v1\"")], 304, Some(b"")),
        (&[("if-none-match", "W/\"v1\", \"v0\"")], 304, Some(b"")),
        (
            &[("if-modified-since", "Fri, 02 Jan 2026 00:00:00 GMT")],
            304,
            Some(b""),
        ),
        (&[("range", "bytes=0-3")], 206, Some(&full.body[..4])),
        (&[("range", "bytes=100000-")], 416, Some(b"")),
        (&[("range", "bytes=0-3"), ("if-range", "\"v0\"")], 200, None),
    ];
    let mut wrong = Vec::new();
    for (headers, status, body) in cases {
        let resp = get(last, &path, headers).await;
        let body_ok = body.is_none_or(|b| resp.body == b);
        if resp.status.as_u16() != status || !body_ok || !resp.is_hit() {
            wrong.push(format!(
                "{mode}: {headers:?}: expected a {status} from the cache, got {resp}"
            ));
        }
    }
    if origin.count(&path) != 1 {
        wrong.push(format!("{mode}: {} origin fetches", origin.count(&path)));
    }
    instances.shutdown().await;
    wrong
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditionals_and_ranges_are_answered_from_the_cache() {
    in_every_mode("60s", &[], conditionals_in_one_mode).await;
}

/// In one mode: an answer whose `Surrogate-Control` (or `CDN-Cache-Control`) says
/// `no-store` to this cache is passed on and never stored, though the route's own rules
/// would keep it; one aimed at another cache (`no-store;other`) does not stop the store.
async fn targeted_no_store_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(cfg, shared).await;
    let mut wrong = Vec::new();
    for (field, value, stored) in [
        ("Surrogate-Control", "no-store", false),
        ("CDN-Cache-Control", "no-store", false),
        (
            "Surrogate-Control",
            "no-store;other-cache, max-age=60",
            true,
        ),
    ] {
        let path = format!("/api/items/{tag}-{}-{stored}", field.to_lowercase());
        origin.set_headers(&path, [(field, value)]);
        let mut seen = Vec::new();
        for running in &instances.all {
            for _ in 0..2 {
                seen.push(get(running.addr(), &path, &[]).await);
            }
        }
        let fetched = origin.count(&path);
        let hits = seen.iter().filter(|r| r.is_hit()).count();
        let ok = if stored {
            fetched == 1 && hits == seen.len() - 1
        } else {
            fetched == seen.len() as u64 && hits == 0
        };
        if !ok {
            let outcomes: Vec<_> = seen.iter().map(Resp::x_cache).collect();
            wrong.push(format!(
                "{mode}: {field}: {value}: fetched {fetched} times for {} requests: {outcomes:?}",
                seen.len()
            ));
        }
    }
    instances.shutdown().await;
    wrong
}

/// Regression: `Surrogate-Control: no-store` was obeyed only on `freshness = "origin"`
/// routes; on a route with its own lifetime the answer was stored and served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_no_store_aimed_at_this_cache_is_never_stored() {
    in_every_mode("60s", &[], targeted_no_store_in_one_mode).await;
}

/// In one mode: on the origin-mode route, answers with `Cache-Control: max-age=3600` and
/// the `Age` lines of each case, asked once through the first instance, then through each.
/// An `Age` that is invalid, or whose first member is young, leaves the answer fresh (later
/// requests are hits, served with a young `Age`); one whose first member is older than its
/// lifetime makes it stale (each request goes to the origin).
async fn listed_and_invalid_ages_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(cfg, shared).await;
    let cases: [(&str, &[&str], bool); 10] = [
        ("nonnumeric", &["abc"], true),
        ("negative", &["-7200"], true),
        ("float", &["7200.0"], true),
        ("prefix", &["0, 7200"], true),
        ("dup-0", &["0, 0"], true),
        ("prefix-twoline", &["0", "7200"], true),
        ("dup-0-twoline", &["0", "0"], true),
        ("suffix", &["7200, 0"], false),
        ("suffix-twoline", &["7200", "0"], false),
        ("large", &["2147483648"], false),
    ];
    let mut wrong = Vec::new();
    for (name, ages, fresh) in cases {
        let path = format!("/api/fresh/{tag}-age-{name}");
        let mut headers = vec![("Cache-Control", "max-age=3600")];
        headers.extend(ages.iter().map(|age| ("Age", *age)));
        origin.set_headers(&path, headers);
        let mut seen = vec![get(instances.all[0].addr(), &path, &[]).await];
        for running in &instances.all {
            seen.push(get(running.addr(), &path, &[]).await);
        }
        let fetched = origin.count(&path);
        let ok = if fresh {
            fetched == 1
                && seen[1..].iter().all(Resp::is_hit)
                && seen.iter().all(|r| r.age().is_some_and(|age| age < 10))
        } else {
            fetched == seen.len() as u64 && !seen.iter().any(Resp::is_hit)
        };
        if !ok {
            let got: Vec<_> = seen.iter().map(|r| (r.x_cache(), r.age())).collect();
            wrong.push(format!(
                "{mode}: Age {ages:?} with max-age=3600: expected {}, got {fetched} origin \
                 fetches and {got:?}",
                if fresh { "fresh" } else { "stale" }
            ));
        }
    }
    instances.shutdown().await;
    wrong
}

/// Regression (RFC 9111 §5.1): `Age: abc`, `-7200`, `7200.0`, `0, 7200`, `0, 0` and two
/// `Age` lines with the first `0` made an answer with `max-age=3600` stale, so it was never
/// served from the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_age_counts_by_its_first_member_and_an_invalid_one_is_ignored() {
    in_every_mode("60s", &[], listed_and_invalid_ages_in_one_mode).await;
}

/// In one mode: answers with a `CDN-Cache-Control` beside `Cache-Control`, on the
/// origin-mode route and on the route with its own lifetimes, each asked twice through every
/// instance. Stored or not as RFC 9213 says, and the field reaches the clients.
async fn cdn_cache_control_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(cfg, shared).await;
    // Name, CDN-Cache-Control, Cache-Control, stored on the origin-mode route, stored on the
    // route with its own lifetimes.
    let cases = [
        ("private", "private", "max-age=10000", false, false),
        ("no-cache", "no-cache", "max-age=10000", false, false),
        ("valid", "max-age=10000", "no-store", true, false),
        (
            "unknown-type",
            "max-age=10000, &&&&&",
            "no-store",
            false,
            false,
        ),
        ("wrong-type", "max-age=\"10000\"", "no-store", false, false),
        ("ignored", "max-age =10000", "max-age=60", true, true),
    ];
    let mut wrong = Vec::new();
    for (name, cdn, cc, in_origin_mode, in_route_mode) in cases {
        for (prefix, stored) in [("fresh", in_origin_mode), ("items", in_route_mode)] {
            let path = format!("/api/{prefix}/{tag}-cdn-{name}");
            origin.set_headers(&path, [("CDN-Cache-Control", cdn), ("Cache-Control", cc)]);
            let mut seen = Vec::new();
            for running in &instances.all {
                for _ in 0..2 {
                    seen.push(get(running.addr(), &path, &[]).await);
                }
            }
            let fetched = origin.count(&path);
            let hits = seen.iter().filter(|r| r.is_hit()).count();
            let ok = if stored {
                fetched == 1 && hits == seen.len() - 1
            } else {
                fetched == seen.len() as u64 && hits == 0
            };
            let passed_on = seen
                .iter()
                .all(|r| r.header("cdn-cache-control").as_deref() == Some(cdn));
            if !ok || !passed_on {
                let outcomes: Vec<_> = seen.iter().map(Resp::x_cache).collect();
                wrong.push(format!(
                    "{mode}: /api/{prefix}: CDN-Cache-Control: {cdn}, Cache-Control: {cc}: \
                     expected stored = {stored}, the field passed on; fetched {fetched} \
                     times for {} requests: {outcomes:?}, passed on: {passed_on}",
                    seen.len()
                ));
            }
        }
    }
    instances.shutdown().await;
    wrong
}

/// Regression (RFC 9213): `CDN-Cache-Control: private` or `no-cache` beside a
/// `Cache-Control` that allows storing was stored and reused, and a `CDN-Cache-Control`
/// that is no valid Structured Field Dictionary (`max-age=10000, &&&&&`,
/// `max-age="10000"`) still overrode `Cache-Control: no-store`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdn_cache_control_private_and_no_cache_stop_reuse_and_an_invalid_one_is_ignored() {
    in_every_mode("60s", &[], cdn_cache_control_in_one_mode).await;
}

/// In one mode: an origin that sends a `103 Early Hints` (with a header of its own) before
/// its `200`. Neither the interim answer nor its header is stored: the later requests are
/// hits with only the final answer's headers, and no interim answer is sent with them.
async fn interim_in_one_mode(mode: &str, cfg: &CgConfig, shared: bool) -> Vec<String> {
    let origin = RawOrigin::start(
        b"HTTP/1.1 103 Early Hints\r\nLink: </styles.css>; rel=preload; as=style\r\n\
          X-My-Header: test\r\n\r\n\
          HTTP/1.1 200 OK\r\nContent-Length: 2\r\nCache-Control: max-age=3600\r\n\r\nok"
            .to_vec(),
    )
    .await;
    let cfg = cfg.clone().set_str("upstream", "url", &origin.url());
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(&cfg, shared).await;
    let mut wrong = Vec::new();
    for prefix in ["items", "fresh"] {
        let path = format!("/api/{prefix}/{tag}-interim");
        let before = origin.requests();
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: cacheguard.test\r\nConnection: close\r\n\r\n");
        let mut seen = Vec::new();
        for running in std::iter::once(&instances.all[0]).chain(&instances.all) {
            let answer = raw_bytes(running.addr(), request.as_bytes(), WAIT, false).await;
            seen.push(answer.to_ascii_lowercase());
        }
        let fetched = origin.requests() - before;
        for (i, answer) in seen.iter().enumerate() {
            let only_final =
                answer.starts_with("http/1.1 200") && answer.matches("http/1.").count() == 1;
            let hit = answer.contains("\r\nx-cache: hit");
            if !only_final
                || answer.contains("x-my-header")
                || (i > 0 && !hit)
                || !answer.ends_with("\r\n\r\nok")
            {
                wrong.push(format!(
                    "{mode}: /api/{prefix}: answer {i} (a hit expected after the first): {answer:?}"
                ));
            }
        }
        if fetched != 1 {
            wrong.push(format!(
                "{mode}: /api/{prefix}: {fetched} origin requests, expected 1"
            ));
        }
    }
    instances.shutdown().await;
    wrong
}

/// Interim answers are never stored or replayed (RFC 9111 §3: only a final answer is
/// stored). Not a regression: hyper's client drops them before cacheguard sees them; this
/// keeps it so. (The suite's `interim-not-cached` also asks that the first client receives
/// the 103, which hyper's server cannot send.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interim_answers_are_never_stored_or_replayed() {
    in_every_mode("60s", &[], async |_, mode, cfg, shared| {
        interim_in_one_mode(mode, cfg, shared).await
    })
    .await;
}

/// How long a raw exchange may take.
const WAIT: Duration = Duration::from_secs(5);

/// Polls `done` every 20 ms until it holds or `within` passes; whether it held.
async fn eventually(within: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while !done() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// In one mode: a client's `If-None-Match` on a miss with nothing stored. On the origin-mode
/// route it reaches the origin, whose `304` is that client's answer (BYPASS); the key is
/// then filled by one whole fetch (no validator), which the next requests are answered
/// from, through every instance. On the route with its own lifetimes the origin sees no
/// validator, and the client's `304` comes from the stored `200`.
async fn conditional_miss_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(cfg, shared).await;
    let first = instances.all[0].addr();
    let last = instances.all[instances.all.len() - 1].addr();
    let validator = [("if-none-match", "\"v1\"")];
    let mut wrong = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            wrong.push(format!("{mode}: {what}"));
        }
    };

    let path = format!("/api/fresh/{tag}-conditional");
    origin.set_headers(&path, [("ETag", "\"v1\""), ("Cache-Control", "max-age=60")]);
    let forwarded = get(first, &path, &validator).await;
    check(
        forwarded.status == 304 && forwarded.x_cache() == "BYPASS",
        format!("origin mode: the origin's 304 expected (BYPASS): {forwarded}"),
    );
    let filled = eventually(WAIT, || origin.count(&path) >= 2).await;
    let refill = origin
        .last_request(&path)
        .and_then(|r| r.header("if-none-match"));
    check(
        filled && refill.is_none(),
        format!("origin mode: no whole refill after the 304 (its If-None-Match: {refill:?})"),
    );
    // Answered from the refill (a follower of it while it runs), then from the cache.
    let whole = get(first, &path, &[]).await;
    let again = get(last, &path, &[]).await;
    let revalidated = get(last, &path, &validator).await;
    check(
        whole.status == 200 && again.status == 200 && again.is_hit() && !again.body.is_empty(),
        format!("origin mode: the whole answer expected, then a hit: {whole}; {again}"),
    );
    check(
        revalidated.status == 304 && revalidated.is_hit(),
        format!("origin mode: a 304 from the cache expected: {revalidated}"),
    );
    check(
        origin.count(&path) == 2,
        format!(
            "origin mode: {} origin requests, expected 2",
            origin.count(&path)
        ),
    );

    let path = format!("/api/items/{tag}-conditional");
    origin.set_headers(&path, [("ETag", "\"v1\"")]);
    let answered = get(first, &path, &validator).await;
    let seen = origin
        .last_request(&path)
        .and_then(|r| r.header("if-none-match"));
    let again = get(last, &path, &[]).await;
    check(
        answered.status == 304 && seen.is_none() && again.status == 200 && again.is_hit(),
        format!(
            "route mode: a 304 from the stored 200 without forwarding expected: {answered} \
             (origin saw If-None-Match {seen:?}); then {again}"
        ),
    );
    check(
        origin.count(&path) == 1,
        format!(
            "route mode: {} origin requests, expected 1",
            origin.count(&path)
        ),
    );
    instances.shutdown().await;
    wrong
}

/// Regression: a client's `If-None-Match` on a miss was dropped from the fetch (the suite's
/// `conditional-etag-forward` read "no"), so the origin could never answer it `304`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conditional_miss_forwards_the_validator_on_origin_mode_routes() {
    in_every_mode("60s", &[], conditional_miss_in_one_mode).await;
}

/// In one mode: a conditional request leads the fill of a cold key (the origin takes 1 s),
/// and while it runs, plain and conditional requests arrive on every instance. The
/// origin's `304` answers the leading client only; everyone else gets the whole answer (the
/// conditional ones a `304` made from it), and the origin is asked twice in all: the
/// leader's conditional fetch and one whole fetch.
async fn conditional_leader_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    let tag = mode.replace([',', ' ', '='], "");
    // The waiters wait for two fetches of 1 s: room for a loaded machine.
    let cfg = cfg.clone().set_str("lock", "wait_timeout", "10s");
    let instances = Instances::start(&cfg, shared).await;
    let path = format!("/api/fresh/{tag}-stampede");
    origin.set_headers(&path, [("ETag", "\"v1\""), ("Cache-Control", "max-age=60")]);
    origin.set_delay(&path, Duration::from_secs(1));
    let spawn = |addr, headers: &'static [(&'static str, &'static str)]| {
        let path = path.clone();
        tokio::spawn(async move { get(addr, &path, headers).await })
    };
    let leader = spawn(instances.all[0].addr(), &[("if-none-match", "\"v1\"")]);
    let mut wrong = Vec::new();
    if !eventually(WAIT, || origin.count(&path) == 1).await {
        wrong.push(format!(
            "{mode}: the leading request never reached the origin"
        ));
    }
    let mut plain = Vec::new();
    let mut conditional = Vec::new();
    for _ in 0..3 {
        plain.push(spawn(instances.all[0].addr(), &[]));
        conditional.push(spawn(
            instances.all[0].addr(),
            &[("if-none-match", "\"v1\"")],
        ));
    }
    for running in &instances.all[1..] {
        for _ in 0..3 {
            plain.push(spawn(running.addr(), &[]));
        }
    }
    let leader = leader.await.expect("leader");
    if leader.status != 304 || leader.x_cache() != "BYPASS" {
        wrong.push(format!(
            "{mode}: the leader expected the origin's 304: {leader}"
        ));
    }
    for (kind, tasks, status) in [("plain", plain, 200), ("conditional", conditional, 304)] {
        for task in tasks {
            let resp = task.await.expect("request");
            if resp.status != status || resp.x_cache() == "BYPASS" {
                wrong.push(format!(
                    "{mode}: a {kind} request waiting on the fill expected {status} from the \
                     whole answer: {resp}"
                ));
            }
        }
    }
    let count = origin.count(&path);
    let last = origin
        .last_request(&path)
        .and_then(|r| r.header("if-none-match"));
    if count != 2 || last.is_some() {
        wrong.push(format!(
            "{mode}: {count} origin requests (expected 2: the leader's, one whole), the last \
             with If-None-Match {last:?}"
        ));
    }
    instances.shutdown().await;
    wrong
}

/// The shared fill with a forwarded validator: the client that leads gets the origin's
/// `304`, no other request is answered with it, and the waiters cost one whole fetch, not
/// one each; on a Redis Cluster too (the fleet lock is released for the other instance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_validator_answers_its_client_only_and_the_waiters_share_one_fetch() {
    let cluster = RedisCluster::start().await;
    in_every_mode("60s", &[("hot", &cluster)], conditional_leader_in_one_mode).await;
}

/// The admin token of the Vary variant tests' instances (their purges).
const TOKEN: &str = "rfc9111-admin-token-0123456789";

/// `POST /admin/purge` of `path` on `admin`.
async fn purge_path(client: &HttpClient, admin: std::net::SocketAddr, path: &str) -> Resp {
    purge(
        client,
        admin,
        Some(TOKEN),
        &format!(r#"{{"keys": ["{path}"]}}"#),
    )
    .await
}

/// Whether `resp` is the answer in `language` (the origin's `lang` field).
fn in_language(resp: &Resp, language: &str) -> bool {
    resp.status == 200 && resp.text().contains(&format!("\"lang\":\"{language}\""))
}

/// A configuration of the Vary variant tests: `[cache] max_variants = 2` (the two
/// languages of the load fit; a third is beyond the budget), and an admin token.
fn vary_cfg(cfg: &CgConfig) -> CgConfig {
    cfg.clone()
        .set("cache", "max_variants", "2")
        .set_str("admin", "token", TOKEN)
}

/// In one mode, on an origin-mode route whose origin answers in the request's
/// `Accept-Language` with `Vary: Accept-Language` (a header the route does not key):
///
/// - after one request of each, an alternating `fr`, `en` load of 200 requests is answered
///   from the cache (≥ 95% hits at X-Cache and at the origin's count), every answer in its
///   own language, through every instance;
/// - more languages than the path's budget are not all stored: two within it
///   (`cacheguard_vary_variants_stored_total`), the first asks beyond it answered uncached
///   (BYPASS, `cacheguard_new_variants_total{outcome="uncached"}`), a repeat admitted;
/// - a purge of the path drops every variant.
async fn vary_variants_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    const LOAD: usize = 200;
    let client = HttpClient::new();
    let tag = mode.replace([',', ' ', '='], "");
    let instances = Instances::start(&vary_cfg(cfg), shared).await;
    let first = instances.all[0].addr();
    let admin = instances.all[0].admin_addr();
    let mut wrong = Vec::new();
    let check = |resp: &Resp, language: &str, what: &str| {
        (!in_language(resp, language))
            .then(|| format!("{mode}: {what}: asked in {language}, answered: {resp}"))
    };
    let path = format!("/api/fresh/{tag}-lang");
    origin.set_by_language(&path);
    origin.set_headers(
        &path,
        [("Vary", "Accept-Language"), ("Cache-Control", "max-age=60")],
    );
    for language in ["fr", "en"] {
        let warm = get(first, &path, &[("accept-language", language)]).await;
        wrong.extend(check(&warm, language, "warm-up"));
    }
    let before = origin.count(&path);
    let mut hits = 0;
    for i in 0..LOAD {
        let language = ["fr", "en"][i % 2];
        let addr = instances.all[(i / 2) % instances.all.len()].addr();
        let resp = get(addr, &path, &[("accept-language", language)]).await;
        hits += usize::from(resp.is_hit());
        wrong.extend(check(&resp, language, "alternating load"));
    }
    let fetched = origin.count(&path) - before;
    eprintln!("{mode}: alternating fr/en: {hits} hits of {LOAD}, {fetched} origin fetches");
    if hits * 100 < LOAD * 95 || fetched * 100 > LOAD as u64 * 5 {
        wrong.push(format!(
            "{mode}: alternating fr/en: {hits} hits of {LOAD}, {fetched} origin fetches \
             (expected ≥ 95% hits)"
        ));
    }

    // Bounded: a third language is the path's third variant beyond `max_variants = 2` (the
    // URL's own key held the first fetched); its first ask is fetched and stored nowhere,
    // its repeat admitted and stored.
    let bounded = format!("/api/fresh/{tag}-bounded");
    origin.set_by_language(&bounded);
    origin.set_headers(
        &bounded,
        [("Vary", "Accept-Language"), ("Cache-Control", "max-age=60")],
    );
    const STORED: &str = "cacheguard_vary_variants_stored_total";
    const NEW: &str = "cacheguard_new_variants_total";
    let fresh = [("route", "fresh")];
    let uncached = [("route", "fresh"), ("outcome", "uncached")];
    let stored_before = metric(&client, admin, STORED, &fresh).await;
    let uncached_before = metric(&client, admin, NEW, &uncached).await;
    let languages = ["de", "fr", "en", "it", "es", "nl"];
    for language in languages {
        let resp = get(first, &bounded, &[("accept-language", language)]).await;
        wrong.extend(check(&resp, language, "bounded, first ask"));
    }
    let stored_now = metric(&client, admin, STORED, &fresh).await - stored_before;
    let uncached_now = metric(&client, admin, NEW, &uncached).await - uncached_before;
    if stored_now != 2.0 || uncached_now != 3.0 {
        wrong.push(format!(
            "{mode}: {} languages on a budget of 2: {stored_now} variants stored, \
             {uncached_now} fetched uncached (expected 2 and 3)",
            languages.len()
        ));
    }
    let repeat = get(first, &bounded, &[("accept-language", "it")]).await;
    wrong.extend(check(&repeat, "it", "bounded, repeat"));
    let again = get(first, &bounded, &[("accept-language", "it")]).await;
    wrong.extend(check(&again, "it", "bounded, repeat again"));
    let stored_now = metric(&client, admin, STORED, &fresh).await - stored_before;
    if !again.is_hit() || stored_now != 3.0 {
        wrong.push(format!(
            "{mode}: a repeat beyond the budget was not admitted and stored ({stored_now} \
             stored): {again}"
        ));
    }

    // A purge of the path drops every variant: both languages are fetched again.
    let purged = purge_path(&client, admin, &path).await;
    if purged.status != 200 {
        wrong.push(format!("{mode}: purge: {purged}"));
    }
    let before = origin.count(&path);
    for language in ["fr", "en"] {
        let resp = get(first, &path, &[("accept-language", language)]).await;
        wrong.extend(check(&resp, language, "after the purge"));
        if resp.is_hit() {
            wrong.push(format!(
                "{mode}: a variant survived the purge of its path: {resp}"
            ));
        }
    }
    if origin.count(&path) - before != 2 {
        wrong.push(format!(
            "{mode}: after the purge, {} origin fetches for fr and en (expected 2)",
            origin.count(&path) - before
        ));
    }
    instances.shutdown().await;
    wrong
}

/// Regression: on a `freshness = "origin"` route, an answer varying on an unkeyed header
/// was kept for one variant only (the latest), so an alternating fr/en load refetched on
/// every switch (hit ratio ~0). Now every variant is kept, within the path's budget, and a
/// purge drops them all: embedded and shared, `l1` off, hot and all, on a Redis Cluster too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_vary_variant_is_kept_within_the_budget() {
    let cluster = RedisCluster::start().await;
    in_every_mode(
        "60s",
        &[("off", &cluster), ("hot", &cluster), ("all", &cluster)],
        vary_variants_in_one_mode,
    )
    .await;
}

/// In one mode: concurrent misses of `fr` and `en` on a cold URL each get their own
/// language; once the origin's `Vary` is known, concurrent misses of one variant share one
/// fetch, and two variants never share one.
async fn vary_coalescing_in_one_mode(
    origin: &TestOrigin,
    mode: &str,
    cfg: &CgConfig,
    shared: bool,
) -> Vec<String> {
    let tag = mode.replace([',', ' ', '='], "");
    let cfg = vary_cfg(cfg).set_str("lock", "wait_timeout", "10s");
    let instances = Instances::start(&cfg, shared).await;
    let mut wrong = Vec::new();
    let concurrent = |path: &str, addrs: Vec<std::net::SocketAddr>| {
        let path = path.to_owned();
        async move {
            let mut tasks = Vec::new();
            for addr in addrs {
                for language in ["fr", "en", "fr", "en"] {
                    let path = path.clone();
                    tasks.push((
                        language,
                        tokio::spawn(async move {
                            get(addr, &path, &[("accept-language", language)]).await
                        }),
                    ));
                }
            }
            let mut answers = Vec::new();
            for (language, task) in tasks {
                answers.push((language, task.await.expect("request")));
            }
            answers
        }
    };
    for (phase, warm) in [("cold", false), ("known", true)] {
        let path = format!("/api/fresh/{tag}-{phase}");
        origin.set_by_language(&path);
        origin.set_headers(
            &path,
            [("Vary", "Accept-Language"), ("Cache-Control", "max-age=60")],
        );
        origin.set_delay(&path, Duration::from_millis(500));
        if warm {
            // A first answer (de) teaches the instance the origin's Vary.
            let de = get(instances.all[0].addr(), &path, &[("accept-language", "de")]).await;
            if !in_language(&de, "de") {
                wrong.push(format!("{mode}: {phase}: de: {de}"));
            }
        }
        let before = origin.count(&path);
        let addrs = match warm {
            true => vec![instances.all[0].addr()],
            false => instances.all.iter().map(|r| r.addr()).collect(),
        };
        for (language, resp) in concurrent(&path, addrs).await {
            if !in_language(&resp, language) {
                wrong.push(format!(
                    "{mode}: {phase}: concurrent {language} answered: {resp}"
                ));
            }
        }
        let fetched = origin.count(&path) - before;
        if warm && fetched != 2 {
            wrong.push(format!(
                "{mode}: {phase}: {fetched} origin fetches for concurrent fr and en \
                 (expected 2: one per variant)"
            ));
        }
        if !warm && fetched > 2 * instances.all.len() as u64 {
            wrong.push(format!(
                "{mode}: {phase}: {fetched} origin fetches for concurrent fr and en on {} \
                 instances",
                instances.all.len()
            ));
        }
    }
    instances.shutdown().await;
    wrong
}

/// Two variants of one URL never coalesce into one answer; two requests of one variant do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_of_two_vary_variants_each_get_their_own() {
    let cluster = RedisCluster::start().await;
    in_every_mode("60s", &[("hot", &cluster)], vary_coalescing_in_one_mode).await;
}
