//! A client's request body as cacheguard reads it, bounded in time the way Apache's
//! `mod_reqtimeout` bounds one (`RequestReadTimeout body=<initial>-<max>,MinRate=<rate>`):
//!
//! - a pause between two pieces longer than `upstream.upload_timeout` ends it
//!   ([`UploadBound::Stalled`]);
//! - past a grace of `upload_timeout` from its start, it must keep up with
//!   `upstream.upload_min_rate` on average: the time it is allowed grows by one second per
//!   `upload_min_rate` bytes received ([`UploadBound::TooSlow`]), so a body that trickles
//!   steadily cannot hold its connection (and a write its buffer) for ever;
//! - it must be whole within `upstream.upload_deadline` of its start, however fast it
//!   goes ([`UploadBound::Deadline`]).
//!
//! Each is a 408, and the connection is closed ([`ProxyError::ends_connection`]). The
//! clock runs from when cacheguard takes the body up (the write's read, or the forward to
//! the origin), on tokio's clock (paused time drives it in the tests below). [`Pace`] is
//! the arithmetic; [`Paced`] applies it to a body as it is polled. The write path reads
//! its body through it before anything else happens (`spool.rs`); pass-through streams
//! the client's body to the origin through it (`passthrough.rs`), where the time the body
//! waits for the origin to take its previous piece counts too (the origin's own stalls
//! are bounded in `upstream.rs`).
//!
//! [`client_body_error`] is the one place that turns an error of a client's body into an
//! answer: a broken bound (408), a chunk size over the limit seen by `chunk_guard.rs` (413),
//! anything else a broken framing (400).

use std::error::Error as StdError;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use super::chunk_guard::ChunkTooLarge;
use crate::config::UpstreamConfig;
use crate::error::{ProxyError, UploadBound};

/// The error of a body on its way through cacheguard (what hyper and `http-body-util`
/// box).
pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;

/// The time bounds of a client's request body (`[upstream]`: `upload_timeout`,
/// `upload_min_rate`, `upload_deadline`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UploadBounds {
    /// The longest pause; also the grace before the rate applies.
    pub(crate) idle: Duration,
    /// Bytes per second, on average past the grace; 0 = no rate bound.
    pub(crate) min_rate: u32,
    /// The longest a body may take in all.
    pub(crate) deadline: Duration,
}

impl UploadBounds {
    pub(crate) fn of(config: &UpstreamConfig) -> Self {
        UploadBounds {
            idle: config.upload_timeout,
            min_rate: config.upload_min_rate,
            deadline: config.upload_deadline,
        }
    }
}

/// How far one body has come, and when it breaks a bound if nothing more arrives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pace {
    bounds: UploadBounds,
    started: Instant,
    /// When the last piece arrived (the start, before any).
    last: Instant,
    received: u64,
}

impl Pace {
    /// A body starting now.
    pub(crate) fn start(bounds: UploadBounds) -> Self {
        let now = Instant::now();
        Pace {
            bounds,
            started: now,
            last: now,
            received: 0,
        }
    }

    /// Notes a piece of `bytes` arriving now.
    pub(crate) fn arrived(&mut self, bytes: u64) {
        self.last = Instant::now();
        self.received = self.received.saturating_add(bytes);
    }

    /// The moment the body breaks a bound if nothing more arrives, and which bound that
    /// is (the earliest; the pause first on a tie).
    pub(crate) fn limit(&self) -> (Instant, UploadBound) {
        let far = |from: Instant, by: Duration| from.checked_add(by).unwrap_or_else(far_future);
        let bounds = self.bounds;
        let mut earliest = (
            far(self.last, bounds.idle),
            UploadBound::Stalled(bounds.idle),
        );
        if bounds.min_rate > 0 {
            let rate = u64::from(bounds.min_rate);
            // One second per `rate` bytes, in whole nanoseconds without overflow.
            let earned = Duration::from_secs(self.received / rate)
                + Duration::from_nanos((self.received % rate) * 1_000_000_000 / rate);
            let at = far(self.started, bounds.idle.saturating_add(earned));
            if at < earliest.0 {
                earliest = (at, UploadBound::TooSlow(bounds.min_rate));
            }
        }
        let at = far(self.started, bounds.deadline);
        if at < earliest.0 {
            earliest = (at, UploadBound::Deadline(bounds.deadline));
        }
        earliest
    }
}

/// Far enough ahead to stand for "never" (about 30 years; tokio's own choice for a
/// timeout that cannot be represented).
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}

