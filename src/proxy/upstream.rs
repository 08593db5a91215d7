//! The pooled HTTP client to the origin.
//!
//! Each proxy worker thread keeps its own pool of origin connections, as nginx keeps a
//! worker's upstream keep-alive connections in that worker. hyper-util's client opens a
//! connection in the future of the request that needs it (or in a task that request
//! spawns to finish it) and spawns the connection's task from there (`TokioExecutor`:
//! `tokio::spawn`), so a connection a worker opened is driven by that worker's
//! single-threaded event loop for its whole life. Taken from a pool shared by every worker,
//! it would carry other workers' requests too, each of which then wakes the opening worker
//! to write and read it, and is woken back with the answer. [`Upstream`] therefore holds
//! one pool per worker and uses the calling thread's ([`worker::index`]): a cached fetch
//! (a miss, a revalidation, a background refresh), a write and a pass-through all run on
//! the worker that took the client's connection (a fill in a task spawned there). Threads
//! that are no proxy worker — the warm-up, on the main runtime, and the fills it starts —
//! share one more pool, whose connections that runtime drives. `upstream.pool_max_idle`
//! is divided among the workers' pools, rounded up (`idle_per_pool`); the shared pool
//! keeps as many as one of them. The retry client (`fresh`) keeps no pool: its connection
//! is opened on the calling thread, used once and closed. What still crosses threads is
//! counted (`cacheguard_origin_requests_off_worker_total`): requests sent from no worker,
//! and requests sent on a connection another thread opened (`OpenedOn`), which the pools
//! keep at 0.
//!
//! `upstream.timeout` bounds the wait for an answer. A request with a body (a write, a
//! pass-through upload) starts that wait once the body has been sent. While it is sent,
//! the client's pace is bounded by the body itself (`upload.rs`, 408), and the origin's
//! here: an origin that takes no piece of the body for `upstream.upload_timeout` while
//! one is ready for it (it stopped reading) is a 504, so a spooled body forwarded to a
//! stuck origin cannot hold its file and connection for ever.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, Uri};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::LengthLimitError;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{
    Connected, Connection, HttpConnector, capture_connection,
};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::access_log;
use super::spool::SpoolReadError;
use super::upload::{self, UploadBounds};
use crate::config::UpstreamConfig;
use crate::error::ProxyError;
use crate::metrics::OffWorkerMetrics;
use crate::worker;

pub(crate) use super::upload::BoxError;
/// Request bodies sent upstream: empty for cached fetches, the client's (limited) body for
/// pass-through.
pub(crate) type UpstreamBody = BoxBody<Bytes, BoxError>;

/// The origin client: one pool per proxy worker, one for the other threads, and the retry
/// client. Cheap to clone: the clones share the pools.
#[derive(Clone, Debug)]
pub(crate) struct Upstream {
    /// Proxy worker `i`'s pool is `workers[i]`: used only on that worker's thread.
    workers: Arc<[Client<Connector, UpstreamBody>]>,
    /// The pool of every thread that is no proxy worker.
    shared: Client<Connector, UpstreamBody>,
    /// Without a pool: a retry after a pooled connection failed must not take another
    /// pooled connection, which may be just as dead.
    fresh: Client<Connector, UpstreamBody>,
    off_worker: OffWorkerMetrics,
    scheme_authority: String,
    /// Path prefix of `upstream.url`, without a trailing slash ("" for none).
    prefix: String,
    authority: HeaderValue,
    pub(crate) timeout: Duration,
    upload: UploadBounds,
}

