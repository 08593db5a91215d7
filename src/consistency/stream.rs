//! External invalidation through a Redis Stream.
//!
//! CDC tools (Canal, Debezium, Maxwell) or batch jobs write invalidations into a Redis
//! Stream (default key `cg:invalidate`); every instance of a fleet reads it through ONE
//! consumer group (default `cacheguard`), under its own instance id as consumer name.
//!
//! # Entry format
//!
//! Each entry carries one or more fields, in any mix:
//!
//! - `path`: a concrete request path (`/api/items/7`): every cached variant of it. Must
//!   start with `/`, at most 8 KiB.
//! - `tag`: a surrogate key: every entry tagged with it. Non-empty, at most 1 KiB.
//!
//! Field names are ASCII case-insensitive; values must be UTF-8. An entry may carry several
//! `path` and `tag` fields. For example:
//!
//! ```text
//! redis-cli XADD cg:invalidate MAXLEN '~' 100000 '*' path /api/items/7 tag item-7
//! ```
//!
//! (Quote the `~`: an unquoted lone `~` is expanded to `$HOME` by the shell.)
//!
//! An entry with an unknown field is still applied for its valid fields (with a warning).
//! An entry without a single valid target is acknowledged and counted `malformed`: it is
//! never retried, since retrying cannot make it valid.
//!
//! # Delivery
//!
//! Each entry is delivered to one instance of the group, which applies it (bumps the
//! generation, deletes in Redis, broadcasts on pub/sub so every instance drops its L1
//! copies) and only then acknowledges it (`XACK`). That is at-least-once delivery: an
//! instance that dies between applying and acknowledging leaves the entry pending, and it
//! is applied again. Invalidation is idempotent, so at-least-once is exactly-once in
//! effect.
//!
//! The entries of one read (up to `batch`) are applied with ONE call of `apply`, with their
//! targets deduplicated, and acknowledged with one `XACK`. When `apply` answers `false`
//! (Redis unavailable), nothing of that read is acknowledged; the entries stay pending on
//! this consumer and are read again from its own pending list after a backoff.
//!
//! # Claiming
//!
//! Entries pending on a consumer that died (or hangs) are claimed by another with
//! `XAUTOCLAIM` once they have been idle for `claim_idle`, checked every `claim_idle / 2`
//! but no more often than once a second. `claim_idle` must be longer than the longest
//! `apply` (otherwise a slow but live consumer's entries are claimed and applied twice:
//! harmless, but wasted work). Consumers of the group with nothing pending and idle for
//! more than an hour are deleted, since instance ids are random per process and dead
//! names would pile up.
//!
//! # Producers
//!
//! Acknowledged entries stay in the stream: producers must trim it, with `MAXLEN ~ N` (or
//! `MINID`) on their `XADD`. Trimming an entry that is still pending is safe: it is
//! acknowledged as deleted when read or claimed (and simply not applied).
//!
//! Requires Redis 6.2 (`XAUTOCLAIM`); 7.0 or later recommended (deleted entries are then
//! reported by `XAUTOCLAIM` and dropped from the pending list).

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use redis::Value;
use redis::aio::ConnectionLike;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::coord::backend::{Backend, DataConn};
use crate::metrics::StreamMetrics;

/// What one stream entry asks to invalidate.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Target {
    /// A concrete request path (`/api/items/7`): every cached variant of it.
    Path(String),
    /// A surrogate key: every entry tagged with it.
    Tag(String),
}

#[derive(Clone, Debug)]
pub(crate) struct StreamSettings {
    /// The stream, e.g. `cg:invalidate`.
    pub(crate) key: String,
    /// The consumer group every instance joins, e.g. `cacheguard`.
    pub(crate) group: String,
    /// This instance's id.
    pub(crate) consumer: String,
    /// Entries per read (default 100).
    pub(crate) batch: usize,
    /// `XREADGROUP BLOCK` (default 1 s).
    pub(crate) block: Duration,
    /// Claim other consumers' entries idle this long (default 30 s).
    pub(crate) claim_idle: Duration,
    /// Bound on every non-blocking command.
    pub(crate) command_timeout: Duration,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// `XAUTOCLAIM` runs every `claim_idle / 2`, but no more often than this.
const MIN_CLAIM_INTERVAL: Duration = Duration::from_secs(1);
const PENDING_REFRESH: Duration = Duration::from_secs(5);
const CLEANUP_INTERVAL: Duration = Duration::from_secs(60);
/// Consumers with nothing pending and idle longer than this are deleted from the group.
const CONSUMER_MAX_IDLE: Duration = Duration::from_secs(3600);
/// A connection (TCP and handshake) gets at least this long, even with a short
/// `command_timeout`.
const MIN_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// `BLOCK 0` means "forever": never ask for less than this.
const MIN_BLOCK: Duration = Duration::from_millis(1);
const MAX_PATH_BYTES: usize = 8 * 1024;
const MAX_TAG_BYTES: usize = 1024;

/// Runs until `stop` is cancelled. `apply` returns true when the invalidations were applied
/// (false: Redis unavailable — do not ack; retry later).
///
/// Uses a connection of its own (a blocking `XREADGROUP` must not stall other traffic) and
/// reconnects with backoff (100 ms doubling to 5 s) after any Redis error. On `stop`, an
/// `apply` in progress is dropped and its entries stay pending: another instance claims
/// them after `claim_idle`.
pub(crate) async fn run<F, Fut>(
    backend: Backend,
    settings: StreamSettings,
    apply: F,
    metrics: StreamMetrics,
    stop: CancellationToken,
) where
    F: Fn(Vec<Target>) -> Fut + Send + Sync,
    Fut: Future<Output = bool> + Send,
{
    let worker = Worker {
        settings: &settings,
        apply: &apply,
        metrics: &metrics,
    };
    let mut timers = Timers::new(Instant::now());
    let mut backoff = BACKOFF_MIN;
    loop {
        let ended = tokio::select! {
            () = stop.cancelled() => return,
            ended = worker.session(&backend, &mut timers, &mut backoff) => ended,
        };
        let failure = match ended {
            Ok(never) => match never {},
            Err(failure) => failure,
        };
        metrics.errors.inc();
        warn!(
            message = "Invalidation stream failed; reconnecting.",
            key = %settings.key,
            op = failure.op,
            error = %failure,
            retry_in = ?backoff,
        );
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// When the periodic work is due next; kept across reconnects.
#[derive(Debug)]
struct Timers {
    claim: Instant,
    pending: Instant,
    cleanup: Instant,
}

impl Timers {
    fn new(now: Instant) -> Self {
        Timers {
            claim: now,
            pending: now,
            cleanup: now,
        }
    }

    fn next_due(&self) -> Instant {
        self.claim.min(self.pending).min(self.cleanup)
    }
}

/// How one round of work ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Progress {
    /// Everything read was applied and acknowledged.
    Done,
    /// `apply` answered false: nothing of the last read was acknowledged.
    Deferred,
}

/// One stream entry as read; `fields` is `None` for an entry deleted from the stream while
/// it was pending (trimmed by the producer).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    id: String,
    fields: Option<Vec<(Vec<u8>, Vec<u8>)>>,
}

struct Worker<'a, F> {
    settings: &'a StreamSettings,
    apply: &'a F,
    metrics: &'a StreamMetrics,
}

