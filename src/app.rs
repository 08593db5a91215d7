//! Builds every component once from a [`Config`] and runs the listeners.
//!
//! Shutdown order: stop accepting on both listeners, drain in-flight requests (bounded by
//! `server.shutdown_grace`), wait for the access log's writer (bounded), then stop
//! background tasks (the Redis probe, the status page's sampler).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

use crate::admin::{Admin, Status};
use crate::cache::l1::L1;
use crate::cache::l2::L2;
use crate::cache::marks::LocalMarks;
use crate::cache::tiers::Tiers;
use crate::config::{Config, JournalFsync, RedisConfig, Vars};
use crate::consistency::invalidate::Invalidator;
use crate::consistency::journal::{self, FsyncPolicy, Journal};
use crate::consistency::stream::{self, StreamSettings};
use crate::coord::events::{BusListener, BusMetrics, EventBus, Waiters};
use crate::coord::locks::{LockService, MemoryLocks, RedisLocks};
use crate::coord::store::RedisStore;
use crate::coord::{Keyspace, RedisConn};
use crate::metrics::Metrics;
use crate::protect::bloom::Filters;
use crate::protect::flight::fleet::FleetLock;
use crate::protect::hotkeys::HotKeys;
use crate::protect::serialize::Serializer;
use crate::protect::stock::Gates;
use crate::proxy::access_log::AccessLog;
use crate::proxy::fill::{Filler, Flights};
use crate::proxy::hot::HotGate;
use crate::proxy::linger::LingerBounds;
use crate::proxy::origin::Origin;
use crate::proxy::origin_guard::{GuardMetrics, Limits, OriginGuard};
use crate::proxy::own_answer::OwnAnswerLog;
use crate::proxy::passthrough::Passthrough;
use crate::proxy::purge_limits::PurgeLimits;
use crate::proxy::read::ReadPath;
use crate::proxy::route::RouteTable;
use crate::proxy::server::{self, Admission, ConnLimits};
use crate::proxy::spool::SpoolConfig;
use crate::proxy::upstream::Upstream;
use crate::proxy::write::WritePath;
use crate::proxy::{CacheEvents, Proxy};
use crate::reload::{self, Live, Reloaded, Source};

/// How long generations, tag invalidation times and local marks are kept: longer than any
/// fill can run (the longest entry life — a refresh may begin just before it ends —, the
/// upstream timeout, a lease) plus a margin.
/// How often invalidations held in memory (the journal could not be written) are retried.
const HELD_RETRY: Duration = Duration::from_millis(500);

/// Connections the admin listener keeps open at once: its own bound, apart from the
/// proxy's, so `/healthz` and `/metrics` answer while the proxy listener is flooded.
const ADMIN_MAX_CONNECTIONS: usize = 256;

fn invalidation_horizon(config: &Config) -> Duration {
    let longest_entry = config
        .routes
        .iter()
        .filter(|r| r.is_read())
        .map(|r| r.ttl.mul_f64(1.0 + r.jitter) + r.grace)
        .max()
        .unwrap_or_default();
    longest_entry + config.upstream.timeout + config.lock.lease + Duration::from_secs(60)
}

fn journal_policy(fsync: JournalFsync) -> FsyncPolicy {
    match fsync {
        JournalFsync::Always => FsyncPolicy::Always,
        JournalFsync::Interval(every) => FsyncPolicy::Interval(every),
        JournalFsync::Never => FsyncPolicy::Never,
    }
}

/// Retries journaled invalidations until each is done; Redis coming back wakes it.
fn spawn_retries(
    journal: &Arc<Journal>,
    conn: &RedisConn,
    invalidator: &Arc<Invalidator>,
    stop: &CancellationToken,
) {
    let wake = Arc::clone(&invalidator.wake);
    let back = Arc::clone(conn.back());
    let forward = Arc::clone(&wake);
    let stop_forward = stop.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop_forward.cancelled() => return,
                () = back.notified() => forward.notify_one(),
            }
        }
    });
    // Owed invalidations the journal could not take (a full disk) are held in memory:
    // retried every half second until Redis or the journal takes them.
    let held = Arc::clone(invalidator);
    let stop_held = stop.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop_held.cancelled() => return,
                () = tokio::time::sleep(HELD_RETRY) => {}
            }
            if held.journal_failing() {
                held.retry_held().await;
            }
        }
    });
    let inv = Arc::clone(invalidator);
    tokio::spawn(journal::run_retries(
        Arc::clone(journal),
        move |owed| {
            let inv = Arc::clone(&inv);
            async move { inv.retry(&owed).await }
        },
        wake,
        stop.clone(),
    ));
}

