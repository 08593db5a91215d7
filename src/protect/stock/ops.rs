//! What a stock ledger is asked, and what it answers: the same for the Redis ledger
//! (`shared.rs`) and the in-memory one (`memory.rs`).

/// What a buy asks of one segment.
#[derive(Debug)]
pub(crate) struct BuyRequest<'a> {
    pub(crate) units: u64,
    /// The reservation's member, `<units>.<id>`.
    pub(crate) member: &'a str,
    pub(crate) ttl_ms: u64,
    pub(crate) idle_ms: u64,
    /// The idempotency key's record to check and claim, when this segment is its home.
    pub(crate) record: Option<RecordClaim>,
}

/// An idempotency key's record as a buy checks and claims it.
#[derive(Debug)]
pub(crate) struct RecordClaim {
    /// Hash of the key.
    pub(crate) key: u128,
    /// The segment the record lives in.
    pub(crate) home: u16,
    /// The in-flight record to write when the key has none.
    pub(crate) pending: Vec<u8>,
    /// Write it even when this segment has too few units (other segments are tried next).
    pub(crate) claim_when_short: bool,
    /// xxh3-64 of the request body.
    pub(crate) fingerprint: u64,
    /// A record in doubt with this body is taken up again (`in_doubt_retry = "forward"`):
    /// [`Buy::Reclaimed`]. Otherwise it is [`Buy::Known`], like any other record.
    pub(crate) reclaim: bool,
}

/// What one segment answered a buy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Buy {
    /// The units are reserved; `left` remain; `expired` units of dead reservations were
    /// cleared (a reconcile should run).
    Taken { left: u64, expired: u64 },
    /// Too few: `left` remain, and `reserved` are held by buys in flight.
    Short {
        left: u64,
        expired: u64,
        reserved: u64,
    },
    /// The idempotency key has a record (raw bytes, see `record.rs`).
    Known(Vec<u8>),
    /// The key's buy was in doubt and the claim may take it up again: this request goes on
    /// with its reservation (the record, as it was, is in flight again).
    Reclaimed(Vec<u8>),
    /// The segment has never been loaded (or expired): load it from the origin.
    Unloaded,
}

/// What the origin's answer meant for a reservation's units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Sold: the reservation is consumed.
    Sold,
    /// Nothing sold: the units go back.
    Back,
    /// The origin has none left: the segment goes to 0.
    NoneLeft,
    /// Unknown: the reservation is left to expire.
    Doubt,
}

impl Outcome {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Sold => "sold",
            Outcome::Back => "back",
            Outcome::NoneLeft => "none",
            Outcome::Doubt => "doubt",
        }
    }
}

/// A settlement of one reservation.
#[derive(Clone, Debug)]
pub(crate) struct Settle {
    pub(crate) member: String,
    pub(crate) outcome: Outcome,
    pub(crate) units: u64,
    pub(crate) idle_ms: u64,
    pub(crate) consumed_kept_ms: u64,
    /// When the origin answered (a sale's time in the consumed set: a settlement retried
    /// later must not look like a sale the reconciles since then could have missed).
    pub(crate) answered: tokio::time::Instant,
    /// The idempotency key's new record.
    pub(crate) record: Option<RecordWrite>,
}

/// A record to write with a settlement.
#[derive(Clone, Debug)]
pub(crate) struct RecordWrite {
    pub(crate) key: u128,
    pub(crate) home: u16,
    pub(crate) value: Vec<u8>,
    pub(crate) ttl_ms: u64,
    /// Delete the record instead, if it names this reservation (its buy never got an
    /// answer to its client).
    pub(crate) forget: bool,
}

/// A sale of one reservation, settled in a batch with others of its segment: what
/// [`Settle`] with [`Outcome::Sold`] and no record says.
#[derive(Clone, Debug)]
pub(crate) struct Sale {
    /// `<units>.<id>`.
    pub(crate) member: String,
    pub(crate) units: u64,
    /// When the origin answered.
    pub(crate) answered: tokio::time::Instant,
}

impl Sale {
    /// The settlement of this sale on its own.
    pub(crate) fn settle(&self, idle_ms: u64, consumed_kept_ms: u64) -> Settle {
        Settle {
            member: self.member.clone(),
            outcome: Outcome::Sold,
            units: self.units,
            idle_ms,
            consumed_kept_ms,
            answered: self.answered,
            record: None,
        }
    }
}

/// What a batch of sales did to their segment: units left afterwards (-1: not loaded) and
/// units still reserved by buys in flight, as [`Settled`] says them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SalesSettled {
    pub(crate) left: i64,
    pub(crate) reserved: u64,
}

/// What a settlement did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Settled {
    /// The reservation was still live (and is gone now).
    pub(crate) removed: bool,
    /// Units left in the segment afterwards; -1 when it is not loaded.
    pub(crate) left: i64,
    /// Units still reserved by buys in flight.
    pub(crate) reserved: u64,
}

/// What a reconcile did to a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Applied {
    /// Units before (`None`: not loaded).
    pub(crate) old: Option<u64>,
    pub(crate) new: u64,
}
