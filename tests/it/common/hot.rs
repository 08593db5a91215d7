//! Hot keys as tests drive and read them: a pipelining load generator that tallies every
//! answer, and the `/admin/hotkeys` view.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::client::parse_response;
use super::{HttpClient, url};

/// `GET /admin/hotkeys`.
pub async fn hotkeys(client: &HttpClient, admin: SocketAddr) -> Value {
    let r = client.get(&url(admin, "/admin/hotkeys")).await;
    assert_eq!(r.status, 200, "/admin/hotkeys: {r}");
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("/admin/hotkeys: {e}: {r}"))
}

/// The `hot_keys` list of `/admin/hotkeys`.
pub fn hot_list(v: &Value) -> Vec<Value> {
    v["hot_keys"]
        .as_array()
        .unwrap_or_else(|| panic!("/admin/hotkeys without a hot_keys array: {v}"))
        .clone()
}

/// `VmRSS` of this process (the cacheguard instances run in it), in bytes.
pub fn rss_bytes() -> u64 {
    status_bytes("self", "VmRSS:")
}

/// The process's peak resident memory (`VmHWM`) since start or the last reset (write `5`
/// to `/proc/self/clear_refs`).
pub fn peak_rss_bytes() -> u64 {
    status_bytes("self", "VmHWM:")
}

/// A `kB` field of `/proc/<process>/status` (`self`, or a child's PID), in bytes.
pub fn status_bytes(process: &str, field: &str) -> u64 {
    let path = format!("/proc/{process}/status");
    let status = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or_else(|| panic!("{field} in {path}"))
}

pub fn as_u64(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field} is not a number in {v}"))
}

// === load generation ===

/// One answer as the load generator saw it.
#[derive(Clone, Debug)]
pub struct Answer {
    pub status: u16,
    pub x_cache: String,
    pub body: Bytes,
}

/// What one load run saw.
#[derive(Debug, Default)]
pub struct Tally {
    pub answers: u64,
    pub by_status: BTreeMap<u16, u64>,
    pub by_x_cache: BTreeMap<String, u64>,
    pub elapsed: Duration,
}

impl Tally {
    pub fn rate(&self) -> f64 {
        self.answers as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn merge(&mut self, other: Tally) {
        self.answers += other.answers;
        for (k, v) in other.by_status {
            *self.by_status.entry(k).or_default() += v;
        }
        for (k, v) in other.by_x_cache {
            *self.by_x_cache.entry(k).or_default() += v;
        }
        self.elapsed = self.elapsed.max(other.elapsed);
    }
}

/// Called for every answer with the time its batch was written (the answer was produced
/// after that).
pub type OnAnswer = Arc<dyn Fn(Instant, &Answer) + Send + Sync>;

/// A load: `conns` keep-alive connections, each writing `depth` pipelined GETs at a time and
/// reading their answers, then (with `pace`) waiting for its next tick. The n-th request
/// overall (one counter for every connection) asks for `path(n)`. Bounded by `duration` and
/// `max_requests`; [`Running::stop`] ends it early.
#[derive(Clone)]
pub struct Load {
    pub addr: SocketAddr,
    pub conns: usize,
    pub depth: usize,
    pub pace: Option<Duration>,
    pub path: Arc<dyn Fn(u64) -> String + Send + Sync>,
    pub duration: Duration,
    pub max_requests: u64,
    pub on_answer: Option<OnAnswer>,
}

impl Load {
    pub fn new(addr: SocketAddr, path: impl Fn(u64) -> String + Send + Sync + 'static) -> Load {
        Load {
            addr,
            conns: 4,
            depth: 16,
            pace: None,
            path: Arc::new(path),
            duration: Duration::from_secs(5),
            max_requests: 1_000_000,
            on_answer: None,
        }
    }

    pub fn conns(mut self, conns: usize, depth: usize) -> Load {
        self.conns = conns.max(1);
        self.depth = depth.max(1);
        self
    }

    pub fn pace(mut self, every: Duration) -> Load {
        self.pace = Some(every);
        self
    }

    pub fn duration(mut self, duration: Duration) -> Load {
        self.duration = duration;
        self
    }

