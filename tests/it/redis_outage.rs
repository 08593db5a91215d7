//! Redis is an accelerator, not a dependency: when it dies or hangs, requests still succeed
//! (L1 or origin) within bounded time, and when it comes back L2 is used again without a
//! restart of cacheguard.

use std::time::Duration;

use tokio::time::Instant;

use crate::common::{CgConfig, HttpClient, RedisServer, TestOrigin, url};

/// Polls with fresh keys: each is fetched through `a`, then must be `HIT-L2` through `b`.
/// Returns how long it took, or `None` after `timeout`.
async fn l2_shared_again_within(
    client: &HttpClient,
    a: &cacheguard::Running,
    b: &cacheguard::Running,
    redis: &RedisServer,
    tag: &str,
    timeout: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    for k in 0..1000 {
        if started.elapsed() > timeout {
            return None;
        }
        let path = format!("/api/items/{tag}-poll-{k}");
        let ra = client.get(&url(a.addr(), &path)).await;
        assert_eq!(ra.status, 200, "while Redis recovers: {ra}");
        if !redis.entry_keys().await.is_empty() {
            let rb = client.get(&url(b.addr(), &path)).await;
            assert_eq!(rb.status, 200, "{rb}");
            if rb.x_cache() == "HIT-L2" {
                return Some(started.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_then_restarted_requests_succeed_and_l2_returns() {
    let mut redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cfg = CgConfig::new(&origin).redis(&redis).l1("hot");
    let a = cfg.start().await;
    let b = cfg.start().await;
    let client = HttpClient::new();

    let r = client.get(&url(a.addr(), "/api/items/1")).await;
    assert_eq!(r.x_cache(), "MISS", "{r}");
    let r = client.get(&url(b.addr(), "/api/items/1")).await;
    assert_eq!(r.x_cache(), "HIT-L2", "sanity before the outage: {r}");

    redis.kill();

    for i in 0..10 {
        for (name, inst) in [("A", &a), ("B", &b)] {
            for path in [
                "/api/items/1".to_string(),
                format!("/api/items/outage-{name}-{i}"),
            ] {
                let started = Instant::now();
                let r = client
                    .try_get(&url(inst.addr(), &path))
                    .await
                    .unwrap_or_else(|e| panic!("{name} {path} with Redis down: {e}"));
                let took = started.elapsed();
                assert_eq!(r.status, 200, "{name} {path} with Redis down: {r}");
                assert!(
                    took < Duration::from_secs(1),
                    "{name} {path} took {took:?} with Redis down (command_timeout is 200ms)"
                );
            }
        }
    }

    redis.restart().await;
    let took =
        l2_shared_again_within(&client, &a, &b, &redis, "after", Duration::from_secs(2)).await;
    assert!(
        took.is_some(),
        "L2 not shared again within 2 s of Redis coming back (no cacheguard restart)"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_fallback_keeps_serving_l1_when_redis_dies() {
    let mut redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).redis(&redis).l1("all").start().await;
    let client = HttpClient::new();
    let u = url(cg.addr(), "/api/items/l1");
    assert_eq!(client.get(&u).await.x_cache(), "MISS");
    redis.kill();
    for i in 0..20 {
        let r = client.get(&u).await;
        assert_eq!(r.status, 200, "#{i}: {r}");
        assert_eq!(
            r.x_cache(),
            "HIT-L1",
            "#{i}: L1 (l1 = \"all\") must keep serving with Redis down: {r}"
        );
    }
    assert_eq!(origin.count("/api/items/l1"), 1);
    // New keys while Redis is down: fetched once, then served from L1 (degraded = embedded).
    let u2 = url(cg.addr(), "/api/items/l1-new");
    assert_eq!(client.get(&u2).await.x_cache(), "MISS");
    let r = client.get(&u2).await;
    assert_eq!(r.x_cache(), "HIT-L1", "{r}");
    assert_eq!(origin.count("/api/items/l1-new"), 1);
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_redis_costs_at_most_command_timeout() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("redis", "command_timeout", "100ms")
        .l1("hot")
        .start()
        .await;
    let client = HttpClient::new();
    assert_eq!(
        client.get(&url(cg.addr(), "/api/items/h")).await.x_cache(),
        "MISS"
    );

    redis.pause();
    let mut worst = Duration::ZERO;
    let mut failures = Vec::new();
    for i in 0..10 {
        let path = if i % 2 == 0 {
            "/api/items/h".to_string()
        } else {
            format!("/api/items/h-{i}")
        };
        let started = Instant::now();
        let r = client.try_get(&url(cg.addr(), &path)).await;
        let took = started.elapsed();
        worst = worst.max(took);
        match r {
            Ok(r) if r.status == 200 => {}
            Ok(r) => failures.push(format!("{path}: {r}")),
            Err(e) => failures.push(format!("{path}: {e}")),
        }
    }
    redis.resume();
    assert!(
        failures.is_empty(),
        "requests failed while Redis hung: {failures:?}"
    );
    // A request may make a few bounded Redis waits (GET, lock, store): allow several
    // command_timeouts, but never an unbounded hang.
    assert!(
        worst < Duration::from_millis(1000),
        "a request took {worst:?} while Redis hung (command_timeout = 100ms)"
    );
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_with_redis_down_and_uses_it_once_it_appears() {
    let mut redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cfg = CgConfig::new(&origin).redis(&redis).l1("hot");
    redis.kill();
    let a = cfg.start().await;
    let b = cfg.start().await;
    let client = HttpClient::new();
    let r = client.get(&url(a.addr(), "/api/items/early")).await;
    assert_eq!(
        r.status, 200,
        "Redis down at start must not fail requests: {r}"
    );

    redis.restart().await;
    let took =
        l2_shared_again_within(&client, &a, &b, &redis, "late", Duration::from_secs(2)).await;
    assert!(
        took.is_some(),
        "L2 not used within 2 s of Redis first becoming reachable"
    );
    a.shutdown().await;
    b.shutdown().await;
}

/// L1 is the second level during an outage: with Redis dead, an L1 copy past its ttl but
/// within grace is answered at once as `STALE` (old body) while one refresh goes to the
/// origin, whose failure keeps the stale copy in service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_l1_copy_past_its_ttl_is_served_stale() {
    let mut redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .redis(&redis)
        .l1("all")
        .set_str("cache", "ttl", "1s")
        .set("cache", "jitter", "0.0")
        .set_str("cache", "grace", "30s")
        .start()
        .await;
    let client = HttpClient::new();
    let first = client.get(&url(cg.addr(), "/api/items/s1")).await;
    assert_eq!(first.x_cache(), "MISS", "{first}");
    let old = first.text();

    redis.kill();
    origin.set_status("/api/items/s1", 500);
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    for i in 0..5 {
        let started = Instant::now();
        let r = client.get(&url(cg.addr(), "/api/items/s1")).await;
        assert_eq!(r.status, 200, "request {i} during the outage: {r}");
        assert_eq!(r.x_cache(), "STALE", "request {i}: {r}");
        assert_eq!(r.text(), old, "request {i}: the L1 copy");
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "request {i} waited {:?}",
            started.elapsed()
        );
    }
    cg.shutdown().await;
}

/// Redis drops every client connection (a restart quicker than a probe interval, a
/// middlebox's idle timeout, `CLIENT KILL`) and goes on answering: the first commands on
/// the old connections fail (broken pipe), but Redis is up, so the breaker stays closed —
/// in each `redis.mode`, whether the first to find out is the breaker's own probe (an idle
/// instance) or a burst of requests. In standalone and Sentinel modes the probe's one
/// `INFO` on the dropped shared connection opened it, and the writes taken while it was
/// open were journaled, not heard by the other instances: stale reads right after Redis
/// came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connections_to_a_redis_that_answers_do_not_open_the_breaker() {
    use crate::common::{AnyRedis, metric, redis_server::query_port};

    for mode in AnyRedis::MODES {
        let origin = TestOrigin::start().await;
        let redis = AnyRedis::start(mode).await;
        let cfg = CgConfig::new(&origin).l1("off").any_redis(&redis);
        let ports = redis.data_ports();
        let cg = cfg.start().await;
        let client = HttpClient::new();
        let admin = cg.admin_addr();
        crate::common::wait_metric(
            &client,
            admin,
            "cacheguard_redis_up",
            &[],
            Duration::from_secs(10),
            Duration::from_millis(20),
            |up| up == 1.0,
            crate::common::no_poke,
        )
        .await;
        const KEYS: usize = 16;
        for i in 0..KEYS {
            let r = client
                .get(&url(cg.addr(), &format!("/api/items/drop-{i}")))
                .await;
            assert_eq!(r.x_cache(), "MISS", "{mode}: {r}");
        }
        let changes = metric(&client, admin, "cacheguard_redis_state_changes_total", &[]).await;
        let drop_all = || async {
            for port in &ports {
                let killed: Option<i64> = query_port(
                    *port,
                    redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal"),
                )
                .await;
                assert!(
                    killed.is_some(),
                    "{mode}: CLIENT KILL TYPE normal on {port}"
                );
            }
        };
        let stays_up = |what: &'static str, until: Instant| {
            let client = &client;
            async move {
                while Instant::now() < until {
                    assert_eq!(
                        metric(client, admin, "cacheguard_redis_up", &[]).await,
                        1.0,
                        "{mode}: the breaker opened after Redis dropped its connections \
                         ({what}), though it answers"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };

        // Idle: the probe (every 800 ms while closed) is the first to use the connection.
        drop_all().await;
        stays_up("idle", Instant::now() + Duration::from_millis(2_000)).await;

        // A burst of reads, all at once on the dropped connections.
        drop_all().await;
        let burst = (0..KEYS).map(|i| {
            let client = &client;
            let addr = cg.addr();
            async move {
                let r = client
                    .get(&url(addr, &format!("/api/items/drop-{i}")))
                    .await;
                assert_eq!(r.status, 200, "{mode}: {r}");
            }
        });
        futures_util::future::join_all(burst).await;
        stays_up(
            "a burst of reads",
            Instant::now() + Duration::from_millis(1_000),
        )
        .await;

        assert_eq!(
            metric(&client, admin, "cacheguard_redis_state_changes_total", &[]).await,
            changes,
            "{mode}: the breaker moved after Redis dropped its connections, though it answers"
        );
        let r = client.get(&url(cg.addr(), "/api/items/drop-0")).await;
        assert_eq!(r.x_cache(), "HIT-L2", "{mode}: L2 in use again: {r}");
        cg.shutdown().await;
    }
}
