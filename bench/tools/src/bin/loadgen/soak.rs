//! `loadgen soak`: paced writers and readers of a versioned KV origin behind one or more
//! caches, for minutes, with a per-bucket timeline of answers, errors and stale reads (see
//! the crate docs).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper::Uri;
use serde_json::{Value, json};

use crate::http::{Sender, Target, connect, fetch, get, parse_targets, put};
use crate::stats::{bump, fine_summary, ms, round3};
use crate::{SoakArgs, positive};

/// SplitMix64, as in `stale`: small, fast, and a reported seed makes the choices repeatable.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// What became of one request.
enum Outcome {
    /// 2xx with a version in the body.
    Version(u64),
    /// Any other status.
    Status(u16),
    /// No usable answer: connect, request, body or timeout (the kind).
    Error(&'static str),
}

/// One request: its loop kind, key, instance, when it was sent and answered, X-Cache.
struct Rec {
    write: bool,
    key: u32,
    inst: u16,
    sent: Instant,
    done: Instant,
    x_cache: String,
    outcome: Outcome,
}

struct Shared {
    targets: Vec<Target>,
    paths: Vec<String>,
    keys: Vec<String>,
    start: Instant,
    deadline: Instant,
    timeout: Duration,
}

/// The `version` of `{"key":"…","version":N}`, checking the key.
fn kv_version(body: &[u8], key: &str) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    if v.get("key").and_then(Value::as_str) != Some(key) {
        return None;
    }
    v.get("version").and_then(Value::as_u64)
}

/// One paced loop: request j is due at start + offset + j × period; a loop more than a
/// second behind (a request that waited for its timeout) drops the slots it missed, so a
/// fault never turns into a burst afterwards. Returns its records and the dropped slots.
async fn soak_loop(
    sh: Arc<Shared>,
    write: bool,
    period: Duration,
    offset: Duration,
    seed: u64,
    mut senders: Vec<Option<Sender>>,
) -> (Vec<Rec>, u64) {
    let mut rng = Rng(seed);
    let mut recs = Vec::new();
    let mut dropped = 0u64;
    let mut due = sh.start + offset;
    loop {
        tokio::time::sleep_until(tokio::time::Instant::from_std(due)).await;
        if Instant::now() >= sh.deadline {
            break;
        }
        let key = rng.below(sh.keys.len() as u64) as usize;
        let inst = rng.below(sh.targets.len() as u64) as usize;
        let target = &sh.targets[inst];
        let sent = Instant::now();
        let rec = |outcome, x_cache: String| Rec {
            write,
            key: key as u32,
            inst: inst as u16,
            sent,
            done: Instant::now(),
            x_cache,
            outcome,
        };

        let slot = &mut senders[inst];
        let usable = match slot.as_mut() {
            Some(s) if !s.is_closed() => matches!(
                tokio::time::timeout(sh.timeout, s.ready()).await,
                Ok(Ok(()))
            ),
            _ => false,
        };
        if !usable {
            *slot = connect(target).await.ok();
        }
        let r = match slot.as_mut() {
            None => rec(Outcome::Error("connect"), String::new()),
            Some(sender) => {
                let path = &sh.paths[key];
                let req = if write {
                    put(target, path)
                } else {
                    get(target, path)
                };
                match tokio::time::timeout(sh.timeout, fetch(sender, req)).await {
                    Ok(Ok((status, x_cache, body))) if (200..300).contains(&status) => {
                        match kv_version(&body, &sh.keys[key]) {
                            Some(v) => rec(Outcome::Version(v), x_cache),
                            None => rec(Outcome::Error("bad_body"), x_cache),
                        }
                    }
                    Ok(Ok((status, x_cache, _))) => rec(Outcome::Status(status), x_cache),
                    Ok(Err(_)) => {
                        *slot = None;
                        rec(Outcome::Error("request"), String::new())
                    }
                    Err(_) => {
                        *slot = None;
                        rec(Outcome::Error("timeout"), String::new())
                    }
                }
            }
        };
        recs.push(r);

        due += period;
        let now = Instant::now();
        if due + Duration::from_secs(1) < now {
            let behind = now.saturating_duration_since(due);
            let missed = (behind.as_secs_f64() / period.as_secs_f64()).floor() as u64;
            dropped += missed;
            due += period.mul_f64(missed as f64);
        }
    }
    (recs, dropped)
}

/// Per timeline bucket.
#[derive(Default)]
struct Bucket {
    reads_ok: u64,
    writes_ok: u64,
    non_2xx: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
    stale: u64,
    x_cache: BTreeMap<String, u64>,
}

