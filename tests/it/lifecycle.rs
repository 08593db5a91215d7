//! Start and stop: graceful shutdown drains in-flight requests and refuses new connections;
//! the real binary starts from a config file, serves, and drains on SIGTERM.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::common::{
    CgConfig, HttpClient, Resp, TestOrigin, default_body, free_port, poll_until,
    spawn_cacheguard_process, url,
};

/// True when a new connection to `addr` cannot get a response (refused, reset, or closed).
async fn refuses_new_requests(addr: SocketAddr) -> Result<(), String> {
    match tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr)).await {
        Ok(Err(_)) => Ok(()),
        Err(_) => Err("connect hung".into()),
        Ok(Ok(_stream)) => {
            // The kernel accepted the handshake (listener still open); the request must
            // still not be served.
            let client = HttpClient::new();
            let late = url(addr, "/api/items/late");
            match tokio::time::timeout(Duration::from_secs(2), client.try_get(&late)).await {
                Ok(Ok(r)) => Err(format!("a new connection was served: {r}")),
                Ok(Err(_)) | Err(_) => Ok(()),
            }
        }
    }
}

/// Starts `GET u` in a task of its own and waits (bounded) until it is in flight at the
/// origin.
async fn start_in_flight(
    client: &HttpClient,
    origin: &TestOrigin,
    u: String,
) -> JoinHandle<Result<Resp, String>> {
    let in_flight = client.spawn_get(&u);
    let reached = poll_until(
        Duration::from_secs(3),
        Duration::from_millis(10),
        || async { (origin.in_flight() >= 1).then_some(()) },
    )
    .await;
    assert!(reached.is_some(), "the request never reached the origin");
    in_flight
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_in_flight_request_and_refuses_new_connections() {
    let origin = TestOrigin::builder()
        .delay(Duration::from_millis(500))
        .start()
        .await;
    let cg = CgConfig::new(&origin).start().await;
    let addr = cg.addr();
    let admin = cg.admin_addr();
    let client = HttpClient::new();

    let in_flight = start_in_flight(&client, &origin, url(addr, "/api/items/drain")).await;

    let shutdown = tokio::spawn(cg.shutdown());
    tokio::time::sleep(Duration::from_millis(100)).await;
    // While draining: no new connections.
    let during = refuses_new_requests(addr).await;

    let r = in_flight.await.expect("task");
    let r = r.unwrap_or_else(|e| panic!("in-flight request was cut by shutdown: {e}"));
    assert_eq!(r.status, 200, "in-flight request: {r}");
    assert_eq!(r.body, default_body("/api/items/drain", 1));

    tokio::time::timeout(Duration::from_secs(10), shutdown)
        .await
        .expect("shutdown() did not return within 10 s")
        .expect("shutdown task");
    during.unwrap_or_else(|e| panic!("during shutdown: {e}"));
    refuses_new_requests(addr)
        .await
        .unwrap_or_else(|e| panic!("after shutdown: {e}"));
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "proxy listener still accepts connections after shutdown() returned"
    );
    assert!(
        TcpStream::connect(admin).await.is_err(),
        "admin listener still accepts connections after shutdown() returned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_do_not_block_shutdown() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client = HttpClient::new();
    // Leave a pooled keep-alive connection open and idle.
    let r = client.get(&url(cg.addr(), "/api/items/idle")).await;
    assert_eq!(r.status, 200, "{r}");
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), cg.shutdown())
        .await
        .expect("shutdown() waited on an idle keep-alive connection");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "shutdown took {:?}",
        started.elapsed()
    );
}

fn process_config(origin: &TestOrigin, dir: &tempfile::TempDir) -> (std::path::PathBuf, u16, u16) {
    let (port, admin_port) = (free_port(), free_port());
    let path = CgConfig::new(origin)
        .listen_on(port, admin_port)
        .write_to(&dir.path().join("cacheguard.toml"));
    (path, port, admin_port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_from_config_file() {
    let origin = TestOrigin::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _, _) = process_config(&origin, &dir);
    let process = spawn_cacheguard_process(&path).await;
    let client = HttpClient::new();
    let u = url(process.addr(), "/api/items/bin");
    let r = client.get(&u).await;
    assert_eq!(r.status, 200, "{r}\n{}", process.output());
    assert_eq!(r.x_cache(), "MISS", "{r}");
    let r = client.get(&u).await;
    assert_eq!(r.x_cache(), "HIT-L1", "{r}");
    assert_eq!(origin.count("/api/items/bin"), 1);
    let m = client.get(&url(process.admin_addr(), "/metrics")).await;
    assert_eq!(m.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_drains_in_flight_request_on_sigterm() {
    let origin = TestOrigin::builder()
        .delay(Duration::from_millis(500))
        .start()
        .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _, _) = process_config(&origin, &dir);
    let mut process = spawn_cacheguard_process(&path).await;
    let client = HttpClient::new();
    let addr = process.addr();
    let in_flight = start_in_flight(&client, &origin, url(addr, "/api/items/term")).await;
    process.terminate();
    let r = in_flight.await.expect("task");
    let r = r.unwrap_or_else(|e| {
        panic!(
            "SIGTERM cut the in-flight request: {e}\n{}",
            process.output()
        )
    });
    assert_eq!(r.status, 200, "{r}");
    let status = process.wait_exit(Duration::from_secs(10)).await;
    let status = status.unwrap_or_else(|| {
        panic!(
            "cacheguard still running 10 s after SIGTERM\n{}",
            process.output()
        )
    });
    assert!(
        status.success(),
        "exit after SIGTERM: {status}\n{}",
        process.output()
    );
}

/// Threads of a process, from /proc.
fn thread_count(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("Threads: line")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_runs_the_configured_number_of_worker_threads() {
    let origin = TestOrigin::start().await;
    let mut counts = Vec::new();
    for workers in [1, 4] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = CgConfig::new(&origin)
            .on_free_ports()
            .set("server", "worker_threads", &workers.to_string())
            .write_to(&dir.path().join("cacheguard.toml"));
        let process = spawn_cacheguard_process(&path).await;
        let r = HttpClient::new()
            .get(&url(process.addr(), "/api/items/threads"))
            .await;
        assert_eq!(r.status, 200, "{r}");
        counts.push(thread_count(process.pid().expect("pid")));
    }
    // The main thread plus the workers (the blocking pool starts empty, and nothing here
    // uses it): going from 1 to 4 workers adds exactly 3 threads.
    assert_eq!(
        counts[1] - counts[0],
        3,
        "threads with 1 and 4 workers: {counts:?}"
    );
}
