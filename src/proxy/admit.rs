//! What a request must be before it is routed at all, whatever its route: one it fails is
//! answered here and never reaches the origin.
//!
//! - `Host` (RFC 9112 §3.2): an HTTP/1.1 request without one, any request with more than
//!   one, or one whose value is not `host[:port]` (empty, with whitespace, with userinfo
//!   such as `good@evil`, a bracketed literal that is not IPv6) gets 400. HTTP/2 names its target in `:authority`, which hyper
//!   puts in the URI; HTTP/1.0 may omit `Host`.
//! - `Connection` may not name `Host`, `Content-Length` or `Transfer-Encoding`: a proxy drops
//!   what `Connection` names before forwarding, so such a request would reach the origin
//!   with other framing or another target than cacheguard saw (400).
//! - Methods: `TRACE` (it would reflect the request, cookies and all) and `CONNECT`
//!   (cacheguard is no tunnel) get 405 on any path. `PURGE` and `BAN` get 405 unless a route
//!   takes them (checked by the router): purges belong to the admin listener.
//! - A request target longer than `server.max_header_bytes` gets 414; one with bytes that
//!   are not ASCII (they must be percent-encoded) 400.
//! - A method longer than [`MAX_METHOD_BYTES`], or one that is not a token (RFC 9110 §9.1,
//!   §5.6.2), gets 400: hyper takes a method of any length up to its read buffer, and
//!   would have it forwarded.

use std::cell::RefCell;

use http::header::{self, HeaderMap};
use http::{Method, Request, Version};

use crate::error::ProxyError;

/// The longest method taken, in bytes. The longest registered in the IANA HTTP Method
/// Registry is 17 (`UPDATEREDIRECTREF`); an extension method is a short verb too. nginx
/// and Varnish bound a method only by their head buffers (1 KiB, 8 KiB) and hyper by its
/// read buffer, so a "method" of hundreds of bytes reached the origin, whose own parser
/// may refuse or misread it. Twice the longest registered method leaves room for any
/// extension in use.
pub(crate) const MAX_METHOD_BYTES: usize = 32;

/// Checks `request`'s target, `Host`, `Connection` and method.
///
/// # Errors
/// The answer to give instead: 400, 405 or 414.
pub(crate) fn check<B>(request: &Request<B>, max_header_bytes: usize) -> Result<(), ProxyError> {
    let target = request.uri().path_and_query().map_or("", |pq| pq.as_str());
    if target.len() > max_header_bytes {
        return Err(ProxyError::UriTooLong(max_header_bytes));
    }
    // RFC 3986 allows only ASCII in a URI; other bytes are to be percent-encoded (RFC 9112
    // §3.2: a server should answer 400 to an invalid request-line).
    if !target.is_ascii() {
        return Err(ProxyError::BadRequest("request target is not ASCII"));
    }
    check_method(request.method())?;
    check_host(request)?;
    check_connection(request.headers())?;
    if request.method() == Method::TRACE || request.method() == Method::CONNECT {
        return Err(ProxyError::MethodNotAllowed);
    }
    Ok(())
}

/// Whether `method` is one only a cache understands (`PURGE`, `BAN`): refused with 405 when
/// no route takes it.
pub(crate) fn is_cache_method(method: &Method) -> bool {
    matches!(method.as_str(), "PURGE" | "BAN")
}

fn check_method(method: &Method) -> Result<(), ProxyError> {
    let name = method.as_str();
    if name.len() > MAX_METHOD_BYTES {
        return Err(ProxyError::BadRequest(
            "method longer than 32 bytes (the longest registered is 17)",
        ));
    }
    // http's parser takes only token bytes already; this keeps the rule here, in one place.
    if name.is_empty() || !name.bytes().all(is_tchar) {
        return Err(ProxyError::BadRequest("method is not a token"));
    }
    Ok(())
}

/// RFC 9110 §5.6.2 `tchar`.
pub(crate) fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn check_host<B>(request: &Request<B>) -> Result<(), ProxyError> {
    let mut hosts = request.headers().get_all(header::HOST).iter();
    let Some(host) = hosts.next() else {
        return if request.version() == Version::HTTP_11 && request.uri().authority().is_none() {
            Err(ProxyError::BadRequest("no Host header"))
        } else {
            Ok(())
        };
    };
    if hosts.next().is_some() {
        return Err(ProxyError::BadRequest("more than one Host header"));
    }
    if !valid_host(host.as_bytes()) {
        return Err(ProxyError::BadRequest("invalid Host header"));
    }
    Ok(())
}

