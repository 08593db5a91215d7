//! The etcd lock against a real `etcd` (Debian's `etcd-server`): grants exclude, a release
//! wakes the waiter, renewals extend, a lapsed lease is lost to the next holder, tokens
//! grow (across a `kill -9` and restart of etcd too), and a down, silent or misconfigured
//! etcd fails every call within its bound.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{EtcdLocks, EtcdSettings};
use crate::coord::locks::test_servers::EtcdServer;
use crate::coord::locks::{AcquireError, Grant, LockService, testing};

/// The shortest lease this etcd keeps (its election timeout is 250 ms).
const LEASE: Duration = Duration::from_secs(1);

fn settings(endpoint: String, user: Option<(&str, &str)>) -> EtcdSettings {
    EtcdSettings {
        name: "orders-etcd".into(),
        endpoints: vec![endpoint],
        prefix: "/cacheguard/locks".into(),
        user: user.map(|(u, p)| (u.to_owned(), p.to_owned())),
        connect_timeout: Duration::from_millis(500),
    }
}

/// One instance's lock service on `server`.
async fn instance(server: &EtcdServer) -> Arc<LockService> {
    Arc::new(LockService::Etcd(
        EtcdLocks::connect(settings(server.url(), None)).await,
    ))
}

async fn acquire(service: &LockService, path: &str, wait: Duration) -> Result<Grant, AcquireError> {
    testing::acquire(service, path, LEASE, wait).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_exclude_and_a_release_hands_over_with_a_larger_token() {
    let server = EtcdServer::start().await;
    let (a, b) = (instance(&server).await, instance(&server).await);
    let first_grant = acquire(&a, "/seats/1", LEASE).await.unwrap();
    assert!(first_grant.expires > Instant::now() + LEASE / 2);

    let started = Instant::now();
    let refused = acquire(&b, "/seats/1", Duration::from_millis(300)).await;
    assert_eq!(refused.err(), Some(AcquireError::Timeout));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_millis(600),
        "{waited:?}"
    );
    // Another resource is another key.
    let other = acquire(&b, "/seats/2", LEASE).await.unwrap();

    // A waiter is woken by the release (its watch sees the key go), not by polling.
    let waiter = {
        let b = Arc::clone(&b);
        tokio::spawn(async move {
            let started = Instant::now();
            (
                acquire(&b, "/seats/1", Duration::from_secs(5)).await,
                started.elapsed(),
            )
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let first = first_grant.token;
    a.release(&first_grant).await;
    drop(first_grant);
    let (second, waited) = waiter.await.unwrap();
    let second = second.unwrap();
    assert!(
        waited < Duration::from_millis(700),
        "woken after {waited:?}"
    );
    assert!(second.token > first, "{first} then {}", second.token);
    assert!(other.token > first && second.token > other.token);
    b.release(&second).await;
    drop(second);
    b.release(&other).await;
    drop(other);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_extend_and_a_lapsed_lease_is_lost_to_the_next_holder() {
    let server = EtcdServer::start().await;
    let (a, b) = (instance(&server).await, instance(&server).await);
    let mut first = acquire(&a, "/seats/1", LEASE).await.unwrap();
    tokio::time::sleep(LEASE / 2).await;
    let before = first.expires;
    assert_eq!(a.renew(&mut first, LEASE).await, Ok(true));
    assert!(first.expires > before);

    // The holder stops renewing (a paused instance): etcd ends its lease and deletes the
    // key, which wakes the waiter.
    let started = Instant::now();
    let second = acquire(&b, "/seats/1", Duration::from_secs(5))
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= LEASE / 2 && waited < LEASE * 3,
        "granted after {waited:?}"
    );
    assert!(second.token > first.token);
    assert_eq!(a.renew(&mut first, LEASE).await, Ok(false), "lost");
    // The late holder's release leaves the new holder's lock alone.
    a.release(&first).await;
    drop(first);
    let refused = acquire(&a, "/seats/1", Duration::from_millis(300)).await;
    assert_eq!(refused.err(), Some(AcquireError::Timeout));
    b.release(&second).await;
    drop(second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_grow_across_a_kill_and_restart_of_etcd() {
    let mut server = EtcdServer::start().await;
    let service = instance(&server).await;
    let mut last = 0;
    for _ in 0..3 {
        let grant = acquire(&service, "/seats/1", LEASE).await.unwrap();
        assert!(grant.token > last);
        last = grant.token;
        service.release(&grant).await;
        drop(grant);
    }
    server.kill();
    // Down: refused at once (the connection is refused), within the deadline at worst.
    let started = Instant::now();
    let down = acquire(&service, "/seats/1", Duration::from_millis(500)).await;
    assert_eq!(down.err(), Some(AcquireError::Unavailable));
    assert!(started.elapsed() < Duration::from_millis(700));
    server.restart().await;
    let grant = testing::acquire_again(&service, "/seats/1", LEASE, Duration::from_secs(10)).await;
    assert!(
        grant.token > last,
        "{last} then {} after the restart",
        grant.token
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_etcd_fails_every_call_within_its_bound() {
    let server = EtcdServer::start().await;
    let service = instance(&server).await;
    let mut held = acquire(&service, "/seats/1", LEASE).await.unwrap();
    server.pause();
    let started = Instant::now();
    let silent = acquire(&service, "/seats/2", Duration::from_millis(300)).await;
    assert_eq!(silent.err(), Some(AcquireError::Unavailable));
    assert!(started.elapsed() < Duration::from_millis(500));
    let started = Instant::now();
    assert_eq!(
        service.renew(&mut held, LEASE).await,
        Err(AcquireError::Unavailable)
    );
    assert!(started.elapsed() < LEASE / 3 + Duration::from_millis(200));
    let started = Instant::now();
    service.release(&held).await;
    drop(held);
    assert!(started.elapsed() < Duration::from_millis(700));
    server.resume();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_or_refused_at_start_is_unavailable_at_once() {
    // Nothing listens there: start does not wait past its bound, and acquires fail at once.
    let nowhere = format!(
        "http://127.0.0.1:{}",
        crate::coord::locks::test_servers::free_port()
    );
    let started = Instant::now();
    let service = LockService::Etcd(EtcdLocks::connect(settings(nowhere, None)).await);
    assert!(started.elapsed() < crate::coord::locks::START_WAIT + Duration::from_millis(500));
    let started = Instant::now();
    let down = acquire(&service, "/seats/1", Duration::from_secs(2)).await;
    assert_eq!(down.err(), Some(AcquireError::Unavailable));
    assert!(started.elapsed() < Duration::from_millis(700));

    // Authentication on, and a wrong password: no client, every acquire refused at once;
    // the right one works.
    let server = EtcdServer::start().await;
    let mut admin = server.client().await;
    admin.user_add("root", "right", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();
    let wrong = LockService::Etcd(
        EtcdLocks::connect(settings(server.url(), Some(("root", "wrong")))).await,
    );
    let started = Instant::now();
    let refused = acquire(&wrong, "/seats/1", Duration::from_secs(2)).await;
    assert_eq!(refused.err(), Some(AcquireError::Unavailable));
    assert!(started.elapsed() < Duration::from_millis(100));
    let right = LockService::Etcd(
        EtcdLocks::connect(settings(server.url(), Some(("root", "right")))).await,
    );
    let grant = acquire(&right, "/seats/1", LEASE).await.unwrap();
    right.release(&grant).await;
    drop(grant);
}
