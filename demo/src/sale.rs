//! The flash-sale phase: a crowd pressing "buy" on one train's seats, first straight at the
//! demo API, then through cacheguard, whose `[[stock]]` gate answers "sold out" once the
//! seats are gone. For each path it reads back from the database how many buy
//! transactions ran, how many seats were sold, and how many beyond the seats on sale
//! (oversold: must be 0).
//!
//! Each path gets a train of its own with the same seats, put on sale through the API
//! (`PUT /trains/{train}/seats/{type}`); the crowd is `crowd` keep-alive connections
//! sending `POST /trains/{train}/seats/{type}/orders` until `attempts` were sent, bounded
//! by [`SALE_TIME_LIMIT`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, StatusCode};
use tokio::task::JoinSet;

use crate::burst::{Counter, HttpClient, NO_X_CACHE};

/// Seats on sale on each path.
pub const SEATS: u64 = 1_000;
/// Buy attempts on each path.
pub const ATTEMPTS: u64 = 100_000;
/// Buy attempts on each path with `--exit` (the smoke run of the test command), which
/// runs a debug build: five times the seats, still a crowd, in a few seconds.
pub const SMOKE_ATTEMPTS: u64 = 5_000;
/// Buyers at once: a crowd, within what two cores serve beside the demo's other parts.
pub const CROWD: usize = 256;
/// The seat type on sale.
pub const SEAT_TYPE: &str = "second";
/// Upper bound on one path's sale; attempts not sent by then are not sent.
const SALE_TIME_LIMIT: Duration = Duration::from_secs(60);

/// What one path's sale produced: what the buyers were told, and what the database says.
#[derive(Clone, Debug, Default)]
pub struct SaleOutcome {
    pub planned: u64,
    pub sent: u64,
    /// Buyers told they bought a seat (201).
    pub told_sold: u64,
    /// Buyers told sold out (409).
    pub sold_out: u64,
    /// Buyers told to come back (503 + `Retry-After`: cacheguard's origin guard had no free
    /// slot in time; nothing was sold).
    pub busy: u64,
    /// Transport errors, timeouts and any other answer.
    pub errors: u64,
    /// `X-Cache` value → count.
    pub x_cache: BTreeMap<String, u64>,
    pub elapsed: Duration,
    /// Buy transactions the database ran.
    pub buy_transactions: u64,
    /// Seats on sale, and orders the database took for them.
    pub seats: u64,
    pub seats_sold: u64,
}

impl SaleOutcome {
    /// Seats sold beyond those on sale.
    pub fn oversold(&self) -> u64 {
        self.seats_sold.saturating_sub(self.seats)
    }

    /// Whether every answer was a sale, "sold out" or "busy, retry", nothing was oversold,
    /// and every buyer told "sold" has an order in the database (and only they).
    pub fn ok(&self) -> bool {
        self.errors == 0 && self.oversold() == 0 && self.told_sold == self.seats_sold
    }
}

/// Puts [`SEATS`] seats of `train` on sale (directly at the API), then sends `attempts`
/// buys of them to `target` with `crowd` buyers at once.
pub async fn run(
    client: &HttpClient,
    counter: &Counter,
    api: SocketAddr,
    target: SocketAddr,
    train: &str,
    attempts: u64,
    crowd: usize,
) -> anyhow::Result<SaleOutcome> {
    let seats = format!("/trains/{train}/seats/{SEAT_TYPE}");
    let put = Request::builder()
        .method(Method::PUT)
        .uri(format!("http://{api}{seats}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(format!("{{\"seats\": {SEATS}}}"))))?;
    let (status, _, _) = crate::send(client, put).await?;
    if status != StatusCode::OK {
        bail!("putting {seats} on sale: the API answered {status}");
    }
    counter.reset().await?;

    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + SALE_TIME_LIMIT;
    let uri: Arc<str> = format!("http://{target}{seats}/orders").into();
    let mut buyers = JoinSet::new();
    for _ in 0..crowd.max(1) {
        let (client, next, uri) = (client.clone(), next.clone(), uri.clone());
        buyers.spawn(async move {
            let mut out = SaleOutcome::default();
            while next.fetch_add(1, Ordering::Relaxed) < attempts && Instant::now() < deadline {
                out.sent += 1;
                buy(&client, &uri, &mut out).await;
            }
            out
        });
    }
    let mut total = SaleOutcome {
        planned: attempts,
        seats: SEATS,
        ..SaleOutcome::default()
    };
    while let Some(joined) = buyers.join_next().await {
        let out = joined.context("buyer task panicked")?;
        total.sent += out.sent;
        total.told_sold += out.told_sold;
        total.sold_out += out.sold_out;
        total.busy += out.busy;
        total.errors += out.errors;
        for (k, v) in out.x_cache {
            *total.x_cache.entry(k).or_default() += v;
        }
    }
    total.elapsed = started.elapsed();
    total.buy_transactions = counter.buy_transactions().await?;
    let get = Request::get(format!("http://{api}{seats}")).body(Full::new(Bytes::new()))?;
    let (status, _, body) = crate::send(client, get).await?;
    if status != StatusCode::OK {
        bail!("reading {seats}: the API answered {status}");
    }
    let count: serde_json::Value = serde_json::from_slice(&body).context("the seats' count")?;
    total.seats_sold = count
        .get("sold")
        .and_then(serde_json::Value::as_u64)
        .with_context(|| format!("no `sold` in {count}"))?;
    Ok(total)
}

async fn buy(client: &HttpClient, uri: &str, out: &mut SaleOutcome) {
    let Ok(req) = Request::post(uri).body(Full::new(Bytes::new())) else {
        out.errors += 1;
        return;
    };
    let Ok((status, x_cache, _)) = crate::send(client, req).await else {
        out.errors += 1;
        return;
    };
    *out.x_cache
        .entry(x_cache.unwrap_or_else(|| NO_X_CACHE.to_owned()))
        .or_default() += 1;
    match status {
        StatusCode::CREATED => out.told_sold += 1,
        StatusCode::CONFLICT => out.sold_out += 1,
        // cacheguard's origin guard had no slot for it in time (a debug build on a busy
        // machine): the buyer may retry, and the gate took its unit back.
        StatusCode::SERVICE_UNAVAILABLE => out.busy += 1,
        _ => out.errors += 1,
    }
}
