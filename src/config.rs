//! Configuration: the validated model the rest of cacheguard reads.
//!
//! The TOML file is parsed into the serde mirror in `config/raw.rs`, then turned into
//! [`Config`] by `config/validate.rs`, the only constructor of these types ("parse, don't
//! validate"). Environment overrides (`CACHEGUARD_*`) are read through [`Vars`] so tests never
//! touch the process environment. Every error names the file, the line and the key.

mod env;
mod raw;
#[cfg(test)]
mod tests;
mod validate;
mod values;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Client headers that tell an origin (or a framework in front of it) who the client is,
/// where it came from or what it really asked for. A client must not choose them: they
/// are dropped from every forwarded request, but for those a route's
/// `forward_client_headers` names (a trusted front sets them), and cacheguard sets
/// `X-Forwarded-For` and `X-Forwarded-Proto` itself.
pub(crate) const CLIENT_CLAIMS: [&str; 17] = [
    "forwarded",
    "x-forwarded-host",
    "x-forwarded-port",
    "x-forwarded-server",
    "x-forwarded-scheme",
    "x-forwarded-ssl",
    "x-forwarded-prefix",
    "x-real-ip",
    "x-client-ip",
    "x-host",
    "x-original-url",
    "x-rewrite-url",
    "x-original-host",
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "x-original-method",
];

/// Those of [`CLIENT_CLAIMS`] that make the origin run another method than the request's.
pub(crate) const METHOD_OVERRIDES: [&str; 4] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
    "x-original-method",
];

use http::{HeaderName, Method, StatusCode, Uri};

pub use env::{ProcessEnv, Vars};
pub(crate) use values::redact_url;
pub use values::{ConfigError, ConfigProblem};

/// The whole validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where the config came from (file path or a label), for messages.
    pub source: String,
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    /// `None` = embedded mode (L1 only, in-process single-flight).
    pub redis: Option<RedisConfig>,
    pub admin: AdminConfig,
    pub cache: CacheDefaults,
    pub lock: LockConfig,
    /// Cached routes, in file order. Matching is by path pattern, then method.
    pub routes: Vec<RouteConfig>,
    /// Bloom filters of existing ids (`[[bloom]]`), in file order.
    pub bloom: Vec<BloomConfig>,
    pub hot_keys: HotKeysConfig,
    /// Where owed invalidations are kept (shared mode).
    pub journal: JournalConfig,
    /// External invalidations from a Redis Stream (shared mode).
    pub stream: StreamConfig,
    /// One line per request (`[access_log]`).
    pub access_log: AccessLogConfig,
    /// Stock gates (`[[stock]]`), in file order.
    pub stock: Vec<StockConfig>,
    /// Lock services of serialized writes (`[locks.<name>]`), by name.
    pub locks: Vec<LockBackendConfig>,
    /// What the file allows but is likely wrong, `file:line: key: message` like an error;
    /// see [`Config::warnings`].
    warnings: Vec<ConfigProblem>,
}

/// `[journal]`: the local append-only file of invalidations Redis could not take yet.
#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// Relative paths are resolved against the config file's directory.
    pub path: PathBuf,
    pub fsync: JournalFsync,
}

/// When the journal is synced to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JournalFsync {
    /// Before the write's answer is released (group commit): survives a power loss.
    Always,
    /// At most this often: survives a crash of cacheguard, not of the machine.
    Interval(Duration),
    /// Left to the OS: survives a crash of cacheguard, not of the machine.
    Never,
}

/// `[access_log]`: one line per proxied request, written off the request path.
#[derive(Clone, Debug, PartialEq)]
pub struct AccessLogConfig {
    pub format: AccessLogFormat,
    pub path: AccessLogPath,
    /// The fraction of requests logged, in `(0, 1]`; cacheguard's own answers and every
    /// 5xx are logged whatever it says.
    pub sample: f64,
    /// Whether the query string is written after the path.
    pub query: bool,
    /// Lines the channel to the writer holds; one more is dropped and counted.
    pub buffer: usize,
}

/// `access_log.format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessLogFormat {
    /// Nothing is logged (the default).
    Off,
    /// One JSON object per line.
    Json,
    /// nginx's `combined` format followed by cacheguard's fields.
    Combined,
}

/// `access_log.path`: where the lines go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AccessLogPath {
    Stdout,
    Stderr,
    /// A file, opened for appending (created if missing); relative paths are resolved
    /// against the config file's directory.
    File(PathBuf),
}

