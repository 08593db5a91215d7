//! Run with: cargo run --release -p cacheguard-demo
//!
//! The one-command cacheguard demo. It needs nothing but the Rust toolchain (SQLite is
//! bundled, Redis is optional):
//!
//! 1. starts a small SQLite-backed JSON API in-process (`origin.rs`: 10 000 items, 20 ms per
//!    database query, trains' seats sold with a conditional decrement, atomic counters of
//!    queries and buy transactions exposed at `/stats`);
//! 2. starts cacheguard in front of it from the embedded [`DEMO_CONFIG`] (embedded mode; set
//!    `CACHEGUARD_REDIS_URL=redis://127.0.0.1:6379` to run in shared mode with Redis as L2);
//! 3. fires a short, bounded burst (`burst.rs`) first directly at the API, then through
//!    cacheguard, and counts the database queries each phase caused:
//!    - **stampede**: 500 GETs of one cold id — cacheguard coalesces them into one query;
//!    - **hot set**: 5000 GETs over 50 popular ids — about one query per id;
//!    - **penetration**: 1000 GETs of ids that do not exist, twice — cacheguard's Bloom
//!      filter of the existing ids (loaded from the API's `/internal/item-ids`) answers
//!      almost all of them at once (`REJECT`); the few false positives reach the database
//!      once and are then answered from the negative cache;
//! 4. prints a table of requests, DB queries and errors per path, the `X-Cache` breakdown
//!    seen through cacheguard, and a read-after-write check;
//! 5. runs a **flash sale** (`sale.rs`): 1000 seats of a train, 100 000 buy attempts from
//!    256 buyers at once, straight at the API and then through cacheguard's `[[stock]]`
//!    gate, and prints for each the database's buy transactions (100 000 straight at the
//!    API; about 1000 through cacheguard, which answers the rest "sold out" itself), the
//!    seats sold and the seats oversold (0: the API decrements conditionally). With
//!    `--exit` it sends 5 000 attempts per path instead, and says so;
//! 6. keeps running (cacheguard URL, admin URL, status page and curl lines are printed)
//!    until Ctrl-C, or exits right away with `--exit` (as CI runs it). The exit status is
//!    non-zero when any request failed (transport error, 5xx or a wrong answer).
//!
//! Options: `--items N`, `--db-delay-ms MS`, `--concurrency N`, `--sale-attempts N`, `--exit`.
//! `RUST_LOG` sets cacheguard's log level (default `warn`).
//!
//! `--origin-only [--listen ADDR]` runs just the SQLite-backed demo API (step 1) on `ADDR`
//! (default `127.0.0.1:9000`) until SIGTERM or SIGINT: no cacheguard, no burst. It is the
//! origin of the container setup (`docker-compose.yml`), where cacheguard runs as its own
//! process, e.g. `cargo run -p cacheguard-demo -- --origin-only --listen 0.0.0.0:9000`.

mod burst;
mod origin;
mod report;
mod sale;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt as _, Full};
use hyper::{Method, Request, StatusCode, Uri};

use crate::burst::{Counter, Expect, HttpClient, Phase};
use crate::origin::{ApiOptions, DemoApi};
use crate::report::Row;
use crate::sale::SaleOutcome;

/// The cacheguard configuration the demo runs with (see `config/cacheguard.toml` for every
/// key). `@UPSTREAM_URL@` becomes the demo API's address and both listeners bind
/// `127.0.0.1:0` (a free port). There is no `[redis]` section, so this is embedded mode;
/// the config loader switches to shared mode by itself when `CACHEGUARD_REDIS_URL` is set.
pub const DEMO_CONFIG: &str = r#"
# cacheguard — configuration of the one-command demo (embedded mode).

[server]
listen = "@LISTEN@"            # the proxy listener; the demo uses 127.0.0.1:0

