//! `Shop`: a flash-sale origin on `127.0.0.1`, the source of truth the stock gate fronts.
//!
//! - `POST /trains/{t}/seats/{type}/orders` (body optional, `{"units": n}`, 1 by default):
//!   a conditional decrement. Stock ≥ units: the units are taken, the sale is logged (order
//!   id, the `Idempotency-Key` and `Stock-Reservation` headers received, when the request
//!   arrived and when the sale was committed) and the answer is `201 {"order":"<id>"}`.
//!   Otherwise `409` problem+json (sold out). A request whose `Idempotency-Key` the shop
//!   already sold answers that same order, `201`, without a second sale. Every buy request
//!   is counted, whatever its answer.
//! - `GET /internal/stock/{t}/{type}`: `{"remaining": n}` (the gate's load and reconcile).
//! - `PUT|PATCH|DELETE /trains/{t}/seats/{s}`: a write to that resource, logged with its
//!   `fencing-token` and `Fencing-Key` and its interval at the origin; in fencing mode
//!   ([`Shop::set_fencing`]) a token below the highest accepted (or none) is refused, `409`.
//!   An accepted write moves the row to its next version, answered in `x-row-version`.
//! - `GET /trains/{t}/seats/{s}`: the row as a read replica has it, lagging
//!   [`Shop::set_replica_lag`] behind the writes: the version committed at or before
//!   `now − lag` (0 before any), as `{"resource":…,"version":n}` and `x-row-version: n`.
//!   [`Shop::set_version_answer`] makes reads or writes send a garbled version, or none.
//!
//! Faults, per [`Scope`]: added latency ([`Shop::set_latency`]), and [`Fault`]s: hang until
//! [`Shop::release`], answer a 5xx, or commit the sale and then hang (the in-doubt case).
//!
//! A request's transaction runs in a task of the shop's own, started once its body is
//! read: a client (cacheguard) that gives up does not cancel a sale already under way, as
//! a database transaction is not cancelled by its client's timeout. Every task is owned by
//! the shop and stopped on `Drop`. Times are on the run's [`Epoch`].

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};

use super::history::{Epoch, Sale, SaleLog, StockRecord, WriteLog, WriteRecord};
use super::origin::{OriginBody, full, serve_http1_with};

/// Longest a hung request waits for [`Shop::release`] before it goes on anyway (every
/// wait is bounded).
const MAX_HANG: Duration = Duration::from_secs(60);

/// The header a fencing origin reads by default.
pub const FENCING_TOKEN: &str = "fencing-token";

/// Which requests a latency or a fault applies to. The most specific one set wins:
/// a path, then a kind, then `All`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    All,
    /// Every `POST …/orders`.
    Buys,
    /// Every `GET /internal/stock/…`.
    Stock,
    /// Every write to a seat (`PUT`/`PATCH`/`DELETE`).
    Writes,
    /// Every read of a seat (`GET`).
    Reads,
    /// One exact path.
    Path(String),
}

/// What the shop does to a request, besides latency.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fault {
    #[default]
    None,
    /// Wait for [`Shop::release`] before doing anything (then carry on as usual).
    Hang,
    /// Answer this status (a 5xx) without doing anything.
    Status(u16),
    /// Do the work (commit the sale), then hold the answer until [`Shop::release`]: the
    /// client times out on a sale that happened.
    CommitThenHang,
    /// Do the work, then answer this status (a 5xx) instead of the real answer.
    CommitThenStatus(u16),
}

/// What the shop puts in `x-row-version` (see [`Shop::set_version_answer`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VersionAnswer {
    /// The row's version.
    #[default]
    Exact,
    /// No `x-row-version` at all.
    Missing,
    /// `x-row-version: v<n>` (not an integer).
    Garbled,
}

#[derive(Debug)]
enum Kind {
    Buy { resource: String },
    Stock { resource: String },
    Write { resource: String },
    Read { resource: String },
    Other,
}

impl Kind {
    fn of(method: &Method, path: &str) -> Kind {
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match (method, parts.as_slice()) {
            (&Method::POST, ["trains", t, "seats", s, "orders"]) => Kind::Buy {
                resource: seat(t, s),
            },
            (&Method::GET, ["internal", "stock", t, s]) => Kind::Stock {
                resource: seat(t, s),
            },
            (m, ["trains", t, "seats", s])
                if m == Method::PUT || m == Method::PATCH || m == Method::DELETE =>
            {
                Kind::Write {
                    resource: seat(t, s),
                }
            }
            (&Method::GET, ["trains", t, "seats", s]) => Kind::Read {
                resource: seat(t, s),
            },
            _ => Kind::Other,
        }
    }

