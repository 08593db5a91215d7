//! Each proxy worker sends a request's Redis commands on a connection of its own, driven on
//! that worker (`coord/worker_conn.rs`), in every Redis mode: with two workers, once each
//! has made its connection (in the background, on its first command), L2 misses and hits
//! send nothing through the Redis thread (`cacheguard_redis_commands_off_worker_total`
//! stays put), and the workers' connections move to a Sentinel's new primary and reconnect
//! after a standalone Redis restarts, instead of falling back to the shared connection for
//! good.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use crate::common::{
    self, AnyRedis, CgConfig, HttpClient, RedisCluster, RedisSentinel, RedisServer, TestOrigin,
    metric, url,
};

const OFF_WORKER: &str = "cacheguard_redis_commands_off_worker_total";

/// Two proxy workers, L1 off (every read goes to Redis).
fn two_workers(cfg: CgConfig) -> CgConfig {
    cfg.set("server", "worker_threads", "2").l1("off")
}

/// Clients of their own (one connection each): the accept loop deals connections to the
/// workers in turn, so each worker serves some of them.
fn clients() -> Vec<HttpClient> {
    (0..4).map(|_| HttpClient::new()).collect()
}

/// `n` fresh keys per client: each a miss, then an L2 hit (asserted).
async fn misses_then_hits(clients: &[HttpClient], addr: SocketAddr, tag: &str, n: usize) {
    for (c, client) in clients.iter().enumerate() {
        for i in 0..n {
            let path = format!("/api/items/{tag}-{c}-{i}");
            let first = client.get(&url(addr, &path)).await;
            assert_eq!(
                (first.status.as_u16(), first.x_cache().as_str()),
                (200, "MISS"),
                "{path}: {first}"
            );
            let second = client.get(&url(addr, &path)).await;
            assert_eq!(
                (second.status.as_u16(), second.x_cache().as_str()),
                (200, "HIT-L2"),
                "{path}: {second}"
            );
        }
    }
}

/// The off-worker commands so far, every op and reason summed, and the series that are not
/// 0 (`op/reason=n`); panics when the family is not exported at all (a renamed metric
/// would pass as 0).
async fn off_worker(client: &HttpClient, admin: SocketAddr) -> (f64, Vec<String>) {
    let exp = common::metrics(client, admin).await;
    assert!(exp.has_family(OFF_WORKER), "{OFF_WORKER} is not exported");
    let nonzero = exp
        .samples_named(OFF_WORKER)
        .filter(|s| s.value > 0.0)
        .map(|s| {
            let label = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
            format!("{}/{}={}", label("op"), label("reason"), s.value)
        })
        .collect();
    (exp.sum(OFF_WORKER, &[]), nonzero)
}

