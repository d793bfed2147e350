//! The per-pool load tracker: scraped engine state, in-flight picks and the
//! prompts still in prefill.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

use super::engine_metrics::EngineLoad;
use super::peers::{PeerLoad, PeerPending, PeerStats, Peers};
use super::prefix::common_prefix;
use super::saturation::SaturationThresholds;
use super::tracker_state::{
    confirm, finished, learn_rate, mark_down, release, settle, EndpointLoad, InFlight, ReportMatch,
};
use crate::types::EndpointId;

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
    /// In-flight picks: this replica's and, with shared load, the other
    /// replicas' (`peer_in_flight` of them).
    pub in_flight: u32,
    /// Queued prefill tokens of in-flight picks, the other replicas'
    /// (`peer_queued_prefill_tokens` of them) included.
    pub queued_prefill_tokens: u64,
    /// Of `in_flight`, the picks other replicas placed (see
    /// [`LoadTracker::set_peer_loads`]).
    pub peer_in_flight: u32,
    /// Of `queued_prefill_tokens`, the other replicas'.
    pub peer_queued_prefill_tokens: u64,
    /// Of `queued_prefill_tokens`, what the engine has computed by now by
    /// its prefill rate, though no report said so yet (at most its oldest
    /// pick's; see `load::drain`). Flow control counts the rest.
    pub prefill_drained_tokens: u64,
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
    /// Times a refused connection turned it unhealthy at once (see
    /// [`LoadTracker::record_refused`]).
    pub refused_marks: u64,
    /// Leading blocks of the request (see [`LoadTracker::views_matching`])
    /// that an in-flight pick to this endpoint, still in prefill, shares:
    /// blocks the engine is computing and will hold by the time this request
    /// runs, though its KV events have not said so yet.
    pub pending_matched_blocks: usize,
    /// This replica's picks that the last scrape counted and that were
    /// reported done since (see [`LoadView::running`]).
    pub done_since_scrape: u32,
}

impl LoadView {
    /// The engine's running requests now, as far as this replica knows: the
    /// last scrape's count less the requests reported done since. Without
    /// it an engine that just finished a request looks busy until its next
    /// scrape, and a conversation's next turn, sent right after, can be
    /// moved off the engine holding its history.
    pub fn running(&self) -> u32 {
        self.engine.running.saturating_sub(self.done_since_scrape)
    }
}

#[derive(Debug, Default)]
struct Inner {
    endpoints: HashMap<EndpointId, EndpointLoad>,
    in_flight: HashMap<String, InFlight>,
    next_seq: u64,
    bounds: BoundStats,
    /// The other replicas' load, added to the views only.
    peers: Peers,
    /// Reports that matched no pick of this replica, newest last (at most
    /// [`MAX_UNMATCHED_KEPT`]): with shared load they go to the other
    /// replicas, one of which may have answered the pick.
    unmatched: VecDeque<(String, Phase)>,
}

/// Unmatched reports kept for the other replicas between two sharing
/// rounds; the oldest go first.
pub const MAX_UNMATCHED_KEPT: usize = 1024;

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
    /// Woken when this replica's own load changes (see [`LoadTracker::changes`]).
    changed: Arc<Notify>,
}

/// A handle on the tracker's in-flight picks that outlives a borrow of it:
/// a pick whose prompt was tokenized only as far as its cached prefix gets
/// its whole block chain later, off the pick's path
/// ([`PendingChains::complete`]).
#[derive(Clone)]
pub struct PendingChains {
    inner: Arc<Mutex<Inner>>,
    changed: Arc<Notify>,
}

impl std::fmt::Debug for PendingChains {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingChains").finish_non_exhaustive()
    }
}

