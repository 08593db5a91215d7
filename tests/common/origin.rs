//! `TestOrigin`: an in-process hyper 1.x HTTP/1.1 server standing in for the database-backed
//! API. It counts requests per path, tracks how many are in flight (and the high-water mark),
//! records the last request per path, and lets each test set per-path behaviour at runtime.
//!
//! Default answer to `GET /x`: `200` with body `{"path":"/x","n":N}` where `N` is the
//! per-path serial number of the request (1 for the first), so tests can tell fresh fetches
//! apart. `GET /internal/ids` answers the configured id list, one per line.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

/// What the origin does for one path. Unset fields fall back to the defaults.
#[derive(Clone, Debug, Default)]
pub struct Behaviour {
    pub delay: Option<Duration>,
    pub status: Option<u16>,
    pub body: Option<Bytes>,
    /// Extra response headers (appended, so repeated names are allowed).
    pub headers: Vec<(String, String)>,
    /// Answer with the request body (and the request's content-type).
    pub echo: bool,
}

/// One request as the origin saw it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub peer: SocketAddr,
}

impl RecordedRequest {
    /// Every value of `name`, joined with `, ` (None when absent).
    pub fn header(&self, name: &str) -> Option<String> {
        let values: Vec<&str> = self
            .headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap_or("<non-utf8>"))
            .collect();
        if values.is_empty() {
            None
        } else {
            Some(values.join(", "))
        }
    }
}

#[derive(Debug, Default)]
struct State {
    default_delay: Mutex<Duration>,
    behaviours: Mutex<HashMap<String, Behaviour>>,
    counts: Mutex<HashMap<String, u64>>,
    total: AtomicU64,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    last: Mutex<HashMap<String, RecordedRequest>>,
    /// Request body bytes received so far per path (updated frame by frame).
    body_bytes: Mutex<HashMap<String, u64>>,
    ids: Mutex<Vec<String>>,
}

/// Builder for [`TestOrigin`].
#[derive(Debug, Default)]
pub struct TestOriginBuilder {
    delay: Duration,
    ids: Vec<String>,
    behaviours: Vec<(String, Behaviour)>,
}

impl TestOriginBuilder {
    /// Delay before every answer (unless a path sets its own).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// The ids served by `GET /internal/ids`.
    pub fn ids<I, S>(mut self, ids: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.ids = ids.into_iter().map(Into::into).collect();
        self
    }

    /// Behaviour for one path, set before start.
    pub fn path(mut self, path: &str, behaviour: Behaviour) -> Self {
        self.behaviours.push((path.to_string(), behaviour));
        self
    }

