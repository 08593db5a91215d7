//! Where the shared Redis is and how to reach it: standalone, Sentinel-managed, or a Redis
//! Cluster (`redis.mode`).
//!
//! [`Backend`] makes the connections; [`DataConn`] is one connection to the data, whatever
//! the topology, and implements redis-rs's `ConnectionLike`, so every command, script and
//! pipeline in cacheguard is written once:
//!
//! - **standalone**: a `ConnectionManager` (reconnects by itself);
//! - **sentinel**: a `ConnectionManager` to the primary the sentinels name, replaced when
//!   they name another one (see [`super::sentinel`]);
//! - **cluster**: redis-rs `cluster-async`, which routes each command by its key's slot and
//!   follows `MOVED`/`ASK` and topology changes. Every key of one cache key carries one hash
//!   tag (see [`super::keyspace`]), so each Lua script touches one slot.
//!
//! Pub/sub (the event bus) needs a plain node connection: [`Backend::pubsub_clients`] lists
//! the nodes to try, in order, and names the one that hears a `PUBLISH` before it answers
//! (see [`PubSubNodes`]). On a cluster `PUBLISH` reaches every node, so any node will
//! do to hear it, but only the channel's primary hears it before the publisher's answer;
//! with Sentinel it is the current primary.
//!
//! At start ([`Backend::shared`]) a standalone `redis.url` that answers is asked what it is:
//! a Sentinel or a cluster node there is refused (every command would fail or be redirected,
//! behind a health probe that still sees an answering Redis). In every mode a server that
//! closes idle clients (`timeout` not 0) is warned about.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{Cmd, ConnectionInfo, FromRedisValue, Pipeline, RedisFuture, RedisResult, Value};

use tracing::warn;

use super::addr::{node_addr, node_info};
use super::sentinel::Sentinel;
use crate::config::{RedisConfig, RedisMode, redact_url};

/// The number of hash slots of a Redis Cluster.
pub(crate) const CLUSTER_SLOTS: u32 = 16_384;

/// One connection to the data (see the module docs). Cheap to clone: clones share the
/// underlying multiplexed socket(s).
#[derive(Clone)]
pub(crate) enum DataConn {
    Managed(ConnectionManager),
    Plain(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for DataConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            DataConn::Managed(conn) => conn.req_packed_command(cmd),
            DataConn::Plain(conn) => conn.req_packed_command(cmd),
            DataConn::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            DataConn::Managed(conn) => conn.req_packed_commands(pipeline, offset, count),
            DataConn::Plain(conn) => conn.req_packed_commands(pipeline, offset, count),
            DataConn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            DataConn::Managed(conn) => conn.get_db(),
            DataConn::Plain(conn) => conn.get_db(),
            DataConn::Cluster(conn) => conn.get_db(),
        }
    }
}

impl DataConn {
    /// Runs `cmd`, which names no key, on the node a command on `key` goes to: on a
    /// cluster the primary of `key`'s slot (redis-rs would send a keyless command to any
    /// node, and `WAIT` to every primary), elsewhere the one server.
    ///
    /// # Errors
    /// What the command or the connection answered.
    pub(crate) async fn query_beside<T: FromRedisValue>(
        &mut self,
        cmd: &Cmd,
        key: &str,
    ) -> RedisResult<T> {
        match self {
            DataConn::Cluster(conn) => {
                let node = Route::new(slot_of(key.as_bytes()), SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(node));
                let value = conn.route_command(cmd.clone(), routing).await?;
                Ok(redis::from_redis_value(value)?)
            }
            DataConn::Managed(_) | DataConn::Plain(_) => cmd.query_async(self).await,
        }
    }
}

impl DataConn {
    /// `PING` to every primary (a cluster's, all of them; elsewhere the one server): the
    /// breaker's heartbeat, which tells a Redis that answers from one that does not.
    ///
    /// # Errors
    /// What a node or the connection answered.
    pub(crate) async fn ping_primaries(&mut self) -> RedisResult<()> {
        let ping = redis::cmd("PING");
        match self {
            DataConn::Cluster(conn) => {
                let every = RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                ));
                conn.route_command(ping, every).await.map(drop)
            }
            DataConn::Managed(_) | DataConn::Plain(_) => ping.query_async::<()>(self).await,
        }
    }
}

