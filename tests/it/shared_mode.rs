//! Shared mode: several instances share one Redis as L2; stored TTLs are jittered and
//! include the grace period; a cold key is fetched once across instances.

use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::common::{
    CgConfig, HttpClient, RedisServer, TestOrigin, bounded_parallel, concurrently, default_body,
    url,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_fetched_through_one_instance_is_l2_hit_through_another() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cfg = CgConfig::new(&origin).redis(&redis).l1("hot");
    let a = cfg.start().await;
    let b = cfg.start().await;
    let client = HttpClient::new();

    let ra = client.get(&url(a.addr(), "/api/items/shared")).await;
    assert_eq!(ra.x_cache(), "MISS", "through A: {ra}");
    let rb = client.get(&url(b.addr(), "/api/items/shared")).await;
    assert_eq!(rb.status, 200, "through B: {rb}");
    assert_eq!(rb.x_cache(), "HIT-L2", "through B: {rb}");
    assert_eq!(rb.body, ra.body, "B served a different body than A stored");
    assert!(
        rb.age().is_some(),
        "HIT-L2 without a numeric Age: {:?}",
        rb.header("age")
    );
    assert_eq!(origin.count("/api/items/shared"), 1);

    // And the other way round for a second key.
    let rb = client.get(&url(b.addr(), "/api/items/other")).await;
    assert_eq!(rb.x_cache(), "MISS", "{rb}");
    let ra = client.get(&url(a.addr(), "/api/items/other")).await;
    assert_eq!(ra.x_cache(), "HIT-L2", "{ra}");
    assert_eq!(origin.count("/api/items/other"), 1);

    a.shutdown().await;
    b.shutdown().await;
}

/// Stores `n` distinct keys through one instance and returns every entry's PTTL (ms).
async fn store_and_read_pttls(cfg: CgConfig, redis: &RedisServer, n: usize) -> Vec<i64> {
    let cg = cfg.start().await;
    let client = HttpClient::new();
    let addr = cg.addr();
    let results = bounded_parallel(n, 16, Duration::from_secs(60), |i| {
        let client = client.clone();
        async move {
            client
                .try_get(&url(addr, &format!("/api/items/ttl-{i}")))
                .await
        }
    })
    .await;
    for (i, r) in results.iter().enumerate() {
        match r {
            Ok(r) => assert!(r.status == 200 && r.x_cache() == "MISS", "key {i}: {r}"),
            Err(e) => panic!("key {i}: {e}"),
        }
    }
    // Stores may complete just after the response: wait (bounded) for all of them.
    let mut keys = redis.entry_keys().await;
    for _ in 0..30 {
        if keys.len() >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        keys = redis.entry_keys().await;
    }
    assert_eq!(
        keys.len(),
        n,
        "expected {n} cg:*:v entries in Redis, found {}",
        keys.len()
    );
    let mut con = redis.client().await;
    let mut pipe = redis::pipe();
    for k in &keys {
        pipe.cmd("PTTL").arg(k);
    }
    let pttls: Vec<i64> = pipe.query_async(&mut con).await.expect("PTTL pipeline");
    cg.shutdown().await;
    pttls
}

/// The Redis PTTLs of `n` entries stored with ttl 60 s, `jitter` and grace 30 s (on a
/// Redis and an origin of their own).
async fn pttls_with_jitter(jitter: &str, n: usize) -> Vec<i64> {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("redis", "command_timeout", "2s")
        .set_str("cache", "ttl", "60s")
        .set("cache", "jitter", jitter)
        .set_str("cache", "grace", "30s");
    store_and_read_pttls(cfg, &redis, n).await
}

