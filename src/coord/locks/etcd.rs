//! The etcd lock of serialized writes (see `locks.rs`).
//!
//! A resource's lock is one key, `<prefix><resource path>`, bound to a lease of the grant's
//! own. Acquiring is two requests: `LeaseGrant` (the route's lease, rounded up to whole
//! seconds: etcd's unit, and never below the server's minimum TTL), then a transaction
//! that creates the key only if it does not exist (`create_revision == 0`) and otherwise
//! reads it. The **token** is the revision that created the key: etcd's revision counts
//! every change of the whole cluster, is persisted in its log before it is acknowledged,
//! and never goes back (across restarts and leader changes), so every later grant of the
//! resource carries a larger one. Renewing is one keep-alive of the lease (the lease not
//! found: it ended and etcd deleted the key, the grant is lost); releasing revokes the
//! lease, which deletes the key.
//!
//! A waiter watches the key from the revision its transaction saw for the key's deletion
//! (a release, or etcd expiring the holder's lease: a paused or dead holder), then tries
//! again; nothing is polled. Every request is bounded by the caller's deadline (renewals by
//! a third of the lease, releases by `connect_timeout`): a silent etcd is
//! [`AcquireError::Unavailable`], never a hang.
//!
//! The client is made at start ([`EtcdLocks::connect`]) and its first request tells whether
//! etcd answers; what is wrong is logged with the lock's name and endpoints, and tried
//! again in the background (a wrong password, etcd not up yet). Until then the lock's
//! routes are answered as with a lock service that does not answer (their
//! `on_redis_error`). Once made, the client reconnects on its own (tonic).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    WatchFilterType, WatchOptions,
};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, error, info};

use super::{AcquireError, Grant, Handle, connect_in_background};

/// Longest pause between two tries of a client that could not be made.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What a grant holds in etcd.
#[derive(Debug)]
pub(crate) struct EtcdGrant {
    lease: i64,
    /// The lease's TTL as etcd granted it (each keep-alive renews it to that).
    ttl: Duration,
}

/// The locks of one `[locks.<name>]` etcd section.
pub(crate) struct EtcdLocks {
    name: String,
    prefix: String,
    connect_timeout: Duration,
    client: Arc<ArcSwapOption<Client>>,
    /// Makes the client, then watches etcd until it answers once (see the module docs).
    _connector: AbortOnDropHandle<()>,
}

impl std::fmt::Debug for EtcdLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLocks")
            .field("name", &self.name)
            .field("prefix", &self.prefix)
            .field("connected", &self.client.load().is_some())
            .finish_non_exhaustive()
    }
}

/// How to reach etcd, as `[locks.<name>]` says.
#[derive(Clone)]
pub(crate) struct EtcdSettings {
    pub(crate) name: String,
    pub(crate) endpoints: Vec<String>,
    pub(crate) prefix: String,
    pub(crate) user: Option<(String, String)>,
    pub(crate) connect_timeout: Duration,
}

impl EtcdLocks {
    /// Starts making the client; returns once it is made and etcd answered, or after
    /// `START_WAIT` at most (see the module docs).
    pub(crate) async fn connect(settings: EtcdSettings) -> EtcdLocks {
        let client = Arc::new(ArcSwapOption::empty());
        let connector = connect_in_background(|ready| {
            keep_connecting(settings.clone(), Arc::clone(&client), ready)
        })
        .await;
        EtcdLocks {
            name: settings.name,
            prefix: settings.prefix,
            connect_timeout: settings.connect_timeout,
            client,
            _connector: connector,
        }
    }

    fn client(&self) -> Result<Client, AcquireError> {
        self.client
            .load_full()
            .map(|client| Client::clone(&client))
            .ok_or(AcquireError::Unavailable)
    }

    fn key(&self, path: &str) -> String {
        format!("{}{path}", self.prefix.trim_end_matches('/'))
    }

