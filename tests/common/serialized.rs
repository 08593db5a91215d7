//! Serialized writes under a nemesis, with what `lock_faults` does not set up: any
//! instance config (the lock service's section added by the caller's function, shared mode
//! with a Redis), an origin that checks no token (to show that a nemesis bites without
//! it), and the checks of a lock service down or refused while requests come. The run
//! itself, the victim whose write is held ([`strand`], [`deliver`]) and the [`Verdict`] are
//! `lock_faults`'s:
//!
//! - **exclusion**: no two writes to one seat overlap at the origin, unless the fault
//!   takes the lock from its holder (then a fencing origin keeps the overlap harmless);
//! - **fencing**: in the origin's commit order the tokens of accepted writes never
//!   decrease, and a write is refused exactly when its token is below one accepted before.
//!
//! Short runs (a 1 s lease, about five seconds of load): longer ones belong in bench/.

use std::net::SocketAddr;
use std::time::Duration;

use super::fleet::{spawn_fleet_each, wait_coordinated};
use super::history::{Epoch, check_exclusion, check_fencing};
use super::jepsen::Nemesis;
pub use super::lock_faults::{
    FAULT_AT, Fixtures, LEASE, SHOP_WRITE, Verdict, WAIT_TIMEOUT, deliver, seats, strand,
};
use super::shop::{FENCING_TOKEN, Scope, Shop};
use super::{CgConfig, HttpClient, TcpProxy, route};

/// The seat route, serialized with a 1 s lease on the lock service `lock` (the shared
/// Redis's without one).
pub fn seat_route(lock: Option<&str>) -> String {
    let lock = lock.map_or_else(String::new, |name| format!(", lock = \"{name}\""));
    route(
        "seat-update",
        "/trains/{train}/seats/{seat}",
        "PUT",
        &format!(
            "serialize = {{ key = \"/trains/{{train}}/seats/{{seat}}\", lease = \"{}ms\", \
             wait_timeout = \"{}ms\", max_waiters = 64, fence_header = \"{FENCING_TOKEN}\"{lock} }}",
            LEASE.as_millis(),
            WAIT_TIMEOUT.as_millis()
        ),
    )
}

/// The seat route on the lock service `lock`, with `on_redis_error = policy` and a wait of
/// `wait` (for the tests of a lock service down).
pub fn policy_route(lock: &str, policy: &str, wait: Duration) -> String {
    route(
        "seat-update",
        "/trains/{train}/seats/{seat}",
        "PUT",
        &format!(
            "serialize = {{ key = \"/trains/{{train}}/seats/{{seat}}\", lease = \"1s\", \
             wait_timeout = \"{}ms\", fence_header = \"{FENCING_TOKEN}\", lock = \"{lock}\", \
             on_redis_error = \"{policy}\" }}",
            wait.as_millis()
        ),
    )
}

/// `PUT path` through `addr`: its status, and how long it took.
pub async fn timed_put(client: &HttpClient, addr: SocketAddr, path: &str) -> (u16, Duration) {
    let started = tokio::time::Instant::now();
    let resp = super::put(client, addr, path).await;
    (resp.status.as_u16(), started.elapsed())
}

/// `n` writes to the first seat through `addr` while its lock service is down or silent
/// (`what`): each answered `status` (503 with `reject`, 200 with `forward`) within `bound`
/// (the route's wait and a margin).
pub async fn answered_within(addr: SocketAddr, n: usize, status: u16, bound: Duration, what: &str) {
    let client = HttpClient::new();
    for _ in 0..n {
        let (got, took) = timed_put(&client, addr, &seats()[0]).await;
        assert_eq!(got, status, "{what}");
        assert!(took <= bound, "{what}: answered after {took:?}");
    }
}

/// Starts the cacheguard process `cfg` describes (with the seat route on a lock service
/// that cannot be used: unreachable, or refusing its credentials) and checks that it
/// starts all the same, answers a write 503 at once (`reject`), and logged a line with
/// each of `needles` (the lock's name, its endpoint, what failed). Returns its output.
pub async fn refused_at_start(cfg: CgConfig, dir: &std::path::Path, needles: &[&str]) -> String {
    let config = cfg
        .on_free_ports()
        .write_to(&dir.join(format!("cacheguard-{}.toml", super::free_port())));
    let started = tokio::time::Instant::now();
    let cg = super::spawn_cacheguard_process(&config).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(8), "started after {took:?}");
    let (status, took) = timed_put(&HttpClient::new(), cg.addr(), &seats()[0]).await;
    assert_eq!(status, 503, "{}", cg.output());
    assert!(took < Duration::from_millis(300), "answered after {took:?}");
    let output = cg.output();
    for needle in needles {
        assert!(
            output.contains(needle),
            "no {needle:?} in the log:\n{output}"
        );
    }
    output
}

/// How a run is set up.
#[derive(Clone, Copy, Debug)]
pub struct Setup<'a> {
    /// The `[locks.<name>]` the seat route uses (`None`: the shared Redis).
    pub lock: Option<&'a str>,
    /// Whether the instances share a Redis (then the run waits until they coordinate).
    pub shared: bool,
    /// Whether the shop refuses stale tokens.
    pub fencing: bool,
}

