//! The real `cacheguard` binary as a child process, killed by PID on `Drop`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tempfile::TempDir;
use tokio::time::Instant;

use super::client::HttpClient;

const READY_DEADLINE: Duration = Duration::from_secs(15);

#[derive(Debug)]
pub struct CacheguardProcess {
    child: Option<Child>,
    addr: SocketAddr,
    admin_addr: SocketAddr,
    logs: TempDir,
}

impl CacheguardProcess {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// stdout and stderr captured so far.
    pub fn output(&self) -> String {
        let read = |p: PathBuf| std::fs::read_to_string(p).unwrap_or_default();
        format!(
            "--- stdout ---\n{}\n--- stderr ---\n{}",
            read(self.logs.path().join("stdout")),
            read(self.logs.path().join("stderr"))
        )
    }

    /// Sends SIGTERM (by PID).
    pub fn terminate(&self) {
        self.signal("-TERM");
    }

    /// SIGSTOP (by PID): the process keeps its sockets open and does nothing at all, as
    /// in a long GC pause or a VM that froze.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT (by PID) after [`CacheguardProcess::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// `kill SIG PID` on this process (`sig` like `"-STOP"`).
    fn signal(&self, sig: &str) {
        signal(self.pid().expect("cacheguard is not running"), sig);
    }

    /// Waits (bounded) for the process to exit; `None` if it is still running at the deadline.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_child(&mut self.child, timeout).await
    }

    /// SIGKILL by PID, then reap. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for CacheguardProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `kill SIG PID` (`sig` like `"-STOP"`), for a process this harness started; panics when
/// `kill` fails.
pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid} failed");
}

fn listen_addr(table: &toml::Table, section: &str) -> SocketAddr {
    let value = table
        .get(section)
        .and_then(|s| s.get("listen"))
        .and_then(|v| v.as_str())
        .unwrap_or_else(|| panic!("config has no [{section}] listen"));
    let addr: SocketAddr = value
        .parse()
        .unwrap_or_else(|e| panic!("[{section}] listen {value:?}: {e}"));
    assert_ne!(
        addr.port(),
        0,
        "process tests need a fixed [{section}] listen port (use free_port())"
    );
    addr
}

/// The binary the process tests run: `CG_TEST_BINARY` when set (a release build, or a copy
/// of this build kept apart from a build directory other checkouts write to), else the one
/// cargo built for these tests.
pub fn binary() -> PathBuf {
    std::env::var_os("CG_TEST_BINARY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_cacheguard")))
}

/// Runs `cacheguard --config FILE` and waits until `/healthz` on the admin port answers 200.
/// The file must name fixed ports for `[server]` and `[admin]` (see `free_port`).
pub async fn spawn_cacheguard_process(config_path: &Path) -> CacheguardProcess {
    spawn_cacheguard_process_with_args(config_path, &[]).await
}

/// As [`spawn_cacheguard_process`], with extra command-line arguments (`--log-format json`).
pub async fn spawn_cacheguard_process_with_args(
    config_path: &Path,
    args: &[&str],
) -> CacheguardProcess {
    spawn_cacheguard_process_with_env(config_path, args, &[]).await
}

/// The shared object of libfaketime for multi-threaded programs (Debian's `libfaketime`,
/// which the `faketime` package brings; scripts/test.sh installs it).
const LIBFAKETIME_MT: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// The environment that runs a program with its wall clock moved by `offset`
/// (libfaketime's offset syntax: `"+30"` seconds, `"-2m"`, `"+1h"`), its monotonic clock left alone (timers and
/// leases measured on it run at the real rate, as on a machine whose wall clock is
/// simply wrong). `None` when libfaketime is not installed.
pub fn faketime_env(offset: &str) -> Option<Vec<(String, String)>> {
    Path::new(LIBFAKETIME_MT).exists().then(|| {
        vec![
            ("LD_PRELOAD".to_string(), LIBFAKETIME_MT.to_string()),
            ("FAKETIME".to_string(), offset.to_string()),
            ("FAKETIME_DONT_FAKE_MONOTONIC".to_string(), "1".to_string()),
        ]
    })
}

/// As [`spawn_cacheguard_process`] with the wall clock moved by `offset` (see
/// [`faketime_env`]); panics when libfaketime is not installed. The process is the
/// cacheguard binary itself (the library is preloaded, no wrapper process), so its PID
/// is cacheguard's.
pub async fn spawn_cacheguard_process_skewed(
    config_path: &Path,
    offset: &str,
) -> CacheguardProcess {
    let env = faketime_env(offset)
        .unwrap_or_else(|| panic!("{LIBFAKETIME_MT} is missing: install the faketime package"));
    spawn_cacheguard_process_with_env(config_path, &[], &env).await
}

/// As [`spawn_cacheguard_process_with_args`], with extra environment variables.
pub async fn spawn_cacheguard_process_with_env(
    config_path: &Path,
    args: &[&str],
    env: &[(String, String)],
) -> CacheguardProcess {
    let text = std::fs::read_to_string(config_path).expect("read config file");
    let table: toml::Table = text.parse().expect("config file is TOML");
    let addr = listen_addr(&table, "server");
    let admin_addr = listen_addr(&table, "admin");

    let logs = tempfile::tempdir().expect("tempdir for process logs");
    let stdout = std::fs::File::create(logs.path().join("stdout")).expect("stdout file");
    let stderr = std::fs::File::create(logs.path().join("stderr")).expect("stderr file");
    let child = Command::new(binary())
        .arg("--config")
        .arg(config_path)
        .args(args)
        .env_remove("CACHEGUARD_LISTEN")
        .env_remove("CACHEGUARD_UPSTREAM")
        .env_remove("CACHEGUARD_REDIS_URL")
        .env_remove("CACHEGUARD_ADMIN_TOKEN")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("spawn cacheguard binary");
    let mut process = CacheguardProcess {
        child: Some(child),
        addr,
        admin_addr,
        logs,
    };

    let client = HttpClient::new();
    let url = format!("http://{admin_addr}/healthz");
    let deadline = Instant::now() + READY_DEADLINE;
    loop {
        if let Some(status) = process.wait_exit(Duration::ZERO).await {
            panic!(
                "cacheguard exited early with {status}\n{}",
                process.output()
            );
        }
        if client.answers_200(&url, Duration::from_millis(500)).await {
            return process;
        }
        if Instant::now() >= deadline {
            panic!(
                "cacheguard /healthz did not answer 200 within {READY_DEADLINE:?}\n{}",
                process.output()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (bounded, without blocking the runtime) for `child` to exit and takes it (so it is
/// not killed on drop); `None` if there is none or it still runs at the deadline.
pub async fn wait_child(child: &mut Option<Child>, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.as_mut()?.try_wait() {
            *child = None;
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
