//! Lookup and fill agree on the Redis key of every cache key: a plain path, a query
//! variant and a route-`vary` variant stored through one instance are L2 hits through
//! another, in every `l1` mode, on a standalone Redis and on a Redis Cluster.
//!
//! With `l1 = "all"` the storing instance answers its own repeats from L1, which would hide
//! an L2 miss; so every case is also read through a second instance, and with `l1` off or
//! `hot` the storing instance's own repeat must come from Redis as well.

use std::time::Duration;

use crate::common;
use crate::common::load::Load;
use crate::common::{
    CgConfig, HttpClient, RedisCluster, RedisServer, SharedRedis, TestOrigin, item_route,
    poll_until, url,
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

/// The defaults under test: `max_variants` and `variant_overflow_rate`.
const BUDGET: usize = 64;
const OVERFLOW_RATE: f64 = 10.0;

/// The instance of `mode`: embedded, or shared on `redis` with `l1` = `mode` (each mode
/// under its own key prefix, so no mode finds another's entries).
fn in_mode(cfg: CgConfig, mode: &str, redis: &RedisServer) -> CgConfig {
    if mode == "embedded" {
        return cfg;
    }
    cfg.redis(redis)
        .l1(mode)
        .set_str("redis", "key_prefix", &format!("{mode}:"))
}

/// `cacheguard_new_variants_total{route="item",outcome}`.
async fn new_variants(client: &HttpClient, cg: &cacheguard::Running, outcome: &str) -> f64 {
    common::metric(
        client,
        cg.admin_addr(),
        "cacheguard_new_variants_total",
        &[("route", "item"), ("outcome", outcome)],
    )
    .await
}

/// `GET /api/items/7001?x=<random>` with the default `query = "sorted"` and
/// `variant_overflow_rate = 0`: each request is a new key, and a path costs at most
/// `max_variants` (64) fetches per `ttl` (per instance); the misses beyond are refused with
/// 429 and a `Retry-After` of the window, and counted; admitted variants are still served
/// (from the cache), and the path itself is untouched. Embedded, and shared with `l1` off
/// and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_overflow_rate_random_parameters_cost_the_budget_and_no_more() {
    const SENT: usize = 200;
    let redis = RedisServer::start().await;
    let mut wrong = Vec::new();
    for mode in ["embedded", "off", "all"] {
        let origin = TestOrigin::start().await;
        let cfg = CgConfig::new(&origin).set("cache", "variant_overflow_rate", "0");
        let cg = in_mode(cfg, mode, &redis).start().await;
        let client = HttpClient::new();
        let path = "/api/items/7001";
        let mut refused = 0;
        for i in 0..SENT {
            let r = client
                .get(&url(cg.addr(), &format!("{path}?x={i:08x}")))
                .await;
            match r.status.as_u16() {
                200 => {}
                429 if r.header("retry-after").as_deref() == Some("60") => refused += 1,
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
        let counted = [
            new_variants(&client, &cg, "budget").await,
            new_variants(&client, &cg, "refused").await,
        ];
        if counted != [BUDGET as f64, refused as f64] {
            wrong.push(format!(
                "{mode}: counted (budget, refused) {counted:?}, saw {BUDGET} and {refused}"
            ));
        }
        cg.shutdown().await;
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// A flood of random parameters (`?x=<n>`, 8 connections, each value sent once) spends
/// `/api/items/7002`'s budget of 64 variants. During it, a real client asks for a variant
/// of its own (`?page=2`) twice, as a second user or a retry would: the second ask is
/// answered 200 and cached (a third is a hit), because a variant asked for before is
/// admitted beyond the budget on the route's overflow rate, half of which first asks never
/// reach. The flood's origin cost stays within the budget plus the overflow rate (10 per
/// second, with a burst of 10) over the flood's length, and every new variant is counted
/// by its outcome. Embedded, and shared with `l1` off and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_variant_is_answered_during_a_random_parameter_flood() {
    const FLOOD_FOR: Duration = Duration::from_secs(3);
    const FLOOD_MAX: u64 = 3_000;
    let redis = RedisServer::start().await;
    let mut wrong = Vec::new();
    for mode in ["embedded", "off", "all"] {
        let origin = TestOrigin::start().await;
        let cg = in_mode(CgConfig::new(&origin), mode, &redis).start().await;
        let client = HttpClient::new();
        let path = "/api/items/7002";
        let flood = Load::new(&[cg.addr()], move |n| format!("{path}?x={n:016x}"))
            .conns(8)
            .duration(FLOOD_FOR)
            .max_requests(FLOOD_MAX)
            .start();
        // The budget is spent, and the flood's first asks are being refused.
        let spent = poll_until(FLOOD_FOR, Duration::from_millis(20), || async {
            (origin.count(path) as usize >= BUDGET
                && new_variants(&client, &cg, "refused").await > 0.0)
                .then_some(())
        })
        .await;
        if spent.is_none() {
            wrong.push(format!(
                "{mode}: the flood did not spend the budget ({} fetches) and get refusals",
                origin.count(path)
            ));
        }
        let real = url(cg.addr(), &format!("{path}?page=2"));
        let first = client.get(&real).await;
        let second = client.get(&real).await;
        let third = client.get(&real).await;
        let real_done = flood.started.elapsed();
        let tally = flood.join().await;
        let after_real = tally
            .timeline
            .iter()
            .filter(|seen| seen.at > real_done)
            .count();
        if after_real < 100 {
            wrong.push(format!(
                "{mode}: the flood ended with the real asks ({after_real} answers after them)"
            ));
        }
        let flood_secs = tally
            .timeline
            .last()
            .map_or(FLOOD_FOR, |seen| seen.at)
            .as_secs_f64();

        if !(first.status == 200 && first.x_cache() == "BYPASS" || first.status == 429) {
            wrong.push(format!("{mode}: the real variant's first ask: {first}"));
        }
        if second.status != 200 || second.x_cache() != "MISS" {
            wrong.push(format!(
                "{mode}: the real variant asked again during the flood: {second}"
            ));
        }
        if third.status != 200 || !third.is_hit() {
            wrong.push(format!("{mode}: the real variant a third time: {third}"));
        }
        // Each flood value is sent once, so every fetch is one new variant's.
        let fetched = origin.count(path) as f64;
        let bound = BUDGET as f64 + OVERFLOW_RATE * (1.0 + flood_secs.ceil());
        let counted: Vec<f64> = futures_util::future::join_all(
            ["budget", "repeat", "uncached", "refused"].map(|o| new_variants(&client, &cg, o)),
        )
        .await;
        let [budget, repeat, uncached, refused] = counted[..] else {
            unreachable!("four outcomes")
        };
        if fetched > bound || tally.answers < 2 * bound as u64 {
            wrong.push(format!(
                "{mode}: {fetched} origin fetches for {} flood requests in {flood_secs:.1} s \
                 (bound {bound})",
                tally.answers
            ));
        }
        if budget != BUDGET as f64 || repeat < 1.0 || budget + repeat + uncached != fetched {
            wrong.push(format!(
                "{mode}: counted budget {budget}, repeat {repeat}, uncached {uncached}, \
                 refused {refused}; {fetched} origin fetches"
            ));
        }
        let flood_refused = tally.by_status.get(&429).copied().unwrap_or(0) as f64;
        let real_refused = f64::from(u8::from(first.status == 429));
        if refused != flood_refused + real_refused
            || tally.answers
                != tally.by_status.get(&200).copied().unwrap_or(0) + flood_refused as u64
        {
            wrong.push(format!(
                "{mode}: {refused} refusals counted; the flood saw {:?}",
                tally.by_status
            ));
        }
        cg.shutdown().await;
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
