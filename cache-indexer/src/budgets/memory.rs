//! The in-process budget store: key -> `TenantBudget` + `OutputEstimate`,
//! and request id -> key for the reports. One mutex: every operation is a
//! few map lookups and integer arithmetic.
//!
//! Lost reports: a reservation whose end is never reported expires after
//! its key's max age (the longest in-flight timeout of the pools that
//! reserved under the key), keeping what it holds (`TenantBudget::expire`).
//! Expiry runs lazily, at most once a second, on the next reservation or
//! report.

use std::any::Any;
use std::collections::HashMap;

use futures::future::{self, BoxFuture};
use kvasir_budget::{
    Cost, OutputEstimate, RateLimitHeaders, Released, Request, TenantBudget, Usage, WINDOW_MS,
};
use parking_lot::Mutex;

use super::{Ask, BudgetMetrics, Report, ReportOp, Reported, Reserved, Store, IDLE_MS};

/// How often the lazy sweep runs, at most.
const SWEEP_EVERY_MS: u64 = 1_000;

/// One open reservation of a key.
#[derive(Debug, Clone, Copy)]
struct Open {
    id: u64,
    since_ms: u64,
    held: Cost,
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// One key's state.
#[derive(Debug)]
struct Key {
    budget: TenantBudget,
    estimate: OutputEstimate,
    default_output: u64,
    max_age_ms: u64,
    last_used_ms: u64,
    open: HashMap<String, Open>,
}

impl Key {
    fn new(ask: &Ask) -> Key {
        Key {
            budget: TenantBudget::new(ask.limits),
            estimate: OutputEstimate::new(ask.default_output_tokens),
            default_output: ask.default_output_tokens,
            max_age_ms: ask.max_age_ms,
            last_used_ms: 0,
            open: HashMap::new(),
        }
    }

    /// Takes the pick's config: limits, default output, max age.
    fn configure(&mut self, ask: &Ask) {
        if self.budget.limits() != &ask.limits {
            self.budget.set_limits(ask.limits);
        }
        // A new default matters only until something is learned.
        if self.default_output != ask.default_output_tokens && self.estimate.samples() == 0 {
            self.estimate = OutputEstimate::new(ask.default_output_tokens);
            self.default_output = ask.default_output_tokens;
        }
        self.max_age_ms = self.max_age_ms.max(ask.max_age_ms);
    }

    /// Drops the reservations older than the key's max age; how many.
    fn expire(&mut self, now_ms: u64, by_request: &mut HashMap<String, String>) -> usize {
        let max_age = self.max_age_ms;
        self.open.retain(|rid, o| {
            let keep = now_ms.saturating_sub(o.since_ms) <= max_age;
            if !keep {
                by_request.remove(rid);
            }
            keep
        });
        self.budget.expire(now_ms, max_age)
    }
}

#[derive(Debug, Default)]
struct State {
    keys: HashMap<String, Key>,
    by_request: HashMap<String, String>,
    last_sweep_ms: Option<u64>,
}

/// Budgets in this process.
#[derive(Debug)]
pub(super) struct MemoryStore {
    state: Mutex<State>,
    max_keys: usize,
    max_open: usize,
}

impl MemoryStore {
    pub(super) fn new(max_keys: usize, max_open: usize) -> Self {
        MemoryStore {
            state: Mutex::new(State::default()),
            max_keys: max_keys.max(1),
            max_open: max_open.max(1),
        }
    }

    pub(super) fn open(&self) -> usize {
        self.state.lock().by_request.len()
    }

    pub(super) fn keys(&self) -> usize {
        self.state.lock().keys.len()
    }

