//! `DemoApi`: a small SQLite-backed JSON API, the origin cacheguard protects in the demo.
//!
//! An in-memory SQLite database (rusqlite, `bundled`) holds `items(id, name, price)`, and
//! for the flash sale `seats(train, type, seats, remaining)` and `orders(id, train, type)`.
//! Every statement run for an item increments one atomic counter, and every buy
//! transaction another, so the demo can show how many database queries and buy
//! transactions each burst really caused.
//!
//! | method | path | answer |
//! |---|---|---|
//! | GET | `/api/items/{id}` | 200 `{"id","name","price"}`, or 404 `{"error"}` (still one query) |
//! | PUT | `/api/items/{id}` | body `{"name","price"}`: 200 updated / 201 created |
//! | GET | `/internal/item-ids` | every id, one per line, streamed in pages |
//! | PUT | `/trains/{train}/seats/{type}` | body `{"seats": N}`: puts N seats on sale (200) |
//! | GET | `/trains/{train}/seats/{type}` | `{"seats","remaining","sold"}` (`sold`: orders taken) |
//! | POST | `/trains/{train}/seats/{type}/orders` | buys one seat: 201 `{"order"}`, or 409 `{"type":"sold-out"}` |
//! | GET | `/internal/stock/{train}/{type}` | `{"remaining": N}`: what a stock gate loads and reconciles from |
//! | GET | `/stats` | `{"db_queries": N, "buy_transactions": M}` |
//! | POST | `/stats/reset` | sets both counters to 0 |
//!
//! Item reads and buys wait `db_delay` (an async sleep, standing in for the latency of a
//! real database) and then run on the blocking pool under a `Mutex<Connection>`. A buy is
//! one transaction with a conditional decrement, as a shop behind a stock gate keeps it:
//! `UPDATE seats SET remaining = remaining - 1 WHERE … AND remaining >= 1`, and an order
//! row when it sold; it never sells a seat it does not have.

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
    /// Buy transactions begun (sold or not).
    buys: AtomicU64,
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
            buys: AtomicU64::new(0),
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
        "CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT NOT NULL, price REAL NOT NULL);
         CREATE TABLE seats (train TEXT NOT NULL, type TEXT NOT NULL, seats INTEGER NOT NULL,
                             remaining INTEGER NOT NULL CHECK (remaining >= 0),
                             PRIMARY KEY (train, type));
         CREATE TABLE orders (id INTEGER PRIMARY KEY, train TEXT NOT NULL, type TEXT NOT NULL,
                              reservation TEXT);",
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
            state.buys.store(0, Ordering::Relaxed);
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
            None => match Seats::of_path(&path) {
                Some((seats, Seats::Orders)) if method == Method::POST => {
                    buy_seat(state, seats, req).await
                }
                Some((seats, Seats::Resource)) if method == Method::GET => {
                    seat_count(state, seats).await
                }
                Some((seats, Seats::Resource)) if method == Method::PUT => {
                    put_on_sale(state, seats, req).await
                }
                Some((seats, Seats::Source)) if method == Method::GET => {
                    seat_count(state, seats).await
                }
                Some((_, Seats::Orders)) => method_not_allowed("POST"),
                Some((_, Seats::Resource)) => method_not_allowed("GET, PUT"),
                Some((_, Seats::Source)) => method_not_allowed("GET"),
                None => json_response(StatusCode::NOT_FOUND, &json!({"error": "no such route"})),
            },
        },
    }
}

/// Which seats path a request names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seats {
    /// `/trains/{train}/seats/{type}`
    Resource,
    /// `/trains/{train}/seats/{type}/orders`
    Orders,
    /// `/internal/stock/{train}/{type}`
    Source,
}

/// A train's seats of one type.
#[derive(Clone, Debug)]
struct SeatKey {
    train: String,
    kind: String,
}

impl Seats {
    fn of_path(path: &str) -> Option<(SeatKey, Seats)> {
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let key = |train: &str, kind: &str| {
            (!train.is_empty() && !kind.is_empty()).then(|| SeatKey {
                train: train.to_owned(),
                kind: kind.to_owned(),
            })
        };
        match parts.as_slice() {
            ["trains", train, "seats", kind] => Some((key(train, kind)?, Seats::Resource)),
            ["trains", train, "seats", kind, "orders"] => Some((key(train, kind)?, Seats::Orders)),
            ["internal", "stock", train, kind] => Some((key(train, kind)?, Seats::Source)),
            _ => None,
        }
    }
}

/// What a buy transaction did.
enum Bought {
    Order(i64),
    SoldOut,
    NoTrain,
}

