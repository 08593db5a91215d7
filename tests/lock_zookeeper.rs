//! Serialized writes on a ZooKeeper lock (`[locks.<name>] backend = "zookeeper"`), against
//! a real standalone ZooKeeper (Debian's `zookeeper` on its JRE; the tests that leave the
//! server alone share one, each under a lock path of its own): the history checkers of
//! `common::serialized` without faults (embedded and shared mode), through a `kill -9` and
//! restart of ZooKeeper (its data kept: sessions and locks survive a short outage, tokens
//! keep growing), through the holder's session expiring (the holder paused past the
//! session timeout: a stale write is provoked, refused by the fencing origin, accepted by
//! one that does not check), and the holder paused past its lease but not its session (a
//! ZooKeeper lock is the session's: it stays). The Java-free proof that Curator's
//! `InterProcessMutex` and cacheguard exclude each other, node by node. Then what a down
//! or unreachable ZooKeeper does to a request: answered within `wait_timeout` and a margin,
//! 503 or forwarded per `on_redis_error`, and a clear log line at start; the same for a
//! ZooKeeper that accepts connections and never answers, at start and at run time.

mod common;

use std::time::Duration;

use common::lock_servers::{ZooKeeperServer, free_port};
use common::serialized::{
    self, FAULT_AT, LEASE, Setup, answered_within, counted, pause_holder_for, policy_route,
    refused_at_start, strand, timed_put,
};
use common::shop::{Fault, Scope, Shop, seat};
use common::{
    CgConfig, HttpClient, RedisServer, TcpProxy, history::Epoch, poll_until, process,
    spawn_cacheguard_process,
};
use zookeeper_client::{Acls, CreateMode};

const LOCK: &str = "orders-zk";
/// The instances' session timeout: the longest a stopped holder keeps its locks.
const SESSION: Duration = Duration::from_secs(3);

/// `cfg` with the ZooKeeper lock `LOCK` on `connect`, its lock nodes under `root`.
fn with_zookeeper(cfg: CgConfig, connect: &str, root: &str) -> CgConfig {
    let section = format!("locks.{LOCK}");
    cfg.set_str(&section, "backend", "zookeeper")
        .set_str(&section, "connect", connect)
        .set_str(&section, "path", root)
        .set_str(
            &section,
            "session_timeout",
            &format!("{}s", SESSION.as_secs()),
        )
}

fn setup(shared: bool, fencing: bool) -> Setup<'static> {
    Setup {
        lock: Some(LOCK),
        shared,
        fencing,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fault_embedded() {
    let zk = ZooKeeperServer::shared().await;
    serialized::run_with(
        setup(false, true),
        |c| with_zookeeper(c, &zk.connect(), "/no-fault-embedded"),
        async |_, _| {},
    )
    .await
    .check(false, true);
}

/// The instances also share a Redis (shared mode): the seat route still locks in
/// ZooKeeper.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fault_shared() {
    let zk = ZooKeeperServer::shared().await;
    let redis = RedisServer::start().await;
    serialized::run_with(
        setup(true, true),
        |c| with_zookeeper(c.redis(&redis), &zk.connect(), "/no-fault-shared"),
        async |_, _| {},
    )
    .await
    .check(false, true);
}

/// `kill -9` of ZooKeeper while writes hold and wait, restarted on its data (the JVM takes
/// a second or so): writes are refused while the sessions are disconnected (503), none
/// overlap, and the tokens after the restart are above every one before (the zxid goes on
/// from the transaction log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_killed_and_restarted() {
    let mut zk = ZooKeeperServer::start().await;
    let connect = zk.connect();
    let mut killed_at = Duration::ZERO;
    let verdict = serialized::run_with(
        setup(false, true),
        |c| with_zookeeper(c, &connect, "/killed"),
        async |n, fx| {
            n.at(FAULT_AT).await;
            n.start("kill -9 zookeeper");
            killed_at = fx.shop.epoch().elapsed();
            zk.kill();
            zk.restart().await;
            n.heal("zookeeper restarted on its data");
            // A session that could not reconnect in time is expired now, or soon: the
            // server deletes its nodes one session timeout after it came back.
            tokio::time::sleep(SESSION).await;
            n.heal("sessions of the outage expired or back");
        },
    )
    .await;
    verdict.check(false, true);
    verdict.assert_tokens_grow_across(killed_at);
}

