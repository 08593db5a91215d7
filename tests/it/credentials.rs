//! Redis credentials rotate without a restart, in every `redis.mode`: the password comes from
//! `redis.password_file`; the operator lets Redis accept the new password, writes it to the
//! file (the config file itself is not touched) and then drops every client connection, as
//! revoking the old password would. cacheguard notices the file, reloads, and keeps using
//! Redis: entries are stored and read from it, the event bus is subscribed again and the
//! breaker is closed.
//!
//! Each test starts Redis processes of its own, so tests run beside each other.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;

use crate::common::redis_sentinel::MASTER_NAME;
use crate::common::redis_server::connect;
use crate::common::{
    CgConfig, HttpClient, RedisCluster, RedisSentinel, RedisServer, TestOrigin, item_route,
    poll_until, scrape, url,
};

const OLD: &str = "old-secret-4f1a";
const NEW: &str = "new-secret-9c2e";

/// Writes `secret` the way a mounted secret is updated: a new file renamed over the old.
fn write_secret(path: &Path, secret: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{secret}\n")).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn run(con: &mut MultiplexedConnection, args: &[&str]) {
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query_async::<redis::Value>(con)
        .await
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
}

/// Connections to the data nodes opened before any password is set: they stay logged in
/// across `CONFIG SET requirepass`, so the test can keep driving Redis.
struct DataNodes(Vec<MultiplexedConnection>);

impl DataNodes {
    async fn open(ports: &[u16]) -> DataNodes {
        let mut cons = Vec::new();
        for port in ports {
            cons.push(connect(*port).await.unwrap());
        }
        DataNodes(cons)
    }

    /// Makes every node (and its replication link) want `secret`.
    async fn require(&mut self, secret: &str) {
        for con in &mut self.0 {
            run(con, &["CONFIG", "SET", "masterauth", secret]).await;
            run(con, &["CONFIG", "SET", "requirepass", secret]).await;
        }
    }

    /// Drops every client connection but the test's own: what revoking a password does.
    async fn drop_clients(&mut self) {
        for con in &mut self.0 {
            for kind in ["normal", "pubsub"] {
                run(con, &["CLIENT", "KILL", "TYPE", kind, "SKIPME", "yes"]).await;
            }
        }
    }
}

/// Starts cacheguard on `config` (written next to the password file) watching its file.
async fn start_watching(config: CgConfig, dir: &Path) -> cacheguard::Running {
    let path = config.write_to(&dir.join("cacheguard.toml"));
    let vars = HashMap::<String, String>::new();
    let loaded = cacheguard::Config::load(&path, &vars).expect("config loads");
    let mut running = cacheguard::App::start(loaded).await.expect("starts");
    running.watch_config(path, Arc::new(vars));
    running
}

/// A fresh key is a MISS, then a HIT from Redis (L1 is off), within `within`.
async fn redis_serves(client: &HttpClient, cg: &cacheguard::Running, key: &str, within: Duration) {
    let path = format!("/api/items/{key}");
    let served = poll_until(within, Duration::from_millis(100), || async {
        let first = client.get(&url(cg.addr(), &path)).await;
        let second = client.get(&url(cg.addr(), &path)).await;
        (first.status == 200 && second.x_cache() == "HIT-L2").then_some(())
    })
    .await;
    assert!(
        served.is_some(),
        "{key}: not stored in and read from Redis within {within:?}: {}",
        client.get(&url(cg.addr(), &path)).await
    );
}

/// The rotation itself, the same in every mode; `nodes` are the data nodes, `tell` tells
/// whatever else logs in to them (Sentinel) each new password.
async fn rotate(mut nodes: DataNodes, config: CgConfig, tell: impl AsyncFn(&str)) {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("redis-password");
    nodes.require(OLD).await;
    tell(OLD).await;
    write_secret(&secret, OLD);
    let config = config
        .set_str("redis", "password_file", &secret.display().to_string())
        .set_str("redis", "command_timeout", "500ms")
        .l1("off")
        .routes(&item_route(r#"ttl = "60s""#));
    let cg = start_watching(config, dir.path()).await;
    let client = HttpClient::new();
    redis_serves(&client, &cg, "before", Duration::from_secs(10)).await;

    nodes.require(NEW).await;
    tell(NEW).await;
    write_secret(&secret, NEW);
    let reloaded = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(50),
        || async {
            let (_, exp) = scrape(&client, cg.admin_addr()).await;
            (exp.sum("cacheguard_config_reloads_total", &[("result", "ok")]) >= 1.0).then_some(())
        },
    )
    .await;
    assert!(
        reloaded.is_some(),
        "a new password in redis.password_file was not reloaded: {}",
        scrape(&client, cg.admin_addr()).await.0
    );
    nodes.drop_clients().await;

    redis_serves(&client, &cg, "after", Duration::from_secs(10)).await;
    let settled = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let (_, exp) = scrape(&client, cg.admin_addr()).await;
            (exp.value_or_zero("cacheguard_redis_up") == 1.0
                && exp.value_or_zero("cacheguard_event_bus_subscribed") == 1.0)
                .then_some(())
        },
    )
    .await;
    assert!(
        settled.is_some(),
        "Redis not up, or the event bus not subscribed, after the rotation: {}",
        scrape(&client, cg.admin_addr()).await.0
    );
    // The password shows nowhere.
    let shown = client.get(&url(cg.admin_addr(), "/admin/config")).await;
    assert!(!shown.text().contains(NEW) && !shown.text().contains(OLD));
    cg.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_credentials_rotate_on_reload() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let nodes = DataNodes::open(&[redis.port()]).await;
    rotate(
        nodes,
        CgConfig::new(&origin).redis(&redis),
        async |_: &str| {},
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_credentials_rotate_on_reload() {
    let cluster = RedisCluster::start().await;
    let origin = TestOrigin::start().await;
    let nodes = DataNodes::open(&cluster.ports()).await;
    rotate(
        nodes,
        CgConfig::new(&origin).redis_cluster(&cluster),
        async |_: &str| {},
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_credentials_rotate_on_reload() {
    let sentinel = RedisSentinel::start().await;
    let origin = TestOrigin::start().await;
    let nodes = DataNodes::open(&sentinel.data_ports()).await;
    let sentinels = sentinel.sentinel_ports();
    // The sentinels must log in to the data nodes too, or they would call the primary down.
    let tell_sentinels = async |secret: &str| {
        for port in &sentinels {
            let mut con = connect(*port).await.unwrap();
            run(
                &mut con,
                &["SENTINEL", "SET", MASTER_NAME, "auth-pass", secret],
            )
            .await;
        }
    };
    rotate(
        nodes,
        CgConfig::new(&origin).redis_sentinel(&sentinel),
        tell_sentinels,
    )
    .await;
}
