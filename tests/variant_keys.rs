//! Lookup and fill agree on the Redis key of every cache key: a plain path, a query
//! variant and a route-`vary` variant stored through one instance are L2 hits through
//! another, in every `l1` mode, on a standalone Redis and on a Redis Cluster.
//!
//! With `l1 = "all"` the storing instance answers its own repeats from L1, which would hide
//! an L2 miss; so every case is also read through a second instance, and with `l1` off or
//! `hot` the storing instance's own repeat must come from Redis as well.

mod common;

use common::{
    CgConfig, HttpClient, RedisCluster, RedisServer, SharedRedis, TestOrigin, item_route, url,
};

/// Route `item`, keyed on its sorted query and on `accept-language`.
fn item_variants_route() -> String {
    item_route(
        r#"
query = "sorted"
vary = ["accept-language"]
"#,
    )
}

/// One request shape: the path (with any query) and the headers it is sent with.
struct Case {
    name: &'static str,
    path: &'static str,
    headers: &'static [(&'static str, &'static str)],
}

const CASES: [Case; 3] = [
    Case {
        name: "plain path",
        path: "/api/items/plain",
        headers: &[],
    },
    Case {
        name: "query variant",
        path: "/api/items/query?b=2&a=1",
        headers: &[],
    },
    Case {
        name: "route-vary variant",
        path: "/api/items/vary",
        headers: &[("accept-language", "fr")],
    },
];

/// For each `l1` mode: instance A fetches each case once (MISS), B reads it from Redis
/// (HIT-L2), and A's repeat is an L1 hit with `l1 = "all"` and an L2 hit otherwise. The
/// origin sees each case exactly once.
async fn every_case_is_an_l2_hit_through_another_instance(redis: &impl SharedRedis) {
    let client = HttpClient::new();
    // Every cell of the matrix is tried; the failures are reported together.
    let mut wrong = Vec::new();
    for l1 in ["off", "hot", "all"] {
        let origin = TestOrigin::start().await;
        let cfg = redis.configure(CgConfig::new(&origin).routes(&item_variants_route()).l1(l1));
        let (a, b) = (cfg.start().await, cfg.start().await);
        // Each mode gets its own paths, so the entries the previous mode left in Redis
        // cannot answer for it.
        for case in &CASES {
            let path = case
                .path
                .replacen("/api/items/", &format!("/api/items/{l1}-"), 1);
            let get = |addr| {
                let u = url(addr, &path);
                let client = client.clone();
                async move { client.get_with_headers(&u, case.headers).await }
            };
            let first = get(a.addr()).await;
            let other = get(b.addr()).await;
            let again = get(a.addr()).await;
            let seen = [&first, &other, &again].map(|r| (r.status.as_u16(), r.x_cache()));
            let repeat = if l1 == "all" { "HIT-L1" } else { "HIT-L2" };
            let expected =
                [(200, "MISS"), (200, "HIT-L2"), (200, repeat)].map(|(s, c)| (s, c.to_owned()));
            let path_only = path.split('?').next().unwrap_or(&path);
            let fetches = origin.count(path_only);
            if seen != expected || other.body != first.body || fetches != 1 {
                wrong.push(format!(
                    "l1 = {l1}, {} ({path}): answers {seen:?}, origin fetches {fetches}, same body {}",
                    case.name,
                    other.body == first.body
                ));
            }
        }
        a.shutdown().await;
        b.shutdown().await;
    }
    assert!(
        wrong.is_empty(),
        "expected MISS, HIT-L2, then HIT-L1 (l1 = all) or HIT-L2, with one origin fetch:\n{}",
        wrong.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variants_hit_l2_across_instances_on_standalone_redis() {
    let redis = RedisServer::start().await;
    every_case_is_an_l2_hit_through_another_instance(&redis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variants_hit_l2_across_instances_on_a_cluster() {
    let cluster = RedisCluster::start().await;
    every_case_is_an_l2_hit_through_another_instance(&cluster).await;
}

/// `GET /api/items/7001?x=<random>` with the default `query = "sorted"`: each request is a
/// new key, so without a bound every one is an origin fetch and an entry. With the default
/// `max_variants = 64` a path costs at most 64 fetches per `ttl` (per instance); the misses
/// beyond are refused with 429 and `Retry-After` and counted, admitted variants are still
/// served (from the cache), and the path itself is untouched. Embedded, and shared with
/// `l1` off and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_query_parameters_cost_a_bounded_number_of_fetches() {
    const SENT: usize = 200;
    const BUDGET: usize = 64;
    let redis = RedisServer::start().await;
    let mut wrong = Vec::new();
    for mode in ["embedded", "off", "all"] {
        let origin = TestOrigin::start().await;
        let mut cfg = CgConfig::new(&origin);
        if mode != "embedded" {
            cfg = cfg
                .redis(&redis)
                .l1(mode)
                .set_str("redis", "key_prefix", &format!("{mode}:"));
        }
        let cg = cfg.start().await;
        let client = HttpClient::new();
        let path = "/api/items/7001";
        let mut refused = 0;
        for i in 0..SENT {
            let r = client
                .get(&url(cg.addr(), &format!("{path}?x={i:08x}")))
                .await;
            match r.status.as_u16() {
                200 => {}
                429 if r.header("retry-after").is_some() => refused += 1,
                _ => wrong.push(format!("{mode}: ?x={i}: {r}")),
            }
        }
        let fetched = origin.count(path);
        if fetched as usize > BUDGET || refused != SENT - BUDGET {
            wrong.push(format!(
                "{mode}: {fetched} origin fetches, {refused} refused"
            ));
        }
        let again = client
            .get(&url(cg.addr(), &format!("{path}?x={:08x}", 3)))
            .await;
        if again.status != 200 || !again.is_hit() {
            wrong.push(format!("{mode}: an admitted variant again: {again}"));
        }
        let base = client.get(&url(cg.addr(), path)).await;
        if base.status != 200 {
            wrong.push(format!("{mode}: the path itself: {base}"));
        }
        let counted = common::metric(
            &client,
            cg.admin_addr(),
            "cacheguard_variants_refused_total",
            &[("route", "item")],
        )
        .await;
        if counted != refused as f64 {
            wrong.push(format!("{mode}: {counted} counted, {refused} refused"));
        }
        cg.shutdown().await;
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
