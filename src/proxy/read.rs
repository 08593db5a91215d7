//! The read path: a cacheable request walks these steps in order and leaves at the first
//! one that can answer.
//!
//! ```text
//! per-user request? ─▶ pass through (BYPASS)
//! derive key (one parse: key + forwarded URL)
//! L1 fresh hit ─▶ HIT-L1 / NEGATIVE
//! L2 fresh hit ─▶ HIT-L2 / NEGATIVE (fills L1 when the route's L1 policy says so)
//! single-flight: one leader per key fetches through the origin guard, stores, and hands the
//!                entry to its followers (MISS); uncacheable answers release followers to
//!                fetch for themselves; failures elect a new leader
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap};
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;

use super::Proxy;
use super::body::Body;
use super::respond::{self, strip_hop_by_hop};
use super::route::Route;
use super::upstream::UpstreamBody;
use crate::cache::key::{self, Derived};
use crate::cache::l2::Lookup;
use crate::cache::{CacheKey, Entry, Freshness, now_ms, ttl};
use crate::config::L1Policy;
use crate::error::ProxyError;
use crate::metrics::{OriginStatus, Outcome};
use crate::protect::flight::{FlightResult, Role};

/// How many times a follower joins a new flight after the leader failed or went away,
/// before it fetches for itself (still through the origin guard).
const MAX_FLIGHT_ATTEMPTS: usize = 3;

/// What one origin fetch on a cached route produced.
enum Fetched {
    /// Stored (L2 and/or L1); the same entry answers the leader and its followers.
    Stored(Arc<Entry>),
    /// A good answer that must not be shared (per-user, status outside the allowlist, too
    /// large): goes to this client only.
    Uncacheable(Response<Body>),
    /// Origin 5xx, timeout, unreachable, or shed: goes to this client only, never stored.
    /// The outcome is `Error` when cacheguard wrote the answer itself.
    Failed(Response<Body>, Outcome),
}

impl Proxy {
    /// Serves a GET/HEAD on a cached route and records its outcome.
    pub(crate) async fn serve_read(
        &self,
        route: &Arc<Route>,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        let started = Instant::now();
        let (parts, body) = request.into_parts();
        // GET/HEAD bodies are never forwarded on cached routes: they are not in the key.
        drop(body);
        let (response, outcome) = self.read(route, parts, client).await;
        route
            .metrics
            .answered(outcome, started.elapsed().as_secs_f64());
        response
    }

    async fn read(
        &self,
        route: &Arc<Route>,
        parts: Parts,
        client: SocketAddr,
    ) -> (Response<Body>, Outcome) {
        // Per-user requests are never answered from, or stored into, a shared cache.
        if parts.headers.contains_key(header::AUTHORIZATION)
            || parts.headers.contains_key(header::COOKIE)
        {
            let empty: UpstreamBody = Empty::new().map_err(|never| match never {}).boxed();
            return self.forward(parts, empty, client).await;
        }

        let head = parts.method == Method::HEAD;
        let derived = key::derive(
            &route.config,
            parts.uri.path(),
            parts.uri.query(),
            &parts.headers,
        );
        let key = &derived.key;

        if let Some((entry, tier)) = self.lookup(route, key).await {
            return hit(&entry, tier, head);
        }
        self.fill(route, &parts, &derived, client, head).await
    }

    /// L1, then L2. Only fresh entries answer here.
    async fn lookup(&self, route: &Route, key: &CacheKey) -> Option<(Arc<Entry>, Outcome)> {
        let use_l1 = self.uses_l1(route);
        let now = now_ms();
        if use_l1 {
            if let Some(entry) = self.l1.get(key).await {
                if entry.freshness(now) == Freshness::Fresh {
                    return Some((entry, Outcome::HitL1));
                }
            }
        }
        let l2 = self.l2.as_ref()?;
        match l2.get(key).await {
            Lookup::Hit(entry) if entry.freshness(now) == Freshness::Fresh => {
                if use_l1 {
                    self.l1.insert(key, Arc::clone(&entry)).await;
                }
                Some((entry, Outcome::HitL2))
            }
            Lookup::Hit(_) | Lookup::Miss | Lookup::Unavailable => None,
        }
    }

    /// Whether this route's entries live in L1. In embedded mode L1 is the only tier, so it
    /// holds everything unless the route says `off`. With Redis, `hot` keeps L1 for hot keys
    /// only (none are promoted until hot-key detection exists).
    fn uses_l1(&self, route: &Route) -> bool {
        match route.config.l1 {
            L1Policy::Off => false,
            L1Policy::All => true,
            L1Policy::Hot => self.l2.is_none(),
        }
    }

