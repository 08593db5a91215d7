//! Serde mirror of `cacheguard.toml`: what the file says, with its defaults, and no
//! invariants yet.
//!
//! Every table is `deny_unknown_fields`, so a misspelt key is an error rather than a silently
//! ignored line. Type-level problems (wrong type, bad duration, bad keyword, unknown or
//! missing key) surface here, as serde errors that `validate.rs` turns into
//! `file:line: key: message`. Values that need checks serde cannot make (addresses, URLs,
//! ranges, route patterns) are kept as [`Spanned`] so `validate.rs` can report their line.
//! Nothing outside `config/` sees these types; the program reads [`super::Config`].

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use toml::Spanned;

use super::{
    AccessLogFormat, FreshnessSource, InDoubtRetry, L1Policy, L1WhileBusDown, OnRedisError,
    OnTimeout,
};

/// Span used for values that did not come from the file (defaults, environment overrides).
/// Such values are already valid, so no problem is ever reported at this span.
pub(super) const NO_SPAN: std::ops::Range<usize> = 0..0;

fn unspanned<T>(value: T) -> Spanned<T> {
    Spanned::new(NO_SPAN, value)
}

/// The whole file. Every section may be absent; `[redis]` being absent means embedded mode.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) server: RawServer,
    /// Spanned so a missing `url` can be reported at the `[upstream]` header.
    pub(super) upstream: Option<Spanned<RawUpstream>>,
    pub(super) redis: Option<Spanned<RawRedis>>,
    #[serde(default)]
    pub(super) admin: RawAdmin,
    #[serde(default)]
    pub(super) cache: RawCache,
    #[serde(default)]
    pub(super) lock: RawLock,
    #[serde(default)]
    pub(super) routes: Vec<Spanned<RawRoute>>,
    #[serde(default)]
    pub(super) bloom: Vec<Spanned<RawBloom>>,
    #[serde(default)]
    pub(super) hot_keys: RawHotKeys,
    #[serde(default)]
    pub(super) journal: RawJournal,
    #[serde(default)]
    pub(super) invalidation_stream: RawStream,
    #[serde(default)]
    pub(super) access_log: RawAccessLog,
    /// Stock gates (`[[stock]]`), bound to write routes by `stock = { gate, units }`.
    #[serde(default)]
    pub(super) stock: Vec<Spanned<RawStock>>,
    /// Lock services for serialized writes (`[locks.<name>]`), picked per route.
    #[serde(default)]
    pub(super) locks: std::collections::BTreeMap<String, Spanned<RawLockBackend>>,
}

/// `[locks.<name>]`: a lock service, by `backend`. One flat table (serde cannot keep
/// spans inside a tagged enum): which keys each backend takes is checked in
/// `validate/locks.rs`, each misplaced key with its line.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLockBackend {
    /// `etcd`, `zookeeper`, `mysql` or `redlock`.
    pub(super) backend: Spanned<String>,
    // etcd
    pub(super) endpoints: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) prefix: Option<Spanned<String>>,
    pub(super) username: Option<Spanned<String>>,
    pub(super) password: Option<Spanned<String>>,
    pub(super) connect_timeout: Option<Spanned<HumanDuration>>,
    // zookeeper
    pub(super) connect: Option<Spanned<String>>,
    pub(super) path: Option<Spanned<String>>,
    pub(super) session_timeout: Option<Spanned<HumanDuration>>,
    // mysql
    pub(super) url: Option<Spanned<String>>,
    pub(super) table: Option<Spanned<String>>,
    // redlock
    pub(super) urls: Option<Spanned<Vec<Spanned<String>>>>,
    /// Clock drift allowed, as a fraction of the lease (Redlock's drift factor).
    pub(super) drift: Option<Spanned<f64>>,
}

/// `[access_log]`: one line per proxied request.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawAccessLog {
    pub(super) format: RawAccessLogFormat,
    /// `"stdout"`, `"stderr"` or a file path.
    pub(super) path: Spanned<String>,
    pub(super) sample: Spanned<f64>,
    pub(super) query: bool,
    pub(super) buffer: Spanned<usize>,
}

