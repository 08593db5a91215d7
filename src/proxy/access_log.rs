//! The access log: one line per proxied request, in JSON or nginx's `combined` format,
//! written by a thread of its own so that a slow disk or pipe never slows a request.
//!
//! # What a request pays
//!
//! With `access_log.format = "off"` (the default) the router reads one atomic flag and
//! nothing else: no clock read, no copy, no body wrapper. With the log on, the router
//! ([`Proxy::handle`](super::Proxy::handle)) copies what the line needs of the request head
//! into one small allocation ([`AccessLog::begin`]: method, target, `User-Agent`, `Referer`;
//! copied rather than shared, so a queued line never holds on to hyper's read buffer), and
//! once the answer is made ([`AccessLog::finish`]) it wraps the response body
//! (`Body::Logged` in `body.rs`), which counts the bytes handed to the connection. When
//! the body ends — sent whole, failed, or dropped because the client went away — the record
//! is completed with the byte count and the total time and handed to the writer with a
//! `try_send` on a bounded channel (`access_log.buffer` lines). Nothing is formatted on the
//! request path, and nothing there waits: a full channel drops the line and counts it
//! (`cacheguard_access_log_lines_total{result="dropped"}`).
//!
//! # The writer
//!
//! A dedicated thread, not a task: `write(2)` to a file, a pipe or a terminal blocks, and
//! the proxy's workers are single-threaded event loops (`server.rs`) that a blocked write
//! would stall. The thread formats what is queued into one buffer and writes it with one
//! `write_all`, then sleeps 5 ms while the next lines gather, and parks only when none
//! came ([`writer`]): under steady traffic no request pays for waking it. A batch costs one
//! system call, and a line is either written whole or counted as failed (`result="failed"`,
//! with a rate-limited warning). `stdout` and `stderr` are locked for the batch, so
//! cacheguard's own log lines never land inside one.
//!
//! A reload (`reload.rs`; `SIGHUP` is one) applies `format`, `sample`, `query` and `path`:
//! the file is opened again (rotation: rename the file, then `SIGHUP`), and the writer
//! switches to it at the first line begun after the reload (lines begun before still go to
//! the old file, in the format of their time). A file that cannot be
//! opened keeps the old log as it was (logged); at start it stops the start. `buffer` needs
//! a restart. Shutdown waits (bounded) for the lines still queued.
//!
//! # What is logged
//!
//! Every request that reaches the router, sampled by `access_log.sample`, except that
//! cacheguard's own answers ([`OwnAnswer`](super::own_answer::OwnAnswer): limits, shed,
//! timeouts, an unreachable origin) and every 5xx are always logged. Requests hyper
//! refuses before the router sees them (`head_guard.rs`: a head over twice
//! `server.max_header_bytes`, a malformed request line, a header read timeout) are not.
//! Fields from the request (method, target, `User-Agent`, `Referer`) are escaped — `"`,
//! `\` and bytes outside printable ASCII become `\xHH`, as nginx does — and capped, so a
//! client can neither break a line nor make one huge.
//!
//! The origin time is what this request's own origin requests waited for their answer's
//! head (retries included; an upload's time excluded), summed: a request that led a fill
//! counts the fill's fetch; one that waited on another request's fill, or was answered
//! from the cache, has none. See [`timing_origin`].

mod line;
mod writer;

use std::cell::Cell;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use http::header;
use http::{Request, StatusCode};
use prometheus::IntCounter;
use tokio::sync::mpsc;

use self::line::{Format, Head, Record};
pub(crate) use self::line::{RouteName, cache_word};
use self::writer::{Sink, SinkSlot};
use crate::config::{AccessLogConfig, AccessLogFormat};
use crate::metrics::AccessLogMetrics;

/// How often [`AccessLog::drain`] looks whether the writer has caught up.
const DRAIN_POLL: Duration = Duration::from_millis(10);

