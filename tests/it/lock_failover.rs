//! The distributed fill lock under failure (Stampede): a holder that dies is replaced by
//! exactly one waiter once its lease ends; a slow fetch keeps its lease by renewing it; a
//! failed fetch's answer is shared with every waiter, on every instance; `on_timeout = "error"` answers 503.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::common;
use crate::common::fleet::{
    lock_events_sum, shutdown_all, spawn_fleet, start_coordinated, wait_coordinated,
    wait_for_lock_waiters,
};
use crate::common::{
    CgConfig, HttpClient, RedisServer, Resp, TestOrigin, default_body, join_within, metrics, url,
    wait_origin_count,
};

/// A waiter's answer and the moment it completed.
type Answer = (Result<Resp, String>, Instant);

/// `n` GETs of `path` on each of `addrs`, each reporting its answer and the moment it
/// completed.
fn spawn_waiters(
    client: &HttpClient,
    addrs: &[SocketAddr],
    path: &str,
    n: usize,
) -> Vec<JoinHandle<Answer>> {
    addrs
        .iter()
        .flat_map(|addr| (0..n).map(move |_| url(*addr, path)))
        .map(|u| {
            let client = client.clone();
            tokio::spawn(async move {
                let r = client.try_get(&u).await;
                (r, Instant::now())
            })
        })
        .collect()
}

/// Joins the waiters (bounded), in spawn order.
async fn join_waiters(handles: Vec<JoinHandle<Answer>>, timeout: Duration) -> Vec<Answer> {
    join_within(handles, timeout, "waiters").await
}

/// A Redis and an origin whose `path` answers after `delay`.
async fn redis_and_slow_origin(path: &str, delay: Duration) -> (RedisServer, TestOrigin) {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    origin.set_delay(path, delay);
    (redis, origin)
}

/// Every waiter got 200 with `expected`; `who` names a waiter in messages.
fn assert_all_got(results: &[Answer], expected: &str, who: &str) {
    for (i, (r, _)) in results.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("{who} {i}: {e}"));
        assert_eq!(r.status, 200, "{who} {i}: {r}");
        assert_eq!(r.body, expected, "{who} {i}: {r}");
    }
}

