//! The status page's memory: a ring of samples, one every [`SAMPLE_EVERY`], so a page opened
//! now shows the last ten minutes at once instead of starting its charts empty.
//!
//! A [`Reading`] is what the counters say at one moment (cumulative answers per route, origin
//! requests so far, gauges); [`History::record`] turns it into a [`Sample`] by comparing it
//! with the sample before: requests per second and hit ratio over the interval. Memory is
//! bounded by [`CAPACITY`] samples of one small record per route and per stock gate (the
//! routes are those of the route table at that moment, so a reload that adds or removes
//! routes shows from the next sample on): about 100 bytes per route or gate per sample,
//! 300 KiB for ten.
//!
//! Time is tokio's: [`run`] ticks on `tokio::time::interval` and stamps samples with
//! [`clock::now_ms`], so the tests below move both with paused time.
//!
//! The hit ratio is `hit_l1 + hit_l2 + coalesced` over every outcome but `bypass`
//! (uncacheable by design) and a stock gate's own answers (`sold_out`, `replayed`: buys,
//! which no cache could have answered), as the dashboard's L1, L2 and coalesced lines add
//! up: a hit is an answer without an origin fetch of its own, so the requests a stampede's
//! one fill answered count (as nginx and Varnish count their waiters). Stale, revalidated,
//! negative and rejected answers count in the denominator only.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::clock;
use crate::metrics::Outcome;

/// How often a sample is taken.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// Samples kept: ten minutes at [`SAMPLE_EVERY`].
pub(crate) const CAPACITY: usize = 300;

/// A route's answers so far, by outcome, in [`Outcome::ALL`] order.
pub(crate) type Counts = [u64; Outcome::ALL.len()];

/// Outcomes that are not answers a cache could have given: out of the hit ratio.
const NOT_CACHEABLE: [Outcome; 3] = [Outcome::Bypass, Outcome::SoldOut, Outcome::Replayed];

/// A stock gate's buys so far, as its chart draws them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct GateCounts {
    /// Buys that took units (forwarded to the origin).
    pub(crate) admitted: u64,
    /// Buys answered sold out, from this instance's marks or from Redis.
    pub(crate) sold_out: u64,
}

/// The counters and gauges the page charts, read at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Reading {
    /// Every route of the route table, with its answers so far.
    pub(crate) routes: Vec<(String, Counts)>,
    /// Origin requests so far (every route, every status).
    pub(crate) origin_requests: u64,
    pub(crate) origin_in_flight: u64,
    /// `upstream.max_concurrency`, as the origin guard enforces it now.
    pub(crate) max_concurrency: u64,
    /// `upstream.max_rps`; 0 = no rate cap.
    pub(crate) max_rps: u64,
    /// Whether Redis is in the request path (breaker closed); `None` in embedded mode.
    pub(crate) redis_up: Option<bool>,
    /// Every stock gate, with its buys so far.
    pub(crate) gates: Vec<(String, GateCounts)>,
}

/// One route in one sample.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RouteSample {
    /// Shared with the same route's entry in the samples before (one allocation per route,
    /// not per sample).
    pub(crate) name: Arc<str>,
    pub(crate) counts: Counts,
    /// Over the interval since the sample before; `None` for a route new in this sample.
    pub(crate) rps: Option<f64>,
    /// Over the same interval; `None` when it had no answer that could have been a hit, and
    /// for a route new in this sample.
    pub(crate) hit_ratio: Option<f64>,
}

/// One stock gate in one sample.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GateSample {
    /// Shared with the same gate's entry in the samples before.
    pub(crate) name: Arc<str>,
    pub(crate) counts: GateCounts,
    /// Per second over the interval since the sample before; `None` in the first sample.
    pub(crate) admitted_rps: Option<f64>,
    pub(crate) sold_out_rps: Option<f64>,
}

/// One sample: a [`Reading`] with its rates.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Sample {
    /// Unix milliseconds, on [`clock::now_ms`].
    pub(crate) at_ms: u64,
    pub(crate) routes: Vec<RouteSample>,
    pub(crate) origin_requests: u64,
    /// Origin requests per second over the interval; `None` for the first sample.
    pub(crate) origin_rps: Option<f64>,
    pub(crate) origin_in_flight: u64,
    pub(crate) max_concurrency: u64,
    pub(crate) max_rps: u64,
    pub(crate) redis_up: Option<bool>,
    pub(crate) gates: Vec<GateSample>,
}

