//! Load client for the bench scripts.
//!
//! `loadgen stampede --url URL [--url URL2 ...] --concurrency C --timeout-s 30 [--warm-path P]`
//!
//! 1. Opens C keep-alive HTTP/1.1 connections, spread round-robin over the URLs (at most
//!    `--connect-parallelism` connects in flight, so no SYN is dropped by a full backlog).
//! 2. With `--warm-path`, sends one GET of that (already cached) path on every connection and
//!    reads the whole answer, so each connection is known to be accepted and served by the
//!    proxy before the stampede (a bare TCP connect only proves the kernel queued it).
//! 3. When every connection is ready (or failed), releases one GET of its URL on each at the
//!    same moment (a watch channel is the barrier).
//! 4. Prints one JSON object: counts, errors, latency percentiles, the X-Cache and status
//!    histograms, per-URL figures, and the send skew.
//!
//! Latency of a request is measured from the moment its first byte is handed to the kernel
//! (the first `write` on its connection after the release; recorded by a wrapper around the
//! socket) to the end of its body. The send skew is the spread of those moments.
//!
//! `loadgen rate --url URL --rate R --duration-s D --connections C [--warmup-s W] [--drain-s 5]`
//!
//! Open loop at a fixed rate, free of coordinated omission:
//!
//! 1. Opens C keep-alive HTTP/1.1 connections to URL (all must connect, or it fails).
//! 2. A pacer thread (an OS thread with `std::thread::sleep`, not the 1 ms tokio timer)
//!    schedules request i at `start + i/R`, for W + D seconds, into a FIFO queue. The first
//!    W seconds are warm-up: sent at the same rate, left out of every figure.
//! 3. Each connection takes the oldest queued request when it is free and sends it. When
//!    every connection is busy, a due request waits in the queue.
//! 4. Latency is measured from the request's *scheduled* time to the end of its body, so
//!    the time it waited for a free connection (and any pacer lag) counts. Service time
//!    (actual send to end of body) and send lag (scheduled to actual send) are reported
//!    beside it, to tell a slow target from a late generator.
//! 5. After the last scheduled request it waits at most `--drain-s` for the queue and the
//!    in-flight requests; whatever is left is counted as unsent / unfinished. A request
//!    taking over `--timeout-s` is an error and its connection is replaced.
//!
//! Prints one JSON object: counts, achieved rate, exact percentiles (nearest rank over the
//! full sorted vector of measured latencies) and the X-Cache / status / body-size histograms.
//!
//! `loadgen list --url 'http://IP:PORT/items/{id}' --ids-file F --connections C
//!  [--max-duration-s 600] [--passed-out FILE] [--reject-x-cache REJECT]`
//!
//! Closed loop at full speed over a fixed list: every id of F (one per line) is requested
//! exactly once, in file order, by whichever of the C keep-alive connections is free next.
//! 1. Opens the C connections before the clock starts (all must connect, or it fails).
//! 2. Each connection takes the next id, GETs it, reads the whole body, and takes the next;
//!    a connection the server closed is replaced (counted as a reconnect).
//! 3. Ends when the list is done; after `--max-duration-s` no new id is handed out (the rest
//!    are counted as unsent).
//! 4. Prints one JSON object: counts, elapsed time (first send to last answer) and the rate,
//!    latency percentiles (send to end of body), X-Cache / status / body-size histograms.
//!    With `--passed-out`, writes the ids whose answer did not carry `X-Cache:
//!    <--reject-x-cache>` (or failed) to that file, one per line.
//!
//! `loadgen cycle --url 'http://IP:PORT/items/{id}' [--url URL2 ...] --keys N [--first-id 1]
//!  --rate R --duration-s D --connections C [--bucket-ms 1000] [--drain-s 5]`
//!
//! Open loop at a fixed rate cycling over N keys, with a timeline (bench/avalanche.sh):
//! 1. Opens C keep-alive connections per URL (all must connect, or it fails).
//! 2. A pacer thread schedules request j at `start + j/R` for D seconds. Request j goes to URL
//!    `j mod U` (U URLs) and asks for id `first_id + (j div U) mod N`, so every URL cycles
//!    through all N keys in order, each at R/U req/s. One pass (D = N/R) is a fill burst.
//! 3. Each URL's connections take its oldest due request when free (a due request waits in
//!    that URL's queue when all are busy); a connection the server closed is replaced.
//! 4. Latency runs from the scheduled time to the end of the body (as in `rate`).
//! 5. Prints one JSON object: totals, the X-Cache / status histograms, and `timeline`: per
//!    `--bucket-ms` bucket of *scheduled* time, the scheduled / ok / non-2xx / error counts,
//!    status and X-Cache histograms and latency percentiles. `start_unix_ms` is the
//!    wall-clock time of `start`, to line the timeline up with other processes' clocks.
//!
//! `loadgen stale --url http://IP:PORT [--url URL2 ...] [--path-template /kv/{key}]
//!  [--writers 8] [--readers 32] [--keys 100] [--duration-s 10] --delay-ms D`
//!
//! Closed-loop read-your-writes check against a versioned KV origin (bench-origin `--kv`)
//! behind one or more caches (bench/stale_window.sh):
//! 1. Opens one keep-alive connection per loop and URL (all must connect, or it fails).
//! 2. W writer loops: a random key, `PUT`, record (key, the version the answer returns, the
//!    instant the answer arrived). R reader loops: a random key, `GET`, record (key,
//!    instance, the instant the request was sent, the version in the JSON body). Each
//!    request goes to a random URL. Every loop stops at `--duration-s` or after
//!    `--max-requests-per-loop` requests; each request is bounded by `--timeout-s`.
//! 3. All instants come from one monotonic clock (`std::time::Instant`), shared by every
//!    loop. For each write (key k, version v, returned at t_w), its *stale window* is the
//!    largest (read start − t_w) over reads of k that started at or after t_w and returned a
//!    version < v (0 when there is none).
//! 4. Prints one JSON object: counts, errors by kind, the distribution of stale windows over
//!    all writes (p50/p90/p99/p99.9/max, ms), `stale_reads_total` (reads that started at or
//!    after the return of some write to their key and returned an older version) and
//!    `stale_reads_after_delay` (the same, started more than D ms after that return: with a
//!    working delayed double delete of `double_delete_delay = D`, this must be 0), the latter
//!    broken down by instance and X-Cache, with samples.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clap::{Parser, Subcommand};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1;
use hyper::header::{HOST, USER_AGENT};
use hyper::{Request, Uri};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc, watch};

#[derive(Parser, Debug)]
#[command(about = "Load client for the cacheguard bench scripts")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// C connections, one GET of the same URL on each, released at once.
    Stampede(StampedeArgs),
    /// Open-loop GETs of one URL at a fixed rate over C keep-alive connections.
    Rate(RateArgs),
    /// Every id of a list GET once, at full speed over C keep-alive connections.
    List(ListArgs),
    /// Open-loop GETs cycling over N keys at a fixed rate, with a per-bucket timeline.
    Cycle(CycleArgs),
    /// Closed-loop writers and readers of a versioned KV origin: stale reads after writes.
    Stale(StaleArgs),
}