impl std::fmt::Display for AccessLogPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AccessLogPath::Stdout => f.write_str("stdout"),
            AccessLogPath::Stderr => f.write_str("stderr"),
            AccessLogPath::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// `[invalidation_stream]`: a Redis Stream CDC tools and batch jobs write invalidations to.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    pub enabled: bool,
    /// The stream's key (default `<redis.key_prefix>invalidate`).
    pub key: String,
    /// Consumer group: one per fleet; each entry is applied by one instance of it.
    pub group: String,
    /// Entries per read.
    pub batch: usize,
    /// Entries another consumer left unacknowledged this long are claimed.
    pub claim_idle: Duration,
}

/// `[hot_keys]`: keys over `threshold_rps` are served from L1 on every instance, with at
/// most `max_backend_rps_per_key` requests per second per key going past L1.
#[derive(Clone, Debug)]
pub struct HotKeysConfig {
    /// Requests per second (per instance) that make a key hot; 0 = detection off.
    pub threshold_rps: u32,
    /// A hot key cools down once its rate stays under this for a second.
    pub cool_rps: u32,
    /// Length of one measuring window.
    pub window: Duration,
    /// How long a hot key's L1 copy is served before Redis is asked again (jittered).
    pub l1_ttl: Duration,
    /// Per key and instance, requests per second that may go past L1 to Redis and the
    /// origin; 0 = no limit.
    pub max_backend_rps_per_key: u32,
    /// Largest hot set.
    pub max_hot_keys: usize,
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Largest request head (request line + headers) accepted; larger → 431.
    pub max_header_bytes: usize,
    /// Most header fields in one request head; more → 431.
    pub max_headers: usize,
    /// Largest request body accepted; larger → 413.
    pub max_body_bytes: u64,
    /// Time a client has to send its request head, from its first byte (the first
    /// request: from accept).
    pub header_read_timeout: Duration,
    /// Time a connection may stay idle between two requests.
    pub keepalive_timeout: Duration,
    /// The longest a lingering close (write side shut down, what the client still sends
    /// read and discarded) lasts in all.
    pub lingering_time: Duration,
    /// The longest one read of a lingering close waits for the client.
    pub lingering_timeout: Duration,
    /// How long shutdown waits for in-flight requests before cutting them.
    pub shutdown_grace: Duration,
    /// Proxy worker threads, each with its own event loop; 0 = the CPUs available to the
    /// process (which respects a container's CPU quota).
    pub worker_threads: usize,
    /// Connections the proxy listener keeps open at once; one more is closed at accept.
    pub max_connections: usize,
    /// Bytes of a write's request body held in memory; the rest waits in a temporary file
    /// in `body_spool_dir` until the body is whole.
    pub body_buffer_bytes: usize,
    /// Where request bodies over `body_buffer_bytes` are spooled (anonymous files, never
    /// named in the directory); checked writable at load.
    pub body_spool_dir: PathBuf,
}

#[derive(Clone, Debug)]
pub struct UpstreamConfig {
    /// Origin base URL, `http://host:port` (a path prefix is allowed).
    pub url: Uri,
    /// Whole-response timeout for one origin request (head and body); exceeded → 504. For
    /// a request with a body, it starts once the body has been sent.
    pub timeout: Duration,
    /// How long a client's request body may pause between two reads; exceeded → 408. Also
    /// the grace before `upload_min_rate` applies, and how long the origin may take to read
    /// the next piece of a spooled body (exceeded → 504).
    pub upload_timeout: Duration,
    /// Bytes per second a client's request body must average once past its
    /// `upload_timeout` grace (the time it is allowed grows by one second per this many
    /// bytes received); slower → 408. 0 = no rate bound.
    pub upload_min_rate: u32,
    /// The longest a client's request body may take in all; exceeded → 408.
    pub upload_deadline: Duration,
    pub connect_timeout: Duration,
    /// Origin guard: at most this many origin requests in flight.
    pub max_concurrency: usize,
    /// Origin guard: requests per second cap, 0 = none.
    pub max_rps: u32,
    /// Origin guard: how long a request may wait for a slot before it is shed (503).
    pub queue_timeout: Duration,
    /// Origin guard: bytes of origin answers buffered in memory at once (read for storage,
    /// until every client they go to has been sent them). A fetch reserves its route's
    /// `max_entry_bytes` before it starts; none free within `queue_timeout` → 503.
    pub max_buffered_bytes: u64,
    /// Idle keep-alive connections kept per origin host.
    pub pool_max_idle: usize,
    /// How long an idle keep-alive connection is kept: below the origin's own keep-alive
    /// timeout, so a request is never sent on a connection the origin is closing.
    pub pool_idle_timeout: Duration,
}

