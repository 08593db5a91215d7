//! Config hot reload: `SIGHUP`, or a change to the config file, reloads it.
//!
//! The new file is parsed and validated exactly as at start; an invalid one is refused
//! with the same error (file, line, key), logged, counted in
//! `cacheguard_config_reloads_total{result="invalid"}`, and the running config keeps
//! serving. A valid one is applied without dropping a connection:
//!
//! - routes (patterns, TTLs, query and vary policies, invalidation rules, Bloom bindings):
//!   a new route table is swapped in; requests in flight finish on the one they started
//!   with; the series of a removed route are exported by one more scrape, then removed;
//! - origin limits (`max_concurrency`, `max_rps`, `queue_timeout`): a new origin guard is
//!   swapped in (requests holding a slot of the old one finish on it, so for a moment both
//!   count) — and the upstream client, when `[upstream]` changed;
//! - `[lock]`, `[hot_keys]` thresholds and the per-key limit, the admin token and the
//!   purge limits;
//! - Bloom filter definitions (sizing, source, refresh; a changed sizing or source rebuilds
//!   the filter now);
//! - stock gate settings (everything of a `[[stock]]` but its name; the units counted, the
//!   reservations and the sold-out marks stay);
//! - Redis credentials (`redis.username`, `redis.password`, the content of
//!   `redis.password_file`): connections made from then on log in with the new ones, and
//!   the shared connection is replaced at once (see `RedisConn::rotate_credentials`). A
//!   rotation is: allow the new password in Redis, reload, then revoke the old one;
//! - the access log (`[access_log]` `format`, `sample`, `query`, `path`): its file is opened
//!   again on every reload, so `SIGHUP` after a rename rotates it (logrotate's
//!   `postrotate`). A file that cannot be opened leaves the access log as it was, with an
//!   error in the log; the rest of the reload is applied.
//!
//! What cannot change while running — listeners, `[server]` limits and threads, the rest of
//! `[redis]`,
//! `[journal]`, `[invalidation_stream]`, `access_log.buffer`, adding or removing a
//! `[[bloom]]` filter or a `[[stock]]` gate — is kept as it was; the reload is applied for
//! everything else and a warning names what needs a restart (`result="partial"`). Adding or
//! removing a filter or a gate refuses the whole reload (`result="refused"`): routes may
//! name it.
//!
//! The file is polled (content hash, every 500 ms) rather than watched with inotify: editors
//! and Kubernetes ConfigMaps replace the file through renames and symlink swaps, which
//! inotify watches lose; a hash compare is cheap and sees every one of them. The hash
//! covers the `redis.password_file` in use too, so a rotated mounted secret is picked up
//! without touching the config file.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{Config, RedisConfig, Vars};
use crate::coord::redis::RedisConn;
use crate::metrics::Metrics;
use crate::protect::bloom::Filters;
use crate::protect::hotkeys::HotKeys;
use crate::protect::stock::Gates;
use crate::proxy::Proxy;
use crate::proxy::origin_guard::{GuardMetrics, Limits, OriginGuard};
use crate::proxy::purge_limits::PurgeLimits;
use crate::proxy::route::RouteTable;
use crate::proxy::upstream::Upstream;

/// How often the config file is checked for changes.
pub(crate) const POLL_EVERY: Duration = Duration::from_millis(500);

/// The parts of a running cacheguard a reload changes, and the config it runs.
#[derive(Debug)]
pub(crate) struct Live {
    pub(crate) proxy: Arc<Proxy>,
    pub(crate) hot: Arc<HotKeys>,
    pub(crate) filters: Arc<Filters>,
    /// The stock gates: their settings change on a reload, not their set.
    pub(crate) gates: Arc<Gates>,
    pub(crate) token: Arc<ArcSwap<Option<String>>>,
    /// The shared Redis, in shared mode: its credentials change on a reload.
    pub(crate) redis: Option<RedisConn>,
    pub(crate) purge_limits: Arc<PurgeLimits>,
    pub(crate) metrics: Metrics,
    /// The config in effect; the lock also serializes reloads.
    pub(crate) current: tokio::sync::Mutex<Config>,
    pub(crate) generation: AtomicU64,
}

/// What a reload did.
#[derive(Debug, PartialEq, Eq)]
pub enum Reloaded {
    /// Everything in the new file is in effect.
    Applied,
    /// In effect except these keys, which need a restart.
    Partial(Vec<&'static str>),
}

impl Live {
    /// Records the config running at start (generation 1).
    pub(crate) fn started(&self, text_hash: u64) {
        self.generation.store(1, Ordering::Release);
        self.metrics.config_loaded(1, text_hash);
    }

