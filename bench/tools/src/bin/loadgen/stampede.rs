//! `loadgen stampede`: C connections, one GET of the same URL on each, released at once (see
//! the crate docs).

use std::collections::BTreeMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc, watch};

use crate::StampedeArgs;
use crate::http::{Sender, Target, fetch, get, handshake, parse_targets, tcp_connect, x_cache_of};
use crate::stats::{Counts, bump, ms, round3, summary};

/// When the first write after `armed` happened on one connection.
#[derive(Default)]
struct WriteMark {
    armed: AtomicBool,
    at: OnceLock<Instant>,
}

/// A TcpStream that records, once armed, the instant of its first write.
struct TimedStream {
    inner: TcpStream,
    mark: Arc<WriteMark>,
}

impl TimedStream {
    fn note_write(&self) {
        if self.mark.armed.load(Ordering::Acquire) && self.mark.at.get().is_none() {
            let _ = self.mark.at.set(Instant::now());
        }
    }
}

impl AsyncRead for TimedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TimedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.note_write();
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.note_write();
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

enum Outcome {
    /// Setup failed; the stampede request was never sent.
    SetupFailed(String),
    Done {
        status: u16,
        x_cache: String,
        body_len: usize,
        sent: Instant,
        done: Instant,
    },
    Error {
        msg: String,
        sent: Option<Instant>,
    },
    Timeout {
        sent: Option<Instant>,
    },
}

struct ConnReport {
    target: usize,
    warm_x_cache: Option<String>,
    outcome: Outcome,
}

struct Shared {
    targets: Vec<Target>,
    warm_path: Option<String>,
    timeout: Duration,
    sem: Semaphore,
}

/// Sets one connection up (connect, handshake, warm-up GET), with bounded parallelism: the
/// sender and the warm-up's X-Cache.
async fn set_up(
    sh: &Shared,
    t: &Target,
    mark: &Arc<WriteMark>,
) -> Result<(Sender, Option<String>), String> {
    let _permit = sh.sem.acquire().await.map_err(|e| e.to_string())?;
    let stream = tcp_connect(t.addr).await?;
    let mut sender = handshake(TimedStream {
        inner: stream,
        mark: mark.clone(),
    })
    .await?;
    let Some(wp) = &sh.warm_path else {
        return Ok((sender, None));
    };
    let fut = async {
        let resp = sender
            .send_request(get(t, wp))
            .await
            .map_err(|e| format!("warm: {e}"))?;
        let xc = x_cache_of(&resp);
        let status = resp.status();
        resp.into_body()
            .collect()
            .await
            .map_err(|e| format!("warm body: {e}"))?;
        if !status.is_success() {
            return Err(format!("warm: status {status}"));
        }
        Ok::<_, String>(xc)
    };
    let xc = tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .map_err(|_| "warm timeout".to_owned())??;
    Ok((sender, Some(xc)))
}

async fn connection(
    sh: Arc<Shared>,
    ti: usize,
    settled: mpsc::UnboundedSender<bool>,
    mut release: watch::Receiver<Option<Instant>>,
) -> ConnReport {
    let t = &sh.targets[ti];
    let mark = Arc::new(WriteMark::default());
    let mut report = ConnReport {
        target: ti,
        warm_x_cache: None,
        outcome: Outcome::SetupFailed("not set up".into()),
    };

    let mut sender = match set_up(&sh, t, &mark).await {
        Ok((sender, wx)) => {
            report.warm_x_cache = wx;
            let _ = settled.send(true);
            sender
        }
        Err(e) => {
            let _ = settled.send(false);
            report.outcome = Outcome::SetupFailed(e);
            return report;
        }
    };

    // --- wait for the release ---
    if release.wait_for(|v| v.is_some()).await.is_err() {
        report.outcome = Outcome::SetupFailed("release channel closed".into());
        return report;
    }
    if let Err(e) = sender.ready().await {
        report.outcome = Outcome::Error {
            msg: format!("connection not ready at release: {e}"),
            sent: None,
        };
        return report;
    }
    mark.armed.store(true, Ordering::Release);
    let sent = || mark.at.get().copied();
    report.outcome =
        match tokio::time::timeout(sh.timeout, fetch(&mut sender, get(t, &t.path))).await {
            Ok(Ok((status, x_cache, body))) => {
                let done = Instant::now();
                Outcome::Done {
                    status,
                    x_cache,
                    body_len: body.len(),
                    sent: sent().unwrap_or(done),
                    done,
                }
            }
            Ok(Err(msg)) => Outcome::Error { msg, sent: sent() },
            Err(_) => Outcome::Timeout { sent: sent() },
        };
    report
}

