//! `[locks.<name>]`: the lock services serialized writes may pick instead of the shared
//! Redis.

use std::time::Duration;

use toml::Spanned;

use super::{Checker, check_filter_name, show};
use crate::config::raw::RawLockBackend;
use crate::config::{LockBackend, LockBackendConfig};

/// Defaults, also named in messages and the README.
pub(in crate::config) mod defaults {
    use std::time::Duration;

    pub(in crate::config) const ETCD_PREFIX: &str = "/cacheguard/locks";
    pub(in crate::config) const ETCD_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
    pub(in crate::config) const ZOOKEEPER_PATH: &str = "/cacheguard/locks";
    pub(in crate::config) const ZOOKEEPER_SESSION_TIMEOUT: Duration = Duration::from_secs(6);
    pub(in crate::config) const MYSQL_TABLE: &str = "cacheguard_locks";
    pub(in crate::config) const REDLOCK_DRIFT: f64 = 0.01;
}

/// The keys each backend takes (besides `backend`).
const ETCD_KEYS: &[&str] = &[
    "endpoints",
    "prefix",
    "username",
    "password",
    "connect_timeout",
];
const ZOOKEEPER_KEYS: &[&str] = &["connect", "path", "session_timeout"];
const MYSQL_KEYS: &[&str] = &["url", "table"];
const REDLOCK_KEYS: &[&str] = &["urls", "drift"];