/// The holder SIGSTOPped with its write on the way, past its session timeout: the server
/// expires the session and deletes its node, another instance takes the seat, and the held
/// write, let through after it, is refused for its older token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_session_expired() {
    let zk = ZooKeeperServer::shared().await;
    serialized::run_with(
        setup(false, true),
        |c| with_zookeeper(c, &zk.connect(), "/holder-session-expired"),
        async |n, fx| {
            n.at(FAULT_AT).await;
            pause_holder_for(&n, fx, SESSION * 2).await;
        },
    )
    .await
    .check(true, true);
}

/// The same against an origin that checks no token: the nemesis bites.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_session_expired_bites() {
    let zk = ZooKeeperServer::shared().await;
    serialized::run_with(
        setup(false, false),
        |c| with_zookeeper(c, &zk.connect(), "/holder-session-expired-bites"),
        async |n, fx| {
            n.at(FAULT_AT).await;
            pause_holder_for(&n, fx, SESSION * 2).await;
        },
    )
    .await
    .check(true, false);
}

/// The holder SIGSTOPped with its write on the way for 1.5 leases, well within its
/// session: a ZooKeeper lock is held by the session, not the route's lease, so nobody
/// takes the seat meanwhile; the held write then goes through, and nothing overlaps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_paused_past_its_lease_within_its_session_keeps_the_lock() {
    let zk = ZooKeeperServer::shared().await;
    serialized::run_with(
        setup(false, true),
        |c| with_zookeeper(c, &zk.connect(), "/holder-paused-within-session"),
        async |n, fx| {
            n.at(FAULT_AT).await;
            strand(&n, fx).await;
            n.start("SIGSTOP instance 0 for 1.5 × lease");
            fx.fleet.pause(0);
            tokio::time::sleep(LEASE * 3 / 2).await;
            fx.fleet.resume(0);
            n.heal("SIGCONT instance 0");
            fx.link.restore();
            n.heal("the held write let through to the origin");
        },
    )
    .await
    .check(false, true);
}

/// The children of `dir` that are contenders, by Curator's order (the sequence).
async fn contenders(zk: &zookeeper_client::Client, dir: &str) -> Vec<String> {
    let mut children = zk
        .list_children(dir)
        .await
        .expect("list the lock directory");
    children.retain(|c| c.contains("-lock-"));
    children.sort_by_key(|c| c.rsplit_once("-lock-").map(|(_, s)| s.to_owned()));
    children
}

