//! Consistency: after a write, no instance serves the old value for longer than
//! the configured bound; a read racing a write cannot put the old value back; owed
//! invalidations survive a Redis outage and a restart; purges and the invalidation stream
//! reach every tier. Everything against real redis-server processes.
//!
//! The origin is the test origin's versioned KV store: `GET /kv/{key}` answers the version
//! a (possibly lagging) replica sees, `PUT /kv/{key}` commits version + 1 on the primary.
//!
//! Every test has its own origin, Redis and instances, so tests run beside each other.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::common::*;
use tokio::time::Instant;

const TOKEN: &str = "purge-secret-0123456789";

/// A cached KV route (L1 for every entry: the hardest case, every instance holds copies)
/// and its write route with the delayed double delete.
fn kv_routes(delay: &str, invalidate: bool) -> String {
    common::kv_routes(delay, invalidate, Some("all"))
}

fn kv_config(origin: &TestOrigin, redis: &impl SharedRedis, delay: &str) -> CgConfig {
    redis
        .configure(CgConfig::new(origin))
        .set_str("admin", "token", TOKEN)
        .routes(&kv_routes(delay, true))
}

/// The version in a KV answer.
fn version(resp: &Resp) -> u64 {
    let body: serde_json::Value = serde_json::from_slice(&resp.body)
        .unwrap_or_else(|e| panic!("KV body is not JSON ({e}): {resp}"));
    body["version"]
        .as_u64()
        .unwrap_or_else(|| panic!("KV body has no version: {resp}"))
}

async fn get_version(client: &HttpClient, addr: std::net::SocketAddr, path: &str) -> u64 {
    let resp = client.get(&url(addr, path)).await;
    assert_eq!(resp.status, 200, "GET {path}: {resp}");
    version(&resp)
}

// === 1. read-after-write on every instance ===

/// A write through A returns → A serves the new value at once, from every copy (L1, L2, the
/// query variants of the path), and so do B and C from the moment they hear the write's
/// `invalidate` event. Redis writes the event to their subscriptions before it answers A,
/// so a read that reaches them after the write returned normally finds it handled; but an
/// instance whose event-bus task has not yet run (a loaded machine) serves its L1 copy
/// until it has, as the design says. So on B and C a stale read must turn fresh within the
/// bus's delivery (polled, bounded), and how many did is printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_one_instance_is_seen_by_all_at_once() {
    on_started(RedisServer::start(), read_after_write).await;
}

/// The same on a Redis Cluster: an entry, its variants' index and its generation share a
/// slot; the write's invalidation reaches them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_one_instance_is_seen_by_all_at_once_on_cluster() {
    on_started(RedisCluster::start(), read_after_write).await;
}

async fn read_after_write(redis: &impl SharedRedis) {
    let origin = TestOrigin::start_kv().await;
    let cfg = kv_config(&origin, redis, "200ms");
    let (a, b, c) = (cfg.start().await, cfg.start().await, cfg.start().await);
    let client = HttpClient::new();
    let instances = [a.addr(), b.addr(), c.addr()];
    let paths = |k: usize| [format!("/kv/k{k}"), format!("/kv/k{k}?lang=de")];

    // Every copy everywhere: L2, and L1 on each instance (the second GET is an L1 hit).
    for k in 0..20 {
        for addr in instances {
            for path in paths(k) {
                for _ in 0..2 {
                    assert_eq!(get_version(&client, addr, &path).await, 0);
                }
                let resp = client.get(&url(addr, &path)).await;
                assert_eq!(resp.x_cache(), "HIT-L1", "{path} on {addr}: {resp}");
            }
        }
    }
    let mut stale = Vec::new();
    let mut late = Vec::new();
    for k in 0..20 {
        let written = put(&client, a.addr(), &format!("/kv/k{k}")).await;
        assert_eq!(written.status, 200, "{written}");
        assert_eq!(version(&written), 1);
        for addr in instances {
            for path in paths(k) {
                let seen = get_version(&client, addr, &path).await;
                if seen == 1 {
                    continue;
                }
                if addr == a.addr() {
                    stale.push(format!("{path} on the writer {addr}: version {seen}"));
                    continue;
                }
                let heard = Instant::now() + Duration::from_secs(5);
                let mut now_seen = seen;
                while now_seen != 1 && Instant::now() < heard {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    now_seen = get_version(&client, addr, &path).await;
                }
                if now_seen == 1 {
                    late.push(format!("{path} on {addr}"));
                } else {
                    stale.push(format!("{path} on {addr}: version {now_seen} after 5 s"));
                }
            }
        }
    }
    assert!(
        stale.is_empty(),
        "stale reads after the write returned:\n{}",
        stale.join("\n")
    );
    println!(
        "reads on the other instances before they heard the write: {} of 80 ({})",
        late.len(),
        late.join(", ")
    );
    let done = metric(
        &client,
        a.admin_addr(),
        "cacheguard_invalidations_total",
        &[("source", "write"), ("result", "done")],
    )
    .await;
    assert!(done >= 40.0, "before and after each of 20 writes: {done}");
    // Right after a write its keys are quarantined: fetched, answered, not kept.
    let mut quarantined = 0.0;
    for admin in [a.admin_addr(), b.admin_addr(), c.admin_addr()] {
        quarantined += metric(
            &client,
            admin,
            "cacheguard_fill_refused_total",
            &[("reason", "quarantine")],
        )
        .await;
    }
    assert!(
        quarantined >= 20.0,
        "fills during the write quarantine kept nothing: {quarantined}"
    );
    for r in [a, b, c] {
        r.shutdown().await;
    }
}

/// A write route without `invalidate` patterns still invalidates what its answer's
/// surrogate keys name; the tags never reach clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn surrogate_keys_of_a_write_answer_invalidate_tagged_entries() {
    on_started(RedisServer::start(), surrogate_keys).await;
}

