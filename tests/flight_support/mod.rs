//! Helpers shared by the breakdown-protection tests (`stampede.rs`, `stale.rs`,
//! `lock_failover.rs`): fleets of cacheguard processes, pre-warmed connections released
//! together behind a barrier with per-request latency, and metric readers.
//!
//! Included from each of those files with `#[path = "flight_support/mod.rs"] mod
//! flight_support;` (a subdirectory, so cargo does not build it as a test of its own).
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tempfile::TempDir;
use tokio::net::TcpStream;
use tokio::sync::Barrier;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::common::{
    CacheguardProcess, CgConfig, HttpClient, Resp, free_port, poll_until, prom, scrape,
    spawn_cacheguard_process,
};

/// Serializes the tests of one test binary: they measure latency on a 2-core machine, and
/// a neighbour's burst would be measured too. Hold the guard for the whole test.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Takes this test binary's serial lock (not poisoned by a failed test).
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    SERIAL.lock().await
}

/// Upper bound for one request on a warm connection.
pub const SHOT_TIMEOUT: Duration = Duration::from_secs(15);

// === processes ===

/// Cacheguard instances running as separate OS processes (each killed by PID on drop).
pub struct Fleet {
    pub procs: Vec<CacheguardProcess>,
    pub configs: Vec<PathBuf>,
    _dir: TempDir,
}

impl Fleet {
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.procs.iter().map(CacheguardProcess::addr).collect()
    }

    pub fn admin_addrs(&self) -> Vec<SocketAddr> {
        self.procs
            .iter()
            .map(CacheguardProcess::admin_addr)
            .collect()
    }

    /// Every process's captured output, for failure messages.
    pub fn output(&self) -> String {
        self.procs
            .iter()
            .enumerate()
            .map(|(i, p)| format!("=== instance {i} (pid {:?}) ===\n{}\n", p.pid(), p.output()))
            .collect()
    }
}

/// `n` distinct free loopback ports.
fn distinct_ports(n: usize) -> Vec<u16> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n * 20 {
        if out.len() == n {
            break;
        }
        let p = free_port();
        if seen.insert(p) {
            out.push(p);
        }
    }
    assert_eq!(out.len(), n, "could not find {n} distinct free ports");
    out
}

/// Starts `n` cacheguard processes from `cfg` (each with its own fixed loopback ports),
/// all at once, and waits until each answers `/healthz`.
pub async fn spawn_fleet(cfg: &CgConfig, n: usize) -> Fleet {
    let dir = tempfile::tempdir().expect("tempdir for fleet configs");
    let ports = distinct_ports(2 * n);
    let mut configs = Vec::with_capacity(n);
    for i in 0..n {
        let c = cfg
            .clone()
            .set_str("server", "listen", &format!("127.0.0.1:{}", ports[2 * i]))
            .set_str(
                "admin",
                "listen",
                &format!("127.0.0.1:{}", ports[2 * i + 1]),
            );
        let path = dir.path().join(format!("cacheguard-{i}.toml"));
        std::fs::write(&path, c.toml()).expect("write fleet config");
        configs.push(path);
    }
    let procs =
        futures_util::future::join_all(configs.iter().map(|p| spawn_cacheguard_process(p))).await;
    Fleet {
        procs,
        configs,
        _dir: dir,
    }
}

// === metrics ===

/// `/metrics` of one instance, parsed.
pub async fn metrics(client: &HttpClient, admin: SocketAddr) -> prom::Exposition {
    scrape(client, admin).await.1
}

/// `cacheguard_lock_events_total{outcome}` of one instance.
pub fn lock_events(exp: &prom::Exposition, outcome: &str) -> f64 {
    exp.sum("cacheguard_lock_events_total", &[("outcome", outcome)])
}

/// An unlabelled gauge or counter (0 when absent).
pub fn value(exp: &prom::Exposition, name: &str) -> f64 {
    exp.value(name).unwrap_or(0.0)
}

/// Sum of `cacheguard_lock_events_total{outcome}` over several instances.
pub async fn lock_events_sum(client: &HttpClient, admins: &[SocketAddr], outcome: &str) -> f64 {
    let mut total = 0.0;
    for admin in admins {
        total += lock_events(&metrics(client, *admin).await, outcome);
    }
    total
}

