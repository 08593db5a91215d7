//! The admin listener: `/metrics` (well-formed Prometheus text with every documented
//! metric), `/healthz`, `/readyz` (degraded, still 200, while Redis is down), and the purge
//! API's rate limit.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::prom::{self, check_histogram};
use common::{
    CgConfig, HttpClient, RedisServer, Resp, TestOrigin, concurrently, metric, poll_until, scrape,
    url,
};
use tokio::time::Instant;

const METRICS: &[&str] = &[
    "cacheguard_requests_total",
    "cacheguard_request_duration_seconds",
    "cacheguard_origin_requests_total",
    "cacheguard_origin_duration_seconds",
    "cacheguard_l1_entries",
    "cacheguard_l1_bytes",
    "cacheguard_redis_errors_total",
    "cacheguard_shed_total",
    "cacheguard_redis_up",
];

#[test]
fn prometheus_parser_accepts_valid_text() {
    let text = "# HELP a_total Things.\n# TYPE a_total counter\na_total{route=\"item\",outcome=\"hit\"} 3\n\
                a_total{route=\"x\\\"y\\\\z\",outcome=\"miss\"} 1.5e3 1700000000000\n\
                # TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.3\nh_count 2\n\
                up NaN\n";
    let exp = prom::parse(text).expect("valid text");
    assert_eq!(exp.sum("a_total", &[("route", "item")]), 3.0);
    assert_eq!(exp.sum("a_total", &[("route", "x\"y\\z")]), 1500.0);
    assert!(exp.has_family("h"));
    check_histogram(&exp, "h").expect("valid histogram");
}

