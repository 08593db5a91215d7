//! One shared Redis of any topology, so a test written once runs on a standalone server
//! and on a Redis Cluster (and on Sentinel): [`SharedRedis::configure`] points a config at
//! it, and [`SharedRedis::conn`] gives the test its own connection for checks, routed by
//! key on a cluster.

use std::future::Future;
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use super::redis_server::{connect, scan_keys};
use super::{CgConfig, RedisCluster, RedisSentinel, RedisServer};

/// A test's own connection to the data.
#[derive(Clone)]
pub enum TestConn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for TestConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            TestConn::Single(c) => c.req_packed_command(cmd),
            TestConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            TestConn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            TestConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            TestConn::Single(c) => c.get_db(),
            TestConn::Cluster(c) => c.get_db(),
        }
    }
}

pub trait SharedRedis: Send + Sync {
    /// `cfg` in shared mode on this Redis.
    fn configure(&self, cfg: CgConfig) -> CgConfig;
    /// A connection of the test's own.
    fn conn(&self) -> impl Future<Output = TestConn> + Send;
    /// Every entry key (`cg:{<base>}:v`, a variant's `cg:{<base>}:v:<hash>`), on every
    /// primary, found with `SCAN`.
    fn entry_keys(&self) -> impl Future<Output = Vec<Vec<u8>>> + Send;
}

/// The entry keys on the server at `port`.
pub async fn entry_keys_on(port: u16) -> Vec<Vec<u8>> {
    let mut con = connect(port).await.expect("connect to a primary");
    let mut keys = scan_keys(&mut con, "cg:*:v").await;
    keys.extend(scan_keys(&mut con, "cg:*:v:*").await);
    keys
}

impl SharedRedis for RedisServer {
    fn configure(&self, cfg: CgConfig) -> CgConfig {
        cfg.redis(self)
    }

    async fn conn(&self) -> TestConn {
        TestConn::Single(self.client().await)
    }

    async fn entry_keys(&self) -> Vec<Vec<u8>> {
        RedisServer::entry_keys(self).await
    }
}

impl SharedRedis for RedisCluster {
    fn configure(&self, cfg: CgConfig) -> CgConfig {
        cfg.redis_cluster(self)
    }

    async fn conn(&self) -> TestConn {
        let client = redis::cluster::ClusterClient::new(self.urls()).expect("cluster urls");
        let conn = tokio::time::timeout(Duration::from_secs(5), client.get_async_connection())
            .await
            .expect("cluster connect timed out")
            .expect("cluster connect");
        TestConn::Cluster(conn)
    }

    async fn entry_keys(&self) -> Vec<Vec<u8>> {
        let mut keys = Vec::new();
        for port in self.primaries().await {
            keys.extend(entry_keys_on(port).await);
        }
        keys
    }
}

impl SharedRedis for RedisSentinel {
    fn configure(&self, cfg: CgConfig) -> CgConfig {
        cfg.redis_sentinel(self)
    }

    async fn conn(&self) -> TestConn {
        let port = self.primary_port().await.expect("a primary");
        TestConn::Single(connect(port).await.expect("connect to the primary"))
    }

    async fn entry_keys(&self) -> Vec<Vec<u8>> {
        entry_keys_on(self.primary_port().await.expect("a primary")).await
    }
}