impl PendingChains {
    /// Gives `request_id`'s pick its whole chain, if the pick is still in
    /// prefill or its chain still settling (see [`PENDING_GRACE`](super::PENDING_GRACE): a fast
    /// engine may be done before the chain is); else there is nothing to
    /// match against any more. Returns whether it did.
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
            let settling = endpoints
                .values_mut()
                .flat_map(|e| e.settling.iter_mut())
                .find(|s| &*s.request_id == request_id);
            return settling.map(|s| s.chain = chain).is_some();
        };
        let Some(e) = endpoints.get_mut(&f.endpoint) else {
            return false;
        };
        match e.pending.iter_mut().find(|(s, _)| *s == f.seq) {
            Some(entry) => entry.1 = chain,
            None => e.remember_pending(f.seq, chain),
        }
        self.changed.notify_one();
        true
    }
}

impl LoadTracker {
    /// An empty tracker.
    pub fn new(cfg: LoadConfig) -> Self {
        LoadTracker {
            cfg,
            inner: Arc::new(Mutex::new(Inner::default())),
            changed: Arc::default(),
        }
    }

    /// A handle for completing picks' chains later.
    pub fn pending_chains(&self) -> PendingChains {
        PendingChains {
            inner: Arc::clone(&self.inner),
            changed: Arc::clone(&self.changed),
        }
    }

    /// Notified (one stored permit, so changes coalesce) whenever a pick,
    /// a report or a completed chain changes what this replica would
    /// share: the shared-load sync can then publish at once instead of at
    /// its next interval.
    pub fn changes(&self) -> Arc<Notify> {
        Arc::clone(&self.changed)
    }

