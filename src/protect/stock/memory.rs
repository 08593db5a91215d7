//! The stock ledger in process memory (embedded mode): the Redis scripts of `shared.rs`,
//! one segment under one mutex. One instance gates alone; several embedded instances would
//! each count the whole stock (the origin's own check still holds; only the flood
//! protection is divided).
//!
//! Bounded: segments exist only for resources the origin gave a number for, and both
//! tables forget what was not touched for the idle expiry (segments) or outlived its time
//! (records).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::ops::{Applied, Buy, BuyRequest, Outcome, Settle, Settled};
use crate::clock::now_ms;

/// Most resource segments and idempotency records kept; beyond, the least used go (a
/// forgotten segment is loaded again from the origin).
const MAX_ENTRIES: u64 = 1_000_000;

#[derive(Debug, Default)]
struct Segment {
    /// Units available.
    n: u64,
    /// Live reservations: member → deadline (ms).
    reservations: HashMap<String, u64>,
    /// Consumed reservations, oldest first: (when, member).
    consumed: VecDeque<(u64, String)>,
}

fn units_of(member: &str) -> u64 {
    member
        .split_once('.')
        .and_then(|(units, _)| units.parse().ok())
        .unwrap_or(0)
}

impl Segment {
    /// Units held by live reservations.
    fn reserved(&self) -> u64 {
        self.reservations.keys().map(|m| units_of(m)).sum()
    }

    /// Removes expired reservations; returns their units.
    fn expire(&mut self, now: u64) -> u64 {
        let mut expired = 0;
        self.reservations.retain(|member, deadline| {
            let live = *deadline > now;
            if !live {
                expired += units_of(member);
            }
            live
        });
        expired
    }
}

type Segments = moka::sync::Cache<(u128, u16), Arc<Mutex<Segment>>>;

/// Idempotency records: (resource, key hash) → (record, deadline in ms).
type Records = moka::sync::Cache<(u128, u128), (Arc<Vec<u8>>, u64)>;

/// The ledger of one gate in embedded mode.
#[derive(Debug)]
pub(crate) struct MemoryLedger {
    segments: Segments,
    records: Records,
}

impl MemoryLedger {
    /// `idle`: how long an untouched segment is kept; `longest_record`: the longest a record
    /// lives.
    pub(crate) fn new(idle: Duration, longest_record: Duration) -> Self {
        MemoryLedger {
            segments: moka::sync::Cache::builder()
                .max_capacity(MAX_ENTRIES)
                .time_to_idle(idle)
                .build(),
            records: moka::sync::Cache::builder()
                .max_capacity(MAX_ENTRIES)
                .time_to_live(longest_record)
                .build(),
        }
    }

    fn record(&self, resource: u128, key: u128) -> Option<Arc<Vec<u8>>> {
        let (record, deadline) = self.records.get(&(resource, key))?;
        (deadline > now_ms()).then_some(record)
    }

    fn put_record(&self, resource: u128, key: u128, value: &[u8], ttl_ms: u64) {
        self.records.insert(
            (resource, key),
            (Arc::new(value.to_vec()), now_ms().saturating_add(ttl_ms)),
        );
    }

    pub(crate) fn buy(&self, resource: u128, segment: u16, request: &BuyRequest<'_>) -> Buy {
        if let Some(claim) = &request.record
            && let Some(record) = self.record(resource, claim.key)
        {
            let fingerprint = format!("{:016x}", claim.fingerprint);
            if claim.reclaim
                && record.first() == Some(&b'U')
                && record.get(2..18) == Some(fingerprint.as_bytes())
            {
                let mut again = record.to_vec();
                again[0] = b'P';
                self.put_record(resource, claim.key, &again, request.ttl_ms);
                return Buy::Reclaimed(record.to_vec());
            }
            return Buy::Known(record.to_vec());
        }
        let Some(state) = self.segments.get(&(resource, segment)) else {
            return Buy::Unloaded;
        };
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = now_ms();
        let expired = state.expire(now);
        if state.n < request.units {
            if let Some(claim) = request.record.as_ref().filter(|c| c.claim_when_short) {
                self.put_record(resource, claim.key, &claim.pending, request.ttl_ms);
            }
            return Buy::Short {
                left: state.n,
                expired,
                reserved: state.reserved(),
            };
        }
        state.n -= request.units;
        state.reservations.insert(
            request.member.to_owned(),
            now.saturating_add(request.ttl_ms),
        );
        if let Some(claim) = &request.record {
            self.put_record(resource, claim.key, &claim.pending, request.ttl_ms);
        }
        Buy::Taken {
            left: state.n,
            expired,
        }
    }

