//! How a Redis node is addressed: its URL with the configured credentials and TLS
//! settings, and the address of another node (found through Sentinel or `CLUSTER NODES`)
//! with the same settings.

use redis::{ConnectionInfo, IntoConnectionInfo, RedisResult};

use crate::config::RedisConfig;

/// `url` with the configured ACL user and password (which win over any in the URL) and
/// TLS settings.
pub(crate) fn node_info(url: &str, config: &RedisConfig) -> RedisResult<ConnectionInfo> {
    let info = url.into_connection_info()?;
    with_tls(with_credentials(info, config), config)
}

/// `info` verifying its server with the configured CA (`redis.tls_ca_file`), when it is a
/// `rediss://` address; addresses made from it later (`node_addr`) keep that setting.
pub(crate) fn with_tls(info: ConnectionInfo, config: &RedisConfig) -> RedisResult<ConnectionInfo> {
    match (&config.tls_ca, info.addr()) {
        (Some((_, pem)), redis::ConnectionAddr::TcpTls { .. }) => {
            let certs = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            };
            Ok(redis::Client::build_with_tls(info, certs)?
                .get_connection_info()
                .clone())
        }
        _ => Ok(info),
    }
}

fn with_credentials(info: ConnectionInfo, config: &RedisConfig) -> ConnectionInfo {
    let mut settings = info.redis_settings().clone();
    if let Some(username) = &config.username {
        settings = settings.set_username(username);
    }
    if let Some(password) = &config.password {
        settings = settings.set_password(password);
    }
    info.set_redis_settings(settings)
}

/// `host:port` with the TLS settings of `like`.
pub(crate) fn node_addr(
    like: &redis::ConnectionAddr,
    host: &str,
    port: u16,
) -> redis::ConnectionAddr {
    match like {
        redis::ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => redis::ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(host.to_owned(), port),
    }
}
