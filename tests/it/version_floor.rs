//! The version floor, against the shop's seats: writes answer the row's new version
//! (`x-row-version`), and reads come from a replica that lags behind the writes. A write
//! route with `version` floors its keys at its answer's version, so no read goes back
//! behind a write its client saw complete, and the first fill that has the write is cached
//! at once — in embedded, standalone and cluster modes (and Sentinel for the latter), with
//! the route's `l1` off, hot or all. Reads and writes go round-robin over three instances
//! (one in embedded mode), and the history checker (`check_version_floor`) judges them.
//!
//! Through faults ([`floor_through`]): Redis killed and restarted empty, the event bus's
//! connections killed while Redis stays up, and (measured only) a Sentinel failover to a
//! lagging replica. No read that began after a completed write may return an older
//! version, except behind a write in flight while its instance could not reach Redis, or
//! on an instance that could not (README's stated limit), which are counted apart.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;

use crate::common;
use crate::common::history::{Epoch, check_version_floor};
use crate::common::jepsen::{self, RunConfig};
use crate::common::shop::{Scope, Shop, VersionAnswer, read_request, seat, write_request};
use crate::common::{
    CgConfig, HttpClient, RedisCluster, RedisSentinel, RedisServer, Resp, TestOrigin, metric,
    metrics, route, url,
};

/// How a test runs cacheguard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Embedded,
    Standalone,
    Sentinel,
    /// Sentinel whose replica can be made to lag (for a failover that loses writes).
    SentinelLagging,
    Cluster,
}

/// The seat read route (`l1` as given) and its write route, both reading `x-row-version`;
/// `write` adds TOML lines to the write route.
fn seat_routes(l1: &str, write: &str) -> String {
    route(
        "seat",
        "/trains/{train}/seats/{seat}",
        "GET",
        &format!("version = {{ header = \"x-row-version\" }}\nl1 = \"{l1}\""),
    ) + &route(
        "seat-update",
        "/trains/{train}/seats/{seat}",
        "PUT",
        &format!(
            "invalidate = [\"/trains/{{train}}/seats/{{seat}}\"]\n\
             version = {{ header = \"x-row-version\" }}\nversion_floor_ttl = \"10s\"\n{write}"
        ),
    )
}

/// A shop, the Redis of `mode`, and `n` coordinated instances (one in embedded mode).
struct Setup {
    mode: Mode,
    shop: Shop,
    instances: Vec<cacheguard::Running>,
    redis: Option<RedisServer>,
    sentinel: Option<RedisSentinel>,
    cluster: Option<RedisCluster>,
}

impl Setup {
    async fn start(
        mode: Mode,
        n: usize,
        routes: &str,
        tweak: impl Fn(CgConfig) -> CgConfig,
    ) -> Setup {
        let shop = Shop::start(Epoch::now(), &[]).await;
        let (mut redis, mut sentinel, mut cluster) = (None, None, None);
        match mode {
            Mode::Embedded => {}
            Mode::Standalone => redis = Some(RedisServer::start().await),
            Mode::Sentinel => sentinel = Some(RedisSentinel::start().await),
            Mode::SentinelLagging => sentinel = Some(RedisSentinel::start_lagging().await),
            Mode::Cluster => cluster = Some(RedisCluster::start().await),
        }
        let mut cfg = tweak(
            CgConfig::with_upstream(&shop.url())
                .set("upstream", "timeout", "\"2s\"")
                .set("lock", "wait_timeout", "\"2s\"")
                .routes(routes),
        );
        if let Some(redis) = &redis {
            cfg = cfg.redis(redis);
        }
        if let Some(sentinel) = &sentinel {
            cfg = cfg.redis_sentinel(sentinel);
        }
        if let Some(cluster) = &cluster {
            cfg = cfg.redis_cluster(cluster);
        }
        let client = HttpClient::new();
        let instances = match mode {
            Mode::Embedded => vec![cfg.start().await],
            _ => {
                let mut started = Vec::new();
                for _ in 0..n {
                    started.push(cfg.start().await);
                }
                let admins: Vec<SocketAddr> = started.iter().map(|r| r.admin_addr()).collect();
                common::fleet::wait_coordinated(&client, &admins).await;
                started
            }
        };
        Setup {
            mode,
            shop,
            instances,
            redis,
            sentinel,
            cluster,
        }
    }

