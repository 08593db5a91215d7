//! The per-request metrics, with one copy per proxy worker, added up at scrape time.
//!
//! Every answered request bumps its route's outcome counter
//! (`cacheguard_requests_total`), its Redis-command counter
//! (`cacheguard_request_redis_commands_total`) and its duration histogram
//! (`cacheguard_request_duration_seconds`). Shared by every worker, each bump is an atomic
//! add on a cache line the other cores write too, so at tens of thousands of answers a
//! second the line moves between cores on nearly every request. Here each proxy worker
//! (see [`crate::worker`]) bumps copies of its own, which no other thread writes, and every
//! other thread (background work, a host program's runtime) shares one more copy. A scrape
//! adds the copies up ([`Collector::collect`]): the exposition is the same three families,
//! one series per route (and outcome), as if there were one copy.
//!
//! Hand-written: the `prometheus` crate's thread-local metrics (`prometheus::local`) are
//! folded in only by their own thread, which a scrape cannot ask of a busy worker in time;
//! a [`Collector`] is the crate's extension point for metrics kept elsewhere.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use prometheus::core::{Collector, Desc, Metric as _};
use prometheus::proto::{self, MetricFamily, MetricType};
use prometheus::{Histogram, HistogramOpts};

use super::{COMMANDS, COMMANDS_HELP, DURATION, DURATION_HELP, Outcome, REQUESTS, REQUESTS_HELP};

/// One thread's copy of a route's request metrics, on cache lines of its own.
#[repr(align(128))]
struct Copy {
    outcomes: [AtomicU64; Outcome::ALL.len()],
    commands: [AtomicU64; Outcome::ALL.len()],
    duration: Histogram,
}

/// A route's request metrics: one [`Copy`] for threads that are no proxy worker (index 0),
/// then one per worker.
pub(crate) struct RouteCopies {
    copies: Box<[Copy]>,
}

impl std::fmt::Debug for RouteCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteCopies")
            .field("copies", &self.copies.len())
            .finish_non_exhaustive()
    }
}

impl RouteCopies {
    fn new(workers: usize, buckets: &[f64]) -> RouteCopies {
        let copies = (0..=workers)
            .map(|_| Copy {
                outcomes: std::array::from_fn(|_| AtomicU64::new(0)),
                commands: std::array::from_fn(|_| AtomicU64::new(0)),
                duration: Histogram::with_opts(
                    HistogramOpts::new(DURATION, DURATION_HELP).buckets(buckets.to_vec()),
                )
                // The name, help and buckets are ours and valid (checked by a test).
                .unwrap_or_else(|_| unreachable!("valid histogram options")),
            })
            .collect();
        RouteCopies { copies }
    }

    /// This thread's copy: its worker's own, or the shared one (a thread that is no proxy
    /// worker, or a worker past the count the copies were made for).
    fn here(&self) -> &Copy {
        let index = crate::worker::index();
        self.copies.get(index).unwrap_or(&self.copies[0])
    }

    /// Records one answered request and the Redis commands it cost.
    pub(crate) fn answered(&self, outcome: Outcome, seconds: f64) {
        let copy = self.here();
        copy.outcomes[outcome.index()].fetch_add(1, Ordering::Relaxed);
        copy.duration.observe(seconds);
    }

    /// Records the Redis commands one answered request cost.
    pub(crate) fn commands(&self, outcome: Outcome, commands: u32) {
        if commands > 0 {
            self.here().commands[outcome.index()].fetch_add(u64::from(commands), Ordering::Relaxed);
        }
    }

    /// Answers so far, by outcome, in [`Outcome::ALL`] order, over every copy.
    pub(crate) fn outcome_counts(&self) -> [u64; Outcome::ALL.len()] {
        self.sum(|copy| &copy.outcomes)
    }

