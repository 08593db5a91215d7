//! The stock gate's own promises, one at a time, against the flash-sale shop
//! (`common::shop`) and real Redis servers: sold out from memory, units given back,
//! idempotency keys, a source that gives no count, one load for the crowd at a sale's
//! opening, Redis down, the sold-out mark on other instances, and the configurations
//! `--check-config` refuses. The same gate under faults,
//! judged by the history checkers, is `tests/it/flash_sale.rs`.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common;
use crate::common::history::Epoch;
use crate::common::redis_server::{command_calls, reset_command_stats};
use crate::common::shop::{Fault, Scope, Shop, orders_path, seat};
use crate::common::{
    AnyRedis, CgConfig, HttpClient, RedisCluster, RedisServer, Resp, metrics, post, route, url,
};

const STOCK: &str = r#"
[[stock]]
name = "seats"
key = "/trains/{train}/seats/{type}"
source = { path = "/internal/stock/{train}/{type}", json = "/remaining" }
reconcile = "5s"
reservation_ttl = "3s"
"#;

fn buy_route() -> String {
    route(
        "buy",
        "/trains/{train}/seats/{type}/orders",
        "POST",
        r#"stock = { gate = "seats", units = 1 }"#,
    )
}

/// cacheguard in front of `shop`, with the gate (`extra` lines in its table), in shared
/// mode on `redis` or embedded.
fn config(shop: &Shop, redis: Option<&RedisServer>, extra: &str) -> CgConfig {
    let cfg = CgConfig::with_upstream(&shop.url())
        .set("upstream", "timeout", "\"1s\"")
        .set("lock", "wait_timeout", "\"1s\"")
        .routes(&format!("{}{STOCK}{extra}", buy_route()));
    match redis {
        Some(redis) => cfg.redis(redis),
        None => cfg,
    }
}

async fn buy(
    client: &HttpClient,
    addr: SocketAddr,
    resource: &str,
    key: Option<&str>,
    body: &str,
) -> Resp {
    let headers: Vec<(&str, &str)> = key.map(|k| ("idempotency-key", k)).into_iter().collect();
    post(client, &url(addr, &orders_path(resource)), &headers, body).await
}

async fn stock_metric(
    client: &HttpClient,
    admin: SocketAddr,
    family: &str,
    label: &str,
    value: &str,
) -> f64 {
    metrics(client, admin)
        .await
        .sum(family, &[("gate", "seats"), (label, value)])
}

/// In each mode: units sell, the rest is answered sold out, and once sold out the answer
/// comes from memory — no Redis command, no request at the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sold_out_resource_is_answered_from_memory() {
    for shared in [false, true] {
        let resource = seat("t1", "a");
        let shop = Shop::start(Epoch::now(), &[(resource.clone(), 3)]).await;
        let redis = if shared {
            Some(RedisServer::start().await)
        } else {
            None
        };
        let cg = config(&shop, redis.as_ref(), "").start().await;
        let client = HttpClient::new();
        let mut sold = 0;
        for i in 0..6 {
            let resp = buy(
                &client,
                cg.addr(),
                &resource,
                None,
                &format!("{{\"n\":{i}}}"),
            )
            .await;
            match resp.status.as_u16() {
                201 => sold += 1,
                409 => assert_eq!(resp.x_cache(), "SOLDOUT", "{resp:?}"),
                other => panic!("unexpected {other}: {resp:?}"),
            }
        }
        assert_eq!(sold, 3, "shared={shared}");
        // The last sale is settled in a batch after its answer, and asks for a reconcile
        // (the segment is sold out with no buy in flight): both are done before the count.
        sales_settled(&client, &cg).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = shop.sale_log().buy_requests();
        let mut con = match &redis {
            Some(redis) => Some(redis.client().await),
            None => None,
        };
        if let Some(con) = con.as_mut() {
            reset_command_stats(con).await;
        }
        for _ in 0..50 {
            let resp = buy(&client, cg.addr(), &resource, None, "{}").await;
            assert_eq!(
                (resp.status.as_u16(), resp.x_cache()),
                (409, "SOLDOUT".to_owned())
            );
            assert_eq!(resp.header("cache-control").as_deref(), Some("no-store"));
            assert_eq!(
                resp.text(),
                r#"{"type":"sold-out","title":"Sold out","status":409}"#
            );
        }
        assert_eq!(
            shop.sale_log().buy_requests(),
            before,
            "no sold-out buy reached the origin"
        );
        if let Some(con) = con.as_mut() {
            let calls = command_calls(con).await;
            let scripts: u64 = calls
                .iter()
                .filter(|(name, _)| name.starts_with("eval"))
                .map(|(_, n)| n)
                .sum();
            assert_eq!(scripts, 0, "sold out from memory: {calls:?}");
        }
        let local = stock_metric(
            &client,
            cg.admin_addr(),
            "cacheguard_stock_requests_total",
            "outcome",
            "sold_out_local",
        )
        .await;
        assert!(local >= 50.0, "shared={shared}: {local}");
        cg.shutdown().await;
    }
}

