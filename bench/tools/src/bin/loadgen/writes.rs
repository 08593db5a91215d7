//! `loadgen writes`: closed-loop writes (`--method`, PUT by default) over one or more instances, for the serialized-writes
//! bench (bench/serialize.sh).
//!
//! 1. Opens `--connections` keep-alive connections per URL (all must connect, or it fails).
//! 2. Every connection loops: takes the next number j of one shared counter, writes key
//!    `<key-prefix>(j mod keys)` and reads the whole answer, then takes the next. With
//!    `--keys 1` every write is to one resource; with many keys, the writes in flight at
//!    once are to different resources (j runs ahead by one per write).
//! 3. The first `--warmup-s` seconds are sent the same way and left out of every figure;
//!    then the loops run `--duration-s` more seconds (a write still in flight at the end is
//!    waited for, up to `--timeout-s`, and counted).
//! 4. Prints one JSON object: the measured writes, their rate (`ok_per_s`: 2xx answers per
//!    second of the measured window), statuses, errors, the latency (send to end of body) of
//!    every measured write, of the 2xx and of the 503 answers, and the longest of each.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::WritesArgs;
use crate::http::{Sender, Target, connect_n, fetch, parse_targets, write};
use crate::stats::{Counts, fine_summary, ms, per_second};

/// What one measured write came to.
struct Sample {
    latency_ms: f64,
    status: Option<u16>,
    error: Option<String>,
}

pub async fn writes(args: WritesArgs) -> Result<Value, String> {
    if args.keys == 0 || args.connections == 0 {
        return Err("--keys and --connections must be positive".into());
    }
    if !["PUT", "PATCH", "DELETE", "POST"].contains(&args.method.as_str()) {
        return Err(format!(
            "--method must be PUT, PATCH, DELETE or POST, got {}",
            args.method
        ));
    }
    let targets = parse_targets(&args.urls)?;
    let timeout = Duration::from_secs_f64(args.timeout_s);
    let counter = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(args.warmup_s);
    let stop_at = measure_from + Duration::from_secs_f64(args.duration_s);
    let mut loops = Vec::new();
    for target in targets {
        let target = Arc::new(target);
        for sender in connect_n(&target, args.connections).await? {
            let (target, counter, args) = (Arc::clone(&target), Arc::clone(&counter), args.clone());
            loops.push(tokio::spawn(async move {
                write_loop(
                    sender,
                    &target,
                    &counter,
                    &args,
                    timeout,
                    measure_from,
                    stop_at,
                )
                .await
            }));
        }
    }
    let mut samples = Vec::new();
    for handle in loops {
        samples.extend(
            handle
                .await
                .map_err(|e| format!("a write loop failed: {e}"))?,
        );
    }
    let window = args.duration_s;
    let mut counts = Counts::default();
    let (mut all, mut ok, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    for s in &samples {
        all.push(s.latency_ms);
        match (s.status, &s.error) {
            (Some(status), _) => {
                counts.response(status, "", 0);
                if (200..300).contains(&status) {
                    ok.push(s.latency_ms);
                } else if status == 503 {
                    refused.push(s.latency_ms);
                }
            }
            (None, Some(e)) => counts.error(e),
            (None, None) => counts.timeout(),
        }
    }
    let ok_n = ok.len() as u64;
    let mut out = json!({
        "mode": "writes",
        "method": args.method,
        "urls": args.urls,
        "connections_per_url": args.connections,
        "keys": args.keys,
        "warmup_s": args.warmup_s,
        "duration_s": window,
        "writes": samples.len(),
        "ok_per_s": per_second(ok_n, window),
        "latency_ms": fine_summary(&mut all),
        "ok_latency_ms": fine_summary(&mut ok),
        "status_503_latency_ms": fine_summary(&mut refused),
    });
    counts.report(&mut out);
    Ok(out)
}

async fn write_loop(
    mut sender: Sender,
    target: &Target,
    counter: &AtomicU64,
    args: &crate::WritesArgs,
    timeout: Duration,
    measure_from: Instant,
    stop_at: Instant,
) -> Vec<Sample> {
    let mut samples = Vec::new();
    let method = hyper::Method::from_bytes(args.method.as_bytes()).unwrap_or(hyper::Method::PUT);
    while Instant::now() < stop_at {
        let j = counter.fetch_add(1, Ordering::Relaxed);
        let key = format!("{}{}", args.key_prefix, j % args.keys);
        let path = args.path_template.replace("{key}", &key);
        let sent = Instant::now();
        let answer = tokio::time::timeout(timeout, async {
            sender.ready().await.map_err(|e| format!("ready: {e}"))?;
            fetch(&mut sender, write(method.clone(), target, &path)).await
        })
        .await;
        let latency_ms = ms(sent.elapsed());
        let measured = sent >= measure_from;
        let broken = !matches!(answer, Ok(Ok(_)));
        if measured {
            samples.push(match answer {
                Ok(Ok((status, _, _))) => Sample {
                    latency_ms,
                    status: Some(status),
                    error: None,
                },
                Ok(Err(e)) => Sample {
                    latency_ms,
                    status: None,
                    error: Some(e),
                },
                Err(_) => Sample {
                    latency_ms,
                    status: None,
                    error: None,
                },
            });
        }
        if broken {
            // The connection cannot be trusted after an error or a timeout: a new one.
            match crate::http::connect(target).await {
                Ok(s) => sender = s,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    samples
}
