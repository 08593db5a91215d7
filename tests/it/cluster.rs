//! Redis Cluster as the shared backend (Scale-out), against a real six-node cluster
//! (three primaries, three replicas) started by the harness: topology checks at start,
//! keys spread over every primary, one origin request per cold-key stampede across
//! instances, a primary killed under load, and a slot resharded under load.
//!
//! Each test starts a cluster of its own (six Redis processes), so tests run beside each
//! other.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::common;
use crate::common::fleet::{spawn_fleet, wait_coordinated};
use crate::common::load::{Load, burst, open_warm, outcomes};
use crate::common::redis_server::{connect, query_port, redis_url, scan_keys};
use crate::common::{
    CgConfig, HttpClient, RedisCluster, TestOrigin, admin_redis, default_body, metric, scrape, url,
};

/// Every key matching `pattern` on the node at `port` (`SCAN`, bounded).
async fn scan(port: u16, pattern: &str) -> Vec<String> {
    scan_keys(&mut connect(port).await.unwrap(), pattern).await
}

/// Start-up reports the topology, and L2 works through the cluster: a miss is stored and
/// the next GET (L1 off) is an L2 hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_topology_is_reported_and_l2_serves_hits() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .l1("off")
        .start()
        .await;
    let client = HttpClient::new();
    let shown = admin_redis(&client, cg.admin_addr()).await;
    assert_eq!(shown["up"], true, "{shown}");
    assert_eq!(shown["topology"]["mode"], "cluster", "{shown}");
    assert_eq!(
        shown["topology"]["primaries"].as_array().unwrap().len(),
        3,
        "{shown}"
    );
    assert_eq!(shown["topology"]["replicas"], 3, "{shown}");
    assert_eq!(shown["topology"]["slots_covered"], 16384, "{shown}");
    let (_, exp) = scrape(&client, cg.admin_addr()).await;
    assert_eq!(
        exp.sum("cacheguard_redis_nodes", &[("role", "primary")]),
        3.0
    );
    assert_eq!(
        exp.sum("cacheguard_redis_nodes", &[("role", "replica")]),
        3.0
    );

    for i in 0..20 {
        let path = format!("/api/items/smoke-{i}");
        let first = client.get(&url(cg.addr(), &path)).await;
        assert_eq!(
            (first.status.as_u16(), first.x_cache().as_str()),
            (200, "MISS"),
            "{first}"
        );
        let second = client.get(&url(cg.addr(), &path)).await;
        assert_eq!(
            (second.status.as_u16(), second.x_cache().as_str()),
            (200, "HIT-L2"),
            "{second}"
        );
        assert_eq!(second.body, default_body(&path, 1).as_bytes());
    }

    // lock.wait_replicas on a cluster: the acquire and its WAIT go to the primary of the
    // lock's slot, which has its one replica.
    let waiting = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .set("lock", "wait_replicas", "1")
        .l1("off")
        .start()
        .await;
    common::cold_misses(&client, waiting.addr(), "wait", 3).await;
    let admin = waiting.admin_addr();
    assert_eq!(common::lock_events(&client, admin, "acquired").await, 3.0);
    assert_eq!(
        common::lock_events(&client, admin, "unreplicated").await,
        0.0,
        "WAIT 1 on a primary with one replica"
    );

    // With every replica stopped (for less than the cluster's node timeout), each WAIT
    // times out on the primary the lock went to (a WAIT sent to any other node, with no
    // write of its connection to wait for, would answer at once): `unreplicated`, never a
    // Redis error.
    let primaries = cluster.primaries().await;
    let replicas: Vec<u16> = cluster
        .ports()
        .into_iter()
        .filter(|p| !primaries.contains(p))
        .collect();
    let stopped = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .set("lock", "wait_replicas", "1")
        .set_str("lock", "wait_replicas_timeout", "100ms")
        .l1("off")
        .start()
        .await;
    // Its connection for a lock and WAIT is made while every node answers.
    common::cold_misses(&client, stopped.addr(), "warm", 1).await;
    for port in &replicas {
        cluster.pause(*port);
    }
    common::cold_misses(&client, stopped.addr(), "stopped", 4).await;
    for port in &replicas {
        cluster.resume(*port);
    }
    let exp = common::metrics(&client, stopped.admin_addr()).await;
    let (errors, acquired, unreplicated) = exp.replicated_locks();
    // The warm-up's WAIT is replicated in time on a quiet machine, but may miss its 100 ms
    // on a loaded one: the four made while every replica was stopped are all unreplicated.
    assert_eq!(
        (errors, acquired),
        (0.0, 5.0),
        "(redis_errors{{op=\"lock\"}}, acquired) with every replica stopped"
    );
    assert!(
        (4.0..=5.0).contains(&unreplicated),
        "every WAIT made while the replicas were stopped is unreplicated: {unreplicated}"
    );
}

