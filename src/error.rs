//! The one place where failures become HTTP responses.

use std::time::Duration;

use http::StatusCode;

/// Why cacheguard answered a request itself instead of with an origin (or cached) answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    #[error("request header fields too large (limit {0} bytes)")]
    HeaderTooLarge(usize),
    #[error("request body too large (limit {0} bytes)")]
    BodyTooLarge(u64),
    #[error("origin busy: no slot within {0:?}")]
    Shed(Duration),
    #[error("origin timed out after {0:?}")]
    OriginTimeout(Duration),
    #[error("origin unreachable: {0}")]
    OriginConnect(String),
    #[error("another instance's fill did not finish within {0:?}")]
    LockWait(Duration),
    #[error("bad request: {0}")]
    BadRequest(&'static str),
}

impl ProxyError {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            ProxyError::HeaderTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::Shed(_) | ProxyError::LockWait(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::OriginTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::OriginConnect(_) => StatusCode::BAD_GATEWAY,
            ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
        }
    }

    /// Seconds to put in `Retry-After`, for errors a client should retry later.
    pub(crate) fn retry_after(&self) -> Option<u64> {
        match self {
            ProxyError::Shed(_) | ProxyError::LockWait(_) => Some(1),
            _ => None,
        }
    }
}
