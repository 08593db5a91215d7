//! Pass-through: requests that match no cached route (and per-user requests on cached
//! routes) are proxied untouched — method, headers, body streamed both ways, status — with
//! only hop-by-hop headers removed and the forwarding headers regenerated. Never cached.

use std::net::SocketAddr;
use std::time::Instant;

use http::{Request, Response};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use std::sync::Arc;

use super::body::Body;
use super::origin::Origin;
use super::upstream::UpstreamBody;
use crate::metrics::{OriginStatus, Outcome, RouteMetrics};

/// Forwards requests untouched, through the origin guard.
#[derive(Debug)]
pub(crate) struct Passthrough {
    pub(crate) origin: Arc<Origin>,
}

impl Passthrough {
    /// Proxies `request` untouched and records it under `metrics`.
    pub(crate) async fn serve(
        &self,
        metrics: &RouteMetrics,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        let started = Instant::now();
        let (parts, body) = request.into_parts();
        let limit = self.origin.max_body_bytes;
        let body: UpstreamBody = Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX))
            .map_err(Into::into)
            .boxed();
        let origin_started = Instant::now();
        let (response, outcome) = self.origin.forward(parts, body, client, metrics).await;
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
