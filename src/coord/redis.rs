//! The shared Redis connection behind a circuit breaker.
//!
//! One multiplexed [`ConnectionManager`] serves every request (commands are pipelined on one
//! socket; redis-rs reconnects it after I/O errors). Around it:
//!
//! - every command is wrapped in `command_timeout`, because a reconnecting manager makes
//!   callers wait for the reconnection, which the manager's own response timeout does not
//!   cover;
//! - `breaker_failures` consecutive failures or timeouts **open** the breaker: from then on
//!   commands fail at once with [`Unavailable`] — requests skip Redis entirely and pay no
//!   timeout — and cacheguard runs on L1 and in-process single-flight;
//! - a background probe `PING`s every [`PROBE_INTERVAL`] while the breaker is open and
//!   **closes** it only when the answer comes within `command_timeout` (a Redis that answers,
//!   but slowly, stays out of the request path);
//! - while closed, the probe runs every 800 ms with `INFO server`, so an idle instance
//!   notices an outage before a request pays for it, and a changed `run_id` tells that Redis
//!   restarted (its cache, locks and generations are gone: L1 and stale copies keep serving
//!   while single-flight refills it, under the origin caps).

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{FromRedisValue, RedisError, Script};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::RedisConfig;
use crate::metrics::{Metrics, RedisOp};

/// How often an open breaker probes Redis.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// How often a closed breaker checks on Redis (every this many probe intervals).
const UP_CHECK_EVERY: u32 = 4;

/// Redis could not be used for this command (down, timed out, or failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unavailable;

/// A cheap-to-clone handle to the shared connection.
#[derive(Clone)]
pub(crate) struct RedisConn {
    inner: Arc<Inner>,
}

struct Inner {
    client: redis::Client,
    conn: ConnectionManager,
    /// A second connection for rare large transfers (see [`RedisConn::bulk`]); made on
    /// first use and dropped after an error.
    bulk: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    command_timeout: Duration,
    probe_timeout: Duration,
    /// Breaker closed (Redis in the request path).
    up: AtomicBool,
    /// Consecutive failed commands while closed.
    failures: AtomicU32,
    breaker_failures: u32,
    /// The `run_id` Redis last reported, to notice a restart.
    run_id: Mutex<Option<String>>,
    /// Notified each time the breaker closes (Redis is back): owed work retries at once.
    back: Arc<tokio::sync::Notify>,
    metrics: Metrics,
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConn")
            .field("up", &self.is_up())
            .finish_non_exhaustive()
    }
}

