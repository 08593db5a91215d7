//! Stock gates: units of a resource (seats of one train and class, one product's stock)
//! counted at the edge, so that a flash sale's crowd is answered "sold out" by cacheguard
//! and the origin's database sees about as many buys as there are units.
//!
//! A gate (`[[stock]]`) is bound to write routes (`stock = { gate, units }`). A resource is
//! the gate's `key` pattern filled from the route's path parameters; its units live in
//! Redis (`shared.rs`; in embedded mode in process memory, `memory.rs`), optionally spread
//! over several `segments` (each its own key, so a Redis Cluster spreads one hot resource
//! over its primaries).
//!
//! A buy:
//!
//! 1. this instance's **sold-out mark** for every segment says there are too few units →
//!    the gate's sold-out answer at once, no Redis, no body read (only for requests without
//!    an idempotency key: a key may have a completed answer to replay);
//! 2. one **buy script** per segment tried (its home first): checks the key's record, takes
//!    the units and records a reservation (id, deadline `reservation_ttl`) — or says how
//!    many units are left, which marks the segment here;
//! 3. the write is forwarded with `Stock-Reservation: <id>`; the origin's answer
//!    **settles** the reservation: 2xx sold (consumed), a `not_sold` status gives the units
//!    back, an `origin_sold_out` status sets the segment to 0, anything else (5xx, timeout,
//!    reset, other statuses) is **in doubt**: the reservation is left to expire and a
//!    reconcile runs at once. cacheguard never makes up a success.
//!
//! The origin stays the source of truth: it still decrements conditionally. A
//! **reconcile** sets each segment to its share of `origin's remaining − live reservations
//! − units sold since the reconcile began` (those may be missing from the origin's number),
//! in one script per segment, so a buy in flight is counted once. It runs for the resources
//! in use every `reconcile` (one instance at a time, by a turn in Redis), at once after an
//! in-doubt outcome, when a buy finds expired reservations (an instance died or stalled
//! mid-buy: their units come back through the origin's number, never blindly), and when a
//! resource is first used: before its first load the gate admits nothing.
//!
//! When a segment runs out, the instance that took its last unit says so on the event bus
//! (`stock soldout …`); every instance then answers from memory until its mark lapses
//! (after `reconcile`, one request asks Redis again while the others keep the mark) or a
//! reconcile or a returned unit says `restock`. After a gap in the bus the marks are dropped.
//!
//! **Idempotency keys** (the IETF `Idempotency-Key` draft): a retry while the first request
//! is in flight gets 409; once it completed, its answer is replayed
//! (`Idempotent-Replayed: true`) for `idempotency_ttl`; the same key with another body gets
//! 422; a key that is not one (empty, over 255 bytes, not visible ASCII) gets 400. After an
//! in-doubt outcome the key's record is in doubt, with its reservation. What a retry with
//! the same body gets is the gate's `in_doubt_retry`:
//!
//! - `reject` (the default): 409, never forwarded, for as long as the record lives
//!   (`idempotency_ttl`): the first request may have sold, and an origin that does not
//!   deduplicate by the key would sell again. While the reservation lives the answer has a
//!   `Retry-After` of its remaining life (then the origin's count settles its units); after
//!   that, none: nobody here can learn the outcome, only the origin knows it.
//! - `forward` (an origin that deduplicates by the key): forwarded again with the same
//!   `Stock-Reservation`, taking no new unit, while the reservation lives.
//!
//! One key never holds two units at once.

mod ledger;
mod memory;
mod ops;
pub(crate) mod record;
mod sales;
mod shared;
mod source;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::StreamExt;
use http::{HeaderValue, StatusCode, Uri};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use self::ledger::Ledger;
use self::memory::MemoryLedger;
use self::ops::{Buy, BuyRequest, Outcome, RecordClaim, RecordWrite, Settle};
use self::record::{Kind, Record, StoredAnswer};
use self::shared::RedisLedger;
use self::source::Source;
use crate::cache::key::normalized_params;
use crate::clock::now_ms;
use crate::config::{InDoubtRetry, OnRedisError, StockConfig, UpstreamConfig, fill_pattern};
use crate::coord::events::{BusListener, Delivery, StockEvent, StockLevel};
use crate::coord::redis::Unavailable;
use crate::coord::{Keyspace, RedisConn, keyspace};
use crate::metrics::{Metrics, StockCounts, StockMetrics, StockOutcome, StockSettled};

/// A resource's keys expire at most this long after its last buy, and at least half of it
/// (or 4 × `reservation_ttl` / `reconcile` when longer): a resource nobody buys is
/// forgotten, and loaded again from the origin when somebody does.
const IDLE: Duration = Duration::from_secs(3600);

/// How long consumed reservations are kept for reconciles to count (at least).
const CONSUMED_KEPT: Duration = Duration::from_secs(60);

/// Resources this instance keeps state for (marks, last use); the least used beyond are
/// forgotten (their next buy asks Redis).
const MAX_RESOURCES: u64 = 100_000;

/// Source loads in flight at once, per gate: a crowd on unknown resources (random ids)
/// cannot turn into a crowd on the origin's stock endpoint.
const MAX_LOADS: usize = 8;

/// After a load failed, buys of that resource are refused for this long without asking
/// the origin again.
const LOAD_FAILURE_HOLD: Duration = Duration::from_secs(1);

/// A settlement Redis did not take is tried again after this long, then twice as long each
/// time, up to [`SETTLE_RETRY_MAX`], until its reservation ends.
const SETTLE_RETRY_FIRST: Duration = Duration::from_millis(50);
const SETTLE_RETRY_MAX: Duration = Duration::from_secs(1);

/// Longest idempotency key accepted.
pub(crate) const MAX_KEY_BYTES: usize = 255;

/// The header that carries a reservation's id to the origin.
pub(crate) static STOCK_RESERVATION: http::HeaderName =
    http::HeaderName::from_static("stock-reservation");

/// The gates of a config, by name.
#[derive(Debug)]
pub(crate) struct Gates {
    by_name: HashMap<String, Arc<Gate>>,
}

