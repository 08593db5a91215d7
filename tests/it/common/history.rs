//! Operation histories and the checkers that judge them, Jepsen-style.
//!
//! A run records every client operation twice: when it is *invoked*, and when it
//! *completes* as `ok` (the client saw success), `fail` (the client saw a definite refusal)
//! or `info` (the outcome is unknown: a timeout, a reset, a 5xx). A [`Recorder`] is shared
//! by every client task and the nemesis (whose faults and heals are recorded too), and
//! [`Recorder::history`] pairs invocations with completions into [`Op`]s. An operation
//! that never completed (its task was cut short) is `info` with no end.
//!
//! The origin keeps its own log ([`SaleLog`] for the flash-sale shop, [`WriteLog`] for
//! writes to one resource), on the same monotonic [`Epoch`] as the history, and the
//! checkers are plain functions over the two, each returning a report (counts, the
//! offending operations, a `Display` that explains a failure):
//!
//! - stock: [`check_oversell`], [`check_phantom`], [`check_undersell`], [`flood_factor`],
//!   [`check_available`];
//! - write serialisation: [`check_exclusion`], [`check_fencing`];
//! - version floor (read-your-writes through a cache in front of a lagging replica):
//!   [`check_version_floor`].
//!
//! Nothing here knows cacheguard: the runner (`jepsen.rs`) and the shop (`shop.rs`) fill
//! these types, and a later feature's tests can fill them the same way.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// How many offending items a report lists in its `Display` (the counts are always whole).
const SHOW: usize = 12;

/// The zero of a run's monotonic times: every time in a history and an origin log is the
/// time elapsed since it.
#[derive(Clone, Copy, Debug)]
pub struct Epoch(Instant);

impl Epoch {
    pub fn now() -> Epoch {
        Epoch(Instant::now())
    }

    /// Time elapsed since the epoch.
    pub fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }

    /// The instant `t` after the epoch.
    pub fn at(&self, t: Duration) -> Instant {
        self.0 + t
    }
}

/// Milliseconds with one decimal, for reports.
fn ms(t: Duration) -> String {
    format!("{:.1}ms", t.as_secs_f64() * 1000.0)
}

// === operations ===

/// How an operation ended, as the client saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Success (a 2xx).
    Ok,
    /// A definite refusal: nothing happened (a 4xx).
    Fail,
    /// Unknown: it may or may not have taken effect (a 5xx, a timeout, a reset).
    Info,
}

impl Outcome {
    /// The outcome an HTTP status means to a client: 2xx ok, 4xx fail, anything else
    /// unknown (a 5xx may come from an origin that did the work).
    pub fn of_status(status: u16) -> Outcome {
        match status {
            200..=299 => Outcome::Ok,
            400..=499 => Outcome::Fail,
            _ => Outcome::Info,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Fail => "fail",
            Outcome::Info => "info",
        }
    }
}

/// One operation: its invocation and (when it came) its completion.
#[derive(Clone, Debug)]
pub struct Op {
    /// Invocation order in the history.
    pub index: usize,
    pub start: Duration,
    /// `None` when it never completed.
    pub end: Option<Duration>,
    /// Who did what to which resource.
    pub call: Invocation,
    /// How it ended (unknown, without details, until it did).
    pub result: Completion,
}

impl Op {
    /// A hand-made operation (for checker tests): build it up with [`Op::span`],
    /// [`Op::status`], [`Op::header`], [`Op::body`] or [`Op::error`].
    pub fn new(process: usize, f: &str, resource: &str, value: &str) -> Op {
        Op::invoked(
            0,
            Duration::ZERO,
            Invocation {
                process,
                f: f.to_string(),
                resource: resource.to_string(),
                value: value.to_string(),
                target: None,
                attempt: 0,
            },
        )
    }

    /// An operation invoked at `start`, not completed yet.
    fn invoked(index: usize, start: Duration, call: Invocation) -> Op {
        Op {
            index,
            start,
            end: None,
            call,
            result: Completion::pending(),
        }
    }

    /// Invoked at `start_ms`, completed at `end_ms` (milliseconds after the epoch).
    pub fn span(mut self, start_ms: u64, end_ms: u64) -> Op {
        self.start = Duration::from_millis(start_ms);
        self.end = Some(Duration::from_millis(end_ms));
        self
    }

    /// Answered `status` (the outcome follows from it).
    pub fn status(mut self, status: u16) -> Op {
        self.result.status = Some(status);
        self.result.outcome = Outcome::of_status(status);
        self.result.error = None;
        self
    }

    pub fn header(mut self, name: &str, value: &str) -> Op {
        self.result
            .headers
            .push((name.to_ascii_lowercase(), value.to_string()));
        self
    }

    pub fn body(mut self, body: &str) -> Op {
        self.result.body = body.to_string();
        self
    }

    /// No response: `error` (a timeout, a reset), so the outcome is unknown.
    pub fn error(mut self, error: &str) -> Op {
        self.result = Completion::no_answer(error.to_string());
        self
    }

    pub fn f(&self) -> &str {
        &self.call.f
    }

    pub fn resource(&self) -> &str {
        &self.call.resource
    }

