//! Every metric cacheguard exports, defined and registered in one place.
//!
//! One explicit [`Registry`] is created by the app and passed here; nothing else in the
//! crate creates or registers a metric (the global registry is banned in `clippy.toml`).
//! Label values come from enums ([`Outcome`], [`OriginStatus`], [`RedisOp`]), so the label
//! sets are bounded by construction: never a raw key or path as a label.
//!
//! Per-route handles ([`RouteMetrics`]) are resolved once when the routes are built, so the
//! request path only touches atomics; those bumped for every request are copied per proxy
//! worker and added up at scrape time (see [`per_worker`]).

mod per_worker;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

/// How a request was answered; the `outcome` label and the `X-Cache` header value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    HitL1,
    HitL2,
    /// This request's own origin fetch (it led the key's fill), or a copy it found nowhere
    /// else: the one request of a stampede that went to the origin.
    Miss,
    /// Answered by another request's fill of the same key, without an origin fetch of its
    /// own: a follower of this process's flight, or a waiter on another instance's fleet
    /// lock that read what the holder stored (`X-Cache: HIT-COALESCED`). A waiter that gave
    /// up and fetched itself is not one (`BYPASS`).
    Coalesced,
    Negative,
    /// A copy past its ttl (within grace), served while one request refreshes it.
    Stale,
    Bypass,
    /// Answered with an error status by cacheguard itself (shed, timeout, bad gateway, limits).
    Error,
    /// A definite miss of the route's Bloom filter, answered without Redis or the origin.
    Reject,
    /// A stored copy the origin confirmed with a `304` (a conditional fetch), served with
    /// its updated headers.
    Revalidated,
    /// A buy a stock gate answered "sold out" without the origin.
    SoldOut,
    /// A completed buy's answer, replayed for a retry with the same idempotency key.
    Replayed,
}

/// The `result` label of revalidations: conditional fetches of a stored copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Revalidation {
    /// `304`: the stored copy was refreshed without a new body.
    NotModified,
    /// A new answer replaced it.
    Modified,
    /// The origin failed.
    Failed,
}

/// The `outcome` label of `cacheguard_new_variants_total`: what became of a miss on a query
/// or `vary` variant new in its path's window (see `protect/variants.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NewVariant {
    /// Within the path's `max_variants`: fetched and cached.
    Budget,
    /// Beyond it, asked for before: fetched and cached, on the route's overflow rate.
    Repeat,
    /// Beyond it, a first ask: fetched for its request only, on the overflow rate.
    Uncached,
    /// Beyond it and over the overflow rate: 429.
    Refused,
}

impl NewVariant {
    pub const ALL: [NewVariant; 4] = [
        NewVariant::Budget,
        NewVariant::Repeat,
        NewVariant::Uncached,
        NewVariant::Refused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NewVariant::Budget => "budget",
            NewVariant::Repeat => "repeat",
            NewVariant::Uncached => "uncached",
            NewVariant::Refused => "refused",
        }
    }
}

impl Revalidation {
    pub const ALL: [Revalidation; 3] = [
        Revalidation::NotModified,
        Revalidation::Modified,
        Revalidation::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Revalidation::NotModified => "not_modified",
            Revalidation::Modified => "modified",
            Revalidation::Failed => "failed",
        }
    }
}

impl Outcome {
    pub const ALL: [Outcome; 12] = [
        Outcome::HitL1,
        Outcome::HitL2,
        Outcome::Miss,
        Outcome::Coalesced,
        Outcome::Negative,
        Outcome::Stale,
        Outcome::Bypass,
        Outcome::Error,
        Outcome::Reject,
        Outcome::Revalidated,
        Outcome::SoldOut,
        Outcome::Replayed,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::HitL1 => "hit_l1",
            Outcome::HitL2 => "hit_l2",
            Outcome::Miss => "miss",
            Outcome::Coalesced => "coalesced",
            Outcome::Negative => "negative",
            Outcome::Stale => "stale",
            Outcome::Bypass => "bypass",
            Outcome::Error => "error",
            Outcome::Reject => "reject",
            Outcome::Revalidated => "revalidated",
            Outcome::SoldOut => "sold_out",
            Outcome::Replayed => "replayed",
        }
    }

    /// The `X-Cache` header value.
    pub fn header_value(self) -> &'static str {
        match self {
            Outcome::HitL1 => "HIT-L1",
            Outcome::HitL2 => "HIT-L2",
            Outcome::Miss => "MISS",
            // A hit to whoever reads `HIT*` (as nginx's and Varnish's waiters are), and told
            // apart from a stored copy's.
            Outcome::Coalesced => "HIT-COALESCED",
            Outcome::Negative => "NEGATIVE",
            Outcome::Stale => "STALE",
            Outcome::Bypass | Outcome::Error => "BYPASS",
            Outcome::Reject => "REJECT",
            Outcome::Revalidated => "REVALIDATED",
            Outcome::SoldOut => "SOLDOUT",
            Outcome::Replayed => "REPLAYED",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The `status` label of origin requests: the status class, or why there was none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OriginStatus {
    S1xx,
    S2xx,
    S3xx,
    S4xx,
    S5xx,
    Timeout,
    Error,
}

impl OriginStatus {
    pub const ALL: [OriginStatus; 7] = [
        OriginStatus::S1xx,
        OriginStatus::S2xx,
        OriginStatus::S3xx,
        OriginStatus::S4xx,
        OriginStatus::S5xx,
        OriginStatus::Timeout,
        OriginStatus::Error,
    ];

    pub fn from_status(status: u16) -> Self {
        match status {
            100..=199 => OriginStatus::S1xx,
            200..=299 => OriginStatus::S2xx,
            300..=399 => OriginStatus::S3xx,
            400..=499 => OriginStatus::S4xx,
            _ => OriginStatus::S5xx,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OriginStatus::S1xx => "1xx",
            OriginStatus::S2xx => "2xx",
            OriginStatus::S3xx => "3xx",
            OriginStatus::S4xx => "4xx",
            OriginStatus::S5xx => "5xx",
            OriginStatus::Timeout => "timeout",
            OriginStatus::Error => "error",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The `outcome` label of distributed lock events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockEvent {
    /// This instance took the lock and fetches.
    Acquired,
    /// Another instance held the lock; this instance waited.
    Contended,
    /// The lease was extended while the fetch ran.
    Renewed,
    /// A renewal found the lock gone or someone else's.
    Lost,
    /// The lock was taken after waiting on another holder (its lease expired or it
    /// released without a fill).
    Takeover,
    /// A waiter gave up after `lock.wait_timeout`.
    WaitTimeout,
    /// With `lock.wait_replicas`, fewer replicas than asked had the lock in time.
    Unreplicated,
    /// A lock with no expiry (not written by cacheguard) was given a lease.
    Repaired,
    /// Another instance held the lock, and `lock.max_waiters` keys were waited on already:
    /// answered per `lock.on_timeout` without waiting.
    WaitersFull,
}

impl LockEvent {
    pub const ALL: [LockEvent; 9] = [
        LockEvent::Acquired,
        LockEvent::Contended,
        LockEvent::Renewed,
        LockEvent::Lost,
        LockEvent::Takeover,
        LockEvent::WaitTimeout,
        LockEvent::Unreplicated,
        LockEvent::Repaired,
        LockEvent::WaitersFull,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LockEvent::Acquired => "acquired",
            LockEvent::Contended => "contended",
            LockEvent::Renewed => "renewed",
            LockEvent::Lost => "lost",
            LockEvent::Takeover => "takeover",
            LockEvent::WaitTimeout => "wait_timeout",
            LockEvent::Unreplicated => "unreplicated",
            LockEvent::Repaired => "repaired",
            LockEvent::WaitersFull => "waiters_full",
        }
    }
}

/// The `reason` label of fills the fill script refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FillRefusal {
    Generation,
    LockTaken,
    /// A write's quarantine (its `double_delete_delay`) was running.
    Quarantine,
    /// Its version is below the key's version floor (a write's, or a newer stored
    /// answer's), or it has none while there is a floor: a replica behind the write.
    OlderVersion,
    /// The answer's `Vary` names a request header the route neither keys nor forwards
    /// (or is `*`): a stored copy could reach a client it was not made for.
    Vary,
}

impl FillRefusal {
    pub fn as_str(self) -> &'static str {
        match self {
            FillRefusal::Generation => "generation",
            FillRefusal::LockTaken => "lock_taken",
            FillRefusal::Quarantine => "quarantine",
            FillRefusal::OlderVersion => "older_version",
            FillRefusal::Vary => "vary",
        }
    }
}

/// The `op` label of Redis errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RedisOp {
    Get,
    Set,
    Ping,
    Lock,
    Renew,
    Fill,
    Release,
    /// Bloom filter adds, snapshots and resyncs.
    Bloom,
    /// Event bus messages sent outside the scripts (hot keys).
    Publish,
    /// Invalidations by writes.
    Invalidate,
    /// Surrogate-key (tag) indexes and tag invalidations.
    Tag,
    /// Stock gates: buys, settlements, reconciles, idempotency records.
    Stock,
    /// Serialized writes' locks.
    Serialize,
}

impl RedisOp {
    pub fn as_str(self) -> &'static str {
        match self {
            RedisOp::Get => "get",
            RedisOp::Set => "set",
            RedisOp::Ping => "ping",
            RedisOp::Lock => "lock",
            RedisOp::Renew => "renew",
            RedisOp::Fill => "fill",
            RedisOp::Release => "release",
            RedisOp::Bloom => "bloom",
            RedisOp::Publish => "publish",
            RedisOp::Invalidate => "invalidate",
            RedisOp::Tag => "tag",
            RedisOp::Stock => "stock",
            RedisOp::Serialize => "serialize",
        }
    }
}

/// The `reason` label of `cacheguard_redis_commands_off_worker_total`: why a command a
/// proxy worker sent did not go on the worker's own connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedisOffWorker {
    /// The worker has no connection of its own to use (it could not be made, or failed).
    Fallback,
    /// Sent past the breaker with no patience (a serialized write's lock renewal or
    /// release): its answer must not wait on a busy worker's own driver.
    Strict,
    /// A lock acquire followed by `WAIT`, on a connection of the pool kept for them.
    Replicated,
    /// A large transfer, on the bulk connection.
    Bulk,
}

impl RedisOffWorker {
    pub fn as_str(self) -> &'static str {
        match self {
            RedisOffWorker::Fallback => "fallback",
            RedisOffWorker::Strict => "strict",
            RedisOffWorker::Replicated => "replicated",
            RedisOffWorker::Bulk => "bulk",
        }
    }
}