impl Gates {
    /// One gate per `[[stock]]`; in Redis when `redis` is given, else in memory.
    pub(crate) fn new(
        configs: &[StockConfig],
        upstream: &UpstreamConfig,
        redis: Option<(RedisConn, Keyspace)>,
        instance: u64,
        metrics: &Metrics,
    ) -> Arc<Gates> {
        let by_name = configs
            .iter()
            .map(|config| {
                let ledger = match &redis {
                    Some((conn, keys)) => {
                        Ledger::Redis(RedisLedger::new(conn.clone(), keys.clone()))
                    }
                    None => Ledger::Memory(MemoryLedger::new(
                        idle(config),
                        config.idempotency_ttl.max(config.reservation_ttl),
                    )),
                };
                let gate = Gate {
                    name: config.name.clone(),
                    settings: ArcSwap::from_pointee(Settings::of(config, upstream)),
                    ledger,
                    resources: moka::sync::Cache::builder()
                        .max_capacity(MAX_RESOURCES)
                        .time_to_idle(idle(config))
                        .build(),
                    source: Source::new(),
                    loads: Semaphore::new(MAX_LOADS),
                    instance,
                    metrics: metrics.stock.for_gate(&config.name),
                    sales: OnceLock::new(),
                };
                (config.name.clone(), Arc::new(gate))
            })
            .collect();
        Arc::new(Gates { by_name })
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Arc<Gate>> {
        self.by_name.get(name)
    }

    /// Every gate's counters now, by name (the status page reads them).
    pub(crate) fn snapshot(&self) -> Vec<GateSnapshot> {
        let mut gates: Vec<GateSnapshot> = self
            .by_name
            .values()
            .map(|gate| GateSnapshot {
                name: gate.name.clone(),
                counts: gate.metrics.counts(),
            })
            .collect();
        gates.sort_by(|a, b| a.name.cmp(&b.name));
        gates
    }

    /// Starts each gate's periodic reconciles; they end with `stop`.
    pub(crate) fn spawn(&self, stop: &CancellationToken) {
        for gate in self.by_name.values() {
            tokio::spawn(Arc::clone(gate).run(stop.clone()));
        }
    }

    /// Whether `configs` names exactly these gates: adding or removing one needs a
    /// restart (routes may name it).
    pub(crate) fn same_gates(&self, configs: &[StockConfig]) -> bool {
        configs.len() == self.by_name.len()
            && configs.iter().all(|c| self.by_name.contains_key(&c.name))
    }

    /// Applies a reloaded config's gate settings (see [`Gates::same_gates`]); their units,
    /// marks and reservations stay.
    pub(crate) fn reconfigure(&self, configs: &[StockConfig], upstream: &UpstreamConfig) {
        for config in configs {
            if let Some(gate) = self.by_name.get(&config.name) {
                gate.settings
                    .store(Arc::new(Settings::of(config, upstream)));
            }
        }
    }
}

impl BusListener for Gates {
    fn on_stock(&self, event: StockEvent) {
        for gate in self.by_name.values() {
            gate.heard(event);
        }
    }

    /// `restock` messages may have been missed: every instance asks Redis again.
    fn on_subscribed(self: Arc<Self>, _delivery: Delivery) {
        for gate in self.by_name.values() {
            for (_, resource) in gate.resources.iter() {
                resource.clear_marks();
            }
        }
    }
}

/// One gate's counters at one moment, read-only ([`Gates::snapshot`]).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GateSnapshot {
    pub(crate) name: String,
    pub(crate) counts: StockCounts,
}

fn idle(config: &StockConfig) -> Duration {
    IDLE.max(config.reservation_ttl * 4)
        .max(config.reconcile * 4)
}

/// What a reload may change of a gate.
#[derive(Debug)]
struct Settings {
    config: Arc<StockConfig>,
    /// The origin's base URL, for the source.
    upstream: Uri,
    /// Bound on one source request.
    timeout: Duration,
}

impl Settings {
    fn of(config: &StockConfig, upstream: &UpstreamConfig) -> Self {
        Settings {
            config: Arc::new(config.clone()),
            upstream: upstream.url.clone(),
            timeout: upstream.timeout,
        }
    }
}

/// One `[[stock]]` gate.
#[derive(Debug)]
pub(crate) struct Gate {
    name: String,
    settings: ArcSwap<Settings>,
    ledger: Ledger,
    /// What this instance knows of the resources in use, by id.
    resources: moka::sync::Cache<u128, Arc<Resource>>,
    source: Source,
    loads: Semaphore,
    instance: u64,
    pub(crate) metrics: StockMetrics,
    /// The queue of sales settled in batches (`sales.rs`), with its task once used.
    sales: OnceLock<tokio::sync::mpsc::Sender<sales::Queued>>,
}

/// What this instance knows of one resource.
#[derive(Debug)]
pub(crate) struct Resource {
    id: u128,
    /// The resource's path and its source path; unset for a resource only heard of on the
    /// bus (no request here named it yet).
    paths: OnceLock<(String, String)>,
    /// Per segment: units left as last heard, while it is fewer than some buy asks.
    marks: Mutex<Vec<Option<Mark>>>,
    /// When a request last named it (ms): periodic reconciles cover recent ones.
    touched_ms: AtomicU64,
    /// Where the next buy without a key starts among the segments.
    next: AtomicU16,
    /// One reconcile of the resource at a time in this instance.
    reconciling: tokio::sync::Mutex<()>,
    /// A reconcile was asked for while one ran: it runs once more.
    again: AtomicBool,
    /// Until when (ms) a failed load holds further buys off the origin.
    failed_until: AtomicU64,
    /// Reconciles of the resource that succeeded here: a buy that found it unloaded takes
    /// one that ended since (counted before its buy) as its own load.
    reconciled: AtomicU64,
}

#[derive(Clone, Copy, Debug)]
struct Mark {
    left: u64,
    until: Instant,
}

impl Resource {
    fn new(id: u128, segments: u16) -> Self {
        Resource {
            id,
            paths: OnceLock::new(),
            marks: Mutex::new(vec![None; usize::from(segments.max(1))]),
            touched_ms: AtomicU64::new(0),
            next: AtomicU16::new(0),
            reconciling: tokio::sync::Mutex::new(()),
            again: AtomicBool::new(false),
            failed_until: AtomicU64::new(0),
            reconciled: AtomicU64::new(0),
        }
    }

    fn marks(&self) -> std::sync::MutexGuard<'_, Vec<Option<Mark>>> {
        self.marks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn mark(&self, segment: u16, left: u64, hold: Duration) {
        if let Some(slot) = self.marks().get_mut(usize::from(segment)) {
            *slot = Some(Mark {
                left,
                until: Instant::now() + hold,
            });
        }
    }

    fn unmark(&self, segment: u16) {
        if let Some(slot) = self.marks().get_mut(usize::from(segment)) {
            *slot = None;
        }
    }

