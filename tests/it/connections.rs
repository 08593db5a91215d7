//! The life of a client connection around the answers cacheguard gives early, and between
//! requests, seen from a raw TCP client.
//!
//! - An answer made before the request body is read (sold out from memory, a declared body
//!   over `server.max_body_bytes`, an admin purge without its token) keeps the connection
//!   only when the rest of the body could be discarded at once; otherwise it says
//!   `Connection: close` and the connection is closed gracefully (lingering close): the
//!   client reads the whole answer and then an orderly end of file, never a reset, however
//!   its body arrives (with the head, 50 ms later, after `Expect: 100-continue`, chunked,
//!   larger than anything buffered).
//! - An idle keep-alive connection lives `server.keepalive_timeout`, not
//!   `server.header_read_timeout`; a head that has begun still has only the latter.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{self, CgConfig, HttpClient, RedisServer, TestOrigin, url};

/// How long any one read may take before the test gives up on it.
const READ: Duration = Duration::from_secs(10);

/// How a request's body follows its head.
#[derive(Clone, Copy, Debug)]
enum Timing {
    /// In the same write.
    WithHead,
    /// 50 ms later (a client that writes head and body apart).
    Later,
    /// With `Expect: 100-continue`: the body after `100 Continue`, or after an early final
    /// answer all the same (a client whose body was on its way).
    Expect,
    /// Chunked, its chunks 50 ms later.
    Chunked,
    /// 50 ms later and larger than anything the server buffers of it.
    Large,
}

const TIMINGS: [Timing; 5] = [
    Timing::WithHead,
    Timing::Later,
    Timing::Expect,
    Timing::Chunked,
    Timing::Large,
];

/// An answer as the raw client read it.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    /// Interim `100 Continue` answers seen before it.
    continues: usize,
}

impl Answer {
    fn closes(&self) -> bool {
        self.head
            .lines()
            .any(|line| line.eq_ignore_ascii_case("connection: close"))
    }
}

/// Reads more of `stream` into `pending`; an end of file is an error (`inside` says where).
async fn read_more(stream: &mut TcpStream, pending: &mut Vec<u8>, inside: &str) -> io::Result<()> {
    let mut buf = [0u8; 8192];
    let n = tokio::time::timeout(READ, stream.read(&mut buf))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("no {inside}")))??;
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "end of file inside the answer's {inside}: {:?}",
                String::from_utf8_lossy(pending)
            ),
        ));
    }
    pending.extend_from_slice(&buf[..n]);
    Ok(())
}

/// Reads one whole answer (its head, then its `Content-Length` body) from `stream`, with
/// `pending` holding bytes read ahead.
async fn read_answer(stream: &mut TcpStream, pending: &mut Vec<u8>) -> io::Result<Answer> {
    read_until(stream, pending, false).await
}

/// [`read_answer`]; with `interim`, a `100 Continue` is an answer too.
async fn read_until(
    stream: &mut TcpStream,
    pending: &mut Vec<u8>,
    interim: bool,
) -> io::Result<Answer> {
    let mut continues = 0;
    loop {
        let end = loop {
            if let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                break end;
            }
            read_more(stream, pending, "head").await?;
        };
        let head = String::from_utf8_lossy(&pending[..end]).into_owned();
        pending.drain(..end + 4);
        let status = common::status_of(&head);
        if status == 100 && !interim {
            continues += 1;
            continue;
        }
        let length: usize = head
            .lines()
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())?
            })
            .unwrap_or(0);
        while pending.len() < length {
            read_more(stream, pending, "body").await?;
        }
        pending.drain(..length);
        return Ok(Answer {
            status,
            head,
            continues,
        });
    }
}