#[derive(Parser, Debug)]
struct StaleArgs {
    /// Base URL of one instance (http://IP:PORT); repeat for several. Each request goes to a
    /// random one.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Path of one key; `{key}` is replaced by the key.
    #[arg(long, default_value = "/kv/{key}")]
    path_template: String,
    /// Writer loops (PUT).
    #[arg(long, default_value_t = 8)]
    writers: usize,
    /// Reader loops (GET).
    #[arg(long, default_value_t = 32)]
    readers: usize,
    /// Number of keys, named `<key-prefix>0` .. `<key-prefix><keys - 1>`; each request picks
    /// one at random.
    #[arg(long, default_value_t = 100)]
    keys: u64,
    /// Prefix of the key names (a fresh prefix gives fresh keys on a long-running origin).
    #[arg(long, default_value = "k")]
    key_prefix: String,
    /// Run time of every loop, in seconds.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// The `double_delete_delay` under test, in milliseconds: a read that starts more than
    /// this long after a write returned must not see an older version.
    #[arg(long)]
    delay_ms: f64,
    /// Hard cap on the requests of each loop.
    #[arg(long, default_value_t = 200_000)]
    max_requests_per_loop: u64,
    /// Per-request timeout (connect, send, whole answer), in seconds.
    #[arg(long, default_value_t = 5.0)]
    timeout_s: f64,
    /// Stale reads (after the delay) listed in the report.
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// Seed of the key and instance choices (default: from the clock; reported).
    #[arg(long)]
    seed: Option<u64>,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct CycleArgs {
    /// URL template with `{id}` in the path, e.g. http://127.0.0.1:8080/items/{id}; repeat
    /// for several instances (request j goes to the (j mod U)-th).
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// First id of the cycle.
    #[arg(long, default_value_t = 1)]
    first_id: u64,
    /// Number of keys cycled: ids first-id ..= first-id + keys - 1.
    #[arg(long)]
    keys: u64,
    /// Requests per second over all URLs (request j is scheduled at start + j/rate).
    #[arg(long)]
    rate: f64,
    /// Duration in seconds: ceil(rate × duration) requests are scheduled.
    #[arg(long)]
    duration_s: f64,
    /// Keep-alive connections per URL; a due request waits for a free one.
    #[arg(long)]
    connections: usize,
    /// Width of one timeline bucket (of scheduled time), in milliseconds.
    #[arg(long, default_value_t = 1000)]
    bucket_ms: u64,
    /// Time allowed after the last scheduled request for the rest to finish, in seconds.
    #[arg(long, default_value_t = 5.0)]
    drain_s: f64,
    /// Per-request timeout (from the actual send), in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_s: f64,
    /// Tokio worker threads (the pacer is one more OS thread).
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct ListArgs {
    /// URL template; `{id}` (in the path) is replaced by each id, e.g.
    /// http://127.0.0.1:8080/items/{id}
    #[arg(long)]
    url: String,
    /// One id per line (trimmed; empty lines ignored). Ids are put into the path verbatim.
    #[arg(long)]
    ids_file: std::path::PathBuf,
    /// Keep-alive connections.
    #[arg(long)]
    connections: usize,
    /// Per-request timeout (from the send), in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_s: f64,
    /// No new id is handed out after this many seconds; the rest are counted as unsent.
    #[arg(long, default_value_t = 600.0)]
    max_duration_s: f64,
    /// Write the ids whose answer's X-Cache was not --reject-x-cache (or that failed) here.
    #[arg(long)]
    passed_out: Option<std::path::PathBuf>,
    /// The X-Cache value of a rejected request (for --passed-out and the "rejected" count).
    #[arg(long, default_value = "REJECT")]
    reject_x_cache: String,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct RateArgs {
    /// Target URL (http://IP:PORT/path).
    #[arg(long)]
    url: String,
    /// Requests per second (request i is scheduled at start + i/rate).
    #[arg(long)]
    rate: f64,
    /// Measured duration in seconds (after the warm-up).
    #[arg(long)]
    duration_s: f64,
    /// Keep-alive connections; a due request waits for a free one.
    #[arg(long)]
    connections: usize,
    /// Warm-up in seconds before the measured part, same rate, not counted.
    #[arg(long, default_value_t = 0.0)]
    warmup_s: f64,
    /// Time allowed after the last scheduled request for the rest to finish, in seconds.
    #[arg(long, default_value_t = 5.0)]
    drain_s: f64,
    /// Per-request timeout (from the actual send), in seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_s: f64,
    /// Tokio worker threads (the pacer is one more OS thread).
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

#[derive(Parser, Debug)]
struct StampedeArgs {
    /// Target URL (repeat for several instances; connections are spread round-robin).
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// Number of connections, one stampede request each.
    #[arg(long)]
    concurrency: usize,
    /// Per-request timeout after the release, in seconds.
    #[arg(long, default_value_t = 30.0)]
    timeout_s: f64,
    /// Path (with query) GET once on every connection before the release; must answer 2xx.
    #[arg(long)]
    warm_path: Option<String>,
    /// Connects (and warm-ups) in flight at once while setting up.
    #[arg(long, default_value_t = 64)]
    connect_parallelism: usize,
    /// Time allowed for setting every connection up, in seconds.
    #[arg(long, default_value_t = 30.0)]
    setup_timeout_s: f64,
    /// Pause between "all connections ready" and the release, in milliseconds.
    #[arg(long, default_value_t = 100)]
    settle_ms: u64,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Include every latency (ms) in the JSON.
    #[arg(long)]
    dump_latencies: bool,
}

/// When the first write after `armed` happened on one connection.
#[derive(Default)]
struct WriteMark {
    armed: AtomicBool,
    at: OnceLock<Instant>,
}

/// A TcpStream that records, once armed, the instant of its first write.
struct TimedStream {
    inner: TcpStream,
    mark: Arc<WriteMark>,
}

impl TimedStream {
    fn note_write(&self) {
        if self.mark.armed.load(Ordering::Acquire) && self.mark.at.get().is_none() {
            let _ = self.mark.at.set(Instant::now());
        }
    }
}

impl AsyncRead for TimedStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TimedStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.note_write();
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.note_write();
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

struct Target {
    url: String,
    addr: SocketAddr,
    authority: String,
    path: String,
}

fn parse_target(url: &str) -> Result<Target, String> {
    let uri: Uri = url.parse().map_err(|e| format!("bad url {url}: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("only http:// urls are supported: {url}"));
    }
    let authority = uri.authority().ok_or_else(|| format!("no host in {url}"))?;
    let host = authority.host();
    let port = authority.port_u16().unwrap_or(80);
    let ip: std::net::IpAddr = host
        .parse()
        .map_err(|_| format!("host must be an IP address (e.g. 127.0.0.1): {url}"))?;
    Ok(Target {
        url: url.to_owned(),
        addr: SocketAddr::new(ip, port),
        authority: authority.as_str().to_owned(),
        path: uri.path_and_query().map_or("/", |p| p.as_str()).to_owned(),
    })
}

enum Outcome {
    /// Setup failed; the stampede request was never sent.
    SetupFailed(String),
    Done {
        status: u16,
        x_cache: String,
        body_len: usize,
        sent: Instant,
        done: Instant,
    },
    Error {
        msg: String,
        sent: Option<Instant>,
    },
    Timeout {
        sent: Option<Instant>,
    },
}

struct ConnReport {
    target: usize,
    warm_x_cache: Option<String>,
    outcome: Outcome,
}

fn x_cache_of<B>(resp: &hyper::Response<B>) -> String {
    resp.headers()
        .get("x-cache")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_else(|| "(none)".to_owned())
}

fn get(t: &Target, path: &str) -> Request<Empty<Bytes>> {
    Request::builder()
        .uri(path)
        .header(HOST, t.authority.as_str())
        .header(USER_AGENT, "cacheguard-bench-loadgen")
        .body(Empty::new())
        .expect("valid request")
}

struct Shared {
    targets: Vec<Target>,
    warm_path: Option<String>,
    timeout: Duration,
    sem: Semaphore,
}

async fn connection(
    sh: Arc<Shared>,
    ti: usize,
    settled: mpsc::UnboundedSender<bool>,
    mut release: watch::Receiver<Option<Instant>>,
) -> ConnReport {
    let t = &sh.targets[ti];
    let mark = Arc::new(WriteMark::default());
    let mut report = ConnReport {
        target: ti,
        warm_x_cache: None,
        outcome: Outcome::SetupFailed("not set up".into()),
    };

    // --- set up: connect, handshake, warm (bounded parallelism) ---
    let setup = async {
        let _permit = sh.sem.acquire().await.map_err(|e| e.to_string())?;
        let stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(t.addr))
            .await
            .map_err(|_| "connect timeout".to_owned())?
            .map_err(|e| format!("connect: {e}"))?;
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(TimedStream {
            inner: stream,
            mark: mark.clone(),
        });
        let (sender, conn) = http1::handshake::<_, Empty<Bytes>>(io)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut sender = sender;
        let mut warm_x_cache = None;
        if let Some(wp) = &sh.warm_path {
            let fut = async {
                let resp = sender.send_request(get(t, wp)).await.map_err(|e| format!("warm: {e}"))?;
                let xc = x_cache_of(&resp);
                let status = resp.status();
                resp.into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("warm body: {e}"))?;
                if !status.is_success() {
                    return Err(format!("warm: status {status}"));
                }
                Ok::<_, String>(xc)
            };
            warm_x_cache = Some(
                tokio::time::timeout(Duration::from_secs(10), fut)
                    .await
                    .map_err(|_| "warm timeout".to_owned())??,
            );
        }
        Ok::<_, String>((sender, warm_x_cache))
    };
    let mut sender = match setup.await {
        Ok((sender, wx)) => {
            report.warm_x_cache = wx;
            let _ = settled.send(true);
            sender
        }
        Err(e) => {
            let _ = settled.send(false);
            report.outcome = Outcome::SetupFailed(e);
            return report;
        }
    };

    // --- wait for the release ---
    if release.wait_for(|v| v.is_some()).await.is_err() {
        report.outcome = Outcome::SetupFailed("release channel closed".into());
        return report;
    }
    if let Err(e) = sender.ready().await {
        report.outcome = Outcome::Error {
            msg: format!("connection not ready at release: {e}"),
            sent: None,
        };
        return report;
    }
    mark.armed.store(true, Ordering::Release);
    let fut = async {
        let resp = sender.send_request(get(t, &t.path)).await.map_err(|e| format!("request: {e}"))?;
        let status = resp.status().as_u16();
        let xc = x_cache_of(&resp);
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        Ok::<_, String>((status, xc, body.len()))
    };
    report.outcome = match tokio::time::timeout(sh.timeout, fut).await {
        Ok(Ok((status, x_cache, body_len))) => {
            let done = Instant::now();
            Outcome::Done {
                status,
                x_cache,
                body_len,
                sent: mark.at.get().copied().unwrap_or(done),
                done,
            }
        }
        Ok(Err(msg)) => Outcome::Error {
            msg,
            sent: mark.at.get().copied(),
        },
        Err(_) => Outcome::Timeout {
            sent: mark.at.get().copied(),
        },
    };
    report
}

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[f64], p: f64) -> Value {
    if sorted.is_empty() {
        return Value::Null;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    round3(sorted[rank.min(sorted.len()) - 1])
}

fn round3(v: f64) -> Value {
    json!((v * 1000.0).round() / 1000.0)
}

fn summary(values: &mut [f64]) -> Value {
    values.sort_by(|a, b| a.total_cmp(b));
    if values.is_empty() {
        return json!({"n": 0});
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    json!({
        "n": values.len(),
        "min": round3(values[0]),
        "p50": pct(values, 50.0),
        "p90": pct(values, 90.0),
        "p99": pct(values, 99.0),
        "max": round3(values[values.len() - 1]),
        "mean": round3(mean),
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn stampede(args: StampedeArgs) -> Result<Value, String> {
    if args.concurrency == 0 {
        return Err("--concurrency must be > 0".into());
    }
    let targets = args
        .urls
        .iter()
        .map(|u| parse_target(u))
        .collect::<Result<Vec<_>, _>>()?;
    let ntargets = targets.len();
    let sh = Arc::new(Shared {
        targets,
        warm_path: args.warm_path.clone(),
        timeout: Duration::from_secs_f64(args.timeout_s),
        sem: Semaphore::new(args.connect_parallelism.max(1)),
    });
    let (settled_tx, mut settled_rx) = mpsc::unbounded_channel();
    let (release_tx, release_rx) = watch::channel(None);

    let setup_start = Instant::now();
    let mut handles = Vec::with_capacity(args.concurrency);
    for i in 0..args.concurrency {
        handles.push(tokio::spawn(connection(
            sh.clone(),
            i % ntargets,
            settled_tx.clone(),
            release_rx.clone(),
        )));
    }
    drop(settled_tx);

    // Wait until every connection is ready or failed (bounded).
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(args.setup_timeout_s);
    let (mut ready, mut failed) = (0usize, 0usize);
    while ready + failed < args.concurrency {
        match tokio::time::timeout_at(deadline, settled_rx.recv()).await {
            Ok(Some(true)) => ready += 1,
            Ok(Some(false)) => failed += 1,
            Ok(None) | Err(_) => break,
        }
    }
    let setup_ms = ms(setup_start.elapsed());
    tokio::time::sleep(Duration::from_millis(args.settle_ms)).await;

    let release_at = Instant::now();
    let _ = release_tx.send(Some(release_at));

    // Every task is bounded by its own timeouts; this is a backstop.
    let backstop = Duration::from_secs_f64(args.timeout_s + args.setup_timeout_s + 10.0);
    let mut reports = Vec::with_capacity(handles.len());
    let mut lost = 0usize;
    for h in handles {
        match tokio::time::timeout(backstop, h).await {
            Ok(Ok(r)) => reports.push(r),
            _ => lost += 1,
        }
    }

    // --- aggregate ---
    let mut lat = Vec::new();
    let mut since_release = Vec::new();
    let mut send_offsets = Vec::new();
    let mut x_cache: BTreeMap<String, u64> = BTreeMap::new();
    let mut warm_x_cache: BTreeMap<String, u64> = BTreeMap::new();
    let mut status: BTreeMap<String, u64> = BTreeMap::new();
    let mut body_sizes: BTreeMap<String, u64> = BTreeMap::new();
    let mut hist: BTreeMap<u64, u64> = BTreeMap::new();
    let mut per_target: Vec<(Vec<f64>, BTreeMap<String, u64>, u64)> =
        (0..ntargets).map(|_| (Vec::new(), BTreeMap::new(), 0)).collect();
    let (mut ok, mut non2xx, mut errors, mut timeouts, mut setup_failures) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut error_samples: BTreeMap<String, u64> = BTreeMap::new();

    for r in &reports {
        if let Some(w) = &r.warm_x_cache {
            *warm_x_cache.entry(w.clone()).or_default() += 1;
        }
        let pt = &mut per_target[r.target];
        match &r.outcome {
            Outcome::SetupFailed(e) => {
                setup_failures += 1;
                *error_samples.entry(format!("setup: {e}")).or_default() += 1;
            }
            Outcome::Done {
                status: st,
                x_cache: xc,
                body_len,
                sent,
                done,
            } => {
                let l = ms(done.saturating_duration_since(*sent));
                lat.push(l);
                since_release.push(ms(done.saturating_duration_since(release_at)));
                send_offsets.push(ms(sent.saturating_duration_since(release_at)));
                *x_cache.entry(xc.clone()).or_default() += 1;
                *status.entry(st.to_string()).or_default() += 1;
                *body_sizes.entry(body_len.to_string()).or_default() += 1;
                *hist.entry((l / 50.0).floor() as u64 * 50).or_default() += 1;
                pt.0.push(l);
                *pt.1.entry(xc.clone()).or_default() += 1;
                pt.2 += 1;
                if (200..300).contains(st) {
                    ok += 1;
                } else {
                    non2xx += 1;
                }
            }
            Outcome::Error { msg, sent } => {
                errors += 1;
                pt.2 += 1;
                if let Some(s) = sent {
                    send_offsets.push(ms(s.saturating_duration_since(release_at)));
                }
                *error_samples.entry(msg.clone()).or_default() += 1;
            }
            Outcome::Timeout { sent } => {
                timeouts += 1;
                errors += 1;
                pt.2 += 1;
                if let Some(s) = sent {
                    send_offsets.push(ms(s.saturating_duration_since(release_at)));
                }
                *error_samples.entry("timeout".into()).or_default() += 1;
            }
        }
    }
    let all_latencies = if args.dump_latencies {
        let mut v = lat.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        json!(v.iter().map(|x| (x * 1000.0).round() / 1000.0).collect::<Vec<_>>())
    } else {
        Value::Null
    };
    let latency = summary(&mut lat);
    let since = summary(&mut since_release);
    send_offsets.sort_by(|a, b| a.total_cmp(b));
    let skew = match (send_offsets.first(), send_offsets.last()) {
        (Some(a), Some(b)) => round3(b - a),
        _ => Value::Null,
    };
    let sends = summary(&mut send_offsets);
    let per_url: Vec<Value> = per_target
        .iter_mut()
        .enumerate()
        .map(|(i, (l, xc, n))| {
            json!({
                "url": sh.targets[i].url,
                "requests": n,
                "latency_ms": summary(l),
                "x_cache": xc,
            })
        })
        .collect();
    let hist: BTreeMap<String, u64> = hist
        .into_iter()
        .map(|(k, v)| (format!("{:05}-{:05}", k, k + 50), v))
        .collect();

    Ok(json!({
        "urls": args.urls,
        "warm_path": args.warm_path,
        "concurrency": args.concurrency,
        "ready": ready,
        "setup_failures": setup_failures,
        "setup_ms": round3(setup_ms),
        "settle_ms": args.settle_ms,
        "count": reports.len() as u64 - setup_failures,
        "ok": ok,
        "non_2xx": non2xx,
        "errors": errors,
        "timeouts": timeouts,
        "lost_tasks": lost,
        "error_samples": error_samples,
        "latency_ms": latency,
        "since_release_ms": since,
        "send_offset_ms": sends,
        "send_skew_ms": skew,
        "x_cache": x_cache,
        "warm_x_cache": warm_x_cache,
        "status": status,
        "body_bytes": body_sizes,
        "latency_hist_50ms": hist,
        "per_url": per_url,
        "latencies_ms": all_latencies,
    }))
}

// --- rate ------------------------------------------------------------------------------

/// One scheduled request.
struct Job {
    scheduled: Instant,
    measured: bool,
}

enum RateOutcome {
    Response {
        status: u16,
        x_cache: String,
        body_len: usize,
    },
    Error(String),
    Timeout,
}

/// One finished request (only measured ones are kept).
struct RateRec {
    scheduled: Instant,
    sent: Instant,
    done: Instant,
    outcome: RateOutcome,
}

#[derive(Default)]
struct RateCounters {
    warmup_sent: std::sync::atomic::AtomicU64,
    warmup_ok: std::sync::atomic::AtomicU64,
    measured_sent: std::sync::atomic::AtomicU64,
    reconnects: std::sync::atomic::AtomicU64,
    connect_failures: std::sync::atomic::AtomicU64,
}

struct RateShared {
    target: Target,
    timeout: Duration,
    queue: tokio::sync::Mutex<mpsc::UnboundedReceiver<Job>>,
    recs: std::sync::Mutex<Vec<RateRec>>,
    counters: RateCounters,
}

async fn rate_connect(t: &Target) -> Result<http1::SendRequest<Empty<Bytes>>, String> {
    let stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(t.addr))
        .await
        .map_err(|_| "connect timeout".to_owned())?
        .map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// One connection: take the oldest due request, send it, record it; reconnect when the
/// connection is gone.
async fn rate_worker(sh: Arc<RateShared>, first: http1::SendRequest<Empty<Bytes>>) {
    let mut sender = Some(first);
    loop {
        let job = {
            let mut q = sh.queue.lock().await;
            q.recv().await
        };
        let Some(job) = job else { return };
        // a usable connection (a new one if the server closed the old one); the time this
        // takes counts in the request's latency
        let mut conn_err = None;
        let mut usable = false;
        for attempt in 0..3 {
            if let Some(s) = sender.as_mut()
                && !s.is_closed()
                && s.ready().await.is_ok()
            {
                usable = true;
                break;
            }
            sender = None;
            if attempt == 2 {
                break;
            }
            sh.counters.reconnects.fetch_add(1, Ordering::Relaxed);
            match rate_connect(&sh.target).await {
                Ok(s) => sender = Some(s),
                Err(e) => {
                    sh.counters.connect_failures.fetch_add(1, Ordering::Relaxed);
                    conn_err = Some(e);
                }
            }
        }
        let sent = Instant::now();
        if job.measured {
            sh.counters.measured_sent.fetch_add(1, Ordering::Relaxed);
        } else {
            sh.counters.warmup_sent.fetch_add(1, Ordering::Relaxed);
        }
        let outcome = if !usable {
            RateOutcome::Error(conn_err.unwrap_or_else(|| "connection not ready".into()))
        } else {
            let s = sender.as_mut().expect("usable sender");
            let fut = async {
                let resp = s
                    .send_request(get(&sh.target, &sh.target.path))
                    .await
                    .map_err(|e| format!("request: {e}"))?;
                let status = resp.status().as_u16();
                let xc = x_cache_of(&resp);
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("body: {e}"))?
                    .to_bytes();
                Ok::<_, String>((status, xc, body.len()))
            };
            match tokio::time::timeout(sh.timeout, fut).await {
                Ok(Ok((status, x_cache, body_len))) => RateOutcome::Response {
                    status,
                    x_cache,
                    body_len,
                },
                Ok(Err(e)) => {
                    sender = None;
                    RateOutcome::Error(e)
                }
                Err(_) => {
                    sender = None;
                    RateOutcome::Timeout
                }
            }
        };
        let done = Instant::now();
        if job.measured {
            sh.recs.lock().expect("recs lock").push(RateRec {
                scheduled: job.scheduled,
                sent,
                done,
                outcome,
            });
        } else if matches!(&outcome, RateOutcome::Response { status, .. } if (200..300).contains(status)) {
            sh.counters.warmup_ok.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Exact percentiles (nearest rank) of a sample, in ms.
fn rate_summary(values: &mut [f64]) -> Value {
    values.sort_by(|a, b| a.total_cmp(b));
    if values.is_empty() {
        return json!({"n": 0});
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    json!({
        "n": values.len(),
        "min": round3(values[0]),
        "p50": pct(values, 50.0),
        "p90": pct(values, 90.0),
        "p99": pct(values, 99.0),
        "p99_9": pct(values, 99.9),
        "max": round3(values[values.len() - 1]),
        "mean": round3(mean),
    })
}

async fn rate(args: RateArgs) -> Result<Value, String> {
    if !(args.rate.is_finite() && args.rate > 0.0) {
        return Err("--rate must be > 0".into());
    }
    if !(args.duration_s.is_finite() && args.duration_s > 0.0) {
        return Err("--duration-s must be > 0".into());
    }
    if !(args.warmup_s.is_finite() && args.warmup_s >= 0.0) {
        return Err("--warmup-s must be >= 0".into());
    }
    if args.connections == 0 {
        return Err("--connections must be > 0".into());
    }
    let target = parse_target(&args.url)?;

    // all connections up before the clock starts
    let mut first = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let s = rate_connect(&target)
            .await
            .map_err(|e| format!("setting up connections: {e}"))?;
        first.push(s);
    }

    let warmup_n = (args.rate * args.warmup_s).ceil() as u64;
    let total_n = (args.rate * (args.warmup_s + args.duration_s)).ceil() as u64;
    let measured_n = total_n - warmup_n;

    let (tx, rx) = mpsc::unbounded_channel::<Job>();
    let sh = Arc::new(RateShared {
        target,
        timeout: Duration::from_secs_f64(args.timeout_s),
        queue: tokio::sync::Mutex::new(rx),
        recs: std::sync::Mutex::new(Vec::with_capacity(measured_n as usize)),
        counters: RateCounters::default(),
    });
    let workers: Vec<_> = first
        .into_iter()
        .map(|s| tokio::spawn(rate_worker(sh.clone(), s)))
        .collect();

    let start = Instant::now() + Duration::from_millis(50);
    let measure_start = start + Duration::from_secs_f64(warmup_n as f64 / args.rate);
    let stop = Arc::new(AtomicBool::new(false));
    let pacer = {
        let stop = stop.clone();
        let rate = args.rate;
        std::thread::spawn(move || {
            // 1 ns timer slack for this thread (default 50 µs): sleeps end on time
            // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
            }
            for i in 0..total_n {
                let t = start + Duration::from_secs_f64(i as f64 / rate);
                let now = Instant::now();
                if t > now {
                    std::thread::sleep(t - now);
                }
                if stop.load(Ordering::Relaxed)
                    || tx
                        .send(Job {
                            scheduled: t,
                            measured: i >= warmup_n,
                        })
                        .is_err()
                {
                    return;
                }
            }
            // dropping tx closes the queue: the workers end once it is empty
        })
    };

    let last_scheduled = start + Duration::from_secs_f64(total_n.saturating_sub(1) as f64 / args.rate);
    let deadline = tokio::time::Instant::from_std(last_scheduled + Duration::from_secs_f64(args.drain_s));
    let joined = tokio::time::timeout_at(deadline, async {
        for w in workers {
            let _ = w.await;
        }
    })
    .await;
    let drained = joined.is_ok();
    stop.store(true, Ordering::Relaxed);
    let end = Instant::now();
    // whatever is still running is abandoned: the runtime is dropped after we return
    let _ = pacer.join();

    let recs = std::mem::take(&mut *sh.recs.lock().expect("recs lock"));
    let c = &sh.counters;
    let sent = c.measured_sent.load(Ordering::Relaxed);
    let (mut ok, mut non2xx, mut errors, mut timeouts) = (0u64, 0u64, 0u64, 0u64);
    let mut lat = Vec::with_capacity(recs.len());
    let mut service = Vec::with_capacity(recs.len());
    let mut lag = Vec::with_capacity(recs.len());
    let mut x_cache: BTreeMap<String, u64> = BTreeMap::new();
    let mut status: BTreeMap<String, u64> = BTreeMap::new();
    let mut body_sizes: BTreeMap<String, u64> = BTreeMap::new();
    let mut error_samples: BTreeMap<String, u64> = BTreeMap::new();
    let mut last_done = measure_start;
    for r in &recs {
        lag.push(ms(r.sent.saturating_duration_since(r.scheduled)));
        match &r.outcome {
            RateOutcome::Response {
                status: st,
                x_cache: xc,
                body_len,
            } => {
                lat.push(ms(r.done.saturating_duration_since(r.scheduled)));
                service.push(ms(r.done.saturating_duration_since(r.sent)));
                last_done = last_done.max(r.done);
                *x_cache.entry(xc.clone()).or_default() += 1;
                *status.entry(st.to_string()).or_default() += 1;
                *body_sizes.entry(body_len.to_string()).or_default() += 1;
                if (200..300).contains(st) {
                    ok += 1;
                } else {
                    non2xx += 1;
                }
            }
            RateOutcome::Error(e) => {
                errors += 1;
                *error_samples.entry(e.clone()).or_default() += 1;
            }
            RateOutcome::Timeout => {
                errors += 1;
                timeouts += 1;
                *error_samples.entry("timeout".into()).or_default() += 1;
            }
        }
    }
    let finished = recs.len() as u64;
    let responses = ok + non2xx;
    let window = last_done.saturating_duration_since(measure_start).as_secs_f64();
    let achieved = if window > 0.0 {
        responses as f64 / window
    } else {
        0.0
    };

    Ok(json!({
        "mode": "rate",
        "url": args.url,
        "rate_rps": args.rate,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "connections": args.connections,
        "drain_s": args.drain_s,
        "timeout_s": args.timeout_s,
        "scheduled": measured_n,
        "sent": sent,
        "ok": ok,
        "non_2xx": non2xx,
        "errors": errors,
        "timeouts": timeouts,
        "unsent": measured_n.saturating_sub(sent),
        "unfinished": sent.saturating_sub(finished),
        "drained": drained,
        "achieved_rate_rps": (achieved * 10.0).round() / 10.0,
        "measured_window_s": round3(window),
        "elapsed_s": round3(end.saturating_duration_since(start).as_secs_f64()),
        "warmup_scheduled": warmup_n,
        "warmup_sent": c.warmup_sent.load(Ordering::Relaxed),
        "warmup_ok": c.warmup_ok.load(Ordering::Relaxed),
        "reconnects": c.reconnects.load(Ordering::Relaxed),
        "connect_failures": c.connect_failures.load(Ordering::Relaxed),
        "latency_ms": rate_summary(&mut lat),
        "service_time_ms": rate_summary(&mut service),
        "send_lag_ms": rate_summary(&mut lag),
        "x_cache": x_cache,
        "status": status,
        "body_bytes": body_sizes,
        "error_samples": error_samples,
    }))
}

// --- list ------------------------------------------------------------------------------

/// One finished request of `list`.
struct ListRec {
    idx: usize,
    sent: Instant,
    done: Instant,
    outcome: RateOutcome,
}

struct ListShared {
    target: Target,
    /// The path with `{id}` still in it.
    path_template: String,
    ids: Vec<String>,
    next: std::sync::atomic::AtomicUsize,
    deadline: Instant,
    timeout: Duration,
    reconnects: std::sync::atomic::AtomicU64,
    connect_failures: std::sync::atomic::AtomicU64,
}

/// One connection: take the next id until the list (or the time) is over.
async fn list_worker(sh: Arc<ListShared>, first: http1::SendRequest<Empty<Bytes>>) -> Vec<ListRec> {
    let mut recs = Vec::new();
    let mut sender = Some(first);
    loop {
        if Instant::now() >= sh.deadline {
            return recs;
        }
        let idx = sh.next.fetch_add(1, Ordering::Relaxed);
        if idx >= sh.ids.len() {
            return recs;
        }
        let mut conn_err = None;
        let mut usable = false;
        for attempt in 0..3 {
            if let Some(s) = sender.as_mut()
                && !s.is_closed()
                && s.ready().await.is_ok()
            {
                usable = true;
                break;
            }
            sender = None;
            if attempt == 2 {
                break;
            }
            sh.reconnects.fetch_add(1, Ordering::Relaxed);
            match rate_connect(&sh.target).await {
                Ok(s) => sender = Some(s),
                Err(e) => {
                    sh.connect_failures.fetch_add(1, Ordering::Relaxed);
                    conn_err = Some(e);
                }
            }
        }
        let sent = Instant::now();
        let outcome = if !usable {
            RateOutcome::Error(conn_err.unwrap_or_else(|| "connection not ready".into()))
        } else {
            let s = sender.as_mut().expect("usable sender");
            let path = sh.path_template.replace("{id}", &sh.ids[idx]);
            let fut = async {
                let resp = s
                    .send_request(get(&sh.target, &path))
                    .await
                    .map_err(|e| format!("request: {e}"))?;
                let status = resp.status().as_u16();
                let xc = x_cache_of(&resp);
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("body: {e}"))?
                    .to_bytes();
                Ok::<_, String>((status, xc, body.len()))
            };
            match tokio::time::timeout(sh.timeout, fut).await {
                Ok(Ok((status, x_cache, body_len))) => RateOutcome::Response {
                    status,
                    x_cache,
                    body_len,
                },
                Ok(Err(e)) => {
                    sender = None;
                    RateOutcome::Error(e)
                }
                Err(_) => {
                    sender = None;
                    RateOutcome::Timeout
                }
            }
        };
        recs.push(ListRec {
            idx,
            sent,
            done: Instant::now(),
            outcome,
        });
    }
}

async fn list(args: ListArgs) -> Result<Value, String> {
    if args.connections == 0 {
        return Err("--connections must be > 0".into());
    }
    if !(args.max_duration_s.is_finite() && args.max_duration_s > 0.0) {
        return Err("--max-duration-s must be > 0".into());
    }
    if !args.url.contains("{id}") {
        return Err(format!("--url must contain {{id}}: {}", args.url));
    }
    let target = parse_target(&args.url.replace("{id}", "0"))?;
    let after_authority = args
        .url
        .find(&target.authority)
        .map(|i| &args.url[i + target.authority.len()..])
        .ok_or_else(|| format!("cannot find the authority in {}", args.url))?;
    let path_template = if after_authority.is_empty() {
        "/".to_owned()
    } else {
        after_authority.to_owned()
    };
    if !path_template.contains("{id}") {
        return Err(format!("{{id}} must be in the path of --url: {}", args.url));
    }
    let text = std::fs::read_to_string(&args.ids_file)
        .map_err(|e| format!("reading {}: {e}", args.ids_file.display()))?;
    let ids: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    if ids.is_empty() {
        return Err(format!("{} has no ids", args.ids_file.display()));
    }
    if let Some(bad) = ids.iter().find(|id| id.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control())) {
        return Err(format!("id with whitespace or control characters: {bad:?}"));
    }

    // all connections up before the clock starts
    let mut first = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        first.push(
            rate_connect(&target)
                .await
                .map_err(|e| format!("setting up connections: {e}"))?,
        );
    }

    let start = Instant::now();
    let sh = Arc::new(ListShared {
        target,
        path_template,
        ids,
        next: std::sync::atomic::AtomicUsize::new(0),
        deadline: start + Duration::from_secs_f64(args.max_duration_s),
        timeout: Duration::from_secs_f64(args.timeout_s),
        reconnects: std::sync::atomic::AtomicU64::new(0),
        connect_failures: std::sync::atomic::AtomicU64::new(0),
    });
    let workers: Vec<_> = first
        .into_iter()
        .map(|s| tokio::spawn(list_worker(sh.clone(), s)))
        .collect();
    let mut recs = Vec::with_capacity(sh.ids.len());
    let mut lost = 0u64;
    for w in workers {
        match w.await {
            Ok(r) => recs.extend(r),
            Err(_) => lost += 1,
        }
    }

    let (mut ok, mut non2xx, mut errors, mut timeouts, mut rejected) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut lat = Vec::with_capacity(recs.len());
    let mut x_cache: BTreeMap<String, u64> = BTreeMap::new();
    let mut status: BTreeMap<String, u64> = BTreeMap::new();
    let mut body_sizes: BTreeMap<String, u64> = BTreeMap::new();
    let mut error_samples: BTreeMap<String, u64> = BTreeMap::new();
    let mut passed: Vec<usize> = Vec::new();
    let mut first_sent: Option<Instant> = None;
    let mut last_done = start;
    for r in &recs {
        first_sent = Some(first_sent.map_or(r.sent, |f| f.min(r.sent)));
        match &r.outcome {
            RateOutcome::Response {
                status: st,
                x_cache: xc,
                body_len,
            } => {
                lat.push(ms(r.done.saturating_duration_since(r.sent)));
                last_done = last_done.max(r.done);
                *x_cache.entry(xc.clone()).or_default() += 1;
                *status.entry(st.to_string()).or_default() += 1;
                *body_sizes.entry(body_len.to_string()).or_default() += 1;
                if (200..300).contains(st) {
                    ok += 1;
                } else {
                    non2xx += 1;
                }
                if *xc == args.reject_x_cache {
                    rejected += 1;
                } else {
                    passed.push(r.idx);
                }
            }
            RateOutcome::Error(e) => {
                errors += 1;
                passed.push(r.idx);
                *error_samples.entry(e.clone()).or_default() += 1;
            }
            RateOutcome::Timeout => {
                errors += 1;
                timeouts += 1;
                passed.push(r.idx);
                *error_samples.entry("timeout".into()).or_default() += 1;
            }
        }
    }
    if let Some(path) = &args.passed_out {
        passed.sort_unstable();
        let mut out = String::with_capacity(passed.len() * 12);
        for i in &passed {
            out.push_str(&sh.ids[*i]);
            out.push('\n');
        }
        std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let sent = recs.len() as u64;
    let responses = ok + non2xx;
    let elapsed = last_done
        .saturating_duration_since(first_sent.unwrap_or(start))
        .as_secs_f64();
    let rps = if elapsed > 0.0 { responses as f64 / elapsed } else { 0.0 };

    Ok(json!({
        "mode": "list",
        "url": args.url,
        "ids_file": args.ids_file.display().to_string(),
        "ids": sh.ids.len(),
        "connections": args.connections,
        "timeout_s": args.timeout_s,
        "max_duration_s": args.max_duration_s,
        "sent": sent,
        "unsent": (sh.ids.len() as u64).saturating_sub(sent),
        "responses": responses,
        "ok": ok,
        "non_2xx": non2xx,
        "errors": errors,
        "timeouts": timeouts,
        "lost_tasks": lost,
        "reject_x_cache": args.reject_x_cache,
        "rejected": rejected,
        "passed": passed.len(),
        "elapsed_s": round3(elapsed),
        "rps": (rps * 10.0).round() / 10.0,
        "reconnects": sh.reconnects.load(Ordering::Relaxed),
        "connect_failures": sh.connect_failures.load(Ordering::Relaxed),
        "latency_ms": rate_summary(&mut lat),
        "x_cache": x_cache,
        "status": status,
        "body_bytes": body_sizes,
        "error_samples": error_samples,
    }))
}

// --- cycle -----------------------------------------------------------------------------

/// One scheduled request of `cycle`.
struct CycleJob {
    scheduled: Instant,
    path: String,
}

/// One finished request of `cycle`.
struct CycleRec {
    url: usize,
    scheduled: Instant,
    sent: Instant,
    done: Instant,
    outcome: RateOutcome,
}

struct CycleShared {
    target: Target,
    url: usize,
    timeout: Duration,
    queue: tokio::sync::Mutex<mpsc::UnboundedReceiver<CycleJob>>,
    recs: Arc<std::sync::Mutex<Vec<CycleRec>>>,
    sent: Arc<std::sync::atomic::AtomicU64>,
    reconnects: Arc<std::sync::atomic::AtomicU64>,
    connect_failures: Arc<std::sync::atomic::AtomicU64>,
}

/// One connection of one URL: take the oldest due request, send it, record it.
async fn cycle_worker(sh: Arc<CycleShared>, first: http1::SendRequest<Empty<Bytes>>) {
    let mut sender = Some(first);
    loop {
        let job = {
            let mut q = sh.queue.lock().await;
            q.recv().await
        };
        let Some(job) = job else { return };
        let mut conn_err = None;
        let mut usable = false;
        for attempt in 0..3 {
            if let Some(s) = sender.as_mut()
                && !s.is_closed()
                && s.ready().await.is_ok()
            {
                usable = true;
                break;
            }
            sender = None;
            if attempt == 2 {
                break;
            }
            sh.reconnects.fetch_add(1, Ordering::Relaxed);
            match rate_connect(&sh.target).await {
                Ok(s) => sender = Some(s),
                Err(e) => {
                    sh.connect_failures.fetch_add(1, Ordering::Relaxed);
                    conn_err = Some(e);
                }
            }
        }
        let sent = Instant::now();
        sh.sent.fetch_add(1, Ordering::Relaxed);
        let outcome = if !usable {
            RateOutcome::Error(conn_err.unwrap_or_else(|| "connection not ready".into()))
        } else {
            let s = sender.as_mut().expect("usable sender");
            let fut = async {
                let resp = s
                    .send_request(get(&sh.target, &job.path))
                    .await
                    .map_err(|e| format!("request: {e}"))?;
                let status = resp.status().as_u16();
                let xc = x_cache_of(&resp);
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("body: {e}"))?
                    .to_bytes();
                Ok::<_, String>((status, xc, body.len()))
            };
            match tokio::time::timeout(sh.timeout, fut).await {
                Ok(Ok((status, x_cache, body_len))) => RateOutcome::Response {
                    status,
                    x_cache,
                    body_len,
                },
                Ok(Err(e)) => {
                    sender = None;
                    RateOutcome::Error(e)
                }
                Err(_) => {
                    sender = None;
                    RateOutcome::Timeout
                }
            }
        };
        let done = Instant::now();
        sh.recs.lock().expect("recs lock").push(CycleRec {
            url: sh.url,
            scheduled: job.scheduled,
            sent,
            done,
            outcome,
        });
    }
}

/// Counts of one timeline bucket (or of the whole run).
#[derive(Default)]
struct CycleTally {
    scheduled: u64,
    ok: u64,
    non2xx: u64,
    errors: u64,
    timeouts: u64,
    status: BTreeMap<String, u64>,
    x_cache: BTreeMap<String, u64>,
    latency: Vec<f64>,
}

impl CycleTally {
    fn add(&mut self, r: &CycleRec) {
        match &r.outcome {
            RateOutcome::Response { status, x_cache, .. } => {
                self.latency
                    .push(ms(r.done.saturating_duration_since(r.scheduled)));
                *self.status.entry(status.to_string()).or_default() += 1;
                *self.x_cache.entry(x_cache.clone()).or_default() += 1;
                if (200..300).contains(status) {
                    self.ok += 1;
                } else {
                    self.non2xx += 1;
                }
            }
            RateOutcome::Error(_) => self.errors += 1,
            RateOutcome::Timeout => {
                self.errors += 1;
                self.timeouts += 1;
            }
        }
    }

    fn json(&mut self, t_s: f64) -> Value {
        self.latency.sort_by(|a, b| a.total_cmp(b));
        let lat = if self.latency.is_empty() {
            Value::Null
        } else {
            json!({
                "p50": pct(&self.latency, 50.0),
                "p99": pct(&self.latency, 99.0),
                "max": round3(self.latency[self.latency.len() - 1]),
            })
        };
        json!({
            "t_s": round3(t_s),
            "scheduled": self.scheduled,
            "answered": self.ok + self.non2xx + self.errors,
            "ok": self.ok,
            "non_2xx": self.non2xx,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "status": self.status,
            "x_cache": self.x_cache,
            "latency_ms": lat,
        })
    }
}

async fn cycle(args: CycleArgs) -> Result<Value, String> {
    if !(args.rate.is_finite() && args.rate > 0.0) {
        return Err("--rate must be > 0".into());
    }
    if !(args.duration_s.is_finite() && args.duration_s > 0.0) {
        return Err("--duration-s must be > 0".into());
    }
    if args.connections == 0 || args.keys == 0 || args.bucket_ms == 0 {
        return Err("--connections, --keys and --bucket-ms must be > 0".into());
    }
    // per URL: the target (for the address) and the path template
    let mut targets = Vec::with_capacity(args.urls.len());
    for url in &args.urls {
        if !url.contains("{id}") {
            return Err(format!("--url must contain {{id}}: {url}"));
        }
        let target = parse_target(&url.replace("{id}", "0"))?;
        let template = url
            .find(&target.authority)
            .map(|i| url[i + target.authority.len()..].to_owned())
            .filter(|p| p.contains("{id}"))
            .ok_or_else(|| format!("{{id}} must be in the path of --url: {url}"))?;
        targets.push((target, template));
    }
    let u = targets.len() as u64;

    // all connections up before the clock starts
    let mut firsts = Vec::with_capacity(targets.len());
    for (target, _) in &targets {
        let mut conns = Vec::with_capacity(args.connections);
        for _ in 0..args.connections {
            conns.push(
                rate_connect(target)
                    .await
                    .map_err(|e| format!("setting up connections to {}: {e}", target.url))?,
            );
        }
        firsts.push(conns);
    }

    let total_n = (args.rate * args.duration_s).ceil() as u64;
    let recs = Arc::new(std::sync::Mutex::new(Vec::with_capacity(total_n as usize)));
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let reconnects = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let connect_failures = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut txs = Vec::with_capacity(targets.len());
    let mut templates = Vec::with_capacity(targets.len());
    let mut workers = Vec::new();
    for (i, ((target, template), conns)) in targets.into_iter().zip(firsts).enumerate() {
        let (tx, rx) = mpsc::unbounded_channel::<CycleJob>();
        txs.push(tx);
        templates.push(template);
        let sh = Arc::new(CycleShared {
            target,
            url: i,
            timeout: Duration::from_secs_f64(args.timeout_s),
            queue: tokio::sync::Mutex::new(rx),
            recs: recs.clone(),
            sent: sent.clone(),
            reconnects: reconnects.clone(),
            connect_failures: connect_failures.clone(),
        });
        for s in conns {
            workers.push(tokio::spawn(cycle_worker(sh.clone(), s)));
        }
    }

    let start = Instant::now() + Duration::from_millis(50);
    let start_unix_ms = (SystemTime::now() + Duration::from_millis(50))
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let stop = Arc::new(AtomicBool::new(false));
    let pacer = {
        let stop = stop.clone();
        let rate = args.rate;
        let (first_id, keys) = (args.first_id, args.keys);
        std::thread::spawn(move || {
            // 1 ns timer slack for this thread (default 50 µs): sleeps end on time
            // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
            }
            for j in 0..total_n {
                let t = start + Duration::from_secs_f64(j as f64 / rate);
                let now = Instant::now();
                if t > now {
                    std::thread::sleep(t - now);
                }
                let url = (j % u) as usize;
                let id = first_id + (j / u) % keys;
                let job = CycleJob {
                    scheduled: t,
                    path: templates[url].replace("{id}", &id.to_string()),
                };
                if stop.load(Ordering::Relaxed) || txs[url].send(job).is_err() {
                    return;
                }
            }
            // dropping the senders closes the queues: the workers end once they are empty
        })
    };

    let last_scheduled = start + Duration::from_secs_f64(total_n.saturating_sub(1) as f64 / args.rate);
    let deadline = tokio::time::Instant::from_std(last_scheduled + Duration::from_secs_f64(args.drain_s));
    let joined = tokio::time::timeout_at(deadline, async {
        for w in workers {
            let _ = w.await;
        }
    })
    .await;
    let drained = joined.is_ok();
    stop.store(true, Ordering::Relaxed);
    let _ = pacer.join();

    let recs = std::mem::take(&mut *recs.lock().expect("recs lock"));
    let sent = sent.load(Ordering::Relaxed);
    let bucket = Duration::from_millis(args.bucket_ms);
    let n_buckets = ((args.duration_s * 1000.0) / args.bucket_ms as f64).ceil().max(1.0) as usize;
    let mut buckets: Vec<CycleTally> = (0..n_buckets).map(|_| CycleTally::default()).collect();
    // scheduled per bucket, from the schedule itself (whether sent or not)
    for j in 0..total_n {
        let at = Duration::from_secs_f64(j as f64 / args.rate);
        let b = ((at.as_nanos() / bucket.as_nanos()) as usize).min(n_buckets - 1);
        buckets[b].scheduled += 1;
    }
    let mut all = CycleTally {
        scheduled: total_n,
        ..CycleTally::default()
    };
    let mut per_url: Vec<CycleTally> = (0..u).map(|_| CycleTally::default()).collect();
    let mut service = Vec::with_capacity(recs.len());
    let mut lag = Vec::with_capacity(recs.len());
    let mut error_samples: BTreeMap<String, u64> = BTreeMap::new();
    let (mut first_sent, mut last_done) = (None::<Instant>, start);
    for r in &recs {
        let b = ((r.scheduled.saturating_duration_since(start).as_nanos() / bucket.as_nanos()) as usize)
            .min(n_buckets - 1);
        buckets[b].add(r);
        all.add(r);
        per_url[r.url].add(r);
        first_sent = Some(first_sent.map_or(r.sent, |f| f.min(r.sent)));
        last_done = last_done.max(r.done);
        lag.push(ms(r.sent.saturating_duration_since(r.scheduled)));
        match &r.outcome {
            RateOutcome::Response { .. } => service.push(ms(r.done.saturating_duration_since(r.sent))),
            RateOutcome::Error(e) => *error_samples.entry(e.clone()).or_default() += 1,
            RateOutcome::Timeout => *error_samples.entry("timeout".into()).or_default() += 1,
        }
    }
    let finished = recs.len() as u64;
    let timeline: Vec<Value> = buckets
        .iter_mut()
        .enumerate()
        .map(|(i, b)| b.json(i as f64 * args.bucket_ms as f64 / 1000.0))
        .collect();
    let per_url: Vec<Value> = per_url
        .iter_mut()
        .zip(&args.urls)
        .map(|(t, url)| {
            let mut v = t.json(0.0);
            v["url"] = json!(url);
            v
        })
        .collect();
    let mut totals = all.json(0.0);
    let span = last_done
        .saturating_duration_since(first_sent.unwrap_or(start))
        .as_secs_f64();

    Ok(json!({
        "mode": "cycle",
        "urls": args.urls,
        "first_id": args.first_id,
        "keys": args.keys,
        "rate_rps": args.rate,
        "duration_s": args.duration_s,
        "connections_per_url": args.connections,
        "drain_s": args.drain_s,
        "timeout_s": args.timeout_s,
        "bucket_ms": args.bucket_ms,
        "start_unix_ms": start_unix_ms,
        "scheduled": total_n,
        "sent": sent,
        "ok": totals["ok"].take(),
        "non_2xx": totals["non_2xx"].take(),
        "errors": totals["errors"].take(),
        "timeouts": totals["timeouts"].take(),
        "unsent": total_n.saturating_sub(sent),
        "unfinished": sent.saturating_sub(finished),
        "drained": drained,
        "first_send_to_last_answer_s": round3(span),
        "reconnects": reconnects.load(Ordering::Relaxed),
        "connect_failures": connect_failures.load(Ordering::Relaxed),
        "latency_ms": rate_summary(&mut all.latency),
        "service_time_ms": rate_summary(&mut service),
        "send_lag_ms": rate_summary(&mut lag),
        "x_cache": totals["x_cache"].take(),
        "status": totals["status"].take(),
        "error_samples": error_samples,
        "per_url": per_url,
        "timeline": timeline,
    }))
}

// --- stale -----------------------------------------------------------------------------

/// A small, fast PRNG (SplitMix64) for the key and instance choices: no dependency, and a
/// reported seed makes a run's choices repeatable.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the modulo bias is negligible for small n).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A write: its key, the version its answer returned and when that answer arrived.
#[derive(Clone, Copy, Debug)]
struct StaleWrite {
    key: u32,
    version: u64,
    done: Instant,
}

/// A read: its key, instance, when it was sent, the version its body returned.
#[derive(Clone, Debug)]
struct StaleRead {
    key: u32,
    inst: u16,
    sent: Instant,
    version: u64,
    x_cache: String,
}

/// What one loop did.
#[derive(Default)]
struct StaleOut {
    /// A writer loop (else a reader).
    write: bool,
    writes: Vec<StaleWrite>,
    reads: Vec<StaleRead>,
    requests: u64,
    errors: BTreeMap<String, u64>,
    error_samples: BTreeMap<String, u64>,
    status: BTreeMap<String, u64>,
    latency_ms: Vec<f64>,
    reconnects: u64,
    hit_request_cap: bool,
}

impl StaleOut {
    fn error(&mut self, kind: &str, msg: String) {
        *self.errors.entry(kind.to_owned()).or_default() += 1;
        // a few distinct messages are enough to tell what went wrong
        if self.error_samples.len() < 20 || self.error_samples.contains_key(&msg) {
            *self.error_samples.entry(msg).or_default() += 1;
        }
    }
}

struct StaleShared {
    targets: Vec<Target>,
    /// Path of each key (index = key number).
    paths: Vec<String>,
    keys: Vec<String>,
    start: Instant,
    deadline: Instant,
    timeout: Duration,
    max_requests: u64,
}

fn put_request(t: &Target, path: &str) -> Request<Empty<Bytes>> {
    Request::builder()
        .method(hyper::Method::PUT)
        .uri(path)
        .header(HOST, t.authority.as_str())
        .header(USER_AGENT, "cacheguard-bench-loadgen")
        .header(hyper::header::CONTENT_LENGTH, "0")
        .body(Empty::new())
        .expect("valid request")
}

/// The `version` of a KV answer body `{"key":"…","version":N}`; checks the key too.
fn kv_version(body: &[u8], key: &str) -> Result<u64, (&'static str, String)> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ("bad_body", format!("body is not JSON: {e}")))?;
    if v.get("key").and_then(Value::as_str) != Some(key) {
        return Err((
            "wrong_key",
            format!("answer for key {} carried key {}", key, v["key"]),
        ));
    }
    v.get("version")
        .and_then(Value::as_u64)
        .ok_or_else(|| ("bad_body", "no integer \"version\" in the body".to_owned()))
}

/// One writer (`write`) or reader loop, until the deadline or the request cap.
async fn stale_loop(
    sh: Arc<StaleShared>,
    write: bool,
    seed: u64,
    mut senders: Vec<Option<http1::SendRequest<Empty<Bytes>>>>,
) -> StaleOut {
    let mut rng = SplitMix64(seed);
    let mut out = StaleOut {
        write,
        ..StaleOut::default()
    };
    tokio::time::sleep_until(tokio::time::Instant::from_std(sh.start)).await;
    loop {
        if Instant::now() >= sh.deadline {
            break;
        }
        if out.requests >= sh.max_requests {
            out.hit_request_cap = true;
            break;
        }
        out.requests += 1;
        let key = rng.below(sh.keys.len() as u64) as usize;
        let inst = rng.below(sh.targets.len() as u64) as usize;
        let target = &sh.targets[inst];

        // a usable connection: the open one, or a new one when the server closed it
        let slot = &mut senders[inst];
        let usable = match slot.as_mut() {
            Some(s) if !s.is_closed() => matches!(
                tokio::time::timeout(sh.timeout, s.ready()).await,
                Ok(Ok(()))
            ),
            _ => false,
        };
        if !usable {
            *slot = None;
            out.reconnects += 1;
            match rate_connect(target).await {
                Ok(s) => *slot = Some(s),
                Err(e) => {
                    out.error("connect", format!("{}: {e}", target.url));
                    // do not spin on an instance that is down
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            }
        }
        let Some(sender) = slot.as_mut() else {
            continue;
        };

        let path = &sh.paths[key];
        let req = if write {
            put_request(target, path)
        } else {
            get(target, path)
        };
        let sent = Instant::now();
        let fut = async {
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| format!("request: {e}"))?;
            let status = resp.status().as_u16();
            let xc = x_cache_of(&resp);
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("body: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, xc, body))
        };
        let result = tokio::time::timeout(sh.timeout, fut).await;
        let done = Instant::now();
        let (status, x_cache, body) = match result {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                *slot = None;
                out.error("request", e);
                continue;
            }
            Err(_) => {
                *slot = None;
                out.error(
                    "timeout",
                    format!("no whole answer within {:?}", sh.timeout),
                );
                continue;
            }
        };
        out.latency_ms
            .push(ms(done.saturating_duration_since(sent)));
        *out.status.entry(status.to_string()).or_default() += 1;
        if !(200..300).contains(&status) {
            out.error(
                &format!("status_{status}"),
                format!(
                    "{} {path}: status {status}",
                    if write { "PUT" } else { "GET" }
                ),
            );
            continue;
        }
        let version = match kv_version(&body, &sh.keys[key]) {
            Ok(v) => v,
            Err((kind, msg)) => {
                out.error(kind, msg);
                continue;
            }
        };
        if write {
            out.writes.push(StaleWrite {
                key: key as u32,
                version,
                done,
            });
        } else {
            out.reads.push(StaleRead {
                key: key as u32,
                inst: inst as u16,
                sent,
                version,
                x_cache,
            });
        }
    }
    out
}

/// The stale-read figures of one run (see the module docs).
struct StaleAnalysis {
    /// Per write, in ms (0 when no read saw an older version after it returned).
    windows_ms: Vec<f64>,
    /// Writes after whose return at least one read of the key saw an older version.
    writes_with_stale_reads: u64,
    stale_reads_total: u64,
    /// Indices (into the reads) of the reads stale more than the delay after a write.
    stale_after_delay: Vec<usize>,
    /// Per stale-after-delay read: (read start − return of the oldest write it missed, in
    /// ms, the newest version returned by a write more than the delay before it).
    stale_after_delay_detail: Vec<(f64, u64)>,
}

/// Stale windows and stale reads. Per key: with the reads sorted by version, the latest
/// start among reads older than v is a prefix maximum, so a write's window is one binary
/// search; with the writes sorted by return time, the newest version returned before t is a
/// prefix maximum too. O((W + R) log) in all.
fn stale_analysis(
    keys: usize,
    writes: &[StaleWrite],
    reads: &[StaleRead],
    delay: Duration,
) -> StaleAnalysis {
    let mut w_by_key: Vec<Vec<(Instant, u64)>> = vec![Vec::new(); keys];
    for w in writes {
        w_by_key[w.key as usize].push((w.done, w.version));
    }
    let mut r_by_key: Vec<Vec<usize>> = vec![Vec::new(); keys];
    for (i, r) in reads.iter().enumerate() {
        r_by_key[r.key as usize].push(i);
    }
    let mut a = StaleAnalysis {
        windows_ms: Vec::with_capacity(writes.len()),
        writes_with_stale_reads: 0,
        stale_reads_total: 0,
        stale_after_delay: Vec::new(),
        stale_after_delay_detail: Vec::new(),
    };
    for k in 0..keys {
        let ws = &mut w_by_key[k];
        ws.sort_by_key(|&(t, v)| (t, v));
        // reads of k by version; latest_start[i] = latest start among the first i + 1
        let mut rs: Vec<(u64, Instant)> = r_by_key[k]
            .iter()
            .map(|&i| (reads[i].version, reads[i].sent))
            .collect();
        rs.sort_by_key(|&(v, t)| (v, t));
        let mut latest_start = Vec::with_capacity(rs.len());
        for (i, &(_, t)) in rs.iter().enumerate() {
            latest_start.push(if i == 0 {
                t
            } else {
                t.max(latest_start[i - 1])
            });
        }
        for &(t_w, v) in ws.iter() {
            let older = rs.partition_point(|&(rv, _)| rv < v);
            match older.checked_sub(1).map(|i| latest_start[i]) {
                Some(latest) if latest >= t_w => {
                    a.writes_with_stale_reads += 1;
                    a.windows_ms.push(ms(latest - t_w));
                }
                _ => a.windows_ms.push(0.0),
            }
        }
        // newest_before[i] = the largest version among the first i + 1 writes by return time
        let mut newest_before = Vec::with_capacity(ws.len());
        for (i, &(_, v)) in ws.iter().enumerate() {
            newest_before.push(if i == 0 {
                v
            } else {
                v.max(newest_before[i - 1])
            });
        }
        for &ri in &r_by_key[k] {
            let r = &reads[ri];
            let n = ws.partition_point(|&(t_w, _)| t_w <= r.sent);
            if n > 0 && newest_before[n - 1] > r.version {
                a.stale_reads_total += 1;
            }
            let n = ws.partition_point(|&(t_w, _)| t_w + delay < r.sent);
            if n > 0 && newest_before[n - 1] > r.version {
                // how long after the oldest write it missed (writes sorted by return time)
                let missed = ws[..n]
                    .iter()
                    .find(|&&(_, v)| v > r.version)
                    .map_or(r.sent, |&(t, _)| t);
                a.stale_after_delay.push(ri);
                a.stale_after_delay_detail.push((
                    ms(r.sent.saturating_duration_since(missed)),
                    newest_before[n - 1],
                ));
            }
        }
    }
    a
}

async fn stale(args: StaleArgs) -> Result<Value, String> {
    if args.writers == 0 || args.readers == 0 {
        return Err("--writers and --readers must be > 0".into());
    }
    if args.keys == 0 || args.keys > u64::from(u32::MAX) {
        return Err("--keys must be in 1..=4294967295".into());
    }
    if args.urls.len() > usize::from(u16::MAX) {
        return Err("too many --url".into());
    }
    if !(args.duration_s.is_finite() && args.duration_s > 0.0) {
        return Err("--duration-s must be > 0".into());
    }
    if !(args.delay_ms.is_finite() && args.delay_ms >= 0.0) {
        return Err("--delay-ms must be ≥ 0".into());
    }
    if !(args.timeout_s.is_finite() && args.timeout_s > 0.0) {
        return Err("--timeout-s must be > 0".into());
    }
    if args.max_requests_per_loop == 0 {
        return Err("--max-requests-per-loop must be > 0".into());
    }
    if !args.path_template.starts_with('/') || !args.path_template.contains("{key}") {
        return Err(format!(
            "--path-template must start with / and contain {{key}}: {}",
            args.path_template
        ));
    }
    let targets = args
        .urls
        .iter()
        .map(|u| parse_target(u))
        .collect::<Result<Vec<_>, _>>()?;
    let keys: Vec<String> = (0..args.keys)
        .map(|i| format!("{}{i}", args.key_prefix))
        .collect();
    let paths: Vec<String> = keys
        .iter()
        .map(|k| args.path_template.replace("{key}", k))
        .collect();
    if let Some(bad) = paths.iter().find(|p| p.parse::<Uri>().is_err()) {
        return Err(format!("not a valid request path: {bad}"));
    }
    let seed = args.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });

    // every loop's connections up before the clock starts
    let loops = args.writers + args.readers;
    let mut conns = Vec::with_capacity(loops);
    for _ in 0..loops {
        let mut per_url = Vec::with_capacity(targets.len());
        for t in &targets {
            per_url.push(Some(
                rate_connect(t)
                    .await
                    .map_err(|e| format!("setting up connections to {}: {e}", t.url))?,
            ));
        }
        conns.push(per_url);
    }

    let timeout = Duration::from_secs_f64(args.timeout_s);
    let start = Instant::now() + Duration::from_millis(50);
    let deadline = start + Duration::from_secs_f64(args.duration_s);
    let sh = Arc::new(StaleShared {
        targets,
        paths,
        keys,
        start,
        deadline,
        timeout,
        max_requests: args.max_requests_per_loop,
    });
    let mut seeder = SplitMix64(seed);
    let mut handles = Vec::with_capacity(loops);
    for (i, c) in conns.into_iter().enumerate() {
        let write = i < args.writers;
        handles.push(tokio::spawn(stale_loop(
            sh.clone(),
            write,
            seeder.next_u64(),
            c,
        )));
    }
    // each request is bounded (connect 5 s, then the timeout for ready and for the
    // answer): this backstop only catches a bug
    let backstop = tokio::time::Instant::from_std(deadline + 2 * timeout + Duration::from_secs(10));
    let mut outs = Vec::with_capacity(loops);
    let mut lost = 0u64;
    for h in handles {
        match tokio::time::timeout_at(backstop, h).await {
            Ok(Ok(out)) => outs.push(out),
            _ => lost += 1,
        }
    }
    let ended = Instant::now();

    // --- aggregate ---
    let mut writes = Vec::new();
    let mut reads = Vec::new();
    let (mut write_requests, mut read_requests, mut reconnects, mut capped) =
        (0u64, 0u64, 0u64, 0u64);
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut error_samples: BTreeMap<String, u64> = BTreeMap::new();
    let mut write_status: BTreeMap<String, u64> = BTreeMap::new();
    let mut read_status: BTreeMap<String, u64> = BTreeMap::new();
    let (mut write_lat, mut read_lat) = (Vec::new(), Vec::new());
    for out in outs {
        if out.write {
            write_requests += out.requests;
            write_lat.extend(out.latency_ms);
            for (k, v) in out.status {
                *write_status.entry(k).or_default() += v;
            }
        } else {
            read_requests += out.requests;
            read_lat.extend(out.latency_ms);
            for (k, v) in out.status {
                *read_status.entry(k).or_default() += v;
            }
        }
        writes.extend(out.writes);
        reads.extend(out.reads);
        reconnects += out.reconnects;
        capped += u64::from(out.hit_request_cap);
        for (k, v) in out.errors {
            *errors.entry(k).or_default() += v;
        }
        for (k, v) in out.error_samples {
            if error_samples.len() < 20 || error_samples.contains_key(&k) {
                *error_samples.entry(k).or_default() += v;
            }
        }
    }
    let delay = Duration::from_secs_f64(args.delay_ms / 1000.0);
    let a = stale_analysis(args.keys as usize, &writes, &reads, delay);

    let n_inst = sh.targets.len();
    let mut reads_by_inst = vec![0u64; n_inst];
    let mut read_x_cache: BTreeMap<String, u64> = BTreeMap::new();
    for r in &reads {
        reads_by_inst[r.inst as usize] += 1;
        *read_x_cache.entry(r.x_cache.clone()).or_default() += 1;
    }
    let mut stale_by_inst = vec![0u64; n_inst];
    let mut stale_x_cache: BTreeMap<String, u64> = BTreeMap::new();
    let mut ages = Vec::with_capacity(a.stale_after_delay.len());
    let mut samples = Vec::new();
    for (&ri, &(age, newest)) in a.stale_after_delay.iter().zip(&a.stale_after_delay_detail) {
        let r = &reads[ri];
        stale_by_inst[r.inst as usize] += 1;
        *stale_x_cache.entry(r.x_cache.clone()).or_default() += 1;
        ages.push(age);
        if samples.len() < args.samples {
            samples.push(json!({
                "key": sh.keys[r.key as usize],
                "instance": r.inst,
                "url": sh.targets[r.inst as usize].url,
                "x_cache": r.x_cache,
                "started_ms": round3(ms(r.sent.saturating_duration_since(start))),
                "version_read": r.version,
                "newest_version_returned_before_delay": newest,
                "ms_after_oldest_missed_write": round3(age),
            }));
        }
    }
    let mut windows = a.windows_ms;
    let elapsed_s = ended.saturating_duration_since(start).as_secs_f64();
    let per_s = |n: usize| round3(n as f64 / args.duration_s);
    let error_total: u64 = errors.values().sum();

    Ok(json!({
        "mode": "stale",
        "urls": args.urls,
        "path_template": args.path_template,
        "writers": args.writers,
        "readers": args.readers,
        "keys": args.keys,
        "key_prefix": args.key_prefix,
        "duration_s": args.duration_s,
        "delay_ms": args.delay_ms,
        "max_requests_per_loop": args.max_requests_per_loop,
        "timeout_s": args.timeout_s,
        "seed": seed,
        "elapsed_s": round3(elapsed_s),
        "writes": writes.len(),
        "reads": reads.len(),
        "writes_per_s": per_s(writes.len()),
        "reads_per_s": per_s(reads.len()),
        "write_requests": write_requests,
        "read_requests": read_requests,
        "errors": error_total,
        "errors_by_kind": errors,
        "error_samples": error_samples,
        "reconnects": reconnects,
        "loops_lost": lost,
        "loops_at_request_cap": capped,
        "stale_window_ms": rate_summary(&mut windows),
        "writes_with_stale_reads": a.writes_with_stale_reads,
        "stale_reads_total": a.stale_reads_total,
        "stale_reads_after_delay": a.stale_after_delay.len(),
        "stale_after_delay_by_instance": stale_by_inst,
        "stale_after_delay_by_x_cache": stale_x_cache,
        "stale_after_delay_age_ms": rate_summary(&mut ages),
        "stale_after_delay_samples": samples,
        "reads_by_instance": reads_by_inst,
        "read_x_cache": read_x_cache,
        "read_status": read_status,
        "write_status": write_status,
        "read_latency_ms": rate_summary(&mut read_lat),
        "write_latency_ms": rate_summary(&mut write_lat),
    }))
}

fn main() {
    let cli = Cli::parse();
    let threads = match &cli.cmd {
        Cmd::Stampede(a) => a.threads,
        Cmd::Rate(a) => a.threads,
        Cmd::List(a) => a.threads,
        Cmd::Cycle(a) => a.threads,
        Cmd::Stale(a) => a.threads,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = match cli.cmd {
        Cmd::Stampede(args) => rt.block_on(stampede(args)),
        Cmd::Rate(args) => rt.block_on(rate(args)),
        Cmd::List(args) => rt.block_on(list(args)),
        Cmd::Cycle(args) => rt.block_on(cycle(args)),
        Cmd::Stale(args) => rt.block_on(stale(args)),
    };
    // do not wait for abandoned tasks (requests still in flight after the drain deadline)
    rt.shutdown_background();
    match result {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("loadgen: {e}");
            std::process::exit(2);
        }
    }
}

#[cfg(test)]
mod stale_tests {
    use super::*;

    fn w(key: u32, version: u64, at: Instant) -> StaleWrite {
        StaleWrite {
            key,
            version,
            done: at,
        }
    }

    fn r(key: u32, version: u64, at: Instant) -> StaleRead {
        StaleRead {
            key,
            inst: 0,
            sent: at,
            version,
            x_cache: "MISS".into(),
        }
    }

    fn whole_ms(v: &[f64]) -> Vec<i64> {
        v.iter().map(|x| x.round() as i64).collect()
    }

    fn detail(a: &StaleAnalysis) -> Vec<(i64, u64)> {
        a.stale_after_delay_detail
            .iter()
            .map(|&(age, v)| (age.round() as i64, v))
            .collect()
    }

    #[test]
    fn windows_and_stale_reads() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let writes = [w(0, 1, at(100)), w(0, 2, at(500)), w(1, 1, at(100))];
        let reads = [
            r(0, 0, at(50)),  // before any write: not stale
            r(0, 0, at(120)), // 20 ms after v1 returned, older than v1
            r(0, 0, at(350)), // 250 ms after v1: stale after a 200 ms delay
            r(0, 1, at(400)), // fresh
            r(0, 1, at(510)), // 10 ms after v2, older than v2
            r(0, 2, at(900)), // fresh
            r(1, 1, at(100)), // key 1: at the very instant of its write, fresh
        ];
        let a = stale_analysis(2, &writes, &reads, Duration::from_millis(200));
        // write order: key 0 (v1 at 100, v2 at 500), then key 1
        assert_eq!(whole_ms(&a.windows_ms), vec![250, 10, 0]);
        assert_eq!(a.writes_with_stale_reads, 2);
        assert_eq!(a.stale_reads_total, 3);
        assert_eq!(a.stale_after_delay, vec![2]);
        assert_eq!(detail(&a), vec![(250, 1)]);
    }

    #[test]
    fn a_read_older_than_several_writes_counts_once() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let writes = [w(0, 2, at(10)), w(0, 1, at(20)), w(0, 3, at(30))];
        let reads = [r(0, 1, at(300))];
        let a = stale_analysis(1, &writes, &reads, Duration::from_millis(100));
        // sorted by return time: v2 (stale: 290 ms), v1 (not stale), v3 (270 ms)
        assert_eq!(whole_ms(&a.windows_ms), vec![290, 0, 270]);
        assert_eq!(a.stale_reads_total, 1);
        assert_eq!(detail(&a), vec![(290, 3)]);
    }
}
