//! One pool's state: its endpoints (each with its KV-event subscriber),
//! prefix index, pick history, tokenizer, load tracker, failure tracking
//! and counters, and which endpoint holds each stored response
//! ([`crate::responses`]). Picks are in [`crate::pick`], reports in
//! [`crate::report`]; [`crate::pools::Pools`] finds a pool by name.
//!
//! Status codes: every malformed request, **unknown pool included**, is
//! `INVALID_ARGUMENT` with a message naming the field (pools are
//! configuration, so naming one that does not exist is a caller bug, and one
//! code keeps the filter's handling simple). Nothing else is an error: when
//! the tokenizer is unavailable (render timeout) the pick goes on by load
//! (`no_index`); when no endpoint is healthy the answer is empty with
//! decision `no_endpoints`.

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Instant;

use kvasir_proto::v1 as pb;
use parking_lot::RwLock;

pub use crate::endpoint::Endpoint;
use crate::events::{DecodedBatch, EngineEvent, EngineHash, SubscriberHandle, SyncState};
use crate::health::{FailureConfig, Failures};
use crate::history::{PickHistory, DEFAULT_PICK_HISTORY_BLOCKS};
use crate::index::PoolIndex;
use crate::load::{pool_saturation, scrape, EngineLoad, Liveness, LoadTracker, ScrapeError};
use crate::metrics::PoolMetrics;
use crate::responses::{Affinity, AffinityConfig, ResponseStore};
use crate::scoring::Weights;
use crate::tokenize::{RequestTokenizer, TokenizeBudget};
use crate::types::{EndpointId, EndpointSpec, IndexSource};

/// A request the indexer refuses (`INVALID_ARGUMENT` at the gRPC edge).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceError {
    /// The pool is not configured.
    #[error("pool: unknown pool `{0}`")]
    UnknownPool(String),
    /// A field is missing or malformed.
    #[error("{field}: {message}")]
    Invalid {
        /// The field, e.g. `chat.messages`.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// A [`ServiceError::Invalid`].
pub(crate) fn invalid(field: &'static str, message: impl Into<String>) -> ServiceError {
    ServiceError::Invalid {
        field,
        message: message.into(),
    }
}

/// Everything the picker knows about one pool.
pub struct Pool {
    /// Pool name.
    pub name: String,
    /// Model name.
    pub model: String,
    /// Tokens per block.
    pub block_size: u32,
    /// The prefix index fed by the engines' KV events (stays empty with
    /// [`IndexSource::Picks`]).
    pub index: Arc<PoolIndex>,
    /// Where picks look prefixes up: the KV-event index, or the pick history.
    pub index_source: IndexSource,
    /// This replica's own picks, per endpoint: the prefix index with
    /// [`IndexSource::Picks`], and the one approx pseudo-tokens are matched
    /// against (they cannot be compared with the engines' events). `None`
    /// when neither applies.
    pub(crate) history: Option<RwLock<PickHistory>>,
    /// The pool's tokenizer.
    pub tokenizer: RequestTokenizer,
    /// Load and in-flight state.
    pub load: LoadTracker,
    /// Scoring weights.
    pub weights: Weights,
    /// Hot-path metrics.
    pub metrics: PoolMetrics,
    endpoints: RwLock<Arc<Vec<Arc<Endpoint>>>>,
    /// Bounds on a pick's in-process tokenization.
    pub tokenize_budget: TokenizeBudget,
    /// Endpoints whose requests fail, from the reports.
    pub failures: Failures,
    /// Chain completions in progress (see `complete_chain_later`).
    pub(crate) completions: Arc<AtomicUsize>,
    /// Which endpoint holds each stored Responses API response.
    pub responses: Affinity,
    /// Conversations started per endpoint lately (the `placement` term).
    pub(crate) placements: crate::load::Placed,
    /// Tenants' token budgets (one set for every pool of the process).
    pub budgets: Arc<crate::budgets::Budgets>,
    /// The pool's flow-control queue.
    pub flow: crate::flow::PoolFlow,
    /// Probes of endpoints whose event socket disconnected (see
    /// [`Pool::probe_loop`]).
    pub liveness: Arc<Liveness>,
    /// Requests admitted without their pick's answer (see
    /// [`crate::abandoned`]).
    pub abandoned: crate::abandoned::Abandoned,
    /// What the pool's endpoint picker counted (see [`crate::picker`]).
    pub picker: crate::picker::PickerMetrics,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("name", &self.name)
            .field("block_size", &self.block_size)
            .field("tokenizer", &self.tokenizer)
            .field("index_source", &self.index_source)
            .finish_non_exhaustive()
    }
}