impl Default for RawAccessLog {
    fn default() -> Self {
        Self {
            format: RawAccessLogFormat(AccessLogFormat::Off),
            path: unspanned("stdout".to_owned()),
            sample: unspanned(1.0),
            query: false,
            buffer: unspanned(8192),
        }
    }
}

/// `[journal]`: where owed invalidations wait while Redis is unavailable.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawJournal {
    /// `None` = `cacheguard.journal` next to the config file.
    pub(super) path: Option<Spanned<String>>,
    /// `None` = `"always"`.
    pub(super) fsync: Option<Spanned<String>>,
}

/// `[invalidation_stream]`: external invalidations from a Redis Stream.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawStream {
    pub(super) enabled: bool,
    /// `None` = `<redis.key_prefix>invalidate`.
    pub(super) key: Option<Spanned<String>>,
    pub(super) group: Spanned<String>,
    pub(super) batch: Spanned<usize>,
    pub(super) claim_idle: HumanDuration,
}

impl Default for RawStream {
    fn default() -> Self {
        Self {
            enabled: true,
            key: None,
            group: unspanned("cacheguard".to_owned()),
            batch: unspanned(100),
            claim_idle: HumanDuration::secs(30),
        }
    }
}

/// `[hot_keys]`: detection, promotion into L1, per-key limits.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawHotKeys {
    pub(super) threshold_rps: Spanned<u32>,
    /// `None` = half of `threshold_rps`.
    pub(super) cool_rps: Option<Spanned<u32>>,
    pub(super) window: HumanDuration,
    pub(super) l1_ttl: HumanDuration,
    pub(super) max_backend_rps_per_key: u32,
    pub(super) max_hot_keys: Spanned<usize>,
}

impl Default for RawHotKeys {
    fn default() -> Self {
        Self {
            threshold_rps: unspanned(100),
            cool_rps: None,
            window: HumanDuration::millis(250),
            l1_ttl: HumanDuration::secs(1),
            max_backend_rps_per_key: 50,
            max_hot_keys: unspanned(256),
        }
    }
}

/// `[server]`: the proxy listener.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: Spanned<String>,
    pub(super) max_header_bytes: usize,
    pub(super) max_headers: Spanned<usize>,
    pub(super) max_body_bytes: u64,
    pub(super) header_read_timeout: Spanned<HumanDuration>,
    pub(super) keepalive_timeout: Spanned<HumanDuration>,
    pub(super) lingering_time: Spanned<HumanDuration>,
    pub(super) lingering_timeout: Spanned<HumanDuration>,
    pub(super) shutdown_grace: HumanDuration,
    pub(super) worker_threads: usize,
    pub(super) max_connections: Spanned<usize>,
    pub(super) body_buffer_bytes: Spanned<u64>,
    /// `None` = the system's temporary directory.
    pub(super) body_spool_dir: Option<Spanned<String>>,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: unspanned(defaults::SERVER_LISTEN.to_owned()),
            max_header_bytes: 16 * 1024,
            max_headers: unspanned(defaults::MAX_HEADERS),
            max_body_bytes: 10 * 1024 * 1024,
            header_read_timeout: unspanned(HumanDuration::secs(10)),
            keepalive_timeout: unspanned(HumanDuration::secs(75)),
            lingering_time: unspanned(HumanDuration::secs(30)),
            lingering_timeout: unspanned(HumanDuration::secs(5)),
            shutdown_grace: HumanDuration::secs(10),
            worker_threads: 0,
            max_connections: unspanned(10_000),
            body_buffer_bytes: unspanned(64 * 1024),
            body_spool_dir: None,
        }
    }
}