    /// Applies `new` (already validated).
    ///
    /// # Errors
    /// A reload that cannot be applied at all (a `[[bloom]]` filter added or removed, a
    /// route table that cannot be built); nothing was changed.
    pub(crate) async fn apply(&self, new: Config, text_hash: u64) -> Result<Reloaded, String> {
        let mut current = self.current.lock().await;
        if !self.gates.same_gates(&new.stock) {
            self.metrics.config_reload("refused");
            return Err(
                "adding or removing [[stock]] gates needs a restart; nothing was reloaded"
                    .to_owned(),
            );
        }
        if let Err(names) = self.filters.reconfigure(&new.bloom) {
            self.metrics.config_reload("refused");
            return Err(format!(
                "adding or removing [[bloom]] filters needs a restart ({}); nothing was reloaded",
                names.join(", ")
            ));
        }
        let routes = RouteTable::build(&new.routes, &self.metrics, &self.filters, &self.gates)
            .map_err(|e| {
                self.metrics.config_reload("refused");
                format!("routes: {e:#}; nothing was reloaded")
            })?;
        self.gates.reconfigure(&new.stock, &new.upstream);
        if let (Some(redis), Some(old), Some(new)) = (&self.redis, &current.redis, &new.redis)
            && credentials(old) != credentials(new)
            && !redis_moved(old, new)
        {
            redis.rotate_credentials(new).await.map_err(|e| {
                self.metrics.config_reload("refused");
                format!("redis credentials: {e:#}; nothing was reloaded")
            })?;
        }
        let proxy = &self.proxy;
        let upstream_changed = format!("{:?}", current.upstream) != format!("{:?}", new.upstream);
        if upstream_changed {
            // The worker threads live as long as the process (`[server]` needs a restart).
            let workers = proxy.origin.upstream.load().workers();
            let upstream = Upstream::new(&new.upstream, workers, self.metrics.origin_off_worker())
                .map_err(|e| {
                    self.metrics.config_reload("refused");
                    format!("upstream: {e:#}; nothing was reloaded")
                })?;
            proxy.origin.upstream.store(Arc::new(upstream));
        }
        let up = &new.upstream;
        let limits = Limits::of(up);
        if !proxy.origin.guard.load().same_limits(&limits) {
            proxy.origin.guard.store(Arc::new(OriginGuard::new(
                limits,
                GuardMetrics::of(&self.metrics),
            )));
        }
        self.metrics.origin_caps(up);
        proxy.routes.store(Arc::new(routes));
        self.metrics.retire_routes(
            current
                .routes
                .iter()
                .map(|r| r.name.as_str())
                .filter(|name| new.routes.iter().all(|r| r.name != *name)),
        );
        proxy.read.filler.lock.store(Arc::new(new.lock.clone()));
        self.hot.reconfigure(&new.hot_keys);
        self.token.store(Arc::new(new.admin.token.clone()));
        self.purge_limits.reconfigure(&new.admin);
        let access_log_kept = match proxy.access_log.reconfigure(&new.access_log).await {
            Ok(()) => false,
            Err(error) => {
                error!(message = "Access log not reloaded; it keeps its old file and settings.", %error);
                true
            }
        };

        let restart = needs_restart(&current, &new);
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        self.metrics.config_loaded(generation, text_hash);
        // What runs now: the new config, except the parts that need a restart.
        let mut effective = new;
        keep_restart_only(&mut effective, &current);
        if access_log_kept {
            effective.access_log = current.access_log.clone();
        }
        *current = effective;
        if restart.is_empty() {
            self.metrics.config_reload("ok");
            info!(message = "Config reloaded.", generation);
            Ok(Reloaded::Applied)
        } else {
            self.metrics.config_reload("partial");
            warn!(message = "Config reloaded, except keys that need a restart.", generation, restart = ?restart);
            Ok(Reloaded::Partial(restart))
        }
    }
}

/// The sections a running instance cannot change, by name, where `new` differs.
fn needs_restart(old: &Config, new: &Config) -> Vec<&'static str> {
    let differs =
        |a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| format!("{a:?}") != format!("{b:?}");
    let mut keys = Vec::new();
    if differs(&old.server, &new.server) {
        keys.push("server");
    }
    if old.admin.listen != new.admin.listen {
        keys.push("admin.listen");
    }
    match (&old.redis, &new.redis) {
        (Some(old), Some(new)) if !redis_moved(old, new) => {}
        (None, None) => {}
        _ => keys.push("redis"),
    }
    if differs(&old.journal, &new.journal) {
        keys.push("journal");
    }
    if differs(&old.stream, &new.stream) {
        keys.push("invalidation_stream");
    }
    if differs(&old.cache.l1_max_bytes, &new.cache.l1_max_bytes) {
        keys.push("cache.l1_max_bytes");
    }
    if old.access_log.buffer != new.access_log.buffer {
        keys.push("access_log.buffer");
    }
    keys
}

