//! In-process single-flight: concurrent misses for one key make one origin request.
//!
//! The first request for a key becomes the [`Leader`] and fetches; the others become
//! followers and wait for the leader's [`FlightResult`] on a `watch` channel. Shaped like
//! pingora-cache's lock: the leader's permit has a `Drop` that never strands followers —
//! a leader that is cancelled (client hung up, shutdown) publishes `Abandoned`, and the
//! followers race to elect a new leader among themselves.
//!
//! Each follower waits until a deadline of its own (`lock.wait_timeout` after it began
//! waiting, whatever its leader waits on): past it, [`Follower::wait`] says so
//! ([`Waited::TimedOut`]) and the caller answers per `lock.on_timeout`. The first follower
//! of a flight to time out is told it is the first, so a flight's timeouts are logged once.
//!
//! A flight is joined only while its key has not been invalidated here since it began (the
//! local marks, [`LocalMarks`], say so: this process's own writes and the `invalidate`
//! events of other instances'). A request that arrives after an invalidation must not be
//! given an answer fetched before it: it leads a new flight instead, which replaces the old
//! one in the table (the old leader still answers the followers it had, which arrived
//! before the invalidation; its `finish` removes only its own slot).
//!
//! Across instances the same shape repeats on the Redis lock: see [`fleet`].

pub(crate) mod fleet;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;
use tokio::time::Instant;

use crate::cache::Entry;
use crate::cache::marks::{LocalMarks, Standing};
use crate::metrics::Outcome;

/// How a flight ended, as seen by its followers. `F` is the shareable copy of a failed
/// answer (the read path's buffered error response).
#[derive(Debug)]
pub(crate) enum FlightResult<F> {
    /// The answer was stored; followers serve it. The outcome says where it came from: a
    /// cache tier when the leader's re-check found it there (no origin fetch was made for
    /// it, so the followers' answers are hits too), otherwise a miss.
    Filled(Arc<Entry>, Outcome),
    /// The answer must not be shared (per-user, uncacheable status, too large): each
    /// follower fetches for itself.
    Uncacheable,
    /// The fetch failed (5xx, timeout, shed). With a copy of the failure that says
    /// `retry`, followers elect a new leader (one more origin attempt); otherwise they answer
    /// with the copy.
    Failed(Option<Arc<F>>),
    /// The leader went away without an answer: followers elect a new leader.
    Abandoned,
}

impl<F> Clone for FlightResult<F> {
    fn clone(&self) -> Self {
        match self {
            FlightResult::Filled(entry, outcome) => {
                FlightResult::Filled(Arc::clone(entry), *outcome)
            }
            FlightResult::Uncacheable => FlightResult::Uncacheable,
            FlightResult::Failed(failure) => FlightResult::Failed(failure.clone()),
            FlightResult::Abandoned => FlightResult::Abandoned,
        }
    }
}

/// Who started a flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FlightKind {
    /// A miss that requests are waiting on: nothing usable was cached when it started.
    Foreground,
    /// A refresh nobody waits on (stale-while-revalidate, early refresh).
    Background,
}

#[derive(Debug)]
struct Slot<F> {
    tx: watch::Sender<Option<FlightResult<F>>>,
    kind: FlightKind,
    /// A follower has timed out waiting on this flight.
    timed_out: AtomicBool,
    /// The key's base key, and the local marks' position when the flight began.
    base: u128,
    since: u64,
}

/// The table of flights in progress, one per key hash.
#[derive(Debug)]
pub(crate) struct Flights<F> {
    // A std mutex: it is held only to look up or remove a map entry, never across an await.
    in_progress: Mutex<HashMap<u128, Arc<Slot<F>>>>,
    /// What this process knows was invalidated: a flight begun before its key's
    /// invalidation is not joined. `None`: every flight is joined (tests).
    marks: Option<Arc<LocalMarks>>,
}

impl<F> Default for Flights<F> {
    fn default() -> Self {
        Flights {
            in_progress: Mutex::new(HashMap::new()),
            marks: None,
        }
    }
}

/// The role a request got for one key.
pub(crate) enum Role<F> {
    Leader(Leader<F>),
    Follower(Follower<F>),
}

/// Proof of leadership for one key; must be [`finish`](Leader::finish)ed.
pub(crate) struct Leader<F> {
    flights: Arc<Flights<F>>,
    hash: u128,
    slot: Arc<Slot<F>>,
    finished: bool,
}

/// A waiter on another request's fetch.
pub(crate) struct Follower<F> {
    rx: watch::Receiver<Option<FlightResult<F>>>,
    slot: Arc<Slot<F>>,
}

/// How a follower's wait ended.
#[derive(Debug)]
pub(crate) enum Waited<F> {
    /// The leader finished (or went away) before the deadline.
    Done(FlightResult<F>),
    /// The deadline came first; `first` for the first follower of the flight it reached.
    TimedOut { first: bool },
}

