//! One origin fetch for a cached route: through the origin guard, with only the keyed
//! inputs forwarded, the body read for storage (bounded by `max_entry_bytes`), then
//! classified. Storing is the caller's business (`fill.rs`).
//!
//! On a route with `version`, the answer's version is read too, and must reach the key's
//! version floor (see `cache/version.rs`): an answer older than a recent write's (its
//! replica has not caught up yet) is neither stored nor served, but fetched again, with a
//! short backoff, until the replica has caught up or `upstream.timeout` is spent:
//!
//! ```text
//! fetch ─▶ a failure (5xx, timeout, shed) ─▶ as it is: nothing to judge
//!       ─▶ version ≥ floor (or no floor) ─▶ the answer (stored at once by the caller)
//!       ─▶ older, or none while there is a floor ─▶ fill_refused{reason="older_version"},
//!             dropped; again after 10 ms, 20, 40 … 200 ms, each try through the guard
//!             ─▶ upstream.timeout spent since the first try ─▶ 503 (version_behind)
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::time::Instant as Deadline;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;

use super::body::Body;
use super::origin::{self, Origin};
use super::origin_guard::Reservation;
use super::own_answer::OwnAnswer;
use super::respond::{self, strip_hop_by_hop};
use super::route::Route;
use super::upstream::UpstreamBody;
use crate::cache::control::{
    ResponseControl, SURROGATE_CAPABILITY_VALUE, SURROGATE_CONTROL, Vary, heuristic_lifetime_secs,
    initial_age_secs, origin_lifetime_secs,
};
use crate::cache::entry::selecting_value;
use crate::cache::key::Derived;
use crate::cache::version::Version;
use crate::cache::{CacheKey, Entry, ttl};
use crate::clock::now_ms;
use crate::config::{FreshnessSource, RouteConfig};
use crate::consistency::tags;
use crate::error::ProxyError;
use crate::metrics::{OriginStatus, Outcome, Revalidation};

/// A miss to fill, detached from the client connection that asked for it: the fill runs in
/// its own task, so a client that hangs up never cancels a fetch other requests wait on.
#[derive(Clone, Debug)]
pub(crate) struct FillJob {
    pub(crate) route: Arc<Route>,
    pub(crate) key: CacheKey,
    /// Path and keyed query to request from the origin.
    pub(crate) forward: String,
    /// The client headers that travel with the fetch: the route's `vary` headers, and in
    /// `freshness = "origin"` mode every end-to-end header cacheguard does not own
    /// (see [`origin::end_to_end`]).
    pub(crate) headers: HeaderMap,
    pub(crate) client: SocketAddr,
    /// A refresh nobody waits on (stale-while-revalidate, early refresh).
    pub(crate) background: bool,
    /// The stored copy this fetch revalidates: its `ETag` / `Last-Modified` go along as
    /// `If-None-Match` / `If-Modified-Since`, and a `304` refreshes it.
    pub(crate) stored: Option<Arc<Entry>>,
    /// The client's own `If-None-Match` / `If-Modified-Since`, sent along when nothing is
    /// stored (see [`FillJob::forwarding_validators`]); empty otherwise.
    pub(crate) validators: HeaderMap,
}

impl FillJob {
    /// The fill of `derived`'s key for a request with `headers`: the values of the route's
    /// `vary` headers travel with it, and in origin mode the other end-to-end headers too.
    pub(crate) fn new(
        route: &Arc<Route>,
        derived: &Derived,
        headers: &HeaderMap,
        client: SocketAddr,
    ) -> Self {
        let keyed = &route.config.vary;
        let mut forwarded = match route.config.freshness {
            FreshnessSource::Route => HeaderMap::new(),
            FreshnessSource::Origin => origin::end_to_end(headers, keyed),
        };
        for name in keyed {
            forwarded.remove(name);
            for value in headers.get_all(name) {
                forwarded.append(name.clone(), value.clone());
            }
        }
        FillJob {
            route: Arc::clone(route),
            key: derived.key.clone(),
            forward: derived.forward_path_and_query(),
            headers: forwarded,
            client,
            background: false,
            stored: None,
            validators: HeaderMap::new(),
        }
    }

    /// A miss with nothing stored: on a `freshness = "origin"` route the client's own
    /// validators (`If-None-Match`, `If-Modified-Since` of `headers`) go with the fetch, so
    /// the origin can answer `304` as it would without a cache in between. That `304` is
    /// this client's answer alone ([`Classified::NotModified`]). A route with its own
    /// lifetimes sends the origin nothing of the client's beyond the key: its fetch stays
    /// whole, and the client's conditional is answered from the stored `200`
    /// (`conditional.rs`).
    pub(crate) fn forwarding_validators(mut self, headers: &HeaderMap) -> Self {
        if self.route.config.freshness == FreshnessSource::Origin {
            for name in [header::IF_NONE_MATCH, header::IF_MODIFIED_SINCE] {
                for value in headers.get_all(&name) {
                    self.validators.append(name.clone(), value.clone());
                }
            }
        }
        self
    }

    /// This fill without the client's validators: for a fetch whose answer other requests
    /// share.
    pub(crate) fn without_validators(&self) -> Self {
        let mut job = self.clone();
        job.validators.clear();
        job
    }

    /// This fill revalidates `stored`, when it has a validator (`ETag`, `Last-Modified`).
    pub(crate) fn revalidating(mut self, stored: Option<Arc<Entry>>) -> Self {
        self.stored = stored.filter(|entry| {
            entry.has_header(&header::ETAG) || entry.has_header(&header::LAST_MODIFIED)
        });
        self
    }
}