/// `Debug` redacts the password in `url`.
#[derive(Clone)]
pub struct RedisConfig {
    pub mode: RedisMode,
    /// Standalone: `redis://[user:pass@]host:port[/db]`; secret parts are redacted when
    /// shown. Empty in the other modes.
    pub url: String,
    /// Sentinel: the sentinels; cluster: the seed nodes. Empty for standalone.
    pub urls: Vec<String>,
    /// Sentinel: the name the sentinels monitor the primary under.
    pub master_name: String,
    /// ACL user for the data nodes, when set apart from the URL.
    pub username: Option<String>,
    /// Password for the data nodes (from `password`, `password_file` or
    /// `CACHEGUARD_REDIS_PASSWORD`); never shown.
    pub password: Option<String>,
    /// Where `password` was read from, when from `password_file` (watched for rotation).
    pub password_file: Option<PathBuf>,
    /// `tls_ca_file` and its PEM contents: the CA to verify `rediss://` servers with
    /// (instead of the system's roots).
    pub tls_ca: Option<(PathBuf, Vec<u8>)>,
    /// Upper bound on every Redis command; a slower answer is treated as Redis being down.
    pub command_timeout: Duration,
    pub connect_timeout: Duration,
    /// Prefix of every key cacheguard writes (default `cg:`).
    pub key_prefix: String,
    /// Consecutive failed or timed-out commands that open the circuit breaker.
    pub breaker_failures: u32,
}

/// How the shared Redis is deployed (`redis.mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedisMode {
    /// One server at `url` (or a proxy in front of several).
    Standalone,
    /// A primary and its replicas, found and followed through Redis Sentinel.
    Sentinel,
    /// A Redis Cluster, found from its seed nodes.
    Cluster,
}

impl RedisMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RedisMode::Standalone => "standalone",
            RedisMode::Sentinel => "sentinel",
            RedisMode::Cluster => "cluster",
        }
    }
}

/// `Debug` never shows the token.
#[derive(Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// Bearer token for mutating admin calls. `None` = mutating calls are refused.
    pub token: Option<String>,
    /// Purge requests naming a pattern, per second and token; those naming only keys and
    /// tags get ten times as many. 0 = no limit.
    pub purge_rate: u32,
    /// Purge requests naming a pattern at once, per token (ten times as many of the others).
    pub purge_burst: u32,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|u| values::redact_url(u)).collect();
        f.debug_struct("RedisConfig")
            .field("mode", &self.mode)
            .field("url", &values::redact_url(&self.url))
            .field("urls", &urls)
            .field("master_name", &self.master_name)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("password_file", &self.password_file)
            .field("tls_ca_file", &self.tls_ca.as_ref().map(|(path, _)| path))
            .field("command_timeout", &self.command_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("key_prefix", &self.key_prefix)
            .field("breaker_failures", &self.breaker_failures)
            .finish()
    }
}

impl std::fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("purge_rate", &self.purge_rate)
            .field("purge_burst", &self.purge_burst)
            .finish()
    }
}

/// Which responses are kept in the in-process L1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L1Policy {
    /// Only hot keys (in embedded mode L1 is the only tier and holds everything).
    Hot,
    /// Every cacheable response.
    All,
    /// Never (embedded mode then caches nothing).
    Off,
}

/// What a route with `version` does with its L1 copies while this instance's event bus
/// is not confirmed (down, or back but its gap not handled yet) and Redis answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L1WhileBusDown {
    /// Answer from Redis (L2, and the floor there) instead: a write another instance
    /// completed meanwhile is seen, though its `invalidate` event was not heard here.
    Bypass,
    /// Answer from L1 as usual: a copy made during the gap may be served after a write
    /// completed elsewhere, until the bus is back or the copy ends.
    Serve,
}

