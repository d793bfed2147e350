//! The picker: per-pool state ([`Pool`]) with `pick` / `report` /
//! `pool_state` as plain async functions returning [`ServiceError`], and the
//! tonic `kvasir.v1.Indexer` service ([`IndexerService`]) that maps those
//! errors to gRPC status codes at the edge.
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
use kvasir_tokenizer::ChatMessage;
use parking_lot::RwLock;

use crate::events::{DecodedBatch, EngineEvent, EngineHash, SubscriberHandle, SyncState};
use crate::health::{FailureConfig, Failures};
use crate::history::{PickHistory, DEFAULT_PICK_HISTORY_BLOCKS};
use crate::index::PoolIndex;
use crate::load::{pool_saturation, LoadTracker, LoadView, Phase};
use crate::metrics::{PoolMetrics, SessionMetrics};
use crate::pick_tokens::{complete_chain_later, OwnedPrompt, PrefixHashes};
use crate::scoring::{self, Candidate, Decision, Weights};
use crate::tokenize::{RequestTokenizer, TokenizeBudget, TokenizeMode};
use crate::types::{EndpointId, EndpointSpec, IndexSource};

/// A request the service refuses.
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

fn invalid(field: &'static str, message: impl Into<String>) -> ServiceError {
    ServiceError::Invalid {
        field,
        message: message.into(),
    }
}

impl From<ServiceError> for tonic::Status {
    fn from(e: ServiceError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

/// One endpoint of a pool, with its event subscriber.
pub struct Endpoint {
    /// What it is.
    pub spec: EndpointSpec,
    /// Its id (`spec.id()`).
    pub id: EndpointId,
    /// Its KV-event subscriber (none in tests that feed the index directly).
    pub subscriber: Option<SubscriberHandle>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("address", &self.spec.address)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Sync state of its event stream (`None` without a subscriber).
    pub fn sync_state(&self) -> Option<SyncState> {
        self.subscriber.as_ref().map(SubscriberHandle::state)
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
    history: Option<RwLock<PickHistory>>,
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
        let history = matches!(tokenizer, RequestTokenizer::Approx)
            .then(|| RwLock::new(PickHistory::new(DEFAULT_PICK_HISTORY_BLOCKS)));
        Pool {
            name: name.into(),
            model: model.into(),
            block_size,
            index: Arc::new(PoolIndex::new(block_size)),
            index_source: IndexSource::Events,
            history,
            tokenizer,
            load,
            weights,
            metrics: PoolMetrics::default(),
            endpoints: RwLock::new(Arc::new(Vec::new())),
            tokenize_budget: TokenizeBudget::default(),
            failures: Failures::default(),
            completions: Arc::new(AtomicUsize::new(0)),
        }
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
                changes.removed.push((*address).to_string());
            }
        }
        next.sort_by(|a, b| a.spec.address.cmp(&b.spec.address));
        *guard = Arc::new(next);
        changes
    }

    fn drop_endpoint_state(&self, id: EndpointId) {
        self.index.remove_endpoint(id);
        if let Some(h) = &self.history {
            h.write().remove_endpoint(id);
        }
        self.load.remove_endpoint(id);
        self.failures.remove_endpoint(id);
    }

    /// Whether every endpoint's event stream is in sync, and the addresses
    /// of those that are not. A pool whose index is its own picks has no
    /// streams to wait for: always ready.
    pub fn readiness(&self) -> (bool, Vec<String>) {
        if !self.wants_events() {
            return (true, Vec::new());
        }
        let not: Vec<String> = self
            .endpoints()
            .iter()
            .filter(|e| e.subscriber.is_some() && e.sync_state() != Some(SyncState::InSync))
            .map(|e| e.spec.address.clone())
            .collect();
        (not.is_empty(), not)
    }

    /// Answers a pick. Counts and times itself.
    pub async fn pick(&self, req: pb::PickRequest) -> Result<pb::PickResponse, ServiceError> {
        let started = Instant::now();
        let r = self.pick_inner(req, started).await;
        match &r {
            Ok(resp) => {
                let d = decision_from_pb(resp.decision);
                self.metrics.count_pick(d);
                self.metrics.pick_latency.observe(started.elapsed());
            }
            Err(_) => self.metrics.pick_invalid.inc(),
        }
        r
    }