/// How redis-rs retries a command a cluster node answers with a redirection or a "not
/// now": `MOVED` and `ASK` (followed at once, `ASK` with `ASKING` before the command on the
/// importing node), `TRYAGAIN` (a multi-key command, such as every Lua script of a fill,
/// whose slot is being migrated and whose keys are not all on one node yet),
/// `CLUSTERDOWN`, a dropped connection. Each retry takes one of `retries`, and the
/// "not now" ones wait `wait_ms` first.
///
/// Sized from `command_timeout`, which bounds every command from outside: the retries all
/// end within half of it, so a `TRYAGAIN` that lasts (a migration of many keys, or one left
/// half done) comes back as that answer, which [`super::redis`] tells from a failure,
/// rather than as a timeout, which it cannot. redis-rs counts retries, not time, so the
/// bound is the count times the wait; the wait is kept short (a slot's keys move in
/// batches of a few milliseconds each) and at least 1 ms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClusterRetry {
    pub(crate) retries: u32,
    pub(crate) wait_ms: u64,
}

impl ClusterRetry {
    /// The fewest retries, whatever the timeout: a `MOVED` after a resharding and the
    /// `ASK` of a key already migrated each take one.
    const MIN_RETRIES: u32 = 2;
    const MAX_RETRIES: u32 = 16;
    const MAX_WAIT_MS: u64 = 50;

    pub(crate) fn within(command_timeout: Duration) -> ClusterRetry {
        let budget_ms = u64::try_from(command_timeout.as_millis() / 2).unwrap_or(u64::MAX);
        let wait_ms = (budget_ms / 8).clamp(1, Self::MAX_WAIT_MS);
        let retries = u32::try_from(budget_ms / wait_ms)
            .unwrap_or(u32::MAX)
            .clamp(Self::MIN_RETRIES, Self::MAX_RETRIES);
        ClusterRetry { retries, wait_ms }
    }
}

/// The hash slot of `key`: CRC16 (XMODEM) of its hash tag (the part between the first `{`
/// and the next `}`, when not empty) or of the whole key, modulo 16384. redis-rs computes
/// this too but does not export it; the checksum itself comes from the `crc16` crate.
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    #[allow(clippy::cast_possible_truncation)] // modulo 16384 fits in u16
    let slot = (u32::from(crc16::State::<crc16::XMODEM>::calculate(tagged)) % CLUSTER_SLOTS) as u16;
    slot
}

/// How to reach the shared Redis. Cheap to clone: clones share the current clients, which
/// [`Backend::rotate`] replaces when the credentials change (a reload), so every
/// connection made afterwards — the shared one, the event bus's, the stream's, the bulk
/// and lock connections — logs in with the new ones. Connections already open stay as
/// they are: Redis keeps a logged-in connection when its password changes.
#[derive(Clone)]
pub(crate) struct Backend(Arc<ArcSwap<Nodes>>);

/// The clients of one set of credentials.
enum Nodes {
    Standalone(Box<redis::Client>),
    Sentinel(Arc<Sentinel>),
    Cluster {
        client: Arc<ClusterClient>,
        /// For [`Backend::dedicated`] connections.
        own: Arc<ClusterClient>,
        /// The seed nodes, for pub/sub when the topology cannot be asked.
        seeds: Arc<Vec<ConnectionInfo>>,
        /// ACL credentials, to reach the nodes the cluster names.
        template: Arc<ConnectionInfo>,
    },
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match &*self.nodes() {
            Nodes::Standalone(_) => "Backend::Standalone",
            Nodes::Sentinel(_) => "Backend::Sentinel",
            Nodes::Cluster { .. } => "Backend::Cluster",
        })
    }
}

impl Backend {
    /// # Errors
    /// A URL the client cannot use (validated at config load already).
    pub(crate) fn new(config: &RedisConfig) -> RedisResult<Backend> {
        Ok(Backend(Arc::new(ArcSwap::from_pointee(Nodes::new(
            config,
        )?))))
    }