    pub fn outcome(&self) -> Outcome {
        self.result.outcome
    }

    /// The first value of response header `name` (lower-case).
    /// Whether the operation was under way at some time within one of `windows`.
    pub fn overlaps(&self, windows: &[(Duration, Duration)]) -> bool {
        let end = self.end.unwrap_or(Duration::MAX);
        windows
            .iter()
            .any(|(from, to)| self.start <= *to && end >= *from)
    }

    pub fn header_value(&self, name: &str) -> Option<&str> {
        self.result
            .headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether the answer was a replay of an earlier one (`Idempotent-Replayed: true`).
    pub fn replayed(&self) -> bool {
        self.header_value("idempotent-replayed")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    }

    /// The string at JSON pointer `pointer` of the body, when it is JSON and has one.
    pub fn body_str(&self, pointer: &str) -> Option<String> {
        let json: serde_json::Value = serde_json::from_str(&self.result.body).ok()?;
        json.pointer(pointer)?.as_str().map(str::to_string)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (call, result) = (&self.call, &self.result);
        write!(
            f,
            "#{} p{} {} {} {:?}",
            self.index, call.process, call.f, call.resource, call.value
        )?;
        if call.attempt > 0 {
            write!(f, " (retry {})", call.attempt)?;
        }
        if let Some(target) = call.target {
            write!(f, " via #{target}")?;
        }
        let end = self.end.map_or_else(|| "never".to_string(), ms);
        write!(
            f,
            " [{} .. {}] {}",
            ms(self.start),
            end,
            result.outcome.as_str()
        )?;
        if let Some(status) = result.status {
            write!(f, " {status}")?;
        }
        for (k, v) in &result.headers {
            write!(f, " {k}={v}")?;
        }
        if !result.body.is_empty() {
            write!(f, " body={:?}", result.body)?;
        }
        if let Some(e) = &result.error {
            write!(f, " error={e:?}")?;
        }
        Ok(())
    }
}

/// A fault the nemesis started or healed, at `time`.
#[derive(Clone, Debug)]
pub struct NemesisEvent {
    pub time: Duration,
    pub phase: Phase,
    pub what: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Start,
    Heal,
}

/// How an operation completed; see [`Recorder::complete`].
#[derive(Clone, Debug)]
pub struct Completion {
    pub outcome: Outcome,
    pub status: Option<u16>,
    /// The response headers the run chose to keep (names lower-case).
    pub headers: Vec<(String, String)>,
    /// The response body, cut to a few hundred bytes.
    pub body: String,
    /// The transport error, for an operation without a response.
    pub error: Option<String>,
}

impl Completion {
    /// An HTTP answer: the outcome follows from `status`.
    pub fn answered(status: u16, headers: Vec<(String, String)>, body: &[u8]) -> Completion {
        let mut body = String::from_utf8_lossy(body).into_owned();
        if body.len() > 300 {
            let mut cut = 300;
            while !body.is_char_boundary(cut) {
                cut -= 1;
            }
            body.truncate(cut);
        }
        Completion {
            outcome: Outcome::of_status(status),
            status: Some(status),
            headers,
            body,
            error: None,
        }
    }

    /// Not completed (yet): unknown, nothing known about it.
    pub fn pending() -> Completion {
        Completion {
            outcome: Outcome::Info,
            status: None,
            headers: Vec::new(),
            body: String::new(),
            error: None,
        }
    }

