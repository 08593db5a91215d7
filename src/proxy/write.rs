//! The write path: a write route's request is forwarded as it is, and the cache keys its
//! `invalidate` patterns name — plus the surrogate keys its answer names — are invalidated
//! around it (delayed double delete):
//!
//! 1. before forwarding: each key's generation is bumped and its entry, variants and lock
//!    deleted in Redis, every instance drops its L1 copies (`invalidate` event);
//! 2. after the origin answers, whatever it answered (an unknown outcome still
//!    invalidates: a spurious delete costs one miss, a missed one costs stale data), the
//!    keys again and the tags of the answer (`Surrogate-Key` / `Cache-Tag`);
//! 3. once more, so that it has landed `double_delete_delay` after the answer: this removes
//!    a copy that a read racing the write, or a lagging replica behind the origin, put back.
//!
//! And from the first delete until a little after the third, the keys are *quarantined*:
//! fills answer their requests but store nothing, in Redis or L1. The origin's replica may
//! not have the write yet, so what it answers now may be the old value; keeping it would
//! serve it until the third delete. With the quarantine, how long the old value is seen
//! after a write is bounded by the replica's own lag, not by `double_delete_delay`; the
//! third delete remains for a fill that began before it and stores after the quarantine.
//! The cost: a written key is fetched (coalesced, one fetch per instance at a time) rather
//! than cached for `double_delete_delay`.
//!
//! The generation bump is what makes step 1 safe against a fill already in flight: its
//! store is refused. An invalidation Redis cannot take is journaled before the answer is
//! released (see `consistency/invalidate.rs`): the write itself always goes through.
//!
//! # Version floor
//!
//! A write route with `version` replaces the guess (a quarantine as long as the replica
//! might lag) with the database's own word, for the keys whose read route has `version`
//! too (of the same kind: integers, or dates):
//!
//! 1. before forwarding: the keys are invalidated, without a quarantine;
//! 2. after the answer, when it carries a version *v* (a status below 500, a header that
//!    parses): the keys are invalidated again and their **floor** raised to *v* for
//!    `version_floor_ttl`, in the same script, before the client gets the answer; no third
//!    delete. From then on a fill of them stores and serves only an answer of version ≥
//!    *v* (an older one is fetched again: see `proxy/fetch.rs`), and the first such answer
//!    is stored at once. An answer stored between 1 and 2 is deleted by 2.
//!
//! An answer without a usable version (a 5xx, a missing or garbled header: counted in
//! `cacheguard_version_unparsed_total`) sets no floor: those keys then get the quarantine
//! of step 2 and the third delete, as above. Keys whose read route has no `version`, tags
//! and the paths an answer names always do. The floor travels in the `invalidate` event,
//! so every instance knows it for its fills without Redis.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{HeaderName, HeaderValue, Method, Request, Response, header};
use hyper::body::Incoming;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::access_log::{origin_waited, timing_origin};
use super::body::Body;
use super::passthrough::Passthrough;
use super::respond;
use super::route::{Route, RouteTable};
use super::spool::Spooled;
use super::stock;
use crate::cache::key::{self, normalized_params};
use crate::cache::version::{Floor, Version};
use crate::config::{OnRedisError, VersionSource, fill_pattern};
use crate::consistency::invalidate::{Invalidation, Invalidator, Source};
use crate::consistency::tags;
use crate::error::ProxyError;
use crate::metrics::RouteMetrics;
use crate::metrics::SerializeOutcome;
use crate::protect::bloom::Filters;
use crate::protect::serialize::{Held, Refusal, Serializer};

/// The third delete is issued this much (at most a quarter of the delay) before
/// `double_delete_delay` is up, so that it has landed by then despite timer and Redis
/// latency.
const THIRD_DELETE_LEAD: Duration = Duration::from_millis(20);

/// Everything a write needs; built once by the app, shared by every connection.
#[derive(Debug)]
pub(crate) struct WritePath {
    /// The router's table (reloadable): a write's `invalidate` patterns name read routes.
    pub(crate) routes: Arc<ArcSwap<RouteTable>>,
    /// Invalidation everywhere (L1, Redis, the journal).
    pub(crate) invalidator: Arc<Invalidator>,
    /// Bloom filters, which a create's id is added to (`create.rs`).
    pub(crate) filters: Arc<Filters>,
    pub(crate) passthrough: Arc<Passthrough>,
    /// Delayed deletes waiting for their time.
    pub(crate) deferred: TaskTracker,
    /// The main runtime: delayed deletes run there, not on a proxy worker's runtime,
    /// which is gone by the time shutdown runs them early.
    pub(crate) background: tokio::runtime::Handle,
    /// Cancelled at shutdown: delayed deletes then run at once.
    pub(crate) stop: CancellationToken,
    /// The locks and queues of serialized writes.
    pub(crate) serializer: Arc<Serializer>,
}

