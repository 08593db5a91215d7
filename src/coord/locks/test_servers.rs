//! Real lock servers for the tests: `etcd` (a single member, or a cluster) and a standalone
//! ZooKeeper, each on free loopback ports with its data in a temporary directory, killed by
//! PID on `Drop`. Restarts keep the data directory (tokens must keep growing across them).
//!
//! One file for both test harnesses: the unit tests of `coord/locks` use it as a module,
//! and `tests/common` includes it by path (`#[path]`), so it names no `crate::` item.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tempfile::TempDir;
use tokio::time::Instant;

/// Debian's `etcd-server`.
const ETCD: &str = "/usr/bin/etcd";
/// Debian's `zookeeper` (its jar names its dependencies) and `default-jre-headless`.
const JAVA: &str = "/usr/bin/java";
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
/// ZooKeeper's tick: sessions may be 2 to 80 ticks; expiry is checked every tick.
const ZOOKEEPER_TICK: Duration = Duration::from_millis(250);

/// How long a server may take to answer after it was started.
const START_DEADLINE: Duration = Duration::from_secs(20);

/// A free loopback port: bind `127.0.0.1:0`, read the port, drop the listener.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a free loopback port")
}

/// A server process with its directory (data, config, log), killed by PID on `Drop`.
struct Daemon {
    what: &'static str,
    child: Option<Child>,
    dir: TempDir,
}

impl Daemon {
    fn new(what: &'static str) -> Daemon {
        Daemon {
            what,
            child: None,
            dir: tempfile::tempdir().expect("tempdir for a test server"),
        }
    }

