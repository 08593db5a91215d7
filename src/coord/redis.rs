//! The Redis connections behind a circuit breaker.
//!
//! A request's commands go on its proxy worker's own connection, driven on that worker
//! (see [`super::worker_conn`]): in every `redis.mode`, whatever the command (the entry
//! read, the lock script, the route index, the fill, invalidations, stock-gate and
//! serialized-write scripts), through the two choke points every command takes
//! ([`RedisConn::query`], [`RedisConn::run_script`]). One multiplexed connection, driven by
//! the Redis thread ([`super::io`]), is shared by everything else: background work (the
//! probe, reconciles, the journal, Bloom sync), callers that are not proxy workers, and a
//! worker's commands while its own connection is being made or after it failed (see
//! [`RedisConn::send`]). A few kinds keep connections of their own on the Redis thread:
//! large transfers ([`RedisConn::bulk`]), lock acquires followed by `WAIT`
//! ([`RedisConn::run_script_replicated`]), the heartbeat, the event bus. Commands are
//! pipelined on one socket per node (see [`super::backend`] for how connections are made in
//! each `redis.mode`). Around them all, one breaker:
//!
//! - every command is wrapped in `command_timeout`, because a reconnecting manager makes
//!   callers wait for the reconnection, which the manager's own response timeout does not
//!   cover;
//! - a command whose answer is late is given up at `command_timeout` only when Redis
//!   answers nothing at all ([`Liveness`]): a heartbeat `PING`, on a connection of its
//!   own and driven by the Redis thread, tells a Redis that answers from one that is
//!   stopped, cut off or slow. While it answers, a late command is this process's own queue
//!   (a saturated machine: the callers, the Redis thread or the pipeline behind our own
//!   commands), not Redis: it is waited for up to `connect_timeout` ([`answer_within`]),
//!   and does not count toward the breaker;
//! - `breaker_failures` consecutive failures or such timeouts **open** the breaker: from
//!   then on commands fail at once with [`Unavailable`] — requests skip Redis entirely and
//!   pay no timeout — and cacheguard runs on L1 and in-process single-flight;
//! - a background probe `PING`s every [`PROBE_INTERVAL`] while the breaker is open and
//!   **closes** it only when the answer comes within `command_timeout` (a Redis that answers,
//!   but slowly, stays out of the request path);
//! - while closed, the probe runs every 800 ms with `INFO server`, so an idle instance
//!   notices an outage before a request pays for it, and a changed `run_id` tells that Redis
//!   restarted (its cache, locks and generations are gone: L1 and stale copies keep serving
//!   while single-flight refills it, under the origin caps). On a cluster the probe asks
//!   `CLUSTER INFO` of any node instead (node run ids differ);
//! - a breaker that opens again soon after it closed (a flapping Redis: a cluster whose
//!   slots come and go during a failover) stays open longer each time before the probe may
//!   close it (see [`Hysteresis`]), so it settles instead of moving at every probe; on a
//!   cluster the probe also wants `cluster_state:ok`;
//! - with Sentinel, a command that hits a demoted primary (`READONLY`) re-resolves the
//!   primary and is retried once; a failing primary makes the follower ask the sentinels
//!   at once, and the shared connection, and so every worker's, moves to each new primary
//!   they name;
//! - answers that say Redis is up do not count toward the breaker: a refusal no retry
//!   changes ([`Refusals`]), and on a cluster a slot being migrated ([`Migrations`]);
//!   nor does a dropped connection, which says nothing of Redis now: it wakes the probe,
//!   which asks again on a new connection ([`RedisConn::dropped`]).
//!
//! At start the topology found is logged (mode, primaries, replicas) and exported
//! (`cacheguard_redis_nodes`); a cluster that does not cover every slot is refused.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use arc_swap::ArcSwapOption;
use redis::{FromRedisValue, RedisError, Script};
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::backend::{self, Backend, CLUSTER_SLOTS, DataConn};
use super::io::IoThread;
use super::worker_conn::{Found, Owner};
use crate::config::{RedisConfig, RedisMode};
use crate::metrics::{Metrics, RedisOffWorker, RedisOp};

/// How often an open breaker probes Redis.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// The size of the pieces a large value is read in ([`RedisConn::bulk_get_rest`]).
const BULK_PIECE: usize = 1024 * 1024;
/// Connections kept for replicated lock acquires (`lock.wait_replicas`).
const WAIT_POOL: usize = 16;
/// How often a closed breaker checks on Redis (every this many probe intervals).
const UP_CHECK_EVERY: u32 = 4;
/// The least time between two probes woken by a dropped connection ([`RedisConn::dropped`]).
const PROBE_WOKEN_EVERY: Duration = Duration::from_millis(50);

/// Redis could not be used for this command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unavailable {
    /// Down, timed out, refused, or failed.
    Down,
    /// Redis answers, but the command's hash slot is being migrated between two cluster
    /// nodes and its keys are not all on one of them (`TRYAGAIN` for the whole retry
    /// budget): the slot cannot take it until the migration ends. Not a failure of Redis.
    Migrating,
}

tokio::task_local! {
    /// The Redis commands sent by the task running [`count_commands`]'s future.
    static COMMANDS: std::cell::Cell<u32>;
}

/// Runs `future`, counting the Redis commands it sends (through [`RedisConn`], in this
/// task); returns its output and the count.
///
/// The result is `future` and a few words: request futures are large (see `tally`).
pub(crate) fn count_commands<F: Future>(future: F) -> impl Future<Output = (F::Output, u32)> {
    COMMANDS.scope(
        std::cell::Cell::new(0),
        crate::tally::tallied(future, || COMMANDS.with(std::cell::Cell::get)),
    )
}

/// Adds `n` commands to the count of the [`count_commands`] this task runs in, if any
/// (commands another task sent on this one's behalf).
pub(crate) fn add_commands(n: u32) {
    let _ = COMMANDS.try_with(|count| count.set(count.get().saturating_add(n)));
}

/// `script` invoked with `keys` and `args`.
fn invocation<'a>(
    script: &'a Script,
    keys: &[&str],
    args: &[&[u8]],
) -> redis::ScriptInvocation<'a> {
    let mut invocation = script.prepare_invoke();
    for key in keys {
        invocation.key(*key);
    }
    for arg in args {
        invocation.arg(*arg);
    }
    invocation
}

/// What a bulk transfer runs (see [`RedisConn::bulk`]).
enum Bulk<'a> {
    Cmd(&'a redis::Cmd),
    Script(&'a redis::ScriptInvocation<'a>),
}

impl Bulk<'_> {
    async fn run<T: FromRedisValue>(&self, conn: &mut DataConn) -> Result<T, RedisError> {
        match self {
            Bulk::Cmd(cmd) => cmd.query_async(conn).await,
            Bulk::Script(invocation) => invocation.invoke_async(conn).await,
        }
    }
}

/// A cheap-to-clone handle to the shared connection.
#[derive(Clone)]
pub(crate) struct RedisConn {
    inner: Arc<Inner>,
}

struct Inner {
    /// The thread every connection to Redis lives on (see [`super::io`]).
    io: IoThread,
    backend: Backend,
    config: RedisConfig,
    /// The shared connection; `None` while there is none to use (no primary known yet, a
    /// cluster not reached yet).
    conn: ArcSwapOption<DataConn>,
    /// Bumped each time `conn` is replaced: the workers' own connections made before
    /// ([`super::worker_conn`]) are made again.
    generation: AtomicU64,
    /// The identity of this connection's per-worker connections.
    workers: Owner,
    /// Sentinel: the primary `conn` talks to.
    conn_primary: Mutex<Option<String>>,
    /// A second connection for rare large transfers (see [`RedisConn::bulk`]); made on
    /// first use and dropped after an error.
    bulk: tokio::sync::Mutex<Option<DataConn>>,
    /// What the last topology check found.
    topology: Mutex<Topology>,
    /// Connections for a lock write followed by `WAIT` (see
    /// [`RedisConn::run_script_replicated`]); emptied when the primary changes.
    wait_pool: Mutex<Vec<DataConn>>,
    command_timeout: Duration,
    probe_timeout: Duration,
    /// Breaker closed (Redis in the request path).
    up: AtomicBool,
    /// Consecutive failed commands while closed.
    failures: AtomicU32,
    /// Whether Redis answers at all (the heartbeat's last answer in time).
    liveness: Liveness,
    breaker_failures: u32,
    /// The `run_id` Redis last reported, to notice a restart.
    run_id: Mutex<Option<String>>,
    /// Notified each time the breaker closes (Redis is back): owed work retries at once.
    back: Arc<tokio::sync::Notify>,
    /// Wakes the probe at once: a command found its connection dropped (see
    /// [`RedisConn::dropped`]).
    probe_now: tokio::sync::Notify,
    /// Commands Redis refused, for the rate-limited log.
    refusals: Refusals,
    /// Commands given up while their slot was migrated, for the rate-limited log.
    migrations: Migrations,
    /// How long an open breaker stays open at least.
    hysteresis: Mutex<Hysteresis>,
    metrics: Metrics,
}