pub async fn soak(args: SoakArgs) -> Result<Value, String> {
    if args.writers == 0 || args.readers == 0 {
        return Err("--writers and --readers must be > 0".into());
    }
    if args.keys == 0 || args.keys > u64::from(u32::MAX) {
        return Err("--keys must be in 1..=4294967295".into());
    }
    if args.urls.len() > usize::from(u16::MAX) {
        return Err("too many --url".into());
    }
    positive(args.duration_s, "--duration-s")?;
    positive(args.write_rate, "--write-rate")?;
    positive(args.read_rate, "--read-rate")?;
    positive(args.timeout_s, "--timeout-s")?;
    if !(args.delay_ms.is_finite() && args.delay_ms >= 0.0) {
        return Err("--delay-ms must be ≥ 0".into());
    }
    if args.bucket_ms == 0 {
        return Err("--bucket-ms must be > 0".into());
    }
    if !args.path_template.starts_with('/') || !args.path_template.contains("{key}") {
        return Err(format!(
            "--path-template must start with / and contain {{key}}: {}",
            args.path_template
        ));
    }
    let targets = parse_targets(&args.urls)?;
    let keys: Vec<String> = (0..args.keys)
        .map(|i| format!("{}{i}", args.key_prefix))
        .collect();
    let paths: Vec<String> = keys
        .iter()
        .map(|k| args.path_template.replace("{key}", k))
        .collect();
    if let Some(bad) = paths.iter().find(|p| p.parse::<Uri>().is_err()) {
        return Err(format!("not a valid request path: {bad}"));
    }
    let seed = args.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });

    let loops = args.writers + args.readers;
    let mut conns = Vec::with_capacity(loops);
    for _ in 0..loops {
        let mut per_url = Vec::with_capacity(targets.len());
        for t in &targets {
            per_url.push(Some(
                connect(t)
                    .await
                    .map_err(|e| format!("setting up connections to {}: {e}", t.url))?,
            ));
        }
        conns.push(per_url);
    }

    let timeout = Duration::from_secs_f64(args.timeout_s);
    let start = Instant::now() + Duration::from_millis(50);
    let start_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
        + 50;
    let deadline = start + Duration::from_secs_f64(args.duration_s);
    let sh = Arc::new(Shared {
        targets,
        paths,
        keys,
        start,
        deadline,
        timeout,
    });
    let write_period = Duration::from_secs_f64(args.writers as f64 / args.write_rate);
    let read_period = Duration::from_secs_f64(args.readers as f64 / args.read_rate);
    let mut seeder = Rng(seed);
    let mut handles = Vec::with_capacity(loops);
    for (i, c) in conns.into_iter().enumerate() {
        let write = i < args.writers;
        let period = if write { write_period } else { read_period };
        // spread the loops' phases over one period
        let offset = period.mul_f64(seeder.below(1000) as f64 / 1000.0);
        handles.push(tokio::spawn(soak_loop(
            sh.clone(),
            write,
            period,
            offset,
            seeder.next_u64(),
            c,
        )));
    }
    // connect (5 s) + ready + answer (timeout each) bound every request; this only catches a bug
    let backstop = tokio::time::Instant::from_std(deadline + 2 * timeout + Duration::from_secs(10));
    let mut recs = Vec::new();
    let (mut dropped, mut lost) = (0u64, 0u64);
    for h in handles {
        match tokio::time::timeout_at(backstop, h).await {
            Ok(Ok((r, d))) => {
                recs.extend(r);
                dropped += d;
            }
            _ => lost += 1,
        }
    }
    let ended = Instant::now();

    // --- stale reads: a read that started more than delay after some write to its key
    // returned version v, and read a version < v ---
    let n_keys = sh.keys.len();
    let delay = Duration::from_secs_f64(args.delay_ms / 1000.0);
    let mut w_by_key: Vec<Vec<(Instant, u64)>> = vec![Vec::new(); n_keys];
    for r in &recs {
        if let (true, Outcome::Version(v)) = (r.write, &r.outcome) {
            w_by_key[r.key as usize].push((r.done, *v));
        }
    }
    // per key, writes by return time and the newest version returned up to each
    let mut newest: Vec<Vec<u64>> = Vec::with_capacity(n_keys);
    for ws in &mut w_by_key {
        ws.sort_by_key(|&(t, v)| (t, v));
        let mut m = 0u64;
        newest.push(
            ws.iter()
                .map(|&(_, v)| {
                    m = m.max(v);
                    m
                })
                .collect(),
        );
    }

    let bucket = Duration::from_millis(args.bucket_ms);
    let n_buckets =
        (ended.saturating_duration_since(start).as_millis() / bucket.as_millis() + 1) as usize;
    let mut timeline: Vec<Bucket> = (0..n_buckets).map(|_| Bucket::default()).collect();
    let n_inst = sh.targets.len();
    let (mut reads, mut writes) = (0u64, 0u64);
    let mut read_status: BTreeMap<String, u64> = BTreeMap::new();
    let mut write_status: BTreeMap<String, u64> = BTreeMap::new();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut read_x_cache: BTreeMap<String, u64> = BTreeMap::new();
    let (mut read_lat, mut write_lat) = (Vec::new(), Vec::new());
    let mut stale = 0u64;
    let mut stale_by_inst = vec![0u64; n_inst];
    let mut stale_x_cache: BTreeMap<String, u64> = BTreeMap::new();
    let mut stale_ages = Vec::new();
    let mut stale_times: Vec<f64> = Vec::new();
    let mut samples = Vec::new();
    let mut s5xx = 0u64;
    for r in &recs {
        let b = (r.sent.saturating_duration_since(start).as_millis() / bucket.as_millis()) as usize;
        let b = &mut timeline[b.min(n_buckets - 1)];
        let status = match r.outcome {
            Outcome::Version(_) => "200".to_owned(),
            Outcome::Status(s) => s.to_string(),
            Outcome::Error(k) => k.to_owned(),
        };
        if r.write {
            bump(&mut write_status, &status);
        } else {
            bump(&mut read_status, &status);
            if !r.x_cache.is_empty() {
                bump(&mut read_x_cache, &r.x_cache);
                bump(&mut b.x_cache, &r.x_cache);
            }
        }
        match r.outcome {
            Outcome::Version(v) => {
                let lat = ms(r.done.saturating_duration_since(r.sent));
                if r.write {
                    writes += 1;
                    b.writes_ok += 1;
                    write_lat.push(lat);
                    continue;
                }
                reads += 1;
                b.reads_ok += 1;
                read_lat.push(lat);
                let ws = &w_by_key[r.key as usize];
                let n = ws.partition_point(|&(t_w, _)| t_w + delay < r.sent);
                if n > 0 && newest[r.key as usize][n - 1] > v {
                    stale += 1;
                    b.stale += 1;
                    stale_by_inst[r.inst as usize] += 1;
                    bump(&mut stale_x_cache, &r.x_cache);
                    let missed = ws[..n]
                        .iter()
                        .find(|&&(_, wv)| wv > v)
                        .map_or(r.sent, |&(t, _)| t);
                    let age = ms(r.sent.saturating_duration_since(missed));
                    let at = ms(r.sent.saturating_duration_since(start)) / 1000.0;
                    stale_ages.push(age);
                    stale_times.push(at);
                    if samples.len() < args.samples {
                        samples.push(json!({
                            "key": sh.keys[r.key as usize],
                            "instance": r.inst,
                            "x_cache": r.x_cache,
                            "started_s": round3(at),
                            "version_read": v,
                            "newest_version_returned_before_delay": newest[r.key as usize][n - 1],
                            "ms_after_oldest_missed_write": round3(age),
                        }));
                    }
                }
            }
            Outcome::Status(s) => {
                if s >= 500 {
                    s5xx += 1;
                }
                bump(&mut b.non_2xx, &s.to_string());
            }
            Outcome::Error(k) => {
                bump(&mut errors, k);
                bump(&mut b.errors, k);
            }
        }
    }
    stale_times.sort_by(|a, b| a.total_cmp(b));
    let last_stale_s = stale_times.last().copied();
    let timeline: Vec<Value> = timeline
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            json!({
                "t_s": round3(i as f64 * bucket.as_secs_f64()),
                "reads_ok": b.reads_ok,
                "writes_ok": b.writes_ok,
                "non_2xx": b.non_2xx,
                "errors": b.errors,
                "stale_reads": b.stale,
                "x_cache": b.x_cache,
            })
        })
        .collect();
    let elapsed_s = ended.saturating_duration_since(start).as_secs_f64();
    let per_s = |n: u64| round3(n as f64 / args.duration_s);

    Ok(json!({
        "mode": "soak",
        "urls": args.urls,
        "path_template": args.path_template,
        "writers": args.writers,
        "readers": args.readers,
        "keys": args.keys,
        "key_prefix": args.key_prefix,
        "write_rate": args.write_rate,
        "read_rate": args.read_rate,
        "duration_s": args.duration_s,
        "delay_ms": args.delay_ms,
        "timeout_s": args.timeout_s,
        "bucket_ms": args.bucket_ms,
        "seed": seed,
        "start_unix_ms": start_unix_ms,
        "elapsed_s": round3(elapsed_s),
        "requests": recs.len(),
        "writes": writes,
        "reads": reads,
        "writes_per_s": per_s(writes),
        "reads_per_s": per_s(reads),
        "read_status": read_status,
        "write_status": write_status,
        "status_5xx": s5xx,
        "errors": errors.values().sum::<u64>(),
        "errors_by_kind": errors,
        "dropped_slots": dropped,
        "loops_lost": lost,
        "read_x_cache": read_x_cache,
        "stale_reads_after_delay": stale,
        "stale_by_instance": stale_by_inst,
        "stale_by_x_cache": stale_x_cache,
        "stale_age_ms": fine_summary(&mut stale_ages),
        "last_stale_read_s": last_stale_s.map(round3),
        "stale_read_times_s": stale_times.iter().map(|&t| round3(t)).collect::<Vec<_>>(),
        "stale_samples": samples,
        "read_latency_ms": fine_summary(&mut read_lat),
        "write_latency_ms": fine_summary(&mut write_lat),
        "timeline": timeline,
    }))
}
