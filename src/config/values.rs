//! What the environment overrides and the file share: the problem type every check
//! reports (`file:line: key: message`), and the value checks both apply.

use std::fmt;
use std::net::SocketAddr;

use http::Uri;

/// One problem in a config source: `file:line: key: message`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigProblem {
    /// The file path, the label given to [`Config::from_toml`], or `environment`.
    pub file: String,
    /// 1-based line; `None` when the problem has no line (environment, unreadable file).
    pub line: Option<usize>,
    /// Dotted key path such as `routes[1].ttl`, or `syntax` / `cannot read`.
    pub key: String,
    /// What was expected and what was found.
    pub message: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}: {}", self.file, line, self.key, self.message),
            None => write!(f, "{}: {}: {}", self.file, self.key, self.message),
        }
    }
}

/// Every problem found in one config source, one per line when displayed.
#[derive(Clone, Debug)]
pub struct ConfigError {
    pub problems: Vec<ConfigProblem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// `example` is the documented default, shown in the message.
pub(super) fn parse_listen(value: &str, example: &str) -> Result<SocketAddr, String> {
    value
        .parse()
        .map_err(|_| format!("expected a socket address like {example:?}, got {value:?}"))
}

pub(super) const UPSTREAM_EXAMPLE: &str = "http://127.0.0.1:9000";

/// `http://host:port[/prefix]`, nothing else.
pub(super) fn parse_upstream_url(value: &str) -> Result<Uri, String> {
    let shown = redact_url(value);
    let expected = format!("expected a URL like \"{UPSTREAM_EXAMPLE}[/prefix]\", got {shown:?}");
    let uri: Uri = value
        .parse()
        .map_err(|error| format!("{expected} ({error})"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(scheme) if scheme.eq_ignore_ascii_case("https") => {
            return Err(format!(
                "https is not supported: the upstream client speaks plain HTTP to a \
                 sidecar-local origin; {expected}"
            ));
        }
        _ => return Err(format!("{expected} (the scheme must be http://)")),
    }
    let Some(authority) = uri.authority() else {
        return Err(format!("{expected} (no host)"));
    };
    if authority.as_str().contains('@') {
        return Err(format!("{expected} (user info is not allowed)"));
    }
    if authority.host().is_empty() {
        return Err(format!("{expected} (no host)"));
    }
    if uri.port_u16().is_none() {
        return Err(format!("{expected} (the port is required)"));
    }
    if uri.query().is_some() || value.contains('#') {
        return Err(format!("{expected} (a query or fragment is not allowed)"));
    }
    Ok(uri)
}

/// `redis://`, `rediss://` or `unix://`, and parseable by the redis client.
pub(super) fn check_redis_url(value: &str) -> Result<(), String> {
    use redis::IntoConnectionInfo;

    let shown = redact_url(value);
    let expected = format!(
        "expected a Redis URL like \"redis://127.0.0.1:6379\" (redis://, rediss:// or unix://), \
         got {shown:?}"
    );
    if !["redis://", "rediss://", "unix://"]
        .iter()
        .any(|scheme| value.starts_with(scheme))
    {
        return Err(expected);
    }
    value
        .into_connection_info()
        .map(|_| ())
        .map_err(|error| format!("{expected} ({error})"))
}

/// A `mysql://` URL the MySQL client can use.
pub(super) fn check_mysql_url(value: &str) -> Result<(), String> {
    value
        .parse::<sqlx::mysql::MySqlConnectOptions>()
        .map(|_| ())
        .map_err(|error| {
            format!(
                "expected a URL like \"mysql://user:password@127.0.0.1:3306/database\", got \
                 {:?} ({error})",
                redact_url(value)
            )
        })
}

pub(super) fn check_token(value: &str) -> Result<(), String> {
    if value.is_empty() {
        Err("expected a non-empty string (omit the token to refuse mutating admin calls)".into())
    } else {
        Ok(())
    }
}

/// Hides the password of `scheme://user:password@host…` so messages never show secrets.
pub(crate) fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let start = scheme_end + 3;
    let end = url[start..].find('/').map_or(url.len(), |i| start + i);
    let Some(at) = url[start..end].rfind('@').map(|i| start + i) else {
        return url.to_owned();
    };
    match url[start..at].split_once(':') {
        Some((user, _password)) => format!("{}{user}:***{}", &url[..start], &url[at..]),
        None => url.to_owned(),
    }
}
