//! The write path: a write route's request is forwarded as it is, and the cache keys its
//! `invalidate` patterns name are invalidated around it — delayed double delete:
//!
//! 1. before forwarding: bump each key's generation, delete its entry and lock in Redis,
//!    publish `invalidate` (every instance drops its L1 copy), drop the local L1 copy;
//! 2. after the origin answers (whatever it answered: an unknown outcome still
//!    invalidates — a spurious delete costs one miss, a missed one costs stale data);
//! 3. once more after the route's `double_delete_delay`, which removes a copy that a read
//!    racing the write (or a lagging replica behind the origin) put back.
//!
//! The generation bump is what makes step 1 safe against a fill already in flight: its
//! store is refused. Patterns are filled from the write's own path parameters; each names
//! the base key of a read route (no query, no `vary` values).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, Request, Response};
use hyper::body::Incoming;
use tracing::warn;

use super::Proxy;
use super::body::Body;
use super::route::Route;
use crate::cache::key;

/// Added to a generation's lifetime beyond the longest fill it must outlive.
const GENERATION_SLACK: Duration = Duration::from_secs(60);

impl Proxy {
    pub(crate) async fn serve_write(
        self: &Arc<Self>,
        route: &Arc<Route>,
        params: &[(String, String)],
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        let targets = self.invalidation_targets(route, params);
        self.invalidate(&targets).await;
        let response = if route.adds_to.is_some() {
            self.serve_create(route, request, client).await
        } else {
            self.serve_passthrough(&route.metrics, request, client)
                .await
        };
        if !targets.is_empty() {
            self.invalidate(&targets).await;
            let this = Arc::clone(self);
            let delay = route.config.double_delete_delay;
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                this.invalidate(&targets).await;
            });
        }
        response
    }

    /// The keys (hash, generation lifetime) a write on `route` with `params` invalidates.
    fn invalidation_targets(
        &self,
        route: &Route,
        params: &[(String, String)],
    ) -> Vec<(u128, Duration)> {
        let mut targets = Vec::new();
        for pattern in &route.config.invalidate {
            let path = fill_pattern(pattern, params);
            let Some(matched) = self.routes.find(&Method::GET, &path) else {
                continue;
            };
            let read = &matched.route.config;
            if !read.is_read() {
                continue;
            }
            let derived = key::derive(read, &path, None, &HeaderMap::new());
            let longest_fill = read.ttl.mul_f64(1.0 + read.jitter)
                + read.grace
                + self.upstream.timeout
                + self.lock.lease;
            targets.push((derived.key.hash, longest_fill + GENERATION_SLACK));
        }
        targets
    }

    /// Invalidates every target here and, through Redis, on every instance.
    async fn invalidate(&self, targets: &[(u128, Duration)]) {
        for &(hash, generation_ttl) in targets {
            self.hot.invalidated(hash);
            self.l1.invalidate(hash).await;
            let Some(dist) = &self.dist else {
                continue;
            };
            let done = dist.invalidate(hash, generation_ttl).await.is_ok();
            self.metrics.invalidation(done);
            if !done {
                warn!(
                    message = "Invalidation not delivered: Redis unavailable.",
                    key = format!("{hash:032x}"),
                );
            }
        }
    }
}

/// `/api/items/{id}` with `id = 7` → `/api/items/7` (`{*rest}` too).
fn fill_pattern(pattern: &str, params: &[(String, String)]) -> String {
    let mut path = pattern.to_owned();
    for (name, value) in params {
        path = path
            .replace(&format!("{{{name}}}"), value)
            .replace(&format!("{{*{name}}}"), value);
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_are_filled_from_the_write_params() {
        let params = vec![("id".to_owned(), "7".to_owned())];
        assert_eq!(fill_pattern("/api/items/{id}", &params), "/api/items/7");
        assert_eq!(fill_pattern("/api/items", &params), "/api/items");
        let rest = vec![("rest".to_owned(), "a/b".to_owned())];
        assert_eq!(fill_pattern("/files/{*rest}", &rest), "/files/a/b");
    }
}