    fn scope(&self) -> Option<Scope> {
        match self {
            Kind::Buy { .. } => Some(Scope::Buys),
            Kind::Stock { .. } => Some(Scope::Stock),
            Kind::Write { .. } => Some(Scope::Writes),
            Kind::Read { .. } => Some(Scope::Reads),
            Kind::Other => None,
        }
    }
}

/// `/trains/{train}/seats/{type}`: a resource's path.
pub fn seat(train: &str, kind: &str) -> String {
    format!("/trains/{train}/seats/{kind}")
}

/// The order path of `resource` (`…/orders`).
pub fn orders_path(resource: &str) -> String {
    format!("{resource}/orders")
}

#[derive(Debug, Default)]
struct Ledger {
    stock: BTreeMap<String, StockRecord>,
    sales: Vec<Sale>,
    /// Idempotency key → index in `sales`.
    by_key: HashMap<String, usize>,
    next_order: u64,
    writes: Vec<WriteRecord>,
    /// Per resource: the highest token accepted, and the row version.
    fences: HashMap<String, (Option<u64>, u64)>,
    /// Per resource: each version with when it was committed, in order.
    versions: HashMap<String, Vec<(Duration, u64)>>,
    /// Reads answered, per resource.
    reads: HashMap<String, u64>,
}

#[derive(Debug, Default)]
struct Knobs {
    latency: HashMap<Scope, Duration>,
    faults: HashMap<Scope, Fault>,
    /// `Some(header)`: refuse writes whose token (in `header`) is below the highest
    /// accepted.
    fencing: Option<String>,
    /// How far behind the writes a read sees the rows.
    replica_lag: Duration,
    /// What reads and writes say in `x-row-version`.
    read_version: VersionAnswer,
    write_version: VersionAnswer,
}

impl Knobs {
    /// The most specific setting for a request to `path` of kind `scope`.
    fn pick<T: Copy + Default>(map: &HashMap<Scope, T>, path: &str, scope: Option<Scope>) -> T {
        map.get(&Scope::Path(path.to_string()))
            .or_else(|| scope.and_then(|s| map.get(&s)))
            .or_else(|| map.get(&Scope::All))
            .copied()
            .unwrap_or_default()
    }
}

