//! Config hot reload: a change to the config file (or SIGHUP) reloads it under
//! load without a failed request; an invalid edit is refused with the startup error and the
//! old config keeps serving.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::common::*;
use tokio::time::Instant;

/// The config file text: embedded mode, the item route with `ttl`, the origin capped at
/// `max_rps` (0 = none) with a queue long enough that capped requests wait, not fail.
fn config_text(origin: &TestOrigin, ttl: &str, max_rps: u32) -> String {
    CgConfig::new(origin)
        .set("upstream", "max_rps", &max_rps.to_string())
        .set_str("upstream", "queue_timeout", "5s")
        .set("cache", "jitter", "0.0")
        .set_str("cache", "grace", "0s")
        .l1("all")
        .routes(&item_route(&format!("ttl = {ttl:?}")))
        .toml()
}

/// Origin requests seen between `from` and `from + window`.
async fn origin_rate(origin: &TestOrigin, window: Duration) -> u64 {
    let before = origin.total();
    tokio::time::sleep(window).await;
    origin.total() - before
}

/// Under a steady load of misses, the file changes a route's ttl (60s → 300ms) and sets an
/// origin rate cap (none → 20/s): both are in effect within 1 s, no request fails, and the
/// reload is counted. Then an invalid edit is refused with file:line:key, counted, and the
/// running config keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_change_reloads_routes_and_limits_under_load_without_a_failed_request() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cacheguard.toml");
    std::fs::write(&path, config_text(&origin, "60s", 0)).expect("write config");
    let cg = start_watching(&path).await;
    let client = HttpClient::new();

    // Load: 16 loops of distinct keys (every request a miss, so every one reaches the
    // origin through the guard), bounded by time and count.
    let stop_at = Instant::now() + Duration::from_secs(7);
    let failures = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let served = Arc::new(AtomicU64::new(0));
    let next = Arc::new(AtomicU64::new(0));
    let mut load = Vec::new();
    for _ in 0..16 {
        let (client, failures, served, next, failed) = (
            client.clone(),
            Arc::clone(&failures),
            Arc::clone(&served),
            Arc::clone(&next),
            Arc::clone(&failed),
        );
        let addr = cg.addr();
        load.push(tokio::spawn(async move {
            for _ in 0..100_000 {
                if Instant::now() >= stop_at {
                    break;
                }
                let n = next.fetch_add(1, Ordering::Relaxed);
                match client
                    .try_get(&url(addr, &format!("/api/items/load-{n}")))
                    .await
                {
                    Ok(resp) if resp.status == 200 => {
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                    other => {
                        failures.fetch_add(1, Ordering::Relaxed);
                        let what = match other {
                            Ok(resp) => format!("{} {}", resp.status, resp.text()),
                            Err(e) => e,
                        };
                        failed
                            .lock()
                            .expect("failures")
                            .push(format!("{:?} after start: {what}", stop_at.elapsed()));
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let uncapped = origin_rate(&origin, Duration::from_secs(1)).await;
    // A key cached under the old ttl.
    assert_eq!(
        client.get(&url(cg.addr(), "/api/items/old")).await.status,
        200
    );

    replace_file(&path, &config_text(&origin, "300ms", 20));
    let changed = Instant::now();
    let reloaded = poll_until(
        Duration::from_secs(1),
        Duration::from_millis(20),
        || async {
            let (_, exp) = scrape(&client, cg.admin_addr()).await;
            (exp.sum("cacheguard_config_reloads_total", &[("result", "ok")]) == 1.0).then_some(())
        },
    )
    .await;
    assert!(
        reloaded.is_some(),
        "the file change was not reloaded within 1 s"
    );
    let took = changed.elapsed();

    // The rate cap: after the reload, at most 20 origin requests a second (+ the queue's
    // edge), where the uncapped load made many more.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let capped = origin_rate(&origin, Duration::from_secs(2)).await;
    assert!(
        uncapped > 60,
        "the load before the reload was too light to tell: {uncapped}/s"
    );
    assert!(
        capped <= 2 * 20 + 3,
        "origin took {capped} requests in 2 s under max_rps = 20 (before: {uncapped}/s)"
    );

    // The ttl: a key fetched now expires after 300 ms.
    let fresh = "/api/items/new-ttl";
    assert_eq!(client.get(&url(cg.addr(), fresh)).await.status, 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let again = client.get(&url(cg.addr(), fresh)).await;
    assert_eq!(again.x_cache(), "MISS", "ttl 300ms not in effect: {again}");
    assert_eq!(origin.count(fresh), 2);

    for task in load {
        task.await.expect("load task");
    }
    assert_eq!(
        failures.load(Ordering::Relaxed),
        0,
        "requests failed across the reload: {:?}",
        failed.lock().expect("failures")
    );
    assert!(served.load(Ordering::Relaxed) > 100);

    // An invalid edit: refused with file:line:key, the old config keeps serving.
    let invalid = config_text(&origin, "soon", 20);
    replace_file(&path, &invalid);
    let refused = cg.reload().await.expect_err("an invalid file is refused");
    let file = path.display().to_string();
    assert!(
        refused.contains(&file) && refused.contains("ttl") && refused.contains("\"soon\""),
        "the error names the file, line and key: {refused}"
    );
    let line = invalid
        .lines()
        .position(|l| l.contains("\"soon\""))
        .expect("ttl line")
        + 1;
    assert!(
        refused.contains(&format!("{file}:{line}")),
        "line {line}: {refused}"
    );
    let (_, exp) = scrape(&client, cg.admin_addr()).await;
    assert!(exp.sum("cacheguard_config_reloads_total", &[("result", "invalid")]) >= 1.0);
    assert_eq!(exp.sum("cacheguard_config_generation", &[]), 2.0);
    let still = client
        .get(&url(cg.addr(), "/api/items/after-invalid"))
        .await;
    assert_eq!(still.status, 200);
    let config = client.get(&url(cg.admin_addr(), "/admin/config")).await;
    assert_eq!(config.status, 200);
    assert!(config.text().contains("300ms"), "{}", config.text());
    eprintln!("reload took {took:?}; origin {uncapped}/s before, {capped} in 2 s after");
    cg.shutdown().await;
}

/// SIGHUP reloads the file (the real binary); `/admin/config` shows the effective config
/// with the admin token redacted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_config_file() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = CgConfig::new(&origin)
        .on_free_ports()
        .set_str("admin", "token", "reload-secret-0123456789")
        .write_to(&dir.path().join("cacheguard.toml"));
    let cg = spawn_cacheguard_process(&path).await;
    let client = HttpClient::new();
    let generation = || async {
        let (_, exp) = scrape(&client, cg.admin_addr()).await;
        exp.sum("cacheguard_config_generation", &[])
    };
    assert_eq!(generation().await, 1.0);
    let pid = cg.pid().expect("running");
    crate::common::process::signal(pid, "-HUP");
    let reloaded = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async { (generation().await == 2.0).then_some(()) },
    )
    .await;
    assert!(reloaded.is_some(), "SIGHUP did not reload\n{}", cg.output());
    assert_eq!(
        client.get(&url(cg.addr(), "/api/items/1")).await.status,
        200
    );
    let config = client.get(&url(cg.admin_addr(), "/admin/config")).await;
    assert_eq!(config.status, 200);
    assert!(config.text().contains("generation 2"), "{}", config.text());
    assert!(
        !config.text().contains("reload-secret"),
        "the admin token leaked: {}",
        config.text()
    );
}

/// A route removed by a reload keeps its series for one more scrape (its last values reach
/// Prometheus), then they are gone; a route added by a reload has its series at once, before
/// its first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_route_keeps_its_series_until_the_next_scrape() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cacheguard.toml");
    let with_routes = |routes: &str| {
        CgConfig::new(&origin)
            .on_free_ports()
            .l1("all")
            .routes(routes)
            .toml()
    };
    let old = item_route("") + &route("thing", "/api/things/{id}", "GET", "");
    std::fs::write(&path, with_routes(&old)).expect("write config");
    let cg = start_watching(&path).await;
    let client = HttpClient::new();
    assert_eq!(
        client.get(&url(cg.addr(), "/api/things/1")).await.status,
        200
    );
    let served = |exp: &prom::Exposition, route: &str| {
        exp.samples_named("cacheguard_requests_total")
            .filter(|s| s.labels.get("route").map(String::as_str) == Some(route))
            .count()
    };
    let thing_series = served(&metrics(&client, cg.admin_addr()).await, "thing");
    assert!(
        thing_series > 0,
        "no series for the route before the reload"
    );

    // `thing` removed, `widget` added.
    let new = item_route("") + &route("widget", "/api/widgets/{id}", "GET", "");
    replace_file(&path, &with_routes(&new));
    let reloaded = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            let exp = metrics(&client, cg.admin_addr()).await;
            (served(&exp, "widget") > 0).then_some(exp)
        },
    )
    .await;
    let first = reloaded.expect("the reload added no series for the new route");
    // The scrape that saw the new route is the first after the reload: the removed route's
    // series were still in it, with their last values.
    assert_eq!(served(&first, "thing"), thing_series);
    assert_eq!(
        first.sum(
            "cacheguard_requests_total",
            &[("route", "thing"), ("outcome", "miss")]
        ),
        1.0
    );
    // The next scrape no longer has them (one more, should that first scrape have fallen
    // between the new table's series and the old route's retirement: microseconds apart).
    let mut second = metrics(&client, cg.admin_addr()).await;
    if served(&second, "thing") > 0 {
        second = metrics(&client, cg.admin_addr()).await;
    }
    assert_eq!(
        served(&second, "thing"),
        0,
        "the removed route's series stayed"
    );
    assert!(
        !second
            .samples
            .iter()
            .any(|s| s.labels.get("route").map(String::as_str) == Some("thing")),
        "a series of the removed route is left in some family"
    );
    assert!(served(&second, "item") > 0 && served(&second, "widget") > 0);
    cg.shutdown().await;
}
