//! Sentinel-managed Redis as the shared backend (Scale-out), against real processes started
//! by the harness: one primary, one replica, three sentinels. cacheguard finds the primary
//! through the sentinels, follows a failover within a second of the announcement, never
//! lets a `READONLY` (a demoted primary's refusal) reach a client, and owes no
//! invalidation: writes during the failover are journaled and applied afterwards.
//!
//! Each test starts five Redis processes of its own, so tests run beside each other.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::common;
use crate::common::load::Load;
use crate::common::redis_sentinel::DOWN_AFTER;
use crate::common::{
    CgConfig, HttpClient, RedisSentinel, Resp, TestOrigin, admin_redis, metric, put, url,
};

/// A cached KV route (the instance's own `l1` policy) and its write route.
fn kv_routes() -> String {
    common::kv_routes("200ms", true, None)
}

fn version(resp: &Resp) -> u64 {
    let body: Value = serde_json::from_slice(&resp.body)
        .unwrap_or_else(|e| panic!("KV body is not JSON ({e}): {resp}"));
    body["version"].as_u64().unwrap()
}

/// `cacheguard_redis_readonly_retries_total` of the instance whose admin listener is `admin`.
async fn readonly_retries(client: &HttpClient, admin: SocketAddr) -> f64 {
    metric(
        client,
        admin,
        "cacheguard_redis_readonly_retries_total",
        &[],
    )
    .await
}

/// Polls `/admin/redis` until the instance uses `primary` with its breaker closed; when.
pub async fn wait_following(
    client: &HttpClient,
    admin: SocketAddr,
    primary: u16,
    timeout: Duration,
) -> Option<Instant> {
    let want = format!("127.0.0.1:{primary}");
    common::poll_until(timeout, Duration::from_millis(10), || async {
        let shown = admin_redis(client, admin).await;
        (shown["up"] == true && shown["topology"]["primaries"][0] == want.as_str())
            .then(Instant::now)
    })
    .await
}

/// The primary is found through the sentinels and reported; L2 works through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_is_found_through_the_sentinels_and_reported() {
    let sentinel = RedisSentinel::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .redis_sentinel(&sentinel)
        .l1("off")
        .start()
        .await;
    let client = HttpClient::new();
    let primary = sentinel.primary_port().await.unwrap();
    let shown = admin_redis(&client, cg.admin_addr()).await;
    assert_eq!(shown["up"], true, "{shown}");
    assert_eq!(shown["topology"]["mode"], "sentinel", "{shown}");
    assert_eq!(
        shown["topology"]["master_name"],
        common::redis_sentinel::MASTER_NAME
    );
    assert_eq!(
        shown["topology"]["primaries"][0],
        format!("127.0.0.1:{primary}"),
        "{shown}"
    );
    assert_eq!(shown["topology"]["replicas"], 1, "{shown}");
    let path = "/api/items/sentinel-smoke";
    assert_eq!(client.get(&url(cg.addr(), path)).await.x_cache(), "MISS");
    assert_eq!(client.get(&url(cg.addr(), path)).await.x_cache(), "HIT-L2");
}

