//! `loadgen buyers`: a flash sale's buyers, paced, round-robin over the instances of a
//! fleet and the resources on sale (see the crate docs), for bench/flash_sale.sh's flood
//! runs. Every buy is recorded with wall-clock times, so the script can line it up with
//! the faults it injects and with the shop's sale log.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{CONTENT_TYPE, HOST, USER_AGENT};
use hyper::{Method, Request};
use serde_json::{Value, json};

use crate::http::{Target, handshake, parse_targets, tcp_connect, x_cache_of};
use crate::stats::{bump, fine_summary, ms};
use crate::{BuyersArgs, positive};

/// A keep-alive connection that sends bodies.
type PostSender = SendRequest<Full<Bytes>>;

/// The body of every buy.
const BODY: &str = "{}";

/// One buy.
struct Rec {
    client: usize,
    instance: usize,
    resource: usize,
    sent_unix_ms: f64,
    done_unix_ms: f64,
    latency_ms: f64,
    /// 0: no answer (`error` says why).
    status: u16,
    x_cache: String,
    error: Option<&'static str>,
}

struct Shared {
    targets: Vec<Target>,
    resources: Vec<String>,
    idempotency: Option<String>,
    pace: Duration,
    max_ops: u64,
    deadline: Instant,
    timeout: Duration,
}

fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

async fn connect(t: &Target) -> Result<PostSender, String> {
    handshake(tcp_connect(t.addr).await?).await
}

/// One POST of `path` with [`BODY`]: status, X-Cache, or why there was no answer.
async fn post(
    sender: &mut PostSender,
    t: &Target,
    path: &str,
    key: Option<&str>,
) -> Result<(u16, String), &'static str> {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(HOST, t.authority.as_str())
        .header(USER_AGENT, "cacheguard-bench-loadgen")
        .header(CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let req = req
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .map_err(|_| "request")?;
    sender.ready().await.map_err(|_| "connection")?;
    let resp = sender.send_request(req).await.map_err(|_| "request")?;
    let status = resp.status().as_u16();
    let x_cache = x_cache_of(&resp);
    resp.into_body().collect().await.map_err(|_| "body")?;
    Ok((status, x_cache))
}

/// Client `p`: its `k`-th buy goes to instance `(p + k) mod n` for resource `(p + k) mod
/// r`, one at a time, `pace` apart, until the deadline or `max_ops`.
async fn client(sh: Arc<Shared>, p: usize) -> Vec<Rec> {
    let mut senders: Vec<Option<PostSender>> = (0..sh.targets.len()).map(|_| None).collect();
    let mut recs = Vec::new();
    for k in 0..sh.max_ops {
        if Instant::now() >= sh.deadline {
            break;
        }
        let instance = (p + k as usize) % sh.targets.len();
        let resource = (p + k as usize) % sh.resources.len();
        let target = &sh.targets[instance];
        let path = format!("{}/orders", sh.resources[resource]);
        let key = sh.idempotency.as_ref().map(|tag| format!("{tag}-p{p}-{k}"));
        let sent_unix_ms = unix_ms();
        let sent = Instant::now();
        let slot = &mut senders[instance];
        let answer = tokio::time::timeout(sh.timeout, async {
            if slot.as_ref().is_none_or(|s| s.is_closed()) {
                *slot = Some(connect(target).await.map_err(|_| "connect")?);
            }
            let sender = slot.as_mut().ok_or("connect")?;
            post(sender, target, &path, key.as_deref()).await
        })
        .await
        .unwrap_or(Err("timeout"));
        if answer.is_err() {
            // a connection in an unknown state is not used again
            *slot = None;
        }
        let (status, x_cache, error) = match answer {
            Ok((status, x_cache)) => (status, x_cache, None),
            Err(e) => (0, String::new(), Some(e)),
        };
        recs.push(Rec {
            client: p,
            instance,
            resource,
            sent_unix_ms,
            done_unix_ms: unix_ms(),
            latency_ms: ms(sent.elapsed()),
            status,
            x_cache,
            error,
        });
        tokio::time::sleep(sh.pace).await;
    }
    recs
}

