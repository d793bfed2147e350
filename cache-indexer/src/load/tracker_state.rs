//! One endpoint's in-flight state inside a [`LoadTracker`](super::LoadTracker),
//! and the steps that move a pick through it (prefill ended, done, moved).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::drain::{self, PrefillRate};
use super::engine_metrics::EngineLoad;
use super::prefix::{MAX_PENDING_PREFIXES, PENDING_GRACE};
use crate::types::EndpointId;

/// Result of a [`LoadTracker::report`](super::LoadTracker::report).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportMatch {
    /// The request id was in flight.
    pub matched: bool,
    /// The endpoint it had been picked for.
    pub endpoint: Option<EndpointId>,
    /// The cached tokens predicted at pick time.
    pub predicted_cached: Option<u32>,
}

#[derive(Debug, Default)]
pub(super) struct EndpointLoad {
    pub(super) engine: EngineLoad,
    pub(super) last_ok: Option<Instant>,
    pub(super) failures_in_row: u32,
    /// Times a refused connection turned it unhealthy at once.
    pub(super) refused_marks: u64,
    pub(super) scrape_failures: u64,
    pub(super) healthy: bool,
    pub(super) in_flight: u32,
    /// In-flight picks not reported yet (bounded by the config).
    pub(super) unconfirmed: u32,
    pub(super) queued_prefill: u64,
    /// (pick seq, block chain) of picks in prefill, oldest first.
    pub(super) pending: std::collections::VecDeque<(u64, Arc<[u64]>)>,
    /// Picks whose prefill ended less than [`PENDING_GRACE`] ago, oldest
    /// first: held by the engine, maybe not indexed yet.
    pub(super) settling: std::collections::VecDeque<Settling>,
    /// Picks made before the last scrape and reported done since: the
    /// scrape still counts them as running.
    pub(super) done_since_scrape: u32,
    /// Picks accounted here since the endpoint was added (never reset):
    /// what other replicas' flow control counts ([`LoadTracker::own_moves`]).
    pub(super) placed_total: u64,
    /// Of those, picks reported done or moved away by a retry.
    pub(super) done_total: u64,
    /// (pick seq, picked at, prefill tokens) of the picks in prefill,
    /// oldest first (see [`drain`]).
    pub(super) prefills: std::collections::VecDeque<(u64, Instant, u64)>,
    /// When a prefill here last ended (a report, or the horizon).
    pub(super) prefill_end: Option<Instant>,
    /// Its prefill rate, from first-token reports.
    pub(super) rate: PrefillRate,
}

impl EndpointLoad {
    /// Remembers pick `seq`'s chain while it is in prefill, forgetting the
    /// oldest past [`MAX_PENDING_PREFIXES`].
    pub(super) fn remember_pending(&mut self, seq: u64, chain: Arc<[u64]>) {
        if self.pending.len() >= MAX_PENDING_PREFIXES {
            self.pending.pop_front();
        }
        self.pending.push_back((seq, chain));
    }

    /// Remembers pick `seq`'s prefill of `tokens`, picked at `at`,
    /// forgetting the oldest past [`MAX_PENDING_PREFIXES`] (the drain then
    /// starts from a younger one: less is taken as done).
    pub(super) fn remember_prefill(&mut self, seq: u64, at: Instant, tokens: u64) {
        if self.prefills.len() >= MAX_PENDING_PREFIXES {
            self.prefills.pop_front();
        }
        self.prefills.push_back((seq, at, tokens));
    }

    /// Queued prefill tokens the engine has computed by `now` by the
    /// estimate of [`drain`]: of the oldest pick in prefill, at most.
    pub(super) fn drained(&self, now: Instant) -> u64 {
        let Some(&(_, picked_at, tokens)) = self.prefills.front() else {
            return 0;
        };
        let since = drain::started(picked_at, self.prefill_end);
        drain::drained(self.rate.per_sec(), Some(since), now, tokens).min(self.queued_prefill)
    }

    /// Keeps a chain whose prefill ended at `now` for [`PENDING_GRACE`],
    /// forgetting the oldest past [`MAX_PENDING_PREFIXES`].
    pub(super) fn settle(&mut self, request_id: &str, chain: Arc<[u64]>, now: Instant) {
        self.expire_settling(now);
        if self.settling.len() >= MAX_PENDING_PREFIXES {
            self.settling.pop_front();
        }
        self.settling.push_back(Settling {
            at: now,
            request_id: request_id.into(),
            chain,
        });
    }

    /// Drops settling chains past the grace at `now`.
    pub(super) fn expire_settling(&mut self, now: Instant) {
        while self.settling.front().is_some_and(|s| !s.live(now)) {
            self.settling.pop_front();
        }
    }

    /// Chains the engine computes or just computed, as of `now`: picks in
    /// prefill and settling chains still in their grace.
    pub(super) fn held_chains(&self, now: Instant) -> impl Iterator<Item = &Arc<[u64]>> {
        let settling = self.settling.iter().filter(move |s| s.live(now));
        self.pending
            .iter()
            .map(|(_, c)| c)
            .chain(settling.map(|s| &s.chain))
    }
}

