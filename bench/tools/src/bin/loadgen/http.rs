//! HTTP/1.1 plumbing shared by every mode: targets, connections, requests and their outcome.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::header::{HOST, USER_AGENT};
use hyper::{Method, Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// A request body: empty for a GET (hyper sends no Content-Length then), or whole bytes.
pub type Body = Full<Bytes>;

/// The sending half of one keep-alive connection.
pub type Sender = http1::SendRequest<Body>;

pub struct Target {
    pub url: String,
    pub addr: SocketAddr,
    pub authority: String,
    pub path: String,
}

pub fn parse_target(url: &str) -> Result<Target, String> {
    let uri: Uri = url.parse().map_err(|e| format!("bad url {url}: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("only http:// urls are supported: {url}"));
    }
    let authority = uri.authority().ok_or_else(|| format!("no host in {url}"))?;
    let host = authority.host();
    let port = authority.port_u16().unwrap_or(80);
    let ip: std::net::IpAddr = host
        .parse()
        .map_err(|_| format!("host must be an IP address (e.g. 127.0.0.1): {url}"))?;
    Ok(Target {
        url: url.to_owned(),
        addr: SocketAddr::new(ip, port),
        authority: authority.as_str().to_owned(),
        path: uri.path_and_query().map_or("/", |p| p.as_str()).to_owned(),
    })
}

pub fn parse_targets(urls: &[String]) -> Result<Vec<Target>, String> {
    urls.iter().map(|u| parse_target(u)).collect()
}

/// A URL template with `{id}` in its path: the target (for the address) and the path with
/// `{id}` still in it.
pub fn parse_template(url: &str) -> Result<(Target, String), String> {
    if !url.contains("{id}") {
        return Err(format!("--url must contain {{id}}: {url}"));
    }
    let target = parse_target(&url.replace("{id}", "0"))?;
    let template = url
        .find(&target.authority)
        .map(|i| url[i + target.authority.len()..].to_owned())
        .filter(|p| p.contains("{id}"))
        .ok_or_else(|| format!("{{id}} must be in the path of --url: {url}"))?;
    Ok((target, template))
}

pub fn x_cache_of<B>(resp: &hyper::Response<B>) -> String {
    resp.headers()
        .get("x-cache")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_else(|| "(none)".to_owned())
}

fn request(method: Method, t: &Target, path: &str) -> hyper::http::request::Builder {
    Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, t.authority.as_str())
        .header(USER_AGENT, "cacheguard-bench-loadgen")
}

pub fn get(t: &Target, path: &str) -> Request<Body> {
    request(Method::GET, t, path)
        .body(Body::default())
        .expect("valid request")
}

/// A POST of `body` (JSON) to `path`.
pub fn post(t: &Target, path: &str, body: Bytes) -> Request<Body> {
    request(Method::POST, t, path)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Body::new(body))
        .expect("valid request")
}

/// A JSON object of exactly `n` bytes (at least 14): `{"payload":"xx…x"}`, the body of
/// bench/post_body.lua too.
pub fn json_body(n: usize) -> Result<Bytes, String> {
    const HEAD: &str = "{\"payload\":\"";
    const TAIL: &str = "\"}";
    let pad = n.checked_sub(HEAD.len() + TAIL.len()).ok_or_else(|| {
        format!(
            "a JSON body takes at least {} bytes",
            HEAD.len() + TAIL.len()
        )
    })?;
    Ok(Bytes::from(format!("{HEAD}{}{TAIL}", "x".repeat(pad))))
}

pub fn put(t: &Target, path: &str) -> Request<Body> {
    write(Method::PUT, t, path)
}

/// A write (`method` with an empty body) of `path`.
pub fn write(method: Method, t: &Target, path: &str) -> Request<Body> {
    request(method, t, path)
        .header(hyper::header::CONTENT_LENGTH, "0")
        .body(Body::default())
        .expect("valid request")
}

/// A TCP connection to `addr` (5 s to connect), with TCP_NODELAY.
pub async fn tcp_connect(addr: SocketAddr) -> Result<TcpStream, String> {
    let stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .map_err(|_| "connect timeout".to_owned())?
        .map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// The HTTP/1.1 handshake on `io`, for requests with bodies of type `B` (`Body` for
/// `Sender`); the connection itself is driven by a task of its own.
pub async fn handshake<T, B>(io: T) -> Result<http1::SendRequest<B>, String>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (sender, conn) = http1::handshake::<_, B>(TokioIo::new(io))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// One keep-alive connection to `t`.
pub async fn connect(t: &Target) -> Result<Sender, String> {
    handshake(tcp_connect(t.addr).await?).await
}

/// `n` keep-alive connections to `t`, one after the other; the first failure is the error.
pub async fn connect_n(t: &Target, n: usize) -> Result<Vec<Sender>, String> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(connect(t).await?);
    }
    Ok(conns)
}

/// Sends `req` and reads the whole answer: status, X-Cache and body.
pub async fn fetch(
    sender: &mut Sender,
    req: Request<Body>,
) -> Result<(u16, String, Bytes), String> {
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let status = resp.status().as_u16();
    let xc = x_cache_of(&resp);
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok((status, xc, body))
}

/// What became of one request.
pub enum Answer {
    Response {
        status: u16,
        x_cache: String,
        body_len: usize,
    },
    Error(String),
    Timeout,
}

/// Reconnect counters of the connections of one target.
#[derive(Default)]
pub struct ConnCounters {
    pub reconnects: AtomicU64,
    pub connect_failures: AtomicU64,
}

/// Makes `sender` usable: the open connection, or a new one (two attempts, each counted in
/// `counters`) when the server closed it. The error of the last failed connect otherwise.
pub async fn ensure_ready(
    sender: &mut Option<Sender>,
    target: &Target,
    counters: &ConnCounters,
) -> Result<(), String> {
    let mut conn_err = None;
    for attempt in 0..3 {
        if let Some(s) = sender.as_mut()
            && !s.is_closed()
            && s.ready().await.is_ok()
        {
            return Ok(());
        }
        *sender = None;
        if attempt == 2 {
            break;
        }
        counters.reconnects.fetch_add(1, Ordering::Relaxed);
        match connect(target).await {
            Ok(s) => *sender = Some(s),
            Err(e) => {
                counters.connect_failures.fetch_add(1, Ordering::Relaxed);
                conn_err = Some(e);
            }
        }
    }
    Err(conn_err.unwrap_or_else(|| "connection not ready".into()))
}

/// One GET of `path` (a POST of `post_body` when given) on the connection `ready` says is
/// usable (else its error is the answer), bounded by `timeout`. After an error or a timeout
/// the connection is dropped.
pub async fn get_answer(
    sender: &mut Option<Sender>,
    ready: Result<(), String>,
    target: &Target,
    path: &str,
    post_body: Option<&Bytes>,
    timeout: Duration,
) -> Answer {
    if let Err(e) = ready {
        return Answer::Error(e);
    }
    let s = sender.as_mut().expect("usable sender");
    let req = match post_body {
        Some(b) => post(target, path, b.clone()),
        None => get(target, path),
    };
    match tokio::time::timeout(timeout, fetch(s, req)).await {
        Ok(Ok((status, x_cache, body))) => Answer::Response {
            status,
            x_cache,
            body_len: body.len(),
        },
        Ok(Err(e)) => {
            *sender = None;
            Answer::Error(e)
        }
        Err(_) => {
            *sender = None;
            Answer::Timeout
        }
    }
}
