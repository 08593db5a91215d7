//! Serialized writes under a nemesis, for any lock service (a `[locks.<name>]` section,
//! or the shared Redis's lock): three cacheguard processes in front of the shop's seat
//! writes, six clients writing two seats through instances 1 and 2, and the checkers of
//! `history` on the shop's write log. The test owns the lock service's servers and acts on
//! them from its nemesis; this runner owns the shop, the fleet and instance 0's link.
//!
//! - **exclusion**: no two writes to one seat overlap at the origin, unless the fault
//!   takes the lock from its holder (then a fencing origin keeps the overlap harmless);
//! - **fencing**: in the origin's commit order the tokens of accepted writes never
//!   decrease, and a write is refused exactly when its token is below one accepted before.
//!
//! A stale write is provoked the way the fencing-token argument draws it ([`strand`],
//! [`deliver`]): instance 0, the victim, reaches the shop through a [`TcpProxy`] of its
//! own. The nemesis holds that link, sends one write through the victim and waits until
//! it is granted (the victim holds the seat, its write on the way); the fault then takes
//! the lock from it; once another instance's newer write was accepted, and while another
//! write is at the shop, the held write is let through, and the shop must refuse it.
//!
//! ```text
//! start(lock, policy) ─▶ Fixtures { shop, link, fleet }        (a [locks.seats] section)
//! run(&mut fx, |n, fx| nemesis(n, …)) ─▶ Verdict { history, log, output }
//! verdict.assert(Expect { … })
//!
//! run_with(Setup { … }, configure, nemesis) ─▶ Verdict        (any instance config: shared
//! verdict.check(takes_the_lock, fencing)                        mode, no token check)
//! ```
//!
//! Also the checks of a lock service down, silent or refused while requests come
//! ([`answered_within`], [`refused_at_start`], [`assert_down_per_policy`]). Short runs (a
//! 1 s lease, about five seconds of load): longer ones belong in bench/.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::fleet::{Fleet, spawn_fleet_each, wait_coordinated};
use super::history::{
    Epoch, ExclusionReport, FencingReport, History, Outcome, WriteLog, check_exclusion,
    check_fencing,
};
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

/// The seat route, serialized per seat with the fencing header; `settings`: the rest of
/// its `serialize = { … }`.
fn serialized_seat_route(settings: &str) -> String {
    route(
        "seat-update",
        "/trains/{train}/seats/{seat}",
        "PUT",
        &format!(
            "serialize = {{ key = \"/trains/{{train}}/seats/{{seat}}\", \
             fence_header = \"{FENCING_TOKEN}\", {settings} }}"
        ),
    )
}

/// The seat route of the runs: a 1 s lease, a 2 s wait, on the lock service `lock` (the
/// shared Redis's without one), its writes refused (`reject`) or forwarded (`forward`)
/// when the lock service fails (the default without `on_error`).
pub fn seat_route(lock: Option<&str>, on_error: Option<&str>) -> String {
    let lock = lock.map_or_else(String::new, |name| format!(", lock = \"{name}\""));
    let on_error = on_error.map_or_else(String::new, |p| format!(", on_redis_error = \"{p}\""));
    serialized_seat_route(&format!(
        "lease = \"{}ms\", wait_timeout = \"{}ms\", max_waiters = 64{lock}{on_error}",
        LEASE.as_millis(),
        WAIT_TIMEOUT.as_millis()
    ))
}

/// The seat route on the lock service `lock`, with `on_redis_error = policy` and a wait of
/// `wait` (for the tests of a lock service down).
pub fn policy_route(lock: &str, policy: &str, wait: Duration) -> String {
    serialized_seat_route(&format!(
        "lease = \"1s\", wait_timeout = \"{}ms\", lock = \"{lock}\", on_redis_error = \"{policy}\"",
        wait.as_millis()
    ))
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
        .routes(&seat_route(Some(LOCK), Some(on_error)))
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

/// The shop (fencing), instance 0 behind its link, instances 1 and 2 straight to the
/// shop, on the `[locks.seats]` service `lock`.
pub async fn start(lock: &[(&str, String)], on_error: &str) -> Fixtures {
    start_with(|upstream| config(upstream, lock, on_error), true, false).await
}

/// The shop (checking tokens: `fencing`), instance 0 behind its link, instances 1 and 2
/// straight to the shop, each configured by `config` for its upstream; with `shared`, once
/// the instances coordinate through their Redis.
pub async fn start_with(
    config: impl Fn(&str) -> CgConfig,
    fencing: bool,
    shared: bool,
) -> Fixtures {
    let shop = Shop::start(Epoch::now(), &[]).await;
    shop.set_latency(Scope::Writes, SHOP_WRITE);
    shop.set_fencing(fencing.then_some(FENCING_TOKEN));
    let link = TcpProxy::start(shop.addr()).await;
    let fleet = spawn_fleet_each(&[
        config(&format!("http://{}", link.addr())),
        config(&shop.url()),
        config(&shop.url()),
    ])
    .await;
    if shared {
        wait_coordinated(&HttpClient::new(), &fleet.admin_addrs()).await;
    }
    Fixtures {
        shop,
        link,
        fleet,
        held: None,
    }
}

/// How a [`run_with`] is set up.
#[derive(Clone, Copy, Debug)]
pub struct Setup<'a> {
    /// The `[locks.<name>]` the seat route uses (`None`: the shared Redis).
    pub lock: Option<&'a str>,
    /// Whether the instances share a Redis (then the run waits until they coordinate).
    pub shared: bool,
    /// Whether the shop refuses stale tokens.
    pub fencing: bool,
}