    pub(crate) fn settle(&self, resource: u128, segment: u16, settle: &Settle) -> Settled {
        let names_this_buy =
            |r: &Arc<Vec<u8>>| std::str::from_utf8(r).is_ok_and(|r| r.contains(&settle.member));
        match &settle.record {
            Some(record)
                if record.forget
                    && self
                        .record(resource, record.key)
                        .is_some_and(|r| names_this_buy(&r)) =>
            {
                self.records.invalidate(&(resource, record.key));
            }
            Some(record) if !record.forget => {
                self.put_record(resource, record.key, &record.value, record.ttl_ms);
            }
            _ => {}
        }
        let Some(state) = self.segments.get(&(resource, segment)) else {
            return Settled {
                removed: false,
                left: -1,
                reserved: 0,
            };
        };
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = now_ms();
        let removed =
            settle.outcome != Outcome::Doubt && state.reservations.remove(&settle.member).is_some();
        match settle.outcome {
            Outcome::Sold if !settle.member.is_empty() => {
                let at = now.saturating_sub(
                    u64::try_from(settle.answered.elapsed().as_millis()).unwrap_or(u64::MAX),
                );
                state.consumed.push_back((at, settle.member.to_owned()));
                let horizon = now.saturating_sub(settle.consumed_kept_ms);
                while state.consumed.front().is_some_and(|(at, _)| *at < horizon) {
                    state.consumed.pop_front();
                }
            }
            Outcome::Back if removed => state.n += settle.units,
            Outcome::NoneLeft => state.n = 0,
            _ => {}
        }
        Settled {
            removed,
            left: i64::try_from(state.n).unwrap_or(i64::MAX),
            reserved: state.reserved(),
        }
    }

    pub(crate) fn write_record(&self, resource: u128, key: u128, record: Option<(&[u8], u64)>) {
        match record {
            Some((value, ttl_ms)) => self.put_record(resource, key, value, ttl_ms),
            None => self.records.invalidate(&(resource, key)),
        }
    }

    pub(crate) fn read_record(&self, resource: u128, key: u128) -> Option<Vec<u8>> {
        self.record(resource, key).map(|r| r.to_vec())
    }

