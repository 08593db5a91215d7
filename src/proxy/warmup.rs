//! Warm-up: read routes with `warmup = { paths, file, rate }` fetch their paths at start,
//! through the normal read pipeline — a path already cached (in L2, by another instance) is
//! left alone, a missing one is filled through single-flight, the fleet lock and the origin
//! guard — at most `rate` paths per second per route, so a new or restarted fleet does not
//! open cold and the warm-up itself never overloads the origin.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Proxy;
use super::fetch::FillJob;
use super::route::Route;
use crate::cache::key;
use crate::cache::tiers::Cached;
use crate::metrics::Outcome;

/// Lines of a warm-up file longer than this are skipped.
const MAX_PATH_BYTES: usize = 8 * 1024;

impl Proxy {
    /// Runs every route's warm-up, each in its own task, until done or `stop`.
    pub(crate) fn spawn_warmups(self: &Arc<Self>, stop: &CancellationToken) {
        let routes = self.routes.load_full();
        for route in routes.all() {
            if route.config.warmup.is_some() {
                let this = Arc::clone(self);
                let route = Arc::clone(route);
                let stop = stop.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = this.warm_up(&route) => {}
                    }
                });
            }
        }
    }

    async fn warm_up(self: &Arc<Self>, route: &Arc<Route>) {
        let Some(warmup) = &route.config.warmup else {
            return;
        };
        let name = &route.config.name;
        let mut paths = warmup.paths.clone();
        if let Some(file) = &warmup.file {
            match tokio::fs::read_to_string(file).await {
                Ok(text) => {
                    let before = paths.len();
                    let mut skipped = 0u64;
                    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
                        let bare = line.split('?').next().unwrap_or(line);
                        if line.len() <= MAX_PATH_BYTES
                            && self
                                .routes
                                .load()
                                .find(&http::Method::GET, bare)
                                .is_some_and(|m| Arc::ptr_eq(m.route, route))
                        {
                            paths.push(line.to_owned());
                        } else {
                            skipped += 1;
                            self.metrics.warmup(name, "skipped");
                        }
                    }
                    if skipped > 0 {
                        warn!(message = "Warm-up file lines that do not match the route were skipped.", route = %name, file = %file.display(), skipped, kept = paths.len() - before);
                    }
                }
                Err(error) => {
                    warn!(message = "Warm-up file unreadable; warming the inline paths only.", route = %name, file = %file.display(), %error);
                }
            }
        }
        let rate = warmup.rate.max(1);
        let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let (mut filled, mut failed) = (0u64, 0u64);
        for path in &paths {
            tick.tick().await;
            match self.warm_one(route, path).await {
                Some(true) => filled += 1,
                Some(false) => failed += 1,
                None => {}
            }
        }
        info!(message = "Warm-up done.", route = %name, paths = paths.len(), filled, failed);
    }

    /// `None` when the path was already cached, else whether the fill answered 2xx/NEGATIVE.
    async fn warm_one(self: &Arc<Self>, route: &Arc<Route>, path_and_query: &str) -> Option<bool> {
        let (path, query) = match path_and_query.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (path_and_query, None),
        };
        let derived = key::derive(&route.config, path, query, &HeaderMap::new());
        if let Cached::Fresh(..) = self
            .read
            .tiers
            .lookup(
                &derived.key,
                route.config.l1,
                route.config.l1_needs_bus(),
                false,
                &http::HeaderMap::new(),
            )
            .await
        {
            self.metrics.warmup(&route.config.name, "cached");
            return None;
        }
        let job = FillJob::new(
            route,
            &derived,
            &HeaderMap::new(),
            SocketAddr::from(([127, 0, 0, 1], 0)),
        );
        let (response, outcome) = self.read.filler.fill(job, true).await;
        let ok = outcome != Outcome::Error && !response.status().is_server_error();
        self.metrics
            .warmup(&route.config.name, if ok { "filled" } else { "failed" });
        Some(ok)
    }
}