    /// A standalone Redis reached through `client`.
    #[cfg(test)]
    pub(crate) fn standalone(client: redis::Client) -> Backend {
        Backend(Arc::new(ArcSwap::from_pointee(Nodes::Standalone(
            Box::new(client),
        ))))
    }

    fn nodes(&self) -> Arc<Nodes> {
        self.0.load_full()
    }

    /// Makes every later connection log in with `config`'s credentials (`username`,
    /// `password`); the addresses and the other settings are the ones already in use.
    /// With Sentinel the follower keeps the primary it knows and reconnects to it.
    ///
    /// # Errors
    /// A URL the client cannot use (validated at config load already); nothing changed.
    pub(crate) async fn rotate(&self, config: &RedisConfig) -> RedisResult<()> {
        match &*self.nodes() {
            Nodes::Sentinel(sentinel) => sentinel.set_credentials(config).await,
            Nodes::Standalone(_) | Nodes::Cluster { .. } => {
                self.0.store(Arc::new(Nodes::new(config)?));
                Ok(())
            }
        }
    }
}

impl Nodes {
    fn new(config: &RedisConfig) -> RedisResult<Nodes> {
        match config.mode {
            RedisMode::Standalone => Ok(Nodes::Standalone(Box::new(redis::Client::open(
                node_info(&config.url, config)?,
            )?))),
            RedisMode::Sentinel => Ok(Nodes::Sentinel(Arc::new(Sentinel::new(config)?))),
            RedisMode::Cluster => {
                let seeds = config
                    .urls
                    .iter()
                    .map(|url| node_info(url, config))
                    .collect::<RedisResult<Vec<_>>>()?;
                let retry = ClusterRetry::within(config.command_timeout);
                let builder = || {
                    let mut builder = ClusterClient::builder(seeds.clone())
                        .connection_timeout(config.connect_timeout)
                        .retries(retry.retries)
                        .min_retry_wait(retry.wait_ms)
                        .max_retry_wait(retry.wait_ms);
                    if let Some(username) = &config.username {
                        builder = builder.username(username);
                    }
                    if let Some(password) = &config.password {
                        builder = builder.password(password);
                    }
                    if let Some((_, pem)) = &config.tls_ca {
                        builder = builder.certs(redis::TlsCertificates {
                            client_tls: None,
                            root_cert: Some(pem.clone()),
                        });
                    }
                    builder
                };
                let shared = builder()
                    .response_timeout(config.connect_timeout.max(config.command_timeout))
                    .build()?;
                // Connections of their own carry blocking reads (`XREADGROUP BLOCK`) and
                // large transfers, bounded by their callers: no overall timeout here (the
                // per-connection config cannot lift the client's).
                let own = builder()
                    .response_timeout(Duration::from_secs(3600))
                    .overall_response_timeout(None)
                    .build()?;
                let template = seeds.first().cloned().ok_or_else(|| {
                    redis::RedisError::from((
                        redis::ErrorKind::InvalidClientConfig,
                        "a cluster needs at least one seed node",
                    ))
                })?;
                Ok(Nodes::Cluster {
                    client: Arc::new(shared),
                    own: Arc::new(own),
                    seeds: Arc::new(seeds),
                    template: Arc::new(template),
                })
            }
        }
    }
}