/// How an origin answer on a cached route was classified.
pub(crate) enum Classified {
    /// May be stored and shared; with the outcome to answer with: `Miss` for a new answer,
    /// `Revalidated` for a stored copy the origin confirmed; and the room its body holds
    /// until every client it goes to has been sent it (see [`served`]).
    Storable(Entry, Outcome, Reservation),
    /// A good answer that must not be shared (per-user, status outside the allowlist, too
    /// large): goes to one client only.
    Uncacheable(Response<Body>),
    /// The origin's `304` to the validators of the client whose request led the fetch (a
    /// miss with nothing stored, see [`FillJob::forwarding_validators`]): that client's
    /// answer alone. Nothing is stored, and the requests waiting on the fill need a whole
    /// answer, so for them the fill ended without one.
    NotModified(Response<Body>),
    /// Origin 5xx, timeout, unreachable, or shed: never stored.
    Failed(Failure),
}

/// A failed fill: the answer for the request that fetched, and, when the answer was
/// buffered whole, a copy its waiters can answer with instead of each going to the origin.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) response: Response<Body>,
    /// `Error` when cacheguard wrote the answer itself, `Bypass` for an origin 5xx.
    pub(crate) outcome: Outcome,
    pub(crate) shared: Option<Arc<SharedFailure>>,
}

/// A buffered failure answer that can be sent any number of times.
#[derive(Debug)]
pub(crate) struct SharedFailure {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    pub(crate) outcome: Outcome,
    /// Set when cacheguard made the answer itself: each copy is logged as its own.
    own: Option<OwnAnswer>,
}

/// The largest failure answer (headers and body) left in Redis for other instances'
/// waiters; a larger one is not shared there (one of them fetches again).
const MAX_SHARED_FAILURE: usize = 64 * 1024;

/// A failure answer as it travels through Redis to other instances' waiters.
#[derive(serde::Serialize, serde::Deserialize)]
struct StoredFailure {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

impl Failure {
    pub(crate) fn new(response: Response<Body>, outcome: Outcome) -> Self {
        let shared = match response.body() {
            Body::Full(bytes) => Some(Arc::new(SharedFailure {
                status: response.status(),
                headers: response.headers().clone(),
                body: bytes.clone().unwrap_or_default(),
                outcome,
                own: response.extensions().get::<OwnAnswer>().cloned(),
            })),
            Body::Stream(_) | Body::Prefixed(..) | Body::Logged(_) => None,
        };
        Failure {
            response,
            outcome,
            shared,
        }
    }

    /// cacheguard's own error answer.
    pub(crate) fn own(error: &ProxyError) -> Self {
        Failure::new(respond::error(error), Outcome::Error)
    }
}

impl SharedFailure {
    /// The copy other instances' waiters may answer with: only the origin's own answers
    /// (cacheguard's errors are each instance's to make and log), and only small ones.
    pub(crate) fn encode_for_fleet(&self) -> Option<Vec<u8>> {
        if self.own.is_some() {
            return None;
        }
        let stored = StoredFailure {
            status: self.status.as_u16(),
            headers: self
                .headers
                .iter()
                .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
                .collect(),
            body: self.body.to_vec(),
        };
        postcard::to_allocvec(&stored)
            .ok()
            .filter(|encoded| encoded.len() <= MAX_SHARED_FAILURE)
    }

    /// A copy another instance left in Redis; `None` if it does not decode.
    pub(crate) fn decode_from_fleet(bytes: &[u8]) -> Option<SharedFailure> {
        let stored: StoredFailure = postcard::from_bytes(bytes).ok()?;
        let mut headers = HeaderMap::with_capacity(stored.headers.len());
        for (name, value) in stored.headers {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).ok()?,
                http::HeaderValue::from_bytes(&value).ok()?,
            );
        }
        Some(SharedFailure {
            status: StatusCode::from_u16(stored.status).ok()?,
            headers,
            body: Bytes::from(stored.body),
            outcome: Outcome::Bypass,
            own: None,
        })
    }

    pub(crate) fn response(&self) -> Response<Body> {
        let mut response = Response::new(Body::full(self.body.clone()));
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers.clone();
        if let Some(own) = &self.own {
            response.extensions_mut().insert(own.clone());
        }
        response
    }
}

/// The first wait before an answer older than the floor is fetched again; each next one is
/// twice as long, up to [`FLOOR_RETRY_MAX`].
const FLOOR_RETRY_FIRST: Duration = Duration::from_millis(10);
const FLOOR_RETRY_MAX: Duration = Duration::from_millis(200);

/// Fetches `job` from the origin through the origin guard and classifies the answer; a
/// revalidation is counted by its result. On a route with `version`, with the answer's
/// version, which reaches `floor` (the key's version floor, if it has one): an older
/// answer is fetched again until one reaches it, or the answer is a 503 (see the module
/// docs). `None` for a failure, and on a route without `version` (one fetch, as always).
pub(crate) async fn from_origin(
    origin: &Origin,
    job: &FillJob,
    floor: Option<u128>,
) -> (Classified, Option<Version>) {
    let timeout = origin.upstream.load().timeout;
    let (classified, version) = match &job.route.config.version {
        None => (fetch(origin, job, timeout).await, None),
        Some(_) => reaching(origin, job, floor, timeout).await,
    };
    if job.stored.is_some() {
        job.route.metrics.revalidated(match &classified {
            Classified::Storable(_, Outcome::Revalidated, _) => Revalidation::NotModified,
            // (A revalidation sends the stored validators, never the client's: no
            // `NotModified` here.)
            Classified::Storable(..) | Classified::Uncacheable(_) | Classified::NotModified(_) => {
                Revalidation::Modified
            }
            Classified::Failed(_) => Revalidation::Failed,
        });
    }
    (classified, version)
}

