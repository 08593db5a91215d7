//! Unit tests of the access log's handle: off costs no record, sampling spares cacheguard's
//! own answers and 5xx, a reload moves the lines to the new file, origin time is summed.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::{Request, StatusCode};

use super::*;
use crate::config::{AccessLogConfig, AccessLogFormat, AccessLogPath};
use crate::metrics::Metrics;

fn config(format: AccessLogFormat, path: &Path, sample: f64) -> AccessLogConfig {
    AccessLogConfig {
        format,
        path: AccessLogPath::File(path.to_path_buf()),
        sample,
        query: false,
        buffer: 64,
    }
}

fn client() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 40000))
}

fn request(path: &str) -> Request<()> {
    Request::builder()
        .uri(path)
        .body(())
        .unwrap_or_else(|e| panic!("request: {e}"))
}

fn answered(status: StatusCode, reason: Option<&'static str>) -> Answered {
    Answered {
        route: RouteName::Static("item"),
        status,
        cache: None,
        reason,
        origin: None,
    }
}

/// Logs one request for `path` answered `status` and finishes its body at once.
fn log_one(log: &AccessLog, path: &str, status: StatusCode) {
    let started = log.begin(&request(path), client()).expect("the log is on");
    if let Some(line) = log.finish(started, answered(status, None)) {
        line.finish(0);
    }
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn off_notes_nothing_and_opens_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("access.log");
    let log = AccessLog::start(
        &config(AccessLogFormat::Off, &path, 1.0),
        Metrics::unregistered().access_log,
    )
    .expect("starts");
    assert!(log.begin(&request("/a"), client()).is_none());
    assert!(!path.exists(), "an access log that is off created its file");
}

#[tokio::test]
async fn sampling_keeps_about_the_fraction_and_always_own_answers_and_5xx() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = AccessLog::start(
        &config(AccessLogFormat::Json, &dir.path().join("a.log"), 0.1),
        Metrics::unregistered().access_log,
    )
    .expect("starts");
    let kept = |status, reason| {
        (0..10_000)
            .filter(|_| {
                let started = log.begin(&request("/a"), client()).expect("on");
                // Dropped unfinished: nothing is queued by these.
                log.finish(started, answered(status, reason)).is_some()
            })
            .count()
    };
    let sampled = kept(StatusCode::OK, None);
    // 1000 expected; the bounds are over 9 standard deviations (30) away.
    assert!(
        (700..=1300).contains(&sampled),
        "sample 0.1 kept {sampled} of 10000"
    );
    assert_eq!(kept(StatusCode::BAD_GATEWAY, None), 10_000, "every 5xx");
    assert_eq!(
        kept(StatusCode::TOO_MANY_REQUESTS, Some("hot_key_limited")),
        10_000,
        "every own answer"
    );
}

#[tokio::test]
async fn a_reload_switches_file_format_and_settings() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (first, second) = (dir.path().join("first.log"), dir.path().join("second.log"));
    let metrics = Metrics::unregistered();
    let log = AccessLog::start(
        &config(AccessLogFormat::Json, &first, 1.0),
        metrics.access_log.clone(),
    )
    .expect("starts");
    log_one(&log, "/one", StatusCode::OK);
    log.reconfigure(&config(AccessLogFormat::Combined, &second, 1.0))
        .await
        .expect("reloads");
    log_one(&log, "/two", StatusCode::OK);
    log.drain(Duration::from_secs(5)).await;
    let (a, b) = (lines(&first), lines(&second));
    assert_eq!(a.len(), 1, "{a:?}");
    assert!(a[0].starts_with('{') && a[0].contains("\"/one\""), "{a:?}");
    assert_eq!(b.len(), 1, "{b:?}");
    assert!(b[0].contains("\"GET /two HTTP/1.1\" 200 0"), "{b:?}");
    assert_eq!(metrics.access_log.written.get(), 2);

    // A file that cannot be opened: refused, and the old file and format stay.
    let refused = config(
        AccessLogFormat::Json,
        &dir.path().join("no-such-dir").join("x.log"),
        1.0,
    );
    let error = log.reconfigure(&refused).await.expect_err("unopenable");
    assert!(error.contains("no-such-dir"), "{error}");
    log_one(&log, "/three", StatusCode::OK);
    // Off: nothing more is noted.
    log.reconfigure(&config(AccessLogFormat::Off, &second, 1.0))
        .await
        .expect("reloads");
    assert!(log.begin(&request("/four"), client()).is_none());
    log.drain(Duration::from_secs(5)).await;
    let b = lines(&second);
    assert_eq!(b.len(), 2, "{b:?}");
    assert!(b[1].contains("GET /three"), "{b:?}");
}

#[tokio::test]
async fn a_file_that_cannot_be_opened_is_named_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("missing").join("access.log");
    let error = AccessLog::start(
        &config(AccessLogFormat::Combined, &path, 1.0),
        Metrics::unregistered().access_log,
    )
    .expect_err("unopenable");
    assert!(
        error.starts_with(&format!("access_log.path {}: cannot open:", path.display())),
        "{error}"
    );
}

#[tokio::test]
async fn origin_time_is_summed_in_its_scope_only() {
    origin_waited(Duration::from_millis(5));
    let ((), none) = timing_origin(async {}).await;
    assert_eq!(none, None);
    let ((), sum) = timing_origin(async {
        origin_waited(Duration::from_millis(3));
        origin_waited(Duration::from_millis(4));
    })
    .await;
    assert_eq!(sum, Some(Duration::from_millis(7)));
}

/// Regression: the scope was an `async move` block awaiting the future it captured, which
/// holds it twice over: a gated write's task was 49,856 bytes, copied on every spawn.
#[test]
fn timing_a_future_costs_a_few_words_not_a_second_copy_of_it() {
    crate::tally::assert_wraps_in_place("timing_origin", crate::tally::four_kib(), timing_origin);
}
