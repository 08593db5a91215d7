//! `[[stock]]` gates and the `stock = { gate, units }` of a write route.

use std::collections::HashSet;
use std::time::Duration;

use http::{HeaderName, StatusCode};
use toml::Spanned;

use super::{Checker, check_filter_name, check_pattern, pattern_params, show};
use crate::config::raw::{RawRoute, RawStock};
use crate::config::{
    InDoubtRetry, OnRedisError, RouteStock, SoldOutAnswer, StockConfig, UpstreamConfig,
};

/// `[[stock]]` defaults, also named in messages and the README.
pub(in crate::config) mod defaults {
    use std::time::Duration;

    pub(in crate::config) const RECONCILE: Duration = Duration::from_secs(5);
    pub(in crate::config) const RESERVATION_TTL: Duration = Duration::from_secs(30);
    pub(in crate::config) const SOLD_OUT_BODY: &str =
        "{\"type\":\"sold-out\",\"title\":\"Sold out\",\"status\":409}";
    pub(in crate::config) const SOLD_OUT_CONTENT_TYPE: &str = "application/problem+json";
    pub(in crate::config) const NOT_SOLD: [u16; 3] = [400, 402, 422];
    pub(in crate::config) const ORIGIN_SOLD_OUT: [u16; 2] = [409, 410];
    pub(in crate::config) const IDEMPOTENCY_HEADER: &str = "idempotency-key";
    pub(in crate::config) const IDEMPOTENCY_TTL: Duration = Duration::from_secs(3600);
    /// Reconciling more often than this would make the origin's stock endpoint a hot path.
    pub(in crate::config) const MIN_RECONCILE: Duration = Duration::from_millis(100);
    /// More segments than this spread one resource thinner than any cluster has nodes.
    pub(in crate::config) const MAX_SEGMENTS: u16 = 64;
}

