//! Logs: human by default, one JSON object per line with `--log-format json`, and
//! no log line per request on the hit path.

use std::time::Duration;

use crate::common;
use crate::common::*;

/// With `--log-format json` every log line is a JSON object with a level and a message; 300
/// requests (a miss, then hits) add no log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_and_no_line_per_hit() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = CgConfig::new(&origin)
        .on_free_ports()
        .l1("all")
        // Hot-key promotion is logged (once per promotion, not per request): off here.
        .set("hot_keys", "threshold_rps", "0")
        .write_to(&dir.path().join("cacheguard.toml"));
    let mut cg = spawn_cacheguard_process_with_args(&path, &["--log-format", "json"]).await;
    let client = HttpClient::new();
    // Let start-up logging settle, then count.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines = |out: &str| {
        out.lines()
            .filter(|l| l.trim_start().starts_with('{'))
            .count()
    };
    let before = lines(&cg.output());
    for _ in 0..300 {
        let resp = client.get(&url(cg.addr(), "/api/items/1")).await;
        assert_eq!(resp.status, 200);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let output = cg.output();
    assert_eq!(lines(&output), before, "requests were logged:\n{output}");
    assert!(
        !output.contains("/api/items/1"),
        "a request path was logged:\n{output}"
    );
    cg.terminate();
    assert!(cg.wait_exit(Duration::from_secs(10)).await.is_some());
    let output = cg.output();
    let mut logged = 0;
    for line in output
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("---"))
    {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
        assert!(value["level"].is_string(), "no level: {line}");
        assert!(value["fields"]["message"].is_string(), "no message: {line}");
        logged += 1;
    }
    assert!(logged >= 2, "start and stop are logged:\n{output}");
}

/// The JSON log lines of `output` whose message is cacheguard's own-error line.
fn own_error_lines(output: &str) -> Vec<serde_json::Value> {
    output
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|v| v["fields"]["message"] == "Answered with cacheguard's own error.")
        .collect()
}