    fn clear_marks(&self) {
        self.marks().iter_mut().for_each(|m| *m = None);
    }

    /// Whether `segment` is known here to have fewer than `units`. A lapsed mark is
    /// renewed for one more `hold` by the request that finds it, which then asks Redis
    /// (the others keep answering from the mark meanwhile).
    fn short(&self, segment: u16, units: u64, hold: Duration) -> bool {
        let mut marks = self.marks();
        let Some(Some(mark)) = marks.get_mut(usize::from(segment)) else {
            return false;
        };
        if mark.left >= units {
            return false;
        }
        let now = Instant::now();
        if now < mark.until {
            return true;
        }
        mark.until = now + hold;
        false
    }
}

/// A well-formed idempotency key of a request, with the body it came with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct IdempotencyKey {
    hash: u128,
    fingerprint: u64,
}

impl IdempotencyKey {
    /// The key a header value holds (an sf-string's quotes are taken off), with the
    /// fingerprint (xxh3-64) of the request body it came with.
    ///
    /// # Errors
    /// When the value is no key: empty, longer than [`MAX_KEY_BYTES`], or not visible ASCII.
    pub(crate) fn parse(value: &HeaderValue, fingerprint: u64) -> Result<Self, ()> {
        let bytes = value.as_bytes();
        let key = bytes
            .strip_prefix(b"\"")
            .and_then(|b| b.strip_suffix(b"\""))
            .unwrap_or(bytes);
        if key.is_empty() || key.len() > MAX_KEY_BYTES || !key.iter().all(u8::is_ascii_graphic) {
            return Err(());
        }
        Ok(IdempotencyKey {
            hash: xxhash_rust::xxh3::xxh3_128(key),
            fingerprint,
        })
    }
}

/// What the gate decided for a buy.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Units taken: forward with this reservation, then settle it.
    Admitted(Reservation),
    /// A retry of an in-doubt buy: forward again with its reservation, then settle it.
    Retried(Reservation),
    SoldOut,
    /// The answer a completed buy with this key got.
    Replay(StoredAnswer),
    /// The first request with this key is still in flight.
    InFlight,
    /// The first request with this key got no answer that says whether it sold, and the
    /// gate does not forward such a retry (`in_doubt_retry = "reject"`).
    InDoubt(Doubt),
    /// This key came first with another body.
    Mismatch,
    /// Redis did not answer (`on_redis_error = "reject"`).
    Unavailable,
    /// The resource's units could not be loaded from the origin.
    NotLoaded,
    /// Redis did not answer (`on_redis_error = "forward"`): forward without a reservation.
    Ungated,
}

/// What an idempotency key's record says, for a request the marks call sold out.
#[derive(Debug)]
pub(crate) enum Lookup {
    /// The answer: a replay, in flight, or another body.
    Answer(Admission),
    /// Its buy was in doubt: go on as a buy (the script takes it up again).
    InDoubt,
    /// No record: sold out.
    NoRecord,
}

/// A buy whose outcome is in doubt, as a retry with its key is told.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Doubt {
    /// Its reservation's id (what the origin was told in `Stock-Reservation`).
    pub(crate) reservation: String,
    /// How long its reservation still holds its units; `None`: it ended (or its end is
    /// not known), and its units were settled by the origin's count.
    pub(crate) ends_in: Option<Duration>,
}

/// Units reserved for one buy in flight.
#[derive(Debug)]
pub(crate) struct Reservation {
    resource: Arc<Resource>,
    segment: u16,
    /// `<units>.<id>`.
    member: String,
    units: u64,
    key: Option<(IdempotencyKey, u16)>,
    /// When the reservation ends in the ledger unless settled (a local estimate, from
    /// before its script was sent).
    deadline: Instant,
}

impl Reservation {
    /// The id the origin is told (`Stock-Reservation`).
    pub(crate) fn id(&self) -> &str {
        reservation_id(&self.member)
    }
}

/// What the origin's answer to a buy means for its units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settlement {
    Sold,
    NotSold,
    OriginSoldOut,
    InDoubt,
}

/// Why a reconcile runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Why {
    /// A buy found the resource unloaded: waited for. `reconciled`: the resource's count of
    /// successful reconciles from before that buy.
    Load { reconciled: u64 },
    /// After an in-doubt outcome or expired reservations: in the background, now.
    Soon,
    /// The periodic pass: one instance at a time (a turn in Redis).
    Periodic,
}

impl Gate {
    /// The gate's config in effect.
    pub(crate) fn config(&self) -> Arc<StockConfig> {
        Arc::clone(&self.settings.load().config)
    }

    /// The resource a request on a bound route names: the gate's key (and source path)
    /// filled from the route's path parameters, their percent-escapes normalized (so
    /// `%41` and `A` are one resource, not two with the whole stock each).
    pub(crate) fn resource(&self, params: &[(String, String)]) -> Arc<Resource> {
        let settings = self.settings.load();
        let config = &settings.config;
        let params = &normalized_params(params);
        let path = fill_pattern(&config.key, params);
        let id = keyspace::stock_resource(&self.name, &path);
        let resource = self
            .resources
            .get_with(id, || Arc::new(Resource::new(id, config.segments)));
        resource
            .paths
            .get_or_init(|| (path, fill_pattern(&config.source_path, params)));
        resource.touched_ms.store(now_ms(), Ordering::Relaxed);
        resource
    }

    /// Whether this instance knows, without asking anyone, that `resource` has fewer than
    /// `units` in every segment.
    pub(crate) fn sold_out_here(&self, resource: &Resource, units: u64) -> bool {
        let settings = self.settings.load();
        let hold = settings.config.reconcile;
        (0..settings.config.segments.max(1)).all(|segment| resource.short(segment, units, hold))
    }