/// The same on a Redis Cluster, where a tag's index and the tagged entries live in
/// different slots (on different primaries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn surrogate_keys_of_a_write_answer_invalidate_tagged_entries_on_cluster() {
    on_started(RedisCluster::start(), surrogate_keys).await;
}

async fn surrogate_keys(redis: &impl SharedRedis) {
    let origin = TestOrigin::start_kv().await;
    origin.set_kv_tags(true);
    let cfg = redis
        .configure(CgConfig::new(&origin))
        .routes(&kv_routes("200ms", false));
    let (a, b) = (cfg.start().await, cfg.start().await);
    let client = HttpClient::new();
    for addr in [a.addr(), b.addr()] {
        for path in ["/kv/t1", "/kv/t1?x=1", "/kv/t2"] {
            let resp = client.get(&url(addr, path)).await;
            assert_eq!(version(&resp), 0);
            assert!(
                resp.header("surrogate-key").is_none(),
                "the origin's tags leaked to a client: {resp}"
            );
        }
    }
    let written = put(&client, a.addr(), "/kv/t1").await;
    assert!(written.header("surrogate-key").is_none(), "{written}");
    for addr in [a.addr(), b.addr()] {
        assert_eq!(
            get_version(&client, addr, "/kv/t1").await,
            1,
            "t1 on {addr}"
        );
        assert_eq!(
            get_version(&client, addr, "/kv/t1?x=1").await,
            1,
            "t1?x=1 on {addr}"
        );
        // t2 carries `kv-all` too, which the write named: invalidated, refetched (still 0).
        let resp = client.get(&url(addr, "/kv/t2")).await;
        assert_eq!(version(&resp), 0);
    }
    a.shutdown().await;
    b.shutdown().await;
}

// === 2. a read racing a write ===

/// A reader's origin fetch begins (the slow origin answers the old value after 500 ms); a
/// write commits in between → the old value is not stored; the next GET shows the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_that_raced_a_write_is_not_stored() {
    on_started(RedisServer::start(), raced_fill).await;
}

/// The same on a Redis Cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_that_raced_a_write_is_not_stored_on_cluster() {
    on_started(RedisCluster::start(), raced_fill).await;
}

async fn raced_fill(redis: &impl SharedRedis) {
    let origin = TestOrigin::start_kv().await;
    let cfg = kv_config(&origin, redis, "200ms");
    let (a, b) = (cfg.start().await, cfg.start().await);
    race(&origin, a.addr(), b.addr(), a.admin_addr()).await;
    a.shutdown().await;
    b.shutdown().await;
}

/// The same race with no Redis at all: the local generation marks refuse the fill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_that_raced_a_write_is_not_stored_in_embedded_mode() {
    let origin = TestOrigin::start_kv().await;
    let cg = CgConfig::new(&origin)
        .routes(&kv_routes("200ms", true))
        .start()
        .await;
    race(&origin, cg.addr(), cg.addr(), cg.admin_addr()).await;
    cg.shutdown().await;
}

/// The same race when the key had no generation when the fetch began, and the write's
/// generation is gone by the time the fill lands (evicted by an `allkeys-*` Redis, here
/// deleted): the fill must still be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_that_raced_a_write_is_not_stored_when_the_generation_was_evicted() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start_kv().await;
    // No delayed delete: nothing after the write would bump the generation again.
    let cfg = kv_config(&origin, &redis, "0s");
    let (a, b) = (cfg.start().await, cfg.start().await);
    let client = HttpClient::new();
    origin.set_kv_read_delay(Duration::from_millis(800));
    let slow = {
        let client = client.clone();
        let reader = a.addr();
        tokio::spawn(async move { get_version(&client, reader, "/kv/evicted").await })
    };
    let begun = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        || async { (origin.kv_reads("evicted") == 1).then_some(()) },
    )
    .await;
    assert!(begun.is_some(), "the slow read has begun");
    let written = put(&client, b.addr(), "/kv/evicted").await;
    assert_eq!(version(&written), 1);
    // The write's generation is evicted before the slow fill lands.
    let mut con = redis.client().await;
    for key in redis.scan("cg:*:gen").await {
        redis::cmd("DEL")
            .arg(&key)
            .query_async::<i64>(&mut con)
            .await
            .expect("DEL gen");
    }
    origin.set_kv_read_delay(Duration::ZERO);
    assert_eq!(
        slow.await.expect("slow read"),
        0,
        "it began before the write"
    );
    for addr in [a.addr(), b.addr()] {
        for _ in 0..3 {
            let resp = client.get(&url(addr, "/kv/evicted")).await;
            assert_eq!(version(&resp), 1, "the old value was stored: {resp}");
        }
    }
    a.shutdown().await;
    b.shutdown().await;
}

async fn race(
    origin: &TestOrigin,
    reader: std::net::SocketAddr,
    writer: std::net::SocketAddr,
    reader_admin: std::net::SocketAddr,
) {
    let client = HttpClient::new();
    origin.set_kv_read_delay(Duration::from_millis(500));
    let slow = {
        let client = client.clone();
        tokio::spawn(async move { get_version(&client, reader, "/kv/race").await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(origin.kv_reads("race"), 1, "the slow read has begun");
    let written = put(&client, writer, "/kv/race").await;
    assert_eq!(version(&written), 1);
    origin.set_kv_read_delay(Duration::ZERO);
    assert_eq!(
        slow.await.expect("slow read"),
        0,
        "it began before the write"
    );
    for _ in 0..3 {
        let resp = client.get(&url(reader, "/kv/race")).await;
        assert_eq!(version(&resp), 1, "the old value was stored: {resp}");
    }
    let refused = metric(
        &client,
        reader_admin,
        "cacheguard_fill_refused_total",
        &[("reason", "generation")],
    )
    .await;
    assert!(
        refused >= 1.0,
        "the raced fill was counted as refused: {refused}"
    );
}

// === a gap in the event subscription ===

/// B holds L1 copies of 100 keys; its event subscription is cut and kept down while A
/// writes all of them; once B has re-subscribed, none of its old copies is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_copies_from_before_a_bus_gap_are_not_served_after_it() {
    let redis = RedisServer::start().await;
    bus_gap(&redis, &[redis.url()], "all", 100).await;
}

/// The same for hot keys in the default `l1 = "hot"`: their L1 copies are checked too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_l1_copies_from_before_a_bus_gap_are_not_served_after_it() {
    let redis = RedisServer::start().await;
    bus_gap(&redis, &[redis.url()], "hot", 5).await;
}

/// The same on a Redis Cluster (every node's subscriptions are cut).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_copies_from_before_a_bus_gap_are_not_served_after_it_on_cluster() {
    let cluster = RedisCluster::start().await;
    bus_gap(&cluster, &cluster.urls(), "all", 100).await;
}

