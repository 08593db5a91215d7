//! The read path's Bloom check (`docs/architecture.md`, read path). An id that is
//! definitely not in the route's filter is answered here, before the cache key is even
//! derived: no Redis command, no origin request, whatever the rest of the request says (a
//! `Cookie` or `Authorization` header must not be a way around it).

use std::borrow::Cow;
use std::time::Instant;

use http::Response;
use http::header::{self, HeaderValue};

use super::body::Body;
use super::respond;
use super::route::Route;
use crate::metrics::Outcome;
use crate::protect::bloom::{Filter, Verdict};

/// `Some(answer)` when `raw_id` (a path segment, still percent-encoded) is a definite miss.
pub(crate) fn check(
    route: &Route,
    filter: &Filter,
    raw_id: &str,
    head: bool,
) -> Option<Response<Body>> {
    let started = Instant::now();
    let id: Cow<'_, [u8]> = percent_encoding::percent_decode_str(raw_id).into();
    if filter.check(&id) != Verdict::Reject {
        return None;
    }
    let bloom = route.config.bloom.as_ref()?;
    let body = if head {
        Body::empty()
    } else {
        Body::full(route.reject_body.clone())
    };
    let mut response = Response::new(body);
    *response.status_mut() = bloom.status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    respond::mark(&mut response, Outcome::Reject);
    filter.metrics.rejections.inc();
    route
        .metrics
        .answered(Outcome::Reject, started.elapsed().as_secs_f64());
    Some(response)
}