    /// One instance of `mode` with the seat routes (`l1`), behind a replica `lag` behind.
    async fn one(mode: Mode, l1: &str, lag: Duration) -> Setup {
        let setup = Setup::start(mode, 1, &seat_routes(l1, ""), |c| c).await;
        setup.shop.set_replica_lag(lag);
        setup
    }

    fn addrs(&self) -> Vec<SocketAddr> {
        self.instances.iter().map(|i| i.addr()).collect()
    }

    /// `name{labels}` summed over the instances.
    async fn metric(&self, client: &HttpClient, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut sum = 0.0;
        for instance in &self.instances {
            sum += metric(client, instance.admin_addr(), name, labels).await;
        }
        sum
    }

    async fn shutdown(self) {
        for instance in self.instances {
            instance.shutdown().await;
        }
    }
}

async fn get(client: &HttpClient, addr: SocketAddr, path: &str) -> Resp {
    client.get(&url(addr, path)).await
}

async fn put(client: &HttpClient, addr: SocketAddr, path: &str) -> Resp {
    client
        .request(
            http::Method::PUT,
            &url(addr, path),
            &[("content-type", "application/json")],
            common::client::full_body("{}".to_owned()),
        )
        .await
        .unwrap_or_else(|e| panic!("PUT {path}: {e}"))
}

/// The version an answer carries.
fn version(resp: &Resp) -> u64 {
    resp.header("x-row-version")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no version: {resp}"))
}

/// (a) With a replica 500 ms behind, clients write and then read, round-robin over the
/// instances, many times and concurrently: no read returns an older version than the
/// client's own last completed write. The replica's lag shows (older answers refused and
/// counted), and caching still works (hits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_read_goes_back_behind_a_completed_write() {
    for (mode, l1) in [
        (Mode::Embedded, "hot"),
        (Mode::Embedded, "off"),
        (Mode::Standalone, "off"),
        (Mode::Standalone, "all"),
        (Mode::Cluster, "hot"),
    ] {
        let setup = Setup::start(mode, 3, &seat_routes(l1, ""), |c| c).await;
        setup.shop.set_replica_lag(Duration::from_millis(500));
        let cfg = RunConfig {
            clients: 8,
            duration: Duration::from_secs(3),
            tail: Duration::ZERO,
            max_ops: 400,
            pace: Duration::from_millis(5),
            request_timeout: Duration::from_secs(5),
            keep_headers: vec!["x-row-version", "x-cache"],
            ..RunConfig::default()
        };
        // Two clients per seat; each writes, then reads three times, each on the next
        // instance.
        let history = jepsen::run(
            &cfg,
            setup.shop.epoch(),
            &setup.addrs(),
            |p, k| {
                let resource = seat("t1", &format!("s{}", p % 4));
                if k % 4 == 0 {
                    write_request(&resource, "{}")
                } else {
                    read_request(&resource)
                }
            },
            jepsen::no_faults,
        )
        .await;
        let report = check_version_floor(&history, "write", "read", "x-row-version");
        let what = format!("{mode:?}, l1 = {l1}");
        assert!(report.ok(), "{what}: {report}\n{}", history.summary());
        assert!(
            report.writes >= 16 && report.reads >= 3 * 16,
            "{what}: too little was done to judge: {report}\n{}",
            history.summary()
        );
        eprintln!("{what}: {report}");
        let client = HttpClient::new();
        let refused = setup
            .metric(
                &client,
                "cacheguard_fill_refused_total",
                &[("reason", "older_version")],
            )
            .await;
        assert!(
            refused > 0.0,
            "{what}: the replica's older answers were refused and counted"
        );
        let hits = history
            .ops_of("read")
            .filter(|op| {
                op.header_value("x-cache")
                    .is_some_and(|c| c.starts_with("HIT"))
            })
            .count();
        if l1 != "off" || mode != Mode::Embedded {
            assert!(hits > 0, "{what}: reads are still cached");
        }
        setup.shutdown().await;
    }
}

