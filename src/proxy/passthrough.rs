//! Pass-through: requests that match no cached route (and per-user requests on cached
//! routes) are proxied untouched — method, headers, body streamed both ways, status — with
//! only hop-by-hop headers removed and the forwarding headers regenerated. Never cached.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::header::{self, HeaderName, HeaderValue};
use http::request::Parts;
use http::{Request, Response};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::body::Body;
use super::origin::Origin;
use super::origin_guard::Reservation;
use super::spool::{self, BodyFingerprint, SpoolConfig, Spooled};
use super::upload::Paced;
use super::upstream::{BoxError, ClientBodyError, UpstreamBody};
use crate::error::ProxyError;
use crate::metrics::{OriginStatus, Outcome, RouteMetrics};

/// Forwards requests untouched, through the origin guard.
#[derive(Debug)]
pub(crate) struct Passthrough {
    pub(crate) origin: Arc<Origin>,
    /// Where a write's body beyond its in-memory part waits (`[server]`).
    pub(crate) spool: SpoolConfig,
}

impl Passthrough {
    /// Proxies `request` untouched, its body streamed to the origin as it arrives, and
    /// records it under `metrics`; of the client's forwarding headers only those in `keep`
    /// (its route's `forward_client_headers`) pass. The body is bounded in time
    /// (`upload.rs`) and size (`server.max_body_bytes`); an error of it ends the origin
    /// request at once and is answered 400, 408 or 413.
    pub(crate) async fn serve(
        &self,
        metrics: &RouteMetrics,
        request: Request<Incoming>,
        client: SocketAddr,
        keep: &[HeaderName],
    ) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let limit = self.origin.max_body_bytes;
        let bounds = self.origin.upstream.load().upload_bounds();
        let body = Paced::new(body, bounds).map_err(|error| BoxError::from(ClientBodyError(error)));
        let body: UpstreamBody = Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX))
            .map_err(Into::into)
            .boxed();
        self.forward(metrics, parts, body, client, keep).await
    }

    /// Proxies `request`, whose body was read whole ([`Passthrough::read_whole`]), as
    /// [`Passthrough::serve`] does: the body goes out with its length as `Content-Length`,
    /// from memory or its spool file.
    pub(crate) async fn serve_whole(
        &self,
        metrics: &RouteMetrics,
        request: Request<Spooled>,
        client: SocketAddr,
        keep: &[HeaderName],
    ) -> Response<Body> {
        let (mut parts, body) = request.into_parts();
        let len = body.len();
        // A body-less request that said nothing of a body does not gain a length.
        if len > 0 || parts.headers.contains_key(header::CONTENT_LENGTH) {
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
        parts.headers.remove(header::TRANSFER_ENCODING);
        let body: UpstreamBody = body.into_body().map_err(BoxError::from).boxed();
        self.forward(metrics, parts, body, client, keep).await
    }

    /// Forwards through the origin guard and records the exchange under `metrics`.
    async fn forward(
        &self,
        metrics: &RouteMetrics,
        parts: Parts,
        body: UpstreamBody,
        client: SocketAddr,
        keep: &[HeaderName],
    ) -> Response<Body> {
        let started = Instant::now();
        let (response, outcome) = self
            .origin
            .forward(parts, body, client, metrics, keep)
            .await;
        let origin_status = match outcome {
            Outcome::Error => match response.status().as_u16() {
                504 => Some(OriginStatus::Timeout),
                502 => Some(OriginStatus::Error),
                _ => None,
            },
            _ => Some(OriginStatus::from_status(response.status().as_u16())),
        };
        if let Some(status) = origin_status {
            metrics.origin(status, started.elapsed().as_secs_f64());
        }
        if response.status() == http::StatusCode::SERVICE_UNAVAILABLE && outcome == Outcome::Error {
            metrics.shed.inc();
        }
        metrics.answered(outcome, started.elapsed().as_secs_f64());
        response
    }

    /// Reads `request`'s body whole, before anything of the request reaches the origin or
    /// any invalidation runs, within the time bounds of `[upstream]` (`upload.rs`) and
    /// `server.max_body_bytes`; past `server.body_buffer_bytes` it waits in a spool file
    /// (`spool.rs`). Room for its in-memory part is reserved in
    /// `upstream.max_buffered_bytes` first (its `Content-Length`, when smaller) and held by
    /// the returned reservation: no room within `queue_timeout` gets 503.
    ///
    /// # Errors
    /// The answer to give instead: 400 (broken framing), 408 (a time bound), 413 (over the
    /// limit), 503 (no room, or the spool file cannot be written).
    pub(crate) async fn read_whole(
        &self,
        request: Request<Incoming>,
    ) -> Result<(Request<Spooled>, Reservation), ProxyError> {
        let (parts, body) = request.into_parts();
        let limit = self.origin.max_body_bytes;
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let in_memory = declared
            .unwrap_or(limit)
            .min(limit)
            .min(self.spool.memory_bytes as u64);
        let room = usize::try_from(in_memory).unwrap_or(usize::MAX);
        let reservation = self.origin.guard.load_full().reserve(room).await?;
        let bounds = self.origin.upstream.load().upload_bounds();
        let (body, fingerprint) = spool::read_whole(body, bounds, limit, &self.spool).await?;
        let mut request = Request::from_parts(parts, body);
        request
            .extensions_mut()
            .insert(BodyFingerprint(fingerprint));
        Ok((request, reservation))
    }
}
