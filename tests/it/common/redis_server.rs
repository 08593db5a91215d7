//! A real `redis-server` process on a free loopback port, killed by PID on `Drop`.
//!
//! Every test that needs Redis starts its own real server with
//! [`RedisServer::start`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::free_port;

const REDIS_SERVER: &str = "/usr/bin/redis-server";
const START_DEADLINE: Duration = Duration::from_secs(5);

/// One `redis-server` child process. Killed (SIGKILL, then reaped) on `Drop`.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    dir: TempDir,
}

impl std::fmt::Debug for RedisServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisServer")
            .field("port", &self.port)
            .field("pid", &self.child.as_ref().map(Child::id))
            .finish()
    }
}

impl RedisServer {
    /// Starts a server on a free loopback port and waits until it answers `PING`.
    pub async fn start() -> RedisServer {
        let dir = tempfile::tempdir().expect("tempdir for redis-server");
        let mut last_error = String::new();
        for _ in 0..8 {
            let port = free_port();
            match spawn_on(port, dir.path()).await {
                Ok(child) => {
                    return RedisServer {
                        port,
                        child: Some(child),
                        dir,
                    };
                }
                Err(e) => last_error = e,
            }
        }
        panic!("could not start redis-server after 8 attempts: {last_error}");
    }

    /// A replica of `primary` on a free loopback port, once its link to the primary is up
    /// (bounded). The primary is told to sync it at once (by default it waits 5 s for more
    /// replicas).
    pub async fn start_replica_of(primary: &RedisServer) -> RedisServer {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("repl-diskless-sync-delay")
            .arg(0)
            .query_async(&mut primary.client().await)
            .await
            .expect("CONFIG SET repl-diskless-sync-delay on the primary");
        let dir = tempfile::tempdir().expect("tempdir for redis-server");
        let primary_port = primary.port.to_string();
        let extra = ["--replicaof", "127.0.0.1", primary_port.as_str()];
        let mut last_error = String::new();
        for _ in 0..8 {
            let port = free_port();
            match spawn_with(port, dir.path(), &extra).await {
                Ok(child) => {
                    let replica = RedisServer {
                        port,
                        child: Some(child),
                        dir,
                    };
                    let deadline = Instant::now() + START_DEADLINE * 2;
                    loop {
                        let replication: String =
                            query_port(port, redis::cmd("INFO").arg("replication"))
                                .await
                                .unwrap_or_default();
                        if replication.contains("master_link_status:up") {
                            return replica;
                        }
                        assert!(
                            Instant::now() < deadline,
                            "the replica never synced:\n{replication}"
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
                Err(e) => last_error = e,
            }
        }
        panic!("could not start a replica after 8 attempts: {last_error}");
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        redis_url(self.port)
    }

    /// The server's loopback socket address.
    pub fn addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// A fresh multiplexed connection (the test's own view of Redis).
    pub async fn client(&self) -> MultiplexedConnection {
        let client = redis::Client::open(self.url()).expect("redis url");
        tokio::time::timeout(
            Duration::from_secs(5),
            client.get_multiplexed_async_connection(),
        )
        .await
        .expect("redis connect timed out")
        .expect("redis connect")
    }

    /// SIGKILL by PID, then reap. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server (if running) and starts a fresh, empty one on the same port.
    pub async fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            match spawn_on(self.port, self.dir.path()).await {
                Ok(child) => {
                    self.child = Some(child);
                    return;
                }
                Err(e) if Instant::now() >= deadline => {
                    panic!("could not restart redis-server on port {}: {e}", self.port)
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// SIGSTOP: the server keeps its socket open but answers nothing (a hung Redis).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`RedisServer::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        super::process::signal(self.pid().expect("redis-server is not running"), sig);
    }

    /// Every entry key (`cg:{<base>}:v` and a variant's `cg:{<base>}:v:<hash>`), found
    /// with `SCAN`.
    pub async fn entry_keys(&self) -> Vec<Vec<u8>> {
        super::shared::entry_keys_on(self.port()).await
    }

    /// Every key matching `pattern`, found with `SCAN` (bounded number of rounds).
    pub async fn scan(&self, pattern: &str) -> Vec<Vec<u8>> {
        scan_keys(&mut self.client().await, pattern).await
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// The server's log file, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn spawn_on(port: u16, dir: &Path) -> Result<Child, String> {
    spawn_with(port, dir, &[]).await
}

/// `redis-server` on `port` with its files in `dir`, plus `extra` arguments; waits until
/// this very process answers (checked by PID).
pub(crate) async fn spawn_with(port: u16, dir: &Path, extra: &[&str]) -> Result<Child, String> {
    let log = dir.join("redis.log");
    let mut command = Command::new(REDIS_SERVER);
    command
        .arg("--port")
        .arg(port.to_string())
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .args(["--daemonize", "no"])
        .arg("--dir")
        .arg(dir)
        .arg("--logfile")
        .arg(&log)
        .args(extra);
    spawn_answering(&mut command, port, &log, "redis-server").await
}

/// `redis://127.0.0.1:{port}`: the URL of a Redis (or a sentinel) on loopback `port`.
pub fn redis_url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}")
}

/// [`redis_url`] of each of `ports`.
pub fn redis_urls(ports: &[u16]) -> Vec<String> {
    ports.iter().map(|p| redis_url(*p)).collect()
}

/// A connection to the Redis (or sentinel) on loopback `port`.
pub async fn connect(port: u16) -> redis::RedisResult<MultiplexedConnection> {
    redis::Client::open(redis_url(port))?
        .get_multiplexed_async_connection()
        .await
}

/// `cmd` on the Redis (or sentinel) on loopback `port`, connection included bounded by
/// 2 s; `None` when it does not answer in time or refuses.
pub async fn query_port<T: redis::FromRedisValue>(port: u16, cmd: &redis::Cmd) -> Option<T> {
    let asked = tokio::time::timeout(Duration::from_secs(2), async {
        cmd.query_async::<T>(&mut connect(port).await.ok()?)
            .await
            .ok()
    })
    .await;
    asked.ok().flatten()
}

/// Every key matching `pattern` on the server behind `con`, found with `SCAN` (bounded
/// number of rounds).
pub async fn scan_keys<K: redis::FromRedisValue>(
    con: &mut MultiplexedConnection,
    pattern: &str,
) -> Vec<K> {
    let mut cursor: u64 = 0;
    let mut keys = Vec::new();
    for _ in 0..100_000 {
        let (next, batch): (u64, Vec<K>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(con)
            .await
            .expect("SCAN");
        keys.extend(batch);
        cursor = next;
        if cursor == 0 {
            return keys;
        }
    }
    panic!("SCAN did not finish");
}

/// `CONFIG RESETSTAT`: zeroes Redis's per-command call counts.
pub async fn reset_command_stats(con: &mut MultiplexedConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(con)
        .await
        .expect("CONFIG RESETSTAT");
}

/// Calls per command since the last reset (`INFO commandstats`), e.g. `"get"`, `"evalsha"`.
pub async fn command_calls(con: &mut MultiplexedConnection) -> BTreeMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(con)
        .await
        .expect("INFO commandstats");
    info.lines()
        .filter_map(|line| {
            let (name, rest) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_string(), calls))
        })
        .collect()
}

/// Starts `redis-server <dir>/sentinel.conf --sentinel` on `port`, the config file holding
/// `config` (the `sentinel monitor …` lines); waits until it answers as itself.
pub(crate) async fn spawn_sentinel(port: u16, dir: &Path, config: &str) -> Result<Child, String> {
    let conf = dir.join("sentinel.conf");
    let log = dir.join("sentinel.log");
    let text = format!(
        "port {port}\nbind 127.0.0.1\ndaemonize no\ndir {}\nlogfile {}\n{config}\n",
        dir.display(),
        log.display()
    );
    std::fs::write(&conf, text).map_err(|e| format!("write {}: {e}", conf.display()))?;
    let mut command = Command::new(REDIS_SERVER);
    command.arg(&conf).arg("--sentinel");
    spawn_answering(&mut command, port, &log, "sentinel").await
}

/// Spawns `command` (the `what` process, no stdio) and waits ([`answering`]) until it
/// answers on `port` as itself.
async fn spawn_answering(
    command: &mut Command,
    port: u16,
    log: &Path,
    what: &str,
) -> Result<Child, String> {
    let child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("spawn {what} ({REDIS_SERVER}): {e}"))?;
    answering(child, port, log, what).await
}