/// Every answer cacheguard makes itself leaves one line naming the route, the status, the
/// reason and the upstream error; a flood of them is held to a rate, and what was held
/// back is counted on the next line. Regression: a 502 left nothing but a metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_errors_are_logged_with_their_cause_and_rate_limited() {
    // Nothing listens on the origin's port: every fetch is refused.
    let origin_url = format!("http://127.0.0.1:{}", free_port());
    let dir = tempfile::tempdir().expect("tempdir");
    let path = CgConfig::with_upstream(&origin_url)
        .on_free_ports()
        .write_to(&dir.path().join("cacheguard.toml"));
    let mut cg = spawn_cacheguard_process_with_args(&path, &["--log-format", "json"]).await;
    let client = HttpClient::new();

    let refused = client.get(&url(cg.addr(), "/api/items/1")).await;
    assert_eq!(refused.status, 502, "{refused}");
    let big = "x".repeat(20_000);
    let too_large = client
        .get_with_headers(&url(cg.addr(), "/api/items/2"), &[("x-big", big.as_str())])
        .await;
    assert_eq!(too_large.status, 431, "{too_large}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines = own_error_lines(&cg.output());
    let found = |status: u64, route: &str, reason: &str| {
        lines.iter().find(|l| {
            l["fields"]["status"] == status
                && l["fields"]["route"] == route
                && l["fields"]["reason"] == reason
        })
    };
    let line = found(502, "item", "origin_unreachable")
        .unwrap_or_else(|| panic!("no line for the 502:\n{}", cg.output()));
    let error = line["fields"]["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("onnect"),
        "the line names the upstream error: {line}"
    );
    assert_eq!(line["fields"]["path"], "/api/items/1", "{line}");
    assert!(
        found(431, "-", "header_too_large").is_some(),
        "no line for the 431:\n{}",
        cg.output()
    );
    // The client is told less than the log.
    assert!(!refused.text().contains("os error"), "{refused}");

    // A flood: 300 errors in well under a second are held to the burst and the rate.
    let before = own_error_lines(&cg.output()).len();
    let started = std::time::Instant::now();
    for i in 0..300 {
        let resp = client
            .get(&url(cg.addr(), &format!("/api/items/f{i}")))
            .await;
        assert_eq!(resp.status, 502);
    }
    let elapsed = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let resp = client.get(&url(cg.addr(), "/api/items/after")).await;
    assert_eq!(resp.status, 502);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines = own_error_lines(&cg.output());
    let flood = lines.len() - before;
    // Burst 20, then 10 per second (plus the line after the flood).
    let allowed = 20 + (elapsed * 10.0).ceil() as usize + 1;
    assert!(
        flood <= allowed,
        "{flood} lines for 301 errors in {elapsed:.2}s; at most {allowed} allowed"
    );
    // Every error is either a line or counted as held back on a later line.
    let held_back: u64 = lines[before..]
        .iter()
        .map(|l| l["fields"]["suppressed"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(
        flood as u64 + held_back,
        301,
        "{flood} lines and {held_back} held back for 301 errors"
    );
    assert!(held_back > 0, "nothing was held back");
    cg.terminate();
    assert!(cg.wait_exit(Duration::from_secs(10)).await.is_some());
}

/// A request refused for a method longer than cacheguard takes leaves an own-answer line
/// like any other 400 (status, reason, route `-`), its method cut to the 32 bytes taken:
/// a client cannot make the line as long as its head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlong_method_is_logged_as_an_own_answer_cut_short() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = CgConfig::new(&origin)
        .on_free_ports()
        .write_to(&dir.path().join("cacheguard.toml"));
    let cg = spawn_cacheguard_process_with_args(&path, &["--log-format", "json"]).await;
    let method = "M".repeat(300);
    let request = format!("{method} /other/m HTTP/1.1\r\nHost: a.example\r\n\r\n");
    let (answer, _) = raw_until_closed(cg.addr(), request.as_bytes(), Duration::from_secs(5)).await;
    assert_eq!(status_of(&answer), 400, "{answer:?}");
    let line = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            own_error_lines(&cg.output())
                .into_iter()
                .find(|l| l["fields"]["status"] == 400 && l["fields"]["path"] == "/other/m")
        },
    )
    .await
    .unwrap_or_else(|| panic!("no line for the 400:\n{}", cg.output()));
    assert_eq!(line["fields"]["reason"], "bad_request", "{line}");
    assert_eq!(line["fields"]["route"], "-", "{line}");
    assert_eq!(line["fields"]["method"], "M".repeat(32), "{line}");
    assert_eq!(origin.count("/other/m"), 0);
}

/// A Redis ACL user that may not run scripts: every lock attempt is refused with NOPERM.
/// Requests are still answered (from the origin), the refusal is logged and says which
/// command lacks permission — once, not once per request — and, since Redis itself
/// answers, it does not open the breaker (which the next probe would close again: a flap
/// per few requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_acl_permission_is_logged_once_and_does_not_open_the_breaker() {
    let redis = RedisServer::start().await;
    let mut con = redis.client().await;
    redis::cmd("ACL")
        .arg("SETUSER")
        .arg("cg")
        .arg("on")
        .arg(">cg-secret")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg("-evalsha")
        .arg("-eval")
        .query_async::<()>(&mut con)
        .await
        .expect("ACL SETUSER");
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("redis", "username", "cg")
        .set_str("redis", "password", "cg-secret")
        .on_free_ports()
        .write_to(&dir.path().join("cacheguard.toml"));
    let cg = spawn_cacheguard_process_with_args(&path, &["--log-format", "json"]).await;
    let client = HttpClient::new();
    let transitions = || async {
        metric(
            &client,
            cg.admin_addr(),
            "cacheguard_redis_breaker_transitions_total",
            &[],
        )
        .await
    };
    // The breaker starts open and closes at the first probe: one transition.
    let at_start = transitions().await;
    for i in 0..30 {
        let r = client
            .get(&url(cg.addr(), &format!("/api/items/acl-{i}")))
            .await;
        assert_eq!(r.status, 200, "#{i}: {r}");
    }
    let after = transitions().await;
    let output = cg.output();
    let refused: Vec<&str> = output.lines().filter(|l| l.contains("NOPERM")).collect();
    assert!(
        !refused.is_empty() && refused.len() <= 2,
        "{} lines name the refusal (one expected):\n{output}",
        refused.len()
    );
    assert!(
        refused[0].to_lowercase().contains("evalsha"),
        "the line does not say which command: {}",
        refused[0]
    );
    assert_eq!(after, at_start, "the breaker moved:\n{output}");
}