impl Upstream {
    /// The client for `workers` proxy worker threads (`upstream.pool_max_idle` is divided
    /// among them: see [`idle_per_pool`]).
    pub(crate) fn new(
        config: &UpstreamConfig,
        workers: usize,
        off_worker: OffWorkerMetrics,
    ) -> anyhow::Result<Self> {
        let authority = config
            .url
            .authority()
            .ok_or_else(|| anyhow::anyhow!("upstream.url has no host"))?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let connector = Connector(connector);
        let idle = idle_per_pool(config.pool_max_idle, workers);
        let pool = || {
            Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(idle)
                .pool_idle_timeout(config.pool_idle_timeout)
                .pool_timer(TokioTimer::new())
                .build(connector.clone())
        };
        let fresh = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector.clone());
        Ok(Upstream {
            workers: (0..workers.max(1)).map(|_| pool()).collect(),
            shared: pool(),
            fresh,
            off_worker,
            scheme_authority: format!("http://{authority}"),
            prefix: config.url.path().trim_end_matches('/').to_owned(),
            authority: HeaderValue::from_str(authority.as_str())?,
            timeout: config.timeout,
            upload: UploadBounds::of(config),
        })
    }

    /// The proxy worker threads this client has a pool for.
    pub(crate) fn workers(&self) -> usize {
        self.workers.len()
    }

    /// The pool of the calling thread: its own on a proxy worker, the shared one elsewhere.
    fn pool(&self) -> &Client<Connector, UpstreamBody> {
        worker::index()
            .checked_sub(1)
            .and_then(|index| self.workers.get(index))
            .unwrap_or(&self.shared)
    }

    /// The origin URI for a client path-and-query.
    pub(crate) fn uri(&self, path_and_query: &str) -> Result<Uri, ProxyError> {
        format!("{}{}{}", self.scheme_authority, self.prefix, path_and_query)
            .parse()
            .map_err(|_| ProxyError::BadRequest("request target cannot be forwarded"))
    }

    /// The time bounds of a client's request body (`upload_timeout`, `upload_min_rate`,
    /// `upload_deadline`).
    pub(crate) fn upload_bounds(&self) -> UploadBounds {
        self.upload
    }

    /// The origin's `host:port`, used as `Host` on cached fetches.
    pub(crate) fn authority(&self) -> &HeaderValue {
        &self.authority
    }

    /// Sends the request `make` builds, an idempotent one without a body, waiting at most
    /// `upstream.timeout` in all for the response head. When the connection fails after the
    /// request was written but before any byte of an answer (a pooled keep-alive connection
    /// the origin or a middlebox dropped), it is sent once more on a new connection, as
    /// RFC 9110 §9.2.2 allows for idempotent methods. Returns whether it was retried. The
    /// time waited goes to the request's access-log line ([`access_log::origin_waited`]).
    ///
    /// # Errors
    /// As [`Upstream::send`].
    pub(crate) async fn send_idempotent(
        &self,
        make: impl Fn() -> Result<Request<UpstreamBody>, ProxyError>,
    ) -> Result<(Response<Incoming>, bool), ProxyError> {
        let started = Instant::now();
        let result = self.exchange_idempotent(make).await;
        access_log::origin_waited(started.elapsed());
        result
    }

    /// [`Upstream::send_idempotent`]'s exchange, retry included.
    async fn exchange_idempotent(
        &self,
        make: impl Fn() -> Result<Request<UpstreamBody>, ProxyError>,
    ) -> Result<(Response<Incoming>, bool), ProxyError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let first =
            tokio::time::timeout_at(deadline, exchange(self.pool(), make()?, &self.off_worker))
                .await;
        match first {
            Err(_) => Err(ProxyError::OriginTimeout(self.timeout)),
            Ok(Ok(response)) => Ok((response, false)),
            Ok(Err(Failed::Client(error))) if unanswered(&error) => {
                match tokio::time::timeout_at(
                    deadline,
                    exchange(&self.fresh, make()?, &self.off_worker),
                )
                .await
                {
                    Err(_) => Err(ProxyError::OriginTimeout(self.timeout)),
                    Ok(Ok(response)) => Ok((response, true)),
                    Ok(Err(failed)) => Err(failed.into()),
                }
            }
            Ok(Err(failed)) => Err(failed.into()),
        }
    }

    /// Sends `request`, waiting at most `upstream.timeout` for the response head once its
    /// body (if any) is sent; while it is sent, the origin must take each piece of the body
    /// within `upstream.upload_timeout` of its being ready (checked every
    /// `upload_timeout`, so an origin that stopped reading is found within twice that).
    /// The time waited once the body was sent goes to the request's access-log line
    /// ([`access_log::origin_waited`]).
    ///
    /// # Errors
    /// Timeout (or an origin that stopped taking the body) → 504; connection failures and
    /// answers refused for their framing → 502; the client's body: a broken time bound →
    /// 408, over the limit → 413, broken framing → 400; a spooled body that cannot be read
    /// back → 503.
    pub(crate) async fn send(
        &self,
        mut request: Request<UpstreamBody>,
    ) -> Result<Response<Incoming>, ProxyError> {
        let mut started = Instant::now();
        let result = if request.body().is_end_stream() {
            tokio::time::timeout(
                self.timeout,
                exchange(self.pool(), request, &self.off_worker),
            )
            .await
        } else {
            let (sent, uploaded) = oneshot::channel();
            let taken = Arc::new(Taken::new());
            let body = std::mem::take(request.body_mut());
            *request.body_mut() = BoxBody::new(Upload {
                inner: body,
                sent: Some(sent),
                taken: Arc::clone(&taken),
            });
            let response = exchange(self.pool(), request, &self.off_worker);
            tokio::pin!(response);
            let idle = self.upload.idle;
            let answered = tokio::select! {
                result = &mut response => Some(result),
                // Sent whole (or dropped by the client after an error it reports itself).
                _ = uploaded => None,
                () = taken.origin_stalled(idle) => {
                    access_log::origin_waited(started.elapsed());
                    return Err(ProxyError::OriginTimeout(idle));
                }
            };
            match answered {
                Some(result) => Ok(result),
                None => {
                    // The origin's time starts once the body is sent: until then the
                    // client's upload is what is waited for.
                    started = Instant::now();
                    tokio::time::timeout(self.timeout, response).await
                }
            }
        };
        access_log::origin_waited(started.elapsed());
        match result {
            Err(_) => Err(ProxyError::OriginTimeout(self.timeout)),
            Ok(result) => result.map_err(Into::into),
        }
    }
}