/// Waits (bounded by [`START_DEADLINE`]) until the `what` process `child` answers on `port`
/// as itself (checked by PID); kills it when it exits or never does (`log`: its log file,
/// for the error).
async fn answering(mut child: Child, port: u16, log: &Path, what: &str) -> Result<Child, String> {
    let deadline = Instant::now() + START_DEADLINE;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            return Err(format!("{what} on port {port} exited with {status}: {log}"));
        }
        // Identity check: a PONG alone could come from another test's server that
        // won the race for this port.
        if server_pid(port).await == Some(child.id()) {
            return Ok(child);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{what} on port {port} never answered"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `INFO server` over a raw socket; the `process_id` of whatever answers on `port`.
async fn server_pid(port: u16) -> Option<u32> {
    let attempt = async {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        s.write_all(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
            .await
            .ok()?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        // Bulk string reply: `$<len>\r\n<len bytes>\r\n`.
        loop {
            let n = s.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&buf);
            let header_end = text.find("\r\n")?;
            let len: usize = text.get(1..header_end)?.parse().ok()?;
            if buf.len() >= header_end + 2 + len {
                break;
            }
            if buf.len() > 1 << 20 {
                return None;
            }
        }
        let text = String::from_utf8_lossy(&buf).into_owned();
        text.lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|v| v.trim().parse().ok())
    };
    tokio::time::timeout(Duration::from_millis(500), attempt)
        .await
        .ok()
        .flatten()
}
