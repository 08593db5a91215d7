//! Invalidation: the one way a key or a tag leaves every cache tier, whoever asks (a write,
//! the purge API, the invalidation stream, the retry journal).
//!
//! ```text
//! invalidate(items)
//!   ├─ here, at once: mark (LocalMarks), drop from L1 (base + variants, or by tag),
//!   │                 end a hot key's L1 grace
//!   │                 a write's version floor: raised here (LocalMarks)
//!   └─ Redis (shared mode): key → INVALIDATE (generation bump, delete entry, variants and
//!                           locks, raise the version floor, publish `invalidate` with the
//!                           floor: every instance drops its L1 copies and knows the floor)
//!                           tag → TAG_MARK (record the time, list the tagged base keys),
//!                           then INVALIDATE each, then forget them from the tag's index
//!      failed (Redis down, timeout) → appended to the journal before the caller goes on,
//!      retried until done, across restarts (see `journal.rs`)
//! ```
//!
//! While an owed invalidation waits in the journal, this instance does not read the keys it
//! concerns from Redis (where an old copy may still be), and while a tag invalidation is
//! owed it does not read Redis at all: the journal is retried the moment Redis is back.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tracing::{error, warn};

use super::journal::{Journal, Owed, OwedFloor};
use crate::cache::l1::L1;
use crate::cache::marks::LocalMarks;
use crate::cache::tiers::OwedSet;
use crate::cache::version::Floor;
use crate::coord::redis::Unavailable;
use crate::coord::store::RedisStore;
use crate::metrics::Metrics;
use crate::protect::hotkeys::HotKeys;

/// One thing to invalidate.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Invalidation {
    /// A base key and all its variants; the generation must outlive any fill of it. With
    /// a write's version `floor` (a write route with `version` whose answer told one):
    /// fills older than it are refused from now on, for its ttl.
    Key {
        base: u128,
        generation_ttl: Duration,
        floor: Option<Floor>,
    },
    /// Every entry carrying the tag.
    Tag(String),
}

impl Invalidation {
    /// This invalidation, raising the key's version floor to `floor` (a tag has none).
    pub(crate) fn with_floor(self, floor: Floor) -> Invalidation {
        match self {
            Invalidation::Key {
                base,
                generation_ttl,
                ..
            } => Invalidation::Key {
                base,
                generation_ttl,
                floor: Some(floor),
            },
            tag @ Invalidation::Tag(_) => tag,
        }
    }
}

pub(crate) use crate::metrics::InvalidationSource as Source;

/// What became of a batch of invalidations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Report {
    /// Applied everywhere (or locally, in embedded mode).
    pub(crate) done: usize,
    /// Applied here; owed to Redis, kept in the journal (or, while it cannot be written,
    /// held in memory), retried until done.
    pub(crate) journaled: usize,
    /// Applied here; owed to Redis but the journal could not take it (logged as an error).
    pub(crate) lost: usize,
}

impl Report {
    /// Everything reached Redis (or there is no Redis).
    pub(crate) fn complete(&self) -> bool {
        self.journaled == 0 && self.lost == 0
    }
}

#[derive(Debug)]
pub(crate) struct Invalidator {
    l1: L1,
    hot: Arc<HotKeys>,
    pub(crate) marks: Arc<LocalMarks>,
    /// `None` in embedded mode.
    dist: Option<RedisStore>,
    journal: Option<Arc<Journal>>,
    /// Wakes the journal's retry loop.
    pub(crate) wake: Arc<Notify>,
    /// How long a tag's invalidation time and a base's generation must be kept.
    horizon: Duration,
    /// Base keys with an owed invalidation (a superset while the journal is not empty), and
    /// whether any tag is owed; `owing` is the fast path: nothing is owed.
    owed_keys: Mutex<HashSet<u128>>,
    owed_tags: AtomicBool,
    owing: AtomicBool,
    /// Owed invalidations the journal could not take (a full or failing disk): kept here
    /// and retried ([`Invalidator::retry_held`]) until Redis takes them or the journal
    /// does. Bounded by [`MAX_HELD`].
    held: Mutex<Vec<Invalidation>>,
    /// How many held invalidations a retry has taken out of `held` and not yet settled;
    /// changed only under `held`'s lock, so "nothing held" is never seen mid-retry.
    retrying: AtomicUsize,
    metrics: Metrics,
}