/// What changed in [`Pool::set_endpoints`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EndpointChanges {
    /// Addresses added (or re-added with a changed spec).
    pub added: Vec<String>,
    /// Addresses removed.
    pub removed: Vec<String>,
}

impl Pool {
    /// A pool with no endpoints yet, its prefix index fed by KV events (see
    /// [`Pool::with_index`]).
    pub fn new(
        name: impl Into<String>,
        model: impl Into<String>,
        block_size: u32,
        tokenizer: RequestTokenizer,
        load: LoadTracker,
        weights: Weights,
    ) -> Self {
        let name = name.into();
        let history = matches!(tokenizer, RequestTokenizer::Approx)
            .then(|| RwLock::new(PickHistory::new(DEFAULT_PICK_HISTORY_BLOCKS)));
        Pool {
            name: name.clone(),
            model: model.into(),
            block_size,
            index: Arc::new(PoolIndex::new(block_size)),
            index_source: IndexSource::Events,
            history,
            tokenizer,
            load,
            placements: crate::load::Placed::new(weights.placement_half_life_ms),
            weights,
            metrics: PoolMetrics::default(),
            endpoints: RwLock::new(Arc::new(Vec::new())),
            tokenize_budget: TokenizeBudget::default(),
            failures: Failures::default(),
            completions: Arc::new(AtomicUsize::new(0)),
            responses: Affinity::new(&name, AffinityConfig::default(), None),
            budgets: Arc::new(crate::budgets::Budgets::memory()),
            flow: crate::flow::PoolFlow::new(Default::default()),
            liveness: Arc::new(Liveness::default()),
            abandoned: crate::abandoned::Abandoned::default(),
            picker: crate::picker::PickerMetrics::default(),
        }
    }

    /// Sets the budgets this pool's picks reserve against (shared by the
    /// process's pools).
    pub fn with_budgets(mut self, budgets: Arc<crate::budgets::Budgets>) -> Self {
        self.budgets = budgets;
        self
    }

    /// Sets the pool's flow control.
    pub fn with_flow_control(mut self, cfg: kvasir_flowcontrol::FlowControlConfig) -> Self {
        self.flow = crate::flow::PoolFlow::new(cfg);
        self
    }

    /// Sets where the prefix index comes from and the pick history's
    /// capacity per endpoint, in blocks (call before adding endpoints).
    pub fn with_index(mut self, source: IndexSource, history_blocks: usize) -> Self {
        self.index_source = source;
        let wants_history =
            source == IndexSource::Picks || matches!(self.tokenizer, RequestTokenizer::Approx);
        self.history = wants_history.then(|| RwLock::new(PickHistory::new(history_blocks)));
        self
    }

    /// Sets the bounds on a pick's in-process tokenization.
    pub fn with_tokenize_budget(mut self, budget: TokenizeBudget) -> Self {
        self.tokenize_budget = budget;
        self
    }

    /// Sets when an endpoint counts as failing.
    pub fn with_failures(mut self, cfg: FailureConfig) -> Self {
        self.failures = Failures::new(cfg);
        self
    }

    /// Sets how stored responses are remembered: `cfg`, and the store the
    /// replicas share (none: this process only).
    pub fn with_responses(
        mut self,
        cfg: AffinityConfig,
        shared: Option<Arc<dyn ResponseStore>>,
    ) -> Self {
        self.responses = Affinity::new(&self.name, cfg, shared);
        self
    }

