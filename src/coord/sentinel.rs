//! Following a Sentinel-managed primary (`redis.mode = "sentinel"`).
//!
//! redis-rs can ask the sentinels for the primary but keeps no connection that follows a
//! failover, so this module owns that:
//!
//! - **resolve**: ask the sentinels in turn `SENTINEL GET-MASTER-ADDR-BY-NAME`, and trust a
//!   new answer only once that node's `ROLE` says `master` (a sentinel may lag behind);
//! - **follow**: one task subscribes to `+switch-master` on a sentinel (moving to the next
//!   one when it goes away) and re-resolves the moment a switch is announced; it also
//!   re-resolves every [`RECHECK`] in case an announcement was missed, and whenever a
//!   command hit a demoted primary (`READONLY`) or the primary stopped answering
//!   ([`Sentinel::poke`]);
//! - **tell**: a new primary bumps [`Sentinel::changes`]; the shared connection, the event
//!   bus and the stream consumer reconnect to it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use futures_util::StreamExt;
use redis::{ConnectionInfo, IntoConnectionInfo, RedisResult};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::addr::node_addr;
use crate::config::RedisConfig;

/// How often the primary is re-checked with the sentinels without any announcement.
pub(crate) const RECHECK: Duration = Duration::from_secs(1);

/// The primary in use.
#[derive(Debug)]
pub(crate) struct Primary {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) client: redis::Client,
}

pub(crate) struct Sentinel {
    sentinels: Vec<ConnectionInfo>,
    master_name: String,
    /// The data nodes' settings (credentials, TLS); the address is the primary's.
    /// Replaced when the credentials change ([`Sentinel::set_credentials`]).
    template: ArcSwap<ConnectionInfo>,
    timeout: Duration,
    primary: ArcSwapOption<Primary>,
    /// Bumped on every change of primary.
    changes: watch::Sender<u64>,
    poke: Notify,
    /// One resolution at a time.
    resolving: tokio::sync::Mutex<()>,
    /// The sentinel that answered last: asked first next time.
    last_good: AtomicUsize,
}

impl std::fmt::Debug for Sentinel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sentinel")
            .field("master_name", &self.master_name)
            .field("primary", &self.primary_addr())
            .finish_non_exhaustive()
    }
}

/// The settings of the data nodes: they speak TLS when the sentinels do; their
/// credentials are the configured ones (a sentinel's own password, if any, stays in its
/// URL). The address is a placeholder, replaced by the primary's.
fn data_template(
    sentinels: &[ConnectionInfo],
    config: &RedisConfig,
) -> RedisResult<ConnectionInfo> {
    let first = sentinels.first().ok_or_else(|| {
        redis::RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "sentinel mode needs at least one sentinel URL",
        ))
    })?;
    let scheme = if matches!(first.addr(), redis::ConnectionAddr::TcpTls { .. }) {
        "rediss"
    } else {
        "redis"
    };
    let template = super::addr::node_info(&format!("{scheme}://127.0.0.1:6379"), config)?;
    Ok(template.set_addr(node_addr(first.addr(), "127.0.0.1", 6379)))
}

impl Sentinel {
    /// # Errors
    /// A sentinel URL the client cannot use (validated at config load already).
    pub(crate) fn new(config: &RedisConfig) -> RedisResult<Self> {
        let sentinels = config
            .urls
            .iter()
            .map(|url| super::addr::with_tls(url.as_str().into_connection_info()?, config))
            .collect::<RedisResult<Vec<_>>>()?;
        let template = ArcSwap::from_pointee(data_template(&sentinels, config)?);
        Ok(Sentinel {
            sentinels,
            master_name: config.master_name.clone(),
            template,
            timeout: config.connect_timeout.max(config.command_timeout),
            primary: ArcSwapOption::empty(),
            changes: watch::Sender::new(0),
            poke: Notify::new(),
            resolving: tokio::sync::Mutex::new(()),
            last_good: AtomicUsize::new(0),
        })
    }

    pub(crate) fn master_name(&self) -> &str {
        &self.master_name
    }

    pub(crate) fn primary_client(&self) -> Option<redis::Client> {
        self.primary.load().as_ref().map(|p| p.client.clone())
    }

    /// `host:port` of the primary in use.
    pub(crate) fn primary_addr(&self) -> Option<String> {
        self.primary
            .load()
            .as_ref()
            .map(|p| format!("{}:{}", p.host, p.port))
    }

