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
//!
//! A write on a route with `version` sets its keys' version *floor* here instead (as it does
//! in Redis), and so does another instance's write, heard on the bus: for the floor's life,
//! a fill of those keys is served and kept only when its answer carries a version at or
//! above it (see `cache/version.rs`). This is what the fills of this process alone go by
//! (embedded mode, Redis down, a cluster slot being migrated); with Redis, a fill takes the
//! higher of this and the floor in Redis. A floor dropped for room becomes a quarantine of
//! every key until the floor's end (the coarse fallback of the quarantines, below): its
//! keys' fills are then kept nowhere, as after a write without `version`.
//!
//! What the marks cannot know is covered by a floor, the one coarse fallback: a copy known
//! valid only from before the floor is [`Standing::Unverified`] (checked against Redis
//! before it is served, while Redis answers) and a fill that began before it is not kept.
//! The floor rises when this process may have missed invalidations — a gap in the event
//! subscription ([`LocalMarks::mark_all`]) — and when a mark is dropped because the tables
//! are full. The tables are bounded (each mark costs about a kilobyte), so a flood of
//! invalidation events costs a bounded amount of memory and some Redis reads, never a
//! stale answer.
//!
//! The marks also hold whether the event subscription is *confirmed*: live, and its last
//! gap handled (the floor raised once more as it came back). While it is not — from the
//! moment it drops until then, and before the first subscription — an `invalidate` sent
//! by another instance may go unheard even for copies made after the gap began, so the
//! routes that ask for it (`version`, with `cache.l1_while_bus_down = "bypass"`) do not
//! answer from L1 while Redis can be asked instead (see `cache/tiers.rs`). One atomic
//! load per L1 hit of such a route.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::notification::RemovalCause;
use moka::sync::Cache;
use prometheus::IntCounter;

/// How many key marks, tag marks and quarantines are held at most, each.
pub(crate) const MARKS_CAPACITY: u64 = 16_384;

/// How a copy known valid from some position stands now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Standing {
    Valid,
    /// Its key or a tag was invalidated since: never serve it.
    Invalidated,
    /// An invalidation since may have been missed: check it against Redis before serving
    /// it (where there is no Redis to ask, it stands: the direct removal covered it).
    Unverified,
}

#[derive(Debug)]
pub(crate) struct LocalMarks {
    seq: AtomicU64,
    keys: Cache<u128, u64>,
    tags: Cache<String, u64>,
    /// Base key → end of its write quarantine.
    quarantine: Cache<u128, Instant>,
    /// Copies and fills from before this position are not trusted (see the module docs).
    floor: Arc<AtomicU64>,
    /// A quarantine (or a version floor) dropped for room is extended to every key until
    /// its end.
    quarantine_all: Arc<Mutex<Option<Instant>>>,
    /// Base key → its version floor, each expiring at its own end.
    floors: Cache<u128, HeldFloor>,
    /// Whether every invalidation sent from now on is heard here (see the module docs):
    /// true without a bus to miss anything on (embedded mode).
    bus_confirmed: AtomicBool,
}

/// A version floor held here: `version` until `until` (on tokio's clock, so paused time
/// moves it; the table's own expiry, on moka's clock, only frees the room).
#[derive(Clone, Copy, Debug)]
struct HeldFloor {
    version: u128,
    until: tokio::time::Instant,
    /// How long it had left when last set: the table's expiry.
    left: Duration,
}

/// Each floor leaves the table when it ends.
struct FloorExpiry;

impl Expiry<u128, HeldFloor> for FloorExpiry {
    fn expire_after_create(&self, _: &u128, floor: &HeldFloor, _: Instant) -> Option<Duration> {
        Some(floor.left)
    }

    fn expire_after_update(
        &self,
        _: &u128,
        floor: &HeldFloor,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(floor.left)
    }
}

/// Extends the quarantine of every key to `until` (a quarantine or a floor was dropped
/// for room), and counts the drop.
fn quarantine_all_until(all: &Mutex<Option<Instant>>, until: Instant, overflow: &IntCounter) {
    let mut all = all.lock().unwrap_or_else(PoisonError::into_inner);
    if all.is_none_or(|current| current < until) {
        *all = Some(until);
    }
    overflow.inc();
}

