//! The accept loop: HTTP/1.1 and h2c (prior knowledge) on one listener, header limits and
//! read timeouts, and graceful shutdown (stop accepting, drain in-flight requests within
//! the grace period, then cut what is left).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::body::Body;

/// Limits applied by the HTTP layer itself.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnLimits {
    pub(crate) max_header_bytes: usize,
    pub(crate) header_read_timeout: Duration,
    pub(crate) shutdown_grace: Duration,
}

/// Serves `listener` with `handler` until `stop` is cancelled, then drains.
pub(crate) async fn serve<H, F>(
    name: &'static str,
    listener: TcpListener,
    limits: ConnLimits,
    stop: CancellationToken,
    handler: Arc<H>,
) where
    H: Fn(Request<Incoming>, std::net::SocketAddr) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        // hyper's own head limit is a backstop (it answers 431 without a body); the
        // configured limit is checked per request with a clear body. Twice the configured
        // size leaves room for request-line and framing overhead.
        .max_buf_size((limits.max_header_bytes * 2).max(8192) + 1024)
        .header_read_timeout(limits.header_read_timeout)
        .timer(TokioTimer::new());
    builder
        .http2()
        .max_header_list_size(u32::try_from(limits.max_header_bytes * 2).unwrap_or(u32::MAX))
        .timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();

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
        let _ = stream.set_nodelay(true);
        let handler = Arc::clone(&handler);
        let service = service_fn(move |request| {
            let response = handler(request, peer);
            async move { Ok::<_, Infallible>(response.await) }
        });
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                debug!(message = "Connection ended with an error.", %error);
            }
        });
    }

    // Stop accepting: new connections are refused from here on.
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => info!(message = "Drained.", listener = name),
        () = tokio::time::sleep(limits.shutdown_grace) => warn!(
            message = "Shutdown grace period over; cutting remaining connections.",
            listener = name,
            grace = ?limits.shutdown_grace,
        ),
    }
}