    async fn pick_inner(
        &self,
        req: pb::PickRequest,
        started: Instant,
    ) -> Result<pb::PickResponse, ServiceError> {
        let pb::PickRequest {
            request_id,
            prompt,
            hints,
            max_endpoints,
            tenant,
            ..
        } = req;
        let prompt = prompt
            .ok_or_else(|| invalid("prompt", "one of chat, text or token_ids is required"))?;
        // Take the prompt by value: a 32k-token chat is ~128 KB of text,
        // not worth copying on the hot path.
        let owned = match prompt {
            pb::pick_request::Prompt::Chat(chat) => {
                if chat.messages.is_empty() {
                    return Err(invalid("chat.messages", "must not be empty"));
                }
                if let Some((i, _)) = chat
                    .messages
                    .iter()
                    .enumerate()
                    .find(|(_, m)| m.role.is_empty())
                {
                    return Err(invalid("chat.messages", format!("message {i} has no role")));
                }
                OwnedPrompt::Chat(
                    chat.messages
                        .into_iter()
                        .map(|m| ChatMessage::new(m.role, m.content))
                        .collect(),
                )
            }
            pb::pick_request::Prompt::Text(t) => {
                if t.is_empty() {
                    return Err(invalid("text", "must not be empty"));
                }
                OwnedPrompt::Text(t)
            }
            pb::pick_request::Prompt::TokenIds(ids) => {
                if ids.ids.is_empty() {
                    return Err(invalid("token_ids.ids", "must not be empty"));
                }
                OwnedPrompt::TokenIds(ids.ids)
            }
        };
        let input = owned.input();
        let salted = hints.as_ref().is_some_and(|h| !h.cache_salt.is_empty());

        let endpoints = self.endpoints();

        // Tokenize. Render mode asks a healthy endpoint chosen by request id
        // (spreads the render load, and replicas ask the same one).
        let render_via = if self.tokenizer.needs_engine() {
            let seed = scoring::seed_of(&request_id, &[]);
            let views = self.load.views(endpoints.iter().map(|e| e.id), started);
            endpoints
                .iter()
                .zip(&views)
                .filter(|(_, v)| v.healthy)
                .min_by_key(|(e, _)| scoring::tie_key(seed, &e.spec.address))
                .map(|(e, _)| e.spec.address.as_str())
        } else {
            None
        };
        let mut hashes = PrefixHashes::default();
        let tokens = self
            .tokenize_pick(input, salted, render_via, &mut hashes)
            .await
            .map_err(|e| invalid("chat.messages", e.to_string()))?;
        let (ids, mode, tokenized_ok) = (tokens.ids, tokens.mode, tokens.ok);
        let estimated_len = tokens.estimated_len;
        let prompt_tokens = u32::try_from(estimated_len.unwrap_or(ids.len())).unwrap_or(u32::MAX);

        // Match against the prefix index: the engines' events, or this
        // replica's own pick history (index `picks` whatever the ids, and
        // approx pseudo-tokens, which cannot be compared with the events).
        // A salted request is not matched (nor recorded): KV events do not
        // carry the salt, so the index cannot tell which blocks a salted
        // request may reuse.
        let from_history = self.index_source == IndexSource::Picks || mode == TokenizeMode::Approx;
        let history = if from_history {
            self.history.as_ref()
        } else {
            None
        };
        // (A pool that matches from its history always has one: `new`,
        // `with_index`.)
        let indexed = tokenized_ok && !salted && (history.is_some() || !from_history);
        // (Hashes the prefix tokenizer's checks computed are extended, not
        // recomputed.)
        if indexed {
            hashes.extend(&self.index, &ids, self.block_size);
        }
        let chain: Option<Arc<[u64]>> = indexed.then(|| std::mem::take(&mut hashes.chain).into());
        let overlap = match (&chain, history) {
            (Some(c), Some(h)) => Some(h.read().overlap(c)),
            (Some(_), None) => Some(self.index.overlap_of(&hashes.local)),
            (None, _) => None,
        };

        // Event-indexed picks also match against picks still in prefill: a
        // burst of requests sharing a prefix sees it as (about to be) cached
        // where the first of them went, before the engine's events say so.
        // The pick history needs no such help: it records each pick at once.
        let pending_chain = if history.is_none() {
            chain.clone()
        } else {
            None
        };
        let views = self.load.views_matching(
            endpoints.iter().map(|e| e.id),
            started,
            pending_chain.as_deref(),
        );
        let failing = self
            .failures
            .ranked_last_all(endpoints.iter().map(|e| e.id), started);
        let candidates: Vec<Candidate<'_>> = endpoints
            .iter()
            .zip(&views)
            .zip(failing)
            .map(|((e, v), failing)| {
                let indexed_blocks = overlap.as_ref().map_or(0, |o| o.blocks_for(e.id));
                Candidate {
                    failing,
                    ..candidate(e, v, indexed_blocks.max(v.pending_matched_blocks))
                }
            })
            .collect();
        let sreq = scoring::Request {
            prompt_tokens,
            block_size: self.block_size,
            seed: scoring::seed_of(&request_id, &ids),
            max_endpoints: max_endpoints as usize,
            indexed,
        };
        let ranking = scoring::rank(&sreq, &candidates, &self.weights);

        if let Some(first) = ranking.order.first() {
            let e = &endpoints[first.candidate];
            self.failures.picked(e.id, started);
            self.load.record_pick(
                &request_id,
                e.id,
                first.cost.prefill_work,
                first.predicted_cached_tokens,
                pending_chain,
                started,
            );
            if let (Some(h), Some(c)) = (history, &chain) {
                h.write().record(e.id, c);
            }
            // A stopped tokenization left the pick's chain short: finish it
            // off the pick's path, so that requests sharing this prompt's
            // fresh part while it is in prefill see it there.
            if let (true, RequestTokenizer::Local(tok), false) = (
                tokens.complete_later,
                &self.tokenizer,
                request_id.is_empty() || salted,
            ) {
                let started = complete_chain_later(
                    Arc::clone(tok),
                    owned,
                    (self.block_size, self.tokenize_budget.limits()),
                    request_id.clone(),
                    self.load.pending_chains(),
                    &self.completions,
                );
                if !started {
                    self.metrics.chain_completions_skipped.inc();
                }
            }
        }

        tracing::debug!(
            pool = %self.name,
            %tenant,
            %request_id,
            decision = ranking.decision.as_str(),
            first = ranking.order.first().map(|r| endpoints[r.candidate].spec.address.as_str()),
            prompt_tokens,
            "pick"
        );
        Ok(pb::PickResponse {
            endpoints: ranking
                .order
                .iter()
                .map(|r| pb::PickedEndpoint {
                    address: endpoints[r.candidate].spec.address.clone(),
                    predicted_cached_tokens: r.predicted_cached_tokens,
                    score: Some(pb::ScoreBreakdown {
                        total: r.cost.total,
                        prefill: r.cost.prefill,
                        decode: r.cost.decode,
                        queue: r.cost.queue,
                        kv: r.cost.kv,
                        matched_blocks: r.cost.matched_blocks,
                        uncached_tokens: r.cost.uncached_tokens,
                        queued_prefill_tokens: r.cost.queued_prefill_tokens,
                    }),
                    saturated: r.saturated,
                })
                .collect(),
            prompt_tokens,
            pool_saturation: pool_saturation(&views),
            decision: decision_to_pb(ranking.decision) as i32,
            reason: ranking.decision.as_str().to_string(),
            tokenize_mode: mode.as_str().to_string(),
        })
    }

