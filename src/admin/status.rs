//! The status page of the admin listener, for an operator without Grafana: `GET /` (and
//! `GET /status`) is one self-contained HTML page, `GET /status.json` the same numbers as
//! JSON with the sampled history.
//!
//! The page is rendered on the server with every number in it ([`page`]), so it reads with
//! JavaScript off. With JavaScript on, its script fetches `/status.json` every two seconds,
//! redraws the numbers and draws the charts of the last ten minutes from the history the
//! server keeps ([`history`]): a page opened now shows those minutes at once.
//!
//! What it shows, all of it already public on the token-free admin endpoints: per route the
//! request rate, hit ratio and answers by outcome (`cacheguard_requests_total`); origin
//! requests in flight and per second against `upstream.max_concurrency` and `max_rps`; the
//! Redis breaker and topology (`/admin/redis`: addresses only, never credentials); the event
//! bus; each Bloom filter's fill and load state (`/admin/bloom`); the journal's depth; lock
//! waits; the hot keys (`/admin/hotkeys`); the last answers cacheguard made itself, as
//! logged (the [`OwnAnswerLog`](crate::proxy::own_answer::OwnAnswerLog) ring, paths without
//! queries); per stock gate, its decisions, settlements, reconciles and Redis errors
//! (`cacheguard_stock_*`, read through
//! [`Gates::snapshot`](crate::protect::stock::Gates::snapshot)) with a chart of admitted against
//! sold-out buys.
//! Never the admin token, a Redis password, a Bloom source URL or an error's detail.
//!
//! Rates in the tables are over the last [`RATE_WINDOW`]; counts are since start. The
//! sampler is the one background task here: [`Status::run`], owned by the app and stopped by
//! its shutdown token.

mod history;
mod page;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Serialize, Serializer};
use tokio_util::sync::CancellationToken;

use self::history::{Counts, GateCounts, History, Reading, hit_ratio, per_second, total};
use crate::clock;
use crate::coord::RedisConn;
use crate::coord::redis::Topology;
use crate::metrics::{LockEvent, Outcome, StockCounts, StockOutcome, StockSettled};
use crate::protect::bloom::FilterStatus;
use crate::protect::stock::GateSnapshot;
use crate::proxy::PASSTHROUGH;
use crate::proxy::own_answer::RecentAnswer;
use crate::reload::Live;

/// What the tables' rates are measured over.
const RATE_WINDOW: Duration = Duration::from_secs(10);
/// A rate over less than this is noise (the only sample was just taken): not shown.
const MIN_RATE_SPAN_MS: u64 = 1_000;
/// Hot keys listed (the hottest first).
const MAX_HOT_KEYS: usize = 20;

/// The status page's sources and the sampled history.
#[derive(Debug)]
pub(crate) struct Status {
    /// Everything the page reads: the route table and origin guard in effect (both swapped by
    /// reloads, so read anew each time), the metrics, Redis, Bloom filters and hot keys.
    live: Arc<Live>,
    started_ms: u64,
    /// A std `Mutex`: see [`history::run`].
    history: Mutex<History>,
}

impl Status {
    pub(crate) fn new(live: Arc<Live>) -> Self {
        Status {
            live,
            started_ms: clock::now_ms(),
            history: Mutex::new(History::default()),
        }
    }

    /// Samples every two seconds until `stop` (the app's task shutdown).
    pub(crate) async fn run(self: Arc<Self>, stop: CancellationToken) {
        history::run(&self.history, || self.read(), stop).await;
    }

    /// The page, with `nonce` on its `<style>` and `<script>` (the response's
    /// `Content-Security-Policy` allows those two and nothing else inline).
    pub(crate) fn page(&self, nonce: &str) -> String {
        page::render(&self.snapshot(), nonce)
    }

    /// The numbers of the page and the samples taken after `since_ms` (all with 0): the page
    /// asks for what it has not seen yet.
    pub(crate) fn json(&self, since_ms: u64) -> serde_json::Value {
        let snapshot = self.snapshot();
        let history: Vec<serde_json::Value> = {
            let history = self.history.lock().unwrap_or_else(PoisonError::into_inner);
            history.since(since_ms).map(sample_json).collect()
        };
        let mut value = serde_json::to_value(&snapshot).unwrap_or_default();
        if let Some(object) = value.as_object_mut() {
            object.insert("history".to_owned(), history.into());
        }
        value
    }