    fn sum(
        &self,
        field: impl Fn(&Copy) -> &[AtomicU64; Outcome::ALL.len()],
    ) -> [u64; Outcome::ALL.len()] {
        let mut sum = [0u64; Outcome::ALL.len()];
        for copy in &self.copies {
            for (total, count) in sum.iter_mut().zip(field(copy)) {
                *total = total.wrapping_add(count.load(Ordering::Relaxed));
            }
        }
        sum
    }

    /// The duration histogram over every copy: bucket counts, count and sum added up.
    fn duration(&self) -> proto::Histogram {
        let mut total = proto::Histogram::default();
        let mut buckets: Vec<proto::Bucket> = Vec::new();
        let (mut count, mut sum) = (0u64, 0f64);
        for copy in &self.copies {
            let metric = copy.duration.metric();
            let histogram = metric.get_histogram();
            count += histogram.get_sample_count();
            sum += histogram.get_sample_sum();
            for (i, bucket) in histogram.get_bucket().iter().enumerate() {
                match buckets.get_mut(i) {
                    Some(b) => {
                        b.set_cumulative_count(b.cumulative_count() + bucket.cumulative_count())
                    }
                    None => buckets.push(bucket.clone()),
                }
            }
        }
        total.set_sample_count(count);
        total.set_sample_sum(sum);
        total.set_bucket(buckets);
        total
    }
}

/// The three request families, collected from every route's copies.
pub(crate) struct RequestMetrics {
    descs: [Desc; 3],
    buckets: Vec<f64>,
    /// How many proxy workers copies are made for (set once they are known).
    workers: AtomicUsize,
    routes: Mutex<BTreeMap<String, Arc<RouteCopies>>>,
}

impl std::fmt::Debug for RequestMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestMetrics")
            .field("workers", &self.workers)
            .finish_non_exhaustive()
    }
}

impl RequestMetrics {
    pub(crate) fn new(buckets: Vec<f64>) -> prometheus::Result<RequestMetrics> {
        let labels = |names: &[&str]| names.iter().map(|n| (*n).to_owned()).collect();
        Ok(RequestMetrics {
            descs: [
                Desc::new(
                    REQUESTS.into(),
                    REQUESTS_HELP.into(),
                    labels(&["route", "outcome"]),
                    Default::default(),
                )?,
                Desc::new(
                    COMMANDS.into(),
                    COMMANDS_HELP.into(),
                    labels(&["route", "outcome"]),
                    Default::default(),
                )?,
                Desc::new(
                    DURATION.into(),
                    DURATION_HELP.into(),
                    labels(&["route"]),
                    Default::default(),
                )?,
            ],
            buckets,
            workers: AtomicUsize::new(0),
            routes: Mutex::new(BTreeMap::new()),
        })
    }