/// A `not_sold` answer gives the unit back at once; an `origin_sold_out` one sets the gate
/// to 0 (and a reconcile puts back what the origin still has).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_sold_answers_give_the_unit_back() {
    let resource = seat("t1", "b");
    let shop = Shop::start(Epoch::now(), &[(resource.clone(), 1)]).await;
    let redis = RedisServer::start().await;
    let cg = config(&shop, Some(&redis), "").start().await;
    let client = HttpClient::new();
    let path = orders_path(&resource);
    shop.set_fault(Scope::Path(path.clone()), Fault::Status(402));
    let declined = buy(&client, cg.addr(), &resource, None, "{}").await;
    assert_eq!(
        declined.status.as_u16(),
        402,
        "the origin's answer, as it is"
    );
    shop.heal();
    let sold = buy(&client, cg.addr(), &resource, None, "{}").await;
    assert_eq!(
        sold.status.as_u16(),
        201,
        "the declined buy's unit came back: {sold:?}"
    );
    let after = buy(&client, cg.addr(), &resource, None, "{}").await;
    assert_eq!(after.x_cache(), "SOLDOUT");
    let returned = stock_metric(
        &client,
        cg.admin_addr(),
        "cacheguard_stock_settled_total",
        "result",
        "returned",
    )
    .await;
    assert_eq!(returned, 1.0);
    cg.shutdown().await;
}

