//! HTTP client helpers: a keep-alive hyper-util legacy client, and a one-shot connection
//! client that sends headers exactly as given (for hop-by-hop tests).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Every value of header `name` in `headers`, joined with `", "`; `None` when absent.
pub fn header_values(headers: &HeaderMap, name: &str) -> Option<String> {
    let values: Vec<&str> = headers
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
    /// Every value of header `name`, joined with `", "` (see [`header_values`]).
    pub fn header(&self, name: &str) -> Option<String> {
        header_values(&self.headers, name)
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

    /// [`HttpClient::try_get`] in a task of its own, started now.
    pub fn spawn_get(&self, url: &str) -> JoinHandle<Result<Resp, String>> {
        let client = self.clone();
        let url = url.to_owned();
        tokio::spawn(async move { client.try_get(&url).await })
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
        within(REQUEST_TIMEOUT, async {
            let resp = self
                .inner
                .request(req)
                .await
                .map_err(|e| format!("request error: {e:?}"))?;
            collect(resp).await
        })
        .await
    }

    /// Whether `GET url` answers 200 within `timeout` (a transport error or no answer in
    /// time: false).
    pub async fn answers_200(&self, url: &str, timeout: Duration) -> bool {
        let answer = tokio::time::timeout(timeout, self.try_get(url)).await;
        matches!(answer, Ok(Ok(resp)) if resp.status == 200)
    }
}

/// A request with `headers` added as given.
pub fn build_request(
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

/// Reads a response's whole body into a [`Resp`].
pub async fn collect(resp: http::Response<hyper::body::Incoming>) -> Result<Resp, String> {
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
    raw_request_from(None, addr, method, path_and_query, headers, body).await
}

/// [`raw_request`] from the local address `from` (another loopback address, to play a
/// second client), or any when `None`.
pub async fn raw_request_from(
    from: Option<std::net::IpAddr>,
    addr: SocketAddr,
    method: Method,
    path_and_query: &str,
    headers: &[(&str, &str)],
    body: TestBody,
) -> Result<Resp, String> {
    within(REQUEST_TIMEOUT, async {
        let stream = match from {
            None => TcpStream::connect(addr).await,
            Some(ip) => {
                let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
                socket
                    .bind(SocketAddr::new(ip, 0))
                    .map_err(|e| format!("bind {ip}: {e}"))?;
                socket.connect(addr).await
            }
        }
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
    })
    .await
}

/// `fut` bounded by `timeout`; running out of time is an error too.
pub async fn within<T>(
    timeout: Duration,
    fut: impl Future<Output = Result<T, String>>,
) -> Result<T, String> {
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| format!("timed out after {timeout:?}"))?
}

// === raw HTTP/1.1 framing, for pipelined clients ===

/// One response as [`parse_response`] read it off a byte stream.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Names lower-cased, in the order received.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

impl RawResponse {
    /// The first value of header `name` (lower-case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The `X-Cache` header, or `"<none>"`.
    pub fn x_cache(&self) -> String {
        self.header("x-cache").unwrap_or("<none>").to_owned()
    }
}

/// Takes one complete HTTP/1.1 response off the front of `buf` (`None`: need more bytes).
/// Header names are lower-cased. Bodies: `content-length` or `chunked`.
pub fn parse_response(buf: &mut BytesMut) -> Result<Option<RawResponse>, String> {
    let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|e| format!("head: {e}"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut response = RawResponse {
        status,
        headers,
        body: Bytes::new(),
    };
    let body_start = head_end + 4;
    if let Some(len) = response.header("content-length") {
        let len: usize = len.parse().map_err(|_| format!("content-length {len:?}"))?;
        if buf.len() < body_start + len {
            return Ok(None);
        }
        let mut frame = buf.split_to(body_start + len);
        response.body = frame.split_off(body_start).freeze();
        return Ok(Some(response));
    }
    if response
        .header("transfer-encoding")
        .is_some_and(|te| te.eq_ignore_ascii_case("chunked"))
    {
        let mut at = body_start;
        let mut body = BytesMut::new();
        loop {
            let Some(eol) = buf[at..].windows(2).position(|w| w == b"\r\n") else {
                return Ok(None);
            };
            let size_text = std::str::from_utf8(&buf[at..at + eol]).map_err(|e| e.to_string())?;
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| format!("chunk size {size_text:?}"))?;
            at += eol + 2;
            if size == 0 {
                // Trailers (none expected) end with an empty line.
                let Some(end) = buf[at..].windows(2).position(|w| w == b"\r\n") else {
                    return Ok(None);
                };
                if end != 0 {
                    return Err("trailers are not supported".into());
                }
                let _ = buf.split_to(at + 2);
                response.body = body.freeze();
                return Ok(Some(response));
            }
            if buf.len() < at + size + 2 {
                return Ok(None);
            }
            body.extend_from_slice(&buf[at..at + size]);
            at += size + 2;
        }
    }
    // No body framing: only valid for answers without a body.
    let _ = buf.split_to(body_start);
    Ok(Some(response))
}

/// Sends `bytes` exactly as given on a new connection and returns the answer's head as
/// text — what came back up to the blank line within `wait`, or what there was when the
/// connection closed. With `close`, the client half-closes after writing.
pub async fn raw_bytes(addr: SocketAddr, bytes: &[u8], wait: Duration, close: bool) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    // The server may answer and close before all is written (a refused head).
    let _ = stream.write_all(bytes).await;
    if close {
        let _ = stream.shutdown().await;
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(wait, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    out.extend_from_slice(&buf[..n]);
                    if out.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            }
        }
    })
    .await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `bytes` exactly as given on a new connection and reads until the server closes it
/// (or `wait` passes): everything that came back, and whether the connection was closed.
pub async fn raw_until_closed(addr: SocketAddr, bytes: &[u8], wait: Duration) -> (String, bool) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    // The server may answer and close before all is written (a refused head).
    let _ = stream.write_all(bytes).await;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(wait, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

/// The status code of a raw answer's status line (0 when there is none).
pub fn status_of(answer: &str) -> u16 {
    answer
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

/// A client that sends `GET path` on a new connection and never reads the answer, through a
/// 16 KiB receive buffer: what it has not read stays in the server (a large body held for
/// it) for as long as the returned stream lives.
pub async fn stalled_get(addr: SocketAddr, path: &str) -> TcpStream {
    use tokio::io::AsyncWriteExt;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(16 * 1024).expect("SO_RCVBUF");
    let mut stream = socket.connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: cacheguard\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    stream
}
