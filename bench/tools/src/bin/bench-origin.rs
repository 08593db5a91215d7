//! A slow, database-backed-API stand-in for the bench scripts.
//!
//! - `GET /items/{id}`: exactly `--body-bytes` (1024) bytes of JSON after `--delay-ms`
//!   (per-request override `?delay_ms=N`); 404 (after the same delay) for ids outside
//!   1..=`--max-id`.
//! - `GET /stats`: JSON counters (total, per path, in flight, max in flight).
//! - `POST /stats/reset` (GET accepted too): zero every counter.
//!
//! The stats endpoints are not counted. Listens on 127.0.0.1 only.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpSocket;

#[derive(Parser, Debug)]
#[command(about = "Slow JSON origin with request counters (bench tool)")]
struct Args {
    /// Port on 127.0.0.1.
    #[arg(long)]
    port: u16,
    /// Delay before every /items answer, in milliseconds.
    #[arg(long, default_value_t = 200)]
    delay_ms: u64,
    /// Largest existing id; ids outside 1..=max-id answer 404.
    #[arg(long, default_value_t = 100_000)]
    max_id: u64,
    /// Exact size of a 200 body.
    #[arg(long, default_value_t = 1024)]
    body_bytes: usize,
    /// Tokio worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

#[derive(Default)]
struct Stats {
    total: AtomicU64,
    items_ok: AtomicU64,
    items_404: AtomicU64,
    other: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    paths: Mutex<BTreeMap<String, u64>>,
}

impl Stats {
    fn reset(&self) {
        self.total.store(0, Ordering::SeqCst);
        self.items_ok.store(0, Ordering::SeqCst);
        self.items_404.store(0, Ordering::SeqCst);
        self.other.store(0, Ordering::SeqCst);
        // in_flight is live state, not a counter: keep it, restart the max from it.
        self.max_in_flight
            .store(self.in_flight.load(Ordering::SeqCst), Ordering::SeqCst);
        self.paths.lock().expect("stats lock").clear();
    }

    fn json(&self) -> String {
        let paths = self.paths.lock().expect("stats lock");
        // Per-path counts are for small runs (stampedes); past 1000 paths only the count is kept.
        let per_path = if paths.len() <= 1000 {
            serde_json::to_value(&*paths).expect("map to json")
        } else {
            serde_json::Value::Null
        };
        serde_json::json!({
            "total": self.total.load(Ordering::SeqCst),
            "items_ok": self.items_ok.load(Ordering::SeqCst),
            "items_404": self.items_404.load(Ordering::SeqCst),
            "other": self.other.load(Ordering::SeqCst),
            "in_flight": self.in_flight.load(Ordering::SeqCst),
            "max_in_flight": self.max_in_flight.load(Ordering::SeqCst),
            "distinct_paths": paths.len(),
            "paths": per_path,
        })
        .to_string()
    }
}

struct State {
    args: Args,
    stats: Stats,
}

/// `{"id":N,"name":"item N","payload":"xxx…"}` of exactly `n` bytes (at least the frame).
fn item_body(id: u64, n: usize) -> Bytes {
    let head = format!("{{\"id\":{id},\"name\":\"item {id}\",\"payload\":\"");
    let tail = "\"}";
    let pad = n.saturating_sub(head.len() + tail.len());
    let mut s = String::with_capacity(n);
    s.push_str(&head);
    s.extend(std::iter::repeat_n('x', pad));
    s.push_str(tail);
    Bytes::from(s)
}

fn json_response(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

fn query_delay(query: Option<&str>) -> Option<u64> {
    query?
        .split('&')
        .find_map(|kv| kv.strip_prefix("delay_ms="))
        .and_then(|v| v.parse().ok())
}

/// Decrements the in-flight gauge when the request ends (also when the client goes away).
struct InFlight<'a>(&'a Stats);

impl<'a> InFlight<'a> {
    fn enter(stats: &'a Stats) -> Self {
        let now = stats.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        stats.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(stats)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_owned();
    let stats = &state.stats;
    match (req.method(), path.as_str()) {
        (&Method::GET, "/stats") => return Ok(json_response(StatusCode::OK, stats.json())),
        (&Method::POST | &Method::GET, "/stats/reset") => {
            stats.reset();
            return Ok(json_response(StatusCode::OK, stats.json()));
        }
        _ => {}
    }

    stats.total.fetch_add(1, Ordering::SeqCst);
    *stats
        .paths
        .lock()
        .expect("stats lock")
        .entry(path.clone())
        .or_insert(0) += 1;

    let Some(id) = path.strip_prefix("/items/") else {
        stats.other.fetch_add(1, Ordering::SeqCst);
        return Ok(json_response(StatusCode::NOT_FOUND, r#"{"error":"no such path"}"#));
    };
    let _guard = InFlight::enter(stats);
    let delay = query_delay(req.uri().query()).unwrap_or(state.args.delay_ms);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    match id.parse::<u64>() {
        Ok(id) if (1..=state.args.max_id).contains(&id) && req.method() == Method::GET => {
            stats.items_ok.fetch_add(1, Ordering::SeqCst);
            Ok(json_response(StatusCode::OK, item_body(id, state.args.body_bytes)))
        }
        _ => {
            stats.items_404.fetch_add(1, Ordering::SeqCst);
            Ok(json_response(StatusCode::NOT_FOUND, r#"{"error":"not found"}"#))
        }
    }
}

fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(serve(args))
}

async fn serve(args: Args) -> std::io::Result<()> {
    let addr = SocketAddr::from(([127, 0, 0, 1], args.port));
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    let listener = socket.listen(4096)?;
    eprintln!(
        "bench-origin listening on http://{addr} (delay {} ms, ids 1..={}, {} byte bodies)",
        args.delay_ms, args.max_id, args.body_bytes
    );
    let state = Arc::new(State {
        args,
        stats: Stats::default(),
    });
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| handle(state.clone(), req));
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