    /// The counters the history samples, now.
    fn read(&self) -> Reading {
        let proxy = &self.live.proxy;
        let table = proxy.routes.load();
        let mut routes: Vec<(String, Counts)> = table
            .all()
            .map(|r| (r.config.name.clone(), r.metrics.outcome_counts()))
            .collect();
        routes.push((
            PASSTHROUGH.to_owned(),
            proxy.passthrough_metrics.outcome_counts(),
        ));
        let (max_concurrency, max_rps) = proxy.origin.guard.load().caps();
        let metrics = &self.live.metrics;
        Reading {
            routes,
            origin_requests: metrics.origin_requests_total(),
            origin_in_flight: u64::try_from(metrics.origin_in_flight.get()).unwrap_or(0),
            max_concurrency: u64::try_from(max_concurrency).unwrap_or(u64::MAX),
            max_rps: u64::from(max_rps),
            redis_up: self.live.redis.as_ref().map(RedisConn::is_up),
            gates: self
                .live
                .gates
                .snapshot()
                .into_iter()
                .map(|g| (g.name, gate_counts(&g.counts)))
                .collect(),
        }
    }

    /// Everything the page shows, now.
    fn snapshot(&self) -> Snapshot {
        let now = self.read();
        let now_ms = clock::now_ms();
        let reference = self
            .history
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .reference(now_ms, RATE_WINDOW)
            .filter(|r| now_ms.saturating_sub(r.at_ms) >= MIN_RATE_SPAN_MS)
            .cloned();
        let span = reference
            .as_ref()
            .map_or(0, |r| now_ms.saturating_sub(r.at_ms));
        let routes = now
            .routes
            .iter()
            .map(|(name, counts)| {
                let before = reference.as_ref().and_then(|r| r.route(name));
                RouteRow {
                    name: name.clone(),
                    requests_per_second: before
                        .and_then(|b| per_second(total(&b.counts), total(counts), span)),
                    hit_ratio: before.and_then(|b| hit_ratio(&b.counts, counts)),
                    hit_ratio_since_start: hit_ratio(&[0; Outcome::ALL.len()], counts),
                    outcomes: *counts,
                    total: total(counts),
                }
            })
            .collect();
        let origin = OriginRow {
            in_flight: now.origin_in_flight,
            max_concurrency: now.max_concurrency,
            requests_per_second: reference
                .as_ref()
                .and_then(|r| per_second(r.origin_requests, now.origin_requests, span)),
            max_rps: now.max_rps,
            requests_total: now.origin_requests,
        };
        let stock = self
            .live
            .gates
            .snapshot()
            .into_iter()
            .map(|gate| {
                let before = reference.as_ref().and_then(|r| r.gate(&gate.name));
                GateRow::of(gate, before.map(|b| b.counts), span)
            })
            .collect();
        let hot = self.live.hot.status();
        Snapshot {
            now_unix_ms: now_ms,
            started_unix_ms: self.started_ms,
            mode: if self.live.redis.is_some() {
                "shared"
            } else {
                "embedded"
            },
            config_generation: self.live.generation.load(Ordering::Acquire),
            sample_every_ms: millis(history::SAMPLE_EVERY),
            rate_window_ms: millis(RATE_WINDOW),
            routes,
            origin,
            redis: self.redis_row(),
            bloom: self
                .live
                .filters
                .all()
                .iter()
                .map(|f| BloomRow::of(&f.status()))
                .collect(),
            journal: self.journal_row(),
            locks: self.lock_row(),
            hot_keys_total: hot.len(),
            hot_keys: hot
                .into_iter()
                .take(MAX_HOT_KEYS)
                .map(|h| HotRow {
                    key: h.key.as_deref().map_or_else(|| h.hash.clone(), display_key),
                    hash: h.hash,
                    rate: h.rate,
                    since_unix_ms: h.since_unix_ms,
                    promoted_from: h.promoted_from,
                })
                .collect(),
            recent_errors: self.live.proxy.own_answers.recent(),
            stock,
        }
    }