    /// Accounts a report.
    pub fn report(&self, req: &pb::ReportRequest) -> Result<pb::ReportResponse, ServiceError> {
        if req.request_id.is_empty() {
            return Err(invalid("request_id", "must not be empty"));
        }
        let phase =
            match pb::ReportPhase::try_from(req.phase).unwrap_or(pb::ReportPhase::Unspecified) {
                pb::ReportPhase::FirstToken => Phase::FirstToken,
                pb::ReportPhase::Done | pb::ReportPhase::Unspecified => Phase::Done,
            };
        let m = self.load.report(&req.request_id, phase);
        if m.matched {
            self.metrics.reports_matched.inc();
        } else {
            self.metrics.reports_unmatched.inc();
        }
        if phase == Phase::Done {
            let outcome = pb::Outcome::try_from(req.outcome).unwrap_or(pb::Outcome::Unspecified);
            let i = match outcome {
                pb::Outcome::Success | pb::Outcome::Unspecified => 0,
                pb::Outcome::Error => 1,
                pb::Outcome::Cancelled => 2,
                pb::Outcome::Timeout => 3,
                pb::Outcome::Rejected => 4,
                pb::Outcome::ClientError => 5,
            };
            self.metrics.reports_by_outcome[i].inc();
            self.count_outcome(&req.endpoint, m.endpoint, outcome);
            // Prediction accuracy, only where the picked endpoint served.
            let served_by_pick = m.endpoint.is_some_and(|id| {
                req.endpoint.is_empty() || EndpointId::from_address(&req.endpoint) == id
            });
            if let (true, Some(p), true) = (served_by_pick, m.predicted_cached, i == 0) {
                self.metrics.predicted_cached_tokens.add(u64::from(p));
                self.metrics
                    .reported_cached_tokens
                    .add(u64::from(req.cached_tokens));
            }
        }
        Ok(pb::ReportResponse { matched: m.matched })
    }