/// One run with any instance config: the shop, three instances configured by `configure`
/// (which adds the lock service's section; the seat route is added here), the clients,
/// and `nemesis`.
pub async fn run_with<N>(
    setup: Setup<'_>,
    configure: impl Fn(CgConfig) -> CgConfig,
    nemesis: N,
) -> Verdict
where
    N: AsyncFnOnce(Nemesis, &mut Fixtures),
{
    let config = |upstream: &str| {
        configure(CgConfig::with_upstream(upstream))
            .set_str("upstream", "timeout", "5s")
            .routes(&seat_route(setup.lock, None))
    };
    let mut fx = start_with(config, setup.fencing, setup.shared).await;
    run(&mut fx, nemesis).await
}

/// What a run left behind.
pub struct Verdict {
    pub history: History,
    pub log: WriteLog,
    pub output: String,
    /// More lines for the report (what a run also measured).
    pub notes: String,
}

/// The clients of a run: six, writing the two seats for 3 s, each write bounded by the
/// wait and 5 s.
pub fn clients() -> RunConfig {
    RunConfig {
        clients: 6,
        duration: Duration::from_secs(3),
        tail: Duration::from_millis(2500),
        pace: Duration::from_millis(10),
        request_timeout: WAIT_TIMEOUT + Duration::from_secs(5),
        keep_headers: vec!["retry-after"],
        ..RunConfig::default()
    }
}

/// Runs the [`clients`] against instances 1 and 2 while `nemesis` acts, then heals the
/// shop and the link and waits for the shop to be idle.
pub async fn run(fx: &mut Fixtures, nemesis: impl AsyncFnOnce(Nemesis, &mut Fixtures)) -> Verdict {
    run_clients(fx, &clients(), nemesis).await
}

/// [`run`] with the clients `config` says.
pub async fn run_clients(
    fx: &mut Fixtures,
    config: &RunConfig,
    nemesis: impl AsyncFnOnce(Nemesis, &mut Fixtures),
) -> Verdict {
    let seats = seats();
    let targets = fx.fleet.addrs()[1..].to_vec();
    let epoch = fx.shop.epoch();
    let history = jepsen::run(
        config,
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
        notes: String::new(),
    }
}

