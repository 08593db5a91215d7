//! The event bus: one pub/sub subscription per instance on `<prefix>events`.
//!
//! Messages are short text lines, `<type> <instance id> <key hash>`, so they can be read
//! with `redis-cli SUBSCRIBE` when debugging. Types: `fill` (an entry was stored:
//! waiters read L2), `released` (a lock was dropped without a fill: one waiter takes over),
//! `uncacheable` (the answer must not be shared: waiters fetch for themselves), `failed`
//! (the fetch failed: waiters answer with the copy of the failure left in Redis),
//! `invalidate` (a base key was invalidated: every instance drops its L1 copies; a write's
//! version floor follows as `<version> <ttl ms>`, which instances before floors ignore:
//! they read three fields), `hot` (a
//! key is hot on the sender: promote it here too), and
//! `bloom_add <instance> <filter> <id as hex>` (an id was created: every instance adds it to
//! its Bloom filter), and `stock <soldout|restock> <instance> <resource> <segment> <units>`
//! (a stock gate's segment has fewer units than a buy may take, or has units again: every
//! instance answers "sold out" from memory, or asks Redis again).
//!
//! Key events go to the [`Waiters`]; every other message goes to the [`BusListener`]s, which
//! also hear about gaps in the subscription so they can resync what the events carry.
//!
//! Requests waiting on another instance's fetch register per key in [`Waiters`] and are
//! woken by these events: no sleep-and-retry loop. The subscription reconnects by itself
//! with backoff; after any gap every waiter is woken to re-check L2 (a `fill` it missed
//! while disconnected must not leave it waiting until its timeout).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use prometheus::{IntCounter, IntGauge};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::RedisConn;
use super::backend::{PubSubNodes, client_addr};
use crate::config::RedisMode;

/// What happened to a key, as carried on the bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventKind {
    Fill,
    Released,
    Uncacheable,
    /// The fetch failed; a copy of the failure is in Redis for a moment: answer with it.
    Failed,
    /// The key was invalidated by a write: drop every L1 copy.
    Invalidate,
    /// The key is hot on the sender: promote it here too.
    Hot,
}

impl EventKind {
    fn as_str(self) -> &'static str {
        match self {
            EventKind::Fill => "fill",
            EventKind::Released => "released",
            EventKind::Uncacheable => "uncacheable",
            EventKind::Failed => "failed",
            EventKind::Invalidate => "invalidate",
            EventKind::Hot => "hot",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "fill" => Some(EventKind::Fill),
            "released" => Some(EventKind::Released),
            "uncacheable" => Some(EventKind::Uncacheable),
            "failed" => Some(EventKind::Failed),
            "invalidate" => Some(EventKind::Invalidate),
            "hot" => Some(EventKind::Hot),
            _ => None,
        }
    }
}

/// One message on the bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Event {
    pub(crate) kind: EventKind,
    pub(crate) instance: u64,
    pub(crate) hash: u128,
    /// `invalidate` of a write with a version: its floor (the version, and how long it
    /// holds in ms), so every instance knows it (see `cache/version.rs`).
    pub(crate) floor: Option<(u128, u64)>,
}

impl Event {
    pub(crate) fn encode(&self) -> String {
        let mut text = format!(
            "{} {:016x} {:032x}",
            self.kind.as_str(),
            self.instance,
            self.hash
        );
        if let Some((version, ttl_ms)) = self.floor {
            text.push_str(&format!(" {version} {ttl_ms}"));
        }
        text
    }

    /// `None` for anything malformed or of a type this version does not know. A floor that
    /// does not parse is dropped (the invalidation itself stands).
    pub(crate) fn decode(text: &str) -> Option<Event> {
        let mut parts = text.split_ascii_whitespace();
        let kind = EventKind::parse(parts.next()?)?;
        let instance = u64::from_str_radix(parts.next()?, 16).ok()?;
        let hash = u128::from_str_radix(parts.next()?, 16).ok()?;
        let floor = match (kind, parts.next(), parts.next()) {
            (EventKind::Invalidate, Some(version), Some(ttl_ms)) => {
                version.parse().ok().zip(ttl_ms.parse().ok())
            }
            _ => None,
        };
        Some(Event {
            kind,
            instance,
            hash,
            floor,
        })
    }
}

