//! The endpoint picker of the Gateway API Inference Extension: an Envoy
//! `ext_proc` server on its own port, one per pool, so that a gateway that
//! handles InferencePool itself (Envoy AI Gateway, kgateway, Istio, GKE,
//! ...) gets Kvasir's picks, budgets and fair queueing without the wasm
//! filter.
//!
//! Each exchange runs the filter's own request flow ([`exchange`], over
//! [`host`]): the tenant from the same sources with the same spoofing
//! rules, the policy document's budgets and weights, every API the filter
//! parses, the stored-response affinity, the reports. The flow is a
//! single-threaded state machine (as in an Envoy worker), so exchanges run
//! on [`WORKERS`] threads of their own, each with a current-thread runtime;
//! the picks and reports go to the pools in process.
//!
//! What a picker-only deployment gives up against the filter: policies that
//! send a request to another pool or to a provider (answered 503, naming
//! where, since the gateway's backend for this pool cannot reach it),
//! Envoy's per-tenant stats (the indexer's per-tenant budget and queue
//! metrics remain), and the filter's local budget share when the pick
//! fails (here the pick is in process).
//!
//! What the filter's root timer does, polling the saturation of the pools
//! that `poolState` conditions test, each worker does in process before
//! the exchanges it starts ([`learn_pool_states`]), at the same period.

mod exchange;
mod host;
mod messages;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kvasir_filter::pick::{pick_outcome_of, FailOpen, PickOutcome};
use kvasir_filter::settings::PluginConfig;
use kvasir_filter::shared::Shared;
use kvasir_filter::stats::Stats;
use kvasir_proto::envoy::service::ext_proc::v3 as ep;
use kvasir_proto::v1 as pb;
use prost::Message;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

pub use exchange::{Exchange, Serving, Step};
pub use host::{now_ns, PickCall};
pub use messages::{
    DESTINATION_KEY, LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE, UPSTREAM_ADDRESS,
};

use crate::metrics::Counter;
use crate::pools::Pools;

/// Threads running exchanges.
pub const WORKERS: usize = 2;
/// Responses buffered for a slow gateway stream.
const OUT_BUFFER: usize = 64;

/// One picker in the indexer's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PickerConfig {
    /// The ext_proc listen address.
    pub addr: SocketAddr,
    /// The pool it picks in (an InferencePool's pool here).
    pub pool: String,
    /// The compiled policy document (what `kvasirctl compile` prints, or
    /// the controller writes into the EnvoyExtensionPolicy's config), with
    /// an optional `filter` settings object: its tenants, keys, budgets,
    /// weights and policies apply as in the filter. `filter.maxEndpoints`
    /// is the length of each answer's list (1 for a gateway whose pool
    /// cluster is ORIGINAL_DST, which reads one address).
    pub policy_file: PathBuf,
    /// Largest ext_proc message accepted, bytes (a gateway sends a buffered
    /// body in one message); see `grpc_limit::picker_limit` for its default
    /// and floor. A larger message is refused with RESOURCE_EXHAUSTED before
    /// it is buffered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_message_bytes: Option<usize>,
}

/// What a pool's picker counted.
#[derive(Debug, Default)]
pub struct PickerMetrics {
    /// Exchanges (requests) begun.
    pub exchanges: Counter,
    /// Requests the picker answered itself (401, 429, 503, ...).
    pub replied: Counter,
    /// Requests sent on with an endpoint list.
    pub forwarded: Counter,
}

/// A stats sink that keeps nothing: Envoy's per-tenant stats have no
/// home here (the indexer's own metrics count per tenant).
struct NoStats;

impl Stats for NoStats {
    fn count(&self, _: &str, _: u64) {}
    fn gauge(&self, _: &str, _: u64) {}
    fn record(&self, _: &str, _: u64) {}
}

