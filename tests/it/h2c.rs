//! HTTP/2 without TLS (h2c, prior knowledge) on the same listener as HTTP/1.1.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::common::{CgConfig, TestOrigin, default_body};

#[tokio::test]
async fn h2c_prior_knowledge_is_served_and_cached() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin).start().await;
    let client: Client<HttpConnector, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let url: http::Uri = format!("http://{}/api/items/7", cg.addr()).parse().unwrap();

    let mut seen = Vec::new();
    for _ in 0..3 {
        let response = client.get(url.clone()).await.unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        assert_eq!(response.status(), 200);
        let x_cache = response.headers()["x-cache"].to_str().unwrap().to_owned();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, default_body("/api/items/7", 1));
        seen.push(x_cache);
    }
    assert_eq!(seen, ["MISS", "HIT-L1", "HIT-L1"]);
    assert_eq!(origin.count("/api/items/7"), 1);
    cg.shutdown().await;
}

/// `server.max_headers` holds on HTTP/2 too (hyper counts fields on HTTP/1.1 only): with
/// 20, a request with 30 header fields gets 431 and never reaches the origin; 15 are fine.
#[tokio::test]
async fn h2c_requests_with_more_header_fields_than_max_headers_get_431() {
    let origin = TestOrigin::start().await;
    let cg = CgConfig::new(&origin)
        .set("server", "max_headers", "20")
        .start()
        .await;
    let client: Client<HttpConnector, Empty<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    for (fields, expected) in [(30, 431), (15, 200)] {
        let path = format!("/api/items/h2-fields-{fields}");
        let mut request = http::Request::get(format!("http://{}{path}", cg.addr()));
        for i in 0..fields {
            request = request.header(format!("x-field-{i}"), i);
        }
        let response = client
            .request(request.body(Empty::new()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.version(), http::Version::HTTP_2);
        assert_eq!(response.status(), expected, "{fields} fields");
        let reached = if expected == 200 { 1 } else { 0 };
        assert_eq!(origin.count(&path), reached, "{fields} fields");
    }
    cg.shutdown().await;
}