/// Commands Redis answered with a refusal that no retry or failover will change (an ACL
/// permission missing, a wrong type, out of memory, a script error): Redis is up, so they
/// do not count toward the breaker, and they are logged at most once a minute per command
/// and error code, with how many there were meanwhile.
#[derive(Default)]
struct Refusals {
    last: Mutex<HashMap<(RedisOp, String), (tokio::time::Instant, u64)>>,
}

/// How long an open breaker stays open at least: nothing the first time; when it opens
/// again within [`FLAP_WINDOW`] of closing, twice as long as the time before (from
/// [`HOLD_MIN`] up to [`HOLD_MAX`]); back to nothing after a quiet [`FLAP_WINDOW`].
/// Hand-written: a few lines of state on tokio's clock, which no breaker crate exposes in a
/// form the probe loop could use.
#[derive(Debug, Default)]
struct Hysteresis {
    opened: Option<tokio::time::Instant>,
    closed: Option<tokio::time::Instant>,
    hold: Duration,
}

/// A re-open this soon after a close counts as a flap.
const FLAP_WINDOW: Duration = Duration::from_secs(10);
const HOLD_MIN: Duration = Duration::from_millis(500);
const HOLD_MAX: Duration = Duration::from_secs(10);

impl Hysteresis {
    fn opened(&mut self) {
        let now = tokio::time::Instant::now();
        let flapping = self
            .closed
            .is_some_and(|closed| now.duration_since(closed) < FLAP_WINDOW);
        self.hold = if flapping {
            (self.hold * 2).clamp(HOLD_MIN, HOLD_MAX)
        } else {
            Duration::ZERO
        };
        self.opened = Some(now);
    }

    /// Whether the breaker may close now.
    fn may_close(&self) -> bool {
        self.opened
            .is_none_or(|opened| opened.elapsed() >= self.hold)
    }

    fn closed(&mut self) {
        self.closed = Some(tokio::time::Instant::now());
    }
}

/// Whether Redis answers at all, as the Redis thread sees it: the breaker's evidence
/// against a command that is late.
///
/// A command's wait, seen from its caller, is the caller's queue (a saturated machine
/// polls it late), the Redis thread's, the pipeline's (our own commands ahead of it on the
/// shared connection) and Redis'. Only the last is what the breaker is for, so a heartbeat
/// (`PING` to every primary, [`RedisConn::heartbeat_loop`]) runs on the Redis thread, on a
/// connection of its own with nothing queued ahead, every [`recheck`] of `command_timeout`
/// while commands are sent, and stamps each answer that came within `command_timeout`. A
/// stopped (`SIGSTOP`) or cut-off Redis stops the stamps; so does one slower than
/// `command_timeout`; a busy cacheguard does not.
///
/// Nor does a cacheguard that was *held up* as a whole: a process that got no CPU for a
/// while (stopped, throttled by a container's CPU quota, swapped out, or starved on a
/// saturated machine) misses its own heartbeats too, and then finds every command late
/// and no heartbeat stamped. Such a lapse is seen where it happens: the heartbeat loop
/// notes when its own timer fired well past its time ([`Liveness::held_up`]), which counts
/// like an answer (no evidence against Redis), and a command whose own deadline fired
/// late looks once more a [`recheck`] later, by when the Redis thread has read what came
/// meanwhile ([`answer_within`]).
///
/// A Redis that refuses the heartbeat's connection (killed, its port closed) is evidence
/// of silence at once ([`Liveness::refused`]): commands waiting past `command_timeout`
/// give up then instead of after [`silence`], so requests do not wait on a dead Redis
/// while the breaker gathers its failures.
///
/// One atomic store per command (the demand), none when idle (no commands, no heartbeat:
/// the probe covers an idle instance). Hand-written: four atomics on tokio's clock.
#[derive(Debug)]
struct Liveness {
    base: tokio::time::Instant,
    /// When the last heartbeat answered in time, µs after `base` (0: none yet).
    answered: AtomicU64,
    /// When the heartbeat last found itself held up (its timer late), µs after `base`.
    held_up: AtomicU64,
    /// When the heartbeat's connection was last refused, µs after `base`.
    refused: AtomicU64,
    /// A command was sent since the last heartbeat.
    demand: AtomicBool,
}

impl Liveness {
    fn new() -> Liveness {
        Liveness {
            base: tokio::time::Instant::now(),
            answered: AtomicU64::new(0),
            held_up: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            demand: AtomicBool::new(false),
        }
    }

    fn micros(&self, at: tokio::time::Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_micros()).unwrap_or(u64::MAX)
    }

    /// A heartbeat was answered in time, now.
    fn answered(&self) {
        let now = self.micros(tokio::time::Instant::now());
        self.answered.fetch_max(now, Ordering::Relaxed);
    }

    /// The heartbeat's own timer fired well past its time, now: this process was held up,
    /// so the heartbeats it missed say nothing about Redis.
    fn held_up(&self) {
        let now = self.micros(tokio::time::Instant::now());
        self.held_up.fetch_max(now, Ordering::Relaxed);
    }

    /// The heartbeat could not connect, now (refused, not late): Redis is gone, whatever
    /// answered before.
    fn refused(&self) {
        let now = self.micros(tokio::time::Instant::now());
        self.refused.fetch_max(now, Ordering::Relaxed);
    }

    /// A command is being sent.
    fn want(&self) {
        self.demand.store(true, Ordering::Relaxed);
    }

    /// Whether a command was sent since the last call (the heartbeat's cue).
    fn take_demand(&self) -> bool {
        self.demand.swap(false, Ordering::Relaxed)
    }

    /// Whether a heartbeat was answered, or the heartbeat found this process held up,
    /// within the last `window`, and its connection was not refused since.
    fn answering(&self, window: Duration) -> bool {
        let answered = self
            .answered
            .load(Ordering::Relaxed)
            .max(self.held_up.load(Ordering::Relaxed));
        let now = self.micros(tokio::time::Instant::now());
        answered > 0
            && answered > self.refused.load(Ordering::Relaxed)
            && now.saturating_sub(answered) <= u64::try_from(window.as_micros()).unwrap_or(u64::MAX)
    }
}

/// How often the heartbeat runs while commands are sent, and a late command looks again
/// whether Redis still answers: a quarter of `command_timeout` (1 to 250 ms).
fn recheck(command_timeout: Duration) -> Duration {
    (command_timeout / 4).clamp(Duration::from_millis(1), Duration::from_millis(250))
}

/// How long the heartbeat may go without an answer in time before Redis counts as
/// answering nothing: 2 × `command_timeout`. One missed beat is not silence (on a machine
/// saturated by other work the Redis thread or redis-server itself can lose the CPU for a
/// few tens of milliseconds), and a stopped Redis still fails its commands within
/// 2 × `command_timeout` + one [`recheck`] of the stop, inside the 3 × `command_timeout`
/// + 50 ms the breaker has to open.
fn silence(command_timeout: Duration) -> Duration {
    command_timeout * 2
}

/// A command given up without an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TimedOut;

/// Awaits `future` (a command's answer) for `timeout`; past it, and as long as Redis
/// answers the heartbeat (`liveness`, looked at every [`recheck`]), for up to `patience`
/// in all (`None`: not at all). Gives up as soon as the heartbeat has had no answer for
/// [`silence`]: a stopped Redis fails a command within that + one recheck of the stop (or
/// `timeout` of its send, if later), a saturated process waits for its answers.
///
/// # Cancel safety
/// As cancel-safe as `future`: dropping this drops it.
async fn answer_within<F: Future>(
    future: F,
    timeout: Duration,
    patience: Option<Duration>,
    liveness: &Liveness,
) -> Result<F::Output, TimedOut> {
    liveness.want();
    let started = tokio::time::Instant::now();
    let mut future = std::pin::pin!(future);
    if let Ok(output) = tokio::time::timeout(timeout, future.as_mut()).await {
        return Ok(output);
    }
    let Some(patience) = patience else {
        return Err(TimedOut);
    };
    let every = recheck(timeout);
    // This task's own deadline fired this late: the task was held up (see `Liveness`), so
    // the silence it sees may be its own; it looks again once the Redis thread has run.
    let mut due = started + timeout;
    loop {
        let held_up = due.elapsed() > every;
        if !held_up && !liveness.answering(silence(timeout)) {
            break;
        }
        let left = patience.saturating_sub(started.elapsed());
        if left.is_zero() {
            break;
        }
        due = tokio::time::Instant::now() + every.min(left);
        if let Ok(output) = tokio::time::timeout_at(due, future.as_mut()).await {
            return Ok(output);
        }
    }
    Err(TimedOut)
}

/// How often one kind of refusal is logged at most.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);

impl Refusals {
    /// Whether `error` is a refusal (see [`Refusals`]) rather than Redis failing.
    fn is_refusal(error: &RedisError) -> bool {
        use redis::{ErrorKind, ServerErrorKind};
        match error.kind() {
            ErrorKind::Server(kind) => matches!(
                kind,
                ServerErrorKind::NoPerm
                    | ServerErrorKind::ResponseError
                    | ServerErrorKind::NoScript
                    | ServerErrorKind::ExecAbort
                    | ServerErrorKind::CrossSlot
            ),
            // Codes redis-rs does not name: WRONGTYPE, OOM, BUSY... all answers.
            ErrorKind::Extension => true,
            _ => false,
        }
    }