/// Fetches until an answer's version reaches `floor`, within `budget` from now.
async fn reaching(
    origin: &Origin,
    job: &FillJob,
    floor: Option<u128>,
    budget: Duration,
) -> (Classified, Option<Version>) {
    let metrics = &job.route.metrics;
    let deadline = Deadline::now() + budget;
    let mut wait = FLOOR_RETRY_FIRST;
    loop {
        let left = deadline.saturating_duration_since(Deadline::now());
        let classified = fetch(origin, job, left).await;
        let version = answer_version(job, &classified);
        if version == Some(Version::Unparsed) {
            metrics.version_unparsed.inc();
        }
        // A failure carries no version to judge: it is the answer as it is.
        if version.is_none_or(|v| v.reaches(floor)) {
            return (classified, version);
        }
        metrics.refused_older.inc();
        drop(classified);
        if Deadline::now() + wait >= deadline {
            tracing::debug!(
                message = "The origin's answers stayed older than the key's version floor.",
                route = %job.route.config.name,
                floor = ?floor,
                version = ?version,
            );
            return (
                Classified::Failed(Failure::own(&ProxyError::VersionBehind)),
                version,
            );
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(FLOOR_RETRY_MAX);
    }
}

/// The version an answer carries, on a route with `version`; `None` for a failure.
fn answer_version(job: &FillJob, classified: &Classified) -> Option<Version> {
    let source = job.route.config.version.as_ref()?;
    match classified {
        Classified::Storable(entry, ..) => Some(Version::read(
            entry
                .header_lines()
                .filter(|(name, _)| name == source.header())
                .map(|(_, value)| value),
            source,
        )),
        // A client's own 304 confirms its copy only as far as the version it names.
        Classified::Uncacheable(response) | Classified::NotModified(response) => {
            Some(Version::of(response.headers(), source))
        }
        Classified::Failed(_) => None,
    }
}

/// One fetch, its answer read within `timeout`.
async fn fetch(origin: &Origin, job: &FillJob, timeout: Duration) -> Classified {
    let route = &job.route;
    let limit = route.config.max_entry_bytes;
    let (slot, reservation) = match origin.guard.load_full().acquire_buffered(limit).await {
        Ok(acquired) => acquired,
        Err(error) => {
            route.metrics.shed.inc();
            tracing::debug!(message = "Origin guard shed a request.", route = %route.config.name);
            return Classified::Failed(Failure::own(&error));
        }
    };

    let started = Instant::now();
    let upstream = origin.upstream.load_full();
    let read = tokio::time::timeout(timeout, async {
        let (response, retried) = upstream
            .send_idempotent(|| cached_fetch_request(origin, job))
            .await?;
        if retried {
            route.metrics.origin_retries.inc();
        }
        Ok::<_, ProxyError>(read_bounded(response, limit).await)
    })
    .await;
    let elapsed = started.elapsed();
    drop(slot);

    let read = match read {
        Err(_) => Err(ProxyError::OriginTimeout(timeout)),
        Ok(result) => result,
    };
    let seconds = elapsed.as_secs_f64();
    let (head, body) = match read {
        Ok(Ok(read)) => read,
        Ok(Err(error)) => {
            route.metrics.origin(OriginStatus::Error, seconds);
            let error = ProxyError::OriginConnect(format!("reading the answer's body: {error}"));
            return Classified::Failed(Failure::own(&error));
        }
        Err(error) => {
            let status = match error {
                ProxyError::OriginTimeout(_) => Some(OriginStatus::Timeout),
                // The request could not be built: nothing reached the origin.
                ProxyError::BadRequest(_) => None,
                _ => Some(OriginStatus::Error),
            };
            if let Some(status) = status {
                route.metrics.origin(status, seconds);
            }
            return Classified::Failed(Failure::own(&error));
        }
    };
    route
        .metrics
        .origin(OriginStatus::from_status(head.status.as_u16()), seconds);
    // The id passed a loaded filter, yet the origin has no such resource.
    if head.status == StatusCode::NOT_FOUND
        && let Some(filter) = &route.filter
        && filter.is_ready()
    {
        filter.metrics.false_positives.inc();
    }

    // An origin error is a failure: waiters may try again, nothing is stored (even with a
    // lifetime of its own: a stored error would replace the copy that stale-if-error
    // answers with while the origin fails).
    if head.status.is_server_error() {
        return Classified::Failed(Failure::new(
            origin_response(head, body.into_body(reservation), Outcome::Bypass),
            Outcome::Bypass,
        ));
    }
    // The origin's 304 to the client's own validators: that client's answer alone.
    if head.status == StatusCode::NOT_MODIFIED && job.stored.is_none() && !job.validators.is_empty()
    {
        let mut response = origin_response(head, body.into_body(reservation), Outcome::Bypass);
        strip_surrogate_control(response.headers_mut());
        return Classified::NotModified(response);
    }
    let complete = match body {
        ReadBody::Complete(bytes) => bytes,
        oversized @ ReadBody::Oversized(..) => {
            route.metrics.oversized.inc();
            return Classified::Uncacheable(origin_response(
                head,
                oversized.into_body(reservation),
                Outcome::Bypass,
            ));
        }
    };
    let fetch_ms = u32::try_from(elapsed.as_millis()).unwrap_or(u32::MAX);
    // A revalidation the origin confirmed: the stored answer, its headers updated from the
    // 304, then judged and stored as a new answer would be.
    let (head, complete, outcome) = match &job.stored {
        Some(stored) if head.status == StatusCode::NOT_MODIFIED => (
            Head {
                status: stored.status,
                headers: updated_headers(stored.headers(), head.headers),
            },
            stored.body(),
            Outcome::Revalidated,
        ),
        _ => (head, complete, Outcome::Miss),
    };
    let control = ResponseControl::parse(&head.headers);
    let shared = storable(&route.config, head.status, &head.headers, &control).and_then(|sel| {
        let life = lifetime(
            &route.config,
            head.status,
            &head.headers,
            &control,
            now_ms(),
            fetch_ms,
        )?;
        Ok((sel, life))
    });
    match shared {
        Ok((selecting, life)) => {
            let mut entry = new_entry(job, head, complete, fetch_ms, life);
            // The values the origin saw: what was forwarded.
            entry.selecting = selecting
                .into_iter()
                .map(|name| {
                    let value = selecting_value(&job.headers, &name);
                    (name, value)
                })
                .collect();
            if let Some(stored) = job.stored.as_ref().filter(|_| entry.tags.is_empty()) {
                // Surrogate keys left the stored headers when it was stored: keep them.
                entry.tags.clone_from(&stored.tags);
            }
            Classified::Storable(entry, outcome, reservation)
        }
        Err(why) => {
            route.metrics.uncacheable.inc();
            if why == NotShared::Vary {
                route.metrics.refused_vary.inc();
            }
            let body = Body::full(reservation.hold(complete));
            let mut response = origin_response(head, body, Outcome::Bypass);
            if route.config.freshness == FreshnessSource::Origin {
                strip_surrogate_control(response.headers_mut());
            }
            Classified::Uncacheable(response)
        }
    }
}

/// The request sent to the origin for a cached fetch. Only what is keyed goes out: the
/// normalized path and keyed query, the route's `vary` headers, and headers cacheguard
/// itself sets (`Host`, `X-Forwarded-For`, `X-Forwarded-Proto`). Client forwarding headers
/// go out only when the route keys them and names them in `forward_client_headers`.
/// Method-override headers, cookies, unkeyed query parameters and bodies never reach the
/// origin from here.
fn cached_fetch_request(
    origin: &Origin,
    job: &FillJob,
) -> Result<Request<UpstreamBody>, ProxyError> {
    let upstream = origin.upstream.load();
    let uri = upstream.uri(&job.forward)?;
    let mut request = Request::new(Empty::new().map_err(|never| match never {}).boxed());
    *request.method_mut() = Method::GET;
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    headers.insert(header::HOST, upstream.authority().clone());
    for (name, value) in &job.headers {
        headers.append(name.clone(), value.clone());
    }
    if let Some(stored) = &job.stored {
        for (validator, condition) in [
            (header::ETAG, header::IF_NONE_MATCH),
            (header::LAST_MODIFIED, header::IF_MODIFIED_SINCE),
        ] {
            if let Some(value) = stored.header(&validator) {
                headers.insert(condition, value);
            }
        }
    } else {
        for (name, value) in &job.validators {
            headers.append(name.clone(), value.clone());
        }
    }
    if job.route.config.freshness == FreshnessSource::Origin {
        // Edge Architecture: tells the origin it may aim Surrogate-Control at this cache.
        headers.append(
            SURROGATE_CAPABILITY.clone(),
            http::HeaderValue::from_static(SURROGATE_CAPABILITY_VALUE),
        );
    }
    // A header the route forwards from the client is keyed too (config load checks it).
    super::origin::set_forwarded(
        headers,
        job.client,
        &job.route.config.forward_client_headers,
    );
    Ok(request)
}

/// Headers a `304` never replaces in the stored copy (RFC 9111 §4.3.4 lets a cache keep
/// what its stored body depends on): the body's length, coding and range, its digest, and
/// the validator the revalidation matched.
const NOT_UPDATED_BY_304: [HeaderName; 5] = [
    header::CONTENT_LENGTH,
    header::CONTENT_ENCODING,
    header::CONTENT_RANGE,
    HeaderName::from_static("content-md5"),
    header::ETAG,
];

/// The stored headers updated from a `304` (RFC 9111 §4.3.4): each header the `304` has
/// replaces the stored one of that name, but for [`NOT_UPDATED_BY_304`].
fn updated_headers(mut headers: HeaderMap, mut not_modified: HeaderMap) -> HeaderMap {
    strip_hop_by_hop(&mut not_modified);
    let mut last = None;
    for (name, value) in not_modified {
        // `into_iter` names a header only at its first value.
        let name = match name {
            Some(name) => {
                last = Some(name.clone());
                if NOT_UPDATED_BY_304.contains(&name) {
                    continue;
                }
                headers.remove(&name);
                name
            }
            None => match &last {
                Some(name) if !NOT_UPDATED_BY_304.contains(name) => name.clone(),
                _ => continue,
            },
        };
        headers.append(name, value);
    }
    headers
}

static SURROGATE_CAPABILITY: HeaderName = HeaderName::from_static("surrogate-capability");

/// How long a storable answer is kept.
#[derive(Debug, PartialEq, Eq)]
struct Lifetime {
    stored_at_ms: u64,
    /// The age it arrived with (RFC 9111 §4.2.3).
    initial_age_secs: u64,
    ttl: Duration,
    /// Served stale at once while refreshed (stale-while-revalidate).
    grace: Duration,
    /// Served stale only when the origin fails (stale-if-error).
    error_grace: Duration,
    /// Kept at all: past both graces only to be revalidated.
    keep: Duration,
}

/// The lifetime of an answer stored at `stored_at_ms` after a fetch of `fetch_ms`: the
/// route's `ttl` (`negative_ttl` for 404/410) and `grace` in `freshness = "route"` mode; in
/// `"origin"` mode what the origin allows from now on (its lifetime minus the answer's
/// age), capped by the route's, with `stale-while-revalidate` as the grace and
/// `stale-if-error` (the route's `grace` without one) as the error grace, both capped by the
/// route's `grace` (RFC 9111 §4.2.4 lets a cache answer with a stale copy when the origin
/// cannot be reached, unless the answer forbids it). In route mode the two windows are the
/// route's `grace`. Jitter spreads a route lifetime both ways, but only ever shortens an
/// origin one. No grace for a negative entry (a stale "does not exist" after the item was
/// created is worse than one more origin request), nor for an answer that forbids stale use.
///
/// `Err(NotShared::NoFreshness)`: in origin mode, an answer that says nothing of its
/// freshness, or is stale on arrival and may never be used stale.
fn lifetime(
    route: &RouteConfig,
    status: StatusCode,
    headers: &HeaderMap,
    control: &ResponseControl,
    stored_at_ms: u64,
    fetch_ms: u32,
) -> Result<Lifetime, NotShared> {
    let negative = matches!(status.as_u16(), 404 | 410);
    let cap = if negative {
        route.negative_ttl
    } else {
        route.ttl
    };
    // An invalid `Age` is ignored (RFC 9111 §5.1): the age is then the apparent one.
    let initial_age_secs = initial_age_secs(headers, stored_at_ms, u64::from(fetch_ms));
    let origin_mode = route.freshness == FreshnessSource::Origin;
    let no_cache = control.no_cache(origin_mode);
    let rng = &mut rand::rng();
    let (ttl, grace, error_grace) = match route.freshness {
        FreshnessSource::Route => (
            ttl::jittered(cap, route.jitter, rng),
            route.grace,
            route.grace,
        ),
        FreshnessSource::Origin => {
            // `no-cache` needs no lifetime: it is revalidated on every use.
            let no_cache = no_cache.then_some(0);
            let lifetime = no_cache
                .or_else(|| origin_lifetime_secs(headers, control, stored_at_ms))
                .or_else(|| {
                    (route.heuristic > 0.0)
                        .then(|| heuristic_lifetime_secs(headers, route.heuristic, stored_at_ms))
                        .flatten()
                })
                .ok_or(NotShared::NoFreshness)?;
            let left = Duration::from_secs(lifetime.saturating_sub(initial_age_secs)).min(cap);
            let grace = control
                .stale_while_revalidate
                .map_or(Duration::ZERO, Duration::from_secs)
                .min(route.grace);
            let error_grace = control
                .stale_if_error
                .map_or(route.grace, Duration::from_secs)
                .min(route.grace);
            (ttl::shortened(left, route.jitter, rng), grace, error_grace)
        }
    };
    // `no-cache` (stored in origin mode only with a validator): never used without a
    // successful revalidation, so stale on arrival and never served stale.
    let (ttl, grace, error_grace) = if no_cache {
        (Duration::ZERO, Duration::ZERO, Duration::ZERO)
    } else if negative || control.forbids_stale() {
        (ttl, Duration::ZERO, Duration::ZERO)
    } else {
        (ttl, grace, error_grace.max(grace))
    };
    // An answer with a validator is kept for the route's grace whatever the windows: past
    // them it is not served, but a conditional fetch can bring it back with a 304.
    let keep = if has_validator(headers) && !negative {
        error_grace.max(route.grace)
    } else {
        error_grace
    };
    if ttl.is_zero() && keep.is_zero() {
        return Err(NotShared::NoFreshness);
    }
    Ok(Lifetime {
        stored_at_ms,
        initial_age_secs,
        ttl,
        grace,
        error_grace,
        keep,
    })
}

fn new_entry(job: &FillJob, head: Head, body: Bytes, fetch_ms: u32, life: Lifetime) -> Entry {
    let route = &job.route.config;
    let mut origin_headers = head.headers;
    strip_hop_by_hop(&mut origin_headers);
    let tags = tags::take(&mut origin_headers);
    if tags.ignored > 0 {
        tracing::debug!(message = "Surrogate keys ignored (too long, not UTF-8, or too many).", route = %route.name, ignored = tags.ignored);
    }
    for name in [
        header::SET_COOKIE,
        header::AGE,
        header::CONTENT_LENGTH,
        respond::X_CACHE.clone(),
    ] {
        origin_headers.remove(name);
    }
    if route.freshness == FreshnessSource::Origin {
        // Aimed at this cache, not at the clients (nor at caches after it).
        strip_surrogate_control(&mut origin_headers);
    }
    // The key and the kept lines are copied into one buffer: hyper's header values are
    // slices of the connection's read buffer (8 KiB and more), which an entry must not
    // pin. The body is kept as it was read.
    let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let mut entry = Entry::new(&job.key.full, head.status, &origin_headers, body);
    entry.stored_at_ms = life.stored_at_ms;
    entry.initial_age_secs = life.initial_age_secs;
    entry.ttl_ms = millis(life.ttl);
    entry.grace_ms = millis(life.grace);
    entry.error_grace_ms = millis(life.error_grace);
    entry.keep_ms = millis(life.keep);
    entry.fetch_ms = fetch_ms;
    entry.tags = tags.tags;
    entry
}

/// The status and headers of an origin answer.
struct Head {
    status: StatusCode,
    headers: HeaderMap,
}

/// An origin body read for storage.
enum ReadBody {
    Complete(Bytes),
    /// Outgrew `max_entry_bytes`: what was read so far, and the rest still streaming.
    Oversized(Bytes, Incoming),
}

impl ReadBody {
    /// The body for one client; what was buffered holds `reservation` until it is sent.
    fn into_body(self, reservation: Reservation) -> Body {
        match self {
            ReadBody::Complete(bytes) => Body::full(reservation.hold(bytes)),
            ReadBody::Oversized(prefix, rest) => {
                Body::Prefixed(Some(reservation.hold(prefix)), rest)
            }
        }
    }
}

/// The entry to answer this fill's clients with: `entry` (as stored) with a body that holds
/// `reservation` until the last of them has been sent it. The stored copies (L1, Redis)
/// never hold it: their memory is `l1_max_bytes`'s to bound.
pub(crate) fn served(entry: Arc<Entry>, reservation: Reservation) -> Arc<Entry> {
    if entry.body_len() == 0 {
        return entry;
    }
    let served = Arc::unwrap_or_clone(entry).map_body(|body| reservation.hold(body));
    Arc::new(served)
}

/// Reads an origin body into memory up to `limit` bytes.
async fn read_bounded(
    response: Response<Incoming>,
    limit: usize,
) -> Result<(Head, ReadBody), hyper::Error> {
    let (parts, mut body) = response.into_parts();
    let head = Head {
        status: parts.status,
        headers: parts.headers,
    };
    // A declared length over the limit is not buffered at all.
    let declared = head
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Ok((head, ReadBody::Oversized(Bytes::new(), body)));
    }
    let mut buf = BytesMut::with_capacity(declared.unwrap_or(0).min(limit));
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() > limit {
                return Ok((head, ReadBody::Oversized(buf.freeze(), body)));
            }
        }
    }
    // A body that grew by doubling may hold up to twice its length: keep an exact copy so
    // a cached entry holds what it weighs.
    let body = if buf.capacity() > buf.len() + buf.len() / 8 {
        Bytes::copy_from_slice(&buf)
    } else {
        buf.freeze()
    };
    Ok((head, ReadBody::Complete(body)))
}

