//! The durable retry journal for owed cache invalidations.
//!
//! A write that cannot invalidate the shared cache (Redis is down, or the command failed)
//! must not forget it: the invalidation is appended here, to a local file, and
//! [`run_retries`] applies it once Redis answers again — after a restart of cacheguard too.
//! Invalidations are idempotent, so wherever a choice exists the journal picks "applied
//! twice" over "lost".
//!
//! # Format
//!
//! Lines, one record each: the CRC-32 of the JSON record in 8 hex digits, a space, and the
//! record (`cut -c10- journal | jq` reads it). Ids increase monotonically; a reopened
//! journal continues after the highest id it finds.
//!
//! ```text
//! 5e0c83d1 {"op":"owe","id":7,"at_ms":1763790000000,"owed":{"kind":"key","base":"<32 hex digits>","generation_ttl_ms":180000}}
//! 0b6f2a9e {"op":"owe","id":8,"at_ms":1763790000004,"owed":{"kind":"tag","tag":"user:42"}}
//! 6b1d0f44 {"op":"owe","id":9,"at_ms":1763790000009,"owed":{"kind":"key","base":"<32 hex digits>","generation_ttl_ms":180000,"floor":{"version":"42","ttl_ms":10000}}}
//! 9a41c0f2 {"op":"done","id":7}
//! ```
//!
//! The checksum is what makes a damaged record visible: one flipped hex digit in a key is
//! still valid JSON, and would replay against a key nobody uses while the real entry stayed
//! stale. A line that starts with `{` is a record from before checksums and is read as it
//! is (an older journal replays after an upgrade).
//!
//! Pending is every `owe` without its `done`. On open, a last line that does not check or
//! parse is a write torn by a crash (no newline, or the zeros a file system leaves after a
//! power loss), whose `append` never returned: dropped, with a log line. Any other line
//! whose checksum does not match is skipped, logged and counted as corrupt and as a
//! give-up; one that does not parse is skipped, logged and counted as a give-up. An exclusive lock
//! on `<path>.lock` keeps a second process off the journal; it is a file of its own so
//! that compaction's rename cannot drop it.
//!
//! # Writing and durability
//!
//! One writer thread owns the file. Callers queue their lines on a channel; the writer
//! takes everything queued, writes it with one `write_all`, syncs per [`FsyncPolicy`] and
//! answers every caller: concurrent appends share one `fdatasync` (group commit). It is a
//! thread rather than a task because `write` and `fdatasync` block, and a slow disk must
//! not stall a runtime worker.
//!
//! - [`FsyncPolicy::Always`] (default): `append` returns after `fdatasync`. The record
//!   survives a crash of cacheguard and a power loss or kernel crash.
//! - [`FsyncPolicy::Interval`]: `append` returns after `write(2)`. The record is in the
//!   page cache, so it survives a crash (or kill) of cacheguard; a power loss or kernel
//!   crash can lose what was appended in the last interval.
//! - [`FsyncPolicy::Never`]: the same, with the kernel's writeback period (about 30 s on
//!   Linux) as the interval.
//!
//! `done` records are written but never synced on their own: a lost `done` only means one
//! more (harmless) apply of that invalidation after a restart.
//!
//! # Compaction
//!
//! In the writer, after a batch, so it never races an append: when nothing is pending the
//! file is truncated to empty (not synced: were the truncation lost, the records behind it
//! would only be applied again); when the file holds more than 4× as many lines as pending
//! records and more than 1000 lines, the pending `owe` records are written to
//! `<path>.tmp`, which is synced and renamed over `<path>`, and the directory is synced.
//! The rewrite is synced under every policy, `Never` included: it is rare, and a rename of
//! unsynced data could leave an empty journal after a power loss. Open compacts too, so
//! appends never follow a torn line.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions, TryLockError};
use std::future::Future;
use std::io::{self, Write};
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::clock::now_ms;
use crate::metrics::JournalMetrics;

/// First wait after a failed retry round.
const RETRY_INITIAL: Duration = Duration::from_millis(100);
/// Longest wait between retry rounds.
const RETRY_MAX: Duration = Duration::from_secs(5);
/// How often a waiting retry loop refreshes the age gauge and looks for records nobody
/// woke it for.
const TICK: Duration = Duration::from_secs(1);
/// Successful retries marked done per write.
const DONE_BATCH: usize = 128;
/// A file with more lines than this, and more than [`COMPACT_RATIO`] lines per pending
/// record, is rewritten.
const COMPACT_MIN_LINES: u64 = 1000;
const COMPACT_RATIO: u64 = 4;

/// One invalidation owed to the shared cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum Owed {
    /// Every variant of one base key: its xxh3-128 hash as 32 lowercase hex digits, and how
    /// long the key's generation must live, in ms; with a write's version floor, when it
    /// had one (records from before floors have none).
    Key {
        base: String,
        generation_ttl_ms: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        floor: Option<OwedFloor>,
    },
    /// Every entry that carried this surrogate key (tag).
    Tag { tag: String },
}

/// A write's version floor in a journal record: the version as decimal digits (a JSON
/// number would lose a large one), and how long it holds, in ms from when it is applied.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct OwedFloor {
    pub(crate) version: String,
    pub(crate) ttl_ms: u64,
}

/// When an append is durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum FsyncPolicy {
    /// fdatasync before `append` returns (group commit: concurrent appends share one sync). Default.
    #[default]
    Always,
    /// `append` returns after write(2) (survives a crash of cacheguard, not of the machine);
    /// fdatasync at most every this long.
    Interval(Duration),
    /// Never sync explicitly; the OS decides.
    Never,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum JournalError {
    #[error("retry journal {path}: cannot {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("retry journal {path} is in use by another process (it holds {lock})")]
    InUse { path: PathBuf, lock: PathBuf },
    #[error("retry journal {path}: the writer thread has stopped")]
    Closed { path: PathBuf },
}

fn io_error(path: &Path, op: &'static str, source: io::Error) -> JournalError {
    JournalError::Io {
        path: path.to_owned(),
        op,
        source,
    }
}

/// One line of the file, as written.
#[derive(Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum LineOut<'a> {
    Owe { id: u64, at_ms: u64, owed: &'a Owed },
    Done { id: u64 },
}