    /// No answer (a timeout, a reset, a refused connection): unknown.
    pub fn no_answer(error: String) -> Completion {
        Completion {
            outcome: Outcome::Info,
            status: None,
            headers: Vec::new(),
            body: String::new(),
            error: Some(error),
        }
    }
}

/// An invocation's handle, for its completion.
#[derive(Clone, Copy, Debug)]
pub struct OpId(usize);

/// What one client is about to do; see [`Recorder::invoke`].
#[derive(Clone, Debug)]
pub struct Invocation {
    /// The client (Jepsen's process); one client runs one operation at a time.
    pub process: usize,
    /// What it does (`"buy"`, `"write"`).
    pub f: String,
    /// The resource it acts on (`/trains/t1/seats/a`).
    pub resource: String,
    /// Its value: the idempotency key of a buy, the body of a write.
    pub value: String,
    /// The instance it was sent to, when there are several.
    pub target: Option<usize>,
    /// 0 for a first try, n for the n-th retry of the same value.
    pub attempt: u32,
}

#[derive(Debug, Default)]
struct Recorded {
    ops: Vec<Op>,
    nemesis: Vec<NemesisEvent>,
}

/// The thread-safe recorder every client task and the nemesis share (clone it freely).
/// Times are taken on the [`Epoch`] when each call is made, under one lock, so the
/// history's order is the order of the calls.
#[derive(Clone, Debug)]
pub struct Recorder {
    epoch: Epoch,
    recorded: Arc<Mutex<Recorded>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Recorder {
    pub fn new(epoch: Epoch) -> Recorder {
        Recorder {
            epoch,
            recorded: Arc::default(),
        }
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Records an invocation now; complete it with [`Recorder::complete`].
    pub fn invoke(&self, call: Invocation) -> OpId {
        let mut recorded = lock(&self.recorded);
        let index = recorded.ops.len();
        let start = self.epoch.elapsed();
        recorded.ops.push(Op::invoked(index, start, call));
        OpId(index)
    }

    /// Records the completion of `id` now (a second completion of one op is ignored).
    pub fn complete(&self, id: OpId, completion: Completion) {
        let mut recorded = lock(&self.recorded);
        let now = self.epoch.elapsed();
        if let Some(op) = recorded.ops.get_mut(id.0)
            && op.end.is_none()
        {
            op.end = Some(now);
            op.result = completion;
        }
    }

    /// Records a fault starting (or healing) now.
    pub fn nemesis(&self, phase: Phase, what: impl Into<String>) {
        let time = self.epoch.elapsed();
        lock(&self.recorded).nemesis.push(NemesisEvent {
            time,
            phase,
            what: what.into(),
        });
    }

    /// The history so far.
    pub fn history(&self) -> History {
        let recorded = lock(&self.recorded);
        History {
            ops: recorded.ops.clone(),
            nemesis: recorded.nemesis.clone(),
        }
    }
}

/// A run's operations (in invocation order) and the nemesis's events.
#[derive(Clone, Debug, Default)]
pub struct History {
    pub ops: Vec<Op>,
    pub nemesis: Vec<NemesisEvent>,
}

impl History {
    /// A hand-made history (for checker tests); indexes are set in order.
    pub fn of(ops: Vec<Op>) -> History {
        let ops = ops
            .into_iter()
            .enumerate()
            .map(|(index, op)| Op { index, ..op })
            .collect();
        History {
            ops,
            nemesis: Vec::new(),
        }
    }

    /// The operations doing `f`.
    pub fn ops_of<'a>(&'a self, f: &'a str) -> impl Iterator<Item = &'a Op> + 'a {
        self.ops.iter().filter(move |op| op.call.f == f)
    }

    /// The windows of the faults whose name starts with `what`: each start to the heal
    /// after it (or to the end of time, if never healed).
    pub fn fault_windows(&self, what: &str) -> Vec<(Duration, Duration)> {
        let mut windows = Vec::new();
        let mut open: Option<Duration> = None;
        for event in self.nemesis.iter().filter(|e| e.what.starts_with(what)) {
            match (event.phase, open) {
                (Phase::Start, None) => open = Some(event.time),
                (Phase::Heal, Some(start)) => {
                    windows.push((start, event.time));
                    open = None;
                }
                _ => {}
            }
        }
        if let Some(start) = open {
            windows.push((start, Duration::MAX));
        }
        windows
    }

    /// When the last fault was healed (or, if one was never healed, the last start).
    pub fn last_fault_end(&self) -> Option<Duration> {
        self.nemesis.iter().map(|e| e.time).max()
    }

    /// Counts per outcome and status, the nemesis's timeline: the "what happened" line of a
    /// failure message.
    pub fn summary(&self) -> HistorySummary {
        let mut by_outcome: BTreeMap<(Outcome, String), usize> = BTreeMap::new();
        for op in &self.ops {
            let detail = match (op.end, op.result.status, &op.result.error) {
                (None, _, _) => "never completed".to_string(),
                (Some(_), Some(s), _) => s.to_string(),
                (Some(_), None, Some(e)) => error_kind(e).to_string(),
                (Some(_), None, None) => "no answer".to_string(),
            };
            *by_outcome.entry((op.outcome(), detail)).or_default() += 1;
        }
        HistorySummary {
            ops: self.ops.len(),
            retries: self.ops.iter().filter(|op| op.call.attempt > 0).count(),
            by_outcome,
            nemesis: self.nemesis.clone(),
        }
    }
}

/// A transport error's kind, for counting.
fn error_kind(error: &str) -> &'static str {
    let e = error.to_ascii_lowercase();
    if e.contains("timed out") || e.contains("timeout") {
        "timeout"
    } else if e.contains("refused") {
        "refused"
    } else if e.contains("reset") || e.contains("closed") || e.contains("incomplete") {
        "reset"
    } else {
        "error"
    }
}

/// See [`History::summary`].
#[derive(Clone, Debug)]
pub struct HistorySummary {
    pub ops: usize,
    pub retries: usize,
    pub by_outcome: BTreeMap<(Outcome, String), usize>,
    pub nemesis: Vec<NemesisEvent>,
}

impl HistorySummary {
    pub fn count(&self, outcome: Outcome) -> usize {
        self.by_outcome
            .iter()
            .filter(|((o, _), _)| *o == outcome)
            .map(|(_, n)| n)
            .sum()
    }
}

impl fmt::Display for HistorySummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ops ({} retries): ok {}, fail {}, info {} [",
            self.ops,
            self.retries,
            self.count(Outcome::Ok),
            self.count(Outcome::Fail),
            self.count(Outcome::Info)
        )?;
        let parts: Vec<String> = self
            .by_outcome
            .iter()
            .map(|((o, detail), n)| format!("{} {detail}: {n}", o.as_str()))
            .collect();
        write!(f, "{}]", parts.join(", "))?;
        for e in &self.nemesis {
            let phase = match e.phase {
                Phase::Start => "start",
                Phase::Heal => "heal",
            };
            write!(f, "; {} {phase} {}", ms(e.time), e.what)?;
        }
        Ok(())
    }
}

