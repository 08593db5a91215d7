//! The thread every Redis connection lives on.
//!
//! A redis-rs connection is driven by a task (the multiplexed pipeline's reader and
//! writer) spawned on whatever runtime makes or re-makes the connection: the caller's. A
//! command's answer is late when that task is late, and every late answer counts toward
//! the circuit breaker as if Redis were slow. On the runtime that also runs the accept
//! loop, the admin listener and the background tasks — or, embedded in a program, that
//! program's own work (a load generator, a database) — a burst of requests kept the
//! drivers waiting past `command_timeout`: the breaker opened on a healthy Redis, and the
//! origin then saw twice the queries.
//!
//! So Redis gets a thread of its own: a single-threaded runtime ([`IoThread`]) that runs
//! nothing but the connection drivers and the tasks that talk to Redis on their own
//! schedule (the health probe, the Sentinel follower, the event bus, the stream consumer).
//! A thread that sleeps until a socket is ready is woken at once by the kernel's scheduler
//! however busy the other threads are. A task that sends a command on one of these
//! connections stays on its runtime; the command is polled inside the Redis thread's
//! context ([`IoThread::enter`]), so whatever redis-rs spawns meanwhile (a reconnection, a
//! new connection's driver) lands on the Redis thread too.
//!
//! Proxy workers are the exception: each sends its requests' commands on a connection of
//! its own, driven on the worker (see [`super::worker_conn`]), so they cross no thread; the
//! breaker's heartbeat, here, still tells a busy worker from a slow Redis.
//!
//! The thread ends when the last handle is dropped, after the tasks that hold one stopped.

use std::future::Future;
use std::sync::Arc;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// A handle to the Redis thread; clones share it, and the thread ends with the last one.
#[derive(Clone, Debug)]
pub(crate) struct IoThread {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    handle: Handle,
    stop: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl IoThread {
    /// Starts the thread.
    ///
    /// # Errors
    /// The thread or its runtime cannot be created.
    pub(crate) fn start() -> std::io::Result<IoThread> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name("cacheguard-redis".to_owned())
            .spawn(move || {
                runtime.block_on(stopped.cancelled());
                // Dropped here, outside any async context: its remaining tasks end.
                drop(runtime);
            })?;
        Ok(IoThread {
            inner: Arc::new(Inner { handle, stop }),
        })
    }

    /// Runs `task` on the Redis thread.
    pub(crate) fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        drop(self.inner.handle.spawn(task));
    }

    /// Polls `future` (on the caller's task) inside the Redis thread's runtime context, so
    /// any task it spawns — a connection driver — runs on the Redis thread.
    ///
    /// # Cancel safety
    /// As cancel-safe as `future`: dropping this drops it.
    pub(crate) async fn enter<F: Future>(&self, future: F) -> F::Output {
        let mut future = std::pin::pin!(future);
        std::future::poll_fn(|cx| {
            let _context = self.inner.handle.enter();
            future.as_mut().poll(cx)
        })
        .await
    }
}
