//! The ZooKeeper lock of serialized writes (see `locks.rs`): Apache Curator's
//! `InterProcessMutex` recipe, so that a Java service locking the same path with Curator
//! and cacheguard exclude each other.
//!
//! A resource's lock is the directory `<path><resource path>` (created as container nodes,
//! as Curator does, so the server removes idle ones). A contender creates an ephemeral
//! sequential node `_c_<uuid>-lock-<sequence>` in it (Curator's "protected" name: after a
//! lost connection the node is found again by its uuid); the lowest sequence holds the
//! lock, and each other contender watches the one just before it, so a release wakes one
//! waiter. The recipe is written here on `zookeeper-client`'s requests rather than taken
//! from its `Client::lock`: a node must be deleted whatever happens to the request that
//! deletes it (that client gives up a delete that was under way when the connection
//! dropped, and the node would then block the resource for as long as the session lives),
//! and an acquire needs its deadline and its node's `czxid`.
//!
//! The **token** is the lock node's `czxid`, the id of the transaction that created it:
//! zxids are cluster-wide, only increase, and are in the transaction log before a write is
//! acknowledged, so a later holder (whose node was created after the previous holder's,
//! or it would not hold) has a larger one, across restarts that keep the data directory
//! (a standalone server goes on from its last logged zxid; a new ensemble epoch moves the
//! high 32 bits up). A server whose data directory was lost starts again from zero, and so
//! would the tokens.
//!
//! A grant lasts as long as the ZooKeeper **session** that created the node, one session
//! per `[locks.<name>]` section and process. The session is the lease: a holder that stops
//! (a pause, a crash) is expired by the server after `session_timeout` and its nodes are
//! deleted, which wakes the next waiter. Hence:
//!
//! - the grant's local expiry is the request's send time plus `min(lease, session
//!   timeout)`, the session being alive at least that long after the server last heard
//!   from it (the route's lease must not exceed the session timeout: config validation);
//! - a renewal checks that the session is connected and the node still exists under it; a
//!   session that is **disconnected** (Curator's SUSPENDED: the server may expire it
//!   meanwhile) or **expired** (LOST) is a lost grant, `Ok(false)`;
//! - a node is deleted by a task that tries until the server says it is gone or the
//!   session ends (which deletes it too): on release, and when a contender gives up (its
//!   deadline, or its future dropped) — a contender whose create went unanswered is found
//!   by its uuid.
//!
//! The session is opened at start ([`ZooKeeperLocks::connect`]) and opened again whenever it
//! ends (expired, or closed by a failure to reconnect in time); what is wrong is logged with
//! the lock's name and connect string. While there is no connected session, acquires fail
//! at once with [`AcquireError::Unavailable`] (the route's `on_redis_error`).

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, error, info, warn};
use zookeeper_client as zk;

use super::{AcquireError, Grant, Handle, connect_in_background};

/// Curator's lock name for `InterProcessMutex` (the `lock-` in `_c_<uuid>-lock-<seq>`).
const LOCK_NAME: &str = "lock-";

/// Longest pause between two tries to open a session.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What a grant holds in ZooKeeper: its lock node, deleted when this is dropped.
#[derive(Debug)]
pub(crate) struct ZooKeeperGrant {
    node: Contender,
}

/// How to reach ZooKeeper, as `[locks.<name>]` says.
#[derive(Clone, Debug)]
pub(crate) struct ZooKeeperSettings {
    pub(crate) name: String,
    pub(crate) connect: String,
    pub(crate) path: String,
    pub(crate) session_timeout: Duration,
}

/// The locks of one `[locks.<name>]` ZooKeeper section.
#[derive(Debug)]
pub(crate) struct ZooKeeperLocks {
    path: String,
    session: Arc<ArcSwapOption<zk::Client>>,
    /// Opens the session, and again each time it ends.
    _keeper: AbortOnDropHandle<()>,
}

impl ZooKeeperLocks {
    /// Starts opening the session; returns once it is open, or after `START_WAIT` at most.
    pub(crate) async fn connect(settings: ZooKeeperSettings) -> ZooKeeperLocks {
        let session = Arc::new(ArcSwapOption::empty());
        let keeper = connect_in_background(|opened| {
            keep_session(settings.clone(), Arc::clone(&session), opened)
        })
        .await;
        ZooKeeperLocks {
            path: settings.path,
            session,
            _keeper: keeper,
        }
    }