    fn log(&self, op: RedisOp, error: &RedisError) {
        let code = error.code().unwrap_or("ERR").to_owned();
        let now = tokio::time::Instant::now();
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let (at, suppressed) = last.entry((op, code.clone())).or_insert((now, u64::MAX));
        if *suppressed != u64::MAX && now.duration_since(*at) < REFUSAL_LOG_EVERY {
            *suppressed += 1;
            return;
        }
        let since = if *suppressed == u64::MAX {
            0
        } else {
            *suppressed
        };
        *at = now;
        *suppressed = 0;
        drop(last);
        let hint = if code == "NOPERM" {
            "grant cacheguard's ACL user this command (see README, Redis topologies)"
        } else {
            "Redis refused the command; cacheguard carries on without it"
        };
        error!(
            message = "Redis refused a command.",
            op = ?op,
            code = %code,
            error = %error,
            refused_since_last_line = since,
            hint,
        );
    }
}

/// Cluster commands given up because their hash slot was being migrated (a resharding:
/// `CLUSTER SETSLOT … MIGRATING/IMPORTING`, then `MIGRATE` key by key). redis-rs follows
/// `ASK` to the importing node (with `ASKING` before the command) and `MOVED` once the slot
/// has moved, and retries `TRYAGAIN` within the command's budget (see
/// [`backend::ClusterRetry`]); what is still `TRYAGAIN` (or a redirection) after that is a
/// multi-key script whose keys the migration has split, or not all moved yet. Redis is up:
/// not counted toward the breaker nor as an error, but counted
/// (`cacheguard_redis_slot_migrating_total`) and logged at most once a minute, with how
/// many there were meanwhile. What needed the command degrades as without Redis for that
/// key (a fill: this process alone, kept in L1 only).
#[derive(Default)]
struct Migrations {
    last: Mutex<Option<(tokio::time::Instant, u64)>>,
}

impl Migrations {
    /// Whether `error` is a cluster's answer about a slot being migrated.
    fn is_migration(error: &RedisError) -> bool {
        use redis::{ErrorKind, ServerErrorKind};
        matches!(
            error.kind(),
            ErrorKind::Server(
                ServerErrorKind::TryAgain | ServerErrorKind::Ask | ServerErrorKind::Moved
            )
        )
    }

    fn log(&self, op: RedisOp, key: Option<&[u8]>, error: &RedisError) {
        let now = tokio::time::Instant::now();
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let since = match &mut *last {
            Some((at, suppressed)) if now.duration_since(*at) < REFUSAL_LOG_EVERY => {
                *suppressed += 1;
                return;
            }
            Some((_, suppressed)) => *suppressed,
            None => 0,
        };
        *last = Some((now, 0));
        drop(last);
        warn!(
            message = "A Redis Cluster hash slot is being migrated (resharding): a command on its keys was still answered TRYAGAIN (or ASK/MOVED) after its retries, and was given up. Redis is up: not counted toward the breaker. What needed the command goes on as without Redis for those keys (a fill: this process alone) until the slot has moved.",
            op = ?op,
            code = error.code().unwrap_or("?"),
            slot = key.map(backend::slot_of),
            error = %error,
            migrating_since_last_line = since,
        );
    }
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConn")
            .field("up", &self.is_up())
            .finish_non_exhaustive()
    }
}

/// The topology found at start (and after a failover), as logged and shown in
/// `/admin/redis`.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Topology {
    pub(crate) mode: &'static str,
    /// `host:port` of each primary (one unless a cluster).
    pub(crate) primaries: Vec<String>,
    pub(crate) replicas: usize,
    /// Cluster: hash slots served by a primary (16384 when complete).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) slots_covered: Option<u32>,
    /// Sentinel: the name of the monitored primary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) master_name: Option<String>,
}