/// Sends `request` (a head without its framing lines) and a body of `size` bytes timed as
/// `timing`, reads the whole answer, then sends a second request on the same connection.
/// Returns the first answer, or a description of how the exchange failed (a reset, a broken pipe, an
/// answer cut short, a second request left unanswered on a connection kept open).
async fn exchange(
    addr: SocketAddr,
    request: &str,
    size: usize,
    timing: Timing,
) -> Result<Answer, String> {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let body = vec![b'x'; size];
    let mut head = request.to_owned();
    match timing {
        Timing::Chunked => head.push_str("Transfer-Encoding: chunked\r\n"),
        Timing::Expect => {
            head.push_str(&format!(
                "Content-Length: {size}\r\nExpect: 100-continue\r\n"
            ));
        }
        _ => head.push_str(&format!("Content-Length: {size}\r\n")),
    }
    head.push_str("\r\n");
    let mut pending = Vec::new();
    if let Timing::Expect = timing {
        // As curl does: the body once `100 Continue` comes; an early final answer is read
        // first, and the body sent all the same (a client whose body was on its way).
        stream
            .write_all(head.as_bytes())
            .await
            .map_err(|e| format!("sending the head failed: {e}"))?;
        let first = read_until(&mut stream, &mut pending, true)
            .await
            .map_err(|e| format!("reading the answer failed: {e}"))?;
        stream
            .write_all(&body)
            .await
            .map_err(|e| format!("sending the body failed: {e}"))?;
        let answer = if first.status == 100 {
            let mut answer = read_answer(&mut stream, &mut pending)
                .await
                .map_err(|e| format!("reading the answer failed: {e}"))?;
            answer.continues += 1;
            answer
        } else {
            first
        };
        return next_request(stream, pending, answer).await;
    }
    let sent = async {
        if let Timing::WithHead = timing {
            let mut all = head.into_bytes();
            all.extend_from_slice(&body);
            return stream.write_all(&all).await;
        }
        stream.write_all(head.as_bytes()).await?;
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Timing::Chunked = timing {
            let half = size / 2;
            for part in [&body[..half], &body[half..]] {
                stream
                    .write_all(format!("{:x}\r\n", part.len()).as_bytes())
                    .await?;
                stream.write_all(part).await?;
                stream.write_all(b"\r\n").await?;
            }
            return stream.write_all(b"0\r\n\r\n").await;
        }
        stream.write_all(&body).await
    };
    sent.await
        .map_err(|e| format!("sending the body failed: {e}"))?;
    let answer = read_answer(&mut stream, &mut pending)
        .await
        .map_err(|e| format!("reading the answer failed: {e}"))?;
    next_request(stream, pending, answer).await
}

/// After `answer`, read whole: a second request on the connection, answered, or an
/// orderly end of file after an answer that said `Connection: close`.
async fn next_request(
    mut stream: TcpStream,
    mut pending: Vec<u8>,
    answer: Answer,
) -> Result<Answer, String> {
    let second = b"GET /api/items/1 HTTP/1.1\r\nHost: cacheguard\r\n\r\n";
    let wrote = stream.write_all(second).await;
    if answer.closes() {
        // The client sees the close only once it reads: its next request may go out
        // first. It must then read an orderly end of file, never a reset.
        let mut buf = [0u8; 1024];
        let read = tokio::time::timeout(READ, stream.read(&mut buf))
            .await
            .map_err(|_| "no end of file after `Connection: close`".to_owned())?;
        return match read {
            Ok(0) if pending.is_empty() => Ok(answer),
            Ok(n) => Err(format!(
                "bytes after an answer that said `Connection: close`: {:?}",
                String::from_utf8_lossy(&buf[..n])
            )),
            Err(e) => Err(format!(
                "after `Connection: close` (second request written: {wrote:?}), the read \
                 failed: {e}"
            )),
        };
    }
    wrote.map_err(|e| format!("the second request on a kept connection failed: {e}"))?;
    let next = read_answer(&mut stream, &mut pending).await.map_err(|e| {
        format!("the answer did not say `Connection: close`, yet the second request failed: {e}")
    })?;
    if next.status == 0 {
        return Err(format!("the second answer has no status: {next:?}"));
    }
    Ok(answer)
}

/// An early answer to check: a request head (without its framing lines or blank line)
/// and the status expected, on `addr`.
struct Early {
    what: &'static str,
    addr: SocketAddr,
    request: String,
    status: u16,
    /// Body size for the timings other than [`Timing::Large`].
    size: usize,
    /// Whether the answer comes before the body is read (else after: it must keep the
    /// connection however the body came).
    early: bool,
    /// Whether the connection is kept when the body came with the head (the server
    /// discards it at once).
    keeps: bool,
    /// Body size for [`Timing::Large`]: more than the server buffers of a body (some
    /// 33 KiB with the default head limit).
    large: usize,
}