impl Backend {
    /// The connection every request shares. Standalone: made lazily (a Redis down at start
    /// is not an error), after asking a Redis that answers what it is (see the module
    /// docs). Sentinel: to the current primary, `None` while none is known. Cluster:
    /// connects now (bounded by `connect_timeout`); `None` when no seed answers.
    ///
    /// # Errors
    /// Standalone: `redis.url` answers as a Sentinel or a cluster node.
    pub(crate) async fn shared(&self, config: &RedisConfig) -> RedisResult<Option<DataConn>> {
        match &*self.nodes() {
            Nodes::Standalone(client) => {
                check_standalone(client, config).await?;
                Ok(Some(DataConn::Managed(managed(client, config)?)))
            }
            Nodes::Sentinel(sentinel) => match sentinel.primary_client() {
                Some(client) => {
                    if let Some(mut conn) = plain(&client, config).await {
                        warn_idle_timeout(&mut conn, config).await;
                    }
                    Ok(Some(DataConn::Managed(managed(&client, config)?)))
                }
                None => Ok(None),
            },
            Nodes::Cluster { client, .. } => {
                match tokio::time::timeout(
                    config.connect_timeout.max(Duration::from_millis(100)) * 2,
                    client.get_async_connection(),
                )
                .await
                {
                    Ok(Ok(conn)) => {
                        let mut conn = DataConn::Cluster(conn);
                        warn_idle_timeout(&mut conn, config).await;
                        Ok(Some(conn))
                    }
                    Ok(Err(_)) | Err(_) => Ok(None),
                }
            }
        }
    }

