//! Shared harness for the integration tests (`crate::common` in each module of the one test
//! binary, `tests/it/main.rs`).
//!
//! - [`RedisServer`]: a real `redis-server` on a free loopback port (always the real server).
//! - [`RedisCluster`]: a real six-node Redis Cluster (three primaries, three replicas).
//! - [`MariaDb`]: a real MariaDB server (the MySQL lock service's tests).
//! - [`serialized`]: serialized writes under a nemesis on any lock service (a
//!   `[locks.<name>]` section or the shared Redis), with the exclusion and fencing checkers,
//!   and the checks of a lock service down, silent or refused.
//! - [`TestOrigin`]: the fake origin API (counters, in-flight gauge, per-path behaviour);
//!   [`RawOrigin`]: one that writes the same raw bytes for every request.
//! - [`CgConfig`] / [`config_toml`] + [`start_cacheguard`]: an in-process cacheguard.
//! - [`HttpClient`]: keep-alive client; [`raw_request`] for exact headers.
//! - [`spawn_cacheguard_process`]: the real binary as a child process.
//! - [`prom`]: a Prometheus text parser for `/metrics`.
//! - [`entry`]: the L2 entry format, read back from Redis.
//! - [`TcpProxy`]: a fault-injecting TCP proxy (cut / restore / added latency), e.g. in
//!   front of a Redis server.
//! - [`fleet`]: several instances on one Redis (process fleets, coordination waits).
//! - [`load`]: a closed-loop load, and bursts released together on warm connections.
//! - [`on_started`]: one test body for every Redis topology.
//! - [`history`]: Jepsen-style operation histories and their checkers (oversell, phantom,
//!   undersell, flood factor; exclusion, fencing); [`jepsen`]: the runner (clients
//!   round-robin over a fleet, a nemesis schedule); [`shop`]: the flash-sale origin.
//! - [`lock_servers`]: real `etcd` and ZooKeeper servers for the lock services (the file the
//!   unit tests of `src/coord/locks` use too).
//! - [`alone`]: what the one test process does not share: a test that measures this process
//!   runs in one of its own ([`in_own_process`]); heavy tests take one lock ([`heavy`]).
//!
//! Every fixture owns what it started and stops it on `Drop` (by PID for processes).
#![allow(dead_code, unused_imports, unreachable_pub)]

pub mod alone;
pub mod client;
pub mod entry;
pub mod fleet;
pub mod history;
pub mod hot;
pub mod jepsen;
pub mod load;
#[path = "../../src/coord/locks/test_servers.rs"]
pub mod lock_servers;
pub mod mariadb;
pub mod origin;
pub mod process;
pub mod prom;
pub mod raw_origin;
pub mod redis_cluster;
pub mod redis_sentinel;
pub mod redis_server;
pub mod serialized;
pub mod shared;
pub mod shop;
pub mod tcp_proxy;

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use alone::{heavy, in_own_process};
pub use client::{
    HttpClient, Resp, empty_body, raw_bytes, raw_request, raw_request_from, raw_until_closed,
    stalled_get, status_of,
};
pub use mariadb::MariaDb;
pub use origin::{IdsFault, IdsFormat, TestOrigin, default_body};
pub use process::{
    CacheguardProcess, spawn_cacheguard_process, spawn_cacheguard_process_with_args,
};
pub use raw_origin::RawOrigin;
pub use redis_cluster::RedisCluster;
pub use redis_sentinel::RedisSentinel;
pub use redis_server::RedisServer;

/// A Redis of one of the topologies users pick (`redis.mode`), for a test that runs in each.
pub enum AnyRedis {
    Standalone(RedisServer),
    Sentinel(RedisSentinel),
    Cluster(RedisCluster),
}

