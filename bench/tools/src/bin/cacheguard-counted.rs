//! `cacheguard-counted`: the `cacheguard` binary with a counting allocator, to measure the
//! allocations of a workload (e.g. per cache hit: the count over a bounded load, net of an
//! idle window of the same length).
//!
//! The proxy is `src/main.rs` itself, compiled in as a module, so it runs exactly as the
//! shipped binary does (same flags, same runtime, same logging). The global allocator is
//! `stats_alloc`'s wrapper around the system allocator: atomic counters per call, no
//! `unsafe` here. With env `ALLOC_REPORT=PATH`, a thread writes every 200 ms one line
//! `<allocations> <bytes>` to PATH: cumulative since start, whole process; a reallocation
//! counts as an allocation and its growth as bytes. The line goes to a temporary file in the
//! same directory, renamed over PATH, so a reader sees a whole line or the previous one.

use std::alloc::System;
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[path = "../../../../src/main.rs"]
mod cacheguard_main;

/// How often the report is rewritten.
const REPORT_EVERY: Duration = Duration::from_millis(200);

fn main() -> ExitCode {
    if let Some(path) = std::env::var_os("ALLOC_REPORT") {
        let path = PathBuf::from(path);
        let mut tmp = OsString::from(path.as_os_str());
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let spawned = std::thread::Builder::new()
            .name("alloc-report".into())
            .spawn(move || report(&path, &tmp));
        if let Err(error) = spawned {
            eprintln!("cacheguard-counted: cannot start the report thread: {error}");
            return ExitCode::from(1);
        }
    }
    cacheguard_main::main()
}

/// Rewrites the report forever. The line is formatted into a buffer reused across rounds,
/// so the thread itself allocates as little as it can (its own share is in the idle window).
fn report(path: &PathBuf, tmp: &PathBuf) {
    let mut line = Vec::with_capacity(64);
    let mut warned = false;
    loop {
        let stats = GLOBAL.stats();
        line.clear();
        // Writing into a Vec cannot fail.
        let _ = writeln!(
            line,
            "{} {}",
            stats.allocations + stats.reallocations,
            stats.bytes_allocated
        );
        let written = std::fs::write(tmp, &line).and_then(|()| std::fs::rename(tmp, path));
        if let Err(error) = written
            && !warned
        {
            eprintln!(
                "cacheguard-counted: cannot write {}: {error}",
                path.display()
            );
            warned = true;
        }
        std::thread::sleep(REPORT_EVERY);
    }
}
