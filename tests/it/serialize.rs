//! Serialized writes, one promise at a time, against the shop's seat writes (which log each
//! write's interval at the origin and its fencing token) and real Redis servers: one write
//! per resource at a time across instances, tokens that only grow (also across a Redis
//! restart without persistence), waits bounded in time and count, and Redis down per
//! policy. The same under faults, judged by the history checkers, is in `tests/it/serialize_faults.rs`.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common;
use crate::common::history::{Epoch, check_exclusion, check_fencing};
use crate::common::redis_server::command_calls;
use crate::common::shop::{FENCING_TOKEN, Fault, Scope, Shop, seat};
use crate::common::{
    AnyRedis, CgConfig, HttpClient, RedisCluster, RedisServer, Resp, TcpProxy, metrics, route, url,
};
use tokio::time::Instant;

fn seat_route(settings: &str) -> String {
    route(
        "seat-update",
        "/trains/{train}/seats/{seat}",
        "PUT",
        &format!(
            "serialize = {{ key = \"/trains/{{train}}/seats/{{seat}}\", fence_header = \
             \"{FENCING_TOKEN}\", {settings} }}"
        ),
    )
}

fn config(shop: &Shop, settings: &str) -> CgConfig {
    CgConfig::with_upstream(&shop.url())
        .set("upstream", "timeout", "\"2s\"")
        .set("lock", "wait_timeout", "\"2s\"")
        .routes(&seat_route(settings))
}

async fn put(client: &HttpClient, addr: SocketAddr, path: &str, body: &str) -> Resp {
    client
        .request(
            http::Method::PUT,
            &url(addr, path),
            &[("content-type", "application/json")],
            common::client::full_body(body.to_owned()),
        )
        .await
        .unwrap_or_else(|e| panic!("PUT {path}: {e}"))
}

async fn writes_metric(client: &HttpClient, admin: SocketAddr, result: &str) -> f64 {
    metrics(client, admin).await.sum(
        "cacheguard_serialized_writes_total",
        &[("route", "seat-update"), ("result", result)],
    )
}

/// Writes to one seat from many clients over two instances (one in embedded mode): the
/// origin never has two at once, each carries a token larger than the last accepted, and
/// the fencing key names the seat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_to_one_resource_never_overlap_and_tokens_grow() {
    for mode in ["embedded", "standalone", "cluster"] {
        let resource = seat("t1", "12A");
        let shop = Shop::start(Epoch::now(), &[]).await;
        shop.set_fencing(Some(FENCING_TOKEN));
        // A write takes a while at the origin: without the lock they would overlap.
        shop.set_latency(Scope::Writes, Duration::from_millis(15));
        let (redis, cluster) = match mode {
            "standalone" => (Some(RedisServer::start().await), None),
            "cluster" => (None, Some(RedisCluster::start().await)),
            _ => (None, None),
        };
        let mut cfg = config(&shop, "");
        if let Some(redis) = &redis {
            cfg = cfg.redis(redis);
        }
        if let Some(cluster) = &cluster {
            cfg = cfg.redis_cluster(cluster);
        }
        let client = HttpClient::new();
        let instances = if mode == "embedded" {
            vec![cfg.start().await]
        } else {
            let [a, b] = common::fleet::start_coordinated::<2>(&cfg, &client).await;
            vec![a, b]
        };
        let addrs: Vec<SocketAddr> = instances.iter().map(|i| i.addr()).collect();
        let tasks: Vec<_> = (0..24)
            .map(|i| {
                let (client, addr, path) =
                    (client.clone(), addrs[i % addrs.len()], resource.clone());
                tokio::spawn(
                    async move { put(&client, addr, &path, &format!("{{\"n\":{i}}}")).await },
                )
            })
            .collect();
        for task in common::join_within(tasks, Duration::from_secs(30), "writes").await {
            assert_eq!(task.status.as_u16(), 200, "{mode}: {task:?}");
        }
        let log = shop.write_log();
        assert_eq!(log.writes.len(), 24, "{mode}");
        let exclusion = check_exclusion(&log);
        assert!(exclusion.ok(), "{mode}: {exclusion}");
        let fencing = check_fencing(&log);
        assert!(fencing.ok(), "{mode}: {fencing}");
        assert_eq!(
            fencing.accepted, 24,
            "{mode}: every write carried a fresh token: {fencing}"
        );
        assert!(
            log.writes
                .iter()
                .all(|w| w.fencing_key.as_deref() == Some(resource.as_str())),
            "{mode}: Fencing-Key names the seat"
        );
        for instance in instances {
            instance.shutdown().await;
        }
    }
}