impl Checker<'_> {
    pub(super) fn stocks(
        &mut self,
        raw: &[Spanned<RawStock>],
        upstream: &UpstreamConfig,
    ) -> Vec<StockConfig> {
        let mut seen = HashSet::new();
        let mut gates = Vec::new();
        for (i, spanned) in raw.iter().enumerate() {
            let stock = spanned.get_ref();
            let name = stock.name.get_ref();
            let key = format!("stock[{i}].name");
            if self
                .check(check_filter_name(name), stock.name.span(), &key)
                .is_none()
            {
                continue;
            }
            if !seen.insert(name.clone()) {
                self.report(
                    stock.name.span(),
                    key,
                    format!("another [[stock]] gate is already named {name:?}"),
                );
                continue;
            }
            if let Some(gate) = self.stock(i, stock, upstream) {
                gates.push(gate);
            }
        }
        gates
    }

    fn stock(
        &mut self,
        i: usize,
        raw: &RawStock,
        upstream: &UpstreamConfig,
    ) -> Option<StockConfig> {
        let key = |field: &str| format!("stock[{i}].{field}");
        let pattern = raw.key.get_ref();
        self.check(check_pattern(pattern), raw.key.span(), &key("key"))?;
        let params: Vec<&str> = pattern_params(pattern);

        let source = raw.source.get_ref();
        let source_path = source.path.get_ref();
        let checked = check_pattern(source_path).and_then(|()| {
            match pattern_params(source_path)
                .into_iter()
                .find(|p| !params.contains(p))
            {
                Some(missing) => Err(format!(
                    "the source path names {{{missing}}}, which the gate's key {pattern:?} \
                     does not have"
                )),
                None => Ok(()),
            }
        });
        self.check(checked, source.path.span(), &key("source.path"));
        let json = source.json.get_ref();
        if !json.is_empty() && !json.starts_with('/') {
            self.report(
                source.json.span(),
                key("source.json"),
                format!(
                    "expected a JSON pointer starting with \"/\" like \"/remaining\" (or \"\" \
                     when the whole answer is the number), got {json:?}"
                ),
            );
        }

        let reconcile = raw.reconcile.as_ref().map_or(defaults::RECONCILE, |d| {
            let value = d.get_ref().0;
            if value < defaults::MIN_RECONCILE {
                self.report(
                    d.span(),
                    key("reconcile"),
                    format!(
                        "expected a duration of at least {} like \"5s\", got {}",
                        show(defaults::MIN_RECONCILE),
                        show(value)
                    ),
                );
            }
            value
        });
        let reservation_ttl = match &raw.reservation_ttl {
            Some(d) => (d.get_ref().0, d.span()),
            None => (defaults::RESERVATION_TTL, raw.name.span()),
        };
        if reservation_ttl.0 <= upstream.timeout {
            self.report(
                reservation_ttl.1,
                key("reservation_ttl"),
                format!(
                    "expected a duration above upstream.timeout ({}): a reservation must \
                     outlive the buy it holds a unit for, got {}",
                    show(upstream.timeout),
                    show(reservation_ttl.0)
                ),
            );
        }
        let sold_out = self.sold_out(i, raw);
        let not_sold = self.statuses(raw.not_sold.as_ref(), &defaults::NOT_SOLD, &key("not_sold"));
        let origin_sold_out = self.statuses(
            raw.origin_sold_out.as_ref(),
            &defaults::ORIGIN_SOLD_OUT,
            &key("origin_sold_out"),
        );
        if let Some(both) = not_sold.iter().find(|s| origin_sold_out.contains(s)) {
            let span = raw
                .origin_sold_out
                .as_ref()
                .or(raw.not_sold.as_ref())
                .map_or(raw.name.span(), Spanned::span);
            self.report(
                span,
                key("origin_sold_out"),
                format!(
                    "status {} is in both not_sold and origin_sold_out: an answer means \
                     either that nothing was sold or that nothing is left",
                    both.as_u16()
                ),
            );
        }
        let idempotency_header = match &raw.idempotency_header {
            None => Some(HeaderName::from_static(defaults::IDEMPOTENCY_HEADER)),
            Some(name) if name.get_ref().is_empty() => None,
            Some(name) => {
                let parsed = HeaderName::from_bytes(name.get_ref().as_bytes()).map_err(|_| {
                    format!(
                        "expected a header name like \"idempotency-key\" (or \"\" to turn \
                         keys off), got {:?}",
                        name.get_ref()
                    )
                });
                self.check(parsed, name.span(), &key("idempotency_header"))
            }
        };
        let idempotency_ttl = self.positive(
            raw.idempotency_ttl.as_ref(),
            defaults::IDEMPOTENCY_TTL,
            &key("idempotency_ttl"),
        );
        let in_doubt_retry = raw
            .in_doubt_retry
            .as_ref()
            .map_or(InDoubtRetry::Reject, |r| r.get_ref().0);
        if let Some(retry) = &raw.in_doubt_retry
            && retry.get_ref().0 == InDoubtRetry::Forward
            && raw
                .idempotency_header
                .as_ref()
                .is_some_and(|h| h.get_ref().is_empty())
        {
            self.report(
                retry.span(),
                key("in_doubt_retry"),
                "\"forward\" forwards retries with an idempotency key, and \
                 idempotency_header = \"\" turns keys off: set a header, or leave \
                 in_doubt_retry out",
            );
        }
        let segments = raw.segments.as_ref().map_or(1, |s| {
            let value = *s.get_ref();
            if !(1..=defaults::MAX_SEGMENTS).contains(&value) {
                self.report(
                    s.span(),
                    key("segments"),
                    format!(
                        "expected an integer from 1 to {}, got {value}",
                        defaults::MAX_SEGMENTS
                    ),
                );
            }
            value
        });
        Some(StockConfig {
            name: raw.name.get_ref().clone(),
            key: pattern.clone(),
            source_path: source_path.clone(),
            source_json: json.clone(),
            reconcile,
            reservation_ttl: reservation_ttl.0,
            sold_out,
            not_sold,
            origin_sold_out,
            on_redis_error: raw
                .on_redis_error
                .as_ref()
                .map_or(OnRedisError::Reject, |o| o.get_ref().0),
            idempotency_header,
            idempotency_ttl,
            in_doubt_retry,
            segments,
        })
    }

    fn positive(
        &mut self,
        value: Option<&Spanned<crate::config::raw::HumanDuration>>,
        default: Duration,
        key: &str,
    ) -> Duration {
        let Some(value) = value else { return default };
        if value.get_ref().0.is_zero() {
            self.report(
                value.span(),
                key,
                format!("expected a duration above zero like {}", show(default)),
            );
        }
        value.get_ref().0
    }

    fn sold_out(&mut self, i: usize, raw: &RawStock) -> SoldOutAnswer {
        let key = format!("stock[{i}].sold_out");
        let Some(spanned) = &raw.sold_out else {
            return SoldOutAnswer {
                status: StatusCode::CONFLICT,
                body: defaults::SOLD_OUT_BODY.to_owned(),
                content_type: defaults::SOLD_OUT_CONTENT_TYPE.to_owned(),
            };
        };
        let answer = spanned.get_ref();
        let status = match &answer.status {
            None => StatusCode::CONFLICT,
            Some(s) => {
                let checked = client_or_server_error(*s.get_ref())
                    .map_err(|m| format!("{m} (a sold-out answer must never look like a sale)"));
                self.check(checked, s.span(), &format!("{key}.status"))
                    .unwrap_or(StatusCode::CONFLICT)
            }
        };
        let content_type = match &answer.content_type {
            None => defaults::SOLD_OUT_CONTENT_TYPE.to_owned(),
            Some(ct) => {
                let value = ct.get_ref();
                if http::HeaderValue::from_str(value).is_err() || value.is_empty() {
                    self.report(
                        ct.span(),
                        format!("{key}.content_type"),
                        format!("expected a media type like \"application/json\", got {value:?}"),
                    );
                }
                value.clone()
            }
        };
        SoldOutAnswer {
            status,
            body: answer
                .body
                .clone()
                .unwrap_or_else(|| defaults::SOLD_OUT_BODY.replace("409", status.as_str())),
            content_type,
        }
    }

    /// A list of 4xx/5xx statuses (`not_sold`, `origin_sold_out`).
    fn statuses(
        &mut self,
        raw: Option<&Spanned<Vec<Spanned<u16>>>>,
        default: &[u16],
        key: &str,
    ) -> Vec<StatusCode> {
        let Some(list) = raw else {
            return default
                .iter()
                .filter_map(|s| StatusCode::from_u16(*s).ok())
                .collect();
        };
        let mut statuses = Vec::new();
        for status in list.get_ref() {
            let checked = client_or_server_error(*status.get_ref())
                .map_err(|m| format!("{m} (a 2xx is a sale; other answers are in doubt)"));
            if let Some(code) = self.check(checked, status.span(), key)
                && !statuses.contains(&code)
            {
                statuses.push(code);
            }
        }
        statuses
    }

    /// A write route's `stock = { gate, units }`, against the validated gates.
    pub(super) fn route_stock(
        &mut self,
        i: usize,
        raw: &RawRoute,
        is_read: bool,
        gates: &[StockConfig],
    ) -> Option<RouteStock> {
        let spanned = raw.stock.as_ref()?;
        let stock = spanned.get_ref();
        let key = format!("routes[{i}].stock");
        if is_read {
            self.report(
                spanned.span(),
                key,
                "a stock gate takes units from buys: bind it to a write route (POST, PUT, \
                 PATCH or DELETE), not one that answers GET/HEAD",
            );
            return None;
        }
        let wanted = stock.gate.get_ref();
        let Some(gate) = gates.iter().find(|g| &g.name == wanted) else {
            let known: Vec<String> = gates.iter().map(|g| format!("{:?}", g.name)).collect();
            let expected = if known.is_empty() {
                "a [[stock]] gate name, but none is defined".to_owned()
            } else {
                format!("the name of a [[stock]] gate ({})", known.join(", "))
            };
            self.report(
                stock.gate.span(),
                format!("{key}.gate"),
                format!("expected {expected}, got {wanted:?}"),
            );
            return None;
        };
        let captured = pattern_params(raw.pattern.get_ref());
        if let Some(missing) = pattern_params(&gate.key)
            .into_iter()
            .find(|p| !captured.contains(p))
        {
            self.report(
                stock.gate.span(),
                format!("{key}.gate"),
                format!(
                    "gate {wanted:?} is keyed by {:?}, whose {{{missing}}} this route's match \
                     {:?} does not capture",
                    gate.key,
                    raw.pattern.get_ref()
                ),
            );
            return None;
        }
        let units = match &stock.units {
            None => 1,
            Some(units) if *units.get_ref() == 0 => {
                self.report(
                    units.span(),
                    format!("{key}.units"),
                    "expected an integer of at least 1, got 0",
                );
                return None;
            }
            Some(units) => *units.get_ref(),
        };
        Some(RouteStock {
            gate: wanted.clone(),
            units,
        })
    }
}

fn client_or_server_error(code: u16) -> Result<StatusCode, String> {
    match StatusCode::from_u16(code) {
        Ok(status) if status.is_client_error() || status.is_server_error() => Ok(status),
        _ => Err(format!("expected a 4xx or 5xx status, got {code}")),
    }
}