/// The access log's handle, owned by the router: reloadable settings and the channel to the
/// writer thread.
#[derive(Debug)]
pub(crate) struct AccessLog {
    /// Whether a format is set: the only thing read while the log is off.
    on: AtomicBool,
    /// Reloadable (see `reload.rs`).
    settings: ArcSwap<Settings>,
    queue: Arc<Queue>,
    /// Where a reload leaves the file it opened for the writer.
    next_sink: Arc<SinkSlot>,
}

/// What a reload may change, read once per request.
#[derive(Clone, Copy, Debug)]
struct Settings {
    format: Option<Format>,
    sample: f64,
    query: bool,
    /// Which opened file the lines of these settings go to: 0 the one opened at start,
    /// then one more for each file a reload opens.
    sink: u64,
}

impl Settings {
    fn of(config: &AccessLogConfig) -> Self {
        let format = match config.format {
            AccessLogFormat::Off => None,
            AccessLogFormat::Json => Some(Format::Json),
            AccessLogFormat::Combined => Some(Format::Combined),
        };
        Settings {
            format,
            sample: config.sample,
            query: config.query,
            sink: 0,
        }
    }
}

/// The sending side of the channel, shared by the router and every line still waiting for
/// its body to end.
#[derive(Debug)]
struct Queue {
    sender: mpsc::Sender<Record>,
    /// Lines sent and not yet written (or failed) by the writer.
    queued: Arc<AtomicU64>,
    dropped: IntCounter,
}

impl Queue {
    /// Hands `record` to the writer, or drops it (counted) when the channel is full.
    fn send(&self, record: Record) {
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.sender.try_send(record).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            self.dropped.inc();
        }
    }
}

/// A request the log has seen arrive: what its line takes from the request head.
#[derive(Debug)]
pub(crate) struct Started {
    settings: Settings,
    since: Instant,
    record: Record,
}

/// What the router knows of an answer once it is made.
#[derive(Debug)]
pub(crate) struct Answered {
    pub(crate) route: RouteName,
    pub(crate) status: StatusCode,
    /// The `X-Cache` value cacheguard set ([`cache_word`]).
    pub(crate) cache: Option<&'static str>,
    /// Why cacheguard answered itself, for its own answers.
    pub(crate) reason: Option<&'static str>,
    /// See [`timing_origin`].
    pub(crate) origin: Option<Duration>,
}

/// A line waiting for its response body to end; see [`Pending::finish`].
#[derive(Debug)]
pub(crate) struct Pending {
    since: Instant,
    record: Record,
    queue: Arc<Queue>,
}

impl Pending {
    /// Completes the line with the `bytes` of body sent and the time since the request
    /// arrived, and queues it. Called once, by the body wrapper, when the body ends or is
    /// dropped.
    pub(crate) fn finish(mut self, bytes: u64) {
        self.record.bytes = bytes;
        self.record.total = self.since.elapsed();
        self.queue.send(self.record);
    }
}

impl AccessLog {
    /// Opens `config.path` (when a format is set) and starts the writer thread.
    ///
    /// # Errors
    /// The file cannot be opened (the message names it), or the thread cannot be started.
    pub(crate) fn start(
        config: &AccessLogConfig,
        metrics: AccessLogMetrics,
    ) -> Result<Self, String> {
        let settings = Settings::of(config);
        let sink = match settings.format {
            Some(_) => Some(Sink::open(&config.path)?),
            None => None,
        };
        let (sender, receiver) = mpsc::channel(config.buffer.max(1));
        let queued = Arc::new(AtomicU64::new(0));
        let next_sink = Arc::new(SinkSlot::default());
        let dropped = metrics.dropped.clone();
        writer::spawn(
            receiver,
            sink,
            Arc::clone(&next_sink),
            Arc::clone(&queued),
            metrics,
        )
        .map_err(|e| format!("access log: cannot start its writer thread: {e}"))?;
        Ok(AccessLog {
            on: AtomicBool::new(settings.format.is_some()),
            settings: ArcSwap::from_pointee(settings),
            queue: Arc::new(Queue {
                sender,
                queued,
                dropped,
            }),
            next_sink,
        })
    }

