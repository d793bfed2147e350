//! Wiring: config -> pools (index, tokenizer, load tracker), their
//! endpoint sets (static, or from an InferencePool through discovery), one
//! KV-event subscriber per endpoint (none for pools whose index is their
//! own picks), the metrics scraper, and the gRPC and HTTP servers; all
//! stopped by one cancellation token.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvasir_proto::v1::indexer_server::IndexerServer;
use kvasir_tokenizer::ChatTokenizer;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;

use crate::auth::{Authenticator, TokenAuth, TokenError};
use crate::config::{Config, ConfigError, PoolConfig, TokenizerSource};
use crate::events::{spawn_subscriber, SubscriberConfig, SubscriberHandle};
use crate::grpc_limit::Limited;
use crate::lifecycle::{GatedIndexer, Lifecycle, Warmup};
use crate::load::{scrape_all, LoadConfig, LoadTracker};
use crate::pool::Pool;
use crate::pools::Pools;
use crate::service::IndexerService;
use crate::tokenize::RequestTokenizer;
use crate::types::EndpointSpec;

/// Why the indexer could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A pool's tokenizer could not be loaded.
    #[error("pools[{pool}].tokenizer {dir}: {source}")]
    Tokenizer {
        /// Pool name.
        pool: String,
        /// Tokenizer directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: kvasir_tokenizer::TokenizerError,
    },
    /// A listener could not be bound.
    #[error("binding the {what} listener on {addr}: {source}")]
    Bind {
        /// `gRPC` or `HTTP`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No Kubernetes client for a discovered pool.
    #[error("pool {pool}: discovery needs a Kubernetes client: {source}")]
    Kube {
        /// Pool name.
        pool: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// The HTTP client could not be built.
    #[error("building the HTTP client: {0}")]
    HttpClient(#[source] reqwest::Error),
    /// The gRPC token file is unusable.
    #[error(transparent)]
    Token(#[from] TokenError),
    /// An endpoint picker could not start.
    #[error(transparent)]
    Picker(#[from] crate::picker::PickerError),
    /// An endpoint picker's message limit cannot hold its policy's body.
    #[error("{0}")]
    PickerLimit(String),
}

/// Builds the pools of a config (no tasks yet). Pools sharing a tokenizer
/// directory share one loaded tokenizer (and its segment cache).
pub fn build_pools(cfg: &Config, client: &reqwest::Client) -> Result<Vec<Arc<Pool>>, AppError> {
    let mut tokenizers: HashMap<PathBuf, Arc<ChatTokenizer>> = HashMap::new();
    let mut pools = Vec::new();
    // One store (one Redis connection) for every pool; keys name the pool.
    let shared = cfg.responses.shared_store()?;
    let budgets = Arc::new(cfg.budgets.build()?);
    for pc in &cfg.pools {
        let tokenizer = match &pc.tokenizer {
            TokenizerSource::Dir(dir) => {
                let tok = match tokenizers.get(dir) {
                    Some(t) => Arc::clone(t),
                    None => {
                        let t = Arc::new(ChatTokenizer::from_dir(dir).map_err(|source| {
                            AppError::Tokenizer {
                                pool: pc.name.clone(),
                                dir: dir.clone(),
                                source,
                            }
                        })?);
                        tokenizers.insert(dir.clone(), Arc::clone(&t));
                        t
                    }
                };
                RequestTokenizer::Local(tok)
            }
            TokenizerSource::Render => RequestTokenizer::Render {
                client: client.clone(),
                model: pc.model.clone(),
                timeout: Duration::from_millis(pc.render_timeout_ms),
            },
            TokenizerSource::Approx => RequestTokenizer::Approx,
        };
        let load = LoadTracker::new(load_config(pc));
        pools.push(Arc::new(
            Pool::new(
                pc.name.clone(),
                pc.model.clone(),
                pc.block_size,
                tokenizer,
                load,
                pc.scoring.clone(),
            )
            .with_index(pc.index, pc.pick_history_blocks)
            .with_tokenize_budget(pc.tokenize_budget.clone())
            .with_failures(pc.failures.clone())
            .with_responses(cfg.responses.affinity(), shared.clone())
            .with_budgets(Arc::clone(&budgets))
            .with_flow_control(pc.flow_control.clone()),
        ));
    }
    Ok(pools)
}

fn load_config(pc: &PoolConfig) -> LoadConfig {
    LoadConfig {
        unhealthy_after: pc.scrape.unhealthy_after,
        in_flight_timeout: Duration::from_secs(pc.in_flight.timeout_s),
        prefill_horizon: Duration::from_millis(pc.in_flight.prefill_horizon_ms),
        saturation: pc.saturation.clone(),
        unconfirmed_timeout: Duration::from_millis(pc.in_flight.unconfirmed_timeout_ms),
        max_unconfirmed_per_endpoint: pc.in_flight.max_unconfirmed_per_endpoint,
        max_tracked: pc.in_flight.max_tracked,
    }
}

/// The shared HTTP client for scrapes and render calls: keep-alive, no
/// proxies (engines are always reached directly).
pub fn http_client() -> Result<reqwest::Client, AppError> {
    reqwest::Client::builder()
        .no_proxy()
        .pool_idle_timeout(Duration::from_secs(30))
        .tcp_nodelay(true)
        .build()
        .map_err(AppError::HttpClient)
}

/// A running indexer.
#[derive(Debug)]
pub struct Indexer {
    /// The pools.
    pub pools: Arc<Pools>,
    /// Where gRPC listens (the bound address: port 0 in the config gives a
    /// free port).
    pub grpc_addr: SocketAddr,
    /// Where HTTP listens.
    pub http_addr: SocketAddr,
    /// Warm-up and shutdown state of the gRPC side.
    pub lifecycle: Arc<Lifecycle>,
    /// Where each endpoint picker listens: (pool, bound address).
    pub picker_addrs: Vec<(String, SocketAddr)>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Indexer {
    /// The token that stops everything when cancelled.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Stops every task and waits for the servers to finish their
    /// in-flight calls (at most the shutdown grace).
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.join().await;
    }

    /// Waits until the indexer stops (after the token is cancelled).
    pub async fn join(mut self) {
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        // Stop subscribers now rather than when the last Arc goes.
        for p in self.pools.iter() {
            p.set_endpoints(Vec::new(), |_| None);
        }
    }
}

/// Starts the indexer for a validated config: binds both listeners, then
/// spawns subscribers, discovery, scrapers and servers. Must run inside a
/// tokio runtime.
pub async fn start(cfg: &Config) -> Result<Indexer, AppError> {
    let client = http_client()?;
    let pool_list = build_pools(cfg, &client)?;
    let pools = Arc::new(Pools::new(pool_list));
    let cancel = CancellationToken::new();
    let mut tasks = Vec::new();
    let shared_load = cfg.shared_load.settings()?;
    let auth = match &cfg.grpc_token_file {
        Some(path) => Some(Arc::new(TokenAuth::load(path)?)),
        None => {
            tracing::warn!("no --grpc-token-file: the gRPC port is unauthenticated; anyone who reaches it can pick and report");
            None
        }
    };
    let life = Arc::new(Lifecycle::new(&pools, cancel.clone()));

    let grpc_listener = tokio::net::TcpListener::bind(cfg.grpc_addr)
        .await
        .map_err(|source| AppError::Bind {
            what: "gRPC",
            addr: cfg.grpc_addr,
            source,
        })?;
    let http_listener = tokio::net::TcpListener::bind(cfg.http_addr)
        .await
        .map_err(|source| AppError::Bind {
            what: "HTTP",
            addr: cfg.http_addr,
            source,
        })?;
    let bound = |l: &tokio::net::TcpListener, what, addr| {
        l.local_addr()
            .map_err(|source| AppError::Bind { what, addr, source })
    };
    let grpc_addr = bound(&grpc_listener, "gRPC", cfg.grpc_addr)?;
    let http_addr = bound(&http_listener, "HTTP", cfg.http_addr)?;

    for (pc, pool) in cfg.pools.iter().zip(pools.iter()) {
        let warmup = life.warmup(&pool.name);
        match &pc.discovery {
            None => {
                let specs: Vec<EndpointSpec> = pc.endpoints.iter().map(|e| e.to_spec()).collect();
                let changes = pool.set_endpoints(specs, |spec| subscribe(pool, spec, &client));
                warmup.mark_known();
                tracing::info!(pool = %pool.name, endpoints = ?changes.added, tokenizer = %pc.tokenizer, index = %pc.index, "pool configured");
            }
            Some(d) => {
                let kube = kube::Client::try_default()
                    .await
                    .map_err(|source| AppError::Kube {
                        pool: pc.name.clone(),
                        source,
                    })?;
                tasks.extend(spawn_discovery(
                    Arc::clone(pool),
                    kube,
                    client.clone(),
                    d.clone(),
                    Arc::clone(&warmup),
                    cancel.clone(),
                ));
                tracing::info!(pool = %pool.name, namespace = %d.namespace, inference_pool = %d.inference_pool, index = %pc.index, "pool discovered from InferencePool");
            }
        }
        tasks.push(tokio::spawn(scrape_loop(
            Arc::clone(pool),
            client.clone(),
            pc.scrape.interval(),
            pc.scrape.timeout(),
            warmup,
            cancel.clone(),
        )));
        // Engines whose event socket disconnects are probed at once.
        tasks.push(tokio::spawn(
            Arc::clone(pool).probe_loop(pc.scrape.timeout(), cancel.clone()),
        ));
    }
    if let Some(a) = &auth {
        tasks.push(tokio::spawn(Arc::clone(a).reload_loop(cancel.clone())));
    }
    if let Some(s) = shared_load {
        let sync = crate::shared_load::run(Arc::clone(&pools), s, cancel.clone());
        tasks.push(tokio::spawn(sync));
    }

    // gRPC: the Indexer service (behind the token check and the lifecycle
    // gate) and grpc.health.v1 (open to probes). The overall status ("") is
    // SERVING once every pool is warm (picks are served) until shutdown;
    // `kvasir.v1.Indexer` only while /readyz would answer 200, so an Envoy
    // health check on that service name routes to replicas whose index is
    // in sync.
    let (reporter, health) = tonic_health::server::health_reporter();
    set_health(&reporter, false, false).await;
    let svc = GatedIndexer::new(IndexerService::new(Arc::clone(&pools)), Arc::clone(&life));
    let authn = Authenticator::new(auth, Arc::clone(&life.metrics.auth));
    let incoming =
        tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true));
    // Every message over the limit is refused (RESOURCE_EXHAUSTED) before
    // it is buffered, health's included.
    let limit = cfg.grpc_max_message_bytes;
    const SETTING: &str = "grpcMaxMessageBytes";
    let indexer = IndexerServer::new(svc).max_decoding_message_size(limit);
    let router = tonic::transport::Server::builder()
        .add_service(Limited::new(health, limit, SETTING))
        .add_service(Limited::new(
            InterceptedService::new(indexer, authn),
            limit,
            SETTING,
        ));
    // The listener closes only once health says NOT_SERVING.
    let unhealthy = CancellationToken::new();
    tasks.push(tokio::spawn(crate::lifecycle::serve_bounded(
        router,
        incoming,
        unhealthy.clone().cancelled_owned(),
        cancel.clone(),
        Duration::from_millis(cfg.shutdown_grace_ms),
    )));
    tasks.push(tokio::spawn(readiness_loop(
        Arc::clone(&pools),
        Arc::clone(&life),
        reporter,
        cancel.clone(),
        unhealthy,
    )));

    let picker_addrs = start_pickers(cfg, &pools, &cancel, &mut tasks).await?;

    let router = crate::http::router(Arc::clone(&pools), Arc::clone(&life));
    let http_cancel = cancel.clone();
    let grace = Duration::from_millis(cfg.shutdown_grace_ms);
    tasks.push(tokio::spawn(async move {
        let serve = axum::serve(http_listener, router)
            .with_graceful_shutdown(http_cancel.clone().cancelled_owned());
        let deadline = async {
            http_cancel.cancelled().await;
            tokio::time::sleep(grace).await;
        };
        tokio::select! {
            r = serve => if let Err(e) = r {
                tracing::error!(error = %e, "HTTP server failed");
            },
            () = deadline => tracing::warn!("HTTP requests still open after the shutdown grace; closing them"),
        }
    }));

    tracing::info!(%grpc_addr, %http_addr, pools = cfg.pools.len(), responses_store = ?cfg.responses.store, "cache-indexer started");
    Ok(Indexer {
        pools,
        grpc_addr,
        http_addr,
        lifecycle: life,
        picker_addrs,
        cancel,
        tasks,
    })
}

/// Starts each configured endpoint picker on its own port (the
/// Inference Extension's ext_proc service and grpc.health.v1, its
/// `envoy.service.ext_proc.v3.ExternalProcessor` service SERVING).
async fn start_pickers(
    cfg: &Config,
    pools: &Arc<Pools>,
    cancel: &CancellationToken,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<Vec<(String, SocketAddr)>, AppError> {
    use kvasir_proto::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
    let mut addrs = Vec::new();
    for pc in &cfg.pickers {
        // Envoy sends a buffered body in one message: the limit holds the
        // policy's bodyLimitBytes.
        let (plugin, _) = crate::picker::load(pc)?;
        let limit = crate::grpc_limit::picker_limit(pc, plugin.settings.body_limit_bytes)
            .map_err(AppError::PickerLimit)?;
        let svc = crate::picker::PickerService::start(pc, Arc::clone(pools))?;
        let listener = tokio::net::TcpListener::bind(pc.addr)
            .await
            .map_err(|source| AppError::Bind {
                what: "picker",
                addr: pc.addr,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| AppError::Bind {
            what: "picker",
            addr: pc.addr,
            source,
        })?;
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter
            .set_service_status(
                "envoy.service.ext_proc.v3.ExternalProcessor",
                tonic_health::ServingStatus::Serving,
            )
            .await;
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let processor = ExternalProcessorServer::new(svc).max_decoding_message_size(limit);
        let router = tonic::transport::Server::builder()
            .add_service(Limited::new(health, limit, "pickers[].maxMessageBytes"))
            .add_service(Limited::new(processor, limit, "pickers[].maxMessageBytes"));
        tasks.push(tokio::spawn(crate::lifecycle::serve_bounded(
            router,
            incoming,
            cancel.clone().cancelled_owned(),
            cancel.clone(),
            Duration::from_millis(cfg.shutdown_grace_ms),
        )));
        tracing::info!(pool = %pc.pool, %addr, "endpoint picker started");
        addrs.push((pc.pool.clone(), addr));
    }
    Ok(addrs)
}

/// The endpoint's KV-event subscriber; none when the pool's index is its
/// own picks. An endpoint without an events address has its sockets read
/// from the engine's `/kv_event_sources` through `http`.
fn subscribe(pool: &Pool, spec: &EndpointSpec, http: &reqwest::Client) -> Option<SubscriberHandle> {
    pool.wants_events().then(|| {
        spawn_subscriber(
            SubscriberConfig::new(spec.clone(), pool.block_size).with_source(http),
            Arc::clone(&pool.index),
        )
    })
}

/// Discovery: one task keeps a watch channel holding the pool's endpoint
/// set (restarting the watch after errors), another applies each new set
/// to the pool (subscribers start and stop with it).
fn spawn_discovery(
    pool: Arc<Pool>,
    client: kube::Client,
    http: reqwest::Client,
    d: crate::config::DiscoveryConfig,
    warmup: Arc<Warmup>,
    cancel: CancellationToken,
) -> Vec<JoinHandle<()>> {
    let (tx, mut rx) = tokio::sync::watch::channel(Vec::<EndpointSpec>::new());
    let watcher_cancel = cancel.clone();
    let name = pool.name.clone();
    let watcher = tokio::spawn(async move {
        let mut backoff = Duration::from_secs(1);
        loop {
            let run = crate::discovery::watch_pool(
                client.clone(),
                &d.namespace,
                &d.inference_pool,
                d.defaults(),
                tx.clone(),
            );
            tokio::select! {
                () = watcher_cancel.cancelled() => return,
                r = run => match r {
                    Ok(()) => return,
                    Err(e) => tracing::error!(pool = %name, error = %e, retry_in = ?backoff, "discovery failed"),
                },
            }
            tokio::select! {
                () = watcher_cancel.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(30));
        }
    });
    let applier = tokio::spawn(async move {
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                r = rx.changed() => if r.is_err() { return },
            }
            let specs = rx.borrow_and_update().clone();
            let changes = pool.set_endpoints(specs, |spec| subscribe(&pool, spec, &http));
            warmup.mark_known();
            if !changes.added.is_empty() || !changes.removed.is_empty() {
                tracing::info!(pool = %pool.name, added = ?changes.added, removed = ?changes.removed, "endpoint set changed");
            }
        }
    });
    vec![watcher, applier]
}

/// Scrapes every endpoint of `pool` each interval, logs health changes and
/// expires lost in-flight picks. The first round over a known endpoint set
/// warms the pool up.
async fn scrape_loop(
    pool: Arc<Pool>,
    client: reqwest::Client,
    interval: Duration,
    timeout: Duration,
    warmup: Arc<Warmup>,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let known = warmup.known();
        let eps = pool.endpoints();
        let targets: Vec<_> = eps.iter().map(|e| (e.id, e.spec.metrics_url())).collect();
        let before = pool.load.views(eps.iter().map(|e| e.id), Instant::now());
        let failures = scrape_all(&pool.load, &client, &targets, timeout).await;
        if known && !warmup.warm() {
            warmup.mark_scraped();
            tracing::info!(pool = %pool.name, endpoints = eps.len(), healthy = failures.len() < eps.len(), "first scrape done: serving picks");
        }
        let after = pool.load.views(eps.iter().map(|e| e.id), Instant::now());
        for ((e, b), a) in eps.iter().zip(&before).zip(&after) {
            match (b.healthy, a.healthy) {
                (false, true) => {
                    tracing::info!(pool = %pool.name, endpoint = %e.spec.address, "endpoint healthy")
                }
                (true, false) => {
                    let why = failures
                        .iter()
                        .find(|(id, _)| *id == e.id)
                        .map_or_else(|| "scrapes failed".to_string(), |(_, err)| err.to_string());
                    pool.went_down(e, &why);
                }
                _ => {}
            }
        }
        for (id, err) in &failures {
            tracing::debug!(pool = %pool.name, endpoint = %id, error = %err, "scrape failed");
        }
        let expired = pool.load.sweep(Instant::now());
        if expired > 0 {
            pool.metrics.in_flight_expired.add(expired as u64);
            tracing::debug!(pool = %pool.name, expired, "in-flight picks expired without a report");
        }
        pool.budgets
            .note_peers(&pool.load.peer_stats(Instant::now()));
        // A scrape may show room the reports did not (other replicas' and
        // direct traffic ending, an endpoint turned healthy).
        pool.capacity_freed();
    }
}

/// Keeps gRPC health in step with warm-up and readiness; at shutdown sets
/// both statuses NOT_SERVING, then cancels `unhealthy` (the listener closes
/// after that).
async fn readiness_loop(
    pools: Arc<Pools>,
    life: Arc<Lifecycle>,
    reporter: tonic_health::server::HealthReporter,
    cancel: CancellationToken,
    unhealthy: CancellationToken,
) {
    let mut last = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            _ = tick.tick() => {}
        }
        let warm = life.all_warm();
        let (in_sync, not) = pools.readiness();
        let state = (warm, warm && in_sync);
        if last != Some(state) {
            set_health(&reporter, state.0, state.1).await;
            match state {
                (_, true) => tracing::info!("index in sync with every endpoint: ready"),
                (true, false) => tracing::info!(not_in_sync = ?not, "not ready"),
                (false, _) => tracing::info!(cold = ?life.cold_pools(), "warming up: not serving"),
            }
            last = Some(state);
        }
    }
    set_health(&reporter, false, false).await;
    tracing::info!("shutting down: gRPC health NOT_SERVING, sessions ending, listener closing");
    unhealthy.cancel();
}

/// Sets the overall ("") and `kvasir.v1.Indexer` health statuses.
async fn set_health(reporter: &tonic_health::server::HealthReporter, serving: bool, ready: bool) {
    use tonic_health::ServingStatus::{NotServing, Serving};
    let st = |b: bool| if b { Serving } else { NotServing };
    reporter.set_service_status("", st(serving)).await;
    reporter
        .set_service_status(kvasir_proto::INDEXER_SERVICE, st(ready))
        .await;
}