    pub(super) fn reserve(&self, now: u64, ask: &Ask, metrics: &BudgetMetrics) -> Reserved {
        let mut st = self.state.lock();
        st.sweep_due(now, metrics);
        if let Some(r) = st.repeated(now, ask) {
            return r;
        }
        if !st.keys.contains_key(&ask.key) && st.keys.len() >= self.max_keys {
            // Make room: keys with nothing in flight, unused for a window.
            st.sweep(now, WINDOW_MS, metrics);
            if st.keys.len() >= self.max_keys {
                return Reserved::Untracked;
            }
        }
        if st.by_request.len() >= self.max_open {
            match st.evict_oldest(now) {
                0 => return Reserved::Untracked,
                n => metrics.evicted.add(n as u64),
            }
        }
        let State {
            keys, by_request, ..
        } = &mut *st;
        let key = keys.entry(ask.key.clone()).or_insert_with(|| Key::new(ask));
        key.configure(ask);
        key.last_used_ms = now;
        let req = Request {
            prompt_tokens: ask.prompt_tokens,
            cached_tokens: ask.cached_tokens.min(ask.prompt_tokens),
            output_tokens: key.estimate.estimate(ask.max_tokens),
        };
        match key.budget.reserve(now, &req) {
            Ok(r) => {
                key.open.insert(
                    ask.request_id.clone(),
                    Open {
                        id: r.id,
                        since_ms: now,
                        held: r.held,
                        prompt_tokens: req.prompt_tokens,
                        cached_tokens: req.cached_tokens,
                    },
                );
                by_request.insert(ask.request_id.clone(), ask.key.clone());
                Reserved::Admitted {
                    held: r.held,
                    headers: RateLimitHeaders::of(&key.budget, now),
                    repeated: false,
                }
            }
            Err(refusal) => Reserved::Limited {
                refusal,
                headers: RateLimitHeaders::of(&key.budget, now),
            },
        }
    }

    /// A report, after the sweep when one is due (the memory store's own
    /// path; the Redis store's local fallback sweeps on reservations).
    pub(super) fn report_swept(&self, now: u64, rep: &Report, metrics: &BudgetMetrics) -> Reported {
        self.state.lock().sweep_due(now, metrics);
        self.report(now, rep)
    }

