//! Each proxy worker keeps its own pool of origin connections: a connection a worker opened
//! is driven by that worker's event loop and carries only that worker's requests, whatever
//! the path (a miss, a pass-through, a write); threads that are no proxy worker (a
//! warm-up) keep a pool of their own. Seen in
//! `cacheguard_origin_requests_off_worker_total{reason}`, which counts the requests sent
//! from another thread than the one that drives their connection.

use std::time::Duration;

use http::Method;

use crate::common::client::full_body;
use crate::common::load::WarmConn;
use crate::common::{self, CgConfig, HttpClient, RawOrigin};

const OFF_WORKER: &str = "cacheguard_origin_requests_off_worker_total";

/// Two workers, eight keep-alive client connections (four on each: the accept loop deals
/// them out in turn), each sending misses, pass-through GETs and POSTs and writes one
/// after the other: no origin request goes out on a connection of another worker, none is
/// sent from outside the workers but the warm-up's, and the origin's connections are
/// reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_connection_serves_only_the_worker_that_opened_it() {
    let origin = RawOrigin::start(
        b"HTTP/1.1 200 OK\r\nCache-Control: max-age=60\r\nContent-Length: 2\r\n\r\nok".to_vec(),
    )
    .await;
    let routes = common::item_route(
        r#"warmup = { paths = ["/api/items/warm-1", "/api/items/warm-2"], rate = 10 }"#,
    ) + &common::route(
        "item-write",
        "/api/items/{id}",
        "PUT",
        r#"invalidate = ["/api/items/{id}"]"#,
    );
    let cg = CgConfig::with_upstream(&origin.url())
        .set("server", "worker_threads", "2")
        .set("upstream", "pool_max_idle", "16")
        .routes(&routes)
        .start()
        .await;
    let client = HttpClient::new();
    let admin = cg.admin_addr();

    // The warm-up runs on the main runtime, outside the workers: its two fills are the
    // only requests counted as sent from no worker. Their connections stay in the pool of
    // the threads outside the workers (on a shared pool, the workers would take them).
    common::wait_metric(
        &client,
        admin,
        OFF_WORKER,
        &[("reason", "not_a_worker")],
        Duration::from_secs(10),
        Duration::from_millis(50),
        |v| v >= 2.0,
        common::no_poke,
    )
    .await;

    let mut conns = Vec::new();
    for c in 0..8 {
        conns.push(
            WarmConn::open(cg.addr(), &format!("/other/open-{c}"))
                .await
                .expect("a client connection"),
        );
    }
    let before = origin.requests();
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(c, mut conn)| {
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for i in 0..20 {
                    let (method, path, body) = match i % 4 {
                        0 => (Method::GET, format!("/api/items/miss-{c}-{i}"), ""),
                        1 => (Method::GET, format!("/other/get-{c}-{i}"), ""),
                        2 => (Method::POST, format!("/other/post-{c}-{i}"), "a body"),
                        _ => (Method::PUT, format!("/api/items/write-{c}-{i}"), "a write"),
                    };
                    let answer = conn
                        .send(method.clone(), &path, full_body(body.to_owned()))
                        .await
                        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
                    statuses.push(answer.status.as_u16());
                }
                statuses
            })
        })
        .collect();
    for statuses in common::join_within(tasks, Duration::from_secs(60), "the clients").await {
        assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    }
    assert_eq!(
        origin.requests() - before,
        160,
        "every request reached the origin once"
    );

    let exposition = common::metrics(&client, admin).await;
    for reason in ["not_a_worker", "other_worker"] {
        assert!(
            exposition
                .samples_named(OFF_WORKER)
                .any(|s| s.labels.get("reason").is_some_and(|v| v == reason)),
            "{OFF_WORKER}{{reason=\"{reason}\"}} is not exported"
        );
    }
    assert_eq!(
        exposition.sum(OFF_WORKER, &[("reason", "other_worker")]),
        0.0,
        "origin requests went out on a connection another thread drives"
    );
    assert_eq!(
        exposition.sum(OFF_WORKER, &[("reason", "not_a_worker")]),
        2.0,
        "a worker's origin request was counted as sent from outside the workers"
    );
    let per_connection = origin.per_connection();
    let connections = per_connection.len();
    assert!(
        connections * 4 <= per_connection.iter().sum::<u64>() as usize,
        "origin connections were not reused: {per_connection:?}"
    );
    cg.shutdown().await;
}