    /// A proxy worker's own connection for the request path (see [`super::worker_conn`]):
    /// made on the calling thread, so its driver runs there. Standalone, and Sentinel's
    /// current primary: a plain multiplexed connection (no response timeout: the caller
    /// bounds every command). Cluster: a cluster connection with the shared one's settings
    /// (slot routing, redirections and retries). TLS and credentials as every connection.
    ///
    /// # Errors
    /// When the node (or, with Sentinel, a known primary; on a cluster, any seed) does not
    /// answer.
    pub(crate) async fn per_worker(&self, connect_timeout: Duration) -> RedisResult<DataConn> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(None);
        let client = match &*self.nodes() {
            Nodes::Standalone(client) => client.as_ref().clone(),
            // No asking the sentinels from a worker: the follower does that.
            Nodes::Sentinel(sentinel) => sentinel.primary_client().ok_or_else(no_primary)?,
            Nodes::Cluster { client, .. } => {
                return Ok(DataConn::Cluster(client.get_async_connection().await?));
            }
        };
        Ok(DataConn::Plain(
            client
                .get_multiplexed_async_connection_with_config(&config)
                .await?,
        ))
    }

    /// A connection of its own (not shared with the request path): for blocking reads
    /// (`XREADGROUP BLOCK`) and large transfers. `response_timeout` `None` = only the
    /// caller's own bounds apply.
    ///
    /// # Errors
    /// When no node (or, with Sentinel, no primary) answers.
    pub(crate) async fn dedicated(
        &self,
        connect_timeout: Duration,
        response_timeout: Option<Duration>,
    ) -> RedisResult<DataConn> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(response_timeout);
        match &*self.nodes() {
            Nodes::Standalone(client) => Ok(DataConn::Plain(
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?,
            )),
            Nodes::Sentinel(sentinel) => {
                let client = match sentinel.primary_client() {
                    Some(client) => client,
                    None => sentinel.resolve_now().await.ok_or_else(no_primary)?,
                };
                Ok(DataConn::Plain(
                    client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?,
                ))
            }
            Nodes::Cluster { own, .. } => {
                let config = redis::cluster::ClusterConfig::new()
                    .set_connection_timeout(connect_timeout)
                    .set_response_timeout(response_timeout.unwrap_or(Duration::from_secs(3600)));
                Ok(DataConn::Cluster(
                    own.get_async_connection_with_config(config).await?,
                ))
            }
        }
    }

    /// Nodes to subscribe to `channel` on, best first. Cluster: the primary of the
    /// channel's slot first (a `PUBLISH` routed there reaches its subscribers before it
    /// answers, see `RedisStore::invalidate`), then the other nodes the cluster reports
    /// (asked through `shared`, when given and connected) in random order, then the seeds.
    pub(crate) async fn pubsub_clients(
        &self,
        shared: Option<DataConn>,
        timeout: Duration,
        channel: &str,
    ) -> PubSubNodes {
        let clients = self.pubsub_candidates(shared, timeout, channel).await;
        let prompt = match &*self.nodes() {
            // The one node there is, or the primary: every PUBLISH is run there.
            Nodes::Standalone(_) | Nodes::Sentinel(_) => {
                clients.first().map(|(client, _)| client_addr(client))
            }
            // The channel's primary, when the cluster named it (first in the list, from
            // `CLUSTER NODES`); a seed tried for want of an answer is not known to be it.
            Nodes::Cluster { .. } => clients
                .first()
                .filter(|(_, owner)| *owner)
                .map(|(client, _)| client_addr(client)),
        };
        PubSubNodes {
            clients: clients.into_iter().map(|(client, _)| client).collect(),
            prompt,
        }
    }

    /// [`Backend::pubsub_clients`]' list, each client with whether the cluster named it
    /// the primary of the channel's slot (always true outside a cluster).
    async fn pubsub_candidates(
        &self,
        shared: Option<DataConn>,
        timeout: Duration,
        channel: &str,
    ) -> Vec<(redis::Client, bool)> {
        match &*self.nodes() {
            Nodes::Standalone(client) => vec![(client.as_ref().clone(), true)],
            Nodes::Sentinel(sentinel) => sentinel
                .primary_client()
                .into_iter()
                .map(|client| (client, true))
                .collect(),
            Nodes::Cluster {
                seeds, template, ..
            } => {
                let mut first = Vec::new();
                let mut infos = Vec::new();
                let slot = u32::from(slot_of(channel.as_bytes()));
                if let Some(mut conn) = shared {
                    let mut cmd = redis::cmd("CLUSTER");
                    cmd.arg("NODES");
                    if let Ok(Ok(nodes)) =
                        tokio::time::timeout(timeout, cmd.query_async::<String>(&mut conn)).await
                    {
                        for node in parse_cluster_nodes(&nodes) {
                            if node.connected && !node.host.is_empty() && node.port != 0 {
                                let addr = node_addr(template.addr(), &node.host, node.port);
                                let info = template.as_ref().clone().set_addr(addr);
                                let owner = node.primary
                                    && node.ranges.iter().any(|(a, b)| (*a..=*b).contains(&slot));
                                if owner {
                                    first.push(info);
                                } else {
                                    infos.push(info);
                                }
                            }
                        }
                    }
                }
                // Any other node hears every message too (the cluster bus carries it):
                // spread the fallbacks with a random start.
                if !infos.is_empty() {
                    let start = rand::random_range(0..infos.len());
                    infos.rotate_left(start);
                }
                let owners = first.len();
                first.extend(infos);
                let mut infos = first;
                infos.extend(seeds.iter().cloned());
                infos
                    .into_iter()
                    .enumerate()
                    .filter_map(|(i, info)| {
                        redis::Client::open(info)
                            .ok()
                            .map(|client| (client, i < owners))
                    })
                    .collect()
            }
        }
    }

    /// Cluster: the hash slots a primary serves, as the first seed that answers
    /// `CLUSTER NODES` sees them (asked over a plain connection, so a cluster the cluster
    /// client refuses to use is still measured). `None` when no seed answers, or not a
    /// cluster.
    pub(crate) async fn seed_coverage(&self, timeout: Duration) -> Option<u32> {
        let Nodes::Cluster { seeds, .. } = &*self.nodes() else {
            return None;
        };
        for seed in seeds.iter() {
            let asked = tokio::time::timeout(timeout, async {
                let client = redis::Client::open(seed.clone())?;
                let mut conn = client.get_multiplexed_async_connection().await?;
                redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query_async::<String>(&mut conn)
                    .await
            })
            .await;
            if let Ok(Ok(text)) = asked {
                return Some(
                    parse_cluster_nodes(&text)
                        .iter()
                        .filter(|n| n.primary && n.connected)
                        .map(|n| n.slots)
                        .sum::<u32>()
                        .min(CLUSTER_SLOTS),
                );
            }
        }
        None
    }

    /// Standalone: `host:port` of the server.
    pub(crate) fn standalone_addr(&self) -> Option<String> {
        match &*self.nodes() {
            Nodes::Standalone(client) => Some(client.get_connection_info().addr().to_string()),
            _ => None,
        }
    }

    /// The Sentinel follower, in sentinel mode.
    pub(crate) fn sentinel(&self) -> Option<Arc<Sentinel>> {
        match &*self.nodes() {
            Nodes::Sentinel(sentinel) => Some(Arc::clone(sentinel)),
            _ => None,
        }
    }
}

