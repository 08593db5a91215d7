//! The admin listener (default `127.0.0.1:9091`). Its endpoints:
//!
//! - `GET /` and `GET /status`: the status page, one self-contained HTML page (see
//!   [`status`]); `GET /status.json`: its numbers and the sampled history, as JSON;
//! - `GET /metrics`: Prometheus text;
//! - `GET /healthz`: liveness; `GET /readyz`: readiness (below);
//! - `GET /admin/bloom`: the Bloom filters; `POST /admin/bloom/{name}/rebuild`: reload one;
//! - `GET /admin/hotkeys`: the hot set;
//! - `GET /admin/redis`: the Redis topology and whether Redis is in the request path;
//! - `GET /admin/config`: the config in effect, secrets redacted;
//! - `POST /admin/purge`: invalidations (below).
//!
//! The `GET` endpoints are read-only and need no token; none of them shows a secret.
//!
//! `POST /admin/purge` takes `{"keys": ["/api/items/7"], "patterns": ["/api/items/*"],
//! "tags": ["item-7"]}` (any of the three; see `proxy/purge.rs` for what each means) and
//! answers 200 with what it did (`done`, or `journaled`: Redis could not take it now, it is
//! retried from the journal), 400 for a malformed body, 503 when a pattern purge cannot
//! reach Redis. Every purge request is audited in the log (caller, items, result), refused
//! ones included.
//!
//! Mutating calls need `Authorization: Bearer <admin.token>`: 401 without one, 403 with a
//! wrong one (or when no token is configured: mutating calls are then disabled). Every
//! mutating call is logged with the caller's address and the result.
//!
//! Purges are rate-limited per token ([`PurgeLimits`]): one over the limit gets 429 with
//! `Retry-After` and is counted in `cacheguard_purges_total{result="rate_limited"}`.
//!
//! `/readyz` answers 200 `ready`, or 200 `degraded: …` when Redis is configured but down, a
//! Bloom filter is not loaded (it then rejects nothing), or the retry journal cannot be
//! written (owed invalidations are then held in memory).
//! It stays 200 on purpose: Redis is an accelerator, and a readiness probe that failed with
//! Redis would pull every instance out of service at once — the outage cacheguard exists to
//! prevent. The body and `cacheguard_redis_up` say what is degraded.

mod status;

use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};

use arc_swap::ArcSwap;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use prometheus::{Encoder, Registry, TextEncoder};
use tracing::{info, warn};

use crate::cache::l1::L1;
use crate::coord::RedisConn;
use crate::metrics::Metrics;
use crate::protect::bloom::Filters;
use crate::protect::hotkeys::HotKeys;
use crate::proxy::Proxy;
use crate::proxy::body::Body;
use crate::proxy::purge::{PurgeError, PurgeRequest};
use crate::proxy::purge_limits::PurgeLimits;
use crate::proxy::respond;
use crate::reload::Live;

pub(crate) use self::status::Status;

#[derive(Debug)]
pub(crate) struct Admin {
    pub(crate) registry: Registry,
    pub(crate) metrics: Metrics,
    pub(crate) l1: L1,
    pub(crate) redis: Option<RedisConn>,
    pub(crate) filters: Arc<Filters>,
    pub(crate) hot: Arc<HotKeys>,
    /// Bearer token for mutating calls; `None` disables them. Reloadable.
    pub(crate) token: Arc<ArcSwap<Option<String>>>,
    /// Purges allowed per token. Reloadable.
    pub(crate) purge_limits: Arc<PurgeLimits>,
    /// For purges.
    pub(crate) proxy: Arc<Proxy>,
    /// The config in effect, for `GET /admin/config`.
    pub(crate) live: Arc<Live>,
    /// The status page and its sampled history.
    pub(crate) status: Arc<Status>,
}

/// Largest purge request body.
const MAX_PURGE_BODY: usize = 1 << 20;

/// The admin endpoints.
#[derive(Clone, Copy, Debug)]
enum Endpoint {
    Metrics,
    Healthz,
    Readyz,
    Bloom,
    BloomRebuild,
    HotKeys,
    Purge,
    Config,
    Redis,
    StatusPage,
    StatusJson,
}