/// The item paths whose entries live on the node at `port` (read back from the entries:
/// each stores its full key).
async fn paths_on(port: u16) -> Vec<String> {
    let mut con = connect(port).await.unwrap();
    let mut paths = Vec::new();
    for key in scan(port, "cg:{*}:v*").await {
        let Ok(Some(value)) = redis::cmd("GET")
            .arg(&key)
            .query_async::<Option<Vec<u8>>>(&mut con)
            .await
        else {
            continue;
        };
        let text = String::from_utf8_lossy(&value);
        if let Some(at) = text.find("/api/items/") {
            let path: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '-' | '_'))
                .collect();
            paths.push(path);
        }
    }
    paths.sort();
    paths.dedup();
    paths
}

/// 1000 distinct keys through cacheguard land on all three primaries (each entry on the
/// primary that owns its slot), none of them with less than a fifth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_keys_spread_over_all_three_primaries() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .set_str("redis", "command_timeout", "1s")
        .l1("off")
        .start()
        .await;
    let addr = cg.addr();
    let statuses = common::bounded_parallel(1000, 32, Duration::from_secs(120), |i| {
        let client = HttpClient::new();
        async move {
            client
                .get(&url(addr, &format!("/api/items/spread-{i}")))
                .await
                .status
                .as_u16()
        }
    })
    .await;
    assert!(
        statuses.iter().all(|s| *s == 200),
        "not every GET answered 200"
    );

    let primaries = cluster.primaries().await;
    assert_eq!(primaries.len(), 3, "{cluster:?}");
    let mut per_primary = BTreeMap::new();
    let mut total = 0;
    for port in &primaries {
        let entries = scan(*port, "cg:{*}:v").await.len();
        total += entries;
        per_primary.insert(*port, entries);
    }
    eprintln!("entries per primary: {per_primary:?}");
    assert_eq!(
        total, 1000,
        "every key stored exactly once: {per_primary:?}"
    );
    assert!(
        per_primary.values().all(|n| *n >= 200),
        "a primary holds less than a fifth of the keys: {per_primary:?}"
    );
    // Each entry sits with its lock and generation (one hash tag), on its slot's owner.
    let key = scan(primaries[0], "cg:{*}:v").await.remove(0);
    assert_eq!(cluster.owner_of(&key).await, Some(primaries[0]), "{key}");
}

/// Two cacheguard processes on the cluster, 500 concurrent GETs of one cold key (250 per
/// instance, released together on warm connections) → one origin request, 500 × 200 with
/// that one body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_cold_gets_over_two_instances_make_one_origin_request() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let path = "/api/items/cluster-stampede";
    origin.set_delay(path, Duration::from_millis(300));
    let cfg = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .set_str("redis", "command_timeout", "2s")
        .set_str("lock", "lease", "6s")
        .set_str("lock", "wait_timeout", "5s")
        .set("upstream", "max_concurrency", "1024");
    let fleet = spawn_fleet(&cfg, 2).await;
    let client = HttpClient::new();
    wait_coordinated(&client, &fleet.admin_addrs()).await;
    let conns = open_warm(&fleet.addrs(), 250, "/warmup").await;
    assert_eq!(conns.len(), 500);
    let shots = burst(conns, path, Duration::from_secs(20)).await;
    let expected = default_body(path, 1);
    let good = shots
        .iter()
        .filter(|s| matches!(&s.result, Ok(r) if r.status == 200 && r.body == expected.as_bytes()))
        .count();
    assert_eq!(
        good,
        500,
        "every client must get 200 with the one fetched body: {:?}\n{}",
        outcomes(&shots),
        fleet.output()
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        origin.count(path),
        1,
        "500 concurrent misses over 2 instances on a cluster made more than one origin request: {:?}",
        outcomes(&shots)
    );
}