/// The token keeps growing across a Redis restart that lost everything: the clock is its
/// floor, so a fencing origin goes on accepting writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_across_a_redis_restart_without_persistence() {
    let resource = seat("t2", "1A");
    let shop = Shop::start(Epoch::now(), &[]).await;
    shop.set_fencing(Some(FENCING_TOKEN));
    let mut redis = RedisServer::start().await;
    let cg = config(&shop, "").redis(&redis).start().await;
    let client = HttpClient::new();
    for i in 0..3 {
        assert_eq!(
            put(&client, cg.addr(), &resource, &format!("{{\"a\":{i}}}"))
                .await
                .status
                .as_u16(),
            200
        );
    }
    redis.restart().await;
    let back = common::poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            let resp = put(&client, cg.addr(), &resource, "{\"b\":0}").await;
            (resp.status.as_u16() == 200).then_some(())
        },
    )
    .await;
    assert!(back.is_some(), "writes go through again once Redis is back");
    let fencing = check_fencing(&shop.write_log());
    assert!(fencing.ok() && fencing.refused == 0, "{fencing}");
    cg.shutdown().await;
}

/// A resource held long: one waiter beyond `max_waiters` is refused at once, and the
/// others wait `wait_timeout` at most (+ 50 ms), then 503 with Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_are_bounded_in_time_and_count() {
    let resource = seat("t3", "1A");
    let shop = Shop::start(Epoch::now(), &[]).await;
    let redis = RedisServer::start().await;
    let cg = config(
        &shop,
        "wait_timeout = \"400ms\", max_waiters = 2, retry_after = \"3s\"",
    )
    .redis(&redis)
    .start()
    .await;
    let client = HttpClient::new();
    shop.set_fault(Scope::Writes, Fault::Hang);
    let holder = {
        let (client, addr, path) = (client.clone(), cg.addr(), resource.clone());
        tokio::spawn(async move { put(&client, addr, &path, "{}").await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let (client, addr, path) = (client.clone(), cg.addr(), resource.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                let resp = put(&client, addr, &path, "{}").await;
                (resp, started.elapsed())
            })
        })
        .collect();
    let mut timed_out = 0;
    let mut refused_at_once = 0;
    for (resp, waited) in common::join_within(waiters, Duration::from_secs(5), "waiters").await {
        assert_eq!(resp.status.as_u16(), 503, "{resp:?}");
        assert_eq!(resp.header("retry-after").as_deref(), Some("3"));
        if waited < Duration::from_millis(100) {
            refused_at_once += 1;
        } else {
            assert!(
                waited <= Duration::from_millis(450 + 150),
                "waited {waited:?}"
            );
            timed_out += 1;
        }
    }
    assert_eq!((timed_out, refused_at_once), (2, 1));
    assert_eq!(
        writes_metric(&client, cg.admin_addr(), "too_many").await,
        1.0
    );
    assert_eq!(
        writes_metric(&client, cg.admin_addr(), "timeout").await,
        2.0
    );
    shop.release();
    assert_eq!(holder.await.expect("holder").status.as_u16(), 200);
    cg.shutdown().await;
}