/// (b) A written key is cached again from the first fill that carries the write's version:
/// the read after it is a hit, within 50 ms (before, a write's keys were not stored for
/// `double_delete_delay`, 1 s by default). (c) The replica's older answers before it were
/// refused, counted, and fetched again; the client never saw one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_written_key_is_cached_again_from_the_first_fill_that_has_the_write() {
    for (mode, l1) in [
        (Mode::Embedded, "hot"),
        (Mode::Standalone, "off"),
        (Mode::Standalone, "all"),
        (Mode::Sentinel, "hot"),
        (Mode::Cluster, "hot"),
    ] {
        let what = format!("{mode:?}, l1 = {l1}");
        let lag = Duration::from_millis(150);
        let setup = Setup::one(mode, l1, lag).await;
        let client = HttpClient::new();
        let addr = setup.addrs()[0];
        let path = seat("t2", "7");
        // Cached before the write.
        assert_eq!(get(&client, addr, &path).await.x_cache(), "MISS");
        let before = get(&client, addr, &path).await;
        assert!(before.x_cache().starts_with("HIT"), "{what}: {before}");
        let refused_before = setup
            .metric(
                &client,
                "cacheguard_fill_refused_total",
                &[("reason", "older_version")],
            )
            .await;

        let written = put(&client, addr, &path).await;
        assert_eq!(written.status, 200, "{what}: {written}");
        let v = version(&written);
        let reads_before = setup.shop.reads(&path);
        // Read as fast as one client can until a hit, for 3 s at most.
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut answers = Vec::new();
        let mut fill: Option<Instant> = None;
        let mut hit: Option<Instant> = None;
        let started = Instant::now();
        while Instant::now() < deadline {
            let resp = get(&client, addr, &path).await;
            let at = Instant::now();
            assert_eq!(resp.status, 200, "{what}: {resp}");
            assert!(
                version(&resp) >= v,
                "{what}: a read after the write saw version {} < {v}: {resp}",
                version(&resp)
            );
            let cache = resp.x_cache();
            if cache.starts_with("HIT") {
                hit = Some(at);
                answers.push(cache);
                break;
            }
            if fill.is_none() {
                fill = Some(at);
            }
            answers.push(cache);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let fill = fill.unwrap_or_else(|| panic!("{what}: no fill after the write: {answers:?}"));
        let hit = hit.unwrap_or_else(|| panic!("{what}: never cached again: {answers:?}"));
        assert_eq!(
            answers,
            ["MISS", answers.last().map_or("", String::as_str)],
            "{what}: one fill (MISS), then hits"
        );
        assert!(
            hit - fill < Duration::from_millis(50),
            "{what}: cached {:?} after the first fill with the write",
            hit - fill
        );
        // The fill waited for the replica, asking it again meanwhile.
        assert!(
            fill - started >= lag - Duration::from_millis(20),
            "{what}: answered after {:?}, before the replica had the write",
            fill - started
        );
        assert!(
            setup.shop.reads(&path) - reads_before >= 2,
            "{what}: asked again"
        );
        let refused = setup
            .metric(
                &client,
                "cacheguard_fill_refused_total",
                &[("reason", "older_version")],
            )
            .await;
        assert!(refused > refused_before, "{what}: older answers counted");
        setup.shutdown().await;
    }
}

