//! The shared Redis connection with health tracking.
//!
//! One multiplexed [`ConnectionManager`] serves every request (commands are pipelined on one
//! socket; redis-rs reconnects it after I/O errors). Around it:
//!
//! - every command is wrapped in `command_timeout`, because a reconnecting manager makes
//!   callers wait for the reconnection, which the manager's own response timeout does not
//!   cover;
//! - the first failure marks Redis *down*: from then on commands fail at once with
//!   [`Unavailable`] (no per-request timeout cost) until a background probe gets a `PING`
//!   answer, which marks it *up* again. The probe runs every [`PROBE_INTERVAL`], so
//!   recovery is noticed well within a second.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncCommands, FromRedisValue, RedisError, Script};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::RedisConfig;
use crate::metrics::{Metrics, RedisOp};

/// How often a down Redis is probed.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_millis(200);

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
    up: AtomicBool,
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
            // Down until the first probe answers: requests never wait on a first connect.
            up: AtomicBool::new(false),
            metrics,
        });
        inner.metrics.redis_up.set(0);
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
        let result = tokio::time::timeout(
            self.inner.command_timeout,
            invocation.invoke_async(&mut conn),
        )
        .await;
        self.settle(op, result)
    }

    /// `GET key`, or `Unavailable` at once while Redis is down.
    pub(crate) async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, Unavailable> {
        if !self.is_up() {
            return Err(Unavailable);
        }
        let mut conn = self.inner.conn.clone();
        let result = tokio::time::timeout(
            self.inner.command_timeout,
            conn.get::<_, Option<Vec<u8>>>(key),
        )
        .await;
        self.settle(RedisOp::Get, result)
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
            let mut conn = match slot.take() {
                Some(conn) => conn,
                None => {
                    let config = redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(self.inner.probe_timeout))
                        .set_response_timeout(Some(timeout));
                    self.inner
                        .client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?
                }
            };
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

    /// Turns a bounded command result into a value or `Unavailable`, marking Redis down on
    /// any failure.
    fn settle<T>(
        &self,
        op: RedisOp,
        result: Result<Result<T, RedisError>, tokio::time::error::Elapsed>,
    ) -> Result<T, Unavailable> {
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => {
                self.inner.metrics.redis_error(op);
                self.mark_down(&format!("{op:?} failed: {error}"));
                Err(Unavailable)
            }
            Err(_) => {
                self.inner.metrics.redis_error(op);
                self.mark_down(&format!(
                    "{op:?} timed out after {:?}",
                    self.inner.command_timeout
                ));
                Err(Unavailable)
            }
        }
    }

    fn mark_down(&self, why: &str) {
        if self.inner.up.swap(false, Ordering::AcqRel) {
            self.inner.metrics.redis_up.set(0);
            self.inner.metrics.redis_transitions.inc();
            warn!(
                message = "Redis unavailable; serving degraded (L1 and origin).",
                reason = why
            );
        }
    }

    fn mark_up(&self) {
        if !self.inner.up.swap(true, Ordering::AcqRel) {
            self.inner.metrics.redis_up.set(1);
            self.inner.metrics.redis_transitions.inc();
            info!(message = "Redis available.");
        }
    }

    /// Probes Redis with `PING` while it is down (and, less often, while it is up, so an
    /// idle instance notices an outage before a request pays for it).
    async fn probe_loop(self, stop: CancellationToken) {
        let mut ticks: u32 = 0;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(PROBE_INTERVAL) => {}
            }
            ticks = ticks.wrapping_add(1);
            if self.is_up() && !ticks.is_multiple_of(5) {
                continue;
            }
            self.probe().await;
        }
    }

    /// One `PING`, bounded by the probe timeout; marks Redis up or down.
    async fn probe(&self) {
        let mut conn = self.inner.conn.clone();
        let ping = tokio::time::timeout(
            self.inner.probe_timeout,
            redis::cmd("PING").query_async::<String>(&mut conn),
        )
        .await;
        match ping {
            Ok(Ok(_)) => self.mark_up(),
            Ok(Err(error)) => {
                self.inner.metrics.redis_error(RedisOp::Ping);
                self.mark_down(&format!("PING failed: {error}"));
            }
            Err(_) => {
                self.inner.metrics.redis_error(RedisOp::Ping);
                self.mark_down("PING timed out");
            }
        }
    }
}
