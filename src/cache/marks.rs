//! Local invalidation marks: what this process knows was invalidated, and when, in one
//! monotonic sequence.
//!
//! A fill takes a [`LocalMarks::snapshot`] before its fetch; its answer may enter L1 only if
//! neither its base key nor any of its tags was marked since. This is the generation check
//! for the copies Redis does not guard: embedded mode, fills made while Redis is down, and
//! the moment between a fill's store in Redis and its L1 insert, when another instance's
//! `invalidate` event can arrive. Marks live as long as the longest fill could run.
//!
//! A write also quarantines its keys here for its `double_delete_delay`, as it does in Redis:
//! meanwhile nothing fetched for them is kept (the origin's replica may lag behind it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use moka::sync::Cache;

#[derive(Debug)]
pub(crate) struct LocalMarks {
    seq: AtomicU64,
    keys: Cache<u128, u64>,
    tags: Cache<String, u64>,
    /// Base key → end of its write quarantine.
    quarantine: Cache<u128, Instant>,
}

impl LocalMarks {
    /// `horizon`: how long a fill can run (upstream timeout, lease, slack).
    pub(crate) fn new(horizon: Duration) -> Self {
        LocalMarks {
            seq: AtomicU64::new(0),
            keys: Cache::builder().time_to_live(horizon).build(),
            tags: Cache::builder().time_to_live(horizon).build(),
            quarantine: Cache::builder().time_to_live(horizon).build(),
        }
    }

    /// Keeps answers for `base` out of L1 for `length` from now (a longer quarantine that
    /// is already running is kept).
    pub(crate) fn quarantine(&self, base: u128, length: Duration) {
        if length.is_zero() {
            return;
        }
        let until = Instant::now() + length;
        if self
            .quarantine
            .get(&base)
            .is_none_or(|current| current < until)
        {
            self.quarantine.insert(base, until);
        }
    }

    pub(crate) fn snapshot(&self) -> u64 {
        self.seq.load(Ordering::Acquire)
    }

    pub(crate) fn mark_key(&self, base: u128) {
        let seq = self.seq.fetch_add(1, Ordering::AcqRel) + 1;
        self.keys.insert(base, seq);
    }

    pub(crate) fn mark_tag(&self, tag: &str) {
        let seq = self.seq.fetch_add(1, Ordering::AcqRel) + 1;
        self.tags.insert(tag.to_owned(), seq);
    }

    /// Whether a copy known valid from `since` is still valid: the fast path (nothing was
    /// marked since) is one atomic load, for every L1 hit.
    pub(crate) fn unchanged_since(&self, base: u128, tags: &[String], since: u64) -> bool {
        if self.seq.load(Ordering::Acquire) <= since {
            return true;
        }
        let after = |seq: Option<u64>| seq.is_some_and(|s| s > since);
        !after(self.keys.get(&base)) && !tags.iter().any(|t| after(self.tags.get(t)))
    }

    /// Whether an answer whose fetch began at `snapshot` may still be kept.
    pub(crate) fn allows(&self, base: u128, tags: &[String], snapshot: u64) -> bool {
        let quarantined = self
            .quarantine
            .get(&base)
            .is_some_and(|until| Instant::now() < until);
        !quarantined && self.unchanged_since(base, tags, snapshot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_after_the_snapshot_refuses() {
        let marks = LocalMarks::new(Duration::from_secs(60));
        marks.mark_key(1);
        let snap = marks.snapshot();
        assert!(marks.allows(1, &[], snap), "marked before the fetch began");
        marks.mark_key(1);
        assert!(!marks.allows(1, &[], snap));
        assert!(marks.allows(2, &[], snap));
        marks.mark_tag("t");
        assert!(!marks.allows(2, &["t".into()], snap));
        assert!(marks.allows(2, &["u".into()], snap));
    }

    #[test]
    fn a_quarantine_refuses_until_it_ends() {
        let marks = LocalMarks::new(Duration::from_secs(60));
        marks.quarantine(3, Duration::from_millis(50));
        marks.quarantine(3, Duration::from_millis(1));
        let snap = marks.snapshot();
        assert!(!marks.allows(3, &[], snap), "the longer quarantine is kept");
        std::thread::sleep(Duration::from_millis(60));
        assert!(marks.allows(3, &[], snap));
    }
}
