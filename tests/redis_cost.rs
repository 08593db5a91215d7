//! What a request costs in Redis, counted (never timed): the commands cacheguard sends per
//! cold miss and per L2 hit, read with `MONITOR` (which tells the commands a client sent
//! from those its scripts ran) around a batch of requests, what
//! `cacheguard_request_redis_commands_total{outcome}` says about the same batch, and the
//! commands Redis executed for it (`INFO commandstats`, which counts the commands scripts
//! run as well as the scripts themselves): a Redis primary's CPU goes with those.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use common::redis_server::{command_calls, connect, reset_command_stats};
use common::{CgConfig, HttpClient, RedisCluster, RedisServer, TestOrigin, metric, url};

/// Commands cacheguard sends on its own schedule, not for a request: the health probe, the
/// event bus, the invalidation stream's consumer and the start-up questions.
const BACKGROUND: [&str; 19] = [
    "XREADGROUP",
    "XAUTOCLAIM",
    "XPENDING",
    "XINFO",
    "XGROUP",
    "INFO",
    "PING",
    "CLIENT",
    "CONFIG",
    "SUBSCRIBE",
    "CLUSTER",
    "HELLO",
    "SELECT",
    "AUTH",
    "SCRIPT",
    // Not cacheguard's: this test's own `MONITOR`, and a cluster's replication.
    "MONITOR",
    "REPLCONF",
    "PSYNC",
    "COMMAND",
];

/// `CONFIG RESETSTAT` on each of `ports`.
async fn reset_executed(ports: &[u16]) {
    for port in ports {
        reset_command_stats(&mut connect(*port).await.unwrap()).await;
    }
}

/// The commands Redis executed since [`reset_executed`], summed over `ports`, by name
/// (scripts' own commands included), without the background ones.
async fn executed(ports: &[u16]) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for port in ports {
        for (name, calls) in command_calls(&mut connect(*port).await.unwrap()).await {
            // `client|setname`, `config|resetstat`: the command is the part before `|`.
            let name = name
                .split('|')
                .next()
                .unwrap_or_default()
                .to_ascii_uppercase();
            if !BACKGROUND.contains(&name.as_str()) {
                *counts.entry(name).or_insert(0) += calls;
            }
        }
    }
    counts
}

/// The most commands a cold miss may make Redis execute, scripts' own commands included.
const EXECUTED_PER_MISS: u64 = 10;

/// `redis-cli MONITOR` on `port`, its lines collected until [`Monitor::stop`].
struct Monitor {
    child: Child,
    lines: tokio::task::JoinHandle<Vec<String>>,
}

/// A [`Monitor`] on each of several nodes (a cluster's).
struct Monitors(Vec<Monitor>);

impl Monitors {
    async fn start(ports: &[u16]) -> Monitors {
        let mut monitors = Vec::new();
        for port in ports {
            monitors.push(Monitor::start(*port).await);
        }
        Monitors(monitors)
    }

    /// The commands clients sent, summed over the nodes.
    async fn stop(self) -> BTreeMap<String, u64> {
        let mut counts = BTreeMap::new();
        for monitor in self.0 {
            for (name, n) in monitor.stop().await {
                *counts.entry(name).or_insert(0) += n;
            }
        }
        counts
    }
}

impl Monitor {
    async fn start(port: u16) -> Monitor {
        let mut child = Command::new("redis-cli")
            .args(["-p", &port.to_string(), "monitor"])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let lines = tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            let mut out = Vec::new();
            let mut ready = Some(ready_tx);
            while let Ok(Some(line)) = reader.next_line().await {
                if let Some(tx) = ready.take() {
                    let _ = tx.send(());
                }
                out.push(line);
            }
            out
        });
        // redis-cli prints "OK" once MONITOR is on.
        tokio::time::timeout(Duration::from_secs(5), ready_rx)
            .await
            .unwrap()
            .unwrap();
        Monitor { child, lines }
    }

    /// The commands clients sent (not their scripts' commands), by name, without the
    /// background ones.
    async fn stop(self) -> BTreeMap<String, u64> {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .arg(pid.to_string())
                .status();
        }
        let lines = tokio::time::timeout(Duration::from_secs(5), self.lines)
            .await
            .unwrap()
            .unwrap();
        let mut counts = BTreeMap::new();
        for line in lines {
            // `1700000000.123456 [0 127.0.0.1:5555] "GET" "key"`; scripts: `[0 lua]`.
            let Some((client, rest)) = line.split_once("] ") else {
                continue;
            };
            if client.ends_with(" lua") {
                continue;
            }
            let name = rest
                .split('"')
                .nth(1)
                .unwrap_or_default()
                .to_ascii_uppercase();
            if name.is_empty() || BACKGROUND.contains(&name.as_str()) {
                continue;
            }
            *counts.entry(name).or_insert(0) += 1;
        }
        counts
    }
}