impl RedisConn {
    /// Creates the connection, probes it once (a Redis that is down at start is not an
    /// error: the instance starts degraded), reports the topology, and spawns the health
    /// probe (and with Sentinel, the primary follower), which stop on `stop`.
    ///
    /// # Errors
    /// When the URL cannot be turned into a client (validated at config load already), or
    /// a reachable cluster does not serve every hash slot.
    pub(crate) async fn start(
        config: &RedisConfig,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> anyhow::Result<Self> {
        let io = IoThread::start().context("starting the Redis thread")?;
        let started = io.clone();
        started
            .enter(Self::start_on(io, config, metrics, stop))
            .await
    }

    /// [`RedisConn::start`], polled in the Redis thread's context.
    async fn start_on(
        io: IoThread,
        config: &RedisConfig,
        metrics: Metrics,
        stop: CancellationToken,
    ) -> anyhow::Result<Self> {
        let backend = Backend::new(config)?;
        if let Some(covered) = backend
            .seed_coverage(config.connect_timeout.max(config.command_timeout))
            .await
        {
            refuse_partial_cluster(covered)?;
        }
        if let Some(sentinel) = backend.sentinel() {
            if sentinel.resolve_now().await.is_none() {
                warn!(
                    message = "No sentinel names a reachable primary yet; serving degraded until one does.",
                    master_name = %sentinel.master_name(),
                );
            }
            io.spawn(sentinel.follow(stop.clone()));
        }
        let conn = backend.shared(config).await?;
        let conn_primary = backend.sentinel().and_then(|s| s.primary_addr());
        let inner = Arc::new(Inner {
            io,
            backend,
            config: config.clone(),
            conn: ArcSwapOption::new(conn.map(Arc::new)),
            generation: AtomicU64::new(0),
            workers: Owner::default(),
            conn_primary: Mutex::new(conn_primary),
            bulk: tokio::sync::Mutex::new(None),
            topology: Mutex::new(Topology::default()),
            wait_pool: Mutex::new(Vec::new()),
            command_timeout: config.command_timeout,
            probe_timeout: config.connect_timeout.max(config.command_timeout),
            // Open until the first probe answers: requests never wait on a first connect.
            up: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            liveness: Liveness::new(),
            breaker_failures: config.breaker_failures.max(1),
            run_id: Mutex::new(None),
            back: Arc::new(tokio::sync::Notify::new()),
            probe_now: tokio::sync::Notify::new(),
            refusals: Refusals::default(),
            migrations: Migrations::default(),
            hysteresis: Mutex::new(Hysteresis::default()),
            metrics,
        });
        inner.metrics.redis_up.set(0);
        inner.metrics.redis_breaker_open.set(1);
        let this = RedisConn { inner };
        this.probe().await;
        if this.is_up() {
            let topology = this.discover().await;
            if let Some(covered) = topology.slots_covered {
                refuse_partial_cluster(covered)?;
            }
        } else {
            warn!(
                message = "Redis unavailable at start; serving degraded until it answers.",
                mode = this.inner.config.mode.as_str(),
            );
        }
        if let Some(sentinel) = this.inner.backend.sentinel() {
            this.inner.io.spawn(
                this.clone()
                    .follow_primary(sentinel.changes(), stop.clone()),
            );
        }
        this.inner
            .io
            .spawn(this.clone().heartbeat_loop(stop.clone()));
        this.inner.io.spawn(this.clone().probe_loop(stop));
        Ok(this)
    }

    /// Logs in with `config`'s credentials from now on (a reload changed `username`,
    /// `password` or the `password_file`'s content): every later connection uses them, and
    /// the shared connection, the bulk one and the lock pool are replaced now, so a
    /// reconnection after the old password is revoked does not fail. The event bus and the
    /// stream consumer keep their open connections and log in anew when they reconnect.
    ///
    /// # Errors
    /// Credentials the client cannot use; the old ones stay in use.
    pub(crate) async fn rotate_credentials(&self, config: &RedisConfig) -> anyhow::Result<()> {
        self.inner.io.enter(self.rotate_on(config)).await
    }

    async fn rotate_on(&self, config: &RedisConfig) -> anyhow::Result<()> {
        self.inner.backend.rotate(config).await?;
        let conn = self.inner.backend.shared(config).await?;
        self.inner.conn.store(conn.map(Arc::new));
        self.inner.generation.fetch_add(1, Ordering::AcqRel);
        self.inner
            .wait_pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        *self.inner.bulk.lock().await = None;
        info!(message = "Redis credentials changed; new connections use them.");
        self.probe().await;
        Ok(())
    }

    /// The Redis thread: tasks that talk to Redis on their own schedule run there.
    pub(crate) fn io(&self) -> &IoThread {
        &self.inner.io
    }

    /// How to reach Redis, for connections of their own (the event bus, the stream).
    pub(crate) fn backend(&self) -> &Backend {
        &self.inner.backend
    }

    /// The shared connection, when there is one.
    pub(crate) fn shared(&self) -> Option<DataConn> {
        self.inner.conn.load().as_deref().cloned()
    }

    /// What the last topology check found.
    pub(crate) fn topology(&self) -> Topology {
        self.inner
            .topology
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sentinel: moves the shared connection to each new primary.
    async fn follow_primary(
        self,
        mut changes: tokio::sync::watch::Receiver<u64>,
        stop: CancellationToken,
    ) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                changed = changes.changed() => if changed.is_err() { return },
            }
            // The connection may have moved already (a command that met the demoted
            // primary re-resolved it): report the new topology either way.
            self.sync_primary();
            // Check the new primary now rather than at the next probe tick.
            self.probe().await;
            self.discover().await;
        }
    }

    /// Sentinel: points the shared connection at the primary the follower holds; true when
    /// it moved.
    fn sync_primary(&self) -> bool {
        let Some(sentinel) = self.inner.backend.sentinel() else {
            return false;
        };
        let addr = sentinel.primary_addr();
        let mut current = self
            .inner
            .conn_primary
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *current == addr {
            return false;
        }
        let Some(client) = sentinel.primary_client() else {
            return false;
        };
        match backend::managed(&client, &self.inner.config) {
            Ok(conn) => {
                self.inner
                    .conn
                    .store(Some(Arc::new(DataConn::Managed(conn))));
                self.inner.generation.fetch_add(1, Ordering::AcqRel);
                self.inner
                    .wait_pool
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clear();
                if current.is_some() {
                    self.inner.metrics.redis_primary_changes.inc();
                }
                *current = addr;
                // A new primary has its own run id: not a restart.
                *self
                    .inner
                    .run_id
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
                true
            }
            Err(error) => {
                warn!(message = "Cannot connect to the new primary.", %error);
                false
            }
        }
    }

    /// Finds and reports the topology (best effort: a failure leaves the last report).
    pub(crate) async fn discover(&self) -> Topology {
        let Some(mut conn) = self.shared() else {
            return self.topology();
        };
        let timeout = self.inner.probe_timeout;
        let mut topology = Topology {
            mode: self.inner.config.mode.as_str(),
            ..Topology::default()
        };
        match self.inner.config.mode {
            RedisMode::Cluster => {
                let mut cmd = redis::cmd("CLUSTER");
                cmd.arg("NODES");
                let Ok(Ok(text)) =
                    tokio::time::timeout(timeout, cmd.query_async::<String>(&mut conn)).await
                else {
                    return self.topology();
                };
                let nodes = backend::parse_cluster_nodes(&text);
                for node in &nodes {
                    if node.primary && node.slots > 0 && node.connected {
                        topology
                            .primaries
                            .push(format!("{}:{}", node.host, node.port));
                    } else if !node.primary && node.connected {
                        topology.replicas += 1;
                    }
                }
                self.check_eviction_policy().await;
                topology.slots_covered = Some(
                    nodes
                        .iter()
                        .filter(|n| n.primary && n.connected)
                        .map(|n| n.slots)
                        .sum::<u32>()
                        .min(CLUSTER_SLOTS),
                );
            }
            RedisMode::Standalone | RedisMode::Sentinel => {
                let mut cmd = redis::cmd("INFO");
                cmd.arg("replication");
                let Ok(Ok(text)) =
                    tokio::time::timeout(timeout, cmd.query_async::<String>(&mut conn)).await
                else {
                    return self.topology();
                };
                let field = |name: &str| {
                    text.lines()
                        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                        .map(str::trim)
                };
                topology.replicas = field("connected_slaves")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                let primary = match self.inner.backend.sentinel() {
                    Some(sentinel) => {
                        topology.master_name = Some(sentinel.master_name().to_owned());
                        sentinel.primary_addr().unwrap_or_default()
                    }
                    None => self
                        .inner
                        .backend
                        .standalone_addr()
                        .unwrap_or_else(|| crate::config::redact_url(&self.inner.config.url)),
                };
                if field("role") == Some("slave") {
                    warn!(
                        message = "Redis is a replica: writes will fail. Point redis.url at the primary, or use mode = \"sentinel\".",
                        redis = %primary,
                    );
                }
                topology.primaries.push(primary);
            }
        }
        info!(
            message = "Redis topology.",
            mode = topology.mode,
            primaries = %topology.primaries.join(","),
            replicas = topology.replicas,
            slots_covered = ?topology.slots_covered,
        );
        let gauge = &self.inner.metrics.redis_nodes;
        gauge
            .with_label_values(&["primary"])
            .set(i64::try_from(topology.primaries.len()).unwrap_or(i64::MAX));
        gauge
            .with_label_values(&["replica"])
            .set(i64::try_from(topology.replicas).unwrap_or(i64::MAX));
        *self
            .inner
            .topology
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = topology.clone();
        topology
    }

    /// Runs `attempt` (whose first key is `key`, for the log) on this proxy worker's own
    /// connection, else on the shared one (see [`RedisConn::send`]), bounded by
    /// `command_timeout`; with Sentinel, a `READONLY` answer (the primary was
    /// demoted) re-resolves the primary and retries once on the new one. Counted toward the
    /// breaker.
    async fn run<T, F, Fut>(
        &self,
        op: RedisOp,
        key: Option<&[u8]>,
        attempt: F,
    ) -> Result<T, Unavailable>
    where
        F: Fn(DataConn) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        if !self.is_up() {
            return Err(Unavailable::Down);
        }
        self.run_past_breaker(op, key, Some(self.patience()), attempt)
            .await
    }

    /// How long a request's command is waited for in all while Redis answers others (see
    /// [`answer_within`]): `connect_timeout` (at least `command_timeout`), the bound of
    /// everything else that talks to Redis.
    fn patience(&self) -> Duration {
        self.inner.probe_timeout
    }

    /// [`RedisConn::run`] sent even while the breaker is open (see
    /// [`RedisConn::run_script_past_breaker`]), waited for past `command_timeout` for up to
    /// `patience` while Redis answers others ([`answer_within`]).
    async fn run_past_breaker<T, F, Fut>(
        &self,
        op: RedisOp,
        key: Option<&[u8]>,
        patience: Option<Duration>,
        attempt: F,
    ) -> Result<T, Unavailable>
    where
        F: Fn(DataConn) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let started = Instant::now();
        let timeout = self.inner.command_timeout;
        let Some(mut result) = self.send(op, patience, &attempt).await else {
            self.failed("no Redis connection to use");
            return Err(Unavailable::Down);
        };
        if let Some(sentinel) = self.inner.backend.sentinel() {
            // A demoted primary refuses writes (`READONLY`) and, as it turns into a
            // replica, drops its clients: both mean the primary may have moved. Ask the
            // sentinels now (within one more command_timeout) and retry once on the new
            // primary; a READONLY is retried in any case (the answer cannot be right).
            let readonly = matches!(&result, Ok(Err(error)) if is_readonly(error));
            let dropped = matches!(&result, Ok(Err(error)) if is_gone(error));
            if readonly || dropped {
                if readonly {
                    self.inner.metrics.redis_readonly_retries.inc();
                }
                let before = sentinel.primary_addr();
                let resolved =
                    tokio::time::timeout(timeout, self.inner.io.enter(sentinel.resolve_now()))
                        .await;
                // Moves the shared connection, and so every worker's, to the new primary.
                self.sync_primary();
                let moved = sentinel.primary_addr() != before;
                if matches!(resolved, Ok(Some(_)))
                    && (readonly || moved)
                    && let Some(retried) = self.send(op, patience, &attempt).await
                {
                    result = retried;
                }
            } else if result.is_err() {
                // Timed out: the primary may be gone; let the follower ask now.
                sentinel.poke();
            }
        }
        self.settle(op, key, started, result)
    }

    /// Sends `attempt` once, waited for like every command ([`answer_within`]); `None`
    /// when there is no connection to send it on.
    ///
    /// On a proxy worker it goes on the worker's own connection (see
    /// [`super::worker_conn`]), whose driver runs on the worker: no thread is crossed.
    /// When the worker has none (being made, or it could not be made lately) or it turns
    /// out gone (a Redis restart, an idle timeout: an idle connection finds out only when
    /// used), the command goes on the shared connection instead, which reconnects by
    /// itself and tells whether Redis is really down; the worker makes a new one in the
    /// background (after a dropped one: at once). A command without
    /// `patience` (a lock renewal or release, strictly bounded) always takes the shared
    /// connection: on the worker's own, a busy worker would be late to read its answer.
    /// Elsewhere (the Redis thread's own tasks, background work, a host program's runtime)
    /// the shared connection, polled in the Redis thread's context (see [`super::io`]).
    /// What a proxy worker sends on the shared connection is counted
    /// (`cacheguard_redis_commands_off_worker_total`).
    async fn send<T, F, Fut>(
        &self,
        op: RedisOp,
        patience: Option<Duration>,
        attempt: &F,
    ) -> Option<Result<Result<T, RedisError>, TimedOut>>
    where
        F: Fn(DataConn) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let timeout = self.inner.command_timeout;
        let liveness = &self.inner.liveness;
        let on_worker = crate::worker::index() > 0;
        if on_worker
            && patience.is_some()
            && let Some(conn) = self.worker_conn()
        {
            add_commands(1);
            // The answer may be waiting in the socket while this worker is too busy to
            // read it (the connection's driver runs here too): while Redis answers the
            // heartbeat, that is this worker's wait, not Redis', and the command waits on.
            let result = answer_within(attempt(conn), timeout, patience, liveness).await;
            // A late answer is no reason to drop the connection (the answer is read and
            // dropped when it comes), nor to pay a new connection's setup meanwhile.
            if !matches!(&result, Ok(Err(error)) if is_gone(error)) {
                return Some(result);
            }
            self.inner.workers.forget();
        }
        let conn = self.shared()?;
        if on_worker {
            let reason = if patience.is_some() {
                RedisOffWorker::Fallback
            } else {
                RedisOffWorker::Strict
            };
            self.inner.metrics.redis_off_worker(op, reason);
        }
        add_commands(1);
        Some(
            answer_within(
                self.inner.io.enter(attempt(conn)),
                timeout,
                patience,
                liveness,
            )
            .await,
        )
    }

    /// This proxy worker's own connection for the shared connection's generation; when
    /// there is none, one is made in the background (see [`super::worker_conn`]) and this
    /// command goes without. `None` also when there is no shared connection (no primary
    /// known, no cluster node reached: nothing to connect to).
    fn worker_conn(&self) -> Option<DataConn> {
        let generation = self.inner.generation.load(Ordering::Acquire);
        match self.inner.workers.find(generation) {
            Found::Ready(conn) => return Some(conn),
            Found::Resting => return None,
            Found::Missing => {}
        }
        self.shared()?;
        let backend = self.inner.backend.clone();
        let connect = self.inner.config.connect_timeout;
        self.inner
            .workers
            .make(generation, self.inner.probe_timeout, async move {
                backend.per_worker(connect).await
            });
        None
    }

    pub(crate) fn mode(&self) -> RedisMode {
        self.inner.config.mode
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    pub(crate) fn is_up(&self) -> bool {
        self.inner.up.load(Ordering::Relaxed)
    }

    /// Notified (`notify_waiters`) each time the breaker closes.
    pub(crate) fn back(&self) -> &Arc<tokio::sync::Notify> {
        &self.inner.back
    }

    /// Runs a Lua script (EVALSHA, loading it on first use), bounded like every command.
    pub(crate) async fn run_script<T: FromRedisValue>(
        &self,
        op: RedisOp,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<T, Unavailable> {
        let invocation = &invocation(script, keys, args);
        let key = keys.first().map(|key| key.as_bytes());
        self.run(op, key, |mut conn| async move {
            invocation.invoke_async(&mut conn).await
        })
        .await
    }

    /// [`RedisConn::run_script`], sent even while the breaker is open: for the few commands
    /// that keep a lock already held (a write lock's renewal and release). The breaker spares
    /// requests the wait on a Redis that fails and spares that Redis their load; a renewal is
    /// neither (one per held lock each lease/3, off any answer's path), and refusing it would
    /// give up a lock a short outage was promised not to cost: the lock lapses only when
    /// Redis stays unreachable for the lease. Still bounded by `command_timeout`, even while
    /// Redis answers others.
    pub(crate) async fn run_script_past_breaker<T: FromRedisValue>(
        &self,
        op: RedisOp,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<T, Unavailable> {
        let invocation = &invocation(script, keys, args);
        let key = keys.first().map(|key| key.as_bytes());
        // No patience: a renewal must end within `command_timeout` (`lock.lease` is sized
        // on it); a late one still counts toward the breaker only if Redis answers nothing.
        self.run_past_breaker(op, key, None, |mut conn| async move {
            invocation.invoke_async(&mut conn).await
        })
        .await
    }

    /// `PUBLISH channel message`, bounded like every command.
    pub(crate) async fn publish(&self, channel: &str, message: &str) -> Result<(), Unavailable> {
        let mut cmd = redis::cmd("PUBLISH");
        cmd.arg(channel).arg(message);
        self.query::<i64>(RedisOp::Publish, &cmd).await.map(|_| ())
    }

    /// At most the first `max` bytes of `key`'s value (`GETRANGE key 0 max-1`): empty when
    /// there is none. A reply is never larger than `max`, so a large value cannot hold up
    /// the shared connection (nor time out on it); read the rest with
    /// [`RedisConn::bulk_get_rest`] (or all of it with [`RedisConn::bulk_get`]).
    pub(crate) async fn get_up_to(&self, key: &str, max: usize) -> Result<Vec<u8>, Unavailable> {
        // Sized at once (`redis::cmd` grows its buffers argument by argument): this is an
        // L2 hit's command.
        let mut cmd = redis::Cmd::with_capacity(4, 8 + key.len() + 1 + 20);
        cmd.arg("GETRANGE")
            .arg(key)
            .arg(0)
            .arg(max.saturating_sub(1));
        self.query(RedisOp::Get, &cmd).await
    }

    /// `GET key` on the bulk connection (see [`RedisConn::bulk`]): for a value known to be
    /// large, read in one piece.
    pub(crate) async fn bulk_get(
        &self,
        key: &str,
        timeout: Duration,
    ) -> Result<Option<Vec<u8>>, Unavailable> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        self.bulk_run(
            RedisOp::Get,
            Some(key.as_bytes()),
            timeout,
            &Bulk::Cmd(&cmd),
        )
        .await
    }

    /// Appends to `value` the bytes of `key`'s value from `value.len()` up to `end`
    /// (exclusive), read with `GETRANGE` in pieces of [`BULK_PIECE`] bytes on the bulk
    /// connection (see [`RedisConn::bulk`]), all within `timeout`; stops early where the
    /// value ends. A reply is parsed in the connection's read buffer and then copied out,
    /// so a value read in one `GET` is briefly in memory twice, and the buffer keeps that
    /// size afterwards: read in pieces, the value is in memory once, in `value`, and the
    /// buffer stays the size of a piece. The pieces are separate commands (each takes its
    /// turn on the bulk connection): a value replaced meanwhile reads as a mix of the two,
    /// which the caller must be able to tell (an entry's checksum does).
    pub(crate) async fn bulk_get_rest(
        &self,
        key: &str,
        value: &mut Vec<u8>,
        end: usize,
        timeout: Duration,
    ) -> Result<(), Unavailable> {
        let deadline = tokio::time::Instant::now() + timeout;
        while value.len() < end {
            let from = value.len();
            let to = end.min(from.saturating_add(BULK_PIECE));
            let mut cmd = redis::cmd("GETRANGE");
            cmd.arg(key).arg(from).arg(to - 1);
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let piece: Vec<u8> = self
                .bulk_run(RedisOp::Get, Some(key.as_bytes()), left, &Bulk::Cmd(&cmd))
                .await?;
            value.extend_from_slice(&piece);
            if piece.len() < to - from {
                break;
            }
        }
        Ok(())
    }

    /// One command (on this proxy worker's own connection, else the shared one: see
    /// [`RedisConn::send`]): refused at once while the breaker is open,
    /// bounded by `command_timeout`, counted toward the breaker.
    pub(crate) async fn query<T: FromRedisValue>(
        &self,
        op: RedisOp,
        cmd: &redis::Cmd,
    ) -> Result<T, Unavailable> {
        self.run(op, first_arg(cmd), |mut conn| async move {
            cmd.query_async::<T>(&mut conn).await
        })
        .await
    }

    /// Runs a script (`EVAL source`), then `WAIT replicas timeout` on the same connection:
    /// the script's answer and how many replicas had its writes in time.
    ///
    /// `WAIT` covers the writes of the connection it is sent on and blocks that connection
    /// meanwhile, so both run on a connection of their own, taken from a small pool: the
    /// shared connection's pipeline never waits on a replica. On a cluster the `WAIT` goes
    /// to the primary of the script's first key, where the script ran.
    ///
    /// The script is a command like any other: bounded by `command_timeout`, a failure of
    /// it counted toward the breaker. The `WAIT` is not: it is sent once the script has
    /// answered (one round trip more, so the two answers are told apart), and whatever
    /// becomes of it — fewer replicas, an error, or no answer within `timeout` +
    /// `command_timeout` — reads as 0 replicas, never as a Redis failure. Redis answers a
    /// `WAIT` that timed out at its next server tick (up to 100 ms late at the default
    /// `hz`), so a bound close to `timeout` is met or missed by chance: when one pipeline
    /// carried both, a late `WAIT` failed the lock taken before it. A connection whose
    /// `WAIT` did not answer in time is not reused (Redis would run its next command only
    /// after that `WAIT`).
    pub(crate) async fn run_script_replicated<T: FromRedisValue>(
        &self,
        op: RedisOp,
        source: &str,
        keys: &[&str],
        args: &[&[u8]],
        replicas: u32,
        timeout: Duration,
    ) -> Result<(T, i64), Unavailable> {
        if !self.is_up() {
            return Err(Unavailable::Down);
        }
        let started = Instant::now();
        let pooled = self
            .inner
            .wait_pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        let mut conn = match pooled {
            Some(conn) => conn,
            None => match tokio::time::timeout(
                self.inner.probe_timeout,
                self.inner.io.enter(self.inner.backend.dedicated(
                    self.inner.probe_timeout,
                    Some(timeout + self.inner.command_timeout),
                )),
            )
            .await
            {
                Ok(Ok(conn)) => conn,
                _ => {
                    self.failed("no connection for a replicated lock");
                    return Err(Unavailable::Down);
                }
            },
        };
        if crate::worker::index() > 0 {
            self.inner
                .metrics
                .redis_off_worker(op, RedisOffWorker::Replicated);
        }
        let mut eval = redis::cmd("EVAL");
        eval.arg(source).arg(keys.len());
        for key in keys {
            eval.arg(*key);
        }
        for arg in args {
            eval.arg(*arg);
        }
        add_commands(1);
        let result = answer_within(
            self.inner.io.enter(eval.query_async::<T>(&mut conn)),
            self.inner.command_timeout,
            Some(self.patience()),
            &self.inner.liveness,
        )
        .await;
        let first_key = keys.first().copied().unwrap_or_default();
        let value = self.settle(op, Some(first_key.as_bytes()), started, result)?;
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(
            u64::try_from(timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
        );
        add_commands(1);
        let acked = tokio::time::timeout(
            timeout + self.inner.command_timeout,
            self.inner
                .io
                .enter(conn.query_beside::<i64>(&wait, first_key)),
        )
        .await;
        let acked = match acked {
            Ok(Ok(acked)) => {
                let mut pool = self
                    .inner
                    .wait_pool
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if pool.len() < WAIT_POOL {
                    pool.push(conn);
                }
                acked
            }
            Ok(Err(_)) | Err(_) => 0,
        };
        Ok((value, acked))
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
        self.bulk_run(RedisOp::Bloom, first_arg(cmd), timeout, &Bulk::Cmd(cmd))
            .await
    }

    /// Runs a script on the bulk connection (see [`RedisConn::bulk`]): for a script that
    /// carries a large value, such as the fill of a large entry.
    pub(crate) async fn bulk_script<T: FromRedisValue>(
        &self,
        op: RedisOp,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
        timeout: Duration,
    ) -> Result<T, Unavailable> {
        let invocation = invocation(script, keys, args);
        let key = keys.first().map(|key| key.as_bytes());
        self.bulk_run(op, key, timeout, &Bulk::Script(&invocation))
            .await
    }

    /// One attempt on the bulk connection, then one more on a fresh connection if the kept
    /// one had died; transfers take turns on it, and waiting for the turn counts toward
    /// `timeout`.
    async fn bulk_run<T: FromRedisValue>(
        &self,
        op: RedisOp,
        key: Option<&[u8]>,
        timeout: Duration,
        bulk: &Bulk<'_>,
    ) -> Result<T, Unavailable> {
        if !self.is_up() {
            return Err(Unavailable::Down);
        }
        if crate::worker::index() > 0 {
            self.inner
                .metrics
                .redis_off_worker(op, RedisOffWorker::Bulk);
        }
        let result = tokio::time::timeout(
            timeout,
            self.inner.io.enter(async {
                let mut slot = self.inner.bulk.lock().await;
                // A kept connection may have died since its last use (Redis restarted, a
                // network cut): then try once more on a fresh one.
                if let Some(mut conn) = slot.take() {
                    match bulk.run(&mut conn).await {
                        Ok(value) => {
                            *slot = Some(conn);
                            return Ok(value);
                        }
                        Err(error) if !error.is_io_error() && !error.is_connection_dropped() => {
                            return Err(error);
                        }
                        Err(_) => {}
                    }
                }
                let mut conn = self
                    .inner
                    .backend
                    .dedicated(self.inner.probe_timeout, Some(timeout))
                    .await?;
                let value = bulk.run(&mut conn).await?;
                *slot = Some(conn);
                Ok::<_, RedisError>(value)
            }),
        )
        .await;
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) if Migrations::is_migration(&error) => {
                self.inner.metrics.redis_slot_migrating(op);
                self.inner.migrations.log(op, key, &error);
                Err(Unavailable::Migrating)
            }
            Ok(Err(error)) => {
                self.inner.metrics.redis_error(op);
                warn!(message = "Redis bulk command failed.", %error);
                Err(Unavailable::Down)
            }
            Err(_) => {
                self.inner.metrics.redis_error(op);
                warn!(message = "Redis bulk command timed out.", timeout = ?timeout);
                Err(Unavailable::Down)
            }
        }
    }

    /// Turns a bounded command result into a value or `Unavailable`, counting failures
    /// toward opening the breaker (not a refusal, nor a slot being migrated: Redis
    /// answered). `key` is the command's first key, for the log.
    fn settle<T>(
        &self,
        op: RedisOp,
        key: Option<&[u8]>,
        started: Instant,
        result: Result<Result<T, RedisError>, TimedOut>,
    ) -> Result<T, Unavailable> {
        self.inner
            .metrics
            .redis_latency(op, started.elapsed().as_secs_f64());
        match result {
            Ok(Ok(value)) => {
                self.inner.failures.store(0, Ordering::Relaxed);
                Ok(value)
            }
            Ok(Err(error)) if Migrations::is_migration(&error) => {
                self.inner.metrics.redis_slot_migrating(op);
                self.inner.migrations.log(op, key, &error);
                Err(Unavailable::Migrating)
            }
            Ok(Err(error)) if Refusals::is_refusal(&error) => {
                self.inner.metrics.redis_error(op);
                self.inner.refusals.log(op, &error);
                Err(Unavailable::Down)
            }
            // redis-rs's own response timeout: a timeout like ours.
            Ok(Err(error)) if error.is_timeout() => {
                self.timed_out(op, &format!("{op:?} timed out: {error}"));
                Err(Unavailable::Down)
            }
            Ok(Err(error)) if is_gone(&error) => {
                self.inner.metrics.redis_error(op);
                self.dropped();
                Err(Unavailable::Down)
            }
            Ok(Err(error)) => {
                self.inner.metrics.redis_error(op);
                self.failed(&format!("{op:?} failed: {error}"));
                Err(Unavailable::Down)
            }
            Err(TimedOut) => {
                self.timed_out(
                    op,
                    &format!(
                        "{op:?} had no answer, and Redis none for the heartbeat, within {:?}",
                        self.inner.command_timeout
                    ),
                );
                Err(Unavailable::Down)
            }
        }
    }

    /// A command given up without an answer: a failure toward the breaker only when Redis
    /// answers nothing (see [`Liveness`]); while it answers the heartbeat in time, the wait
    /// was this process's own and Redis is not the one to blame.
    fn timed_out(&self, op: RedisOp, why: &str) {
        self.inner.metrics.redis_error(op);
        if !self.answering() {
            self.failed(why);
        }
    }

    /// Whether Redis answered the heartbeat lately (see [`silence`]).
    fn answering(&self) -> bool {
        self.inner
            .liveness
            .answering(silence(self.inner.command_timeout))
    }

    /// A command found its connection dropped (closed, reset): that connection is gone,
    /// not necessarily Redis. Every command in flight on it, and the first sent on it
    /// after, fails at once — after a restart quicker than a probe, a middlebox's idle
    /// timeout, `CLIENT KILL` — while the connection it is made again on works. So this is
    /// not a failure toward the breaker: the probe is woken to ask Redis on a new
    /// connection now (see [`RedisConn::probe`]), and opens the breaker at once if that
    /// fails too (a Redis killed refuses the new connection).
    fn dropped(&self) {
        self.inner.probe_now.notify_one();
    }

    /// One more consecutive failure; enough of them open the breaker.
    fn failed(&self, why: &str) {
        let failures = self.inner.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures >= self.inner.breaker_failures {
            self.mark_down(why);
        }
    }

    fn hysteresis(&self) -> std::sync::MutexGuard<'_, Hysteresis> {
        self.inner
            .hysteresis
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens the breaker as enough failures would (for unit tests of what an open breaker
    /// lets through).
    #[cfg(test)]
    pub(crate) fn open_breaker(&self) {
        self.mark_down("opened by a test");
    }

    fn mark_down(&self, why: &str) {
        if self.inner.up.swap(false, Ordering::AcqRel) {
            self.hysteresis().opened();
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
        if !self.inner.up.load(Ordering::Acquire) {
            let mut hysteresis = self.hysteresis();
            if !hysteresis.may_close() {
                return;
            }
            hysteresis.closed();
        }
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
        let mut last = tokio::time::Instant::now();
        loop {
            let asked = tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(PROBE_INTERVAL) => false,
                () = self.inner.probe_now.notified() => true,
            };
            if asked {
                // Connections dropped again and again (a middlebox resetting them) cost
                // one probe per PROBE_WOKEN_EVERY, not a loop of them.
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep_until(last + PROBE_WOKEN_EVERY) => {}
                }
            }
            ticks = ticks.wrapping_add(1);
            if !asked && self.is_up() && !ticks.is_multiple_of(UP_CHECK_EVERY) {
                continue;
            }
            self.probe().await;
            last = tokio::time::Instant::now();
        }
    }

    /// One `INFO server`, bounded by the probe timeout. It closes the breaker only when it
    /// is answered within `command_timeout`; a failure opens it at once (the probe is not
    /// a request: one failed probe is evidence enough) — except a dropped connection, which
    /// says nothing of Redis now: it is asked once more, on the connection made again
    /// (see [`RedisConn::dropped`]). The run id tells a restart.
    async fn probe(&self) {
        let cluster = self.inner.config.mode == RedisMode::Cluster;
        if cluster && self.shared().is_none() {
            // Not reached yet: try the seeds again.
            if let Ok(Some(conn)) = self.inner.backend.shared(&self.inner.config).await {
                self.inner.conn.store(Some(Arc::new(conn)));
                self.inner.generation.fetch_add(1, Ordering::AcqRel);
            }
        }
        let Some(mut conn) = self.shared() else {
            if let Some(sentinel) = self.inner.backend.sentinel() {
                sentinel.poke();
            }
            self.mark_down("no Redis connection (no primary known, or no node reached)");
            return;
        };
        let mut cmd = redis::cmd(if cluster { "CLUSTER" } else { "INFO" });
        cmd.arg(if cluster { "INFO" } else { "server" });
        let mut started = Instant::now();
        let mut info = tokio::time::timeout(
            self.inner.probe_timeout,
            cmd.query_async::<String>(&mut conn),
        )
        .await;
        if matches!(&info, Ok(Err(error)) if is_gone(error)) {
            started = Instant::now();
            info = tokio::time::timeout(
                self.inner.probe_timeout,
                cmd.query_async::<String>(&mut conn),
            )
            .await;
        }
        if !matches!(info, Ok(Ok(_)))
            && let Some(sentinel) = self.inner.backend.sentinel()
        {
            sentinel.poke();
        }
        let took = started.elapsed();
        self.inner
            .metrics
            .redis_latency(RedisOp::Ping, took.as_secs_f64());
        match info {
            // A cluster that answers but has lost a primary (until its replica is promoted)
            // refuses the keys of that primary's slots: still down, or the breaker would
            // close on this answer and open again on the next command, a flap per probe.
            Ok(Ok(info)) if cluster && !info.contains("cluster_state:ok") => {
                self.mark_down("the cluster's state is not ok (a primary lost, failover pending)");
            }
            // While closed, a slow answer that Redis' heartbeat does not confirm waited behind
            // our own commands on the shared connection: not Redis being slow.
            Ok(Ok(info))
                if took <= self.inner.command_timeout || (self.is_up() && self.answering()) =>
            {
                if !cluster && self.note_run_id(&info) {
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
            Err(_) if self.is_up() && self.answering() => {
                self.inner.metrics.redis_error(RedisOp::Ping);
            }
            Err(_) => {
                self.inner.metrics.redis_error(RedisOp::Ping);
                self.mark_down("INFO timed out");
            }
        }
    }

    /// The heartbeat behind [`Liveness`]: while the breaker is closed and commands are sent,
    /// a `PING` to every primary every [`recheck`] of `command_timeout`, on a connection of
    /// its own (nothing of ours queued ahead of it), from the Redis thread (no request
    /// worker's queue in its way); an answer within `command_timeout` is stamped. The
    /// connection is made again after an error, a `PING` without an answer in time, a new
    /// shared connection (new credentials) or, with Sentinel, a new primary.
    async fn heartbeat_loop(self, stop: CancellationToken) {
        let timeout = self.inner.command_timeout;
        let every = recheck(timeout);
        let mut conn: Option<DataConn> = None;
        let mut made_for = (0, None);
        loop {
            let slept = tokio::time::Instant::now();
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            if slept.elapsed() > every * 2 {
                // Woken more than a recheck late: this process was held up.
                self.inner.liveness.held_up();
            }
            if !self.is_up() || !self.inner.liveness.take_demand() {
                continue;
            }
            let target = (
                self.inner.generation.load(Ordering::Acquire),
                self.inner.backend.sentinel().and_then(|s| s.primary_addr()),
            );
            if target != made_for {
                conn = None;
                made_for = target;
            }
            if conn.is_none() {
                let made = tokio::time::timeout(
                    self.inner.probe_timeout,
                    self.inner
                        .backend
                        .dedicated(self.inner.config.connect_timeout, None),
                )
                .await;
                conn = match made {
                    Ok(Ok(conn)) => Some(conn),
                    // Refused (not late): a dead Redis, or its port closed.
                    Ok(Err(_)) => {
                        self.inner.liveness.refused();
                        None
                    }
                    Err(_) => None,
                };
            }
            let Some(heartbeat) = conn.as_mut() else {
                continue;
            };
            let sent = tokio::time::Instant::now();
            match tokio::time::timeout(timeout, heartbeat.ping_primaries()).await {
                Ok(Ok(())) => self.inner.liveness.answered(),
                // The timeout fired more than a recheck late: this process was held up,
                // and the answer may be unread in the socket. Nothing against Redis.
                Err(_) if sent.elapsed() > timeout + every => self.inner.liveness.held_up(),
                Ok(Err(_)) | Err(_) => conn = None,
            }
        }
    }

    /// Warns when Redis may evict any key under memory pressure: an evicted quarantine or
    /// tag time weakens what it guards (see `docs/architecture.md`, write path).
    /// `CONFIG` may be refused (managed Redis, ACLs): then nothing is said.
    async fn check_eviction_policy(&self) {
        let Some(mut conn) = self.shared() else {
            return;
        };
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
                message = "Redis maxmemory-policy may evict cacheguard's bookkeeping keys: an evicted generation only refuses fills, but an evicted write quarantine or tag invalidation time can let a fill racing a write store the old value. Prefer a volatile-* policy or noeviction, or size Redis so it never evicts.",
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

/// The first argument of `cmd` (its key, for most commands).
fn first_arg(cmd: &redis::Cmd) -> Option<&[u8]> {
    match cmd.args_iter().nth(1)? {
        redis::Arg::Simple(arg) => Some(arg),
        _ => None,
    }
}

/// An error that says the connection is gone (closed, reset, never reconnected).
fn is_gone(error: &RedisError) -> bool {
    error.is_io_error() || error.is_connection_dropped()
}

/// A demoted primary's answer to a write (also inside a script).
fn is_readonly(error: &RedisError) -> bool {
    error.code() == Some("READONLY") || error.to_string().contains("READONLY")
}

/// A cluster that leaves hash slots unserved would fail the commands of every key in them,
/// quietly, forever: refuse to start on one.
fn refuse_partial_cluster(covered: u32) -> anyhow::Result<()> {
    if covered < CLUSTER_SLOTS {
        bail!(
            "the Redis Cluster serves {covered} of {CLUSTER_SLOTS} hash slots, so commands for \
             keys in the others would fail: assign every slot (redis-cli --cluster fix) or point \
             redis.urls at a complete cluster"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `INFO` calls Redis has executed so far (`INFO commandstats`).
    async fn info_calls(redis: &crate::test_redis::TestRedis) -> u64 {
        let mut conn = redis.conn().await;
        let stats: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await
            .expect("INFO commandstats");
        stats
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_info:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// A connection dropped again and again wakes the probe at most once per
    /// `PROBE_WOKEN_EVERY`: a thousand drops in half a second cost about ten `INFO`s (and
    /// the breaker stays closed: Redis answers each), not a loop of them.
    #[tokio::test]
    async fn dropped_connections_wake_the_probe_at_most_every_fifty_ms() {
        let redis = crate::test_redis::TestRedis::start().await;
        let toml = format!(
            "[upstream]\nurl = \"http://127.0.0.1:9\"\n[redis]\nurl = \"{}\"\n",
            redis.url()
        );
        let vars = HashMap::<String, String>::new();
        let config = crate::config::Config::from_toml(&toml, "test.toml", &vars).expect("config");
        let stop = CancellationToken::new();
        let conn = RedisConn::start(
            config.redis.as_ref().expect("shared mode"),
            Metrics::unregistered(),
            stop.clone(),
        )
        .await
        .expect("redis");
        assert!(conn.is_up());
        let before = info_calls(&redis).await;
        let started = tokio::time::Instant::now();
        for _ in 0..1_000 {
            conn.dropped();
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        let elapsed = started.elapsed();
        let woken = info_calls(&redis).await - before;
        // One per 50 ms of the loop, and the closed breaker's own every 800 ms.
        let bound = u64::try_from(elapsed.as_millis() / 50 + elapsed.as_millis() / 800 + 2)
            .unwrap_or(u64::MAX);
        assert!(woken >= 1, "the probe was never woken");
        assert!(
            woken <= bound,
            "{woken} INFO probes in {elapsed:?} of dropped connections (bound {bound})"
        );
        assert!(conn.is_up(), "Redis answers: the breaker stays closed");
        stop.cancel();
    }

    /// Regression: the scope was an `async move` block awaiting the future it captured,
    /// which holds it twice over: with `timing_origin` around it too, a miss's fill task
    /// was 64,976 bytes for a 16,208-byte fill, copied on every spawn.
    #[test]
    fn counting_a_future_costs_a_few_words_not_a_second_copy_of_it() {
        crate::tally::assert_wraps_in_place(
            "count_commands",
            crate::tally::four_kib(),
            count_commands,
        );
    }

    const TIMEOUT: Duration = Duration::from_millis(50);
    const PATIENCE: Duration = Duration::from_secs(1);

    /// A Redis that answers the heartbeat every `every` until `until` (after the start).
    fn heartbeat(every: Duration, until: Duration) -> Arc<Liveness> {
        let liveness = Arc::new(Liveness::new());
        let beating = liveness.clone();
        tokio::spawn(async move {
            let end = tokio::time::Instant::now() + until;
            while tokio::time::Instant::now() < end {
                beating.answered();
                tokio::time::sleep(every).await;
            }
        });
        liveness
    }

    /// A command answered `after` its send.
    async fn answered_after(after: Duration) -> u32 {
        tokio::time::sleep(after).await;
        7
    }

    /// Regression: a command whose answer came after `command_timeout` counted toward the
    /// breaker and failed its request though Redis was answering (a saturated machine: the
    /// wait was this process's queue). Now it is waited for while the heartbeat answers.
    #[tokio::test(start_paused = true)]
    async fn a_late_answer_is_waited_for_while_redis_answers_the_heartbeat() {
        let liveness = heartbeat(recheck(TIMEOUT), Duration::from_secs(10));
        tokio::task::yield_now().await;
        let started = tokio::time::Instant::now();
        let answer = answer_within(
            answered_after(Duration::from_millis(180)),
            TIMEOUT,
            Some(PATIENCE),
            &liveness,
        )
        .await;
        assert_eq!(answer, Ok(7));
        assert_eq!(started.elapsed(), Duration::from_millis(180));
        assert!(liveness.take_demand(), "a command asks for heartbeats");
        assert!(!liveness.take_demand());
    }

    /// Regression: a process held up as a whole (stopped, CPU-throttled) found, once it ran
    /// again, every command past its deadline and no heartbeat stamped meanwhile (the
    /// heartbeat was held up too), and counted Redis as silent though its answers were
    /// waiting in the socket. A command whose own deadline fired late now looks again a
    /// recheck later, by when the Redis thread has read them.
    #[tokio::test(start_paused = true)]
    async fn a_command_held_up_past_its_deadline_looks_again_before_it_gives_up() {
        let liveness = Arc::new(Liveness::new());
        let (answer, read) = tokio::sync::oneshot::channel::<u32>();
        let command = {
            let liveness = liveness.clone();
            tokio::spawn(async move {
                answer_within(
                    async { read.await.unwrap_or(0) },
                    TIMEOUT,
                    Some(PATIENCE),
                    &liveness,
                )
                .await
            })
        };
        tokio::task::yield_now().await;
        // The whole process stops for 150 ms: no task runs, the clock goes on.
        tokio::time::advance(Duration::from_millis(150)).await;
        // It runs again: the command's deadline fires first, then the Redis thread reads
        // the answer that came meanwhile.
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        let _ = answer.send(7);
        let answered = command.await.expect("the command's task");
        assert_eq!(
            answered,
            Ok(7),
            "the answer came while the process was held up"
        );
    }

    /// The heartbeat's own lateness counts like an answer: no evidence against Redis.
    #[tokio::test(start_paused = true)]
    async fn a_held_up_heartbeat_is_no_evidence_of_silence() {
        let liveness = Liveness::new();
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!liveness.answering(silence(TIMEOUT)));
        liveness.held_up();
        assert!(liveness.answering(silence(TIMEOUT)));
        tokio::time::advance(silence(TIMEOUT) + Duration::from_millis(1)).await;
        assert!(!liveness.answering(silence(TIMEOUT)));
    }

    /// Regression: a killed Redis (its heartbeat connection refused) counted as answering
    /// for 2 × `command_timeout` after its last answer, so L1 hits that asked it (their
    /// copies unverified once the bus dropped) waited past `command_timeout` for a Redis
    /// already gone. A refusal is evidence of silence at once; a later answer ends it.
    #[tokio::test(start_paused = true)]
    async fn a_refused_heartbeat_is_evidence_of_silence_at_once() {
        let liveness = Liveness::new();
        tokio::time::advance(Duration::from_millis(1)).await;
        liveness.answered();
        tokio::time::advance(Duration::from_millis(5)).await;
        liveness.refused();
        let started = tokio::time::Instant::now();
        let answer = answer_within(
            std::future::pending::<u32>(),
            TIMEOUT,
            Some(PATIENCE),
            &liveness,
        )
        .await;
        assert_eq!(answer, Err(TimedOut));
        assert_eq!(started.elapsed(), TIMEOUT, "given up at its own timeout");
        tokio::time::advance(Duration::from_millis(1)).await;
        liveness.answered();
        assert!(liveness.answering(silence(TIMEOUT)), "answering again");
    }

    /// A stopped or blackholed Redis answers nothing from `T0` on: every command sent then,
    /// and every one still waiting, is given up within 2 × `command_timeout` + one recheck
    /// of `T0`, so `breaker_failures` (3) of them open the breaker within
    /// 3 × `command_timeout` + 50 ms of the stop.
    #[tokio::test(start_paused = true)]
    async fn a_silent_redis_fails_commands_within_the_timeout_and_a_recheck() {
        let stop_at = Duration::from_millis(300);
        let liveness = heartbeat(recheck(TIMEOUT), stop_at);
        tokio::task::yield_now().await;
        let start = tokio::time::Instant::now();
        let never = std::future::pending::<u32>;
        let mut given_up = Vec::new();
        // One sent 30 ms before the stop (its deadline falls while Redis still answers the
        // heartbeat), then three sent after it.
        for sent_at in [270, 300, 310, 320] {
            tokio::time::sleep_until(start + Duration::from_millis(sent_at)).await;
            let liveness = liveness.clone();
            given_up.push(tokio::spawn(async move {
                let answer = answer_within(never(), TIMEOUT, Some(PATIENCE), &liveness).await;
                (answer, start.elapsed())
            }));
        }
        let bound = stop_at + 3 * TIMEOUT + Duration::from_millis(50);
        for task in given_up {
            let (answer, at) = task.await.expect("the command's task");
            assert_eq!(answer, Err(TimedOut));
            assert!(
                at <= stop_at + silence(TIMEOUT) + recheck(TIMEOUT),
                "given up at {at:?}, Redis silent from {stop_at:?}"
            );
            assert!(at <= bound);
        }
    }

    /// A Redis slower than `command_timeout` on every answer, the heartbeat's included,
    /// is not answering: its commands fail at `command_timeout`, as before.
    #[tokio::test(start_paused = true)]
    async fn a_redis_slower_than_the_timeout_is_not_answering() {
        let liveness = Liveness::new();
        let started = tokio::time::Instant::now();
        let answer = answer_within(
            answered_after(TIMEOUT * 2),
            TIMEOUT,
            Some(PATIENCE),
            &liveness,
        )
        .await;
        assert_eq!(answer, Err(TimedOut));
        assert_eq!(started.elapsed(), TIMEOUT);
    }

    /// Without patience (a lock renewal) a command ends at `command_timeout` even while
    /// Redis answers; with it, at the patience at most.
    #[tokio::test(start_paused = true)]
    async fn patience_bounds_the_wait_while_redis_answers() {
        let liveness = heartbeat(recheck(TIMEOUT), Duration::from_secs(10));
        tokio::task::yield_now().await;
        let started = tokio::time::Instant::now();
        let strict = answer_within(std::future::pending::<()>(), TIMEOUT, None, &liveness).await;
        assert_eq!(strict, Err(TimedOut));
        assert_eq!(started.elapsed(), TIMEOUT);
        let started = tokio::time::Instant::now();
        let patient = answer_within(
            std::future::pending::<()>(),
            TIMEOUT,
            Some(PATIENCE),
            &liveness,
        )
        .await;
        assert_eq!(patient, Err(TimedOut));
        assert_eq!(started.elapsed(), PATIENCE);
    }

    #[test]
    fn the_recheck_is_a_quarter_of_the_timeout_within_bounds() {
        assert_eq!(recheck(TIMEOUT), Duration::from_micros(12_500));
        assert_eq!(recheck(Duration::from_millis(2)), Duration::from_millis(1));
        assert_eq!(recheck(Duration::from_secs(5)), Duration::from_millis(250));
    }

    #[tokio::test(start_paused = true)]
    async fn a_breaker_that_flaps_stays_open_longer_each_time() {
        let mut h = Hysteresis::default();
        h.opened();
        assert!(
            h.may_close(),
            "a first open may close at the next good probe"
        );
        h.closed();
        // Open again 1 s later: a flap.
        tokio::time::advance(Duration::from_secs(1)).await;
        h.opened();
        assert!(!h.may_close());
        tokio::time::advance(HOLD_MIN).await;
        assert!(h.may_close());
        h.closed();
        tokio::time::advance(Duration::from_millis(100)).await;
        h.opened();
        tokio::time::advance(HOLD_MIN).await;
        assert!(!h.may_close(), "the hold doubled");
        tokio::time::advance(HOLD_MIN).await;
        assert!(h.may_close());
        h.closed();
        // Quiet for a while: back to no hold.
        tokio::time::advance(FLAP_WINDOW).await;
        h.opened();
        assert!(h.may_close());
    }

    /// A server's error answer, as redis-rs hands it over.
    fn answer(line: &str) -> RedisError {
        let value = redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).expect("RESP");
        value.extract_error().expect_err("an error answer")
    }

    #[test]
    fn a_slot_being_migrated_is_neither_a_failure_nor_a_refusal() {
        for line in [
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "ASK 3999 127.0.0.1:6381",
            "MOVED 3999 127.0.0.1:6381",
        ] {
            let error = answer(line);
            assert!(Migrations::is_migration(&error), "{line}");
            assert!(!Refusals::is_refusal(&error), "{line}");
        }
        for line in [
            "NOPERM this user has no permissions",
            "CLUSTERDOWN The cluster is down",
            "ERR Script attempted to access a non local key in a cluster node",
        ] {
            assert!(!Migrations::is_migration(&answer(line)), "{line}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_hold_is_capped() {
        let mut h = Hysteresis::default();
        for _ in 0..20 {
            h.opened();
            tokio::time::advance(h.hold).await;
            assert!(h.may_close());
            h.closed();
        }
        assert_eq!(h.hold, HOLD_MAX);
    }
}
