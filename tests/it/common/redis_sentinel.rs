//! A real Sentinel-managed Redis on loopback: one primary, one replica, and three
//! `redis-server --sentinel` processes monitoring them (quorum 2, `down-after-milliseconds`
//! 1000, so a killed primary is failed over in about two seconds). Every process is killed
//! by PID on `Drop`.
//!
//! [`RedisSentinel::start_lagging`] puts a [`TcpProxy`] on the replication link, so the
//! replica can be made to fall behind ([`RedisSentinel::lag_replica`]: the link is
//! blackholed, the primary keeps taking writes the replica never gets) and then promoted
//! ([`RedisSentinel::fail_over_to_lagging_replica`], which proves that writes were lost).

use std::process::Child;
use std::time::Duration;

use futures_util::StreamExt;
use tempfile::TempDir;
use tokio::time::Instant;

use super::free_port;
use super::redis_server::{connect, query_port, redis_url, redis_urls, spawn_sentinel, spawn_with};
use super::tcp_proxy::TcpProxy;

pub const MASTER_NAME: &str = "cgprimary";
const SENTINELS: usize = 3;
const FORM_DEADLINE: Duration = Duration::from_secs(30);
/// `down-after-milliseconds`: how long a silent primary takes to be judged down.
pub const DOWN_AFTER: Duration = Duration::from_millis(1000);

struct Proc {
    port: u16,
    child: Option<Child>,
    /// A data node's extra arguments, to start it again as it was (empty: no persistence).
    args: Vec<String>,
    dir: TempDir,
}

impl Proc {
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub struct RedisSentinel {
    data: Vec<Proc>,
    sentinels: Vec<Proc>,
    /// The replication link of a lagging set (replica → proxy → primary).
    link: Option<TcpProxy>,
}

impl std::fmt::Debug for RedisSentinel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSentinel")
            .field(
                "data",
                &self.data.iter().map(|p| p.port).collect::<Vec<_>>(),
            )
            .field("sentinels", &self.sentinel_ports())
            .finish()
    }
}

async fn start_data(extra: &[&str]) -> Proc {
    for _ in 0..8 {
        let dir = tempfile::tempdir().expect("tempdir for redis-server");
        let port = free_port();
        if let Ok(child) = spawn_with(port, dir.path(), extra).await {
            return Proc {
                port,
                child: Some(child),
                args: extra.iter().map(|a| a.to_string()).collect(),
                dir,
            };
        }
    }
    panic!("could not start a data node");
}

impl RedisSentinel {
    /// Starts the primary, its replica (waiting for the link), then the sentinels, and
    /// waits until every sentinel sees the replica and the two other sentinels.
    pub async fn start() -> RedisSentinel {
        RedisSentinel::start_with(false).await
    }

    /// As [`RedisSentinel::start`], with the replica replicating through a [`TcpProxy`], so
    /// that it can be made to lag ([`RedisSentinel::lag_replica`]). The sentinels'
    /// `failover-timeout` is 60 s here: after that long, a sentinel would "fix" a replica
    /// whose primary address is not the primary's own (the proxy's) by pointing it at the
    /// primary directly, and the link could no longer be held.
    pub async fn start_lagging() -> RedisSentinel {
        RedisSentinel::start_with(true).await
    }