/// The idle connections each pool keeps: `upstream.pool_max_idle` divided among the
/// `workers`, rounded up. Divided, so the origin sees about as many idle connections as
/// its operator sized it for, whatever `server.worker_threads` is; rounded up, so a value
/// below the worker count still keeps one per worker rather than none.
fn idle_per_pool(pool_max_idle: usize, workers: usize) -> usize {
    pool_max_idle.div_ceil(workers.max(1))
}

/// The most informational (1xx) answers taken before the final one: a few `100 Continue`
/// and `103 Early Hints` are normal; an origin that keeps sending them is not answering.
const MAX_INFORMATIONAL: usize = 16;

/// Why an exchange with the origin failed.
enum Failed {
    /// The client failed: connection, protocol, the request body.
    Client(hyper_util::client::legacy::Error),
    /// The origin's answer was refused.
    Refused(&'static str),
}

impl From<Failed> for ProxyError {
    fn from(failed: Failed) -> Self {
        match failed {
            Failed::Client(error) => classify(&error),
            Failed::Refused(why) => ProxyError::OriginConnect(why.to_owned()),
        }
    }
}

/// One request on `client`, its answer checked: more than [`MAX_INFORMATIONAL`] 1xx answers
/// before the final one, or a final one whose framing cannot be trusted, is refused: both
/// `Content-Length` and `Transfer-Encoding` (RFC 9112 §6.3: a sign of request smuggling or
/// a broken origin). A `Transfer-Encoding` whose last coding is not `chunked` is no fault in
/// an answer (RFC 9112 §6.3 (3), unlike in a request): its body runs to the connection's
/// close, which hyper reads to the end and never reuses.
///
/// The connection of a refused answer never carries another request: the origin and
/// cacheguard may disagree on where that answer ends, so what it reads next could be the
/// rest of this one. Dropping the answer is not enough: hyper drains a body that is already
/// in its buffer and then hands the connection back to the pool as sound. It is poisoned
/// instead (`Connected::poison`, through [`capture_connection`]), which keeps the pool from
/// handing it out again, and is closed once hyper lets it go. Framing hyper refuses itself
/// (two different `Content-Length` values, a bad chunk size, a body cut short, bytes past
/// the end) already ends the connection in hyper.
///
/// A request sent from a thread that is no proxy worker, or on a connection another thread
/// opened, is counted in `off_worker` (see the module docs).
async fn exchange(
    client: &Client<Connector, UpstreamBody>,
    mut request: Request<UpstreamBody>,
    off_worker: &OffWorkerMetrics,
) -> Result<Response<Incoming>, Failed> {
    let sender = worker::index();
    if sender == 0 {
        off_worker.not_a_worker.inc();
    }
    let connection = capture_connection(&mut request);
    let refuse = |why: &'static str| {
        if let Some(connected) = connection.connection_metadata().as_ref() {
            connected.poison();
        }
        Failed::Refused(why)
    };
    let flood = Arc::new(Informational::default());
    let seen = Arc::clone(&flood);
    hyper::ext::on_informational(&mut request, move |_| {
        if seen.count.fetch_add(1, Ordering::Relaxed) + 1 > MAX_INFORMATIONAL {
            seen.too_many.notify_one();
        }
    });
    let too_many = "more than 16 informational (1xx) answers";
    let response = tokio::select! {
        biased;
        () = flood.too_many.notified() => return Err(refuse(too_many)),
        response = client.request(request) => response,
    };
    // The thread whose event loop drives the connection (hyper sets the connector's
    // extras on the answer; a failed exchange has only the captured connection's).
    let opened = match &response {
        Ok(response) => response.extensions().get::<OpenedOn>().copied(),
        Err(_) => connection
            .connection_metadata()
            .as_ref()
            .and_then(|connected| {
                let mut extras = http::Extensions::new();
                connected.get_extras(&mut extras);
                extras.get::<OpenedOn>().copied()
            }),
    };
    if sender != 0 && opened.is_some_and(|OpenedOn(on)| on != sender) {
        off_worker.other_worker.inc();
    }
    let response = response.map_err(Failed::Client)?;
    // The flood and the final answer may have come in one read.
    if flood.count.load(Ordering::Relaxed) > MAX_INFORMATIONAL {
        return Err(refuse(too_many));
    }
    let headers = response.headers();
    if headers.contains_key(header::TRANSFER_ENCODING)
        && headers.contains_key(header::CONTENT_LENGTH)
    {
        return Err(refuse(
            "an answer with both Content-Length and Transfer-Encoding",
        ));
    }
    Ok(response)
}