/// The resource a serialized write's fencing token is for (its path), beside the token.
static FENCING_KEY: HeaderName = HeaderName::from_static("fencing-key");

impl WritePath {
    /// Serves a request on a write route: forwarded, with its invalidations around it.
    pub(crate) async fn serve(
        self: &Arc<Self>,
        route: &Arc<Route>,
        params: &[(String, String)],
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        let delay = route.config.double_delete_delay;
        let lead = THIRD_DELETE_LEAD.min(delay / 4);
        // Until a little after the third delete (zero when there is none).
        let quarantine = if delay.is_zero() {
            Duration::ZERO
        } else {
            delay + lead
        };
        // A stock gate's crowd on a sold-out resource is answered here, from memory,
        // before its body is read.
        let gated = stock::Gated::of(route, params);
        if let Some(answer) = gated
            .as_ref()
            .and_then(|g| g.sold_out_here(route, &request))
        {
            return answer;
        }
        // The body is read whole first (in memory up to `server.body_buffer_bytes`, the
        // rest in a spool file): a malformed, oversized, slow or stalled one is answered
        // here, before any invalidation runs and before anything reaches the origin.
        let (mut request, _room) = match self.passthrough.read_whole(request).await {
            Ok(buffered) => buffered,
            Err(error) => return respond::error(&error),
        };
        // The gate takes the buy's units (or answers for itself: sold out, a replay...).
        let reservation = match gated {
            Some(gated) => match gated.admit(route, &mut request).await {
                Ok(reservation) => reservation,
                Err(answer) => return answer,
            },
            None => None,
        };
        // Writes to one resource go one at a time across the fleet, each with its token.
        let lock = match self.lock(route, params, &mut request).await {
            Ok(lock) => lock,
            Err(answer) => return answer,
        };
        let host = request.headers().get(header::HOST).cloned();
        let Targets {
            floored,
            mut quarantined,
        } = self.invalidation_targets(route, params);
        // Keys a floor will guard take no quarantine now: what a fill stores before the
        // answer is deleted by the second invalidation.
        self.invalidate(&floored, Duration::ZERO).await;
        self.invalidate(&quarantined, quarantine).await;
        let mut response = if reservation.is_none() && lock.is_none() {
            self.forward(route, request, client).await
        } else {
            // Forwarded from a task of its own: a client that hangs up neither leaves the
            // units reserved nor lets the next write in while this one is at the origin.
            // The time it waited on the origin is this request's (the access log's).
            // The forward, the hold and the settlement are boxed: the task's future then
            // holds pointers, not their whole states (kilobytes), and is cheap to move into
            // the task.
            let (this, route) = (Arc::clone(self), Arc::clone(route));
            let write = tokio::spawn(timing_origin(async move {
                let forward = Box::pin(this.forward(&route, request, client));
                let response = match (lock, &route.serialized) {
                    (Some(held), Some(metrics)) => {
                        Box::pin(this.serializer.hold(held, forward, metrics)).await
                    }
                    _ => forward.await,
                };
                match reservation {
                    Some(reservation) => Box::pin(reservation.settle(response)).await,
                    None => response,
                }
            }));
            match write.await {
                Ok((response, waited)) => {
                    if let Some(waited) = waited {
                        origin_waited(waited);
                    }
                    response
                }
                Err(_) => respond::error(&ProxyError::Internal),
            }
        };
        let answered = Instant::now();
        quarantined.extend(
            tags::take(response.headers_mut())
                .tags
                .into_iter()
                .map(Invalidation::Tag),
        );
        quarantined.extend(self.named_by_answer(&response, host.as_ref()));
        // The answer's version floors the keys a floor guards; without one, they fall
        // back to the quarantine and the third delete.
        match floor_of(route, &response) {
            Some(floor) if !floored.is_empty() => {
                let floored: Vec<Invalidation> = floored
                    .into_iter()
                    .map(|target| target.with_floor(floor))
                    .collect();
                self.invalidate(&floored, Duration::ZERO).await;
            }
            _ => quarantined.extend(floored),
        }
        if quarantined.is_empty() {
            return response;
        }
        self.invalidate(&quarantined, quarantine).await;
        if !delay.is_zero() {
            let this = Arc::clone(self);
            self.deferred.spawn_on(
                async move {
                    // At shutdown, at once: the delete is owed whether or not we wait.
                    tokio::select! {
                        () = tokio::time::sleep_until(answered + delay - lead) => {}
                        () = this.stop.cancelled() => {}
                    }
                    this.invalidator
                        .invalidate(&quarantined, Source::Write, Duration::ZERO)
                        .await;
                },
                &self.background,
            );
        }
        response
    }