    /// Notes a request's arrival, when the log is on.
    pub(crate) fn begin<B>(&self, request: &Request<B>, client: SocketAddr) -> Option<Started> {
        if !self.on.load(Ordering::Relaxed) {
            return None;
        }
        let settings = **self.settings.load();
        let format = settings.format?;
        let headers = request.headers();
        let head = Head::new(
            request.method().as_str(),
            line::target(request.uri(), settings.query),
            headers.get(header::USER_AGENT),
            headers.get(header::REFERER),
        );
        Some(Started {
            settings,
            since: Instant::now(),
            record: Record {
                format,
                sink: settings.sink,
                at: SystemTime::now(),
                client: client.ip(),
                version: request.version(),
                head,
                status: StatusCode::OK,
                cache: None,
                route: RouteName::Static("-"),
                reason: None,
                origin: None,
                bytes: 0,
                total: Duration::ZERO,
            },
        })
    }

    /// The line of a request answered as `answered`, to be finished when its body ends;
    /// `None` when sampling leaves it out. cacheguard's own answers and every 5xx are
    /// always logged.
    pub(crate) fn finish(&self, started: Started, answered: Answered) -> Option<Pending> {
        let Started {
            settings,
            since,
            mut record,
        } = started;
        let always = answered.reason.is_some() || answered.status.is_server_error();
        if !always && settings.sample < 1.0 && rand::random::<f64>() >= settings.sample {
            return None;
        }
        record.status = answered.status;
        record.cache = answered.cache;
        record.route = answered.route;
        record.reason = answered.reason;
        record.origin = answered.origin;
        Some(Pending {
            since,
            record,
            queue: Arc::clone(&self.queue),
        })
    }

    /// Applies a reloaded `[access_log]`: opens its `path` again (a rotated file is
    /// replaced by a new one), then switches format, sample and query. `buffer` is not
    /// changed (it needs a restart).
    ///
    /// # Errors
    /// The file cannot be opened: nothing was changed, the old file and settings stay.
    pub(crate) async fn reconfigure(&self, config: &AccessLogConfig) -> Result<(), String> {
        let mut settings = Settings::of(config);
        settings.sink = self.settings.load().sink;
        if settings.format.is_some() {
            // Opening may block (a FIFO waits for its reader): not on the runtime's thread.
            let path = config.path.clone();
            let sink = tokio::task::spawn_blocking(move || Sink::open(&path))
                .await
                .map_err(|e| format!("access log: opening {}: {e}", config.path))??;
            // Before the new settings: the first line they produce finds the new file, and
            // the lines begun before them still go to the old one.
            settings.sink += 1;
            self.next_sink.put(settings.sink, sink);
        }
        self.settings.store(Arc::new(settings));
        self.on.store(settings.format.is_some(), Ordering::Relaxed);
        Ok(())
    }

    /// Waits, at most `within`, until every line queued so far is written.
    pub(crate) async fn drain(&self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        while self.queue.queued.load(Ordering::Acquire) > 0
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }
}

tokio::task_local! {
    /// The time the requests of the task running [`timing_origin`]'s future waited on the
    /// origin.
    static ORIGIN_WAIT: Cell<Option<Duration>>;
}

/// Runs `future`, summing the time its origin requests wait for an answer (reported by
/// [`origin_waited`], in this task); returns its output and that time (`None`: no origin
/// request).
///
/// The result is `future` and a few words, like `count_commands` (see `tally`).
pub(crate) fn timing_origin<F: Future>(
    future: F,
) -> impl Future<Output = (F::Output, Option<Duration>)> {
    ORIGIN_WAIT.scope(
        Cell::new(None),
        crate::tally::tallied(future, || ORIGIN_WAIT.with(Cell::get)),
    )
}

/// Adds `waited` to the origin time of the [`timing_origin`] this task runs in, if any:
/// called where an origin request gets its answer (`upstream.rs`), and where a fill run in
/// a task of its own hands its time back to the request that led it (`fill.rs`).
pub(crate) fn origin_waited(waited: Duration) {
    let _ = ORIGIN_WAIT.try_with(|sum| sum.set(Some(sum.get().unwrap_or_default() + waited)));
}

#[cfg(test)]
mod tests;