    /// The session, if it is connected now.
    fn session(&self) -> Result<Arc<zk::Client>, AcquireError> {
        self.session
            .load_full()
            .filter(|client| connected(client))
            .ok_or(AcquireError::Unavailable)
    }

    pub(super) async fn acquire(
        &self,
        resource: u128,
        path: &str,
        lease: Duration,
        deadline: Instant,
    ) -> Result<Grant, AcquireError> {
        let client = self.session()?;
        let dir = lock_dir(&self.path, path);
        let owner = format!("{:032x}", rand::random::<u128>());
        let sent = Instant::now();
        let mut node = Contender::new(Arc::clone(&client), &dir);
        let token = match tokio::time::timeout_at(deadline, node.contend(owner.as_bytes())).await {
            Ok(Ok(token)) => token,
            Ok(Err(e)) => {
                debug!(message = "ZooKeeper lock failed.", dir = %dir, error = %e);
                return Err(AcquireError::Unavailable);
            }
            // Held by another until the deadline: waiting for a predecessor to go, on a
            // session still connected. Otherwise ZooKeeper did not answer in time.
            Err(_) if node.watching && connected(&client) => return Err(AcquireError::Timeout),
            Err(_) => return Err(AcquireError::Unavailable),
        };
        Ok(Grant {
            token,
            expires: sent + lease.min(client.session_timeout()),
            resource,
            owner,
            key: String::new(),
            handle: Handle::ZooKeeper(ZooKeeperGrant { node }),
        })
    }

    pub(super) async fn renew(
        &self,
        grant: &mut Grant,
        lease: Duration,
    ) -> Result<bool, AcquireError> {
        let Handle::ZooKeeper(held) = &grant.handle else {
            return Ok(false);
        };
        let client = &held.node.client;
        // Disconnected (SUSPENDED) or expired (LOST): the server may have given the node
        // away, or will.
        if !connected(client) {
            return Ok(false);
        }
        let Some(path) = held.node.path.as_deref() else {
            return Ok(false);
        };
        let sent = Instant::now();
        match tokio::time::timeout(lease / 3, client.check_stat(path)).await {
            Ok(Ok(Some(stat))) if stat.ephemeral_owner == client.session_id().0 => {
                grant.expires = sent + lease.min(client.session_timeout());
                Ok(true)
            }
            Ok(Ok(_)) => Ok(false),
            _ if !connected(client) => Ok(false),
            _ => Err(AcquireError::Unavailable),
        }
    }
}

/// One contender's node in a lock directory, from before it is created until it is
/// deleted: dropped at any point (a deadline, a dropped future, a release), it has the node
/// deleted in the background ([`delete_later`]).
#[derive(Debug)]
struct Contender {
    client: Arc<zk::Client>,
    dir: String,
    /// `_c_<uuid>-`: finds the node when its create went unanswered.
    protected: String,
    /// The node, once created (or found).
    path: Option<String>,
    /// Whether a create was sent (without a node known: it may have been made).
    tried: bool,
    /// Whether it waits for a predecessor's node to go (rather than for an answer).
    watching: bool,
}

impl Contender {
    fn new(client: Arc<zk::Client>, dir: &str) -> Contender {
        Contender {
            client,
            dir: dir.to_owned(),
            protected: format!("_c_{}-", uuid_v4()),
            path: None,
            tried: false,
            watching: false,
        }
    }