    pub(super) async fn acquire(
        &self,
        resource: u128,
        path: &str,
        lease: Duration,
        deadline: Instant,
    ) -> Result<Grant, AcquireError> {
        let mut client = self.client()?;
        let key = self.key(path);
        let owner = format!("{:032x}", rand::random::<u128>());
        let ttl = i64::try_from(lease.as_secs() + u64::from(lease.subsec_nanos() > 0))
            .unwrap_or(i64::MAX)
            .max(1);
        loop {
            let sent = Instant::now();
            let granted = bounded(deadline, client.lease_grant(ttl, None)).await?;
            let lease_id = granted.id();
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    key.as_str(),
                    owner.as_str(),
                    Some(PutOptions::new().with_lease(lease_id)),
                )])
                .or_else([TxnOp::get(
                    key.as_str(),
                    Some(GetOptions::new().with_keys_only()),
                )]);
            let answer = match bounded(deadline, client.txn(txn)).await {
                Ok(answer) => answer,
                Err(e) => {
                    // Whether the key was made is unknown: its lease goes now, or ends.
                    self.revoke_later(&client, lease_id);
                    return Err(e);
                }
            };
            let revision = answer.header().map_or(0, |h| h.revision());
            if answer.succeeded() {
                let Ok(token) = u64::try_from(revision) else {
                    self.revoke_later(&client, lease_id);
                    return Err(AcquireError::Unavailable);
                };
                let ttl = Duration::from_secs(u64::try_from(granted.ttl()).unwrap_or(0));
                return Ok(Grant {
                    token,
                    expires: sent + lease.min(ttl),
                    resource,
                    owner,
                    key: String::new(),
                    handle: Handle::Etcd(EtcdGrant {
                        lease: lease_id,
                        ttl,
                    }),
                });
            }
            // Held by another: this lease is not needed while waiting.
            self.revoke_later(&client, lease_id);
            if Instant::now() >= deadline {
                return Err(AcquireError::Timeout);
            }
            self.wait_for_delete(&mut client, &key, revision + 1, deadline)
                .await?;
        }
    }

    /// Waits until the key is deleted at or after `from` (or the watch ends: then the
    /// caller just tries again), until `deadline` at most.
    async fn wait_for_delete(
        &self,
        client: &mut Client,
        key: &str,
        from: i64,
        deadline: Instant,
    ) -> Result<(), AcquireError> {
        let options = WatchOptions::new()
            .with_start_revision(from)
            .with_filters([WatchFilterType::NoPut]);
        let mut stream =
            match tokio::time::timeout_at(deadline, client.watch(key, Some(options))).await {
                Err(_) => return Err(AcquireError::Timeout),
                Ok(Err(e)) => {
                    debug!(message = "etcd watch failed.", lock = %self.name, error = %e);
                    return Err(AcquireError::Unavailable);
                }
                Ok(Ok(stream)) => stream,
            };
        loop {
            match tokio::time::timeout_at(deadline, stream.message()).await {
                Err(_) => return Err(AcquireError::Timeout),
                // The stream ended or failed (etcd restarted, the revision was compacted):
                // the caller's next transaction tells where things stand.
                Ok(Err(_) | Ok(None)) => return Ok(()),
                Ok(Ok(Some(answer))) => {
                    if answer.canceled()
                        || answer
                            .events()
                            .iter()
                            .any(|e| e.event_type() == EventType::Delete)
                    {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Revokes `lease` in the background, bounded by `connect_timeout` (if it fails, etcd
    /// ends the lease at its TTL).
    fn revoke_later(&self, client: &Client, lease: i64) {
        let mut client = client.clone();
        let bound = self.connect_timeout;
        tokio::spawn(async move {
            let _ = tokio::time::timeout(bound, client.lease_revoke(lease)).await;
        });
    }

    pub(super) async fn renew(
        &self,
        grant: &mut Grant,
        lease: Duration,
    ) -> Result<bool, AcquireError> {
        let Handle::Etcd(held) = &grant.handle else {
            return Ok(false);
        };
        let mut client = self.client()?;
        let sent = Instant::now();
        // Opening the keep-alive stream sends one keep-alive and reads its answer: TTL 0
        // ("lease not found") means the lease ended, and with it the key.
        match tokio::time::timeout(lease / 3, client.lease_keep_alive(held.lease)).await {
            Ok(Ok(_)) => {
                grant.expires = sent + lease.min(held.ttl);
                Ok(true)
            }
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(_))) => Ok(false),
            Ok(Err(e)) => {
                debug!(message = "etcd keep-alive failed.", lock = %self.name, error = %e);
                Err(AcquireError::Unavailable)
            }
            Err(_) => Err(AcquireError::Unavailable),
        }
    }

    pub(super) async fn release(&self, grant: &Grant) -> bool {
        let Handle::Etcd(held) = &grant.handle else {
            return true;
        };
        let Ok(mut client) = self.client() else {
            return false;
        };
        // Revoking deletes the key (the waiters' watches fire); if etcd does not answer,
        // the lease ends at its TTL.
        matches!(
            tokio::time::timeout(self.connect_timeout, client.lease_revoke(held.lease)).await,
            Ok(Ok(_))
        )
    }
}

/// `request`, bounded by `deadline`: not answered in time, or failed, is
/// [`AcquireError::Unavailable`].
async fn bounded<T>(
    deadline: Instant,
    request: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, AcquireError> {
    match tokio::time::timeout_at(deadline, request).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => {
            debug!(message = "etcd request failed.", error = %e);
            Err(AcquireError::Unavailable)
        }
        Err(_) => Err(AcquireError::Unavailable),
    }
}

/// Makes the client (tried again with a growing pause while it cannot be: a wrong password,
/// an endpoint that refuses), then asks etcd until it answers once. Logs the first failure
/// of each as an error naming the lock, its endpoints and what failed, and the recovery.
async fn keep_connecting(
    settings: EtcdSettings,
    slot: Arc<ArcSwapOption<Client>>,
    ready: tokio::sync::watch::Sender<bool>,
) {
    let EtcdSettings {
        name,
        endpoints,
        prefix,
        user,
        connect_timeout,
    } = settings;
    let mut options = ConnectOptions::new()
        .with_connect_timeout(connect_timeout)
        .with_keep_alive(connect_timeout, connect_timeout)
        .with_auto_token_refresh(true);
    if let Some((user, password)) = user {
        options = options.with_user(user, password);
    }
    let mut backoff = Duration::from_millis(100);
    let mut failures = 0u32;
    let mut client = loop {
        let made = tokio::time::timeout(
            connect_timeout,
            Client::connect(&endpoints, Some(options.clone())),
        )
        .await;
        let problem = match made {
            Ok(Ok(client)) => break client,
            Ok(Err(e)) => describe(&e),
            Err(_) => format!("no answer within connect_timeout ({connect_timeout:?})"),
        };
        if failures == 0 {
            error!(
                message = "Lock service unreachable or refused at start: writes on the routes \
                           that use it follow their on_redis_error until it connects (tried \
                           again in the background).",
                lock = %name,
                backend = "etcd",
                endpoints = ?endpoints,
                problem = %problem,
            );
        } else {
            debug!(message = "etcd still not connected.", lock = %name, problem = %problem);
        }
        failures += 1;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    };
    slot.store(Some(Arc::new(client.clone())));
    // The client connects lazily: a read of the lock prefix says whether etcd answers and
    // lets this user read it.
    let mut backoff = Duration::from_millis(100);
    let mut logged = false;
    loop {
        let probe = tokio::time::timeout(
            connect_timeout,
            client.get(
                prefix.as_str(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            ),
        )
        .await;
        let problem = match probe {
            Ok(Ok(_)) => break,
            Ok(Err(e)) => describe(&e),
            Err(_) => format!("no answer within connect_timeout ({connect_timeout:?})"),
        };
        if !logged {
            error!(
                message = "Lock service unreachable at start: writes on the routes that use it \
                           follow their on_redis_error until it answers.",
                lock = %name,
                backend = "etcd",
                endpoints = ?endpoints,
                problem = %problem,
            );
            logged = true;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
    if logged || failures > 0 {
        info!(message = "Lock service answers now.", lock = %name, backend = "etcd");
    } else {
        info!(
            message = "Lock service connected.",
            lock = %name,
            backend = "etcd",
            endpoints = ?endpoints,
        );
    }
    let _ = ready.send(true);
}

/// A short account of why a request to etcd failed, for the log.
fn describe(error: &etcd_client::Error) -> String {
    match error {
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            tonic::Code::Unauthenticated => format!(
                "authentication failed (check username and password): {}",
                status.message()
            ),
            tonic::Code::PermissionDenied => format!(
                "permission denied (the user needs read and write on the prefix): {}",
                status.message()
            ),
            code => {
                let cause = std::error::Error::source(status)
                    .map(|cause| format!(" ({cause})"))
                    .unwrap_or_default();
                format!("{code:?}: {}{cause}", status.message())
            }
        },
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests;
