//! Logs: human by default, one JSON object per line with `--log-format json`, and
//! no log line per request on the hit path.

mod common;

use std::time::Duration;

use common::*;

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
