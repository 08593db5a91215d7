//! A closed-loop GET load for failover tests: `conns` tasks, each sending one request at a
//! time over the shared keep-alive [`HttpClient`], round-robin over the instances and over
//! a path function. Bounded by a duration and a request count; [`LoadRun::stop`] ends it
//! early. Every answer is tallied, and the non-2xx ones are kept (first 20) with their
//! bodies, so a failure message shows what the client saw.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{HttpClient, url};

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
