//! Hot keys: detection, promotion into every instance's L1, per-key backend limits.
//!
//! - **Detection.** Every request records its key hash in a HeavyKeeper top-K sketch (the
//!   `heavykeeper` crate): one sketch per proxy worker thread, so recording takes a lock no
//!   other request contends for. Every `window` the detector swaps the sketches for fresh
//!   ones and sums their top-K lists: a key whose rate reaches `threshold_rps` is hot; a hot
//!   key whose rate stays under `cool_rps` for a second cools down (hysteresis).
//! - **Promotion.** A hot key is kept in L1 whatever the route's `l1` policy (unless `off`),
//!   and its L1 copy is served without asking Redis for `l1_ttl` (jittered); the hot set is
//!   broadcast (`hot` events, renewed every second) so the other instances promote the key
//!   before their own traffic crosses the threshold. An invalidation ends the L1 grace at
//!   once.
//! - **Per-key limits.** A governor keyed limiter caps, per key and instance, the requests
//!   per second that may go past L1 (`max_backend_rps_per_key`); the excess is answered
//!   from the L1 copy (fresh or stale). With no copy yet (a key that turned hot before its
//!   first fill here), the excess joins the key's one in-process fill, which costs the
//!   backend one fetch per instance at a time; only a key whose answers cannot be shared
//!   (each request would fetch for itself) is answered 429.
//!
//! **Memory bound.** Independent of how many distinct keys pass: one sketch per worker
//! thread (plus one) of `SKETCH_WIDTH × SKETCH_DEPTH` counters and a top-K heap of
//! `max_hot_keys.min(1024)` entries, the hot set (at most `max_hot_keys`), and a limiter
//! entry per key that went past L1 *while hot* (so again at most `max_hot_keys`; idle ones
//! are dropped every window). [`HotKeys::memory_bound`] states it in bytes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use governor::{Quota, RateLimiter};
use heavykeeper::TopK;
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::cache::tiers::HotSet;
use crate::cache::{CacheKey, ttl};
use crate::clock::{KeyedLimiter, TokioClock, now_ms};
use crate::config::HotKeysConfig;
use crate::coord::RedisConn;
use crate::coord::events::{Event, EventKind};
use crate::metrics::{HotMetrics, Metrics};

const SKETCH_WIDTH: usize = 2048;
const SKETCH_DEPTH: usize = 4;
const SKETCH_DECAY: f64 = 0.9;
/// Local hot keys are re-broadcast this often; a peer's promotion lapses after three
/// missed renewals.
const REBROADCAST: Duration = Duration::from_secs(1);
const PEER_LEASE: Duration = Duration::from_secs(3);
/// A hot key must stay cool this long before it is demoted.
const COOL_FOR: Duration = Duration::from_secs(1);

/// Where a key was found hot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Promoted {
    Local,
    Peer(u64),
}

/// One hot key.
#[derive(Debug)]
pub(crate) struct Hot {
    since_ms: u64,
    from: Promoted,
    /// Requests per second in the last window (f64 bits).
    rate: AtomicU64,
    /// Until when (unix ms) the L1 copy is served without asking Redis.
    l1_until_ms: AtomicU64,
    /// Windows in a row under `cool_rps`.
    cool_windows: AtomicU32,
    /// Peer promotions lapse at this time (unix ms) unless renewed; 0 for local ones.
    lease_until_ms: AtomicU64,
}

impl Hot {
    fn new(from: Promoted, rate: f64) -> Self {
        let now = now_ms();
        let lease = match from {
            Promoted::Local => 0,
            Promoted::Peer(_) => now + millis(PEER_LEASE),
        };
        Hot {
            since_ms: now,
            from,
            rate: AtomicU64::new(rate.to_bits()),
            l1_until_ms: AtomicU64::new(0),
            cool_windows: AtomicU32::new(0),
            lease_until_ms: AtomicU64::new(lease),
        }
    }

    /// Whether the L1 copy may be served without asking Redis.
    pub(crate) fn l1_fresh(&self) -> bool {
        now_ms() < self.l1_until_ms.load(Ordering::Relaxed)
    }

    fn rate(&self) -> f64 {
        f64::from_bits(self.rate.load(Ordering::Relaxed))
    }
}