/// One buy: one transaction with a conditional decrement, counted in `buy_transactions`.
async fn buy_seat(state: &Arc<State>, seats: SeatKey, req: Request<Incoming>) -> Response<Body> {
    let reservation = req
        .headers()
        .get("stock-reservation")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if !state.db_delay.is_zero() {
        tokio::time::sleep(state.db_delay).await;
    }
    let st = state.clone();
    let sold = tokio::task::spawn_blocking(move || {
        st.buys.fetch_add(1, Ordering::Relaxed);
        let mut db = lock(&st);
        let tx = db.transaction()?;
        let taken = tx.execute(
            "UPDATE seats SET remaining = remaining - 1 \
             WHERE train = ?1 AND type = ?2 AND remaining >= 1",
            params![seats.train, seats.kind],
        )?;
        let bought = if taken == 1 {
            tx.execute(
                "INSERT INTO orders (train, type, reservation) VALUES (?1, ?2, ?3)",
                params![seats.train, seats.kind, reservation],
            )?;
            Bought::Order(tx.last_insert_rowid())
        } else {
            // Sold out, or no such train: which one, for the answer.
            let exists = tx
                .query_row(
                    "SELECT 1 FROM seats WHERE train = ?1 AND type = ?2",
                    params![seats.train, seats.kind],
                    |_| Ok(()),
                )
                .optional()?;
            if exists.is_some() {
                Bought::SoldOut
            } else {
                Bought::NoTrain
            }
        };
        tx.commit()?;
        Ok::<Bought, rusqlite::Error>(bought)
    })
    .await;
    match sold {
        Ok(Ok(Bought::Order(order))) => {
            json_response(StatusCode::CREATED, &json!({"order": order}))
        }
        Ok(Ok(Bought::SoldOut)) => {
            json_response(StatusCode::CONFLICT, &json!({"type": "sold-out"}))
        }
        Ok(Ok(Bought::NoTrain)) => {
            json_response(StatusCode::NOT_FOUND, &json!({"error": "no such train"}))
        }
        Ok(Err(e)) => internal_error(&e.to_string()),
        Err(e) => internal_error(&e.to_string()),
    }
}

/// `{"seats", "remaining", "sold"}` of a train's seats (one query, not a buy).
async fn seat_count(state: &Arc<State>, seats: SeatKey) -> Response<Body> {
    let st = state.clone();
    let row = tokio::task::spawn_blocking(move || {
        st.queries.fetch_add(1, Ordering::Relaxed);
        lock(&st)
            .query_row(
                "SELECT s.seats, s.remaining, \
                        (SELECT COUNT(*) FROM orders o WHERE o.train = s.train AND o.type = s.type) \
                 FROM seats s WHERE s.train = ?1 AND s.type = ?2",
                params![seats.train, seats.kind],
                |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?)),
            )
            .optional()
    })
    .await;
    match row {
        Ok(Ok(Some((total, remaining, sold)))) => json_response(
            StatusCode::OK,
            &json!({"seats": total, "remaining": remaining, "sold": sold}),
        ),
        Ok(Ok(None)) => json_response(StatusCode::NOT_FOUND, &json!({"error": "no such train"})),
        Ok(Err(e)) => internal_error(&e.to_string()),
        Err(e) => internal_error(&e.to_string()),
    }
}

/// `PUT` `{"seats": N}`: N seats on sale, none sold yet (its earlier orders are dropped).
async fn put_on_sale(state: &Arc<State>, seats: SeatKey, req: Request<Incoming>) -> Response<Body> {
    let parsed = match json_body(req).await {
        Ok(v) => v,
        Err(answer) => return answer,
    };
    let Some(n) = parsed
        .get("seats")
        .and_then(serde_json::Value::as_i64)
        .filter(|n| *n >= 0)
    else {
        return json_response(
            StatusCode::BAD_REQUEST,
            &json!({"error": "expected {\"seats\": a number of seats}"}),
        );
    };
    let st = state.clone();
    let result = tokio::task::spawn_blocking(move || {
        let mut db = lock(&st);
        let tx = db.transaction()?;
        tx.execute(
            "INSERT INTO seats (train, type, seats, remaining) VALUES (?1, ?2, ?3, ?3) \
             ON CONFLICT (train, type) DO UPDATE SET seats = ?3, remaining = ?3",
            params![seats.train, seats.kind, n],
        )?;
        tx.execute(
            "DELETE FROM orders WHERE train = ?1 AND type = ?2",
            params![seats.train, seats.kind],
        )?;
        tx.commit()
    })
    .await;
    match result {
        Ok(Ok(())) => json_response(
            StatusCode::OK,
            &json!({"seats": n, "remaining": n, "sold": 0}),
        ),
        Ok(Err(e)) => internal_error(&e.to_string()),
        Err(e) => internal_error(&e.to_string()),
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

/// The request's body as JSON, or the 400 to answer.
async fn json_body(req: Request<Incoming>) -> Result<serde_json::Value, Response<Body>> {
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Err(json_response(
                StatusCode::BAD_REQUEST,
                &json!({"error": format!("could not read body: {e}")}),
            ));
        }
    };
    serde_json::from_slice(&body).map_err(|e| {
        json_response(
            StatusCode::BAD_REQUEST,
            &json!({"error": format!("body is not JSON: {e}")}),
        )
    })
}

async fn put_item(state: &Arc<State>, id: i64, req: Request<Incoming>) -> Response<Body> {
    let parsed = match json_body(req).await {
        Ok(v) => v,
        Err(answer) => return answer,
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
        &json!({
            "db_queries": state.queries.load(Ordering::Relaxed),
            "buy_transactions": state.buys.load(Ordering::Relaxed),
        }),
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
