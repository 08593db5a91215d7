//! Serialized writes under faults, Jepsen-style: three cacheguard processes in front of the
//! shop's seat writes (`common::shop`: every write logged with its interval at the origin
//! and its fencing token; in fencing mode a token below the highest accepted is refused),
//! six clients writing two seats, each through instances 1 and 2 in turn (`common::jepsen`), one
//! nemesis per test, and the checkers of `common::history` on the shop's write log:
//!
//! - **exclusion**: no two writes to one seat overlap at the origin. 0 without faults and
//!   under every fault that must not take the lock from its holder; under one that does, the
//!   overlaps are reported, and a fencing origin keeps them harmless (below);
//! - **fencing**: in the origin's commit order the tokens of accepted writes never decrease,
//!   and a write is refused exactly when its token is below one accepted before: across a
//!   Redis restart without persistence and a failover to a lagging replica too.
//!
//! How a stale write is provoked (the paused-holder diagram of the fencing-token argument):
//! instance 0, the *victim*, reaches the origin through a fault proxy of its own. The
//! nemesis holds that link, sends one write through the victim and waits until it is
//! granted: the victim holds the seat's lock and its write is on its way, as if the pause
//! had struck right after the grant. Then the fault takes the lock from it (the victim
//! SIGSTOPped for 2 × lease or `kill -9`ed; Redis `kill -9`ed and restarted empty; a
//! failover to a replica that never got the lock; Redis blackholed past the lease), another
//! instance is granted the seat with a newer token and the origin accepts its write; only
//! then, while another write is at the origin, is the held write let through. A fencing
//! origin refuses it (`stale_refused` ≥ 1, no token decrease). The `*_bites` tests run the
//! same nemesis against an origin that does not check: it accepts the stale write, out of
//! token order and overlapping another: the nemesis bites, and only the origin's check
//! stops it.
//!
//! The faults that must not take the lock (an origin slower than the lease: the watchdog
//! renews; Redis slowed; Redis blackholed for less than the lease; two instances' wall
//! clocks an hour off) must leave exclusion at 0 and the origin refusing nothing.
//!
//! Topologies: every nemesis but two runs in standalone, Sentinel and Cluster. Redis is
//! blackholed through its proxy in standalone; in Sentinel and Cluster, whose nodes the
//! instances reach directly, the lock's primary is SIGSTOPped instead (open sockets, no
//! answers). "Restarted empty" is the standalone server; in Sentinel both data nodes; in
//! Cluster the lock's primary and its replica (back before a failover could start). Redis
//! slowed and a blackhole shorter than the lease need the proxy (standalone only); the
//! failover to a lagging replica is Sentinel's.
//!
//! Short runs (a 1 s lease, about six seconds of load each): longer ones belong in bench/.

mod common;

use std::time::Duration;

use common::fleet::{Fleet, wait_coordinated};
use common::jepsen::{Backend, Nemesis, RunConfig, Topology};
use common::serialized::{
    self, Answers, FAULT_AT, Fixtures, LEASE, SHOP_WRITE, Verdict, WAIT_TIMEOUT, seats,
};
use common::shop::Scope;
use common::{CgConfig, HttpClient, RedisServer, TcpProxy, url};

