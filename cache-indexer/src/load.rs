//! Load tracking: what each engine says about itself (scraped from vLLM's
//! `/metrics`) and what this indexer has sent it (in-flight picks).
//!
//! * **Scrapes.** Every interval each endpoint's `/metrics` is fetched with a
//!   timeout and `vllm:num_requests_running`, `vllm:num_requests_waiting` and
//!   `vllm:kv_cache_usage_perc` are read (summed over series for the two
//!   counts, averaged for KV usage: a data-parallel engine exposes one series
//!   per rank, and its HTTP server balances across them). An endpoint is
//!   healthy from its first successful scrape and unhealthy after
//!   `unhealthyAfter` failures in a row; it has to be scraped once before it
//!   is picked at all, so a freshly added endpoint joins within one interval.
//! * **In flight.** A pick with a request id adds the request to its
//!   endpoint, with the prefill tokens it is expected to compute; a
//!   FIRST_TOKEN report ends its prefill part, a DONE report (or the
//!   in-flight timeout, for lost reports) removes it. The prefill part also
//!   lapses after the prefill horizon, so filters that only report DONE do not
//!   make long streams look like queued prefill forever.
//! * **Saturation.** Per endpoint, `max(kv_usage / kvUsage, waiting /
//!   waiting)` capped at 1; saturated at 1, i.e. when KV usage or the waiting
//!   queue reaches its threshold. Only *KV-full* endpoints (usage at
//!   `kvUsage`) are left out of picks; a long waiting queue is priced by the
//!   scorer's queue terms instead (see `scoring`), unless `leaveOutQueued`
//!   asks for the old rule (every saturated endpoint left out). Pool saturation is the
//!   **mean** over healthy endpoints (1 when none is healthy): the fraction of
//!   the pool's headroom in use, which is what an admission policy wants; the
//!   minimum would report a pool with one idle endpoint as empty.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::types::EndpointId;

/// When an endpoint counts as saturated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct SaturationThresholds {
    /// KV-cache usage (0..1] at which an endpoint is saturated. vLLM's usage
    /// counts blocks pinned by running requests (cached free blocks are not
    /// usage), so above ~90% admitting more work means preempting some.
    #[serde(alias = "kv_usage")]
    pub kv_usage: f64,
    /// Waiting requests at which an endpoint is saturated. vLLM queues only
    /// when it is out of batch slots or KV space; five queued prefills is
    /// already a few hundred ms of extra TTFT for everyone behind them.
    pub waiting: u32,
    /// Leave endpoints saturated by their waiting queue alone out of picks
    /// too (as KV-full ones always are), instead of ranking them at their
    /// cost. Off by default; see the scoring module docs for the A/B that
    /// keeps this a setting.
    pub leave_out_queued: bool,
}

impl Default for SaturationThresholds {
    fn default() -> Self {
        SaturationThresholds {
            kv_usage: 0.9,
            waiting: 5,
            leave_out_queued: false,
        }
    }
}

impl SaturationThresholds {
    /// Checks ranges; on error, the field name and what is wrong.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.kv_usage > 0.0 && self.kv_usage <= 1.0) {
            return Err((
                "kvUsage",
                format!("must be in (0, 1], got {}", self.kv_usage),
            ));
        }
        if self.waiting == 0 {
            return Err(("waiting", "must be at least 1".into()));
        }
        Ok(())
    }

    /// Saturation 0..1 of an engine state.
    pub fn saturation(&self, load: &EngineLoad) -> f64 {
        let kv = load.kv_usage / self.kv_usage;
        let q = f64::from(load.waiting) / f64::from(self.waiting);
        kv.max(q).clamp(0.0, 1.0)
    }

    /// Whether KV usage is at the threshold: admitting more work there means
    /// preempting running sequences.
    pub fn kv_full(&self, load: &EngineLoad) -> bool {
        load.kv_usage >= self.kv_usage
    }

    /// Whether picks leave the endpoint out (unless every healthy one is
    /// left out): KV-full, or saturated at all with `leave_out_queued`.
    pub fn leaves_out(&self, load: &EngineLoad) -> bool {
        self.kv_full(load) || (self.leave_out_queued && self.saturation(load) >= 1.0)
    }
}

