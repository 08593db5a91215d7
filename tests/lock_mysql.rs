//! Serialized writes on the MySQL/MariaDB lock service (`backend = "mysql"`), against a real
//! MariaDB (Debian's `mariadb-server`): the history checkers of `common::serialized`
//! (exclusion, fencing, nothing hangs) without faults, through a `kill -9` and restart of
//! MariaDB, and with the holder paused past its lease; MariaDB down per `on_redis_error`;
//! and a misconfigured lock service (bad password, unreachable, no lock table) named at
//! start. The lock's own behaviour (grants, renewal, loss, tokens across restarts,
//! concurrent takers, waiters without connections) is tested in `src/coord/locks/mysql.rs`.

mod common;

use std::time::Duration;

use common::history::Epoch;
use common::serialized::{self, Expect, FAULT_AT, LEASE};
use common::shop::{Shop, seat};
use common::{HttpClient, MariaDb, spawn_cacheguard_process};
use tokio::time::Instant;

fn lock(db: &MariaDb) -> Vec<(&'static str, String)> {
    vec![
        ("backend", "\"mysql\"".to_owned()),
        ("url", format!("{:?}", db.url())),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fault() {
    let db = MariaDb::start().await;
    let mut fx = serialized::start(&lock(&db), "reject").await;
    let verdict = serialized::run(&mut fx, serialized::no_faults).await;
    verdict.assert(Expect::default());
    assert_eq!(verdict.refused(), 0, "no write refused without a fault");
}

/// MariaDB `kill -9`ed while writes come, down for longer than the lease, then restarted:
/// writes are refused meanwhile (503 within the wait), and once it is back the fence
/// column (durable) keeps the tokens growing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_killed_and_restarted() {
    let mut db = MariaDb::start().await;
    let mut fx = serialized::start(&lock(&db), "reject").await;
    let verdict = serialized::run(&mut fx, async |n, _| {
        n.at(FAULT_AT).await;
        n.start("kill -9 mariadb");
        db.kill();
        n.at(FAULT_AT + 2 * LEASE).await;
        db.restart().await;
        n.heal("mariadb restarted");
    })
    .await;
    verdict.assert(Expect {
        outage: true,
        ..Expect::default()
    });
    assert!(
        verdict.refused() > 0,
        "no write was refused while MariaDB was down"
    );
}

/// The holder SIGSTOPped past its lease with its write on the way: another instance takes
/// the row with a larger fence, and the shop refuses the held write when it arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_paused_past_its_lease() {
    let db = MariaDb::start().await;
    let mut fx = serialized::start(&lock(&db), "reject").await;
    let verdict = serialized::run(&mut fx, serialized::pause_holder).await;
    verdict.assert(Expect {
        stale_write: true,
        ..Expect::default()
    });
}

/// MariaDB down: `reject` answers 503 at once and the shop sees nothing; `forward`
/// forwards every write, unserialized and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_down_rejects_or_forwards_as_configured() {
    let mut db = MariaDb::start().await;
    let lock = lock(&db);
    db.kill();
    serialized::assert_down_per_policy(&lock, Duration::from_secs(1)).await;
}

/// A lock service that cannot be used is named at start with what is wrong (a refused
/// login, a server that cannot be reached, a missing table the user may not create), the
/// instance still starts, and its writes are refused at once (`reject`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misconfigured_lock_service_is_named_at_start() {
    let db = MariaDb::start().await;
    db.root(&[
        "CREATE USER 'plain'@'%' IDENTIFIED BY 'pw'",
        "GRANT SELECT, INSERT, UPDATE ON locks.* TO 'plain'@'%'",
    ])
    .await;
    let closed = common::free_port();
    let cases = [
        (
            db.url_as(common::mariadb::USER, "wrong-password"),
            "login was refused",
        ),
        (
            format!("mysql://u:p@127.0.0.1:{closed}/locks"),
            "cannot be reached",
        ),
        (
            db.url_as("plain", "pw"),
            "is missing and this user may not create it",
        ),
    ];
    let shop = Shop::start(Epoch::now(), &[]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let client = HttpClient::new();
    for (i, (url, problem)) in cases.iter().enumerate() {
        let lock = vec![
            ("backend", "\"mysql\"".to_owned()),
            ("url", format!("{url:?}")),
        ];
        let path = serialized::config(&shop.url(), &lock, "reject")
            .on_free_ports()
            .write_to(&dir.path().join(format!("cg-{i}.toml")));
        let process = spawn_cacheguard_process(&path).await;
        let output = process.output();
        assert!(
            output.contains("Lock service not usable at start") && output.contains(problem),
            "{problem:?} not named:\n{output}"
        );
        assert!(
            !output.contains("wrong-password"),
            "a password in the log:\n{output}"
        );
        let started = Instant::now();
        let resp = common::put(&client, process.addr(), &seat("t1", "1A")).await;
        assert_eq!(resp.status.as_u16(), 503, "{resp:?}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }
    assert!(shop.write_log().writes.is_empty());
}