    /// Takes `units` of `resource` for one buy, or says why not (see the module docs).
    ///
    /// # Cancel safety
    /// A buy dropped after its script ran leaves its reservation to expire; the units come
    /// back through the reconcile that expiry triggers. Settle every reservation this
    /// returns, from a task a client's hang-up cannot cancel.
    pub(crate) async fn admit(
        self: &Arc<Self>,
        resource: &Arc<Resource>,
        units: u64,
        key: Option<IdempotencyKey>,
    ) -> Admission {
        let settings = self.settings.load_full();
        let config = &settings.config;
        let segments = config.segments.max(1);
        let home = key.map(|k| u16::try_from(k.hash % u128::from(segments)).unwrap_or(0));
        let start =
            home.unwrap_or_else(|| resource.next.fetch_add(1, Ordering::Relaxed) % segments);
        let member = format!("{units}.{:032x}", rand::random::<u128>());
        let ttl_ms = millis(config.reservation_ttl);
        let idle_ms = millis(idle(config));
        let mut loaded = false;
        // With several segments, the key's record is claimed in its home segment even when
        // that one is short: the reservation is then taken elsewhere.
        let mut claimed = false;
        for step in 0..segments {
            let segment = (start + step) % segments;
            let checks_record = key.is_some() && home == Some(segment);
            if !checks_record && resource.short(segment, units, config.reconcile) {
                continue;
            }
            let record = key.filter(|_| checks_record).map(|k| RecordClaim {
                key: k.hash,
                home: segment,
                pending: Record {
                    kind: Kind::InFlight,
                    fingerprint: k.fingerprint,
                    segment,
                    member: member.clone(),
                    ends_ms: None,
                    answer: None,
                }
                .encode(),
                claim_when_short: segments > 1,
                fingerprint: k.fingerprint,
                reclaim: config.in_doubt_retry == InDoubtRetry::Forward,
            });
            let request = BuyRequest {
                units,
                member: &member,
                ttl_ms,
                idle_ms,
                record,
            };
            let mut sent = Instant::now();
            let reconciled = resource.reconciled.load(Ordering::Acquire);
            // With the breaker open the script is not sent: nothing is taken, so nothing is
            // to be given back (a crowd refused during an outage leaves no task behind).
            let asked = self.ledger.up();
            let mut answer = if asked {
                self.ledger.buy(resource.id, segment, &request).await
            } else {
                Err(Unavailable::Down)
            };
            if matches!(answer, Ok(Buy::Unloaded)) && !loaded {
                loaded = true;
                if !self.load(resource, reconciled).await {
                    return self.refused(StockOutcome::NotLoaded, Admission::NotLoaded);
                }
                sent = Instant::now();
                answer = self.ledger.buy(resource.id, segment, &request).await;
            }
            let deadline = sent + config.reservation_ttl;
            let answer = match answer {
                Ok(answer) => answer,
                Err(_) => {
                    self.metrics.redis_errors.inc();
                    // Sent, the script may have run: whatever it took goes back.
                    if asked {
                        let claim = key.filter(|_| checks_record).zip(home);
                        self.cancel(resource, segment, member, units, claim);
                    }
                    return match config.on_redis_error {
                        OnRedisError::Reject => {
                            self.refused(StockOutcome::Unavailable, Admission::Unavailable)
                        }
                        OnRedisError::Forward => {
                            self.refused(StockOutcome::Ungated, Admission::Ungated)
                        }
                    };
                }
            };
            match answer {
                Buy::Taken { left, expired } => {
                    if expired > 0 {
                        self.reconcile_soon(resource);
                    }
                    if left == 0 {
                        self.sold_out(resource, segment, 0).await;
                    } else {
                        resource.unmark(segment);
                    }
                    let key = key.map(|k| (k, home.unwrap_or(segment)));
                    if claimed && let Some((k, home)) = key {
                        // The record claimed in the home segment names this reservation.
                        let record = Record {
                            kind: Kind::InFlight,
                            fingerprint: k.fingerprint,
                            segment,
                            member: member.clone(),
                            ends_ms: None,
                            answer: None,
                        };
                        let _ = self
                            .ledger
                            .write_record(
                                resource.id,
                                home,
                                k.hash,
                                Some((&record.encode(), ttl_ms)),
                            )
                            .await;
                    }
                    self.metrics.request(StockOutcome::Admitted);
                    return Admission::Admitted(Reservation {
                        resource: Arc::clone(resource),
                        segment,
                        member,
                        units,
                        key,
                        deadline,
                    });
                }
                Buy::Short {
                    left,
                    expired,
                    reserved,
                } => {
                    // Sold out with no buy in flight: the number to check against the
                    // origin's now, exactly (see `settle_once`).
                    if expired > 0 || (left == 0 && reserved == 0) {
                        self.reconcile_soon(resource);
                    }
                    resource.mark(segment, left, config.reconcile);
                    self.metrics.sold_out_marks.inc();
                    claimed |= checks_record && segments > 1;
                }
                Buy::Known(raw) => return self.known(&raw, key),
                Buy::Reclaimed(raw) => {
                    let (Some(k), Some(record)) = (key, Record::decode(&raw)) else {
                        return self.refused(StockOutcome::Unavailable, Admission::Unavailable);
                    };
                    self.metrics.request(StockOutcome::Retried);
                    return Admission::Retried(Reservation {
                        resource: Arc::clone(resource),
                        segment: record.segment,
                        units: units_of(&record.member).unwrap_or(units),
                        member: record.member,
                        key: Some((k, home.unwrap_or(0))),
                        deadline,
                    });
                }
                Buy::Unloaded => {
                    return self.refused(StockOutcome::NotLoaded, Admission::NotLoaded);
                }
            }
        }
        if claimed && let (Some(k), Some(home)) = (key, home) {
            let _ = self
                .ledger
                .write_record(resource.id, home, k.hash, None)
                .await;
        }
        self.metrics.request(StockOutcome::SoldOutRedis);
        Admission::SoldOut
    }

    /// Counts a refusal.
    fn refused(&self, outcome: StockOutcome, admission: Admission) -> Admission {
        self.metrics.request(outcome);
        admission
    }

    /// What an idempotency key's existing record answers.
    fn known(&self, raw: &[u8], key: Option<IdempotencyKey>) -> Admission {
        let Some(record) = Record::decode(raw) else {
            // Not a record we wrote: never guess it is a sale.
            return self.refused(StockOutcome::InFlight, Admission::InFlight);
        };
        if key.is_some_and(|k| k.fingerprint != record.fingerprint) {
            return self.refused(StockOutcome::Mismatch, Admission::Mismatch);
        }
        match (record.kind, record.answer) {
            (Kind::Done, Some(answer)) => {
                self.metrics.request(StockOutcome::Replayed);
                Admission::Replay(answer)
            }
            (Kind::InDoubt, _) => {
                let now = now_ms();
                let doubt = Doubt {
                    reservation: reservation_id(&record.member).to_owned(),
                    ends_in: record
                        .ends_ms
                        .filter(|ends| *ends > now)
                        .map(|ends| Duration::from_millis(ends - now)),
                };
                self.refused(StockOutcome::InDoubt, Admission::InDoubt(doubt))
            }
            _ => self.refused(StockOutcome::InFlight, Admission::InFlight),
        }
    }