[upstream]
url = "@UPSTREAM_URL@"         # the in-process SQLite demo API
timeout = "5s"                 # whole-response timeout of one origin request (then 504)
max_concurrency = 128          # origin guard: at most 128 origin requests in flight
queue_timeout = "250ms"        # wait at most this for a slot, then shed with 503

[admin]
listen = "@ADMIN_LISTEN@"      # /metrics, /healthz, /readyz; the demo uses 127.0.0.1:0

[cache]
jitter = 0.1                   # stored ttl is uniform in ttl × [0.9, 1.1]
grace = "30s"                  # stale copies kept this long past ttl (stale-while-revalidate)
l1 = "hot"                     # embedded mode: L1 is the only tier and holds every entry

[lock]
lease = "5s"                   # shared mode: lock lease of the one fetching instance
wait_timeout = "3s"            # how long a coalesced waiter waits for the fill
on_timeout = "origin"          # then fetch from the origin itself (through the origin guard)

# A Bloom filter of the ids that exist, streamed from the API at start and every 5 min.
# Until it has loaded it rejects nothing.
[[bloom]]
name = "items"
expected_items = 100000
fp_rate = 0.001
source = { url = "/internal/item-ids" }
refresh = "5m"

# Reads of one item: ids the filter does not know are answered 404 at once (REJECT); a 404
# from the API (a filter false positive) is cached as NEGATIVE for 10 s; a found item is
# cached for 60 s.
[[routes]]
name = "item"
match = "/api/items/{id}"
methods = ["GET"]
ttl = "60s"
negative_ttl = "10s"
bloom = { filter = "items", param = "id" }

# Writes of one item go straight to the origin and invalidate the cached read
# (delete before and after the write, and once more after double_delete_delay).
[[routes]]
name = "item-write"
match = "/api/items/{id}"
methods = ["PUT", "PATCH", "DELETE"]
invalidate = ["/api/items/{id}"]
double_delete_delay = "1s"

# The flash sale: a train's seats counted at the edge (in memory here; in Redis in shared
# mode). Loaded from the API's own count, reconciled with it every 5 s; once they are gone,
# buyers get the sold-out answer from cacheguard and the database never sees them.
[[stock]]
name = "seats"
key = "/trains/{train}/seats/{type}"
source = { path = "/internal/stock/{train}/{type}", json = "/remaining" }
reconcile = "5s"
reservation_ttl = "30s"        # above upstream.timeout: a buy in flight keeps its seat
sold_out = { status = 409, body = '{"type":"sold-out"}', content_type = "application/json" }

# Buying a seat takes one of the gate's units before the API is asked.
[[routes]]
name = "buy"
match = "/trains/{train}/seats/{type}/orders"
methods = ["POST"]
stock = { gate = "seats", units = 1 }
"#;

/// Requests in the stampede phase (all for one cold id).
const STAMPEDE_REQUESTS: usize = 500;
/// Requests and distinct ids in the hot-set phase.
const HOT_REQUESTS: usize = 5_000;
const HOT_IDS: i64 = 50;
/// Distinct absent ids in each penetration pass.
const PENETRATION_IDS: i64 = 1_000;
/// How long shutdown of either server may take before the demo gives up on it.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(15);

