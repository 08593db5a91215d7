//! The HTTP side of a stock gate (`protect/stock.rs`): the gate's own answers (sold out,
//! a replay), and the forward of an admitted buy, settled by the origin's answer from a
//! task of its own so that a client hanging up never leaves a reservation unsettled.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{HeaderName, Request, Response, StatusCode};

use super::body::Body;
use super::body::{Read, read_whole};
use super::own_answer::OwnAnswer;
use super::respond;
use super::route::Route;
use super::spool::{BodyFingerprint, Spooled};
use crate::config::StockConfig;
use crate::error::ProxyError;
use crate::metrics::Outcome;
use crate::protect::stock::record::{MAX_REPLAY_BODY, StoredAnswer};
use crate::protect::stock::{
    Admission, Doubt, Gate, IdempotencyKey, Lookup, Reservation, Resource, STOCK_RESERVATION,
};

/// Set on a replayed answer (the name Stripe and others use).
static IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The gate's sold-out answer: its status, body and type, never stored by anyone.
pub(crate) fn sold_out(config: &StockConfig) -> Response<Body> {
    let mut response = Response::new(Body::full(Bytes::from(config.sold_out.body.clone())));
    *response.status_mut() = config.sold_out.status;
    let headers = response.headers_mut();
    if let Ok(value) = HeaderValue::from_str(&config.sold_out.content_type) {
        headers.insert(header::CONTENT_TYPE, value);
    }
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    respond::mark(&mut response, Outcome::SoldOut);
    response
}

