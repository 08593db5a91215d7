//! The read path: a cacheable GET/HEAD walks these steps in order and leaves at the first
//! one that can answer. Each step is one call into the module that owns it.
//!
//! ```text
//! per-user request? ─▶ forwarded untouched (BYPASS)                     origin.rs
//! derive the key (one parse: key + forwarded URL)                        cache/key.rs
//! origin mode, the origin varies the URL on unkeyed headers (names known here)?
//!      ─▶ the request's own Vary variant key instead                      cache/key.rs
//! hot key? ─▶ its L1 copy, a 429, or straight to the key's fill          hot.rs
//! a fill of the key runs here? ─▶ join it without looking                fill.rs
//! L1, then L2 ─▶ fresh: HIT-L1 / HIT-L2 / NEGATIVE (maybe an early refresh)
//!             ─▶ stale: STALE at once, one refresh in the background    cache/tiers.rs
//!             ─▶ a miss, but a copy within its error grace: it answers if the fill fails
//!             ─▶ a miss on the URL's key whose copy (another variant's) just taught
//!                the Vary names: once more from the hot-key gate, with the variant key
//! a variant new in its path's window, beyond the budget
//!      ─▶ asked for before: on to the fill; a first ask: fetched
//!         uncached (BYPASS); over the overflow rate: 429               protect/variants.rs
//! miss ─▶ single-flight here, the fleet lock across instances, the origin guard, the
//!         origin, then the store (generation-checked)                    fill.rs, fetch.rs
//! the client's If-None-Match / If-Modified-Since / Range on the 200 ─▶ 304 / 206 / 416
//!                                                                        conditional.rs
//! ```
//!
//! The Bloom check runs before this, in the router (`proxy.rs`): an id the filter knows
//! nothing of never reaches the read path.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use http::header::{self, HeaderMap};
use http::request::Parts;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;

use super::body::Body;
use super::conditional;
use super::fetch::FillJob;
use super::fill::Filler;
use super::hot::{Gate, HotGate};
use super::origin::Origin;
use super::respond;
use super::route::Route;
use super::upstream::UpstreamBody;
use crate::cache::key::{self, Derived};
use crate::cache::tiers::{Cached, Tiers};
use crate::cache::{CacheKey, Freshness};
use crate::clock::now_ms;
use crate::config::FreshnessSource;
use crate::coord::redis::count_commands;
use crate::error::ProxyError;
use crate::metrics::{NewVariant, Outcome};

/// Everything a read needs; built once by the app, shared by every connection.
#[derive(Debug)]
pub(crate) struct ReadPath {
    pub(crate) tiers: Arc<Tiers>,
    pub(crate) gate: HotGate,
    pub(crate) filler: Arc<Filler>,
    pub(crate) origin: Arc<Origin>,
}

impl ReadPath {
    /// Serves a GET/HEAD on a cached route and records its outcome.
    pub(crate) async fn serve(
        &self,
        route: &Arc<Route>,
        request: Request<Incoming>,
        client: SocketAddr,
    ) -> Response<Body> {
        let started = Instant::now();
        let (parts, body) = request.into_parts();
        // GET/HEAD bodies are never forwarded on cached routes: they are not in the key.
        drop(body);
        let asked = conditional::Asked::of(&parts.headers);
        let head = parts.method == Method::HEAD;
        // On the heap: every future that awaits this one (and hyper, which moves the
        // request's future twice) then holds a pointer, not kilobytes to copy per request.
        let ((mut response, outcome), commands) =
            count_commands(Box::pin(self.read(route, parts, client))).await;
        if let Some(asked) = &asked {
            response = conditional::apply(asked, response, head);
        }
        route
            .metrics
            .answered(outcome, started.elapsed().as_secs_f64());
        route.metrics.redis_commands(outcome, commands);
        response
    }

    async fn read(
        &self,
        route: &Arc<Route>,
        parts: Parts,
        client: SocketAddr,
    ) -> (Response<Body>, Outcome) {
        if per_user(&parts.headers) {
            return Box::pin(self.origin.forward(
                parts,
                no_body(),
                client,
                &route.metrics,
                &route.config.forward_client_headers,
            ))
            .await;
        }
        let derived = key::derive(
            &route.config,
            parts.uri.path(),
            parts.uri.query(),
            &parts.headers,
        );
        let derived = self
            .vary_variant(route, &derived, &parts.headers)
            .unwrap_or(derived);
        Box::pin(self.read_key(route, &parts, derived, client)).await
    }

    /// On a `freshness = "origin"` route whose origin varies this URL's answers on headers
    /// the route does not key (as a copy of the URL's key taught this process), the
    /// request's own Vary variant of `derived` (`key::selected`). `None` otherwise: the
    /// names are not known here, the URL's own key holds the request's variant, or
    /// `derived` is a Vary variant already.
    fn vary_variant(
        &self,
        route: &Route,
        derived: &Derived,
        headers: &HeaderMap,
    ) -> Option<Derived> {
        if route.config.freshness != FreshnessSource::Origin {
            return None;
        }
        let spec = self.tiers.vary_spec(&derived.key)?;
        let selected = key::selected(&derived.key, &spec.names, headers);
        (selected.hash != spec.held).then(|| derived.with_key(selected))
    }

