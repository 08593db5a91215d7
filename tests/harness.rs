//! Self-checks of the test harness, without cacheguard in between: they prove that the
//! fixtures observe what the other tests rely on (so those tests can fail), e.g. that the
//! origin records hop-by-hop and spoofed headers when they do reach it.

mod common;

use std::time::Duration;

use bytes::Bytes;
use http::Method;
use tokio::time::Instant;

use common::client::channel_body;
use common::{
    HOP_REQUEST, HOP_RESPONSE, HttpClient, RedisServer, TestOrigin, concurrently, default_body,
    hop_names, poll_until, post_hop, serve_hop,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_counts_serials_and_records_requests() {
    let origin = TestOrigin::start().await;
    let client = HttpClient::new();
    let u = format!("{}/x?a=1", origin.url());
    for n in 1..=3 {
        let r = client
            .get_with_headers(&u, &[("x-forwarded-for", "6.6.6.6")])
            .await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, default_body("/x", n));
    }
    assert_eq!(origin.count("/x"), 3);
    assert_eq!(origin.count("/y"), 0);
    assert_eq!(origin.total(), 3);
    let seen = origin.last_request("/x").expect("recorded");
    assert_eq!(seen.uri.to_string(), "/x?a=1");
    assert_eq!(seen.header("x-forwarded-for").as_deref(), Some("6.6.6.6"));
    assert!(seen.peer.ip().is_loopback());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_behaviour_is_configurable_per_path() {
    let origin = TestOrigin::start().await;
    origin.set_status("/p", 404);
    origin.set_body("/p", "nope");
    origin.set_headers("/p", [("set-cookie", "a=1"), ("cache-control", "private")]);
    origin.set_ids(["1", "2", "3"]);
    let client = HttpClient::new();
    let r = client.get(&format!("{}/p", origin.url())).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.text(), "nope");
    assert_eq!(r.header("set-cookie").as_deref(), Some("a=1"));
    assert_eq!(r.header("cache-control").as_deref(), Some("private"));
    let ids = client.get(&format!("{}/internal/ids", origin.url())).await;
    assert_eq!(ids.text(), "1\n2\n3");
    origin.reset("/p");
    let r = client.get(&format!("{}/p", origin.url())).await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_tracks_max_in_flight() {
    let origin = TestOrigin::builder()
        .delay(Duration::from_millis(200))
        .start()
        .await;
    let client = HttpClient::new();
    let base = origin.url();
    concurrently(10, Duration::from_secs(10), |i| {
        let client = client.clone();
        let u = format!("{base}/k{i}");
        async move { client.get(&u).await.status }
    })
    .await;
    assert_eq!(origin.max_in_flight(), 10);
    assert_eq!(origin.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_request_delivers_hop_by_hop_headers_both_ways() {
    let origin = TestOrigin::start().await;
    serve_hop(&origin, &[]);
    let r = post_hop(origin.addr(), &[]).await;
    assert_eq!(r.body, "hello");
    let seen = origin.last_request("/hop").expect("seen");
    for name in hop_names(&HOP_REQUEST) {
        assert!(seen.header(name).is_some(), "{name} not delivered directly");
    }
    for name in hop_names(&HOP_RESPONSE) {
        assert!(r.header(name).is_some(), "{name} not received directly");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_sees_streamed_body_progressively() {
    let origin = TestOrigin::start().await;
    origin.set_echo("/s");
    let client = HttpClient::new();
    let (tx, body) = channel_body();
    let u = format!("{}/s", origin.url());
    let req = tokio::spawn(async move { client.request(Method::PUT, &u, &[], body).await });
    tx.send(Bytes::from_static(b"first")).await.expect("send");
    let seen = poll_until(
        Duration::from_secs(3),
        Duration::from_millis(10),
        || async { (origin.body_bytes_received("/s") == 5).then_some(()) },
    )
    .await;
    assert!(seen.is_some(), "first chunk not observed");
    tx.send(Bytes::from_static(b"second")).await.expect("send");
    drop(tx);
    let r = req.await.expect("task").expect("PUT");
    assert_eq!(r.body, "firstsecond");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_server_kill_pause_and_restart() {
    let mut redis = RedisServer::start().await;
    let mut con = redis.client().await;
    let _: () = redis::cmd("SET")
        .arg("cg:{abc}:v")
        .arg("x")
        .query_async(&mut con)
        .await
        .expect("SET");
    assert_eq!(redis.entry_keys().await.len(), 1);

    redis.pause();
    let started = Instant::now();
    let ping = tokio::time::timeout(
        Duration::from_millis(300),
        redis::cmd("PING").query_async::<String>(&mut con),
    )
    .await;
    assert!(ping.is_err(), "a paused redis-server answered: {ping:?}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    redis.resume();

    redis.kill();
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", redis.port()))
            .await
            .is_err(),
        "killed redis-server still accepts connections"
    );
    redis.restart().await;
    assert!(
        redis.entry_keys().await.is_empty(),
        "restarted redis is not empty"
    );
}

/// The cluster fixture (for the scale-out work): six real nodes form a cluster with three
/// primaries, each serving a third of the slots; a key's owner can be found; a killed
/// primary's replica is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_fixture_forms_and_fails_over() {
    let mut cluster = common::RedisCluster::start().await;
    assert_eq!(cluster.ports().len(), 6);
    let primaries = cluster.primaries().await;
    assert_eq!(primaries.len(), 3, "{}", cluster.nodes(primaries[0]).await);
    let mut owners = std::collections::HashSet::new();
    for k in 0..64 {
        let owner = cluster
            .owner_of(&format!("cg:{{{k:032x}}}:v"))
            .await
            .expect("every slot has an owner");
        assert!(primaries.contains(&owner));
        owners.insert(owner);
    }
    assert_eq!(
        owners.len(),
        3,
        "64 hash tags spread over all three primaries"
    );

    let victim = primaries[0];
    cluster.kill(victim);
    let survivor = primaries[1];
    let promoted = poll_until(Duration::from_secs(20), Duration::from_millis(200), || {
        let cluster = &cluster;
        async move {
            let info = cluster.info(survivor).await;
            (info.contains("cluster_state:ok") && cluster.primaries().await.len() == 3)
                .then_some(())
        }
    })
    .await;
    assert!(
        promoted.is_some(),
        "no replica took over from {victim}:\n{}\n{}",
        cluster.info(survivor).await,
        cluster.nodes(survivor).await
    );
}
