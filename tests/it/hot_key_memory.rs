//! Hot keys under a flood of distinct keys: the detector's and the limiter's memory stays
//! within the bound they report. It measures this process's RSS, which any other test running
//! beside it would move too: it runs in a process of its own ([`common::in_own_process`]).

use std::collections::BTreeSet;
use std::time::Duration;

use tokio::time::Instant;

use crate::common;
use crate::common::hot::{Load, as_u64, hot_list, hotkeys, rss_bytes};
use crate::common::{CgConfig, HttpClient, TestOrigin, metrics};

/// Distinct keys, one request each, leave the detector's and the limiter's memory bounded:
/// `memory_bound_bytes` (their worst case whatever the traffic: one HeavyKeeper sketch per
/// worker plus one, the top-K heaps, at most `max_hot_keys` hot entries and limiter cells;
/// 741 376 bytes with 2 workers and the default `max_hot_keys = 256`) is under 1 MiB and
/// unchanged by the traffic, the hot set stays empty, and the process's resident memory
/// does not grow with the number of keys.
///
/// A million HTTP requests is too slow for a debug build: this drives as many distinct keys
/// as it can in 15 s (about 20–25k on a quiet box; at least 5000 are required) and bounds
/// the RSS growth from 2 s into the load (connections, pools and allocator arenas at their
/// working size by then) to its end: at most 1 MiB, i.e. about 50 bytes per key at 20k keys,
/// where anything kept per key would show. (Over 70k keys in 40 s, RSS stayed within
/// ±100 KiB after the first second.)
/// Every key misses (`?k=<n>` is part of the key) and nothing else keeps per-key state: the
/// route has `l1 = "off"` (L1 does not grow), the origin counts per path (one path).
/// Embedded mode: the detector and limiter are the same with Redis, and without it a miss
/// costs one origin round trip instead of four Redis commands more, so several times more
/// keys fit in the time. (The hot-set part of the bound, with Redis, is the next test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_keys_leave_detector_and_limiter_memory_bounded() {
    let test = "distinct_keys_leave_detector_and_limiter_memory_bounded";
    if common::in_own_process(module_path!(), test).await {
        return;
    }
    const MAX_KEYS: u64 = 100_000;
    const SETTLE: Duration = Duration::from_secs(2);
    const GROWTH_LIMIT: u64 = 1024 * 1024;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set("server", "worker_threads", "2")
        .set("hot_keys", "threshold_rps", "100")
        // Every key is a query variant of one path: no variant budget here.
        .set("cache", "max_variants", "0")
        .l1("off")
        .start()
        .await;
    let (addr, admin) = (cg.addr(), cg.admin_addr());
    let client = HttpClient::new();
    let bound = as_u64(&hotkeys(&client, admin).await, "memory_bound_bytes");
    let rss_start = rss_bytes();

    let load = Load::new(addr, |n| format!("/api/items/x?k={n}"))
        .conns(8, 16)
        .max_requests(MAX_KEYS)
        .duration(Duration::from_secs(15))
        .start();
    let started = Instant::now();
    let mut baseline: Option<(u64, u64)> = None; // (keys sent, RSS)
    let mut last = (0, rss_start);
    let mut max_hot = 0;
    let mut bounds = BTreeSet::new();
    // Sample every 250 ms while the load runs (the last sample is taken while it still runs:
    // its connections' buffers are then in both samples).
    while started.elapsed() < Duration::from_millis(14_700) && load.sent() < MAX_KEYS {
        let v = hotkeys(&client, admin).await;
        max_hot = max_hot.max(hot_list(&v).len());
        bounds.insert(as_u64(&v, "memory_bound_bytes"));
        last = (load.sent(), rss_bytes());
        if baseline.is_none() && started.elapsed() >= SETTLE {
            baseline = Some(last);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let tally = load.finish().await;
    let v = hotkeys(&client, admin).await;
    bounds.insert(as_u64(&v, "memory_bound_bytes"));
    max_hot = max_hot.max(hot_list(&v).len());
    let exp = metrics(&client, admin).await;
    let (base_keys, base_rss) = baseline.expect("a sample 2 s into the load");
    let (end_keys, end_rss) = last;
    let keys = end_keys.saturating_sub(base_keys);
    let growth = end_rss.saturating_sub(base_rss);
    eprintln!(
        "memory: {} distinct keys in {:.1} s ({:.0} req/s) {:?}; memory_bound_bytes {bound} \
         ({:.0} KiB); RSS {:.1} MiB at start, {:.1} MiB {} keys in, {:.1} MiB {} keys in: \
         growth {:.0} KiB over {keys} keys ({:.1} bytes per key); largest hot set {max_hot}",
        tally.answers,
        tally.elapsed.as_secs_f64(),
        tally.rate(),
        tally.by_x_cache,
        bound as f64 / 1024.0,
        rss_start as f64 / 1_048_576.0,
        base_rss as f64 / 1_048_576.0,
        base_keys,
        end_rss as f64 / 1_048_576.0,
        end_keys,
        growth as f64 / 1024.0,
        growth as f64 / keys.max(1) as f64,
    );
    assert!(
        keys >= 5_000,
        "only {keys} distinct keys between the RSS samples: too few to tell (box too busy?)"
    );
    assert_eq!(tally.by_status.get(&200), Some(&tally.answers), "{tally:?}");
    assert_eq!(
        tally.by_x_cache.get("MISS"),
        Some(&tally.answers),
        "every key must be new: {tally:?}"
    );
    assert_eq!(origin.count("/api/items/x"), tally.answers);
    // The stated bound: small, and a property of the configuration, not of the traffic.
    assert!(bound < 1024 * 1024, "memory_bound_bytes {bound} ≥ 1 MiB");
    assert_eq!(
        bounds,
        BTreeSet::from([bound]),
        "memory_bound_bytes changed"
    );
    assert_eq!(max_hot, 0, "a key seen once became hot");
    assert_eq!(exp.sum("cacheguard_hot_keys", &[]), 0.0);
    assert_eq!(exp.sum("cacheguard_hot_key_promotions_total", &[]), 0.0);
    assert!(
        growth <= GROWTH_LIMIT,
        "RSS grew {:.0} KiB over {keys} distinct keys ({:.0} bytes per key)",
        growth as f64 / 1024.0,
        growth as f64 / keys.max(1) as f64
    );
    tokio::time::timeout(Duration::from_secs(15), cg.shutdown())
        .await
        .expect("cacheguard shutdown did not finish within 15s");
}
