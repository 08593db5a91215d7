//! What an origin answer's own headers allow a shared cache to do with it (RFC 9111):
//! its `Cache-Control` directives, the request headers its `Vary` names, and its age when
//! it arrived.
//!
//! The directive parser is written here rather than taken from a crate: the crates that
//! implement RFC 9111 (e.g. `http-cache-semantics`) decide storage and freshness as a
//! whole, for a cache keyed by URL alone; cacheguard keys by route, keeps its own freshness
//! rules per route, and only needs the directives themselves.
//!
//! Parsing is lenient where the RFC asks for it: directive names are case-insensitive, a
//! value may be a token or a quoted string, unknown directives are ignored, and a
//! delta-seconds value that does not parse makes its directive count as present with no
//! usable value (`max-age=abc` is treated as stale, RFC 9111 §4.2.1).
//!
//! `CDN-Cache-Control` is the exception: RFC 9213 defines it as a Structured Field
//! Dictionary (RFC 9651), parsed here with the `sfv` crate. A value that is not one, or in
//! which a cache directive has the wrong type (`max-age="60"`, `no-store=1`), is ignored
//! as a whole, as if the field were absent (RFC 9213 §2.2).

use http::header::{self, HeaderMap, HeaderName};

/// The largest age or lifetime a cache must represent (RFC 9111 §1.2.2): larger values,
/// and values that overflow, count as this.
pub(crate) const MAX_DELTA_SECONDS: u64 = 2_147_483_648;

/// The response `Cache-Control` directives a shared cache acts on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ResponseControl {
    pub(crate) no_store: bool,
    /// `private`, with or without a field list: never stored by a shared cache.
    pub(crate) private: bool,
    /// `no-cache`, with or without a field list: never reused without revalidation.
    pub(crate) no_cache: bool,
    pub(crate) must_revalidate: bool,
    pub(crate) proxy_revalidate: bool,
    /// Store only an answer whose status this cache understands, and then ignore
    /// `no-store` (RFC 9111 §5.2.2.3).
    pub(crate) must_understand: bool,
    pub(crate) public: bool,
    /// `Some(None)`: present but not a valid delta-seconds.
    pub(crate) s_maxage: Option<Option<u64>>,
    pub(crate) max_age: Option<Option<u64>>,
    pub(crate) stale_while_revalidate: Option<u64>,
    pub(crate) stale_if_error: Option<u64>,
    /// What the fields aimed at this cache say (`Surrogate-Control`, `CDN-Cache-Control`).
    pub(crate) targeted: TargetedControl,
}

impl ResponseControl {
    /// The directives of every `Cache-Control` field line of `headers`, and those of the
    /// fields aimed at this cache.
    pub(crate) fn parse(headers: &HeaderMap) -> Self {
        let mut control = ResponseControl {
            targeted: TargetedControl::parse(headers),
            ..ResponseControl::default()
        };
        for (name, value) in directives(headers, &header::CACHE_CONTROL) {
            let seconds = || value.as_deref().map(delta_seconds);
            match name.as_str() {
                "no-store" => control.no_store = true,
                "private" => control.private = true,
                "no-cache" => control.no_cache = true,
                "must-revalidate" => control.must_revalidate = true,
                "proxy-revalidate" => control.proxy_revalidate = true,
                "must-understand" => control.must_understand = true,
                "public" => control.public = true,
                // The first occurrence wins (RFC 9111 §4.2.1 allows it; a second one is
                // more likely a mistake than the origin's intent).
                "s-maxage" if control.s_maxage.is_none() => {
                    control.s_maxage = Some(seconds().flatten());
                }
                "max-age" if control.max_age.is_none() => {
                    control.max_age = Some(seconds().flatten());
                }
                "stale-while-revalidate" if control.stale_while_revalidate.is_none() => {
                    control.stale_while_revalidate = seconds().flatten();
                }
                "stale-if-error" if control.stale_if_error.is_none() => {
                    control.stale_if_error = seconds().flatten();
                }
                _ => {}
            }
        }
        control
    }

    /// Whether a stale copy must never be served without a successful revalidation:
    /// `must-revalidate` (RFC 9111 §5.2.2.2), and for a shared cache `proxy-revalidate`
    /// (§5.2.2.8) and `s-maxage` (§5.2.2.10, which implies `proxy-revalidate`). This rules
    /// out grace, stale-while-revalidate and stale-if-error alike.
    pub(crate) fn forbids_stale(&self) -> bool {
        self.must_revalidate
            || self.proxy_revalidate
            || self.s_maxage.is_some()
            || self.targeted.forbids_stale
    }

