//! `cache-indexer`: Kvasir's KV-prefix index and endpoint picker.
//!
//! ```text
//! cache-indexer --config indexer.yaml
//! cache-indexer --tokenizer .tools/tokenizers/qwen3 \
//!   --endpoint pool=demo,address=127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558
//! ```
//!
//! Logs go to stderr (`RUST_LOG`, default `info`). SIGINT / SIGTERM stop it
//! gracefully: gRPC health goes NOT_SERVING, `Session` streams end with
//! UNAVAILABLE, in-flight calls get `--shutdown-grace-ms`, subscribers stop;
//! it exits 0 within the grace plus about a second whatever callers do.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kvasir_cache_indexer::config::{Args, Config};
use kvasir_cache_indexer::start;
use tracing_subscriber::EnvFilter;

/// Longest the runtime waits, after the indexer stopped, for tasks that
/// still run (connections a caller holds open, blocking work).
const RUNTIME_SHUTDOWN: Duration = Duration::from_secs(1);

fn main() -> ExitCode {
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cache-indexer: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = rt.block_on(run());
    rt.shutdown_timeout(RUNTIME_SHUTDOWN);
    code
}

async fn run() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: log files and collectors want plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let cfg = match Config::from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cache-indexer: {e}");
            return ExitCode::from(2);
        }
    };
    let indexer = match start(&cfg).await {
        Ok(i) => i,
        Err(e) => {
            eprintln!("cache-indexer: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cancel = indexer.cancel_token();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        cancel.cancel();
    });
    indexer.join().await;
    ExitCode::SUCCESS
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
