//! The origin guard: the origin never sees more than it was configured to take.
//!
//! Every origin request (cached fetch or pass-through) first takes a slot: a concurrency
//! permit (`upstream.max_concurrency`) and, when `upstream.max_rps` is set, a token from a
//! governor rate limiter. A request that cannot get both within `upstream.queue_timeout`
//! is shed with 503 + `Retry-After` — the queue is bounded in time, never unbounded.
//!
//! A cached fetch also reserves room for the answer it buffers (`upstream.max_buffered_bytes`):
//! `max_entry_bytes` before it starts, cut to the answer's size once it is read, and held
//! until the last client it is sent to has been written all of it. The slot frees when the
//! origin has answered; the bytes only when nobody holds them any more, so a burst of large
//! misses to slow clients waits (or is shed) instead of buffering without bound.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
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
    /// Room for buffered answers, in KiB (a semaphore counts permits in `u32` per
    /// acquisition: KiB keeps a large entry within one).
    buffer: Arc<Semaphore>,
    buffer_kib: u32,
    buffered: IntGauge,
}

/// The origin guard's limits, as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) max_concurrency: usize,
    pub(crate) max_rps: u32,
    pub(crate) queue_timeout: Duration,
    pub(crate) max_buffered_bytes: u64,
}

impl Limits {
    pub(crate) fn of(upstream: &crate::config::UpstreamConfig) -> Self {
        Limits {
            max_concurrency: upstream.max_concurrency,
            max_rps: upstream.max_rps,
            queue_timeout: upstream.queue_timeout,
            max_buffered_bytes: upstream.max_buffered_bytes,
        }
    }
}

/// The guard's gauges and histogram (kept across reloads: a new guard reports into them).
#[derive(Clone, Debug)]
pub(crate) struct GuardMetrics {
    pub(crate) in_flight: IntGauge,
    pub(crate) queue_wait: Histogram,
    /// Bytes reserved for buffered answers.
    pub(crate) buffered: IntGauge,
}

impl GuardMetrics {
    pub(crate) fn of(metrics: &crate::metrics::Metrics) -> Self {
        GuardMetrics {
            in_flight: metrics.origin_in_flight.clone(),
            queue_wait: metrics.origin_queue_wait.clone(),
            buffered: metrics.origin_buffered.clone(),
        }
    }
}

/// Room reserved for one buffered origin answer; dropping it frees the room. See
/// [`Reservation::hold`] for how it outlives the fetch.
#[derive(Debug)]
pub(crate) struct Reservation {
    permit: OwnedSemaphorePermit,
    buffered: IntGauge,
}

impl Reservation {
    /// Keeps only the room `bytes` need and frees the rest.
    fn shrink_to(&mut self, bytes: usize) {
        let keep = kib(bytes).max(1) as usize;
        let held = self.permit.num_permits();
        if held > keep
            && let Some(extra) = self.permit.split(held - keep)
        {
            self.buffered.sub(kib_to_bytes(extra.num_permits()));
        }
    }

    /// `body`, holding this reservation (cut to its size) for as long as any copy of it
    /// lives: the copies hyper queues for a slow client included, which outlive the
    /// response body that handed them over.
    pub(crate) fn hold(mut self, body: Bytes) -> Bytes {
        if body.is_empty() {
            return body;
        }
        self.shrink_to(body.len());
        Bytes::from_owner(Held {
            body,
            _reservation: self,
        })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.buffered.sub(kib_to_bytes(self.permit.num_permits()));
    }
}

/// A buffered answer and the room reserved for it.
struct Held {
    body: Bytes,
    _reservation: Reservation,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.body
    }
}

fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