/// `[upstream]`: the origin and the origin guard.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawUpstream {
    /// Required (by the file or `CACHEGUARD_UPSTREAM`); checked in `validate.rs`.
    pub(super) url: Option<Spanned<String>>,
    pub(super) timeout: Spanned<HumanDuration>,
    pub(super) connect_timeout: HumanDuration,
    pub(super) max_concurrency: Spanned<usize>,
    pub(super) max_rps: u32,
    pub(super) queue_timeout: HumanDuration,
    pub(super) max_buffered_bytes: Spanned<u64>,
    pub(super) upload_timeout: Spanned<HumanDuration>,
    pub(super) upload_min_rate: u32,
    pub(super) upload_deadline: Spanned<HumanDuration>,
    pub(super) pool_max_idle: usize,
    pub(super) pool_idle_timeout: Spanned<HumanDuration>,
}

impl Default for RawUpstream {
    fn default() -> Self {
        Self {
            url: None,
            timeout: unspanned(HumanDuration::secs(10)),
            connect_timeout: HumanDuration::secs(2),
            max_concurrency: unspanned(256),
            max_rps: 0,
            queue_timeout: HumanDuration::millis(100),
            max_buffered_bytes: unspanned(256 << 20),
            upload_timeout: unspanned(HumanDuration::secs(10)),
            upload_min_rate: 500,
            upload_deadline: unspanned(HumanDuration::secs(300)),
            pool_max_idle: 64,
            pool_idle_timeout: unspanned(HumanDuration::secs(4)),
        }
    }
}

/// `[redis]`: the shared L2 and coordination store.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawRedis {
    /// `standalone` (default), `sentinel` or `cluster`.
    pub(super) mode: Option<Spanned<String>>,
    /// Standalone: required in the section (or from `CACHEGUARD_REDIS_URL`); cluster: one
    /// seed (alternative to `urls`); checked in `validate.rs`.
    pub(super) url: Option<Spanned<String>>,
    /// Sentinel: the sentinels; cluster: seed nodes.
    pub(super) urls: Option<Spanned<Vec<Spanned<String>>>>,
    /// Sentinel: the monitored primary's name.
    pub(super) master_name: Option<Spanned<String>>,
    /// ACL user for the data nodes (overrides one in the URL).
    pub(super) username: Option<Spanned<String>>,
    /// Password for the data nodes; prefer `password_file` or `CACHEGUARD_REDIS_PASSWORD`.
    pub(super) password: Option<Spanned<String>>,
    /// A file holding the password (a mounted secret); trailing newlines are ignored.
    pub(super) password_file: Option<Spanned<String>>,
    /// PEM file of the CA that signed the servers' certificates (`rediss://`).
    pub(super) tls_ca_file: Option<Spanned<String>>,
    pub(super) command_timeout: Spanned<HumanDuration>,
    pub(super) connect_timeout: HumanDuration,
    pub(super) key_prefix: String,
    pub(super) breaker_failures: Spanned<u32>,
}

impl Default for RawRedis {
    fn default() -> Self {
        Self {
            mode: None,
            url: None,
            urls: None,
            master_name: None,
            username: None,
            password: None,
            password_file: None,
            tls_ca_file: None,
            command_timeout: unspanned(HumanDuration::millis(50)),
            connect_timeout: HumanDuration::secs(1),
            key_prefix: "cg:".to_owned(),
            breaker_failures: unspanned(3),
        }
    }
}

/// `[admin]`: the admin listener.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawAdmin {
    pub(super) listen: Spanned<String>,
    pub(super) token: Option<Spanned<String>>,
    pub(super) purge_rate: u32,
    pub(super) purge_burst: Spanned<u32>,
}

impl Default for RawAdmin {
    fn default() -> Self {
        Self {
            listen: unspanned(defaults::ADMIN_LISTEN.to_owned()),
            token: None,
            purge_rate: 10,
            purge_burst: unspanned(20),
        }
    }
}

/// `[cache]`: defaults for every route.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawCache {
    pub(super) ttl: Spanned<HumanDuration>,
    pub(super) jitter: Spanned<f64>,
    pub(super) grace: HumanDuration,
    pub(super) negative_ttl: HumanDuration,
    pub(super) max_entry_bytes: usize,
    pub(super) l1_max_bytes: Spanned<u64>,
    pub(super) l1: RawL1,
    pub(super) l1_while_bus_down: RawL1WhileBusDown,
    pub(super) freshness: RawFreshness,
    pub(super) heuristic: Spanned<f64>,
    pub(super) max_variants: usize,
    pub(super) variant_overflow_rate: u32,
}