/// (d) An answer whose version does not parse (or is missing) is counted and never
/// trusted: over a floor it is neither stored nor served (the read is answered 503 with
/// Retry-After once `upstream.timeout` is spent), and once the replica answers a version
/// again the first fill with the write is stored at once. Without a floor it is stored (it
/// has nothing to prove), but raises none. A write whose answer has no usable version sets
/// no floor: its keys fall back to the quarantine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unparsable_version_is_counted_and_never_stored_over_a_floor() {
    for mode in [Mode::Embedded, Mode::Standalone] {
        let what = format!("{mode:?}");
        let setup = Setup::start(
            mode,
            1,
            &seat_routes("hot", "double_delete_delay = \"400ms\""),
            |c| {
                c.set("upstream", "timeout", "\"600ms\"")
                    .set("lock", "wait_timeout", "\"600ms\"")
            },
        )
        .await;
        let client = HttpClient::new();
        let addr = setup.addrs()[0];
        let unparsed = |route: &'static str| {
            let client = client.clone();
            let admin = setup.instances[0].admin_addr();
            async move {
                metric(
                    &client,
                    admin,
                    "cacheguard_version_unparsed_total",
                    &[("route", route)],
                )
                .await
            }
        };

        // Over a floor: refused until the budget is spent, then 503.
        let path = seat("t3", "1");
        setup
            .shop
            .set_version_answer(Scope::Reads, VersionAnswer::Garbled);
        let v = version(&put(&client, addr, &path).await);
        let started = Instant::now();
        let refused = get(&client, addr, &path).await;
        assert_eq!(refused.status, 503, "{what}: {refused}");
        assert!(refused.header("retry-after").is_some(), "{what}: {refused}");
        assert!(
            started.elapsed() >= Duration::from_millis(500),
            "{what}: fetched again for the budget, not refused at once"
        );
        assert!(unparsed("seat").await >= 2.0, "{what}: counted");
        setup
            .shop
            .set_version_answer(Scope::Reads, VersionAnswer::Missing);
        assert_eq!(
            get(&client, addr, &path).await.status,
            503,
            "{what}: none at all"
        );
        // The replica answers versions again: the first fill is stored, at once.
        setup
            .shop
            .set_version_answer(Scope::Reads, VersionAnswer::Exact);
        let filled = get(&client, addr, &path).await;
        assert_eq!(
            (filled.status.as_u16(), filled.x_cache().as_str()),
            (200, "MISS"),
            "{what}"
        );
        assert_eq!(version(&filled), v);
        let again = get(&client, addr, &path).await;
        assert!(again.x_cache().starts_with("HIT"), "{what}: {again}");

        // No floor (never written): stored, as it proves nothing and needs to prove nothing.
        let fresh = seat("t3", "2");
        setup
            .shop
            .set_version_answer(Scope::Reads, VersionAnswer::Garbled);
        assert_eq!(get(&client, addr, &fresh).await.x_cache(), "MISS");
        let cached = get(&client, addr, &fresh).await;
        assert!(cached.x_cache().starts_with("HIT"), "{what}: {cached}");
        setup
            .shop
            .set_version_answer(Scope::Reads, VersionAnswer::Exact);

        // A write answered without a usable version: counted, no floor, the quarantine.
        let quarantined = seat("t3", "3");
        assert_eq!(get(&client, addr, &quarantined).await.x_cache(), "MISS");
        setup
            .shop
            .set_version_answer(Scope::Writes, VersionAnswer::Garbled);
        let before = unparsed("seat-update").await;
        assert_eq!(put(&client, addr, &quarantined).await.status, 200);
        assert_eq!(unparsed("seat-update").await, before + 1.0, "{what}");
        for _ in 0..2 {
            let r = get(&client, addr, &quarantined).await;
            assert_eq!(r.x_cache(), "MISS", "{what}: quarantined, not stored: {r}");
        }
        setup.shutdown().await;
    }
}

/// A cold miss on a route with `version` costs the Redis commands of one without: the
/// floor is read in the lock's own round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floor_costs_a_cold_miss_no_redis_command() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    for id in ["warm", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"] {
        origin.set_headers(&format!("/v/{id}"), [("x-row-version", "1")]);
    }
    let routes = route("plain", "/p/{id}", "GET", "")
        + &route(
            "versioned",
            "/v/{id}",
            "GET",
            "version = { header = \"x-row-version\" }",
        );
    let cg = CgConfig::new(&origin)
        .redis(&redis)
        .routes(&routes)
        .start()
        .await;
    let client = HttpClient::new();
    let mut per_miss = Vec::new();
    for route in ["plain", "versioned"] {
        let prefix = if route == "plain" { "/p" } else { "/v" };
        // Scripts loaded, connections made.
        get(&client, cg.addr(), &format!("{prefix}/warm")).await;
        let commands = |exp: &common::prom::Exposition| {
            exp.sum(
                "cacheguard_request_redis_commands_total",
                &[("route", route), ("outcome", "miss")],
            )
        };
        let before = commands(&metrics(&client, cg.admin_addr()).await);
        for i in 0..10 {
            let r = get(&client, cg.addr(), &format!("{prefix}/{i}")).await;
            assert_eq!(r.x_cache(), "MISS", "{r}");
        }
        let after = commands(&metrics(&client, cg.admin_addr()).await);
        per_miss.push((after - before) / 10.0);
    }
    assert_eq!(per_miss[0], per_miss[1], "plain vs versioned: {per_miss:?}");
    cg.shutdown().await;
}