fn kib_to_bytes(kib: usize) -> i64 {
    i64::try_from(kib).unwrap_or(i64::MAX / 1024) * 1024
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
    pub(crate) fn new(limits: Limits, metrics: GuardMetrics) -> Self {
        let Limits {
            max_concurrency,
            max_rps,
            queue_timeout,
            max_buffered_bytes,
        } = limits;
        let buffer_kib = u32::try_from(max_buffered_bytes / 1024)
            .unwrap_or(u32::MAX)
            .max(1);
        OriginGuard {
            slots: Arc::new(Semaphore::new(max_concurrency.max(1))),
            // A burst of one: requests are spaced 1/max_rps apart, so no 1 s window ever sees
            // more than max_rps (governor's default burst of max_rps would let an idle origin
            // take twice its cap in the first second of an avalanche).
            rate: NonZeroU32::new(max_rps).map(|rps| {
                RateLimiter::direct_with_clock(
                    Quota::per_second(rps).allow_burst(NonZeroU32::MIN),
                    TokioClock::new(),
                )
            }),
            turn: tokio::sync::Mutex::new(()),
            queue_timeout,
            max_concurrency: max_concurrency.max(1),
            max_rps,
            in_flight: metrics.in_flight,
            queue_wait: metrics.queue_wait,
            buffer: Arc::new(Semaphore::new(buffer_kib as usize)),
            buffer_kib,
            buffered: metrics.buffered,
        }
    }

    /// How long a request may wait for a slot.
    pub(crate) fn queue_timeout(&self) -> Duration {
        self.queue_timeout
    }

    /// `upstream.max_concurrency` and `upstream.max_rps` (0: no rate cap), as enforced.
    pub(crate) fn caps(&self) -> (usize, u32) {
        (self.max_concurrency, self.max_rps)
    }

    /// Whether this guard enforces the same limits as a new one made of `limits` would.
    pub(crate) fn same_limits(&self, limits: &Limits) -> bool {
        self.max_concurrency == limits.max_concurrency.max(1)
            && self.max_rps == limits.max_rps
            && self.queue_timeout == limits.queue_timeout
            && self.buffer_kib
                == u32::try_from(limits.max_buffered_bytes / 1024)
                    .unwrap_or(u32::MAX)
                    .max(1)
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
        let slot = tokio::time::timeout(self.queue_timeout, self.slot()).await;
        self.queue_wait.observe(started.elapsed().as_secs_f64());
        slot.ok()
            .flatten()
            .ok_or(ProxyError::Shed(self.queue_timeout))
    }

    /// Waits for room to buffer an answer of up to `bytes` (a route's `max_entry_bytes`),
    /// then for a slot: both within one `queue_timeout`.
    ///
    /// # Errors
    /// [`ProxyError::Shed`] when either did not come in time.
    ///
    /// # Cancel safety
    /// Cancel-safe, as [`OriginGuard::acquire`]: a dropped wait frees what it took.
    pub(crate) async fn acquire_buffered(
        &self,
        bytes: usize,
    ) -> Result<(Slot, Reservation), ProxyError> {
        let started = Instant::now();
        let wait = async {
            // Never more than the whole budget (configuration refuses a route whose
            // max_entry_bytes exceeds it; this keeps a wait from being endless regardless).
            let kib = kib(bytes).clamp(1, self.buffer_kib);
            let permit = Arc::clone(&self.buffer)
                .acquire_many_owned(kib)
                .await
                .ok()?;
            self.buffered.add(kib_to_bytes(kib as usize));
            let reservation = Reservation {
                permit,
                buffered: self.buffered.clone(),
            };
            Some((self.slot().await?, reservation))
        };
        let acquired = tokio::time::timeout(self.queue_timeout, wait).await;
        self.queue_wait.observe(started.elapsed().as_secs_f64());
        acquired
            .ok()
            .flatten()
            .ok_or(ProxyError::Shed(self.queue_timeout))
    }

    /// Waits (at most `queue_timeout`) for room to buffer `bytes` of a request body, without
    /// a slot: the slot is taken when the request is sent.
    ///
    /// # Errors
    /// [`ProxyError::Shed`] when no room came in time.
    pub(crate) async fn reserve(&self, bytes: usize) -> Result<Reservation, ProxyError> {
        let kib = kib(bytes).clamp(1, self.buffer_kib);
        let room = Arc::clone(&self.buffer).acquire_many_owned(kib);
        match tokio::time::timeout(self.queue_timeout, room).await {
            Ok(Ok(permit)) => {
                self.buffered.add(kib_to_bytes(kib as usize));
                Ok(Reservation {
                    permit,
                    buffered: self.buffered.clone(),
                })
            }
            _ => Err(ProxyError::Shed(self.queue_timeout)),
        }
    }

    async fn slot(&self) -> Option<Slot> {
        let permit = Arc::clone(&self.slots).acquire_owned().await.ok()?;
        if let Some(rate) = &self.rate {
            // tokio's Mutex is fair (FIFO): the oldest waiter takes the next token.
            let _turn = self.turn.lock().await;
            clock::until_ready(rate).await;
        }
        self.in_flight.inc();
        Some(Slot {
            _permit: permit,
            in_flight: self.in_flight.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    //! On paused time: the caps are arithmetic on the clock, so every figure is exact.

    use std::sync::Mutex;

    use super::*;

    fn guard(max: usize, rps: u32, queue: Duration) -> OriginGuard {
        buffered_guard(max, rps, queue, 256 << 20)
    }

    fn buffered_guard(max: usize, rps: u32, queue: Duration, bytes: u64) -> OriginGuard {
        let metrics = GuardMetrics {
            in_flight: IntGauge::new("t_in_flight", "t").expect("gauge"),
            queue_wait: Histogram::with_opts(prometheus::HistogramOpts::new("t_wait", "t"))
                .expect("histogram"),
            buffered: IntGauge::new("t_buffered", "t").expect("gauge"),
        };
        let limits = Limits {
            max_concurrency: max,
            max_rps: rps,
            queue_timeout: queue,
            max_buffered_bytes: bytes,
        };
        OriginGuard::new(limits, metrics)
    }

    /// A buffered answer holds its room until its last copy is gone (a slice in a slow
    /// client's write queue included), cut to its size once read; a fetch that finds no
    /// room in time is shed.
    #[tokio::test(start_paused = true)]
    async fn buffered_answers_hold_their_room_until_the_last_copy_is_gone() {
        const MIB: usize = 1 << 20;
        let g = buffered_guard(100, 0, Duration::from_millis(30), 4 << 20);
        let (slot, reservation) = g.acquire_buffered(3 * MIB).await.expect("room");
        drop(slot);
        assert_eq!(g.buffered.get(), 3 << 20);
        let started = Instant::now();
        assert!(matches!(
            g.acquire_buffered(3 * MIB).await,
            Err(ProxyError::Shed(_))
        ));
        assert_eq!(started.elapsed(), Duration::from_millis(30));
        assert_eq!(g.buffered.get(), 3 << 20, "a shed wait holds nothing");

        // The answer was 2 MiB: the third MiB is free again, the rest lives with the body.
        let body = reservation.hold(Bytes::from(vec![7u8; 2 * MIB]));
        let queued = body.slice(10..20);
        drop(body);
        assert_eq!(g.buffered.get(), 2 << 20);
        assert!(matches!(
            g.acquire_buffered(3 * MIB).await,
            Err(ProxyError::Shed(_))
        ));
        let (_slot, second) = g.acquire_buffered(2 * MIB).await.expect("2 MiB fit");
        assert_eq!(g.buffered.get(), 4 << 20);
        drop(queued);
        assert_eq!(g.buffered.get(), 2 << 20);
        drop(second);
        assert_eq!(g.buffered.get(), 0);
        assert_eq!(g.in_flight.get(), 1);
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
