//! The public HTTP-cache test suite (the npm package `http-cache-tests`, pinned to
//! [`PACKAGE_VERSION`]) run against cacheguard, embedded and shared, and scored exactly as
//! the suite scores itself: kinds (required, optimal, check) and dependencies included.
//!
//! Each mode starts the suite's own origin server on a free loopback port, cacheguard in
//! front of it (one catch-all cached GET route and one catch-all write route that
//! invalidates the path it writes), and the suite's command-line client against cacheguard.
//! `tests/it/cache_tests/score.mjs` scores the client's results with the suite's own code.
//!
//! On a cached route the origin receives no client request header outside the cache key, so
//! it never sees the `Req-Num` header the client numbers its requests with and numbers them
//! itself; the suite then scores a test in which the origin saw two or more requests as
//! `retry`, whatever the answers were.
//!
//! What it proves: no test recorded as `pass` in `tests/it/cache_tests/expected-<mode>.txt`
//! has stopped passing. Tests marked `flaky` there (timing-based tests that flip between
//! runs) are not checked. Tests that newly pass are listed; to record them, and any other
//! change, rewrite the expectations from a run:
//!
//! Where 0.4.5 and the suite's development version (the `http-tests/cache-tests`
//! repository, which `bench/cache_tests.sh` runs too) disagree, cacheguard follows RFC 9111
//! and the newer version, so 0.4.5 scores those tests as required failures by design: they
//! are listed in [`NEWER_READING`], and their lines in the expectations say why.
//!
//! ```sh
//! CACHE_TESTS_BLESS=1 cargo test --test it cache_tests::
//! ```
//!
//! The package is installed by `scripts/test.sh` under the target directory
//! (`target/cache-tests/node_modules/http-cache-tests`); `CACHE_TESTS_DIR` names another
//! copy of the package. Each run leaves the client's raw results and stderr, the score and
//! the origin's log in `target/tmp/cache-tests/<mode>/`. One test of the suite runs by hand,
//! with its requests and answers printed, from the package directory against a running
//! cacheguard: `npm_config_base=http://127.0.0.1:PORT npm_package_config_id=ID node cli.mjs`.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use crate::common;
use crate::common::{CgConfig, RedisServer, free_port};

/// The version of `http-cache-tests` the expectations were recorded with.
const PACKAGE_VERSION: &str = "0.4.5";

/// How the package is installed where this test looks for it (`scripts/test.sh` does it).
const INSTALL_HINT: &str = "install it with `bash scripts/test.sh` (or `npm install --prefix \
     target/cache-tests --omit=dev http-cache-tests@0.4.5`), or point CACHE_TESTS_DIR at a copy \
     of the package";

/// The tests of 0.4.5 whose expectation the suite's development version reverses, each with
/// what the newer version (and RFC 9111) asks instead: cacheguard does what the newer one
/// asks, so 0.4.5 counts them as required failures. The expectations carry the reason after
/// a `#`, and the summary line counts the required failures on which the versions agree.
const NEWER_READING: [(&str, &str); 11] = [
    ("age-parse-nonnumeric", AGE_IGNORED),
    ("age-parse-negative", AGE_IGNORED),
    ("age-parse-float", AGE_IGNORED),
    ("age-parse-prefix-twoline", AGE_FIRST),
    ("age-parse-dup-0", AGE_FIRST),
    ("age-parse-dup-0-twoline", AGE_FIRST),
    ("age-parse-dup-old", AGE_FIRST),
    ("stale-close-must-revalidate", STALE_CLOSE),
    ("stale-close-no-cache", STALE_CLOSE),
    ("stale-close-proxy-revalidate", STALE_CLOSE),
    ("stale-close-s-maxage=2", STALE_CLOSE),
];
const AGE_IGNORED: &str = "newer reading: an invalid Age is ignored, so the answer is \
                           fresh (RFC 9111 §5.1); 0.4.5 takes it as stale";
const AGE_FIRST: &str = "newer reading: a list-valued Age counts by its first member, a \
                         young one here (RFC 9111 §5.1); 0.4.5 takes any list as stale";
const STALE_CLOSE: &str = "newer reading: cacheguard's own 502 for the dropped connection \
                           is no stale copy; 0.4.5 counts any answer without the origin's \
                           request count as one from the cache";

/// Why 0.4.5's expectation for `id` is not followed, when it is one of [`NEWER_READING`].
fn newer_reading(id: &str) -> Option<&'static str> {
    NEWER_READING
        .iter()
        .find(|(newer, _)| *newer == id)
        .map(|(_, why)| *why)
}

