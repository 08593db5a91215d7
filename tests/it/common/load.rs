//! Load for the integration tests, two kinds:
//!
//! - [`Load`]: a closed-loop GET load for failover tests: `conns` tasks, each sending one
//!   request at a time over the shared keep-alive [`HttpClient`], round-robin over the
//!   instances and over a path function. Bounded by a duration and a request count;
//!   [`LoadRun::stop`] ends it early. Every answer is tallied, and the non-2xx ones are
//!   kept (first 20) with their bodies, so a failure message shows what the client saw.
//! - [`burst`]: pre-warmed connections ([`open_warm`]) released together behind a barrier,
//!   each request measuring its own latency; [`hit_floor`] measures the machine's floor for
//!   such a burst, and [`percentile`] / [`latency_summary`] read the latencies.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use http::Method;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Barrier;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::client::{TestBody, build_request, collect, empty_body, within};
use super::{HttpClient, Resp, join_within, url};

/// One answer on the timeline.
#[derive(Clone, Debug)]
pub struct Seen {
    /// Since the load started.
    pub at: Duration,
    pub path: String,
    /// 0 for a transport error.
    pub status: u16,
    pub x_cache: String,
}

/// What a load run saw.
#[derive(Debug, Default)]
pub struct Tally {
    pub answers: u64,
    pub by_status: BTreeMap<u16, u64>,
    pub by_x_cache: BTreeMap<String, u64>,
    /// The first non-2xx answers (and transport errors), with bodies.
    pub bad: Vec<String>,
    /// Answers whose body mentions `READONLY` (a demoted primary's error leaking out).
    pub readonly: u64,
    pub timeline: Vec<Seen>,
}

impl Tally {
    /// Answers that were not 2xx (transport errors included).
    pub fn non_2xx(&self) -> u64 {
        self.by_status
            .iter()
            .filter(|(s, _)| !(200..300).contains(*s))
            .map(|(_, n)| n)
            .sum()
    }

    fn merge(&mut self, other: Tally) {
        self.answers += other.answers;
        for (k, v) in other.by_status {
            *self.by_status.entry(k).or_default() += v;
        }
        for (k, v) in other.by_x_cache {
            *self.by_x_cache.entry(k).or_default() += v;
        }
        for b in other.bad {
            if self.bad.len() < 20 {
                self.bad.push(b);
            }
        }
        self.readonly += other.readonly;
        self.timeline.extend(other.timeline);
    }
}

pub type PathFn = Arc<dyn Fn(u64) -> String + Send + Sync>;

#[derive(Clone)]
pub struct Load {
    addrs: Vec<SocketAddr>,
    path: PathFn,
    conns: usize,
    duration: Duration,
    max_requests: u64,
    pause: Duration,
}

impl Load {
    pub fn new(addrs: &[SocketAddr], path: impl Fn(u64) -> String + Send + Sync + 'static) -> Load {
        Load {
            addrs: addrs.to_vec(),
            path: Arc::new(path),
            conns: 8,
            duration: Duration::from_secs(10),
            max_requests: 1_000_000,
            pause: Duration::ZERO,
        }
    }

    pub fn conns(mut self, n: usize) -> Load {
        self.conns = n.max(1);
        self
    }

    pub fn duration(mut self, d: Duration) -> Load {
        self.duration = d;
        self
    }

    pub fn max_requests(mut self, n: u64) -> Load {
        self.max_requests = n;
        self
    }

    /// A pause after each answer, per connection (to keep a debug build's load modest).
    pub fn pause(mut self, d: Duration) -> Load {
        self.pause = d;
        self
    }

    pub fn start(self) -> LoadRun {
        let stop = Arc::new(AtomicBool::new(false));
        let next = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let deadline = started + self.duration;
        let client = HttpClient::new();
        let tasks = (0..self.conns)
            .map(|_| {
                let load = self.clone();
                let stop = stop.clone();
                let next = next.clone();
                let client = client.clone();
                tokio::spawn(async move {
                    let mut tally = Tally::default();
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        let n = next.fetch_add(1, Ordering::Relaxed);
                        if n >= load.max_requests {
                            break;
                        }
                        let path = (load.path)(n);
                        let addr = load.addrs[(n as usize) % load.addrs.len()];
                        let answer = tokio::time::timeout(
                            Duration::from_secs(10),
                            client.try_get(&url(addr, &path)),
                        )
                        .await;
                        let (status, x_cache, body) = match answer {
                            Ok(Ok(r)) => (r.status.as_u16(), r.x_cache(), r.text()),
                            Ok(Err(e)) => (0, "<error>".to_owned(), e),
                            Err(_) => (0, "<timeout>".to_owned(), "no answer in 10 s".to_owned()),
                        };
                        tally.answers += 1;
                        *tally.by_status.entry(status).or_default() += 1;
                        *tally.by_x_cache.entry(x_cache.clone()).or_default() += 1;
                        if body.contains("READONLY") {
                            tally.readonly += 1;
                        }
                        if !(200..300).contains(&status) && tally.bad.len() < 20 {
                            tally.bad.push(format!(
                                "{:?} {addr}{path}: {status} {x_cache} {body:?}",
                                started.elapsed()
                            ));
                        }
                        tally.timeline.push(Seen {
                            at: started.elapsed(),
                            path,
                            status,
                            x_cache,
                        });
                        if !load.pause.is_zero() {
                            tokio::time::sleep(load.pause).await;
                        }
                    }
                    tally
                })
            })
            .collect();
        LoadRun {
            stop,
            tasks,
            started,
            limit: self.duration + Duration::from_secs(20),
        }
    }
}

