//! Cache key derivation.
//!
//! The key and the URL forwarded to the origin come from one parse of the request: the
//! normalized path, the query as the route's policy keeps it, and the values of the route's
//! `vary` headers. Whatever is not in the key is not forwarded either ("forward only what you
//! key"), so two requests with one key can never make the origin answer differently.
//!
//! Keys are hashed to 128 bits (xxh3) for L1 and Redis; the full key travels inside the
//! stored entry and is compared on read, so a hash collision is a miss, never a wrong answer.
//!
//! Every key also has a *base*: the key of the same route and path without query and
//! without `vary` values. All variants of a path share their base's generation and Redis
//! hash tag, so a write invalidates them together and the variants are found from the base
//! (an index kept next to it) without scanning Redis. A request without query or `vary`
//! values is its own base.
//!
//! A *Vary variant* ([`selected`]) is one more level: on a `freshness = "origin"` route an
//! origin answer whose `Vary` names headers the route does not key is stored under the
//! URL's key extended with those names and the request's normalized values of them (as
//! `Entry::selects` compares them). It has the URL key's base, so it is a variant of the
//! path like a query variant: same generation, hash tag and variant index.

use std::ops::Range;

use http::{HeaderMap, HeaderName, HeaderValue};

use super::entry::selecting_value;

use crate::config::{QueryPolicy, RouteConfig};

/// A derived cache key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CacheKey {
    /// `route \n path \n query \n vary…`; stored in the entry and compared on read.
    pub(crate) full: String,
    /// xxh3-128 of `full`.
    pub(crate) hash: u128,
    /// xxh3-128 of the base key (route and path only); equal to `hash` for the base itself.
    pub(crate) base: u128,
    /// xxh3-128 of the URL's key this one was [`selected`] from by an origin's `Vary`;
    /// equal to `hash` for a URL's own key.
    pub(crate) url: u128,
}

/// What the read path needs from one parse of the request: the key, and where in its
/// text the path and query to send to the origin are (a hit needs no forwarded URL, so it
/// is made only when asked for).
#[derive(Debug)]
pub(crate) struct Derived {
    pub(crate) key: CacheKey,
    path: Range<usize>,
    query: Range<usize>,
}

impl Derived {
    /// Path and query to send to the origin (normalized, unkeyed parameters removed).
    pub(crate) fn forward_path_and_query(&self) -> String {
        let path = self.key.full.get(self.path.clone()).unwrap_or("/");
        let query = self.key.full.get(self.query.clone()).unwrap_or("");
        if query.is_empty() {
            return path.to_owned();
        }
        let mut forward = String::with_capacity(path.len() + 1 + query.len());
        forward.push_str(path);
        forward.push('?');
        forward.push_str(query);
        forward
    }

    /// The same request under `key`, a [`selected`] Vary variant of this one's key (whose
    /// text begins with this key's: the path and query are where they were).
    pub(crate) fn with_key(&self, key: CacheKey) -> Derived {
        debug_assert!(key.full.starts_with(&self.key.full));
        Derived {
            key,
            path: self.path.clone(),
            query: self.query.clone(),
        }
    }
}

impl CacheKey {
    /// A key that is its own base.
    pub(crate) fn new(full: String) -> Self {
        let hash = xxhash_rust::xxh3::xxh3_128(full.as_bytes());
        CacheKey {
            full,
            hash,
            base: hash,
            url: hash,
        }
    }

    /// The normalized path this key was derived from.
    pub(crate) fn path(&self) -> &str {
        route_and_path(&self.full).map_or("", |(_, path)| path)
    }

    /// Whether this key is a variant (query or `vary` values) of another, its base.
    pub(crate) fn is_variant(&self) -> bool {
        self.hash != self.base
    }

    /// Whether this key is a Vary variant of a URL's key (see [`selected`]).
    pub(crate) fn is_selected(&self) -> bool {
        self.hash != self.url
    }
}

/// The Vary variant of the URL key `url` for a request with `headers`, whose origin
/// answers vary on `names` (headers the route does not key): `url`'s text, then a line
/// `vary <name>=<value>` per name, with the value normalized as a `Vary` selection compares
/// it (`Entry::selects`), so two requests one stored answer selects share the variant.
/// A header name cannot contain a space, so these lines never read as a keyed header's.
/// Same base as `url` (a purge of the path drops it); its `url` is `url`'s hash.
pub(crate) fn selected(url: &CacheKey, names: &[HeaderName], headers: &HeaderMap) -> CacheKey {
    selected_by(
        url,
        names
            .iter()
            .map(|name| (name, selecting_value(headers, name))),
    )
}