    /// Whether a field aimed at this cache replaces what `Cache-Control` says of freshness
    /// and storage: in `freshness = "origin"` mode (`origin_mode`), when it gives a
    /// `max-age` (RFC 9213 §2.1). `private` in `Cache-Control` still holds.
    pub(crate) fn targeted_rules(&self, origin_mode: bool) -> bool {
        origin_mode && self.targeted.max_age.is_some()
    }

    /// Whether the answer must be revalidated before each use (`no-cache`): a field aimed
    /// at this cache says so, or `Cache-Control` does and no targeted field replaces it
    /// (see [`ResponseControl::targeted_rules`]).
    pub(crate) fn no_cache(&self, origin_mode: bool) -> bool {
        self.targeted.no_cache || (self.no_cache && !self.targeted_rules(origin_mode))
    }
}

/// The directives the fields aimed at this cache give it: `Surrogate-Control` (Edge
/// Architecture: its untargeted directives and those targeted at [`SURROGATE_TARGET`]),
/// then `CDN-Cache-Control` (RFC 9213). The `max-age` is the first field's that has one;
/// the restrictions hold when either field says them, the stricter reading of two fields.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TargetedControl {
    /// A `Surrogate-Control` `max-age` that does not parse is 0: stale.
    pub(crate) max_age: Option<u64>,
    /// Never stored, whatever `Cache-Control` says.
    pub(crate) no_store: bool,
    /// Never reused without a revalidation, whatever `Cache-Control` says.
    pub(crate) no_cache: bool,
    /// Never stored by a shared cache, whatever `Cache-Control` says.
    pub(crate) private: bool,
    /// `must-revalidate`, `proxy-revalidate` or `s-maxage`: never served stale.
    pub(crate) forbids_stale: bool,
}

impl TargetedControl {
    fn parse(headers: &HeaderMap) -> TargetedControl {
        let mut control = TargetedControl::default();
        for (name, value) in surrogate_directives(headers) {
            control.apply(&name, || {
                value.as_deref().and_then(delta_seconds).or(Some(0))
            });
        }
        if let Some(cdn) = cdn_directives(headers) {
            for (name, max_age) in cdn {
                control.apply(&name, || max_age);
            }
        }
        control
    }

    /// Notes directive `name`; `max_age` gives its value when it is a `max-age`.
    fn apply(&mut self, name: &str, max_age: impl FnOnce() -> Option<u64>) {
        match name {
            "max-age" if self.max_age.is_none() => self.max_age = max_age(),
            "no-store" => self.no_store = true,
            "no-cache" => self.no_cache = true,
            "private" => self.private = true,
            "must-revalidate" | "proxy-revalidate" | "s-maxage" => self.forbids_stale = true,
            _ => {}
        }
    }
}

/// The `(name, value)` pairs of the directives in every `field` line of `headers`, names
/// lowercased, quoted values unquoted.
fn directives(headers: &HeaderMap, field: &HeaderName) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    for line in headers.get_all(field) {
        let Ok(line) = line.to_str() else { continue };
        for item in split_list(line) {
            let (name, value) = match item.split_once('=') {
                Some((name, value)) => (name, Some(unquote(value.trim()))),
                None => (item, None),
            };
            let name = name.trim().to_ascii_lowercase();
            if !name.is_empty() {
                out.push((name, value));
            }
        }
    }
    out
}

