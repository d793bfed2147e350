//! What the root context and every request of one VM share: the
//! configuration, the pools' last known saturation and the stats sink, with
//! the bookkeeping of `PoolState` polls ([`Polls`]: when, and which are
//! out) and report dispatches.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use kvasir_policy::PoolStates;

use crate::pick;
use crate::settings::PluginConfig;
use crate::stats::{pool_stat, Stats};

/// State shared by the root context and every request of one VM.
pub struct Shared {
    /// The configuration.
    pub config: PluginConfig,
    /// Pool saturation as last learned (from picks and `PoolState` polls).
    pub pools: RefCell<PoolStates>,
    /// Where stats go.
    pub stats: Rc<dyn Stats>,
    /// The ids this VM gives the requests it picks for.
    pub request_ids: RequestIds,
}

impl Shared {
    /// Shared state for a configuration (request ids from seed 0: see
    /// [`Shared::with_id_seed`]).
    pub fn new(config: PluginConfig, stats: Rc<dyn Stats>) -> Shared {
        let pools = RefCell::new(PoolStates::new(&config.policy));
        Shared {
            config,
            pools,
            stats,
            request_ids: RequestIds::new(0),
        }
    }

    /// The same, with request ids from `seed` (random per VM, so that no
    /// two VMs of any Envoy give the same ids).
    pub fn with_id_seed(mut self, seed: u64) -> Shared {
        self.request_ids = RequestIds::new(seed);
        self
    }

    /// Records a pool's saturation (from a pick or a poll) and its gauge.
    pub fn learn_saturation(&self, pool_index: usize, saturation: f64, now_ns: u64) {
        self.pools
            .borrow_mut()
            .update(pool_index, saturation, now_ns / 1_000_000);
        if let Some(p) = self.config.policy.pools().get(pool_index) {
            let permille = (saturation.clamp(0.0, 1.0) * 1000.0).round() as u64;
            self.stats
                .gauge(&pool_stat(&p.name, "saturation_permille"), permille);
        }
    }

    /// The `PoolState` polls the root context's timer makes: (indexer
    /// cluster, pool index, encoded request, timeout ms).
    pub fn pool_state_polls(&self) -> Vec<(String, usize, Vec<u8>, u32)> {
        let cfg = &self.config.policy;
        cfg.pools_needing_state()
            .filter_map(|i| cfg.pools().get(i).map(|p| (i, p)))
            .map(|(i, p)| {
                (
                    p.indexer_cluster.clone(),
                    i,
                    pick::pool_state_request(&p.indexer_pool),
                    p.indexer_timeout_ms.max(100),
                )
            })
            .collect()
    }

    /// Counts a report dispatch (`report.sent` / `report.dispatch_failed`).
    pub fn count_report(&self, pool_name: &str, sent: bool) {
        let what = if sent {
            "report.sent"
        } else {
            "report.dispatch_failed"
        };
        self.stats.count(&pool_stat(pool_name, what), 1);
    }

    /// A `PoolState` answer for pool `pool_index`.
    pub fn on_pool_state(&self, pool_index: usize, status: u32, body: Option<&[u8]>, now_ns: u64) {
        let name = self
            .config
            .policy
            .pools()
            .get(pool_index)
            .map(|p| p.name.clone())
            .unwrap_or_default();
        match pick::pool_state_saturation(status, body) {
            Some(s) => {
                self.learn_saturation(pool_index, s, now_ns);
                self.stats.count(&pool_stat(&name, "state_poll.ok"), 1);
            }
            None => self.stats.count(&pool_stat(&name, "state_poll.error"), 1),
        }
    }
}

/// The ids the filter gives requests, for the indexer's accounting (budget
/// reservations, in-flight load): `<seed>-<n>`, unique per VM by its
/// random seed and per request by a counter. Never a client's header: a
/// client repeating an `x-request-id` would otherwise share one
/// reservation among many requests.
#[derive(Debug)]
pub struct RequestIds {
    seed: String,
    next: Cell<u64>,
}

impl RequestIds {
    /// Ids under `seed`.
    pub fn new(seed: u64) -> RequestIds {
        RequestIds {
            seed: format!("{seed:016x}"),
            next: Cell::new(0),
        }
    }

    /// The next id.
    pub fn next(&self) -> String {
        let n = self.next.get();
        self.next.set(n.wrapping_add(1));
        format!("{}-{n:x}", self.seed)
    }
}

/// The root context's `PoolState` polls: every period, at most one out
/// per pool (a slow indexer is not asked again before it answered).
#[derive(Debug, Default)]
pub struct Polls {
    period_ms: u64,
    next_ns: u64,
    /// Call token -> pool index.
    out: HashMap<u32, usize>,
}

impl Polls {
    /// A (re)configuration: polls every `period_ms` if some policy needs
    /// a pool's state, else none.
    pub fn configure(&mut self, needed: bool, period_ms: u32) {
        self.period_ms = if needed { u64::from(period_ms) } else { 0 };
    }

    /// The poll period (ms, 0 = no polls).
    pub fn period_ms(&self) -> u64 {
        self.period_ms
    }

    /// Whether polls are due on this tick; if so, the next are due a
    /// period later. `clock` (ns) is read only with polls on.
    pub fn due(&mut self, clock: impl FnOnce() -> u64) -> bool {
        if self.period_ms == 0 {
            return false;
        }
        let now = clock();
        if now < self.next_ns {
            return false;
        }
        self.next_ns = now + self.period_ms * 1_000_000;
        true
    }

    /// Whether `pool`'s last poll is still out (then it is skipped).
    pub fn out(&self, pool: usize) -> bool {
        self.out.values().any(|&p| p == pool)
    }

    /// A poll of `pool` was dispatched under `token`.
    pub fn sent(&mut self, token: u32, pool: usize) {
        self.out.insert(token, pool);
    }

    /// The pool a call's answer is for; `None`: not a poll.
    pub fn answered(&mut self, token: u32) -> Option<usize> {
        self.out.remove(&token)
    }
}

#[cfg(test)]
mod tests {
    use super::{Polls, RequestIds};

    #[test]
    fn request_ids_differ_by_seed_and_by_request() {
        let a = RequestIds::new(0xabc);
        assert_eq!(a.next(), "0000000000000abc-0");
        assert_eq!(a.next(), "0000000000000abc-1");
        assert_ne!(RequestIds::new(1).next(), RequestIds::new(2).next());
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn polls_run_every_period_with_one_out_per_pool() {
        let mut p = Polls::default();
        assert!(!p.due(|| panic!("no polls: the clock is not read")));
        p.configure(false, 250);
        assert_eq!(p.period_ms(), 0, "no policy needs a pool's state");
        assert!(!p.due(|| panic!("not read")));
        p.configure(true, 250);
        assert_eq!(p.period_ms(), 250);
        assert!(p.due(|| 10 * MS));
        assert!(!p.due(|| 259 * MS), "a period later, not before");
        assert!(p.due(|| 260 * MS));
        p.sent(3, 0);
        assert!(p.out(0) && !p.out(1));
        assert_eq!(p.answered(9), None, "not a poll");
        assert_eq!(p.answered(3), Some(0));
        assert!(!p.out(0));
        assert_eq!(p.answered(3), None, "answered once");
    }
}
