//! cacheguard's own answers — the errors it makes itself instead of relaying the origin's
//! (400, 413, 429, 431, 500, 502, 503, 504) — each leave one log line naming the route, the
//! request, the status, the reason and the upstream error, so a client's error can be
//! traced to its cause. The lines are rate-limited, so a flood of errors cannot fill a
//! disk: what is held back is counted and reported on the next line that gets through.
//!
//! [`respond::error`](super::respond::error) tags every such answer with an [`OwnAnswer`]
//! (a response extension, never sent); the router logs what it finds once the answer is
//! made, whichever path made it.
//!
//! The last [`RECENT`] lines written are also kept in a small ring for the admin status
//! page ([`OwnAnswerLog::recent`]): time, route, method (cut to the [`MAX_METHOD_BYTES`]
//! taken), path (without its query, which may carry a token, and cut to
//! [`MAX_PATH_CHARS`]), status and reason; not the error detail, which can name upstream
//! addresses. Only what the log takes: under a flood the ring costs nothing more per answer
//! than the log does, and the page lists what the log says.

use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use http::{Method, Response};
use serde::Serialize;
use tracing::warn;

use super::admit::MAX_METHOD_BYTES;
use super::body::Body;
use crate::clock::{self, DirectLimiter, TokioClock};
use crate::error::ProxyError;

/// Log lines per second, sustained.
const LINES_PER_SECOND: u32 = 10;
/// Log lines at once after a quiet spell.
const BURST: u32 = 20;
/// The longest path written into a line or kept in the ring (a 431's path can be as long
/// as the header limit).
const MAX_PATH_CHARS: usize = 200;
/// Own answers kept for the status page.
pub(crate) const RECENT: usize = 20;

/// Why cacheguard made an answer itself; carried in the answer's extensions.
#[derive(Clone, Debug)]
pub(crate) struct OwnAnswer {
    pub(crate) reason: &'static str,
    /// The error in full, with the upstream error where there is one.
    pub(crate) detail: String,
    /// The connection is closed after this answer ([`ProxyError::ends_connection`]).
    pub(crate) ends_connection: bool,
}

impl OwnAnswer {
    pub(crate) fn of(error: &ProxyError) -> Self {
        OwnAnswer {
            reason: error.reason(),
            detail: error.detail(),
            ends_connection: error.ends_connection(),
        }
    }
}

/// One own answer, as the status page lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct RecentAnswer {
    pub(crate) unix_ms: u64,
    pub(crate) route: String,
    /// At most [`MAX_METHOD_BYTES`] characters (a longer one was refused).
    pub(crate) method: String,
    /// Without the query, at most [`MAX_PATH_CHARS`] characters. Chosen by the client:
    /// whoever shows it must escape it.
    pub(crate) path: String,
    pub(crate) status: u16,
    pub(crate) reason: &'static str,
}

/// The rate-limited log of own answers, and the ring of the last few.
#[derive(Debug)]
pub(crate) struct OwnAnswerLog {
    limiter: DirectLimiter,
    /// Lines held back since the last one written.
    suppressed: AtomicU64,
    /// The last [`RECENT`] own answers, oldest first. A std `Mutex`: held for one push or
    /// one copy, never across an `.await`.
    recent: Mutex<VecDeque<RecentAnswer>>,
}

impl Default for OwnAnswerLog {
    fn default() -> Self {
        Self::new()
    }
}

impl OwnAnswerLog {
    pub(crate) fn new() -> Self {
        let per_second = NonZeroU32::new(LINES_PER_SECOND).unwrap_or(NonZeroU32::MIN);
        let burst = NonZeroU32::new(BURST).unwrap_or(NonZeroU32::MIN);
        OwnAnswerLog {
            limiter: governor::RateLimiter::direct_with_clock(
                governor::Quota::per_second(per_second).allow_burst(burst),
                TokioClock::new(),
            ),
            suppressed: AtomicU64::new(0),
            recent: Mutex::new(VecDeque::with_capacity(RECENT)),
        }
    }

    /// The last [`RECENT`] own answers, newest first.
    pub(crate) fn recent(&self) -> Vec<RecentAnswer> {
        let recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        recent.iter().rev().cloned().collect()
    }

    fn remember(&self, answer: RecentAnswer) {
        let mut recent = self.recent.lock().unwrap_or_else(PoisonError::into_inner);
        let oldest = (recent.len() == RECENT).then(|| recent.pop_front());
        recent.push_back(answer);
        drop(recent);
        // Freed after the lock is released.
        drop(oldest);
    }

