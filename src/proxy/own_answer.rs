//! cacheguard's own answers — the errors it makes itself instead of relaying the origin's
//! (400, 413, 429, 431, 500, 502, 503, 504) — each leave one log line naming the route, the
//! request, the status, the reason and the upstream error, so a client's error can be
//! traced to its cause. The lines are rate-limited, so a flood of errors cannot fill a
//! disk: what is held back is counted and reported on the next line that gets through.
//!
//! [`respond::error`](super::respond::error) tags every such answer with an [`OwnAnswer`]
//! (a response extension, never sent); the router logs what it finds once the answer is
//! made, whichever path made it.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};

use http::{Method, Response};
use tracing::warn;

use super::body::Body;
use crate::clock::{DirectLimiter, TokioClock};
use crate::error::ProxyError;

/// Log lines per second, sustained.
const LINES_PER_SECOND: u32 = 10;
/// Log lines at once after a quiet spell.
const BURST: u32 = 20;
/// The longest path written into a line (a 431's path can be as long as the header limit).
const MAX_PATH_CHARS: usize = 200;

/// Why cacheguard made an answer itself; carried in the answer's extensions.
#[derive(Clone, Debug)]
pub(crate) struct OwnAnswer {
    pub(crate) reason: &'static str,
    /// The error in full, with the upstream error where there is one.
    pub(crate) detail: String,
}

impl OwnAnswer {
    pub(crate) fn of(error: &ProxyError) -> Self {
        OwnAnswer {
            reason: error.reason(),
            detail: error.detail(),
        }
    }
}

/// The rate-limited log of own answers.
#[derive(Debug)]
pub(crate) struct OwnAnswerLog {
    limiter: DirectLimiter,
    /// Lines held back since the last one written.
    suppressed: AtomicU64,
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
        }
    }

    /// Logs `response` when cacheguard made it itself (it carries an [`OwnAnswer`]).
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
        warn!(
            message = "Answered with cacheguard's own error.",
            route,
            method = %method,
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
}