/// The thread that opened an origin connection, as [`worker::index`] (0: no proxy worker),
/// carried in the connection's extras. hyper-util's client opens a connection in the
/// future of the request that asked for it (or, when an idle one came back first, in a task
/// that request spawns to finish it), and spawns the connection's task from there
/// (`TokioExecutor`: `tokio::spawn`): on a worker's single-threaded runtime, the thread
/// that opened a connection is the one whose event loop drives it for its whole life.
#[derive(Clone, Copy, Debug)]
struct OpenedOn(usize);

/// hyper-util's TCP connector, its connections marked with the thread that opened them
/// ([`OpenedOn`]). A connector of its own because hyper-util has no other place to attach
/// data to a pooled connection: its extras come from the transport's [`Connection`].
#[derive(Clone, Debug)]
struct Connector(HttpConnector);

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<Opened>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let on = worker::index();
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let stream = connecting.await?.into_inner();
            Ok(TokioIo::new(Opened { stream, on }))
        })
    }
}

/// An origin connection's socket, with the thread that opened it.
#[derive(Debug)]
struct Opened {
    stream: TcpStream,
    on: usize,
}

impl Connection for Opened {
    fn connected(&self) -> Connected {
        self.stream.connected().extra(OpenedOn(self.on))
    }
}

impl AsyncRead for Opened {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Opened {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// The informational answers of one exchange so far.
#[derive(Default)]
struct Informational {
    count: AtomicUsize,
    too_many: tokio::sync::Notify,
}

/// A request body on its way to the origin: says when it has been sent whole, and notes
/// in [`Taken`] when the origin took each piece.
struct Upload {
    inner: UpstreamBody,
    sent: Option<oneshot::Sender<()>>,
    taken: Arc<Taken>,
}

/// When the origin last took a piece of a body, and whether the body is now waiting for
/// its own source (the client, or its spool file) rather than for the origin.
#[derive(Debug)]
struct Taken {
    /// A std `Mutex`: held for one read or write, never across an `.await`.
    state: Mutex<(tokio::time::Instant, bool)>,
}

impl Taken {
    fn new() -> Self {
        Taken {
            state: Mutex::new((tokio::time::Instant::now(), false)),
        }
    }