/// (a) The lock holder, a separate process, is SIGKILLed mid-fetch (lease 1 s). Its lease
/// expires, exactly one waiting instance takes over (origin count 2: the abandoned fetch
/// and the takeover), and every waiter is answered 200 within lease + origin delay +
/// 200 ms of the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_killed_mid_fetch_one_waiter_takes_over_after_the_lease() {
    const LEASE: Duration = Duration::from_secs(1);
    const DELAY: Duration = Duration::from_millis(800);
    let path = "/api/items/failover-kill";
    let (redis, origin) = redis_and_slow_origin(path, DELAY).await;
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("lock", "lease", "1s")
        .set_str("lock", "wait_timeout", "5s");
    let mut fleet = spawn_fleet(&cfg, 1).await;
    let b = cfg.start().await;
    let c = cfg.start().await;
    let client = HttpClient::new();
    let a_addr = fleet.addrs()[0];
    let mut admins = fleet.admin_addrs();
    admins.extend([b.admin_addr(), c.admin_addr()]);
    wait_coordinated(&client, &admins).await;

    // A (the process) takes the lock and starts fetching.
    let sent = Instant::now();
    let a_request = client.spawn_get(&url(a_addr, path));
    wait_origin_count(&origin, path, 1, Duration::from_secs(3)).await;
    let locks = redis.scan("cg:*:lock").await;
    assert_eq!(
        locks.len(),
        1,
        "A must hold the key's lock while fetching: {locks:?}"
    );

    // Waiters on B and C; both instances' leaders are waiting on A's lock.
    let waiters = spawn_waiters(&client, &[b.addr(), c.addr()], path, 10);
    wait_for_lock_waiters(&client, b.admin_addr(), 1.0).await;
    wait_for_lock_waiters(&client, c.admin_addr(), 1.0).await;

    assert_eq!(
        origin.in_flight(),
        1,
        "A's fetch must still be in flight at the kill"
    );
    assert!(
        sent.elapsed() < DELAY - Duration::from_millis(100),
        "setup took {:?}: A may have finished its fetch before the kill",
        sent.elapsed()
    );
    let a_pid = fleet.procs[0].pid();
    fleet.procs[0].kill(); // SIGKILL by PID
    let killed = Instant::now();
    eprintln!(
        "killed A (pid {a_pid:?}) {:?} after its request",
        sent.elapsed()
    );
    let a_answer = a_request.await.expect("A request task");
    assert!(
        a_answer.is_err(),
        "A was killed mid-fetch; its client cannot have an answer: {a_answer:?}"
    );

    let results = join_waiters(waiters, Duration::from_secs(10)).await;
    let bound = LEASE + DELAY + Duration::from_millis(200);
    let expected = default_body(path, 2);
    let mut slowest = Duration::ZERO;
    for (i, (r, done)) in results.iter().enumerate() {
        let r = r
            .as_ref()
            .unwrap_or_else(|e| panic!("waiter {i}: transport error {e}"));
        assert_eq!(r.status, 200, "waiter {i}: {r}");
        assert_eq!(
            r.body, expected,
            "waiter {i} must get the takeover's fetch: {r}"
        );
        let after_kill = done.saturating_duration_since(killed);
        slowest = slowest.max(after_kill);
        assert!(
            after_kill <= bound,
            "waiter {i} answered {after_kill:?} after the kill (> lease + origin delay + 200ms = {bound:?})"
        );
    }
    eprintln!("slowest waiter answered {slowest:?} after the kill (bound {bound:?})");

    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        origin.count(path),
        2,
        "exactly one takeover fetch after the holder died (A's abandoned fetch + 1)"
    );
    let bc = [b.admin_addr(), c.admin_addr()];
    assert_eq!(
        lock_events_sum(&client, &bc, "takeover").await,
        1.0,
        "exactly one waiter instance takes the lock over"
    );
    assert_eq!(lock_events_sum(&client, &bc, "acquired").await, 0.0);

    shutdown_all([b, c]).await;
}

/// (b) A fetch three times as long as the lease: the holder renews its lease (every
/// lease/3), nobody takes over, one origin request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_fetch_renews_its_lease_and_stays_the_only_fetch() {
    let path = "/api/items/slow-renew";
    let (redis, origin) = redis_and_slow_origin(path, Duration::from_millis(1500)).await;
    // A lease of 500 ms is renewable with commands bounded at 150 ms (lease >= 3 ×).
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("redis", "command_timeout", "150ms")
        .set_str("lock", "lease", "500ms")
        .set_str("lock", "wait_timeout", "5s");
    let client = HttpClient::new();
    let [a, b] = start_coordinated(&cfg, &client).await;

    let handles = spawn_waiters(&client, &[a.addr(), b.addr()], path, 10);
    let results = join_waiters(handles, Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    let ea = metrics(&client, a.admin_addr()).await;
    let eb = metrics(&client, b.admin_addr()).await;
    let (owner, other) = if ea.lock_events("acquired") == 1.0 {
        (&ea, &eb)
    } else {
        (&eb, &ea)
    };
    let report = |e: &common::prom::Exposition| {
        let mut parts: Vec<String> = [
            "acquired",
            "contended",
            "renewed",
            "lost",
            "takeover",
            "wait_timeout",
        ]
        .iter()
        .map(|o| format!("{o}={}", e.lock_events(o)))
        .collect();
        parts.push(format!(
            "redis_state_changes={}",
            e.value_or_zero("cacheguard_redis_state_changes_total")
        ));
        parts.join(" ")
    };
    let report = format!("owner: {} | other: {}", report(owner), report(other));
    let answers: Vec<String> = results
        .iter()
        .map(|(r, _)| match r {
            Ok(r) => r.to_string(),
            Err(e) => format!("error {e}"),
        })
        .collect();
    assert_eq!(
        origin.count(path),
        1,
        "a renewed lease means no second fetch; lock events {report}; answers {answers:#?}"
    );
    assert_all_got(&results, &default_body(path, 1), "client");

    assert_eq!(owner.lock_events("acquired"), 1.0, "{report}");
    assert!(
        owner.lock_events("renewed") >= 2.0,
        "a 1.5 s fetch under a 500 ms lease must renew at least twice: {report}"
    );
    assert_eq!(owner.lock_events("lost"), 0.0, "{report}");
    assert_eq!(other.lock_events("takeover"), 0.0, "{report}");
    assert_eq!(other.lock_events("acquired"), 0.0, "{report}");
    assert!(other.lock_events("contended") >= 1.0, "{report}");

    shutdown_all([a, b]).await;
}