/// Owed invalidations kept in memory at most while the journal cannot be written (about
/// 100 bytes each). Beyond it they are lost, logged and counted, as with no journal.
const MAX_HELD: usize = 100_000;

impl Invalidator {
    pub(crate) fn new(
        l1: L1,
        hot: Arc<HotKeys>,
        marks: Arc<LocalMarks>,
        dist: Option<RedisStore>,
        journal: Option<Arc<Journal>>,
        horizon: Duration,
        metrics: Metrics,
    ) -> Self {
        let this = Invalidator {
            l1,
            hot,
            marks,
            dist,
            journal,
            wake: Arc::new(Notify::new()),
            horizon,
            owed_keys: Mutex::default(),
            owed_tags: AtomicBool::new(false),
            owing: AtomicBool::new(false),
            held: Mutex::default(),
            retrying: AtomicUsize::new(0),
            metrics,
        };
        if let Some(journal) = &this.journal {
            for (owed, _) in journal.pending() {
                if let Some(item) = from_owed(&owed) {
                    this.note_owed(&item);
                }
            }
        }
        this
    }

    /// How long generations and tag times are kept (longer than any fill).
    pub(crate) fn horizon(&self) -> Duration {
        self.horizon
    }

    /// Invalidates `items` here at once and, in shared mode, fleet-wide through Redis;
    /// what Redis cannot take now is journaled before this returns. A non-zero `quarantine`
    /// (a write's) keeps fills of the keys from storing anything for that long.
    pub(crate) async fn invalidate(
        &self,
        items: &[Invalidation],
        source: Source,
        quarantine: Duration,
    ) -> Report {
        for item in items {
            self.apply_local(item, quarantine).await;
        }
        let mut report = Report::default();
        let Some(dist) = &self.dist else {
            report.done = items.len();
            self.metrics.invalidation(source, "done", items.len());
            return report;
        };
        let mut owed = Vec::new();
        for item in items {
            match self.apply_remote(dist, item, quarantine).await {
                Ok(()) => report.done += 1,
                Err(_) => owed.push(item.clone()),
            }
        }
        self.metrics.invalidation(source, "done", report.done);
        if owed.is_empty() {
            return report;
        }
        let Some(journal) = &self.journal else {
            report.lost = owed.len();
            self.metrics.invalidation(source, "lost", owed.len());
            error!(
                message = "Invalidation not delivered and no journal to keep it.",
                count = owed.len()
            );
            return report;
        };
        for item in &owed {
            self.note_owed(item);
        }
        let first = journal.depth() == 0;
        match journal.append(owed.iter().map(to_owed).collect()).await {
            Ok(()) => {
                report.journaled = owed.len();
                self.metrics.invalidation(source, "journaled", owed.len());
                // Once when the journal starts filling, not once per write of an outage:
                // the depth and age gauges tell the rest.
                if first {
                    warn!(
                        message = "Invalidations are being journaled: Redis unavailable; retried until done (cacheguard_journal_depth counts them).",
                        journal = %journal.path().display(),
                    );
                }
                self.wake.notify_one();
            }
            Err(e) => {
                let count = owed.len();
                let kept = self.hold(owed);
                report.journaled = kept;
                report.lost = count - kept;
                self.metrics.invalidation(source, "held", kept);
                if report.lost > 0 {
                    self.metrics.invalidation(source, "lost", report.lost);
                    error!(
                        message = "Invalidation could not be journaled nor held; stale copies may stay in Redis until they expire.",
                        count = report.lost,
                        error = %e,
                    );
                }
                self.wake.notify_one();
            }
        }
        report
    }

