//! The runner of Jepsen-style tests: client tasks send operations round-robin over a
//! fleet's instances for a bounded time and count while a nemesis injects faults on a
//! schedule, and every operation is recorded ([`history`](super::history)) for the
//! checkers.
//!
//! ```text
//! run(cfg, epoch, targets, generate, nemesis)
//!  ├─ cfg.clients tasks, each: op k of client p → targets[(p + k + attempt) % n]
//!  │    invoke → HTTP request bounded by cfg.request_timeout → ok / fail / info
//!  │    an unknown outcome (or an answer with Retry-After) is retried with the *same*
//!  │    request (same idempotency key) up to cfg.retries times, on the next instance
//!  ├─ the nemesis future, alongside: `nemesis.at(t)`, then a fault, `start`/`heal` recorded
//!  └─ clients stop at max(cfg.duration, nemesis done + cfg.tail), or after cfg.max_ops each
//! ```
//!
//! The runner owns nothing but its clients: the nemesis future borrows the fixtures it
//! acts on (fleet, Redis, proxy, origin) from the test, which keeps them. [`Backend`] is
//! the Redis of a run in each [`Topology`] (standalone behind a [`TcpProxy`], Sentinel
//! with a replica that can lag, Cluster), started and configured the same way for every
//! suite.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::Method;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::client::{HttpClient, full_body};
use super::fleet::{Fleet, spawn_fleet, wait_coordinated};
use super::history::{Completion, Epoch, History, Invocation, Outcome, Phase, Recorder};
use super::{CgConfig, RedisCluster, RedisSentinel, RedisServer, TcpProxy, join_within};

/// One HTTP operation a client makes. Retrying it sends it again as it is.
#[derive(Clone, Debug)]
pub struct Request {
    /// What it does (`"buy"`), the resource it acts on, its value (e.g. the idempotency
    /// key): as recorded in the history.
    pub f: String,
    pub resource: String,
    pub value: String,
    pub method: Method,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

/// The shape of a run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Client tasks (Jepsen's processes), each one operation at a time.
    pub clients: usize,
    /// The shortest run.
    pub duration: Duration,
    /// Clients keep going this long after the nemesis's last step (the recovery window
    /// the undersell check looks at).
    pub tail: Duration,
    /// Operations per client, at most (retries not counted).
    pub max_ops: u64,
    /// Pause between a client's operations (keeps the load bounded on a small machine).
    pub pace: Duration,
    /// The client's own bound on one request: past it the outcome is unknown.
    pub request_timeout: Duration,
    /// Retries of an unknown outcome with the same request (0: none).
    pub retries: u32,
    pub retry_backoff: Duration,
    /// Response headers kept in the history (lower-case).
    pub keep_headers: Vec<&'static str>,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            clients: 12,
            duration: Duration::from_secs(8),
            tail: Duration::from_secs(2),
            max_ops: 2_000,
            pace: Duration::from_millis(15),
            request_timeout: Duration::from_secs(2),
            retries: 0,
            retry_backoff: Duration::from_millis(50),
            keep_headers: vec!["idempotent-replayed", "x-cache", "retry-after"],
        }
    }
}

/// The nemesis's handle on the run: its clock, and the record of its faults.
#[derive(Clone, Debug)]
pub struct Nemesis {
    started: Instant,
    recorder: Recorder,
}

impl Nemesis {
    /// Sleeps until `t` after the run's start.
    pub async fn at(&self, t: Duration) {
        tokio::time::sleep_until(self.started + t).await;
    }

    /// Time since the run's start.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Records that fault `what` starts now.
    pub fn start(&self, what: &str) {
        self.recorder.nemesis(Phase::Start, what);
    }

    /// Records that fault `what` is healed now.
    pub fn heal(&self, what: &str) {
        self.recorder.nemesis(Phase::Heal, what);
    }
}

/// A nemesis that does nothing (the no-fault run).
pub async fn no_faults(_: Nemesis) {}

/// Longest the runner waits for its clients once told to stop, beyond their own bounds.
const STOP_SLACK: Duration = Duration::from_secs(5);

/// Runs the clients against `targets` while `nemesis` runs; returns the history. Times in
/// it are on `epoch` (give the origin the same one). `generate(p, k)` is client `p`'s
/// `k`-th operation.
pub async fn run<G, N, Fut>(
    cfg: &RunConfig,
    epoch: Epoch,
    targets: &[SocketAddr],
    generate: G,
    nemesis: N,
) -> History
where
    G: Fn(usize, u64) -> Request + Send + Sync + 'static,
    N: FnOnce(Nemesis) -> Fut,
    Fut: Future<Output = ()>,
{
    assert!(!targets.is_empty(), "a run needs at least one target");
    let recorder = Recorder::new(epoch);
    let stop = CancellationToken::new();
    let generate = Arc::new(generate);
    let targets: Arc<[SocketAddr]> = targets.into();
    let started = Instant::now();
    let clients: Vec<_> = (0..cfg.clients)
        .map(|p| {
            let client = Client {
                process: p,
                cfg: cfg.clone(),
                http: HttpClient::new(),
                targets: targets.clone(),
                recorder: recorder.clone(),
                stop: stop.clone(),
            };
            let generate = generate.clone();
            tokio::spawn(async move { client.run(&*generate).await })
        })
        .collect();

    nemesis(Nemesis {
        started,
        recorder: recorder.clone(),
    })
    .await;
    let end = (started + cfg.duration).max(Instant::now() + cfg.tail);
    tokio::time::sleep_until(end).await;
    stop.cancel();
    let one_op = cfg.request_timeout * (cfg.retries + 1) + cfg.retry_backoff * cfg.retries;
    join_within(clients, one_op + STOP_SLACK, "the clients").await;
    recorder.history()
}