    /// Spawns `command` with its output in the directory's log file.
    fn spawn(&mut self, command: &mut Command) {
        let out = std::fs::File::create(self.log_path()).expect("create the server's log file");
        let err = out.try_clone().expect("clone the log file handle");
        let child = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e} (installed by scripts/test.sh)", self.what));
        self.child = Some(child);
    }

    /// `Err` when the process has exited (it is then forgotten).
    fn check_running(&mut self) -> Result<(), String> {
        if let Some(child) = self.child.as_mut()
            && let Ok(Some(status)) = child.try_wait()
        {
            self.child = None;
            return Err(format!(
                "{} exited with {status}: {}",
                self.what,
                self.log()
            ));
        }
        Ok(())
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL and reap, if running.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `kill -<sig> <pid>`.
    fn signal(&self, sig: &str) {
        let pid = self.pid().expect("the server is not running");
        let status = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} {pid} failed");
    }

    fn log_path(&self) -> std::path::PathBuf {
        self.dir.path().join(format!("{}.log", self.what))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `answers` until it says the server answers as itself (`Ok(true)`), the server is
/// not ours (`Ok(false)`), or [`START_DEADLINE`] passed; kills the process when it fails.
async fn wait_answering<F, Fut>(daemon: &mut Daemon, mut answers: F) -> Result<(), String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<bool>>,
{
    let deadline = Instant::now() + START_DEADLINE;
    loop {
        daemon.check_running()?;
        match tokio::time::timeout(Duration::from_secs(2), answers()).await {
            Ok(Some(true)) => return Ok(()),
            Ok(Some(false)) => {
                daemon.kill();
                return Err(format!("another {} answers on its port", daemon.what));
            }
            _ => {}
        }
        if Instant::now() >= deadline {
            daemon.kill();
            return Err(format!("{} never answered: {}", daemon.what, daemon.log()));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// One member of an etcd cluster (a cluster of one, unless made by [`EtcdServer::cluster`]).
pub struct EtcdServer {
    name: String,
    client_port: u16,
    peer_port: u16,
    initial_cluster: String,
    daemon: Daemon,
}

impl std::fmt::Debug for EtcdServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdServer")
            .field("url", &self.url())
            .field("pid", &self.pid())
            .finish()
    }
}

impl EtcdServer {
    /// A single-member etcd, answering. Elections are short (50 ms heartbeats), so a lease
    /// may be as short as 1 s (etcd's floor is 1.5 election timeouts).
    pub async fn start() -> EtcdServer {
        let mut last = String::new();
        for _ in 0..5 {
            let mut member = EtcdServer::new("m0", free_port(), free_port(), None);
            member.spawn();
            match member.wait_answering().await {
                Ok(()) => return member,
                Err(e) => last = e,
            }
        }
        panic!("etcd did not start: {last}");
    }

    /// A cluster of `n` members on loopback, every one answering.
    pub async fn cluster(n: usize) -> Vec<EtcdServer> {
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members: Vec<EtcdServer> = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| {
                EtcdServer::new(&format!("m{i}"), *client, *peer, Some(initial.clone()))
            })
            .collect();
        for member in &mut members {
            member.spawn();
        }
        for member in &mut members {
            if let Err(e) = member.wait_answering().await {
                panic!("etcd cluster member did not start: {e}");
            }
        }
        members
    }

    fn new(name: &str, client_port: u16, peer_port: u16, cluster: Option<String>) -> EtcdServer {
        EtcdServer {
            name: name.to_owned(),
            client_port,
            peer_port,
            initial_cluster: cluster
                .unwrap_or_else(|| format!("{name}=http://127.0.0.1:{peer_port}")),
            daemon: Daemon::new("etcd"),
        }
    }

    fn spawn(&mut self) {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(ETCD);
        command
            .args(["--name", &self.name])
            .arg("--data-dir")
            .arg(self.daemon.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--heartbeat-interval", "50", "--election-timeout", "250"])
            .args(["--logger", "zap", "--log-outputs", "stderr"]);
        self.daemon.spawn(&mut command);
    }

    /// Waits until this member answers as itself (its name among the members).
    async fn wait_answering(&mut self) -> Result<(), String> {
        let (url, name) = (self.url(), self.name.clone());
        wait_answering(&mut self.daemon, || {
            let (url, name) = (url.clone(), name.clone());
            async move {
                let mut client = etcd_client::Client::connect([url], None).await.ok()?;
                client.status().await.ok()?;
                let members = client.member_list().await.ok()?;
                Some(members.members().iter().any(|m| m.name() == name))
            }
        })
        .await
    }

    /// `http://127.0.0.1:<client port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.daemon.pid()
    }

    /// A client of this member.
    pub async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.url()], None)
            .await
            .expect("connect to etcd")
    }

    /// `kill -9`: no shutdown, what was not yet in its log is lost.
    pub fn kill(&mut self) {
        self.daemon.kill();
    }

    /// Starts the member again on its ports and data directory, and waits until it answers
    /// (in a cluster: until the cluster answers through it).
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn();
        if let Err(e) = self.wait_answering().await {
            panic!("etcd did not restart: {e}");
        }
    }

    /// SIGSTOP: the socket stays open, nothing answers.
    pub fn pause(&self) {
        self.daemon.signal("-STOP");
    }

    /// SIGCONT after [`EtcdServer::pause`].
    pub fn resume(&self) {
        self.daemon.signal("-CONT");
    }

    /// The server's output so far, for failure messages.
    pub fn log(&self) -> String {
        self.daemon.log()
    }
}

/// A standalone ZooKeeper server (the JVM), killed by PID on `Drop`.
pub struct ZooKeeperServer {
    port: u16,
    daemon: Daemon,
    /// Written in the new server's tree at its first start: a server on this port that
    /// does not have it is another test's.
    mark: String,
}

impl std::fmt::Debug for ZooKeeperServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperServer")
            .field("connect", &self.connect())
            .field("pid", &self.pid())
            .finish()
    }
}

/// The node that marks a test's server as its own.
const MARK: &str = "/cacheguard-test-server";

impl ZooKeeperServer {
    /// The server the tests running now share (for those that do not stop it), started
    /// by the first of them; it stops with the last one that holds it (a static would
    /// outlive the test process's last `Drop`, and leave the JVM running).
    pub async fn shared() -> Arc<ZooKeeperServer> {
        static SHARED: tokio::sync::Mutex<Weak<ZooKeeperServer>> =
            tokio::sync::Mutex::const_new(Weak::new());
        let mut shared = SHARED.lock().await;
        if let Some(server) = shared.upgrade() {
            return server;
        }
        let server = Arc::new(ZooKeeperServer::start().await);
        *shared = Arc::downgrade(&server);
        server
    }

