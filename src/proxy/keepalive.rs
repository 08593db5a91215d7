//! How long an HTTP/1 connection may wait for its next request head: `server.keepalive_timeout`
//! while it is idle (no byte of a next head yet), `server.header_read_timeout` once a head
//! has begun to arrive.
//!
//! hyper has one timer for both: its `header_read_timeout` starts when the connection
//! begins to wait for a head, which is when the previous answer is done. An idle
//! keep-alive connection was therefore closed after `header_read_timeout` (10 s by
//! default), well before the idle timeout of the load balancer or nginx in front (60 s
//! for AWS ALB, nginx's `keepalive_timeout` 75 s): a backend that closes first makes the
//! balancer reuse a connection just closed, and its client gets a 502.
//!
//! hyper asks its timer for that wait, and only for it (`proto/h1/conn.rs`,
//! `poll_read_head`): [`HeadTimer`] is that timer, one per connection. Its wait
//! ([`HeadWait`]) starts when hyper starts waiting and ends `keepalive_timeout` later while
//! no byte of a head has come; once one has (as `chunk_guard.rs` follows the framing, it
//! publishes it in [`HeadStart`]), it ends `header_read_timeout` after that byte (or after
//! the start of the wait, for a head that came early, pipelined). A connection is thus
//! never closed for being idle once a request has begun to arrive. When the wait ends,
//! hyper closes an idle connection cleanly and cuts a head that is not whole; each is
//! counted (`cacheguard_connections_timed_out_total`). The deadline hyper passes is
//! ignored. On tokio's clock (paused time drives it in the tests below).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use hyper::rt::{Sleep, Timer};
use tokio::time::Instant;

use crate::metrics::{ConnTimeout, ConnectionMetrics};

/// Whether a request head has begun to arrive on a connection and is not whole yet.
#[derive(Debug, Default)]
pub(crate) struct HeadStart(AtomicBool);

impl HeadStart {
    pub(crate) fn set(&self, begun: bool) {
        self.0.store(begun, Ordering::Relaxed);
    }

    fn begun(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// hyper's HTTP/1 timer for one connection (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct HeadTimer {
    pub(crate) head: Arc<HeadStart>,
    pub(crate) keepalive: Duration,
    pub(crate) header_read: Duration,
    pub(crate) metrics: Arc<ConnectionMetrics>,
}

impl HeadTimer {
    /// The wait from now; its sleep is inline, so hyper's one box per wait is the only
    /// allocation (a wait begins with every request on a connection).
    fn wait(&self) -> HeadWait {
        let idle_since = Instant::now();
        // A head begun already (pipelined): `header_read_timeout` from now.
        let began = self.head.begun().then_some(idle_since);
        let deadline = match began {
            Some(began) => began + self.header_read,
            None => idle_since + self.keepalive,
        };
        HeadWait {
            timer: self.clone(),
            idle_since,
            began,
            sleep: tokio::time::sleep_until(deadline),
        }
    }
}

impl Timer for HeadTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        Box::pin(Plain {
            sleep: tokio::time::sleep(duration),
        })
    }

    /// hyper's wait for a request head.
    fn sleep_until(&self, _deadline: std::time::Instant) -> Pin<Box<dyn Sleep>> {
        Box::pin(self.wait())
    }
}

pin_project_lite::pin_project! {
    /// A plain sleep, for any other use hyper may make of its timer.
    struct Plain {
        #[pin]
        sleep: tokio::time::Sleep,
    }
}

impl Future for Plain {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.project().sleep.poll(cx)
    }
}

impl Sleep for Plain {}

pin_project_lite::pin_project! {
    /// One wait for a request head (see the module docs).
    pub(crate) struct HeadWait {
        timer: HeadTimer,
        idle_since: Instant,
        // When a head was first seen begun in this wait.
        began: Option<Instant>,
        #[pin]
        sleep: tokio::time::Sleep,
    }
}

