//! The pooled HTTP client to the origin.

use std::error::Error as StdError;
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderValue;
use http::{Request, Response, Uri};
use http_body_util::LengthLimitError;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::config::UpstreamConfig;
use crate::error::ProxyError;

pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;
/// Request bodies sent upstream: empty for cached fetches, the client's (limited) body for
/// pass-through.
pub(crate) type UpstreamBody = BoxBody<Bytes, BoxError>;

#[derive(Clone, Debug)]
pub(crate) struct Upstream {
    client: Client<HttpConnector, UpstreamBody>,
    scheme_authority: String,
    /// Path prefix of `upstream.url`, without a trailing slash ("" for none).
    prefix: String,
    authority: HeaderValue,
    pub(crate) timeout: Duration,
}

impl Upstream {
    pub(crate) fn new(config: &UpstreamConfig) -> anyhow::Result<Self> {
        let authority = config
            .url
            .authority()
            .ok_or_else(|| anyhow::anyhow!("upstream.url has no host"))?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(config.pool_max_idle)
            .pool_idle_timeout(config.pool_idle_timeout)
            .pool_timer(TokioTimer::new())
            .build(connector);
        Ok(Upstream {
            client,
            scheme_authority: format!("http://{authority}"),
            prefix: config.url.path().trim_end_matches('/').to_owned(),
            authority: HeaderValue::from_str(authority.as_str())?,
            timeout: config.timeout,
        })
    }

    /// The origin URI for a client path-and-query.
    pub(crate) fn uri(&self, path_and_query: &str) -> Result<Uri, ProxyError> {
        format!("{}{}{}", self.scheme_authority, self.prefix, path_and_query)
            .parse()
            .map_err(|_| ProxyError::BadRequest("request target cannot be forwarded"))
    }

    /// The origin's `host:port`, used as `Host` on cached fetches.
    pub(crate) fn authority(&self) -> &HeaderValue {
        &self.authority
    }

    /// Sends `request`, waiting at most `upstream.timeout` for the response head.
    ///
    /// # Errors
    /// Timeout → 504, connection failures → 502, a client body over the limit → 413.
    pub(crate) async fn send(
        &self,
        request: Request<UpstreamBody>,
    ) -> Result<Response<Incoming>, ProxyError> {
        match tokio::time::timeout(self.timeout, self.client.request(request)).await {
            Err(_) => Err(ProxyError::OriginTimeout(self.timeout)),
            Ok(Ok(response)) => Ok(response),
            Ok(Err(error)) => Err(classify(&error)),
        }
    }
}

fn classify(error: &hyper_util::client::legacy::Error) -> ProxyError {
    let mut source: Option<&(dyn StdError + 'static)> = error.source();
    while let Some(cause) = source {
        if let Some(limit) = cause.downcast_ref::<LengthLimitError>() {
            let _ = limit;
            return ProxyError::BodyTooLarge(0);
        }
        source = cause.source();
    }
    // The whole chain, for the log line: "client error (Connect): tcp connect error:
    // Connection refused (os error 111)", "… connection closed before message completed".
    let mut detail = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        detail.push_str(": ");
        detail.push_str(&cause.to_string());
        source = cause.source();
    }
    ProxyError::OriginConnect(detail)
}
