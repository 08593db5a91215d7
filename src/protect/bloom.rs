//! Bloom filters of existing ids: penetration protection.
//!
//! A read route with `bloom = { filter, param }` checks the id in its path against the
//! filter before any cache tier; a definite miss is answered at once, without Redis or the
//! origin. The one rule everything here serves: **never reject a real id**.
//!
//! - A filter that has not loaded yet, or whose loads all failed, rejects nothing
//!   ([`Verdict::NotReady`]); negative caching still protects the origin meanwhile.
//! - Loads run in the background and swap the new filter in under a write lock held for a
//!   pointer move; checks take the read lock and never wait on a load. Ids created while a
//!   load runs are kept aside and added to the new filter before the swap.
//! - Created ids (write routes with `bloom_add`) are added locally, logged in Redis and
//!   broadcast as `bloom_add` events before the client gets the create's answer.
//! - Any gap in what this instance heard (a subscription loss, a snapshot or a source
//!   export older than now) is closed by replaying the Redis log from before the gap.
//!
//! Layout: `source.rs` streams a source into a filter; `shared.rs` is the Redis side
//! (snapshot, log of created ids).

mod shared;
pub(crate) mod source;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use bloomfilter::Bloom;
use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde::Serialize;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use self::shared::{REPLAY_MARGIN_MS, Shared};
use crate::clock::now_ms;
use crate::config::BloomConfig;
use crate::coord::events::{BloomAddEvent, BusListener, Delivery};
use crate::coord::{Keyspace, RedisConn};
use crate::metrics::{AddVia, FilterMetrics, Metrics};

/// Filters are sized for this fraction of the configured false-positive rate. Sized for
/// exactly `fp_rate`, the whole number of hash functions makes the real rate land a hair
/// above it (0.01004 for 0.01), so "at most fp_rate of absent ids reach the origin" would
/// hold only half the time; this margin costs about 2% more bits.
const SIZING_MARGIN: f64 = 0.9;
/// Retry delays after a failed source load: doubling from the first, capped by the last
/// (and by `refresh`), so a source that is down at start is picked up soon after it returns.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);
/// Created ids that could not be logged in Redis wait here (bounded) to be retried.
const UNSHARED_MAX: usize = 100_000;
const UNSHARED_RETRY: Duration = Duration::from_secs(1);
/// A subscription loss is noticed within moments, but instance clocks differ a little:
/// replay from this long before the loss.
const GAP_MARGIN_MS: u64 = 5_000;

/// The answer of a check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The id may exist: go on.
    Pass,
    /// The id definitely does not exist.
    Reject,
    /// The filter is not loaded: it rejects nothing.
    NotReady,
}

/// Where the filter in service came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum LoadedFrom {
    Source,
    Snapshot,
}

/// The last finished source load, for `/admin/bloom`.
#[derive(Clone, Copy, Debug, Serialize)]
pub(crate) struct LoadReport {
    pub(crate) at_unix_ms: u64,
    pub(crate) duration_ms: u64,
    pub(crate) lines: u64,
    pub(crate) skipped: u64,
}

/// One `[[bloom]]` filter.
#[derive(Debug)]
pub(crate) struct Filter {
    /// The filter's name: the key a reload matches filters by, so it never changes.
    name: String,
    /// The current definition; a reload swaps it ([`Filters::reconfigure`]). Read it through
    /// [`Filter::config`], once per use: a load sizes, reads and snapshots with one version.
    config: ArcSwap<BloomConfig>,
    pub(crate) metrics: FilterMetrics,
    // A std RwLock: checks hold it for one filter probe, a swap for a pointer move, an add
    // for one insert; never across an await.
    state: RwLock<State>,
    /// Wakes the load loop for an admin rebuild.
    rebuild: Notify,
    /// Wakes a waiting load loop to re-read its `refresh` after a reload.
    reconfigured: Notify,
    loading: AtomicBool,
    created: Instant,
    /// The earliest time from which this instance may have missed created ids (unix ms);
    /// cleared by a successful replay.
    missed_since: Mutex<Option<u64>>,
}

struct State {
    bloom: Option<Bloom<[u8]>>,
    items: u64,
    loaded_from: Option<LoadedFrom>,
    loaded_at: Option<Instant>,
    last_load: Option<LoadReport>,
    last_error: Option<String>,
    /// While a source load runs: ids added meanwhile, for the new filter.
    pending: Option<Vec<Vec<u8>>>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("ready", &self.bloom.is_some())
            .field("items", &self.items)
            .field("loaded_from", &self.loaded_from)
            .finish_non_exhaustive()
    }
}