    /// Logs `response` when cacheguard made it itself (it carries an [`OwnAnswer`]), and
    /// keeps the line in the ring. `path` is the request's path, without its query.
    pub(crate) fn record(
        &self,
        route: &str,
        method: &Method,
        path: &str,
        response: &Response<Body>,
    ) {
        let Some(own) = response.extensions().get::<OwnAnswer>() else {
            return;
        };
        let Some(suppressed) = self.admit() else {
            return;
        };
        let path: String = path.chars().take(MAX_PATH_CHARS).collect();
        // A method refused for its length is cut to the length taken.
        let method: String = method.as_str().chars().take(MAX_METHOD_BYTES).collect();
        self.remember(RecentAnswer {
            unix_ms: clock::now_ms(),
            route: route.to_owned(),
            method: method.clone(),
            path: path.clone(),
            status: response.status().as_u16(),
            reason: own.reason,
        });
        warn!(
            message = "Answered with cacheguard's own error.",
            route,
            method,
            path,
            status = response.status().as_u16(),
            reason = own.reason,
            error = %own.detail,
            suppressed,
        );
    }

    /// Whether one more line may be written now; if so, how many were held back since the
    /// last one.
    fn admit(&self) -> Option<u64> {
        if self.limiter.check().is_err() {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_flood_is_held_to_the_rate_and_counted() {
        let log = OwnAnswerLog::new();
        let admitted = (0..1000).filter_map(|_| log.admit()).count();
        assert_eq!(admitted, BURST as usize, "a burst, then nothing");
        tokio::time::advance(Duration::from_secs(1)).await;
        let next: Vec<u64> = (0..100).filter_map(|_| log.admit()).collect();
        assert_eq!(next.len(), LINES_PER_SECOND as usize, "one second's worth");
        assert_eq!(
            next[0],
            1000 - u64::from(BURST),
            "the first line reports what was held back"
        );
        assert!(next[1..].iter().all(|&n| n == 0));
    }

    #[tokio::test(start_paused = true)]
    async fn the_ring_keeps_the_last_answers_newest_first_with_capped_paths() {
        let log = OwnAnswerLog::new();
        let own = |status: http::StatusCode| {
            let mut response = Response::new(Body::empty());
            *response.status_mut() = status;
            response.extensions_mut().insert(OwnAnswer {
                reason: "shed",
                detail: "origin 10.0.0.7:8080 refused".to_owned(),
                ends_connection: false,
            });
            response
        };
        // Not an own answer: not kept.
        log.record("item", &Method::GET, "/x", &Response::new(Body::empty()));
        assert!(log.recent().is_empty());
        for i in 0..(RECENT + 5) {
            log.record(
                "item",
                &Method::GET,
                &format!("/api/items/{i}"),
                &own(http::StatusCode::SERVICE_UNAVAILABLE),
            );
            // Within the log's rate.
            tokio::time::advance(Duration::from_millis(100)).await;
        }
        // Held back from the log: not kept either.
        for _ in 0..BURST {
            let _ = log.admit();
        }
        log.record(
            "item",
            &Method::GET,
            "/held",
            &own(http::StatusCode::SERVICE_UNAVAILABLE),
        );
        assert!(log.recent().iter().all(|r| r.path != "/held"));
        tokio::time::advance(Duration::from_secs(3)).await;
        let long = format!("/api/items/{}", "x".repeat(1000));
        log.record(
            "-",
            &Method::POST,
            &long,
            &own(http::StatusCode::PAYLOAD_TOO_LARGE),
        );
        let long_method = Method::from_bytes("M".repeat(300).as_bytes()).expect("method");
        log.record("-", &long_method, "/m", &own(http::StatusCode::BAD_REQUEST));
        let recent = log.recent();
        assert_eq!(recent.len(), RECENT);
        assert_eq!(recent[0].method, "M".repeat(MAX_METHOD_BYTES));
        assert_eq!(recent[1].status, 413);
        assert_eq!(recent[1].method, "POST");
        assert_eq!(recent[1].path.chars().count(), MAX_PATH_CHARS);
        assert_eq!(recent[2].path, format!("/api/items/{}", RECENT + 4));
        assert_eq!(recent[RECENT - 1].path, "/api/items/7");
        assert!(recent.iter().all(|r| r.reason == "shed"));
    }
}
