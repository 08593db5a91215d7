//! Limits and error mapping: 431 for an oversized head, 413 for an oversized body, 504 on
//! origin timeout, 502 when the origin is unreachable, and the origin guard (503 +
//! `Retry-After` when no slot is free within `queue_timeout`). Big entries pass uncached.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use tokio::time::Instant;

use crate::common;
use crate::common::client::{TestBody, channel_body, full_body};
use crate::common::{CgConfig, HttpClient, Resp, TestOrigin, concurrently, free_port, url};

fn assert_short_text_body(r: &Resp, what: &str) {
    assert!(!r.body.is_empty(), "{what}: empty error body");
    assert!(
        r.body.len() < 1024,
        "{what}: error body is not short: {} bytes",
        r.body.len()
    );
    assert!(
        std::str::from_utf8(&r.body).is_ok(),
        "{what}: error body is not text"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_head_gets_431() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set("server", "max_header_bytes", "8192")
        .start()
        .await;
    let client = HttpClient::new();
    let big = "a".repeat(16 * 1024);
    for path in ["/api/items/1", "/unmatched"] {
        let r = client
            .get_with_headers(&url(cg.addr(), path), &[("x-big", big.as_str())])
            .await;
        assert_eq!(r.status, 431, "{path}: {r}");
        assert_short_text_body(&r, "431");
    }
    // Many medium headers adding up past the limit count too.
    let medium = "b".repeat(1000);
    let headers: Vec<(String, &str)> = (0..16)
        .map(|i| (format!("x-h{i}"), medium.as_str()))
        .collect();
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let r = client
        .get_with_headers(&url(cg.addr(), "/api/items/2"), &headers)
        .await;
    assert_eq!(r.status, 431, "16 x 1000-byte headers: {r}");
    // A head well under the limit is fine.
    let small = "c".repeat(2000);
    let r = client
        .get_with_headers(
            &url(cg.addr(), "/api/items/3"),
            &[("x-small", small.as_str())],
        )
        .await;
    assert_eq!(r.status, 200, "{r}");
    assert_eq!(origin.total(), 1, "an oversized request reached the origin");
    cg.shutdown().await;
}

/// An origin that echoes `/upload`, behind an instance with `max_body_bytes = 1024`.
async fn upload_behind_1k_limit() -> (TestOrigin, cacheguard::Running) {
    let origin = TestOrigin::start().await;
    origin.set_echo("/upload");
    let cg = CgConfig::new(&origin)
        .set("server", "max_body_bytes", "1024")
        .start()
        .await;
    (origin, cg)
}

/// `POST /upload` with `body` through the instance at `addr`.
async fn upload(client: &HttpClient, addr: SocketAddr, body: TestBody) -> Result<Resp, String> {
    client
        .request(Method::POST, &url(addr, "/upload"), &[], body)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_with_content_length_gets_413() {
    let (origin, cg) = upload_behind_1k_limit().await;
    let client = HttpClient::new();
    let r = upload(&client, cg.addr(), full_body(vec![b'x'; 4096]))
        .await
        .expect("POST");
    assert_eq!(r.status, 413, "{r}");
    assert_short_text_body(&r, "413");
    assert_eq!(
        origin.count("/upload"),
        0,
        "a body declared too large was forwarded"
    );
    // At the limit is fine.
    let r = upload(&client, cg.addr(), full_body(vec![b'y'; 1024]))
        .await
        .expect("POST");
    assert_eq!(r.status, 200, "{r}");
    assert_eq!(r.body.len(), 1024);
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_chunked_body_gets_413() {
    let (origin, cg) = upload_behind_1k_limit().await;
    let client = HttpClient::new();
    let (tx, body) = channel_body();
    // Just over the limit, then the stream stays open (no end, no more bytes). A client that
    // kept blasting could see its next write reset before it reads the 413: hyper closes a
    // connection whose request body it did not read, without a lingering close.
    let feeder = tokio::spawn(async move {
        for _ in 0..2 {
            if tx.send(Bytes::from(vec![b'z'; 1024])).await.is_err() {
                return;
            }
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
        drop(tx);
    });
    let r = upload(&client, cg.addr(), body).await;
    feeder.abort();
    match r {
        Ok(r) => {
            assert_eq!(r.status, 413, "chunked body over a 1 KiB limit: {r}");
        }
        Err(e) => panic!("expected a 413 answer, got a transport error: {e}"),
    }
    assert!(
        origin
            .last_request("/upload")
            .is_none_or(|req| req.body.len() <= 1024),
        "the origin received more than max_body_bytes"
    );
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_timeout_gets_504() {
    let origin = TestOrigin::start().await;
    origin.set_delay("/api/items/slow", Duration::from_secs(3));
    origin.set_delay("/slow-unmatched", Duration::from_secs(3));
    let cg = CgConfig::new(&origin)
        .set_str("upstream", "timeout", "300ms")
        .start()
        .await;
    let client = HttpClient::new();
    for path in ["/api/items/slow", "/slow-unmatched"] {
        let started = Instant::now();
        let r = client.get(&url(cg.addr(), path)).await;
        let took = started.elapsed();
        assert_eq!(r.status, 504, "{path}: {r}");
        assert_short_text_body(&r, "504");
        assert!(
            took < Duration::from_secs(2),
            "{path}: 504 took {took:?} with a 300ms timeout"
        );
    }
    // The timeout is not cached: once the origin is fast again, the key is served.
    origin.reset("/api/items/slow");
    let r = client.get(&url(cg.addr(), "/api/items/slow")).await;
    assert_eq!(r.status, 200, "{r}");
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_origin_gets_502() {
    // A loopback port with nothing listening.
    let dead = format!("http://127.0.0.1:{}", free_port());
    let cg = CgConfig::with_upstream(&dead).start().await;
    let client = HttpClient::new();
    for path in ["/api/items/1", "/unmatched"] {
        let r = client.get(&url(cg.addr(), path)).await;
        assert_eq!(r.status, 502, "{path}: {r}");
        assert_short_text_body(&r, "502");
    }
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_guard_caps_concurrency_and_sheds_with_retry_after() {
    let origin = TestOrigin::builder()
        .delay(Duration::from_millis(500))
        .start()
        .await;
    let cg = CgConfig::new(&origin)
        .set("upstream", "max_concurrency", "4")
        .set_str("upstream", "queue_timeout", "100ms")
        .start()
        .await;
    let client = HttpClient::new();
    let addr = cg.addr();
    let started = Instant::now();
    let results = concurrently(50, Duration::from_secs(20), |i| {
        let client = client.clone();
        async move {
            client
                .try_get(&url(addr, &format!("/api/items/guard-{i}")))
                .await
        }
    })
    .await;
    let took = started.elapsed();
    let mut ok = 0;
    let mut shed = 0;
    for (i, r) in results.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("client {i}: {e}"));
        match r.status.as_u16() {
            200 => ok += 1,
            503 => {
                shed += 1;
                let retry = r.header("retry-after");
                assert!(
                    retry
                        .as_deref()
                        .is_some_and(|v| v.trim().parse::<u64>().is_ok()),
                    "client {i}: 503 without a numeric Retry-After: {retry:?}"
                );
                assert_short_text_body(r, "503");
            }
            _ => panic!("client {i}: expected 200 or 503, got {r}"),
        }
    }
    assert!(
        origin.max_in_flight() <= 4,
        "origin saw {} requests in flight with max_concurrency = 4",
        origin.max_in_flight()
    );
    assert!(ok >= 1, "no request got through the guard");
    assert!(
        shed >= 1,
        "50 concurrent 500ms misses with 4 slots and a 100ms queue shed nothing"
    );
    assert_eq!(
        origin.total(),
        ok,
        "shed requests must never reach the origin ({ok} answered 200, origin saw {})",
        origin.total()
    );
    // 4 slots × 500 ms, queue 100 ms: shedding must be quick, not a 50 × 500 ms queue.
    assert!(took < Duration::from_secs(5), "50 requests took {took:?}");
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_over_max_entry_bytes_is_passed_through_uncached() {
    let origin = TestOrigin::start().await;
    let big = "x".repeat(4096);
    origin.set_body("/api/items/big", big.clone());
    let cg = CgConfig::new(&origin)
        .set("cache", "max_entry_bytes", "1024")
        .start()
        .await;
    let client = HttpClient::new();
    let u = url(cg.addr(), "/api/items/big");
    for i in 1..=2u64 {
        let r = client.get(&u).await;
        assert_eq!(r.status, 200, "#{i}: {r}");
        assert_eq!(r.body.len(), big.len(), "#{i}: body truncated");
        assert!(
            !r.is_hit(),
            "#{i}: an entry over max_entry_bytes was cached: {r}"
        );
        assert_eq!(origin.count("/api/items/big"), i);
    }
    cg.shutdown().await;
}

/// Opens `n` connections to `addr` that never send a byte.
async fn idle_connections(addr: SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
    }
    conns
}

/// How many of `conns` the server has closed: a read that ends (EOF or reset) within
/// `within`, rather than waiting.
async fn closed_by_server(conns: &mut [tokio::net::TcpStream], within: Duration) -> usize {
    use tokio::io::AsyncReadExt;
    let deadline = Instant::now() + within;
    let mut closed = 0;
    for conn in conns.iter_mut() {
        let mut byte = [0u8; 1];
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = left.max(Duration::from_millis(1));
        if let Ok(read) = tokio::time::timeout(wait, conn.read(&mut byte)).await
            && matches!(read, Ok(0) | Err(_))
        {
            closed += 1;
        }
    }
    closed
}

/// Connections that never send a byte are closed after `header_read_timeout`, counted from
/// accept: 300 of them hold no descriptor past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_send_nothing_are_closed_after_the_header_timeout() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set_str("server", "header_read_timeout", "1s")
        .start()
        .await;
    let mut conns = idle_connections(cg.addr(), 300).await;
    let closed = closed_by_server(&mut conns, Duration::from_secs(4)).await;
    assert_eq!(
        closed, 300,
        "idle connections still open after the header timeout"
    );
    cg.shutdown().await;
}

/// `server.max_connections`: beyond it a new connection is closed at once and counted;
/// those within it are served, and the admin listener answers throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_max_connections_are_closed_and_counted() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set("server", "max_connections", "50")
        .set_str("server", "header_read_timeout", "30s")
        .start()
        .await;
    let client = HttpClient::new();
    let mut held = idle_connections(cg.addr(), 50).await;
    // Let the accept loop count them.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut beyond = idle_connections(cg.addr(), 30).await;
    let closed = closed_by_server(&mut beyond, Duration::from_secs(2)).await;
    assert_eq!(closed, 30, "connections beyond the cap were kept");
    let health = client.get(&url(cg.admin_addr(), "/healthz")).await;
    assert_eq!(health.status, 200, "admin during the flood: {health}");
    let refused = common::metric(
        &client,
        cg.admin_addr(),
        "cacheguard_connections_refused_total",
        &[("listener", "proxy")],
    )
    .await;
    assert!(refused >= 30.0, "{refused} refusals counted");
    assert_eq!(
        closed_by_server(&mut held, Duration::from_millis(200)).await,
        0,
        "connections within the cap were closed"
    );
    drop(held);
    // Room again: a request is served.
    let ok = common::poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            let r = client.try_get(&url(cg.addr(), "/api/items/1")).await.ok()?;
            (r.status == 200).then_some(())
        },
    )
    .await;
    assert!(
        ok.is_some(),
        "no request served once the connections were closed"
    );
    cg.shutdown().await;
}