impl AnyRedis {
    /// Every mode, by its `redis.mode` name.
    pub const MODES: [&'static str; 3] = ["standalone", "sentinel", "cluster"];

    /// Starts the topology of `mode` (a name from [`AnyRedis::MODES`]).
    pub async fn start(mode: &str) -> AnyRedis {
        match mode {
            "standalone" => AnyRedis::Standalone(RedisServer::start().await),
            "sentinel" => AnyRedis::Sentinel(RedisSentinel::start().await),
            "cluster" => AnyRedis::Cluster(RedisCluster::start().await),
            other => panic!("no Redis mode {other}"),
        }
    }

    /// The ports of its data nodes (not the sentinels).
    pub fn data_ports(&self) -> Vec<u16> {
        match self {
            AnyRedis::Standalone(r) => vec![r.port()],
            AnyRedis::Sentinel(s) => s.data_ports(),
            AnyRedis::Cluster(c) => c.ports(),
        }
    }

    /// The ports of its primaries.
    pub async fn primary_ports(&self) -> Vec<u16> {
        match self {
            AnyRedis::Standalone(r) => vec![r.port()],
            AnyRedis::Sentinel(s) => vec![s.primary_port().await.expect("the primary")],
            AnyRedis::Cluster(c) => c.primaries().await,
        }
    }

    /// A connection to each of its primaries.
    pub async fn primary_connections(&self) -> Vec<redis::aio::MultiplexedConnection> {
        let mut connections = Vec::new();
        for port in self.primary_ports().await {
            let client = redis::Client::open(redis_server::redis_url(port)).expect("url");
            connections.push(
                client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect to a primary"),
            );
        }
        connections
    }
}
pub use shared::{SharedRedis, TestConn};
pub use tcp_proxy::TcpProxy;

/// The cached route most tests use.
pub const ITEM_ROUTE: &str = r#"
[[routes]]
name = "item"
match = "/api/items/{id}"
methods = ["GET"]
"#;

/// One `[[routes]]` table: `name`, `match = pattern`, `methods = [method]`, then
/// `settings` (TOML lines such as `ttl = "4s"`; may be empty).
pub fn route(name: &str, pattern: &str, method: &str, settings: &str) -> String {
    format!(
        "\n[[routes]]\nname = {}\nmatch = {}\nmethods = [{}]\n{}\n",
        q(name),
        q(pattern),
        q(method),
        settings.trim()
    )
}

/// The `item` route of [`ITEM_ROUTE`] (`GET /api/items/{id}`) with `settings` added.
pub fn item_route(settings: &str) -> String {
    route("item", "/api/items/{id}", "GET", settings)
}

/// The `item` route and a write route on the same path, `PUT /api/items/{id}`, that
/// invalidates it.
pub fn item_write_routes() -> String {
    item_route("")
        + &route(
            "item-write",
            "/api/items/{id}",
            "PUT",
            "invalidate = [\"/api/items/{id}\"]",
        )
}

/// One `[[bloom]]` table; `source` is the TOML inline table (`{ url = "…" }`).
pub fn bloom_table(
    name: &str,
    expected_items: u64,
    fp_rate: f64,
    refresh: &str,
    source: &str,
) -> String {
    format!(
        "\n[[bloom]]\nname = {}\nexpected_items = {expected_items}\nfp_rate = {fp_rate}\n\
         refresh = {}\nsource = {source}\n",
        q(name),
        q(refresh)
    )
}

/// A `[[stock]]` gate `name` over the seats of a train (`/trains/{train}/seats/{type}`),
/// counted from the origin's `GET /internal/stock/{train}/{type}` (`{"remaining": N}`, see
/// [`set_seats`]), with `settings` added (TOML lines; may be empty).
pub fn stock_table(name: &str, settings: &str) -> String {
    format!(
        "\n[[stock]]\nname = {}\nkey = \"/trains/{{train}}/seats/{{type}}\"\n\
         source = {{ path = \"/internal/stock/{{train}}/{{type}}\", json = \"/remaining\" }}\n{}\n",
        q(name),
        settings.trim()
    )
}

/// The buy route `POST /trains/{train}/seats/{type}/orders`, taking one unit of `gate`.
pub fn buy_route(gate: &str) -> String {
    route(
        "buy",
        "/trains/{train}/seats/{type}/orders",
        "POST",
        &format!("stock = {{ gate = {}, units = 1 }}", q(gate)),
    )
}

/// The order path of seat type `kind` of `train` (the path of [`buy_route`]).
pub fn orders(train: &str, kind: &str) -> String {
    format!("/trains/{train}/seats/{kind}/orders")
}

/// Puts `remaining` seats of `kind` on `train` on sale at `origin`
/// ([`TestOrigin::set_seats`]: the count a [`stock_table`] gate loads, and buys that
/// decrement it).
pub fn set_seats(origin: &TestOrigin, train: &str, kind: &str, remaining: u64) {
    origin.set_seats(&format!("/trains/{train}/seats/{kind}"), remaining);
}

/// The KV origin's routes: `GET /kv/{key}` cached (with route-level `l1` when given), and
/// `PUT /kv/{key}`, a write route with the delayed double delete after `delay` and, when
/// `invalidate`, the pattern that invalidates the written key.
pub fn kv_routes(delay: &str, invalidate: bool, l1: Option<&str>) -> String {
    let invalidate = if invalidate {
        r#"invalidate = ["/kv/{key}"]"#
    } else {
        ""
    };
    let l1 = l1.map(|p| format!("l1 = {}", q(p))).unwrap_or_default();
    let write = format!("{invalidate}\ndouble_delete_delay = {}", q(delay));
    route("kv", "/kv/{key}", "GET", &l1) + &route("kv-write", "/kv/{key}", "PUT", &write)
}

/// GETs `/api/items/{prefix}-{i}` for `i` in `0..n`, each a cold key: every answer must be a
/// 200 MISS (in shared mode, one lock acquire each).
pub async fn cold_misses(client: &HttpClient, addr: SocketAddr, prefix: &str, n: usize) {
    for i in 0..n {
        let r = client
            .get(&url(addr, &format!("/api/items/{prefix}-{i}")))
            .await;
        assert_eq!(
            (r.status.as_u16(), r.x_cache().as_str()),
            (200, "MISS"),
            "{r}"
        );
    }
}

/// `cacheguard_lock_events_total{outcome}` on the instance whose admin listener is `admin`.
pub async fn lock_events(client: &HttpClient, admin: SocketAddr, outcome: &str) -> f64 {
    metrics(client, admin).await.lock_events(outcome)
}

/// Runs `test` on the fixture `start` makes (a standalone Redis, a cluster, …), so one
/// test body serves every topology.
pub async fn on_started<R>(start: impl Future<Output = R>, test: impl AsyncFnOnce(&R)) {
    test(&start.await).await;
}

/// A free loopback port: bind `127.0.0.1:0`, read the port, drop the listener.
pub fn free_port() -> u16 {
    for _ in 0..20 {
        if let Ok(l) = std::net::TcpListener::bind("127.0.0.1:0")
            && let Ok(addr) = l.local_addr()
        {
            return addr.port();
        }
    }
    panic!("no free loopback port");
}

/// Builds the usual TOML config. Each section is an ordered list of `key = <toml value>`
/// lines; [`CgConfig::set`] replaces or adds one.
#[derive(Clone, Debug)]
pub struct CgConfig {
    sections: Vec<(String, Vec<(String, String)>)>,
    routes: String,
}

fn q(s: &str) -> String {
    format!("{s:?}")
}

impl CgConfig {
    /// Defaults: embedded mode, both listeners on `127.0.0.1:0`, the `[cache]` values of the
    /// contract (ttl 60s, jitter 0.2, grace 30s, negative_ttl 10s), and [`ITEM_ROUTE`].
    pub fn new(origin: &TestOrigin) -> CgConfig {
        CgConfig::with_upstream(&origin.url())
    }