impl Default for RawCache {
    fn default() -> Self {
        Self {
            ttl: unspanned(HumanDuration::secs(60)),
            jitter: unspanned(0.2),
            grace: HumanDuration::secs(30),
            negative_ttl: HumanDuration::secs(10),
            max_entry_bytes: 1024 * 1024,
            l1_max_bytes: unspanned(256 * 1024 * 1024),
            l1: RawL1(L1Policy::Hot),
            l1_while_bus_down: RawL1WhileBusDown(L1WhileBusDown::Bypass),
            freshness: RawFreshness(FreshnessSource::Route),
            heuristic: unspanned(0.0),
            max_variants: 64,
            variant_overflow_rate: 10,
        }
    }
}

/// `[lock]`: the single-flight lock.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawLock {
    pub(super) lease: Spanned<HumanDuration>,
    pub(super) wait_timeout: Spanned<HumanDuration>,
    pub(super) on_timeout: Spanned<RawOnTimeout>,
    pub(super) uncacheable_ttl: HumanDuration,
    pub(super) wait_replicas: Spanned<u32>,
    pub(super) wait_replicas_timeout: Spanned<HumanDuration>,
    pub(super) max_waiters: Spanned<u32>,
}

impl Default for RawLock {
    fn default() -> Self {
        Self {
            lease: unspanned(HumanDuration::secs(5)),
            wait_timeout: unspanned(HumanDuration::secs(3)),
            on_timeout: unspanned(RawOnTimeout(OnTimeout::Origin)),
            uncacheable_ttl: HumanDuration::secs(10),
            wait_replicas: unspanned(0),
            wait_replicas_timeout: unspanned(HumanDuration::secs(1)),
            max_waiters: unspanned(1024),
        }
    }
}

/// One `[[routes]]` entry. `None` overrides inherit from `[cache]` in `validate.rs`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    pub(super) name: Spanned<String>,
    #[serde(rename = "match")]
    pub(super) pattern: Spanned<String>,
    /// `None` = `["GET"]`.
    pub(super) methods: Option<Vec<Spanned<String>>>,
    pub(super) ttl: Option<Spanned<HumanDuration>>,
    pub(super) jitter: Option<Spanned<f64>>,
    pub(super) grace: Option<HumanDuration>,
    pub(super) negative_ttl: Option<HumanDuration>,
    pub(super) max_entry_bytes: Option<usize>,
    pub(super) l1: Option<RawL1>,
    pub(super) freshness: Option<RawFreshness>,
    pub(super) heuristic: Option<Spanned<f64>>,
    pub(super) max_variants: Option<usize>,
    pub(super) variant_overflow_rate: Option<u32>,
    /// `None` = `"sorted"`.
    pub(super) query: Option<Spanned<RawQuery>>,
    #[serde(default)]
    pub(super) vary: Vec<Spanned<String>>,
    /// Client forwarding headers passed on to the origin as sent, on this route only.
    #[serde(default)]
    pub(super) forward_client_headers: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) invalidate: Vec<Spanned<String>>,
    pub(super) double_delete_delay: Option<HumanDuration>,
    pub(super) early_refresh_beta: Option<Spanned<f64>>,
    /// Read routes: check the id against a Bloom filter before any cache tier.
    pub(super) bloom: Option<Spanned<RawRouteBloom>>,
    /// Write routes: add the created id to a Bloom filter on a 2xx answer.
    pub(super) bloom_add: Option<Spanned<RawBloomAdd>>,
    /// Read routes: paths fetched at start so the cache does not open cold.
    pub(super) warmup: Option<Spanned<RawWarmup>>,
    /// Write routes: the stock gate a request takes units from before it is forwarded.
    pub(super) stock: Option<Spanned<RawRouteStock>>,
    /// Write routes: writes to one resource go one at a time across the fleet.
    pub(super) serialize: Option<Spanned<RawSerialize>>,
    /// How the origin tells a row's version (read routes: of what a fill stores; write
    /// routes: the version its answer makes the floor).
    pub(super) version: Option<Spanned<RawVersion>>,
    /// Write routes with `version`: how long the floor a write sets is kept.
    pub(super) version_floor_ttl: Option<Spanned<HumanDuration>>,
}