    async fn start_with(lagging: bool) -> RedisSentinel {
        let primary = start_data(&[]).await;
        let primary_port = primary.port.to_string();
        let link = if lagging {
            Some(TcpProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], primary.port))).await)
        } else {
            None
        };
        let upstream_port = link
            .as_ref()
            .map_or(primary_port.clone(), |l| l.addr().port().to_string());
        let replica = start_data(&["--replicaof", "127.0.0.1", &upstream_port]).await;
        let failover_timeout = if lagging { 60_000 } else { 5_000 };
        let mut this = RedisSentinel {
            data: vec![primary, replica],
            sentinels: Vec::new(),
            link,
        };
        let deadline = Instant::now() + FORM_DEADLINE;
        let replica_port = this.data[1].port;
        while !info(replica_port, "replication")
            .await
            .contains("master_link_status:up")
        {
            assert!(Instant::now() < deadline, "the replica never synced");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let monitor = format!(
            "sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} 2\n\
             sentinel down-after-milliseconds {MASTER_NAME} {}\n\
             sentinel failover-timeout {MASTER_NAME} {failover_timeout}\n\
             sentinel parallel-syncs {MASTER_NAME} 1",
            DOWN_AFTER.as_millis()
        );
        while this.sentinels.len() < SENTINELS {
            let dir = tempfile::tempdir().expect("tempdir for a sentinel");
            let port = free_port();
            if let Ok(child) = spawn_sentinel(port, dir.path(), &monitor).await {
                this.sentinels.push(Proc {
                    port,
                    child: Some(child),
                    args: Vec::new(),
                    dir,
                });
            }
        }
        for port in this.sentinel_ports() {
            loop {
                let state = sentinel_master(port).await;
                let field = |name: &str| {
                    state
                        .iter()
                        .position(|v| v == name)
                        .and_then(|i| state.get(i + 1))
                        .cloned()
                };
                if field("num-slaves").as_deref() == Some("1")
                    && field("num-other-sentinels").as_deref() == Some("2")
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "sentinel {port} did not see the whole set: {state:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        this
    }

    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|p| p.port).collect()
    }

    /// `redis://` URLs of the sentinels.
    pub fn sentinel_urls(&self) -> Vec<String> {
        redis_urls(&self.sentinel_ports())
    }

    /// Ports of the two data nodes.
    pub fn data_ports(&self) -> Vec<u16> {
        self.data.iter().map(|p| p.port).collect()
    }

    /// The primary's port as the first answering sentinel names it.
    pub async fn primary_port(&self) -> Option<u16> {
        for port in self.sentinel_ports() {
            let ask = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(MASTER_NAME)
                .clone();
            if let Some(Some((_, p))) = query_port::<Option<(String, String)>>(port, &ask).await {
                return p.parse().ok();
            }
        }
        None
    }

    /// [`RedisSentinel::failover`], then its `+switch-master` announcement: the port of the
    /// primary the sentinels promoted. Panics when none comes within `timeout`.
    pub async fn switch_over(&self, timeout: Duration) -> u16 {
        let switch = self.watch_switch().await;
        self.failover().await;
        let (promoted, _) = switch
            .wait(timeout)
            .await
            .unwrap_or_else(|| panic!("no +switch-master within {timeout:?} of SENTINEL FAILOVER"));
        promoted
    }

    /// `SENTINEL FAILOVER`: a failover without the primary failing (it is demoted to a
    /// replica), asked of the first sentinel.
    pub async fn failover(&self) {
        let mut con = connect(self.sentinel_ports()[0])
            .await
            .expect("connect to a sentinel");
        let _: String = redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg(MASTER_NAME)
            .query_async(&mut con)
            .await
            .expect("SENTINEL FAILOVER");
    }

    /// Makes the replica fall behind: its replication link is blackholed, so every write
    /// the primary takes from now on stays on the primary (the replica does not notice:
    /// its link looks idle, not down). Needs [`RedisSentinel::start_lagging`].
    pub fn lag_replica(&self) {
        self.link
            .as_ref()
            .expect("lag_replica needs RedisSentinel::start_lagging")
            .blackhole();
    }

    /// Fails over to the lagging replica and proves it lost writes: writes `markers` keys
    /// to the primary (which the lagging replica never gets), forces `SENTINEL FAILOVER`,
    /// waits (bounded) for the switch to the replica and its promotion, and asserts that
    /// none of the markers is on the new primary. Returns the new primary's port. Calls
    /// [`RedisSentinel::lag_replica`] first if the caller did not.
    pub async fn fail_over_to_lagging_replica(&self, markers: usize) -> u16 {
        self.lag_replica();
        let old = self
            .primary_port()
            .await
            .expect("the sentinels name a primary");
        let replica = *self
            .data_ports()
            .iter()
            .find(|p| **p != old)
            .expect("a replica");
        let mut con = connect(old).await.expect("connect to the primary");
        for i in 0..markers {
            let _: () = redis::cmd("SET")
                .arg(format!("harness:lost:{i}"))
                .arg(i)
                .query_async(&mut con)
                .await
                .expect("SET a marker on the primary");
        }
        assert!(
            markers_on(replica, markers).await.is_empty(),
            "the replica is not lagging"
        );
        let promoted = self.switch_over(Duration::from_secs(20)).await;
        assert_eq!(promoted, replica, "the sentinels promoted another node");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !info(replica, "replication").await.contains("role:master") {
            assert!(Instant::now() < deadline, "the replica was never promoted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let kept = markers_on(replica, markers).await;
        assert!(
            kept.is_empty(),
            "the promoted replica has markers {kept:?}: it was not lagging, no write was lost"
        );
        replica
    }

    /// SIGKILL the data node on `port`, by PID.
    pub fn kill(&mut self, port: u16) {
        if let Some(node) = self.data.iter_mut().find(|p| p.port == port) {
            node.kill();
        }
    }

    /// SIGSTOP (`pause`) or SIGCONT the data node on `port`, by PID: stopped, it keeps its
    /// sockets open and answers nothing, as if blackholed.
    pub fn signal(&self, port: u16, pause: bool) {
        let pid = self
            .data
            .iter()
            .find(|p| p.port == port)
            .and_then(|p| p.child.as_ref())
            .map(Child::id)
            .unwrap_or_else(|| panic!("no running data node on {port}"));
        super::process::signal(pid, if pause { "-STOP" } else { "-CONT" });
    }

    /// SIGKILLs both data nodes, then starts each again on its port with its arguments
    /// (the primary first): without persistence both come back empty, the replica
    /// replicating the empty primary, before the sentinels judge the primary down (when
    /// the restart takes less than [`DOWN_AFTER`]).
    pub async fn restart_data_empty(&mut self) {
        for node in &mut self.data {
            node.kill();
        }
        let deadline = Instant::now() + FORM_DEADLINE;
        for node in &mut self.data {
            let args: Vec<&str> = node.args.iter().map(String::as_str).collect();
            loop {
                match spawn_with(node.port, node.dir.path(), &args).await {
                    Ok(child) => {
                        node.child = Some(child);
                        break;
                    }
                    Err(e) => {
                        assert!(
                            Instant::now() < deadline,
                            "could not restart the data node on {}: {e}",
                            node.port
                        );
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }
    }

    /// A client subscribed to `+switch-master` on the first sentinel: `wait` returns the
    /// new primary's port and when the announcement arrived.
    pub async fn watch_switch(&self) -> SwitchWatch {
        let client = redis::Client::open(redis_url(self.sentinel_ports()[0])).expect("url");
        let mut pubsub = client
            .get_async_pubsub()
            .await
            .expect("subscribe to a sentinel");
        pubsub.subscribe("+switch-master").await.expect("subscribe");
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut messages = pubsub.into_on_message();
            let deadline = Instant::now() + Duration::from_secs(60);
            while let Ok(Some(message)) = tokio::time::timeout_at(deadline, messages.next()).await {
                let text = String::from_utf8_lossy(message.get_payload_bytes()).into_owned();
                let fields: Vec<&str> = text.split_whitespace().collect();
                if fields.first() == Some(&MASTER_NAME)
                    && let Some(port) = fields.get(4).and_then(|p| p.parse::<u16>().ok())
                {
                    let _ = tx.send((port, Instant::now()));
                    return;
                }
            }
        });
        SwitchWatch { rx, task }
    }
}

pub struct SwitchWatch {
    rx: tokio::sync::oneshot::Receiver<(u16, Instant)>,
    task: tokio::task::JoinHandle<()>,
}

impl SwitchWatch {
    /// The new primary's port and when the switch was announced, if within `timeout`.
    pub async fn wait(self, timeout: Duration) -> Option<(u16, Instant)> {
        let got = tokio::time::timeout(timeout, self.rx).await.ok()?.ok();
        self.task.abort();
        got
    }
}

/// The markers (`harness:lost:{i}`, `i < n`) present on the node on `port`.
async fn markers_on(port: u16, n: usize) -> Vec<usize> {
    let mut found = Vec::new();
    for i in 0..n {
        let value: Option<Option<String>> =
            query_port(port, redis::cmd("GET").arg(format!("harness:lost:{i}"))).await;
        if value.flatten().is_some() {
            found.push(i);
        }
    }
    found
}

/// `INFO section` of the node on `port` (empty when it does not answer).
pub async fn info(port: u16, section: &str) -> String {
    query_port(port, redis::cmd("INFO").arg(section))
        .await
        .unwrap_or_default()
}

/// `SENTINEL MASTER <name>` on the sentinel at `port`, as a flat list of names and values.
async fn sentinel_master(port: u16) -> Vec<String> {
    query_port(port, redis::cmd("SENTINEL").arg("MASTER").arg(MASTER_NAME))
        .await
        .unwrap_or_default()
}

impl Drop for RedisSentinel {
    fn drop(&mut self) {
        for p in self.sentinels.iter_mut().chain(self.data.iter_mut()) {
            p.kill();
        }
    }
}