/// Where a stored answer's lifetime comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreshnessSource {
    /// The route's `ttl`, `grace` and `negative_ttl`, whatever the origin says (strict).
    /// Only keyed request headers reach the origin.
    Route,
    /// The origin's own headers (RFC 9111): `s-maxage`, `max-age`, `Expires`, and the
    /// `Surrogate-Control`/`CDN-Cache-Control` aimed at this cache, capped by the route's
    /// `ttl`; `stale-while-revalidate` sets the grace (capped by the route's `grace`).
    /// End-to-end request headers reach the origin.
    Origin,
}

/// What a waiter does when the lock holder does not fill in time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnTimeout {
    Origin,
    Error,
}

/// How the query string takes part in the cache key (and the forwarded URL).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueryPolicy {
    /// The query is not keyed and is removed from the forwarded URL.
    Ignore,
    /// Every parameter is keyed, sorted by name then value.
    Sorted,
    /// Only these parameters are keyed (sorted) and forwarded; others are removed.
    Allow(Vec<String>),
}

/// Defaults for every route (`[cache]`).
#[derive(Clone, Debug)]
pub struct CacheDefaults {
    pub ttl: Duration,
    /// Fraction in `0.0..1.0` (1.0 excluded): stored ttl is uniform in
    /// ttl × [1 - jitter, 1 + jitter].
    pub jitter: f64,
    /// Extra time a stale copy is kept past its ttl.
    pub grace: Duration,
    pub negative_ttl: Duration,
    pub max_entry_bytes: usize,
    pub l1_max_bytes: u64,
    pub l1: L1Policy,
    /// Routes with `version`, while the event bus is not confirmed and Redis answers.
    pub l1_while_bus_down: L1WhileBusDown,
    pub freshness: FreshnessSource,
    pub heuristic: f64,
    /// Distinct query or `vary` variants of one path fetched per `ttl`, per instance; 0 =
    /// no limit.
    pub max_variants: usize,
    /// Fetches per second, per route and instance, of variants beyond a spent
    /// `max_variants` (see `protect/variants.rs`); 0 = none.
    pub variant_overflow_rate: u32,
}

#[derive(Clone, Debug)]
pub struct LockConfig {
    pub lease: Duration,
    pub wait_timeout: Duration,
    pub on_timeout: OnTimeout,
    /// How long a key whose answer was not shareable skips single-flight (hit-for-miss).
    pub uncacheable_ttl: Duration,
    /// After acquiring a lock, `WAIT` for this many replicas to have it (0 = don't), so a
    /// failover right after is less likely to lose it and cause a second fetch.
    pub wait_replicas: u32,
    /// How long that `WAIT` may take: its own bound, not `redis.command_timeout`, so
    /// replication lag on a busy primary is counted as `unreplicated`, never as a Redis
    /// failure that could open the breaker.
    pub wait_replicas_timeout: Duration,
    /// How many keys this instance waits on another instance's fetch of at once; a miss
    /// beyond is answered per `on_timeout` without waiting.
    pub max_waiters: usize,
}