    /// Whether the pool's endpoints get KV-event subscribers.
    pub fn wants_events(&self) -> bool {
        self.index_source == IndexSource::Events
    }

    /// Blocks the pick history holds for an endpoint (`None` without a
    /// history).
    pub fn history_blocks(&self, endpoint: EndpointId) -> Option<usize> {
        self.history.as_ref().map(|h| h.read().blocks(endpoint))
    }

    /// Capacity of each endpoint's pick history, blocks (`None` without a
    /// history).
    pub fn history_capacity_blocks(&self) -> Option<usize> {
        self.history.as_ref().map(|h| h.read().capacity_blocks())
    }

    /// Blocks the pool's prefix index holds for an endpoint: the KV-event
    /// index's, or the pick history's with [`IndexSource::Picks`].
    pub fn indexed_blocks(&self, endpoint: EndpointId) -> usize {
        match (self.index_source, &self.history) {
            (IndexSource::Picks, Some(h)) => h.read().blocks(endpoint),
            _ => self.index.blocks(endpoint),
        }
    }

    /// Forgets what the index and the pick history hold for an endpoint
    /// (it went away: it may come back with an empty cache).
    pub fn clear_endpoint(&self, endpoint: EndpointId) {
        self.index.clear_endpoint(endpoint);
        if let Some(h) = &self.history {
            h.write().clear_endpoint(endpoint);
        }
        self.placements.forget(endpoint);
    }

    /// The current endpoints, sorted by address (a cheap snapshot).
    pub fn endpoints(&self) -> Arc<Vec<Arc<Endpoint>>> {
        self.endpoints.read().clone()
    }

    /// Replaces the endpoint set. Endpoints whose spec is unchanged keep
    /// their subscriber and state; new ones get `spawn(spec)` as subscriber
    /// and start unhealthy (until scraped); removed ones are dropped from the
    /// index, the load tracker and the pick history, and their subscriber
    /// stops.
    pub fn set_endpoints(
        &self,
        specs: Vec<EndpointSpec>,
        mut spawn: impl FnMut(&EndpointSpec) -> Option<SubscriberHandle>,
    ) -> EndpointChanges {
        let mut guard = self.endpoints.write();
        let old: HashMap<&str, &Arc<Endpoint>> =
            guard.iter().map(|e| (e.spec.address.as_str(), e)).collect();
        let mut changes = EndpointChanges::default();
        let mut next: Vec<Arc<Endpoint>> = Vec::with_capacity(specs.len());
        let mut keep = std::collections::HashSet::new();
        for spec in specs {
            if next.iter().any(|e| e.spec.address == spec.address) {
                continue; // duplicate address: first wins
            }
            match old.get(spec.address.as_str()) {
                Some(e) if e.spec == spec => {
                    keep.insert(spec.address.clone());
                    next.push(Arc::clone(e));
                }
                _ => {
                    let id = spec.id();
                    if old.contains_key(spec.address.as_str()) {
                        // Same address, new spec (e.g. other event port):
                        // start over.
                        self.drop_endpoint_state(id);
                    }
                    self.load.add_endpoint(id);
                    let subscriber = spawn(&spec);
                    if let Some(s) = &subscriber {
                        let liveness = Arc::clone(&self.liveness);
                        s.on_disconnect(Arc::new(move || {
                            liveness.request(id);
                        }));
                    }
                    changes.added.push(spec.address.clone());
                    keep.insert(spec.address.clone());
                    next.push(Arc::new(Endpoint {
                        id,
                        spec,
                        subscriber,
                    }));
                }
            }
        }
        for (address, e) in &old {
            if !keep.contains(*address) {
                self.drop_endpoint_state(e.id);
                // Only a removal: a changed spec at the same address (other
                // event port) is the same engine, still holding its
                // responses; a restart shows on its event stream.
                self.responses.endpoint_left(e.id);
                changes.removed.push((*address).to_string());
            }
        }
        next.sort_by(|a, b| a.spec.address.cmp(&b.spec.address));
        *guard = Arc::new(next);
        drop(guard);
        self.capacity_freed();
        changes
    }

