//! `RawConfig` → [`Config`]: the only constructor of the validated configuration.
//!
//! Owns the error model ([`ConfigProblem`], [`ConfigError`]) and every check. Loading runs in
//! three steps:
//!
//! 1. parse: TOML syntax and serde errors (wrong type, bad duration or keyword, unknown or
//!    missing key). These stop at the first problem; `serde_path_to_error` supplies the key
//!    path and toml's span the line.
//! 2. environment overrides (`env.rs`), each checked on its own and reported as
//!    `environment: CACHEGUARD_…: …`.
//! 3. semantic checks (addresses, URLs, ranges, routes), all collected before failing, each
//!    located through the [`Spanned`] values kept in the raw model.
//!
//! Every message reads `file:line: key: what was expected, got what`. Route indexes in keys
//! are 0-based, as in `routes[0].ttl`.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method, StatusCode, Uri};
use toml::Spanned;

use super::env::{Memory, SystemMemory};
use super::raw::{
    NO_SPAN, RawAccessLog, RawAdmin, RawBloom, RawCache, RawConfig, RawHotKeys, RawJournal,
    RawQuery, RawRoute, RawSourceFormat, RawStream, defaults,
};
use super::values::{
    ConfigError, ConfigProblem, UPSTREAM_EXAMPLE, check_redis_url, check_token, parse_listen,
    parse_upstream_url,
};
use super::{
    AccessLogConfig, AccessLogPath, AddFrom, AdminConfig, BloomAdd, BloomConfig, BloomSource,
    CacheDefaults, Config, HotKeysConfig, JournalConfig, JournalFsync, LockConfig, OnTimeout,
    QueryPolicy, RedisConfig, RedisMode, RouteBloom, RouteConfig, ServerConfig, SourceFormat,
    StreamConfig, UpstreamConfig, Vars, WarmupConfig, env,
};
use super::{CLIENT_CLAIMS, LockBackendConfig, METHOD_OVERRIDES, StockConfig};

mod locks;
mod stock;
mod write;

impl std::error::Error for ConfigError {}

impl From<ConfigProblem> for ConfigError {
    fn from(problem: ConfigProblem) -> Self {
        Self {
            problems: vec![problem],
        }
    }
}

pub(super) fn load_file(path: &Path, vars: &dyn Vars) -> Result<Config, ConfigError> {
    let file = path.display().to_string();
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) => {
            return Err(ConfigProblem {
                file,
                line: None,
                key: "cannot read".to_owned(),
                message: error.to_string(),
            }
            .into());
        }
    };
    from_toml(&text, &file, vars)
}

pub(super) fn from_toml(text: &str, source: &str, vars: &dyn Vars) -> Result<Config, ConfigError> {
    from_toml_with(text, source, vars, &SystemMemory)
}

/// [`from_toml`] with the memory limit read from `memory` (tests pass a fixed one).
pub(super) fn from_toml_with(
    text: &str,
    source: &str,
    vars: &dyn Vars,
    memory: &dyn Memory,
) -> Result<Config, ConfigError> {
    let mut raw = parse(text, source)?;
    let mut checker = Checker {
        file: source,
        text,
        memory,
        problems: Vec::new(),
        warnings: Vec::new(),
    };
    env::apply(&mut raw, vars, &mut checker.problems);
    let mut config = checker.config(&raw);
    if checker.problems.is_empty() {
        let mut warnings = checker.warnings;
        warnings.sort_by_key(|warning| warning.line);
        config.warnings = warnings;
        return Ok(config);
    }
    // Environment problems (no line) first, then the file's in line order; the sort is
    // stable, so problems on one line keep the order they were found in.
    let mut problems = checker.problems;
    problems.sort_by_key(|problem| problem.line);
    Err(ConfigError { problems })
}

// === parse ===

fn parse(text: &str, file: &str) -> Result<RawConfig, ConfigProblem> {
    let deserializer = toml::de::Deserializer::parse(text).map_err(|error| {
        let mut message = error
            .message()
            .lines()
            .next()
            .unwrap_or("invalid TOML")
            .to_owned();
        // toml does not name the repeated key; its span does.
        if message == "duplicate key"
            && let Some(key) = error.span().and_then(|span| text.get(span))
        {
            message.push_str(&format!(" {key:?}"));
        }
        // Some errors come without a position (the parser's nesting limit): point at the
        // start, and say so, so every problem still reads `file:line: key: message`.
        let line = line_at(text, error.span()).or_else(|| {
            message.push_str(" (the parser gave no position)");
            Some(1)
        });
        ConfigProblem {
            file: file.to_owned(),
            line,
            key: "syntax".to_owned(),
            message,
        }
    })?;
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let path = key_path(error.path());
        let inner = error.into_inner();
        let (key, message) = describe_serde_error(&path, inner.message());
        ConfigProblem {
            file: file.to_owned(),
            line: line_at(text, inner.span()),
            key,
            message,
        }
    })
}

/// `routes[1].ttl` from serde's path, without the segments `toml::Spanned` adds.
fn key_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;

    let mut key = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => key.push_str(&format!("[{index}]")),
            Segment::Map { key: name } | Segment::Enum { variant: name } => {
                if name.starts_with("$__serde_spanned_private_") {
                    continue;
                }
                if !key.is_empty() {
                    key.push('.');
                }
                key.push_str(name);
            }
            Segment::Unknown => {
                if !key.is_empty() {
                    key.push('.');
                }
                key.push('?');
            }
        }
    }
    key
}

/// 1-based line of a byte offset.
fn line_at(text: &str, span: Option<Range<usize>>) -> Option<usize> {
    let start = span?.start.min(text.len());
    Some(
        text.as_bytes()[..start]
            .iter()
            .filter(|b| **b == b'\n')
            .count()
            + 1,
    )
}

/// Turns serde's message into `key` + `expected …, got …`. serde's wording is stable
/// (`missing field`, `unknown field`, `invalid type`, `invalid value`); anything else (our
/// own custom messages) passes through unchanged.
fn describe_serde_error(path: &str, message: &str) -> (String, String) {
    let key = if path.is_empty() { "config" } else { path };
    if let Some(rest) = message.strip_prefix("missing field `") {
        let field = rest.split('`').next().unwrap_or(rest);
        let key = if path.is_empty() {
            field.to_owned()
        } else {
            format!("{path}.{field}")
        };
        return (key, "required key is missing".to_owned());
    }
    if let Some(rest) = message.strip_prefix("unknown field `") {
        // The path already ends with the unknown key.
        let (_field, expected) = rest.split_once('`').unwrap_or((rest, ""));
        let choices: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
        let text = if choices.is_empty() {
            "unknown key".to_owned()
        } else {
            format!("unknown key, expected one of {}", choices.join(", "))
        };
        return (key.to_owned(), text);
    }
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some((got, expected)) = message
            .strip_prefix(prefix)
            .and_then(|rest| rest.rsplit_once(", expected "))
        {
            let text = format!(
                "expected {}, got {}",
                describe_expected(expected),
                describe_got(got)
            );
            return (key.to_owned(), text);
        }
    }
    (key.to_owned(), message.to_owned())
}

fn describe_expected(expected: &str) -> String {
    let plain = match expected {
        "u64" | "usize" => "a non-negative integer",
        "u32" => "an integer from 0 to 4294967295",
        "u16" => "an integer from 0 to 65535",
        "i64" | "i32" | "isize" => "an integer",
        "f64" | "f32" => "a number",
        "a sequence" => "an array",
        "a map" => "a table",
        other if other.starts_with("struct ") => "a table",
        other => other,
    };
    plain.to_owned()
}

fn describe_got(got: &str) -> String {
    if let Some(quoted) = got.strip_prefix("string ") {
        return quoted.to_owned();
    }
    for kind in ["integer ", "floating point ", "boolean "] {
        if let Some(value) = got.strip_prefix(kind) {
            return value.trim_matches('`').to_owned();
        }
    }
    match got {
        "sequence" => "an array".to_owned(),
        "map" => "a table".to_owned(),
        other => other.to_owned(),
    }
}

fn check_jitter(value: f64) -> Result<f64, String> {
    if (0.0..1.0).contains(&value) {
        Ok(value)
    } else {
        Err(format!(
            "expected a number from 0.0 up to (not including) 1.0, got {value:?}"
        ))
    }
}

fn check_heuristic(value: f64) -> Result<f64, String> {
    if (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(format!(
            "expected a fraction from 0.0 to 1.0 of the time since Last-Modified, got {value:?}"
        ))
    }
}

fn check_beta(value: f64) -> Result<f64, String> {
    if (0.0..=100.0).contains(&value) {
        Ok(value)
    } else {
        Err(format!(
            "expected a number from 0.0 (off) to 100.0, like 1.0, got {value:?}"
        ))
    }
}