/// Runs every timing of every `early` answer; returns the failures.
async fn check_all(mode: &str, early: &[Early]) -> Vec<String> {
    let mut failures = Vec::new();
    for case in early {
        for timing in TIMINGS {
            let size = match timing {
                Timing::Large => case.large,
                _ => case.size,
            };
            let what = format!("{mode}, {}, {timing:?}", case.what);
            match exchange(case.addr, &case.request, size, timing).await {
                Ok(answer) => {
                    if answer.status != case.status {
                        failures.push(format!("{what}: status {}: {}", answer.status, answer.head));
                    }
                    if !case.early && answer.closes() {
                        failures.push(format!(
                            "{what}: an answer after the body closed the connection: {}",
                            answer.head
                        ));
                    }
                    if let Timing::WithHead = timing
                        && case.keeps
                        && answer.closes()
                    {
                        failures.push(format!(
                            "{what}: the body came with the head, yet the connection was \
                             closed: {}",
                            answer.head
                        ));
                    }
                    if let Timing::Expect = timing
                        && case.early
                        && (answer.continues > 0 || !answer.closes())
                    {
                        failures.push(format!(
                            "{what}: an early answer to `Expect: 100-continue` sent \
                             {} `100 Continue` and said `Connection: close`: {}",
                            answer.continues,
                            answer.closes()
                        ));
                    }
                }
                Err(failure) => failures.push(format!("{what}: {failure}")),
            }
        }
    }
    failures
}

const TOKEN: &str = "early-answers-token";

/// Every answer cacheguard gives before it reads the request body, with each timing of
/// that body, embedded and shared: the client reads the whole answer, and its next
/// request on the connection is either answered or meets an orderly end of file after an
/// answer that said `Connection: close` — never a reset or a broken pipe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_before_the_body_never_reset_the_connection() {
    let mut failures = Vec::new();
    for shared in [false, true] {
        let origin = TestOrigin::start().await;
        common::set_seats(&origin, "t1", "a", 0);
        common::set_seats(&origin, "t2", "a", 100);
        let redis = if shared {
            Some(RedisServer::start().await)
        } else {
            None
        };
        let mut cfg = CgConfig::new(&origin)
            .set("server", "max_body_bytes", "262144")
            .set_str("admin", "token", TOKEN)
            .routes(&format!(
                "{}{}",
                common::buy_route("seats"),
                common::stock_table("seats", "on_redis_error = \"reject\"")
            ));
        if let Some(redis) = &redis {
            cfg = cfg.redis(redis);
        }
        let cg = cfg.start().await;
        let client = HttpClient::new();
        let orders = common::orders("t1", "a");
        // The first buy learns the resource is sold out; the next are answered from
        // memory, before their body.
        let first = common::post(&client, &url(cg.addr(), &orders), &[], "{}").await;
        assert_eq!(first.status, 409, "{first}");
        let early = [
            Early {
                what: "sold out",
                addr: cg.addr(),
                request: format!("POST {orders} HTTP/1.1\r\nHost: cacheguard\r\n"),
                status: 409,
                early: true,
                keeps: true,
                size: 64,
                large: 200_000,
            },
            Early {
                what: "413",
                addr: cg.addr(),
                request: "POST /api/items HTTP/1.1\r\nHost: cacheguard\r\n".to_owned(),
                status: 413,
                early: true,
                keeps: false,
                size: 300_000,
                large: 1 << 20,
            },
            Early {
                what: "admin 401",
                addr: cg.admin_addr(),
                request: "POST /admin/purge HTTP/1.1\r\nHost: cacheguard\r\n".to_owned(),
                status: 401,
                early: true,
                keeps: true,
                size: 64,
                large: 200_000,
            },
        ];
        let mode = if shared { "shared" } else { "embedded" };
        failures.extend(check_all(mode, &early).await);
        // Closed by lingering, the clients closing their side on the end of file.
        let lingered = common::poll_until(
            Duration::from_secs(5),
            Duration::from_millis(50),
            || async {
                let labels = [("listener", "proxy"), ("end", "closed")];
                let n = common::metric(
                    &client,
                    cg.admin_addr(),
                    "cacheguard_lingering_closes_total",
                    &labels,
                )
                .await;
                (n >= 1.0).then_some(n)
            },
        )
        .await;
        if lingered.is_none() {
            failures.push(format!("{mode}: no lingering close counted"));
        }
        if let Some(mut redis) = redis {
            // The gate refuses while Redis is down (`on_redis_error = "reject"`): after
            // it has read the body, here.
            let seats = common::orders("t2", "a");
            let sold = common::post(&client, &url(cg.addr(), &seats), &[], "{}").await;
            assert!(sold.status.is_success(), "{sold}");
            redis.kill();
            let unavailable = [Early {
                what: "503 gate unavailable",
                addr: cg.addr(),
                request: format!("POST {seats} HTTP/1.1\r\nHost: cacheguard\r\n"),
                status: 503,
                early: false,
                keeps: true,
                size: 64,
                large: 200_000,
            }];
            failures.extend(check_all(mode, &unavailable).await);
        }
        cg.shutdown().await;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Reads until the server closes `stream` (or `within` passes): how long that took, or
/// `None` when it did not.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return start.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .ok()
}

