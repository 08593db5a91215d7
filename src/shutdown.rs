//! Waiting for the process's stop signal (SIGTERM or SIGINT).

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
///
/// # Errors
/// When the signal handlers cannot be installed.
pub async fn signal() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}
