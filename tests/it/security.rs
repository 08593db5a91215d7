//! Security: per-user responses are never shared, the origin only receives what is keyed,
//! clients cannot force origin fetches, and corrupt or foreign Redis values are misses.

use std::time::Duration;

use bytes::Bytes;
use http::Method;
use rand::RngExt;

use crate::common::client::full_body;
use crate::common::{
    CgConfig, HttpClient, RedisServer, Resp, TestOrigin, default_body, item_route, route, url,
};

/// Both deployment shapes, so every "never shared" rule is checked against L1 and L2.
async fn both_modes(
    origin: &TestOrigin,
    redis: &RedisServer,
) -> Vec<(&'static str, cacheguard::Running)> {
    vec![
        ("embedded", CgConfig::new(origin).start().await),
        (
            "shared",
            CgConfig::new(origin).redis(redis).l1("all").start().await,
        ),
    ]
}

fn assert_not_hit(r: &Resp, what: &str) {
    let x = r.x_cache();
    assert!(
        x == "BYPASS" || x == "MISS",
        "{what}: expected X-Cache BYPASS or MISS, got {r}"
    );
}

/// The origin answers `path` with `headers`; two GETs must both reach the origin.
async fn response_header_prevents_sharing(headers: &[(&str, &str)]) {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let client = HttpClient::new();
    for (mode, cg) in both_modes(&origin, &redis).await {
        let path = format!("/api/items/private-{mode}");
        origin.set_headers(&path, headers.iter().copied());
        let u = url(cg.addr(), &path);
        for i in 1..=3u64 {
            let r = client.get(&u).await;
            assert_eq!(r.status, 200, "{mode} #{i}: {r}");
            assert_not_hit(&r, &format!("{mode} #{i} with response {headers:?}"));
            assert_eq!(
                r.body,
                default_body(&path, i),
                "{mode} #{i}: served someone else's copy"
            );
            assert_eq!(
                origin.count(&path),
                i,
                "{mode} #{i}: did not reach the origin"
            );
        }
        cg.shutdown().await;
    }
    assert!(
        redis.entry_keys().await.is_empty(),
        "a response with {headers:?} was stored in Redis"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_cookie_response_is_never_shared() {
    response_header_prevents_sharing(&[("set-cookie", "session=abc; HttpOnly")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_control_private_response_is_never_shared() {
    response_header_prevents_sharing(&[("cache-control", "private, max-age=60")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_control_no_store_response_is_never_shared() {
    response_header_prevents_sharing(&[("cache-control", "no-store")]).await;
}

/// Requests carrying `header` go to the origin every time and their answers are never
/// served to anyone else; the route itself is cacheable (checked at the end).
async fn request_header_bypasses_cache(header: (&str, &str)) {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let client = HttpClient::new();
    for (mode, cg) in both_modes(&origin, &redis).await {
        let path = format!("/api/items/user-{mode}");
        let u = url(cg.addr(), &path);
        let r1 = client.get_with_headers(&u, &[header]).await;
        assert_eq!(r1.status, 200, "{mode}: {r1}");
        assert_not_hit(&r1, &format!("{mode}: first request with {header:?}"));
        let r2 = client.get_with_headers(&u, &[header]).await;
        assert_not_hit(&r2, &format!("{mode}: second request with {header:?}"));
        assert_eq!(
            origin.count(&path),
            2,
            "{mode}: a request with {header:?} was served from cache"
        );

        let anon = client.get(&u).await;
        assert_not_hit(
            &anon,
            &format!("{mode}: anonymous request after {header:?} requests"),
        );
        assert_eq!(
            origin.count(&path),
            3,
            "{mode}: anonymous request got the per-user copy"
        );
        assert_eq!(anon.body, default_body(&path, 3));

        // Sanity: the route does cache anonymous requests.
        let anon2 = client.get(&u).await;
        assert!(
            anon2.is_hit(),
            "{mode}: route should cache anonymous requests: {anon2}"
        );

        // And a cached anonymous entry is not served to a request with credentials.
        let r3 = client.get_with_headers(&u, &[header]).await;
        assert_not_hit(
            &r3,
            &format!("{mode}: request with {header:?} after an anonymous entry"),
        );
        assert_eq!(
            origin.count(&path),
            4,
            "{mode}: request with {header:?} did not reach the origin"
        );
        cg.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_request_bypasses_cache() {
    request_header_bypasses_cache(("authorization", "Bearer user-a-token")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cookie_request_bypasses_cache() {
    request_header_bypasses_cache(("cookie", "session=user-a")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_never_cached() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let client = HttpClient::new();
    for (mode, cg) in both_modes(&origin, &redis).await {
        for status in [500u16, 502, 503] {
            let path = format!("/api/items/err-{mode}-{status}");
            origin.set_status(&path, status);
            let u = url(cg.addr(), &path);
            for i in 1..=3u64 {
                let r = client.get(&u).await;
                assert_eq!(r.status, status, "{mode} {status} #{i}: {r}");
                assert_not_hit(&r, &format!("{mode} origin {status} #{i}"));
                assert_eq!(
                    origin.count(&path),
                    i,
                    "{mode}: a {status} was served from cache"
                );
            }
        }
        cg.shutdown().await;
    }
    assert!(
        redis.entry_keys().await.is_empty(),
        "a 5xx was stored in Redis"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_x_forwarded_headers_are_replaced_on_cached_route() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    let r = client
        .get_with_headers(
            &url(cg.addr(), "/api/items/xff"),
            &[
                ("x-forwarded-for", "6.6.6.6"),
                ("x-forwarded-host", "evil.example"),
                ("x-forwarded-proto", "gopher"),
                ("forwarded", "for=6.6.6.6;host=evil.example"),
            ],
        )
        .await;
    assert_eq!(r.status, 200, "{r}");
    let seen = origin
        .last_request("/api/items/xff")
        .expect("origin saw the request");
    assert_eq!(
        seen.header("x-forwarded-for").as_deref(),
        Some("127.0.0.1"),
        "origin must see cacheguard's X-Forwarded-For (the client IP), not the client's"
    );
    for name in ["x-forwarded-host", "x-forwarded-proto", "forwarded"] {
        let v = seen.header(name).unwrap_or_default();
        assert!(
            !v.contains("evil.example") && !v.contains("gopher") && !v.contains("6.6.6.6"),
            "client's {name} passed through to the origin: {v:?}"
        );
    }
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_x_forwarded_for_is_replaced_on_unmatched_path() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    let r = client
        .get_with_headers(
            &url(cg.addr(), "/other/xff"),
            &[("x-forwarded-for", "6.6.6.6")],
        )
        .await;
    assert_eq!(r.status, 200, "{r}");
    let seen = origin
        .last_request("/other/xff")
        .expect("origin saw the request");
    assert_eq!(seen.header("x-forwarded-for").as_deref(), Some("127.0.0.1"));
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_override_headers_and_get_body_are_not_forwarded_on_cached_route() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    let r = client
        .request(
            Method::GET,
            &url(cg.addr(), "/api/items/override"),
            &[
                ("x-http-method-override", "DELETE"),
                ("x-http-method", "DELETE"),
                ("x-method-override", "DELETE"),
                ("content-type", "application/json"),
            ],
            full_body(Bytes::from_static(b"{\"evil\":true}")),
        )
        .await
        .expect("GET with body");
    // Either answered (the body dropped) or refused outright; never a poisoned entry.
    let seen = origin.last_request("/api/items/override");
    if let Some(seen) = seen {
        assert_eq!(seen.method, Method::GET);
        for name in [
            "x-http-method-override",
            "x-http-method",
            "x-method-override",
        ] {
            assert_eq!(
                seen.header(name),
                None,
                "{name} was forwarded to the origin"
            );
        }
        assert!(
            seen.body.is_empty(),
            "GET body forwarded to the origin: {:?}",
            seen.body
        );
    } else {
        assert!(
            r.status.is_client_error(),
            "not forwarded but not refused either: {r}"
        );
    }
    // A plain GET afterwards gets the ordinary representation.
    let plain = client.get(&url(cg.addr(), "/api/items/override")).await;
    assert_eq!(plain.status, 200, "{plain}");
    assert!(plain.text().contains("/api/items/override"), "{plain}");
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_query_params_are_stripped_and_do_not_split_the_key() {
    let origin = TestOrigin::start().await;
    let routes = route("list", "/api/list", "GET", r#"query = ["page"]"#);
    let cg = CgConfig::new(&origin).routes(&routes).start().await;
    let client = HttpClient::new();
    let first = client.get(&url(cg.addr(), "/api/list?page=2&utm=x")).await;
    assert_eq!(first.status, 200, "{first}");
    assert_eq!(first.x_cache(), "MISS", "{first}");
    let seen = origin
        .last_request("/api/list")
        .expect("origin saw the request");
    assert_eq!(
        seen.uri.to_string(),
        "/api/list?page=2",
        "the unkeyed utm parameter must be removed from the forwarded URI"
    );
    for u in [
        "/api/list?page=2",
        "/api/list?utm=y&page=2",
        "/api/list?page=2&utm=z&utm=w",
    ] {
        let r = client.get(&url(cg.addr(), u)).await;
        assert!(
            r.is_hit(),
            "{u}: an unkeyed parameter created a new key: {r}"
        );
        assert_eq!(r.body, first.body);
    }
    let other = client.get(&url(cg.addr(), "/api/list?page=3&utm=x")).await;
    assert_eq!(other.x_cache(), "MISS", "page is keyed: {other}");
    assert_eq!(origin.count("/api/list"), 2);
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_no_cache_does_not_force_an_origin_fetch() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    let u = url(cg.addr(), "/api/items/nc");
    assert_eq!(client.get(&u).await.x_cache(), "MISS");
    for headers in [
        vec![("cache-control", "no-cache")],
        vec![("pragma", "no-cache")],
        vec![("cache-control", "max-age=0")],
        vec![("cache-control", "no-cache"), ("pragma", "no-cache")],
    ] {
        let r = client.get_with_headers(&u, &headers).await;
        assert!(
            r.is_hit(),
            "{headers:?} must still be served from cache: {r}"
        );
    }
    assert_eq!(origin.count("/api/items/nc"), 1);
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vary_header_values_are_distinct_keys() {
    let origin = TestOrigin::start().await;
    let routes = item_route(r#"vary = ["accept-language"]"#);
    let cg = CgConfig::new(&origin).routes(&routes).start().await;
    let client = HttpClient::new();
    let u = url(cg.addr(), "/api/items/v");
    let en = client
        .get_with_headers(&u, &[("accept-language", "en")])
        .await;
    assert_eq!(en.x_cache(), "MISS", "{en}");
    assert_eq!(
        origin
            .last_request("/api/items/v")
            .and_then(|r| r.header("accept-language"))
            .as_deref(),
        Some("en"),
        "a vary header must be forwarded"
    );
    let fr = client
        .get_with_headers(&u, &[("accept-language", "fr")])
        .await;
    assert_eq!(fr.x_cache(), "MISS", "fr must not get the en copy: {fr}");
    assert_ne!(fr.body, en.body);
    let en2 = client
        .get_with_headers(&u, &[("accept-language", "en")])
        .await;
    assert!(en2.is_hit(), "{en2}");
    assert_eq!(en2.body, en.body, "en got the fr copy");
    let fr2 = client
        .get_with_headers(&u, &[("accept-language", "fr")])
        .await;
    assert!(fr2.is_hit(), "{fr2}");
    assert_eq!(fr2.body, fr.body, "fr got the en copy");
    assert_eq!(origin.count("/api/items/v"), 2);
    cg.shutdown().await;
}

/// Shared mode, L1 not involved: every read of an entry goes to Redis.
async fn shared_hot_only(origin: &TestOrigin, redis: &RedisServer) -> cacheguard::Running {
    CgConfig::new(origin).redis(redis).l1("hot").start().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_in_redis_entry_is_a_miss_not_an_error() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = shared_hot_only(&origin, &redis).await;
    let client = HttpClient::new();
    let mut rng = rand::rng();
    let random: Vec<u8> = (0..256).map(|_| rng.random()).collect();
    let long_random: Vec<u8> = (0..100_000).map(|_| rng.random()).collect();
    let garbage: Vec<(&str, Vec<u8>)> = vec![
        ("random bytes", random),
        ("empty", Vec::new()),
        ("one byte", vec![0x01]),
        ("all 0xff", vec![0xff; 64]),
        ("100k random", long_random),
        ("text", b"{\"status\":200,\"body\":\"pwned\"}".to_vec()),
    ];
    for (i, (what, value)) in garbage.iter().enumerate() {
        let path = format!("/api/items/garbage-{i}");
        let u = url(cg.addr(), &path);
        let r = client.get(&u).await;
        assert_eq!(r.x_cache(), "MISS", "{r}");
        let r = client.get(&u).await;
        assert_eq!(
            r.x_cache(),
            "HIT-L2",
            "sanity: entry is read from Redis: {r}"
        );
        // Overwrite every entry currently in Redis with the garbage value.
        let keys = redis.entry_keys().await;
        assert!(!keys.is_empty(), "no cg:*:v keys found");
        let mut con = redis.client().await;
        for k in &keys {
            let _: () = redis::cmd("SET")
                .arg(k)
                .arg(value.as_slice())
                .arg("PX")
                .arg(60_000)
                .query_async(&mut con)
                .await
                .expect("SET garbage");
        }
        let before = origin.count(&path);
        let r = client.get(&u).await;
        assert_eq!(
            r.status, 200,
            "{what}: garbage entry must be a miss, got {r}"
        );
        assert_eq!(r.x_cache(), "MISS", "{what}: {r}");
        assert_eq!(
            origin.count(&path),
            before + 1,
            "{what}: garbage entry was not refetched"
        );
        assert_eq!(r.body, default_body(&path, before + 1), "{what}: body");
    }
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_copied_under_another_key_is_not_served() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = shared_hot_only(&origin, &redis).await;
    let client = HttpClient::new();
    client.get(&url(cg.addr(), "/api/items/a")).await;
    let keys_a = redis.entry_keys().await;
    assert_eq!(keys_a.len(), 1);
    client.get(&url(cg.addr(), "/api/items/b")).await;
    let keys: Vec<Vec<u8>> = redis
        .entry_keys()
        .await
        .into_iter()
        .filter(|k| k != &keys_a[0])
        .collect();
    assert_eq!(keys.len(), 1);
    let (key_a, key_b) = (&keys_a[0], &keys[0]);
    let mut con = redis.client().await;
    let value_a: Vec<u8> = redis::cmd("GET")
        .arg(key_a)
        .query_async(&mut con)
        .await
        .expect("GET a");
    let _: () = redis::cmd("SET")
        .arg(key_b)
        .arg(value_a)
        .arg("PX")
        .arg(60_000)
        .query_async(&mut con)
        .await
        .expect("SET b");
    let r = client.get(&url(cg.addr(), "/api/items/b")).await;
    assert_eq!(r.status, 200, "{r}");
    assert!(
        !r.text().contains("/api/items/a"),
        "a's entry stored under b's key was served for b (full key not compared on read): {r}"
    );
    assert_eq!(r.body, default_body("/api/items/b", 2), "{r}");
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_header_request_does_not_poison_the_entry() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set("server", "max_header_bytes", "4096")
        .start()
        .await;
    let client = HttpClient::new();
    let u = url(cg.addr(), "/api/items/poison");
    let big = "x".repeat(8192);
    let r = client
        .get_with_headers(&u, &[("x-big", big.as_str())])
        .await;
    assert_eq!(r.status, 431, "{r}");
    let r = client.get(&u).await;
    assert_eq!(
        r.status, 200,
        "an oversized request poisoned the entry: {r}"
    );
    assert_eq!(r.x_cache(), "MISS", "{r}");
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(origin.count("/api/items/poison"), 1);
    cg.shutdown().await;
}
