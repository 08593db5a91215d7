//! `loadgen stale`: closed-loop writers and readers of a versioned KV origin, and the stale
//! reads after writes (see the crate docs).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper::Uri;
use serde_json::{Value, json};

use crate::http::{Sender, Target, connect, fetch, get, parse_targets, put};
use crate::stats::{fine_summary, ms, round3};
use crate::{StaleArgs, positive};

/// A small, fast PRNG (SplitMix64) for the key and instance choices: no dependency, and a
/// reported seed makes a run's choices repeatable.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the modulo bias is negligible for small n).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A write: its key, the version its answer returned and when that answer arrived.
#[derive(Clone, Copy, Debug)]
struct StaleWrite {
    key: u32,
    version: u64,
    done: Instant,
}

/// A read: its key, instance, when it was sent, the version its body returned.
#[derive(Clone, Debug)]
struct StaleRead {
    key: u32,
    inst: u16,
    sent: Instant,
    version: u64,
    x_cache: String,
}

/// What one loop did.
#[derive(Default)]
struct StaleOut {
    /// A writer loop (else a reader).
    write: bool,
    writes: Vec<StaleWrite>,
    reads: Vec<StaleRead>,
    requests: u64,
    errors: BTreeMap<String, u64>,
    error_samples: BTreeMap<String, u64>,
    status: BTreeMap<String, u64>,
    latency_ms: Vec<f64>,
    reconnects: u64,
    hit_request_cap: bool,
}

impl StaleOut {
    fn error(&mut self, kind: &str, msg: String) {
        *self.errors.entry(kind.to_owned()).or_default() += 1;
        // a few distinct messages are enough to tell what went wrong
        if self.error_samples.len() < 20 || self.error_samples.contains_key(&msg) {
            *self.error_samples.entry(msg).or_default() += 1;
        }
    }
}

struct StaleShared {
    targets: Vec<Target>,
    /// Path of each key (index = key number).
    paths: Vec<String>,
    keys: Vec<String>,
    start: Instant,
    deadline: Instant,
    timeout: Duration,
    max_requests: u64,
}

/// The `version` of a KV answer body `{"key":"…","version":N}`; checks the key too.
fn kv_version(body: &[u8], key: &str) -> Result<u64, (&'static str, String)> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ("bad_body", format!("body is not JSON: {e}")))?;
    if v.get("key").and_then(Value::as_str) != Some(key) {
        return Err((
            "wrong_key",
            format!("answer for key {} carried key {}", key, v["key"]),
        ));
    }
    v.get("version")
        .and_then(Value::as_u64)
        .ok_or_else(|| ("bad_body", "no integer \"version\" in the body".to_owned()))
}

/// One writer (`write`) or reader loop, until the deadline or the request cap.
async fn stale_loop(
    sh: Arc<StaleShared>,
    write: bool,
    seed: u64,
    mut senders: Vec<Option<Sender>>,
) -> StaleOut {
    let mut rng = SplitMix64(seed);
    let mut out = StaleOut {
        write,
        ..StaleOut::default()
    };
    tokio::time::sleep_until(tokio::time::Instant::from_std(sh.start)).await;
    loop {
        if Instant::now() >= sh.deadline {
            break;
        }
        if out.requests >= sh.max_requests {
            out.hit_request_cap = true;
            break;
        }
        out.requests += 1;
        let key = rng.below(sh.keys.len() as u64) as usize;
        let inst = rng.below(sh.targets.len() as u64) as usize;
        let target = &sh.targets[inst];

        // a usable connection: the open one, or a new one when the server closed it
        let slot = &mut senders[inst];
        let usable = match slot.as_mut() {
            Some(s) if !s.is_closed() => matches!(
                tokio::time::timeout(sh.timeout, s.ready()).await,
                Ok(Ok(()))
            ),
            _ => false,
        };
        if !usable {
            *slot = None;
            out.reconnects += 1;
            match connect(target).await {
                Ok(s) => *slot = Some(s),
                Err(e) => {
                    out.error("connect", format!("{}: {e}", target.url));
                    // do not spin on an instance that is down
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            }
        }
        let Some(sender) = slot.as_mut() else {
            continue;
        };

        let path = &sh.paths[key];
        let req = if write {
            put(target, path)
        } else {
            get(target, path)
        };
        let sent = Instant::now();
        let result = tokio::time::timeout(sh.timeout, fetch(sender, req)).await;
        let done = Instant::now();
        let (status, x_cache, body) = match result {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                *slot = None;
                out.error("request", e);
                continue;
            }
            Err(_) => {
                *slot = None;
                out.error(
                    "timeout",
                    format!("no whole answer within {:?}", sh.timeout),
                );
                continue;
            }
        };
        out.latency_ms
            .push(ms(done.saturating_duration_since(sent)));
        *out.status.entry(status.to_string()).or_default() += 1;
        if !(200..300).contains(&status) {
            out.error(
                &format!("status_{status}"),
                format!(
                    "{} {path}: status {status}",
                    if write { "PUT" } else { "GET" }
                ),
            );
            continue;
        }
        let version = match kv_version(&body, &sh.keys[key]) {
            Ok(v) => v,
            Err((kind, msg)) => {
                out.error(kind, msg);
                continue;
            }
        };
        if write {
            out.writes.push(StaleWrite {
                key: key as u32,
                version,
                done,
            });
        } else {
            out.reads.push(StaleRead {
                key: key as u32,
                inst: inst as u16,
                sent,
                version,
                x_cache,
            });
        }
    }
    out
}