/// The credentials of `redis`, the part of it a reload changes.
fn credentials(redis: &RedisConfig) -> (Option<&str>, Option<&str>) {
    (redis.username.as_deref(), redis.password.as_deref())
}

/// Whether `new` differs from `old` in more than its credentials (which need a restart).
fn redis_moved(old: &RedisConfig, new: &RedisConfig) -> bool {
    let mut same_credentials = new.clone();
    same_credentials.username.clone_from(&old.username);
    same_credentials.password.clone_from(&old.password);
    same_credentials
        .password_file
        .clone_from(&old.password_file);
    old.url != new.url || format!("{old:?}") != format!("{same_credentials:?}")
}

fn keep_restart_only(new: &mut Config, old: &Config) {
    new.server = old.server.clone();
    new.admin.listen = old.admin.listen;
    let rotated = match (&old.redis, &new.redis) {
        (Some(old), Some(new)) if !redis_moved(old, new) => Some(new.clone()),
        _ => None,
    };
    new.redis = rotated.or_else(|| old.redis.clone());
    new.journal = old.journal.clone();
    new.stream = old.stream.clone();
    new.cache.l1_max_bytes = old.cache.l1_max_bytes;
    new.access_log.buffer = old.access_log.buffer;
}

/// Where the config comes from, for reloads.
pub(crate) struct Source {
    pub(crate) path: PathBuf,
    pub(crate) vars: Arc<dyn Vars + Send + Sync>,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Source")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The hash of the file text: tells a changed file from a touched one, and names the
/// config in `cacheguard_config_info`.
pub(crate) fn text_hash(text: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(text.as_bytes())
}

/// Reads, validates and applies the config file once.
///
/// # Errors
/// The file cannot be read, is invalid (the error names file, line and key), or cannot
/// be applied; the running config is unchanged.
pub(crate) async fn reload_file(live: &Live, source: &Source) -> Result<Reloaded, String> {
    let text = match tokio::fs::read_to_string(&source.path).await {
        Ok(text) => text,
        Err(e) => {
            live.metrics.config_reload("invalid");
            let message = format!("{}: cannot read: {e}", source.path.display());
            error!(message = "Config reload refused; the running config keeps serving.", error = %message);
            return Err(message);
        }
    };
    let hash = text_hash(&text);
    let label = source.path.display().to_string();
    let config = match Config::from_toml(&text, &label, source.vars.as_ref()) {
        Ok(config) => {
            for warning in config.warnings() {
                warn!(message = "Risky configuration.", problem = %warning);
            }
            config
        }
        Err(e) => {
            live.metrics.config_reload("invalid");
            let message = e.to_string();
            error!(message = "Config reload refused; the running config keeps serving.", error = %message);
            return Err(message);
        }
    };
    let applied = live.apply(config, hash).await;
    if let Err(message) = &applied {
        error!(message = "Config reload refused; the running config keeps serving.", error = %message);
    }
    applied
}

/// Polls the config file (and the password file in use) and reloads when either content
/// changes, until `stop`.
pub(crate) async fn watch(live: Arc<Live>, source: Arc<Source>, stop: CancellationToken) {
    let mut last = fingerprint(&live, &source).await;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(POLL_EVERY) => {}
        }
        let Some(now) = fingerprint(&live, &source).await else {
            // Mid-replace, or removed: the next poll sees what is there then.
            continue;
        };
        if last == Some(now) {
            continue;
        }
        last = Some(now);
        info!(message = "Config file changed; reloading.", path = %source.path.display());
        let _ = reload_file(&live, &source).await;
    }
}

/// What the watcher compares: the config text and the content of the running config's
/// `redis.password_file`. `None` while the config file cannot be read.
async fn fingerprint(live: &Live, source: &Source) -> Option<u64> {
    let text = tokio::fs::read(&source.path).await.ok()?;
    let secret_file = live
        .current
        .lock()
        .await
        .redis
        .as_ref()
        .and_then(|redis| redis.password_file.clone());
    let secret = match secret_file {
        Some(path) => tokio::fs::read(&path).await.unwrap_or_default(),
        None => Vec::new(),
    };
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&text);
    hasher.update(&secret);
    Some(hasher.digest())
}