/// Why a picker could not start.
#[derive(Debug, thiserror::Error)]
pub enum PickerError {
    /// The policy file could not be read.
    #[error("picker for pool `{pool}`: cannot read {path}: {source}")]
    Read {
        /// The pool.
        pool: String,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The policy file is not a filter configuration.
    #[error("picker for pool `{pool}`: {path}: {message}")]
    Policy {
        /// The pool.
        pool: String,
        /// The file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The policy document names no pool served by this indexer pool.
    #[error("picker for pool `{pool}`: {path} has no pool with indexerPool `{pool}`")]
    NoPool {
        /// The pool.
        pool: String,
        /// The file.
        path: PathBuf,
    },
    /// The pool is not configured here.
    #[error("picker for pool `{0}`: no such pool in this indexer")]
    UnknownPool(String),
    /// A worker thread could not start.
    #[error("picker: cannot start a worker: {0}")]
    Worker(std::io::Error),
}

/// A new exchange's streams, handed to a worker.
struct Job {
    inbound: tonic::Streaming<ep::ProcessingRequest>,
    out: mpsc::Sender<Result<ep::ProcessingResponse, tonic::Status>>,
}

/// The ext_proc service of one pool's picker.
pub struct PickerService {
    workers: Vec<mpsc::UnboundedSender<Job>>,
    next: AtomicUsize,
    pool: String,
}

/// Loads a picker's policy document and what it serves.
pub fn load(cfg: &PickerConfig) -> Result<(PluginConfig, Serving), PickerError> {
    let bytes = std::fs::read(&cfg.policy_file).map_err(|source| PickerError::Read {
        pool: cfg.pool.clone(),
        path: cfg.policy_file.clone(),
        source,
    })?;
    let plugin = PluginConfig::from_bytes(&bytes).map_err(|message| PickerError::Policy {
        pool: cfg.pool.clone(),
        path: cfg.policy_file.clone(),
        message,
    })?;
    let cluster = plugin
        .policy
        .pools()
        .iter()
        .find(|p| p.indexer_pool == cfg.pool)
        .map(|p| p.cluster.clone())
        .ok_or_else(|| PickerError::NoPool {
            pool: cfg.pool.clone(),
            path: cfg.policy_file.clone(),
        })?;
    Ok((
        plugin,
        Serving {
            pool: cfg.pool.clone(),
            cluster,
        },
    ))
}

impl PickerService {
    /// A picker for `cfg` over `pools`, its worker threads started.
    pub fn start(cfg: &PickerConfig, pools: Arc<Pools>) -> Result<PickerService, PickerError> {
        pools
            .get(&cfg.pool)
            .map_err(|_| PickerError::UnknownPool(cfg.pool.clone()))?;
        let (plugin, serving) = load(cfg)?;
        let serving = Arc::new(serving);
        let mut workers = Vec::with_capacity(WORKERS);
        for i in 0..WORKERS {
            let (tx, rx) = mpsc::unbounded_channel();
            let (plugin, serving, pools) =
                (plugin.clone(), Arc::clone(&serving), Arc::clone(&pools));
            std::thread::Builder::new()
                .name(format!("picker-{}-{i}", cfg.pool))
                .spawn(move || worker(rx, plugin, serving, pools))
                .map_err(PickerError::Worker)?;
            workers.push(tx);
        }
        Ok(PickerService {
            workers,
            next: AtomicUsize::new(0),
            pool: cfg.pool.clone(),
        })
    }
}

/// A worker thread: its runtime runs the exchanges handed to it.
fn worker(
    mut jobs: mpsc::UnboundedReceiver<Job>,
    plugin: PluginConfig,
    serving: Arc<Serving>,
    pools: Arc<Pools>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "picker worker: no runtime");
            return;
        }
    };
    let seed = seed();
    let shared = Rc::new(Shared::new(plugin, Rc::new(NoStats)).with_id_seed(seed));
    // 0 turns polling off, as in the filter.
    let every = Duration::from_millis(u64::from(shared.config.settings.pool_state_poll_ms));
    let mut polled: Option<Instant> = None;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        while let Some(job) = jobs.recv().await {
            if !every.is_zero() && polled.is_none_or(|t| t.elapsed() >= every) {
                learn_pool_states(&shared, now_ns(), |name| {
                    pools.get(name).ok().map(|p| p.state())
                });
                polled = Some(Instant::now());
            }
            let (shared, serving, pools) =
                (Rc::clone(&shared), Arc::clone(&serving), Arc::clone(&pools));
            tokio::task::spawn_local(run(job, shared, serving, pools));
        }
    });
}