#[derive(Parser, Debug)]
#[command(
    name = "cacheguard-demo",
    about = "cacheguard in front of a SQLite-backed API: stampede, hot set and penetration, with and without cacheguard"
)]
struct Args {
    /// Items seeded in the demo database (ids 1..=N).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=10_000_000))]
    items: u64,
    /// Artificial latency of each item read and each buy in the demo database, in milliseconds.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=5_000))]
    db_delay_ms: u64,
    /// Requests in flight at once during the burst (keep-alive connections per path).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=512))]
    concurrency: u64,
    /// Buy attempts per path in the flash sale (default 100000; 5000 with --exit).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    sale_attempts: Option<u64>,
    /// Shut down and exit right after printing the results (for CI).
    #[arg(long)]
    exit: bool,
    /// Run only the SQLite-backed demo API on --listen, without cacheguard and without the
    /// burst, until SIGTERM or SIGINT (the origin of the container setup).
    #[arg(long, conflicts_with_all = ["exit", "concurrency", "sale_attempts"])]
    origin_only: bool,
    /// Address the demo API listens on with --origin-only, "ip:port".
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "127.0.0.1:9000",
        requires = "origin_only"
    )]
    listen: SocketAddr,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let outcome = if args.origin_only {
        run_origin_only(&args).await
    } else {
        run(args).await
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("demo: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let api = DemoApi::start(ApiOptions {
        items: args.items,
        db_delay: Duration::from_millis(args.db_delay_ms),
    })
    .await?;

    let config = match demo_config(api.addr()) {
        Ok(c) => c,
        Err(e) => {
            api.shutdown().await;
            return Err(e);
        }
    };
    let mode = match &config.redis {
        None => "embedded (L1 only, in-process single-flight; no Redis)".to_owned(),
        Some(_) => {
            "shared (Redis from CACHEGUARD_REDIS_URL as L2, lock service and event bus)".to_owned()
        }
    };
    let running = match cacheguard::App::start(config).await {
        Ok(r) => r,
        Err(e) => {
            api.shutdown().await;
            return Err(e.context("starting cacheguard"));
        }
    };

    if !filters_loaded(running.admin_addr()).await {
        eprintln!("demo: the Bloom filter did not load within 10 s; it rejects nothing meanwhile");
    }
    let outcome = burst_and_report(&args, &api, running.addr(), &mode).await;
    let ok = match outcome {
        Ok(ok) => ok,
        Err(e) => {
            eprintln!("demo: error: {e:#}");
            false
        }
    };

    if !args.exit {
        print_try_it(api.addr(), running.addr(), running.admin_addr(), args.items);
        wait_for_signal().await;
        println!("\nshutting down…");
    }
    if tokio::time::timeout(SHUTDOWN_LIMIT, running.shutdown())
        .await
        .is_err()
    {
        eprintln!("demo: cacheguard did not shut down within {SHUTDOWN_LIMIT:?}");
    }
    if tokio::time::timeout(SHUTDOWN_LIMIT, api.shutdown())
        .await
        .is_err()
    {
        eprintln!("demo: the demo API did not shut down within {SHUTDOWN_LIMIT:?}");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `--origin-only`: serves the demo API on `--listen` until SIGTERM or SIGINT, then lets open
/// connections finish (bounded) and exits 0.
async fn run_origin_only(args: &Args) -> anyhow::Result<ExitCode> {
    // Registered before seeding, so a stop request that arrives early is not lost (as PID 1
    // in a container, a signal without a handler would simply be ignored).
    let stop = stop_signals()?;
    let api = DemoApi::start_on(
        ApiOptions {
            items: args.items,
            db_delay: Duration::from_millis(args.db_delay_ms),
        },
        args.listen,
    )
    .await?;
    let addr = api.addr();
    println!(
        "demo API (origin only): http://{addr}, {} items, {} ms per query",
        args.items, args.db_delay_ms
    );
    println!("  GET /api/items/{{id}}, PUT /api/items/{{id}}, GET /internal/item-ids,");
    println!(
        "  PUT|GET /trains/{{train}}/seats/{{type}}, POST /trains/{{train}}/seats/{{type}}/orders,"
    );
    println!("  GET /internal/stock/{{train}}/{{type}},");
    println!("  GET /stats (database queries and buy transactions so far), POST /stats/reset");
    println!("  SIGTERM or Ctrl-C stops it");
    stop.await;
    println!("demo API: shutting down");
    if tokio::time::timeout(SHUTDOWN_LIMIT, api.shutdown())
        .await
        .is_err()
    {
        eprintln!("demo: the demo API did not shut down within {SHUTDOWN_LIMIT:?}");
    }
    Ok(ExitCode::SUCCESS)
}

/// SIGINT and SIGTERM, both registered now; the future completes on the first of them.
#[cfg(unix)]
fn stop_signals() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    let mut terminate = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}

