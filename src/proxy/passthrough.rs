//! Pass-through: requests that match no cached route (and per-user requests on cached
//! routes) are proxied untouched — method, headers, body streamed both ways, status — with
//! only hop-by-hop headers removed and the forwarding headers regenerated. Never cached.

use std::net::SocketAddr;
use std::time::Instant;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Request, Response};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::Proxy;
use super::body::Body;
use super::respond::{self, strip_hop_by_hop};
use super::upstream::UpstreamBody;
use crate::error::ProxyError;
use crate::metrics::{OriginStatus, Outcome, RouteMetrics};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// Replaces every client-supplied forwarding header with cacheguard's own: the client's
/// address is what cacheguard saw on the socket, never what the client claims.
pub(crate) fn set_forwarded(headers: &mut HeaderMap, client: SocketAddr) {
    headers.remove(&X_FORWARDED_HOST);
    headers.remove(&FORWARDED);
    headers.remove("x-real-ip");
    let ip = HeaderValue::from_str(&client.ip().to_string())
        .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
    headers.insert(X_FORWARDED_FOR.clone(), ip);
    headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static("http"));
}

impl Proxy {
    /// Proxies `request` untouched and records it under `metrics`.
    pub(crate) async fn serve_passthrough(
        &self,
        metrics: &RouteMetrics,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        let started = Instant::now();
        let (parts, body) = request.into_parts();
        let limit = self.max_body_bytes;
        let body: UpstreamBody = Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX))
            .map_err(Into::into)
            .boxed();
        let origin_started = Instant::now();
        let (response, outcome) = self.forward(parts, body, client).await;
        let origin_status = match outcome {
            Outcome::Error => match response.status().as_u16() {
                504 => Some(OriginStatus::Timeout),
                502 => Some(OriginStatus::Error),
                _ => None,
            },
            _ => Some(OriginStatus::from_status(response.status().as_u16())),
        };
        if let Some(status) = origin_status {
            metrics.origin(status, origin_started.elapsed().as_secs_f64());
        }
        if response.status() == http::StatusCode::SERVICE_UNAVAILABLE && outcome == Outcome::Error {
            metrics.shed.inc();
        }
        metrics.answered(outcome, started.elapsed().as_secs_f64());
        response
    }

    /// Sends one request to the origin through the origin guard and streams the answer back.
    pub(crate) async fn forward(
        &self,
        mut parts: Parts,
        body: UpstreamBody,
        client: SocketAddr,
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
        set_forwarded(&mut parts.headers, client);
        let mut request = Request::new(body);
        *request.method_mut() = parts.method;
        *request.uri_mut() = uri;
        *request.headers_mut() = parts.headers;
        // HTTP/2 clients send :authority instead of Host; keep what they addressed.
        if let Some(host) = parts.uri.authority()
            && !request.headers().contains_key(header::HOST)
            && let Ok(value) = HeaderValue::from_str(host.as_str())
        {
            request.headers_mut().insert(header::HOST, value);
        }

        // The slot is held until the origin's response head arrives; streaming the body
        // back does not occupy the origin's request capacity.
        let slot = match self.guard.load_full().acquire().await {
            Ok(slot) => slot,
            Err(error) => return (respond::error(&error), Outcome::Error),
        };
        let sent = upstream.send(request).await;
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
