//! The admin listener (default `127.0.0.1:9091`): `/metrics`, `/healthz`, `/readyz`.
//!
//! `/readyz` answers 200 `ready`, or 200 `degraded: …` when Redis is configured but down.
//! It stays 200 on purpose: Redis is an accelerator, and a readiness probe that failed with
//! Redis would pull every instance out of service at once — the outage cacheguard exists to
//! prevent. The body and `cacheguard_redis_up` say what is degraded.

use std::sync::Arc;

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use prometheus::{Encoder, Registry, TextEncoder};

use crate::cache::l1::L1;
use crate::coord::RedisConn;
use crate::metrics::Metrics;
use crate::proxy::body::Body;
use crate::proxy::respond;

#[derive(Debug)]
pub(crate) struct Admin {
    pub(crate) registry: Registry,
    pub(crate) metrics: Metrics,
    pub(crate) l1: L1,
    pub(crate) redis: Option<RedisConn>,
}

impl Admin {
    pub(crate) async fn handle(self: Arc<Self>, request: Request<Incoming>) -> Response<Body> {
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return respond::text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        }
        match request.uri().path() {
            "/metrics" => self.metrics_text().await,
            "/healthz" => respond::text(StatusCode::OK, "ok\n"),
            "/readyz" => match &self.redis {
                Some(redis) if !redis.is_up() => {
                    respond::text(StatusCode::OK, "degraded: redis unreachable\n")
                }
                _ => respond::text(StatusCode::OK, "ready\n"),
            },
            _ => respond::text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }

    async fn metrics_text(&self) -> Response<Body> {
        // Gauges that mirror another structure are refreshed at scrape time.
        let (entries, bytes) = self.l1.usage().await;
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
        if let Err(error) = encoder.encode(&self.registry.gather(), &mut buf) {
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