impl Sample {
    /// The entry of route `name`, if the route was in the table then.
    pub(crate) fn route(&self, name: &str) -> Option<&RouteSample> {
        self.routes.iter().find(|r| &*r.name == name)
    }

    /// The entry of stock gate `name`.
    pub(crate) fn gate(&self, name: &str) -> Option<&GateSample> {
        self.gates.iter().find(|g| &*g.name == name)
    }
}

/// The last [`CAPACITY`] samples, oldest first.
#[derive(Debug)]
pub(crate) struct History {
    samples: VecDeque<Sample>,
    capacity: usize,
}

impl Default for History {
    fn default() -> Self {
        History::with_capacity(CAPACITY)
    }
}

impl History {
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        History {
            samples: VecDeque::with_capacity(capacity.max(1)),
            capacity: capacity.max(1),
        }
    }

    /// Adds the sample of `reading` taken at `at_ms`, dropping the oldest when full.
    pub(crate) fn record(&mut self, at_ms: u64, reading: Reading) {
        let before = self.samples.back();
        let ms = before.map_or(0, |b| at_ms.saturating_sub(b.at_ms));
        let routes = reading
            .routes
            .into_iter()
            .map(|(name, counts)| {
                let prior = before.and_then(|b| b.route(&name));
                RouteSample {
                    name: prior.map_or_else(|| Arc::from(name), |p| Arc::clone(&p.name)),
                    rps: prior.and_then(|p| per_second(total(&p.counts), total(&counts), ms)),
                    hit_ratio: prior.and_then(|p| hit_ratio(&p.counts, &counts)),
                    counts,
                }
            })
            .collect();
        let gates = reading
            .gates
            .into_iter()
            .map(|(name, counts)| {
                let prior = before.and_then(|b| b.gate(&name));
                GateSample {
                    name: prior.map_or_else(|| Arc::from(name), |p| Arc::clone(&p.name)),
                    admitted_rps: prior
                        .and_then(|p| per_second(p.counts.admitted, counts.admitted, ms)),
                    sold_out_rps: prior
                        .and_then(|p| per_second(p.counts.sold_out, counts.sold_out, ms)),
                    counts,
                }
            })
            .collect();
        let sample = Sample {
            at_ms,
            routes,
            origin_requests: reading.origin_requests,
            origin_rps: before
                .and_then(|b| per_second(b.origin_requests, reading.origin_requests, ms)),
            origin_in_flight: reading.origin_in_flight,
            max_concurrency: reading.max_concurrency,
            max_rps: reading.max_rps,
            redis_up: reading.redis_up,
            gates,
        };
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }

    /// The samples taken after `after_ms`, oldest first.
    pub(crate) fn since(&self, after_ms: u64) -> impl Iterator<Item = &Sample> {
        // Samples are in time order: skip from the front.
        let start = self.samples.partition_point(|s| s.at_ms <= after_ms);
        self.samples.range(start..)
    }

    /// What to measure rates against at `now_ms`: the newest sample at least `window` old,
    /// or, while the history is younger than that, the oldest one.
    pub(crate) fn reference(&self, now_ms: u64, window: Duration) -> Option<&Sample> {
        let window = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let cutoff = now_ms.saturating_sub(window);
        self.samples
            .iter()
            .rev()
            .find(|s| s.at_ms <= cutoff)
            .or_else(|| self.samples.front())
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.samples.len()
    }
}

/// Every answer in `counts`.
pub(crate) fn total(counts: &Counts) -> u64 {
    counts.iter().sum()
}

/// `(after - before)` per second over `ms`; `None` over no time. Saturating: a counter never
/// goes back, and a reading that looked so would show no requests, not a negative rate.
pub(crate) fn per_second(before: u64, after: u64, ms: u64) -> Option<f64> {
    (ms > 0).then(|| after.saturating_sub(before) as f64 * 1000.0 / ms as f64)
}

