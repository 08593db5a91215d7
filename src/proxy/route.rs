//! Routing: the configured `[[routes]]` in a matchit router.
//!
//! Several routes may share one pattern with different methods (`item` and `item-write` in
//! `config/cacheguard.toml`), so the router maps a pattern to the list of routes on it, and
//! the method picks among them. `HEAD` is served by the route that serves `GET`.

use std::sync::Arc;

use bytes::Bytes;
use http::Method;

use crate::config::RouteConfig;
use crate::metrics::{Metrics, RouteMetrics, SerializeMetrics};
use crate::protect::bloom::{Filter, Filters};
use crate::protect::stock::{Gate, Gates};
use crate::protect::variants::VariantBudget;

/// One configured route with its metric handles and filters resolved.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) config: RouteConfig,
    pub(crate) metrics: Arc<RouteMetrics>,
    /// Read routes with `bloom`: the filter ids are checked against.
    pub(crate) filter: Option<Arc<Filter>>,
    /// Write routes with `bloom_add`: the filter created ids go to.
    pub(crate) adds_to: Option<Arc<Filter>>,
    /// The body of a Bloom rejection, shared by every answer (no copy per request).
    pub(crate) reject_body: Bytes,
    /// Read routes with `max_variants`: how many variants of a path are fetched and
    /// cached, and what passes beyond.
    pub(crate) variants: Option<VariantBudget>,
    /// Write routes with `stock`: the gate a buy takes its units from.
    pub(crate) stock: Option<Arc<Gate>>,
    /// Write routes with `serialize`: their metric handles.
    pub(crate) serialized: Option<SerializeMetrics>,
}

/// A matched route, with the raw (still percent-encoded) value of its Bloom id parameter.
#[derive(Debug)]
pub(crate) struct Matched<'r, 'p> {
    pub(crate) route: &'r Arc<Route>,
    pub(crate) id: Option<&'p str>,
    /// Write routes that invalidate: every path parameter, to fill the patterns with.
    pub(crate) params: Vec<(String, String)>,
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
        filters: &Filters,
        gates: &Gates,
    ) -> Result<Self, matchit::InsertError> {
        let mut router = matchit::Router::new();
        let mut patterns: Vec<&str> = Vec::new();
        let mut by_pattern: Vec<Vec<Arc<Route>>> = Vec::new();
        for config in routes {
            if config.warmup.is_some() {
                metrics.warmup_route(&config.name);
            }
            // Filter names were checked against `[[bloom]]` at config load.
            let filter = |name: Option<&String>| name.and_then(|n| filters.get(n)).cloned();
            let route = Arc::new(Route {
                config: config.clone(),
                metrics: metrics.for_route(&config.name),
                filter: filter(config.bloom.as_ref().map(|b| &b.filter)),
                adds_to: filter(config.bloom_add.as_ref().map(|b| &b.filter)),
                reject_body: config
                    .bloom
                    .as_ref()
                    .map_or_else(Bytes::new, |b| Bytes::from(b.body.clone())),
                variants: (config.is_read() && config.max_variants > 0).then(|| {
                    VariantBudget::new(
                        config.max_variants,
                        config.ttl,
                        config.variant_overflow_rate,
                    )
                }),
                // Gate names were checked against `[[stock]]` at config load.
                stock: config
                    .stock
                    .as_ref()
                    .and_then(|s| gates.get(&s.gate))
                    .cloned(),
                serialized: config
                    .serialize
                    .as_ref()
                    .map(|_| metrics.serialize.for_route(&config.name)),
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
    pub(crate) fn find<'p>(&self, method: &Method, path: &'p str) -> Option<Matched<'_, 'p>> {
        let matched = self.router.at(path).ok()?;
        let routes = self.by_pattern.get(*matched.value)?;
        let wanted = if method == Method::HEAD {
            &Method::GET
        } else {
            method
        };
        let route = routes
            .iter()
            .find(|r| r.config.methods.iter().any(|m| m == wanted || m == method))?;
        let id = route
            .config
            .bloom
            .as_ref()
            .and_then(|bloom| matched.params.get(&bloom.param));
        let params = if route.config.invalidate.is_empty()
            && route.stock.is_none()
            && route.config.serialize.is_none()
        {
            Vec::new()
        } else {
            matched
                .params
                .iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        };
        Some(Matched { route, id, params })
    }

    /// Every route, in no particular order.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Arc<Route>> {
        self.by_pattern.iter().flatten()
    }

    /// The route named `name`, if it is a read route.
    pub(crate) fn by_name(&self, name: &str) -> Option<&Arc<Route>> {
        self.all()
            .find(|r| r.config.name == name && r.config.is_read())
    }

    /// The names of the read (cached) routes.
    pub(crate) fn read_route_names(&self) -> impl Iterator<Item = &str> {
        self.all()
            .filter(|r| r.config.is_read())
            .map(|r| r.config.name.as_str())
    }

    /// The Bloom id in `path` for a read route of `filter`: how the id of a created
    /// resource is found in its `Location`.
    pub(crate) fn id_for_filter<'p>(&self, filter: &str, path: &'p str) -> Option<&'p str> {
        let matched = self.router.at(path).ok()?;
        let routes = self.by_pattern.get(*matched.value)?;
        routes.iter().find_map(|route| {
            let bloom = route.config.bloom.as_ref().filter(|b| b.filter == filter)?;
            matched.params.get(&bloom.param)
        })
    }
}
