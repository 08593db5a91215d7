//! A real MariaDB server (Debian's `mariadb-server`, installed by `scripts/test.sh`) on a
//! free loopback port, its data in a temporary directory, stopped by PID on `Drop`.
//!
//! The data directory is copied from a template made once per machine with
//! `mariadb-install-db` (a few seconds) and kept under the system temp directory; each
//! start then takes well under a second. Every server has the database [`DATABASE`] and
//! the user [`USER`] (password [`PASSWORD`], every right on that database), created at
//! start as `root` (no password, loopback only).
//!
//! Self-contained (std, tokio, tempfile, sqlx) so that the crate's unit tests include it
//! too (`src/lib.rs`, `test_mariadb`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sqlx::Connection;
use sqlx::mysql::{MySqlConnectOptions, MySqlConnection};
use tempfile::TempDir;
use tokio::time::Instant;

pub const DATABASE: &str = "locks";
pub const USER: &str = "cacheguard";
pub const PASSWORD: &str = "cg-test-secret";

const MARIADBD: &str = "/usr/sbin/mariadbd";
const INSTALL_DB: &str = "/usr/bin/mariadb-install-db";
const START_DEADLINE: Duration = Duration::from_secs(30);
/// Small buffers: a test server holds a few rows.
const SERVER_ARGS: &[&str] = &[
    "--no-defaults",
    "--bind-address=127.0.0.1",
    "--skip-name-resolve",
    "--innodb-buffer-pool-size=8M",
    "--innodb-log-file-size=4M",
    "--performance-schema=OFF",
];

/// One `mariadbd` child process.
pub struct MariaDb {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl std::fmt::Debug for MariaDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MariaDb")
            .field("port", &self.port)
            .field("pid", &self.child.as_ref().map(Child::id))
            .finish()
    }
}

impl MariaDb {
    /// Starts a server on a free loopback port and waits until it answers as itself.
    pub async fn start() -> MariaDb {
        let template = tokio::task::spawn_blocking(template)
            .await
            .expect("template task");
        let mut dir = tempfile::tempdir().expect("tempdir for mariadb");
        copy_dir(&template, &dir.path().join("data"));
        let mut last_error = String::new();
        for _ in 0..8 {
            let port = free_port();
            let mut server = MariaDb {
                port,
                dir,
                child: None,
            };
            match server.spawn().await {
                Ok(()) => {
                    server.bootstrap().await;
                    return server;
                }
                Err(e) => {
                    last_error = e;
                    dir = server.take_dir();
                }
            }
        }
        panic!("could not start mariadbd after 8 attempts: {last_error}");
    }