#[cfg(not(unix))]
fn stop_signals() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}

/// Builds the cacheguard config from [`DEMO_CONFIG`] for an API at `api`.
fn demo_config(api: SocketAddr) -> anyhow::Result<cacheguard::Config> {
    let upstream = format!("http://{api}");
    let text = DEMO_CONFIG
        .replace("@UPSTREAM_URL@", &upstream)
        .replace("@ADMIN_LISTEN@", "127.0.0.1:0")
        .replace("@LISTEN@", "127.0.0.1:0");
    let mut config =
        cacheguard::Config::from_toml(&text, "demo (embedded)", &cacheguard::config::ProcessEnv)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context("the demo's embedded cacheguard config was refused")?;
    if config.upstream.url.authority().map(|a| a.as_str())
        != Some(upstream.trim_start_matches("http://"))
    {
        bail!(
            "CACHEGUARD_UPSTREAM points cacheguard at {} instead of the demo API; unset it to run the demo",
            config.upstream.url
        );
    }
    if let Some(redis) = config.redis.as_mut() {
        // A fresh key prefix per run: entries a previous demo run left in Redis (same ids,
        // same data) would otherwise turn this run's misses into HIT-L2.
        let run_id = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        redis.key_prefix = format!("{}demo-{}-{run_id}:", redis.key_prefix, std::process::id());
        // The retry journal of owed invalidations: in the temp dir, not wherever the demo
        // was started.
        config.journal.path =
            std::env::temp_dir().join(format!("cacheguard-demo-{}.journal", std::process::id()));
    }
    Ok(config)
}

fn phases(items: i64) -> Vec<Phase> {
    let cold = items / 2 + 1; // exists, and is not one of the hot ids 1..=50
    let absent: Vec<i64> = (1..=PENETRATION_IDS).map(|i| items + i).collect();
    vec![
        Phase {
            name: "stampede: 1 cold id".to_owned(),
            ids: vec![cold; STAMPEDE_REQUESTS],
            expect: Expect::Item,
        },
        Phase {
            name: format!("hot set: {HOT_IDS} ids"),
            ids: (0..HOT_REQUESTS as i64).map(|i| 1 + i % HOT_IDS).collect(),
            expect: Expect::Item,
        },
        Phase {
            name: "penetration, pass 1".to_owned(),
            ids: absent.clone(),
            expect: Expect::Missing,
        },
        Phase {
            name: "penetration, pass 2".to_owned(),
            ids: absent,
            expect: Expect::Missing,
        },
    ]
}

/// Runs every phase directly, then through cacheguard, and prints the results.
/// Returns whether every request got a right answer.
async fn burst_and_report(
    args: &Args,
    api: &DemoApi,
    proxy: SocketAddr,
    mode: &str,
) -> anyhow::Result<bool> {
    let concurrency = usize::try_from(args.concurrency)?;
    let items = i64::try_from(args.items)?;
    let client = burst::client(concurrency);
    let counter = Counter::new(client.clone(), api.addr());
    let phases = phases(items);

    println!("cacheguard demo");
    println!("  mode:        {mode}");
    println!(
        "  origin:      SQLite demo API, {} items, {} ms per query or buy, at http://{}",
        args.items,
        args.db_delay_ms,
        api.addr()
    );
    println!("  cacheguard:  http://{proxy}");
    println!("  burst:       {concurrency} requests in flight, keep-alive connections");
    println!();

    let mut direct = Vec::new();
    for phase in &phases {
        direct.push(burst::run(&client, &counter, api.addr(), phase, concurrency).await?);
    }
    let mut cached = Vec::new();
    for phase in &phases {
        cached.push(burst::run(&client, &counter, proxy, phase, concurrency).await?);
    }
    let rows: Vec<Row> = phases
        .iter()
        .zip(direct.into_iter().zip(cached))
        .map(|(p, (direct, cached))| Row {
            phase: p.name.clone(),
            direct,
            cached,
        })
        .collect();

    println!("DB queries per phase, directly at the API and via cacheguard (cg):");
    print!("{}", report::table(&rows));
    println!();
    println!("X-Cache seen via cacheguard (MISS counts every request answered by a fresh");
    println!("origin fetch, including the coalesced waiters that shared one DB query):");
    print!("{}", report::x_cache_table(&rows));
    let details = report::error_details(&rows);
    if !details.is_empty() {
        println!();
        println!("errors:");
        print!("{details}");
    }
    println!();
    match read_after_write(&client, proxy).await {
        Ok(line) => println!("read after write via cacheguard: {line}"),
        Err(e) => println!("read after write via cacheguard: could not check: {e:#}"),
    }
    println!();
    let sale_ok = flash_sale(args, api, proxy).await?;
    let ok = sale_ok
        && rows
            .iter()
            .all(|r| r.direct.errors() == 0 && r.cached.errors() == 0);
    if !ok {
        println!("\nFAILED: some requests failed (see errors above)");
    }
    Ok(ok)
}