/// Curator's `InterProcessMutex` and cacheguard on one path, without Java: a node written
/// by hand in Curator's layout (what `InterProcessMutex.acquire()` creates: a protected
/// ephemeral sequential `_c_<uuid>-lock-<seq>` under the mutex's path) blocks cacheguard's
/// writes until it is deleted; and cacheguard's own node, while its write is at the
/// origin, is in that layout and comes first, so a Curator contender waits behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curator_and_cacheguard_exclude_each_other() {
    let zk = ZooKeeperServer::shared().await;
    let root = "/curator";
    let shop = Shop::start(Epoch::now(), &[]).await;
    let wait = Duration::from_millis(1500);
    let cg = with_zookeeper(CgConfig::with_upstream(&shop.url()), &zk.connect(), root)
        .routes(&policy_route(LOCK, "reject", wait))
        .start()
        .await;
    let client = HttpClient::new();
    let resource = seat("t1", "1A");
    let dir = format!("{root}{resource}");
    let java = zk.client(Duration::from_secs(10)).await;
    let container = CreateMode::Container.with_acls(Acls::anyone_all());
    let protected = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
    java.mkdir(&dir, &container).await.expect("mkdir");
    let prefix = format!("{dir}/_c_2b0c7a8e-5d1f-4c3a-9e6b-0f1d2c3b4a59-lock-");
    let (_, sequence) = java
        .create(&prefix, b"10.0.0.7", &protected)
        .await
        .expect("Curator's node");
    let curator_node = format!("{prefix}{sequence}");

    let (status, took) = timed_put(&client, cg.addr(), &resource).await;
    assert_eq!(status, 503, "a Curator holder blocks cacheguard");
    assert!(took >= wait, "{took:?}");
    assert!(shop.write_log().writes.is_empty());

    let waiting = {
        let (client, addr, resource) = (client.clone(), cg.addr(), resource.clone());
        tokio::spawn(async move { timed_put(&client, addr, &resource).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    java.delete(&curator_node, None)
        .await
        .expect("Curator releases");
    let (status, took) = waiting.await.expect("the waiting write");
    assert_eq!(status, 200, "granted once the Curator node is gone");
    assert!(took < wait, "{took:?}");

    // The other way: cacheguard holds while its write is at the origin.
    shop.set_fault(Scope::Writes, Fault::Hang);
    let holding = {
        let (client, addr, resource) = (client.clone(), cg.addr(), resource.clone());
        tokio::spawn(async move { timed_put(&client, addr, &resource).await })
    };
    let at_origin = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        || async { (shop.in_flight() == 1).then_some(()) },
    )
    .await;
    assert!(
        at_origin.is_some(),
        "cacheguard's write never reached the origin"
    );
    let held = contenders(&java, &dir).await;
    assert_eq!(held.len(), 1, "{held:?}");
    let name = held[0]
        .strip_prefix("_c_")
        .and_then(|n| n.split_once("-lock-"))
        .unwrap_or_else(|| panic!("not Curator's layout: {held:?}"));
    assert_eq!(name.0.len(), 36, "{held:?}");
    assert!(
        name.1.len() == 10 && name.1.bytes().all(|b| b.is_ascii_digit()),
        "{held:?}"
    );
    // A Curator contender now: its node sorts after cacheguard's, so it waits.
    let (_, sequence) = java
        .create(&prefix, b"10.0.0.7", &protected)
        .await
        .expect("Curator contends");
    let curator_node = format!("{prefix}{sequence}");
    let order = contenders(&java, &dir).await;
    assert_eq!(order.len(), 2);
    assert_eq!(
        order[0], held[0],
        "cacheguard's node comes first: {order:?}"
    );
    assert!(curator_node.ends_with(&order[1]));
    // cacheguard's write ends: its node goes, and the Curator contender's is the lowest
    // (Curator's watch on its predecessor fires and it holds).
    shop.release();
    assert_eq!(holding.await.expect("the holding write").0, 200);
    let alone = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        || async {
            let order = contenders(&java, &dir).await;
            (order.len() == 1 && curator_node.ends_with(&order[0])).then_some(())
        },
    )
    .await;
    assert!(alone.is_some(), "cacheguard's node was not deleted");
    // And cacheguard now waits for Curator again.
    shop.set_fault(Scope::Writes, Fault::None);
    assert_eq!(timed_put(&client, cg.addr(), &resource).await.0, 503);
    cg.shutdown().await;
}

/// ZooKeeper silent (SIGSTOP: before the session sees the connection lost, and after)
/// and down (killed): a write is answered within `wait_timeout` and a margin, 503 with
/// `reject`, forwarded (unserialized) with `forward`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zookeeper_down_or_silent_answers_per_policy_within_the_wait() {
    let wait = Duration::from_millis(400);
    let bound = wait + Duration::from_millis(300);
    for (policy, status) in [("reject", 503), ("forward", 200)] {
        let mut zk = ZooKeeperServer::start().await;
        let shop = Shop::start(Epoch::now(), &[]).await;
        let cg = with_zookeeper(CgConfig::with_upstream(&shop.url()), &zk.connect(), "/down")
            .routes(&policy_route(LOCK, policy, wait))
            .start()
            .await;
        answered_within(cg.addr(), 1, 200, bound, "zookeeper up").await;
        zk.pause();
        // The session concludes the connection lost after 2/5 of its timeout (1.2 s): the
        // writes before and after that.
        answered_within(
            cg.addr(),
            5,
            status,
            bound,
            &format!("{policy}, zookeeper silent"),
        )
        .await;
        zk.resume();
        zk.kill();
        answered_within(
            cg.addr(),
            3,
            status,
            bound,
            &format!("{policy}, zookeeper down"),
        )
        .await;
        let reached = if policy == "reject" { 1 } else { 9 };
        assert_eq!(shop.write_log().writes.len(), reached, "{policy}");
        cg.shutdown().await;
    }
}