    /// A standalone server, answering (a JVM: this takes a second or two).
    pub async fn start() -> ZooKeeperServer {
        let mut last = String::new();
        for _ in 0..5 {
            let mut server = ZooKeeperServer {
                port: free_port(),
                daemon: Daemon::new("zookeeper"),
                mark: format!("{:032x}", rand::random::<u128>()),
            };
            server.write_config();
            server.spawn();
            match server.wait_answering(true).await {
                Ok(()) => return server,
                Err(e) => last = e,
            }
        }
        panic!("zookeeper did not start: {last}");
    }

    fn write_config(&self) {
        let data = self.daemon.dir.path().join("data");
        std::fs::create_dir_all(&data).expect("create zookeeper's data dir");
        let config = format!(
            "tickTime={}\ndataDir={}\nclientPort={}\nclientPortAddress=127.0.0.1\n\
             admin.enableServer=false\nminSessionTimeout={}\nmaxSessionTimeout=20000\n\
             maxClientCnxns=0\n",
            ZOOKEEPER_TICK.as_millis(),
            data.display(),
            self.port,
            ZOOKEEPER_TICK.as_millis() * 2,
        );
        std::fs::write(self.config_path(), config).expect("write zoo.cfg");
    }

    fn config_path(&self) -> std::path::PathBuf {
        self.daemon.dir.path().join("zoo.cfg")
    }

    fn spawn(&mut self) {
        let mut command = Command::new(JAVA);
        command
            .args([
                "-Xms32m",
                "-Xmx256m",
                "-XX:+UseSerialGC",
                "-XX:TieredStopAtLevel=1",
            ])
            .args(["-Dzookeeper.admin.enableServer=false", "-cp", ZOOKEEPER_JAR])
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(self.config_path());
        self.daemon.spawn(&mut command);
    }

    /// Waits until the server answers a session as this test's (`first`: marks it so).
    async fn wait_answering(&mut self, first: bool) -> Result<(), String> {
        let (connect, mark) = (self.connect(), self.mark.clone());
        wait_answering(&mut self.daemon, || {
            let (connect, mark) = (connect.clone(), mark.clone());
            async move {
                let client = zookeeper_client::Client::connector()
                    .with_session_timeout(Duration::from_secs(2))
                    .with_fail_eagerly()
                    .connect(&connect)
                    .await
                    .ok()?;
                if first {
                    let create = zookeeper_client::CreateMode::Persistent
                        .with_acls(zookeeper_client::Acls::anyone_all());
                    client.create(MARK, mark.as_bytes(), &create).await.ok()?;
                }
                let (data, _) = client.get_data(MARK).await.ok()?;
                Some(data == mark.as_bytes())
            }
        })
        .await
    }

    /// `127.0.0.1:<port>`, the connect string.
    pub fn connect(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.daemon.pid()
    }

    /// A session of the test's own.
    pub async fn client(&self, session_timeout: Duration) -> zookeeper_client::Client {
        tokio::time::timeout(
            Duration::from_secs(10),
            zookeeper_client::Client::connector()
                .with_session_timeout(session_timeout)
                .connect(&self.connect()),
        )
        .await
        .expect("zookeeper session within 10s")
        .expect("zookeeper session")
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        self.daemon.kill();
    }

    /// Starts the server again on its port and data directory, and waits until it answers.
    pub async fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            self.spawn();
            match self.wait_answering(false).await {
                Ok(()) => return,
                // The port may not be free again at once.
                Err(e) if Instant::now() >= deadline => panic!("zookeeper did not restart: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// SIGSTOP: the socket stays open, nothing answers.
    pub fn pause(&self) {
        self.daemon.signal("-STOP");
    }

    /// SIGCONT after [`ZooKeeperServer::pause`].
    pub fn resume(&self) {
        self.daemon.signal("-CONT");
    }

    /// The server's output so far, for failure messages.
    pub fn log(&self) -> String {
        self.daemon.log()
    }
}