    /// Test and benchmark support: the endpoints become `n`
    /// [`EndpointSpec::loopback`] ones without subscribers, each with one
    /// idle scrape recorded, so they are healthy and picked straight away.
    pub fn set_idle_loopback_endpoints(&self, n: usize) {
        self.set_endpoints((0..n).map(EndpointSpec::loopback).collect(), |_| None);
        let now = Instant::now();
        for e in self.endpoints().iter() {
            self.load
                .record_scrape(e.id, Some(EngineLoad::default()), now);
        }
    }

    fn drop_endpoint_state(&self, id: EndpointId) {
        self.index.remove_endpoint(id);
        if let Some(h) = &self.history {
            h.write().remove_endpoint(id);
        }
        self.load.remove_endpoint(id);
        self.failures.remove_endpoint(id);
        self.placements.forget(id);
    }

    /// Whether every endpoint's event stream is in sync, and the addresses
    /// of those that are not. A pool whose index is its own picks has no
    /// streams to wait for: always ready; nor has an endpoint whose engine
    /// advertises no KV events ([`SyncState::NoSource`]): waiting for it
    /// would keep the indexer unready for as long as that engine runs.
    pub fn readiness(&self) -> (bool, Vec<String>) {
        if !self.wants_events() {
            return (true, Vec::new());
        }
        let waits =
            |s: Option<SyncState>| !matches!(s, Some(SyncState::InSync | SyncState::NoSource));
        let not: Vec<String> = self
            .endpoints()
            .iter()
            .filter(|e| e.subscriber.is_some() && waits(e.sync_state()))
            .map(|e| e.spec.address.clone())
            .collect();
        (not.is_empty(), not)
    }

    /// The pool's state.
    pub fn state(&self) -> pb::PoolStateResponse {
        let endpoints = self.endpoints();
        let now = Instant::now();
        let views = self.load.views(endpoints.iter().map(|e| e.id), now);
        let mut state = pb::PoolStateResponse {
            pool: self.name.clone(),
            endpoints: endpoints
                .iter()
                .zip(&views)
                .map(|(e, v)| pb::EndpointState {
                    address: e.spec.address.clone(),
                    running: v.engine.running,
                    waiting: v.engine.waiting,
                    kv_usage: v.engine.kv_usage,
                    in_flight: v.in_flight,
                    queued_prefill_tokens: v.queued_prefill_tokens,
                    saturation: v.saturation,
                    saturated: v.saturated,
                    healthy: v.healthy,
                    indexed_blocks: self.indexed_blocks(e.id) as u64,
                    sync_state: sync_to_pb(e.sync_state()) as i32,
                    last_scrape_age_ms: v.last_scrape_age.map_or(0, |d| {
                        u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
                    }),
                })
                .collect(),
            pool_saturation: pool_saturation(&views),
            block_size: self.block_size,
            ..Default::default()
        };
        state.set_tokenize_mode(self.tokenizer.mode());
        state
    }
}