/// Idempotency keys: a replay of a completed buy, 422 for another body, 409 while the first
/// is in flight, 400 for a key that is none; one key never takes two units.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_replay_refuse_and_never_take_two_units() {
    for shared in [false, true] {
        let resource = seat("t2", "a");
        let shop = Shop::start(Epoch::now(), &[(resource.clone(), 5)]).await;
        let redis = if shared {
            Some(RedisServer::start().await)
        } else {
            None
        };
        let cg = config(&shop, redis.as_ref(), "").start().await;
        let client = HttpClient::new();
        let first = buy(
            &client,
            cg.addr(),
            &resource,
            Some("k-1"),
            r#"{"seat":"12A"}"#,
        )
        .await;
        assert_eq!(first.status.as_u16(), 201, "{first:?}");
        let again = buy(
            &client,
            cg.addr(),
            &resource,
            Some("k-1"),
            r#"{"seat":"12A"}"#,
        )
        .await;
        assert_eq!(again.status.as_u16(), 201);
        assert_eq!(again.x_cache(), "REPLAYED");
        assert_eq!(again.header("idempotent-replayed").as_deref(), Some("true"));
        assert_eq!(again.body, first.body, "the first answer, replayed");
        let other = buy(
            &client,
            cg.addr(),
            &resource,
            Some("k-1"),
            r#"{"seat":"12B"}"#,
        )
        .await;
        assert_eq!(other.status.as_u16(), 422, "{other:?}");
        let long = "k".repeat(256);
        assert_eq!(
            buy(&client, cg.addr(), &resource, Some(&long), "{}")
                .await
                .status
                .as_u16(),
            400
        );
        assert_eq!(
            buy(&client, cg.addr(), &resource, Some("a b"), "{}")
                .await
                .status
                .as_u16(),
            400
        );
        // In flight: the origin holds the first; a retry with its key is told to wait.
        shop.set_fault(Scope::Path(orders_path(&resource)), Fault::Hang);
        let (c, addr, r) = (client.clone(), cg.addr(), resource.clone());
        let held = tokio::spawn(async move { buy(&c, addr, &r, Some("k-2"), "{}").await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let retry = buy(&client, cg.addr(), &resource, Some("k-2"), "{}").await;
        assert_eq!(retry.status.as_u16(), 409, "{retry:?}");
        assert!(retry.header("retry-after").is_some());
        shop.heal();
        shop.release();
        let _ = held.await;
        assert_eq!(
            shop.sale_log()
                .sales
                .iter()
                .filter(|s| s.idempotency_key.as_deref() == Some("k-1"))
                .count(),
            1,
            "shared={shared}"
        );
        assert!(
            shop.sale_log()
                .sales
                .iter()
                .filter(|s| s.idempotency_key.as_deref() == Some("k-2"))
                .count()
                <= 1,
            "one key never takes two units"
        );
        cg.shutdown().await;
    }
}

/// A source that gives no count (no such field): nothing is admitted, 503, and no buy
/// reaches the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_without_a_count_admits_nothing() {
    let resource = seat("t3", "a");
    let shop = Shop::start(Epoch::now(), &[(resource.clone(), 5)]).await;
    let redis = RedisServer::start().await;
    let toml = config(&shop, Some(&redis), "")
        .toml()
        .replace(r#"json = "/remaining""#, r#"json = "/left""#);
    let cg = common::start_cacheguard(&toml).await;
    let client = HttpClient::new();
    for _ in 0..3 {
        let resp = buy(&client, cg.addr(), &resource, None, "{}").await;
        assert_eq!(resp.status.as_u16(), 503, "{resp:?}");
        assert!(resp.header("retry-after").is_some());
    }
    assert_eq!(shop.sale_log().sales.len(), 0);
    let failed = stock_metric(
        &client,
        cg.admin_addr(),
        "cacheguard_stock_requests_total",
        "outcome",
        "not_loaded",
    )
    .await;
    assert_eq!(failed, 3.0);
    cg.shutdown().await;
}

/// Redis down: `reject` answers 503 with Retry-After and the origin sees nothing;
/// `forward` lets the origin decide and counts every ungated buy.
/// The crowd at a sale's opening finds the resource unloaded all at once. The first buy
/// loads it from the shop's count; the others wait for that load and take it. They used to
/// ask the source once each, one after another (a reconcile per buyer, in turn): 40 buyers,
/// 40 source requests, the last buyer served seconds late. Embedded and shared mode (the
/// load is the gate's, whatever the ledger).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_opening_crowd_loads_the_resource_once() {
    const BUYERS: usize = 40;
    let redis = RedisServer::start().await;
    for shared in [false, true] {
        let resource = seat("t1", "a");
        let shop = Shop::start(Epoch::now(), &[(resource.clone(), 1_000)]).await;
        // A count slow enough that the whole crowd arrives while it is asked.
        shop.set_latency(Scope::Stock, Duration::from_millis(100));
        let cg = config(&shop, shared.then_some(&redis), "").start().await;
        let client = HttpClient::new();
        let addr = cg.addr();
        let statuses = common::concurrently(BUYERS, Duration::from_secs(30), |i| {
            let (client, resource) = (client.clone(), resource.clone());
            async move {
                let body = format!("{{\"n\":{i}}}");
                buy(&client, addr, &resource, None, &body)
                    .await
                    .status
                    .as_u16()
            }
        })
        .await;
        assert!(
            statuses.iter().all(|s| *s == 201),
            "shared={shared}: {statuses:?}"
        );
        // Every request the shop had but the buys: the gate's loads of the count.
        let loads = shop.requests() - BUYERS as u64;
        assert_eq!(
            loads, 1,
            "shared={shared}: the count was asked {loads} times for {BUYERS} buyers at the opening"
        );
        cg.shutdown().await;
    }
}