/// `/admin/hotkeys`'s view of one hot key.
#[derive(Debug, Serialize)]
pub(crate) struct HotStatus {
    pub(crate) hash: String,
    pub(crate) key: Option<String>,
    pub(crate) rate: f64,
    pub(crate) since_unix_ms: u64,
    pub(crate) promoted_from: String,
    pub(crate) l1_fresh_for_ms: u64,
}

/// The detector, the hot set and the per-key limiter of one instance.
pub(crate) struct HotKeys {
    /// Reloadable (see [`HotKeys::reconfigure`]); the sketches keep the size they had at start.
    config: ArcSwap<HotKeysConfig>,
    shards: Vec<Mutex<TopK<u128>>>,
    hot: ArcSwap<HashMap<u128, Arc<Hot>>>,
    limiter: ArcSwap<Option<KeyedLimiter<u128>>>,
    /// Full cache keys of hot keys, for the admin view (filled by the read path).
    labels: Mutex<HashMap<u128, String>>,
    instance: u64,
    /// Where `hot` events go; `None` in embedded mode.
    bus: Option<(RedisConn, String)>,
    metrics: HotMetrics,
}

impl std::fmt::Debug for HotKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HotKeys")
            .field("hot", &self.hot.load().len())
            .field("config", &**self.config.load())
            .finish_non_exhaustive()
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl HotKeys {
    pub(crate) fn new(
        config: &HotKeysConfig,
        workers: usize,
        instance: u64,
        bus: Option<(RedisConn, String)>,
        metrics: &Metrics,
    ) -> Arc<Self> {
        let k = config.max_hot_keys.clamp(16, 1024);
        let shards = (0..=workers).map(|_| Mutex::new(Self::sketch(k))).collect();
        let limiter = std::num::NonZeroU32::new(config.max_backend_rps_per_key).map(|rate| {
            RateLimiter::dashmap_with_clock(Quota::per_second(rate), TokioClock::new())
        });
        Arc::new(HotKeys {
            config: ArcSwap::from_pointee(config.clone()),
            shards,
            hot: ArcSwap::from_pointee(HashMap::new()),
            limiter: ArcSwap::from_pointee(limiter),
            labels: Mutex::new(HashMap::new()),
            instance,
            bus,
            metrics: metrics.hot_metrics(),
        })
    }

    /// Applies reloaded thresholds: rates, window, L1 grace and the per-key limit take
    /// effect at once (a new limit starts a fresh limiter); `max_hot_keys` caps the hot set
    /// at once, but the sketches keep the size they were built with.
    pub(crate) fn reconfigure(&self, config: &HotKeysConfig) {
        let old = self.config.load_full();
        if old.max_backend_rps_per_key != config.max_backend_rps_per_key {
            self.limiter.store(Arc::new(
                std::num::NonZeroU32::new(config.max_backend_rps_per_key).map(|rate| {
                    RateLimiter::dashmap_with_clock(Quota::per_second(rate), TokioClock::new())
                }),
            ));
        }
        self.config.store(Arc::new(config.clone()));
    }

    fn sketch(k: usize) -> TopK<u128> {
        TopK::new(k, SKETCH_WIDTH, SKETCH_DEPTH, SKETCH_DECAY)
    }

    fn enabled(&self) -> bool {
        self.config.load().threshold_rps > 0
    }

    /// Upper bound of the detector's and limiter's memory in bytes, whatever the traffic.
    pub(crate) fn memory_bound(&self) -> usize {
        let k = self.config.load().max_hot_keys.clamp(16, 1024);
        // A sketch bucket holds a fingerprint and a count; a heap slot an item and a count.
        let sketch = SKETCH_WIDTH * SKETCH_DEPTH * 16 + k * 48;
        // A hot-set entry: the map slot, the `Hot`, a label of up to 1 KiB; a limiter slot.
        let per_hot = 64 + 64 + 1024 + 64;
        self.shards.len() * sketch + self.config.load().max_hot_keys * per_hot
    }

    /// Counts one request for `hash`.
    pub(crate) fn record(&self, hash: u128) {
        if !self.enabled() {
            return;
        }
        let shard = crate::worker::index() % self.shards.len();
        self.shards[shard]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .add(&hash, 1);
    }

    /// The key's hot state, if it is hot.
    pub(crate) fn get(&self, hash: u128) -> Option<Arc<Hot>> {
        if !self.enabled() {
            return None;
        }
        self.hot.load().get(&hash).cloned()
    }

    /// Counts how a hot key's request was served, and notes its full key for the admin view.
    pub(crate) fn served(&self, hash: u128, full_key: &str, from_l1: bool) {
        if from_l1 {
            self.metrics.served_l1.inc();
        } else {
            self.metrics.served_backend.inc();
            self.label(hash, full_key);
        }
    }

    /// Notes the full key of hot `hash` for the admin view (once).
    pub(crate) fn label(&self, hash: u128, full_key: &str) {
        let mut labels = self.labels.lock().unwrap_or_else(PoisonError::into_inner);
        if labels.len() < self.config.load().max_hot_keys && !labels.contains_key(&hash) {
            let mut label = full_key.to_owned();
            label.truncate(1024);
            labels.insert(hash, label);
        }
    }

    /// Whether one more request for hot `hash` may go past L1 (to Redis, the origin).
    pub(crate) fn allow_backend(&self, hash: u128) -> bool {
        self.limiter
            .load()
            .as_ref()
            .as_ref()
            .is_none_or(|limiter| limiter.check_key(&hash).is_ok())
    }

    /// The L1 copy of hot `hash` was just refreshed from Redis or the origin.
    pub(crate) fn renew_l1(&self, hot: &Hot) {
        let ttl = ttl::jittered(self.config.load().l1_ttl, 0.2, &mut rand::rng());
        hot.l1_until_ms
            .store(now_ms() + millis(ttl), Ordering::Relaxed);
    }

    /// An invalidation: the L1 copy must not be served without asking Redis again.
    pub(crate) fn invalidated(&self, hash: u128) {
        if let Some(hot) = self.hot.load().get(&hash) {
            hot.l1_until_ms.store(0, Ordering::Relaxed);
        }
    }

    /// A peer found `hash` hot.
    pub(crate) fn peer_hot(&self, instance: u64, hash: u128) {
        if !self.enabled() || instance == self.instance {
            return;
        }
        if let Some(hot) = self.hot.load().get(&hash) {
            if hot.from != Promoted::Local {
                hot.lease_until_ms
                    .store(now_ms() + millis(PEER_LEASE), Ordering::Relaxed);
            }
            return;
        }
        let mut promoted = false;
        self.hot.rcu(|current| {
            let mut next = HashMap::clone(current);
            promoted = false;
            if next.len() < self.config.load().max_hot_keys && !next.contains_key(&hash) {
                next.insert(hash, Arc::new(Hot::new(Promoted::Peer(instance), 0.0)));
                promoted = true;
            }
            next
        });
        if promoted {
            self.metrics.promotions_peer.inc();
            self.metrics.hot_keys.inc();
        }
    }

    /// The hot set for `/admin/hotkeys`, hottest first.
    pub(crate) fn status(&self) -> Vec<HotStatus> {
        let labels = self.labels.lock().unwrap_or_else(PoisonError::into_inner);
        let now = now_ms();
        let mut list: Vec<HotStatus> = self
            .hot
            .load()
            .iter()
            .map(|(hash, hot)| HotStatus {
                hash: format!("{hash:032x}"),
                key: labels.get(hash).cloned(),
                rate: hot.rate(),
                since_unix_ms: hot.since_ms,
                promoted_from: match hot.from {
                    Promoted::Local => "local".to_owned(),
                    Promoted::Peer(id) => format!("peer {id:016x}"),
                },
                l1_fresh_for_ms: hot.l1_until_ms.load(Ordering::Relaxed).saturating_sub(now),
            })
            .collect();
        list.sort_by(|a, b| b.rate.total_cmp(&a.rate));
        list
    }

    /// Runs the detector until `stop`.
    pub(crate) async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut last_broadcast = tokio::time::Instant::now();
        loop {
            // Read each round: a reload may change the window or turn detection on or off.
            let window = self.config.load().window;
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(window) => {}
            }
            if !self.enabled() {
                continue;
            }
            let newly = self.detect(window);
            let due = last_broadcast.elapsed() >= REBROADCAST;
            if due {
                last_broadcast = tokio::time::Instant::now();
            }
            let to_send: Vec<u128> = if due {
                self.hot
                    .load()
                    .iter()
                    .filter(|(_, hot)| hot.from == Promoted::Local)
                    .map(|(hash, _)| *hash)
                    .collect()
            } else {
                newly
            };
            self.broadcast(&to_send).await;
            if let Some(limiter) = self.limiter.load().as_ref() {
                limiter.retain_recent();
                limiter.shrink_to_fit();
            }
        }
    }

    /// One window: swaps the sketches, promotes and demotes. Returns the keys that became
    /// hot here.
    fn detect(&self, window: Duration) -> Vec<u128> {
        let k = self.config.load().max_hot_keys.clamp(16, 1024);
        let mut counts: HashMap<u128, u64> = HashMap::new();
        for shard in &self.shards {
            let sketch = std::mem::replace(
                &mut *shard.lock().unwrap_or_else(PoisonError::into_inner),
                Self::sketch(k),
            );
            for node in sketch.list() {
                *counts.entry(node.item).or_default() += node.count;
            }
        }
        let secs = window.as_secs_f64().max(0.001);
        #[allow(clippy::cast_precision_loss)] // counts per window, far below 2^52
        let rate_of = |count: u64| count as f64 / secs;
        let threshold = f64::from(self.config.load().threshold_rps);
        let cool = f64::from(self.config.load().cool_rps);
        let cool_windows_needed =
            u32::try_from((COOL_FOR.as_millis() / window.as_millis().max(1)).max(1))
                .unwrap_or(u32::MAX);
        let now = now_ms();

        let current = self.hot.load_full();
        let mut demote = Vec::new();
        for (hash, hot) in current.iter() {
            let rate = counts.get(hash).map_or(0.0, |c| rate_of(*c));
            hot.rate.store(rate.to_bits(), Ordering::Relaxed);
            if rate >= cool {
                hot.cool_windows.store(0, Ordering::Relaxed);
                continue;
            }
            let cooled = hot.cool_windows.fetch_add(1, Ordering::Relaxed) + 1;
            let lease = hot.lease_until_ms.load(Ordering::Relaxed);
            let lapsed = lease == 0 || lease <= now;
            if cooled >= cool_windows_needed && lapsed {
                demote.push(*hash);
            }
        }
        let mut newly = Vec::new();
        for (hash, count) in &counts {
            let rate = rate_of(*count);
            if rate >= threshold && !current.contains_key(hash) {
                newly.push((*hash, rate));
            }
        }
        newly.sort_by(|a, b| b.1.total_cmp(&a.1));
        if demote.is_empty() && newly.is_empty() {
            return Vec::new();
        }
        let mut next = HashMap::clone(&current);
        for hash in &demote {
            next.remove(hash);
        }
        let mut promoted = Vec::new();
        for (hash, rate) in newly {
            if next.len() >= self.config.load().max_hot_keys {
                break;
            }
            next.insert(hash, Arc::new(Hot::new(Promoted::Local, rate)));
            promoted.push(hash);
        }
        self.hot.store(Arc::new(next));
        if !demote.is_empty() {
            let mut labels = self.labels.lock().unwrap_or_else(PoisonError::into_inner);
            for hash in &demote {
                labels.remove(hash);
            }
        }
        self.metrics.demotions.inc_by(demote.len() as u64);
        self.metrics.promotions_local.inc_by(promoted.len() as u64);
        self.metrics
            .hot_keys
            .set(i64::try_from(self.hot.load().len()).unwrap_or(i64::MAX));
        if !promoted.is_empty() {
            info!(
                message = "Hot keys promoted into L1.",
                count = promoted.len()
            );
        }
        promoted
    }

    async fn broadcast(&self, hashes: &[u128]) {
        let Some((redis, channel)) = &self.bus else {
            return;
        };
        for hash in hashes {
            let event = Event {
                kind: EventKind::Hot,
                instance: self.instance,
                hash: *hash,
                floor: None,
            };
            if redis.publish(channel, &event.encode()).await.is_err() {
                return;
            }
        }
    }
}