/// Consumes the invalidation stream: each entry's paths and tags are invalidated.
fn spawn_stream(
    proxy: &Arc<Proxy>,
    conn: &RedisConn,
    config: &Config,
    instance: u64,
    stop: &CancellationToken,
) {
    let settings = StreamSettings {
        key: config.stream.key.clone(),
        group: config.stream.group.clone(),
        consumer: format!("{instance:016x}"),
        batch: config.stream.batch,
        block: Duration::from_secs(1),
        claim_idle: config.stream.claim_idle,
        command_timeout: config.redis.as_ref().map_or(Duration::from_secs(1), |r| {
            r.command_timeout.max(Duration::from_millis(500))
        }),
    };
    let proxy = Arc::clone(proxy);
    let metrics = proxy.metrics.stream.clone();
    conn.io().spawn(stream::run(
        conn.backend().clone(),
        settings,
        move |targets| {
            let proxy = Arc::clone(&proxy);
            async move { proxy.apply_stream_targets(targets).await }
        },
        metrics,
        stop.clone(),
    ));
}

/// Starts the event bus on `conn`: one subscription that wakes the fleet lock's waiters and
/// hands key and Bloom events to `listeners`. Returns once the first subscription is up
/// (bounded by `redis.connect_timeout`), so the first stampede after start already
/// coalesces across instances; until then the instance runs degraded.
async fn start_event_bus(
    conn: &RedisConn,
    rc: &RedisConfig,
    instance: u64,
    listeners: Vec<Arc<dyn BusListener>>,
    metrics: &Metrics,
    stop: &CancellationToken,
) -> Arc<EventBus> {
    let waiters = Waiters::new(metrics.lock_waiters.clone());
    let channel = Keyspace::new(&rc.key_prefix).events_channel();
    let bus = EventBus::new(channel, instance, waiters, listeners);
    let bus_metrics = BusMetrics {
        subscribed: metrics.bus_subscribed.clone(),
        resubscriptions: metrics.bus_resubscriptions.clone(),
        events: metrics.bus_events.clone(),
    };
    conn.io().spawn(Arc::clone(&bus).run(
        conn.clone(),
        rc.connect_timeout,
        bus_metrics,
        stop.clone(),
    ));
    let ready = tokio::time::Instant::now() + rc.connect_timeout;
    while conn.is_up() && !bus.is_connected() && tokio::time::Instant::now() < ready {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    bus
}

/// The read path over `tiers`: the hot-key gate and the filler share the in-process
/// flights and the hit-for-miss set. The flights are not joined once their key was
/// invalidated (`marks`).
fn read_path(
    config: &Config,
    tiers: Arc<Tiers>,
    marks: &Arc<LocalMarks>,
    hot: &Arc<HotKeys>,
    store: Option<RedisStore>,
    origin: &Arc<Origin>,
    metrics: &Metrics,
) -> Arc<ReadPath> {
    let flights = Arc::new(Flights::new(Arc::clone(marks)));
    let uncacheable = moka::sync::Cache::builder()
        .max_capacity(100_000)
        .time_to_live(config.lock.uncacheable_ttl)
        .build();
    Arc::new(ReadPath {
        tiers: Arc::clone(&tiers),
        gate: HotGate {
            hot: Arc::clone(hot),
            tiers: Arc::clone(&tiers),
            flights: Arc::clone(&flights),
            uncacheable: uncacheable.clone(),
        },
        filler: Arc::new(Filler {
            tiers,
            flights,
            lone: Arc::new(Flights::new(Arc::clone(marks))),
            fleet: store.map(|store| FleetLock::new(store, metrics.clone())),
            lock: ArcSwap::from_pointee(config.lock.clone()),
            uncacheable,
            refresh_backoff: moka::sync::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(REFRESH_BACKOFF)
                .build(),
            origin: Arc::clone(origin),
            metrics: metrics.clone(),
        }),
        origin: Arc::clone(origin),
    })
}

/// Every 30 s: drops the L1 entries past their end, and index members whose entries left.
async fn sweep_l1_index(l1: L1, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(30)) => l1.sweep(),
        }
    }
}