/// A shop with `units` of `resource`, cacheguard in front of it in shared mode with
/// `on_redis_error = policy`, and one unit sold through it (the gate is loaded).
async fn one_sold(
    resource: &str,
    units: u64,
    policy: &str,
) -> (Shop, RedisServer, cacheguard::Running, HttpClient) {
    let shop = Shop::start(Epoch::now(), &[(resource.to_owned(), units)]).await;
    let redis = RedisServer::start().await;
    let cg = config(
        &shop,
        Some(&redis),
        &format!("on_redis_error = \"{policy}\"\n"),
    )
    .start()
    .await;
    let client = HttpClient::new();
    let first = buy(&client, cg.addr(), resource, None, "{}").await;
    assert_eq!(first.status.as_u16(), 201, "{policy}: {first:?}");
    // The sale is settled in a batch just after its answer: settled before any fault.
    sales_settled(&client, &cg).await;
    (shop, redis, cg, client)
}

/// Over the primaries of `redis`: the calls of each command since their stats were reset,
/// the members of the gate's keys whose names end in each of `suffixes`, and the gate's
/// keys that have no expiry.
async fn primaries_report(
    redis: &AnyRedis,
    suffixes: &[&str],
) -> (
    std::collections::BTreeMap<String, u64>,
    Vec<u64>,
    Vec<String>,
) {
    let mut calls = std::collections::BTreeMap::new();
    let mut members = vec![0; suffixes.len()];
    let mut lasting = Vec::new();
    for mut con in redis.primary_connections().await {
        for (name, n) in command_calls(&mut con).await {
            *calls.entry(name).or_insert(0) += n;
        }
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*stock:*")
            .query_async(&mut con)
            .await
            .expect("KEYS");
        for key in keys {
            let pttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut con)
                .await
                .expect("PTTL");
            if pttl == -1 {
                lasting.push(key.clone());
            }
            if let Some(i) = suffixes.iter().position(|s| key.ends_with(s)) {
                let n: u64 = redis::cmd("ZCARD")
                    .arg(&key)
                    .query_async(&mut con)
                    .await
                    .expect("ZCARD");
                members[i] += n;
            }
        }
    }
    (calls, members, lasting)
}

/// In every mode: sales without an idempotency key are settled in batches after their
/// answers. 64 buys at once take far fewer settlement calls than sales (in Redis, fewer
/// scripts than a BUY and a SETTLE each, and at most 8 commands per buy, everything
/// counted), and once settled no reservation is left, every sale is in the consumed set,
/// as when each was settled on its own, and every key of the gate still expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sales_are_settled_in_batches() {
    const CROWD: usize = 64;
    for mode in ["embedded", "standalone", "sentinel", "cluster"] {
        let resource = seat("t9", "a");
        let shop = Shop::start(Epoch::now(), &[(resource.clone(), 1000)]).await;
        let redis = match mode {
            "embedded" => None,
            mode => Some(AnyRedis::start(mode).await),
        };
        let cg = match &redis {
            Some(redis) => config(&shop, None, "").any_redis(redis),
            None => config(&shop, None, ""),
        }
        .start()
        .await;
        let client = HttpClient::new();
        // The resource loaded, the scripts too.
        let first = buy(&client, cg.addr(), &resource, None, "{}").await;
        assert_eq!(first.status.as_u16(), 201, "{mode}: {first:?}");
        sales_settled(&client, &cg).await;
        if let Some(redis) = &redis {
            for mut con in redis.primary_connections().await {
                reset_command_stats(&mut con).await;
            }
        }
        let batches_before = stock_metric(
            &client,
            cg.admin_addr(),
            "cacheguard_stock_sale_batches_total",
            "gate",
            "seats",
        )
        .await;
        let tasks: Vec<_> = (0..CROWD)
            .map(|i| {
                let (client, addr, resource) = (client.clone(), cg.addr(), resource.clone());
                tokio::spawn(async move {
                    buy(&client, addr, &resource, None, &format!("{{\"n\":{i}}}")).await
                })
            })
            .collect();
        for answer in common::join_within(tasks, Duration::from_secs(30), "buys").await {
            assert_eq!(answer.status.as_u16(), 201, "{mode}: {answer:?}");
        }
        sales_settled(&client, &cg).await;
        let batches = stock_metric(
            &client,
            cg.admin_addr(),
            "cacheguard_stock_sale_batches_total",
            "gate",
            "seats",
        )
        .await
            - batches_before;
        assert!(
            batches >= 1.0 && batches <= (CROWD / 4) as f64,
            "{mode}: {CROWD} sales settled in {batches} calls"
        );
        if let Some(redis) = &redis {
            let (calls, members, lasting) = primaries_report(redis, &[":res", ":done"]).await;
            let scripts = calls.get("evalsha").copied().unwrap_or(0);
            assert!(
                scripts <= (CROWD + CROWD / 4) as u64,
                "{mode}: {scripts} scripts for {CROWD} buys: {calls:?}"
            );
            // Every command the primaries executed meanwhile (the instance's background
            // ones too): BUY is 6 (EVALSHA TIME HMGET ZRANGEBYSCORE HSET ZADD) while its
            // keys are fresh, and a batch of sales 9.
            let commands: u64 = calls
                .iter()
                .filter(|(name, _)| name.as_str() != "config|resetstat")
                .map(|(_, n)| n)
                .sum();
            assert!(
                commands <= 8 * CROWD as u64,
                "{mode}: {commands} commands for {CROWD} buys: {calls:?}"
            );
            assert!(
                lasting.is_empty(),
                "{mode}: keys without expiry: {lasting:?}"
            );
            assert_eq!(
                members,
                [0, CROWD as u64 + 1],
                "{mode}: reservations left, sales consumed"
            );
        }
        assert_eq!(shop.sale_log().sold(), CROWD as u64 + 1, "{mode}");
        cg.shutdown().await;
    }
}