/// Rounds of one miss and hit per client until a round sends nothing through the Redis
/// thread: a worker makes its connection in the background, on its first command (which
/// goes on the shared connection meanwhile), and again after losing it. Panics when that
/// does not happen within `timeout` (the workers keep falling back).
async fn until_on_worker_connections(
    clients: &[HttpClient],
    cg: &cacheguard::Running,
    tag: &str,
    timeout: Duration,
) {
    let admin = cg.admin_addr();
    let started = tokio::time::Instant::now();
    let mut round = 0;
    loop {
        let (before, _) = off_worker(&clients[0], admin).await;
        misses_then_hits(clients, cg.addr(), &format!("{tag}-warm-{round}"), 1).await;
        let (after, series) = off_worker(&clients[0], admin).await;
        if after == before {
            return;
        }
        assert!(
            started.elapsed() < timeout,
            "{tag}: the workers still send through the Redis thread after {timeout:?}: \
             {series:?}"
        );
        round += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Once each worker has its connection, misses and L2 hits (L1 off) send nothing through
/// the Redis thread.
pub async fn nothing_off_worker(cg: &cacheguard::Running, mode: &str) {
    let clients = clients();
    until_on_worker_connections(&clients, cg, mode, Duration::from_secs(10)).await;
    let (before, _) = off_worker(&clients[0], cg.admin_addr()).await;
    misses_then_hits(&clients, cg.addr(), mode, 5).await;
    let (after, series) = off_worker(&clients[0], cg.admin_addr()).await;
    assert_eq!(
        after - before,
        0.0,
        "{mode}: misses and L2 hits sent commands through the Redis thread: {series:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_misses_and_hits_stay_on_their_worker() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = two_workers(CgConfig::new(&origin).redis(&redis))
        .start()
        .await;
    nothing_off_worker(&cg, "standalone").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_misses_and_hits_stay_on_their_worker() {
    let sentinel = RedisSentinel::start().await;
    let origin = TestOrigin::start().await;
    let cg = two_workers(CgConfig::new(&origin).redis_sentinel(&sentinel))
        .start()
        .await;
    nothing_off_worker(&cg, "sentinel").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_misses_and_hits_stay_on_their_worker() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let cg = two_workers(CgConfig::new(&origin).redis_cluster(&cluster))
        .start()
        .await;
    nothing_off_worker(&cg, "cluster").await;
}

/// Polls with fresh keys (each client in turn, so every worker is asked) until a miss and
/// its L2 hit come back on every client; how long that took, `None` after `timeout`.
async fn l2_hits_again_within(
    clients: &[HttpClient],
    addr: SocketAddr,
    tag: &str,
    timeout: Duration,
) -> Option<Duration> {
    let started = tokio::time::Instant::now();
    let mut round = 0;
    while started.elapsed() < timeout && round < 1000 {
        round += 1;
        let mut all = true;
        for (c, client) in clients.iter().enumerate() {
            let path = format!("/api/items/{tag}-poll-{round}-{c}");
            let first = client.get(&url(addr, &path)).await;
            assert_eq!(first.status, 200, "{path}: {first}");
            let second = client.get(&url(addr, &path)).await;
            assert_eq!(second.status, 200, "{path}: {second}");
            all &= second.x_cache() == "HIT-L2";
        }
        if all {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

/// After the change (a failover, a restart) has settled: more misses and hits, none of
/// them sent through the Redis thread (the workers use connections of their own again).
async fn settled_on_worker_connections(
    clients: &[HttpClient],
    cg: &cacheguard::Running,
    tag: &str,
) {
    until_on_worker_connections(clients, cg, tag, Duration::from_secs(10)).await;
    let admin = cg.admin_addr();
    let (before, _) = off_worker(&clients[0], admin).await;
    misses_then_hits(clients, cg.addr(), tag, 5).await;
    let (after, series) = off_worker(&clients[0], admin).await;
    assert_eq!(
        after - before,
        0.0,
        "{tag}: the workers still fall back to the shared connection: {series:?}"
    );
}

/// A Sentinel failover: the workers' connections move to the new primary (a new shared
/// connection makes them again), and L2 hits come back within a bound, on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_connections_follow_a_sentinel_failover() {
    // Wall-clock bounds: not beside another heavy test.
    let _heavy = common::heavy().await;
    let sentinel = RedisSentinel::start().await;
    let origin = TestOrigin::start().await;
    let cg = two_workers(CgConfig::new(&origin).redis_sentinel(&sentinel))
        .start()
        .await;
    let clients = clients();
    misses_then_hits(&clients, cg.addr(), "before", 2).await;
    let old_primary = sentinel.primary_port().await.unwrap();
    let new_primary = sentinel.switch_over(Duration::from_secs(30)).await;
    assert_ne!(new_primary, old_primary);
    let admin = cg.admin_addr();
    let followed =
        crate::sentinel::wait_following(&clients[0], admin, new_primary, Duration::from_secs(10))
            .await;
    assert!(followed.is_some(), "cacheguard did not follow the failover");
    let took = l2_hits_again_within(&clients, cg.addr(), "failover", Duration::from_secs(10)).await;
    assert!(took.is_some(), "no L2 hits within 10 s of the failover");
    let retries = metric(
        &clients[0],
        admin,
        "cacheguard_redis_readonly_retries_total",
        &[],
    )
    .await;
    settled_on_worker_connections(&clients, &cg, "after-failover").await;
    assert_eq!(
        metric(
            &clients[0],
            admin,
            "cacheguard_redis_readonly_retries_total",
            &[]
        )
        .await,
        retries,
        "a worker's connection stayed on the demoted primary"
    );
}

/// A standalone Redis restarted: each worker's connection, gone with it, is made again,
/// and L2 hits come back within a bound, on the workers' own connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_connections_reconnect_after_a_redis_restart() {
    // Wall-clock bounds: not beside another heavy test.
    let _heavy = common::heavy().await;
    let mut redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = two_workers(CgConfig::new(&origin).redis(&redis))
        .start()
        .await;
    let clients = clients();
    misses_then_hits(&clients, cg.addr(), "before", 2).await;
    redis.restart().await;
    let took = l2_hits_again_within(&clients, cg.addr(), "restart", Duration::from_secs(5)).await;
    assert!(took.is_some(), "no L2 hits within 5 s of Redis restarting");
    settled_on_worker_connections(&clients, &cg, "after-restart").await;
}

/// The connections each Redis data node holds for cacheguard, from `CLIENT LIST` (every
/// client but the sentinels', the replication links and the asking connection itself).
async fn clients_per_node(ports: &[u16]) -> Vec<(u16, usize, String)> {
    let mut counts = Vec::new();
    for port in ports {
        let list: Option<String> =
            common::redis_server::query_port(*port, redis::cmd("CLIENT").arg("LIST")).await;
        let list = list.unwrap_or_else(|| panic!("CLIENT LIST on {port}"));
        let ours: Vec<&str> = list
            .lines()
            .filter(|c| {
                !c.contains(" name=sentinel-")
                    && !c.contains(" cmd=client|list ")
                    && !c.contains(" flags=S ")
                    && !c.contains(" flags=M ")
            })
            .collect();
        let kinds = ours
            .iter()
            .map(|c| {
                c.split_whitespace()
                    .find_map(|f| f.strip_prefix("cmd="))
                    .unwrap_or("?")
            })
            .collect::<Vec<_>>()
            .join(",");
        counts.push((*port, ours.len(), kinds));
    }
    counts
}

/// What one instance costs each Redis node in connections, with `workers` proxy workers:
/// one per worker (its own), plus the shared connection, the heartbeat and the event bus —
/// on a cluster, each worker's cluster connection reaches every primary. In a fleet of a
/// hundred instances these add up on one Redis: README states the figure this test holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_holds_a_bounded_number_of_connections_per_redis_node() {
    for mode in AnyRedis::MODES {
        let origin = TestOrigin::start().await;
        let redis = AnyRedis::start(mode).await;
        let cfg = two_workers(CgConfig::new(&origin)).any_redis(&redis);
        let ports = redis.data_ports();
        let before = clients_per_node(&ports).await;
        let cg = cfg.start().await;
        let clients = clients();
        until_on_worker_connections(&clients, &cg, mode, Duration::from_secs(10)).await;
        let after = clients_per_node(&ports).await;
        eprintln!("{mode}: before {before:?}\n{mode}: after {after:?}");
        assert!(
            before.iter().all(|(_, n, _)| *n == 0),
            "{mode}: clients before cacheguard: {before:?}"
        );
        const WORKERS: usize = 2;
        let primary_ports = redis.primary_ports().await;
        let (primaries, replicas): (Vec<_>, Vec<_>) = after
            .iter()
            .partition(|(port, _, _)| primary_ports.contains(port));
        let primaries: Vec<usize> = primaries.iter().map(|(_, n, _)| *n).collect();
        let replicas: Vec<usize> = replicas.iter().map(|(_, n, _)| *n).collect();
        let expected_primaries = if mode == "cluster" { 3 } else { 1 };
        // Each primary: each worker's own connection (on a cluster, its cluster
        // connection's link to that primary), the shared one, the heartbeat; on one node
        // each, the event bus and the invalidation stream's reader. A replica: none, or on
        // a cluster the links its cluster clients (each worker's, the shared one, the
        // heartbeat's) keep from the slot map's discovery: at most one each.
        assert_eq!(primaries.len(), expected_primaries, "{mode}: {after:?}");
        assert!(
            primaries
                .iter()
                .all(|n| (WORKERS + 2..=WORKERS + 4).contains(n)),
            "{mode}: {after:?}"
        );
        assert!(
            replicas.iter().all(|n| *n <= WORKERS + 2),
            "{mode}: {after:?}"
        );
        cg.shutdown().await;
    }
}