/// One `[[routes]]` entry with the `[cache]` defaults already applied.
#[derive(Clone, Debug)]
pub struct RouteConfig {
    /// Unique name; part of the cache key and the `route` metric label.
    pub name: String,
    /// matchit pattern, e.g. `/api/items/{id}`.
    pub pattern: String,
    /// Methods this route handles; `GET` implies `HEAD`.
    pub methods: Vec<Method>,
    pub ttl: Duration,
    pub jitter: f64,
    pub grace: Duration,
    pub negative_ttl: Duration,
    pub max_entry_bytes: usize,
    pub l1: L1Policy,
    /// Where a stored answer's lifetime comes from; `ttl` is a cap in `Origin` mode.
    pub freshness: FreshnessSource,
    /// `Origin` mode: the fraction of an answer's age at arrival by its `Last-Modified`
    /// that it is fresh for when it says nothing of its freshness (RFC 9111 §4.2.2);
    /// 0 = such answers are not stored.
    pub heuristic: f64,
    /// Distinct query or `vary` variants of one path fetched and cached per `ttl`, per
    /// instance. 0 = no limit.
    pub max_variants: usize,
    /// Beyond `max_variants`, fetches per second for the whole route (per instance): a
    /// variant asked for again is cached, a first ask is answered uncached (at most half of
    /// the rate), and the rest are refused (429). 0 = every variant beyond is refused until
    /// the window ends.
    pub variant_overflow_rate: u32,
    pub query: QueryPolicy,
    /// Request headers whose values are part of the key (and the only client headers,
    /// besides a fixed safe set, forwarded to the origin on a cached fetch). Sorted and
    /// deduplicated; never `authorization`, `proxy-authorization` or `cookie`.
    pub vary: Vec<HeaderName>,
    /// Client forwarding headers (of those cacheguard otherwise drops: `X-Forwarded-Host`,
    /// `X-Forwarded-Prefix`, ...) passed on to the origin as the client sent them, for the
    /// requests this route takes. On a read route each is also in `vary` (so every value is
    /// stored apart) and none is a method override. Sorted and deduplicated.
    pub forward_client_headers: Vec<HeaderName>,
    /// Write routes: path patterns to invalidate (used by the write path).
    pub invalidate: Vec<String>,
    pub double_delete_delay: Duration,
    /// Probabilistic early refresh (XFetch) strength; 0 = off, 1 = the paper's default.
    pub early_refresh_beta: f64,
    /// Read routes: the Bloom filter checked before any cache tier.
    pub bloom: Option<RouteBloom>,
    /// Write routes: the Bloom filter a created id is added to.
    pub bloom_add: Option<BloomAdd>,
    /// Read routes: paths fetched at start.
    pub warmup: Option<WarmupConfig>,
    /// Write routes: the stock gate each request takes units from before it is forwarded.
    pub stock: Option<RouteStock>,
    /// Write routes: writes to one resource go one at a time across the fleet.
    pub serialize: Option<SerializeConfig>,
    /// Where the origin tells a row's version: on a read route, what a fill's answer is
    /// compared with the floor by; on a write route, what its answer sets the floor to.
    pub version: Option<VersionSource>,
    /// Write routes with `version`: how long the floor a write sets is kept (at least the
    /// worst replica lag).
    pub version_floor_ttl: Duration,
    /// `[cache] l1_while_bus_down`: read routes with `version` (see
    /// [`RouteConfig::l1_needs_bus`]).
    pub l1_while_bus_down: L1WhileBusDown,
}

impl RouteConfig {
    /// Whether this route's L1 copies answer only while the event bus is confirmed (or
    /// Redis cannot be asked): a route with `version` whose `l1_while_bus_down` is
    /// `bypass`.
    pub fn l1_needs_bus(&self) -> bool {
        self.version.is_some() && self.l1_while_bus_down == L1WhileBusDown::Bypass
    }
}

/// `serialize = { … }` on a write route: a write is forwarded only while this instance
/// holds the resource's lock, fleet-wide, with a fencing token for the origin to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SerializeConfig {
    /// The resource's path pattern, over the route's parameters.
    pub key: String,
    /// How long a grant lasts unless renewed (renewed every third of it while the write is
    /// at the origin).
    pub lease: Duration,
    /// How long a write waits for the lock, in this instance's queue and the fleet's.
    pub wait_timeout: Duration,
    /// Writes waiting for one resource in this instance; one more is refused at once.
    pub max_waiters: usize,
    /// The request header the fencing token goes in; `None`: no token is sent (the lock is
    /// then only an efficiency lock).
    pub fence_header: Option<HeaderName>,
    pub on_redis_error: OnRedisError,
    /// The `Retry-After` of a write refused for waiting too long or too many.
    pub retry_after: Duration,
    /// The `[locks.<name>]` backend; `None`: the shared Redis.
    pub lock: Option<String>,
}

/// One `[locks.<name>]` lock service.
#[derive(Clone, Debug, PartialEq)]
pub struct LockBackendConfig {
    pub name: String,
    pub backend: LockBackend,
}

/// A lock service and how to reach it. `Debug` never shows a password.
#[derive(Clone, PartialEq)]
pub enum LockBackend {
    Etcd {
        /// `http://host:port` of each member.
        endpoints: Vec<String>,
        /// Lock keys live under it: `<prefix><resource path>`.
        prefix: String,
        username: Option<String>,
        password: Option<String>,
        connect_timeout: Duration,
    },
    ZooKeeper {
        /// `host:port[,host:port…]`.
        connect: String,
        /// Lock nodes live under it: `<path><resource path>/…` (Curator's layout).
        path: String,
        session_timeout: Duration,
    },
    Mysql {
        /// `mysql://user:password@host:port/database`.
        url: String,
        table: String,
    },
    Redlock {
        /// Independent Redis masters (`redis://…`), at least three.
        urls: Vec<String>,
        drift: f64,
    },
}

