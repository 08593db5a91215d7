//! The one place where failures become HTTP responses.

use std::fmt;
use std::time::Duration;

use http::StatusCode;

/// The bound a client's request body broke (see `proxy/upload.rs`): each is a 408.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UploadBound {
    /// It paused longer than `upstream.upload_timeout`.
    Stalled(Duration),
    /// Past its grace, it fell behind `upstream.upload_min_rate` (bytes per second).
    TooSlow(u32),
    /// It was not whole within `upstream.upload_deadline`.
    Deadline(Duration),
}

impl fmt::Display for UploadBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UploadBound::Stalled(idle) => write!(f, "stalled for {idle:?}"),
            UploadBound::TooSlow(rate) => write!(f, "slower than {rate} bytes/s"),
            UploadBound::Deadline(deadline) => write!(f, "not received within {deadline:?}"),
        }
    }
}

/// What an in-doubt answer says comes next: with its reservation's remaining seconds, and
/// without (it ended).
fn in_doubt_next(retry_after: Option<u64>) -> String {
    match retry_after {
        Some(seconds) => format!(
            ". Its unit stays reserved for {seconds} s; then the origin's count settles it, \
             and if the origin has no such order, buy again with a new key."
        ),
        None => ". Its reservation ended and the origin's count settled it: if the origin has no \
             such order, buy again with a new key."
            .to_owned(),
    }
}

/// Why cacheguard answered a request itself instead of with an origin (or cached) answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    #[error("request header fields too large (limit {0} bytes)")]
    HeaderTooLarge(usize),
    #[error("too many request header fields (limit {0})")]
    TooManyHeaders(usize),
    #[error("request body too large (limit {0} bytes)")]
    BodyTooLarge(u64),
    #[error("origin busy: no slot within {0:?}")]
    Shed(Duration),
    #[error("origin timed out after {0:?}")]
    OriginTimeout(Duration),
    /// The client's request body broke one of its time bounds.
    #[error("request body {0}")]
    UploadTimeout(UploadBound),
    /// A request body could not be written to its spool file (a full or failing disk);
    /// the text is the I/O error, for the log line.
    #[error("request body could not be stored")]
    BodySpool(String),
    /// The text is the upstream error, for the log line: the client is told less.
    #[error("origin unreachable")]
    OriginConnect(String),
    #[error("another instance's fill did not finish within {0:?}")]
    LockWait(Duration),
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    /// The client's request body broke its framing (a bad chunk, cut short).
    #[error("bad request: malformed request body")]
    BadRequestBody,
    /// A method cacheguard never forwards (`TRACE`, `CONNECT`), or one no route takes that
    /// only makes sense to a cache (`PURGE`, `BAN`: the purge API is on the admin listener).
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("request target too long (limit {0} bytes)")]
    UriTooLong(usize),
    #[error("too many requests for this key")]
    HotKeyLimited,
    /// A miss on a new query variant of a path whose budget is spent, over the route's
    /// overflow rate (the seconds to wait: 1, or the window without an overflow rate).
    #[error("too many distinct query variants of this path")]
    TooManyVariants(u64),
    /// An idempotency key that is not one (empty, too long, not visible ASCII).
    #[error("bad request: malformed idempotency key")]
    BadIdempotencyKey,
    /// The first request with this idempotency key is still being processed.
    #[error("a request with this idempotency key is in progress")]
    IdempotencyInFlight,
    /// The first request with this idempotency key reached the origin, which did not say
    /// whether it sold (a timeout, a 5xx, a lost connection), and the gate does not
    /// forward a retry of it (`in_doubt_retry = "reject"`): the reservation's id, and the
    /// seconds its units stay reserved (`None`: its reservation ended).
    #[error(
        "the outcome of the first request with this idempotency key is unknown: the origin \
         did not answer whether it sold (Stock-Reservation {reservation}). This key is not \
         forwarded again; ask the origin for that order{}",
        in_doubt_next(*.retry_after)
    )]
    IdempotencyInDoubt {
        reservation: String,
        retry_after: Option<u64>,
    },
    /// This idempotency key was first used with another request body.
    #[error("this idempotency key was used with another request")]
    IdempotencyMismatch,
    /// A stock gate could not ask Redis (`on_redis_error = "reject"`).
    #[error("stock gate unavailable")]
    StockUnavailable,
    /// A stock gate could not learn the resource's units from the origin.
    #[error("stock not loaded")]
    StockNotLoaded,
    /// A serialized write found `max_waiters` writes to its resource waiting already (the
    /// `Retry-After` seconds).
    #[error("too many writes waiting for this resource")]
    WriteQueueFull(u64),
    /// A serialized write did not get its resource's lock within `wait_timeout`.
    #[error("the resource stayed locked by other writes")]
    WriteLockWait(u64),
    /// A serialized write's lock service did not answer (`on_redis_error = "reject"`).
    #[error("write lock unavailable")]
    WriteLockUnavailable(u64),
    /// A read on a route with `version`: the origin's answers stayed older than a write's
    /// version floor (a replica that did not catch up) within `upstream.timeout`.
    #[error("the origin's answer stayed older than a recent write")]
    VersionBehind,
    #[error("internal error")]
    Internal,
}