/// A read that arrives after a write was answered never gets the answer of a fetch that
/// began before the write: neither by joining that fetch (its flight) nor by waiting on
/// its lock. The fetch before is slow (300 ms) and its replica a second behind; the write
/// lands while it runs, and a read right after must see the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_after_a_write_never_joins_a_fetch_begun_before_it() {
    for (mode, l1) in [
        (Mode::Embedded, "hot"),
        (Mode::Standalone, "off"),
        (Mode::Standalone, "all"),
    ] {
        let what = format!("{mode:?}, l1 = {l1}");
        let setup = Setup::one(mode, l1, Duration::from_secs(1)).await;
        setup
            .shop
            .set_latency(Scope::Reads, Duration::from_millis(300));
        let client = HttpClient::new();
        let addr = setup.addrs()[0];
        let path = seat("t4", "1");
        let before = {
            let (client, path) = (client.clone(), path.clone());
            tokio::spawn(async move { get(&client, addr, &path).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let v = version(&put(&client, addr, &path).await);
        let after = get(&client, addr, &path).await;
        assert_eq!(after.status, 200, "{what}: {after}");
        assert!(
            version(&after) >= v,
            "{what}: a read after the write got {} < {v}: {after}",
            version(&after)
        );
        let before = before.await.expect("the read before");
        assert_eq!(before.status, 200, "{what}: {before}");
        setup.shutdown().await;
    }
}

/// A fault the nemesis injects a few times during a run of [`floor_through`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Every data node of the topology killed (SIGKILL) and started again, empty.
    RedisRestart,
    /// `CLIENT KILL TYPE pubsub` on every data node, and `SUBSCRIBE` refused there for
    /// [`BUS_OUT_FOR`]: the event bus's connections drop while Redis stays up.
    BusKilled,
    /// Sentinel fails over to a replica that lags: the writes it did not have are lost.
    LaggingFailover,
}

/// The nemesis's name of a fault during which Redis cannot be reached: writes in flight
/// then are the stated limit (their invalidation is journaled, not heard).
const REDIS_DOWN: &str = "redis down";

/// How long Redis stays killed, per topology: long enough that the event bus's
/// reconnection backoff (25 ms doubling up to 500 ms) has reached its longest, so an
/// instance may reach Redis again (its breaker probes every 200 ms) up to half a second
/// before its bus is back — the window judged. Sentinel's nodes are back within its
/// `down-after-milliseconds` (1 s), a cluster's within its node timeout (2 s): no failover.
fn down_for(mode: Mode) -> Duration {
    Duration::from_millis(match mode {
        Mode::Sentinel | Mode::SentinelLagging => 0,
        Mode::Cluster => 1_000,
        Mode::Embedded | Mode::Standalone => 1_300,
    })
}

impl Fault {
    /// When it is injected, from the run's start.
    fn rounds(self) -> Vec<Duration> {
        let ms = match self {
            Fault::RedisRestart => vec![1_000, 3_600, 6_200],
            Fault::BusKilled => vec![1_000, 2_000, 3_000, 4_000, 5_000],
            Fault::LaggingFailover => vec![1_000],
        };
        ms.into_iter().map(Duration::from_millis).collect()
    }
}

impl Setup {
    /// The ports of every Redis data node.
    fn data_ports(&self) -> Vec<u16> {
        let mut ports = Vec::new();
        if let Some(redis) = &self.redis {
            ports.push(redis.port());
        }
        if let Some(sentinel) = &self.sentinel {
            ports.extend(sentinel.data_ports());
        }
        if let Some(cluster) = &self.cluster {
            ports.extend(cluster.ports());
        }
        ports
    }

    /// Records that Redis cannot be reached from any instance from now on: `#i what`
    /// for instance `i`, healed by [`Setup::wait_redis_up`].
    fn redis_down(&self, nemesis: &jepsen::Nemesis, what: &str) {
        for i in 0..self.instances.len() {
            nemesis.start(&format!("#{i} {what}"));
        }
    }

    /// Waits (bounded) until each instance reports Redis up (its breaker closed), and
    /// records it as the heal of `#i what` for that instance — not that its event bus is
    /// back, which is what the runs are about.
    async fn wait_redis_up(&self, client: &HttpClient, nemesis: &jepsen::Nemesis, what: &str) {
        let waits = self.instances.iter().enumerate().map(|(i, instance)| {
            let admin = instance.admin_addr();
            async move {
                let up =
                    common::poll_until(Duration::from_secs(15), Duration::from_millis(5), || {
                        let client = client.clone();
                        async move {
                            (metric(&client, admin, "cacheguard_redis_up", &[]).await == 1.0)
                                .then_some(())
                        }
                    })
                    .await;
                assert!(
                    up.is_some(),
                    "instance {admin}: Redis not up again within 15 s"
                );
                nemesis.heal(&format!("#{i} {what}"));
            }
        });
        futures_util::future::join_all(waits).await;
    }

    /// Injects `fault` once, recording it.
    async fn inject(&mut self, fault: Fault, client: &HttpClient, nemesis: &jepsen::Nemesis) {
        match fault {
            Fault::RedisRestart => {
                let what = format!("{REDIS_DOWN}, killed and restarted empty");
                self.redis_down(nemesis, &what);
                if let Some(redis) = self.redis.as_mut() {
                    redis.kill();
                    tokio::time::sleep(down_for(self.mode)).await;
                    redis.restart().await;
                }
                if let Some(sentinel) = self.sentinel.as_mut() {
                    let primary = sentinel.primary_port().await;
                    sentinel.restart_data_empty().await;
                    self.wait_redis_up(client, nemesis, &what).await;
                    let sentinel = self.sentinel.as_ref().expect("the Sentinel set");
                    assert_eq!(
                        sentinel.primary_port().await,
                        primary,
                        "the sentinels failed over: a restart, not a failover, was meant"
                    );
                    return;
                }
                if let Some(cluster) = self.cluster.as_mut() {
                    // The primary the event bus subscribes on, with the keys it serves.
                    let home = cluster
                        .owner_of("cg:events")
                        .await
                        .expect("the channel's node");
                    cluster.kill(home);
                    tokio::time::sleep(down_for(self.mode)).await;
                    cluster.start_again(home).await;
                    let deadline = Instant::now() + Duration::from_secs(15);
                    while !cluster.info(home).await.contains("cluster_state:ok") {
                        assert!(Instant::now() < deadline, "node {home} never back");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                self.wait_redis_up(client, nemesis, &what).await;
            }
            Fault::BusKilled => {
                // Kept out for a while (SUBSCRIBE refused by an ACL), so the gap is as long
                // as after a Redis restart; every other command goes on.
                nemesis.start("bus connections killed");
                let ports = self.data_ports();
                for port in &ports {
                    acl(*port, "-subscribe").await;
                    let killed: Option<i64> = common::redis_server::query_port(
                        *port,
                        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("pubsub"),
                    )
                    .await;
                    assert!(killed.is_some(), "CLIENT KILL TYPE pubsub on {port}");
                }
                tokio::time::sleep(BUS_OUT_FOR).await;
                for port in &ports {
                    acl(*port, "+subscribe").await;
                }
                nemesis.heal("bus connections killed");
            }
            Fault::LaggingFailover => {
                let sentinel = self.sentinel.as_ref().expect("a Sentinel set");
                nemesis.start("failover to a lagging replica");
                sentinel.fail_over_to_lagging_replica(3).await;
                nemesis.heal("failover to a lagging replica");
            }
        }
    }
}

/// How long the event bus is kept out after its connections are killed.
const BUS_OUT_FOR: Duration = Duration::from_millis(400);

/// `ACL SETUSER default <rule>` on the node on `port`.
async fn acl(port: u16, rule: &str) {
    let set: Option<String> = common::redis_server::query_port(
        port,
        redis::cmd("ACL").arg("SETUSER").arg("default").arg(rule),
    )
    .await;
    assert!(set.is_some(), "ACL SETUSER default {rule} on {port}");
}

/// What a run through a fault found: every read behind a write completed before it
/// began, split into those behind a write in flight while Redis could not be reached
/// (`excused`, the stated limit) and the rest (`judged`).
struct Through {
    report: common::history::VersionFloorReport,
    judged: usize,
    excused: usize,
    summary: String,
}

/// Three instances with the seat routes (`l1 = "all"`, so every read may be an L1 hit),
/// a replica 300 ms behind, eight clients that write and read the seats round-robin, and
/// `fault` injected a few times; judged by `check_version_floor`.
async fn floor_through(mode: Mode, fault: Fault) -> Through {
    let mut setup = Setup::start(mode, 3, &seat_routes("all", ""), |c| c).await;
    setup.shop.set_replica_lag(Duration::from_millis(300));
    let cfg = RunConfig {
        clients: 8,
        duration: Duration::from_secs(if fault == Fault::RedisRestart { 9 } else { 6 }),
        tail: Duration::from_secs(1),
        max_ops: 2_000,
        pace: Duration::from_millis(5),
        request_timeout: Duration::from_secs(5),
        keep_headers: vec!["x-row-version", "x-cache"],
        ..RunConfig::default()
    };
    let (addrs, epoch) = (setup.addrs(), setup.shop.epoch());
    let client = HttpClient::new();
    let history = {
        let (setup, client) = (&mut setup, &client);
        jepsen::run(
            &cfg,
            epoch,
            &addrs,
            |p, k| {
                let resource = seat("t5", &format!("s{}", p % 4));
                if k % 4 == 0 {
                    write_request(&resource, "{}")
                } else {
                    read_request(&resource)
                }
            },
            |nemesis| async move {
                for at in fault.rounds() {
                    nemesis.at(at).await;
                    setup.inject(fault, client, &nemesis).await;
                }
            },
        )
        .await
    };
    let report = check_version_floor(&history, "write", "read", "x-row-version");
    // Per instance, when it could not reach Redis: a write it took then, or a read it
    // answered then, is within the stated limit.
    let down: Vec<_> = (0..addrs.len())
        .map(|i| history.fault_windows(&format!("#{i} {REDIS_DOWN}")))
        .collect();
    let (excused, judged) = report.behind_any_split(|stale| {
        let down_at =
            |op: &common::history::Op| op.call.target.is_some_and(|i| op.overlaps(&down[i]));
        down_at(&stale.write) || down_at(&stale.read)
    });
    let mut summary = format!("{} of them:\n", judged.len());
    for stale in judged.iter().take(10) {
        summary.push_str(&format!("    {stale}\n"));
    }
    summary.push_str(&format!("{report}\n{}", history.summary()));
    let (excused, judged) = (excused.len(), judged.len());
    setup.shutdown().await;
    Through {
        report,
        judged,
        excused,
        summary,
    }
}

/// Asserts that no read began after a write had completed and returned an older version,
/// beyond the stated limit (a write in flight while Redis was unreachable).
fn assert_floor_held(what: &str, through: &Through) {
    let report = &through.report;
    eprintln!(
        "{what}: {} reads behind a completed write ({} behind a write in flight while Redis \
         was unreachable), of {} reads after {} writes",
        through.judged, through.excused, report.reads, report.writes
    );
    assert_eq!(
        through.judged, 0,
        "{what}: stale reads that began after a completed write: {}",
        through.summary
    );
    assert!(report.unversioned.is_empty(), "{what}: {}", through.summary);
    assert!(
        report.writes >= 16 && report.reads >= 3 * 16,
        "{what}: too little was done to judge: {}",
        through.summary
    );
}

/// (a) Redis killed and restarted empty, twice: once every instance reaches Redis again,
/// no read returns an older version than a write completed before it began — though the
/// event bus comes back only later (its backoff), so the writes' `invalidate` events are
/// heard by no other instance. Meanwhile reads of the `version` route do not answer from
/// L1 copies they cannot prove current (`cache.l1_while_bus_down = "bypass"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floor_holds_right_after_redis_restarts() {
    let _heavy = common::heavy().await;
    for mode in [Mode::Standalone, Mode::Sentinel, Mode::Cluster] {
        let through = floor_through(mode, Fault::RedisRestart).await;
        assert_floor_held(&format!("{mode:?}, Redis restarted"), &through);
    }
}

/// (b) The event bus's connections killed (`CLIENT KILL TYPE pubsub`, then kept out for
/// 400 ms) five times while Redis stays up: no read returns an older version than a write
/// completed before it began, on any instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_floor_holds_while_the_bus_reconnects() {
    let _heavy = common::heavy().await;
    for mode in [Mode::Standalone, Mode::Sentinel, Mode::Cluster] {
        let through = floor_through(mode, Fault::BusKilled).await;
        assert_floor_held(&format!("{mode:?}, bus killed"), &through);
    }
}

/// On a cluster only the channel's primary has a `PUBLISH` before it answers; another
/// node has it later, over the cluster bus, so an instance subscribed there may read a
/// key after another instance's write returned and before that write's `invalidate`
/// arrives. While the primary refuses the subscription (it is taken on another node),
/// the `version` route answers from Redis (`HIT-L2`), not from L1; once the primary takes
/// it again, the bus moves there and L1 answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_on_another_cluster_node_than_the_channels_primary_is_not_trusted() {
    let setup = Setup::one(Mode::Cluster, "all", Duration::ZERO).await;
    let client = HttpClient::new();
    let addr = setup.addrs()[0];
    let path = "/trains/t1/seats/s1";
    let cluster = setup.cluster.as_ref().expect("a cluster");
    let home = cluster
        .owner_of("cg:events")
        .await
        .expect("the channel's node");
    let cache = |r: &Resp| r.header("x-cache").unwrap_or_default();
    get(&client, addr, path).await;
    assert_eq!(
        cache(&get(&client, addr, path).await),
        "HIT-L1",
        "warm, bus on the primary"
    );

    let subscriptions = setup
        .metric(&client, "cacheguard_event_bus_resubscriptions_total", &[])
        .await;
    acl(home, "-subscribe").await;
    let killed: Option<i64> = common::redis_server::query_port(
        home,
        redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("pubsub"),
    )
    .await;
    assert_eq!(killed, Some(1), "the bus was on the channel's primary");
    let moved = common::poll_until(Duration::from_secs(10), Duration::from_millis(10), || {
        let setup = &setup;
        let client = client.clone();
        async move {
            (setup
                .metric(&client, "cacheguard_event_bus_resubscriptions_total", &[])
                .await
                > subscriptions)
                .then_some(())
        }
    })
    .await;
    assert!(moved.is_some(), "the bus never subscribed on another node");
    // Several of the bus's looks for the primary (each refused) happen meanwhile.
    let until = Instant::now() + Duration::from_millis(600);
    let mut reads = 0;
    while Instant::now() < until {
        let resp = get(&client, addr, path).await;
        assert_eq!(
            cache(&resp),
            "HIT-L2",
            "read {reads} with the bus on another node than the channel's primary: {resp}"
        );
        reads += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    acl(home, "+subscribe").await;
    let back = common::poll_until(Duration::from_secs(5), Duration::from_millis(20), || {
        let client = client.clone();
        async move { (cache(&get(&client, addr, path).await) == "HIT-L1").then_some(()) }
    })
    .await;
    assert!(
        back.is_some(),
        "L1 never answered again after the channel's primary took the subscription"
    );
    setup.shutdown().await;
}

/// (c) Sentinel fails over to a replica that lags, losing what the primary took since
/// (generations, floors, deleted entries, even entries' deletions): measured, and stated
/// in README. What the instances heard before (each `invalidate` event's floor, kept
/// `version_floor_ttl`) still refuses older fills, but an L2 entry the lost write had
/// deleted comes back with the replica and is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_lagging_replica_is_measured() {
    let _heavy = common::heavy().await;
    let through = floor_through(Mode::SentinelLagging, Fault::LaggingFailover).await;
    let report = &through.report;
    eprintln!(
        "Sentinel, failover to a lagging replica: {} reads behind a completed write, {} \
         behind their own client's, of {} reads after {} writes",
        report.behind_any.len(),
        report.stale.len(),
        report.reads,
        report.writes
    );
    assert!(
        report.writes >= 16 && report.reads >= 3 * 16,
        "too little was done to judge: {}",
        through.summary
    );
}
