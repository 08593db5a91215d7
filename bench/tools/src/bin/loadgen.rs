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

fn main() {
    let cli = Cli::parse();
    let threads = match &cli.cmd {
        Cmd::Stampede(a) => a.threads,
        Cmd::Rate(a) => a.threads,
        Cmd::List(a) => a.threads,
        Cmd::Cycle(a) => a.threads,
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