/// An origin slower than the lease.
const SLOW_WRITE: Duration = Duration::from_millis(2500);
/// The first seat's writes at the origin while the held write is delivered: long enough
/// that it meets another holder's write there however the machine schedules them.
const DELIVERY_WRITE: Duration = Duration::from_millis(400);
/// How long the first seat's writes stay that slow once the held write was let through.
const DELIVERY_WINDOW: Duration = Duration::from_millis(1500);
/// Room for a loaded machine's scheduling in the clients' liveness bounds (a process
/// here may wait seconds for a CPU): bench/serialize.sh measures the tight bounds; the
/// checkers take no slack.
const LOAD_SLACK: Duration = Duration::from_secs(8);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    None,
    /// The holder SIGSTOPped for 2 × lease, its write on the way.
    PauseHolder,
    /// The holder `kill -9`ed, its write on the way.
    KillHolder,
    /// Redis `kill -9`ed and restarted empty while a write holds the lock.
    KillRedis,
    /// A write granted on the primary only, then a failover to the lagging replica.
    LaggingFailover,
    /// Redis slowed (40 ms each way), then blackholed for longer than the lease.
    RedisSlowThenBlackhole,
    /// The Redis primary that holds the lock SIGSTOPped for 1.5 × lease: it answers
    /// nothing, as if blackholed (Sentinel and Cluster, whose nodes are reached directly).
    RedisPausedPastTheLease,
    /// Every write at the origin for 2.5 × lease: the watchdog keeps the lock.
    OriginSlowerThanLease,
    /// An origin slower than the lease, and Redis blackholed for 600 ms (under the lease,
    /// over a renewal's timeout): one renewal fails, the next ones keep the lock.
    ShortRedisBlackhole,
    /// Instance 1 restarted with its wall clock an hour ahead, instance 2 an hour behind.
    ClockSkew,
}

impl Fault {
    /// Whether the fault takes the lock from a holder whose write is still on its way (and
    /// so must provoke a stale write).
    fn takes_the_lock(self) -> bool {
        matches!(
            self,
            Fault::PauseHolder
                | Fault::KillHolder
                | Fault::KillRedis
                | Fault::LaggingFailover
                | Fault::RedisSlowThenBlackhole
                | Fault::RedisPausedPastTheLease
        )
    }
}

/// The standalone Redis and the proxy in front of it.
fn standalone(backend: &mut Backend) -> (&mut RedisServer, &TcpProxy) {
    match backend {
        Backend::Standalone { redis, proxy } => (redis, proxy),
        _ => unreachable!("this nemesis runs on a standalone Redis"),
    }
}

/// The Redis key of the first seat's lock (`coord::keyspace`'s name for it: the default
/// prefix, the hash of the resource's path): which Cluster node holds it.
fn lock_key() -> String {
    let resource = xxhash_rust::xxh3::xxh3_128(seats()[0].as_bytes());
    format!("cg:ser:{{{resource:032x}}}:lock")
}

