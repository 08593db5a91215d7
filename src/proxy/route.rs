//! Routing: the configured `[[routes]]` in a matchit router.
//!
//! Several routes may share one pattern with different methods (DESIGN's `item` and
//! `item-write`), so the router maps a pattern to the list of routes on it, and the method
//! picks among them. `HEAD` is served by the route that serves `GET`.

use std::sync::Arc;

use http::Method;

use crate::config::RouteConfig;
use crate::metrics::{Metrics, RouteMetrics};

/// One configured route with its metric handles resolved.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) config: RouteConfig,
    pub(crate) metrics: Arc<RouteMetrics>,
}

#[derive(Debug)]
pub(crate) struct RouteTable {
    router: matchit::Router<usize>,
    by_pattern: Vec<Vec<Arc<Route>>>,
}

impl RouteTable {
    /// # Errors
    /// When two patterns conflict (validated at config load already).
    pub(crate) fn build(
        routes: &[RouteConfig],
        metrics: &Metrics,
    ) -> Result<Self, matchit::InsertError> {
        let mut router = matchit::Router::new();
        let mut patterns: Vec<&str> = Vec::new();
        let mut by_pattern: Vec<Vec<Arc<Route>>> = Vec::new();
        for config in routes {
            let route = Arc::new(Route {
                config: config.clone(),
                metrics: metrics.for_route(&config.name),
            });
            if let Some(i) = patterns.iter().position(|p| *p == config.pattern) {
                by_pattern[i].push(route);
            } else {
                router.insert(config.pattern.clone(), patterns.len())?;
                patterns.push(&config.pattern);
                by_pattern.push(vec![route]);
            }
        }
        Ok(RouteTable { router, by_pattern })
    }

    /// The route for `method` on `path`, if any.
    pub(crate) fn find(&self, method: &Method, path: &str) -> Option<&Arc<Route>> {
        let matched = self.router.at(path).ok()?;
        let routes = self.by_pattern.get(*matched.value)?;
        let wanted = if method == Method::HEAD {
            &Method::GET
        } else {
            method
        };
        routes
            .iter()
            .find(|r| r.config.methods.iter().any(|m| m == wanted || m == method))
    }
}
