//! Sales settled in batches. A buy the origin answered as sold, without an idempotency
//! key, leaves nothing for its client to wait on: its units were taken by BUY, and what is
//! left to do is to move its reservation to the consumed set. So its answer goes back at
//! once, and the settlement joins the gate's queue of sales. One task per gate takes what
//! arrived within [`LINGER`] of the first (at most [`MAX_BATCH`]) and settles each
//! segment's share with one call (`SETTLE_SALES` in Redis): its cost per sale falls as the
//! rate rises, and at a low rate a sale's settlement is only [`LINGER`] later.
//!
//! What it keeps of the settlement's promises:
//! - **Nothing is dropped.** A full queue settles the sale on the buyer's path, as before;
//!   a batch Redis did not take is settled sale by sale, each retried until its
//!   reservation ends (`Gate::settle_until`), after which the reconcile counts it.
//! - **Counts as before.** The batch does per sale what SETTLE does for `sold`: a live
//!   reservation leaves the reserved units; every sale enters the consumed set as of when
//!   the origin answered, so a reconcile in between subtracts it. A sale still queued looks
//!   to a reconcile like a buy in flight (its reservation is live), which is what it is
//!   until settled.
//! - **The last buy in flight** of a sold-out segment settled asks for a reconcile, as a
//!   settlement one by one does, once per batch.
//! - A process that stops with sales queued leaves their reservations to expire: their
//!   units stay taken (they were sold), and the origin's count is the next reconcile's.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::ops::Sale;
use super::{CONSUMED_KEPT, Gate, Reservation, Resource, idle, millis};

/// How long a batch waits for more sales after its first.
pub(super) const LINGER: Duration = Duration::from_millis(2);

/// The most sales settled in one batch.
pub(super) const MAX_BATCH: usize = 256;

/// Sales queued beyond this settle on the buyer's path.
const QUEUE: usize = 16_384;

/// A sale waiting for its batch.
#[derive(Debug)]
pub(super) struct Queued {
    resource: Arc<Resource>,
    segment: u16,
    sale: Sale,
    /// When the reservation ends unless settled.
    deadline: Instant,
}

impl Gate {
    /// Settles the sale of `reservation` in the next batch, or now when the queue is full.
    pub(super) async fn queue_sale(self: &Arc<Self>, reservation: Reservation) {
        let sales = self.sales.get_or_init(|| {
            let (sender, receiver) = mpsc::channel(QUEUE);
            tokio::spawn(run(Arc::downgrade(self), receiver));
            sender
        });
        let queued = Queued {
            sale: Sale {
                member: reservation.member,
                units: reservation.units,
                answered: Instant::now(),
            },
            resource: reservation.resource,
            segment: reservation.segment,
            deadline: reservation.deadline,
        };
        match sales.try_send(queued) {
            Ok(()) => self.metrics.sales_queued.inc(),
            Err(full) => self.settle_sale(full.into_inner()).await,
        }
    }

    /// Settles `batch`, one ledger call per segment, the segments at once.
    async fn settle_batch(self: &Arc<Self>, batch: Vec<Queued>) {
        let mut segments: HashMap<(u128, u16), Vec<Queued>> = HashMap::new();
        for queued in batch {
            segments
                .entry((queued.resource.id, queued.segment))
                .or_default()
                .push(queued);
        }
        let settings = self.settings.load_full();
        let config = &settings.config;
        let (idle_ms, kept_ms) = (
            millis(idle(config)),
            millis(CONSUMED_KEPT.max(config.reconcile * 4)),
        );
        futures_util::future::join_all(segments.into_values().map(|queued| async move {
            let sales: Vec<Sale> = queued.iter().map(|q| q.sale.clone()).collect();
            self.metrics.sale_batches.inc();
            let (resource, segment) = (&queued[0].resource, queued[0].segment);
            match self
                .ledger
                .settle_sales(resource.id, segment, &sales, idle_ms, kept_ms)
                .await
            {
                Ok(settled) => {
                    self.metrics
                        .sales_queued
                        .sub(i64::try_from(sales.len()).unwrap_or(0));
                    if settled.left == 0 && settled.reserved == 0 {
                        self.reconcile_soon(resource);
                    }
                }
                Err(_) => {
                    self.metrics.redis_errors.inc();
                    for queued in queued {
                        let gate = Arc::clone(self);
                        tokio::spawn(async move {
                            gate.settle_sale(queued).await;
                            gate.metrics.sales_queued.dec();
                        });
                    }
                }
            }
        }))
        .await;
    }

    /// Settles one queued sale on its own, retried until its reservation ends.
    async fn settle_sale(self: &Arc<Self>, queued: Queued) {
        let settings = self.settings.load_full();
        let config = &settings.config;
        let settle = queued.sale.settle(
            millis(idle(config)),
            millis(CONSUMED_KEPT.max(config.reconcile * 4)),
        );
        self.settle_until(&queued.resource, queued.segment, settle, queued.deadline)
            .await;
    }
}

/// The gate's batching task: ends with the gate.
async fn run(gate: Weak<Gate>, mut receiver: mpsc::Receiver<Queued>) {
    while let Some(first) = receiver.recv().await {
        let mut batch = vec![first];
        let until = Instant::now() + LINGER;
        while batch.len() < MAX_BATCH {
            match tokio::time::timeout_at(until, receiver.recv()).await {
                Ok(Some(queued)) => batch.push(queued),
                Ok(None) | Err(_) => break,
            }
        }
        let Some(gate) = gate.upgrade() else {
            return;
        };
        gate.settle_batch(batch).await;
    }
}