/// One run: the shop, three instances configured by `configure` (the victim behind its
/// link), the clients, and `nemesis`.
pub async fn run<N>(
    setup: Setup<'_>,
    configure: impl Fn(CgConfig) -> CgConfig,
    nemesis: N,
) -> Verdict
where
    N: AsyncFnOnce(Nemesis, &mut Fixtures),
{
    let epoch = Epoch::now();
    let shop = Shop::start(epoch, &[]).await;
    shop.set_latency(Scope::Writes, SHOP_WRITE);
    shop.set_fencing(setup.fencing.then_some(FENCING_TOKEN));
    let link = TcpProxy::start(shop.addr()).await;
    let cfg = |upstream: String| {
        configure(CgConfig::with_upstream(&upstream))
            .set_str("upstream", "timeout", "5s")
            .routes(&seat_route(setup.lock))
    };
    let fleet = spawn_fleet_each(&[
        cfg(format!("http://{}", link.addr())),
        cfg(shop.url()),
        cfg(shop.url()),
    ])
    .await;
    if setup.shared {
        wait_coordinated(&HttpClient::new(), &fleet.admin_addrs()).await;
    }
    let mut fx = Fixtures {
        shop,
        link,
        fleet,
        held: None,
    };
    super::lock_faults::run(&mut fx, nemesis).await
}

/// The victim SIGSTOPped for `pause` with its write on the way; the held write is
/// delivered once another instance took the seat over (so `pause` must outlast the lock:
/// the lease, or the session).
pub async fn pause_holder(n: &Nemesis, fx: &mut Fixtures, pause: Duration) {
    let since = strand(n, fx).await;
    let paused = n.elapsed();
    n.start("SIGSTOP instance 0");
    fx.fleet.pause(0);
    deliver(n, fx, since).await;
    n.at(paused + pause).await;
    fx.fleet.resume(0);
    n.heal("SIGCONT instance 0");
}

impl Verdict {
    /// The checkers' verdict against a fencing origin (`fencing`) or one that checks
    /// nothing, for a fault that takes the lock from a holder whose write is on its way
    /// (`takes_the_lock`: a stale write must have been provoked) or not.
    pub fn check(&self, takes_the_lock: bool, fencing: bool) {
        let exclusion = check_exclusion(&self.log);
        let tokens = check_fencing(&self.log);
        let report = format!("{}\n{exclusion}{tokens}", self.history.summary());
        eprintln!("takes the lock {takes_the_lock}, fencing {fencing}:\n{report}");
        if !fencing {
            // The nemesis bites: the stale write is accepted, out of order, overlapping.
            if tokens.decreases.is_empty() {
                self.fail(
                    "no stale write was accepted: the nemesis did not bite",
                    &report,
                );
            }
            if exclusion.overlaps_accepted() == 0 {
                self.fail("no two accepted writes overlapped", &report);
            }
            return;
        }
        if !tokens.ok() {
            self.fail("fencing: a token decreased or was wrongly refused", &report);
        }
        if takes_the_lock {
            if tokens.stale_refused == 0 {
                self.fail("the nemesis provoked no stale write", &report);
            }
        } else {
            if !exclusion.ok() {
                self.fail("two writes to one seat overlapped at the origin", &report);
            }
            if tokens.refused > 0 {
                self.fail(
                    "the origin refused a write without a fault to explain it",
                    &report,
                );
            }
        }
        self.assert_clients(&report);
    }

    /// Every client write ended with an answer within bounds (200, or 503 with
    /// Retry-After within the wait bound: a wait that ran out, or the lock service down),
    /// and writes were accepted after the last fault.
    fn assert_clients(&self, report: &str) {
        let longest = WAIT_TIMEOUT + Duration::from_secs(1);
        for op in &self.history.ops {
            let Some(end) = op.end else {
                self.fail(&format!("a write never completed: {op}"), report);
            };
            match op.result.status {
                Some(200) => {}
                Some(503) if end - op.start <= longest => {
                    if op.header_value("retry-after").is_none() {
                        self.fail(&format!("a 503 without Retry-After: {op}"), report);
                    }
                }
                _ => self.fail(&format!("unexpected answer: {op}"), report),
            }
        }
        let after = self.history.last_fault_end().unwrap_or_default();
        let later = self
            .log
            .writes
            .iter()
            .filter(|w| w.accepted && w.start > after)
            .count();
        if later == 0 {
            self.fail("no write was accepted after the last fault", report);
        }
    }

    /// The highest token accepted at the origin before `t` is below the lowest after it:
    /// a fault at `t` (a lock server's restart) left the tokens growing across it.
    pub fn assert_tokens_grow_across(&self, t: Duration) {
        let accepted = || self.log.writes.iter().filter(|w| w.accepted);
        let before = accepted()
            .filter(|w| w.end < t)
            .filter_map(|w| w.token)
            .max();
        let after = accepted()
            .filter(|w| w.start > t)
            .filter_map(|w| w.token)
            .min();
        match (before, after) {
            (Some(before), Some(after)) => {
                assert!(after > before, "{before:#x} then {after:#x} across {t:?}");
            }
            other => self.fail(&format!("no writes on both sides of {t:?}: {other:?}"), ""),
        }
    }
}
