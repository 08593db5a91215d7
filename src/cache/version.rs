//! Row versions, as the origin tells them in a header of its answers (a route's
//! `version = { header }`), and the floors writes set with them.
//!
//! A write whose answer carries version *v* sets its keys' **floor** to *v*: from then on,
//! for `version_floor_ttl`, a fill of those keys whose answer carries an older version
//! (its replica has not caught up with the write yet) is neither stored nor served, and
//! one at or above the floor is stored at once. See `proxy/write.rs` for the write side and
//! `proxy/fetch.rs`, `proxy/fill.rs` for the fill side; the floors live in Redis
//! (`<p>{<base>}:floor`) and, for what this process knows, in [`super::marks`].
//!
//! A version is a non-negative integer: the header's digits (a row version, a µs
//! `updated_at`), or with a date header (`last-modified`, `date`) the HTTP date's seconds
//! since the Unix epoch. Anything else (missing, empty, signs, spaces inside, more than one
//! value, a date before 1970, more than 38 digits) is [`Version::Unparsed`]: counted, and
//! never trusted, since it cannot prove it is at least a floor. In Redis, versions travel
//! as canonical decimal strings (no leading zeros), compared there by length, then digit
//! by digit: exact at any size, without Lua's doubles.

use std::time::Duration;

use http::HeaderMap;

use crate::config::VersionSource;

/// The version an origin answer carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Version {
    At(u128),
    /// Missing or not a version: it proves nothing.
    Unparsed,
}

impl Version {
    /// The version `headers` carry, read as `source` says.
    pub(crate) fn of(headers: &HeaderMap, source: &VersionSource) -> Version {
        Version::read(headers.get_all(source.header()).iter(), source)
    }

    /// The version that `values` (every value of `source`'s header in an answer) tell:
    /// exactly one, that parses.
    pub(crate) fn read<V: AsRef<[u8]>>(
        mut values: impl Iterator<Item = V>,
        source: &VersionSource,
    ) -> Version {
        let (Some(value), None) = (values.next(), values.next()) else {
            return Version::Unparsed;
        };
        let Ok(text) = std::str::from_utf8(value.as_ref()) else {
            return Version::Unparsed;
        };
        let parsed = match source {
            VersionSource::Integer(_) => integer(text),
            VersionSource::Date(_) => httpdate::parse_http_date(text)
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| u128::from(d.as_secs())),
        };
        parsed.map_or(Version::Unparsed, Version::At)
    }

    /// Whether an answer with this version may be stored and served while `floor` holds:
    /// any answer when there is no floor; otherwise only a version at or above it.
    pub(crate) fn reaches(self, floor: Option<u128>) -> bool {
        match (self, floor) {
            (_, None) => true,
            (Version::At(v), Some(floor)) => v >= floor,
            (Version::Unparsed, Some(_)) => false,
        }
    }

    /// The version as the fill script takes it: decimal digits, or `-` for none.
    pub(crate) fn to_arg(self) -> String {
        match self {
            Version::At(v) => v.to_string(),
            Version::Unparsed => "-".to_owned(),
        }
    }
}

/// Decimal digits only (1 to 38 of them, so any fits a `u128`), leading zeros allowed.
fn integer(text: &str) -> Option<u128> {
    if text.is_empty() || text.len() > 38 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A write's floor: fills of its keys older than `version` are refused for `ttl`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Floor {
    pub(crate) version: u128,
    pub(crate) ttl: Duration,
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, HeaderValue};

    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                HeaderName::from_static(name),
                HeaderValue::from_str(value).expect("value"),
            );
        }
        map
    }

    fn integer_source() -> VersionSource {
        VersionSource::Integer(HeaderName::from_static("x-row-version"))
    }

    #[test]
    fn integers_are_digits_only() {
        let source = integer_source();
        let of = |v: &str| Version::of(&headers(&[("x-row-version", v)]), &source);
        assert_eq!(of("42"), Version::At(42));
        assert_eq!(of("0"), Version::At(0));
        assert_eq!(of("007"), Version::At(7), "leading zeros");
        assert_eq!(
            of("12345678901234567890123456789012345678"),
            Version::At(12_345_678_901_234_567_890_123_456_789_012_345_678)
        );
        for garbage in [
            "",
            "-1",
            "+1",
            "1.5",
            "1e3",
            "0x10",
            "12 3",
            "v7",
            "123456789012345678901234567890123456789",
        ] {
            assert_eq!(of(garbage), Version::Unparsed, "{garbage:?}");
        }
        assert_eq!(Version::of(&HeaderMap::new(), &source), Version::Unparsed);
        let two = headers(&[("x-row-version", "1"), ("x-row-version", "2")]);
        assert_eq!(Version::of(&two, &source), Version::Unparsed, "ambiguous");
    }

    #[test]
    fn dates_are_seconds_since_the_epoch() {
        let source = VersionSource::Date(http::header::LAST_MODIFIED);
        let of = |v: &str| Version::of(&headers(&[("last-modified", v)]), &source);
        assert_eq!(of("Thu, 01 Jan 1970 00:16:40 GMT"), Version::At(1000));
        assert_eq!(
            of("Sunday, 06-Nov-94 08:49:37 GMT"),
            Version::At(784_111_777)
        );
        assert_eq!(of("yesterday"), Version::Unparsed);
        assert_eq!(of("1000"), Version::Unparsed);
    }

    #[test]
    fn only_a_version_at_or_above_the_floor_reaches_it() {
        assert!(Version::At(5).reaches(None));
        assert!(Version::Unparsed.reaches(None), "nothing to prove");
        assert!(Version::At(5).reaches(Some(5)));
        assert!(Version::At(6).reaches(Some(5)));
        assert!(!Version::At(4).reaches(Some(5)));
        assert!(!Version::Unparsed.reaches(Some(0)), "never trusted");
        assert_eq!(Version::At(7).to_arg(), "7");
        assert_eq!(Version::Unparsed.to_arg(), "-");
    }
}