/// `serialize = { key, lease, wait_timeout, max_waiters, fence_header, on_redis_error,
/// retry_after, lock }` on a write route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSerialize {
    pub(super) key: Spanned<String>,
    pub(super) lease: Option<Spanned<HumanDuration>>,
    pub(super) wait_timeout: Option<Spanned<HumanDuration>>,
    pub(super) max_waiters: Option<Spanned<u32>>,
    pub(super) fence_header: Option<Spanned<String>>,
    pub(super) on_redis_error: Option<Spanned<RawOnRedisError>>,
    pub(super) retry_after: Option<Spanned<HumanDuration>>,
    /// A `[locks.<name>]` backend; absent: the shared Redis.
    pub(super) lock: Option<Spanned<String>>,
}

/// `version = { header }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawVersion {
    pub(super) header: Option<Spanned<String>>,
}

/// `stock = { gate, units }` on a write route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRouteStock {
    pub(super) gate: Spanned<String>,
    pub(super) units: Option<Spanned<u64>>,
}

/// One `[[stock]]` gate.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStock {
    pub(super) name: Spanned<String>,
    /// The resource's path pattern; its parameters come from the routes bound to it.
    pub(super) key: Spanned<String>,
    pub(super) source: Spanned<RawStockSource>,
    pub(super) reconcile: Option<Spanned<HumanDuration>>,
    pub(super) reservation_ttl: Option<Spanned<HumanDuration>>,
    pub(super) sold_out: Option<Spanned<RawSoldOut>>,
    pub(super) not_sold: Option<Spanned<Vec<Spanned<u16>>>>,
    pub(super) origin_sold_out: Option<Spanned<Vec<Spanned<u16>>>>,
    pub(super) on_redis_error: Option<Spanned<RawOnRedisError>>,
    pub(super) idempotency_header: Option<Spanned<String>>,
    pub(super) idempotency_ttl: Option<Spanned<HumanDuration>>,
    pub(super) in_doubt_retry: Option<Spanned<RawInDoubtRetry>>,
    pub(super) segments: Option<Spanned<u16>>,
}

/// `source = { path, json }`: where the origin tells how many units are left.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStockSource {
    pub(super) path: Spanned<String>,
    pub(super) json: Spanned<String>,
}

/// `sold_out = { status, body, content_type }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSoldOut {
    pub(super) status: Option<Spanned<u16>>,
    pub(super) body: Option<String>,
    pub(super) content_type: Option<Spanned<String>>,
}

/// `on_redis_error = "reject" | "forward"`.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawOnRedisError(pub(super) OnRedisError);

impl<'de> Deserialize<'de> for RawOnRedisError {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const WORDS: &[(&str, OnRedisError)] = &[
            ("reject", OnRedisError::Reject),
            ("forward", OnRedisError::Forward),
        ];
        deserializer.deserialize_str(Keyword(WORDS)).map(Self)
    }
}

/// `in_doubt_retry = "reject" | "forward"`.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawInDoubtRetry(pub(super) InDoubtRetry);

impl<'de> Deserialize<'de> for RawInDoubtRetry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const WORDS: &[(&str, InDoubtRetry)] = &[
            ("reject", InDoubtRetry::Reject),
            ("forward", InDoubtRetry::Forward),
        ];
        deserializer.deserialize_str(Keyword(WORDS)).map(Self)
    }
}

/// `warmup = { paths, file, rate }` on a read route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWarmup {
    #[serde(default)]
    pub(super) paths: Vec<Spanned<String>>,
    pub(super) file: Option<Spanned<String>>,
    pub(super) rate: Option<Spanned<u32>>,
}