impl Pool {
    /// Probes each endpoint whose event socket reported a disconnect, at
    /// once rather than at the next scrape tick: one `/metrics` GET bounded
    /// by `timeout`, at most one per endpoint at a time. A refused
    /// connection (nobody listens: the engine is gone) turns the endpoint
    /// unhealthy now, with what turning unhealthy does ([`Pool::went_down`]);
    /// a good answer is recorded as a scrape, so a blip on a live engine's
    /// socket changes nothing; other failures are left to the ticks and
    /// their `unhealthyAfter` count. Runs until `cancel`.
    ///
    /// Probes open a fresh connection each: a kept-alive one to an engine
    /// that just died fails as "connection closed" until the pool notices,
    /// which says nothing, while a new one is refused at once.
    pub async fn probe_loop(
        self: Arc<Self>,
        timeout: std::time::Duration,
        cancel: tokio_util::sync::CancellationToken,
    ) {
        let client = match reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .build()
        {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(pool = %self.name, error = %e, "no HTTP client for liveness probes; left to the scrapes");
                return;
            }
        };
        loop {
            let ids = tokio::select! {
                () = cancel.cancelled() => return,
                ids = self.liveness.next() => ids,
            };
            for id in ids {
                let pool = Arc::clone(&self);
                let client = client.clone();
                tokio::spawn(async move {
                    pool.probe(&client, id, timeout).await;
                    pool.liveness.done(id);
                });
            }
        }
    }

    async fn probe(&self, client: &reqwest::Client, id: EndpointId, timeout: std::time::Duration) {
        let Some(e) = self.endpoints().iter().find(|e| e.id == id).cloned() else {
            return;
        };
        let url = e.spec.metrics_url();
        let mut result = scrape(client, &url, timeout).await;
        // An engine being killed closes its event socket a moment before its
        // HTTP listener: a connection accepted meanwhile is reset. Ask
        // again (a live engine does not reset fresh connections).
        for _ in 0..PROBE_RETRIES {
            if !matches!(result, Err(ScrapeError::Reset { .. })) {
                break;
            }
            tokio::time::sleep(PROBE_RETRY_DELAY).await;
            result = scrape(client, &url, timeout).await;
        }
        match result {
            Ok(load) => self.load.record_scrape(id, Some(load), Instant::now()),
            Err(ScrapeError::Refused { .. }) => {
                if self.load.record_refused(id) {
                    self.went_down(&e, "connection refused after its event socket disconnected");
                }
            }
            Err(err) => {
                tracing::debug!(pool = %self.name, endpoint = %e.spec.address, error = %err, "liveness probe failed; left to the scrapes");
            }
        }
    }

    /// What an endpoint turning unhealthy does besides leaving picks: an
    /// engine that went away may come back empty (a restart), so its blocks
    /// are dropped and its subscriber rebuilds from replay at the next
    /// contact.
    pub fn went_down(&self, e: &Endpoint, why: &str) {
        tracing::warn!(pool = %self.name, endpoint = %e.spec.address, why, "endpoint unhealthy; left out of picks, its blocks dropped");
        if let Some(sub) = &e.subscriber {
            sub.mark_unreachable();
        }
        self.clear_endpoint(e.id);
    }
}

/// Probes asked again after a reset connection (see [`Pool::probe_loop`]).
const PROBE_RETRIES: u32 = 3;
/// Wait before asking again: an exiting process closes its sockets within
/// milliseconds.
const PROBE_RETRY_DELAY: std::time::Duration = std::time::Duration::from_millis(20);

/// A batch with one `BlockStored` of GPU blocks from the start of a
/// sequence: how benchmarks and tests feed an index without an engine.
pub fn stored_batch(
    block_hashes: Vec<EngineHash>,
    token_ids: Vec<u32>,
    block_size: u32,
) -> DecodedBatch {
    DecodedBatch {
        ts: 0.0,
        events: vec![EngineEvent::BlockStored {
            block_hashes,
            parent: None,
            token_ids,
            block_size,
            lora_name: None,
            medium: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        }],
        dp_rank: None,
        ignored_events: 0,
    }
}

/// The proto enum of a subscriber state.
fn sync_to_pb(s: Option<SyncState>) -> pb::SyncState {
    match s {
        None => pb::SyncState::Unspecified,
        Some(SyncState::Connecting) => pb::SyncState::Connecting,
        Some(SyncState::InSync) => pb::SyncState::InSync,
        Some(SyncState::Replaying) => pb::SyncState::Replaying,
        Some(SyncState::Resyncing) => pb::SyncState::Resyncing,
        // No source to subscribe to: the proto (additive only) has no
        // value of its own for it, and "no stream" is what a reader needs.
        Some(SyncState::Disconnected | SyncState::NoSource) => pb::SyncState::Disconnected,
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
