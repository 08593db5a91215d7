//! Serialized writes under a nemesis, for any `[locks.<name>]` lock service: three
//! cacheguard processes in front of the shop's seat writes (fencing on), six clients writing
//! two seats through instances 1 and 2, and the checkers of `history` on the shop's write
//! log (exclusion, fencing). The test owns the lock service's servers and acts on them
//! from its nemesis; this runner owns the shop, the fleet and instance 0's link.
//!
//! A stale write is provoked the way the fencing-token argument draws it ([`strand`],
//! [`deliver`]): instance 0, the victim, reaches the shop through a [`TcpProxy`] of its
//! own. The nemesis holds that link, sends one write through the victim and waits until
//! it is granted (the victim holds the seat, its write on the way); the fault then takes
//! the lock from it; once another instance's newer write was accepted, and while another
//! write is at the shop, the held write is let through, and the shop must refuse it.
//!
//! ```text
//! start(lock, policy) ─▶ Fixtures { shop, link, fleet }
//! run(&mut fx, |n| nemesis(n, …)) ─▶ Verdict { history, log, output }
//! verdict.assert(Expect { … })
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::fleet::{Fleet, spawn_fleet_each};
use super::history::{Epoch, History, Outcome, WriteLog, check_exclusion, check_fencing};
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
/// The `[locks.<name>]` the route uses.
pub const LOCK: &str = "seats";

/// The seats the clients write; the victim's held write is to the first.
pub fn seats() -> [String; 2] {
    [seat("t1", "1A"), seat("t1", "1B")]
}

/// The seat route on lock [`LOCK`], its writes refused (`reject`) or forwarded
/// (`forward`) when the lock service fails.
pub fn seat_route(on_error: &str) -> String {
    route(
        "seat-update",
        "/trains/{train}/seats/{seat}",
        "PUT",
        &format!(
            "serialize = {{ key = \"/trains/{{train}}/seats/{{seat}}\", lease = \"{}ms\", \
             wait_timeout = \"{}ms\", max_waiters = 64, fence_header = \"{FENCING_TOKEN}\", \
             lock = \"{LOCK}\", on_redis_error = \"{on_error}\" }}",
            LEASE.as_millis(),
            WAIT_TIMEOUT.as_millis()
        ),
    )
}

/// An instance's config in front of `upstream`, with `[locks.seats]` = `lock` (`key`,
/// TOML value), embedded mode (the lock service is the only thing instances share).
pub fn config(upstream: &str, lock: &[(&str, String)], on_error: &str) -> CgConfig {
    let section = format!("locks.{LOCK}");
    lock.iter()
        .fold(CgConfig::with_upstream(upstream), |cfg, (key, value)| {
            cfg.set(&section, key, value)
        })
        .set_str("upstream", "timeout", "5s")
        .routes(&seat_route(on_error))
}

/// Everything a run acts on besides the lock service; the nemesis borrows it.
pub struct Fixtures {
    pub shop: Shop,
    /// Instance 0's way to the shop.
    pub link: TcpProxy,
    pub fleet: Fleet,
    /// The victim's write, held on its way (kept until the run ends).
    pub(super) held: Option<JoinHandle<()>>,
}

/// The shop (fencing), instance 0 behind its link, instances 1 and 2 straight to the shop.
pub async fn start(lock: &[(&str, String)], on_error: &str) -> Fixtures {
    let shop = Shop::start(Epoch::now(), &[]).await;
    shop.set_latency(Scope::Writes, SHOP_WRITE);
    shop.set_fencing(Some(FENCING_TOKEN));
    let link = TcpProxy::start(shop.addr()).await;
    let fleet = spawn_fleet_each(&[
        config(&format!("http://{}", link.addr()), lock, on_error),
        config(&shop.url(), lock, on_error),
        config(&shop.url(), lock, on_error),
    ])
    .await;
    Fixtures {
        shop,
        link,
        fleet,
        held: None,
    }
}

/// What a run left behind.
pub struct Verdict {
    pub history: History,
    pub log: WriteLog,
    pub output: String,
}

