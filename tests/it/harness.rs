//! Self-checks of the test harness, without cacheguard in between: they prove that the
//! fixtures observe what the other tests rely on (so those tests can fail), e.g. that the
//! origin records hop-by-hop and spoofed headers when they do reach it.

use std::time::Duration;

use bytes::Bytes;
use http::Method;
use tokio::time::Instant;

use crate::common;
use crate::common::client::channel_body;
use crate::common::{
    HOP_REQUEST, HOP_RESPONSE, HttpClient, RedisServer, TestOrigin, concurrently, default_body,
    hop_names, poll_until, post_hop, serve_hop,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_counts_serials_and_records_requests() {
    let origin = TestOrigin::start().await;
    let client = HttpClient::new();
    let u = format!("{}/x?a=1", origin.url());
    for n in 1..=3 {
        let r = client
            .get_with_headers(&u, &[("x-forwarded-for", "6.6.6.6")])
            .await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, default_body("/x", n));
    }
    assert_eq!(origin.count("/x"), 3);
    assert_eq!(origin.count("/y"), 0);
    assert_eq!(origin.total(), 3);
    let seen = origin.last_request("/x").expect("recorded");
    assert_eq!(seen.uri.to_string(), "/x?a=1");
    assert_eq!(seen.header("x-forwarded-for").as_deref(), Some("6.6.6.6"));
    assert!(seen.peer.ip().is_loopback());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_behaviour_is_configurable_per_path() {
    let origin = TestOrigin::start().await;
    origin.set_status("/p", 404);
    origin.set_body("/p", "nope");
    origin.set_headers("/p", [("set-cookie", "a=1"), ("cache-control", "private")]);
    origin.set_ids(["1", "2", "3"]);
    let client = HttpClient::new();
    let r = client.get(&format!("{}/p", origin.url())).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.text(), "nope");
    assert_eq!(r.header("set-cookie").as_deref(), Some("a=1"));
    assert_eq!(r.header("cache-control").as_deref(), Some("private"));
    let ids = client.get(&format!("{}/internal/ids", origin.url())).await;
    assert_eq!(ids.text(), "1\n2\n3");
    origin.reset("/p");
    let r = client.get(&format!("{}/p", origin.url())).await;
    assert_eq!(r.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_tracks_max_in_flight() {
    let origin = TestOrigin::builder()
        .delay(Duration::from_millis(200))
        .start()
        .await;
    let client = HttpClient::new();
    let base = origin.url();
    concurrently(10, Duration::from_secs(10), |i| {
        let client = client.clone();
        let u = format!("{base}/k{i}");
        async move { client.get(&u).await.status }
    })
    .await;
    assert_eq!(origin.max_in_flight(), 10);
    assert_eq!(origin.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_request_delivers_hop_by_hop_headers_both_ways() {
    let origin = TestOrigin::start().await;
    serve_hop(&origin, &[]);
    let r = post_hop(origin.addr(), &[]).await;
    assert_eq!(r.body, "hello");
    let seen = origin.last_request("/hop").expect("seen");
    for name in hop_names(&HOP_REQUEST) {
        assert!(seen.header(name).is_some(), "{name} not delivered directly");
    }
    for name in hop_names(&HOP_RESPONSE) {
        assert!(r.header(name).is_some(), "{name} not received directly");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_sees_streamed_body_progressively() {
    let origin = TestOrigin::start().await;
    origin.set_echo("/s");
    let client = HttpClient::new();
    let (tx, body) = channel_body();
    let u = format!("{}/s", origin.url());
    let req = tokio::spawn(async move { client.request(Method::PUT, &u, &[], body).await });
    tx.send(Bytes::from_static(b"first")).await.expect("send");
    let seen = poll_until(
        Duration::from_secs(3),
        Duration::from_millis(10),
        || async { (origin.body_bytes_received("/s") == 5).then_some(()) },
    )
    .await;
    assert!(seen.is_some(), "first chunk not observed");
    tx.send(Bytes::from_static(b"second")).await.expect("send");
    drop(tx);
    let r = req.await.expect("task").expect("PUT");
    assert_eq!(r.body, "firstsecond");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_server_kill_pause_and_restart() {
    let mut redis = RedisServer::start().await;
    let mut con = redis.client().await;
    let _: () = redis::cmd("SET")
        .arg("cg:{abc}:v")
        .arg("x")
        .query_async(&mut con)
        .await
        .expect("SET");
    assert_eq!(redis.entry_keys().await.len(), 1);

    redis.pause();
    let started = Instant::now();
    let ping = tokio::time::timeout(
        Duration::from_millis(300),
        redis::cmd("PING").query_async::<String>(&mut con),
    )
    .await;
    assert!(ping.is_err(), "a paused redis-server answered: {ping:?}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    redis.resume();

    redis.kill();
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", redis.port()))
            .await
            .is_err(),
        "killed redis-server still accepts connections"
    );
    redis.restart().await;
    assert!(
        redis.entry_keys().await.is_empty(),
        "restarted redis is not empty"
    );
}

/// The cluster fixture (for the scale-out work): six real nodes form a cluster with three
/// primaries, each serving a third of the slots; a key's owner can be found; a killed
/// primary's replica is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_fixture_forms_and_fails_over() {
    let mut cluster = common::RedisCluster::start().await;
    assert_eq!(cluster.ports().len(), 6);
    let primaries = cluster.primaries().await;
    assert_eq!(primaries.len(), 3, "{}", cluster.nodes(primaries[0]).await);
    let mut owners = std::collections::HashSet::new();
    for k in 0..64 {
        let owner = cluster
            .owner_of(&format!("cg:{{{k:032x}}}:v"))
            .await
            .expect("every slot has an owner");
        assert!(primaries.contains(&owner));
        owners.insert(owner);
    }
    assert_eq!(
        owners.len(),
        3,
        "64 hash tags spread over all three primaries"
    );

    let victim = primaries[0];
    cluster.kill(victim);
    let survivor = primaries[1];
    let promoted = poll_until(Duration::from_secs(20), Duration::from_millis(200), || {
        let cluster = &cluster;
        async move {
            let info = cluster.info(survivor).await;
            (info.contains("cluster_state:ok") && cluster.primaries().await.len() == 3)
                .then_some(())
        }
    })
    .await;
    assert!(
        promoted.is_some(),
        "no replica took over from {victim}:\n{}\n{}",
        cluster.info(survivor).await,
        cluster.nodes(survivor).await
    );
}

// === the history checkers, on hand-made histories ===

mod checkers {
    use std::time::Duration;

    use super::common::history::{
        History, NemesisEvent, Op, Phase, Sale, SaleLog, StockRecord, WriteLog, WriteRecord,
        check_available, check_exclusion, check_fencing, check_oversell, check_phantom,
        check_undersell, check_version_floor, flood_factor,
    };

    const SEAT: &str = "/trains/t1/seats/a";

    fn sale(order: &str, key: &str, committed_ms: u64) -> Sale {
        Sale {
            order: order.to_string(),
            resource: SEAT.to_string(),
            units: 1,
            idempotency_key: Some(key.to_string()),
            reservation: Some(format!("r-{key}")),
            received: Duration::from_millis(committed_ms.saturating_sub(5)),
            committed: Duration::from_millis(committed_ms),
        }
    }

    /// A log of `supplied` units, the given sales, `buy_requests` requests.
    fn log(supplied: u64, sales: Vec<Sale>, buy_requests: u64) -> SaleLog {
        let sold: u64 = sales.iter().map(|s| s.units).sum();
        let mut log = SaleLog::default();
        log.resources.insert(
            SEAT.to_string(),
            StockRecord {
                supplied,
                remaining: supplied.saturating_sub(sold),
                buy_requests,
                replays: 0,
            },
        );
        log.sales = sales;
        log
    }

    fn buy(process: usize, key: &str) -> Op {
        Op::new(process, "buy", SEAT, key)
    }

    #[test]
    fn availability_counts_the_servers_own_503_only() {
        const MARKER: &str = "stock gate unavailable";
        let history = History::of(vec![
            buy(0, "a").span(0, 10).status(201),
            buy(1, "b").span(0, 10).status(409),
            // The origin's own 503 and a client timeout are not the gate's refusal.
            buy(2, "c")
                .span(0, 10)
                .status(503)
                .body("origin overloaded"),
            buy(3, "d")
                .span(0, 10)
                .error("timed out after 2s (client bound)"),
        ]);
        let report = check_available(&history, "buy", MARKER);
        assert!(report.ok(), "{report}");
        assert_eq!(report.answered, 3);

        let mut ops = history.ops.clone();
        ops.push(buy(4, "e").span(5, 6).status(503).body(MARKER));
        let report = check_available(&History::of(ops), "buy", MARKER);
        assert!(!report.ok());
        assert_eq!(report.unavailable.len(), 1);
        assert!(report.to_string().contains("1 of 4 answers"), "{report}");
    }

    #[test]
    fn oversell_passes_at_the_supply_and_fails_past_it() {
        let at_supply = check_oversell(&log(2, vec![sale("o1", "a", 10), sale("o2", "b", 20)], 2));
        assert!(at_supply.ok(), "{at_supply}");
        assert_eq!(at_supply.oversold(), 0);

        let over = log(
            2,
            vec![
                sale("o1", "a", 10),
                sale("o2", "b", 20),
                sale("o3", "c", 30),
            ],
            3,
        );
        let report = check_oversell(&over);
        assert!(!report.ok());
        assert_eq!(report.oversold(), 1);
        assert_eq!(report.resources[0].over.len(), 1);
        assert_eq!(
            report.resources[0].over[0].order, "o3",
            "the sale past the supply"
        );
        let text = report.to_string();
        assert!(
            text.contains("oversell: 1 units") && text.contains("order o3"),
            "{text}"
        );
    }

    #[test]
    fn oversell_flags_a_count_that_disagrees_with_the_sales() {
        let mut bad = log(3, vec![sale("o1", "a", 10)], 1);
        bad.resources.get_mut(SEAT).expect("seat").remaining = 0;
        let report = check_oversell(&bad);
        assert!(!report.ok(), "{report}");
        assert!(report.to_string().contains("disagrees"), "{report}");
    }

    #[test]
    fn phantom_passes_sold_orders_and_replays_of_sold_keys() {
        let log = log(5, vec![sale("o1", "k1", 10), sale("o2", "k2", 20)], 3);
        let history = History::of(vec![
            buy(0, "k1")
                .span(0, 12)
                .status(201)
                .body(r#"{"order":"o1"}"#),
            // A replay of a key the origin sold: backed, with or without a body.
            buy(1, "k2")
                .span(30, 31)
                .status(201)
                .header("Idempotent-Replayed", "true"),
            buy(2, "k2")
                .span(32, 33)
                .status(201)
                .header("Idempotent-Replayed", "true")
                .body(r#"{"order":"o2"}"#),
            // Refusals and unknowns are not successes.
            buy(3, "k3").span(0, 5).status(409),
            buy(4, "k4").span(0, 1000).error("timed out"),
        ]);
        let report = check_phantom(&history, &log, "buy");
        assert!(report.ok(), "{report}");
        assert_eq!((report.successes, report.replays), (3, 2));
    }

    #[test]
    fn phantom_catches_successes_the_origin_never_sold() {
        let log = log(5, vec![sale("o1", "k1", 10)], 3);
        let history = History::of(vec![
            // An order id the origin never issued.
            buy(0, "k9")
                .span(0, 5)
                .status(201)
                .body(r#"{"order":"o9"}"#),
            // A real order, answered to another key.
            buy(1, "k2")
                .span(0, 5)
                .status(201)
                .body(r#"{"order":"o1"}"#),
            // A replay of a key the origin never sold.
            buy(2, "k3")
                .span(0, 5)
                .status(200)
                .header("idempotent-replayed", "true"),
            // A success made up without any order.
            buy(3, "k4").span(0, 5).status(201).body("{}"),
        ]);
        let report = check_phantom(&history, &log, "buy");
        assert_eq!(report.phantoms.len(), 4, "{report}");
        let text = report.to_string();
        for needle in [
            "order o9 is not in the origin's sales",
            "sold to key",
            "without an order id",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
        }
    }

    #[test]
    fn undersell_needs_units_left_and_buyers_turned_away_in_the_window() {
        let window = Duration::from_millis(1000);
        // Sold out at the end, buyers turned away: fine.
        let sold_out = log(1, vec![sale("o1", "k1", 10)], 5);
        let history = History::of(vec![
            buy(0, "k1")
                .span(0, 10)
                .status(201)
                .body(r#"{"order":"o1"}"#),
            buy(1, "k2").span(1500, 1501).status(409),
        ]);
        assert!(check_undersell(&history, &sold_out, "buy", window).ok());

        // Units left, but the turned-away buy was before the window (the fault's time).
        let left = log(3, vec![sale("o1", "k1", 10)], 5);
        let early = History::of(vec![buy(1, "k2").span(500, 501).status(409)]);
        let report = check_undersell(&early, &left, "buy", window);
        assert!(report.ok(), "{report}");

        // Units left and buyers told "sold out" after the window started: undersold. A 503
        // (come back later) is unavailability, counted apart.
        let late = History::of(vec![
            buy(1, "k2").span(1200, 1201).status(409),
            buy(2, "k3").span(1300, 1301).status(503),
            buy(3, "k4")
                .span(1400, 1401)
                .status(201)
                .body(r#"{"order":"o1"}"#),
        ]);
        let report = check_undersell(&late, &left, "buy", window);
        assert!(!report.ok());
        let r = report.undersold()[0];
        assert_eq!(
            (r.remaining, r.attempts, r.refused, r.unavailable),
            (2, 3, 1, 1)
        );
        assert!(report.to_string().contains("2 left"), "{report}");
        let unavailable_only = History::of(vec![buy(2, "k3").span(1300, 1301).status(503)]);
        assert!(check_undersell(&unavailable_only, &left, "buy", window).ok());
    }

    #[test]
    fn flood_factor_is_requests_per_unit_sold() {
        let gated = flood_factor(&log(2, vec![sale("o1", "a", 1), sale("o2", "b", 2)], 2));
        assert!((gated.factor() - 1.0).abs() < 1e-9, "{gated}");
        let flooded = flood_factor(&log(2, vec![sale("o1", "a", 1), sale("o2", "b", 2)], 50));
        assert!((flooded.factor() - 25.0).abs() < 1e-9, "{flooded}");
        assert!(flooded.to_string().contains("50 buy requests"), "{flooded}");
        assert!(flood_factor(&log(2, vec![], 7)).factor().is_infinite());
        assert_eq!(flood_factor(&log(2, vec![], 0)).factor(), 0.0);
    }

    fn write(
        seq: u64,
        resource: &str,
        token: Option<u64>,
        span: (u64, u64),
        ok: bool,
    ) -> WriteRecord {
        WriteRecord {
            seq,
            resource: resource.to_string(),
            token,
            fencing_key: Some(format!("fk-{resource}")),
            start: Duration::from_millis(span.0),
            end: Duration::from_millis(span.1),
            status: if ok { 200 } else { 409 },
            accepted: ok,
        }
    }

    #[test]
    fn exclusion_passes_back_to_back_writes_and_reports_overlaps() {
        let serial = WriteLog {
            writes: vec![
                write(0, "/s/1", Some(1), (0, 10), true),
                write(1, "/s/1", Some(2), (10, 20), true), // touching ends: no overlap
                write(2, "/s/2", Some(1), (5, 15), true),  // another resource
            ],
        };
        let report = check_exclusion(&serial);
        assert!(report.ok(), "{report}");

        let racing = WriteLog {
            writes: vec![
                write(0, "/s/1", Some(1), (0, 100), true),
                write(1, "/s/1", Some(2), (20, 30), true),
                write(2, "/s/1", Some(1), (50, 60), false),
                write(3, "/s/1", Some(3), (200, 210), true),
            ],
        };
        let report = check_exclusion(&racing);
        assert_eq!(report.overlaps.len(), 2, "{report}");
        assert_eq!(report.overlaps_accepted(), 1, "{report}");
        assert!(report.to_string().contains("overlaps write #1"), "{report}");
    }

    #[test]
    fn fencing_passes_rising_tokens_and_right_refusals() {
        let log = WriteLog {
            writes: vec![
                write(0, "/s/1", Some(5), (0, 1), true),
                write(1, "/s/1", Some(5), (2, 3), true), // the same holder again
                write(2, "/s/1", Some(3), (4, 5), false), // stale, refused
                write(3, "/s/1", Some(9), (6, 7), true),
                write(4, "/s/2", Some(1), (0, 1), true), // tokens are per resource
            ],
        };
        let report = check_fencing(&log);
        assert!(report.ok(), "{report}");
        assert_eq!(
            (report.accepted, report.refused, report.stale_refused),
            (4, 1, 1)
        );
    }

    #[test]
    fn fencing_catches_decreases_wrong_refusals_and_missing_tokens() {
        let log = WriteLog {
            writes: vec![
                write(0, "/s/1", Some(5), (0, 1), true),
                write(1, "/s/1", Some(4), (2, 3), true), // accepted although stale
                write(2, "/s/1", Some(7), (4, 5), false), // refused although newest
                write(3, "/s/1", None, (6, 7), true),
            ],
        };
        let report = check_fencing(&log);
        assert!(!report.ok());
        assert_eq!(report.decreases.len(), 1, "{report}");
        assert_eq!(report.decreases[0].1.seq, 1);
        assert_eq!(report.wrongly_refused.len(), 1, "{report}");
        assert_eq!(report.missing_token.len(), 1, "{report}");
        assert!(report.to_string().contains("1 token decreases"), "{report}");
    }

    /// Client `p`'s `f` ("write", "read") of `resource` over `[start, end]` ms, answered
    /// 200 with `x-row-version: version` (none when `None`).
    fn versioned(p: usize, f: &str, resource: &str, span: (u64, u64), version: Option<u64>) -> Op {
        let op = Op::new(p, f, resource, "").span(span.0, span.1).status(200);
        match version {
            Some(v) => op.header("x-row-version", &v.to_string()),
            None => op,
        }
    }

    #[test]
    fn version_floor_passes_reads_at_or_after_the_clients_own_writes() {
        let history = History::of(vec![
            versioned(0, "write", SEAT, (0, 10), Some(1)),
            versioned(0, "read", SEAT, (20, 30), Some(1)),
            versioned(0, "write", SEAT, (40, 50), Some(2)),
            versioned(0, "read", SEAT, (60, 70), Some(3)), // someone else wrote since
            versioned(0, "read", "/other", (60, 70), Some(0)), // per resource
            // Began before client 0's write completed: concurrent, either version will do.
            versioned(1, "read", SEAT, (45, 80), Some(1)),
            // Client 2's write timed out: it did not see it complete.
            versioned(2, "write", SEAT, (0, 10), Some(9)).error("timed out"),
            versioned(2, "read", SEAT, (20, 30), Some(1)),
        ]);
        let report = check_version_floor(&history, "write", "read", "x-row-version");
        assert!(report.ok(), "{report}");
        assert!(report.behind_any.is_empty(), "{report}");
        assert_eq!((report.writes, report.reads), (2, 5), "{report}");
    }

    #[test]
    fn version_floor_catches_stale_reads_and_answers_without_a_version() {
        let history = History::of(vec![
            versioned(0, "write", SEAT, (0, 10), Some(1)),
            versioned(0, "write", SEAT, (20, 30), Some(2)),
            versioned(0, "read", SEAT, (40, 50), Some(1)), // its own write was 2
            // Another client, after client 0's write of 2 completed: behind it.
            versioned(1, "read", SEAT, (35, 45), Some(1)),
            versioned(1, "read", SEAT, (50, 60), None),
        ]);
        let report = check_version_floor(&history, "write", "read", "x-row-version");
        assert!(!report.ok());
        assert_eq!(report.stale.len(), 1, "{report}");
        assert_eq!(
            (report.stale[0].written, report.stale[0].seen),
            (2, 1),
            "{report}"
        );
        assert_eq!(report.behind_any.len(), 2, "{report}");
        assert_eq!(report.unversioned.len(), 1, "{report}");
        assert!(report.to_string().contains("1 stale reads"), "{report}");
    }

    /// The reads behind a completed write split by a fault's windows: a write (or a read)
    /// under way while its fault ran is excused, one wholly outside is judged.
    #[test]
    fn version_floor_splits_what_a_fault_window_excuses() {
        let mut history = History::of(vec![
            versioned(0, "write", SEAT, (0, 10), Some(1)),
            versioned(0, "write", SEAT, (100, 110), Some(2)), // in flight during the fault
            versioned(1, "read", SEAT, (120, 130), Some(1)),
            versioned(0, "write", SEAT, (200, 210), Some(3)), // after it
            versioned(1, "read", SEAT, (220, 230), Some(2)),
        ]);
        let at = Duration::from_millis;
        history.nemesis = vec![
            NemesisEvent {
                time: at(105),
                phase: Phase::Start,
                what: "#0 redis down".into(),
            },
            NemesisEvent {
                time: at(150),
                phase: Phase::Heal,
                what: "#0 redis down".into(),
            },
            NemesisEvent {
                time: at(300),
                phase: Phase::Start,
                what: "#1 redis down".into(),
            },
        ];
        let windows = history.fault_windows("#0 redis down");
        assert_eq!(windows, [(at(105), at(150))]);
        assert_eq!(
            history.fault_windows("#1 redis down"),
            [(at(300), Duration::MAX)],
            "never healed: to the end"
        );
        let report = check_version_floor(&history, "write", "read", "x-row-version");
        assert_eq!(report.behind_any.len(), 2, "{report}");
        let (excused, judged) = report.behind_any_split(|stale| stale.write.overlaps(&windows));
        assert_eq!(excused.len(), 1, "{report}");
        assert_eq!((excused[0].written, excused[0].seen), (2, 1));
        assert_eq!(judged.len(), 1, "{report}");
        assert_eq!((judged[0].written, judged[0].seen), (3, 2));
    }
}

// === the flash-sale shop, the runner and the nemesis tools ===

mod shop {
    use std::time::Duration;

    use http::Method;

    use super::common::history::{
        Epoch, check_oversell, check_phantom, check_undersell, flood_factor,
    };
    use super::common::jepsen::{self, RunConfig};
    use super::common::shop::{Fault, Scope, Shop, buy_request, orders_path, seat};
    use super::common::{HttpClient, client::full_body};

    async fn post(client: &HttpClient, url: &str, key: &str) -> super::common::Resp {
        client
            .request(
                Method::POST,
                url,
                &[("idempotency-key", key), ("stock-reservation", "rsv-1")],
                full_body(r#"{"units":1}"#),
            )
            .await
            .expect("POST to the shop")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shop_sells_conditionally_once_per_key_and_logs_every_sale() {
        let a = seat("t1", "a");
        let shop = Shop::start(Epoch::now(), &[(a.clone(), 2)]).await;
        let client = HttpClient::new();
        let buy = format!("{}{}", shop.url(), orders_path(&a));
        let first = post(&client, &buy, "k1").await;
        assert_eq!(first.status, 201, "{first}");
        assert_eq!(first.text(), r#"{"order":"o1"}"#);
        let again = post(&client, &buy, "k1").await;
        assert_eq!(
            (again.status.as_u16(), again.text()),
            (201, first.text()),
            "a replay"
        );
        assert_eq!(post(&client, &buy, "k2").await.status, 201);
        let out = post(&client, &buy, "k3").await;
        assert_eq!(out.status, 409, "{out}");
        assert_eq!(
            out.header("content-type").as_deref(),
            Some("application/problem+json")
        );
        let stock = client
            .get(&format!("{}/internal/stock/t1/a", shop.url()))
            .await;
        assert_eq!(stock.text(), r#"{"remaining":0}"#);
        let unknown = post(
            &client,
            &format!("{}/trains/t9/seats/z/orders", shop.url()),
            "k4",
        )
        .await;
        assert_eq!(unknown.status, 404);

        let log = shop.sale_log();
        assert_eq!(log.sales.len(), 2);
        assert_eq!(log.sales[0].idempotency_key.as_deref(), Some("k1"));
        assert_eq!(log.sales[0].reservation.as_deref(), Some("rsv-1"));
        assert!(log.sales[0].received <= log.sales[0].committed);
        let record = &log.resources[&a];
        assert_eq!(
            (record.buy_requests, record.replays, record.remaining),
            (4, 1, 0)
        );
        assert!(check_oversell(&log).ok());
        assert!((flood_factor(&log).factor() - 2.0).abs() < 1e-9);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shop_faults_hang_fail_and_commit_in_doubt() {
        let a = seat("t1", "a");
        let shop = Shop::start(Epoch::now(), &[(a.clone(), 10)]).await;
        let client = HttpClient::new();
        let buy = format!("{}{}", shop.url(), orders_path(&a));

        shop.set_fault(Scope::Buys, Fault::Status(503));
        assert_eq!(post(&client, &buy, "k1").await.status, 503);
        assert_eq!(shop.remaining(&a), Some(10), "a 5xx fault sells nothing");

        // Commit, then hang: the client times out on a sale that happened.
        shop.set_fault(Scope::Buys, Fault::CommitThenHang);
        let timed_out =
            tokio::time::timeout(Duration::from_millis(300), post(&client, &buy, "k2")).await;
        assert!(timed_out.is_err(), "the answer was held");
        assert_eq!(shop.remaining(&a), Some(9), "the sale was committed");
        assert_eq!(shop.in_flight(), 1);

        // A hang before the work: nothing sold until released, even after the client left.
        shop.set_fault(Scope::Buys, Fault::Hang);
        let gone =
            tokio::time::timeout(Duration::from_millis(300), post(&client, &buy, "k3")).await;
        assert!(gone.is_err());
        assert_eq!(shop.remaining(&a), Some(9));
        shop.heal();
        assert!(
            shop.wait_idle(Duration::from_secs(2)).await,
            "released requests finish"
        );
        assert_eq!(
            shop.remaining(&a),
            Some(8),
            "the released buy went on, its client gone"
        );

        // Latency per path, the stock endpoint unaffected.
        shop.set_latency(Scope::Path(orders_path(&a)), Duration::from_millis(200));
        let started = tokio::time::Instant::now();
        assert_eq!(post(&client, &buy, "k4").await.status, 201);
        assert!(started.elapsed() >= Duration::from_millis(200));
        let started = tokio::time::Instant::now();
        client
            .get(&format!("{}/internal/stock/t1/a", shop.url()))
            .await;
        assert!(started.elapsed() < Duration::from_millis(200));

        shop.set_fault(Scope::Buys, Fault::CommitThenStatus(502));
        shop.set_latency(Scope::All, Duration::ZERO);
        assert_eq!(post(&client, &buy, "k5").await.status, 502);
        assert_eq!(shop.remaining(&a), Some(6), "committed, then answered 502");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shop_fencing_mode_refuses_stale_tokens() {
        let shop = Shop::start(Epoch::now(), &[]).await;
        let client = HttpClient::new();
        let put = |token: Option<&'static str>| {
            let client = client.clone();
            let url = format!("{}/trains/t1/seats/12A", shop.url());
            async move {
                let headers: Vec<(&str, &str)> =
                    token.map(|t| ("fencing-token", t)).into_iter().collect();
                client
                    .request(Method::PUT, &url, &headers, full_body("{}"))
                    .await
                    .expect("PUT")
            }
        };
        // Recording only: a stale token goes through.
        assert_eq!(put(Some("5")).await.status, 200);
        assert_eq!(put(Some("3")).await.status, 200);
        shop.set_fencing(Some("fencing-token"));
        assert_eq!(put(Some("4")).await.status, 409, "below 5");
        let ok = put(Some("6")).await;
        assert_eq!(ok.status, 200);
        assert_eq!(ok.header("x-row-version").as_deref(), Some("3"));
        assert_eq!(put(None).await.status, 409, "no token");
        let log = shop.write_log();
        assert_eq!(log.writes.len(), 5);
        assert_eq!(
            log.writes.iter().map(|w| w.accepted).collect::<Vec<_>>(),
            [true, true, false, true, false]
        );
        assert_eq!(log.writes[2].token, Some(4));
    }

    /// The runner and the checkers end to end, straight against the shop (no cacheguard):
    /// the origin alone decides, so nothing is oversold or made up, every unit sells, and
    /// the flood factor is attempts per unit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn runner_records_a_history_the_checkers_accept() {
        let resources = [seat("t1", "a"), seat("t1", "b")];
        let epoch = Epoch::now();
        let shop = Shop::start(
            epoch,
            &[(resources[0].clone(), 20), (resources[1].clone(), 40)],
        )
        .await;
        shop.set_latency(Scope::Buys, Duration::from_millis(2));
        let cfg = RunConfig {
            clients: 4,
            duration: Duration::from_millis(800),
            tail: Duration::from_millis(400),
            max_ops: 100,
            pace: Duration::from_millis(5),
            ..RunConfig::default()
        };
        let rs = resources.clone();
        let history = jepsen::run(
            &cfg,
            epoch,
            &[shop.addr()],
            move |p, k| buy_request(&rs[(p + k as usize) % rs.len()], &format!("p{p}-{k}")),
            |nemesis| async move {
                nemesis.at(Duration::from_millis(100)).await;
                nemesis.start("nothing");
                nemesis.heal("nothing");
            },
        )
        .await;
        let log = shop.sale_log();
        let summary = history.summary();
        assert!(summary.ops > 60, "{summary}");
        assert_eq!(history.nemesis.len(), 2, "{summary}");
        assert!(history.ops.iter().all(|op| op.end.is_some()), "{summary}");
        assert_eq!(log.sold(), 60, "{summary}");
        let oversell = check_oversell(&log);
        assert!(oversell.ok(), "{oversell}");
        let phantom = check_phantom(&history, &log, "buy");
        assert!(phantom.ok(), "{phantom}");
        assert_eq!(phantom.successes, 60);
        let window = history.last_fault_end().expect("a heal") + Duration::from_millis(100);
        let undersell = check_undersell(&history, &log, "buy", window);
        assert!(undersell.ok(), "{undersell}");
        let flood = flood_factor(&log);
        assert_eq!(flood.buy_requests, summary.ops as u64, "{flood}");
    }
}

mod nemesis {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::common::redis_sentinel::info;
    use super::common::{RedisSentinel, RedisServer, TcpProxy};

    /// A blackholed proxy holds connections, open and new, in silence (no error, no
    /// answer); restored, the held commands are answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tcp_proxy_blackhole_holds_and_restore_delivers() {
        let redis = RedisServer::start().await;
        let proxy = TcpProxy::start(redis.addr()).await;
        let mut open = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert_eq!(
            ping(&mut open, Duration::from_secs(2)).await.as_deref(),
            Some("+PONG")
        );

        proxy.blackhole();
        assert!(proxy.is_blackholed());
        assert_eq!(
            ping(&mut open, Duration::from_millis(300)).await,
            None,
            "answered"
        );
        let mut fresh = TcpStream::connect(proxy.addr())
            .await
            .expect("a blackhole still accepts");
        assert_eq!(
            ping(&mut fresh, Duration::from_millis(300)).await,
            None,
            "answered"
        );

        proxy.restore();
        // The PINGs held on both connections are delivered and answered now.
        let mut buf = [0u8; 64];
        for con in [&mut open, &mut fresh] {
            let n = tokio::time::timeout(Duration::from_secs(2), con.read(&mut buf))
                .await
                .expect("the held PING is answered after restore")
                .expect("read");
            assert_eq!(&buf[..n], b"+PONG\r\n");
        }
    }

    /// Sends `PING` on `con`; the first line of the answer, or `None` if none came within
    /// `timeout`.
    async fn ping(con: &mut TcpStream, timeout: Duration) -> Option<String> {
        con.write_all(b"PING\r\n").await.expect("write PING");
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(timeout, con.read(&mut buf))
            .await
            .ok()?
            .ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).trim_end().to_string())
    }

    /// The lagging-replica failover really promotes a replica that misses the last writes
    /// (the helper asserts it), and the sentinels then name it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sentinel_fails_over_to_a_replica_that_lost_writes() {
        let set = RedisSentinel::start_lagging().await;
        let old = set.primary_port().await.expect("a primary");
        let promoted = set.fail_over_to_lagging_replica(25).await;
        assert_ne!(promoted, old);
        assert_eq!(set.primary_port().await, Some(promoted));
        assert!(info(promoted, "replication").await.contains("role:master"));
    }
}
