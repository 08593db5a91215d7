//! The admin listener's status page (`/`, `/status`, `/status.json`), against a real
//! `redis-server` in shared mode and a real origin.
//!
//! - `status_json_has_every_field_and_the_page_escapes_client_strings` reads the page and
//!   its JSON over HTTP: every field is there (a stock gate's decisions after a sale, a
//!   replay and a key reused with another body among them), paths and keys chosen by clients
//!   are escaped, and neither the admin token nor the Redis password shows.
//! - `the_page_in_a_real_browser` opens the page in Debian's `chromium`, headless, under a
//!   background load with one hot key and a crowd buying sold-out seats: the charts fill
//!   (the stock gate's admitted and sold-out lines among them), the hit ratio, the hot key,
//!   the gate's numbers and the breaker state are on the page; with Redis killed the page
//!   says the breaker is open; with JavaScript off the numbers are still there and no chart
//!   was drawn. It saves a
//!   screenshot to `target/test-artifacts/status-page.png`.
//!
//! The browser is driven through its command line only: `--dump-dom` with
//! `--virtual-time-budget` runs the page's script (virtual time waits for its fetches) and
//! prints the DOM. JavaScript is turned off through the profile's content setting
//! (`--blink-settings=scriptEnabled=false` also stops `--dump-dom` from printing anything).
//! Each load is one chromium process with a profile of its own, killed by PID if a test
//! ends while it runs; it resolves no name and reaches only the loopback listener.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use http::Method;
use serde_json::Value;
use tokio::io::AsyncReadExt;
use tokio::time::Instant;

use crate::common::hot::{hot_list, hotkeys};
use crate::common::load::Load;
use crate::common::{
    CgConfig, HttpClient, RedisServer, TestOrigin, bloom_table, buy_route, empty_body, item_route,
    orders, poll_until, post, raw_request, route, set_seats, stock_table, url,
};

const HOT_PATH: &str = "/api/items/hot";
const ADMIN_TOKEN: &str = "admin-token-7d1c90";
const REDIS_PASSWORD: &str = "redis-pass-3be4f2";
/// A path whose quotes and ampersand would break out of an attribute if not escaped (`<` and
/// `>` never reach the proxy in a path: the HTTP parser refuses them).
const NASTY_PATH: &str = r#"/api/items/x"onmouseover="alert(1)"'&"#;
/// A header value keyed into the cache key (the route varies on it), so into hot keys.
const NASTY_TAG: &str = "<script>alert(1)</script>";
/// The stock gate, and the seats its resource has at the origin.
const GATE: &str = "seats";
const SEATS: u64 = 5;

// === the setup both tests share ===

/// A Redis that wants [`REDIS_PASSWORD`] (set on the harness's own connection, which stays
/// logged in).
async fn redis_with_password() -> RedisServer {
    let redis = RedisServer::start().await;
    let mut con = redis.client().await;
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg(REDIS_PASSWORD)
        .query_async::<()>(&mut con)
        .await
        .expect("CONFIG SET requirepass");
    redis
}

