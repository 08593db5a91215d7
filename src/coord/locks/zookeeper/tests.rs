//! The ZooKeeper lock against a real standalone ZooKeeper (Debian's `zookeeper`): Curator's
//! node layout, grants exclude, a release wakes the next contender, tokens (czxids) grow
//! across a `kill -9` and restart of the server, a session that expires or is disconnected
//! is a lost grant, and an unreachable server fails every call at once. The tests that do
//! not stop the server share one ([`ZooKeeperServer::shared`]: a JVM takes a while to
//! start), each on paths of its own.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{ZooKeeperLocks, ZooKeeperSettings, lock_dir, sequence, uuid_v4};
use crate::coord::locks::test_servers::{ZooKeeperServer, free_port};
use crate::coord::locks::{AcquireError, Grant, Handle, LockService, testing};

const LEASE: Duration = Duration::from_secs(1);
/// The session of the tests that wait for a session to be suspended or to expire.
const SESSION: Duration = Duration::from_secs(2);
/// The session of the tests that end a session on purpose (or not at all): a machine
/// under load must not end or suspend it. A 2 s session cannot promise that: its client
/// concludes the connection lost after 0.8 s without a byte from the server (2/5 of the
/// session), which a starved test process or JVM outlasts at a load of 6 to 9, and a
/// request under way then fails (`Unavailable`) although nothing was wrong.
const LONG_SESSION: Duration = Duration::from_secs(10);
/// How long a session may take to open on a loaded machine.
const OPEN_BOUND: Duration = Duration::from_secs(20);

fn settings(connect: String) -> ZooKeeperSettings {
    settings_with(connect, SESSION)
}

fn settings_with(connect: String, session_timeout: Duration) -> ZooKeeperSettings {
    ZooKeeperSettings {
        name: "orders-zk".into(),
        connect,
        path: "/cacheguard/locks".into(),
        session_timeout,
    }
}

async fn instance(server: &ZooKeeperServer) -> Arc<LockService> {
    instance_with(server, SESSION).await
}