/// Waits until the sales `cg` answered are settled (none waits for its batch).
async fn sales_settled(client: &HttpClient, cg: &cacheguard::Running) {
    let settled = common::poll_until(Duration::from_secs(5), Duration::from_millis(5), || async {
        let queued = metrics(client, cg.admin_addr())
            .await
            .sum("cacheguard_stock_sales_queued", &[("gate", "seats")]);
        (queued == 0.0).then_some(())
    })
    .await;
    assert!(
        settled.is_some(),
        "sales still wait for their batch after 5 s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_rejects_or_forwards_as_configured() {
    for (policy, status) in [("reject", 503), ("forward", 201)] {
        let resource = seat("t4", "a");
        let (shop, mut redis, cg, client) = one_sold(&resource, 10, policy).await;
        redis.kill();
        for _ in 0..3 {
            let resp = buy(&client, cg.addr(), &resource, None, "{}").await;
            assert_eq!(resp.status.as_u16(), status, "{policy}: {resp:?}");
        }
        let (outcome, sales) = if policy == "reject" {
            ("unavailable", 1)
        } else {
            ("ungated", 4)
        };
        assert_eq!(shop.sale_log().sales.len(), sales, "{policy}");
        let counted = stock_metric(
            &client,
            cg.admin_addr(),
            "cacheguard_stock_requests_total",
            "outcome",
            outcome,
        )
        .await;
        assert_eq!(counted, 3.0, "{policy}");
        cg.shutdown().await;
    }
}

/// A crowd refused while the Redis breaker is open leaves nothing behind: Redis was not
/// asked, so there is no unit to give back and no task that keeps trying to. (Each refusal
/// used to start one, retrying for `reservation_ttl`: a flash sale's crowd during an outage
/// piled up tasks by the thousand, and their retries, let loose when the breaker closed,
/// timed out and opened it again.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buys_refused_while_redis_is_down_leave_no_retries() {
    const CROWD: usize = 40;
    for (policy, status) in [("reject", 503), ("forward", 201)] {
        let resource = seat("t6", "a");
        let (_shop, mut redis, cg, client) = one_sold(&resource, 1000, policy).await;
        redis.kill();
        // The breaker's own check finds Redis gone; no buy is sent before it has.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while metrics(&client, cg.admin_addr())
            .await
            .value_or_zero("cacheguard_redis_breaker_open")
            < 1.0
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{policy}: the breaker did not open"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for _ in 0..CROWD {
            let resp = buy(&client, cg.addr(), &resource, None, "{}").await;
            assert_eq!(resp.status.as_u16(), status, "{policy}: {resp:?}");
        }
        let errors = |m: common::prom::Exposition| {
            m.sum("cacheguard_stock_redis_errors_total", &[("gate", "seats")])
        };
        let after = errors(metrics(&client, cg.admin_addr()).await);
        // Retries of a give-back start 50 ms after it failed and double: within this wait
        // every one of them would have tried four times or more.
        tokio::time::sleep(Duration::from_millis(1600)).await;
        let later = errors(metrics(&client, cg.admin_addr()).await);
        assert!(
            later - after <= 2.0,
            "{policy}: {} Redis errors after the crowd was answered (from {after} to {later}): \
             the refusals left tasks retrying",
            later - after
        );
        cg.shutdown().await;
    }
}