/// The stale-read figures of one run (see the module docs).
struct StaleAnalysis {
    /// Per write, in ms (0 when no read saw an older version after it returned).
    windows_ms: Vec<f64>,
    /// Writes after whose return at least one read of the key saw an older version.
    writes_with_stale_reads: u64,
    stale_reads_total: u64,
    /// Indices (into the reads) of the reads stale more than the delay after a write.
    stale_after_delay: Vec<usize>,
    /// Per stale-after-delay read: (read start − return of the oldest write it missed, in
    /// ms, the newest version returned by a write more than the delay before it).
    stale_after_delay_detail: Vec<(f64, u64)>,
}

/// Stale windows and stale reads. Per key: with the reads sorted by version, the latest
/// start among reads older than v is a prefix maximum, so a write's window is one binary
/// search; with the writes sorted by return time, the newest version returned before t is a
/// prefix maximum too. O((W + R) log) in all.
fn stale_analysis(
    keys: usize,
    writes: &[StaleWrite],
    reads: &[StaleRead],
    delay: Duration,
) -> StaleAnalysis {
    let mut w_by_key: Vec<Vec<(Instant, u64)>> = vec![Vec::new(); keys];
    for w in writes {
        w_by_key[w.key as usize].push((w.done, w.version));
    }
    let mut r_by_key: Vec<Vec<usize>> = vec![Vec::new(); keys];
    for (i, r) in reads.iter().enumerate() {
        r_by_key[r.key as usize].push(i);
    }
    let mut a = StaleAnalysis {
        windows_ms: Vec::with_capacity(writes.len()),
        writes_with_stale_reads: 0,
        stale_reads_total: 0,
        stale_after_delay: Vec::new(),
        stale_after_delay_detail: Vec::new(),
    };
    for k in 0..keys {
        let ws = &mut w_by_key[k];
        ws.sort_by_key(|&(t, v)| (t, v));
        // reads of k by version; latest_start[i] = latest start among the first i + 1
        let mut rs: Vec<(u64, Instant)> = r_by_key[k]
            .iter()
            .map(|&i| (reads[i].version, reads[i].sent))
            .collect();
        rs.sort_by_key(|&(v, t)| (v, t));
        let mut latest_start = Vec::with_capacity(rs.len());
        for (i, &(_, t)) in rs.iter().enumerate() {
            latest_start.push(if i == 0 {
                t
            } else {
                t.max(latest_start[i - 1])
            });
        }
        for &(t_w, v) in ws.iter() {
            let older = rs.partition_point(|&(rv, _)| rv < v);
            match older.checked_sub(1).map(|i| latest_start[i]) {
                Some(latest) if latest >= t_w => {
                    a.writes_with_stale_reads += 1;
                    a.windows_ms.push(ms(latest - t_w));
                }
                _ => a.windows_ms.push(0.0),
            }
        }
        // newest_before[i] = the largest version among the first i + 1 writes by return time
        let mut newest_before = Vec::with_capacity(ws.len());
        for (i, &(_, v)) in ws.iter().enumerate() {
            newest_before.push(if i == 0 {
                v
            } else {
                v.max(newest_before[i - 1])
            });
        }
        for &ri in &r_by_key[k] {
            let r = &reads[ri];
            let n = ws.partition_point(|&(t_w, _)| t_w <= r.sent);
            if n > 0 && newest_before[n - 1] > r.version {
                a.stale_reads_total += 1;
            }
            let n = ws.partition_point(|&(t_w, _)| t_w + delay < r.sent);
            if n > 0 && newest_before[n - 1] > r.version {
                // how long after the oldest write it missed (writes sorted by return time)
                let missed = ws[..n]
                    .iter()
                    .find(|&&(_, v)| v > r.version)
                    .map_or(r.sent, |&(t, _)| t);
                a.stale_after_delay.push(ri);
                a.stale_after_delay_detail.push((
                    ms(r.sent.saturating_duration_since(missed)),
                    newest_before[n - 1],
                ));
            }
        }
    }
    a
}

