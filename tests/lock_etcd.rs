//! Serialized writes on an etcd lock (`[locks.<name>] backend = "etcd"`), against real
//! `etcd` servers (Debian's `etcd-server`, started per test: a third of a second): the
//! history checkers of `common::serialized` without faults (embedded and shared mode),
//! through a `kill -9` and restart of etcd (its data kept: tokens keep growing, the lock is
//! not taken from its holder, whose lease etcd refreshes when it comes back), through the
//! holder paused past its lease (etcd expires it: a stale write is provoked, and refused by
//! the fencing origin, accepted by one that does not check), and a member of a
//! three-member cluster killed. Then what a down, silent or misconfigured etcd does to a
//! request: answered within `wait_timeout` and a margin, 503 or forwarded per
//! `on_redis_error`, and a clear log line at start.

mod common;

use std::time::Duration;

use common::lock_servers::{EtcdServer, free_port};
use common::serialized::{
    self, FAULT_AT, LEASE, Setup, answered_within, pause_holder_for, policy_route, refused_at_start,
};
use common::shop::Shop;
use common::{CgConfig, RedisServer, history::Epoch};

const LOCK: &str = "orders-etcd";

/// `cfg` with the etcd lock `LOCK` on `endpoints`.
fn with_etcd(cfg: CgConfig, endpoints: &[String]) -> CgConfig {
    let section = format!("locks.{LOCK}");
    let list: Vec<String> = endpoints.iter().map(|e| format!("\"{e}\"")).collect();
    cfg.set_str(&section, "backend", "etcd")
        .set(&section, "endpoints", &format!("[{}]", list.join(", ")))
        .set_str(&section, "connect_timeout", "500ms")
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
    let etcd = EtcdServer::start().await;
    let endpoints = [etcd.url()];
    serialized::run_with(
        setup(false, true),
        |c| with_etcd(c, &endpoints),
        async |_, _| {},
    )
    .await
    .check(false, true);
}

/// The instances also share a Redis (shared mode): the seat route still locks in etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fault_shared() {
    let etcd = EtcdServer::start().await;
    let redis = RedisServer::start().await;
    let endpoints = [etcd.url()];
    serialized::run_with(
        setup(true, true),
        |c| with_etcd(c.redis(&redis), &endpoints),
        async |_, _| {},
    )
    .await
    .check(false, true);
}

/// `kill -9` of etcd while writes hold and wait for locks, restarted on its data 0.5 s
/// later: writes are refused meanwhile (503, the lock service down), none overlap, and
/// the tokens after the restart are above every one before (etcd's revision is durable).
/// A lock whose release etcd missed stays taken until its lease ends (etcd gives every
/// lease its full TTL again when it comes back): writes must go through again after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_killed_and_restarted() {
    let mut etcd = EtcdServer::start().await;
    let endpoints = [etcd.url()];
    let mut killed_at = Duration::ZERO;
    let verdict = serialized::run_with(
        setup(false, true),
        |c| with_etcd(c, &endpoints),
        async |n, fx| {
            n.at(FAULT_AT).await;
            n.start("kill -9 etcd");
            killed_at = fx.shop.epoch().elapsed();
            etcd.kill();
            tokio::time::sleep(Duration::from_millis(500)).await;
            etcd.restart().await;
            n.heal("etcd restarted on its data");
            tokio::time::sleep(LEASE * 2).await;
            n.heal("the leases of the releases etcd missed have ended");
        },
    )
    .await;
    verdict.check(false, true);
    verdict.assert_tokens_grow_across(killed_at);
}

/// The holder SIGSTOPped with its write on the way, past its lease: etcd expires the
/// lease, another instance takes the seat, and the held write, let through after it, is
/// refused for its older token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_paused_past_its_lease() {
    let etcd = EtcdServer::start().await;
    let endpoints = [etcd.url()];
    serialized::run_with(
        setup(false, true),
        |c| with_etcd(c, &endpoints),
        async |n, fx| {
            n.at(FAULT_AT).await;
            pause_holder_for(&n, fx, LEASE * 3).await;
        },
    )
    .await
    .check(true, true);
}