/// Shared mode on `redis` (its password in the URL), an admin token, quick hot keys, an
/// origin rate cap, one Bloom filter and one stock gate (`buy`); `item` varies on `x-tag`.
fn config(origin: &TestOrigin, redis: &RedisServer) -> CgConfig {
    let bloom_route = route(
        "other",
        "/api/other/{id}",
        "GET",
        r#"bloom = { filter = "ids", param = "id" }"#,
    );
    CgConfig::new(origin)
        .redis(redis)
        .set_str(
            "redis",
            "url",
            &format!("redis://:{REDIS_PASSWORD}@127.0.0.1:{}", redis.port()),
        )
        // A loaded two-core box with a browser beside it: a slow answer must not open the
        // breaker before the test kills Redis.
        .set_str("redis", "command_timeout", "1s")
        .set_str("admin", "token", ADMIN_TOKEN)
        .set("upstream", "max_rps", "500")
        .set("hot_keys", "threshold_rps", "20")
        .set_str("hot_keys", "window", "250ms")
        .routes(
            &(item_route(r#"vary = ["x-tag"]"#)
                + &bloom_route
                + &bloom_table("ids", 1000, 0.01, "10m", r#"{ url = "/internal/ids" }"#)
                + &buy_route(GATE)
                + &stock_table(GATE, "")),
        )
}

/// The origin: items, ids for the filter, and [`SEATS`] seats on train t1.
async fn origin() -> TestOrigin {
    let origin = TestOrigin::builder().ids(["1", "2", "3"]).start().await;
    set_seats(&origin, "t1", "a", SEATS);
    origin
}

/// One buy of a seat on train t1, with an idempotency key when given.
async fn buy(
    client: &HttpClient,
    addr: std::net::SocketAddr,
    key: Option<&str>,
    body: &str,
) -> u16 {
    let headers: Vec<(&str, &str)> = key.map(|k| ("idempotency-key", k)).into_iter().collect();
    post(client, &url(addr, &orders("t1", "a")), &headers, body)
        .await
        .status
        .as_u16()
}

/// Keeps buying seats on train t1 while it lives (every 50 ms): after the first few, the
/// gate answers sold out.
fn crowd(addr: std::net::SocketAddr) -> Repeating {
    Repeating::start(
        addr,
        Method::POST,
        orders("t1", "a"),
        &[],
        Duration::from_millis(50),
    )
}

/// Keeps `/api/items/hot` with `x-tag: <script>…` hot while it lives: requests in a row,
/// far above `threshold_rps` however slow the build.
fn nasty_hot_key(addr: std::net::SocketAddr) -> Repeating {
    Repeating::start(
        addr,
        Method::GET,
        HOT_PATH.to_owned(),
        &[("x-tag", NASTY_TAG)],
        Duration::ZERO,
    )
}

/// One request sent again and again (after `pause` each time) while it lives, for at most
/// two minutes.
struct Repeating(tokio::task::JoinHandle<()>);

impl Repeating {
    fn start(
        addr: std::net::SocketAddr,
        method: Method,
        path: String,
        headers: &[(&'static str, &'static str)],
        pause: Duration,
    ) -> Repeating {
        let headers = headers.to_vec();
        Repeating(tokio::spawn(async move {
            let client = HttpClient::new();
            let deadline = Instant::now() + Duration::from_secs(120);
            while Instant::now() < deadline {
                // Errors only while the instance shuts down, before this is dropped.
                let _ = client
                    .request(method.clone(), &url(addr, &path), &headers, empty_body())
                    .await;
                tokio::time::sleep(pause).await;
            }
        }))
    }
}

impl Drop for Repeating {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An answer cacheguard makes itself for [`NASTY_PATH`]: a GET that declares a body over
/// `server.max_body_bytes` (413).
async fn own_answer_for_nasty_path(addr: std::net::SocketAddr) {
    let host = addr.to_string();
    let r = raw_request(
        addr,
        Method::GET,
        NASTY_PATH,
        &[("host", &host), ("content-length", "99999999999")],
        empty_body(),
    )
    .await
    .expect("GET the nasty path");
    assert_eq!(r.status, 413, "{r}");
}

async fn wait_hot(client: &HttpClient, admin: std::net::SocketAddr, what: &str) {
    let hot = poll_until(
        Duration::from_secs(15),
        Duration::from_millis(50),
        || async {
            let list = hot_list(&hotkeys(client, admin).await);
            list.iter()
                .any(|h| h["key"].as_str().is_some_and(|k| k.contains(what)))
                .then_some(())
        },
    )
    .await;
    assert!(
        hot.is_some(),
        "{what} did not become hot within 15 s: {}",
        hotkeys(client, admin).await
    );
}

async fn status_json(client: &HttpClient, admin: std::net::SocketAddr, since: u64) -> Value {
    let r = client
        .get(&url(admin, &format!("/status.json?since={since}")))
        .await;
    assert_eq!(r.status, 200, "{r}");
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("/status.json: {e}: {r}"))
}

/// Waits until the sampler has taken `n` samples.
async fn wait_samples(client: &HttpClient, admin: std::net::SocketAddr, n: usize) {
    let filled = poll_until(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let history = status_json(client, admin, 0).await["history"].clone();
            (history.as_array().map_or(0, Vec::len) >= n).then_some(())
        },
    )
    .await;
    assert!(filled.is_some(), "fewer than {n} samples after 30 s");
}

// === over HTTP ===

/// The keys of `value` at `path` (an object), for a failure message and the field check.
fn assert_fields(value: &Value, at: &str, fields: &[&str]) {
    let object = value
        .as_object()
        .unwrap_or_else(|| panic!("{at} is not an object: {value}"));
    for field in fields {
        assert!(
            object.contains_key(*field),
            "{at} has no {field:?}: {value}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_has_every_field_and_the_page_escapes_client_strings() {
    let redis = redis_with_password().await;
    let origin = origin().await;
    let cg = config(&origin, &redis).start().await;
    let (addr, admin) = (cg.addr(), cg.admin_addr());
    let client = HttpClient::new();

    // The sale: a keyed buy, its replay, its key with another body (422), then more buys
    // than there are seats.
    assert_eq!(buy(&client, addr, Some("k1"), "a").await, 200);
    assert_eq!(buy(&client, addr, Some("k1"), "a").await, 200, "the replay");
    assert_eq!(buy(&client, addr, Some("k1"), "b").await, 422);
    let mut statuses = Vec::new();
    for _ in 0..3 * SEATS {
        statuses.push(buy(&client, addr, None, "").await);
    }
    assert!(statuses.contains(&409), "never sold out: {statuses:?}");
    // After the 422: the newest of cacheguard's own answers.
    own_answer_for_nasty_path(addr).await;
    let _hot = nasty_hot_key(addr);
    wait_hot(&client, admin, NASTY_TAG).await;
    wait_samples(&client, admin, 2).await;

    let s = status_json(&client, admin, 0).await;
    assert_fields(
        &s,
        "/status.json",
        &[
            "now_unix_ms",
            "started_unix_ms",
            "mode",
            "config_generation",
            "sample_every_ms",
            "rate_window_ms",
            "routes",
            "origin",
            "redis",
            "bloom",
            "journal",
            "locks",
            "hot_keys",
            "hot_keys_total",
            "recent_errors",
            "stock",
            "history",
        ],
    );
    assert_eq!(s["mode"], "shared");
    let item = s["routes"]
        .as_array()
        .and_then(|routes| routes.iter().find(|r| r["name"] == "item"))
        .unwrap_or_else(|| panic!("no item route: {s}"));
    assert_fields(
        item,
        "routes[item]",
        &[
            "name",
            "requests_per_second",
            "hit_ratio",
            "hit_ratio_since_start",
            "outcomes",
            "total",
        ],
    );
    assert_fields(
        &item["outcomes"],
        "routes[item].outcomes",
        &[
            "hit_l1",
            "hit_l2",
            "coalesced",
            "miss",
            "stale",
            "bypass",
            "error",
            "reject",
            "negative",
            "revalidated",
            "sold_out",
            "replayed",
        ],
    );
    assert!(item["total"].as_u64() >= Some(20), "{item}");
    assert!(item["hit_ratio_since_start"].as_f64() > Some(0.5), "{item}");
    assert!(
        s["routes"]
            .as_array()
            .is_some_and(|r| r.iter().any(|r| r["name"] == "_passthrough")),
        "{s}"
    );
    assert_fields(
        &s["origin"],
        "origin",
        &[
            "in_flight",
            "max_concurrency",
            "requests_per_second",
            "max_rps",
            "requests_total",
        ],
    );
    assert_eq!(s["origin"]["max_concurrency"], 256);
    assert_eq!(s["origin"]["max_rps"], 500);
    assert_fields(
        &s["redis"],
        "redis",
        &["breaker", "topology_text", "topology", "event_bus"],
    );
    assert_eq!(s["redis"]["breaker"], "closed");
    assert_eq!(s["redis"]["topology"]["mode"], "standalone");
    let bloom = &s["bloom"][0];
    assert_fields(
        bloom,
        "bloom[0]",
        &[
            "name",
            "state",
            "items",
            "expected_items",
            "fill",
            "estimated_fp_rate",
            "configured_fp_rate",
        ],
    );
    assert_eq!(bloom["name"], "ids");
    assert_fields(
        &s["journal"],
        "journal",
        &[
            "enabled",
            "depth",
            "oldest_pending_seconds",
            "failing",
            "held",
        ],
    );
    assert_fields(
        &s["locks"],
        "locks",
        &["waiting", "waits", "wait_seconds", "wait_timeouts"],
    );
    let hot = &s["hot_keys"][0];
    assert_fields(
        hot,
        "hot_keys[0]",
        &["key", "hash", "rate", "since_unix_ms", "promoted_from"],
    );
    assert!(
        hot["key"]
            .as_str()
            .is_some_and(|k| k.contains(HOT_PATH) && k.contains(NASTY_TAG)),
        "{hot}"
    );
    let error = &s["recent_errors"][0];
    assert_fields(
        error,
        "recent_errors[0]",
        &["unix_ms", "route", "method", "path", "status", "reason"],
    );
    assert_eq!(error["path"], NASTY_PATH);
    assert_eq!(error["status"], 413);
    let gate = &s["stock"][0];
    assert_fields(
        gate,
        "stock[0]",
        &[
            "name",
            "admitted_per_second",
            "sold_out_per_second",
            "decisions",
            "settled",
            "reconciles",
            "reconciles_failed",
            "reconcile_delta",
            "redis_errors",
        ],
    );
    assert_eq!(gate["name"], GATE);
    assert_fields(
        &gate["decisions"],
        "stock[0].decisions",
        &[
            "admitted",
            "retried",
            "sold_out_local",
            "sold_out_redis",
            "replayed",
            "in_flight",
            "mismatch",
            "bad_key",
            "unavailable",
            "ungated",
            "not_loaded",
        ],
    );
    assert_fields(
        &gate["settled"],
        "stock[0].settled",
        &["sold", "returned", "origin_sold_out", "in_doubt"],
    );
    let decisions = &gate["decisions"];
    assert_eq!(decisions["admitted"], SEATS, "{gate}");
    let sold_out = decisions["sold_out_local"].as_u64().unwrap_or(0)
        + decisions["sold_out_redis"].as_u64().unwrap_or(0);
    assert_eq!(
        sold_out,
        statuses.iter().filter(|s| **s == 409).count() as u64,
        "{gate}"
    );
    assert_eq!(decisions["replayed"], 1, "{gate}");
    assert_eq!(decisions["mismatch"], 1, "{gate}");
    assert_eq!(gate["settled"]["sold"], decisions["admitted"], "{gate}");
    assert!(
        gate["reconciles"].as_u64() >= Some(1),
        "the first load: {gate}"
    );
    assert_eq!(item_outcome(&s, "buy", "sold_out"), sold_out, "{s}");
    let history = s["history"].as_array().expect("history");
    let last = history.last().expect("a sample");
    assert_fields(
        last,
        "history[last]",
        &[
            "t",
            "routes",
            "origin_rps",
            "origin_in_flight",
            "max_concurrency",
            "max_rps",
            "redis_up",
        ],
    );
    assert_fields(
        &last["routes"]["item"],
        "history[last].routes.item",
        &["rps", "hit_ratio"],
    );
    assert_fields(
        &last["gates"][GATE],
        "history[last].gates.seats",
        &["admitted", "sold_out"],
    );
    // Only what is newer than `since`.
    let t = last["t"].as_u64().expect("t");
    let newer = status_json(&client, admin, t).await;
    assert!(
        newer["history"]
            .as_array()
            .is_some_and(|h| h.iter().all(|p| p["t"].as_u64() > Some(t))),
        "{newer}"
    );

    for path in ["/", "/status"] {
        let r = client.get(&url(admin, path)).await;
        assert_eq!(r.status, 200, "{r}");
        assert_eq!(
            r.header("content-type").as_deref(),
            Some("text/html; charset=utf-8")
        );
        let page = r.text();
        let csp = r.header("content-security-policy").unwrap_or_default();
        let nonce = csp
            .split("'nonce-")
            .nth(1)
            .and_then(|rest| rest.split('\'').next())
            .unwrap_or_else(|| panic!("no script nonce in the CSP {csp:?}"));
        assert!(
            page.contains(&format!("<script nonce=\"{nonce}\">")),
            "the page's script does not carry the CSP's nonce"
        );
        assert!(!page.contains("{{"), "a slot left unfilled");
        // The path, escaped for an element and an attribute alike.
        assert!(
            page.contains("/api/items/x&quot;onmouseover=&quot;alert(1)&quot;&#39;&amp;"),
            "the nasty path is not in the page, escaped"
        );
        assert!(
            !page.contains(r#"x"onmouseover"#),
            "the nasty path, unescaped"
        );
        // The hot key's header value.
        assert!(
            page.contains("x-tag=&lt;script&gt;alert(1)&lt;/script&gt;"),
            "the hot key with its x-tag is not in the page, escaped"
        );
        assert!(
            !page.contains("<script>alert"),
            "a client's script in the page"
        );
        assert_eq!(
            page.matches("<script").count(),
            1,
            "one script: the page's own"
        );
        assert!(page.contains(r#"<td id="breaker-state" data-state="closed">closed</td>"#));
        assert!(page.contains(r#"<tr data-route="item">"#));
        assert!(page.contains(r#"<tr data-gate="seats"><td class="name">seats</td>"#));
        assert!(page.contains(r#"<svg id="chart-stock-0""#));
        for secret in [ADMIN_TOKEN, REDIS_PASSWORD] {
            assert!(!page.contains(secret), "{path} shows a secret");
        }
    }
    let json = client.get(&url(admin, "/status.json")).await.text();
    for secret in [ADMIN_TOKEN, REDIS_PASSWORD] {
        assert!(!json.contains(secret), "/status.json shows a secret");
    }
    // Read-only.
    let r = client
        .request(Method::POST, &url(admin, "/status"), &[], empty_body())
        .await
        .expect("POST /status");
    assert_eq!(r.status, 405, "{r}");
    cg.shutdown().await;
}

/// Route `route`'s count of answers with `outcome` in a `/status.json` document.
fn item_outcome(s: &Value, route: &str, outcome: &str) -> u64 {
    s["routes"]
        .as_array()
        .and_then(|routes| routes.iter().find(|r| r["name"] == route))
        .and_then(|r| r["outcomes"][outcome].as_u64())
        .unwrap_or(0)
}

// === in a browser ===

/// Debian's `chromium`, headless; every page load is a process of its own.
struct Chromium {
    binary: PathBuf,
}

/// Whether the page's script may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Script {
    On,
    Off,
}

/// One chromium process, killed by its PID when dropped before it exited (a test that
/// failed or timed out while it ran).
struct Browser {
    child: tokio::process::Child,
}

impl Drop for Browser {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.start_kill();
        }
    }
}

/// How long one page load may take, start to exit.
const BROWSER_LIMIT: Duration = Duration::from_secs(60);

impl Chromium {
    /// Finds `chromium` on `PATH`.
    ///
    /// # Panics
    /// When there is none, saying how to install it.
    fn find() -> Chromium {
        let binary = std::env::var_os("PATH")
            .iter()
            .flat_map(std::env::split_paths)
            .map(|dir| dir.join("chromium"))
            .find(|path| path.is_file())
            .unwrap_or_else(|| {
                panic!(
                    "chromium is not installed: this test opens the status page in Debian's \
                     headless chromium. Install it with `apt-get install chromium` \
                     (scripts/test.sh does)."
                )
            });
        Chromium { binary }
    }

    /// Loads `url` and returns what chromium printed (`args` say what: `--dump-dom`, or
    /// `--screenshot`), after `budget` of the page's virtual time.
    async fn run(&self, url: &str, script: Script, budget: Duration, args: &[String]) -> String {
        let profile = tempfile::tempdir().expect("a profile directory");
        if script == Script::Off {
            // The content setting "JavaScript: blocked", as a user would set it.
            let default = profile.path().join("Default");
            std::fs::create_dir_all(&default).expect("the profile's Default directory");
            std::fs::write(
                default.join("Preferences"),
                r#"{"profile":{"default_content_setting_values":{"javascript":2}}}"#,
            )
            .expect("the profile's Preferences");
        }
        let mut command = tokio::process::Command::new(&self.binary);
        command
            .args([
                "--headless",
                // Root (as the tests run) needs it; the page is our own.
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-default-apps",
                "--mute-audio",
                "--hide-scrollbars",
                "--no-proxy-server",
                // Names resolve to nothing: only the loopback address in `url` is reached.
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(format!("--virtual-time-budget={}", budget.as_millis()))
            .args(args)
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.binary.display()));
        let (mut stdout, mut stderr) = (
            child.stdout.take().expect("piped stdout"),
            child.stderr.take().expect("piped stderr"),
        );
        let mut browser = Browser { child };
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let ran = tokio::time::timeout(BROWSER_LIMIT, async {
            let (read_out, read_err) =
                tokio::join!(stdout.read_to_end(&mut out), stderr.read_to_end(&mut err));
            read_out.and(read_err)?;
            browser.child.wait().await
        })
        .await;
        let err = String::from_utf8_lossy(&err);
        let tail: String = err.lines().rev().take(15).collect::<Vec<_>>().join("\n");
        match ran {
            Ok(Ok(status)) if status.success() => {}
            Ok(Ok(status)) => {
                panic!("chromium exited with {status} on {url}; stderr ends:\n{tail}")
            }
            Ok(Err(e)) => panic!("chromium on {url}: {e}"),
            Err(_) => panic!("chromium did not finish {url} within {BROWSER_LIMIT:?}"),
        }
        drop(browser);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// The DOM of `url` after its script ran for `budget` of virtual time (its fetches are
    /// waited for: virtual time stands still while one is pending).
    async fn dom(&self, url: &str, script: Script, budget: Duration) -> String {
        let dom = self
            .run(url, script, budget, &["--dump-dom".to_owned()])
            .await;
        assert!(
            dom.contains("</html>"),
            "chromium printed no DOM for {url} (script {script:?}): {dom:?}"
        );
        dom
    }

    /// A PNG of `url` at `width`×`height` into `path`.
    async fn screenshot(&self, url: &str, path: &Path, width: u32, height: u32) {
        let _ = std::fs::remove_file(path);
        self.run(
            url,
            Script::On,
            Duration::from_secs(3),
            &[
                format!("--screenshot={}", path.display()),
                format!("--window-size={width},{height}"),
            ],
        )
        .await;
        let png = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            png.starts_with(b"\x89PNG"),
            "{} is not a PNG",
            path.display()
        );
    }
}

// --- reading the dumped DOM ---

/// The text of the element with `id` (up to its first child tag).
fn text_of(dom: &str, id: &str) -> String {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no element #{id} in the page"));
    let rest = &dom[at..];
    let start = rest.find('>').map_or(rest.len(), |i| i + 1);
    let rest = &rest[start..];
    rest[..rest.find('<').unwrap_or(rest.len())].to_owned()
}

/// The markup from `open` (the first occurrence) to the next `close`.
fn section<'d>(dom: &'d str, open: &str, close: &str) -> &'d str {
    let at = dom
        .find(open)
        .unwrap_or_else(|| panic!("no {open} in the page"));
    let rest = &dom[at..];
    &rest[..rest.find(close).map_or(rest.len(), |i| i + close.len())]
}

/// The hit-ratio cell of route `name`.
fn hit_ratio(dom: &str, name: &str) -> String {
    let row = section(dom, &format!("<tr data-route=\"{name}\""), "</tr>");
    let cell = section(row, "hit-ratio\">", "</td>");
    cell["hit-ratio\">".len()..cell.len() - "</td>".len()].to_owned()
}

/// Points of the polylines of `series` in the chart `chart` (one per run without a gap), 0
/// when there is none.
fn points(dom: &str, chart: &str, series: &str) -> usize {
    let svg = section(dom, &format!("id=\"{chart}\""), "</svg>");
    svg.split("<polyline")
        .skip(1)
        .map(|tag| &tag[..tag.find('>').unwrap_or(tag.len())])
        .filter(|tag| tag.contains(&format!("data-series=\"{series}\"")))
        .filter_map(|tag| tag.split("points=\"").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .map(|points| points.split_whitespace().count())
        .sum()
}

/// The sold-out rate cell of a stock gate's row (0 when it shows none).
fn sold_out_rate(row: &str) -> f64 {
    let cell = section(row, "sold-out-rate\">", "</td>");
    cell["sold-out-rate\">".len()..cell.len() - "</td>".len()]
        .parse()
        .unwrap_or(0.0)
}

/// Whether `text` reads like `93.4%`.
fn is_percent(text: &str) -> bool {
    text.strip_suffix('%')
        .and_then(|n| n.parse::<f64>().ok())
        .is_some_and(|n| (0.0..=100.0).contains(&n))
}

/// Chart points to wait for: the charts show some history before the page is judged.
const MIN_POINTS: usize = 4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_in_a_real_browser() {
    // Loads the machine or times it: never beside another such test (see `alone::heavy`).
    let _heavy = crate::common::heavy().await;
    let chromium = Chromium::find();
    let started = Instant::now();
    let mut redis = redis_with_password().await;
    let origin = origin().await;
    let cg = config(&origin, &redis).start().await;
    let (addr, admin) = (cg.addr(), cg.admin_addr());
    let page = url(admin, "/");
    let client = HttpClient::new();

    // Background load: half of it on the hot key, the rest over 50 keys; paced so a debug
    // build keeps up with a browser beside it. It keeps Redis commands flowing, so the
    // breaker notices the kill at once.
    let load = Load::new(&[addr], |n| {
        if n % 2 == 0 {
            HOT_PATH.to_owned()
        } else {
            format!("/api/items/k{}", n % 50)
        }
    })
    .conns(3)
    .pause(Duration::from_millis(10))
    .duration(Duration::from_secs(150))
    .start();
    let _crowd = crowd(addr);
    own_answer_for_nasty_path(addr).await;
    wait_hot(&client, admin, HOT_PATH).await;

    // The charts fill: the polyline of `item` gains points as samples arrive.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (dom, filled) = loop {
        let dom = chromium
            .dom(&page, Script::On, Duration::from_secs(3))
            .await;
        let n = points(&dom, "chart-hit-ratio", "item");
        seen.push(n);
        if n >= MIN_POINTS {
            break (dom, n);
        }
        assert!(
            Instant::now() < deadline,
            "the hit-ratio chart of `item` did not reach {MIN_POINTS} points within 60 s (points seen: {seen:?})"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert!(
        seen.windows(2).all(|w| w[0] <= w[1]),
        "points went down: {seen:?}"
    );
    assert!(
        dom.contains(r#"<html lang="en" data-live="on">"#),
        "the script did not run"
    );
    for chart in [
        "chart-rps",
        "chart-origin",
        "chart-origin-rps",
        "chart-redis",
    ] {
        assert!(
            dom.contains(&format!("id=\"{chart}\""))
                && section(&dom, &format!("id=\"{chart}\""), "</svg>").contains("<polyline"),
            "{chart} has no line"
        );
    }
    assert!(points(&dom, "chart-rps", "item") >= MIN_POINTS - 1);
    for series in ["admitted", "sold out"] {
        assert!(
            points(&dom, "chart-stock-0", series) >= MIN_POINTS - 1,
            "the stock gate's {series} line is too short"
        );
    }
    let gate = section(&dom, "<tr data-gate=\"seats\"", "</tr>");
    assert!(
        sold_out_rate(gate) > 0.0,
        "the crowd's sold-out answers per second: {gate}"
    );
    assert!(points(&dom, "chart-redis", "redis up") >= MIN_POINTS);
    let ratio = hit_ratio(&dom, "item");
    assert!(is_percent(&ratio), "hit ratio of item: {ratio:?}");
    let hot = section(&dom, "<ol id=\"hot-keys\"", "</ol>");
    assert!(hot.contains(HOT_PATH), "the hot key is not listed: {hot}");
    assert_eq!(text_of(&dom, "breaker-state"), "closed");
    assert!(
        text_of(&dom, "live").starts_with("live"),
        "{}",
        text_of(&dom, "live")
    );
    // The nasty path is shown as text: no element grew an attribute from it, no script ran
    // from it.
    let errors = section(&dom, "<table id=\"recent-errors\"", "</table>");
    assert!(
        errors.contains(r#"/api/items/x"onmouseover="alert(1)"'&amp;"#),
        "the own answer for the nasty path is not listed: {errors}"
    );
    assert!(
        !dom.contains(" onmouseover="),
        "an attribute injected into the page"
    );
    assert_eq!(dom.matches("<script").count(), 1);
    for secret in [ADMIN_TOKEN, REDIS_PASSWORD] {
        assert!(!dom.contains(secret), "the page shows a secret");
    }

    // The screenshot, with the charts drawn.
    let artifacts = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-artifacts");
    std::fs::create_dir_all(&artifacts).expect("target/test-artifacts");
    let png = artifacts.join("status-page.png");
    chromium.screenshot(&page, &png, 1280, 1000).await;

    // JavaScript off: the numbers are there, no chart was drawn.
    let plain = chromium
        .dom(&page, Script::Off, Duration::from_secs(3))
        .await;
    assert!(
        plain.contains(r#"<html lang="en">"#),
        "the script ran with JavaScript off"
    );
    assert!(
        !plain.contains("<polyline"),
        "a chart was drawn with JavaScript off"
    );
    let ratio = hit_ratio(&plain, "item");
    assert!(
        is_percent(&ratio),
        "hit ratio of item, JavaScript off: {ratio:?}"
    );
    assert_eq!(text_of(&plain, "breaker-state"), "closed");
    assert!(section(&plain, "<ol id=\"hot-keys\"", "</ol>").contains(HOT_PATH));
    assert!(text_of(&plain, "origin-max-rps") == "500");
    let gate = section(&plain, "<tr data-gate=\"seats\"", "</tr>");
    assert!(
        sold_out_rate(gate) > 0.0,
        "the gate's sold-out rate, JavaScript off: {gate}"
    );

    // Redis dies: the page says the breaker is open within a few seconds.
    redis.kill();
    let killed = Instant::now();
    let open = poll_until(
        Duration::from_secs(20),
        Duration::from_millis(500),
        || async {
            let dom = chromium
                .dom(&page, Script::On, Duration::from_secs(3))
                .await;
            (text_of(&dom, "breaker-state") == "open").then_some(dom)
        },
    )
    .await;
    let open =
        open.unwrap_or_else(|| panic!("the page did not say `open` within 20 s of the kill"));
    let took = killed.elapsed();
    assert!(open.contains(r#"data-state="open""#));
    assert!(
        points(&open, "chart-redis", "redis up") >= MIN_POINTS,
        "the Redis chart lost its history"
    );
    // Seconds later, the charts have more points: samples kept arriving.
    let later = points(&open, "chart-hit-ratio", "item");
    assert!(later > filled, "no new points: {filled} then {later}");

    let tally = load.finish().await;
    assert!(tally.answers > 0, "the load made no request");
    cg.shutdown().await;
    eprintln!(
        "status page in chromium: breaker shown open {took:?} after the kill; test took {:?}; \
         chart points seen while filling {seen:?}; screenshot {}",
        started.elapsed(),
        png.display()
    );
}