impl Checker<'_> {
    /// One section's backend, with only its own keys (each other one is reported).
    fn backend(
        &mut self,
        name: &str,
        raw: &RawLockBackend,
        section: std::ops::Range<usize>,
    ) -> Option<LockBackend> {
        let key = |field: &str| format!("locks.{name}.{field}");
        let present: [(&str, Option<std::ops::Range<usize>>); 13] = [
            ("endpoints", raw.endpoints.as_ref().map(Spanned::span)),
            ("prefix", raw.prefix.as_ref().map(Spanned::span)),
            ("username", raw.username.as_ref().map(Spanned::span)),
            ("password", raw.password.as_ref().map(Spanned::span)),
            (
                "connect_timeout",
                raw.connect_timeout.as_ref().map(Spanned::span),
            ),
            ("connect", raw.connect.as_ref().map(Spanned::span)),
            ("path", raw.path.as_ref().map(Spanned::span)),
            (
                "session_timeout",
                raw.session_timeout.as_ref().map(Spanned::span),
            ),
            ("url", raw.url.as_ref().map(Spanned::span)),
            ("table", raw.table.as_ref().map(Spanned::span)),
            ("urls", raw.urls.as_ref().map(Spanned::span)),
            ("drift", raw.drift.as_ref().map(Spanned::span)),
            ("backend", None),
        ];
        let kind = raw.backend.get_ref().as_str();
        let allowed = match kind {
            "etcd" => ETCD_KEYS,
            "zookeeper" => ZOOKEEPER_KEYS,
            "mysql" => MYSQL_KEYS,
            "redlock" => REDLOCK_KEYS,
            other => {
                self.report(
                    raw.backend.span(),
                    key("backend"),
                    format!(
                        "expected one of \"etcd\", \"zookeeper\", \"mysql\", \"redlock\", got \
                         {other:?}"
                    ),
                );
                return None;
            }
        };
        let mut misplaced = false;
        for (field, span) in present {
            if let Some(span) = span
                && !allowed.contains(&field)
            {
                self.report(
                    span,
                    key(field),
                    format!(
                        "not a key of a {kind} lock (its keys: backend, {})",
                        allowed.join(", ")
                    ),
                );
                misplaced = true;
            }
        }
        let required = |this: &mut Self, field: &str, present: bool| {
            if !present {
                this.report(
                    section.clone(),
                    key(field),
                    format!("required key is missing for a {kind} lock"),
                );
            }
            present
        };
        let backend = match kind {
            "etcd" => {
                let endpoints = match &raw.endpoints {
                    Some(list) => self.urls(list, &["http"], &key("endpoints"), 1),
                    None => {
                        required(self, "endpoints", false);
                        return None;
                    }
                };
                for (i, endpoint) in raw
                    .endpoints
                    .iter()
                    .flat_map(|l| l.get_ref().iter().enumerate())
                {
                    // (Another scheme is reported by `urls` below.)
                    let Some(authority) = endpoint.get_ref().strip_prefix("http://") else {
                        continue;
                    };
                    if let Some(problem) = authority_problem(authority.trim_end_matches('/')) {
                        self.report(
                            endpoint.span(),
                            format!("{}[{i}]", key("endpoints")),
                            format!(
                                "expected http://host:port like \"http://127.0.0.1:2379\" \
                                 ({problem}), got {:?}",
                                endpoint.get_ref()
                            ),
                        );
                    }
                }
                // A user without a password (or the reverse) would be sent with an empty
                // one, and refused by etcd only at start.
                match (&raw.username, &raw.password) {
                    (Some(user), None) => self.report(
                        user.span(),
                        key("username"),
                        "expected a password too: etcd authenticates with both",
                    ),
                    (None, Some(password)) => self.report(
                        password.span(),
                        key("password"),
                        "expected a username too: etcd authenticates with both",
                    ),
                    _ => {}
                }
                let prefix = self.path(raw.prefix.as_ref(), defaults::ETCD_PREFIX, &key("prefix"));
                LockBackend::Etcd {
                    endpoints,
                    prefix,
                    username: raw.username.as_ref().map(|u| u.get_ref().clone()),
                    password: raw.password.as_ref().map(|p| p.get_ref().clone()),
                    connect_timeout: raw
                        .connect_timeout
                        .as_ref()
                        .map_or(defaults::ETCD_CONNECT_TIMEOUT, |d| d.get_ref().0),
                }
            }
            "zookeeper" => {
                let Some(connect) = &raw.connect else {
                    required(self, "connect", false);
                    return None;
                };
                if let Some(problem) = zookeeper_connect_problem(connect.get_ref()) {
                    self.report(
                        connect.span(),
                        key("connect"),
                        format!(
                            "expected host:port[,host:port…][/chroot] like \"127.0.0.1:2181\" \
                             ({problem}), got {:?}",
                            connect.get_ref()
                        ),
                    );
                }
                let path = self.path(raw.path.as_ref(), defaults::ZOOKEEPER_PATH, &key("path"));
                let session_timeout = match &raw.session_timeout {
                    None => defaults::ZOOKEEPER_SESSION_TIMEOUT,
                    Some(t) => {
                        if t.get_ref().0 < Duration::from_secs(2) {
                            self.report(
                                t.span(),
                                key("session_timeout"),
                                format!(
                                    "expected at least \"2s\" (ZooKeeper's smallest session is \
                                     a few ticks), got {}",
                                    show(t.get_ref().0)
                                ),
                            );
                        }
                        t.get_ref().0
                    }
                };
                LockBackend::ZooKeeper {
                    connect: connect.get_ref().clone(),
                    path,
                    session_timeout,
                }
            }
            "mysql" => {
                let Some(url) = &raw.url else {
                    required(self, "url", false);
                    return None;
                };
                let urls = self.urls(
                    &Spanned::new(url.span(), vec![url.clone()]),
                    &["mysql"],
                    &key("url"),
                    1,
                );
                if let Some(text) = urls.first()
                    && let Err(problem) = crate::config::values::check_mysql_url(text)
                {
                    self.report(url.span(), key("url"), problem);
                }
                let table = match &raw.table {
                    None => defaults::MYSQL_TABLE.to_owned(),
                    Some(t) => {
                        let valid = !t.get_ref().is_empty()
                            && t.get_ref().len() <= 64
                            && t.get_ref()
                                .chars()
                                .all(|c| c.is_ascii_alphanumeric() || c == '_');
                        if !valid {
                            self.report(
                                t.span(),
                                key("table"),
                                format!(
                                    "expected a table name of letters, digits and '_' (at most \
                                     64) like \"cacheguard_locks\", got {:?}",
                                    t.get_ref()
                                ),
                            );
                        }
                        t.get_ref().clone()
                    }
                };
                LockBackend::Mysql {
                    url: urls.into_iter().next().unwrap_or_default(),
                    table,
                }
            }
            _ => {
                let Some(list) = &raw.urls else {
                    required(self, "urls", false);
                    return None;
                };
                // Fewer than three masters: a majority is all of them, and one down stops
                // every grant; Redlock's point is to survive a minority.
                let urls = self.urls(list, &["redis", "rediss"], &key("urls"), 3);
                for (i, url) in list.get_ref().iter().enumerate() {
                    if urls.contains(url.get_ref())
                        && let Err(problem) = crate::config::values::check_redis_url(url.get_ref())
                    {
                        self.report(url.span(), format!("{}[{i}]", key("urls")), problem);
                    }
                }
                let drift = match &raw.drift {
                    None => defaults::REDLOCK_DRIFT,
                    Some(d) => {
                        if !(0.0..0.5).contains(d.get_ref()) {
                            self.report(
                                d.span(),
                                key("drift"),
                                format!(
                                    "expected a fraction of the lease from 0.0 to below 0.5, \
                                     like 0.01, got {:?}",
                                    d.get_ref()
                                ),
                            );
                        }
                        *d.get_ref()
                    }
                };
                LockBackend::Redlock { urls, drift }
            }
        };
        (!misplaced).then_some(backend)
    }

    pub(super) fn locks(
        &mut self,
        raw: &std::collections::BTreeMap<String, Spanned<RawLockBackend>>,
    ) -> Vec<LockBackendConfig> {
        let mut locks = Vec::new();
        for (name, spanned) in raw {
            if self
                .check(
                    check_filter_name(name),
                    spanned.span(),
                    &format!("locks.{name}"),
                )
                .is_none()
            {
                continue;
            }
            let raw = spanned.get_ref();
            let Some(backend) = self.backend(name, raw, spanned.span()) else {
                continue;
            };
            locks.push(LockBackendConfig {
                name: name.clone(),
                backend,
            });
        }
        locks
    }

    /// A list of URLs with one of `schemes`, at least `min` of them, none twice.
    fn urls(
        &mut self,
        list: &Spanned<Vec<Spanned<String>>>,
        schemes: &[&str],
        key: &str,
        min: usize,
    ) -> Vec<String> {
        let mut urls: Vec<String> = Vec::new();
        for (i, url) in list.get_ref().iter().enumerate() {
            let text = url.get_ref();
            let scheme = text.split_once("://").map(|(s, _)| s);
            let ok = scheme.is_some_and(|s| schemes.contains(&s))
                && text
                    .split_once("://")
                    .is_some_and(|(_, rest)| !rest.is_empty());
            if !ok {
                let example = format!("{}://127.0.0.1:…", schemes[0]);
                self.report(
                    url.span(),
                    if min == 1 && list.get_ref().len() == 1 && key.ends_with(".url") {
                        key.to_owned()
                    } else {
                        format!("{key}[{i}]")
                    },
                    format!(
                        "expected a URL like \"{example}\", got {:?}",
                        crate::config::values::redact_url(text)
                    ),
                );
            } else if urls.contains(text) {
                self.report(
                    url.span(),
                    format!("{key}[{i}]"),
                    "the same server is listed twice",
                );
            } else {
                urls.push(text.clone());
            }
        }
        if list.get_ref().len() < min {
            self.report(
                list.span(),
                key,
                format!(
                    "expected at least {min} servers, got {}",
                    list.get_ref().len()
                ),
            );
        }
        urls
    }

    /// A path prefix starting with `/`, without a trailing `/`.
    fn path(&mut self, value: Option<&Spanned<String>>, default: &str, key: &str) -> String {
        let Some(value) = value else {
            return default.to_owned();
        };
        let text = value.get_ref();
        if !text.starts_with('/') || text.len() > 1 && text.ends_with('/') {
            self.report(
                value.span(),
                key,
                format!("expected a path like \"{default}\" (a leading \"/\", no trailing one), got {text:?}"),
            );
        }
        text.clone()
    }
}