/// (c) The holder's fetch answers 500: it releases the lock and leaves a copy of the 500
/// for the waiters, so the waiting instances answer with it instead of asking the failing
/// origin again (origin count 1, no takeover). The failure is not cached: the next request
/// fetches again and gets the origin's new answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_fetch_is_shared_with_the_waiting_instances() {
    const DELAY: Duration = Duration::from_millis(500);
    let path = "/api/items/owner-500";
    let (redis, origin) = redis_and_slow_origin(path, DELAY).await;
    origin.set_status(path, 500);
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("lock", "wait_timeout", "5s");
    let client = HttpClient::new();
    let [a, b, c] = start_coordinated(&cfg, &client).await;

    let sent = Instant::now();
    let a_request = client.spawn_get(&url(a.addr(), path));
    wait_origin_count(&origin, path, 1, Duration::from_secs(3)).await;
    // Only the first request fails: later ones get the default 200 (same delay).
    origin.reset(path);
    origin.set_delay(path, DELAY);

    let waiters = spawn_waiters(&client, &[b.addr(), c.addr()], path, 10);
    wait_for_lock_waiters(&client, b.admin_addr(), 1.0).await;
    wait_for_lock_waiters(&client, c.admin_addr(), 1.0).await;
    assert!(
        sent.elapsed() < DELAY,
        "setup took {:?}: waiters were not waiting while A fetched",
        sent.elapsed()
    );

    let a_answer = a_request.await.expect("A task").expect("A answered");
    assert_eq!(
        a_answer.status, 500,
        "A's client gets the origin's 500: {a_answer}"
    );

    let results = join_waiters(waiters, Duration::from_secs(10)).await;
    for (i, (r, _)) in results.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("waiter {i}: {e}"));
        assert_eq!(r.status, 500, "waiter {i} gets the holder's failure: {r}");
        assert_eq!(r.body, default_body(path, 1), "waiter {i}: {r}");
    }
    assert_eq!(
        origin.count(path),
        1,
        "the waiters did not ask the origin again"
    );
    let bc = [b.admin_addr(), c.admin_addr()];
    assert_eq!(lock_events_sum(&client, &bc, "takeover").await, 0.0);
    let next = client.get(&url(b.addr(), path)).await;
    assert_eq!(next.status, 200, "the failure is not cached: {next}");
    assert_eq!(next.body, default_body(path, 2), "{next}");

    shutdown_all([a, b, c]).await;
}