impl<F, Fut> Worker<'_, F>
where
    F: Fn(Vec<Target>) -> Fut + Send + Sync,
    Fut: Future<Output = bool> + Send,
{
    /// One connection's life: returns only on a failure that needs a new connection.
    async fn session(
        &self,
        backend: &Backend,
        timers: &mut Timers,
        backoff: &mut Duration,
    ) -> Result<Infallible, Failure> {
        let mut conn = self.connect(backend).await?;
        create_group(&mut conn, self.settings).await?;
        // Entries may be pending on this consumer from before (a read whose reply was lost
        // with the previous connection, or an `apply` that answered false).
        let mut own_pending = true;
        let mut apply_backoff = BACKOFF_MIN;
        let mut nogroup_streak = 0u32;
        loop {
            match self.round(&mut conn, timers, &mut own_pending).await {
                Ok(Progress::Done) => {
                    *backoff = BACKOFF_MIN;
                    apply_backoff = BACKOFF_MIN;
                    nogroup_streak = 0;
                }
                Ok(Progress::Deferred) => {
                    *backoff = BACKOFF_MIN;
                    nogroup_streak = 0;
                    own_pending = true;
                    if apply_backoff == BACKOFF_MIN {
                        warn!(
                            message = "Stream invalidations could not be applied; retrying.",
                            key = %self.settings.key,
                        );
                    } else {
                        debug!(message = "Stream invalidations still deferred.", retry_in = ?apply_backoff);
                    }
                    tokio::time::sleep(apply_backoff).await;
                    apply_backoff = (apply_backoff * 2).min(BACKOFF_MAX);
                }
                // The group is gone while the connection is fine: someone deleted the key
                // or the group (`UNBLOCKED` when that happened during our BLOCK read), or
                // Redis restarted empty between two commands. Recreate it here; a second
                // time in a row goes the reconnect way, with backoff.
                Err(failure) if failure.is_group_gone() && nogroup_streak == 0 => {
                    nogroup_streak += 1;
                    self.metrics.errors.inc();
                    warn!(
                        message = "Invalidation stream group is gone; recreating it.",
                        key = %self.settings.key,
                        group = %self.settings.group,
                        error = %failure,
                    );
                    create_group(&mut conn, self.settings).await?;
                    own_pending = true;
                }
                Err(failure) => return Err(failure),
            }
        }
    }

    async fn connect(&self, backend: &Backend) -> Result<DataConn, Failure> {
        let limit = self.settings.command_timeout.max(MIN_CONNECT_TIMEOUT);
        // No response timeout of the crate's own: its default (500 ms) is shorter than a
        // BLOCK read. Every command here is bounded by `tokio::time::timeout` instead. The
        // connection is this consumer's own: a blocking read must not stall other traffic.
        match tokio::time::timeout(limit, backend.dedicated(limit, None)).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(error)) => Err(Failure::redis("connect", error)),
            Err(_) => Err(Failure::timeout("connect", limit)),
        }
    }

    /// Own pending entries first, then claims and housekeeping when due, then new entries.
    async fn round(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        timers: &mut Timers,
        own_pending: &mut bool,
    ) -> Result<Progress, Failure> {
        if *own_pending {
            if self.drain_own_pending(conn).await? == Progress::Deferred {
                return Ok(Progress::Deferred);
            }
            *own_pending = false;
        }
        let now = Instant::now();
        if now >= timers.claim {
            let progress = self.claim(conn).await;
            timers.claim = Instant::now() + self.claim_interval();
            if progress? == Progress::Deferred {
                return Ok(Progress::Deferred);
            }
        }
        if now >= timers.pending {
            let count = pending_count(conn, self.settings).await?;
            self.metrics.pending.set(count);
            timers.pending = Instant::now() + PENDING_REFRESH;
        }
        if now >= timers.cleanup {
            timers.cleanup = Instant::now() + CLEANUP_INTERVAL;
            // Housekeeping: a failure here (say, an ACL without XGROUP DELCONSUMER) must
            // not stop invalidations. A broken connection shows on the next read anyway.
            if let Err(failure) =
                remove_idle_consumers(conn, self.settings, CONSUMER_MAX_IDLE).await
            {
                self.metrics.errors.inc();
                warn!(
                    message = "Could not remove idle consumers of the invalidation stream.",
                    op = failure.op,
                    error = %failure,
                );
            }
        }
        // Wake up in time for the next periodic work, even without traffic.
        let block = timers
            .next_due()
            .saturating_duration_since(Instant::now())
            .clamp(MIN_BLOCK, self.settings.block.max(MIN_BLOCK));
        let entries = self.read_new(conn, block).await?;
        self.process(conn, entries).await
    }

    fn claim_interval(&self) -> Duration {
        (self.settings.claim_idle / 2).max(MIN_CLAIM_INTERVAL)
    }

    /// Entries delivered to this consumer and not acknowledged, page by page.
    async fn drain_own_pending(
        &self,
        conn: &mut (impl ConnectionLike + Send),
    ) -> Result<Progress, Failure> {
        let mut after = "0".to_owned();
        loop {
            let mut cmd = redis::cmd("XREADGROUP");
            cmd.arg("GROUP")
                .arg(&self.settings.group)
                .arg(&self.settings.consumer)
                .arg("COUNT")
                .arg(self.batch())
                .arg("STREAMS")
                .arg(&self.settings.key)
                .arg(&after);
            let reply = query(conn, &cmd, "XREADGROUP 0", self.settings.command_timeout).await?;
            let entries =
                parse_read_reply(&reply).map_err(|e| Failure::reply("XREADGROUP 0", e))?;
            let Some(last) = entries.last() else {
                return Ok(Progress::Done);
            };
            after.clone_from(&last.id);
            if self.process(conn, entries).await? == Progress::Deferred {
                return Ok(Progress::Deferred);
            }
        }
    }

    /// `XAUTOCLAIM` entries idle for `claim_idle` on any consumer, following the cursor.
    async fn claim(&self, conn: &mut (impl ConnectionLike + Send)) -> Result<Progress, Failure> {
        let idle_ms = u64::try_from(self.settings.claim_idle.as_millis()).unwrap_or(u64::MAX);
        let mut cursor = "0-0".to_owned();
        let mut total = 0u64;
        let progress = loop {
            let mut cmd = redis::cmd("XAUTOCLAIM");
            cmd.arg(&self.settings.key)
                .arg(&self.settings.group)
                .arg(&self.settings.consumer)
                .arg(idle_ms)
                .arg(&cursor)
                .arg("COUNT")
                .arg(self.batch());
            let reply = query(conn, &cmd, "XAUTOCLAIM", self.settings.command_timeout).await?;
            let claimed =
                parse_autoclaim_reply(&reply).map_err(|e| Failure::reply("XAUTOCLAIM", e))?;
            let live = claimed
                .entries
                .iter()
                .filter(|e| e.fields.is_some())
                .count() as u64;
            self.metrics.claimed.inc_by(live);
            total += live;
            let mut entries = claimed.entries;
            // Ids of entries deleted from the stream while pending (Redis 7+ already drops
            // them from the pending list; acknowledging them again is harmless).
            entries.extend(
                claimed
                    .deleted
                    .into_iter()
                    .map(|id| Entry { id, fields: None }),
            );
            if self.process(conn, entries).await? == Progress::Deferred {
                break Progress::Deferred;
            }
            if is_zero_id(&claimed.cursor) || claimed.cursor == cursor {
                break Progress::Done;
            }
            cursor = claimed.cursor;
        };
        if total > 0 {
            info!(
                message = "Claimed invalidation stream entries from an idle consumer.",
                count = total,
            );
        }
        Ok(progress)
    }

    async fn read_new(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        block: Duration,
    ) -> Result<Vec<Entry>, Failure> {
        let block_ms = u64::try_from(block.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(&self.settings.group)
            .arg(&self.settings.consumer)
            .arg("COUNT")
            .arg(self.batch())
            .arg("BLOCK")
            .arg(block_ms)
            .arg("STREAMS")
            .arg(&self.settings.key)
            .arg(">");
        let limit = block + self.settings.command_timeout;
        let reply = query(conn, &cmd, "XREADGROUP", limit).await?;
        parse_read_reply(&reply).map_err(|e| Failure::reply("XREADGROUP", e))
    }

    /// Applies one read's entries with one `apply` call, then acknowledges them all with
    /// one `XACK`. Nothing is acknowledged (or counted) when `apply` answers false.
    async fn process(
        &self,
        conn: &mut (impl ConnectionLike + Send),
        entries: Vec<Entry>,
    ) -> Result<Progress, Failure> {
        if entries.is_empty() {
            return Ok(Progress::Done);
        }
        let mut ids = Vec::with_capacity(entries.len());
        let mut targets = Vec::new();
        let mut seen = HashSet::new();
        let (mut applied, mut malformed) = (0u64, 0u64);
        for entry in entries {
            match &entry.fields {
                None => {
                    debug!(message = "Invalidation stream entry was deleted while pending.", id = %entry.id);
                }
                Some(fields) => {
                    let parsed = parse_fields(fields);
                    if parsed.targets.is_empty() {
                        malformed += 1;
                        warn!(
                            message = "Malformed invalidation stream entry; acknowledged without effect.",
                            id = %entry.id,
                            problems = %parsed.problems.join("; "),
                        );
                    } else {
                        applied += 1;
                        if !parsed.problems.is_empty() {
                            warn!(
                                message = "Invalidation stream entry has invalid fields; applying the valid ones.",
                                id = %entry.id,
                                problems = %parsed.problems.join("; "),
                            );
                        }
                        for target in parsed.targets {
                            if seen.insert(target.clone()) {
                                targets.push(target);
                            }
                        }
                    }
                }
            }
            ids.push(entry.id);
        }
        if !targets.is_empty() && !(self.apply)(targets).await {
            return Ok(Progress::Deferred);
        }
        let mut cmd = redis::cmd("XACK");
        cmd.arg(&self.settings.key)
            .arg(&self.settings.group)
            .arg(&ids);
        query(conn, &cmd, "XACK", self.settings.command_timeout).await?;
        if applied > 0 {
            self.metrics
                .entries
                .with_label_values(&["applied"])
                .inc_by(applied);
        }
        if malformed > 0 {
            self.metrics
                .entries
                .with_label_values(&["malformed"])
                .inc_by(malformed);
        }
        Ok(Progress::Done)
    }

    fn batch(&self) -> usize {
        self.settings.batch.max(1)
    }
}

