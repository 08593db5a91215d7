//! How often a token may purge (`admin.purge_rate`, `admin.purge_burst`).

use std::num::NonZeroU32;
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::clock::{KeyedLimiter, TokioClock};
use crate::config::AdminConfig;

/// How many more purges naming only keys and tags than naming a pattern are allowed.
const EXACT_PURGES_PER_PATTERN_PURGE: u32 = 10;

/// The purge requests allowed per token. One naming a pattern scans every cached route's
/// index in Redis and the whole L1, so those are allowed `admin.purge_rate` per second in
/// bursts of `admin.purge_burst`; one naming only keys and tags costs a few Redis commands
/// per item, so those get ten times both, from a budget of their own. The limiters are
/// keyed by a hash of the token presented, which has been checked already: there is one
/// entry per configured token, however many calls, and a second token would get budgets
/// of its own. Time is tokio's ([`TokioClock`]). A reload with other limits starts afresh.
pub(crate) struct PurgeLimits {
    current: ArcSwap<Limits>,
}

/// The limits in effect and their limiters; `None` with `purge_rate = 0` (no limit).
struct Limits {
    rate: u32,
    burst: u32,
    limiters: Option<Limiters>,
}

struct Limiters {
    patterns: KeyedLimiter<u64>,
    exact: KeyedLimiter<u64>,
}

impl std::fmt::Debug for PurgeLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let limits = self.current.load();
        f.debug_struct("PurgeLimits")
            .field("rate", &limits.rate)
            .field("burst", &limits.burst)
            .finish_non_exhaustive()
    }
}

impl Limits {
    fn of(config: &AdminConfig) -> Self {
        let quota = |rate: u32, burst: u32| {
            let rate = NonZeroU32::new(rate)?;
            let burst = NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN);
            Some(governor::Quota::per_second(rate).allow_burst(burst))
        };
        let factor = EXACT_PURGES_PER_PATTERN_PURGE;
        let limiters = quota(config.purge_rate, config.purge_burst)
            .zip(quota(
                config.purge_rate.saturating_mul(factor),
                config.purge_burst.saturating_mul(factor),
            ))
            .map(|(patterns, exact)| Limiters {
                patterns: governor::RateLimiter::dashmap_with_clock(patterns, TokioClock::new()),
                exact: governor::RateLimiter::dashmap_with_clock(exact, TokioClock::new()),
            });
        Limits {
            rate: config.purge_rate,
            burst: config.purge_burst,
            limiters,
        }
    }
}

impl PurgeLimits {
    pub(crate) fn new(config: &AdminConfig) -> Self {
        PurgeLimits {
            current: ArcSwap::from_pointee(Limits::of(config)),
        }
    }

    /// Applies reloaded limits; unchanged ones keep their limiters (and what they counted).
    pub(crate) fn reconfigure(&self, config: &AdminConfig) {
        let current = self.current.load();
        if current.rate != config.purge_rate || current.burst != config.purge_burst {
            self.current.store(Arc::new(Limits::of(config)));
        }
    }

    /// The limiters' key for a presented token: a hash, so no copy of it is kept.
    pub(crate) fn caller(token: &str) -> u64 {
        xxhash_rust::xxh3::xxh3_64(token.as_bytes())
    }

    /// Takes one purge of `caller` (naming a pattern or not), or says how many whole
    /// seconds (at least 1) until one is allowed.
    pub(crate) fn check(&self, caller: u64, pattern: bool) -> Result<(), u64> {
        let current = self.current.load();
        let Some(limiters) = &current.limiters else {
            return Ok(());
        };
        let limiter = if pattern {
            &limiters.patterns
        } else {
            &limiters.exact
        };
        limiter.check_key(&caller).map_err(|not_until| {
            let wait = not_until.wait_time_from(governor::clock::Clock::now(limiter.clock()));
            (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Duration;

    use super::*;

    fn limits(rate: u32, burst: u32) -> PurgeLimits {
        PurgeLimits::new(&AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: Some("t".to_owned()),
            purge_rate: rate,
            purge_burst: burst,
        })
    }

    /// How many of `n` checks pass at once.
    fn passed(limits: &PurgeLimits, caller: u64, pattern: bool, n: usize) -> usize {
        (0..n)
            .filter(|_| limits.check(caller, pattern).is_ok())
            .count()
    }

    #[tokio::test(start_paused = true)]
    async fn pattern_purges_pass_in_bursts_then_at_the_rate_per_token() {
        let limits = limits(2, 5);
        let (a, b) = (PurgeLimits::caller("a"), PurgeLimits::caller("b"));
        assert_eq!(passed(&limits, a, true, 100), 5, "the burst");
        // One cell every 500 ms: the next in half a second, said as 1 s.
        assert_eq!(limits.check(a, true), Err(1));
        assert_eq!(
            passed(&limits, b, true, 100),
            5,
            "another token, its own budget"
        );
        assert_eq!(
            passed(&limits, a, false, 100),
            50,
            "keys and tags: ten times the burst, a budget of their own"
        );
        tokio::time::advance(Duration::from_millis(499)).await;
        assert_eq!(limits.check(a, true), Err(1));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(limits.check(a, true), Ok(()));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(
            passed(&limits, a, true, 100),
            5,
            "refilled to the burst, no more"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_is_in_whole_seconds_and_a_reload_changes_the_limit() {
        let limits = limits(1, 1);
        let a = PurgeLimits::caller("a");
        assert_eq!(passed(&limits, a, true, 3), 1);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(limits.check(a, true), Err(1), "999 ms, rounded up");
        let config = |rate, burst| AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: None,
            purge_rate: rate,
            purge_burst: burst,
        };
        // The same limits: what was counted stays.
        limits.reconfigure(&config(1, 1));
        assert_eq!(limits.check(a, true), Err(1));
        limits.reconfigure(&config(1, 4));
        assert_eq!(
            passed(&limits, a, true, 10),
            4,
            "a new burst, counted afresh"
        );
        limits.reconfigure(&config(0, 4));
        assert_eq!(
            passed(&limits, a, true, 1000),
            1000,
            "purge_rate = 0: no limit"
        );
    }
}
