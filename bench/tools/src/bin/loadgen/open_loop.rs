//! The engine of the open-loop modes (`rate`, `cycle`): a pacer thread schedules request j at
//! `start + j/rate` into the queue of its URL; each connection of that URL takes the oldest
//! due request when it is free (a due request waits while all are busy), sends it (a GET, or a
//! POST of its body) and records it; a connection the server closed is replaced. After the last scheduled request the run
//! waits at most the drain time for the rest.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::http::{Answer, ConnCounters, Sender, Target, ensure_ready, get_answer};

/// One scheduled request.
pub struct Job {
    pub scheduled: Instant,
    /// The path to GET; None for the path of the URL itself.
    pub path: Option<String>,
    /// POST this body instead of a GET.
    pub post_body: Option<Bytes>,
    /// False for a warm-up request: counted, not recorded.
    pub measured: bool,
}

/// One finished (measured) request.
pub struct Rec {
    /// Index of its URL.
    pub url: usize,
    pub scheduled: Instant,
    pub sent: Instant,
    pub done: Instant,
    pub outcome: Answer,
}

/// Counters over every connection of a run.
#[derive(Default)]
pub struct Counters {
    /// Measured requests sent.
    pub sent: AtomicU64,
    pub warmup_sent: AtomicU64,
    pub warmup_ok: AtomicU64,
    pub conn: ConnCounters,
}

/// The connections of one URL: their queue of due requests and where they record.
struct Lane {
    target: Target,
    url: usize,
    timeout: Duration,
    queue: tokio::sync::Mutex<mpsc::UnboundedReceiver<Job>>,
    recs: Arc<std::sync::Mutex<Vec<Rec>>>,
    counters: Arc<Counters>,
}

/// One connection: take the oldest due request, send it, record it; reconnect when the
/// connection is gone.
async fn worker(lane: Arc<Lane>, first: Sender) {
    let mut sender = Some(first);
    loop {
        let job = {
            let mut q = lane.queue.lock().await;
            q.recv().await
        };
        let Some(job) = job else { return };
        // a usable connection (a new one if the server closed the old one); the time this
        // takes counts in the request's latency
        let ready = ensure_ready(&mut sender, &lane.target, &lane.counters.conn).await;
        let sent = Instant::now();
        let c = &lane.counters;
        let counter = if job.measured {
            &c.sent
        } else {
            &c.warmup_sent
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let path = job.path.as_deref().unwrap_or(&lane.target.path);
        let outcome = get_answer(
            &mut sender,
            ready,
            &lane.target,
            path,
            job.post_body.as_ref(),
            lane.timeout,
        )
        .await;
        let done = Instant::now();
        if job.measured {
            lane.recs.lock().expect("recs lock").push(Rec {
                url: lane.url,
                scheduled: job.scheduled,
                sent,
                done,
                outcome,
            });
        } else if matches!(&outcome, Answer::Response { status, .. } if (200..300).contains(status))
        {
            c.warmup_ok.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What an open-loop run leaves.
pub struct Finished {
    /// The measured requests that finished, in the order they did.
    pub recs: Vec<Rec>,
    pub counters: Arc<Counters>,
    /// Every request finished before the drain deadline.
    pub drained: bool,
    /// When the drain ended.
    pub end: Instant,
}

/// Runs `n` requests at `rate` from `start` over `lanes` (per URL: its target and its open
/// connections), each request answered within `timeout` of its send; `job(j, t)` makes request
/// j, scheduled at t, for the URL it returns. Waits at most `drain_s` after the last one.
pub async fn run<F>(
    lanes: Vec<(Target, Vec<Sender>)>,
    timeout: Duration,
    start: Instant,
    rate: f64,
    n: u64,
    drain_s: f64,
    mut job: F,
) -> Finished
where
    F: FnMut(u64, Instant) -> (usize, Job) + Send + 'static,
{
    let recs = Arc::new(std::sync::Mutex::new(Vec::with_capacity(n as usize)));
    let counters = Arc::new(Counters::default());
    let mut txs = Vec::with_capacity(lanes.len());
    let mut workers = Vec::new();
    for (url, (target, conns)) in lanes.into_iter().enumerate() {
        let (tx, rx) = mpsc::unbounded_channel::<Job>();
        txs.push(tx);
        let lane = Arc::new(Lane {
            target,
            url,
            timeout,
            queue: tokio::sync::Mutex::new(rx),
            recs: recs.clone(),
            counters: counters.clone(),
        });
        for s in conns {
            workers.push(tokio::spawn(worker(lane.clone(), s)));
        }
    }
    let pacer = Pacer::start(start, rate, n, move |j, t| {
        let (url, job) = job(j, t);
        txs[url].send(job).is_ok()
    });

    let last_scheduled = start + Duration::from_secs_f64(n.saturating_sub(1) as f64 / rate);
    let deadline =
        tokio::time::Instant::from_std(last_scheduled + Duration::from_secs_f64(drain_s));
    let joined = tokio::time::timeout_at(deadline, async {
        for w in workers {
            let _ = w.await;
        }
    })
    .await;
    let end = Instant::now();
    // whatever is still running is abandoned: the runtime is dropped after the mode returns
    pacer.finish();
    let recs = std::mem::take(&mut *recs.lock().expect("recs lock"));
    Finished {
        recs,
        counters,
        drained: joined.is_ok(),
        end,
    }
}

/// The pacer thread: an OS thread with `std::thread::sleep`, not the 1 ms tokio timer.
struct Pacer {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Pacer {
    /// Calls `emit(j, t)` for j = 0 .. n at t = `start` + j/`rate`, sleeping until t; ends
    /// early when `emit` returns false or the pacer is stopped.
    fn start<F>(start: Instant, rate: f64, n: u64, mut emit: F) -> Pacer
    where
        F: FnMut(u64, Instant) -> bool + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            // 1 ns timer slack for this thread (default 50 µs): sleeps end on time
            // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
            }
            for j in 0..n {
                let t = start + Duration::from_secs_f64(j as f64 / rate);
                let now = Instant::now();
                if t > now {
                    std::thread::sleep(t - now);
                }
                if stopped.load(Ordering::Relaxed) || !emit(j, t) {
                    return;
                }
            }
            // dropping `emit` (and the queue senders it holds) closes the queues: the workers
            // end once they are empty
        });
        Pacer { stop, thread }
    }

    /// Stops the pacer and waits for its thread.
    fn finish(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}