/// `/admin/bloom`'s view of one filter.
#[derive(Debug, Serialize)]
pub(crate) struct FilterStatus {
    pub(crate) name: String,
    pub(crate) ready: bool,
    pub(crate) loading: bool,
    pub(crate) loaded_from: Option<LoadedFrom>,
    pub(crate) source: String,
    pub(crate) expected_items: usize,
    pub(crate) configured_fp_rate: f64,
    pub(crate) items: u64,
    pub(crate) bits: u64,
    pub(crate) bytes: u64,
    pub(crate) hash_functions: u32,
    pub(crate) estimated_fp_rate: f64,
    pub(crate) last_load: Option<LoadReport>,
    pub(crate) seconds_since_load: Option<f64>,
    pub(crate) last_error: Option<String>,
}

impl Filter {
    fn new(config: BloomConfig, metrics: FilterMetrics) -> Self {
        metrics.ready.set(0);
        Filter {
            name: config.name.clone(),
            config: ArcSwap::from_pointee(config),
            metrics,
            state: RwLock::new(State {
                bloom: None,
                items: 0,
                loaded_from: None,
                loaded_at: None,
                last_load: None,
                last_error: None,
                pending: None,
            }),
            rebuild: Notify::new(),
            reconfigured: Notify::new(),
            loading: AtomicBool::new(false),
            created: Instant::now(),
            missed_since: Mutex::new(None),
        }
    }

