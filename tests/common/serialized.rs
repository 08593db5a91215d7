//! Serialized writes under a nemesis, Jepsen-style, for any lock service: three cacheguard
//! processes in front of the shop's seat writes (`shop.rs`: every write logged with its
//! interval at the origin and its fencing token; in fencing mode a token below the highest
//! accepted is refused), six clients writing two seats round-robin over instances 1 and 2
//! (`jepsen.rs`), one nemesis, and the checkers of `history.rs` on the shop's write log:
//!
//! - **exclusion**: no two writes to one seat overlap at the origin. 0 without faults and
//!   under every fault that must not take the lock from its holder; under one that does,
//!   the overlaps are reported, and a fencing origin keeps them harmless;
//! - **fencing**: in the origin's commit order the tokens of accepted writes never
//!   decrease, and a write is refused exactly when its token is below one accepted before.
//!
//! How a stale write is provoked (the paused-holder diagram of the fencing-token argument):
//! instance 0, the *victim*, reaches the origin through a fault proxy of its own. The
//! nemesis holds that link, sends one write through the victim and waits until it is
//! granted ([`strand`]): the victim holds the seat's lock and its write is on its way.
//! Then a fault takes the lock from it (the victim paused past its lease or its session,
//! …), another instance is granted the seat with a newer token and the origin accepts its
//! write; only then, while another write is at the origin, is the held write let through
//! ([`deliver`]). A fencing origin refuses it.
//!
//! The lock service is the caller's: [`run`] takes a function that adds it to each
//! instance's config (a `[locks.<name>]` section, `[redis]` for shared mode) and the name
//! the seat route's `serialize.lock` picks. Short runs (a 1 s lease, about five seconds of
//! load): longer ones belong in bench/.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::fleet::{Fleet, spawn_fleet_each, wait_coordinated};
use super::history::{Epoch, History, WriteLog, check_exclusion, check_fencing};
use super::jepsen::{self, Nemesis, RunConfig};
use super::shop::{FENCING_TOKEN, Scope, Shop, seat, write_request};
use super::{CgConfig, HttpClient, TcpProxy, metrics, poll_until, route, url};

pub const LEASE: Duration = Duration::from_secs(1);
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(2);
/// A write's time at the origin (its transaction).
pub const SHOP_WRITE: Duration = Duration::from_millis(40);
/// When every nemesis strikes.
pub const FAULT_AT: Duration = Duration::from_secs(1);
/// How long the nemesis waits for the lock to change hands after a fault.
const TAKEOVER_BOUND: Duration = Duration::from_secs(20);

/// The seats the clients write; the victim's held write is to the first.
pub fn seats() -> [String; 2] {
    [seat("t1", "1A"), seat("t1", "1B")]
}

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

/// What a run acts on; the nemesis borrows it.
pub struct Fixtures {
    pub shop: Shop,
    /// Instance 0's way to the origin.
    pub link: TcpProxy,
    pub fleet: Fleet,
    /// The victim's write, held on its way (kept until the run ends).
    held: Option<JoinHandle<()>>,
}

/// What a run left behind.
pub struct Verdict {
    pub history: History,
    pub log: WriteLog,
    pub output: String,
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
    let targets = fleet.addrs()[1..].to_vec();
    let mut fx = Fixtures {
        shop,
        link,
        fleet,
        held: None,
    };
    let config = RunConfig {
        clients: 6,
        duration: Duration::from_secs(3),
        tail: Duration::from_millis(1500),
        pace: Duration::from_millis(10),
        request_timeout: WAIT_TIMEOUT + Duration::from_secs(5),
        keep_headers: vec!["retry-after"],
        ..RunConfig::default()
    };
    let seats = seats();
    let history = jepsen::run(
        &config,
        epoch,
        &targets,
        move |p, k| {
            write_request(
                &seats[(p + k as usize) % seats.len()],
                &format!("{{\"p\":{p},\"k\":{k}}}"),
            )
        },
        |n| nemesis(n, &mut fx),
    )
    .await;
    fx.link.restore();
    fx.shop.heal();
    let idle = fx.shop.wait_idle(Duration::from_secs(10)).await;
    assert!(
        idle,
        "the shop still has writes in flight 10s after the run"
    );
    if let Some(held) = fx.held.take() {
        held.abort();
    }
    Verdict {
        log: fx.shop.write_log(),
        history,
        output: fx.fleet.output(),
    }
}