    pub fn with_upstream(url: &str) -> CgConfig {
        let s = |v: &[(&str, String)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(k, v)| ((*k).to_string(), v.clone()))
                .collect()
        };
        CgConfig {
            sections: vec![
                (
                    "server".into(),
                    s(&[
                        ("listen", q("127.0.0.1:0")),
                        ("max_header_bytes", "16384".into()),
                        ("max_body_bytes", "10485760".into()),
                    ]),
                ),
                (
                    "upstream".into(),
                    s(&[
                        ("url", q(url)),
                        ("timeout", q("10s")),
                        ("max_concurrency", "256".into()),
                        ("queue_timeout", q("1s")),
                    ]),
                ),
                ("admin".into(), s(&[("listen", q("127.0.0.1:0"))])),
                (
                    "cache".into(),
                    s(&[
                        ("ttl", q("60s")),
                        ("jitter", "0.2".into()),
                        ("grace", q("30s")),
                        ("negative_ttl", q("10s")),
                        ("max_entry_bytes", "1048576".into()),
                        ("l1", q("hot")),
                    ]),
                ),
                ("lock".into(), s(&[("lease", q("5s"))])),
            ],
            routes: ITEM_ROUTE.to_string(),
        }
    }

    /// Shared mode against `redis` (command_timeout 200ms: generous for a loaded CI box).
    /// Unless `[journal] path` is set, every [`CgConfig::toml`] (so every start) gets a
    /// journal file of its own ([`fresh_journal_path`]): two instances never share one.
    pub fn redis(self, redis: &RedisServer) -> CgConfig {
        self.set("redis", "url", &q(&redis.url()))
            .set("redis", "command_timeout", &q("200ms"))
    }

