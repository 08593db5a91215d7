//! A small parser for the Prometheus text exposition format (version 0.0.4): enough to
//! check that `/metrics` is well formed and to read sample values.

use std::collections::{BTreeMap, HashMap};

#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

#[derive(Clone, Debug, Default)]
pub struct Exposition {
    /// `# TYPE` per family name.
    pub types: HashMap<String, String>,
    /// `# HELP` per family name.
    pub help: HashMap<String, String>,
    pub samples: Vec<Sample>,
}

impl Exposition {
    /// Samples whose name is `name` exactly.
    pub fn samples_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// True when a family called `name` is declared or has samples (histogram families
    /// count through their `_bucket`/`_sum`/`_count` samples).
    pub fn has_family(&self, name: &str) -> bool {
        self.types.contains_key(name)
            || self
                .samples
                .iter()
                .any(|s| family_of(&s.name, &self.types) == name)
    }

    /// Sum of the values of `name` samples whose labels include every `(k, v)` in `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples_named(name)
            .filter(|s| {
                labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .sum()
    }

    /// The single value of an unlabelled (or uniquely labelled) sample.
    pub fn value(&self, name: &str) -> Option<f64> {
        let mut it = self.samples_named(name);
        let first = it.next()?.value;
        Some(first + it.map(|s| s.value).sum::<f64>())
    }

    /// [`Exposition::value`], 0 when absent.
    pub fn value_or_zero(&self, name: &str) -> f64 {
        self.value(name).unwrap_or(0.0)
    }

    /// `cacheguard_lock_events_total{outcome}`.
    pub fn lock_events(&self, outcome: &str) -> f64 {
        self.sum("cacheguard_lock_events_total", &[("outcome", outcome)])
    }

    /// With `lock.wait_replicas`: (`redis_errors{op="lock"}`, locks `acquired`, locks
    /// `unreplicated`).
    pub fn replicated_locks(&self) -> (f64, f64, f64) {
        (
            self.sum("cacheguard_redis_errors_total", &[("op", "lock")]),
            self.lock_events("acquired"),
            self.lock_events("unreplicated"),
        )
    }
}

/// The family a sample belongs to: strips `_bucket`/`_sum`/`_count` when the base name is a
/// declared histogram or summary.
pub fn family_of<'a>(sample_name: &'a str, types: &HashMap<String, String>) -> &'a str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = sample_name.strip_suffix(suffix)
            && matches!(
                types.get(base).map(String::as_str),
                Some("histogram" | "summary")
            )
        {
            return base;
        }
    }
    sample_name
}

fn valid_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse::<f64>().ok(),
    }
}