    pub fn max_requests(mut self, n: u64) -> Load {
        self.max_requests = n;
        self
    }

    pub fn on_answer(mut self, f: impl Fn(Instant, &Answer) + Send + Sync + 'static) -> Load {
        self.on_answer = Some(Arc::new(f));
        self
    }

    /// Starts the load in the background.
    pub fn start(self) -> LoadRun {
        let stop = Arc::new(AtomicBool::new(false));
        let next = Arc::new(AtomicU64::new(0));
        let deadline = Instant::now() + self.duration;
        let tasks = (0..self.conns)
            .map(|_| {
                let load = self.clone();
                let stop = stop.clone();
                let next = next.clone();
                tokio::spawn(async move { load.connection(&stop, &next, deadline).await })
            })
            .collect();
        LoadRun {
            stop,
            sent: next,
            tasks,
            limit: self.duration + Duration::from_secs(20),
        }
    }

    pub async fn connection(
        &self,
        stop: &AtomicBool,
        next: &AtomicU64,
        deadline: Instant,
    ) -> Tally {
        let started = Instant::now();
        let stream = TcpStream::connect(self.addr)
            .await
            .unwrap_or_else(|e| panic!("connect {}: {e}", self.addr));
        stream.set_nodelay(true).expect("nodelay");
        let (mut rd, mut wr) = stream.into_split();
        let mut buf = BytesMut::with_capacity(64 * 1024);
        let mut tally = Tally::default();
        let mut tick = self.pace.map(|every| {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick
        });
        let mut batch = Vec::with_capacity(self.depth * 64);
        loop {
            if let Some(tick) = tick.as_mut() {
                tick.tick().await;
            }
            if stop.load(Ordering::Relaxed) || Instant::now() >= deadline {
                break;
            }
            let first = next.fetch_add(self.depth as u64, Ordering::Relaxed);
            if first >= self.max_requests {
                break;
            }
            let n = (self.max_requests - first).min(self.depth as u64);
            batch.clear();
            for i in 0..n {
                let path = (self.path)(first + i);
                batch.extend_from_slice(
                    format!("GET {path} HTTP/1.1\r\nhost: {}\r\n\r\n", self.addr).as_bytes(),
                );
            }
            let sent = Instant::now();
            wr.write_all(&batch)
                .await
                .unwrap_or_else(|e| panic!("write to {}: {e}", self.addr));
            for _ in 0..n {
                let answer = loop {
                    if let Some(raw) = parse_response(&mut buf)
                        .unwrap_or_else(|e| panic!("answer from {}: {e}", self.addr))
                    {
                        break Answer {
                            status: raw.status,
                            x_cache: raw.x_cache(),
                            body: raw.body,
                        };
                    }
                    let read = rd
                        .read_buf(&mut buf)
                        .await
                        .unwrap_or_else(|e| panic!("read from {}: {e}", self.addr));
                    assert!(read > 0, "{} closed the connection mid-batch", self.addr);
                };
                tally.answers += 1;
                *tally.by_status.entry(answer.status).or_default() += 1;
                *tally.by_x_cache.entry(answer.x_cache.clone()).or_default() += 1;
                if let Some(f) = &self.on_answer {
                    f(sent, &answer);
                }
            }
        }
        tally.elapsed = started.elapsed();
        tally
    }
}

/// A load started with [`Load::start`].
pub struct LoadRun {
    pub stop: Arc<AtomicBool>,
    pub sent: Arc<AtomicU64>,
    pub tasks: Vec<JoinHandle<Tally>>,
    pub limit: Duration,
}

impl LoadRun {
    /// Asks every connection to stop after its current batch.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Requests handed out so far (a batch counts when it is taken).
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Waits (bounded) for every connection and sums what they saw.
    pub async fn finish(self) -> Tally {
        let all = async {
            let mut total = Tally::default();
            for task in self.tasks {
                total.merge(task.await.expect("load connection panicked"));
            }
            total
        };
        tokio::time::timeout(self.limit, all)
            .await
            .unwrap_or_else(|_| panic!("load did not finish within {:?}", self.limit))
    }
}

// === admin, metrics, Redis ===