/// The `reason` label of `cacheguard_origin_requests_off_worker_total`: why an origin
/// request was sent from another thread than the one that drives its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OffWorker {
    /// Sent from a thread that is no proxy worker.
    NotAWorker,
    /// Sent by a proxy worker on a connection another thread opened.
    OtherWorker,
}

impl OffWorker {
    fn as_str(self) -> &'static str {
        match self {
            OffWorker::NotAWorker => "not_a_worker",
            OffWorker::OtherWorker => "other_worker",
        }
    }
}

/// `cacheguard_origin_requests_off_worker_total`'s series, resolved once (see
/// [`Metrics::origin_off_worker`]).
#[derive(Clone, Debug)]
pub(crate) struct OffWorkerMetrics {
    pub(crate) not_a_worker: IntCounter,
    pub(crate) other_worker: IntCounter,
}

/// The `result` label of `cacheguard_warmup_requests_total`.
pub const WARMUP_RESULTS: [&str; 4] = ["filled", "failed", "cached", "skipped"];

/// The `reason` label of `cacheguard_rejected_requests_total`: the refusals of a request
/// before it reaches its path (the reasons of the errors `proxy.rs` counts there).
const REJECTED_REASONS: [&str; 11] = [
    "header_too_large",
    "too_many_headers",
    "body_too_large",
    "bad_request",
    "uri_too_long",
    "bad_request_body",
    "upload_timeout",
    "upload_too_slow",
    "upload_deadline",
    "body_spool_failed",
    "method_not_allowed",
];

/// Process-wide metric families. Cheap to clone (every field is an `Arc` inside).
#[derive(Clone, Debug)]
pub struct Metrics {
    /// `cacheguard_requests_total`, `cacheguard_request_redis_commands_total` and
    /// `cacheguard_request_duration_seconds`, per worker (see [`per_worker`]).
    requests: Arc<per_worker::RequestMetrics>,
    origin_requests: IntCounterVec,
    origin_duration: HistogramVec,
    shed: IntCounterVec,
    uncacheable: IntCounterVec,
    vary_variants: IntCounterVec,
    revalidations: IntCounterVec,
    oversized: IntCounterVec,
    version_unparsed: IntCounterVec,
    new_variants: IntCounterVec,
    origin_retries: IntCounterVec,
    origin_off_worker: IntCounterVec,
    coalesced: IntCounterVec,
    pub l1_entries: IntGauge,
    pub l1_bytes: IntGauge,
    pub redis_up: IntGauge,
    redis_errors: IntCounterVec,
    redis_slot_migrating: IntCounterVec,
    redis_off_worker: IntCounterVec,
    pub redis_transitions: IntCounter,
    redis_command_duration: HistogramVec,
    pub redis_breaker_open: IntGauge,
    redis_breaker_transitions: IntCounterVec,
    pub redis_restarts: IntCounter,
    /// Times the primary in use changed (Sentinel failover followed).
    pub redis_primary_changes: IntCounter,
    /// Commands retried once after hitting a demoted primary (`READONLY`).
    pub redis_readonly_retries: IntCounter,
    /// Nodes of the topology found, by role (primary, replica).
    pub redis_nodes: IntGaugeVec,
    warmup: IntCounterVec,
    hot_keys: IntGauge,
    hot_promotions: IntCounterVec,
    hot_demotions: IntCounter,
    hot_requests: IntCounterVec,
    hot_limited: IntCounterVec,
    invalidations: IntCounterVec,
    /// The retry journal of owed invalidations.
    pub(crate) journal: JournalMetrics,
    /// The invalidation stream's consumer.
    pub(crate) stream: StreamMetrics,
    /// The access log's writer.
    pub(crate) access_log: AccessLogMetrics,
    /// The stock gates' families (see [`StockFamilies::for_gate`]).
    pub(crate) stock: StockFamilies,
    /// Serialized writes' families (see [`SerializeFamilies::for_route`]).
    pub(crate) serialize: SerializeFamilies,
    purges: IntCounterVec,
    config_reloads: IntCounterVec,
    config_generation: IntGauge,
    config_info: IntGaugeVec,
    pub origin_in_flight: IntGauge,
    pub origin_queue_wait: Histogram,
    origin_max_concurrency: IntGauge,
    origin_max_rps: IntGauge,
    pub origin_buffered: IntGauge,
    origin_max_buffered: IntGauge,
    pub entry_decode_errors: IntCounter,
    pub rejected_requests: IntCounterVec,
    /// Routes a reload removed: their series are exported once more, then forgotten (see
    /// [`Metrics::retire_routes`]).
    retired_routes: Arc<Mutex<BTreeSet<String>>>,
    lock_events: IntCounterVec,
    pub lock_waiters: IntGauge,
    pub lock_wait: Histogram,
    fill_refused: IntCounterVec,
    stale_served: IntCounterVec,
    early_refreshes: IntCounterVec,
    background_refreshes: IntCounterVec,
    pub bus_subscribed: IntGauge,
    pub bus_resubscriptions: IntCounter,
    pub bus_events: IntCounter,
    pub marks_overflow: IntCounter,
    pub journal_failing: IntGauge,
    pub invalidations_held: IntGauge,
    connections_refused: IntCounterVec,
    connections_open: IntGaugeVec,
    connections_timed_out: IntCounterVec,
    lingering_closes: IntCounterVec,
    bloom_rejections: IntCounterVec,
    bloom_false_positives: IntCounterVec,
    bloom_items: IntGaugeVec,
    bloom_bits: IntGaugeVec,
    bloom_bytes: IntGaugeVec,
    bloom_fp_rate: GaugeVec,
    bloom_ready: IntGaugeVec,
    bloom_loads: IntCounterVec,
    bloom_load_failures: IntCounterVec,
    bloom_load_duration: HistogramVec,
    bloom_since_load: GaugeVec,
    bloom_skipped_lines: IntCounterVec,
    bloom_adds: IntCounterVec,
    bloom_add_failures: IntCounterVec,
}

// The per-request families, kept per proxy worker by `per_worker` (named here, with every
// other metric).
const REQUESTS: &str = "cacheguard_requests_total";
const REQUESTS_HELP: &str = "Requests answered, by route and outcome (the X-Cache value).";
const COMMANDS: &str = "cacheguard_request_redis_commands_total";
const COMMANDS_HELP: &str = "Redis commands sent for requests, by route and outcome: a \
    request's own, and for a request that led a fill, the fill's. Divided by \
    cacheguard_requests_total: commands per request.";
const DURATION: &str = "cacheguard_request_duration_seconds";
const DURATION_HELP: &str = "Time from request head to response head, by route.";

fn buckets_latency() -> Vec<f64> {
    vec![
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        5.0, 10.0,
    ]
}

/// The retry journal's metrics (see `consistency/journal.rs`).
#[derive(Clone, Debug)]
pub(crate) struct JournalMetrics {
    /// Pending records.
    pub(crate) depth: prometheus::IntGauge,
    /// Age of the oldest pending record (0 when empty).
    pub(crate) oldest_pending_seconds: prometheus::Gauge,
    /// Records journaled.
    pub(crate) appended: prometheus::IntCounter,
    /// Records retried successfully.
    pub(crate) applied: prometheus::IntCounter,
    /// Retry attempts that failed.
    pub(crate) retries: prometheus::IntCounter,
    /// Owed invalidations abandoned (could not be journaled; unreadable record).
    pub(crate) give_ups: prometheus::IntCounter,
    /// Records whose checksum did not match (skipped).
    pub(crate) corrupt: prometheus::IntCounter,
    pub(crate) fsync_seconds: prometheus::Histogram,
}

/// The invalidation stream consumer's metrics (see `consistency/stream.rs`).
#[derive(Clone, Debug)]
pub(crate) struct StreamMetrics {
    /// Entries handled, label `result`: `applied` | `malformed`.
    pub(crate) entries: IntCounterVec,
    /// Entries claimed from another consumer.
    pub(crate) claimed: IntCounter,
    /// The group's pending count (`XPENDING` summary), refreshed periodically.
    pub(crate) pending: IntGauge,
    /// Redis errors (reconnects).
    pub(crate) errors: IntCounter,
}

/// The access log's metrics (see `proxy/access_log.rs`): lines by what became of them.
#[derive(Clone, Debug)]
pub(crate) struct AccessLogMetrics {
    /// Written to the log's destination.
    pub(crate) written: IntCounter,
    /// Not queued: the channel to the writer was full.
    pub(crate) dropped: IntCounter,
    /// Queued, but the write failed (a full disk, a closed pipe).
    pub(crate) failed: IntCounter,
}

/// Hot-key metrics.
#[derive(Clone, Debug)]
pub(crate) struct HotMetrics {
    pub(crate) hot_keys: prometheus::IntGauge,
    pub(crate) promotions_local: prometheus::IntCounter,
    pub(crate) promotions_peer: prometheus::IntCounter,
    pub(crate) demotions: prometheus::IntCounter,
    pub(crate) served_l1: prometheus::IntCounter,
    pub(crate) served_backend: prometheus::IntCounter,
}

/// Who asked: the `source` label of the invalidation metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum InvalidationSource {
    Write,
    Purge,
    Stream,
    Retry,
}

impl InvalidationSource {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            InvalidationSource::Write => "write",
            InvalidationSource::Purge => "purge",
            InvalidationSource::Stream => "stream",
            InvalidationSource::Retry => "retry",
        }
    }
}

impl Metrics {
    /// Every metric, registered in a registry of its own: for unit tests, which then use
    /// exactly the names and labels production does.
    ///
    /// # Panics
    /// Never: a fresh registry has no family registered twice.
    #[cfg(test)]
    #[allow(clippy::expect_used)]
    pub(crate) fn unregistered() -> Self {
        Metrics::register(&Registry::new()).expect("a fresh registry")
    }