/// How long one start-up question may take: as long as the health probe's.
fn ask_timeout(config: &RedisConfig) -> Duration {
    config.connect_timeout.max(config.command_timeout)
}

/// A one-off plain connection, or `None` when the server does not answer in time.
async fn plain(client: &redis::Client, config: &RedisConfig) -> Option<MultiplexedConnection> {
    let limit = ask_timeout(config);
    let settings = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(limit));
    match tokio::time::timeout(
        limit,
        client.get_multiplexed_async_connection_with_config(&settings),
    )
    .await
    {
        Ok(Ok(conn)) => Some(conn),
        Ok(Err(_)) | Err(_) => None,
    }
}

/// One `INFO section`, `None` when it is not answered in time.
async fn info(conn: &mut impl ConnectionLike, section: &str, limit: Duration) -> Option<String> {
    let mut cmd = redis::cmd("INFO");
    cmd.arg(section);
    match tokio::time::timeout(limit, cmd.query_async::<String>(conn)).await {
        Ok(Ok(text)) => Some(text),
        Ok(Err(_)) | Err(_) => None,
    }
}

/// The value of `field:value` in an `INFO` answer.
fn info_field<'a>(text: &'a str, field: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .map(str::trim)
}

/// What a standalone `redis.url` turns out to be when it is not a data server: the
/// refusal's detail, `None` for a data server. `server` and `cluster` are its `INFO server`
/// and `INFO cluster` answers.
fn not_standalone(url: &str, server: &str, cluster: &str) -> Option<String> {
    let url = redact_url(url);
    if info_field(server, "redis_mode") == Some("sentinel") {
        return Some(format!(
            "redis.url ({url}) points at a Redis Sentinel (INFO server: redis_mode:sentinel), \
             not at a Redis that holds data: every command would fail. Set mode = \"sentinel\" \
             with the sentinels in redis.urls and the primary's name in redis.master_name, or \
             point redis.url at the primary"
        ));
    }
    if info_field(cluster, "cluster_enabled") == Some("1")
        || info_field(server, "redis_mode") == Some("cluster")
    {
        return Some(format!(
            "redis.url ({url}) points at a Redis Cluster node (INFO cluster: \
             cluster_enabled:1): commands for the other nodes' hash slots would be refused \
             (MOVED). Set mode = \"cluster\" with the nodes in redis.urls"
        ));
    }
    None
}

/// Standalone: refuses a `redis.url` that answers as a Sentinel or a cluster node; one that
/// does not answer (yet) is not an error.
async fn check_standalone(client: &redis::Client, config: &RedisConfig) -> RedisResult<()> {
    let Some(mut conn) = plain(client, config).await else {
        return Ok(());
    };
    let limit = ask_timeout(config);
    let Some(server) = info(&mut conn, "server", limit).await else {
        return Ok(());
    };
    let cluster = info(&mut conn, "cluster", limit).await.unwrap_or_default();
    if let Some(detail) = not_standalone(&config.url, &server, &cluster) {
        return Err(redis::RedisError::from((
            redis::ErrorKind::InvalidClientConfig,
            "redis.url is not a standalone Redis",
            detail,
        )));
    }
    warn_idle_timeout(&mut conn, config).await;
    Ok(())
}

/// Warns when Redis closes idle clients (`timeout`, in seconds; 0 = never). The shared
/// connection is probed more often than every second, but the connections kept for
/// `lock.wait_replicas` can sit idle for as long as no key is missed: one Redis closed
/// fails its next lock, counted toward the breaker. `CONFIG` may be refused (managed Redis,
/// ACLs): then nothing is said.
async fn warn_idle_timeout(conn: &mut impl ConnectionLike, config: &RedisConfig) {
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET").arg("timeout");
    let answer = tokio::time::timeout(ask_timeout(config), cmd.query_async::<Vec<String>>(conn));
    if let Ok(Ok(pair)) = answer.await
        && let Some(seconds) = idle_timeout(&pair)
    {
        warn!(
            message = "Redis closes client connections idle for `timeout` seconds, and cacheguard keeps some idle for longer: with lock.wait_replicas, a lock taken on a connection Redis closed fails and counts toward the circuit breaker. Set `timeout 0` (Redis's default) in the Redis config.",
            redis_timeout_s = seconds,
        );
    }
}