// === the origin's logs ===

/// One resource's stock as the origin kept it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StockRecord {
    /// Units the origin ever had (the initial stock plus any restock).
    pub supplied: u64,
    pub remaining: u64,
    /// Buy requests received (sold, sold out, replayed, faulted: all of them).
    pub buy_requests: u64,
    /// Buy requests answered from the origin's own idempotency record (no new sale).
    pub replays: u64,
}

/// One sale the origin committed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sale {
    pub order: String,
    pub resource: String,
    pub units: u64,
    /// The `Idempotency-Key` the request carried.
    pub idempotency_key: Option<String>,
    /// The `Stock-Reservation` the request carried (the gate's reservation id).
    pub reservation: Option<String>,
    /// When the request arrived, and when the sale was committed.
    pub received: Duration,
    pub committed: Duration,
}

/// The flash-sale origin's log: every resource's stock and every sale.
#[derive(Clone, Debug, Default)]
pub struct SaleLog {
    pub resources: BTreeMap<String, StockRecord>,
    pub sales: Vec<Sale>,
}

impl SaleLog {
    /// Units sold over every resource.
    pub fn sold(&self) -> u64 {
        self.sales.iter().map(|s| s.units).sum()
    }

    pub fn buy_requests(&self) -> u64 {
        self.resources.values().map(|r| r.buy_requests).sum()
    }
}

/// One write as the origin saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteRecord {
    /// Commit order at the origin (the order in which accept-or-refuse was decided).
    pub seq: u64,
    pub resource: String,
    /// The fencing token it carried, if any (and if it parsed as an integer).
    pub token: Option<u64>,
    /// The `Fencing-Key` it carried.
    pub fencing_key: Option<String>,
    /// Arrival at the origin, and the decision (the end of its transaction).
    pub start: Duration,
    pub end: Duration,
    pub status: u16,
    pub accepted: bool,
}

impl fmt::Display for WriteRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let token = self
            .token
            .map_or_else(|| "none".to_string(), |t| t.to_string());
        write!(
            f,
            "write #{} {} token {token} [{} .. {}] {} {}",
            self.seq,
            self.resource,
            ms(self.start),
            ms(self.end),
            self.status,
            if self.accepted { "accepted" } else { "refused" }
        )
    }
}

/// An origin's log of writes (for write serialisation).
#[derive(Clone, Debug, Default)]
pub struct WriteLog {
    pub writes: Vec<WriteRecord>,
}

impl WriteLog {
    /// The writes of each resource, in commit order.
    fn by_resource(&self) -> BTreeMap<&str, Vec<&WriteRecord>> {
        let mut out: BTreeMap<&str, Vec<&WriteRecord>> = BTreeMap::new();
        for w in &self.writes {
            out.entry(w.resource.as_str()).or_default().push(w);
        }
        for writes in out.values_mut() {
            writes.sort_by_key(|w| w.seq);
        }
        out
    }
}

/// Lists at most [`SHOW`] items, one per line, and says how many were left out.
fn list<T: fmt::Display>(f: &mut fmt::Formatter<'_>, items: &[T]) -> fmt::Result {
    for item in items.iter().take(SHOW) {
        writeln!(f, "    {item}")?;
    }
    if items.len() > SHOW {
        writeln!(f, "    … and {} more", items.len() - SHOW)?;
    }
    Ok(())
}

// === stock checkers ===

/// One resource's sales against its stock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceSales {
    pub resource: String,
    pub supplied: u64,
    pub sold: u64,
    pub remaining: u64,
    /// The sales past the supply, in commit order (empty when none).
    pub over: Vec<Sale>,
}

impl ResourceSales {
    pub fn oversold(&self) -> u64 {
        self.sold.saturating_sub(self.supplied)
    }

    /// Whether the origin's own count disagrees with its sales (supplied − sold ≠ remaining).
    pub fn inconsistent(&self) -> bool {
        self.supplied.checked_sub(self.sold) != Some(self.remaining)
    }
}

/// See [`check_oversell`].
#[derive(Clone, Debug)]
pub struct OversellReport {
    pub resources: Vec<ResourceSales>,
}

impl OversellReport {
    /// Units sold past the supply, over every resource.
    pub fn oversold(&self) -> u64 {
        self.resources.iter().map(ResourceSales::oversold).sum()
    }

    pub fn ok(&self) -> bool {
        self.oversold() == 0 && !self.resources.iter().any(ResourceSales::inconsistent)
    }
}