pub async fn stale(args: StaleArgs) -> Result<Value, String> {
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
    if !(args.delay_ms.is_finite() && args.delay_ms >= 0.0) {
        return Err("--delay-ms must be ≥ 0".into());
    }
    positive(args.timeout_s, "--timeout-s")?;
    if args.max_requests_per_loop == 0 {
        return Err("--max-requests-per-loop must be > 0".into());
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

    // every loop's connections up before the clock starts
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
    let deadline = start + Duration::from_secs_f64(args.duration_s);
    let sh = Arc::new(StaleShared {
        targets,
        paths,
        keys,
        start,
        deadline,
        timeout,
        max_requests: args.max_requests_per_loop,
    });
    let mut seeder = SplitMix64(seed);
    let mut handles = Vec::with_capacity(loops);
    for (i, c) in conns.into_iter().enumerate() {
        let write = i < args.writers;
        handles.push(tokio::spawn(stale_loop(
            sh.clone(),
            write,
            seeder.next_u64(),
            c,
        )));
    }
    // each request is bounded (connect 5 s, then the timeout for ready and for the
    // answer): this backstop only catches a bug
    let backstop = tokio::time::Instant::from_std(deadline + 2 * timeout + Duration::from_secs(10));
    let mut outs = Vec::with_capacity(loops);
    let mut lost = 0u64;
    for h in handles {
        match tokio::time::timeout_at(backstop, h).await {
            Ok(Ok(out)) => outs.push(out),
            _ => lost += 1,
        }
    }
    let ended = Instant::now();

    // --- aggregate ---
    let mut writes = Vec::new();
    let mut reads = Vec::new();
    let (mut write_requests, mut read_requests, mut reconnects, mut capped) =
        (0u64, 0u64, 0u64, 0u64);
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut error_samples: BTreeMap<String, u64> = BTreeMap::new();
    let mut write_status: BTreeMap<String, u64> = BTreeMap::new();
    let mut read_status: BTreeMap<String, u64> = BTreeMap::new();
    let (mut write_lat, mut read_lat) = (Vec::new(), Vec::new());
    for out in outs {
        if out.write {
            write_requests += out.requests;
            write_lat.extend(out.latency_ms);
            for (k, v) in out.status {
                *write_status.entry(k).or_default() += v;
            }
        } else {
            read_requests += out.requests;
            read_lat.extend(out.latency_ms);
            for (k, v) in out.status {
                *read_status.entry(k).or_default() += v;
            }
        }
        writes.extend(out.writes);
        reads.extend(out.reads);
        reconnects += out.reconnects;
        capped += u64::from(out.hit_request_cap);
        for (k, v) in out.errors {
            *errors.entry(k).or_default() += v;
        }
        for (k, v) in out.error_samples {
            if error_samples.len() < 20 || error_samples.contains_key(&k) {
                *error_samples.entry(k).or_default() += v;
            }
        }
    }
    let delay = Duration::from_secs_f64(args.delay_ms / 1000.0);
    let a = stale_analysis(args.keys as usize, &writes, &reads, delay);

    let n_inst = sh.targets.len();
    let mut reads_by_inst = vec![0u64; n_inst];
    let mut read_x_cache: BTreeMap<String, u64> = BTreeMap::new();
    for r in &reads {
        reads_by_inst[r.inst as usize] += 1;
        *read_x_cache.entry(r.x_cache.clone()).or_default() += 1;
    }
    let mut stale_by_inst = vec![0u64; n_inst];
    let mut stale_x_cache: BTreeMap<String, u64> = BTreeMap::new();
    let mut ages = Vec::with_capacity(a.stale_after_delay.len());
    let mut samples = Vec::new();
    for (&ri, &(age, newest)) in a.stale_after_delay.iter().zip(&a.stale_after_delay_detail) {
        let r = &reads[ri];
        stale_by_inst[r.inst as usize] += 1;
        *stale_x_cache.entry(r.x_cache.clone()).or_default() += 1;
        ages.push(age);
        if samples.len() < args.samples {
            samples.push(json!({
                "key": sh.keys[r.key as usize],
                "instance": r.inst,
                "url": sh.targets[r.inst as usize].url,
                "x_cache": r.x_cache,
                "started_ms": round3(ms(r.sent.saturating_duration_since(start))),
                "version_read": r.version,
                "newest_version_returned_before_delay": newest,
                "ms_after_oldest_missed_write": round3(age),
            }));
        }
    }
    let mut windows = a.windows_ms;
    let elapsed_s = ended.saturating_duration_since(start).as_secs_f64();
    let per_s = |n: usize| round3(n as f64 / args.duration_s);
    let error_total: u64 = errors.values().sum();

    Ok(json!({
        "mode": "stale",
        "urls": args.urls,
        "path_template": args.path_template,
        "writers": args.writers,
        "readers": args.readers,
        "keys": args.keys,
        "key_prefix": args.key_prefix,
        "duration_s": args.duration_s,
        "delay_ms": args.delay_ms,
        "max_requests_per_loop": args.max_requests_per_loop,
        "timeout_s": args.timeout_s,
        "seed": seed,
        "elapsed_s": round3(elapsed_s),
        "writes": writes.len(),
        "reads": reads.len(),
        "writes_per_s": per_s(writes.len()),
        "reads_per_s": per_s(reads.len()),
        "write_requests": write_requests,
        "read_requests": read_requests,
        "errors": error_total,
        "errors_by_kind": errors,
        "error_samples": error_samples,
        "reconnects": reconnects,
        "loops_lost": lost,
        "loops_at_request_cap": capped,
        "stale_window_ms": fine_summary(&mut windows),
        "writes_with_stale_reads": a.writes_with_stale_reads,
        "stale_reads_total": a.stale_reads_total,
        "stale_reads_after_delay": a.stale_after_delay.len(),
        "stale_after_delay_by_instance": stale_by_inst,
        "stale_after_delay_by_x_cache": stale_x_cache,
        "stale_after_delay_age_ms": fine_summary(&mut ages),
        "stale_after_delay_samples": samples,
        "reads_by_instance": reads_by_inst,
        "read_x_cache": read_x_cache,
        "read_status": read_status,
        "write_status": write_status,
        "read_latency_ms": fine_summary(&mut read_lat),
        "write_latency_ms": fine_summary(&mut write_lat),
    }))
}

#[cfg(test)]
mod stale_tests {
    use super::*;

    fn w(key: u32, version: u64, at: Instant) -> StaleWrite {
        StaleWrite {
            key,
            version,
            done: at,
        }
    }

    fn r(key: u32, version: u64, at: Instant) -> StaleRead {
        StaleRead {
            key,
            inst: 0,
            sent: at,
            version,
            x_cache: "MISS".into(),
        }
    }

    fn whole_ms(v: &[f64]) -> Vec<i64> {
        v.iter().map(|x| x.round() as i64).collect()
    }

    fn detail(a: &StaleAnalysis) -> Vec<(i64, u64)> {
        a.stale_after_delay_detail
            .iter()
            .map(|&(age, v)| (age.round() as i64, v))
            .collect()
    }

    #[test]
    fn windows_and_stale_reads() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let writes = [w(0, 1, at(100)), w(0, 2, at(500)), w(1, 1, at(100))];
        let reads = [
            r(0, 0, at(50)),  // before any write: not stale
            r(0, 0, at(120)), // 20 ms after v1 returned, older than v1
            r(0, 0, at(350)), // 250 ms after v1: stale after a 200 ms delay
            r(0, 1, at(400)), // fresh
            r(0, 1, at(510)), // 10 ms after v2, older than v2
            r(0, 2, at(900)), // fresh
            r(1, 1, at(100)), // key 1: at the very instant of its write, fresh
        ];
        let a = stale_analysis(2, &writes, &reads, Duration::from_millis(200));
        // write order: key 0 (v1 at 100, v2 at 500), then key 1
        assert_eq!(whole_ms(&a.windows_ms), vec![250, 10, 0]);
        assert_eq!(a.writes_with_stale_reads, 2);
        assert_eq!(a.stale_reads_total, 3);
        assert_eq!(a.stale_after_delay, vec![2]);
        assert_eq!(detail(&a), vec![(250, 1)]);
    }

    #[test]
    fn a_read_older_than_several_writes_counts_once() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let writes = [w(0, 2, at(10)), w(0, 1, at(20)), w(0, 3, at(30))];
        let reads = [r(0, 1, at(300))];
        let a = stale_analysis(1, &writes, &reads, Duration::from_millis(100));
        // sorted by return time: v2 (stale: 290 ms), v1 (not stale), v3 (270 ms)
        assert_eq!(whole_ms(&a.windows_ms), vec![290, 0, 270]);
        assert_eq!(a.stale_reads_total, 1);
        assert_eq!(detail(&a), vec![(290, 3)]);
    }
}
