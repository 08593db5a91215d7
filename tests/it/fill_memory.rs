//! Large answers buffered for slow clients cost a bounded amount of memory. It measures this
//! process's peak RSS, which any other test running beside it would move too: it runs in a
//! process of its own ([`common::in_own_process`]).

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;
use tokio::time::Instant;

use crate::common;
use crate::common::hot::{peak_rss_bytes, rss_bytes};
use crate::common::{CgConfig, HttpClient, RedisServer, TestOrigin, item_route, metric};

const MIB: u64 = 1024 * 1024;
const KEYS: usize = 200;
const BODY: usize = 4 * MIB as usize;
/// `upstream.max_buffered_bytes` of the runs below.
const BUDGET: u64 = 48 * MIB;
/// The route's `max_entry_bytes`.
const MAX_ENTRY: u64 = 8 * MIB;
/// Shared mode writes one large value at a time, whose copies (encoded, in the command,
/// packed for the socket) live while it is written: about four of its size.
const LARGE_WRITE: u64 = 4 * MAX_ENTRY;
/// The origin's and hyper's buffers (the origin runs in this process too), allocator
/// slack. glibc's per-thread arenas keep freed blocks: on one 2-core machine the same code
/// peaked 30 MiB higher than on another, so the margin is generous; what this test catches
/// is buffering that is not bounded at all (200 answers of 4 MiB: 800 MiB).
const MARGIN: u64 = 64 * MIB;

/// Resets the peak to the current resident memory (`/proc/PID/clear_refs`, value 5).
fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5").expect("reset VmHWM");
}

/// One client that asks for `path` at once but reads nothing before `read_at`, through a
/// 16 KiB receive buffer (so what it has not read stays in the proxy, not in the kernel),
/// then reads and discards the answer. Returns the status line and the bytes read.
async fn slow_client(addr: std::net::SocketAddr, path: String, read_at: Instant) -> (String, u64) {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(16 * 1024).expect("SO_RCVBUF");
    let mut stream = socket.connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: cacheguard\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    tokio::time::sleep_until(read_at).await;
    let mut buf = vec![0u8; 64 * 1024];
    let mut first = Vec::new();
    let mut total = 0u64;
    loop {
        let n = stream.read(&mut buf).await.expect("read");
        if n == 0 {
            break;
        }
        if first.len() < 64 {
            first.extend_from_slice(&buf[..n.min(64)]);
        }
        total += n as u64;
    }
    let status = String::from_utf8_lossy(&first)
        .lines()
        .next()
        .unwrap_or("")
        .to_string();
    (status, total)
}

/// 200 concurrent misses of distinct 4 MiB answers through 16 origin slots, to clients that
/// read nothing for the first seconds: unbounded, every answer is buffered at once (peak
/// RSS +840 MiB here). With `max_buffered_bytes` at 48 MiB the process's peak RSS grows by
/// no more than that, one large write's copies in shared mode, and a working margin (seen:
/// +75 MiB embedded, +102 to +112 MiB shared); every client still gets its whole answer,
/// and the reservation drains to 0 once all are sent. Embedded and shared mode (whose fill
/// also sends a copy to Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_in_flight_stay_within_max_buffered_bytes() {
    let test = "answers_in_flight_stay_within_max_buffered_bytes";
    if common::in_own_process(module_path!(), test).await {
        return;
    }
    let body = Bytes::from(vec![b'x'; BODY]);
    let origin = TestOrigin::start().await;
    for i in 0..KEYS {
        origin.set_body(&format!("/api/items/{i}"), body.clone());
    }
    let redis = RedisServer::start().await;
    for shared in [false, true] {
        let mode = if shared { "shared" } else { "embedded" };
        let mut config = CgConfig::new(&origin)
            .set("upstream", "max_concurrency", "16")
            .set("upstream", "max_buffered_bytes", &BUDGET.to_string())
            .set("upstream", "queue_timeout", "\"60s\"")
            .set("upstream", "timeout", "\"60s\"")
            .set("server", "header_read_timeout", "\"60s\"")
            .l1("off")
            .routes(&item_route(&format!("max_entry_bytes = {MAX_ENTRY}")));
        if shared {
            config = config
                .redis(&redis)
                .set("redis", "command_timeout", "\"5s\"");
        }
        let cg = config.start().await;
        let prefix = if shared { "s" } else { "e" };
        let before = origin.total();

        let rss_before = rss_bytes();
        reset_peak();
        let read_at = Instant::now() + Duration::from_secs(3);
        let clients: Vec<_> = (0..KEYS)
            .map(|i| {
                let path = format!("/api/items/{i}?{prefix}");
                tokio::spawn(slow_client(cg.addr(), path, read_at))
            })
            .collect();
        for (i, client) in clients.into_iter().enumerate() {
            let (status, bytes) = tokio::time::timeout(Duration::from_secs(120), client)
                .await
                .unwrap_or_else(|_| panic!("{mode}: client {i} took over 120 s"))
                .expect("client task");
            assert!(
                status.contains(" 200 "),
                "{mode}: client {i} got {status:?}"
            );
            assert!(bytes > BODY as u64, "{mode}: client {i} read {bytes} bytes");
        }
        let growth = peak_rss_bytes().saturating_sub(rss_before);
        eprintln!("{mode}: peak RSS grew by {} MiB", growth / MIB);

        assert_eq!(origin.total() - before, KEYS as u64, "{mode}");
        assert!(
            growth <= BUDGET + LARGE_WRITE + MARGIN,
            "{mode}: peak RSS grew by {} MiB with max_buffered_bytes at {} MiB",
            growth / MIB,
            BUDGET / MIB
        );
        let client = HttpClient::new();
        let held = metric(
            &client,
            cg.admin_addr(),
            "cacheguard_origin_buffered_bytes",
            &[],
        )
        .await;
        assert_eq!(held, 0.0, "{mode}: answers all sent, yet {held} bytes held");
        cg.shutdown().await;
    }
}
