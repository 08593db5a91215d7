//! Where a gate's units are counted: Redis in shared mode (`shared.rs`), process memory in
//! embedded mode (`memory.rs`). Both keep the same per-segment state and answer the same
//! five operations; the gate (`super`) decides what to do with the answers.

use super::memory::MemoryLedger;
use super::ops::{Applied, Buy, BuyRequest, Sale, SalesSettled, Settle, Settled};
use super::shared::RedisLedger;
use crate::coord::redis::Unavailable;

/// Where one gate counts.
#[derive(Debug)]
pub(crate) enum Ledger {
    Redis(RedisLedger),
    Memory(MemoryLedger),
}

impl Ledger {
    /// Whether a command would be sent now: false while the Redis breaker is open (a
    /// command then fails at once, unsent). Memory is always up.
    pub(crate) fn up(&self) -> bool {
        match self {
            Ledger::Redis(redis) => redis.up(),
            Ledger::Memory(_) => true,
        }
    }

    pub(crate) async fn buy(
        &self,
        resource: u128,
        segment: u16,
        request: &BuyRequest<'_>,
    ) -> Result<Buy, Unavailable> {
        match self {
            Ledger::Redis(redis) => redis.buy(resource, segment, request).await,
            Ledger::Memory(memory) => Ok(memory.buy(resource, segment, request)),
        }
    }

    pub(crate) async fn settle(
        &self,
        resource: u128,
        segment: u16,
        settle: &Settle,
    ) -> Result<Settled, Unavailable> {
        match self {
            Ledger::Redis(redis) => redis.settle(resource, segment, settle).await,
            Ledger::Memory(memory) => Ok(memory.settle(resource, segment, settle)),
        }
    }

    /// Settles sales of one segment together: in Redis one script call for all of them.
    pub(crate) async fn settle_sales(
        &self,
        resource: u128,
        segment: u16,
        sales: &[Sale],
        idle_ms: u64,
        consumed_kept_ms: u64,
    ) -> Result<SalesSettled, Unavailable> {
        match self {
            Ledger::Redis(redis) => {
                redis
                    .settle_sales(resource, segment, sales, idle_ms, consumed_kept_ms)
                    .await
            }
            Ledger::Memory(memory) => {
                let mut last = SalesSettled {
                    left: -1,
                    reserved: 0,
                };
                for sale in sales {
                    let settled =
                        memory.settle(resource, segment, &sale.settle(idle_ms, consumed_kept_ms));
                    last = SalesSettled {
                        left: settled.left,
                        reserved: settled.reserved,
                    };
                }
                Ok(last)
            }
        }
    }

    pub(crate) async fn write_record(
        &self,
        resource: u128,
        home: u16,
        key: u128,
        record: Option<(&[u8], u64)>,
    ) -> Result<(), Unavailable> {
        match self {
            Ledger::Redis(redis) => redis.write_record(resource, home, key, record).await,
            Ledger::Memory(memory) => {
                memory.write_record(resource, key, record);
                Ok(())
            }
        }
    }

    pub(crate) async fn read_record(
        &self,
        resource: u128,
        home: u16,
        key: u128,
    ) -> Result<Option<Vec<u8>>, Unavailable> {
        match self {
            Ledger::Redis(redis) => redis.read_record(resource, home, key).await,
            Ledger::Memory(memory) => Ok(memory.read_record(resource, key)),
        }
    }

    /// The ledger's clock (ms since the Unix epoch) where `segment` of `resource` lives:
    /// the Redis node's in shared mode.
    pub(crate) async fn clock(&self, resource: u128, segment: u16) -> Result<u64, Unavailable> {
        match self {
            Ledger::Redis(redis) => redis.clock(resource, segment).await,
            Ledger::Memory(_) => Ok(crate::clock::now_ms()),
        }
    }

    pub(crate) async fn apply(
        &self,
        resource: u128,
        segment: u16,
        budget: u64,
        since_ms: u64,
        idle_ms: u64,
        consumed_kept_ms: u64,
    ) -> Result<Applied, Unavailable> {
        match self {
            Ledger::Redis(redis) => {
                redis
                    .apply(
                        resource,
                        segment,
                        budget,
                        since_ms,
                        idle_ms,
                        consumed_kept_ms,
                    )
                    .await
            }
            Ledger::Memory(memory) => {
                Ok(memory.apply(resource, segment, budget, since_ms, consumed_kept_ms))
            }
        }
    }

    /// Whether this instance reconciles `resource` now; alone in embedded mode, always.
    pub(crate) async fn take_turn(
        &self,
        resource: u128,
        instance: u64,
        ttl_ms: u64,
    ) -> Result<bool, Unavailable> {
        match self {
            Ledger::Redis(redis) => redis.take_turn(resource, instance, ttl_ms).await,
            Ledger::Memory(_) => Ok(true),
        }
    }
}