/// The same against an origin that checks no token: the stale write is accepted, out of
/// order and overlapping another (the nemesis bites; only the origin's check stops it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_paused_past_its_lease_bites() {
    let etcd = EtcdServer::start().await;
    let endpoints = [etcd.url()];
    serialized::run_with(
        setup(false, false),
        |c| with_etcd(c, &endpoints),
        async |n, fx| {
            n.at(FAULT_AT).await;
            pause_holder_for(&n, fx, LEASE * 3).await;
        },
    )
    .await
    .check(true, false);
}

/// A three-member cluster, every member an endpoint; one member `kill -9`ed and restarted
/// a second later (a new leader is elected if it led): no overlap, tokens grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_member_killed_and_restarted() {
    let mut members = EtcdServer::cluster(3).await;
    let endpoints: Vec<String> = members.iter().map(EtcdServer::url).collect();
    serialized::run_with(
        setup(false, true),
        |c| with_etcd(c, &endpoints),
        async |n, _| {
            n.at(FAULT_AT).await;
            n.start("kill -9 etcd member 0");
            members[0].kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            members[0].restart().await;
            n.heal("etcd member 0 restarted");
        },
    )
    .await
    .check(false, true);
}

/// etcd down (refusing connections) and silent (SIGSTOP): a write is answered within
/// `wait_timeout` and a margin, 503 with `reject`, forwarded (unserialized) with `forward`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_down_or_silent_answers_per_policy_within_the_wait() {
    let wait = Duration::from_millis(400);
    let bound = wait + Duration::from_millis(300);
    for (policy, status) in [("reject", 503), ("forward", 200)] {
        let mut etcd = EtcdServer::start().await;
        let shop = Shop::start(Epoch::now(), &[]).await;
        let cg = with_etcd(CgConfig::with_upstream(&shop.url()), &[etcd.url()])
            .routes(&policy_route(LOCK, policy, wait))
            .start()
            .await;
        answered_within(cg.addr(), 1, 200, bound, "etcd up").await;
        etcd.pause();
        answered_within(
            cg.addr(),
            2,
            status,
            bound,
            &format!("{policy}, etcd silent"),
        )
        .await;
        etcd.resume();
        etcd.kill();
        answered_within(cg.addr(), 2, status, bound, &format!("{policy}, etcd down")).await;
        let reached = if policy == "reject" { 1 } else { 5 };
        assert_eq!(shop.write_log().writes.len(), reached, "{policy}");
        cg.shutdown().await;
    }
}

/// Unreachable at start, and a wrong password: the process starts all the same (no hang),
/// logs an error naming the lock, its endpoints and what failed, and answers the route's
/// writes per its policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_or_refused_at_start_is_logged_and_answered_per_policy() {
    let shop = Shop::start(Epoch::now(), &[]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let route = policy_route(LOCK, "reject", Duration::from_secs(1));
    let nowhere = format!("http://127.0.0.1:{}", free_port());
    let upstream = || CgConfig::with_upstream(&shop.url());
    refused_at_start(
        with_etcd(upstream(), std::slice::from_ref(&nowhere)).routes(&route),
        dir.path(),
        &["Lock service unreachable", LOCK, &nowhere],
    )
    .await;

    let etcd = EtcdServer::start().await;
    let mut admin = etcd.client().await;
    admin
        .user_add("root", "right", None)
        .await
        .expect("user add");
    admin
        .user_grant_role("root", "root")
        .await
        .expect("grant root");
    admin.auth_enable().await.expect("auth enable");
    let output = refused_at_start(
        with_etcd(upstream(), &[etcd.url()])
            .set_str(&format!("locks.{LOCK}"), "username", "root")
            .set_str(&format!("locks.{LOCK}"), "password", "wrong-s3cret")
            .routes(&route),
        dir.path(),
        &["authentication failed", LOCK, &etcd.url()],
    )
    .await;
    assert!(
        !output.contains("wrong-s3cret"),
        "the password is never logged:\n{output}"
    );
    assert!(shop.write_log().writes.is_empty());
}