/// One client task.
struct Client {
    process: usize,
    cfg: RunConfig,
    http: HttpClient,
    targets: Arc<[SocketAddr]>,
    recorder: Recorder,
    stop: CancellationToken,
}

impl Client {
    async fn run(&self, generate: &(dyn Fn(usize, u64) -> Request + Send + Sync)) {
        for k in 0..self.cfg.max_ops {
            if self.stop.is_cancelled() {
                return;
            }
            let request = generate(self.process, k);
            for attempt in 0..=self.cfg.retries {
                let target = (self.process + k as usize + attempt as usize) % self.targets.len();
                let completion = self.attempt(&request, target, attempt).await;
                let retry = completion.outcome == Outcome::Info
                    || completion.headers.iter().any(|(k, _)| k == "retry-after");
                if !retry || attempt == self.cfg.retries || self.stop.is_cancelled() {
                    break;
                }
                tokio::time::sleep(self.cfg.retry_backoff).await;
            }
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = tokio::time::sleep(self.cfg.pace) => {}
            }
        }
    }

    /// One try of `request` on instance `target`, recorded; the completion recorded.
    async fn attempt(&self, request: &Request, target: usize, attempt: u32) -> Completion {
        let id = self.recorder.invoke(Invocation {
            process: self.process,
            f: request.f.clone(),
            resource: request.resource.clone(),
            value: request.value.clone(),
            target: Some(target),
            attempt,
        });
        let url = format!("http://{}{}", self.targets[target], request.path);
        let headers: Vec<(&str, &str)> = request
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let sent = self.http.request(
            request.method.clone(),
            &url,
            &headers,
            full_body(request.body.clone()),
        );
        let completion = match tokio::time::timeout(self.cfg.request_timeout, sent).await {
            Err(_) => Completion::no_answer(format!(
                "timed out after {:?} (client bound)",
                self.cfg.request_timeout
            )),
            Ok(Err(e)) => Completion::no_answer(e),
            Ok(Ok(resp)) => {
                let kept = self
                    .cfg
                    .keep_headers
                    .iter()
                    .filter_map(|name| Some((name.to_string(), resp.header(name)?)))
                    .collect();
                Completion::answered(resp.status.as_u16(), kept, &resp.body)
            }
        };
        self.recorder.complete(id, completion.clone());
        completion
    }
}

/// Starts `n` cacheguard processes from `cfg` (each on ports of its own); in shared mode
/// waits until every one reports Redis up and the event bus subscribed.
pub async fn start_fleet(cfg: &CgConfig, n: usize, shared: bool) -> Fleet {
    let fleet = spawn_fleet(cfg, n).await;
    if shared {
        wait_coordinated(&HttpClient::new(), &fleet.admin_addrs()).await;
    }
    fleet
}

/// The Redis topology a run's fleet shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// One instance, no Redis (in-process state only).
    Embedded,
    /// Redis behind a [`TcpProxy`] (so it can be slowed and blackholed).
    Standalone,
    /// A Sentinel set whose replica can be made to lag.
    Sentinel,
    Cluster,
}

/// The Redis of a run, kept alive for its length; the nemesis acts on it.
pub enum Backend {
    None,
    Standalone { redis: RedisServer, proxy: TcpProxy },
    Sentinel(RedisSentinel),
    Cluster(RedisCluster),
}

impl Backend {
    pub async fn start(topology: Topology) -> Backend {
        match topology {
            Topology::Embedded => Backend::None,
            Topology::Standalone => {
                let redis = RedisServer::start().await;
                let proxy = TcpProxy::start(redis.addr()).await;
                Backend::Standalone { redis, proxy }
            }
            Topology::Sentinel => Backend::Sentinel(RedisSentinel::start_lagging().await),
            Topology::Cluster => Backend::Cluster(RedisCluster::start().await),
        }
    }

    /// `cfg` in shared mode on this Redis (`command_timeout` 200ms), or as it is.
    pub fn configure(&self, cfg: CgConfig) -> CgConfig {
        match self {
            Backend::None => cfg,
            Backend::Standalone { proxy, .. } => cfg
                .set_str("redis", "url", &proxy.redis_url())
                .set_str("redis", "command_timeout", "200ms"),
            Backend::Sentinel(set) => cfg.redis_sentinel(set),
            Backend::Cluster(cluster) => cfg.redis_cluster(cluster),
        }
    }
}