/// The client runs ~20 s; past this it is killed and the test fails.
const CLIENT_DEADLINE: Duration = Duration::from_secs(150);

/// Every GET is cached by the origin's freshness (`freshness = "origin"`; the route's
/// lifetimes, as caps, are long enough not to cut the suite's); every write is forwarded
/// and invalidates the path it wrote (the suite's setup `PUT /config/<uuid>` takes this
/// route too). The suite's origin reads its
/// own state, so there is no replica lag to wait out after a write.
const ROUTES: &str = include_str!("cache_tests/routes.toml");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded() {
    // Loads the machine or times it: never beside another such test (see `alone::heavy`).
    let _heavy = crate::common::heavy().await;
    run_suite("embedded", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared() {
    // Loads the machine or times it: never beside another such test (see `alone::heavy`).
    let _heavy = crate::common::heavy().await;
    let redis = RedisServer::start().await;
    run_suite("shared", Some(&redis)).await;
}

/// Runs the whole suite through cacheguard (shared mode when `redis` is given) and checks
/// the score against `expected-<mode>.txt`.
async fn run_suite(mode: &str, redis: Option<&RedisServer>) {
    let package = package_dir();
    let out = work_dir(mode);
    let started = Instant::now();

    let origin = SuiteOrigin::start(&package, &out).await;
    let mut cfg = CgConfig::with_upstream(&format!("http://{}", origin.addr)).routes(ROUTES);
    if let Some(redis) = redis {
        cfg = cfg.redis(redis);
    }
    let cg = cfg.start().await;

    let results = out.join("results.json");
    let client_log = out.join("client.stderr");
    let mut client = NodeProcess::spawn(
        Command::new("node")
            .arg("--no-warnings")
            .arg("cli.mjs")
            .current_dir(&package)
            // What `npm run cli --base=…` would set; an empty id runs every test.
            .env("npm_config_base", format!("http://{}", cg.addr()))
            .env("npm_config_id", "")
            .env("npm_package_config_id", ""),
        &results,
        &client_log,
    );
    let status = client.wait(CLIENT_DEADLINE).await;
    cg.shutdown().await;
    let elapsed = started.elapsed();
    let status = status.unwrap_or_else(|| {
        panic!(
            "{mode}: the suite's client did not finish within {CLIENT_DEADLINE:?}\n{}\n{}",
            tail("client stderr", &client_log),
            tail("origin log", &origin.log)
        )
    });
    assert!(
        status.success(),
        "{mode}: the suite's client exited with {status}\n{}",
        tail("client stderr", &client_log)
    );
    drop(origin);

    let score = score(&package, &results, &client_log).await;
    let raw = raw_results(&results);
    let newer = score
        .results
        .iter()
        .filter(|(id, result)| *result == "fail" && newer_reading(id).is_some())
        .count();
    eprintln!(
        "cache-tests {mode}: {} passed, {} required failures ({} where 0.4.5 contradicts the \
         newer reading cacheguard follows) ({}) in {:.1}s",
        score.passed,
        score.required_failures,
        newer,
        score.counts,
        elapsed.as_secs_f64()
    );
    check(mode, &score.results, &raw);
}

/// The package's directory: `CACHE_TESTS_DIR`, else where `scripts/test.sh` installs it.
/// Panics, saying how to install it, when it is missing or another version.
fn package_dir() -> PathBuf {
    let dir = match std::env::var_os("CACHE_TESTS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => target_dir().join("cache-tests/node_modules/http-cache-tests"),
    };
    let manifest = dir.join("package.json");
    let text = std::fs::read_to_string(&manifest).unwrap_or_else(|e| {
        panic!(
            "the HTTP-cache test suite is not installed ({}: {e}); {INSTALL_HINT}",
            manifest.display()
        )
    });
    let json: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{}: not JSON: {e}", manifest.display()));
    let version = json.get("version").and_then(|v| v.as_str());
    assert_eq!(
        version,
        Some(PACKAGE_VERSION),
        "{} is http-cache-tests {version:?}, the expectations are for {PACKAGE_VERSION}; \
         {INSTALL_HINT}",
        dir.display()
    );
    dir
}

/// The cargo target directory (the parent of cargo's per-target temp dir).
fn target_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).to_path_buf()
}

/// `target/tmp/cache-tests/<mode>/`, emptied: what a run leaves for a person to read.
fn work_dir(mode: &str) -> PathBuf {
    let dir = work_dir_path(mode);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    dir
}