/// One line of the file, as read.
#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum LineIn {
    Owe { id: u64, at_ms: u64, owed: Owed },
    Done { id: u64 },
}

/// Appends one line and its newline to `buf` (all or nothing): checksum, space, record.
fn push_line(buf: &mut Vec<u8>, line: &LineOut<'_>) -> io::Result<()> {
    let json = serde_json::to_vec(line).map_err(io::Error::other)?;
    let crc = crc32fast::hash(&json);
    buf.extend_from_slice(format!("{crc:08x} ").as_bytes());
    buf.extend_from_slice(&json);
    buf.push(b'\n');
    Ok(())
}

/// Why a line could not be read.
enum BadLine {
    /// Its checksum does not match its record: the file was damaged.
    Corrupt,
    /// It does not parse as a record.
    Unreadable(String),
}

/// Reads one line: checked against its checksum, or as it is when it predates them.
fn parse_line(line: &[u8]) -> Result<LineIn, BadLine> {
    let json = if line.first() == Some(&b'{') {
        line
    } else {
        let (crc, json) = match line.split_at_checked(9) {
            Some((head, json)) if head.last() == Some(&b' ') => (&head[..8], json),
            _ => return Err(BadLine::Unreadable("no checksum".to_owned())),
        };
        let expected = std::str::from_utf8(crc)
            .ok()
            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
            .ok_or_else(|| BadLine::Unreadable("no checksum".to_owned()))?;
        if crc32fast::hash(json) != expected {
            return Err(BadLine::Corrupt);
        }
        json
    };
    serde_json::from_slice::<LineIn>(json).map_err(|e| BadLine::Unreadable(e.to_string()))
}

/// `<path><suffix>`, next to the journal.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

fn open_append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// A pending record.
#[derive(Debug)]
struct Record {
    owed: Owed,
    at_ms: u64,
    /// Taken by the retry loop and being applied: an equal record appended now is a new
    /// record, because the apply in flight may have run before the write that owes it.
    claimed: bool,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    /// By id, so oldest first.
    pending: BTreeMap<u64, Record>,
    /// The unclaimed pending record of each value, for deduplication and `done`.
    unclaimed: HashMap<Owed, u64>,
}

impl State {
    fn remove(&mut self, id: u64) -> Option<Record> {
        let record = self.pending.remove(&id)?;
        if self.unclaimed.get(&record.owed) == Some(&id) {
            self.unclaimed.remove(&record.owed);
        }
        Some(record)
    }
}

/// What the caller side and the writer thread share.
#[derive(Debug)]
struct Shared {
    path: PathBuf,
    metrics: JournalMetrics,
    state: Mutex<State>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Brings the depth and age gauges up to date.
    fn publish(&self, state: &State) {
        self.metrics
            .depth
            .set(i64::try_from(state.pending.len()).unwrap_or(i64::MAX));
        let age_ms = state
            .pending
            .values()
            .map(|r| r.at_ms)
            .next()
            .map_or(0, |at| now_ms().saturating_sub(at));
        self.metrics
            .oldest_pending_seconds
            .set(age_ms as f64 / 1000.0);
    }
}

/// An io error as the writer reports it to every caller of a batch (`io::Error` is not
/// `Clone`).
#[derive(Clone, Debug)]
struct Failure {
    op: &'static str,
    kind: io::ErrorKind,
    message: String,
}

impl Failure {
    fn new(op: &'static str, error: &io::Error) -> Self {
        Failure {
            op,
            kind: error.kind(),
            message: error.to_string(),
        }
    }

    fn into_error(self, path: &Path) -> JournalError {
        io_error(path, self.op, io::Error::new(self.kind, self.message))
    }
}

/// Labels an io result with the operation, for the writer.
fn step<T>(op: &'static str, result: io::Result<T>) -> Result<T, Failure> {
    result.map_err(|e| Failure::new(op, &e))
}

/// Lines for the writer.
struct Request {
    bytes: Vec<u8>,
    lines: u64,
    /// Ids of the `owe` records among the lines: no longer pending if they cannot be
    /// written.
    owes: Vec<u64>,
    /// Wants an fdatasync under [`FsyncPolicy::Always`] (`owe` records and duplicates of
    /// them; not `done` records).
    sync: bool,
    ack: oneshot::Sender<Result<(), Failure>>,
}

/// The durable retry journal. See the module docs.
pub(crate) struct Journal {
    shared: Arc<Shared>,
    fsync: FsyncPolicy,
    tx: Option<mpsc::Sender<Request>>,
    writer: Option<JoinHandle<()>>,
    /// Held (locked) for the journal's lifetime.
    _lock: File,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("path", &self.shared.path)
            .field("fsync", &self.fsync)
            .field("depth", &self.depth())
            .finish_non_exhaustive()
    }
}