    /// Invalidates a write's `targets` (none: nothing to do), with `quarantine`.
    async fn invalidate(&self, targets: &[Invalidation], quarantine: Duration) {
        if !targets.is_empty() {
            self.invalidator
                .invalidate(targets, Source::Write, quarantine)
                .await;
        }
    }

    /// On a serialized route, waits for the lock on the resource the write names and puts
    /// its fencing token and the resource in the request (`Err`: the answer instead).
    async fn lock(
        &self,
        route: &Route,
        params: &[(String, String)],
        request: &mut Request<Spooled>,
    ) -> Result<Option<Held>, Response<Body>> {
        let (Some(config), Some(metrics)) = (&route.config.serialize, &route.serialized) else {
            return Ok(None);
        };
        // Percent-escapes normalized: `%41` and `A` are one resource, one lock.
        let path = fill_pattern(&config.key, &normalized_params(params));
        let retry_after = config.retry_after.as_secs().max(1);
        let held = match self.serializer.acquire(config, &path, metrics).await {
            Ok(held) => held,
            Err(Refusal::TooMany) => {
                return Err(respond::error(&ProxyError::WriteQueueFull(retry_after)));
            }
            Err(Refusal::Timeout) => {
                return Err(respond::error(&ProxyError::WriteLockWait(retry_after)));
            }
            Err(Refusal::Unavailable) => match config.on_redis_error {
                OnRedisError::Reject => {
                    return Err(respond::error(&ProxyError::WriteLockUnavailable(
                        retry_after,
                    )));
                }
                OnRedisError::Forward => {
                    metrics.outcome(SerializeOutcome::Ungated);
                    return Ok(None);
                }
            },
        };
        let headers = request.headers_mut();
        if let Some(name) = &config.fence_header {
            headers.insert(name.clone(), HeaderValue::from(held.token()));
        }
        if let Ok(key) = HeaderValue::from_str(&path) {
            headers.insert(FENCING_KEY.clone(), key);
        }
        Ok(Some(held))
    }

    /// Forwards a write (a create: with its Bloom add).
    async fn forward(
        &self,
        route: &Arc<Route>,
        request: Request<Spooled>,
        client: SocketAddr,
    ) -> Response<Body> {
        if route.adds_to.is_some() {
            self.serve_create(route, request, client).await
        } else {
            self.passthrough
                .serve_whole(
                    &route.metrics,
                    request,
                    client,
                    &route.config.forward_client_headers,
                )
                .await
        }
    }

    /// An unsafe method no write route takes, on a path a read route caches: forwarded, and
    /// after a non-error answer the path is invalidated (RFC 9111 §4.4: a cache must, for
    /// any method not known to be safe), with the URIs the answer's `Location` and
    /// `Content-Location` name. Once, without the delayed deletes of a write route.
    pub(crate) async fn serve_unrouted(
        &self,
        target: Invalidation,
        metrics: &RouteMetrics,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        let host = request.headers().get(header::HOST).cloned();
        let response = self.passthrough.serve(metrics, request, client, &[]).await;
        if !is_error(&response) {
            let mut targets = vec![target];
            targets.extend(self.named_by_answer(&response, host.as_ref()));
            self.invalidator
                .invalidate(&targets, Source::Write, Duration::ZERO)
                .await;
        }
        response
    }

    /// The paths a non-error answer to an unsafe method names in `Location` and
    /// `Content-Location` (RFC 9111 §4.4), if a read route caches them. Only URIs on this
    /// origin count — a path, or an absolute URL whose authority is the request's `Host` or
    /// the origin's — so an answer cannot make the cache drop another site's entries.
    fn named_by_answer(
        &self,
        response: &Response<Body>,
        host: Option<&HeaderValue>,
    ) -> Vec<Invalidation> {
        if is_error(response) {
            return Vec::new();
        }
        let upstream = self.passthrough.origin.upstream.load();
        let ours = |authority: &str| {
            host.is_some_and(|h| h.as_bytes().eq_ignore_ascii_case(authority.as_bytes()))
                || upstream
                    .authority()
                    .as_bytes()
                    .eq_ignore_ascii_case(authority.as_bytes())
        };
        [header::LOCATION, header::CONTENT_LOCATION]
            .iter()
            .filter_map(|name| response.headers().get(name)?.to_str().ok())
            .filter_map(|value| same_origin_path(value, ours))
            .filter_map(|path| self.path_target(&path))
            .collect()
    }