#[test]
fn prometheus_parser_rejects_malformed_text() {
    for bad in [
        "a_total{route=\"item\"} notanumber\n",
        "a_total{route=item} 1\n",
        "a_total{route=\"item\" 1\n",
        "9bad 1\n",
        "a_total\n",
        "# TYPE a_total countr\n",
        "a{x=\"1\",x=\"2\"} 1\n",
        "a 1 2 3\n",
    ] {
        assert!(prom::parse(bad).is_err(), "accepted {bad:?}");
    }
    let exp = prom::parse(
        "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\nh_sum 1\n",
    )
    .expect("parses");
    assert!(
        check_histogram(&exp, "h").is_err(),
        "non-cumulative buckets accepted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_200() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    let r = client.get(&url(cg.admin_addr(), "/healthz")).await;
    assert_eq!(r.status, 200, "{r}");
    let r = client.get(&url(cg.admin_addr(), "/readyz")).await;
    assert_eq!(r.status, 200, "embedded mode readyz: {r}");
    assert!(r.text().starts_with("ready"), "embedded mode readyz: {r}");
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_name_every_documented_metric() {
    let mut redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    origin.set_delay("/api/items/slow-0", Duration::from_millis(400));
    origin.set_delay("/api/items/slow-1", Duration::from_millis(400));
    origin.set_delay("/api/items/slow-2", Duration::from_millis(400));
    let cg = CgConfig::new(&origin)
        .redis(&redis)
        .l1("all")
        .set("upstream", "max_concurrency", "1")
        .set_str("upstream", "queue_timeout", "50ms")
        .start()
        .await;
    let client = HttpClient::new();
    let addr = cg.addr();

    // Misses, hits, a negative entry, an unmatched path.
    for i in 0..5 {
        client.get(&url(addr, &format!("/api/items/m-{i}"))).await;
        client.get(&url(addr, &format!("/api/items/m-{i}"))).await;
    }
    origin.set_status("/api/items/nf", 404);
    client.get(&url(addr, "/api/items/nf")).await;
    client.get(&url(addr, "/api/items/nf")).await;
    client.get(&url(addr, "/unmatched")).await;
    // Shedding: three concurrent slow misses through one origin slot.
    let shed = concurrently(3, Duration::from_secs(10), |i| {
        let client = client.clone();
        async move {
            client
                .get(&url(addr, &format!("/api/items/slow-{i}")))
                .await
                .status
        }
    })
    .await;
    assert!(
        shed.iter().any(|s| *s == 503),
        "no request was shed: {shed:?}"
    );

    let (_, before) = scrape(&client, cg.admin_addr()).await;
    assert_eq!(
        before.value("cacheguard_redis_up"),
        Some(1.0),
        "redis_up with Redis up"
    );

    // Redis errors.
    redis.kill();
    for i in 0..3 {
        let r = client
            .get(&url(addr, &format!("/api/items/down-{i}")))
            .await;
        assert_eq!(r.status, 200, "{r}");
    }

    let (text, exp) = scrape(&client, cg.admin_addr()).await;
    let missing: Vec<&&str> = METRICS.iter().filter(|m| !exp.has_family(m)).collect();
    assert!(missing.is_empty(), "/metrics lacks {missing:?}\n{text}");

    for (name, labels) in [
        ("cacheguard_requests_total", &["route", "outcome"][..]),
        ("cacheguard_origin_requests_total", &["route", "status"][..]),
        ("cacheguard_redis_errors_total", &["op"][..]),
        ("cacheguard_shed_total", &["route"][..]),
    ] {
        assert_eq!(
            exp.types.get(name).map(String::as_str),
            Some("counter"),
            "{name} TYPE"
        );
        let samples: Vec<_> = exp.samples_named(name).collect();
        assert!(!samples.is_empty(), "{name} has no samples after traffic");
        for s in samples {
            for l in labels {
                assert!(
                    s.labels.contains_key(*l),
                    "{name} sample without label {l}: {s:?}"
                );
            }
            assert!(s.value >= 0.0 && s.value.is_finite(), "{name}: {s:?}");
        }
    }
    for name in [
        "cacheguard_request_duration_seconds",
        "cacheguard_origin_duration_seconds",
    ] {
        check_histogram(&exp, name).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(
            exp.samples_named(&format!("{name}_bucket"))
                .all(|s| s.labels.contains_key("route")),
            "{name} without a route label"
        );
    }
    for name in [
        "cacheguard_l1_entries",
        "cacheguard_l1_bytes",
        "cacheguard_redis_up",
    ] {
        assert_eq!(
            exp.types.get(name).map(String::as_str),
            Some("gauge"),
            "{name} TYPE"
        );
    }

    // Values follow the traffic.
    let item_requests = exp.sum("cacheguard_requests_total", &[("route", "item")]);
    assert!(
        item_requests >= 15.0,
        "requests_total{{route=\"item\"}} = {item_requests}, sent at least 15"
    );
    assert!(
        exp.sum("cacheguard_shed_total", &[("route", "item")]) >= 1.0,
        "shed_total"
    );
    assert!(
        exp.value("cacheguard_redis_errors_total").unwrap_or(0.0) >= 1.0,
        "redis_errors_total"
    );
    assert!(
        exp.value("cacheguard_l1_entries").unwrap_or(0.0) >= 1.0,
        "l1_entries with l1 = \"all\""
    );
    assert!(
        exp.value("cacheguard_l1_bytes").unwrap_or(0.0) > 0.0,
        "l1_bytes with l1 = \"all\""
    );
    let origin_item = exp.sum("cacheguard_origin_requests_total", &[("route", "item")]);
    assert!(
        origin_item >= 5.0,
        "origin_requests_total{{route=\"item\"}} = {origin_item}"
    );

    // Bounded labels: never a raw path or key.
    for s in &exp.samples {
        for (k, v) in &s.labels {
            assert!(
                !v.contains("/api/") && !v.contains("/unmatched"),
                "path used as a label value: {} {k}={v:?}",
                s.name
            );
        }
    }

    // redis_up follows the outage.
    let down = poll_until(Duration::from_secs(5), Duration::from_millis(100), || {
        let client = client.clone();
        let admin = cg.admin_addr();
        async move {
            let (_, exp) = scrape(&client, admin).await;
            (exp.value("cacheguard_redis_up") == Some(0.0)).then_some(())
        }
    })
    .await;
    assert!(
        down.is_some(),
        "cacheguard_redis_up did not drop to 0 with Redis killed"
    );
    cg.shutdown().await;
}

async fn readyz(client: &HttpClient, admin: std::net::SocketAddr) -> (u16, String) {
    let r = client.get(&url(admin, "/readyz")).await;
    (r.status.as_u16(), r.text())
}

/// Polls `/readyz` on `admin` every `every` until it answers 200 `ready…`; false if it
/// has not within `timeout`.
async fn becomes_ready(
    client: &HttpClient,
    admin: std::net::SocketAddr,
    timeout: Duration,
    every: Duration,
) -> bool {
    let ready = poll_until(timeout, every, || {
        let client = client.clone();
        async move {
            let (s, body) = readyz(&client, admin).await;
            (s == 200 && body.starts_with("ready")).then_some(())
        }
    })
    .await;
    ready.is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_degraded_while_redis_is_down_and_ready_after() {
    let mut redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).redis(&redis).start().await;
    let client = HttpClient::new();
    let admin = cg.admin_addr();

    let up = becomes_ready(
        &client,
        admin,
        Duration::from_secs(3),
        Duration::from_millis(50),
    )
    .await;
    assert!(
        up,
        "readyz with Redis up: {:?}",
        readyz(&client, admin).await
    );

    redis.kill();
    // No proxied traffic: readiness must notice on its own.
    let degraded = poll_until(Duration::from_secs(5), Duration::from_millis(100), || {
        let client = client.clone();
        async move {
            let (s, body) = readyz(&client, admin).await;
            assert_eq!(
                s, 200,
                "readyz must stay 200 while Redis is down (body {body:?})"
            );
            body.starts_with("degraded").then_some(())
        }
    })
    .await;
    assert!(
        degraded.is_some(),
        "readyz not degraded 5 s after Redis died: {:?}",
        readyz(&client, admin).await
    );

    // Proxying still works while degraded.
    let r = client.get(&url(cg.addr(), "/api/items/1")).await;
    assert_eq!(r.status, 200, "{r}");

    redis.restart().await;
    let ready = becomes_ready(
        &client,
        admin,
        Duration::from_secs(5),
        Duration::from_millis(100),
    )
    .await;
    assert!(
        ready,
        "readyz not ready 5 s after Redis returned: {:?}",
        readyz(&client, admin).await
    );
    cg.shutdown().await;
}

const TOKEN: &str = "purge-secret-0123456789abcdef";

/// `POST /admin/purge` with `body` and the admin token.
async fn purge(client: &HttpClient, admin: std::net::SocketAddr, body: &str) -> Resp {
    common::purge(client, admin, Some(TOKEN), body).await
}

/// Purges are rate-limited per token: of 100 pattern purges of `/*` sent at once with
/// `purge_rate = 1` and `purge_burst = 10`, the burst (and what the rate adds while they
/// run) succeed; every other gets 429 with `Retry-After: 1` and a short JSON body, and is
/// counted in `cacheguard_purges_total{result="rate_limited"}`. A purge of keys has a
/// budget of its own; after `Retry-After` a pattern purge succeeds again; a reload to
/// `purge_rate = 0` lifts the limit. Before, all 100 succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_are_rate_limited_per_token_and_a_reload_changes_the_limit() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cacheguard.toml");
    let text = |rate: u32, burst: u32| {
        CgConfig::new(&origin)
            .set_str("admin", "token", TOKEN)
            .set("admin", "purge_rate", &rate.to_string())
            .set("admin", "purge_burst", &burst.to_string())
            .toml()
    };
    std::fs::write(&path, text(1, 10)).expect("write config");
    let vars = HashMap::<String, String>::new();
    let config = cacheguard::Config::load(&path, &vars).expect("config loads");
    let mut cg = cacheguard::App::start(config).await.expect("starts");
    cg.watch_config(path.clone(), Arc::new(vars));
    let (client, admin) = (HttpClient::new(), cg.admin_addr());
    for i in 0..3 {
        let r = client
            .get(&url(cg.addr(), &format!("/api/items/p{i}")))
            .await;
        assert_eq!(r.status, 200, "{r}");
    }

    let started = Instant::now();
    let answers = concurrently(100, Duration::from_secs(20), |_| {
        let client = client.clone();
        async move { purge(&client, admin, r#"{"patterns": ["/*"]}"#).await }
    })
    .await;
    let took = started.elapsed().as_secs_f64();
    let ok = answers.iter().filter(|r| r.status == 200).count();
    let limited: Vec<&Resp> = answers.iter().filter(|r| r.status == 429).collect();
    assert_eq!(ok + limited.len(), 100, "only 200 and 429 expected");
    assert!(
        ok >= 10 && ok as f64 <= 10.0 + took + 1.0,
        "{ok} of 100 pattern purges passed in {took:.2} s (burst 10, 1 per second)"
    );
    for r in &limited {
        assert_eq!(r.header("retry-after").as_deref(), Some("1"), "{r}");
        assert!(
            r.text().contains("too many purge requests") && r.body.len() < 200,
            "{r}"
        );
    }
    let counted = metric(
        &client,
        admin,
        "cacheguard_purges_total",
        &[("result", "rate_limited")],
    )
    .await;
    assert_eq!(counted, limited.len() as f64);

    let keys = purge(&client, admin, r#"{"keys": ["/api/items/p1"]}"#).await;
    assert_eq!(keys.status, 200, "keys have a budget of their own: {keys}");
    let refused = purge(&client, admin, r#"{"patterns": ["/*"]}"#).await;
    assert_eq!(refused.status, 429, "{refused}");
    let wait: u64 = refused
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in seconds");
    tokio::time::sleep(Duration::from_secs(wait)).await;
    let again = purge(&client, admin, r#"{"patterns": ["/*"]}"#).await;
    assert_eq!(again.status, 200, "after Retry-After: {again}");

    // Reloaded without a limit.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text(0, 0)).expect("write config");
    std::fs::rename(&tmp, &path).expect("rename config");
    let reloaded = poll_until(Duration::from_secs(5), Duration::from_millis(100), || {
        let client = client.clone();
        async move {
            let generation = metric(&client, admin, "cacheguard_config_generation", &[]).await;
            (generation >= 2.0).then_some(())
        }
    })
    .await;
    assert!(reloaded.is_some(), "the config was not reloaded");
    let answers = concurrently(30, Duration::from_secs(20), |_| {
        let client = client.clone();
        async move {
            purge(&client, admin, r#"{"patterns": ["/*"]}"#)
                .await
                .status
        }
    })
    .await;
    assert!(answers.iter().all(|s| *s == 200), "{answers:?}");
    cg.shutdown().await;
}
