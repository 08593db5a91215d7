//! Serialized writes on the Redlock lock service (`backend = "redlock"`) over independent
//! real Redis masters (`redis-server` processes): the history checkers of
//! `common::serialized` (exclusion, fencing, nothing hangs) without faults, through a
//! `kill -9` and empty restart of one master, with a minority of five masters down (grants
//! go on), with a majority down (writes refused within the wait, then served again), and
//! with the holder paused past its lease; a majority down per `on_redis_error`; masters
//! unreachable at start, or refusing the login, named in the log. The lock's own behaviour (validity, majority,
//! tokens across empty restarts) is tested in `src/coord/locks/redlock.rs`.

mod common;

use std::time::Duration;

use common::history::Epoch;
use common::serialized::{self, Expect, FAULT_AT, LEASE};
use common::shop::{Shop, seat};
use common::{HttpClient, RedisServer, spawn_cacheguard_process};

async fn masters(n: usize) -> Vec<RedisServer> {
    let mut servers = Vec::new();
    for _ in 0..n {
        servers.push(RedisServer::start().await);
    }
    servers
}

fn lock(masters: &[RedisServer]) -> Vec<(&'static str, String)> {
    let urls: Vec<String> = masters.iter().map(|m| format!("{:?}", m.url())).collect();
    vec![
        ("backend", "\"redlock\"".to_owned()),
        ("urls", format!("[{}]", urls.join(", "))),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fault() {
    let servers = masters(3).await;
    let mut fx = serialized::start(&lock(&servers), "reject").await;
    let verdict = serialized::run(&mut fx, serialized::no_faults).await;
    verdict.assert(Expect::default());
    assert_eq!(verdict.refused(), 0, "no write refused without a fault");
}

/// One of three masters `kill -9`ed and restarted empty: the other two are a majority
/// all along, and its lost counter is made up by the others' and its clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_master_killed_and_restarted_empty() {
    let mut servers = masters(3).await;
    let mut fx = serialized::start(&lock(&servers), "reject").await;
    let verdict = serialized::run(&mut fx, async |n, _| {
        n.at(FAULT_AT).await;
        n.start("kill -9 master 0");
        servers[0].kill();
        n.at(FAULT_AT + LEASE).await;
        servers[0].restart().await;
        n.heal("master 0 restarted empty");
    })
    .await;
    verdict.assert(Expect::default());
    assert_eq!(verdict.refused(), 0, "a majority answered all along");
}

/// Two of five masters down for two leases: grants go on (the run asserts no write
/// refused and exclusion), and writes are accepted while they are down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minority_down() {
    let mut servers = masters(5).await;
    let mut fx = serialized::start(&lock(&servers), "reject").await;
    let mut window = (Duration::ZERO, Duration::ZERO);
    let epoch = fx.shop.epoch();
    let verdict = serialized::run(&mut fx, async |n, _| {
        n.at(FAULT_AT).await;
        n.start("kill -9 masters 0 and 1 of 5");
        window.0 = epoch.elapsed();
        servers[0].kill();
        servers[1].kill();
        n.at(FAULT_AT + 2 * LEASE).await;
        window.1 = epoch.elapsed();
        servers[0].restart().await;
        servers[1].restart().await;
        n.heal("masters 0 and 1 restarted empty");
    })
    .await;
    verdict.assert(Expect::default());
    assert_eq!(verdict.refused(), 0, "a majority answered all along");
    let during = verdict
        .log
        .writes
        .iter()
        .filter(|w| w.accepted && w.start > window.0 && w.end < window.1)
        .count();
    assert!(
        during > 0,
        "no write was accepted while the minority was down"
    );
}

/// Two of three masters down for two leases: writes are refused (503, within the wait:
/// the run asserts nothing hangs), and served again once they are back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn majority_down() {
    let mut servers = masters(3).await;
    let mut fx = serialized::start(&lock(&servers), "reject").await;
    let verdict = serialized::run(&mut fx, async |n, _| {
        n.at(FAULT_AT).await;
        n.start("kill -9 masters 0 and 1 of 3");
        servers[0].kill();
        servers[1].kill();
        n.at(FAULT_AT + 2 * LEASE).await;
        servers[0].restart().await;
        servers[1].restart().await;
        n.heal("masters 0 and 1 restarted empty");
    })
    .await;
    verdict.assert(Expect {
        outage: true,
        ..Expect::default()
    });
    assert!(
        verdict.refused() > 0,
        "no write was refused while a majority was down"
    );
}