    /// The pool's state.
    pub fn state(&self) -> pb::PoolStateResponse {
        let endpoints = self.endpoints();
        let now = Instant::now();
        let views = self.load.views(endpoints.iter().map(|e| e.id), now);
        pb::PoolStateResponse {
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
            tokenize_mode: self.tokenizer.mode().as_str().to_string(),
            block_size: self.block_size,
        }
    }
}

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

fn candidate<'a>(e: &'a Endpoint, v: &LoadView, matched: usize) -> Candidate<'a> {
    Candidate {
        address: &e.spec.address,
        matched_blocks: u32::try_from(matched).unwrap_or(u32::MAX),
        running: v.engine.running,
        waiting: v.engine.waiting,
        kv_usage: v.engine.kv_usage,
        in_flight: v.in_flight,
        queued_prefill_tokens: v.queued_prefill_tokens,
        healthy: v.healthy,
        saturated: v.saturated,
        left_out: v.left_out,
        failing: false,
    }
}

/// The proto enum of a decision.
pub fn decision_to_pb(d: Decision) -> pb::Decision {
    match d {
        Decision::Prefix => pb::Decision::Prefix,
        Decision::Load => pb::Decision::Load,
        Decision::NoIndex => pb::Decision::NoIndex,
        Decision::AllSaturated => pb::Decision::AllSaturated,
        Decision::NoEndpoints => pb::Decision::NoEndpoints,
    }
}

fn decision_from_pb(d: i32) -> Decision {
    match pb::Decision::try_from(d) {
        Ok(pb::Decision::Prefix) => Decision::Prefix,
        Ok(pb::Decision::NoIndex) => Decision::NoIndex,
        Ok(pb::Decision::AllSaturated) => Decision::AllSaturated,
        Ok(pb::Decision::NoEndpoints) => Decision::NoEndpoints,
        _ => Decision::Load,
    }
}

/// The proto enum of a subscriber state.
pub fn sync_to_pb(s: Option<SyncState>) -> pb::SyncState {
    match s {
        None => pb::SyncState::Unspecified,
        Some(SyncState::Connecting) => pb::SyncState::Connecting,
        Some(SyncState::InSync) => pb::SyncState::InSync,
        Some(SyncState::Replaying) => pb::SyncState::Replaying,
        Some(SyncState::Resyncing) => pb::SyncState::Resyncing,
        Some(SyncState::Disconnected) => pb::SyncState::Disconnected,
    }
}

/// The pools of one indexer, by name.
#[derive(Debug, Default, Clone)]
pub struct Pools {
    by_name: HashMap<String, Arc<Pool>>,
    ordered: Vec<Arc<Pool>>,
    sessions: Arc<SessionMetrics>,
}

impl Pools {
    /// From a list (names unique; a later duplicate is ignored).
    pub fn new(pools: Vec<Arc<Pool>>) -> Self {
        let mut by_name = HashMap::new();
        let mut ordered = Vec::new();
        for p in pools {
            if by_name.insert(p.name.clone(), Arc::clone(&p)).is_none() {
                ordered.push(p);
            }
        }
        Pools {
            by_name,
            ordered,
            sessions: Arc::default(),
        }
    }

    /// Metrics of the `Session` streams served over these pools.
    pub fn session_metrics(&self) -> &Arc<SessionMetrics> {
        &self.sessions
    }

    /// A pool by name.
    pub fn get(&self, name: &str) -> Result<&Arc<Pool>, ServiceError> {
        if name.is_empty() {
            return Err(invalid("pool", "must not be empty"));
        }
        self.by_name
            .get(name)
            .ok_or_else(|| ServiceError::UnknownPool(name.to_string()))
    }

    /// All pools, in configuration order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.ordered.iter()
    }

    /// Whether every pool is ready, and the `pool/address` of endpoints
    /// that are not in sync.
    pub fn readiness(&self) -> (bool, Vec<String>) {
        let mut not = Vec::new();
        for p in &self.ordered {
            let (_, n) = p.readiness();
            not.extend(n.into_iter().map(|a| format!("{}/{a}", p.name)));
        }
        (not.is_empty(), not)
    }
}