/// The idle timeout of a `CONFIG GET timeout` answer, when Redis closes idle clients.
fn idle_timeout(pair: &[String]) -> Option<u64> {
    match pair {
        [name, value] if name == "timeout" => value.trim().parse().ok().filter(|&s| s > 0),
        _ => None,
    }
}

fn no_primary() -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Io,
        "no sentinel names a reachable primary",
    ))
}

/// A `ConnectionManager` with cacheguard's settings, connecting lazily.
pub(crate) fn managed(
    client: &redis::Client,
    config: &RedisConfig,
) -> RedisResult<ConnectionManager> {
    let manager_config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        // Commands are bounded from outside (`super::redis`): `command_timeout` while Redis
        // answers nothing, longer while it answers others; this is only the last resort.
        .set_response_timeout(Some(config.connect_timeout.max(config.command_timeout)))
        // Few, short retries: the breaker's probe retries for us every PROBE_INTERVAL, and
        // a long backoff would delay noticing that Redis is back.
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_millis(200));
    ConnectionManager::new_lazy_with_config(client.clone(), manager_config)
}

/// One line of `CLUSTER NODES`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClusterNode {
    pub(crate) id: String,
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) primary: bool,
    /// Not flagged `fail`/`fail?`/`noaddr`, and its link is `connected`.
    pub(crate) connected: bool,
    /// Slots it serves (primaries only).
    pub(crate) slots: u32,
    /// The slot ranges it serves, inclusive.
    pub(crate) ranges: Vec<(u32, u32)>,
}

/// Parses `CLUSTER NODES`: `<id> <ip:port@cport[,hostname]> <flags> <primary> <ping> <pong>
/// <epoch> <link> <slot> ...`. Lines that do not parse are skipped.
pub(crate) fn parse_cluster_nodes(text: &str) -> Vec<ClusterNode> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_ascii_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            let addr = fields[1].split(['@', ',']).next()?;
            let (host, port) = addr.rsplit_once(':')?;
            // The host is empty on a node that has not learnt its own address yet.
            let port: u16 = port.parse().ok()?;
            let flags: Vec<&str> = fields[2].split(',').collect();
            let failing = flags
                .iter()
                .any(|f| matches!(*f, "fail" | "fail?" | "noaddr" | "handshake"));
            let primary = flags.contains(&"master");
            // Slots and ranges; `[slot->-id]` / `[slot-<-id]` are migrations in progress.
            let ranges: Vec<(u32, u32)> = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|range| match range.split_once('-') {
                    Some((a, b)) => match (a.parse::<u32>(), b.parse::<u32>()) {
                        (Ok(a), Ok(b)) if b >= a => Some((a, b)),
                        _ => None,
                    },
                    None => range.parse::<u32>().ok().map(|s| (s, s)),
                })
                .collect();
            let slots = ranges.iter().map(|(a, b)| b - a + 1).sum();
            Some(ClusterNode {
                id: fields[0].to_owned(),
                host: host.trim_matches(['[', ']']).to_owned(),
                port,
                primary,
                connected: !failing && fields[7] == "connected",
                slots,
                ranges,
            })
        })
        .collect()
}

/// Where the event bus may subscribe ([`Backend::pubsub_clients`]).
#[derive(Debug, Default)]
pub(crate) struct PubSubNodes {
    /// The nodes to try, best first.
    pub(crate) clients: Vec<redis::Client>,
    /// `host:port` of the node where every `PUBLISH` of the channel is run: its
    /// subscribers have a message before its publisher has the answer. Any other cluster
    /// node has it later, over the cluster bus. `None` when no such node is known.
    pub(crate) prompt: Option<String>,
}