/// The flash sale, straight at the API and then through cacheguard (`sale.rs`), and its
/// table. Returns whether both went right: only sales, "sold out" and "busy, retry"
/// answered, nothing oversold, every buyer told "sold" has an order.
async fn flash_sale(args: &Args, api: &DemoApi, proxy: SocketAddr) -> anyhow::Result<bool> {
    let attempts = args.sale_attempts.unwrap_or(if args.exit {
        sale::SMOKE_ATTEMPTS
    } else {
        sale::ATTEMPTS
    });
    let client = burst::client(sale::CROWD);
    let counter = Counter::new(client.clone(), api.addr());
    // A train per path, so each sale starts with every seat and a gate that never saw it
    // (`<pid>-2` is the one sold through cacheguard: the "try" lines name it).
    let run = std::process::id();
    let direct = sale::run(
        &client,
        &counter,
        api.addr(),
        api.addr(),
        &format!("{run}-1"),
        attempts,
        sale::CROWD,
    )
    .await?;
    let gated = sale::run(
        &client,
        &counter,
        api.addr(),
        proxy,
        &format!("{run}-2"),
        attempts,
        sale::CROWD,
    )
    .await?;
    println!(
        "Flash sale: {} seats, {attempts} buy attempts from {} buyers at once",
        sale::SEATS,
        sale::CROWD
    );
    println!(
        "(POST /trains/{{train}}/seats/{}/orders; the API sells with a conditional decrement",
        sale::SEAT_TYPE
    );
    println!("in one transaction; through cacheguard a [[stock]] gate counts the seats first):");
    if args.exit && args.sale_attempts.is_none() {
        println!(
            "  (--exit: {attempts} attempts per path instead of {}, to keep the smoke run short)",
            sale::ATTEMPTS
        );
    }
    print!(
        "{}",
        report::sale_table(&[("straight to the API", &direct), ("via cacheguard", &gated)])
    );
    println!("  X-Cache via cacheguard: {}", report::sale_x_cache(&gated));
    println!(
        "  buy transactions per seat sold: {} straight, {} via cacheguard",
        per_seat(&direct),
        per_seat(&gated)
    );
    let ok = direct.ok() && gated.ok();
    if !ok {
        println!("  FAILED: an error, a seat oversold, or a buyer told \"sold\" without an order");
    }
    Ok(ok)
}

/// Buy transactions per seat sold, as `1.00`.
fn per_seat(outcome: &SaleOutcome) -> String {
    if outcome.seats_sold == 0 {
        return "\u{2013}".to_owned();
    }
    format!(
        "{:.2}",
        outcome.buy_transactions as f64 / outcome.seats_sold as f64
    )
}

