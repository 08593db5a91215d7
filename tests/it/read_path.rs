//! The read path: miss → store → hit, single-flight of concurrent misses, negative caching,
//! `Age`, and how the query string takes part in the key. Embedded and shared mode.

use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::common::{
    CgConfig, HttpClient, ITEM_ROUTE, RedisServer, TestOrigin, concurrently, config_toml,
    default_body, item_route, route, start_cacheguard, url,
};

/// 1 MISS, then 49 hits, exactly one origin request. Returns the hit labels seen.
async fn fifty_sequential_gets_make_one_origin_request(
    cfg: CgConfig,
    origin: &TestOrigin,
) -> Vec<String> {
    let cg = cfg.start().await;
    let client = HttpClient::new();
    let u = url(cg.addr(), "/api/items/42");

    let first = client.get(&u).await;
    assert_eq!(first.status, 200, "first GET: {first}");
    assert_eq!(first.x_cache(), "MISS", "first GET: {first}");
    assert_eq!(
        first.body,
        default_body("/api/items/42", 1),
        "first GET body"
    );

    let mut labels = Vec::new();
    for i in 1..50 {
        let r = client.get(&u).await;
        assert_eq!(r.status, 200, "GET #{i}: {r}");
        assert_eq!(r.body, first.body, "GET #{i} served a different body: {r}");
        let x = r.x_cache();
        assert!(
            x == "HIT-L1" || x == "HIT-L2",
            "GET #{i}: expected a hit, got {r}"
        );
        let age = r.age();
        assert!(
            age.is_some(),
            "GET #{i}: hit without a numeric Age header: {:?}",
            r.header("age")
        );
        assert!(
            age.unwrap_or(u64::MAX) <= 60,
            "GET #{i}: Age {age:?} larger than the ttl"
        );
        labels.push(x);
    }
    assert_eq!(
        origin.count("/api/items/42"),
        1,
        "50 sequential GETs of one key reached the origin more than once"
    );
    assert_eq!(origin.total(), 1);
    cg.shutdown().await;
    labels
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_mode_miss_then_l1_hits_one_origin_request() {
    let origin = TestOrigin::start().await;
    let labels =
        fifty_sequential_gets_make_one_origin_request(CgConfig::new(&origin), &origin).await;
    // Embedded mode has no L2: every hit must come from L1.
    assert!(
        labels.iter().all(|l| l == "HIT-L1"),
        "embedded mode hits: {labels:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_mode_miss_then_hits_one_origin_request() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cfg = CgConfig::new(&origin).redis(&redis).l1("hot");
    fifty_sequential_gets_make_one_origin_request(cfg, &origin).await;
    let keys = redis.entry_keys().await;
    assert_eq!(
        keys.len(),
        1,
        "expected exactly one cg:*:v entry in Redis, found {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_mode_l1_all_serves_hits_from_l1() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cfg = CgConfig::new(&origin).redis(&redis).l1("all");
    let labels = fifty_sequential_gets_make_one_origin_request(cfg, &origin).await;
    assert!(
        labels.iter().any(|l| l == "HIT-L1"),
        "l1 = \"all\" but no hit came from L1: {labels:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_ids_are_distinct_keys() {
    let origin = TestOrigin::start().await;
    let cg = start_cacheguard(&config_toml(&origin, None, ITEM_ROUTE)).await;
    let client = HttpClient::new();
    for id in ["1", "2", "3"] {
        let r = client
            .get(&url(cg.addr(), &format!("/api/items/{id}")))
            .await;
        assert_eq!(r.x_cache(), "MISS", "id {id}: {r}");
        assert_eq!(r.body, default_body(&format!("/api/items/{id}"), 1));
    }
    for id in ["1", "2", "3"] {
        let r = client
            .get(&url(cg.addr(), &format!("/api/items/{id}")))
            .await;
        assert!(r.is_hit(), "id {id}: {r}");
        assert_eq!(
            r.body,
            default_body(&format!("/api/items/{id}"), 1),
            "id {id} got another key's body"
        );
    }
    assert_eq!(origin.total(), 3);
    cg.shutdown().await;
}

async fn two_hundred_concurrent_cold_gets(cfg: CgConfig, origin: &TestOrigin) {
    let cg = cfg.start().await;
    let client = HttpClient::new();
    let u = Arc::new(url(cg.addr(), "/api/items/hot"));
    let results = concurrently(200, Duration::from_secs(20), |_| {
        let client = client.clone();
        let u = u.clone();
        async move { client.try_get(&u).await }
    })
    .await;
    let expected = default_body("/api/items/hot", 1);
    let mut failures = Vec::new();
    for (i, r) in results.iter().enumerate() {
        match r {
            Ok(r) if r.status == 200 && r.body == expected => {}
            Ok(r) => failures.push(format!("client {i}: {r}")),
            Err(e) => failures.push(format!("client {i}: {e}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of 200 clients did not get 200 + the body, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert_eq!(
        origin.count("/api/items/hot"),
        1,
        "200 concurrent GETs of one cold key made more than one origin request"
    );
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_two_hundred_concurrent_misses_make_one_origin_request() {
    let origin = TestOrigin::builder()
        .delay(Duration::from_millis(200))
        .start()
        .await;
    two_hundred_concurrent_cold_gets(CgConfig::new(&origin), &origin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_two_hundred_concurrent_misses_make_one_origin_request() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::builder()
        .delay(Duration::from_millis(200))
        .start()
        .await;
    two_hundred_concurrent_cold_gets(CgConfig::new(&origin).redis(&redis), &origin).await;
}

async fn not_found_is_cached_as_negative(cfg: CgConfig, origin: &TestOrigin, status: u16) {
    origin.set_status("/api/items/missing", status);
    origin.set_body("/api/items/missing", r#"{"error":"not found"}"#);
    let cg = cfg.start().await;
    let client = HttpClient::new();
    let u = url(cg.addr(), "/api/items/missing");
    let first = client.get(&u).await;
    assert_eq!(first.status, status, "first: {first}");
    assert_ne!(
        first.x_cache(),
        "NEGATIVE",
        "the first {status} cannot come from the cache: {first}"
    );
    for i in 0..10 {
        let r = client.get(&u).await;
        assert_eq!(r.status, status, "repeat #{i}: {r}");
        assert_eq!(r.x_cache(), "NEGATIVE", "repeat #{i}: {r}");
    }
    assert_eq!(
        origin.count("/api/items/missing"),
        1,
        "a cached {status} reached the origin again within negative_ttl"
    );
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_404_is_served_negative_on_repeat() {
    let origin = TestOrigin::start().await;
    not_found_is_cached_as_negative(CgConfig::new(&origin), &origin, 404).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_404_is_served_negative_on_repeat() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    not_found_is_cached_as_negative(CgConfig::new(&origin).redis(&redis), &origin, 404).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_410_is_served_negative_on_repeat() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    not_found_is_cached_as_negative(CgConfig::new(&origin).redis(&redis), &origin, 410).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_entry_expires_after_negative_ttl() {
    let origin = TestOrigin::start().await;
    origin.set_status("/api/items/gone", 404);
    let cfg = CgConfig::new(&origin).set_str("cache", "negative_ttl", "1s");
    let cg = cfg.start().await;
    let client = HttpClient::new();
    let u = url(cg.addr(), "/api/items/gone");
    client.get(&u).await;
    let r = client.get(&u).await;
    assert_eq!(r.x_cache(), "NEGATIVE", "{r}");
    assert_eq!(origin.count("/api/items/gone"), 1);
    // The item now exists. After negative_ttl (1s, ≤ 1.2s with jitter) the 404 is gone: a
    // negative entry has no grace, so it is never served stale.
    origin.reset("/api/items/gone");
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let r = client.get(&u).await;
    assert_eq!(
        (r.status.as_u16(), r.x_cache().as_str()),
        (200, "MISS"),
        "{r}"
    );
    assert_eq!(origin.count("/api/items/gone"), 2);
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn age_counts_seconds_since_store() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    let u = url(cg.addr(), "/api/items/aged");
    client.get(&u).await;
    let r = client.get(&u).await;
    assert!(r.is_hit(), "{r}");
    assert!(
        r.age().is_some_and(|a| a <= 1),
        "fresh hit Age: {:?}",
        r.header("age")
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let r = client.get(&u).await;
    assert!(r.is_hit(), "{r}");
    let age = r.age();
    assert!(
        age.is_some_and(|a| (2..=4).contains(&a)),
        "Age 2.1s after the store should be 2 (±), got {:?}",
        r.header("age")
    );
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sorted_query_keys_on_every_parameter_in_any_order() {
    let origin = TestOrigin::start().await;
    let routes = route("search", "/api/search", "GET", r#"query = "sorted""#);
    let cg = CgConfig::new(&origin).routes(&routes).start().await;
    let client = HttpClient::new();
    let a = client.get(&url(cg.addr(), "/api/search?b=2&a=1")).await;
    assert_eq!(a.x_cache(), "MISS", "{a}");
    let b = client.get(&url(cg.addr(), "/api/search?a=1&b=2")).await;
    assert!(b.is_hit(), "reordered parameters must be the same key: {b}");
    assert_eq!(b.body, a.body);
    let c = client.get(&url(cg.addr(), "/api/search?a=1&b=3")).await;
    assert_eq!(
        c.x_cache(),
        "MISS",
        "a different value must be a different key: {c}"
    );
    let d = client.get(&url(cg.addr(), "/api/search?a=1")).await;
    assert_eq!(
        d.x_cache(),
        "MISS",
        "a missing parameter must be a different key: {d}"
    );
    assert_eq!(origin.count("/api/search"), 3);
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignored_query_is_not_keyed_and_not_forwarded() {
    let origin = TestOrigin::start().await;
    let routes = item_route(r#"query = "ignore""#);
    let cg = CgConfig::new(&origin).routes(&routes).start().await;
    let client = HttpClient::new();
    let a = client.get(&url(cg.addr(), "/api/items/7?x=1")).await;
    assert_eq!(a.x_cache(), "MISS", "{a}");
    let seen = origin
        .last_request("/api/items/7")
        .expect("origin saw the request");
    assert_eq!(
        seen.uri.query(),
        None,
        "ignored query forwarded: {}",
        seen.uri
    );
    let b = client.get(&url(cg.addr(), "/api/items/7?x=2")).await;
    assert!(b.is_hit(), "{b}");
    let c = client.get(&url(cg.addr(), "/api/items/7")).await;
    assert!(c.is_hit(), "{c}");
    assert_eq!(origin.count("/api/items/7"), 1);
    cg.shutdown().await;
}

/// `upstream.pool_idle_timeout`: a connection to the origin idle for longer is not reused
/// (an origin that closes idle connections first would otherwise see a request on a
/// connection it is closing: a 502). Within it, the connection is reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_origin_connections_are_dropped_after_pool_idle_timeout() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set_str("upstream", "pool_idle_timeout", "300ms")
        .l1("all")
        .start()
        .await;
    let client = HttpClient::new();
    let peer = |path: &str| {
        origin
            .last_request(path)
            .unwrap_or_else(|| panic!("the origin saw no request for {path}"))
            .peer
    };
    for path in ["/api/items/a", "/api/items/b"] {
        assert_eq!(client.get(&url(cg.addr(), path)).await.status, 200);
    }
    assert_eq!(
        peer("/api/items/a"),
        peer("/api/items/b"),
        "a connection idle for less than pool_idle_timeout is reused"
    );
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(
        client.get(&url(cg.addr(), "/api/items/c")).await.status,
        200
    );
    assert_ne!(
        peer("/api/items/a"),
        peer("/api/items/c"),
        "a connection idle for longer than pool_idle_timeout is not reused"
    );
    cg.shutdown().await;
}

/// Eight warm keep-alive connections to the origin are forgotten by a middlebox in
/// between: each fails on its next request, after the request was written. A cached GET
/// is idempotent and nothing of an answer was read, so it is retried once on a new
/// connection: every client gets 200, and the retries are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_whose_pooled_connection_was_dropped_is_retried_once() {
    let origin = TestOrigin::start().await;
    origin.set_default_delay(Duration::from_millis(100));
    let middlebox = common::TcpProxy::start(origin.addr()).await;
    let cg = CgConfig::with_upstream(&format!("http://{}", middlebox.addr()))
        .set("cache", "max_variants", "0")
        .start()
        .await;
    let client = HttpClient::new();
    let addr = cg.addr();
    let eight = |name: &'static str| {
        let client = client.clone();
        concurrently(8, Duration::from_secs(10), move |i| {
            let client = client.clone();
            async move {
                client
                    .get(&url(addr, &format!("/api/items/{name}-{i}")))
                    .await
            }
        })
    };
    // Eight concurrent misses: eight pooled connections.
    let warm = eight("warm").await;
    assert!(warm.iter().all(|r| r.status == 200), "{warm:?}");
    middlebox.drop_open_on_next_request();
    let burst = eight("burst").await;
    let statuses: Vec<u16> = burst.iter().map(|r| r.status.as_u16()).collect();
    assert_eq!(statuses, vec![200; 8], "{burst:?}");
    let retries = common::metric(
        &client,
        cg.admin_addr(),
        "cacheguard_origin_retries_total",
        &[("route", "item")],
    )
    .await;
    assert!(retries >= 1.0, "{retries} retries counted");
    cg.shutdown().await;
}