async fn bus_gap(redis: &impl SharedRedis, nodes: &[String], l1: &str, keys: usize) {
    let origin = TestOrigin::start_kv().await;
    let cfg = redis
        .configure(CgConfig::new(&origin))
        .set("hot_keys", "threshold_rps", "20")
        .routes(&common::kv_routes("0s", true, Some(l1)));
    let (a, b) = (cfg.start().await, cfg.start().await);
    let client = HttpClient::new();
    let path = |i: usize| format!("/kv/gap{i}");
    for i in 0..keys {
        assert_eq!(get_version(&client, b.addr(), &path(i)).await, 0);
    }
    if l1 == "hot" {
        // Hot on B: requested well above the threshold until B lists every one.
        let all_hot = poll_until(Duration::from_secs(10), Duration::ZERO, || async {
            for i in 0..keys {
                for _ in 0..10 {
                    get_version(&client, b.addr(), &path(i)).await;
                }
            }
            let hot = common::hot::hot_list(&common::hot::hotkeys(&client, b.admin_addr()).await);
            (hot.len() >= keys).then_some(())
        })
        .await;
        assert!(all_hot.is_some(), "the keys did not turn hot on B");
    }
    for i in 0..keys {
        let resp = client.get(&url(b.addr(), &path(i))).await;
        // A hot key's copy is checked against Redis now and then (HIT-L2).
        let held = resp.x_cache() == "HIT-L1" || (l1 == "hot" && resp.x_cache() == "HIT-L2");
        assert!(held, "B holds {}: {resp}", path(i));
    }
    let resubscribed = || async {
        metric(
            &client,
            b.admin_addr(),
            "cacheguard_event_bus_resubscriptions_total",
            &[],
        )
        .await
    };
    let before = resubscribed().await;
    // Keep every subscription down (each reconnect is killed at once) while A writes.
    let mut conns = Vec::new();
    for node in nodes {
        let client = redis::Client::open(node.as_str()).expect("node url");
        conns.push(
            client
                .get_multiplexed_async_connection()
                .await
                .expect("connect"),
        );
    }
    let cutting = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let cutter = {
        let cutting = Arc::clone(&cutting);
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while cutting.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < deadline {
                for con in &mut conns {
                    let _: redis::RedisResult<i64> = redis::cmd("CLIENT")
                        .arg("KILL")
                        .arg("TYPE")
                        .arg("pubsub")
                        .query_async(con)
                        .await;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let down = wait_metric(
        &client,
        b.admin_addr(),
        "cacheguard_event_bus_subscribed",
        &[],
        Duration::from_secs(5),
        Duration::from_millis(5),
        |v| v == 0.0,
        no_poke,
    )
    .await;
    assert_eq!(down, 0.0, "B's subscription was not cut");
    for i in 0..keys {
        assert_eq!(version(&put(&client, a.addr(), &path(i)).await), 1);
    }
    cutting.store(false, std::sync::atomic::Ordering::Relaxed);
    cutter.await.expect("cutter");
    let back = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let live = metric(
                &client,
                b.admin_addr(),
                "cacheguard_event_bus_subscribed",
                &[],
            )
            .await;
            (live == 1.0 && resubscribed().await > before).then_some(())
        },
    )
    .await;
    assert!(back.is_some(), "B did not re-subscribe");
    let mut old = Vec::new();
    for i in 0..keys {
        let resp = client.get(&url(b.addr(), &path(i))).await;
        if version(&resp) != 1 {
            old.push(format!("{} {}", path(i), resp.x_cache()));
        }
    }
    assert!(
        old.is_empty(),
        "{} of {keys} old copies served after the gap: {old:?}",
        old.len()
    );
    a.shutdown().await;
    b.shutdown().await;
}

// === 3. stress: 8 writers, 32 readers, replica lag ===

/// One stress run's observations.
struct Observed {
    writes: usize,
    reads: usize,
    /// Reads that began more than `bound` after some write of their key returned, and saw
    /// an older version than it.
    stale_after_bound: usize,
}

/// `writers` + `readers` closed loops over `keys` keys for `run`, each request to a random
/// instance; then counts stale reads (see [`Observed`]).
async fn stress(
    instances: &[std::net::SocketAddr],
    keys: usize,
    writers: usize,
    readers: usize,
    run: Duration,
    bound: Duration,
) -> Observed {
    let started = Instant::now();
    let deadline = started + run;
    // (key, return time, version) and (key, start time, version).
    let writes = Arc::new(std::sync::Mutex::new(Vec::<(usize, Duration, u64)>::new()));
    let reads = Arc::new(std::sync::Mutex::new(Vec::<(usize, Duration, u64)>::new()));
    let mut tasks = Vec::new();
    for worker in 0..writers + readers {
        let instances = instances.to_vec();
        let (writes, reads) = (Arc::clone(&writes), Arc::clone(&reads));
        tasks.push(tokio::spawn(async move {
            let client = HttpClient::new();
            let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ (worker as u64 + 1);
            let mut next = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            // Bounded by time and by count.
            for _ in 0..200_000 {
                if Instant::now() >= deadline {
                    break;
                }
                let key = next() as usize % keys;
                let addr = instances[next() as usize % instances.len()];
                let path = format!("/kv/s{key}");
                if worker < writers {
                    let resp = put(&client, addr, &path).await;
                    assert_eq!(resp.status, 200, "{resp}");
                    let at = started.elapsed();
                    writes
                        .lock()
                        .expect("writes")
                        .push((key, at, version(&resp)));
                } else {
                    let at = started.elapsed();
                    let seen = get_version(&client, addr, &path).await;
                    reads.lock().expect("reads").push((key, at, seen));
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("stress worker");
    }
    let writes = std::mem::take(&mut *writes.lock().expect("writes"));
    let reads = std::mem::take(&mut *reads.lock().expect("reads"));
    // Per key: writes by return time, with the running maximum version.
    let mut by_key: HashMap<usize, Vec<(Duration, u64)>> = HashMap::new();
    for &(key, at, v) in &writes {
        by_key.entry(key).or_default().push((at, v));
    }
    for list in by_key.values_mut() {
        list.sort();
        let mut max = 0;
        for entry in list.iter_mut() {
            max = max.max(entry.1);
            entry.1 = max;
        }
    }
    let stale_after_bound = reads
        .iter()
        .filter(|&&(key, at, seen)| {
            let Some(list) = by_key.get(&key) else {
                return false;
            };
            let Some(cutoff) = at.checked_sub(bound) else {
                return false;
            };
            // The newest version returned before `at - bound`.
            let i = list.partition_point(|&(t, _)| t < cutoff);
            i > 0 && list[i - 1].1 > seen
        })
        .count();
    Observed {
        writes: writes.len(),
        reads: reads.len(),
        stale_after_bound,
    }
}

/// The stress load (8 writers, 32 readers, 100 keys, `run`) through three instances of
/// `kv_config(origin, redis, delay)`, stopped afterwards.
async fn stress_fleet(
    origin: &TestOrigin,
    redis: &impl SharedRedis,
    delay: &str,
    run: Duration,
    bound: Duration,
) -> Observed {
    let cfg = kv_config(origin, redis, delay);
    let fleet = [cfg.start().await, cfg.start().await, cfg.start().await];
    let addrs: Vec<_> = fleet.iter().map(|r| r.addr()).collect();
    let observed = stress(&addrs, 100, 8, 32, run, bound).await;
    for r in fleet {
        r.shutdown().await;
    }
    observed
}

/// A KV origin whose replica trails the primary by 50 ms.
async fn lagging_kv_origin() -> TestOrigin {
    let origin = TestOrigin::start_kv().await;
    origin.set_replica_lag(Duration::from_millis(50));
    origin
}

/// The stress run had enough load to tell, and no read began more than `bound` after a
/// write returned yet saw an older version.
fn assert_never_stale(guarded: &Observed, bound: Duration) {
    assert!(
        guarded.writes > 200 && guarded.reads > 1000,
        "too little load to tell"
    );
    assert_eq!(
        guarded.stale_after_bound, 0,
        "reads older than a write that returned over {bound:?} before"
    );
}

/// 8 writers and 32 readers over 100 keys for 10 s through 3 instances, origin replica lag
/// 50 ms: reads that begin more than `double_delete_delay` after a write returned never see
/// an older version. The same load on a naive cache-aside configuration (no delayed
/// delete) does show stale reads: the count detects staleness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_with_replica_lag_never_serves_older_than_the_bound() {
    // Loads the machine or times it: never beside another such test (see `alone::heavy`).
    let _heavy = crate::common::heavy().await;
    const BOUND: Duration = Duration::from_millis(200);
    let origin = lagging_kv_origin().await;

    let redis = RedisServer::start().await;
    let guarded = stress_fleet(&origin, &redis, "200ms", Duration::from_secs(10), BOUND).await;
    let naive_redis = RedisServer::start().await;
    let naive = stress_fleet(&origin, &naive_redis, "0s", Duration::from_secs(5), BOUND).await;

    eprintln!(
        "guarded: {} writes, {} reads, {} stale after {BOUND:?}; naive cache-aside: {} writes, {} reads, {} stale",
        guarded.writes,
        guarded.reads,
        guarded.stale_after_bound,
        naive.writes,
        naive.reads,
        naive.stale_after_bound
    );
    assert_never_stale(&guarded, BOUND);
    assert!(
        naive.stale_after_bound > 0,
        "the naive configuration showed no stale read: the check cannot detect staleness"
    );
}

/// The guarded half of the stress test on a Redis Cluster (the naive half above already
/// shows that the count detects staleness): 8 writers and 32 readers over 100 keys for
/// 10 s through 3 instances, 50 ms replica lag → no read that began more than
/// `double_delete_delay` after a write returned saw an older version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stress_with_replica_lag_never_serves_older_than_the_bound_on_cluster() {
    // Loads the machine or times it: never beside another such test (see `alone::heavy`).
    let _heavy = crate::common::heavy().await;
    const BOUND: Duration = Duration::from_millis(200);
    let origin = lagging_kv_origin().await;
    let cluster = RedisCluster::start().await;
    let guarded = stress_fleet(&origin, &cluster, "200ms", Duration::from_secs(10), BOUND).await;
    eprintln!(
        "cluster: {} writes, {} reads, {} stale after {BOUND:?}",
        guarded.writes, guarded.reads, guarded.stale_after_bound
    );
    assert_never_stale(&guarded, BOUND);
}

// === 4. Redis down during writes, cacheguard restarted ===

/// A config file for a cacheguard process on fixed ports, its Redis through `redis_url`, its
/// journal at `journal`.
fn process_config(
    dir: &Path,
    origin: &TestOrigin,
    redis_url: &str,
    journal: &Path,
    extra: &str,
) -> std::path::PathBuf {
    CgConfig::new(origin)
        .on_free_ports()
        .set_str("redis", "url", redis_url)
        .set_str("redis", "command_timeout", "200ms")
        .set_str("journal", "path", &journal.display().to_string())
        .set_str("admin", "token", TOKEN)
        .routes(&format!("{}{extra}", kv_routes("200ms", true)))
        .write_to(&dir.join(format!("cg-{}.toml", free_port())))
}

/// Redis is cut off from instance A during 100 writes: all 100 succeed at the origin, the
/// journal holds the deletes; A is killed (SIGKILL) and started again while Redis is still
/// unreachable; Redis comes back → every delete applied, journal empty, and no instance
/// serves a stale value (B kept reading Redis all along and had the old entries).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_during_a_redis_outage_are_journaled_and_survive_a_restart() {
    let redis = RedisServer::start().await;
    let link = TcpProxy::start(redis.addr()).await;
    let origin = TestOrigin::start_kv().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let journal = dir.path().join("a.journal");
    let conf_a = process_config(dir.path(), &origin, &link.redis_url(), &journal, "");
    let mut a = spawn_cacheguard_process(&conf_a).await;
    let b = CgConfig::new(&origin)
        .redis(&redis)
        .routes(&kv_routes("200ms", true))
        .l1("off")
        .start()
        .await;
    let client = HttpClient::new();
    let depth = |admin| {
        let client = client.clone();
        async move { metric(&client, admin, "cacheguard_journal_depth", &[]).await }
    };
    let keys: Vec<String> = (0..100).map(|k| format!("/kv/j{k}")).collect();
    for path in &keys {
        assert_eq!(get_version(&client, b.addr(), path).await, 0);
    }
    assert_eq!(redis.entry_keys().await.len(), 100);

    link.cut();
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            let (text, _) = scrape(&client, a.admin_addr()).await;
            text.contains("cacheguard_redis_up 0").then_some(())
        },
    )
    .await
    .expect("A sees Redis down");
    for path in &keys {
        let resp = put(&client, a.addr(), path).await;
        assert_eq!(
            resp.status, 200,
            "a write was refused while Redis was down: {resp}"
        );
        assert_eq!(version(&resp), 1);
    }
    for path in &keys {
        let key = path.trim_start_matches("/kv/");
        assert_eq!(origin.kv_version(key), 1, "{path} reached the origin");
    }
    // Each write owes one base key: before, after and the delayed delete are one record.
    let owed = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            let d = depth(a.admin_addr()).await;
            (d >= 100.0).then_some(d)
        },
    )
    .await;
    assert_eq!(owed, Some(100.0), "journal depth on A");
    // B reads Redis, which still holds the old entries: the outage's stale window.
    assert_eq!(get_version(&client, b.addr(), "/kv/j0").await, 0);

    // Crash A and start it again, Redis still unreachable: the journal is read back.
    a.kill();
    let mut a = spawn_cacheguard_process(&conf_a).await;
    assert_eq!(
        depth(a.admin_addr()).await,
        100.0,
        "journal depth after the restart"
    );
    assert_eq!(
        get_version(&client, a.addr(), "/kv/j1").await,
        1,
        "A does not read Redis for a key it owes an invalidation"
    );

    link.restore();
    let drained = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async { (depth(a.admin_addr()).await == 0.0).then_some(()) },
    )
    .await;
    assert!(
        drained.is_some(),
        "journal not drained after Redis came back\n{}",
        a.output()
    );
    let mut stale = Vec::new();
    for path in &keys {
        for addr in [a.addr(), b.addr()] {
            let seen = get_version(&client, addr, path).await;
            if seen != 1 {
                stale.push(format!("{path} on {addr}: {seen}"));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "stale after the journal drained:\n{}",
        stale.join("\n")
    );
    let (_, exp) = scrape(&client, a.admin_addr()).await;
    assert_eq!(exp.sum("cacheguard_journal_give_ups_total", &[]), 0.0);
    assert!(exp.sum("cacheguard_journal_applied_total", &[]) >= 100.0);
    assert!(journal.exists(), "the journal file is kept (empty)");
    a.kill();
    b.shutdown().await;
}

// === 5. purge API ===

/// Purge by key, by pattern and by tag reaches L1 and L2 on every instance; without a
/// token → 401, with a wrong one → 403, and then nothing is purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_by_key_pattern_and_tag() {
    on_started(RedisServer::start(), purge_all_ways).await;
}