/// A `bloom_add` message: `id` was created, and belongs in `filter`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BloomAddEvent {
    pub(crate) instance: u64,
    pub(crate) filter: String,
    pub(crate) id: Vec<u8>,
}

const BLOOM_ADD: &str = "bloom_add";

impl BloomAddEvent {
    /// Ids are hex-encoded, so any bytes (spaces included) fit in one text line.
    pub(crate) fn encode(&self) -> String {
        let mut text = format!("{BLOOM_ADD} {:016x} {} ", self.instance, self.filter);
        for byte in &self.id {
            text.push_str(&format!("{byte:02x}"));
        }
        text
    }

    pub(crate) fn decode(text: &str) -> Option<Self> {
        let mut parts = text.split_ascii_whitespace();
        if parts.next()? != BLOOM_ADD {
            return None;
        }
        let instance = u64::from_str_radix(parts.next()?, 16).ok()?;
        let filter = parts.next()?.to_owned();
        let hex = parts.next()?;
        if hex.is_empty() || hex.len() % 2 != 0 || parts.next().is_some() {
            return None;
        }
        let id = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
            .collect::<Option<Vec<u8>>>()?;
        Some(BloomAddEvent {
            instance,
            filter,
            id,
        })
    }
}

/// What a `stock` message says of one segment of a stock resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StockLevel {
    /// `units` are left, fewer than some buy asks for (0: none at all).
    SoldOut,
    /// A reconcile (or units given back) raised it to `units`.
    Restock,
}

/// A `stock` message: a segment of a stock resource sold out or came back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StockEvent {
    pub(crate) level: StockLevel,
    pub(crate) instance: u64,
    pub(crate) resource: u128,
    pub(crate) segment: u16,
    pub(crate) units: u64,
}

const STOCK: &str = "stock";

impl StockEvent {
    pub(crate) fn encode(&self) -> String {
        let level = match self.level {
            StockLevel::SoldOut => "soldout",
            StockLevel::Restock => "restock",
        };
        format!(
            "{STOCK} {level} {:016x} {:032x} {} {}",
            self.instance, self.resource, self.segment, self.units
        )
    }

    pub(crate) fn decode(text: &str) -> Option<Self> {
        let mut parts = text.split_ascii_whitespace();
        if parts.next()? != STOCK {
            return None;
        }
        let level = match parts.next()? {
            "soldout" => StockLevel::SoldOut,
            "restock" => StockLevel::Restock,
            _ => return None,
        };
        let event = StockEvent {
            level,
            instance: u64::from_str_radix(parts.next()?, 16).ok()?,
            resource: u128::from_str_radix(parts.next()?, 16).ok()?,
            segment: parts.next()?.parse().ok()?,
            units: parts.next()?.parse().ok()?,
        };
        parts.next().is_none().then_some(event)
    }
}

/// Someone other than the lock waiters that needs the bus: told of every non-key message
/// and of every gap, so state carried by events (Bloom adds, later the hot set) can be
/// resynced instead of silently missed.
pub(crate) trait BusListener: Send + Sync + std::fmt::Debug {
    fn on_bloom_add(&self, _event: BloomAddEvent) {}
    /// A stock gate's segment sold out or came back (on another instance or this one).
    fn on_stock(&self, _event: StockEvent) {}
    /// A key event other than the lock's (`invalidate`, `hot`), from another instance.
    fn on_key_event(&self, _event: Event) {}
    /// The subscription was lost at `unix_ms`: events from then on may be missed.
    fn on_gap(&self, _unix_ms: u64) {}
    /// The subscription is live (again): resync whatever was missed since the gap.
    /// `delivery` says whether a message is heard before its publisher's answer.
    fn on_subscribed(self: Arc<Self>, _delivery: Delivery) {}
}

