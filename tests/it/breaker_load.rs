//! The circuit breaker opens for a sick Redis, not for a busy process. cacheguard embedded
//! in a program shares that program's runtime; when the program keeps it busy (here: its
//! threads blocked 300 ms at a time, as a CPU-bound host would), Redis answers must still
//! arrive in time, so requests keep using Redis, the breaker never opens, and each key is
//! fetched from the origin once. (The slow-Redis and killed-Redis tests in `avalanche.rs`
//! and `redis_outage.rs` show it still opens when Redis is the problem.)

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::common::{CgConfig, HttpClient, RedisServer, TestOrigin, metric, poll_until, url};

const KEYS: usize = 40;
const BUSY_FOR: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_host_runtime_does_not_open_the_breaker() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).redis(&redis).l1("off").start().await;
    let client = HttpClient::new();
    let up = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            (metric(&client, cg.admin_addr(), "cacheguard_redis_up", &[]).await == 1.0)
                .then_some(())
        },
    )
    .await;
    assert!(up.is_some(), "Redis never seen up");
    // The keys are in Redis before the host gets busy: from then on every answer is a read
    // from Redis (L1 is off), or, with the breaker open, a fetch from the origin.
    for i in 0..KEYS {
        let r = client
            .get(&url(cg.addr(), &format!("/api/items/busy-{i}")))
            .await;
        assert_eq!(r.x_cache(), "MISS", "{r}");
    }

    // Requests from a thread and runtime of their own, for as long as the host is busy.
    let addr = cg.addr();
    let load = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let client = HttpClient::new();
            let until = Instant::now() + BUSY_FOR;
            let mut tasks = Vec::new();
            for worker in 0..4 {
                let client = client.clone();
                tasks.push(tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut i = worker;
                    while Instant::now() < until && seen.len() < 10_000 {
                        let path = format!("/api/items/busy-{}", i % KEYS);
                        let r = client.try_get(&url(addr, &path)).await;
                        seen.push(r.map(|r| (r.status.as_u16(), r.x_cache().to_owned())));
                        i += 4;
                    }
                    seen
                }));
            }
            let mut all = Vec::new();
            for task in tasks {
                all.extend(task.await.unwrap());
            }
            all
        })
    });

    // The host keeps every thread of the runtime cacheguard was started on busy.
    let busy: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(async {
                let until = Instant::now() + BUSY_FOR;
                while Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(300));
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    for task in busy {
        task.await.unwrap();
    }
    let answers = tokio::task::spawn_blocking(move || load.join().unwrap())
        .await
        .unwrap();

    let mut by_answer = BTreeMap::new();
    for answer in &answers {
        let key = match answer {
            Ok((status, cache)) => format!("{status} {cache}"),
            Err(e) => format!("error {e}"),
        };
        *by_answer.entry(key).or_insert(0u32) += 1;
    }
    eprintln!("{} answers: {by_answer:?}", answers.len());
    let opened = metric(
        &client,
        cg.admin_addr(),
        "cacheguard_redis_breaker_transitions_total",
        &[("to", "open")],
    )
    .await;
    assert_eq!(opened, 0.0, "the breaker opened: {by_answer:?}");
    assert!(answers.len() >= 2 * KEYS, "too little load: {by_answer:?}");

    let fetched_twice: Vec<String> = (0..KEYS)
        .map(|i| format!("/api/items/busy-{i}"))
        .filter(|path| origin.count(path) > 1)
        .collect();
    assert!(
        fetched_twice.is_empty(),
        "fetched from the origin more than once: {fetched_twice:?}; answers {by_answer:?}"
    );
    assert_eq!(
        by_answer.keys().collect::<Vec<_>>(),
        ["200 HIT-L2"],
        "every answer read from Redis"
    );
    cg.shutdown().await;
}
