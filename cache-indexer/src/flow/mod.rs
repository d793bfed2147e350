//! A pool's flow control: the queue picks wait in while the pool
//! is saturated, released one per freed slot in the order of
//! `kvasir-flowcontrol` (priority bands, then token-weighted fair share
//! between tenants). The pick path ([`crate::pick`]) asks [`PoolFlow::arrive`]
//! whether a pick goes, waits or is shed, and waits on the answer channel
//! it gets; [`PoolFlow::release`] runs when capacity is freed (reports,
//! scrapes, endpoint changes, and time alone: see below) and sends each
//! released pick a [`Passage`].
//!
//! Saturation is the least saturated healthy endpoint's, from its last
//! scrape moved on by the requests reported done and the picks placed since
//! ([`estimate`]), with the picks let through or released but not placed
//! yet (in transit) added where they find the most room: so a burst of
//! arrivals, or one freed slot, lets through as many picks as there is
//! room for, not more. No healthy endpoint: nothing is known, picks go (the
//! ranking answers `no_endpoints`), as the indexer fails open elsewhere.
//! An endpoint's saturation is also at least its queued prefill work over
//! `saturatedPrefillTokens` (the uncached prompt tokens of picks placed
//! there not at their first token yet, in transit ones added at their
//! size): one long prompt can be seconds of prefill, and vLLM's chunked
//! prefill runs several at once with nothing "waiting". That work drains
//! with time between reports, at the engine's prefill rate learned from
//! first-token reports and never past its oldest pick in prefill
//! (`crate::load::drain`); so while picks wait, one of them runs a timer
//! ([`recheck`], every 10 ms) that runs the release: what releases a held
//! pick is a report, a scrape, a sharing round, an endpoint change, or the
//! estimate saying an engine has worked its backlog down to the threshold.
//!
//! The reserve: a tenant holding more than its weighted share of the work
//! in flight (by this replica's picks, [`kvasir_flowcontrol::Shares`]) goes
//! only below `threshold x (1 - reserve)`, and the release passes over its
//! waiting picks while tenants under their share may go; so a flooding
//! tenant cannot keep every engine at the threshold. A pick's work is in
//! flight from its pass until its DONE report ([`PoolFlow::settle`]), or
//! until it is forgotten ([`MAX_CHARGES`], [`CHARGE_TTL`]). With
//! `reserveCountsWaiting` the share counts the tenant's waiting picks too
//! (its demand: the fair order releases a flooding tenant at about its
//! share, so by the work in flight alone it is seldom over it); with
//! `overShareSlack` "over" means past `1 + slack` times the share. What the
//! reserve did is counted per tenant ([`metrics::TenantCounts`]).
//!
//! With several indexer replicas each keeps its own queue for the picks of
//! the streams it serves (see flowcontrol/README.md, "Two or more indexer
//! replicas"): every replica scrapes every engine, and between scrapes
//! counts its own placements and reports and, with shared load, the other
//! replicas' placements and ends as its last sharing rounds read them
//! ([`PoolFlow::peer_moves`], [`crate::shared_load::moves`]).

mod estimate;
pub(crate) mod exposition;
pub mod metrics;
mod moves;
mod passage;
mod quickest;
pub mod recheck;
mod release;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvasir_flowcontrol::{
    engine_priority, has_room, room_bound, EnginePriorityBy, FlowControlConfig, FlowQueue, Refusal,
    ReleaseOrder, Shares, Ticket,
};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::load::{LoadView, SaturationThresholds};
use crate::types::EndpointId;
use estimate::Since;
pub use metrics::{FlowMetrics, ShedCause};
use moves::{since_scrape, PeerMoves};
pub use passage::Passage;
use passage::{Charge, EngineRank, ShareGuard, Transit};
use quickest::Taker;
pub use quickest::{Price, MOVE_PENALTY};

/// Placements remembered per endpoint between two scrapes; past it the
/// oldest are forgotten (the endpoint looks less loaded until the scrape).
const MAX_PLACED_PER_ENDPOINT: usize = 4096;

/// Released picks whose charge waits for their DONE report; past it the
/// oldest are forgotten (their charge stays the estimate).
const MAX_CHARGES: usize = 65_536;

/// How long a placed pick's work counts in its tenant's share without its
/// DONE report (a lost report must not hold a tenant over its share for
/// good; a stream longer than this counts less than it holds).
pub const CHARGE_TTL: Duration = Duration::from_secs(600);