    fn set(&self, waiting_for_source: bool) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if waiting_for_source {
            state.1 = true;
        } else {
            *state = (tokio::time::Instant::now(), false);
        }
    }

    /// Resolves once a piece of the body has waited `idle` for the origin to take it.
    /// While the body waits for its own source, its own bounds apply: looked at again
    /// every `idle`.
    async fn origin_stalled(&self, idle: Duration) {
        loop {
            let (taken, waiting_for_source) =
                *self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if waiting_for_source {
                tokio::time::sleep(idle).await;
                continue;
            }
            let due = taken + idle;
            if tokio::time::Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

/// An error of the client's request body itself (a broken chunk, a connection cut, a
/// broken time bound): the client's fault, not the origin's (see
/// [`upload::client_body_error`]).
#[derive(Debug, thiserror::Error)]
#[error("client request body: {0}")]
pub(crate) struct ClientBodyError(pub(crate) BoxError);

impl HttpBody for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                // Handed to the origin's connection: the origin has the next move.
                this.taken.set(false);
                if this.inner.is_end_stream() {
                    this.done();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.done();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(error))),
            Poll::Pending => {
                this.taken.set(true);
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Upload {
    fn done(&mut self) {
        if let Some(sent) = self.sent.take() {
            let _ = sent.send(());
        }
    }
}

/// Whether a request failed on an established connection before any byte of an answer:
/// the connection was closed or reset under it (not a refused or timed-out connect, which
/// a new attempt would meet again at once).
fn unanswered(error: &hyper_util::client::legacy::Error) -> bool {
    if error.is_connect() {
        return false;
    }
    let mut source: Option<&(dyn StdError + 'static)> = error.source();
    while let Some(cause) = source {
        if let Some(hyper) = cause.downcast_ref::<hyper::Error>()
            && (hyper.is_incomplete_message() || hyper.is_canceled())
        {
            return true;
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            )
        {
            return true;
        }
        source = cause.source();
    }
    false
}

fn classify(error: &hyper_util::client::legacy::Error) -> ProxyError {
    let mut source: Option<&(dyn StdError + 'static)> = error.source();
    while let Some(cause) = source {
        if cause.downcast_ref::<LengthLimitError>().is_some() {
            return ProxyError::BodyTooLarge(0);
        }
        if let Some(ClientBodyError(error)) = cause.downcast_ref::<ClientBodyError>() {
            return upload::client_body_error(error.as_ref());
        }
        if let Some(SpoolReadError(error)) = cause.downcast_ref::<SpoolReadError>() {
            return ProxyError::BodySpool(error.to_string());
        }
        source = cause.source();
    }
    // The whole chain, for the log line: "client error (Connect): tcp connect error:
    // Connection refused (os error 111)", "… connection closed before message completed".
    let mut detail = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        detail.push_str(": ");
        detail.push_str(&cause.to_string());
        source = cause.source();
    }
    ProxyError::OriginConnect(detail)
}

#[cfg(test)]
mod tests {
    use super::idle_per_pool;

    #[test]
    fn pool_max_idle_is_divided_among_the_workers_rounded_up() {
        assert_eq!(idle_per_pool(64, 2), 32);
        assert_eq!(idle_per_pool(64, 3), 22);
        assert_eq!(idle_per_pool(64, 1), 64);
        // Fewer than the workers: one each, not none.
        assert_eq!(idle_per_pool(1, 4), 1);
        // 0 keeps none anywhere.
        assert_eq!(idle_per_pool(0, 4), 0);
        assert_eq!(idle_per_pool(8, 0), 8);
    }
}
