//! A slow, database-backed-API stand-in for the bench scripts.
//!
//! - `GET /items/{id}`: exactly `--body-bytes` (1024) bytes of JSON after `--delay-ms`
//!   (per-request override `?delay_ms=N`); 404 (after the same delay) for ids outside
//!   1..=`--max-id`.
//! - `GET /stats`: JSON counters (total, per path, in flight, max in flight).
//! - `POST /stats/reset` (GET accepted too): zero every counter.
//! - `GET /internal/ids`: every existing id, `1..=--max-id`, one per line (`text/plain`,
//!   chunked, generated on the fly in batches: never one big string). The source of a
//!   cacheguard `[[bloom]]` filter (`source = { url = "/internal/ids" }`); no delay.
//!
//! - `GET /stats/timeline`: the counted requests (those in `total`) per `--timeline-bucket-ms`
//!   (100 ms) bucket since the last reset (or the start), with the largest in-flight count
//!   seen in each bucket: `{"bucket_ms", "t0_unix_ms", "elapsed_ms", "counts": [..],
//!   "max_in_flight": [..], "overflow"}`. Buckets cover the first hour after a reset; later
//!   requests are only counted in `overflow`. `/stats/reset` restarts it too. For rates over
//!   time (bench/avalanche.sh: origin req/s in any 1 s window).
//!
//! - With `--kv`: a versioned key-value store with a lagging read replica, for the
//!   write-path consistency bench (bench/stale_window.sh). Every key exists, at version 0
//!   until its first write.
//!   - `PUT /kv/{key}` (body read and ignored): after `--kv-write-delay-ms`, commits the next
//!     version on the primary and answers `200` `{"key":"<key>","version":N}` with the new N.
//!     `PATCH` and `DELETE` are the same write.
//!   - `GET /kv/{key}` (`HEAD` alike): reads, on arrival, the version the replica shows (the
//!     newest one committed at least `--replica-lag-ms` ago), waits `--kv-read-delay-ms` and
//!     answers `200` `{"key":"<key>","version":N}` with what it read: a slow read racing a
//!     write answers the old version.
//!   - With `--kv-tags` both carry `Surrogate-Key: kv-<key> kv-all`. Other methods get 405.
//!   - `--delay-ms` does not apply to `/kv`. `/stats` adds `kv_reads` and `kv_writes`;
//!     `/stats/reset` zeroes those counters but keeps the versions.
//!   - The **write gap** of a key: from a write's answer (its commit) to the next write of
//!     the same key arriving, when none was at the origin between them; for serialized
//!     writes of one key, how long the lock took to go from one writer to the next
//!     (bench/serialize.sh). `/stats` adds `kv_write_gap_us: {count, p50, p99, max}`;
//!     `/stats/reset` forgets the gaps (at most 1,000,000 are kept between resets).
//!   - Keys live in 64 mutex-guarded shards; each key keeps only the commits younger than
//!     the lag (the rest are folded into the version the replica shows).
//!
//! - With `--shop`: a flash-sale origin for the stock-gate bench (bench/flash_sale.sh), the
//!   source of truth a cacheguard `[[stock]]` gate fronts. Resources are
//!   `/trains/{train}/seats/{type}`; one not seen before has `--shop-stock` units.
//!   - `POST <resource>/orders` (body read and ignored; any resource path, so that an
//!     ungated route can buy too): after
//!     `--shop-delay-ms` (the database transaction), a conditional decrement of one unit:
//!     `201 {"order":N}` when one was left, else `409` problem+json (sold out).
//!   - `GET /internal/stock/{t}/{s}`: `{"remaining":N}` (the gate's source).
//!   - `PUT /shop/stock/{t}/{s}` with a decimal body: that resource now has that many units
//!     (its counters start again).
//!   - `GET /shop/stats`: per resource (the first 1000) and in all: the units at the start,
//!     left, buy requests, sold, refused, and the unix ms of the first and last sale and of
//!     the moment it sold out.
//!
//!   Shop requests are counted in `/shop/stats` only (not in `total`/`paths`: they are
//!   many, and the counters there cost a lock and an allocation each); `/stats/reset` leaves
//!   them alone.
//!
//! The stats endpoints and `/internal/ids` are not counted in `total`/`paths` (so `total`
//! stays "API requests that reached the origin"); `/stats` reports the id-list downloads
//! separately as `ids_lists`. Listens on 127.0.0.1 only.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::convert::Infallible;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpSocket;