impl ProxyError {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            ProxyError::HeaderTooLarge(_) | ProxyError::TooManyHeaders(_) => {
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
            }
            ProxyError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::Shed(_)
            | ProxyError::LockWait(_)
            | ProxyError::BodySpool(_)
            | ProxyError::VersionBehind => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::OriginTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::UploadTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::OriginConnect(_) => StatusCode::BAD_GATEWAY,
            ProxyError::BadRequest(_) | ProxyError::BadRequestBody => StatusCode::BAD_REQUEST,
            ProxyError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::UriTooLong(_) => StatusCode::URI_TOO_LONG,
            ProxyError::HotKeyLimited | ProxyError::TooManyVariants(_) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ProxyError::BadIdempotencyKey => StatusCode::BAD_REQUEST,
            ProxyError::IdempotencyInFlight | ProxyError::IdempotencyInDoubt { .. } => {
                StatusCode::CONFLICT
            }
            ProxyError::IdempotencyMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ProxyError::StockUnavailable
            | ProxyError::StockNotLoaded
            | ProxyError::WriteQueueFull(_)
            | ProxyError::WriteLockWait(_)
            | ProxyError::WriteLockUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A short, stable name for logs and metric labels.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            ProxyError::HeaderTooLarge(_) => "header_too_large",
            ProxyError::TooManyHeaders(_) => "too_many_headers",
            ProxyError::BodyTooLarge(_) => "body_too_large",
            ProxyError::Shed(_) => "shed",
            ProxyError::OriginTimeout(_) => "origin_timeout",
            ProxyError::UploadTimeout(UploadBound::Stalled(_)) => "upload_timeout",
            ProxyError::UploadTimeout(UploadBound::TooSlow(_)) => "upload_too_slow",
            ProxyError::UploadTimeout(UploadBound::Deadline(_)) => "upload_deadline",
            ProxyError::BodySpool(_) => "body_spool_failed",
            ProxyError::OriginConnect(_) => "origin_unreachable",
            ProxyError::LockWait(_) => "lock_wait",
            ProxyError::BadRequest(_) => "bad_request",
            ProxyError::BadRequestBody => "bad_request_body",
            ProxyError::MethodNotAllowed => "method_not_allowed",
            ProxyError::UriTooLong(_) => "uri_too_long",
            ProxyError::HotKeyLimited => "hot_key_limited",
            ProxyError::TooManyVariants(_) => "too_many_variants",
            ProxyError::BadIdempotencyKey => "bad_idempotency_key",
            ProxyError::IdempotencyInFlight => "idempotency_in_flight",
            ProxyError::IdempotencyInDoubt { .. } => "idempotency_in_doubt",
            ProxyError::IdempotencyMismatch => "idempotency_mismatch",
            ProxyError::StockUnavailable => "stock_unavailable",
            ProxyError::StockNotLoaded => "stock_not_loaded",
            ProxyError::WriteQueueFull(_) => "write_queue_full",
            ProxyError::WriteLockWait(_) => "write_lock_wait",
            ProxyError::WriteLockUnavailable(_) => "write_lock_unavailable",
            ProxyError::VersionBehind => "version_behind",
            ProxyError::Internal => "internal",
        }
    }

    /// What the log line says beyond the client's answer: the upstream error, if any.
    pub(crate) fn detail(&self) -> String {
        match self {
            ProxyError::OriginConnect(upstream) | ProxyError::BodySpool(upstream) => {
                format!("{self}: {upstream}")
            }
            other => other.to_string(),
        }
    }

    /// Whether the connection must be closed after this answer (`Connection: close`): the
    /// request's framing or target can no longer be trusted — a refused head (`Host`,
    /// `Connection` naming a framing header), a body that broke its framing, went over the
    /// limit or timed out, all left partly unread — so nothing more is read from it.
    pub(crate) fn ends_connection(&self) -> bool {
        matches!(
            self,
            ProxyError::BadRequest(_)
                | ProxyError::BadRequestBody
                | ProxyError::BodyTooLarge(_)
                | ProxyError::UploadTimeout(_)
                | ProxyError::BodySpool(_)
        )
    }

    /// Seconds to put in `Retry-After`, for errors a client should retry later.
    pub(crate) fn retry_after(&self) -> Option<u64> {
        match self {
            ProxyError::Shed(_)
            | ProxyError::LockWait(_)
            | ProxyError::HotKeyLimited
            | ProxyError::IdempotencyInFlight
            | ProxyError::StockUnavailable
            | ProxyError::StockNotLoaded
            | ProxyError::VersionBehind => Some(1),
            ProxyError::IdempotencyInDoubt { retry_after, .. } => *retry_after,
            ProxyError::TooManyVariants(seconds)
            | ProxyError::WriteQueueFull(seconds)
            | ProxyError::WriteLockWait(seconds)
            | ProxyError::WriteLockUnavailable(seconds) => Some(*seconds),
            _ => None,
        }
    }
}
