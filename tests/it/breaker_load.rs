//! The circuit breaker opens for a sick Redis, not for a busy process. cacheguard embedded
//! in a program shares that program's runtime; when the program keeps it busy (here: its
//! threads blocked 300 ms at a time, as a CPU-bound host would), Redis answers must still
//! arrive in time, so requests keep using Redis, the breaker never opens, and each key is
//! fetched from the origin once. (The slow-Redis and killed-Redis tests in `avalanche.rs`
//! and `redis_outage.rs` show it still opens when Redis is the problem; the saturating
//! flood of `flash_sale.rs` that it does not open for a saturated machine.)
//!
//! And the other side: a Redis that answers nothing — stopped (`SIGSTOP`: its sockets open,
//! nothing read) or behind a blackholed network — still opens the breaker within
//! 3 × `command_timeout` + 50 ms of the fault, under traffic, with the default 50 ms.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::common::{
    CgConfig, HttpClient, RedisServer, TcpProxy, TestOrigin, metric, poll_until, url,
};

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

/// How Redis falls silent.
#[derive(Clone, Copy, Debug)]
enum Silence {
    /// `SIGSTOP` of redis-server.
    Stopped,
    /// The network between cacheguard and Redis forwards nothing (a [`TcpProxy`] blackhole).
    Blackholed,
}

const COMMAND_TIMEOUT: Duration = Duration::from_millis(50);
/// What the breaker must open within: 3 × `command_timeout` + 50 ms.
const OPEN_WITHIN: Duration = Duration::from_millis(3 * 50 + 50);
/// Allowance for seeing it: the metric is read over HTTP every few milliseconds on a shared
/// machine (the decision itself is bounded on paused time in `coord::redis`'s unit tests).
const SEEN_SLACK: Duration = Duration::from_millis(250);

/// Time from Redis falling silent to the breaker seen open, under a steady read load (L1 off:
/// every answer reads Redis) with `command_timeout` 50 ms.
async fn time_to_open(silence: Silence) -> Duration {
    let _heavy = crate::common::heavy().await;
    let redis = RedisServer::start().await;
    let proxy = TcpProxy::start(redis.addr()).await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set_str("redis", "url", &proxy.redis_url())
        .set_str("redis", "command_timeout", "50ms")
        .l1("off")
        .start()
        .await;
    let client = HttpClient::new();
    let admin = cg.admin_addr();
    let up = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async {
            (metric(&client, admin, "cacheguard_redis_up", &[]).await == 1.0).then_some(())
        },
    )
    .await;
    assert!(up.is_some(), "Redis never seen up");
    for i in 0..KEYS {
        client
            .get(&url(cg.addr(), &format!("/api/items/silent-{i}")))
            .await;
    }
    // Readers keep commands in flight (bounded in count and time).
    let stop = tokio_util::sync::CancellationToken::new();
    let addr = cg.addr();
    let readers: Vec<_> = (0..4)
        .map(|worker| {
            let stop = stop.clone();
            let client = client.clone();
            tokio::spawn(async move {
                let until = Instant::now() + Duration::from_secs(10);
                let mut i = worker;
                for _ in 0..100_000 {
                    if stop.is_cancelled() || Instant::now() >= until {
                        break;
                    }
                    let path = format!("/api/items/silent-{}", i % KEYS);
                    let _ = client.try_get(&url(addr, &path)).await;
                    i += 4;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let opened_before = metric(
        &client,
        admin,
        "cacheguard_redis_breaker_transitions_total",
        &[("to", "open")],
    )
    .await;
    assert_eq!(opened_before, 0.0, "the breaker opened before the fault");
    let silent = Instant::now();
    match silence {
        Silence::Stopped => redis.pause(),
        Silence::Blackholed => proxy.blackhole(),
    }
    let seen = poll_until(Duration::from_secs(3), Duration::from_millis(5), || async {
        (metric(&client, admin, "cacheguard_redis_breaker_open", &[]).await == 1.0)
            .then(|| silent.elapsed())
    })
    .await;
    match silence {
        Silence::Stopped => redis.resume(),
        Silence::Blackholed => proxy.restore(),
    }
    stop.cancel();
    for reader in readers {
        reader.await.unwrap();
    }
    cg.shutdown().await;
    seen.unwrap_or_else(|| panic!("{silence:?}: the breaker did not open within 3 s"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_redis_opens_the_breaker_within_three_timeouts() {
    let took = time_to_open(Silence::Stopped).await;
    eprintln!("SIGSTOP: breaker seen open after {took:?} (command_timeout {COMMAND_TIMEOUT:?})");
    assert!(
        took <= OPEN_WITHIN + SEEN_SLACK,
        "SIGSTOP: the breaker opened after {took:?}, not within {OPEN_WITHIN:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_redis_opens_the_breaker_within_three_timeouts() {
    let took = time_to_open(Silence::Blackholed).await;
    eprintln!("blackhole: breaker seen open after {took:?} (command_timeout {COMMAND_TIMEOUT:?})");
    assert!(
        took <= OPEN_WITHIN + SEEN_SLACK,
        "blackhole: the breaker opened after {took:?}, not within {OPEN_WITHIN:?}"
    );
}