#[derive(Parser, Debug)]
#[command(about = "Slow JSON origin with request counters (bench tool)")]
struct Args {
    /// Port on 127.0.0.1.
    #[arg(long)]
    port: u16,
    /// Delay before every /items answer, in milliseconds.
    #[arg(long, default_value_t = 200)]
    delay_ms: u64,
    /// Largest existing id; ids outside 1..=max-id answer 404.
    #[arg(long, default_value_t = 100_000)]
    max_id: u64,
    /// Exact size of a 200 body.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Width of one `/stats/timeline` bucket, in milliseconds.
    #[arg(long, default_value_t = 100)]
    timeline_bucket_ms: u64,
    /// Serve the versioned KV store at /kv/{key} (GET reads the replica, PUT writes).
    #[arg(long)]
    kv: bool,
    /// KV: how far the replica (what GET answers) trails the primary, in milliseconds.
    #[arg(long, default_value_t = 0, requires = "kv")]
    replica_lag_ms: u64,
    /// KV: time between a GET reading its version (on arrival) and answering, in ms.
    #[arg(long, default_value_t = 0, requires = "kv")]
    kv_read_delay_ms: u64,
    /// KV: time a PUT waits before it commits and answers, in milliseconds.
    #[arg(long, default_value_t = 0, requires = "kv")]
    kv_write_delay_ms: u64,
    /// KV: answers carry `Surrogate-Key: kv-<key> kv-all`.
    #[arg(long, requires = "kv")]
    kv_tags: bool,
    /// Serve the flash-sale shop (buys, the stock source, /shop/stats).
    #[arg(long)]
    shop: bool,
    /// Shop: the units of a resource not seen before.
    #[arg(long, default_value_t = 1000, requires = "shop")]
    shop_stock: u64,
    /// Shop: time a buy takes before it decides (its database transaction), in ms.
    #[arg(long, default_value_t = 0, requires = "shop")]
    shop_delay_ms: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One key of the KV store.
#[derive(Default)]
struct KvKey {
    /// The newest committed version (the primary).
    primary: u64,
    /// The newest version known to be visible on the replica.
    replica: u64,
    /// Commits younger than the lag, `(commit time, version)`, oldest first.
    pending: VecDeque<(Instant, u64)>,
    /// When the last write was committed, if no write of the key is at the origin since.
    idle_since: Option<Instant>,
}

impl KvKey {
    /// The version the replica shows at `now`: the newest one committed at least `lag` ago.
    fn visible(&mut self, now: Instant, lag: Duration) -> u64 {
        while let Some(&(at, version)) = self.pending.front() {
            if now.saturating_duration_since(at) < lag {
                break;
            }
            self.replica = version;
            self.pending.pop_front();
        }
        self.replica
    }

    fn commit(&mut self, now: Instant, lag: Duration) -> u64 {
        self.visible(now, lag);
        self.primary += 1;
        self.pending.push_back((now, self.primary));
        self.primary
    }
}

/// The versioned KV store (`--kv`), sharded so requests for different keys rarely contend.
struct KvStore {
    lag: Duration,
    read_delay: Duration,
    write_delay: Duration,
    tags: bool,
    shards: Vec<Mutex<HashMap<String, KvKey>>>,
    reads: AtomicU64,
    writes: AtomicU64,
    /// Write gaps in µs since the last reset (see the module docs).
    gaps: Mutex<Vec<u64>>,
}

impl KvStore {
    const SHARDS: usize = 64;