/// How long a key whose background refresh failed waits before the next attempt.
const REFRESH_BACKOFF: Duration = Duration::from_secs(1);

/// Entry point: `App::start(config)` binds the proxy and admin listeners and serves.
#[derive(Debug)]
pub struct App;

/// A started cacheguard: its bound addresses and the handle to stop it.
#[derive(Debug)]
pub struct Running {
    addr: SocketAddr,
    admin_addr: SocketAddr,
    stop_listeners: CancellationToken,
    stop_tasks: CancellationToken,
    servers: Vec<JoinHandle<()>>,
    /// Delayed deletes not yet done: run at once, and waited for, on shutdown.
    deferred: TaskTracker,
    /// What a config reload changes.
    live: Arc<Live>,
    /// The config file, once [`Running::watch_config`] was called.
    source: Option<Arc<Source>>,
}

/// The `[locks.<name>]` services, by name. One that cannot be reached now is logged and
/// kept: it answers as a lock service that does not answer until it can be reached, and its
/// routes follow their `on_redis_error` (see `coord/locks.rs`).
async fn connect_locks(
    configs: &[crate::config::LockBackendConfig],
) -> std::collections::HashMap<String, LockService> {
    let mut services = std::collections::HashMap::new();
    for config in configs {
        services.insert(
            config.name.clone(),
            crate::coord::locks::connect(config).await,
        );
    }
    services
}

/// How long shutdown waits for the delayed deletes it runs early.
const DEFERRED_GRACE: Duration = Duration::from_secs(5);

/// How long shutdown waits for the access log's writer to write what is queued.
const ACCESS_LOG_GRACE: Duration = Duration::from_secs(2);

