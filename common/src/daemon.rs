//! What the node daemons' binaries share: logging to stderr filtered by `GPUFRAC_LOG`,
//! and waiting for SIGTERM or SIGINT.

/// Logs to stderr with the `GPUFRAC_LOG` filter (`RUST_LOG` syntax, default `info`);
/// a bad filter is an error naming the variable.
pub fn init_logging() -> Result<(), String> {
    let text = std::env::var("GPUFRAC_LOG").unwrap_or_else(|_| "info".to_owned());
    let filter = tracing_subscriber::EnvFilter::try_new(&text)
        .map_err(|e| format!("invalid GPUFRAC_LOG={text:?}: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    Ok(())
}

/// Completes on SIGTERM or SIGINT.
pub async fn terminated() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async {
            match term.as_mut() {
                Some(t) => {
                    t.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        } => {}
    }
}