/// Under load, the primary that holds the hot key is killed. Its replica is promoted; no
/// client sees anything but 2xx (A serves its L1 copies, fresh or stale, and every miss
/// falls back to the origin), and B (L1 off) gets L2 hits for that primary's keys again
/// after the promotion, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_killed_under_load_costs_no_errors_and_l2_hits_resume() {
    // Loads the machine or times it: never beside another such test (see `alone::heavy`).
    let _heavy = crate::common::heavy().await;
    let mut cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let base = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .set_str("cache", "ttl", "2s")
        .set_str("cache", "grace", "60s")
        .set("cache", "jitter", "0.0");
    let a = base.clone().l1("all").start().await;
    let b = base.clone().l1("off").start().await;
    let client = HttpClient::new();
    let paths: Vec<String> = (0..30).map(|i| format!("/api/items/fo-{i}")).collect();
    for path in &paths {
        for addr in [a.addr(), a.addr(), b.addr()] {
            let r = client.get(&url(addr, path)).await;
            assert_eq!(r.status, 200, "{r}");
        }
    }
    // The victim: the primary holding the most of these keys; its keys are the ones B
    // must read from L2 again after the promotion.
    let mut victim = (0, Vec::new());
    for port in cluster.primaries().await {
        let on = paths_on(port).await;
        if on.len() > victim.1.len() {
            victim = (port, on);
        }
    }
    let (victim, victim_paths) = victim;
    assert!(!victim_paths.is_empty());
    let hot = victim_paths[0].clone();

    let load_paths = paths.clone();
    let hot_path = hot.clone();
    let load = Load::new(&[a.addr(), b.addr()], move |n| {
        // Half the requests on the hot key, the rest over every key.
        if n % 2 == 0 {
            hot_path.clone()
        } else {
            load_paths[(n as usize / 2) % load_paths.len()].clone()
        }
    })
    .conns(8)
    .pause(Duration::from_millis(2))
    .duration(Duration::from_secs(40))
    .start();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed_at = Instant::now();
    cluster.kill(victim);
    let promoted = cluster
        .wait_failed_over(victim, Duration::from_secs(30))
        .await;
    assert!(promoted.is_some(), "the replica was never promoted");
    let promoted_at = Instant::now();
    // L2 hits resume on B for the killed primary's keys.
    let mut resumed = None;
    while promoted_at.elapsed() < Duration::from_secs(15) {
        let r = client.get(&url(b.addr(), &hot)).await;
        assert!(r.status.is_success(), "{r}");
        if r.x_cache() == "HIT-L2" {
            resumed = Some(promoted_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let tally = load.finish().await;
    eprintln!(
        "killed {victim} ({} of the keys); promoted after {:?}; L2 hits on B again {:?} after; \
         load: {} answers, {:?}",
        victim_paths.len(),
        promoted_at - killed_at,
        resumed,
        tally.answers,
        tally.by_x_cache
    );
    assert_eq!(tally.non_2xx(), 0, "non-2xx answers: {:#?}", tally.bad);
    assert!(
        tally.answers > 500,
        "the load hardly ran: {}",
        tally.answers
    );
    assert!(
        resumed.is_some(),
        "B never got an L2 hit for {hot} in 15 s after the promotion"
    );
    for path in &victim_paths {
        let r = client.get(&url(b.addr(), path)).await;
        assert_eq!(r.status, 200, "{r}");
    }
    let up = metric(&client, b.admin_addr(), "cacheguard_redis_up", &[]).await;
    assert_eq!(up, 1.0, "B's breaker did not close again");
}

/// Under load through two instances (L1 off: every request reads Redis), 1000 slots move
/// from one primary to another with `redis-cli --cluster reshard`. Clients see no error,
/// and afterwards every key is still an L2 hit: the moved entries are found on their new
/// primary (MOVED/ASK followed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_under_load_costs_no_errors() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let cfg = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .set_str("redis", "command_timeout", "1s")
        .l1("off");
    let a = cfg.start().await;
    let b = cfg.start().await;
    let client = HttpClient::new();
    let paths: Vec<String> = (0..300).map(|i| format!("/api/items/rs-{i}")).collect();
    for path in &paths {
        let r = client.get(&url(a.addr(), path)).await;
        assert_eq!(r.status, 200, "{r}");
    }
    let primaries = cluster.primaries().await;
    let (from, to) = (primaries[0], primaries[1]);
    let moving_before = paths_on(from).await;

    let load_paths = paths.clone();
    let load = Load::new(&[a.addr(), b.addr()], move |n| {
        load_paths[n as usize % load_paths.len()].clone()
    })
    .conns(8)
    .duration(Duration::from_secs(90))
    .start();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let resharded = cluster.reshard(from, to, 1000).await;
    assert!(
        resharded.status.success(),
        "reshard failed:\n{}{}",
        String::from_utf8_lossy(&resharded.stdout),
        String::from_utf8_lossy(&resharded.stderr)
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let tally = load.finish().await;
    let now_on_to = paths_on(to).await;
    let moved_keys = moving_before
        .iter()
        .filter(|p| now_on_to.contains(p))
        .count();
    eprintln!(
        "reshard moved {moved_keys} of the keys; load: {} answers, {:?}, {:?}",
        tally.answers, tally.by_status, tally.by_x_cache
    );
    assert!(
        moved_keys > 0,
        "no key of the test moved: the reshard tested nothing"
    );
    assert_eq!(tally.non_2xx(), 0, "client errors: {:#?}", tally.bad);
    for path in &paths {
        let r = client.get(&url(b.addr(), path)).await;
        assert_eq!(
            (r.status.as_u16(), r.x_cache().as_str()),
            (200, "HIT-L2"),
            "{path} after the reshard: {r}"
        );
    }
}

/// A cluster that does not serve every hash slot is refused at start, with a message that
/// says so (here: one node serving 10000 of the 16384 slots).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_without_full_slot_coverage_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port();
    let mut node = common::redis_cluster::spawn_node(port, dir.path(), &[])
        .await
        .unwrap();
    let seed = redis_url(port);
    let mut con = connect(port).await.unwrap();
    let _: String = redis::cmd("CLUSTER")
        .arg("ADDSLOTSRANGE")
        .arg(0)
        .arg(9999)
        .query_async(&mut con)
        .await
        .unwrap();
    let origin = TestOrigin::start().await;
    let toml = CgConfig::new(&origin)
        .set_str("redis", "mode", "cluster")
        .set("redis", "urls", &format!("[\"{seed}\"]"))
        .toml();
    let config =
        cacheguard::Config::from_toml(&toml, "test.toml", &std::collections::HashMap::new())
            .unwrap();
    let started = tokio::time::timeout(Duration::from_secs(15), cacheguard::App::start(config))
        .await
        .expect("start did not return");
    let _ = node.kill();
    let _ = node.wait();
    let error = match started {
        Ok(_) => panic!("a cluster serving 10000 of 16384 slots was accepted"),
        Err(error) => format!("{error:#}"),
    };
    assert!(
        error.contains("serves 10000 of 16384 hash slots"),
        "unclear refusal: {error}"
    );
}

/// The primary every instance subscribes on (the one serving the event channel's slot) is
/// killed. Each instance's event bus moves to another node at once, then back to the
/// channel's new primary (the promoted replica); after that, a write through A is seen
/// through B's L1 as soon as it returns, as before the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_bus_follows_the_channels_primary_through_a_failover() {
    let mut cluster = RedisCluster::start().await;
    let origin = TestOrigin::start_kv().await;
    let cfg = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .routes(&common::kv_routes("100ms", true, Some("all")));
    let a = cfg.start().await;
    let b = cfg.start().await;
    let client = HttpClient::new();
    let channel_home = cluster.owner_of("cg:events").await.unwrap();
    cluster.kill(channel_home);
    assert!(
        cluster
            .wait_failed_over(channel_home, Duration::from_secs(30))
            .await
            .is_some(),
        "no failover"
    );
    let new_home = cluster.owner_of("cg:events").await.unwrap();
    assert_ne!(new_home, channel_home);
    // Re-homing is checked every 2 s.
    let rehomed = common::poll_until(
        Duration::from_secs(15),
        Duration::from_millis(200),
        || async {
            let mut ok = true;
            for admin in [a.admin_addr(), b.admin_addr()] {
                ok &= metric(&client, admin, "cacheguard_event_bus_subscribed", &[]).await == 1.0
                    && metric(
                        &client,
                        admin,
                        "cacheguard_event_bus_resubscriptions_total",
                        &[],
                    )
                    .await
                        >= 1.0
                    && metric(&client, admin, "cacheguard_redis_up", &[]).await == 1.0;
            }
            ok.then_some(())
        },
    )
    .await;
    assert!(rehomed.is_some(), "the event buses did not come back");
    // Two re-home checks' time, with margin for the nodes' views of the new primary.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut stale = Vec::new();
    for k in 0..20 {
        let path = format!("/kv/eb{k}");
        for _ in 0..2 {
            let r = client.get(&url(b.addr(), &path)).await;
            assert_eq!(r.status, 200, "{r}");
        }
        let written = client
            .request(
                http::Method::PUT,
                &url(a.addr(), &path),
                &[],
                common::client::full_body("x"),
            )
            .await
            .unwrap();
        assert_eq!(written.status, 200, "{written}");
        let seen = client.get(&url(b.addr(), &path)).await;
        let body: Value = serde_json::from_slice(&seen.body).unwrap();
        if body["version"] != 1 {
            stale.push(format!("{path}: {}", seen.text()));
        }
    }
    assert!(
        stale.is_empty(),
        "B served stale values after A's write returned: {stale:#?}"
    );
}