/// Kills the Redis that holds the lock (in Sentinel, both data nodes; in Cluster, the
/// lock's primary and its replica) and starts it again at once, empty: every lock and
/// every stored token is gone, and the restart is shorter than a failover's detection.
async fn restart_redis_empty(backend: &mut Backend) {
    match backend {
        Backend::Standalone { redis, .. } => {
            redis.kill();
            tokio::time::sleep(Duration::from_millis(300)).await;
            redis.restart().await;
        }
        Backend::Sentinel(set) => set.restart_data_empty().await,
        Backend::Cluster(cluster) => {
            let primary = cluster
                .owner_of(&lock_key())
                .await
                .expect("a primary owns the lock's slot");
            let replica = cluster.replica_of(primary).await;
            cluster.kill(primary);
            if let Some(replica) = replica {
                cluster.kill(replica);
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            cluster.start_again(primary).await;
            if let Some(replica) = replica {
                cluster.start_again(replica).await;
            }
        }
        Backend::None => unreachable!("this nemesis needs a Redis"),
    }
}

/// SIGSTOPs (`pause`) or SIGCONTs the primary that holds the lock.
async fn signal_lock_primary(backend: &Backend, port: Option<u16>, pause: bool) -> u16 {
    match backend {
        Backend::Sentinel(set) => {
            let port = match port {
                Some(port) => port,
                None => set
                    .primary_port()
                    .await
                    .expect("the sentinels name a primary"),
            };
            set.signal(port, pause);
            port
        }
        Backend::Cluster(cluster) => {
            let port = match port {
                Some(port) => port,
                None => cluster
                    .owner_of(&lock_key())
                    .await
                    .expect("a primary owns the lock's slot"),
            };
            if pause {
                cluster.pause(port);
            } else {
                cluster.resume(port);
            }
            port
        }
        _ => unreachable!("standalone Redis is blackholed through its proxy"),
    }
}

/// The leases each instance counted lost (a renewal that found the lock gone): a holder
/// starved of CPU past its lease on a loaded machine loses it as a paused one does.
async fn leases_lost(fleet: &Fleet) -> String {
    let client = HttpClient::new();
    let mut counts = Vec::new();
    for admin in fleet.admin_addrs() {
        let scraped = client
            .request(
                http::Method::GET,
                &url(admin, "/metrics"),
                &[],
                common::client::full_body(String::new()),
            )
            .await;
        let count = match scraped {
            Ok(resp) if resp.status == 200 => common::prom::parse(&resp.text())
                .map(|m| {
                    m.sum(
                        "cacheguard_serialized_leases_lost_total",
                        &[("route", "seat-update")],
                    )
                    .to_string()
                })
                .unwrap_or_else(|_| "?".to_string()),
            _ => "-".to_string(),
        };
        counts.push(count);
    }
    format!("leases lost per instance: {}", counts.join(", "))
}

/// One run: the backend, the shop (fencing or not), three instances (the victim behind its
/// link, all on the backend's lock), the clients and the nemesis.
async fn run(topology: Topology, fault: Fault, fencing: bool) -> Verdict {
    let mut backend = Backend::start(topology).await;
    let config = |upstream: &str| {
        backend
            .configure(CgConfig::with_upstream(upstream))
            .set_str("upstream", "timeout", "15s")
            .routes(&serialized::seat_route(None, None))
    };
    let mut fx = serialized::start_with(config, fencing, true).await;
    let clients = RunConfig {
        tail: Duration::from_millis(1500),
        // Above the longest a write may take: a wait, then a slow origin.
        request_timeout: WAIT_TIMEOUT + SLOW_WRITE + LOAD_SLACK,
        ..serialized::clients()
    };
    let mut verdict = serialized::run_clients(&mut fx, &clients, async |n, fx| {
        strike(n, fault, fx, &mut backend).await;
    })
    .await;
    verdict.notes = leases_lost(&fx.fleet).await;
    verdict
}

/// Waits until another instance's write to the first seat (begun after `since`) was
/// accepted and a write is at the origin, then lets the held write through, while the
/// seat's writes take [`DELIVERY_WRITE`] at the origin: the held write (stale) meets
/// another there, which an origin without the token check shows as an overlap.
async fn deliver(n: &Nemesis, fx: &Fixtures, since: Duration) -> tokio::time::Instant {
    fx.shop
        .set_latency(Scope::Path(seats()[0].clone()), DELIVERY_WRITE);
    serialized::deliver(n, fx, since).await;
    tokio::time::Instant::now()
}

/// [`DELIVERY_WINDOW`] after `delivered`, the first seat's writes back to their pace.
async fn settle(fx: &Fixtures, delivered: tokio::time::Instant) {
    tokio::time::sleep_until(delivered + DELIVERY_WINDOW).await;
    fx.shop
        .set_latency(Scope::Path(seats()[0].clone()), SHOP_WRITE);
}

/// The nemesis's schedule for `fault`.
async fn strike(n: Nemesis, fault: Fault, fx: &mut Fixtures, backend: &mut Backend) {
    n.at(FAULT_AT).await;
    match fault {
        Fault::None => {}
        Fault::PauseHolder => {
            let since = serialized::strand(&n, fx).await;
            let paused = n.elapsed();
            n.start("SIGSTOP instance 0 for 2 × lease");
            fx.fleet.pause(0);
            let delivered = deliver(&n, fx, since).await;
            n.at(paused + 2 * LEASE).await;
            fx.fleet.resume(0);
            n.heal("SIGCONT instance 0");
            settle(fx, delivered).await;
        }
        Fault::KillHolder => {
            let since = serialized::strand(&n, fx).await;
            n.start("kill -9 instance 0");
            fx.fleet.kill(0);
            let delivered = deliver(&n, fx, since).await;
            settle(fx, delivered).await;
        }
        Fault::KillRedis => {
            let since = serialized::strand(&n, fx).await;
            n.start("kill -9 redis");
            restart_redis_empty(backend).await;
            n.heal("redis restarted empty");
            let delivered = deliver(&n, fx, since).await;
            settle(fx, delivered).await;
        }
        Fault::LaggingFailover => {
            let Backend::Sentinel(set) = &*backend else {
                unreachable!("LaggingFailover runs on Sentinel")
            };
            n.start("replica link blackholed");
            set.lag_replica();
            let since = serialized::strand(&n, fx).await;
            n.start("failover to the lagging replica");
            let Backend::Sentinel(set) = &*backend else {
                unreachable!("LaggingFailover runs on Sentinel")
            };
            set.fail_over_to_lagging_replica(10).await;
            n.heal("lagging replica promoted");
            let delivered = deliver(&n, fx, since).await;
            settle(fx, delivered).await;
        }
        Fault::RedisSlowThenBlackhole => {
            n.start("redis +40ms each way");
            standalone(backend).1.set_delay(Duration::from_millis(40));
            n.at(FAULT_AT + Duration::from_secs(1)).await;
            let since = serialized::strand(&n, fx).await;
            n.start("redis blackholed for 1.5 × lease");
            let proxy = standalone(backend).1;
            proxy.blackhole();
            tokio::time::sleep(LEASE * 3 / 2).await;
            proxy.set_delay(Duration::ZERO);
            proxy.restore();
            n.heal("redis restored");
            let delivered = deliver(&n, fx, since).await;
            settle(fx, delivered).await;
        }
        Fault::RedisPausedPastTheLease => {
            let since = serialized::strand(&n, fx).await;
            n.start("the lock's redis primary SIGSTOPped for 1.5 × lease");
            let port = signal_lock_primary(backend, None, true).await;
            tokio::time::sleep(LEASE * 3 / 2).await;
            signal_lock_primary(backend, Some(port), false).await;
            n.heal("SIGCONT the redis primary");
            let delivered = deliver(&n, fx, since).await;
            settle(fx, delivered).await;
        }
        Fault::OriginSlowerThanLease => {
            n.start("origin writes take 2.5 × lease");
            fx.shop.set_latency(Scope::Writes, SLOW_WRITE);
            n.at(FAULT_AT + 2 * SLOW_WRITE).await;
            fx.shop.set_latency(Scope::Writes, SHOP_WRITE);
            n.heal("origin back to its pace");
        }
        Fault::ShortRedisBlackhole => {
            n.start("origin writes take 2.5 × lease");
            fx.shop.set_latency(Scope::Writes, SLOW_WRITE);
            // Writes are at the origin now, renewing their leases.
            n.at(FAULT_AT + Duration::from_millis(500)).await;
            n.start("redis blackholed for 600ms");
            let proxy = standalone(backend).1;
            proxy.blackhole();
            tokio::time::sleep(Duration::from_millis(600)).await;
            proxy.restore();
            n.heal("redis restored");
            n.at(FAULT_AT + 2 * SLOW_WRITE).await;
            fx.shop.set_latency(Scope::Writes, SHOP_WRITE);
            n.heal("origin back to its pace");
        }
        Fault::ClockSkew => {
            let client = HttpClient::new();
            n.start("instance 1 restarted an hour ahead");
            fx.fleet.restart_skewed(1, "+1h").await;
            n.start("instance 2 restarted an hour behind");
            fx.fleet.restart_skewed(2, "-1h").await;
            wait_coordinated(&client, &fx.fleet.admin_addrs()[1..]).await;
            n.heal("both skewed instances serving");
        }
    }
}

/// The checkers' verdict for `fault` against a fencing origin (`fencing`) or one that
/// checks nothing: a 503 within the wait, a Redis call in flight at its deadline
/// (command_timeout) and room for a loaded machine's scheduling; a restarted instance
/// (`ClockSkew`) refuses connections for a moment.
fn assert(verdict: &Verdict, fault: Fault, fencing: bool) {
    let answers = Answers {
        longest_refusal: WAIT_TIMEOUT + LOAD_SLACK,
        unanswered: fault == Fault::ClockSkew,
    };
    verdict.check_answers(fault.takes_the_lock(), fencing, answers);
}

async fn scenario(topology: Topology, fault: Fault) {
    assert(&run(topology, fault, true).await, fault, true);
}

/// The same nemesis against an origin that checks no token.
async fn bites(topology: Topology, fault: Fault) {
    assert(&run(topology, fault, false).await, fault, false);
}

// === no faults: exclusion 0 in every topology ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fault_standalone() {
    scenario(Topology::Standalone, Fault::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fault_sentinel() {
    scenario(Topology::Sentinel, Fault::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fault_cluster() {
    scenario(Topology::Cluster, Fault::None).await;
}

// === faults that take the lock from a holder: stale writes provoked and refused ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_paused_past_its_lease_standalone() {
    scenario(Topology::Standalone, Fault::PauseHolder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_paused_past_its_lease_cluster() {
    scenario(Topology::Cluster, Fault::PauseHolder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_paused_past_its_lease_sentinel() {
    scenario(Topology::Sentinel, Fault::PauseHolder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_paused_past_its_lease_bites() {
    bites(Topology::Standalone, Fault::PauseHolder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_killed_standalone() {
    scenario(Topology::Standalone, Fault::KillHolder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_killed_sentinel() {
    scenario(Topology::Sentinel, Fault::KillHolder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_killed_cluster() {
    scenario(Topology::Cluster, Fault::KillHolder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_killed_bites() {
    bites(Topology::Standalone, Fault::KillHolder).await;
}

/// "A fencing origin never accepts a token lower than one it accepted before, including
/// across a Redis restart without persistence."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_empty() {
    scenario(Topology::Standalone, Fault::KillRedis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_empty_sentinel() {
    scenario(Topology::Sentinel, Fault::KillRedis).await;
}

/// The lock's primary and its replica killed and restarted empty: the slot's tokens are
/// gone, and the next ones are still above every token the origin accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_empty_cluster() {
    scenario(Topology::Cluster, Fault::KillRedis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_empty_bites() {
    bites(Topology::Standalone, Fault::KillRedis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_fails_over_to_a_lagging_replica() {
    scenario(Topology::Sentinel, Fault::LaggingFailover).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_fails_over_to_a_lagging_replica_bites() {
    bites(Topology::Sentinel, Fault::LaggingFailover).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_slowed_then_blackholed_past_the_lease() {
    scenario(Topology::Standalone, Fault::RedisSlowThenBlackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_slowed_then_blackholed_past_the_lease_bites() {
    bites(Topology::Standalone, Fault::RedisSlowThenBlackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_primary_paused_past_the_lease_sentinel() {
    scenario(Topology::Sentinel, Fault::RedisPausedPastTheLease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_primary_paused_past_the_lease_cluster() {
    scenario(Topology::Cluster, Fault::RedisPausedPastTheLease).await;
}

// === faults that must not take the lock: exclusion 0, nothing refused ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_slower_than_the_lease_standalone() {
    scenario(Topology::Standalone, Fault::OriginSlowerThanLease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_slower_than_the_lease_sentinel() {
    scenario(Topology::Sentinel, Fault::OriginSlowerThanLease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_slower_than_the_lease_cluster() {
    scenario(Topology::Cluster, Fault::OriginSlowerThanLease).await;
}

/// One renewal that times out (Redis unreachable for 600 ms, under the lease) does not
/// give the lock up: the next renewals keep it while the slow write is at the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_blackholed_shorter_than_the_lease_keeps_the_lock() {
    scenario(Topology::Standalone, Fault::ShortRedisBlackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_clocks_skewed_standalone() {
    scenario(Topology::Standalone, Fault::ClockSkew).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_clocks_skewed_sentinel() {
    scenario(Topology::Sentinel, Fault::ClockSkew).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instance_clocks_skewed_cluster() {
    scenario(Topology::Cluster, Fault::ClockSkew).await;
}