/// Runs the clients against instances 1 and 2 while `nemesis` acts, then heals the shop
/// and the link and waits for the shop to be idle.
pub async fn run(fx: &mut Fixtures, nemesis: impl AsyncFnOnce(Nemesis, &mut Fixtures)) -> Verdict {
    let config = RunConfig {
        clients: 6,
        duration: Duration::from_secs(3),
        tail: Duration::from_millis(2500),
        pace: Duration::from_millis(10),
        request_timeout: WAIT_TIMEOUT + Duration::from_secs(5),
        keep_headers: vec!["retry-after"],
        ..RunConfig::default()
    };
    let seats = seats();
    let targets = fx.fleet.addrs()[1..].to_vec();
    let epoch = fx.shop.epoch();
    let history = jepsen::run(
        &config,
        epoch,
        &targets,
        move |p, k| write_request(&seats[p % seats.len()], &format!("{{\"p\":{p},\"k\":{k}}}")),
        |n| nemesis(n, &mut *fx),
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

/// Writes granted on the instance with admin listener `admin` so far.
async fn granted(client: &HttpClient, admin: SocketAddr) -> f64 {
    metrics(client, admin).await.sum(
        "cacheguard_serialized_writes_total",
        &[("route", "seat-update"), ("result", "granted")],
    )
}

/// Holds the victim's link and has the victim take the first seat's lock for a write of
/// its own: once this returns, the victim holds the lock and its write is on its way.
/// Returns the time (on the shop's epoch) from which another holder's write is newer.
pub async fn strand(n: &Nemesis, fx: &mut Fixtures) -> Duration {
    let (since, write) = hold_victim(n, &fx.link, &fx.fleet, &fx.shop).await;
    fx.held = Some(write);
    since
}

/// [`strand`] on any run's parts: instance 0 of `fleet` reaches `shop` through `link`.
/// Returns the time from which another holder's write is newer, and the held write (keep
/// it until the run ends).
pub async fn hold_victim(
    n: &Nemesis,
    link: &TcpProxy,
    fleet: &Fleet,
    shop: &Shop,
) -> (Duration, JoinHandle<()>) {
    link.blackhole();
    let client = HttpClient::new();
    let (addr, admin) = (fleet.addrs()[0], fleet.admin_addrs()[0]);
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
            return (shop.epoch().elapsed(), write);
        }
        write.abort();
    }
    panic!("instance 0 was never granted the seat\n{}", fleet.output());
}

/// Waits until another instance's write to the first seat (begun after `since`) was
/// accepted and a write is at the shop, then lets the held write through.
pub async fn deliver(n: &Nemesis, fx: &Fixtures, since: Duration) {
    release_victim(n, &fx.link, &fx.fleet, &fx.shop, since).await;
}

/// [`deliver`] on any run's parts.
pub async fn release_victim(
    n: &Nemesis,
    link: &TcpProxy,
    fleet: &Fleet,
    shop: &Shop,
    since: Duration,
) {
    let seat = seats()[0].clone();
    let taken = poll_until(TAKEOVER_BOUND, Duration::from_millis(2), || {
        let newer = shop
            .write_log()
            .writes
            .iter()
            .any(|w| w.resource == seat && w.accepted && w.start > since);
        let busy = shop.in_flight() > 0;
        async move { (newer && busy).then_some(()) }
    })
    .await;
    assert!(
        taken.is_some(),
        "no other instance wrote the seat within {TAKEOVER_BOUND:?} of the fault\n{}",
        fleet.output()
    );
    link.restore();
    n.heal("the held write let through to the origin");
}

/// The nemesis of a run without faults.
pub async fn no_faults(_: Nemesis, _: &mut Fixtures) {}