/// A pick that asks to wait (the queue's `Waiting` without its state).
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    /// Its request id: a released pick's charge is settled by its DONE
    /// report's usage ([`PoolFlow::settle`]).
    pub request_id: String,
    /// Whose pick it is.
    pub tenant: String,
    /// Its band (lower is more urgent).
    pub priority: i32,
    /// The tenant's weight.
    pub weight: u32,
    /// Prompt tokens plus the output estimate.
    pub tokens: u64,
    /// How long its caller waits at most (the pool's maximum also holds).
    pub max_wait: Duration,
    /// Its prefill on each endpoint, for `releaseOrder: quickestFirst`.
    pub price: Price,
}

/// What a pick waiting in the queue is woken with.
#[derive(Debug)]
pub enum Wake {
    /// Released: place it now.
    Go(Passage),
    /// Past its deadline: shed it (`max_wait`).
    Expired,
}

/// What [`PoolFlow::arrive`] says about a pick.
#[derive(Debug)]
pub enum Arrival {
    /// Place it now.
    Go(Passage),
    /// It waits: until `rx` says, or its deadline passes.
    Queued {
        /// Its place, to withdraw it.
        ticket: Ticket,
        /// Where its release or expiry comes.
        rx: oneshot::Receiver<Wake>,
        /// When it has waited its longest.
        deadline: Instant,
    },
    /// Shed it.
    Shed(ShedCause),
}

/// A waiting pick's state in the queue: where to send its wake.
#[derive(Debug)]
struct Waiter {
    tx: oneshot::Sender<Wake>,
    request_id: String,
    price: Price,
}

#[derive(Debug)]
struct Inner {
    queue: FlowQueue<Waiter>,
    /// Placement times per endpoint since (about) its last scrape.
    placed: HashMap<EndpointId, VecDeque<Instant>>,
    /// Other replicas' placements and ends per endpoint since its last
    /// scrape.
    peer: HashMap<EndpointId, PeerMoves>,
    /// Tokens waiting per tenant (tenants with picks waiting only).
    tokens: HashMap<String, u64>,
    /// Released and placed picks' charges by request id, oldest first.
    charges: HashMap<String, Charge>,
    charge_order: VecDeque<String>,
}

/// One pool's flow-control state.
#[derive(Debug)]
pub struct PoolFlow {
    config: FlowControlConfig,
    inner: Mutex<Inner>,
    in_transit: Arc<Transit>,
    /// Work in flight and waiting per tenant (locked after `inner`).
    shares: Arc<Mutex<Shares>>,
    /// Counters and the wait histogram.
    pub metrics: FlowMetrics,
    /// The re-check timer while picks wait ([`recheck`]).
    pub recheck: recheck::Recheck,
}