impl Drop for Journal {
    /// Closes the channel and waits for the writer to finish what is queued (only what
    /// dropped `append`/`done` futures left) and its final sync, so the lock is released
    /// only once nothing writes the file. Blocks the dropping thread for that long.
    fn drop(&mut self) {
        self.tx.take();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl Journal {
    /// Opens or creates the journal at `path` (parent dir created if missing), takes an
    /// exclusive lock on `<path>.lock` — a second process on the same journal gets
    /// [`JournalError::InUse`] — and loads the pending records (appended minus done).
    /// Compacts the file on open. Needs no runtime: the writer is a thread.
    ///
    /// # Errors
    /// When the directory, the lock or the file cannot be created, read or compacted, or
    /// the lock is held.
    pub(crate) fn open(
        path: &Path,
        fsync: FsyncPolicy,
        metrics: JournalMetrics,
    ) -> Result<Arc<Journal>, JournalError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).map_err(|e| io_error(path, "create its directory", e))?;
        }
        let lock_path = sibling(path, ".lock");
        let lock = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|e| io_error(path, "open its lock file", e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(JournalError::InUse {
                    path: path.to_owned(),
                    lock: lock_path,
                });
            }
            Err(TryLockError::Error(e)) => return Err(io_error(path, "lock", e)),
        }

        let loaded = load(path, &metrics)?;
        let mut state = State {
            next_id: loaded.max_id.saturating_add(1),
            ..State::default()
        };
        for (id, (owed, at_ms)) in loaded.records {
            // An equal record already pending covers this one (owed again while being
            // applied, then a crash before either was done).
            if state.unclaimed.contains_key(&owed) {
                continue;
            }
            state.unclaimed.insert(owed.clone(), id);
            state.pending.insert(
                id,
                Record {
                    owed,
                    at_ms,
                    claimed: false,
                },
            );
        }
        let tidy = loaded.tidy && loaded.lines == state.pending.len() as u64;
        let file = open_append(path).map_err(|e| io_error(path, "open", e))?;
        let shared = Arc::new(Shared {
            path: path.to_owned(),
            metrics,
            state: Mutex::new(state),
        });
        let mut writer = Writer {
            shared: Arc::clone(&shared),
            fsync,
            file: Some(file),
            len: loaded.len,
            lines: loaded.lines,
            written: loaded.max_id,
            dirty: false,
            last_sync: Instant::now(),
        };
        if !tidy {
            writer.open_compaction().map_err(|f| f.into_error(path))?;
        }
        shared.publish(&shared.state());

        let (tx, rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("cacheguard-journal".to_owned())
            .spawn(move || writer.run(rx))
            .map_err(|e| io_error(path, "start its writer thread", e))?;
        Ok(Arc::new(Journal {
            shared,
            fsync,
            tx: Some(tx),
            writer: Some(handle),
            _lock: lock,
        }))
    }

    /// Appends records; returns once they are durable per the policy. Records equal to one
    /// already pending are not written twice (the call still waits until that one is
    /// durable). On an io error: returns the error, the records are no longer pending, and
    /// one give-up is counted per record (the caller logs at error level).
    ///
    /// # Cancel safety
    /// Dropping the future does not take back what it queued.
    pub(crate) async fn append(&self, owed: Vec<Owed>) -> Result<(), JournalError> {
        if owed.is_empty() {
            return Ok(());
        }
        let records = owed.len() as u64;
        let (ack, answer) = oneshot::channel();
        let owes = {
            let mut state = self.shared.state();
            let at_ms = now_ms();
            let mut bytes = Vec::new();
            let mut owes = Vec::new();
            let mut encoded = Ok(());
            for owed in owed {
                if state.unclaimed.contains_key(&owed) {
                    continue;
                }
                let id = state.next_id;
                encoded = push_line(
                    &mut bytes,
                    &LineOut::Owe {
                        id,
                        at_ms,
                        owed: &owed,
                    },
                );
                if encoded.is_err() {
                    break;
                }
                state.next_id += 1;
                state.unclaimed.insert(owed.clone(), id);
                state.pending.insert(
                    id,
                    Record {
                        owed,
                        at_ms,
                        claimed: false,
                    },
                );
                owes.push(id);
            }
            let sent = match encoded {
                Ok(()) => self.send(Request {
                    bytes,
                    lines: owes.len() as u64,
                    owes: owes.clone(),
                    sync: true,
                    ack,
                }),
                Err(e) => Err(io_error(&self.shared.path, "encode a record", e)),
            };
            if let Err(error) = sent {
                for id in &owes {
                    state.remove(*id);
                }
                self.shared.publish(&state);
                self.shared.metrics.give_ups.inc_by(records);
                return Err(error);
            }
            self.shared.publish(&state);
            owes
        };
        let result = match answer.await {
            Ok(result) => result.map_err(|f| f.into_error(&self.shared.path)),
            Err(_) => Err(self.closed()),
        };
        match &result {
            Ok(()) => self.shared.metrics.appended.inc_by(owes.len() as u64),
            Err(_) => {
                // The writer already dropped what it could not write; this covers a writer
                // that went away.
                let mut state = self.shared.state();
                for id in &owes {
                    state.remove(*id);
                }
                self.shared.publish(&state);
                self.shared.metrics.give_ups.inc_by(records);
            }
        }
        result
    }

    /// Pending records, oldest first, each with the unix-ms time it was first journaled.
    pub(crate) fn pending(&self) -> Vec<(Owed, u64)> {
        self.shared
            .state()
            .pending
            .values()
            .map(|r| (r.owed.clone(), r.at_ms))
            .collect()
    }

    pub(crate) fn depth(&self) -> usize {
        self.shared.state().pending.len()
    }

    /// Marks records done (no longer owed). A record the retry loop is applying at this
    /// moment is left to it. Returns once the `done` lines are written (not synced: a lost
    /// `done` only means one more apply after a restart).
    #[allow(dead_code)] // the API for callers that retire records themselves; the retry loop retires by id
    pub(crate) async fn done(&self, owed: &[Owed]) -> Result<(), JournalError> {
        self.retire(|state| {
            owed.iter()
                .filter_map(|o| state.unclaimed.get(o).copied())
                .collect()
        })
        .await
    }

    pub(crate) fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Removes the records `select` picks (by id) and writes their `done` lines.
    async fn retire(&self, select: impl FnOnce(&State) -> Vec<u64>) -> Result<(), JournalError> {
        let (ack, answer) = oneshot::channel();
        {
            let mut state = self.shared.state();
            let ids = select(&state);
            let mut bytes = Vec::new();
            let mut lines = 0;
            for id in ids {
                if state.remove(id).is_some() {
                    push_line(&mut bytes, &LineOut::Done { id })
                        .map_err(|e| io_error(&self.shared.path, "encode a record", e))?;
                    lines += 1;
                }
            }
            self.shared.publish(&state);
            if lines == 0 {
                return Ok(());
            }
            self.send(Request {
                bytes,
                lines,
                owes: Vec::new(),
                sync: false,
                ack,
            })?;
        }
        match answer.await {
            Ok(result) => result.map_err(|f| f.into_error(&self.shared.path)),
            Err(_) => Err(self.closed()),
        }
    }

    /// Queues a request. Called with the state locked, so the writer sees requests in id
    /// order.
    fn send(&self, request: Request) -> Result<(), JournalError> {
        match &self.tx {
            Some(tx) => tx.send(request).map_err(|_| self.closed()),
            None => Err(self.closed()),
        }
    }

    fn closed(&self) -> JournalError {
        JournalError::Closed {
            path: self.shared.path.clone(),
        }
    }

    fn refresh_gauges(&self) {
        self.shared.publish(&self.shared.state());
    }

    /// Takes the oldest unclaimed record after `after` for the retry loop.
    fn claim_next(&self, after: Option<u64>) -> Option<(u64, Owed)> {
        let mut state = self.shared.state();
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        let (id, owed) = state
            .pending
            .range_mut((from, Bound::Unbounded))
            .find(|(_, r)| !r.claimed)
            .map(|(id, r)| {
                r.claimed = true;
                (*id, r.owed.clone())
            })?;
        if state.unclaimed.get(&owed) == Some(&id) {
            state.unclaimed.remove(&owed);
        }
        Some((id, owed))
    }

    /// Gives back a claimed record that was not applied.
    fn unclaim(&self, id: u64) {
        let mut state = self.shared.state();
        if let Some(record) = state.pending.get_mut(&id) {
            record.claimed = false;
            let owed = record.owed.clone();
            // An equal record appended meanwhile stays the one appends merge into; this
            // one is simply applied first.
            state.unclaimed.entry(owed).or_insert(id);
        }
    }

    async fn done_ids(&self, ids: Vec<u64>) -> Result<(), JournalError> {
        self.retire(|_| ids).await
    }
}