/// The same on a Redis Cluster (a pattern purge scans the route's tag index on its
/// primary; the keys it names live on all of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_by_key_pattern_and_tag_on_cluster() {
    on_started(RedisCluster::start(), purge_all_ways).await;
}

async fn purge_all_ways(redis: &impl SharedRedis) {
    let origin = TestOrigin::start_kv().await;
    origin.set_kv_tags(true);
    let cfg = kv_config(&origin, redis, "200ms");
    let (a, b) = (cfg.start().await, cfg.start().await);
    let client = HttpClient::new();
    let paths = [
        "/kv/p1",
        "/kv/p1?v=2",
        "/kv/p2",
        "/kv/c1",
        "/kv/c2",
        "/kv/other",
    ];
    for addr in [a.addr(), b.addr()] {
        for path in paths {
            assert_eq!(get_version(&client, addr, path).await, 0);
        }
    }
    // The data changes behind the cache's back (a PUT straight to the origin).
    for key in ["p1", "p2", "c1", "c2", "other"] {
        put(&client, origin.addr(), &format!("/kv/{key}")).await;
    }
    let everything = r#"{"keys": ["/kv/p1"], "patterns": ["/kv/c*"], "tags": ["kv-p2"]}"#;
    let refused = purge(&client, a.admin_addr(), None, everything).await;
    assert_eq!(refused.status, 401, "{refused}");
    let refused = purge(
        &client,
        a.admin_addr(),
        Some("wrong-token-000000000000"),
        everything,
    )
    .await;
    assert_eq!(refused.status, 403, "{refused}");
    for addr in [a.addr(), b.addr()] {
        for path in paths {
            assert_eq!(
                get_version(&client, addr, path).await,
                0,
                "{path} purged by a refused call"
            );
        }
    }

    let ok = purge(
        &client,
        a.admin_addr(),
        Some(TOKEN),
        r#"{"keys": ["/kv/p1"]}"#,
    )
    .await;
    assert_eq!(ok.status, 200, "{ok}");
    for addr in [b.addr(), a.addr()] {
        assert_eq!(get_version(&client, addr, "/kv/p1").await, 1);
        assert_eq!(
            get_version(&client, addr, "/kv/p1?v=2").await,
            1,
            "variants go with their key"
        );
        assert_eq!(get_version(&client, addr, "/kv/p2").await, 0);
    }
    let ok = purge(
        &client,
        b.admin_addr(),
        Some(TOKEN),
        r#"{"patterns": ["/kv/c*"]}"#,
    )
    .await;
    assert_eq!(ok.status, 200, "{ok}");
    let outcome: serde_json::Value = serde_json::from_slice(&ok.body).expect("JSON");
    assert_eq!(outcome["pattern_matches"], 2, "{ok}");
    for addr in [a.addr(), b.addr()] {
        assert_eq!(get_version(&client, addr, "/kv/c1").await, 1);
        assert_eq!(get_version(&client, addr, "/kv/c2").await, 1);
        assert_eq!(get_version(&client, addr, "/kv/other").await, 0);
        assert_eq!(get_version(&client, addr, "/kv/p2").await, 0);
    }
    let ok = purge(
        &client,
        a.admin_addr(),
        Some(TOKEN),
        r#"{"tags": ["kv-p2"]}"#,
    )
    .await;
    assert_eq!(ok.status, 200, "{ok}");
    for addr in [a.addr(), b.addr()] {
        assert_eq!(get_version(&client, addr, "/kv/p2").await, 1);
        assert_eq!(get_version(&client, addr, "/kv/other").await, 0);
    }

    for bad in [
        "not json",
        "{}",
        r#"{"keys": ["no-slash"]}"#,
        r#"{"pattern": ["/x"]}"#,
    ] {
        let resp = purge(&client, a.admin_addr(), Some(TOKEN), bad).await;
        assert_eq!(resp.status, 400, "{bad}: {resp}");
    }
    let (_, exp) = scrape(&client, a.admin_addr()).await;
    assert_eq!(
        exp.sum("cacheguard_purges_total", &[("result", "unauthorized")]),
        1.0
    );
    assert_eq!(
        exp.sum("cacheguard_purges_total", &[("result", "forbidden")]),
        1.0
    );
    assert_eq!(exp.sum("cacheguard_purges_total", &[("result", "ok")]), 2.0);
    assert_eq!(
        exp.sum("cacheguard_purges_total", &[("result", "bad_request")]),
        4.0
    );
    a.shutdown().await;
    b.shutdown().await;
}

