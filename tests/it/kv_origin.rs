//! Self-checks of the test origin's versioned KV store ([`TestOrigin::enable_kv`]), with
//! no cacheguard in between: versions, replica lag, slow reads racing a write, write delay,
//! `Surrogate-Key` tags and per-path precedence. Tests of the write path rely on these.

use std::time::Duration;

use http::Method;
use tokio::time::Instant;

use crate::common::client::full_body;
use crate::common::{HttpClient, Resp, TestOrigin, default_body, poll_until};

fn kv_url(origin: &TestOrigin, key: &str) -> String {
    format!("{}/kv/{key}", origin.url())
}

/// `(key, version)` of a KV answer; panics on anything else.
fn parse(resp: &Resp) -> (String, u64) {
    assert_eq!(resp.status, 200, "{resp}");
    assert_eq!(
        resp.header("content-type").as_deref(),
        Some("application/json")
    );
    let v: serde_json::Value = serde_json::from_slice(&resp.body)
        .unwrap_or_else(|e| panic!("KV body is not JSON ({e}): {}", resp.text()));
    let key = v["key"].as_str().expect("key").to_owned();
    let version = v["version"].as_u64().expect("version");
    (key, version)
}

async fn get(client: &HttpClient, origin: &TestOrigin, key: &str) -> u64 {
    let (k, version) = parse(&client.get(&kv_url(origin, key)).await);
    assert_eq!(k, key);
    version
}