    /// The read of `derived`'s key, from the hot-key gate on.
    async fn read_key(
        &self,
        route: &Arc<Route>,
        parts: &Parts,
        derived: Derived,
        client: SocketAddr,
    ) -> (Response<Body>, Outcome) {
        let head = parts.method == Method::HEAD;
        let job = || FillJob::new(route, &derived, &parts.headers, client);
        let gate = self
            .gate
            .check(route, &derived.key, head, &parts.headers)
            .await;
        let (past_l1, refresh_early) = match gate {
            Gate::Answered(answer) => return answer,
            Gate::Join => {
                return match variant_budget(route, &derived.key) {
                    Budget::Fill => Box::pin(self.filler.fill(job(), head)).await,
                    Budget::Uncached => Box::pin(self.filler.fetch_uncached(&job(), head)).await,
                    Budget::Refused(refused) => refused,
                };
            }
            Gate::Lookup {
                past_l1,
                refresh_early,
            } => (past_l1, refresh_early),
        };
        if self.filler.in_progress(derived.key.hash) {
            return Box::pin(self.filler.fill(job(), head)).await;
        }
        match self
            .tiers
            .lookup(
                &derived.key,
                route.config.l1,
                route.config.l1_needs_bus(),
                past_l1,
                &parts.headers,
            )
            .await
        {
            Cached::Fresh(entry, tier) => {
                self.filler.refresh_early(route, &entry, refresh_early, job);
                respond::hit(&entry, tier, head)
            }
            Cached::Stale(entry) => {
                self.filler
                    .refresh_in_background(job().revalidating(Some(Arc::clone(&entry))), false);
                route.metrics.stale_served.inc();
                respond::hit(&entry, Outcome::Stale, head)
            }
            Cached::Miss(kept) => {
                // The URL's key held another variant's copy, which taught its Vary names
                // (or that it holds that variant) just now: the request's own variant is
                // read instead (once: a variant key has no variant of its own).
                if kept.is_none()
                    && let Some(selected) = self.vary_variant(route, &derived, &parts.headers)
                {
                    return Box::pin(self.read_key(route, parts, selected, client)).await;
                }
                if kept.is_none() {
                    match variant_budget(route, &derived.key) {
                        Budget::Fill => {}
                        Budget::Uncached => {
                            return Box::pin(self.filler.fetch_uncached(&job(), head)).await;
                        }
                        Budget::Refused(refused) => return refused,
                    }
                }
                let job = match &kept {
                    Some(_) => job().revalidating(kept.clone()),
                    // Nothing stored: the client's validators may go along (origin mode).
                    None => job().forwarding_validators(&parts.headers),
                };
                let (response, outcome) = Box::pin(self.filler.fill(job, head)).await;
                match kept {
                    // Stale-if-error: the origin failed, a copy within its error grace
                    // answers instead.
                    Some(entry)
                        if failed(&response, outcome)
                            && entry.freshness(now_ms()) == Freshness::IfError =>
                    {
                        route.metrics.stale_served.inc();
                        respond::hit(&entry, Outcome::Stale, head)
                    }
                    _ => (response, outcome),
                }
            }
        }
    }
}

/// What a miss with nothing stored may do, by its path's variant budget.
enum Budget {
    /// The base key, an admitted variant, or a new one the budget admits: fill it.
    Fill,
    /// A first ask beyond the budget: fetch it for this request only.
    Uncached,
    /// Beyond the budget and its overflow rate: this 429.
    Refused((Response<Body>, Outcome)),
}

/// Asks the route's variant budget about a miss on `key`; a new variant is counted by
/// what became of it.
fn variant_budget(route: &Route, key: &CacheKey) -> Budget {
    let Some(budget) = route.variants.as_ref() else {
        return Budget::Fill;
    };
    let Some(new) = budget.admit(key.base, key.hash) else {
        return Budget::Fill;
    };
    route.metrics.new_variant(new);
    match new {
        NewVariant::Budget | NewVariant::Repeat => Budget::Fill,
        NewVariant::Uncached => Budget::Uncached,
        NewVariant::Refused => {
            let seconds = budget.retry_after(route.config.ttl);
            Budget::Refused((
                respond::error(&ProxyError::TooManyVariants(seconds)),
                Outcome::Error,
            ))
        }
    }
}

/// Whether a fill's answer is a failure: cacheguard's own error or an origin 5xx.
fn failed(response: &Response<Body>, outcome: Outcome) -> bool {
    outcome == Outcome::Error || (outcome == Outcome::Bypass && response.status().is_server_error())
}

/// Per-user requests are never answered from, or stored into, a shared cache.
fn per_user(headers: &HeaderMap) -> bool {
    headers.contains_key(header::AUTHORIZATION) || headers.contains_key(header::COOKIE)
}

/// The empty body of a forwarded GET/HEAD.
fn no_body() -> UpstreamBody {
    Empty::new().map_err(|never| match never {}).boxed()
}
