//! Tests that must not share what the others share. Every integration test is a module of one
//! test binary (`tests/it/main.rs`), so they all run in one process, two at a time whatever
//! module they come from: a test cannot count on a process, or a machine, of its own.
//!
//! - [`in_own_process`]: a test that measures this process (its resident memory) runs again
//!   in a process of its own, this binary filtered to that one test.
//! - [`heavy`]: tests that load the machine, or need it quiet, hold one lock, so no two of
//!   them overlap.

use std::process::Stdio;

use tokio::sync::{Mutex, MutexGuard};

/// Set, to the test's name, in the process [`in_own_process`] starts for that test.
const OWN_PROCESS: &str = "CG_TEST_OWN_PROCESS";

/// Held by each test that must not run beside another heavy one (see [`heavy`]).
static HEAVY: Mutex<()> = Mutex::const_new(());

/// The lock of the heavy tests: held for the whole test, it keeps the tests that take it from
/// overlapping one another (tests that do not take it still run beside them). A panicking
/// holder releases it like any other (a tokio mutex is not poisoned).
pub async fn heavy() -> MutexGuard<'static, ()> {
    HEAVY.lock().await
}

/// Runs the calling test again in a process of its own: this test binary, started with only
/// that test (`--exact`), its output printed here. For a test that measures this process
/// (its resident memory), which every test running beside it in this binary would move too.
///
/// Returns `true` in the calling process, once the test passed in the child (a failure there
/// panics here, with the child's status), and `false` in the child, where the caller then
/// runs the test's body. `module` is the test's `module_path!()`, `test` its function's name.
/// The calling process holds [`heavy`] while the child runs.
pub async fn in_own_process(module: &str, test: &str) -> bool {
    // `module_path!()` starts with the crate (`it::event_memory`); test names do not.
    let module = module.split_once("::").map_or("", |(_, rest)| rest);
    let name = if module.is_empty() {
        test.to_owned()
    } else {
        format!("{module}::{test}")
    };
    if std::env::var_os(OWN_PROCESS).is_some_and(|n| n == name.as_str()) {
        return false;
    }
    let _heavy = heavy().await;
    let exe = std::env::current_exe().expect("the path of this test binary");
    let out = tokio::process::Command::new(&exe)
        .args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(OWN_PROCESS, &name)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("start {} for {name}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "{name} failed in a process of its own ({})",
        out.status
    );
    // A name that matches no test would pass, having run nothing.
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "{name}: its own process ran no test"
    );
    true
}
