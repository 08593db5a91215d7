//! Readers of one large L2 entry share one buffer, however many there are. It measures a child
//! cacheguard's resident memory, which nothing else runs in.

use std::time::Duration;

use bytes::Bytes;

use crate::common::hot::status_bytes;
use crate::common::{
    CacheguardProcess, CgConfig, HttpClient, RedisServer, TestOrigin, concurrently, item_route,
    metric, poll_until, spawn_cacheguard_process, stalled_get, url,
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

        let StalledChild {
            child,
            pid,
            rss_before,
            stalled,
            _dir,
        } = stalled_child(&config, &client, &path, l1).await;
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

/// A cacheguard of its own (a child process, which nothing else runs in) and a client of
/// it that asked for a large entry and reads nothing.
struct StalledChild {
    child: CacheguardProcess,
    pid: String,
    /// The child's resident memory before the stalled request.
    rss_before: u64,
    stalled: tokio::net::TcpStream,
    _dir: tempfile::TempDir,
}

/// Starts a child cacheguard from `config`, warms it on a small entry (its connections
/// made, its allocator warm), then asks it for `path` from a client that reads nothing,
/// and waits until that request has its answer.
async fn stalled_child(
    config: &CgConfig,
    client: &HttpClient,
    path: &str,
    what: &str,
) -> StalledChild {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = config
        .clone()
        .on_free_ports()
        .write_to(&dir.path().join("cg.toml"));
    let child = spawn_cacheguard_process(&file).await;
    let pid = child.pid().expect("child pid").to_string();
    for _ in 0..2 {
        let r = client.get(&url(child.addr(), "/api/items/small")).await;
        assert_eq!(r.status, 200, "{what}: {r}");
    }
    let answered = || metric(client, child.admin_addr(), "cacheguard_requests_total", &[]);
    let before_stall = answered().await;
    let rss_before = status_bytes(&pid, "VmRSS:");
    let stalled = stalled_get(child.addr(), path).await;
    let head_sent = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async { (answered().await > before_stall).then_some(()) },
    )
    .await;
    assert!(
        head_sent.is_some(),
        "{what}: the stalled reader got no answer"
    );
    StalledChild {
        child,
        pid,
        rss_before,
        stalled,
        _dir: dir,
    }
}

/// `GET path` on a connection of its own, its answer compared with `body` as it arrives
/// and not kept, so that many readers of a large body cost the test little: the answer's
/// `X-Cache` (lower case), or why it was not a 200 with the whole body.
async fn get_streamed(
    addr: std::net::SocketAddr,
    path: &str,
    body: &[u8],
) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: cacheguard\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("send: {e}"))?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut head = Vec::new();
    let mut x_cache = None;
    let mut at = 0;
    loop {
        let n = stream
            .read(&mut buf)
            .await
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            break;
        }
        let mut bytes = &buf[..n];
        if x_cache.is_none() {
            head.extend_from_slice(bytes);
            let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let text = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
            if !text.starts_with("http/1.1 200 ") {
                return Err(format!("answered {text:?}"));
            }
            let found = text.lines().find_map(|l| l.strip_prefix("x-cache: "));
            x_cache = Some(found.unwrap_or_default().to_owned());
            bytes = &head[end + 4..];
        }
        if body.get(at..at + bytes.len()) != Some(bytes) {
            return Err(format!("the body differs from byte {at} on"));
        }
        at += bytes.len();
    }
    if at != body.len() {
        return Err(format!("{at} of {} bytes", body.len()));
    }
    x_cache.ok_or_else(|| "no head".to_owned())
}

