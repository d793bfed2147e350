//! `kvasir-controller`: see the crate docs and README "Deploy on
//! Kubernetes".
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Parser;
use kvasir_api::eep::WasmCode;
use kvasir_controller::http::{self, HttpState, WasmModule};
use kvasir_controller::leader::{self, LeaseConfig};
use kvasir_controller::metrics::Metrics;
use kvasir_controller::reconcile::{Context, Settings};
use kvasir_controller::run::{self, Timing};
use tokio::sync::watch;

/// Watches kvasir.dev resources, InferencePools and tenants' key Secrets,
/// compiles each Gateway/HTTPRoute they target (the same code as
/// `kvasirctl compile`) and server-side applies the EnvoyExtensionPolicy
/// that carries the Kvasir filter, with status conditions on every
/// kvasir.dev object.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Serves /healthz, /readyz and the filter module.
    #[arg(long, default_value = "0.0.0.0:8080", env = "KVASIR_HTTP_ADDR")]
    http_addr: SocketAddr,
    /// Serves /metrics.
    #[arg(long, default_value = "0.0.0.0:9090", env = "KVASIR_METRICS_ADDR")]
    metrics_addr: SocketAddr,
    /// The filter module to serve at /kvasir_filter-<sha256>.wasm (and
    /// /kvasir_filter.wasm); its SHA-256 goes into every
    /// EnvoyExtensionPolicy.
    #[arg(long, env = "KVASIR_WASM_FILE")]
    wasm_file: Option<PathBuf>,
    /// The module's URL as Envoy Gateway reaches it (this controller's
    /// Service, or any HTTP server holding the same file). `{sha256}` in it
    /// stands for the module's digest: with
    /// `http://<service>:8080/kvasir_filter-{sha256}.wasm` each module has
    /// its own URL.
    #[arg(long, env = "KVASIR_WASM_URL")]
    wasm_url: String,
    /// The module's hex SHA-256, when it is not served from --wasm-file.
    #[arg(long, env = "KVASIR_WASM_SHA256", conflicts_with = "wasm_file")]
    wasm_sha256: Option<String>,
    /// A namespace to watch (repeat for several); none: every namespace.
    #[arg(long = "namespace")]
    namespaces: Vec<String>,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "kvasir-system")]
    lease_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "kvasir-controller")]
    lease_name: String,
    /// This replica's identity in the Lease (the pod name).
    #[arg(long, env = "POD_NAME")]
    identity: String,
    /// The Envoy cluster of the cache-indexer's gRPC service.
    #[arg(long, default_value = "kvasir-indexer")]
    indexer_cluster: String,
    /// The ConfigMap (in each served namespace) the indexer reads its pools
    /// from; empty: do not write it.
    #[arg(long, default_value = kvasir_api::indexer::POOLS_CONFIG_MAP)]
    indexer_pools_configmap: String,
    /// The indexer Deployment to roll when its pools change; empty: none.
    #[arg(long, default_value = "kvasir-indexer")]
    indexer_deployment: String,
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        // Colours only on a terminal: `kubectl logs` would show the codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    match serve(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

fn wasm(args: &Args) -> Result<(WasmCode, Option<Arc<WasmModule>>), String> {
    let (sha256, module) = match (&args.wasm_file, &args.wasm_sha256) {
        (Some(path), _) => {
            let m = WasmModule::load(path)
                .map_err(|e| format!("--wasm-file {}: {e}", path.display()))?;
            (m.sha256.clone(), Some(Arc::new(m)))
        }
        (None, Some(hex)) => (hex.clone(), None),
        (None, None) => return Err("give --wasm-file (served here) or --wasm-sha256".into()),
    };
    let valid = sha256.len() == 64
        && sha256
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if !valid {
        return Err(format!(
            "the module's SHA-256 must be 64 lowercase hex digits, not `{sha256}`"
        ));
    }
    Ok((WasmCode::new(&args.wasm_url, &sha256), module))
}

async fn serve(args: Args) -> Result<(), String> {
    let (code, module) = wasm(&args)?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("no Kubernetes client configuration: {e}"))?;
    let metrics = Arc::new(Metrics::new());
    let (ready_tx, ready_rx) = watch::channel(false);
    let (leading_tx, leading_rx) = watch::channel(false);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };

    let http_listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|e| format!("--http-addr {}: {e}", args.http_addr))?;
    let metrics_listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .map_err(|e| format!("--metrics-addr {}: {e}", args.metrics_addr))?;
    let state = HttpState {
        metrics: metrics.clone(),
        ready: ready_rx,
        wasm: module,
    };
    let http_task = tokio::spawn(http::serve(http_listener, http::router(state), stopped()));
    let metrics_task = tokio::spawn(http::serve(
        metrics_listener,
        http::metrics_router(metrics.clone()),
        stopped(),
    ));

    let lease = LeaseConfig::new(
        args.lease_namespace.clone(),
        args.lease_name.clone(),
        args.identity.clone(),
    );
    let leader_task = tokio::spawn(leader::run(client.clone(), lease, leading_tx, stopped()));
    let leader_metrics = metrics.clone();
    let mut leading_seen = leading_rx.clone();
    tokio::spawn(async move {
        while leading_seen.changed().await.is_ok() {
            leader_metrics.set_leader(*leading_seen.borrow());
        }
    });

    let settings = Settings {
        wasm: code,
        options: kvasir_api::Options {
            indexer_cluster: args.indexer_cluster.clone(),
        },
        pools_configmap: non_empty(args.indexer_pools_configmap.clone()),
        indexer_deployment: non_empty(args.indexer_deployment.clone()),
    };
    let ctx = Arc::new(Context::new(client, settings, metrics));
    tracing::info!(identity = %args.identity, namespaces = ?args.namespaces, "starting");
    let work = run::run(
        ctx,
        args.namespaces.clone(),
        Timing::default(),
        leading_rx,
        ready_tx,
        stopped(),
    );
    tokio::select! {
        () = work => {}
        () = shutdown_signal() => tracing::info!("shutting down"),
    }
    let _ = stop_tx.send(true);
    // The leader hands the Lease back so the other replica takes over now,
    // not when the lease expires.
    let _ = leader_task.await;
    let _ = http_task.await;
    let _ = metrics_task.await;
    Ok(())
}
