//! Pass-through: requests that match no cached route (and per-user requests on cached
//! routes) are proxied untouched — method, headers, body streamed both ways, status — with
//! only hop-by-hop headers removed and the forwarding headers regenerated. Never cached.

use std::net::SocketAddr;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::{HeaderName, Request, Response, header};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

use std::sync::Arc;

use super::body::Body;
use super::origin::Origin;
use super::origin_guard::Reservation;
use super::stock::BodyFingerprint;
use super::upstream::{BoxError, ClientBodyError, UpstreamBody};
use crate::error::ProxyError;
use crate::metrics::{OriginStatus, Outcome, RouteMetrics};

/// A request body read whole before it is forwarded.
pub(crate) type Buffered = Full<Bytes>;

/// Forwards requests untouched, through the origin guard.
#[derive(Debug)]
pub(crate) struct Passthrough {
    pub(crate) origin: Arc<Origin>,
}

impl Passthrough {
    /// Proxies `request` untouched and records it under `metrics`; of the client's
    /// forwarding headers only those in `keep` (its route's `forward_client_headers`) pass.
    /// An error of the client's body ends the origin request at once and is answered 400.
    pub(crate) async fn serve<B>(
        &self,
        metrics: &RouteMetrics,
        request: Request<B>,
        client: SocketAddr,
        keep: &[HeaderName],
    ) -> Response<Body>
    where
        B: HttpBody<Data = Bytes> + Send + Sync + 'static,
        B::Error: Into<BoxError>,
    {
        let started = Instant::now();
        let (parts, body) = request.into_parts();
        let limit = self.origin.max_body_bytes;
        let body = body.map_err(|error| BoxError::from(ClientBodyError(error.into())));
        let body: UpstreamBody = Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX))
            .map_err(Into::into)
            .boxed();
        let origin_started = Instant::now();
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
            metrics.origin(status, origin_started.elapsed().as_secs_f64());
        }
        if response.status() == http::StatusCode::SERVICE_UNAVAILABLE && outcome == Outcome::Error {
            metrics.shed.inc();
        }
        metrics.answered(outcome, started.elapsed().as_secs_f64());
        response
    }
}

impl Passthrough {
    /// Reads `request`'s body whole, before anything of the request reaches the origin or
    /// any invalidation runs: a body that breaks its framing gets 400, one over
    /// `server.max_body_bytes` 413, one that pauses longer than `upstream.upload_timeout`
    /// 408. Its room is reserved in `upstream.max_buffered_bytes` first (its
    /// `Content-Length`, or `max_body_bytes` when it has none) and held by the returned
    /// reservation: no room within `queue_timeout` gets 503.
    ///
    /// # Errors
    /// The answer to give instead.
    pub(crate) async fn buffer(
        &self,
        request: Request<Incoming>,
    ) -> Result<(Request<Buffered>, Reservation), ProxyError> {
        let (parts, mut body) = request.into_parts();
        let limit = self.origin.max_body_bytes;
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let room = usize::try_from(declared.unwrap_or(limit).min(limit)).unwrap_or(usize::MAX);
        let reservation = self.origin.guard.load_full().reserve(room).await?;
        let idle = self.origin.upstream.load().upload_timeout();
        let mut buf = BytesMut::with_capacity(room.min(64 * 1024));
        loop {
            let frame = match tokio::time::timeout(idle, body.frame()).await {
                Err(_) => return Err(ProxyError::UploadTimeout(idle)),
                Ok(None) => break,
                Ok(Some(Err(_))) => return Err(ProxyError::BadRequestBody),
                Ok(Some(Ok(frame))) => frame,
            };
            if let Ok(data) = frame.into_data() {
                if (buf.len() + data.len()) as u64 > limit {
                    return Err(ProxyError::BodyTooLarge(limit));
                }
                buf.extend_from_slice(&data);
            }
        }
        let body = buf.freeze();
        let mut request = Request::from_parts(parts, Full::new(body.clone()));
        request
            .extensions_mut()
            .insert(BodyFingerprint(xxhash_rust::xxh3::xxh3_64(&body)));
        Ok((request, reservation))
    }
}