/// What is wrong with `host:port` (a port is required: a lock service has no default
/// one cacheguard should guess), if anything.
fn authority_problem(authority: &str) -> Option<String> {
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let Some((host, port)) = rest.split_once("]:") else {
            return Some("an IPv6 host is written [addr]:port".to_owned());
        };
        (host, port)
    } else {
        let Some((host, port)) = authority.rsplit_once(':') else {
            return Some(format!("no port in {authority:?}"));
        };
        (host, port)
    };
    if host.is_empty() {
        return Some(format!("no host in {authority:?}"));
    }
    match port.parse::<u16>() {
        Ok(0) | Err(_) => Some(format!("port {port:?} is not a port from 1 to 65535")),
        Ok(_) => None,
    }
}

/// What is wrong with a ZooKeeper connect string (`host:port,…`, each perhaps after
/// `tcp://`, and an optional `/chroot` after the last one), if anything.
fn zookeeper_connect_problem(connect: &str) -> Option<String> {
    if connect.trim().is_empty() {
        return Some("no server".to_owned());
    }
    let entries: Vec<&str> = connect.split(',').collect();
    let last = entries.len().saturating_sub(1);
    entries.iter().enumerate().find_map(|(i, entry)| {
        let entry = entry.strip_prefix("tcp://").unwrap_or(entry);
        let host_port = if i == last {
            entry.split_once('/').map_or(entry, |(hosts, _)| hosts)
        } else {
            entry
        };
        authority_problem(host_port)
    })
}