/// The error a [`Paced`] body ends with when its client broke a bound.
#[derive(Debug, thiserror::Error)]
#[error("request body {0}")]
pub(crate) struct UploadLimit(pub(crate) UploadBound);

/// A client's body, ended with [`UploadLimit`] when it breaks a bound of its
/// [`UploadBounds`]. The clock starts when the wrapper is made.
#[derive(Debug)]
pub(crate) struct Paced<B> {
    inner: B,
    pace: Pace,
    /// Fires at `pace.limit()`, for `bound`.
    timer: Pin<Box<Sleep>>,
    bound: UploadBound,
}

impl<B> Paced<B> {
    pub(crate) fn new(inner: B, bounds: UploadBounds) -> Self {
        let pace = Pace::start(bounds);
        let (at, bound) = pace.limit();
        Paced {
            inner,
            pace,
            timer: Box::pin(tokio::time::sleep_until(at)),
            bound,
        }
    }
}

impl<B> HttpBody for Paced<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let bytes = frame.data_ref().map_or(0, |data| data.len() as u64);
                this.pace.arrived(bytes);
                let (at, bound) = this.pace.limit();
                this.bound = bound;
                this.timer.as_mut().reset(at);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(error.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            // Nothing from the client: only a broken bound ends the wait.
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(UploadLimit(this.bound))))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The answer to an error of a client's request body (the error, and what it wraps):
/// a broken time bound → 408, a chunk size over `server.max_body_bytes` → 413, anything
/// else (a bad chunk, a body cut short) → 400.
pub(crate) fn client_body_error(error: &(dyn StdError + 'static)) -> ProxyError {
    let mut cause = Some(error);
    while let Some(current) = cause {
        if let Some(UploadLimit(bound)) = current.downcast_ref::<UploadLimit>() {
            return ProxyError::UploadTimeout(*bound);
        }
        // hyper reports a failed read as the body's error, with the I/O error as its
        // source; `io::Error::source` skips the error it wraps, so look inside.
        if let Some(io) = current.downcast_ref::<std::io::Error>()
            && let Some(ChunkTooLarge(limit)) = io
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<ChunkTooLarge>())
        {
            return ProxyError::BodyTooLarge(*limit);
        }
        cause = current.source();
    }
    ProxyError::BadRequestBody
}

#[cfg(test)]
mod tests {
    //! On paused time: every bound is arithmetic on tokio's clock, so the figures are exact.

    use http_body_util::BodyExt;
    use tokio::sync::mpsc;

    use super::*;

    const BOUNDS: UploadBounds = UploadBounds {
        idle: Duration::from_secs(2),
        min_rate: 1000,
        deadline: Duration::from_secs(60),
    };

    fn seconds(from: Instant, at: Instant) -> f64 {
        (at - from).as_secs_f64()
    }

