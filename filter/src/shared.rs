//! What the root context and every request of one VM share: the
//! configuration, the pools' last known saturation and the stats sink, with
//! the bookkeeping of `PoolState` polls and report dispatches.

use std::cell::RefCell;
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
}

impl Shared {
    /// Shared state for a configuration.
    pub fn new(config: PluginConfig, stats: Rc<dyn Stats>) -> Shared {
        let pools = RefCell::new(PoolStates::new(&config.policy));
        Shared {
            config,
            pools,
            stats,
        }
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
