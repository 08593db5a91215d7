//! Time, in one place. Two clocks, both following tokio's, so a test on paused time
//! (`tokio::time::pause`, `#[tokio::test(start_paused = true)]`) moves everything at once:
//!
//! - [`now_ms`]: milliseconds since the Unix epoch, for what is stored and shared between
//!   instances (an entry's store time, expiry and age), so not an `Instant`;
//! - `tokio::time::Instant`: deadlines and leases inside one process (the fleet lock's
//!   waits and renewals, the in-process flights, the event bus).
//!
//! - [`TokioClock`]: governor's clock on tokio's, for the rate limiters (the origin guard's
//!   rate cap, the hot-key per-key limit).
//!
//! Not on this seam: latency measurements for metrics, and the journal's writer thread
//! (which runs outside the runtime), use `std::time::Instant`.
//!
//! `now_ms` is the wall clock read once, at first use, advanced by tokio's monotonic clock
//! since then. A step of the system clock (a manual change) is therefore not seen until a
//! restart; NTP's gradual slewing applies to both clocks alike.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// The wall clock (Unix ms) and tokio's clock at the same moment.
static ANCHOR: OnceLock<(u64, Instant)> = OnceLock::new();

fn anchor() -> (u64, Instant) {
    *ANCHOR.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        (wall, Instant::now())
    })
}

/// Milliseconds since the Unix epoch, on tokio's clock.
///
/// The anchor is read once per process, on whichever runtime asks first. A runtime whose
/// clock is behind it (a paused test runtime made after another one had advanced) still
/// sees its own time move: the offset is signed rather than saturated.
pub(crate) fn now_ms() -> u64 {
    let (wall_ms, at) = anchor();
    let now = Instant::now();
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if now >= at {
        wall_ms.saturating_add(ms(now - at))
    } else {
        wall_ms.saturating_sub(ms(at - now))
    }
}

/// governor's clock on tokio's: an instant is the time since the clock was made. governor
/// ships clocks on `std` and on `quanta`, neither of which paused time moves; this adapter
/// is the whole of what it takes (governor's `Reference` is implemented for `Duration`).
///
/// Each clock has its own start, taken on the runtime that makes it: a start shared by the
/// whole process would come from whichever runtime read it first, and a paused runtime
/// whose clock is behind it would see its limiter's time stand still.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokioClock {
    start: Instant,
}

impl TokioClock {
    pub(crate) fn new() -> Self {
        TokioClock {
            start: Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl governor::clock::Clock for TokioClock {
    type Instant = Duration;

    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.start)
    }
}

/// A direct (unkeyed) rate limiter on [`TokioClock`].
pub(crate) type DirectLimiter = governor::RateLimiter<
    governor::state::NotKeyed,
    governor::state::InMemoryState,
    TokioClock,
    governor::middleware::NoOpMiddleware<Duration>,
>;

/// A keyed rate limiter on [`TokioClock`].
pub(crate) type KeyedLimiter<K> = governor::RateLimiter<
    K,
    governor::state::keyed::DefaultKeyedStateStore<K>,
    TokioClock,
    governor::middleware::NoOpMiddleware<Duration>,
>;

/// Waits until `limiter` grants one cell, sleeping on tokio's clock.
///
/// # Cancel safety
/// Cancel-safe: a cell is only taken by the `check` that returns `Ok`.
pub(crate) async fn until_ready(limiter: &DirectLimiter) {
    while let Err(not_until) = limiter.check() {
        let now = governor::clock::Clock::now(limiter.clock());
        tokio::time::sleep(not_until.wait_time_from(now)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paused_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a runtime")
    }

    /// A runtime whose paused clock is far ahead (a test that advanced an hour) does not
    /// stop the clocks made on another runtime.
    #[test]
    fn a_clock_counts_from_its_own_start_on_its_own_runtime() {
        use governor::clock::Clock as _;
        paused_runtime().block_on(async {
            tokio::time::advance(Duration::from_secs(3600)).await;
            let _ = TokioClock::new().now();
        });
        paused_runtime().block_on(async {
            let clock = TokioClock::new();
            tokio::time::advance(Duration::from_secs(1)).await;
            assert_eq!(clock.now(), Duration::from_secs(1));
        });
    }

    #[test]
    fn follows_the_wall_clock() {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
        assert!(now_ms().abs_diff(wall) < 1_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_rate_limiter_on_tokio_time_spaces_its_cells() {
        let limiter: DirectLimiter = governor::RateLimiter::direct_with_clock(
            governor::Quota::per_second(std::num::NonZeroU32::new(10).expect("10 > 0"))
                .allow_burst(std::num::NonZeroU32::MIN),
            TokioClock::new(),
        );
        let started = Instant::now();
        for _ in 0..5 {
            until_ready(&limiter).await;
        }
        // The first cell at once, then one every 100 ms.
        assert_eq!(started.elapsed(), Duration::from_millis(400));
    }

    #[tokio::test(start_paused = true)]
    async fn moves_exactly_with_paused_time() {
        let before = now_ms();
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(now_ms() - before, 90_000);
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(now_ms() - before, 90_250);
    }
}