    fn new(args: &Args) -> Self {
        KvStore {
            lag: Duration::from_millis(args.replica_lag_ms),
            read_delay: Duration::from_millis(args.kv_read_delay_ms),
            write_delay: Duration::from_millis(args.kv_write_delay_ms),
            tags: args.kv_tags,
            shards: (0..Self::SHARDS)
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            gaps: Mutex::new(Vec::new()),
        }
    }

    const MAX_GAPS: usize = 1_000_000;

    /// A write of `key` arrived: its gap since the last one's commit is recorded, if the key
    /// was idle since.
    fn write_arrived(&self, key: &str) {
        let gap = {
            let mut shard = lock(self.shard(key));
            shard
                .get_mut(key)
                .and_then(|k| k.idle_since.take())
                .map(|since| since.elapsed())
        };
        if let Some(gap) = gap {
            let mut gaps = lock(&self.gaps);
            if gaps.len() < Self::MAX_GAPS {
                gaps.push(u64::try_from(gap.as_micros()).unwrap_or(u64::MAX));
            }
        }
    }

    /// `{count, p50, p99, max}` of the write gaps, in µs.
    fn gaps_json(&self) -> serde_json::Value {
        let mut gaps = lock(&self.gaps).clone();
        gaps.sort_unstable();
        let at = |q: f64| -> u64 {
            if gaps.is_empty() {
                return 0;
            }
            let i = ((gaps.len() as f64 * q).ceil() as usize).clamp(1, gaps.len()) - 1;
            gaps[i]
        };
        serde_json::json!({
            "count": gaps.len(),
            "p50": at(0.50),
            "p99": at(0.99),
            "max": gaps.last().copied().unwrap_or(0),
        })
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, KvKey>> {
        let mut h = DefaultHasher::new();
        key.hash(&mut h);
        &self.shards[(h.finish() % Self::SHARDS as u64) as usize]
    }

    /// The version the replica shows now (0 for a key never written; reads add no key).
    fn read(&self, key: &str) -> u64 {
        let mut shard = lock(self.shard(key));
        match shard.get_mut(key) {
            Some(k) => k.visible(Instant::now(), self.lag),
            None => 0,
        }
    }

    /// Commits the next version of `key` on the primary; returns it.
    fn write(&self, key: &str) -> u64 {
        let mut shard = lock(self.shard(key));
        let now = Instant::now();
        let k = match shard.get_mut(key) {
            Some(k) => k,
            None => shard.entry(key.to_owned()).or_default(),
        };
        k.idle_since = Some(now);
        k.commit(now, self.lag)
    }
}

/// One resource of the shop.
#[derive(Clone, Copy, Default)]
struct ShopItem {
    initial: u64,
    remaining: u64,
    buys: u64,
    sold: u64,
    refused: u64,
    first_sale_ms: Option<u64>,
    last_sale_ms: Option<u64>,
    sold_out_ms: Option<u64>,
}

impl ShopItem {
    fn with(units: u64) -> Self {
        ShopItem {
            initial: units,
            remaining: units,
            ..ShopItem::default()
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "initial": self.initial,
            "remaining": self.remaining,
            "buys": self.buys,
            "sold": self.sold,
            "refused": self.refused,
            "first_sale_unix_ms": self.first_sale_ms,
            "last_sale_unix_ms": self.last_sale_ms,
            "sold_out_unix_ms": self.sold_out_ms,
        })
    }
}

/// The flash-sale shop (`--shop`): stock per resource with a conditional decrement.
struct Shop {
    default_units: u64,
    delay: Duration,
    items: Mutex<HashMap<String, ShopItem>>,
}

/// What a shop request is, by method and path.
enum ShopRequest<'a> {
    Buy(&'a str),
    Stock(&'a str),
    Set(&'a str),
    Stats,
}

impl ShopRequest<'_> {
    fn of<'a>(method: &Method, path: &'a str) -> Option<ShopRequest<'a>> {
        if path == "/shop/stats" && method == Method::GET {
            return Some(ShopRequest::Stats);
        }
        if let Some(rest) = path.strip_prefix("/internal/stock/") {
            return (method == Method::GET).then_some(ShopRequest::Stock(rest));
        }
        if let Some(rest) = path.strip_prefix("/shop/stock/") {
            return (method == Method::PUT).then_some(ShopRequest::Set(rest));
        }
        let resource = path.strip_suffix("/orders")?;
        (method == Method::POST && !resource.is_empty()).then_some(ShopRequest::Buy(resource))
    }
}