// === 6. the invalidation stream ===

async fn xadd_paths(redis: &impl SharedRedis, paths: impl Iterator<Item = String>) {
    let mut con = redis.conn().await;
    for path in paths {
        redis::cmd("XADD")
            .arg("cg:invalidate")
            .arg("*")
            .arg("path")
            .arg(path)
            .query_async::<String>(&mut con)
            .await
            .expect("XADD");
    }
}

/// Entries delivered to the group and not yet acknowledged (0 before the group exists).
async fn group_pending(redis: &impl SharedRedis) -> i64 {
    let mut con = redis.conn().await;
    let Ok(summary) = redis::cmd("XPENDING")
        .arg("cg:invalidate")
        .arg("cacheguard")
        .query_async::<redis::Value>(&mut con)
        .await
    else {
        return 0;
    };
    match summary {
        redis::Value::Array(items) => match items.first() {
            Some(redis::Value::Int(n)) => *n,
            _ => -1,
        },
        _ => -1,
    }
}

/// 1000 path entries in `cg:invalidate` → every one applied (all instances serve the new
/// values); the consumer that had them pending is killed mid-way → another claims and
/// applies them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_entries_are_all_applied_and_a_dead_consumers_are_claimed() {
    let redis = RedisServer::start().await;
    let link = TcpProxy::start(redis.addr()).await;
    let origin = TestOrigin::start_kv().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let journal = dir.path().join("slow.journal");
    // A slow consumer: its Redis link adds 15 ms per chunk, so a batch takes seconds.
    let conf = process_config(
        dir.path(),
        &origin,
        &link.redis_url(),
        &journal,
        "\n[invalidation_stream]\nbatch = 200\nclaim_idle = \"1s\"\n",
    );
    let reader = CgConfig::new(&origin)
        .redis(&redis)
        .routes(&kv_routes("200ms", true))
        .set("invalidation_stream", "enabled", "false")
        .start()
        .await;
    let client = HttpClient::new();
    let keys: Vec<String> = (0..1000).map(|k| format!("/kv/x{k}")).collect();
    for path in &keys {
        assert_eq!(get_version(&client, reader.addr(), path).await, 0);
    }
    for path in &keys {
        put(&client, origin.addr(), path).await;
    }

    // The entries are there before the slow consumer starts: its first read takes a whole
    // batch, which it needs seconds to apply, and acknowledges only after.
    xadd_paths(&redis, keys.iter().cloned()).await;
    link.set_delay(Duration::from_millis(15));
    let mut slow = spawn_cacheguard_process(&conf).await;
    let pending = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let n = group_pending(&redis).await;
            (n >= 100).then_some(n)
        },
    )
    .await
    .expect("the slow consumer took entries");
    slow.kill();
    eprintln!("killed the slow consumer with {pending} entries pending");

    // The survivor joins the same group and claims what the dead consumer left.
    let survivor = CgConfig::new(&origin)
        .redis(&redis)
        .routes(&kv_routes("200ms", true))
        .set_str("invalidation_stream", "claim_idle", "1s")
        .start()
        .await;
    let drained = poll_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            let (_, exp) = scrape(&client, survivor.admin_addr()).await;
            let applied = exp.sum("cacheguard_stream_entries_total", &[("result", "applied")]);
            (group_pending(&redis).await == 0 && applied > 0.0).then_some(exp)
        },
    )
    .await
    .expect("the stream was not drained");
    assert!(
        drained.sum("cacheguard_stream_claimed_total", &[]) > 0.0,
        "the survivor claimed the dead consumer's entries"
    );
    let mut stale = Vec::new();
    for path in &keys {
        let seen = get_version(&client, reader.addr(), path).await;
        if seen != 1 {
            stale.push(path.clone());
        }
    }
    assert!(
        stale.is_empty(),
        "{} of 1000 entries not applied: {:?}",
        stale.len(),
        &stale[..stale.len().min(10)]
    );
    survivor.shutdown().await;
    reader.shutdown().await;
}

