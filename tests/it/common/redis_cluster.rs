//! A real Redis Cluster on loopback: six `redis-server --cluster-enabled yes` processes
//! joined by `redis-cli --cluster create --cluster-replicas 1` (three primaries, each with
//! one replica). Every process is killed by PID on `Drop`.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

use tempfile::TempDir;
use tokio::time::Instant;

use super::redis_server::{connect, query_port, redis_urls, spawn_with};

const NODES: usize = 6;

/// Every node's arguments, besides [`spawn_node`]'s.
const NODE_ARGS: &[&str] = &[
    "--cluster-node-timeout",
    "2000",
    // A replica may take over however long ago it last heard its primary: failover tests
    // must not depend on replication timing.
    "--cluster-replica-validity-factor",
    "0",
    // Replicas sync at once (the default waits 5 s for more replicas).
    "--repl-diskless-sync-delay",
    "0",
];
const FORM_DEADLINE: Duration = Duration::from_secs(30);

/// One cluster node.
struct Node {
    port: u16,
    child: Option<Child>,
    dir: TempDir,
}

pub struct RedisCluster {
    nodes: Vec<Node>,
}

impl std::fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCluster")
            .field("ports", &self.ports())
            .finish()
    }
}

/// A loopback port that is free together with its cluster bus port (port + 10000).
fn free_cluster_port() -> u16 {
    for _ in 0..200 {
        let port = super::free_port();
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port pair for a cluster node");
}

/// A cluster-enabled `redis-server` on `port` (not yet part of any cluster), its files in
/// `dir`, plus `extra` arguments.
pub async fn spawn_node(port: u16, dir: &Path, extra: &[&str]) -> Result<Child, String> {
    let mut args = vec![
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
    ];
    args.extend_from_slice(extra);
    spawn_with(port, dir, &args).await
}

impl RedisCluster {
    /// Starts six nodes, creates the cluster and waits until every replica has synced and
    /// every node reports all 16384 slots served and knows the three replicas (bounded).
    pub async fn start() -> RedisCluster {
        let mut nodes = Vec::with_capacity(NODES);
        while nodes.len() < NODES {
            let dir = tempfile::tempdir().expect("tempdir for a cluster node");
            let port = free_cluster_port();
            let started = spawn_node(port, dir.path(), NODE_ARGS).await;
            if let Ok(child) = started {
                nodes.push(Node {
                    port,
                    child: Some(child),
                    dir,
                });
            }
        }
        let cluster = RedisCluster { nodes };
        let addresses: Vec<String> = cluster
            .ports()
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let created = tokio::time::timeout(
            FORM_DEADLINE,
            tokio::process::Command::new("redis-cli")
                .arg("--cluster")
                .arg("create")
                .args(&addresses)
                .args(["--cluster-replicas", "1", "--cluster-yes"])
                .stdin(Stdio::null())
                .output(),
        )
        .await
        .expect("redis-cli --cluster create timed out")
        .expect("run redis-cli");
        assert!(
            created.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&created.stdout),
            String::from_utf8_lossy(&created.stderr)
        );
        let deadline = Instant::now() + FORM_DEADLINE;
        // Every replica has finished its first sync (WAIT counts only synced replicas).
        for port in cluster.ports() {
            loop {
                let replication = cluster
                    .query(port, redis::cmd("INFO").arg("replication"))
                    .await
                    .unwrap_or_default();
                if replication.contains("role:master")
                    || replication.contains("master_link_status:up")
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "replica {port} did not sync:\n{replication}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        for port in cluster.ports() {
            loop {
                let info = cluster.info(port).await;
                // Replica roles spread by gossip: wait until every node knows all three.
                let replicas = cluster
                    .nodes(port)
                    .await
                    .lines()
                    .filter(|l| l.contains("slave") && l.contains(" connected"))
                    .count();
                if info.contains("cluster_state:ok")
                    && info.contains("cluster_slots_ok:16384")
                    && replicas == NODES / 2
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "node {port} did not see the whole cluster:\n{info}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        cluster
    }

    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// `redis://` seed URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        redis_urls(&self.ports())
    }

    /// `CLUSTER INFO` of the node on `port` (empty if it does not answer).
    pub async fn info(&self, port: u16) -> String {
        self.query(port, redis::cmd("CLUSTER").arg("INFO"))
            .await
            .unwrap_or_default()
    }

    /// `CLUSTER NODES` as seen by the node on `port`.
    pub async fn nodes(&self, port: u16) -> String {
        self.query(port, redis::cmd("CLUSTER").arg("NODES"))
            .await
            .unwrap_or_default()
    }

    /// Ports of the nodes that are primaries now.
    pub async fn primaries(&self) -> Vec<u16> {
        let mut primaries = Vec::new();
        for port in self.ports() {
            if self
                .nodes(port)
                .await
                .lines()
                .any(|l| l.contains("myself") && l.contains("master") && !l.contains("fail"))
            {
                primaries.push(port);
            }
        }
        primaries
    }

    /// The port of the node that answers `CLUSTER KEYSLOT key` → owner, as seen by any node.
    pub async fn owner_of(&self, key: &str) -> Option<u16> {
        let port = *self.ports().first()?;
        let mut con = self.connect(port).await?;
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query_async(&mut con)
            .await
            .ok()?;
        let nodes = self.nodes(port).await;
        nodes.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if !fields.get(2)?.contains("master") {
                return None;
            }
            let owns = fields.iter().skip(8).any(|range| {
                let mut ends = range.split('-');
                let lo: i64 = ends.next().and_then(|v| v.parse().ok()).unwrap_or(-1);
                let hi: i64 = ends.next().and_then(|v| v.parse().ok()).unwrap_or(lo);
                (lo..=hi).contains(&slot)
            });
            let addr = fields.get(1)?.split('@').next()?;
            owns.then(|| addr.rsplit(':').next()?.parse().ok())?
        })
    }

    /// The node id of the node on `port` (`CLUSTER MYID`).
    pub async fn node_id(&self, port: u16) -> String {
        self.query(port, redis::cmd("CLUSTER").arg("MYID"))
            .await
            .unwrap_or_else(|| panic!("CLUSTER MYID on {port}"))
    }

    /// Moves `slots` hash slots from the primary on `from` to the one on `to` with
    /// `redis-cli --cluster reshard` (keys migrate with `MIGRATE`, clients see `ASK` and
    /// then `MOVED`). Bounded by 120 s.
    pub async fn reshard(&self, from: u16, to: u16, slots: u32) -> std::process::Output {
        let (from_id, to_id) = (self.node_id(from).await, self.node_id(to).await);
        tokio::time::timeout(
            Duration::from_secs(120),
            tokio::process::Command::new("redis-cli")
                .arg("--cluster")
                .arg("reshard")
                .arg(format!("127.0.0.1:{from}"))
                .args(["--cluster-from", &from_id, "--cluster-to", &to_id])
                .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
                .stdin(Stdio::null())
                .output(),
        )
        .await
        .expect("redis-cli --cluster reshard timed out")
        .expect("run redis-cli")
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT`).
    pub async fn keyslot(&self, key: &str) -> u16 {
        let port = self.ports()[0];
        query_port(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))
            .await
            .unwrap_or_else(|| panic!("CLUSTER KEYSLOT {key}"))
    }

    /// The keys of `slot` the node on `port` holds itself (`CLUSTER GETKEYSINSLOT`: no
    /// redirection, whatever the slot's state).
    pub async fn keys_in_slot(&self, port: u16, slot: u16) -> Vec<String> {
        query_port(
            port,
            redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(10_000),
        )
        .await
        .unwrap_or_else(|| panic!("CLUSTER GETKEYSINSLOT {slot} on {port}"))
    }

    /// Starts moving `slot` from the primary on `from` to the one on `to`, as
    /// `redis-cli --cluster reshard` does before it moves any key: `IMPORTING` on `to`,
    /// then `MIGRATING` on `from`. Commands on the slot's keys are then answered by `from`
    /// while it has them, with `ASK` (to `to`) for a key it has not, and `TRYAGAIN` for a
    /// multi-key command whose keys are not all on one node.
    pub async fn begin_migration(&self, slot: u16, from: u16, to: u16) {
        let (from_id, to_id) = (self.node_id(from).await, self.node_id(to).await);
        for (port, state, id) in [(to, "IMPORTING", &from_id), (from, "MIGRATING", &to_id)] {
            let done: Option<String> = query_port(
                port,
                redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg(state)
                    .arg(id),
            )
            .await;
            assert_eq!(
                done.as_deref(),
                Some("OK"),
                "SETSLOT {slot} {state} on {port}"
            );
        }
    }

    /// Moves `keys` (of a slot being migrated) from the node on `from` to the one on `to`
    /// (`MIGRATE … KEYS`).
    pub async fn migrate(&self, from: u16, to: u16, keys: &[String]) {
        if keys.is_empty() {
            return;
        }
        let moved: Option<String> = query_port(
            from,
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(keys),
        )
        .await;
        assert_eq!(
            moved.as_deref(),
            Some("OK"),
            "MIGRATE {keys:?} {from} -> {to}"
        );
    }

    /// Ends the migration of `slot` begun with [`RedisCluster::begin_migration`]: the keys
    /// `from` still holds move to `to`, which then owns the slot (`SETSLOT … NODE` on `to`,
    /// `from` and the other primaries, as `redis-cli` does).
    pub async fn end_migration(&self, slot: u16, from: u16, to: u16) {
        let rest = self.keys_in_slot(from, slot).await;
        self.migrate(from, to, &rest).await;
        let to_id = self.node_id(to).await;
        let mut ports = vec![to, from];
        ports.extend(
            self.primaries()
                .await
                .into_iter()
                .filter(|p| *p != to && *p != from),
        );
        for port in ports {
            let done: Option<String> = query_port(
                port,
                redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg("NODE")
                    .arg(&to_id),
            )
            .await;
            assert_eq!(done.as_deref(), Some("OK"), "SETSLOT {slot} NODE on {port}");
        }
    }

    /// Waits until every live node reports `cluster_state:ok` with all slots served and
    /// `port` is not a primary any more (bounded by `timeout`); how long it took.
    pub async fn wait_failed_over(&self, dead: u16, timeout: Duration) -> Option<Duration> {
        let started = Instant::now();
        let live: Vec<u16> = self
            .nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect();
        loop {
            let mut ok = true;
            for port in &live {
                let info = self.info(*port).await;
                let nodes = self.nodes(*port).await;
                let dead_is_primary = nodes.lines().any(|l| {
                    l.contains(&format!(":{dead}@")) && l.contains("master") && !l.contains("fail")
                });
                if !info.contains("cluster_state:ok")
                    || !info.contains("cluster_slots_ok:16384")
                    || dead_is_primary
                {
                    ok = false;
                    break;
                }
            }
            if ok {
                return Some(started.elapsed());
            }
            if started.elapsed() > timeout {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGSTOP the node on `port`, by PID: it keeps its sockets open but answers nothing.
    pub fn pause(&self, port: u16) {
        self.signal(port, "-STOP");
    }

    /// SIGCONT after [`RedisCluster::pause`].
    pub fn resume(&self, port: u16) {
        self.signal(port, "-CONT");
    }

    fn signal(&self, port: u16, sig: &str) {
        let pid = self
            .nodes
            .iter()
            .find(|n| n.port == port)
            .and_then(|n| n.child.as_ref())
            .map(Child::id)
            .unwrap_or_else(|| panic!("no running node on {port}"));
        super::process::signal(pid, sig);
    }

    /// The replica of the primary on `port`, as that primary sees it.
    pub async fn replica_of(&self, primary: u16) -> Option<u16> {
        let id = self.node_id(primary).await;
        self.nodes(primary).await.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if !fields.get(2)?.contains("slave") || *fields.get(3)? != id {
                return None;
            }
            let addr = fields.get(1)?.split('@').next()?;
            addr.rsplit(':').next()?.parse().ok()
        })
    }

    /// Starts the node on `port` again after [`RedisCluster::kill`], on its files: it keeps
    /// its cluster config (`nodes.conf`: its id, role and slots) but, without persistence,
    /// none of its data. Back within the node timeout (2 s), nobody failed it over.
    pub async fn start_again(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no node on {port}"));
        assert!(node.child.is_none(), "the node on {port} is running");
        let deadline = Instant::now() + FORM_DEADLINE;
        loop {
            match spawn_node(port, node.dir.path(), NODE_ARGS).await {
                Ok(child) => {
                    node.child = Some(child);
                    return;
                }
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "could not start the node on {port} again: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// SIGKILL the node on `port`, by PID.
    pub fn kill(&mut self, port: u16) {
        if let Some(node) = self.nodes.iter_mut().find(|n| n.port == port)
            && let Some(mut child) = node.child.take()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    async fn connect(&self, port: u16) -> Option<redis::aio::MultiplexedConnection> {
        tokio::time::timeout(Duration::from_secs(2), connect(port))
            .await
            .ok()?
            .ok()
    }

    async fn query(&self, port: u16, cmd: &redis::Cmd) -> Option<String> {
        let mut con = self.connect(port).await?;
        tokio::time::timeout(Duration::from_secs(2), cmd.query_async::<String>(&mut con))
            .await
            .ok()?
            .ok()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}