    #[tokio::test(start_paused = true)]
    async fn the_earliest_bound_is_the_one_that_ends_the_body() {
        let mut pace = Pace::start(BOUNDS);
        let start = Instant::now();
        // Nothing yet: the grace and the pause end together; the pause is named.
        assert_eq!(
            pace.limit(),
            (start + BOUNDS.idle, UploadBound::Stalled(BOUNDS.idle))
        );
        // 1500 bytes at 1 s: the pause ends at 3 s, the rate at 2 + 1.5 = 3.5 s.
        tokio::time::advance(Duration::from_secs(1)).await;
        pace.arrived(1500);
        let (at, bound) = pace.limit();
        assert_eq!(
            (seconds(start, at), bound),
            (3.0, UploadBound::Stalled(BOUNDS.idle))
        );
        // A steady trickle of 500 bytes a second: the pause never ends it, the rate does.
        // After t seconds it has 1500 + 500 (t - 1) bytes, allowed 2 + that / 1000 s.
        for _ in 0..3 {
            tokio::time::advance(Duration::from_secs(1)).await;
            pace.arrived(500);
        }
        let (at, bound) = pace.limit();
        assert_eq!(
            (seconds(start, at), bound),
            (5.0, UploadBound::TooSlow(1000))
        );
        // Fast enough for the rate, the deadline is what is left.
        tokio::time::advance(Duration::from_secs(1)).await;
        pace.arrived(1_000_000);
        let (at, bound) = pace.limit();
        assert_eq!(
            (seconds(start, at), bound),
            (7.0, UploadBound::Stalled(BOUNDS.idle))
        );
        tokio::time::advance(Duration::from_millis(53_500)).await;
        pace.arrived(1);
        assert_eq!(
            pace.limit(),
            (
                start + BOUNDS.deadline,
                UploadBound::Deadline(BOUNDS.deadline)
            )
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_rate_bounds_only_the_pause_and_the_deadline() {
        let bounds = UploadBounds {
            min_rate: 0,
            ..BOUNDS
        };
        let mut pace = Pace::start(bounds);
        let start = Instant::now();
        for _ in 0..100 {
            tokio::time::advance(Duration::from_secs(1)).await;
            pace.arrived(1);
            let (_, bound) = pace.limit();
            assert!(!matches!(bound, UploadBound::TooSlow(_)), "{bound:?}");
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(pace.limit().0, start + bounds.deadline);
        // Huge counts and bounds do not overflow.
        let mut huge = Pace::start(UploadBounds {
            idle: Duration::MAX,
            min_rate: 1,
            deadline: Duration::MAX,
        });
        huge.arrived(u64::MAX);
        assert!(huge.limit().0 > Instant::now() + Duration::from_secs(86_400 * 365));
    }

    type Fed = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

    /// A body fed through a channel, `Paced`.
    fn paced(bounds: UploadBounds) -> (mpsc::Sender<Bytes>, Paced<Fed>) {
        let (tx, rx) = mpsc::channel::<Bytes>(1);
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            let chunk = rx.recv().await?;
            Some((Ok::<_, BoxError>(Frame::data(chunk)), rx))
        });
        let body = http_body_util::StreamBody::new(stream).boxed_unsync();
        (tx, Paced::new(body, bounds))
    }

    /// Reads `body` until it fails; the bound it broke.
    async fn bound_broken(body: &mut Paced<Fed>) -> UploadBound {
        loop {
            match body.frame().await {
                Some(Ok(_)) => continue,
                Some(Err(error)) => match client_body_error(error.as_ref()) {
                    ProxyError::UploadTimeout(bound) => return bound,
                    other => panic!("not a time bound: {other:?}"),
                },
                None => panic!("the body ended"),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickled_body_ends_when_it_falls_behind_the_rate() {
        let (tx, mut body) = paced(BOUNDS);
        let start = Instant::now();
        // 250 bytes a second, never pausing for 2 s: allowed 2 s plus 1 s per 1000 bytes;
        // after the piece at 2 s (750 bytes in all) that is 2.75 s, before the next piece.
        let feeder = tokio::spawn(async move {
            loop {
                if tx.send(Bytes::from(vec![b'x'; 250])).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        let bound = bound_broken(&mut body).await;
        assert_eq!(bound, UploadBound::TooSlow(1000));
        assert_eq!(start.elapsed(), Duration::from_millis(2750));
        feeder.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_pauses_or_runs_long_ends_at_its_bound() {
        let (tx, mut body) = paced(BOUNDS);
        let start = Instant::now();
        tx.send(Bytes::from(vec![b'x'; 5000])).await.expect("sent");
        assert_eq!(
            bound_broken(&mut body).await,
            UploadBound::Stalled(BOUNDS.idle)
        );
        assert_eq!(start.elapsed(), BOUNDS.idle);

        let short = UploadBounds {
            deadline: Duration::from_secs(3),
            ..BOUNDS
        };
        let (tx, mut body) = paced(short);
        let start = Instant::now();
        let feeder = tokio::spawn(async move {
            loop {
                if tx.send(Bytes::from(vec![b'x'; 10_000])).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
        assert_eq!(
            bound_broken(&mut body).await,
            UploadBound::Deadline(Duration::from_secs(3))
        );
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        feeder.abort();
    }

    #[test]
    fn body_errors_are_told_apart() {
        let limit: BoxError = Box::new(UploadLimit(UploadBound::TooSlow(5)));
        assert!(matches!(
            client_body_error(limit.as_ref()),
            ProxyError::UploadTimeout(UploadBound::TooSlow(5))
        ));
        let chunk = std::io::Error::new(std::io::ErrorKind::InvalidData, ChunkTooLarge(64));
        assert!(matches!(
            client_body_error(&chunk),
            ProxyError::BodyTooLarge(64)
        ));
        let other = std::io::Error::new(std::io::ErrorKind::InvalidData, "bad chunk");
        assert!(matches!(
            client_body_error(&other),
            ProxyError::BadRequestBody
        ));
    }
}
