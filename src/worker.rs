//! Which proxy worker thread the caller runs on. Per-thread state (the hot-key sketches,
//! the origin connection pools) is sharded by it, so a request never contends with another
//! worker's requests for a lock, nor sends on a connection another worker's event loop
//! drives. The accept loop (`proxy/server.rs`) numbers its workers; everything else reads.

use std::cell::Cell;

thread_local! {
    /// 1 + the index of the proxy worker thread this is, 0 elsewhere.
    static WORKER_INDEX: Cell<usize> = const { Cell::new(0) };
}

/// 1 + the index of the proxy worker thread this is, 0 on any other thread.
pub(crate) fn index() -> usize {
    WORKER_INDEX.get()
}

/// Marks the current thread as proxy worker `index` (from 0).
pub(crate) fn set_index(index: usize) {
    WORKER_INDEX.set(index + 1);
}
