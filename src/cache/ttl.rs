//! TTL jitter: spreads the expiry of entries stored together so they do not expire together.

use std::time::Duration;

use rand::{Rng, RngExt};

/// A TTL drawn uniformly from `ttl × [1 - jitter, 1 + jitter]`.
///
/// `jitter` is validated to `0.0..1.0` at config load; values outside are clamped here so a
/// programming error can never produce a negative or absurd TTL.
pub(crate) fn jittered(ttl: Duration, jitter: f64, rng: &mut impl Rng) -> Duration {
    let jitter = jitter.clamp(0.0, 0.999);
    if jitter == 0.0 || ttl.is_zero() {
        return ttl;
    }
    let factor = rng.random_range((1.0 - jitter)..=(1.0 + jitter));
    ttl.mul_f64(factor)
}

/// A TTL drawn uniformly from `ttl × [1 - jitter, 1]`: jitter that never extends what the
/// origin allowed (the lifetime of `freshness = "origin"` routes).
pub(crate) fn shortened(ttl: Duration, jitter: f64, rng: &mut impl Rng) -> Duration {
    let jitter = jitter.clamp(0.0, 0.999);
    if jitter == 0.0 || ttl.is_zero() {
        return ttl;
    }
    ttl.mul_f64(rng.random_range((1.0 - jitter)..=1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn shortened_never_extends() {
        let mut rng = StdRng::seed_from_u64(7);
        let ttl = Duration::from_secs(60);
        let draws: Vec<Duration> = (0..10_000).map(|_| shortened(ttl, 0.2, &mut rng)).collect();
        assert!(
            draws
                .iter()
                .all(|d| *d <= ttl && *d >= Duration::from_secs(48))
        );
        assert!(draws.iter().any(|d| *d < Duration::from_secs(50)));
    }

    #[test]
    fn jitter_stays_in_bounds_and_spreads() {
        let mut rng = StdRng::seed_from_u64(7);
        let ttl = Duration::from_secs(60);
        let draws: Vec<Duration> = (0..10_000).map(|_| jittered(ttl, 0.2, &mut rng)).collect();
        let min = draws.iter().min().unwrap();
        let max = draws.iter().max().unwrap();
        assert!(*min >= Duration::from_secs(48), "{min:?}");
        assert!(*max <= Duration::from_secs(72), "{max:?}");
        assert!(
            *max - *min > Duration::from_secs(20),
            "spread {min:?}..{max:?}"
        );
        // Uniform: each of 4 equal buckets holds about a quarter.
        let mut buckets = [0usize; 4];
        for d in &draws {
            let b = ((d.as_secs_f64() - 48.0) / 6.0).floor().clamp(0.0, 3.0) as usize;
            buckets[b] += 1;
        }
        for b in buckets {
            assert!((2_200..=2_800).contains(&b), "{buckets:?}");
        }
    }

    #[test]
    fn zero_jitter_is_exact() {
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(
            jittered(Duration::from_secs(5), 0.0, &mut rng),
            Duration::from_secs(5)
        );
    }
}