    fn take_dir(mut self) -> TempDir {
        self.kill();
        let placeholder = tempfile::tempdir().expect("tempdir");
        std::mem::replace(&mut self.dir, placeholder)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `mysql://cacheguard:…@127.0.0.1:<port>/locks`.
    pub fn url(&self) -> String {
        self.url_as(USER, PASSWORD)
    }

    pub fn url_as(&self, user: &str, password: &str) -> String {
        format!(
            "mysql://{user}:{password}@127.0.0.1:{}/{DATABASE}",
            self.port
        )
    }

    /// Runs `statements` as root, in order (test setup: users, grants, tables).
    pub async fn root(&self, statements: &[&str]) {
        let mut conn = root_connection(self.port)
            .await
            .expect("root connection to mariadb");
        for statement in statements {
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_string()))
                .execute(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("{statement}: {e}"));
        }
    }

    /// `SELECT fence FROM locks.<table> WHERE resource = <resource>`, as root.
    pub async fn fence(&self, table: &str, resource: &str) -> Option<u64> {
        let mut conn = root_connection(self.port).await.ok()?;
        sqlx::query_scalar::<_, u64>(sqlx::AssertSqlSafe(format!(
            "SELECT fence FROM `{DATABASE}`.`{table}` WHERE resource = ?"
        )))
        .bind(resource.as_bytes())
        .fetch_optional(&mut conn)
        .await
        .ok()
        .flatten()
    }

    /// SIGKILL by PID, then reap: no shutdown, InnoDB recovers at the next start.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server if it runs, and starts it again on the same port and data.
    pub async fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            match self.spawn().await {
                Ok(()) => return,
                Err(e) if Instant::now() >= deadline => {
                    panic!("could not restart mariadbd on port {}: {e}", self.port)
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// SIGSTOP: the server keeps its socket open and answers nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`MariaDb::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        // Not `process::signal`: the lock backends' unit tests include this file alone.
        let pid = self.pid().expect("mariadbd is not running");
        let status = Command::new("kill")
            .arg(sig)
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} {pid} failed");
    }

    /// The server's error log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }

    /// Spawns `mariadbd` on this port and data and waits until it answers as itself.
    async fn spawn(&mut self) -> Result<(), String> {
        let data = self.dir.path().join("data");
        let mut command = Command::new(MARIADBD);
        command
            .args(SERVER_ARGS)
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--port={}", self.port))
            .arg(format!(
                "--socket={}",
                self.dir.path().join("sock").display()
            ))
            .arg(format!(
                "--pid-file={}",
                self.dir.path().join("pid").display()
            ))
            .arg(format!(
                "--log-error={}",
                self.dir.path().join("error.log").display()
            ));
        if running_as_root() {
            command.arg("--user=root");
        }
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawn {MARIADBD}: {e} (install Debian's mariadb-server)"))?;
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "mariadbd on port {} exited with {status}: {}",
                    self.port,
                    self.log()
                ));
            }
            // Identity check: another test's server may have won the race for this port.
            if let Ok(mut conn) = root_connection(self.port).await
                && let Ok(datadir) = sqlx::query_scalar::<_, String>("SELECT @@datadir")
                    .fetch_one(&mut conn)
                    .await
                && Path::new(datadir.trim_end_matches('/')) == data
            {
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("mariadbd on port {} never answered", self.port));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn bootstrap(&self) {
        self.root(&[
            &format!("CREATE DATABASE IF NOT EXISTS `{DATABASE}`"),
            &format!("CREATE USER IF NOT EXISTS '{USER}'@'%' IDENTIFIED BY '{PASSWORD}'"),
            &format!("GRANT ALL ON `{DATABASE}`.* TO '{USER}'@'%'"),
        ])
        .await;
    }
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn root_connection(port: u16) -> Result<MySqlConnection, sqlx::Error> {
    let options = MySqlConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("root");
    match tokio::time::timeout(
        Duration::from_secs(2),
        MySqlConnection::connect_with(&options),
    )
    .await
    {
        Ok(conn) => conn,
        Err(_) => Err(sqlx::Error::PoolTimedOut),
    }
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0")
}

/// The initialised data directory every server copies, made once per machine (and per
/// MariaDB version): in a directory of its own, then renamed into place, so concurrent
/// test processes never see half of one.
fn template() -> PathBuf {
    let version = Command::new(MARIADBD)
        .arg("--version")
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .unwrap_or_default();
    let tag = version
        .split_whitespace()
        .find(|word| word.contains("MariaDB"))
        .unwrap_or("unknown")
        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '.', "_");
    let path = std::env::temp_dir().join(format!("cacheguard-mariadb-template-{tag}"));
    if path.join("mysql").is_dir() {
        return path;
    }
    let work = tempfile::Builder::new()
        .prefix("cacheguard-mariadb-init-")
        .tempdir_in(std::env::temp_dir())
        .expect("tempdir for the mariadb template");
    let data = work.path().join("data");
    let mut command = Command::new(INSTALL_DB);
    command
        .arg("--no-defaults")
        .arg(format!("--datadir={}", data.display()))
        .arg("--auth-root-authentication-method=normal")
        .arg("--skip-test-db")
        .args(&SERVER_ARGS[1..]);
    if running_as_root() {
        command.arg("--user=root");
    }
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("run {INSTALL_DB}: {e} (install Debian's mariadb-server)"));
    assert!(
        out.status.success(),
        "{INSTALL_DB} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Another process may have won: keep theirs.
    if std::fs::rename(&data, &path).is_err() {
        assert!(
            path.join("mysql").is_dir(),
            "no mariadb template at {}",
            path.display()
        );
    }
    path
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the data directory");
    for entry in std::fs::read_dir(from).expect("read the template") {
        let entry = entry.expect("template entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy a template file");
        }
    }
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}
