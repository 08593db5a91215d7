//! The accept loop: HTTP/1.1 and h2c (prior knowledge) on one listener, header limits and
//! read timeouts, and graceful shutdown (stop accepting, drain in-flight requests within
//! the grace period, then cut what is left).
//!
//! The proxy listener is served nginx-style ([`serve_sharded`]): one accept loop hands each
//! connection, round-robin, to one of N worker threads, each running its own
//! single-threaded event loop. A connection and every request on it then stay on one
//! thread: no work stealing and no cross-thread wake-up per request, which on a small CPU
//! budget cost more than they gain (BENCHMARKS.md, hit path). Shared state (caches, flights,
//! Redis) is thread-safe and shared by all workers. The admin listener uses [`serve`] on
//! the main runtime.
//!
//! A connection's bytes go through, from the socket up: [`Linger`] (a lingering close when
//! hyper lets go of the socket, `linger.rs`), [`ChunkGuard`] (chunk sizes over the body
//! limit; where a request head begins and ends), [`HeadGuard`] (cacheguard's own answers in
//! place of hyper's bare refusals of a head). hyper's HTTP/1 timer is [`HeadTimer`]: an idle
//! connection lives `keepalive_timeout`, a head that has begun `header_read_timeout`
//! (`keepalive.rs`).
//!
//! An answer made before the request body was read to its end (sold out, 413, 401, ...)
//! must not leave the client guessing whether the connection lives: hyper then discards
//! what of the body it has already received, and when that is not all of it, closes the
//! connection after the answer — but it decides so only when it sees the body dropped,
//! after it has written the answer's head, which then lacks `Connection: close`. The
//! service therefore yields once after an answer to a request with a body, before handing
//! the answer over: hyper's dispatcher polls its read side first, discards or gives up on
//! the rest of the body, and writes the head with `Connection: close` when it will close
//! (hyper's `proto/h1/dispatch.rs`, `poll_drain_or_close_read`; `conn.rs`,
//! `enforce_version`). A body sent with its head is thus discarded and the connection
//! kept; one still on its way (sent later, after `Expect: 100-continue` — to which no
//! `100 Continue` is then sent — or larger than what hyper buffers) gets
//! `Connection: close`, and the close lingers until the client has read the answer.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use prometheus::IntGauge;
use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::body::Body;
use super::chunk_guard::ChunkGuard;
use super::head_guard::HeadGuard;
use super::keepalive::{HeadStart, HeadTimer};
use super::linger::{Linger, LingerBounds};
use crate::metrics::{ConnTimeout, ConnectionMetrics};

/// Limits applied by the HTTP layer itself.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnLimits {
    pub(crate) max_header_bytes: usize,
    /// Header fields in one HTTP/1.1 request head; hyper answers 431 to more.
    pub(crate) max_headers: usize,
    /// `server.max_body_bytes`: a chunked body whose sizes declare more is refused as soon
    /// as its size line arrives ([`ChunkGuard`]).
    pub(crate) max_body_bytes: u64,
    /// The time a request head has from its first byte; also from accept to the first
    /// request: a connection that sends no complete request head in this time is closed,
    /// so connections that never send one cannot pile up.
    pub(crate) header_read_timeout: Duration,
    /// The time a connection may stay idle between two requests (`keepalive.rs`).
    pub(crate) keepalive_timeout: Duration,
    /// The bounds of a lingering close (`linger.rs`).
    pub(crate) linger: LingerBounds,
    pub(crate) shutdown_grace: Duration,
}

/// How many connections a listener keeps open at once; one more is closed as soon as it is
/// accepted (so it does not wait in the kernel's backlog either) and counted.
/// The place is held until the socket is closed, lingering included. Also carries the
/// listener's connection metrics.
#[derive(Clone, Debug)]
pub(crate) struct Admission {
    slots: Arc<Semaphore>,
    metrics: Arc<ConnectionMetrics>,
}

impl Admission {
    pub(crate) fn new(max_connections: usize, metrics: ConnectionMetrics) -> Self {
        Admission {
            slots: Arc::new(Semaphore::new(max_connections.max(1))),
            metrics: Arc::new(metrics),
        }
    }