/// On a Redis Cluster: the stream key lives on one primary (its slot's); 500 path entries
/// written there are all applied by a consumer reading over its own cluster connection,
/// and reach another instance's L1 through the event bus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_entries_are_all_applied_on_cluster() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start_kv().await;
    let reader = kv_config(&origin, &cluster, "200ms")
        .set("invalidation_stream", "enabled", "false")
        .start()
        .await;
    let consumer = kv_config(&origin, &cluster, "200ms").start().await;
    let client = HttpClient::new();
    let keys: Vec<String> = (0..500).map(|k| format!("/kv/s{k}")).collect();
    for path in &keys {
        assert_eq!(get_version(&client, reader.addr(), path).await, 0);
    }
    for path in &keys {
        put(&client, origin.addr(), path).await;
    }
    xadd_paths(&cluster, keys.iter().cloned()).await;
    let applied = poll_until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let (_, exp) = scrape(&client, consumer.admin_addr()).await;
            let n = exp.sum("cacheguard_stream_entries_total", &[("result", "applied")]);
            (n >= 500.0 && group_pending(&cluster).await == 0).then_some(n)
        },
    )
    .await;
    assert!(
        applied.is_some(),
        "the stream was not drained on the cluster"
    );
    let mut stale = Vec::new();
    for path in &keys {
        if get_version(&client, reader.addr(), path).await != 1 {
            stale.push(path.clone());
        }
    }
    assert!(
        stale.is_empty(),
        "{} of 500 not applied: {:?}",
        stale.len(),
        &stale[..stale.len().min(10)]
    );
    // The consumer's blocking reads come back empty when idle, without errors (a response
    // timeout shorter than the BLOCK would fail every idle read and reconnect).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        metric(
            &client,
            consumer.admin_addr(),
            "cacheguard_stream_errors_total",
            &[]
        )
        .await,
        0.0,
        "the stream consumer failed on the cluster"
    );
    consumer.shutdown().await;
    reader.shutdown().await;
}

