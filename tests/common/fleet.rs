//! Several cacheguard instances sharing one Redis: a [`Fleet`] of separate OS processes,
//! and waits on what the instances report together (Redis up and the event bus
//! subscribed, lock waiters, lock events summed over the fleet).
//!
//! The fleet is also a nemesis's handle on its instances, each by index and acted on by
//! PID: [`Fleet::pause`] / [`Fleet::resume`] (SIGSTOP / SIGCONT), [`Fleet::kill`]
//! (SIGKILL) and [`Fleet::restart`] (the same config file, so the same ports and
//! journal), or [`Fleet::restart_skewed`] (with its wall clock moved, libfaketime).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tempfile::TempDir;

use super::process::spawn_cacheguard_process_skewed;
use super::{
    CacheguardProcess, CgConfig, HttpClient, free_port, metrics, poll_until,
    spawn_cacheguard_process,
};

/// Cacheguard instances running as separate OS processes (each killed by PID on drop).
pub struct Fleet {
    pub procs: Vec<CacheguardProcess>,
    pub configs: Vec<PathBuf>,
    /// Instances replaced by a restart, kept for their output.
    retired: Vec<(usize, CacheguardProcess)>,
    _dir: TempDir,
}

impl Fleet {
    /// The proxy listener of every process, in start order.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.procs.iter().map(CacheguardProcess::addr).collect()
    }

    /// The admin listener of every process, in start order.
    pub fn admin_addrs(&self) -> Vec<SocketAddr> {
        self.procs
            .iter()
            .map(CacheguardProcess::admin_addr)
            .collect()
    }

    /// Every process's captured output (restarted ones' earlier lives first), for failure
    /// messages.
    pub fn output(&self) -> String {
        self.retired
            .iter()
            .map(|(i, p)| (*i, p, " (before a restart)"))
            .chain(self.procs.iter().enumerate().map(|(i, p)| (i, p, "")))
            .map(|(i, p, when)| {
                format!(
                    "=== instance {i}{when} (pid {:?}) ===\n{}\n",
                    p.pid(),
                    p.output()
                )
            })
            .collect()
    }

    /// SIGSTOP instance `i`.
    pub fn pause(&self, i: usize) {
        self.procs[i].pause();
    }

    /// SIGCONT instance `i`.
    pub fn resume(&self, i: usize) {
        self.procs[i].resume();
    }

    /// SIGKILL instance `i` (and reap it): no shutdown, no drain, its in-flight work lost.
    pub fn kill(&mut self, i: usize) {
        self.procs[i].kill();
    }

    /// Kills instance `i` if it still runs, then starts it again from its config file (the
    /// same ports and journal), and waits until it answers `/healthz`.
    pub async fn restart(&mut self, i: usize) {
        self.procs[i].kill();
        let fresh = spawn_cacheguard_process(&self.configs[i]).await;
        let old = std::mem::replace(&mut self.procs[i], fresh);
        self.retired.push((i, old));
    }

    /// As [`Fleet::restart`], with the instance's wall clock moved by `offset` (e.g.
    /// `"+30"` seconds; see `process::faketime_env`).
    pub async fn restart_skewed(&mut self, i: usize, offset: &str) {
        self.procs[i].kill();
        let fresh = spawn_cacheguard_process_skewed(&self.configs[i], offset).await;
        let old = std::mem::replace(&mut self.procs[i], fresh);
        self.retired.push((i, old));
    }
}

/// `n` distinct free loopback ports.
fn distinct_ports(n: usize) -> Vec<u16> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n * 20 {
        if out.len() == n {
            break;
        }
        let p = free_port();
        if seen.insert(p) {
            out.push(p);
        }
    }
    assert_eq!(out.len(), n, "could not find {n} distinct free ports");
    out
}

/// Starts `n` cacheguard processes from `cfg` (each with its own fixed loopback ports),
/// all at once, and waits until each answers `/healthz`.
pub async fn spawn_fleet(cfg: &CgConfig, n: usize) -> Fleet {
    spawn_fleet_each(&vec![cfg.clone(); n]).await
}

/// As [`spawn_fleet`], instance `i` from `cfgs[i]` (e.g. one of them reaching the origin
/// through a fault proxy of its own).
pub async fn spawn_fleet_each(cfgs: &[CgConfig]) -> Fleet {
    let dir = tempfile::tempdir().expect("tempdir for fleet configs");
    let ports = distinct_ports(2 * cfgs.len());
    let configs: Vec<PathBuf> = cfgs
        .iter()
        .enumerate()
        .map(|(i, cfg)| {
            cfg.clone()
                .listen_on(ports[2 * i], ports[2 * i + 1])
                .write_to(&dir.path().join(format!("cacheguard-{i}.toml")))
        })
        .collect();
    let procs =
        futures_util::future::join_all(configs.iter().map(|p| spawn_cacheguard_process(p))).await;
    Fleet {
        procs,
        configs,
        retired: Vec::new(),
        _dir: dir,
    }
}

/// Starts `N` in-process instances from `cfg` and waits until they coordinate
/// ([`wait_coordinated`]).
pub async fn start_coordinated<const N: usize>(
    cfg: &CgConfig,
    client: &HttpClient,
) -> [cacheguard::Running; N] {
    let mut started = Vec::with_capacity(N);
    for _ in 0..N {
        started.push(cfg.start().await);
    }
    let admins: Vec<SocketAddr> = started.iter().map(|r| r.admin_addr()).collect();
    wait_coordinated(client, &admins).await;
    started
        .try_into()
        .unwrap_or_else(|_| unreachable!("exactly {N} instances were started"))
}

/// Shuts every instance down, one after the other.
pub async fn shutdown_all<const N: usize>(instances: [cacheguard::Running; N]) {
    for instance in instances {
        instance.shutdown().await;
    }
}

/// Sum of `cacheguard_lock_events_total{outcome}` over several instances.
pub async fn lock_events_sum(client: &HttpClient, admins: &[SocketAddr], outcome: &str) -> f64 {
    let mut total = 0.0;
    for admin in admins {
        total += metrics(client, *admin).await.lock_events(outcome);
    }
    total
}

/// Waits (bounded) until every instance reports Redis up and the event bus subscribed:
/// before that an instance fills without the fleet lock (degraded), by design.
pub async fn wait_coordinated(client: &HttpClient, admins: &[SocketAddr]) {
    for admin in admins {
        let ok = poll_until(Duration::from_secs(10), Duration::from_millis(25), || {
            let client = client.clone();
            let admin = *admin;
            async move {
                let exp = metrics(&client, admin).await;
                (exp.value_or_zero("cacheguard_redis_up") == 1.0
                    && exp.value_or_zero("cacheguard_event_bus_subscribed") == 1.0)
                    .then_some(())
            }
        })
        .await;
        assert!(
            ok.is_some(),
            "instance with admin {admin}: Redis up + event bus subscribed not reported within 10s"
        );
    }
}

/// Waits (bounded) until `cacheguard_lock_waiters` ≥ `at_least` on `admin`.
pub async fn wait_for_lock_waiters(client: &HttpClient, admin: SocketAddr, at_least: f64) {
    let ok = poll_until(Duration::from_secs(3), Duration::from_millis(10), || {
        let client = client.clone();
        async move {
            let exp = metrics(&client, admin).await;
            (exp.value_or_zero("cacheguard_lock_waiters") >= at_least).then_some(())
        }
    })
    .await;
    assert!(
        ok.is_some(),
        "instance with admin {admin}: no request registered as a lock waiter within 3s"
    );
}