    /// Creates every metric family and registers it in `registry`.
    ///
    /// # Errors
    /// When a family is registered twice in the same registry.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let requests = Arc::new(per_worker::RequestMetrics::new(buckets_latency())?);
        let origin_requests = IntCounterVec::new(
            Opts::new(
                "cacheguard_origin_requests_total",
                "Requests sent to the origin, by route and status class.",
            ),
            &["route", "status"],
        )?;
        let origin_duration = HistogramVec::new(
            HistogramOpts::new(
                "cacheguard_origin_duration_seconds",
                "Origin request duration (head and, for cached routes, body), by route.",
            )
            .buckets(buckets_latency()),
            &["route"],
        )?;
        let shed = IntCounterVec::new(
            Opts::new(
                "cacheguard_shed_total",
                "Requests answered 503 by the origin guard (no slot within queue_timeout).",
            ),
            &["route"],
        )?;
        let revalidations = IntCounterVec::new(
            Opts::new(
                "cacheguard_revalidations_total",
                "Conditional fetches of a stored copy (If-None-Match / If-Modified-Since), by \
                 result: not_modified (refreshed by a 304), modified (replaced), failed.",
            ),
            &["route", "result"],
        )?;
        let uncacheable = IntCounterVec::new(
            Opts::new(
                "cacheguard_uncacheable_responses_total",
                "Origin answers on cached routes that were not stored (status, private, cookie).",
            ),
            &["route"],
        )?;
        let vary_variants = IntCounterVec::new(
            Opts::new(
                "cacheguard_vary_variants_stored_total",
                "Vary variants stored on freshness = \"origin\" routes: answers whose Vary \
                 names request headers the route does not key, stored under the request's \
                 own variant key by a fill that found none stored (each new one is a \
                 variant in its path's budget: see cacheguard_new_variants_total).",
            ),
            &["route"],
        )?;
        let new_variants = IntCounterVec::new(
            Opts::new(
                "cacheguard_new_variants_total",
                "Misses on a query or vary variant new in its path's window, by outcome: \
                 budget (within max_variants: fetched and cached), repeat (beyond it, asked \
                 for before: fetched and cached), uncached (beyond it, a first ask: fetched, \
                 not stored), refused (beyond it and over variant_overflow_rate: 429).",
            ),
            &["route", "outcome"],
        )?;
        let origin_retries = IntCounterVec::new(
            Opts::new(
                "cacheguard_origin_retries_total",
                "Cached fetches sent a second time on a new connection because their pooled \
                 connection failed after the request was written, before any answer.",
            ),
            &["route"],
        )?;
        let origin_off_worker = IntCounterVec::new(
            Opts::new(
                "cacheguard_origin_requests_off_worker_total",
                "Origin requests sent from another thread than the proxy worker whose event \
                 loop drives their connection, by reason: not_a_worker (sent from a thread \
                 that is no proxy worker: a warm-up, and the fills it starts; they keep a \
                 pool of their own), other_worker (sent by a proxy worker on a connection \
                 another thread opened and drives: each exchange then wakes that thread and \
                 back; 0 while every worker keeps its own pool).",
            ),
            &["reason"],
        )?;
        let oversized = IntCounterVec::new(
            Opts::new(
                "cacheguard_oversized_responses_total",
                "Origin answers larger than max_entry_bytes, served but not stored.",
            ),
            &["route"],
        )?;
        let version_unparsed = IntCounterVec::new(
            Opts::new(
                "cacheguard_version_unparsed_total",
                "Origin answers on a route with `version` whose version header was missing \
                 or did not parse: never trusted (a fill over a floor is refused, a write \
                 sets no floor).",
            ),
            &["route"],
        )?;
        let coalesced = IntCounterVec::new(
            Opts::new(
                "cacheguard_coalesced_requests_total",
                "Requests that waited for another request's origin fetch in this process \
                 instead of their own, counted when they began waiting (those answered by it \
                 are cacheguard_requests_total{outcome=\"coalesced\"}).",
            ),
            &["route"],
        )?;
        let l1_entries = IntGauge::new("cacheguard_l1_entries", "Entries in the in-process L1.")?;
        let l1_bytes = IntGauge::new(
            "cacheguard_l1_bytes",
            "Weighted size of the in-process L1 in bytes.",
        )?;
        let redis_up = IntGauge::new(
            "cacheguard_redis_up",
            "1 when Redis answers, 0 when cacheguard runs degraded (or no Redis is configured).",
        )?;
        let redis_errors = IntCounterVec::new(
            Opts::new(
                "cacheguard_redis_errors_total",
                "Redis commands that failed or timed out, by operation.",
            ),
            &["op"],
        )?;
        let redis_slot_migrating = IntCounterVec::new(
            Opts::new(
                "cacheguard_redis_slot_migrating_total",
                "Redis Cluster commands given up because their hash slot was being migrated \
                 (TRYAGAIN, or ASK/MOVED, after every retry), by operation: Redis answered, so \
                 they are neither errors nor failures toward the breaker.",
            ),
            &["op"],
        )?;
        let redis_off_worker = IntCounterVec::new(
            Opts::new(
                "cacheguard_redis_commands_off_worker_total",
                "Redis commands a proxy worker sent through the Redis thread instead of on its \
                 own connection, by operation and reason: fallback (no connection of its own to \
                 use), strict (a serialized write's lock renewal or release), replicated (a \
                 lock acquire followed by WAIT), bulk (a large transfer).",
            ),
            &["op", "reason"],
        )?;
        let redis_transitions = IntCounter::new(
            "cacheguard_redis_state_changes_total",
            "Times Redis went from up to down or back.",
        )?;
        let redis_command_duration = HistogramVec::new(
            HistogramOpts::new(
                "cacheguard_redis_command_duration_seconds",
                "Time Redis commands took (answered or timed out), by operation.",
            )
            .buckets(buckets_latency()),
            &["op"],
        )?;
        let redis_breaker_open = IntGauge::new(
            "cacheguard_redis_breaker_open",
            "1 while the Redis circuit breaker is open (requests skip Redis entirely).",
        )?;
        let redis_breaker_transitions = IntCounterVec::new(
            Opts::new(
                "cacheguard_redis_breaker_transitions_total",
                "Redis circuit breaker transitions, by the state entered (open, closed).",
            ),
            &["to"],
        )?;
        let redis_restarts = IntCounter::new(
            "cacheguard_redis_restarts_total",
            "Times Redis came back with a new run id (restarted, its data possibly gone).",
        )?;
        let redis_primary_changes = IntCounter::new(
            "cacheguard_redis_primary_changes_total",
            "Times cacheguard followed Sentinel to a new Redis primary.",
        )?;
        let redis_readonly_retries = IntCounter::new(
            "cacheguard_redis_readonly_retries_total",
            "Commands that hit a demoted primary (READONLY) and were retried once after re-resolving.",
        )?;
        let redis_nodes = IntGaugeVec::new(
            Opts::new(
                "cacheguard_redis_nodes",
                "Redis nodes in the topology found at start or after a failover, by role (primary, replica).",
            ),
            &["role"],
        )?;
        let warmup = IntCounterVec::new(
            Opts::new(
                "cacheguard_warmup_requests_total",
                "Warm-up paths fetched at start, by route and result (filled, cached, failed, skipped).",
            ),
            &["route", "result"],
        )?;
        for to in ["open", "closed"] {
            redis_breaker_transitions.with_label_values(&[to]);
        }
        let hot_keys = IntGauge::new(
            "cacheguard_hot_keys",
            "Keys currently hot on this instance (served from L1).",
        )?;
        let hot_promotions = IntCounterVec::new(
            Opts::new(
                "cacheguard_hot_key_promotions_total",
                "Keys promoted to hot, by where they were found hot (local, peer).",
            ),
            &["from"],
        )?;
        let hot_demotions = IntCounter::new(
            "cacheguard_hot_key_demotions_total",
            "Hot keys that cooled down.",
        )?;
        let hot_requests = IntCounterVec::new(
            Opts::new(
                "cacheguard_hot_key_requests_total",
                "Requests for hot keys, by where they were served from (l1, backend).",
            ),
            &["tier"],
        )?;
        let hot_limited = IntCounterVec::new(
            Opts::new(
                "cacheguard_hot_key_limited_total",
                "Hot-key requests over max_backend_rps_per_key, by route (answered from L1 or 429).",
            ),
            &["route"],
        )?;
        let invalidations = IntCounterVec::new(
            Opts::new(
                "cacheguard_invalidations_total",
                "Invalidations (base keys and tags), by source (write, purge, stream, retry) and result (done; journaled: Redis unavailable, retried from the journal; held: the journal could not be written, held in memory and retried; lost: neither).",
            ),
            &["source", "result"],
        )?;
        for from in ["local", "peer"] {
            hot_promotions.with_label_values(&[from]);
        }
        for tier in ["l1", "backend"] {
            hot_requests.with_label_values(&[tier]);
        }
        for source in ["write", "purge", "stream", "retry"] {
            for result in ["done", "journaled", "held", "lost"] {
                invalidations.with_label_values(&[source, result]);
            }
        }
        registry.register(Box::new(hot_keys.clone()))?;
        registry.register(Box::new(hot_promotions.clone()))?;
        registry.register(Box::new(hot_demotions.clone()))?;
        registry.register(Box::new(hot_requests.clone()))?;
        registry.register(Box::new(hot_limited.clone()))?;
        registry.register(Box::new(invalidations.clone()))?;
        let journal = JournalMetrics {
            depth: IntGauge::new(
                "cacheguard_journal_depth",
                "Invalidations owed to Redis, waiting in the journal.",
            )?,
            oldest_pending_seconds: Gauge::new(
                "cacheguard_journal_oldest_pending_seconds",
                "Age of the oldest invalidation waiting in the journal (0 when empty).",
            )?,
            appended: IntCounter::new(
                "cacheguard_journal_appended_total",
                "Invalidations written to the journal because Redis could not take them.",
            )?,
            applied: IntCounter::new(
                "cacheguard_journal_applied_total",
                "Journaled invalidations that reached Redis on a retry.",
            )?,
            retries: IntCounter::new(
                "cacheguard_journal_retries_total",
                "Retries of journaled invalidations that failed (Redis still unavailable).",
            )?,
            give_ups: IntCounter::new(
                "cacheguard_journal_give_ups_total",
                "Owed invalidations abandoned: the journal could not be written, or a record was unreadable. Should stay 0.",
            )?,
            corrupt: IntCounter::new(
                "cacheguard_journal_corrupt_records_total",
                "Journal records skipped on open because their checksum did not match (a \
                 damaged file); each is also a give-up. Should stay 0.",
            )?,
            fsync_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "cacheguard_journal_fsync_seconds",
                    "Time of one journal sync (group commit).",
                )
                .buckets(vec![
                    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0,
                ]),
            )?,
        };
        registry.register(Box::new(journal.depth.clone()))?;
        registry.register(Box::new(journal.oldest_pending_seconds.clone()))?;
        registry.register(Box::new(journal.appended.clone()))?;
        registry.register(Box::new(journal.applied.clone()))?;
        registry.register(Box::new(journal.retries.clone()))?;
        registry.register(Box::new(journal.give_ups.clone()))?;
        registry.register(Box::new(journal.corrupt.clone()))?;
        registry.register(Box::new(journal.fsync_seconds.clone()))?;
        let stream = StreamMetrics {
            entries: IntCounterVec::new(
                Opts::new(
                    "cacheguard_stream_entries_total",
                    "Invalidation stream entries handled by this instance, by result (applied, malformed).",
                ),
                &["result"],
            )?,
            claimed: IntCounter::new(
                "cacheguard_stream_claimed_total",
                "Invalidation stream entries claimed from another consumer that left them unacknowledged.",
            )?,
            pending: IntGauge::new(
                "cacheguard_stream_pending",
                "Entries delivered to the consumer group but not yet acknowledged.",
            )?,
            errors: IntCounter::new(
                "cacheguard_stream_errors_total",
                "Redis errors of the invalidation stream's consumer.",
            )?,
        };
        for result in ["applied", "malformed"] {
            stream.entries.with_label_values(&[result]);
        }
        registry.register(Box::new(stream.entries.clone()))?;
        registry.register(Box::new(stream.claimed.clone()))?;
        registry.register(Box::new(stream.pending.clone()))?;
        registry.register(Box::new(stream.errors.clone()))?;
        let access_log_lines = IntCounterVec::new(
            Opts::new(
                "cacheguard_access_log_lines_total",
                "Access log lines, by result (written; dropped: the channel to the writer was full, the request did not wait; failed: the write failed).",
            ),
            &["result"],
        )?;
        let access_log = AccessLogMetrics {
            written: access_log_lines.with_label_values(&["written"]),
            dropped: access_log_lines.with_label_values(&["dropped"]),
            failed: access_log_lines.with_label_values(&["failed"]),
        };
        registry.register(Box::new(access_log_lines))?;
        let stock = StockFamilies::register(registry)?;
        let serialize = SerializeFamilies::register(registry)?;
        let purges = IntCounterVec::new(
            Opts::new(
                "cacheguard_purges_total",
                "Purge API requests, by result (ok, unauthorized, forbidden, bad_request, rate_limited: over admin.purge_rate, answered 429).",
            ),
            &["result"],
        )?;
        for result in [
            "ok",
            "unauthorized",
            "forbidden",
            "bad_request",
            "rate_limited",
        ] {
            purges.with_label_values(&[result]);
        }
        registry.register(Box::new(purges.clone()))?;
        let config_reloads = IntCounterVec::new(
            Opts::new(
                "cacheguard_config_reloads_total",
                "Config reloads, by result (ok; partial: applied except keys that need a restart; invalid: refused, the old config keeps serving; refused: valid but not applicable without a restart).",
            ),
            &["result"],
        )?;
        for result in ["ok", "partial", "invalid", "refused"] {
            config_reloads.with_label_values(&[result]);
        }
        let config_generation = IntGauge::new(
            "cacheguard_config_generation",
            "Generation of the config in effect: 1 at start, +1 per applied reload.",
        )?;
        let config_info = IntGaugeVec::new(
            Opts::new(
                "cacheguard_config_info",
                "1 for the config in effect, labelled with the hash of its file text.",
            ),
            &["hash"],
        )?;
        registry.register(Box::new(config_reloads.clone()))?;
        registry.register(Box::new(config_generation.clone()))?;
        registry.register(Box::new(config_info.clone()))?;
        registry.register(Box::new(redis_command_duration.clone()))?;
        registry.register(Box::new(redis_breaker_open.clone()))?;
        registry.register(Box::new(redis_breaker_transitions.clone()))?;
        registry.register(Box::new(redis_restarts.clone()))?;
        registry.register(Box::new(redis_primary_changes.clone()))?;
        registry.register(Box::new(redis_readonly_retries.clone()))?;
        registry.register(Box::new(redis_nodes.clone()))?;
        registry.register(Box::new(warmup.clone()))?;
        let origin_in_flight = IntGauge::new(
            "cacheguard_origin_in_flight",
            "Origin requests holding an origin guard slot.",
        )?;
        let origin_max_concurrency = IntGauge::new(
            "cacheguard_origin_max_concurrency",
            "The origin guard's configured upstream.max_concurrency.",
        )?;
        let origin_max_rps = IntGauge::new(
            "cacheguard_origin_max_rps",
            "The origin guard's configured upstream.max_rps (0 = no rate cap).",
        )?;
        registry.register(Box::new(origin_max_concurrency.clone()))?;
        registry.register(Box::new(origin_max_rps.clone()))?;
        let origin_buffered = IntGauge::new(
            "cacheguard_origin_buffered_bytes",
            "Bytes reserved for origin answers held in memory: fetches in progress \
             (max_entry_bytes each) and answers not yet sent to every client.",
        )?;
        let origin_max_buffered = IntGauge::new(
            "cacheguard_origin_max_buffered_bytes",
            "The origin guard's configured upstream.max_buffered_bytes.",
        )?;
        registry.register(Box::new(origin_buffered.clone()))?;
        registry.register(Box::new(origin_max_buffered.clone()))?;
        let origin_queue_wait = Histogram::with_opts(
            HistogramOpts::new(
                "cacheguard_origin_queue_wait_seconds",
                "Time requests waited for an origin guard slot.",
            )
            .buckets(buckets_latency()),
        )?;
        let entry_decode_errors = IntCounter::new(
            "cacheguard_entry_decode_errors_total",
            "L2 values refused as they were read: damaged (cut, padded, a byte changed: their length or checksum disagrees), of a format before version 8 (no checksum), not an entry at all, or the whole entry of another cache key (copied under this one's name). Each is a miss, and the next fill overwrites it.",
        )?;
        let rejected_requests = IntCounterVec::new(
            Opts::new(
                "cacheguard_rejected_requests_total",
                "Client requests refused before proxying, by reason.",
            ),
            &["reason"],
        )?;

        let lock_events = IntCounterVec::new(
            Opts::new(
                "cacheguard_lock_events_total",
                "Distributed fill lock events, by outcome.",
            ),
            &["outcome"],
        )?;
        let lock_waiters = IntGauge::new(
            "cacheguard_lock_waiters",
            "Requests waiting on another instance's fetch right now.",
        )?;
        let lock_wait = Histogram::with_opts(
            HistogramOpts::new(
                "cacheguard_lock_wait_seconds",
                "Time a request waited on another instance's fetch.",
            )
            .buckets(buckets_latency()),
        )?;
        let fill_refused = IntCounterVec::new(
            Opts::new(
                "cacheguard_fill_refused_total",
                "Fetched answers that were not stored, by reason: refused by the fill script \
                 (generation, lock_taken, quarantine), older than the key's version floor \
                 (older_version: neither stored nor served, fetched again), or by their own \
                 Vary (vary).",
            ),
            &["reason"],
        )?;
        let stale_served = IntCounterVec::new(
            Opts::new(
                "cacheguard_stale_served_total",
                "Stale copies served (stale-while-revalidate, stale-if-error), by route.",
            ),
            &["route"],
        )?;
        let early_refreshes = IntCounterVec::new(
            Opts::new(
                "cacheguard_early_refreshes_total",
                "Fresh entries refreshed early by probabilistic early expiration, by route.",
            ),
            &["route"],
        )?;
        let background_refreshes = IntCounterVec::new(
            Opts::new(
                "cacheguard_background_refreshes_total",
                "Refreshes run in the background while a stale or early copy was served.",
            ),
            &["route"],
        )?;
        let bus_subscribed = IntGauge::new(
            "cacheguard_event_bus_subscribed",
            "1 while the pub/sub event subscription is live.",
        )?;
        let bus_resubscriptions = IntCounter::new(
            "cacheguard_event_bus_resubscriptions_total",
            "Times the event subscription was re-established after a loss.",
        )?;
        let connections_refused = IntCounterVec::new(
            Opts::new(
                "cacheguard_connections_refused_total",
                "Connections closed as soon as they were accepted because the listener had \
                 its maximum open (server.max_connections for the proxy).",
            ),
            &["listener"],
        )?;
        let connections_open = IntGaugeVec::new(
            Opts::new(
                "cacheguard_connections_open",
                "Connections open on the listener.",
            ),
            &["listener"],
        )?;
        let connections_timed_out = IntCounterVec::new(
            Opts::new(
                "cacheguard_connections_timed_out_total",
                "Connections closed for a timeout: reason keepalive_timeout (idle between \
                 requests for server.keepalive_timeout) or header_read_timeout (no request \
                 within it of accept, or a request head begun and not whole within it).",
            ),
            &["listener", "reason"],
        )?;
        let lingering_closes = IntCounterVec::new(
            Opts::new(
                "cacheguard_lingering_closes_total",
                "Connections closed by lingering (write side shut down, what the client \
                 still sent read and discarded), by how it ended: closed (the client closed \
                 its side), lingering_timeout (a read waited that long), lingering_time \
                 (the whole bound), error.",
            ),
            &["listener", "end"],
        )?;
        let journal_failing = IntGauge::new(
            "cacheguard_journal_failing",
            "1 while the retry journal cannot be written and owed invalidations are held in \
             memory instead (retried until Redis or the journal takes them).",
        )?;
        let invalidations_held = IntGauge::new(
            "cacheguard_invalidations_held",
            "Owed invalidations held in memory because the journal could not be written.",
        )?;
        let marks_overflow = IntCounter::new(
            "cacheguard_invalidation_marks_overflow_total",
            "Local invalidation marks dropped because their table was full: L1 copies known \
             valid only from before them are checked against Redis again, and fills that \
             began before them are not kept in L1.",
        )?;
        let bus_events = IntCounter::new(
            "cacheguard_event_bus_messages_total",
            "Messages received on the event bus.",
        )?;
        let bloom = |name: &str, help: &str| Opts::new(name, help);
        let bloom_rejections = IntCounterVec::new(
            bloom(
                "cacheguard_bloom_rejections_total",
                "Requests answered at once because the id is not in the Bloom filter, by filter.",
            ),
            &["filter"],
        )?;
        let bloom_false_positives = IntCounterVec::new(
            bloom(
                "cacheguard_bloom_false_positives_total",
                "Requests that passed a loaded Bloom filter and got 404 from the origin.",
            ),
            &["filter"],
        )?;
        let bloom_items = IntGaugeVec::new(
            bloom(
                "cacheguard_bloom_items",
                "Ids in the Bloom filter: those loaded, plus later adds that set a new bit.",
            ),
            &["filter"],
        )?;
        let bloom_bits = IntGaugeVec::new(
            bloom("cacheguard_bloom_bits", "Size of the Bloom filter in bits."),
            &["filter"],
        )?;
        let bloom_bytes = IntGaugeVec::new(
            bloom(
                "cacheguard_bloom_bytes",
                "Memory of the Bloom filter's bitmap in bytes.",
            ),
            &["filter"],
        )?;
        let bloom_fp_rate = GaugeVec::new(
            bloom(
                "cacheguard_bloom_estimated_fp_rate",
                "Estimated false-positive rate of the Bloom filter at its current item count.",
            ),
            &["filter"],
        )?;
        let bloom_ready = IntGaugeVec::new(
            bloom(
                "cacheguard_bloom_ready",
                "1 when the Bloom filter is loaded and rejecting, 0 while it rejects nothing.",
            ),
            &["filter"],
        )?;
        let bloom_loads = IntCounterVec::new(
            bloom(
                "cacheguard_bloom_loads_total",
                "Successful Bloom filter loads, by filter and where from (source, snapshot).",
            ),
            &["filter", "from"],
        )?;
        let bloom_load_failures = IntCounterVec::new(
            bloom(
                "cacheguard_bloom_load_failures_total",
                "Bloom filter source loads that failed (the previous filter kept serving).",
            ),
            &["filter"],
        )?;
        let bloom_load_duration = HistogramVec::new(
            HistogramOpts::new(
                "cacheguard_bloom_load_duration_seconds",
                "Time one Bloom filter source load took, by filter.",
            )
            .buckets(vec![
                0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
            ]),
            &["filter"],
        )?;
        let bloom_since_load = GaugeVec::new(
            bloom(
                "cacheguard_bloom_seconds_since_load",
                "Seconds since the Bloom filter's last successful load (since start if never).",
            ),
            &["filter"],
        )?;
        let bloom_skipped_lines = IntCounterVec::new(
            bloom(
                "cacheguard_bloom_skipped_lines_total",
                "Malformed source lines skipped while loading a Bloom filter.",
            ),
            &["filter"],
        )?;
        let bloom_adds = IntCounterVec::new(
            bloom(
                "cacheguard_bloom_adds_total",
                "Ids added to a Bloom filter after its load, by filter and how they arrived.",
            ),
            &["filter", "via"],
        )?;
        let bloom_add_failures = IntCounterVec::new(
            bloom(
                "cacheguard_bloom_add_failures_total",
                "Creates whose id could not be taken (no_id) or shared through Redis (redis).",
            ),
            &["filter", "reason"],
        )?;
        for family in [
            Box::new(bloom_rejections.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(bloom_false_positives.clone()),
            Box::new(bloom_items.clone()),
            Box::new(bloom_bits.clone()),
            Box::new(bloom_bytes.clone()),
            Box::new(bloom_fp_rate.clone()),
            Box::new(bloom_ready.clone()),
            Box::new(bloom_loads.clone()),
            Box::new(bloom_load_failures.clone()),
            Box::new(bloom_load_duration.clone()),
            Box::new(bloom_since_load.clone()),
            Box::new(bloom_skipped_lines.clone()),
            Box::new(bloom_adds.clone()),
            Box::new(bloom_add_failures.clone()),
        ] {
            registry.register(family)?;
        }

        for event in LockEvent::ALL {
            lock_events.with_label_values(&[event.as_str()]);
        }
        for refusal in [
            FillRefusal::Generation,
            FillRefusal::LockTaken,
            FillRefusal::Quarantine,
            FillRefusal::OlderVersion,
            FillRefusal::Vary,
        ] {
            fill_refused.with_label_values(&[refusal.as_str()]);
        }

        registry.register(Box::new(lock_events.clone()))?;
        registry.register(Box::new(lock_waiters.clone()))?;
        registry.register(Box::new(lock_wait.clone()))?;
        registry.register(Box::new(fill_refused.clone()))?;
        registry.register(Box::new(stale_served.clone()))?;
        registry.register(Box::new(early_refreshes.clone()))?;
        registry.register(Box::new(background_refreshes.clone()))?;
        registry.register(Box::new(bus_subscribed.clone()))?;
        registry.register(Box::new(bus_resubscriptions.clone()))?;
        registry.register(Box::new(bus_events.clone()))?;
        registry.register(Box::new(marks_overflow.clone()))?;
        registry.register(Box::new(journal_failing.clone()))?;
        registry.register(Box::new(invalidations_held.clone()))?;
        registry.register(Box::new(connections_refused.clone()))?;
        registry.register(Box::new(connections_open.clone()))?;
        registry.register(Box::new(connections_timed_out.clone()))?;
        registry.register(Box::new(lingering_closes.clone()))?;
        registry.register(Box::new(per_worker::Registered(Arc::clone(&requests))))?;
        registry.register(Box::new(origin_requests.clone()))?;
        registry.register(Box::new(origin_duration.clone()))?;
        registry.register(Box::new(shed.clone()))?;
        registry.register(Box::new(uncacheable.clone()))?;
        registry.register(Box::new(vary_variants.clone()))?;
        registry.register(Box::new(revalidations.clone()))?;
        registry.register(Box::new(oversized.clone()))?;
        registry.register(Box::new(version_unparsed.clone()))?;
        registry.register(Box::new(new_variants.clone()))?;
        registry.register(Box::new(origin_retries.clone()))?;
        registry.register(Box::new(origin_off_worker.clone()))?;
        registry.register(Box::new(coalesced.clone()))?;
        registry.register(Box::new(l1_entries.clone()))?;
        registry.register(Box::new(l1_bytes.clone()))?;
        registry.register(Box::new(redis_up.clone()))?;
        registry.register(Box::new(redis_errors.clone()))?;
        registry.register(Box::new(redis_slot_migrating.clone()))?;
        registry.register(Box::new(redis_off_worker.clone()))?;
        registry.register(Box::new(redis_transitions.clone()))?;
        registry.register(Box::new(origin_in_flight.clone()))?;
        registry.register(Box::new(origin_queue_wait.clone()))?;
        registry.register(Box::new(entry_decode_errors.clone()))?;
        registry.register(Box::new(rejected_requests.clone()))?;

        // Pre-create the Redis error series so dashboards see zeros, not gaps.
        for op in [
            RedisOp::Get,
            RedisOp::Set,
            RedisOp::Ping,
            RedisOp::Lock,
            RedisOp::Renew,
            RedisOp::Fill,
            RedisOp::Release,
            RedisOp::Bloom,
            RedisOp::Publish,
            RedisOp::Invalidate,
            RedisOp::Tag,
            RedisOp::Stock,
            RedisOp::Serialize,
        ] {
            redis_errors.with_label_values(&[op.as_str()]);
            redis_slot_migrating.with_label_values(&[op.as_str()]);
            redis_off_worker.with_label_values(&[op.as_str(), RedisOffWorker::Fallback.as_str()]);
        }
        for reason in REJECTED_REASONS {
            rejected_requests.with_label_values(&[reason]);
        }
        for reason in [OffWorker::NotAWorker, OffWorker::OtherWorker] {
            origin_off_worker.with_label_values(&[reason.as_str()]);
        }

        Ok(Metrics {
            requests,
            origin_requests,
            origin_duration,
            shed,
            uncacheable,
            vary_variants,
            revalidations,
            oversized,
            version_unparsed,
            new_variants,
            origin_retries,
            origin_off_worker,
            coalesced,
            l1_entries,
            l1_bytes,
            redis_up,
            redis_errors,
            redis_slot_migrating,
            redis_off_worker,
            redis_transitions,
            redis_command_duration,
            redis_breaker_open,
            redis_breaker_transitions,
            redis_restarts,
            redis_primary_changes,
            redis_readonly_retries,
            redis_nodes,
            warmup,
            hot_keys,
            hot_promotions,
            hot_demotions,
            hot_requests,
            hot_limited,
            invalidations,
            journal,
            stream,
            access_log,
            stock,
            serialize,
            purges,
            config_reloads,
            config_generation,
            config_info,
            origin_in_flight,
            origin_queue_wait,
            origin_max_concurrency,
            origin_max_rps,
            origin_buffered,
            origin_max_buffered,
            entry_decode_errors,
            rejected_requests,
            retired_routes: Arc::default(),
            lock_events,
            lock_waiters,
            lock_wait,
            fill_refused,
            stale_served,
            early_refreshes,
            background_refreshes,
            bus_subscribed,
            bus_resubscriptions,
            bus_events,
            marks_overflow,
            journal_failing,
            invalidations_held,
            connections_refused,
            connections_open,
            connections_timed_out,
            lingering_closes,
            bloom_rejections,
            bloom_false_positives,
            bloom_items,
            bloom_bits,
            bloom_bytes,
            bloom_fp_rate,
            bloom_ready,
            bloom_loads,
            bloom_load_failures,
            bloom_load_duration,
            bloom_since_load,
            bloom_skipped_lines,
            bloom_adds,
            bloom_add_failures,
        })
    }

    /// The handles of `cacheguard_origin_requests_off_worker_total`, for the upstream client.
    pub(crate) fn origin_off_worker(&self) -> OffWorkerMetrics {
        let series =
            |reason: OffWorker| self.origin_off_worker.with_label_values(&[reason.as_str()]);
        OffWorkerMetrics {
            not_a_worker: series(OffWorker::NotAWorker),
            other_worker: series(OffWorker::OtherWorker),
        }
    }

    /// Resolves one Bloom filter's handles once, at config load.
    pub fn for_filter(&self, filter: &str) -> FilterMetrics {
        let f = &[filter];
        let via = |v: AddVia| self.bloom_adds.with_label_values(&[filter, v.as_str()]);
        FilterMetrics {
            rejections: self.bloom_rejections.with_label_values(f),
            false_positives: self.bloom_false_positives.with_label_values(f),
            items: self.bloom_items.with_label_values(f),
            bits: self.bloom_bits.with_label_values(f),
            bytes: self.bloom_bytes.with_label_values(f),
            fp_rate: self.bloom_fp_rate.with_label_values(f),
            ready: self.bloom_ready.with_label_values(f),
            loads_source: self.bloom_loads.with_label_values(&[filter, "source"]),
            loads_snapshot: self.bloom_loads.with_label_values(&[filter, "snapshot"]),
            load_failures: self.bloom_load_failures.with_label_values(f),
            load_duration: self.bloom_load_duration.with_label_values(f),
            since_load: self.bloom_since_load.with_label_values(f),
            skipped_lines: self.bloom_skipped_lines.with_label_values(f),
            adds: [via(AddVia::Write), via(AddVia::Event), via(AddVia::Resync)],
            add_failures_no_id: self
                .bloom_add_failures
                .with_label_values(&[filter, "no_id"]),
            add_failures_redis: self
                .bloom_add_failures
                .with_label_values(&[filter, "redis"]),
        }
    }

    pub fn lock_event(&self, event: LockEvent) {
        self.lock_events.with_label_values(&[event.as_str()]).inc();
    }

    pub fn fill_refused(&self, reason: FillRefusal) {
        self.fill_refused
            .with_label_values(&[reason.as_str()])
            .inc();
    }

    /// Gives each of `workers` proxy workers its own copies of the per-request metrics of
    /// the routes resolved from now on (see [`per_worker`]); before, every thread shares one.
    pub fn set_workers(&self, workers: usize) {
        self.requests.set_workers(workers);
    }

    /// Resolves every per-route handle once (at config load), so requests only touch atomics.
    pub fn for_route(&self, route: &str) -> Arc<RouteMetrics> {
        // Under the lock, so a scrape forgetting retired routes cannot remove a series this
        // route's new handles were just resolved to.
        let mut retired = self
            .retired_routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        retired.remove(route);
        Arc::new(RouteMetrics {
            requests: self.requests.route(route),
            origin: OriginStatus::ALL
                .map(|s| self.origin_requests.with_label_values(&[route, s.as_str()])),
            origin_duration: self.origin_duration.with_label_values(&[route]),
            shed: self.shed.with_label_values(&[route]),
            uncacheable: self.uncacheable.with_label_values(&[route]),
            vary_variants_stored: self.vary_variants.with_label_values(&[route]),
            revalidations: Revalidation::ALL
                .map(|r| self.revalidations.with_label_values(&[route, r.as_str()])),
            refused_vary: self
                .fill_refused
                .with_label_values(&[FillRefusal::Vary.as_str()]),
            refused_older: self
                .fill_refused
                .with_label_values(&[FillRefusal::OlderVersion.as_str()]),
            oversized: self.oversized.with_label_values(&[route]),
            version_unparsed: self.version_unparsed.with_label_values(&[route]),
            new_variants: NewVariant::ALL
                .map(|v| self.new_variants.with_label_values(&[route, v.as_str()])),
            origin_retries: self.origin_retries.with_label_values(&[route]),
            coalesced: self.coalesced.with_label_values(&[route]),
            stale_served: self.stale_served.with_label_values(&[route]),
            early_refreshes: self.early_refreshes.with_label_values(&[route]),
            background_refreshes: self.background_refreshes.with_label_values(&[route]),
            hot_limited: self.hot_limited.with_label_values(&[route]),
        })
    }

    /// Creates the warm-up series of `route` at 0 (a route with `warmup` configured).
    pub fn warmup_route(&self, route: &str) {
        for result in WARMUP_RESULTS {
            self.warmup.with_label_values(&[route, result]);
        }
    }

    /// `routes` were removed by a reload: their series stay until the next scrape has
    /// exported their last values ([`Metrics::forget_retired_routes`]), then go, so a
    /// renamed route does not leave a frozen series behind for ever. A route added back
    /// before that scrape keeps its series.
    pub fn retire_routes<'a>(&self, routes: impl IntoIterator<Item = &'a str>) {
        self.retired_routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(routes.into_iter().map(str::to_owned));
    }

    /// Removes the series of the routes retired since the last call; called right after a
    /// scrape was encoded.
    pub fn forget_retired_routes(&self) {
        let mut retired = self
            .retired_routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for route in std::mem::take(&mut *retired) {
            let r = route.as_str();
            // A series that never existed is no error: ignored.
            self.requests.forget(r);
            for status in OriginStatus::ALL {
                let _ = self
                    .origin_requests
                    .remove_label_values(&[r, status.as_str()]);
            }
            for result in Revalidation::ALL {
                let _ = self
                    .revalidations
                    .remove_label_values(&[r, result.as_str()]);
            }
            for outcome in NewVariant::ALL {
                let _ = self
                    .new_variants
                    .remove_label_values(&[r, outcome.as_str()]);
            }
            for result in WARMUP_RESULTS {
                let _ = self.warmup.remove_label_values(&[r, result]);
            }
            let _ = self.origin_duration.remove_label_values(&[r]);
            for family in [
                &self.shed,
                &self.uncacheable,
                &self.vary_variants,
                &self.oversized,
                &self.version_unparsed,
                &self.origin_retries,
                &self.coalesced,
                &self.stale_served,
                &self.early_refreshes,
                &self.background_refreshes,
                &self.hot_limited,
            ] {
                let _ = family.remove_label_values(&[r]);
            }
        }
    }

    pub fn redis_latency(&self, op: RedisOp, seconds: f64) {
        self.redis_command_duration
            .with_label_values(&[op.as_str()])
            .observe(seconds);
    }

    pub fn breaker_transition(&self, open: bool) {
        self.redis_breaker_open.set(i64::from(open));
        self.redis_breaker_transitions
            .with_label_values(&[if open { "open" } else { "closed" }])
            .inc();
    }

    pub(crate) fn hot_metrics(&self) -> HotMetrics {
        HotMetrics {
            hot_keys: self.hot_keys.clone(),
            promotions_local: self.hot_promotions.with_label_values(&["local"]),
            promotions_peer: self.hot_promotions.with_label_values(&["peer"]),
            demotions: self.hot_demotions.clone(),
            served_l1: self.hot_requests.with_label_values(&["l1"]),
            served_backend: self.hot_requests.with_label_values(&["backend"]),
        }
    }

    pub(crate) fn invalidation(&self, source: InvalidationSource, result: &str, count: usize) {
        if count > 0 {
            self.invalidations
                .with_label_values(&[source.as_str(), result])
                .inc_by(count as u64);
        }
    }

    /// The origin guard's configured caps (at start and after each reload).
    pub fn origin_caps(&self, upstream: &crate::config::UpstreamConfig) {
        self.origin_max_concurrency
            .set(i64::try_from(upstream.max_concurrency).unwrap_or(i64::MAX));
        self.origin_max_rps.set(i64::from(upstream.max_rps));
        self.origin_max_buffered
            .set(i64::try_from(upstream.max_buffered_bytes).unwrap_or(i64::MAX));
    }

    pub fn config_reload(&self, result: &str) {
        self.config_reloads.with_label_values(&[result]).inc();
    }

    /// The config of `generation` (file text hash `hash`) is in effect.
    pub fn config_loaded(&self, generation: u64, hash: u64) {
        self.config_generation
            .set(i64::try_from(generation).unwrap_or(i64::MAX));
        self.config_info.reset();
        self.config_info
            .with_label_values(&[&format!("{hash:016x}")])
            .set(1);
    }

    pub fn purge(&self, result: &str) {
        self.purges.with_label_values(&[result]).inc();
    }

    pub fn warmup(&self, route: &str, result: &str) {
        self.warmup.with_label_values(&[route, result]).inc();
    }

    pub fn redis_error(&self, op: RedisOp) {
        self.redis_errors.with_label_values(&[op.as_str()]).inc();
    }

    /// A cluster command given up while its hash slot was being migrated.
    pub fn redis_slot_migrating(&self, op: RedisOp) {
        self.redis_slot_migrating
            .with_label_values(&[op.as_str()])
            .inc();
    }

    /// A command a proxy worker sent through the Redis thread (see [`RedisOffWorker`]).
    pub fn redis_off_worker(&self, op: RedisOp, reason: RedisOffWorker) {
        self.redis_off_worker
            .with_label_values(&[op.as_str(), reason.as_str()])
            .inc();
    }

    /// Origin requests so far, every route and status class summed (routes a reload removed
    /// included), for the status page's origin rate.
    pub fn origin_requests_total(&self) -> u64 {
        use prometheus::core::Collector as _;
        let sum: f64 = self
            .origin_requests
            .collect()
            .iter()
            .flat_map(|family| family.get_metric())
            .map(|metric| metric.get_counter().value())
            .sum();
        // A counter's value is a whole number kept in an f64.
        sum as u64
    }

    /// Distributed lock events of one outcome so far, for the status page.
    pub fn lock_event_count(&self, event: LockEvent) -> u64 {
        self.lock_events.with_label_values(&[event.as_str()]).get()
    }
}

