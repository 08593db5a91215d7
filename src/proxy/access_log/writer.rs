//! The writer thread: takes what is queued, formats it into one buffer and writes that
//! with one `write_all` to where `access_log.path` points.
//!
//! A request that queues a line while the writer is parked in the channel's `blocking_recv`
//! pays for waking it (a futex call, and a context switch on a busy machine). Were the
//! writer to park whenever it has emptied the channel, nearly every line would, at any rate
//! below what keeps it busy. So after each write it sleeps [`GATHER`], and only parks when
//! nothing came in meanwhile: under traffic it wakes once per [`GATHER`] by itself and
//! requests wake nothing; after a quiet spell the first line wakes it, once. A line
//! reaches its file within about [`GATHER`]; `access_log.buffer` must hold what arrives in
//! that time (the default, 8192 lines, holds 5 ms of 1.6 million requests per second).
//!
//! The batch buffer is the write buffering (a `BufWriter` would add a second copy): a
//! batch is at most [`BATCH_LINES`] lines or [`BATCH_BYTES`] bytes, and what is left is
//! written as soon as the channel is empty. A batch whose write fails is counted as
//! failed, whole; the next batch is tried afresh.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;
use tracing::warn;

use super::line::{self, Record, Scratch};
use crate::config::AccessLogPath;
use crate::metrics::AccessLogMetrics;

/// Most lines in one write.
const BATCH_LINES: u64 = 512;
/// A batch is written once it holds this many bytes.
const BATCH_BYTES: usize = 64 * 1024;
/// The writer thread's name (`bench/access_log.sh` finds its CPU time by it).
const WRITER_THREAD: &str = "cg-access-log";
/// How long the writer sleeps after a write, while the next lines gather.
const GATHER: Duration = Duration::from_millis(5);
/// At most one warning about failed writes this often (the count covers the rest).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Where the lines go.
#[derive(Debug)]
pub(super) enum Sink {
    Stdout,
    Stderr,
    File(File),
}

impl Sink {
    /// Opens `path`: a file for appending, created if missing.
    ///
    /// # Errors
    /// The file cannot be opened; the message names it.
    pub(super) fn open(path: &AccessLogPath) -> Result<Sink, String> {
        match path {
            AccessLogPath::Stdout => Ok(Sink::Stdout),
            AccessLogPath::Stderr => Ok(Sink::Stderr),
            AccessLogPath::File(file) => OpenOptions::new()
                .append(true)
                .create(true)
                .open(file)
                .map(Sink::File)
                .map_err(|e| format!("access_log.path {}: cannot open: {e}", file.display())),
        }
    }

    /// Writes `bytes` whole. The standard streams are locked for it, so no other line of
    /// the process lands inside.
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(bytes)?;
                out.flush()
            }
            Sink::Stderr => {
                let mut out = io::stderr().lock();
                out.write_all(bytes)?;
                out.flush()
            }
            Sink::File(file) => file.write_all(bytes),
        }
    }
}

/// A sink opened by a reload, waiting for the writer to take it, with its number (each
/// reload that opens a file numbers it one more than the last).
#[derive(Debug, Default)]
pub(super) struct SinkSlot {
    next: Mutex<Option<(u64, Sink)>>,
    /// Set with `next`: what the writer checks before each line.
    ready: AtomicBool,
}

impl SinkSlot {
    /// Leaves sink number `number` for the writer, which switches to it at the first line
    /// begun under the settings that opened it (or later ones).
    pub(super) fn put(&self, number: u64, sink: Sink) {
        *self.next.lock().unwrap_or_else(PoisonError::into_inner) = Some((number, sink));
        self.ready.store(true, Ordering::Release);
    }

    /// The waiting sink, if one is waiting and a line numbered `line` belongs to it.
    fn take(&self, line: u64) -> Option<(u64, Sink)> {
        if !self.ready.load(Ordering::Acquire) {
            return None;
        }
        let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        if next.as_ref().is_none_or(|(number, _)| *number > line) {
            return None;
        }
        self.ready.store(false, Ordering::Release);
        next.take()
    }
}

/// Starts the writer thread; it ends when every sender is gone, after writing what is left.
///
/// # Errors
/// The thread cannot be started.
pub(super) fn spawn(
    receiver: mpsc::Receiver<Record>,
    sink: Option<Sink>,
    next: Arc<SinkSlot>,
    queued: Arc<AtomicU64>,
    metrics: AccessLogMetrics,
) -> io::Result<()> {
    let writer = Writer {
        sink,
        number: 0,
        next,
        queued,
        metrics,
        batch: Vec::with_capacity(BATCH_BYTES),
        lines: 0,
        scratch: Scratch::default(),
        failed_since_warning: 0,
        last_warning: None,
    };
    std::thread::Builder::new()
        // At most 15 bytes: the name the kernel keeps (`/proc/PID/task/TID/comm`).
        .name(WRITER_THREAD.to_owned())
        .spawn(move || writer.run(receiver))
        .map(drop)
}