pub async fn stampede(args: StampedeArgs) -> Result<Value, String> {
    if args.concurrency == 0 {
        return Err("--concurrency must be > 0".into());
    }
    let targets = parse_targets(&args.urls)?;
    let ntargets = targets.len();
    let sh = Arc::new(Shared {
        targets,
        warm_path: args.warm_path.clone(),
        timeout: Duration::from_secs_f64(args.timeout_s),
        sem: Semaphore::new(args.connect_parallelism.max(1)),
    });
    let (settled_tx, mut settled_rx) = mpsc::unbounded_channel();
    let (release_tx, release_rx) = watch::channel(None);

    let setup_start = Instant::now();
    let mut handles = Vec::with_capacity(args.concurrency);
    for i in 0..args.concurrency {
        handles.push(tokio::spawn(connection(
            sh.clone(),
            i % ntargets,
            settled_tx.clone(),
            release_rx.clone(),
        )));
    }
    drop(settled_tx);

    // Wait until every connection is ready or failed (bounded).
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(args.setup_timeout_s);
    let (mut ready, mut failed) = (0usize, 0usize);
    while ready + failed < args.concurrency {
        match tokio::time::timeout_at(deadline, settled_rx.recv()).await {
            Ok(Some(true)) => ready += 1,
            Ok(Some(false)) => failed += 1,
            Ok(None) | Err(_) => break,
        }
    }
    let setup_ms = ms(setup_start.elapsed());
    tokio::time::sleep(Duration::from_millis(args.settle_ms)).await;

    let release_at = Instant::now();
    let _ = release_tx.send(Some(release_at));

    // Every task is bounded by its own timeouts; this is a backstop.
    let backstop = Duration::from_secs_f64(args.timeout_s + args.setup_timeout_s + 10.0);
    let mut reports = Vec::with_capacity(handles.len());
    let mut lost = 0usize;
    for h in handles {
        match tokio::time::timeout(backstop, h).await {
            Ok(Ok(r)) => reports.push(r),
            _ => lost += 1,
        }
    }

    // --- aggregate ---
    let mut lat = Vec::new();
    let mut since_release = Vec::new();
    let mut send_offsets = Vec::new();
    let mut counts = Counts::default();
    let mut warm_x_cache: BTreeMap<String, u64> = BTreeMap::new();
    let mut hist: BTreeMap<u64, u64> = BTreeMap::new();
    let mut per_target: Vec<(Vec<f64>, BTreeMap<String, u64>, u64)> = (0..ntargets)
        .map(|_| (Vec::new(), BTreeMap::new(), 0))
        .collect();
    let mut setup_failures = 0u64;
    let since = |at: &Instant| ms(at.saturating_duration_since(release_at));

    for r in &reports {
        if let Some(w) = &r.warm_x_cache {
            bump(&mut warm_x_cache, w);
        }
        let pt = &mut per_target[r.target];
        match &r.outcome {
            Outcome::SetupFailed(e) => {
                setup_failures += 1;
                bump(&mut counts.error_samples, &format!("setup: {e}"));
            }
            Outcome::Done {
                status,
                x_cache,
                body_len,
                sent,
                done,
            } => {
                let l = ms(done.saturating_duration_since(*sent));
                lat.push(l);
                since_release.push(since(done));
                send_offsets.push(since(sent));
                counts.response(*status, x_cache, *body_len);
                *hist.entry((l / 50.0).floor() as u64 * 50).or_default() += 1;
                pt.0.push(l);
                bump(&mut pt.1, x_cache);
                pt.2 += 1;
            }
            Outcome::Error { msg, sent } => {
                counts.error(msg);
                pt.2 += 1;
                send_offsets.extend(sent.as_ref().map(since));
            }
            Outcome::Timeout { sent } => {
                counts.timeout();
                pt.2 += 1;
                send_offsets.extend(sent.as_ref().map(since));
            }
        }
    }
    let all_latencies = if args.dump_latencies {
        let mut v = lat.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        json!(
            v.iter()
                .map(|x| (x * 1000.0).round() / 1000.0)
                .collect::<Vec<_>>()
        )
    } else {
        Value::Null
    };
    let latency = summary(&mut lat);
    let since_release = summary(&mut since_release);
    send_offsets.sort_by(|a, b| a.total_cmp(b));
    let skew = match (send_offsets.first(), send_offsets.last()) {
        (Some(a), Some(b)) => round3(b - a),
        _ => Value::Null,
    };
    let sends = summary(&mut send_offsets);
    let per_url: Vec<Value> = per_target
        .iter_mut()
        .enumerate()
        .map(|(i, (l, xc, n))| {
            json!({
                "url": sh.targets[i].url,
                "requests": n,
                "latency_ms": summary(l),
                "x_cache": xc,
            })
        })
        .collect();
    let hist: BTreeMap<String, u64> = hist
        .into_iter()
        .map(|(k, v)| (format!("{:05}-{:05}", k, k + 50), v))
        .collect();

    let mut out = json!({
        "urls": args.urls,
        "warm_path": args.warm_path,
        "concurrency": args.concurrency,
        "ready": ready,
        "setup_failures": setup_failures,
        "setup_ms": round3(setup_ms),
        "settle_ms": args.settle_ms,
        "count": reports.len() as u64 - setup_failures,
        "lost_tasks": lost,
        "latency_ms": latency,
        "since_release_ms": since_release,
        "send_offset_ms": sends,
        "send_skew_ms": skew,
        "warm_x_cache": warm_x_cache,
        "latency_hist_50ms": hist,
        "per_url": per_url,
        "latencies_ms": all_latencies,
    });
    counts.report(&mut out);
    Ok(out)
}