/// How an id reached a Bloom filter after its load: the `via` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddVia {
    /// A create answered 2xx through this instance.
    Write,
    /// A `bloom_add` event from another instance.
    Event,
    /// Re-read from Redis after a gap in the event bus, or after a rebuild.
    Resync,
}

impl AddVia {
    pub fn as_str(self) -> &'static str {
        match self {
            AddVia::Write => "write",
            AddVia::Event => "event",
            AddVia::Resync => "resync",
        }
    }
}

/// Handles for one Bloom filter.
#[derive(Clone, Debug)]
pub struct FilterMetrics {
    pub rejections: IntCounter,
    pub false_positives: IntCounter,
    pub items: IntGauge,
    pub bits: IntGauge,
    pub bytes: IntGauge,
    pub fp_rate: Gauge,
    pub ready: IntGauge,
    pub loads_source: IntCounter,
    pub loads_snapshot: IntCounter,
    pub load_failures: IntCounter,
    pub load_duration: Histogram,
    pub since_load: Gauge,
    pub skipped_lines: IntCounter,
    adds: [IntCounter; 3],
    pub add_failures_no_id: IntCounter,
    pub add_failures_redis: IntCounter,
}

impl FilterMetrics {
    pub fn added(&self, via: AddVia, n: u64) {
        self.adds[via as usize].inc_by(n);
    }
}