impl App {
    /// Binds `server.listen` and `admin.listen` (port 0 picks a free port) and starts serving.
    /// A Redis that is down at start is not an error: the instance starts degraded and
    /// connects when Redis answers.
    ///
    /// # Errors
    /// When a listener cannot be bound or a component cannot be built.
    pub async fn start(config: Config) -> anyhow::Result<Running> {
        // Risky but workable settings, each with its file, line and key.
        for warning in config.warnings() {
            tracing::warn!(message = "Risky configuration.", problem = %warning);
        }
        let registry = Registry::new();
        let metrics = Metrics::register(&registry).context("registering metrics")?;
        // First, before anything runs: a file that cannot be opened stops the start.
        let access_log = AccessLog::start(&config.access_log, metrics.access_log.clone())
            .map_err(anyhow::Error::msg)?;
        let stop_listeners = CancellationToken::new();
        let stop_tasks = CancellationToken::new();

        let redis = match &config.redis {
            Some(redis) => Some(
                RedisConn::start(redis, metrics.clone(), stop_tasks.clone())
                    .await
                    .context("connecting to Redis")?,
            ),
            None => None,
        };
        let horizon = invalidation_horizon(&config);
        let marks = Arc::new(LocalMarks::new(horizon, metrics.marks_overflow.clone()));
        let l1 = L1::new(
            config.cache.l1_max_bytes,
            config.cache.max_entry_bytes,
            Arc::clone(&marks),
        );
        tokio::spawn(sweep_l1_index(l1.clone(), stop_tasks.clone()));
        let l2 = match (&redis, &config.redis) {
            (Some(conn), Some(rc)) => Some(L2::new(
                conn.clone(),
                Keyspace::new(&rc.key_prefix),
                metrics.clone(),
            )),
            _ => None,
        };
        let workers = match config.server.worker_threads {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            n => n,
        };
        metrics.set_workers(workers);
        let instance = rand::random::<u64>();
        let hot = HotKeys::new(
            &config.hot_keys,
            workers,
            instance,
            redis
                .as_ref()
                .zip(config.redis.as_ref())
                .map(|(conn, rc)| (conn.clone(), Keyspace::new(&rc.key_prefix).events_channel())),
            &metrics,
        );
        tokio::spawn(Arc::clone(&hot).run(stop_tasks.clone()));
        let filters = Filters::new(
            &config.bloom,
            &metrics,
            redis
                .as_ref()
                .zip(config.redis.as_ref())
                .map(|(conn, rc)| (conn.clone(), Keyspace::new(&rc.key_prefix))),
            instance,
        );
        let gates = Gates::new(
            &config.stock,
            &config.upstream,
            redis
                .as_ref()
                .zip(config.redis.as_ref())
                .map(|(conn, rc)| (conn.clone(), Keyspace::new(&rc.key_prefix))),
            instance,
            &metrics,
        );
        // The fleet-wide fill lock and the event bus that wakes its waiters (and carries
        // Bloom adds and the stock gates' sold-out marks).
        let dist = match (&redis, &config.redis) {
            (Some(conn), Some(rc)) => {
                // Nothing is heard before the first subscription.
                marks.bus_lost();
                let listeners: Vec<Arc<dyn BusListener>> = vec![
                    Arc::clone(&filters) as _,
                    Arc::clone(&gates) as _,
                    Arc::new(CacheEvents {
                        l1: l1.clone(),
                        hot: Arc::clone(&hot),
                        marks: Arc::clone(&marks),
                    }) as _,
                ];
                let bus =
                    start_event_bus(conn, rc, instance, listeners, &metrics, &stop_tasks).await;
                Some(
                    RedisStore::new(
                        conn.clone(),
                        Keyspace::new(&rc.key_prefix),
                        config.lock.lease,
                        bus,
                    )
                    .with_wait_replicas(
                        config.lock.wait_replicas,
                        config.lock.wait_replicas_timeout,
                    )
                    .with_longest_fetch(
                        config.upstream.queue_timeout
                            + config.upstream.connect_timeout
                            + config.upstream.timeout,
                    ),
                )
            }
            _ => None,
        };
        // After the first subscription, so no create's event falls between the snapshot
        // read and the subscription.
        filters.spawn(&stop_tasks);
        gates.spawn(&stop_tasks);
        let routes = RouteTable::build(&config.routes, &metrics, &filters, &gates)
            .context("building routes")?;
        let upstream = Upstream::new(&config.upstream, workers, metrics.origin_off_worker())
            .context("building the upstream client")?;
        metrics.origin_caps(&config.upstream);
        let guard = OriginGuard::new(Limits::of(&config.upstream), GuardMetrics::of(&metrics));
        // Owed invalidations: the journal (shared mode only: in embedded mode nothing is
        // owed to anyone), its retry loop, and the invalidation stream's consumer.
        let journal = match &redis {
            Some(_) => Some(
                Journal::open(
                    &config.journal.path,
                    journal_policy(config.journal.fsync),
                    metrics.journal.clone(),
                )
                .with_context(|| {
                    format!("opening the journal {}", config.journal.path.display())
                })?,
            ),
            None => None,
        };
        let invalidator = Arc::new(Invalidator::new(
            l1.clone(),
            Arc::clone(&hot),
            Arc::clone(&marks),
            dist.clone(),
            journal.clone(),
            horizon,
            metrics.clone(),
        ));
        if let (Some(journal), Some(conn)) = (&journal, &redis) {
            spawn_retries(journal, conn, &invalidator, &stop_tasks);
        }
        let origin = Arc::new(Origin {
            upstream: ArcSwap::from_pointee(upstream),
            guard: ArcSwap::from_pointee(guard),
            max_body_bytes: config.server.max_body_bytes,
        });
        let tiers = Arc::new(Tiers::new(
            l1.clone(),
            l2,
            Arc::clone(&marks),
            Arc::clone(&hot) as _,
            Arc::clone(&invalidator) as _,
            metrics.clone(),
        ));
        let read = read_path(
            &config,
            tiers,
            &marks,
            &hot,
            dist.clone(),
            &origin,
            &metrics,
        );
        let routes = Arc::new(ArcSwap::from_pointee(routes));
        let passthrough = Arc::new(Passthrough {
            origin: Arc::clone(&origin),
            spool: SpoolConfig {
                memory_bytes: config.server.body_buffer_bytes,
                dir: config.server.body_spool_dir.clone(),
            },
        });
        // Serialized writes take their locks in the shared Redis; in embedded mode the
        // fleet is this process.
        let locks = match (&redis, &config.redis, &dist) {
            (Some(conn), Some(rc), Some(store)) => LockService::Redis(RedisLocks::new(
                conn.clone(),
                Keyspace::new(&rc.key_prefix),
                Arc::clone(store.waiters()),
                instance,
            )),
            _ => LockService::Memory(MemoryLocks::new()),
        };
        let write = Arc::new(WritePath {
            serializer: Serializer::new(locks, connect_locks(&config.locks).await),
            routes: Arc::clone(&routes),
            invalidator: Arc::clone(&invalidator),
            filters: Arc::clone(&filters),
            passthrough: Arc::clone(&passthrough),
            deferred: TaskTracker::new(),
            background: tokio::runtime::Handle::current(),
            stop: stop_tasks.clone(),
        });
        let proxy = Arc::new(Proxy {
            routes,
            read,
            write,
            passthrough,
            origin,
            l1: l1.clone(),
            store: dist,
            max_header_bytes: config.server.max_header_bytes,
            max_headers: config.server.max_headers,
            max_body_bytes: config.server.max_body_bytes,
            passthrough_metrics: metrics.for_route(crate::proxy::PASSTHROUGH),
            metrics: metrics.clone(),
            invalidator: Arc::clone(&invalidator),
            own_answers: OwnAnswerLog::new(),
            access_log,
        });
        let deferred = proxy.write.deferred.clone();
        if let (Some(conn), Some(_)) = (&redis, &config.redis)
            && config.stream.enabled
        {
            spawn_stream(&proxy, conn, &config, instance, &stop_tasks);
        }
        proxy.spawn_warmups(&stop_tasks);
        let token = Arc::new(ArcSwap::from_pointee(config.admin.token.clone()));
        let purge_limits = Arc::new(PurgeLimits::new(&config.admin));
        let (shared, route_count) = (config.redis.is_some(), config.routes.len());
        let listen = (config.server.listen, config.admin.listen);
        let admissions = {
            let proxy = Admission::new(config.server.max_connections, metrics.connections("proxy"));
            (
                proxy,
                Admission::new(ADMIN_MAX_CONNECTIONS, metrics.connections("admin")),
            )
        };
        let limits = ConnLimits {
            max_header_bytes: config.server.max_header_bytes,
            max_headers: config.server.max_headers,
            max_body_bytes: config.server.max_body_bytes,
            header_read_timeout: config.server.header_read_timeout,
            keepalive_timeout: config.server.keepalive_timeout,
            linger: LingerBounds {
                time: config.server.lingering_time,
                timeout: config.server.lingering_timeout,
            },
            shutdown_grace: config.server.shutdown_grace,
        };
        let live = Arc::new(Live {
            proxy: Arc::clone(&proxy),
            hot: Arc::clone(&hot),
            filters: Arc::clone(&filters),
            gates,
            token: Arc::clone(&token),
            redis: redis.clone(),
            purge_limits: Arc::clone(&purge_limits),
            metrics: metrics.clone(),
            current: tokio::sync::Mutex::new(config),
            generation: std::sync::atomic::AtomicU64::new(0),
        });
        live.started(0);
        // The status page's sampler: a sample every two seconds, so a page opened later
        // shows the minutes before it.
        let status = Arc::new(Status::new(Arc::clone(&live)));
        tokio::spawn(Arc::clone(&status).run(stop_tasks.clone()));
        let admin = Arc::new(Admin {
            registry,
            metrics,
            l1,
            redis,
            filters,
            hot,
            token,
            purge_limits,
            proxy: Arc::clone(&proxy),
            live: Arc::clone(&live),
            status,
        });

        let listener = TcpListener::bind(listen.0)
            .await
            .with_context(|| format!("binding server.listen {}", listen.0))?;
        let admin_listener = TcpListener::bind(listen.1)
            .await
            .with_context(|| format!("binding admin.listen {}", listen.1))?;
        let addr = listener.local_addr()?;
        let admin_addr = admin_listener.local_addr()?;

        let stop_proxy = stop_listeners.clone();
        let proxy_handler = Arc::new(move |request, peer| {
            let proxy = Arc::clone(&proxy);
            async move { proxy.handle(request, peer).await }
        });
        let admin_handler = Arc::new(move |request, peer| Arc::clone(&admin).handle(request, peer));
        let servers = vec![
            tokio::spawn(async move {
                if let Err(error) = server::serve_sharded(
                    "proxy",
                    listener,
                    limits,
                    admissions.0,
                    stop_proxy,
                    proxy_handler,
                    workers,
                )
                .await
                {
                    tracing::error!(message = "Proxy workers could not start.", %error);
                }
            }),
            tokio::spawn(server::serve(
                "admin",
                admin_listener,
                limits,
                admissions.1,
                stop_listeners.clone(),
                admin_handler,
            )),
        ];
        info!(
            message = "cacheguard started.",
            listen = %addr,
            admin = %admin_addr,
            mode = if shared { "shared" } else { "embedded" },
            routes = route_count,
            workers,
        );
        Ok(Running {
            addr,
            admin_addr,
            stop_listeners,
            stop_tasks,
            servers,
            deferred,
            live,
            source: None,
        })
    }
}

