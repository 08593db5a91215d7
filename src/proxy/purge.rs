//! Purges and external invalidations: the purge API (`admin.rs`) and the invalidation
//! stream (`consistency/stream.rs`) both land here, and both go through the one
//! invalidation routine.
//!
//! - a **key** is a request path (`/api/items/7`; a query is accepted and ignored): it
//!   invalidates that path with all its variants, which share one generation;
//! - a **pattern** is a path with `*` wildcards (`/api/items/*`, `*` matching any run of
//!   characters, `/` included): it invalidates every cached path it matches, found in the
//!   routes' indexes in Redis (each fill lists its path under its route) and in L1;
//! - a **tag** is a surrogate key: every entry the origin tagged with it.

use std::collections::HashSet;

use serde::Deserialize;

use super::Proxy;
use super::fill::route_tag;
use crate::cache::key;
use crate::consistency::invalidate::{Invalidation, Report, Source};
use crate::consistency::stream::Target;
use crate::consistency::tags;

/// Most keys, patterns and tags one purge request may name.
pub(crate) const MAX_PURGE_ITEMS: usize = 10_000;

/// The body of `POST /admin/purge`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PurgeRequest {
    #[serde(default)]
    pub(crate) keys: Vec<String>,
    #[serde(default)]
    pub(crate) patterns: Vec<String>,
    #[serde(default)]
    pub(crate) tags: Vec<String>,
}

/// Why a purge request was refused before anything was purged.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum PurgeError {
    #[error("nothing to purge: give keys, patterns or tags")]
    Empty,
    #[error("too many items: at most {MAX_PURGE_ITEMS} keys, patterns and tags together")]
    TooMany,
    #[error("{0}")]
    Invalid(String),
    #[error(
        "pattern purges need Redis (its index of cached paths), which is unavailable now; keys and tags work without it"
    )]
    RedisUnavailable,
}

/// What a purge did.
#[derive(Debug, Default, serde::Serialize)]
pub(crate) struct PurgeOutcome {
    /// Keys that name a cached route.
    pub(crate) keys: usize,
    /// Keys that match no cached route (nothing to purge).
    pub(crate) unmatched_keys: Vec<String>,
    /// Cached paths the patterns matched.
    pub(crate) pattern_matches: usize,
    pub(crate) tags: usize,
    /// Invalidations done everywhere, journaled (owed to Redis, retried), lost.
    pub(crate) done: usize,
    pub(crate) journaled: usize,
    pub(crate) lost: usize,
}