static ENDPOINTS: LazyLock<matchit::Router<Endpoint>> = LazyLock::new(|| {
    let mut router = matchit::Router::new();
    for (path, endpoint) in [
        ("/metrics", Endpoint::Metrics),
        ("/healthz", Endpoint::Healthz),
        ("/readyz", Endpoint::Readyz),
        ("/admin/bloom", Endpoint::Bloom),
        ("/admin/bloom/{name}/rebuild", Endpoint::BloomRebuild),
        ("/admin/hotkeys", Endpoint::HotKeys),
        ("/admin/purge", Endpoint::Purge),
        ("/admin/config", Endpoint::Config),
        ("/admin/redis", Endpoint::Redis),
        ("/", Endpoint::StatusPage),
        ("/status", Endpoint::StatusPage),
        ("/status.json", Endpoint::StatusJson),
    ] {
        // Fixed, distinct paths: an insert error is a bug caught by the tests.
        if let Err(error) = router.insert(path, endpoint) {
            tracing::error!(message = "Admin route not registered.", path, %error);
        }
    }
    router
});

impl Admin {
    pub(crate) async fn handle(
        self: Arc<Self>,
        request: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<Body> {
        let Ok(matched) = ENDPOINTS.at(request.uri().path()) else {
            return respond::text(StatusCode::NOT_FOUND, "not found\n");
        };
        let read = request.method() == Method::GET || request.method() == Method::HEAD;
        match (*matched.value, read) {
            (Endpoint::Metrics, true) => self.metrics_text().await,
            (Endpoint::Healthz, true) => respond::text(StatusCode::OK, "ok\n"),
            (Endpoint::Readyz, true) => self.readyz(),
            (Endpoint::Bloom, true) => self.bloom_status(),
            (Endpoint::Config, true) => self.config_text().await,
            (Endpoint::StatusPage, true) => self.status_page(),
            (Endpoint::StatusJson, true) => {
                let since = since_ms(request.uri().query());
                let mut response = json(StatusCode::OK, &self.status.json(since));
                response
                    .headers_mut()
                    .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                response
            }
            (Endpoint::Redis, true) => match &self.redis {
                // The topology found at start or after the last failover, and whether
                // Redis is in the request path right now.
                Some(redis) => json(
                    StatusCode::OK,
                    &serde_json::json!({
                        "up": redis.is_up(),
                        "topology": redis.topology(),
                    }),
                ),
                None => json(StatusCode::OK, &serde_json::json!({ "mode": "embedded" })),
            },
            (Endpoint::HotKeys, true) => json(
                StatusCode::OK,
                &serde_json::json!({
                    "hot_keys": self.hot.status(),
                    "memory_bound_bytes": self.hot.memory_bound(),
                }),
            ),
            (Endpoint::BloomRebuild, false) if request.method() == Method::POST => {
                let name = matched.params.get("name").unwrap_or_default().to_owned();
                if let Err(denied) = self.authorize(&request) {
                    info!(message = "Admin call refused.", call = "bloom rebuild", filter = %name, %peer, status = denied.status().as_u16());
                    return denied;
                }
                self.bloom_rebuild(&name, peer)
            }
            (Endpoint::Purge, false) if request.method() == Method::POST => {
                if let Err(denied) = self.authorize(&request) {
                    let status = denied.status();
                    self.metrics.purge(if status == StatusCode::UNAUTHORIZED {
                        "unauthorized"
                    } else {
                        "forbidden"
                    });
                    warn!(message = "Purge refused.", %peer, status = status.as_u16());
                    return denied;
                }
                let caller = bearer(&request).map_or(0, PurgeLimits::caller);
                self.purge(request, peer, caller).await
            }
            _ => respond::text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"),
        }
    }

    /// The status page. Its inline style and script carry a fresh nonce, and the
    /// `Content-Security-Policy` allows nothing else: should a client-chosen string ever
    /// slip past the escaping, the browser still runs no script of it. It may fetch only
    /// from this listener (`status.json`), and may not be framed.
    fn status_page(&self) -> Response<Body> {
        let nonce = format!("{:032x}", rand::random::<u128>());
        let mut response = Response::new(Body::full(self.status.page(&nonce)));
        let csp = format!(
            "default-src 'none'; style-src 'nonce-{nonce}'; script-src 'nonce-{nonce}'; \
             connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        );
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        headers.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        // Hex digits and fixed text: always a valid header value.
        if let Ok(csp) = HeaderValue::from_str(&csp) {
            headers.insert(header::CONTENT_SECURITY_POLICY, csp);
        }
        response
    }

    /// The config in effect (what a reload applied; keys that need a restart show their
    /// running values), secrets redacted: the config types' `Debug` never shows the Redis
    /// password or the admin token.
    async fn config_text(&self) -> Response<Body> {
        let config = self.live.current.lock().await;
        let generation = self
            .live
            .generation
            .load(std::sync::atomic::Ordering::Acquire);
        respond::text(
            StatusCode::OK,
            format!(
                "# cacheguard config in effect: generation {generation}, from {}\n{config:#?}\n",
                config.source
            ),
        )
    }

    fn readyz(&self) -> Response<Body> {
        let mut problems = Vec::new();
        if let Some(redis) = &self.redis
            && !redis.is_up()
        {
            problems.push("redis unreachable".to_owned());
        }
        if self.proxy.invalidator.journal_failing() {
            problems.push(
                "retry journal cannot be written (owed invalidations held in memory)".to_owned(),
            );
        }
        for filter in self.filters.all() {
            if !filter.is_ready() {
                problems.push(format!(
                    "bloom filter {:?} not loaded (rejects nothing)",
                    filter.name()
                ));
            }
        }
        if problems.is_empty() {
            respond::text(StatusCode::OK, "ready\n")
        } else {
            respond::text(
                StatusCode::OK,
                format!("degraded: {}\n", problems.join("; ")),
            )
        }
    }

    fn bloom_status(&self) -> Response<Body> {
        let filters: Vec<_> = self.filters.all().iter().map(|f| f.status()).collect();
        json(StatusCode::OK, &serde_json::json!({ "filters": filters }))
    }

    fn bloom_rebuild(&self, name: &str, peer: SocketAddr) -> Response<Body> {
        let Some(filter) = self.filters.get(name) else {
            info!(message = "Admin call: unknown filter.", call = "bloom rebuild", filter = %name, %peer);
            return json(
                StatusCode::NOT_FOUND,
                &serde_json::json!({ "error": format!("no bloom filter named {name:?}") }),
            );
        };
        let started = filter.request_rebuild();
        let rebuild = if started { "started" } else { "queued" };
        info!(message = "Admin call: Bloom filter rebuild.", filter = %name, %peer, rebuild);
        json(
            StatusCode::ACCEPTED,
            &serde_json::json!({ "filter": name, "rebuild": rebuild }),
        )
    }

    /// Purges what `request` names, within the purge limits of `caller` (see
    /// [`PurgeLimits::caller`]).
    async fn purge(
        &self,
        request: Request<Incoming>,
        peer: SocketAddr,
        caller: u64,
    ) -> Response<Body> {
        let bad = |why: String| {
            self.metrics.purge("bad_request");
            warn!(message = "Purge refused: bad request.", %peer, reason = %why);
            json(
                StatusCode::BAD_REQUEST,
                &serde_json::json!({ "error": why }),
            )
        };
        let body = match Limited::new(request.into_body(), MAX_PURGE_BODY)
            .collect()
            .await
        {
            Ok(body) => body.to_bytes(),
            Err(e) => {
                return bad(format!(
                    "cannot read the body (at most {MAX_PURGE_BODY} bytes): {e}"
                ));
            }
        };
        let purge: PurgeRequest = match serde_json::from_slice(&body) {
            Ok(purge) => purge,
            Err(e) => {
                return bad(format!(
                    "expected JSON like {{\"keys\": [\"/api/items/7\"], \"patterns\": [\"/api/items/*\"], \"tags\": [\"item-7\"]}}: {e}"
                ));
            }
        };
        if let Err(seconds) = self.purge_limits.check(caller, !purge.patterns.is_empty()) {
            self.metrics.purge("rate_limited");
            warn!(
                message = "Purge refused: rate limited.",
                %peer,
                keys = ?audit_list(&purge.keys),
                patterns = ?audit_list(&purge.patterns),
                tags = ?audit_list(&purge.tags),
                retry_after = seconds,
            );
            let mut response = json(
                StatusCode::TOO_MANY_REQUESTS,
                &serde_json::json!({
                    "error": format!("too many purge requests: retry in {seconds} s")
                }),
            );
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            return response;
        }
        match self.proxy.purge(&purge).await {
            Ok(outcome) => {
                self.metrics.purge("ok");
                info!(
                    message = "Purge.",
                    %peer,
                    keys = ?audit_list(&purge.keys),
                    patterns = ?audit_list(&purge.patterns),
                    tags = ?audit_list(&purge.tags),
                    pattern_matches = outcome.pattern_matches,
                    done = outcome.done,
                    journaled = outcome.journaled,
                    lost = outcome.lost,
                );
                let status = if outcome.lost > 0 {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::OK
                };
                json(status, &serde_json::json!(outcome))
            }
            Err(PurgeError::RedisUnavailable) => {
                self.metrics.purge("bad_request");
                warn!(message = "Purge refused: Redis unavailable for a pattern purge.", %peer, patterns = ?audit_list(&purge.patterns));
                let mut response = json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &serde_json::json!({ "error": PurgeError::RedisUnavailable.to_string() }),
                );
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                response
            }
            Err(e) => bad(e.to_string()),
        }
    }

    /// Checks the bearer token of a mutating call.
    #[allow(clippy::result_large_err)] // the error is the response itself
    fn authorize(&self, request: &Request<Incoming>) -> Result<(), Response<Body>> {
        let token = self.token.load();
        let Some(token) = token.as_ref() else {
            return Err(respond::text(
                StatusCode::FORBIDDEN,
                "mutating admin calls are disabled: set admin.token\n",
            ));
        };
        match bearer(request) {
            None => {
                let mut response =
                    respond::text(StatusCode::UNAUTHORIZED, "bearer token required\n");
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                Err(response)
            }
            Some(presented) if constant_time_eq(presented.as_bytes(), token.as_bytes()) => Ok(()),
            Some(_) => Err(respond::text(StatusCode::FORBIDDEN, "wrong token\n")),
        }
    }

    async fn metrics_text(&self) -> Response<Body> {
        for filter in self.filters.all() {
            filter.refresh_age();
        }
        // Gauges that mirror another structure are refreshed at scrape time.
        let (entries, bytes) = self.l1.usage();
        self.metrics
            .l1_entries
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
        self.metrics
            .l1_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        if self.redis.is_none() {
            self.metrics.redis_up.set(0);
        }
        let encoder = TextEncoder::new();
        let mut buf = Vec::with_capacity(16 * 1024);
        let families = self.registry.gather();
        // Routes removed by a reload had their last values in this scrape.
        self.metrics.forget_retired_routes();
        if let Err(error) = encoder.encode(&families, &mut buf) {
            return respond::text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot encode metrics: {error}\n"),
            );
        }
        let mut response = Response::new(Body::full(buf));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        );
        response
    }
}

/// The bearer token `request` presents, if any.
fn bearer(request: &Request<Incoming>) -> Option<&str> {
    request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// The `since` of `/status.json?since=<unix ms>`: the page asks only for the samples it has
/// not seen. Absent or not a number: 0, every sample.
fn since_ms(query: Option<&str>) -> u64 {
    query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|pair| pair.strip_prefix("since="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// At most the first 20 items of a purge list, for the audit log.
fn audit_list(items: &[String]) -> Vec<&str> {
    items.iter().take(20).map(String::as_str).collect()
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut response = Response::new(Body::full(format!("{value}\n")));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Compares a presented token without an early exit, so response timing does not tell how
/// much of a guess was right. (Three lines; not worth a crate.)
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