/// (d) `on_timeout = "error"`: waiters that outwait `wait_timeout` (200 ms, origin takes
/// 1 s) get 503 with `Retry-After`, and do not go to the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_timeout_with_on_timeout_error_answers_503_retry_after() {
    let path = "/api/items/wait-timeout";
    let (redis, origin) = redis_and_slow_origin(path, Duration::from_secs(1)).await;
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("lock", "wait_timeout", "200ms")
        .set_str("lock", "on_timeout", "error");
    let client = HttpClient::new();
    let [a, b] = start_coordinated(&cfg, &client).await;

    let a_request = client.spawn_get(&url(a.addr(), path));
    wait_origin_count(&origin, path, 1, Duration::from_secs(3)).await;

    let started = Instant::now();
    let waiters = spawn_waiters(&client, &[b.addr()], path, 10);
    let results = join_waiters(waiters, Duration::from_secs(10)).await;
    let answers: Vec<String> = results
        .iter()
        .map(|(r, done)| match r {
            Ok(r) => format!(
                "{} after {:?} (retry-after {:?}, x-cache {})",
                r.status.as_u16(),
                done.saturating_duration_since(started),
                r.header("retry-after"),
                r.x_cache()
            ),
            Err(e) => format!("error {e}"),
        })
        .collect();
    let origin_count = origin.count(path);
    for (i, (r, done)) in results.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("waiter {i}: {e}"));
        let took = done.saturating_duration_since(started);
        assert_eq!(
            r.status, 503,
            "waiter {i} must get 503 after wait_timeout; origin count {origin_count}; \
             answers: {answers:#?}"
        );
        let retry_after = r.header("retry-after");
        assert!(
            retry_after
                .as_deref()
                .is_some_and(|v| v.trim().parse::<u64>().is_ok()),
            "waiter {i}: 503 without a numeric Retry-After: {answers:#?}"
        );
        assert!(
            took < Duration::from_millis(800),
            "waiter {i} answered after {took:?}: the 503 must come at wait_timeout (200 ms), \
             not after the holder's fetch: {answers:#?}"
        );
    }
    assert_eq!(
        origin.count(path),
        1,
        "waiters that timed out with on_timeout = \"error\" must not fetch"
    );
    let eb = metrics(&client, b.admin_addr()).await;
    assert!(eb.lock_events("wait_timeout") >= 1.0);

    let a_answer = a_request.await.expect("A task").expect("A answered");
    assert_eq!(a_answer.status, 200, "{a_answer}");
    let after = client.get(&url(b.addr(), path)).await;
    assert_eq!(after.status, 200, "{after}");
    assert_eq!(after.body, default_body(path, 1), "{after}");
    assert_eq!(origin.count(path), 1);

    shutdown_all([a, b]).await;
}

/// A key whose origin keeps failing (500): after each failed fetch exactly one waiter
/// becomes the next owner, so the origin never sees two fetches of the key at once —
/// however many requests wait, and however many times the fetch fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_origin_is_never_fetched_concurrently_for_one_key() {
    let path = "/api/items/always-500";
    let (redis, origin) = redis_and_slow_origin(path, Duration::from_millis(150)).await;
    origin.set_status(path, 500);
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("lock", "wait_timeout", "5s");
    let client = HttpClient::new();
    let [a, b] = start_coordinated(&cfg, &client).await;

    let handles = spawn_waiters(&client, &[a.addr(), b.addr()], path, 10);
    let results = join_waiters(handles, Duration::from_secs(15)).await;
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for (i, (r, _)) in results.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("client {i}: {e}"));
        *statuses.entry(r.status.as_u16()).or_default() += 1;
    }
    assert_eq!(
        origin.max_in_flight(),
        1,
        "a failing key was fetched {} times at once ({} origin requests in all; client \
         statuses {statuses:?}): after a failed fetch one waiter takes over, the others keep \
         waiting",
        origin.max_in_flight(),
        origin.count(path)
    );
    shutdown_all([a, b]).await;
}

