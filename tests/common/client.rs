//! HTTP client helpers: a keep-alive hyper-util legacy client, and a one-shot connection
//! client that sends headers exactly as given (for hop-by-hop tests).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

/// Upper bound on any one request made by a test.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

pub type TestBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A complete response.
#[derive(Clone, Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
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

    /// The `X-Cache` header, or `"<none>"`.
    pub fn x_cache(&self) -> String {
        self.header("x-cache").unwrap_or_else(|| "<none>".into())
    }

    pub fn is_hit(&self) -> bool {
        self.x_cache().starts_with("HIT")
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// `Age` in seconds, when present and numeric.
    pub fn age(&self) -> Option<u64> {
        self.header("age").and_then(|a| a.trim().parse().ok())
    }
}

impl std::fmt::Display for Resp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut body = self.text();
        if body.len() > 300 {
            body.truncate(300);
            body.push('…');
        }
        write!(
            f,
            "{} x-cache={} body={body:?}",
            self.status,
            self.x_cache()
        )
    }
}

pub fn empty_body() -> TestBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

pub fn full_body(bytes: impl Into<Bytes>) -> TestBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A request body fed chunk by chunk through the returned sender; ends when it is dropped.
pub fn channel_body() -> (mpsc::Sender<Bytes>, TestBody) {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, std::io::Error>(Frame::data(chunk)), rx))
    });
    (tx, StreamBody::new(stream).boxed_unsync())
}

/// Keep-alive client (hyper-util legacy).
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Client<HttpConnector, TestBody>,
}

impl Default for HttpClient {
    fn default() -> Self {
        HttpClient::new()
    }
}

impl HttpClient {
    pub fn new() -> HttpClient {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let inner = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        HttpClient { inner }
    }

    /// GET; panics on a transport error.
    pub async fn get(&self, url: &str) -> Resp {
        self.get_with_headers(url, &[]).await
    }

    /// GET with extra headers; panics on a transport error.
    pub async fn get_with_headers(&self, url: &str, headers: &[(&str, &str)]) -> Resp {
        self.request(Method::GET, url, headers, empty_body())
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"))
    }

    /// GET; transport errors returned.
    pub async fn try_get(&self, url: &str) -> Result<Resp, String> {
        self.request(Method::GET, url, &[], empty_body()).await
    }

    /// Any request, bounded by [`REQUEST_TIMEOUT`]; transport errors returned as text.
    pub async fn request(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: TestBody,
    ) -> Result<Resp, String> {
        let req = build_request(method, url, headers, body)?;
        let fut = async {
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| format!("request error: {e:?}"))?;
            collect(resp).await
        };
        tokio::time::timeout(REQUEST_TIMEOUT, fut)
            .await
            .map_err(|_| format!("timed out after {REQUEST_TIMEOUT:?}"))?
    }
}

fn build_request(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: TestBody,
) -> Result<Request<TestBody>, String> {
    let mut builder = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    builder.body(body).map_err(|e| format!("bad request: {e}"))
}

async fn collect(resp: http::Response<hyper::body::Incoming>) -> Result<Resp, String> {
    let (parts, body) = resp.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| format!("body error: {e:?}"))?
        .to_bytes();
    Ok(Resp {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// One request on a fresh HTTP/1.1 connection, headers sent exactly as given (no `Host`
/// added: pass it yourself). The connection is closed afterwards.
pub async fn raw_request(
    addr: SocketAddr,
    method: Method,
    path_and_query: &str,
    headers: &[(&str, &str)],
    body: TestBody,
) -> Result<Resp, String> {
    let fut = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let conn_task = tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(path_and_query)
            .body(body)
            .map_err(|e| format!("bad request: {e}"))?;
        for (k, v) in headers {
            req.headers_mut().append(
                HeaderName::from_bytes(k.as_bytes()).map_err(|e| e.to_string())?,
                HeaderValue::from_str(v).map_err(|e| e.to_string())?,
            );
        }
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("request error: {e:?}"))?;
        let out = collect(resp).await;
        conn_task.abort();
        out
    };
    tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .map_err(|_| format!("timed out after {REQUEST_TIMEOUT:?}"))?
}
