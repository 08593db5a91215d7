//! `loadgen cycle`: open-loop GETs cycling over N keys at a fixed rate, with a timeline (see
//! the crate docs).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::http::{Answer, connect_n, parse_template};
use crate::open_loop::{self, Job, Rec};
use crate::stats::{Counts, fine_summary, ms, pct, round3};
use crate::{CycleArgs, positive};

/// Counts of one timeline bucket (or of the whole run).
#[derive(Default)]
struct CycleTally {
    scheduled: u64,
    counts: Counts,
    latency: Vec<f64>,
}

impl CycleTally {
    fn add(&mut self, r: &Rec) {
        self.counts.add(&r.outcome);
        if let Answer::Response { .. } = r.outcome {
            self.latency
                .push(ms(r.done.saturating_duration_since(r.scheduled)));
        }
    }

    fn json(&mut self, t_s: f64) -> Value {
        self.latency.sort_by(|a, b| a.total_cmp(b));
        let lat = if self.latency.is_empty() {
            Value::Null
        } else {
            json!({
                "p50": pct(&self.latency, 50.0),
                "p99": pct(&self.latency, 99.0),
                "max": round3(self.latency[self.latency.len() - 1]),
            })
        };
        let c = &self.counts;
        json!({
            "t_s": round3(t_s),
            "scheduled": self.scheduled,
            "answered": c.ok + c.non2xx + c.errors,
            "ok": c.ok,
            "non_2xx": c.non2xx,
            "errors": c.errors,
            "timeouts": c.timeouts,
            "status": c.status,
            "x_cache": c.x_cache,
            "latency_ms": lat,
        })
    }
}

pub async fn cycle(args: CycleArgs) -> Result<Value, String> {
    positive(args.rate, "--rate")?;
    positive(args.duration_s, "--duration-s")?;
    if args.connections == 0 || args.keys == 0 || args.bucket_ms == 0 {
        return Err("--connections, --keys and --bucket-ms must be > 0".into());
    }
    // per URL: the target (for the address) and the path template
    let (targets, templates): (Vec<_>, Vec<_>) = args
        .urls
        .iter()
        .map(|url| parse_template(url))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .unzip();
    let u = targets.len() as u64;

    // all connections up before the clock starts
    let mut lanes = Vec::with_capacity(targets.len());
    for target in targets {
        let conns = connect_n(&target, args.connections)
            .await
            .map_err(|e| format!("setting up connections to {}: {e}", target.url))?;
        lanes.push((target, conns));
    }

    let total_n = (args.rate * args.duration_s).ceil() as u64;
    let start = Instant::now() + Duration::from_millis(50);
    let start_unix_ms = (SystemTime::now() + Duration::from_millis(50))
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    // request j goes to URL j mod U and asks for id first_id + (j div U) mod N
    let (first_id, keys) = (args.first_id, args.keys);
    let run = open_loop::run(
        lanes,
        Duration::from_secs_f64(args.timeout_s),
        start,
        args.rate,
        total_n,
        args.drain_s,
        move |j, t| {
            let url = (j % u) as usize;
            let id = first_id + (j / u) % keys;
            let job = Job {
                scheduled: t,
                path: Some(templates[url].replace("{id}", &id.to_string())),
                post_body: None,
                measured: true,
            };
            (url, job)
        },
    )
    .await;

    let recs = run.recs;
    let sent = run.counters.sent.load(Ordering::Relaxed);
    let bucket = Duration::from_millis(args.bucket_ms);
    let n_buckets = ((args.duration_s * 1000.0) / args.bucket_ms as f64)
        .ceil()
        .max(1.0) as usize;
    let mut buckets: Vec<CycleTally> = (0..n_buckets).map(|_| CycleTally::default()).collect();
    // scheduled per bucket, from the schedule itself (whether sent or not)
    for j in 0..total_n {
        let at = Duration::from_secs_f64(j as f64 / args.rate);
        let b = ((at.as_nanos() / bucket.as_nanos()) as usize).min(n_buckets - 1);
        buckets[b].scheduled += 1;
    }
    let mut all = CycleTally {
        scheduled: total_n,
        ..CycleTally::default()
    };
    let mut per_url: Vec<CycleTally> = (0..u).map(|_| CycleTally::default()).collect();
    let mut service = Vec::with_capacity(recs.len());
    let mut lag = Vec::with_capacity(recs.len());
    let (mut first_sent, mut last_done) = (None::<Instant>, start);
    for r in &recs {
        let b = ((r.scheduled.saturating_duration_since(start).as_nanos() / bucket.as_nanos())
            as usize)
            .min(n_buckets - 1);
        buckets[b].add(r);
        all.add(r);
        per_url[r.url].add(r);
        first_sent = Some(first_sent.map_or(r.sent, |f| f.min(r.sent)));
        last_done = last_done.max(r.done);
        lag.push(ms(r.sent.saturating_duration_since(r.scheduled)));
        if let Answer::Response { .. } = r.outcome {
            service.push(ms(r.done.saturating_duration_since(r.sent)));
        }
    }
    let finished = recs.len() as u64;
    let timeline: Vec<Value> = buckets
        .iter_mut()
        .enumerate()
        .map(|(i, b)| b.json(i as f64 * args.bucket_ms as f64 / 1000.0))
        .collect();
    let per_url: Vec<Value> = per_url
        .iter_mut()
        .zip(&args.urls)
        .map(|(t, url)| {
            let mut v = t.json(0.0);
            v["url"] = json!(url);
            v
        })
        .collect();
    let mut totals = all.json(0.0);
    let span = last_done
        .saturating_duration_since(first_sent.unwrap_or(start))
        .as_secs_f64();

    Ok(json!({
        "mode": "cycle",
        "urls": args.urls,
        "first_id": args.first_id,
        "keys": args.keys,
        "rate_rps": args.rate,
        "duration_s": args.duration_s,
        "connections_per_url": args.connections,
        "drain_s": args.drain_s,
        "timeout_s": args.timeout_s,
        "bucket_ms": args.bucket_ms,
        "start_unix_ms": start_unix_ms,
        "scheduled": total_n,
        "sent": sent,
        "ok": totals["ok"].take(),
        "non_2xx": totals["non_2xx"].take(),
        "errors": totals["errors"].take(),
        "timeouts": totals["timeouts"].take(),
        "unsent": total_n.saturating_sub(sent),
        "unfinished": sent.saturating_sub(finished),
        "drained": run.drained,
        "first_send_to_last_answer_s": round3(span),
        "reconnects": run.counters.conn.reconnects.load(Ordering::Relaxed),
        "connect_failures": run.counters.conn.connect_failures.load(Ordering::Relaxed),
        "latency_ms": fine_summary(&mut all.latency),
        "service_time_ms": fine_summary(&mut service),
        "send_lag_ms": fine_summary(&mut lag),
        "x_cache": totals["x_cache"].take(),
        "status": totals["status"].take(),
        "error_samples": all.counts.error_samples,
        "per_url": per_url,
        "timeline": timeline,
    }))
}