/// The holder paused past its lease: [`strand`], SIGSTOP the victim for 2 × lease,
/// [`deliver`], SIGCONT.
pub async fn pause_holder(n: Nemesis, fx: &mut Fixtures) {
    n.at(FAULT_AT).await;
    let n = &n;
    let since = strand(n, fx).await;
    let paused = n.elapsed();
    n.start("SIGSTOP instance 0 for 2 × lease");
    fx.fleet.pause(0);
    deliver(n, fx, since).await;
    n.at(paused + 2 * LEASE).await;
    fx.fleet.resume(0);
    n.heal("SIGCONT instance 0");
}

/// What a run must show.
#[derive(Clone, Copy, Debug, Default)]
pub struct Expect {
    /// The fault takes the lock from a holder whose write is on its way: the shop must
    /// refuse at least one stale write (and exclusion is not asked).
    pub stale_write: bool,
    /// Writes are refused (503) for a while: the shop may have fewer writes then.
    pub outage: bool,
}

impl Verdict {
    pub(super) fn fail(&self, what: &str, report: &str) -> ! {
        panic!(
            "{what}\n{report}\n--- cacheguard output ---\n{}",
            self.output
        )
    }

    /// Fencing holds (tokens of accepted writes never decrease, no write refused without
    /// a newer one before it, every write carried a token); exclusion holds unless the
    /// fault takes the lock, and then a stale write was refused; every client got an
    /// answer within the wait and the write's time; writes were accepted after the last
    /// fault healed.
    pub fn assert(&self, expect: Expect) {
        let exclusion = check_exclusion(&self.log);
        let tokens = check_fencing(&self.log);
        let report = format!("{}\n{exclusion}{tokens}", self.history.summary());
        eprintln!("{expect:?}:\n{report}");
        if !tokens.ok() {
            self.fail(
                "fencing: a token decreased, was missing or was wrongly refused",
                &report,
            );
        }
        if expect.stale_write {
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
        // Nothing hangs: every client got an answer within the wait, the write and slack.
        let bound = WAIT_TIMEOUT + SHOP_WRITE + Duration::from_millis(1500);
        if let Some(op) = self.history.ops.iter().find(|op| {
            op.result.status.is_none() || op.end.is_none_or(|end| end - op.start > bound)
        }) {
            self.fail(&format!("a client waited past {bound:?}: {op}"), &report);
        }
        let healed = self.history.last_fault_end().unwrap_or(Duration::ZERO);
        let after = self
            .log
            .writes
            .iter()
            .filter(|w| w.accepted && w.start > healed)
            .count();
        if after == 0 {
            self.fail("no write was accepted after the last fault healed", &report);
        }
        if !expect.outage && self.history.summary().count(Outcome::Ok) == 0 {
            self.fail("no write succeeded", &report);
        }
    }

    /// Writes refused (503) by the instances, over the run.
    pub fn refused(&self) -> usize {
        self.history
            .ops
            .iter()
            .filter(|op| op.result.status == Some(503))
            .count()
    }
}

/// With `lock`'s service down: `reject` answers 503 and the shop sees nothing; `forward`
/// forwards every write, unserialized and counted; each answer within `within`.
pub async fn assert_down_per_policy(lock: &[(&str, String)], within: Duration) {
    for (policy, status, result) in [("reject", 503, "unavailable"), ("forward", 200, "ungated")] {
        let shop = Shop::start(Epoch::now(), &[]).await;
        let cg = config(&shop.url(), lock, policy).start().await;
        let client = HttpClient::new();
        for _ in 0..3 {
            let started = tokio::time::Instant::now();
            let resp = super::put(&client, cg.addr(), &seats()[0]).await;
            assert_eq!(resp.status.as_u16(), status, "{policy}: {resp:?}");
            assert!(
                started.elapsed() < within,
                "{policy}: answered after {:?}",
                started.elapsed()
            );
        }
        let reached = if policy == "reject" { 0 } else { 3 };
        assert_eq!(shop.write_log().writes.len(), reached, "{policy}");
        let counted = metrics(&client, cg.admin_addr()).await.sum(
            "cacheguard_serialized_writes_total",
            &[("route", "seat-update"), ("result", result)],
        );
        assert_eq!(counted, 3.0, "{policy}");
        cg.shutdown().await;
    }
}