/// Handles for one route (or for the pass-through pseudo-route `_passthrough`).
#[derive(Debug)]
pub struct RouteMetrics {
    /// Answers, their Redis commands and durations (see [`per_worker`]).
    requests: Arc<per_worker::RouteCopies>,
    origin: [IntCounter; 7],
    origin_duration: Histogram,
    pub shed: IntCounter,
    pub uncacheable: IntCounter,
    /// Vary variants stored (origin mode): see `cacheguard_vary_variants_stored_total`.
    pub vary_variants_stored: IntCounter,
    revalidations: [IntCounter; 3],
    /// `fill_refused{reason="vary"}` (not per route: the counter has no route label).
    pub refused_vary: IntCounter,
    /// `fill_refused{reason="older_version"}` (likewise).
    pub refused_older: IntCounter,
    pub oversized: IntCounter,
    /// Answers whose version header was missing or did not parse (routes with `version`).
    pub version_unparsed: IntCounter,
    new_variants: [IntCounter; 4],
    pub origin_retries: IntCounter,
    pub coalesced: IntCounter,
    pub stale_served: IntCounter,
    pub early_refreshes: IntCounter,
    pub background_refreshes: IntCounter,
    /// Requests refused by the per-key limit of a hot key.
    pub hot_limited: IntCounter,
}