/// What one scrape said.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineLoad {
    /// `vllm:num_requests_running` (summed over series).
    pub running: u32,
    /// `vllm:num_requests_waiting` (summed).
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc` (mean over series), 0..1.
    pub kv_usage: f64,
}

/// Why a metrics page could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetricsParseError {
    /// A line is not Prometheus text format.
    #[error("line {line}: {reason}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A metric the indexer needs is not there.
    #[error("no {0} in the metrics (is this a vLLM /metrics URL?)")]
    Missing(&'static str),
}

/// One sample of a Prometheus text page.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Metric name.
    pub name: &'a str,
    /// Labels, unescaped.
    pub labels: Vec<(&'a str, String)>,
    /// Value.
    pub value: f64,
}

/// Parses one sample line (`name{a="b",...} value [timestamp]`).
pub fn parse_sample(line: &str) -> Result<Sample<'_>, String> {
    let line = line.trim();
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .ok_or("no value")?;
    let name = &line[..name_end];
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    {
        return Err(format!("bad metric name `{name}`"));
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        rest = r;
        loop {
            rest = rest.trim_start();
            if let Some(r) = rest.strip_prefix('}') {
                rest = r;
                break;
            }
            let eq = rest.find('=').ok_or("label without =")?;
            let key = rest[..eq].trim();
            rest = rest[eq + 1..].trim_start();
            rest = rest.strip_prefix('"').ok_or("label value not quoted")?;
            let mut value = String::new();
            let mut chars = rest.char_indices();
            let end = loop {
                match chars.next() {
                    None => return Err("unterminated label value".into()),
                    Some((i, '"')) => break i,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => return Err("unterminated escape".into()),
                    },
                    Some((_, c)) => value.push(c),
                }
            };
            labels.push((key, value));
            rest = rest[end + 1..].trim_start();
            if let Some(r) = rest.strip_prefix(',') {
                rest = r;
            }
        }
    }
    let mut parts = rest.split_whitespace();
    let v = parts.next().ok_or("no value")?;
    let value = match v {
        "NaN" => f64::NAN,
        "+Inf" | "Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse::<f64>().map_err(|_| format!("bad value `{v}`"))?,
    };
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// Reads the three load metrics from a vLLM `/metrics` page. Comment
/// lines, unknown metrics and (for robustness against exotic exporters)
/// unparsable lines of *other* metrics are ignored; a malformed line of one
/// of the three is an error. The pre-0.10 name `vllm:gpu_cache_usage_perc`
/// is accepted when the new one is absent.
pub fn parse_vllm_metrics(text: &str) -> Result<EngineLoad, MetricsParseError> {
    const RUNNING: &str = "vllm:num_requests_running";
    const WAITING: &str = "vllm:num_requests_waiting";
    const KV: &str = "vllm:kv_cache_usage_perc";
    const KV_OLD: &str = "vllm:gpu_cache_usage_perc";
    let (mut running, mut waiting) = (None::<f64>, None::<f64>);
    let (mut kv_sum, mut kv_n, mut old_sum, mut old_n) = (0.0, 0u32, 0.0, 0u32);
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let ours = [RUNNING, WAITING, KV, KV_OLD].iter().any(|m| {
            t.strip_prefix(m)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(char::is_whitespace))
        });
        if !ours {
            continue;
        }
        let s = parse_sample(t).map_err(|reason| MetricsParseError::Syntax {
            line: i + 1,
            reason,
        })?;
        if !s.value.is_finite() {
            continue;
        }
        match s.name {
            RUNNING => *running.get_or_insert(0.0) += s.value,
            WAITING => *waiting.get_or_insert(0.0) += s.value,
            KV => {
                kv_sum += s.value;
                kv_n += 1;
            }
            _ => {
                old_sum += s.value;
                old_n += 1;
            }
        }
    }
    let running = running.ok_or(MetricsParseError::Missing(RUNNING))?;
    let waiting = waiting.ok_or(MetricsParseError::Missing(WAITING))?;
    let kv_usage = match (kv_n, old_n) {
        (0, 0) => return Err(MetricsParseError::Missing(KV)),
        (0, n) => old_sum / f64::from(n),
        (n, _) => kv_sum / f64::from(n),
    };
    let count = |v: f64| v.max(0.0).round().min(f64::from(u32::MAX)) as u32;
    Ok(EngineLoad {
        running: count(running),
        waiting: count(waiting),
        kv_usage: kv_usage.clamp(0.0, 1.0),
    })
}

/// Settings of a [`LoadTracker`].
#[derive(Debug, Clone, PartialEq)]
pub struct LoadConfig {
    /// Failed scrapes in a row before unhealthy.
    pub unhealthy_after: u32,
    /// Lost-report timeout of an in-flight pick.
    pub in_flight_timeout: Duration,
    /// Longest a pick's prefill counts as queued.
    pub prefill_horizon: Duration,
    /// Saturation thresholds.
    pub saturation: SaturationThresholds,
    /// A pick with no report at all (no FIRST_TOKEN, no DONE) is dropped
    /// after this long: a pick no request followed is never reported.
    /// 60 s by default: twice the prefill horizon, so a real request queued
    /// before its first token keeps its entry; a non-streamed one (whose
    /// first byte is its whole answer) may lose it earlier, which the
    /// engine's own scraped `running` count covers.
    pub unconfirmed_timeout: Duration,
    /// Unconfirmed picks accounted per endpoint; past it a pick is answered
    /// but adds no load. 64 by default: that many requests without a first
    /// token is a deep queue (saturation counts 5 waiting as full), which
    /// the engine's scraped `waiting` shows by the next scrape anyway.
    pub max_unconfirmed_per_endpoint: u32,
    /// In-flight picks tracked per pool (a memory bound on the table).
    pub max_tracked: usize,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            unhealthy_after: 3,
            in_flight_timeout: Duration::from_secs(300),
            prefill_horizon: Duration::from_secs(30),
            saturation: SaturationThresholds::default(),
            unconfirmed_timeout: Duration::from_secs(60),
            max_unconfirmed_per_endpoint: 64,
            max_tracked: 65_536,
        }
    }
}

/// One endpoint's load as the picker and `PoolState` see it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadView {
    /// Last successful scrape (zeros before the first).
    pub engine: EngineLoad,
    /// Whether the endpoint is healthy.
    pub healthy: bool,
    /// In-flight picks.
    pub in_flight: u32,
    /// Queued prefill tokens of in-flight picks.
    pub queued_prefill_tokens: u64,
    /// Saturation 0..1 (1 when unhealthy).
    pub saturation: f64,
    /// Whether saturated.
    pub saturated: bool,
    /// Whether picks leave it out ([`SaturationThresholds::leaves_out`]);
    /// implies `saturated`.
    pub left_out: bool,
    /// Time since the last successful scrape.
    pub last_scrape_age: Option<Duration>,
    /// Failed scrapes since start.
    pub scrape_failures: u64,
    /// Failed scrapes in a row now.
    pub failures_in_row: u32,
    /// Leading blocks of the request (see [`LoadTracker::views_matching`])
    /// that an in-flight pick to this endpoint, still in prefill, shares:
    /// blocks the engine is computing and will hold by the time this request
    /// runs, though its KV events have not said so yet.
    pub pending_matched_blocks: usize,
}

/// Prompts in prefill remembered per endpoint for
/// [`LoadView::pending_matched_blocks`]; older ones are forgotten first.
pub const MAX_PENDING_PREFIXES: usize = 64;

#[derive(Debug, Default)]
struct EndpointLoad {
    engine: EngineLoad,
    last_ok: Option<Instant>,
    failures_in_row: u32,
    scrape_failures: u64,
    healthy: bool,
    in_flight: u32,
    /// In-flight picks not reported yet (bounded by the config).
    unconfirmed: u32,
    queued_prefill: u64,
    /// (pick seq, block chain) of picks in prefill, oldest first.
    pending: std::collections::VecDeque<(u64, Arc<[u64]>)>,
}

impl EndpointLoad {
    /// Remembers pick `seq`'s chain while it is in prefill, forgetting the
    /// oldest past [`MAX_PENDING_PREFIXES`].
    fn remember_pending(&mut self, seq: u64, chain: Arc<[u64]>) {
        if self.pending.len() >= MAX_PENDING_PREFIXES {
            self.pending.pop_front();
        }
        self.pending.push_back((seq, chain));
    }
}

#[derive(Debug, Clone)]
struct InFlight {
    seq: u64,
    endpoint: EndpointId,
    predicted_cached: u32,
    prefill_tokens: u64,
    prefill_pending: bool,
    /// Some report (FIRST_TOKEN or DONE) came for it.
    confirmed: bool,
    picked_at: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    endpoints: HashMap<EndpointId, EndpointLoad>,
    in_flight: HashMap<String, InFlight>,
    next_seq: u64,
    bounds: BoundStats,
}

/// What the bounds on unreported picks did (see [`LoadConfig`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BoundStats {
    /// Picks not accounted: their endpoint had its unconfirmed cap.
    pub capped_endpoint: u64,
    /// Picks not accounted: the pool tracked its most picks.
    pub capped_pool: u64,
    /// Picks dropped by the unconfirmed timeout.
    pub unconfirmed_expired: u64,
    /// Unconfirmed picks now.
    pub unconfirmed: u64,
}

/// How [`LoadTracker::record_pick`] accounted a pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accounting {
    /// In flight on its endpoint.
    Accounted,
    /// Not accounted: no request id, or an unknown endpoint.
    Ignored,
    /// Not accounted: the endpoint has its most unconfirmed picks.
    EndpointCap,
    /// Not accounted: the pool tracks its most picks.
    PoolCap,
}

/// Result of a [`LoadTracker::report`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportMatch {
    /// The request id was in flight.
    pub matched: bool,
    /// The endpoint it had been picked for.
    pub endpoint: Option<EndpointId>,
    /// The cached tokens predicted at pick time.
    pub predicted_cached: Option<u32>,
}

/// Which part of a request's life a report ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Prefill is over.
    FirstToken,
    /// The request is over.
    Done,
}

/// Load and in-flight state of one pool's endpoints. `Send + Sync`; all
/// methods take one short lock.
#[derive(Debug, Default)]
pub struct LoadTracker {
    cfg: LoadConfig,
    inner: Arc<Mutex<Inner>>,
}

/// A handle on the tracker's in-flight picks that outlives a borrow of it:
/// a pick whose prompt was tokenized only as far as its cached prefix gets
/// its whole block chain later, off the pick's path
/// ([`PendingChains::complete`]).
#[derive(Clone)]
pub struct PendingChains {
    inner: Arc<Mutex<Inner>>,
}

impl std::fmt::Debug for PendingChains {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingChains").finish_non_exhaustive()
    }
}

impl PendingChains {
    /// Gives `request_id`'s pick its whole chain, if the pick is still in
    /// prefill (else there is nothing to match against any more). Returns
    /// whether it did.
    pub fn complete(&self, request_id: &str, chain: Arc<[u64]>) -> bool {
        if chain.is_empty() {
            return false;
        }
        let mut g = self.inner.lock();
        let Inner {
            endpoints,
            in_flight,
            ..
        } = &mut *g;
        let Some(f) = in_flight.get(request_id).filter(|f| f.prefill_pending) else {
            return false;
        };
        let Some(e) = endpoints.get_mut(&f.endpoint) else {
            return false;
        };
        match e.pending.iter_mut().find(|(s, _)| *s == f.seq) {
            Some(entry) => entry.1 = chain,
            None => e.remember_pending(f.seq, chain),
        }
        true
    }
}

impl LoadTracker {
    /// An empty tracker.
    pub fn new(cfg: LoadConfig) -> Self {
        LoadTracker {
            cfg,
            inner: Arc::new(Mutex::new(Inner::default())),
        }
    }

    /// A handle for completing picks' chains later.
    pub fn pending_chains(&self) -> PendingChains {
        PendingChains {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Whether some pick still in prefill has a prompt starting with the
    /// whole of `chain` (chained hashes: equal last entries mean equal
    /// prefixes).
    pub fn pending_holds(&self, chain: &[u64]) -> bool {
        let Some(last) = chain.last() else {
            return true;
        };
        let i = chain.len() - 1;
        self.inner.lock().endpoints.values().any(|e| {
            e.pending
                .iter()
                .any(|(_, p)| p.get(i).is_some_and(|h| h == last))
        })
    }

    /// The settings.
    pub fn config(&self) -> &LoadConfig {
        &self.cfg
    }

    /// Starts tracking an endpoint (unhealthy until its first scrape).
    pub fn add_endpoint(&self, id: EndpointId) {
        self.inner.lock().endpoints.entry(id).or_default();
    }

    /// Stops tracking an endpoint and forgets its in-flight picks.
    pub fn remove_endpoint(&self, id: EndpointId) {
        let mut g = self.inner.lock();
        g.endpoints.remove(&id);
        g.in_flight.retain(|_, f| f.endpoint != id);
    }

    /// Records a scrape result (`None`: the scrape failed).
    pub fn record_scrape(&self, id: EndpointId, result: Option<EngineLoad>, now: Instant) {
        let mut g = self.inner.lock();
        let Some(e) = g.endpoints.get_mut(&id) else {
            return;
        };
        match result {
            Some(load) => {
                e.engine = load;
                e.last_ok = Some(now);
                e.failures_in_row = 0;
                e.healthy = true;
            }
            None => {
                e.failures_in_row = e.failures_in_row.saturating_add(1);
                e.scrape_failures += 1;
                if e.failures_in_row >= self.cfg.unhealthy_after {
                    e.healthy = false;
                }
            }
        }
    }

    /// Accounts a pick: `request_id` goes to `endpoint` with `prefill_tokens`
    /// to compute and `predicted_cached` tokens expected cached (kept to
    /// compare with the report). `chain` (see [`block_chain`]) is the
    /// request's prompt, remembered while it is in prefill so that requests
    /// sharing its prefix see it as about to be cached there. An empty id is
    /// not accounted (nothing could report it). Picking an id again (a
    /// retry) moves it. Past the unconfirmed cap of the endpoint or the
    /// pool's tracking cap the pick is not accounted (and counted).
    pub fn record_pick(
        &self,
        request_id: &str,
        endpoint: EndpointId,
        prefill_tokens: u64,
        predicted_cached: u32,
        chain: Option<Arc<[u64]>>,
        now: Instant,
    ) -> Accounting {
        if request_id.is_empty() {
            return Accounting::Ignored;
        }
        let mut g = self.inner.lock();
        let Inner {
            endpoints,
            in_flight,
            next_seq,
            bounds,
        } = &mut *g;
        if let Some(old) = in_flight.remove(request_id) {
            release(endpoints, &old, true);
        }
        let Some(e) = endpoints.get_mut(&endpoint) else {
            return Accounting::Ignored;
        };
        if e.unconfirmed >= self.cfg.max_unconfirmed_per_endpoint {
            bounds.capped_endpoint += 1;
            return Accounting::EndpointCap;
        }
        if in_flight.len() >= self.cfg.max_tracked {
            bounds.capped_pool += 1;
            return Accounting::PoolCap;
        }
        let seq = *next_seq;
        *next_seq += 1;
        e.in_flight += 1;
        e.unconfirmed += 1;
        e.queued_prefill += prefill_tokens;
        if let Some(chain) = chain.filter(|c| !c.is_empty()) {
            e.remember_pending(seq, chain);
        }
        in_flight.insert(
            request_id.to_string(),
            InFlight {
                seq,
                endpoint,
                predicted_cached,
                prefill_tokens,
                prefill_pending: true,
                confirmed: false,
                picked_at: now,
            },
        );
        Accounting::Accounted
    }

    /// What the bounds on unreported picks did so far.
    pub fn bound_stats(&self) -> BoundStats {
        let g = self.inner.lock();
        BoundStats {
            unconfirmed: g.endpoints.values().map(|e| u64::from(e.unconfirmed)).sum(),
            ..g.bounds
        }
    }

    /// Accounts a report. Unknown ids (never picked, already done, expired)
    /// are harmless and come back unmatched.
    pub fn report(&self, request_id: &str, phase: Phase) -> ReportMatch {
        let mut g = self.inner.lock();
        let Inner {
            endpoints,
            in_flight,
            ..
        } = &mut *g;
        let unmatched = ReportMatch {
            matched: false,
            endpoint: None,
            predicted_cached: None,
        };
        match phase {
            Phase::Done => match in_flight.remove(request_id) {
                Some(f) => {
                    release(endpoints, &f, true);
                    ReportMatch {
                        matched: true,
                        endpoint: Some(f.endpoint),
                        predicted_cached: Some(f.predicted_cached),
                    }
                }
                None => unmatched,
            },
            Phase::FirstToken => match in_flight.get_mut(request_id) {
                Some(f) => {
                    confirm(endpoints, f);
                    if f.prefill_pending {
                        release(endpoints, f, false);
                        f.prefill_pending = false;
                    }
                    ReportMatch {
                        matched: true,
                        endpoint: Some(f.endpoint),
                        predicted_cached: Some(f.predicted_cached),
                    }
                }
                None => unmatched,
            },
        }
    }

    /// Expires in-flight picks past the timeout and prefill parts past the
    /// horizon; returns how many picks expired.
    pub fn sweep(&self, now: Instant) -> usize {
        let mut g = self.inner.lock();
        let Inner {
            endpoints,
            in_flight,
            bounds,
            ..
        } = &mut *g;
        let mut expired = 0;
        in_flight.retain(|_, f| {
            let age = now.saturating_duration_since(f.picked_at);
            let unconfirmed = !f.confirmed && age >= self.cfg.unconfirmed_timeout;
            if age >= self.cfg.in_flight_timeout || unconfirmed {
                bounds.unconfirmed_expired += u64::from(unconfirmed);
                release(endpoints, f, true);
                expired += 1;
                return false;
            }
            if f.prefill_pending && age >= self.cfg.prefill_horizon {
                release(endpoints, f, false);
                f.prefill_pending = false;
            }
            true
        });
        expired
    }

    fn view_of(&self, e: &EndpointLoad, now: Instant, chain: Option<&[u64]>) -> LoadView {
        let pending_matched_blocks = chain.map_or(0, |c| {
            e.pending
                .iter()
                .map(|(_, p)| common_prefix(c, p))
                .max()
                .unwrap_or(0)
        });
        let saturation = if e.healthy {
            self.cfg.saturation.saturation(&e.engine)
        } else {
            1.0
        };
        LoadView {
            engine: e.engine,
            healthy: e.healthy,
            in_flight: e.in_flight,
            queued_prefill_tokens: e.queued_prefill,
            saturation,
            saturated: e.healthy && saturation >= 1.0,
            left_out: e.healthy && self.cfg.saturation.leaves_out(&e.engine),
            last_scrape_age: e.last_ok.map(|t| now.saturating_duration_since(t)),
            scrape_failures: e.scrape_failures,
            failures_in_row: e.failures_in_row,
            pending_matched_blocks,
        }
    }

    /// Views of `ids`, in order (a default, unhealthy view for unknown ids).
    pub fn views(&self, ids: impl IntoIterator<Item = EndpointId>, now: Instant) -> Vec<LoadView> {
        self.views_matching(ids, now, None)
    }

    /// Like [`LoadTracker::views`], also matching a request's block chain
    /// against each endpoint's picks in prefill
    /// ([`LoadView::pending_matched_blocks`]).
    pub fn views_matching(
        &self,
        ids: impl IntoIterator<Item = EndpointId>,
        now: Instant,
        chain: Option<&[u64]>,
    ) -> Vec<LoadView> {
        let g = self.inner.lock();
        ids.into_iter()
            .map(|id| match g.endpoints.get(&id) {
                Some(e) => self.view_of(e, now, chain),
                None => LoadView {
                    saturation: 1.0,
                    ..Default::default()
                },
            })
            .collect()
    }

    /// Number of in-flight picks in the pool.
    pub fn in_flight_total(&self) -> usize {
        self.inner.lock().in_flight.len()
    }
}

/// Pool saturation from endpoint views: the mean over healthy endpoints, 1
/// when none is healthy.
pub fn pool_saturation(views: &[LoadView]) -> f64 {
    let healthy: Vec<f64> = views
        .iter()
        .filter(|v| v.healthy)
        .map(|v| v.saturation)
        .collect();
    if healthy.is_empty() {
        1.0
    } else {
        healthy.iter().sum::<f64>() / healthy.len() as f64
    }
}

/// Ends `f`'s prefill part (if still pending) and, when `whole`, its
/// in-flight count.
fn release(endpoints: &mut HashMap<EndpointId, EndpointLoad>, f: &InFlight, whole: bool) {
    if let Some(e) = endpoints.get_mut(&f.endpoint) {
        if f.prefill_pending {
            e.queued_prefill = e.queued_prefill.saturating_sub(f.prefill_tokens);
            if let Some(pos) = e.pending.iter().position(|(s, _)| *s == f.seq) {
                e.pending.remove(pos);
            }
        }
        if whole {
            e.in_flight = e.in_flight.saturating_sub(1);
            if !f.confirmed {
                e.unconfirmed = e.unconfirmed.saturating_sub(1);
            }
        }
    }
}

/// Marks `f` reported (once), freeing its place under the unconfirmed cap.
fn confirm(endpoints: &mut HashMap<EndpointId, EndpointLoad>, f: &mut InFlight) {
    if !f.confirmed {
        f.confirmed = true;
        if let Some(e) = endpoints.get_mut(&f.endpoint) {
            e.unconfirmed = e.unconfirmed.saturating_sub(1);
        }
    }
}

/// The chained hashes of a prompt's full blocks: entry `i` identifies the
/// whole prefix up to block `i`, so two chains agree exactly on their
/// common prefix. (Private to the indexer; the engines' hashes are never
/// reproduced.)
pub fn block_chain(tokens: &[u32], block_size: u32) -> Vec<u64> {
    let mut chain = Vec::with_capacity(tokens.len() / block_size.max(1) as usize);
    extend_block_chain(&mut chain, tokens, block_size);
    chain
}

/// Extends `chain`, the [`block_chain`] of a prefix of `tokens`, to the
/// full blocks of `tokens`: only the new blocks are hashed.
pub fn extend_block_chain(chain: &mut Vec<u64>, tokens: &[u32], block_size: u32) {
    let bs = block_size.max(1) as usize;
    let mut h = chain.last().copied().unwrap_or(0);
    // One-shot over the block's little-endian bytes: the same value as
    // feeding the tokens to a streaming hasher one by one, at a fraction of
    // the per-call cost.
    let mut bytes = Vec::with_capacity(bs * 4);
    let done = chain.len() * bs;
    let Some(rest) = tokens.get(done..) else {
        return;
    };
    chain.extend(rest.chunks_exact(bs).map(|block| {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        h = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, h);
        h
    }));
}

/// Length of the common prefix of two block chains. Chains agree on a
/// prefix and differ after it, so a binary search finds the end.
pub fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let (mut lo, mut hi) = (0usize, a.len().min(b.len()));
    // Invariant: a[..lo] == b[..lo]; a[..hi+1] != b[..hi+1] past hi.
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if a[mid - 1] == b[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Why one scrape failed (logged at debug, counted in metrics).
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// Connection, timeout, or a non-2xx status.
    #[error("GET {url}: {message}")]
    Http {
        /// The metrics URL.
        url: String,
        /// What happened.
        message: String,
    },
    /// The page is not usable.
    #[error("GET {url}: {source}")]
    Parse {
        /// The metrics URL.
        url: String,
        /// Why.
        #[source]
        source: MetricsParseError,
    },
}

/// Fetches and parses one endpoint's metrics.
pub async fn scrape(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<EngineLoad, ScrapeError> {
    let http = |message: String| ScrapeError::Http {
        url: url.to_string(),
        message,
    };
    let resp = client
        .get(url)
        .timeout(timeout)
        .send()
        .await
        .map_err(|e| http(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(http(format!("status {}", resp.status())));
    }
    let text = resp.text().await.map_err(|e| http(e.to_string()))?;
    parse_vllm_metrics(&text).map_err(|source| ScrapeError::Parse {
        url: url.to_string(),
        source,
    })
}

/// Scrapes every target concurrently and records the results; returns the
/// failures (already counted in the tracker).
pub async fn scrape_all(
    tracker: &LoadTracker,
    client: &reqwest::Client,
    targets: &[(EndpointId, String)],
    timeout: Duration,
) -> Vec<(EndpointId, ScrapeError)> {
    let results = futures::future::join_all(
        targets
            .iter()
            .map(|(id, url)| async move { (*id, scrape(client, url, timeout).await) }),
    )
    .await;
    let now = Instant::now();
    let mut failures = Vec::new();
    for (id, r) in results {
        match r {
            Ok(load) => tracker.record_scrape(id, Some(load), now),
            Err(e) => {
                tracker.record_scrape(id, None, now);
                failures.push((id, e));
            }
        }
    }
    failures
}

#[cfg(test)]
#[path = "load_bounds_tests.rs"]
mod bounds_tests;

/// A tracker with `cfg` and two endpoints (1 and 2), for the tests.
#[cfg(test)]
fn two_endpoints(cfg: LoadConfig) -> (LoadTracker, EndpointId, EndpointId, Instant) {
    let t = LoadTracker::new(cfg);
    let (a, b) = (EndpointId(1), EndpointId(2));
    t.add_endpoint(a);
    t.add_endpoint(b);
    (t, a, b, Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 1.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.25
vllm:num_requests_running_total_weird{x="y"} 100
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 7
vllm:cache_config_info{block_size="16",weird="a\"b,c}d"} 1 1700000000000
"#;

    #[test]
    fn parses_vllm_page() {
        let l = parse_vllm_metrics(VLLM).unwrap();
        assert_eq!(l.running, 5);
        assert_eq!(l.waiting, 1);
        assert!((l.kv_usage - 0.375).abs() < 1e-12);
    }

    #[test]
    fn parses_samples_with_escapes_and_specials() {
        let s = parse_sample(r#"m{a="x\"y",b="c\\d\n",} +Inf 123"#).unwrap();
        assert_eq!(s.name, "m");
        assert_eq!(
            s.labels,
            vec![("a", "x\"y".to_string()), ("b", "c\\d\n".to_string())]
        );
        assert!(s.value.is_infinite());
        assert_eq!(parse_sample("up 1").unwrap().value, 1.0);
        assert!(parse_sample("bad-name 1").is_err());
        assert!(parse_sample(r#"m{a="x} 1"#).is_err());
        assert!(parse_sample("m{a=\"x\"} notanumber").is_err());
    }

    #[test]
    fn missing_and_malformed_metrics_are_errors() {
        assert_eq!(
            parse_vllm_metrics("foo 1\n").unwrap_err(),
            MetricsParseError::Missing("vllm:num_requests_running")
        );
        let bad = "vllm:num_requests_running{a=\"b\"} x\n";
        assert!(matches!(
            parse_vllm_metrics(bad),
            Err(MetricsParseError::Syntax { line: 1, .. })
        ));
        let old = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n";
        assert_eq!(parse_vllm_metrics(old).unwrap().kv_usage, 0.5);
        // Garbage lines of other metrics do not break the page.
        let noisy = format!("{VLLM}\n!!!garbage\nother{{ 1\n");
        assert_eq!(parse_vllm_metrics(&noisy).unwrap().running, 5);
    }

    #[test]
    fn saturation_thresholds() {
        let t = SaturationThresholds::default();
        let mut l = EngineLoad::default();
        assert_eq!(t.saturation(&l), 0.0);
        l.kv_usage = 0.45;
        assert!((t.saturation(&l) - 0.5).abs() < 1e-12);
        l.waiting = 5;
        assert_eq!(t.saturation(&l), 1.0);
        // Saturated by the queue, but not KV-full: still picked.
        assert!(!t.kv_full(&l) && !t.leaves_out(&l));
        let strict = SaturationThresholds {
            leave_out_queued: true,
            ..SaturationThresholds::default()
        };
        assert!(strict.leaves_out(&l));
        l.kv_usage = 0.9;
        assert!(t.kv_full(&l) && t.leaves_out(&l));
        assert!(SaturationThresholds {
            kv_usage: 0.0,
            waiting: 1,
            leave_out_queued: false,
        }
        .validate()
        .is_err());
    }

    #[test]
    fn saturation_settings_parse_with_defaults_for_what_is_left_out() {
        let t: SaturationThresholds = serde_json::from_str(r#"{"leaveOutQueued": true}"#).unwrap();
        assert!(t.leave_out_queued);
        assert_eq!((t.kv_usage, t.waiting), (0.9, 5));
        assert!(!SaturationThresholds::default().leave_out_queued);
        assert!(
            serde_json::from_str::<SaturationThresholds>(r#"{"leaveOutQueud": true}"#).is_err()
        );
    }

    fn tracker() -> (LoadTracker, EndpointId, EndpointId, Instant) {
        super::two_endpoints(LoadConfig {
            unhealthy_after: 2,
            in_flight_timeout: Duration::from_secs(10),
            prefill_horizon: Duration::from_secs(1),
            saturation: SaturationThresholds::default(),
            ..LoadConfig::default()
        })
    }

    #[test]
    fn health_follows_scrapes() {
        let (t, a, _, now) = tracker();
        assert!(
            !t.views([a], now)[0].healthy,
            "unhealthy before the first scrape"
        );
        t.record_scrape(
            a,
            Some(EngineLoad {
                running: 2,
                waiting: 0,
                kv_usage: 0.1,
            }),
            now,
        );
        assert!(t.views([a], now)[0].healthy);
        t.record_scrape(a, None, now);
        assert!(t.views([a], now)[0].healthy, "one failure is tolerated");
        t.record_scrape(a, None, now);
        let v = &t.views([a], now)[0];
        assert!(!v.healthy);
        assert_eq!(v.scrape_failures, 2);
        assert_eq!(v.saturation, 1.0);
        t.record_scrape(a, Some(EngineLoad::default()), now);
        assert!(t.views([a], now)[0].healthy);
    }

    #[test]
    fn in_flight_accounting() {
        let (t, a, b, now) = tracker();
        t.record_pick("r1", a, 100, 0, None, now);
        t.record_pick("r2", a, 50, 0, None, now);
        t.record_pick("", a, 1000, 0, None, now); // not accounted
        let v = t.views([a, b], now);
        assert_eq!((v[0].in_flight, v[0].queued_prefill_tokens), (2, 150));
        let m = t.report("r1", Phase::FirstToken);
        assert_eq!((m.matched, m.endpoint), (true, Some(a)));
        assert_eq!(t.views([a], now)[0].queued_prefill_tokens, 50);
        assert_eq!(t.views([a], now)[0].in_flight, 2);
        assert!(t.report("r1", Phase::Done).matched);
        assert!(
            !t.report("r1", Phase::Done).matched,
            "second DONE is unmatched"
        );
        assert_eq!(t.views([a], now)[0].in_flight, 1);
        // A retry moves the request.
        t.record_pick("r2", b, 70, 0, None, now);
        let v = t.views([a, b], now);
        assert_eq!((v[0].in_flight, v[0].queued_prefill_tokens), (0, 0));
        assert_eq!((v[1].in_flight, v[1].queued_prefill_tokens), (1, 70));
        // Prefill horizon, then timeout.
        assert_eq!(t.sweep(now + Duration::from_millis(1500)), 0);
        assert_eq!(t.views([b], now)[0].queued_prefill_tokens, 0);
        assert_eq!(t.views([b], now)[0].in_flight, 1);
        assert_eq!(t.sweep(now + Duration::from_secs(11)), 1);
        assert_eq!(t.views([b], now)[0].in_flight, 0);
        assert_eq!(t.in_flight_total(), 0);
    }

    #[test]
    fn removing_an_endpoint_forgets_its_picks() {
        let (t, a, b, now) = tracker();
        t.record_pick("r1", a, 10, 0, None, now);
        t.record_pick("r2", b, 10, 0, None, now);
        t.remove_endpoint(a);
        assert_eq!(t.in_flight_total(), 1);
        assert!(!t.report("r1", Phase::Done).matched);
        t.record_pick("r3", a, 10, 0, None, now); // unknown endpoint: ignored
        assert_eq!(t.in_flight_total(), 1);
    }

    #[test]
    fn block_chain_values_are_the_streaming_hash_of_each_block() {
        // The values are part of nothing persisted, but replicas of
        // different versions compare nothing either; this pins the
        // one-shot form to the definition (a seeded xxh3 over the tokens'
        // little-endian bytes, seeded with the previous block's hash).
        let tokens: Vec<u32> = (0..40).map(|i| i * 7919).collect();
        let mut h = 0u64;
        let want: Vec<u64> = tokens
            .chunks_exact(16)
            .map(|b| {
                let mut x = xxhash_rust::xxh3::Xxh3::with_seed(h);
                for t in b {
                    x.update(&t.to_le_bytes());
                }
                h = x.digest();
                h
            })
            .collect();
        assert_eq!(block_chain(&tokens, 16), want);
        // Extending a prefix's chain gives the whole chain.
        let mut c = block_chain(&tokens[..20], 16);
        extend_block_chain(&mut c, &tokens, 16);
        assert_eq!(c, want);
        extend_block_chain(&mut c, &tokens[..8], 16);
        assert_eq!(c, want, "a shorter prompt changes nothing");
    }

    #[test]
    fn block_chains_and_common_prefix() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999; // block 10 (size 4) differs
        let (ca, cb) = (block_chain(&a, 4), block_chain(&b, 4));
        assert_eq!(ca.len(), 16);
        assert_eq!(common_prefix(&ca, &cb), 10);
        assert_eq!(common_prefix(&ca, &ca), 16);
        assert_eq!(common_prefix(&ca, &ca[..3]), 3);
        assert_eq!(common_prefix(&ca, &[]), 0);
        assert_eq!(common_prefix(&ca, &block_chain(&[7; 64], 4)), 0);
        assert_eq!(
            block_chain(&a[..7], 4).len(),
            1,
            "partial blocks are not hashed"
        );
    }

    #[test]
    fn picks_in_prefill_count_as_pending_prefixes() {
        let (t, a, b, now) = tracker();
        let chain: Arc<[u64]> = block_chain(&(0..64).collect::<Vec<u32>>(), 4).into();
        t.record_pick("r1", a, 64, 0, Some(Arc::clone(&chain)), now);
        let v = t.views_matching([a, b], now, Some(&chain[..12]));
        assert_eq!(
            (v[0].pending_matched_blocks, v[1].pending_matched_blocks),
            (12, 0)
        );
        t.report("r1", Phase::FirstToken);
        let v = t.views_matching([a], now, Some(&chain));
        assert_eq!(
            v[0].pending_matched_blocks, 0,
            "after prefill the KV events tell"
        );
        for i in 0..(MAX_PENDING_PREFIXES + 5) {
            t.record_pick(&format!("x{i}"), b, 1, 0, Some(Arc::clone(&chain)), now);
        }
        let v = t.views_matching([b], now, Some(&chain));
        assert_eq!(v[0].pending_matched_blocks, 16);
        assert_eq!(t.sweep(now + Duration::from_millis(1500)), 0);
        assert_eq!(
            t.views_matching([b], now, Some(&chain))[0].pending_matched_blocks,
            0
        );
    }

    #[test]
    fn pool_saturation_is_mean_of_healthy() {
        let mk = |healthy, saturation| LoadView {
            healthy,
            saturation,
            ..Default::default()
        };
        assert_eq!(pool_saturation(&[]), 1.0);
        assert_eq!(pool_saturation(&[mk(false, 1.0)]), 1.0);
        assert_eq!(
            pool_saturation(&[mk(true, 0.2), mk(true, 0.6), mk(false, 1.0)]),
            0.4
        );
    }
}