/// The values of `pttls` outside `range`.
fn outside(pttls: &[i64], range: std::ops::RangeInclusive<i64>) -> Vec<i64> {
    pttls
        .iter()
        .copied()
        .filter(|p| !range.contains(p))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_stored_ttls_are_jittered_within_bounds() {
    let pttls = pttls_with_jitter("0.2", 1000).await;
    let out_of_range = outside(&pttls, 48_000..=102_000);
    assert!(
        out_of_range.is_empty(),
        "{} PTTLs outside [48s, 102s] (ttl 60s ± 20% + grace 30s), e.g. {:?}",
        out_of_range.len(),
        &out_of_range[..out_of_range.len().min(10)]
    );
    let min = pttls.iter().min().copied().unwrap_or_default();
    let max = pttls.iter().max().copied().unwrap_or_default();
    assert!(
        max - min >= 10_000,
        "TTLs are not jittered enough: min {min} ms, max {max} ms (spread {} ms < 10 s)",
        max - min
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_ttl_is_ttl_plus_grace() {
    let pttls = pttls_with_jitter("0.0", 50).await;
    // Redis TTL = ttl (no jitter) + grace = 90 s, minus the few seconds the test took.
    let bad = outside(&pttls, 80_000..=90_000);
    assert!(
        bad.is_empty(),
        "PTTLs should be ~90 s (60 s ttl + 30 s grace): {bad:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_entries_use_negative_ttl_in_redis() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    origin.set_status("/api/items/none", 404);
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("cache", "negative_ttl", "10s")
        .set_str("cache", "grace", "30s");
    let cg = cfg.start().await;
    let client = HttpClient::new();
    let r = client.get(&url(cg.addr(), "/api/items/none")).await;
    assert_eq!(r.status, 404, "{r}");
    let keys = redis.entry_keys().await;
    assert_eq!(
        keys.len(),
        1,
        "a 404 must be stored as a negative entry: {keys:?}"
    );
    let mut con = redis.client().await;
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&keys[0])
        .query_async(&mut con)
        .await
        .expect("PTTL");
    // negative_ttl (10 s, maybe jittered by 20%) plus at most the grace period; never the
    // positive ttl of 60 s.
    assert!(
        (1..=42_000).contains(&pttl),
        "negative entry PTTL {pttl} ms: expected about negative_ttl (10 s) (+ grace), not the 60 s ttl"
    );
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_across_two_instances_make_one_origin_request() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::builder()
        .delay(Duration::from_millis(300))
        .start()
        .await;
    // A generous command_timeout: this test is about the lock, not Redis latency (a lock
    // command that times out rightly falls back to a local fetch).
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("redis", "command_timeout", "2s")
        .l1("hot");
    let a = cfg.start().await;
    let b = cfg.start().await;
    let client = HttpClient::new();
    let addrs = Arc::new([a.addr(), b.addr()]);
    let results = concurrently(100, Duration::from_secs(20), |i| {
        let client = client.clone();
        let addrs = addrs.clone();
        async move {
            client
                .try_get(&url(addrs[i % 2], "/api/items/stampede"))
                .await
        }
    })
    .await;
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for (i, r) in results.iter().enumerate() {
        match r {
            Ok(r) => {
                assert_eq!(r.status, 200, "client {i}: {r}");
                *outcomes
                    .entry(format!("{} {}", r.x_cache(), r.text()))
                    .or_default() += 1;
            }
            Err(e) => panic!("client {i}: {e}"),
        }
    }
    assert_eq!(
        origin.count("/api/items/stampede"),
        1,
        "100 concurrent misses spread over two instances made more than one origin request; \
         answers (x-cache body => clients): {outcomes:?}"
    );
    let expected = default_body("/api/items/stampede", 1);
    for (i, r) in results.iter().enumerate() {
        if let Ok(r) = r {
            assert_eq!(r.body, expected, "client {i}: {r}");
        }
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// A 10 MiB entry read by 30 clients at once, twice, on the instance that filled it and on
/// another, in every `l1` mode: one origin fetch, every answer the whole body from a cache
/// tier, Redis never marked down. A large value is written and read on the bulk connection
/// (the shared one only carries its first 256 KiB), and concurrent reads of the key share
/// them: before, the 10 MiB write or the 30 reads timed out at `command_timeout` (the
/// harness's 200 ms here; the default 50 ms is too tight for any command of a debug build on
/// a loaded box), so requests were MISSes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_entry_is_stored_once_and_read_by_many_from_the_cache() {
    const BODY: usize = 10 * 1024 * 1024;
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let body = bytes::Bytes::from(vec![b'y'; BODY]);
    let client = HttpClient::new();
    for l1 in ["off", "hot", "all"] {
        let path = format!("/api/items/big-{l1}");
        origin.set_body(&path, body.clone());
        let cfg = CgConfig::new(&origin)
            .redis(&redis)
            .l1(l1)
            .routes(&common::item_route("max_entry_bytes = 16777216"));
        let a = cfg.start().await;
        let b = cfg.start().await;
        let first = client.get(&url(a.addr(), &path)).await;
        assert_eq!(first.status, 200, "l1 = {l1}: {first}");
        assert_eq!(first.body.len(), BODY, "l1 = {l1}");
        for (name, instance) in [("A", &a), ("B", &b)] {
            for round in 0..2 {
                let target = url(instance.addr(), &path);
                let answers = concurrently(30, Duration::from_secs(60), |_| {
                    let (client, target) = (client.clone(), target.clone());
                    async move { client.get(&target).await }
                })
                .await;
                for answer in answers {
                    assert_eq!(answer.status, 200, "l1 = {l1}, {name}, round {round}");
                    assert_eq!(answer.body.len(), BODY, "l1 = {l1}, {name}, round {round}");
                    assert!(
                        answer.is_hit(),
                        "l1 = {l1}, {name}, round {round}: {}",
                        answer.x_cache()
                    );
                }
            }
        }
        assert_eq!(origin.count(&path), 1, "l1 = {l1}: fetched more than once");
        for instance in [&a, &b] {
            let opened = common::metric(
                &client,
                instance.admin_addr(),
                "cacheguard_redis_breaker_transitions_total",
                &[("to", "open")],
            )
            .await;
            assert_eq!(opened, 0.0, "l1 = {l1}: the breaker opened");
        }
        a.shutdown().await;
        b.shutdown().await;
    }
}