    /// The base keys a write on `route` with `params` invalidates: its `invalidate`
    /// patterns filled from the write's path parameters, each with all its variants; split
    /// by whether the write's answer can floor them (the write route and the key's read
    /// route both have `version`, of one kind).
    fn invalidation_targets(&self, route: &Route, params: &[(String, String)]) -> Targets {
        let mut targets = Targets::default();
        for pattern in &route.config.invalidate {
            let path = fill_pattern(pattern, params);
            let Some((target, read_version)) = self.read_target(&path) else {
                continue;
            };
            let floored = match (&route.config.version, &read_version) {
                (Some(write), Some(read)) => same_kind(write, read),
                _ => false,
            };
            if floored {
                targets.floored.push(target);
            } else {
                targets.quarantined.push(target);
            }
        }
        targets
    }

    /// The invalidation of `path` (every cached variant of it), if a read route caches it.
    pub(crate) fn path_target(&self, path: &str) -> Option<Invalidation> {
        self.read_target(path).map(|(target, _)| target)
    }

    /// [`WritePath::path_target`], with how the read route that caches `path` reads
    /// versions (its `version`).
    fn read_target(&self, path: &str) -> Option<(Invalidation, Option<VersionSource>)> {
        let routes = self.routes.load();
        let matched = routes.find(&Method::GET, path)?;
        let read = &matched.route.config;
        if !read.is_read() {
            return None;
        }
        let base = key::base(read, path);
        let target = Invalidation::Key {
            base: base.base,
            generation_ttl: self.invalidator.horizon(),
            floor: None,
        };
        Some((target, read.version.clone()))
    }
}

/// A write's keys, by what keeps older answers out of them after it.
#[derive(Debug, Default)]
struct Targets {
    /// Keys the answer's version floors (see the module docs).
    floored: Vec<Invalidation>,
    /// Keys a quarantine and the third delete guard.
    quarantined: Vec<Invalidation>,
}

/// Whether two routes' versions compare: both integers, or both dates.
fn same_kind(a: &VersionSource, b: &VersionSource) -> bool {
    matches!(
        (a, b),
        (VersionSource::Integer(_), VersionSource::Integer(_))
            | (VersionSource::Date(_), VersionSource::Date(_))
    )
}

/// The floor a write's answer sets, on a route with `version`: its version, for
/// `version_floor_ttl`. None for a 5xx (the write's outcome is unknown) or an answer whose
/// version is missing or does not parse (counted: it is never trusted).
fn floor_of(route: &Route, response: &Response<Body>) -> Option<Floor> {
    let source = route.config.version.as_ref()?;
    if response.status().is_server_error() {
        return None;
    }
    match Version::of(response.headers(), source) {
        Version::At(version) => Some(Floor {
            version,
            ttl: route.config.version_floor_ttl,
        }),
        Version::Unparsed => {
            route.metrics.version_unparsed.inc();
            None
        }
    }
}

/// Whether an answer is an error (4xx, 5xx): after one, nothing is invalidated by what it
/// names.
fn is_error(response: &Response<Body>) -> bool {
    response.status().is_client_error() || response.status().is_server_error()
}

/// The path of a `Location`/`Content-Location` value on this origin: a path-absolute
/// reference, or an absolute http(s) URL whose authority `ours` accepts. `None` otherwise
/// (another origin, a relative path, garbage).
fn same_origin_path(value: &str, ours: impl Fn(&str) -> bool) -> Option<String> {
    let value = value.trim();
    if value.starts_with('/') && !value.starts_with("//") {
        let end = value.find(['?', '#']).unwrap_or(value.len());
        return Some(value[..end].to_owned());
    }
    let uri: http::Uri = value.parse().ok()?;
    let scheme = uri.scheme_str()?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return None;
    }
    ours(uri.authority()?.as_str()).then(|| uri.path().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_same_origin_locations_name_a_path() {
        let ours = |a: &str| a == "api.test" || a == "127.0.0.1:9000";
        let path = |v: &str| same_origin_path(v, ours);
        assert_eq!(path("/items/7?x=1#f").as_deref(), Some("/items/7"));
        assert_eq!(path("http://api.test/items/7").as_deref(), Some("/items/7"));
        assert_eq!(path("http://127.0.0.1:9000/a").as_deref(), Some("/a"));
        assert_eq!(path("https://evil.test/items/7"), None);
        assert_eq!(path("//evil.test/items/7"), None);
        assert_eq!(path("items/7"), None);
        assert_eq!(path("ftp://api.test/items/7"), None);
    }
}