/// `uri-host [ ":" port ]` (RFC 9110 §7.2): a registered name (unreserved, sub-delims and
/// percent-encoded bytes), an IPv4 address or a bracketed IP literal, then digits after a
/// colon. Not empty, no userinfo.
///
/// http's parser copies the value it parses, and every request carries a `Host`: the last
/// value found valid on this thread is remembered, and the same bytes again (the usual
/// case: one client, one host) are valid without a parse.
fn valid_host(value: &[u8]) -> bool {
    thread_local! {
        static LAST_VALID: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    if !value.is_empty() && LAST_VALID.with_borrow(|last| last.as_slice() == value) {
        return true;
    }
    let valid = parse_host(value);
    if valid {
        LAST_VALID.with_borrow_mut(|last| {
            last.clear();
            last.extend_from_slice(value);
        });
    }
    valid
}

fn parse_host(value: &[u8]) -> bool {
    if value.is_empty() || value.contains(&b'@') {
        return false;
    }
    let Ok(text) = std::str::from_utf8(value) else {
        return false;
    };
    // http's authority parser knows the grammar; the userinfo it would accept is out above.
    let Ok(authority) = text.parse::<http::uri::Authority>() else {
        return false;
    };
    let host = authority.host();
    // An IP literal in brackets is an IPv6 address (IPvFuture is not in use).
    if let Some(literal) = host.strip_prefix('[') {
        let inner = literal.strip_suffix(']').unwrap_or(literal);
        if inner.parse::<std::net::Ipv6Addr>().is_err() {
            return false;
        }
    }
    !host.is_empty()
        && authority.as_str().len() == text.len()
        && (text.len() == host.len() || authority.port().is_some())
}

fn check_connection(headers: &HeaderMap) -> Result<(), ProxyError> {
    for value in headers.get_all(header::CONNECTION) {
        let names = value.to_str().unwrap_or("");
        for name in names.split(',') {
            let name = name.trim();
            if name.eq_ignore_ascii_case("host")
                || name.eq_ignore_ascii_case("content-length")
                || name.eq_ignore_ascii_case("transfer-encoding")
            {
                return Err(ProxyError::BadRequest(
                    "Connection names Host, Content-Length or Transfer-Encoding",
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(version: Version, headers: &[(&str, &str)]) -> Request<()> {
        let mut builder = Request::builder().uri("/a").version(version);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).expect("request")
    }

    fn status(version: Version, headers: &[(&str, &str)]) -> u16 {
        match check(&request(version, headers), 1024) {
            Ok(()) => 200,
            Err(error) => error.status().as_u16(),
        }
    }

    #[test]
    fn host_rules() {
        let v11 = Version::HTTP_11;
        assert_eq!(status(v11, &[("host", "example.com")]), 200);
        assert_eq!(status(v11, &[("host", "example.com:8080")]), 200);
        assert_eq!(status(v11, &[("host", "127.0.0.1:80")]), 200);
        assert_eq!(status(v11, &[("host", "[::1]:80")]), 200);
        assert_eq!(status(v11, &[]), 400, "HTTP/1.1 without Host");
        assert_eq!(status(Version::HTTP_10, &[]), 200, "HTTP/1.0 may omit it");
        assert_eq!(status(v11, &[("host", "a"), ("host", "a")]), 400);
        assert_eq!(status(v11, &[("host", "")]), 400);
        assert_eq!(status(v11, &[("host", "a b")]), 400);
        assert_eq!(status(v11, &[("host", "good@evil")]), 400);
        assert_eq!(status(v11, &[("host", "a:b")]), 400);
        assert_eq!(status(v11, &[("host", "a:")]), 400);
        assert_eq!(status(v11, &[("host", "a/b")]), 400);
        assert_eq!(status(v11, &[("host", "[127.0.0.1]")]), 400);
        assert_eq!(status(v11, &[("host", "[::1")]), 400);
    }

    /// The remembered last valid `Host` answers only for the same bytes: a valid value
    /// seen before does not make a longer or shorter one valid.
    #[test]
    fn a_remembered_host_vouches_for_itself_only() {
        assert!(valid_host(b"example.com:8080"));
        assert!(valid_host(b"example.com:8080"));
        assert!(!valid_host(b"example.com:8080@evil"));
        assert!(!valid_host(b"example.com:"));
        assert!(!valid_host(b""));
        assert!(valid_host(b"example.com:8080"));
    }

    #[test]
    fn connection_may_not_name_framing_or_host() {
        let ok = [("host", "a")];
        assert_eq!(status(Version::HTTP_11, &ok), 200);
        for named in ["Content-Length", "close, Host", "transfer-encoding"] {
            let headers = [("host", "a"), ("connection", named)];
            assert_eq!(status(Version::HTTP_11, &headers), 400, "{named}");
        }
        let keep = [("host", "a"), ("connection", "keep-alive, x-trace")];
        assert_eq!(status(Version::HTTP_11, &keep), 200);
    }

    #[test]
    fn methods_and_target_length() {
        for (method, expected) in [("TRACE", 405), ("CONNECT", 405), ("GET", 200)] {
            let request = Request::builder()
                .method(method)
                .uri(if method == "CONNECT" {
                    "evil.example:443"
                } else {
                    "/a"
                })
                .header("host", "a")
                .body(())
                .expect("request");
            let got = check(&request, 1024).map_or_else(|e| e.status().as_u16(), |()| 200);
            assert_eq!(got, expected, "{method}");
        }
        let long = Request::builder()
            .uri(format!("/{}", "a".repeat(2000)))
            .header("host", "a")
            .body(())
            .expect("request");
        assert_eq!(
            check(&long, 1024).map_err(|e| e.status().as_u16()),
            Err(414)
        );
        let encoded = Request::builder()
            .uri("/caf%C3%A9")
            .header("host", "a")
            .body(())
            .expect("request");
        assert!(check(&encoded, 1024).is_ok(), "percent-encoded is fine");
        assert!(is_cache_method(
            &Method::from_bytes(b"PURGE").expect("method")
        ));
        assert!(!is_cache_method(&Method::DELETE));
    }

    #[test]
    fn methods_are_short_tokens() {
        let status = |method: &str| {
            let request = Request::builder()
                .method(method)
                .uri("/a")
                .header("host", "a")
                .body(())
                .expect("request");
            check(&request, 1024).map_or_else(|e| e.status().as_u16(), |()| 200)
        };
        assert_eq!(status("UPDATEREDIRECTREF"), 200);
        assert_eq!(status(&"M".repeat(MAX_METHOD_BYTES)), 200);
        assert_eq!(status(&"M".repeat(MAX_METHOD_BYTES + 1)), 400);
        assert_eq!(status(&"M".repeat(300)), 400);
        assert!("!#$%&'*+-.^_`|~aZ09".bytes().all(is_tchar));
        assert!(!"(),/:;<=>?@[]{} \"\t".bytes().any(is_tchar));
    }
}
