//! One origin fetch for a cached route: through the origin guard, with only the keyed
//! inputs forwarded, the body read for storage (bounded by `max_entry_bytes`), then
//! classified. Storing is the caller's business (`fill.rs`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;

use super::body::Body;
use super::origin::Origin;
use super::own_answer::OwnAnswer;
use super::respond::{self, strip_hop_by_hop};
use super::route::Route;
use super::upstream::UpstreamBody;
use crate::cache::control::{ResponseControl, Vary, initial_age_secs};
use crate::cache::key::Derived;
use crate::cache::{CacheKey, Entry, ttl};
use crate::clock::now_ms;
use crate::consistency::tags;
use crate::error::ProxyError;
use crate::metrics::{OriginStatus, Outcome};

/// A miss to fill, detached from the client connection that asked for it: the fill runs in
/// its own task, so a client that hangs up never cancels a fetch other requests wait on.
#[derive(Clone, Debug)]
pub(crate) struct FillJob {
    pub(crate) route: Arc<Route>,
    pub(crate) key: CacheKey,
    /// Path and keyed query to request from the origin.
    pub(crate) forward: String,
    /// The values of the route's `vary` headers, the only client headers forwarded.
    pub(crate) vary: HeaderMap,
    pub(crate) client: SocketAddr,
    /// A refresh nobody waits on (stale-while-revalidate, early refresh).
    pub(crate) background: bool,
}

impl FillJob {
    /// The fill of `derived`'s key for a request with `headers`: only the values of the
    /// route's `vary` headers travel with it.
    pub(crate) fn new(
        route: &Arc<Route>,
        derived: &Derived,
        headers: &HeaderMap,
        client: SocketAddr,
    ) -> Self {
        let mut vary = HeaderMap::new();
        for name in &route.config.vary {
            for value in headers.get_all(name) {
                vary.append(name.clone(), value.clone());
            }
        }
        FillJob {
            route: Arc::clone(route),
            key: derived.key.clone(),
            forward: derived.forward_path_and_query.clone(),
            vary,
            client,
            background: false,
        }
    }
}

/// How an origin answer on a cached route was classified.
pub(crate) enum Classified {
    /// May be stored and shared.
    Storable(Entry),
    /// A good answer that must not be shared (per-user, status outside the allowlist, too
    /// large): goes to one client only.
    Uncacheable(Response<Body>),
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
    /// Whether a waiter should try the origin once more itself (an origin 5xx may be
    /// transient), rather than answer with this copy at once (cacheguard's own errors:
    /// shed, timeouts, lock wait — retrying inside the same request would hit them again).
    pub(crate) retry: bool,
    /// Set when cacheguard made the answer itself: each copy is logged as its own.
    own: Option<OwnAnswer>,
}

impl Failure {
    pub(crate) fn new(response: Response<Body>, outcome: Outcome, retry: bool) -> Self {
        let shared = match response.body() {
            Body::Full(bytes) => Some(Arc::new(SharedFailure {
                status: response.status(),
                headers: response.headers().clone(),
                body: bytes.clone().unwrap_or_default(),
                outcome,
                retry,
                own: response.extensions().get::<OwnAnswer>().cloned(),
            })),
            Body::Stream(_) | Body::Prefixed(..) => None,
        };
        Failure {
            response,
            outcome,
            shared,
        }
    }

    /// cacheguard's own error answer.
    pub(crate) fn own(error: &ProxyError) -> Self {
        Failure::new(respond::error(error), Outcome::Error, false)
    }
}