    /// Shared mode against a Redis Cluster, seeded with every node.
    pub fn redis_cluster(self, cluster: &RedisCluster) -> CgConfig {
        let urls: Vec<String> = cluster.urls().iter().map(|u| q(u)).collect();
        self.set_str("redis", "mode", "cluster")
            .set("redis", "urls", &format!("[{}]", urls.join(", ")))
            .set("redis", "command_timeout", &q("200ms"))
    }

    /// Shared mode against a Sentinel-managed primary.
    pub fn redis_sentinel(self, sentinel: &RedisSentinel) -> CgConfig {
        let urls: Vec<String> = sentinel.sentinel_urls().iter().map(|u| q(u)).collect();
        self.set_str("redis", "mode", "sentinel")
            .set("redis", "urls", &format!("[{}]", urls.join(", ")))
            .set_str("redis", "master_name", redis_sentinel::MASTER_NAME)
            .set("redis", "command_timeout", &q("200ms"))
    }

    /// Shared mode against `redis`, whichever topology it is.
    pub fn any_redis(self, redis: &AnyRedis) -> CgConfig {
        match redis {
            AnyRedis::Standalone(r) => self.redis(r),
            AnyRedis::Sentinel(s) => self.redis_sentinel(s),
            AnyRedis::Cluster(c) => self.redis_cluster(c),
        }
    }

    /// Sets `key = value` in `[section]`; `value` is TOML (quote strings: `"\"10s\""`).
    /// A `redis.command_timeout` raises `lock.lease` to 3 times it when the lease is shorter
    /// (configuration refuses a lease the holder cannot renew in time).
    pub fn set(mut self, section: &str, key: &str, value: &str) -> CgConfig {
        if section == "redis"
            && key == "command_timeout"
            && let Some(timeout) = toml_millis(value)
        {
            let lease = self
                .get("lock", "lease")
                .and_then(|lease| toml_millis(&lease))
                .unwrap_or(5_000);
            if lease < 3 * timeout {
                self = self.set("lock", "lease", &q(&format!("{}ms", 3 * timeout)));
            }
        }
        self.set_raw(section, key, value)
    }

    /// The TOML value of `key` in `[section]`, if set.
    fn get(&self, section: &str, key: &str) -> Option<String> {
        let (_, entries) = self.sections.iter().find(|(name, _)| name == section)?;
        entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn set_raw(mut self, section: &str, key: &str, value: &str) -> CgConfig {
        let idx = match self.sections.iter().position(|(name, _)| name == section) {
            Some(i) => i,
            None => {
                self.sections.push((section.to_string(), Vec::new()));
                self.sections.len() - 1
            }
        };
        let entries = &mut self.sections[idx].1;
        match entries.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value.to_string(),
            None => entries.push((key.to_string(), value.to_string())),
        }
        self
    }

    /// Sets a string value (quoted for you).
    pub fn set_str(self, section: &str, key: &str, value: &str) -> CgConfig {
        self.set(section, key, &q(value))
    }

    /// Removes `key` from `[section]` (e.g. to rely on a default).
    pub fn unset(mut self, section: &str, key: &str) -> CgConfig {
        if let Some((_, entries)) = self.sections.iter_mut().find(|(n, _)| n == section) {
            entries.retain(|(k, _)| k != key);
        }
        self
    }

