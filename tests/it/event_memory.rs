//! A flood of invalidation events costs a bounded amount of memory. It measures this
//! process's RSS, which any other test running beside it would move too: it runs in a process
//! of its own ([`common::in_own_process`]).

use std::time::Duration;

use crate::common;
use crate::common::hot::rss_bytes;
use crate::common::{CgConfig, HttpClient, RedisServer, TestOrigin, metric, poll_until};

/// 100,000 `invalidate` events for distinct keys, as another instance would publish them
/// for a burst of writes or purges: each is marked here (a fill racing it must not keep its
/// copy), but the marks are bounded, so the resident memory grows by far less than the
/// ~1.4 KB per event an unbounded table costs (over 100 MiB). What a dropped mark would have
/// refused is still refused (the floor, tested with the marks); the drops are counted.
///
/// RSS is read once 20,000 events are in (tables and allocator at their working size) and
/// at the end: the 80,000 events between may add at most 24 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_invalidation_events_keeps_memory_bounded() {
    let test = "a_flood_of_invalidation_events_keeps_memory_bounded";
    if common::in_own_process(module_path!(), test).await {
        return;
    }
    const EVENTS: u64 = 100_000;
    const WARM: u64 = 20_000;
    const GROWTH_LIMIT: u64 = 24 * 1024 * 1024;
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).redis(&redis).start().await;
    let client = HttpClient::new();
    let subscribed = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
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
    assert!(subscribed.is_some(), "the event bus did not subscribe");
    let mut con = redis.client().await;
    let received = || async {
        metric(
            &client,
            cg.admin_addr(),
            "cacheguard_event_bus_messages_total",
            &[],
        )
        .await as u64
    };
    let publish = |from: u64, to: u64| {
        let mut pipe = redis::pipe();
        for n in from..to {
            let hash = u128::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
            pipe.cmd("PUBLISH")
                .arg("cg:events")
                .arg(format!("invalidate {:016x} {hash:032x}", 0xfeed_u64))
                .ignore();
        }
        pipe
    };
    let mut sent = 0;
    let mut warm_rss = None;
    while sent < EVENTS {
        let to = (sent + 1_000).min(EVENTS);
        publish(sent, to)
            .query_async::<()>(&mut con)
            .await
            .expect("PUBLISH");
        sent = to;
        if sent == WARM {
            let all_in = poll_until(
                Duration::from_secs(30),
                Duration::from_millis(20),
                || async { (received().await >= WARM).then_some(()) },
            )
            .await;
            assert!(
                all_in.is_some(),
                "the first {WARM} events were not received"
            );
            warm_rss = Some(rss_bytes());
        }
    }
    let all_in = poll_until(
        Duration::from_secs(60),
        Duration::from_millis(50),
        || async { (received().await >= EVENTS).then_some(()) },
    )
    .await;
    assert!(
        all_in.is_some(),
        "only {} events received",
        received().await
    );
    // Let the spawned L1 removals run.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (warm, end) = (warm_rss.expect("warm RSS"), rss_bytes());
    let growth = end.saturating_sub(warm);
    assert!(
        growth <= GROWTH_LIMIT,
        "RSS grew by {} KiB over {} events ({warm} → {end} bytes)",
        growth / 1024,
        EVENTS - WARM
    );
    let dropped = metric(
        &client,
        cg.admin_addr(),
        "cacheguard_invalidation_marks_overflow_total",
        &[],
    )
    .await;
    assert!(dropped > 0.0, "marks dropped for room are counted");
    cg.shutdown().await;
}