/// A lock key with no TTL (written by another client, or left by a bug) would stall its key
/// for ever: every request waits, the lock is never taken, nothing is stored. The first
/// attempt that finds it gives it a lease (counted as `repaired`); requests are answered
/// once that lease ends, with one origin fetch, and nobody polls Redis in a tight loop
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_without_a_ttl_is_repaired_not_waited_on_for_ever() {
    let path = "/api/items/no-ttl-lock";
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("lock", "lease", "1s")
        .set_str("lock", "wait_timeout", "4s")
        .start()
        .await;
    let client = HttpClient::new();
    assert_eq!(client.get(&url(cg.addr(), path)).await.status, 200);
    let entries = redis.scan("cg:*:v").await;
    assert_eq!(entries.len(), 1, "one stored entry");
    let entry = String::from_utf8(entries[0].clone()).expect("key name");
    let lock = format!(
        "{}lock",
        entry.strip_suffix('v').expect("entry key ends in v")
    );
    let mut con = redis.client().await;
    let _: () = redis::cmd("DEL")
        .arg(&entry)
        .query_async(&mut con)
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(&lock)
        .arg("junk")
        .query_async(&mut con)
        .await
        .unwrap();
    common::redis_server::reset_command_stats(&mut con).await;

    let started = Instant::now();
    let results = join_waiters(
        spawn_waiters(&client, &[cg.addr()], path, 3),
        Duration::from_secs(10),
    )
    .await;
    let took = started.elapsed();
    assert_all_got(&results, &default_body(path, 2), "request");
    assert!(
        took < Duration::from_millis(2_500),
        "answered after {took:?}: the stuck lock was waited on until wait_timeout (4 s)"
    );
    let calls = common::redis_server::command_calls(&mut con).await;
    let scripts =
        calls.get("evalsha").copied().unwrap_or(0) + calls.get("eval").copied().unwrap_or(0);
    assert!(
        scripts <= 20,
        "{scripts} script calls for 3 requests: {calls:?}"
    );
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&lock)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_ne!(pttl, -1, "the lock still has no TTL");
    assert_eq!(origin.count(path), 2, "one fetch after the repair");
    let m = metrics(&client, cg.admin_addr()).await;
    assert_eq!(m.lock_events("repaired"), 1.0);
    cg.shutdown().await;
}

/// An origin answering 503 after 300 ms, 100 concurrent GETs over two instances: the one
/// fetch's failure is shared with every waiter, in its instance and on the other (through
/// Redis), so the origin is asked once, and every client gets the origin's 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_is_shared_with_every_waiter_not_retried_by_each() {
    let path = "/api/items/failing-503";
    let (redis, origin) = redis_and_slow_origin(path, Duration::from_millis(300)).await;
    origin.set_status(path, 503);
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set_str("lock", "wait_timeout", "5s");
    let client = HttpClient::new();
    let [a, b] = start_coordinated(&cfg, &client).await;
    let handles = spawn_waiters(&client, &[a.addr(), b.addr()], path, 50);
    let results = join_waiters(handles, Duration::from_secs(15)).await;
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for (i, (r, _)) in results.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("client {i}: {e}"));
        *statuses.entry(r.status.as_u16()).or_default() += 1;
    }
    assert_eq!(
        origin.count(path),
        1,
        "the failing origin was asked {} times (client statuses {statuses:?})",
        origin.count(path)
    );
    assert_eq!(
        statuses,
        [(503, 100)].into_iter().collect(),
        "every client gets the origin's answer"
    );
    shutdown_all([a, b]).await;
}