    /// A miss: one origin fetch per key in this process, shared with every concurrent miss.
    async fn fill(
        &self,
        route: &Arc<Route>,
        parts: &Parts,
        derived: &Derived,
        client: SocketAddr,
        head: bool,
    ) -> (Response<Body>, Outcome) {
        let key = &derived.key;
        let mut counted = false;
        for _ in 0..MAX_FLIGHT_ATTEMPTS {
            match self.flights.join(key.hash) {
                Role::Leader(leader) => {
                    // A flight that finished between our lookup and our join has already
                    // stored its entry: look once more before fetching again.
                    if let Some((entry, tier)) = self.lookup(route, key).await {
                        leader.finish(FlightResult::Filled(Arc::clone(&entry)));
                        return hit(&entry, tier, head);
                    }
                    return match self.fetch(route, parts, derived, client).await {
                        Fetched::Stored(entry) => {
                            leader.finish(FlightResult::Filled(Arc::clone(&entry)));
                            hit(&entry, Outcome::Miss, head)
                        }
                        Fetched::Uncacheable(response) => {
                            leader.finish(FlightResult::Uncacheable);
                            (response, Outcome::Bypass)
                        }
                        Fetched::Failed(response, outcome) => {
                            leader.finish(FlightResult::Failed);
                            (response, outcome)
                        }
                    };
                }
                Role::Follower(follower) => {
                    if !counted {
                        route.metrics.coalesced.inc();
                        counted = true;
                    }
                    match follower.wait(self.follower_wait_limit()).await {
                        FlightResult::Filled(entry) if entry.matches(key) => {
                            return hit(&entry, Outcome::Miss, head);
                        }
                        FlightResult::Uncacheable => break,
                        FlightResult::Filled(_)
                        | FlightResult::Failed
                        | FlightResult::Abandoned => {}
                    }
                }
            }
        }
        // Released by the flight (uncacheable answer) or out of attempts: fetch alone.
        match self.fetch(route, parts, derived, client).await {
            Fetched::Stored(entry) => hit(&entry, Outcome::Miss, head),
            Fetched::Uncacheable(response) => (response, Outcome::Bypass),
            Fetched::Failed(response, outcome) => (response, outcome),
        }
    }

    /// A follower never waits longer than a leader can take: the guard's queue plus the
    /// origin timeout, plus a margin.
    fn follower_wait_limit(&self) -> Duration {
        self.queue_timeout + self.upstream.timeout + Duration::from_secs(1)
    }

    /// One origin fetch for a cached route: through the origin guard, with only the keyed
    /// inputs forwarded, the body read for storage (bounded by `max_entry_bytes`), then
    /// classified and stored.
    async fn fetch(
        &self,
        route: &Route,
        parts: &Parts,
        derived: &Derived,
        client: SocketAddr,
    ) -> Fetched {
        let slot = match self.guard.acquire().await {
            Ok(slot) => slot,
            Err(error) => {
                route.metrics.shed.inc();
                tracing::debug!(message = "Origin guard shed a request.", route = %route.config.name);
                return Fetched::Failed(respond::error(&error), Outcome::Error);
            }
        };
        let request = match self.cached_fetch_request(route, parts, derived, client) {
            Ok(request) => request,
            Err(error) => return Fetched::Failed(respond::error(&error), Outcome::Error),
        };

        let started = Instant::now();
        let limit = route.config.max_entry_bytes;
        let timeout = self.upstream.timeout;
        let read = tokio::time::timeout(timeout, async {
            let response = self.upstream.send(request).await?;
            Ok::<_, ProxyError>(read_bounded(response, limit).await)
        })
        .await;
        let seconds = started.elapsed().as_secs_f64();
        drop(slot);

        let read = match read {
            Err(_) => Err(ProxyError::OriginTimeout(timeout)),
            Ok(result) => result,
        };
        let (head, body) = match read {
            Ok(Ok(read)) => read,
            Ok(Err(_)) | Err(ProxyError::OriginConnect(_)) => {
                route.metrics.origin(OriginStatus::Error, seconds);
                let error = ProxyError::OriginConnect("origin closed the connection".into());
                return Fetched::Failed(respond::error(&error), Outcome::Error);
            }
            Err(error) => {
                let status = match error {
                    ProxyError::OriginTimeout(_) => OriginStatus::Timeout,
                    _ => OriginStatus::Error,
                };
                route.metrics.origin(status, seconds);
                return Fetched::Failed(respond::error(&error), Outcome::Error);
            }
        };
        route
            .metrics
            .origin(OriginStatus::from_status(head.status.as_u16()), seconds);

        if head.status.is_server_error() {
            return Fetched::Failed(
                origin_response(head, body.into_body(), Outcome::Bypass),
                Outcome::Bypass,
            );
        }
        let complete = match body {
            ReadBody::Complete(bytes) => bytes,
            oversized @ ReadBody::Oversized(..) => {
                route.metrics.oversized.inc();
                return Fetched::Uncacheable(origin_response(
                    head,
                    oversized.into_body(),
                    Outcome::Bypass,
                ));
            }
        };
        if !storable(head.status, &head.headers) {
            route.metrics.uncacheable.inc();
            return Fetched::Uncacheable(origin_response(
                head,
                Body::full(complete),
                Outcome::Bypass,
            ));
        }

        let entry = Arc::new(self.new_entry(route, derived, head, complete));
        if let Some(l2) = &self.l2 {
            l2.store(&derived.key, &entry).await;
        }
        if self.uses_l1(route) {
            self.l1.insert(&derived.key, Arc::clone(&entry)).await;
        }
        Fetched::Stored(entry)
    }