impl<F> Flights<F> {
    /// A table whose flights are not joined once their key was invalidated (`marks`).
    pub(crate) fn new(marks: Arc<LocalMarks>) -> Self {
        Flights {
            in_progress: Mutex::new(HashMap::new()),
            marks: Some(marks),
        }
    }

    /// Joins the flight for `hash` (of base key `base`), becoming its leader (of a `kind`
    /// flight) when there is none, or when the one there began before its key was
    /// invalidated here.
    pub(crate) fn join(self: &Arc<Self>, hash: u128, base: u128, kind: FlightKind) -> Role<F> {
        let mut map = self
            .in_progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = map.get(&hash)
            && !self.overtaken(slot)
        {
            return Role::Follower(Follower {
                rx: slot.tx.subscribe(),
                slot: Arc::clone(slot),
            });
        }
        let slot = Arc::new(Slot {
            tx: watch::Sender::new(None),
            kind,
            timed_out: AtomicBool::new(false),
            base,
            since: self.marks.as_ref().map_or(0, |m| m.snapshot()),
        });
        map.insert(hash, Arc::clone(&slot));
        Role::Leader(Leader {
            flights: Arc::clone(self),
            hash,
            slot,
            finished: false,
        })
    }

    /// Whether a foreground fill of `hash` is running in this process: its leader found
    /// nothing usable in L1 or L2, so a request arriving now can join it without looking
    /// (in a stampede that saves one Redis read per request).
    pub(crate) fn foreground_in_progress(&self, hash: u128) -> bool {
        self.in_progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&hash)
            .is_some_and(|slot| slot.kind == FlightKind::Foreground && !self.overtaken(slot))
    }

    /// Whether `slot`'s key was invalidated here since its flight began (or invalidations
    /// may have been missed since: a gap in the event bus). One atomic load when nothing
    /// was marked since.
    fn overtaken(&self, slot: &Slot<F>) -> bool {
        self.marks
            .as_ref()
            .is_some_and(|m| m.standing(slot.base, &[], slot.since) != Standing::Valid)
    }

    /// Number of flights in progress (for tests and metrics).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.in_progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    fn remove(&self, hash: u128, slot: &Arc<Slot<F>>) {
        let mut map = self
            .in_progress
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Only remove our own slot: a newer flight for the same key may already exist.
        if map.get(&hash).is_some_and(|s| Arc::ptr_eq(s, slot)) {
            map.remove(&hash);
        }
    }
}

impl<F> Leader<F> {
    /// Publishes the result to every follower and ends the flight.
    ///
    /// The flight is removed from the table *before* followers are woken, and the caller
    /// stores the entry (L1/L2) before calling this: a request arriving after the removal
    /// finds the entry in the cache or starts a fresh flight, never a finished one.
    pub(crate) fn finish(mut self, result: FlightResult<F>) {
        self.finished = true;
        self.flights.remove(self.hash, &self.slot);
        self.slot.tx.send_replace(Some(result));
    }
}

impl<F> Drop for Leader<F> {
    fn drop(&mut self) {
        if !self.finished {
            self.flights.remove(self.hash, &self.slot);
            self.slot.tx.send_replace(Some(FlightResult::Abandoned));
        }
    }
}