impl LocalMarks {
    /// `horizon`: how long a fill can run (upstream timeout, lease, slack). `overflow`
    /// counts marks dropped for room.
    pub(crate) fn new(horizon: Duration, overflow: IntCounter) -> Self {
        Self::with_capacity(horizon, MARKS_CAPACITY, overflow)
    }

    pub(crate) fn with_capacity(horizon: Duration, capacity: u64, overflow: IntCounter) -> Self {
        let floor = Arc::new(AtomicU64::new(0));
        let quarantine_all = Arc::new(Mutex::new(None::<Instant>));
        // A mark dropped for room (not expired) raises the floor to its own position:
        // whatever it would have refused is still refused, coarsely.
        let seq_table = |floor: &Arc<AtomicU64>, overflow: &IntCounter| {
            let (floor, overflow) = (Arc::clone(floor), overflow.clone());
            move |seq: u64, cause: RemovalCause| {
                if cause == RemovalCause::Size {
                    floor.fetch_max(seq, Ordering::AcqRel);
                    overflow.inc();
                }
            }
        };
        let on_key = seq_table(&floor, &overflow);
        let on_tag = seq_table(&floor, &overflow);
        let on_quarantine = {
            let (all, overflow) = (Arc::clone(&quarantine_all), overflow.clone());
            move |_: Arc<u128>, until: Instant, cause: RemovalCause| {
                if cause == RemovalCause::Size {
                    quarantine_all_until(&all, until, &overflow);
                }
            }
        };
        // A floor dropped for room: nothing of any key is kept until it would have ended.
        let on_floor = {
            let all = Arc::clone(&quarantine_all);
            move |_: Arc<u128>, floor: HeldFloor, cause: RemovalCause| {
                if cause == RemovalCause::Size {
                    let left = floor
                        .until
                        .saturating_duration_since(tokio::time::Instant::now());
                    quarantine_all_until(&all, Instant::now() + left, &overflow);
                }
            }
        };
        LocalMarks {
            seq: AtomicU64::new(0),
            keys: Cache::builder()
                .max_capacity(capacity)
                .time_to_live(horizon)
                .eviction_listener(move |_, seq, cause| on_key(seq, cause))
                .build(),
            tags: Cache::builder()
                .max_capacity(capacity)
                .time_to_live(horizon)
                .eviction_listener(move |_, seq, cause| on_tag(seq, cause))
                .build(),
            quarantine: Cache::builder()
                .max_capacity(capacity)
                .time_to_live(horizon)
                .eviction_listener(on_quarantine)
                .build(),
            floor,
            quarantine_all,
            floors: Cache::builder()
                .max_capacity(capacity)
                .expire_after(FloorExpiry)
                .eviction_listener(on_floor)
                .build(),
            bus_confirmed: AtomicBool::new(true),
        }
    }

    /// The event subscription is down (or not up yet): invalidations may go unheard from
    /// now on, until [`LocalMarks::bus_confirmed_again`]. Raises the floor too (as
    /// [`LocalMarks::mark_all`]).
    pub(crate) fn bus_lost(&self) {
        self.bus_confirmed.store(false, Ordering::Release);
        self.mark_all();
    }

    /// The subscription is live again: whatever was read or filled during the gap may
    /// predate an invalidation sent during it, so the floor rises before the bus counts as
    /// confirmed (a copy from the gap is then checked against Redis once).
    pub(crate) fn bus_confirmed_again(&self) {
        self.mark_all();
        self.bus_confirmed.store(true, Ordering::Release);
    }

    /// Whether the event subscription is live and its last gap handled.
    pub(crate) fn bus_confirmed(&self) -> bool {
        self.bus_confirmed.load(Ordering::Acquire)
    }