/// A Redis that may evict any key (an `allkeys-*` policy) could evict generation keys:
/// cacheguard says so at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allkeys_eviction_policy_is_warned_about_at_start() {
    let redis = RedisServer::start().await;
    let mut con = redis.client().await;
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async::<()>(&mut con)
        .await
        .expect("CONFIG SET");
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = process_config(
        dir.path(),
        &origin,
        &redis.url(),
        &dir.path().join("j.journal"),
        "",
    );
    let cg = spawn_cacheguard_process(&conf).await;
    let warned = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async { cg.output().contains("maxmemory-policy").then_some(()) },
    )
    .await;
    assert!(
        warned.is_some(),
        "no warning about allkeys-lru\n{}",
        cg.output()
    );
}

/// A delayed delete still waiting when cacheguard shuts down is done at once, not dropped:
/// the key's generation is bumped by all three deletes before shutdown returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_runs_pending_delayed_deletes_at_once() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start_kv().await;
    let cg = kv_config(&origin, &redis, "10s").start().await;
    let client = HttpClient::new();
    assert_eq!(get_version(&client, cg.addr(), "/kv/bye").await, 0);
    // A base key's fill needs no generation (its lock fences it): the first delete
    // creates it (`INCR` from nothing).
    assert_eq!(
        redis.scan("cg:*:gen").await.len(),
        0,
        "a generation before any write"
    );
    let first = 0;
    let mut con = redis.client().await;
    assert_eq!(put(&client, cg.addr(), "/kv/bye").await.status, 200);
    let gens = redis.scan("cg:*:gen").await;
    assert_eq!(gens.len(), 1, "the write created the key's generation");
    let started = Instant::now();
    cg.shutdown().await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "shutdown waited for the 10 s delay"
    );
    assert_eq!(redis.scan("cg:*:gen").await, gens, "one written key");
    let generation: i64 = redis::cmd("GET")
        .arg(&gens[0])
        .query_async(&mut con)
        .await
        .expect("GET gen");
    assert_eq!(
        generation - first,
        3,
        "before, after, and the delayed delete at shutdown"
    );
}

// === what a write's answer names ===