    /// The filter's name (never changed by a reload).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The current definition. A reload may swap it at any time: take it once per use.
    pub(crate) fn config(&self) -> Arc<BloomConfig> {
        self.config.load_full()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn check(&self, id: &[u8]) -> Verdict {
        match &self.read().bloom {
            None => Verdict::NotReady,
            Some(bloom) if bloom.check(id) => Verdict::Pass,
            Some(_) => Verdict::Reject,
        }
    }

    pub(crate) fn is_ready(&self) -> bool {
        self.read().bloom.is_some()
    }

    /// Adds one id. With no filter loaded yet there is nothing to add to: the coming load
    /// reads the source and replays the log, which both include it.
    pub(crate) fn add(&self, id: &[u8], via: AddVia) {
        let mut state = self.write();
        if let Some(pending) = &mut state.pending {
            pending.push(id.to_vec());
        }
        let fresh = state.bloom.as_mut().map(|bloom| !bloom.check_and_set(id));
        if fresh == Some(true) {
            state.items += 1;
        }
        self.publish_gauges(&state);
        drop(state);
        self.metrics.added(via, 1);
    }

    fn add_many(&self, ids: &[Vec<u8>], via: AddVia) {
        if ids.is_empty() {
            return;
        }
        let mut state = self.write();
        for id in ids {
            if let Some(pending) = &mut state.pending {
                pending.push(id.clone());
            }
            if let Some(bloom) = state.bloom.as_mut()
                && !bloom.check_and_set(id)
            {
                state.items += 1;
            }
        }
        self.publish_gauges(&state);
        drop(state);
        self.metrics.added(via, ids.len() as u64);
    }

    /// Puts a newly built filter in service, with the ids created while it was built. A
    /// source load's report is stored in the same step, so a status never shows the new
    /// filter without it.
    fn install(
        &self,
        mut bloom: Bloom<[u8]>,
        mut items: u64,
        from: LoadedFrom,
        report: Option<LoadReport>,
    ) {
        let mut state = self.write();
        for id in state.pending.take().unwrap_or_default() {
            if !bloom.check_and_set(&id) {
                items += 1;
            }
        }
        state.bloom = Some(bloom);
        state.items = items;
        state.loaded_from = Some(from);
        state.loaded_at = Some(Instant::now());
        state.last_error = None;
        if report.is_some() {
            state.last_load = report;
        }
        self.publish_gauges(&state);
        self.metrics.ready.set(1);
    }

    fn publish_gauges(&self, state: &State) {
        let Some(bloom) = &state.bloom else {
            return;
        };
        self.metrics
            .items
            .set(i64::try_from(state.items).unwrap_or(i64::MAX));
        self.metrics
            .bits
            .set(i64::try_from(bloom.len()).unwrap_or(i64::MAX));
        self.metrics
            .bytes
            .set(i64::try_from(bloom.len().div_ceil(8)).unwrap_or(i64::MAX));
        self.metrics.fp_rate.set(estimated_fp_rate(
            bloom.len(),
            bloom.number_of_hash_functions(),
            state.items,
        ));
    }

    /// Refreshes the scrape-time gauge.
    pub(crate) fn refresh_age(&self) {
        let since = self.read().loaded_at.unwrap_or(self.created);
        self.metrics.since_load.set(since.elapsed().as_secs_f64());
    }

    pub(crate) fn status(&self) -> FilterStatus {
        let config = self.config();
        let state = self.read();
        let (bits, hash_functions) = state
            .bloom
            .as_ref()
            .map_or((0, 0), |b| (b.len(), b.number_of_hash_functions()));
        FilterStatus {
            name: self.name.clone(),
            ready: state.bloom.is_some(),
            loading: self.loading.load(Ordering::Relaxed),
            loaded_from: state.loaded_from,
            source: config.source.to_string(),
            expected_items: config.expected_items,
            configured_fp_rate: config.fp_rate,
            items: state.items,
            bits,
            bytes: bits.div_ceil(8),
            hash_functions,
            estimated_fp_rate: estimated_fp_rate(bits, hash_functions, state.items),
            last_load: state.last_load,
            seconds_since_load: state.loaded_at.map(|at| at.elapsed().as_secs_f64()),
            last_error: state.last_error.clone(),
        }
    }

    /// Asks the load loop for a rebuild now. `false` when one is already running (it is
    /// then queued behind it).
    pub(crate) fn request_rebuild(&self) -> bool {
        self.rebuild.notify_one();
        !self.loading.load(Ordering::Relaxed)
    }

    fn note_missed(&self, since_ms: u64) {
        let mut missed = self
            .missed_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *missed = Some(missed.map_or(since_ms, |m| m.min(since_ms)));
    }

    fn take_missed(&self) -> Option<u64> {
        self.missed_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// How long a load loop waits after a load before the next one; `None`: until asked.
/// A failed load is retried with a doubling backoff, never later than `refresh`.
fn next_wait(refresh: Duration, loaded: bool, failures: u32) -> Option<Duration> {
    if loaded {
        return (!refresh.is_zero()).then_some(refresh);
    }
    let backoff = RETRY_MIN
        .saturating_mul(1 << failures.saturating_sub(1).min(6))
        .min(RETRY_MAX);
    Some(if refresh.is_zero() {
        backoff
    } else {
        backoff.min(refresh)
    })
}

/// What a reload changes for one filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Change {
    None,
    /// Only what the load loop reads when it needs it (`refresh`, `load_timeout`).
    Settings,
    /// What the filter in service was built from: it is rebuilt now.
    Rebuild,
}

fn compare(old: &BloomConfig, new: &BloomConfig) -> Change {
    // Destructured so that a new field cannot be forgotten here.
    let BloomConfig {
        name: _,
        expected_items,
        fp_rate,
        refresh,
        load_timeout,
        source,
        format,
    } = new;
    if *expected_items != old.expected_items
        || fp_rate.to_bits() != old.fp_rate.to_bits()
        || *source != old.source
        || *format != old.format
    {
        Change::Rebuild
    } else if *refresh != old.refresh || *load_timeout != old.load_timeout {
        Change::Settings
    } else {
        Change::None
    }
}

/// (1 - e^(-k·n/m))^k: the false-positive rate of a filter of `m` bits and `k` hashes
/// holding `n` items.
fn estimated_fp_rate(m: u64, k: u32, n: u64) -> f64 {
    if m == 0 || n == 0 {
        return 0.0;
    }
    let k = f64::from(k);
    #[allow(clippy::cast_precision_loss)] // counts far below 2^52
    let exponent = -k * n as f64 / m as f64;
    (1.0 - exponent.exp()).powf(k)
}

/// Every filter of this instance, and their Redis side.
#[derive(Debug)]
pub(crate) struct Filters {
    by_name: HashMap<String, Arc<Filter>>,
    order: Vec<Arc<Filter>>,
    shared: Option<Shared>,
    instance: u64,
    client: Client<HttpConnector, Empty<Bytes>>,
    /// Created ids whose Redis log/broadcast failed: retried until Redis takes them.
    unshared: Mutex<Vec<(Arc<Filter>, BloomAddEvent, u64)>>,
    /// Whether the event bus is subscribed (events are being heard).
    bus_up: AtomicBool,
}

impl Filters {
    /// `redis` is `None` in embedded mode (filters are then local only).
    pub(crate) fn new(
        configs: &[BloomConfig],
        metrics: &Metrics,
        redis: Option<(RedisConn, Keyspace)>,
        instance: u64,
    ) -> Arc<Self> {
        let order: Vec<Arc<Filter>> = configs
            .iter()
            .map(|config| {
                Arc::new(Filter::new(
                    config.clone(),
                    metrics.for_filter(&config.name),
                ))
            })
            .collect();
        let by_name = order
            .iter()
            .map(|f| (f.name.clone(), Arc::clone(f)))
            .collect();
        let shared = redis.map(|(conn, keys)| Shared::new(conn, keys));
        Arc::new(Filters {
            by_name,
            order,
            shared,
            instance,
            client: source::http_client(),
            unshared: Mutex::new(Vec::new()),
            bus_up: AtomicBool::new(false),
        })
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Arc<Filter>> {
        self.by_name.get(name)
    }

    pub(crate) fn all(&self) -> &[Arc<Filter>] {
        &self.order
    }

    /// Starts one load loop per filter (and, in shared mode, the loop that retries what
    /// Redis could not take: created ids not yet logged, replays that failed).
    pub(crate) fn spawn(self: &Arc<Self>, stop: &CancellationToken) {
        for filter in &self.order {
            tokio::spawn(Arc::clone(self).run(Arc::clone(filter), stop.clone()));
        }
        if self.shared.is_some() && !self.order.is_empty() {
            tokio::spawn(Arc::clone(self).retry_loop(stop.clone()));
        }
    }

    /// A create answered 2xx: add its id here, log it in Redis and tell every instance —
    /// all before the client hears back, so no instance rejects the id once the client
    /// can know it.
    pub(crate) async fn add_created(&self, filter: &Arc<Filter>, id: &[u8]) {
        filter.add(id, AddVia::Write);
        let Some(shared) = &self.shared else {
            return;
        };
        let event = BloomAddEvent {
            instance: self.instance,
            filter: filter.name.clone(),
            id: id.to_vec(),
        };
        let at = now_ms();
        if shared.add(&filter.config(), &event, at).await.is_err() {
            filter.metrics.add_failures_redis.inc();
            let mut unshared = self.unshared.lock().unwrap_or_else(PoisonError::into_inner);
            if unshared.len() < UNSHARED_MAX {
                unshared.push((Arc::clone(filter), event, at));
            }
        }
    }

    async fn retry_loop(self: Arc<Self>, stop: CancellationToken) {
        let Some(shared) = &self.shared else {
            return;
        };
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(UNSHARED_RETRY) => {}
            }
            if !shared.redis.is_up() {
                continue;
            }
            // A replay that failed (Redis unreachable at the time) is retried here until it
            // succeeds; only while the bus is up, or it would miss what comes after it.
            if self.bus_up.load(Ordering::Acquire) {
                for filter in &self.order {
                    self.replay(filter).await;
                }
            }
            let batch =
                std::mem::take(&mut *self.unshared.lock().unwrap_or_else(PoisonError::into_inner));
            let mut failed = Vec::new();
            for (filter, event, at) in batch {
                if failed.is_empty() && shared.add(&filter.config(), &event, at).await.is_ok() {
                    continue;
                }
                failed.push((filter, event, at));
            }
            if !failed.is_empty() {
                self.unshared
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .extend(failed);
            }
        }
    }

    /// One filter's life: start from the Redis snapshot when there is one, then load the
    /// source, then reload every `refresh` (or on request). The definition is re-read for
    /// every load and whenever a reload changes it, so a new `refresh` counts from the end
    /// of the last load: shortened below the time already waited, the next load starts now.
    async fn run(self: Arc<Self>, filter: Arc<Filter>, stop: CancellationToken) {
        if self.shared.is_some() {
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.fast_start(&filter) => {}
            }
        }
        let mut failures: u32 = 0;
        loop {
            let loaded = tokio::select! {
                () = stop.cancelled() => return,
                loaded = self.load_source(&filter) => loaded,
            };
            let finished = tokio::time::Instant::now();
            failures = if loaded {
                0
            } else {
                failures.saturating_add(1)
            };
            loop {
                let due = next_wait(filter.config().refresh, loaded, failures)
                    .and_then(|wait| finished.checked_add(wait));
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = filter.rebuild.notified() => break,
                    // The definition changed: wait again with its `refresh`.
                    () = filter.reconfigured.notified() => {}
                    () = async {
                        match due {
                            Some(due) => tokio::time::sleep_until(due).await,
                            None => std::future::pending().await,
                        }
                    } => break,
                }
            }
        }
    }

    /// Applies a reloaded `[[bloom]]` list (names are unique: the config was validated).
    /// Filters are matched by name; for each whose definition changed, the new one is in
    /// effect for everything that reads it from now on:
    /// - `refresh`: the load loop is woken and waits again with it, counted from the end of
    ///   its last load;
    /// - `load_timeout`: from the next load;
    /// - `source`, `format`, `expected_items`, `fp_rate`: a rebuild is requested now (like
    ///   an admin rebuild: queued behind a load that is running), which reads and sizes
    ///   with the new definition. The filter in service keeps serving until it succeeds.
    ///
    /// # Errors
    /// The names of filters added or removed (added first, in `configs` order, then
    /// removed): that needs a restart, and then nothing is changed.
    pub(crate) fn reconfigure(&self, configs: &[BloomConfig]) -> Result<Vec<String>, Vec<String>> {
        let new_names: HashSet<&str> = configs.iter().map(|c| c.name.as_str()).collect();
        let unmatched: Vec<String> = configs
            .iter()
            .filter(|c| !self.by_name.contains_key(&c.name))
            .map(|c| c.name.clone())
            .chain(
                self.order
                    .iter()
                    .filter(|f| !new_names.contains(f.name()))
                    .map(|f| f.name.clone()),
            )
            .collect();
        if !unmatched.is_empty() {
            return Err(unmatched);
        }
        let mut changed = Vec::new();
        for new in configs {
            let Some(filter) = self.by_name.get(&new.name) else {
                continue; // every name was matched above
            };
            let change = compare(&filter.config(), new);
            if change == Change::None {
                continue;
            }
            filter.config.store(Arc::new(new.clone()));
            if change == Change::Rebuild {
                filter.rebuild.notify_one();
            } else {
                filter.reconfigured.notify_one();
            }
            info!(
                message = "Bloom filter reconfigured.",
                filter = %new.name,
                rebuild = change == Change::Rebuild,
            );
            changed.push(new.name.clone());
        }
        Ok(changed)
    }

    /// Loads the Redis snapshot and the ids created since it, if both can be had.
    async fn fast_start(&self, filter: &Filter) {
        let Some(shared) = &self.shared else {
            return;
        };
        let config = filter.config();
        let name = filter.name();
        // From here on, events are kept for the filter about to be installed: one that
        // lands after the log was read must not be lost while no filter is in service.
        filter.write().pending.get_or_insert_with(Vec::new);
        let snapshot = match shared.read_snapshot(&config).await {
            Ok(Some(snapshot)) => snapshot,
            Ok(None) | Err(_) => return,
        };
        let since = snapshot.load_started_ms.saturating_sub(REPLAY_MARGIN_MS);
        // Without the ids created since the snapshot it could reject a real one: then
        // wait for the source instead.
        let Ok(adds) = shared.adds_since(name, since).await else {
            return;
        };
        let mut bloom = snapshot.bloom;
        let mut items = snapshot.items;
        for id in &adds {
            if !bloom.check_and_set(id) {
                items += 1;
            }
        }
        if filter.is_ready() {
            return; // a source load won the race
        }
        filter.install(bloom, items, LoadedFrom::Snapshot, None);
        filter.metrics.loads_snapshot.inc();
        filter.metrics.added(AddVia::Resync, adds.len() as u64);
        info!(
            message = "Bloom filter started from the Redis snapshot.",
            filter = %name,
            items,
            replayed = adds.len(),
        );
    }

    /// One source load; `true` when it succeeded.
    async fn load_source(&self, filter: &Filter) -> bool {
        // One version of the definition for the whole load: the snapshot's header must name
        // the sizing the filter was built with.
        let config = filter.config();
        let started_ms = now_ms();
        let started = Instant::now();
        let mut bloom: Bloom<[u8]> =
            match Bloom::new_for_fp_rate(config.expected_items, config.fp_rate * SIZING_MARGIN) {
                Ok(bloom) => bloom,
                Err(error) => {
                    self.load_failed(filter, format!("cannot size the filter: {error}"));
                    return false;
                }
            };
        filter.loading.store(true, Ordering::Relaxed);
        filter.write().pending.get_or_insert_with(Vec::new);
        let loaded = tokio::time::timeout(
            config.load_timeout,
            source::load(&config.source, &config.format, &self.client, &mut bloom),
        )
        .await;
        filter.loading.store(false, Ordering::Relaxed);
        let stats = match loaded {
            Ok(Ok(stats)) => stats,
            Ok(Err(error)) => {
                self.load_failed(filter, error);
                return false;
            }
            Err(_) => {
                self.load_failed(
                    filter,
                    format!("the load took longer than {:?}", config.load_timeout),
                );
                return false;
            }
        };
        let elapsed = started.elapsed();
        let snapshot = self.shared.as_ref().map(|_| bloom.to_bytes());
        let report = LoadReport {
            at_unix_ms: started_ms,
            duration_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
            lines: stats.lines,
            skipped: stats.skipped,
        };
        filter.install(bloom, stats.items, LoadedFrom::Source, Some(report));
        let metrics = &filter.metrics;
        metrics.loads_source.inc();
        metrics.load_duration.observe(elapsed.as_secs_f64());
        metrics.skipped_lines.inc_by(stats.skipped);
        info!(
            message = "Bloom filter loaded from its source.",
            filter = %filter.name,
            items = stats.items,
            skipped = stats.skipped,
            took = ?elapsed,
        );
        if let (Some(shared), Some(snapshot)) = (&self.shared, snapshot) {
            // Ids created since the source began its export may be missing from it.
            filter.note_missed(started_ms.saturating_sub(REPLAY_MARGIN_MS));
            self.replay(filter).await;
            if shared
                .write_snapshot(&config, &snapshot, started_ms, stats.items)
                .await
                .is_err()
            {
                warn!(message = "Bloom filter snapshot not written to Redis.", filter = %filter.name);
            }
        }
        true
    }

    fn load_failed(&self, filter: &Filter, error: String) {
        filter.metrics.load_failures.inc();
        let mut state = filter.write();
        state.pending = None;
        let first = state.last_error.is_none();
        let serving = state.bloom.is_some();
        state.last_error = Some(error.clone());
        drop(state);
        // One line when loading starts to fail, not one per retry.
        if first {
            if serving {
                warn!(
                    message = "Bloom filter reload failed; the previous filter keeps serving.",
                    filter = %filter.name,
                    %error,
                );
            } else {
                warn!(
                    message = "Bloom filter not loaded; it rejects nothing until a load succeeds.",
                    filter = %filter.name,
                    %error,
                );
            }
        }
    }

    /// Replays the Redis log of created ids from before the filter's gap, if it has one.
    async fn replay(&self, filter: &Filter) {
        let Some(shared) = &self.shared else {
            return;
        };
        let Some(since) = filter.take_missed() else {
            return;
        };
        match shared.adds_since(&filter.name, since).await {
            Ok(ids) => {
                filter.add_many(&ids, AddVia::Resync);
                // While the bus is down, events are still being missed: keep the mark, so
                // the replay after the resubscription starts from it.
                if !self.bus_up.load(Ordering::Acquire) {
                    filter.note_missed(since);
                }
            }
            Err(_) => filter.note_missed(since),
        }
    }

    async fn replay_all(self: Arc<Self>) {
        for filter in &self.order {
            self.replay(filter).await;
        }
    }
}