/// The sold-out mark reaches another instance over the bus: it answers from memory without
/// having asked Redis for the resource itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sold_out_mark_reaches_other_instances() {
    let resource = seat("t5", "a");
    let shop = Shop::start(Epoch::now(), &[(resource.clone(), 2)]).await;
    let redis = RedisServer::start().await;
    let cfg = config(&shop, Some(&redis), "");
    let client = HttpClient::new();
    let [a, b] = common::fleet::start_coordinated::<2>(&cfg, &client).await;
    for _ in 0..2 {
        assert_eq!(
            buy(&client, a.addr(), &resource, None, "{}")
                .await
                .status
                .as_u16(),
            201
        );
    }
    // B never asked for this resource: it heard the mark on the bus.
    let mut con = redis.client().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    reset_command_stats(&mut con).await;
    let resp = buy(&client, b.addr(), &resource, None, "{}").await;
    assert_eq!(resp.x_cache(), "SOLDOUT");
    let calls = command_calls(&mut con).await;
    assert!(
        !calls.keys().any(|name| name.starts_with("eval")),
        "B answered from the mark it heard: {calls:?}"
    );
    common::fleet::shutdown_all([a, b]).await;
}

/// Where a gate counts, for the tests that run in each mode.
enum Ledger {
    Embedded,
    Standalone(RedisServer),
    Cluster(RedisCluster),
}

impl Ledger {
    async fn each() -> [Ledger; 3] {
        [
            Ledger::Embedded,
            Ledger::Standalone(RedisServer::start().await),
            Ledger::Cluster(RedisCluster::start().await),
        ]
    }

    fn name(&self) -> &'static str {
        match self {
            Ledger::Embedded => "embedded",
            Ledger::Standalone(_) => "standalone",
            Ledger::Cluster(_) => "cluster",
        }
    }

    /// cacheguard in front of `shop` with the gate (`extra` lines in its table) counting
    /// here; on the cluster, over three segments (the key's record and its reservation may
    /// live on different nodes).
    fn config(&self, shop: &Shop, extra: &str) -> CgConfig {
        match self {
            Ledger::Embedded => config(shop, None, extra),
            Ledger::Standalone(redis) => config(shop, Some(redis), extra),
            Ledger::Cluster(cluster) => {
                config(shop, None, &format!("{extra}segments = 3\n")).redis_cluster(cluster)
            }
        }
    }
}

/// A keyed buy the shop commits but answers only after cacheguard's `upstream.timeout`:
/// the client gets 504 and the buy is in doubt. Returns the shop's reservation id for it.
async fn buy_in_doubt(
    client: &HttpClient,
    cg: &cacheguard::Running,
    shop: &Shop,
    resource: &str,
    key: &str,
) -> String {
    shop.set_fault(Scope::Path(orders_path(resource)), Fault::CommitThenHang);
    let first = buy(client, cg.addr(), resource, Some(key), "{}").await;
    assert_eq!(first.status.as_u16(), 504, "{first:?}");
    // The shop answers at once from now on: a retry forwarded would be seen, and sold.
    shop.heal();
    let log = shop.sale_log();
    assert_eq!(log.sales.len(), 1, "the first request sold");
    log.sales[0]
        .reservation
        .clone()
        .expect("a Stock-Reservation")
}