impl Metrics {
    /// The connection metrics of `listener` (`proxy`, `admin`).
    pub fn connections(&self, listener: &str) -> ConnectionMetrics {
        ConnectionMetrics {
            refused: self.connections_refused.with_label_values(&[listener]),
            open: self.connections_open.with_label_values(&[listener]),
            timed_out: ConnTimeout::ALL.map(|reason| {
                self.connections_timed_out
                    .with_label_values(&[listener, reason.as_str()])
            }),
            lingering: LingerEnd::ALL.map(|end| {
                self.lingering_closes
                    .with_label_values(&[listener, end.as_str()])
            }),
        }
    }
}

/// The connection metrics of one listener.
#[derive(Clone, Debug)]
pub struct ConnectionMetrics {
    /// Connections closed at accept, the listener being full.
    pub refused: IntCounter,
    pub open: IntGauge,
    timed_out: [IntCounter; ConnTimeout::ALL.len()],
    lingering: [IntCounter; LingerEnd::ALL.len()],
}

/// Why a connection was closed for a timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnTimeout {
    /// Idle between two requests for `server.keepalive_timeout`.
    Keepalive,
    /// No request within `server.header_read_timeout` of accept, or a head begun and not
    /// whole within it.
    HeaderRead,
}

impl ConnTimeout {
    pub const ALL: [ConnTimeout; 2] = [ConnTimeout::Keepalive, ConnTimeout::HeaderRead];