/// A ZooKeeper that accepts connections and never answers: the test's fault proxy in front
/// of the real server, blackholed (every connection accepted and held, not a byte either
/// way). For each `on_redis_error`:
///
/// - `--check-config` passes at once and connects nowhere (it cannot know);
/// - silent at start: the process is up all the same (the session is not waited for
///   forever), logs the lock unreachable with its name and connect string, and answers
///   writes per policy within the wait;
/// - silent at run time (the proxy blackholed while the session is connected, before the
///   client concludes the connection lost): a lock request that is never answered is the
///   lock service unavailable, answered per policy, not a lock held by another (which is
///   503 whatever the policy, and counted `timeout`). No write is ever counted `timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_zookeeper_at_start_or_at_run_time_answers_per_policy() {
    let zk = ZooKeeperServer::shared().await;
    let server: std::net::SocketAddr = zk.connect().parse().expect("a socket address");
    let wait = Duration::from_millis(400);
    let bound = wait + Duration::from_secs(1);
    let client = HttpClient::new();
    for (policy, status, result) in [("reject", 503, "unavailable"), ("forward", 200, "ungated")] {
        let silent = TcpProxy::start(server).await;
        silent.blackhole();
        let connect = silent.addr().to_string();
        let shop = Shop::start(Epoch::now(), &[]).await;
        let dir = tempfile::tempdir().expect("tempdir");
        let root = format!("/silent-{policy}");
        let config = with_zookeeper(CgConfig::with_upstream(&shop.url()), &connect, &root)
            .routes(&policy_route(LOCK, policy, wait))
            .on_free_ports()
            .write_to(&dir.path().join("cacheguard.toml"));

        let started = tokio::time::Instant::now();
        let checked = std::process::Command::new(process::binary())
            .arg("--check-config")
            .arg(&config)
            .output()
            .expect("run cacheguard --check-config");
        let took = started.elapsed();
        let stdout = String::from_utf8_lossy(&checked.stdout);
        assert!(
            checked.status.success() && stdout.contains("config OK"),
            "{checked:?}"
        );
        assert!(
            took < Duration::from_secs(5),
            "--check-config took {took:?}"
        );
        assert_eq!(
            silent.accepted(),
            0,
            "--check-config connected to ZooKeeper"
        );

        let started = tokio::time::Instant::now();
        let cg = spawn_cacheguard_process(&config).await;
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(8),
            "{policy}: started after {took:?}"
        );
        let needles = ["Lock service unreachable", LOCK, connect.as_str()];
        let logged = poll_until(Duration::from_secs(10), Duration::from_millis(50), || {
            let output = cg.output();
            async move { needles.iter().all(|n| output.contains(n)).then_some(()) }
        })
        .await;
        assert!(
            logged.is_some(),
            "{policy}: no {needles:?} in\n{}",
            cg.output()
        );
        assert!(
            silent.accepted() > 0,
            "{policy}: the silent server was never tried"
        );
        answered_within(
            cg.addr(),
            2,
            status,
            bound,
            &format!("{policy}, silent at start"),
        )
        .await;

        // Heard again: the session opens in the background and writes are granted.
        silent.restore();
        let granted = poll_until(Duration::from_secs(20), Duration::from_millis(100), || {
            let (client, addr, admin) = (client.clone(), cg.addr(), cg.admin_addr());
            async move {
                let status = common::put(&client, addr, &seat("t1", "1A")).await.status;
                (status == 200 && counted(&client, admin, "granted").await > 0.0).then_some(())
            }
        })
        .await;
        assert!(
            granted.is_some(),
            "{policy}: never granted\n{}",
            cg.output()
        );

        silent.blackhole();
        let before = counted(&client, cg.admin_addr(), result).await;
        answered_within(
            cg.addr(),
            4,
            status,
            bound,
            &format!("{policy}, silent at run time"),
        )
        .await;
        assert_eq!(
            counted(&client, cg.admin_addr(), result).await - before,
            4.0,
            "{policy}: the writes while ZooKeeper was silent"
        );
        assert_eq!(
            counted(&client, cg.admin_addr(), "timeout").await,
            0.0,
            "{policy}: a silent ZooKeeper counted as a lock held by another"
        );
    }
}

/// Unreachable at start: the process starts all the same (no hang), logs an error naming
/// the lock, its connect string and what failed, and answers the route's writes per its
/// policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_at_start_is_logged_and_answered_per_policy() {
    let shop = Shop::start(Epoch::now(), &[]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let nowhere = format!("127.0.0.1:{}", free_port());
    refused_at_start(
        with_zookeeper(CgConfig::with_upstream(&shop.url()), &nowhere, "/nowhere")
            .routes(&policy_route(LOCK, "reject", Duration::from_secs(1))),
        dir.path(),
        &["Lock service unreachable", LOCK, &nowhere],
    )
    .await;
    assert!(shop.write_log().writes.is_empty());
}
