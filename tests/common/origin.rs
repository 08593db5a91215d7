//! `TestOrigin`: an in-process hyper 1.x HTTP/1.1 server standing in for the database-backed
//! API. It counts requests per path, tracks how many are in flight (and the high-water mark),
//! records the last request per path, and lets each test set per-path behaviour at runtime.
//!
//! Default answer to `GET /x`: `200` with body `{"path":"/x","n":N}` where `N` is the
//! per-path serial number of the request (1 for the first), so tests can tell fresh fetches
//! apart. A request whose `If-None-Match` is the answer's `ETag` gets `304` without a body. `GET /internal/ids` answers the configured id list, one per line.
//!
//! The ids endpoint can be controlled at runtime (see [`IdsFault`], [`IdsFormat`],
//! [`TestOrigin::set_ids_delay`], [`TestOrigin::set_ids_trickle`],
//! [`TestOrigin::inject_ids_lines`]), and an opt-in "items API"
//! ([`TestOrigin::enable_items_api`]) makes `POST /api/items` create ids and
//! `GET /api/items/<id>` answer 200 for existing ids and 404 for the others.
//!
//! An opt-in versioned KV store ([`TestOrigin::enable_kv`]) stands in for a database with a
//! lagging read replica: `PUT /kv/<key>` bumps the key's version on the primary at once,
//! `GET /kv/<key>` answers the version the replica shows, which trails the primary by
//! [`TestOrigin::set_replica_lag`]. For tests of the write path's invalidation.

use std::collections::{HashMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// What the origin does for one path. Unset fields fall back to the defaults.
#[derive(Clone, Debug, Default)]
pub struct Behaviour {
    pub delay: Option<Duration>,
    pub status: Option<u16>,
    pub body: Option<Bytes>,
    /// Extra response headers (appended, so repeated names are allowed).
    pub headers: Vec<(String, String)>,
    /// Answer with the request body (and the request's content-type).
    pub echo: bool,
    /// Count the request body's bytes but keep none of them (a large upload must not cost
    /// the test process its size): the recorded request's body is empty.
    pub discard_body: bool,
    /// The default body names the request's `Accept-Language` (see [`language_body`]).
    pub by_language: bool,
}

/// One request as the origin saw it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub peer: SocketAddr,
}

impl RecordedRequest {
    /// Every value of `name`, joined with `, ` (None when absent).
    pub fn header(&self, name: &str) -> Option<String> {
        super::client::header_values(&self.headers, name)
    }
}

#[derive(Debug, Default)]
struct State {
    default_delay: Mutex<Duration>,
    behaviours: Mutex<HashMap<String, Behaviour>>,
    counts: Mutex<HashMap<String, u64>>,
    total: AtomicU64,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    last: Mutex<HashMap<String, RecordedRequest>>,
    /// Request body bytes received so far per path (updated frame by frame).
    body_bytes: Mutex<HashMap<String, u64>>,
    ids: Mutex<IdSet>,
    ids_endpoint: Mutex<IdsEndpoint>,
    /// `GET /internal/ids` answers whose body was produced to the end.
    ids_completed: AtomicU64,
    items_api: Mutex<Option<ItemsApi>>,
    kv: Mutex<KvStore>,
    /// Seats left per resource path (`/trains/t1/seats/a`), see [`TestOrigin::set_seats`].
    seats: Mutex<HashMap<String, u64>>,
}

/// The origin's existing ids: in order (for `/internal/ids`) and as a set (for look-ups).
#[derive(Debug, Default)]
struct IdSet {
    list: Vec<String>,
    set: HashSet<String>,
    /// The largest id that is a plain integer (0 when none): created ids continue from it.
    max_int: u64,
}

impl IdSet {
    fn new(list: Vec<String>) -> IdSet {
        let mut ids = IdSet::default();
        for id in list {
            ids.push(id);
        }
        ids
    }

    fn push(&mut self, id: String) {
        if let Ok(n) = id.parse::<u64>() {
            self.max_int = self.max_int.max(n);
        }
        if self.set.insert(id.clone()) {
            self.list.push(id);
        }
    }
}