impl fmt::Display for OversellReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let supplied: u64 = self.resources.iter().map(|r| r.supplied).sum();
        let sold: u64 = self.resources.iter().map(|r| r.sold).sum();
        writeln!(
            f,
            "oversell: {} units over {} resources (supplied {supplied}, sold {sold})",
            self.oversold(),
            self.resources.len()
        )?;
        for r in &self.resources {
            if r.oversold() == 0 && !r.inconsistent() {
                continue;
            }
            writeln!(
                f,
                "  {}: supplied {}, sold {}, remaining {}{}",
                r.resource,
                r.supplied,
                r.sold,
                r.remaining,
                if r.inconsistent() {
                    " (the origin's count disagrees with its sales)"
                } else {
                    ""
                }
            )?;
            let over: Vec<String> = r
                .over
                .iter()
                .map(|s| {
                    format!(
                        "order {} key {:?} reservation {:?} committed at {}",
                        s.order,
                        s.idempotency_key,
                        s.reservation,
                        ms(s.committed)
                    )
                })
                .collect();
            list(f, &over)?;
        }
        Ok(())
    }
}

/// **Oversell**: for every resource, units sold ≤ units supplied (and the origin's
/// remaining count agrees with its sales).
pub fn check_oversell(log: &SaleLog) -> OversellReport {
    let mut sales: BTreeMap<&str, Vec<&Sale>> = BTreeMap::new();
    for sale in &log.sales {
        sales.entry(sale.resource.as_str()).or_default().push(sale);
    }
    let mut resources: Vec<ResourceSales> = log
        .resources
        .iter()
        .map(|(resource, record)| {
            let mut mine = sales.remove(resource.as_str()).unwrap_or_default();
            mine.sort_by_key(|s| s.committed);
            let mut running = 0;
            let mut over = Vec::new();
            for sale in &mine {
                running += sale.units;
                if running > record.supplied {
                    over.push((*sale).clone());
                }
            }
            ResourceSales {
                resource: resource.clone(),
                supplied: record.supplied,
                sold: running,
                remaining: record.remaining,
                over,
            }
        })
        .collect();
    // Sales of a resource the origin has no stock record for: all of them are over.
    for (resource, mine) in sales {
        resources.push(ResourceSales {
            resource: resource.to_string(),
            supplied: 0,
            sold: mine.iter().map(|s| s.units).sum(),
            remaining: 0,
            over: mine.into_iter().cloned().collect(),
        });
    }
    OversellReport { resources }
}

/// A client success the origin's log does not back.
#[derive(Clone, Debug)]
pub struct Phantom {
    pub op: Op,
    pub reason: String,
}

impl fmt::Display for Phantom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.op)
    }
}

/// See [`check_phantom`].
#[derive(Clone, Debug)]
pub struct PhantomReport {
    /// Client successes checked.
    pub successes: usize,
    /// … of which replays (`Idempotent-Replayed: true`).
    pub replays: usize,
    pub phantoms: Vec<Phantom>,
}

impl PhantomReport {
    pub fn ok(&self) -> bool {
        self.phantoms.is_empty()
    }
}

impl fmt::Display for PhantomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "phantom: {} of {} client successes ({} replays) have no sale at the origin",
            self.phantoms.len(),
            self.successes,
            self.replays
        )?;
        list(f, &self.phantoms)
    }
}

/// **Phantom**: every client success of `f` (a 2xx) is backed by a sale in the origin's
/// log: the order id of its body (`{"order": "<id>"}`) was sold, for the same resource
/// and (when both carry one) the same idempotency key. A replay (`Idempotent-Replayed:
/// true`) of a key the origin did sell once is backed by that sale.
pub fn check_phantom(history: &History, log: &SaleLog, f: &str) -> PhantomReport {
    let by_order: HashMap<&str, &Sale> = log.sales.iter().map(|s| (s.order.as_str(), s)).collect();
    let by_key: HashMap<&str, &Sale> = log
        .sales
        .iter()
        .filter_map(|s| Some((s.idempotency_key.as_deref()?, s)))
        .collect();
    let mut report = PhantomReport {
        successes: 0,
        replays: 0,
        phantoms: Vec::new(),
    };
    for op in history.ops_of(f).filter(|op| op.outcome() == Outcome::Ok) {
        report.successes += 1;
        let replayed = op.replayed();
        if replayed {
            report.replays += 1;
        }
        let reason = match op.body_str("/order") {
            Some(order) => match by_order.get(order.as_str()) {
                Some(sale) if sale.resource != op.call.resource => Some(format!(
                    "order {order} was sold for {}, not this resource",
                    sale.resource
                )),
                Some(sale)
                    if sale
                        .idempotency_key
                        .as_deref()
                        .is_some_and(|key| key != op.call.value) =>
                {
                    Some(format!(
                        "order {order} was sold to key {:?}, not this one",
                        sale.idempotency_key
                    ))
                }
                Some(_) => None,
                None if replayed && by_key.contains_key(op.call.value.as_str()) => None,
                None => Some(format!("order {order} is not in the origin's sales")),
            },
            None if replayed && by_key.contains_key(op.call.value.as_str()) => None,
            None => Some("a success without an order id, not a replay of a sale".to_string()),
        };
        if let Some(reason) = reason {
            report.phantoms.push(Phantom {
                op: op.clone(),
                reason,
            });
        }
    }
    report
}