impl Shop {
    fn new(args: &Args) -> Self {
        Shop {
            default_units: args.shop_stock,
            delay: Duration::from_millis(args.shop_delay_ms),
            items: Mutex::new(HashMap::new()),
        }
    }

    /// `/trains/{t}/seats/{s}` of the `{t}/{s}` in a stock path.
    fn resource(rest: &str) -> Option<String> {
        let (train, kind) = rest.split_once('/')?;
        (!train.is_empty() && !kind.is_empty() && !kind.contains('/'))
            .then(|| format!("/trains/{train}/seats/{kind}"))
    }

    /// One buy of one unit of `resource`: `Some(order number)` when it sold.
    fn buy(&self, resource: &str) -> Option<u64> {
        let mut items = lock(&self.items);
        let default_units = self.default_units;
        let item = match items.get_mut(resource) {
            Some(item) => item,
            None => items
                .entry(resource.to_owned())
                .or_insert_with(|| ShopItem::with(default_units)),
        };
        item.buys += 1;
        if item.remaining == 0 {
            item.refused += 1;
            return None;
        }
        let now = unix_ms();
        item.remaining -= 1;
        item.sold += 1;
        item.first_sale_ms.get_or_insert(now);
        item.last_sale_ms = Some(now);
        if item.remaining == 0 {
            item.sold_out_ms = Some(now);
        }
        Some(item.sold)
    }

    fn remaining(&self, resource: String) -> u64 {
        let default_units = self.default_units;
        lock(&self.items)
            .entry(resource)
            .or_insert_with(|| ShopItem::with(default_units))
            .remaining
    }

    fn stats(&self) -> String {
        let items = lock(&self.items);
        let mut total = ShopItem::default();
        for item in items.values() {
            total.initial += item.initial;
            total.remaining += item.remaining;
            total.buys += item.buys;
            total.sold += item.sold;
            total.refused += item.refused;
        }
        let mut listed: Vec<(&String, &ShopItem)> = items.iter().collect();
        listed.sort_by(|a, b| a.0.cmp(b.0));
        let per_item: serde_json::Map<String, serde_json::Value> = listed
            .into_iter()
            .take(1000)
            .map(|(path, item)| (path.clone(), item.json()))
            .collect();
        serde_json::json!({
            "resources": items.len(),
            "initial": total.initial,
            "remaining": total.remaining,
            "buys": total.buys,
            "sold": total.sold,
            "refused": total.refused,
            "items": per_item,
        })
        .to_string()
    }
}

/// A request's whole body, at most `limit` bytes (`None` when longer or broken off).
async fn read_body(req: Request<Incoming>, limit: usize) -> Option<Bytes> {
    Limited::new(req.into_body(), limit)
        .collect()
        .await
        .ok()
        .map(|body| body.to_bytes())
}