const MISSES: u64 = 20;

/// Commands per cold miss and per L2 hit through one instance, with `l1`, watching `ports`.
async fn cost(config: CgConfig, ports: &[u16], l1: &str) {
    let cg = config.l1(l1).start().await;
    let client = HttpClient::new();
    // Scripts loaded, connections made.
    let warm = client
        .get(&url(cg.addr(), &format!("/api/items/warm-up-{l1}")))
        .await;
    assert_eq!(warm.x_cache(), "MISS", "{warm}");

    let counted = |outcome: &'static str| {
        let client = client.clone();
        let admin = cg.admin_addr();
        async move {
            metric(
                &client,
                admin,
                "cacheguard_request_redis_commands_total",
                &[("outcome", outcome)],
            )
            .await
        }
    };
    let before = counted("miss").await;
    let monitors = Monitors::start(ports).await;
    reset_executed(ports).await;
    for i in 0..MISSES {
        let r = client
            .get(&url(cg.addr(), &format!("/api/items/cold-{l1}-{i}")))
            .await;
        assert_eq!(r.x_cache(), "MISS", "{r}");
    }
    let counts = monitors.stop().await;
    let ran = executed(ports).await;
    let total: u64 = counts.values().sum();
    let ran_total: u64 = ran.values().sum();
    eprintln!("l1 = {l1}: {MISSES} cold misses: sent {counts:?}; executed {ran:?}");
    // The metric tells what MONITOR saw.
    assert_eq!(
        counted("miss").await - before,
        total as f64,
        "l1 = {l1}: cacheguard_request_redis_commands_total{{outcome=\"miss\"}}"
    );
    assert!(
        total <= 4 * MISSES,
        "l1 = {l1}: {:.1} commands per cold miss (at most 4): {counts:?}",
        total as f64 / MISSES as f64
    );
    assert!(
        ran_total <= EXECUTED_PER_MISS * MISSES,
        "l1 = {l1}: Redis executed {:.2} commands per cold miss (at most {EXECUTED_PER_MISS}): \
         {ran:?}",
        ran_total as f64 / MISSES as f64
    );

    if l1 != "all" {
        // An L2 hit (L1 is off, or only for hot keys): one command.
        let before = counted("hit_l2").await;
        let monitors = Monitors::start(ports).await;
        reset_executed(ports).await;
        for i in 0..MISSES {
            let r = client
                .get(&url(cg.addr(), &format!("/api/items/cold-{l1}-{i}")))
                .await;
            assert_eq!(r.x_cache(), "HIT-L2", "{r}");
        }
        let counts = monitors.stop().await;
        let ran = executed(ports).await;
        let total: u64 = counts.values().sum();
        assert_eq!(total, MISSES, "l1 = {l1}: L2 hits: {counts:?}");
        // Nothing runs inside Redis for a hit but the read itself.
        assert_eq!(ran, counts, "l1 = {l1}: L2 hits, executed");
        assert_eq!(counted("hit_l2").await - before, total as f64);
    }
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_miss_costs_at_most_four_redis_commands_sent_and_ten_executed_standalone() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    for l1 in ["off", "hot", "all"] {
        cost(CgConfig::new(&origin).redis(&redis), &[redis.port()], l1).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_miss_costs_at_most_four_redis_commands_sent_and_ten_executed_cluster() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    for l1 in ["off", "hot", "all"] {
        cost(
            CgConfig::new(&origin).redis_cluster(&cluster),
            // Primaries only: a replica's MONITOR shows what its primary replicates.
            &cluster.primaries().await,
            l1,
        )
        .await;
    }
}