    /// A place for one more connection, or `None` (counted) when the listener is full.
    fn admit(&self) -> Option<Admitted> {
        match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(permit) => {
                self.metrics.open.inc();
                Some(Admitted {
                    _permit: permit,
                    open: self.metrics.open.clone(),
                })
            }
            Err(_) => {
                self.metrics.refused.inc();
                None
            }
        }
    }
}

/// One admitted connection's place: freed when the connection's task ends.
#[derive(Debug)]
struct Admitted {
    _permit: OwnedSemaphorePermit,
    open: IntGauge,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// hyper's default number of header fields, parsed into an array on the stack.
const HYPER_MAX_HEADERS: usize = 100;

fn connection_builder(limits: ConnLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    let mut http1 = builder.http1();
    http1
        // hyper's own head limit is a backstop (a head that overflows it gets 431, or 414
        // when the request line is what overflows: see `HeadGuard`); the configured limit
        // is checked per request. Twice the configured size leaves room for request-line
        // and framing overhead, and bounds what one connection buffers of a head.
        .max_buf_size((limits.max_header_bytes * 2).max(8192) + 1024)
        // Only turns hyper's wait for a head on: its timer, set per connection
        // (`HeadTimer`), makes the deadlines.
        .header_read_timeout(limits.keepalive_timeout);
    // Any other count makes hyper allocate the array on the heap for every request: only
    // then is it set.
    if limits.max_headers != HYPER_MAX_HEADERS {
        http1.max_headers(limits.max_headers);
    }
    builder
        .http2()
        .max_header_list_size(u32::try_from(limits.max_header_bytes * 2).unwrap_or(u32::MAX))
        .timer(TokioTimer::new());
    builder
}

/// Serves one accepted connection on the current runtime, watched by `graceful`, holding
/// its admission place until its socket is closed (see the module docs for the layers of
/// its bytes). A connection whose first request has not begun within
/// `header_read_timeout` of accept is closed: hyper's wait for a head starts with the first
/// bytes, and the protocol detection before it waits for ever.
fn spawn_connection<H, F>(
    builder: &auto::Builder<TokioExecutor>,
    graceful: &GracefulShutdown,
    (stream, peer, admitted): (TcpStream, SocketAddr, Admitted),
    (limits, metrics): (ConnLimits, &Arc<ConnectionMetrics>),
    handler: &Arc<H>,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let _ = stream.set_nodelay(true);
    let handler = Arc::clone(handler);
    let asked = Arc::new(AtomicBool::new(false));
    let service = {
        let asked = Arc::clone(&asked);
        service_fn(move |request: Request<Incoming>| {
            asked.store(true, Ordering::Relaxed);
            // See the module docs: hyper must see an unread body before the answer's head.
            let with_body = request.version() < http::Version::HTTP_2
                && !http_body::Body::is_end_stream(request.body());
            let response = handler(request, peer);
            async move {
                let response = response.await;
                if with_body {
                    tokio::task::yield_now().await;
                }
                Ok::<_, Infallible>(response)
            }
        })
    };
    let head = Arc::new(HeadStart::default());
    let stream = Linger::new(stream, admitted, limits.linger, Arc::clone(metrics));
    let stream = ChunkGuard::new(stream, limits.max_body_bytes, Arc::clone(&head));
    let stream = HeadGuard::new(stream, limits.max_header_bytes, limits.max_headers);
    let mut builder = builder.clone();
    builder.http1().timer(HeadTimer {
        head,
        keepalive: limits.keepalive_timeout,
        header_read: limits.header_read_timeout,
        metrics: Arc::clone(metrics),
    });
    let first_request = limits.header_read_timeout;
    let connection = builder
        .serve_connection(TokioIo::new(stream), service)
        .into_owned();
    let connection = graceful.watch(connection);
    let metrics = Arc::clone(metrics);
    tokio::spawn(async move {
        tokio::pin!(connection);
        let ended = tokio::select! {
            ended = &mut connection => ended,
            () = tokio::time::sleep(first_request) => {
                if !asked.load(Ordering::Relaxed) {
                    metrics.timed_out(ConnTimeout::HeaderRead);
                    debug!(message = "Connection closed: no request within header_read_timeout.", %peer);
                    return;
                }
                connection.await
            }
        };
        if let Err(error) = ended {
            debug!(message = "Connection ended with an error.", %error);
        }
    });
}

/// Lets the connections of `graceful` finish, at most `grace`.
async fn drain(name: &'static str, graceful: GracefulShutdown, grace: Duration) {
    tokio::select! {
        () = graceful.shutdown() => debug!(message = "Drained.", listener = name),
        () = tokio::time::sleep(grace) => warn!(
            message = "Shutdown grace period over; cutting remaining connections.",
            listener = name,
            ?grace,
        ),
    }
}

/// Accepts on `listener` and hands each connection to one of `workers` threads (see the
/// module docs) until `stop` is cancelled; then stops accepting and waits for every worker
/// to drain.
///
/// # Errors
/// When a worker thread or its runtime cannot be started.
pub(crate) async fn serve_sharded<H, F>(
    name: &'static str,
    listener: TcpListener,
    limits: ConnLimits,
    admission: Admission,
    stop: CancellationToken,
    handler: Arc<H>,
    workers: usize,
) -> std::io::Result<()>
where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let mut queues = Vec::with_capacity(workers);
    let mut finished = Vec::with_capacity(workers);
    for index in 0..workers.max(1) {
        // Unbounded is fine: the accept loop is the only sender and a worker takes a
        // connection as fast as it can register it; the kernel backlog bounds the rest.
        let (queue, mut incoming) =
            mpsc::unbounded_channel::<(std::net::TcpStream, SocketAddr, Admitted)>();
        let (done, finished_rx) = oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handler = Arc::clone(&handler);
        let metrics = Arc::clone(&admission.metrics);
        std::thread::Builder::new()
            .name(format!("cacheguard-w{index}"))
            .spawn(move || {
                crate::worker::set_index(index);
                runtime.block_on(async move {
                    let builder = connection_builder(limits);
                    let graceful = GracefulShutdown::new();
                    while let Some((stream, peer, admitted)) = incoming.recv().await {
                        match TcpStream::from_std(stream) {
                            Ok(stream) => spawn_connection(
                                &builder,
                                &graceful,
                                (stream, peer, admitted),
                                (limits, &metrics),
                                &handler,
                            ),
                            Err(error) => debug!(message = "Cannot adopt a connection.", %error),
                        }
                    }
                    drain(name, graceful, limits.shutdown_grace).await;
                });
                // Dropping the runtime here cancels what is left (cut connections' tasks).
                drop(runtime);
                let _ = done.send(());
            })?;
        queues.push(queue);
        finished.push(finished_rx);
    }