    fn redis_row(&self) -> RedisRow {
        let Some(redis) = &self.live.redis else {
            return RedisRow {
                breaker: "embedded",
                topology_text: "embedded mode: no Redis".to_owned(),
                topology: None,
                event_bus: None,
            };
        };
        let topology = redis.topology();
        RedisRow {
            breaker: if redis.is_up() { "closed" } else { "open" },
            topology_text: topology_text(&topology),
            topology: Some(topology),
            event_bus: Some(if self.live.metrics.bus_subscribed.get() == 1 {
                "subscribed"
            } else {
                "not subscribed"
            }),
        }
    }

    fn journal_row(&self) -> JournalRow {
        let metrics = &self.live.metrics;
        JournalRow {
            enabled: self.live.redis.is_some(),
            depth: u64::try_from(metrics.journal.depth.get()).unwrap_or(0),
            oldest_pending_seconds: metrics.journal.oldest_pending_seconds.get(),
            failing: self.live.proxy.invalidator.journal_failing(),
            held: u64::try_from(metrics.invalidations_held.get()).unwrap_or(0),
        }
    }

    fn lock_row(&self) -> LockRow {
        let metrics = &self.live.metrics;
        LockRow {
            waiting: u64::try_from(metrics.lock_waiters.get()).unwrap_or(0),
            waits: metrics.lock_wait.get_sample_count(),
            wait_seconds: metrics.lock_wait.get_sample_sum(),
            wait_timeouts: metrics.lock_event_count(LockEvent::WaitTimeout),
        }
    }
}