/// PUTs a new name for a hot item through cacheguard, then GETs it through cacheguard.
async fn read_after_write(client: &HttpClient, proxy: SocketAddr) -> anyhow::Result<String> {
    let id = 2;
    let name = format!("renamed by the demo (pid {})", std::process::id());
    let body = serde_json::json!({"name": name, "price": 4.2}).to_string();
    let uri: Uri = format!("http://{proxy}/api/items/{id}").parse()?;
    let put = Request::builder()
        .method(Method::PUT)
        .uri(uri.clone())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let (status, _, _) = send(client, put).await?;
    if !status.is_success() {
        bail!("PUT /api/items/{id} answered {status}");
    }
    let get = Request::get(uri).body(Full::new(Bytes::new()))?;
    let (status, x_cache, body) = send(client, get).await?;
    let seen = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("name").and_then(|n| n.as_str()).map(str::to_owned));
    let x_cache = x_cache.unwrap_or_else(|| burst::NO_X_CACHE.to_owned());
    Ok(
        if status == StatusCode::OK && seen.as_deref() == Some(name.as_str()) {
            format!("PUT /api/items/{id}, then GET → the new name (X-Cache: {x_cache}) — fresh")
        } else {
            format!(
                "PUT /api/items/{id}, then GET → {status}, {seen:?} (X-Cache: {x_cache}) — STALE"
            )
        },
    )
}

/// Waits (at most 10 s) until `/readyz` says every Bloom filter is loaded.
async fn filters_loaded(admin: SocketAddr) -> bool {
    let client = burst::client(1);
    for _ in 0..100 {
        let ready = Request::get(format!("http://{admin}/readyz"))
            .body(Full::new(Bytes::new()))
            .ok();
        if let Some(req) = ready
            && let Ok((_, _, body)) = send(&client, req).await
            && !String::from_utf8_lossy(&body).contains("bloom")
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Sends `req` and reads the whole answer (within 10 s): its status, `X-Cache` and body.
async fn send(
    client: &HttpClient,
    req: Request<Full<Bytes>>,
) -> anyhow::Result<(StatusCode, Option<String>, Bytes)> {
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .context("timed out")??;
    let status = resp.status();
    let x_cache = resp
        .headers()
        .get("x-cache")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, x_cache, body))
}

fn print_try_it(api: SocketAddr, proxy: SocketAddr, admin: SocketAddr, items: u64) {
    let cold = items - 7; // an id the burst did not touch
    let absent = items + 1_000_001;
    let tries = [
        (
            format!("curl -i http://{proxy}/api/items/1"),
            "warmed by the burst: a hit",
        ),
        (
            format!("curl -i http://{proxy}/api/items/{cold}"),
            "MISS, then a hit on the second try",
        ),
        (
            format!("curl -i http://{proxy}/api/items/{absent}"),
            "404 at once: REJECT (the Bloom filter knows it does not exist)",
        ),
        (
            format!(
                "curl -i -X POST http://{proxy}/trains/{}-2/seats/{}/orders",
                std::process::id(),
                sale::SEAT_TYPE
            ),
            "the flash sale's train: 409 at once, SOLDOUT (the gate knows)",
        ),
        (
            format!("curl -s http://{api}/stats"),
            "DB queries and buy transactions so far (the API itself)",
        ),
        (
            format!("curl -s http://{admin}/metrics | grep ^cacheguard_"),
            "metrics",
        ),
    ];
    let width = tries.iter().map(|(c, _)| c.len()).max().unwrap_or(0);
    println!();
    println!("cacheguard is running (Ctrl-C to stop):");
    println!("  proxy:  http://{proxy}");
    println!("  admin:  http://{admin}  (/metrics, /healthz, /readyz, /admin/bloom)");
    println!("  status: http://{admin}/  (the status page: open it in a browser)");
    println!("  origin: http://{api}  (the demo API itself, bypassing cacheguard)");
    println!();
    println!("try:");
    for (command, what) in &tries {
        println!("  {command:<width$}  # {what}");
    }
    println!(
        "  curl -i -X PUT -H 'content-type: application/json' -d '{{\"name\":\"new\",\"price\":1.5}}' http://{proxy}/api/items/1"
    );
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