    pub fn as_str(self) -> &'static str {
        match self {
            ConnTimeout::Keepalive => "keepalive_timeout",
            ConnTimeout::HeaderRead => "header_read_timeout",
        }
    }
}

/// How a lingering close ended (`proxy/linger.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LingerEnd {
    /// The client closed its side.
    Closed,
    /// A read waited `server.lingering_timeout`.
    Timeout,
    /// `server.lingering_time` passed.
    Time,
    /// The socket failed (a reset from the client).
    Error,
}

impl LingerEnd {
    pub const ALL: [LingerEnd; 4] = [
        LingerEnd::Closed,
        LingerEnd::Timeout,
        LingerEnd::Time,
        LingerEnd::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LingerEnd::Closed => "closed",
            LingerEnd::Timeout => "lingering_timeout",
            LingerEnd::Time => "lingering_time",
            LingerEnd::Error => "error",
        }
    }
}

impl ConnectionMetrics {
    /// Records a connection closed for `reason`.
    pub fn timed_out(&self, reason: ConnTimeout) {
        self.timed_out[reason as usize].inc();
    }

    /// Records a lingering close that ended so.
    pub fn lingered(&self, end: LingerEnd) {
        self.lingering[end as usize].inc();
    }

    /// Lingering closes so far that ended so.
    pub fn lingering_closes(&self, end: LingerEnd) -> u64 {
        self.lingering[end as usize].get()
    }

    /// Connections closed so far for `reason`.
    pub fn timeouts(&self, reason: ConnTimeout) -> u64 {
        self.timed_out[reason as usize].get()
    }
}

impl RouteMetrics {
    /// Records one answered request.
    pub fn answered(&self, outcome: Outcome, seconds: f64) {
        self.requests.answered(outcome, seconds);
    }

    /// Records the Redis commands one answered request cost.
    pub fn redis_commands(&self, outcome: Outcome, commands: u32) {
        self.requests.commands(outcome, commands);
    }

    /// Records what became of a miss on a new variant.
    pub fn new_variant(&self, outcome: NewVariant) {
        self.new_variants[outcome as usize].inc();
    }

    /// Records one revalidation.
    pub fn revalidated(&self, result: Revalidation) {
        self.revalidations[result as usize].inc();
    }

    /// Records one origin request.
    pub fn origin(&self, status: OriginStatus, seconds: f64) {
        self.origin[status.index()].inc();
        self.origin_duration.observe(seconds);
    }

    /// Answers so far, by outcome, in [`Outcome::ALL`] order (for the status page).
    pub fn outcome_counts(&self) -> [u64; Outcome::ALL.len()] {
        self.requests.outcome_counts()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A coalesced answer reads as a hit to whatever matches `HIT*`, and as none of the
    /// others; every outcome has a label of its own.
    #[test]
    fn coalesced_is_a_hit_of_its_own() {
        assert_eq!(Outcome::Coalesced.header_value(), "HIT-COALESCED");
        assert_eq!(Outcome::Coalesced.as_str(), "coalesced");
        let words: BTreeSet<_> = Outcome::ALL.iter().map(|o| o.header_value()).collect();
        // Bypass and Error share `BYPASS`.
        assert_eq!(words.len(), Outcome::ALL.len() - 1);
        let labels: BTreeSet<_> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(labels.len(), Outcome::ALL.len());
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(o.index(), i, "{o:?}: ALL is in declaration order");
        }
    }

    #[test]
    fn route_handles_share_families() {
        let registry = Registry::new();
        let metrics = Metrics::register(&registry).unwrap();
        let a = metrics.for_route("item");
        a.answered(Outcome::HitL1, 0.001);
        a.origin(OriginStatus::S2xx, 0.01);
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap();
        assert!(text.contains(r#"cacheguard_requests_total{outcome="hit_l1",route="item"} 1"#));
        assert!(text.contains(r#"cacheguard_origin_requests_total{route="item",status="2xx"} 1"#));
    }
}

/// What a stock gate decided for a buy: the `outcome` label of
/// `cacheguard_stock_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StockOutcome {
    /// Units taken: forwarded with a reservation.
    Admitted,
    /// A retry of a buy whose outcome was in doubt: forwarded again with its reservation.
    Retried,
    /// Sold out, answered from this instance's memory (no Redis).
    SoldOutLocal,
    /// Sold out, as Redis answered.
    SoldOutRedis,
    /// A completed buy's answer replayed for a retry with its idempotency key.
    Replayed,
    /// A retry while the first request with its key was still in flight (409).
    InFlight,
    /// An idempotency key reused with another body (422).
    Mismatch,
    /// An idempotency key that is not one (400).
    BadKey,
    /// Redis could not answer: refused with 503 (`on_redis_error = "reject"`).
    Unavailable,
    /// Redis could not answer: forwarded ungated (`on_redis_error = "forward"`).
    Ungated,
    /// The resource's units could not be loaded from the origin: 503.
    NotLoaded,
    /// A retry of a buy whose outcome is in doubt, refused (409,
    /// `in_doubt_retry = "reject"`).
    InDoubt,
}

impl StockOutcome {
    pub const ALL: [StockOutcome; 12] = [
        StockOutcome::Admitted,
        StockOutcome::Retried,
        StockOutcome::SoldOutLocal,
        StockOutcome::SoldOutRedis,
        StockOutcome::Replayed,
        StockOutcome::InFlight,
        StockOutcome::Mismatch,
        StockOutcome::BadKey,
        StockOutcome::Unavailable,
        StockOutcome::Ungated,
        StockOutcome::NotLoaded,
        StockOutcome::InDoubt,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StockOutcome::Admitted => "admitted",
            StockOutcome::Retried => "retried",
            StockOutcome::SoldOutLocal => "sold_out_local",
            StockOutcome::SoldOutRedis => "sold_out_redis",
            StockOutcome::Replayed => "replayed",
            StockOutcome::InFlight => "in_flight",
            StockOutcome::InDoubt => "in_doubt",
            StockOutcome::Mismatch => "mismatch",
            StockOutcome::BadKey => "bad_key",
            StockOutcome::Unavailable => "unavailable",
            StockOutcome::Ungated => "ungated",
            StockOutcome::NotLoaded => "not_loaded",
        }
    }
}

/// What the origin's answer to an admitted buy meant for its units: the `result` label of
/// `cacheguard_stock_settled_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StockSettled {
    /// 2xx: sold, the reservation is consumed.
    Sold,
    /// A `not_sold` status: the units went back.
    Returned,
    /// An `origin_sold_out` status: the gate went to 0.
    OriginSoldOut,
    /// A timeout, a reset, a 5xx or another status: the reservation is left to expire and a
    /// reconcile asks the origin.
    InDoubt,
}

impl StockSettled {
    pub const ALL: [StockSettled; 4] = [
        StockSettled::Sold,
        StockSettled::Returned,
        StockSettled::OriginSoldOut,
        StockSettled::InDoubt,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StockSettled::Sold => "sold",
            StockSettled::Returned => "returned",
            StockSettled::OriginSoldOut => "origin_sold_out",
            StockSettled::InDoubt => "in_doubt",
        }
    }
}

/// The stock gates' metric families; each gate resolves its handles once
/// ([`StockFamilies::for_gate`]).
#[derive(Clone, Debug)]
pub(crate) struct StockFamilies {
    requests: IntCounterVec,
    settled: IntCounterVec,
    reconciles: IntCounterVec,
    reconcile_units: IntCounterVec,
    reconcile_delta: IntGaugeVec,
    redis_errors: IntCounterVec,
    sold_out_events: IntCounterVec,
    sales_queued: IntGaugeVec,
    sale_batches: IntCounterVec,
}

