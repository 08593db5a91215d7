//! Time, in one place. Two clocks, both following tokio's, so a test on paused time
//! (`tokio::time::pause`, `#[tokio::test(start_paused = true)]`) moves everything at once:
//!
//! - [`now_ms`]: milliseconds since the Unix epoch, for what is stored and shared between
//!   instances (an entry's store time, expiry and age), so not an `Instant`;
//! - `tokio::time::Instant`: deadlines and leases inside one process (the fleet lock's
//!   waits and renewals, the in-process flights, the event bus).
//!
//! Not yet on this seam: latency measurements for metrics and the journal's writer thread
//! (which runs outside the runtime) use `std::time::Instant`, and the rate limiters
//! (origin guard, hot-key limit) use governor's own clock.
//!
//! `now_ms` is the wall clock read once, at first use, advanced by tokio's monotonic clock
//! since then. A step of the system clock (a manual change) is therefore not seen until a
//! restart; NTP's gradual slewing applies to both clocks alike.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// The wall clock (Unix ms) and tokio's clock at the same moment.
static ANCHOR: OnceLock<(u64, Instant)> = OnceLock::new();

/// Milliseconds since the Unix epoch, on tokio's clock.
pub(crate) fn now_ms() -> u64 {
    let (wall_ms, at) = *ANCHOR.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        (wall, Instant::now())
    });
    let elapsed = Instant::now().saturating_duration_since(at);
    wall_ms.saturating_add(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn follows_the_wall_clock() {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
        assert!(now_ms().abs_diff(wall) < 1_000);
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
