//! Unmatched paths are proxied untouched and never cached: bodies stream through both
//! ways, status and end-to-end headers pass back, hop-by-hop headers are stripped.

use std::time::Duration;

use bytes::Bytes;
use http::Method;

use crate::common;
use crate::common::client::{channel_body, full_body};
use crate::common::{
    CgConfig, HOP_REQUEST, HOP_RESPONSE, HttpClient, TestOrigin, hop_names, poll_until, post_hop,
    serve_hop, url,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_get_is_bypassed_every_time() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    for i in 1..=3u64 {
        let r = client.get(&url(cg.addr(), "/not/a/route?q=1")).await;
        assert_eq!(r.status, 200, "{r}");
        assert_eq!(r.x_cache(), "BYPASS", "{r}");
        assert_eq!(
            origin.count("/not/a/route"),
            i,
            "an unmatched path was cached"
        );
    }
    let seen = origin.last_request("/not/a/route").expect("seen");
    assert_eq!(
        seen.uri.to_string(),
        "/not/a/route?q=1",
        "unmatched URI must pass untouched"
    );
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_post_is_echoed_with_status_and_headers() {
    let origin = TestOrigin::start().await;
    origin.set_echo("/echo");
    origin.set_status("/echo", 201);
    origin.set_headers(
        "/echo",
        [
            ("x-custom", "abc"),
            ("location", "/echo/7"),
            ("set-cookie", "s=1"),
        ],
    );
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    let payload = Bytes::from(
        (0..200_000u32)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    );
    let r = client
        .request(
            Method::POST,
            &url(cg.addr(), "/echo?a=1"),
            &[
                ("content-type", "application/x-test"),
                ("x-request-id", "r-1"),
            ],
            full_body(payload.clone()),
        )
        .await
        .expect("POST");
    assert_eq!(r.status, 201, "{r}");
    assert_eq!(r.body, payload, "echoed body differs");
    assert_eq!(r.header("x-custom").as_deref(), Some("abc"));
    assert_eq!(r.header("location").as_deref(), Some("/echo/7"));
    assert_eq!(
        r.header("set-cookie").as_deref(),
        Some("s=1"),
        "pass-through must keep Set-Cookie"
    );
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/x-test")
    );
    assert_eq!(r.x_cache(), "BYPASS", "{r}");
    let seen = origin.last_request("/echo").expect("seen");
    assert_eq!(seen.method, Method::POST);
    assert_eq!(seen.uri.to_string(), "/echo?a=1");
    assert_eq!(
        seen.header("x-request-id").as_deref(),
        Some("r-1"),
        "end-to-end header dropped"
    );
    assert_eq!(seen.body, payload);
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_request_body_is_streamed_not_buffered() {
    let origin = TestOrigin::start().await;
    origin.set_echo("/stream");
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    let (tx, body) = channel_body();
    let u = url(cg.addr(), "/stream");
    let req = tokio::spawn({
        let client = client.clone();
        async move { client.request(Method::PUT, &u, &[], body).await }
    });
    let first = Bytes::from(vec![b'a'; 32 * 1024]);
    tx.send(first.clone()).await.expect("send first chunk");
    // The origin must see the first chunk while the client is still holding the rest.
    let arrived = poll_until(
        Duration::from_secs(3),
        Duration::from_millis(20),
        || async { (origin.body_bytes_received("/stream") > 0).then_some(()) },
    )
    .await;
    let second = Bytes::from(vec![b'b'; 32 * 1024]);
    tx.send(second.clone()).await.expect("send second chunk");
    drop(tx);
    let r = req.await.expect("task").expect("PUT");
    assert!(
        arrived.is_some(),
        "the origin saw no body bytes 3 s after the first chunk was sent: the body is buffered, not streamed"
    );
    assert_eq!(r.status, 200, "{r}");
    let mut expected = first.to_vec();
    expected.extend_from_slice(&second);
    assert_eq!(r.body.len(), expected.len());
    assert!(r.body == expected, "echoed stream differs");
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_are_stripped_both_ways() {
    let origin = TestOrigin::start().await;
    serve_hop(&origin, &[("x-end-to-end", "kept")]);
    let cg = CgConfig::new(&origin).start().await;
    let r = post_hop(cg.addr(), &[("x-end-to-end", "kept")]).await;
    assert_eq!(r.status, 200, "{r}");
    assert_eq!(r.body, "hello");

    let seen = origin.last_request("/hop").expect("seen");
    for name in hop_names(&HOP_REQUEST) {
        assert_eq!(
            seen.header(name),
            None,
            "hop-by-hop request header {name} reached the origin"
        );
    }
    if let Some(c) = seen.header("connection") {
        assert!(
            !c.to_ascii_lowercase().contains("x-hop"),
            "client's Connection forwarded: {c}"
        );
    }
    assert_eq!(seen.header("x-end-to-end").as_deref(), Some("kept"));

    for name in hop_names(&HOP_RESPONSE) {
        assert_eq!(
            r.header(name),
            None,
            "hop-by-hop response header {name} reached the client"
        );
    }
    if let Some(c) = r.header("connection") {
        assert!(
            !c.to_ascii_lowercase().contains("x-resp-hop"),
            "origin's Connection passed back: {c}"
        );
    }
    assert_eq!(r.header("x-end-to-end").as_deref(), Some("kept"));
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_error_statuses_pass_through() {
    let origin = TestOrigin::start().await;
    for (path, status) in [
        ("/p/404", 404u16),
        ("/p/418", 418),
        ("/p/500", 500),
        ("/p/503", 503),
    ] {
        origin.set_status(path, status);
        origin.set_body(path, format!("origin says {status}"));
    }
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    for (path, status) in [
        ("/p/404", 404u16),
        ("/p/418", 418),
        ("/p/500", 500),
        ("/p/503", 503),
    ] {
        let r = client.get(&url(cg.addr(), path)).await;
        assert_eq!(r.status, status, "{path}: {r}");
        assert_eq!(
            r.text(),
            format!("origin says {status}"),
            "{path}: origin body replaced"
        );
    }
    cg.shutdown().await;
}

/// An upload is bounded by its pauses (`upstream.upload_timeout`), not by
/// `upstream.timeout`, which counts from the end of the body: a 2.4 MiB PUT that keeps
/// moving for 2.4 s goes through whole with `upstream.timeout` at 1 s, and one that stalls
/// gets 408 about `upload_timeout` after its last piece. On an unrouted path and on a write
/// route. Before, `upstream.timeout` bounded the whole exchange: the slow PUT got 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_is_bounded_by_its_pauses_not_by_the_origin_timeout() {
    const CHUNK: usize = 100 * 1024;
    const CHUNKS: usize = 24;
    let origin = TestOrigin::start().await;
    let routes = format!(
        "{}{}",
        common::ITEM_ROUTE,
        common::route(
            "item-write",
            "/api/items/{id}",
            "PUT",
            "invalidate = [\"/api/items/{id}\"]"
        )
    );
    let cg = CgConfig::new(&origin)
        .set("upstream", "timeout", "\"1s\"")
        .set("upstream", "upload_timeout", "\"800ms\"")
        .routes(&routes)
        .start()
        .await;
    let client = HttpClient::new();
    for path in ["/upload/slow", "/api/items/slow"] {
        let (tx, body) = channel_body();
        let feeder = tokio::spawn(async move {
            for _ in 0..CHUNKS {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if tx.send(Bytes::from(vec![b'u'; CHUNK])).await.is_err() {
                    return;
                }
            }
        });
        let answer = client
            .request(Method::PUT, &url(cg.addr(), path), &[], body)
            .await
            .expect("an answer");
        feeder.await.expect("feeder");
        assert_eq!(answer.status, 200, "{path}: {answer}");
        assert_eq!(
            origin.body_bytes_received(path),
            (CHUNK * CHUNKS) as u64,
            "{path}: the origin did not get the whole body"
        );

        let (tx, body) = channel_body();
        let stalled_path = format!("{path}-stalled");
        let started = tokio::time::Instant::now();
        let answer = {
            let target = url(cg.addr(), &stalled_path);
            let request = client.request(Method::PUT, &target, &[], body);
            tx.send(Bytes::from(vec![b'u'; CHUNK]))
                .await
                .expect("first piece");
            // The client keeps its connection and sends nothing more.
            let answer = request.await.expect("an answer");
            drop(tx);
            answer
        };
        let took = started.elapsed();
        assert_eq!(answer.status, 408, "{stalled_path}: {answer}");
        assert!(
            took >= Duration::from_millis(700) && took < Duration::from_secs(5),
            "{stalled_path}: answered after {took:?}"
        );
    }
}

/// A pass-through GET whose pooled connection a middlebox dropped (it ends, unanswered, at
/// the request's first bytes) is sent once more on a new connection, as for cached fetches:
/// eight warm keep-alive connections dropped before a burst of eight GETs on an unrouted
/// path, and all eight answer 200; the retries are counted. Before, 8 of 8 got 502.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passthrough_get_whose_pooled_connection_was_dropped_is_retried_once() {
    let origin = TestOrigin::start().await;
    origin.set_default_delay(Duration::from_millis(100));
    let middlebox = common::TcpProxy::start(origin.addr()).await;
    let cg = CgConfig::with_upstream(&format!("http://{}", middlebox.addr()))
        .start()
        .await;
    let client = HttpClient::new();
    let addr = cg.addr();
    let eight = |name: &'static str| {
        let client = client.clone();
        common::concurrently(8, Duration::from_secs(10), move |i| {
            let client = client.clone();
            async move { client.get(&url(addr, &format!("/other/{name}-{i}"))).await }
        })
    };
    let warm = eight("warm").await;
    assert!(warm.iter().all(|r| r.status == 200), "{warm:?}");
    middlebox.drop_open_on_next_request();
    let burst = eight("burst").await;
    let statuses: Vec<u16> = burst.iter().map(|r| r.status.as_u16()).collect();
    assert_eq!(statuses, vec![200; 8], "{burst:?}");
    let retries = common::metric(
        &client,
        cg.admin_addr(),
        "cacheguard_origin_retries_total",
        &[("route", "_passthrough")],
    )
    .await;
    assert!(retries >= 1.0, "{retries} retries counted");
    cg.shutdown().await;
}