/// A standalone `redis.url` that points at a cluster node is refused at start, naming
/// `redis.url` and what it found: commands for the other nodes' slots would be redirected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_url_at_a_cluster_node_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port();
    let mut node = common::redis_cluster::spawn_node(port, dir.path(), &[])
        .await
        .unwrap();
    let origin = TestOrigin::start().await;
    let toml = CgConfig::new(&origin)
        .set_str("redis", "url", &redis_url(port))
        .set_str("redis", "command_timeout", "200ms")
        .toml();
    let config =
        cacheguard::Config::from_toml(&toml, "test.toml", &std::collections::HashMap::new())
            .unwrap();
    let started = tokio::time::timeout(Duration::from_secs(15), cacheguard::App::start(config))
        .await
        .expect("start did not return");
    let _ = node.kill();
    let _ = node.wait();
    let error = match started {
        Ok(_) => panic!("a cluster node was accepted as a standalone Redis"),
        Err(error) => format!("{error:#}"),
    };
    assert!(
        error.contains(&format!(
            "redis.url ({}) points at a Redis Cluster node",
            redis_url(port)
        )) && error.contains("mode = \"cluster\""),
        "unclear refusal: {error}"
    );
}

/// The lock key a fill of this instance holds now, and the primary it is on (bounded wait).
async fn held_lock(cluster: &RedisCluster) -> (String, u16) {
    common::poll_until(Duration::from_secs(5), Duration::from_millis(5), || async {
        for port in cluster.primaries().await {
            if let Some(lock) = scan(port, "cg:{*}:lock").await.pop() {
                return Some((lock, port));
            }
        }
        None
    })
    .await
    .expect("no fill took a lock")
}