struct Writer {
    sink: Option<Sink>,
    /// The number of `sink` (see [`SinkSlot`]).
    number: u64,
    next: Arc<SinkSlot>,
    queued: Arc<AtomicU64>,
    metrics: AccessLogMetrics,
    batch: Vec<u8>,
    /// Lines in `batch`.
    lines: u64,
    scratch: Scratch,
    failed_since_warning: u64,
    last_warning: Option<Instant>,
}

impl Writer {
    fn run(mut self, mut receiver: mpsc::Receiver<Record>) {
        loop {
            let first = match receiver.try_recv() {
                Ok(record) => record,
                // A quiet spell: park until a line comes.
                Err(TryRecvError::Empty) => match receiver.blocking_recv() {
                    Some(record) => record,
                    None => break,
                },
                Err(TryRecvError::Disconnected) => break,
            };
            let mut next = Some(first);
            while let Some(record) = next.take() {
                self.add(&record);
                drop(record);
                if self.lines >= BATCH_LINES || self.batch.len() >= BATCH_BYTES {
                    self.flush();
                }
                next = receiver.try_recv().ok();
            }
            self.flush();
            std::thread::sleep(GATHER);
        }
    }

    fn add(&mut self, record: &Record) {
        // A reload opened the file again: lines begun before it go to the old one, what
        // was formatted before goes there too.
        if record.sink > self.number
            && let Some((number, sink)) = self.next.take(record.sink)
        {
            self.flush();
            self.sink = Some(sink);
            self.number = number;
        }
        line::write(record, &mut self.scratch, &mut self.batch);
        self.lines += 1;
    }

    fn flush(&mut self) {
        if self.lines == 0 {
            return;
        }
        let written = match &mut self.sink {
            Some(sink) => sink.write_all(&self.batch),
            None => Err(io::Error::other("no access log destination is open")),
        };
        match written {
            Ok(()) => self.metrics.written.inc_by(self.lines),
            Err(error) => self.failed(self.lines, &error),
        }
        self.queued.fetch_sub(self.lines, Ordering::AcqRel);
        self.batch.clear();
        self.lines = 0;
    }

    fn failed(&mut self, lines: u64, error: &io::Error) {
        self.metrics.failed.inc_by(lines);
        self.failed_since_warning += lines;
        if self
            .last_warning
            .is_some_and(|last| last.elapsed() < WARN_EVERY)
        {
            return;
        }
        self.last_warning = Some(Instant::now());
        warn!(
            message = "Access log lines could not be written.",
            %error,
            lines = self.failed_since_warning,
        );
        self.failed_since_warning = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AccessLogPath;
    use crate::metrics::Metrics;
    use crate::proxy::access_log::line::tests::record;

    /// A line begun before a reload goes to the file of its time, however late the writer
    /// takes it; the first line begun after goes to the new file.
    #[test]
    fn lines_go_to_the_file_of_the_settings_they_began_under() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (first, second) = (dir.path().join("first.log"), dir.path().join("second.log"));
        let open = |path: &std::path::Path| {
            Sink::open(&AccessLogPath::File(path.to_owned())).expect("opens")
        };
        let (sender, receiver) = mpsc::channel(8);
        let slot = Arc::new(SinkSlot::default());
        let metrics = Metrics::unregistered().access_log.clone();
        let writer = Writer {
            sink: Some(open(&first)),
            number: 0,
            next: Arc::clone(&slot),
            queued: Arc::default(),
            metrics,
            batch: Vec::new(),
            lines: 0,
            scratch: Scratch::default(),
            failed_since_warning: 0,
            last_warning: None,
        };
        // Begun before the reload, taken by the writer after it.
        let mut before = record(super::super::line::Format::Json);
        before.sink = 0;
        let mut after = record(super::super::line::Format::Combined);
        after.sink = 1;
        sender.try_send(before).expect("queued");
        slot.put(1, open(&second));
        sender.try_send(after).expect("queued");
        drop(sender);
        writer.run(receiver);
        let read = |path: &std::path::Path| std::fs::read_to_string(path).unwrap_or_default();
        let (a, b) = (read(&first), read(&second));
        assert_eq!(a.lines().count(), 1, "{a:?}");
        assert!(a.starts_with('{'), "{a:?}");
        assert_eq!(b.lines().count(), 1, "{b:?}");
        assert!(!b.starts_with('{'), "{b:?}");
    }
}