/// The primary is killed under read load while writes go on. The sentinels fail over;
/// both instances follow the new primary within 1 s of the `+switch-master`
/// announcement; no read of a cached key gets anything but 2xx; every write succeeds, its
/// invalidations journaled while Redis was unusable and applied after (journal back to 0);
/// afterwards both instances serve the written values; no `READONLY` ever reaches a
/// client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_killed_under_load_is_followed_within_a_second() {
    // Loads the machine or times it: never beside another such test (see `alone::heavy`).
    let _heavy = crate::common::heavy().await;
    let mut sentinel = RedisSentinel::start().await;
    let origin = TestOrigin::start_kv().await;
    let base = CgConfig::new(&origin)
        .redis_sentinel(&sentinel)
        .set_str("cache", "ttl", "60s")
        .routes(&kv_routes());
    let a = base.clone().l1("all").start().await;
    let b = base.clone().l1("off").start().await;
    let client = HttpClient::new();
    let keys: Vec<String> = (0..20).map(|i| format!("/kv/k{i}")).collect();
    for path in &keys {
        for addr in [a.addr(), a.addr(), b.addr()] {
            let r = client.get(&url(addr, path)).await;
            assert_eq!(r.status, 200, "{r}");
            assert_eq!(version(&r), 0);
        }
    }
    let old_primary = sentinel.primary_port().await.unwrap();
    let switch = sentinel.watch_switch().await;
    let load_keys = keys.clone();
    let load = Load::new(&[a.addr(), b.addr()], move |n| {
        load_keys[n as usize % load_keys.len()].clone()
    })
    .conns(6)
    .pause(Duration::from_millis(2))
    .duration(Duration::from_secs(40))
    .start();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed_at = Instant::now();
    sentinel.kill(old_primary);

    // Writes while the primary is gone (before the sentinels even notice): every one must
    // succeed at the origin; its invalidations cannot reach Redis now.
    let written: Vec<String> = keys[..10].to_vec();
    for path in &written {
        let r = put(&client, a.addr(), path).await;
        assert_eq!(r.status, 200, "a write during the failover failed: {r}");
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let (new_primary, switched_at) = switch
        .wait(Duration::from_secs(30))
        .await
        .expect("the sentinels never announced a failover");
    assert_ne!(new_primary, old_primary);
    let within = Duration::from_secs(10);
    let follow_a = wait_following(&client, a.admin_addr(), new_primary, within).await;
    let follow_b = wait_following(&client, b.admin_addr(), new_primary, within).await;
    let lag = |at: Option<Instant>| at.map(|t| t.saturating_duration_since(switched_at));
    eprintln!(
        "failover announced {:?} after the kill (down-after {DOWN_AFTER:?}); A followed {:?} \
         later, B {:?}",
        switched_at - killed_at,
        lag(follow_a),
        lag(follow_b)
    );
    for (name, lag) in [("A", lag(follow_a)), ("B", lag(follow_b))] {
        let lag = lag.unwrap_or_else(|| panic!("{name} never followed the new primary"));
        assert!(
            lag <= Duration::from_secs(1),
            "{name} followed the new primary {lag:?} after the announcement (> 1 s)"
        );
    }
    // The invalidations owed by the writes are applied once Redis is back.
    let drained = common::poll_until(
        Duration::from_secs(15),
        Duration::from_millis(50),
        || async {
            (metric(&client, a.admin_addr(), "cacheguard_journal_depth", &[]).await == 0.0)
                .then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let tally = load.finish().await;
    assert!(
        drained.is_some(),
        "A's journal did not drain after the failover"
    );
    let journaled = metric(
        &client,
        a.admin_addr(),
        "cacheguard_invalidations_total",
        &[("source", "write"), ("result", "journaled")],
    )
    .await;
    assert!(
        journaled >= 1.0,
        "no write's invalidation was journaled: the writes did not fall in the failover"
    );
    assert_eq!(
        metric(
            &client,
            a.admin_addr(),
            "cacheguard_journal_give_ups_total",
            &[]
        )
        .await,
        0.0
    );
    eprintln!(
        "load: {} answers, {:?}, {:?}; readonly retries A {} B {}",
        tally.answers,
        tally.by_status,
        tally.by_x_cache,
        readonly_retries(&client, a.admin_addr()).await,
        readonly_retries(&client, b.admin_addr()).await,
    );
    assert_eq!(
        tally.non_2xx(),
        0,
        "non-2xx answers for cached keys: {:#?}",
        tally.bad
    );
    assert_eq!(
        tally.readonly, 0,
        "a READONLY reached a client: {:#?}",
        tally.bad
    );
    assert!(
        tally.answers > 300,
        "the load hardly ran: {}",
        tally.answers
    );
    for path in &written {
        for addr in [a.addr(), b.addr()] {
            let r = client.get(&url(addr, path)).await;
            assert_eq!(r.status, 200, "{r}");
            assert_eq!(
                version(&r),
                1,
                "{path} through {addr} is stale after the failover: {r}"
            );
        }
    }
    assert_eq!(
        metric(
            &client,
            a.admin_addr(),
            "cacheguard_redis_primary_changes_total",
            &[]
        )
        .await,
        1.0
    );
}

/// A manual failover (`SENTINEL FAILOVER`: the old primary stays up and is demoted to a
/// replica) under read and write load: zero non-2xx, and no `READONLY` reaches a client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_failover_under_load_never_shows_readonly() {
    // Loads the machine or times it: never beside another such test (see `alone::heavy`).
    let _heavy = crate::common::heavy().await;
    let sentinel = RedisSentinel::start().await;
    let origin = TestOrigin::start_kv().await;
    let cfg = CgConfig::new(&origin)
        .redis_sentinel(&sentinel)
        .l1("off")
        .routes(&kv_routes());
    let a = cfg.start().await;
    let client = HttpClient::new();
    let keys: Vec<String> = (0..20).map(|i| format!("/kv/m{i}")).collect();
    for path in &keys {
        assert_eq!(client.get(&url(a.addr(), path)).await.status, 200);
    }
    let old_primary = sentinel.primary_port().await.unwrap();
    let switch = sentinel.watch_switch().await;
    let load_keys = keys.clone();
    let load = Load::new(&[a.addr()], move |n| {
        load_keys[n as usize % load_keys.len()].clone()
    })
    .conns(6)
    .duration(Duration::from_secs(30))
    .start();
    // Writes all through the failover.
    let writer = {
        let client = client.clone();
        let keys = keys.clone();
        let addr = a.addr();
        tokio::spawn(async move {
            let mut bad = Vec::new();
            let until = Instant::now() + Duration::from_secs(6);
            let mut n = 0usize;
            while Instant::now() < until {
                let r = put(&client, addr, &keys[n % keys.len()]).await;
                if !r.status.is_success() || r.text().contains("READONLY") {
                    bad.push(r.to_string());
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (n, bad)
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    sentinel.failover().await;
    let (new_primary, _) = switch
        .wait(Duration::from_secs(30))
        .await
        .expect("no failover announced");
    assert_ne!(new_primary, old_primary);
    assert!(
        wait_following(&client, a.admin_addr(), new_primary, Duration::from_secs(5))
            .await
            .is_some(),
        "cacheguard did not follow the new primary"
    );
    let (writes, bad_writes) = writer.await.unwrap();
    let tally = load.finish().await;
    eprintln!(
        "{writes} writes; load: {} answers, {:?}; readonly retries {}",
        tally.answers,
        tally.by_x_cache,
        readonly_retries(&client, a.admin_addr()).await
    );
    assert!(bad_writes.is_empty(), "writes failed: {bad_writes:#?}");
    assert_eq!(tally.non_2xx(), 0, "non-2xx: {:#?}", tally.bad);
    assert_eq!(tally.readonly, 0, "a READONLY reached a client");
}

/// `lock.wait_replicas`: the lock owner `WAIT`s for the replicas. With 1 (the replica
/// there is) every acquire is replicated; asking for 2 of the one replica is counted as
/// `unreplicated` and the fill still goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_wait_replicas_waits_for_the_replica() {
    let sentinel = RedisSentinel::start().await;
    let origin = TestOrigin::start().await;
    let client = HttpClient::new();
    for (wanted, unreplicated) in [(1, 0.0), (2, 3.0)] {
        let cg = CgConfig::new(&origin)
            .redis_sentinel(&sentinel)
            .set("lock", "wait_replicas", &wanted.to_string())
            .l1("off")
            .start()
            .await;
        common::cold_misses(&client, cg.addr(), &format!("wait-{wanted}"), 3).await;
        let admin = cg.admin_addr();
        assert_eq!(common::lock_events(&client, admin, "acquired").await, 3.0);
        assert_eq!(
            common::lock_events(&client, admin, "unreplicated").await,
            unreplicated,
            "wait_replicas = {wanted} with one replica"
        );
    }
}

/// A command that reaches a demoted primary is answered `READONLY`; cacheguard re-resolves
/// the primary through the sentinels and retries once on the new one, so the write's
/// invalidation is done at once (nothing journaled) and the client never sees it.
///
/// To make the demoted primary certain to get commands, cacheguard reaches the sentinels
/// through TCP proxies that are cut during a `SENTINEL FAILOVER`: it cannot hear the
/// switch. The old primary, turning replica, drops its clients; cacheguard's probe finds
/// its connection dropped and asks again on a new one, to the old primary, the only one it
/// knows (which answers: the breaker stays closed). Then the proxies are restored and
/// writes go through at once (the periodic re-check is a second away): the first meets
/// `READONLY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readonly_from_a_demoted_primary_is_retried_on_the_new_one() {
    let sentinel = RedisSentinel::start().await;
    let mut proxies = Vec::new();
    for port in sentinel.sentinel_ports() {
        proxies.push(common::TcpProxy::start(SocketAddr::from(([127, 0, 0, 1], port))).await);
    }
    let urls: Vec<String> = proxies
        .iter()
        .map(|p| format!("{:?}", p.redis_url()))
        .collect();
    let origin = TestOrigin::start_kv().await;
    let cg = CgConfig::new(&origin)
        .set_str("redis", "mode", "sentinel")
        .set("redis", "urls", &format!("[{}]", urls.join(", ")))
        .set_str("redis", "master_name", common::redis_sentinel::MASTER_NAME)
        .set_str("redis", "command_timeout", "1s")
        .l1("off")
        .routes(&kv_routes())
        .start()
        .await;
    let client = HttpClient::new();
    let keys: Vec<String> = (0..10).map(|i| format!("/kv/ro{i}")).collect();
    for path in &keys {
        assert_eq!(version(&client.get(&url(cg.addr(), path)).await), 0);
    }
    let old_primary = sentinel.primary_port().await.unwrap();

    for proxy in &proxies {
        proxy.cut();
    }
    let new_primary = sentinel.switch_over(Duration::from_secs(30)).await;
    assert_ne!(new_primary, old_primary);
    let demoted = common::poll_until(
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async {
            common::redis_sentinel::info(old_primary, "replication")
                .await
                .contains("role:slave")
                .then_some(())
        },
    )
    .await;
    assert!(demoted.is_some(), "the old primary was never demoted");
    // The probe's `INFO` (every 800 ms) on a connection made after the demotion, which
    // dropped every client but the sentinels'.
    let reconnected = common::poll_until(
        Duration::from_secs(15),
        Duration::from_millis(20),
        || async {
            let clients: Option<String> =
                common::redis_server::query_port(old_primary, redis::cmd("CLIENT").arg("LIST"))
                    .await;
            let probed = clients.is_some_and(|list| {
                list.lines()
                    .any(|c| c.contains(" cmd=info ") && !c.contains(" name=sentinel-"))
            });
            let shown = admin_redis(&client, cg.admin_addr()).await;
            (probed && shown["up"] == true).then_some(())
        },
    )
    .await;
    assert!(
        reconnected.is_some(),
        "cacheguard did not reconnect to the demoted primary"
    );
    let shown = admin_redis(&client, cg.admin_addr()).await;
    assert_eq!(
        shown["topology"]["primaries"][0],
        format!("127.0.0.1:{old_primary}"),
        "cacheguard learnt of the failover through the cut: the test proves nothing: {shown}"
    );

    for proxy in &proxies {
        proxy.restore();
    }
    for path in &keys {
        let r = put(&client, cg.addr(), path).await;
        assert_eq!(r.status, 200, "{r}");
        assert!(!r.text().contains("READONLY"), "{r}");
    }
    let admin = cg.admin_addr();
    let retries = metric(
        &client,
        admin,
        "cacheguard_redis_readonly_retries_total",
        &[],
    )
    .await;
    let journaled = metric(
        &client,
        admin,
        "cacheguard_invalidations_total",
        &[("source", "write"), ("result", "journaled")],
    )
    .await;
    eprintln!("READONLY retries: {retries}; invalidations journaled: {journaled}");
    assert!(
        retries >= 1.0,
        "no command met the demoted primary's READONLY"
    );
    assert_eq!(
        journaled, 0.0,
        "an invalidation was journaled instead of retried"
    );
    assert!(
        wait_following(&client, admin, new_primary, Duration::from_secs(5))
            .await
            .is_some()
    );
    for path in &keys {
        let r = client.get(&url(cg.addr(), path)).await;
        assert_eq!((r.status.as_u16(), version(&r)), (200, 1), "{r}");
    }
}

/// A standalone `redis.url` that points at a sentinel is refused at start, naming
/// `redis.url` and what it found: a sentinel holds no data, every command would fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_url_at_a_sentinel_is_refused() {
    let sentinel = RedisSentinel::start().await;
    let origin = TestOrigin::start().await;
    let at = sentinel.sentinel_urls()[0].clone();
    let toml = CgConfig::new(&origin)
        .set_str("redis", "url", &at)
        .set_str("redis", "command_timeout", "200ms")
        .toml();
    let config =
        cacheguard::Config::from_toml(&toml, "test.toml", &std::collections::HashMap::new())
            .unwrap();
    let started = tokio::time::timeout(Duration::from_secs(15), cacheguard::App::start(config))
        .await
        .expect("start did not return");
    let error = match started {
        Ok(_) => panic!("a sentinel was accepted as a standalone Redis"),
        Err(error) => format!("{error:#}"),
    };
    assert!(
        error.contains(&format!("redis.url ({at}) points at a Redis Sentinel"))
            && error.contains("mode = \"sentinel\""),
        "unclear refusal: {error}"
    );
}

/// A primary that closes idle clients (`timeout` not 0) is warned about at start: the
/// connections kept for `lock.wait_replicas` can sit idle longer than that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_closes_idle_clients_is_warned_about() {
    let sentinel = RedisSentinel::start().await;
    let primary = sentinel.primary_port().await.unwrap();
    let mut con = common::redis_server::connect(primary).await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("timeout")
        .arg(5)
        .query_async(&mut con)
        .await
        .unwrap();
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = CgConfig::new(&origin)
        .redis_sentinel(&sentinel)
        .set("lock", "wait_replicas", "1")
        .on_free_ports()
        .write_to(&dir.path().join("cacheguard.toml"));
    let mut cg = common::spawn_cacheguard_process_with_args(&path, &["--log-format", "json"]).await;
    let warned = common::poll_until(Duration::from_secs(5), Duration::from_millis(50), || {
        let output = cg.output();
        async move {
            (output.contains("Redis closes client connections idle")
                && output.contains("\"redis_timeout_s\":5"))
            .then_some(())
        }
    })
    .await;
    let output = cg.output();
    cg.kill();
    assert!(warned.is_some(), "no warning at start:\n{output}");
}