/// Writes granted on the instance whose admin listener is `admin`, so far.
async fn granted(client: &HttpClient, admin: SocketAddr) -> f64 {
    metrics(client, admin).await.sum(
        "cacheguard_serialized_writes_total",
        &[("route", "seat-update"), ("result", "granted")],
    )
}

/// Holds the victim's link to the origin and has the victim take the first seat's lock
/// for a write of its own: once this returns, the victim holds the lock and its write is
/// on its way. Returns the time (on the shop's epoch) from which another holder's write is
/// a newer one.
pub async fn strand(n: &Nemesis, fx: &mut Fixtures) -> Duration {
    fx.link.blackhole();
    let client = HttpClient::new();
    let (addr, admin) = (fx.fleet.addrs()[0], fx.fleet.admin_addrs()[0]);
    let seat = seats()[0].clone();
    // The clients contend for the seat too: a write that times out waiting is sent again.
    for attempt in 0..5 {
        let before = granted(&client, admin).await;
        let (writer, path) = (client.clone(), seat.clone());
        let write = tokio::spawn(async move {
            let target = url(addr, &path);
            let put = writer.request(
                http::Method::PUT,
                &target,
                &[("content-type", "application/json")],
                super::client::full_body(format!("{{\"held\":{attempt}}}")),
            );
            let _ = tokio::time::timeout(Duration::from_secs(30), put).await;
        });
        let got = poll_until(WAIT_TIMEOUT * 2, Duration::from_millis(5), || {
            let client = client.clone();
            async move { (granted(&client, admin).await > before).then_some(()) }
        })
        .await;
        if got.is_some() {
            n.start("instance 0 holds seat 1A, its write held on the way to the origin");
            fx.held = Some(write);
            return fx.shop.epoch().elapsed();
        }
        write.abort();
    }
    panic!("instance 0 was never granted the seat");
}

/// Waits until another instance's write to the first seat (begun after `since`) was
/// accepted and a write is at the origin, then lets the held write through.
pub async fn deliver(n: &Nemesis, fx: &Fixtures, since: Duration) {
    let seat = seats()[0].clone();
    let taken = poll_until(TAKEOVER_BOUND, Duration::from_millis(2), || {
        let newer = fx
            .shop
            .write_log()
            .writes
            .iter()
            .any(|w| w.resource == seat && w.accepted && w.start > since);
        let busy = fx.shop.in_flight() > 0;
        async move { (newer && busy).then_some(()) }
    })
    .await;
    assert!(
        taken.is_some(),
        "no other instance wrote the seat within {TAKEOVER_BOUND:?} of the fault\n{}",
        fx.fleet.output()
    );
    fx.link.restore();
    n.heal("the held write let through to the origin");
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
    pub fn fail(&self, what: &str, report: &str) -> ! {
        panic!(
            "{what}\n{report}\n--- cacheguard output ---\n{}",
            self.output
        )
    }

    /// The checkers' verdict against a fencing origin (`fencing`) or one that checks
    /// nothing, for a fault that takes the lock from a holder whose write is on its way
    /// (`takes_the_lock`: a stale write must have been provoked) or not.
    pub fn assert(&self, takes_the_lock: bool, fencing: bool) {
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

    /// The highest token accepted at the origin before `t` and the lowest after it: a
    /// fault at `t` (a lock server's restart) must leave the tokens growing across it.
    pub fn tokens_around(&self, t: Duration) -> (Option<u64>, Option<u64>) {
        let accepted = || self.log.writes.iter().filter(|w| w.accepted);
        let before = accepted()
            .filter(|w| w.end < t)
            .filter_map(|w| w.token)
            .max();
        let after = accepted()
            .filter(|w| w.start > t)
            .filter_map(|w| w.token)
            .min();
        (before, after)
    }
}