#[derive(Debug)]
struct State {
    epoch: Epoch,
    ledger: Mutex<Ledger>,
    knobs: Mutex<Knobs>,
    /// Bumped by `release()`: hung requests wait for it to change.
    released: watch::Sender<u64>,
    /// Transactions under way (owned here, aborted on drop).
    tasks: Mutex<JoinSet<()>>,
    in_flight: AtomicUsize,
    requests: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The flash-sale origin. Stops (listener, connections, transactions) on `Drop`.
#[derive(Debug)]
pub struct Shop {
    addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Drop for Shop {
    fn drop(&mut self) {
        self.task.abort();
        lock(&self.state.tasks).abort_all();
    }
}

impl Shop {
    /// Starts the shop with `stock`: `(resource path, units)` pairs, e.g.
    /// `(seat("t1", "a"), 100)`.
    pub async fn start(epoch: Epoch, stock: &[(String, u64)]) -> Shop {
        let ledger = Ledger {
            stock: stock
                .iter()
                .map(|(resource, units)| {
                    (
                        resource.clone(),
                        StockRecord {
                            supplied: *units,
                            remaining: *units,
                            ..StockRecord::default()
                        },
                    )
                })
                .collect(),
            next_order: 1,
            ..Ledger::default()
        };
        let state = Arc::new(State {
            epoch,
            ledger: Mutex::new(ledger),
            knobs: Mutex::default(),
            released: watch::Sender::new(0),
            tasks: Mutex::default(),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind shop");
        let addr = listener.local_addr().expect("shop local addr");
        let accept_state = state.clone();
        // A write whose instance died once it was sent still reaches its transaction.
        let task = serve_http1_with(listener, true, move |_peer, req| {
            handle(accept_state.clone(), req)
        });
        Shop { addr, state, task }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn epoch(&self) -> Epoch {
        self.state.epoch
    }

    /// Added latency before a request is handled (zero = none).
    pub fn set_latency(&self, scope: Scope, latency: Duration) {
        lock(&self.state.knobs).latency.insert(scope, latency);
    }

    pub fn set_fault(&self, scope: Scope, fault: Fault) {
        lock(&self.state.knobs).faults.insert(scope, fault);
    }

    /// Lets every hung request go on (new ones still hang while a hang fault is set).
    pub fn release(&self) {
        self.state.released.send_modify(|n| *n += 1);
    }

    /// No more faults or latency, and every hung request released.
    pub fn heal(&self) {
        {
            let mut knobs = lock(&self.state.knobs);
            knobs.latency.clear();
            knobs.faults.clear();
        }
        self.release();
    }

    /// Fencing mode: writes must carry a token in `header` (e.g. [`FENCING_TOKEN`]) not
    /// below the highest accepted for their resource; `None` records writes without
    /// checking.
    pub fn set_fencing(&self, header: Option<&str>) {
        lock(&self.state.knobs).fencing = header.map(str::to_ascii_lowercase);
    }

    /// Reads see the rows as they were `lag` ago (a replica that far behind the primary).
    pub fn set_replica_lag(&self, lag: Duration) {
        lock(&self.state.knobs).replica_lag = lag;
    }

    /// What `x-row-version` says from now on, in answers to reads (`Scope::Reads`) or to
    /// writes (`Scope::Writes`).
    pub fn set_version_answer(&self, scope: Scope, answer: VersionAnswer) {
        let mut knobs = lock(&self.state.knobs);
        match scope {
            Scope::Reads => knobs.read_version = answer,
            Scope::Writes => knobs.write_version = answer,
            other => panic!("versions are answered to reads and writes, not {other:?}"),
        }
    }

    /// The version of `resource` now (at the primary): 0 before any write.
    pub fn version(&self, resource: &str) -> u64 {
        lock(&self.state.ledger)
            .fences
            .get(resource)
            .map_or(0, |(_, version)| *version)
    }

    /// Reads of `resource` answered so far.
    pub fn reads(&self, resource: &str) -> u64 {
        lock(&self.state.ledger)
            .reads
            .get(resource)
            .copied()
            .unwrap_or(0)
    }

    /// Adds `units` to `resource` (a restock; the resource is created if new).
    pub fn restock(&self, resource: &str, units: u64) {
        let mut ledger = lock(&self.state.ledger);
        let record = ledger.stock.entry(resource.to_string()).or_default();
        record.supplied += units;
        record.remaining += units;
    }

    pub fn remaining(&self, resource: &str) -> Option<u64> {
        lock(&self.state.ledger)
            .stock
            .get(resource)
            .map(|r| r.remaining)
    }

    /// Requests being handled now (including hung ones).
    pub fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// Requests received, all paths.
    pub fn requests(&self) -> u64 {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// The stock and sales so far.
    pub fn sale_log(&self) -> SaleLog {
        let ledger = lock(&self.state.ledger);
        SaleLog {
            resources: ledger.stock.clone(),
            sales: ledger.sales.clone(),
        }
    }

    /// The writes so far.
    pub fn write_log(&self) -> WriteLog {
        WriteLog {
            writes: lock(&self.state.ledger).writes.clone(),
        }
    }

    /// Waits (bounded) until no request is in flight; whether it got there.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        super::poll_until(timeout, Duration::from_millis(10), || async {
            (self.in_flight() == 0).then_some(())
        })
        .await
        .is_some()
    }
}

type ShopBody = OriginBody;

fn answer(status: u16, content_type: &'static str, body: String) -> Response<ShopBody> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    resp
}

fn json(status: u16, body: String) -> Response<ShopBody> {
    answer(status, "application/json", body)
}

fn problem(status: u16, kind: &str, title: &str) -> Response<ShopBody> {
    answer(
        status,
        "application/problem+json",
        format!(r#"{{"type":"{kind}","title":"{title}"}}"#),
    )
}

struct InFlight(Arc<State>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<ShopBody> {
    state.in_flight.fetch_add(1, Ordering::SeqCst);
    let guard = InFlight(state.clone());
    state.requests.fetch_add(1, Ordering::SeqCst);
    let received = state.epoch.elapsed();
    let (parts, body) = req.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return problem(400, "bad-body", "the body did not arrive");
    };
    // The transaction runs in a task of the shop's: the connection going away does not
    // cancel it.
    let (tx, rx) = oneshot::channel();
    let path = parts.uri.path().to_string();
    {
        let mut tasks = lock(&state.tasks);
        while tasks.try_join_next().is_some() {}
        let state = state.clone();
        tasks.spawn(async move {
            let _guard = guard;
            let resp = transaction(
                &state,
                &parts.method,
                &path,
                &parts.headers,
                &body,
                received,
            )
            .await;
            let _ = tx.send(resp);
        });
    }
    rx.await
        .unwrap_or_else(|_| problem(500, "aborted", "the shop stopped"))
}

/// Waits for the next [`Shop::release`] (bounded by [`MAX_HANG`]).
async fn hang(state: &State) {
    let mut released = state.released.subscribe();
    released.borrow_and_update();
    let _ = tokio::time::timeout(MAX_HANG, released.changed()).await;
}

async fn transaction(
    state: &State,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    body: &Bytes,
    received: Duration,
) -> Response<ShopBody> {
    let kind = Kind::of(method, path);
    let (latency, fault, fencing, lag, read_version, write_version) = {
        let knobs = lock(&state.knobs);
        (
            Knobs::pick(&knobs.latency, path, kind.scope()),
            Knobs::pick(&knobs.faults, path, kind.scope()),
            knobs.fencing.clone(),
            knobs.replica_lag,
            knobs.read_version,
            knobs.write_version,
        )
    };
    if let Kind::Buy { resource } = &kind
        && let Some(record) = lock(&state.ledger).stock.get_mut(resource)
    {
        record.buy_requests += 1;
    }
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    match fault {
        Fault::Hang => hang(state).await,
        Fault::Status(status) => return problem(status, "fault", "injected fault"),
        _ => {}
    }
    let resp = match kind {
        Kind::Buy { resource } => buy(state, &resource, headers, body, received),
        Kind::Stock { resource } => match lock(&state.ledger).stock.get(&resource) {
            Some(record) => json(200, format!(r#"{{"remaining":{}}}"#, record.remaining)),
            None => problem(404, "unknown-resource", "no such resource"),
        },
        Kind::Write { resource } => {
            write(state, &resource, headers, received, fencing, write_version)
        }
        Kind::Read { resource } => read(state, &resource, lag, read_version),
        Kind::Other => problem(404, "not-found", "no such path"),
    };
    match fault {
        Fault::CommitThenHang => {
            hang(state).await;
            resp
        }
        Fault::CommitThenStatus(status) => problem(status, "fault", "injected fault after commit"),
        _ => resp,
    }
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The conditional decrement.
fn buy(
    state: &State,
    resource: &str,
    headers: &HeaderMap,
    body: &Bytes,
    received: Duration,
) -> Response<ShopBody> {
    let units = if body.is_empty() {
        Some(1)
    } else {
        serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v.get("units").map_or(Some(1), serde_json::Value::as_u64))
    };
    let Some(units) = units.filter(|u| *u > 0) else {
        return problem(400, "bad-units", "units must be a positive integer");
    };
    let key = header(headers, "idempotency-key");
    let mut ledger = lock(&state.ledger);
    let ledger = &mut *ledger;
    let Some(record) = ledger.stock.get_mut(resource) else {
        return problem(404, "unknown-resource", "no such resource");
    };
    if let Some(key) = &key
        && let Some(&index) = ledger.by_key.get(key)
    {
        let sale = &ledger.sales[index];
        if sale.resource != resource {
            return problem(
                422,
                "key-reused",
                "idempotency key used for another resource",
            );
        }
        record.replays += 1;
        return json(201, format!(r#"{{"order":"{}"}}"#, sale.order));
    }
    if record.remaining < units {
        return problem(409, "sold-out", "sold out");
    }
    record.remaining -= units;
    let order = format!("o{}", ledger.next_order);
    ledger.next_order += 1;
    if let Some(key) = &key {
        ledger.by_key.insert(key.clone(), ledger.sales.len());
    }
    ledger.sales.push(Sale {
        order: order.clone(),
        resource: resource.to_string(),
        units,
        idempotency_key: key,
        reservation: header(headers, "stock-reservation"),
        received,
        committed: state.epoch.elapsed(),
    });
    json(201, format!(r#"{{"order":"{order}"}}"#))
}

/// The row `resource` at `version`, with `x-row-version` as `answer` says.
fn row(resource: &str, version: u64, answer: VersionAnswer) -> Response<ShopBody> {
    let mut resp = json(
        200,
        format!(r#"{{"resource":"{resource}","version":{version}}}"#),
    );
    let header = match answer {
        VersionAnswer::Exact => Some(version.to_string()),
        VersionAnswer::Garbled => Some(format!("v{version}")),
        VersionAnswer::Missing => None,
    };
    if let Some(v) = header.and_then(|h| HeaderValue::from_str(&h).ok()) {
        resp.headers_mut().insert("x-row-version", v);
    }
    resp
}

/// A read of `resource` from a replica `lag` behind: the last version committed by then.
fn read(state: &State, resource: &str, lag: Duration, answer: VersionAnswer) -> Response<ShopBody> {
    let seen = state.epoch.elapsed().saturating_sub(lag);
    let mut ledger = lock(&state.ledger);
    *ledger.reads.entry(resource.to_string()).or_default() += 1;
    let version = ledger.versions.get(resource).map_or(0, |versions| {
        versions
            .iter()
            .rev()
            .find(|(at, _)| *at <= seen)
            .map_or(0, |(_, v)| *v)
    });
    row(resource, version, answer)
}

/// A write to `resource`, checked against the highest token in fencing mode.
fn write(
    state: &State,
    resource: &str,
    headers: &HeaderMap,
    received: Duration,
    fencing: Option<String>,
    answer: VersionAnswer,
) -> Response<ShopBody> {
    let header_name = fencing.as_deref().unwrap_or(FENCING_TOKEN);
    let token = header(headers, header_name).and_then(|t| t.trim().parse::<u64>().ok());
    let mut ledger = lock(&state.ledger);
    let ledger = &mut *ledger;
    let (highest, version) = ledger.fences.entry(resource.to_string()).or_default();
    let stale = match (token, *highest) {
        (None, _) => true,
        (Some(t), Some(h)) => t < h,
        (Some(_), None) => false,
    };
    let accepted = fencing.is_none() || !stale;
    if accepted {
        *highest = token.max(*highest);
        *version += 1;
    }
    let version = *version;
    if accepted {
        ledger
            .versions
            .entry(resource.to_string())
            .or_default()
            .push((state.epoch.elapsed(), version));
    }
    let status = if accepted { 200 } else { 409 };
    ledger.writes.push(WriteRecord {
        seq: ledger.writes.len() as u64,
        resource: resource.to_string(),
        token,
        fencing_key: header(headers, "fencing-key"),
        start: received,
        end: state.epoch.elapsed(),
        status,
        accepted,
    });
    if !accepted {
        return problem(409, "stale-token", "a newer fencing token was accepted");
    }
    row(resource, version, answer)
}

/// A client's buy of one unit of `resource` with idempotency key `key`, for the runner.
pub fn buy_request(resource: &str, key: &str) -> super::jepsen::Request {
    super::jepsen::Request {
        f: "buy".to_string(),
        resource: resource.to_string(),
        value: key.to_string(),
        method: Method::POST,
        path: orders_path(resource),
        headers: vec![
            ("idempotency-key".to_string(), key.to_string()),
            ("content-type".to_string(), "application/json".to_string()),
        ],
        body: r#"{"units":1}"#.to_string(),
    }
}

/// A client's read of `resource` (`GET`), for the runner.
pub fn read_request(resource: &str) -> super::jepsen::Request {
    super::jepsen::Request {
        f: "read".to_string(),
        resource: resource.to_string(),
        value: String::new(),
        method: Method::GET,
        path: resource.to_string(),
        headers: Vec::new(),
        body: String::new(),
    }
}

/// A client's write of `body` to `resource` (`PUT`), for the runner.
pub fn write_request(resource: &str, body: &str) -> super::jepsen::Request {
    super::jepsen::Request {
        f: "write".to_string(),
        resource: resource.to_string(),
        value: body.to_string(),
        method: Method::PUT,
        path: resource.to_string(),
        headers: vec![("content-type".to_string(), "application/json".to_string())],
        body: body.to_string(),
    }
}