impl RedisConn {
    /// Creates the connection, probes it once (a Redis that is down at start is not an
    /// error: the instance starts degraded) and spawns the health probe, which stops on
    /// `stop`.
    ///
    /// # Errors
    /// When the URL cannot be turned into a client (validated at config load already).
    pub(crate) async fn start(
        config: &RedisConfig,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> Result<Self, RedisError> {
        let client = redis::Client::open(config.url.as_str())?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.command_timeout))
            // Few, short retries: the probe below retries for us every PROBE_INTERVAL, and a
            // long backoff would delay noticing that Redis is back.
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(200));
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), manager_config)?;
        let inner = Arc::new(Inner {
            client,
            conn,
            bulk: tokio::sync::Mutex::new(None),
            command_timeout: config.command_timeout,
            probe_timeout: config.connect_timeout.max(config.command_timeout),
            // Open until the first probe answers: requests never wait on a first connect.
            up: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            breaker_failures: config.breaker_failures.max(1),
            run_id: Mutex::new(None),
            back: Arc::new(tokio::sync::Notify::new()),
            metrics,
        });
        inner.metrics.redis_up.set(0);
        inner.metrics.redis_breaker_open.set(1);
        let this = RedisConn { inner };
        this.probe().await;
        if !this.is_up() {
            warn!(message = "Redis unavailable at start; serving degraded until it answers.");
        }
        tokio::spawn(this.clone().probe_loop(stop));
        Ok(this)
    }

    pub(crate) fn is_up(&self) -> bool {
        self.inner.up.load(Ordering::Relaxed)
    }

    /// Notified (`notify_waiters`) each time the breaker closes.
    pub(crate) fn back(&self) -> &Arc<tokio::sync::Notify> {
        &self.inner.back
    }

    /// The client, for connections of their own (the pub/sub subscription).
    pub(crate) fn client(&self) -> &redis::Client {
        &self.inner.client
    }

    /// Runs a Lua script (EVALSHA, loading it on first use), bounded like every command.
    pub(crate) async fn run_script<T: FromRedisValue>(
        &self,
        op: RedisOp,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<T, Unavailable> {
        if !self.is_up() {
            return Err(Unavailable);
        }
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let mut conn = self.inner.conn.clone();
        let started = Instant::now();
        let result = tokio::time::timeout(
            self.inner.command_timeout,
            invocation.invoke_async(&mut conn),
        )
        .await;
        self.settle(op, started, result)
    }

    /// `PUBLISH channel message`, bounded like every command.
    pub(crate) async fn publish(&self, channel: &str, message: &str) -> Result<(), Unavailable> {
        let mut cmd = redis::cmd("PUBLISH");
        cmd.arg(channel).arg(message);
        self.query::<i64>(RedisOp::Publish, &cmd).await.map(|_| ())
    }

    /// `GET key`, or `Unavailable` at once while Redis is down.
    pub(crate) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, Unavailable> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        self.query(RedisOp::Get, &cmd).await
    }

    /// One command on the shared connection: refused at once while the breaker is open,
    /// bounded by `command_timeout`, counted toward the breaker.
    pub(crate) async fn query<T: FromRedisValue>(
        &self,
        op: RedisOp,
        cmd: &redis::Cmd,
    ) -> Result<T, Unavailable> {
        if !self.is_up() {
            return Err(Unavailable);
        }
        let mut conn = self.inner.conn.clone();
        let started = Instant::now();
        let result =
            tokio::time::timeout(self.inner.command_timeout, cmd.query_async::<T>(&mut conn)).await;
        self.settle(op, started, result)
    }

    /// Runs a command that may move a large value (a Bloom filter snapshot, a resync of
    /// many ids) on a connection of its own, bounded by `timeout` instead of
    /// `command_timeout`. A big transfer must neither count as "Redis is slow, so down" nor
    /// hold up the small commands pipelined behind it on the shared socket. Failures are
    /// counted but do not mark Redis down: the health probe decides that.
    pub(crate) async fn bulk<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        timeout: Duration,
    ) -> Result<T, Unavailable> {
        if !self.is_up() {
            return Err(Unavailable);
        }
        let mut slot = self.inner.bulk.lock().await;
        let attempt = tokio::time::timeout(timeout, async {
            // A kept connection may have died since its last use (Redis restarted, a
            // network cut): then try once more on a fresh one.
            if let Some(mut conn) = slot.take() {
                match cmd.query_async::<T>(&mut conn).await {
                    Ok(value) => return Ok((conn, value)),
                    Err(error) if !error.is_io_error() && !error.is_connection_dropped() => {
                        return Err(error);
                    }
                    Err(_) => {}
                }
            }
            let config = redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(self.inner.probe_timeout))
                .set_response_timeout(Some(timeout));
            let mut conn = self
                .inner
                .client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            let value = cmd.query_async::<T>(&mut conn).await?;
            Ok::<_, RedisError>((conn, value))
        })
        .await;
        match attempt {
            Ok(Ok((conn, value))) => {
                *slot = Some(conn);
                Ok(value)
            }
            Ok(Err(error)) => {
                self.inner.metrics.redis_error(RedisOp::Bloom);
                warn!(message = "Redis bulk command failed.", %error);
                Err(Unavailable)
            }
            Err(_) => {
                self.inner.metrics.redis_error(RedisOp::Bloom);
                warn!(message = "Redis bulk command timed out.", timeout = ?timeout);
                Err(Unavailable)
            }
        }
    }

    /// Turns a bounded command result into a value or `Unavailable`, counting failures
    /// toward opening the breaker.
    fn settle<T>(
        &self,
        op: RedisOp,
        started: Instant,
        result: Result<Result<T, RedisError>, tokio::time::error::Elapsed>,
    ) -> Result<T, Unavailable> {
        self.inner
            .metrics
            .redis_latency(op, started.elapsed().as_secs_f64());
        match result {
            Ok(Ok(value)) => {
                self.inner.failures.store(0, Ordering::Relaxed);
                Ok(value)
            }
            Ok(Err(error)) => {
                self.inner.metrics.redis_error(op);
                self.failed(&format!("{op:?} failed: {error}"));
                Err(Unavailable)
            }
            Err(_) => {
                self.inner.metrics.redis_error(op);
                self.failed(&format!(
                    "{op:?} timed out after {:?}",
                    self.inner.command_timeout
                ));
                Err(Unavailable)
            }
        }
    }

    /// One more consecutive failure; enough of them open the breaker.
    fn failed(&self, why: &str) {
        let failures = self.inner.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures >= self.inner.breaker_failures {
            self.mark_down(why);
        }
    }

    fn mark_down(&self, why: &str) {
        if self.inner.up.swap(false, Ordering::AcqRel) {
            self.inner.metrics.redis_up.set(0);
            self.inner.metrics.redis_transitions.inc();
            self.inner.metrics.breaker_transition(true);
            warn!(
                message =
                    "Redis breaker open; serving degraded (L1, in-process single-flight, origin).",
                reason = why
            );
        }
    }

    fn mark_up(&self) {
        self.inner.failures.store(0, Ordering::Relaxed);
        if !self.inner.up.swap(true, Ordering::AcqRel) {
            self.inner.metrics.redis_up.set(1);
            self.inner.metrics.redis_transitions.inc();
            self.inner.metrics.breaker_transition(false);
            info!(message = "Redis breaker closed: Redis answers in time again.");
            self.inner.back.notify_waiters();
        }
    }

    /// Probes Redis while the breaker is open (and, less often, while it is closed).
    async fn probe_loop(self, stop: CancellationToken) {
        let mut ticks: u32 = 0;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(PROBE_INTERVAL) => {}
            }
            ticks = ticks.wrapping_add(1);
            if self.is_up() && !ticks.is_multiple_of(UP_CHECK_EVERY) {
                continue;
            }
            self.probe().await;
        }
    }

    /// One `INFO server`, bounded by the probe timeout. It closes the breaker only when it
    /// is answered within `command_timeout`; a failure opens it at once (the probe is not
    /// a request: one failed probe is evidence enough). The run id tells a restart.
    async fn probe(&self) {
        let mut conn = self.inner.conn.clone();
        let started = Instant::now();
        let info = tokio::time::timeout(
            self.inner.probe_timeout,
            redis::cmd("INFO")
                .arg("server")
                .query_async::<String>(&mut conn),
        )
        .await;
        let took = started.elapsed();
        self.inner
            .metrics
            .redis_latency(RedisOp::Ping, took.as_secs_f64());
        match info {
            Ok(Ok(info)) if took <= self.inner.command_timeout => {
                if self.note_run_id(&info) {
                    self.check_eviction_policy().await;
                }
                self.mark_up();
            }
            Ok(Ok(_)) => {
                self.inner.metrics.redis_error(RedisOp::Ping);
                self.mark_down(&format!(
                    "Redis answered in {took:?}, over command_timeout {:?}",
                    self.inner.command_timeout
                ));
            }
            Ok(Err(error)) => {
                self.inner.metrics.redis_error(RedisOp::Ping);
                self.mark_down(&format!("INFO failed: {error}"));
            }
            Err(_) => {
                self.inner.metrics.redis_error(RedisOp::Ping);
                self.mark_down("INFO timed out");
            }
        }
    }

    /// Warns when Redis may evict any key under memory pressure: an evicted generation key
    /// lets a fill that raced a write store its old value (see DESIGN.md, write path).
    /// `CONFIG` may be refused (managed Redis, ACLs): then nothing is said.
    async fn check_eviction_policy(&self) {
        let mut conn = self.inner.conn.clone();
        let answer = tokio::time::timeout(
            self.inner.probe_timeout,
            redis::cmd("CONFIG")
                .arg("GET")
                .arg("maxmemory-policy")
                .query_async::<Vec<String>>(&mut conn),
        )
        .await;
        if let Ok(Ok(pair)) = answer
            && let Some(policy) = pair.get(1)
            && policy.starts_with("allkeys-")
        {
            warn!(
                message = "Redis maxmemory-policy may evict generation keys; a fill racing a write could then store the old value. Prefer a volatile-* policy or noeviction, or size Redis so it never evicts.",
                maxmemory_policy = %policy,
            );
        }
    }

    /// Notes the run id from `INFO server`; true when it is new (first contact, or Redis
    /// restarted).
    fn note_run_id(&self, info: &str) -> bool {
        let Some(run_id) = info
            .lines()
            .find_map(|line| line.strip_prefix("run_id:"))
            .map(str::trim)
        else {
            return false;
        };
        let mut last = self
            .inner
            .run_id
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(previous) = last.as_deref()
            && previous != run_id
        {
            self.inner.metrics.redis_restarts.inc();
            warn!(
                message = "Redis restarted (new run id): its cache is empty; L1 and stale copies serve while single-flight refills it.",
                previous, run_id,
            );
        }
        if last.as_deref() == Some(run_id) {
            return false;
        }
        *last = Some(run_id.to_owned());
        true
    }
}