/// The body format of `GET /internal/ids`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IdsFormat {
    /// One id per line (the default; without injected lines the body has no final newline,
    /// as it always had).
    #[default]
    Lines,
    /// One `{"id":"…"}` object per line.
    Ndjson,
}

/// A failure of `GET /internal/ids`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IdsFault {
    #[default]
    None,
    /// Answer this status (e.g. 503) with a short text body instead of the ids.
    Status(u16),
    /// Answer 200, send about half of the body, then reset the connection (a source that
    /// dies mid-stream).
    AbortMidBody,
}

#[derive(Clone, Debug, Default)]
struct IdsEndpoint {
    format: IdsFormat,
    fault: IdsFault,
    /// Before the response head.
    delay: Duration,
    /// `(chunk bytes, pause before each chunk)`: a body that trickles.
    trickle: Option<(usize, Duration)>,
    /// Raw lines (without their newline) inserted before the id at this index.
    injected: Vec<(usize, Bytes)>,
}

/// The opt-in items API (see [`TestOrigin::enable_items_api`]).
#[derive(Clone, Copy, Debug)]
struct ItemsApi {
    /// Whether `POST /api/items` sends `Location`.
    location: bool,
}

/// The opt-in versioned KV store (see [`TestOrigin::enable_kv`]).
#[derive(Debug, Default)]
struct KvStore {
    enabled: bool,
    /// Whether answers carry `Surrogate-Key: kv-<key> kv-all`.
    tags: bool,
    replica_lag: Duration,
    read_delay: Duration,
    write_delay: Duration,
    keys: HashMap<String, KvKey>,
}

/// One key of the KV store: every key exists, at version 0 until its first write.
#[derive(Debug, Default)]
struct KvKey {
    /// The newest committed version (the primary).
    primary: u64,
    /// The newest version known to be visible on the replica.
    replica: u64,
    /// Commits the replica may not show yet, `(commit time, version)`, oldest first. Only
    /// commits younger than the lag stay here, so the history is bounded by the write rate
    /// times the lag.
    pending: VecDeque<(Instant, u64)>,
    /// `GET`/`HEAD` requests seen.
    reads: u64,
}

impl KvKey {
    /// The version the replica shows at `now`: the newest one committed at least `lag` ago
    /// (commits that old are folded into `replica` and dropped from the history).
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

    /// Commits the next version on the primary at `now`; returns it.
    fn commit(&mut self, now: Instant, lag: Duration) -> u64 {
        self.visible(now, lag);
        self.primary += 1;
        self.pending.push_back((now, self.primary));
        self.primary
    }
}

/// A KV request, as taken when it arrived.
#[derive(Debug)]
enum KvRequest {
    /// `GET`/`HEAD`: the version the replica showed on arrival, answered after `delay`.
    Read {
        key: String,
        version: u64,
        delay: Duration,
    },
    /// `PUT`: committed after `delay`.
    Write { key: String, delay: Duration },
}

const KV_PREFIX: &str = "/kv/";

const ITEMS_PREFIX: &str = "/api/items/";
const ITEMS_COLLECTION: &str = "/api/items";

/// Builder for [`TestOrigin`].
#[derive(Debug, Default)]
pub struct TestOriginBuilder {
    delay: Duration,
    ids: Vec<String>,
    behaviours: Vec<(String, Behaviour)>,
}

impl TestOriginBuilder {
    /// Delay before every answer (unless a path sets its own).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// The ids served by `GET /internal/ids`.
    pub fn ids<I, S>(mut self, ids: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.ids = ids.into_iter().map(Into::into).collect();
        self
    }

    /// Behaviour for one path, set before start.
    pub fn path(mut self, path: &str, behaviour: Behaviour) -> Self {
        self.behaviours.push((path.to_string(), behaviour));
        self
    }