/// What a journal file holds.
struct Loaded {
    /// Pending `owe` records by id: (value, at_ms).
    records: BTreeMap<u64, (Owed, u64)>,
    max_id: u64,
    /// Non-blank lines, torn or not.
    lines: u64,
    len: u64,
    /// Nothing to drop: no blank, unreadable or torn line, and a final newline.
    tidy: bool,
}

fn load(path: &Path, metrics: &JournalMetrics) -> Result<Loaded, JournalError> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(io_error(path, "read", e)),
    };
    let mut loaded = Loaded {
        records: BTreeMap::new(),
        max_id: 0,
        lines: 0,
        len: bytes.len() as u64,
        tidy: bytes.last().is_none_or(|b| *b == b'\n'),
    };
    let blank = |line: &[u8]| line.trim_ascii().is_empty();
    let segments: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
    // What follows the last newline is an empty segment in a tidy file.
    let last = segments.iter().rposition(|s| !blank(s));
    for (index, segment) in segments.iter().enumerate() {
        if blank(segment) {
            if index + 1 != segments.len() {
                loaded.tidy = false;
            }
            continue;
        }
        loaded.lines += 1;
        match parse_line(segment) {
            Ok(LineIn::Owe { id, at_ms, owed }) => {
                loaded.max_id = loaded.max_id.max(id);
                loaded.records.entry(id).or_insert((owed, at_ms));
            }
            Ok(LineIn::Done { id }) => {
                loaded.max_id = loaded.max_id.max(id);
                loaded.records.remove(&id);
            }
            // A torn last write: its append never returned.
            Err(_) if Some(index) == last => {
                loaded.tidy = false;
                warn!(
                    message = "Retry journal: a torn last record (a write cut by a crash) was dropped; its append never returned.",
                    path = %path.display(),
                    line = index + 1,
                );
            }
            Err(BadLine::Corrupt) => {
                loaded.tidy = false;
                metrics.corrupt.inc();
                metrics.give_ups.inc();
                warn!(
                    message = "Retry journal: a record's checksum does not match (a damaged file); skipped, its invalidation is given up.",
                    path = %path.display(),
                    line = index + 1,
                );
            }
            Err(BadLine::Unreadable(error)) => {
                loaded.tidy = false;
                metrics.give_ups.inc();
                warn!(
                    message = "Retry journal: unreadable record skipped; its invalidation is given up.",
                    path = %path.display(),
                    line = index + 1,
                    %error
                );
            }
        }
    }
    Ok(loaded)
}

