//! `DemoApi`: a small SQLite-backed JSON API, the origin cacheguard protects in the demo.
//!
//! An in-memory SQLite database (rusqlite, `bundled`) holds `items(id, name, price)`.
//! Every statement run against it increments one atomic counter, so the demo can show how
//! many database queries each burst really caused.
//!
//! | method | path | answer |
//! |---|---|---|
//! | GET | `/api/items/{id}` | 200 `{"id","name","price"}`, or 404 `{"error"}` (still one query) |
//! | PUT | `/api/items/{id}` | body `{"name","price"}`: 200 updated / 201 created |
//! | GET | `/internal/item-ids` | every id, one per line, streamed in pages |
//! | GET | `/stats` | `{"db_queries": N}` |
//! | POST | `/stats/reset` | sets the counter to 0, answers `{"db_queries": 0}` |
//!
//! Item reads wait `db_delay` (an async sleep, standing in for the latency of a real
//! database query) and then run one `SELECT` on the blocking pool under a
//! `Mutex<Connection>`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use rusqlite::{Connection, OptionalExtension as _, params};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

type Body = BoxBody<Bytes, Infallible>;

/// Largest PUT body the API accepts.
const MAX_BODY_BYTES: usize = 64 * 1024;
/// Ids sent per page by `/internal/item-ids` (the DB lock is held for one page at a time).
const ID_PAGE: i64 = 2_000;
/// How long `shutdown` waits for open connections to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Settings of the demo API.
#[derive(Clone, Debug)]
pub struct ApiOptions {
    /// Items seeded, ids `1..=items`.
    pub items: u64,
    /// Artificial latency added before each item read.
    pub db_delay: Duration,
}

/// A running demo API.
pub struct DemoApi {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

struct State {
    db: Mutex<Connection>,
    queries: Arc<AtomicU64>,
    db_delay: Duration,
}

/// The seeded name and price of item `id` (deterministic, so every run serves the same data).
pub fn seed_item(id: i64) -> (String, f64) {
    const ADJ: [&str; 8] = [
        "red", "quiet", "rapid", "golden", "tiny", "sturdy", "bright", "hollow",
    ];
    const NOUN: [&str; 8] = [
        "kettle", "lantern", "anchor", "teapot", "compass", "ribbon", "saddle", "mirror",
    ];
    let n = id.unsigned_abs() as usize;
    let name = format!("{} {} #{id}", ADJ[n % 8], NOUN[(n / 8) % 8]);
    let cents = (id.unsigned_abs().wrapping_mul(7_919) % 100_000) + 99;
    (name, cents as f64 / 100.0)
}

impl DemoApi {
    /// Seeds the database and starts serving on `127.0.0.1:0`.
    pub async fn start(opts: ApiOptions) -> anyhow::Result<DemoApi> {
        Self::start_on(opts, SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Seeds the database and starts serving on `listen` (`--origin-only` mode).
    pub async fn start_on(opts: ApiOptions, listen: SocketAddr) -> anyhow::Result<DemoApi> {
        let items = i64::try_from(opts.items).context("--items is too large")?;
        let conn = tokio::task::spawn_blocking(move || seed(items))
            .await
            .context("seeding task failed")??;
        let queries = Arc::new(AtomicU64::new(0));
        let state = Arc::new(State {
            db: Mutex::new(conn),
            queries,
            db_delay: opts.db_delay,
        });
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding the demo API listener on {listen}"))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(serve(listener, state, stopped));
        Ok(DemoApi {
            addr,
            stop: Some(stop),
            task,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets open connections finish (bounded), then returns.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

fn seed(items: i64) -> anyhow::Result<Connection> {
    let mut conn = Connection::open_in_memory().context("opening in-memory SQLite")?;
    conn.execute_batch(
        "CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT NOT NULL, price REAL NOT NULL);",
    )?;
    let tx = conn.transaction()?;
    {
        let mut insert = tx.prepare("INSERT INTO items (id, name, price) VALUES (?1, ?2, ?3)")?;
        for id in 1..=items {
            let (name, price) = seed_item(id);
            insert.execute(params![id, name, price])?;
        }
    }
    tx.commit()?;
    Ok(conn)
}

async fn serve(listener: TcpListener, state: Arc<State>, mut stopped: oneshot::Receiver<()>) {
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // e.g. EMFILE: back off briefly instead of spinning.
                        eprintln!("demo API: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let state = state.clone();
                let svc = service_fn(move |req| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(handle(&state, req).await) }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), svc).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await;
}

async fn handle(state: &Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    match path.as_str() {
        "/stats" if method == Method::GET => stats(state),
        "/stats/reset" if method == Method::POST => {
            state.queries.store(0, Ordering::Relaxed);
            stats(state)
        }
        "/internal/item-ids" if method == Method::GET => item_ids(state),
        "/stats/reset" => method_not_allowed("POST"),
        "/stats" | "/internal/item-ids" => method_not_allowed("GET"),
        _ => match path.strip_prefix("/api/items/") {
            Some(raw_id) => {
                let Ok(id) = raw_id.parse::<i64>() else {
                    return json_response(
                        StatusCode::BAD_REQUEST,
                        &json!({"error": "item id must be an integer"}),
                    );
                };
                match method {
                    Method::GET | Method::HEAD => get_item(state, id).await,
                    Method::PUT => put_item(state, id, req).await,
                    _ => method_not_allowed("GET, HEAD, PUT"),
                }
            }
            None => json_response(StatusCode::NOT_FOUND, &json!({"error": "no such route"})),
        },
    }
}

fn lock(state: &State) -> MutexGuard<'_, Connection> {
    // A panic while holding the lock cannot leave the connection half-changed (every
    // statement is atomic), so a poisoned lock is still usable.
    state
        .db
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn get_item(state: &Arc<State>, id: i64) -> Response<Body> {
    if !state.db_delay.is_zero() {
        tokio::time::sleep(state.db_delay).await;
    }
    let st = state.clone();
    let row = tokio::task::spawn_blocking(move || {
        st.queries.fetch_add(1, Ordering::Relaxed);
        lock(&st)
            .query_row(
                "SELECT id, name, price FROM items WHERE id = ?1",
                params![id],
                |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, f64>(2)?,
                    ))
                },
            )
            .optional()
    })
    .await;
    match row {
        Ok(Ok(Some((id, name, price)))) => json_response(
            StatusCode::OK,
            &json!({"id": id, "name": name, "price": price}),
        ),
        Ok(Ok(None)) => json_response(
            StatusCode::NOT_FOUND,
            &json!({"error": "item not found", "id": id}),
        ),
        Ok(Err(e)) => internal_error(&e.to_string()),
        Err(e) => internal_error(&e.to_string()),
    }
}

async fn put_item(state: &Arc<State>, id: i64, req: Request<Incoming>) -> Response<Body> {
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return json_response(
                StatusCode::BAD_REQUEST,
                &json!({"error": format!("could not read body: {e}")}),
            );
        }
    };
    let parsed: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return json_response(
                StatusCode::BAD_REQUEST,
                &json!({"error": format!("body is not JSON: {e}")}),
            );
        }
    };
    let (Some(name), Some(price)) = (
        parsed
            .get("name")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned),
        parsed.get("price").and_then(serde_json::Value::as_f64),
    ) else {
        return json_response(
            StatusCode::BAD_REQUEST,
            &json!({"error": "expected {\"name\": string, \"price\": number}"}),
        );
    };
    let st = state.clone();
    let (n, p) = (name.clone(), price);
    let result = tokio::task::spawn_blocking(move || {
        st.queries.fetch_add(1, Ordering::Relaxed);
        let db = lock(&st);
        let updated = db.execute(
            "UPDATE items SET name = ?2, price = ?3 WHERE id = ?1",
            params![id, n, p],
        )?;
        if updated == 0 {
            db.execute(
                "INSERT INTO items (id, name, price) VALUES (?1, ?2, ?3)",
                params![id, n, p],
            )?;
        }
        Ok::<bool, rusqlite::Error>(updated == 0)
    })
    .await;
    let item = json!({"id": id, "name": name, "price": price});
    match result {
        Ok(Ok(true)) => json_response(StatusCode::CREATED, &item),
        Ok(Ok(false)) => json_response(StatusCode::OK, &item),
        Ok(Err(e)) => internal_error(&e.to_string()),
        Err(e) => internal_error(&e.to_string()),
    }
}

