//! No key cacheguard writes grows into a big key: after many fills of one route, every
//! `cg:` key in Redis stays under 1 MB (`MEMORY USAGE`) and 10k members, and a pattern
//! purge still finds its keys across the shards of the route's index.
//!
//! The suite fills 12,000 keys (more than one unsharded index may hold, so a single index
//! fails the bound); `CG_BIG_KEYS_FILLS=100000` runs the full-size check (about 4 minutes
//! on a debug build), as `bench/big_keys.sh` does. The keys of a Bloom filter's snapshot
//! are checked in `tests/it/bloom.rs`
//! (`a_1m_item_filter_snapshot_is_in_parts_under_1_mb_and_a_restart_starts_from_it`).

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common;
use crate::common::{CgConfig, HttpClient, RedisServer, TestOrigin, item_route, post, url};

/// Fills made: `CG_BIG_KEYS_FILLS`, default 12,000 (at least 10,430, so every key the
/// purge below matches exists).
fn fills() -> usize {
    std::env::var("CG_BIG_KEYS_FILLS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(12_000)
}
const TOKEN: &str = "big-keys-token-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_cacheguard_key_grows_past_1_mb_or_10k_members_after_many_fills() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .redis(&redis)
        .l1("off")
        .set_str("admin", "token", TOKEN)
        .set_str("redis", "command_timeout", "1s")
        .routes(&item_route(r#"ttl = "600s""#))
        .start()
        .await;
    let client = HttpClient::new();
    let addr = cg.addr();
    let fills = fills();
    let results = common::bounded_parallel(fills, 32, Duration::from_secs(600), |i| {
        let client = client.clone();
        async move {
            client
                .try_get(&url(addr, &format!("/api/items/big-{i}")))
                .await
                .map(|r| (r.status.as_u16(), r.x_cache().to_owned()))
        }
    })
    .await;
    let misses = results
        .iter()
        .filter(|r| matches!(r, Ok((200, cache)) if cache == "MISS"))
        .count();
    assert_eq!(misses, fills, "not every request was a stored miss");

    // Every key cacheguard wrote, its size and, for a collection, its members.
    let mut con = redis.client().await;
    let keys: Vec<Vec<u8>> = common::redis_server::scan_keys(&mut con, "cg:*").await;
    assert!(keys.len() >= fills, "{} keys in Redis", keys.len());
    let mut largest = (0u64, String::new());
    let mut most = (0u64, String::new());
    for chunk in keys.chunks(1000) {
        let mut pipe = redis::pipe();
        for key in chunk {
            pipe.cmd("MEMORY")
                .arg("USAGE")
                .arg(key)
                .arg("SAMPLES")
                .arg(0);
            pipe.cmd("TYPE").arg(key);
        }
        let answers: Vec<redis::Value> = pipe.query_async(&mut con).await.unwrap();
        for (key, pair) in chunk.iter().zip(answers.chunks(2)) {
            let name = String::from_utf8_lossy(key).into_owned();
            let bytes: u64 = redis::from_redis_value(pair[0].clone()).unwrap_or(0);
            let kind: String = redis::from_redis_value(pair[1].clone()).unwrap_or_default();
            if bytes > largest.0 {
                largest = (bytes, name.clone());
            }
            let count_cmd = match kind.as_str() {
                "zset" => Some("ZCARD"),
                "set" => Some("SCARD"),
                "hash" => Some("HLEN"),
                "list" => Some("LLEN"),
                "stream" => Some("XLEN"),
                _ => None,
            };
            if let Some(cmd) = count_cmd {
                let n: u64 = redis::cmd(cmd)
                    .arg(key)
                    .query_async(&mut con)
                    .await
                    .unwrap();
                if n > most.0 {
                    most = (n, name);
                }
            }
        }
    }
    eprintln!(
        "{} keys; largest {} ({} bytes); most members {} ({})",
        keys.len(),
        largest.1,
        largest.0,
        most.1,
        most.0
    );
    assert!(
        largest.0 < 1_000_000,
        "{} takes {} bytes (at most 1 MB)",
        largest.1,
        largest.0
    );
    assert!(
        most.0 < 10_000,
        "{} has {} members (at most 10k)",
        most.1,
        most.0
    );

    // A pattern purge still finds what it matches, in every shard: big-1042 and
    // big-10420 … big-10429.
    let headers = [
        ("authorization", &*format!("Bearer {TOKEN}")),
        ("content-type", "application/json"),
    ];
    let purged = post(
        &client,
        &url(cg.admin_addr(), "/admin/purge"),
        &headers,
        r#"{"patterns": ["/api/items/big-1042*"]}"#,
    )
    .await;
    assert_eq!(purged.status, 200, "{purged}");
    let outcome: serde_json::Value = serde_json::from_slice(&purged.body).unwrap();
    assert_eq!(outcome["pattern_matches"], 11, "{purged}");
    for (path, expected) in [
        ("/api/items/big-1042", "MISS"),
        ("/api/items/big-10427", "MISS"),
        ("/api/items/big-1043", "HIT-L2"),
    ] {
        let r = client.get(&url(addr, path)).await;
        assert_eq!(r.x_cache(), expected, "{path}: {r}");
    }
    cg.shutdown().await;
}