/// `bloom = { filter, param, status, body }` on a read route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRouteBloom {
    pub(super) filter: Spanned<String>,
    pub(super) param: Spanned<String>,
    pub(super) status: Option<Spanned<u16>>,
    pub(super) body: Option<String>,
}

/// `bloom_add = { filter, from }` on a write route.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBloomAdd {
    pub(super) filter: Spanned<String>,
    /// `"location"` or `"json:/pointer"`.
    pub(super) from: Spanned<String>,
}

/// One `[[bloom]]` filter.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBloom {
    pub(super) name: Spanned<String>,
    pub(super) expected_items: Spanned<u64>,
    pub(super) fp_rate: Spanned<f64>,
    pub(super) refresh: Option<HumanDuration>,
    pub(super) load_timeout: Option<HumanDuration>,
    pub(super) source: Spanned<RawBloomSource>,
}

/// `source = { url | file, format, field }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBloomSource {
    pub(super) url: Option<Spanned<String>>,
    pub(super) file: Option<Spanned<String>>,
    pub(super) format: Option<RawSourceFormat>,
    pub(super) field: Option<Spanned<String>>,
}

/// `format = "lines" | "ndjson"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RawSourceFormat {
    Lines,
    Ndjson,
}

impl<'de> Deserialize<'de> for RawSourceFormat {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const WORDS: &[(&str, RawSourceFormat)] = &[
            ("lines", RawSourceFormat::Lines),
            ("ndjson", RawSourceFormat::Ndjson),
        ];
        deserializer.deserialize_str(Keyword(WORDS))
    }
}

/// Defaults shared with `env.rs` and the messages in `validate.rs`.
pub(super) mod defaults {
    use std::time::Duration;

    pub(in crate::config) const SERVER_LISTEN: &str = "0.0.0.0:8080";
    pub(in crate::config) const ADMIN_LISTEN: &str = "127.0.0.1:9091";
    pub(in crate::config) const ROUTE_METHOD: &str = "GET";
    pub(in crate::config) const DOUBLE_DELETE_DELAY: Duration = Duration::from_secs(1);
    /// Default journal file name, next to the config file.
    pub(in crate::config) const JOURNAL_FILE: &str = "cacheguard.journal";
    pub(in crate::config) const BLOOM_REFRESH: Duration = Duration::from_secs(600);
    pub(in crate::config) const BLOOM_LOAD_TIMEOUT: Duration = Duration::from_secs(300);
    pub(in crate::config) const BLOOM_REJECT_BODY: &str = "not found\n";
    pub(in crate::config) const WARMUP_RATE: u32 = 10;
    /// hyper's own default: the header fields it parses a request head into on the stack.
    pub(in crate::config) const MAX_HEADERS: usize = 100;
    /// Most header fields a request may be allowed: hyper parses every head into an array
    /// of `max_headers` slots (64 bytes each, allocated per request above the default).
    pub(in crate::config) const MAX_HEADERS_LIMIT: usize = 1000;
    /// Most lines `access_log.buffer` may hold (a queued line takes about 300 bytes).
    pub(in crate::config) const ACCESS_LOG_MAX_BUFFER: usize = 1_000_000;
}

// === impl HumanDuration ===

/// A duration written as a human string: `"250ms"`, `"30s"`, `"5m"`, `"1h 30m"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HumanDuration(pub(super) Duration);

impl HumanDuration {
    const fn secs(secs: u64) -> Self {
        Self(Duration::from_secs(secs))
    }

    const fn millis(millis: u64) -> Self {
        Self(Duration::from_millis(millis))
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DurationVisitor;

        impl Visitor<'_> for DurationVisitor {
            type Value = HumanDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration like \"30s\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                humantime::parse_duration(v)
                    .map(HumanDuration)
                    .map_err(|_| E::custom(format!("expected a duration like \"30s\", got {v:?}")))
            }
        }

        deserializer.deserialize_str(DurationVisitor)
    }
}

// === impl RawL1, RawOnTimeout, RawAccessLogFormat ===

/// `l1 = "hot" | "all" | "off"`.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawL1(pub(super) L1Policy);