/// Waiters are capped: with `lock.max_waiters = 16`, B waits on at most 16 keys that A
/// holds; the misses beyond are answered per `lock.on_timeout` at once (here `error`: 503
/// with `Retry-After`), counted as `waiters_full`, and never reach the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_beyond_max_waiters_are_answered_per_on_timeout() {
    const KEYS: usize = 60;
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    origin.set_default_delay(Duration::from_millis(1_500));
    let cfg = CgConfig::new(&origin)
        .redis(&redis)
        .set("upstream", "max_concurrency", "256")
        .set_str("lock", "wait_timeout", "5s")
        .set_str("lock", "on_timeout", "error")
        .set("lock", "max_waiters", "16");
    let client = HttpClient::new();
    let [a, b] = start_coordinated(&cfg, &client).await;
    let path = |i: usize| format!("/api/items/held-{i}");
    // A holds every key's lock for the length of its slow fetch.
    let held: Vec<_> = (0..KEYS)
        .map(|i| client.spawn_get(&url(a.addr(), &path(i))))
        .collect();
    wait_origin_count(&origin, &path(KEYS - 1), 1, Duration::from_secs(5)).await;
    let started = Instant::now();
    let on_b: Vec<_> = (0..KEYS)
        .map(|i| client.spawn_get(&url(b.addr(), &path(i))))
        .collect();
    let mut waited = 0;
    let mut refused = 0;
    for (i, answer) in join_within(on_b, Duration::from_secs(10), "B")
        .await
        .into_iter()
        .enumerate()
    {
        let r = answer.unwrap_or_else(|e| panic!("B {i}: {e}"));
        match r.status.as_u16() {
            200 => waited += 1,
            503 => {
                assert!(r.header("retry-after").is_some(), "B {i}: {r}");
                refused += 1;
            }
            _ => panic!("B {i}: {r}"),
        }
    }
    let took = started.elapsed();
    assert!(
        (1..=16).contains(&waited),
        "{waited} waited, {refused} refused"
    );
    assert_eq!(waited + refused, KEYS);
    let m = metrics(&client, b.admin_addr()).await;
    assert_eq!(m.lock_events("waiters_full"), refused as f64);
    let fetched: u64 = (0..KEYS).map(|i| origin.count(&path(i))).sum();
    assert_eq!(
        fetched, KEYS as u64,
        "B sent nothing to the origin (took {took:?})"
    );
    join_within(held, Duration::from_secs(10), "A").await;
    shutdown_all([a, b]).await;
}

/// `lock.wait_replicas = 1` with the only replica stopped (SIGSTOP): every won lock's
/// `WAIT` times out, which is `unreplicated`, never a Redis failure. Redis answers a `WAIT`
/// that timed out only when its event loop next wakes: at its next server tick (every
/// 100 ms at the default `hz`; here the primary runs at `hz 1`) or on other traffic. The
/// client used to bound the script and its `WAIT` together by `wait_replicas_timeout +
/// command_timeout`, so an answer that came later failed the lock it had taken, counted as
/// `redis_errors{op="lock"}` toward the breaker. Now 20 cold misses, one after the other,
/// all take their lock, all count `unreplicated`, and none counts as a Redis error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_on_a_stopped_replica_is_unreplicated_never_a_redis_failure() {
    const MISSES: usize = 20;
    let primary = RedisServer::start().await;
    let replica = RedisServer::start_replica_of(&primary).await;
    let mut con = primary.client().await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("hz")
        .arg(1)
        .query_async(&mut con)
        .await
        .unwrap();
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .redis(&primary)
        .set("lock", "wait_replicas", "1")
        .set_str("lock", "wait_replicas_timeout", "100ms")
        .l1("off")
        .start()
        .await;
    let client = HttpClient::new();
    replica.pause();
    common::cold_misses(&client, cg.addr(), "unreplicated", MISSES).await;
    replica.resume();
    let exp = metrics(&client, cg.admin_addr()).await;
    assert_eq!(
        exp.replicated_locks(),
        (0.0, MISSES as f64, MISSES as f64),
        "(redis_errors{{op=\"lock\"}}, acquired, unreplicated)"
    );
    assert_eq!(exp.sum("cacheguard_redis_up", &[]), 1.0);
}