/// Streams every id, one per line, one page (one query) at a time.
fn item_ids(state: &Arc<State>) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Bytes>(2);
    let st = state.clone();
    tokio::task::spawn_blocking(move || {
        let mut after = 0_i64;
        loop {
            st.queries.fetch_add(1, Ordering::Relaxed);
            let page: rusqlite::Result<Vec<i64>> = {
                let db = lock(&st);
                db.prepare_cached("SELECT id FROM items WHERE id > ?1 ORDER BY id LIMIT ?2")
                    .and_then(|mut s| {
                        s.query_map(params![after, ID_PAGE], |r| r.get(0))?
                            .collect()
                    })
            };
            let Ok(page) = page else { break };
            let Some(&last) = page.last() else { break };
            after = last;
            let mut chunk = String::with_capacity(page.len() * 8);
            for id in &page {
                chunk.push_str(&id.to_string());
                chunk.push('\n');
            }
            // The client went away: stop reading.
            if tx.blocking_send(Bytes::from(chunk)).is_err() {
                break;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, Infallible>(Frame::data(chunk)), rx))
    });
    let mut resp = Response::new(StreamBody::new(stream).boxed());
    resp.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn stats(state: &State) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &json!({"db_queries": state.queries.load(Ordering::Relaxed)}),
    )
}

fn method_not_allowed(allow: &'static str) -> Response<Body> {
    let mut resp = json_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &json!({"error": "method not allowed"}),
    );
    resp.headers_mut()
        .insert(ALLOW, hyper::header::HeaderValue::from_static(allow));
    resp
}

fn internal_error(msg: &str) -> Response<Body> {
    json_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        &json!({"error": "database error", "detail": msg}),
    )
}

fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut body = value.to_string();
    body.push('\n');
    let mut resp = Response::new(Full::new(Bytes::from(body)).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}