impl SharedFailure {
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

/// Fetches `job` from the origin through the origin guard and classifies the answer.
pub(crate) async fn from_origin(origin: &Origin, job: &FillJob) -> Classified {
    let route = &job.route;
    let slot = match origin.guard.load_full().acquire().await {
        Ok(slot) => slot,
        Err(error) => {
            route.metrics.shed.inc();
            tracing::debug!(message = "Origin guard shed a request.", route = %route.config.name);
            return Classified::Failed(Failure::own(&error));
        }
    };
    let request = match cached_fetch_request(origin, job) {
        Ok(request) => request,
        Err(error) => return Classified::Failed(Failure::own(&error)),
    };

    let started = Instant::now();
    let limit = route.config.max_entry_bytes;
    let upstream = origin.upstream.load_full();
    let timeout = upstream.timeout;
    let read = tokio::time::timeout(timeout, async {
        let response = upstream.send(request).await?;
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
                ProxyError::OriginTimeout(_) => OriginStatus::Timeout,
                _ => OriginStatus::Error,
            };
            route.metrics.origin(status, seconds);
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

    if head.status.is_server_error() {
        return Classified::Failed(Failure::new(
            origin_response(head, body.into_body(), Outcome::Bypass),
            Outcome::Bypass,
            true,
        ));
    }
    let complete = match body {
        ReadBody::Complete(bytes) => bytes,
        oversized @ ReadBody::Oversized(..) => {
            route.metrics.oversized.inc();
            return Classified::Uncacheable(origin_response(
                head,
                oversized.into_body(),
                Outcome::Bypass,
            ));
        }
    };
    if let Err(why) = storable(head.status, &head.headers, &route.config.vary) {
        route.metrics.uncacheable.inc();
        if why == NotShared::Vary {
            route.metrics.refused_vary.inc();
        }
        return Classified::Uncacheable(origin_response(
            head,
            Body::full(complete),
            Outcome::Bypass,
        ));
    }
    let fetch_ms = u32::try_from(elapsed.as_millis()).unwrap_or(u32::MAX);
    Classified::Storable(new_entry(job, head, complete, fetch_ms))
}

/// The request sent to the origin for a cached fetch. Only what is keyed goes out: the
/// normalized path and keyed query, the route's `vary` headers, and headers cacheguard
/// itself sets (`Host`, `X-Forwarded-For`, `X-Forwarded-Proto`). Method-override headers,
/// cookies, unkeyed query parameters and bodies never reach the origin from here.
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
    for (name, value) in &job.vary {
        headers.append(name.clone(), value.clone());
    }
    super::origin::set_forwarded(headers, job.client);
    Ok(request)
}

fn new_entry(job: &FillJob, head: Head, body: Bytes, fetch_ms: u32) -> Entry {
    let route = &job.route.config;
    let negative = matches!(head.status.as_u16(), 404 | 410);
    let nominal = if negative {
        route.negative_ttl
    } else {
        route.ttl
    };
    let ttl = ttl::jittered(nominal, route.jitter, &mut rand::rng());
    let control = ResponseControl::parse(&head.headers);
    let stored_at_ms = now_ms();
    let initial_age_secs = initial_age_secs(&head.headers, stored_at_ms, u64::from(fetch_ms));
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
    // hyper's header values are slices of the connection's read buffer (8 KiB and more):
    // keeping them would pin a whole buffer per cached entry. Copy what is kept.
    let mut headers = HeaderMap::with_capacity(origin_headers.len());
    for (name, value) in &origin_headers {
        let mut owned =
            http::HeaderValue::from_bytes(value.as_bytes()).unwrap_or_else(|_| value.clone());
        owned.set_sensitive(value.is_sensitive());
        headers.append(name.clone(), owned);
    }
    Entry {
        key: job.key.full.clone(),
        status: head.status,
        headers,
        body,
        stored_at_ms,
        initial_age_secs,
        ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        // A negative entry gets no grace: serving a stale "does not exist" after the item was
        // created is worse than one more origin request. Nor does an answer whose origin
        // forbids serving it stale (`must-revalidate` and the like): past its lifetime it is
        // fetched again, and an origin failure is answered as one.
        grace_ms: if negative || control.forbids_stale() {
            0
        } else {
            u64::try_from(route.grace.as_millis()).unwrap_or(u64::MAX)
        },
        fetch_ms,
        tags: tags.tags,
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

/// Why an origin answer is not stored.
#[derive(Debug, PartialEq, Eq)]
enum NotShared {
    /// Its status, a `Set-Cookie`, or its `Cache-Control` (`private`, `no-store`,
    /// `no-cache`).
    Policy,
    /// Its `Vary` names a request header the route does not key (or is `*`).
    Vary,
}

/// Whether an origin answer may be stored and shared by a route that keys the request
/// headers `keyed`.
///
/// A stored answer is only ever served to requests with the same key, so it may be shared
/// only if every request header its `Vary` names is in the key (RFC 9111 §4.1): a header
/// the route does not key — one it never forwards, or one cacheguard sets per client such
/// as `X-Forwarded-For` — would let the copy reach a client it was not made for.
/// `Accept-Encoding` is the one exception, for an answer without `Content-Encoding`:
/// cacheguard forwards no `Accept-Encoding` it does not key, so the origin chose the
/// identity encoding, which every client accepts (RFC 9110 §12.5.3).
fn storable(
    status: StatusCode,
    headers: &HeaderMap,
    keyed: &[HeaderName],
) -> Result<(), NotShared> {
    if !storable_status(status) || headers.contains_key(header::SET_COOKIE) {
        return Err(NotShared::Policy);
    }
    let control = ResponseControl::parse(headers);
    if control.private || control.no_store || control.no_cache {
        return Err(NotShared::Policy);
    }
    match Vary::of(headers) {
        Vary::None => Ok(()),
        Vary::Any => Err(NotShared::Vary),
        Vary::Headers(names) => {
            let identity = !headers.contains_key(header::CONTENT_ENCODING);
            let keyed_or_identity = |name: &HeaderName| {
                keyed.contains(name) || (*name == header::ACCEPT_ENCODING && identity)
            };
            if names.iter().all(keyed_or_identity) {
                Ok(())
            } else {
                Err(NotShared::Vary)
            }
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

    fn shareable(status: StatusCode, h: &HeaderMap) -> bool {
        storable(status, h, &[]).is_ok()
    }

    #[test]
    fn vary_is_shared_only_on_keyed_headers() {
        let foo = HeaderName::from_static("foo");
        let vary = |v: &'static str| headers(&[("vary", v)]);
        assert_eq!(
            storable(StatusCode::OK, &vary("Foo"), &[]),
            Err(NotShared::Vary)
        );
        assert_eq!(
            storable(StatusCode::OK, &vary("Foo"), std::slice::from_ref(&foo)),
            Ok(())
        );
        assert_eq!(
            storable(
                StatusCode::OK,
                &vary("x-forwarded-for"),
                std::slice::from_ref(&foo)
            ),
            Err(NotShared::Vary)
        );
        assert_eq!(
            storable(StatusCode::OK, &vary("foo, *"), std::slice::from_ref(&foo)),
            Err(NotShared::Vary)
        );
        assert_eq!(
            storable(StatusCode::OK, &vary("Accept-Encoding"), &[]),
            Ok(())
        );
        let gzip = headers(&[("vary", "accept-encoding"), ("content-encoding", "gzip")]);
        assert_eq!(storable(StatusCode::OK, &gzip, &[]), Err(NotShared::Vary));
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
