//! `loadgen rate`: open-loop GETs (or POSTs of a JSON body) of one URL at a fixed rate (see the
//! crate docs).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::http::{Answer, connect_n, json_body, parse_target};
use crate::open_loop::{self, Job};
use crate::stats::{Counts, fine_summary, ms, per_second, round3};
use crate::{RateArgs, positive};

pub async fn rate(args: RateArgs) -> Result<Value, String> {
    positive(args.rate, "--rate")?;
    positive(args.duration_s, "--duration-s")?;
    if !(args.warmup_s.is_finite() && args.warmup_s >= 0.0) {
        return Err("--warmup-s must be >= 0".into());
    }
    if args.connections == 0 {
        return Err("--connections must be > 0".into());
    }
    let target = parse_target(&args.url)?;
    let post_body = args.post_bytes.map(json_body).transpose()?;

    // all connections up before the clock starts
    let conns = connect_n(&target, args.connections)
        .await
        .map_err(|e| format!("setting up connections: {e}"))?;

    let warmup_n = (args.rate * args.warmup_s).ceil() as u64;
    let total_n = (args.rate * (args.warmup_s + args.duration_s)).ceil() as u64;
    let measured_n = total_n - warmup_n;

    let start = Instant::now() + Duration::from_millis(50);
    let measure_start = start + Duration::from_secs_f64(warmup_n as f64 / args.rate);
    // the first W seconds are warm-up: sent at the same rate, left out of every figure
    let run = open_loop::run(
        vec![(target, conns)],
        Duration::from_secs_f64(args.timeout_s),
        start,
        args.rate,
        total_n,
        args.drain_s,
        move |i, t| {
            let job = Job {
                scheduled: t,
                path: None,
                post_body: post_body.clone(),
                measured: i >= warmup_n,
            };
            (0, job)
        },
    )
    .await;

    let c = &run.counters;
    let sent = c.sent.load(Ordering::Relaxed);
    let mut counts = Counts::default();
    let mut lat = Vec::with_capacity(run.recs.len());
    let mut service = Vec::with_capacity(run.recs.len());
    let mut lag = Vec::with_capacity(run.recs.len());
    let mut last_done = measure_start;
    for r in &run.recs {
        lag.push(ms(r.sent.saturating_duration_since(r.scheduled)));
        counts.add(&r.outcome);
        if let Answer::Response { .. } = r.outcome {
            lat.push(ms(r.done.saturating_duration_since(r.scheduled)));
            service.push(ms(r.done.saturating_duration_since(r.sent)));
            last_done = last_done.max(r.done);
        }
    }
    let finished = run.recs.len() as u64;
    let window = last_done
        .saturating_duration_since(measure_start)
        .as_secs_f64();

    let mut out = json!({
        "mode": "rate",
        "url": args.url,
        "method": if args.post_bytes.is_some() { "POST" } else { "GET" },
        "post_bytes": args.post_bytes,
        "rate_rps": args.rate,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "connections": args.connections,
        "drain_s": args.drain_s,
        "timeout_s": args.timeout_s,
        "scheduled": measured_n,
        "sent": sent,
        "unsent": measured_n.saturating_sub(sent),
        "unfinished": sent.saturating_sub(finished),
        "drained": run.drained,
        "achieved_rate_rps": per_second(counts.responses(), window),
        "measured_window_s": round3(window),
        "elapsed_s": round3(run.end.saturating_duration_since(start).as_secs_f64()),
        "warmup_scheduled": warmup_n,
        "warmup_sent": c.warmup_sent.load(Ordering::Relaxed),
        "warmup_ok": c.warmup_ok.load(Ordering::Relaxed),
        "reconnects": c.conn.reconnects.load(Ordering::Relaxed),
        "connect_failures": c.conn.connect_failures.load(Ordering::Relaxed),
        "latency_ms": fine_summary(&mut lat),
        "service_time_ms": fine_summary(&mut service),
        "send_lag_ms": fine_summary(&mut lag),
    });
    counts.report(&mut out);
    Ok(out)
}
