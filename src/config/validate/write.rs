//! A route's `serialize`, `version` and `version_floor_ttl`.

use std::time::Duration;

use http::HeaderName;
use toml::Spanned;

use super::{Checker, pattern_params, show};
use crate::config::raw::RawRoute;
use crate::config::{LockBackendConfig, OnRedisError, RedisConfig, SerializeConfig, VersionSource};

/// Defaults, also named in messages and the README.
pub(in crate::config) mod defaults {
    use std::time::Duration;

    pub(in crate::config) const LEASE: Duration = Duration::from_secs(5);
    pub(in crate::config) const WAIT_TIMEOUT: Duration = Duration::from_secs(2);
    pub(in crate::config) const MAX_WAITERS: u32 = 256;
    pub(in crate::config) const RETRY_AFTER: Duration = Duration::from_secs(1);
    pub(in crate::config) const VERSION_FLOOR_TTL: Duration = Duration::from_secs(10);
}

impl Checker<'_> {
    /// A write route's `serialize = { … }`.
    pub(super) fn serialize(
        &mut self,
        i: usize,
        raw: &RawRoute,
        is_read: bool,
        redis: Option<&RedisConfig>,
        locks: &[LockBackendConfig],
    ) -> Option<SerializeConfig> {
        let spanned = raw.serialize.as_ref()?;
        let serialize = spanned.get_ref();
        let key = |field: &str| format!("routes[{i}].serialize{field}");
        if is_read {
            self.report(
                spanned.span(),
                key(""),
                "only writes are serialized: move it to a write route (POST, PUT, PATCH or \
                 DELETE)",
            );
            return None;
        }
        let pattern = serialize.key.get_ref();
        let captured = pattern_params(raw.pattern.get_ref());
        if !pattern.starts_with('/') {
            self.report(
                serialize.key.span(),
                key(".key"),
                format!("expected a path pattern like \"/trains/{{train}}/seats/{{seat}}\", got {pattern:?}"),
            );
        } else if let Some(missing) = pattern_params(pattern)
            .into_iter()
            .find(|p| !captured.contains(p))
        {
            self.report(
                serialize.key.span(),
                key(".key"),
                format!(
                    "the key names {{{missing}}}, which this route's match {:?} does not \
                     capture",
                    raw.pattern.get_ref()
                ),
            );
        }
        let lease = serialize
            .lease
            .as_ref()
            .map_or(defaults::LEASE, |l| l.get_ref().0);
        if let Some(redis) = redis
            && serialize.lock.is_none()
            && lease < redis.command_timeout.saturating_mul(3)
        {
            let span = serialize
                .lease
                .as_ref()
                .map_or(serialize.key.span(), Spanned::span);
            self.report(
                span,
                key(".lease"),
                format!(
                    "expected a lease of at least 3 × redis.command_timeout ({}): it is renewed \
                     every third of it, and one renewal that times out must leave time for \
                     the next, got {}",
                    show(redis.command_timeout.saturating_mul(3)),
                    show(lease)
                ),
            );
        }
        let wait_timeout = match &serialize.wait_timeout {
            None => defaults::WAIT_TIMEOUT,
            Some(wait) => {
                if wait.get_ref().0.is_zero() {
                    self.report(
                        wait.span(),
                        key(".wait_timeout"),
                        "expected a duration above zero like \"2s\"",
                    );
                }
                wait.get_ref().0
            }
        };
        let max_waiters = match &serialize.max_waiters {
            None => defaults::MAX_WAITERS,
            Some(n) if *n.get_ref() == 0 => {
                self.report(
                    n.span(),
                    key(".max_waiters"),
                    "expected an integer of at least 1, got 0",
                );
                1
            }
            Some(n) => *n.get_ref(),
        };
        let fence_header = match &serialize.fence_header {
            None => {
                self.warn(
                    spanned.span(),
                    key(""),
                    "no fence_header: the origin gets no fencing token to check, so a write \
                     that outlives its lease (a paused or cut-off instance) can still run \
                     beside the next holder's; without an origin check this is an efficiency \
                     lock, not a safety one",
                );
                None
            }
            Some(name) => {
                let parsed = HeaderName::from_bytes(name.get_ref().as_bytes()).map_err(|_| {
                    format!(
                        "expected a header name like \"fencing-token\", got {:?}",
                        name.get_ref()
                    )
                });
                self.check(parsed, name.span(), &key(".fence_header"))
            }
        };
        let retry_after = serialize
            .retry_after
            .as_ref()
            .map_or(defaults::RETRY_AFTER, |r| r.get_ref().0);
        if let Some(lock) = &serialize.lock
            && !locks.iter().any(|l| &l.name == lock.get_ref())
        {
            let known: Vec<String> = locks.iter().map(|l| format!("{:?}", l.name)).collect();
            let expected = if known.is_empty() {
                "the name of a [locks.<name>] section, but none is defined".to_owned()
            } else {
                format!(
                    "the name of a [locks.<name>] section ({})",
                    known.join(", ")
                )
            };
            self.report(
                lock.span(),
                key(".lock"),
                format!("expected {expected}, got {:?}", lock.get_ref()),
            );
        }
        // A ZooKeeper lock is held by its session: the session is the lease, and a route's
        // lease longer than it would promise a hold the server does not keep.
        if let Some(lock) = &serialize.lock
            && let Some(crate::config::LockBackend::ZooKeeper {
                session_timeout, ..
            }) = locks
                .iter()
                .find(|l| &l.name == lock.get_ref())
                .map(|l| &l.backend)
            && lease > *session_timeout
        {
            let span = serialize.lease.as_ref().map_or(lock.span(), Spanned::span);
            self.report(
                span,
                key(".lease"),
                format!(
                    "expected a lease of at most locks.{}.session_timeout ({}): a ZooKeeper \
                     lock lasts as long as its session, which the server ends that long after \
                     it last heard from this instance, got {}",
                    lock.get_ref(),
                    show(*session_timeout),
                    show(lease)
                ),
            );
        }
        Some(SerializeConfig {
            key: pattern.clone(),
            lease,
            wait_timeout,
            max_waiters: usize::try_from(max_waiters).unwrap_or(usize::MAX),
            fence_header,
            on_redis_error: serialize
                .on_redis_error
                .as_ref()
                .map_or(OnRedisError::Reject, |o| o.get_ref().0),
            retry_after,
            lock: serialize.lock.as_ref().map(|l| l.get_ref().clone()),
        })
    }

    /// A route's `version = { header }` and `version_floor_ttl`.
    pub(super) fn version(
        &mut self,
        i: usize,
        raw: &RawRoute,
        is_read: bool,
    ) -> (Option<VersionSource>, Duration) {
        let key = |field: &str| format!("routes[{i}].{field}");
        let floor_ttl = match &raw.version_floor_ttl {
            None => defaults::VERSION_FLOOR_TTL,
            Some(ttl) => {
                if is_read || raw.version.is_none() {
                    self.report(
                        ttl.span(),
                        key("version_floor_ttl"),
                        "only a write route with `version` sets a floor: add version = { \
                         header = \"…\" } to this write route, or remove this key",
                    );
                } else if ttl.get_ref().0.is_zero() {
                    self.report(
                        ttl.span(),
                        key("version_floor_ttl"),
                        "expected a duration above zero, at least the worst replica lag, \
                         like \"10s\"",
                    );
                }
                ttl.get_ref().0
            }
        };
        let Some(spanned) = &raw.version else {
            return (None, floor_ttl);
        };
        let Some(header) = &spanned.get_ref().header else {
            self.report(
                spanned.span(),
                key("version"),
                "expected the header the origin tells a row's version in, like { header = \
                 \"x-row-version\" } (or \"last-modified\" to compare dates)",
            );
            return (None, floor_ttl);
        };
        let name = match HeaderName::from_bytes(header.get_ref().as_bytes()) {
            Ok(name) => name,
            Err(_) => {
                self.report(
                    header.span(),
                    key("version.header"),
                    format!(
                        "expected a header name like \"x-row-version\", got {:?}",
                        header.get_ref()
                    ),
                );
                return (None, floor_ttl);
            }
        };
        let source = if name == http::header::LAST_MODIFIED || name == http::header::DATE {
            VersionSource::Date(name)
        } else {
            VersionSource::Integer(name)
        };
        (Some(source), floor_ttl)
    }
}