/// How soon a subscription hears a message, next to its publisher's `PUBLISH` answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// On the node where every `PUBLISH` of the channel is run (standalone, the Sentinel
    /// primary, the cluster primary of the channel's slot): Redis writes the message to
    /// its subscribers before it answers the publisher, so an instance has heard a write's
    /// `invalidate` before that write's answer leaves the writer.
    Prompt,
    /// On another cluster node, which has the message over the cluster bus after the
    /// publisher's answer: a read may begin after a write returned and before its
    /// `invalidate` arrives here.
    Late,
}

/// What a waiter is woken with: the latest event for its key, or `None` for "re-check,
/// events may have been missed" (after a reconnect).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Signal {
    seq: u64,
    pub(crate) kind: Option<EventKind>,
}

/// Requests waiting for an event on a key, registered per key hash.
#[derive(Debug)]
pub(crate) struct Waiters {
    // A std mutex: held only to find, insert or remove a map entry, never across an await.
    by_key: Mutex<HashMap<u128, watch::Sender<Signal>>>,
    /// Registered handles (the gauge shows the same number; this one is read to cap it).
    handles: AtomicUsize,
    gauge: IntGauge,
}

/// One registered waiter. Register *before* checking L2, so an event that lands between
/// the check and the wait is not missed: the receiver sees every change after it was made.
#[derive(Debug)]
pub(crate) struct WaitHandle {
    waiters: Arc<Waiters>,
    hash: u128,
    rx: Option<watch::Receiver<Signal>>,
}

impl Waiters {
    pub(crate) fn new(gauge: IntGauge) -> Arc<Self> {
        Arc::new(Waiters {
            by_key: Mutex::new(HashMap::new()),
            handles: AtomicUsize::new(0),
            gauge,
        })
    }

    #[cfg(test)]
    pub(crate) fn register(self: &Arc<Self>, hash: u128) -> WaitHandle {
        let mut map = self.by_key.lock().unwrap_or_else(PoisonError::into_inner);
        self.insert(&mut map, hash)
    }

    /// Registers a waiter on `hash` unless `max` are registered already.
    pub(crate) fn try_register(self: &Arc<Self>, hash: u128, max: usize) -> Option<WaitHandle> {
        let mut map = self.by_key.lock().unwrap_or_else(PoisonError::into_inner);
        // Under the map's lock: registrations do not race past the cap.
        (self.handles.load(Ordering::Relaxed) < max).then(|| self.insert(&mut map, hash))
    }

    fn insert(
        self: &Arc<Self>,
        map: &mut HashMap<u128, watch::Sender<Signal>>,
        hash: u128,
    ) -> WaitHandle {
        self.handles.fetch_add(1, Ordering::Relaxed);
        self.gauge.inc();
        let rx = map
            .entry(hash)
            .or_insert_with(|| watch::Sender::new(Signal::default()))
            .subscribe();
        WaitHandle {
            waiters: Arc::clone(self),
            hash,
            rx: Some(rx),
        }
    }

    /// Wakes the waiters of `hash` with `kind`.
    pub(crate) fn notify(&self, hash: u128, kind: EventKind) {
        let map = self.by_key.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tx) = map.get(&hash) {
            tx.send_modify(|s| {
                s.seq = s.seq.wrapping_add(1);
                s.kind = Some(kind);
            });
        }
    }

    /// Wakes every waiter to re-check (events may have been missed).
    pub(crate) fn wake_all(&self) {
        let map = self.by_key.lock().unwrap_or_else(PoisonError::into_inner);
        for tx in map.values() {
            tx.send_modify(|s| {
                s.seq = s.seq.wrapping_add(1);
                s.kind = None;
            });
        }
    }

    #[cfg(test)]
    fn keys(&self) -> usize {
        self.by_key
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl WaitHandle {
    /// Waits for the next signal on this key.
    ///
    /// # Cancel safety
    /// Cancel-safe: a signal that arrives while not waiting is seen by the next call.
    pub(crate) async fn changed(&mut self) -> Signal {
        let Some(rx) = self.rx.as_mut() else {
            return Signal::default();
        };
        match rx.changed().await {
            Ok(()) => *rx.borrow_and_update(),
            // The sender lives in the map as long as any handle exists, so this is
            // unreachable; answer "re-check" rather than hang.
            Err(_) => Signal::default(),
        }
    }
}

impl Drop for WaitHandle {
    fn drop(&mut self) {
        self.waiters.gauge.dec();
        self.waiters.handles.fetch_sub(1, Ordering::Relaxed);
        // Drop our receiver first, then remove the key's sender if nobody else waits on it.
        drop(self.rx.take());
        let mut map = self
            .waiters
            .by_key
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if map
            .get(&self.hash)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            map.remove(&self.hash);
        }
    }
}