impl BusListener for Filters {
    fn on_bloom_add(&self, event: BloomAddEvent) {
        if let Some(filter) = self.by_name.get(&event.filter) {
            filter.add(&event.id, AddVia::Event);
        }
    }

    fn on_gap(&self, unix_ms: u64) {
        self.bus_up.store(false, Ordering::Release);
        for filter in &self.order {
            filter.note_missed(unix_ms.saturating_sub(GAP_MARGIN_MS));
        }
    }

    fn on_subscribed(self: Arc<Self>, _delivery: Delivery) {
        self.bus_up.store(true, Ordering::Release);
        if !self.order.is_empty() {
            tokio::spawn(self.replay_all());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use prometheus::Registry;

    use super::*;
    use crate::config::{BloomSource, SourceFormat};

    const LIMIT: Duration = Duration::from_secs(10);

    fn config(name: &str, path: &Path, refresh: Duration) -> BloomConfig {
        BloomConfig {
            name: name.to_owned(),
            expected_items: 1000,
            fp_rate: 0.01,
            refresh,
            load_timeout: Duration::from_secs(5),
            source: BloomSource::File(path.to_owned()),
            format: SourceFormat::Lines,
        }
    }

    fn filters(configs: &[BloomConfig]) -> Arc<Filters> {
        let metrics = Metrics::register(&Registry::new()).unwrap();
        Filters::new(configs, &metrics, None, 1)
    }

    fn write_ids(path: &Path, n: u32) {
        let text: String = (0..n).map(|i| format!("{i}\n")).collect();
        std::fs::write(path, text).unwrap();
    }

    /// Polls `filter` until its status satisfies `done`, within [`LIMIT`].
    async fn wait_status(filter: &Filter, done: impl Fn(&FilterStatus) -> bool) -> FilterStatus {
        tokio::time::timeout(LIMIT, async {
            loop {
                let status = filter.status();
                if done(&status) {
                    return status;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("filter status never got there: {:?}", filter.status()))
    }

    #[tokio::test]
    async fn a_shorter_refresh_wakes_the_sleeping_loop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids");
        write_ids(&path, 10);
        let initial = config("ids", &path, Duration::from_secs(600));
        let filters = filters(std::slice::from_ref(&initial));
        let stop = CancellationToken::new();
        filters.spawn(&stop);
        let filter = Arc::clone(filters.get("ids").unwrap());
        wait_status(&filter, |s| s.ready && s.items == 10).await;
        // Let the loop go to sleep on its 10 minutes.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(filter.metrics.loads_source.get(), 1);

        write_ids(&path, 25);
        let shorter = BloomConfig {
            refresh: Duration::from_millis(200),
            ..initial.clone()
        };
        assert_eq!(
            filters.reconfigure(std::slice::from_ref(&shorter)),
            Ok(vec!["ids".to_owned()])
        );
        assert_eq!(filter.config().refresh, Duration::from_millis(200));
        wait_status(&filter, |s| s.items == 25).await;
        // And it keeps that pace.
        let loads = filter.metrics.loads_source.get();
        tokio::time::timeout(LIMIT, async {
            while filter.metrics.loads_source.get() < loads + 2 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the loop did not keep reloading every 200ms");

        // Back to a long refresh: the loop waits on it again (a wake alone reloads nothing).
        assert_eq!(
            filters.reconfigure(std::slice::from_ref(&initial)),
            Ok(vec!["ids".to_owned()])
        );
        // (A load that was running then may still finish.)
        tokio::time::sleep(Duration::from_millis(500)).await;
        let settled = filter.metrics.loads_source.get();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(filter.metrics.loads_source.get(), settled);
        stop.cancel();
    }

    #[tokio::test]
    async fn a_new_sizing_rebuilds_now_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ids");
        write_ids(&path, 10);
        // Loaded once, at start: only the reconfiguration can load it again.
        let initial = config("ids", &path, Duration::ZERO);
        let filters = filters(std::slice::from_ref(&initial));
        let stop = CancellationToken::new();
        filters.spawn(&stop);
        let filter = Arc::clone(filters.get("ids").unwrap());
        let before = wait_status(&filter, |s| s.ready && s.items == 10).await;

        let bigger = BloomConfig {
            expected_items: 20_000,
            fp_rate: 0.001,
            ..initial.clone()
        };
        assert_eq!(
            filters.reconfigure(std::slice::from_ref(&bigger)),
            Ok(vec!["ids".to_owned()])
        );
        let after = wait_status(&filter, |s| s.bits != before.bits).await;
        assert!(after.bits > before.bits, "{before:?} -> {after:?}");
        assert!(after.hash_functions > before.hash_functions);
        assert_eq!(after.items, 10);
        assert_eq!(after.expected_items, 20_000);
        assert!((after.configured_fp_rate - 0.001).abs() < f64::EPSILON);
        assert_eq!(filter.metrics.loads_source.get(), 2);
        for id in 0..10 {
            assert_eq!(filter.check(id.to_string().as_bytes()), Verdict::Pass);
        }
        stop.cancel();
    }

    #[tokio::test]
    async fn added_or_removed_filters_are_refused_and_nothing_changes() {
        let dir = tempfile::tempdir().unwrap();
        let a = config("a", &dir.path().join("a"), Duration::from_secs(600));
        let b = config("b", &dir.path().join("b"), Duration::from_secs(600));
        let c = config("c", &dir.path().join("c"), Duration::from_secs(600));
        let filters = filters(&[a.clone(), b.clone()]);
        let a_before = filters.get("a").unwrap().config();
        let b_before = filters.get("b").unwrap().config();
        let changed_a = BloomConfig {
            refresh: Duration::from_secs(1),
            fp_rate: 0.05,
            ..a.clone()
        };

        assert_eq!(
            filters.reconfigure(&[changed_a.clone(), c.clone()]),
            Err(vec!["c".to_owned(), "b".to_owned()])
        );
        assert_eq!(
            filters.reconfigure(std::slice::from_ref(&changed_a)),
            Err(vec!["b".to_owned()])
        );
        assert_eq!(
            filters.reconfigure(&[changed_a.clone(), b.clone(), c]),
            Err(vec!["c".to_owned()])
        );
        assert_eq!(
            filters.reconfigure(&[]),
            Err(vec!["a".to_owned(), "b".to_owned()])
        );
        assert!(Arc::ptr_eq(&filters.get("a").unwrap().config(), &a_before));
        assert!(Arc::ptr_eq(&filters.get("b").unwrap().config(), &b_before));
        assert_eq!(filters.all().len(), 2);
        assert!(filters.get("c").is_none());

        // Nothing was asked of the load loops either: once spawned, each loads once and
        // then waits its 10 minutes.
        std::fs::write(dir.path().join("a"), "1\n").unwrap();
        std::fs::write(dir.path().join("b"), "1\n").unwrap();
        let stop = CancellationToken::new();
        filters.spawn(&stop);
        for filter in filters.all() {
            wait_status(filter, |s| s.ready).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        for filter in filters.all() {
            assert_eq!(filter.metrics.loads_source.get(), 1, "{}", filter.name());
        }
        stop.cancel();
    }

    #[tokio::test]
    async fn an_unchanged_list_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let a = config("a", &dir.path().join("a"), Duration::from_secs(600));
        let b = config("b", &dir.path().join("b"), Duration::ZERO);
        let filters = filters(&[a.clone(), b.clone()]);
        let a_before = filters.get("a").unwrap().config();
        assert_eq!(filters.reconfigure(&[a.clone(), b.clone()]), Ok(vec![]));
        // The order of the list is not part of any definition.
        assert_eq!(filters.reconfigure(&[b.clone(), a.clone()]), Ok(vec![]));
        assert!(Arc::ptr_eq(&filters.get("a").unwrap().config(), &a_before));

        // Only the changed one is named; a timeout alone is no rebuild.
        let b2 = BloomConfig {
            load_timeout: Duration::from_secs(1),
            ..b.clone()
        };
        assert_eq!(
            filters.reconfigure(&[a.clone(), b2]),
            Ok(vec!["b".to_owned()])
        );
        assert_eq!(
            filters.get("b").unwrap().config().load_timeout,
            Duration::from_secs(1)
        );
        assert!(Arc::ptr_eq(&filters.get("a").unwrap().config(), &a_before));
    }

    #[test]
    fn what_a_change_implies() {
        let path = Path::new("/dev/null");
        let base = config("x", path, Duration::from_secs(60));
        let with = |f: &dyn Fn(&mut BloomConfig)| {
            let mut c = base.clone();
            f(&mut c);
            compare(&base, &c)
        };
        assert_eq!(with(&|_| {}), Change::None);
        assert_eq!(with(&|c| c.refresh = Duration::ZERO), Change::Settings);
        assert_eq!(
            with(&|c| c.load_timeout = Duration::from_secs(1)),
            Change::Settings
        );
        assert_eq!(with(&|c| c.expected_items = 5), Change::Rebuild);
        assert_eq!(with(&|c| c.fp_rate = 0.02), Change::Rebuild);
        assert_eq!(
            with(&|c| c.source = BloomSource::File("/other".into())),
            Change::Rebuild
        );
        assert_eq!(
            with(&|c| c.format = SourceFormat::Ndjson {
                field: "id".to_owned()
            }),
            Change::Rebuild
        );
    }

    #[test]
    fn waits_after_a_load() {
        let ten = Duration::from_secs(10);
        assert_eq!(next_wait(ten, true, 0), Some(ten));
        assert_eq!(next_wait(Duration::ZERO, true, 0), None);
        assert_eq!(next_wait(Duration::ZERO, false, 1), Some(RETRY_MIN));
        assert_eq!(next_wait(Duration::ZERO, false, 3), Some(RETRY_MIN * 4));
        assert_eq!(next_wait(Duration::ZERO, false, 30), Some(RETRY_MAX));
        assert_eq!(next_wait(ten, false, 30), Some(ten));
    }
}
