//! A real `redis-server` for the unit tests that need one (the integration tests in
//! `tests/` have their own harness), on a free loopback port, killed by PID on `Drop`.
#![allow(clippy::unwrap_used)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

pub(crate) struct TestRedis {
    port: u16,
    child: Option<Child>,
}

impl TestRedis {
    pub(crate) async fn start() -> TestRedis {
        for _ in 0..8 {
            let port = free_port();
            if let Some(child) = spawn_redis(port).await {
                return TestRedis {
                    port,
                    child: Some(child),
                };
            }
        }
        panic!("could not start redis-server");
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub(crate) fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
    }

    pub(crate) async fn conn(&self) -> MultiplexedConnection {
        open(&self.url()).await
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts a new, empty one on the same port.
    pub(crate) async fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(child) = spawn_redis(self.port).await {
                self.child = Some(child);
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("could not restart redis-server on port {}", self.port);
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

async fn spawn_redis(port: u16) -> Option<Child> {
    let mut child = Command::new("redis-server")
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1"])
        .args(["--save", ""])
        .args(["--appendonly", "no"])
        .arg("--dir")
        .arg(std::env::temp_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return None;
        }
        // It must answer PING, and be our process (not another test's on a raced port).
        if answering_pid(port).await == Some(child.id()) {
            return Some(child);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn answering_pid(port: u16) -> Option<u32> {
    let attempt = async {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        let pong: String = redis::cmd("PING").query_async(&mut conn).await.ok()?;
        if pong != "PONG" {
            return None;
        }
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await
            .ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|pid| pid.trim().parse().ok())
    };
    tokio::time::timeout(Duration::from_millis(500), attempt)
        .await
        .ok()
        .flatten()
}

pub(crate) async fn open(url: &str) -> MultiplexedConnection {
    let client = redis::Client::open(url).unwrap();
    tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await
    .unwrap()
    .unwrap()
}