pub struct LoadRun {
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Tally>>,
    pub started: Instant,
    limit: Duration,
}

impl LoadRun {
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Stops the load and returns what it saw (bounded: a task stuck past the load's
    /// duration plus 20 s fails the test).
    pub async fn finish(self) -> Tally {
        self.stop();
        self.join().await
    }

    /// Lets the load run to its end (its duration or its request count) and returns what it
    /// saw; bounded as [`LoadRun::finish`].
    pub async fn join(self) -> Tally {
        let mut tally = Tally::default();
        let all = async {
            for task in self.tasks {
                tally.merge(task.await.expect("load task panicked"));
            }
        };
        tokio::time::timeout(self.limit, all)
            .await
            .expect("the load did not stop in time");
        tally.timeline.sort_by_key(|s| s.at);
        tally
    }
}

// === warm connections and bursts ===

/// Upper bound for one request on a warm connection.
pub const SHOT_TIMEOUT: Duration = Duration::from_secs(15);

/// One HTTP/1.1 connection, opened and used once before the measured request, so the
/// server has accepted it and its connection task runs.
pub struct WarmConn {
    addr: SocketAddr,
    sender: SendRequest<TestBody>,
    task: JoinHandle<()>,
}

impl Drop for WarmConn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl WarmConn {
    /// Connects to `addr` and sends `GET {warm_path}` (expected to answer 2xx).
    pub async fn open(addr: SocketAddr, warm_path: &str) -> Result<WarmConn, String> {
        let stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
            .await
            .map_err(|_| format!("connect {addr} timed out"))?
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut warm = WarmConn { addr, sender, task };
        let r = warm.get(warm_path).await?;
        if !r.status.is_success() {
            return Err(format!("warm-up GET {warm_path} via {addr}: {r}"));
        }
        Ok(warm)
    }

    /// `GET path` on this connection, bounded by [`SHOT_TIMEOUT`].
    pub async fn get(&mut self, path: &str) -> Result<Resp, String> {
        self.send(Method::GET, path, empty_body()).await
    }