/// The slot of the lock a fill holds now, left half-migrated: `MIGRATING` on its primary,
/// `IMPORTING` on another, the key's generation (as an earlier invalidation leaves it: a
/// base key's fill creates none) already moved there. Returns the lock, the slot, and the
/// ports of the two primaries (from, to).
async fn half_migrate_held_lock(cluster: &RedisCluster) -> (String, u16, u16, u16) {
    let (lock, source) = held_lock(cluster).await;
    let slot = cluster.keyslot(&lock).await;
    let target = cluster
        .primaries()
        .await
        .into_iter()
        .find(|p| *p != source)
        .unwrap();
    let generation = lock.replace(":lock", ":gen");
    let set: Option<String> = query_port(
        source,
        redis::cmd("SET")
            .arg(&generation)
            .arg("1")
            .arg("PX")
            .arg(600_000),
    )
    .await;
    assert_eq!(set.as_deref(), Some("OK"), "SET {generation}");
    cluster.begin_migration(slot, source, target).await;
    cluster.migrate(source, target, &[generation]).await;
    (lock, slot, source, target)
}

/// A fill whose slot is half-migrated while it fetches (`MIGRATING` on its primary,
/// `IMPORTING` on another, the key's generation already moved there with `MIGRATE`): its
/// fill script, whose keys the migration has split, is answered `TRYAGAIN` for as long as
/// the slot stays so. It is retried within its budget, then given up: the lock is released
/// at once (gone from both nodes, not left to its lease), nothing counts as a Redis error
/// or toward the breaker (`breaker_failures = 1`: one failure would open it), and one log
/// line names the migration. A second miss of the key meanwhile is answered from the
/// origin (this process alone) and not logged again. Once the migration ends, the key
/// fills and is read from its new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_on_a_half_migrated_slot_gives_up_fast_releases_its_lock_and_is_no_failure() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let path = "/api/items/migrating";
    origin.set_delay(path, Duration::from_millis(700));
    let dir = tempfile::tempdir().unwrap();
    let config = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .set("redis", "breaker_failures", "1")
        .l1("off")
        .on_free_ports()
        .write_to(&dir.path().join("cacheguard.toml"));
    let cg = common::spawn_cacheguard_process(&config).await;
    let client = HttpClient::new();
    let admin = cg.admin_addr();
    common::wait_metric(
        &client,
        admin,
        "cacheguard_redis_up",
        &[],
        Duration::from_secs(10),
        Duration::from_millis(50),
        |v| v == 1.0,
        common::no_poke,
    )
    .await;

    let request = client.spawn_get(&url(cg.addr(), path));
    let (lock, slot, source, target) = half_migrate_held_lock(&cluster).await;

    let first = request.await.unwrap().unwrap();
    assert_eq!(
        (first.status.as_u16(), first.x_cache().as_str()),
        (200, "MISS"),
        "{first}"
    );
    for port in [source, target] {
        let keys = cluster.keys_in_slot(port, slot).await;
        assert!(
            !keys.contains(&lock),
            "the lock is left on {port} after its fill gave up: {keys:?}"
        );
    }

    origin.set_delay(path, Duration::ZERO);
    let second = client.get(&url(cg.addr(), path)).await;
    assert_eq!(
        (second.status.as_u16(), second.x_cache().as_str()),
        (200, "MISS"),
        "{second}"
    );
    assert_eq!(origin.count(path), 2);

    let exp = common::metrics(&client, admin).await;
    let output = cg.output();
    assert_eq!(
        exp.sum("cacheguard_redis_errors_total", &[]),
        0.0,
        "a slot migration counted as Redis errors\n{output}"
    );
    assert_eq!(exp.sum("cacheguard_redis_up", &[]), 1.0, "{output}");
    assert!(
        exp.sum("cacheguard_redis_slot_migrating_total", &[("op", "fill")]) >= 1.0,
        "{output}"
    );
    let named: Vec<&str> = output
        .lines()
        .filter(|l| l.contains("TRYAGAIN") && l.contains("migrated"))
        .collect();
    assert_eq!(named.len(), 1, "one line names the migration:\n{output}");

    cluster.end_migration(slot, source, target).await;
    let filled = common::poll_until(Duration::from_secs(5), Duration::from_millis(50), || {
        let client = client.clone();
        let addr = cg.addr();
        async move {
            let r = client.get(&url(addr, path)).await;
            (r.x_cache() == "HIT-L2").then_some(r)
        }
    })
    .await;
    assert!(
        filled.is_some(),
        "never an L2 hit after the migration ended"
    );
    assert!(
        cluster
            .keys_in_slot(target, slot)
            .await
            .iter()
            .any(|k| k.ends_with(":v")),
        "the entry is on the slot's new primary"
    );
}