    /// Creates the node and waits until it is the lowest; returns its `czxid`. Errors are
    /// the server's (the session's) failures; the caller bounds the wait.
    async fn contend(&mut self, data: &[u8]) -> Result<u64, zk::Error> {
        let czxid = self.create(data).await?;
        let Some(path) = self.path.clone() else {
            return Err(zk::Error::UnexpectedError("no lock node".into()));
        };
        let name = path.rsplit('/').next().unwrap_or_default().to_owned();
        loop {
            let mut contenders: Vec<(String, String)> = self
                .client
                .list_children(&self.dir)
                .await?
                .into_iter()
                .filter_map(|child| Some((sequence(&child)?.to_owned(), child)))
                .collect();
            // Curator's order: by the sequence after `lock-` (ten digits).
            contenders.sort();
            let Some(mine) = contenders.iter().position(|(_, child)| *child == name) else {
                // Our node is gone: the session that made it expired.
                return Err(zk::Error::SessionExpired);
            };
            let Some(mine) = mine.checked_sub(1) else {
                return Ok(czxid);
            };
            let before = format!("{}/{}", self.dir, contenders[mine].1);
            match self.client.check_and_watch_stat(&before).await? {
                (None, _) => continue,
                (Some(_), watcher) => {
                    self.watching = true;
                    watcher.changed().await;
                    self.watching = false;
                }
            }
        }
    }

