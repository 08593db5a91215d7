//! The origin as every path reaches it: the upstream client and the origin guard (both
//! swapped whole by a reload), and the one way a request is forwarded untouched.

use std::net::SocketAddr;

use arc_swap::ArcSwap;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Request, Response};
use http_body::Body as _;

use super::body::Body;
use super::origin_guard::OriginGuard;
use super::respond::{self, is_hop_by_hop, strip_hop_by_hop};
use super::upstream::{Upstream, UpstreamBody};
use crate::config::CLIENT_CLAIMS;
use crate::error::ProxyError;
use crate::metrics::{Outcome, RouteMetrics};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Replaces every client-supplied forwarding header with cacheguard's own: the client's
/// address is what cacheguard saw on the socket, never what the client claims; headers that
/// would rewrite the target or the method for the origin ([`CLIENT_CLAIMS`]) are dropped,
/// but for those in `keep` (the route's `forward_client_headers`), passed on as sent.
pub(crate) fn set_forwarded(headers: &mut HeaderMap, client: SocketAddr, keep: &[HeaderName]) {
    for name in CLIENT_CLAIMS {
        if !keep.iter().any(|kept| kept == name) {
            headers.remove(name);
        }
    }
    let ip = HeaderValue::from_str(&client.ip().to_string())
        .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
    headers.insert(X_FORWARDED_FOR.clone(), ip);
    headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
}

/// Request headers a cached fetch never passes on from the client, even in
/// `freshness = "origin"` mode: what cacheguard sets itself (`Host`, the forwarding
/// headers), what would let one client's request rewrite what is fetched for everybody
/// (method and path overrides), what is per user (such requests are never cached), what
/// the cache answers itself (conditionals, ranges: a miss with nothing stored sends the
/// client's validators on its own, see `FillJob::forwarding_validators`), and a body's
/// framing (a GET body is never forwarded).
const NOT_FORWARDED_ON_FETCH: [&str; 25] = [
    "host",
    "surrogate-capability",
    "content-length",
    "content-type",
    "expect",
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "x-original-method",
    "x-original-url",
    "x-rewrite-url",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-port",
    "forwarded",
    "x-real-ip",
    "authorization",
    "cookie",
    "range",
    "if-range",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
];

/// The client headers a `freshness = "origin"` fetch passes on: those of `headers` that
/// [`forwarded_on_fetch`] admits, less any a `Connection` line names.
pub(crate) fn end_to_end(headers: &HeaderMap, keyed: &[HeaderName]) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers {
        if forwarded_on_fetch(name, keyed) {
            out.append(name.clone(), value.clone());
        }
    }
    for named in headers.get_all(header::CONNECTION) {
        for name in named.to_str().unwrap_or("").split(',') {
            out.remove(name.trim());
        }
    }
    out
}

/// Whether a `freshness = "origin"` fetch passes `name` on as the client sent it (so an
/// answer may vary on it): any end-to-end header but those cacheguard owns
/// ([`NOT_FORWARDED_ON_FETCH`]) and `Accept-Encoding` unless the route keys it (an answer
/// made for one encoding must not be stored for every client: unkeyed, the origin is asked
/// for the identity encoding every client accepts).
pub(crate) fn forwarded_on_fetch(name: &HeaderName, keyed: &[HeaderName]) -> bool {
    !is_hop_by_hop(name)
        && !NOT_FORWARDED_ON_FETCH.contains(&name.as_str())
        && (*name != header::ACCEPT_ENCODING || keyed.contains(name))
}

/// The upstream client and the origin guard every origin request goes through.
#[derive(Debug)]
pub(crate) struct Origin {
    /// Reloadable (see `reload.rs`).
    pub(crate) upstream: ArcSwap<Upstream>,
    /// Reloadable (see `reload.rs`).
    pub(crate) guard: ArcSwap<OriginGuard>,
    /// `server.max_body_bytes`: a forwarded body is cut there.
    pub(crate) max_body_bytes: u64,
}

impl Origin {
    /// Sends one request to the origin through the origin guard and streams the answer back.
    /// An idempotent request without a body whose pooled connection failed before any byte
    /// of an answer is sent once more on a new connection (counted under `metrics`). The
    /// client's forwarding headers are dropped but for those in `keep` (see
    /// [`set_forwarded`]).
    pub(crate) async fn forward(
        &self,
        mut parts: Parts,
        body: UpstreamBody,
        client: SocketAddr,
        metrics: &RouteMetrics,
        keep: &[HeaderName],
    ) -> (Response<Body>, Outcome) {
        let upstream = self.upstream.load_full();
        let uri = match parts
            .uri
            .path_and_query()
            .map(|pq| upstream.uri(pq.as_str()))
        {
            Some(Ok(uri)) => uri,
            Some(Err(error)) => return (respond::error(&error), Outcome::Error),
            None => match upstream.uri("/") {
                Ok(uri) => uri,
                Err(error) => return (respond::error(&error), Outcome::Error),
            },
        };
        strip_hop_by_hop(&mut parts.headers);
        set_forwarded(&mut parts.headers, client, keep);
        // HTTP/2 clients send :authority instead of Host; keep what they addressed.
        if let Some(host) = parts.uri.authority()
            && !parts.headers.contains_key(header::HOST)
            && let Ok(value) = HeaderValue::from_str(host.as_str())
        {
            parts.headers.insert(header::HOST, value);
        }

        // The slot is held until the origin's response head arrives; streaming the body
        // back does not occupy the origin's request capacity.
        let slot = match self.guard.load_full().acquire().await {
            Ok(slot) => slot,
            Err(error) => return (respond::error(&error), Outcome::Error),
        };
        let sent = if parts.method.is_idempotent() && body.is_end_stream() {
            let make = || {
                let mut request = Request::new(UpstreamBody::default());
                *request.method_mut() = parts.method.clone();
                *request.uri_mut() = uri.clone();
                *request.headers_mut() = parts.headers.clone();
                Ok(request)
            };
            upstream
                .send_idempotent(make)
                .await
                .map(|(response, retried)| {
                    if retried {
                        metrics.origin_retries.inc();
                    }
                    response
                })
        } else {
            let mut request = Request::new(body);
            *request.method_mut() = parts.method;
            *request.uri_mut() = uri;
            *request.headers_mut() = parts.headers;
            upstream.send(request).await
        };
        drop(slot);
        match sent {
            Ok(response) => {
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers);
                let mut response = Response::from_parts(head, Body::Stream(body));
                respond::mark(&mut response, Outcome::Bypass);
                (response, Outcome::Bypass)
            }
            Err(ProxyError::BodyTooLarge(_)) => (
                respond::error(&ProxyError::BodyTooLarge(self.max_body_bytes)),
                Outcome::Error,
            ),
            Err(error) => (respond::error(&error), Outcome::Error),
        }
    }
}