/// While Redis is down the event bus retries every 500 ms; its log says so once, then at
/// most once a minute with a count, not once per attempt; and once when it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_bus_that_cannot_subscribe_logs_its_state_not_each_attempt() {
    let mut redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = CgConfig::new(&origin)
        .redis(&redis)
        .on_free_ports()
        .write_to(&dir.path().join("cacheguard.toml"));
    let cg = spawn_cacheguard_process(&path).await;
    let client = HttpClient::new();
    redis.kill();
    // About ten attempts at the 500 ms backoff.
    tokio::time::sleep(Duration::from_secs(5)).await;
    redis.restart().await;
    let back = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        || async {
            let live = metric(
                &client,
                cg.admin_addr(),
                "cacheguard_event_bus_subscribed",
                &[],
            )
            .await;
            (live == 1.0).then_some(())
        },
    )
    .await;
    assert!(back.is_some(), "the bus did not come back");
    let output = cg.output();
    let failing = output
        .lines()
        .filter(|l| l.contains("cannot subscribe"))
        .count();
    assert!(
        (1..=2).contains(&failing),
        "{failing} lines about failing to subscribe in 5 s:\n{output}"
    );
}

/// A Redis Cluster primary dies under load and its replica is promoted: the log tells the
/// story in a few lines (the breaker opening and closing, a topology change), not dozens a
/// second, and the breaker does not flap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_failover_is_logged_in_a_few_lines() {
    let mut cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = CgConfig::new(&origin)
        .redis_cluster(&cluster)
        .on_free_ports()
        .write_to(&dir.path().join("cacheguard.toml"));
    let cg = spawn_cacheguard_process(&path).await;
    let client = HttpClient::new();
    let transitions = || async {
        metric(
            &client,
            cg.admin_addr(),
            "cacheguard_redis_breaker_transitions_total",
            &[],
        )
        .await
    };
    // Redis in use (the breaker starts open and closes at the first probe).
    let closed = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        || async {
            let open = metric(
                &client,
                cg.admin_addr(),
                "cacheguard_redis_breaker_open",
                &[],
            )
            .await;
            (open == 0.0).then_some(())
        },
    )
    .await;
    assert!(closed.is_some(), "the breaker never closed");
    let paths: Vec<String> = (0..60)
        .map(|i| format!("/api/items/failover-{i}"))
        .collect();
    let load_paths = paths.clone();
    let load = common::load::Load::new(&[cg.addr()], move |n| {
        load_paths[n as usize % load_paths.len()].clone()
    })
    .conns(4)
    .pause(Duration::from_millis(2))
    .duration(Duration::from_secs(40))
    .start();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = cg.output().lines().count();
    let at_kill = transitions().await;
    let victim = cluster.primaries().await[0];
    cluster.kill(victim);
    let promoted = cluster
        .wait_failed_over(victim, Duration::from_secs(30))
        .await;
    assert!(promoted.is_some(), "the replica was never promoted");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let tally = load.finish().await;
    let output = cg.output();
    let lines: Vec<&str> = output.lines().skip(before).collect();
    let flaps = transitions().await - at_kill;
    eprintln!(
        "{} lines, {flaps} breaker transitions, promoted after {promoted:?}; load {:?}",
        lines.len(),
        tally.by_x_cache
    );
    assert!(
        lines.len() <= 20,
        "{} log lines for one failover:\n{}",
        lines.len(),
        lines.join("\n")
    );
    // Open while the slots are down, closed once the replica serves them; a second open
    // is allowed for the moment the promoted node's slot map settles. Not a flap per probe.
    assert!(
        flaps <= 4.0,
        "the breaker moved {flaps} times:\n{}",
        lines.join("\n")
    );
}