    /// Creates the node (its directory too), or finds it again after a lost answer.
    async fn create(&mut self, data: &[u8]) -> Result<u64, zk::Error> {
        let prefix = format!("{}/{}{LOCK_NAME}", self.dir, self.protected);
        let node = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        let directory = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
        loop {
            self.tried = true;
            match self.client.create(&prefix, data, &node).await {
                Ok((stat, seq)) => {
                    self.path = Some(format!("{prefix}{seq}"));
                    return u64::try_from(stat.czxid)
                        .map_err(|_| zk::Error::UnexpectedError("negative czxid".into()));
                }
                Err(zk::Error::NoNode) => match self.client.mkdir(&self.dir, &directory).await {
                    Ok(()) | Err(zk::Error::NodeExists) => {}
                    Err(e) => return Err(e),
                },
                Err(zk::Error::ConnectionLoss) => {
                    // Made or not? Curator's protection: look for our uuid.
                    let children = self.client.list_children(&self.dir).await?;
                    if let Some(child) = children.iter().find(|c| c.starts_with(&self.protected)) {
                        let path = format!("{}/{child}", self.dir);
                        let stat = self.client.check_stat(&path).await?;
                        self.path = Some(path);
                        let czxid = stat.map(|s| s.czxid).ok_or(zk::Error::SessionExpired)?;
                        return u64::try_from(czxid)
                            .map_err(|_| zk::Error::UnexpectedError("negative czxid".into()));
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for Contender {
    fn drop(&mut self) {
        let target = match self.path.take() {
            Some(path) => Target::Node(path),
            None if !self.tried => return,
            None => Target::Protected {
                dir: std::mem::take(&mut self.dir),
                protected: std::mem::take(&mut self.protected),
            },
        };
        delete_later(Arc::clone(&self.client), target);
    }
}

/// A node to delete.
#[derive(Debug)]
enum Target {
    Node(String),
    /// The node of `dir` whose name starts with `protected`, if its create went through.
    Protected {
        dir: String,
        protected: String,
    },
}

/// How long one try of a background delete may take.
const DELETE_TRY: Duration = Duration::from_secs(2);

/// Deletes `target` in the background, trying until the server says it is gone or the
/// session has ended (which deleted it).
fn delete_later(client: Arc<zk::Client>, target: Target) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        // No runtime (the process is ending): the session's end deletes the node.
        return;
    };
    runtime.spawn(async move {
        let mut backoff = Duration::from_millis(50);
        while !client.state().is_terminated() {
            let tried = tokio::time::timeout(DELETE_TRY, async {
                let path = match &target {
                    Target::Node(path) => path.clone(),
                    Target::Protected { dir, protected } => {
                        let children = match client.list_children(dir).await {
                            Err(zk::Error::NoNode) => return Ok(()),
                            other => other?,
                        };
                        match children.iter().find(|c| c.starts_with(protected.as_str())) {
                            Some(child) => format!("{dir}/{child}"),
                            None => return Ok(()),
                        }
                    }
                };
                match client.delete(&path, None).await {
                    Err(zk::Error::NoNode) => Ok(()),
                    other => other,
                }
            })
            .await;
            if matches!(tried, Ok(Ok(()))) {
                return;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    });
}

/// The sequence of a contender's node name (`…lock-0000000042` → `0000000042`), as
/// Curator sorts them; `None` for a node that is not a contender.
fn sequence(name: &str) -> Option<&str> {
    let (_, sequence) = name.rsplit_once(LOCK_NAME)?;
    (!sequence.is_empty() && sequence.bytes().all(|b| b.is_ascii_digit())).then_some(sequence)
}

/// A random (version 4) UUID, as Curator writes it in a protected node's name.
fn uuid_v4() -> String {
    let bits = (rand::random::<u128>() & !(0xf << 76) & !(0x3 << 62)) | (0x4 << 76) | (0x2 << 62);
    let hex = format!("{bits:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Whether `client`'s session is connected to a server now.
fn connected(client: &zk::Client) -> bool {
    matches!(
        client.state(),
        zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly
    )
}

/// The lock directory of `resource` (a path like `/trains/t1/seats/1A`) under `root`: the
/// path as it is, so that a Curator mutex on `<root><path>` is the same lock, except for
/// what ZooKeeper does not take in a node name: an empty, `.` or `..` segment, and control
/// characters (those are percent-escaped; `%` itself is left alone).
pub(crate) fn lock_dir(root: &str, resource: &str) -> String {
    let mut dir = root.trim_end_matches('/').to_owned();
    for segment in resource.trim_start_matches('/').split('/') {
        dir.push('/');
        match segment {
            "" => dir.push_str("%20"),
            "." => dir.push_str("%2E"),
            ".." => dir.push_str("%2E%2E"),
            _ => {
                for c in segment.chars() {
                    if forbidden(c) {
                        let mut bytes = [0u8; 4];
                        for b in c.encode_utf8(&mut bytes).bytes() {
                            dir.push_str(&format!("%{b:02X}"));
                        }
                    } else {
                        dir.push(c);
                    }
                }
            }
        }
    }
    dir
}

/// Characters ZooKeeper refuses in a path (`PathUtils.validatePath`).
fn forbidden(c: char) -> bool {
    matches!(c, '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}')
}

/// Opens the session, and again each time it ends, with a growing pause between failed
/// tries. Logs the first failure as an error naming the lock, its connect string and what
/// failed, and each session opened or ended.
async fn keep_session(
    settings: ZooKeeperSettings,
    slot: Arc<ArcSwapOption<zk::Client>>,
    opened: tokio::sync::watch::Sender<bool>,
) {
    let ZooKeeperSettings {
        name,
        connect,
        session_timeout,
        ..
    } = settings;
    let mut backoff = Duration::from_millis(100);
    let mut failures = 0u32;
    loop {
        let attempt = zk::Client::connector()
            .with_session_timeout(session_timeout)
            .with_fail_eagerly()
            .connect(&connect);
        let problem = match tokio::time::timeout(session_timeout, attempt).await {
            Ok(Ok(client)) => {
                info!(
                    message = "Lock service session opened.",
                    lock = %name,
                    backend = "zookeeper",
                    connect = %connect,
                    session = %client.session_id(),
                    session_timeout = ?client.session_timeout(),
                );
                let mut states = client.state_watcher();
                slot.store(Some(Arc::new(client)));
                let _ = opened.send(true);
                failures = 0;
                backoff = Duration::from_millis(100);
                let ended = loop {
                    let state = states.changed().await;
                    if state.is_terminated() {
                        break state;
                    }
                    debug!(message = "ZooKeeper session state.", lock = %name, state = ?state);
                };
                slot.store(None);
                warn!(
                    message = "Lock service session ended: the locks it held are lost (their \
                               holders learn it at their next renewal); opening a new one.",
                    lock = %name,
                    backend = "zookeeper",
                    state = ?ended,
                );
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no session within session_timeout ({session_timeout:?})"),
        };
        if failures == 0 {
            error!(
                message = "Lock service unreachable: writes on the routes that use it follow \
                           their on_redis_error until a session opens (tried again in the \
                           background).",
                lock = %name,
                backend = "zookeeper",
                connect = %connect,
                problem = %problem,
            );
        } else {
            debug!(message = "ZooKeeper still unreachable.", lock = %name, problem = %problem);
        }
        failures += 1;
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests;
