//! `TcpProxy`: a small fault-injecting TCP proxy on `127.0.0.1`, put between cacheguard and
//! a Redis server to cut connections or slow them down.
//!
//! - [`TcpProxy::cut`]: closes every proxied connection now and closes each new one as soon
//!   as it is accepted, until [`TcpProxy::restore`] (a network partition, seen by the client
//!   as connections that end at once).
//! - [`TcpProxy::set_delay`]: each chunk read from either side waits this long before it is
//!   forwarded (added latency, both directions; applies to connections already open too).
//! - [`TcpProxy::drop_open_on_next_request`]: connections open now end, unanswered, at the
//!   next bytes their client sends (a pooled connection a middlebox forgot).
//! - [`TcpProxy::blackhole`]: connections (open and new) are accepted and held, and no byte
//!   crosses in either direction, until [`TcpProxy::restore`] (packets dropped on the floor:
//!   the client sees no error, only silence). On restore, what was held is delivered, as
//!   TCP retransmission would after a short partition.
//!
//! Every task the proxy spawns is owned by it and stopped on `Drop`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

/// Bound on connecting to the target for one accepted connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const CHUNK: usize = 16 * 1024;

#[derive(Debug)]
struct Link {
    /// While true, new connections are closed as soon as they are accepted.
    cut: bool,
    /// Cancelled by `cut()`: ends every connection opened before it.
    epoch: CancellationToken,
    /// Cancelled by `drop_open_on_next_request()`: connections opened before it end at
    /// their next client bytes, which are not forwarded.
    stale: CancellationToken,
}

#[derive(Debug)]
struct Shared {
    target: SocketAddr,
    link: Mutex<Link>,
    delay: Mutex<Duration>,
    /// True while blackholed: nothing is connected or forwarded.
    blackholed: watch::Sender<bool>,
    accepted: AtomicU64,
    refused: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A TCP proxy from a free loopback port to `target`. Stops (listener and every proxied
/// connection) on `Drop`.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl TcpProxy {
    /// Binds `127.0.0.1:0` and forwards every accepted connection to `target`.
    pub async fn start(target: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind tcp proxy");
        let addr = listener.local_addr().expect("tcp proxy local addr");
        let shared = Arc::new(Shared {
            target,
            link: Mutex::new(Link {
                cut: false,
                epoch: CancellationToken::new(),
                stale: CancellationToken::new(),
            }),
            delay: Mutex::new(Duration::ZERO),
            blackholed: watch::Sender::new(false),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        });
        let stop = CancellationToken::new();
        let task = tokio::spawn(accept_loop(listener, shared.clone(), stop.clone()));
        TcpProxy {
            addr,
            shared,
            stop,
            task,
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `redis://ADDR` for a proxy in front of a Redis server.
    pub fn redis_url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Drops every current connection and closes new ones at once, until [`Self::restore`].
    pub fn cut(&self) {
        let mut link = lock(&self.shared.link);
        link.cut = true;
        link.epoch.cancel();
    }

    /// Accepts and forwards connections again, after a cut or a blackhole (connections
    /// dropped by `cut` stay closed; what a blackhole held is delivered now).
    pub fn restore(&self) {
        {
            let mut link = lock(&self.shared.link);
            link.cut = false;
            if link.epoch.is_cancelled() {
                link.epoch = CancellationToken::new();
            }
        }
        self.shared.blackholed.send_replace(false);
    }

    /// Holds every connection, open and new, and forwards nothing either way until
    /// [`Self::restore`]: a peer behind a silent network (its requests time out, no
    /// connection is refused or reset).
    pub fn blackhole(&self) {
        self.shared.blackholed.send_replace(true);
    }

    /// Whether the proxy is blackholed.
    pub fn is_blackholed(&self) -> bool {
        *self.shared.blackholed.borrow()
    }

    /// Every connection open now is dropped, silently, at the next bytes its client sends
    /// (which never reach the target): a middlebox that forgot the connection, so a pooled
    /// keep-alive connection fails on its next request, after the request was written.
    /// Connections opened later are not affected.
    pub fn drop_open_on_next_request(&self) {
        let mut link = lock(&self.shared.link);
        link.stale.cancel();
        link.stale = CancellationToken::new();
    }

    /// Whether the proxy is cut.
    pub fn is_cut(&self) -> bool {
        lock(&self.shared.link).cut
    }

    /// Added latency per forwarded chunk, both directions (zero = none).
    pub fn set_delay(&self, delay: Duration) {
        *lock(&self.shared.delay) = delay;
    }

    /// Connections accepted and forwarded so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections closed at once because the proxy was cut.
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        lock(&self.shared.link).epoch.cancel();
        // Aborting the accept task drops its JoinSet, which aborts every connection task.
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => {
                let Ok((client, _peer)) = accepted else { continue };
                // Decide under the lock, so a connection accepted while `cut()` runs is
                // either refused here or owned by the epoch `cut()` cancels.
                let tokens = {
                    let link = lock(&shared.link);
                    (!link.cut).then(|| (link.epoch.clone(), link.stale.clone()))
                };
                let Some((epoch, stale)) = tokens else {
                    shared.refused.fetch_add(1, Ordering::SeqCst);
                    drop(client);
                    continue;
                };
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                connections.spawn(proxy_connection(client, shared.clone(), epoch, stale));
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
}

async fn proxy_connection(
    client: TcpStream,
    shared: Arc<Shared>,
    epoch: CancellationToken,
    stale: CancellationToken,
) {
    // A blackhole holds a new connection before it reaches the target.
    tokio::select! {
        () = epoch.cancelled() => return,
        () = passable(&shared) => {}
    }
    let upstream = tokio::select! {
        () = epoch.cancelled() => return,
        c = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(shared.target)) => c,
    };
    let Ok(Ok(upstream)) = upstream else { return };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    // The first direction to end (EOF, error, or the cut) ends the whole connection: both
    // sockets are dropped here, so each peer sees the connection close.
    tokio::select! {
        biased;
        () = epoch.cancelled() => {}
        () = pump(client_read, upstream_write, &shared, &epoch, Some(&stale)) => {}
        () = pump(upstream_read, client_write, &shared, &epoch, None) => {}
    }
}

/// Copies `from` to `to` until either ends. Nothing read after a cut is forwarded: the cut
/// is checked before every write, so once `cut()` returns no byte crosses.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    epoch: &CancellationToken,
    stale: Option<&CancellationToken>,
) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let delay = *lock(&shared.delay);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        // Held while blackholed (the caller's select! ends this on a cut).
        passable(shared).await;
        if stale.is_some_and(CancellationToken::is_cancelled) {
            return;
        }
        if epoch.is_cancelled() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Returns once the proxy is not blackholed.
async fn passable(shared: &Shared) {
    let mut blackholed = shared.blackholed.subscribe();
    // The sender lives in `shared`, which outlives this wait: `wait_for` only fails if it
    // were dropped, and then there is nothing left to hold for.
    let _ = blackholed.wait_for(|held| !*held).await;
}
