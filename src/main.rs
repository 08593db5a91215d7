//! The `cacheguard` command: run the proxy, or check a config file.

use std::path::PathBuf;
use std::process::ExitCode;

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

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(path) = &args.check_config {
        return match Config::load(path, &ProcessEnv) {
            Ok(_) => {
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
        let running = match App::start(config).await {
            Ok(running) => running,
            Err(error) => {
                eprintln!("cacheguard: {error:#}");
                return ExitCode::from(1);
            }
        };
        if let Err(error) = shutdown::signal().await {
            eprintln!("cacheguard: cannot wait for signals: {error}");
        }
        tracing::info!(message = "Shutting down: draining in-flight requests.");
        running.shutdown().await;
        tracing::info!(message = "Stopped.");
        ExitCode::SUCCESS
    })
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