/// Parses the whole text; the error names the 1-based line and what was wrong.
pub fn parse(text: &str) -> Result<Exposition, String> {
    let mut out = Exposition::default();
    for (i, line) in text.lines().enumerate() {
        let lineno = i + 1;
        let err = |what: &str| format!("line {lineno}: {what}: {line:?}");
        let line_trimmed = line.trim();
        if line_trimmed.is_empty() {
            continue;
        }
        if let Some(rest) = line_trimmed.strip_prefix('#') {
            let rest = rest.trim_start();
            if let Some(rest) = rest.strip_prefix("HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
                if !valid_metric_name(name) {
                    return Err(err("bad metric name in HELP"));
                }
                out.help.insert(name.to_string(), help.to_string());
            } else if let Some(rest) = rest.strip_prefix("TYPE ") {
                let mut parts = rest.split_whitespace();
                let (Some(name), Some(kind), None) = (parts.next(), parts.next(), parts.next())
                else {
                    return Err(err("TYPE needs a name and a type"));
                };
                if !valid_metric_name(name) {
                    return Err(err("bad metric name in TYPE"));
                }
                if !matches!(
                    kind,
                    "counter" | "gauge" | "histogram" | "summary" | "untyped"
                ) {
                    return Err(err("unknown metric type"));
                }
                if out
                    .types
                    .insert(name.to_string(), kind.to_string())
                    .is_some()
                {
                    return Err(err("duplicate TYPE"));
                }
            }
            // Other comments are allowed and ignored.
            continue;
        }
        out.samples
            .push(parse_sample(line_trimmed).map_err(|e| err(&e))?);
    }
    Ok(out)
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or("sample without value")?;
    let name = &line[..name_end];
    if !valid_metric_name(name) {
        return Err("bad metric name".into());
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        let mut chars = after_brace.char_indices().peekable();
        let end;
        loop {
            // skip spaces and commas between pairs
            while let Some(&(_, c)) = chars.peek() {
                if c == ' ' || c == ',' {
                    chars.next();
                } else {
                    break;
                }
            }
            let Some(&(start, c)) = chars.peek() else {
                return Err("unterminated label set".into());
            };
            if c == '}' {
                end = start + 1;
                break;
            }
            let mut label_name = String::new();
            while let Some(&(_, c)) = chars.peek() {
                if c == '=' {
                    break;
                }
                label_name.push(c);
                chars.next();
            }
            if !valid_label_name(label_name.trim()) {
                return Err(format!("bad label name {label_name:?}"));
            }
            if chars.next().map(|(_, c)| c) != Some('=') {
                return Err("label without '='".into());
            }
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err("label value not quoted".into());
            }
            let mut value = String::new();
            loop {
                match chars.next() {
                    None => return Err("unterminated label value".into()),
                    Some((_, '"')) => break,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, '\\')) => value.push('\\'),
                        Some((_, '"')) => value.push('"'),
                        _ => return Err("bad escape in label value".into()),
                    },
                    Some((_, c)) => value.push(c),
                }
            }
            if labels
                .insert(label_name.trim().to_string(), value)
                .is_some()
            {
                return Err(format!("duplicate label {label_name:?}"));
            }
        }
        rest = &after_brace[end..];
    }
    let mut parts = rest.split_whitespace();
    let value = parts.next().ok_or("sample without value")?;
    let value = parse_value(value).ok_or_else(|| format!("value {value:?} is not a float"))?;
    if let Some(ts) = parts.next() {
        ts.parse::<i64>()
            .map_err(|_| format!("timestamp {ts:?} is not an integer"))?;
    }
    if parts.next().is_some() {
        return Err("trailing garbage".into());
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// Checks a histogram family: `_bucket` samples carry `le`, each series has a `+Inf`
/// bucket equal to its `_count`, and buckets are cumulative.
pub fn check_histogram(exp: &Exposition, family: &str) -> Result<(), String> {
    if exp.types.get(family).map(String::as_str) != Some("histogram") {
        return Err(format!("{family} is not declared as a histogram"));
    }
    let bucket_name = format!("{family}_bucket");
    let count_name = format!("{family}_count");
    let sum_name = format!("{family}_sum");
    let mut series: BTreeMap<BTreeMap<String, String>, Vec<(f64, f64)>> = BTreeMap::new();
    for s in exp.samples_named(&bucket_name) {
        let le = s
            .labels
            .get("le")
            .ok_or_else(|| format!("{bucket_name} sample without le"))?;
        let le = parse_value(le).ok_or_else(|| format!("le {le:?} is not a float"))?;
        let mut key = s.labels.clone();
        key.remove("le");
        series.entry(key).or_default().push((le, s.value));
    }
    if series.is_empty() {
        return Err(format!("{family} has no buckets"));
    }
    for (labels, mut buckets) in series {
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        if buckets.windows(2).any(|w| w[1].1 < w[0].1) {
            return Err(format!("{family}{labels:?}: buckets are not cumulative"));
        }
        let Some(&(le, inf_count)) = buckets.last() else {
            continue;
        };
        if le != f64::INFINITY {
            return Err(format!("{family}{labels:?}: no +Inf bucket"));
        }
        let count = exp
            .samples_named(&count_name)
            .find(|s| s.labels == labels)
            .ok_or_else(|| format!("{family}{labels:?}: no _count"))?;
        if count.value != inf_count {
            return Err(format!(
                "{family}{labels:?}: _count {} != +Inf bucket {inf_count}",
                count.value
            ));
        }
        if !exp.samples_named(&sum_name).any(|s| s.labels == labels) {
            return Err(format!("{family}{labels:?}: no _sum"));
        }
    }
    Ok(())
}