/// `XGROUP CREATE key group 0 MKSTREAM`; an existing group (`BUSYGROUP`) is fine.
async fn create_group(
    conn: &mut (impl ConnectionLike + Send),
    settings: &StreamSettings,
) -> Result<(), Failure> {
    // Start at `0`, not `$`: entries written before the group existed (a producer that
    // started first, or writes right after Redis restarted empty) must not be lost, and
    // applying an old invalidation again is harmless because invalidation is idempotent.
    let mut cmd = redis::cmd("XGROUP");
    cmd.arg("CREATE")
        .arg(&settings.key)
        .arg(&settings.group)
        .arg("0")
        .arg("MKSTREAM");
    match query(conn, &cmd, "XGROUP CREATE", settings.command_timeout).await {
        Ok(_) => {
            info!(
                message = "Invalidation stream consumer group created.",
                key = %settings.key,
                group = %settings.group,
            );
            Ok(())
        }
        Err(failure) if failure.code() == Some("BUSYGROUP") => Ok(()),
        Err(failure) => Err(failure),
    }
}

/// The group's pending count, from the summary form of `XPENDING`.
async fn pending_count(
    conn: &mut (impl ConnectionLike + Send),
    settings: &StreamSettings,
) -> Result<i64, Failure> {
    let mut cmd = redis::cmd("XPENDING");
    cmd.arg(&settings.key).arg(&settings.group);
    let reply = query(conn, &cmd, "XPENDING", settings.command_timeout).await?;
    parse_pending_summary(&reply)
        .ok_or_else(|| Failure::reply("XPENDING", format!("unexpected reply {reply:?}")))
}

/// Deletes the group's consumers (other than this one) with nothing pending and idle for
/// more than `max_idle`. Returns their names.
async fn remove_idle_consumers(
    conn: &mut (impl ConnectionLike + Send),
    settings: &StreamSettings,
    max_idle: Duration,
) -> Result<Vec<String>, Failure> {
    let mut cmd = redis::cmd("XINFO");
    cmd.arg("CONSUMERS").arg(&settings.key).arg(&settings.group);
    let reply = query(conn, &cmd, "XINFO CONSUMERS", settings.command_timeout).await?;
    let consumers = parse_consumers(&reply).map_err(|e| Failure::reply("XINFO CONSUMERS", e))?;
    let max_idle_ms = i64::try_from(max_idle.as_millis()).unwrap_or(i64::MAX);
    let mut removed = Vec::new();
    for consumer in consumers {
        // `idle` is the time since the consumer's last attempted interaction (any read,
        // even an empty one), so a live consumer never gets near an hour. Not `inactive`
        // (7.2+: since the last successful one), which grows on a quiet stream.
        if consumer.name == settings.consumer
            || consumer.pending != 0
            || consumer.idle_ms <= max_idle_ms
        {
            continue;
        }
        let mut cmd = redis::cmd("XGROUP");
        cmd.arg("DELCONSUMER")
            .arg(&settings.key)
            .arg(&settings.group)
            .arg(&consumer.name);
        let reply = query(conn, &cmd, "XGROUP DELCONSUMER", settings.command_timeout).await?;
        // Nonzero only if it read entries between XINFO and now: those were dropped from
        // the pending list (and will not be redelivered). A consumer idle for an hour
        // waking up in that instant is not a practical concern; say so if it happens.
        if let Some(lost) = as_int(&reply).filter(|n| *n > 0) {
            warn!(
                message = "Deleted an idle consumer that had just read entries.",
                consumer = %consumer.name,
                pending = lost,
            );
        }
        removed.push(consumer.name);
    }
    if !removed.is_empty() {
        info!(
            message = "Removed idle consumers from the invalidation stream group.",
            count = removed.len(),
            consumers = %removed.join(","),
        );
    }
    Ok(removed)
}