    /// For a request the local marks call sold out but that carries an idempotency key:
    /// what the key's record says (a completed buy is replayed, not refused).
    pub(crate) async fn lookup(&self, resource: &Resource, key: IdempotencyKey) -> Lookup {
        let settings = self.settings.load();
        let segments = settings.config.segments.max(1);
        let reclaim = settings.config.in_doubt_retry == InDoubtRetry::Forward;
        let home = u16::try_from(key.hash % u128::from(segments)).unwrap_or(0);
        match self.ledger.read_record(resource.id, home, key.hash).await {
            Ok(Some(raw)) => match Record::decode(&raw) {
                Some(record)
                    if reclaim
                        && record.kind == Kind::InDoubt
                        && record.fingerprint == key.fingerprint =>
                {
                    Lookup::InDoubt
                }
                _ => Lookup::Answer(self.known(&raw, Some(key))),
            },
            Ok(None) => Lookup::NoRecord,
            Err(_) => {
                self.metrics.redis_errors.inc();
                Lookup::NoRecord
            }
        }
    }

    /// Counts a sold-out answer made from this instance's marks.
    pub(crate) fn sold_out_local(&self) {
        self.metrics.request(StockOutcome::SoldOutLocal);
    }

    /// Counts a request refused for its idempotency key (400).
    pub(crate) fn bad_key(&self) {
        self.metrics.request(StockOutcome::BadKey);
    }

    /// What an origin answer means for the units: by status, and for cacheguard's own
    /// answers by what they say happened (`shed`: never sent, so nothing sold).
    pub(crate) fn classify(&self, status: StatusCode, own: Option<&str>) -> Settlement {
        let settings = self.settings.load();
        let config = &settings.config;
        match own {
            Some("shed") => return Settlement::NotSold,
            Some(_) => return Settlement::InDoubt,
            None => {}
        }
        if status.is_success() {
            Settlement::Sold
        } else if config.not_sold.contains(&status) {
            Settlement::NotSold
        } else if config.origin_sold_out.contains(&status) {
            Settlement::OriginSoldOut
        } else {
            Settlement::InDoubt
        }
    }

    /// Settles a reservation by what the origin answered, and records the key's answer.
    pub(crate) async fn settle(
        self: &Arc<Self>,
        reservation: Reservation,
        settlement: Settlement,
        answer: Option<StoredAnswer>,
    ) {
        let settings = self.settings.load_full();
        let config = &settings.config;
        let (outcome, result) = match settlement {
            Settlement::Sold => (Outcome::Sold, StockSettled::Sold),
            Settlement::NotSold => (Outcome::Back, StockSettled::Returned),
            Settlement::OriginSoldOut => (Outcome::NoneLeft, StockSettled::OriginSoldOut),
            Settlement::InDoubt => (Outcome::Doubt, StockSettled::InDoubt),
        };
        // A sale without a key has no record to write and nobody waiting on it: it is
        // settled in a batch (`sales.rs`).
        if outcome == Outcome::Sold && reservation.key.is_none() && !reservation.member.is_empty() {
            self.metrics.settled(result);
            self.queue_sale(reservation).await;
            return;
        }
        let record = reservation.key.map(|(key, home)| {
            let (kind, ttl, answer) = match settlement {
                // Refused retries are refused for the key's whole life: past the
                // reservation the outcome is no better known. Forwarded ones go on with the
                // reservation while it lives; after it, a retry is a new buy, which an
                // origin that deduplicates by the key answers with the first order.
                Settlement::InDoubt => match config.in_doubt_retry {
                    InDoubtRetry::Reject => (
                        Kind::InDoubt,
                        config.idempotency_ttl.max(config.reservation_ttl),
                        None,
                    ),
                    InDoubtRetry::Forward => (Kind::InDoubt, config.reservation_ttl, None),
                },
                _ => (Kind::Done, config.idempotency_ttl, answer),
            };
            let ends_ms = (kind == Kind::InDoubt).then(|| {
                now_ms().saturating_add(millis(
                    reservation
                        .deadline
                        .saturating_duration_since(Instant::now()),
                ))
            });
            let answer = match kind {
                Kind::Done => Some(answer.unwrap_or_else(|| StoredAnswer {
                    status: 0,
                    headers: Vec::new(),
                    body: bytes::Bytes::new(),
                    cut: true,
                })),
                _ => None,
            };
            RecordWrite {
                key: key.hash,
                home,
                value: Record {
                    kind,
                    fingerprint: key.fingerprint,
                    segment: reservation.segment,
                    member: reservation.member.clone(),
                    ends_ms,
                    answer,
                }
                .encode(),
                ttl_ms: millis(ttl),
                forget: false,
            }
        });
        let settle = Settle {
            member: reservation.member.clone(),
            outcome,
            units: reservation.units,
            idle_ms: millis(idle(config)),
            consumed_kept_ms: millis(CONSUMED_KEPT.max(config.reconcile * 4)),
            answered: Instant::now(),
            record,
        };
        self.metrics.settled(result);
        self.settle_until(
            &reservation.resource,
            reservation.segment,
            settle,
            reservation.deadline,
        )
        .await;
    }

    /// Applies `settle`; when Redis does not take it, goes on trying in the background
    /// until the reservation's `deadline` (after which it expires by itself and a
    /// reconcile asks the origin). A settlement left undone would hold its units for the
    /// rest of the reservation's life: an undersell.
    async fn settle_until(
        self: &Arc<Self>,
        resource: &Arc<Resource>,
        segment: u16,
        settle: Settle,
        deadline: Instant,
    ) {
        if self.settle_once(resource, segment, &settle).await {
            return;
        }
        let (gate, resource) = (Arc::clone(self), Arc::clone(resource));
        tokio::spawn(async move {
            let mut pause = SETTLE_RETRY_FIRST;
            while Instant::now() + pause < deadline {
                tokio::time::sleep(pause).await;
                if gate.settle_once(&resource, segment, &settle).await {
                    return;
                }
                pause = (pause * 2).min(SETTLE_RETRY_MAX);
            }
            // Past its deadline the reservation is gone anyway: the origin's count decides.
            gate.reconcile_soon(&resource);
        });
    }

