//! The integration tests: one test binary, whose modules are the test files (`cargo test
//! --test it <module>::` runs one of them). One binary links the crate and its dependencies
//! once, where a binary per file linked them some fifty times.
//!
//! They share one process, and libtest runs them side by side (one per core) whatever their
//! module: a test that needs a process of its own, or must not overlap the other heavy ones,
//! says so ([`common::alone`]).

mod common;

mod access_log;
mod admin;
mod avalanche;
mod big_keys;
mod bloom;
mod breaker_load;
mod cache_tests;
mod cluster;
mod config_errors;
mod connections;
mod consistency;
mod credentials;
mod dashboards;
mod event_bus;
mod event_memory;
mod fill_memory;
mod flash_sale;
mod fuzz;
mod h2c;
mod hardening;
mod harness;
mod hot_key_memory;
mod hot_keys;
mod kv_origin;
mod l2_integrity;
mod l2_read_memory;
mod layers;
mod lifecycle;
mod limits;
mod lock_etcd;
mod lock_failover;
mod lock_mysql;
mod lock_redlock;
mod lock_zookeeper;
mod logs;
mod origin_mode;
mod origin_pool;
mod passthrough;
mod read_path;
mod redis_cost;
mod redis_outage;
mod redis_tls;
mod reload;
mod rfc9111;
mod security;
mod sentinel;
mod serialize;
mod serialize_faults;
mod shared_mode;
mod shipped_configs;
mod stale;
mod stampede;
mod status_page;
mod stock_gate;
mod uploads;
mod variant_keys;
mod version_floor;
mod worker_conns;

/// Every `.rs` file of `tests/it/` is a module of this binary (one that is not would never
/// be compiled, its tests never run), and `tests/` holds no other test file (each would be a
/// binary of its own, linking everything again).
#[test]
fn every_test_file_is_a_module_of_this_binary() {
    let tests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let rs_files = |dir: &std::path::Path| -> Vec<String> {
        let entries =
            std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
        let mut names: Vec<String> = entries
            .map(|e| {
                e.expect("a directory entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter_map(|name| name.strip_suffix(".rs").map(str::to_owned))
            .collect();
        names.sort();
        names
    };
    let outside = rs_files(&tests);
    assert!(
        outside.is_empty(),
        "tests/{{{}}}.rs: move them into tests/it/ as modules of this binary",
        outside.join(",")
    );
    let main = include_str!("main.rs");
    let missing: Vec<String> = rs_files(&tests.join("it"))
        .into_iter()
        .filter(|name| name != "main" && !main.lines().any(|l| l == format!("mod {name};")))
        .collect();
    assert!(
        missing.is_empty(),
        "tests/it/{{{}}}.rs: not a module; declare it in tests/it/main.rs",
        missing.join(",")
    );
}