/// One resource at the end of a run: units left, and the demand in the final window.
#[derive(Clone, Debug)]
pub struct ResourceDemand {
    pub resource: String,
    pub remaining: u64,
    /// Attempts invoked in the window, and how many of them were told "sold out" (409
    /// without `Retry-After`, from the gate or the origin).
    pub attempts: usize,
    pub refused: usize,
    /// The last attempt in the window told "sold out".
    pub last_refused: Option<Op>,
    /// Attempts in the window that got neither a sale nor "sold out" (a 503 to come back
    /// later, a timeout): unavailability, not an undersell; reported, not judged here.
    pub unavailable: usize,
}

impl ResourceDemand {
    /// Units left at the origin while clients were still told there were none.
    pub fn undersold(&self) -> bool {
        self.remaining > 0 && self.refused > 0
    }
}

/// See [`check_undersell`].
#[derive(Clone, Debug)]
pub struct UndersellReport {
    pub window_start: Duration,
    pub resources: Vec<ResourceDemand>,
}

impl UndersellReport {
    /// Resources with units left while demand was turned away.
    pub fn undersold(&self) -> Vec<&ResourceDemand> {
        self.resources.iter().filter(|r| r.undersold()).collect()
    }

    pub fn ok(&self) -> bool {
        self.undersold().is_empty()
    }
}

impl fmt::Display for UndersellReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bad = self.undersold();
        writeln!(
            f,
            "undersell: {} of {} resources had units left at the origin while buys were \
             turned away after {}",
            bad.len(),
            self.resources.len(),
            ms(self.window_start)
        )?;
        for r in bad {
            writeln!(
                f,
                "  {}: {} left, {} of {} attempts in the window told sold out ({} more \
                 unavailable); last: {}",
                r.resource,
                r.remaining,
                r.refused,
                r.attempts,
                r.unavailable,
                r.last_refused
                    .as_ref()
                    .map_or_else(String::new, ToString::to_string)
            )?;
        }
        Ok(())
    }
}

/// **Undersell**: at the end of the run, a resource the origin still has units of must
/// not have told buyers (`f`) it had none (a 409, the gate's or the origin's) in the final
/// window, which starts after the last fault healed plus the time the system is allowed
/// to recover (e.g. two reconcile intervals); the runner keeps buying through it, so demand
/// remained. An answer to come back later (503, a timeout) is unavailability, counted
/// apart: a resource is undersold when the gate says "sold out", not when Redis is still
/// coming back.
pub fn check_undersell(
    history: &History,
    log: &SaleLog,
    f: &str,
    window_start: Duration,
) -> UndersellReport {
    let resources = log
        .resources
        .iter()
        .map(|(resource, record)| {
            let mut demand = ResourceDemand {
                resource: resource.clone(),
                remaining: record.remaining,
                attempts: 0,
                refused: 0,
                last_refused: None,
                unavailable: 0,
            };
            for op in history
                .ops_of(f)
                .filter(|op| op.call.resource == *resource && op.start >= window_start)
            {
                demand.attempts += 1;
                match (op.outcome(), op.result.status) {
                    (Outcome::Ok, _) => {}
                    // A 409 with `Retry-After` is no "sold out": a retry while the first
                    // request with its key is in flight, or while its outcome is in doubt.
                    (_, Some(409)) if op.header_value("retry-after").is_none() => {
                        demand.refused += 1;
                        demand.last_refused = Some(op.clone());
                    }
                    _ => demand.unavailable += 1,
                }
            }
            demand
        })
        .collect();
    UndersellReport {
        window_start,
        resources,
    }
}

/// See [`check_available`].
#[derive(Clone, Debug)]
pub struct AvailabilityReport {
    /// What the refusals' bodies were matched on.
    pub marker: String,
    /// Operations of `f` that got an answer.
    pub answered: usize,
    /// Those answered 503 with the marker in their body.
    pub unavailable: Vec<Op>,
}

impl AvailabilityReport {
    pub fn ok(&self) -> bool {
        self.unavailable.is_empty()
    }
}

impl fmt::Display for AvailabilityReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "availability: {} of {} answers were 503 \"{}\"",
            self.unavailable.len(),
            self.answered,
            self.marker
        )?;
        list(f, &self.unavailable)
    }
}

/// **Availability**: no operation doing `f` was answered 503 with `marker` in its body (the
/// server's own "cannot decide now", e.g. a stock gate that could not ask its store). For
/// runs with no fault: such an answer turns a buyer away while units are left, and is the
/// server's doing, not the client's nor the origin's.
pub fn check_available(history: &History, f: &str, marker: &str) -> AvailabilityReport {
    let answered = history
        .ops_of(f)
        .filter(|op| op.result.status.is_some())
        .count();
    let unavailable = history
        .ops_of(f)
        .filter(|op| op.result.status == Some(503) && op.result.body.contains(marker))
        .cloned()
        .collect();
    AvailabilityReport {
        marker: marker.to_string(),
        answered,
        unavailable,
    }
}

/// See [`flood_factor`].
#[derive(Clone, Copy, Debug)]
pub struct FloodReport {
    pub buy_requests: u64,
    pub sold: u64,
}