    /// One try of `settle`, with what follows from it. `false`: Redis did not answer.
    async fn settle_once(
        self: &Arc<Self>,
        resource: &Arc<Resource>,
        segment: u16,
        settle: &Settle,
    ) -> bool {
        let settled = match self.ledger.settle(resource.id, segment, settle).await {
            Ok(settled) => settled,
            Err(_) => {
                self.metrics.redis_errors.inc();
                return false;
            }
        };
        // The last buy in flight of a sold-out segment settled: a reconcile now is exact (no
        // reservation to subtract, no sale the origin's number could miss), and gives back
        // any unit an earlier reconcile counted twice (a sale the origin had already made
        // while its reservation was still live).
        if settled.left == 0 && settled.reserved == 0 && settle.outcome == Outcome::Sold {
            self.reconcile_soon(resource);
        }
        match settle.outcome {
            Outcome::Back if settled.removed => {
                if let Ok(left) = u64::try_from(settled.left)
                    && left > 0
                {
                    resource.unmark(segment);
                    self.publish(StockLevel::Restock, resource.id, segment, left)
                        .await;
                }
            }
            Outcome::NoneLeft => {
                self.sold_out(resource, segment, 0).await;
                self.reconcile_soon(resource);
            }
            Outcome::Doubt => self.reconcile_soon(resource),
            Outcome::Sold | Outcome::Back => {}
        }
        true
    }

    /// A buy whose script may have run but whose answer did not come back: its units (if
    /// it took any) go back, and its key's record (if it claimed one) is forgotten, so a
    /// lost answer does not hold units or the key until the reservation ends.
    fn cancel(
        self: &Arc<Self>,
        resource: &Arc<Resource>,
        segment: u16,
        member: String,
        units: u64,
        key: Option<(IdempotencyKey, u16)>,
    ) {
        let settings = self.settings.load();
        let config = &settings.config;
        let settle = Settle {
            member,
            outcome: Outcome::Back,
            units,
            idle_ms: millis(idle(config)),
            consumed_kept_ms: millis(CONSUMED_KEPT.max(config.reconcile * 4)),
            answered: Instant::now(),
            record: key.map(|(key, home)| RecordWrite {
                key: key.hash,
                home,
                value: Vec::new(),
                ttl_ms: 0,
                forget: true,
            }),
        };
        let deadline = Instant::now() + config.reservation_ttl;
        let (gate, resource) = (Arc::clone(self), Arc::clone(resource));
        tokio::spawn(async move {
            gate.settle_until(&resource, segment, settle, deadline)
                .await
        });
    }

    /// `segment` of `resource` has `left` units, fewer than some buy asks: marked here, and
    /// said on the bus.
    async fn sold_out(&self, resource: &Resource, segment: u16, left: u64) {
        let hold = self.settings.load().config.reconcile;
        resource.mark(segment, left, hold);
        self.metrics.sold_out_marks.inc();
        self.publish(StockLevel::SoldOut, resource.id, segment, left)
            .await;
    }

    async fn publish(&self, level: StockLevel, resource: u128, segment: u16, units: u64) {
        if let Ledger::Redis(redis) = &self.ledger {
            let event = StockEvent {
                level,
                instance: self.instance,
                resource,
                segment,
                units,
            };
            if redis.publish(&event.encode()).await.is_err() {
                debug!(message = "Stock event not published.", gate = %self.name);
            }
        }
    }

    /// A stock event from the bus (any instance, this one included).
    fn heard(&self, event: StockEvent) {
        let settings = self.settings.load();
        let config = &settings.config;
        if event.segment >= config.segments.max(1) {
            return;
        }
        let resource = match event.level {
            // A resource not in use here yet is marked too: the crowd reaches every
            // instance at once.
            StockLevel::SoldOut => self.resources.get_with(event.resource, || {
                Arc::new(Resource::new(event.resource, config.segments))
            }),
            StockLevel::Restock => match self.resources.get(&event.resource) {
                Some(resource) => resource,
                None => return,
            },
        };
        match event.level {
            StockLevel::SoldOut => resource.mark(event.segment, event.units, config.reconcile),
            StockLevel::Restock => resource.unmark(event.segment),
        }
    }

    /// Loads a resource a buy found unloaded (never loaded, or expired); `reconciled` is the
    /// resource's count of successful reconciles from before that buy. `false`: it could not
    /// be loaded.
    async fn load(self: &Arc<Self>, resource: &Arc<Resource>, reconciled: u64) -> bool {
        if resource.failed_until.load(Ordering::Relaxed) > now_ms() {
            return false;
        }
        self.reconcile(resource, Why::Load { reconciled }).await
    }

    /// Reconciles `resource` in the background, now.
    fn reconcile_soon(self: &Arc<Self>, resource: &Arc<Resource>) {
        let (gate, resource) = (Arc::clone(self), Arc::clone(resource));
        tokio::spawn(async move { gate.reconcile(&resource, Why::Soon).await });
    }

    /// Sets each segment of `resource` from the origin's number (see the module docs).
    /// `false` when the origin or Redis did not answer.
    async fn reconcile(self: &Arc<Self>, resource: &Arc<Resource>, why: Why) -> bool {
        let _turn = match why {
            // The crowd at a sale's opening finds the resource unloaded all at once: the
            // first buy loads it, and the others take its result instead of asking the
            // origin's source once each, one after another. A reconcile that succeeded
            // since a buy found the resource unloaded has loaded it: another one now,
            // with buys in flight, could only count some of them twice.
            Why::Load { reconciled } => {
                let turn = resource.reconciling.lock().await;
                if resource.reconciled.load(Ordering::Acquire) != reconciled {
                    return true;
                }
                if resource.failed_until.load(Ordering::Relaxed) > now_ms() {
                    return false;
                }
                turn
            }
            Why::Soon | Why::Periodic => match resource.reconciling.try_lock() {
                Ok(guard) => guard,
                Err(_) => {
                    if why == Why::Soon {
                        resource.again.store(true, Ordering::Relaxed);
                    }
                    return true;
                }
            },
        };
        loop {
            let done = self.reconcile_once(resource, why).await;
            if !resource.again.swap(false, Ordering::Relaxed) {
                return done;
            }
        }
    }

