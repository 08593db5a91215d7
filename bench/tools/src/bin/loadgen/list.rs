//! `loadgen list`: every id of a list GET once, at full speed (see the crate docs).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::http::{Answer, ConnCounters, Sender, Target, connect_n, ensure_ready, get_answer};
use crate::stats::{Counts, fine_summary, ms, per_second, round3};
use crate::{ListArgs, positive};

/// One finished request of `list`.
struct ListRec {
    idx: usize,
    sent: Instant,
    done: Instant,
    outcome: Answer,
}

struct ListShared {
    target: Target,
    /// The path with `{id}` still in it.
    path_template: String,
    ids: Vec<String>,
    next: AtomicUsize,
    deadline: Instant,
    timeout: Duration,
    conn: ConnCounters,
}

/// One connection: take the next id until the list (or the time) is over.
async fn list_worker(sh: Arc<ListShared>, first: Sender) -> Vec<ListRec> {
    let mut recs = Vec::new();
    let mut sender = Some(first);
    loop {
        if Instant::now() >= sh.deadline {
            return recs;
        }
        let idx = sh.next.fetch_add(1, Ordering::Relaxed);
        if idx >= sh.ids.len() {
            return recs;
        }
        let ready = ensure_ready(&mut sender, &sh.target, &sh.conn).await;
        let sent = Instant::now();
        let path = sh.path_template.replace("{id}", &sh.ids[idx]);
        let outcome = get_answer(&mut sender, ready, &sh.target, &path, None, sh.timeout).await;
        recs.push(ListRec {
            idx,
            sent,
            done: Instant::now(),
            outcome,
        });
    }
}

/// The ids of `file`: one per line, trimmed, empty lines left out.
fn read_ids(file: &std::path::Path) -> Result<Vec<String>, String> {
    let text =
        std::fs::read_to_string(file).map_err(|e| format!("reading {}: {e}", file.display()))?;
    let ids: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    if ids.is_empty() {
        return Err(format!("{} has no ids", file.display()));
    }
    if let Some(bad) = ids.iter().find(|id| {
        id.bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    }) {
        return Err(format!("id with whitespace or control characters: {bad:?}"));
    }
    Ok(ids)
}

pub async fn list(args: ListArgs) -> Result<Value, String> {
    if args.connections == 0 {
        return Err("--connections must be > 0".into());
    }
    positive(args.max_duration_s, "--max-duration-s")?;
    let (target, path_template) = crate::http::parse_template(&args.url)?;
    let ids = read_ids(&args.ids_file)?;

    // all connections up before the clock starts
    let first = connect_n(&target, args.connections)
        .await
        .map_err(|e| format!("setting up connections: {e}"))?;

    let start = Instant::now();
    let sh = Arc::new(ListShared {
        target,
        path_template,
        ids,
        next: AtomicUsize::new(0),
        deadline: start + Duration::from_secs_f64(args.max_duration_s),
        timeout: Duration::from_secs_f64(args.timeout_s),
        conn: ConnCounters::default(),
    });
    let workers: Vec<_> = first
        .into_iter()
        .map(|s| tokio::spawn(list_worker(sh.clone(), s)))
        .collect();
    let mut recs = Vec::with_capacity(sh.ids.len());
    let mut lost = 0u64;
    for w in workers {
        match w.await {
            Ok(r) => recs.extend(r),
            Err(_) => lost += 1,
        }
    }

    let mut counts = Counts::default();
    let mut rejected = 0u64;
    let mut lat = Vec::with_capacity(recs.len());
    let mut passed: Vec<usize> = Vec::new();
    let mut first_sent: Option<Instant> = None;
    let mut last_done = start;
    for r in &recs {
        first_sent = Some(first_sent.map_or(r.sent, |f| f.min(r.sent)));
        counts.add(&r.outcome);
        match &r.outcome {
            Answer::Response { x_cache, .. } => {
                lat.push(ms(r.done.saturating_duration_since(r.sent)));
                last_done = last_done.max(r.done);
                if *x_cache == args.reject_x_cache {
                    rejected += 1;
                } else {
                    passed.push(r.idx);
                }
            }
            Answer::Error(_) | Answer::Timeout => passed.push(r.idx),
        }
    }
    if let Some(path) = &args.passed_out {
        passed.sort_unstable();
        let mut out = String::with_capacity(passed.len() * 12);
        for i in &passed {
            out.push_str(&sh.ids[*i]);
            out.push('\n');
        }
        std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let sent = recs.len() as u64;
    let elapsed = last_done
        .saturating_duration_since(first_sent.unwrap_or(start))
        .as_secs_f64();

    let mut out = json!({
        "mode": "list",
        "url": args.url,
        "ids_file": args.ids_file.display().to_string(),
        "ids": sh.ids.len(),
        "connections": args.connections,
        "timeout_s": args.timeout_s,
        "max_duration_s": args.max_duration_s,
        "sent": sent,
        "unsent": (sh.ids.len() as u64).saturating_sub(sent),
        "responses": counts.responses(),
        "lost_tasks": lost,
        "reject_x_cache": args.reject_x_cache,
        "rejected": rejected,
        "passed": passed.len(),
        "elapsed_s": round3(elapsed),
        "rps": per_second(counts.responses(), elapsed),
        "reconnects": sh.conn.reconnects.load(Ordering::Relaxed),
        "connect_failures": sh.conn.connect_failures.load(Ordering::Relaxed),
        "latency_ms": fine_summary(&mut lat),
    });
    counts.report(&mut out);
    Ok(out)
}