/// One command, bounded by `limit`.
async fn query(
    conn: &mut (impl ConnectionLike + Send),
    cmd: &redis::Cmd,
    op: &'static str,
    limit: Duration,
) -> Result<Value, Failure> {
    match tokio::time::timeout(limit, cmd.query_async::<Value>(conn)).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(Failure::redis(op, error)),
        Err(_) => Err(Failure::timeout(op, limit)),
    }
}

/// A failed step; ends the connection unless handled where it happens.
#[derive(Debug)]
struct Failure {
    op: &'static str,
    kind: FailureKind,
}

#[derive(Debug)]
enum FailureKind {
    Redis(redis::RedisError),
    Timeout(Duration),
    /// A reply of a shape this module does not understand.
    Reply(String),
}

impl Failure {
    fn redis(op: &'static str, error: redis::RedisError) -> Self {
        Failure {
            op,
            kind: FailureKind::Redis(error),
        }
    }

    fn timeout(op: &'static str, limit: Duration) -> Self {
        Failure {
            op,
            kind: FailureKind::Timeout(limit),
        }
    }

    fn reply(op: &'static str, detail: String) -> Self {
        Failure {
            op,
            kind: FailureKind::Reply(detail),
        }
    }

    /// `NOGROUP`, or `UNBLOCKED` (a blocked read whose stream or group was deleted).
    fn is_group_gone(&self) -> bool {
        matches!(self.code(), Some("NOGROUP" | "UNBLOCKED"))
    }

