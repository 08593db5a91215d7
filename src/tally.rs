//! Per-task tallies read when a future ends: the Redis commands a request sent
//! (`coord::redis::count_commands`), the time it waited on the origin
//! (`proxy::access_log::timing_origin`). Each keeps its count in a tokio task-local scoped
//! around the future; [`Tallied`] reads the count in the poll that finishes the future,
//! while the scope is still set.
//!
//! Hand-written rather than an `async move { let output = future.await; (output, read()) }`
//! block: such a block keeps the captured future and the awaited one in two slots of its
//! state, so each wrapper doubled the size of the request or fill future it wrapped (a
//! miss's fill task was 65 KB, 16 KB of it fill), and every spawn or box of it copied all
//! of that.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

pin_project_lite::pin_project! {
    /// `future`'s output, and what `read` returns in the poll that produced it. Made by
    /// [`tallied`].
    pub(crate) struct Tallied<F, T> {
        #[pin]
        future: F,
        read: fn() -> T,
    }
}

/// `future`, then `read()` taken as it ends. Wrapped in a task-local's `scope`, `read` sees
/// that scope's value as the future left it; the result is the size of `future` and a
/// pointer.
pub(crate) fn tallied<F: Future, T>(future: F, read: fn() -> T) -> Tallied<F, T> {
    Tallied { future, read }
}

impl<F: Future, T> Future for Tallied<F, T> {
    type Output = (F::Output, T);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let output = ready!(this.future.poll(cx));
        Poll::Ready((output, (this.read)()))
    }
}

/// Asserts that `wrap(inner)` is `inner` and a few words, not twice it (for the wrappers
/// built on [`tallied`]); `inner` is best [`four_kib`].
#[cfg(test)]
pub(crate) fn assert_wraps_in_place<F: Future, W>(what: &str, inner: F, wrap: impl FnOnce(F) -> W) {
    let inner_size = std::mem::size_of_val(&inner);
    let wrapped_size = std::mem::size_of_val(&wrap(inner));
    assert!(
        wrapped_size < inner_size + 64,
        "{what} of a {inner_size}-byte future is {wrapped_size} bytes"
    );
}

/// A future that holds 4 KiB across an await.
#[cfg(test)]
pub(crate) async fn four_kib() -> usize {
    let buffer = [0u8; 4096];
    tokio::task::yield_now().await;
    buffer.len()
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::tallied;

    tokio::task_local! {
        static COUNT: Cell<u32>;
    }

    fn add() {
        COUNT.with(|c| c.set(c.get() + 1));
    }

    #[tokio::test]
    async fn the_count_is_read_as_the_future_ends_inside_its_scope() {
        let (output, count) = COUNT
            .scope(
                Cell::new(0),
                tallied(
                    async {
                        add();
                        tokio::task::yield_now().await;
                        add();
                        "done"
                    },
                    || COUNT.with(Cell::get),
                ),
            )
            .await;
        assert_eq!((output, count), ("done", 2));
    }

    #[test]
    fn the_wrapper_costs_a_few_words_not_a_second_copy_of_the_future() {
        super::assert_wraps_in_place("tallied in a scope", super::four_kib(), |inner| {
            COUNT.scope(Cell::new(0), tallied(inner, || COUNT.with(Cell::get)))
        });
    }
}