/// The writer thread: owns the file.
struct Writer {
    shared: Arc<Shared>,
    fsync: FsyncPolicy,
    /// `None` after an error that left the handle unusable; reopened on the next write.
    file: Option<File>,
    /// Bytes of whole lines in the file.
    len: u64,
    /// Lines in the file.
    lines: u64,
    /// The highest `owe` id written: pending records above it are still queued.
    written: u64,
    /// Written but not synced.
    dirty: bool,
    last_sync: Instant,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Request>) {
        loop {
            let first = match self.sync_due() {
                Some(due) => match rx.recv_timeout(due.saturating_duration_since(Instant::now())) {
                    Ok(request) => request,
                    Err(RecvTimeoutError::Timeout) => {
                        self.sync_logged();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                },
                None => match rx.recv() {
                    Ok(request) => request,
                    Err(_) => break,
                },
            };
            let mut batch = vec![first];
            batch.extend(rx.try_iter());
            self.commit(batch);
        }
        if self.dirty && self.fsync != FsyncPolicy::Never {
            self.sync_logged();
        }
    }

    /// When the pending interval sync is due.
    fn sync_due(&self) -> Option<Instant> {
        match self.fsync {
            FsyncPolicy::Interval(every) if self.dirty => Some(self.last_sync + every),
            _ => None,
        }
    }

    /// Writes one batch with one `write_all`, syncs per the policy, compacts, and answers
    /// every caller (under `Always`, after the sync; otherwise after the write).
    fn commit(&mut self, batch: Vec<Request>) {
        let mut bytes = Vec::with_capacity(batch.iter().map(|r| r.bytes.len()).sum());
        let mut lines = 0;
        let mut wants_sync = false;
        for request in &batch {
            bytes.extend_from_slice(&request.bytes);
            lines += request.lines;
            wants_sync |= request.sync;
        }
        let written = if bytes.is_empty() {
            Ok(())
        } else {
            self.write(&bytes)
        };
        let synced = match (&written, self.fsync) {
            (Ok(()), FsyncPolicy::Always) if wants_sync && self.dirty => {
                step("fdatasync", self.sync())
            }
            _ => Ok(()),
        };
        let outcome = |request: &Request| match (&written, &synced) {
            (Err(failure), _) => Err(failure.clone()),
            (Ok(()), Err(failure)) if request.sync => Err(failure.clone()),
            _ => Ok(()),
        };

        let lost: Vec<u64> = batch
            .iter()
            .filter(|r| outcome(r).is_err())
            .flat_map(|r| r.owes.iter().copied())
            .collect();
        if !lost.is_empty() {
            let mut state = self.shared.state();
            for id in lost {
                state.remove(id);
            }
            self.shared.publish(&state);
        }
        if written.is_ok() {
            self.lines += lines;
            if let Some(max) = batch.iter().flat_map(|r| r.owes.iter()).max() {
                self.written = self.written.max(*max);
            }
            if let Err(failure) = self.compact() {
                let error = failure.into_error(&self.shared.path);
                warn!(message = "Retry journal not compacted.", %error);
            }
        }
        for request in batch {
            let result = outcome(&request);
            // A caller that went away does not need the answer.
            let _ = request.ack.send(result);
        }
        // Interval: callers have their answer; sync now if the last sync is old enough
        // (otherwise `run` does when it is).
        if let FsyncPolicy::Interval(every) = self.fsync
            && self.dirty
            && self.last_sync.elapsed() >= every
        {
            self.sync_logged();
        }
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), Failure> {
        if self.file.is_none() {
            let mut file = step("open", open_append(&self.shared.path))?;
            let on_disk = step("stat", file.metadata())?.len();
            if on_disk != self.len {
                // A torn write that could not be cut off: end it, so it stays a line of its
                // own (skipped, and counted, on the next open) instead of spoiling ours.
                step("write", file.write_all(b"\n"))?;
                self.len = on_disk + 1;
                self.lines += 1;
            }
            self.file = Some(file);
        }
        let Some(file) = self.file.as_mut() else {
            return Err(Failure::new("open", &io::Error::other("no file handle")));
        };
        match file.write_all(bytes) {
            Ok(()) => {
                self.len += bytes.len() as u64;
                self.dirty = true;
                Ok(())
            }
            Err(error) => {
                // Part of the batch may be in the file: cut it off, or a later record would
                // be glued to a half line and lost.
                if file.set_len(self.len).is_err() {
                    self.file = None;
                }
                Err(Failure::new("write", &error))
            }
        }
    }

    fn sync(&mut self) -> io::Result<()> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let started = Instant::now();
        let result = file.sync_data();
        self.shared
            .metrics
            .fsync_seconds
            .observe(started.elapsed().as_secs_f64());
        self.last_sync = Instant::now();
        if result.is_ok() {
            self.dirty = false;
        }
        result
    }

    /// A sync no caller waits for (`Interval`, shutdown): failures are only logged.
    fn sync_logged(&mut self) {
        if let Err(e) = self.sync() {
            let error = io_error(&self.shared.path, "fdatasync", e);
            warn!(message = "Retry journal not synced; a power loss could lose recent records.", %error);
        }
    }

    /// Truncates or rewrites the file when it holds mostly done records.
    fn compact(&mut self) -> Result<(), Failure> {
        let records = {
            let state = self.shared.state();
            // Records above `written` are still queued; few, so counting them is cheap.
            let queued = state
                .pending
                .range((Bound::Excluded(self.written), Bound::Unbounded))
                .count();
            let in_file = (state.pending.len() - queued) as u64;
            if in_file == 0 {
                None
            } else if self.lines > COMPACT_RATIO * in_file && self.lines > COMPACT_MIN_LINES {
                Some(Self::records(&state, self.written))
            } else {
                return Ok(());
            }
        };
        match records {
            None if self.lines == 0 => Ok(()),
            None => self.truncate(),
            Some(records) => self.rewrite(&records),
        }
    }

    /// The pending records up to `written`: (id, at_ms, value).
    fn records(state: &State, written: u64) -> Vec<(u64, u64, Owed)> {
        state
            .pending
            .range(..=written)
            .map(|(id, r)| (*id, r.at_ms, r.owed.clone()))
            .collect()
    }

    /// Empties the file (not synced: see the module docs).
    fn truncate(&mut self) -> Result<(), Failure> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        step("truncate", file.set_len(0))?;
        self.len = 0;
        self.lines = 0;
        Ok(())
    }

    /// Replaces the file with one holding only `records`: `<path>.tmp`, synced, renamed
    /// over the journal, directory synced.
    fn rewrite(&mut self, records: &[(u64, u64, Owed)]) -> Result<(), Failure> {
        let mut bytes = Vec::new();
        for (id, at_ms, owed) in records {
            step(
                "encode a record",
                push_line(
                    &mut bytes,
                    &LineOut::Owe {
                        id: *id,
                        at_ms: *at_ms,
                        owed,
                    },
                ),
            )?;
        }
        let path = self.shared.path.clone();
        let tmp = sibling(&path, ".tmp");
        let copied = (|| {
            let mut file = step("create the compacted copy", File::create(&tmp))?;
            step("write the compacted copy", file.write_all(&bytes))?;
            self.timed(|| step("fsync the compacted copy", file.sync_all()))?;
            step("rename the compacted copy", fs::rename(&tmp, &path))
        })();
        if let Err(failure) = copied {
            let _ = fs::remove_file(&tmp);
            return Err(failure);
        }
        // The journal is the new file from here on, whatever follows.
        self.len = bytes.len() as u64;
        self.lines = records.len() as u64;
        self.dirty = false;
        self.file = None;
        self.file = Some(step("open", open_append(&path))?);
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
            _ => PathBuf::from("."),
        };
        // Without it a power loss may bring back the old file: done records applied again.
        self.timed(|| {
            step(
                "fsync the directory",
                File::open(&dir).and_then(|d| d.sync_all()),
            )
        })
    }

    /// Compaction on open: drops done, torn and unreadable lines.
    fn open_compaction(&mut self) -> Result<(), Failure> {
        let records = Self::records(&self.shared.state(), u64::MAX);
        if records.is_empty() {
            self.truncate()
        } else {
            self.rewrite(&records)
        }
    }

    fn timed<T>(&self, sync: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let result = sync();
        self.shared
            .metrics
            .fsync_seconds
            .observe(started.elapsed().as_secs_f64());
        result
    }
}