/// A pick's chain after its prefill ended (see [`PENDING_GRACE`]).
#[derive(Debug)]
pub(super) struct Settling {
    /// When the prefill ended.
    pub(super) at: Instant,
    /// The pick's request id: its chain may be completed late
    /// ([`PendingChains::complete`](super::PendingChains::complete)).
    pub(super) request_id: Box<str>,
    pub(super) chain: Arc<[u64]>,
}

impl Settling {
    /// Whether still in its grace at `now`.
    pub(super) fn live(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.at) < PENDING_GRACE
    }
}

#[derive(Debug, Clone)]
pub(super) struct InFlight {
    pub(super) seq: u64,
    pub(super) endpoint: EndpointId,
    pub(super) predicted_cached: u32,
    pub(super) prefill_tokens: u64,
    pub(super) prefill_pending: bool,
    /// Some report (FIRST_TOKEN or DONE) came for it.
    pub(super) confirmed: bool,
    pub(super) picked_at: Instant,
}

impl InFlight {
    /// What a report that found this pick answers.
    pub(super) fn matched(&self) -> ReportMatch {
        ReportMatch {
            matched: true,
            endpoint: Some(self.endpoint),
            predicted_cached: Some(self.predicted_cached),
        }
    }
}

/// Ends `f`'s prefill part (if still pending; at `now`) and, when `whole`,
/// its in-flight count. Returns the chain it had in prefill, if any.
pub(super) fn release(
    endpoints: &mut HashMap<EndpointId, EndpointLoad>,
    f: &InFlight,
    whole: bool,
    now: Instant,
) -> Option<Arc<[u64]>> {
    let e = endpoints.get_mut(&f.endpoint)?;
    let mut chain = None;
    if f.prefill_pending {
        e.queued_prefill = e.queued_prefill.saturating_sub(f.prefill_tokens);
        if let Some(pos) = e.prefills.iter().position(|(s, _, _)| *s == f.seq) {
            e.prefills.remove(pos);
        }
        // (Later is safer: the next prefill is taken to start no earlier.)
        e.prefill_end = Some(e.prefill_end.map_or(now, |t| t.max(now)));
        if let Some(pos) = e.pending.iter().position(|(s, _)| *s == f.seq) {
            chain = e.pending.remove(pos).map(|(_, c)| c);
        }
    }
    if whole {
        e.in_flight = e.in_flight.saturating_sub(1);
        if !f.confirmed {
            e.unconfirmed = e.unconfirmed.saturating_sub(1);
        }
    }
    chain
}

/// Learns the engine's prefill rate from `f`'s first token, reported at
/// `now` (before its prefill part is released: see [`drain`]).
pub(super) fn learn_rate(
    endpoints: &mut HashMap<EndpointId, EndpointLoad>,
    f: &InFlight,
    now: Instant,
) {
    if let Some(e) = endpoints.get_mut(&f.endpoint) {
        let since = drain::started(f.picked_at, e.prefill_end);
        e.rate
            .observe(f.prefill_tokens, now.saturating_duration_since(since));
    }
}

/// Keeps the chain of `f`, whose prefill just ended on its endpoint, as
/// settling there (see [`PENDING_GRACE`]).
pub(super) fn settle(
    endpoints: &mut HashMap<EndpointId, EndpointLoad>,
    request_id: &str,
    f: &InFlight,
    chain: Option<Arc<[u64]>>,
) {
    if let (Some(e), Some(chain)) = (endpoints.get_mut(&f.endpoint), chain) {
        e.settle(request_id, chain, Instant::now());
    }
}

/// Turns `e` unhealthy: it is left out of picks, and what it was computing
/// or just computed is no longer credited (it may come back empty).
pub(super) fn mark_down(e: &mut EndpointLoad) {
    e.healthy = false;
    e.settling.clear();
}

/// Counts a pick reported done (for other replicas, [`LoadTracker::own_moves`]),
/// and, when the endpoint's last scrape counted it (picked before it), in
/// `done_since_scrape`: until the next scrape, the engine's scraped
/// `running` is that much too high.
pub(super) fn finished(endpoints: &mut HashMap<EndpointId, EndpointLoad>, f: &InFlight) {
    if let Some(e) = endpoints.get_mut(&f.endpoint) {
        e.done_total += 1;
        if e.last_ok.is_some_and(|scraped| f.picked_at <= scraped) {
            e.done_since_scrape = e.done_since_scrape.saturating_add(1);
        }
    }
}

/// Marks `f` reported (once), freeing its place under the unconfirmed cap.
pub(super) fn confirm(endpoints: &mut HashMap<EndpointId, EndpointLoad>, f: &mut InFlight) {
    if !f.confirmed {
        f.confirmed = true;
        if let Some(e) = endpoints.get_mut(&f.endpoint) {
            e.unconfirmed = e.unconfirmed.saturating_sub(1);
        }
    }
}