/// Statuses that may be stored (404 and 410 as negative entries).
fn storable_status(status: StatusCode) -> bool {
    matches!(
        status.as_u16(),
        200 | 203 | 204 | 300 | 301 | 308 | 404 | 410
    )
}

/// A final status a cache may store, on an origin-mode route, when the answer gives its
/// own lifetime (RFC 9111 §3: a targeted `max-age`, `s-maxage`, `max-age`, `Expires`): not
/// a partial answer (`206`: only part of the body) nor `304` (no body at all). 5xx
/// answers are failures and never reach this.
fn final_status(status: StatusCode) -> bool {
    (200..500).contains(&status.as_u16()) && !matches!(status.as_u16(), 206 | 304)
}

/// Whether an answer carries a validator a conditional fetch can send back.
fn has_validator(headers: &HeaderMap) -> bool {
    headers.contains_key(header::ETAG) || headers.contains_key(header::LAST_MODIFIED)
}

/// Why an origin answer is not stored.
#[derive(Debug, PartialEq, Eq)]
enum NotShared {
    /// Its status, a `Set-Cookie`, or its `Cache-Control` (`private`, `no-store`,
    /// `no-cache`).
    Policy,
    /// Its `Vary` names a request header the route does not key (or is `*`).
    Vary,
    /// In origin mode: it says nothing of its freshness, or is stale on arrival.
    NoFreshness,
}