/// The Vary variant of `url` whose selecting headers have these (normalized) values: the
/// one a stored copy with this `Entry::selecting` answers.
pub(crate) fn selected_by<'a>(
    url: &CacheKey,
    selection: impl IntoIterator<Item = (&'a HeaderName, Option<HeaderValue>)>,
) -> CacheKey {
    let mut full = url.full.clone();
    for (name, value) in selection {
        full.push_str("\nvary ");
        full.push_str(name.as_str());
        // Absent is not the empty value: no `=`. Non-UTF-8 bytes are escaped, as in
        // `derive`: they never collide with text.
        if let Some(value) = value {
            full.push('=');
            full.push_str(
                &String::from_utf8_lossy(value.as_bytes())
                    .escape_default()
                    .to_string(),
            );
        }
    }
    let hash = xxhash_rust::xxh3::xxh3_128(full.as_bytes());
    CacheKey {
        full,
        hash,
        base: url.base,
        url: url.hash,
    }
}

/// The route name and path of a full key text (`route \n path \n …`): the one reader of
/// the format [`derive`] writes. `None` for text that is not a key.
pub(crate) fn route_and_path(full: &str) -> Option<(&str, &str)> {
    let mut lines = full.split('\n');
    Some((lines.next()?, lines.next()?))
}

/// The base key of `path` on `route`: no query, no `vary` values.
pub(crate) fn base(route: &RouteConfig, path: &str) -> CacheKey {
    derive(route, path, None, &HeaderMap::new()).key
}

/// Derives the key of a read request on `route`.
pub(crate) fn derive(
    route: &RouteConfig,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
) -> Derived {
    let query = keyed_query(&route.query, query.unwrap_or(""));

    let mut full = String::with_capacity(route.name.len() + path.len() + query.len() + 8);
    full.push_str(&route.name);
    full.push('\n');
    let path_start = full.len();
    normalize_percent_into(&mut full, path);
    let path_range = path_start..full.len();
    full.push('\n');
    let query_range = full.len()..full.len() + query.len();
    full.push_str(&query);
    for name in &route.vary {
        full.push('\n');
        full.push_str(name.as_str());
        full.push('=');
        let mut first = true;
        for value in headers.get_all(name) {
            if !first {
                full.push(',');
            }
            first = false;
            // Non-UTF-8 bytes are kept distinct by escaping them; they never collide with text.
            full.push_str(
                &String::from_utf8_lossy(value.as_bytes())
                    .escape_default()
                    .to_string(),
            );
        }
    }

    let mut key = CacheKey::new(full);
    let path = &key.full[path_range.clone()];
    if key.full.len() != base_len(route, path) {
        key.base = xxhash_rust::xxh3::xxh3_128(base_text(route, path).as_bytes());
    }
    Derived {
        key,
        path: path_range,
        query: query_range,
    }
}

/// The base key's text: `route \n path \n` and each `vary` name with no value. A key of the
/// same length is the base itself (query and values can only add bytes).
fn base_text(route: &RouteConfig, path: &str) -> String {
    let mut text = String::with_capacity(base_len(route, path));
    text.push_str(&route.name);
    text.push('\n');
    text.push_str(path);
    text.push('\n');
    for name in &route.vary {
        text.push('\n');
        text.push_str(name.as_str());
        text.push('=');
    }
    text
}

fn base_len(route: &RouteConfig, path: &str) -> usize {
    route.name.len()
        + path.len()
        + 2
        + route
            .vary
            .iter()
            .map(|n| n.as_str().len() + 2)
            .sum::<usize>()
}

/// The query string the key (and the forwarded URL) carries under `policy`.
fn keyed_query(policy: &QueryPolicy, raw: &str) -> String {
    if matches!(policy, QueryPolicy::Ignore) || raw.is_empty() {
        return String::new();
    }
    let mut pairs: Vec<String> = raw
        .split('&')
        .filter(|p| !p.is_empty())
        .map(normalize_percent)
        .filter(|pair| match policy {
            QueryPolicy::Allow(names) => {
                let name = pair.split_once('=').map_or(pair.as_str(), |(n, _)| n);
                names.iter().any(|allowed| allowed == name)
            }
            _ => true,
        })
        .collect();
    pairs.sort();
    pairs.join("&")
}