/// One 50 MiB entry in Redis, one client that asked for it and reads nothing, then 100
/// clients reading it at once, in a cacheguard of its own: the entry is in memory once,
/// however many read it. The process's peak resident memory grows by one copy, plus
/// [`READ_CONSTANT`] for reading it from Redis, plus [`PER_CONNECTION`] per reader: never a
/// copy of the value per reader, nor the 256 KiB of a reader's first read held for its
/// answer (100 of those would be 25 MiB).
///
/// Neither allowance grows with the entry (seen with the stalled reader alone: +1.4 MiB for
/// a 200 KiB entry, +4.1 MiB for 2 MiB, +14.6 MiB for 10 MiB, +55.2 MiB for 50 MiB, +105.1
/// MiB for 100 MiB; 100 readers then add +3.4 MiB beside a 200 KiB entry, +4.3 MiB beside
/// a 10 or a 50 MiB one, and a second and third round of them +1 MiB in all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_readers_of_a_50_mib_entry_beside_a_stalled_one_cost_one_copy() {
    /// Reading one large value from Redis, whatever its size: the bulk connection's read
    /// buffer (a 1 MiB piece), the per-thread connections' buffers (a 256 KiB first read
    /// each), and what the allocator keeps of the pieces freed (about 2 MiB of the 5 seen:
    /// with a fixed `MALLOC_MMAP_THRESHOLD_`, +3.4 MiB).
    const READ_CONSTANT: u64 = 8 * MIB;
    /// One reader's connection, task and hyper buffers, kept by the allocator once freed
    /// (seen: 34 to 43 KiB).
    const PER_CONNECTION: u64 = 64 * 1024;
    const BIG: usize = 50 * MIB as usize;
    const READERS: usize = 100;
    let _heavy = crate::common::heavy().await;
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let body = Bytes::from((0..BIG).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let client = HttpClient::new();
    let path = "/api/items/big".to_owned();
    origin.set_body(&path, body.clone());
    let config = CgConfig::new(&origin)
        .redis(&redis)
        .set("server", "worker_threads", "2")
        .set_str("redis", "command_timeout", "2s")
        .l1("off")
        .routes(&item_route(&format!("max_entry_bytes = {}", 64 * MIB)));
    let filler = config.start().await;
    get_streamed(filler.addr(), &path, &body)
        .await
        .expect("the fill");
    filler.shutdown().await;

    let StalledChild {
        child,
        pid,
        rss_before,
        stalled,
        _dir,
    } = stalled_child(&config, &client, &path, "l1 off").await;
    let rss_stalled = status_bytes(&pid, "VmRSS:");

    let addr = child.addr();
    let answers = concurrently(READERS, Duration::from_secs(120), |_| {
        let (path, body) = (path.clone(), body.clone());
        async move { get_streamed(addr, &path, &body).await }
    })
    .await;
    for (i, answer) in answers.iter().enumerate() {
        match answer {
            Ok(x_cache) => assert_eq!(x_cache, "hit-l2", "reader {i}"),
            Err(error) => panic!("reader {i}: {error}"),
        }
    }
    let peak = status_bytes(&pid, "VmHWM:");
    let mib = |bytes: u64| bytes as f64 / MIB as f64;
    eprintln!(
        "RSS {:.1} MiB, with the stalled reader {:.1} MiB, peak with {READERS} readers {:.1} MiB",
        mib(rss_before),
        mib(rss_stalled),
        mib(peak)
    );
    let readers = READERS as u64 * PER_CONNECTION;
    let growth = peak.saturating_sub(rss_before);
    assert!(
        growth <= BIG as u64 + READ_CONSTANT + readers,
        "the peak RSS grew by {:.1} MiB: more than one copy of the {} MiB entry, {:.0} MiB \
         to read it and {:.1} MiB for {READERS} connections",
        mib(growth),
        BIG as u64 / MIB,
        mib(READ_CONSTANT),
        mib(readers)
    );
    let by_readers = peak.saturating_sub(rss_stalled);
    assert!(
        by_readers <= readers,
        "{READERS} readers grew the peak RSS by {:.1} MiB, over {:.0} KiB each",
        mib(by_readers),
        PER_CONNECTION as f64 / 1024.0
    );
    drop(stalled);
    drop(child);
}