impl FloodReport {
    /// Origin buy requests per unit sold (infinite when requests sold nothing).
    pub fn factor(&self) -> f64 {
        if self.sold == 0 {
            return if self.buy_requests == 0 {
                0.0
            } else {
                f64::INFINITY
            };
        }
        self.buy_requests as f64 / self.sold as f64
    }
}

impl fmt::Display for FloodReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "flood factor {:.3}: {} buy requests reached the origin for {} units sold",
            self.factor(),
            self.buy_requests,
            self.sold
        )
    }
}

/// **Flood factor**: buy requests the origin received ÷ units it sold.
pub fn flood_factor(log: &SaleLog) -> FloodReport {
    FloodReport {
        buy_requests: log.buy_requests(),
        sold: log.sold(),
    }
}

// === write-serialisation checkers ===

/// Two writes to one resource whose intervals at the origin overlap.
#[derive(Clone, Debug)]
pub struct Overlap {
    pub first: WriteRecord,
    pub second: WriteRecord,
}

impl Overlap {
    pub fn both_accepted(&self) -> bool {
        self.first.accepted && self.second.accepted
    }
}

impl fmt::Display for Overlap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}\n      overlaps {}", self.first, self.second)
    }
}

/// See [`check_exclusion`].
#[derive(Clone, Debug)]
pub struct ExclusionReport {
    pub writes: usize,
    pub overlaps: Vec<Overlap>,
}

impl ExclusionReport {
    pub fn ok(&self) -> bool {
        self.overlaps.is_empty()
    }

    /// Overlaps in which the origin accepted both writes (what a fencing origin prevents
    /// from doing harm: with it, one of two overlapping writes is refused or in order).
    pub fn overlaps_accepted(&self) -> usize {
        self.overlaps.iter().filter(|o| o.both_accepted()).count()
    }
}

impl fmt::Display for ExclusionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "exclusion: {} overlapping pairs of writes to one resource at the origin \
             ({} with both accepted), of {} writes",
            self.overlaps.len(),
            self.overlaps_accepted(),
            self.writes
        )?;
        list(f, &self.overlaps)
    }
}

/// **Exclusion**: no two writes to one resource overlap at the origin (intervals
/// `[start, end]`; touching ends do not overlap).
pub fn check_exclusion(log: &WriteLog) -> ExclusionReport {
    let mut overlaps = Vec::new();
    for writes in log.by_resource().into_values() {
        let mut by_start = writes;
        by_start.sort_by_key(|w| (w.start, w.seq));
        // The writes still open at the current one's start: every one of them overlaps it.
        let mut open: Vec<&WriteRecord> = Vec::new();
        for w in by_start {
            open.retain(|o| o.end > w.start);
            for o in &open {
                overlaps.push(Overlap {
                    first: (*o).clone(),
                    second: w.clone(),
                });
            }
            open.push(w);
        }
    }
    ExclusionReport {
        writes: log.writes.len(),
        overlaps,
    }
}

/// See [`check_fencing`].
#[derive(Clone, Debug)]
pub struct FencingReport {
    pub accepted: usize,
    pub refused: usize,
    /// Refused writes whose token was below one accepted before: the stale writes the
    /// nemesis provoked and the origin caught.
    pub stale_refused: usize,
    /// Accepted writes whose token was below one accepted before them (`(before, after)`).
    pub decreases: Vec<(WriteRecord, WriteRecord)>,
    /// Refused writes whose token was not below any accepted before them.
    pub wrongly_refused: Vec<WriteRecord>,
    /// Writes without a (numeric) token.
    pub missing_token: Vec<WriteRecord>,
}

impl FencingReport {
    pub fn ok(&self) -> bool {
        self.decreases.is_empty()
            && self.wrongly_refused.is_empty()
            && self.missing_token.is_empty()
    }
}

impl fmt::Display for FencingReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "fencing: {} accepted, {} refused ({} stale and rightly refused); {} token \
             decreases, {} refused wrongly, {} without a token",
            self.accepted,
            self.refused,
            self.stale_refused,
            self.decreases.len(),
            self.wrongly_refused.len(),
            self.missing_token.len()
        )?;
        let decreases: Vec<String> = self
            .decreases
            .iter()
            .map(|(before, after)| format!("{after}\n      after {before}"))
            .collect();
        list(f, &decreases)?;
        list(f, &self.wrongly_refused)?;
        list(f, &self.missing_token)
    }
}

/// **Fencing**: per resource, in the origin's commit order, the tokens of accepted writes
/// never decrease, and a write is refused exactly when its token is below the highest
/// accepted before it. (Equal tokens are allowed: one holder may write twice.)
pub fn check_fencing(log: &WriteLog) -> FencingReport {
    let mut report = FencingReport {
        accepted: 0,
        refused: 0,
        stale_refused: 0,
        decreases: Vec::new(),
        wrongly_refused: Vec::new(),
        missing_token: Vec::new(),
    };
    for writes in log.by_resource().into_values() {
        let mut highest: Option<&WriteRecord> = None;
        for w in writes {
            if w.accepted {
                report.accepted += 1;
            } else {
                report.refused += 1;
            }
            let Some(token) = w.token else {
                report.missing_token.push(w.clone());
                continue;
            };
            let stale = highest.and_then(|h| h.token).is_some_and(|h| token < h);
            match (w.accepted, stale) {
                (true, true) => {
                    if let Some(h) = highest {
                        report.decreases.push((h.clone(), w.clone()));
                    }
                }
                (true, false) => highest = Some(w),
                (false, true) => report.stale_refused += 1,
                (false, false) => report.wrongly_refused.push(w.clone()),
            }
        }
    }
    report
}