/// Redis down: `reject` answers 503 and the origin sees nothing; `forward` forwards and
/// counts every unserialized write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_rejects_or_forwards_as_configured() {
    for (policy, status, result) in [("reject", 503, "unavailable"), ("forward", 200, "ungated")] {
        let resource = seat("t4", "1A");
        let shop = Shop::start(Epoch::now(), &[]).await;
        let mut redis = RedisServer::start().await;
        let cg = config(&shop, &format!("on_redis_error = \"{policy}\""))
            .redis(&redis)
            .start()
            .await;
        let client = HttpClient::new();
        assert_eq!(
            put(&client, cg.addr(), &resource, "{}")
                .await
                .status
                .as_u16(),
            200
        );
        redis.kill();
        for _ in 0..3 {
            let resp = put(&client, cg.addr(), &resource, "{}").await;
            assert_eq!(resp.status.as_u16(), status, "{policy}: {resp:?}");
        }
        let reached = if policy == "reject" { 1 } else { 4 };
        assert_eq!(shop.write_log().writes.len(), reached, "{policy}");
        assert_eq!(
            writes_metric(&client, cg.admin_addr(), result).await,
            3.0,
            "{policy}"
        );
        cg.shutdown().await;
    }
}

/// A release Redis did not take (its connection cut as the origin answered) is tried again
/// while the lease lasts: the next write to the resource goes through soon after Redis is
/// back, instead of waiting out the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_redis_missed_is_tried_again() {
    let resource = seat("t5", "1A");
    let shop = Shop::start(Epoch::now(), &[]).await;
    shop.set_fencing(Some(FENCING_TOKEN));
    let lost = redis_lost_during_a_write(
        shop,
        &resource,
        "lease = \"3s\", wait_timeout = \"1500ms\"",
        "200ms",
        TcpProxy::cut,
    )
    .await;
    let (shop, proxy, cg, client) = (&lost.shop, &lost.proxy, &lost.cg, lost.client.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.restore();
    // Until the instance reaches Redis again, writes are refused at once (unavailable): the
    // first one that gets past that is timed.
    let mut attempt = 0;
    let (second, waited) = loop {
        let started = Instant::now();
        let resp = put(&client, cg.addr(), &resource, "{\"a\":2}").await;
        let waited = started.elapsed();
        let unavailable = resp.status.as_u16() == 503
            && String::from_utf8_lossy(&resp.body).contains("unavailable");
        attempt += 1;
        if !unavailable || attempt == 40 {
            break (resp, waited);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        second.status.as_u16(),
        200,
        "the first write's lock was still held after {waited:?}: {second:?}"
    );
    assert!(
        waited < Duration::from_secs(1),
        "the second write waited {waited:?} for a lock nobody held"
    );
    let fencing = check_fencing(&shop.write_log());
    assert!(fencing.ok() && fencing.accepted == 2, "{fencing}");
    lost.cg.shutdown().await;
}

/// A write that arrives while the last write's release is held up by a Redis that stopped
/// answering (its connection blackholed as the origin answered) waits for this instance's
/// turn until its wait runs out: that wait was spent on the lock service, not on another
/// write, so the route's `on_redis_error` decides the answer, as it does when Redis is down
/// at the write's own acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_behind_a_release_redis_does_not_answer_follows_the_policy() {
    for (policy, status, result) in [("reject", 503, "unavailable"), ("forward", 200, "ungated")] {
        let resource = seat("t6", "1A");
        // No fencing: the write forwarded without the lock carries no token.
        let shop = Shop::start(Epoch::now(), &[]).await;
        let lost = redis_lost_during_a_write(
            shop,
            &resource,
            &format!("lease = \"6s\", wait_timeout = \"400ms\", on_redis_error = \"{policy}\""),
            // The release sent after the answer waits out the whole `command_timeout`.
            "2s",
            TcpProxy::blackhole,
        )
        .await;
        let (shop, proxy, cg, client) = (&lost.shop, &lost.proxy, &lost.cg, lost.client.clone());
        let started = Instant::now();
        let second = put(&client, cg.addr(), &resource, "{\"a\":2}").await;
        let waited = started.elapsed();
        assert_eq!(
            second.status.as_u16(),
            status,
            "{policy}: the write behind a stalled release: {second:?}"
        );
        assert!(
            waited < Duration::from_millis(1500),
            "{policy}: answered after {waited:?}, not when its 400 ms wait ran out"
        );
        assert_eq!(
            writes_metric(&client, cg.admin_addr(), result).await,
            1.0,
            "{policy}"
        );
        assert_eq!(
            writes_metric(&client, cg.admin_addr(), "timeout").await,
            0.0,
            "{policy}"
        );
        let reached = if policy == "reject" { 1 } else { 2 };
        assert_eq!(shop.write_log().writes.len(), reached, "{policy}");
        proxy.restore();
        lost.cg.shutdown().await;
    }
}

