//! Readers of one large L2 entry share one buffer, however many there are. It measures a child
//! cacheguard's resident memory, which nothing else runs in.

use std::time::Duration;

use bytes::Bytes;

use crate::common::hot::status_bytes;
use crate::common::{
    CgConfig, HttpClient, RedisServer, TestOrigin, concurrently, item_route, metric, poll_until,
    spawn_cacheguard_process, stalled_get, url,
};

const MIB: u64 = 1024 * 1024;
/// The entry's body: well above the 256 KiB of a first read, so it is read on the bulk path.
const BODY: usize = 10 * MIB as usize;
const READERS: usize = 30;

/// A 10 MiB entry in Redis, one client that asked for it and reads nothing, then 30 clients
/// reading it at once, in a cacheguard of its own (a child process): every answer is the
/// whole body, and the process's peak resident memory grows by less than two copies of it,
/// for each route `l1` policy (seen: +15 to +17 MiB). Before readers shared a buffer, each
/// read of the value was a copy of its own, and the one `GET` that read it left the bulk
/// connection's read buffer at its size: +39 MiB with `l1` off or hot (at times +50), +22
/// MiB with `l1 = "all"` (one read, then L1 hits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_readers_of_a_10_mib_l2_entry_beside_a_stalled_one_hold_under_two_copies() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let body = Bytes::from((0..BODY).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let client = HttpClient::new();
    let mut over = Vec::new();
    for l1 in ["off", "hot", "all"] {
        let path = format!("/api/items/big-{l1}");
        origin.set_body(&path, body.clone());
        // Two proxy threads whatever the machine: each thread's own Redis read connection
        // keeps a buffer of a first read's size (256 KiB) once it has read one.
        let config = CgConfig::new(&origin)
            .redis(&redis)
            .set("server", "worker_threads", "2")
            .set_str("redis", "command_timeout", "2s")
            .l1(l1)
            .routes(&item_route(&format!("max_entry_bytes = {}", 16 * MIB)));

        // Stored through an instance in this process: the child below only reads it.
        let filler = config.start().await;
        let r = client.get(&url(filler.addr(), &path)).await;
        assert_eq!((r.status.as_u16(), r.body.len()), (200, BODY), "{l1}: fill");
        filler.shutdown().await;

        let dir = tempfile::tempdir().expect("tempdir");
        let file = config.on_free_ports().write_to(&dir.path().join("cg.toml"));
        let child = spawn_cacheguard_process(&file).await;
        let pid = child.pid().expect("child pid").to_string();
        // Its connections made and its allocator warm on a small entry first.
        for _ in 0..2 {
            let r = client.get(&url(child.addr(), "/api/items/small")).await;
            assert_eq!(r.status, 200, "{l1}: {r}");
        }
        let answered = || {
            metric(
                &client,
                child.admin_addr(),
                "cacheguard_requests_total",
                &[],
            )
        };
        let before_stall = answered().await;
        let rss_before = status_bytes(&pid, "VmRSS:");

        let stalled = stalled_get(child.addr(), &path).await;
        let head_sent = poll_until(
            Duration::from_secs(10),
            Duration::from_millis(20),
            || async { (answered().await > before_stall).then_some(()) },
        )
        .await;
        assert!(
            head_sent.is_some(),
            "{l1}: the stalled reader got no answer"
        );
        let addr = child.addr();
        let answers = concurrently(READERS, Duration::from_secs(120), |_| {
            let (client, path) = (client.clone(), path.clone());
            async move { client.get(&url(addr, &path)).await }
        })
        .await;
        for (i, r) in answers.iter().enumerate() {
            assert_eq!(r.status, 200, "{l1}: reader {i}: {r}");
            assert!(r.is_hit(), "{l1}: reader {i}: {r}");
            assert!(
                r.body == body,
                "{l1}: reader {i} got {} bytes",
                r.body.len()
            );
        }
        let rss_after = status_bytes(&pid, "VmRSS:");
        // The peak since the child started: before the readers it was about `rss_before`.
        let growth = status_bytes(&pid, "VmHWM:").saturating_sub(rss_before);
        let mib = |bytes: u64| bytes as f64 / MIB as f64;
        eprintln!(
            "l1 = {l1}: RSS {:.1} -> {:.1} MiB, peak +{:.1} MiB",
            mib(rss_before),
            mib(rss_after),
            mib(growth)
        );
        if growth >= 2 * BODY as u64 {
            over.push(format!("l1 = {l1}: +{:.1} MiB", mib(growth)));
        }
        drop(stalled);
        drop(child);
    }
    assert!(
        over.is_empty(),
        "{READERS} readers and a stalled one grew the peak RSS by two copies of the {} MiB \
         entry or more: {over:?}",
        BODY as u64 / MIB
    );
}