impl<'de> Deserialize<'de> for RawL1 {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const WORDS: &[(&str, L1Policy)] = &[
            ("hot", L1Policy::Hot),
            ("all", L1Policy::All),
            ("off", L1Policy::Off),
        ];
        deserializer.deserialize_str(Keyword(WORDS)).map(Self)
    }
}

/// `l1_while_bus_down = "bypass" | "serve"` in `[cache]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawL1WhileBusDown(pub(super) L1WhileBusDown);

impl<'de> Deserialize<'de> for RawL1WhileBusDown {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const WORDS: &[(&str, L1WhileBusDown)] = &[
            ("bypass", L1WhileBusDown::Bypass),
            ("serve", L1WhileBusDown::Serve),
        ];
        deserializer.deserialize_str(Keyword(WORDS)).map(Self)
    }
}

/// `freshness = "route" | "origin"`.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawFreshness(pub(super) FreshnessSource);

impl<'de> Deserialize<'de> for RawFreshness {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const WORDS: &[(&str, FreshnessSource)] = &[
            ("route", FreshnessSource::Route),
            ("origin", FreshnessSource::Origin),
        ];
        deserializer.deserialize_str(Keyword(WORDS)).map(Self)
    }
}

/// `on_timeout = "origin" | "error"`.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawOnTimeout(pub(super) OnTimeout);

impl<'de> Deserialize<'de> for RawOnTimeout {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const WORDS: &[(&str, OnTimeout)] =
            &[("origin", OnTimeout::Origin), ("error", OnTimeout::Error)];
        deserializer.deserialize_str(Keyword(WORDS)).map(Self)
    }
}

/// `format = "off" | "json" | "combined"` in `[access_log]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawAccessLogFormat(pub(super) AccessLogFormat);

impl<'de> Deserialize<'de> for RawAccessLogFormat {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const WORDS: &[(&str, AccessLogFormat)] = &[
            ("off", AccessLogFormat::Off),
            ("json", AccessLogFormat::Json),
            ("combined", AccessLogFormat::Combined),
        ];
        deserializer.deserialize_str(Keyword(WORDS)).map(Self)
    }
}

/// Visitor for a string that must be one of a fixed set of words. Written by hand (rather
/// than a derived enum) so the message reads `expected one of "hot", "all", "off", got "x"`.
struct Keyword<T: 'static>(&'static [(&'static str, T)]);

impl<T: 'static> Keyword<T> {
    fn choices(&self) -> String {
        let quoted: Vec<String> = self.0.iter().map(|(word, _)| format!("{word:?}")).collect();
        format!("one of {}", quoted.join(", "))
    }
}

impl<T: Copy + 'static> Visitor<'_> for Keyword<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.choices())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        self.0
            .iter()
            .find(|(word, _)| *word == v)
            .map(|(_, value)| *value)
            .ok_or_else(|| E::custom(format!("expected {}, got {v:?}", self.choices())))
    }
}

// === impl RawQuery ===

/// `query = "sorted" | "ignore" | ["param", ...]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum RawQuery {
    Sorted,
    Ignore,
    /// Names as written; sorted, deduplicated and checked in `validate.rs`.
    Allow(Vec<String>),
}

impl<'de> Deserialize<'de> for RawQuery {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct QueryVisitor;

        const EXPECTED: &str = "\"sorted\", \"ignore\" or an array of parameter names";

        impl<'de> Visitor<'de> for QueryVisitor {
            type Value = RawQuery;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(EXPECTED)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawQuery, E> {
                match v {
                    "sorted" => Ok(RawQuery::Sorted),
                    "ignore" => Ok(RawQuery::Ignore),
                    _ => Err(E::custom(format!("expected {EXPECTED}, got {v:?}"))),
                }
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawQuery, A::Error> {
                let mut names = Vec::new();
                while let Some(name) = seq.next_element::<String>()? {
                    names.push(name);
                }
                Ok(RawQuery::Allow(names))
            }
        }

        deserializer.deserialize_any(QueryVisitor)
    }
}