fn check_sample(value: f64) -> Result<f64, String> {
    if value > 0.0 && value <= 1.0 {
        Ok(value)
    } else {
        Err(format!(
            "expected a fraction of requests above 0.0 and at most 1.0, like 0.1, got {value:?}"
        ))
    }
}

fn check_filter_name(name: &str) -> Result<(), String> {
    let valid = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '-');
    if !name.is_empty() && name.len() <= 64 && name.chars().all(valid) {
        Ok(())
    } else {
        Err(format!(
            "expected a name of lowercase letters, digits, '_' and '-' (at most 64) like \
             \"items\", got {name:?}"
        ))
    }
}

/// Above this a filter needs gigabytes: surely a typo.
const MAX_EXPECTED_ITEMS: u64 = 2_000_000_000;

fn check_expected_items(value: u64) -> Result<usize, String> {
    if (1..=MAX_EXPECTED_ITEMS).contains(&value) {
        usize::try_from(value).map_err(|_| format!("{value} is too large for this platform"))
    } else {
        Err(format!(
            "expected a count from 1 to {MAX_EXPECTED_ITEMS}, like 1000000, got {value}"
        ))
    }
}

fn check_fp_rate(value: f64) -> Result<f64, String> {
    if value > 0.0 && value <= 0.5 {
        Ok(value)
    } else {
        Err(format!(
            "expected a false-positive rate above 0.0 and at most 0.5, like 0.001, got {value:?}"
        ))
    }
}

/// A source URL: a path on the upstream (`/internal/ids`) or a full `http://` URL.
fn resolve_source_url(value: &str, upstream: &Uri) -> Result<Uri, String> {
    if value.starts_with('/') {
        let authority = upstream
            .authority()
            .map_or_else(String::new, |a| a.as_str().to_owned());
        let prefix = upstream.path().trim_end_matches('/');
        return format!("http://{authority}{prefix}{value}")
            .parse()
            .map_err(|error| {
                format!("expected a path like \"/internal/ids\", got {value:?} ({error})")
            });
    }
    let uri: Uri = value.parse().map_err(|error| {
        format!("expected a path like \"/internal/ids\" or an http:// URL, got {value:?} ({error})")
    })?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(format!(
            "expected a path like \"/internal/ids\" or an http://host:port/… URL, got {value:?}"
        ));
    }
    Ok(uri)
}

fn check_route_name(name: &str) -> Result<(), String> {
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    if !name.is_empty() && name.chars().all(valid) {
        Ok(())
    } else {
        Err(format!(
            "expected a name of letters, digits, '_', '.' and '-' like \"item\", got {name:?}"
        ))
    }
}

/// Checks the syntax of one matchit pattern on its own (conflicts are checked across routes).
fn check_pattern(pattern: &str) -> Result<(), String> {
    if !pattern.starts_with('/') {
        return Err(format!(
            "expected a path pattern starting with \"/\" like \"/api/items/{{id}}\", \
             got {pattern:?}"
        ));
    }
    matchit::Router::<()>::new()
        .insert(pattern, ())
        .map_err(|error| {
            format!(
                "{pattern:?} is not a valid route pattern: {}",
                lowercase_first(&error.to_string())
            )
        })
}

/// Names of the `{param}` and `{*param}` segments of a matchit pattern (`{{` is a literal).
fn pattern_params(pattern: &str) -> Vec<&str> {
    let mut params = Vec::new();
    let mut rest = pattern;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        if let Some(escaped) = after.strip_prefix('{') {
            rest = escaped;
            continue;
        }
        let Some(close) = after.find('}') else { break };
        params.push(after[..close].trim_start_matches('*'));
        rest = &after[close + 1..];
    }
    params
}

fn lowercase_first(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

fn is_write_method(method: &Method) -> bool {
    [Method::POST, Method::PUT, Method::PATCH, Method::DELETE].contains(method)
}

/// The methods a route really answers: `GET` implies `HEAD`.
fn effective_methods(methods: &[Method]) -> Vec<Method> {
    let mut all = methods.to_vec();
    if all.contains(&Method::GET) && !all.contains(&Method::HEAD) {
        all.push(Method::HEAD);
    }
    all
}

/// 127.0.0.0/8 and ::1 (also as `::ffff:127.x.y.z`); `0.0.0.0` and `::` are every address.
fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// The first of `candidates` (key, span) the file sets, so a problem between two keys is
/// reported on a line the user wrote; the first candidate when none is written.
fn first_written<'k>(candidates: &[(&'k str, Range<usize>)]) -> (&'k str, Range<usize>) {
    candidates
        .iter()
        .find(|(_, span)| *span != NO_SPAN)
        .or(candidates.first())
        .map_or(("config", NO_SPAN), |(key, span)| (*key, span.clone()))
}

/// A duration as the file writes it (`"150ms"`, `"3s 233ms"`), to the millisecond.
fn show(duration: Duration) -> String {
    let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    format!(
        "\"{}\"",
        humantime::format_duration(Duration::from_millis(millis))
    )
}

/// Request headers that carry a user's identity: keying on them would store one cache entry
/// per user, and cacheguard never shares per-user responses.
const PER_USER_HEADERS: [&str; 3] = ["authorization", "cookie", "proxy-authorization"];

// === impl Checker ===

/// Collects every semantic problem; values that fail a check are replaced by a placeholder,
/// and the half-built [`Config`] is dropped when any problem was found.
struct Checker<'a> {
    file: &'a str,
    text: &'a str,
    /// The memory the process may use (`cache.l1_max_bytes` must fit).
    memory: &'a dyn Memory,
    problems: Vec<ConfigProblem>,
    /// Kept only when there is no problem (see [`Config::warnings`]).
    warnings: Vec<ConfigProblem>,
}