/// `PUBLISH`es the primaries of `redis` executed so far (the scripts' own included).
async fn publishes(redis: &AnyRedis) -> u64 {
    let mut total = 0;
    for port in redis.primary_ports().await {
        let client = redis::Client::open(common::redis_server::redis_url(port)).expect("url");
        let mut con = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to a primary");
        total += command_calls(&mut con)
            .await
            .get("publish")
            .copied()
            .unwrap_or(0);
    }
    total
}

/// Writes waiting for one resource in one instance get the lock passed on from the write
/// before, each with a fresh token, in every Redis mode: eight writes cost one acquire and
/// one release (one `released` event on the bus), not eight of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_waiting_in_one_instance_get_the_lock_passed_on() {
    for mode in AnyRedis::MODES {
        let resource = seat("t7", "1A");
        let shop = Shop::start(Epoch::now(), &[]).await;
        shop.set_fencing(Some(FENCING_TOKEN));
        let redis = AnyRedis::start(mode).await;
        // Runs of a third of the lease (1.67 s): the eight writes fit in one.
        let cg = config(&shop, "wait_timeout = \"10s\"")
            .any_redis(&redis)
            .start()
            .await;
        let client = HttpClient::new();
        // Scripts loaded, connections made.
        let first = put(&client, cg.addr(), &resource, "{\"n\":0}").await;
        assert_eq!(first.status.as_u16(), 200, "{mode}: {first:?}");
        let events = common::poll_until(
            Duration::from_secs(5),
            Duration::from_millis(20),
            || async {
                let n = publishes(&redis).await;
                (n > 0).then_some(n)
            },
        )
        .await
        .unwrap_or_else(|| panic!("{mode}: the first write's release published nothing"));
        shop.set_latency(Scope::Writes, Duration::from_millis(50));
        let tasks: Vec<_> = (1..=8)
            .map(|i| {
                let (client, addr, path) = (client.clone(), cg.addr(), resource.clone());
                tokio::spawn(
                    async move { put(&client, addr, &path, &format!("{{\"n\":{i}}}")).await },
                )
            })
            .collect();
        for answer in common::join_within(tasks, Duration::from_secs(30), "writes").await {
            assert_eq!(answer.status.as_u16(), 200, "{mode}: {answer:?}");
        }
        // The last write's release runs after its answer.
        let released = common::poll_until(
            Duration::from_secs(5),
            Duration::from_millis(20),
            || async {
                let n = publishes(&redis).await;
                (n > events).then_some(n - events)
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let released_after = publishes(&redis).await - events;
        assert_eq!(
            (released, released_after),
            (Some(1), 1),
            "{mode}: one release for the eight writes"
        );
        let passed_on = metrics(&client, cg.admin_addr()).await.sum(
            "cacheguard_serialized_passed_on_total",
            &[("route", "seat-update")],
        );
        assert_eq!(passed_on, 7.0, "{mode}");
        let log = shop.write_log();
        let exclusion = check_exclusion(&log);
        assert!(exclusion.ok(), "{mode}: {exclusion}");
        let fencing = check_fencing(&log);
        assert!(fencing.ok(), "{mode}: {fencing}");
        assert_eq!(
            fencing.accepted, 9,
            "{mode}: every write carried a fresh token: {fencing}"
        );
        cg.shutdown().await;
    }
}

/// Two instances with writes always waiting for one resource take turns: a run of writes
/// passing the lock on in one instance ends after a quarter of `wait_timeout`, and the
/// other instance's waiting write, woken by the release, takes the lock before the next
/// one of the first. So no write waits out its `wait_timeout`, and both get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_with_writes_always_waiting_take_turns() {
    let resource = seat("t8", "1A");
    let shop = Shop::start(Epoch::now(), &[]).await;
    shop.set_fencing(Some(FENCING_TOKEN));
    shop.set_latency(Scope::Writes, Duration::from_millis(10));
    let redis = RedisServer::start().await;
    // Runs of 250 ms.
    let cfg = config(&shop, "wait_timeout = \"1s\"").redis(&redis);
    let client = HttpClient::new();
    let [a, b] = common::fleet::start_coordinated::<2>(&cfg, &client).await;
    let until = Instant::now() + Duration::from_secs(2);
    // Four writers per instance, each writing again as soon as answered.
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (client, addr, path) = (
                client.clone(),
                if i % 2 == 0 { a.addr() } else { b.addr() },
                resource.clone(),
            );
            tokio::spawn(async move {
                let mut answers = Vec::new();
                while Instant::now() < until {
                    let answer = put(&client, addr, &path, &format!("{{\"w\":{i}}}")).await;
                    answers.push(answer.status.as_u16());
                }
                answers
            })
        })
        .collect();
    let answers = common::join_within(tasks, Duration::from_secs(30), "writers").await;
    let per_instance: Vec<Vec<u16>> = [0, 1]
        .map(|k| {
            answers
                .iter()
                .enumerate()
                .filter(|(i, _)| i % 2 == k)
                .flat_map(|(_, a)| a.iter().copied())
                .collect()
        })
        .into();
    for (name, answers) in ["a", "b"].iter().zip(&per_instance) {
        let refused = answers.iter().filter(|s| **s != 200).count();
        assert_eq!(
            refused,
            0,
            "instance {name}: {refused} of {} refused",
            answers.len()
        );
    }
    let (ok_a, ok_b) = (per_instance[0].len(), per_instance[1].len());
    let share = ok_a.min(ok_b) as f64 / (ok_a + ok_b) as f64;
    assert!(
        share >= 0.25,
        "one instance got {ok_a} writes through, the other {ok_b}"
    );
    for instance in [&a, &b] {
        let passed_on = metrics(&client, instance.admin_addr()).await.sum(
            "cacheguard_serialized_passed_on_total",
            &[("route", "seat-update")],
        );
        assert!(
            passed_on > 0.0,
            "each instance passed the lock on in its runs"
        );
    }
    let log = shop.write_log();
    let exclusion = check_exclusion(&log);
    assert!(exclusion.ok(), "{exclusion}");
    let fencing = check_fencing(&log);
    assert!(fencing.ok() && fencing.refused == 0, "{fencing}");
    common::fleet::shutdown_all([a, b]).await;
}