async fn put_resp(client: &HttpClient, origin: &TestOrigin, key: &str) -> Resp {
    client
        .request(
            Method::PUT,
            &kv_url(origin, key),
            &[("content-type", "application/json")],
            full_body(r#"{"ignored":true}"#),
        )
        .await
        .unwrap_or_else(|e| panic!("PUT /kv/{key}: {e}"))
}

async fn put(client: &HttpClient, origin: &TestOrigin, key: &str) -> u64 {
    let (k, version) = parse(&put_resp(client, origin, key).await);
    assert_eq!(k, key);
    version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_versions_start_at_zero_and_increment_per_key() {
    let origin = TestOrigin::start_kv().await;
    let client = HttpClient::new();

    assert_eq!(get(&client, &origin, "a").await, 0);
    assert_eq!(put(&client, &origin, "a").await, 1);
    assert_eq!(put(&client, &origin, "a").await, 2);
    assert_eq!(origin.kv_version("a"), 2);
    // no lag: the replica shows the primary at once
    assert_eq!(get(&client, &origin, "a").await, 2);
    // other keys are independent
    assert_eq!(get(&client, &origin, "b").await, 0);
    assert_eq!(origin.kv_version("b"), 0);
    assert_eq!(origin.kv_version("never-seen"), 0);

    assert_eq!(origin.kv_reads("a"), 2, "reads count GETs only, not PUTs");
    assert_eq!(origin.kv_reads("b"), 1);
    assert_eq!(origin.kv_reads("never-seen"), 0);
    assert_eq!(
        origin.count("/kv/a"),
        4,
        "the usual per-path counter sees both"
    );
    // the KV store only answers /kv/<one segment>
    let r = client.get(&format!("{}/kv/a/b", origin.url())).await;
    assert_eq!(r.body, default_body("/kv/a/b", 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_is_off_by_default_and_per_path_settings_take_precedence() {
    let origin = TestOrigin::start().await;
    let client = HttpClient::new();
    let r = client.get(&kv_url(&origin, "a")).await;
    assert_eq!(r.body, default_body("/kv/a", 1), "KV store off by default");
    let r = put_resp(&client, &origin, "a").await;
    assert_eq!(r.body, default_body("/kv/a", 2));
    assert_eq!(origin.kv_version("a"), 0);

    origin.enable_kv();
    origin.set_status("/kv/a", 503);
    let r = put_resp(&client, &origin, "a").await;
    assert_eq!(r.status, 503);
    assert_eq!(
        origin.kv_version("a"),
        0,
        "a PUT answered by a per-path status commits nothing"
    );
    origin.reset("/kv/a");
    assert_eq!(put(&client, &origin, "a").await, 1);
    origin.set_body("/kv/a", r#"{"fixed":1}"#);
    assert_eq!(
        client.get(&kv_url(&origin, "a")).await.text(),
        r#"{"fixed":1}"#
    );
    assert_eq!(
        origin.kv_reads("a"),
        1,
        "a GET is counted even when a per-path body answers it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_replica_lag_hides_a_write_until_it_is_old_enough() {
    let lag = Duration::from_millis(1000);
    let origin = TestOrigin::start_kv().await;
    origin.set_replica_lag(lag);
    let client = HttpClient::new();

    let before_put = Instant::now();
    assert_eq!(put(&client, &origin, "k").await, 1);
    let put_answered = Instant::now();
    assert_eq!(origin.kv_version("k"), 1, "the primary has it at once");
    let read = get(&client, &origin, "k").await;
    // The commit happened after `before_put`, the read arrived before now: when that span
    // is under the lag, the replica cannot show the write yet.
    let span = before_put.elapsed();
    assert!(
        span < lag,
        "too slow to check the lag: PUT + GET took {span:?}"
    );
    assert_eq!(
        read, 0,
        "a GET right after the PUT reads the replica's old version"
    );

    tokio::time::sleep_until(put_answered + lag + Duration::from_millis(50)).await;
    assert_eq!(
        get(&client, &origin, "k").await,
        1,
        "after the lag the replica shows it"
    );

    // the next write is hidden again, behind the version already visible
    let before_put = Instant::now();
    assert_eq!(put(&client, &origin, "k").await, 2);
    let put_answered = Instant::now();
    let read = get(&client, &origin, "k").await;
    let span = before_put.elapsed();
    assert!(
        span < lag,
        "too slow to check the lag: PUT + GET took {span:?}"
    );
    assert_eq!(read, 1);
    tokio::time::sleep_until(put_answered + lag + Duration::from_millis(50)).await;
    assert_eq!(get(&client, &origin, "k").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_slow_read_answers_the_version_it_read_on_arrival() {
    let read_delay = Duration::from_millis(400);
    let origin = TestOrigin::start_kv().await;
    origin.set_kv_read_delay(read_delay);
    let client = HttpClient::new();

    let slow = {
        let client = client.clone();
        let url = kv_url(&origin, "r");
        tokio::spawn(async move {
            let started = Instant::now();
            let resp = client.get(&url).await;
            (parse(&resp).1, started.elapsed())
        })
    };
    // the slow GET has arrived (and read version 0): now write
    poll_until(Duration::from_secs(5), Duration::from_millis(2), || async {
        (origin.kv_reads("r") == 1).then_some(())
    })
    .await
    .expect("the slow GET did not reach the origin");
    assert_eq!(
        put(&client, &origin, "r").await,
        1,
        "writes are not delayed by reads"
    );
    let (version, took) = slow.await.expect("slow GET task");
    assert_eq!(
        version, 0,
        "the slow read answers what it read before the write"
    );
    assert!(took >= read_delay, "the read answered after {took:?}");

    origin.set_kv_read_delay(Duration::ZERO);
    assert_eq!(get(&client, &origin, "r").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_write_delay_commits_after_the_delay() {
    let write_delay = Duration::from_millis(400);
    let origin = TestOrigin::start_kv().await;
    origin.set_kv_write_delay(write_delay);
    let client = HttpClient::new();

    let started = Instant::now();
    let slow = {
        let client = client.clone();
        let url = kv_url(&origin, "w");
        tokio::spawn(async move {
            client
                .request(Method::PUT, &url, &[], full_body("x"))
                .await
                .map(|r| parse(&r).1)
        })
    };
    poll_until(Duration::from_secs(5), Duration::from_millis(2), || async {
        (origin.count("/kv/w") == 1).then_some(())
    })
    .await
    .expect("the PUT did not reach the origin");
    let version_while_waiting = origin.kv_version("w");
    if started.elapsed() < write_delay {
        assert_eq!(version_while_waiting, 0, "committed before the write delay");
        assert_eq!(get(&client, &origin, "w").await, 0);
    }
    let version = slow.await.expect("PUT task").expect("PUT");
    assert_eq!(version, 1);
    assert!(started.elapsed() >= write_delay);
    assert_eq!(origin.kv_version("w"), 1);
    assert_eq!(get(&client, &origin, "w").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_surrogate_key_tags_only_when_enabled() {
    let origin = TestOrigin::start_kv().await;
    let client = HttpClient::new();

    let r = client.get(&kv_url(&origin, "t1")).await;
    assert_eq!(r.header("surrogate-key"), None, "no tags by default");
    let r = put_resp(&client, &origin, "t1").await;
    assert_eq!(r.header("surrogate-key"), None);

    origin.set_kv_tags(true);
    let r = client.get(&kv_url(&origin, "t1")).await;
    assert_eq!(parse(&r), ("t1".to_owned(), 1));
    assert_eq!(r.header("surrogate-key").as_deref(), Some("kv-t1 kv-all"));
    let r = put_resp(&client, &origin, "t1").await;
    assert_eq!(parse(&r), ("t1".to_owned(), 2));
    assert_eq!(r.header("surrogate-key").as_deref(), Some("kv-t1 kv-all"));
}
