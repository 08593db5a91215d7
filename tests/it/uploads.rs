//! Request bodies as cacheguard reads them: bounded in time (a pause, a minimum rate, a
//! total deadline) and in memory (a write's body beyond `server.body_buffer_bytes` waits in
//! an anonymous temporary file, not in RAM), on write routes and on pass-through.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::common;
use crate::common::{
    CgConfig, HttpClient, RedisServer, TestOrigin, item_write_routes, status_of, url,
};

/// What a trickling client saw: the answer's bytes, when its head came (from the first
/// byte sent), and whether the server closed the connection within 3 s after it.
struct Trickled {
    answer: String,
    answered_after: Option<Duration>,
    closed: bool,
}

/// Sends `head` with `Content-Length: 1048576`, then 1 KiB of body per second (512 bytes
/// every half second, the first at once), until the server answers (or `wait` passes).
async fn trickle(addr: SocketAddr, head: &str, wait: Duration) -> Trickled {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut read, mut write) = stream.into_split();
    let head = format!("{head}Content-Length: 1048576\r\n\r\n");
    write.write_all(head.as_bytes()).await.expect("head");
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        let half = [b'x'; 512];
        for _ in 0..2048 {
            if write.write_all(&half).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let mut answered_after = None;
    let mut closed = false;
    let deadline = started + wait;
    loop {
        let limit = match answered_after {
            // Once answered, the connection must close soon.
            Some(at) => {
                (started + at + Duration::from_secs(3)).min(deadline + Duration::from_secs(3))
            }
            None => deadline,
        };
        match tokio::time::timeout_at(limit, read.read(&mut buf)).await {
            Err(_) => break,
            Ok(Ok(0) | Err(_)) => {
                closed = true;
                break;
            }
            Ok(Ok(n)) => {
                out.extend_from_slice(&buf[..n]);
                if answered_after.is_none() && out.windows(4).any(|w| w == b"\r\n\r\n") {
                    answered_after = Some(started.elapsed());
                }
            }
        }
    }
    sender.abort();
    Trickled {
        answer: String::from_utf8_lossy(&out).into_owned(),
        answered_after,
        closed: closed && answered_after.is_some(),
    }
}

/// A body sent slowly but steadily (1 KiB/s of a declared 1 MiB) is answered 408 once it
/// falls behind `upstream.upload_min_rate` (after the `upload_timeout` grace) or runs past
/// `upstream.upload_deadline`, with `Connection: close`, and the connection is closed: on a
/// write route before anything reaches the origin or is invalidated, and on pass-through
/// (streamed) by ending the origin request. Each is counted under its reason. Before, only
/// a body that paused for `upload_timeout` was ended: this one held its connection (and a
/// write its 1 MiB reservation) for 17 minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_upload_is_answered_408_within_its_bounds() {
    let origin = TestOrigin::start().await;
    let client = HttpClient::new();
    // Rate: 1 s of grace, then 4 KiB/s: a 1 KiB/s body falls behind after about 1.7 s.
    // Deadline: 2 s in all, whatever the rate.
    for (bound, min_rate, deadline, reason) in [
        ("rate", "4096", "\"30s\"", "upload_too_slow"),
        ("deadline", "0", "\"2s\"", "upload_deadline"),
    ] {
        let cg = CgConfig::new(&origin)
            .routes(&item_write_routes())
            .set("upstream", "upload_timeout", "\"1s\"")
            .set("upstream", "upload_min_rate", min_rate)
            .set("upstream", "upload_deadline", deadline)
            .start()
            .await;
        for path in [
            format!("/api/items/trickle-{bound}"),
            format!("/other/trickle-{bound}"),
        ] {
            let written = path.starts_with("/api/");
            if written {
                assert_eq!(client.get(&url(cg.addr(), &path)).await.status, 200);
            }
            let method = if written { "PUT" } else { "POST" };
            let head = format!("{method} {path} HTTP/1.1\r\nHost: a.example\r\n");
            let seen = trickle(cg.addr(), &head, Duration::from_secs(8)).await;
            assert_eq!(status_of(&seen.answer), 408, "{path}: {:?}", seen.answer);
            let after = seen.answered_after.expect("answered");
            assert!(
                after >= Duration::from_millis(1200) && after < Duration::from_secs(5),
                "{path}: answered after {after:?}"
            );
            assert!(
                seen.answer
                    .to_ascii_lowercase()
                    .contains("\r\nconnection: close\r\n"),
                "{path}: {:?}",
                seen.answer
            );
            assert!(seen.closed, "{path}: the connection stayed open");
            if written {
                assert_eq!(origin.count(&path), 1, "{path}: the PUT reached the origin");
                let again = client.get(&url(cg.addr(), &path)).await;
                assert!(again.is_hit(), "{path}: invalidated: {again}");
            }
        }
        let counted = common::metric(
            &client,
            cg.admin_addr(),
            "cacheguard_rejected_requests_total",
            &[("reason", reason)],
        )
        .await;
        assert_eq!(
            counted, 2.0,
            "{bound}: rejected_requests{{reason={reason}}}"
        );
        cg.shutdown().await;
    }
}