/// The tonic `kvasir.v1.Indexer` service.
#[derive(Debug, Clone)]
pub struct IndexerService {
    pools: Arc<Pools>,
}

impl IndexerService {
    /// A service over `pools`.
    pub fn new(pools: Arc<Pools>) -> Self {
        IndexerService { pools }
    }

    /// The pools.
    pub fn pools(&self) -> &Arc<Pools> {
        &self.pools
    }

    /// `Pick` without gRPC (same code path, for benchmarks and in-process
    /// callers).
    pub async fn pick(&self, req: pb::PickRequest) -> Result<pb::PickResponse, ServiceError> {
        let pool = self.pools.get(&req.pool)?;
        pool.pick(req).await
    }

    /// `Report` without gRPC (the unary RPC and `Session` streams).
    pub fn report(&self, req: &pb::ReportRequest) -> Result<pb::ReportResponse, ServiceError> {
        self.pools.get(&req.pool)?.report(req)
    }
}

#[tonic::async_trait]
impl pb::indexer_server::Indexer for IndexerService {
    async fn pick(
        &self,
        request: tonic::Request<pb::PickRequest>,
    ) -> Result<tonic::Response<pb::PickResponse>, tonic::Status> {
        let req = request.into_inner();
        Ok(tonic::Response::new(IndexerService::pick(self, req).await?))
    }

    async fn report(
        &self,
        request: tonic::Request<pb::ReportRequest>,
    ) -> Result<tonic::Response<pb::ReportResponse>, tonic::Status> {
        let req = request.into_inner();
        Ok(tonic::Response::new(IndexerService::report(self, &req)?))
    }

    async fn pool_state(
        &self,
        request: tonic::Request<pb::PoolStateRequest>,
    ) -> Result<tonic::Response<pb::PoolStateResponse>, tonic::Status> {
        let req = request.into_inner();
        let pool = self.pools.get(&req.pool)?;
        Ok(tonic::Response::new(pool.state()))
    }

    type SessionStream = crate::session::SessionStream;

