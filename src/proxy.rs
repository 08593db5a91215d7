//! The proxy: HTTP server, routing, and the three paths a request can take — the read
//! path ([`read`], with [`hot`], [`fill`], [`fetch`]), the write path ([`write`],
//! [`create`]) and pass-through ([`passthrough`]) — over the origin ([`origin`], the
//! upstream client and the origin guard).

pub(crate) mod access_log;
pub(crate) mod admit;
pub(crate) mod body;
pub(crate) mod chunk_guard;
pub(crate) mod conditional;
pub(crate) mod create;
pub(crate) mod fetch;
pub(crate) mod fill;
pub(crate) mod head_guard;
pub(crate) mod hot;
pub(crate) mod keepalive;
pub(crate) mod linger;
pub(crate) mod origin;
pub(crate) mod origin_guard;
pub(crate) mod own_answer;
pub(crate) mod passthrough;
pub(crate) mod purge;
pub(crate) mod purge_limits;
pub(crate) mod read;
pub(crate) mod reject;
pub(crate) mod respond;
pub(crate) mod route;
pub(crate) mod server;
pub(crate) mod spool;
pub(crate) mod stock;
pub(crate) mod upload;
pub(crate) mod upstream;
pub(crate) mod warmup;
pub(crate) mod write;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{HeaderValue, Method, Request, Response, Version, header};
use hyper::body::Incoming;

use self::access_log::{AccessLog, Answered, RouteName};
use self::body::Body;
use self::origin::Origin;
use self::own_answer::{OwnAnswer, OwnAnswerLog};
use self::passthrough::Passthrough;
use self::read::ReadPath;
use self::route::{Route, RouteTable};
use self::write::WritePath;
use crate::cache::l1::L1;
use crate::cache::marks::LocalMarks;
use crate::consistency::invalidate::{self, Invalidator};
use crate::coord::events::{BusListener, Delivery, Event, EventKind};
use crate::coord::store::RedisStore;
use crate::error::ProxyError;
use crate::metrics::{Metrics, RouteMetrics};
use crate::protect::hotkeys::HotKeys;

