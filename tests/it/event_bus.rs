//! The pub/sub event bus stays subscribed while idle.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::common::{CgConfig, HttpClient, RedisServer, TestOrigin, scrape};

/// Regression: inside a subscription Redis answers PING with an array, which the idle
/// keep-alive once read as a failure, dropping and re-making the subscription every idle
/// second. Each gap let a stampede skip the fleet lock.
#[tokio::test]
async fn idle_subscription_is_kept_not_remade() {
    let redis = RedisServer::start().await;
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).redis(&redis).start().await;
    let client = HttpClient::new();
    // Three idle keep-alive periods.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let (_, metrics) = scrape(&client, cg.admin_addr()).await;
    assert_eq!(metrics.value("cacheguard_event_bus_subscribed"), Some(1.0));
    assert_eq!(
        metrics.value("cacheguard_event_bus_resubscriptions_total"),
        Some(0.0)
    );
    cg.shutdown().await;
}