    /// Bumped each time the primary changes.
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Asks the follower to re-resolve now (a command failed in a way that may mean the
    /// primary moved).
    pub(crate) fn poke(&self) {
        self.poke.notify_one();
    }

    /// The data node at `host:port`, with the current credentials and TLS settings.
    fn node(&self, host: &str, port: u16) -> ConnectionInfo {
        let template = self.template.load();
        template
            .as_ref()
            .clone()
            .set_addr(node_addr(template.addr(), host, port))
    }

    /// Makes later connections to the data nodes log in with `config`'s credentials: the
    /// primary in use is kept (no failover is announced) with a client that has them.
    ///
    /// # Errors
    /// Settings the client cannot use (validated at config load already); nothing changed.
    pub(crate) async fn set_credentials(&self, config: &RedisConfig) -> RedisResult<()> {
        let fresh = data_template(&self.sentinels, config)?;
        // Not while a resolution installs a primary made with the old template.
        let _one = self.resolving.lock().await;
        if let Some(primary) = self.primary.load_full() {
            let client = redis::Client::open(fresh.clone().set_addr(node_addr(
                fresh.addr(),
                &primary.host,
                primary.port,
            )))?;
            self.primary.store(Some(Arc::new(Primary {
                host: primary.host.clone(),
                port: primary.port,
                client,
            })));
        }
        self.template.store(Arc::new(fresh));
        Ok(())
    }

    /// Resolves the primary now and installs it when it changed; the client of the
    /// primary in use afterwards.
    pub(crate) async fn resolve_now(&self) -> Option<redis::Client> {
        let _one = self.resolving.lock().await;
        let current = self.primary.load_full();
        if let Some((host, port)) = self.ask(current.as_deref()).await
            && current
                .as_ref()
                .is_none_or(|p| p.host != host || p.port != port)
        {
            let info = self.node(&host, port);
            match redis::Client::open(info) {
                Ok(client) => {
                    match &current {
                        Some(old) => warn!(
                            message = "Sentinel names a new Redis primary; following it.",
                            master_name = %self.master_name,
                            from = %format!("{}:{}", old.host, old.port),
                            to = %format!("{host}:{port}"),
                        ),
                        None => info!(
                            message = "Redis primary found through Sentinel.",
                            master_name = %self.master_name,
                            primary = %format!("{host}:{port}"),
                        ),
                    }
                    self.primary
                        .store(Some(Arc::new(Primary { host, port, client })));
                    self.changes.send_modify(|n| *n = n.wrapping_add(1));
                }
                Err(error) => warn!(message = "Cannot use the primary Sentinel names.", %error),
            }
        }
        self.primary_client()
    }

    /// The primary's address as the sentinels name it, checked with `ROLE` when it is not
    /// `current`. `None` when no sentinel answers or the named node is not a primary.
    async fn ask(&self, current: Option<&Primary>) -> Option<(String, u16)> {
        let n = self.sentinels.len();
        let start = self.last_good.load(Ordering::Relaxed) % n.max(1);
        for i in (0..n).map(|k| (start + k) % n) {
            let Some((host, port)) = self.ask_one(&self.sentinels[i]).await else {
                continue;
            };
            self.last_good.store(i, Ordering::Relaxed);
            if current.is_some_and(|p| p.host == host && p.port == port) {
                return Some((host, port));
            }
            if self.is_primary(&host, port).await {
                return Some((host, port));
            }
            // This sentinel still names a node that is not (or not yet) the primary:
            // another one may know better.
        }
        None
    }

    async fn ask_one(&self, sentinel: &ConnectionInfo) -> Option<(String, u16)> {
        let client = redis::Client::open(sentinel.clone()).ok()?;
        let asked = tokio::time::timeout(self.timeout, async {
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(&self.master_name)
                .query_async::<Option<(String, String)>>(&mut conn)
                .await
        })
        .await;
        match asked {
            Ok(Ok(Some((host, port)))) => Some((host, port.parse().ok()?)),
            _ => None,
        }
    }

    async fn is_primary(&self, host: &str, port: u16) -> bool {
        let Ok(client) = redis::Client::open(self.node(host, port)) else {
            return false;
        };
        let role = tokio::time::timeout(self.timeout, async {
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("ROLE")
                .query_async::<redis::Value>(&mut conn)
                .await
        })
        .await;
        match role {
            Ok(Ok(redis::Value::Array(parts))) => matches!(
                parts.first(),
                Some(redis::Value::BulkString(role)) if role == b"master"
            ),
            _ => false,
        }
    }

    /// Follows the primary until `stop`: re-resolves on `+switch-master`, on a poke, and
    /// every [`RECHECK`].
    pub(crate) async fn follow(self: Arc<Self>, stop: CancellationToken) {
        tokio::spawn(Arc::clone(&self).watch_switches(stop.clone()));
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.poke.notified() => {}
                () = tokio::time::sleep(RECHECK) => {}
            }
            self.resolve_now().await;
        }
    }

    /// Subscribes to `+switch-master` on one sentinel after another; every announcement
    /// for our primary pokes the follower.
    async fn watch_switches(self: Arc<Self>, stop: CancellationToken) {
        let mut next = 0usize;
        loop {
            let sentinel = &self.sentinels[next % self.sentinels.len()];
            next = next.wrapping_add(1);
            let subscribed = tokio::time::timeout(self.timeout, async {
                let client = redis::Client::open(sentinel.clone())?;
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe("+switch-master").await?;
                Ok::<_, redis::RedisError>(pubsub)
            })
            .await;
            if let Ok(Ok(pubsub)) = subscribed {
                let mut messages = pubsub.into_on_message();
                loop {
                    let message = tokio::select! {
                        () = stop.cancelled() => return,
                        m = messages.next() => m,
                    };
                    let Some(message) = message else { break };
                    // `<master name> <old ip> <old port> <new ip> <new port>`
                    let payload = String::from_utf8_lossy(message.get_payload_bytes()).into_owned();
                    if payload.split_ascii_whitespace().next() == Some(self.master_name.as_str()) {
                        info!(message = "Sentinel announced a failover.", switch = %payload);
                        self.poke();
                    }
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }
}