/// A lock service on `server` with sessions of `session`, once its session is open: the
/// service's `connect` waits `START_WAIT` at most (then goes on, and acquires fail until
/// the session opens), which a loaded machine may outlast.
async fn instance_with(server: &ZooKeeperServer, session: Duration) -> Arc<LockService> {
    let service = LockService::ZooKeeper(
        ZooKeeperLocks::connect(settings_with(server.connect(), session)).await,
    );
    let deadline = Instant::now() + OPEN_BOUND;
    while locks_of(&service).session().is_err() {
        assert!(
            Instant::now() < deadline,
            "no ZooKeeper session within {OPEN_BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Arc::new(service)
}

async fn acquire(service: &LockService, path: &str, wait: Duration) -> Result<Grant, AcquireError> {
    testing::acquire(service, path, LEASE, wait).await
}

fn node_of(grant: &Grant) -> &str {
    match &grant.handle {
        Handle::ZooKeeper(held) => held.node.path.as_deref().unwrap_or_default(),
        _ => panic!("not a ZooKeeper grant"),
    }
}

fn locks_of(service: &LockService) -> &ZooKeeperLocks {
    match service {
        LockService::ZooKeeper(zk) => zk,
        _ => panic!("not a ZooKeeper service"),
    }
}

#[test]
fn lock_dirs_are_the_path_under_the_root_with_what_zookeeper_refuses_escaped() {
    assert_eq!(
        lock_dir("/cacheguard/locks", "/trains/t1/seats/1A"),
        "/cacheguard/locks/trains/t1/seats/1A"
    );
    assert_eq!(lock_dir("/", "/a/b"), "/a/b");
    assert_eq!(lock_dir("/l", "/a/./../b%2F"), "/l/a/%2E/%2E%2E/b%2F");
    assert_eq!(lock_dir("/l", "/a//b/"), "/l/a/%20/b/%20");
    assert_eq!(lock_dir("/l", "/a\u{1}b"), "/l/a%01b");
    assert_eq!(lock_dir("/l", "/x\u{7f}y"), "/l/x%7Fy");
}

#[test]
fn contenders_sort_by_curators_sequence() {
    assert_eq!(sequence("_c_0b1c-lock-0000000042"), Some("0000000042"));
    assert_eq!(sequence("x-lock-lock-0000000007"), Some("0000000007"));
    assert_eq!(sequence("lock-"), None);
    assert_eq!(sequence("_c_0b1c-latch-0000000042"), None);
    let uuid = uuid_v4();
    let groups: Vec<usize> = uuid.split('-').map(str::len).collect();
    assert_eq!(groups, [8, 4, 4, 4, 12], "{uuid}");
    assert_eq!(&uuid[14..15], "4", "version 4: {uuid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curators_layout_grants_exclude_and_a_release_hands_over_with_a_larger_token() {
    let server = ZooKeeperServer::shared().await;
    let (a, b) = (instance(&server).await, instance(&server).await);
    let first = acquire(&a, "/t1/seats/1", LEASE).await.unwrap();
    // Curator's InterProcessMutex node: `<dir>/_c_<uuid>-lock-<10-digit sequence>`.
    let node = node_of(&first).to_owned();
    let name = node
        .strip_prefix("/cacheguard/locks/t1/seats/1/_c_")
        .unwrap_or_else(|| panic!("{node}"));
    let (uuid, sequence) = name.split_once("-lock-").unwrap();
    assert_eq!(uuid.len(), 36, "{node}");
    assert!(
        sequence.len() == 10 && sequence.bytes().all(|b| b.is_ascii_digit()),
        "{node}"
    );

    let started = Instant::now();
    let refused = acquire(&b, "/t1/seats/1", Duration::from_millis(300)).await;
    assert_eq!(refused.err(), Some(AcquireError::Timeout));
    assert!(started.elapsed() < Duration::from_millis(600));
    // The contender that gave up left no node behind (it is deleted in the background).
    let watcher = server.client(SESSION).await;
    let deadline = Instant::now() + Duration::from_secs(2);
    while watcher
        .list_children("/cacheguard/locks/t1/seats/1")
        .await
        .unwrap()
        .len()
        > 1
    {
        assert!(
            Instant::now() < deadline,
            "a given-up contender's node is left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let waiter = {
        let b = Arc::clone(&b);
        tokio::spawn(async move {
            let started = Instant::now();
            (
                acquire(&b, "/t1/seats/1", Duration::from_secs(5)).await,
                started.elapsed(),
            )
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let token = first.token;
    a.release(&first).await;
    drop(first);
    let (second, waited) = waiter.await.unwrap();
    let mut second = second.unwrap();
    assert!(
        waited < Duration::from_millis(700),
        "woken after {waited:?}"
    );
    assert!(second.token > token, "{token} then {}", second.token);
    assert_eq!(b.renew(&mut second, LEASE).await, Ok(true));
    b.release(&second).await;
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_session_is_a_lost_grant_and_a_new_session_follows() {
    let server = ZooKeeperServer::shared().await;
    // The session is ended on purpose below; nothing else may end or suspend it.
    let (a, b) = (
        instance_with(&server, LONG_SESSION).await,
        instance_with(&server, LONG_SESSION).await,
    );
    // Nobody holds the seat: the wait only bounds the server's answers.
    let mut first = acquire(&a, "/t2/seats/1", LONG_SESSION).await.unwrap();
    let waiter = {
        let b = Arc::clone(&b);
        tokio::spawn(async move { acquire(&b, "/t2/seats/1", 2 * LONG_SESSION).await })
    };
    // Expire a's session the classic way: open it from another client, and close that.
    // A race: the server closes a session's other connection when a client takes the
    // session, and a's client reconnects at once and takes it back, so the thief's connect
    // may fail (it tries until its deadline: `Timeout`), or its close be cut off. Tried
    // again until a's node is gone (the server closed the session).
    let session = locks_of(&a).session.load_full().unwrap().session().clone();
    let node = node_of(&first).to_owned();
    let connect = server.connect();
    let watcher = server.client(LONG_SESSION).await;
    let deadline = Instant::now() + OPEN_BOUND;
    let mut tries = 0;
    while watcher.check_stat(&node).await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "a's session still open after {tries} tries to close it"
        );
        tries += 1;
        let thief = zookeeper_client::Client::connector()
            .with_session(session.clone())
            .with_fail_eagerly()
            .connect(&connect);
        if let Ok(Ok(thief)) = tokio::time::timeout(SESSION, thief).await {
            drop(thief);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("a's session closed at try {tries}");
    let second = waiter.await.unwrap().unwrap();
    assert!(second.token > first.token);
    // a learns it within a session timeout: told by the server that its session expired,
    // or, hearing nothing, disconnected after 2/5 of it.
    let deadline = Instant::now() + LONG_SESSION;
    while a.renew(&mut first, LEASE).await != Ok(false) {
        assert!(
            Instant::now() < deadline,
            "the expired session's grant still renews"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The service opens a new session on its own, and locks again.
    let handed = second.token;
    b.release(&second).await;
    drop(second);
    let third = testing::acquire_again(&a, "/t2/seats/1", LEASE, OPEN_BOUND).await;
    assert!(third.token > handed, "{handed} then {}", third.token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_session_is_a_lost_grant_and_acquires_fail_at_once() {
    let server = ZooKeeperServer::start().await;
    let service = instance(&server).await;
    let mut held = acquire(&service, "/t3/seats/1", LEASE).await.unwrap();
    server.pause();
    // The client concludes the connection lost after 2/5 of the session timeout
    // (Curator's SUSPENDED); a renewal in the meantime is bounded by a third of the lease.
    let deadline = Instant::now() + SESSION;
    loop {
        let started = Instant::now();
        let renewed = service.renew(&mut held, LEASE).await;
        assert!(started.elapsed() < LEASE / 3 + Duration::from_millis(100));
        if renewed == Ok(false) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {renewed:?} while disconnected"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let started = Instant::now();
    let refused = acquire(&service, "/t3/seats/2", Duration::from_secs(2)).await;
    assert_eq!(refused.err(), Some(AcquireError::Unavailable));
    assert!(started.elapsed() < Duration::from_millis(100));
    server.resume();
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_across_a_kill_and_restart_of_zookeeper() {
    let mut server = ZooKeeperServer::start().await;
    let service = instance(&server).await;
    let mut last = 0;
    for _ in 0..3 {
        let grant = acquire(&service, "/t4/seats/1", LEASE).await.unwrap();
        assert!(grant.token > last);
        last = grant.token;
        service.release(&grant).await;
        drop(grant);
    }
    server.kill();
    server.restart().await;
    let grant =
        testing::acquire_again(&service, "/t4/seats/1", LEASE, Duration::from_secs(15)).await;
    // A standalone server goes on from the last zxid in its log (kept in its data dir).
    assert!(
        grant.token > last,
        "{last:#x} then {:#x} after the restart",
        grant.token
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_at_start_is_unavailable_at_once() {
    let started = Instant::now();
    let service = LockService::ZooKeeper(
        ZooKeeperLocks::connect(settings(format!("127.0.0.1:{}", free_port()))).await,
    );
    assert!(started.elapsed() < crate::coord::locks::START_WAIT + Duration::from_millis(500));
    let started = Instant::now();
    let down = acquire(&service, "/t5/seats/1", Duration::from_secs(2)).await;
    assert_eq!(down.err(), Some(AcquireError::Unavailable));
    assert!(started.elapsed() < Duration::from_millis(100));
}
