//! The origin guard: the origin never sees more than it was configured to take.
//!
//! Every origin request (cached fetch or pass-through) first takes a slot: a concurrency
//! permit (`upstream.max_concurrency`) and, when `upstream.max_rps` is set, a token from a
//! governor rate limiter. A request that cannot get both within `upstream.queue_timeout`
//! is shed with 503 + `Retry-After` — the queue is bounded in time, never unbounded.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use governor::{Quota, RateLimiter};
use prometheus::{Histogram, IntGauge};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::clock::{self, DirectLimiter, TokioClock};
use crate::error::ProxyError;

#[derive(Debug)]
pub(crate) struct OriginGuard {
    slots: Arc<Semaphore>,
    rate: Option<DirectLimiter>,
    /// Rate tokens are waited for one request at a time, in arrival order. governor's
    /// `until_ready` is not fair: each waiter sleeps until its computed time and whoever
    /// checks first wins, so under contention one request could lose again and again until
    /// `queue_timeout` shed it (seen: 503 after 5 s at 20 req/s with 16 waiters).
    turn: tokio::sync::Mutex<()>,
    queue_timeout: Duration,
    max_concurrency: usize,
    max_rps: u32,
    in_flight: IntGauge,
    queue_wait: Histogram,
}

/// A held origin slot; dropping it frees the slot.
#[derive(Debug)]
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
    in_flight: IntGauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

impl OriginGuard {
    pub(crate) fn new(
        max_concurrency: usize,
        max_rps: u32,
        queue_timeout: Duration,
        in_flight: IntGauge,
        queue_wait: Histogram,
    ) -> Self {
        OriginGuard {
            slots: Arc::new(Semaphore::new(max_concurrency.max(1))),
            // A burst of one: requests are spaced 1/max_rps apart, so no 1 s window ever sees
            // more than max_rps (governor's default burst of max_rps would let an idle origin
            // take twice its cap in the first second of an avalanche).
            rate: NonZeroU32::new(max_rps).map(|rps| {
                RateLimiter::direct_with_clock(
                    Quota::per_second(rps).allow_burst(NonZeroU32::MIN),
                    TokioClock,
                )
            }),
            turn: tokio::sync::Mutex::new(()),
            queue_timeout,
            max_concurrency: max_concurrency.max(1),
            max_rps,
            in_flight,
            queue_wait,
        }
    }

    /// How long a request may wait for a slot.
    pub(crate) fn queue_timeout(&self) -> Duration {
        self.queue_timeout
    }

    /// Whether this guard enforces the same limits as `other` would.
    pub(crate) fn same_limits(
        &self,
        max_concurrency: usize,
        max_rps: u32,
        queue_timeout: Duration,
    ) -> bool {
        self.max_concurrency == max_concurrency.max(1)
            && self.max_rps == max_rps
            && self.queue_timeout == queue_timeout
    }

    /// Waits for a slot, at most `queue_timeout`.
    ///
    /// # Errors
    /// [`ProxyError::Shed`] when no slot (or rate token) came in time.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped wait holds nothing (the permit is taken first-in-first-out
    /// from tokio's fair semaphore and released on drop; a rate token is only taken once a
    /// permit is held).
    pub(crate) async fn acquire(&self) -> Result<Slot, ProxyError> {
        let started = Instant::now();
        let wait = async {
            let permit = Arc::clone(&self.slots).acquire_owned().await.ok()?;
            if let Some(rate) = &self.rate {
                // tokio's Mutex is fair (FIFO): the oldest waiter takes the next token.
                let _turn = self.turn.lock().await;
                clock::until_ready(rate).await;
            }
            Some(permit)
        };
        let permit = tokio::time::timeout(self.queue_timeout, wait).await;
        self.queue_wait.observe(started.elapsed().as_secs_f64());
        match permit {
            Ok(Some(permit)) => {
                self.in_flight.inc();
                Ok(Slot {
                    _permit: permit,
                    in_flight: self.in_flight.clone(),
                })
            }
            _ => Err(ProxyError::Shed(self.queue_timeout)),
        }
    }
}

#[cfg(test)]
mod tests {
    //! On paused time: the caps are arithmetic on the clock, so every figure is exact.

    use std::sync::Mutex;

    use super::*;

    fn guard(max: usize, rps: u32, queue: Duration) -> OriginGuard {
        let in_flight = IntGauge::new("t_in_flight", "t").expect("gauge");
        let wait =
            Histogram::with_opts(prometheus::HistogramOpts::new("t_wait", "t")).expect("histogram");
        OriginGuard::new(max, rps, queue, in_flight, wait)
    }