/// Retries the pending records until each succeeds: `apply` returns true when the
/// invalidation reached Redis. Backoff per round: starts at 100 ms, doubles to a cap of
/// 5 s, resets after a round where anything succeeded; `wake.notified()` (Redis came back,
/// or new records were appended) cuts the current wait short — wake with `notify_one`, which
/// is kept until the loop waits. An empty journal is looked at every second anyway. Stops
/// when `stop` is cancelled.
///
/// A round tries records oldest first and ends at the first failure (Redis is likely still
/// down). Successes are marked done in batches.
pub(crate) async fn run_retries<F, Fut>(
    journal: Arc<Journal>,
    apply: F,
    wake: Arc<Notify>,
    stop: CancellationToken,
) where
    F: Fn(Owed) -> Fut,
    Fut: Future<Output = bool>,
{
    retry_loop(&journal, apply, &wake, &stop, RETRY_INITIAL, RETRY_MAX).await;
}

/// How a retry round ended.
enum Round {
    /// Nothing left to try.
    Drained,
    /// A record failed; `progressed` when some succeeded before it.
    Failed {
        progressed: bool,
    },
    Stopped,
}

async fn retry_loop<F, Fut>(
    journal: &Journal,
    apply: F,
    wake: &Notify,
    stop: &CancellationToken,
    initial: Duration,
    max: Duration,
) where
    F: Fn(Owed) -> Fut,
    Fut: Future<Output = bool>,
{
    let metrics = &journal.shared.metrics;
    let mut backoff = initial;
    loop {
        journal.refresh_gauges();
        if journal.depth() == 0 {
            if !pause(journal, wake, stop, TICK).await {
                return;
            }
            continue;
        }
        match round(journal, &apply, stop).await {
            Round::Drained => backoff = initial,
            Round::Stopped => return,
            Round::Failed { progressed } => {
                metrics.retries.inc();
                if progressed {
                    backoff = initial;
                }
                if !pause(journal, wake, stop, backoff).await {
                    return;
                }
                backoff = (backoff * 2).min(max);
            }
        }
    }
}

/// One pass over the pending records, oldest first, until the first failure.
async fn round<F, Fut>(journal: &Journal, apply: &F, stop: &CancellationToken) -> Round
where
    F: Fn(Owed) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut applied = Vec::new();
    let mut after = None;
    let mut progressed = false;
    let outcome = loop {
        let Some((id, owed)) = journal.claim_next(after) else {
            break Round::Drained;
        };
        after = Some(id);
        let reached = tokio::select! {
            biased;
            () = stop.cancelled() => None,
            reached = apply(owed) => Some(reached),
        };
        match reached {
            Some(true) => {
                journal.shared.metrics.applied.inc();
                progressed = true;
                applied.push(id);
                if applied.len() >= DONE_BATCH {
                    mark_done(journal, std::mem::take(&mut applied)).await;
                }
            }
            Some(false) => {
                journal.unclaim(id);
                break Round::Failed { progressed };
            }
            None => {
                journal.unclaim(id);
                break Round::Stopped;
            }
        }
    };
    if !applied.is_empty() {
        mark_done(journal, applied).await;
    }
    outcome
}

async fn mark_done(journal: &Journal, ids: Vec<u64>) {
    if let Err(error) = journal.done_ids(ids).await {
        warn!(
            message = "Retry journal: applied invalidations not marked done; a restart applies them again.",
            %error
        );
    }
}