impl Proxy {
    pub(crate) async fn purge(&self, request: &PurgeRequest) -> Result<PurgeOutcome, PurgeError> {
        let count = request.keys.len() + request.patterns.len() + request.tags.len();
        if count == 0 {
            return Err(PurgeError::Empty);
        }
        if count > MAX_PURGE_ITEMS {
            return Err(PurgeError::TooMany);
        }
        if let Some(bad) = request.keys.iter().find(|k| !k.starts_with('/')) {
            return Err(PurgeError::Invalid(format!(
                "a key is a path starting with \"/\", got {bad:?}"
            )));
        }
        if let Some(bad) = request.patterns.iter().find(|p| !p.starts_with('/')) {
            return Err(PurgeError::Invalid(format!(
                "a pattern is a path starting with \"/\", got {bad:?}"
            )));
        }
        if let Some(bad) = request.tags.iter().find(|t| !tags::valid(t)) {
            return Err(PurgeError::Invalid(format!(
                "a tag is 1 to {} bytes, got {} bytes",
                tags::MAX_TAG_BYTES,
                bad.len()
            )));
        }
        let dist = self.store.as_ref();
        if !request.patterns.is_empty() && dist.is_some_and(|d| !d.is_available()) {
            return Err(PurgeError::RedisUnavailable);
        }

        let mut outcome = PurgeOutcome::default();
        let mut items: Vec<Invalidation> = Vec::new();
        for key in &request.keys {
            let path = key.split_once('?').map_or(key.as_str(), |(p, _)| p);
            match self.write.path_target(path) {
                Some(item) => {
                    outcome.keys += 1;
                    items.push(item);
                }
                None => outcome.unmatched_keys.push(key.clone()),
            }
        }
        let mut forget: Vec<(String, Vec<String>)> = Vec::new();
        if !request.patterns.is_empty() {
            let matches = |path: &str| request.patterns.iter().any(|p| glob_match(p, path));
            let mut bases = HashSet::new();
            // L1: the whole cache in embedded mode, and copies made while Redis was down.
            for full in self.l1.matching_keys(|path| matches(path)) {
                let Some((route, path)) = key::route_and_path(&full) else {
                    continue;
                };
                if let Some(read) = self.routes.load().by_name(route) {
                    bases.insert(key::base(&read.config, path).base);
                }
            }
            // Redis: each read route's index, scanned for the patterns. Marking the route's
            // tag first also refuses every fill of the route that was in flight, so none
            // puts a matched path back.
            if let Some(dist) = dist {
                let routes = self.routes.load_full();
                for name in routes.read_route_names() {
                    let tag = route_tag(name);
                    let mut matched = Vec::new();
                    for pattern in &request.patterns {
                        let members = dist
                            .route_scan(&tag, self.invalidator.horizon(), pattern)
                            .await
                            .map_err(|_| PurgeError::RedisUnavailable)?;
                        for member in members {
                            let Some((hex, path)) = member.split_once(' ') else {
                                continue;
                            };
                            if glob_match(pattern, path)
                                && let Ok(base) = u128::from_str_radix(hex, 16)
                            {
                                bases.insert(base);
                                matched.push(member);
                            }
                        }
                    }
                    forget.push((tag, matched));
                }
            }
            outcome.pattern_matches = bases.len();
            items.extend(bases.into_iter().map(|base| Invalidation::Key {
                base,
                generation_ttl: self.invalidator.horizon(),
                floor: None,
            }));
        }
        outcome.tags = request.tags.len();
        items.extend(request.tags.iter().cloned().map(Invalidation::Tag));

        let report = self
            .invalidator
            .invalidate(&items, Source::Purge, std::time::Duration::ZERO)
            .await;
        if let Some(dist) = dist
            && report.complete()
        {
            for (tag, members) in &forget {
                let _ = dist.route_forget(tag, members).await;
            }
        }
        outcome.done = report.done;
        outcome.journaled = report.journaled;
        outcome.lost = report.lost;
        Ok(outcome)
    }

    /// Applies one batch of stream entries; false when it could not be made durable
    /// (then the entries stay unacknowledged and are read again).
    pub(crate) async fn apply_stream_targets(&self, targets: Vec<Target>) -> bool {
        let items: Vec<Invalidation> = targets
            .into_iter()
            .filter_map(|target| match target {
                Target::Path(path) => self.write.path_target(&path),
                Target::Tag(tag) => Some(Invalidation::Tag(tag)),
            })
            .collect();
        if items.is_empty() {
            return true;
        }
        let report: Report = self
            .invalidator
            .invalidate(&items, Source::Stream, std::time::Duration::ZERO)
            .await;
        report.lost == 0
    }
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters (none
/// included) and every other character matches itself. Linear-time greedy matching with
/// backtracking to the last `*` (no regex crate needed for one wildcard).
pub(crate) fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::glob_match;

    #[test]
    fn globs() {
        assert!(glob_match("/api/items/*", "/api/items/7"));
        assert!(glob_match("/api/items/*", "/api/items/7/parts"));
        assert!(glob_match("/api/*/7", "/api/items/7"));
        assert!(glob_match("*", "/"));
        assert!(glob_match("/a*b*c", "/axxbyyc"));
        assert!(!glob_match("/api/items/*", "/api/users/7"));
        assert!(!glob_match("/api/items/7", "/api/items/70"));
        assert!(glob_match("/api/items/7*", "/api/items/70"));
        assert!(!glob_match("/a*b", "/acbd"));
    }
}