/// The saturation of each pool the policies' `poolState` conditions test,
/// from `state_of` (the pool's state by its indexer name; none for a pool
/// this indexer does not serve), learned as the filter learns a `PoolState`
/// answer. Without it a worker would know a pool's saturation only from
/// its own picks, so a condition on a pool nobody picks in (an idle pool:
/// "batch work while the GPUs are idle") would never hold.
pub fn learn_pool_states(
    shared: &Shared,
    now_ns: u64,
    state_of: impl Fn(&str) -> Option<pb::PoolStateResponse>,
) {
    let cfg = &shared.config.policy;
    for i in cfg.pools_needing_state() {
        let Some(state) = cfg.pools().get(i).and_then(|p| state_of(&p.indexer_pool)) else {
            continue;
        };
        shared.on_pool_state(i, 0, Some(&state.encode_to_vec()), now_ns);
    }
}

fn seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// One exchange, to its end.
async fn run(job: Job, shared: Rc<Shared>, serving: Arc<Serving>, pools: Arc<Pools>) {
    let Job { mut inbound, out } = job;
    let metrics = pools.get(&serving.pool).ok().map(Arc::clone);
    if let Some(p) = &metrics {
        p.picker.exchanges.inc();
    }
    let mut ex = Exchange::new(shared, Arc::clone(&serving));
    let mut forwarded = false;
    'stream: while let Some(msg) = inbound.next().await {
        let msg = match msg {
            Ok(msg) => msg,
            // A message over the limit (RESOURCE_EXHAUSTED) or a broken
            // stream: the gateway is told why (after a reset nobody is).
            Err(status) => {
                let _ = out.send(Err(status)).await;
                break;
            }
        };
        let mut step = ex.on_message(msg);
        loop {
            match step {
                Step::Send(responses) => {
                    for r in responses {
                        forwarded |= is_forward(&r);
                        if out.send(Ok(r)).await.is_err() {
                            break 'stream;
                        }
                    }
                    break;
                }
                Step::Pick(call) => {
                    let outcome = pick(&pools, &call.msg, call.timeout_ms, ex.subset()).await;
                    step = ex.picked(call.token, outcome);
                }
            }
        }
        report_all(&pools, ex.take_reports());
    }
    ex.on_end();
    report_all(&pools, ex.take_reports());
    if let Some(p) = &metrics {
        if ex.replied() {
            p.picker.replied.inc();
        } else if forwarded {
            p.picker.forwarded.inc();
        }
    }
}

/// Whether a response sends the request on with an endpoint list.
fn is_forward(r: &ep::ProcessingResponse) -> bool {
    r.dynamic_metadata
        .as_ref()
        .is_some_and(|m| m.fields.contains_key(LB_NAMESPACE))
}

/// Runs a pick the flow (or the exchange) encoded, within `subset`.
async fn pick(
    pools: &Pools,
    msg: &[u8],
    timeout_ms: u32,
    subset: Option<&[String]>,
) -> PickOutcome {
    let Ok(mut req) = pb::PickRequest::decode(msg) else {
        return PickOutcome::failed(FailOpen::BadResponse);
    };
    if let Some(s) = subset {
        req.subset = Some(pb::EndpointSubset {
            addresses: s.to_vec(),
        });
    }
    let limit = Duration::from_millis(u64::from(timeout_ms.max(1)));
    match tokio::time::timeout(limit, pools.pick(req)).await {
        Ok(Ok(answer)) => pick_outcome_of(answer),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "picker: pick refused");
            PickOutcome::failed(FailOpen::GrpcError)
        }
        Err(_) => PickOutcome::failed(FailOpen::Timeout),
    }
}

fn report_all(pools: &Pools, reports: Vec<Vec<u8>>) {
    for r in reports {
        match pb::ReportRequest::decode(r.as_slice()) {
            Ok(r) => {
                if let Err(e) = pools.report(&r) {
                    tracing::debug!(error = %e, "picker: report refused");
                }
            }
            Err(e) => tracing::debug!(error = %e, "picker: report does not decode"),
        }
    }
}

type ProcessStream =
    Pin<Box<dyn Stream<Item = Result<ep::ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ep::external_processor_server::ExternalProcessor for PickerService {
    type ProcessStream = ProcessStream;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ep::ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let (out, rx) = mpsc::channel(OUT_BUFFER);
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        let job = Job {
            inbound: request.into_inner(),
            out,
        };
        if self.workers[i].send(job).is_err() {
            return Err(tonic::Status::unavailable(format!(
                "the picker of pool `{}` is stopping",
                self.pool
            )));
        }
        let stream =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
        Ok(tonic::Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests;