/// Removes `Surrogate-Control` from an answer passed on: the Edge Architecture has a
/// surrogate consume it. `CDN-Cache-Control` goes on: RFC 9213 aims it at every CDN cache on
/// the path, and one in front of cacheguard needs it as much.
fn strip_surrogate_control(headers: &mut HeaderMap) {
    headers.remove(&SURROGATE_CONTROL);
}

/// Whether an origin answer may be stored and shared by `route` (whose keyed request
/// headers are its `vary`).
///
/// A stored answer is only ever served to requests with the same key, so it may be shared
/// only if every request header its `Vary` names is in the key (RFC 9111 §4.1): a header
/// the route does not key — one it never forwards, or one cacheguard sets per client such
/// as `X-Forwarded-For` — would let the copy reach a client it was not made for.
/// `Accept-Encoding` is the one exception, for an answer without `Content-Encoding`:
/// cacheguard forwards no `Accept-Encoding` it does not key, so the origin chose the
/// identity encoding, which every client accepts (RFC 9110 §12.5.3).
///
/// In origin mode, where the client's end-to-end headers reach the origin, a `Vary`-named
/// header the route does not key but forwards is allowed too: it becomes the answer's
/// selecting header (returned), and the stored copy is served only to requests with the
/// same value (`Entry::selects`). A header cacheguard does not forward as the client sent
/// it (`X-Forwarded-For`, `Cookie`, …) still makes the answer unshareable.
fn storable(
    route: &RouteConfig,
    status: StatusCode,
    headers: &HeaderMap,
    control: &ResponseControl,
) -> Result<Vec<HeaderName>, NotShared> {
    let origin_mode = route.freshness == FreshnessSource::Origin;
    // `must-understand`: only a status cacheguard knows the caching rules of.
    let status_ok = storable_status(status)
        || (origin_mode
            && !control.must_understand
            && final_status(status)
            && origin_lifetime_secs(headers, control, 0).is_some());
    if !status_ok || headers.contains_key(header::SET_COOKIE) {
        return Err(NotShared::Policy);
    }
    // A `no-store` or `private` aimed at this cache (`Surrogate-Control`,
    // `CDN-Cache-Control`) is obeyed whatever the route's freshness source: the origin said
    // this cache must not keep it.
    if control.targeted.no_store || control.targeted.private {
        return Err(NotShared::Policy);
    }
    // In origin mode a `max-age` aimed at this cache (Surrogate-Control, CDN-Cache-Control)
    // overrides what `Cache-Control` says to caches in general; `private` still holds.
    let targeted = control.targeted_rules(origin_mode);
    // `no-cache` needs a revalidation on every use: in origin mode an answer with a
    // validator is stored and revalidated each time (see `lifetime`); otherwise it is not
    // stored. `must-understand` on a status cacheguard understands overrides `no-store`.
    let no_store = control.no_store && !control.must_understand;
    let no_cache = control.no_cache(origin_mode) && !(origin_mode && has_validator(headers));
    if control.private || (!targeted && no_store) || no_cache {
        return Err(NotShared::Policy);
    }
    let keyed = route.vary.as_slice();
    match Vary::of(headers) {
        Vary::None => Ok(Vec::new()),
        Vary::Any => Err(NotShared::Vary),
        Vary::Headers(names) => {
            let identity = !headers.contains_key(header::CONTENT_ENCODING);
            let mut selecting = Vec::new();
            for name in names {
                if keyed.contains(&name) || (name == header::ACCEPT_ENCODING && identity) {
                    continue;
                }
                if origin_mode && origin::forwarded_on_fetch(&name, keyed) {
                    selecting.push(name);
                } else {
                    return Err(NotShared::Vary);
                }
            }
            Ok(selecting)
        }
    }
}