// === the version-floor checker ===

/// A read that returned an older version of its resource than a write that had completed
/// before the read began.
#[derive(Clone, Debug)]
pub struct StaleRead {
    pub write: Op,
    pub read: Op,
    /// The write's version, and the read's.
    pub written: u64,
    pub seen: u64,
}

impl fmt::Display for StaleRead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "read version {} < {}: {}\n      after {}",
            self.seen, self.written, self.read, self.write
        )
    }
}

/// See [`check_version_floor`].
#[derive(Clone, Debug)]
pub struct VersionFloorReport {
    /// Writes that completed `ok`, and reads that completed `ok`, each with a version.
    pub writes: usize,
    pub reads: usize,
    /// `ok` operations whose answer carried no version (the header missing or garbled).
    pub unversioned: Vec<Op>,
    /// Reads older than a write *their own client* had seen complete (read-your-writes).
    pub stale: Vec<StaleRead>,
    /// Reads older than a write *any* client had seen complete before the read began (a
    /// superset of `stale`: what a reader could learn of another's write by other means).
    pub behind_any: Vec<StaleRead>,
}

impl VersionFloorReport {
    /// No stale read, and every `ok` answer carried a version.
    pub fn ok(&self) -> bool {
        self.stale.is_empty() && self.unversioned.is_empty()
    }

    /// The reads of `behind_any` (older than a write any client saw complete before they
    /// began) split in two: those `excused` says are within a stated limit, and the rest.
    pub fn behind_any_split(
        &self,
        excused: impl Fn(&StaleRead) -> bool,
    ) -> (Vec<&StaleRead>, Vec<&StaleRead>) {
        self.behind_any.iter().partition(|stale| excused(stale))
    }
}

impl fmt::Display for VersionFloorReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "version floor: {} stale reads (older than the client's own completed write), \
             {} behind another client's completed write, {} answers without a version; of \
             {} reads after {} writes",
            self.stale.len(),
            self.behind_any.len(),
            self.unversioned.len(),
            self.reads,
            self.writes
        )?;
        list(f, &self.stale)?;
        list(f, &self.behind_any)?;
        list(f, &self.unversioned)
    }
}

/// **Version floor**: with versions that only grow per resource (a row version), no read
/// returns an older version than a write its client saw complete. Writes are the `ok`
/// operations doing `write_f`, reads those doing `read_f`; each answer's version is in its
/// `header` (kept in the history). A write whose outcome is unknown was not seen complete
/// and sets nothing. Also reported: reads older than *any* client's write completed before
/// the read began (`behind_any`).
pub fn check_version_floor(
    history: &History,
    write_f: &str,
    read_f: &str,
    header: &str,
) -> VersionFloorReport {
    let mut report = VersionFloorReport {
        writes: 0,
        reads: 0,
        unversioned: Vec::new(),
        stale: Vec::new(),
        behind_any: Vec::new(),
    };
    let version = |op: &Op| {
        op.header_value(header)
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    // Every completed write per resource, by when it completed.
    let mut completed: BTreeMap<&str, Vec<(Duration, u64, &Op)>> = BTreeMap::new();
    // Per client and resource, the last write it saw complete (its ops run one at a time).
    let mut own: HashMap<(usize, &str), (u64, &Op)> = HashMap::new();
    let mut ops: Vec<&Op> = history.ops.iter().collect();
    ops.sort_by_key(|op| op.index);
    for op in ops {
        if op.outcome() != Outcome::Ok || (op.f() != write_f && op.f() != read_f) {
            continue;
        }
        let Some(v) = version(op) else {
            report.unversioned.push(op.clone());
            continue;
        };
        let key = (op.call.process, op.resource());
        if op.f() == write_f {
            report.writes += 1;
            if let Some(end) = op.end {
                completed
                    .entry(op.resource())
                    .or_default()
                    .push((end, v, op));
            }
            own.insert(key, (v, op));
            continue;
        }
        report.reads += 1;
        if let Some((written, write)) = own.get(&key)
            && v < *written
        {
            report.stale.push(StaleRead {
                write: (*write).clone(),
                read: op.clone(),
                written: *written,
                seen: v,
            });
        }
    }
    for read in history.ops_of(read_f) {
        let Some(seen) = version(read).filter(|_| read.outcome() == Outcome::Ok) else {
            continue;
        };
        let newest = completed
            .get(read.resource())
            .into_iter()
            .flatten()
            .filter(|(end, _, _)| *end < read.start)
            .max_by_key(|(_, v, _)| *v);
        if let Some((_, written, write)) = newest
            && seen < *written
        {
            report.behind_any.push(StaleRead {
                write: (*write).clone(),
                read: read.clone(),
                written: *written,
                seen,
            });
        }
    }
    report
}