/// A migration that ends while the fill script is answered `TRYAGAIN` (keys split between
/// the two nodes) is waited out: the retries (within `command_timeout`, here 1 s) reach
/// the slot's new primary, the entry is stored there, and the next request is an L2 hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_waits_out_a_slot_migration_that_ends_within_its_budget() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let path = "/api/items/migrated";
    origin.set_delay(path, Duration::from_millis(500));
    let cg = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .set_str("redis", "command_timeout", "1s")
        .l1("off")
        .start()
        .await;
    let client = HttpClient::new();
    let request = client.spawn_get(&url(cg.addr(), path));
    let (_, slot, source, target) = half_migrate_held_lock(&cluster).await;
    // The origin has answered: the fill script is being retried.
    assert!(
        common::poll_until(Duration::from_secs(3), Duration::from_millis(5), || async {
            (origin.count(path) == 1 && origin.in_flight() == 0).then_some(())
        })
        .await
        .is_some()
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !request.is_finished(),
        "the fill gave up within 100 ms of a migration: {:?}",
        request.await
    );
    cluster.end_migration(slot, source, target).await;
    let first = request.await.unwrap().unwrap();
    assert_eq!(
        (first.status.as_u16(), first.x_cache().as_str()),
        (200, "MISS"),
        "{first}"
    );
    let second = client.get(&url(cg.addr(), path)).await;
    assert_eq!(
        (second.status.as_u16(), second.x_cache().as_str()),
        (200, "HIT-L2"),
        "{second}"
    );
    assert_eq!(origin.count(path), 1);
    assert_eq!(
        metric(
            &client,
            cg.admin_addr(),
            "cacheguard_redis_errors_total",
            &[]
        )
        .await,
        0.0
    );
}