/// The current resident set of process `pid`, in bytes (`VmRSS` of `/proc/<pid>/status`).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// The unlinked files in `dir` that process `pid` holds open (a spooled body shows as
/// `<dir>/#<inode> (deleted)`).
fn open_files_in(pid: u32, dir: &Path) -> usize {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    fds.filter_map(Result::ok)
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter(|target| {
            target.starts_with(dir) && target.to_string_lossy().ends_with(" (deleted)")
        })
        .count()
}

/// A request body of `len` bytes in 64 KiB chunks, made as it is sent (the test process
/// never holds it).
fn generated_body(len: u64) -> http_body_util::combinators::UnsyncBoxBody<Bytes, std::io::Error> {
    const CHUNK: u64 = 64 * 1024;
    let chunk = Bytes::from(vec![b'u'; CHUNK as usize]);
    let stream = futures_util::stream::iter((0..len.div_ceil(CHUNK)).map(move |i| {
        let size = CHUNK.min(len - i * CHUNK) as usize;
        Ok::<_, std::io::Error>(Frame::data(chunk.slice(..size)))
    }));
    http_body_util::StreamBody::new(stream).boxed_unsync()
}

/// `PUT path` with a generated body of `len` bytes and `Content-Length`, on a connection
/// of its own; the status, or what went wrong.
async fn put_generated(addr: SocketAddr, path: &str, len: u64) -> Result<u16, String> {
    let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    let conn = tokio::spawn(conn);
    let request = http::Request::put(path)
        .header("host", "a.example")
        .header("content-length", len.to_string())
        .body(generated_body(len))
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = response.status().as_u16();
    let _ = response.into_body().collect().await;
    conn.abort();
    Ok(status)
}

/// A 200 MiB `PUT` to a write route costs the cacheguard process less than 16 MiB of RSS:
/// beyond `server.body_buffer_bytes` the body waits in an anonymous temporary file (in the
/// default `server.body_spool_dir`, the system's temporary directory), and is then
/// forwarded from it, whole, with its `Content-Length`. The file is gone once the write is
/// answered. Before, the body was read whole into memory (+200 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200_mib_upload_costs_under_16_mib_of_rss() {
    const LEN: u64 = 200 << 20;
    let origin = TestOrigin::start().await;
    origin.set_discard_body("/api/items/big");
    origin.set_discard_body("/api/items/warm");
    let dir = tempfile::tempdir().expect("tempdir");
    let spool = std::env::temp_dir();
    let config = CgConfig::new(&origin)
        .on_free_ports()
        .routes(&item_write_routes())
        .set("server", "max_body_bytes", &(LEN + 1024).to_string())
        .write_to(&dir.path().join("cacheguard.toml"));
    let cg = common::spawn_cacheguard_process(&config).await;
    let pid = cg.pid().expect("running");
    // Warm: the connection machinery and the allocator's arenas, with a spooled body.
    assert_eq!(
        put_generated(cg.addr(), "/api/items/warm", 4 << 20).await,
        Ok(200)
    );
    let baseline = rss_bytes(pid);
    assert!(baseline > 0, "no VmRSS for {pid}");

    let watching = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let watching = std::sync::Arc::clone(&watching);
        let spool = spool.clone();
        tokio::spawn(async move {
            let (mut peak, mut spooled) = (0, 0);
            while watching.load(std::sync::atomic::Ordering::Relaxed) {
                peak = rss_bytes(pid).max(peak);
                spooled = open_files_in(pid, &spool).max(spooled);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (peak, spooled)
        })
    };
    let answered = tokio::time::timeout(
        Duration::from_secs(120),
        put_generated(cg.addr(), "/api/items/big", LEN),
    )
    .await
    .expect("the upload was answered within 120 s");
    watching.store(false, std::sync::atomic::Ordering::Relaxed);
    let (peak, spooled) = sampler.await.expect("sampler");
    assert_eq!(answered, Ok(200), "{}", cg.output());
    assert_eq!(origin.body_bytes_received("/api/items/big"), LEN);
    let forwarded = origin.last_request("/api/items/big").expect("forwarded");
    assert_eq!(forwarded.header("content-length"), Some(LEN.to_string()));
    let growth = peak.saturating_sub(baseline);
    println!(
        "200 MiB upload: RSS {} KiB before, {} KiB at peak (+{} KiB)",
        baseline >> 10,
        peak >> 10,
        growth >> 10
    );
    assert!(
        growth < 16 << 20,
        "RSS grew {} KiB during a 200 MiB upload (baseline {} KiB, peak {} KiB)",
        growth >> 10,
        baseline >> 10,
        peak >> 10
    );
    assert_eq!(
        spooled,
        1,
        "the body was not spooled to {}",
        spool.display()
    );
    assert_eq!(
        open_files_in(pid, &spool),
        0,
        "the spool file is still open"
    );
}