/// The methods RFC 9110 defines as safe: they never invalidate a cached answer. Any other,
/// an unknown extension method included, may change the resource.
fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// Adds `Connection: close` to an HTTP/1 answer cacheguard made itself when what it
/// answers leaves the connection's framing in doubt ([`ProxyError::ends_connection`]): hyper
/// then closes the connection once the answer is written, and a request pipelined behind it
/// is never read. (HTTP/2 frames each request apart, and has no `Connection` header.)
fn end_connection_if_untrusted(version: Version, response: &mut Response<Body>) {
    if version < Version::HTTP_2
        && response
            .extensions()
            .get::<OwnAnswer>()
            .is_some_and(|own| own.ends_connection)
    {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// The route name of requests that match no route, in metrics and logs.
pub(crate) const PASSTHROUGH: &str = "_passthrough";

/// The router: limits, then the route, then one of three paths — [`ReadPath`] for GET/HEAD
/// on a cached route, the write path (`write.rs`, `create.rs`) for write routes, and
/// pass-through for everything else. Built once by the app, shared by every connection.
#[derive(Debug)]
pub(crate) struct Proxy {
    /// Reloadable: swapped whole by a config reload (see `reload.rs`); shared with the
    /// write path.
    pub(crate) routes: Arc<ArcSwap<RouteTable>>,
    pub(crate) read: Arc<ReadPath>,
    pub(crate) write: Arc<WritePath>,
    pub(crate) passthrough: Arc<Passthrough>,
    /// The upstream client and origin guard every path shares (swapped by a reload).
    pub(crate) origin: Arc<Origin>,
    /// L1, for purges by pattern (in embedded mode it is the whole cache).
    pub(crate) l1: L1,
    /// The Redis calls of invalidation and the tag index; `None` in embedded mode.
    pub(crate) store: Option<RedisStore>,
    pub(crate) max_header_bytes: usize,
    /// `server.max_headers`: hyper refuses more on HTTP/1.1; checked here for HTTP/2.
    pub(crate) max_headers: usize,
    pub(crate) max_body_bytes: u64,
    pub(crate) metrics: Metrics,
    /// Metric handles for requests that match no route ([`PASSTHROUGH`]).
    pub(crate) passthrough_metrics: Arc<RouteMetrics>,
    /// Invalidation everywhere (L1, Redis, the journal), for purges.
    pub(crate) invalidator: Arc<Invalidator>,
    /// One log line per answer cacheguard makes itself, rate-limited.
    pub(crate) own_answers: OwnAnswerLog,
    /// One line per request, when `[access_log]` is on (reloadable).
    pub(crate) access_log: AccessLog,
}

/// Applies other instances' key events to this instance's cache: an `invalidate` drops
/// the base key and its variants from L1 (and ends their hot-key L1 grace) and raises its
/// version floor here when it carries one, a `hot` promotes the key here too.
#[derive(Debug)]
pub(crate) struct CacheEvents {
    pub(crate) l1: L1,
    pub(crate) hot: Arc<HotKeys>,
    pub(crate) marks: Arc<LocalMarks>,
}

impl BusListener for CacheEvents {
    fn on_key_event(&self, event: Event) {
        match event.kind {
            EventKind::Invalidate => {
                // The floor first, then the mark, at once (a fill finishing right now must
                // not keep its copy, a request arriving now must not join a flight begun
                // before, and the one it leads goes by the floor); the L1 removal itself is
                // async.
                if let Some((version, ttl_ms)) = event.floor {
                    self.marks
                        .raise_floor(event.hash, version, Duration::from_millis(ttl_ms));
                }
                self.marks.mark_key(event.hash);
                let (l1, hot) = (self.l1.clone(), Arc::clone(&self.hot));
                tokio::spawn(async move { invalidate::drop_base(&l1, &hot, event.hash).await });
            }
            EventKind::Hot => self.hot.peer_hot(event.instance, event.hash),
            EventKind::Fill | EventKind::Released | EventKind::Uncacheable | EventKind::Failed => {}
        }
    }

    /// Invalidations sent from now on may be missed: L1 copies are checked against Redis
    /// before they are served again, and until the bus is back the routes that ask for it
    /// answer from Redis rather than from L1 (`cache.l1_while_bus_down`).
    fn on_gap(&self, _unix_ms: u64) {
        self.marks.bus_lost();
    }

    /// Copies read from Redis during the gap may predate an invalidation sent during it:
    /// checked again too; then the bus counts as confirmed, if it hears a write's
    /// `invalidate` before the write's answer. A subscription that hears it later (another
    /// cluster node than the channel's primary) leaves the bus unconfirmed until the bus
    /// moves to the primary.
    fn on_subscribed(self: Arc<Self>, delivery: Delivery) {
        match delivery {
            Delivery::Prompt => self.marks.bus_confirmed_again(),
            Delivery::Late => self.marks.bus_lost(),
        }
    }
}

impl Proxy {
    /// Entry point for every proxied request: limits, then route, then the read path or
    /// pass-through; with the access log on, the answer's body is wrapped to write its line
    /// when it ends.
    pub(crate) async fn handle(
        self: &Arc<Self>,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        // Off: one atomic load, and the answer as it is.
        let Some(started) = self.access_log.begin(&request, client) else {
            return self.answer(request, client).await.1;
        };
        let ((route, response), origin) =
            access_log::timing_origin(self.answer(request, client)).await;
        let answered = Answered {
            route,
            status: response.status(),
            cache: response
                .headers()
                .get(&respond::X_CACHE)
                .map(access_log::cache_word),
            reason: response
                .extensions()
                .get::<OwnAnswer>()
                .map(|own| own.reason),
            origin,
        };
        match self.access_log.finish(started, answered) {
            Some(line) => response.map(|body| body.logged(line)),
            None => response,
        }
    }

    /// The answer to a request, with the route it took (for the access log).
    async fn answer(
        self: &Arc<Self>,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> (RouteName, Response<Body>) {
        let version = request.version();
        if let Err(error) = self.check_limits(&request) {
            self.metrics
                .rejected_requests
                .with_label_values(&[error.reason()])
                .inc();
            let mut response = respond::error(&error);
            end_connection_if_untrusted(version, &mut response);
            self.own_answers
                .record("-", request.method(), request.uri().path(), &response);
            return (RouteName::Static("-"), response);
        }
        // Cheap clones (no allocation for a standard method; the URI shares its bytes).
        let (method, uri) = (request.method().clone(), request.uri().clone());
        let (route, mut response) = self.route(request, client).await;
        end_connection_if_untrusted(version, &mut response);
        // Requests refused on their way (a broken, oversized, slow or unstorable body, a
        // cache-only method) are counted with those refused up front.
        if let Some(own) = response.extensions().get::<OwnAnswer>()
            && matches!(
                own.reason,
                "bad_request_body"
                    | "body_too_large"
                    | "upload_timeout"
                    | "upload_too_slow"
                    | "upload_deadline"
                    | "body_spool_failed"
                    | "method_not_allowed"
            )
        {
            self.metrics
                .rejected_requests
                .with_label_values(&[own.reason])
                .inc();
        }
        let name = route
            .as_ref()
            .map_or(PASSTHROUGH, |r| r.config.name.as_str());
        self.own_answers
            .record(name, &method, uri.path(), &response);
        let route = match route {
            Some(route) => RouteName::Route(route),
            None => RouteName::Static(PASSTHROUGH),
        };
        (route, response)
    }

    /// Sends a request within the limits down its path; returns its route (`None` for
    /// pass-through) with the answer.
    async fn route(
        self: &Arc<Self>,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> (Option<Arc<Route>>, Response<Body>) {
        let method = request.method();
        let head = method == Method::HEAD;
        let routes = self.routes.load();
        match routes.find(method, request.uri().path()) {
            Some(matched)
                if matched.route.config.is_read()
                    && (method == Method::GET || method == Method::HEAD) =>
            {
                let route = Arc::clone(matched.route);
                // The Bloom check of the read path: ids the filter knows nothing of end here.
                if let (Some(filter), Some(id)) = (&route.filter, matched.id)
                    && let Some(rejected) = reject::check(&route, filter, id, head)
                {
                    return (Some(route), rejected);
                }
                let response = self.read.serve(&route, request, client).await;
                (Some(route), response)
            }
            // Write routes: forwarded as they are, with the invalidations and Bloom adds
            // they owe around them.
            Some(matched) => {
                let route = Arc::clone(matched.route);
                let params = matched.params;
                let response = Box::pin(self.write.serve(&route, &params, request, client)).await;
                (Some(route), response)
            }
            None if admit::is_cache_method(method) => {
                (None, respond::error(&ProxyError::MethodNotAllowed))
            }
            None => {
                let metrics = Arc::clone(&self.passthrough_metrics);
                // An unsafe method on a cached path still invalidates it.
                if !is_safe(method)
                    && let Some(target) = self.write.path_target(request.uri().path())
                {
                    let response =
                        Box::pin(self.write.serve_unrouted(target, &metrics, request, client))
                            .await;
                    return (None, response);
                }
                (
                    None,
                    Box::pin(self.passthrough.serve(&metrics, request, client, &[])).await,
                )
            }
        }
    }

    /// Request head over `max_header_bytes`, or with more than `max_headers` fields → 431;
    /// declared body over `max_body_bytes` → 413 (undeclared bodies are cut at the limit
    /// while streaming).
    fn check_limits(&self, request: &Request<Incoming>) -> Result<(), ProxyError> {
        admit::check(request, self.max_header_bytes)?;
        if request.headers().len() > self.max_headers {
            return Err(ProxyError::TooManyHeaders(self.max_headers));
        }
        let head_bytes: usize = request
            .uri()
            .path_and_query()
            .map_or(0, |pq| pq.as_str().len())
            + request
                .headers()
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len() + 4)
                .sum::<usize>();
        if head_bytes > self.max_header_bytes {
            return Err(ProxyError::HeaderTooLarge(self.max_header_bytes));
        }
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > self.max_body_bytes) {
            return Err(ProxyError::BodyTooLarge(self.max_body_bytes));
        }
        Ok(())
    }
}