/// The subscription side of the bus; publishing happens inside the Lua scripts.
#[derive(Debug)]
pub(crate) struct EventBus {
    pub(crate) channel: String,
    pub(crate) instance: u64,
    pub(crate) waiters: Arc<Waiters>,
    connected: AtomicBool,
    listeners: Vec<Arc<dyn BusListener>>,
}

/// Counters the subscription loop reports to.
#[derive(Clone, Debug)]
pub(crate) struct BusMetrics {
    pub(crate) subscribed: IntGauge,
    pub(crate) resubscriptions: IntCounter,
    pub(crate) events: IntCounter,
}

/// How often a subscription that keeps failing is logged again.
const FAILING_LOG_EVERY: Duration = Duration::from_secs(60);

/// Failed subscription attempts in a row, for a log that says when it starts failing, then
/// once a minute how many attempts failed, and when it works again — not one line per
/// attempt (two a second while Redis is down).
#[derive(Debug, Default)]
struct Failing {
    /// Since when, the attempts so far, and when the last line was written.
    run: Option<(tokio::time::Instant, u64, tokio::time::Instant)>,
}

impl Failing {
    /// One more failed attempt; returns whether it was logged.
    fn failed(&mut self, error: &impl std::fmt::Display) -> bool {
        let now = tokio::time::Instant::now();
        match &mut self.run {
            None => {
                self.run = Some((now, 1, now));
                warn!(
                    message = "Event bus cannot subscribe; retrying (logged again once a minute while it fails).",
                    error = %error,
                );
                true
            }
            Some((since, attempts, logged)) => {
                *attempts += 1;
                if now.duration_since(*logged) < FAILING_LOG_EVERY {
                    return false;
                }
                *logged = now;
                warn!(
                    message = "Event bus still cannot subscribe.",
                    error = %error,
                    attempts = *attempts,
                    failing_for_s = now.duration_since(*since).as_secs(),
                );
                true
            }
        }
    }

    fn ended(&mut self) {
        if let Some((since, attempts, _)) = self.run.take() {
            info!(
                message = "Event bus can subscribe again.",
                failed_attempts = attempts,
                failed_for_ms = u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX),
            );
        }
    }
}

const BACKOFF_MIN: Duration = Duration::from_millis(25);
const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// How often a cluster subscription checks that it is on the channel's primary.
const REHOME_EVERY: Duration = Duration::from_secs(2);

/// How soon a cluster subscription that hears messages late (not on the channel's
/// primary) first looks for the primary again: until it is there, reads that need the bus
/// confirmed go to Redis. Doubled after each look that ends late again, up to
/// [`REHOME_EVERY`].
const REHOME_LATE_EVERY: Duration = Duration::from_millis(100);
/// A subscription idle for this long is pinged, so a half-open connection is noticed.
const IDLE_PING: Duration = Duration::from_secs(1);

impl EventBus {
    pub(crate) fn new(
        channel: String,
        instance: u64,
        waiters: Arc<Waiters>,
        listeners: Vec<Arc<dyn BusListener>>,
    ) -> Arc<Self> {
        Arc::new(EventBus {
            channel,
            instance,
            waiters,
            connected: AtomicBool::new(false),
            listeners,
        })
    }