/// The holder SIGSTOPped past its lease with its write on the way: another instance gets
/// a majority with a larger token, and the shop refuses the held write when it arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_paused_past_its_lease() {
    let servers = masters(3).await;
    let mut fx = serialized::start(&lock(&servers), "reject").await;
    let verdict = serialized::run(&mut fx, serialized::pause_holder).await;
    verdict.assert(Expect {
        stale_write: true,
        ..Expect::default()
    });
}

/// A majority down: `reject` answers 503 at once and the shop sees nothing; `forward`
/// forwards every write, unserialized and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn majority_down_rejects_or_forwards_as_configured() {
    let mut servers = masters(3).await;
    let lock = lock(&servers);
    servers[0].kill();
    servers[1].kill();
    serialized::assert_down_per_policy(&lock, Duration::from_millis(500)).await;
}

/// Masters that do not answer at start are named: a minority as a warning (grants go
/// on), a majority as an error (writes refused until they answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masters_down_at_start_are_named() {
    let mut servers = masters(3).await;
    let shop = Shop::start(Epoch::now(), &[]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let client = HttpClient::new();
    servers[0].kill();
    let path = serialized::config(&shop.url(), &lock(&servers), "reject")
        .on_free_ports()
        .write_to(&dir.path().join("minority.toml"));
    let process = spawn_cacheguard_process(&path).await;
    let output = process.output();
    assert!(
        output.contains("Some Redlock masters cannot be used at start")
            && output.contains(&format!("127.0.0.1:{}", servers[0].port())),
        "{output}"
    );
    let resp = common::put(&client, process.addr(), &seat("t1", "1A")).await;
    assert_eq!(resp.status.as_u16(), 200, "{resp:?}");
    servers[1].kill();
    let path = serialized::config(&shop.url(), &lock(&servers), "reject")
        .on_free_ports()
        .write_to(&dir.path().join("majority.toml"));
    let process = spawn_cacheguard_process(&path).await;
    let output = process.output();
    assert!(
        output.contains("fewer than a majority of its Redis masters can be used"),
        "{output}"
    );
    let resp = common::put(&client, process.addr(), &seat("t1", "1A")).await;
    assert_eq!(resp.status.as_u16(), 503, "{resp:?}");
}

/// Masters that refuse the login (no password given, or a wrong one) are named as such at
/// start, not as ready nor as silent, and the writes are refused at once (`reject`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_login_is_named_at_start() {
    let servers = masters(3).await;
    for server in &servers {
        let mut conn = server.client().await;
        let () = redis::cmd("CONFIG")
            .arg(&["SET", "requirepass", "right-secret"])
            .query_async(&mut conn)
            .await
            .expect("CONFIG SET requirepass");
    }
    let shop = Shop::start(Epoch::now(), &[]).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let client = HttpClient::new();
    let without: Vec<String> = servers.iter().map(RedisServer::url).collect();
    let wrong: Vec<String> = servers
        .iter()
        .map(|m| format!("redis://:wrong-secret@127.0.0.1:{}", m.port()))
        .collect();
    for (i, urls) in [without, wrong].iter().enumerate() {
        let quoted: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
        let lock = vec![
            ("backend", "\"redlock\"".to_owned()),
            ("urls", format!("[{}]", quoted.join(", "))),
        ];
        let path = serialized::config(&shop.url(), &lock, "reject")
            .on_free_ports()
            .write_to(&dir.path().join(format!("cg-{i}.toml")));
        let process = spawn_cacheguard_process(&path).await;
        let output = process.output();
        assert!(
            output.contains("Lock service not usable at start")
                && output.contains("login was refused")
                && output.contains(&format!("127.0.0.1:{}", servers[2].port())),
            "the refused login is not named:\n{output}"
        );
        assert!(
            !output.contains("wrong-secret"),
            "a password in the log:\n{output}"
        );
        let started = tokio::time::Instant::now();
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