/// With `keepalive_timeout` 1.5 s and `header_read_timeout` 300 ms: an idle connection
/// outlives the header timeout (its next request is answered) and is closed about the
/// keep-alive timeout after its last answer, counted; a head begun and left unfinished is
/// cut after the header timeout, counted apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_live_the_keepalive_timeout_and_slow_heads_the_header_timeout() {
    let _heavy = common::heavy().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set_str("server", "keepalive_timeout", "1500ms")
        .set_str("server", "header_read_timeout", "300ms")
        .start()
        .await;
    let get = b"GET /api/items/1 HTTP/1.1\r\nHost: cacheguard\r\n\r\n";
    let mut stream = TcpStream::connect(cg.addr()).await.expect("connect");
    let mut pending = Vec::new();
    stream.write_all(get).await.expect("first request");
    let first = read_answer(&mut stream, &mut pending).await.expect("first");
    assert_eq!(first.status, 200, "{first:?}");
    // Idle past the header timeout: still open.
    tokio::time::sleep(Duration::from_millis(800)).await;
    stream.write_all(get).await.expect("second request");
    let second = read_answer(&mut stream, &mut pending)
        .await
        .expect("an idle connection closed before keepalive_timeout");
    assert_eq!(second.status, 200, "{second:?}");
    let idle = closed_within(&mut stream, Duration::from_secs(5))
        .await
        .expect("an idle connection still open well past keepalive_timeout");
    assert!(
        idle >= Duration::from_millis(1000),
        "an idle connection closed after {idle:?}, before keepalive_timeout"
    );

    // A head begun: the header timeout from its first byte, not the keep-alive timeout.
    let mut slow = TcpStream::connect(cg.addr()).await.expect("connect");
    slow.write_all(get).await.expect("request");
    let answer = read_answer(&mut slow, &mut Vec::new())
        .await
        .expect("answer");
    assert_eq!(answer.status, 200, "{answer:?}");
    slow.write_all(b"GET /api/items/1 HTTP/1.1\r\nHo")
        .await
        .expect("half a head");
    let cut = closed_within(&mut slow, Duration::from_secs(5))
        .await
        .expect("a slow head still open");
    assert!(
        cut < Duration::from_millis(1200),
        "a slow head was cut after {cut:?}, not after header_read_timeout"
    );

    let client = HttpClient::new();
    for reason in ["keepalive_timeout", "header_read_timeout"] {
        let counted = common::metric(
            &client,
            cg.admin_addr(),
            "cacheguard_connections_timed_out_total",
            &[("listener", "proxy"), ("reason", reason)],
        )
        .await;
        assert!(counted >= 1.0, "{reason}: {counted}");
    }
    cg.shutdown().await;
}