/// Bytes `0..len` of a recognisable pattern (so a reordered or cut body shows).
fn pattern(len: usize) -> Bytes {
    (0..len)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<u8>>()
        .into()
}

/// A write body over `server.body_buffer_bytes` — with `Content-Length`, and chunked — is
/// spooled and reaches the origin whole, in order, with its length as `Content-Length`; the
/// write invalidates as before; the spool file is closed once answered. In embedded and
/// shared mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spooled_write_reaches_the_origin_whole_and_invalidates() {
    let origin = TestOrigin::start().await;
    let redis = RedisServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let body = pattern(3 << 20);
    for (mode, cfg) in [
        ("embedded", CgConfig::new(&origin)),
        ("shared", CgConfig::new(&origin).redis(&redis)),
    ] {
        let cg = cfg
            .routes(&item_write_routes())
            .set("server", "body_buffer_bytes", "65536")
            .set_str(
                "server",
                "body_spool_dir",
                &dir.path().display().to_string(),
            )
            .start()
            .await;
        let client = HttpClient::new();
        for framing in ["length", "chunked"] {
            let path = format!("/api/items/spool-{mode}-{framing}");
            origin.set_echo(&path);
            assert_eq!(client.get(&url(cg.addr(), &path)).await.status, 200);
            assert!(client.get(&url(cg.addr(), &path)).await.is_hit());
            let sent = if framing == "length" {
                common::client::full_body(body.clone())
            } else {
                let (tx, sent) = common::client::channel_body();
                let body = body.clone();
                tokio::spawn(async move {
                    for start in (0..body.len()).step_by(100_000) {
                        let end = (start + 100_000).min(body.len());
                        if tx.send(body.slice(start..end)).await.is_err() {
                            break;
                        }
                    }
                });
                sent
            };
            let answer = client
                .request(http::Method::PUT, &url(cg.addr(), &path), &[], sent)
                .await
                .expect("answer");
            assert_eq!(answer.status, 200, "{mode} {framing}: {answer}");
            assert!(
                answer.body == body,
                "{mode} {framing}: the body came back changed"
            );
            let seen = origin.last_request(&path).expect("forwarded");
            assert_eq!(
                seen.header("content-length"),
                Some(body.len().to_string()),
                "{mode} {framing}"
            );
            assert_eq!(seen.header("transfer-encoding"), None, "{mode} {framing}");
            let after = client.get(&url(cg.addr(), &path)).await;
            assert!(
                !after.is_hit(),
                "{mode} {framing}: not invalidated: {after}"
            );
            assert_eq!(open_files_in(std::process::id(), dir.path()), 0);
        }
        cg.shutdown().await;
    }
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
}

/// Waits (at most 5 s) until this process has `n` files open in `dir`.
async fn wait_open_files(dir: &Path, n: usize) -> bool {
    common::poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        || async { (open_files_in(std::process::id(), dir) == n).then_some(()) },
    )
    .await
    .is_some()
}

/// The spool file of a write goes away whoever ends the exchange: a client that hangs up
/// in the middle of its body, and an origin that closes the connection while the spooled
/// body is forwarded (answered 502). Nothing is left in the spool directory, which holds
/// only unlinked files anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spool_file_is_closed_when_the_client_or_the_origin_aborts() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let spool = |cfg: CgConfig| {
        cfg.routes(&item_write_routes())
            .set("server", "body_buffer_bytes", "65536")
            .set_str(
                "server",
                "body_spool_dir",
                &dir.path().display().to_string(),
            )
    };
    // The client goes away after 1 MiB of 4.
    let cg = spool(CgConfig::new(&origin)).start().await;
    let mut stream = TcpStream::connect(cg.addr()).await.expect("connect");
    let head = "PUT /api/items/gone HTTP/1.1\r\nHost: a.example\r\nContent-Length: 4194304\r\n\r\n";
    stream.write_all(head.as_bytes()).await.expect("head");
    stream.write_all(&vec![b'g'; 1 << 20]).await.expect("body");
    assert!(
        wait_open_files(dir.path(), 1).await,
        "the body was not spooled"
    );
    drop(stream);
    assert!(
        wait_open_files(dir.path(), 0).await,
        "the spool file stayed open"
    );
    assert_eq!(origin.count("/api/items/gone"), 0);
    cg.shutdown().await;

    // The origin reads 1 MiB of the forwarded body, then closes.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let cut_origin = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut read = 0;
                while read < 1 << 20 {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => read += n,
                    }
                }
            });
        }
    });
    let cg = spool(CgConfig::with_upstream(&format!("http://{cut_origin}")))
        .start()
        .await;
    let status = put_generated(cg.addr(), "/api/items/cut", 8 << 20).await;
    assert_eq!(status, Ok(502));
    assert!(
        wait_open_files(dir.path(), 0).await,
        "the spool file stayed open"
    );
    cg.shutdown().await;
    task.abort();
    assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
}