impl StockFamilies {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        let families = StockFamilies {
            requests: IntCounterVec::new(
                Opts::new(
                    "cacheguard_stock_requests_total",
                    "Buys on routes bound to a stock gate, by gate and what the gate decided \
                     (admitted, retried, sold_out_local, sold_out_redis, replayed, in_flight, \
                     mismatch, bad_key, unavailable, ungated, not_loaded).",
                ),
                &["gate", "outcome"],
            )?,
            settled: IntCounterVec::new(
                Opts::new(
                    "cacheguard_stock_settled_total",
                    "Admitted buys by what the origin's answer meant for their units (sold, \
                     returned, origin_sold_out, in_doubt).",
                ),
                &["gate", "result"],
            )?,
            reconciles: IntCounterVec::new(
                Opts::new(
                    "cacheguard_stock_reconciles_total",
                    "Reconciles of a resource's units with the origin, by gate and result (ok, \
                     failed: the source did not answer a number; skipped: another instance \
                     had the turn).",
                ),
                &["gate", "result"],
            )?,
            reconcile_units: IntCounterVec::new(
                Opts::new(
                    "cacheguard_stock_reconcile_units_total",
                    "Units reconciles added (up) or removed (down), by gate: how far the \
                     gate's count had drifted from the origin's.",
                ),
                &["gate", "direction"],
            )?,
            reconcile_delta: IntGaugeVec::new(
                Opts::new(
                    "cacheguard_stock_reconcile_delta_units",
                    "The last reconcile's change to the gate's count (signed: positive when \
                     the origin had more than the gate thought), by gate.",
                ),
                &["gate"],
            )?,
            redis_errors: IntCounterVec::new(
                Opts::new(
                    "cacheguard_stock_redis_errors_total",
                    "Stock gate operations Redis did not answer, by gate.",
                ),
                &["gate"],
            )?,
            sold_out_events: IntCounterVec::new(
                Opts::new(
                    "cacheguard_stock_sold_out_marks_total",
                    "Sold-out marks this instance set (a resource segment learned sold out, \
                     from Redis or the event bus), by gate.",
                ),
                &["gate"],
            )?,
            sales_queued: IntGaugeVec::new(
                Opts::new(
                    "cacheguard_stock_sales_queued",
                    "Sales answered and waiting for their batch's settlement, by gate.",
                ),
                &["gate"],
            )?,
            sale_batches: IntCounterVec::new(
                Opts::new(
                    "cacheguard_stock_sale_batches_total",
                    "Ledger calls that settled a batch of sales of one segment, by gate (with \
                     cacheguard_stock_settled_total{result=\"sold\"}: the sales per call).",
                ),
                &["gate"],
            )?,
        };
        for family in [
            Box::new(families.requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(families.settled.clone()),
            Box::new(families.reconciles.clone()),
            Box::new(families.reconcile_units.clone()),
            Box::new(families.reconcile_delta.clone()),
            Box::new(families.redis_errors.clone()),
            Box::new(families.sold_out_events.clone()),
            Box::new(families.sales_queued.clone()),
            Box::new(families.sale_batches.clone()),
        ] {
            registry.register(family)?;
        }
        Ok(families)
    }

    /// Resolves one gate's handles (every series exists from then on).
    pub(crate) fn for_gate(&self, gate: &str) -> StockMetrics {
        StockMetrics {
            requests: StockOutcome::ALL
                .map(|o| self.requests.with_label_values(&[gate, o.as_str()])),
            settled: StockSettled::ALL.map(|r| self.settled.with_label_values(&[gate, r.as_str()])),
            reconciles_ok: self.reconciles.with_label_values(&[gate, "ok"]),
            reconciles_failed: self.reconciles.with_label_values(&[gate, "failed"]),
            reconciles_skipped: self.reconciles.with_label_values(&[gate, "skipped"]),
            units_up: self.reconcile_units.with_label_values(&[gate, "up"]),
            units_down: self.reconcile_units.with_label_values(&[gate, "down"]),
            delta: self.reconcile_delta.with_label_values(&[gate]),
            redis_errors: self.redis_errors.with_label_values(&[gate]),
            sold_out_marks: self.sold_out_events.with_label_values(&[gate]),
            sales_queued: self.sales_queued.with_label_values(&[gate]),
            sale_batches: self.sale_batches.with_label_values(&[gate]),
        }
    }
}

/// One stock gate's counters at one moment ([`StockMetrics::counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StockCounts {
    /// By decision, in [`StockOutcome::ALL`] order.
    pub(crate) requests: [u64; StockOutcome::ALL.len()],
    /// By what the origin's answer meant, in [`StockSettled::ALL`] order.
    pub(crate) settled: [u64; StockSettled::ALL.len()],
    pub(crate) reconciles_ok: u64,
    pub(crate) reconciles_failed: u64,
    /// The last reconcile's change to the gate's count (signed).
    pub(crate) last_delta: i64,
    pub(crate) redis_errors: u64,
    pub(crate) sold_out_marks: u64,
}

impl StockCounts {
    pub(crate) fn request(&self, outcome: StockOutcome) -> u64 {
        self.requests[outcome as usize]
    }

    /// Sold-out answers, from this instance's marks and from Redis.
    pub(crate) fn sold_out(&self) -> u64 {
        self.request(StockOutcome::SoldOutLocal) + self.request(StockOutcome::SoldOutRedis)
    }
}

/// One stock gate's metric handles.
#[derive(Clone, Debug)]
pub(crate) struct StockMetrics {
    requests: [IntCounter; StockOutcome::ALL.len()],
    settled: [IntCounter; StockSettled::ALL.len()],
    pub(crate) reconciles_ok: IntCounter,
    pub(crate) reconciles_failed: IntCounter,
    pub(crate) reconciles_skipped: IntCounter,
    units_up: IntCounter,
    units_down: IntCounter,
    delta: IntGauge,
    pub(crate) redis_errors: IntCounter,
    pub(crate) sold_out_marks: IntCounter,
    pub(crate) sales_queued: IntGauge,
    pub(crate) sale_batches: IntCounter,
}

impl StockMetrics {
    pub(crate) fn request(&self, outcome: StockOutcome) {
        self.requests[outcome as usize].inc();
    }

    pub(crate) fn settled(&self, result: StockSettled) {
        self.settled[result as usize].inc();
    }

    /// The gate's counters now (for the status page; the metric families stay the record).
    pub(crate) fn counts(&self) -> StockCounts {
        StockCounts {
            requests: self.requests.each_ref().map(IntCounter::get),
            settled: self.settled.each_ref().map(IntCounter::get),
            reconciles_ok: self.reconciles_ok.get(),
            reconciles_failed: self.reconciles_failed.get(),
            last_delta: self.delta.get(),
            redis_errors: self.redis_errors.get(),
            sold_out_marks: self.sold_out_marks.get(),
        }
    }

    /// A reconcile moved the gate's count by `delta` units (summed over its segments).
    pub(crate) fn reconciled(&self, delta: i64) {
        self.reconciles_ok.inc();
        self.delta.set(delta);
        if delta > 0 {
            self.units_up.inc_by(delta.unsigned_abs());
        } else {
            self.units_down.inc_by(delta.unsigned_abs());
        }
    }
}

/// What became of a write on a serialized route: the `result` label of
/// `cacheguard_serialized_writes_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SerializeOutcome {
    /// It got the lock and was forwarded.
    Granted,
    /// No lock within `wait_timeout`: 503.
    Timeout,
    /// `max_waiters` waited already: 503 at once.
    TooMany,
    /// The lock service did not answer: 503 (`on_redis_error = "reject"`).
    Unavailable,
    /// The lock service did not answer: forwarded unserialized (`on_redis_error =
    /// "forward"`).
    Ungated,
}

impl SerializeOutcome {
    pub const ALL: [SerializeOutcome; 5] = [
        SerializeOutcome::Granted,
        SerializeOutcome::Timeout,
        SerializeOutcome::TooMany,
        SerializeOutcome::Unavailable,
        SerializeOutcome::Ungated,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SerializeOutcome::Granted => "granted",
            SerializeOutcome::Timeout => "timeout",
            SerializeOutcome::TooMany => "too_many",
            SerializeOutcome::Unavailable => "unavailable",
            SerializeOutcome::Ungated => "ungated",
        }
    }
}

/// The families of serialized writes; each route resolves its handles once.
#[derive(Clone, Debug)]
pub(crate) struct SerializeFamilies {
    writes: IntCounterVec,
    wait: HistogramVec,
    lost: IntCounterVec,
    late: IntCounterVec,
    passed_on: IntCounterVec,
}

impl SerializeFamilies {
    fn register(registry: &Registry) -> prometheus::Result<Self> {
        let families = SerializeFamilies {
            writes: IntCounterVec::new(
                Opts::new(
                    "cacheguard_serialized_writes_total",
                    "Writes on serialized routes, by route and result (granted; timeout: no \
                     lock within wait_timeout; too_many: max_waiters waited already; \
                     unavailable: the lock service did not answer and the write was refused; \
                     ungated: it did not answer and the write was forwarded unserialized).",
                ),
                &["route", "result"],
            )?,
            wait: HistogramVec::new(
                HistogramOpts::new(
                    "cacheguard_serialized_wait_seconds",
                    "How long granted writes waited for their lock, by route.",
                )
                .buckets(buckets_latency()),
                &["route"],
            )?,
            lost: IntCounterVec::new(
                Opts::new(
                    "cacheguard_serialized_leases_lost_total",
                    "Writes whose lock was lost while at the origin (a renewal found it \
                     gone): only the origin's fencing-token check keeps them in order.",
                ),
                &["route"],
            )?,
            late: IntCounterVec::new(
                Opts::new(
                    "cacheguard_serialized_late_grants_total",
                    "Grants given back because less than a third of the lease was left when \
                     they arrived (a slow lock service), by route.",
                ),
                &["route"],
            )?,
            passed_on: IntCounterVec::new(
                Opts::new(
                    "cacheguard_serialized_passed_on_total",
                    "Locks passed on by a write that was answered to the next write of the \
                     same resource waiting in this instance, with a fresh fencing token, \
                     instead of being released, by route.",
                ),
                &["route"],
            )?,
        };
        for family in [
            Box::new(families.writes.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(families.wait.clone()),
            Box::new(families.lost.clone()),
            Box::new(families.late.clone()),
            Box::new(families.passed_on.clone()),
        ] {
            registry.register(family)?;
        }
        Ok(families)
    }

    /// Resolves one route's handles (every series exists from then on).
    pub(crate) fn for_route(&self, route: &str) -> SerializeMetrics {
        SerializeMetrics {
            writes: SerializeOutcome::ALL
                .map(|o| self.writes.with_label_values(&[route, o.as_str()])),
            wait: self.wait.with_label_values(&[route]),
            lost: self.lost.with_label_values(&[route]),
            late_grants: self.late.with_label_values(&[route]),
            passed_on: self.passed_on.with_label_values(&[route]),
        }
    }
}

/// One serialized route's handles.
#[derive(Clone, Debug)]
pub(crate) struct SerializeMetrics {
    writes: [IntCounter; 5],
    wait: Histogram,
    pub(crate) lost: IntCounter,
    pub(crate) late_grants: IntCounter,
    pub(crate) passed_on: IntCounter,
}

impl SerializeMetrics {
    pub(crate) fn outcome(&self, outcome: SerializeOutcome) {
        self.writes[outcome as usize].inc();
    }

    pub(crate) fn waited(&self, waited: std::time::Duration) {
        self.wait.observe(waited.as_secs_f64());
    }
}