fn work_dir_path(mode: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cache-tests")
        .join(mode)
}

fn expectations_path(mode: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/cache_tests")
        .join(format!("expected-{mode}.txt"))
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/cache_tests")
        .join(name)
}

/// A node child process, its stdout and stderr in files; killed by PID on `Drop`.
struct NodeProcess {
    child: Option<Child>,
}

impl NodeProcess {
    fn spawn(command: &mut Command, stdout: &Path, stderr: &Path) -> NodeProcess {
        let open = |p: &Path| File::create(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let child = command
            .stdin(Stdio::null())
            .stdout(open(stdout))
            .stderr(open(stderr))
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run node ({e}): install nodejs and npm (scripts/test.sh does)")
            });
        NodeProcess { child: Some(child) }
    }

    /// Waits (bounded, without blocking the runtime) for the exit; `None` at the deadline.
    async fn wait(&mut self, timeout: Duration) -> Option<ExitStatus> {
        common::process::wait_child(&mut self.child, timeout).await
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The suite's origin server (`server/server.mjs`, through `tests/it/cache_tests/origin.mjs`,
/// which keeps it on 127.0.0.1) on a free port.
struct SuiteOrigin {
    addr: SocketAddr,
    log: PathBuf,
    _process: NodeProcess,
}

impl SuiteOrigin {
    async fn start(package: &Path, out: &Path) -> SuiteOrigin {
        let log = out.join("origin.log");
        for _ in 0..8 {
            let port = free_port();
            let mut process = NodeProcess::spawn(
                Command::new("node")
                    .arg(script("origin.mjs"))
                    .arg(package)
                    .arg(port.to_string()),
                &log,
                &log.with_extension("stderr"),
            );
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if process.wait(Duration::ZERO).await.is_some() {
                    // Exited: most likely the port was taken in the meantime; try another.
                    break;
                }
                if tokio::net::TcpStream::connect(addr).await.is_ok() {
                    return SuiteOrigin {
                        addr,
                        log,
                        _process: process,
                    };
                }
                assert!(
                    Instant::now() < deadline,
                    "the suite's origin did not listen on {addr} within 10s\n{}",
                    tail("origin log", &log.with_extension("stderr"))
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        panic!(
            "the suite's origin did not start after 8 attempts\n{}",
            tail("origin stderr", &log.with_extension("stderr"))
        );
    }
}

/// A run scored by `score.mjs`.
struct Score {
    /// Test id → the suite's category (`pass`, `fail`, `optional-fail`, …).
    results: BTreeMap<String, String>,
    passed: u64,
    required_failures: u64,
    /// Every category's count, for the summary line.
    counts: String,
}

async fn score(package: &Path, results: &Path, client_log: &Path) -> Score {
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("node")
            .arg(script("score.mjs"))
            .arg(package)
            .arg(results)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("score.mjs did not finish within 60s")
    .expect("run node score.mjs");
    assert!(
        output.status.success(),
        "score.mjs failed ({}): {}\n(the client's results are in {})\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr),
        results.display(),
        tail("client stderr", client_log)
    );
    let text = String::from_utf8_lossy(&output.stdout);
    let _ = std::fs::write(results.with_file_name("score.txt"), text.as_bytes());
    let mut score = Score {
        results: BTreeMap::new(),
        passed: 0,
        required_failures: 0,
        counts: String::new(),
    };
    let mut counts = Vec::new();
    for line in text.lines() {
        let (summary, line) = match line.strip_prefix("# ") {
            Some(rest) => (true, rest),
            None => (false, line),
        };
        let (name, value) = line
            .split_once(' ')
            .unwrap_or_else(|| panic!("score.mjs printed {line:?}"));
        if !summary {
            score.results.insert(name.to_owned(), value.to_owned());
            continue;
        }
        let n: u64 = value
            .parse()
            .unwrap_or_else(|e| panic!("score.mjs printed {line:?}: {e}"));
        match name {
            "passed" => score.passed = n,
            "required-failures" => score.required_failures = n,
            _ if n > 0 => counts.push(format!("{name} {n}")),
            _ => {}
        }
    }
    assert!(!score.results.is_empty(), "score.mjs printed no results");
    score.counts = counts.join(", ");
    score
}

/// The client's own results (`id → true | [kind, message]`), for the failure messages.
fn raw_results(path: &Path) -> BTreeMap<String, serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Reads `expected-<mode>.txt`: `<id> <result>` lines, each maybe followed by `# <note>`;
/// `#` lines are comments.
fn read_expectations(path: &Path) -> Option<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).ok()?;
    let mut expected = BTreeMap::new();
    for line in text.lines() {
        let line = line.split_once(" #").map_or(line, |(line, _)| line).trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (id, result) = line.split_once(' ').unwrap_or_else(|| {
            panic!("{}: expected `<id> <result>`, got {line:?}", path.display())
        });
        expected.insert(id.to_owned(), result.trim().to_owned());
    }
    Some(expected)
}

/// Rewrites `expected-<mode>.txt` from `results`; tests marked `flaky` stay marked, and
/// the tests of [`NEWER_READING`] say why 0.4.5's expectation is not followed.
fn bless(path: &Path, results: &BTreeMap<String, String>, old: Option<&BTreeMap<String, String>>) {
    let mut text = String::from(
        "# The HTTP-cache test suite through cacheguard: each test's result as the suite scores\n\
         # it. Rewritten by `CACHE_TESTS_BLESS=1 cargo test --test it cache_tests::` (see\n\
         # tests/it/cache_tests.rs); `flaky` marks are kept and are not checked. A `# newer\n\
         # reading` note marks a test whose 0.4.5 expectation the suite's development version\n\
         # reverses: cacheguard follows RFC 9111 and the newer version there.\n",
    );
    for (id, result) in results {
        let flaky = old.and_then(|o| o.get(id)).is_some_and(|r| r == "flaky");
        let result = if flaky { "flaky" } else { result.as_str() };
        match newer_reading(id) {
            Some(why) => text.push_str(&format!("{id} {result} # {why}\n")),
            None => text.push_str(&format!("{id} {result}\n")),
        }
    }
    std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    eprintln!("cache-tests: wrote {}", path.display());
}

/// Compares a run with the expectations: fails when a test expected to pass does not.
fn check(
    mode: &str,
    results: &BTreeMap<String, String>,
    raw: &BTreeMap<String, serde_json::Value>,
) {
    let path = expectations_path(mode);
    let expected = read_expectations(&path);
    if std::env::var_os("CACHE_TESTS_BLESS").is_some_and(|v| v == "1") {
        bless(&path, results, expected.as_ref());
        return;
    }
    let Some(expected) = expected else {
        panic!(
            "{}: missing; record it with CACHE_TESTS_BLESS=1 cargo test --test it cache_tests::",
            path.display()
        );
    };
    let detail = |id: &str| match raw.get(id) {
        Some(serde_json::Value::Array(a)) => {
            let parts: Vec<String> = a
                .iter()
                .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
                .collect();
            format!(": {}", parts.join(": "))
        }
        _ => String::new(),
    };
    let mut regressed = Vec::new();
    let mut newly_pass = Vec::new();
    let mut changed = Vec::new();
    for (id, was) in &expected {
        let now = results.get(id).map_or("missing", String::as_str);
        if was == "flaky" || was == now {
            continue;
        }
        if was == "pass" {
            regressed.push(format!("  {id}: {now}{}", detail(id)));
        } else if now == "pass" {
            newly_pass.push(format!("  {id} (was {was})"));
        } else {
            changed.push(format!("  {id}: {was} -> {now}"));
        }
    }
    for (id, now) in results {
        if expected.contains_key(id) {
            continue;
        }
        if now == "pass" {
            newly_pass.push(format!("  {id} (not in the expectations)"));
        } else {
            changed.push(format!("  {id}: not in the expectations -> {now}"));
        }
    }
    let rebless =
        "record the new results with CACHE_TESTS_BLESS=1 cargo test --test it cache_tests::";
    if !newly_pass.is_empty() {
        eprintln!(
            "cache-tests {mode}: newly passing: {} ({rebless}):\n{}",
            newly_pass.len(),
            newly_pass.join("\n")
        );
    }
    if !changed.is_empty() {
        eprintln!(
            "cache-tests {mode}: other results changed: {}\n{}",
            changed.len(),
            changed.join("\n")
        );
    }
    assert!(
        regressed.is_empty(),
        "cache-tests {mode}: tests that passed and no longer pass: {} (expectations: {}; the \
         run's files: {}):\n{}\nIf this is intended, {rebless}.",
        regressed.len(),
        path.display(),
        work_dir_path(mode).display(),
        regressed.join("\n")
    );
}

/// The last lines of a log file, labelled, for a failure message.
fn tail(label: &str, path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(40);
    format!(
        "--- {label} ({}) ---\n{}",
        path.display(),
        lines[start..].join("\n")
    )
}