    /// Keeps owed invalidations the journal could not take, up to [`MAX_HELD`]; returns
    /// how many were kept. Says so once when the journal starts failing.
    fn hold(&self, owed: Vec<Invalidation>) -> usize {
        let mut held = self.held();
        let retrying = self.retrying.load(Ordering::Acquire);
        let was_empty = held.is_empty() && retrying == 0;
        let room = MAX_HELD.saturating_sub(held.len() + retrying);
        let kept = owed.len().min(room);
        held.extend(owed.into_iter().take(kept));
        self.metrics.journal_failing.set(1);
        self.metrics
            .invalidations_held
            .set(i64::try_from(held.len()).unwrap_or(i64::MAX));
        if was_empty {
            error!(
                message = "Retry journal cannot be written: owed invalidations are held in memory and retried until Redis or the journal takes them.",
                journal = %self.journal.as_ref().map(|j| j.path().display().to_string()).unwrap_or_default(),
            );
        }
        kept
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Vec<Invalidation>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether owed invalidations wait in memory because the journal could not be written.
    pub(crate) fn journal_failing(&self) -> bool {
        self.holds_any()
    }

    /// Whether invalidations are held in memory, counting those a retry is working on.
    fn holds_any(&self) -> bool {
        let held = self.held();
        !held.is_empty() || self.retrying.load(Ordering::Acquire) > 0
    }

    /// One retry of the invalidations held in memory: each goes to Redis if it answers;
    /// what is left goes to the journal if it can be written now; what neither took is
    /// held again. Returns whether nothing is held any more.
    pub(crate) async fn retry_held(&self) -> bool {
        let items = {
            let mut held = self.held();
            self.retrying.store(held.len(), Ordering::Release);
            std::mem::take(&mut *held)
        };
        if items.is_empty() {
            return true;
        }
        let mut left = Vec::new();
        for item in items {
            let applied = match &self.dist {
                Some(dist) => self.apply_remote(dist, &item, Duration::ZERO).await.is_ok(),
                None => true,
            };
            if applied {
                self.metrics.invalidation(Source::Retry, "done", 1);
                self.settle_owed(&item);
            } else {
                left.push(item);
            }
        }
        if !left.is_empty()
            && let Some(journal) = &self.journal
            && journal
                .append(left.iter().map(to_owed).collect())
                .await
                .is_ok()
        {
            left.clear();
        }
        let mut held = self.held();
        // Put back what is left, before anything held meanwhile.
        left.append(&mut held);
        *held = left;
        self.retrying.store(0, Ordering::Release);
        let empty = held.is_empty();
        self.metrics
            .invalidations_held
            .set(i64::try_from(held.len()).unwrap_or(i64::MAX));
        if empty {
            self.metrics.journal_failing.set(0);
            warn!(
                message = "Owed invalidations are no longer held in memory: Redis or the journal took them."
            );
        }
        empty
    }

    /// Whether this instance must not read `base` from Redis now: an invalidation of it
    /// (or of some tag) is owed there.
    pub(crate) fn owes(&self, base: u128) -> bool {
        if !self.owing.load(Ordering::Acquire) {
            return false;
        }
        if self.journal.as_ref().is_none_or(|j| j.depth() == 0) && !self.holds_any() {
            // Everything owed was applied: back to the fast path.
            self.owing.store(false, Ordering::Release);
            self.owed_tags.store(false, Ordering::Release);
            self.owed_keys().clear();
            return false;
        }
        self.owed_tags.load(Ordering::Acquire) || self.owed_keys().contains(&base)
    }

    /// One retry of a journaled invalidation; true when Redis took it.
    pub(crate) async fn retry(&self, owed: &Owed) -> bool {
        let (Some(dist), Some(item)) = (&self.dist, from_owed(owed)) else {
            // Unreadable, or no Redis any more (embedded now): nothing left to do.
            return true;
        };
        match self.apply_remote(dist, &item, Duration::ZERO).await {
            Ok(()) => {
                self.metrics.invalidation(Source::Retry, "done", 1);
                self.settle_owed(&item);
                true
            }
            Err(_) => false,
        }
    }

    async fn apply_local(&self, item: &Invalidation, quarantine: Duration) {
        match item {
            Invalidation::Key { base, floor, .. } => {
                // The floor before the mark: a fill that sees the mark and starts again
                // sees the floor too.
                if let Some(floor) = floor {
                    self.marks.raise_floor(*base, floor.version, floor.ttl);
                }
                self.marks.mark_key(*base);
                self.marks.quarantine(*base, quarantine);
                drop_base(&self.l1, &self.hot, *base).await;
            }
            Invalidation::Tag(tag) => {
                self.marks.mark_tag(tag);
                for hash in self.l1.invalidate_tag(tag) {
                    self.hot.invalidated(hash);
                }
            }
        }
    }

    async fn apply_remote(
        &self,
        dist: &RedisStore,
        item: &Invalidation,
        quarantine: Duration,
    ) -> Result<(), Unavailable> {
        match item {
            Invalidation::Key {
                base,
                generation_ttl,
                floor,
            } => {
                let floor = floor.map(|f| (f.version, f.ttl));
                dist.invalidate(*base, *generation_ttl, quarantine, floor)
                    .await
            }
            Invalidation::Tag(tag) => {
                let members = dist.tag_mark(tag, self.horizon).await?;
                for member in &members {
                    let base = member
                        .get(..32)
                        .and_then(|hex| u128::from_str_radix(hex, 16).ok());
                    if let Some(base) = base {
                        dist.invalidate(base, self.horizon, quarantine, None)
                            .await?;
                    }
                }
                dist.tag_forget(tag, &members).await
            }
        }
    }

    fn owed_keys(&self) -> std::sync::MutexGuard<'_, HashSet<u128>> {
        self.owed_keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn note_owed(&self, item: &Invalidation) {
        match item {
            Invalidation::Key { base, .. } => {
                self.owed_keys().insert(*base);
            }
            Invalidation::Tag(_) => self.owed_tags.store(true, Ordering::Release),
        }
        self.owing.store(true, Ordering::Release);
    }

    fn settle_owed(&self, item: &Invalidation) {
        if let Invalidation::Key { base, .. } = item {
            self.owed_keys().remove(base);
        }
    }
}

/// Drops base key `base` and its variants from L1 and ends their hot-key L1 grace (also
/// what another instance's `invalidate` event does here).
pub(crate) async fn drop_base(l1: &L1, hot: &HotKeys, base: u128) {
    for hash in l1.invalidate_base(base) {
        hot.invalidated(hash);
    }
}

fn to_owed(item: &Invalidation) -> Owed {
    let millis = |d: &Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    match item {
        Invalidation::Key {
            base,
            generation_ttl,
            floor,
        } => Owed::Key {
            base: format!("{base:032x}"),
            generation_ttl_ms: millis(generation_ttl),
            floor: floor.map(|f| OwedFloor {
                version: f.version.to_string(),
                ttl_ms: millis(&f.ttl),
            }),
        },
        Invalidation::Tag(tag) => Owed::Tag { tag: tag.clone() },
    }
}

/// `None` for a record that does not read (a damaged base, or floor).
fn from_owed(owed: &Owed) -> Option<Invalidation> {
    match owed {
        Owed::Key {
            base,
            generation_ttl_ms,
            floor,
        } => Some(Invalidation::Key {
            base: u128::from_str_radix(base, 16).ok()?,
            generation_ttl: Duration::from_millis(*generation_ttl_ms),
            floor: match floor {
                Some(floor) => Some(Floor {
                    version: floor.version.parse().ok()?,
                    ttl: Duration::from_millis(floor.ttl_ms),
                }),
                None => None,
            },
        }),
        Owed::Tag { tag } => Some(Invalidation::Tag(tag.clone())),
    }
}

impl OwedSet for Invalidator {
    fn owes(&self, base: u128) -> bool {
        Invalidator::owes(self, base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journal_records_round_trip() {
        let items = [
            Invalidation::Key {
                base: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
                generation_ttl: Duration::from_millis(123_456),
                floor: None,
            },
            Invalidation::Key {
                base: 7,
                generation_ttl: Duration::from_millis(1),
                floor: Some(Floor {
                    version: u128::MAX,
                    ttl: Duration::from_secs(10),
                }),
            },
            Invalidation::Tag("item-7".into()),
        ];
        for item in items {
            assert_eq!(from_owed(&to_owed(&item)), Some(item));
        }
        assert_eq!(
            from_owed(&Owed::Key {
                base: "zz".into(),
                generation_ttl_ms: 1,
                floor: None,
            }),
            None
        );
        assert_eq!(
            from_owed(&Owed::Key {
                base: "7".into(),
                generation_ttl_ms: 1,
                floor: Some(OwedFloor {
                    version: "x".into(),
                    ttl_ms: 1
                }),
            }),
            None,
            "a damaged floor is not replayed as no floor"
        );
    }
}
