//! Each proxy worker's own connection to Redis.
//!
//! Every connection a request's command could go on has its driver (redis-rs's pipeline
//! reader and writer, or a cluster connection's router) on the thread that made it. The
//! shared connection's lives on the Redis thread (see [`super::io`]), so a command sent
//! from a proxy worker on it crosses threads twice: written there, answered there, handed
//! back. A connection made *on* the worker has its driver on the worker's own runtime: the
//! command is written, answered and handed back on that thread, which measured a third of
//! an L2 hit's CPU. So each proxy worker keeps one connection per [`super::redis::RedisConn`]
//! (made by [`super::backend::Backend::per_worker`]: a plain multiplexed connection to the
//! standalone Redis or to the Sentinel's current primary, a cluster connection that routes
//! by slot and follows `MOVED`/`ASK` itself), and `RedisConn` sends a request's commands on
//! it when called on a proxy worker.
//!
//! Thread-local by nature (the point is which thread drives it), so kept in a
//! `thread_local`, by owner (a `Weak` to a token of its `RedisConn`, so a dropped one's are
//! pruned and never mistaken for a new one's) and by the generation of the shared
//! connection: a new shared connection (new credentials, a Sentinel's new primary, a
//! cluster reached at last) makes every worker's connection again.
//!
//! A connection is made by a task of the worker's own ([`Owner::make`]), never by a
//! request: connecting to a Redis that hangs (`SIGSTOP`, a blackhole) waits for
//! `connect_timeout`, which no request should pay. Until it is made, and for
//! [`RETRY_AFTER`] after it could not be, the worker's commands go on the shared connection
//! (counted: `cacheguard_redis_commands_off_worker_total{reason="fallback"}`).
//! Hand-written: a few lines of per-thread bookkeeping no crate offers for redis-rs.

use std::cell::RefCell;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::backend::DataConn;

/// How long a worker goes on without a connection of its own after failing to make one.
pub(crate) const RETRY_AFTER: Duration = Duration::from_millis(200);

/// The identity of one `RedisConn`'s connections in every worker's table.
#[derive(Clone, Debug, Default)]
pub(crate) struct Owner(Arc<()>);

/// A worker's connection, being made, or when it last failed to make one.
enum State {
    Ready(DataConn),
    Making,
    Failed(tokio::time::Instant),
}

struct Entry {
    owner: Weak<()>,
    generation: u64,
    state: State,
}

thread_local! {
    static CONNS: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

/// What this thread holds for an owner and generation.
pub(crate) enum Found {
    /// A connection to use.
    Ready(DataConn),
    /// Being made, or making one failed less than [`RETRY_AFTER`] ago: use the shared
    /// connection.
    Resting,
    /// None yet: make one.
    Missing,
}

impl Owner {
    fn is(&self, entry: &Entry) -> bool {
        std::ptr::eq(entry.owner.as_ptr(), Arc::as_ptr(&self.0))
    }

    /// This thread's connection for `generation`.
    pub(crate) fn find(&self, generation: u64) -> Found {
        CONNS.with_borrow(|conns| {
            match conns
                .iter()
                .find(|e| e.generation == generation && self.is(e))
                .map(|e| &e.state)
            {
                Some(State::Ready(conn)) => Found::Ready(conn.clone()),
                Some(State::Making) => Found::Resting,
                Some(State::Failed(at)) if at.elapsed() < RETRY_AFTER => Found::Resting,
                Some(State::Failed(_)) | None => Found::Missing,
            }
        })
    }

    /// Makes this thread's connection for `generation` with `connect` (bounded by
    /// `within`), on a task of the calling thread's runtime (a proxy worker's runs on that
    /// worker alone, and so will the connection's driver); [`Owner::find`] has it once made.
    pub(crate) fn make<F>(&self, generation: u64, within: Duration, connect: F)
    where
        F: Future<Output = redis::RedisResult<DataConn>> + Send + 'static,
    {
        self.put(generation, State::Making);
        let owner = self.clone();
        drop(tokio::spawn(async move {
            let state = match tokio::time::timeout(within, connect).await {
                Ok(Ok(conn)) => State::Ready(conn),
                Ok(Err(_)) | Err(_) => State::Failed(tokio::time::Instant::now()),
            };
            owner.made(generation, state);
        }));
    }

    /// Settles a [`Owner::make`] of `generation`, unless this thread moved on meanwhile (a
    /// newer generation, or the attempt forgotten).
    fn made(&self, generation: u64, state: State) {
        CONNS.with_borrow_mut(|conns| {
            if let Some(entry) = conns
                .iter_mut()
                .find(|e| self.is(e) && e.generation == generation)
                && matches!(entry.state, State::Making)
            {
                entry.state = state;
            }
        });
    }

    /// Drops this thread's connection (it failed): the next command makes a new one.
    pub(crate) fn forget(&self) {
        CONNS.with_borrow_mut(|conns| conns.retain(|e| !self.is(e)));
    }

    fn put(&self, generation: u64, state: State) {
        CONNS.with_borrow_mut(|conns| {
            conns.retain(|e| e.owner.strong_count() > 0 && !self.is(e));
            conns.push(Entry {
                owner: Arc::downgrade(&self.0),
                generation,
                state,
            });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> redis::RedisResult<DataConn> {
        Err(redis::RedisError::from((redis::ErrorKind::Io, "refused")))
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_connection_rests_then_is_made_again_and_a_new_generation_misses() {
        let owner = Owner::default();
        assert!(matches!(owner.find(0), Found::Missing));
        owner.make(0, RETRY_AFTER, async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            refused()
        });
        assert!(
            matches!(owner.find(0), Found::Resting),
            "no request waits for a connection being made"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(matches!(owner.find(0), Found::Resting), "failed: resting");
        assert!(
            matches!(owner.find(1), Found::Missing),
            "a new shared connection is worth a try at once"
        );
        tokio::time::advance(RETRY_AFTER).await;
        assert!(matches!(owner.find(0), Found::Missing));
        let other = Owner::default();
        other.make(0, RETRY_AFTER, std::future::pending());
        assert!(
            matches!(owner.find(0), Found::Missing),
            "owners are told apart"
        );
        // A connection that takes too long is given up.
        tokio::time::sleep(RETRY_AFTER * 2).await;
        assert!(matches!(other.find(0), Found::Missing));
        // An attempt of an older generation does not settle a newer one.
        owner.make(0, RETRY_AFTER, async { refused() });
        owner.make(1, RETRY_AFTER, std::future::pending());
        tokio::task::yield_now().await;
        assert!(matches!(owner.find(1), Found::Resting));
        drop(other);
        owner.make(2, RETRY_AFTER, async { refused() });
        CONNS.with_borrow(|conns| assert_eq!(conns.len(), 1, "a dropped owner's are pruned"));
        owner.forget();
        CONNS.with_borrow(|conns| assert!(conns.is_empty()));
    }
}