    /// Whether some pick still in prefill (or settling, see
    /// [`PENDING_GRACE`](super::PENDING_GRACE)), this replica's or (with shared load) another's,
    /// has a prompt starting with the whole of `chain`
    /// (chained hashes: equal last entries mean equal prefixes).
    pub fn pending_holds(&self, chain: &[u64]) -> bool {
        let Some(last) = chain.last() else {
            return true;
        };
        let i = chain.len() - 1;
        let now = Instant::now();
        let g = self.inner.lock();
        g.endpoints.values().any(|e| {
            e.held_chains(now)
                .any(|p| p.get(i).is_some_and(|h| h == last))
        }) || g.peers.pending_may_hold(chain, now)
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
                e.done_since_scrape = 0;
                e.failures_in_row = 0;
                e.healthy = true;
            }
            None => {
                e.failures_in_row = e.failures_in_row.saturating_add(1);
                e.scrape_failures += 1;
                if e.failures_in_row >= self.cfg.unhealthy_after {
                    mark_down(e);
                }
            }
        }
    }

    /// Records that nobody listens at the endpoint (a connection refused):
    /// unlike a timeout, which a busy engine may cause, that is a definite
    /// answer, so the endpoint turns unhealthy at once. Counted as a failed
    /// scrape. Returns whether it was healthy until now.
    pub fn record_refused(&self, id: EndpointId) -> bool {
        let mut g = self.inner.lock();
        let Some(e) = g.endpoints.get_mut(&id) else {
            return false;
        };
        e.failures_in_row = e.failures_in_row.saturating_add(1);
        e.scrape_failures += 1;
        let was = e.healthy;
        if was {
            e.refused_marks += 1;
        }
        mark_down(e);
        was
    }

    /// Accounts a pick: `request_id` goes to `endpoint` with `prefill_tokens`
    /// to compute and `predicted_cached` tokens expected cached (kept to
    /// compare with the report). `chain` (see [`block_chain`](super::prefix::block_chain)) is the
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
            ..
        } = &mut *g;
        if let Some(old) = in_flight.remove(request_id) {
            release(endpoints, &old, true, now);
            // The retry left that endpoint: for other replicas, as if done.
            if let Some(e) = endpoints.get_mut(&old.endpoint) {
                e.done_total += 1;
            }
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
        e.placed_total += 1;
        e.queued_prefill += prefill_tokens;
        e.remember_prefill(seq, now, prefill_tokens);
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
        drop(g);
        self.changed.notify_one();
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
        let m = self.apply_report(request_id, phase);
        if !m.matched && !request_id.is_empty() {
            let mut g = self.inner.lock();
            if g.unmatched.len() == MAX_UNMATCHED_KEPT {
                g.unmatched.pop_front();
            }
            g.unmatched.push_back((request_id.to_owned(), phase));
        }
        m
    }

    /// The reports that matched no pick here since the last call, oldest
    /// first (for the other replicas).
    pub fn take_unmatched(&self) -> Vec<(String, Phase)> {
        self.inner.lock().unmatched.drain(..).collect()
    }

    /// A report another replica received for a pick it did not answer:
    /// accounted here if the pick is this replica's, else nothing (and not
    /// kept for anyone). Returns whether it matched.
    pub fn peer_report(&self, request_id: &str, phase: Phase) -> bool {
        self.apply_report(request_id, phase).matched
    }

    fn apply_report(&self, request_id: &str, phase: Phase) -> ReportMatch {
        let mut g = self.inner.lock();
        let Inner {
            endpoints,
            in_flight,
            ..
        } = &mut *g;
        let now = Instant::now();
        let unmatched = ReportMatch {
            matched: false,
            endpoint: None,
            predicted_cached: None,
        };
        let m = match phase {
            Phase::Done => match in_flight.remove(request_id) {
                Some(f) => {
                    let chain = release(endpoints, &f, true, now);
                    settle(endpoints, request_id, &f, chain);
                    finished(endpoints, &f);
                    f.matched()
                }
                None => unmatched,
            },
            Phase::FirstToken => match in_flight.get_mut(request_id) {
                Some(f) => {
                    confirm(endpoints, f);
                    if f.prefill_pending {
                        learn_rate(endpoints, f, now);
                        let chain = release(endpoints, f, false, now);
                        settle(endpoints, request_id, f, chain);
                        f.prefill_pending = false;
                    }
                    f.matched()
                }
                None => unmatched,
            },
        };
        if m.matched {
            self.changed.notify_one();
        }
        m
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
                release(endpoints, f, true, now);
                expired += 1;
                return false;
            }
            if f.prefill_pending && age >= self.cfg.prefill_horizon {
                release(endpoints, f, false, now);
                f.prefill_pending = false;
            }
            true
        });
        for e in endpoints.values_mut() {
            e.expire_settling(now);
        }
        expired
    }

    fn view_of(
        &self,
        e: &EndpointLoad,
        peers: &Peers,
        id: EndpointId,
        now: Instant,
        chain: Option<&[u64]>,
    ) -> LoadView {
        let peer = peers.load(id, now);
        // Another replica's pick in prefill is as good a sign as this
        // one's: its KV events come only once that prefill is done.
        let pending_matched_blocks = chain.map_or(0, |c| {
            e.held_chains(now)
                .map(|p| common_prefix(c, p))
                .max()
                .unwrap_or(0)
                .max(peers.pending_matched(id, c, now))
        });
        let saturation = if e.healthy {
            self.cfg.saturation.saturation(&e.engine)
        } else {
            1.0
        };
        LoadView {
            engine: e.engine,
            healthy: e.healthy,
            in_flight: e.in_flight.saturating_add(peer.in_flight),
            queued_prefill_tokens: e.queued_prefill.saturating_add(peer.queued_prefill_tokens),
            peer_in_flight: peer.in_flight,
            peer_queued_prefill_tokens: peer.queued_prefill_tokens,
            prefill_drained_tokens: e.drained(now),
            saturation,
            saturated: e.healthy && saturation >= 1.0,
            left_out: e.healthy && self.cfg.saturation.leaves_out(&e.engine),
            last_scrape_age: e.last_ok.map(|t| now.saturating_duration_since(t)),
            scrape_failures: e.scrape_failures,
            failures_in_row: e.failures_in_row,
            refused_marks: e.refused_marks,
            pending_matched_blocks,
            done_since_scrape: e.done_since_scrape,
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
                Some(e) => self.view_of(e, &g.peers, id, now, chain),
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

    /// This replica's own load per endpoint (in-flight picks, queued
    /// prefill), endpoints with none left out, sorted by id: what it
    /// publishes for the other replicas.
    pub fn own_loads(&self) -> Vec<(EndpointId, PeerLoad)> {
        let g = self.inner.lock();
        let mut out: Vec<(EndpointId, PeerLoad)> = g
            .endpoints
            .iter()
            .map(|(id, e)| {
                let l = PeerLoad {
                    in_flight: e.in_flight,
                    queued_prefill_tokens: e.queued_prefill,
                };
                (*id, l)
            })
            .filter(|(_, l)| !l.is_zero())
            .collect();
        out.sort_unstable_by_key(|(id, _)| id.0);
        out
    }

    /// This replica's picks accounted per endpoint and, of those, the ones
    /// reported done (or moved by a retry), both counted since the endpoint
    /// was added, never reset; endpoints with none left out, sorted by id:
    /// what it publishes for the other replicas' flow control, which counts
    /// the increments it reads as placements and ends since its own scrape.
    pub fn own_moves(&self) -> Vec<(EndpointId, u64, u64)> {
        let g = self.inner.lock();
        let mut out: Vec<(EndpointId, u64, u64)> = g
            .endpoints
            .iter()
            .filter(|(_, e)| e.placed_total > 0)
            .map(|(id, e)| (*id, e.placed_total, e.done_total))
            .collect();
        out.sort_unstable_by_key(|(id, _, _)| id.0);
        out
    }

    /// Takes the other replicas' load, summed over `peers` live replicas
    /// (never this one's): the views add it until `now + ttl`, then fall
    /// back to this replica's own counts unless a newer read replaces it.
    pub fn set_peer_loads(
        &self,
        loads: HashMap<EndpointId, PeerLoad>,
        peers: usize,
        now: Instant,
        ttl: Duration,
    ) {
        self.inner.lock().peers.set(loads, peers, now, ttl);
    }

    /// This replica's picks in prefill per endpoint, newest first, then the
    /// chains still settling (prefill ended within [`PENDING_GRACE`](super::PENDING_GRACE)),
    /// newest first: the other replicas' picks need them for the same
    /// reason as this one's. Endpoints with none left out, sorted by id:
    /// what it publishes for the other replicas to match.
    pub fn own_pending(&self) -> Vec<(EndpointId, Vec<Arc<[u64]>>)> {
        let now = Instant::now();
        let g = self.inner.lock();
        let mut out: Vec<(EndpointId, Vec<Arc<[u64]>>)> = g
            .endpoints
            .iter()
            .map(|(id, e)| {
                let pending = e.pending.iter().rev().map(|(_, c)| Arc::clone(c));
                let settling = e
                    .settling
                    .iter()
                    .rev()
                    .filter(|s| s.live(now))
                    .map(|s| Arc::clone(&s.chain));
                (*id, pending.chain(settling).collect::<Vec<_>>())
            })
            .filter(|(_, chains)| !chains.is_empty())
            .collect();
        out.sort_unstable_by_key(|(id, _)| id.0);
        out
    }

    /// Takes the other replicas' picks in prefill from the same read as
    /// the next [`LoadTracker::set_peer_loads`]: the views match them while
    /// they use that read's loads.
    pub fn set_peer_pending(&self, pending: PeerPending) {
        self.inner.lock().peers.set_pending(pending);
    }

    /// Counts a failed round with the shared store; the last read stays in
    /// use until its TTL.
    pub fn peer_round_failed(&self) {
        self.inner.lock().peers.failed();
    }

    /// How the sharing of load with other replicas stands at `now`.
    pub fn peer_stats(&self, now: Instant) -> PeerStats {
        self.inner.lock().peers.stats(now)
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

#[cfg(test)]
#[path = "tracker_bounds_tests.rs"]
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
#[path = "tracker_tests.rs"]
mod tests;