impl std::fmt::Debug for LockBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LockBackend::Etcd {
                endpoints,
                prefix,
                username,
                password,
                connect_timeout,
            } => f
                .debug_struct("Etcd")
                .field("endpoints", endpoints)
                .field("prefix", prefix)
                .field("username", username)
                .field("password", &password.as_ref().map(|_| "***"))
                .field("connect_timeout", connect_timeout)
                .finish(),
            LockBackend::ZooKeeper {
                connect,
                path,
                session_timeout,
            } => f
                .debug_struct("ZooKeeper")
                .field("connect", connect)
                .field("path", path)
                .field("session_timeout", session_timeout)
                .finish(),
            LockBackend::Mysql { url, table } => f
                .debug_struct("Mysql")
                .field("url", &values::redact_url(url))
                .field("table", table)
                .finish(),
            LockBackend::Redlock { urls, drift } => {
                let urls: Vec<String> = urls.iter().map(|u| values::redact_url(u)).collect();
                f.debug_struct("Redlock")
                    .field("urls", &urls)
                    .field("drift", drift)
                    .finish()
            }
        }
    }
}

impl LockBackend {
    /// The word users write in `backend`.
    pub fn kind(&self) -> &'static str {
        match self {
            LockBackend::Etcd { .. } => "etcd",
            LockBackend::ZooKeeper { .. } => "zookeeper",
            LockBackend::Mysql { .. } => "mysql",
            LockBackend::Redlock { .. } => "redlock",
        }
    }
}

/// Where a row's version is read from an origin answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VersionSource {
    /// A header holding a non-negative integer (a row version, a µs `updated_at`, ...).
    Integer(HeaderName),
    /// `Last-Modified` (or another header holding an HTTP date), compared as dates.
    Date(HeaderName),
}

impl VersionSource {
    pub fn header(&self) -> &HeaderName {
        match self {
            VersionSource::Integer(name) | VersionSource::Date(name) => name,
        }
    }
}

/// `stock = { gate, units }` on a write route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteStock {
    /// The `[[stock]]` gate's name.
    pub gate: String,
    /// Units one request takes (at least 1).
    pub units: u64,
}

/// What a stock gate does with a buy when Redis cannot answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnRedisError {
    /// 503 + `Retry-After`: the origin never sees an ungated crowd.
    Reject,
    /// Forwarded ungated (counted): the origin decides alone.
    Forward,
}

/// What a stock gate does with a retry (same idempotency key, same body) of a buy whose
/// outcome is in doubt: the origin timed out, failed with a 5xx or lost the connection
/// after the request was sent, so the first request may have sold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InDoubtRetry {
    /// 409 + `Retry-After`, never forwarded: against an origin that does not deduplicate
    /// by the key, a second forward could sell twice.
    Reject,
    /// Forwarded again with the same `Stock-Reservation` (no new unit taken): only for an
    /// origin that deduplicates by the idempotency key.
    Forward,
}

/// One `[[stock]]` gate: units of one kind of resource, counted in Redis (in process
/// memory in embedded mode) so that the origin sees about as many buys as there are units.
#[derive(Clone, Debug, PartialEq)]
pub struct StockConfig {
    pub name: String,
    /// The resource's path pattern (`/trains/{train}/seats/{type}`): a resource is this
    /// pattern filled from a bound route's parameters.
    pub key: String,
    /// The path (a pattern over the key's parameters) where the origin tells how many units
    /// are left, resolved against `upstream.url`.
    pub source_path: String,
    /// The JSON pointer (RFC 6901) to that number in the source's answer; empty: the whole
    /// body is the number.
    pub source_json: String,
    /// How often a resource in use is reconciled with the origin (and at once after any
    /// in-doubt outcome).
    pub reconcile: Duration,
    /// How long a unit stays reserved for a buy in flight; above `upstream.timeout`, so an
    /// instance that dies mid-buy gives its units back.
    pub reservation_ttl: Duration,
    /// The answer when there are not enough units.
    pub sold_out: SoldOutAnswer,
    /// Origin statuses that mean nothing was sold: the units go back at once.
    pub not_sold: Vec<StatusCode>,
    /// Origin statuses that mean the origin has none left: the gate goes to 0.
    pub origin_sold_out: Vec<StatusCode>,
    pub on_redis_error: OnRedisError,
    /// The request header of an idempotency key; `None`: keys are not looked at.
    pub idempotency_header: Option<HeaderName>,
    /// How long a completed buy's answer is replayed to a retry with the same key.
    pub idempotency_ttl: Duration,
    /// A retry of a buy whose outcome is in doubt: refused or forwarded again.
    pub in_doubt_retry: InDoubtRetry,
    /// How many keys one resource's units are spread over (on a Redis Cluster, several
    /// primaries share a hot resource); 1 = one key.
    pub segments: u16,
}

