//! Figures: percentiles, summaries and the answer counts every mode reports.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::http::Answer;

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub fn round3(v: f64) -> Value {
    json!((v * 1000.0).round() / 1000.0)
}

/// Nearest-rank percentile of sorted values.
pub fn pct(sorted: &[f64], p: f64) -> Value {
    if sorted.is_empty() {
        return Value::Null;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    round3(sorted[rank.min(sorted.len()) - 1])
}

/// n, min, the percentiles `ps` (name, p), max and mean of a sample (sorted here).
fn summary_with(values: &mut [f64], ps: &[(&str, f64)]) -> Value {
    values.sort_by(|a, b| a.total_cmp(b));
    if values.is_empty() {
        return json!({"n": 0});
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let mut m = Map::new();
    m.insert("n".into(), json!(values.len()));
    m.insert("min".into(), round3(values[0]));
    for &(name, p) in ps {
        m.insert(name.into(), pct(values, p));
    }
    m.insert("max".into(), round3(values[values.len() - 1]));
    m.insert("mean".into(), round3(mean));
    Value::Object(m)
}

/// n, min, p50, p90, p99, max and mean of a sample.
pub fn summary(values: &mut [f64]) -> Value {
    summary_with(values, &[("p50", 50.0), ("p90", 90.0), ("p99", 99.0)])
}

/// Exact percentiles (nearest rank) of a sample: `summary` and p99.9.
pub fn fine_summary(values: &mut [f64]) -> Value {
    summary_with(
        values,
        &[("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99_9", 99.9)],
    )
}

/// `n` per second over `secs`, with one decimal (0 for an empty span).
pub fn per_second(n: u64, secs: f64) -> f64 {
    let r = if secs > 0.0 { n as f64 / secs } else { 0.0 };
    (r * 10.0).round() / 10.0
}

/// Adds one to the count of `key`.
pub fn bump(counts: &mut BTreeMap<String, u64>, key: &str) {
    *counts.entry(key.to_owned()).or_default() += 1;
}

/// Answers by kind: 2xx, other statuses, errors (timeouts included), and the histograms.
#[derive(Default)]
pub struct Counts {
    pub ok: u64,
    pub non2xx: u64,
    pub errors: u64,
    pub timeouts: u64,
    pub x_cache: BTreeMap<String, u64>,
    pub status: BTreeMap<String, u64>,
    pub body_bytes: BTreeMap<String, u64>,
    pub error_samples: BTreeMap<String, u64>,
}

impl Counts {
    pub fn response(&mut self, status: u16, x_cache: &str, body_len: usize) {
        bump(&mut self.x_cache, x_cache);
        bump(&mut self.status, &status.to_string());
        bump(&mut self.body_bytes, &body_len.to_string());
        if (200..300).contains(&status) {
            self.ok += 1;
        } else {
            self.non2xx += 1;
        }
    }

    pub fn error(&mut self, msg: &str) {
        self.errors += 1;
        bump(&mut self.error_samples, msg);
    }

    pub fn timeout(&mut self) {
        self.timeouts += 1;
        self.error("timeout");
    }

    /// Answers with a status (2xx or not).
    pub fn responses(&self) -> u64 {
        self.ok + self.non2xx
    }

    pub fn add(&mut self, a: &Answer) {
        match a {
            Answer::Response {
                status,
                x_cache,
                body_len,
            } => self.response(*status, x_cache, *body_len),
            Answer::Error(e) => self.error(e),
            Answer::Timeout => self.timeout(),
        }
    }

    /// Writes the counts into the JSON object `out`: ok, non_2xx, errors, timeouts, x_cache,
    /// status, body_bytes and error_samples.
    pub fn report(&self, out: &mut Value) {
        let fields = [
            ("ok", json!(self.ok)),
            ("non_2xx", json!(self.non2xx)),
            ("errors", json!(self.errors)),
            ("timeouts", json!(self.timeouts)),
            ("x_cache", json!(self.x_cache)),
            ("status", json!(self.status)),
            ("body_bytes", json!(self.body_bytes)),
            ("error_samples", json!(self.error_samples)),
        ];
        for (k, v) in fields {
            out[k] = v;
        }
    }
}