impl Checker<'_> {
    fn problem(&self, span: Range<usize>, key: String, message: String) -> ConfigProblem {
        ConfigProblem {
            file: self.file.to_owned(),
            line: line_at(self.text, Some(span)),
            key,
            message,
        }
    }

    fn report(&mut self, span: Range<usize>, key: impl Into<String>, message: impl Into<String>) {
        let problem = self.problem(span, key.into(), message.into());
        self.problems.push(problem);
    }

    /// Records a warning: the file is accepted, and the warning is logged at start.
    fn warn(&mut self, span: Range<usize>, key: impl Into<String>, message: impl Into<String>) {
        let warning = self.problem(span, key.into(), message.into());
        self.warnings.push(warning);
    }

    /// Keeps the `Ok` value, or records the message at `span` and returns `None`.
    fn check<T>(&mut self, result: Result<T, String>, span: Range<usize>, key: &str) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(message) => {
                self.report(span, key, message);
                None
            }
        }
    }

    fn listen(&mut self, value: &Spanned<String>, example: &str, key: &str) -> SocketAddr {
        let parsed = parse_listen(value.get_ref(), example);
        self.check(parsed, value.span(), key)
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    fn jitter(&mut self, value: &Spanned<f64>, key: &str) -> f64 {
        let checked = check_jitter(*value.get_ref());
        self.check(checked, value.span(), key).unwrap_or(0.0)
    }

    fn heuristic(&mut self, value: &Spanned<f64>, key: &str) -> f64 {
        let checked = check_heuristic(*value.get_ref());
        self.check(checked, value.span(), key).unwrap_or(0.0)
    }

    fn config(&mut self, raw: &RawConfig) -> Config {
        if *raw.server.max_connections.get_ref() == 0 {
            self.report(
                raw.server.max_connections.span(),
                "server.max_connections",
                "expected an integer of at least 1, got 0",
            );
        }
        let max_headers = *raw.server.max_headers.get_ref();
        if !(1..=defaults::MAX_HEADERS_LIMIT).contains(&max_headers) {
            self.report(
                raw.server.max_headers.span(),
                "server.max_headers",
                format!(
                    "expected an integer from 1 to {} (header fields in one request head), \
                     got {max_headers}",
                    defaults::MAX_HEADERS_LIMIT
                ),
            );
        }
        let [
            header_read_timeout,
            keepalive_timeout,
            lingering_time,
            lingering_timeout,
        ] = [
            (
                &raw.server.header_read_timeout,
                "header_read_timeout",
                "10s",
            ),
            (&raw.server.keepalive_timeout, "keepalive_timeout", "75s"),
            (&raw.server.lingering_time, "lingering_time", "30s"),
            (&raw.server.lingering_timeout, "lingering_timeout", "5s"),
        ]
        .map(|(value, key, example)| {
            let duration = value.get_ref().0;
            if duration.is_zero() {
                self.report(
                    value.span(),
                    format!("server.{key}"),
                    format!("expected a duration above zero like \"{example}\""),
                );
            }
            duration
        });
        if keepalive_timeout < header_read_timeout {
            self.warn(
                raw.server.keepalive_timeout.span(),
                "server.keepalive_timeout",
                format!(
                    "{} is shorter than server.header_read_timeout ({}): an idle connection \
                     is closed after keepalive_timeout; header_read_timeout bounds only a \
                     request head that has begun (keep keepalive_timeout above the idle \
                     timeout of a load balancer in front)",
                    humantime::format_duration(keepalive_timeout),
                    humantime::format_duration(header_read_timeout),
                ),
            );
        }
        let server = ServerConfig {
            max_connections: *raw.server.max_connections.get_ref(),
            max_headers,
            listen: self.listen(&raw.server.listen, defaults::SERVER_LISTEN, "server.listen"),
            max_header_bytes: raw.server.max_header_bytes,
            max_body_bytes: raw.server.max_body_bytes,
            header_read_timeout,
            keepalive_timeout,
            lingering_time,
            lingering_timeout,
            shutdown_grace: raw.server.shutdown_grace.0,
            worker_threads: raw.server.worker_threads,
            body_buffer_bytes: usize::try_from(*raw.server.body_buffer_bytes.get_ref())
                .unwrap_or(usize::MAX),
            body_spool_dir: self.spool_dir(raw.server.body_spool_dir.as_ref()),
        };
        let upstream = self.upstream(raw);
        let redis = raw.redis.as_ref().map(|section| self.redis(section));
        let admin = self.admin(&raw.admin, &server);
        let cache = self.cache(&raw.cache);
        if *raw.lock.max_waiters.get_ref() == 0 {
            self.report(
                raw.lock.max_waiters.span(),
                "lock.max_waiters",
                "expected an integer of at least 1, got 0",
            );
        }
        let lock = LockConfig {
            max_waiters: usize::try_from(*raw.lock.max_waiters.get_ref()).unwrap_or(usize::MAX),
            lease: raw.lock.lease.get_ref().0,
            wait_timeout: raw.lock.wait_timeout.get_ref().0,
            on_timeout: raw.lock.on_timeout.get_ref().0,
            uncacheable_ttl: raw.lock.uncacheable_ttl.0,
            wait_replicas: *raw.lock.wait_replicas.get_ref(),
            wait_replicas_timeout: raw.lock.wait_replicas_timeout.get_ref().0,
        };
        if let Some(redis) = &redis {
            self.lock_fits(raw, &lock, redis, &upstream);
        }
        let bloom = self.blooms(&raw.bloom, &upstream);
        let hot_keys = self.hot_keys(&raw.hot_keys);
        let stock = self.stocks(&raw.stock, &upstream);
        let locks = self.locks(&raw.locks);
        let routes = self.routes(&raw.routes, &cache, &bloom, &stock, redis.as_ref(), &locks);
        self.buffered_fits(raw, &upstream, &cache, &routes);
        let journal = self.journal(&raw.journal);
        let prefix = redis.as_ref().map_or("cg:", |r| r.key_prefix.as_str());
        let stream = self.stream(&raw.invalidation_stream, prefix);
        let access_log = self.access_log(&raw.access_log);
        Config {
            source: self.file.to_owned(),
            server,
            upstream,
            redis,
            admin,
            cache,
            lock,
            routes,
            bloom,
            hot_keys,
            journal,
            stream,
            access_log,
            stock,
            locks,
            warnings: Vec::new(),
        }
    }

    fn access_log(&mut self, raw: &RawAccessLog) -> AccessLogConfig {
        let path = match raw.path.get_ref().as_str() {
            "stdout" => AccessLogPath::Stdout,
            "stderr" => AccessLogPath::Stderr,
            blank if blank.trim().is_empty() => {
                self.report(
                    raw.path.span(),
                    "access_log.path",
                    format!("expected \"stdout\", \"stderr\" or a file path, got {blank:?}"),
                );
                AccessLogPath::Stdout
            }
            // Relative to the config file, like `[journal] path`.
            file => AccessLogPath::File(self.relative_to_config(file)),
        };
        let checked = check_sample(*raw.sample.get_ref());
        let sample = self
            .check(checked, raw.sample.span(), "access_log.sample")
            .unwrap_or(1.0);
        let buffer = *raw.buffer.get_ref();
        if !(1..=defaults::ACCESS_LOG_MAX_BUFFER).contains(&buffer) {
            self.report(
                raw.buffer.span(),
                "access_log.buffer",
                format!(
                    "expected a count of lines from 1 to {}, got {buffer}",
                    defaults::ACCESS_LOG_MAX_BUFFER
                ),
            );
        }
        AccessLogConfig {
            format: raw.format.0,
            path,
            sample,
            query: raw.query,
            buffer: buffer.clamp(1, defaults::ACCESS_LOG_MAX_BUFFER),
        }
    }

    fn journal(&mut self, raw: &RawJournal) -> JournalConfig {
        let path = match &raw.path {
            Some(path) if path.get_ref().trim().is_empty() => {
                self.report(
                    path.span(),
                    "journal.path",
                    "expected a file path, got \"\"".to_owned(),
                );
                PathBuf::from(defaults::JOURNAL_FILE)
            }
            Some(path) => PathBuf::from(path.get_ref()),
            None => PathBuf::from(defaults::JOURNAL_FILE),
        };
        // Relative to the config file, so a service manager's working directory does not
        // decide where owed invalidations go.
        let path = self.relative_to_config(&path.to_string_lossy());
        let fsync = match &raw.fsync {
            None => JournalFsync::Always,
            Some(value) => match value.get_ref().as_str() {
                "always" => JournalFsync::Always,
                "never" => JournalFsync::Never,
                other => match humantime::parse_duration(other) {
                    Ok(every) if !every.is_zero() => JournalFsync::Interval(every),
                    _ => {
                        self.report(
                            value.span(),
                            "journal.fsync",
                            format!(
                                "expected \"always\", \"never\" or an interval like \"1s\", got {other:?}"
                            ),
                        );
                        JournalFsync::Always
                    }
                },
            },
        };
        JournalConfig { path, fsync }
    }

    fn stream(&mut self, raw: &RawStream, prefix: &str) -> StreamConfig {
        let key = match &raw.key {
            Some(key) if key.get_ref().is_empty() => {
                self.report(
                    key.span(),
                    "invalidation_stream.key",
                    "expected a Redis key, got \"\"".to_owned(),
                );
                format!("{prefix}invalidate")
            }
            Some(key) => key.get_ref().clone(),
            None => format!("{prefix}invalidate"),
        };
        let group = raw.group.get_ref();
        if group.is_empty() || group.len() > 200 {
            self.report(
                raw.group.span(),
                "invalidation_stream.group",
                format!("expected a group name of 1 to 200 bytes, got {group:?}"),
            );
        }
        let batch = *raw.batch.get_ref();
        if !(1..=10_000).contains(&batch) {
            self.report(
                raw.batch.span(),
                "invalidation_stream.batch",
                format!("expected a count from 1 to 10000, got {batch}"),
            );
        }
        StreamConfig {
            enabled: raw.enabled,
            key,
            group: group.clone(),
            batch: batch.clamp(1, 10_000),
            claim_idle: raw.claim_idle.0.max(std::time::Duration::from_millis(100)),
        }
    }

    fn hot_keys(&mut self, raw: &RawHotKeys) -> HotKeysConfig {
        let threshold_rps = *raw.threshold_rps.get_ref();
        let cool_rps = match &raw.cool_rps {
            Some(cool) if threshold_rps > 0 && *cool.get_ref() >= threshold_rps => {
                self.report(
                    cool.span(),
                    "hot_keys.cool_rps",
                    format!(
                        "expected a rate below threshold_rps ({threshold_rps}), got {}",
                        cool.get_ref()
                    ),
                );
                threshold_rps / 2
            }
            Some(cool) => *cool.get_ref(),
            None => threshold_rps / 2,
        };
        let max_hot_keys = *raw.max_hot_keys.get_ref();
        if !(1..=100_000).contains(&max_hot_keys) {
            self.report(
                raw.max_hot_keys.span(),
                "hot_keys.max_hot_keys",
                format!("expected a count from 1 to 100000, got {max_hot_keys}"),
            );
        }
        HotKeysConfig {
            threshold_rps,
            cool_rps,
            window: raw.window.0.max(std::time::Duration::from_millis(10)),
            l1_ttl: raw.l1_ttl.0,
            max_backend_rps_per_key: raw.max_backend_rps_per_key,
            max_hot_keys: max_hot_keys.clamp(1, 100_000),
        }
    }

    fn upstream(&mut self, raw: &RawConfig) -> UpstreamConfig {
        let absent = Spanned::new(NO_SPAN, Default::default());
        let section = raw.upstream.as_ref().unwrap_or(&absent);
        let up = section.get_ref();
        let url = match &up.url {
            Some(url) => {
                let parsed = parse_upstream_url(url.get_ref());
                self.check(parsed, url.span(), "upstream.url")
            }
            None => {
                self.report(
                    section.span(),
                    "upstream.url",
                    format!(
                        "required key is missing: expected the origin URL like \
                         \"{UPSTREAM_EXAMPLE}\" (or set CACHEGUARD_UPSTREAM)"
                    ),
                );
                None
            }
        };
        let max_concurrency = *up.max_concurrency.get_ref();
        if max_concurrency == 0 {
            self.report(
                up.max_concurrency.span(),
                "upstream.max_concurrency",
                "expected an integer of at least 1, got 0",
            );
        }
        let pool_idle_timeout = up.pool_idle_timeout.get_ref().0;
        if pool_idle_timeout.is_zero() {
            self.report(
                up.pool_idle_timeout.span(),
                "upstream.pool_idle_timeout",
                "expected a duration above zero like \"4s\" (pool_max_idle = 0 keeps no idle \
                 connection)",
            );
        }
        let upload_timeout = up.upload_timeout.get_ref().0;
        if upload_timeout.is_zero() {
            self.report(
                up.upload_timeout.span(),
                "upstream.upload_timeout",
                "expected a duration above zero like \"10s\"",
            );
        }
        let upload_deadline = up.upload_deadline.get_ref().0;
        if upload_deadline.is_zero() {
            self.report(
                up.upload_deadline.span(),
                "upstream.upload_deadline",
                "expected a duration above zero like \"5m\" (every request body has a \
                 deadline; make it long for large uploads)",
            );
        }
        UpstreamConfig {
            url: url.unwrap_or_default(),
            timeout: up.timeout.get_ref().0,
            upload_timeout,
            upload_min_rate: up.upload_min_rate,
            upload_deadline,
            connect_timeout: up.connect_timeout.0,
            max_concurrency,
            max_rps: up.max_rps,
            queue_timeout: up.queue_timeout.0,
            max_buffered_bytes: *up.max_buffered_bytes.get_ref(),
            pool_max_idle: up.pool_max_idle,
            pool_idle_timeout,
        }
    }

    fn redis(&mut self, section: &Spanned<super::raw::RawRedis>) -> RedisConfig {
        let redis = section.get_ref();
        let mode = match &redis.mode {
            None => RedisMode::Standalone,
            Some(mode) => match mode.get_ref().as_str() {
                "standalone" => RedisMode::Standalone,
                "sentinel" => RedisMode::Sentinel,
                "cluster" => RedisMode::Cluster,
                other => {
                    self.report(
                        mode.span(),
                        "redis.mode",
                        format!(
                            "expected \"standalone\", \"sentinel\" or \"cluster\", got {other:?}"
                        ),
                    );
                    RedisMode::Standalone
                }
            },
        };
        let mut urls = Vec::new();
        for (i, url) in redis.urls.iter().flat_map(|u| u.get_ref()).enumerate() {
            let checked = check_redis_url(url.get_ref()).and_then(|()| {
                if url.get_ref().starts_with("unix://") {
                    Err(format!(
                        "a unix socket cannot be a {} node; expected redis:// or rediss://",
                        mode.as_str()
                    ))
                } else {
                    Ok(())
                }
            });
            if self
                .check(checked, url.span(), &format!("redis.urls[{i}]"))
                .is_some()
            {
                urls.push(url.get_ref().clone());
            }
        }
        let mut url = String::new();
        match mode {
            RedisMode::Standalone => {
                if let Some(list) = &redis.urls {
                    self.report(
                        list.span(),
                        "redis.urls",
                        "urls is for mode = \"sentinel\" or \"cluster\"; a standalone Redis \
                         takes one url",
                    );
                }
                url = self.redis_url(section);
            }
            RedisMode::Cluster => {
                // One seed may come as `url` (as from `CACHEGUARD_REDIS_URL`).
                if redis.url.is_some() {
                    let seed = self.redis_url(section);
                    if !seed.is_empty() && !urls.contains(&seed) {
                        urls.insert(0, seed);
                    }
                } else if redis.urls.as_ref().is_none_or(|u| u.get_ref().is_empty()) {
                    self.report(
                        section.span(),
                        "redis.urls",
                        "required key is missing: expected the cluster's seed nodes like \
                         [\"redis://10.0.0.1:6379\", \"redis://10.0.0.2:6379\"]",
                    );
                }
            }
            RedisMode::Sentinel => {
                if let Some(given) = &redis.url {
                    self.report(
                        given.span(),
                        "redis.url",
                        "mode = \"sentinel\" finds the primary through the sentinels: list \
                         them in urls (and name the primary in master_name) instead",
                    );
                }
                if redis.urls.as_ref().is_none_or(|u| u.get_ref().is_empty()) {
                    self.report(
                        section.span(),
                        "redis.urls",
                        "required key is missing: expected the sentinels like \
                         [\"redis://10.0.0.1:26379\", \"redis://10.0.0.2:26379\"]",
                    );
                }
            }
        }
        let master_name = match (&redis.master_name, mode) {
            (Some(name), RedisMode::Sentinel) if name.get_ref().trim().is_empty() => {
                self.report(
                    name.span(),
                    "redis.master_name",
                    "expected a non-empty name",
                );
                String::new()
            }
            (Some(name), RedisMode::Sentinel) => name.get_ref().clone(),
            (None, RedisMode::Sentinel) => {
                self.report(
                    section.span(),
                    "redis.master_name",
                    "required key is missing: expected the name the sentinels monitor the \
                     primary under, like \"mymaster\"",
                );
                String::new()
            }
            (Some(name), _) => {
                self.report(
                    name.span(),
                    "redis.master_name",
                    "master_name is only for mode = \"sentinel\"",
                );
                String::new()
            }
            (None, _) => String::new(),
        };
        let password = match (&redis.password, &redis.password_file) {
            (Some(_), Some(file)) => {
                self.report(
                    file.span(),
                    "redis.password_file",
                    "set either password or password_file, not both",
                );
                None
            }
            (Some(password), None) => Some(password.get_ref().clone()),
            (None, Some(file)) => {
                let path = self.relative_to_config(file.get_ref());
                let read = std::fs::read_to_string(&path)
                    .map_err(|error| format!("cannot read {}: {error}", path.display()))
                    .and_then(|text| {
                        let secret = text.trim_end_matches(['\r', '\n']).to_owned();
                        if secret.is_empty() {
                            Err(format!("{} is empty", path.display()))
                        } else {
                            Ok(secret)
                        }
                    });
                self.check(read, file.span(), "redis.password_file")
            }
            (None, None) => None,
        };
        let password_file = redis
            .password_file
            .as_ref()
            .filter(|_| password.is_some())
            .map(|file| self.relative_to_config(file.get_ref()));
        let tls_ca = redis.tls_ca_file.as_ref().and_then(|file| {
            let path = self.relative_to_config(file.get_ref());
            let read = std::fs::read(&path)
                .map_err(|error| format!("cannot read {}: {error}", path.display()))
                .and_then(|pem| {
                    if String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                        Ok((path.clone(), pem))
                    } else {
                        Err(format!("{} holds no PEM certificate", path.display()))
                    }
                });
            self.check(read, file.span(), "redis.tls_ca_file")
        });
        let breaker_failures = *redis.breaker_failures.get_ref();
        if breaker_failures == 0 {
            self.report(
                redis.breaker_failures.span(),
                "redis.breaker_failures",
                "expected an integer of at least 1, got 0",
            );
        }
        RedisConfig {
            mode,
            url,
            urls,
            master_name,
            username: redis.username.as_ref().map(|u| u.get_ref().clone()),
            password,
            password_file,
            tls_ca,
            command_timeout: redis.command_timeout.get_ref().0,
            connect_timeout: redis.connect_timeout.0,
            key_prefix: redis.key_prefix.clone(),
            breaker_failures,
        }
    }

    /// `redis.url`, checked; reported as missing when absent.
    fn redis_url(&mut self, section: &Spanned<super::raw::RawRedis>) -> String {
        match &section.get_ref().url {
            Some(url) => {
                let checked = check_redis_url(url.get_ref());
                self.check(checked, url.span(), "redis.url");
                url.get_ref().clone()
            }
            None => {
                self.report(
                    section.span(),
                    "redis.url",
                    "required key is missing: expected a Redis URL like \
                     \"redis://127.0.0.1:6379\" (or remove [redis] for embedded mode)",
                );
                String::new()
            }
        }
    }

    /// A path from the config, relative to the config file's directory.
    /// `server.body_spool_dir` (relative to the config file; the system's temporary
    /// directory when unset), refused unless an anonymous file can be made in it now: a
    /// write's body over `body_buffer_bytes` waits there.
    fn spool_dir(&mut self, raw: Option<&Spanned<String>>) -> PathBuf {
        let (dir, span) = match raw {
            Some(dir) if dir.get_ref().trim().is_empty() => {
                self.report(
                    dir.span(),
                    "server.body_spool_dir",
                    "expected a directory path, got \"\"",
                );
                return std::env::temp_dir();
            }
            Some(dir) => (self.relative_to_config(dir.get_ref()), dir.span()),
            None => (std::env::temp_dir(), NO_SPAN),
        };
        if let Err(error) = tempfile::tempfile_in(&dir) {
            self.report(
                span,
                "server.body_spool_dir",
                format!(
                    "cannot make a temporary file in {}: {error} (request bodies over \
                     server.body_buffer_bytes are spooled there)",
                    dir.display()
                ),
            );
        }
        dir
    }

    fn relative_to_config(&self, path: &str) -> PathBuf {
        let path = Path::new(path);
        match Path::new(self.file).parent() {
            Some(dir) if path.is_relative() && !dir.as_os_str().is_empty() => dir.join(path),
            _ => path.to_path_buf(),
        }
    }

    fn admin(&mut self, raw: &RawAdmin, server: &ServerConfig) -> AdminConfig {
        let listen = self.listen(&raw.listen, defaults::ADMIN_LISTEN, "admin.listen");
        let proxy = server.listen;
        let overlaps = listen.port() != 0
            && listen.port() == proxy.port()
            && (listen.ip() == proxy.ip()
                || listen.ip().is_unspecified()
                || proxy.ip().is_unspecified());
        if overlaps {
            self.report(
                raw.listen.span(),
                "admin.listen",
                format!("expected an address apart from server.listen ({proxy}), got \"{listen}\""),
            );
        }
        let token = match &raw.token {
            Some(token) => {
                let checked = check_token(token.get_ref());
                self.check(checked, token.span(), "admin.token");
                Some(token.get_ref().clone())
            }
            None => None,
        };
        // Only a parsed address (a bad one is reported above, as `listen` is a placeholder).
        let parsed = parse_listen(raw.listen.get_ref(), defaults::ADMIN_LISTEN).is_ok();
        if parsed && token.is_none() && !is_loopback(listen.ip()) {
            self.report(
                raw.listen.span(),
                "admin.listen",
                format!(
                    "\"{listen}\" is reachable from other hosts and admin.token is not set: \
                     /metrics, /admin/config and /admin/hotkeys would be open to the network; \
                     set admin.token (or CACHEGUARD_ADMIN_TOKEN) and keep the port private, or \
                     listen on a loopback address like \"{}\"",
                    defaults::ADMIN_LISTEN
                ),
            );
        }
        let purge_burst = *raw.purge_burst.get_ref();
        if raw.purge_rate > 0 && purge_burst == 0 {
            self.report(
                raw.purge_burst.span(),
                "admin.purge_burst",
                "expected an integer of at least 1 with admin.purge_rate above 0 (no purge \
                 could ever pass), got 0",
            );
        }
        AdminConfig {
            listen,
            token,
            purge_rate: raw.purge_rate,
            purge_burst,
        }
    }

    /// The lock's timings against Redis's and the origin's (shared mode only).
    fn lock_fits(
        &mut self,
        raw: &RawConfig,
        lock: &LockConfig,
        redis: &RedisConfig,
        upstream: &UpstreamConfig,
    ) {
        let lease = lock.lease;
        let command_timeout = redis.command_timeout;
        let command_timeout_span = raw
            .redis
            .as_ref()
            .map_or(NO_SPAN, |r| r.get_ref().command_timeout.span());
        let lease_at = ("lock.lease", raw.lock.lease.span());
        let command_timeout_at = ("redis.command_timeout", command_timeout_span);

        // The holder renews its lease every lease/3, each renewal bounded by
        // command_timeout: one that times out must leave time for another before the lease
        // runs out (2/3 of the lease + one command_timeout), so lease >= 3 × command_timeout.
        let renewable = lease >= command_timeout.saturating_mul(3);
        if !renewable {
            let (key, span) = first_written(&[lease_at.clone(), command_timeout_at.clone()]);
            self.report(
                span,
                key,
                format!(
                    "lock.lease ({}) is below 3 × redis.command_timeout ({}): the lease is \
                     renewed every lease/3 and a renewal may take command_timeout, so one \
                     renewal that times out would leave no time for the next before the lease \
                     runs out and another instance fetches the same key; set lock.lease to at \
                     least {} or lower redis.command_timeout",
                    show(lease),
                    show(command_timeout),
                    show(command_timeout.saturating_mul(3))
                ),
            );
        }

        // A waiter that gives up after more than the holder's whole fetch, then fetches
        // itself, has waited for nothing.
        if lock.on_timeout == OnTimeout::Origin && lock.wait_timeout > upstream.timeout {
            let upstream_timeout_span = raw
                .upstream
                .as_ref()
                .map_or(NO_SPAN, |up| up.get_ref().timeout.span());
            let (key, span) = first_written(&[
                ("lock.wait_timeout", raw.lock.wait_timeout.span()),
                ("upstream.timeout", upstream_timeout_span),
                ("lock.on_timeout", raw.lock.on_timeout.span()),
            ]);
            self.report(
                span,
                key,
                format!(
                    "lock.wait_timeout ({}) is longer than upstream.timeout ({}) with \
                     lock.on_timeout = \"origin\": a waiter would outwait the holder's whole \
                     fetch (which has answered or timed out by then) and then fetch from the \
                     origin itself; set lock.wait_timeout to at most upstream.timeout, or \
                     on_timeout = \"error\"",
                    show(lock.wait_timeout),
                    show(upstream.timeout)
                ),
            );
        }

        if lock.wait_replicas == 0 {
            return;
        }
        let replicas_timeout_at = (
            "lock.wait_replicas_timeout",
            raw.lock.wait_replicas_timeout.span(),
        );
        let replicas_at = ("lock.wait_replicas", raw.lock.wait_replicas.span());
        // A won lock WAITs for its replicas (up to wait_replicas_timeout, its answer up to
        // one more command_timeout: that WAIT is never counted as a Redis failure) before
        // the fetch starts, and the first renewal comes lease/3 later and may take
        // command_timeout: all of it within the lease, or the lock is gone before it is
        // first renewed.
        let room = (lease.saturating_mul(2) / 3).saturating_sub(command_timeout.saturating_mul(2));
        if renewable && lock.wait_replicas_timeout > room {
            let (key, span) = first_written(&[
                replicas_timeout_at.clone(),
                lease_at,
                command_timeout_at,
                replicas_at.clone(),
            ]);
            self.report(
                span,
                key,
                format!(
                    "lock.wait_replicas_timeout ({}) does not fit in lock.lease ({}): a won \
                     lock waits that long for its replicas (its answer up to \
                     redis.command_timeout more) before the fetch starts, and is first renewed \
                     lease/3 later, within command_timeout; so wait_replicas_timeout + 2 × \
                     command_timeout must be at most 2/3 of the lease. Set \
                     wait_replicas_timeout to at most {}, or raise lock.lease",
                    show(lock.wait_replicas_timeout),
                    show(lease),
                    show(room)
                ),
            );
        }
        // Waiters on other instances give up after wait_timeout; a WAIT as long makes them
        // all give up whenever the replicas lag, before the holder has even started.
        if lock.wait_replicas_timeout >= lock.wait_timeout {
            let (key, span) = first_written(&[
                replicas_timeout_at,
                ("lock.wait_timeout", raw.lock.wait_timeout.span()),
                replicas_at,
            ]);
            let what = match lock.on_timeout {
                OnTimeout::Origin => "each fetch the key from the origin itself",
                OnTimeout::Error => "each answer 503",
            };
            self.warn(
                span,
                key,
                format!(
                    "lock.wait_replicas_timeout ({}) is not below lock.wait_timeout ({}): \
                     while the replicas lag, a won lock waits for them that long before its \
                     fetch starts, so the other instances' waiters give up first and {what}; \
                     set wait_replicas_timeout well below wait_timeout",
                    show(lock.wait_replicas_timeout),
                    show(lock.wait_timeout)
                ),
            );
        }
    }

    /// Every route's largest answer must fit in `upstream.max_buffered_bytes`: a fetch
    /// reserves its `max_entry_bytes` there before it starts.
    fn buffered_fits(
        &mut self,
        raw: &RawConfig,
        upstream: &UpstreamConfig,
        cache: &CacheDefaults,
        routes: &[RouteConfig],
    ) {
        let budget = upstream.max_buffered_bytes;
        let span = raw
            .upstream
            .as_ref()
            .map_or(NO_SPAN, |up| up.get_ref().max_buffered_bytes.span());
        if budget < 1024 {
            self.report(
                span,
                "upstream.max_buffered_bytes",
                format!("expected at least 1024 bytes, got {budget}"),
            );
            return;
        }
        // A write's body reserves its in-memory part in the same budget.
        let body_buffer = *raw.server.body_buffer_bytes.get_ref();
        if body_buffer > budget {
            self.report(
                raw.server.body_buffer_bytes.span(),
                "server.body_buffer_bytes",
                format!(
                    "{body_buffer} is above upstream.max_buffered_bytes ({budget}), where it \
                     is reserved: one request body would hold the whole budget"
                ),
            );
        }
        if cache.max_entry_bytes as u64 > budget {
            self.report(
                span,
                "upstream.max_buffered_bytes",
                format!(
                    "{budget} is below cache.max_entry_bytes ({}): no answer of that size \
                     could ever be fetched",
                    cache.max_entry_bytes
                ),
            );
        }
        for (i, (route, raw_route)) in routes.iter().zip(&raw.routes).enumerate() {
            if route.max_entry_bytes as u64 > budget
                && route.max_entry_bytes != cache.max_entry_bytes
            {
                self.report(
                    raw_route.span(),
                    format!("routes[{i}].max_entry_bytes"),
                    format!(
                        "{} is above upstream.max_buffered_bytes ({budget}): no answer of that \
                         size could ever be fetched",
                        route.max_entry_bytes
                    ),
                );
            }
        }
    }

    fn cache(&mut self, raw: &RawCache) -> CacheDefaults {
        let ttl = raw.ttl.get_ref().0;
        self.ttl_above_zero(ttl, raw.ttl.span(), "cache.ttl");
        self.l1_fits(&raw.l1_max_bytes);
        CacheDefaults {
            ttl,
            jitter: self.jitter(&raw.jitter, "cache.jitter"),
            grace: raw.grace.0,
            negative_ttl: raw.negative_ttl.0,
            max_entry_bytes: raw.max_entry_bytes,
            l1_max_bytes: *raw.l1_max_bytes.get_ref(),
            l1: raw.l1.0,
            l1_while_bus_down: raw.l1_while_bus_down.0,
            freshness: raw.freshness.0,
            heuristic: self.heuristic(&raw.heuristic, "cache.heuristic"),
            max_variants: raw.max_variants,
            variant_overflow_rate: raw.variant_overflow_rate,
        }
    }

    fn ttl_above_zero(&mut self, ttl: Duration, span: Range<usize>, key: &str) {
        if ttl.is_zero() {
            self.report(
                span,
                key,
                "expected a duration above zero like \"60s\", got \"0s\": an entry that is \
                 never fresh is stored only to be fetched again; to not cache a path, do not \
                 route it",
            );
        }
    }

    /// L1 must fit in the memory the process may use (the container's limit, or the
    /// machine's memory).
    fn l1_fits(&mut self, value: &Spanned<u64>) {
        let wanted = *value.get_ref();
        let Some(limit) = self.memory.limit() else {
            return;
        };
        if wanted <= limit.bytes {
            return;
        }
        let default = if value.span() == NO_SPAN {
            " (the default)"
        } else {
            ""
        };
        self.report(
            value.span(),
            "cache.l1_max_bytes",
            format!(
                "{wanted}{default} is above the memory this process may use, {} bytes ({}): a \
                 full L1 would get the process killed for lack of memory; set it well below \
                 that",
                limit.bytes, limit.source
            ),
        );
    }

    fn routes(
        &mut self,
        raw: &[Spanned<RawRoute>],
        cache: &CacheDefaults,
        filters: &[BloomConfig],
        gates: &[StockConfig],
        redis: Option<&RedisConfig>,
        locks: &[LockBackendConfig],
    ) -> Vec<RouteConfig> {
        let routes: Vec<RouteConfig> = raw
            .iter()
            .enumerate()
            .map(|(i, route)| self.route(i, route, cache, filters, gates, redis, locks))
            .collect();
        self.unique_names(raw);
        self.distinct_methods(raw, &routes);
        self.routable_together(raw);
        routes
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "the route's index, text and the config's sections it refers to"
    )]
    fn route(
        &mut self,
        i: usize,
        spanned: &Spanned<RawRoute>,
        cache: &CacheDefaults,
        filters: &[BloomConfig],
        gates: &[StockConfig],
        redis: Option<&RedisConfig>,
        locks: &[LockBackendConfig],
    ) -> RouteConfig {
        let raw = spanned.get_ref();
        let key = |field: &str| format!("routes[{i}].{field}");

        let name = raw.name.get_ref();
        self.check(check_route_name(name), raw.name.span(), &key("name"));
        // The pattern's syntax; conflicts between routes are checked in `routable_together`.
        let pattern = raw.pattern.get_ref();
        self.check(check_pattern(pattern), raw.pattern.span(), &key("match"));

        let methods = self.methods(i, spanned);
        let is_read = methods
            .iter()
            .any(|m| m == Method::GET || m == Method::HEAD);

        let jitter = match &raw.jitter {
            Some(jitter) => self.jitter(jitter, &key("jitter")),
            None => cache.jitter,
        };
        let early_refresh_beta = match &raw.early_refresh_beta {
            Some(beta) => {
                let checked = check_beta(*beta.get_ref());
                self.check(checked, beta.span(), &key("early_refresh_beta"))
                    .unwrap_or(0.0)
            }
            None => 0.0,
        };
        if let Some(ttl) = &raw.ttl {
            self.ttl_above_zero(ttl.get_ref().0, ttl.span(), &key("ttl"));
        }
        let query = self.query(i, raw);
        let vary = self.vary(i, raw);
        let forward_client_headers = self.forward_client_headers(i, raw, is_read, &vary);
        let invalidate = self.invalidate(i, raw, is_read);
        let bloom = self.route_bloom(i, raw, is_read, filters);
        let bloom_add = self.bloom_add(i, raw, is_read, filters);
        let warmup = self.warmup(i, raw, is_read);
        let stock = self.route_stock(i, raw, is_read, gates);
        let serialize = self.serialize(i, raw, is_read, redis, locks);
        let (version, version_floor_ttl) = self.version(i, raw, is_read);

        RouteConfig {
            name: name.clone(),
            pattern: pattern.clone(),
            methods,
            ttl: raw.ttl.as_ref().map_or(cache.ttl, |d| d.get_ref().0),
            jitter,
            grace: raw.grace.map_or(cache.grace, |d| d.0),
            negative_ttl: raw.negative_ttl.map_or(cache.negative_ttl, |d| d.0),
            max_entry_bytes: raw.max_entry_bytes.unwrap_or(cache.max_entry_bytes),
            l1: raw.l1.map_or(cache.l1, |l1| l1.0),
            freshness: raw.freshness.map_or(cache.freshness, |f| f.0),
            heuristic: match &raw.heuristic {
                Some(h) => self.heuristic(h, &key("heuristic")),
                None => cache.heuristic,
            },
            max_variants: raw.max_variants.unwrap_or(cache.max_variants),
            variant_overflow_rate: raw
                .variant_overflow_rate
                .unwrap_or(cache.variant_overflow_rate),
            query,
            vary,
            forward_client_headers,
            invalidate,
            double_delete_delay: raw
                .double_delete_delay
                .map_or(defaults::DOUBLE_DELETE_DELAY, |d| d.0),
            early_refresh_beta,
            bloom,
            bloom_add,
            warmup,
            stock,
            serialize,
            version,
            version_floor_ttl,
            l1_while_bus_down: cache.l1_while_bus_down,
        }
    }

    fn warmup(&mut self, i: usize, raw: &RawRoute, is_read: bool) -> Option<WarmupConfig> {
        let spanned = raw.warmup.as_ref()?;
        let warmup = spanned.get_ref();
        let key = format!("routes[{i}].warmup");
        if !is_read {
            self.report(
                spanned.span(),
                key,
                "only read routes (GET/HEAD) warm up; move it to the route that caches",
            );
            return None;
        }
        let pattern = raw.pattern.get_ref();
        let mut router = matchit::Router::new();
        if check_pattern(pattern).is_err() || router.insert(pattern.as_str(), ()).is_err() {
            return None; // reported at routes[i].match
        }
        let mut paths = Vec::new();
        for (j, path) in warmup.paths.iter().enumerate() {
            let text = path.get_ref();
            let bare = text.split('?').next().unwrap_or(text);
            if !bare.starts_with('/') || router.at(bare).is_err() {
                self.report(
                    path.span(),
                    format!("{key}.paths[{j}]"),
                    format!("expected a path this route matches ({pattern:?}), got {text:?}"),
                );
                continue;
            }
            paths.push(text.clone());
        }
        let file = warmup.file.as_ref().map(|f| PathBuf::from(f.get_ref()));
        if paths.is_empty() && file.is_none() && warmup.paths.is_empty() {
            self.report(
                spanned.span(),
                key.clone(),
                "expected paths = [\"/api/items/1\", …] or file = \"/path/to/paths.txt\", got neither",
            );
        }
        let rate = match &warmup.rate {
            Some(rate) if *rate.get_ref() == 0 => {
                self.report(
                    rate.span(),
                    format!("{key}.rate"),
                    "expected paths per second of at least 1, got 0",
                );
                1
            }
            Some(rate) => *rate.get_ref(),
            None => defaults::WARMUP_RATE,
        };
        Some(WarmupConfig { paths, file, rate })
    }

    fn route_bloom(
        &mut self,
        i: usize,
        raw: &RawRoute,
        is_read: bool,
        filters: &[BloomConfig],
    ) -> Option<RouteBloom> {
        let spanned = raw.bloom.as_ref()?;
        let bloom = spanned.get_ref();
        let key = format!("routes[{i}].bloom");
        if !is_read {
            self.report(
                spanned.span(),
                key,
                "only read routes (GET/HEAD) check a Bloom filter; use bloom_add on the \
                 route that creates ids",
            );
            return None;
        }
        let filter = self.filter_name(&bloom.filter, filters, &format!("{key}.filter"))?;
        let param = bloom.param.get_ref();
        let params = pattern_params(raw.pattern.get_ref());
        if !params.contains(&param.as_str()) {
            let known = if params.is_empty() {
                "it has none".to_owned()
            } else {
                format!("{{{}}}", params.join("}, {"))
            };
            self.report(
                bloom.param.span(),
                format!("{key}.param"),
                format!(
                    "expected a parameter of this route's match {:?} ({known}), got {param:?}",
                    raw.pattern.get_ref()
                ),
            );
            return None;
        }
        let status = match &bloom.status {
            Some(status) => {
                let code = *status.get_ref();
                let checked = StatusCode::from_u16(code)
                    .ok()
                    .filter(|s| (200..=599).contains(&s.as_u16()))
                    .ok_or_else(|| format!("expected an HTTP status from 200 to 599, got {code}"));
                self.check(checked, status.span(), &format!("{key}.status"))?
            }
            None => StatusCode::NOT_FOUND,
        };
        Some(RouteBloom {
            filter,
            param: param.clone(),
            status,
            body: bloom
                .body
                .clone()
                .unwrap_or_else(|| defaults::BLOOM_REJECT_BODY.to_owned()),
        })
    }

    fn bloom_add(
        &mut self,
        i: usize,
        raw: &RawRoute,
        is_read: bool,
        filters: &[BloomConfig],
    ) -> Option<BloomAdd> {
        let spanned = raw.bloom_add.as_ref()?;
        let add = spanned.get_ref();
        let key = format!("routes[{i}].bloom_add");
        if is_read {
            self.report(
                spanned.span(),
                key,
                "only write routes (no GET/HEAD) add ids; move it to the route that creates \
                 them",
            );
            return None;
        }
        let filter = self.filter_name(&add.filter, filters, &format!("{key}.filter"))?;
        let from_text = add.from.get_ref();
        let from = if from_text == "location" {
            Ok(AddFrom::Location)
        } else if let Some(pointer) = from_text.strip_prefix("json:") {
            if pointer.starts_with('/') {
                Ok(AddFrom::Json(pointer.to_owned()))
            } else {
                Err(format!(
                    "expected a JSON pointer starting with \"/\" after \"json:\", like \
                     \"json:/id\", got {from_text:?}"
                ))
            }
        } else {
            Err(format!(
                "expected \"location\" or \"json:/pointer\" (like \"json:/id\"), got \
                 {from_text:?}"
            ))
        };
        let from = self.check(from, add.from.span(), &format!("{key}.from"))?;
        Some(BloomAdd { filter, from })
    }

    /// A `filter = "…"` reference must name a `[[bloom]]`.
    fn filter_name(
        &mut self,
        name: &Spanned<String>,
        filters: &[BloomConfig],
        key: &str,
    ) -> Option<String> {
        let wanted = name.get_ref();
        if filters.iter().any(|f| &f.name == wanted) {
            return Some(wanted.clone());
        }
        let known: Vec<String> = filters.iter().map(|f| format!("{:?}", f.name)).collect();
        let expected = if known.is_empty() {
            "a [[bloom]] filter name, but none is defined".to_owned()
        } else {
            format!("the name of a [[bloom]] filter ({})", known.join(", "))
        };
        self.report(
            name.span(),
            key,
            format!("expected {expected}, got {wanted:?}"),
        );
        None
    }

    fn blooms(&mut self, raw: &[Spanned<RawBloom>], upstream: &UpstreamConfig) -> Vec<BloomConfig> {
        let mut seen: HashMap<String, usize> = HashMap::new();
        let mut filters = Vec::new();
        for (i, spanned) in raw.iter().enumerate() {
            let bloom = spanned.get_ref();
            let key = |field: &str| format!("bloom[{i}].{field}");
            let name = bloom.name.get_ref();
            if self
                .check(check_filter_name(name), bloom.name.span(), &key("name"))
                .is_none()
            {
                continue;
            }
            if let Some(first) = seen.get(name) {
                self.report(
                    bloom.name.span(),
                    key("name"),
                    format!("expected a unique filter name, got {name:?} again (bloom[{first}])"),
                );
                continue;
            }
            seen.insert(name.clone(), i);
            let items = *bloom.expected_items.get_ref();
            let expected_items = self.check(
                check_expected_items(items),
                bloom.expected_items.span(),
                &key("expected_items"),
            );
            let fp_rate = self.check(
                check_fp_rate(*bloom.fp_rate.get_ref()),
                bloom.fp_rate.span(),
                &key("fp_rate"),
            );
            let source = self.bloom_source(i, bloom, upstream);
            let (Some(expected_items), Some(fp_rate), Some((source, format))) =
                (expected_items, fp_rate, source)
            else {
                continue;
            };
            filters.push(BloomConfig {
                name: name.clone(),
                expected_items,
                fp_rate,
                refresh: bloom.refresh.map_or(defaults::BLOOM_REFRESH, |d| d.0),
                load_timeout: bloom
                    .load_timeout
                    .map_or(defaults::BLOOM_LOAD_TIMEOUT, |d| d.0),
                source,
                format,
            });
        }
        filters
    }

    fn bloom_source(
        &mut self,
        i: usize,
        bloom: &RawBloom,
        upstream: &UpstreamConfig,
    ) -> Option<(BloomSource, SourceFormat)> {
        let key = format!("bloom[{i}].source");
        let spanned = &bloom.source;
        let source = spanned.get_ref();
        let place = match (&source.url, &source.file) {
            (Some(url), None) => {
                let resolved = resolve_source_url(url.get_ref(), &upstream.url);
                BloomSource::Url(self.check(resolved, url.span(), &format!("{key}.url"))?)
            }
            (None, Some(file)) => {
                if file.get_ref().is_empty() {
                    self.report(
                        file.span(),
                        format!("{key}.file"),
                        "expected a file path, got \"\"",
                    );
                    return None;
                }
                BloomSource::File(file.get_ref().into())
            }
            (Some(_), Some(file)) => {
                self.report(file.span(), key, "expected either url or file, got both");
                return None;
            }
            (None, None) => {
                self.report(
                    spanned.span(),
                    key,
                    "expected url = \"/internal/ids\" (on the upstream, or an http:// URL) or \
                     file = \"/path/to/ids.txt\", got neither",
                );
                return None;
            }
        };
        let format = match (source.format, &source.field) {
            (Some(RawSourceFormat::Ndjson), Some(field)) if !field.get_ref().is_empty() => {
                SourceFormat::Ndjson {
                    field: field.get_ref().clone(),
                }
            }
            (Some(RawSourceFormat::Ndjson), _) => {
                self.report(
                    spanned.span(),
                    format!("{key}.field"),
                    "format = \"ndjson\" needs field = \"…\": the name of the id field",
                );
                return None;
            }
            (_, Some(field)) => {
                self.report(
                    field.span(),
                    format!("{key}.field"),
                    "field is only used with format = \"ndjson\"",
                );
                return None;
            }
            (None | Some(RawSourceFormat::Lines), None) => SourceFormat::Lines,
        };
        Some((place, format))
    }

    fn methods(&mut self, i: usize, spanned: &Spanned<RawRoute>) -> Vec<Method> {
        let Some(list) = &spanned.get_ref().methods else {
            return vec![Method::GET];
        };
        if list.is_empty() {
            self.report(
                spanned.span(),
                format!("routes[{i}].methods"),
                format!(
                    "expected at least one method like {:?}, got an empty array",
                    defaults::ROUTE_METHOD
                ),
            );
        }
        let mut methods: Vec<Method> = Vec::new();
        let mut first_write = None;
        for (j, value) in list.iter().enumerate() {
            let text = value.get_ref();
            let Ok(method) = Method::from_bytes(text.to_ascii_uppercase().as_bytes()) else {
                self.report(
                    value.span(),
                    format!("routes[{i}].methods[{j}]"),
                    format!("expected an HTTP method like \"GET\", got {text:?}"),
                );
                continue;
            };
            if is_write_method(&method) && first_write.is_none() {
                first_write = Some(value.span());
            }
            if !methods.contains(&method) {
                methods.push(method);
            }
        }
        let is_read = methods
            .iter()
            .any(|m| m == Method::GET || m == Method::HEAD);
        if let (true, Some(span)) = (is_read, first_write) {
            let writes: Vec<&str> = methods
                .iter()
                .filter(|m| is_write_method(m))
                .map(Method::as_str)
                .collect();
            self.report(
                span,
                format!("routes[{i}].methods"),
                format!(
                    "a read route (GET/HEAD) cannot also take {}: split read and write \
                     methods into two routes with the same match",
                    writes.join(", ")
                ),
            );
        }
        methods
    }

    fn query(&mut self, i: usize, raw: &RawRoute) -> QueryPolicy {
        let Some(query) = &raw.query else {
            return QueryPolicy::Sorted;
        };
        let key = format!("routes[{i}].query");
        match query.get_ref() {
            RawQuery::Sorted => QueryPolicy::Sorted,
            RawQuery::Ignore => QueryPolicy::Ignore,
            RawQuery::Allow(names) => {
                if names.is_empty() {
                    self.report(
                        query.span(),
                        key.as_str(),
                        "expected at least one parameter name, got an empty array \
                         (use query = \"ignore\" to key no parameter)",
                    );
                }
                if names.iter().any(String::is_empty) {
                    self.report(
                        query.span(),
                        key.as_str(),
                        "expected parameter names, got an empty string",
                    );
                }
                let mut names = names.clone();
                names.sort();
                names.dedup();
                QueryPolicy::Allow(names)
            }
        }
    }

    fn vary(&mut self, i: usize, raw: &RawRoute) -> Vec<HeaderName> {
        let mut vary = Vec::new();
        for (j, value) in raw.vary.iter().enumerate() {
            let key = format!("routes[{i}].vary[{j}]");
            let text = value.get_ref();
            let lower = text.to_ascii_lowercase();
            let Ok(name) = HeaderName::from_bytes(lower.as_bytes()) else {
                self.report(
                    value.span(),
                    key,
                    format!("expected a header name like \"accept-language\", got {text:?}"),
                );
                continue;
            };
            if PER_USER_HEADERS.contains(&name.as_str()) {
                self.report(
                    value.span(),
                    key,
                    format!(
                        "{:?} cannot be a vary header: it identifies the user, and \
                         per-user responses are never shared (leave this path uncached)",
                        name.as_str()
                    ),
                );
                continue;
            }
            vary.push(name);
        }
        vary.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        vary.dedup();
        vary
    }

    /// The client forwarding headers a route passes on: only names cacheguard otherwise
    /// drops ([`CLIENT_CLAIMS`]). A read route stores what the origin answers for everybody,
    /// so there each must be keyed (in `vary`), and a method override is refused outright:
    /// it would turn a cached GET into a write at the origin that nothing invalidates.
    fn forward_client_headers(
        &mut self,
        i: usize,
        raw: &RawRoute,
        is_read: bool,
        vary: &[HeaderName],
    ) -> Vec<HeaderName> {
        let mut names = Vec::new();
        for (j, value) in raw.forward_client_headers.iter().enumerate() {
            let key = format!("routes[{i}].forward_client_headers[{j}]");
            let text = value.get_ref();
            let lower = text.to_ascii_lowercase();
            let known = HeaderName::from_bytes(lower.as_bytes())
                .ok()
                .filter(|name| CLIENT_CLAIMS.contains(&name.as_str()));
            let Some(name) = known else {
                self.report(
                    value.span(),
                    key,
                    format!(
                        "expected one of the client headers cacheguard drops before forwarding \
                         ({}), got {text:?}",
                        CLIENT_CLAIMS.join(", ")
                    ),
                );
                continue;
            };
            if is_read && METHOD_OVERRIDES.contains(&name.as_str()) {
                self.report(
                    value.span(),
                    key,
                    format!(
                        "{:?} cannot be forwarded on a read route: it would make the origin \
                         run another method than the GET the cache stores, and nothing \
                         invalidates what that changes; allow it on a write route",
                        name.as_str()
                    ),
                );
                continue;
            }
            if is_read && !vary.contains(&name) {
                self.report(
                    value.span(),
                    key,
                    format!(
                        "{:?} changes what the origin answers, and this route caches it for \
                         everybody: add it to this route's vary too (each value is then \
                         stored apart), or leave it off this route",
                        name.as_str()
                    ),
                );
                continue;
            }
            names.push(name);
        }
        names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        names.dedup();
        names
    }

    fn invalidate(&mut self, i: usize, raw: &RawRoute, is_read: bool) -> Vec<String> {
        if is_read && let Some(first) = raw.invalidate.first() {
            self.report(
                first.span(),
                format!("routes[{i}].invalidate"),
                "only write routes (no GET/HEAD) invalidate; move it to the route that \
                 takes the writes",
            );
        }
        let own_params = pattern_params(raw.pattern.get_ref());
        let mut invalidate = Vec::new();
        for (j, value) in raw.invalidate.iter().enumerate() {
            let key = format!("routes[{i}].invalidate[{j}]");
            let pattern = value.get_ref();
            if self
                .check(check_pattern(pattern), value.span(), &key)
                .is_none()
            {
                continue;
            }
            let unknown: Vec<&str> = pattern_params(pattern)
                .into_iter()
                .filter(|p| !own_params.contains(p))
                .collect();
            if !unknown.is_empty() {
                self.report(
                    value.span(),
                    key,
                    format!(
                        "expected parameters taken from this route's match {:?}, got {{{}}} \
                         in {pattern:?}",
                        raw.pattern.get_ref(),
                        unknown.join("}, {")
                    ),
                );
                continue;
            }
            invalidate.push(pattern.clone());
        }
        invalidate
    }

    fn unique_names(&mut self, raw: &[Spanned<RawRoute>]) {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, route) in raw.iter().enumerate() {
            let name = route.get_ref().name.get_ref();
            match seen.entry(name.as_str()) {
                Entry::Occupied(first) => {
                    let first = *first.get();
                    let first_line = line_at(self.text, Some(raw[first].get_ref().name.span()));
                    self.report(
                        route.get_ref().name.span(),
                        format!("routes[{i}].name"),
                        format!(
                            "expected a unique route name, got {name:?} again (routes[{first}], \
                             line {})",
                            first_line.unwrap_or(1)
                        ),
                    );
                }
                Entry::Vacant(slot) => {
                    slot.insert(i);
                }
            }
        }
    }

    /// Two routes with the same `match` must not answer the same method.
    fn distinct_methods(&mut self, raw: &[Spanned<RawRoute>], routes: &[RouteConfig]) {
        for (i, route) in routes.iter().enumerate() {
            let mine = effective_methods(&route.methods);
            let Some((j, other)) = routes[..i]
                .iter()
                .enumerate()
                .find(|(_, other)| other.pattern == route.pattern)
            else {
                continue;
            };
            let theirs = effective_methods(&other.methods);
            let shared: Vec<&str> = mine
                .iter()
                .filter(|m| theirs.contains(m))
                .map(Method::as_str)
                .collect();
            if shared.is_empty() {
                continue;
            }
            let spanned = &raw[i];
            let span = match &spanned.get_ref().methods {
                Some(list) if !list.is_empty() => list[0].span(),
                _ => spanned.span(),
            };
            self.report(
                span,
                format!("routes[{i}].methods"),
                format!(
                    "{} already handled by route {:?} (routes[{j}]) with the same match {:?}",
                    shared.join(", "),
                    other.name,
                    other.pattern
                ),
            );
        }
    }

    /// Every distinct pattern must fit in one router; a conflict is reported on the later route.
    fn routable_together(&mut self, raw: &[Spanned<RawRoute>]) {
        let mut router = matchit::Router::<()>::new();
        let mut inserted: HashMap<&str, usize> = HashMap::new();
        for (i, route) in raw.iter().enumerate() {
            let pattern = route.get_ref().pattern.get_ref().as_str();
            if inserted.contains_key(pattern) || check_pattern(pattern).is_err() {
                continue; // same pattern as an earlier route, or already reported
            }
            match router.insert(pattern, ()) {
                Ok(()) => {
                    inserted.insert(pattern, i);
                }
                Err(error) => {
                    let with = match &error {
                        matchit::InsertError::Conflict { with } => {
                            match inserted.get(with.as_str()) {
                                Some(&j) => {
                                    format!(
                                        "route {:?} (routes[{j}])",
                                        raw[j].get_ref().name.get_ref()
                                    )
                                }
                                None => "an earlier route".to_owned(),
                            }
                        }
                        _ => "an earlier route".to_owned(),
                    };
                    self.report(
                        route.get_ref().pattern.span(),
                        format!("routes[{i}].match"),
                        format!(
                            "pattern {pattern:?} conflicts with {with}: {}",
                            lowercase_first(&error.to_string())
                        ),
                    );
                }
            }
        }
    }
}