    async fn reconcile_once(&self, resource: &Resource, why: Why) -> bool {
        let settings = self.settings.load_full();
        let config = &settings.config;
        let Some((path, source_path)) = resource.paths.get() else {
            return true;
        };
        if why == Why::Periodic {
            let turn = millis(config.reconcile.mul_f64(0.8));
            match self
                .ledger
                .take_turn(resource.id, self.instance, turn)
                .await
            {
                Ok(true) => {}
                Ok(false) => {
                    self.metrics.reconciles_skipped.inc();
                    return true;
                }
                Err(_) => {
                    self.metrics.redis_errors.inc();
                    return false;
                }
            }
        }
        let Ok(_load) = tokio::time::timeout(settings.timeout, self.loads.acquire()).await else {
            self.metrics.reconciles_failed.inc();
            return false;
        };
        // When the reconcile began, on the clock of each segment's node (on a cluster they
        // differ): sales settled after it may be missing from the origin's number.
        let segments = config.segments.max(1);
        let mut since = Vec::with_capacity(usize::from(segments));
        for segment in 0..segments {
            match self.ledger.clock(resource.id, segment).await {
                Ok(now) => since.push(now),
                Err(_) => {
                    self.metrics.redis_errors.inc();
                    return false;
                }
            }
        }
        let remaining = match self
            .source
            .remaining(
                &settings.upstream,
                source_path,
                &config.source_json,
                settings.timeout,
            )
            .await
        {
            Ok(remaining) => remaining,
            Err(why) => {
                self.metrics.reconciles_failed.inc();
                resource.failed_until.store(
                    now_ms().saturating_add(millis(LOAD_FAILURE_HOLD)),
                    Ordering::Relaxed,
                );
                warn!(
                    message = "Stock source did not give a count; the gate keeps its number (or admits nothing before the first).",
                    gate = %self.name,
                    resource = %path,
                    error = %why,
                );
                return false;
            }
        };
        let mut delta: i64 = 0;
        for (segment, since) in (0..segments).zip(since) {
            let budget = share(remaining, segments, segment);
            let applied = match self
                .ledger
                .apply(
                    resource.id,
                    segment,
                    budget,
                    since,
                    millis(idle(config)),
                    millis(CONSUMED_KEPT.max(config.reconcile * 4)),
                )
                .await
            {
                Ok(applied) => applied,
                Err(_) => {
                    self.metrics.redis_errors.inc();
                    return false;
                }
            };
            let old = applied.old.unwrap_or(0);
            delta += i64::try_from(applied.new).unwrap_or(i64::MAX)
                - i64::try_from(old).unwrap_or(i64::MAX);
            if applied.new == 0 {
                if applied.old != Some(0) {
                    self.sold_out(resource, segment, 0).await;
                } else {
                    resource.mark(segment, 0, config.reconcile);
                }
            } else {
                resource.unmark(segment);
                if applied.old.is_none_or(|old| old == 0) {
                    self.publish(StockLevel::Restock, resource.id, segment, applied.new)
                        .await;
                }
            }
        }
        resource.failed_until.store(0, Ordering::Relaxed);
        resource.reconciled.fetch_add(1, Ordering::Release);
        self.metrics.reconciled(delta);
        debug!(message = "Stock reconciled.", gate = %self.name, resource = %path, remaining, delta);
        true
    }

    /// Every `reconcile`, reconciles the resources a request named within the last two
    /// intervals (one instance at a time each, a few at once).
    async fn run(self: Arc<Self>, stop: CancellationToken) {
        loop {
            let every = self.settings.load().config.reconcile;
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            let since = now_ms().saturating_sub(millis(every * 2));
            let due: Vec<Arc<Resource>> = self
                .resources
                .iter()
                .map(|(_, resource)| resource)
                .filter(|r| {
                    r.paths.get().is_some() && r.touched_ms.load(Ordering::Relaxed) >= since
                })
                .collect();
            let gate = &self;
            let pass = futures_util::stream::iter(due).for_each_concurrent(
                MAX_LOADS,
                |resource| async move {
                    gate.reconcile(&resource, Why::Periodic).await;
                },
            );
            tokio::select! {
                () = stop.cancelled() => return,
                () = pass => {}
            }
        }
    }
}

/// Segment `segment`'s share of `total` units over `segments`: even, the first ones take
/// the remainder.
fn share(total: u64, segments: u16, segment: u16) -> u64 {
    let n = u64::from(segments.max(1));
    total / n + u64::from(u64::from(segment) < total % n)
}

/// The id of a reservation member `<units>.<id>`.
fn reservation_id(member: &str) -> &str {
    member.split_once('.').map_or(member, |(_, id)| id)
}