/// A completed buy's answer, for a retry with the same idempotency key.
pub(crate) fn replay(answer: &StoredAnswer) -> Response<Body> {
    let mut response = Response::new(Body::full(answer.body.clone()));
    *response.status_mut() =
        StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    *response.headers_mut() = answer.header_map();
    let headers = response.headers_mut();
    headers.insert(
        IDEMPOTENT_REPLAYED.clone(),
        HeaderValue::from_static("true"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    respond::mark(&mut response, Outcome::Replayed);
    response
}

/// The answer to a retry of a buy whose outcome is in doubt, when the gate does not forward
/// it: 409 (the key's state conflicts with the request, as for a retry in flight) with
/// `Retry-After` while the reservation still holds its units, and its id in
/// `Stock-Reservation` so the client can ask the origin for the order.
fn in_doubt(doubt: Doubt) -> Response<Body> {
    let retry_after = doubt
        .ends_in
        .map(|left| left.as_secs() + u64::from(left.subsec_nanos() > 0));
    let id = HeaderValue::from_str(&doubt.reservation).ok();
    let mut response = respond::error(&ProxyError::IdempotencyInDoubt {
        reservation: doubt.reservation,
        retry_after,
    });
    if let Some(id) = id {
        response.headers_mut().insert(STOCK_RESERVATION.clone(), id);
    }
    response
}

/// Settles `reservation` by `response` (an origin answer, or cacheguard's own when the
/// origin could not be asked or did not answer in time), and gives the response back. When
/// the buy has an idempotency key, the answer is read (up to [`MAX_REPLAY_BODY`]) so that
/// retries can be replayed it; the client then gets it after its record is written.
pub(crate) async fn settle(
    gate: &Arc<Gate>,
    reservation: Reservation,
    response: Response<Body>,
    keyed: bool,
) -> Response<Body> {
    let own = response
        .extensions()
        .get::<OwnAnswer>()
        .map(|own| own.reason);
    let settlement = gate.classify(response.status(), own);
    if !keyed {
        gate.settle(reservation, settlement, None).await;
        return response;
    }
    let (parts, body) = response.into_parts();
    let (body, kept) = match read_whole(body, MAX_REPLAY_BODY).await {
        Ok(Read::Whole(bytes)) => (Body::full(bytes.clone()), Some(bytes)),
        Ok(Read::TooLarge(body)) => (body, None),
        // The origin's answer broke off: the client cannot have it either.
        Err(_) => (Body::empty(), None),
    };
    let answer = StoredAnswer::of(parts.status, &parts.headers, kept);
    gate.settle(reservation, settlement, Some(answer)).await;
    Response::from_parts(parts, body)
}

/// A request on a route bound to a stock gate: the gate, the resource the request names,
/// and the units it takes.
pub(crate) struct Gated {
    gate: Arc<Gate>,
    resource: Arc<Resource>,
    units: u64,
    started: Instant,
}

/// Units held for a buy being forwarded: settled by the answer.
#[derive(Debug)]
pub(crate) struct Held {
    gate: Arc<Gate>,
    reservation: Reservation,
    keyed: bool,
}

impl Gated {
    /// The gate of `route`, if it has one, and the resource `params` name.
    pub(crate) fn of(route: &Route, params: &[(String, String)]) -> Option<Gated> {
        let gate = route.stock.as_ref()?;
        let units = route.config.stock.as_ref().map_or(1, |s| s.units);
        Some(Gated {
            resource: gate.resource(params),
            gate: Arc::clone(gate),
            units,
            started: Instant::now(),
        })
    }

    /// The sold-out answer, when this instance already knows there are too few units and
    /// the request has no idempotency key (a key may have a completed answer to replay).
    pub(crate) fn sold_out_here<B>(
        &self,
        route: &Route,
        request: &Request<B>,
    ) -> Option<Response<Body>> {
        let config = self.gate.config();
        let keyed = config
            .idempotency_header
            .as_ref()
            .is_some_and(|name| request.headers().contains_key(name));
        if keyed || !self.gate.sold_out_here(&self.resource, self.units) {
            return None;
        }
        self.gate.sold_out_local();
        Some(self.answered(route, sold_out(&config), Outcome::SoldOut))
    }

    /// Takes the buy's units: `Ok(Some)` to forward (with `Stock-Reservation` set on
    /// `request`), `Ok(None)` to forward ungated, `Err` the answer to give instead.
    pub(crate) async fn admit(
        self,
        route: &Route,
        request: &mut Request<Spooled>,
    ) -> Result<Option<Held>, Response<Body>> {
        let config = self.gate.config();
        let key = match config
            .idempotency_header
            .as_ref()
            .and_then(|name| request.headers().get(name))
        {
            None => None,
            Some(value) => {
                let fingerprint = request
                    .extensions()
                    .get::<BodyFingerprint>()
                    .map_or(0, |f| f.0);
                match IdempotencyKey::parse(value, fingerprint) {
                    Ok(key) => Some(key),
                    Err(()) => {
                        self.gate.bad_key();
                        return Err(respond::error(&ProxyError::BadIdempotencyKey));
                    }
                }
            }
        };
        let admission = match key {
            Some(key) if self.gate.sold_out_here(&self.resource, self.units) => {
                match self.gate.lookup(&self.resource, key).await {
                    Lookup::Answer(known) => known,
                    Lookup::InDoubt => self.gate.admit(&self.resource, self.units, Some(key)).await,
                    Lookup::NoRecord => {
                        self.gate.sold_out_local();
                        Admission::SoldOut
                    }
                }
            }
            _ => self.gate.admit(&self.resource, self.units, key).await,
        };
        let reservation = match admission {
            Admission::Admitted(reservation) | Admission::Retried(reservation) => reservation,
            Admission::Ungated => return Ok(None),
            Admission::SoldOut => {
                return Err(self.answered(route, sold_out(&config), Outcome::SoldOut));
            }
            Admission::Replay(answer) => {
                return Err(self.answered(route, replay(&answer), Outcome::Replayed));
            }
            Admission::InFlight => return Err(respond::error(&ProxyError::IdempotencyInFlight)),
            Admission::InDoubt(doubt) => return Err(in_doubt(doubt)),
            Admission::Mismatch => return Err(respond::error(&ProxyError::IdempotencyMismatch)),
            Admission::Unavailable => return Err(respond::error(&ProxyError::StockUnavailable)),
            Admission::NotLoaded => return Err(respond::error(&ProxyError::StockNotLoaded)),
        };
        if let Ok(id) = HeaderValue::from_str(reservation.id()) {
            request.headers_mut().insert(STOCK_RESERVATION.clone(), id);
        }
        Ok(Some(Held {
            gate: self.gate,
            reservation,
            keyed: key.is_some(),
        }))
    }

    fn answered(
        &self,
        route: &Route,
        response: Response<Body>,
        outcome: Outcome,
    ) -> Response<Body> {
        route
            .metrics
            .answered(outcome, self.started.elapsed().as_secs_f64());
        response
    }
}

impl Held {
    /// Settles the held units by `response` and gives it back (see [`settle`]).
    pub(crate) async fn settle(self, response: Response<Body>) -> Response<Body> {
        settle(&self.gate, self.reservation, response, self.keyed).await
    }
}