    /// The server's error code (`NOGROUP`, `BUSYGROUP`, ...), if Redis answered with one.
    fn code(&self) -> Option<&str> {
        match &self.kind {
            FailureKind::Redis(error) => error.code(),
            _ => None,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            FailureKind::Redis(error) => write!(f, "{}: {error}", self.op),
            FailureKind::Timeout(limit) => write!(f, "{}: timed out after {limit:?}", self.op),
            FailureKind::Reply(detail) => write!(f, "{}: unexpected reply: {detail}", self.op),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Entry fields.

#[derive(Debug, Default, PartialEq, Eq)]
struct ParsedFields {
    targets: Vec<Target>,
    /// Why fields were skipped, for the log.
    problems: Vec<String>,
}

fn parse_fields(fields: &[(Vec<u8>, Vec<u8>)]) -> ParsedFields {
    let mut parsed = ParsedFields::default();
    for (name, value) in fields {
        let is_path = name.eq_ignore_ascii_case(b"path");
        if !is_path && !name.eq_ignore_ascii_case(b"tag") {
            parsed.problems.push(format!(
                "unknown field {:?}",
                String::from_utf8_lossy(name)
                    .chars()
                    .take(64)
                    .collect::<String>()
            ));
            continue;
        }
        let field = if is_path { "path" } else { "tag" };
        let Ok(text) = std::str::from_utf8(value) else {
            parsed.problems.push(format!("{field} is not UTF-8"));
            continue;
        };
        if is_path {
            if !text.starts_with('/') {
                parsed
                    .problems
                    .push("path does not start with '/'".to_owned());
            } else if text.len() > MAX_PATH_BYTES {
                parsed
                    .problems
                    .push(format!("path longer than {MAX_PATH_BYTES} bytes"));
            } else {
                parsed.targets.push(Target::Path(text.to_owned()));
            }
        } else if text.is_empty() {
            parsed.problems.push("tag is empty".to_owned());
        } else if text.len() > MAX_TAG_BYTES {
            parsed
                .problems
                .push(format!("tag longer than {MAX_TAG_BYTES} bytes"));
        } else {
            parsed.targets.push(Target::Tag(text.to_owned()));
        }
    }
    if fields.is_empty() {
        parsed.problems.push("no fields".to_owned());
    }
    parsed
}

// ---------------------------------------------------------------------------------------
// Replies, from raw values. RESP2 and RESP3 differ for XREADGROUP (an array of
// `[key, entries]` pairs vs a map) and XINFO (flat field/value arrays vs maps).

fn unwrap_attribute(value: &Value) -> &Value {
    match value {
        Value::Attribute { data, .. } => unwrap_attribute(data),
        other => other,
    }
}

fn as_bytes(value: &Value) -> Option<&[u8]> {
    match unwrap_attribute(value) {
        Value::BulkString(bytes) => Some(bytes),
        Value::SimpleString(text) => Some(text.as_bytes()),
        Value::VerbatimString { text, .. } => Some(text.as_bytes()),
        _ => None,
    }
}

fn as_text(value: &Value) -> Option<String> {
    as_bytes(value)
        .and_then(|b| std::str::from_utf8(b).ok())
        .map(str::to_owned)
}

fn as_int(value: &Value) -> Option<i64> {
    match unwrap_attribute(value) {
        Value::Int(n) => Some(*n),
        other => std::str::from_utf8(as_bytes(other)?).ok()?.parse().ok(),
    }
}

fn as_seq(value: &Value) -> Option<&[Value]> {
    match unwrap_attribute(value) {
        Value::Array(items) | Value::Set(items) => Some(items),
        _ => None,
    }
}

/// Field/value pairs: a RESP3 map, or a flat RESP2 array.
fn as_pairs(value: &Value) -> Option<Vec<(&Value, &Value)>> {
    match unwrap_attribute(value) {
        Value::Map(pairs) => Some(pairs.iter().map(|(k, v)| (k, v)).collect()),
        Value::Array(items) if items.len() % 2 == 0 => {
            Some(items.chunks_exact(2).map(|p| (&p[0], &p[1])).collect())
        }
        _ => None,
    }
}

fn is_zero_id(id: &str) -> bool {
    id == "0-0" || id == "0"
}

/// `XREADGROUP`: nil (nothing), `[[key, entries]]` (RESP2) or `{key: entries}` (RESP3).
fn parse_read_reply(value: &Value) -> Result<Vec<Entry>, String> {
    let mut entries = Vec::new();
    match unwrap_attribute(value) {
        Value::Nil => {}
        Value::Map(streams) => {
            for (_, stream) in streams {
                entries.extend(parse_entries(stream)?);
            }
        }
        Value::Array(streams) => {
            for stream in streams {
                match as_seq(stream) {
                    Some([_, stream_entries]) => entries.extend(parse_entries(stream_entries)?),
                    _ => return Err(format!("stream element {stream:?}")),
                }
            }
        }
        other => return Err(format!("{other:?}")),
    }
    Ok(entries)
}

/// A list of `[id, fields]`; `fields` nil for an entry deleted while pending. A bare nil in
/// place of an entry (old servers, deleted entry) carries no id and is skipped.
fn parse_entries(value: &Value) -> Result<Vec<Entry>, String> {
    if matches!(unwrap_attribute(value), Value::Nil) {
        return Ok(Vec::new());
    }
    let items = as_seq(value).ok_or_else(|| format!("entries {value:?}"))?;
    let mut entries = Vec::with_capacity(items.len());
    for item in items {
        if matches!(unwrap_attribute(item), Value::Nil) {
            continue;
        }
        let Some([id, fields]) = as_seq(item) else {
            return Err(format!("entry {item:?}"));
        };
        let id = as_text(id).ok_or_else(|| format!("entry id {id:?}"))?;
        let fields = if matches!(unwrap_attribute(fields), Value::Nil) {
            None
        } else {
            let pairs = as_pairs(fields).ok_or_else(|| format!("fields of {id}: {fields:?}"))?;
            let mut out = Vec::with_capacity(pairs.len());
            for (name, value) in pairs {
                match (as_bytes(name), as_bytes(value)) {
                    (Some(name), Some(value)) => out.push((name.to_vec(), value.to_vec())),
                    _ => return Err(format!("field of {id}: {name:?} = {value:?}")),
                }
            }
            Some(out)
        };
        entries.push(Entry { id, fields });
    }
    Ok(entries)
}

#[derive(Debug, PartialEq, Eq)]
struct Claimed {
    cursor: String,
    entries: Vec<Entry>,
    /// Ids of entries that no longer exist in the stream (Redis 7+).
    deleted: Vec<String>,
}

/// `XAUTOCLAIM`: `[cursor, entries]` (6.2) or `[cursor, entries, deleted ids]` (7+).
fn parse_autoclaim_reply(value: &Value) -> Result<Claimed, String> {
    let items = as_seq(value).ok_or_else(|| format!("{value:?}"))?;
    let (cursor, entries, deleted) = match items {
        [cursor, entries] => (cursor, entries, None),
        [cursor, entries, deleted, ..] => (cursor, entries, Some(deleted)),
        _ => return Err(format!("{value:?}")),
    };
    let cursor = as_text(cursor).ok_or_else(|| format!("cursor {cursor:?}"))?;
    let entries = parse_entries(entries)?;
    let deleted = match deleted.map(unwrap_attribute) {
        None | Some(Value::Nil) => Vec::new(),
        Some(list) => as_seq(list)
            .ok_or_else(|| format!("deleted ids {list:?}"))?
            .iter()
            .map(|id| as_text(id).ok_or_else(|| format!("deleted id {id:?}")))
            .collect::<Result<_, _>>()?,
    };
    Ok(Claimed {
        cursor,
        entries,
        deleted,
    })
}

/// `XPENDING key group`: `[count, first id, last id, per-consumer counts]`.
fn parse_pending_summary(value: &Value) -> Option<i64> {
    as_int(as_seq(value)?.first()?)
}

#[derive(Debug, PartialEq, Eq)]
struct ConsumerInfo {
    name: String,
    pending: i64,
    idle_ms: i64,
}

/// `XINFO CONSUMERS`: a list of flat field/value arrays (RESP2) or maps (RESP3).
fn parse_consumers(value: &Value) -> Result<Vec<ConsumerInfo>, String> {
    let items = as_seq(value).ok_or_else(|| format!("{value:?}"))?;
    let mut consumers = Vec::with_capacity(items.len());
    for item in items {
        let pairs = as_pairs(item).ok_or_else(|| format!("consumer {item:?}"))?;
        let (mut name, mut pending, mut idle_ms) = (None, None, None);
        for (key, value) in pairs {
            match as_bytes(key) {
                Some(b"name") => name = as_text(value),
                Some(b"pending") => pending = as_int(value),
                Some(b"idle") => idle_ms = as_int(value),
                _ => {}
            }
        }
        match (name, pending, idle_ms) {
            (Some(name), Some(pending), Some(idle_ms)) => consumers.push(ConsumerInfo {
                name,
                pending,
                idle_ms,
            }),
            _ => return Err(format!("consumer {item:?}")),
        }
    }
    Ok(consumers)
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use redis::aio::MultiplexedConnection;

    use crate::test_redis::{TestRedis, open};

    const KEY: &str = "cg:invalidate";
    const GROUP: &str = "cacheguard";
    const TEST_LIMIT: Duration = Duration::from_secs(9);

    // -----------------------------------------------------------------------------------
    // Helpers.

    type Log = Arc<Mutex<Vec<Target>>>;

    fn settings(consumer: &str) -> StreamSettings {
        StreamSettings {
            key: KEY.to_owned(),
            group: GROUP.to_owned(),
            consumer: consumer.to_owned(),
            batch: 100,
            block: Duration::from_millis(200),
            claim_idle: Duration::from_secs(30),
            command_timeout: Duration::from_secs(2),
        }
    }

    /// An `apply` that records what it was given and succeeds.
    fn recorder(
        log: Log,
    ) -> impl Fn(Vec<Target>) -> std::future::Ready<bool> + Send + Sync + 'static {
        move |targets| {
            log.lock().unwrap().extend(targets);
            std::future::ready(true)
        }
    }

    fn path(i: usize) -> Target {
        Target::Path(format!("/api/items/{i}"))
    }

    async fn xadd_paths(conn: &mut MultiplexedConnection, range: std::ops::Range<usize>) {
        let mut pipe = redis::pipe();
        for i in range {
            pipe.cmd("XADD")
                .arg(KEY)
                .arg("*")
                .arg("path")
                .arg(format!("/api/items/{i}"));
        }
        let _: Vec<String> = pipe.query_async(conn).await.unwrap();
    }

    async fn xadd(conn: &mut MultiplexedConnection, fields: &[(&[u8], &[u8])]) -> String {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(KEY).arg("*");
        for (name, value) in fields {
            cmd.arg(*name).arg(*value);
        }
        cmd.query_async(conn).await.unwrap()
    }

    async fn pending(conn: &mut MultiplexedConnection) -> i64 {
        pending_count(conn, &settings("test")).await.unwrap()
    }

    fn applied(metrics: &StreamMetrics) -> u64 {
        metrics.entries.with_label_values(&["applied"]).get()
    }

    fn malformed(metrics: &StreamMetrics) -> u64 {
        metrics.entries.with_label_values(&["malformed"]).get()
    }

    fn counts(log: &Log) -> HashMap<Target, usize> {
        let mut counts = HashMap::new();
        for target in log.lock().unwrap().iter() {
            *counts.entry(target.clone()).or_default() += 1;
        }
        counts
    }

    /// Polls `check` every 20 ms until it holds; panics after `limit`.
    async fn eventually(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
        let deadline = Instant::now() + limit;
        while !check().await {
            assert!(Instant::now() < deadline, "timed out waiting for: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn spawn_consumer<F, Fut>(
        redis: &TestRedis,
        settings: StreamSettings,
        apply: F,
        metrics: &StreamMetrics,
    ) -> (CancellationToken, tokio::task::JoinHandle<()>)
    where
        F: Fn(Vec<Target>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = bool> + Send + 'static,
    {
        let stop = CancellationToken::new();
        let task = tokio::spawn(run(
            Backend::standalone(redis.client()),
            settings,
            apply,
            metrics.clone(),
            stop.clone(),
        ));
        (stop, task)
    }

    async fn stop_consumer(stop: CancellationToken, task: tokio::task::JoinHandle<()>) {
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .unwrap()
            .unwrap();
    }

    // -----------------------------------------------------------------------------------
    // Against a real Redis.

    #[tokio::test]
    async fn thousand_entries_are_applied_once_and_acked() {
        tokio::time::timeout(TEST_LIMIT, async {
            let redis = TestRedis::start().await;
            let mut conn = redis.conn().await;
            // Written before the group exists: the group starts at 0, so none is lost.
            xadd_paths(&mut conn, 0..1000).await;
            let log = Log::default();
            let metrics = crate::metrics::Metrics::unregistered().stream;
            let (stop, task) =
                spawn_consumer(&redis, settings("a"), recorder(log.clone()), &metrics);

            eventually("1000 applied", Duration::from_secs(8), async || {
                applied(&metrics) == 1000
            })
            .await;
            assert_eq!(pending(&mut conn).await, 0);
            stop_consumer(stop, task).await;

            let counts = counts(&log);
            assert_eq!(counts.len(), 1000);
            assert!(
                counts.values().all(|n| *n == 1),
                "an entry was applied twice"
            );
            assert!((0..1000).all(|i| counts.contains_key(&path(i))));
            assert_eq!(malformed(&metrics), 0);
            assert_eq!(metrics.errors.get(), 0);
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn two_consumers_share_the_entries_without_overlap() {
        tokio::time::timeout(TEST_LIMIT, async {
            let redis = TestRedis::start().await;
            let mut conn = redis.conn().await;
            let (log_a, log_b) = (Log::default(), Log::default());
            let metrics = crate::metrics::Metrics::unregistered().stream;
            // A slow-ish apply, so both consumers are busy and both get entries.
            let slow = |log: Log| {
                move |targets: Vec<Target>| {
                    let log = log.clone();
                    async move {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        log.lock().unwrap().extend(targets);
                        true
                    }
                }
            };
            let (stop_a, task_a) =
                spawn_consumer(&redis, settings("a"), slow(log_a.clone()), &metrics);
            let (stop_b, task_b) =
                spawn_consumer(&redis, settings("b"), slow(log_b.clone()), &metrics);
            // Both consumers are registered (blocked on their first read) before entries come.
            eventually(
                "both consumers joined",
                Duration::from_secs(3),
                async || {
                    let mut cmd = redis::cmd("XINFO");
                    cmd.arg("CONSUMERS").arg(KEY).arg(GROUP);
                    match cmd.query_async::<Value>(&mut conn).await {
                        Ok(reply) => parse_consumers(&reply)
                            .map(|c| c.len() == 2)
                            .unwrap_or(false),
                        Err(_) => false,
                    }
                },
            )
            .await;
            for chunk in 0..10 {
                xadd_paths(&mut conn, chunk * 100..(chunk + 1) * 100).await;
            }

            eventually("1000 applied", Duration::from_secs(8), async || {
                applied(&metrics) == 1000
            })
            .await;
            assert_eq!(pending(&mut conn).await, 0);
            stop_consumer(stop_a, task_a).await;
            stop_consumer(stop_b, task_b).await;

            let (a, b) = (counts(&log_a), counts(&log_b));
            assert!(
                !a.is_empty() && !b.is_empty(),
                "one consumer got everything: {} / {}",
                a.len(),
                b.len()
            );
            assert!(
                a.keys().all(|t| !b.contains_key(t)),
                "an entry was applied by both"
            );
            assert_eq!(a.len() + b.len(), 1000);
            assert!(a.values().chain(b.values()).all(|n| *n == 1));
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn entries_of_a_stuck_consumer_are_claimed() {
        tokio::time::timeout(TEST_LIMIT, async {
            let redis = TestRedis::start().await;
            let mut conn = redis.conn().await;
            xadd_paths(&mut conn, 0..250).await;

            // A reads its first batch of 100 and never finishes applying it.
            let entered = Arc::new(tokio::sync::Notify::new());
            let hang = {
                let entered = entered.clone();
                move |_targets: Vec<Target>| {
                    entered.notify_one();
                    std::future::pending::<bool>()
                }
            };
            let metrics_a = crate::metrics::Metrics::unregistered().stream;
            let (stop_a, task_a) = spawn_consumer(&redis, settings("a"), hang, &metrics_a);
            entered.notified().await;
            stop_consumer(stop_a, task_a).await;
            assert_eq!(pending(&mut conn).await, 100);

            let log = Log::default();
            let metrics = crate::metrics::Metrics::unregistered().stream;
            let b = StreamSettings {
                claim_idle: Duration::from_millis(500),
                ..settings("b")
            };
            let (stop_b, task_b) = spawn_consumer(&redis, b, recorder(log.clone()), &metrics);
            eventually("250 applied by B", Duration::from_secs(6), async || {
                applied(&metrics) == 250
            })
            .await;
            assert_eq!(pending(&mut conn).await, 0);
            stop_consumer(stop_b, task_b).await;

            assert_eq!(metrics.claimed.get(), 100);
            let counts = counts(&log);
            assert_eq!(counts.len(), 250);
            assert!(counts.values().all(|n| *n == 1));
            assert_eq!(applied(&metrics_a), 0);
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn nothing_is_acked_while_apply_fails() {
        tokio::time::timeout(TEST_LIMIT, async {
            let redis = TestRedis::start().await;
            let mut conn = redis.conn().await;
            xadd_paths(&mut conn, 0..200).await;

            let fail = Arc::new(AtomicBool::new(true));
            let failed_calls = Arc::new(AtomicUsize::new(0));
            let log = Log::default();
            let apply = {
                let (fail, failed_calls, log) = (fail.clone(), failed_calls.clone(), log.clone());
                move |targets: Vec<Target>| {
                    if fail.load(Ordering::SeqCst) {
                        failed_calls.fetch_add(1, Ordering::SeqCst);
                        return std::future::ready(false);
                    }
                    log.lock().unwrap().extend(targets);
                    std::future::ready(true)
                }
            };
            let metrics = crate::metrics::Metrics::unregistered().stream;
            let (stop, task) = spawn_consumer(&redis, settings("a"), apply, &metrics);

            eventually("three failed applies", Duration::from_secs(4), async || {
                failed_calls.load(Ordering::SeqCst) >= 3
            })
            .await;
            // The first batch was delivered and retried from the own pending list; none of it
            // was acked, and the rest was not even read.
            assert_eq!(pending(&mut conn).await, 100);
            assert_eq!(applied(&metrics), 0);
            assert!(log.lock().unwrap().is_empty());

            fail.store(false, Ordering::SeqCst);
            eventually("200 applied", Duration::from_secs(6), async || {
                applied(&metrics) == 200
            })
            .await;
            assert_eq!(pending(&mut conn).await, 0);
            stop_consumer(stop, task).await;

            let counts = counts(&log);
            assert_eq!(counts.len(), 200);
            assert!(counts.values().all(|n| *n == 1));
            assert_eq!(metrics.errors.get(), 0);
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn malformed_entries_are_acked_and_counted() {
        tokio::time::timeout(TEST_LIMIT, async {
            let redis = TestRedis::start().await;
            let mut conn = redis.conn().await;
            let long_path = format!("/{}", "x".repeat(MAX_PATH_BYTES));
            xadd(&mut conn, &[(b"foo", b"bar")]).await;
            xadd(&mut conn, &[(b"tag", b"")]).await;
            xadd(&mut conn, &[(b"path", b"api/items/1")]).await;
            xadd(&mut conn, &[(b"tag", b"\xff\xfe")]).await;
            xadd(&mut conn, &[(b"path", long_path.as_bytes())]).await;
            // Mixed: applied for its valid field, the unknown one is ignored.
            xadd(&mut conn, &[(b"PATH", b"/ok"), (b"junk", b"x")]).await;
            // Several targets in one entry, names in any case.
            xadd(
                &mut conn,
                &[(b"Tag", b"t1"), (b"tag", b"t2"), (b"pAtH", b"/two")],
            )
            .await;

            let log = Log::default();
            let metrics = crate::metrics::Metrics::unregistered().stream;
            let (stop, task) =
                spawn_consumer(&redis, settings("a"), recorder(log.clone()), &metrics);
            eventually("7 handled", Duration::from_secs(5), async || {
                applied(&metrics) + malformed(&metrics) == 7
            })
            .await;
            assert_eq!(pending(&mut conn).await, 0);
            stop_consumer(stop, task).await;

            assert_eq!(malformed(&metrics), 5);
            assert_eq!(applied(&metrics), 2);
            let mut got = log.lock().unwrap().clone();
            got.sort_by_key(|t| format!("{t:?}"));
            assert_eq!(
                got,
                vec![
                    Target::Path("/ok".into()),
                    Target::Path("/two".into()),
                    Target::Tag("t1".into()),
                    Target::Tag("t2".into()),
                ]
            );
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn group_is_recreated_after_redis_restarts_empty() {
        tokio::time::timeout(TEST_LIMIT, async {
            let mut redis = TestRedis::start().await;
            let mut conn = redis.conn().await;
            let log = Log::default();
            let metrics = crate::metrics::Metrics::unregistered().stream;
            let (stop, task) =
                spawn_consumer(&redis, settings("a"), recorder(log.clone()), &metrics);
            xadd_paths(&mut conn, 0..10).await;
            eventually("first 10 applied", Duration::from_secs(3), async || {
                applied(&metrics) == 10
            })
            .await;

            redis.restart().await;
            let mut conn = redis.conn().await;
            xadd_paths(&mut conn, 100..110).await;
            eventually("10 more applied", Duration::from_secs(5), async || {
                applied(&metrics) == 20
            })
            .await;
            assert_eq!(pending(&mut conn).await, 0);
            assert!(metrics.errors.get() >= 1);
            stop_consumer(stop, task).await;

            let counts = counts(&log);
            assert!(
                (0..10)
                    .chain(100..110)
                    .all(|i| counts.get(&path(i)) == Some(&1))
            );
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn group_is_recreated_after_the_stream_is_deleted() {
        tokio::time::timeout(TEST_LIMIT, async {
            let redis = TestRedis::start().await;
            let mut conn = redis.conn().await;
            let log = Log::default();
            let metrics = crate::metrics::Metrics::unregistered().stream;
            let (stop, task) =
                spawn_consumer(&redis, settings("a"), recorder(log.clone()), &metrics);
            xadd_paths(&mut conn, 0..10).await;
            eventually("first 10 applied", Duration::from_secs(3), async || {
                applied(&metrics) == 10
            })
            .await;

            // Same connection, no restart: the next read answers NOGROUP.
            let _: i64 = redis::cmd("DEL")
                .arg(KEY)
                .query_async(&mut conn)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            xadd_paths(&mut conn, 100..110).await;
            eventually("10 more applied", Duration::from_secs(5), async || {
                applied(&metrics) == 20
            })
            .await;
            assert_eq!(pending(&mut conn).await, 0);
            stop_consumer(stop, task).await;
            assert_eq!(counts(&log).len(), 20);
            assert!(metrics.errors.get() >= 1);

            // Outside a blocked read, a missing group answers NOGROUP: handled the same way.
            let mut cmd = redis::cmd("XREADGROUP");
            cmd.arg("GROUP")
                .arg("nosuch")
                .arg("x")
                .arg("STREAMS")
                .arg(KEY)
                .arg(">");
            let failure = query(&mut conn, &cmd, "XREADGROUP", Duration::from_secs(1))
                .await
                .unwrap_err();
            assert_eq!(failure.code(), Some("NOGROUP"));
            assert!(failure.is_group_gone());
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn resp3_replies_are_understood() {
        tokio::time::timeout(TEST_LIMIT, async {
            let redis = TestRedis::start().await;
            let url = format!("{}/?protocol=resp3", redis.url());
            let mut conn = open(&url).await;
            xadd_paths(&mut conn, 0..30).await;
            xadd(&mut conn, &[(b"nope", b"x")]).await;
            create_group(&mut conn, &settings("ghost")).await.unwrap();
            // A consumer that read 5 entries and went away.
            let _: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(GROUP)
                .arg("ghost")
                .arg("COUNT")
                .arg(5)
                .arg("STREAMS")
                .arg(KEY)
                .arg(">")
                .query_async(&mut conn)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(600)).await;

            // The first apply fails, so the own pending list is read too.
            let calls = Arc::new(AtomicUsize::new(0));
            let log = Log::default();
            let apply = {
                let (calls, log) = (calls.clone(), log.clone());
                move |targets: Vec<Target>| {
                    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        return std::future::ready(false);
                    }
                    log.lock().unwrap().extend(targets);
                    std::future::ready(true)
                }
            };
            let metrics = crate::metrics::Metrics::unregistered().stream;
            let s = StreamSettings {
                claim_idle: Duration::from_millis(500),
                batch: 7,
                ..settings("r3")
            };
            let stop = CancellationToken::new();
            let client = redis::Client::open(url.as_str()).unwrap();
            let task = tokio::spawn(run(
                Backend::standalone(client),
                s,
                apply,
                metrics.clone(),
                stop.clone(),
            ));
            eventually("31 handled", Duration::from_secs(6), async || {
                applied(&metrics) + malformed(&metrics) == 31
            })
            .await;
            assert_eq!(pending(&mut conn).await, 0);
            stop_consumer(stop, task).await;
            assert_eq!(metrics.claimed.get(), 5);
            assert_eq!(malformed(&metrics), 1);
            let counts = counts(&log);
            assert_eq!(counts.len(), 30);
            assert!(counts.values().all(|n| *n == 1));
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn idle_consumers_without_pending_are_removed() {
        tokio::time::timeout(TEST_LIMIT, async {
            let redis = TestRedis::start().await;
            for (round, suffix) in ["", "/?protocol=resp3"].into_iter().enumerate() {
                let mut conn = open(&format!("{}{suffix}", redis.url())).await;
                let _: i64 = redis::cmd("DEL")
                    .arg(KEY)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                create_group(&mut conn, &settings("me")).await.unwrap();
                xadd_paths(&mut conn, 0..3).await;
                for name in ["me", "gone", "busy"] {
                    let count = if name == "busy" { 1 } else { 0 };
                    let mut cmd = redis::cmd("XREADGROUP");
                    cmd.arg("GROUP").arg(GROUP).arg(name);
                    if count > 0 {
                        cmd.arg("COUNT").arg(count);
                    }
                    // `gone` and `me` read nothing new: registered with nothing pending.
                    let id = if count > 0 { ">" } else { "0" };
                    let _: Value = cmd
                        .arg("STREAMS")
                        .arg(KEY)
                        .arg(id)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;

                // An hour: nobody is that idle.
                let removed = remove_idle_consumers(&mut conn, &settings("me"), CONSUMER_MAX_IDLE)
                    .await
                    .unwrap();
                assert!(removed.is_empty(), "round {round}: {removed:?}");
                // Anything idle at all: only `gone` (not us, not one with pending entries).
                let removed = remove_idle_consumers(&mut conn, &settings("me"), Duration::ZERO)
                    .await
                    .unwrap();
                assert_eq!(removed, vec!["gone".to_owned()], "round {round}");
                let mut cmd = redis::cmd("XINFO");
                cmd.arg("CONSUMERS").arg(KEY).arg(GROUP);
                let reply: Value = cmd.query_async(&mut conn).await.unwrap();
                let mut names: Vec<_> = parse_consumers(&reply)
                    .unwrap()
                    .into_iter()
                    .map(|c| c.name)
                    .collect();
                names.sort();
                assert_eq!(names, vec!["busy".to_owned(), "me".to_owned()]);
                assert_eq!(pending(&mut conn).await, 1);
            }
        })
        .await
        .expect("test timed out");
    }

    // -----------------------------------------------------------------------------------
    // Parsing, without Redis.

    fn bulk(s: &[u8]) -> Value {
        Value::BulkString(s.to_vec())
    }

    fn fields(pairs: &[(&[u8], &[u8])]) -> Vec<(Vec<u8>, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_vec(), v.to_vec()))
            .collect()
    }

    #[test]
    fn fields_are_validated() {
        let p = parse_fields(&fields(&[
            (b"PATH", b"/a"),
            (b"tag", b"x"),
            (b"other", b"1"),
        ]));
        assert_eq!(
            p.targets,
            vec![Target::Path("/a".into()), Target::Tag("x".into())]
        );
        assert_eq!(p.problems.len(), 1);
        let tag_limit = "t".repeat(MAX_TAG_BYTES);
        let p = parse_fields(&fields(&[(b"tag", tag_limit.as_bytes())]));
        assert_eq!(p.targets.len(), 1);
        let too_long = "t".repeat(MAX_TAG_BYTES + 1);
        for bad in [
            fields(&[(b"tag", too_long.as_bytes())]),
            fields(&[(b"tag", b"")]),
            fields(&[(b"path", b"")]),
            fields(&[(b"path", b"x/")]),
            fields(&[(b"path", b"/\xc3")]),
            fields(&[(b"paths", b"/a")]),
            Vec::new(),
        ] {
            let p = parse_fields(&bad);
            assert!(p.targets.is_empty(), "{bad:?}");
            assert!(!p.problems.is_empty(), "{bad:?}");
        }
    }

    #[test]
    fn read_replies_in_both_protocols() {
        let entry = |id: &[u8], f: Value| Value::Array(vec![bulk(id), f]);
        let entries = Value::Array(vec![
            entry(b"1-0", Value::Array(vec![bulk(b"path"), bulk(b"/a")])),
            entry(b"2-0", Value::Nil),
        ]);
        let expected = vec![
            Entry {
                id: "1-0".into(),
                fields: Some(fields(&[(b"path", b"/a")])),
            },
            Entry {
                id: "2-0".into(),
                fields: None,
            },
        ];
        let resp2 = Value::Array(vec![Value::Array(vec![bulk(b"k"), entries.clone()])]);
        let resp3 = Value::Map(vec![(bulk(b"k"), entries)]);
        assert_eq!(parse_read_reply(&resp2).unwrap(), expected);
        assert_eq!(parse_read_reply(&resp3).unwrap(), expected);
        assert_eq!(parse_read_reply(&Value::Nil).unwrap(), Vec::new());
        assert!(parse_read_reply(&Value::Int(3)).is_err());
        // Fields as a map (not sent by Redis today, but accepted).
        let mapped = Value::Map(vec![(
            bulk(b"k"),
            Value::Array(vec![entry(
                b"3-0",
                Value::Map(vec![(bulk(b"tag"), bulk(b"t"))]),
            )]),
        )]);
        assert_eq!(
            parse_read_reply(&mapped).unwrap()[0].fields,
            Some(fields(&[(b"tag", b"t")]))
        );
    }

    #[test]
    fn autoclaim_replies_of_6_2_and_7() {
        let entries = Value::Array(vec![
            Value::Array(vec![
                bulk(b"1-0"),
                Value::Array(vec![bulk(b"tag"), bulk(b"t")]),
            ]),
            Value::Nil,
        ]);
        let v62 = Value::Array(vec![bulk(b"0-0"), entries.clone()]);
        let c = parse_autoclaim_reply(&v62).unwrap();
        assert_eq!(c.cursor, "0-0");
        assert_eq!(c.entries.len(), 1);
        assert!(c.deleted.is_empty());
        let v7 = Value::Array(vec![
            bulk(b"5-1"),
            entries,
            Value::Array(vec![bulk(b"3-0")]),
        ]);
        let c = parse_autoclaim_reply(&v7).unwrap();
        assert_eq!(c.cursor, "5-1");
        assert_eq!(c.deleted, vec!["3-0".to_owned()]);
        assert!(parse_autoclaim_reply(&Value::Array(vec![bulk(b"0-0")])).is_err());
    }

    #[test]
    fn pending_and_consumer_replies() {
        let summary = Value::Array(vec![Value::Int(4), bulk(b"1-0"), bulk(b"2-0"), Value::Nil]);
        assert_eq!(parse_pending_summary(&summary), Some(4));
        let empty = Value::Array(vec![Value::Int(0), Value::Nil, Value::Nil, Value::Nil]);
        assert_eq!(parse_pending_summary(&empty), Some(0));
        let resp2 = Value::Array(vec![Value::Array(vec![
            bulk(b"name"),
            bulk(b"a"),
            bulk(b"pending"),
            Value::Int(2),
            bulk(b"idle"),
            Value::Int(10),
        ])]);
        let resp3 = Value::Array(vec![Value::Map(vec![
            (Value::SimpleString("name".into()), bulk(b"a")),
            (Value::SimpleString("pending".into()), Value::Int(2)),
            (Value::SimpleString("idle".into()), Value::Int(10)),
            (Value::SimpleString("inactive".into()), Value::Int(-1)),
        ])]);
        let expected = vec![ConsumerInfo {
            name: "a".into(),
            pending: 2,
            idle_ms: 10,
        }];
        assert_eq!(parse_consumers(&resp2).unwrap(), expected);
        assert_eq!(parse_consumers(&resp3).unwrap(), expected);
    }
}