    /// The request sent to the origin for a cached fetch. Only what is keyed goes out: the
    /// normalized path and keyed query, the route's `vary` headers, and headers cacheguard
    /// itself sets (`Host`, `X-Forwarded-For`, `X-Forwarded-Proto`). Method-override headers,
    /// cookies, unkeyed query parameters and bodies never reach the origin from here.
    fn cached_fetch_request(
        &self,
        route: &Route,
        parts: &Parts,
        derived: &Derived,
        client: SocketAddr,
    ) -> Result<Request<UpstreamBody>, ProxyError> {
        let uri = self.upstream.uri(&derived.forward_path_and_query)?;
        let mut request = Request::new(Empty::new().map_err(|never| match never {}).boxed());
        *request.method_mut() = Method::GET;
        *request.uri_mut() = uri;
        let headers = request.headers_mut();
        headers.insert(header::HOST, self.upstream.authority().clone());
        for name in &route.config.vary {
            for value in parts.headers.get_all(name) {
                headers.append(name.clone(), value.clone());
            }
        }
        super::passthrough::set_forwarded(headers, client);
        Ok(request)
    }

    fn new_entry(&self, route: &Route, derived: &Derived, head: Head, body: Bytes) -> Entry {
        let negative = matches!(head.status.as_u16(), 404 | 410);
        let nominal = if negative {
            route.config.negative_ttl
        } else {
            route.config.ttl
        };
        let ttl = ttl::jittered(nominal, route.config.jitter, &mut rand::rng());
        let mut headers = head.headers;
        strip_hop_by_hop(&mut headers);
        for name in [
            header::SET_COOKIE,
            header::AGE,
            header::CONTENT_LENGTH,
            respond::X_CACHE.clone(),
        ] {
            headers.remove(name);
        }
        Entry {
            key: derived.key.full.clone(),
            status: head.status,
            headers,
            body,
            stored_at_ms: now_ms(),
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            grace_ms: u64::try_from(route.config.grace.as_millis()).unwrap_or(u64::MAX),
        }
    }
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
    fn into_body(self) -> Body {
        match self {
            ReadBody::Complete(bytes) => Body::full(bytes),
            ReadBody::Oversized(prefix, rest) => Body::Prefixed(Some(prefix), rest),
        }
    }
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
    Ok((head, ReadBody::Complete(buf.freeze())))
}

/// Statuses that may be stored (404 and 410 as negative entries).
fn storable_status(status: StatusCode) -> bool {
    matches!(
        status.as_u16(),
        200 | 203 | 204 | 300 | 301 | 308 | 404 | 410
    )
}

/// Whether an origin answer may be stored and shared.
fn storable(status: StatusCode, headers: &HeaderMap) -> bool {
    if !storable_status(status) || headers.contains_key(header::SET_COOKIE) {
        return false;
    }
    let forbidden = headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|directive| {
            directive
                .split('=')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .any(|d| d == "private" || d == "no-store" || d == "no-cache");
    let vary_star = headers
        .get_all(header::VARY)
        .iter()
        .any(|v| v.as_bytes().trim_ascii() == b"*");
    !forbidden && !vary_star
}

fn hit(entry: &Entry, tier: Outcome, head: bool) -> (Response<Body>, Outcome) {
    let outcome = if entry.is_negative() && tier != Outcome::Miss {
        Outcome::Negative
    } else {
        tier
    };
    (respond::from_entry(entry, outcome, head, now_ms()), outcome)
}

/// An origin answer passed to one client, with hop-by-hop headers removed.
fn origin_response(head: Head, body: Body, outcome: Outcome) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = head.status;
    *response.headers_mut() = head.headers;
    strip_hop_by_hop(response.headers_mut());
    respond::mark(&mut response, outcome);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn storable_rules() {
        assert!(storable(StatusCode::OK, &HeaderMap::new()));
        assert!(storable(StatusCode::NOT_FOUND, &HeaderMap::new()));
        assert!(!storable(
            StatusCode::INTERNAL_SERVER_ERROR,
            &HeaderMap::new()
        ));
        assert!(!storable(StatusCode::FORBIDDEN, &HeaderMap::new()));
        assert!(!storable(
            StatusCode::OK,
            &headers(&[("set-cookie", "a=b")])
        ));
        assert!(!storable(
            StatusCode::OK,
            &headers(&[("cache-control", "max-age=5, private")])
        ));
        assert!(!storable(
            StatusCode::OK,
            &headers(&[("cache-control", "no-store")])
        ));
        assert!(!storable(
            StatusCode::OK,
            &headers(&[("cache-control", "private=\"x\"")])
        ));
        assert!(storable(
            StatusCode::OK,
            &headers(&[("cache-control", "public, max-age=60")])
        ));
        assert!(!storable(StatusCode::OK, &headers(&[("vary", "*")])));
    }
}