/// A shop request (`--shop`).
async fn shop_handle(
    shop: &Shop,
    req: Request<Incoming>,
    what: ShopRequest<'_>,
) -> Response<RespBody> {
    match what {
        ShopRequest::Stats => json_response(StatusCode::OK, shop.stats()),
        ShopRequest::Stock(rest) => match Shop::resource(rest) {
            Some(resource) => json_response(
                StatusCode::OK,
                format!("{{\"remaining\":{}}}", shop.remaining(resource)),
            ),
            None => json_response(StatusCode::NOT_FOUND, r#"{"error":"no such resource"}"#),
        },
        ShopRequest::Set(rest) => {
            let Some(resource) = Shop::resource(rest) else {
                return json_response(StatusCode::NOT_FOUND, r#"{"error":"no such resource"}"#);
            };
            let units = read_body(req, 64).await.and_then(|body| {
                std::str::from_utf8(&body)
                    .ok()
                    .and_then(|t| t.trim().parse::<u64>().ok())
            });
            let Some(units) = units else {
                return json_response(StatusCode::BAD_REQUEST, r#"{"error":"body: a number"}"#);
            };
            lock(&shop.items).insert(resource, ShopItem::with(units));
            json_response(StatusCode::OK, format!("{{\"units\":{units}}}"))
        }
        ShopRequest::Buy(resource) => {
            // read (and drop) the body, so the connection stays usable
            if read_body(req, 1 << 16).await.is_none() {
                return json_response(StatusCode::BAD_REQUEST, r#"{"error":"bad body"}"#);
            }
            if !shop.delay.is_zero() {
                tokio::time::sleep(shop.delay).await;
            }
            match shop.buy(resource) {
                Some(order) => json_response(StatusCode::CREATED, format!("{{\"order\":{order}}}")),
                None => {
                    let mut resp = json_response(StatusCode::CONFLICT, r#"{"type":"sold-out"}"#);
                    resp.headers_mut().insert(
                        CONTENT_TYPE,
                        HeaderValue::from_static("application/problem+json"),
                    );
                    resp
                }
            }
        }
    }
}

/// Counted requests per time bucket since `t0` (the last reset), for `/stats/timeline`.
struct Timeline {
    bucket_ms: u64,
    /// Process-local time base: `t0` is `base + t0_ns`.
    base: Instant,
    t0_ns: AtomicU64,
    t0_unix_ms: AtomicU64,
    counts: Vec<AtomicU64>,
    max_in_flight: Vec<AtomicU64>,
    overflow: AtomicU64,
}

impl Timeline {
    /// One hour of buckets.
    const SPAN_MS: u64 = 3_600_000;

    fn new(bucket_ms: u64) -> Self {
        let bucket_ms = bucket_ms.max(1);
        let n = Self::SPAN_MS.div_ceil(bucket_ms) as usize;
        Timeline {
            bucket_ms,
            base: Instant::now(),
            t0_ns: AtomicU64::new(0),
            t0_unix_ms: AtomicU64::new(unix_ms()),
            counts: (0..n).map(|_| AtomicU64::new(0)).collect(),
            max_in_flight: (0..n).map(|_| AtomicU64::new(0)).collect(),
            overflow: AtomicU64::new(0),
        }
    }

    fn elapsed_ms(&self) -> u64 {
        let now_ns = self.base.elapsed().as_nanos() as u64;
        now_ns.saturating_sub(self.t0_ns.load(Ordering::SeqCst)) / 1_000_000
    }

    /// The bucket of "now", if it is within the span.
    fn bucket(&self) -> Option<usize> {
        let i = (self.elapsed_ms() / self.bucket_ms) as usize;
        (i < self.counts.len()).then_some(i)
    }

    fn count(&self) {
        match self.bucket() {
            Some(i) => {
                self.counts[i].fetch_add(1, Ordering::Relaxed);
            }
            None => {
                self.overflow.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn in_flight(&self, now: u64) {
        if let Some(i) = self.bucket() {
            self.max_in_flight[i].fetch_max(now, Ordering::Relaxed);
        }
    }

    fn reset(&self) {
        for c in self.counts.iter().chain(self.max_in_flight.iter()) {
            c.store(0, Ordering::Relaxed);
        }
        self.overflow.store(0, Ordering::Relaxed);
        self.t0_unix_ms.store(unix_ms(), Ordering::SeqCst);
        self.t0_ns
            .store(self.base.elapsed().as_nanos() as u64, Ordering::SeqCst);
    }

    fn json(&self) -> String {
        let elapsed = self.elapsed_ms();
        let n = ((elapsed / self.bucket_ms) as usize + 1).min(self.counts.len());
        let load = |v: &[AtomicU64]| {
            v[..n]
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect::<Vec<_>>()
        };
        serde_json::json!({
            "bucket_ms": self.bucket_ms,
            "t0_unix_ms": self.t0_unix_ms.load(Ordering::SeqCst),
            "elapsed_ms": elapsed,
            "counts": load(&self.counts),
            "max_in_flight": load(&self.max_in_flight),
            "overflow": self.overflow.load(Ordering::Relaxed),
        })
        .to_string()
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Default)]
struct Stats {
    total: AtomicU64,
    items_ok: AtomicU64,
    items_404: AtomicU64,
    other: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    /// `GET /internal/ids` downloads started (not part of `total`).
    ids_lists: AtomicU64,
    paths: Mutex<BTreeMap<String, u64>>,
}

impl Stats {
    fn reset(&self) {
        self.total.store(0, Ordering::SeqCst);
        self.items_ok.store(0, Ordering::SeqCst);
        self.items_404.store(0, Ordering::SeqCst);
        self.other.store(0, Ordering::SeqCst);
        self.ids_lists.store(0, Ordering::SeqCst);
        // in_flight is live state, not a counter: keep it, restart the max from it.
        self.max_in_flight
            .store(self.in_flight.load(Ordering::SeqCst), Ordering::SeqCst);
        self.paths.lock().expect("stats lock").clear();
    }

    fn json(&self) -> serde_json::Value {
        let paths = self.paths.lock().expect("stats lock");
        // Per-path counts are for small runs (stampedes); past 1000 paths only the count is kept.
        let per_path = if paths.len() <= 1000 {
            serde_json::to_value(&*paths).expect("map to json")
        } else {
            serde_json::Value::Null
        };
        serde_json::json!({
            "total": self.total.load(Ordering::SeqCst),
            "items_ok": self.items_ok.load(Ordering::SeqCst),
            "items_404": self.items_404.load(Ordering::SeqCst),
            "other": self.other.load(Ordering::SeqCst),
            "in_flight": self.in_flight.load(Ordering::SeqCst),
            "max_in_flight": self.max_in_flight.load(Ordering::SeqCst),
            "ids_lists": self.ids_lists.load(Ordering::SeqCst),
            "distinct_paths": paths.len(),
            "paths": per_path,
        })
    }
}

struct State {
    args: Args,
    stats: Stats,
    timeline: Timeline,
    kv: Option<KvStore>,
    shop: Option<Shop>,
}

/// `{"id":N,"name":"item N","payload":"xxx…"}` of exactly `n` bytes (at least the frame).
fn item_body(id: u64, n: usize) -> Bytes {
    let head = format!("{{\"id\":{id},\"name\":\"item {id}\",\"payload\":\"");
    let tail = "\"}";
    let pad = n.saturating_sub(head.len() + tail.len());
    let mut s = String::with_capacity(n);
    s.push_str(&head);
    s.extend(std::iter::repeat_n('x', pad));
    s.push_str(tail);
    Bytes::from(s)
}

/// The ids `next..=last`, one per line, produced a batch at a time as the client reads.
struct IdsBody {
    next: u64,
    last: u64,
    done: bool,
}

impl IdsBody {
    fn new(last: u64) -> Self {
        IdsBody {
            next: 1,
            last,
            done: last == 0,
        }
    }

    /// Ids per frame: 8192 ids is ~50-60 KiB of text.
    const BATCH: u64 = 8192;
}

impl Body for IdsBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        use std::fmt::Write;
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let end = this.last.min(this.next.saturating_add(Self::BATCH - 1));
        let mut s = String::with_capacity(((end - this.next + 1) * 8) as usize);
        for id in this.next..=end {
            let _ = writeln!(s, "{id}");
        }
        if end == this.last {
            this.done = true;
        } else {
            this.next = end + 1;
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(s)))))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        // no exact length: hyper sends the body chunked
        SizeHint::default()
    }
}

type RespBody = Either<Full<Bytes>, IdsBody>;

fn json_response(status: StatusCode, body: impl Into<Bytes>) -> Response<RespBody> {
    let mut resp = Response::new(Either::Left(Full::new(body.into())));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn query_delay(query: Option<&str>) -> Option<u64> {
    query?
        .split('&')
        .find_map(|kv| kv.strip_prefix("delay_ms="))
        .and_then(|v| v.parse().ok())
}

/// Decrements the in-flight gauge when the request ends (also when the client goes away).
struct InFlight<'a>(&'a Stats);

impl<'a> InFlight<'a> {
    fn enter(stats: &'a Stats, timeline: &Timeline) -> Self {
        let now = stats.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        stats.max_in_flight.fetch_max(now, Ordering::SeqCst);
        timeline.in_flight(now);
        InFlight(stats)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, Infallible> {
    let path = req.uri().path().to_owned();
    let stats = &state.stats;
    match (req.method(), path.as_str()) {
        (&Method::GET, "/stats") => return Ok(json_response(StatusCode::OK, state.stats_json())),
        (&Method::GET, "/stats/timeline") => {
            return Ok(json_response(StatusCode::OK, state.timeline.json()));
        }
        (&Method::POST | &Method::GET, "/stats/reset") => {
            stats.reset();
            state.timeline.reset();
            if let Some(kv) = &state.kv {
                kv.reads.store(0, Ordering::SeqCst);
                kv.writes.store(0, Ordering::SeqCst);
                lock(&kv.gaps).clear();
            }
            return Ok(json_response(StatusCode::OK, state.stats_json()));
        }
        (&Method::GET, "/internal/ids") => {
            stats.ids_lists.fetch_add(1, Ordering::SeqCst);
            let mut resp = Response::new(Either::Right(IdsBody::new(state.args.max_id)));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            return Ok(resp);
        }
        _ => {}
    }

    if let Some(shop) = &state.shop
        && let Some(what) = ShopRequest::of(req.method(), &path)
    {
        return Ok(shop_handle(shop, req, what).await);
    }

    stats.total.fetch_add(1, Ordering::SeqCst);
    state.timeline.count();
    *stats
        .paths
        .lock()
        .expect("stats lock")
        .entry(path.clone())
        .or_insert(0) += 1;

    if let Some(kv) = &state.kv
        && let Some(key) = path.strip_prefix("/kv/")
    {
        let _guard = InFlight::enter(stats, &state.timeline);
        return Ok(kv_handle(kv, req, key).await);
    }
    let Some(id) = path.strip_prefix("/items/") else {
        stats.other.fetch_add(1, Ordering::SeqCst);
        return Ok(json_response(
            StatusCode::NOT_FOUND,
            r#"{"error":"no such path"}"#,
        ));
    };
    let _guard = InFlight::enter(stats, &state.timeline);
    let delay = query_delay(req.uri().query()).unwrap_or(state.args.delay_ms);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    match id.parse::<u64>() {
        Ok(id) if (1..=state.args.max_id).contains(&id) && req.method() == Method::GET => {
            stats.items_ok.fetch_add(1, Ordering::SeqCst);
            Ok(json_response(
                StatusCode::OK,
                item_body(id, state.args.body_bytes),
            ))
        }
        _ => {
            stats.items_404.fetch_add(1, Ordering::SeqCst);
            Ok(json_response(
                StatusCode::NOT_FOUND,
                r#"{"error":"not found"}"#,
            ))
        }
    }
}

impl State {
    /// `/stats`, with the KV counters in KV mode.
    fn stats_json(&self) -> String {
        let mut json = self.stats.json();
        if let Some(kv) = &self.kv {
            json["kv_reads"] = kv.reads.load(Ordering::SeqCst).into();
            json["kv_writes"] = kv.writes.load(Ordering::SeqCst).into();
            json["kv_write_gap_us"] = kv.gaps_json();
        }
        json.to_string()
    }
}

/// `{"key":"<key>","version":N}`, with the surrogate keys when `--kv-tags`.
fn kv_answer(kv: &KvStore, key: &str, version: u64) -> Response<RespBody> {
    let body = serde_json::json!({"key": key, "version": version}).to_string();
    let mut resp = json_response(StatusCode::OK, body);
    if kv.tags
        && let Ok(value) = HeaderValue::from_str(&format!("kv-{key} kv-all"))
    {
        resp.headers_mut()
            .insert(HeaderName::from_static("surrogate-key"), value);
    }
    resp
}

/// `/kv/{key}` in KV mode. Nothing here trusts the request: a bad key or method gets 4xx.
async fn kv_handle(kv: &KvStore, req: Request<Incoming>, key: &str) -> Response<RespBody> {
    if key.is_empty() || key.contains('/') {
        return json_response(StatusCode::NOT_FOUND, r#"{"error":"no such key"}"#);
    }
    match *req.method() {
        Method::GET | Method::HEAD => {
            kv.reads.fetch_add(1, Ordering::Relaxed);
            let version = kv.read(key);
            if !kv.read_delay.is_zero() {
                tokio::time::sleep(kv.read_delay).await;
            }
            kv_answer(kv, key, version)
        }
        // PATCH and DELETE are writes like PUT (so one instance can serve one method
        // through one route and another through another: bench/serialize.sh).
        Method::PUT | Method::PATCH | Method::DELETE => {
            kv.write_arrived(key);
            // read (and drop) the body, so the connection stays usable; bounded
            if read_body(req, 1 << 20).await.is_none() {
                return json_response(StatusCode::BAD_REQUEST, r#"{"error":"bad body"}"#);
            }
            if !kv.write_delay.is_zero() {
                tokio::time::sleep(kv.write_delay).await;
            }
            kv.writes.fetch_add(1, Ordering::Relaxed);
            let version = kv.write(key);
            kv_answer(kv, key, version)
        }
        _ => {
            let mut resp = json_response(
                StatusCode::METHOD_NOT_ALLOWED,
                r#"{"error":"method not allowed"}"#,
            );
            resp.headers_mut().insert(
                ALLOW,
                HeaderValue::from_static("GET, HEAD, PUT, PATCH, DELETE"),
            );
            resp
        }
    }
}

fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(serve(args))
}

async fn serve(args: Args) -> std::io::Result<()> {
    let addr = SocketAddr::from(([127, 0, 0, 1], args.port));
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    let listener = socket.listen(4096)?;
    eprintln!(
        "bench-origin listening on http://{addr} (delay {} ms, ids 1..={}, {} byte bodies)",
        args.delay_ms, args.max_id, args.body_bytes
    );
    if args.kv {
        eprintln!(
            "bench-origin: KV store at /kv/{{key}} (replica lag {} ms, read delay {} ms, write delay {} ms, tags {})",
            args.replica_lag_ms, args.kv_read_delay_ms, args.kv_write_delay_ms, args.kv_tags
        );
    }
    if args.shop {
        eprintln!(
            "bench-origin: shop at /trains/{{t}}/seats/{{s}}/orders ({} units per new resource, {} ms per buy)",
            args.shop_stock, args.shop_delay_ms
        );
    }
    let timeline = Timeline::new(args.timeline_bucket_ms);
    let kv = args.kv.then(|| KvStore::new(&args));
    let shop = args.shop.then(|| Shop::new(&args));
    let state = Arc::new(State {
        args,
        stats: Stats::default(),
        timeline,
        kv,
        shop,
    });
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| handle(state.clone(), req));
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