    /// `method path` with `body` on this connection, bounded by [`SHOT_TIMEOUT`].
    pub async fn send(
        &mut self,
        method: Method,
        path: &str,
        body: TestBody,
    ) -> Result<Resp, String> {
        let host = self.addr.to_string();
        let req = build_request(method, path, &[("host", &host)], body)?;
        within(SHOT_TIMEOUT, async {
            self.sender
                .ready()
                .await
                .map_err(|e| format!("connection not ready: {e}"))?;
            let resp = self
                .sender
                .send_request(req)
                .await
                .map_err(|e| format!("request error: {e:?}"))?;
            collect(resp).await
        })
        .await
    }
}

/// Opens `per_instance` warm connections to each of `addrs` (tagged with the instance
/// index), at most 64 connects at a time.
pub async fn open_warm(
    addrs: &[SocketAddr],
    per_instance: usize,
    warm_path: &str,
) -> Vec<(usize, WarmConn)> {
    let targets: Vec<(usize, SocketAddr)> = (0..per_instance)
        .flat_map(|_| addrs.iter().copied().enumerate())
        .collect();
    let sem = Arc::new(tokio::sync::Semaphore::new(64));
    let handles: Vec<_> = targets
        .into_iter()
        .map(|(i, addr)| {
            let sem = sem.clone();
            let warm_path = warm_path.to_string();
            tokio::spawn(async move {
                let _permit = sem.acquire_owned().await.expect("semaphore");
                (i, WarmConn::open(addr, &warm_path).await)
            })
        })
        .collect();
    join_within(handles, Duration::from_secs(30), "warm-up of connections")
        .await
        .into_iter()
        .map(|(i, conn)| {
            (
                i,
                conn.unwrap_or_else(|e| panic!("warm-up to instance {i}: {e}")),
            )
        })
        .collect()
}

/// One measured request of a burst.
#[derive(Debug)]
pub struct Shot {
    pub instance: usize,
    pub result: Result<Resp, String>,
    /// From this request's release (right after the barrier) to its complete response.
    pub latency: Duration,
    /// When the complete response was read.
    pub done: Instant,
}

/// Sends `GET path` on every connection at once: each request waits on one barrier, the
/// barrier opens, and each measures its own latency from that moment. Bounded by
/// `timeout` overall. Returns when every request has answered.
pub async fn burst(conns: Vec<(usize, WarmConn)>, path: &str, timeout: Duration) -> Vec<Shot> {
    let barrier = Arc::new(Barrier::new(conns.len() + 1));
    let handles: Vec<_> = conns
        .into_iter()
        .map(|(instance, mut conn)| {
            let barrier = barrier.clone();
            let path = path.to_string();
            tokio::spawn(async move {
                barrier.wait().await;
                let started = Instant::now();
                let result = conn.get(&path).await;
                let done = Instant::now();
                Shot {
                    instance,
                    result,
                    latency: done - started,
                    done,
                }
            })
        })
        .collect();
    barrier.wait().await;
    let n = handles.len();
    join_within(handles, timeout, &format!("a burst of {n} requests")).await
}

/// `(status x-cache body) => count`, for failure messages.
pub fn outcomes(shots: &[Shot]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for s in shots {
        let k = match &s.result {
            Ok(r) => format!("{} {} {}", r.status.as_u16(), r.x_cache(), r.text()),
            Err(e) => format!("error: {e}"),
        };
        *out.entry(k).or_default() += 1;
    }
    out
}

/// The `p`-th percentile (0 < p ≤ 100) by nearest rank.
pub fn percentile(latencies: &[Duration], p: f64) -> Duration {
    assert!(!latencies.is_empty(), "percentile of no samples");
    let mut v = latencies.to_vec();
    v.sort();
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// `n/p50/p99/max` as text (`n=0` for no samples).
pub fn latency_summary(latencies: &[Duration]) -> String {
    if latencies.is_empty() {
        return "n=0".into();
    }
    format!(
        "n={} p50={:?} p99={:?} max={:?}",
        latencies.len(),
        percentile(latencies, 50.0),
        percentile(latencies, 99.0),
        percentile(latencies, 100.0)
    )
}

/// How long after the burst's first complete answer each answer completed.
pub fn completion_spread(shots: &[Shot]) -> Vec<Duration> {
    let Some(first) = shots.iter().map(|s| s.done).min() else {
        return Vec::new();
    };
    shots.iter().map(|s| s.done - first).collect()
}

/// The machine's floor for a burst of `n` simultaneous requests, from a burst of cache hits.
#[derive(Clone, Debug)]
pub struct Floor {
    /// p99 latency from release.
    pub latency_p99: Duration,
    /// p99 of [`completion_spread`].
    pub spread_p99: Duration,
    pub summary: String,
}

impl Floor {
    /// The larger of two measurements, field by field.
    pub fn max(self, other: Floor) -> Floor {
        Floor {
            latency_p99: self.latency_p99.max(other.latency_p99),
            spread_p99: self.spread_p99.max(other.spread_p99),
            summary: format!("{} | {}", self.summary, other.summary),
        }
    }
}

/// The machine's floor for a burst: `GET path` (expected to be a cache hit) on every
/// connection at once.
pub async fn hit_floor(conns: Vec<(usize, WarmConn)>, path: &str) -> Floor {
    let hits = burst(conns, path, Duration::from_secs(20)).await;
    assert!(
        hits.iter()
            .all(|s| matches!(&s.result, Ok(r) if r.status == 200 && r.is_hit())),
        "the calibration burst must be all hits: {:?}",
        outcomes(&hits)
    );
    let latencies: Vec<Duration> = hits.iter().map(|s| s.latency).collect();
    let spread = completion_spread(&hits);
    let spread_p99 = percentile(&spread, 99.0);
    Floor {
        latency_p99: percentile(&latencies, 99.0),
        spread_p99,
        summary: format!("{} spread-p99={spread_p99:?}", latency_summary(&latencies)),
    }
}

/// Whether the absolute latency bounds are enforced too (`CACHEGUARD_STRICT_LATENCY=1`;
/// meant for optimized builds on an idle machine); the default run relaxes them for a
/// shared machine (each test says how and why).
pub fn strict_latency() -> bool {
    std::env::var("CACHEGUARD_STRICT_LATENCY").is_ok_and(|v| v == "1")
}