    #[tokio::test(start_paused = true)]
    async fn sheds_when_no_slot_frees_in_time() {
        let g = guard(2, 0, Duration::from_millis(30));
        let a = g.acquire().await.expect("a slot");
        let _b = g.acquire().await.expect("a slot");
        let started = Instant::now();
        assert!(matches!(g.acquire().await, Err(ProxyError::Shed(_))));
        assert_eq!(started.elapsed(), Duration::from_millis(30));
        assert_eq!(g.in_flight.get(), 2);
        drop(a);
        assert!(g.acquire().await.is_ok());
    }

    /// Rate tokens go to waiters in arrival order: 12 waiters arriving 2 ms apart on a
    /// 50/s cap get their tokens in exactly that order (governor alone lets whoever
    /// re-checks first win, so a waiter can lose again and again).
    #[tokio::test(start_paused = true)]
    async fn rate_tokens_go_to_waiters_in_turn() {
        let g = Arc::new(guard(100, 50, Duration::from_secs(3)));
        let order = Arc::new(Mutex::new(Vec::new()));
        // Take the one token there is, so every waiter below has to wait.
        let _first = g.acquire().await.expect("the first token");
        let mut tasks = Vec::new();
        for i in 0..12 {
            let (g, order) = (Arc::clone(&g), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let slot = g.acquire().await;
                assert!(slot.is_ok(), "waiter {i} was shed");
                order.lock().expect("order").push(i);
            }));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        for task in tasks {
            task.await.expect("waiter");
        }
        assert_eq!(*order.lock().expect("order"), (0..12).collect::<Vec<_>>());
    }

    #[tokio::test(start_paused = true)]
    async fn rate_cap_sheds_the_excess() {
        let g = guard(100, 5, Duration::from_millis(50));
        // 20 at once: one passes (no burst: requests are spaced 200 ms apart), the rest
        // would need to wait 200 ms or more, longer than the 50 ms queue timeout.
        let results = futures_util::future::join_all((0..20).map(|_| g.acquire())).await;
        let ok = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(ok, 1, "{ok}");
        assert!(
            results
                .iter()
                .all(|r| r.is_ok() || matches!(r, Err(ProxyError::Shed(_))))
        );
    }

    /// An avalanche of 200 misses on a 50/s cap: the grants are spaced exactly 20 ms
    /// apart, so no one-second window ever holds more than 50 of them.
    #[tokio::test(start_paused = true)]
    async fn no_second_ever_sees_more_than_max_rps() {
        let g = Arc::new(guard(256, 50, Duration::from_secs(60)));
        let started = Instant::now();
        let grants = Arc::new(Mutex::new(Vec::new()));
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                let (g, grants) = (Arc::clone(&g), Arc::clone(&grants));
                tokio::spawn(async move {
                    let slot = g.acquire().await.expect("no shedding within 60 s");
                    grants.lock().expect("grants").push(started.elapsed());
                    drop(slot);
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task");
        }
        let mut grants = grants.lock().expect("grants").clone();
        grants.sort();
        let expected: Vec<_> = (0..200).map(|i| Duration::from_millis(20 * i)).collect();
        assert_eq!(grants, expected);
        for (i, at) in grants.iter().enumerate() {
            let in_window = grants[i..]
                .iter()
                .take_while(|t| **t < *at + Duration::from_secs(1))
                .count();
            assert!(
                in_window <= 50,
                "{in_window} grants in the second from {at:?}"
            );
        }
    }

    /// 100 misses of 100 ms each through 16 slots: never more than 16 at the origin, and
    /// the whole burst takes exactly ceil(100 / 16) = 7 rounds.
    #[tokio::test(start_paused = true)]
    async fn never_more_than_max_concurrency_at_the_origin() {
        let g = Arc::new(guard(16, 0, Duration::from_secs(60)));
        let peak = Arc::new(Mutex::new(0i64));
        let started = Instant::now();
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let (g, peak) = (Arc::clone(&g), Arc::clone(&peak));
                tokio::spawn(async move {
                    let slot = g.acquire().await.expect("no shedding within 60 s");
                    {
                        let mut peak = peak.lock().expect("peak");
                        *peak = (*peak).max(g.in_flight.get());
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    drop(slot);
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("task");
        }
        assert_eq!(*peak.lock().expect("peak"), 16);
        assert_eq!(started.elapsed(), Duration::from_millis(700));
        assert_eq!(g.in_flight.get(), 0);
    }
}