/// Waits (bounded) until every instance reports Redis up and the event bus subscribed:
/// before that an instance fills without the fleet lock (degraded), by design.
pub async fn wait_coordinated(client: &HttpClient, admins: &[SocketAddr]) {
    for admin in admins {
        let ok = poll_until(Duration::from_secs(10), Duration::from_millis(25), || {
            let client = client.clone();
            let admin = *admin;
            async move {
                let exp = metrics(&client, admin).await;
                (value(&exp, "cacheguard_redis_up") == 1.0
                    && value(&exp, "cacheguard_event_bus_subscribed") == 1.0)
                    .then_some(())
            }
        })
        .await;
        assert!(
            ok.is_some(),
            "instance with admin {admin}: Redis up + event bus subscribed not reported within 10s"
        );
    }
}

/// Waits (bounded) until `cacheguard_lock_waiters` ≥ `at_least` on `admin`.
pub async fn wait_for_lock_waiters(client: &HttpClient, admin: SocketAddr, at_least: f64) {
    let ok = poll_until(Duration::from_secs(3), Duration::from_millis(10), || {
        let client = client.clone();
        async move {
            let exp = metrics(&client, admin).await;
            (value(&exp, "cacheguard_lock_waiters") >= at_least).then_some(())
        }
    })
    .await;
    assert!(
        ok.is_some(),
        "instance with admin {admin}: no request registered as a lock waiter within 3s"
    );
}

// === warm connections and bursts ===

/// One HTTP/1.1 connection, opened and used once before the measured request, so the
/// server has accepted it and its connection task runs.
pub struct WarmConn {
    addr: SocketAddr,
    sender: SendRequest<Empty<Bytes>>,
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
        let req = Request::builder()
            .method("GET")
            .uri(path)
            .header("host", self.addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(|e| format!("bad request: {e}"))?;
        let fut = async {
            self.sender
                .ready()
                .await
                .map_err(|e| format!("connection not ready: {e}"))?;
            let resp = self
                .sender
                .send_request(req)
                .await
                .map_err(|e| format!("request error: {e:?}"))?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| format!("body error: {e:?}"))?
                .to_bytes();
            Ok(Resp {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(SHOT_TIMEOUT, fut)
            .await
            .map_err(|_| format!("timed out after {SHOT_TIMEOUT:?}"))?
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
    let mut out = Vec::with_capacity(handles.len());
    let all = async {
        for h in handles {
            let (i, conn) = h.await.expect("warm-up task panicked");
            out.push((
                i,
                conn.unwrap_or_else(|e| panic!("warm-up to instance {i}: {e}")),
            ));
        }
    };
    tokio::time::timeout(Duration::from_secs(30), all)
        .await
        .unwrap_or_else(|_| panic!("warm-up of connections did not finish within 30s"));
    out
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
    let all = async {
        let mut out = Vec::with_capacity(n);
        for h in handles {
            out.push(h.await.expect("burst task panicked"));
        }
        out
    };
    tokio::time::timeout(timeout, all)
        .await
        .unwrap_or_else(|_| panic!("a burst of {n} requests did not finish within {timeout:?}"))
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

/// `p50/p99/max` as text.
pub fn latency_summary(latencies: &[Duration]) -> String {
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

/// Whether the absolute latency bounds of the brief are enforced too
/// (`CACHEGUARD_STRICT_LATENCY=1`; meant for optimized builds on an idle machine).
pub fn strict_latency() -> bool {
    std::env::var("CACHEGUARD_STRICT_LATENCY").is_ok_and(|v| v == "1")
}

/// `CONFIG RESETSTAT`: zeroes Redis's per-command call counts.
pub async fn reset_command_stats(con: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(con)
        .await
        .expect("CONFIG RESETSTAT");
}

/// Calls per command since the last reset (`INFO commandstats`), e.g. `"get"`, `"evalsha"`.
pub async fn command_calls(con: &mut redis::aio::MultiplexedConnection) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .expect("INFO commandstats");
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}