impl PoolFlow {
    /// Flow control with `config`.
    pub fn new(config: FlowControlConfig) -> Self {
        PoolFlow {
            inner: Mutex::new(Inner {
                queue: FlowQueue::new(config.limits()),
                placed: HashMap::new(),
                peer: HashMap::new(),
                tokens: HashMap::new(),
                charges: HashMap::new(),
                charge_order: VecDeque::new(),
            }),
            config,
            in_transit: Arc::default(),
            shares: Arc::default(),
            metrics: FlowMetrics::default(),
            recheck: recheck::Recheck::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &FlowControlConfig {
        &self.config
    }

    /// Whether picks may wait at all.
    pub fn enabled(&self) -> bool {
        self.config.enabled
    }

    /// Picks waiting.
    pub fn len(&self) -> usize {
        self.inner.lock().queue.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Picks let through or released and not placed yet.
    pub fn in_transit(&self) -> usize {
        self.in_transit.picks.load(Ordering::Acquire)
    }

    /// Whether `tenant` holds more than its weighted share of the work in
    /// flight, with other tenants active (see the module docs).
    pub fn over_share(&self, tenant: &str) -> bool {
        let c = &self.config;
        self.shares
            .lock()
            .over_share_of(tenant, c.over_share_slack, c.reserve_counts_waiting)
    }

    /// Tokens `tenant` has in flight (this replica's picks), and all
    /// tenants'.
    pub fn held(&self, tenant: &str) -> (u64, u64) {
        let s = self.shares.lock();
        (s.held(tenant), s.total())
    }

    /// The saturation below which `tenant`'s pick may go now
    /// ([`room_bound`]).
    fn bound(&self, shares: &Shares, tenant: &str) -> f64 {
        room_bound(
            self.config.threshold,
            self.config.reserve,
            shares.over_share_of(
                tenant,
                self.config.over_share_slack,
                self.config.reserve_counts_waiting,
            ),
        )
    }

    /// A pass for a pick going now: in transit, its work in its tenant's
    /// share, and its engine priority as the shares are before it starts.
    fn pass(&self, queued: Duration, charge: Charge) -> Passage {
        let t = &self.in_transit;
        t.picks.fetch_add(1, Ordering::AcqRel);
        t.tokens.fetch_add(charge.tokens, Ordering::AcqRel);
        let engine_rank = {
            let mut shares = self.shares.lock();
            let band = charge.priority;
            let r = match (self.config.engine_priority, self.config.engine_priority_by) {
                (false, _) => None,
                (true, EnginePriorityBy::Share) => Some(EngineRank::Fixed(
                    self.engine_priority_in(&shares, &charge.tenant, band),
                )),
                (true, EnginePriorityBy::Prefill) => Some(EngineRank::ByPrefill(band)),
            };
            shares.start(&charge.tenant, charge.weight, charge.tokens);
            r
        };
        Passage {
            in_transit: Some(Arc::clone(t)),
            tokens: charge.tokens,
            queued,
            share: Some(ShareGuard {
                shares: Arc::clone(&self.shares),
                tenant: charge.tenant.clone(),
                tokens: charge.tokens,
                armed: true,
            }),
            charge: Some(charge),
            engine_rank,
        }
    }

    /// The engine priority of a pick of `tenant` in `band` bound now
    /// ([`engine_priority`]). Over its share counts the tenant's waiting
    /// picks with its work in flight (its demand), whatever
    /// `reserveCountsWaiting` says: the fair order releases a flooding
    /// tenant at about its share, so by the work in flight alone it would
    /// be "over" only now and then, and the engines' queues would again
    /// serve its backlog first come first served.
    fn engine_priority_in(&self, shares: &Shares, tenant: &str, band: i32) -> i32 {
        let over = shares.over_share_of(tenant, self.config.over_share_slack, true);
        engine_priority(band, over)
    }

    /// Per tenant with picks waiting: (tenant, picks, tokens), sorted.
    pub fn tenants(&self) -> Vec<(String, usize, u64)> {
        let g = self.inner.lock();
        let mut out: Vec<(String, usize, u64)> = g
            .queue
            .tenants()
            .map(|(t, n)| (t.to_string(), n, g.tokens.get(t).copied().unwrap_or(0)))
            .collect();
        out.sort();
        out
    }

    /// Decides a new pick's fate: go (room, or nothing known), wait, or be
    /// shed. `loads` are the pool's endpoints' views at `now`.
    pub fn arrive(
        &self,
        loads: &[(EndpointId, LoadView)],
        thresholds: &SaturationThresholds,
        ask: Ask,
        now: Instant,
    ) -> Arrival {
        let mut g = self.inner.lock();
        let mut sat = self.saturation(&mut g, loads, thresholds, now);
        if has_room(sat, self.config.threshold) && !g.queue.is_empty() {
            // Room no report or scrape announced (a released pick whose
            // caller went away, say): the picks waiting take it first.
            self.release_locked(&mut g, loads, thresholds, now);
            sat = self.saturation(&mut g, loads, thresholds, now);
        }
        // What still waits now is held at this saturation (no room, or
        // over its share): a newcomer with room by its own bound overtakes
        // only those.
        let bound = self.bound(&self.shares.lock(), &ask.tenant);
        let reserved = bound < self.config.threshold;
        if has_room(sat, bound) {
            if reserved {
                self.metrics.reserve_passed(&ask.tenant);
            }
            let charge = Charge {
                request_id: ask.request_id,
                tenant: ask.tenant,
                priority: ask.priority,
                weight: ask.weight,
                tokens: ask.tokens,
                queued: false,
                at: now,
            };
            return Arrival::Go(self.pass(Duration::ZERO, charge));
        }
        // Room by the threshold, none by its bound: it waits for the reserve.
        let held = reserved && has_room(sat, self.config.threshold);
        let tokens = ask.tokens;
        let wait = ask.max_wait.min(self.config.limits().max_wait);
        if wait.is_zero() {
            self.metrics.count_shed(ShedCause::NoWait, tokens);
            return Arrival::Shed(ShedCause::NoWait);
        }
        let deadline = now + wait;
        let (tx, rx) = oneshot::channel();
        let tenant = ask.tenant.clone();
        let waiting = kvasir_flowcontrol::Waiting {
            tenant: ask.tenant,
            priority: ask.priority,
            weight: ask.weight,
            tokens,
            deadline: Some(deadline),
            item: Waiter {
                tx,
                request_id: ask.request_id,
                price: ask.price,
            },
        };
        match g.queue.push(waiting, now) {
            Ok(ticket) => {
                if held {
                    self.metrics.reserve_held(&tenant);
                }
                self.metrics.queued.inc();
                self.metrics.queued_tokens.add(tokens);
                self.shares.lock().queue(&tenant, ask.weight, tokens);
                track(&mut g.tokens, &tenant, tokens);
                Arrival::Queued {
                    ticket,
                    rx,
                    deadline,
                }
            }
            Err(refused) => {
                let cause = match refused.reason {
                    Refusal::PoolFull { .. } => ShedCause::PoolFull,
                    Refusal::TenantFull { .. } => ShedCause::TenantFull,
                    Refusal::NoTime => ShedCause::NoWait,
                };
                self.metrics.count_shed(cause, tokens);
                Arrival::Shed(cause)
            }
        }
    }

    /// Capacity may have been freed: sheds the picks past their deadline,
    /// then releases waiting picks while an endpoint has room (picks in
    /// transit counted), each with a [`Passage`]. A released pick whose
    /// caller is gone is skipped.
    pub fn release(
        &self,
        loads: &[(EndpointId, LoadView)],
        thresholds: &SaturationThresholds,
        now: Instant,
    ) {
        let mut g = self.inner.lock();
        self.release_locked(&mut g, loads, thresholds, now);
    }

    fn release_locked(
        &self,
        g: &mut Inner,
        loads: &[(EndpointId, LoadView)],
        thresholds: &SaturationThresholds,
        now: Instant,
    ) {
        if g.queue.is_empty() {
            return;
        }
        for r in g.queue.expire(now) {
            self.shares
                .lock()
                .unqueue(&r.waiting.tenant, r.waiting.tokens);
            untrack(&mut g.tokens, &r.waiting.tenant, r.waiting.tokens);
            self.metrics
                .count_shed(ShedCause::MaxWait, r.waiting.tokens);
            let _ = r.waiting.item.tx.send(Wake::Expired);
        }
        let quickest = self.config.release_order == ReleaseOrder::QuickestFirst;
        let max_skip = Duration::from_millis(self.config.max_quickest_skip_ms);
        loop {
            let (freest, sat) = self.freest(g, loads, thresholds, now);
            if !has_room(sat, self.config.threshold) {
                break;
            }
            let r = {
                let shares = self.shares.lock();
                let allow = |t: &str| has_room(sat, self.bound(&shares, t));
                match freest.filter(|_| quickest) {
                    Some(id) => {
                        let taker = Taker::new(id, loads);
                        g.queue
                            .pop_quickest_where(allow, now, max_skip, |w| taker.cost(&w.item.price))
                    }
                    None => g.queue.pop_next_where(allow),
                }
            };
            let Some(r) = r else {
                break;
            };
            let bound = self.bound(&self.shares.lock(), &r.waiting.tenant);
            if bound < self.config.threshold {
                self.metrics.reserve_passed(&r.waiting.tenant);
            }
            self.shares
                .lock()
                .unqueue(&r.waiting.tenant, r.waiting.tokens);
            untrack(&mut g.tokens, &r.waiting.tenant, r.waiting.tokens);
            let waited = now.saturating_duration_since(r.enqueued_at);
            let w = r.waiting;
            let charge = Charge {
                request_id: w.item.request_id,
                tenant: w.tenant,
                priority: w.priority,
                weight: w.weight,
                tokens: w.tokens,
                queued: true,
                at: now,
            };
            let tenant = charge.tenant.clone();
            let passage = self.pass(waited, charge);
            if w.item.tx.send(Wake::Go(passage)).is_ok() {
                self.metrics.tenant_released(&tenant, waited);
                self.metrics.released.inc();
                self.metrics.released_tokens.add(w.tokens);
                self.metrics.wait.observe(waited);
            } else {
                // Its caller went away between its last poll and now (the
                // returned pass is dropped here, out of transit).
                self.metrics.cancelled.inc();
            }
        }
    }

    /// Takes a waiting pick out at its deadline; false when it had left
    /// already (released or expired: its wake is in its channel).
    pub fn expire_one(&self, ticket: Ticket) -> bool {
        self.take(ticket)
            .inspect(|tokens| {
                self.metrics.count_shed(ShedCause::MaxWait, *tokens);
            })
            .is_some()
    }

    /// Takes a waiting pick out because its caller went away; false when it
    /// had left already.
    pub fn cancel(&self, ticket: Ticket) -> bool {
        self.take(ticket)
            .inspect(|_| self.metrics.cancelled.inc())
            .is_some()
    }

    fn take(&self, ticket: Ticket) -> Option<u64> {
        let mut g = self.inner.lock();
        let r = g.queue.remove(ticket)?;
        self.shares
            .lock()
            .unqueue(&r.waiting.tenant, r.waiting.tokens);
        untrack(&mut g.tokens, &r.waiting.tenant, r.waiting.tokens);
        Some(r.waiting.tokens)
    }

    /// A pick that went through flow control was placed on `endpoint`
    /// (none: nothing was placed): it counts as the endpoint's load until
    /// its next scrape, and is no longer in transit.
    pub fn placed(&self, mut passage: Passage, endpoint: Option<EndpointId>) {
        if passage.in_transit.is_none() {
            return;
        }
        let Some(id) = endpoint else {
            return;
        };
        let mut g = self.inner.lock();
        let q = g.placed.entry(id).or_default();
        if q.len() >= MAX_PLACED_PER_ENDPOINT {
            q.pop_front();
        }
        let now = Instant::now();
        q.push_back(now);
        if let Some(mut c) = passage.charge.take().filter(|c| !c.request_id.is_empty()) {
            // Its work stays in its tenant's share until its report.
            if let Some(s) = passage.share.as_mut() {
                s.armed = false;
            }
            c.at = now;
            remember_charge(&mut g, &self.shares, c, now);
        }
        drop(g);
        drop(passage);
    }

    /// A released pick's request is done: its fair-share charge (prompt
    /// plus output estimate) becomes `actual` (prompt plus the output it
    /// produced; 0: unknown, the estimate stands). Unknown ids (not
    /// released, or forgotten) change nothing.
    pub fn settle(&self, request_id: &str, actual: u64) {
        let mut g = self.inner.lock();
        let Some(c) = g.charges.remove(request_id) else {
            return;
        };
        self.shares.lock().end(&c.tenant, c.tokens);
        if actual > 0 && c.queued {
            g.queue
                .settle(&c.tenant, c.priority, c.weight, c.tokens, actual);
        }
    }

    /// Other replicas' picks placed on and ended at each endpoint, as a
    /// sharing round read them at `read_at`; each happened at most `lag`
    /// before (the writer's round and the reader's). Until this replica's
    /// next scrape of the endpoint they move its estimate as its own
    /// placements and DONE reports do, each on the safe side of that
    /// uncertainty: a placement counts while it may be newer than the
    /// scrape (taken to be at `read_at`), an end only once it is surely
    /// newer (taken to be at `read_at - lag`): an end the scrape may
    /// already show is never credited twice, at the price of room seen one
    /// scrape later. Returns whether some ended (the caller runs a
    /// release).
    pub fn peer_moves(
        &self,
        moves: impl IntoIterator<Item = (EndpointId, u32, u32)>,
        read_at: Instant,
        lag: Duration,
    ) -> bool {
        let mut g = self.inner.lock();
        let mut ended = false;
        let ended_at = read_at.checked_sub(lag).unwrap_or(read_at);
        for (id, placed, done) in moves {
            if placed == 0 && done == 0 {
                continue;
            }
            let m = g.peer.entry(id).or_default();
            if placed > 0 {
                m.placed.push(read_at, placed);
            }
            if done > 0 {
                m.ended.push(ended_at, done);
                ended = true;
            }
        }
        ended
    }

    /// Released picks whose charge waits for their report.
    pub fn charges_open(&self) -> usize {
        self.inner.lock().charges.len()
    }

    /// The endpoints of `loads` below the threshold now (picks in transit
    /// not counted): where a released pick is placed.
    pub fn with_room(
        &self,
        loads: &[(EndpointId, LoadView)],
        thresholds: &SaturationThresholds,
        now: Instant,
    ) -> Vec<EndpointId> {
        let mut g = self.inner.lock();
        let since = since_scrape(&mut g, loads, now);
        loads
            .iter()
            .zip(since)
            .filter(|((_, v), s)| {
                v.healthy
                    && has_room(
                        estimate::engine_saturation(v, *s, 0, &self.scale(thresholds)),
                        self.config.threshold,
                    )
            })
            .map(|((id, _), _)| *id)
            .collect()
    }

    /// The pool's saturation for flow control (see the module docs); not a
    /// number when no endpoint is healthy.
    fn saturation(
        &self,
        g: &mut Inner,
        loads: &[(EndpointId, LoadView)],
        thresholds: &SaturationThresholds,
        now: Instant,
    ) -> f64 {
        self.freest(g, loads, thresholds, now).1
    }

    /// The endpoint a pick released now finds the most room on (picks in
    /// transit placed first), and the pool's saturation for flow control
    /// (its saturation; not a number when no endpoint is healthy).
    fn freest(
        &self,
        g: &mut Inner,
        loads: &[(EndpointId, LoadView)],
        thresholds: &SaturationThresholds,
        now: Instant,
    ) -> (Option<EndpointId>, f64) {
        let since = since_scrape(g, loads, now);
        let healthy: Vec<(EndpointId, &LoadView, Since)> = loads
            .iter()
            .zip(since)
            .filter(|((_, v), _)| v.healthy)
            .map(|((id, v), p)| (*id, v, p))
            .collect();
        let views: Vec<(&LoadView, Since)> = healthy.iter().map(|(_, v, p)| (*v, *p)).collect();
        let transit = (
            self.in_transit(),
            self.in_transit.tokens.load(Ordering::Acquire),
        );
        match estimate::freest(
            &views,
            transit,
            &self.scale(thresholds),
            self.config.threshold,
        ) {
            Some((i, sat)) => (Some(healthy[i].0), sat),
            None => (None, f64::NAN),
        }
    }

    fn scale<'t>(&self, thresholds: &'t SaturationThresholds) -> estimate::Scale<'t> {
        estimate::Scale {
            thresholds,
            saturated_prefill_tokens: self.config.saturated_prefill_tokens,
        }
    }
}

/// Keeps a placed pick's charge for its report, forgetting the oldest past
/// [`MAX_CHARGES`] or older than [`CHARGE_TTL`] (and ids settled already,
/// met on the way); a forgotten charge's work leaves its tenant's share.
fn remember_charge(g: &mut Inner, shares: &Mutex<Shares>, c: Charge, now: Instant) {
    while let Some(old) = g.charge_order.front() {
        let stale = match g.charges.get(old) {
            Some(o) => g.charges.len() >= MAX_CHARGES || now.duration_since(o.at) > CHARGE_TTL,
            None => true,
        };
        if !stale {
            break;
        }
        if let Some(o) = g
            .charge_order
            .pop_front()
            .and_then(|id| g.charges.remove(&id))
        {
            shares.lock().end(&o.tenant, o.tokens);
        }
    }
    // (Settled ids stay in the order until met; it is bounded by twice
    // the map's size, compacted when it passes it.)
    if g.charge_order.len() >= 2 * MAX_CHARGES {
        let Inner {
            charges,
            charge_order,
            ..
        } = g;
        charge_order.retain(|id| charges.contains_key(id));
    }
    g.charge_order.push_back(c.request_id.clone());
    if let Some(old) = g.charges.insert(c.request_id.clone(), c) {
        // A request id seen twice: the first pick's report will not come
        // apart from the second's.
        shares.lock().end(&old.tenant, old.tokens);
    }
}

/// Adds a waiting pick's tokens to its tenant's.
fn track(tokens: &mut HashMap<String, u64>, tenant: &str, n: u64) {
    *tokens.entry(tenant.to_string()).or_default() += n;
}

/// Takes a pick that left the queue out of its tenant's tokens.
fn untrack(tokens: &mut HashMap<String, u64>, tenant: &str, n: u64) {
    if let Some(t) = tokens.get_mut(tenant) {
        *t = t.saturating_sub(n);
        if *t == 0 {
            tokens.remove(tenant);
        }
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;

#[cfg(test)]
#[path = "quickest_tests.rs"]
mod quickest_tests;