impl<F> Follower<F> {
    /// Waits for the leader's result until `deadline`. A result there at the deadline wins
    /// over the timeout.
    ///
    /// # Cancel safety
    /// Cancel-safe: dropping the future only drops this follower's receiver.
    pub(crate) async fn wait(mut self, deadline: Instant) -> Waited<F> {
        let waited = tokio::time::timeout_at(deadline, self.rx.wait_for(Option::is_some)).await;
        match waited {
            Ok(Ok(result)) => Waited::Done(result.clone().unwrap_or(FlightResult::Abandoned)),
            // Sender dropped without a value (cannot happen: Drop sends).
            Ok(Err(_)) => Waited::Done(FlightResult::Abandoned),
            Err(_) => Waited::TimedOut {
                first: !self.slot.timed_out.swap(true, Ordering::Relaxed),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    #[tokio::test]
    async fn one_leader_many_followers() {
        let flights = Arc::new(Flights::<()>::default());
        let leaders = Arc::new(AtomicUsize::new(0));
        let barrier = Arc::new(tokio::sync::Barrier::new(100));
        let mut tasks = Vec::new();
        for _ in 0..100 {
            let (flights, leaders, barrier) = (flights.clone(), leaders.clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                match flights.join(42, 42, FlightKind::Foreground) {
                    Role::Leader(l) => {
                        leaders.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        l.finish(FlightResult::Uncacheable);
                        true
                    }
                    Role::Follower(f) => {
                        matches!(
                            f.wait(Instant::now() + Duration::from_secs(5)).await,
                            Waited::Done(FlightResult::Uncacheable)
                        )
                    }
                }
            }));
        }
        for t in tasks {
            assert!(t.await.unwrap());
        }
        assert_eq!(leaders.load(Ordering::SeqCst), 1);
        assert_eq!(flights.len(), 0);
    }

    #[tokio::test]
    async fn dropped_leader_releases_followers() {
        let flights = Arc::new(Flights::<()>::default());
        let Role::Leader(leader) = flights.join(1, 1, FlightKind::Foreground) else {
            panic!("first join must lead")
        };
        let Role::Follower(follower) = flights.join(1, 1, FlightKind::Foreground) else {
            panic!("second join must follow")
        };
        drop(leader);
        assert!(matches!(
            follower.wait(Instant::now() + Duration::from_secs(1)).await,
            Waited::Done(FlightResult::Abandoned)
        ));
        assert!(matches!(
            flights.join(1, 1, FlightKind::Foreground),
            Role::Leader(_)
        ));
    }

    /// A request that arrives after its key was invalidated here leads a new flight, not
    /// the one begun before (whose answer may predate the write); the old leader still
    /// answers its own followers and leaves the new flight in the table.
    #[tokio::test]
    async fn a_flight_begun_before_an_invalidation_is_not_joined() {
        let marks = Arc::new(LocalMarks::new(
            Duration::from_secs(60),
            prometheus::IntCounter::new("overflow", "overflow").expect("counter"),
        ));
        let flights = Arc::new(Flights::<()>::new(Arc::clone(&marks)));
        let Role::Leader(old) = flights.join(11, 10, FlightKind::Foreground) else {
            panic!("first join must lead")
        };
        let Role::Follower(before) = flights.join(11, 10, FlightKind::Foreground) else {
            panic!("a join before the invalidation follows")
        };
        marks.mark_key(99);
        assert!(
            matches!(
                flights.join(11, 10, FlightKind::Foreground),
                Role::Follower(_)
            ),
            "another key's invalidation changes nothing"
        );
        marks.mark_key(10);
        assert!(!flights.foreground_in_progress(11));
        let Role::Leader(new) = flights.join(11, 10, FlightKind::Foreground) else {
            panic!("a join after the invalidation leads a new flight")
        };
        let Role::Follower(after) = flights.join(11, 10, FlightKind::Foreground) else {
            panic!("the new flight is joined")
        };
        old.finish(FlightResult::Uncacheable);
        let deadline = Instant::now() + Duration::from_secs(1);
        assert!(matches!(
            before.wait(deadline).await,
            Waited::Done(FlightResult::Uncacheable)
        ));
        assert!(flights.foreground_in_progress(11), "the new flight stays");
        new.finish(FlightResult::Abandoned);
        assert!(matches!(
            after.wait(deadline).await,
            Waited::Done(FlightResult::Abandoned)
        ));
        assert_eq!(flights.len(), 0);
    }

    #[test]
    fn only_foreground_flights_are_joined_without_looking() {
        let flights = Arc::new(Flights::<()>::default());
        let _refresh = flights.join(1, 1, FlightKind::Background);
        let _miss = flights.join(2, 2, FlightKind::Foreground);
        assert!(!flights.foreground_in_progress(1));
        assert!(flights.foreground_in_progress(2));
        assert!(!flights.foreground_in_progress(3));
    }

    /// Each follower's wait ends at its own deadline, however long the leader takes, and
    /// the first of the flight to time out is told so (one log line per flight). A result
    /// published before a deadline is that follower's answer.
    #[tokio::test(start_paused = true)]
    async fn each_follower_waits_until_its_own_deadline() {
        let flights = Arc::new(Flights::<()>::default());
        let Role::Leader(leader) = flights.join(7, 7, FlightKind::Foreground) else {
            panic!("first join must lead")
        };
        let started = Instant::now();
        let wait_timeout = Duration::from_secs(1);
        let mut waiting = Vec::new();
        // Followers join 0, 300 and 600 ms after the leader started.
        for joined_at in [0, 300, 600] {
            let flights = Arc::clone(&flights);
            waiting.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(joined_at)).await;
                let Role::Follower(follower) = flights.join(7, 7, FlightKind::Foreground) else {
                    panic!("a join during the flight must follow")
                };
                let waited = follower.wait(Instant::now() + wait_timeout).await;
                (waited, started.elapsed())
            }));
        }
        // The leader takes 1.5 s: the first two followers time out, the third gets it.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        leader.finish(FlightResult::Uncacheable);
        let mut ended = Vec::new();
        for task in waiting {
            ended.push(task.await.expect("follower task"));
        }
        assert!(matches!(ended[0].0, Waited::TimedOut { first: true }));
        assert_eq!(ended[0].1, Duration::from_millis(1000));
        assert!(matches!(ended[1].0, Waited::TimedOut { first: false }));
        assert_eq!(ended[1].1, Duration::from_millis(1300));
        assert!(matches!(
            ended[2].0,
            Waited::Done(FlightResult::Uncacheable)
        ));
        assert_eq!(ended[2].1, Duration::from_millis(1500));
    }
}