/// The gate's own "sold out" answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoldOutAnswer {
    pub status: StatusCode,
    pub body: String,
    pub content_type: String,
}

/// `warmup = { paths, file, rate }`: paths fetched through the cache (and the origin guard)
/// at start, at most `rate` per second, so a new or restarted fleet does not open cold.
#[derive(Clone, Debug)]
pub struct WarmupConfig {
    /// Paths (with an optional query) that match the route.
    pub paths: Vec<String>,
    /// More paths, one per line, read at start.
    pub file: Option<PathBuf>,
    /// Paths per second.
    pub rate: u32,
}

/// `bloom = { filter, param }` on a read route: ids absent from the filter are answered at
/// once with `status` and `body`.
#[derive(Clone, Debug)]
pub struct RouteBloom {
    pub filter: String,
    /// The path parameter (of the route's `match`) that carries the id.
    pub param: String,
    pub status: StatusCode,
    pub body: String,
}

/// `bloom_add = { filter, from }` on a write route.
#[derive(Clone, Debug)]
pub struct BloomAdd {
    pub filter: String,
    pub from: AddFrom,
}

/// Where the id of a created resource is found in a 2xx answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddFrom {
    /// The `Location` header's path, matched against the read routes of the same filter.
    Location,
    /// A JSON pointer (RFC 6901) into the response body, e.g. `/id`.
    Json(String),
}

/// One `[[bloom]]` filter of existing ids.
#[derive(Clone, Debug)]
pub struct BloomConfig {
    pub name: String,
    pub expected_items: usize,
    pub fp_rate: f64,
    /// Rebuild period from the source; zero = load once at start.
    pub refresh: Duration,
    /// Bound on one source load.
    pub load_timeout: Duration,
    pub source: BloomSource,
    pub format: SourceFormat,
}

/// Where a filter's ids come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BloomSource {
    /// An HTTP endpoint (a path is resolved against `upstream.url`).
    Url(Uri),
    File(PathBuf),
}

impl std::fmt::Display for BloomSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BloomSource::Url(uri) => write!(f, "{uri}"),
            BloomSource::File(path) => write!(f, "file:{}", path.display()),
        }
    }
}

/// How a source lists its ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceFormat {
    /// One id per line.
    Lines,
    /// One JSON object per line; the id is `field` (a string or an integer).
    Ndjson { field: String },
}

/// A path pattern filled from a matched route's parameters: `/api/items/{id}` with
/// `id = 7` is `/api/items/7` (`{*rest}` too).
pub(crate) fn fill_pattern(pattern: &str, params: &[(String, String)]) -> String {
    let mut path = pattern.to_owned();
    for (name, value) in params {
        path = path
            .replace(&format!("{{{name}}}"), value)
            .replace(&format!("{{*{name}}}"), value);
    }
    path
}

impl RouteConfig {
    /// A route with any read method is a cached (read) route; otherwise it is a write route.
    pub fn is_read(&self) -> bool {
        self.methods
            .iter()
            .any(|m| m == Method::GET || m == Method::HEAD)
    }
}

impl Config {
    /// Reads, parses and validates `path`, applying environment overrides from `vars`.
    ///
    /// # Errors
    /// Every problem found, each naming `file:line: key: what was expected`.
    pub fn load(path: &Path, vars: &dyn Vars) -> Result<Config, ConfigError> {
        validate::load_file(path, vars)
    }

    /// Parses and validates TOML text; `source` names it in messages.
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn from_toml(text: &str, source: &str, vars: &dyn Vars) -> Result<Config, ConfigError> {
        validate::from_toml(text, source, vars)
    }

    /// What the config allows but is likely wrong, in line order, each displayed as
    /// `file:line: key: message`. They do not stop a start or a reload: log them.
    pub fn warnings(&self) -> &[ConfigProblem] {
        &self.warnings
    }
}
