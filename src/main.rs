//! The `cacheguard` command: run the proxy, or check a config file.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use cacheguard::config::{Config, ProcessEnv};
use cacheguard::{App, shutdown};
use clap::{Parser, ValueEnum};

/// A cache-protection sidecar: an HTTP reverse proxy that keeps a database-backed API alive
/// and correct under cache penetration, stampedes, avalanches, hot keys and inconsistency.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Config file to run with.
    #[arg(
        long,
        short,
        value_name = "FILE",
        default_value = "config/cacheguard.toml"
    )]
    config: PathBuf,
    /// Validate FILE and exit: 0 when valid, 1 with one line per problem otherwise.
    #[arg(long, value_name = "FILE", conflicts_with = "config")]
    check_config: Option<PathBuf>,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Human)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

pub(crate) fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(path) = &args.check_config {
        return match Config::load(path, &ProcessEnv) {
            Ok(config) => {
                // Risky but workable settings: named, and not a failure.
                for warning in config.warnings() {
                    eprintln!("warning: {warning}");
                }
                println!("config OK: {}", path.display());
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("{error}");
                ExitCode::from(1)
            }
        };
    }
    init_logging(args.log_format);
    let config = match Config::load(&args.config, &ProcessEnv) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::from(1);
        }
    };
    // The main runtime runs the accept loop, the admin listener and the background tasks
    // (Redis health, event bus); requests are served by the proxy's own worker threads
    // (`server.worker_threads`).
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("cacheguard: cannot start the runtime: {error}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async {
        let mut running = match App::start(config).await {
            Ok(running) => running,
            Err(error) => {
                eprintln!("cacheguard: {error:#}");
                return ExitCode::from(1);
            }
        };
        // A change to the file reloads it; so does SIGHUP.
        running.watch_config(args.config.clone(), Arc::new(ProcessEnv));
        let stop = shutdown::signal();
        tokio::pin!(stop);
        let mut hangup = reload_signal();
        loop {
            tokio::select! {
                result = &mut stop => {
                    if let Err(error) = result {
                        eprintln!("cacheguard: cannot wait for signals: {error}");
                    }
                    break;
                }
                () = next_hangup(&mut hangup) => {
                    tracing::info!(message = "SIGHUP: reloading the config.");
                    // The outcome is logged by the reload itself.
                    let _ = running.reload().await;
                }
            }
        }
        tracing::info!(message = "Shutting down: draining in-flight requests.");
        running.shutdown().await;
        tracing::info!(message = "Stopped.");
        ExitCode::SUCCESS
    })
}

/// The SIGHUP stream, when it can be installed (Unix).
#[cfg(unix)]
fn reload_signal() -> Option<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok()
}

#[cfg(not(unix))]
fn reload_signal() -> Option<()> {
    None
}

/// The next SIGHUP; never, without a SIGHUP stream.
#[cfg(unix)]
async fn next_hangup(hangup: &mut Option<tokio::signal::unix::Signal>) {
    if let Some(signal) = hangup
        && signal.recv().await.is_some()
    {
        return;
    }
    std::future::pending().await
}

#[cfg(not(unix))]
async fn next_hangup(_: &mut Option<()>) {
    std::future::pending().await
}

/// The default log filter: cacheguard's own lines from INFO up. The Redis client's own
/// lines only from ERROR: it logs every failed reconnect and slot refresh (dozens a
/// second while a cluster node is down), and cacheguard already says what happens to
/// Redis, once per change (the breaker, the topology, the event bus). `RUST_LOG`
/// replaces this, e.g. `RUST_LOG=info,redis=debug` to see the client's side too.
const DEFAULT_LOG_FILTER: &str = "info,redis=error";

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