/// An origin answer passed to one client, with hop-by-hop headers removed.
fn origin_response(head: Head, body: Body, outcome: Outcome) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = head.status;
    *response.headers_mut() = head.headers;
    strip_hop_by_hop(response.headers_mut());
    tags::take(response.headers_mut());
    respond::mark(&mut response, outcome);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cache::control::tests::headers;

    /// A route `r` with `settings` (TOML lines) on top of the defaults.
    fn route(settings: &str) -> RouteConfig {
        let toml = format!(
            "[upstream]\nurl = \"http://127.0.0.1:9\"\n\
             [[routes]]\nname = \"r\"\nmatch = \"/r/{{id}}\"\n{settings}\n"
        );
        let vars = std::collections::HashMap::<String, String>::new();
        let config = crate::config::Config::from_toml(&toml, "test.toml", &vars).expect("config");
        config.routes.into_iter().next().expect("one route")
    }

    fn check(route: &RouteConfig, h: &HeaderMap) -> Result<(), NotShared> {
        storable(route, StatusCode::OK, h, &ResponseControl::parse(h)).map(|_| ())
    }

    fn shareable(status: StatusCode, h: &HeaderMap) -> bool {
        storable(&route(""), status, h, &ResponseControl::parse(h)).is_ok()
    }

    #[test]
    fn vary_is_shared_only_on_keyed_headers() {
        let vary = |v: &'static str| headers(&[("vary", v)]);
        let plain = route("");
        let keyed = route("vary = [\"foo\"]");
        assert_eq!(check(&plain, &vary("Foo")), Err(NotShared::Vary));
        assert_eq!(check(&keyed, &vary("Foo")), Ok(()));
        assert_eq!(
            check(&keyed, &vary("x-forwarded-for")),
            Err(NotShared::Vary)
        );
        assert_eq!(check(&keyed, &vary("foo, *")), Err(NotShared::Vary));
        assert_eq!(check(&plain, &vary("Accept-Encoding")), Ok(()));
        let gzip = headers(&[("vary", "accept-encoding"), ("content-encoding", "gzip")]);
        assert_eq!(check(&plain, &gzip), Err(NotShared::Vary));
        // In origin mode a forwarded header the route does not key selects the copy.
        let origin = route("freshness = \"origin\"");
        let h = vary("Foo, Accept-Language");
        let selecting = storable(&origin, StatusCode::OK, &h, &ResponseControl::parse(&h));
        assert_eq!(
            selecting,
            Ok(vec![
                HeaderName::from_static("foo"),
                HeaderName::from_static("accept-language")
            ])
        );
        for owned in [
            "x-forwarded-for",
            "cookie",
            "authorization",
            "host",
            "range",
        ] {
            let h = headers(&[("vary", owned)]);
            assert_eq!(check(&origin, &h), Err(NotShared::Vary), "Vary: {owned}");
        }
        assert_eq!(
            check(&origin, &headers(&[("surrogate-control", "no-store")])),
            Err(NotShared::Policy)
        );
    }

    fn life(
        route: &RouteConfig,
        pairs: &[(&'static str, &'static str)],
    ) -> Result<Lifetime, NotShared> {
        let h = headers(pairs);
        lifetime(
            route,
            StatusCode::OK,
            &h,
            &ResponseControl::parse(&h),
            1_000_000,
            0,
        )
    }

    #[test]
    fn route_lifetimes_ignore_the_origin() {
        let r = route("ttl = \"60s\"\njitter = 0.0\ngrace = \"30s\"");
        let got = life(&r, &[("cache-control", "max-age=5")]).expect("stored");
        assert_eq!(
            (got.ttl, got.grace),
            (Duration::from_secs(60), Duration::from_secs(30))
        );
        let got = life(&r, &[("cache-control", "max-age=5, must-revalidate")]).expect("stored");
        assert_eq!(got.grace, Duration::ZERO);
        assert!(
            life(&r, &[]).is_ok(),
            "no freshness information: the route's"
        );
    }

    #[test]
    fn origin_lifetimes_are_the_origins_capped_by_the_route() {
        let r = route("freshness = \"origin\"\nttl = \"60s\"\njitter = 0.0\ngrace = \"30s\"");
        let secs = Duration::from_secs;
        let got = life(&r, &[("cache-control", "max-age=10")]).expect("stored");
        assert_eq!((got.ttl, got.grace), (secs(10), Duration::ZERO));
        assert_eq!(
            got.error_grace,
            secs(30),
            "stale-if-error by default, the route's grace"
        );
        let got = life(&r, &[("cache-control", "max-age=10, stale-if-error=5")]).expect("stored");
        assert_eq!(got.error_grace, secs(5));
        // no-cache with a validator: stored stale, kept only to be revalidated.
        let got = life(&r, &[("cache-control", "no-cache"), ("etag", "\"a\"")]).expect("kept");
        assert_eq!(
            (got.ttl, got.grace, got.error_grace, got.keep),
            (Duration::ZERO, Duration::ZERO, Duration::ZERO, secs(30))
        );
        assert_eq!(
            check(&r, &headers(&[("cache-control", "no-cache")])),
            Err(NotShared::Policy),
            "no validator: nothing to revalidate with"
        );
        let got = life(&r, &[("cache-control", "max-age=10, must-revalidate")]).expect("stored");
        assert_eq!(
            (got.grace, got.error_grace),
            (Duration::ZERO, Duration::ZERO)
        );
        let got = life(&r, &[("cache-control", "max-age=10"), ("age", "4")]).expect("stored");
        assert_eq!(got.ttl, secs(6), "minus the age it arrived with");
        let got = life(
            &r,
            &[("cache-control", "max-age=3600, stale-while-revalidate=99")],
        )
        .expect("stored");
        assert_eq!(
            (got.ttl, got.grace),
            (secs(60), secs(30)),
            "capped by ttl and grace"
        );
        let got = life(
            &r,
            &[("cache-control", "max-age=0, stale-while-revalidate=5")],
        )
        .expect("stored: servable stale while refreshed");
        assert_eq!((got.ttl, got.grace), (Duration::ZERO, secs(5)));
        assert_eq!(life(&r, &[]), Err(NotShared::NoFreshness));
        assert_eq!(
            life(&r, &[("cache-control", "max-age=0, must-revalidate")]),
            Err(NotShared::NoFreshness)
        );
        let modified = [
            ("date", "Thu, 01 Jan 1970 00:16:40 GMT"),
            ("last-modified", "Thu, 01 Jan 1970 00:00:00 GMT"),
        ];
        assert_eq!(
            life(&r, &modified),
            Err(NotShared::NoFreshness),
            "no heuristic"
        );
        let heuristic = route("freshness = \"origin\"\nheuristic = 0.01\njitter = 0.0");
        let got = life(&heuristic, &modified).expect("stored");
        assert_eq!(got.ttl, secs(10), "1% of 1000 s");
        assert_eq!(
            life(
                &r,
                &[
                    ("cache-control", "max-age=10, stale-if-error=0"),
                    ("age", "20")
                ]
            ),
            Err(NotShared::NoFreshness)
        );
        let jittered = route("freshness = \"origin\"\njitter = 0.5");
        for _ in 0..100 {
            let got = life(&jittered, &[("cache-control", "max-age=10")]).expect("stored");
            assert!(got.ttl <= secs(10) && got.ttl >= secs(5), "{got:?}");
        }
    }

    #[test]
    fn origin_mode_stores_any_final_status_it_is_given_a_lifetime_for() {
        let origin = route("freshness = \"origin\"");
        let fresh = headers(&[("cache-control", "max-age=60")]);
        let store = |status: u16, h: &HeaderMap, r: &RouteConfig| {
            let status = StatusCode::from_u16(status).expect("status");
            storable(r, status, h, &ResponseControl::parse(h)).is_ok()
        };
        for status in [302, 303, 307, 400, 499] {
            assert!(store(status, &fresh, &origin), "{status} with max-age");
            assert!(
                !store(status, &HeaderMap::new(), &origin),
                "{status} without"
            );
            assert!(!store(status, &fresh, &route("")), "{status} in route mode");
        }
        for status in [206, 304] {
            assert!(!store(status, &fresh, &origin), "{status}");
        }
        let understand = headers(&[("cache-control", "max-age=60, must-understand, no-store")]);
        assert!(
            !store(599, &understand, &origin),
            "an unknown status is not understood"
        );
        assert!(store(200, &understand, &origin), "no-store is overridden");
    }

    #[test]
    fn storable_rules() {
        assert!(shareable(StatusCode::OK, &HeaderMap::new()));
        assert!(shareable(StatusCode::NOT_FOUND, &HeaderMap::new()));
        assert!(!shareable(
            StatusCode::INTERNAL_SERVER_ERROR,
            &HeaderMap::new()
        ));
        assert!(!shareable(StatusCode::FORBIDDEN, &HeaderMap::new()));
        assert!(!shareable(
            StatusCode::OK,
            &headers(&[("set-cookie", "a=b")])
        ));
        assert!(!shareable(
            StatusCode::OK,
            &headers(&[("cache-control", "max-age=5, private")])
        ));
        assert!(!shareable(
            StatusCode::OK,
            &headers(&[("cache-control", "no-store")])
        ));
        assert!(!shareable(
            StatusCode::OK,
            &headers(&[("cache-control", "private=\"x\"")])
        ));
        assert!(shareable(
            StatusCode::OK,
            &headers(&[("cache-control", "public, max-age=60")])
        ));
        assert!(!shareable(StatusCode::OK, &headers(&[("vary", "*")])));
    }
}