    async fn session(
        &self,
        request: tonic::Request<tonic::Streaming<pb::SessionRequest>>,
    ) -> Result<tonic::Response<Self::SessionStream>, tonic::Status> {
        Ok(tonic::Response::new(crate::session::serve(
            self.clone(),
            request.into_inner(),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{block_chain, EngineLoad, LoadConfig};

    fn pool_with(n: usize, tokenizer: RequestTokenizer) -> Pool {
        pool_indexed(
            n,
            tokenizer,
            IndexSource::Events,
            DEFAULT_PICK_HISTORY_BLOCKS,
        )
    }

    fn pool_indexed(
        n: usize,
        tokenizer: RequestTokenizer,
        source: IndexSource,
        history_blocks: usize,
    ) -> Pool {
        let pool = Pool::new(
            "p",
            "m",
            4,
            tokenizer,
            LoadTracker::new(LoadConfig::default()),
            Weights::default(),
        )
        .with_index(source, history_blocks);
        let specs = (0..n)
            .map(|i| EndpointSpec {
                address: format!("127.0.0.1:{}", 8000 + i),
                kv_events: format!("tcp://127.0.0.1:{}", 9000 + i),
                replay: None,
                metrics_url: None,
                topic: String::new(),
            })
            .collect();
        pool.set_endpoints(specs, |_| None);
        let now = Instant::now();
        for e in pool.endpoints().iter() {
            pool.load
                .record_scrape(e.id, Some(EngineLoad::default()), now);
        }
        pool
    }

    fn ids_req(id: &str, ids: Vec<u32>) -> pb::PickRequest {
        pb::PickRequest {
            pool: "p".into(),
            request_id: id.into(),
            prompt: Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds { ids })),
            ..Default::default()
        }
    }

    fn store(pool: &Pool, address: &str, ids: &[u32]) {
        let blocks = ids.len() / 4;
        let hashes = (0..blocks as u64)
            .map(|i| EngineHash::U64(1000 + i))
            .collect();
        let batch = stored_batch(hashes, ids[..blocks * 4].to_vec(), 4);
        pool.index.apply(EndpointId::from_address(address), &batch);
        pool.index.flush_blocking();
    }

    #[tokio::test]
    async fn picks_the_endpoint_holding_the_prefix_and_accounts_it() {
        let pool = pool_with(3, RequestTokenizer::Approx);
        let ids: Vec<u32> = (0..40).collect();
        store(&pool, "127.0.0.1:8001", &ids);
        let r = pool.pick(ids_req("r1", ids.clone())).await.unwrap();
        assert_eq!(r.endpoints.len(), 3);
        assert_eq!(r.endpoints[0].address, "127.0.0.1:8001");
        assert_eq!(
            r.endpoints[0].predicted_cached_tokens, 36,
            "last block recomputed"
        );
        assert_eq!(r.reason, "prefix");
        assert_eq!(r.tokenize_mode, "token_ids");
        assert_eq!(r.prompt_tokens, 40);
        let st = pool.state();
        assert_eq!(st.endpoints[1].in_flight, 1);
        assert_eq!(st.endpoints[1].queued_prefill_tokens, 4);
        assert_eq!(st.endpoints[1].indexed_blocks, 10);
        let rep = pool
            .report(&pb::ReportRequest {
                pool: "p".into(),
                request_id: "r1".into(),
                endpoint: "127.0.0.1:8001".into(),
                cached_tokens: 36,
                ..Default::default()
            })
            .unwrap();
        assert!(rep.matched);
        assert_eq!(pool.state().endpoints[1].in_flight, 0);
        assert_eq!(pool.metrics.predicted_cached_tokens.get(), 36);
        assert_eq!(pool.metrics.reported_cached_tokens.get(), 36);
    }

    #[tokio::test]
    async fn bad_requests_are_invalid() {
        let pools = Pools::new(vec![Arc::new(pool_with(1, RequestTokenizer::Approx))]);
        let svc = IndexerService::new(Arc::new(pools));
        let mut r = ids_req("x", vec![1]);
        r.pool = "nope".into();
        assert_eq!(
            svc.pick(r).await.unwrap_err(),
            ServiceError::UnknownPool("nope".into())
        );
        let mut r = ids_req("x", vec![]);
        assert_eq!(
            svc.pick(r.clone()).await.unwrap_err().to_string(),
            "token_ids.ids: must not be empty"
        );
        r.prompt = None;
        assert!(svc
            .pick(r.clone())
            .await
            .unwrap_err()
            .to_string()
            .starts_with("prompt:"));
        r.prompt = Some(pb::pick_request::Prompt::Chat(pb::Chat {
            messages: vec![],
        }));
        assert_eq!(
            svc.pick(r).await.unwrap_err().to_string(),
            "chat.messages: must not be empty"
        );
        let status: tonic::Status = ServiceError::UnknownPool("x".into()).into();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
    }

    #[tokio::test]
    async fn approx_mode_remembers_its_own_picks() {
        let pool = pool_with(4, RequestTokenizer::Approx);
        let chat = |extra: &str| pb::PickRequest {
            pool: "p".into(),
            request_id: format!("r-{extra}"),
            prompt: Some(pb::pick_request::Prompt::Chat(pb::Chat {
                messages: vec![
                    pb::ChatMessage {
                        role: "system".into(),
                        content: "x".repeat(400),
                    },
                    pb::ChatMessage {
                        role: "user".into(),
                        content: extra.into(),
                    },
                ],
            })),
            ..Default::default()
        };
        let first = pool.pick(chat("one")).await.unwrap();
        assert_eq!(first.tokenize_mode, "approx");
        pool.report(&pb::ReportRequest {
            pool: "p".into(),
            request_id: "r-one".into(),
            ..Default::default()
        })
        .unwrap();
        let second = pool.pick(chat("two")).await.unwrap();
        assert_eq!(second.endpoints[0].address, first.endpoints[0].address);
        assert_eq!(second.reason, "prefix");
        assert!(second.endpoints[0].predicted_cached_tokens >= 96);
    }

    #[tokio::test]
    async fn salted_requests_are_not_matched_and_unhealthy_are_skipped() {
        let pool = pool_with(2, RequestTokenizer::Approx);
        let ids: Vec<u32> = (0..40).collect();
        store(&pool, "127.0.0.1:8000", &ids);
        let mut r = ids_req("s", ids);
        r.hints = Some(pb::Hints {
            cache_salt: "tenant-a".into(),
            ..Default::default()
        });
        let out = pool.pick(r).await.unwrap();
        assert_eq!(out.reason, "no_index");
        assert!(out.endpoints.iter().all(|e| e.predicted_cached_tokens == 0));
        let e0 = pool.endpoints()[0].id;
        for _ in 0..3 {
            pool.load.record_scrape(e0, None, Instant::now());
        }
        let out = pool.pick(ids_req("t", vec![1, 2, 3])).await.unwrap();
        assert_eq!(out.endpoints.len(), 1);
        assert_eq!(out.endpoints[0].address, "127.0.0.1:8001");
    }

    #[tokio::test]
    async fn render_failure_picks_by_load() {
        let tokenizer = RequestTokenizer::Render {
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
            model: "m".into(),
            timeout: std::time::Duration::from_millis(200),
        };
        let pool = Pool::new(
            "p",
            "m",
            4,
            tokenizer,
            LoadTracker::new(LoadConfig::default()),
            Weights::default(),
        );
        // Nothing listens on port 1: the render call is refused.
        let spec = EndpointSpec {
            address: "127.0.0.1:1".into(),
            kv_events: "tcp://127.0.0.1:2".into(),
            replay: None,
            metrics_url: None,
            topic: String::new(),
        };
        pool.set_endpoints(vec![spec], |_| None);
        let id = pool.endpoints()[0].id;
        pool.load
            .record_scrape(id, Some(EngineLoad::default()), Instant::now());
        let req = pb::PickRequest {
            pool: "p".into(),
            prompt: Some(pb::pick_request::Prompt::Text("hello".into())),
            ..Default::default()
        };
        let out = pool.pick(req).await.unwrap();
        assert_eq!(out.reason, "no_index");
        assert_eq!(out.endpoints[0].address, "127.0.0.1:1");
        assert_eq!(pool.metrics.tokenize_failures.get(), 1);
    }

    fn done(pool: &Pool, id: &str) {
        pool.report(&pb::ReportRequest {
            pool: "p".into(),
            request_id: id.into(),
            ..Default::default()
        })
        .unwrap();
    }

    /// Token ids: a shared head of `shared` tokens, then a tail unique to
    /// `n`.
    fn prompt(shared: u32, tail: u32, n: u32) -> Vec<u32> {
        (0..shared)
            .chain((0..tail).map(|i| 1_000_000 * (n + 1) + i))
            .collect()
    }

    #[tokio::test]
    async fn picks_mode_sends_a_shared_prefix_where_it_went() {
        // Token ids bypass the tokenizer; with index picks they are matched
        // against the history whatever the pool's tokenize mode.
        let render = RequestTokenizer::Render {
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
            model: "m".into(),
            timeout: std::time::Duration::from_millis(200),
        };
        for tokenizer in [RequestTokenizer::Approx, render] {
            let pool = pool_indexed(3, tokenizer, IndexSource::Picks, 10_000);
            assert!(!pool.wants_events());
            assert_eq!(pool.readiness(), (true, Vec::new()));
            // The KV-event index says 8002 holds the prompt: ignored.
            let first_ids = prompt(2000, 40, 1);
            store(&pool, "127.0.0.1:8002", &first_ids);
            let first = pool.pick(ids_req("r1", first_ids.clone())).await.unwrap();
            assert_eq!(first.reason, "load", "nothing in the history yet");
            assert!(first
                .endpoints
                .iter()
                .all(|e| e.predicted_cached_tokens == 0));
            let home = first.endpoints[0].address.clone();
            let home_id = EndpointId::from_address(&home);
            assert_eq!(pool.history_blocks(home_id), Some(510));
            assert_eq!(
                pool.state()
                    .endpoints
                    .iter()
                    .find(|e| e.address == home)
                    .unwrap()
                    .indexed_blocks,
                510,
                "PoolState shows the history with index picks"
            );
            done(&pool, "r1");

            // Same 2000-token head, other tail: goes home, predicted from
            // the history.
            let second_ids = prompt(2000, 60, 2);
            let second = pool.pick(ids_req("r2", second_ids.clone())).await.unwrap();
            assert_eq!(second.reason, "prefix");
            assert_eq!(second.endpoints[0].address, home);
            assert_eq!(second.endpoints[0].predicted_cached_tokens, 2000);
            assert!(second.endpoints[1..]
                .iter()
                .all(|e| e.predicted_cached_tokens == 0));
            assert_eq!(pool.history_blocks(home_id), Some(525), "15 new blocks");
            // No pending-prefill matching with index picks: r2 (still in
            // prefill) left no chain in the load tracker.
            let chain = block_chain(&second_ids, 4);
            let ids: Vec<EndpointId> = pool.endpoints().iter().map(|e| e.id).collect();
            let views = pool
                .load
                .views_matching(ids.iter().copied(), Instant::now(), Some(&chain));
            assert!(views.iter().all(|v| v.pending_matched_blocks == 0));
            assert_eq!(
                pool.state()
                    .endpoints
                    .iter()
                    .map(|e| e.in_flight)
                    .sum::<u32>(),
                1
            );

            // A salted request is neither matched nor recorded.
            let mut salted = ids_req("s", prompt(2000, 80, 3));
            salted.hints = Some(pb::Hints {
                cache_salt: "t".into(),
                ..Default::default()
            });
            let out = pool.pick(salted).await.unwrap();
            assert_eq!(out.reason, "no_index");
            let total: usize = ids.iter().filter_map(|id| pool.history_blocks(*id)).sum();
            assert_eq!(total, 525);

            // An endpoint that went away forgets its history.
            pool.clear_endpoint(home_id);
            assert_eq!(pool.history_blocks(home_id), Some(0));
        }
    }

    #[tokio::test]
    async fn events_mode_keeps_pending_prefill_matching() {
        let pool = pool_with(2, RequestTokenizer::Approx);
        assert!(pool.wants_events());
        let first = pool.pick(ids_req("r1", prompt(400, 8, 1))).await.unwrap();
        let home = EndpointId::from_address(&first.endpoints[0].address);
        let chain = block_chain(&prompt(400, 8, 2), 4);
        let views = pool
            .load
            .views_matching([home], Instant::now(), Some(&chain));
        assert_eq!(
            views[0].pending_matched_blocks, 100,
            "r1 is in prefill there"
        );
        assert_eq!(
            pool.history_blocks(home),
            Some(0),
            "token ids use the events, not the approx history"
        );
    }

    #[tokio::test]
    async fn picks_mode_history_is_bounded_and_evicts_the_oldest() {
        // One endpoint, 20 blocks of history; prompts of 10 blocks.
        let pool = pool_indexed(1, RequestTokenizer::Approx, IndexSource::Picks, 20);
        let id = pool.endpoints()[0].id;
        let p = |n: u32| prompt(0, 40, n);
        for n in 1..=3 {
            let r = pool.pick(ids_req(&format!("r{n}"), p(n))).await.unwrap();
            assert_eq!(r.reason, "load");
            done(&pool, &format!("r{n}"));
            assert!(pool.history_blocks(id).unwrap() <= 20, "capacity respected");
        }
        assert_eq!(pool.history_blocks(id), Some(20));
        assert_eq!(pool.state().endpoints[0].indexed_blocks, 20);
        // Newest first: p(3) and p(2) are held (all but the last block is
        // predicted: vLLM recomputes it), p(1) was evicted.
        let r = pool.pick(ids_req("a", p(3))).await.unwrap();
        assert_eq!(
            (r.reason.as_str(), r.endpoints[0].predicted_cached_tokens),
            ("prefix", 36)
        );
        let r = pool.pick(ids_req("b", p(2))).await.unwrap();
        assert_eq!(
            (r.reason.as_str(), r.endpoints[0].predicted_cached_tokens),
            ("prefix", 36)
        );
        let r = pool.pick(ids_req("c", p(1))).await.unwrap();
        assert_eq!(
            (r.reason.as_str(), r.endpoints[0].predicted_cached_tokens),
            ("load", 0)
        );
        // Picking p(1) recorded it again: now p(3), the least recently
        // picked, is the one gone.
        assert_eq!(pool.history_blocks(id), Some(20));
        let r = pool.pick(ids_req("d", p(3))).await.unwrap();
        assert_eq!(r.endpoints[0].predicted_cached_tokens, 0);
    }

    #[test]
    fn set_endpoints_diffs() {
        let pool = pool_with(2, RequestTokenizer::Approx);
        let mut specs: Vec<EndpointSpec> =
            pool.endpoints().iter().map(|e| e.spec.clone()).collect();
        specs.remove(0);
        specs.push(EndpointSpec {
            address: "127.0.0.1:9999".into(),
            kv_events: "tcp://127.0.0.1:1".into(),
            replay: None,
            metrics_url: None,
            topic: String::new(),
        });
        let ch = pool.set_endpoints(specs, |_| None);
        assert_eq!(ch.added, vec!["127.0.0.1:9999".to_string()]);
        assert_eq!(ch.removed, vec!["127.0.0.1:8000".to_string()]);
        let st = pool.state();
        assert_eq!(st.endpoints.len(), 2);
        assert!(st.endpoints[0].healthy, "kept endpoint keeps its state");
        assert!(!st.endpoints[1].healthy, "new endpoint waits for a scrape");
    }
}