    /// Raises the version floor of `base` to `version` for `ttl` from now: the floor kept
    /// is the higher of the two, until the later end.
    pub(crate) fn raise_floor(&self, base: u128, version: u128, ttl: Duration) {
        let now = tokio::time::Instant::now();
        let until = now + ttl;
        self.floors.entry(base).and_upsert_with(|held| {
            let (version, until) = match held.map(|e| e.into_value()) {
                Some(old) if old.until > now => (old.version.max(version), old.until.max(until)),
                _ => (version, until),
            };
            HeldFloor {
                version,
                until,
                left: until - now,
            }
        });
    }

    /// The version floor of `base` this process knows of, while it lasts.
    pub(crate) fn floor(&self, base: u128) -> Option<u128> {
        let held = self.floors.get(&base)?;
        (tokio::time::Instant::now() < held.until).then_some(held.version)
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

    fn next(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::AcqRel) + 1
    }

    pub(crate) fn mark_key(&self, base: u128) {
        let seq = self.next();
        self.keys.insert(base, seq);
    }

    pub(crate) fn mark_tag(&self, tag: &str) {
        let seq = self.next();
        self.tags.insert(tag.to_owned(), seq);
    }

    /// Invalidations may have been missed (the event subscription had a gap): every copy
    /// known valid from before now is unverified, every fill begun before now is not kept.
    pub(crate) fn mark_all(&self) {
        let seq = self.next();
        self.floor.fetch_max(seq, Ordering::AcqRel);
    }

    /// How a copy known valid from `since` stands: the fast path (nothing was marked
    /// since) is one atomic load, for every L1 hit.
    pub(crate) fn standing(&self, base: u128, tags: &[String], since: u64) -> Standing {
        if self.seq.load(Ordering::Acquire) <= since {
            return Standing::Valid;
        }
        let after = |seq: Option<u64>| seq.is_some_and(|s| s > since);
        if after(self.keys.get(&base)) || tags.iter().any(|t| after(self.tags.get(t))) {
            Standing::Invalidated
        } else if since < self.floor.load(Ordering::Acquire) {
            Standing::Unverified
        } else {
            Standing::Valid
        }
    }