fn units_of(member: &str) -> Option<u64> {
    member.split_once('.')?.0.parse().ok()
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn shares_add_up() {
        for total in [0, 1, 7, 1000] {
            for segments in [1, 3, 8] {
                let sum: u64 = (0..segments).map(|s| share(total, segments, s)).sum();
                assert_eq!(sum, total);
            }
        }
    }

    #[test]
    fn idempotency_keys_are_short_visible_ascii() {
        let ok = |v: &'static str| IdempotencyKey::parse(&HeaderValue::from_static(v), 0).is_ok();
        assert!(ok("8e03978e-40d5-43e8-bc93-6894a57f9324"));
        assert!(ok("\"8e03978e\""));
        assert!(!ok(""));
        assert!(!ok("\"\""));
        assert!(!ok("a b"));
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        assert!(IdempotencyKey::parse(&HeaderValue::from_str(&long).unwrap(), 0).is_err());
        let a = IdempotencyKey::parse(&HeaderValue::from_static("k"), 1).unwrap();
        let b = IdempotencyKey::parse(&HeaderValue::from_static("\"k\""), 2).unwrap();
        assert_eq!(a.hash, b.hash);
    }

    /// A gate over `ledger` with `extra` lines in its table (reservation_ttl 30s,
    /// idempotency_ttl 1h), and a resource of it with 5 units loaded. The resource has no
    /// paths, so its reconciles ask no origin.
    async fn gate_with_units(
        extra: &str,
        redis: Option<(RedisConn, Keyspace)>,
    ) -> (Arc<Gate>, Arc<Resource>) {
        let toml = format!(
            "[upstream]\nurl = \"http://127.0.0.1:9\"\n\
             [[stock]]\nname = \"seats\"\nkey = \"/s/{{id}}\"\n\
             source = {{ path = \"/stock/{{id}}\", json = \"/remaining\" }}\n\
             reservation_ttl = \"30s\"\nidempotency_ttl = \"1h\"\n{extra}\
             [[routes]]\nname = \"buy\"\nmatch = \"/s/{{id}}/orders\"\n\
             methods = [\"POST\"]\nstock = {{ gate = \"seats\" }}\n"
        );
        let vars = HashMap::<String, String>::new();
        let config = crate::config::Config::from_toml(&toml, "test.toml", &vars).expect("config");
        let gates = Gates::new(
            &config.stock,
            &config.upstream,
            redis,
            1,
            &Metrics::unregistered(),
        );
        let gate = Arc::clone(gates.get("seats").expect("the gate"));
        let resource = Arc::new(Resource::new(rand::random(), 1));
        gate.ledger
            .apply(resource.id, 0, 5, now_ms(), 3_600_000, 60_000)
            .await
            .expect("loaded");
        (gate, resource)
    }

    fn key(name: &'static str) -> IdempotencyKey {
        IdempotencyKey::parse(&HeaderValue::from_static(name), 0xaa).expect("a key")
    }

    /// A keyed buy admitted and settled in doubt (the origin timed out); its reservation id.
    async fn buy_in_doubt(gate: &Arc<Gate>, resource: &Arc<Resource>, k: IdempotencyKey) -> String {
        let Admission::Admitted(reservation) = gate.admit(resource, 1, Some(k)).await else {
            panic!("the first buy is admitted");
        };
        let id = reservation.id().to_owned();
        gate.settle(reservation, Settlement::InDoubt, None).await;
        id
    }

    /// What a retry of `k` is told: through the buy script, and through the record lookup
    /// a request the marks call sold out takes (both must agree).
    async fn retry(gate: &Arc<Gate>, resource: &Arc<Resource>, k: IdempotencyKey) -> Admission {
        let looked_up = gate.lookup(resource, k).await;
        let admitted = gate.admit(resource, 1, Some(k)).await;
        match (&looked_up, &admitted) {
            (Lookup::Answer(Admission::InDoubt(a)), Admission::InDoubt(b)) => {
                assert_eq!(a.reservation, b.reservation);
            }
            (Lookup::InDoubt, Admission::Retried(_))
            | (Lookup::NoRecord, Admission::Admitted(_)) => {}
            other => panic!("lookup and buy disagree: {other:?}"),
        }
        admitted
    }

    /// Regression: a retry of a buy in doubt was taken up again and forwarded (a second sale
    /// at an origin that does not deduplicate by the key). Refused by default: with the
    /// reservation's remaining life while it holds its unit, without once it ended, and as
    /// a new buy only once the key's record is gone (`idempotency_ttl`).
    #[tokio::test(start_paused = true)]
    async fn a_retry_in_doubt_is_refused_for_the_key_s_life_in_memory() {
        let (gate, resource) = gate_with_units("", None).await;
        let k = key("k-doubt");
        let id = buy_in_doubt(&gate, &resource, k).await;
        tokio::time::advance(Duration::from_secs(10)).await;
        match retry(&gate, &resource, k).await {
            Admission::InDoubt(doubt) => {
                assert_eq!(doubt.reservation, id);
                assert_eq!(doubt.ends_in, Some(Duration::from_secs(20)));
            }
            other => panic!("refused while its reservation lives, got {other:?}"),
        }
        tokio::time::advance(Duration::from_secs(21)).await;
        match retry(&gate, &resource, k).await {
            Admission::InDoubt(doubt) => assert_eq!(doubt.ends_in, None),
            other => panic!("still refused after the reservation, got {other:?}"),
        }
        assert!(
            matches!(
                gate.admit(&resource, 1, Some(key("k-other"))).await,
                Admission::Admitted(_)
            ),
            "another key buys"
        );
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(
            matches!(retry(&gate, &resource, k).await, Admission::Admitted(_)),
            "a key past idempotency_ttl is new"
        );
        assert_eq!(gate.metrics.counts().request(StockOutcome::InDoubt), 4);
    }

    /// `in_doubt_retry = "forward"`: the retry goes on with the first reservation, no new
    /// unit; once the reservation ended, a retry is a new buy.
    #[tokio::test(start_paused = true)]
    async fn a_retry_in_doubt_is_forwarded_when_configured_in_memory() {
        let (gate, resource) = gate_with_units("in_doubt_retry = \"forward\"\n", None).await;
        let k = key("k-doubt");
        let id = buy_in_doubt(&gate, &resource, k).await;
        match retry(&gate, &resource, k).await {
            Admission::Retried(again) => {
                assert_eq!(again.id(), id);
                gate.settle(again, Settlement::InDoubt, None).await;
            }
            other => panic!("forwarded again, got {other:?}"),
        }
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(matches!(
            retry(&gate, &resource, k).await,
            Admission::Admitted(_)
        ));
    }

    /// The same in Redis (standalone; the cluster and the whole path through a timed-out
    /// origin are in `tests/it/stock_gate.rs`), on Redis's clock: the refusal and the
    /// forward.
    #[tokio::test]
    async fn a_retry_in_doubt_is_refused_or_forwarded_in_redis() {
        let redis = crate::test_redis::TestRedis::start().await;
        for (extra, forward) in [("", false), ("in_doubt_retry = \"forward\"\n", true)] {
            let toml = format!(
                "[upstream]\nurl = \"http://127.0.0.1:9\"\n[redis]\nurl = \"{}\"\n",
                redis.url()
            );
            let vars = HashMap::<String, String>::new();
            let config =
                crate::config::Config::from_toml(&toml, "test.toml", &vars).expect("config");
            let redis_config = config.redis.as_ref().expect("shared mode");
            let conn = RedisConn::start(
                redis_config,
                Metrics::unregistered(),
                CancellationToken::new(),
            )
            .await
            .expect("redis");
            let keys = Keyspace::new(&redis_config.key_prefix);
            let (gate, resource) = gate_with_units(extra, Some((conn, keys))).await;
            let k = key("k-doubt");
            let id = buy_in_doubt(&gate, &resource, k).await;
            match (retry(&gate, &resource, k).await, forward) {
                (Admission::InDoubt(doubt), false) => {
                    assert_eq!(doubt.reservation, id);
                    let left = doubt.ends_in.expect("the reservation lives");
                    assert!(left > Duration::from_secs(25), "{left:?}");
                }
                (Admission::Retried(again), true) => assert_eq!(again.id(), id),
                (other, _) => panic!("forward={forward}: {other:?}"),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lapsed_mark_sends_one_request_to_redis() {
        let resource = Resource::new(1, 2);
        let hold = Duration::from_secs(1);
        resource.mark(0, 0, hold);
        assert!(resource.short(0, 1, hold));
        assert!(!resource.short(1, 1, hold), "segment 1 is not marked");
        resource.mark(1, 1, hold);
        assert!(!resource.short(1, 1, hold), "one left is enough for one");
        assert!(resource.short(1, 2, hold));
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert!(
            !resource.short(0, 1, hold),
            "the first request after it lapsed asks"
        );
        assert!(
            resource.short(0, 1, hold),
            "the others keep the mark meanwhile"
        );
    }
}