    /// `l1 = "hot" | "all" | "off"` in `[cache]`.
    pub fn l1(self, policy: &str) -> CgConfig {
        self.set_str("cache", "l1", policy)
    }

    /// Both listeners on fixed loopback ports (a process needs them: see
    /// [`spawn_cacheguard_process`]).
    pub fn listen_on(self, port: u16, admin_port: u16) -> CgConfig {
        self.set_str("server", "listen", &format!("127.0.0.1:{port}"))
            .set_str("admin", "listen", &format!("127.0.0.1:{admin_port}"))
    }

    /// Both listeners on free loopback ports of their own ([`CgConfig::listen_on`]).
    pub fn on_free_ports(self) -> CgConfig {
        self.listen_on(free_port(), free_port())
    }

    /// Writes [`CgConfig::toml`] to `path` and returns it.
    pub fn write_to(&self, path: &std::path::Path) -> std::path::PathBuf {
        std::fs::write(path, self.toml())
            .unwrap_or_else(|e| panic!("write config {}: {e}", path.display()));
        path.to_path_buf()
    }

    /// Replaces the `[[routes]]` text.
    pub fn routes(mut self, routes: &str) -> CgConfig {
        self.routes = routes.to_string();
        self
    }

    pub fn toml(&self) -> String {
        let mut out = String::new();
        let shared = self.sections.iter().any(|(name, _)| name == "redis");
        let journal_set = self
            .sections
            .iter()
            .any(|(name, e)| name == "journal" && e.iter().any(|(k, _)| k == "path"));
        if shared && !journal_set {
            let path = fresh_journal_path().display().to_string();
            out.push_str(&format!("[journal]\npath = {}\n\n", q(&path)));
        }
        for (name, entries) in &self.sections {
            out.push_str(&format!("[{name}]\n"));
            for (k, v) in entries {
                out.push_str(&format!("{k} = {v}\n"));
            }
            out.push('\n');
        }
        out.push_str(&self.routes);
        out
    }

    pub async fn start(&self) -> cacheguard::Running {
        start_cacheguard(&self.toml()).await
    }
}

/// A journal path no other instance uses (under cargo's per-target temp dir). Reuse one
/// to restart an instance on the same journal.
pub fn fresh_journal_path() -> std::path::PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("journals");
    std::fs::create_dir_all(&dir).expect("create the journals dir");
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!(
        "{}-{n}-{:08x}.journal",
        std::process::id(),
        rand_u32()
    ));
    let _ = std::fs::remove_file(&path);
    path
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish() as u32
}

/// The usual config file text: embedded mode without `redis`, shared mode with it.
pub fn config_toml(origin: &TestOrigin, redis: Option<&RedisServer>, routes_toml: &str) -> String {
    let mut cfg = CgConfig::new(origin).routes(routes_toml);
    if let Some(r) = redis {
        cfg = cfg.redis(r);
    }
    cfg.toml()
}

/// Parses `toml` as `test.toml` (no environment overrides) and starts cacheguard in-process.
pub async fn start_cacheguard(toml: &str) -> cacheguard::Running {
    let vars = HashMap::<String, String>::new();
    let config = cacheguard::Config::from_toml(toml, "test.toml", &vars)
        .unwrap_or_else(|e| panic!("config rejected:\n{e}\n--- config ---\n{toml}"));
    tokio::time::timeout(Duration::from_secs(15), cacheguard::App::start(config))
        .await
        .unwrap_or_else(|_| panic!("App::start did not return within 15s"))
        .unwrap_or_else(|e| panic!("App::start failed: {e:#}\n--- config ---\n{toml}"))
}

/// A quoted TOML duration (`"500ms"`, `"2s"`) in milliseconds.
fn toml_millis(value: &str) -> Option<u64> {
    let text = value.trim().trim_matches('"');
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse().ok();
    }
    text.strip_suffix('s')?
        .parse::<u64>()
        .ok()
        .map(|s| s * 1000)
}

/// `http://ADDR{path}`
pub fn url(addr: SocketAddr, path: &str) -> String {
    format!("http://{addr}{path}")
}