    /// Whether an answer whose fetch began at `snapshot` may still be kept.
    pub(crate) fn allows(&self, base: u128, tags: &[String], snapshot: u64) -> bool {
        let now = Instant::now();
        let quarantined = self.quarantine.get(&base).is_some_and(|until| now < until)
            || self
                .quarantine_all
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_some_and(|until| now < until);
        !quarantined && self.standing(base, tags, snapshot) == Standing::Valid
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_after_the_snapshot_refuses() {
        let marks = LocalMarks::new(Duration::from_secs(60), counter());
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
        let marks = LocalMarks::new(Duration::from_secs(60), counter());
        marks.quarantine(3, Duration::from_millis(50));
        marks.quarantine(3, Duration::from_millis(1));
        let snap = marks.snapshot();
        assert!(!marks.allows(3, &[], snap), "the longer quarantine is kept");
        std::thread::sleep(Duration::from_millis(60));
        assert!(marks.allows(3, &[], snap));
    }

    /// On paused time: a floor lasts its ttl, a raise keeps the higher version and the
    /// later end, and a lower one changes neither.
    #[tokio::test(start_paused = true)]
    async fn a_floor_keeps_the_highest_version_until_the_latest_end() {
        let marks = LocalMarks::new(Duration::from_secs(60), counter());
        assert_eq!(marks.floor(1), None);
        marks.raise_floor(1, 7, Duration::from_secs(10));
        assert_eq!(marks.floor(1), Some(7));
        assert_eq!(marks.floor(2), None, "per base key");
        marks.raise_floor(1, 5, Duration::from_secs(2));
        assert_eq!(marks.floor(1), Some(7), "a lower version does not lower it");
        tokio::time::advance(Duration::from_secs(9)).await;
        marks.raise_floor(1, 9, Duration::from_secs(5));
        assert_eq!(marks.floor(1), Some(9));
        tokio::time::advance(Duration::from_secs(4)).await;
        assert_eq!(marks.floor(1), Some(9), "the later end is kept");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(marks.floor(1), None, "ended");
        marks.raise_floor(1, 3, Duration::from_secs(1));
        assert_eq!(marks.floor(1), Some(3), "an ended floor is not raised from");
    }

    /// More floors than the table holds: each one dropped quarantines every key until it
    /// would have ended, so no fill is kept that it would have refused.
    #[test]
    fn a_floor_dropped_for_room_quarantines_every_key() {
        let overflow = counter();
        let marks = LocalMarks::with_capacity(Duration::from_secs(60), 100, overflow.clone());
        for base in 0..10_000u128 {
            marks.raise_floor(base, 1, Duration::from_secs(30));
        }
        marks.floors.run_pending_tasks();
        assert!(marks.floors.entry_count() <= 100);
        assert!(overflow.get() > 0, "drops are counted");
        let after = marks.snapshot();
        assert!(!marks.allows(123_456, &[], after), "every key quarantined");
    }

    fn counter() -> IntCounter {
        IntCounter::new("overflow", "overflow").expect("counter")
    }

    #[test]
    fn a_gap_leaves_earlier_copies_unverified_and_refuses_earlier_fills() {
        let marks = LocalMarks::new(Duration::from_secs(60), counter());
        let before = marks.snapshot();
        marks.mark_all();
        assert_eq!(marks.standing(1, &[], before), Standing::Unverified);
        assert!(!marks.allows(1, &[], before), "a fill begun before the gap");
        let after = marks.snapshot();
        assert_eq!(marks.standing(1, &[], after), Standing::Valid);
        assert!(marks.allows(1, &[], after));
        marks.mark_key(1);
        assert_eq!(marks.standing(1, &[], before), Standing::Invalidated);
    }

    /// The bus is confirmed only once it is back and the gap handled: a copy made while it
    /// was down (after the gap's mark) stands valid by the marks, but the bus says it may
    /// have missed an invalidation; once back, the floor rose past it, so it is checked.
    #[test]
    fn the_bus_is_confirmed_only_after_the_gap_is_handled() {
        let marks = LocalMarks::new(Duration::from_secs(60), counter());
        assert!(marks.bus_confirmed(), "no bus, nothing to miss");
        let before = marks.snapshot();
        marks.bus_lost();
        assert!(!marks.bus_confirmed());
        assert_eq!(marks.standing(1, &[], before), Standing::Unverified);
        let during = marks.snapshot();
        assert_eq!(
            marks.standing(1, &[], during),
            Standing::Valid,
            "the marks alone cannot tell: the bus state does"
        );
        marks.bus_confirmed_again();
        assert!(marks.bus_confirmed());
        assert_eq!(marks.standing(1, &[], during), Standing::Unverified);
        assert!(!marks.allows(1, &[], during), "a fill begun during the gap");
        let after = marks.snapshot();
        assert_eq!(marks.standing(1, &[], after), Standing::Valid);
    }

    /// A flood of marks keeps the tables at their capacity; what a dropped mark would have
    /// refused is still refused.
    #[test]
    fn the_tables_are_bounded_and_an_overflow_never_lets_a_stale_copy_through() {
        let overflow = counter();
        let marks = LocalMarks::with_capacity(Duration::from_secs(60), 100, overflow.clone());
        let before = marks.snapshot();
        for base in 0..10_000u128 {
            marks.mark_key(base);
            marks.mark_tag(&format!("t{base}"));
            marks.quarantine(base, Duration::from_secs(30));
        }
        marks.keys.run_pending_tasks();
        marks.tags.run_pending_tasks();
        marks.quarantine.run_pending_tasks();
        assert!(
            marks.keys.entry_count() <= 100,
            "{}",
            marks.keys.entry_count()
        );
        assert!(
            marks.tags.entry_count() <= 100,
            "{}",
            marks.tags.entry_count()
        );
        assert!(marks.quarantine.entry_count() <= 100);
        assert!(overflow.get() > 0, "overflows are counted");
        for base in [0, 1, 5_000, 9_999] {
            assert_ne!(marks.standing(base, &[], before), Standing::Valid, "{base}");
            assert!(!marks.allows(base, &[format!("t{base}")], before), "{base}");
        }
        // A fill begun after the flood is still refused by the quarantines it overflowed.
        let after = marks.snapshot();
        assert!(!marks.allows(0, &[], after), "quarantine of a dropped key");
    }
}