/// What [`redis_lost_during_a_write`] leaves running.
struct LostDuringAWrite {
    shop: Shop,
    _redis: RedisServer,
    proxy: TcpProxy,
    cg: cacheguard::Running,
    client: HttpClient,
}

/// One instance serializing `resource` (route `settings`, Redis `command_timeout`) through
/// a proxy in front of Redis, and one write to it that `shop` takes 300 ms to answer:
/// 150 ms in, while the write holds the lock, `fault` is done to the proxy. Returns once
/// that write was answered 200.
async fn redis_lost_during_a_write(
    shop: Shop,
    resource: &str,
    settings: &str,
    command_timeout: &str,
    fault: fn(&TcpProxy),
) -> LostDuringAWrite {
    shop.set_latency(Scope::Writes, Duration::from_millis(300));
    let redis = RedisServer::start().await;
    let proxy = TcpProxy::start(redis.addr()).await;
    let cg = config(&shop, settings)
        .set_str("redis", "url", &proxy.redis_url())
        .set_str("redis", "command_timeout", command_timeout)
        .start()
        .await;
    let client = HttpClient::new();
    let first = {
        let (client, addr, path) = (client.clone(), cg.addr(), resource.to_owned());
        tokio::spawn(async move { put(&client, addr, &path, "{\"a\":1}").await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    fault(&proxy);
    let answered = first.await.expect("first write");
    assert_eq!(answered.status.as_u16(), 200, "{answered:?}");
    LostDuringAWrite {
        shop,
        _redis: redis,
        proxy,
        cg,
        client,
    }
}