/// The hit ratio of the answers between `before` and `after` (see the module doc); `None`
/// when none of them could have been a hit.
pub(crate) fn hit_ratio(before: &Counts, after: &Counts) -> Option<f64> {
    let delta = |o: Outcome| {
        let i = o as usize;
        after[i].saturating_sub(before[i])
    };
    let hits = delta(Outcome::HitL1) + delta(Outcome::HitL2) + delta(Outcome::Coalesced);
    let cacheable: u64 = Outcome::ALL
        .into_iter()
        .filter(|o| !NOT_CACHEABLE.contains(o))
        .map(delta)
        .sum();
    (cacheable > 0).then(|| hits as f64 / cacheable as f64)
}

/// Takes a sample of `read()` every [`SAMPLE_EVERY`] into `history` until `stop`; the first
/// at once.
///
/// The lock is a std `Mutex`: held for one push here and for one walk over the ring when a
/// page is built, never across an `.await`.
pub(crate) async fn run(
    history: &Mutex<History>,
    mut read: impl FnMut() -> Reading,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    // A late tick (a busy runtime) is taken late, not made up for with a burst: the rates
    // divide by the real interval either way.
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let reading = read();
        history
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(clock::now_ms(), reading);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    fn counts(pairs: &[(Outcome, u64)]) -> Counts {
        let mut c = [0; Outcome::ALL.len()];
        for (o, n) in pairs {
            c[*o as usize] = *n;
        }
        c
    }

    fn reading(routes: &[(&str, Counts)], origin: u64) -> Reading {
        Reading {
            routes: routes.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect(),
            origin_requests: origin,
            origin_in_flight: 3,
            max_concurrency: 64,
            max_rps: 100,
            redis_up: Some(true),
            gates: Vec::new(),
        }
    }

    #[test]
    fn hit_ratio_leaves_bypass_out_and_is_none_without_cacheable_answers() {
        let before = counts(&[]);
        let after = counts(&[
            (Outcome::HitL1, 6),
            (Outcome::HitL2, 2),
            (Outcome::Miss, 1),
            (Outcome::Stale, 1),
            (Outcome::Bypass, 50),
        ]);
        assert_eq!(hit_ratio(&before, &after), Some(0.8));
        assert_eq!(hit_ratio(&after, &after), None);
        assert_eq!(hit_ratio(&before, &counts(&[(Outcome::Bypass, 9)])), None);
    }

    /// A stampede's waiters, answered by its one fill, are hits: 1 miss and 9 coalesced
    /// answers are a 90% hit ratio, not 0%.
    #[test]
    fn coalesced_answers_are_hits() {
        let before = counts(&[]);
        let stampede = counts(&[(Outcome::Miss, 1), (Outcome::Coalesced, 9)]);
        assert_eq!(hit_ratio(&before, &stampede), Some(0.9));
    }

    /// A flash sale's crowd answered sold out (and replays of completed buys) are buys, not
    /// cache misses: they leave a route's hit ratio alone.
    #[test]
    fn stock_answers_are_not_in_the_hit_ratio() {
        let before = counts(&[]);
        let sale = counts(&[
            (Outcome::HitL1, 3),
            (Outcome::Miss, 1),
            (Outcome::SoldOut, 1_000),
            (Outcome::Replayed, 10),
        ]);
        assert_eq!(hit_ratio(&before, &sale), Some(0.75));
        let buys_only = counts(&[(Outcome::SoldOut, 1_000), (Outcome::Bypass, 10)]);
        assert_eq!(hit_ratio(&before, &buys_only), None);
    }

    #[test]
    fn gates_get_rates_of_admitted_and_sold_out() {
        let gate = |admitted, sold_out| {
            let mut r = reading(&[], 0);
            r.gates = vec![("seats".to_owned(), GateCounts { admitted, sold_out })];
            r
        };
        let mut history = History::default();
        history.record(2000, gate(10, 0));
        history.record(4000, gate(30, 500));
        let samples: Vec<&Sample> = history.since(0).collect();
        let first = samples[0].gate("seats").expect("the gate");
        assert_eq!((first.admitted_rps, first.sold_out_rps), (None, None));
        let second = samples[1].gate("seats").expect("the gate");
        assert_eq!(
            (second.admitted_rps, second.sold_out_rps),
            (Some(10.0), Some(250.0))
        );
        assert!(Arc::ptr_eq(&first.name, &second.name));
    }

    #[test]
    fn the_ring_keeps_its_capacity_and_drops_the_oldest() {
        let mut history = History::with_capacity(3);
        for i in 0..10u64 {
            history.record(i * 2000, reading(&[("item", counts(&[]))], i));
        }
        assert_eq!(history.len(), 3);
        let times: Vec<u64> = history.since(0).map(|s| s.at_ms).collect();
        assert_eq!(times, [14_000, 16_000, 18_000]);
        let after: Vec<u64> = history.since(16_000).map(|s| s.at_ms).collect();
        assert_eq!(after, [18_000]);
    }

    #[test]
    fn routes_added_and_removed_by_a_reload_show_from_the_next_sample() {
        let mut history = History::default();
        let a = counts(&[(Outcome::HitL1, 10)]);
        history.record(2000, reading(&[("a", a)], 0));
        history.record(4000, reading(&[("a", a), ("b", a)], 0));
        history.record(6000, reading(&[("b", counts(&[(Outcome::HitL1, 14)]))], 0));
        let samples: Vec<&Sample> = history.since(0).collect();
        assert_eq!(samples[1].route("a").map(|r| r.rps), Some(Some(0.0)));
        // New: no rate yet (its counts may date from before the reload).
        assert_eq!(samples[1].route("b").map(|r| r.rps), Some(None));
        assert!(samples[2].route("a").is_none());
        assert_eq!(samples[2].route("b").map(|r| r.rps), Some(Some(2.0)));
        // One name, one allocation.
        assert!(Arc::ptr_eq(
            &samples[1].routes[1].name,
            &samples[2].routes[0].name
        ));
    }

    #[test]
    fn the_reference_is_the_newest_sample_a_window_old() {
        let mut history = History::default();
        for i in 0..10u64 {
            history.record(i * 2000, reading(&[], 0));
        }
        let window = Duration::from_secs(10);
        assert_eq!(
            history.reference(19_000, window).map(|s| s.at_ms),
            Some(8_000)
        );
        // Younger than the window: the oldest.
        assert_eq!(history.reference(5_000, window).map(|s| s.at_ms), Some(0));
        assert!(History::default().reference(5_000, window).is_none());
    }

    /// The sampler on paused time: one sample at once, then one every two seconds, with
    /// rates over the real interval, and never more than the capacity.
    #[tokio::test(start_paused = true)]
    async fn samples_every_two_seconds_with_rates_on_paused_time() {
        let history = Arc::new(Mutex::new(History::default()));
        let answered = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (history, answered, stop) = (history.clone(), answered.clone(), stop.clone());
            async move {
                let read = || {
                    let n = answered.load(Ordering::Relaxed);
                    // Three hits in four cacheable answers, and as many bypasses.
                    let c = counts(&[
                        (Outcome::HitL1, n * 3 / 8),
                        (Outcome::Miss, n / 8),
                        (Outcome::Bypass, n / 2),
                    ]);
                    reading(&[("item", c)], n / 8)
                };
                run(&history, read, stop).await;
            }
        });
        let started = clock::now_ms();
        tokio::task::yield_now().await;
        assert_eq!(history.lock().unwrap().len(), 1, "the first sample at once");
        for _ in 0..(CAPACITY + 50) {
            // 80 answers per two seconds: 40 req/s, 5 origin req/s.
            answered.fetch_add(80, Ordering::Relaxed);
            tokio::time::advance(SAMPLE_EVERY).await;
            tokio::task::yield_now().await;
        }
        stop.cancel();
        task.await.unwrap();

        let history = history.lock().unwrap();
        assert_eq!(history.len(), CAPACITY);
        let samples: Vec<&Sample> = history.since(0).collect();
        let last = samples[CAPACITY - 1];
        assert_eq!(last.at_ms - started, (CAPACITY as u64 + 50) * 2000);
        assert_eq!(last.at_ms - samples[0].at_ms, (CAPACITY as u64 - 1) * 2000);
        let item = last.route("item").unwrap();
        assert_eq!(item.rps, Some(40.0));
        assert_eq!(item.hit_ratio, Some(0.75));
        assert_eq!(last.origin_rps, Some(5.0));
    }
}