/// A create's `Location` names a path whose 404 is cached (negative caching), and an update's
/// `Content-Location` names a cached entry: both are invalidated by the write (RFC 9111
/// §4.4), in embedded mode and in shared mode with every `l1` policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_writes_answer_names_is_invalidated() {
    let redis = RedisServer::start().await;
    let mut wrong = Vec::new();
    for mode in ["embedded", "off", "hot", "all"] {
        let origin = TestOrigin::start().await;
        let routes = format!(
            "{}{}{}",
            route("item", "/api/items/{id}", "GET", ""),
            route("create", "/api/items", "POST", ""),
            route("update", "/api/edit/{id}", "PUT", ""),
        );
        let mut cfg = CgConfig::new(&origin).routes(&routes);
        if mode != "embedded" {
            cfg = cfg
                .redis(&redis)
                .l1(mode)
                .set_str("redis", "key_prefix", &format!("{mode}:"));
        }
        let cg = cfg.start().await;
        let client = HttpClient::new();
        let (created, edited) = ("/api/items/created", "/api/items/edited");
        origin.set_status(created, 404);
        for _ in 0..2 {
            client.get(&url(cg.addr(), created)).await;
            client.get(&url(cg.addr(), edited)).await;
        }
        let cached = client.get(&url(cg.addr(), created)).await;
        assert_eq!(
            (cached.status.as_u16(), cached.x_cache().as_str()),
            (404, "NEGATIVE"),
            "{mode}: the 404 is cached: {cached}"
        );
        origin.set_status(created, 200);
        origin.set_status("/api/items", 201);
        origin.set_headers("/api/items", [("Location", created)]);
        let answer = post(&client, &url(cg.addr(), "/api/items"), &[], "{}").await;
        assert_eq!(answer.status, 201, "{mode}: {answer}");
        origin.set_headers("/api/edit/1", [("Content-Location", edited)]);
        let answer = client
            .request(
                http::Method::PUT,
                &url(cg.addr(), "/api/edit/1"),
                &[],
                common::client::full_body("{}"),
            )
            .await
            .unwrap_or_else(|e| panic!("{mode}: PUT: {e}"));
        assert_eq!(answer.status, 200, "{mode}: {answer}");
        let after = client.get(&url(cg.addr(), created)).await;
        if after.status != 200 {
            wrong.push(format!("{mode}: the created path still answers {after}"));
        }
        let after = client.get(&url(cg.addr(), edited)).await;
        if after.is_hit() {
            wrong.push(format!("{mode}: the edited path is still cached: {after}"));
        }
        cg.shutdown().await;
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

// === a full journal disk ===

/// A small tmpfs, mounted for one test and unmounted when dropped.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// Needs root (the machine the suite runs on); says so if mounting is refused.
    fn mount(size: &str) -> SmallDisk {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "mounting a tmpfs failed ({status}): this test needs root to make a small disk"
        );
        SmallDisk { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes a filler file until the disk is full.
    fn fill(&self) {
        use std::io::Write;
        let mut file = std::fs::File::create(self.path().join("filler")).expect("filler");
        let chunk = vec![0u8; 4096];
        while file.write_all(&chunk).is_ok() && file.flush().is_ok() {}
        let _ = file.sync_all();
    }

    fn free(&self) {
        std::fs::remove_file(self.path().join("filler")).expect("remove filler");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
    }
}

/// The journal's disk is full and Redis unreachable: 20 writes are forwarded, and none of
/// their invalidations is lost. They are held in memory (`/readyz` and
/// `cacheguard_journal_failing` say the journal is failing), and once Redis and the disk
/// are back every key reads the new version from Redis, not the old entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_journal_disk_loses_no_invalidation() {
    let disk = SmallDisk::mount("256k");
    let redis = RedisServer::start().await;
    let link = TcpProxy::start(redis.addr()).await;
    let origin = TestOrigin::start_kv().await;
    let cg = kv_config(&origin, &redis, "0s")
        .set_str("redis", "url", &link.redis_url())
        .set_str(
            "journal",
            "path",
            &disk.path().join("j.journal").display().to_string(),
        )
        .start()
        .await;
    let client = HttpClient::new();
    let path = |i: usize| format!("/kv/full-{i}");
    for i in 0..20 {
        assert_eq!(get_version(&client, cg.addr(), &path(i)).await, 0);
    }
    disk.fill();
    link.cut();
    let down = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let up = metric(&client, cg.admin_addr(), "cacheguard_redis_up", &[]).await;
            (up == 0.0).then_some(())
        },
    )
    .await;
    assert!(down.is_some(), "Redis still seen up");
    for i in 0..20 {
        let r = put(&client, cg.addr(), &path(i)).await;
        assert_eq!(r.status, 200, "{r}");
    }
    let lost = metric(
        &client,
        cg.admin_addr(),
        "cacheguard_invalidations_total",
        &[("result", "lost")],
    )
    .await;
    assert_eq!(lost, 0.0, "invalidations lost on a full journal disk");
    let failing = metric(&client, cg.admin_addr(), "cacheguard_journal_failing", &[]).await;
    assert_eq!(failing, 1.0);
    let ready = client.get(&url(cg.admin_addr(), "/readyz")).await;
    assert!(
        String::from_utf8_lossy(&ready.body).contains("journal"),
        "/readyz is silent about the journal: {ready}"
    );
    disk.free();
    link.restore();
    let drained = poll_until(
        Duration::from_secs(15),
        Duration::from_millis(50),
        || async {
            let held = metric(
                &client,
                cg.admin_addr(),
                "cacheguard_invalidations_held",
                &[],
            )
            .await;
            let depth = metric(&client, cg.admin_addr(), "cacheguard_journal_depth", &[]).await;
            (held == 0.0 && depth == 0.0).then_some(())
        },
    )
    .await;
    assert!(drained.is_some(), "owed invalidations never drained");
    for i in 0..20 {
        assert_eq!(
            get_version(&client, cg.addr(), &path(i)).await,
            1,
            "{} still stale after Redis and the disk came back",
            path(i)
        );
    }
    cg.shutdown().await;
}