    pub async fn start(self) -> TestOrigin {
        let state = Arc::new(State::default());
        *lock(&state.default_delay) = self.delay;
        *lock(&state.ids) = self.ids;
        lock(&state.behaviours).extend(self.behaviours);

        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind test origin");
        let addr = listener.local_addr().expect("origin local addr");
        let accept_state = state.clone();
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, peer)) = accepted else { continue };
                        let _ = stream.set_nodelay(true);
                        let state = accept_state.clone();
                        connections.spawn(async move {
                            let service = service_fn(move |req| {
                                let state = state.clone();
                                async move { Ok::<_, Infallible>(handle(state, peer, req).await) }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        TestOrigin { addr, state, task }
    }
}

/// The fake origin. Stops (listener and every connection) on `Drop`.
#[derive(Debug)]
pub struct TestOrigin {
    addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Drop for TestOrigin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl TestOrigin {
    pub fn builder() -> TestOriginBuilder {
        TestOriginBuilder::default()
    }

    /// An origin with default behaviour and no delay.
    pub async fn start() -> TestOrigin {
        TestOrigin::builder().start().await
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests received for `path` (query ignored).
    pub fn count(&self, path: &str) -> u64 {
        lock(&self.state.counts).get(path).copied().unwrap_or(0)
    }

    /// Requests received, all paths.
    pub fn total(&self) -> u64 {
        self.state.total.load(Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> usize {
        self.state.in_flight.load(Ordering::SeqCst)
    }

    /// Highest number of requests ever in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// The last request received for `path`.
    pub fn last_request(&self, path: &str) -> Option<RecordedRequest> {
        lock(&self.state.last).get(path).cloned()
    }

    /// Request body bytes received so far for `path` (grows while a body streams in).
    pub fn body_bytes_received(&self, path: &str) -> u64 {
        lock(&self.state.body_bytes).get(path).copied().unwrap_or(0)
    }

    fn update(&self, path: &str, f: impl FnOnce(&mut Behaviour)) {
        f(lock(&self.state.behaviours)
            .entry(path.to_string())
            .or_default());
    }

    pub fn set_default_delay(&self, delay: Duration) {
        *lock(&self.state.default_delay) = delay;
    }

    pub fn set_delay(&self, path: &str, delay: Duration) {
        self.update(path, |b| b.delay = Some(delay));
    }

    pub fn set_status(&self, path: &str, status: u16) {
        self.update(path, |b| b.status = Some(status));
    }

    pub fn set_body(&self, path: &str, body: impl Into<Bytes>) {
        let body = body.into();
        self.update(path, |b| b.body = Some(body));
    }

    /// Replaces the extra response headers for `path`.
    pub fn set_headers<'a, I>(&self, path: &str, headers: I)
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
    {
        let headers: Vec<(String, String)> = headers
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.update(path, |b| b.headers = headers);
    }

    /// Answer requests to `path` with their own body.
    pub fn set_echo(&self, path: &str) {
        self.update(path, |b| b.echo = true);
    }

    /// Back to the default behaviour for `path`.
    pub fn reset(&self, path: &str) {
        lock(&self.state.behaviours).remove(path);
    }

    pub fn set_ids<I, S>(&self, ids: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        *lock(&self.state.ids) = ids.into_iter().map(Into::into).collect();
    }
}

/// The default body for the `n`th request to `path`.
pub fn default_body(path: &str, n: u64) -> String {
    format!(r#"{{"path":"{path}","n":{n}}}"#)
}

struct InFlight(Arc<State>);

impl InFlight {
    fn enter(state: Arc<State>) -> InFlight {
        let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        state.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn handle(
    state: Arc<State>,
    peer: SocketAddr,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let _guard = InFlight::enter(state.clone());
    let path = req.uri().path().to_string();
    state.total.fetch_add(1, Ordering::SeqCst);
    let n = {
        let mut counts = lock(&state.counts);
        let c = counts.entry(path.clone()).or_insert(0);
        *c += 1;
        *c
    };
    let behaviour = lock(&state.behaviours)
        .get(&path)
        .cloned()
        .unwrap_or_default();
    let default_delay = *lock(&state.default_delay);

    let (parts, mut body) = req.into_parts();
    let mut received = BytesMut::new();
    lock(&state.body_bytes).insert(path.clone(), 0);
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        if let Ok(data) = frame.into_data() {
            received.extend_from_slice(&data);
            lock(&state.body_bytes).insert(path.clone(), received.len() as u64);
        }
    }
    let received = received.freeze();
    lock(&state.last).insert(
        path.clone(),
        RecordedRequest {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers: parts.headers.clone(),
            body: received.clone(),
            peer,
        },
    );

    let delay = behaviour.delay.unwrap_or(default_delay);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }

    let status = StatusCode::from_u16(behaviour.status.unwrap_or(200)).expect("valid status");
    let (body, content_type) = if behaviour.echo {
        let ct = parts
            .headers
            .get(http::header::CONTENT_TYPE)
            .cloned()
            .unwrap_or(HeaderValue::from_static("application/octet-stream"));
        (received, ct)
    } else if let Some(body) = behaviour.body {
        (body, HeaderValue::from_static("application/json"))
    } else if path == "/internal/ids" {
        let ids = lock(&state.ids).join("\n");
        (Bytes::from(ids), HeaderValue::from_static("text/plain"))
    } else {
        (
            Bytes::from(default_body(&path, n)),
            HeaderValue::from_static("application/json"),
        )
    };
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(http::header::CONTENT_TYPE, content_type);
    for (k, v) in &behaviour.headers {
        let name = HeaderName::from_bytes(k.as_bytes()).expect("header name");
        let value = HeaderValue::from_str(v).expect("header value");
        resp.headers_mut().append(name, value);
    }
    resp
}