impl Running {
    /// The proxy listener's bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The admin listener's bound address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Reloads the config from `path` whenever its content changes (checked every 500 ms),
    /// and makes [`Running::reload`] (what `SIGHUP` calls) read it. `vars` are the
    /// environment overrides, as at start.
    pub fn watch_config(&mut self, path: PathBuf, vars: Arc<dyn Vars + Send + Sync>) {
        let source = Arc::new(Source { path, vars });
        // The file as read at start is generation 1.
        if let Ok(text) = std::fs::read_to_string(&source.path) {
            self.live.started(reload::text_hash(&text));
        }
        tokio::spawn(reload::watch(
            Arc::clone(&self.live),
            Arc::clone(&source),
            self.stop_tasks.clone(),
        ));
        self.source = Some(source);
    }

    /// Reloads the config file now (`SIGHUP`).
    ///
    /// # Errors
    /// No file is watched, or the file is unreadable, invalid or not applicable: the
    /// message says why (file, line and key for an invalid file); the running config is
    /// unchanged.
    pub async fn reload(&self) -> Result<Reloaded, String> {
        let Some(source) = &self.source else {
            return Err("no config file to reload: watch_config was not called".to_owned());
        };
        reload::reload_file(&self.live, source).await
    }

    /// Graceful shutdown: stop accepting, drain in-flight requests (bounded by
    /// `server.shutdown_grace`), let the access log write their lines, stop background
    /// tasks.
    /// Delayed deletes still waiting are done at once (a write's owed invalidations are
    /// never dropped by a restart; what Redis cannot take goes to the journal).
    pub async fn shutdown(mut self) {
        self.stop_listeners.cancel();
        for server in std::mem::take(&mut self.servers) {
            let _ = server.await;
        }
        self.live.proxy.access_log.drain(ACCESS_LOG_GRACE).await;
        self.stop_tasks.cancel();
        self.deferred.close();
        let _ = tokio::time::timeout(DEFERRED_GRACE, self.deferred.wait()).await;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // A `Running` dropped without `shutdown()` (a test that panicked) must not leave
        // listeners or probes behind.
        self.stop_listeners.cancel();
        self.stop_tasks.cancel();
    }
}