impl HeadWait {
    /// Moves the deadline to what the connection's bytes say now. hyper polls the wait
    /// after every read that leaves its head incomplete, so a head's first byte is seen
    /// as it arrives.
    fn follow(self: Pin<&mut Self>) {
        let this = self.project();
        let begun = this.timer.head.begun();
        let deadline = match (begun, *this.began) {
            (true, Some(_)) | (false, None) => return,
            (true, None) => {
                let began = Instant::now().max(*this.idle_since);
                *this.began = Some(began);
                began + this.timer.header_read
            }
            // Only empty lines came (skipped before a request line): idle again.
            (false, Some(_)) => {
                *this.began = None;
                *this.idle_since + this.timer.keepalive
            }
        };
        this.sleep.reset(deadline);
    }
}

impl Future for HeadWait {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.as_mut().follow();
        let this = self.project();
        ready!(this.sleep.poll(cx));
        this.timer.metrics.timed_out(if this.began.is_some() {
            ConnTimeout::HeaderRead
        } else {
            ConnTimeout::Keepalive
        });
        Poll::Ready(())
    }
}

impl Sleep for HeadWait {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    fn timer() -> HeadTimer {
        HeadTimer {
            head: Arc::new(HeadStart::default()),
            keepalive: Duration::from_secs(75),
            header_read: Duration::from_secs(10),
            metrics: Arc::new(Metrics::unregistered().connections("proxy")),
        }
    }

    /// How long `wait` takes to end from now, given `poke` run after `after`.
    async fn ends_after(
        wait: impl Future<Output = ()>,
        after: Duration,
        poke: impl FnOnce(),
    ) -> Duration {
        let start = Instant::now();
        let mut wait = std::pin::pin!(wait);
        tokio::select! {
            () = &mut wait => return start.elapsed(),
            () = tokio::time::sleep(after) => poke(),
        }
        wait.await;
        start.elapsed()
    }

    /// Idle: the connection lives `keepalive_timeout`, not `header_read_timeout`.
    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_waits_the_keepalive_timeout() {
        let timer = timer();
        let took = ends_after(timer.wait(), Duration::from_secs(1), || {}).await;
        assert_eq!(took, Duration::from_secs(75));
        assert_eq!(timer.metrics.timeouts(ConnTimeout::Keepalive), 1);
        assert_eq!(timer.metrics.timeouts(ConnTimeout::HeaderRead), 0);
    }

    /// A head begun late in the idle time still has the whole `header_read_timeout`: the
    /// connection is not closed at `keepalive_timeout` under it.
    #[tokio::test(start_paused = true)]
    async fn a_head_begun_has_the_header_read_timeout_from_its_first_byte() {
        let timer = timer();
        let head = Arc::clone(&timer.head);
        let took = ends_after(timer.wait(), Duration::from_secs(70), || head.set(true)).await;
        assert_eq!(took, Duration::from_secs(80));
        assert_eq!(timer.metrics.timeouts(ConnTimeout::HeaderRead), 1);
        assert_eq!(timer.metrics.timeouts(ConnTimeout::Keepalive), 0);
    }

    /// A head already begun when the wait starts (pipelined, or the first request after
    /// accept): `header_read_timeout` from the start of the wait.
    #[tokio::test(start_paused = true)]
    async fn a_head_begun_before_the_wait_counts_from_the_wait() {
        let timer = timer();
        timer.head.set(true);
        let took = ends_after(timer.wait(), Duration::from_secs(1), || {}).await;
        assert_eq!(took, Duration::from_secs(10));
    }

    /// Empty lines alone (skipped before a request line) leave the connection idle.
    #[tokio::test(start_paused = true)]
    async fn empty_lines_leave_the_connection_idle() {
        let timer = timer();
        let head = Arc::clone(&timer.head);
        let mut wait = Box::pin(timer.wait());
        tokio::time::sleep(Duration::from_secs(30)).await;
        head.set(true);
        wait.as_mut().follow();
        tokio::time::sleep(Duration::from_secs(1)).await;
        head.set(false);
        let took = ends_after(wait, Duration::from_secs(1), || {}).await;
        assert_eq!(took, Duration::from_secs(75 - 31));
        assert_eq!(timer.metrics.timeouts(ConnTimeout::Keepalive), 1);
    }
}