/// `host:port` of `client`'s server, as the event bus names the node it is on.
pub(crate) fn client_addr(client: &redis::Client) -> String {
    client.get_connection_info().addr().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_retries_end_within_half_the_command_timeout() {
        for ms in [1, 10, 20, 50, 100, 250, 1000, 5000, 60_000] {
            let timeout = Duration::from_millis(ms);
            let retry = ClusterRetry::within(timeout);
            assert!(retry.wait_ms >= 1, "{ms} ms: {retry:?}");
            assert!(
                retry.retries >= ClusterRetry::MIN_RETRIES,
                "{ms} ms: {retry:?}"
            );
            if ms >= 4 {
                let waited = Duration::from_millis(retry.wait_ms * u64::from(retry.retries));
                assert!(waited <= timeout / 2, "{ms} ms: {retry:?} waits {waited:?}");
            }
        }
        assert_eq!(
            ClusterRetry::within(Duration::from_millis(50)),
            ClusterRetry {
                retries: 8,
                wait_ms: 3
            }
        );
    }

    #[test]
    fn slots_follow_the_hash_tag_like_redis() {
        // Values from `CLUSTER KEYSLOT` on Redis 7.
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        assert_eq!(slot_of(b"foo{}{bar}"), slot_of(b"foo{}{bar}"));
        assert_eq!(slot_of(b"123456789"), 12739);
        assert_eq!(slot_of(b"cg:{abc}:v"), slot_of(b"cg:{abc}:lock"));
    }

    #[test]
    fn a_sentinel_or_a_cluster_node_is_not_a_standalone_redis() {
        let url = "redis://app:s3cret@10.0.0.5:26379";
        let sentinel = not_standalone(
            url,
            "# Server\r\nredis_version:7.0.15\r\nredis_mode:sentinel\r\n",
            "",
        )
        .unwrap();
        assert!(
            sentinel.starts_with(
                "redis.url (redis://app:***@10.0.0.5:26379) points at a Redis Sentinel"
            ),
            "{sentinel}"
        );
        let node = not_standalone(
            url,
            "redis_mode:cluster\r\n",
            "# Cluster\r\ncluster_enabled:1\r\n",
        )
        .unwrap();
        assert!(node.contains("points at a Redis Cluster node"), "{node}");
        assert_eq!(
            not_standalone(url, "redis_mode:standalone\r\n", "cluster_enabled:0\r\n"),
            None
        );
    }

    #[test]
    fn only_a_nonzero_idle_timeout_is_reported() {
        let pair = |v: &str| vec!["timeout".to_owned(), v.to_owned()];
        assert_eq!(idle_timeout(&pair("300")), Some(300));
        assert_eq!(idle_timeout(&pair("0")), None);
        assert_eq!(idle_timeout(&[]), None);
    }

    #[test]
    fn cluster_nodes_parse_with_flags_and_slots() {
        let text = "\
07c3 127.0.0.1:30004@40004 slave e7d1 0 1426238317239 4 connected
67ed 127.0.0.1:30002@40002 master - 0 1426238316232 2 connected 5461-10922
292f 127.0.0.1:30003@40003 master - 0 1426238318243 3 connected 10923-16383
6ec2 127.0.0.1:30005@40005 slave,fail 67ed 0 1426238316232 5 disconnected
e7d1 127.0.0.1:30001@40001,host-a myself,master - 0 0 1 connected 0-5460 [5461->-67ed]
";
        let nodes = parse_cluster_nodes(text);
        assert_eq!(nodes.len(), 5);
        let primaries: Vec<_> = nodes.iter().filter(|n| n.primary).collect();
        assert_eq!(primaries.len(), 3);
        assert_eq!(
            primaries.iter().map(|n| n.slots).sum::<u32>(),
            CLUSTER_SLOTS
        );
        assert!(!nodes[3].connected, "a failed node is not a candidate");
        assert_eq!(nodes[4].port, 30001);
        assert_eq!(nodes[4].host, "127.0.0.1");
    }
}