/// Splits a comma-separated field value, keeping commas inside quoted strings.
fn split_list(line: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut start, mut quoted, mut escaped) = (0, false, false);
    for (i, c) in line.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            ',' if !quoted => {
                items.push(line[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(line[start..].trim());
    items.retain(|item| !item.is_empty());
    items
}

fn unquote(value: &str) -> String {
    match value
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
    {
        Some(inner) => {
            let mut out = String::with_capacity(inner.len());
            let mut escaped = false;
            for c in inner.chars() {
                if escaped || c != '\\' {
                    out.push(c);
                    escaped = false;
                } else {
                    escaped = true;
                }
            }
            out
        }
        None => value.to_owned(),
    }
}

/// A delta-seconds value (RFC 9111 §1.2.2): digits only; too large saturates at
/// [`MAX_DELTA_SECONDS`].
pub(crate) fn delta_seconds(value: &str) -> Option<u64> {
    let value = value.trim();
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(
        value
            .parse::<u64>()
            .map_or(MAX_DELTA_SECONDS, |v| v.min(MAX_DELTA_SECONDS)),
    )
}

/// How long an answer is fresh by its own headers, in seconds from when it was made
/// (RFC 9111 §4.2.1), as a surrogate sees it: a `Surrogate-Control` or `CDN-Cache-Control`
/// (RFC 9213) `max-age` aimed at caches like this one comes first, then `s-maxage`, then
/// `max-age`, then `Expires` minus `Date`. `None`: the answer gives no freshness at all.
///
/// An invalid value counts as already stale (0), as RFC 9111 asks for `Expires` and
/// `max-age`; so does an `Expires` that does not parse (an invalid `CDN-Cache-Control` is
/// ignored instead: see [`TargetedControl`]).
pub(crate) fn origin_lifetime_secs(
    headers: &HeaderMap,
    control: &ResponseControl,
    response_time_ms: u64,
) -> Option<u64> {
    if let Some(max_age) = control.targeted.max_age {
        return Some(max_age);
    }
    if let Some(s_maxage) = control.s_maxage {
        return Some(s_maxage.unwrap_or(0));
    }
    if let Some(max_age) = control.max_age {
        return Some(max_age.unwrap_or(0));
    }
    let expires = headers.get(header::EXPIRES)?;
    let Some(expires) = http_date_secs(expires) else {
        return Some(0);
    };
    let date = headers
        .get(header::DATE)
        .and_then(http_date_secs)
        .unwrap_or(response_time_ms / 1000);
    Some(expires.saturating_sub(date).min(MAX_DELTA_SECONDS))
}

/// The heuristic lifetime of an answer that gives no freshness (RFC 9111 §4.2.2): `fraction`
/// of the time between its `Last-Modified` and its `Date` (or its arrival). `None` without
/// a usable `Last-Modified`.
pub(crate) fn heuristic_lifetime_secs(
    headers: &HeaderMap,
    fraction: f64,
    response_time_ms: u64,
) -> Option<u64> {
    let modified = http_date_secs(headers.get(header::LAST_MODIFIED)?)?;
    let date = headers
        .get(header::DATE)
        .and_then(http_date_secs)
        .unwrap_or(response_time_ms / 1000);
    let since = date.saturating_sub(modified);
    // Whole seconds; the fraction is validated to 0..=1, so this cannot overflow.
    Some((since as f64 * fraction.clamp(0.0, 1.0)) as u64)
}

/// The name this cache answers to in `Surrogate-Control` (Edge Architecture): a directive
/// `max-age=60;cacheguard` is aimed at it, and it says so to the origin with
/// [`SURROGATE_CAPABILITY_VALUE`].
pub(crate) const SURROGATE_TARGET: &str = "cacheguard";
/// The `Surrogate-Capability` request header a fetch carries in origin mode.
pub(crate) const SURROGATE_CAPABILITY_VALUE: &str = "cacheguard=\"Surrogate/1.0\"";

/// The directives of `Surrogate-Control` aimed at this cache: untargeted ones, and those
/// targeted at [`SURROGATE_TARGET`] (`max-age=60;cacheguard`), the target removed. Those
/// aimed at another surrogate are left out.
fn surrogate_directives(headers: &HeaderMap) -> Vec<(String, Option<String>)> {
    let ours = |target: &str| target.trim().eq_ignore_ascii_case(SURROGATE_TARGET);
    let mut out = Vec::new();
    for (name, value) in directives(headers, &SURROGATE_CONTROL) {
        let (name, value) = match (name.split_once(';'), value) {
            (Some((name, target)), None) if ours(target) => (name.to_owned(), None),
            (Some(_), _) => continue,
            (None, Some(value)) => match value.split_once(';') {
                Some((value, target)) if ours(target) => (name, Some(value.to_owned())),
                Some(_) => continue,
                None => (name, Some(value)),
            },
            (None, None) => (name, None),
        };
        out.push((name, value));
    }
    out
}

/// The cache directives of `CDN-Cache-Control` (RFC 9213) that are set, each with its
/// delta-seconds value when it has one (`max-age=60`; larger than [`MAX_DELTA_SECONDS`]
/// saturates). Its field lines are one Structured Field Dictionary (RFC 9651 §3.2, lines
/// joined by commas); parameters are ignored, and a Boolean `?0` leaves a directive unset.
///
/// `None` — the field is to be ignored as a whole — when it is absent or empty, when it
/// does not parse as a Dictionary (`&&&`, `max-age =60`, an upper-case key), or when a
/// cache directive of RFC 9111 has a value of another type than its own (`max-age="60"`,
/// an inner list, a negative age). Unknown directives are allowed, whatever their value.
fn cdn_directives(headers: &HeaderMap) -> Option<Vec<(String, Option<u64>)>> {
    use sfv::{BareItem, ListEntry};

    let mut dictionary = sfv::Dictionary::new();
    for line in headers.get_all(&CDN_CACHE_CONTROL) {
        dictionary = sfv::Parser::new(line.as_bytes())
            .parse_dictionary_with_visitor(dictionary)
            .ok()?;
    }
    if dictionary.is_empty() {
        return None;
    }
    let mut out = Vec::new();
    for (name, member) in &dictionary {
        let name = name.as_str();
        let Some(kind) = DirectiveType::of(name) else {
            continue;
        };
        let ListEntry::Item(item) = member else {
            return None;
        };
        let (set, seconds) = match (kind, &item.bare_item) {
            (DirectiveType::Seconds, BareItem::Integer(n)) => {
                let n = u64::try_from(*n).ok()?;
                (true, Some(n.min(MAX_DELTA_SECONDS)))
            }
            (DirectiveType::Flag | DirectiveType::FlagOrFields, BareItem::Boolean(set)) => {
                (*set, None)
            }
            // `no-cache="Set-Cookie"`, `private="x"`: a field list; the whole answer is
            // treated so, as for `Cache-Control`.
            (DirectiveType::FlagOrFields, BareItem::String(_)) => (true, None),
            _ => return None,
        };
        if set {
            out.push((name.to_owned(), seconds));
        }
    }
    Some(out)
}

/// The value type a cache directive of RFC 9111 §5.2.2 has in a Structured Field
/// (RFC 9213 §2.2).
#[derive(Clone, Copy)]
enum DirectiveType {
    /// An Integer of seconds, not negative.
    Seconds,
    /// A Boolean (no value).
    Flag,
    /// A Boolean, or a String listing field names.
    FlagOrFields,
}

impl DirectiveType {
    fn of(name: &str) -> Option<DirectiveType> {
        Some(match name {
            "max-age" | "s-maxage" | "stale-while-revalidate" | "stale-if-error" => {
                DirectiveType::Seconds
            }
            "no-store" | "must-revalidate" | "proxy-revalidate" | "public" | "must-understand"
            | "no-transform" | "immutable" => DirectiveType::Flag,
            "no-cache" | "private" => DirectiveType::FlagOrFields,
            _ => return None,
        })
    }
}

/// An HTTP-date as seconds since the Unix epoch.
fn http_date_secs(value: &http::HeaderValue) -> Option<u64> {
    let date = httpdate::parse_http_date(value.to_str().ok()?).ok()?;
    Some(date.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs())
}

pub(crate) static SURROGATE_CONTROL: HeaderName = HeaderName::from_static("surrogate-control");
static CDN_CACHE_CONTROL: HeaderName = HeaderName::from_static("cdn-cache-control");

/// What an answer's `Vary` names.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Vary {
    /// No `Vary` (or an empty one).
    None,
    /// `*`: the answer depends on more than request headers; never reused.
    Any,
    /// These request headers (lowercase, deduplicated, in order of first mention).
    Headers(Vec<HeaderName>),
}

impl Vary {
    /// The `Vary` of `headers`, over all its field lines. A member that is not a valid
    /// header name makes the whole answer [`Vary::Any`]: a cache cannot match on it.
    pub(crate) fn of(headers: &HeaderMap) -> Vary {
        let mut names: Vec<HeaderName> = Vec::new();
        for line in headers.get_all(header::VARY) {
            let Ok(line) = line.to_str() else {
                return Vary::Any;
            };
            for member in line.split(',').map(str::trim).filter(|m| !m.is_empty()) {
                if member == "*" {
                    return Vary::Any;
                }
                let Ok(name) = HeaderName::from_bytes(member.as_bytes()) else {
                    return Vary::Any;
                };
                if !names.contains(&name) {
                    names.push(name);
                }
            }
        }
        if names.is_empty() {
            Vary::None
        } else {
            Vary::Headers(names)
        }
    }
}

/// The age of an answer when it arrived here (RFC 9111 §4.2.3, `corrected_initial_age`):
/// the larger of its apparent age (arrival time minus its `Date`) and its `Age` plus the
/// time the request took. `Age` as sent by the origin or a cache upstream is kept this
/// way, so a downstream cache never keeps the copy fresh longer than the origin allowed.
pub(crate) fn initial_age_secs(headers: &HeaderMap, response_time_ms: u64, delay_ms: u64) -> u64 {
    let corrected_age = age_value(headers)
        .unwrap_or(0)
        .saturating_add(delay_ms / 1000);
    let apparent_age = headers
        .get(header::DATE)
        .and_then(http_date_secs)
        .map_or(0, |date| (response_time_ms / 1000).saturating_sub(date));
    apparent_age.max(corrected_age).min(MAX_DELTA_SECONDS)
}

/// The `Age` of an answer (RFC 9111 §5.1): a list-valued `Age` (several members on a line,
/// or several lines) counts by its first member, and an invalid one (`abc`, `-7200`,
/// `7200.0`, empty) is ignored: `None`, as if there were no `Age`. An age is not taken as
/// stale for being unreadable: the origin's own lifetime still bounds the copy.
///
/// A member's parameters are dropped (`7200;foo=bar` is 7200). RFC 9111 has `Age` as a
/// bare delta-seconds, so a strict reading would ignore such a value; a parameter extends
/// a valid age rather than breaking it, and keeping the number is the conservative reading
/// (the older copy is the one served less), which both versions of the public cache test
/// suite expect.
fn age_value(headers: &HeaderMap) -> Option<u64> {
    let first_line = headers.get(header::AGE)?.to_str().ok()?;
    let first_member = first_line.split(',').next()?;
    let number = first_member.split(';').next()?;
    delta_seconds(number)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use http::HeaderValue;

    /// A header map of `(name, value)` pairs, repeated names appended.
    pub(crate) fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    fn control(value: &'static str) -> ResponseControl {
        ResponseControl::parse(&headers(&[("cache-control", value)]))
    }

    #[test]
    fn directives_are_case_insensitive_and_span_lines() {
        let c = ResponseControl::parse(&headers(&[
            ("cache-control", "Max-Age=60, MUST-REVALIDATE"),
            ("cache-control", "s-maxage=\"30\""),
        ]));
        assert_eq!(c.max_age, Some(Some(60)));
        assert_eq!(c.s_maxage, Some(Some(30)));
        assert!(c.must_revalidate && c.forbids_stale());
    }

    #[test]
    fn quoted_commas_do_not_split() {
        let c = control("private=\"a, b\", max-age=5");
        assert!(c.private);
        assert_eq!(c.max_age, Some(Some(5)));
        assert!(control("no-cache=\"set-cookie\"").no_cache);
    }

    #[test]
    fn bad_and_huge_delta_seconds() {
        assert_eq!(control("max-age=abc").max_age, Some(None));
        assert_eq!(control("max-age=-1").max_age, Some(None));
        assert_eq!(
            control("max-age=99999999999999999999999").max_age,
            Some(Some(MAX_DELTA_SECONDS))
        );
        assert_eq!(control("max-age=1, max-age=9").max_age, Some(Some(1)));
    }

    #[test]
    fn what_forbids_stale() {
        assert!(!control("max-age=2").forbids_stale());
        assert!(!control("max-age=2, stale-while-revalidate=10").forbids_stale());
        assert!(control("max-age=2, must-revalidate").forbids_stale());
        assert!(control("proxy-revalidate").forbids_stale());
        assert!(control("s-maxage=2").forbids_stale());
    }

    #[test]
    fn vary_members() {
        assert_eq!(Vary::of(&HeaderMap::new()), Vary::None);
        assert_eq!(Vary::of(&headers(&[("vary", "")])), Vary::None);
        assert_eq!(Vary::of(&headers(&[("vary", "Foo, *")])), Vary::Any);
        assert_eq!(Vary::of(&headers(&[("vary", "a b")])), Vary::Any);
        assert_eq!(
            Vary::of(&headers(&[("vary", "Foo, accept"), ("vary", "foo,Bar")])),
            Vary::Headers(vec![
                HeaderName::from_static("foo"),
                HeaderName::from_static("accept"),
                HeaderName::from_static("bar"),
            ])
        );
    }

    #[test]
    fn origin_lifetime_precedence() {
        let life = |pairs: &[(&'static str, &'static str)]| {
            let h = headers(pairs);
            origin_lifetime_secs(&h, &ResponseControl::parse(&h), 100_000)
        };
        assert_eq!(life(&[]), None);
        assert_eq!(life(&[("cache-control", "max-age=60")]), Some(60));
        assert_eq!(
            life(&[("cache-control", "max-age=60, s-maxage=5")]),
            Some(5)
        );
        assert_eq!(
            life(&[
                ("cache-control", "s-maxage=5"),
                ("surrogate-control", "max-age=3600")
            ]),
            Some(3600)
        );
        assert_eq!(life(&[("cdn-cache-control", "max-age=7")]), Some(7));
        assert_eq!(life(&[("cache-control", "max-age=x")]), Some(0));
        let dated = [
            ("date", "Thu, 01 Jan 1970 00:01:00 GMT"),
            ("expires", "Thu, 01 Jan 1970 00:02:30 GMT"),
        ];
        assert_eq!(life(&dated), Some(90));
        assert_eq!(
            life(&[("expires", "0")]),
            Some(0),
            "an invalid Expires is stale"
        );
        // Without Date, the time the answer arrived stands in for it.
        assert_eq!(
            life(&[("expires", "Thu, 01 Jan 1970 00:02:30 GMT")]),
            Some(50)
        );
        let targeted = |pairs: &[(&'static str, &'static str)]| {
            ResponseControl::parse(&headers(pairs)).targeted
        };
        assert!(targeted(&[("surrogate-control", "no-store")]).no_store);
        let sc = |v: &'static str| targeted(&[("surrogate-control", v)]);
        assert_eq!(sc("max-age=10;cacheguard").max_age, Some(10));
        assert_eq!(sc("max-age=10;other").max_age, None);
        assert_eq!(sc("max-age=10;other, max-age=5").max_age, Some(5));
        assert_eq!(sc("max-age=x").max_age, Some(0), "invalid: stale");
        assert!(sc("no-store;cacheguard").no_store);
        assert!(!sc("no-store;other").no_store);
        assert_eq!(
            targeted(&[
                ("surrogate-control", "max-age=5"),
                ("cdn-cache-control", "max-age=60, private")
            ]),
            TargetedControl {
                max_age: Some(5),
                private: true,
                ..TargetedControl::default()
            },
            "the first field's max-age, either field's restrictions"
        );
        let modified = headers(&[
            ("date", "Thu, 01 Jan 1970 00:16:40 GMT"),
            ("last-modified", "Thu, 01 Jan 1970 00:00:00 GMT"),
        ]);
        assert_eq!(heuristic_lifetime_secs(&modified, 0.1, 0), Some(100));
        assert_eq!(heuristic_lifetime_secs(&HeaderMap::new(), 0.1, 0), None);
    }

    #[test]
    fn initial_age_keeps_the_upstream_age() {
        let h = headers(&[("age", "2000")]);
        assert_eq!(initial_age_secs(&h, 1_000_000, 0), 2000);
        assert_eq!(initial_age_secs(&h, 1_000_000, 3_500), 2003);
        assert_eq!(initial_age_secs(&HeaderMap::new(), 1_000_000, 0), 0);
        // Apparent age from Date, when larger.
        let dated = headers(&[("date", "Thu, 01 Jan 1970 00:00:10 GMT"), ("age", "5")]);
        assert_eq!(initial_age_secs(&dated, 100_000, 0), 90);
        // A Date in the future is no negative age.
        assert_eq!(initial_age_secs(&dated, 1_000, 0), 5);
        let huge = headers(&[("age", "2147483649")]);
        assert_eq!(initial_age_secs(&huge, 5_000, 0), MAX_DELTA_SECONDS);
    }

    /// RFC 9111 §5.1: a list-valued `Age` counts by its first member, an invalid one is
    /// ignored (no age, not stale). The public cache test suite's newer version expects
    /// this; its 0.4.5 took both as stale.
    #[test]
    fn a_list_age_counts_by_its_first_member_and_an_invalid_one_is_ignored() {
        let age = |pairs: &[(&'static str, &'static str)]| age_value(&headers(pairs));
        for (value, expected) in [
            ("0, 7200", Some(0)),
            ("7200, 0", Some(7200)),
            ("7200,0", Some(7200)),
            ("0, 0", Some(0)),
            (" 60 ", Some(60)),
            ("7200;foo=bar", Some(7200)),
            ("7200;foo=111", Some(7200)),
            ("abc", None),
            ("-7200", None),
            ("7200.0", None),
            ("", None),
            (", 7200", None),
        ] {
            assert_eq!(age(&[("age", value)]), expected, "Age: {value}");
        }
        assert_eq!(age(&[("age", "0"), ("age", "7200")]), Some(0));
        assert_eq!(age(&[("age", "7200"), ("age", "0")]), Some(7200));
        assert_eq!(age(&[("age", "abc"), ("age", "7200")]), None);
        let ignored = headers(&[("age", "abc")]);
        assert_eq!(initial_age_secs(&ignored, 5_000, 0), 0, "not stale");
    }

    /// RFC 9213: `CDN-Cache-Control` is a Structured Field Dictionary; one that is not,
    /// or whose cache directives have the wrong types, is ignored whole.
    #[test]
    fn cdn_cache_control_is_a_structured_dictionary() {
        let cdn = |lines: &[&'static str]| {
            let pairs: Vec<_> = lines.iter().map(|l| ("cdn-cache-control", *l)).collect();
            ResponseControl::parse(&headers(&pairs)).targeted
        };
        let max_age = |n: u64| TargetedControl {
            max_age: Some(n),
            ..TargetedControl::default()
        };
        assert_eq!(cdn(&["max-age=3600"]), max_age(3600));
        assert_eq!(cdn(&["foobar, max-age=3600"]), max_age(3600));
        assert_eq!(cdn(&["max-age=3600;cacheguard"]), max_age(3600));
        assert_eq!(cdn(&["max-age=99999999999"]), max_age(MAX_DELTA_SECONDS));
        assert!(cdn(&["max-age=60", "private"]).private);
        assert!(cdn(&["private"]).private);
        assert!(cdn(&["no-cache"]).no_cache);
        assert!(cdn(&["no-cache=\"set-cookie\""]).no_cache);
        assert!(cdn(&["no-store"]).no_store);
        assert!(
            !cdn(&["no-store=?0"]).no_store,
            "a false Boolean sets nothing"
        );
        assert!(cdn(&["must-revalidate, max-age=5"]).forbids_stale);
        assert_eq!(cdn(&["ext=(a b), x=\"y\", max-age=1"]), max_age(1));
        for invalid in [
            "max-age=10000, &&&&&",
            "max-age=\"10000\"",
            "max-age =100",
            "max-age= 100",
            "MaX-aGe=3600",
            "max-age=-1",
            "max-age=1.5",
            "max-age=(1 2)",
            "no-store=1",
            "private=tok",
            "",
        ] {
            assert_eq!(
                cdn(&[invalid]),
                TargetedControl::default(),
                "CDN-Cache-Control: {invalid}"
            );
        }
        assert_eq!(
            cdn(&["max-age=60", "no-store=\"x\""]),
            TargetedControl::default(),
            "a bad line spoils the whole field"
        );
        // Ignored, it leaves Cache-Control in charge.
        let both = headers(&[
            ("cdn-cache-control", "max-age=\"10000\""),
            ("cache-control", "no-store"),
        ]);
        let control = ResponseControl::parse(&both);
        assert!(control.no_store && control.targeted.max_age.is_none());
    }

    #[test]
    fn targeted_no_cache_and_max_age_against_cache_control() {
        let parse =
            |pairs: &[(&'static str, &'static str)]| ResponseControl::parse(&headers(pairs));
        let cdn_no_cache = parse(&[
            ("cdn-cache-control", "no-cache"),
            ("cache-control", "max-age=10000"),
        ]);
        assert!(cdn_no_cache.no_cache(true) && cdn_no_cache.no_cache(false));
        let replaced = parse(&[
            ("cdn-cache-control", "max-age=60"),
            ("cache-control", "no-cache"),
        ]);
        assert!(replaced.targeted_rules(true) && !replaced.no_cache(true));
        assert!(!replaced.targeted_rules(false) && replaced.no_cache(false));
    }
}