/// What the history keeps of a gate's counters.
fn gate_counts(counts: &StockCounts) -> GateCounts {
    GateCounts {
        admitted: counts.request(StockOutcome::Admitted),
        sold_out: counts.sold_out(),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A cache key as a person reads it: `route \n path \n query \n vary…` on one line, the empty
/// parts left out.
fn display_key(key: &str) -> String {
    key.split('\n')
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// One line for the topology: its mode, primaries (addresses as `/admin/redis` shows them,
/// without credentials) and replicas.
fn topology_text(t: &Topology) -> String {
    let mut text = match (&t.master_name, t.mode) {
        (Some(master), mode) => format!("{mode} {master}: {}", t.primaries.join(", ")),
        (None, "cluster") => format!("cluster: {} primaries", t.primaries.len()),
        (None, "") => "not reached yet".to_owned(),
        (None, mode) => format!("{mode} {}", t.primaries.join(", ")),
    };
    if !t.mode.is_empty() {
        text.push_str(&format!(", {} replicas", t.replicas));
    }
    if let Some(slots) = t.slots_covered {
        text.push_str(&format!(", {slots}/16384 slots"));
    }
    text
}

/// A sample of the history, as the page's script reads it.
fn sample_json(sample: &history::Sample) -> serde_json::Value {
    let routes: serde_json::Map<String, serde_json::Value> = sample
        .routes
        .iter()
        .map(|r| {
            (
                r.name.to_string(),
                serde_json::json!({ "rps": r.rps, "hit_ratio": r.hit_ratio }),
            )
        })
        .collect();
    let gates: serde_json::Map<String, serde_json::Value> = sample
        .gates
        .iter()
        .map(|g| {
            (
                g.name.to_string(),
                serde_json::json!({ "admitted": g.admitted_rps, "sold_out": g.sold_out_rps }),
            )
        })
        .collect();
    serde_json::json!({
        "t": sample.at_ms,
        "routes": routes,
        "gates": gates,
        "origin_rps": sample.origin_rps,
        "origin_in_flight": sample.origin_in_flight,
        "max_concurrency": sample.max_concurrency,
        "max_rps": sample.max_rps,
        "redis_up": sample.redis_up,
    })
}

/// Everything the page shows at one moment (`/status.json` without its history).
#[derive(Debug, Serialize)]
pub(crate) struct Snapshot {
    pub(crate) now_unix_ms: u64,
    pub(crate) started_unix_ms: u64,
    /// `shared` or `embedded`.
    pub(crate) mode: &'static str,
    pub(crate) config_generation: u64,
    pub(crate) sample_every_ms: u64,
    pub(crate) rate_window_ms: u64,
    pub(crate) routes: Vec<RouteRow>,
    pub(crate) origin: OriginRow,
    pub(crate) redis: RedisRow,
    pub(crate) bloom: Vec<BloomRow>,
    pub(crate) journal: JournalRow,
    pub(crate) locks: LockRow,
    /// The hottest [`MAX_HOT_KEYS`].
    pub(crate) hot_keys: Vec<HotRow>,
    pub(crate) hot_keys_total: usize,
    /// Newest first.
    pub(crate) recent_errors: Vec<RecentAnswer>,
    /// The stock gates, by name.
    pub(crate) stock: Vec<GateRow>,
}

#[derive(Debug, Serialize)]
pub(crate) struct RouteRow {
    pub(crate) name: String,
    /// Over the last [`RATE_WINDOW`].
    pub(crate) requests_per_second: Option<f64>,
    /// Over the last [`RATE_WINDOW`] (see `history` for the definition).
    pub(crate) hit_ratio: Option<f64>,
    pub(crate) hit_ratio_since_start: Option<f64>,
    /// Since start, by outcome label.
    #[serde(serialize_with = "by_outcome")]
    pub(crate) outcomes: Counts,
    pub(crate) total: u64,
}

/// Counts as `{"hit_l1": …, "hit_l2": …, …}`.
fn by_outcome<S: Serializer>(counts: &Counts, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_map(
        Outcome::ALL
            .iter()
            .map(|o| (o.as_str(), counts[*o as usize])),
    )
}

/// One stock gate: its counters since start (`cacheguard_stock_*` of this instance) and its
/// rates over the last [`RATE_WINDOW`].
#[derive(Debug, Serialize)]
pub(crate) struct GateRow {
    pub(crate) name: String,
    pub(crate) admitted_per_second: Option<f64>,
    /// Sold-out answers, here and from Redis.
    pub(crate) sold_out_per_second: Option<f64>,
    /// Buys by what the gate decided (`cacheguard_stock_requests_total`'s outcomes).
    #[serde(serialize_with = "by_decision")]
    pub(crate) decisions: [u64; StockOutcome::ALL.len()],
    /// Admitted buys by what the origin's answer meant (`cacheguard_stock_settled_total`).
    #[serde(serialize_with = "by_settlement")]
    pub(crate) settled: [u64; StockSettled::ALL.len()],
    pub(crate) reconciles: u64,
    pub(crate) reconciles_failed: u64,
    /// The last reconcile's change to the gate's count: positive when the origin had more
    /// than the gate thought.
    pub(crate) reconcile_delta: i64,
    pub(crate) redis_errors: u64,
}

impl GateRow {
    /// The row of `gate`, with rates against its counts `before` (taken `span_ms` ago).
    fn of(gate: GateSnapshot, before: Option<GateCounts>, span_ms: u64) -> Self {
        let counts = &gate.counts;
        let now = gate_counts(counts);
        GateRow {
            admitted_per_second: before.and_then(|b| per_second(b.admitted, now.admitted, span_ms)),
            sold_out_per_second: before.and_then(|b| per_second(b.sold_out, now.sold_out, span_ms)),
            decisions: counts.requests,
            settled: counts.settled,
            reconciles: counts.reconciles_ok + counts.reconciles_failed,
            reconciles_failed: counts.reconciles_failed,
            reconcile_delta: counts.last_delta,
            redis_errors: counts.redis_errors,
            name: gate.name,
        }
    }

    pub(crate) fn decision(&self, outcome: StockOutcome) -> u64 {
        self.decisions[outcome as usize]
    }

    pub(crate) fn settlement(&self, result: StockSettled) -> u64 {
        self.settled[result as usize]
    }
}

/// Decisions as `{"admitted": …, "sold_out_local": …, …}`.
fn by_decision<S: Serializer>(
    counts: &[u64; StockOutcome::ALL.len()],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(
        StockOutcome::ALL
            .iter()
            .map(|o| (o.as_str(), counts[*o as usize])),
    )
}

/// Settlements as `{"sold": …, "returned": …, …}`.
fn by_settlement<S: Serializer>(
    counts: &[u64; StockSettled::ALL.len()],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(
        StockSettled::ALL
            .iter()
            .map(|r| (r.as_str(), counts[*r as usize])),
    )
}

#[derive(Debug, Serialize)]
pub(crate) struct OriginRow {
    pub(crate) in_flight: u64,
    pub(crate) max_concurrency: u64,
    /// Over the last [`RATE_WINDOW`].
    pub(crate) requests_per_second: Option<f64>,
    /// 0: no rate cap.
    pub(crate) max_rps: u64,
    pub(crate) requests_total: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct RedisRow {
    /// `closed` (Redis in the request path), `open`, or `embedded`.
    pub(crate) breaker: &'static str,
    pub(crate) topology_text: String,
    /// As `/admin/redis` shows it; `None` in embedded mode.
    pub(crate) topology: Option<Topology>,
    /// `subscribed` or `not subscribed`; `None` in embedded mode.
    pub(crate) event_bus: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub(crate) struct BloomRow {
    pub(crate) name: String,
    /// `ready`, `ready, reloading`, `loading`, or `not loaded` (it then rejects nothing).
    pub(crate) state: &'static str,
    pub(crate) items: u64,
    pub(crate) expected_items: u64,
    /// `items / expected_items`: past 1 the false-positive rate climbs above the configured.
    pub(crate) fill: f64,
    pub(crate) estimated_fp_rate: f64,
    pub(crate) configured_fp_rate: f64,
}

impl BloomRow {
    fn of(status: &FilterStatus) -> Self {
        let expected = u64::try_from(status.expected_items).unwrap_or(u64::MAX);
        BloomRow {
            name: status.name.clone(),
            state: match (status.ready, status.loading) {
                (true, false) => "ready",
                (true, true) => "ready, reloading",
                (false, true) => "loading",
                (false, false) => "not loaded",
            },
            items: status.items,
            expected_items: expected,
            fill: status.items as f64 / expected.max(1) as f64,
            estimated_fp_rate: status.estimated_fp_rate,
            configured_fp_rate: status.configured_fp_rate,
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct JournalRow {
    /// Shared mode only: in embedded mode nothing is owed to anyone.
    pub(crate) enabled: bool,
    /// Invalidations owed to Redis, waiting in the journal.
    pub(crate) depth: u64,
    pub(crate) oldest_pending_seconds: f64,
    /// The journal cannot be written; `held` invalidations wait in memory.
    pub(crate) failing: bool,
    pub(crate) held: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct LockRow {
    /// Requests waiting on another instance's fetch now.
    pub(crate) waiting: u64,
    /// Waits so far, and their time in seconds.
    pub(crate) waits: u64,
    pub(crate) wait_seconds: f64,
    pub(crate) wait_timeouts: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct HotRow {
    /// The cache key on one line (client-chosen: escaped wherever shown), or its hash when
    /// this instance has not served it itself.
    pub(crate) key: String,
    pub(crate) hash: String,
    pub(crate) rate: f64,
    pub(crate) since_unix_ms: u64,
    pub(crate) promoted_from: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_shown_on_one_line() {
        assert_eq!(display_key("item\n/api/items/7\n\n"), "item /api/items/7");
        assert_eq!(
            display_key("item\n/api/items/7\nlang=en\nx-tag=a"),
            "item /api/items/7 lang=en x-tag=a"
        );
    }

    #[test]
    fn topology_lines() {
        let standalone = Topology {
            mode: "standalone",
            primaries: vec!["127.0.0.1:6379".to_owned()],
            replicas: 1,
            ..Topology::default()
        };
        assert_eq!(
            topology_text(&standalone),
            "standalone 127.0.0.1:6379, 1 replicas"
        );
        let cluster = Topology {
            mode: "cluster",
            primaries: vec!["a:1".to_owned(), "b:2".to_owned(), "c:3".to_owned()],
            replicas: 3,
            slots_covered: Some(16384),
            master_name: None,
        };
        assert_eq!(
            topology_text(&cluster),
            "cluster: 3 primaries, 3 replicas, 16384/16384 slots"
        );
        assert_eq!(topology_text(&Topology::default()), "not reached yet");
    }
}