/// Regression: a retry with the `Idempotency-Key` of a buy whose outcome was in doubt (the
/// origin timed out, 504) was forwarded to the origin a second time, which, against an
/// origin that does not deduplicate by the key, sells twice. With `in_doubt_retry`
/// unset (`"reject"`), in each mode: 409 with `Retry-After` while the reservation holds its
/// unit, the reservation's id and a body saying the outcome is unknown; after the
/// reservation ended, still 409, without `Retry-After`; the origin never sees the key again.
/// With `"forward"`, the retry goes to the origin with the same reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_a_buy_in_doubt_is_refused_unless_configured_to_forward() {
    for ledger in Ledger::each().await {
        let mode = ledger.name();
        let resource = seat("t9", "a");
        let shop = Shop::start(Epoch::now(), &[(resource.clone(), 5)]).await;
        let cg = ledger.config(&shop, "").start().await;
        let client = HttpClient::new();
        let reservation = buy_in_doubt(&client, &cg, &shop, &resource, "k-doubt").await;
        let retry = buy(&client, cg.addr(), &resource, Some("k-doubt"), "{}").await;
        let requests = shop.sale_log().resources[&resource].buy_requests;
        assert_eq!(
            requests, 1,
            "{mode}: the retry reached the origin ({requests} buy requests): {retry:?}"
        );
        assert_eq!(retry.status.as_u16(), 409, "{mode}: {retry:?}");
        let seconds: u64 = retry
            .header("retry-after")
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{mode}: Retry-After: {retry:?}"));
        assert!((1..=3).contains(&seconds), "{mode}: Retry-After {seconds}");
        assert_eq!(
            retry.header("stock-reservation").as_deref(),
            Some(reservation.as_str()),
            "{mode}"
        );
        let body = String::from_utf8_lossy(&retry.body).to_string();
        assert!(
            body.contains("unknown") && body.contains(&reservation),
            "{mode}: {body}"
        );
        let refused = stock_metric(
            &client,
            cg.admin_addr(),
            "cacheguard_stock_requests_total",
            "outcome",
            "in_doubt",
        )
        .await;
        assert_eq!(refused, 1.0, "{mode}");
        // The reservation ends (reservation_ttl 3s): the key is still not forwarded, and no
        // longer told to come back.
        tokio::time::sleep(Duration::from_millis(3500)).await;
        let later = buy(&client, cg.addr(), &resource, Some("k-doubt"), "{}").await;
        assert_eq!(later.status.as_u16(), 409, "{mode}: {later:?}");
        assert_eq!(later.header("retry-after"), None, "{mode}: {later:?}");
        assert_eq!(
            shop.sale_log().resources[&resource].buy_requests,
            1,
            "{mode}"
        );
        // Another key buys: the unit in doubt was settled by the origin's count (sold).
        let other = buy(&client, cg.addr(), &resource, Some("k-new"), "{}").await;
        assert_eq!(other.status.as_u16(), 201, "{mode}: {other:?}");
        cg.shutdown().await;

        // An origin that deduplicates by the key: the retry is forwarded with the same
        // reservation, and takes no unit of its own.
        let resource = seat("t9", "b");
        let shop = Shop::start(Epoch::now(), &[(resource.clone(), 5)]).await;
        let cg = ledger
            .config(&shop, "in_doubt_retry = \"forward\"\n")
            .start()
            .await;
        let reservation = buy_in_doubt(&client, &cg, &shop, &resource, "k-doubt").await;
        let retry = buy(&client, cg.addr(), &resource, Some("k-doubt"), "{}").await;
        assert_eq!(retry.status.as_u16(), 201, "{mode}: {retry:?}");
        let log = shop.sale_log();
        assert_eq!(log.resources[&resource].buy_requests, 2, "{mode}");
        assert_eq!(
            log.resources[&resource].replays, 1,
            "{mode}: the shop's own replay"
        );
        assert_eq!(log.sales.len(), 1, "{mode}");
        assert_eq!(
            log.sales[0].reservation.as_deref(),
            Some(reservation.as_str())
        );
        let retried = stock_metric(
            &client,
            cg.admin_addr(),
            "cacheguard_stock_requests_total",
            "outcome",
            "retried",
        )
        .await;
        assert_eq!(retried, 1.0, "{mode}");
        cg.shutdown().await;
    }
}
