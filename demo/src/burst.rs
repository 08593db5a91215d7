//! The scripted burst: a few bounded phases of GETs, sent with a keep-alive hyper client at
//! bounded concurrency, each phase bracketed by a reset and a read of the API's DB counter.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Upper bound on one request (head and body).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Upper bound on one phase on one path; requests not started by then are not sent.
const PHASE_TIME_LIMIT: Duration = Duration::from_secs(30);
/// Name under which responses without an `X-Cache` header are counted.
pub const NO_X_CACHE: &str = "(none)";

/// A keep-alive HTTP/1.1 client whose pool keeps one idle connection per worker.
pub fn client(concurrency: usize) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency)
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector)
}

/// What a correct answer for one id looks like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// 200 with a JSON body whose `id` is the requested id.
    Item,
    /// 404 (the id does not exist).
    Missing,
}

/// One phase: a name and the ids to GET, in order.
#[derive(Clone, Debug)]
pub struct Phase {
    pub name: String,
    pub ids: Vec<i64>,
    pub expect: Expect,
}

/// What one phase on one path produced.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub planned: u64,
    /// Requests sent (fewer than planned only if the phase hit its time limit).
    pub sent: u64,
    /// DB queries the API ran during the phase.
    pub db_queries: u64,
    pub elapsed: Duration,
    /// Connect/IO/timeout failures.
    pub transport_errors: u64,
    /// 5xx answers.
    pub server_errors: u64,
    /// Any other wrong answer: a status other than the expected 200/404, or a 200 whose body
    /// is not the requested item.
    pub wrong_answers: u64,
    /// `X-Cache` header value → count.
    pub x_cache: BTreeMap<String, u64>,
}

impl Outcome {
    pub fn errors(&self) -> u64 {
        self.transport_errors + self.server_errors + self.wrong_answers
    }

    fn merge(&mut self, other: Outcome) {
        self.sent += other.sent;
        self.transport_errors += other.transport_errors;
        self.server_errors += other.server_errors;
        self.wrong_answers += other.wrong_answers;
        for (k, v) in other.x_cache {
            *self.x_cache.entry(k).or_default() += v;
        }
    }
}

/// Resets and reads the demo API's counters, of database queries and of buy transactions
/// (always directly at the API).
#[derive(Clone)]
pub struct Counter {
    client: HttpClient,
    api: SocketAddr,
}

impl Counter {
    pub fn new(client: HttpClient, api: SocketAddr) -> Counter {
        Counter { client, api }
    }

    pub async fn reset(&self) -> anyhow::Result<()> {
        self.call(Method::POST, "/stats/reset", "db_queries")
            .await
            .map(|_| ())
    }

    /// Database queries since the last reset.
    pub async fn read(&self) -> anyhow::Result<u64> {
        self.call(Method::GET, "/stats", "db_queries").await
    }

    /// Buy transactions since the last reset.
    pub async fn buy_transactions(&self) -> anyhow::Result<u64> {
        self.call(Method::GET, "/stats", "buy_transactions").await
    }

    async fn call(&self, method: Method, path: &str, field: &str) -> anyhow::Result<u64> {
        let uri: Uri = format!("http://{}{path}", self.api).parse()?;
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .body(Full::new(Bytes::new()))?;
        let resp = tokio::time::timeout(REQUEST_TIMEOUT, self.client.request(req))
            .await
            .context("demo API /stats timed out")?
            .context("demo API /stats")?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if status != StatusCode::OK {
            bail!("demo API {path} answered {status}");
        }
        let v: serde_json::Value = serde_json::from_slice(&body).context("demo API /stats body")?;
        v.get(field)
            .and_then(serde_json::Value::as_u64)
            .with_context(|| format!("demo API {path}: no {field} in {v}"))
    }
}

/// Runs `phase` against `target` with `concurrency` workers and returns what happened.
pub async fn run(
    client: &HttpClient,
    counter: &Counter,
    target: SocketAddr,
    phase: &Phase,
    concurrency: usize,
) -> anyhow::Result<Outcome> {
    counter.reset().await?;
    let ids: Arc<[i64]> = phase.ids.clone().into();
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let deadline = started + PHASE_TIME_LIMIT;
    let mut workers = JoinSet::new();
    for _ in 0..concurrency.min(ids.len()).max(1) {
        let (client, ids, next) = (client.clone(), ids.clone(), next.clone());
        let expect = phase.expect;
        workers.spawn(async move {
            let mut out = Outcome::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&id) = ids.get(i) else { break };
                if Instant::now() >= deadline {
                    break;
                }
                out.sent += 1;
                get_one(&client, target, id, expect, &mut out).await;
            }
            out
        });
    }
    let mut total = Outcome {
        planned: ids.len() as u64,
        ..Outcome::default()
    };
    while let Some(joined) = workers.join_next().await {
        total.merge(joined.context("burst worker panicked")?);
    }
    total.elapsed = started.elapsed();
    total.db_queries = counter.read().await?;
    Ok(total)
}

async fn get_one(
    client: &HttpClient,
    target: SocketAddr,
    id: i64,
    expect: Expect,
    out: &mut Outcome,
) {
    let Ok(uri) = format!("http://{target}/api/items/{id}").parse::<Uri>() else {
        out.wrong_answers += 1;
        return;
    };
    let Ok(req) = Request::get(uri).body(Full::new(Bytes::new())) else {
        out.wrong_answers += 1;
        return;
    };
    let exchange = async {
        let resp = client.request(req).await?;
        let status = resp.status();
        let x_cache = resp
            .headers()
            .get("x-cache")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let body = resp.into_body().collect().await?.to_bytes();
        Ok::<_, anyhow::Error>((status, x_cache, body))
    };
    let (status, x_cache, body) = match tokio::time::timeout(REQUEST_TIMEOUT, exchange).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(_)) | Err(_) => {
            out.transport_errors += 1;
            return;
        }
    };
    *out.x_cache
        .entry(x_cache.unwrap_or_else(|| NO_X_CACHE.to_owned()))
        .or_default() += 1;
    if status.is_server_error() {
        out.server_errors += 1;
        return;
    }
    let right = match expect {
        Expect::Missing => status == StatusCode::NOT_FOUND,
        Expect::Item => {
            status == StatusCode::OK
                && serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("id").and_then(serde_json::Value::as_i64))
                    == Some(id)
        }
    };
    if !right {
        out.wrong_answers += 1;
    }
}