/// Waits (bounded) until the origin has received `n` requests for `path`; returns when.
pub async fn wait_origin_count(
    origin: &TestOrigin,
    path: &str,
    n: u64,
    timeout: Duration,
) -> Instant {
    poll_until(timeout, Duration::from_millis(2), || async {
        (origin.count(path) >= n).then(Instant::now)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "origin did not receive request #{n} for {path} within {timeout:?} (count {})",
            origin.count(path)
        )
    })
}

/// Polls `check` every `every` until it returns `Some`, or gives up at `timeout`.
pub async fn poll_until<T, F, Fut>(timeout: Duration, every: Duration, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(every).await;
    }
}

/// Runs `n` copies of `f(i)` concurrently (all spawned at once), bounded by `timeout`
/// overall; results in index order.
pub async fn concurrently<T, F, Fut>(n: usize, timeout: Duration, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let handles: Vec<_> = (0..n).map(|i| tokio::spawn(f(i))).collect();
    join_within(handles, timeout, &format!("{n} concurrent tasks")).await
}

/// Runs `f(i)` for `i in 0..n` with at most `width` in flight, bounded by `timeout` overall.
pub async fn bounded_parallel<T, F, Fut>(n: usize, width: usize, timeout: Duration, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(width));
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let sem = sem.clone();
            let fut = f(i);
            tokio::spawn(async move {
                let _permit = sem.acquire_owned().await.expect("semaphore");
                fut.await
            })
        })
        .collect();
    join_within(handles, timeout, &format!("{n} tasks")).await
}

/// Joins `handles` in order, bounded by `timeout` overall; panics naming `what` when a task
/// panicked or the time ran out.
pub async fn join_within<T>(handles: Vec<JoinHandle<T>>, timeout: Duration, what: &str) -> Vec<T> {
    let all = async {
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            out.push(
                h.await
                    .unwrap_or_else(|e| panic!("{what}: a task panicked: {e}")),
            );
        }
        out
    };
    tokio::time::timeout(timeout, all)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {timeout:?}"))
}

/// `POST /admin/purge` with `body` (JSON) on `admin`, with the admin token `auth` if any.
pub async fn purge(client: &HttpClient, admin: SocketAddr, auth: Option<&str>, body: &str) -> Resp {
    let header = auth.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = header
        .as_deref()
        .map(|h| vec![("authorization", h), ("content-type", "application/json")])
        .unwrap_or_else(|| vec![("content-type", "application/json")]);
    post(client, &url(admin, "/admin/purge"), &headers, body).await
}

/// POST `body` to `url` with extra headers; panics on a transport error.
pub async fn post(client: &HttpClient, url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    client
        .request(
            http::Method::POST,
            url,
            headers,
            client::full_body(body.to_owned()),
        )
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"))
}

/// GET `/metrics` on the admin listener and parse it.
pub async fn scrape(client: &HttpClient, admin: SocketAddr) -> (String, prom::Exposition) {
    let resp = client.get(&url(admin, "/metrics")).await;
    assert_eq!(resp.status, 200, "/metrics: {resp}");
    let text = resp.text();
    let exp = prom::parse(&text).unwrap_or_else(|e| panic!("/metrics does not parse: {e}"));
    (text, exp)
}

/// `admin`'s `/metrics`, parsed.
pub async fn metrics(client: &HttpClient, admin: SocketAddr) -> prom::Exposition {
    scrape(client, admin).await.1
}

/// The sum of `name{labels}` over the series of `admin`'s `/metrics`.
pub async fn metric(
    client: &HttpClient,
    admin: SocketAddr,
    name: &str,
    labels: &[(&str, &str)],
) -> f64 {
    metrics(client, admin).await.sum(name, labels)
}