pub async fn buyers(args: BuyersArgs) -> Result<Value, String> {
    positive(args.duration_s, "--duration-s")?;
    positive(args.timeout_s, "--timeout-s")?;
    if args.clients == 0 || args.max_ops == 0 {
        return Err("--clients and --max-ops must be > 0".into());
    }
    if args.resources.is_empty() {
        return Err("--resource: at least one".into());
    }
    let targets = parse_targets(&args.urls)?;
    let start_unix_ms = unix_ms();
    let start = Instant::now();
    let sh = Arc::new(Shared {
        targets,
        resources: args.resources.clone(),
        idempotency: args.idempotency_keys.then(|| args.key_tag.clone()),
        pace: Duration::from_millis(args.pace_ms),
        max_ops: args.max_ops,
        deadline: start + Duration::from_secs_f64(args.duration_s),
        timeout: Duration::from_secs_f64(args.timeout_s),
    });
    let tasks: Vec<_> = (0..args.clients)
        .map(|p| tokio::spawn(client(sh.clone(), p)))
        .collect();
    let mut recs = Vec::new();
    let mut lost = 0u64;
    for t in tasks {
        match t.await {
            Ok(r) => recs.extend(r),
            Err(_) => lost += 1,
        }
    }
    let end_unix_ms = unix_ms();
    recs.sort_by(|a, b| a.sent_unix_ms.total_cmp(&b.sent_unix_ms));

    let mut status = BTreeMap::new();
    let mut x_cache = BTreeMap::new();
    let mut errors = BTreeMap::new();
    let mut per_resource: Vec<BTreeMap<String, u64>> = vec![BTreeMap::new(); sh.resources.len()];
    let mut lat = Vec::with_capacity(recs.len());
    for r in &recs {
        match r.error {
            Some(e) => bump(&mut errors, e),
            None => {
                bump(&mut status, &r.status.to_string());
                bump(&mut x_cache, &r.x_cache);
                lat.push(r.latency_ms);
            }
        }
        let kind = match r.status {
            0 => "errors",
            200..=299 => "ok",
            _ => "refused",
        };
        bump(&mut per_resource[r.resource], kind);
        bump(&mut per_resource[r.resource], "attempts");
    }
    if let Some(path) = &args.ops_out {
        let mut out = String::with_capacity(recs.len() * 64);
        out.push_str(
            "sent_unix_ms\tdone_unix_ms\tclient\tinstance\tresource\tstatus\tx_cache\terror\n",
        );
        for r in &recs {
            let _ = writeln!(
                out,
                "{:.3}\t{:.3}\t{}\t{}\t{}\t{}\t{}\t{}",
                r.sent_unix_ms,
                r.done_unix_ms,
                r.client,
                r.instance,
                sh.resources[r.resource],
                r.status,
                if r.x_cache.is_empty() {
                    "-"
                } else {
                    &r.x_cache
                },
                r.error.unwrap_or("-"),
            );
        }
        std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    let resources: serde_json::Map<String, Value> = sh
        .resources
        .iter()
        .zip(per_resource)
        .map(|(name, counts)| (name.clone(), json!(counts)))
        .collect();
    Ok(json!({
        "mode": "buyers",
        "urls": args.urls,
        "clients": args.clients,
        "pace_ms": args.pace_ms,
        "duration_s": args.duration_s,
        "idempotency_keys": args.idempotency_keys,
        "start_unix_ms": start_unix_ms,
        "end_unix_ms": end_unix_ms,
        "ops": recs.len(),
        "lost_tasks": lost,
        "ok": recs.iter().filter(|r| (200..300).contains(&r.status)).count(),
        "status": status,
        "x_cache": x_cache,
        "errors": errors,
        "resources": resources,
        "latency_ms": fine_summary(&mut lat),
    }))
}