impl HotSet for HotKeys {
    fn is_hot(&self, hash: u128) -> bool {
        self.get(hash).is_some()
    }

    fn kept(&self, key: &CacheKey) {
        if let Some(hot) = self.get(key.hash) {
            self.renew_l1(&hot);
            self.label(key.hash, &key.full);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(threshold: u32) -> HotKeysConfig {
        HotKeysConfig {
            threshold_rps: threshold,
            cool_rps: threshold / 2,
            window: Duration::from_millis(250),
            l1_ttl: Duration::from_secs(1),
            max_backend_rps_per_key: 5,
            max_hot_keys: 8,
        }
    }

    fn hot_keys(threshold: u32) -> Arc<HotKeys> {
        let registry = prometheus::Registry::new();
        let metrics = Metrics::register(&registry).unwrap();
        HotKeys::new(&config(threshold), 2, 1, None, &metrics)
    }

    #[test]
    fn a_key_over_the_threshold_is_hot_and_cools_with_hysteresis() {
        let hk = hot_keys(100);
        let window = Duration::from_millis(250);
        for _ in 0..100 {
            hk.record(7); // 400 req/s
        }
        for key in 0..1000u128 {
            hk.record(1000 + key); // 4 req/s each
        }
        assert_eq!(hk.detect(window), vec![7]);
        assert!(hk.get(7).is_some());
        assert!(hk.get(1000).is_none());
        // Between cool (50) and threshold (100): stays hot.
        for _ in 0..20 {
            hk.record(7); // 80 req/s
        }
        hk.detect(window);
        assert!(hk.get(7).is_some());
        // Under cool for a whole second: demoted.
        for _ in 0..4 {
            hk.detect(window);
        }
        assert!(hk.get(7).is_none());
    }

    #[test]
    fn peer_promotions_and_the_limiter() {
        let hk = hot_keys(100);
        hk.peer_hot(2, 9);
        let hot = hk.get(9).unwrap();
        assert_eq!(hot.from, Promoted::Peer(2));
        assert!(!hot.l1_fresh());
        hk.renew_l1(&hot);
        assert!(hot.l1_fresh());
        hk.invalidated(9);
        assert!(!hot.l1_fresh());
        let allowed = (0..20).filter(|_| hk.allow_backend(9)).count();
        assert_eq!(allowed, 5, "a burst of max_backend_rps_per_key");
        // Own broadcasts are ignored.
        hk.peer_hot(1, 10);
        assert!(hk.get(10).is_none());
    }

    /// On paused time: the L1 grace of a hot key lasts `l1_ttl` ± 20 % (jittered, so the
    /// hot keys of a fleet do not all go back to Redis at once) after its renewal.
    #[tokio::test(start_paused = true)]
    async fn the_l1_grace_lasts_l1_ttl_within_its_jitter() {
        let hk = hot_keys(100);
        hk.peer_hot(2, 9);
        let hot = hk.get(9).expect("promoted by the peer");
        hk.renew_l1(&hot);
        tokio::time::advance(Duration::from_millis(799)).await;
        assert!(hot.l1_fresh());
        tokio::time::advance(Duration::from_millis(402)).await;
        assert!(!hot.l1_fresh());
    }

    /// On paused time: past its burst, the per-key limit lets one request through every
    /// 1 / max_backend_rps_per_key (200 ms here), per key.
    #[tokio::test(start_paused = true)]
    async fn the_per_key_limit_refills_at_its_rate() {
        let hk = hot_keys(100);
        assert_eq!((0..20).filter(|_| hk.allow_backend(9)).count(), 5);
        tokio::time::advance(Duration::from_millis(199)).await;
        assert!(!hk.allow_backend(9));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(hk.allow_backend(9));
        assert!(!hk.allow_backend(9));
        // Another key has its own budget.
        assert!(hk.allow_backend(10));
    }

    /// On paused time: the detector promotes a key at the end of the window in which it
    /// crossed the threshold, and demotes it a second after it went cold.
    #[tokio::test(start_paused = true)]
    async fn the_detector_decides_once_per_window() {
        let hk = hot_keys(100);
        let stop = CancellationToken::new();
        let detector = tokio::spawn(Arc::clone(&hk).run(stop.clone()));
        for _ in 0..100 {
            hk.record(7); // 400 req/s over a 250 ms window
        }
        tokio::time::sleep(Duration::from_millis(249)).await;
        assert!(hk.get(7).is_none(), "promoted before the window ended");
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert!(hk.get(7).is_some(), "not promoted at the end of the window");
        tokio::time::sleep(Duration::from_millis(1250)).await;
        assert!(hk.get(7).is_none(), "still hot a second after it went cold");
        stop.cancel();
        detector.await.expect("detector");
    }

    #[test]
    fn memory_is_bounded_whatever_the_key_count() {
        let hk = hot_keys(1_000_000);
        for key in 0..200_000u128 {
            hk.record(key);
        }
        hk.detect(Duration::from_millis(250));
        assert!(hk.hot.load().is_empty());
        assert!(hk.memory_bound() < 2 * 1024 * 1024, "{}", hk.memory_bound());
    }
}