/// Polls `admin`'s `/metrics` every `every` until `pred` holds for `name{labels}` (summed
/// over the matching series) and returns that value; panics with the last value after
/// `timeout`. `poke` runs before every poll (traffic that makes the condition come true;
/// [`no_poke`] for none).
#[allow(clippy::too_many_arguments)]
pub async fn wait_metric<F, Fut>(
    client: &HttpClient,
    admin: SocketAddr,
    name: &str,
    labels: &[(&str, &str)],
    timeout: Duration,
    every: Duration,
    pred: impl Fn(f64) -> bool,
    mut poke: F,
) -> f64
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let pred = &pred;
    let found = poll_until(timeout, every, || {
        let poked = poke();
        async move {
            poked.await;
            let v = metric(client, admin, name, labels).await;
            pred(v).then_some(v)
        }
    })
    .await;
    match found {
        Some(v) => v,
        None => panic!(
            "{name}{labels:?} on {admin} did not reach the expected value within {timeout:?}; \
             last {}",
            metric(client, admin, name, labels).await
        ),
    }
}

/// The `poke` of a [`wait_metric`] that needs no traffic.
pub async fn no_poke() {}

/// `GET /admin/redis` (the topology report) as JSON.
pub async fn admin_redis(client: &HttpClient, admin: SocketAddr) -> serde_json::Value {
    let r = client.get(&url(admin, "/admin/redis")).await;
    assert_eq!(r.status, 200, "{r}");
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("/admin/redis: {e}: {r}"))
}

/// `PUT path` with a small body through cacheguard at `addr` (a write route).
pub async fn put(client: &HttpClient, addr: SocketAddr, path: &str) -> Resp {
    client
        .request(
            http::Method::PUT,
            &url(addr, path),
            &[],
            client::full_body("x"),
        )
        .await
        .unwrap_or_else(|e| panic!("PUT {path}: {e}"))
}

/// Hop-by-hop request headers as a client sends them (`connection` names `x-hop`).
pub const HOP_REQUEST: [(&str, &str); 7] = [
    ("connection", "x-hop"),
    ("x-hop", "1"),
    ("keep-alive", "timeout=5"),
    ("te", "trailers"),
    ("upgrade", "websocket"),
    ("proxy-authorization", "Basic c2VjcmV0"),
    ("proxy-connection", "keep-alive"),
];

/// Hop-by-hop response headers as an origin sends them (`connection` names `x-resp-hop`).
pub const HOP_RESPONSE: [(&str, &str); 5] = [
    ("connection", "x-resp-hop"),
    ("x-resp-hop", "1"),
    ("keep-alive", "timeout=5"),
    ("proxy-authenticate", "Basic realm=\"origin\""),
    ("upgrade", "foo/1"),
];

/// The names in `headers` other than `connection` (the ones it names, and the standard
/// hop-by-hop ones).
pub fn hop_names(headers: &[(&'static str, &'static str)]) -> Vec<&'static str> {
    headers
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| *name != "connection")
        .collect()
}

/// Makes `/hop` on `origin` echo the request body and answer with [`HOP_RESPONSE`] plus
/// `extra` headers.
pub fn serve_hop(origin: &TestOrigin, extra: &[(&str, &str)]) {
    origin.set_echo("/hop");
    origin.set_headers("/hop", HOP_RESPONSE.iter().chain(extra).copied());
}

/// `POST /hop` with body `hello` on a fresh connection to `addr`, sending `Host`,
/// [`HOP_REQUEST`] and `extra` headers exactly as given.
pub async fn post_hop(addr: SocketAddr, extra: &[(&str, &str)]) -> Resp {
    let host = addr.to_string();
    let headers: Vec<(&str, &str)> = [("host", host.as_str())]
        .into_iter()
        .chain(HOP_REQUEST)
        .chain(extra.iter().copied())
        .collect();
    raw_request(
        addr,
        http::Method::POST,
        "/hop",
        &headers,
        client::full_body("hello"),
    )
    .await
    .expect("raw POST")
}

/// Starts cacheguard from the config file at `path` and watches the file for changes (a
/// reload on each), as the binary does.
pub async fn start_watching(path: &std::path::Path) -> cacheguard::Running {
    let vars = HashMap::<String, String>::new();
    let config = cacheguard::Config::load(path, &vars).expect("config loads");
    let mut running = cacheguard::App::start(config).await.expect("starts");
    running.watch_config(path.to_path_buf(), std::sync::Arc::new(vars));
    running
}

/// Writes the file the way editors do: a new file renamed over the old one.
pub fn replace_file(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write config");
    std::fs::rename(&tmp, path).expect("rename config");
}