    /// Makes routes' copies for `workers` proxy workers from now on.
    pub(crate) fn set_workers(&self, workers: usize) {
        self.workers.store(workers, Ordering::Relaxed);
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<RouteCopies>>> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `route`'s copies: those it had (a reload keeps its counts), or new ones at 0.
    pub(crate) fn route(&self, route: &str) -> Arc<RouteCopies> {
        let mut routes = self.routes();
        let workers = self.workers.load(Ordering::Relaxed);
        match routes.get(route) {
            Some(copies) if copies.copies.len() == workers + 1 => Arc::clone(copies),
            _ => {
                let copies = Arc::new(RouteCopies::new(workers, &self.buckets));
                routes.insert(route.to_owned(), Arc::clone(&copies));
                copies
            }
        }
    }

    /// Stops exposing `route` (retired by a reload).
    pub(crate) fn forget(&self, route: &str) {
        self.routes().remove(route);
    }
}

/// What the registry holds (it takes its collectors boxed): the metrics' handle.
pub(crate) struct Registered(pub(crate) Arc<RequestMetrics>);

impl Collector for Registered {
    fn desc(&self) -> Vec<&Desc> {
        self.0.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.0.collect()
    }
}

fn label(name: &str, value: &str) -> proto::LabelPair {
    let mut pair = proto::LabelPair::default();
    pair.set_name(name.to_owned());
    pair.set_value(value.to_owned());
    pair
}

fn family(desc: &Desc, kind: MetricType, metrics: Vec<proto::Metric>) -> MetricFamily {
    let mut family = MetricFamily::default();
    family.set_name(desc.fq_name.clone());
    family.set_help(desc.help.clone());
    family.set_field_type(kind);
    family.set_metric(metrics);
    family
}

impl Collector for RequestMetrics {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let routes: Vec<(String, Arc<RouteCopies>)> = self
            .routes()
            .iter()
            .map(|(name, copies)| (name.clone(), Arc::clone(copies)))
            .collect();
        let (mut requests, mut commands, mut durations) = (Vec::new(), Vec::new(), Vec::new());
        for (route, copies) in &routes {
            let counters = [
                (&mut requests, copies.sum(|c| &c.outcomes)),
                (&mut commands, copies.sum(|c| &c.commands)),
            ];
            for (metrics, sums) in counters {
                for (outcome, value) in Outcome::ALL.iter().zip(sums) {
                    let mut counter = proto::Counter::default();
                    // Exposed as a float, as every counter is.
                    #[allow(clippy::cast_precision_loss)]
                    counter.set_value(value as f64);
                    let mut metric = proto::Metric::from_label(vec![
                        label("outcome", outcome.as_str()),
                        label("route", route),
                    ]);
                    metric.set_counter(counter);
                    metrics.push(metric);
                }
            }
            let mut metric = proto::Metric::from_label(vec![label("route", route)]);
            metric.set_histogram(copies.duration());
            durations.push(metric);
        }
        vec![
            family(&self.descs[0], MetricType::COUNTER, requests),
            family(&self.descs[1], MetricType::COUNTER, commands),
            family(&self.descs[2], MetricType::HISTOGRAM, durations),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copies_of_every_thread_add_up_in_one_series_per_route_and_outcome() {
        let metrics = Arc::new(RequestMetrics::new(vec![0.001, 0.01, 0.1]).unwrap());
        metrics.set_workers(2);
        let route = metrics.route("items");
        route.answered(Outcome::HitL1, 0.0005);
        route.commands(Outcome::HitL1, 0);
        let threads: Vec<_> = (0..2)
            .map(|worker| {
                let route = Arc::clone(&route);
                std::thread::spawn(move || {
                    crate::worker::set_index(worker);
                    for _ in 0..10 {
                        route.answered(Outcome::HitL2, 0.005);
                        route.commands(Outcome::HitL2, 1);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        // Three copies were written: the shared one and each worker's.
        let written = route
            .copies
            .iter()
            .filter(|c| c.outcomes.iter().any(|o| o.load(Ordering::Relaxed) > 0))
            .count();
        assert_eq!(written, 3);

        let registry = prometheus::Registry::new();
        registry
            .register(Box::new(Registered(Arc::clone(&metrics))))
            .unwrap();
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap();
        for line in [
            r#"cacheguard_requests_total{outcome="hit_l1",route="items"} 1"#,
            r#"cacheguard_requests_total{outcome="hit_l2",route="items"} 20"#,
            r#"cacheguard_request_redis_commands_total{outcome="hit_l2",route="items"} 20"#,
            r#"cacheguard_request_redis_commands_total{outcome="hit_l1",route="items"} 0"#,
            r#"cacheguard_request_duration_seconds_bucket{route="items",le="0.001"} 1"#,
            r#"cacheguard_request_duration_seconds_bucket{route="items",le="0.01"} 21"#,
            r#"cacheguard_request_duration_seconds_count{route="items"} 21"#,
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        assert_eq!(route.outcome_counts()[Outcome::HitL2.index()], 20);

        // A reload keeps the counts; a retired route leaves the exposition.
        assert!(Arc::ptr_eq(&metrics.route("items"), &route));
        metrics.forget("items");
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap();
        assert!(!text.contains("route=\"items\""), "{text}");
    }
}