/// The seat route's writes counted with `result` (granted, timeout, unavailable,
/// ungated…) so far by the instance whose admin listener is `admin`.
pub async fn counted(client: &HttpClient, admin: SocketAddr, result: &str) -> f64 {
    metrics(client, admin).await.sum(
        "cacheguard_serialized_writes_total",
        &[("route", "seat-update"), ("result", result)],
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
        let before = counted(&client, admin, "granted").await;
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
            async move { (counted(&client, admin, "granted").await > before).then_some(()) }
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

/// The holder paused past its lease: at [`FAULT_AT`], [`pause_holder_for`] 2 × lease.
pub async fn pause_holder(n: Nemesis, fx: &mut Fixtures) {
    n.at(FAULT_AT).await;
    pause_holder_for(&n, fx, 2 * LEASE).await;
}

/// The victim SIGSTOPped for `pause` with its write on the way ([`strand`]); the held write
/// is delivered once another instance took the seat over ([`deliver`]; so `pause` must
/// outlast the lock: the lease, or the session), then SIGCONT.
pub async fn pause_holder_for(n: &Nemesis, fx: &mut Fixtures, pause: Duration) {
    let since = strand(n, fx).await;
    let paused = n.elapsed();
    n.start(&format!("SIGSTOP instance 0 for {pause:?}"));
    fx.fleet.pause(0);
    deliver(n, fx, since).await;
    n.at(paused + pause).await;
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

/// How a [`Verdict::check_answers`] bounds the clients' answers.
#[derive(Clone, Copy, Debug)]
pub struct Answers {
    /// The longest a 503 may take (the wait, and room for the machine's scheduling).
    pub longest_refusal: Duration,
    /// Whether a write may get no answer (an instance restarted refuses connections for a
    /// moment).
    pub unanswered: bool,
}

impl Verdict {
    pub(super) fn fail(&self, what: &str, report: &str) -> ! {
        panic!(
            "{what}\n{report}\n--- cacheguard output ---\n{}",
            self.output
        )
    }

    /// The checkers' reports on the shop's log, and the text of the report (printed, with
    /// `label` for the run's expectation).
    fn reports(&self, label: &str) -> (ExclusionReport, FencingReport, String) {
        let exclusion = check_exclusion(&self.log);
        let tokens = check_fencing(&self.log);
        let report = format!(
            "{}\n{exclusion}{tokens}{}",
            self.history.summary(),
            self.notes
        );
        eprintln!("{label}:\n{report}");
        (exclusion, tokens, report)
    }

    /// With a fencing origin: tokens never decrease (nor are missing, nor wrongly refused);
    /// a fault that takes the lock (`stale_write`) provoked a stale write, refused; any
    /// other run kept exclusion and had nothing refused.
    fn assert_fenced(
        &self,
        stale_write: bool,
        exclusion: &ExclusionReport,
        tokens: &FencingReport,
        report: &str,
    ) {
        if !tokens.ok() {
            self.fail(
                "fencing: a token decreased, was missing or was wrongly refused",
                report,
            );
        }
        if stale_write {
            if tokens.stale_refused == 0 {
                self.fail("the nemesis provoked no stale write", report);
            }
        } else {
            if !exclusion.ok() {
                self.fail("two writes to one seat overlapped at the origin", report);
            }
            if tokens.refused > 0 {
                self.fail(
                    "the origin refused a write without a fault to explain it",
                    report,
                );
            }
        }
    }

    /// Writes accepted at the origin that began after the last fault healed: none means
    /// the fault left the lock service (or the seat) unusable.
    fn assert_accepted_after_faults(&self, report: &str) {
        let healed = self.history.last_fault_end().unwrap_or(Duration::ZERO);
        let after = self
            .log
            .writes
            .iter()
            .filter(|w| w.accepted && w.start > healed)
            .count();
        if after == 0 {
            self.fail("no write was accepted after the last fault healed", report);
        }
    }

    /// A [`start`]ed run: fencing holds; exclusion holds unless the fault takes the lock,
    /// and then a stale write was refused; every client got an answer within the wait and
    /// the write's time; writes were accepted after the last fault healed.
    pub fn assert(&self, expect: Expect) {
        let (exclusion, tokens, report) = self.reports(&format!("{expect:?}"));
        self.assert_fenced(expect.stale_write, &exclusion, &tokens, &report);
        // Nothing hangs: every client got an answer within the wait, the write and slack.
        let bound = WAIT_TIMEOUT + SHOP_WRITE + Duration::from_millis(1500);
        if let Some(op) = self.history.ops.iter().find(|op| {
            op.result.status.is_none() || op.end.is_none_or(|end| end - op.start > bound)
        }) {
            self.fail(&format!("a client waited past {bound:?}: {op}"), &report);
        }
        self.assert_accepted_after_faults(&report);
        if !expect.outage && self.history.summary().count(Outcome::Ok) == 0 {
            self.fail("no write succeeded", &report);
        }
    }

    /// A [`run_with`]'s verdict against a fencing origin (`fencing`) or one that checks
    /// nothing, for a fault that takes the lock from a holder whose write is on its way
    /// (`takes_the_lock`: a stale write must have been provoked) or not.
    pub fn check(&self, takes_the_lock: bool, fencing: bool) {
        self.check_answers(
            takes_the_lock,
            fencing,
            Answers {
                longest_refusal: WAIT_TIMEOUT + Duration::from_secs(1),
                unanswered: false,
            },
        );
    }

    /// [`Verdict::check`], the clients' answers bounded by `answers`.
    pub fn check_answers(&self, takes_the_lock: bool, fencing: bool, answers: Answers) {
        let (exclusion, tokens, report) = self.reports(&format!(
            "takes the lock {takes_the_lock}, fencing {fencing}"
        ));
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
        self.assert_fenced(takes_the_lock, &exclusion, &tokens, &report);
        self.assert_clients(takes_the_lock, answers, &report);
    }

    /// Every client write ended with an answer within bounds (200, or 503 with
    /// Retry-After within the wait bound: a wait that ran out, or the lock service down;
    /// under a fault that can take the lock, also the fencing origin's own 409 `stale-token`
    /// passed through to the client whose older grant lost), and writes were accepted after
    /// the last fault.
    fn assert_clients(&self, takes_the_lock: bool, answers: Answers, report: &str) {
        for op in &self.history.ops {
            let Some(end) = op.end else {
                self.fail(&format!("a write never completed: {op}"), report);
            };
            match op.result.status {
                Some(200) => {}
                Some(503) if end - op.start <= answers.longest_refusal => {
                    if op.header_value("retry-after").is_none() {
                        self.fail(&format!("a 503 without Retry-After: {op}"), report);
                    }
                }
                // A holder whose grant the fault took (a failover that lost the lock) wrote
                // after the next holder: the origin refused its token, and the client is
                // told so rather than the write being dropped.
                Some(409) if takes_the_lock && op.result.body.contains("stale-token") => {}
                None if answers.unanswered => {}
                _ => self.fail(&format!("unexpected answer: {op}"), report),
            }
        }
        self.assert_accepted_after_faults(report);
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

    /// Writes refused (503) by the instances, over the run.
    pub fn refused(&self) -> usize {
        self.history
            .ops
            .iter()
            .filter(|op| op.result.status == Some(503))
            .count()
    }
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
        assert_eq!(
            counted(&client, cg.admin_addr(), result).await,
            3.0,
            "{policy}"
        );
        cg.shutdown().await;
    }
}