    /// Whether the subscription is live right now.
    pub(crate) fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Runs the subscription until `stop`, reconnecting with backoff. Each (re)connection
    /// tries the nodes [`Backend::pubsub_clients`] names in turn: on a cluster any node
    /// hears every `PUBLISH`, so losing one node moves the subscription to another; with
    /// Sentinel it follows the primary (a new primary ends the current subscription).
    pub(crate) async fn run(
        self: Arc<Self>,
        redis: RedisConn,
        connect_timeout: Duration,
        metrics: BusMetrics,
        stop: CancellationToken,
    ) {
        let mut backoff = BACKOFF_MIN;
        let mut failing = Failing::default();
        let mut first = true;
        // How soon a late subscription looks for the channel's primary: doubling while
        // each look ends on a late node again (a primary that refuses the subscription),
        // up to REHOME_EVERY; back to the shortest once a subscription is prompt.
        let mut late_every = REHOME_LATE_EVERY;
        let mut primary_changes = redis.backend().sentinel().map(|s| s.changes());
        loop {
            let subscribed = tokio::select! {
                () = stop.cancelled() => return,
                s = self.subscribe_any(&redis, connect_timeout) => s,
            };
            match subscribed {
                Ok((pubsub, node, delivery)) => {
                    backoff = BACKOFF_MIN;
                    failing.ended();
                    self.connected.store(true, Ordering::Relaxed);
                    metrics.subscribed.set(1);
                    if !first {
                        metrics.resubscriptions.inc();
                        info!(message = "Event bus re-subscribed.", channel = %self.channel, node = %node);
                    }
                    if delivery == Delivery::Late {
                        info!(
                            message = "Event bus on a node that hears messages after their publishers' answers; moving to the channel's primary when it takes the subscription.",
                            channel = %self.channel,
                            node = %node
                        );
                    }
                    first = false;
                    // Anything published while we were away is lost: wake every waiter
                    // to re-check L2, and let the listeners resync.
                    self.waiters.wake_all();
                    for listener in &self.listeners {
                        Arc::clone(listener).on_subscribed(delivery);
                    }
                    if let Some(changes) = primary_changes.as_mut() {
                        changes.mark_unchanged();
                    }
                    // On a cluster, come back to the channel's primary when it is not the
                    // node we are on (after a failover moved the slot).
                    let every = match delivery {
                        Delivery::Prompt => {
                            late_every = REHOME_LATE_EVERY;
                            REHOME_EVERY
                        }
                        Delivery::Late => {
                            let every = late_every;
                            late_every = (late_every * 2).min(REHOME_EVERY);
                            every
                        }
                    };
                    let home = (redis.mode() == RedisMode::Cluster).then_some(Home {
                        redis: &redis,
                        node: node.as_str(),
                        delivery,
                        every,
                        timeout: connect_timeout,
                    });
                    let ended = self
                        .consume(pubsub, &metrics, &stop, primary_changes.as_mut(), home)
                        .await;
                    self.connected.store(false, Ordering::Relaxed);
                    metrics.subscribed.set(0);
                    let lost_at = crate::clock::now_ms();
                    for listener in &self.listeners {
                        listener.on_gap(lost_at);
                    }
                    // Waiters must not sit out a lease on a bus that cannot wake them:
                    // let them re-check (and degrade) now.
                    self.waiters.wake_all();
                    match ended {
                        Ended::Stopped => return,
                        Ended::Rehome => {
                            info!(message = "Event bus moves to the channel's primary.", channel = %self.channel, from = %node);
                            continue;
                        }
                        Ended::Lost => {
                            warn!(message = "Event bus subscription lost; reconnecting.", channel = %self.channel);
                        }
                    }
                }
                Err(error) => {
                    failing.failed(&error);
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// Subscribes on the first node that takes it, each bounded by `connect_timeout`:
    /// the subscription, the node's `host:port`, and how soon it hears messages there.
    async fn subscribe_any(
        &self,
        redis: &RedisConn,
        connect_timeout: Duration,
    ) -> Result<(redis::aio::PubSub, String, Delivery), String> {
        let PubSubNodes { clients, prompt } = redis
            .backend()
            .pubsub_clients(redis.shared(), connect_timeout, &self.channel)
            .await;
        if clients.is_empty() {
            return Err("no node to subscribe on (no primary known yet)".to_owned());
        }
        let mut last = String::new();
        for client in clients {
            let attempt = tokio::time::timeout(connect_timeout, async {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(&self.channel).await?;
                Ok::<_, redis::RedisError>(pubsub)
            })
            .await;
            match attempt {
                Ok(Ok(pubsub)) => {
                    let node = client_addr(&client);
                    let delivery = if prompt.as_deref() == Some(node.as_str()) {
                        Delivery::Prompt
                    } else {
                        Delivery::Late
                    };
                    return Ok((pubsub, node, delivery));
                }
                Ok(Err(error)) => last = error.to_string(),
                Err(_) => last = format!("timed out after {connect_timeout:?}"),
            }
        }
        Err(last)
    }

    async fn consume(
        &self,
        pubsub: redis::aio::PubSub,
        metrics: &BusMetrics,
        stop: &CancellationToken,
        mut primary_changes: Option<&mut watch::Receiver<u64>>,
        home: Option<Home<'_>>,
    ) -> Ended {
        let (mut sink, mut stream) = pubsub.split();
        let rehome_every = home.as_ref().map_or(REHOME_EVERY, |h| h.every);
        let mut rehome_at = tokio::time::Instant::now() + rehome_every;
        loop {
            if let Some(home) = &home
                && tokio::time::Instant::now() >= rehome_at
            {
                rehome_at = tokio::time::Instant::now() + rehome_every;
                let prompt = home
                    .redis
                    .backend()
                    .pubsub_clients(home.redis.shared(), home.timeout, &self.channel)
                    .await
                    .prompt;
                // Another node is the channel's primary now (a failover moved the slot),
                // or this one is and was not known to be when subscribing: subscribe
                // again, there, to hear messages before their publishers' answers.
                if prompt.is_some_and(|p| p != home.node || home.delivery == Delivery::Late) {
                    return Ended::Rehome;
                }
            }
            let primary_changed = async {
                match primary_changes.as_mut() {
                    Some(changes) => changes.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            let next = tokio::select! {
                () = stop.cancelled() => return Ended::Stopped,
                true = primary_changed => return Ended::Lost,
                next = tokio::time::timeout(IDLE_PING, stream.next()) => next,
            };
            match next {
                Ok(Some(message)) => {
                    metrics.events.inc();
                    let Ok(text) = std::str::from_utf8(message.get_payload_bytes()) else {
                        continue;
                    };
                    if let Some(event) = Event::decode(text) {
                        match event.kind {
                            EventKind::Fill
                            | EventKind::Released
                            | EventKind::Uncacheable
                            | EventKind::Failed => {
                                self.waiters.notify(event.hash, event.kind);
                            }
                            EventKind::Invalidate | EventKind::Hot => {
                                if event.instance != self.instance {
                                    for listener in &self.listeners {
                                        listener.on_key_event(event);
                                    }
                                }
                            }
                        }
                    } else if let Some(add) = BloomAddEvent::decode(text)
                        && add.instance != self.instance
                    {
                        for listener in &self.listeners {
                            listener.on_bloom_add(add.clone());
                        }
                    } else if let Some(stock) = StockEvent::decode(text) {
                        for listener in &self.listeners {
                            listener.on_stock(stock);
                        }
                    }
                }
                Ok(None) => return Ended::Lost,
                Err(_) => {
                    // Idle: make sure the connection is still there. Inside a subscription
                    // Redis answers PING with an array (`pong`, ""), so any answer counts.
                    let ping = tokio::time::timeout(IDLE_PING, sink.ping::<redis::Value>()).await;
                    if !matches!(ping, Ok(Ok(_))) {
                        return Ended::Lost;
                    }
                }
            }
        }
    }
}

/// A cluster subscription's node, checked against the channel's primary now and then
/// ([`EventBus::consume`]).
struct Home<'a> {
    redis: &'a RedisConn,
    node: &'a str,
    delivery: Delivery,
    /// How often to look for the channel's primary.
    every: Duration,
    timeout: Duration,
}

#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// A better node to subscribe on (the channel's primary) is there.
    Rehome,
    Stopped,
    Lost,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_and_garbage_is_ignored() {
        let e = Event {
            kind: EventKind::Fill,
            instance: 0xabc,
            hash: u128::MAX - 5,
            floor: None,
        };
        assert_eq!(Event::decode(&e.encode()), Some(e));
        let floored = Event {
            kind: EventKind::Invalidate,
            floor: Some((u128::MAX, 10_000)),
            ..e
        };
        assert_eq!(Event::decode(&floored.encode()), Some(floored));
        // What an instance from before floors reads of it: the invalidation.
        let text = floored.encode();
        let old: Vec<&str> = text.split_ascii_whitespace().take(3).collect();
        assert_eq!(
            Event::decode(&old.join(" ")),
            Some(Event {
                floor: None,
                ..floored
            })
        );
        let garbled = format!("{} 12x 5", old.join(" "));
        assert_eq!(
            Event::decode(&garbled).map(|e| (e.kind, e.floor)),
            Some((EventKind::Invalidate, None)),
            "a floor that does not parse is dropped, the invalidation stands"
        );
        assert_eq!(Event::decode(""), None);
        assert_eq!(Event::decode("fill zz 12"), None);
        assert_eq!(Event::decode("bogus 1 2"), None);
    }

    #[test]
    fn bloom_adds_round_trip_any_bytes() {
        let add = BloomAddEvent {
            instance: 7,
            filter: "items".to_owned(),
            id: b"a b\n\xff".to_vec(),
        };
        let text = add.encode();
        assert_eq!(BloomAddEvent::decode(&text), Some(add));
        let stock = StockEvent {
            level: StockLevel::SoldOut,
            instance: 7,
            resource: 0xabc,
            segment: 3,
            units: 0,
        };
        assert_eq!(StockEvent::decode(&stock.encode()), Some(stock));
        assert_eq!(StockEvent::decode("stock soldout 7 abc 3"), None);
        assert_eq!(Event::decode(&stock.encode()), None);
        assert_eq!(Event::decode(&text), None);
        assert_eq!(BloomAddEvent::decode("bloom_add 7 items 0"), None);
        assert_eq!(BloomAddEvent::decode("bloom_add 7 items zz"), None);
        assert_eq!(BloomAddEvent::decode("bloom_add 7 items"), None);
        assert_eq!(BloomAddEvent::decode("fill 7 items 00"), None);
    }

    #[tokio::test]
    async fn waiters_are_woken_per_key_and_cleaned_up() {
        let gauge = IntGauge::new("t_waiters", "t").unwrap();
        let waiters = Waiters::new(gauge.clone());
        let mut a = waiters.register(1);
        let mut b = waiters.register(1);
        let _c = waiters.register(2);
        assert_eq!(gauge.get(), 3);
        // Notified before anyone awaits: not lost.
        waiters.notify(1, EventKind::Fill);
        assert_eq!(a.changed().await.kind, Some(EventKind::Fill));
        assert_eq!(b.changed().await.kind, Some(EventKind::Fill));
        waiters.wake_all();
        assert_eq!(a.changed().await.kind, None);
        drop(a);
        drop(b);
        assert_eq!(waiters.keys(), 1);
        assert_eq!(gauge.get(), 1);
    }

    /// Two attempts a second for three minutes: logged at the start and once a minute.
    #[tokio::test(start_paused = true)]
    async fn a_failing_subscription_is_logged_once_a_minute() {
        let mut failing = Failing::default();
        let mut logged = 0;
        for _ in 0..360 {
            if failing.failed(&"refused") {
                logged += 1;
            }
            tokio::time::advance(Duration::from_millis(500)).await;
        }
        assert_eq!(logged, 3, "at 0 s, 60 s and 120 s");
        failing.ended();
        assert!(
            failing.failed(&"refused"),
            "a new run of failures is logged at once"
        );
    }
}