    pub(crate) fn apply(
        &self,
        resource: u128,
        segment: u16,
        budget: u64,
        since_ms: u64,
        consumed_kept_ms: u64,
    ) -> Applied {
        let (state, old) = match self.segments.get(&(resource, segment)) {
            Some(state) => {
                let old = state.lock().unwrap_or_else(PoisonError::into_inner).n;
                (state, Some(old))
            }
            None => {
                let state = self.segments.get_with((resource, segment), || {
                    Arc::new(Mutex::new(Segment::default()))
                });
                (state, None)
            }
        };
        let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
        let now = now_ms();
        state.expire(now);
        let reserved = state.reserved();
        let horizon = now.saturating_sub(consumed_kept_ms);
        while state.consumed.front().is_some_and(|(at, _)| *at < horizon) {
            state.consumed.pop_front();
        }
        let recent: u64 = state
            .consumed
            .iter()
            .filter(|(at, _)| *at >= since_ms)
            .map(|(_, m)| units_of(m))
            .sum();
        state.n = budget.saturating_sub(reserved).saturating_sub(recent);
        Applied { old, new: state.n }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protect::stock::ops::RecordClaim;

    fn buy(ledger: &MemoryLedger, member: &str, units: u64) -> Buy {
        ledger.buy(
            1,
            0,
            &BuyRequest {
                units,
                member,
                ttl_ms: 1000,
                idle_ms: 60_000,
                record: None,
            },
        )
    }

    fn settle(ledger: &MemoryLedger, member: &str, outcome: Outcome) -> Settled {
        settle_answered(ledger, member, outcome, tokio::time::Instant::now())
    }

    fn settle_answered(
        ledger: &MemoryLedger,
        member: &str,
        outcome: Outcome,
        answered: tokio::time::Instant,
    ) -> Settled {
        ledger.settle(
            1,
            0,
            &Settle {
                member: member.to_owned(),
                outcome,
                units: units_of(member),
                idle_ms: 60_000,
                consumed_kept_ms: 10_000,
                answered,
                record: None,
            },
        )
    }

    /// Regression: a sale's settlement that reached the ledger late (retried while Redis
    /// was away) was consumed as of its arrival, so a reconcile that began after the
    /// origin's answer, whose number already showed the sale, took it off a second time:
    /// the gate said sold out with a unit left at the origin until the next reconcile.
    #[tokio::test(start_paused = true)]
    async fn a_sale_settled_late_counts_from_the_origin_answer() {
        let ledger = MemoryLedger::new(Duration::from_secs(60), Duration::from_secs(60));
        assert_eq!(ledger.apply(1, 0, 2, now_ms(), 10_000).new, 2);
        assert!(matches!(buy(&ledger, "1.a", 1), Buy::Taken { left: 1, .. }));
        let answered = tokio::time::Instant::now();
        tokio::time::advance(Duration::from_secs(2)).await;
        // A reconcile begins: the origin sold 1 of its 2 before it was asked.
        let since = now_ms();
        settle_answered(&ledger, "1.a", Outcome::Sold, answered);
        assert_eq!(ledger.apply(1, 0, 1, since, 10_000).new, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn units_are_taken_given_back_and_reconciled() {
        let ledger = MemoryLedger::new(Duration::from_secs(60), Duration::from_secs(60));
        assert_eq!(buy(&ledger, "1.a", 1), Buy::Unloaded);
        let start = now_ms();
        assert_eq!(ledger.apply(1, 0, 2, start, 10_000).new, 2);
        assert_eq!(
            buy(&ledger, "1.a", 1),
            Buy::Taken {
                left: 1,
                expired: 0
            }
        );
        assert_eq!(
            buy(&ledger, "1.b", 1),
            Buy::Taken {
                left: 0,
                expired: 0
            }
        );
        assert_eq!(
            buy(&ledger, "1.c", 1),
            Buy::Short {
                left: 0,
                expired: 0,
                reserved: 2
            }
        );
        // Not sold: back at once. Sold: consumed, and counted by a reconcile begun before.
        assert_eq!(settle(&ledger, "1.a", Outcome::Back).left, 1);
        assert!(settle(&ledger, "1.b", Outcome::Sold).removed);
        // The origin says 1 left, read before the sale was settled: the sale is not in it.
        assert_eq!(ledger.apply(1, 0, 2, start, 10_000).new, 1);
        // A buy left in doubt keeps its unit until its deadline, without giving it back.
        assert_eq!(
            buy(&ledger, "1.d", 1),
            Buy::Taken {
                left: 0,
                expired: 0
            }
        );
        assert!(!settle(&ledger, "1.d", Outcome::Doubt).removed);
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert_eq!(
            buy(&ledger, "1.e", 1),
            Buy::Short {
                left: 0,
                expired: 1,
                reserved: 0
            }
        );
        // The reconcile after it: the origin's number decides.
        assert_eq!(ledger.apply(1, 0, 1, now_ms(), 10_000).new, 1);
        assert_eq!(settle(&ledger, "1.x", Outcome::NoneLeft).left, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_claims_once_and_a_doubtful_one_is_reclaimed_by_its_own_body() {
        let ledger = MemoryLedger::new(Duration::from_secs(60), Duration::from_secs(60));
        ledger.apply(1, 0, 5, now_ms(), 10_000);
        let claim = |pending: &[u8], fingerprint| RecordClaim {
            key: 9,
            home: 0,
            pending: pending.to_vec(),
            claim_when_short: false,
            fingerprint,
            reclaim: true,
        };
        let request = |fingerprint| BuyRequest {
            units: 1,
            member: "1.a",
            ttl_ms: 1000,
            idle_ms: 60_000,
            record: Some(claim(b"P 00000000000000aa 0 1.a", fingerprint)),
        };
        assert!(matches!(
            ledger.buy(1, 0, &request(0xaa)),
            Buy::Taken { .. }
        ));
        assert_eq!(
            ledger.buy(1, 0, &request(0xaa)),
            Buy::Known(b"P 00000000000000aa 0 1.a".to_vec())
        );
        ledger.write_record(1, 9, Some((b"U 00000000000000aa 0 1.a", 1000)));
        assert_eq!(
            ledger.buy(1, 0, &request(0xbb)),
            Buy::Known(b"U 00000000000000aa 0 1.a".to_vec()),
            "another body is not the same buy"
        );
        assert_eq!(
            ledger.buy(1, 0, &request(0xaa)),
            Buy::Reclaimed(b"U 00000000000000aa 0 1.a".to_vec())
        );
        assert_eq!(
            ledger.read_record(1, 9).as_deref(),
            Some(&b"P 00000000000000aa 0 1.a"[..])
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(ledger.read_record(1, 9), None, "records end with their ttl");
    }
}