/// A matched route's path parameters with their percent-escapes normalized (see
/// [`normalize_percent`]): `%41` and `A` name one resource.
pub(crate) fn normalized_params(params: &[(String, String)]) -> Vec<(String, String)> {
    params
        .iter()
        .map(|(name, value)| (name.clone(), normalize_percent(value)))
        .collect()
}

/// RFC 3986 §6.2.2 normalization: percent-escapes of unreserved characters are decoded,
/// the hex digits of every other escape are uppercased. Meaning is preserved, so the
/// normalized form is also what is forwarded.
pub(crate) fn normalize_percent(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    normalize_percent_into(&mut out, s);
    out
}

/// [`normalize_percent`] of `s`, appended to `out`.
fn normalize_percent_into(out: &mut String, s: &str) {
    let bytes = s.as_bytes();
    if !bytes.contains(&b'%') {
        out.push_str(s);
        return;
    }
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hi = (bytes[i + 1] as char).to_digit(16);
            let lo = (bytes[i + 2] as char).to_digit(16);
            if let (Some(hi), Some(lo)) = (hi, lo) {
                let b = (hi * 16 + lo) as u8;
                if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                    out.push(b as char);
                } else {
                    out.push('%');
                    out.push(bytes[i + 1].to_ascii_uppercase() as char);
                    out.push(bytes[i + 2].to_ascii_uppercase() as char);
                }
                i += 3;
                continue;
            }
        }
        // `s` is a valid &str and we only step over ASCII escapes, so pushing the char at
        // `i` keeps UTF-8 intact.
        let ch = s[i..].chars().next().unwrap_or('\u{fffd}');
        out.push(ch);
        i += ch.len_utf8();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::L1Policy;
    use http::{HeaderName, HeaderValue, Method};
    use std::time::Duration;

    fn route(query: QueryPolicy, vary: &[&'static str]) -> RouteConfig {
        RouteConfig {
            name: "item".into(),
            pattern: "/api/items/{id}".into(),
            methods: vec![Method::GET],
            ttl: Duration::from_secs(60),
            jitter: 0.2,
            grace: Duration::from_secs(30),
            negative_ttl: Duration::from_secs(10),
            max_entry_bytes: 1 << 20,
            l1: L1Policy::Hot,
            freshness: crate::config::FreshnessSource::Route,
            heuristic: 0.0,
            max_variants: 64,
            variant_overflow_rate: 10,
            query,
            vary: vary.iter().map(|v| HeaderName::from_static(v)).collect(),
            forward_client_headers: vec![],
            invalidate: vec![],
            double_delete_delay: Duration::from_secs(1),
            early_refresh_beta: 0.0,
            bloom: None,
            bloom_add: None,
            warmup: None,
            stock: None,
            serialize: None,
            version: None,
            version_floor_ttl: Duration::from_secs(10),
            l1_while_bus_down: crate::config::L1WhileBusDown::Bypass,
        }
    }

    #[test]
    fn sorted_query_is_order_independent() {
        let r = route(QueryPolicy::Sorted, &[]);
        let h = HeaderMap::new();
        let a = derive(&r, "/api/items/1", Some("b=2&a=1"), &h);
        let b = derive(&r, "/api/items/1", Some("a=1&b=2"), &h);
        assert_eq!(a.key, b.key);
        assert_eq!(a.forward_path_and_query(), "/api/items/1?a=1&b=2");
    }

    #[test]
    fn ignored_query_is_neither_keyed_nor_forwarded() {
        let r = route(QueryPolicy::Ignore, &[]);
        let h = HeaderMap::new();
        let a = derive(&r, "/api/items/1", Some("x=1"), &h);
        let b = derive(&r, "/api/items/1", None, &h);
        assert_eq!(a.key, b.key);
        assert_eq!(a.forward_path_and_query(), "/api/items/1");
    }

    #[test]
    fn allow_list_drops_unkeyed_parameters_from_key_and_url() {
        let r = route(QueryPolicy::Allow(vec!["page".into()]), &[]);
        let h = HeaderMap::new();
        let a = derive(&r, "/api/items/1", Some("utm=x&page=2"), &h);
        let b = derive(&r, "/api/items/1", Some("page=2"), &h);
        assert_eq!(a.key, b.key);
        assert_eq!(a.forward_path_and_query(), "/api/items/1?page=2");
        let c = derive(&r, "/api/items/1", Some("page=3"), &h);
        assert_ne!(a.key, c.key);
    }

    #[test]
    fn vary_headers_split_keys() {
        let r = route(QueryPolicy::Sorted, &["accept-language"]);
        let mut en = HeaderMap::new();
        en.insert("accept-language", HeaderValue::from_static("en"));
        let mut de = HeaderMap::new();
        de.insert("accept-language", HeaderValue::from_static("de"));
        assert_ne!(
            derive(&r, "/a", None, &en).key,
            derive(&r, "/a", None, &de).key
        );
    }

    #[test]
    fn percent_encoding_is_normalized() {
        assert_eq!(normalize_percent("/a%41%2f%2F"), "/aA%2F%2F");
        assert_eq!(normalize_percent("/%zz%4"), "/%zz%4");
        assert_eq!(normalize_percent("/ü%41"), "/üA");
        let r = route(QueryPolicy::Sorted, &[]);
        let h = HeaderMap::new();
        assert_eq!(
            derive(&r, "/api/items/%61", None, &h).key,
            derive(&r, "/api/items/a", None, &h).key
        );
    }

    #[test]
    fn variants_share_their_base() {
        let r = route(QueryPolicy::Sorted, &["accept-language"]);
        let none = HeaderMap::new();
        let mut en = HeaderMap::new();
        en.insert("accept-language", HeaderValue::from_static("en"));
        let plain = derive(&r, "/api/items/1", None, &none).key;
        assert!(!plain.is_variant());
        assert_eq!(plain, base(&r, "/api/items/1"));
        let queried = derive(&r, "/api/items/1", Some("a=1"), &none).key;
        let varied = derive(&r, "/api/items/1", None, &en).key;
        for variant in [&queried, &varied] {
            assert!(variant.is_variant());
            assert_eq!(variant.base, plain.hash);
            assert_ne!(variant.hash, plain.hash);
        }
        assert_ne!(derive(&r, "/api/items/2", None, &en).key.base, plain.hash);
    }

    #[test]
    fn vary_variants_are_variants_of_their_url_keys_base() {
        let r = route(QueryPolicy::Sorted, &[]);
        let names = [HeaderName::from_static("accept-language")];
        let with = |value: Option<&'static str>| {
            let mut h = HeaderMap::new();
            if let Some(value) = value {
                h.insert("accept-language", HeaderValue::from_static(value));
            }
            h
        };
        for query in [None, Some("a=1")] {
            let url = derive(&r, "/api/items/1", query, &HeaderMap::new()).key;
            assert!(!url.is_selected());
            let fr = selected(&url, &names, &with(Some("fr")));
            let en = selected(&url, &names, &with(Some("en")));
            let none = selected(&url, &names, &with(None));
            let empty = selected(&url, &names, &with(Some("")));
            for v in [&fr, &en, &none, &empty] {
                assert!(v.is_selected() && v.is_variant());
                assert_eq!((v.base, v.url), (url.base, url.hash));
                assert_eq!(route_and_path(&v.full), Some(("item", "/api/items/1")));
            }
            assert_ne!(fr.hash, en.hash);
            assert_ne!(none.hash, empty.hash, "absent is not empty");
            // What a stored copy's selection makes is the variant of its requests.
            let copy_fr = [(&names[0], Some(HeaderValue::from_static("fr")))];
            assert_eq!(selected_by(&url, copy_fr), fr);
            assert_eq!(selected_by(&url, [(&names[0], None)]), none);
            // Normalized as `Entry::selects` compares: `a, b` and `a,b` are one variant.
            let mut spaced = HeaderMap::new();
            spaced.insert("accept-language", HeaderValue::from_static("fr, en"));
            assert_eq!(
                selected(&url, &names, &spaced),
                selected(&url, &names, &with(Some("fr,en")))
            );
        }
    }

    #[test]
    fn routes_do_not_share_keys() {
        let mut r2 = route(QueryPolicy::Sorted, &[]);
        r2.name = "other".into();
        let h = HeaderMap::new();
        assert_ne!(
            derive(&route(QueryPolicy::Sorted, &[]), "/a", None, &h).key,
            derive(&r2, "/a", None, &h).key
        );
    }
}