    pub(super) fn report(&self, now: u64, rep: &Report) -> Reported {
        let mut st = self.state.lock();
        let State {
            keys, by_request, ..
        } = &mut *st;
        // The request id is the truth here; a report naming another key
        // (a filter bug) still settles the request it names.
        let Some(name) = by_request.get(&rep.request_id).cloned() else {
            return charge_unreserved(keys, now, rep);
        };
        let Some(key) = keys.get_mut(&name) else {
            by_request.remove(&rep.request_id);
            return Reported::default();
        };
        let Some(open) = key.open.get(&rep.request_id).copied() else {
            by_request.remove(&rep.request_id);
            return Reported::default();
        };
        key.last_used_ms = now;
        let mut out = Reported {
            key: Some(name),
            ..Reported::default()
        };
        match rep.op {
            ReportOp::Settle(usage) => {
                out.charged = key.budget.settle(now, open.id, &usage).unwrap_or_default();
                if let Some(o) = key.open.get_mut(&rep.request_id) {
                    o.held = o.held.saturating_add(out.charged);
                }
                return out;
            }
            ReportOp::Release { usage, train, .. } => {
                // Without usage the prompt counts as reserved (the engine
                // may have computed it) and the completion as last settled.
                let u = usage.unwrap_or(Usage {
                    prompt_tokens: open.prompt_tokens,
                    cached_tokens: open.cached_tokens,
                    completion_tokens: 0,
                });
                if let Some(r) = key.budget.release(now, open.id, &u) {
                    out.charged = r.charged;
                    out.refunded = r.refunded;
                    out.settled = Some(final_cost(&open, &r));
                }
                if let (true, Some(u)) = (train, usage) {
                    key.estimate.observe(u.completion_tokens);
                }
            }
            ReportOp::Cancel => {
                out.refunded = key.budget.cancel(now, open.id).unwrap_or_default();
            }
        }
        key.open.remove(&rep.request_id);
        by_request.remove(&rep.request_id);
        out
    }
}

/// The end of a request the filter admitted itself, with no reservation
/// open under its id: its usage is charged to its key, if the key is
/// known here (its limits came with an earlier pick).
/// Never awaits: each future is ready on its first poll.
impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn reserve<'a>(
        &'a self,
        now_ms: u64,
        ask: &'a Ask,
        metrics: &'a BudgetMetrics,
    ) -> BoxFuture<'a, Reserved> {
        Box::pin(future::ready(MemoryStore::reserve(
            self, now_ms, ask, metrics,
        )))
    }

    fn report<'a>(
        &'a self,
        now_ms: u64,
        rep: &'a Report,
        metrics: &'a BudgetMetrics,
    ) -> BoxFuture<'a, Reported> {
        Box::pin(future::ready(self.report_swept(now_ms, rep, metrics)))
    }

    fn open_reservations(&self) -> usize {
        self.open()
    }

    fn keys(&self) -> usize {
        MemoryStore::keys(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn charge_unreserved(keys: &mut HashMap<String, Key>, now: u64, rep: &Report) -> Reported {
    let (
        ReportOp::Release {
            usage: Some(usage),
            local: true,
            ..
        },
        Some(name),
    ) = (rep.op, rep.key.as_ref())
    else {
        return Reported::default();
    };
    let Some(key) = keys.get_mut(name) else {
        return Reported::default();
    };
    key.last_used_ms = now;
    let charged = key.budget.charge(now, &usage);
    Reported {
        key: Some(name.clone()),
        charged,
        settled: Some(charged),
        unreserved: true,
        ..Reported::default()
    }
}

/// A released request's final cost: what it held (admission plus
/// settles) less the refund plus the overrun.
fn final_cost(open: &Open, r: &Released) -> Cost {
    open.held
        .saturating_sub(r.refunded)
        .saturating_add(r.charged)
}

impl State {
    /// Sweeps when the last sweep is a second old.
    fn sweep_due(&mut self, now: u64, metrics: &BudgetMetrics) {
        if self
            .last_sweep_ms
            .is_none_or(|t| now >= t.saturating_add(SWEEP_EVERY_MS))
        {
            self.sweep(now, IDLE_MS, metrics);
        }
    }

    /// Expires lost reservations and forgets keys with nothing in flight
    /// unused for `idle_ms`.
    fn sweep(&mut self, now: u64, idle_ms: u64, metrics: &BudgetMetrics) {
        self.last_sweep_ms = Some(now);
        let State {
            keys, by_request, ..
        } = self;
        let mut expired = 0;
        keys.retain(|_, k| {
            expired += k.expire(now, by_request);
            !(k.open.is_empty() && now.saturating_sub(k.last_used_ms) >= idle_ms)
        });
        metrics.expired.add(expired as u64);
    }

    /// The same request picked again while its reservation is open: admit
    /// it without taking more. A request id open under another key is
    /// cancelled first (it was never served under that one).
    fn repeated(&mut self, now: u64, ask: &Ask) -> Option<Reserved> {
        let name = self.by_request.get(&ask.request_id)?.clone();
        let key = self.keys.get_mut(&name)?;
        let open = *key.open.get(&ask.request_id)?;
        if name == ask.key {
            return Some(Reserved::Admitted {
                held: open.held,
                headers: RateLimitHeaders::of(&key.budget, now),
                repeated: true,
            });
        }
        key.budget.cancel(now, open.id);
        key.open.remove(&ask.request_id);
        self.by_request.remove(&ask.request_id);
        None
    }

    /// Drops the oldest open reservation (it keeps its charge, as an
    /// expired one); how many were dropped (ties go together; 0 when none
    /// could be).
    fn evict_oldest(&mut self, now: u64) -> usize {
        let oldest = self
            .keys
            .iter()
            .flat_map(|(name, k)| k.open.values().map(move |o| (o.since_ms, name)))
            .min();
        let Some((since, name)) = oldest.map(|(s, n)| (s, n.clone())) else {
            return 0;
        };
        let age = now.saturating_sub(since);
        if age == 0 {
            return 0;
        }
        let Some(key) = self.keys.get_mut(&name) else {
            return 0;
        };
        // Everything of this key at least as old as the oldest (ties).
        let by_request = &mut self.by_request;
        key.open.retain(|rid, o| {
            let keep = o.since_ms > since;
            if !keep {
                by_request.remove(rid);
            }
            keep
        });
        key.budget.expire(now, age - 1)
    }
}