/// The wait deadline is per waiter, wherever it waits. `lock.wait_timeout = 1s`, and the
/// origin's first answer for the key takes 3 s: 100 requests on the instance whose request
/// is fetching wait on its in-process flight, and each is answered per `lock.on_timeout`
/// once its own wait passed 1 s, counted `wait_timeout` (not after the fetch, as before):
///
/// - `origin`: `200 BYPASS` from one more origin request (300 ms) that the 100 share (2 in
///   all, not 101: one such fetch per key at a time per instance), stored nowhere;
/// - `error`: `503` with `Retry-After`, no more origin request.
///
/// In embedded mode (no Redis) and in shared mode (the instance holds the fleet lock); the
/// fetching request itself is answered `200 MISS` when its fetch ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_on_the_fetching_instance_are_answered_at_wait_timeout() {
    const FOLLOWERS: usize = 100;
    const WAIT_TIMEOUT: Duration = Duration::from_secs(1);
    const FETCH: Duration = Duration::from_secs(3);
    const LONE_FETCH: Duration = Duration::from_millis(300);
    const TOLERANCE: Duration = Duration::from_millis(500);
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let client = HttpClient::new();
    for shared in [false, true] {
        for on_timeout in ["origin", "error"] {
            let mode = if shared { "shared" } else { "embedded" };
            let path = format!("/api/items/followers-{mode}-{on_timeout}");
            let mut cfg = CgConfig::new(&origin)
                .set_str("lock", "wait_timeout", "1s")
                .set_str("lock", "on_timeout", on_timeout);
            if shared {
                cfg = cfg.redis(&redis);
            }
            let cg = cfg.start().await;
            origin.set_delay(&path, FETCH);
            let fetching = Instant::now();
            let holder = client.spawn_get(&url(cg.addr(), &path));
            wait_origin_count(&origin, &path, 1, Duration::from_secs(3)).await;
            // The next requests are quicker (the followers' lone fetch).
            origin.set_delay(&path, LONE_FETCH);
            let answers = common::concurrently(FOLLOWERS, Duration::from_secs(10), |_| {
                let client = client.clone();
                let url = url(cg.addr(), &path);
                async move {
                    let sent = Instant::now();
                    (client.try_get(&url).await, sent.elapsed())
                }
            })
            .await;
            let who = format!("{mode}, on_timeout = {on_timeout}");
            let mut slowest = Duration::ZERO;
            for (i, (r, took)) in answers.iter().enumerate() {
                let r = r
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{who}: follower {i}: {e}"));
                slowest = slowest.max(*took);
                let fetched = if on_timeout == "origin" {
                    LONE_FETCH
                } else {
                    Duration::ZERO
                };
                assert!(
                    *took <= WAIT_TIMEOUT + fetched + TOLERANCE,
                    "{who}: follower {i} answered after {took:?}, not at wait_timeout: {r}"
                );
                match on_timeout {
                    "origin" => assert_eq!(
                        (r.status.as_u16(), r.x_cache().as_str()),
                        (200, "BYPASS"),
                        "{who}: follower {i}: {r}"
                    ),
                    _ => {
                        assert_eq!(r.status, 503, "{who}: follower {i}: {r}");
                        assert!(r.header("retry-after").is_some(), "{who}: {r}");
                    }
                }
            }
            eprintln!("{who}: slowest follower {slowest:?}");
            let fetches = if on_timeout == "origin" { 2 } else { 1 };
            assert_eq!(origin.count(&path), fetches, "{who}: origin requests");
            let exp = metrics(&client, cg.admin_addr()).await;
            assert_eq!(
                exp.lock_events("wait_timeout"),
                FOLLOWERS as f64,
                "{who}: each follower's timeout is counted"
            );
            let holder = holder.await.unwrap().unwrap();
            assert_eq!(
                (holder.status.as_u16(), holder.x_cache().as_str()),
                (200, "MISS"),
                "{who}: {holder}"
            );
            assert!(
                fetching.elapsed() >= FETCH,
                "{who}: the first fetch was not slow"
            );
            assert_eq!(origin.count(&path), fetches, "{who}: origin requests");
        }
    }
}