    let mut next = 0usize;
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(error) => {
                // Out of file descriptors and the like: back off instead of spinning.
                warn!(message = "Accept failed.", listener = name, %error);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Full: closed at once (dropped), counted.
        let Some(admitted) = admission.admit() else {
            continue;
        };
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        if queues[next % queues.len()]
            .send((stream, peer, admitted))
            .is_err()
        {
            warn!(
                message = "A proxy worker stopped unexpectedly.",
                listener = name
            );
        }
        next = next.wrapping_add(1);
    }
    // Stop accepting: new connections are refused from here on. Closing the queues tells
    // each worker to drain.
    drop(listener);
    drop(queues);
    for worker in finished {
        let _ = worker.await;
    }
    info!(message = "Drained.", listener = name);
    Ok(())
}

/// Serves `listener` with `handler` on the current runtime until `stop` is cancelled, then
/// drains.
pub(crate) async fn serve<H, F>(
    name: &'static str,
    listener: TcpListener,
    limits: ConnLimits,
    admission: Admission,
    stop: CancellationToken,
    handler: Arc<H>,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let builder = connection_builder(limits);
    let graceful = GracefulShutdown::new();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                if let Some(admitted) = admission.admit() {
                    spawn_connection(
                        &builder,
                        &graceful,
                        (stream, peer, admitted),
                        (limits, &admission.metrics),
                        &handler,
                    );
                }
            }
            Err(error) => {
                warn!(message = "Accept failed.", listener = name, %error);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    // Stop accepting: new connections are refused from here on.
    drop(listener);
    drain(name, graceful, limits.shutdown_grace).await;
}