/// Waits `delay`, keeping the age gauge current, unless woken first. False when stopped.
async fn pause(
    journal: &Journal,
    wake: &Notify,
    stop: &CancellationToken,
    delay: Duration,
) -> bool {
    let deadline = tokio::time::Instant::now() + delay;
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return true;
        }
        tokio::select! {
            biased;
            () = stop.cancelled() => return false,
            () = wake.notified() => return true,
            () = tokio::time::sleep((deadline - now).min(TICK)) => journal.refresh_gauges(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    const LIMIT: Duration = Duration::from_secs(2);

    fn key(n: u32) -> Owed {
        Owed::Key {
            base: format!("{n:032x}"),
            generation_ttl_ms: 180_000,
            floor: None,
        }
    }

    fn tag(name: &str) -> Owed {
        Owed::Tag {
            tag: name.to_owned(),
        }
    }

    fn open_with(path: &Path, fsync: FsyncPolicy) -> Arc<Journal> {
        Journal::open(path, fsync, crate::metrics::Metrics::unregistered().journal).unwrap()
    }

    fn open(path: &Path) -> Arc<Journal> {
        open_with(path, FsyncPolicy::Always)
    }

    fn values(journal: &Journal) -> Vec<Owed> {
        journal.pending().into_iter().map(|(o, _)| o).collect()
    }

    fn lines(path: &Path) -> usize {
        fs::read_to_string(path).unwrap().lines().count()
    }

    async fn bounded<T>(f: impl Future<Output = T>) -> T {
        tokio::time::timeout(LIMIT, f)
            .await
            .expect("test took too long")
    }

    #[tokio::test]
    async fn appended_records_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/journal");
        let journal = open(&path);
        bounded(journal.append(vec![key(1), tag("user:42")]))
            .await
            .unwrap();
        let before = journal.pending();
        assert_eq!(before.len(), 2);
        assert_eq!(journal.shared.metrics.appended.get(), 2);
        assert_eq!(journal.shared.metrics.depth.get(), 2);
        drop(journal);

        let journal = open(&path);
        assert_eq!(journal.pending(), before);
        assert_eq!(journal.shared.metrics.depth.get(), 2);
        // Ids continue after the highest one found.
        bounded(journal.append(vec![key(2)])).await.unwrap();
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains(r#""op":"owe","id":3,"#), "{text}");
        assert!(
            text.contains(r#""owed":{"kind":"tag","tag":"user:42"}"#),
            "{text}"
        );
    }

    /// A write's floor is kept with its record across a restart, as digits (a large
    /// version survives); a record written before floors reads as one without.
    #[tokio::test]
    async fn a_floor_survives_a_restart_and_older_records_have_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let floored = Owed::Key {
            base: format!("{:032x}", 5),
            generation_ttl_ms: 180_000,
            floor: Some(OwedFloor {
                version: u128::MAX.to_string(),
                ttl_ms: 10_000,
            }),
        };
        let journal = open(&path);
        bounded(journal.append(vec![floored.clone(), key(6)]))
            .await
            .unwrap();
        drop(journal);
        let text = fs::read_to_string(&path).unwrap();
        assert!(
            text.contains(&format!(
                r#""floor":{{"version":"{}","ttl_ms":10000}}"#,
                u128::MAX
            )),
            "{text}"
        );
        assert!(
            !text.lines().nth(1).unwrap().contains("floor"),
            "none written for a record without: {text}"
        );
        assert_eq!(values(&open(&path)), vec![floored, key(6)]);
        // A line as the version before floors wrote it.
        let old = dir.path().join("old");
        fs::write(
            &old,
            format!(
                "{{\"op\":\"owe\",\"id\":1,\"at_ms\":1,\"owed\":{{\"kind\":\"key\",\"base\":\"{:032x}\",\"generation_ttl_ms\":180000}}}}\n",
                6
            ),
        )
        .unwrap();
        assert_eq!(values(&open(&old)), vec![key(6)]);
    }

    #[tokio::test]
    async fn done_records_are_gone_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let journal = open(&path);
        bounded(journal.append(vec![key(1), key(2), key(3)]))
            .await
            .unwrap();
        bounded(journal.done(&[key(2), key(9)])).await.unwrap();
        assert_eq!(values(&journal), vec![key(1), key(3)]);
        drop(journal);

        let journal = open(&path);
        assert_eq!(values(&journal), vec![key(1), key(3)]);
        // Open compacted away the owe/done pair.
        assert_eq!(lines(&path), 2);
        bounded(journal.done(&[key(1), key(3)])).await.unwrap();
        assert_eq!(journal.depth(), 0);
        assert_eq!(journal.shared.metrics.oldest_pending_seconds.get(), 0.0);
        // Nothing pending: the file is emptied.
        assert_eq!(fs::metadata(&path).unwrap().len(), 0);
        drop(journal);
        assert_eq!(open(&path).depth(), 0);
    }

    #[tokio::test]
    async fn an_equal_pending_record_is_written_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let journal = open(&path);
        bounded(journal.append(vec![key(1), key(1), tag("t")]))
            .await
            .unwrap();
        bounded(journal.append(vec![key(1)])).await.unwrap();
        assert_eq!(lines(&path), 2);
        assert_eq!(journal.depth(), 2);
        assert_eq!(journal.shared.metrics.appended.get(), 2);
        // Another generation TTL is another record.
        let longer = Owed::Key {
            base: format!("{:032x}", 1),
            generation_ttl_ms: 360_000,
            floor: None,
        };
        bounded(journal.append(vec![longer])).await.unwrap();
        assert_eq!(lines(&path), 3);
    }

    #[tokio::test]
    async fn a_record_owed_again_while_being_applied_stays_owed() {
        let dir = tempfile::tempdir().unwrap();
        let journal = open(&dir.path().join("journal"));
        bounded(journal.append(vec![key(1)])).await.unwrap();
        let (id, owed) = journal.claim_next(None).unwrap();
        assert_eq!(owed, key(1));
        // A write after the apply began: the apply in flight does not cover it.
        bounded(journal.append(vec![key(1)])).await.unwrap();
        assert_eq!(journal.depth(), 2);
        bounded(journal.done_ids(vec![id])).await.unwrap();
        assert_eq!(values(&journal), vec![key(1)]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_appends_share_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let journal = open(&path);
        let tasks: Vec<_> = (0..50)
            .map(|n| {
                let journal = Arc::clone(&journal);
                tokio::spawn(async move { journal.append(vec![key(n)]).await })
            })
            .collect();
        bounded(async {
            for task in tasks {
                task.await.unwrap().unwrap();
            }
        })
        .await;
        let syncs = journal.shared.metrics.fsync_seconds.get_sample_count();
        assert!((1..50).contains(&syncs), "{syncs} syncs for 50 appends");
        assert_eq!(journal.shared.metrics.appended.get(), 50);
        drop(journal);
        let mut reopened = values(&open(&path));
        reopened.sort_by_key(|o| format!("{o:?}"));
        let mut expected: Vec<_> = (0..50).map(key).collect();
        expected.sort_by_key(|o| format!("{o:?}"));
        assert_eq!(reopened, expected);
    }

    #[tokio::test]
    async fn interval_and_never_return_before_syncing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("interval");
        let journal = open_with(&path, FsyncPolicy::Interval(Duration::from_millis(200)));
        bounded(journal.append(vec![key(1)])).await.unwrap();
        assert_eq!(lines(&path), 1);
        bounded(async {
            while journal.shared.metrics.fsync_seconds.get_sample_count() == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;

        let path = dir.path().join("never");
        let journal = open_with(&path, FsyncPolicy::Never);
        bounded(journal.append(vec![key(1)])).await.unwrap();
        assert_eq!(lines(&path), 1);
        let metrics = journal.shared.metrics.clone();
        drop(journal);
        assert_eq!(metrics.fsync_seconds.get_sample_count(), 0);
    }

    #[tokio::test]
    async fn a_second_open_is_refused_while_the_first_is_alive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let journal = open(&path);
        let error = Journal::open(
            &path,
            FsyncPolicy::Always,
            crate::metrics::Metrics::unregistered().journal,
        )
        .unwrap_err();
        let message = error.to_string();
        assert!(message.contains("in use"), "{message}");
        assert!(message.contains(&path.display().to_string()), "{message}");
        drop(journal);
        open(&path);
    }

    #[tokio::test]
    async fn a_torn_tail_is_ignored_and_a_garbage_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let owe = |id: u64, n: u32| {
            let mut line = Vec::new();
            push_line(
                &mut line,
                &LineOut::Owe {
                    id,
                    at_ms: 1_000 + id,
                    owed: &key(n),
                },
            )
            .unwrap();
            String::from_utf8(line).unwrap()
        };
        let text = format!(
            "{}this is not json\n{}{}",
            owe(1, 1),
            owe(3, 3),
            r#"{"op":"owe","id":4,"at_ms":17637900"#
        );
        fs::write(&path, text).unwrap();
        let metrics = crate::metrics::Metrics::unregistered().journal;
        let journal = Journal::open(&path, FsyncPolicy::Always, metrics.clone()).unwrap();
        assert_eq!(journal.pending(), vec![(key(1), 1_001), (key(3), 1_003)]);
        assert_eq!(metrics.give_ups.get(), 1);
        // Rewritten clean, so an append does not follow the torn line.
        assert_eq!(fs::read_to_string(&path).unwrap(), owe(1, 1) + &owe(3, 3));
        bounded(journal.append(vec![key(5)])).await.unwrap();
        drop(journal);

        let metrics = crate::metrics::Metrics::unregistered().journal;
        let journal = Journal::open(&path, FsyncPolicy::Always, metrics.clone()).unwrap();
        assert_eq!(values(&journal), vec![key(1), key(3), key(5)]);
        assert_eq!(metrics.give_ups.get(), 0);
        // The torn record's id is never seen; the next id follows the highest read.
        assert!(fs::read_to_string(&path).unwrap().contains(r#""id":4,"#));

        // Zeros after the last newline (a power loss) are a torn tail too.
        drop(journal);
        let mut bytes = fs::read(&path).unwrap();
        bytes.extend_from_slice(&[0; 64]);
        fs::write(&path, bytes).unwrap();
        let metrics = crate::metrics::Metrics::unregistered().journal;
        let journal = Journal::open(&path, FsyncPolicy::Always, metrics.clone()).unwrap();
        assert_eq!(journal.depth(), 3);
        assert_eq!(metrics.give_ups.get(), 0);
    }

    /// One flipped hex digit in a record's key still makes valid JSON: without a checksum
    /// it would replay against a key nobody uses while the real entry stays stale. With
    /// one, the record is skipped and counted; the others load; lines from before checksums
    /// (no prefix) still load.
    #[tokio::test]
    async fn a_corrupt_record_is_skipped_and_counted_not_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let line = |id: u64, n: u32| {
            let mut line = Vec::new();
            push_line(
                &mut line,
                &LineOut::Owe {
                    id,
                    at_ms: 1_000 + id,
                    owed: &key(n),
                },
            )
            .unwrap();
            String::from_utf8(line).unwrap()
        };
        let corrupt = {
            let good = line(2, 2);
            let at = good.find(r#""base":""#).unwrap() + r#""base":""#.len() + 5;
            let mut bytes = good.into_bytes();
            bytes[at] = if bytes[at] == b'a' { b'b' } else { b'a' };
            String::from_utf8(bytes).unwrap()
        };
        let legacy = serde_json::to_string(&LineOut::Owe {
            id: 4,
            at_ms: 1_004,
            owed: &key(4),
        })
        .unwrap();
        fs::write(
            &path,
            format!("{}{corrupt}{}{legacy}\n", line(1, 1), line(3, 3)),
        )
        .unwrap();
        let metrics = crate::metrics::Metrics::unregistered().journal;
        let journal = Journal::open(&path, FsyncPolicy::Always, metrics.clone()).unwrap();
        assert_eq!(values(&journal), vec![key(1), key(3), key(4)]);
        assert_eq!(metrics.corrupt.get(), 1);
        assert_eq!(
            metrics.give_ups.get(),
            1,
            "its invalidation is given up, counted"
        );
    }

    #[tokio::test]
    async fn compaction_shrinks_the_file_and_keeps_pending_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let journal = open(&path);
        let all: Vec<Owed> = (0..1200).map(key).collect();
        bounded(journal.append(all.clone())).await.unwrap();
        let big = fs::metadata(&path).unwrap().len();
        bounded(journal.done(&all[..1100])).await.unwrap();
        // 2300 lines for 100 pending records: rewritten.
        assert_eq!(lines(&path), 100);
        assert!(fs::metadata(&path).unwrap().len() < big / 10);
        assert!(!sibling(&path, ".tmp").exists());
        // Appends go to the new file.
        bounded(journal.append(vec![tag("after")])).await.unwrap();
        assert_eq!(lines(&path), 101);
        let pending = journal.pending();
        drop(journal);

        let journal = open(&path);
        assert_eq!(journal.pending(), pending);
        assert_eq!(pending.first().unwrap().0, key(1100));
    }

    #[tokio::test]
    async fn retries_until_applied_with_backoff() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal");
        let journal = open(&path);
        bounded(journal.append(vec![key(1), key(2), key(3)]))
            .await
            .unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let task = tokio::spawn(run_retries(
            Arc::clone(&journal),
            {
                let calls = Arc::clone(&calls);
                let seen = Arc::clone(&seen);
                move |owed: Owed| {
                    let calls = Arc::clone(&calls);
                    let seen = Arc::clone(&seen);
                    async move {
                        // Down for the first two attempts (100 ms, then 200 ms of backoff).
                        let ok = calls.fetch_add(1, Ordering::SeqCst) >= 2;
                        if ok {
                            seen.lock().unwrap().push(owed);
                        }
                        ok
                    }
                }
            },
            Arc::new(Notify::new()),
            stop.clone(),
        ));
        bounded(async {
            while journal.depth() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        stop.cancel();
        bounded(task).await.unwrap();
        let metrics = &journal.shared.metrics;
        assert_eq!(metrics.retries.get(), 2);
        assert_eq!(metrics.applied.get(), 3);
        assert_eq!(metrics.depth.get(), 0);
        assert_eq!(*seen.lock().unwrap(), vec![key(1), key(2), key(3)]);
        assert_eq!(fs::metadata(&path).unwrap().len(), 0);
        drop(journal);
        assert_eq!(open(&path).depth(), 0);
    }

    #[tokio::test]
    async fn wake_cuts_the_backoff_short() {
        let dir = tempfile::tempdir().unwrap();
        let journal = open(&dir.path().join("journal"));
        bounded(journal.append(vec![key(1)])).await.unwrap();
        let down = Arc::new(AtomicUsize::new(1));
        let wake = Arc::new(Notify::new());
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let journal = Arc::clone(&journal);
            let down = Arc::clone(&down);
            let wake = Arc::clone(&wake);
            let stop = stop.clone();
            async move {
                let apply = |_: Owed| {
                    let down = Arc::clone(&down);
                    async move {
                        down.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                            .is_err()
                    }
                };
                // A first wait far longer than the test.
                let hour = Duration::from_secs(3600);
                retry_loop(&journal, apply, &wake, &stop, hour, hour).await;
            }
        });
        bounded(async {
            while journal.shared.metrics.retries.get() == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert_eq!(journal.depth(), 1);
        wake.notify_one();
        bounded(async {
            while journal.depth() > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        stop.cancel();
        bounded(task).await.unwrap();
        assert_eq!(journal.shared.metrics.applied.get(), 1);
    }
}