    pub async fn start(self) -> TestOrigin {
        let state = Arc::new(State::default());
        *lock(&state.default_delay) = self.delay;
        *lock(&state.ids) = IdSet::new(self.ids);
        lock(&state.behaviours).extend(self.behaviours);

        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind test origin");
        let addr = listener.local_addr().expect("origin local addr");
        let accept_state = state.clone();
        let task = serve_http1(listener, move |peer, req| {
            handle(accept_state.clone(), peer, req)
        });
        TestOrigin { addr, state, task }
    }
}

/// Serves HTTP/1.1 on `listener`, each request answered by `handle(peer, request)`, until
/// the returned task is aborted (which drops the listener and every connection).
pub fn serve_http1<H, Fut>(listener: TcpListener, handle: H) -> JoinHandle<()>
where
    H: Fn(SocketAddr, Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Response<OriginBody>> + Send + 'static,
{
    serve_http1_with(listener, false, handle)
}

/// As [`serve_http1`]; with `half_close`, a request whose client closes its side once the
/// request is sent (or dies then) is still handled, as a database still runs a transaction
/// that reached it before its client went away (hyper's default closes the connection, and
/// drops the request, at that EOF).
pub fn serve_http1_with<H, Fut>(
    listener: TcpListener,
    half_close: bool,
    handle: H,
) -> JoinHandle<()>
where
    H: Fn(SocketAddr, Request<Incoming>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Response<OriginBody>> + Send + 'static,
{
    tokio::spawn(async move {
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, peer)) = accepted else { continue };
                    let _ = stream.set_nodelay(true);
                    let handle = handle.clone();
                    connections.spawn(async move {
                        let service = service_fn(move |req| {
                            let answer = handle(peer, req);
                            async move { Ok::<_, Infallible>(answer.await) }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .half_close(half_close)
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    })
}

/// The fake origin. Stops (listener and every connection) on `Drop`.
#[derive(Debug)]
pub struct TestOrigin {
    addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Drop for TestOrigin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl TestOrigin {
    /// Stops the listener and closes every connection (new connections are refused), as
    /// when the origin goes down. Takes effect at the server task's next step: give it a
    /// moment.
    pub fn stop(&self) {
        self.task.abort();
    }

    pub fn builder() -> TestOriginBuilder {
        TestOriginBuilder::default()
    }

    /// An origin with default behaviour and no delay.
    pub async fn start() -> TestOrigin {
        TestOrigin::builder().start().await
    }

    /// [`TestOrigin::start`] with the versioned KV store on ([`TestOrigin::enable_kv`]).
    pub async fn start_kv() -> TestOrigin {
        let origin = TestOrigin::start().await;
        origin.enable_kv();
        origin
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests received for `path` (query ignored).
    pub fn count(&self, path: &str) -> u64 {
        lock(&self.state.counts).get(path).copied().unwrap_or(0)
    }

    /// Requests received, all paths.
    pub fn total(&self) -> u64 {
        self.state.total.load(Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// Highest number of requests ever in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// The last request received for `path`.
    pub fn last_request(&self, path: &str) -> Option<RecordedRequest> {
        lock(&self.state.last).get(path).cloned()
    }

    /// Request body bytes received so far for `path` (grows while a body streams in).
    pub fn body_bytes_received(&self, path: &str) -> u64 {
        lock(&self.state.body_bytes).get(path).copied().unwrap_or(0)
    }

    fn update(&self, path: &str, f: impl FnOnce(&mut Behaviour)) {
        f(lock(&self.state.behaviours)
            .entry(path.to_string())
            .or_default());
    }

    pub fn set_default_delay(&self, delay: Duration) {
        *lock(&self.state.default_delay) = delay;
    }

    pub fn set_delay(&self, path: &str, delay: Duration) {
        self.update(path, |b| b.delay = Some(delay));
    }

    pub fn set_status(&self, path: &str, status: u16) {
        self.update(path, |b| b.status = Some(status));
    }

    pub fn set_body(&self, path: &str, body: impl Into<Bytes>) {
        let body = body.into();
        self.update(path, |b| b.body = Some(body));
    }

    /// Replaces the extra response headers for `path`.
    pub fn set_headers<'a, I>(&self, path: &str, headers: I)
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
    {
        let headers: Vec<(String, String)> = headers
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.update(path, |b| b.headers = headers);
    }

    /// Answer requests to `path` with their own body.
    pub fn set_echo(&self, path: &str) {
        self.update(path, |b| b.echo = true);
    }

    /// Answer requests to `path` in their `Accept-Language`: the default body with the
    /// request's value in it ([`language_body`]).
    pub fn set_by_language(&self, path: &str) {
        self.update(path, |b| b.by_language = true);
    }

    /// Requests to `path` have their body counted ([`TestOrigin::body_bytes_received`]) and
    /// dropped as it arrives.
    pub fn set_discard_body(&self, path: &str) {
        self.update(path, |b| b.discard_body = true);
    }

    /// Back to the default behaviour for `path`.
    pub fn reset(&self, path: &str) {
        lock(&self.state.behaviours).remove(path);
    }

    pub fn set_ids<I, S>(&self, ids: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        *lock(&self.state.ids) = IdSet::new(ids.into_iter().map(Into::into).collect());
    }

    /// Adds one id to the existing ids (served by `/internal/ids` and the items API).
    pub fn add_id(&self, id: impl Into<String>) {
        lock(&self.state.ids).push(id.into());
    }

    /// Whether `id` is one of the existing ids.
    pub fn has_id(&self, id: &str) -> bool {
        lock(&self.state.ids).set.contains(id)
    }

    /// How many ids exist.
    pub fn id_count(&self) -> usize {
        lock(&self.state.ids).list.len()
    }

    /// Requests received for every path starting with `prefix` (query ignored).
    pub fn count_prefix(&self, prefix: &str) -> u64 {
        lock(&self.state.counts)
            .iter()
            .filter(|(path, _)| path.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    }

    /// `GET /internal/ids` answers whose body was produced to its end (compare with
    /// `count("/internal/ids")`, the requests received, to see a load still running).
    pub fn ids_completed(&self) -> u64 {
        self.state.ids_completed.load(Ordering::SeqCst)
    }

    /// The body format of `/internal/ids`.
    pub fn set_ids_format(&self, format: IdsFormat) {
        lock(&self.state.ids_endpoint).format = format;
    }

    /// Makes `/internal/ids` fail (or, with [`IdsFault::None`], work again).
    pub fn set_ids_fault(&self, fault: IdsFault) {
        lock(&self.state.ids_endpoint).fault = fault;
    }

    /// Delay before `/internal/ids` sends its response head.
    pub fn set_ids_delay(&self, delay: Duration) {
        lock(&self.state.ids_endpoint).delay = delay;
    }

    /// Streams the `/internal/ids` body in chunks of `chunk_bytes`, pausing `pause` before
    /// each; `None` sends it at once.
    pub fn set_ids_trickle(&self, trickle: Option<(usize, Duration)>) {
        lock(&self.state.ids_endpoint).trickle = trickle.map(|(n, d)| (n.max(1), d));
    }

    /// Inserts raw lines (no newline inside; any bytes, so non-UTF-8 too) into the
    /// `/internal/ids` body before the id at index `before` (`before >= len` = at the end).
    /// Accumulates; [`TestOrigin::clear_ids_lines`] removes them.
    pub fn inject_ids_lines<I, B>(&self, before: usize, lines: I)
    where
        I: IntoIterator<Item = B>,
        B: Into<Bytes>,
    {
        let mut endpoint = lock(&self.state.ids_endpoint);
        endpoint
            .injected
            .extend(lines.into_iter().map(|l| (before, l.into())));
    }

    pub fn clear_ids_lines(&self) {
        lock(&self.state.ids_endpoint).injected.clear();
    }

    /// Turns the items API on: `POST /api/items` creates the next integer id (one more than
    /// the largest integer id so far), adds it to the existing ids and answers `201` with
    /// `Location: /api/items/<id>` and `{"id":"<id>"}`; `GET /api/items/<id>` answers `200`
    /// `{"id":"<id>"}` for an existing id and `404` otherwise. Per-path settings (status,
    /// body, echo) still take precedence; delays apply as usual.
    pub fn enable_items_api(&self) {
        *lock(&self.state.items_api) = Some(ItemsApi { location: true });
    }

    /// With the items API on: whether `POST /api/items` sends `Location` (default true).
    pub fn set_items_location(&self, location: bool) {
        if let Some(api) = lock(&self.state.items_api).as_mut() {
            api.location = location;
        }
    }

    /// Puts `remaining` seats on sale at `resource` (`/trains/{train}/seats/{type}`), the
    /// origin side of a stock gate: `GET /internal/stock/{train}/{type}` answers
    /// `{"remaining": N}`, and `POST <resource>/orders` sells one seat with a conditional
    /// decrement (`200 {"order":K}`) or answers `409 {"type":"sold-out"}` when none is left.
    /// Per-path settings (status, body, echo) still take precedence (a buy they answer sells
    /// nothing); delays apply as usual.
    pub fn set_seats(&self, resource: &str, remaining: u64) {
        lock(&self.state.seats).insert(resource.to_owned(), remaining);
    }

    /// Seats left at `resource` (`None`: not on sale).
    pub fn seats(&self, resource: &str) -> Option<u64> {
        lock(&self.state.seats).get(resource).copied()
    }

    /// Turns the versioned KV store on (off by default). Every key exists, at version 0
    /// until its first write; `<key>` is one path segment, taken as it appears in the path.
    ///
    /// - `PUT /kv/<key>` (body ignored): after the write delay, commits the next version on
    ///   the primary and answers `200` `{"key":"<key>","version":N}` with the new N.
    /// - `GET /kv/<key>` (`HEAD` alike): reads, when it arrives, the version the replica
    ///   shows (the newest one committed at least the replica lag ago), waits the read delay
    ///   and answers `200` `{"key":"<key>","version":N}` with what it read, so a slow read
    ///   racing a write answers the old version.
    ///
    /// Both carry `Surrogate-Key: kv-<key> kv-all` with [`TestOrigin::set_kv_tags`]. Per-path
    /// settings (status, body, echo) still take precedence (a `PUT` they answer commits
    /// nothing); per-path and default delays apply as usual, on top of the KV delays.
    pub fn enable_kv(&self) {
        lock(&self.state.kv).enabled = true;
    }

    /// Whether KV answers carry `Surrogate-Key: kv-<key> kv-all` (default false).
    pub fn set_kv_tags(&self, tags: bool) {
        lock(&self.state.kv).tags = tags;
    }

    /// How far the replica (what `GET` answers) trails the primary (default 0). Commits
    /// older than the lag are forgotten once a newer one is visible, so raising the lag
    /// later does not bring their versions back.
    pub fn set_replica_lag(&self, lag: Duration) {
        lock(&self.state.kv).replica_lag = lag;
    }

    /// Time between a `GET /kv/<key>` reading its version (on arrival) and answering it
    /// (default 0).
    pub fn set_kv_read_delay(&self, delay: Duration) {
        lock(&self.state.kv).read_delay = delay;
    }

    /// Time a `PUT /kv/<key>` waits before it commits and answers (default 0).
    pub fn set_kv_write_delay(&self, delay: Duration) {
        lock(&self.state.kv).write_delay = delay;
    }

    /// The newest committed version of `key` (the primary; 0 before any write).
    pub fn kv_version(&self, key: &str) -> u64 {
        lock(&self.state.kv).keys.get(key).map_or(0, |k| k.primary)
    }

    /// `GET` (and `HEAD`) requests for `/kv/<key>` the origin has seen.
    pub fn kv_reads(&self, key: &str) -> u64 {
        lock(&self.state.kv).keys.get(key).map_or(0, |k| k.reads)
    }
}

/// The default body for the `n`th request to `path`.
pub fn default_body(path: &str, n: u64) -> String {
    format!(r#"{{"path":"{path}","n":{n}}}"#)
}

/// The body of the `n`th request to `path` answered in `language` (its `Accept-Language`).
pub fn language_body(path: &str, language: &str, n: u64) -> String {
    format!(r#"{{"path":"{path}","lang":"{language}","n":{n}}}"#)
}

/// The origin's response body.
pub type OriginBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A whole body of `body`.
pub fn full(body: impl Into<Bytes>) -> OriginBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

struct InFlight(Arc<State>);

impl InFlight {
    fn enter(state: Arc<State>) -> InFlight {
        let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        state.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn handle(
    state: Arc<State>,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Response<OriginBody> {
    let _guard = InFlight::enter(state.clone());
    let path = req.uri().path().to_string();
    let kv_request = kv_arrival(&state, req.method(), &path);
    state.total.fetch_add(1, Ordering::SeqCst);
    let n = {
        let mut counts = lock(&state.counts);
        let c = counts.entry(path.clone()).or_insert(0);
        *c += 1;
        *c
    };
    let behaviour = lock(&state.behaviours)
        .get(&path)
        .cloned()
        .unwrap_or_default();
    let default_delay = *lock(&state.default_delay);

    let (parts, mut body) = req.into_parts();
    let mut received = BytesMut::new();
    let mut counted = 0u64;
    lock(&state.body_bytes).insert(path.clone(), 0);
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        if let Ok(data) = frame.into_data() {
            counted += data.len() as u64;
            if !behaviour.discard_body {
                received.extend_from_slice(&data);
            }
            lock(&state.body_bytes).insert(path.clone(), counted);
        }
    }
    let received = received.freeze();
    lock(&state.last).insert(
        path.clone(),
        RecordedRequest {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers: parts.headers.clone(),
            body: received.clone(),
            peer,
        },
    );

    let delay = behaviour.delay.unwrap_or(default_delay);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }

    let plain = behaviour.status.is_none() && behaviour.body.is_none() && !behaviour.echo;
    let items_api = *lock(&state.items_api);
    let special = if plain && path == "/internal/ids" {
        Some(ids_response(&state).await)
    } else if plain && let Some(kv) = kv_request {
        Some(kv_response(&state, kv).await)
    } else if plain && let Some(api) = items_api {
        items_response(&state, api, &parts.method, &path)
            .or_else(|| seats_response(&state, &parts.method, &path))
    } else if plain {
        seats_response(&state, &parts.method, &path)
    } else {
        None
    };
    let mut resp = match special {
        Some(resp) => resp,
        None => {
            let status =
                StatusCode::from_u16(behaviour.status.unwrap_or(200)).expect("valid status");
            let (body, content_type) = if behaviour.echo {
                let ct = parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .cloned()
                    .unwrap_or(HeaderValue::from_static("application/octet-stream"));
                (received, ct)
            } else if let Some(body) = behaviour.body {
                (body, HeaderValue::from_static("application/json"))
            } else if path == "/internal/ids" {
                let ids = lock(&state.ids).list.join("\n");
                (Bytes::from(ids), HeaderValue::from_static("text/plain"))
            } else if behaviour.by_language {
                let language = parts
                    .headers
                    .get(http::header::ACCEPT_LANGUAGE)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                (
                    Bytes::from(language_body(&path, language, n)),
                    HeaderValue::from_static("application/json"),
                )
            } else {
                (
                    Bytes::from(default_body(&path, n)),
                    HeaderValue::from_static("application/json"),
                )
            };
            let mut resp = Response::new(full(body));
            *resp.status_mut() = status;
            resp.headers_mut()
                .insert(http::header::CONTENT_TYPE, content_type);
            resp
        }
    };
    for (k, v) in &behaviour.headers {
        let name = HeaderName::from_bytes(k.as_bytes()).expect("header name");
        let value = HeaderValue::from_str(v).expect("header value");
        resp.headers_mut().append(name, value);
    }
    // A conditional GET whose If-None-Match names the answer's ETag: 304, headers only.
    let etag = resp.headers().get(http::header::ETAG).cloned();
    let matched = parts
        .headers
        .get(http::header::IF_NONE_MATCH)
        .is_some_and(|inm| Some(inm) == etag.as_ref());
    if matched && resp.status() == StatusCode::OK {
        *resp.status_mut() = StatusCode::NOT_MODIFIED;
        *resp.body_mut() = full(Bytes::new());
        resp.headers_mut().remove(http::header::CONTENT_TYPE);
    }
    resp
}

/// A JSON answer.
fn json(status: StatusCode, body: String) -> Response<OriginBody> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// The seats of [`TestOrigin::set_seats`]: their count, and buys. `None` for any other path.
fn seats_response(state: &State, method: &Method, path: &str) -> Option<Response<OriginBody>> {
    let mut seats = lock(&state.seats);
    if let Some(rest) = path.strip_prefix("/internal/stock/")
        && *method == Method::GET
    {
        let left = *seats.get(&format!("/trains/{}", rest.replacen('/', "/seats/", 1)))?;
        return Some(json(StatusCode::OK, format!("{{\"remaining\": {left}}}")));
    }
    let resource = path
        .strip_suffix("/orders")
        .filter(|_| *method == Method::POST)?;
    let left = seats.get_mut(resource)?;
    Some(if *left > 0 {
        *left -= 1;
        json(StatusCode::OK, format!("{{\"order\": {left}}}"))
    } else {
        json(StatusCode::CONFLICT, "{\"type\":\"sold-out\"}".to_owned())
    })
}

/// `GET /internal/ids` as configured by the ids endpoint settings.
async fn ids_response(state: &Arc<State>) -> Response<OriginBody> {
    let endpoint = lock(&state.ids_endpoint).clone();
    if !endpoint.delay.is_zero() {
        tokio::time::sleep(endpoint.delay).await;
    }
    if let IdsFault::Status(code) = endpoint.fault {
        let mut resp = Response::new(full("ids unavailable\n"));
        *resp.status_mut() = StatusCode::from_u16(code).expect("valid status");
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain"),
        );
        return resp;
    }
    let body = ids_body(&lock(&state.ids).list, &endpoint);
    let content_type = match endpoint.format {
        IdsFormat::Lines => "text/plain",
        IdsFormat::Ndjson => "application/x-ndjson",
    };

    // Chunks to send, then (for AbortMidBody) an error that makes hyper reset the
    // connection instead of ending the body.
    let chunk_size = endpoint.trickle.map_or(64 * 1024, |(n, _)| n);
    let pause = endpoint.trickle.map_or(Duration::ZERO, |(_, d)| d);
    let abort = endpoint.fault == IdsFault::AbortMidBody;
    let send_len = if abort { body.len() / 2 } else { body.len() };
    let chunks: Vec<Bytes> = (0..send_len)
        .step_by(chunk_size)
        .map(|start| body.slice(start..(start + chunk_size).min(send_len)))
        .collect();
    let done = state.clone();
    let stream = futures_util::stream::unfold(
        (chunks.into_iter(), false),
        move |(mut chunks, finished)| {
            let done = done.clone();
            async move {
                if finished {
                    return None;
                }
                match chunks.next() {
                    Some(chunk) => {
                        if !pause.is_zero() {
                            tokio::time::sleep(pause).await;
                        }
                        Some((Ok(Frame::data(chunk)), (chunks, false)))
                    }
                    None if abort => Some((
                        Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionReset,
                            "ids source aborted mid-body",
                        )),
                        (chunks, true),
                    )),
                    None => {
                        done.ids_completed.fetch_add(1, Ordering::SeqCst);
                        None
                    }
                }
            }
        },
    );
    let mut resp = Response::new(StreamBody::new(stream).boxed_unsync());
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(content_type),
    );
    resp
}

/// The `/internal/ids` body: ids (and injected raw lines) in the configured format.
fn ids_body(ids: &[String], endpoint: &IdsEndpoint) -> Bytes {
    if endpoint.format == IdsFormat::Lines && endpoint.injected.is_empty() {
        // Exactly the historical body: ids joined by newlines, no final newline.
        return Bytes::from(ids.join("\n"));
    }
    let mut injected = endpoint.injected.clone();
    // Stable: lines injected at the same index keep their order.
    injected.sort_by_key(|(before, _)| *before);
    let mut injected = injected.into_iter().peekable();
    let mut out = BytesMut::new();
    for (i, id) in ids.iter().enumerate() {
        while let Some((_, line)) = injected.next_if(|(before, _)| *before <= i) {
            out.extend_from_slice(&line);
            out.extend_from_slice(b"\n");
        }
        match endpoint.format {
            IdsFormat::Lines => out.extend_from_slice(id.as_bytes()),
            IdsFormat::Ndjson => {
                out.extend_from_slice(format!("{{\"id\":{}}}", json_string(id)).as_bytes());
            }
        }
        out.extend_from_slice(b"\n");
    }
    for (_, line) in injected {
        out.extend_from_slice(&line);
        out.extend_from_slice(b"\n");
    }
    out.freeze()
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The items API, when it applies to this request.
fn items_response(
    state: &Arc<State>,
    api: ItemsApi,
    method: &Method,
    path: &str,
) -> Option<Response<OriginBody>> {
    if path == ITEMS_COLLECTION && method == Method::POST {
        let id = {
            let mut ids = lock(&state.ids);
            let id = (ids.max_int + 1).to_string();
            ids.push(id.clone());
            id
        };
        let mut resp = json(
            StatusCode::CREATED,
            format!("{{\"id\":{}}}", json_string(&id)),
        );
        if api.location {
            let location = HeaderValue::from_str(&format!("{ITEMS_PREFIX}{id}"))
                .expect("location header value");
            resp.headers_mut().insert(http::header::LOCATION, location);
        }
        return Some(resp);
    }
    let id = path.strip_prefix(ITEMS_PREFIX)?;
    if id.is_empty() || id.contains('/') || !(method == Method::GET || method == Method::HEAD) {
        return None;
    }
    Some(if lock(&state.ids).set.contains(id) {
        json(StatusCode::OK, format!("{{\"id\":{}}}", json_string(id)))
    } else {
        json(
            StatusCode::NOT_FOUND,
            r#"{"error":"not found"}"#.to_string(),
        )
    })
}

/// A KV request on arrival (None when the KV store is off or this is not one): a read takes
/// the version the replica shows now and is counted.
fn kv_arrival(state: &State, method: &Method, path: &str) -> Option<KvRequest> {
    let key = path.strip_prefix(KV_PREFIX)?;
    if key.is_empty() || key.contains('/') {
        return None;
    }
    let mut kv = lock(&state.kv);
    if !kv.enabled {
        return None;
    }
    if method == Method::GET || method == Method::HEAD {
        let (lag, delay) = (kv.replica_lag, kv.read_delay);
        let entry = kv.keys.entry(key.to_string()).or_default();
        entry.reads += 1;
        let version = entry.visible(Instant::now(), lag);
        Some(KvRequest::Read {
            key: key.to_string(),
            version,
            delay,
        })
    } else if method == Method::PUT {
        Some(KvRequest::Write {
            key: key.to_string(),
            delay: kv.write_delay,
        })
    } else {
        None
    }
}

/// The KV answer: a read's version after its delay, or a write committed after its delay.
async fn kv_response(state: &State, request: KvRequest) -> Response<OriginBody> {
    let (key, delay) = match &request {
        KvRequest::Read { key, delay, .. } | KvRequest::Write { key, delay } => (key, *delay),
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let (version, tags) = {
        let mut kv = lock(&state.kv);
        let (lag, tags) = (kv.replica_lag, kv.tags);
        let version = match &request {
            KvRequest::Read { version, .. } => *version,
            KvRequest::Write { key, .. } => kv
                .keys
                .entry(key.clone())
                .or_default()
                .commit(Instant::now(), lag),
        };
        (version, tags)
    };
    let body = format!("{{\"key\":{},\"version\":{version}}}", json_string(key));
    let mut resp = Response::new(full(body));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if tags && let Ok(value) = HeaderValue::from_str(&format!("kv-{key} kv-all")) {
        resp.headers_mut()
            .insert(HeaderName::from_static("surrogate-key"), value);
    }
    resp
}
